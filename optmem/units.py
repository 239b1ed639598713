"""The one input contract for memory sizes and bandwidths (Python API and CLI alike).

Every memory limit of optmem (``CheckpointProblem(chain, M)``, ``OffloadProblem``,
``RematOffloadProblem``, ``PipelineProblem(memory_per_gpu=M)``, ``MinPeakProblem``,
``solve``/``compare``/``sweep``, the torch bridge's ``memory_limit``, ``--memory``) goes
through :func:`memory_size`: an ``int``, a numpy integer, an integral ``float`` (``2e9``) or a
size string (``"2GiB"``, ``"512MB"``, ``"1.5GiB"``, ``"16"``). Fractional bytes, negatives,
NaN, infinities, booleans and anything else raise one :class:`OptmemInputError` naming the
field.

Every bandwidth goes through :func:`rate_per_second` and :func:`chain_rate`: a number is
**memory units (bytes) per second**, a string is a rate such as ``"12GB/s"``, ``"500MiB/s"``,
``"2e6B/ms"`` or a bare number (bytes per second, as in Python); :func:`chain_rate`
converts it to the chain's units (memory units per chain time unit, what the models and the
simulator use), which needs the chain's ``time_unit`` to be one of ``s``, ``ms``, ``us``,
``ns``.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from numbers import Integral, Real
from typing import Any

import numpy as np

from optmem.errors import OptmemInputError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
MAX_SIZE = 2**62  # sizes beyond this overflow the int64 arithmetic of the DPs
MemoryLike = int | float | str
"""What a memory limit may be given as (numpy integers and floats too)."""
RateLike = float | int | str
"""What a bandwidth may be given as (memory units per second, or a rate string)."""

_SIZE_EXAMPLE = "a size like 16, 4GiB, 512MB or 1.5GiB (a whole number of bytes)"


def memory_size(value: Any, *, field: str = "memory_limit") -> int:
    """Normalise a memory size to a non-negative integer number of bytes (memory units).

    Parameters
    ----------
    value
        An ``int``, a numpy integer, an integral ``float`` (``2e9``) or a size string
        (``"2GiB"``, ``"512MB"``, ``"1.5GiB"``, ``"16"``; ``k``/``M``/``G``/``T`` alone are
        binary units, ``kB``/``MB``/... decimal).
    field
        The name of the field, for the error message.

    Raises
    ------
    OptmemInputError
        For a boolean, a negative, fractional, NaN or infinite value, a value above 2^62,
        or anything else (one message naming ``field``).

    Examples
    --------
    >>> memory_size("4GiB"), memory_size("512MB"), memory_size(2e9), memory_size("1.5GiB")
    (4294967296, 512000000, 2000000000, 1610612736)
    >>> memory_size("2.7")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'memory_limit': expected a whole number of bytes...
    """
    if isinstance(value, bool | np.bool_):
        raise OptmemInputError(f"expected {_SIZE_EXAMPLE}, got the boolean {value!r}",
                               field=field)
    if isinstance(value, Integral):
        exact = Decimal(int(value))
    elif isinstance(value, Real):
        number = float(value)
        if not math.isfinite(number):
            raise OptmemInputError(f"expected a finite size, got {value!r}", field=field)
        exact = Decimal(number)
    elif isinstance(value, str):
        exact = _parse_size_text(value, field)
    else:
        raise OptmemInputError(f"expected {_SIZE_EXAMPLE}, got {value!r}", field=field)
    if exact < 0:
        raise OptmemInputError(f"expected a non-negative size, got {value!r}", field=field)
    if exact != exact.to_integral_value():
        raise OptmemInputError(f"expected a whole number of bytes, got {value!r} "
                               f"({exact.normalize():f} bytes)", field=field)
    if exact > MAX_SIZE:
        raise OptmemInputError(f"size {value!r} is too large (above 2^62 bytes)", field=field)
    return int(exact)


def memory_percent(value: Any, *, field: str = "memory_limit") -> Decimal | None:
    """The fraction a relative limit ``"60%"`` asks for (``None`` for anything else).

    A relative limit is a percentage of the chain's store-all peak
    (:meth:`optmem.chain.Chain.store_all_peak`): ``"60%"`` is ``0.6`` of it. Values that do
    not end in ``%`` are left to :func:`memory_size`.

    Raises
    ------
    OptmemInputError
        For a percentage that is not a finite number above 0 (``"0%"``, ``"-5%"``, ``"x%"``).

    Examples
    --------
    >>> memory_percent("60%"), memory_percent(" 12.5 % "), memory_percent("4GiB")
    (Decimal('0.6'), Decimal('0.125'), None)
    """
    if not isinstance(value, str) or not value.strip().endswith("%"):
        return None
    m = re.fullmatch(_NUMBER + r"\s*%", value.strip())
    number = Decimal(m.group(1)) if m else None
    if number is None or not number.is_finite() or number <= 0 or number.adjusted() > 6:
        raise OptmemInputError(f"expected a percentage of the store-all peak above 0 such as "
                               f"60%, got {value!r}", field=field)
    return number / 100


def relative_memory(value: Any, store_all_peak: int, *, field: str = "memory_limit") -> int:
    """A limit in bytes (units): a size, or a percentage of ``store_all_peak`` rounded down.

    Examples
    --------
    >>> relative_memory("60%", 1000), relative_memory("33.3%", 10), relative_memory("2KiB", 7)
    (600, 3, 2048)
    """
    fraction = memory_percent(value, field=field)
    if fraction is None:
        return memory_size(value, field=field)
    return int((fraction * store_all_peak).to_integral_value(rounding="ROUND_FLOOR"))


def _parse_size_text(text: str, field: str) -> Decimal:
    m = re.fullmatch(r"([+-]?)" + _NUMBER + r"\s*([a-zA-Z]*)", text.strip())
    if not m or m.group(3).lower() not in _SIZE_UNITS:
        raise OptmemInputError(f"expected {_SIZE_EXAMPLE}, got {text!r}", field=field)
    try:
        number = Decimal(m.group(2))
    except InvalidOperation:  # pragma: no cover - the pattern only lets numbers through
        raise OptmemInputError(f"expected {_SIZE_EXAMPLE}, got {text!r}", field=field) from None
    if number.adjusted() > 30:
        raise OptmemInputError(f"size {text!r} is too large (above 2^62 bytes)", field=field)
    sign = -1 if m.group(1) == "-" else 1
    return sign * number * _SIZE_UNITS[m.group(3).lower()]


def parse_size(text: Any, *, field: str = "memory") -> int:
    """Parse ``16``, ``4GiB``, ``512MB``, ``1.5G`` into an integer number of bytes (units).

    The same as :func:`memory_size` (kept for the CLI's ``--memory`` and older callers).

    Examples
    --------
    >>> parse_size("4GiB"), parse_size("512MB"), parse_size(16)
    (4294967296, 512000000, 16)
    """
    return memory_size(text, field=field)


def rate_per_second(value: Any, *, field: str = "bandwidth", allow_inf: bool = False) -> float:
    """Normalise a bandwidth to memory units (bytes) per second.

    Parameters
    ----------
    value
        A number (memory units per second; numpy numbers too) or a string: a rate
        ``"12GB/s"``, ``"500MiB/s"``, ``"2e6B/ms"``, or a bare number (per second).
    field
        Field name for the error message.
    allow_inf
        Accept ``inf`` (``math.inf``, ``"inf"``, ``"none"``): free transfers (pipelines).

    Raises
    ------
    OptmemInputError
        For a boolean, a negative, NaN (or infinite unless ``allow_inf``) value, a size
        without ``/time`` (``"12GB"``) or an unknown unit.

    Examples
    --------
    >>> rate_per_second("12GB/s"), rate_per_second(12e9), rate_per_second("12e6B/ms")
    (12000000000.0, 12000000000.0, 12000000000.0)
    """
    if isinstance(value, bool | np.bool_):
        raise OptmemInputError(f"expected a bandwidth like 12GB/s or a number of bytes per "
                               f"second, got the boolean {value!r}", field=field)
    if isinstance(value, Real):
        rate = float(value)
    elif isinstance(value, str):
        rate = _parse_rate_text(value, field, allow_inf)
    else:
        raise OptmemInputError(f"expected a bandwidth like 12GB/s or a number of bytes per "
                               f"second, got {value!r}", field=field)
    if math.isnan(rate) or rate < 0 or (math.isinf(rate) and not allow_inf):
        finite = "" if allow_inf else "finite "
        raise OptmemInputError(f"expected a {finite}non-negative bandwidth, got {value!r}",
                               field=field)
    return rate


def _parse_rate_text(text: str, field: str, allow_inf: bool) -> float:
    raw = text.strip()
    if allow_inf and raw.lower() in ("inf", "infinity", "none"):
        return math.inf
    size, sep, per = raw.partition("/")
    if not sep:
        try:
            return float(Decimal(raw)) if re.fullmatch(r"[+-]?" + _NUMBER, raw) else \
                _bad_rate(text, field)
        except InvalidOperation:  # pragma: no cover
            return _bad_rate(text, field)
    if per.strip().lower() not in TIME_UNITS:
        return _bad_rate(text, field)
    m = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", size.strip())
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        return _bad_rate(text, field)
    per_unit = float(Decimal(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    return per_unit / TIME_UNITS[per.strip().lower()]


def _bad_rate(text: str, field: str) -> float:
    raise OptmemInputError(f"expected a bandwidth like 12GB/s, 500MiB/s or a number of bytes "
                           f"per second, got {text!r}", field=field)


def seconds_per(time_unit: str, *, field: str = "bandwidth") -> float:
    """Seconds in one chain time unit (``ms`` -> 1e-3); raise for a unit that is no time."""
    if time_unit not in TIME_UNITS:
        raise OptmemInputError(
            f"cannot convert a bandwidth per second to the chain's time unit {time_unit!r} "
            f"(expected one of {', '.join(TIME_UNITS)}); give the bandwidth in chain units "
            f"(memory units per chain time unit: chain_bandwidth=... in Python, "
            f"--chain-bandwidth on the command line)", field=field)
    return TIME_UNITS[time_unit]


def chain_rate(value: Any, time_unit: str, *, field: str = "bandwidth",
               allow_inf: bool = False) -> float:
    """A bandwidth (see :func:`rate_per_second`) in memory units per chain time unit.

    Examples
    --------
    >>> chain_rate("12GB/s", "ms"), chain_rate(12e9, "ms"), chain_rate("250", "s")
    (12000000.0, 12000000.0, 250.0)
    """
    rate = rate_per_second(value, field=field, allow_inf=allow_inf)
    if rate == 0 or math.isinf(rate):
        return rate
    return rate * seconds_per(time_unit, field=field)


def parse_bandwidth(text: Any, *, time_unit: str = "ms", field: str = "bandwidth") -> float:
    """Parse a bandwidth into memory units per chain time unit (see :func:`chain_rate`).

    A bare number means memory units (bytes) per second, as everywhere in optmem.

    Examples
    --------
    >>> parse_bandwidth("12GB/s", time_unit="ms")
    12000000.0
    >>> parse_bandwidth("250000", time_unit="ms")
    250.0
    """
    return chain_rate(text, time_unit, field=field)


def chain_bandwidth_value(value: Any, *, field: str = "chain_bandwidth",
                          allow_inf: bool = False) -> float:
    """Check a bandwidth given directly in chain units (memory units per chain time unit)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real):
        raise OptmemInputError(f"expected a number of memory units per chain time unit, got "
                               f"{value!r}", field=field)
    rate = float(value)
    if math.isnan(rate) or rate < 0 or (math.isinf(rate) and not allow_inf):
        finite = "" if allow_inf else "finite "
        raise OptmemInputError(f"expected a {finite}non-negative bandwidth, got {value!r}",
                               field=field)
    return rate


def parse_chain_bandwidth(value: Any, *, field: str = "chain_bandwidth",
                          allow_inf: bool = False) -> float:
    """:func:`chain_bandwidth_value` of a number or its text (the CLI's ``--chain-bandwidth``).

    A string is a plain decimal number (``"1.5e3"``; ``"inf"`` where ``allow_inf``): memory
    units per chain time unit, without units, since the chain's own units are meant.

    Examples
    --------
    >>> parse_chain_bandwidth("2.5"), parse_chain_bandwidth("inf", allow_inf=True)
    (2.5, inf)
    >>> parse_chain_bandwidth("12GB/s")
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'chain_bandwidth': expected a number of memory \
units per chain time unit, got '12GB/s' (a rate with units is --bandwidth / bandwidth=)
    """
    if isinstance(value, str):
        raw = value.strip()
        if allow_inf and raw.lower() in ("inf", "infinity"):
            return math.inf
        if not re.fullmatch(r"[+-]?" + _NUMBER, raw):
            raise OptmemInputError(f"expected a number of memory units per chain time unit, "
                                   f"got {value!r} (a rate with units is --bandwidth / "
                                   f"bandwidth=)", field=field)
        value = float(Decimal(raw))
    return chain_bandwidth_value(value, field=field, allow_inf=allow_inf)


def format_size(n: float) -> str:
    """Human-readable size in binary units (``1.5 GiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
