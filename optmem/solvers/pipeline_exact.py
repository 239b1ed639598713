"""Drivers of the exact pipeline models (ILP of ch. 6 and CP-SAT) behind the facade.

Both models are built on *units* (:mod:`optmem.models.pipeline_common`): the ``L`` layers
for the full problem (methods ``ilp``/``cpsat``), or the stages of a MadPipe allocation for
its phase 2. With the ``stash`` memory model the best contiguous 1F1B* period is a valid
upper bound (contiguous 1F1B* patterns are solutions of the model), so it is given to the
engine as a cutoff, and returned as a ``feasible`` fallback when the engine finds nothing
better within its limits, or fails (:mod:`optmem.solvers.engine_results`). There is no hidden
limit: ``SolveOptions.time_limit_s``, ``node_limit`` (ILP) and ``deterministic_time``
(CP-SAT) are passed as given (``None``: none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from optmem.models.pipeline_common import Units, make_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers.engine_results import engine_failure
from optmem.solvers.engines import cpsat_settings, pulp_settings


def run_model(
    problem: PipelineProblem, units: Units, method: str, options: SolveOptions, *,
    gpu: Sequence[int] | None = None, upper_bound: float | None = None,
) -> tuple[Any, PipelinePlan | None, dict[str, int]]:
    """Build, solve and decode one model; returns ``(engine_result, plan, model_size)``."""
    from optmem.solvers.pipeline import lower_bound

    lb = max(max(f + b for f, b in zip(units.f, units.b, strict=True)), 0.0)
    if gpu is None:
        lb = max(lb, lower_bound(problem))
    strict = problem.memory_model == "strict"
    if method == "ilp":
        from optmem.models import pipeline_ilp as mod

        built = mod.build_pipeline_ilp(units, problem.n_gpus, problem.memory_per_gpu,
                                       strict=strict, gpu=gpu, upper_bound=upper_bound,
                                       lower_bound=lb)
        res = mod.solve_pipeline_ilp(built, engine=options.solver, **pulp_settings(options))
        plan = mod.decode_pipeline_ilp(built, res.values) if res.status.has_plan else None
    else:
        from optmem.models import pipeline_cpsat as cps

        cp = cps.build_pipeline_cpsat(units, problem.n_gpus, problem.memory_per_gpu,
                                      strict=strict, gpu=gpu, upper_bound=upper_bound,
                                      lower_bound=lb)
        res = cps.solve_pipeline_cpsat(cp, **cpsat_settings(options))
        plan = cps.decode_pipeline_cpsat(cp, res.values) if res.status.has_plan else None
        return res, plan, dict(cp.size)
    return res, plan, dict(built.size)


def solve_exact(problem: PipelineProblem, options: SolveOptions, method: str) -> Result:
    """Method ``ilp`` or ``cpsat``: all allocations and 1-periodic patterns of the model."""
    from optmem.solvers import pipeline_contiguous as contig
    from optmem.solvers.pipeline import infeasible, plan_result

    incumbent: tuple[float, PipelinePlan] | None = None
    if problem.memory_model == "stash" and options.warm_start:
        found = contig.best_contiguous(problem)
        if found is not None:
            sched = contig.best_period_for_allocation(problem, found[1])
            if sched is not None:
                incumbent = sched
    units = make_units(problem)
    res, plan, size = run_model(problem, units, method, options,
                                upper_bound=incumbent[0] if incumbent else None)
    solver = options.solver if method == "ilp" else "cpsat"
    report: dict[str, Any] = {"model_size": size}
    if res.failed:
        fallback = None
        if incumbent is not None:
            period, best = incumbent

            def fallback(info: dict[str, Any]) -> Result:
                return plan_result(problem, best, method=method, status=Status.FEASIBLE,
                                   bound=math.nan, claimed=period, solver=solver,
                                   report={**info, "incumbent": "contiguous 1F1B* plan"})

        return engine_failure("pipeline", method, res, report=report, fallback=fallback,
                              memory_limit=problem.memory_per_gpu)
    report.update(res.report())
    bound = res.bound if math.isfinite(res.bound) else math.nan
    if method == "cpsat" and plan is not None and getattr(res, "info", {}).get("scaled"):
        report["time_scale"] = res.info["scale"]
    rounded = bool(getattr(res, "info", {}).get("rounded", False))
    if res.status is Status.INFEASIBLE and rounded:
        # durations were rounded up to integers: infeasibility of the rounded model proves
        # nothing about the true one
        report["note"] = "times rounded up for CP-SAT: infeasibility not proven"
        if incumbent is None:
            return infeasible(problem, method, "the model with times rounded up has no "
                              "solution", proven=False, report=report).with_(solver=solver)
        return plan_result(problem, incumbent[1], method=method, status=Status.FEASIBLE,
                           bound=math.nan, claimed=incumbent[0], solver=solver, report=report)
    if res.status is Status.INFEASIBLE and incumbent is None:
        return infeasible(problem, method, "no allocation and 1-periodic pattern fits "
                          "(proven by the model)", report=report).with_(solver=solver)
    if res.status is Status.INFEASIBLE and incumbent is not None:
        # the cutoff at the incumbent's period made the model infeasible: the incumbent is
        # optimal (up to the cutoff's 1e-9 slack)
        return plan_result(problem, incumbent[1], method=method, status=Status.OPTIMAL,
                           bound=incumbent[0], claimed=incumbent[0], solver=solver,
                           report={**report, "note": "optimum is the contiguous 1F1B* plan"})
    if plan is None:
        if incumbent is not None:
            return plan_result(problem, incumbent[1], method=method, status=Status.FEASIBLE,
                               bound=bound, claimed=incumbent[0], solver=solver,
                               report={**report, "note": "engine found nothing better than "
                                       "the contiguous 1F1B* incumbent"})
        return infeasible(problem, method, f"engine stopped without a solution "
                          f"({res.message})", proven=False, report=report).with_(solver=solver)
    status = Status.FEASIBLE if rounded else res.status
    return plan_result(problem, plan, method=method, status=status, bound=bound,
                       claimed=None, solver=solver, report=report)
