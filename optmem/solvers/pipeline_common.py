"""What every pipeline method shares: bounds, the replayed result, and one exact-model run.

:mod:`optmem.solvers.pipeline` (registration, contiguous and baseline methods),
:mod:`optmem.solvers.pipeline_exact` (``ilp``, ``cpsat``) and
:mod:`optmem.solvers.pipeline_madpipe` (``madpipe``) import this module and nothing of each
other but in that order (registration -> exact -> MadPipe -> here), so there is no import
circle.

Exactness in the original units
--------------------------------
A result is ``optimal`` when its plan, replayed by the simulator, has a period within
:data:`OPTIMALITY_TOLERANCE` (relative) of a lower bound proven in the chain's own time
unit. The bound of an engine is made valid in those units here: HiGHS/CBC/Gurobi report it
in floats (valid up to their feasibility tolerance, about 1e-9 relative here); CP-SAT works
on a time grid of ``1 / scale`` (:meth:`~optmem.models.pipeline.PipelineFormulation.time_scale`:
exact for the durations, at most 1e-7 of the load bound) on which the optimal period may
only be approached from above, so its bound is lowered by one grid step (and, should the
durations not be exact on the grid, by the largest rounding along any cycle of the model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from optmem.engines import adapters as engines
from optmem.errors import PlanError
from optmem.models.formulation import Kind, shape_error, to_cpsat, to_pulp
from optmem.models.pipeline import (
    PipelineFormulation,
    Units,
    build_pipeline_model,
    load_bound,
    make_units,
)
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.simulate.verify import Replay, Wording, replay_result
from optmem.solvers.time_budget import Deadline, left_for_engine

PROBLEM = "pipeline"
FIXED_PARAMETERS: dict[str, Any] = {"linearization_level": 2}
"""CP-SAT parameters when :func:`run_model` minimises the period of a fixed allocation
(``gpu`` given, not ``feasibility``): MadPipe's phase 2, the decomposition's subproblems,
the chunk scan's polish. Level 2 puts the no-overlap and enforced rows into CP-SAT's LP
relaxation, whose bound is what proves an allocation optimal. Measured
(``benchmarks/bench_pipeline_linearization.py``, ``results/pipeline_linearization.md``):
of 1,743 allocations of random 2-5-layer chains, 12 stayed unproven after 5 deterministic
seconds at CP-SAT's default (level 1), 1 (general build) or 3 (slim) at level 2, and a
decomposition without a limit ran for minutes on a 5-layer chain; MadPipe on ResNet-152, 8
GPUs, 6 GiB: 45.29 instead of 47.42 in 7 instead of 91 CPU s. The chunk scan's
feasibility questions keep the default: level 2 made them 2.6x slower on the headline."""
OPTIMALITY_TOLERANCE = 1e-6
"""Relative gap below which a plan counts as proven optimal (the simulator's time tolerance)."""
WORDING = Wording(claim="claimed period {claimed} but the plan's period is {simulated}",
                  peak="plan peaks at {peak}, above the memory per GPU {limit}",
                  invalid="invalid plan: ")


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
    """Replay ``plan`` and build the result from the simulation (``error`` if it is invalid).

    :func:`optmem.simulate.verify.replay_result`; ``bound`` is kept as given (a proven lower
    bound in the chain's units, or ``nan``); an ``optimal`` status without a bound gets the
    simulated period as its bound.
    """

    def replay() -> Replay:
        sim = simulate_pipeline(problem, plan)
        return Replay(sim.period, sim.peak_memory, {
            "peaks": list(sim.peaks), "nca": list(sim.nca), "allocation": plan.describe(),
            "stages": len(plan.stages), **problem.settings_report()})

    out = replay_result(PROBLEM, method, status, plan.to_strings(), replay, bound=bound,
                        claimed=claimed, memory_limit=problem.memory_per_gpu,
                        variant=variant, solver=solver, report=report, wording=WORDING,
                        optimal_bound=False)
    if out.status is Status.OPTIMAL and not math.isfinite(bound):
        out = out.with_(bound=out.objective)
    return out


def infeasible(problem: PipelineProblem, method: str, reason: str, *,
               proven: bool = True, report: dict[str, Any] | None = None) -> Result:
    """``infeasible`` (proven for the method's class) or ``no_solution``."""
    info = dict(report or {})
    info["hint"] = reason
    return Result(PROBLEM, method, Status.INFEASIBLE if proven else Status.NO_SOLUTION,
                  bound=math.inf if proven else math.nan,
                  memory_limit=problem.memory_per_gpu, report=info)


def below_least_memory(problem: PipelineProblem, method: str) -> Result | None:
    """``infeasible`` (proven for every plan) when the memory per GPU is below the least.

    :meth:`PipelineProblem.memory_lower_bound` holds for any allocation, grouping and
    schedule (thesis ch. 5/7 memory model: ``C`` weight copies and one micro-batch's stash or
    task per layer), so a method whose own search only finds plans (``equal``,
    ``pipedream``, ``madpipe``, ``chunks``) can still prove such a limit infeasible, at once.

    Returns
    -------
    Result or None
        The ``infeasible`` result (report keys ``hint`` and ``memory_lower_bound``), or
        ``None`` when the limit is not below the bound.
    """
    least = problem.memory_lower_bound()
    if problem.memory_per_gpu >= least:
        return None
    return infeasible(problem, method, "no plan fits: every plan needs at least "
                      f"{least} per GPU (C x weights / P, and each layer's weights with "
                      "one micro-batch's stash)", report={"memory_lower_bound": least})


def replayed_period(problem: PipelineProblem, plan: PipelinePlan) -> float | None:
    """The simulated period of ``plan`` (``None``: invalid, or above the memory per GPU)."""
    try:
        sim = simulate_pipeline(problem, plan)
    except PlanError:
        return None
    return sim.period if sim.peak_memory <= problem.memory_per_gpu else None


def fits(problem: PipelineProblem, plan: PipelinePlan) -> bool:
    """Whether ``plan`` replays without error within the memory per GPU."""
    return replayed_period(problem, plan) is not None


def proven(objective: float, bound: float) -> bool:
    """Whether ``bound`` proves ``objective`` optimal (:data:`OPTIMALITY_TOLERANCE`)."""
    return math.isfinite(bound) and objective <= bound + OPTIMALITY_TOLERANCE * max(
        abs(objective), 1e-12)


# ------------------------------------------------------------------ one exact-model run
@dataclass
class ModelRun:
    """Outcome of one build-solve-decode of the exact model.

    ``status`` is the engine's; ``plan`` the decoded plan (``None`` without one); ``bound``
    a proven lower bound on the model's optimum in the chain's units (``nan`` unknown,
    ``inf`` when the engine proved the model infeasible); ``step`` the time grid of the
    engine (CP-SAT: ``1 / scale``, a cutoff holds up to it; 0 for the MILP engines);
    ``engine`` the engine's own outcome (``engine.failed``: the engine crashed, ``status``
    is ``error``; hand it to :func:`~optmem.engines.results.engine_failure`).
    """

    status: Status
    plan: PipelinePlan | None
    bound: float
    report: dict[str, Any] = field(default_factory=dict)
    step: float = 0.0
    engine: engines.EngineResult | None = None

    @property
    def failed(self) -> bool:
        """Whether the engine failed (see :attr:`EngineResult.failed`)."""
        return self.engine is not None and self.engine.failed


def run_model(
    problem: PipelineProblem, method: str, options: SolveOptions, *,
    units: Units | None = None, gpu: list[int] | None = None,
    upper_bound: float | None = None, warm: PipelinePlan | None = None, lower: float = 0.0,
    feasibility: bool = False, lifetime_cuts: bool = False,
    together: Sequence[Sequence[int]] = (),
    same_gpu: Mapping[tuple[int, int], bool] | None = None, slim: bool = True,
    parameters: Mapping[str, Any] | None = None,
    stash_floors: Mapping[tuple[int, int], int] | None = None,
    deadline: float | None = None, tie_relaxed: bool = False,
) -> ModelRun:
    """Build the model of ``units`` (default: the layers), solve it with ``method``.

    ``method``: ``"ilp"`` (PuLP, engine ``options.solver``) or ``"cpsat"``. ``warm``: a plan
    given to the engine as a starting solution (when the model can represent it);
    ``upper_bound``: a cutoff on the period (a valid plan's period); ``lower``: a proven
    lower bound on it. The engine gets the limits of ``options`` as they are
    (:func:`~optmem.engines.adapters.pulp_settings`,
    :func:`~optmem.engines.adapters.cpsat_settings`:
    ``time_limit_s``, ``node_limit``, ``deterministic_time``, ``seed``; ``None``: none).
    ``feasibility``: no objective, so the engine stops at the first plan with a period
    between the bounds (the answer is then "some plan at or below ``upper_bound``", proven
    by that plan, or ``bound = inf``: none; ``bound`` means nothing else).
    ``lifetime_cuts``: add the lifetime relaxation's copy rows at ``upper_bound``
    (:func:`~optmem.models.pipeline.build_pipeline_model`; valid inequalities).
    ``together``: groups of units restricted to one GPU each (a restriction of the model:
    :func:`~optmem.models.pipeline.build_pipeline_model`). ``slim``: with ``gpu`` fixed,
    the slim fixed-allocation model (default) or the general one (``False``).
    ``parameters``: CP-SAT parameters for this run (default: :data:`FIXED_PARAMETERS` when
    minimising over a fixed allocation, CP-SAT's own otherwise). ``stash_floors``: with
    ``gpu`` fixed, least stash counts (valid rows,
    :func:`~optmem.models.pipeline.build_pipeline_model`). ``deadline`` (a
    :func:`time.perf_counter` instant): the engine's time limit is what the build and the
    emission left before it (at least :data:`MIN_ENGINE_LIMIT_S`), and no more than
    ``options.time_limit_s`` (since stop 74: the full model's build at L = 68 took 10 s
    outside a 10 s limit). ``tie_relaxed``: the model without the rows ``neara``
    (:func:`~optmem.models.pipeline.build_pipeline_model`; a relaxation, stop 79).
    """
    form = build_model(problem, units=units, gpu=gpu, upper_bound=upper_bound, lower=lower,
                       feasibility=feasibility, lifetime_cuts=lifetime_cuts,
                       together=together, same_gpu=same_gpu, slim=slim,
                       stash_floors=stash_floors, tie_relaxed=tie_relaxed)
    values = form.encode(warm) if warm is not None and options.warm_start else None
    report: dict[str, Any] = {"model_size": form.model.size,
                              "warm_start": "none" if warm is None or not options.warm_start
                              else "plan" if values is not None else "not representable"}
    if method == "ilp":
        run = _run_pulp(form, options, values, deadline)
    else:
        optimising = gpu is not None and not feasibility
        run = _run_cpsat(form, options, values, dict(parameters) if parameters is not None
                         else FIXED_PARAMETERS if optimising else None, deadline)
    run.report = {**report, **run.report}
    return run


def build_model(
    problem: PipelineProblem, *, units: Units | None = None, gpu: list[int] | None = None,
    upper_bound: float | None = None, lower: float = 0.0, feasibility: bool = False,
    lifetime_cuts: bool = False, together: Sequence[Sequence[int]] = (),
    same_gpu: Mapping[tuple[int, int], bool] | None = None, slim: bool = True,
    stash_floors: Mapping[tuple[int, int], int] | None = None, tie_relaxed: bool = False,
) -> PipelineFormulation:
    """The model :func:`run_model` solves (its arguments, as there), built and not solved.

    With ``gpu`` free the period's floor is also the problem's :func:`lower_bound`; with
    ``feasibility`` the objective is 0.
    """
    units = units if units is not None else make_units(problem)
    form = build_pipeline_model(units, problem.n_gpus, problem.memory_per_gpu,
                                strict=problem.memory_model == "strict", gpu=gpu,
                                upper_bound=upper_bound,
                                lower_bound=max(lower, lower_bound(problem))
                                if gpu is None else lower,
                                lifetime_cuts=lifetime_cuts, together=together,
                                same_gpu=same_gpu, slim=slim, stash_floors=stash_floors,
                                tie_relaxed=tie_relaxed)
    if feasibility:
        form.model.minimize(0)
    return form


def refute(
    problem: PipelineProblem, options: SolveOptions, cutoff: float, *,
    units: Units | None = None, gpu: list[int] | None = None, lower: float = 0.0,
    lifetime_cuts: bool = False, together: Sequence[Sequence[int]] = (),
    parameters: Mapping[str, Any] | None = None,
    stash_floors: Mapping[tuple[int, int], int] | None = None,
) -> tuple[ModelRun, float | None]:
    """Whether no plan has a period ``<= cutoff``: one CP-SAT feasibility run of the model.

    The model of :func:`run_model` (``units``, ``gpu``, ``lower``, ``lifetime_cuts``,
    ``together``, ``parameters``, ``stash_floors`` as there; the limits of ``options`` as
    they are) with no objective and the period at most ``cutoff``. Returns the run and the
    proven bound: ``cutoff - 2 / scale`` when the engine proved that there is no plan (the
    cutoff holds up to one grid step on CP-SAT's exact grid, and the optimum may lie one
    more step below it), ``None`` when it found one (``run.plan``, not yet replayed),
    stopped without an answer or failed.
    """
    run = run_model(problem, "cpsat", options, units=units, gpu=gpu, upper_bound=cutoff,
                    feasibility=True, lower=lower, lifetime_cuts=lifetime_cuts,
                    together=together, parameters=parameters, stash_floors=stash_floors)
    if run.failed or run.bound != math.inf:
        return run, None
    return run, cutoff - 2 * run.step


MIN_ENGINE_LIMIT_S = 1e-3
"""Least wall-clock limit of an engine run when the solve's ``time_limit_s`` is spent before
it (the madpipe warm start, the relaxation, the probes, the search or the model's build
took it all): the engine stops at once with what it has. Without it the run got
``time_limit_s=0``, which ``SolveOptions`` refuses as an input error (as
``pipeline_chunks`` floors its calls)."""


def _limited(options: SolveOptions, deadline: float | None) -> SolveOptions:
    """``options`` with the time limit capped by what is left before ``deadline``."""
    if deadline is None:
        return options
    return options.with_(time_limit_s=left_for_engine(
        Deadline(deadline, time.perf_counter), options.time_limit_s, MIN_ENGINE_LIMIT_S))


def _run_pulp(form: PipelineFormulation, options: SolveOptions, values: list[float] | None,
              deadline: float | None = None) -> ModelRun:
    pm = to_pulp(form.model)
    res = engines.solve_pulp(pm.problem, pm.all_variables, options.solver,
                             initial=pm.initial(values),
                             **engines.pulp_settings(_limited(options, deadline)))
    report: dict[str, Any] = res.report()
    if res.failed:
        return ModelRun(Status.ERROR, None, math.nan, report, engine=res)
    if options.solver == "highs" and "nodes" in res.info:  # the adapter read HiGHS's count
        report["nodes"] = res.info["nodes"]
    bound = res.bound if math.isfinite(res.bound) else math.nan
    if res.status is Status.INFEASIBLE:
        return ModelRun(res.status, None, math.inf, report, engine=res)
    if not res.status.has_plan or res.values is None:
        return ModelRun(res.status, None, bound, report, engine=res)
    raw = res.values
    plan = _decode(form, lambda: (_polish(pm, form, raw, options) or raw)[:len(form.model.vars)])
    if isinstance(plan, str):
        return _undecodable(res, plan, report)
    return ModelRun(res.status, plan, bound, report, engine=res)


def _decode(form: PipelineFormulation, values: Callable[[], Sequence[float]]
            ) -> PipelinePlan | str:
    """The plan of the engine's values, or why they do not decode.

    A misbehaving engine (too few values, NaN, an assignment that no pattern has) would
    crash the decoder; that is the engine's failure, not the method's.
    """
    try:
        got = list(values())
        fault = shape_error(got, len(form.model.vars))
        if fault is not None:
            raise ValueError(fault)
        return form.decode(got)
    except (ArithmeticError, LookupError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _undecodable(res: engines.EngineResult, fault: str, report: dict[str, Any],
                 step: float = 0.0) -> ModelRun:
    """The run of an engine whose solution did not decode: a failed engine call."""
    failed = engines.undecodable_result(res, fault)
    return ModelRun(Status.ERROR, None, math.nan, {**report, **failed.report()}, step,
                    engine=failed)


def _polish(pm: Any, form: PipelineFormulation, values: list[float], options: SolveOptions
            ) -> list[float] | None:
    """Re-solve the LP with every integer variable fixed to its rounded value.

    MIP engines accept integers within a tolerance, which the big-M rows multiply into time
    errors of about ``1e-6 K``: enough to move a task by a period in the decoder. With the
    integers fixed the LP's vertex is exact up to the LP tolerance. The LP is small: no limit,
    and it runs outside the solve's work budget (it reads the plan the MIP found; skipped
    under a budget the MIP spent, the plan was decoded from the unpolished values).
    """
    import pulp  # type: ignore[import-untyped]

    saved = []
    for v, x in zip(pm.all_variables, values, strict=True):
        if v.cat == pulp.LpInteger:
            saved.append((v, v.lowBound, v.upBound))
            v.cat = pulp.LpContinuous
            v.lowBound = v.upBound = round(x)
    try:
        with engines.outside_budget():
            res = engines.solve_pulp(pm.problem, pm.all_variables, options.solver,
                                     threads=options.threads, seed=options.seed)
        return res.values if res.status is Status.OPTIMAL else None
    finally:
        for v, lo, hi in saved:
            v.cat = pulp.LpInteger
            v.lowBound, v.upBound = lo, hi


def _run_cpsat(form: PipelineFormulation, options: SolveOptions, values: list[float] | None,
               parameters: dict[str, Any] | None = None, deadline: float | None = None
               ) -> ModelRun:
    scale, exact_data = form.time_scale()
    cm = to_cpsat(form.model, scale)
    res = engines.solve_cpsat(cm.cp, cm.variables, hint=cm.hint(values),
                              parameters=parameters,
                              **engines.cpsat_settings(_limited(options, deadline)))
    # one grid step: the true optimum may lie between two grid points; when the data were
    # rounded, also the largest rounding along any cycle of the model's time rows
    steps = 1.0 if cm.exact else 1.0 + _cycle_terms(form) * cm.max_rounding
    report: dict[str, Any] = {**res.report(), "time_scale": scale,
                              "time_grid_exact": bool(cm.exact and exact_data),
                              "bound_correction": steps / scale}
    step = steps / scale
    if res.failed:
        return ModelRun(Status.ERROR, None, math.nan, report, step, engine=res)
    if res.status is Status.INFEASIBLE:
        if not cm.exact:
            report["note"] = "times rounded for CP-SAT: infeasibility not proven"
            return ModelRun(Status.NO_SOLUTION, None, math.nan, report, step, engine=res)
        return ModelRun(res.status, None, math.inf, report, step, engine=res)
    bound = (res.bound - steps) / scale if math.isfinite(res.bound) else math.nan
    if not res.status.has_plan or res.values is None:
        return ModelRun(res.status, None, bound, report, step, engine=res)
    raw = res.values
    plan = _decode(form, lambda: cm.values(raw))
    if isinstance(plan, str):
        return _undecodable(res, plan, report, step)
    return ModelRun(res.status, plan, bound, report, step, engine=res)


def _cycle_terms(form: PipelineFormulation) -> int:
    """Most duration terms on a cycle of the time rows (one per time variable)."""
    return sum(1 for v in form.model.vars if v.kind is Kind.CONTINUOUS)


def scaled(problem: PipelineProblem, factor: float) -> PipelineProblem:
    """``problem`` with its memory per GPU multiplied by ``factor`` (rounded down)."""
    return replace(problem, memory_per_gpu=int(problem.memory_per_gpu * factor))


__all__ = ["MIN_ENGINE_LIMIT_S", "OPTIMALITY_TOLERANCE", "PROBLEM", "ModelRun",
           "below_least_memory", "fits", "infeasible", "load_bound", "lower_bound",
           "plan_result", "proven", "refute", "replayed_period", "run_model", "scaled"]
