"""The layout docs/architecture.md describes holds: who may import whom, no private names
imported across packages, no source file over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "thinwire"

#: what ``import thinwire`` (the public API) brings in
PUBLIC_API = {"auto", "checkpoint", "comm", "compress", "data_parallel", "errors", "parallel"}
_TRANSPORT = {"comm", "compress", "errors"}
_LIBRARY = _TRANSPORT | {"data_parallel", "parallel", "integrations", "strategies", "checkpoint"}

#: each part of thinwire and the parts it may import (besides itself): docs/architecture.md
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "exit_grace": set(),
    "compress": {"errors"},
    "comm": {"compress", "errors"},
    "data_parallel": _TRANSPORT,
    "parallel": _TRANSPORT | {"data_parallel"},
    "strategies": _TRANSPORT | {"data_parallel"},
    "integrations": _TRANSPORT | {"data_parallel"},
    "checkpoint": {"data_parallel", "errors"},
    "tasks": PUBLIC_API,  # digits_training: a loop on the public API
    "cluster": {"errors"},
    "auto": _LIBRARY | {"tasks", "cluster", "launch", "plan"},
    "launch": {"cluster", "errors"},
    "plan": _LIBRARY | {"tasks", "cluster", "launch"},
    "bench": _LIBRARY | {"tasks", "cluster", "launch", "plan", "auto"},
    "demo": _LIBRARY | {"tasks", "cluster", "launch", "plan", "bench", "auto"},
    "cli": _LIBRARY | {"tasks", "cluster", "launch", "plan", "bench", "demo", "auto"},
    "__init__": PUBLIC_API | {"exit_grace"},  # imported for its exit handler
}


def _part(path: Path) -> str:
    """The part of thinwire a source file belongs to (its subpackage, or its module)."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every thinwire import in ``path`` (names: those taken from
    the module with ``from ... import``; empty for ``import module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "thinwire":
                found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "thinwire"]
    return found


def _target(module: str) -> set[str]:
    parts = module.split(".")
    return PUBLIC_API if len(parts) == 1 else {parts[1]}


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_is_known() -> None:
    assert {_part(p) for p in SOURCES} <= set(ALLOWED), "add the new part to ALLOWED and the doc"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_dependency_rule(path: Path) -> None:
    part = _part(path)
    for module, _ in _imports(path):
        forbidden = _target(module) - ALLOWED[part] - {part}
        assert not forbidden, f"{part} may not import {module} (docs/architecture.md)"


def _package_of_module(module: str) -> str:
    """The package a dotted module name lies in (a package is its own)."""
    is_package = (PACKAGE.parent / module.replace(".", "/")).is_dir()
    return module if is_package else module.rsplit(".", 1)[0]


def _package_of_file(path: Path) -> str:
    """The package of a file in thinwire ("" for tests and bench scripts)."""
    if PACKAGE not in path.parents:
        return ""
    return ".".join(path.relative_to(PACKAGE.parent).parts[:-1])


def test_no_private_name_is_imported_from_another_package() -> None:
    offenders = []
    for path in [*SOURCES, *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_")]
            if private and _package_of_module(module) != _package_of_file(path):
                offenders.append(f"{path.relative_to(ROOT)}: {module}.{', '.join(private)}")
    assert not offenders, "\n".join(offenders)


def test_no_source_file_is_over_500_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in [*SOURCES, *(ROOT / "bench").glob("*.py")]
        if (n := len(p.read_text().splitlines())) > 500
    ]
    assert not long, "split these by what they do:\n" + "\n".join(long)


def test_the_rule_catches_a_forbidden_import(tmp_path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("from thinwire.data_parallel.ddp_hook import register\nimport thinwire\n")
    targets = set().union(*(_target(m) for m, _ in _imports(module)))
    expected = {"auto", "checkpoint", "data_parallel", "parallel"}
    assert targets - ALLOWED["comm"] - {"comm"} == expected


def test_data_parallel_code_starts_without_the_hybrid_half_and_every_public_name_resolves():
    """A data-parallel rank (the DDP hook, the wrappers, the bench's worker) never imports
    DTensor, pipelining or ``torch._dynamo``: they double the CPU its imports take.
    ``thinwire.<name>`` still gives every public name, imported on first use."""
    import subprocess
    import sys

    script = (
        "import sys, thinwire, thinwire.data_parallel, thinwire.launch, thinwire.bench.worker\n"
        "heavy = ('torch.distributed.tensor', 'torch.distributed.pipelining', 'torch._dynamo')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "print(sorted(n for n in thinwire.__all__ if getattr(thinwire, n).__name__ != n))\n"
        "print(sorted(set(thinwire.__all__) ^ set(thinwire._HOMES)))\n"
        "try:\n    thinwire.no_such_name\nexcept AttributeError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[]",
        "[]",
        "[]",
        "module 'thinwire' has no attribute 'no_such_name'",
    ], done.stdout
