"""A reader for IDX files (the MNIST family's format), plain or gzip-compressed.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the values in C order, big-endian.

    images = read_idx("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

#: IDX type code -> NumPy dtype (big-endian, as the format stores them)
IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"


class IDXFormatError(ValueError):
    """A file is not a well-formed IDX file; the message names the file and the fault."""


def read_idx(path: str | Path) -> np.ndarray:
    """The array stored in the IDX file at ``path`` (gzip-compressed or not), native order.

    Raises :class:`IDXFormatError` naming the file when the compression, the magic
    number, the dimensions or the payload length are wrong.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise IDXFormatError(f"{path}: corrupt gzip stream ({error})") from None
    return parse_idx(raw, source=str(path))


def parse_idx(raw: bytes, source: str = "<bytes>") -> np.ndarray:
    """The array encoded by the uncompressed IDX bytes ``raw`` (``source`` names them in errors)."""
    if len(raw) < 4:
        raise IDXFormatError(f"{source}: {len(raw)} bytes, too short for an IDX header")
    zero0, zero1, type_code, ndim = raw[:4]
    if zero0 != 0 or zero1 != 0 or type_code not in IDX_TYPES:
        raise IDXFormatError(
            f"{source}: bad IDX magic number 0x{raw[:4].hex()} (expected 0x0000TTDD with "
            f"type TT in {', '.join(f'0x{c:02x}' for c in IDX_TYPES)})"
        )
    if ndim == 0:
        raise IDXFormatError(f"{source}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IDXFormatError(f"{source}: truncated header ({ndim} dimensions need {header} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_TYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise IDXFormatError(
            f"{source}: payload is {len(raw) - header} bytes but shape {shape} of "
            f"{dtype.name} needs {expected}"
        )
    values = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return values.astype(dtype.newbyteorder("="))
