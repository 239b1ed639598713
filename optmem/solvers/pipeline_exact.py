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
from typing import Any

from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers import engines
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.pipeline_common import (
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


def solve_exact(problem: PipelineProblem, options: SolveOptions, method: str) -> Result:
    """Optimal allocation and 1-periodic pattern (``method``: ``ilp`` or ``cpsat``)."""
    if method == "ilp":
        engines.check_engine(options.solver)
    solver = options.solver if method == "ilp" else "cpsat"
    starts = incumbents(problem, options) if options.warm_start else []
    best = starts[0] if starts else None
    run = run_model(problem, method, options, upper_bound=best[0] if best else None,
                    warm=best[1] if best else None, time_limit_s=options.time_limit_s)
    report: dict[str, Any] = {**run.report, "incumbents": {s: p for p, _, s in starts}}
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
    bound = max(bound, lower_bound(problem)) if not math.isnan(bound) else lower_bound(problem)
    if not candidates:
        return infeasible(problem, method, f"engine stopped without a solution "
                          f"({run.report.get('engine_status', '')})", proven=False,
                          report=report).with_(solver=solver)
    period, plan, source = min(candidates, key=lambda c: c[0])
    report["source"] = source
    status = Status.OPTIMAL if proven(period, bound) else Status.FEASIBLE
    return plan_result(problem, plan, method=method, status=status, bound=min(bound, period),
                       claimed=period, solver=solver, report=report)
