"""Bit packing: small unsigned codes (1, 2, 4 or 8 bits each) into uint8 bytes and back.

``pack(codes, bits)`` stores ``8 // bits`` codes per byte, first code in the lowest bits;
the last byte is padded with zeros. ``unpack(packed, bits, count)`` is its inverse.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPPORTED_BITS = (1, 2, 4, 8)


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` codes of ``bits`` bits."""
    _check_bits(bits)
    per_byte = 8 // bits
    return (count + per_byte - 1) // per_byte


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack a 1-D integer tensor of codes in ``[0, 2**bits)`` into a uint8 tensor."""
    _check_bits(bits)
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    per_byte = 8 // bits
    count = codes.numel()
    padded = packed_size(count, bits) * per_byte
    if padded != count:
        codes = torch.cat([codes, codes.new_zeros(padded - count)])
    lanes = codes.view(-1, per_byte)
    out = lanes[:, 0].clone()
    for lane in range(1, per_byte):
        out.bitwise_or_(lanes[:, lane].bitwise_left_shift(lane * bits))
    return out


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


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits per code must be one of {SUPPORTED_BITS}, got {bits!r}")
