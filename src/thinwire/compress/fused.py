"""DGC's threshold selection in fewer kernels on a GPU, with Triton where it is installed.

The threshold selection (:mod:`thinwire.compress.dgc`) spends most of its GPU time passing
over the whole tensor: ``|v|`` written out, then compared with the threshold, then the
passes scanned. Two kernels here take over what PyTorch does in several:

* :func:`mark_at_least` writes ``|v| >= max(t, tiny)`` in one pass (reads ``v``, writes
  the mask), where PyTorch writes ``|v|`` (the tensor's size again) and reads it back;
* :func:`take_found` turns ``torch.nonzero_static``'s padded positions into the sent
  (index, value) pairs, an empty slot repeating the first index with the value 0, in one
  kernel instead of four.

Both give the same bits as the PyTorch operations they replace (the comparison is made in
float32, into which every float16 and bfloat16 value converts exactly). They run on CUDA
tensors when Triton imports; elsewhere the callers keep PyTorch's operations. The tests
run them on CPU tensors through Triton's interpreter (:data:`ON_CPU`, with
``TRITON_INTERPRET=1`` set before Triton is first imported: ``tests/conftest.py``).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import Tensor

#: Triton and its language, imported at the first kernel (``None`` until then). The
#: kernels' language must be a global of their module for Triton's interpreter.
triton: Any = None
tl: Any = None

#: whether the kernels also run on CPU tensors, through Triton's interpreter (the tests:
#: ``TRITON_INTERPRET=1`` must be set before Triton is first imported)
ON_CPU = False


@functools.cache
def triton_modules() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, or ``None`` where Triton does not import."""
    try:
        import triton as triton_module
        import triton.language as language
    except ImportError:
        return None
    return triton_module, language


#: values each Triton program handles
BLOCK = 1024


@functools.cache
def _kernels() -> Any:
    """The Triton kernels, defined on first use (``None`` where Triton does not import).

    Defined lazily so that ``TRITON_INTERPRET``, read when a kernel is defined, is read
    at the first call rather than at import."""
    global triton, tl
    modules = triton_modules()
    if modules is None:
        return None
    triton, tl = modules

    @triton.jit
    def mark_at_least_kernel(
        v_ptr,
        t_ptr,
        out_ptr,
        n,
        tiny,
        BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        v = tl.load(v_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        t = tl.maximum(tl.load(t_ptr).to(tl.float32), tiny)
        tl.store(out_ptr + offsets, tl.abs(v) >= t, mask=inside)

    @triton.jit
    def take_found_kernel(v_ptr, found_ptr, index_ptr, value_ptr, k, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < k
        found = tl.load(found_ptr + offsets, mask=inside, other=-1)
        first = tl.maximum(tl.load(found_ptr), 0)
        ok = found >= 0
        index = tl.where(ok, found, first)
        value = tl.load(v_ptr + index, mask=inside, other=0.0)
        tl.store(index_ptr + offsets, index, mask=inside)
        tl.store(value_ptr + offsets, tl.where(ok, value, 0.0), mask=inside)

    return triton, mark_at_least_kernel, take_found_kernel


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: per device, whether the kernels passed their first-use check there
_checked: dict[str, bool] = {}


def available(device: torch.device) -> bool:
    """Whether the fused kernels run for tensors on ``device``: CUDA with Triton, or the
    CPU under Triton's interpreter where :data:`ON_CPU` asks for it; and, the first time
    for each device, whether they compile there and give PyTorch's results
    (:func:`_works_on`)."""
    on_cpu = device.type == "cpu" and ON_CPU and interpreting()
    if device.type != "cuda" and not on_cpu:
        return False
    if triton_modules() is None:
        return False
    works = _checked.get(str(device))
    if works is None:
        works = _checked[str(device)] = _works_on(device)
    return works


def forget_checks() -> None:
    """Check the kernels again at their next use (tests)."""
    _checked.clear()


def _works_on(device: torch.device) -> bool:
    """Run each kernel once on a small tensor against PyTorch's operations. Where Triton
    cannot build them (no C compiler, a GPU it does not support) or they disagree, warn
    once: DGC's selection then keeps PyTorch's operations on that device."""
    from thinwire.compress import fused_segments

    try:
        flat = torch.randn(3000, generator=torch.Generator().manual_seed(0)).to(device)
        flat[:100] = 0.0
        threshold = torch.tensor(0.5, device=device)
        passed = mark_at_least(flat, threshold)
        found_at = torch.nonzero_static(passed, size=2500, fill_value=-1).view(-1)
        indices, values = take_found(flat, found_at)
        tables = fused_segments.SegmentTables([1000, 2000], [10, 20])
        thresholds = torch.tensor([0.5, 1.0], device=device)
        picked, _ = fused_segments.pick_segments(flat, thresholds, tables)
        found = found_at >= 0
        expected_indices = torch.where(found, found_at, found_at[:1].clamp_min(0))
        first = (flat[:1000].abs() >= 0.5).nonzero().view(-1)[:10]
        second = (flat[1000:].abs() >= 1.0).nonzero().view(-1)[:20] + 1000
        same = (
            torch.equal(passed, flat.abs() >= threshold)
            and torch.equal(indices, expected_indices)
            and torch.equal(values, torch.where(found, flat[expected_indices], 0.0))
            and torch.equal(picked, torch.cat([first, second]))
        )
    except Exception as error:  # any failure to build or run: PyTorch's operations instead
        _warn(device, f"they failed: {type(error).__name__}: {str(error)[:300]}")
        return False
    if not same:
        _warn(device, "they disagreed with PyTorch's operations")
        return False
    return True


def _warn(device: torch.device, what: str) -> None:
    warnings.warn(
        f"thinwire: Triton's kernels for DGC's selection on {device}: {what}; the selection "
        "uses PyTorch's operations there (the same pairs, slower)",
        RuntimeWarning,
        stacklevel=3,
    )


def mark_at_least(flat: Tensor, threshold: Tensor, out: Tensor | None = None) -> Tensor:
    """``|flat| >= max(threshold, tiny)`` in one pass, into ``out`` (a bool tensor of
    ``flat``'s length; made when not given). ``threshold``: a 0-d tensor on ``flat``'s
    device; ``tiny``: the smallest normal value of ``flat``'s dtype (a zero carries
    nothing)."""
    kernel = _kernels()[1]
    n = flat.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.bool, device=flat.device)
    if threshold.numel() != 1:
        raise ValueError(f"mark_at_least takes one threshold, got {threshold.numel()}")
    tiny = torch.finfo(flat.dtype).tiny
    kernel[(triton.cdiv(n, BLOCK),)](flat, threshold, out, n, tiny, BLOCK=BLOCK)
    return out


def take_found(flat: Tensor, found_at: Tensor) -> tuple[Tensor, Tensor]:
    """The (indices, values) of ``found_at``'s positions of ``flat``: where a position is
    -1 (an empty slot of ``torch.nonzero_static``), the first position (0 if none) and
    the value 0."""
    kernel = _kernels()[2]
    k = found_at.numel()
    indices = torch.empty(k, dtype=torch.int64, device=flat.device)
    values = torch.empty(k, dtype=flat.dtype, device=flat.device)
    kernel[(triton.cdiv(k, BLOCK),)](flat, found_at, indices, values, k, BLOCK=BLOCK)
    return indices, values
