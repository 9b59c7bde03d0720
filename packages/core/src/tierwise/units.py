"""Byte sizes as people write them ("8GiB", "512MB", 1 << 30) and back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Parse ``value`` into a byte count; raise ValueError saying what was wrong."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a byte count like 8GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{what}: {value} is negative; give a byte count like 8GiB")
        if value != int(value):
            raise ValueError(
                f"{what}: {value} is not a whole number of bytes; give an integer byte count "
                "or a size with a unit, e.g. 3.5GiB"
            )
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{what}: cannot read {value!r} as a size; write e.g. 8GiB, 512MiB, 2GB or 1073741824"
        )
    if _UNITS[unit] == 1 and not match.group(1).isdigit():
        raise ValueError(
            f"{what}: {value!r} is not a whole number of bytes; a number without a unit is a "
            f"byte count: give an integer, or a unit, e.g. {match.group(1)}GiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_gib(n: float) -> str:
    """Bytes as GiB for messages people read (``format_bytes`` below 1 GiB)."""
    if abs(n) < 1024**3:
        return format_bytes(n)
    return f"{n / 1024**3:.2f} GiB"
