"""Pipeline methods behind the facade (problem ``pipeline``).

==============  ======  ==================================================================
method          exact   what
==============  ======  ==================================================================
``contiguous``  yes*    best contiguous allocation + optimal 1F1B* (thesis ch. 5, Alg. 7
                        with an exact period scan); *optimal among contiguous allocations
                        and 1-periodic patterns, stash memory model
``equal``       no      equal layer counts on every GPU + 1F1B* (torch.distributed.pipelining)
``pipedream``   no      PipeDream's planner (DP + crude memory filter) + 1F1B*, the thesis'
                        "PipeDream = DP + 1F1B*" baseline (section 7.3.3), best stage count
``madpipe``     no      MadPipe (ch. 7): DP over non-contiguous allocations with one special
                        GPU, then the exact model schedules the coarse chain (with fallbacks)
``ilp``         yes     the exact model of chapter 6 with the digest's corrections, emitted
                        to PuLP (:mod:`optmem.models.pipeline`)
``cpsat``       yes     the same model emitted to CP-SAT (intervals, no-overlap)
``chunks``      yes*    every allocation with at most k chunks (runs of layers) per GPU,
                        each decided by the exact model with the allocation fixed
                        (:mod:`optmem.solvers.pipeline_chunks`); *optimal among those
                        allocations and 1-periodic patterns when ``chunks_bound`` is set
==============  ======  ==================================================================

Every plan is replayed by :func:`optmem.simulate.pipeline.simulate_pipeline` before it is
returned: the objective is the simulated period and every GPU's peak is within the limit.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from optmem.models.interrupt import Interrupted, poll, stop_when
from optmem.models.pipeline import Units, make_units, model_bounds, separation
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers import pipeline_chunks as chunked
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.options import flag
from optmem.solvers.pipeline_common import (
    PROBLEM,
    below_least_memory,
    infeasible,
    lower_bound,
    plan_result,
    proven,
)
from optmem.solvers.pipeline_exact import (
    first_bound,
    incumbents,
    solve_exact,
    tie_separated_units,
)
from optmem.solvers.pipeline_madpipe import solve_madpipe
from optmem.solvers.registration import register, register_exporter
from optmem.solvers.time_budget import Deadline, stopped_during

ENGINES = ("pulp",)
WALK_SHARE = 0.1
"""Share of ``time_limit_s`` that ``chunks`` keeps for the walk of :func:`_allocations_bound`
after its scan and complete family (stop 71): they stop at ``(1 - WALK_SHARE) x`` the limit,
the walk at the limit. Before, the walk ran to its deterministic work cap past the limit
(ResNet-50 at 3x, 4 GPUs: 81 s for a 60 s limit, 326 s for 300 s)."""
MADPIPE_EXTRA = ("phase2", "madpipe_grid", "madpipe_iterations")
"""``SolveOptions.extra`` keys of ``madpipe``."""
EXACT_EXTRA = ("warm_madpipe", "relaxation", "stash_relaxation", "strategy", "trim_work", "isolate",
               "probe_step", "probe_work", "lifetime_cuts", "colocate_step", "colocate_work",
               "colocate_order", "colocate_beside", "lns", "lns_work", *MADPIPE_EXTRA)
"""Keys of ``ilp``/``cpsat``: their own, and MadPipe's (its run gives their warm start)."""
CHUNKS_EXTRA = ("chunks", "chunk_work", "chunk_step", "chunk_retry_work", "family",
                "family_limit", "waits", "trim", "trim_tail", "trim_share", "heads",
                "head_step", "head_floor", "head_contents", "head_processes", "proof_gap",
                "warm_madpipe", "relaxation", "stash_relaxation",
                *MADPIPE_EXTRA)
"""Keys of ``chunks``: its own, and MadPipe's (its run gives the first cutoff)."""


def _schedule_allocation(problem: PipelineProblem, bounds: contig.Bounds
                         ) -> tuple[float, PipelinePlan] | None:
    return contig.best_period_for_allocation(problem, bounds)


def min_memory_contiguous(problem: PipelineProblem) -> int:
    """Smallest memory per GPU at which some contiguous allocation has a schedule.

    :func:`contig.best_contiguous` has a plan exactly when some split of the layers into
    at most ``P`` contiguous stages has every stage within the memory with one activation
    stashed (its first check: the period ``total + links``, where 1F1B* keeps one copy per
    stage), so the threshold is the least over such splits of the largest
    ``stage_memory(i, j, 1)``: a min-max partition, solved by a dynamic program over the
    split's last stage (``O(P L^2)``; the ``L^2 / 2`` stage memories are the problem's
    :meth:`~PipelineProblem.stage_memory`, computed once). Until stop 75 a
    doubling search and a bisection called :func:`contig.best_contiguous` (its whole period
    search) at each step: 111 s to say ``infeasible`` on ResNet-1001 (L = 339, 4 GPUs,
    12 GiB), where the DP takes milliseconds; ``tests/test_pipeline_min_memory.py`` checks
    the two agree. Never below 1.
    """
    n = problem.layers.n
    # memory[j][i - 1]: stage i..j alone on its GPU with one stash (the problem's own rule)
    memory = [np.array([problem.stage_memory(i, j, 1) for i in range(1, j + 1)],
                       dtype=np.int64) for j in range(1, n + 1)]
    inf = np.iinfo(np.int64).max
    best = np.full(n + 1, inf, dtype=np.int64)  # best[j]: layers 1..j in <= k stages
    best[0] = 0
    answer = inf
    for _ in range(min(problem.n_gpus, n)):
        new = np.full(n + 1, inf, dtype=np.int64)
        for j in range(1, n + 1):
            new[j] = int(np.min(np.maximum(best[:j], memory[j - 1])))
        best = np.minimum(best, new)
        answer = min(answer, int(best[n]))
    return max(1, answer)


# ------------------------------------------------------------------ contiguous
@register(PROBLEM, "contiguous", exact=True, default=True,
          description="best contiguous allocation + optimal 1F1B* (thesis ch. 5, exact scan)")
def solve_pipeline_contiguous(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Optimal among contiguous allocations and 1-periodic patterns (stash memory model).

    ``options.time_limit_s`` stops the period search (:func:`contig.best_contiguous`, or
    the strict model's scan, :func:`_best_contiguous_strict`; stop 76): the split of the
    least period found so far, ``feasible`` with the problem's bound and
    ``report["stopped"]``; ``no_solution`` before any split is found.
    """
    stop = Deadline.start(options.time_limit_s, margin=0.0).stopper()
    if problem.memory_model != "stash":
        return _best_contiguous_strict(problem, stop)
    try:
        found = contig.best_contiguous(problem, stop=stop)
    except Interrupted:
        return infeasible(problem, "contiguous", "the time limit passed before any contiguous "
                          "allocation was found", proven=False,
                          report={"stopped": stopped_during(SEARCH)}).with_(
            bound=lower_bound(problem))
    if found is None:
        least = min_memory_contiguous(problem)
        result = infeasible(problem, "contiguous",
                            "no contiguous allocation fits, even with one activation per stage; "
                            f"the smallest feasible memory per GPU is {least}")
        return result.with_(min_feasible_memory=least)
    return _contiguous_result(problem, found)


SEARCH = "the contiguous period search"
"""Where :func:`contig.best_contiguous` stops (``report["stopped"]``, :func:`stopped_during`)."""


def _contiguous_result(problem: PipelineProblem, found: contig.ContiguousBest) -> Result:
    """The replayed 1F1B* plan of ``found``: ``optimal`` when proven, else ``feasible``."""
    report: dict[str, Any] = {"model": "1F1B*", "proven": found.proven}
    if found.stopped:
        report["stopped"] = stopped_during(SEARCH)
    status = Status.OPTIMAL if found.proven else Status.FEASIBLE
    return plan_result(problem, found.plan, method="contiguous", status=status,
                       bound=found.period if found.proven else lower_bound(problem),
                       claimed=found.period, report=report)


def _best_contiguous_strict(problem: PipelineProblem, stop: Callable[[], bool] | None = None
                            ) -> Result:
    """Strict memory model: enumerate contiguous splits (small chains) and scan periods.

    Splits are tried in order of their least period (their largest pseudo-stage load) and
    the scan stops at the first whose least period exceeds the best found; a split with a
    stage below :meth:`PipelineProblem.stage_memory_floor`'s memory, and periods not below
    the best, are not scheduled. The plan is the one the full scan in enumeration order
    returns (ties go to the earlier split). ``stop`` (the solve's time limit, stop 76: 9.5 s
    at L = 339, 24 GiB, under load 8, where it did not poll) ends the enumeration and the
    scan with the best plan so far, ``feasible`` with ``report["stopped"]``
    (``no_solution`` without one).
    """
    scan = _StrictScan()
    try:
        with stop_when(stop):
            scan.run(problem)
    except Interrupted:
        scan.report["stopped"] = stopped_during(SEARCH)
    if scan.best is None and "stopped" in scan.report:
        return infeasible(problem, "contiguous", "the time limit passed before any contiguous "
                          "allocation was found", proven=False, report=scan.report)
    if scan.best is None:
        return infeasible(problem, "contiguous", "no contiguous allocation fits with 1F1B*")
    return plan_result(problem, scan.best[1], method="contiguous", status=Status.FEASIBLE,
                       bound=lower_bound(problem), claimed=scan.best[0], report=scan.report)


@dataclass
class _StrictScan:
    """:func:`_best_contiguous_strict`'s scan: the best plan so far, its split's rank."""

    best: tuple[float, PipelinePlan] | None = None
    index: int = -1
    report: dict[str, Any] = field(default_factory=lambda: {
        "model": "1F1B* (strict memory: not proven optimal)"})

    def run(self, problem: PipelineProblem) -> None:
        """Schedule the splits by increasing least period until none can do better."""
        splits = _contiguous_splits(problem)
        self.report["splits"] = len(splits)
        stage_floor = functools.cache(problem.stage_memory_floor)  # stages recur across splits
        for floor, index, bounds in sorted(splits):
            poll()
            if self.best is not None and floor > self.best[0]:
                break
            if any(stage_floor(i, j) > problem.memory_per_gpu for i, j in bounds):
                continue
            best = self.best
            found = contig.best_period_for_allocation(
                problem, bounds, at_most=math.inf if best is None else best[0],
                equal=best is None or index < self.index)
            if found and (best is None or (found[0], index) < (best[0], self.index)):
                self.best, self.index = found, index


def _contiguous_splits(problem: PipelineProblem) -> list[tuple[float, int, contig.Bounds]]:
    """The first 20,000 contiguous splits on at most ``P`` GPUs, fewer stages first.

    Each comes with its least period (its largest pseudo-stage load) and its rank in that
    order (:func:`_best_contiguous_strict` breaks ties by it).
    """
    from itertools import chain, combinations, islice

    n = problem.layers.n
    every = chain.from_iterable(combinations(range(1, n), k - 1)
                                for k in range(1, min(problem.n_gpus, n) + 1))
    out: list[tuple[float, int, contig.Bounds]] = []
    for cuts in islice(every, 20000):
        poll()
        edges = [0, *cuts, n]
        bounds = [(edges[t] + 1, edges[t + 1]) for t in range(len(edges) - 1)]
        f, b = contig.pseudo_loads(problem, bounds)
        out.append((max(x + y for x, y in zip(f, b, strict=True)), len(out), bounds))
    return out


# ------------------------------------------------------------------ baselines
@register(PROBLEM, "equal", exact=False,
          description="equal layer counts per GPU + 1F1B* (torch.distributed.pipelining)")
def solve_pipeline_equal(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Split the layers in ``P`` equal runs and schedule them with the optimal 1F1B*."""
    del options
    if (below := below_least_memory(problem, "equal")) is not None:
        return below
    bounds = contig.equal_split(problem, problem.n_gpus)
    found = _schedule_allocation(problem, bounds)
    if found is None:
        return infeasible(problem, "equal", "the equal split does not fit, even with one "
                          "activation per stage", proven=False)
    return plan_result(problem, found[1], method="equal", status=Status.FEASIBLE,
                       bound=lower_bound(problem), claimed=found[0])


@register(PROBLEM, "pipedream", exact=False,
          description="PipeDream planner (DP, crude memory filter) + optimal 1F1B*")
def solve_pipeline_pipedream(problem: PipelineProblem, options: SolveOptions) -> Result:
    """PipeDream's partitioning for each stage count, scheduled by 1F1B*; the best one."""
    del options
    if (below := below_least_memory(problem, "pipedream")) is not None:
        return below
    best: tuple[float, PipelinePlan, int] | None = None
    for k in range(1, min(problem.n_gpus, problem.layers.n) + 1):
        bounds = contig.pipedream_split(problem, k)
        if bounds is None:
            continue
        found = _schedule_allocation(problem, bounds)
        if found and (best is None or found[0] < best[0] - 1e-12):
            best = (found[0], found[1], k)
    if best is None:
        return infeasible(problem, "pipedream", "no PipeDream partition fits", proven=False)
    return plan_result(problem, best[1], method="pipedream", status=Status.FEASIBLE,
                       bound=lower_bound(problem), claimed=best[0],
                       report={"pipedream_stages": best[2]})


# ------------------------------------------------------------------ exact models, MadPipe
@register(PROBLEM, "ilp", exact=True, full_model=True, requires=("pulp",), max_length=8,
          description="exact model of thesis ch. 6 (corrected), general allocations (PuLP)",
          extra=EXACT_EXTRA)
def solve_pipeline_ilp(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Optimal 1-periodic pattern over all allocations (thesis ch. 6, corrected)."""
    relaxed = stash_relaxed(solve_pipeline_ilp, options)
    return merged_class(problem, solve_exact(problem, options, "ilp"), relaxed)


@register(PROBLEM, "cpsat", exact=True, full_model=True, requires=("ortools",), max_length=8,
          description="the same exact model with CP-SAT (intervals), general allocations",
          extra=EXACT_EXTRA)
def solve_pipeline_cpsat(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Optimal 1-periodic pattern over all allocations, CP-SAT emission of the same model."""
    relaxed = stash_relaxed(solve_pipeline_cpsat, options)
    return merged_class(problem, solve_exact(problem, options, "cpsat"), relaxed)


@register(PROBLEM, "madpipe", exact=False, requires=("pulp",),
          description="MadPipe: non-contiguous DP (one special GPU) + exact schedule (ch. 7)",
          extra=MADPIPE_EXTRA)
def solve_pipeline_madpipe(problem: PipelineProblem, options: SolveOptions) -> Result:
    """MadPipe phase 1 (DP, Algorithm 8) then phase 2 (the exact model on the coarse chain)."""
    start = time.perf_counter()
    result = solve_madpipe(problem, options)
    return result.with_(solve_time_s=time.perf_counter() - start)


@register(PROBLEM, "chunks", exact=False, full_model=True, requires=("ortools",),
          in_compare=False, compare_limited=100,
          description="best plan with at most k chunks of layers per GPU (V-shaped, "
                      "interleaved): each allocation decided by the exact model",
          extra=CHUNKS_EXTRA)
def solve_pipeline_chunks(problem: PipelineProblem, options: SolveOptions) -> Result:
    """The chunk scan (:mod:`optmem.solvers.pipeline_chunks`) from the best incumbent."""
    relaxed = stash_relaxed(solve_pipeline_chunks, options)
    return merged_class(problem, _solve_chunks(problem, options), relaxed)


TINY_DURATION = 1e-6
"""Forward and backward times above 0 and below this share of the load bound are *tiny*
(:func:`tiny_durations`): at least 10 steps of the CP-SAT grid
(:data:`~optmem.models.pipeline.TIME_RESOLUTION`) and far above HiGHS' tolerances otherwise.
The smallest on the bundled profiles is 5.6e-6 (ResNet-1001, 4 GPUs)."""


def tiny_durations(problem: PipelineProblem) -> int:
    """How many forward and backward times of a ``strict`` problem are tiny (under 1e-6).

    Such a task is neither zero-length for the models' tie rows nor long enough for the
    engines: CP-SAT rounds a forward of 1e-9 to no step of its grid and answered
    ``optimal`` 14.29 where ``ilp`` replays 5.5 (strict), HiGHS treats a backward of 1e-9
    as none (a hunt, stop 76). :func:`merged_class` then trusts no proof.
    """
    if problem.memory_model != "strict":
        return 0  # the hunts found no such answer under stash (0.1 beside 1e9 proves there)
    lay = problem.layers
    cut = TINY_DURATION * lower_bound(problem)
    return sum(1 for q in range(1, lay.n + 1) for d in (lay.fwd(q, q), lay.bwd(q, q))
               if 0 < d < cut)


def tie_separated(problem: PipelineProblem, res: Result) -> Result:
    """``res`` with a bound that does not depend on the models' tie separation (``strict``).

    Under ``strict`` the models count a start less than
    :func:`~optmem.models.pipeline.separation` after a zero-length task as tied with it
    (``_Builder.tie_vars``: a MILP has no strict inequality). A plan that needs such a
    start closer than that but not at the same instant is outside the models, so their
    optimum (and bound) can lie up to the separation above the problem's infimum (a seeded
    chain: 4.000305 where plans reach 4 + any epsilon). On a chain whose units have a
    zero-length task (:func:`~optmem.solvers.pipeline_exact.tie_separated_units`) the
    models' bound is therefore lowered by the separation (stop 78,
    never below the load bound), and raised to the tie-relaxed model's bound
    (:func:`~optmem.solvers.pipeline_exact.tie_relaxed_bound`, computed first by
    :func:`~optmem.solvers.pipeline_exact.first_bound`: ``report["tie_relaxation"]``),
    which does not depend on the separation (stop 79). ``optimal`` where that bound meets
    the plan, else ``feasible`` with it and ``report["tie_separation"]``; a ``feasible``
    answer's bound gets the same treatment (it came from the models too).
    """
    if not res.status.has_plan or not tie_separated_units(problem):
        return res
    sep = separation(res.objective)
    load = lower_bound(problem)
    low = load if math.isnan(res.bound) else max(load, res.bound - sep)
    tie = res.report.get("tie_relaxation", {}).get("bound", load)
    low = min(max(low, tie), res.objective)
    if proven(res.objective, low):
        return res.with_(status=Status.OPTIMAL, bound=low)
    return res.with_(status=Status.FEASIBLE, bound=low, report={
        **res.report, "tie_separation": f"starts closer than {sep:.6g} after a zero-length "
        "task count as tied in the models (strict): their optimum can lie that far above "
        "the problem's; the bound is the tie-relaxed model's (or theirs less that)"})


def stash_relaxation(problem: PipelineProblem) -> PipelineProblem:
    r"""A ``stash`` problem whose optimum bounds the ``strict`` ``problem``'s (stop 79).

    The same GPUs, memory, transfers and times; stashes lowered where needed so that the
    ``stash`` model's check of every plan never exceeds the ``strict`` model's. Its exact
    methods keep layers without forward time as their own units (the ``stash`` model counts
    ties of zero-length tasks as the simulator does), so its bound covers the plans that
    :func:`~optmem.models.pipeline.zero_forward_merged` leaves out of the ``strict`` models.

    **Validity.** Both models replay a plan at the same times (durations and transfers do
    not depend on the memory model; ``a`` is kept, so are buffers and transfer times) and
    hold the same weights and buffers. The ``stash`` simulator checks a GPU only where a
    stage's forward starts, counting the stashes alive there (the same set the ``strict``
    check counts: forwards started then or before, backwards not ended by then) plus the
    stage's own new stash ``x(i..j)``; the ``strict`` check there counts the same alive
    stashes (without the new one), ``strict_task(i, j)[0] >= x(i..j-1) + a_{j-1} + a_j +
    tf_j`` and data waiting. Here each layer's stash is ``x'_j = min(x_j, a_{j-1} + a_j +
    tf_j)`` (``tf`` the temporaries when counted, else 0), lowered through ``saved_size``
    (and, for the last layer, ``output_size``, which then only enters ``x_L``), so
    ``x'(i..j) <= x(i..j-1) + a_{j-1} + a_j + tf_j`` for every stage: every plan that fits
    the ``strict`` problem fits this one at its period, and this one's optimum (or proven
    bound, or ``infeasible``) is one of the ``strict`` problem too.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> chain = Chain.from_lists([1.0, 0.0, 2.0], [1.0, 0.0, 1.0], [2, 2, 3], [9, 2, 8],
    ...                          input_size=1)
    >>> strict = PipelineProblem(chain, 2, 100, memory_model="strict")
    >>> relaxed = stash_relaxation(strict)
    >>> relaxed.memory_model, strict.layers.x, relaxed.layers.x
    ('stash', (0, 8, 2, 10), (0, 3, 2, 2))
    """
    chain, lay = problem.chain, problem.layers
    n = lay.n
    tf = lay.tf or (0,) * (n + 1)
    saved, out = list(chain.saved_size), list(chain.output_size)
    for j in range(1, n + 1):
        saved[j - 1] -= max(0, lay.x[j] - (lay.a[j - 1] + lay.a[j] + tf[j]))
    out[n - 1] = min(out[n - 1], saved[n - 1])
    lowered = replace(chain, saved_size=tuple(saved), output_size=tuple(out))
    return replace(problem, chain=lowered, memory_model="stash", temporaries=False)


def stash_relaxed(method: Callable[[PipelineProblem, SolveOptions], Result],
                  options: SolveOptions) -> Callable[[PipelineProblem], Result | None] | None:
    """The run of :func:`stash_relaxation` that :func:`merged_class` may ask (stop 79).

    ``None`` unless ``extra["stash_relaxation"]`` is true (default false: the relaxation
    is a second exact solve, which on the bundled ResNets under ``strict`` lifted no bound
    but one and ran past 10 minutes without a limit; on tiny chains it proves answers
    ``optimal`` or ``infeasible``). The run is ``method`` on the relaxed problem with
    ``options``, within what is left of ``options.time_limit_s`` since this call (``None``,
    and ``report["stash_relaxation"]`` says so, when nothing is left), and charges the
    solve's work budget (one solve, one budget): a limit still bounds the whole solve.
    """
    if not flag(options, "stash_relaxation", False):
        return None
    start = time.perf_counter()

    def run(relaxed: PipelineProblem) -> Result | None:
        limit = options.time_limit_s
        if limit is None:
            return method(relaxed, options)
        left = limit - (time.perf_counter() - start)
        return None if left <= 0 else method(relaxed, options.with_(time_limit_s=left))
    return run


def merged_class(problem: PipelineProblem, res: Result,
                 relaxed: Callable[[PipelineProblem], Result | None] | None = None) -> Result:
    """``res`` of a method whose models keep zero-forward layers with their predecessor.

    Under ``strict`` the models' units (:func:`~optmem.models.pipeline.model_bounds`, then
    :func:`~optmem.models.pipeline.zero_forward_merged`) put a layer without forward time
    on its predecessor's GPU: their proofs (``optimal``, a bound, ``infeasible``) cover that
    class only. Until stop 75 they were reported as the problem's: ``ilp``, ``cpsat`` and
    ``chunks`` answered ``optimal`` 10 where MadPipe replays 8 by putting such a layer on
    another GPU (a hunt). On such a chain the answer is ``feasible`` with the problem's
    load bound (``no_solution`` for an ``infeasible`` of the class, unless the least memory
    of any plan proved it: ``memory_lower_bound``), and ``report["merged_units"]`` says
    why. Since stop 79 (zero forwards) ``relaxed`` (the same method, when
    ``extra["stash_relaxation"]`` asks for it: :func:`stash_relaxed`) solves
    :func:`stash_relaxation`, whose models keep every layer: its bound (or ``infeasible``)
    is the problem's, so the answer is ``optimal`` where it meets the plan
    (``report["stash_relaxation"]``). Under ``stash`` the units are the layers (the model
    counts ties of zero-length tasks as the simulator does), except last layers without
    any time, joined to the last one with time (a stash that may live no time: the same
    correction). A chain with tiny forward or backward times (:func:`tiny_durations`) gets
    the same answer, with ``report["tiny_durations"]``. Other chains are unchanged.
    Since stop 80 the ``strict`` models keep every layer too (joins for zero-length
    forwards, :data:`~optmem.models.pipeline.STRICT_LAYERS`), so no ``strict`` chain is
    merged and the stash relaxation runs only where ``STRICT_LAYERS`` is switched off.
    """
    units = model_bounds(problem)
    tiny = tiny_durations(problem)
    if (len(units) == problem.layers.n and not tiny) or res.status is Status.ERROR:
        return tie_separated(problem, res)
    if len(units) < problem.layers.n:
        report = {**res.report, "merged_units": f"{problem.layers.n - len(units)} layers "
                  "without forward time (strict) or at the end without any time (stash) "
                  "kept with their predecessor: the models' proofs cover that class only, "
                  "the bound is the problem's load bound (strict: or the stash "
                  "relaxation's, stash_relaxation)"}
    else:
        report = {**res.report, "tiny_durations": f"{tiny} forward or backward times "
                  f"above 0 and below {TINY_DURATION:g} of the load bound (below the "
                  "engines' tolerances and the CP-SAT grid): the models' proofs are not "
                  "trusted, the bound is the problem's load bound"}
    low = lower_bound(problem)
    if relaxed is not None and problem.memory_model == "strict" and not tiny:
        rel = relaxed(stash_relaxation(problem))
        report["stash_relaxation"] = "skipped: the time limit passed" if rel is None else {
            "status": rel.status.value, "bound": rel.bound if math.isfinite(rel.bound) else None}
    else:
        rel = None
    if rel is not None:
        if rel.status is Status.INFEASIBLE and not res.status.has_plan:
            return res.with_(status=Status.INFEASIBLE, bound=math.inf, plan=None,
                             report=report)
        if rel.status is not Status.INFEASIBLE and math.isfinite(rel.bound):
            low = max(low, rel.bound)
    if res.status is Status.INFEASIBLE:
        if problem.memory_per_gpu < problem.memory_lower_bound():
            return res  # no plan of any allocation fits (below_least_memory)
        return res.with_(status=Status.NO_SOLUTION, bound=math.nan, report=report)
    if not res.status.has_plan:
        return res.with_(bound=math.nan, report=report)
    low = min(low, res.objective)
    if proven(res.objective, low):
        return res.with_(status=Status.OPTIMAL, bound=low, report=report)
    return res.with_(status=Status.FEASIBLE, bound=low, report=report)


def _solve_chunks(problem: PipelineProblem, options: SolveOptions) -> Result:
    """:func:`solve_pipeline_chunks` on the models' units."""
    start = time.perf_counter()
    conf = chunked.settings(options)
    if (below := below_least_memory(problem, "chunks")) is not None:
        return below.with_(solve_time_s=time.perf_counter() - start)
    units = make_units(problem)
    starts = incumbents(problem, options) if options.warm_start else []
    period, plan = (starts[0][0], starts[0][1]) if starts else (math.inf, None)
    limit = options.time_limit_s
    deadline = None if limit is None else start + limit
    searching = None if limit is None else start + (1 - WALK_SHARE) * limit
    relaxed, report = first_bound(problem, period, options, plan)
    found = chunked.scan(problem, units, period, plan, chunks=conf.chunks, work=conf.work,
                         step=conf.step, seed=options.seed, deadline=searching,
                         workers=options.threads, retry=conf.retry, waits=conf.waits,
                         tail=conf.tail, share=conf.share)
    report.update(found.report())
    improved = bool(found.improvements)
    bound, closed = relaxed, False
    decided = dict(found.decided)
    refuted: chunked.Heads | None = None
    if conf.family == "all":
        heads = chunked.head_depths(units.n, conf.head_step) if conf.head_step else []
        whole, cut = chunked.complete(problem, units, found, limit=conf.limit,
                                      work=conf.work, step=conf.step, seed=options.seed,
                                      deadline=searching, workers=options.threads,
                                      retry=conf.retry, waits=conf.waits, tail=conf.tail,
                                      share=conf.share, heads=heads,
                                      head_rounds=conf.head_rounds,
                                      head_contents=conf.head_contents,
                                      head_processes=conf.head_processes, gap=conf.gap)
        report.update(whole.report("complete"))
        report.update(cut.report("complete"))
        report["complete_proof_gap"] = conf.gap
        refuted = cut
        improved = improved or bool(whole.improvements)
        for gpu, proven_at in whole.decided.items():
            decided[gpu] = max(proven_at, decided.get(gpu, 0.0))
        closed = not math.isnan(whole.bound)  # every allocation decided: the problem's bound
        if closed:
            bound = max(bound, whole.bound)
        found = whole
    if closed and proven(found.period, bound):
        every = bound  # the complete family's bound proves the plan: no walk can add to it
    else:
        every = _allocations_bound(problem, units, found.period, bound, decided, conf.waits,
                                   refuted, deadline)
    bound = max(bound, every)
    report.update({"incumbents": {s: p for p, _, s in starts},
                   "source": "chunks" if improved else starts[0][2] if starts else None,
                   "allocations_bound": every})
    if found.plan is None:
        reason = "no allocation has a plan" if closed else "no plan with at most " \
            f"{conf.chunks} chunks per GPU was found"
        return infeasible(problem, "chunks", reason, proven=closed, report=report).with_(
            solve_time_s=time.perf_counter() - start)
    status = Status.OPTIMAL if proven(found.period, bound) else Status.FEASIBLE
    return plan_result(problem, found.plan, method="chunks", status=status, bound=bound,
                       claimed=found.period, report=report).with_(
        solve_time_s=time.perf_counter() - start)


def _allocations_bound(problem: PipelineProblem, units: Units, period: float, low: float,
                       decided: dict[tuple[int, ...], float], waits: bool,
                       heads: chunked.Heads | None, deadline: float | None) -> float:
    """:func:`~optmem.solvers.pipeline_chunks.allocations_bound` below the plan's ``period``.

    The least bound over every allocation (its floor, or what the scan proved for it or
    for a head it extends); ``low`` (the problem's own bound) without a plan, as no cap is
    then known. The walk stops at the solve's ``deadline`` (:data:`WALK_SHARE`).
    """
    if not math.isfinite(period):
        return low
    return chunked.allocations_bound(units, problem.n_gpus, chunked.floor_memory(problem), low,
                                     period, decided, waits=waits, heads=heads,
                                     deadline=deadline)


@register_exporter(PROBLEM, "ilp")
def export_pipeline_ilp(problem: PipelineProblem, options: SolveOptions, path: str) -> None:
    """Write the exact model (no cutoff) as ``.mps`` or ``.lp`` (by suffix)."""
    from pathlib import Path

    from optmem.errors import OptmemInputError
    from optmem.models.formulation import to_pulp
    from optmem.models.pipeline import build_pipeline_model, make_units

    del options
    suffix = Path(path).suffix.lower()
    if suffix not in (".mps", ".lp"):
        raise OptmemInputError(f"cannot tell the model format from {Path(path).name!r} "
                               "(expected a .mps or .lp file)", field="output")
    form = build_pipeline_model(make_units(problem), problem.n_gpus, problem.memory_per_gpu,
                                strict=problem.memory_model == "strict",
                                lower_bound=lower_bound(problem))
    model = to_pulp(form.model).problem
    try:
        if suffix == ".mps":
            model.writeMPS(path)
        else:
            model.writeLP(path)
    except OSError as exc:
        raise OptmemInputError(f"cannot write {path} ({exc.strerror})", field="output") from None
