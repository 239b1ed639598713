"""Parsing and printing of memory sizes, bandwidths and durations given on the command line."""

from __future__ import annotations

import math
import re

from optmem.errors import OptmemInputError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


def parse_size(text: str | int, *, field: str = "memory") -> int:
    """Parse ``16``, ``4GiB``, ``512MB``, ``1.5G`` into an integer number of bytes (units).

    Examples
    --------
    >>> parse_size("4GiB"), parse_size("512MB"), parse_size(16)
    (4294967296, 512000000, 16)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise OptmemInputError(f"expected a non-negative size, got {text}", field=field)
        return text
    m = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", str(text).strip())
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise OptmemInputError(
            f"expected a size like 16, 4GiB or 512MB, got {text!r}", field=field)
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not math.isfinite(value):  # '9' * 400 overflows to inf
        raise OptmemInputError(f"size {text!r} is too large", field=field)
    return int(value)


def parse_bandwidth(text: str | float, *, time_unit: str = "ms", field: str = "bandwidth") -> float:
    """Parse a bandwidth into bytes per chain time unit.

    ``12GB/s`` with a chain in milliseconds gives ``12e6`` bytes per ms; a bare number is
    taken as bytes per chain time unit already.

    Examples
    --------
    >>> parse_bandwidth("12GB/s", time_unit="ms")
    12000000.0
    >>> parse_bandwidth("250")
    250.0
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip()
        size, sep, per = raw.partition("/")
        if sep:
            if per.lower() not in _TIME_UNITS:
                raise OptmemInputError(f"expected a rate like 12GB/s, got {text!r}", field=field)
            if time_unit not in _TIME_UNITS:
                raise OptmemInputError(
                    f"cannot convert {text!r}: the chain's time unit {time_unit!r} is not one "
                    f"of {', '.join(_TIME_UNITS)}", field=field)
            value = parse_size(size, field=field) / _TIME_UNITS[per.lower()] \
                * _TIME_UNITS[time_unit]
        else:
            try:
                value = float(raw)
            except ValueError:
                raise OptmemInputError(
                    f"expected a bandwidth like 12GB/s or a number, got {text!r}",
                    field=field) from None
    if not value >= 0 or value == float("inf"):
        raise OptmemInputError(f"expected a finite non-negative bandwidth, got {text!r}",
                               field=field)
    return value


def format_size(n: float) -> str:
    """Human-readable size in binary units (``1.5 GiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
