"""Fashion-MNIST small enough to travel to a lent GPU machine, and whole again there.

The working tree that travels to the device machine is capped at 64 MiB; the repository
is about 47 MB and the training images 26 MB. For timing runs (``--compute sleep``,
where the data only shapes the gradients' sparsity) the first N training images travel
and are tiled back to the 60,000 the task checks for:

    python bench/fashion_subset.py cut /usr/share/datasets/fashion-mnist .devcarry/fsub 10000
    python3 bench/fashion_subset.py tile .devcarry/fsub /tmp/fashion   # on the device machine
    DATA_DIR=/tmp/fashion bash bench/sparse_cores16.sh OUT

The test files travel as they are. Written for ``bench/sparse_cores16.sh``'s runs
(docs/sparse.md, "On sixteen cores, three more pairs and pacing"); not for quality runs.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

TRAIN = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
TEST = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
FULL = 60_000


def _header(raw: bytes) -> tuple[int, list[int]]:
    """The header's length and the dimensions of an IDX file's bytes."""
    dims = raw[3]
    return 4 + 4 * dims, [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]


def _with_rows(raw: bytes, rows: int, body: bytes) -> bytes:
    """An IDX file of ``rows`` first-axis entries holding ``body``."""
    _, dims = _header(raw)
    dims[0] = rows
    return raw[:4] + b"".join(d.to_bytes(4, "big") for d in dims) + body


def cut(source: Path, target: Path, count: int) -> None:
    """Write the first ``count`` training entries of ``source``'s files (and its test
    files as they are) to ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in TRAIN:
        raw = gzip.decompress((source / name).read_bytes())
        length, dims = _header(raw)
        if count > dims[0] or FULL % count:
            raise SystemExit(f"count must divide {FULL} and be at most {dims[0]}, got {count}")
        item = (len(raw) - length) // dims[0]
        body = raw[length : length + count * item]
        (target / name).write_bytes(gzip.compress(_with_rows(raw, count, body), compresslevel=9))
    for name in TEST:
        shutil.copy(source / name, target / name)


def tile(source: Path, target: Path) -> None:
    """Repeat ``source``'s training entries up to 60,000 into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in TRAIN:
        raw = gzip.decompress((source / name).read_bytes())
        length, dims = _header(raw)
        if FULL % dims[0]:
            raise SystemExit(f"{source / name}: {dims[0]} entries do not divide {FULL}")
        body = raw[length:] * (FULL // dims[0])
        (target / name).write_bytes(gzip.compress(_with_rows(raw, FULL, body), compresslevel=1))
    for name in TEST:
        shutil.copy(source / name, target / name)


def main() -> None:
    """``cut SOURCE TARGET COUNT`` or ``tile SOURCE TARGET``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cutting = commands.add_parser("cut", help="keep the first COUNT training entries")
    cutting.add_argument("source", type=Path)
    cutting.add_argument("target", type=Path)
    cutting.add_argument("count", type=int)
    tiling = commands.add_parser("tile", help="repeat the training entries to 60,000")
    tiling.add_argument("source", type=Path)
    tiling.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.command == "cut":
        cut(args.source, args.target, args.count)
    else:
        tile(args.source, args.target)


if __name__ == "__main__":
    main()
