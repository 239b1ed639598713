"""Exact remat + offload methods ``ilp``, ``cpsat`` (one model) and ``brute``.

* ``ilp`` / ``cpsat``: the one exact model of :mod:`optmem.models.remat_offload` (the
  phase-indexed checkpoint slots, link positions after every item, O.7 memory), emitted to
  PuLP (``options.solver``: HiGHS, CBC, Gurobi) or to CP-SAT. ``optimal`` means optimal for
  the simulator's semantics over the model's class: at most ``sweeps`` increasing forward
  runs per phase (``extra["sweeps"]``, default 1) and at most ``transfers_per_gap`` transfers
  listed between two consecutive ops (``extra["transfers_per_gap"]``, default 1), any number
  of offload/prefetch pairs per value. The model is warm-started from the best plan of the
  chapter 4 DP, the persistent checkpoint DP and the offload-only DYNPROG that fits the
  class (completed by the engine with the plan's binaries fixed), its horizon is that plan's
  makespan, and the decoded plan is replayed by the simulator (it is never slower than the
  model says; ``report['model_objective']``). ``time_limit_s`` bounds the whole solve (the
  link relaxation's bound at most a quarter of it, ``extra["relaxation_share"]``, the
  candidate plans, at most a quarter completing the warm start, the search the rest): one
  :class:`~optmem.solvers.time_budget.Deadline`, taken when the solve starts, less
  :data:`~optmem.solvers.time_budget.REPLAY_MARGIN_S` for the final replay, caps every
  engine call of every stage, and a stage with less than one second left of it is skipped
  (``report["search"] = "skipped (time)"``, a relaxation stage's ``"skipped (time)"``); only
  the model build, the DP candidates and an emission already started can pass it. It
  returns the best verified plan with the engine's bound. CP-SAT runs on the exact time
  grid of :func:`cpsat_time_scale` (the least common denominator of durations and transfer
  times) where one exists;
  ``report["engine_work"]`` holds the engine's deterministic counts.
* Both first solve :func:`~optmem.models.remat_offload.build_link_relaxation` (HiGHS; a
  proven lower bound on the model's optimum, ``report["relaxation"]``; off with
  ``extra["relaxation"] = False``): a candidate plan that meets it is returned as
  ``optimal`` without a search, otherwise the bound becomes a row ``makespan >= bound`` of
  the model (exact times only) and a floor of the reported bound. Its prefetch-deadline
  rows are on by default (``extra["relaxation_deadlines"]``); its read deadlines
  (``extra["relaxation_read_deadlines"]``) and the compute sequence of its strongest stage
  solved to optimality, completed by the engine, as one more candidate plan
  (``extra["relaxation_sequence"]``, :func:`_sequence_candidate`), and its cumulative read
  rows (``extra["relaxation_cumulative_reads"]``) and its window
  (``extra["relaxation_window"]``: re-solves floored at the proven bound, Benders masters
  cut off at the incumbent) are on by default under ``strategy=benders`` only
  (:data:`BENDERS_EXTRA`, where they were measured). ``strategy=benders`` runs on either
  grid: on the rounded one (durations rounded down, ``report["exact_times"]`` false) its
  bounds stay in the original units (:func:`~optmem.solvers.remat_offload_benders.solve_benders`).
* ``brute``: the independent oracle for tiny chains: every compute sequence with at most
  ``L (L + 1) / 2 + L`` forwards (every persistent sequence), and for every gap between two
  consecutive uses of a stored value at most one offload/prefetch pair (enumerated window
  subsets, link orders and issue points), each plan replayed by
  :func:`optmem.simulate.offload.simulate_offload` (``L <= 2``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, cast

from optmem.chain import Chain
from optmem.engines import adapters as engines
from optmem.engines.adapters import EngineResult
from optmem.engines.results import engine_failure
from optmem.errors import OptmemInputError, PlanError
from optmem.models.checkpoint_ilp import write_model
from optmem.models.formulation import (
    MAX_DECIMALS,
    MILP_DEFAULT_TOLERANCE,
    Expr,
    Kind,
    Model,
    Relation,
    grid_ceiling,
    largest_bound,
    milp_integrality_tolerance,
    milp_time_unit,
    rational_time_scale,
    shape_error,
    time_scale,
    to_cpsat,
    to_pulp,
)
from optmem.models.interrupt import Interrupted, stop_when
from optmem.models.remat_offload import (
    RematOffloadModel,
    build_link_relaxation,
    build_remat_offload,
    class_horizon,
    duration_resolution,
    host_item_rows,
    host_violations,
    with_fixed,
)
from optmem.plan import (
    LOSS,
    AnyOp,
    B,
    F_all,
    F_ck,
    F_none,
    Op,
    parse_mixed_plan,
)
from optmem.problems.checkpoint import Discretized
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import initial_state, is_final, transition
from optmem.simulate.offload import reads, simulate_offload
from optmem.solvers.checkpoint_baselines import store_all_or_chen
from optmem.solvers.offload_bruteforce import (
    check_brute_length,
    fastest_plan,
    interleave_transfers,
)
from optmem.solvers.options import flag, positive_int
from optmem.solvers.registration import register, register_exporter
from optmem.solvers.remat_offload import (
    AUTOCAPPER_VALUES,
    LEAST_ENGINE_TIME_S,
    PROBLEM,
    below_least_forward,
    best_candidate,
    discretized,
    grid_of,
    lower_bound,
    no_plan_result,
    offload_candidate,
    plan_result,
    pofo_plan,
    prefetch_policies,
    remat_candidate,
    shortest_transfer,
    solve_autocapper,
)
from optmem.solvers.remat_offload_benders import (
    CUMULATIVE_READS_DEFAULT,
    READ_DEADLINES_DEFAULT,
    WINDOW_DEFAULT,
    check_benders_options,
    solve_benders,
)
from optmem.solvers.remat_offload_lns import LNS_EXTRA, improve, lns_settings
from optmem.solvers.remat_offload_probe import PROBE_EXTRA, probe_result, probe_settings
from optmem.solvers.remat_offload_schedule import Window, static_replay, window_before
from optmem.solvers.time_budget import (
    Deadline,
    least_left,
    left_for_engine,
    stopped_during,
)

BRUTE_MAX_LENGTH = 2
COMPLETION_SHARE = 0.25  # share of a user's time limit spent completing warm starts
RELAXATION_SHARE = 0.25  # share of a user's time limit spent on the link relaxation's bound
LAZY_HOST_DEFAULT = True  # extra["relaxation_lazy"]: the host stage's rows added lazily
# extra["relaxation_compact"]: the relaxation's deadline rows through build_link_relaxation's
# compact y chains (the same relaxation, fewer non-zeros; ro19)
COMPACT_DEFAULT = False
# extra["relaxation_plain"]: the plain stage before the deadline stage (false: the deadline
# stage is the first; its rows contain the plain stage's, so its optimum is never lower; ro21)
PLAIN_STAGE_DEFAULT = True
# extra["relaxation_first"] (strategy=benders): the DP ladder after the relaxation (ro21)
RELAXATION_FIRST_DEFAULT = False
HOST_STAGE_MAX_VALUES = 1200  # most per-value host binaries of the host stage (_host_stage_fits)
MAX_RATIONAL_SCALE = 10**6  # largest exact CP-SAT time grid: never finer than the decimal one
MAX_SCALED_HORIZON = 2.0**44
"""Largest scaled sum of durations and transfer times of :func:`cpsat_time_scale`'s grid:
room for 2^19 time variables (repeated forwards, each transfer twice) within int64."""
# extra["dp_ladder"]: (grid, backlog_grid) pairs whose chapter 4 DP plans join the candidates
# (strategy=full: none; benders: BENDERS_EXTRA) and extra["autocapper_candidate"] (full: off)
DP_LADDER_DEFAULT: tuple[tuple[int, int], ...] = ()
AUTOCAPPER_CANDIDATE_DEFAULT = False
# ro18 (results/remat_offload_exact.md): on ResNet-50 the default grid's DP plan (200 x 25) was
# the exact methods' plan at 10 / 30 / 60 %; these grids give plans 2.2-3.3 % faster
BENDERS_DP_LADDER = ((200, 100), (500, 100))
DP_LADDER_SHARE = 0.25  # share of a user's time limit for the ladder's DP runs
# the ladder's first run's predicted seconds per _dp_states state under relaxation_first:
# measured 1.3e-7 (ResNet-50, 200 x 100 and 200 x 150) and 2.0e-7 (500 x 100), load 0.2-1 (ro21)
DP_SECONDS_PER_STATE = 2.5e-7
# extra["relaxation_share"] under strategy=benders: the host stage's rows are its strongest
# bound and its sequence the best plan (results/remat_offload_proofs.md, ro12)
BENDERS_RELAXATION_SHARE = 0.6
# the defaults strategy=benders adds to extra (measured together there, ro12; full: not)
BENDERS_EXTRA = {"relaxation_share": BENDERS_RELAXATION_SHARE,
                 "relaxation_read_deadlines": True, "relaxation_sequence": True,
                 "relaxation_cumulative_reads": True,
                 # ro14: 11 of the 12 instances of 10-12 stages proven in 300 s (8 before),
                 # none of them lost (results/remat_offload_proofs.md, ro14-window)
                 "relaxation_window": True,
                 # ro18: the DP ladder and the autocapper plan as candidate plans
                 "dp_ladder": BENDERS_DP_LADDER, "autocapper_candidate": True}
BENDERS_WARMUP = 0.3  # share of the time limit for the monolithic warm-up of strategy=benders
WINDOW_JOBS_DEFAULT = False  # extra["relaxation_window_jobs"]: window rows in the lazy rounds
SEQUENCE_DEFAULT = False  # extra["relaxation_sequence"] (strategy=full; benders: BENDERS_EXTRA)
SEQUENCE_WORK = 10.0  # CP-SAT deterministic seconds completing the relaxation's sequence
SEQUENCE_SHARE = 0.1  # share of a user's time limit completing the relaxation's sequence
STRATEGIES = ("full", "benders")  # extra["strategy"] of cpsat (benders: remat_offload_benders)
MIN_ENGINE_LIMIT_S = 0.01  # an engine call whose emission took what was left: stops at once
# the full solve's horizon (every time at most the warm start's makespan) lies this far
# (relative) above the start's model value: that value is an engine's, exact only to its
# feasibility tolerance (a CBC completion broke a row by 3.3e-8, and CBC's preprocessing
# then called the model with the horizon at that value infeasible; stop 50's hunt)
HORIZON_SLACK = 1e-6


def persistent_forwards(length: int) -> int:
    """The most forward ops of a persistent compute sequence of ``length`` stages.

    ``L (L + 1) / 2 + L``, the compute slots of the phase-indexed checkpoint model: at
    worst ``F_ck 1``, ``F_none 2 .. L`` and ``Loss`` (``L`` forwards), then a persistent
    sequence of the ``L`` stages without the loss (at most ``L (L + 1) / 2``). The loss
    stage's own recomputation is what ``L (L + 1) / 2`` alone misses, e.g.
    ``F_ck 1, Loss, F_all 1, B 1``.

    Examples
    --------
    >>> persistent_forwards(1), persistent_forwards(2)
    (2, 5)
    """
    return length * (length + 1) // 2 + length


def compute_sequences(chain: Chain, max_forwards: int | None = None
                      ) -> list[tuple[float, int, tuple[Op, ...]]]:
    """Every complete compute sequence: ``(compute time, checkpoint peak, ops)``.

    ``max_forwards`` caps the forward ops of a sequence; the default,
    :func:`persistent_forwards`, is the most any persistent sequence runs, so every plan of
    the persistent checkpoint DP (``remat_only``) is enumerated.
    """
    L = chain.length
    cap = persistent_forwards(L) if max_forwards is None else max_forwards
    out: list[tuple[float, int, tuple[Op, ...]]] = []
    candidates = [LOSS, *(f(i) for i in range(1, L + 1) for f in (F_all, F_ck, F_none)),
                  *(B(i) for i in range(1, L + 1))]

    def dfs(stored: frozenset, ops: list[Op], time: float, peak: int, fwd: int) -> None:
        if is_final(stored):
            out.append((time, peak, tuple(ops)))
            return
        for op in candidates:
            is_fwd = op.kind.value.startswith("F")
            if is_fwd and fwd >= cap:
                continue
            try:
                new, op_peak, duration = transition(chain, stored, op)
            except PlanError:
                continue
            ops.append(op)
            dfs(new, ops, time + duration, max(peak, op_peak), fwd + int(is_fwd))
            ops.pop()

    dfs(initial_state(), [], 0.0, 0, 0)
    out.sort(key=lambda t: (t[0], len(t[2])))
    return out


def all_windows(chain: Chain, ops: Sequence[Op]) -> list[Window]:
    """Every gap between two consecutive uses of a stored value."""
    static = static_replay(chain, ops)
    out = []
    for c, op in enumerate(ops):
        for value in static.before[c]:
            if value[0] == "delta" or not reads(op, value, chain.length):
                continue
            w = window_before(chain, ops, static, value, c)
            if w is not None and w.last + 1 < w.consumer:
                out.append(w)
    return out


def _brute_search(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    disc, beta = discretized(problem, options)
    chain, limit = disc.chain, disc.memory_limit
    seqs = compute_sequences(chain)
    best: tuple[float, tuple[AnyOp, ...]] | None = None
    tried = 0
    for compute, peak, ops in seqs:
        if best is not None and compute >= best[0] - 1e-12:
            break
        if peak <= limit:
            best = (compute, ops)
            break
        if beta <= 0 or not _may_fit(chain, limit, ops):
            continue
        tried += 1
        found = _brute_transfers(chain, limit, beta, ops)
        if found is not None and (best is None or found[0] < best[0] - 1e-12):
            best = found
    report = {"sequences": len(seqs), "sequences_with_transfers": tried,
              "plan_space": "compute sequences with <= L(L+1)/2 + L forwards, one transfer "
                            "pair per gap between uses"}
    if best is None:
        return no_plan_result(problem, options, "brute", Status.INFEASIBLE, report)
    return plan_result(problem, options, best[1], method="brute", status=Status.OPTIMAL,
                       report=report, claimed=best[0])


def _may_fit(chain: Chain, limit: int, ops: tuple[Op, ...]) -> bool:
    """Necessary condition: every op fits with every value it does not read on the host."""
    from optmem.simulate.checkpoint import value_size

    static = static_replay(chain, ops)
    windows = all_windows(chain, ops)
    for j, peak in enumerate(static.peaks):
        if peak <= limit:
            continue
        host = {w.value for w in windows if w.last < j < w.consumer}
        if peak - sum(value_size(chain, v) for v in host) > limit:
            return False
    return True


def _orders(wins: list[int], windows: list[Window]) -> Iterator[list[tuple[str, int]]]:
    items = [("O", i) for i in wins] + [("P", i) for i in wins]
    after = [(i1, i2) for i1 in wins for i2 in wins
             if windows[i1].value == windows[i2].value
             and windows[i1].consumer <= windows[i2].last]
    for perm in itertools.permutations(items):
        pos = {t: k for k, t in enumerate(perm)}
        if all(pos[("O", i)] < pos[("P", i)] for i in wins) and \
                all(pos[("P", i1)] < pos[("O", i2)] for i1, i2 in after):
            yield list(perm)


def _gaps(order: list[tuple[str, int]], windows: list[Window], lo: int = 0
          ) -> Iterator[list[int]]:
    """Non-decreasing issue points (the compute op each transfer is listed before)."""
    if not order:
        yield []
        return
    kind, i = order[0]
    w = windows[i]
    first = max(lo, w.first if kind == "O" else w.last + 1)
    last = w.consumer - 1 if kind == "O" else w.consumer
    for g in range(first, last + 1):
        for rest in _gaps(order[1:], windows, g):
            yield [g, *rest]


def _brute_transfers(chain: Chain, limit: int, beta: float, ops: tuple[Op, ...]
                     ) -> tuple[float, tuple[AnyOp, ...]] | None:
    found = fastest_plan(chain, beta, limit, _transfer_plans(chain, ops))
    return None if found is None else (found[0], found[1])


def _transfer_plans(chain: Chain, ops: tuple[Op, ...]) -> Iterator[list[AnyOp]]:
    """``ops`` with every set, order and issue point of transfers in their windows."""
    windows = all_windows(chain, ops)
    idx = list(range(len(windows)))
    for r in range(1, len(idx) + 1):
        for chosen in itertools.combinations(idx, r):
            values = [windows[i].value for i in chosen]
            if len(set(values)) < len(values) and _overlap(windows, chosen):
                continue
            for order in _orders(list(chosen), windows):
                for gaps in _gaps(order, windows):
                    yield interleave_transfers(
                        ops, [(kind, windows[i].value) for kind, i in order], gaps)


def _overlap(windows: list[Window], chosen: Sequence[int]) -> bool:
    for i, k in itertools.combinations(chosen, 2):
        a, b = windows[i], windows[k]
        if a.value == b.value and not (a.consumer <= b.last or b.consumer <= a.last):
            return True
    return False


@register(PROBLEM, "brute", exact=True, full_model=True, max_length=BRUTE_MAX_LENGTH,
          description="exact: compute sequences x enumerated transfers (L <= 2)")
def solve_brute(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Exact optimum by enumeration and simulation (independent of the model)."""
    check_brute_length(problem.chain.length, BRUTE_MAX_LENGTH)
    return _brute_search(problem, options)


# ------------------------------------------------------------------ the exact model
@dataclass(frozen=True)
class _Start:
    """The warm start: a plan, its simulated makespan and its completed model values."""

    plan: tuple[AnyOp, ...] | None
    makespan: float
    values: list[float] | None
    model_value: float
    note: str


Candidate = tuple[float, str, tuple[AnyOp, ...]]
"""A replayed candidate plan: ``(makespan, label, plan)``."""


@dataclass
class _Cheap:
    """How far :func:`_cheap_candidates` got: whether it started, the plans replayed."""

    started: bool = False
    found: list[Candidate] = field(default_factory=list)


def _cheap_candidates(problem: RematOffloadProblem, options: SolveOptions,
                      done: _Cheap | None = None) -> list[Candidate]:
    """The checkpoint-only and offload-only plans that replay, fastest first.

    The persistent checkpoint DP's plan and DYNPROG's: what a solve stopped by its time
    limit answers with at least (:func:`_stopped`). Both poll the solve's deadline (since
    stop 77; 10.5 s at L = 339 under load 8 before): ``done`` (when given) is marked
    started and gets each replayed plan as soon as it is known, so a solve stopped in
    DYNPROG keeps the checkpoint DP's plan.
    """
    done = _Cheap() if done is None else done
    done.started = True
    disc, _ = discretized(problem, options)
    found = done.found
    makers: tuple[tuple[str, Callable[[], Sequence[AnyOp] | None]], ...] = (
        ("checkpoint only (persistent dp)", lambda: remat_candidate(disc)),
        ("offload only (dynprog)", lambda: offload_candidate(problem, options)))
    for label, make in makers:
        plan = make()
        seen: dict[str, float] = {}
        best_candidate(problem, options, [(label, plan)], seen)
        if plan is not None and label in seen:
            found.append((seen[label], label, tuple(plan)))
    return sorted(found)


FALLBACK_GRACE_S = 1.0
"""The most a stopped solve spends on the checkpoint-only and offload-only DPs it had not
run (:func:`_fallback`): within the time the deadline keeps back (2 s,
:data:`~optmem.solvers.time_budget.REPLAY_MARGIN_S`)."""


def _fallback(problem: RematOffloadProblem, options: SolveOptions, cheap: _Cheap
              ) -> list[Candidate]:
    """A stopped solve's candidates when it had not finished computing them.

    ``cheap``: how far :func:`_cheap_candidates` got before the stop: the plans it
    replayed. When it had not started (a stop in the link relaxation, the chapter 4 DP, or
    without a limit), it runs here with at most a quarter of the limit, at most
    :data:`FALLBACK_GRACE_S` (all it needs below L = 100 or so; before stop 77 it ran whole
    here: 10.5 s at L = 339). No plan from it: :func:`_quick_candidates`.
    """
    if not cheap.started:
        limit = options.time_limit_s
        grace = Deadline.start(None if limit is None else min(FALLBACK_GRACE_S, 0.25 * limit),
                               margin=0.0)
        with suppress(Interrupted), stop_when(grace.stopper()):
            _cheap_candidates(problem, options, cheap)
    return sorted(cheap.found) or _quick_candidates(problem, options)


def _quick_candidates(problem: RematOffloadProblem, options: SolveOptions
                      ) -> list[Candidate]:
    """A stopped solve's plans when its DPs had none yet: store-all, else Chen's sqrt(L).

    No DP: store-all (when its peak fits) or Chen's ``round(sqrt(L))`` equal segments,
    replayed (0.3 s at L = 339); both are checkpoint-only plans, never faster than the
    persistent DP's (:func:`_cheap_candidates`), which a stopped solve had not finished
    (stop 77: it used to compute those DPs again after the deadline, 10.5 s at L = 339).
    """
    disc, _ = discretized(problem, options)
    plans: list[tuple[str, Sequence[AnyOp] | None]] = [
        store_all_or_chen(disc.chain, disc.memory_limit)]
    seen: dict[str, float] = {}
    best_candidate(problem, options, plans, seen)
    return [(seen[label], label, tuple(plan)) for label, plan in plans
            if plan is not None and label in seen]


def _candidates(problem: RematOffloadProblem, options: SolveOptions,
                deadline: Deadline | None = None, report: dict[str, Any] | None = None,
                prior: float | None = None,
                base: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None,
                cheap: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None,
                done: _Cheap | None = None
                ) -> list[tuple[float, str, tuple[AnyOp, ...]]]:
    """The DP, checkpoint-only and offload-only plans that replay, fastest first.

    With ``extra["dp_ladder"]`` and ``extra["autocapper_candidate"]`` also the plans of
    :func:`_ladder_plans` (``report["dp_ladder"]``: each one's makespan, or why not;
    ``prior``: its seconds per state before the first run). ``base``: the default
    candidates, already computed (``relaxation_first``): only the ladder's are added.
    ``cheap``: :func:`_cheap_candidates`, already computed (a solve under a time limit
    computes them first): not computed again; else computed with ``done``
    (:func:`_cheap_candidates`: a stopped solve keeps those replayed so far).
    """
    plans: list[tuple[str, Sequence[AnyOp] | None]] = []
    known: dict[tuple[int, int], Sequence[AnyOp] | None] = {}
    if base is None:
        default = _pofo_candidate(problem, options, report)
        known[grid_of(options)] = default
        plans.append(("chapter 4 dp", default))
        if cheap is None:
            base = _cheap_candidates(problem, options, done)
        else:
            base = list(cheap)
    else:
        known[grid_of(options)] = next((plan for _, label, plan in base
                                        if label == "chapter 4 dp"), None)
    notes: dict[str, Any] = {}
    plans += _ladder_plans(problem, options, deadline, notes, known, prior=prior)
    seen: dict[str, float] = {}
    best_candidate(problem, options, plans, seen)
    if report is not None and notes:
        report["dp_ladder"] = {label: seen.get(label, note) for label, note in notes.items()}
    found = list(base or []) + [(seen[label], label, tuple(plan)) for label, plan in plans
                                if plan is not None and label in seen]
    found.sort(key=lambda t: (t[0], _RANK.get(t[1], len(_RANK))))  # ties: as before stop 74
    return found


# the order of equally fast candidates: the default ones first, as they were listed
_RANK = {"chapter 4 dp": 0, "checkpoint only (persistent dp)": 1, "offload only (dynprog)": 2}


def _pofo_candidate(problem: RematOffloadProblem, options: SolveOptions,
                    report: dict[str, Any] | None = None) -> tuple[AnyOp, ...] | None:
    """The chapter 4 DP's plan (``extended``), or ``None`` when the DP refuses the size.

    The DP's memory guard refuses tables past 4 GiB (ResNet-1001, L = 339, 500 slots:
    11.3 GiB) with an input error, right for the ``dp`` method, whose grid the user can
    coarsen; for the exact methods it is one candidate fewer, not a failed solve (stop 74:
    ``solve remat-offload resnet1001-b8-224 --method ilp`` exited 2 with the DP's message;
    ``report["dp_candidate"]`` now has it). The options were checked before any work
    (:func:`_solve_model`).
    """
    try:
        return pofo_plan(problem, options, "extended")[0]
    except OptmemInputError as exc:
        if report is not None:
            report["dp_candidate"] = str(exc)
        return None


def dp_ladder(options: SolveOptions) -> tuple[tuple[int, int], ...]:
    """``extra["dp_ladder"]``: ``(grid, backlog_grid)`` pairs of positive integers.

    Default :data:`DP_LADDER_DEFAULT` (none; :data:`BENDERS_DP_LADDER` under
    ``strategy=benders``).
    """
    value = options.extra.get("dp_ladder", DP_LADDER_DEFAULT)
    pairs: list[tuple[int, int]] = []
    if isinstance(value, (list, tuple)):
        for pair in value:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in pair):
                break
            pairs.append((int(pair[0]), int(pair[1])))
        else:
            return tuple(pairs)
    raise OptmemInputError(f"expected a list of [grid, backlog_grid] pairs of positive "
                           f"integers for dp_ladder, got {value!r}", field="dp_ladder")


def _dp_states(length: int, grid: int, backlog: int) -> float:
    """The chapter 4 DP's state count (``remat_offload.grid_of``): its time, up to a factor."""
    return length * grid * (2.0 * backlog ** 2 + length * backlog / 2.0)


def _ladder_plans(problem: RematOffloadProblem, options: SolveOptions,
                  deadline: Deadline | None, notes: dict[str, Any],
                  known: dict[tuple[int, int], Sequence[AnyOp] | None] | None = None,
                  prior: float | None = None) -> list[tuple[str, Sequence[AnyOp] | None]]:
    """More candidate plans: the chapter 4 DP on other grids, and the autocapper plan.

    ``extra["dp_ladder"]`` (:func:`dp_ladder`): for each ``(grid, backlog_grid)`` pair the
    chapter 4 DP's plan on that grid (``pofo_plan``, the ``extended`` variant, ``grid``
    at most ``slots``); ``extra["autocapper_candidate"]``: the autocapper heuristic's plan
    (thesis 4.3: the persistent checkpoint plan of a larger limit ``M'`` with capper's
    offloads, 40 values of ``M'``). Primal heuristics only: every plan is replayed by
    the simulator before it counts (:func:`best_candidate`), no bound depends on them. Why:
    on ResNet-50 (``bench_exact.py``'s instances, 12 GB/s) the default grid's DP plan was
    the exact methods' final plan at 10 / 30 / 60 %, and finer backlog grids give plans
    2.2-3.3 % faster (``benchmarks/results/remat_offload_exact.md``, ``ro18``).

    With a time limit, the DP runs stop once :data:`DP_LADDER_SHARE` of it is spent or
    the next run, predicted from the last one's seconds per state (:func:`_dp_states`),
    would pass that share or leave less than :data:`LEAST_ENGINE_TIME_S` before ``deadline``
    (``notes[label] = "skipped (time)"``); a DP run
    is not an engine call and cannot be stopped once started. ``notes`` gets one label per
    plan tried (its makespan is filled in by the caller's replay). ``known``: plans already
    solved, by ``(grid, backlog_grid)`` (the caller's default grid), taken instead of a run.
    ``prior``: the least seconds per state of every prediction, the first run's too
    (``None``: the first run is not predicted; ``relaxation_first``, where the ladder runs
    after the relaxation, near the deadline, passes :data:`DP_SECONDS_PER_STATE`: the state
    count underestimates 500 x 100 by 1.5x against 200 x 100); with it the ladder has no
    share of its own, only ``deadline`` (the relaxation has had its time).
    """
    out: list[tuple[str, Sequence[AnyOp] | None]] = []
    pairs = dp_ladder(options)
    if flag(options, "autocapper_candidate", AUTOCAPPER_CANDIDATE_DEFAULT):
        res = solve_autocapper(problem, options.with_(variant=None))
        label = "autocapper"
        notes[label] = "no plan"
        out.append((label, parse_mixed_plan(res.plan) if res.status.has_plan else None))
    share = None if options.time_limit_s is None or prior is not None else \
        DP_LADDER_SHARE * options.time_limit_s
    solve_deadline = Deadline(None) if deadline is None else deadline
    clock = solve_deadline.clock
    ladder = Deadline(None, clock).within(share)  # the ladder's share, from now
    rate: float | None = None  # seconds per state of the last run
    for grid, backlog in pairs:
        grid = min(grid, options.slots)
        label = f"chapter 4 dp (grid {grid}, backlog_grid {backlog})"
        if label in notes:
            continue
        if known and (grid, backlog) in known:
            notes[label] = "no plan"
            out.append((label, known[grid, backlog]))
            continue
        states = _dp_states(problem.chain.length, grid, backlog)
        rates = [r for r in (rate, prior) if r is not None]
        predicted = max(rates, default=0.0) * states
        if ladder.spent(predicted) or solve_deadline.spent(predicted + LEAST_ENGINE_TIME_S):
            notes[label] = "skipped (time)"
            continue
        run = clock()
        plan = _pofo_candidate(problem, options.with_(extra={**options.extra, "grid": grid,
                                                             "backlog_grid": backlog}))
        rate = (clock() - run) / states
        notes[label] = "no plan"
        out.append((label, plan))
    return out


def _engine_solve(model: Model, engine: str, options: SolveOptions, *,
                  initial: Sequence[float] | None, scale: int, time_limit_s: float | None,
                  deadline: Deadline | None = None, tolerance: float = MILP_DEFAULT_TOLERANCE
                  ) -> tuple[EngineResult, list[float] | None, float]:
    """Emit ``model`` for ``engine`` and solve: the engine outcome, model values, bound.

    ``deadline`` caps ``time_limit_s`` once the model is emitted (the emission of the
    ResNet-50 model takes 3-5 s: a limit computed before it overran the solve's deadline).
    ``tolerance``: HiGHS's ``mip_feasibility_tolerance`` when below its default
    (:attr:`~optmem.models.remat_offload.RematOffloadModel.integrality_tolerance`, stop 78;
    the other engines keep theirs).
    """

    def limit() -> float | None:
        return left_for_engine(deadline, time_limit_s, MIN_ENGINE_LIMIT_S)

    if engine == "cpsat":
        cp = to_cpsat(model, scale=scale)
        out = _shaped(engines.solve_cpsat(cp.cp, cp.variables, hint=cp.hint(initial),
                                          **{**engines.cpsat_settings(options),
                                             "time_limit_s": limit()}), model)
        values = cp.values(out.values) if out.values is not None else None
        bound = cp.objective(out.bound) if math.isfinite(out.bound) else math.nan
        return out, values, bound
    unit = milp_time_unit(largest_bound(model))  # stop 77: times of a slow link ~1e10
    pm = to_pulp(model.in_units(unit))
    highs = _highs_tolerance(tolerance, engine)
    out = _shaped(engines.solve_pulp(pm.problem, pm.all_variables, engine,
                                     initial=pm.initial(None if initial is None else
                                                        model.to_units(initial, unit)),
                                     **{**engines.pulp_settings(options),
                                        "time_limit_s": limit()}, highs_options=highs), model)
    return _from_units(out, model, unit)


def _tolerance_option(model: Model, chain: Chain, beta: float, engine: str
                      ) -> dict[str, Any] | None:
    """HiGHS's ``mip_feasibility_tolerance`` for a link relaxation of ``chain`` (stop 78).

    :func:`~optmem.models.formulation.milp_integrality_tolerance` at the chain's
    :func:`~optmem.models.remat_offload.duration_resolution`, as for the model
    (:attr:`~optmem.models.remat_offload.RematOffloadModel.integrality_tolerance`): on slow
    links HiGHS called relaxations infeasible where the DP's plan replays (and so gave no
    bound). ``None`` (HiGHS's default) for other engines and well-conditioned models.
    """
    if engine != "highs":
        return None
    return _highs_tolerance(milp_integrality_tolerance(model, duration_resolution(chain, beta)),
                            engine)


def _highs_tolerance(tolerance: float, engine: str) -> dict[str, Any] | None:
    """HiGHS's options for an integrality ``tolerance`` below its default (``None``: none)."""
    if engine != "highs" or tolerance >= MILP_DEFAULT_TOLERANCE:
        return None
    return {"mip_feasibility_tolerance": tolerance}


def _from_units(out: EngineResult, model: Model, unit: float
                ) -> tuple[EngineResult, list[float] | None, float]:
    """A MILP engine's outcome on ``model.in_units(unit)`` back in the model's units.

    The continuous variables (the times of :mod:`optmem.models.remat_offload`) and the
    objective and bound (a makespan) are multiplied by ``unit`` (a power of two: exact).
    """
    n = len(model.vars)
    values = out.values[:n] if out.values is not None else None
    if unit == 1:
        return out, values, out.bound
    if out.values is not None and values is not None and shape_error(values, n) is None:
        values = model.from_units(values, unit)  # else a fault the callers report
        out = replace(out, values=[*values, *out.values[n:]])
    out = replace(out, objective=out.objective * unit, bound=out.bound * unit)
    return out, values, out.bound


def _shaped(out: engines.EngineResult, model: Model) -> engines.EngineResult:
    """``out``, or an engine fault when its values are no assignment of ``model``."""
    if out.values is None:
        return out
    fault = shape_error(out.values[:len(model.vars)], len(model.vars))
    return out if fault is None else engines.undecodable_result(out, fault)


def _warm_start(problem: RematOffloadProblem, options: SolveOptions,
                built: RematOffloadModel, engine: str, scale: int,
                found: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None,
                deadline: Deadline | None = None) -> _Start:
    """The fastest candidate plan that fits the model, completed by the engine.

    ``plan`` is the fastest candidate (the incumbent), ``values`` the completion of the
    fastest one the model can take; ``found``: :func:`_candidates`, if already computed.
    Each completion's engine limit is what is left of :data:`COMPLETION_SHARE` of the time
    limit, capped by ``deadline`` (the solve's, :mod:`optmem.solvers.time_budget`).
    """
    if not options.warm_start:
        return _Start(None, math.inf, None, math.inf, "off")
    notes = []
    clock = time.monotonic if deadline is None else deadline.clock  # one clock per solve
    began = clock()
    budget = None if options.time_limit_s is None else COMPLETION_SHARE * options.time_limit_s
    if found is None:
        found = _candidates(problem, options)
    best = found[0] if found else None  # the incumbent, even if the model cannot take it
    for _, label, plan in found:
        fixed = built.fixing(plan)
        if fixed is None:
            notes.append(f"{label}: does not fit the model's slots")
            continue
        limit = None if budget is None else budget - (clock() - began)
        if deadline is not None:
            if deadline.spent(LEAST_ENGINE_TIME_S):  # as every stage: the emission needs it
                notes.append(f"{label}: less than {LEAST_ENGINE_TIME_S:g} s left of the limit")
                break
            limit = deadline.cap(limit)
        if limit is not None and limit <= 0:
            notes.append(f"{label}: no time left of the warm start's share of the limit")
            break
        done, values, _ = _engine_solve(with_fixed(built, fixed), engine, options,
                                        initial=None, scale=scale, time_limit_s=limit,
                                        deadline=deadline,
                                        tolerance=built.integrality_tolerance)
        if not done.status.has_plan or values is None:
            notes.append(f"{label}: not completed ({done.status}: {done.message})")
            continue
        value = values[built.objective_var]
        # unused time variables may sit anywhere below the default horizon: clamp them to
        # this plan's makespan, the main solve's horizon (a valid assignment stays valid)
        values = [min(max(x, v.lo), value, v.hi) if v.kind is Kind.CONTINUOUS
                  else float(round(x)) for v, x in zip(built.model.vars, values, strict=True)]
        if built.model.violated(values, tol=1e-5):
            notes.append(f"{label}: completion not valid")
            continue
        note = label if not notes else f"{label} ({'; '.join(notes)})"
        assert best is not None
        return _Start(best[2], best[0], values, value, note)
    note = "; ".join(notes) or "no candidate plan"
    if best is None:
        return _Start(None, math.inf, None, math.inf, note)
    return _Start(best[2], best[0], None, math.inf, f"none ({note}); incumbent: {best[1]}")


def cpsat_time_scale(chain: Chain, beta: float) -> tuple[int, bool]:
    """The CP-SAT grid ``1 / scale`` of the durations and transfer times; whether exact.

    Transfer times ``size / beta`` are fractions (``beta = 51 / 46`` on
    ``random_chain(8, seed=1)``), which no power of ten makes integral: the decimal grid
    (:func:`~optmem.models.formulation.time_scale`) then rounds them on ``1e-6``, the model
    becomes a relaxation (no ``relaxation_bound`` row) and CP-SAT improves its incumbent
    one grid step at a time. The least common denominator
    (:func:`~optmem.models.formulation.rational_time_scale`) is exact and coarse there (51);
    it is used when it does not exceed :data:`MAX_RATIONAL_SCALE` (CP-SAT's integer
    coefficients stay small), else the decimal grid as before.
    """
    values = [*chain.fwd_time, *chain.bwd_time, chain.loss_bwd_time,
              *([v / beta for v in (chain.input_size, *chain.output_size, *chain.saved_size)]
                if beta > 0 else [])]
    # every time variable lies below the durations summed; CP-SAT refuses a model whose
    # domains add up beyond int64 (MODEL_INVALID on a 1e9 ms stage at the 1e-6 grid)
    top = max(1.0, math.fsum(v for v in values if math.isfinite(v)))
    finest = max(1, int(MAX_SCALED_HORIZON / top))
    decimals = max(0, min(MAX_DECIMALS, int(math.floor(math.log10(finest)))))
    decimal = time_scale(values, decimals)
    rational = rational_time_scale(values, max_scale=min(MAX_RATIONAL_SCALE, finest))
    if rational[1] and (not decimal[1] or rational[0] < decimal[0]):
        return rational
    return decimal


@dataclass(frozen=True)
class _Relaxed:
    """The link relaxation's proven bound (``-inf``: none), its report and its master.

    ``master`` is the strongest model solved to optimality (the first one when none was)
    and ``out`` its outcome: the Benders loop's first master and proposal (``None`` when
    the relaxation is off or skipped).
    """

    bound: float
    info: dict[str, Any]
    master: Model | None = None
    out: EngineResult | None = None


# the relaxation's solves, weakest first: (deadline rows, per-value host rows, report key)
RELAXATION_STAGES = ((False, False, "plain_bound"), (True, False, "deadline_bound"),
                     (True, True, "host_bound"))


def _relaxation_bound(chain: Chain, memory_limit: int, beta: float, sweeps: int,
                      options: SolveOptions, engine: str, *,
                      master_budget_s: float | None = None,
                      clock: Callable[[], float] | None = None,
                      deadline: Deadline | None = None) -> _Relaxed:
    """The proven bound of :func:`~optmem.models.remat_offload.build_link_relaxation`.

    Solved by the PuLP engine of the method (HiGHS for ``cpsat`` when installed) within
    :data:`RELAXATION_SHARE` of the time limit, in the stages of :data:`RELAXATION_STAGES`:
    plain, with the prefetch deadlines (``extra["relaxation_deadlines"]``, default true),
    with the per-value host rows as well (``extra["relaxation_values"]``, default true;
    ``host_values``). Each stage is a stronger relaxation and a slower MILP (HiGHS: 0.4 s,
    4 s and 28 s on ``random_chain(10, seed=1)`` at its 10 % limit, load 2); the engine's
    dual bound is valid even when it stops early, and the best one is the bound
    (``report["relaxation"]`` has each stage's under its key). The strongest stage solved to
    optimality is the Benders loop's first master.

    The share covers the whole relaxation, model builds included (:func:`_stage_limit`),
    except that ``master_budget_s`` (``strategy=benders``: the loop's time) replaces it for
    the stages before the host stage: the strongest of them is the loop's first master,
    which the loop would otherwise solve again from scratch. The first stage gets at least
    :data:`LEAST_ENGINE_TIME_S`, a later one runs only with that much left of its budget,
    and the host stage only when :func:`_host_stage_fits` (model size, not
    time: the stage's time varies 3x with the load, its size does not). ``clock`` is the
    time source (injected by the tests). ``deadline`` (the solve's,
    :mod:`optmem.solvers.time_budget`) caps every stage's limit, whatever its share says;
    a stage (the first one too) with less than :data:`LEAST_ENGINE_TIME_S` left of it is
    skipped (``"skipped (time)"``). With ``extra["relaxation_lazy"]`` (default
    :data:`LAZY_HOST_DEFAULT`) the host stage is :func:`_lazy_host` instead (host rows only
    on the items the current optimum violates; no size rule, the share bounds it;
    ``info["host_rounds"]``, ``info["host_items"]``). ``-inf`` when it is off
    (``extra["relaxation"] = False``), no MILP engine is installed, there is no link or the
    engine fails.

    ``extra["relaxation_plain"]`` (default :data:`PLAIN_STAGE_DEFAULT`) false: the plain
    stage is skipped (``info["plain_bound"]``), the deadline stage is the first and gets its
    budget; its model is the plain one with more rows, so its optimum is never lower.
    """
    deadlines = flag(options, "relaxation_deadlines", True)
    host_values = flag(options, "relaxation_values", True)
    lazy = flag(options, "relaxation_lazy", LAZY_HOST_DEFAULT)
    reads_too = flag(options, "relaxation_read_deadlines", READ_DEADLINES_DEFAULT)
    cumulative = flag(options, "relaxation_cumulative_reads", CUMULATIVE_READS_DEFAULT)
    window = flag(options, "relaxation_window", WINDOW_DEFAULT)
    compact = flag(options, "relaxation_compact", COMPACT_DEFAULT)
    if not flag(options, "relaxation", True) or beta <= 0:
        return _Relaxed(-math.inf, {"status": "off"})
    pulp_engine = engine if engine != "cpsat" else "highs"
    if not engines.is_available(pulp_engine):
        return _Relaxed(-math.inf, {"status": f"skipped ({pulp_engine} not installed)"})
    share = None if options.time_limit_s is None else \
        _relaxation_share(options) * options.time_limit_s
    first_budget = share if share is None or master_budget_s is None else \
        max(share, master_budget_s)
    if deadline is None:
        deadline = Deadline(None)
    if clock is None:  # the deadline's clock (injected by the tests; the machine's if none)
        clock = deadline.clock
    began = clock()
    best: float = -math.inf
    info: dict[str, Any] = {}
    kept: tuple[Model, EngineResult] | None = None
    previous: EngineResult | None = None
    stages = [st for st in RELAXATION_STAGES
              if (deadlines or not st[0]) and (host_values or not st[1])]
    if deadlines and not flag(options, "relaxation_plain", PLAIN_STAGE_DEFAULT):
        stages = stages[1:]  # the deadline stage first: its rows contain the plain stage's
        info["plain_bound"] = "skipped (relaxation_plain false)"
    key = ""
    try:  # the stages' builds and emissions stop at the solve's deadline (stop 74)
        for with_deadlines, with_values, key in stages:
            budget = share if with_values else first_budget
            if (previous is not None and budget is not None and
                    budget - (clock() - began) < LEAST_ENGINE_TIME_S) or \
                    deadline.spent(LEAST_ENGINE_TIME_S):
                info[key] = "skipped (time)"
                break
            if with_values and lazy:
                if previous is None or previous.status is not Status.OPTIMAL or kept is None:
                    info[key] = "skipped (the deadline stage not solved)"
                    break
                covered: set[int] = set()
                info["host_rounds"] = 0
                def host_left(b: float | None = budget) -> float | None:
                    return deadline.cap(_stage_limit(b, clock() - began, first=False))

                for master, out in _lazy_host(chain, memory_limit, beta, sweeps, kept, options,
                                              pulp_engine, covered, host_left,
                                              floor=best if window else -math.inf):
                    info = _record(info, key, out)
                    info["host_rounds"] += 1
                    kept = (master, out) if out.status is Status.OPTIMAL else kept
                    best = _better(best, out)
                info["host_items"] = len(covered)
                info.setdefault(key, previous.bound)  # no item violated: the same optimum
                break
            master = build_link_relaxation(chain, memory_limit, beta, sweeps=sweeps,
                                           deadlines=with_deadlines, host_values=with_values,
                                           read_deadlines=reads_too, cumulative_reads=cumulative,
                                           compact=compact)
            if with_values and previous is not None and not _host_stage_fits(master, previous):
                info[key] = "skipped (too large, or the deadline stage not solved)"
                break
            unit = milp_time_unit(largest_bound(master))
            pm = to_pulp(master.in_units(unit))
            if deadline.spent(LEAST_ENGINE_TIME_S):  # the build took what was left
                info[key] = "skipped (time)"
                break
            limit = deadline.cap(_stage_limit(budget, clock() - began, first=previous is None))
            out = _from_units(engines.solve_pulp(
                pm.problem, pm.all_variables, pulp_engine,
                **{**engines.pulp_settings(options), "time_limit_s": limit},
                highs_options=_tolerance_option(master, chain, beta, pulp_engine)),
                master, unit)[0]
            info = _record(info, key, out)
            if out.status is Status.INFEASIBLE and not out.failed:
                if _confirmed_empty(chain, memory_limit, beta, sweeps, options, pulp_engine,
                                    deadline, info):
                    info["relaxation_s"] = round(clock() - began, 3)
                    return _Relaxed(math.inf, info)
                break  # not confirmed: no bound from this stage, and none stronger to try
            if kept is None or out.status is Status.OPTIMAL:
                kept = (master, out)
            best = _better(best, out)
            previous = out
    except Interrupted:
        info[key] = "stopped (time)"  # the earlier stages' bounds stand
    info["relaxation_s"] = round(clock() - began, 3)
    if math.isfinite(best):
        info["bound"] = best
    return _Relaxed(best, info, *kept) if kept is not None else _Relaxed(best, info)


def _confirmed_empty(chain: Chain, memory_limit: int, beta: float, sweeps: int,
                     options: SolveOptions, engine: str, deadline: Deadline,
                     info: dict[str, Any]) -> bool:
    """Whether no plan of the model's class fits: a relaxation stage was infeasible.

    A stage's horizon bounds its times, so its infeasibility alone speaks only of plans
    faster than that horizon. The plain stage is solved again with
    :func:`~optmem.models.remat_offload.class_horizon` as its horizon, a makespan no plan of
    the class (``sweeps``, ``extra["transfers_per_gap"]``) exceeds: every plan then maps to
    one of its points (proof in
    :func:`~optmem.models.remat_offload.build_link_relaxation`), so when it too is
    infeasible the class has no plan within ``memory_limit``. ``info["infeasible"]`` says
    what was confirmed (or why not). The callers still check that no candidate plan replays
    within the limit before they believe it (:func:`_refuted_by_relaxation`).
    """
    horizon = class_horizon(chain, memory_limit, beta, sweeps=sweeps,
                            transfers_per_gap=positive_int(options, "transfers_per_gap", 1))
    if deadline.spent(LEAST_ENGINE_TIME_S):
        info["infeasible"] = "not confirmed (time)"
        return False
    model = build_link_relaxation(chain, memory_limit, beta, sweeps=sweeps, deadlines=False,
                                  host_values=False, horizon=horizon)
    plain = to_pulp(model.in_units(milp_time_unit(largest_bound(model))))
    out = engines.solve_pulp(plain.problem, plain.all_variables, engine,
                             **{**engines.pulp_settings(options),
                                "time_limit_s": deadline.cap(None)},
                             highs_options=_tolerance_option(model, chain, beta, engine))
    empty = out.status is Status.INFEASIBLE and not out.failed
    info["infeasible"] = (f"the plain stage has no point at the class horizon {horizon:g}"
                          if empty else f"not confirmed at the class horizon {horizon:g} "
                          f"({out.status})")
    return empty


@dataclass(frozen=True)
class _Early:
    """What a solve learns before it builds the model (:func:`_solve_model`).

    ``relaxed``: the link relaxation; ``candidates``: the candidate plans computed so far
    (``None``: none yet); ``refuted``: the ``infeasible`` answer when the relaxation has no
    point and no candidate replays (:func:`_refuted_by_relaxation`), else ``None``.
    """

    relaxed: _Relaxed
    candidates: list[tuple[float, str, tuple[AnyOp, ...]]] | None
    refuted: Result | None = None


def _refuted_by_relaxation(problem: RematOffloadProblem, method: str, deadline: Deadline,
                           relaxed: _Relaxed,
                           candidates: list[tuple[float, str, tuple[AnyOp, ...]]] | None,
                           options: SolveOptions, report: dict[str, Any],
                           cheap: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None
                           ) -> _Early:
    """The ``infeasible`` answer when the link relaxation has no point, and the relaxation.

    ``relaxed.bound`` is ``inf`` only when :func:`_confirmed_empty` holds: then no plan of
    the model's class fits, and the solve answers at once, with no search (before stop 72
    the search went on: ``ilp`` on ResNet-18 at 60 % of its store-all peak, 12 GB/s, ran
    more than 12 minutes without a verdict where the plain stage had none in 0.1 s) and,
    since stop 73, before the model is built (:func:`_solve_model`). An engine can be
    wrong: if a candidate plan (``candidates``, computed here when ``None``) replays within
    the limit, the verdict is not believed; the relaxation then gives no bound
    (``report["relaxation"]["engine_error"]``) and the solve goes on. ``cheap``: the
    checkpoint-only and offload-only plans when already computed (:func:`_cheap_candidates`,
    a solve under a time limit computes them first), not computed again.
    """
    if relaxed.bound != math.inf:
        return _Early(relaxed, candidates)
    found = candidates if candidates is not None else \
        _candidates(problem, options, deadline, report, cheap=cheap)
    if found:
        info = {**relaxed.info, "engine_error": f"the relaxation has no point, but "
                f"{found[0][1]} replays at {found[0][0]:g} within the limit"}
        report["relaxation"] = info
        return _Early(_Relaxed(-math.inf, info), found)
    report["relaxation"] = relaxed.info
    report["note"] = "no plan of the model's class fits (the link relaxation has no point)"
    return _Early(relaxed, found, no_plan_result(problem, options, method, Status.INFEASIBLE,
                                                 report))


def _full_start(problem: RematOffloadProblem, method: str, disc: Discretized, beta: float,
                sweeps: int, engine: str, options: SolveOptions, deadline: Deadline,
                report: dict[str, Any],
                cheap: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None) -> _Early:
    """``strategy=full`` before the model is built: the link relaxation and its verdict.

    The relaxation does not need the model (:func:`_relaxation_bound`); when it has no point
    the solve ends here (:func:`_refuted_by_relaxation`), without the model's build (before
    stop 73, 5.5 of 13.6 s of ``ilp`` on ResNet-50 at 25 %, 12 GB/s, under cProfile).
    ``cheap``: the candidates :func:`_staged` computed first under a time limit, passed on
    so that the verdict's check does not compute them again.
    """
    relaxed = _relaxation_bound(disc.chain, disc.memory_limit, beta, sweeps, options, engine,
                                deadline=deadline)
    return _refuted_by_relaxation(problem, method, deadline, relaxed, None, options, report,
                                  cheap)


def _relaxation_share(options: SolveOptions) -> float:
    """``extra["relaxation_share"]``: the relaxation's share of the time limit.

    Default :data:`RELAXATION_SHARE`; a number in ``(0, 1]``.
    """
    share = options.extra.get("relaxation_share", RELAXATION_SHARE)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise OptmemInputError(f"expected a share in (0, 1] for relaxation_share, got "
                               f"{share!r}", field="relaxation_share")
    return float(share)


def _record(info: dict[str, Any], key: str, out: EngineResult) -> dict[str, Any]:
    """The relaxation's report after a stage's solve ``out`` (earlier stages' bounds kept)."""
    return {**{k: v for k, v in info.items() if k.endswith("_bound") or k.startswith("host_")},
            "status": str(out.status), "bound": out.bound,
            "seconds": round(out.time_s, 3), **out.info, key: out.bound}


def _better(best: float, out: EngineResult) -> float:
    """``best`` or the engine's dual bound ``out.bound`` (less a relative 1e-9), the larger."""
    if out.failed or not math.isfinite(out.bound):
        return best
    return max(best, out.bound - 1e-9 * max(1.0, abs(out.bound)))


def _lazy_host(chain: Chain, memory_limit: int, beta: float, sweeps: int,
               start: tuple[Model, EngineResult], options: SolveOptions, engine: str,
               covered: set[int], limit: Callable[[], float | None], *,
               floor: float = -math.inf) -> Iterator[tuple[Model, EngineResult]]:
    """The host stage with its per-value host rows added lazily (``relaxation_lazy``).

    ``start`` is the deadline stage and its optimal solution. Each round adds to
    ``covered`` the items whose local host rows that solution violates
    (:func:`~optmem.models.remat_offload.host_violations`) and solves the relaxation with
    the host rows on ``covered`` (``host_items``) within ``limit()``; it stops when no item
    is violated (the optimum is then the host stage's on the rows that bind), when the
    engine stops without an optimum, or when less than :data:`LEAST_ENGINE_TIME_S` is left.
    Every round's model has the aggregated rows of the deadline stage where it has no host
    rows and the full host stage's rows where it has them, a subset of the full host
    stage's rows once the aggregated ones (which those imply) are left out: by the proof of
    :func:`~optmem.models.remat_offload.build_link_relaxation` (the optimal plan maps to a
    point of the full host stage with ``r_p = sum_v size_v h[v,p]``, which satisfies the
    aggregated rows too), its optimum and any dual bound are at most the optimum (digest
    ``shared/design/offload.md`` 0.2). With ``extra["relaxation_cumulative_reads"]`` the
    rounds first run without those rows, as before; once no item is violated they go on
    with them (their first round rebuilds the covered items with them), so the rounds
    without them are never slower than before.

    ``extra["relaxation_window_jobs"]`` (default :data:`WINDOW_JOBS_DEFAULT`): the rounds'
    models also get the window-job rows among the covered items
    (:func:`~optmem.models.remat_offload.build_link_relaxation`, ``window_jobs``; a
    relaxation by the proof there) and are solved with HiGHS's presolve off (HiGHS 1.14.0's
    presolve returned optima above feasible points of such models on 4-stage chains).

    ``floor`` (``extra["relaxation_window"]``: the best bound of the stages before, else
    ``-inf``): each round's model gets the row ``makespan >= floor`` (less 1e-6 relative),
    ``floor`` rising with every round's dual bound. Valid: ``floor`` is a proven bound, at
    most the optimum ``v*``, and the optimal plan's point of the proof has ``makespan =
    v*``, so it satisfies the row and the round stays a relaxation; HiGHS then has the
    root bound at once and ends a round whose optimum did not rise as soon as it finds a
    solution there (the rounds' optima rise slowly: 105, 105, 110 on
    ``random_chain(12, seed=2)`` at 10 %).
    """
    reads_too = flag(options, "relaxation_read_deadlines", READ_DEADLINES_DEFAULT)
    cumulative = flag(options, "relaxation_cumulative_reads", CUMULATIVE_READS_DEFAULT)
    jobs = flag(options, "relaxation_window_jobs", WINDOW_JOBS_DEFAULT)
    # HiGHS 1.14's MIP presolve is wrong on some models with the window rows (ro20)
    presolve: dict[str, Any] | None = {"presolve": "off"} if jobs else None
    compact = flag(options, "relaxation_compact", COMPACT_DEFAULT)
    master, out = start
    for cum in (False, True) if cumulative else (False,):
        full = build_link_relaxation(chain, memory_limit, beta, sweeps=sweeps,
                                     read_deadlines=reads_too, cumulative_reads=cum)
        rows = host_item_rows(full, start[0])
        forced = cum and bool(covered)  # the covered items' cumulative rows: not in yet
        # a solution that is no assignment of the master (a misbehaving engine) ends the
        # lazy rounds: the bound so far is a relaxation's all the same
        while out.status is Status.OPTIMAL and out.values is not None and \
                shape_error(out.values[:len(master.vars)], len(master.vars)) is None:
            violated = host_violations(full, rows, master, out.values, covered)
            left = limit()
            if (not violated and not forced) or \
                    (left is not None and left < LEAST_ENGINE_TIME_S):
                break
            forced = False
            covered.update(violated)
            master = build_link_relaxation(chain, memory_limit, beta, sweeps=sweeps,
                                           host_items=covered, read_deadlines=reads_too,
                                           cumulative_reads=cum, window_jobs=jobs,
                                           compact=compact)
            if math.isfinite(floor):
                at = next(i for i, v in enumerate(master.vars) if v.name == "makespan")
                master.add(Expr([(at, 1.0)]) >= floor - 1e-6 * max(1.0, abs(floor)),
                           "relaxation_floor")
            unit = milp_time_unit(largest_bound(master))
            pm = to_pulp(master.in_units(unit))
            left = limit()  # again: the build and emission took some of it
            out = _from_units(engines.solve_pulp(
                pm.problem, pm.all_variables, engine,
                **{**engines.pulp_settings(options), "time_limit_s":
                   None if left is None else max(left, MIN_ENGINE_LIMIT_S)},
                highs_options={**(presolve or {}),
                               **(_tolerance_option(master, chain, beta, engine) or {})}
                or None), master, unit)[0]
            if not out.failed and math.isfinite(out.bound):
                floor = max(floor, out.bound - 1e-9 * max(1.0, abs(out.bound)))
            yield master, out


def _stage_limit(share: float | None, spent: float, *, first: bool) -> float | None:
    """A stage's engine time limit: what is left of ``share`` after ``spent`` seconds.

    The first stage gets at least :data:`LEAST_ENGINE_TIME_S` (the loop needs its
    master), a later one only starts with that much left, so the whole relaxation overruns
    its share by at most that floor (and the engine's own overshoot of its limit).
    """
    if share is None:
        return None
    left = share - spent
    return max(LEAST_ENGINE_TIME_S, left) if first else max(left, 0.0)


def _host_stage_fits(master: Model, deadline_stage: EngineResult) -> bool:
    """Whether the host-rows stage ``master`` is solved after the deadline stage's outcome.

    Only after a deadline stage solved to optimality (a harder MILP than one HiGHS could
    not finish is not finished either) and with at most :data:`HOST_STAGE_MAX_VALUES`
    per-value host binaries ``h_*``. Measured (``benchmarks/results/remat_offload_exact.md``,
    ``ro9``; HiGHS, 2 threads): ``random_chain(10)`` has 1000 of them, its stage is solved in
    28-82 s at load 2-4 (74 -> 76 at 10 %) or stopped above the deadline stage's bound
    (67 -> 68.43 at 30 % after 120 s); ``random_chain(12)`` has 1624 and HiGHS does not finish
    in 400 s, with a dual bound below the deadline stage's (66.49 against 67.64), so there
    the stage would only cost the time.
    """
    if deadline_stage.status is not Status.OPTIMAL:
        return False
    return sum(v.name.startswith("h_") for v in master.vars) <= HOST_STAGE_MAX_VALUES


@dataclass(frozen=True)
class _Setup:
    """The instance as the model sees it.

    The discretised chain, bandwidth, built model, engine and CP-SAT time grid (``exact``:
    every duration and transfer time on it); ``deadline``: the end of the solve's time
    limit, taken when the solve started (:mod:`optmem.solvers.time_budget`), which caps
    every engine call of every stage.
    """

    problem: RematOffloadProblem
    method: str
    engine: str
    disc: Discretized
    beta: float
    built: RematOffloadModel
    scale: int
    exact: bool
    deadline: Deadline = Deadline(None)
    grid: int | None = None  # every plan's makespan is a multiple of 1 / grid (None: unknown)

    def lift(self, bound: float) -> float:
        """``bound`` lifted to the grid of every plan's makespan, when there is one.

        ``ilp`` builds its model on exact times (``scale`` 1), but its bounds were lifted
        to the integers as if every duration were integral: with transfer times of
        ``size / 3`` or fractional durations it answered ``optimal`` above the optimum
        (``random_chain(3, seed=16, max_size=6)`` at 27, link 3: 16.667 for 16.333; stop 75
        hunt). ``grid`` is the CP-SAT grid when it is exact (:func:`cpsat_time_scale`), for
        both engines.
        """
        return bound if self.grid is None else grid_ceiling(bound, self.grid)


def _benders_start(problem: RematOffloadProblem, method: str, disc: Discretized,
                   beta: float, sweeps: int, options: SolveOptions, deadline: Deadline,
                   report: dict[str, Any], progress: _Progress | None = None) -> _Early:
    """``strategy=benders`` before the model is built: candidates and the link relaxation.

    The candidate plans and the relaxation in the order :func:`_benders` describes
    (``extra["relaxation_first"]``), then the relaxation's verdict
    (:func:`_refuted_by_relaxation`): when it has no point the solve ends here, without the
    model's build (since stop 73). ``options`` carry :data:`BENDERS_EXTRA` already
    (:func:`_solve_model`). ``progress`` (:func:`_stopped`) gets the candidates and the
    bound as soon as each is known.
    """
    progress = _Progress() if progress is None else progress
    share = _warmup_share(options)
    later = flag(options, "relaxation_first", RELAXATION_FIRST_DEFAULT)
    candidates = _candidates(problem, options.with_(extra={
        **options.extra, "dp_ladder": [], "autocapper_candidate": False}) if later else options,
        deadline, report, done=progress.cheap)
    progress.learnt(_Early(_Relaxed(-math.inf, {}), candidates))
    limit = options.time_limit_s
    relaxed = _relaxation_bound(disc.chain, disc.memory_limit, beta, sweeps, options, "cpsat",
                                master_budget_s=None if limit is None else (1 - share) * limit,
                                deadline=deadline)
    report["relaxation"] = relaxed.info  # the loop adds its first master's bound
    progress.learnt(_Early(relaxed, candidates))
    if later:  # the ladder's plans with what the relaxation left
        candidates = _candidates(problem, options, deadline, report,
                                 prior=DP_SECONDS_PER_STATE, base=candidates)
    early = _refuted_by_relaxation(problem, method, deadline, relaxed, candidates, options,
                                   report)
    if early.refuted is not None:
        early.refuted.report["strategy"] = "benders (no plan: the link relaxation has no point)"
    return early


def _benders(setup: _Setup, options: SolveOptions, report: dict[str, Any], early: _Early
             ) -> Result:
    """``strategy=benders``: a warm-up search of the one model, then the decomposition.

    The warm-up is the monolithic ``cpsat`` solve within ``extra["benders_warmup"]`` (share
    of ``time_limit_s``, default :data:`BENDERS_WARMUP`; 0: none; without a time limit it
    runs only with ``deterministic_time``, which bounds it). Its plan (replayed) joins the
    candidate plans as the incumbent, whose quality sets the strength of the refutation
    cuts, and its proven bound floors the loop's; a proof ends the solve there. The
    candidates, the built model and the link relaxation are computed once and shared: the
    relaxation is solved first and gives the warm-up its bound and the loop its first master
    and proposal. The stages up to the deadline rows are that master and may use the loop's
    share of the limit (the loop would otherwise solve it again: 50-140 s at tight limits);
    the host stage stays within the relaxation's share, :data:`BENDERS_RELAXATION_SHARE`
    under this strategy unless ``extra["relaxation_share"]`` says otherwise (the keys of
    :data:`BENDERS_EXTRA`, read deadlines, cumulative reads and the relaxation's sequence
    on, are this strategy's defaults) (with the
    loop's share it took 160-176 s of 300 s at load 7-9 before the read deadlines; with them
    and the relaxation's sequence as a plan, 0.6 instead of 0.25 proved
    ``random_chain(10, seed=1)`` at 10 % and raised every other 10 % bound at L = 10-12,
    the 30 % ones unchanged: ``benchmarks/results/remat_offload_proofs.md``, ``ro12``).
    The loop gets what the relaxation and the warm-up leave.

    ``extra["relaxation_first"]`` (default :data:`RELAXATION_FIRST_DEFAULT`): the DP ladder
    and the autocapper plan (:func:`_ladder_plans`) are computed after the relaxation
    instead of before it, with what it leaves (the default candidates, a few seconds, stay
    before it), every DP run predicted from :data:`DP_SECONDS_PER_STATE` at least and run
    only if it ends before the deadline. Only the order changes; every bound and plan is
    the same kind. For chains whose relaxation needs most of the limit (ResNet-50 at 10 %:
    the deadline stage's 180 CPU s; at 30 % it leaves the ladder no time, a worse plan:
    ``benchmarks/results/remat_offload_exact.md``, ``ro21``).
    """
    share = _warmup_share(options)  # options carry BENDERS_EXTRA (_solve_model)
    problem, deadline = setup.problem, setup.deadline
    floor = -math.inf
    first: tuple[Model, EngineResult] | None = None
    limit = options.time_limit_s
    relaxed = early.relaxed
    if relaxed.master is not None and relaxed.out is not None:
        first = (relaxed.master, relaxed.out)
    candidates = _with_sequence(setup, relaxed, options, early.candidates, report)
    found = [(value, plan) for value, _, plan in candidates]
    if share > 0 and (limit is not None or options.deterministic_time is not None):
        warm_options = options.with_(time_limit_s=None if limit is None else share * limit)
        warm = _full_solve(setup, warm_options, dict(report), relaxed=relaxed,
                           candidates=candidates, deadline=deadline.within(
                               warm_options.time_limit_s))
        report["warmup"] = {"status": str(warm.status), "objective": warm.objective,
                            "bound": warm.bound, "seconds": warm.report.get("engine_time_s"),
                            "engine_work": warm.report.get("engine_work")}
        if warm.status in (Status.OPTIMAL, Status.INFEASIBLE):
            warm.report["strategy"] = "benders (proven by the warm-up search)"
            warm.report["warmup"] = report["warmup"]
            return warm
        if warm.status.has_plan:
            found.append((warm.objective, tuple(parse_mixed_plan(warm.plan))))
        if math.isfinite(warm.bound):
            floor = warm.bound
    found.sort(key=lambda t: t[0])
    left = deadline.left()  # the loop's engine calls are capped by the deadline itself
    return solve_benders(problem, options.with_(time_limit_s=None if left is None else
                                                max(left, 1e-3)), built=setup.built,
                         scale=setup.scale, incumbent=found[0] if found else None,
                         report=report, floor=floor, first=first, deadline=deadline,
                         exact=setup.exact)


def _warmup_share(options: SolveOptions) -> float:
    """``extra["benders_warmup"]``, a share in [0, 1] (:class:`OptmemInputError` if not)."""
    share = options.extra.get("benders_warmup", BENDERS_WARMUP)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise OptmemInputError(f"expected a share in [0, 1] for benders_warmup, got {share!r}",
                               field="benders_warmup")
    return float(share)


def _solve_model(problem: RematOffloadProblem, options: SolveOptions, method: str
                 ) -> Result:
    """:func:`_solve_class`, its proofs checked against the held-free chain's (stop 82 hunt).

    On a chain with a held gap (:func:`held_gap`) a plan outside the model's class (a
    forward nothing reads) may beat the model's optimum, so the same solve on the chain
    without its held terms (the time left) gives the proofs: every plan of ``problem`` is
    one of that chain (:func:`outside_class`). With less than
    :data:`~optmem.solvers.remat_offload.LEAST_ENGINE_TIME_S` left there is no second solve
    (the bound is :func:`lower_bound`).
    """
    deadline = Deadline.start(options.time_limit_s)
    result = _solve_class(problem, options, method)
    if not held_gap(problem.chain) or result.status not in PROVEN_OR_PLAN:
        return result
    left = deadline.left()
    if left is not None and left < LEAST_ENGINE_TIME_S:  # no time left: the compute-time bound
        free = Result(PROBLEM, method, Status.NO_SOLUTION)
    else:
        free = _solve_class(replace(problem, chain=held_free(problem.chain)),
                            options.with_(time_limit_s=left), method)
    return outside_class(problem, result, free)


PROVEN_OR_PLAN = (Status.OPTIMAL, Status.FEASIBLE, Status.INFEASIBLE)


def held_free(chain: Chain) -> Chain:
    """``chain`` without its held terms (``fwd_held``, ``bwd_held``, ``loss_held`` 0)."""
    zero = (0,) * chain.length
    return replace(chain, fwd_held=zero, bwd_held=zero, loss_held=0)


def held_gap(chain: Chain) -> bool:
    """Whether a forward nothing reads may beat the model's class on ``chain`` (stop 82).

    Such a forward ``F k``, run only to end what the op before it left held, helps only
    when its own held term is below that op's. With every ``fwd_held`` the same ``t`` and
    every ``bwd_held`` and ``loss_held`` at most ``t`` (a chain that holds nothing too) it
    never does, and the model's class holds the optimum (:mod:`optmem.models.remat_offload`).
    """
    if not chain.holds:
        return False
    least = min(chain.fwd_held)
    return max((*chain.fwd_held, *chain.bwd_held, chain.loss_held)) > least


def outside_class(problem: RematOffloadProblem, result: Result, free: Result) -> Result:
    """``result`` with the proofs of ``free``, the same solve on :func:`held_free`'s chain.

    Every plan of ``problem`` is a plan of the held-free chain, whose model holds its
    optimum (no held term, no gap), so ``free``'s bound (its optimum when ``optimal``; the
    held-free :func:`lower_bound`, every compute time once, when it has none) bounds every
    plan of ``problem``, and its ``infeasible`` refutes ``problem``. ``result`` keeps its
    plan, ``optimal`` only when its makespan reaches that bound (else ``feasible``, the
    bound the smaller of its own and that one); its ``infeasible`` stands only when
    ``free``'s does (else ``no_solution``). ``report["held_gap"]`` records ``free``'s
    status and bound.
    """
    if free.status is Status.INFEASIBLE:
        return result  # no plan of the held-free chain: none of problem's either
    bound = free.objective if free.status is Status.OPTIMAL else free.bound
    bound = lower_bound(problem) if not math.isfinite(bound) else bound
    report = {**result.report, "held_gap": {
        "note": "a forward nothing reads may end a held term: the model's class may miss the "
                "optimum; the proofs are the held-free chain's (CONTRACT section 13)",
        "held_free_status": str(free.status), "held_free_bound": bound}}
    if result.status is Status.INFEASIBLE:
        return replace(result, status=Status.NO_SOLUTION, bound=bound, report=report)
    bound = min(bound, result.bound) if math.isfinite(result.bound) else bound
    proven = result.objective <= bound * (1 + 1e-9)
    return replace(result, status=Status.OPTIMAL if proven else Status.FEASIBLE, bound=bound,
                   report=report)


def _solve_class(problem: RematOffloadProblem, options: SolveOptions, method: str) -> Result:
    """The model's solve: its optimum, bound and infeasibility over its class."""
    deadline = Deadline.start(options.time_limit_s)  # every stage within it (time_budget)
    sweeps = positive_int(options, "sweeps", 1)
    per_gap = positive_int(options, "transfers_per_gap", 1)
    engine = "cpsat" if method == "cpsat" else options.solver
    if engine != "cpsat":
        engines.check_engine(engine)
    strategy = options.extra.get("strategy", "full") if engine == "cpsat" else "full"
    if strategy not in STRATEGIES:
        raise OptmemInputError(f"expected strategy one of {', '.join(STRATEGIES)}, got "
                               f"{strategy!r}", field="strategy")
    # checked before any work, whatever the strategy (a bad value of an option the chosen
    # strategy does not read is refused too, not ignored)
    flag(options, "relaxation_deadlines", True)
    flag(options, "relaxation_values", True)
    flag(options, "relaxation_lazy", LAZY_HOST_DEFAULT)
    if engine == "cpsat":  # the loop's options are registered for cpsat only
        check_benders_options(options)
        _warmup_share(options)
        flag(options, "relaxation_first", RELAXATION_FIRST_DEFAULT)
    flag(options, "relaxation_read_deadlines", READ_DEADLINES_DEFAULT)  # checked before work
    flag(options, "relaxation_cumulative_reads", CUMULATIVE_READS_DEFAULT)
    flag(options, "relaxation_window", WINDOW_DEFAULT)
    flag(options, "relaxation_compact", COMPACT_DEFAULT)
    flag(options, "relaxation_plain", PLAIN_STAGE_DEFAULT)
    flag(options, "relaxation_window_jobs", WINDOW_JOBS_DEFAULT)
    flag(options, "relaxation_sequence", SEQUENCE_DEFAULT)
    flag(options, "autocapper_candidate", AUTOCAPPER_CANDIDATE_DEFAULT)
    flag(options, "relaxation", True)
    grid_of(options)
    prefetch_policies(options)  # the candidate plans' placement policy
    positive_int(options, "autocapper_values", AUTOCAPPER_VALUES)
    dp_ladder(options)
    if lns_settings(options).enabled and engine != "cpsat":  # checked before any work
        raise OptmemInputError("the large-neighbourhood search (lns) runs CP-SAT: use the "
                               "cpsat method", field="lns")
    if probe_settings(options)[0] is not None and engine != "cpsat":
        raise OptmemInputError("the capped probe (probe_gap) runs CP-SAT: use the cpsat "
                               "method", field="probe_gap")
    _relaxation_share(options)
    report: dict[str, Any] = {"sweeps": sweeps, "transfers_per_gap": per_gap}
    if (below := below_least_forward(problem, options, method, report)) is not None:
        return below  # no plan of any class fits: no model to build, no search
    progress = _Progress()
    with stop_when(deadline.stopper()):
        try:
            progress.stage = "the candidate plans"  # the guard's checkpoint-only DP plan
            slow = _slower_than_checkpointing(problem, options)
            progress.stage = _Progress.stage
            if slow is not None:
                return _linkless(problem, options, method, deadline, *slow)
            return _staged(problem, options, method, engine, strategy, deadline, report,
                           progress)
        except Interrupted:
            pass
    return _stopped(problem, options, method, engine, progress, report)


def _slower_than_checkpointing(problem: RematOffloadProblem, options: SolveOptions
                               ) -> tuple[float, tuple[AnyOp, ...], float] | None:
    """``(shortest, plan, makespan)`` when no transfer can beat a checkpoint plan, else ``None``.

    The simulator's makespan includes the end of every transfer (O.2,
    :func:`~optmem.simulate.offload.simulate_offload`), so a plan that moves a value of
    positive size takes at least ``shortest``, the least positive size over the bandwidth
    (:func:`shortest_transfer`). When the optimal persistent checkpoint plan
    (:func:`remat_candidate`, replayed) takes no longer, no plan with such a transfer is
    faster, and the problem's optimum is that of the same problem without the link (a
    transfer of a value of size 0 takes no time and frees no memory). The check is cheap
    before the DP: ``shortest`` must reach the compute-time bound first. On 1e-9 links the
    link relaxation's rows hold coefficients of 1e9 and HiGHS's answer to them was wrong
    (stop 80: ``random_chain(12, seed=1, max_size=8, integer_times=False)`` at 35 with
    ``strategy=benders``: ``optimal`` 143.0598 where the optimum is 142.8322).
    """
    disc, beta = discretized(problem, options)
    shortest = shortest_transfer(disc.chain, beta)
    if math.isinf(shortest) or shortest < lower_bound(problem):
        return None  # no link (already the linkless problem), or a transfer fits in time
    plan = remat_candidate(disc)
    if plan is None:
        return None
    makespan = simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan
    return (shortest, plan, makespan) if makespan <= shortest else None


def _linkless(problem: RematOffloadProblem, options: SolveOptions, method: str,
              deadline: Deadline, shortest: float, plan: tuple[AnyOp, ...], makespan: float
              ) -> Result:
    """Solve ``problem`` as the same problem without the link (:func:`_slower_than_checkpointing`).

    The linkless solve (same method and options, the time left: since stop 81 no more,
    it had at least :data:`LEAST_ENGINE_TIME_S`, so ``--time-limit 0.05`` answered after
    0.5 s) is the exact model's class
    without transfers; its plan, or the checkpoint plan if faster or if it has none, is
    replayed on ``problem`` (a plan without transfers takes the same time on any link) and
    its bound ``min(linkless bound, shortest)`` holds for every plan of ``problem``.
    ``report["linkless"]`` says so. An ``error`` of the linkless solve (an engine fault) is
    the answer, as the engine-fault rules give it without the guard (CONTRACT section 14).
    """
    left = deadline.left()
    twin = RematOffloadProblem(problem.chain, problem.memory_limit, chain_bandwidth=0.0)
    sub = _solve_model(twin, options.with_(time_limit_s=None if left is None else
                                           max(left, MIN_ENGINE_LIMIT_S)), method)
    note = (f"no transfer beats a checkpoint plan: the shortest transfer takes {shortest:.6g} "
            f"and the checkpoint plan {makespan:.6g}; solved without the link "
            f"({sub.status}, bound {sub.bound:.6g})")
    if sub.status is Status.ERROR:  # an engine fault: answered as without the guard
        return sub.with_(report={**sub.report, "linkless": note})
    best = parse_mixed_plan(sub.plan) if sub.status.has_plan and sub.objective <= makespan \
        else plan
    res = plan_result(problem, options, best, method=method, solver=sub.solver,
                      report={**sub.report, "linkless": note})
    if not res.status.has_plan:
        return res
    bound = max(lower_bound(problem), min(sub.bound, shortest))
    if res.objective <= bound + 1e-9 * max(1.0, bound):
        return res.with_(status=Status.OPTIMAL, bound=res.objective)
    return res.with_(status=Status.FEASIBLE, bound=bound)


@dataclass
class _Progress:
    """What a solve has when its time limit stops its Python work (:func:`_stopped`).

    ``stage``: the stage running; ``bound``: the link relaxation's proven bound (``-inf``
    before it); ``candidates``: the replayed candidate plans, fastest first (``None``:
    not computed yet); ``cheap``: how far :func:`_cheap_candidates` got.
    """

    stage: str = "the link relaxation"
    bound: float = -math.inf
    candidates: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None
    relaxation: dict[str, Any] | None = None
    cheap: _Cheap = field(default_factory=_Cheap)

    def learnt(self, early: _Early) -> None:
        """Keep the bound and the candidates computed before the model's build."""
        if early.relaxed.info:
            self.relaxation = early.relaxed.info
        if math.isfinite(early.relaxed.bound):
            self.bound = early.relaxed.bound
        if early.candidates is not None:
            self.candidates = early.candidates


def _stopped(problem: RematOffloadProblem, options: SolveOptions, method: str, engine: str,
             progress: _Progress, report: dict[str, Any]) -> Result:
    """The answer of a solve whose Python work reached its deadline (stop 74).

    Building the model, emitting it and the chapter 4 DP are not engine calls and had no
    limit: ``ilp --time-limit 10`` on ResNet-101 (L = 39, 50 %, 12 GB/s) answered after 27 s,
    at L = 68 after 220 s and 5 GB. They now poll the solve's deadline
    (:mod:`optmem.models.interrupt`) and the solve answers with what it has: the fastest
    replayed candidate (at least the checkpoint-only and offload-only DPs' plans, which a
    solve under a time limit computes first, :func:`_staged`) as ``feasible`` (``optimal``
    when it meets the bound), and the link relaxation's bound if it was solved;
    ``no_solution`` with the bound when no candidate replays. ``report["stopped"]`` names
    the stage. Those DPs poll the deadline too (since stop 77; before, a solve stopped
    before them computed them here, past its deadline: 10.5 s at L = 339): stopped in
    them, the answer is the plans they replayed so far (:func:`_fallback`).
    """
    report = {**report, "stopped": stopped_during(progress.stage)}
    if progress.relaxation is not None:
        report.setdefault("relaxation", progress.relaxation)
    found = progress.candidates if progress.candidates is not None else \
        _fallback(problem, options, progress.cheap)
    bound = max(lower_bound(problem), progress.bound)
    if not found:
        return no_plan_result(problem, options, method, Status.NO_SOLUTION, report).with_(
            bound=bound)
    report["incumbent"] = found[0][1]
    res = plan_result(problem, options, found[0][2], method=method, solver=engine,
                      status=Status.FEASIBLE, report=report)
    if not res.status.has_plan:
        return res
    if res.objective <= bound + 1e-9 * max(1.0, bound):
        return res.with_(status=Status.OPTIMAL, bound=res.objective)
    return res.with_(bound=bound)


def _staged(problem: RematOffloadProblem, options: SolveOptions, method: str, engine: str,
            strategy: str, deadline: Deadline, report: dict[str, Any], progress: _Progress
            ) -> Result:
    """The stages of :func:`_solve_model`, ``progress`` kept for :func:`_stopped`.

    Under ``strategy=full`` the candidate plans (the chapter 4 DP) are computed before the
    model's build (since stop 74; after it before): the same plans, and a solve stopped in
    the build still has them.
    """
    disc, beta = discretized(problem, options)
    sweeps = positive_int(options, "sweeps", 1)
    per_gap = positive_int(options, "transfers_per_gap", 1)
    grid_scale, on_grid = cpsat_time_scale(disc.chain, beta)
    scale, exact = (grid_scale, on_grid) if engine == "cpsat" else (1, True)
    # the benders strategy's defaults, merged once for its two halves (before and after the
    # build)
    benders = options.with_(extra={**BENDERS_EXTRA, **options.extra}) \
        if strategy == "benders" else options
    cheap = None
    if strategy != "benders" and options.time_limit_s is not None:
        # what a stopped solve answers with, before the relaxation takes its time
        progress.stage = "the candidate plans"
        cheap = progress.candidates = _cheap_candidates(problem, options, progress.cheap)
        progress.stage = "the link relaxation"
    early = _benders_start(problem, method, disc, beta, sweeps, benders, deadline, report,
                           progress) if strategy == "benders" else \
        _full_start(problem, method, disc, beta, sweeps, engine, options, deadline, report,
                    cheap)
    progress.learnt(early)
    if early.refuted is not None:
        return early.refuted  # the link relaxation has no point: no model to build either
    if strategy != "benders" and early.candidates is None and options.warm_start:
        progress.stage = "the candidate plans"
        early = replace(early, candidates=_candidates(problem, options, deadline, report,
                                                      cheap=cheap, done=progress.cheap))
        progress.learnt(early)
    progress.stage = "the model's build"
    built = build_remat_offload(disc.chain, disc.memory_limit, beta, sweeps=sweeps,
                                transfers_per_gap=per_gap, grid=None if exact else scale)
    progress.stage = "the search"
    report["model"] = built.info
    if engine == "cpsat":
        report["time_scale"] = scale
        report["exact_times"] = exact
    if built.model.trivially_infeasible:
        return no_plan_result(problem, options, method, Status.INFEASIBLE, {
            **report, "hint": "no plan of the model's class fits (its rows contradict "
                              "before any search)"})
    setup = _Setup(problem, method, engine, disc, beta, built, scale, exact, deadline,
                   grid_scale if on_grid else None)
    if strategy == "benders":
        res = _benders(setup, benders, report, early)
    else:
        # without a warm start, the candidates computed so far (the cheap ones under a time
        # limit) serve the engine's cross-check (_cross_check) instead of being computed again
        candidates = _with_sequence(setup, early.relaxed, options, early.candidates, report) \
            if options.warm_start else early.candidates or cheap
        res = _full_solve(setup, options, report, relaxed=early.relaxed, candidates=candidates)

    def replay(plan: tuple[AnyOp, ...]) -> float:
        return simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan

    def rebuild(plan: tuple[AnyOp, ...], info: dict[str, Any]) -> Result:
        return plan_result(problem, options, plan, method=method, solver=engine,
                           status=Status.FEASIBLE, report=info)

    return probe_result(res, built, scale, exact, options, deadline, replay, rebuild)


def _sequence_candidate(setup: _Setup, relaxed: _Relaxed, options: SolveOptions
                        ) -> tuple[float, str, tuple[AnyOp, ...]] | None:
    """The relaxation's compute sequence completed by the engine: a candidate plan.

    ``extra["relaxation_sequence"]`` (default :data:`SEQUENCE_DEFAULT`). The strongest
    relaxation stage solved to optimality (``relaxed.master``, its first variables are the
    model's compute binaries) proposes a compute sequence; the model with those binaries
    fixed (transfers free) is solved by the method's engine within :data:`SEQUENCE_SHARE` of
    the time limit (CP-SAT: at most :data:`SEQUENCE_WORK` deterministic seconds too) and
    the decoded plan, replayed by the simulator, joins the candidates (``None`` when there
    is none, or it does not replay). A primal heuristic only: the bound is untouched. Why:
    on ``random_chain(10, seed=1)`` at its 10 % limit the relaxation (with its read
    deadlines) proposes a sequence worth 76 in the model, its own bound, where every search
    before found plans of 81-85 in 300 s (``benchmarks/results/remat_offload_proofs.md``).
    """
    if not flag(options, "relaxation_sequence", SEQUENCE_DEFAULT) or relaxed.master is None \
            or relaxed.out is None or relaxed.out.values is None \
            or relaxed.out.status is not Status.OPTIMAL:
        return None
    built = setup.built
    n_ck = len(built.checkpoint.names)
    fixed = {i: float(round(relaxed.out.values[i])) for i in range(n_ck)}
    if setup.deadline.spent(LEAST_ENGINE_TIME_S):
        return None
    limit = setup.deadline.cap(None if options.time_limit_s is None else
                               max(LEAST_ENGINE_TIME_S, SEQUENCE_SHARE * options.time_limit_s))
    work = SEQUENCE_WORK if options.deterministic_time is None else \
        min(SEQUENCE_WORK, options.deterministic_time)
    out, values, _ = _engine_solve(with_fixed(built, fixed), setup.engine,
                                   options.with_(deterministic_time=work), initial=None,
                                   scale=setup.scale, time_limit_s=limit,
                                   deadline=setup.deadline,
                                   tolerance=built.integrality_tolerance)
    if not out.status.has_plan or values is None:
        return None
    plan = built.decode(values)
    try:
        sim = simulate_offload(setup.disc.chain, plan, setup.beta,
                               setup.disc.memory_limit).makespan
    except PlanError:  # engine tolerances: the simulator is the judge
        return None
    return sim, "the relaxation's compute sequence", plan


def _with_sequence(setup: _Setup, relaxed: _Relaxed, options: SolveOptions,
                   candidates: list[tuple[float, str, tuple[AnyOp, ...]]] | None,
                   report: dict[str, Any]) -> list[tuple[float, str, tuple[AnyOp, ...]]]:
    """``candidates`` (computed if ``None``) with :func:`_sequence_candidate`, fastest first.

    With ``extra["lns"]`` (:mod:`optmem.solvers.remat_offload_lns`) the large-neighbourhood
    search then starts from the fastest of them, unless it meets the relaxation's bound, and
    its plan, when faster (replayed), comes first (``report["lns"]``).
    """
    found = list(_candidates(setup.problem, options, setup.deadline, report)
                 if candidates is None else candidates)
    began = time.monotonic()
    extra = _sequence_candidate(setup, relaxed, options)
    if extra is not None:
        found.append(extra)
        found.sort(key=lambda t: t[0])
        report["relaxation_sequence"] = {"makespan": extra[0],
                                         "seconds": round(time.monotonic() - began, 3)}
    settings = lns_settings(options)  # on only with cpsat (_solve_model refuses ilp)
    if not settings.enabled or not found:
        return found
    if math.isfinite(relaxed.bound) and \
            found[0][0] <= relaxed.bound + 1e-9 * max(1.0, abs(relaxed.bound)):
        report["lns"] = "skipped (the fastest candidate meets the relaxation's bound)"
    else:  # the large-neighbourhood search from the best candidate (remat_offload_lns)
        out = improve(setup.built, setup.disc.chain, setup.disc.memory_limit, setup.beta,
                      setup.scale, (found[0][0], found[0][2]), settings, options,
                      setup.deadline)
        report["lns"] = out.report
        if out.improved:
            found.insert(0, (out.makespan, "large-neighbourhood search", out.plan))
    return found


def _full_solve(setup: _Setup, options: SolveOptions, report: dict[str, Any], *,
                relaxed: _Relaxed,
                candidates: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None,
                deadline: Deadline | None = None) -> Result:
    """The monolithic solve (module docstring).

    ``relaxed`` (whose verdict the caller took: :func:`_refuted_by_relaxation`, so its
    bound is finite or ``-inf``) and ``candidates``: computed by the caller before the
    model was built. ``deadline`` (default ``setup.deadline``) caps every engine call; when
    less than :data:`LEAST_ENGINE_TIME_S` is left for the search (less under a limit too
    short to leave that much: :func:`~optmem.solvers.time_budget.least_left`), it is
    skipped and the fastest candidate plan is returned (``feasible``) with the bounds
    proven so far.
    """
    if deadline is None:
        deadline = setup.deadline
    problem, method, solver, built = setup.problem, setup.method, setup.engine, setup.built
    disc, beta, engine, scale = setup.disc, setup.beta, setup.engine, setup.scale
    began = deadline.clock()
    report["relaxation"] = relaxed.info
    start = _warm_start(problem, options, built, engine, scale, candidates, deadline)
    report["warm_start"] = start.note
    lifted = setup.lift(relaxed.bound)
    if start.plan is not None and \
            start.makespan <= lifted + 1e-9 * max(1.0, lifted):
        report["note"] = "the fastest candidate plan meets the link relaxation's bound"
        return plan_result(problem, options, start.plan, method=method, solver=solver,
                           status=Status.OPTIMAL, report=report)
    model = with_fixed(built, {}, _horizon(start))
    if math.isfinite(relaxed.bound) and setup.exact:
        # valid for the model (build_link_relaxation); a hair below for engine tolerances
        model.add(Relation(Expr([(built.objective_var, 1.0)]),
                           relaxed.bound - 1e-6 * max(1.0, abs(relaxed.bound)), None),
                  "relaxation_bound")
    left = deadline.cap(None if options.time_limit_s is None else
                        max(LEAST_ENGINE_TIME_S, options.time_limit_s - (deadline.clock() - began)))
    if deadline.spent(least_left(options.time_limit_s, LEAST_ENGINE_TIME_S)):  # no time left
        report["search"] = "skipped (time)"
        out, values, bound = EngineResult(Status.NO_SOLUTION, None, math.nan, -math.inf,
                                          engine, 0.0, "no time left",
                                          stopped_by="time"), None, -math.inf
    else:
        tolerance = built.integrality_tolerance
        if _highs_tolerance(tolerance, engine):
            report["integrality_tolerance"] = tolerance
        out, values, bound = _engine_solve(model, engine, options, initial=start.values,
                                           scale=scale, time_limit_s=left, deadline=deadline,
                                           tolerance=tolerance)
    start = _cross_check(problem, options, start, out, report, candidates)
    if out.status is Status.INFEASIBLE and start.plan is not None:
        # the warm start replays within the memory: an engine fault (as checkpoint's _checked)
        out = engines.failed_result(out.engine, f"{out.message or out.status}: infeasible, "
                                    "but the warm-start plan replays", out.time_s)
    status = out.status
    floor = max(lower_bound(problem), relaxed.bound)
    if out.failed:
        incumbent = start.plan
        proven = setup.lift(floor)

        def fallback(info: dict[str, Any]) -> Result:
            assert incumbent is not None
            return _candidate_result(problem, options, incumbent, proven, method=method,
                                     solver=solver,
                                     report={**info, "incumbent": "the fastest candidate plan"})

        return engine_failure(PROBLEM, method, out, report=report,
                              fallback=fallback if incumbent is not None else None,
                              memory_limit=disc.memory_limit, unit=disc.unit)
    report.update(out.report())
    if out.info:
        report["engine_work"] = dict(out.info)  # deterministic counts (nodes, branches, ...)
    bound = max(bound, floor) if math.isfinite(bound) else floor
    bound = setup.lift(bound)  # every plan's makespan is on the grid (grid_ceiling)
    if status is Status.INFEASIBLE:
        report["note"] = "no plan of the model's class fits"
        return no_plan_result(problem, options, method, Status.INFEASIBLE, report)
    plan: tuple[AnyOp, ...] | None = None
    if status.has_plan and values is not None:
        plan = built.decode(values)
        report["model_objective"] = values[built.objective_var]
        try:
            sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan
        except PlanError as exc:
            start = _undecodable(problem, options, start, report, candidates, exc)
            if start.plan is None:  # nothing replays: the proven floor only
                return no_plan_result(problem, options, method, Status.NO_SOLUTION,
                                      report).with_(bound=setup.lift(floor))
            return _candidate_result(problem, options, start.plan, setup.lift(floor),
                                     method=method, solver=solver, report=report)
        if sim > values[built.objective_var] + 1e-6 * max(1.0, sim):
            # engine tolerances on big-M rows (or rounded times): the simulator is the judge
            report["model_mismatch"] = (f"the simulator says {sim}, the model "
                                        f"{values[built.objective_var]}")
        refuted = _refuted(status, values[built.objective_var], start)
        if refuted is not None:  # the engine's proof is wrong: only the proven floor stays
            report["warning"] = refuted
            status, bound = Status.FEASIBLE, setup.lift(floor)
        if start.plan is not None and sim > start.makespan + 1e-9:
            plan, sim = start.plan, start.makespan
            report["incumbent"] = "the fastest candidate plan (the engine's was slower)"
        if status is Status.OPTIMAL and sim > bound + 1e-6 * max(1.0, sim):
            status = Status.FEASIBLE  # optimal for the rounded times only
        elif status is Status.FEASIBLE and sim <= bound + 1e-9 * max(1.0, sim):
            status = Status.OPTIMAL  # the bound lifted to the time grid meets the plan
            report["note"] = "the bound, lifted to the time grid, meets the plan"
    elif start.plan is not None:
        plan, sim, status = start.plan, start.makespan, Status.FEASIBLE
        report["incumbent"] = "the fastest candidate plan"
    if plan is None:
        return no_plan_result(problem, options, method, Status.NO_SOLUTION, report).with_(
            bound=bound)
    res = plan_result(problem, options, plan, method=method, solver=solver,
                      status=status, report=report)
    if res.status is Status.FEASIBLE:
        res = res.with_(bound=min(bound, res.objective))
    return res


def _cross_check(problem: RematOffloadProblem, options: SolveOptions, start: _Start,
                 out: EngineResult, report: dict[str, Any],
                 candidates: list[tuple[float, str, tuple[AnyOp, ...]]] | None = None
                 ) -> _Start:
    """``start``, or without a warm start a replayed plan to check the engine's proof by.

    When the engine answers ``infeasible`` or ``optimal`` and there is no warm start
    (``warm_start=False``), the fastest of :func:`_cheap_candidates` (the checkpoint DP's
    and DYNPROG's plans), computed after the solve and never given to the engine, becomes
    the incumbent (``report['cross_check']`` names it): the offload model's engines gave
    wrong proofs on slow links (``chain_bandwidth=1e-9``: HiGHS's ``infeasible``, CP-SAT's
    presolve an optimum 1.5x too high; hunt, stop 76), and this model shares their big-M
    rows and horizons. ``candidates``: the replayed candidates the solve computed already
    (fastest first; the cheap ones under a time limit), used instead of computing them again.
    """
    if start.plan is not None or out.status not in (Status.INFEASIBLE, Status.OPTIMAL):
        return start
    found = candidates or _cheap_candidates(problem, options)
    report["cross_check"] = None if not found else {"method": found[0][1],
                                                    "makespan": found[0][0]}
    return _with_fastest(start, found)


def _with_fastest(start: _Start, found: list[Candidate]) -> _Start:
    """``start`` with the fastest of ``found`` (fastest first) as its plan (unchanged: none)."""
    return replace(start, plan=found[0][2], makespan=found[0][0]) if found else start


def _candidate_result(problem: RematOffloadProblem, options: SolveOptions,
                      plan: tuple[AnyOp, ...], proven: float, *, method: str,
                      solver: str | None, report: dict[str, Any]) -> Result:
    """A candidate plan replayed as the answer: ``feasible`` with the ``proven`` bound."""
    res = plan_result(problem, options, plan, method=method, solver=solver,
                      status=Status.FEASIBLE, report=report)
    return res.with_(bound=min(proven, res.objective)) if res.status.has_plan else res


def _undecodable(problem: RematOffloadProblem, options: SolveOptions, start: _Start,
                 report: dict[str, Any], candidates: list[Candidate] | None,
                 exc: PlanError) -> _Start:
    """The incumbent when the engine's plan does not replay: its answer is dropped.

    HiGHS's tolerances on big-M rows can let a badly conditioned model's rows slip (a very
    slow link, ``chain_bandwidth`` 1e-8: "B 4 needs 58 memory, above the limit 51"; 42 of
    294 seeded 3-4-stage cases at 1e-9..1e-6, stop 77). Such a solve answered ``error``;
    it now answers the fastest replayed candidate (the warm start, else
    :func:`_cheap_candidates`), ``feasible`` with the proven floor only, and says why in
    ``report['warning']``; with none (only plans that both recompute and offload fit),
    ``no_solution`` with that floor. ``start`` unchanged (no plan) then.
    """
    report["warning"] = (f"the engine's plan does not replay ({exc}): its answer and bound "
                         "are ignored (engine tolerances on a badly conditioned model; "
                         "method 'cpsat' computes with exact integers)")
    if start.plan is not None:
        report["incumbent"] = "the fastest candidate plan (the engine's does not replay)"
        return start
    found = candidates or _cheap_candidates(problem, options)
    if found:
        report["incumbent"] = f"{found[0][1]} (the engine's plan does not replay)"
    return _with_fastest(start, found)


def _refuted(status: Status, model_value: float, start: _Start) -> str | None:
    """Why the incumbent refutes the engine's ``optimal`` (``None``: it does not).

    The engine's optimum ``model_value`` (the model's objective, a lower bound on every
    plan of the model's class when proven; rounded times are rounded down) above the
    replayed makespan of a plan, beyond the engines' tolerance ``1e-6``.
    """
    if status is not Status.OPTIMAL or start.plan is None:
        return None
    if model_value <= start.makespan + 1e-6 * max(1.0, start.makespan):
        return None
    return (f"the engine's optimum {model_value} is above the replayed makespan "
            f"{start.makespan} of the fastest candidate plan: its proof and bound are "
            f"ignored")


def _horizon(start: _Start) -> float | None:
    """The full solve's bound on every time (``None``: no completed warm start).

    The warm start's model value plus :data:`HORIZON_SLACK` of it.
    """
    if start.values is None:
        return None
    return start.model_value + HORIZON_SLACK * max(1.0, abs(start.model_value))


# the options both engines of the model read (cpsat adds its strategy's)
MODEL_EXTRA = ("sweeps", "transfers_per_gap", "grid", "backlog_grid", "prefetch",
               "relaxation", "relaxation_deadlines", "relaxation_values", "relaxation_lazy",
               "relaxation_read_deadlines", "relaxation_sequence", "relaxation_share",
               "relaxation_cumulative_reads", "relaxation_window", "relaxation_compact",
               "relaxation_window_jobs", "relaxation_plain", "dp_ladder", "autocapper_candidate",
               "autocapper_values", *LNS_EXTRA, *PROBE_EXTRA)  # cpsat only (ilp refuses them)


@register(PROBLEM, "ilp", exact=True, full_model=True, requires=("pulp",),
          description="exact model (checkpoint slots + link positions, O.7 memory), PuLP",
          compare_as=(("ilp", 6),), compare_limited=60,
          extra=MODEL_EXTRA)
def solve_ilp(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Optimal plan over the model's class (module docstring), HiGHS/CBC/Gurobi."""
    return _solve_model(problem, options, "ilp")


@register(PROBLEM, "cpsat", exact=True, full_model=True, requires=("ortools",),
          description="exact model (same formulation as ilp), CP-SAT",
          compare_as=(("cpsat", 6),),
          extra=(*MODEL_EXTRA, "strategy", "benders_work", "benders_filter_work",
                 "benders_iterations", "benders_warmup", "benders_filter", "benders_host_bound",
                 "benders_first_found", "benders_compute_cut", "benders_compute_work",
                 "relaxation_first"))
def solve_cpsat(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Optimal plan over the model's class with OR-Tools CP-SAT."""
    return _solve_model(problem, options, "cpsat")


@register_exporter(PROBLEM, "ilp")
def export_ilp(problem: RematOffloadProblem, options: SolveOptions, path: str) -> None:
    """Write the model (no warm start, default horizon) as ``.mps`` or ``.lp``."""
    disc, beta = discretized(problem, options)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta,
                                sweeps=positive_int(options, "sweeps", 1),
                                transfers_per_gap=positive_int(options, "transfers_per_gap", 1))
    write_model(cast(Any, to_pulp(built.model)), path)  # needs only ``.problem``
