"""Exact checkpointing methods ``ilp`` (PuLP: HiGHS, CBC, Gurobi) and ``cpsat`` (OR-Tools).

Both solve the phase-indexed model of :mod:`optmem.models.checkpoint_ilp` (the full
operation model of the simulator; variant ``persistent`` adds memory persistence, RR-9302
section 4, and then equals the persistent DP). The persistent DP plan (paper variant) is
given to the engine as a starting solution, so a time limit returns a plan at least as good
as the DP's with the engine's proven bound (``feasible``) instead of failing. Every plan is
replayed by the simulator (:func:`optmem.solvers.checkpoint.plan_result`); the model's own
objective of the decoded plan must equal the simulated makespan.

Options read from :class:`optmem.result.SolveOptions`: ``variant`` (``full`` default,
``persistent``), ``solver`` (ILP engine), ``time_limit_s``, ``node_limit`` (``ilp``),
``deterministic_time`` (``cpsat``), ``seed``, ``threads``, ``warm_start``, ``verbose``,
``extra["sweeps"]`` (increasing forward runs per phase, default 1), ``extra["highs_options"]``
(``ilp`` on HiGHS: HiGHS options over :data:`HIGHS_DEFAULTS`, e.g.
``{"mip_pscost_minreliable": 8}`` for HiGHS's own strong branching; the gaps stay 0, see
:func:`optmem.engines.adapters.check_highs_options`).

An engine that fails (:mod:`optmem.engines.results`) gives ``feasible`` with the DP
plan when it was the warm start, ``error`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from optmem.engines import adapters as engines
from optmem.engines.results import engine_failure
from optmem.errors import OptmemInputError
from optmem.models.checkpoint_ilp import (
    VARIANTS,
    Formulation,
    build_formulation,
    emit_pulp,
    write_model,
)
from optmem.models.formulation import Kind
from optmem.models.interrupt import Interrupted, stop_when
from optmem.plan import Op
from optmem.problems.checkpoint import CheckpointProblem, Discretized
from optmem.result import Result, SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers.checkpoint import (
    PROBLEM,
    discretize_for,
    dp_min_memory,
    infeasible_result,
    lower_bound,
    plan_min_memory,
    plan_result,
)
from optmem.solvers.checkpoint_baselines import store_all_or_chen
from optmem.solvers.checkpoint_dp import solve_persistent_table
from optmem.solvers.registration import register, register_exporter
from optmem.solvers.time_budget import Deadline, left_for_engine, stopped_during

MIN_MEMORY_TIME_LIMIT_S = 30.0
MIN_MEMORY_NODE_LIMIT = 20_000


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


HIGHS_DEFAULTS: dict[str, Any] = {"mip_pscost_minreliable": 0}
"""HiGHS options of the checkpoint ILP unless ``extra["highs_options"]`` overrides them.

``mip_pscost_minreliable = 0``: branch on pseudo-costs without HiGHS's reliability strong
branching. On these models the strong-branching LPs (174k non-zeros on ResNet-152) took
most of the time and the tree did not move (0-3 nodes in 120-150 s); without them
ResNet-101 at 10 % is proven (82 s, 262 nodes; before: gap 0.74 % after 120 s); small
chains take the same time with fewer LP iterations
(``benchmarks/results/checkpoint_exact.md``). The model and its optimum are unchanged (an
engine setting, not a model change; the gaps stay 0).
"""


CPSAT_PARAMETERS: dict[str, Any] = {"linearization_level": 2}
"""CP-SAT parameters of the checkpoint model's solve (``cpsat``; stop 50).

``linearization_level`` 2 puts the model's enforced rows (the memory rows of each phase
and the tape rows, all conditional) into CP-SAT's LP relaxation; at the default level 1
the LP sees little of them and the bound stays near the compute sum on large chains
(ResNet-101 at 30 %: gap 13.65 % after 60 deterministic s at level 1, 0.68 % at level 2;
``benchmarks/bench_cpsat_linearization.py``, ``benchmarks/results/cpsat_linearization.md``).
An engine setting: the model and its optimum are unchanged.
"""


def _tape_chain(options: SolveOptions) -> bool:
    """``extra["tape_chain"]`` (default :data:`TAPE_CHAIN_DEFAULT`): add the tape-chain rows."""
    value = options.extra.get("tape_chain", TAPE_CHAIN_DEFAULT)
    if not isinstance(value, bool):
        raise OptmemInputError(f"expected true or false for tape_chain, got {value!r}",
                               field="tape_chain")
    return value


TAPE_CHAIN_DEFAULT = True
"""Whether the exact models carry the tape-chain rows by default
(:func:`~optmem.models.checkpoint_ilp.build_formulation`, ``tape_chain``; valid rows, the
optimum is unchanged; ``benchmarks/results/checkpoint_exact.md``)."""


def _highs_options(options: SolveOptions) -> dict[str, Any]:
    """:data:`HIGHS_DEFAULTS` updated by the checked ``extra["highs_options"]`` (HiGHS only)."""
    checked = engines.check_highs_options(options.extra.get("highs_options"))
    return {**HIGHS_DEFAULTS, **checked} if options.solver == "highs" else {}


_Planned = tuple[tuple[Op, ...], float]  # a plan and its simulated makespan


def _dp_plan(disc: Discretized) -> _Planned | None:
    """The persistent DP plan (paper variant) and its simulated makespan, or ``None``."""
    budget = disc.memory_limit - disc.chain.input_size
    if budget < 0:
        return None
    table = solve_persistent_table(disc.chain, budget, "paper")
    if not math.isfinite(table.value()):
        return None
    plan = table.plan()
    return plan, simulate_checkpoint(disc.chain, plan).makespan


def _quick_plan(disc: Discretized) -> tuple[str, _Planned] | None:
    """A plan without the DP: store-all when its peak fits, else Chen's sqrt(L) segments.

    The answer of a solve stopped inside the DP warm start (:func:`_stopped`), when its
    simulated peak fits; ``None`` otherwise. One simulation (0.1 s at L = 339); never
    faster than the persistent DP's plan, which is optimal among persistent plans.
    """
    label, plan = store_all_or_chen(disc.chain, disc.memory_limit)
    sim = simulate_checkpoint(disc.chain, plan)
    if sim.peak_memory > disc.memory_limit:
        return None
    return label, (plan, sim.makespan)


def _stopped(problem: CheckpointProblem, options: SolveOptions, method: str, solver: str,
             disc: Discretized, dp: _Planned | None, *, in_dp: bool = False) -> Result:
    """The answer when the DP warm start, the model's build or its emission reach the deadline.

    The persistent DP plan ``dp`` (computed before the build; replayed), ``feasible`` with
    the compute-time bound, or ``no_solution``; ``report["stopped"]``. Why: at L = 339
    (ResNet-1001, 50 %) the ILP's build ran past 2 minutes and 10 GB under
    ``--time-limit 10`` (stop 74); the build polls the deadline
    (:mod:`optmem.models.interrupt`). ``in_dp``: the DP itself was stopped (it polls since
    stop 77; 6.6 s at L = 339 under load 8 before), the plan is :func:`_quick_plan`'s
    (``report["incumbent"]`` names it).
    """
    variant = _variant(options)
    stage = "the DP warm start" if in_dp else "the model's build"
    report: dict[str, Any] = {"stopped": stopped_during(stage)}
    label = "dp plan"
    if in_dp and (quick := _quick_plan(disc)) is not None:
        label, dp = quick
    if dp is None:
        return Result(PROBLEM, method, Status.NO_SOLUTION, bound=lower_bound(problem),
                      memory_limit=disc.memory_limit, unit=disc.unit, variant=variant,
                      solver=solver, report=report)
    report["incumbent"] = label
    return plan_result(problem, disc, dp[0], method=method, status=Status.FEASIBLE,
                       bound=lower_bound(problem), variant=variant, solver=solver,
                       report=report)


def _dp_start(dp: _Planned | None, form: Formulation, wanted: bool) -> _Start:
    """The persistent DP plan ``dp`` (:func:`_dp_plan`) and its assignment in ``form``."""
    if dp is None:
        return _Start(None, math.inf, None, "the DP has no plan")
    plan, makespan = dp
    if not wanted:
        return _Start(plan, makespan, None, "off")
    values = form.assignment(plan)
    note = "dp plan" if values is not None else "the dp plan does not fit the slots"
    return _Start(plan, makespan, values, note)


def _min_memory(problem: CheckpointProblem, options: SolveOptions, variant: str,
                sweeps: int) -> int | None:
    """Smallest limit at which the exact model finds a plan, as solved, if proven.

    The min-peak mode of the model on the undiscretised chain, with sizes scaled to
    coefficients of at most :data:`~optmem.engines.adapters.MAX_COEFFICIENT`; its plan,
    replayed on the chain, gives the least peak, and
    :func:`~optmem.solvers.checkpoint.plan_min_memory` the least limit at which that plan
    fits after rounding. The search gets the method's time limit (at most
    ``MIN_MEMORY_TIME_LIMIT_S``) and node limit, else ``MIN_MEMORY_NODE_LIMIT`` nodes (a
    deterministic budget); ``None`` when it does not prove its answer.
    """
    if not engines.is_available(options.solver):
        return None
    chain = problem.chain
    scale = engines.coefficient_scale(chain.store_all_peak())
    form = build_formulation(chain, None, variant, sweeps, size_scale=scale,
                             tape_chain=_tape_chain(options))
    model = emit_pulp(form)
    settings = {**engines.pulp_settings(options), "highs_options": _highs_options(options)}
    if settings["time_limit_s"] is not None:
        settings["time_limit_s"] = min(settings["time_limit_s"], MIN_MEMORY_TIME_LIMIT_S)
    elif settings["node_limit"] is None:
        settings["node_limit"] = MIN_MEMORY_NODE_LIMIT
    out = _checked(engines.solve_pulp(model.problem, model.variables, options.solver,
                                      **settings), form)
    if out.status is not Status.OPTIMAL or out.values is None:
        return None
    plan = form.decode([round(v) for v in out.values])
    return plan_min_memory(chain, [plan], options.slots)


def _finish(
    problem: CheckpointProblem, options: SolveOptions, disc: Discretized, form: Formulation,
    start: _Start, *, method: str, variant: str, status: Status, values: list[float] | None,
    bound: float, solver: str, report: dict[str, Any],
) -> Result:
    """Turn an engine outcome into a Result (plan replayed by the simulator)."""
    bound = max(bound, lower_bound(problem)) if math.isfinite(bound) else lower_bound(problem)
    if status is Status.INFEASIBLE:
        sweeps = _sweeps(options)
        if variant == "persistent":  # the persistent DP's model: its exact least limit
            min_mem = dp_min_memory(problem, options, "paper")
        elif method == "ilp":
            min_mem = _min_memory(problem, options, variant, sweeps)
        else:
            min_mem = None
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


def _prepare(problem: CheckpointProblem, options: SolveOptions, method: str = "ilp",
             disc: Discretized | None = None) -> tuple[Discretized, str, Formulation]:
    """Discretise and build the model; CP-SAT gets the running-memory rows.

    The running memory variables (:func:`~optmem.models.checkpoint_ilp.build_formulation`)
    let CP-SAT prove every chain ``compare`` gives it (L <= 15) in seconds, where the dense
    rows left 10-30 % gaps after 60 s from L = 15; for HiGHS the measurements are mixed
    (ResNet-152 at 30 %: better tree progress, a weaker root bound; ResNet-101: worse), so
    the ILP keeps the dense rows (``benchmarks/results/checkpoint_exact.md``).
    """
    disc = discretize_for(problem, options) if disc is None else disc
    variant = _variant(options)
    form = build_formulation(disc.chain, disc.memory_limit, variant, _sweeps(options),
                             running_memory=method == "cpsat",
                             tape_chain=_tape_chain(options))
    return disc, variant, form


_Emitted = TypeVar("_Emitted")  # the engine's model (emit_pulp's or emit_cpsat's)


class _Begun(NamedTuple):
    """A solve's instance, model, report so far and DP warm start (:func:`_begin`)."""

    disc: Discretized
    variant: str
    form: Formulation
    report: dict[str, Any]
    start: _Start


def _begin(problem: CheckpointProblem, options: SolveOptions, method: str, solver: str,
           emit: Callable[[Formulation], _Emitted], deadline: Deadline
           ) -> tuple[_Begun, _Emitted] | Result:
    """Build ``method``'s model, its report and the DP warm start, and ``emit`` the model.

    The ``infeasible`` result instead when the model is trivially infeasible; ``solver`` is
    the engine named in that result. The DP plan (:func:`_dp_plan`) is computed before the
    build (since stop 74; after it before); the DP (since stop 77), the build and the
    emission poll ``deadline`` (:mod:`optmem.models.interrupt`), and when it passes the
    answer is that plan, or a cheaper one when the DP was stopped (:func:`_stopped`).
    """
    disc = discretize_for(problem, options)
    try:
        with stop_when(deadline.stopper()):
            dp = _dp_plan(disc)
    except Interrupted:
        return _stopped(problem, options, method, solver, disc, None, in_dp=True)
    try:
        with stop_when(deadline.stopper()):
            disc, variant, form = _prepare(problem, options, method, disc)
            report: dict[str, Any] = {"model": form.size, "sweeps": form.sweeps,
                                      "tape_chain": form.tape_chain}
            if not form.trivially_infeasible:
                start = _dp_start(dp, form, options.warm_start)
                report["warm_start"] = start.note
                return _Begun(disc, variant, form, report, start), emit(form)
    except Interrupted:
        return _stopped(problem, options, method, solver, disc, dp)
    # proven infeasible: its least-memory hint (the persistent DP's recurrence, which polls
    # since stop 80) runs outside the deadline's block, as before, so the proof is kept
    return _finish(problem, options, disc, form, _Start(None, math.inf, None, ""),
                   method=method, variant=variant, status=Status.INFEASIBLE,
                   values=None, bound=math.inf, solver=solver, report=report)


# ------------------------------------------------------------------ ILP
@register(PROBLEM, "ilp", exact=True, full_model=True, restricted_variants=("persistent",),
          requires=("pulp",),
          description="exact phase-indexed ILP of the full model (PuLP: HiGHS/CBC/Gurobi)",
          compare_as=(("ilp", 20), ("ilp:persistent", 20)), compare_limited=100,
          extra=("sweeps", "highs_options", "tape_chain"), variants=VARIANTS)
def solve_checkpoint_ilp(problem: CheckpointProblem, options: SolveOptions) -> Result:
    """Optimal plan of the full operation model (``persistent``: of persistent plans)."""
    engines.check_engine(options.solver)
    highs_options = _highs_options(options)
    deadline = Deadline.start(options.time_limit_s, margin=0.0)  # the build's time counts
    begun = _begin(problem, options, "ilp", options.solver, emit_pulp, deadline)
    if isinstance(begun, Result):
        return begun
    (disc, variant, form, report, start), model = begun
    out = _checked(engines.solve_pulp(model.problem, model.variables, options.solver,
                                      initial=model.initial(start.values),
                                      highs_options=highs_options,
                                      **{**engines.pulp_settings(options),
                                         "time_limit_s": left_for_engine(deadline)}),
                   form, start)
    if out.failed:
        return _engine_failed(problem, disc, start, out, method="ilp", variant=variant,
                              report=report)
    report.update(out.report())
    return _finish(problem, options, disc, form, start, method="ilp", variant=variant,
                   status=out.status, values=out.values, bound=out.bound, solver=out.engine,
                   report=report)


SOLUTION_TOLERANCE = 1e-4
"""Row violation (relative to the row's largest coefficient) above which an engine's
solution is refused: far above the engines' feasibility tolerances (1e-6 .. 1e-9), far below
what a wrong 0/1 value does (a whole size or op)."""


def _checked(out: engines.EngineResult, form: Formulation, start: _Start | None = None
             ) -> engines.EngineResult:
    """``out``, or an engine fault when its solution is no solution of the model.

    The plan is decoded from the rounded values; a solution that lacks values, has NaN or
    violates a row after rounding (a misbehaving engine) would decode to garbage or crash
    the decoder, so it is handled as a failed engine call (``_engine_failed``). So is an
    ``infeasible`` that the warm start (an assignment of the model, ``start.values``)
    refutes.
    """
    if out.status is Status.INFEASIBLE and start is not None and start.values is not None:
        return engines.failed_result(out.engine, f"{out.message or out.status}: infeasible, "
                                     "but the warm-start plan is a solution", out.time_s)
    if not out.status.has_plan:
        return out
    if out.values is None:
        return engines.failed_result(out.engine, f"{out.message or out.status}: a solution "
                                     "without values", out.time_s)
    # the model's variables come first; the engine may add its own (objective_constant);
    # integer variables are read rounded, as the decoder reads them
    rounded = [round(x) if math.isfinite(x) and v.kind is not Kind.CONTINUOUS else x
               for v, x in zip(form.model.vars, out.values, strict=False)]
    fault = form.model.solution_error(rounded, tol=SOLUTION_TOLERANCE)
    if fault is None:
        return out
    return engines.failed_result(out.engine, f"returned an invalid solution ({fault})",
                                 out.time_s)


def _engine_failed(problem: CheckpointProblem, disc: Discretized, start: _Start,
                   out: engines.EngineResult, *, method: str, variant: str,
                   report: dict[str, Any]) -> Result:
    """``feasible`` with the DP plan (when it was the warm start), else ``error``."""
    fallback = None
    if start.values is not None and start.plan is not None:
        plan = start.plan

        def fallback(info: dict[str, Any]) -> Result:
            return plan_result(problem, disc, plan, method=method, status=Status.FEASIBLE,
                               bound=lower_bound(problem), variant=variant,
                               solver=out.engine, report={**info, "incumbent": "dp plan"})

    return engine_failure(PROBLEM, method, out, report=report, fallback=fallback,
                          memory_limit=disc.memory_limit, unit=disc.unit, variant=variant)


# ------------------------------------------------------------------ CP-SAT
@register(PROBLEM, "cpsat", exact=True, full_model=True, restricted_variants=("persistent",),
          requires=("ortools",),
          description="exact CP-SAT model of the full model (same formulation as ilp)",
          compare_as=(("cpsat", 10), ("cpsat:persistent", 10)),
          extra=("sweeps", "tape_chain"), variants=VARIANTS)
def solve_checkpoint_cpsat(problem: CheckpointProblem, options: SolveOptions) -> Result:
    """Optimal plan of the full operation model with OR-Tools CP-SAT."""
    from optmem.models.checkpoint_cpsat import emit_cpsat

    deadline = Deadline.start(options.time_limit_s, margin=0.0)  # the build's time counts
    begun = _begin(problem, options, "cpsat", "cpsat", emit_cpsat, deadline)
    if isinstance(begun, Result):
        return begun
    (disc, variant, form, report, start), model = begun
    report["time_scale"] = model.scale
    out = _checked(engines.solve_cpsat(model.model, model.variables,
                                       hint=model.hint(start.values),
                                       parameters=CPSAT_PARAMETERS,
                                       **{**engines.cpsat_settings(options),
                                          "time_limit_s": left_for_engine(deadline)}),
                   form, start)
    if out.failed:
        return _engine_failed(problem, disc, start, out, method="cpsat", variant=variant,
                              report=report)
    report.update(out.report())
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
    """Write the CP-SAT model (``.pb``/``.pbtxt``) or the same model as ILP (``.mps``/``.lp``).

    Atomically, with :func:`optmem.fileio.write_atomic` (the mode of every other output).
    """
    from pathlib import Path

    from optmem.fileio import write_atomic
    from optmem.models.checkpoint_cpsat import emit_cpsat

    _, _, form = _prepare(problem, options, "cpsat")
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix in (".mps", ".lp"):
        write_model(emit_pulp(form), target)
        return
    if suffix not in (".pb", ".pbtxt"):
        raise OptmemInputError(f"cannot tell the model format from {target.name!r} "
                               "(expected .pb, .pbtxt, .mps or .lp)", field="output")
    model = emit_cpsat(form)

    def write(tmp: Path) -> None:
        if not model.model.export_to_file(str(tmp)):
            raise OptmemInputError(f"cannot write {target}", field="output")

    write_atomic(target, write, field="output")
