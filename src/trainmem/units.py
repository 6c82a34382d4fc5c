"""Memory units. trainmem counts bytes as ``int`` everywhere and converts only when rendering.

GiB (2**30) is the default because that is what ``torch.cuda.max_memory_allocated()`` users and
``nvidia-smi`` (MiB) think in; GB (10**9) is what the seed article and vendor spec sheets use.
"""

from __future__ import annotations

import re

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
    """``format_bytes(2**30) == '1.00 GiB'``: the unit is always printed. Bytes are whole: ``format_bytes(1234, "B")
    == '1,234 B'`` (no ``.00``; a fractional count is rounded)."""
    if unit == "B":
        return f"{round(num_bytes):,} B"
    return f"{to_unit(num_bytes, unit):,.{digits}f} {unit}"


MAX_MEMORY_BYTES = 2**50
"""The largest memory :func:`parse_size` takes (1 PiB), far above any accelerator."""

_SIZE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: object, what: str = "gpu-memory") -> int:
    """A memory size in bytes (see :func:`parse_sized`)."""
    return parse_sized(value, what)[0]


def parse_sized(value: object, what: str = "gpu-memory") -> tuple[int, str]:
    """A memory size and how to show it (``"48 GiB"``): the bytes from ``"48GiB"``, ``"48 GB"``, ``"49140MiB"``, ``"51539607552"`` (plain bytes) or an
    int of bytes; positive, finite and at most :data:`MAX_MEMORY_BYTES`, else one ConfigError naming ``what``."""
    accepted = f"give a positive size such as 48GiB, 80GB, 49140MiB or a whole number of bytes (units: " \
               f"{', '.join(UNIT_BYTES)})"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what} must be a size such as '48GiB' or an integer of bytes, got "
                          f"{type(value).__name__} {value!r}")
    if isinstance(value, int):
        number: int | float = value
        unit = "B"
    else:
        match = _SIZE.match(value) if len(value) <= 100 else None
        if match is None:
            raise ConfigError(f"{what}: {value[:100]!r} is not a size; {accepted}")
        text, unit_text = match.group(1).replace("_", "").replace(",", ""), match.group(2) or "B"
        try:
            unit = parse_unit(unit_text)
        except ConfigError:
            raise ConfigError(f"{what}: unknown unit {unit_text!r} in {value!r}; {accepted}") from None
        if unit == "B" and not re.fullmatch(r"[0-9]+", text):
            raise ConfigError(f"{what}: {value!r} is not a whole number of bytes; {accepted}")
        number = int(text) if re.fullmatch(r"[0-9]+", text) else float(text)
    if isinstance(number, float) and not number < float(MAX_MEMORY_BYTES):  # (inf and NaN fail here)
        raise ConfigError(f"{what} must be at most {MAX_MEMORY_BYTES:,} bytes (1 PiB), got {value!r}")
    nbytes = round(number * UNIT_BYTES[unit]) if isinstance(number, float) else number * UNIT_BYTES[unit]
    if not 0 < nbytes <= MAX_MEMORY_BYTES:
        raise ConfigError(f"{what} must be positive and at most {MAX_MEMORY_BYTES:,} bytes (1 PiB), got {value!r}")
    if unit != "B":
        label = f"{number:g} {unit}"
    elif nbytes % 2**30 == 0:
        label = f"{nbytes // 2**30:,} GiB"
    else:
        label = format_bytes(nbytes, "GiB")
    return nbytes, label


def format_count(n: int) -> str:
    """Human parameter count: 6738415616 -> '6.74B'."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)
