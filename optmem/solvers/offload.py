"""Offloading methods behind the facade (problem ``offload``).

Thesis chapter 3 / Beaumont et al. 2019 (digest ``shared/design/offload.md``):

* ``frac``: the OFF_frac optimum (Theorem 8), a proven lower bound (no plan);
* ``greedy``: GREEDY, the eager prefix of ``M_peak - M`` bytes (section 3.1);
* ``dp``: DYNPROG: Algorithm 5 (exact for OFF_comm on the discretised instance, Theorem 10),
  whose offload set is then run as an OFF_int plan (section 3.2.5);
* ``vdnn``: the papers' vDNN re-implementation (ratio thresholds, all or half; 3.4);
  ``vdnn_conv``: offload the inputs of convolution-like stages (name contains ``conv`` or
  the stage has ``"kind": "conv"``); ``offload_all``: offload every saved activation;
* ``cpsat`` and ``ilp``: the exact model of OFF_int (:mod:`optmem.models.offload`, written
  once) emitted to CP-SAT on an exact time grid, or to a MILP engine through PuLP; the
  DYNPROG/GREEDY plan is the warm start and the horizon, so a time limit returns a plan at
  least as good with the engine's proven bound;
* ``brute``: enumeration of offload sets, transfer orders and issue points (tiny chains).

Every plan is replayed by :func:`optmem.simulate.offload.simulate_offload` on the discretised
chain; the result's objective is the simulated makespan and its ``bound`` the best proven
lower bound (Prop. 3 and OFF_frac).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from optmem.chain import Chain
from optmem.engines import adapters as engines
from optmem.engines.results import engine_failure
from optmem.errors import OptmemInputError, PlanError
from optmem.models.formulation import milp_time_unit, shape_error, to_cpsat, to_pulp
from optmem.models.interrupt import Interrupted, stop_when
from optmem.models.offload import (
    OffloadData,
    OffloadModel,
    Schedule,
    build_offload_model,
    cpsat_parameters,
    exact_scale,
)
from optmem.plan import (
    AnyOp,
    TransferKind,
    TransferOp,
    offload,
    parse_mixed_plan,
    prefetch,
    store_all_plan,
)
from optmem.problems.checkpoint import Discretized
from optmem.problems.offload import OffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import held_after, simulate_checkpoint
from optmem.simulate.offload import OffloadSimulation, simulate_offload
from optmem.simulate.verify import Replay, replay_result
from optmem.solvers.hints import AS_SOLVED, smallest_solvable_limit, too_few_slots
from optmem.solvers.offload_comm import (
    Layers,
    fractional_bound,
    prop3_bound,
    solve_comm_dp,
    solve_comm_dp_thesis,
)
from optmem.solvers.offload_schedule import (
    PREFETCH_POLICIES,
    offloaded_set,
    ordered_plan,
    value_op,
    value_sizes,
)
from optmem.solvers.options import one_or_all
from optmem.solvers.registration import register, register_exporter
from optmem.solvers.time_budget import Deadline, left_for_engine, stopped_during

PROBLEM = "offload"
DP_VARIANTS = ("contract", "thesis", "cheap")
BRUTE_MAX_LENGTH = 3


def prefetch_policies(options: SolveOptions) -> tuple[str, ...]:
    """``extra["prefetch"]``: one of :data:`PREFETCH_POLICIES`, else all of them."""
    return one_or_all(options, "prefetch", PREFETCH_POLICIES)


def _disc(problem: OffloadProblem, options: SolveOptions) -> tuple[Discretized, float]:
    disc = problem.discretize(options.slots)
    return disc, problem.unit_bandwidth(disc.unit)


def lower_bound(problem: OffloadProblem, options: SolveOptions) -> float:
    """Best proven lower bound: max(Prop. 3, OFF_frac) on the discretised instance."""
    disc, beta = _disc(problem, options)
    return max(prop3_bound(disc.chain, disc.memory_limit, beta),
               fractional_bound(disc.chain, disc.memory_limit, beta))


def min_memory(problem: OffloadProblem, slots: int) -> int | None:
    """Least limit at which the store-all sequence runs with everything offloaded, as solved.

    The minimum memory of the OFF_comm model (digest 1.1) on the chain rounded to each
    candidate unit (:func:`optmem.solvers.hints.smallest_solvable_limit`). Without a link
    (bandwidth 0) nothing leaves the GPU: the store-all peak.
    """
    def need(unit: int) -> int:
        layers = Layers.of(problem.chain.quantize(unit))
        return math.ceil(layers.peak() if problem.chain_bandwidth == 0 else layers.min_memory())

    return smallest_solvable_limit(need(1), need, slots)


def _infeasible(problem: OffloadProblem, disc: Discretized, method: str,
                report: dict | None = None, *, slots: int, offloads: bool = False) -> Result:
    """``status: infeasible`` with the least limit at which ``method`` finds a plan.

    ``offloads``: every plan of ``method`` offloads some value (``vdnn``, ``vdnn_conv``,
    ``offload_all``), so at bandwidth 0 it finds a plan at no limit and names none.
    """
    info = dict(report or {})
    if offloads and problem.chain_bandwidth == 0:
        info["hint"] = (f"{method} always offloads, which needs a link: at bandwidth 0 it finds "
                        f"a plan at no limit (use dp, which can offload nothing)")
        return Result(PROBLEM, method, Status.INFEASIBLE, bound=math.inf,
                      memory_limit=disc.memory_limit, unit=disc.unit, report=info)
    need = min_memory(problem, slots)
    if need is None:
        info["hint"] = (f"the store-all sequence with everything offloaded fits no limit with "
                        f"slots = {slots}: {too_few_slots()}")
    elif problem.chain_bandwidth == 0:
        info["hint"] = (f"the smallest feasible memory is {need} {problem.chain.memory_unit} "
                        f"(the store-all peak: nothing is offloaded at bandwidth 0; "
                        f"{AS_SOLVED})")
    else:
        info["hint"] = (f"the smallest feasible memory is {need} {problem.chain.memory_unit} "
                        f"(the store-all sequence with everything offloaded; {AS_SOLVED})")
    return Result(PROBLEM, method, Status.INFEASIBLE, bound=math.inf,
                  memory_limit=disc.memory_limit, unit=disc.unit, min_feasible_memory=need,
                  report=info)


def replay_offload(problem: OffloadProblem, disc: Discretized, beta: float,
                   plan: Sequence[AnyOp], extra: dict[str, Any] | None = None) -> Replay:
    """Replay ``plan`` on the discretised instance: makespan, peak and the link's report keys.

    The report of every offload-shaped plan (offload and remat + offload): ``idle_time``,
    ``offloaded``, ``transfers`` and the bandwidths, then ``extra``.
    """
    sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
    return Replay(sim.makespan, sim.peak_memory, {
        "idle_time": sim.idle_time, "offloaded": sim.offloaded_size,
        "transfers": len(sim.link), "bandwidth": problem.chain_bandwidth,
        "bandwidth_per_s": problem.bandwidth, "bandwidth_units": beta, **(extra or {})})


def plan_result(problem: OffloadProblem, options: SolveOptions, plan: Sequence[AnyOp], *,
                method: str, status: Status, claimed: float | None = None,
                report: dict | None = None, solver: str | None = None) -> Result:
    """Replay ``plan`` and build the result from the simulation (objective = makespan).

    :func:`optmem.simulate.verify.replay_result`, and an ``error`` when the proven lower
    bound is above the simulated makespan of a plan not claimed optimal.
    """
    disc, beta = _disc(problem, options)

    def replay() -> Replay:
        return replay_offload(problem, disc, beta, plan)

    bound = lower_bound(problem, options)
    out = replay_result(PROBLEM, method, status, tuple(str(op) for op in plan), replay,
                        bound=bound, claimed=claimed, memory_limit=disc.memory_limit,
                        unit=disc.unit, solver=solver, report=report)
    if out.status not in (Status.ERROR, Status.OPTIMAL) and (
            bound > out.objective + 1e-9 * max(1.0, out.objective)):
        out.report["error"] = (f"lower bound {bound} above the simulated makespan "
                               f"{out.objective}")
        return out.with_(status=Status.ERROR)
    return out


def _too_small(disc: Discretized) -> bool:
    return disc.memory_limit < Layers.of(disc.chain).min_memory()


def _try_sets(problem: OffloadProblem, options: SolveOptions, method: str,
              sets: Iterable[tuple[str, Iterable[int]]], report: dict | None = None, *,
              offloads: bool = False) -> Result:
    """Best plan among offload sets (each as an ordered no-wait plan); infeasible if none.

    The prefetch policy is checked first, before any work (``sets`` may be lazy).
    ``offloads``: every set is non-empty (see :func:`_infeasible`).
    """
    policies = prefetch_policies(options)
    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, method, report, slots=options.slots,
                           offloads=offloads)
    best: tuple[float, str, tuple[AnyOp, ...]] | None = None
    tried = 0
    for label, values in sets:
        values = list(values)
        for policy in policies:
            tried += 1
            try:
                plan, sim = ordered_plan(disc.chain, beta, disc.memory_limit, values, policy)
            except PlanError:
                continue
            if best is None or sim.makespan < best[0] - 1e-12:
                best = (sim.makespan, f"{label} (prefetch {policy})", plan)
    info = dict(report or {})
    info["candidates"] = tried
    if best is None:
        info["hint"] = "no candidate offload set fits (try a larger memory or bandwidth)"
        return Result(PROBLEM, method, Status.NO_SOLUTION, bound=lower_bound(problem, options),
                      memory_limit=disc.memory_limit, unit=disc.unit, report=info)
    info["choice"] = best[1]
    info["offload_set"] = offloaded_set(best[2])
    return plan_result(problem, options, best[2], method=method, status=Status.FEASIBLE,
                       report=info)


def _need(disc: Discretized) -> float:
    return Layers.of(disc.chain).peak() - disc.memory_limit


def _eager_extensions(length: int, first: int) -> Iterable[list[int]]:
    for k in range(first, length + 1):
        yield list(range(k))


# ------------------------------------------------------------------ bound
@register(PROBLEM, "frac", exact=False,
          description="OFF_frac optimum (Theorem 8): proven lower bound, no plan")
def solve_frac(problem: OffloadProblem, options: SolveOptions) -> Result:
    """The fractional relaxation: ``bound`` only (status ``no_solution``, no plan)."""
    disc, beta = _disc(problem, options)
    frac = fractional_bound(disc.chain, disc.memory_limit, beta)
    prop3 = prop3_bound(disc.chain, disc.memory_limit, beta)
    if _too_small(disc):
        return _infeasible(problem, disc, "frac", slots=options.slots)
    return Result(PROBLEM, "frac", Status.NO_SOLUTION, bound=max(frac, prop3),
                  memory_limit=disc.memory_limit, unit=disc.unit,
                  report={"off_frac": frac, "prop3": prop3, "model": "OFF_frac",
                          "note": "lower bound of the fractional relaxation; no plan"})


# ------------------------------------------------------------------ heuristics
@register(PROBLEM, "greedy", exact=False,
          description="GREEDY: offload the eager prefix of M_peak - M (thesis 3.2)",
          extra=("prefetch",))
def solve_greedy(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Smallest prefix ``abar_0..abar_k`` covering ``M_peak - M`` (longer if it fails)."""
    prefetch_policies(options)  # a bad policy fails before any work
    disc, _ = _disc(problem, options)
    sizes = value_sizes(disc.chain)
    need, total, first = _need(disc), 0, 0
    while first < len(sizes) and total < need:
        total += sizes[first]
        first += 1

    def sets() -> Iterable[tuple[str, list[int]]]:
        for values in _eager_extensions(len(sizes), first):
            yield f"prefix of {len(values)}", values

    # the first prefix that fits is GREEDY's answer
    for label, values in sets():
        result = _try_sets(problem, options, "greedy", [(label, values)])
        if result.status.has_plan or result.status is Status.INFEASIBLE:
            return result
    return result


@register(PROBLEM, "dp", exact=False, default=True,
          description="DYNPROG: OFF_comm-optimal set (Algorithm 5) run as an OFF_int plan",
          compare_as=(("dp", None), ("dp:thesis", None)), extra=("prefetch",),
          variants=DP_VARIANTS)
def solve_dynprog(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Algorithm 5 on the discretised instance, then the ordered no-wait integral plan.

    Variants: ``contract`` (default: sizes rounded up as CONTRACT section 2 says),
    ``thesis`` (the thesis discretisation with the iterative fix, digest 3.2.6), ``cheap``
    (the cheap junction ``(DF+ + DB+) / beta``).

    ``report['comm_value']`` is the DP's OFF_comm optimum (exact when every ``u * beta`` is
    a whole number of units; a lower bound on OFF_int then). If the set does not fit as an
    integral plan, values are added in eager order until it does.
    """
    prefetch_policies(options)  # a bad policy fails before any work
    variant = options.variant or "contract"
    if variant not in DP_VARIANTS:  # before the limit is looked at: at every limit alike
        raise OptmemInputError(f"unknown dp variant {variant!r} (expected one of "
                               f"{', '.join(DP_VARIANTS)})", field="variant")
    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, "dp", slots=options.slots).with_(variant=variant)
    cheap = variant == "cheap"
    report: dict[str, Any] = {"junction": "cheap" if cheap else "exact (3.16)/(3.17)"}
    if variant == "thesis":
        dp, runs = solve_comm_dp_thesis(problem.chain, problem.memory_limit,
                                        problem.chain_bandwidth, options.slots)
        report.update({"discretisation": "thesis 3.3.3.2 (iterative)", "dp_runs": runs})
    else:
        dp = solve_comm_dp(disc.chain, disc.memory_limit, beta, cheap_junction=cheap)
        report["discretisation"] = "CONTRACT section 2"
    report.update({"comm_value": dp.value, "dp_states": dp.states,
                   "comm_set": list(dp.offloaded)})
    if not math.isfinite(dp.value):
        return _try_sets(problem, options, "dp", [], report).with_(variant=variant)
    base = list(dp.offloaded)
    sets = [("comm-optimal set", base)]
    for k in range(disc.chain.length):
        extra = sorted(set(base) | set(range(k + 1)))
        if extra != base:
            sets.append((f"set + prefix {k + 1}", extra))
    for label, values in sets:
        result = _try_sets(problem, options, "dp", [(label, values)], report)
        if result.status.has_plan:
            break
    return result.with_(variant=variant)


def _ratio_candidates(problem: OffloadProblem, options: SolveOptions
                      ) -> Iterable[tuple[str, list[int]]]:
    disc, _ = _disc(problem, options)
    chain = disc.chain
    sizes = value_sizes(chain)
    ratios = [(chain.fwd_time[k] / sizes[k] if sizes[k] else -1.0, k)
              for k in range(chain.length)]
    for threshold in sorted({r for r, _ in ratios if r >= 0}):
        chosen = sorted(k for r, k in ratios if r >= threshold)
        yield f"ratio >= {threshold:.4g}", chosen
        yield f"ratio >= {threshold:.4g}, every other", chosen[::2]


@register(PROBLEM, "vdnn", exact=False,
          description="vDNN as re-implemented in the papers: ratio u_F/abar thresholds",
          extra=("prefetch",))
def solve_vdnn(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Best of all thresholds on ``u_F_{k+1} / abar_k``, offloading all or half (3.4)."""
    return _try_sets(problem, options, "vdnn", _ratio_candidates(problem, options),
                     offloads=True)


def conv_stages(problem: OffloadProblem) -> list[int]:
    """Values whose consumer stage looks like a convolution (name or ``kind`` field)."""
    chain = problem.chain
    out = []
    for k in range(chain.length):
        name = chain.stage_names[k].lower()
        kind = str(chain.stage_extra[k].get("kind", "")).lower()
        if "conv" in name or kind == "conv":
            out.append(k)
    return out


@register(PROBLEM, "vdnn_conv", exact=False,
          description="vDNN conv: offload the inputs of convolution stages (name or kind)",
          extra=("prefetch",))
def solve_vdnn_conv(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Offload the input of every convolution-like stage (falls back to every stage)."""
    chosen = conv_stages(problem)
    label = "conv inputs" if chosen else "no conv stage found: every stage"
    return _try_sets(problem, options, "vdnn_conv",
                     [(label, chosen or list(range(problem.chain.length)))], offloads=True)


@register(PROBLEM, "offload_all", exact=False,
          description="vDNN all: offload every saved activation", extra=("prefetch",))
def solve_offload_all(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Offload every value ``abar_0 .. abar_{L-1}``."""
    return _try_sets(problem, options, "offload_all",
                     [("all", list(range(problem.chain.length)))], offloads=True)


# ------------------------------------------------------------------ exact
CPSAT_MAX_LENGTH = 24  # compare runs cpsat by default up to ResNet-50 (L = 22)
ILP_MAX_LENGTH = 8  # the big-M emission proves small chains only (benchmarks/results)
_TIME_TOL = 1e-6  # engine times (MILP tolerances) closer than this count as equal


def op_durations(chain: Chain) -> tuple[float, ...]:
    """Durations of the store-all sequence ``F_all 1..L, Loss, B L..B 1`` (chain fields)."""
    return (*chain.fwd_time, chain.loss_bwd_time, *reversed(chain.bwd_time))


def _fraction(x: float) -> Fraction:
    """``x`` as the decimal it prints as (chain files hold decimals)."""
    return Fraction(repr(float(x)))


@dataclass(frozen=True)
class _Start:
    """The warm start: the best heuristic plan, its simulation and its model schedule."""

    method: str
    plan: tuple[AnyOp, ...]
    makespan: float
    schedule: Schedule


def _schedule(sim: OffloadSimulation) -> Schedule:
    """Compute starts and transfer starts (per value index) of a replayed plan."""
    offloads: dict[int, float] = {}
    prefetches: dict[int, float] = {}
    for step in sim.link:
        kind, _, index = step.op.split()
        (offloads if kind == "offload" else prefetches)[int(index)] = step.start
    return Schedule(tuple(s.start for s in sim.compute), offloads, prefetches)


def canonical_plan(chain: Chain, plan: Sequence[AnyOp]) -> tuple[AnyOp, ...]:
    """``plan`` with the transfers of equal-sized values moved to the lowest indices.

    The symmetry breaking of :mod:`optmem.models.offload` (``off_b <= off_a`` when
    ``z_a = z_b``, ``a < b``) keeps only such plans; the moved value takes the same link
    slots and is as good (same sizes, produced and read earlier, needed later).
    """
    sizes = value_sizes(chain)
    sent = offloaded_set(plan)
    rename: dict[int, int] = {}
    for size in {sizes[k] for k in sent}:
        group = [k for k in range(len(sizes)) if sizes[k] == size]
        moved = [k for k in group if k in sent]
        rename.update(zip(moved, group[:len(moved)], strict=True))
    out: list[AnyOp] = []
    for op in plan:
        if isinstance(op, TransferOp):
            k = rename[op.stage]
            op = (offload if op.kind is TransferKind.OFFLOAD else prefetch)(*value_op(k))
        out.append(op)
    return tuple(out)


def _warm_start(problem: OffloadProblem, options: SolveOptions,
                done: list[_Start] | None = None) -> _Start | None:
    """The better of DYNPROG and GREEDY, with equal-sized values canonical (or ``None``).

    Both poll the solve's deadline (:func:`~optmem.solvers.offload_schedule.ordered_plan`,
    since stop 77; 2.8 s at L = 339 under load 8 before): ``done`` (when given) gets each
    plan as soon as it is known, so a solve stopped in GREEDY keeps DYNPROG's.
    """
    disc, beta = _disc(problem, options)
    base = options.with_(variant=None)
    best: _Start | None = None
    for method, fn in (("dp", solve_dynprog), ("greedy", solve_greedy)):
        result = fn(problem, base)
        if not result.status.has_plan:
            continue
        plan = canonical_plan(disc.chain, parse_mixed_plan(result.plan))
        try:
            sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
        except PlanError:  # not expected (the renaming is as good); keep the plan as is
            plan = parse_mixed_plan(result.plan)
            sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
        if best is None or sim.makespan < best.makespan:
            best = _Start(method, tuple(plan), sim.makespan, _schedule(sim))
            if done is not None:
                done.append(best)
    return best


def _quick_start(problem: OffloadProblem, options: SolveOptions, done: list[_Start]
                 ) -> tuple[str, tuple[AnyOp, ...]] | None:
    """A stopped warm start's plan: the best finished one, else store-all if its peak fits.

    ``done``: the plans :func:`_warm_start` finished (each better than the one before).
    Store-all needs no simulation to be ruled out (its peak is the chain's); ``None`` when
    neither is there (the answer is then ``no_solution``).
    """
    if done:
        return f"the warm start ({done[-1].method})", done[-1].plan
    disc, _ = _disc(problem, options)
    if Layers.of(disc.chain).peak() <= disc.memory_limit:
        return "store all", store_all_plan(disc.chain.length)
    return None


def _stopped(problem: OffloadProblem, options: SolveOptions, method: str, solver: str | None,
             plan: tuple[str, tuple[AnyOp, ...]] | None, stage: str) -> Result:
    """The answer when the deadline passes in the warm start or the model's build.

    ``plan``: ``(incumbent, plan)``, replayed as ``feasible`` with the lower bound
    (Prop. 3, OFF_frac), or ``no_solution`` with that bound without one;
    ``report["stopped"]`` names ``stage`` (CONTRACT: ``report.stopped``).
    """
    disc, _ = _disc(problem, options)
    lower = lower_bound(problem, options)
    report: dict[str, Any] = {"stopped": stopped_during(stage)}
    if plan is None:
        return Result(PROBLEM, method, Status.NO_SOLUTION, bound=lower,
                      memory_limit=disc.memory_limit, unit=disc.unit, solver=solver,
                      report=report)
    report["incumbent"] = plan[0]
    return plan_result(problem, options, plan[1], method=method, status=Status.FEASIBLE,
                       report=report, solver=solver).with_(bound=lower)


@dataclass(frozen=True)
class _Exact:
    """The model data of an instance: in time units (MILP) and in CP-SAT's integer steps."""

    data: OffloadData
    steps: OffloadData
    scale: int
    exact: bool
    start: _Start | None


ROUNDED_SCALE = 10**6
"""Steps per time unit of the rounded (relaxation) CP-SAT data when no exact grid exists."""


def exact_instance(problem: OffloadProblem, options: SolveOptions,
                   done: list[_Start] | None = None) -> _Exact:
    """Model data (from the discretised chain), warm start and CP-SAT's integer steps.

    ``done``: :func:`_warm_start`'s, the warm-start plans finished so far.

    The steps are exact (``1 / scale`` divides every duration, read as the decimals of the
    chain file, and every transfer time ``z_k * unit / bandwidth``) when ``scale <=``
    :data:`~optmem.models.offload.MAX_SCALE` and the horizon stays below ``2**50`` steps;
    otherwise ``scale = 10**6`` and the steps are the rounded relaxation of
    :meth:`~optmem.models.offload.OffloadData.in_steps`.
    """
    disc, beta = _disc(problem, options)
    chain = disc.chain
    ops = store_all_plan(chain.length)
    seq = simulate_checkpoint(chain, ops)
    sizes = value_sizes(chain)
    durations = op_durations(chain)
    transfer = tuple(z / beta if beta > 0 else math.inf for z in sizes)
    start = _warm_start(problem, options, done) if options.warm_start else None
    finite = [t for t in transfer if math.isfinite(t)]
    horizon = sum(durations) + 2 * sum(finite)
    if start is not None:
        horizon = min(horizon, start.makespan * (1 + 1e-9) + 1e-9)
    lower = lower_bound(problem, options) * (1 - 1e-9) - 1e-12
    data = OffloadData(durations, tuple(s.peak for s in seq.timeline),
                       tuple(s.after + held_after(chain, op)
                             for s, op in zip(seq.timeline, ops, strict=True)),
                       tuple(sizes), transfer,
                       disc.memory_limit, upper=horizon, lower=max(0.0, lower))
    rate = _fraction(problem.unit_bandwidth(1))  # memory units per time unit, undiscretised
    exact = [_fraction(d) for d in durations]
    exact += [Fraction(z * disc.unit) / rate if beta > 0 else Fraction(0) for z in sizes]
    scale = exact_scale(exact)
    if scale is None or scale * horizon > 2**50:
        return _Exact(data, data.in_steps(ROUNDED_SCALE), ROUNDED_SCALE, False, start)
    return _Exact(data, data.in_steps(scale, exact), scale, True, start)


def schedule_plan(length: int, schedule: Schedule, tol: float = 0.0) -> tuple[AnyOp, ...]:
    """The plan of a model schedule (CONTRACT section 10: plan order is issue order).

    Each transfer is listed after the last compute op started no later than it (times within
    ``tol`` count as equal; an offload before a prefetch on ties).
    """
    ops = store_all_plan(length)
    transfers = sorted([(t, 0, offload(*value_op(k))) for k, t in schedule.offloads.items()]
                       + [(t, 1, prefetch(*value_op(k)))
                          for k, t in schedule.prefetches.items()],
                       key=lambda item: (item[0], item[1]))
    plan: list[AnyOp] = []
    pos = 0
    for j, op in enumerate(ops):
        plan.append(op)
        nxt = schedule.starts[j + 1] - tol if j + 1 < len(ops) else math.inf
        while pos < len(transfers) and transfers[pos][0] < nxt:
            plan.append(transfers[pos][2])
            pos += 1
    return tuple(plan)


@dataclass
class _Outcome:
    """An engine call in the original time units."""

    status: Status
    schedule: Schedule | None
    objective: float
    bound: float
    report: dict[str, Any]
    failed: engines.EngineResult | None = None


def _undecodable(out: engines.EngineResult, fault: str, report: dict[str, Any]) -> _Outcome:
    """A solution that is no assignment of the model (a misbehaving engine): a failed call."""
    return _Outcome(Status.ERROR, None, math.nan, math.nan, report,
                    failed=engines.undecodable_result(out, fault))


def _solve_cpsat_model(inst: _Exact, options: SolveOptions, deadline: Deadline) -> _Outcome:
    """CP-SAT on the integer steps (``to_cpsat(model, 1)``); results back in time units."""
    om = build_offload_model(inst.steps)
    cm = to_cpsat(om.model, 1)
    # a true schedule in steps: exact times are integers; floored ones fit the relaxation
    to_steps = (lambda t: round(t * inst.scale)) if inst.exact else (
        lambda t: math.floor(t * inst.scale))
    hint = _hint(om, inst, to_steps, tol=0.5)  # integer times: exact comparisons
    parameters = cpsat_parameters(om.model)  # presolve off on badly conditioned steps
    out = engines.solve_cpsat(cm.cp, cm.variables,
                              **{**engines.cpsat_settings(options),
                                 "time_limit_s": left_for_engine(deadline)},
                              hint=cm.hint(hint[0]) if hint[0] is not None else None,
                              parameters=parameters)
    exact = inst.exact and cm.exact
    report = {"model": om.model.size, "time_scale": inst.scale, "exact_times": exact,
              "presolve": parameters.get("cp_model_presolve", True),
              "time_rounding": "exact" if exact else
              f"relaxation: durations rounded down to 1/{inst.scale} (bound valid)",
              **hint[1], **_engine_report(out)}
    schedule = None
    fault = None if out.values is None else shape_error(out.values, len(om.model.vars))
    if fault is not None:
        return _undecodable(out, fault, report)
    if out.values is not None:
        schedule = om.decode(cm.values(out.values)).map(lambda t: t / inst.scale)
    objective = cm.objective(out.objective) / inst.scale if out.values is not None \
        else math.nan
    bound = cm.objective(out.bound) / inst.scale if math.isfinite(out.bound) else math.nan
    status = out.status if exact or out.status is not Status.OPTIMAL else Status.FEASIBLE
    return _Outcome(status, schedule, objective, bound, report,
                    failed=out if out.failed else None)


def _solve_pulp_model(inst: _Exact, options: SolveOptions, deadline: Deadline) -> _Outcome:
    """A MILP engine on the data in units of :func:`milp_time_unit` (``to_pulp``).

    The model's times are divided by a power of two when its horizon exceeds
    :data:`~optmem.models.offload.MILP_HORIZON` (exact in floats; stop 77): HiGHS called
    the OFF_int model of a very slow link infeasible in chain time units (hunt, stop 76).
    Results come back in chain time units.
    """
    unit = milp_time_unit(inst.data.upper)
    om = build_offload_model(inst.data.in_units(unit))
    pm = to_pulp(om.model)
    hint = _hint(om, inst, lambda t: t / unit, tol=1e-9 * max(1.0, om.data.upper))
    out = engines.solve_pulp(pm.problem, pm.all_variables, options.solver,
                             **{**engines.pulp_settings(options),
                                "time_limit_s": left_for_engine(deadline)},
                             initial=pm.initial(hint[0]))
    report = {"model": om.model.size, "time_unit": unit, **hint[1], **_engine_report(out)}
    values = None if out.values is None else out.values[:len(om.model.vars)]
    fault = None if values is None else shape_error(values, len(om.model.vars))
    if fault is not None:
        return _undecodable(out, fault, report)
    schedule = om.decode(values).map(lambda t: t * unit) if values is not None else None
    return _Outcome(out.status, schedule, out.objective * unit, out.bound * unit, report,
                    failed=out if out.failed else None)


def _hint(om: OffloadModel, inst: _Exact, unit: Callable[[float], float], tol: float
          ) -> tuple[list[float] | None, dict[str, Any]]:
    """The warm start (times mapped by ``unit``) as model values, if the model accepts it.

    ``tol``: times that close compare as equal when the event positions are derived.
    """
    if inst.start is None:
        return None, {"warm_start": None}
    info: dict[str, Any] = {"warm_start": {"method": inst.start.method,
                                           "makespan": inst.start.makespan}}
    values = om.assignment(inst.start.schedule.map(unit), tol=tol)
    bad = om.model.violated(values, tol=1e-6)
    if bad:
        info["warm_start_rejected"] = bad[:3]
        return None, info
    return values, info


def _engine_report(out: engines.EngineResult) -> dict[str, Any]:
    """Engine status, time and deterministic work counts (when the adapter gives them)."""
    report: dict[str, Any] = {"engine_message": out.message, **out.report()}
    work = {k: out.info[k] for k in ("branches", "conflicts", "nodes", "deterministic_time")
            if k in out.info}
    if work:
        report["work"] = work
    return report


def _solve_exact(problem: OffloadProblem, options: SolveOptions, method: str) -> Result:
    """Build, solve, decode, replay; never worse than the warm start (see module docstring)."""
    prefetch_policies(options)  # a bad policy fails before any work
    deadline = Deadline.start(options.time_limit_s, margin=0.0)  # the build's time counts
    disc, _ = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, method, slots=options.slots)
    run = _solve_cpsat_model if method == "cpsat" else _solve_pulp_model
    solver = "cpsat" if method == "cpsat" else options.solver
    lower = lower_bound(problem, options)
    done: list[_Start] = []
    try:  # DYNPROG and GREEDY poll the deadline too (since stop 77)
        with stop_when(deadline.stopper()):
            inst = exact_instance(problem, options, done)
    except Interrupted:  # they ran whole before: 2.8 s at L = 339 under load 8
        return _stopped(problem, options, method, solver,
                        _quick_start(problem, options, done), "the warm start")
    try:  # the model's build and emission poll the deadline (optmem.models.interrupt)
        with stop_when(deadline.stopper()):
            outcome = run(inst, options, deadline)
    except Interrupted:  # at L = 339 the cpsat build ran 270 s under --time-limit 10
        start = None if inst.start is None else \
            (f"the warm start ({inst.start.method})", inst.start.plan)
        return _stopped(problem, options, method, solver, start, "the model's build")
    report = outcome.report
    if outcome.failed is not None:  # the engine crashed: the verified warm start, or error
        return _engine_failed(problem, options, disc, inst, outcome, method, solver, lower)
    if math.isfinite(outcome.bound):
        report["engine_bound"] = outcome.bound
    check = _cross_check(problem, options, inst, outcome, report)
    refuted = _refuted(outcome, check)
    if refuted is not None:  # no proven bound: the engine's is not reported as one
        report["warning"] = refuted
        report.pop("engine_bound", None)
    elif outcome.status is Status.INFEASIBLE:
        return _infeasible(problem, disc, method, report, slots=options.slots)
    found: list[Result] = []
    if outcome.schedule is not None:
        report["model_objective"] = outcome.objective
        plan = schedule_plan(disc.chain.length, outcome.schedule,
                             0.0 if method == "cpsat" else
                             _TIME_TOL * report.get("time_unit", 1.0))
        try:
            found.append(plan_result(problem, options, plan, method=method,
                                     status=Status.FEASIBLE, report=report, solver=solver))
        except PlanError as exc:  # a decoding fault: keep the warm start, say why
            report["decode_error"] = str(exc)
    if check is not None:
        found.append(plan_result(problem, options, check.plan, method=method,
                                 status=Status.FEASIBLE, report=report, solver=solver))
    found = [r for r in found if r.status is Status.FEASIBLE]
    # a refuted engine proved nothing: its bound is dropped, the proven bounds stay
    bound = lower if refuted is not None else max(lower, _finite(outcome.bound))
    if not found:
        status = Status.ERROR if outcome.status is Status.ERROR else Status.NO_SOLUTION
        return Result(PROBLEM, method, status, bound=bound, memory_limit=disc.memory_limit,
                      unit=disc.unit, solver=solver, report=report)
    best = min(found, key=lambda r: r.objective)
    tol = _TIME_TOL * max(1.0, best.objective)
    if refuted is None and outcome.status is Status.OPTIMAL and \
            abs(best.objective - outcome.objective) <= tol:
        return best.with_(status=Status.OPTIMAL, bound=best.objective)
    if refuted is None and outcome.status is Status.OPTIMAL:
        best.report["warning"] = (f"the engine's optimum {outcome.objective} differs from the "
                                  f"replayed plan {best.objective}: reported as feasible "
                                  f"unless the proven bounds reach it")
    bound = min(bound, best.objective)
    if bound >= best.objective - 1e-9 * max(1.0, best.objective):
        return best.with_(status=Status.OPTIMAL, bound=best.objective)
    return best.with_(bound=bound)


def _cross_check(problem: OffloadProblem, options: SolveOptions, inst: _Exact,
                 outcome: _Outcome, report: dict[str, Any]) -> _Start | None:
    """A verified plan to check the engine's proof against: the warm start, or computed.

    Without a warm start (``warm_start=False``) the engine's ``infeasible`` or ``optimal``
    is checked against the DYNPROG/GREEDY plan (:func:`_warm_start`), computed after the
    solve and never given to the engine: on a slow link (``chain_bandwidth=1e-9``, a
    horizon of ~1e10 against durations ~1) HiGHS called the OFF_int model of
    :mod:`optmem.models.offload` infeasible and CP-SAT's presolve (OR-Tools 9.15) proved an
    optimum 1.5x too high (hunt, stop 76). ``report['cross_check']`` names the plan.
    """
    if inst.start is not None:
        return inst.start
    if outcome.status not in (Status.INFEASIBLE, Status.OPTIMAL):
        return None  # no proof to check
    check = _warm_start(problem, options)
    report["cross_check"] = None if check is None else {"method": check.method,
                                                        "makespan": check.makespan}
    return check


def _refuted(outcome: _Outcome, check: _Start | None) -> str | None:
    """Why the verified plan ``check`` refutes the engine's proof (``None``: it does not).

    An ``infeasible`` model with a plan that replays, or an ``optimal`` objective above
    the replayed makespan of a plan (beyond the engines' time tolerance ``1e-6``).
    """
    if check is None:
        return None
    if outcome.status is Status.INFEASIBLE:
        return (f"the engine calls the model infeasible but the {check.method} plan fits: "
                f"its verdict and bound are ignored")
    tol = _TIME_TOL * max(1.0, check.makespan)
    if outcome.status is Status.OPTIMAL and outcome.objective > check.makespan + tol:
        return (f"the engine's optimum {outcome.objective} is above the replayed makespan "
                f"{check.makespan} of the {check.method} plan: its proof and bound are "
                f"ignored")
    return None


def _engine_failed(problem: OffloadProblem, options: SolveOptions, disc: Discretized,
                   inst: _Exact, outcome: _Outcome, method: str, solver: str | None,
                   lower: float) -> Result:
    """A failed engine: the replayed warm start as ``feasible`` (CONTRACT 14), else error."""
    assert outcome.failed is not None
    start = inst.start

    def fallback(report: dict[str, Any]) -> Result:
        assert start is not None
        result = plan_result(problem, options, start.plan, method=method,
                             status=Status.FEASIBLE, report=report, solver=solver)
        return result.with_(bound=min(lower, result.objective)) if result.status.has_plan \
            else result

    return engine_failure(PROBLEM, method, outcome.failed, report=outcome.report,
                          fallback=fallback if start is not None else None,
                          memory_limit=disc.memory_limit, unit=disc.unit, solver=solver,
                          bound=lower)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


@register(PROBLEM, "cpsat", exact=True, full_model=True,
          requires=("ortools",), max_length=CPSAT_MAX_LENGTH, compare_limited=100,
          description="exact event-position model of OFF_int, CP-SAT (exact time grid)",
          extra=("prefetch",))
def solve_cpsat(problem: OffloadProblem, options: SolveOptions) -> Result:
    """OFF_int optimum with CP-SAT (:mod:`optmem.models.offload`, emitted by ``to_cpsat``).

    ``optimal`` means proven on an exact time grid (``report['exact_times']``); with a
    rounded grid the engine's bound is a relaxation bound, still valid. A time limit
    returns the best replayed plan (never worse than the DYNPROG/GREEDY warm start) and
    the best proven bound.
    """
    return _solve_exact(problem, options, "cpsat")


@register(PROBLEM, "ilp", exact=True, full_model=True,
          requires=("pulp",), max_length=ILP_MAX_LENGTH,
          description="exact event-position model of OFF_int, MILP (HiGHS/CBC/Gurobi)",
          extra=("prefetch",))
def solve_ilp(problem: OffloadProblem, options: SolveOptions) -> Result:
    """OFF_int optimum with a MILP engine (the same model, emitted by ``to_pulp``).

    ``optimal`` when the engine proves its optimum and the replayed plan equals it (within
    the engines' time tolerance ``1e-6``).
    """
    return _solve_exact(problem, options, "ilp")


@register_exporter(PROBLEM, "ilp")
def export_offload_ilp(problem: OffloadProblem, options: SolveOptions, path: str) -> None:
    """Write the MILP emission of the model to ``path`` (``.mps`` or ``.lp``)."""
    inst = exact_instance(problem, options.with_(warm_start=False))
    pm = to_pulp(build_offload_model(inst.data).model)
    if str(path).lower().endswith(".lp"):
        pm.problem.writeLP(str(path))
    else:
        pm.problem.writeMPS(str(path))


@register(PROBLEM, "brute", exact=True, full_model=True, max_length=BRUTE_MAX_LENGTH,
          description="enumerate offload sets, transfer orders and issue points (tiny chains)")
def solve_brute(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Exact OFF_int optimum by enumeration and simulation."""
    from optmem.solvers.offload_bruteforce import brute_force_offload, check_brute_length

    check_brute_length(problem.chain.length, BRUTE_MAX_LENGTH)
    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, "brute", slots=options.slots)
    found = brute_force_offload(disc.chain, beta, disc.memory_limit)
    if found is None:
        return _infeasible(problem, disc, "brute", {"note": "no plan fits"},
                           slots=options.slots)
    value, plan, count = found
    return plan_result(problem, options, plan, method="brute", status=Status.OPTIMAL,
                       claimed=value, report={"plans_simulated": count})
