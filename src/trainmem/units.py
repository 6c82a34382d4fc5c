"""Memory units. trainmem counts bytes as ``int`` everywhere and converts only when rendering.

GiB (2**30) is the default because that is what ``torch.cuda.max_memory_allocated()`` users and
``nvidia-smi`` (MiB) think in; GB (10**9) is what the seed article and vendor spec sheets use.
"""

from __future__ import annotations

from .errors import ConfigError

UNIT_BYTES: dict[str, int] = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
DEFAULT_UNIT = "GiB"


def parse_unit(name: str) -> str:
    """Return the canonical spelling of a unit name (case-insensitive), or raise ConfigError."""
    for unit in UNIT_BYTES:
        if unit.lower() == name.strip().lower():
            return unit
    raise ConfigError(f"unknown unit {name!r}; accepted: {', '.join(UNIT_BYTES)}")


def to_unit(num_bytes: int | float, unit: str = DEFAULT_UNIT) -> float:
    return num_bytes / UNIT_BYTES[unit]


def format_bytes(num_bytes: int | float, unit: str = DEFAULT_UNIT, digits: int = 2) -> str:
    """``format_bytes(2**30) == '1.00 GiB'``: the unit is always printed."""
    return f"{to_unit(num_bytes, unit):,.{digits}f} {unit}"


def format_count(n: int) -> str:
    """Human parameter count: 6738415616 -> '6.74B'."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)
