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
                        GPU, then the ILP schedules the coarse chain (with fallbacks)
``ilp``         yes     the full ILP of chapter 6 with the digest's corrections (PuLP)
``cpsat``       yes     the same problem as a CP-SAT model with interval variables
==============  ======  ==================================================================

Every plan is replayed by :func:`optmem.simulate.pipeline.simulate_pipeline` before it is
returned: the objective is the simulated period and every GPU's peak is within the limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from optmem.errors import PlanError
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.facade import register, register_exporter

PROBLEM = "pipeline"
ENGINES = ("pulp",)


def lower_bound(problem: PipelineProblem) -> float:
    """Total work over the GPUs, and the heaviest layer: no period can be smaller."""
    lay = problem.layers
    return max(lay.load(1, lay.n) / problem.n_gpus,
               max(lay.load(q, q) for q in range(1, lay.n + 1)))


def plan_result(
    problem: PipelineProblem, plan: PipelinePlan, *, method: str, status: Status,
    bound: float, claimed: float | None = None, variant: str | None = None,
    solver: str | None = None, report: dict[str, Any] | None = None,
) -> Result:
    """Replay ``plan`` and build the result from the simulation (``error`` if it is invalid)."""
    info = dict(report or {})
    try:
        sim = simulate_pipeline(problem, plan)
    except PlanError as exc:
        info["error"] = f"invalid plan: {exc}"
        return Result(PROBLEM, method, Status.ERROR, memory_limit=problem.memory_per_gpu,
                      variant=variant, solver=solver, report=info)
    info.update({"peaks": list(sim.peaks), "nca": list(sim.nca),
                 "allocation": plan.describe(), "stages": len(plan.stages)})
    out = Result(PROBLEM, method, status, objective=sim.period, bound=bound,
                 plan=plan.to_strings(), peak_memory=sim.peak_memory,
                 memory_limit=problem.memory_per_gpu, variant=variant, solver=solver,
                 report=info)
    if claimed is not None and not math.isclose(claimed, sim.period, rel_tol=1e-6,
                                                abs_tol=1e-9):
        info["error"] = f"claimed period {claimed} but the plan's period is {sim.period}"
        return out.with_(status=Status.ERROR)
    if sim.peak_memory > problem.memory_per_gpu:
        info["error"] = (f"plan peaks at {sim.peak_memory}, above the memory per GPU "
                         f"{problem.memory_per_gpu}")
        return out.with_(status=Status.ERROR)
    if status is Status.OPTIMAL:
        out = out.with_(bound=sim.period)
    return out


def infeasible(problem: PipelineProblem, method: str, reason: str, *,
               proven: bool = True, report: dict[str, Any] | None = None) -> Result:
    """``infeasible`` (proven for the method's class) or ``no_solution``."""
    info = dict(report or {})
    info["hint"] = reason
    return Result(PROBLEM, method, Status.INFEASIBLE if proven else Status.NO_SOLUTION,
                  bound=math.inf if proven else math.nan,
                  memory_limit=problem.memory_per_gpu, report=info)


def _schedule_allocation(problem: PipelineProblem, bounds: contig.Bounds
                         ) -> tuple[float, PipelinePlan] | None:
    return contig.best_period_for_allocation(problem, bounds)


def min_memory_contiguous(problem: PipelineProblem) -> int:
    """Smallest memory per GPU at which some contiguous allocation has a schedule.

    Feasibility is monotone in the memory per GPU, so a doubling search followed by a
    bisection over integers finds the exact threshold of :func:`contig.best_contiguous`.
    """
    def fits(memory: int) -> bool:
        return contig.best_contiguous(replace(problem, memory_per_gpu=memory)) is not None

    low, high = problem.memory_per_gpu, max(1, 2 * problem.memory_per_gpu)
    while not fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


# ------------------------------------------------------------------ contiguous
@register(PROBLEM, "contiguous", exact=True, default=True,
          description="best contiguous allocation + optimal 1F1B* (thesis ch. 5, exact scan)")
def solve_pipeline_contiguous(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Optimal among contiguous allocations and 1-periodic patterns (stash memory model)."""
    del options
    if problem.memory_model != "stash":
        return _best_contiguous_strict(problem)
    found = contig.best_contiguous(problem)
    if found is None:
        least = min_memory_contiguous(problem)
        result = infeasible(problem, "contiguous",
                            "no contiguous allocation fits, even with one activation per stage; "
                            f"the smallest feasible memory per GPU is {least}")
        return result.with_(min_feasible_memory=least)
    period, bounds, proven = found
    sched = _schedule_allocation(problem, bounds)
    assert sched is not None
    status = Status.OPTIMAL if proven else Status.FEASIBLE
    return plan_result(problem, sched[1], method="contiguous", status=status,
                       bound=period if proven else lower_bound(problem), claimed=period,
                       report={"model": "1F1B*", "proven": proven})


def _best_contiguous_strict(problem: PipelineProblem) -> Result:
    """Strict memory model: enumerate contiguous splits (small chains) and scan periods."""
    from itertools import combinations

    n = problem.layers.n
    best: tuple[float, PipelinePlan] | None = None
    count = 0
    for k in range(1, min(problem.n_gpus, n) + 1):
        for cuts in combinations(range(1, n), k - 1):
            count += 1
            if count > 20000:
                break
            edges = [0, *cuts, n]
            bounds = [(edges[t] + 1, edges[t + 1]) for t in range(k)]
            found = _schedule_allocation(problem, bounds)
            if found and (best is None or found[0] < best[0]):
                best = found
    if best is None:
        return infeasible(problem, "contiguous", "no contiguous allocation fits with 1F1B*")
    return plan_result(problem, best[1], method="contiguous", status=Status.FEASIBLE,
                       bound=lower_bound(problem), claimed=best[0],
                       report={"model": "1F1B* (strict memory: not proven optimal)",
                               "splits": count})


# ------------------------------------------------------------------ baselines
@register(PROBLEM, "equal", exact=False,
          description="equal layer counts per GPU + 1F1B* (torch.distributed.pipelining)")
def solve_pipeline_equal(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Split the layers in ``P`` equal runs and schedule them with the optimal 1F1B*."""
    del options
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
def _exact(problem: PipelineProblem, options: SolveOptions, method: str) -> Result:
    from optmem.solvers.pipeline_exact import solve_exact

    return solve_exact(problem, options, method)


@register(PROBLEM, "ilp", exact=True, requires=("pulp",), max_length=8,
          description="full ILP of thesis ch. 6 (corrected), general allocations (PuLP)")
def solve_pipeline_ilp(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Optimal 1-periodic pattern over all allocations (thesis ch. 6, corrected)."""
    return _exact(problem, options, "ilp")


@register(PROBLEM, "cpsat", exact=True, requires=("ortools",), max_length=8,
          description="CP-SAT model with interval variables, general allocations")
def solve_pipeline_cpsat(problem: PipelineProblem, options: SolveOptions) -> Result:
    """Optimal 1-periodic pattern over all allocations, CP-SAT with interval variables."""
    return _exact(problem, options, "cpsat")


@register(PROBLEM, "madpipe", exact=False, requires=("pulp",),
          description="MadPipe: non-contiguous DP (one special GPU) + ILP schedule (ch. 7)",
          extra=("phase2", "madpipe_grid", "madpipe_iterations"))
def solve_pipeline_madpipe(problem: PipelineProblem, options: SolveOptions) -> Result:
    """MadPipe phase 1 (DP, Algorithm 8) then phase 2 (ILP on the coarse chain)."""
    from optmem.solvers.pipeline_madpipe import solve_madpipe

    start = time.perf_counter()
    result = solve_madpipe(problem, options)
    return result.with_(solve_time_s=time.perf_counter() - start)


@register_exporter(PROBLEM, "ilp")
def export_pipeline_ilp(problem: PipelineProblem, options: SolveOptions, path: str) -> None:
    """Write the full chapter 6 ILP (no cutoff) as ``.mps`` or ``.lp`` (by suffix)."""
    from pathlib import Path

    from optmem.errors import OptmemInputError
    from optmem.models.pipeline_common import make_units
    from optmem.models.pipeline_ilp import build_pipeline_ilp

    del options
    suffix = Path(path).suffix.lower()
    if suffix not in (".mps", ".lp"):
        raise OptmemInputError(f"cannot tell the model format from {Path(path).name!r} "
                               "(expected a .mps or .lp file)", field="output")
    built = build_pipeline_ilp(make_units(problem), problem.n_gpus, problem.memory_per_gpu,
                               strict=problem.memory_model == "strict",
                               lower_bound=lower_bound(problem))
    try:
        if suffix == ".mps":
            built.model.writeMPS(path)
        else:
            built.model.writeLP(path)
    except OSError as exc:
        raise OptmemInputError(f"cannot write {path} ({exc.strerror})", field="output") from None
