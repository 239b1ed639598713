"""Methods ``ilp`` and ``cpsat``: the exact pipeline model, one formulation, two engines.

Both solve :mod:`optmem.models.pipeline` (all allocations and 1-periodic patterns, thesis
ch. 6 corrected; its emitters write it for PuLP and CP-SAT). Before the engine runs, the
best contiguous 1F1B* plan (stash memory model, thesis ch. 5) and the MadPipe plan
(:mod:`optmem.solvers.pipeline_madpipe`) are computed and replayed; the better one is the
engine's warm start and its period the cutoff on the model's period. The answer is the
best replayed plan among the engine's and these, with the proven bound of
:mod:`optmem.solvers.pipeline_common` (the load bound at least): ``optimal`` when they meet
(:data:`~optmem.solvers.pipeline_common.OPTIMALITY_TOLERANCE`). A time limit returns that
plan with its bound (``feasible``); an engine that fails returns the best incumbent,
replayed, as ``feasible``, or ``error`` without one
(:func:`~optmem.engines.results.engine_failure`).

Options: ``time_limit_s`` (``None``: no limit), ``node_limit`` (the MILP engines),
``deterministic_time`` (CP-SAT), ``seed``, ``threads``, ``solver`` (``ilp``'s engine),
``warm_start`` (``False``: no incumbents, no cutoff), ``verbose``; there is no hidden
limit. ``extra["warm_madpipe"]`` (default ``True``: also run MadPipe for the incumbent; it
gets a tenth of the time limit, or its own deterministic work limits when there is none),
``extra["relaxation"]`` (default ``True``: bound the period by
:func:`relaxation_bound` first; needs OR-Tools), ``extra["strategy"]`` (``"full"``, the
default: the whole model at once; ``"benders"``: the allocation decomposition of
:mod:`optmem.solvers.pipeline_benders`, the method's engine solving the fixed-allocation
subproblems, CP-SAT the master; it falls back to ``"full"`` without an incumbent or without
OR-Tools), ``extra["trim_work"]`` (``benders`` only: CP-SAT deterministic time of each
trimmed solve that generalises a refuted allocation, default 2.0; ``None``: no limit),
``extra["isolate"]`` (``benders`` only, default ``False``: also generalise each refuted
allocation by refuting two of its GPUs in isolation, a GPU-set no-good),
``extra["colocate_step"]`` (default ``None``: off; a number in (0, 1): after the relaxation
and the probes, raise the bound by the co-location climb of
:func:`~optmem.solvers.pipeline_benders.climb_bound`, probes ``bound x (1 + step)``, with
:data:`COLOCATE_SHARE` of the time left under a limit), ``extra["colocate_work"]`` (CP-SAT
deterministic time of each of its refutations, default
:data:`~optmem.solvers.pipeline_benders.COLOCATE_WORK`), ``extra["colocate_order"]``
(``"ladder"``, the default: probes ``bound x (1 + step)`` upwards; ``"bisect"``: probes
halfway between the bound and the lowest open probe, at least one step up:
:meth:`~optmem.solvers.pipeline_benders.Benders.climb`), ``extra["lns"]`` and
``extra["lns_work"]`` (the large-neighbourhood search of :mod:`optmem.solvers.pipeline_lns`
after the relaxation and the probes: moves and CP-SAT deterministic seconds per move; by
default 40 moves under a time limit on chains of at least 10 units, with
:data:`~optmem.solvers.pipeline_lns.LNS_SHARE` of the time left, else none),
``extra["colocate_beside"]`` (default ``True``: while the search runs under a time limit
with ``threads >= 2``, the co-location climb runs on a thread beside it, one CP-SAT worker
each, with ``colocate_step`` or :data:`BESIDE_STEP`, and stops with the search: the search
uses one worker, so the climb takes the core it leaves idle; :class:`BesideSearch`; with
``colocate_step`` set, the climb after the search goes on from its state).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, NamedTuple

from optmem.engines import adapters as engines
from optmem.engines.results import engine_failure
from optmem.errors import OptmemInputError
from optmem.models.formulation import to_cpsat
from optmem.models.interrupt import Interrupted, stop_when
from optmem.models.pipeline import build_relaxation, grid_scale, make_units, model_bounds
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers import pipeline_lns as lns
from optmem.solvers.options import flag
from optmem.solvers.pipeline_benders import (
    CLIMB_ORDERS,
    COLOCATE_WORK,
    Benders,
    climb_bound,
    solve_benders,
)
from optmem.solvers.pipeline_common import (
    MIN_ENGINE_LIMIT_S,
    OPTIMALITY_TOLERANCE,
    fits,
    infeasible,
    lower_bound,
    plan_result,
    proven,
    refute,
    run_model,
)
from optmem.solvers.pipeline_madpipe import madpipe_settings, solve_madpipe
from optmem.solvers.time_budget import Deadline, stopped_during

Candidate = tuple[float, PipelinePlan, str]
STRATEGIES = ("full", "benders")
"""``extra["strategy"]``: the full model, or the allocation decomposition."""


def incumbents(problem: PipelineProblem, options: SolveOptions) -> list[Candidate]:
    """Replayed plans of the contiguous 1F1B* optimum and of MadPipe (best first).

    The contiguous search stops at ``options.time_limit_s`` once it has a split (stop 76:
    3.8 s at L = 339, 24 GiB, where it did not poll), with the split of least period found
    so far; MadPipe gets a tenth of the limit.
    """
    found: list[Candidate] = []
    if problem.memory_model == "stash":
        sched = _contiguous_incumbent(problem, options.time_limit_s)
        if sched is not None and fits(problem, sched[1]):
            found.append((sched[0], sched[1], "contiguous 1F1B*"))
    if flag(options, "warm_madpipe", True):
        limit = options.time_limit_s / 10 if options.time_limit_s is not None else None
        res = solve_madpipe(problem, options.with_(time_limit_s=limit))
        if res.status.has_plan:
            plan = PipelinePlan.from_strings(res.plan)
            found.append((res.objective, plan, "madpipe"))
    return sorted(found, key=lambda c: c[0])



def _contiguous_incumbent(problem: PipelineProblem, limit_s: float | None
                          ) -> tuple[float, PipelinePlan] | None:
    """The 1F1B* plan of :func:`contig.best_contiguous`'s split, searched within ``limit_s``.

    The limit is asked once a split is found (``keep_first``): an incumbent whenever a
    contiguous split fits.
    """
    best = contig.best_contiguous(problem, stop=Deadline.start(limit_s, margin=0.0).stopper(),
                                  keep_first=True)
    return (best.period, best.plan) if best else None


RELAXATION_SHARE = 0.3
"""Share of a time limit (wall-clock or deterministic) given to the relaxation's bisection
(none without a limit)."""
RELAXATION_PRECISION = 1e-3
"""The bisection stops when the bound is within this (relative) of the incumbent's period."""


def relaxation_bound(problem: PipelineProblem, upper: float, options: SolveOptions,
                     time_limit_s: float | None) -> tuple[float, dict[str, Any]]:
    """Largest period proven impossible by :func:`~optmem.models.pipeline.build_relaxation`.

    Bisection over integer periods (grid ``1 / scale``) below ``upper`` (a valid plan's
    period), each probe a CP-SAT feasibility run; the first probe is just below ``upper``
    (proving it optimal at once when it is). Stops at :data:`RELAXATION_PRECISION`, at the
    time limit, or at a probe the engine cannot decide (or fails: then ``relaxation_error``
    is reported). Each probe gets ``options.deterministic_time`` times
    :data:`RELAXATION_SHARE` when that is set.
    """
    units = make_units(problem)
    low = lower_bound(problem)
    scale, _ = grid_scale([*units.f, *units.b, *units.dt], low, refine=False)
    lo, hi = math.floor(low * scale) - 1, math.floor(upper * scale)
    probe = math.floor(upper * scale * (1 - OPTIMALITY_TOLERANCE / 2))
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    probes, proven_at = 0, lo
    report: dict[str, Any] = {}
    settings = engines.cpsat_settings(options)
    if options.deterministic_time is not None:
        settings["deterministic_time"] = RELAXATION_SHARE * options.deterministic_time
    while hi - lo > max(1, RELAXATION_PRECISION * hi) and lo < probe < hi:
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            break
        try:  # the build and emission stop at the deadline too (5.8 + 2.1 s at L = 68)
            with stop_when(Deadline(deadline, time.perf_counter).stopper()):
                form = build_relaxation(units, problem.n_gpus, problem.memory_per_gpu, probe,
                                        scale, strict=problem.memory_model == "strict")
                cm = to_cpsat(form.model, 1)
        except Interrupted:
            report["relaxation_stopped"] = "time (in the model's build)"
            break
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            break
        res = engines.solve_cpsat(cm.cp, cm.variables, **{**settings, "time_limit_s": left})
        probes += 1
        if res.failed:
            report["relaxation_error"] = res.report()["engine_error"]
            break
        if res.status is Status.INFEASIBLE:
            lo = proven_at = probe
        elif res.status.has_plan:
            hi = probe
        else:
            break
        probe = (lo + hi) // 2
    bound = proven_at / scale if proven_at > math.floor(low * scale) - 1 else low
    return bound, {**report, "relaxation_bound": bound, "relaxation_probes": probes}


def first_bound(problem: PipelineProblem, upper: float, options: SolveOptions,
                plan: PipelinePlan | None = None) -> tuple[float, dict[str, Any]]:
    """The problem's bound before any search: :func:`relaxation_bound` below ``upper``.

    With ``extra["relaxation"]`` (default true), CP-SAT and a plan (``upper`` finite), the
    relaxation's bisection within :data:`RELAXATION_SHARE` of the time limit; otherwise
    :func:`~optmem.solvers.pipeline_common.lower_bound` and an empty report. On a chain
    where the tie separation matters (:func:`tie_separated_units`), also the tie-relaxed
    model's bound (:func:`tie_relaxed_bound`, ``plan`` its warm start;
    ``report["tie_relaxation"]``): a lower bound on the models' optimum, so every run
    after it starts from it (stop 79: CP-SAT proved 11.00073 in 0.02 s of engine time
    from it, where it had no bound above 7.5 after 5 deterministic s).
    """
    wanted = flag(options, "relaxation", True)  # checked with or without a plan
    bound, report = lower_bound(problem), dict[str, Any]()
    limit = options.time_limit_s
    share = None if limit is None else RELAXATION_SHARE * limit
    if wanted and math.isfinite(upper) and engines.is_available("cpsat"):
        bound, report = relaxation_bound(problem, upper, options, share)
    if tie_separated_units(problem):
        tie, info = tie_relaxed_bound(problem, options.with_(time_limit_s=share),
                                      upper=upper, plan=plan)
        report["tie_relaxation"] = info
        bound = max(bound, tie)
    return bound, report


def tie_separated_units(problem: PipelineProblem) -> bool:
    """Whether the models' tie separation matters: ``strict``, a unit with a zero-length task.

    Under ``strict`` the models count a start less than
    :func:`~optmem.models.pipeline.separation` after a zero-length task as tied with it
    (``_Builder.tie_vars``, rows ``neara``: a MILP has no strict inequality), so on such a
    chain their optimum is the problem's only up to the separation (docs/pipeline.md).
    """
    if problem.memory_model != "strict":
        return False
    lay = problem.layers
    return any(lay.fwd(lo, hi) == 0 or lay.bwd(lo, hi) == 0 for lo, hi in model_bounds(problem))


def tie_relaxed_bound(problem: PipelineProblem, options: SolveOptions, *,
                      upper: float = math.inf, plan: PipelinePlan | None = None
                      ) -> tuple[float, dict[str, Any]]:
    """A lower bound on every plan's period that does not depend on the tie separation.

    The *tie-relaxed* model (``build_pipeline_model(tie_relaxed=True)``) is the model
    without the rows ``neara``: a task ``u`` after a zero-length task ``t`` may count as
    tied with it (``near = 1``: the row of ``t`` counts ``u``'s stash or output) or not
    (``near = 0``) wherever it starts. Every plan of the problem is one of its solutions at
    its own period: take ``near = 1`` exactly for the tasks that start at ``t``'s instant
    (the rows then count what the simulator counts there: docs/pipeline.md, "Notes and
    limits"; ``neara`` was the only row that forced ``near = 1`` for a start close to
    ``t`` but not at it, the other rows bound ``near`` from above or hold for any larger
    value), and the window of each GPU at a task start that no zero-length task precedes
    by less than the separation (rows ``wend``; one exists while the GPU has fewer than
    ``T / separation`` tasks, about ``2^14``: following zero-length predecessors closer
    than that from a start never closes a cycle round the period). So its optimum is at
    most the problem's infimum, whatever the separation, and also where no plan attains
    the infimum; it is at most the models' optimum too (they add rows to it). The
    encoder writes a plan with ``near = 1`` at its exact ties only, and
    ``tests/test_pipeline_zero_ties.py`` checks that its rows hold iff the simulator fits
    for random plans with starts closer than the separation.

    One run of CP-SAT (its presolve can drop the free ``near``, which only add to memory
    rows; without OR-Tools the MILP engine ``options.solver``) with the limits of
    ``options``, the period at most ``upper`` (finite: a valid plan's period) and ``plan``
    as warm start. Returns the bound (the load bound when the run proves nothing, also
    when it finds no solution at or below ``upper``) and a report (engine, its status,
    the bound, the model's size).
    """
    low = lower_bound(problem)
    engine = "cpsat" if engines.is_available("cpsat") else "ilp"
    if engine == "ilp":
        engines.check_engine(options.solver)
    run = run_model(problem, engine, options, upper_bound=upper if math.isfinite(upper)
                    else None, warm=plan, tie_relaxed=True)
    bound = run.bound
    if run.failed or not math.isfinite(bound):
        bound = low
    bound = max(low, min(bound, upper))
    return bound, {"engine": engine if engine == "cpsat" else options.solver,
                   "engine_status": str(run.status), "bound": bound,
                   "model_size": run.report.get("model_size")}


PROBE_WORK = 60.0
"""Default ``extra["probe_work"]``: CP-SAT deterministic time of one full-model probe."""


class ProbeSettings(NamedTuple):
    """``extra["probe_step"]`` (``None``: no probes), ``["probe_work"]``, ``["lifetime_cuts"]``.

    Built only by :func:`probe_settings`, which applies the defaults (no probes,
    :data:`PROBE_WORK`, no cuts) and checks the values.
    """

    step: float | None
    work: float
    cuts: bool


def probe_settings(options: SolveOptions) -> ProbeSettings:
    """The probe options of ``options.extra``, checked (one clear error each)."""
    extra = options.extra
    step, work = extra.get("probe_step"), extra.get("probe_work", PROBE_WORK)
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                             or not 0 < step < 1):
        raise OptmemInputError(f"probe_step must be a number in (0, 1) or null, got {step!r}",
                               field="probe_step")
    if isinstance(work, bool) or not isinstance(work, (int, float)) or not work > 0:
        raise OptmemInputError(f"probe_work must be a positive number, got {work!r}",
                               field="probe_work")
    if not isinstance(extra.get("lifetime_cuts", False), bool):
        raise OptmemInputError(f"lifetime_cuts must be true or false, got "
                               f"{extra['lifetime_cuts']!r}", field="lifetime_cuts")
    return ProbeSettings(step, float(work), extra.get("lifetime_cuts", False))


def probe_bound(problem: PipelineProblem, best: Candidate, bound: float,
                options: SolveOptions, deadline: float | None, settings: ProbeSettings
                ) -> tuple[float, Candidate | None, dict[str, Any]]:
    """Raise ``bound`` by full-model feasibility probes just above it (``extra["probe_step"]``).

    Probe ``k`` asks CP-SAT (``probe_work`` deterministic seconds, the options' threads and
    seed) whether any allocation and 1-periodic pattern has a period at most ``T_k =
    bound (1 + step)`` (below the incumbent). Infeasible: no plan has a period ``<= T_k``
    up to the engine's grid, so ``T_k - 2 / scale`` is a proven bound (as for the
    incumbent's cutoff in :func:`solve_exact`) and the next probe is one step higher. A
    plan: replayed, it is returned as the new incumbent and probing ends. Undecided, a
    failed engine or the deadline: probing ends with the last proven bound. The bisection
    of the lifetime relaxation cannot see waits; the full model does, and just above the
    relaxation's bound its refutations are the cheapest (``benchmarks/results/
    pipeline_exact.md``). ``settings``: :func:`probe_settings`.
    """
    step, work, cuts = settings
    report: dict[str, Any] = {"probes": []}
    found: Candidate | None = None
    while step is not None:
        target = bound * (1 + step)
        if target >= best[0] * (1 - OPTIMALITY_TOLERANCE):
            break
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            break
        opts = options.with_(deterministic_time=work, time_limit_s=left, warm_start=False)
        run, proved = refute(problem, opts, target, lower=bound, lifetime_cuts=cuts)
        report["probes"].append({"period": target, "status": run.status.value,
                                 **{k: run.report[k] for k in ("engine_time_s",)
                                    if k in run.report}})
        if proved is None:
            if run.plan is not None and not run.failed and fits(problem, run.plan):
                found = (run.plan.period, run.plan, "probe")
            break
        bound = max(bound, proved)
    report["probe_bound"] = bound
    return bound, found, report


COLOCATE_SHARE = 0.5
"""Share of the time left (under a wall-clock limit) given to the co-location climb."""


def colocate_settings(options: SolveOptions) -> tuple[float | None, float, str]:
    """The climb's options, checked.

    ``extra["colocate_step"]`` (``None``: off), ``["colocate_work"]`` and
    ``["colocate_order"]`` (:data:`~optmem.solvers.pipeline_benders.CLIMB_ORDERS`).
    """
    extra = options.extra
    step, work = extra.get("colocate_step"), extra.get("colocate_work", COLOCATE_WORK)
    order = extra.get("colocate_order", "ladder")
    if not isinstance(order, str) or order not in CLIMB_ORDERS:
        raise OptmemInputError(f"colocate_order must be one of {', '.join(CLIMB_ORDERS)}, "
                               f"got {order!r}", field="colocate_order")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                             or not 0 < step < 1):
        raise OptmemInputError(f"colocate_step must be a number in (0, 1) or null, got "
                               f"{step!r}", field="colocate_step")
    if isinstance(work, bool) or not isinstance(work, (int, float)) or not work > 0:
        raise OptmemInputError(f"colocate_work must be a positive number, got {work!r}",
                               field="colocate_work")
    return step, float(work), order


BESIDE_STEP = 0.01
"""Step of the climb beside the search when ``extra["colocate_step"]`` is not set: the 1 %
ladder, the order that closes the most rungs on the headline per CPU second
(``benchmarks/results/pipeline_exact.md``, "Climb order")."""


class BesideSearch:
    """The co-location climb on a thread of its own while the search runs.

    The search (:func:`~optmem.solvers.pipeline_lns.improve`) asks CP-SAT with one worker,
    so under ``threads >= 2`` a core is idle while it runs: the climb
    (:meth:`~optmem.solvers.pipeline_benders.Benders.climb`, one worker per CP-SAT call)
    takes it. :meth:`stop` moves the climb's deadline to now and waits for its engine call
    in flight (at most ``colocate_work`` deterministic seconds, and never past the search's
    own deadline). The climb reads the incumbent it started from; a plan the search finds
    meanwhile does not change what the climb proves (its probes are lower bounds on every
    plan), only where it would have stopped.
    """

    def __init__(self, problem: PipelineProblem, options: SolveOptions, best: Candidate,
                 bound: float, deadline: float | None, step: float, order: str) -> None:
        self.climber = Benders(problem, "cpsat", options.with_(threads=1), best[0], best[1],
                               bound, deadline)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=engines.carry_budget(self._climb),
                                       args=(step, order),
                                       name="optmem-colocate-climb", daemon=True)
        self.thread.start()

    def _climb(self, step: float, order: str) -> None:
        try:
            self.climber.climb(step, order)
        except BaseException as exc:  # handed to the solving thread by stop()
            self.error = exc

    def stop(self) -> Benders:
        """End the climb now (after its engine call in flight) and return its state."""
        now = time.perf_counter()
        if self.climber.deadline is None or self.climber.deadline > now:
            self.climber.deadline = now
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.climber


def beside_search(problem: PipelineProblem, options: SolveOptions, best: Candidate,
                  bound: float, deadline: float | None, step: float | None, order: str
                  ) -> BesideSearch | None:
    """Start the climb beside the search (``None`` when it does not run).

    It runs when ``extra["colocate_beside"]`` (default ``True``) and the setting allow it:
    a time limit, ``threads >= 2`` and CP-SAT. ``step``, ``order``: the checked
    ``colocate_step`` (``None``: :data:`BESIDE_STEP`) and ``colocate_order``
    (:func:`colocate_settings`).
    """
    if not flag(options, "colocate_beside", True) or options.time_limit_s is None \
            or options.threads < 2 or not engines.is_available("cpsat"):
        return None
    return BesideSearch(problem, options, best, bound, deadline,
                        BESIDE_STEP if step is None else step, order)


def solve_exact(problem: PipelineProblem, options: SolveOptions, method: str) -> Result:
    """Optimal allocation and 1-periodic pattern (``method``: ``ilp`` or ``cpsat``)."""
    strategy = options.extra.get("strategy", "full")
    if strategy not in STRATEGIES:
        raise OptmemInputError(f"unknown strategy {strategy!r} (expected one of "
                               f"{', '.join(STRATEGIES)})", field="strategy")
    work = options.extra.get("trim_work", 2.0)
    if work is not None and (isinstance(work, bool) or not isinstance(work, (int, float))
                             or not work > 0):
        raise OptmemInputError(f"trim_work must be a positive number or null, got {work!r}",
                               field="trim_work")
    if not isinstance(options.extra.get("isolate", False), bool):
        raise OptmemInputError(f"isolate must be true or false, got "
                               f"{options.extra['isolate']!r}", field="isolate")
    probing = probe_settings(options)
    units = make_units(problem)
    search = lns.settings(options, units.n)
    colocate_step, _, colocate_order = colocate_settings(options)
    flag(options, "warm_madpipe", True)
    flag(options, "relaxation", True)
    flag(options, "colocate_beside", True)
    madpipe_settings(options)  # the warm start's MadPipe run reads them
    if method == "ilp":
        engines.check_engine(options.solver)
    solver = options.solver if method == "ilp" else "cpsat"
    start = time.perf_counter()
    starts = incumbents(problem, options) if options.warm_start else []
    best = starts[0] if starts else None
    limit = options.time_limit_s
    relaxed, report = first_bound(problem, math.inf if best is None else best[0], options,
                                  None if best is None else best[1])
    end = None if limit is None else start + limit
    try:  # every build of the search polls the deadline (stop 74; optmem.models.interrupt)
        with stop_when(Deadline(end, time.perf_counter).stopper()):
            if best is not None and probing.step is not None and engines.is_available("cpsat"):
                relaxed, probed, info = probe_bound(problem, best, relaxed, options, end,
                                                    probing)
                report.update(info)
                if probed is not None:
                    starts = _joined(starts, [probed])
                    best = starts[0]
            climbed: Benders | None = None  # the climb beside the search; the one after goes on
            if best is not None and search.moves and engines.is_available("cpsat") \
                    and not proven(best[0], relaxed):
                left = None if limit is None else max(0.0, limit - (time.perf_counter() - start))
                deadline = None if left is None else time.perf_counter() + lns.LNS_SHARE * left
                beside = beside_search(problem, options, best, relaxed, deadline, colocate_step,
                                       colocate_order)
                try:
                    found = lns.improve(problem, best[0], best[1], moves=search.moves,
                                        work=search.work, seed=options.seed, bound=relaxed,
                                        units=units, deadline=deadline)
                finally:  # the climb never outlives the search, whatever ends it
                    climbed = beside.stop() if beside is not None else None
                report.update(found.report())
                if found.improvements:
                    starts = _joined(starts, [(found.period, found.plan, "lns")])
                if climbed is not None:
                    report.update(climbed.report, colocate_beside=True)
                    relaxed = max(relaxed, climbed.bound)
                    starts = _joined(starts, [(p, pl, "colocate") for p, pl in climbed.found])
                best = starts[0]
            if best is not None and colocate_step is not None and engines.is_available("cpsat") \
                    and not proven(best[0], relaxed):
                left = None if limit is None else max(0.0, limit - (time.perf_counter() - start))
                known = 0 if climbed is None else len(climbed.found)  # joined already
                climbed = climb_bound(problem, options, period=best[0], plan=best[1], bound=relaxed,
                                      deadline=None if left is None
                                      else time.perf_counter() + COLOCATE_SHARE * left,
                                      step=colocate_step, order=colocate_order, state=climbed)
                report.update(climbed.report)
                relaxed = max(relaxed, climbed.bound)
                if climbed.found[known:]:
                    starts = _joined(starts, [(p, pl, "colocate")
                                              for p, pl in climbed.found[known:]])
                    best = starts[0]
            if best is not None and proven(best[0], relaxed):
                report.update(incumbents={s: p for p, _, s in starts}, source=best[2])
                return plan_result(problem, best[1], method=method, status=Status.OPTIMAL,
                                   bound=min(relaxed, best[0]), claimed=best[0], solver=solver,
                                   report=report)
            if best is not None and strategy == "benders" \
                    and engines.is_available("cpsat"):
                return _decomposed(problem, options, method, solver, starts, relaxed,
                                   None if limit is None else start + limit, report)
            left = None if limit is None else max(MIN_ENGINE_LIMIT_S,
                                                  limit - (time.perf_counter() - start))
            run = run_model(problem, method, options.with_(time_limit_s=left),
                            upper_bound=best[0] if best else None, warm=best[1] if best else None,
                            lower=relaxed, lifetime_cuts=probing.cuts, deadline=end)
            report = {**report, **run.report, "incumbents": {s: p for p, _, s in starts}}
            if run.failed and run.engine is not None:
                return _failure(problem, method, solver, run.engine, report, best, relaxed)
            candidates = list(starts)
            if run.plan is not None:
                if fits(problem, run.plan):
                    candidates.append((run.plan.period, run.plan, "engine"))
                else:
                    report["engine_plan"] = "rejected by the simulator"
            if run.bound == math.inf:  # the model has no solution below the cutoff, if any
                if best is None:
                    return infeasible(problem, method, "no allocation and 1-periodic pattern fits "
                                      "(proven by the model)", report=report).with_(solver=solver)
                bound = best[0] - 2 * run.step
            else:
                bound = run.bound
            bound = max(bound, relaxed) if not math.isnan(bound) else relaxed
            if not candidates:
                return infeasible(problem, method, f"engine stopped without a solution "
                                  f"({run.report.get('engine_status', '')})", proven=False,
                                  report=report).with_(solver=solver)
            period, plan, source = min(candidates, key=lambda c: c[0])
            report["source"] = source
            status = Status.OPTIMAL if proven(period, bound) else Status.FEASIBLE
            return plan_result(problem, plan, method=method, status=status,
                               bound=min(bound, period), claimed=period, solver=solver,
                               report=report)
    except Interrupted:
        return _stopped(problem, method, solver, starts, relaxed, report)


def _stopped(problem: PipelineProblem, method: str, solver: str, starts: list[Candidate],
             relaxed: float, report: dict[str, Any]) -> Result:
    """The answer when the full model's build reaches the time limit (stop 74).

    The best replayed incumbent, ``feasible`` with the bound proven so far (the
    relaxation's, the probes'), ``report["stopped"]``; without one, ``no_solution`` (not
    proven infeasible). Before, the build ran outside the limit: ``ilp`` took 24.6 s and
    ``cpsat`` 22.1 s under ``--time-limit 10`` on DenseNet-121 (L = 68, 4 GPUs, 3 GiB).
    """
    report = {**report, "stopped": stopped_during("the model's build"),
              "incumbents": {s: p for p, _, s in starts}}
    if not starts:
        return infeasible(problem, method, "the time limit passed before the model was "
                          "built, and no incumbent fits", proven=False,
                          report=report).with_(solver=solver)
    period, plan, source = starts[0]
    report["source"] = source
    status = Status.OPTIMAL if proven(period, relaxed) else Status.FEASIBLE
    return plan_result(problem, plan, method=method, status=status,
                       bound=min(relaxed, period), claimed=period, solver=solver,
                       report=report)


def _joined(starts: list[Candidate], found: list[Candidate]) -> list[Candidate]:
    """The incumbents with plans ``found`` on the way, fastest first."""
    return sorted([*starts, *found], key=lambda c: c[0])


FULL_SHARE = 0.25
"""Share of a wall-clock limit the ``benders`` strategy first gives the full model."""


def _decomposed(problem: PipelineProblem, options: SolveOptions, method: str, solver: str,
                starts: list[Candidate], relaxed: float, deadline: float | None,
                report: dict[str, Any]) -> Result:
    """Strategy ``benders``: a short full-model run, then the allocation decomposition.

    Under a limit (``time_limit_s``: :data:`FULL_SHARE` of what is left;
    ``deterministic_time``: its own) the full model runs first, from the best incumbent: it
    often finds better non-contiguous plans quickly, and its bound is kept. Then
    :mod:`optmem.solvers.pipeline_benders` starts from the best replayed plan and bound.
    """
    candidates = list(starts)
    bound = relaxed
    if deadline is not None or options.deterministic_time is not None:
        left = None if deadline is None else max(
            MIN_ENGINE_LIMIT_S, FULL_SHARE * (deadline - time.perf_counter()))
        best = min(candidates, key=lambda c: c[0])
        run = run_model(problem, method, options.with_(time_limit_s=left),
                        upper_bound=best[0], warm=best[1], lower=relaxed)
        report = {**report, "full_model": {k: run.report.get(k) for k in (
            "engine_status", "engine_time_s", "nodes") if k in run.report}}
        if run.plan is not None and not run.failed and fits(problem, run.plan):
            candidates.append((run.plan.period, run.plan, "engine"))
        if run.bound == math.inf and not run.failed:
            bound = max(bound, best[0] - 2 * run.step)
        elif math.isfinite(run.bound) and not run.failed:
            bound = max(bound, run.bound)
    period, plan, _ = min(candidates, key=lambda c: c[0])
    out = solve_benders(problem, method, options, period=period, plan=plan, bound=bound,
                        deadline=deadline)
    report = {**report, **out.report, "strategy": "benders",
              "incumbents": {s: p for p, _, s in starts}}
    candidates += [(p, pl, "benders") for p, pl in out.found]
    period, plan, source = min(candidates, key=lambda c: c[0])
    report["source"] = source
    status = Status.OPTIMAL if proven(period, out.bound) else Status.FEASIBLE
    return plan_result(problem, plan, method=method, status=status,
                       bound=min(out.bound, period), claimed=period, solver=solver,
                       report=report)


def _failure(problem: PipelineProblem, method: str, solver: str, out: engines.EngineResult,
             report: dict[str, Any], best: Candidate | None, relaxed: float) -> Result:
    """The result when the engine failed: the best incumbent, replayed, or ``error``."""
    fallback = None
    if best is not None:
        period, plan, source = best

        def fallback(info: dict[str, Any]) -> Result:
            return plan_result(problem, plan, method=method, status=Status.FEASIBLE,
                               bound=min(relaxed, period), claimed=period, solver=solver,
                               report={**info, "source": source})

    return engine_failure("pipeline", method, out, report=report, fallback=fallback,
                          memory_limit=problem.memory_per_gpu, solver=solver)
