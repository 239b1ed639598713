"""Checked numeric ``extra`` options of the solvers (one clear error for a bad value).

Examples
--------
>>> from optmem.result import SolveOptions
>>> positive_int(SolveOptions(extra={"sweeps": 2}), "sweeps", 1)
2
>>> positive_float(SolveOptions(), "benders_work", 10.0)
10.0
>>> flag(SolveOptions(extra={"relaxation_deadlines": False}), "relaxation_deadlines", True)
False
>>> choice(SolveOptions(extra={"phase2": "ilp"}), "phase2", "cpsat", ("cpsat", "ilp"))
'ilp'
>>> one_or_all(SolveOptions(), "prefetch", ("alap", "lazy"))
('alap', 'lazy')
>>> fraction(SolveOptions(extra={"proof_gap": 0.01}), "proof_gap")
0.01
"""

from __future__ import annotations

from collections.abc import Sequence

from optmem.errors import OptmemInputError
from optmem.result import SolveOptions

__all__ = ["WORK_COUNT_MAX", "check_work_count", "choice", "flag", "one_or_all",
           "positive_float", "positive_int", "fraction"]

WORK_COUNT_MAX: dict[str, int] = {
    "transfers_per_gap": 100,  # transfer positions per gap: the model grows linearly
    "grid": 1_000_000,  # remat-offload DP memory values (checkpoint slots go to 2e6)
    "backlog_grid": 10_000,  # DP backlog values: the DP's states grow with grid x backlog
    "autocapper_values": 10_000,  # one DP solve per cap value
    "madpipe_iterations": 10_000,  # one phase-1 DP run per iteration
    "chunks": 1_000,  # runs of layers per GPU (a chain has far fewer useful ones)
    "family_limit": 2_000_000,  # allocations asked by the chunk scan's complete family
    "benders_iterations": 100_000,  # one master solve per iteration
    "lns": 100_000,  # pipeline: one CP-SAT move each (remat-offload's lns is a flag)
    "lns_windows": 100_000,  # one window solve each
    "lns_width": 100_000,  # backward phases per window (clamped to the chain)
    "lns_step": 100_000,  # backward phases from one window to the next
}
"""The largest value of each integer work count of ``SolveOptions.extra``.

A method's work grows with these counts (solves, DP runs, model size), so a value far above
any real use (``2**70``) would run for ever: :func:`positive_int` refuses more than the
bound with one :class:`~optmem.errors.OptmemInputError` naming the option (CLI exit 2).
``sweeps`` is bounded by the model it builds instead (``MAX_SLOTS`` compute slots).
"""


def positive_int(options: SolveOptions, key: str, default: int) -> int:
    """``options.extra[key]`` (else ``default``) as an integer >= 1 (``bool`` refused).

    Raises
    ------
    OptmemInputError
        For a value that is not an integer >= 1, or one above ``WORK_COUNT_MAX[key]``
        (keys of :data:`WORK_COUNT_MAX`), naming ``key``.
    """
    value = options.extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptmemInputError(f"expected a positive integer {key}, got {value!r}", field=key)
    return check_work_count(key, value)


def check_work_count(key: str, value: int) -> int:
    """``value`` unless it is above ``WORK_COUNT_MAX[key]`` (an input error naming ``key``).

    Keys outside :data:`WORK_COUNT_MAX` are not bounded here.
    """
    most = WORK_COUNT_MAX.get(key)
    if most is not None and value > most:
        raise OptmemInputError(f"expected {key} at most {most:,} (its work grows with it), "
                               f"got {value!r}", field=key)
    return value


def positive_float(options: SolveOptions, key: str, default: float) -> float:
    """``options.extra[key]`` (else ``default``) as a number > 0 (``bool`` refused)."""
    value = options.extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise OptmemInputError(f"expected a positive number {key}, got {value!r}", field=key)
    return float(value)


def fraction(options: SolveOptions, key: str) -> float | None:
    """``options.extra[key]`` as a share in (0, 1), e.g. ``0.01`` for 1 % (``None``: not given)."""
    value = options.extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise OptmemInputError(f"expected a share in (0, 1) for {key} (e.g. 0.01 for 1 %), "
                               f"got {value!r}", field=key)
    return float(value)


def choice(options: SolveOptions, key: str, default: str, allowed: Sequence[str]) -> str:
    """``options.extra[key]`` (else ``default``), which must be one of ``allowed``."""
    value = options.extra.get(key, default)
    if not isinstance(value, str) or value not in allowed:
        raise OptmemInputError(f"expected one of {', '.join(allowed)} for {key}, got {value!r}",
                               field=key)
    return value


def one_or_all(options: SolveOptions, key: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """``(options.extra[key],)`` if given (one of ``allowed``), else all of ``allowed``.

    A restriction of a search over named alternatives (e.g. the prefetch policies).
    """
    if key not in options.extra:
        return tuple(allowed)
    return (choice(options, key, allowed[0], allowed),)


def flag(options: SolveOptions, key: str, default: bool) -> bool:
    """``options.extra[key]`` (else ``default``), which must be ``True`` or ``False``."""
    value = options.extra.get(key, default)
    if not isinstance(value, bool):
        raise OptmemInputError(f"expected true or false for {key}, got {value!r}", field=key)
    return value
