"""Result types shared by every method: :class:`Status`, :class:`Result`, :class:`SolveOptions`.

Backend status codes are mapped to :class:`Status` in exactly one place per engine adapter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from numbers import Integral, Real
from typing import Any

import numpy as np

from optmem.errors import OptmemInputError, check_keywords


class Status(StrEnum):
    """Outcome of a solve (CONTRACT section 4)."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    NO_SOLUTION = "no_solution"
    ERROR = "error"

    @property
    def has_plan(self) -> bool:
        """Whether a result with this status carries a plan."""
        return self in (Status.OPTIMAL, Status.FEASIBLE)


MAX_WORKERS = 256
"""Most threads (``threads``, ``--threads``) and worker processes (``--jobs``): beyond this,
engines stall or abort spawning threads (HiGHS aborts the process at 100000)."""
MAX_SEED = 2**31 - 1
"""Largest engine seed: HiGHS ``random_seed`` and CP-SAT ``random_seed`` are 32-bit."""


@dataclass(frozen=True)
class SolveOptions:
    """Options common to all methods; problem-specific knobs go in ``extra``.

    Parameters
    ----------
    variant
        Method variant (checkpoint DP: ``paper``, ``rotor``, ``floating``; exact models:
        ``full`` or ``persistent``).
    slots
        Number of memory slots of the discretisation (CONTRACT section 2).
    time_limit_s
        Wall-clock limit of each exact engine call; ``None`` (default) for no limit. The
        outcome then depends on the machine's speed and load: for reproducible limits use
        ``node_limit`` / ``deterministic_time``.
    solver
        ILP engine: ``highs`` (default), ``cbc`` or ``gurobi``.
    threads
        Threads for exact engines, ``1..MAX_WORKERS`` (256, as ``--threads``).
    warm_start
        Give exact engines the DP plan as a starting solution (``True`` or ``False``).
    verbose
        Let engines print their logs (``True`` or ``False``).
    node_limit
        Deterministic work limit of each MILP engine call: branch-and-bound nodes (HiGHS
        ``mip_max_nodes``, CBC ``maxNodes`` single-threaded, Gurobi ``NodeLimit``).
    deterministic_time
        Deterministic work limit of each CP-SAT call (``max_deterministic_time``, in CP-SAT's
        deterministic seconds); CP-SAT then runs one worker so the answer is reproducible.
    seed
        Random seed of every engine (HiGHS ``random_seed``, CBC ``randomCbcSeed``, CP-SAT
        ``random_seed``, Gurobi ``Seed``), ``0..2**31 - 1``.
    extra
        Method-specific options, a dict with string keys; each method declares the keys it
        reads (an unknown key raises, naming the closest known one).
    work_budget
        Deterministic work limit of the whole solve: deterministic seconds summed over
        every CP-SAT, HiGHS and CBC call of the method (each call gets at most what is
        left, one worker / thread; HiGHS and CBC at fixed rates: 50 HiGHS limit checks,
        10,000 HiGHS LP iterations or 50 CBC nodes a second); ``inf`` measures without
        limiting. Gurobi calls run without a limit from it (counted). The ``report`` gets
        the ``work_*`` keys (CONTRACT section 14).

    Examples
    --------
    >>> SolveOptions(node_limit=10).node_limit
    10
    >>> SolveOptions(time_limt_s=5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'time_limt_s': ... did you mean 'time_limit_s'? ...
    """

    variant: str | None = None
    slots: int = 500
    time_limit_s: float | None = None
    solver: str = "highs"
    threads: int = 2
    warm_start: bool = True
    verbose: bool = False
    node_limit: int | None = None
    deterministic_time: float | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    work_budget: float | None = None

    def __post_init__(self) -> None:
        for name in ("time_limit_s", "deterministic_time", "work_budget"):
            object.__setattr__(self, name, _limit(getattr(self, name), name))
        object.__setattr__(self, "node_limit", _node_limit(self.node_limit))
        for name, low, high, what in (("seed", 0, MAX_SEED, "a non-negative integer seed"),
                                      ("slots", 1, None, "an integer number of slots"),
                                      ("threads", 1, MAX_WORKERS, "an integer number of threads")):
            object.__setattr__(self, name, check_integer(getattr(self, name), name, low, high,
                                                         what))
        for name in ("warm_start", "verbose"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise OptmemInputError(f"expected True or False, got {getattr(self, name)!r}",
                                       field=name)
            object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("variant", "solver"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "variant" and value is None):
                raise OptmemInputError(f"expected a name (a string), got {value!r}", field=name)
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise OptmemInputError(f"expected a dict of method options with string keys, got "
                                   f"{self.extra!r}", field="extra")

    def with_(self, **changes: Any) -> SolveOptions:
        """Return a copy with ``changes`` applied (unknown names raise, naming the closest)."""
        check_keywords(changes, OPTION_NAMES, what="SolveOptions")
        return replace(self, **changes)


def _limit(value: Any, name: str) -> float | None:
    """A time limit: ``None`` or a number > 0 (``inf``: none), as a float."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real) or not _positive(value):
        raise OptmemInputError(f"expected a positive number (inf or None: no limit), got "
                               f"{value!r}", field=name)
    try:
        return float(value)
    except OverflowError:
        raise OptmemInputError(f"expected a positive number (inf or None: no limit), got "
                               f"{value!r} (too large for a float)", field=name) from None


def _node_limit(value: Any) -> int | None:
    """A node limit: ``None`` or a whole number > 0 (``1e3`` too), as an int."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real) or not _positive(value):
        raise OptmemInputError(f"expected a positive whole number of nodes (None, or no "
                               f"--node-limit: no limit), got {value!r}", field="node_limit")
    if isinstance(value, Integral):
        return int(value)
    number = float(value)
    if not (math.isfinite(number) and number.is_integer()):
        raise OptmemInputError(f"expected a whole number of nodes, got {value!r}",
                               field="node_limit")
    return int(number)


def _positive(value: Real) -> bool:
    """Whether ``value > 0`` (``False`` for NaN; an int of any size is not made a float)."""
    return int(value) > 0 if isinstance(value, Integral) else float(value) > 0


def check_integer(value: Any, name: str, low: int, high: int | None, what: str) -> int:
    """``value`` as an ``int`` in ``low..high`` (numpy integers too; booleans refused).

    Examples
    --------
    >>> check_integer(np.int64(3), "slots", 1, None, "an integer number of slots")
    3
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, Integral) \
            or int(value) < low or (high is not None and int(value) > high):
        bounds = f"{low}..{high}" if high is not None else f"at least {low}"
        raise OptmemInputError(f"expected {what} ({bounds}), got {value!r}", field=name)
    return int(value)


OPTION_NAMES = tuple(f.name for f in fields(SolveOptions))
"""The fields of :class:`SolveOptions` (what ``solve(..., **options)`` accepts)."""


def _checked_init(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: SolveOptions, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        check_keywords(kwargs, OPTION_NAMES, what="SolveOptions")
        init(self, *args, **kwargs)

    return __init__


SolveOptions.__init__ = _checked_init(SolveOptions.__init__)  # type: ignore[method-assign]


@dataclass(frozen=True)
class Result:
    """What every method returns.

    Parameters
    ----------
    problem
        Problem name (``checkpoint``, ``offload``, ...).
    method, variant, solver
        Which formulation, variant and engine produced the result.
    status
        See :class:`Status`.
    objective
        Makespan (or period) of the plan in the chain's time unit; ``nan`` without a plan.
    bound
        Best proven lower bound on the optimum (``objective`` when optimal, ``inf`` when
        infeasible, ``nan`` when unknown).
    plan
        The plan as a tuple of op strings (empty without a plan).
    peak_memory
        Simulated peak in discretised units (``None`` without a plan).
    memory_limit
        Limit in discretised units.
    unit
        Bytes per discretised unit.
    solve_time_s
        Wall-clock time of the method.
    min_feasible_memory
        Smallest feasible limit in the original memory unit when known (set on infeasible).
    report
        Method details: model size, DP states, engine log summary, gap, ...
    """

    problem: str
    method: str
    status: Status
    objective: float = math.nan
    bound: float = math.nan
    plan: tuple[str, ...] = ()
    peak_memory: int | None = None
    memory_limit: int | None = None
    unit: int = 1
    variant: str | None = None
    solver: str | None = None
    solve_time_s: float = 0.0
    min_feasible_memory: int | None = None
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """Relative gap ``(objective - bound) / objective`` (0 when optimal, nan if unknown)."""
        if not self.status.has_plan or not math.isfinite(self.bound):
            return math.nan
        if self.objective == 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)

    def with_(self, **changes: Any) -> Result:
        """Return a copy with ``changes`` applied."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Return the CONTRACT section 4 JSON object (finite numbers or null)."""

        def num(v: float | None) -> float | None:
            return None if v is None or not math.isfinite(v) else float(v)

        out: dict[str, Any] = {
            "problem": self.problem, "method": self.method, "variant": self.variant,
            "status": str(self.status), "objective": num(self.objective),
            "peak_memory": self.peak_memory, "memory_limit": self.memory_limit,
            "unit": self.unit, "plan": list(self.plan),
            "solve_time_s": round(self.solve_time_s, 6), "bound": num(self.bound),
        }
        if self.status is Status.INFEASIBLE and self.bound == math.inf:
            out["bound"] = None
        out["solver"] = self.solver
        out["gap"] = num(self.gap)
        if self.min_feasible_memory is not None:
            out["min_feasible_memory"] = self.min_feasible_memory
        if self.report:
            out["report"] = _jsonable(self.report)
        return out


def _jsonable(value: Any) -> Any:
    """Convert numpy scalars, tuples and non-finite floats to plain JSON values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
