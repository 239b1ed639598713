"""Exact checkpointing methods ``ilp`` (PuLP: HiGHS, CBC, Gurobi) and ``cpsat`` (OR-Tools).

Both solve the phase-indexed model of :mod:`optmem.models.checkpoint_ilp` (the full
operation model of the simulator; variant ``persistent`` adds memory persistence, RR-9302
section 4, and then equals the persistent DP). The persistent DP plan (paper variant) is
given to the engine as a starting solution, so a time limit returns a plan at least as good
as the DP's with the engine's proven bound (``feasible``) instead of failing. Every plan is
replayed by the simulator (:func:`optmem.solvers.checkpoint.plan_result`); the model's own
objective of the decoded plan must equal the simulated makespan.

Options read from :class:`optmem.result.SolveOptions`: ``variant`` (``full`` default,
``persistent``), ``solver`` (ILP engine), ``time_limit_s``, ``threads``, ``warm_start``,
``verbose``, ``extra["sweeps"]`` (increasing forward runs per phase, default 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optmem.errors import OptmemInputError
from optmem.models.checkpoint_ilp import (
    VARIANTS,
    Formulation,
    build_formulation,
    emit_pulp,
    write_model,
)
from optmem.plan import Op
from optmem.problems.checkpoint import CheckpointProblem, Discretized
from optmem.result import Result, SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers import engines
from optmem.solvers.checkpoint import (
    PROBLEM,
    discretize_for,
    infeasible_result,
    lower_bound,
    plan_result,
)
from optmem.solvers.checkpoint_dp import solve_persistent_table
from optmem.solvers.facade import register, register_exporter

MIN_MEMORY_TIME_LIMIT_S = 30.0


@dataclass(frozen=True)
class _Start:
    """The DP plan used as a warm start and as the fallback incumbent."""

    plan: tuple[Op, ...] | None
    makespan: float
    values: list[int] | None
    note: str


def _variant(options: SolveOptions) -> str:
    variant = options.variant or "full"
    if variant not in VARIANTS:
        raise OptmemInputError(f"unknown exact-model variant {variant!r} "
                               f"(expected one of {', '.join(VARIANTS)})", field="variant")
    return variant


def _sweeps(options: SolveOptions) -> int:
    sweeps = options.extra.get("sweeps", 1)
    if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 1:
        raise OptmemInputError(f"expected a positive integer number of sweeps, got {sweeps!r}",
                               field="sweeps")
    return sweeps


def _dp_start(disc: Discretized, form: Formulation, wanted: bool) -> _Start:
    """The persistent DP plan (paper variant) and its assignment in ``form``."""
    budget = disc.memory_limit - disc.chain.input_size
    if budget < 0:
        return _Start(None, math.inf, None, "the DP has no plan")
    table = solve_persistent_table(disc.chain, budget, "paper")
    if not math.isfinite(table.value()):
        return _Start(None, math.inf, None, "the DP has no plan")
    plan = table.plan()
    makespan = simulate_checkpoint(disc.chain, plan).makespan
    if not wanted:
        return _Start(plan, makespan, None, "off")
    values = form.assignment(plan)
    note = "dp plan" if values is not None else "the dp plan does not fit the slots"
    return _Start(plan, makespan, values, note)


def _min_memory(problem: CheckpointProblem, options: SolveOptions, variant: str,
                sweeps: int) -> int | None:
    """Smallest feasible limit of the undiscretised chain (min-peak ILP), if proven.

    The search gets the method's time limit, at most ``MIN_MEMORY_TIME_LIMIT_S``.
    """
    if not engines.is_available(options.solver):
        return None
    form = build_formulation(problem.chain, None, variant, sweeps)
    model = emit_pulp(form)
    limit = min(options.time_limit_s or MIN_MEMORY_TIME_LIMIT_S, MIN_MEMORY_TIME_LIMIT_S)
    out = engines.solve_pulp(model.problem, model.variables, options.solver,
                             time_limit_s=limit, threads=options.threads,
                             verbose=options.verbose)
    if out.status is not Status.OPTIMAL or out.values is None:
        return None
    return int(round(out.values[form.peak_var]))  # type: ignore[index]


def _finish(
    problem: CheckpointProblem, options: SolveOptions, disc: Discretized, form: Formulation,
    start: _Start, *, method: str, variant: str, status: Status, values: list[float] | None,
    bound: float, solver: str, report: dict[str, Any],
) -> Result:
    """Turn an engine outcome into a Result (plan replayed by the simulator)."""
    bound = max(bound, lower_bound(problem)) if math.isfinite(bound) else lower_bound(problem)
    if status is Status.INFEASIBLE:
        sweeps = _sweeps(options)
        min_mem = _min_memory(problem, options, variant, sweeps) if method == "ilp" else None
        if min_mem is None and method == "cpsat" and engines.is_available("highs"):
            min_mem = _min_memory(problem, options.with_(solver="highs"), variant, sweeps)
        return infeasible_result(problem, disc, method=method, variant=variant,
                                 min_memory=min_mem, report=report)
    if status.has_plan and values is not None:
        rounded = [round(v) for v in values]
        plan = form.decode(rounded)
        claimed = form.evaluate(rounded)
        if start.plan is not None and claimed > start.makespan + 1e-9:
            # never return worse than the DP (an engine that ignored the warm start)
            report["incumbent"] = "dp plan (the engine's was worse)"
            return plan_result(problem, disc, start.plan, method=method,
                               status=Status.FEASIBLE, bound=bound, variant=variant,
                               solver=solver, report=report)
        return plan_result(problem, disc, plan, method=method, status=status, bound=bound,
                           variant=variant, solver=solver, claimed=claimed, report=report)
    if status is Status.NO_SOLUTION and start.plan is not None:
        report["incumbent"] = "dp plan"
        return plan_result(problem, disc, start.plan, method=method, status=Status.FEASIBLE,
                           bound=bound, variant=variant, solver=solver, report=report)
    return Result(PROBLEM, method, status, bound=bound, memory_limit=disc.memory_limit,
                  unit=disc.unit, variant=variant, solver=solver, report=report)


def _prepare(problem: CheckpointProblem, options: SolveOptions
             ) -> tuple[Discretized, str, Formulation]:
    disc = discretize_for(problem, options)
    variant = _variant(options)
    form = build_formulation(disc.chain, disc.memory_limit, variant, _sweeps(options))
    return disc, variant, form


# ------------------------------------------------------------------ ILP
@register(PROBLEM, "ilp", exact=True, requires=("pulp",),
          description="exact phase-indexed ILP of the full model (PuLP: HiGHS/CBC/Gurobi)",
          compare_as=(("ilp", 20), ("ilp:persistent", 20)))
def solve_checkpoint_ilp(problem: CheckpointProblem, options: SolveOptions) -> Result:
    """Optimal plan of the full operation model (``persistent``: of persistent plans)."""
    engines.check_engine(options.solver)
    disc, variant, form = _prepare(problem, options)
    report: dict[str, Any] = {"model": form.size, "sweeps": form.sweeps}
    if form.trivially_infeasible:
        return _finish(problem, options, disc, form, _Start(None, math.inf, None, ""),
                       method="ilp", variant=variant, status=Status.INFEASIBLE, values=None,
                       bound=math.inf, solver=options.solver, report=report)
    start = _dp_start(disc, form, options.warm_start)
    report["warm_start"] = start.note
    model = emit_pulp(form)
    out = engines.solve_pulp(model.problem, model.variables, options.solver,
                             time_limit_s=options.time_limit_s, threads=options.threads,
                             initial=model.initial(start.values), verbose=options.verbose)
    report.update(engine_status=out.message, engine_time_s=round(out.time_s, 4))
    return _finish(problem, options, disc, form, start, method="ilp", variant=variant,
                   status=out.status, values=out.values, bound=out.bound, solver=out.engine,
                   report=report)


# ------------------------------------------------------------------ CP-SAT
@register(PROBLEM, "cpsat", exact=True, requires=("ortools",),
          description="exact CP-SAT model of the full model (same formulation as ilp)",
          compare_as=(("cpsat", 12), ("cpsat:persistent", 12)))
def solve_checkpoint_cpsat(problem: CheckpointProblem, options: SolveOptions) -> Result:
    """Optimal plan of the full operation model with OR-Tools CP-SAT."""
    from optmem.models.checkpoint_cpsat import emit_cpsat

    disc, variant, form = _prepare(problem, options)
    report: dict[str, Any] = {"model": form.size, "sweeps": form.sweeps}
    if form.trivially_infeasible:
        return _finish(problem, options, disc, form, _Start(None, math.inf, None, ""),
                       method="cpsat", variant=variant, status=Status.INFEASIBLE,
                       values=None, bound=math.inf, solver="cpsat", report=report)
    start = _dp_start(disc, form, options.warm_start)
    report["warm_start"] = start.note
    model = emit_cpsat(form)
    report["time_scale"] = model.scale
    out = engines.solve_cpsat(model.model, model.variables, time_limit_s=options.time_limit_s,
                              threads=options.threads, hint=model.hint(start.values),
                              verbose=options.verbose)
    report.update(engine_status=out.message, engine_time_s=round(out.time_s, 4))
    status = out.status
    bound = model.true_bound(out.bound)
    if status is Status.OPTIMAL and not model.exact_scale:
        report["time_scale_note"] = ("times rounded to 1e-6 for CP-SAT: optimal for the rounded "
                                     "times; bound shifted by the largest rounding error")
        if out.values is not None:
            true = form.evaluate([round(v) for v in out.values])
            if true > bound + 1e-9 * max(1.0, abs(true)):
                status = Status.FEASIBLE
    return _finish(problem, options, disc, form, start, method="cpsat", variant=variant,
                   status=status, values=out.values, bound=bound, solver="cpsat",
                   report=report)


# ------------------------------------------------------------------ export
@register_exporter(PROBLEM, "ilp")
def export_checkpoint_ilp(problem: CheckpointProblem, options: SolveOptions, path: str) -> None:
    """Write the ILP as ``.mps`` or ``.lp`` (by suffix); nothing is left on error."""
    _, _, form = _prepare(problem, options)
    write_model(emit_pulp(form), path)


@register_exporter(PROBLEM, "cpsat")
def export_checkpoint_cpsat(problem: CheckpointProblem, options: SolveOptions,
                            path: str) -> None:
    """Write the CP-SAT model (``.pb``/``.pbtxt``) or the same model as ILP (``.mps``/``.lp``)."""
    import os
    import tempfile
    from pathlib import Path

    from optmem.models.checkpoint_cpsat import emit_cpsat

    _, _, form = _prepare(problem, options)
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix in (".mps", ".lp"):
        write_model(emit_pulp(form), target)
        return
    if suffix not in (".pb", ".pbtxt"):
        raise OptmemInputError(f"cannot tell the model format from {target.name!r} "
                               "(expected .pb, .pbtxt, .mps or .lp)", field="output")
    model = emit_cpsat(form)
    fd, tmp = tempfile.mkstemp(suffix=suffix, prefix=".optmem-",
                               dir=target.parent if str(target.parent) else ".")
    os.close(fd)
    try:
        if not model.model.export_to_file(tmp):
            raise OptmemInputError(f"cannot write {target}", field="output")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
