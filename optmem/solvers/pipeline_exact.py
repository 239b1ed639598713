"""Methods ``ilp`` and ``cpsat``: the exact pipeline model, one formulation, two engines.

Both solve :mod:`optmem.models.pipeline` (all allocations and 1-periodic patterns, thesis
ch. 6 corrected; its emitters write it for PuLP and CP-SAT). Before the engine runs, the
best contiguous 1F1B* plan (stash memory model, thesis ch. 5) and the MadPipe plan
(:mod:`optmem.solvers.pipeline_madpipe`) are computed and replayed; the better one is the
engine's warm start and its period the cutoff on the model's period. The answer is the
best replayed plan among the engine's and these, with the proven bound of
:mod:`optmem.solvers.pipeline_common` (the load bound at least): ``optimal`` when they meet
(:data:`~optmem.solvers.pipeline_common.OPTIMALITY_TOLERANCE`). A time limit returns that
plan with its bound (``feasible``).

Options: ``time_limit_s`` (``None``: no limit), ``threads``, ``solver`` (``ilp``'s engine),
``warm_start`` (``False``: no incumbents, no cutoff), ``verbose``;
``extra["warm_madpipe"]`` (default ``True``: also run MadPipe for the incumbent; its phase 2
gets a tenth of the time limit, or its own default when there is none).
"""

from __future__ import annotations

import math
import time
from typing import Any

from optmem.models.formulation import rational_time_scale, to_cpsat
from optmem.models.pipeline import TIME_RESOLUTION, build_relaxation, make_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers import engines
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.pipeline_common import (
    OPTIMALITY_TOLERANCE,
    fits,
    infeasible,
    lower_bound,
    plan_result,
    proven,
    run_model,
)
from optmem.solvers.pipeline_madpipe import PHASE2_TIME_LIMIT_S, solve_madpipe

Candidate = tuple[float, PipelinePlan, str]


def incumbents(problem: PipelineProblem, options: SolveOptions) -> list[Candidate]:
    """Replayed plans of the contiguous 1F1B* optimum and of MadPipe (best first)."""
    found: list[Candidate] = []
    if problem.memory_model == "stash":
        best = contig.best_contiguous(problem)
        sched = contig.best_period_for_allocation(problem, best[1]) if best else None
        if sched is not None and fits(problem, sched[1]):
            found.append((sched[0], sched[1], "contiguous 1F1B*"))
    if options.extra.get("warm_madpipe", True):
        limit = options.time_limit_s / 10 if options.time_limit_s is not None \
            else options.extra.get("phase2_time_limit_s", PHASE2_TIME_LIMIT_S)
        sub = options.with_(extra={**options.extra, "phase2_time_limit_s": limit})
        res = solve_madpipe(problem, sub)
        if res.status.has_plan:
            plan = PipelinePlan.from_strings(res.plan)
            found.append((res.objective, plan, "madpipe"))
    return sorted(found, key=lambda c: c[0])


RELAXATION_SHARE = 0.3
"""Share of a time limit given to the relaxation's bisection (all of it without a limit)."""
RELAXATION_PRECISION = 1e-3
"""The bisection stops when the bound is within this (relative) of the incumbent's period."""


def relaxation_bound(problem: PipelineProblem, upper: float, options: SolveOptions,
                     time_limit_s: float | None) -> tuple[float, dict[str, Any]]:
    """Largest period proven impossible by :func:`~optmem.models.pipeline.build_relaxation`.

    Bisection over integer periods (grid ``1 / scale``) below ``upper`` (a valid plan's
    period), each probe a CP-SAT feasibility run; the first probe is just below ``upper``
    (proving it optimal at once when it is). Stops at :data:`RELAXATION_PRECISION`, at the
    time limit, or at a probe the engine cannot decide.
    """
    units = make_units(problem)
    low = lower_bound(problem)
    scale, _ = rational_time_scale([*units.f, *units.b, *units.dt],
                                   resolution=TIME_RESOLUTION * low)
    lo, hi = math.floor(low * scale) - 1, math.floor(upper * scale)
    probe = math.floor(upper * scale * (1 - OPTIMALITY_TOLERANCE / 2))
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    probes, proven_at = 0, lo
    while hi - lo > max(1, RELAXATION_PRECISION * hi) and lo < probe < hi:
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            break
        form = build_relaxation(units, problem.n_gpus, problem.memory_per_gpu, probe, scale,
                                strict=problem.memory_model == "strict")
        cm = to_cpsat(form.model, 1)
        res = engines.solve_cpsat(cm.cp, cm.variables, time_limit_s=left,
                                  threads=options.threads, verbose=options.verbose)
        probes += 1
        if res.status is Status.INFEASIBLE:
            lo = proven_at = probe
        elif res.status.has_plan:
            hi = probe
        else:
            break
        probe = (lo + hi) // 2
    bound = proven_at / scale if proven_at > math.floor(low * scale) - 1 else low
    return bound, {"relaxation_bound": bound, "relaxation_probes": probes}


def solve_exact(problem: PipelineProblem, options: SolveOptions, method: str) -> Result:
    """Optimal allocation and 1-periodic pattern (``method``: ``ilp`` or ``cpsat``)."""
    if method == "ilp":
        engines.check_engine(options.solver)
    solver = options.solver if method == "ilp" else "cpsat"
    start = time.perf_counter()
    starts = incumbents(problem, options) if options.warm_start else []
    best = starts[0] if starts else None
    limit = options.time_limit_s
    relaxed: float = lower_bound(problem)
    report: dict[str, Any] = {}
    if best is not None and options.extra.get("relaxation", True):
        share = None if limit is None else RELAXATION_SHARE * limit
        relaxed, report = relaxation_bound(problem, best[0], options, share)
    if best is not None and proven(best[0], relaxed):
        report.update(incumbents={s: p for p, _, s in starts}, source=best[2])
        return plan_result(problem, best[1], method=method, status=Status.OPTIMAL,
                           bound=min(relaxed, best[0]), claimed=best[0], solver=solver,
                           report=report)
    left = None if limit is None else max(0.0, limit - (time.perf_counter() - start))
    run = run_model(problem, method, options, upper_bound=best[0] if best else None,
                    warm=best[1] if best else None, time_limit_s=left, lower=relaxed)
    report = {**report, **run.report, "incumbents": {s: p for p, _, s in starts}}
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
    return plan_result(problem, plan, method=method, status=status, bound=min(bound, period),
                       claimed=period, solver=solver, report=report)
