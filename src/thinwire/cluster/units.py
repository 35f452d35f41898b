"""Link rates, delays and sizes as people write them: ``"100mbit"``, ``"50ms"``, ``"8GiB"``.

Used wherever a bandwidth or a latency comes from a user: the emulated cluster, the
benchmark and the cost model.
"""

from __future__ import annotations

import re

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str | float | None) -> float | None:
    """Bits per second from ``"100mbit"``, ``"10Mbit"``, ``"1gbit"`` or a number;
    ``None``, ``"unlimited"`` and ``0`` mean no limit."""
    if text is None or text in ("unlimited", "none", 0, "0"):
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _RATE_UNITS:
            raise ValueError(
                f"bandwidth {text!r} is not understood; write a number and a unit, e.g. "
                f"10mbit, 100mbit, 1gbit (units: {', '.join(_RATE_UNITS)}), or 'unlimited'"
            )
        value = float(match.group(1)) * _RATE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"bandwidth must be > 0 bits per second, got {text!r}")
    return value


def parse_duration(text: str | float, what: str = "latency", most_s: float = 10.0) -> float:
    """Seconds from ``"1ms"``, ``"50ms"``, ``"200us"``, ``"5s"``, ``"0"`` or a number of
    seconds; ``what`` names the value in errors, which refuse more than ``most_s``."""
    if isinstance(text, (int, float)):
        value = float(text)
    elif text.strip() == "0":
        value = 0.0
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
        if not match or match.group(2) not in _TIME_UNITS:
            raise ValueError(
                f"{what} {text!r} is not understood as a duration; write a number and a unit, "
                f"e.g. 1ms, 50ms, 200us, 5s (units: {', '.join(_TIME_UNITS)})"
            )
        value = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if not 0 <= value <= most_s:
        raise ValueError(f"{what} must be between 0 and {most_s:g} s, got {text!r}")
    return value


_BYTE_UNITS = {
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"2GB"`` or a number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = (match.group(2) or "b").lower() if match else ""
        if not match or unit not in _BYTE_UNITS:
            raise ValueError(
                f"memory {text!r} is not understood; write a number and a unit, e.g. 8GiB, "
                f"512MiB, 2GB (units: KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )
        value = float(match.group(1)) * _BYTE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory must be > 0 bytes, got {text!r}")
    return int(value)
