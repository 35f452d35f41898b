"""Bit packing: small unsigned codes (1, 2, 4 or 8 bits each) into uint8 bytes and back.

``pack(codes, bits)`` stores ``8 // bits`` codes per byte, first code in the lowest bits;
the last byte is padded with zeros. ``unpack(packed, bits, count)`` is its inverse, and
``decode(packed, bits, values, out)`` writes ``values[code]`` for every packed code straight
into ``out``, which is how the quantizers turn payloads back into gradients without a
full-size temporary.

Every step is a whole-tensor torch op on bytes read through wider integer views, so a
25 M-code tensor packs in a few milliseconds:

* 1 and 2 bits: one multiplication gathers the codes of a 64-bit word of code bytes into
  one byte (1 bit) or two (2 bits), shown at :data:`GATHER`. The partial products land on
  distinct bits, so nothing carries into the bytes that are kept (the product wraps
  around 2**64 above them, which changes nothing below).
* 4 bits: ``word | word >> 4`` puts codes ``2i`` and ``2i + 1`` into byte ``2i``.
* decode: ``index_select`` of the rows of a table holding the values of the codes in every
  possible byte (2-bit codes of long tensors: every pair of bytes), 8 values per row.

The word views assume little-endian byte order, that of every machine torch ships for;
elsewhere packing takes one shift per code lane instead.

:class:`OutputBuffers` keeps the quantizers' full-size outputs from one exchange to the
next, because a fresh 100 MB tensor costs more to allocate than to fill.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import Tensor

SUPPORTED_BITS = (1, 2, 4, 8)

#: bits per code -> (multiplier, kept bytes of each 64-bit product): code ``i`` of the
#: word's 8 code bytes goes to bit ``8 * 7 + i`` (1 bit), or to bit ``8 * 3 + 2 * i`` of
#: bytes 3 and 7 (2 bits: ``i`` < 4 and ``i`` >= 4).
GATHER = {
    1: (sum(1 << (7 * k) for k in range(1, 9)), slice(7, 8)),
    2: (sum(1 << (6 * k) for k in range(1, 5)), slice(3, 8, 4)),
}

#: Values per call in the loops over long tensors on the CPU (4 MiB of fp32: cache-sized
#: pieces).
CHUNK = 1 << 20
#: ... and on a GPU, where each call is a few kernel launches and no cache is to be fitted:
#: whole gradients in one piece (scratch bounded at 128 MiB of fp32).
GPU_CHUNK = 1 << 25

_LITTLE_ENDIAN = sys.byteorder == "little"


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` codes of ``bits`` bits."""
    _check_bits(bits)
    per_byte = 8 // bits
    return (count + per_byte - 1) // per_byte


def pack(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """Pack a 1-D tensor of codes in ``[0, 2**bits)`` (integers or bools) into uint8,
    into ``out`` (``packed_size`` bytes) if given."""
    _check_bits(bits)
    codes = codes.reshape(-1)
    count = codes.numel()
    if out is None:
        out = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=codes.device)
    elif out.numel() != packed_size(count, bits) or out.dtype != torch.uint8:
        raise ValueError(
            f"out must be {packed_size(count, bits)} uint8 bytes for {count} codes of "
            f"{bits} bits, got {out.numel()} {out.dtype}"
        )
    if bits == 8:
        return out.copy_(codes)
    if codes.dtype not in (torch.uint8, torch.bool) or count % 8 or not _word_aligned(codes):
        padded = torch.zeros(-(-count // 8) * 8, dtype=torch.uint8, device=codes.device)
        padded[:count] = codes
        codes = padded
    if not _LITTLE_ENDIAN:
        return _pack_by_lanes(codes.view(torch.uint8), bits, out)
    words = codes.view(torch.int64)  # 8 code bytes per word
    if bits == 4:
        words = words | (words >> 4)
        return out.copy_(words.view(torch.uint8)[::2][: out.numel()])
    multiplier, kept = GATHER[bits]
    gathered = (words * multiplier).view(torch.uint8).view(-1, 8)[:, kept]
    return out.copy_(gathered.reshape(-1)[: out.numel()])


def unpack(packed: Tensor, bits: int, count: int) -> Tensor:
    """Unpack ``count`` codes of ``bits`` bits from a uint8 tensor made by :func:`pack`."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 8:
        return packed[:count].clone()
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    lanes = packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(mask)
    return lanes.reshape(-1)[:count]


def decode(packed: Tensor, bits: int, values: Tensor, out: Tensor, add: bool = False) -> Tensor:
    """``out[i] = values[code i]`` for the ``out.numel()`` codes in ``packed`` (``out += ...``
    with ``add``); ``values`` holds one value per code, ``2**bits`` of them.

    ``out`` must be contiguous and 1-D; nothing of its size is allocated on the way.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    count = out.numel()
    values = values.to(out.dtype)
    per_byte = 8 // bits
    # 2-bit codes of long tensors: one table row per pair of bytes (8 values per row, as
    # for 1-bit codes), worth its 64 Ki rows from about a million codes on.
    pairs = bits == 2 and count >= CHUNK
    width = 2 if pairs else 1
    per_row = per_byte * width
    rows = count // per_row
    table = values[_byte_codes(bits, values.device, pairs)]  # (byte values, per_row)
    body = out[: rows * per_row].view(rows, per_row)
    step = max(1, min(rows, chunk_for(out.device) // per_row))
    index = torch.empty(step, dtype=torch.int64, device=out.device)  # reused per chunk
    decoded = torch.empty(step if add else 0, per_row, dtype=out.dtype, device=out.device)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        rows_of = _row_index(packed[lo * width : hi * width], pairs, out=index[: hi - lo])
        if add:
            body[lo:hi].add_(torch.index_select(table, 0, rows_of, out=decoded[: hi - lo]))
        else:
            torch.index_select(table, 0, rows_of, out=body[lo:hi])
    done = rows * per_row
    if done < count:
        tail = values[unpack(packed[done // per_byte :], bits, count - done).long()]
        if add:
            out[done:].add_(tail)
        else:
            out[done:].copy_(tail)
    return out


class OutputBuffers:
    """Full-size output tensors kept per tensor key, reused by the next exchange of the key.

    The first write to a fresh large tensor makes the operating system map and zero every
    page: about 60 ms for 100 MB on a 2-core CPU, against 8 ms to fill a tensor that is
    already mapped. So ``mean`` and ``local`` go into the buffers of the last exchange of
    the same key, provided nothing outside this object still refers to their memory (a
    view, a reshape or a detached alias all count; the engine and the front ends copy the
    mean into the gradient and drop both before the next step). While a caller holds one,
    a new buffer is allocated and kept instead, so nobody sees a returned tensor change.
    Buffers are scratch, never checkpoint state.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], Tensor] = {}

    def take(self, key: str, name: str, like: Tensor) -> Tensor:
        """A contiguous tensor of ``like``'s shape, dtype and device for output ``name`` of
        tensor ``key``: the kept one if nobody else refers to it, else a new one."""
        kept = self._kept.get((key, name))
        if (
            kept is None
            or kept.shape != like.shape
            or kept.dtype != like.dtype
            or kept.device != like.device
            or not _unreferenced(kept)
        ):
            kept = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self._kept[(key, name)] = kept
        return kept


class ScratchBuffer:
    """One scratch tensor reused from call to call, grown when a call needs more.

    For work space that never leaves the function using it (a block of decoded values,
    the magnitudes a selection ranks): allocated once per size class, not per call.
    """

    def __init__(self) -> None:
        self._kept: Tensor | None = None

    @property
    def capacity(self) -> int:
        """Values the kept tensor holds (0 before the first call)."""
        return 0 if self._kept is None else self._kept.numel()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``numel`` values of ``dtype`` on ``device``; contents are left over, not zeroed."""
        kept = self._kept
        if kept is None or kept.numel() < numel or kept.dtype != dtype or kept.device != device:
            kept = torch.empty(numel, dtype=dtype, device=device)
            self._kept = kept
        return kept[:numel]


def _unreferenced(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the only tensor using its memory (a bare storage object from
    ``untyped_storage()`` is not seen: hold a tensor). Without torch's storage use count,
    a private helper, nothing counts as unreferenced, and outputs are always fresh."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # references: ``tensor`` itself and the storage object made for the question
    return bool(use_count(tensor.untyped_storage()._cdata) <= 2)


def chunk_for(device: torch.device) -> int:
    """Values per call in the loops over long tensors on ``device``."""
    return CHUNK if device.type == "cpu" else GPU_CHUNK


def chunks(count: int, size: int = CHUNK) -> Iterator[slice]:
    """Consecutive slices of at most ``size`` (a multiple of 8) covering ``range(count)``."""
    for start in range(0, count, size):
        yield slice(start, min(count, start + size))


def _row_index(packed: Tensor, pairs: bool, out: Tensor) -> Tensor:
    """Table rows for packed bytes, into ``out``: the byte itself, or each pair of bytes as
    the unsigned 16-bit number they spell in memory."""
    if not pairs:
        return out.copy_(packed)
    if packed.storage_offset() % 2:
        packed = packed.clone()  # a gathered payload may start at an odd byte
    return out.copy_(packed.view(torch.uint16))


def _word_aligned(codes: Tensor) -> bool:
    """Whether ``codes`` (bytes) can be viewed as 64-bit words."""
    return codes.is_contiguous() and codes.storage_offset() % 8 == 0


_CODE_TABLES: dict[tuple[int, bool, torch.device], Tensor] = {}


def _byte_codes(bits: int, device: torch.device, pairs: bool = False) -> Tensor:
    """int64 ``(256, 8 // bits)`` table of the codes in every byte value, or with ``pairs``
    ``(65536, 16 // bits)`` for every pair of bytes as :func:`_row_index` numbers it."""
    key = (bits, pairs, torch.device(device))
    table = _CODE_TABLES.get(key)
    if table is None:
        if pairs:  # row r: the bytes of the uint16 r as they lie in memory
            row_bytes = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16)
            byte_values = row_bytes.view(torch.uint8).view(-1, 2).long()
        else:
            byte_values = torch.arange(256).view(-1, 1)
        shifts = torch.arange(0, 8, bits)
        codes = (byte_values.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        table = codes.reshape(byte_values.shape[0], -1).to(device)
        _CODE_TABLES[key] = table
    return table


def _pack_by_lanes(codes: Tensor, bits: int, out: Tensor) -> Tensor:
    """:func:`pack` without word views (big-endian machines): one shift per code lane."""
    lanes = codes.view(-1, 8 // bits)
    packed = lanes[:, 0].clone()
    for lane in range(1, 8 // bits):
        packed.bitwise_or_(lanes[:, lane].bitwise_left_shift(lane * bits))
    return out.copy_(packed[: out.numel()])


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits per code must be one of {SUPPORTED_BITS}, got {bits!r}")
