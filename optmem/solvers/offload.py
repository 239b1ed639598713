"""Offloading methods behind the facade (problem ``offload``).

Thesis chapter 3 / Beaumont et al. 2019 (digest ``shared/design/offload.md``):

* ``frac``: the OFF_frac optimum (Theorem 8), a proven lower bound (no plan);
* ``greedy``: GREEDY, the eager prefix of ``M_peak - M`` bytes (section 3.1);
* ``dp``: DYNPROG: Algorithm 5 (exact for OFF_comm on the discretised instance, Theorem 10),
  whose offload set is then run as an OFF_int plan (section 3.2.5);
* ``vdnn``: the papers' vDNN re-implementation (ratio thresholds, all or half; 3.4);
  ``vdnn_conv``: offload the inputs of convolution-like stages (name contains ``conv`` or
  the stage has ``"kind": "conv"``); ``offload_all``: offload every saved activation;
* ``cpsat``: the exact CP-SAT model of OFF_int (:mod:`optmem.models.offload_cpsat`);
* ``brute``: enumeration of offload sets, transfer orders and issue points (tiny chains).

Every plan is replayed by :func:`optmem.simulate.offload.simulate_offload` on the discretised
chain; the result's objective is the simulated makespan and its ``bound`` the best proven
lower bound (Prop. 3 and OFF_frac).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from optmem.errors import OptmemInputError, PlanError
from optmem.plan import AnyOp
from optmem.problems.checkpoint import Discretized
from optmem.problems.offload import OffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.offload import simulate_offload
from optmem.solvers.engine_results import engine_failure
from optmem.solvers.engines import EngineResult, cpsat_settings
from optmem.solvers.facade import register, register_exporter
from optmem.solvers.hints import smallest_solvable_limit
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
    value_sizes,
)

PROBLEM = "offload"
CPSAT_MAX_LENGTH = 8
DP_VARIANTS = ("contract", "thesis", "cheap")
BRUTE_MAX_LENGTH = 3


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
    candidate unit (:func:`optmem.solvers.hints.smallest_solvable_limit`).
    """
    def need(unit: int) -> int:
        return math.ceil(Layers.of(problem.chain.quantize(unit)).min_memory())

    return smallest_solvable_limit(need(1), need, slots)


def _infeasible(problem: OffloadProblem, disc: Discretized, method: str,
                report: dict | None = None, *, slots: int) -> Result:
    need = min_memory(problem, slots)
    info = dict(report or {})
    info["hint"] = (f"below the minimum memory of the store-all sequence with everything "
                    f"offloaded ({need} {problem.chain.memory_unit}, as solved)")
    return Result(PROBLEM, method, Status.INFEASIBLE, bound=math.inf,
                  memory_limit=disc.memory_limit, unit=disc.unit, min_feasible_memory=need,
                  report=info)


def plan_result(problem: OffloadProblem, options: SolveOptions, plan: Sequence[AnyOp], *,
                method: str, status: Status, claimed: float | None = None,
                report: dict | None = None, solver: str | None = None) -> Result:
    """Replay ``plan`` and build the result from the simulation (objective = makespan)."""
    disc, beta = _disc(problem, options)
    sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
    info = dict(report or {})
    info.update({"idle_time": sim.idle_time, "offloaded": sim.offloaded_size,
                 "transfers": len(sim.link), "bandwidth": problem.chain_bandwidth,
                 "bandwidth_per_s": problem.bandwidth, "bandwidth_units": beta})
    bound = lower_bound(problem, options)
    out = Result(PROBLEM, method, status, objective=sim.makespan, bound=bound,
                 plan=tuple(str(op) for op in plan), peak_memory=sim.peak_memory,
                 memory_limit=disc.memory_limit, unit=disc.unit, solver=solver, report=info)
    if claimed is not None and not math.isclose(claimed, sim.makespan, rel_tol=1e-9,
                                                abs_tol=1e-9):
        info["error"] = f"claimed objective {claimed} but the simulator says {sim.makespan}"
        return out.with_(status=Status.ERROR)
    if sim.peak_memory > disc.memory_limit:
        info["error"] = f"plan peaks at {sim.peak_memory}, above {disc.memory_limit}"
        return out.with_(status=Status.ERROR)
    if status is Status.OPTIMAL:
        out = out.with_(bound=sim.makespan)
    elif bound > sim.makespan + 1e-9 * max(1.0, sim.makespan):
        info["error"] = f"lower bound {bound} above the simulated makespan {sim.makespan}"
        return out.with_(status=Status.ERROR)
    return out


def _too_small(disc: Discretized) -> bool:
    return disc.memory_limit < Layers.of(disc.chain).min_memory()


def _try_sets(problem: OffloadProblem, options: SolveOptions, method: str,
              sets: Iterable[tuple[str, Iterable[int]]], report: dict | None = None) -> Result:
    """Best plan among offload sets (each as an ordered no-wait plan); infeasible if none."""
    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, method, report, slots=options.slots)
    best: tuple[float, str, tuple[AnyOp, ...]] | None = None
    tried = 0
    policies = [options.extra["prefetch"]] if "prefetch" in options.extra else PREFETCH_POLICIES
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
          compare_as=(("dp", None), ("dp:thesis", None)), extra=("prefetch",))
def solve_dynprog(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Algorithm 5 on the discretised instance, then the ordered no-wait integral plan.

    Variants: ``contract`` (default: sizes rounded up as CONTRACT section 2 says),
    ``thesis`` (the thesis discretisation with the iterative fix, digest 3.2.6), ``cheap``
    (the cheap junction ``(DF+ + DB+) / beta``).

    ``report['comm_value']`` is the DP's OFF_comm optimum (exact when every ``u * beta`` is
    a whole number of units; a lower bound on OFF_int then). If the set does not fit as an
    integral plan, values are added in eager order until it does.
    """
    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, "dp", slots=options.slots)
    variant = options.variant or "contract"
    if variant not in DP_VARIANTS:
        raise OptmemInputError(f"unknown dp variant {variant!r} (expected one of "
                               f"{', '.join(DP_VARIANTS)})", field="variant")
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
    return _try_sets(problem, options, "vdnn", _ratio_candidates(problem, options))


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
                     [(label, chosen or list(range(problem.chain.length)))])


@register(PROBLEM, "offload_all", exact=False,
          description="vDNN all: offload every saved activation", extra=("prefetch",))
def solve_offload_all(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Offload every value ``abar_0 .. abar_{L-1}``."""
    return _try_sets(problem, options, "offload_all",
                     [("all", list(range(problem.chain.length)))])


# ------------------------------------------------------------------ exact
def _without_plan(problem: OffloadProblem, options: SolveOptions, disc: Discretized,
                  method: str, out: EngineResult, report: dict[str, Any]) -> Result | None:
    """The result of an engine outcome without a plan (failed, infeasible, stopped), or None.

    Adds the engine's report keys to ``report`` when there is a plan to decode.
    """
    if out.failed:
        return engine_failure(PROBLEM, method, out, report=report,
                              memory_limit=disc.memory_limit, unit=disc.unit)
    report.update(out.report())
    if out.status is Status.INFEASIBLE:
        return _infeasible(problem, disc, method, report, slots=options.slots)
    if out.values is None:
        status = out.status if not out.status.has_plan else Status.ERROR
        return Result(PROBLEM, method, status, bound=lower_bound(problem, options),
                      memory_limit=disc.memory_limit, unit=disc.unit, solver=out.engine,
                      report=report)
    return None


@register(PROBLEM, "cpsat", exact=True, requires=("ortools",), max_length=CPSAT_MAX_LENGTH,
          description="exact CP-SAT model of OFF_int (small chains)")
def solve_cpsat(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Exact OFF_int optimum (``optimal`` when proven within the time limit)."""
    from optmem.models.offload_cpsat import build_offload_cpsat
    from optmem.models.remat_offload_cpsat import decode_transfer_cpsat, solve_transfer_cpsat

    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, "cpsat", slots=options.slots)
    if problem.chain.length > 4 * CPSAT_MAX_LENGTH:
        raise OptmemInputError(f"the CP-SAT model is for small chains; refusing L = "
                               f"{problem.chain.length}", field="method")
    built = build_offload_cpsat(disc.chain, disc.memory_limit, beta)
    out = solve_transfer_cpsat(built, **cpsat_settings(options))
    report = {"model": dict(built.info), "time_scale": built.scale, "exact_times": built.exact}
    early = _without_plan(problem, options, disc, "cpsat", out, report)
    if early is not None:
        return early
    assert out.values is not None
    plan, value = decode_transfer_cpsat(built, out.values)
    proven = out.status is Status.OPTIMAL and built.exact
    report["model_objective"] = value
    result = plan_result(problem, options, plan, method="cpsat",
                         status=Status.OPTIMAL if proven else Status.FEASIBLE,
                         claimed=value if built.exact else None, report=report, solver="cpsat")
    if not proven and result.status is Status.FEASIBLE:
        bound = out.bound / built.scale if built.exact else result.bound
        result = result.with_(bound=max(result.bound, bound))
    return result


@register(PROBLEM, "brute", exact=True, max_length=BRUTE_MAX_LENGTH,
          description="enumerate offload sets, transfer orders and issue points (tiny chains)")
def solve_brute(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Exact OFF_int optimum by enumeration and simulation."""
    from optmem.solvers.offload_bruteforce import brute_force_offload

    if problem.chain.length > 2 * BRUTE_MAX_LENGTH:
        raise OptmemInputError(f"brute force is exponential; refusing L = "
                               f"{problem.chain.length}", field="method")
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


@register(PROBLEM, "ilp", exact=True, requires=("pulp",), max_length=CPSAT_MAX_LENGTH,
          description="exact MILP of OFF_int (PuLP: HiGHS/CBC/Gurobi; small chains)")
def solve_ilp(problem: OffloadProblem, options: SolveOptions) -> Result:
    """Exact OFF_int optimum by the big-M MILP (``optimal`` when proven and replayed)."""
    from optmem.models.offload_ilp import build_offload_ilp, decode_offload_ilp
    from optmem.solvers import engines

    disc, beta = _disc(problem, options)
    if _too_small(disc):
        return _infeasible(problem, disc, "ilp", slots=options.slots)
    if problem.chain.length > 4 * CPSAT_MAX_LENGTH:
        raise OptmemInputError(f"the MILP is for small chains; refusing L = "
                               f"{problem.chain.length}", field="method")
    model = build_offload_ilp(disc.chain, disc.memory_limit, beta)
    out = engines.solve_pulp(model.problem, model.variables, options.solver,
                             **engines.pulp_settings(options))
    report: dict[str, Any] = {"model": dict(model.info), "engine_message": out.message}
    early = _without_plan(problem, options, disc, "ilp", out, report)
    if early is not None:
        return early
    assert out.values is not None
    plan = decode_offload_ilp(model, out.values)
    report["model_objective"] = out.objective
    result = plan_result(problem, options, plan, method="ilp", status=Status.FEASIBLE,
                         report=report, solver=out.engine)
    if not result.status.has_plan:
        return result
    tol = 1e-6 * max(1.0, abs(out.objective))
    if out.status is Status.OPTIMAL and result.objective <= out.objective + tol:
        return result.with_(status=Status.OPTIMAL, bound=result.objective)
    if out.status is Status.OPTIMAL:
        report["warning"] = ("the replayed plan is slower than the model's optimum "
                             f"{out.objective}: reported as feasible")
    return result.with_(bound=max(result.bound, min(out.bound, result.objective)))


@register_exporter(PROBLEM, "ilp")
def export_offload_ilp(problem: OffloadProblem, options: SolveOptions, path: str) -> None:
    """Write the MILP of the discretised instance to ``path`` (``.mps`` or ``.lp``)."""
    from optmem.models.offload_ilp import build_offload_ilp, write_offload_ilp

    disc, beta = _disc(problem, options)
    write_offload_ilp(build_offload_ilp(disc.chain, disc.memory_limit, beta), path)
