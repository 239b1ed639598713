"""Engine adapters: PuLP + HiGHS (default), CBC (bundled with PuLP), Gurobi (optional), CP-SAT.

Each adapter maps its backend's status codes to :class:`optmem.result.Status` in exactly one
place (the ``_STATUS`` tables and ``_status`` helpers below) and returns an
:class:`EngineResult` with the variable values, the engine's objective, its proven bound and
its run time. Every adapter accepts a time limit, a thread count and a warm start (initial
values for every variable) and asks for a zero optimality gap.

Deterministic limits and seeds (:class:`optmem.result.SolveOptions` ``node_limit``,
``deterministic_time``, ``seed``; :func:`pulp_settings`, :func:`cpsat_settings`): a node limit
is HiGHS ``mip_max_nodes``, CBC ``maxNodes`` (then single-threaded), Gurobi ``NodeLimit``; a
deterministic time is CP-SAT ``max_deterministic_time`` (then one worker); the seed is HiGHS
``random_seed``, CBC ``randomCbcSeed``, CP-SAT ``random_seed``, Gurobi ``Seed``. The
:attr:`EngineResult.stopped_by` field says which limit stopped the engine.

Engine faults are survived here, once: an exception of the backend (a CBC binary that is
missing, exits non-zero or dies by a signal, a HiGHS or Gurobi exception, an OR-Tools error)
and a CP-SAT ``MODEL_INVALID`` become an ``error`` :class:`EngineResult` whose ``message``
carries the engine's own text; nothing is raised past the adapter except bad input
(an unknown or uninstalled engine).

One deterministic work budget per solve (:class:`WorkBudget`, ``SolveOptions.work_budget``):
the facade opens it around a method (:func:`work_budget`, a context variable, so it follows
the solve and not the process) and :func:`solve_cpsat`, the one door to CP-SAT, gives each
call ``min(deterministic_time, what is left)`` and charges the deterministic time CP-SAT
reports; a call made when nothing is left is not run (``no_solution``, ``stopped_by:
"work_budget"``). :func:`solve_pulp` does the same for HiGHS and CBC in their own
deterministic units, converted at documented rates (:data:`HIGHS_CHECKS_PER_SECOND`,
:data:`HIGHS_LP_ITERATIONS_PER_SECOND`, :data:`CBC_NODES_PER_SECOND`); Gurobi calls are
only counted.

PuLP, highspy and OR-Tools are imported inside the functions (ortools 9.15 and highspy >= 1.15
crash in one process; optmem pins highspy 1.14).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import importlib.util
import math
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from optmem.errors import OptmemInputError, UnavailableError
from optmem.result import Status

ILP_ENGINES = ("highs", "cbc", "gurobi")
_REQUIRES = {"highs": ("pulp", "highspy"), "cbc": ("pulp",), "gurobi": ("pulp", "gurobipy"),
             "cpsat": ("ortools",)}


@dataclass(frozen=True)
class EngineResult:
    """What an engine reports.

    Attributes
    ----------
    status
        ``optimal`` (proven), ``feasible`` (a solution, limit hit), ``infeasible`` (proven),
        ``no_solution`` (limit hit without a solution) or ``error``.
    values
        One value per variable (``None`` without a solution).
    objective, bound
        The engine's objective and proven lower bound (``nan`` when unknown).
    engine
        Adapter name (``highs``, ``cbc``, ``gurobi``, ``cpsat``).
    time_s
        Wall-clock time of the engine call.
    message
        The backend's own status text (the exception text when the engine failed).
    stopped_by
        The limit that stopped the engine before it proved its answer: ``"time"``,
        ``"nodes"``, ``"deterministic_time"``, ``"work_budget"`` (the solve's
        :class:`WorkBudget`: it cut the call short, or nothing was left to run it) or
        ``"other"``; ``None`` otherwise.
    info
        Deterministic work counts: ``nodes`` (HiGHS); ``branches``, ``conflicts``,
        ``deterministic_time`` (CP-SAT).
    """

    status: Status
    values: list[float] | None
    objective: float
    bound: float
    engine: str
    time_s: float
    message: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    stopped_by: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the engine crashed or misbehaved (``status`` is ``error``)."""
        return self.status is Status.ERROR

    def report(self) -> dict[str, Any]:
        """Report keys of every exact method: ``engine_status``, ``engine_time_s``, ...

        ``engine_stopped_by`` is there when a limit stopped the engine, ``engine_error``
        when it failed.
        """
        out: dict[str, Any] = {"engine_status": self.message,
                               "engine_time_s": round(self.time_s, 4)}
        if self.stopped_by is not None:
            out["engine_stopped_by"] = self.stopped_by
        if self.failed:
            out["engine_error"] = f"{self.engine} failed: {self.message}"
        return out


def failed_result(engine: str, exc: BaseException | str, time_s: float = 0.0) -> EngineResult:
    """The ``error`` result of an engine that raised ``exc`` (or reported ``exc``)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}".strip()
    return EngineResult(Status.ERROR, None, math.nan, math.nan, engine, time_s,
                        text.splitlines()[0] if text else "unknown failure")


def undecodable_result(out: EngineResult, fault: str) -> EngineResult:
    """The ``error`` result of an engine whose solution does not decode (``fault``: why).

    A misbehaving engine (too few values, NaN, an assignment the model has no plan for) is
    the engine's failure, not the method's: callers handle it as a failed engine call.
    """
    return failed_result(out.engine, f"returned a solution that does not decode ({fault})",
                         out.time_s)


@dataclass
class WorkBudget:
    """Deterministic seconds one solve may spend, summed over all its engine calls.

    Opened by :func:`work_budget` (the facade does it for every ``solve``/``compare`` row
    with ``SolveOptions.work_budget``) and read by :func:`solve_cpsat` and
    :func:`solve_pulp` through :func:`active_budget`: each CP-SAT call gets :meth:`grant`
    (the smaller of its own ``deterministic_time`` and what is left; one worker) and is
    charged the deterministic time CP-SAT reports (:meth:`charge`, which may pass the
    total by the overshoot of the last call: CP-SAT checks its limit between steps, a few
    thousandths of a deterministic second: 2.3e-3 seen on a 41-stage checkpoint model).
    Each HiGHS / CBC call gets what is left, converted to its own deterministic unit
    (HiGHS limit checks or LP iterations, CBC nodes; one thread), and is charged what it
    used, converted back (:meth:`charge_milp`; the overshoot is the work between two of
    HiGHS's checks, or CBC's root node). Gurobi calls run without a limit from the budget
    (:meth:`unbounded_milp`). A call made with nothing left is not run (:meth:`skip`,
    :meth:`skip_milp`). Thread-safe: threads a method starts share their solve's budget
    (:func:`carry_budget`).

    Examples
    --------
    >>> b = WorkBudget(1.0)
    >>> b.grant(None), b.grant(0.25)
    (1.0, 0.25)
    >>> b.charge(0.75, cut=False); b.grant(None), b.left()
    (0.25, 0.25)
    >>> b.charge(0.3, cut=True); b.grant(5.0), b.exhausted
    (None, True)
    >>> sorted(b.report())[:3]
    ['work_budget', 'work_calls', 'work_cut_calls']
    """

    total: float
    used: float = 0.0
    calls: int = 0
    cut_calls: int = 0
    skipped_calls: int = 0
    milp_calls: int = 0
    milp_used: float = 0.0
    milp_cut_calls: int = 0
    milp_skipped_calls: int = 0
    milp_unbounded_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def left(self) -> float:
        """Deterministic seconds left (never negative; ``inf`` for an unbounded budget)."""
        with self._lock:
            return max(0.0, self.total - self.used)

    @property
    def exhausted(self) -> bool:
        """Whether nothing is left."""
        return self.left() <= 0.0

    def grant(self, deterministic_time: float | None) -> float | None:
        """The limit of the next CP-SAT call (``None``: nothing left, do not run it).

        An unbounded budget (``inf``) grants ``deterministic_time`` unchanged, ``inf`` when
        the call has none (then it measures the work only).
        """
        left = self.left()
        if left <= 0.0:
            return None
        return left if deterministic_time is None else min(float(deterministic_time), left)

    def charge(self, used: float, *, cut: bool) -> None:
        """Count a call that ran ``used`` deterministic seconds (``cut``: stopped by this)."""
        with self._lock:
            self.used += max(0.0, float(used))
            self.calls += 1
            self.cut_calls += int(cut)

    def skip(self) -> None:
        """Count a call that was not run (nothing left)."""
        with self._lock:
            self.skipped_calls += 1

    def count_milp(self) -> None:
        """Count a HiGHS / CBC / Gurobi call (made, whether it runs or not)."""
        with self._lock:
            self.milp_calls += 1

    def charge_milp(self, used: float, *, cut: bool) -> None:
        """Count a HiGHS / CBC call that ran ``used`` deterministic seconds (converted)."""
        with self._lock:
            self.used += max(0.0, float(used))
            self.milp_used += max(0.0, float(used))
            self.milp_cut_calls += int(cut)

    def skip_milp(self) -> None:
        """Count a HiGHS / CBC / Gurobi call that was not run (nothing left)."""
        with self._lock:
            self.milp_skipped_calls += 1

    def unbounded_milp(self) -> None:
        """Count a Gurobi call: run without a limit from the budget, charged nothing."""
        with self._lock:
            self.milp_unbounded_calls += 1

    def report(self) -> dict[str, Any]:
        """The ``work_*`` report keys of a solve (CONTRACT section 14)."""
        with self._lock:
            return {"work_budget": self.total, "work_used": round(self.used, 6),
                    "work_calls": self.calls, "work_cut_calls": self.cut_calls,
                    "work_skipped_calls": self.skipped_calls,
                    "work_exhausted": self.used >= self.total,
                    "work_milp_calls": self.milp_calls,
                    "work_milp_used": round(self.milp_used, 6),
                    "work_milp_cut_calls": self.milp_cut_calls,
                    "work_milp_skipped_calls": self.milp_skipped_calls,
                    "work_milp_unbounded_calls": self.milp_unbounded_calls}


_BUDGET: contextvars.ContextVar[WorkBudget | None] = contextvars.ContextVar(
    "optmem_work_budget", default=None)


def active_budget() -> WorkBudget | None:
    """The work budget of the solve running in this context (``None``: none)."""
    return _BUDGET.get()


@contextlib.contextmanager
def work_budget(total: float | None) -> Iterator[WorkBudget | None]:
    """Open a :class:`WorkBudget` of ``total`` deterministic seconds for the code inside.

    ``None`` opens nothing (yields the budget already open, if any). Inside an open budget
    (a method that solves through the facade again) the outer budget stays the one in
    force: one solve, one budget.
    """
    current = _BUDGET.get()
    if total is None or current is not None:
        yield current
        return
    budget = WorkBudget(float(total))
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


@contextlib.contextmanager
def outside_budget() -> Iterator[None]:
    """Run the engine calls inside without the solve's budget (neither limited nor charged).

    For a call that reads a plan rather than searches for one: the pipeline ILP's polish
    LP (every integer variable fixed to the engine's rounded value). Skipped under a spent
    budget, the plan would be decoded from the MIP's unpolished values, whose integrality
    tolerance can move a task by a period.
    """
    token = _BUDGET.set(None)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def carry_budget(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` bound to this context, so a thread running it charges this solve's budget.

    Threads do not inherit context variables: a method that runs engine calls on a thread
    (the chunk scan's pool, the co-location climb beside the search) submits them through
    this.
    """
    budget = _BUDGET.get()

    def run(*args: Any, **kwargs: Any) -> Any:
        token = _BUDGET.set(budget)
        try:
            return fn(*args, **kwargs)
        finally:
            _BUDGET.reset(token)

    return run


def pulp_settings(options: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`solve_pulp` from a :class:`~optmem.result.SolveOptions`."""
    return {"time_limit_s": options.time_limit_s, "threads": options.threads,
            "verbose": options.verbose, "node_limit": options.node_limit,
            "seed": options.seed}


def cpsat_settings(options: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`solve_cpsat` from a :class:`~optmem.result.SolveOptions`."""
    return {"time_limit_s": options.time_limit_s, "threads": options.threads,
            "verbose": options.verbose, "deterministic_time": options.deterministic_time,
            "seed": options.seed}


MAX_COEFFICIENT = 1e4
"""Largest size coefficient a memory row should carry (see :func:`coefficient_scale`)."""


def coefficient_scale(largest: float) -> float:
    """Divisor that brings size coefficients up to ``largest`` to at most ``MAX_COEFFICIENT``.

    MILP engines work with absolute tolerances around 1e-6 to 1e-9 and big-M rows: byte-sized
    coefficients (~1e9) made HiGHS return wrong answers (an always-feasible min-peak model
    called infeasible, wrong "optimal" checkpoint sets). Models divide sizes by this scale
    and read exact byte values back from the decoded plan.

    Examples
    --------
    >>> coefficient_scale(500), coefficient_scale(4e10)
    (1.0, 4000000.0)
    """
    return max(1.0, float(largest) / MAX_COEFFICIENT)


def is_available(engine: str) -> bool:
    """Whether ``engine`` (``highs``, ``cbc``, ``gurobi``, ``cpsat``) can run here."""
    if engine not in _REQUIRES:
        return False
    if not all(importlib.util.find_spec(m) is not None for m in _REQUIRES[engine]):
        return False
    if engine == "cbc":
        import pulp  # type: ignore[import-untyped]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(pulp.PULP_CBC_CMD(msg=False).available())
    return True


def check_engine(engine: str) -> None:
    """Raise a clear error if ``engine`` is unknown or not installed."""
    if engine not in ILP_ENGINES:
        raise OptmemInputError(f"unknown ILP solver {engine!r} (expected one of "
                               f"{', '.join(ILP_ENGINES)})", field="solver")
    if not is_available(engine):
        raise UnavailableError(f"ILP solver {engine!r} is not installed "
                               f"(needs {', '.join(_REQUIRES[engine])})", field="solver")


# ------------------------------------------------------------------ PuLP engines
HIGHS_CHECKS_PER_SECOND = 50
"""HiGHS limit checks one deterministic second of a :class:`WorkBudget` buys.

HiGHS 1.14 honours no deterministic limit that bounds a MIP's root node (``mip_max_nodes``,
``mip_max_leaves``, ``mip_max_stall_nodes`` and ``mip_max_improving_sols`` count nodes and
solutions; ``simplex_iteration_limit`` is not applied to the MIP's LPs), but it calls its
MIP interrupt callback each time it checks its limits: after presolve, after each root
separation round and root heuristic, at each node of the search (sub-MIPs excepted). Their
number is a deterministic count of the work done (the same on every run at one thread);
under a budget :func:`solve_pulp` interrupts HiGHS at the check that spends the call's
grant. Measured on this repository's checkpoint ILP (the model alone, no warm start;
one thread, ``nice 19``): 1,296 checks took 22-29 s of wall clock on a 20-stage chain at
30 % of its store-all peak and 991 checks 154 s on a 40-stage one, while CP-SAT ran
4.1-4.2 wall seconds per deterministic second on the same models and load
(``benchmarks/results/work_budget.md``): 50 checks per deterministic second lies between
the two, a rough rate.
"""

HIGHS_LP_ITERATIONS_PER_SECOND = 10_000
"""Simplex iterations one deterministic second buys a HiGHS call on a pure LP (no integer
variable: no MIP check is made; its simplex interrupt callback counts iterations)."""

CBC_NODES_PER_SECOND = 50
"""Branch-and-bound nodes one deterministic second buys a CBC call (``maxNodes``; CBC's
root node, cuts and heuristics are not bounded by it: CBC has no other deterministic
limit PuLP can pass, and no callback)."""


@dataclass(frozen=True)
class _Settings:
    """What every PuLP engine call is given.

    ``work_grant``: deterministic seconds of the solve's :class:`WorkBudget` this call may
    spend (``inf``: measure only; ``None``: no budget).
    """

    time_limit_s: float | None
    threads: int
    initial: Sequence[float] | None
    verbose: bool
    node_limit: int | None
    seed: int
    highs_options: dict[str, Any] = field(default_factory=dict)
    work_grant: float | None = None

    def cap(self, rate: float) -> int | None:
        """The grant in an engine's unit (at least 1; ``None``: no cap)."""
        if self.work_grant is None or math.isinf(self.work_grant):
            return None
        return max(1, math.floor(self.work_grant * rate))


_Run = tuple[Status, float, str, str | None, dict[str, Any]]
"""What an engine runner returns: status, bound, message, stopped_by, work counts."""


HIGHS_PROTECTED = ("mip_rel_gap", "mip_abs_gap", "threads", "time_limit", "random_seed",
                   "mip_max_nodes", "output_flag")
"""HiGHS options :func:`solve_pulp` sets itself (a zero gap, so ``optimal`` means proven)."""


def check_highs_options(options: Any) -> dict[str, Any]:
    """A copy of extra HiGHS options, checked: a dict of names to numbers / strings / bools.

    Raises
    ------
    OptmemInputError
        For anything else, and for the options the adapter sets itself
        (:data:`HIGHS_PROTECTED`: the gaps stay 0 so that ``optimal`` is a proof).

    Examples
    --------
    >>> check_highs_options({"mip_pscost_minreliable": 0})
    {'mip_pscost_minreliable': 0}
    """
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise OptmemInputError(f"expected a dict of HiGHS option names to values, got "
                               f"{options!r}", field="highs_options")
    for key, value in options.items():
        if key in HIGHS_PROTECTED:
            raise OptmemInputError(f"HiGHS option {key!r} is set by optmem itself "
                                   "(gaps stay 0; use time_limit_s / node_limit / seed / "
                                   "threads)", field="highs_options")
        if not isinstance(value, bool | int | float | str):
            raise OptmemInputError(f"HiGHS option {key!r}: expected a number, string or "
                                   f"bool, got {value!r}", field="highs_options")
    if options and importlib.util.find_spec("highspy") is not None:
        import highspy  # type: ignore[import-untyped]

        probe = highspy.Highs()
        probe.setOptionValue("output_flag", False)
        for key, value in options.items():
            if probe.setOptionValue(key, value) != highspy.HighsStatus.kOk:
                raise OptmemInputError(f"HiGHS rejects option {key} = {value!r} (unknown "
                                       "name or a value of the wrong type or range)",
                                       field="highs_options")
    return dict(options)


def objective_factor(objective: Any) -> float:
    """Power of two lifting the largest objective coefficient to ``[1, 2)`` (1.0: none needed).

    The engines judge optimality with absolute tolerances (gap ``1e-9``, reduced costs
    ``1e-7``): on an objective whose coefficients are all tiny (a chain of nanosecond times
    in milliseconds), HiGHS called a plan 44 % above the optimum optimal, with that plan's
    makespan as its bound. :func:`solve_pulp` solves with the objective multiplied by this
    factor (exact: a power of two) and divides the bound by it; objectives with a
    coefficient of at least 1 are solved as they are.

    Examples
    --------
    >>> import pulp
    >>> x = pulp.LpVariable("x")
    >>> objective_factor(1e-9 * x) == 2.0 ** 30, objective_factor(3 * x), objective_factor(0 * x)
    (True, 1.0, 1.0)
    """
    largest = max((abs(float(c)) for _, c in objective.items()), default=0.0)
    if largest == 0.0 or largest >= 1.0 or not math.isfinite(largest):
        return 1.0
    return 2.0 ** -math.floor(math.log2(largest))


START_BOUND_TOLERANCE = 1e-9
"""Relative distance (to ``max(1, |bound|)``) within which a warm start's value outside a
variable's bound is taken as on it (:func:`_set_initial`)."""


def _set_initial(variable: Any, value: float | None) -> None:
    """Give ``variable`` a warm start's ``value``, never raising on its bounds.

    A value outside the variable's bounds by float noise (relative
    :data:`START_BOUND_TOLERANCE`) is moved onto the bound: the offload MILP at a chain
    bandwidth of 1e20 started a transfer at 8e-20 where its bound was 0, and PuLP's
    ``setInitialValue`` raised ``ValueError`` through the solve (a stop-78 sweep). A value
    further out is left unset (``None``): the engine gets a partial start, or none.
    """
    if value is not None:
        low, high = variable.lowBound, variable.upBound
        if low is not None and value < low <= value + START_BOUND_TOLERANCE * max(1.0, abs(low)):
            value = low
        if high is not None and value > high >= value - START_BOUND_TOLERANCE * max(
                1.0, abs(high)):
            value = high
    if value is None or not variable.setInitialValue(value, check=False):
        variable.varValue = None


def solve_pulp(
    problem: Any, variables: Sequence[Any], engine: str = "highs", *,
    time_limit_s: float | None = None, threads: int = 2, initial: Sequence[float] | None = None,
    verbose: bool = False, node_limit: int | None = None, seed: int = 0,
    highs_options: dict[str, Any] | None = None,
) -> EngineResult:
    """Solve a PuLP minimisation ``problem`` with ``engine``.

    Parameters
    ----------
    problem, variables
        The PuLP problem and its variables (the order of ``values`` and ``initial``).
    engine
        ``highs``, ``cbc`` or ``gurobi``.
    time_limit_s, threads, verbose
        Engine settings (wall-clock limit, threads, logs).
    node_limit, seed
        Deterministic branch-and-bound node limit (CBC then runs single-threaded) and
        random seed.
    initial
        A feasible assignment to start from (warm start), or ``None``.
    highs_options
        Further HiGHS options (name -> value, e.g. ``mip_pscost_minreliable``), checked by
        :func:`check_highs_options`; the other engines ignore them.

    Returns
    -------
    EngineResult
        ``status: error`` (with the engine's message) when the engine failed.

    Notes
    -----
    Under the solve's :class:`WorkBudget` (:func:`active_budget`) a HiGHS or CBC call runs
    on one thread with what is left of the budget, converted to the engine's deterministic
    unit: HiGHS is interrupted at the limit check (MIP; :data:`HIGHS_CHECKS_PER_SECOND`) or
    simplex iteration (LP; :data:`HIGHS_LP_ITERATIONS_PER_SECOND`) that spends it, CBC gets
    ``maxNodes`` (:data:`CBC_NODES_PER_SECOND`; the smaller of it and ``node_limit``). The
    call is charged what it used (``info``: ``checks``, ``nodes``, ``lp_iterations`` and
    ``work``, in deterministic seconds); ``stopped_by`` is ``"work_budget"`` when the
    budget's limit stopped it. With nothing left the call is not run: ``no_solution``,
    ``stopped_by: "work_budget"``, ``info["skipped"]``. A Gurobi call runs without a limit
    from the budget (counted, ``work_milp_unbounded_calls``).
    """
    check_engine(engine)
    extra_highs = check_highs_options(highs_options)
    budget = _BUDGET.get()
    grant: float | None = None
    if budget is not None:
        budget.count_milp()
        grant = budget.grant(None)
        if grant is None:
            budget.skip_milp()
            return EngineResult(Status.NO_SOLUTION, None, math.nan, math.nan, engine, 0.0,
                                "WORK_BUDGET_SPENT", stopped_by="work_budget",
                                info={"work": 0.0, "skipped": True})
        if engine == "gurobi":
            budget.unbounded_milp()
            grant = None
        else:
            threads = 1  # one thread: the same counts, so the same answer, on every run
    if initial is not None:
        for v, x in zip(variables, initial, strict=True):
            _set_initial(v, x)
    else:
        for v in variables:
            v.varValue = None
    settings = _Settings(time_limit_s, threads, initial, verbose, node_limit, seed,
                         extra_highs, grant)
    run = {"highs": _solve_highs, "cbc": _solve_cbc, "gurobi": _solve_gurobi}[engine]
    factor = objective_factor(problem.objective)
    original = problem.objective
    start = time.perf_counter()
    try:
        if factor != 1.0:
            problem.objective = original * factor
        status, bound, message, stopped, work = run(problem, settings)
    except Exception as exc:  # noqa: BLE001 - an engine fault never escapes the adapter
        if budget is not None and grant is not None:
            budget.charge_milp(0.0, cut=False)
        return failed_result(engine, exc, time.perf_counter() - start)
    finally:
        problem.objective = original
    if budget is not None and grant is not None:
        budget.charge_milp(work["work"], cut=stopped == "work_budget"
                           and status in (Status.FEASIBLE, Status.NO_SOLUTION))
    bound /= factor
    elapsed = time.perf_counter() - start
    values = None
    objective = math.nan
    if status.has_plan:
        values = [v.varValue if v.varValue is not None else 0.0 for v in variables]
        terms = list(problem.objective.items())
        # a zero term may name a variable the engine never saw (PuLP's ``__dummy`` of an
        # empty objective, a variable in no row): it has no value and adds nothing
        value = None if any(v.varValue is None and x for v, x in terms) else \
            problem.objective.constant + sum(x * v.varValue for v, x in terms if x)
        if value is None or not math.isfinite(float(value)):
            return failed_result(engine, f"{message}: a solution without an objective value",
                                 elapsed)
        objective = float(value)
        if status is Status.OPTIMAL:
            bound = objective
    if status in (Status.OPTIMAL, Status.INFEASIBLE):
        stopped = None
    if grant is None:  # the counts of a budget only under one that bounds the call
        work = {"nodes": work["nodes"]} if "nodes" in work else {}
    return EngineResult(status, values, objective, bound, engine, elapsed, message,
                        stopped_by=stopped, info=work)


def _highs_work(problem: Any) -> dict[str, Any]:
    """HiGHS's deterministic work counts of the last run: ``nodes``, ``lp_iterations``."""
    model = getattr(problem, "solverModel", None)
    if model is None:
        return {}
    try:
        info = model.getInfo()
        return {"nodes": int(info.mip_node_count),
                "lp_iterations": int(info.simplex_iteration_count)}
    except Exception:  # noqa: BLE001 - a count is informative only
        return {}


_HIGHS_STATUS: dict[str, Status] = {
    "kOptimal": Status.OPTIMAL,
    "kInfeasible": Status.INFEASIBLE,
    "kTimeLimit": Status.NO_SOLUTION,  # FEASIBLE when a primal solution exists
    "kIterationLimit": Status.NO_SOLUTION,
    "kSolutionLimit": Status.NO_SOLUTION,
    "kInterrupt": Status.NO_SOLUTION,
    "kHighsInterrupt": Status.NO_SOLUTION,
    "kMemoryLimit": Status.NO_SOLUTION,
    "kObjectiveBound": Status.NO_SOLUTION,
    "kObjectiveTarget": Status.NO_SOLUTION,
}


def _highs_status(model_status: Any, has_solution: bool) -> Status:
    """HiGHS model status -> Status (the one mapping for HiGHS)."""
    name = getattr(model_status, "name", str(model_status).split(".")[-1])
    status = _HIGHS_STATUS.get(name, Status.ERROR)
    if status is Status.NO_SOLUTION and has_solution:
        return Status.FEASIBLE
    return status


def _highs_stopped(model_status: Any) -> str | None:
    """Which limit a HiGHS model status reports."""
    name = getattr(model_status, "name", str(model_status).split(".")[-1])
    return {"kTimeLimit": "time", "kSolutionLimit": "nodes", "kIterationLimit": "nodes",
            "kInterrupt": "other", "kHighsInterrupt": "other", "kMemoryLimit": "other",
            "kObjectiveBound": "other", "kObjectiveTarget": "other"}.get(name)


_HIGHS_THREADS: dict[str, int] = {}
"""Thread count of the last HiGHS run in this process (its global scheduler's)."""


def _shut_highs_down_at_exit(highspy: Any) -> None:
    """Stop HiGHS's worker threads before the interpreter exits (call before the first run).

    HiGHS keeps a process-wide pool of detached worker threads; a process that exits while
    they are still alive can abort with ``terminate called without an active exception``
    (seen once, under load, at the end of a ``torchrun`` worker that had solved MadPipe's
    model). Shutting the pool down at exit, blocking until the workers are gone, removes
    that race.
    """
    atexit.register(highspy.Highs.resetGlobalScheduler, True)


class _HighsMeter:
    """Counts HiGHS's limit checks (MIP) and simplex iterations (LP) of one run.

    It interrupts the run at the check / iteration that spends its grant
    (:class:`_Settings`).
    """

    def __init__(self, settings: _Settings) -> None:
        self.check_cap = settings.cap(HIGHS_CHECKS_PER_SECOND)
        self.iteration_cap = settings.cap(HIGHS_LP_ITERATIONS_PER_SECOND)
        self.checks = 0
        self.lp_iterations = 0
        self.interrupted = False

    def on_check(self, event: Any) -> None:
        """HiGHS's MIP interrupt callback: one limit check."""
        self.checks += 1
        if self.check_cap is not None and self.checks >= self.check_cap:
            self.interrupted = True
            event.interrupt()

    def on_iteration(self, event: Any) -> None:
        """HiGHS's simplex interrupt callback (pure LPs): the iteration count so far."""
        self.lp_iterations = max(self.lp_iterations,
                                 int(event.data_out.simplex_iteration_count))
        if self.iteration_cap is not None and self.lp_iterations >= self.iteration_cap:
            self.interrupted = True
            event.interrupt()

    def work(self) -> float:
        """The run's work in deterministic seconds (the rates of the module)."""
        return self.checks / HIGHS_CHECKS_PER_SECOND \
            + self.lp_iterations / HIGHS_LP_ITERATIONS_PER_SECOND


def _solve_highs(problem: Any, settings: _Settings) -> _Run:
    import highspy  # type: ignore[import-untyped]
    import pulp  # type: ignore[import-untyped]

    initial = settings.initial
    threads = settings.threads
    meter = _HighsMeter(settings)

    class _Highs(pulp.HiGHS):  # type: ignore[misc, name-defined]
        """PuLP's highspy interface plus a warm start, the final info and a fast model pass.

        :func:`_pass_model` replaces PuLP's ``buildSolverModel`` (one ``addCol`` /
        ``addRow`` call per column and row) and :func:`_read_values` its
        ``findSolutionValues``; ``actualSolve`` calls them instead of PuLP's.
        """

        captured: dict[str, Any] = {}
        columns: list[Any] = []

        def actualSolve(self, lp: Any, **kwargs: Any) -> Any:  # noqa: N802 - PuLP's name
            del kwargs
            self.createAndConfigureSolver(lp)
            self.columns = _pass_model(lp, lp.solverModel, highspy, mip=bool(self.mip))
            self.callSolver(lp)
            status, solution = _read_values(lp.solverModel, self.columns, self.captured,
                                            pulp)
            lp.assignStatus(status, solution)
            return status

        def callSolver(self, lp: Any) -> None:  # noqa: N802 - PuLP's name
            h = lp.solverModel
            if "last" not in _HIGHS_THREADS:  # the process's first HiGHS run
                _shut_highs_down_at_exit(highspy)
            elif _HIGHS_THREADS["last"] != threads:
                # HiGHS keeps one global thread pool per process: a run with another thread
                # count fails with status kNotset unless the pool is rebuilt
                highspy.Highs.resetGlobalScheduler(True)
            _HIGHS_THREADS["last"] = threads
            if initial is not None:
                sol = highspy.HighsSolution()
                sol.col_value = [float(v.varValue or 0.0) for v in self.columns]
                sol.value_valid = True
                h.setSolution(sol)
            if settings.work_grant is not None:
                h.cbMipInterrupt.subscribe(meter.on_check)
                h.cbSimplexInterrupt.subscribe(meter.on_iteration)
            h.run()
            info = h.getInfo()
            self.captured = {"status": h.getModelStatus(),
                             "bound": float(info.mip_dual_bound),
                             "has_solution": int(info.primal_solution_status) == 2}

    params: dict[str, Any] = {**settings.highs_options, "random_seed": int(settings.seed)}
    if settings.node_limit is not None:
        params["mip_max_nodes"] = int(settings.node_limit)
    solver = _Highs(msg=settings.verbose, gapRel=0.0, gapAbs=1e-9, threads=settings.threads,
                    timeLimit=settings.time_limit_s, **params)
    problem.solve(solver)
    cap = solver.captured
    status = _highs_status(cap["status"], cap["has_solution"])
    bound = cap["bound"] + problem.objective.constant
    if not math.isfinite(bound):
        bound = math.nan
    stopped = _highs_stopped(cap["status"])
    if meter.interrupted and stopped == "other":
        stopped = "work_budget"
        if meter.checks == 0:  # an LP stopped mid-simplex: its objective bounds nothing
            bound = math.nan
    work = {**_highs_work(problem), "checks": meter.checks, "work": meter.work()}
    return status, bound, str(cap["status"]).split(".")[-1], stopped, work


def _pass_model(lp: Any, h: Any, highspy: Any, *, mip: bool) -> list[Any]:
    """Give HiGHS the PuLP problem ``lp`` in three array calls; its columns, in order.

    The model PuLP's ``buildSolverModel`` passes, passed at once: the same columns in the
    same order (every variable of the objective and the rows, sorted by name, as
    ``LpProblem.variables``), the same rows (zero coefficients dropped) and bounds, integer
    columns when ``mip``; ``var.index`` and ``constraint.index`` set as PuLP sets them. Why:
    PuLP makes one ``addRow`` call per row, 90 microseconds each under highspy 1.14, and
    scans every row three more times for ``LpProblem.variables``; on the remat + offload
    link relaxation of DenseNet-121 (L = 68: 0.84 M rows) the pass took 106 of a 126 s call
    given a 1 s time limit (stop 74), time no engine limit bounds.
    """
    import numpy as np

    inf = highspy.kHighsInf
    rows = list(lp._constraints.values())
    # every term of every row, flattened (C-level extends), and the objective's variables
    terms: list[Any] = list(lp.objective.keys())
    n_obj = len(terms)
    coefs: list[float] = []
    counts = np.zeros(len(rows), dtype=np.int64)
    row_lo = np.empty(len(rows), dtype=np.float64)
    row_hi = np.empty(len(rows), dtype=np.float64)
    for i, con in enumerate(rows):
        con.index = i
        terms.extend(con.keys())
        coefs.extend(con.values())
        counts[i] = len(con)
        lb, ub = con.getLb(), con.getUb()
        row_lo[i] = -inf if lb is None else lb
        row_hi[i] = inf if ub is None else ub
    ids = np.fromiter(map(id, terms), dtype=np.int64, count=len(terms))
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    # columns: by name, ties by first appearance (LpProblem.variables: a stable sort)
    order = sorted(range(len(first)), key=lambda k: (terms[first[k]].name, first[k]))
    columns = [terms[first[k]] for k in order]
    column_of = np.empty(len(first), dtype=np.int32)
    column_of[np.array(order, dtype=np.int64)] = np.arange(len(first), dtype=np.int32)
    for i, var in enumerate(columns):
        var.index = i
    sign = -1.0 if lp.sense == -1 else 1.0  # pulp.LpMaximize
    cost = np.array([sign * lp.objective.get(v, 0.0) for v in columns], dtype=np.float64)
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in columns],
                     dtype=np.float64)
    upper = np.array([inf if v.upBound is None else v.upBound for v in columns],
                     dtype=np.float64)
    empty_i, empty_f = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float64)
    h.addCols(len(columns), cost, lower, upper, 0, empty_i, empty_i, empty_f)
    if mip:
        ints = [v.index for v in columns if v.cat == "Integer"]  # pulp.LpInteger
        if ints:
            h.changeColsIntegrality(len(ints), np.array(ints, dtype=np.int32),
                                    np.full(len(ints), int(highspy.HighsVarType.kInteger),
                                            dtype=np.uint8))
    if rows:
        value = np.array(coefs, dtype=np.float64)
        index = column_of[inverse[n_obj:]]
        kept = value != 0  # PuLP drops zero coefficients
        row_of = np.repeat(np.arange(len(rows)), counts)[kept]
        starts = np.zeros(len(rows), dtype=np.int32)
        starts[1:] = np.cumsum(np.bincount(row_of, minlength=len(rows)))[:-1]
        h.addRows(len(rows), row_lo, row_hi, int(kept.sum()), starts,
                  index[kept].astype(np.int32), value[kept])
    return columns


def _read_values(h: Any, columns: Sequence[Any], captured: dict[str, Any], pulp: Any
                 ) -> tuple[int, int]:
    """Set each column's ``varValue`` (and ``dj``) from HiGHS; PuLP's status pair.

    What optmem reads of PuLP's ``findSolutionValues`` (row slacks and duals are not set:
    no caller reads them); the statuses optmem reports come from ``captured``
    (:func:`_solve_highs`), the pair only keeps PuLP's problem consistent.
    """
    solution = h.getSolution()
    values, duals = list(solution.col_value), list(solution.col_dual)
    for var in columns:
        var.varValue = values[var.index] if var.index < len(values) else None
        var.dj = duals[var.index] if var.index < len(duals) else None
    name = getattr(captured.get("status"), "name", "")
    if name == "kOptimal":
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
    if name in ("kInfeasible", "kUnboundedOrInfeasible"):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    if captured.get("has_solution"):
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
    return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


_CBC_RESULT = re.compile(r"Result - (.*)")
# what CBC prints instead of a "Result - " line when presolve or the LP settles the problem
_CBC_SHORT = re.compile(r"^(Problem is infeasible|Problem proven infeasible|"
                        r"Pre-processing says infeasible.*|"
                        r"Optimal - objective value .*)", re.MULTILINE)
_CBC_LOWER = re.compile(r"Lower bound:\s*([-+0-9.eE]+)")


def _cbc_status(result_line: str, pulp_status: int, sol_status: int) -> Status:
    """CBC result line and PuLP codes -> Status (the one mapping for CBC)."""
    import pulp  # type: ignore[import-untyped]

    text = result_line.lower()
    if not text:  # CBC died before its summary: nothing it says can be trusted
        return Status.ERROR
    if "optimal solution found" in text or text.startswith("optimal - objective value"):
        return Status.OPTIMAL
    if text.startswith("pre-processing says infeasible"):  # "... or unbounded": ask PuLP
        return Status.INFEASIBLE if pulp_status == pulp.LpStatusInfeasible else Status.ERROR
    if "infeasible" in text:
        return Status.INFEASIBLE
    if "stopped" in text or "time limit" in text:
        has = sol_status == pulp.LpSolutionIntegerFeasible
        return Status.FEASIBLE if has else Status.NO_SOLUTION
    if pulp_status == pulp.LpStatusOptimal:
        return Status.OPTIMAL
    return Status.ERROR


def _cbc_stopped(result_line: str) -> str | None:
    """Which limit a CBC result line reports (``Stopped on node limit``, ...)."""
    text = result_line.lower()
    if "stopped" not in text and "limit" not in text:
        return None
    if "node" in text:
        return "nodes"
    return "time" if "time" in text else "other"


CBC_PATH: str | None = None
"""A CBC binary to run instead of the one bundled with PuLP (``None``: the bundled one)."""


def _run_cbc(problem: Any, settings: _Settings, log: str, time_mode: str, work_dir: str) -> int:
    """Run CBC once (``time_mode``: ``elapsed`` or ``cpu`` seconds) and return PuLP's status.

    PuLP writes the model, the MIP start and the solution into ``work_dir``; it deletes them
    only when CBC succeeds, so the caller removes the directory whatever happens.
    """
    import pulp  # type: ignore[import-untyped]

    deterministic = settings.node_limit is not None or settings.work_grant is not None
    kwargs: dict[str, Any] = {
        "msg": settings.verbose, "timeLimit": settings.time_limit_s,
        "threads": 1 if deterministic else settings.threads, "gapRel": 0.0, "gapAbs": 1e-9,
        "warmStart": settings.initial is not None, "logPath": log, "timeMode": time_mode,
        "maxNodes": _cbc_nodes(settings)[0],
        "options": [f"randomCbcSeed {int(settings.seed)}"]}
    with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC for 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.COIN_CMD(path=CBC_PATH, **kwargs) if CBC_PATH is not None \
            else pulp.PULP_CBC_CMD(**kwargs)
    solver.tmpDir = work_dir
    return int(problem.solve(solver))


def _cbc_nodes(settings: _Settings) -> tuple[int | None, bool]:
    """CBC's ``maxNodes``: the node limit or the budget's grant, the smaller.

    Also whether the grant is the one in force.
    """
    cap = settings.cap(CBC_NODES_PER_SECOND)
    if cap is not None and (settings.node_limit is None or cap < settings.node_limit):
        return cap, True
    return settings.node_limit, False


_CBC_NODES = re.compile(r"Enumerated nodes:\s*(\d+)")
_CBC_ITERATIONS = re.compile(r"Total iterations:\s*(\d+)")


def _bounded(problem: Any) -> bool:
    """Whether every variable of a PuLP problem has finite bounds (so it is not unbounded)."""
    return all(v.lowBound is not None and v.upBound is not None for v in problem.variables())


def _solve_cbc(problem: Any, settings: _Settings) -> _Run:
    import pulp  # type: ignore[import-untyped]

    # one directory per run: a CBC that crashes would leave PuLP's files behind (stop 40)
    with tempfile.TemporaryDirectory(prefix="optmem-cbc-") as work_dir:
        log = os.path.join(work_dir, "cbc.log")
        try:
            pulp_status = _run_cbc(problem, settings, log, "elapsed", work_dir)
        except pulp.PulpSolverError:
            if settings.initial is None or settings.time_limit_s is None:
                raise
            # the bundled CBC 2.10 segfaults when an elapsed-time limit hits while it is
            # still processing a MIP start (limits of a fraction of a second); counting CPU
            # time avoids the crash (and a second crash is reported as an engine error)
            pulp_status = _run_cbc(problem, settings, log, "cpu", work_dir)
        with open(log, errors="replace") as fh:
            text = fh.read()
    result = _CBC_RESULT.findall(text) or _CBC_SHORT.findall(text)
    line = result[-1] if result else ""
    status = _cbc_status(line, pulp_status, problem.sol_status)
    if line.startswith("Pre-processing says infeasible") and not _bounded(problem):
        status = Status.ERROR  # it may be unbounded: nothing proven
    low = _CBC_LOWER.findall(text)
    # PuLP does not give CBC the objective constant: add it back
    bound = float(low[-1]) + float(problem.objective.constant) if low else math.nan
    message = line or f"no result line in the CBC log (pulp status {pulp_status})"
    stopped = _cbc_stopped(line)
    nodes = [int(n) for n in _CBC_NODES.findall(text)]
    iterations = [int(n) for n in _CBC_ITERATIONS.findall(text)]
    work: dict[str, Any] = {}
    if settings.work_grant is not None:
        if stopped == "nodes" and _cbc_nodes(settings)[1]:
            stopped = "work_budget"
        # at least the root node, which CBC always solves (a log without the line included)
        spent = max(1, nodes[-1] if nodes else 0)
        work = {"nodes": spent, "lp_iterations": iterations[-1] if iterations else 0,
                "work": spent / CBC_NODES_PER_SECOND}
    return status, bound, message, stopped, work


def _gurobi_status(code: int, solutions: int) -> Status:
    """Gurobi status code -> Status (the one mapping for Gurobi)."""
    if code == 2:
        return Status.OPTIMAL
    if code in (3, 4):
        return Status.INFEASIBLE
    if code in (7, 8, 9, 10, 11, 13, 16, 17):
        return Status.FEASIBLE if solutions > 0 else Status.NO_SOLUTION
    return Status.ERROR


def _solve_gurobi(problem: Any, settings: _Settings) -> _Run:
    import pulp  # type: ignore[import-untyped]

    params: dict[str, Any] = {"Seed": int(settings.seed)}
    if settings.node_limit is not None:
        params["NodeLimit"] = float(settings.node_limit)
    solver = pulp.GUROBI(msg=settings.verbose, timeLimit=settings.time_limit_s,
                         warmStart=settings.initial is not None, gapRel=0.0,
                         Threads=settings.threads, **params)
    problem.solve(solver)
    model = problem.solverModel
    status = _gurobi_status(int(model.Status), int(model.SolCount))
    bound = float(model.ObjBound) + problem.objective.constant if model.SolCount else math.nan
    stopped = {9: "time", 8: "nodes"}.get(int(model.Status),
                                          "other" if int(model.Status) in (7, 10, 11, 13, 16,
                                                                           17) else None)
    return status, bound, f"gurobi status {model.Status}", stopped, {}


# ------------------------------------------------------------------ CP-SAT
def _work_of(solver: Any) -> float:
    """The deterministic time a ``CpSolver`` reports (0 when it has none to report)."""
    try:
        return float(solver.deterministic_time) if solver is not None else 0.0
    except Exception:  # noqa: BLE001 - a solver that failed before solving
        return 0.0


def _cpsat_status(code: Any, cp_model: Any) -> Status:
    """CP-SAT status -> Status (the one mapping for CP-SAT)."""
    return {
        cp_model.OPTIMAL: Status.OPTIMAL,
        cp_model.FEASIBLE: Status.FEASIBLE,
        cp_model.INFEASIBLE: Status.INFEASIBLE,
        cp_model.UNKNOWN: Status.NO_SOLUTION,
    }.get(code, Status.ERROR)


def solve_cpsat(
    model: Any, variables: Sequence[Any], *, time_limit_s: float | None = None,
    threads: int = 2, hint: Sequence[int] | None = None, verbose: bool = False,
    deterministic_time: float | None = None, seed: int = 0,
    assumptions: Sequence[Any] | None = None, parameters: dict[str, Any] | None = None,
) -> EngineResult:
    """Solve an OR-Tools ``CpModel`` (minimisation of an integer objective).

    ``objective`` and ``bound`` are in the model's integer units; ``hint`` (one value per
    variable) is passed with ``add_hint`` as a warm start. ``deterministic_time`` is CP-SAT's
    ``max_deterministic_time`` (the search then runs on one worker, so the limit gives the
    same answer on every run); ``seed`` its ``random_seed``. ``assumptions`` (literals of the
    model) hold for this solve (CP-SAT's ``add_assumptions``; they replace the model's earlier
    assumptions, and a call without them clears them). An invalid model, or any OR-Tools
    exception, gives ``status: error`` with the validation message. ``parameters``: more
    ``CpSolver`` parameters by name (e.g. ``{"cp_model_probing_level": 0}``), set last
    (``max_deterministic_time`` and ``num_workers`` excepted under a work budget).

    Under the solve's :class:`WorkBudget` (:func:`active_budget`) the call's deterministic
    time is ``min(deterministic_time, left)`` (so one worker) and the deterministic time
    CP-SAT reports is charged to it; with nothing left the call is not run and returns
    ``no_solution`` with ``stopped_by: "work_budget"`` (and ``info["skipped"]``).
    """
    if not is_available("cpsat"):
        raise UnavailableError("CP-SAT needs ortools", field="method")
    from ortools.sat.python import cp_model

    budget = _BUDGET.get()
    own_limit = deterministic_time
    if budget is not None:
        deterministic_time = budget.grant(own_limit)
        if deterministic_time is None:
            budget.skip()
            return EngineResult(Status.NO_SOLUTION, None, math.nan, math.nan, "cpsat", 0.0,
                                "WORK_BUDGET_SPENT", stopped_by="work_budget",
                                info={"deterministic_time": 0.0, "skipped": True})
        if math.isinf(deterministic_time):  # an unbounded budget only measures
            deterministic_time = None
    start = time.perf_counter()
    solver: Any = None
    try:
        model.clear_hints()
        model.clear_assumptions()
        if assumptions:
            model.add_assumptions(list(assumptions))
        if hint is not None:
            for v, x in zip(variables, hint, strict=True):
                model.add_hint(v, int(x))
        solver = cp_model.CpSolver()
        params = solver.parameters
        params.num_workers = 1 if deterministic_time is not None else max(1, threads)
        params.random_seed = int(seed)
        if time_limit_s is not None:
            params.max_time_in_seconds = float(time_limit_s)
        if deterministic_time is not None:
            params.max_deterministic_time = float(deterministic_time)
        params.log_search_progress = verbose
        params.relative_gap_limit = 0.0
        params.absolute_gap_limit = 0.0
        for key, value in (parameters or {}).items():
            if budget is not None and key in ("max_deterministic_time", "num_workers"):
                continue  # the budget's limit, one worker: nothing may widen them
            setattr(params, key, value)
        code = solver.solve(model)
    except Exception as exc:  # noqa: BLE001 - an engine fault never escapes the adapter
        if budget is not None:
            budget.charge(_work_of(solver), cut=False)
        return failed_result("cpsat", exc, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    used = float(solver.deterministic_time)
    cut = budget is not None and deterministic_time is not None \
        and (own_limit is None or deterministic_time < own_limit) \
        and used >= 0.95 * deterministic_time
    if budget is not None:
        budget.charge(used, cut=cut and code in (cp_model.FEASIBLE, cp_model.UNKNOWN))
    status = _cpsat_status(code, cp_model)
    message = solver.status_name(code)
    if code == cp_model.MODEL_INVALID:
        detail = model.validate() if hasattr(model, "validate") else ""
        return failed_result("cpsat", f"{message}: {detail}" if detail else message, elapsed)
    values = None
    objective = bound = math.nan
    if status.has_plan:
        values = [float(solver.value(v)) for v in variables]
        objective = float(solver.objective_value)
        bound = objective if status is Status.OPTIMAL else float(solver.best_objective_bound)
    stopped = None
    if status in (Status.FEASIBLE, Status.NO_SOLUTION):
        if cut:
            stopped = "work_budget"
        elif deterministic_time is not None and used >= 0.95 * deterministic_time:
            stopped = "deterministic_time"
        elif time_limit_s is not None:
            stopped = "time"
        else:
            stopped = "other"
    work = {"branches": int(solver.num_branches), "conflicts": int(solver.num_conflicts),
            "deterministic_time": used}  # deterministic counts
    return EngineResult(status, values, objective, bound, "cpsat", elapsed, message,
                        stopped_by=stopped, info=work)
