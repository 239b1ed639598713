r"""Logic-based Benders decomposition for exact remat + offload (``cpsat``, ``strategy=benders``).

The monolithic ``cpsat`` / ``ilp`` solve (:mod:`optmem.solvers.remat_offload_exact`) proves
8-stage chains but stalls at 10-12 stages at tight limits, where the weak side is the bound:
the link relaxation's best compute sequence is worth much more in the full model than the
relaxation says (62.33 against 52 on ``random_chain(8, seed=1)`` at 10 %). This strategy
splits the problem (digest ``shared/design/offload.md`` 0.2 and 5, thesis chapter 4,
Problem 8) into

* a **master**: the link relaxation
  :func:`~optmem.models.remat_offload.build_link_relaxation` (the phase-indexed checkpoint
  slots, integral compute binaries, the link aggregated into one relief per item), a MILP
  solved by HiGHS, whose ``makespan`` ``theta`` is an optimistic estimate of every compute
  sequence, plus the cuts below;
* a **subproblem** per compute sequence ``x`` the master proposes: the full model
  :func:`~optmem.models.remat_offload.build_remat_offload` with its horizon set just below the
  incumbent's makespan ``z`` and the compute binaries of ``x`` as CP-SAT *assumptions* (one
  emitted model for all subproblems). CP-SAT either finds a better plan (it then minimises:
  the new incumbent, replayed by the simulator) or proves that no plan of ``x`` beats ``z``.

Cuts
----
For a set ``J`` of the compute binaries (the ops of some forward slots) write
``dis_J(x) = sum_{i in J, xhat_i = 1} (1 - x_i) + sum_{i in J, xhat_i = 0} x_i`` (0 iff ``x``
agrees with ``xhat`` on ``J``) and ``theta_0`` for the better of the master's first
optimum (the link relaxation's optimum) and the caller's proven bound ``floor``. A cut is
``theta >= b - (b - theta_0) dis_J(x)``.

* **Refutation cut** (``b = z``): when the subproblem is infeasible, a *deletion filter*
  drops the assumptions of whole phases, then of single slots, as long as CP-SAT still proves
  the subproblem infeasible with only the remaining assumptions (each check bounded by
  ``extra["benders_filter_work"]`` deterministic seconds; a check that does not prove keeps
  the slot). ``J`` is what is left: typically 4 of 55 slots at ``L = 10``, so one cut removes
  every compute sequence that shares those few decisions, not one sequence as a no-good does.
  By default (``extra["benders_filter"] = "phases"``) the single-slot pass is skipped and
  ``J`` is a union of whole phases: a slightly weaker cut for half the checks or fewer (the
  single-slot checks are the expensive ones: CP-SAT's presolve proves them, near the work
  limit); ``"slots"`` runs it. Each kept set is refuted either way, so the cut's validity
  does not depend on the pass.
* **Value cut** (``J`` = all compute binaries, ``b`` = CP-SAT's proven bound of ``x`` in the
  subproblem, at least the master's value): when the subproblem finds a plan or stops at its
  work limit.
* **Host-rows bound of a proposal** (``extra["benders_host_bound"]``, default false): before
  CP-SAT, the link relaxation *with* its per-value host rows (``host_values``, the stage the
  relaxation skips at ``L = 12``: too large to solve over all sequences) is solved by HiGHS
  with the compute binaries of ``x`` fixed, a small MILP (binaries ``h`` only). Its value
  (or HiGHS's dual bound if stopped) raises the value cut's ``b``; when it reaches the
  incumbent ``z``, CP-SAT is skipped and the cut is a refutation cut (``b = z``) whose ``J``
  comes from the same deletion filter with this relaxation as the check
  (:func:`host_filter`). Measured
  (``benchmarks/results/remat_offload_proofs.md``): on ``random_chain(12, seed=1)`` at its
  10 % limit the first master's sequence is worth 67.64 in the master, 71.03 in the host
  rows, and CP-SAT finds 96.78 with bound 67.67 on it in 60 s. Off by default: in 300 s
  runs it changed no bound (the incumbent, 71.31 there, stays above the host rows' value
  of the proposals, so the cuts remove single sequences), and without the warm-up a 4-stage
  chain the loop proves in 1.3 CPU s was not proven in 240 s with it (a host cut skips
  CP-SAT, which finds the better plans and the small refuted sets).

Why the bound is valid
----------------------
Let ``x*`` be the compute sequence of an optimal plan of the model's class, of makespan
``v*``. The point (``x*``, ``theta = v*``, the relaxation's other variables as built in the
proof of :func:`~optmem.models.remat_offload.build_link_relaxation` with ``T = v*``) satisfies
the relaxation's rows. It satisfies every cut: if ``x*`` differs from ``xhat`` on ``J``, the
right-hand side is at most ``theta_0``, the least makespan of the relaxation or the
better proven bound ``floor`` of the caller (the warm-up search, the relaxation's slower
stages), so at most ``v*``. If it agrees on ``J``: for a refutation cut, the full model
with the compute binaries of ``J`` fixed as in ``xhat`` has no solution with all times at
most ``z - 1 / (2 s)`` (``build_remat_offload``: the horizon bounds every time variable of
every plan of makespan at most the horizon); on the exact time grid ``1 / s``
(:func:`~optmem.solvers.remat_offload_exact.cpsat_time_scale`, when exact: every
duration and transfer time is a multiple of ``1 / s``, and so is every simulated start and
end) no plan agreeing on ``J`` is faster than ``z``, so ``v* >= z = b``. On the rounded grid
(durations not on any grid of at most 1e6 steps per unit: the subproblem's durations are
rounded *down* to ``1 / s``, as in the ``full`` strategy) a plan of the true durations and
makespan ``T`` maps onto a subproblem solution of makespan ``floor(T s) / s`` (floor every
time: precedence rows keep, since ``floor(a + d) >= floor(a) + floor(d)``; the premise on
which CONTRACT 13 states the rounded model's bound valid), so the refutation proves
``v* >= (floor(z s - 1/2) + 1) / s`` instead, ``b`` = that or ``z``, the smaller
(:meth:`_Loop.refuted`); grid lifts are not taken there (``solve_benders``).
For a value cut ``x* = xhat`` and ``b`` is CP-SAT's proven bound of that sequence (or the
master's value there, itself at most ``v*``), or the host-rows bound of ``xhat``: the proof
of :func:`~optmem.models.remat_offload.build_link_relaxation` maps the optimal plan (compute
binaries ``x* = xhat``) to a point of that relaxation with the same compute binaries and
``T = v*``, so the relaxation with ``xhat`` fixed has a solution of value ``v*`` and its
optimum (and any dual bound of HiGHS on it) is at most ``v*``; the same holds with only the
slots of ``J`` fixed (:func:`host_filter`), for every plan agreeing with ``xhat`` on ``J``,
so a host refutation cut (that bound at least ``z``) gives ``v* >= z = b`` as well.
Hence the master's optimum, and any dual bound of HiGHS on it, is at most ``v*`` (in the
original units: the grid is exact), and the strategy reports ``optimal`` only when that
bound meets the incumbent's simulated makespan.

**First-found proposals** (``extra["benders_first_found"]``, default false; windowed
masters only, ``extra["relaxation_window"]``): a master re-solve stops at its first
solution in the window ``[bound, z - 1 / (2 s)]`` (HiGHS ``mip_max_improving_sols = 1``)
and that solution's compute sequence ``xhat`` is the next proposal. Nothing above uses the
proposal's optimality: a refutation cut holds for any ``xhat`` (its ``J`` is refuted by
CP-SAT), and the stopped master's dual bound, capped at ``z``, is a bound by the argument
of :func:`_window`. Only a value cut's ``b`` may not be the stopped solution's makespan
(the master's least makespan with ``xhat`` fixed is at most ``v*`` when ``x* = xhat``, a
non-optimal solution's can be larger): it is CP-SAT's proven bound of ``xhat`` (or the
host-rows bound) alone (``_subproblem``'s ``least``). A windowed master with no solution
still proves the incumbent optimal (:func:`_window`). Measured on ``random_chain(12,
seed=1)`` at 10 % (``benchmarks/results/remat_offload_proofs.md``, ``ro16``): 16
iterations (masters of 6-125 s) in 645 s where optimal re-solves took 150-200 s each,
52 in 2400 s, every proposal refuted, the window still not empty: off by default.

**Compute-class cuts** (``extra["benders_compute_cut"]``, default false; windowed masters
on the exact grid; ``ro24``; proof in :func:`_compute_cut`): after a refutation cut, CP-SAT
checks the proposal's whole *compute class*, the model with the row ``compute_time >= C``
(``C`` the proposal's forward and backward time, :func:`compute_time`) and no assumptions,
within ``extra["benders_compute_work"]`` deterministic seconds (60); refuted, the master
gets ``compute_time <= C - 1 / s``, which removes at once every sequence of that compute
time or more (on ``random_chain(12, seed=1)`` at 10 % most of the window's proposals share
one compute time, 71, and differ elsewhere, each refutation cut removing few of them); a
plan found there below the incumbent is replayed and taken. ``report.benders``:
``compute_checks`` (``[C, status]`` per check) and ``compute_cuts``.

Termination: a value cut removes ``xhat`` unless ``b`` does not exceed the master's value
there; the subproblem's work limit is then doubled for the next proposal of ``xhat``. The
loop ends at the time limit, at ``extra["benders_iterations"]`` (deterministic), or when the
bound meets the incumbent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from optmem.engines import adapters as engines
from optmem.engines.adapters import EngineResult
from optmem.errors import OptmemInputError, PlanError
from optmem.models import checkpoint_ilp as ck
from optmem.models.formulation import (
    CpsatModel,
    Expr,
    Model,
    Relation,
    grid_ceiling,
    to_cpsat,
    to_pulp,
)
from optmem.models.remat_offload import (
    RematOffloadModel,
    build_link_relaxation,
    with_fixed,
)
from optmem.plan import AnyOp
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.offload import simulate_offload
from optmem.solvers.options import flag, positive_float, positive_int
from optmem.solvers.remat_offload import (
    LEAST_ENGINE_TIME_S,
    discretized,
    lower_bound,
    no_plan_result,
    plan_result,
)
from optmem.solvers.time_budget import Deadline

DEFAULT_SUB_WORK = 10.0  # CP-SAT deterministic seconds per subproblem (doubled on a repeat)
DEFAULT_FILTER_WORK = 0.25  # CP-SAT deterministic seconds per deletion-filter check
HOST_CHECK_S = 10.0  # HiGHS seconds per host-rows filter check (host_filter), within the limit
READ_DEADLINES_DEFAULT = False  # extra["relaxation_read_deadlines"] (strategy=benders: true)
CUMULATIVE_READS_DEFAULT = False  # extra["relaxation_cumulative_reads"] (with the read rows)
# extra["relaxation_window"]: the re-solves' makespan floor and cut-off (_window); true
# under strategy=benders (BENDERS_EXTRA of remat_offload_exact)
WINDOW_DEFAULT = False
# extra["benders_first_found"]: a windowed master stops at its first solution in the window
FIRST_FOUND_DEFAULT = False
# extra["benders_compute_cut"]: after a refutation, refute the proposal's compute class
# (every plan of at least its compute time) at once (_compute_cut); its CP-SAT work
COMPUTE_CUT_DEFAULT = False
DEFAULT_COMPUTE_WORK = 60.0  # extra["benders_compute_work"], deterministic seconds per check
ROUNDED_CLAIM_TOLERANCE = 1e-6  # relative: optimal on the rounded grid (solve_benders)
FILTER_MODES = ("phases", "slots")  # extra["benders_filter"] (default first): filter passes
LOG = logging.getLogger(__name__)


@dataclass
class _State:
    """The incumbent, the emitted subproblem model and the loop's counters."""

    plan: tuple[AnyOp, ...] | None
    makespan: float
    limit: int
    beta: float
    cp: CpsatModel | None = None
    single_slots: bool = False  # the deletion filter's single-slot pass (benders_filter)
    host: Model | None = None  # the host-rows relaxation (benders_host_bound), else None
    counts: dict[str, Any] = field(default_factory=lambda: {
        "iterations": 0, "refutation_cuts": 0, "value_cuts": 0, "filter_checks": 0,
        "improvements": 0, "cut_slots": [], "master_nodes": 0, "host_bounds": [],
        "host_cuts": 0, "window_proofs": 0, "first_found": 0, "compute_checks": [],
        "compute_cuts": 0,
        "cpsat_deterministic_time": 0.0, "cpsat_branches": 0})


@dataclass
class _Loop:
    """What every iteration shares: the two models, the settings and the incumbent.

    ``theta`` is the index of the master's makespan, ``theta0`` the master's first optimum
    (the cuts' floor, module docstring), ``left()`` the time left of the solve's limit.
    """

    built: RematOffloadModel
    master: Model
    theta: int
    slots: list[ck.Slot]
    options: SolveOptions
    scale: int
    filter_work: float
    state: _State
    left: Callable[[], float | None]
    theta0: float = -math.inf
    exact: bool = True  # the time grid 1 / scale is exact (else durations rounded down)
    compute_work: float | None = None  # benders_compute_cut's work per check (None: off)
    tried: set[tuple[int, int]] = field(default_factory=set)  # compute classes checked

    def refuted(self, z: float) -> float:
        """The value a refutation of the subproblem of horizon ``z`` proves (see below).

        On the exact grid, ``z``. On the rounded grid (``exact`` false) the subproblem, of
        durations rounded down to ``1 / s``, is refuted with every time at most ``c / s``,
        ``c = floor(z s - 1/2)`` (:func:`_emit`); a plan of the true durations and makespan
        ``T`` maps onto a solution of it with makespan ``floor(T s) / s`` (the premise of the
        rounded grid, :mod:`optmem.models.remat_offload`), so every plan agreeing with the
        refuted set has ``floor(T s) >= c + 1``: ``T >= (c + 1) / s``, which can lie a hair
        below ``z``; the least of the two, less a relative 1e-12 for the float arithmetic.
        """
        if self.exact:
            return z
        c = math.floor(z * self.scale - 0.5)
        return min(z, (c + 1) / self.scale) - 1e-12 * max(1.0, abs(z))

    def cut(self, slots: Sequence[ck.Slot], xhat: dict[int, int], b: float, name: str) -> None:
        """``theta >= b - (b - theta0) dis_J(x)`` over the op binaries of ``slots``."""
        self.master.add(Expr([(self.theta, 1.0)]) + _disagreement(slots, xhat)
                        * (b - self.theta0) >= b, name)


def _iterations(options: SolveOptions) -> int | None:
    if options.extra.get("benders_iterations") is None:
        return None
    return positive_int(options, "benders_iterations", 1)


def _filter_mode(options: SolveOptions) -> str:
    value = options.extra.get("benders_filter", FILTER_MODES[0])
    if value not in FILTER_MODES:
        raise OptmemInputError(f"expected benders_filter one of {', '.join(FILTER_MODES)}, "
                               f"got {value!r}", field="benders_filter")
    return str(value)


def check_benders_options(options: SolveOptions) -> None:
    """Check the loop's ``extra`` options (:class:`OptmemInputError` on a bad value).

    Called before any work whatever the strategy, so that a bad value is refused even where
    the loop would not read it (``strategy=full``).
    """
    positive_float(options, "benders_work", DEFAULT_SUB_WORK)
    positive_float(options, "benders_filter_work", DEFAULT_FILTER_WORK)
    _iterations(options)
    _filter_mode(options)
    flag(options, "benders_host_bound", False)
    flag(options, "benders_first_found", FIRST_FOUND_DEFAULT)
    flag(options, "benders_compute_cut", COMPUTE_CUT_DEFAULT)
    positive_float(options, "benders_compute_work", DEFAULT_COMPUTE_WORK)


def describe(slots: Sequence[ck.Slot], xhat: dict[int, int]) -> str:
    """The ops ``xhat`` runs in ``slots``, in order, as ``phase:op`` (the loop's debug log)."""
    return " ".join(f"{sl.phase}:{kind.value}{sl.stage}" for sl in slots
                    for kind, i in sl.ops if xhat[i])


def _disagreement(slots: Sequence[ck.Slot], xhat: dict[int, int]) -> Expr:
    """``dis_J(x)`` over the op binaries of ``slots`` (module docstring)."""
    terms = []
    for sl in slots:
        for _, i in sl.ops:
            one = Expr([(i, 1.0)])
            terms.append(1 - one if xhat[i] else one)
    return Expr.sum(terms)


def _emit(built: RematOffloadModel, makespan: float, scale: int,
          least_compute: float | None = None) -> CpsatModel:
    """The subproblem model: every time at most ``makespan - 1 / (2 scale)`` (floored).

    ``least_compute``: with the row ``compute time >= least_compute`` (:func:`_compute_cut`).
    """
    model = with_fixed(built, {}, makespan - 0.5 / scale)
    if least_compute is not None:
        model.add(Relation(compute_time(built), least_compute, None), "benders_compute_class")
    return to_cpsat(model, scale=scale)


def compute_time(built: RematOffloadModel) -> Expr:
    """The compute sequence's time (forward ops' times plus the backward's) over its binaries.

    The checkpoint formulation's objective (:mod:`optmem.models.checkpoint_ilp`,
    Objective); the master and the model share these binaries' indices.
    """
    return Expr(list(built.checkpoint.objective.items())) + built.checkpoint.objective_const


def _assume(cp: CpsatModel, slots: Sequence[ck.Slot], xhat: dict[int, int]) -> list[Any]:
    return [cp.variables[i] if xhat[i] else cp.variables[i].Not()
            for sl in slots for _, i in sl.ops]


def _count(state: _State, info: dict[str, Any]) -> None:
    """Add a CP-SAT call's deterministic work to the loop's counters."""
    state.counts["cpsat_deterministic_time"] += float(info.get("deterministic_time", 0.0))
    state.counts["cpsat_branches"] += int(info.get("branches", 0))


def _cpsat(cp: CpsatModel, options: SolveOptions, slots: Sequence[ck.Slot],
           xhat: dict[int, int], state: _State, **settings: Any) -> EngineResult:
    """CP-SAT on ``cp`` with ``xhat`` on ``slots`` assumed.

    The options' engine settings (:func:`~optmem.engines.adapters.cpsat_settings`),
    overridden by ``settings``.
    """
    out = engines.solve_cpsat(cp.cp, cp.variables, assumptions=_assume(cp, slots, xhat),
                              **{**engines.cpsat_settings(options), **settings})
    _count(state, out.info)
    return out


def _refuted(cp: CpsatModel, slots: Sequence[ck.Slot], xhat: dict[int, int],
             options: SolveOptions, work: float, state: _State,
             time_limit_s: float | None = None) -> bool:
    state.counts["filter_checks"] += 1
    out = _cpsat(cp, options, slots, xhat, state, threads=1, deterministic_time=work,
                 time_limit_s=time_limit_s)
    return out.status is Status.INFEASIBLE


def deletion_filter(cp: CpsatModel, slots: Sequence[ck.Slot], xhat: dict[int, int],
                    options: SolveOptions, work: float, state: _State,
                    left: Callable[[], float | None] = lambda: None, *,
                    single_slots: bool = True) -> list[ck.Slot]:
    """A subset of ``slots`` whose assumptions alone keep the subproblem infeasible.

    ``left()`` is the time left of the solve's limit (``None``: none); when it runs out the
    filter stops and returns what it has (a set shrinks only when a check proves it).

    Whole phases first, then (``single_slots``) single slots; a check that does not prove
    infeasibility within ``work`` keeps what it tried to drop, so the result is always a
    refuted set.
    """
    keep = list(slots)
    phases = [[sl for sl in slots if sl.phase == k] for k in sorted({sl.phase for sl in slots})]
    singles = [[sl] for sl in slots] if single_slots else []
    for group in [*phases, *singles]:
        limit = left()
        if limit is not None and limit <= LEAST_ENGINE_TIME_S:
            break
        trial = [sl for sl in keep if not any(sl is g for g in group)]
        if len(trial) < len(keep) and _refuted(cp, trial, xhat, options, work, state, limit):
            keep = trial
    return keep


def solve_benders(problem: RematOffloadProblem, options: SolveOptions, *,
                  built: RematOffloadModel, scale: int,
                  incumbent: tuple[float, tuple[AnyOp, ...]] | None, report: dict[str, Any],
                  floor: float = -math.inf,
                  first: tuple[Model, EngineResult] | None = None,
                  deadline: Deadline | None = None, exact: bool = True) -> Result:
    """Run the decomposition (module docstring) on the CP-SAT time grid ``1 / scale``.

    ``exact``: every duration and transfer time of the chain is a multiple of ``1 / scale``
    (bounds are then lifted to the grid, a refutation proves the incumbent's makespan).
    Otherwise ``built`` has its durations rounded down to the grid (``build_remat_offload(...,
    grid=scale)``, the rounded grid of
    :func:`~optmem.solvers.remat_offload_exact.cpsat_time_scale`) and every bound stays in
    the original units: the master (the link relaxation of the true durations) as it is,
    not lifted; a refutation proves :meth:`_Loop.refuted` (a hair below the incumbent at
    most); a value cut CP-SAT's bound of the rounded subproblem (a plan of the true
    durations maps onto it with no larger makespan), at most that refuted value; a window
    proof ``z - 1 / (2 s)`` (:func:`_window`). Plans are replayed on the true durations,
    and ``optimal`` is claimed only when that bound meets the replayed makespan (within
    :data:`ROUNDED_CLAIM_TOLERANCE` relative, the ``full`` strategy's rule on that grid).
    ``deadline`` (default: ``options.time_limit_s`` from now) caps every engine call; the
    loop stops before a master or subproblem call with less than
    :data:`~optmem.solvers.remat_offload.LEAST_ENGINE_TIME_S` left.

    ``built`` is the full model (no grid), ``incumbent`` the best verified plan so far
    (simulated makespan, plan) and ``floor`` a proven bound from elsewhere (the warm-up
    search); the reported bound is the better of it and the master's. ``first`` is the
    master (the link relaxation with the deadline rows of ``extra["relaxation_deadlines"]``)
    already solved by the caller, with that outcome: an optimal one is the first proposal.
    ``infeasible`` when the loop proves that no plan of the class fits (the relaxation has
    no solution, or the cuts remove every compute sequence below the default horizon).
    """
    began = time.monotonic()
    disc, beta = discretized(problem, options)
    sub_work = positive_float(options, "benders_work", DEFAULT_SUB_WORK)
    max_iter = _iterations(options)
    window = flag(options, "relaxation_window", WINDOW_DEFAULT)
    first_found = flag(options, "benders_first_found", FIRST_FOUND_DEFAULT)
    if first is None:
        master = build_link_relaxation(disc.chain, disc.memory_limit, beta,
                                       sweeps=built.checkpoint.sweeps,
                                       deadlines=flag(options, "relaxation_deadlines", True),
                                       host_values=flag(options, "relaxation_values", True),
                                       read_deadlines=flag(options, "relaxation_read_deadlines",
                                                           READ_DEADLINES_DEFAULT),
                                       cumulative_reads=flag(options,
                                                             "relaxation_cumulative_reads",
                                                             CUMULATIVE_READS_DEFAULT))
    else:
        master = first[0]
    plan, z = (incumbent[1], incumbent[0]) if incumbent else (None, built.horizon)

    if deadline is None:
        deadline = Deadline.start(options.time_limit_s, margin=0.0)
    left = deadline.left
    lift: Callable[[float], float] = \
        (lambda b: grid_ceiling(b, scale)) if exact else (lambda b: b)
    # the bound meets the incumbent: relative 1e-9 on the exact grid (lifted bounds); on
    # the rounded one the full strategy's rule there (its engine bound within 1e-6 of the
    # replayed plan), since the cuts' values lie up to half a grid step or HiGHS's 1e-9
    # margin below the incumbent even when they prove it
    claim_tol = 1e-9 if exact else ROUNDED_CLAIM_TOLERANCE

    host = build_link_relaxation(disc.chain, disc.memory_limit, beta,
                                 sweeps=built.checkpoint.sweeps,
                                 read_deadlines=flag(options, "relaxation_read_deadlines",
                                                     READ_DEADLINES_DEFAULT),
                                 cumulative_reads=flag(options, "relaxation_cumulative_reads",
                                                       CUMULATIVE_READS_DEFAULT)) \
        if flag(options, "benders_host_bound", False) else None
    loop = _Loop(built, master, next(i for i, v in enumerate(master.vars)
                                     if v.name == "makespan"), built.slots, options, scale,
                 positive_float(options, "benders_filter_work", DEFAULT_FILTER_WORK),
                 _State(plan, z, limit=disc.memory_limit, beta=beta,
                        single_slots=_filter_mode(options) == "slots", host=host), left,
                 exact=exact)
    if window and exact and flag(options, "benders_compute_cut", COMPUTE_CUT_DEFAULT):
        loop.compute_work = positive_float(options, "benders_compute_work",
                                           DEFAULT_COMPUTE_WORK)
    state = loop.state
    opvars = [i for sl in loop.slots for _, i in sl.ops]
    report.update({"strategy": "benders", "model": built.info, "time_scale": scale,
                   "exact_times": exact, "benders": state.counts})
    bound = floor
    tries: dict[tuple[int, ...], int] = {}
    status = Status.FEASIBLE
    no_plan = False
    while True:
        if max_iter is not None and state.counts["iterations"] >= max_iter:
            break
        if first is not None and first[1].status is Status.OPTIMAL:
            out, first = first[1], None  # solved by the caller: no engine call
            windowed = False
        else:
            if deadline.spent(LEAST_ENGINE_TIME_S):  # no time for a master
                break
            first = None
            windowed = window and state.plan is not None and math.isfinite(loop.theta0)
            pm = to_pulp(_window(master, loop.theta, bound, state.makespan, scale)
                         if windowed else master)
            settings = {**engines.pulp_settings(options), "time_limit_s": left()}
            if windowed and first_found:  # stop at the first solution in the window
                settings["highs_options"] = {"mip_max_improving_sols": 1}
            out = engines.solve_pulp(pm.problem, pm.all_variables, "highs", **settings)
            state.counts["master_nodes"] += int(out.info.get("nodes", 0) or 0)
            LOG.info("benders master: %s, value %.6g, bound %.6g, %.1f s, %s nodes",
                     out.status, out.objective, out.bound, out.time_s, out.info.get("nodes"))
            if windowed and not out.failed and math.isfinite(out.bound):
                # the windowed master's dual bound, capped at z, is at most v* (_window)
                capped = min(out.bound - 1e-9 * max(1.0, abs(out.bound)),
                             _window_proof(state.makespan, scale, exact))
                bound = max(bound, lift(capped))
                out = replace(out, bound=min(out.bound, state.makespan))
            if windowed and out.status is Status.INFEASIBLE:
                # no compute sequence's master value is below z - 1 / (2 s): _window
                state.counts["window_proofs"] += 1
                bound = max(bound, _window_proof(state.makespan, scale, exact))
                status = Status.OPTIMAL if exact else status  # rounded: checked below
                break
        if out.status is Status.INFEASIBLE and (state.plan is None or
                                                 not math.isfinite(loop.theta0)):
            # no compute sequence is left: every plan of the class satisfies every row and
            # every cut of the master (module docstring)
            report["note"] = ("the link relaxation has no solution: no plan fits"
                              if not math.isfinite(loop.theta0) else
                              "the cuts leave no compute sequence: no plan fits")
            no_plan = True
            break
        if out.failed or out.values is None or not math.isfinite(out.bound):
            report["master"] = f"{out.status}: {out.message}"
            break
        master_bound = out.bound - 1e-9 * max(1.0, abs(out.bound))
        bound = max(bound, lift(master_bound))  # exact grid: plans lie on it
        if not math.isfinite(loop.theta0):  # at most every sequence's relaxation value
            # and at most the optimum, as is the floor: the cuts' validity needs only that
            loop.theta0 = max(master_bound, floor)
            report["relaxation"] = {**report.get("relaxation", {}), "bound": master_bound,
                                    "seconds": round(out.time_s, 3)}
        if bound >= state.makespan - claim_tol * max(1.0, state.makespan):
            status = Status.OPTIMAL
            no_plan = state.plan is None  # nothing below the default horizon, which is
            break  # above every plan of the class
        found = windowed and first_found and out.status is Status.FEASIBLE
        if out.status is not Status.OPTIMAL and not found:
            break  # a master stopped early gives its bound, not a trustworthy proposal
        if deadline.spent(LEAST_ENGINE_TIME_S):  # no time for the subproblem
            break
        state.counts["iterations"] += 1
        state.counts["first_found"] += found
        xhat = {i: int(round(out.values[i])) for i in opvars}
        key = tuple(xhat[i] for i in opvars)
        tries[key] = tries.get(key, 0) + 1
        LOG.debug("benders %d: proposal (master %.6g) %s", state.counts["iterations"],
                  out.values[loop.theta], describe(loop.slots, xhat))
        work = sub_work * 2 ** (tries[key] - 1)
        b = _subproblem(loop, xhat, work, out.values[loop.theta], least=False) if found \
            else _subproblem(loop, xhat, work, out.values[loop.theta])
        LOG.info("benders %d: bound %.6g, incumbent %.6g, cut %.6g, %.1f s",
                 state.counts["iterations"], bound, state.makespan, b or math.nan,
                 time.monotonic() - began)
        if b is None:
            break
    report["engine_time_s"] = round(time.monotonic() - began, 3)
    report["engine_work"] = {"deterministic_time": state.counts["cpsat_deterministic_time"],
                             "branches": state.counts["cpsat_branches"],
                             "master_nodes": state.counts["master_nodes"]}
    if no_plan:
        report["benders"]["bound"] = math.inf
        return no_plan_result(problem, options, "cpsat", Status.INFEASIBLE, report)
    bound = lift(max(bound, lower_bound(problem)))
    if status is Status.FEASIBLE and state.plan is not None and \
            bound >= state.makespan - claim_tol * max(1.0, state.makespan):
        status = Status.OPTIMAL  # the bound lifted to the time grid meets the incumbent
    report["benders"]["bound"] = bound
    if state.plan is None:
        return no_plan_result(problem, options, "cpsat", Status.NO_SOLUTION,
                              report).with_(bound=bound)
    res = plan_result(problem, options, state.plan, method="cpsat", solver="cpsat",
                      status=status, report=report)
    if res.status is Status.FEASIBLE:
        res = res.with_(bound=min(bound, res.objective))
    return res


def _subproblem(loop: _Loop, xhat: dict[int, int], work: float, value: float, *,
                least: bool = True) -> float | None:
    """Solve the subproblem of ``xhat`` (master value ``value``), add its cut to the master.

    Returns the cut's ``b`` (``value`` when the subproblem proves nothing above it: no cut
    is added then, since the master's solution already satisfies it; the caller doubles the
    work for the next proposal of ``xhat``), ``None`` when CP-SAT failed or was not run
    because the solve's work budget (``SolveOptions.work_budget``) is spent: without a cut
    the master would propose ``xhat`` again, for ever.

    ``least``: ``value`` is the master's least makespan with ``xhat`` (an optimal master
    solution), hence at most every plan of ``xhat``, and may be ``b``. A solution of a
    stopped master (``benders_first_found``) is not: its makespan may be above the master's
    least with ``xhat``, so ``b`` is then only the host-rows bound or CP-SAT's proven bound
    (module docstring), and a value cut is added whenever that is above ``theta_0``.
    """
    state = loop.state
    n = state.counts["iterations"]
    hosted = host_bound(state.host, xhat, loop.options, loop.left())
    state.counts["host_bounds"].append(round(hosted, 6) if math.isfinite(hosted) else None)
    if hosted >= state.makespan - 1e-9 * max(1.0, state.makespan):
        kept = host_filter(loop, xhat)
        loop.cut(kept, xhat, state.makespan, f"benders_host_{n}")
        state.counts["host_cuts"] += 1
        state.counts["cut_slots"].append(len(kept))
        return state.makespan
    if state.cp is None:
        state.cp = _emit(loop.built, state.makespan, loop.scale)
    cp = state.cp
    out = _cpsat(cp, loop.options, loop.slots, xhat, state, time_limit_s=loop.left(),
                 deterministic_time=work)
    if out.failed or out.info.get("skipped"):
        return None  # an engine failure, or the solve's work budget is spent: no cut
    if out.status is Status.INFEASIBLE:
        kept = deletion_filter(cp, loop.slots, xhat, loop.options, loop.filter_work, state,
                               loop.left, single_slots=state.single_slots)
        LOG.info("benders %d: refuted, cut of %d of %d slots", n, len(kept), len(loop.slots))
        LOG.debug("benders %d: cut %s | slots %s", n, describe(kept, xhat),
                  " ".join(f"{sl.phase}:{sl.stage}" for sl in kept))
        proven = loop.refuted(state.makespan)
        loop.cut(kept, xhat, proven, f"benders_refute_{n}")
        state.counts["refutation_cuts"] += 1
        state.counts["cut_slots"].append(len(kept))
        if loop.compute_work is not None:
            _compute_cut(loop, xhat, n)
        return proven
    if out.status.has_plan and out.values is not None:
        _improve(loop, loop.built.decode(cp.values(out.values)))
    b = max(value, hosted) if least else hosted
    if math.isfinite(out.bound):
        b = max(b, min(cp.objective(out.bound) - 1e-9 * max(1.0, abs(value)),
                       loop.refuted(state.makespan)))
    over = value if least else loop.theta0
    if b > over + 1e-9 * max(1.0, abs(over)):  # else the cut would not remove xhat
        loop.cut(loop.slots, xhat, b, f"benders_value_{n}")
        state.counts["value_cuts"] += 1
    return b


def _compute_cut(loop: _Loop, xhat: dict[int, int], n: int) -> None:
    r"""Refute the compute class of a refuted proposal: ``compute >= C(xhat)`` (``C``: time).

    ``extra["benders_compute_cut"]`` (windowed masters on the exact grid only; the caller
    sets ``loop.compute_work``). CP-SAT solves the subproblem model of horizon
    ``z - 1 / (2 s)`` with the row ``compute_time >= C`` and no assumptions, within
    ``extra["benders_compute_work"]`` deterministic seconds; each class ``(C, z)`` once.

    * **Refuted**: no plan of compute time at least ``C`` has every time at most
      ``z - 1 / (2 s)`` (the model's horizon bounds every time of a plan of that makespan),
      so on the exact grid ``1 / s`` every such plan has makespan ``>= z``. The master gets
      the row ``compute_time <= C - 1 / s`` (compute times lie on the grid: every duration
      is a multiple of ``1 / s``). It is not valid for every plan, only for those faster
      than ``z``, and that suffices for every figure the loop takes from a windowed master:
      let ``x*`` be an optimal plan's sequence, of makespan ``v*``. If ``v* < z`` then
      ``compute(x*) < C``, so the point of ``x*`` (module docstring) satisfies the row and
      every proof there holds unchanged (the master's optimum and dual bounds at most
      ``v*``, an empty window proves ``z``: :func:`_window`). If ``v* >= z``, the
      incumbent (of makespan ``z``, or a later one below it) is optimal and every bound
      the loop takes from a windowed master is capped at the incumbent (``solve_benders``),
      so at most ``v*``; an empty window then claims what is true. The incumbent only
      falls, so a row proven for ``z`` stays valid under a later ``z' < z`` by the same
      argument. The cuts ``theta >= b - (b - theta_0) dis_J(x)`` keep their proofs
      (they do not depend on the other rows).
    * **A plan**: a plan below ``z`` (of compute time at least ``C``), replayed by the
      simulator and taken as the incumbent when faster (:func:`_improve`).
    * **Neither** within the work: nothing.
    """
    state = loop.state
    expr = compute_time(loop.built)
    c = expr.const + sum(coef * xhat[i] for i, coef in expr.terms)
    key = (round(c * loop.scale), round(state.makespan * loop.scale))
    if key in loop.tried or state.plan is None:
        return
    loop.tried.add(key)
    cp = _emit(loop.built, state.makespan, loop.scale, least_compute=c)
    out = engines.solve_cpsat(cp.cp, cp.variables,
                              **{**engines.cpsat_settings(loop.options), "threads": 1,
                                 "deterministic_time": loop.compute_work,
                                 "time_limit_s": loop.left()})
    _count(state, out.info)
    state.counts["compute_checks"].append([round(c, 6), str(out.status)])
    LOG.info("benders %d: compute class >= %.6g: %s", n, c, out.status)
    if out.status is Status.INFEASIBLE:
        loop.master.add(Relation(expr, None, c - 1.0 / loop.scale),
                        f"benders_compute_{n}")
        state.counts["compute_cuts"] += 1
    elif out.status.has_plan and out.values is not None:
        _improve(loop, loop.built.decode(cp.values(out.values)))


def _window_proof(z: float, scale: int, exact: bool) -> float:
    """What a windowed master with no solution proves (:func:`_window`).

    ``z`` on the exact grid; on the rounded grid only ``z - 1 / (2 s)`` (every compute
    sequence's master value is above it, and the plans need not lie on the grid), less a
    relative 1e-9 for HiGHS's tolerances.
    """
    if exact:
        return z
    return z - 0.5 / scale - 1e-9 * max(1.0, abs(z))


def _window(master: Model, theta: int, bound: float, makespan: float, scale: int) -> Model:
    r"""The master with its makespan ``theta`` kept in ``[bound, z - 1 / (2 s)]``.

    ``extra["relaxation_window"]`` (default :data:`WINDOW_DEFAULT`): a copy of ``master``
    (its cuts stay in ``master``) with the two rows

    * ``theta >= bound - 1e-6 max(1, |bound|)``, ``bound`` the loop's proven bound: valid
      because ``bound <= v*`` and the point of the optimal plan (module docstring) has
      ``theta = v*``, so it satisfies the row and the master keeps every property the
      module docstring proves (its optimum and dual bounds stay at most ``v*``). It gives
      HiGHS the root bound at once, so a re-solve whose optimum did not rise ends as soon
      as it finds a sequence there;
    * ``theta <= z - 1 / (2 s)``, ``z`` the incumbent's makespan, ``s`` the exact time grid
      (required by the loop): a proposal is useful only below ``z``, so every solution the
      loop would use is kept, and when HiGHS proves the windowed master *infeasible*, every
      compute sequence has a master value above ``z - 1 / (2 s)``, hence (the master's
      optimum is at most ``v*``, plans lie on the grid ``1 / s``) ``v* >= z``: the
      incumbent is optimal (``report.benders.window_proofs``). The caller adds this row only
      with an incumbent and a finite ``theta_0``, so that infeasibility is not confused
      with "no plan fits". Its dual bound is not always at most ``v*``, but capped at
      ``z`` it is: if the unwindowed master's optimum ``m <= v*`` is below the cutoff the
      windowed master contains its optimal point, so its dual bound is at most ``m``; if
      not, ``v* >= m > z - 1 / (2 s)``, so ``v* >= z`` on the grid.

    The first row's slack (1e-6 relative) only weakens it; the second's half grid step is far
    above HiGHS's feasibility tolerance.
    """
    out = replace(master, constraints=list(master.constraints))
    lo = bound - 1e-6 * max(1.0, abs(bound)) if math.isfinite(bound) else None
    out.add(Relation(Expr([(theta, 1.0)]), lo, makespan - 0.5 / scale), "benders_window")
    return out


def host_bound(host: Model | None, xhat: dict[int, int], options: SolveOptions,
               time_limit_s: float | None) -> float:
    """The host-rows relaxation's bound with the compute binaries ``xhat`` fixed.

    ``host`` is :func:`~optmem.models.remat_offload.build_link_relaxation` with
    ``host_values`` (its first variables are the compute binaries, as in the model); the
    value, or HiGHS's dual bound when stopped, is at most every plan of the compute
    sequence ``xhat`` (module docstring). ``-inf`` without ``host`` or when HiGHS fails;
    ``inf`` when the fixed relaxation has no solution (no plan of ``xhat`` fits).
    """
    if host is None:
        return -math.inf
    fixed = replace(host, constraints=list(host.constraints))
    for i, x in xhat.items():
        fixed.add(Relation(Expr([(i, 1.0)]), float(x), float(x)), f"fix_{i}")
    pm = to_pulp(fixed)
    out = engines.solve_pulp(pm.problem, pm.all_variables, "highs",
                             **{**engines.pulp_settings(options), "time_limit_s": time_limit_s})
    if out.status is Status.INFEASIBLE:
        return math.inf
    if out.failed or not math.isfinite(out.bound):
        return -math.inf
    return out.bound - 1e-9 * max(1.0, abs(out.bound))


def host_filter(loop: _Loop, xhat: dict[int, int]) -> list[ck.Slot]:
    """A subset ``J`` of the slots whose ``xhat`` keeps the host-rows bound at the incumbent.

    The deletion filter of the refutation cuts with the host-rows relaxation as the check:
    whole phases are dropped from the fixing while the relaxation with the rest fixed
    (a MILP over the dropped slots' binaries; HiGHS within :data:`HOST_CHECK_S` of the
    time left, its dual bound counts) still bounds every plan agreeing on them at or above
    the incumbent ``z``. The cut ``theta >= z - (z - theta_0) dis_J(x)`` is then valid by
    the argument of the module docstring (the optimal plan, if it agrees with ``xhat`` on
    ``J``, is a point of that fixed relaxation).
    """
    state = loop.state
    keep = list(loop.slots)
    for phase in sorted({sl.phase for sl in loop.slots}):
        left = loop.left()
        if left is not None and left <= LEAST_ENGINE_TIME_S:
            break
        trial = [sl for sl in keep if sl.phase != phase]
        if len(trial) == len(keep):
            continue
        bound = host_bound(state.host, {i: xhat[i] for sl in trial for _, i in sl.ops},
                           loop.options, None if left is None else min(left, HOST_CHECK_S))
        state.counts["filter_checks"] += 1
        if bound >= state.makespan - 1e-9 * max(1.0, state.makespan):
            keep = trial
    return keep


def _improve(loop: _Loop, plan: tuple[AnyOp, ...]) -> None:
    """Replay a subproblem's plan; a faster one is the new incumbent (a lower horizon)."""
    state = loop.state
    try:
        sim = simulate_offload(loop.built.chain, plan, state.beta, state.limit).makespan
    except PlanError:  # engine tolerances: the simulator is the judge, keep the incumbent
        return
    if sim < state.makespan - 1e-9 * max(1.0, sim):
        state.plan, state.makespan = plan, sim
        state.counts["improvements"] += 1
        state.cp = None  # the next subproblem needs the lower horizon
