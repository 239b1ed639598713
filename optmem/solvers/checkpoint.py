"""Checkpointing methods behind the facade: the DPs, the baselines and the brute force.

Every method discretises the instance (CONTRACT section 2), builds a plan, and reports the
plan's makespan and peak as replayed by :func:`optmem.simulate.simulate_checkpoint`: no
method reports a number the simulator did not reproduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from optmem.chain import MAX_TOTAL_TIME, Chain
from optmem.errors import OptmemInputError
from optmem.plan import Op, OpKind, plan_strings
from optmem.problems.checkpoint import CheckpointProblem, Discretized, discretize
from optmem.result import Result, SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.simulate.verify import Replay, Wording, claim_holds, replay_result
from optmem.solvers import checkpoint_baselines as base
from optmem.solvers.checkpoint_bruteforce import brute_force_checkpoint, brute_force_min_peak
from optmem.solvers.checkpoint_dp import min_memory_persistent, solve_persistent_table
from optmem.solvers.hints import AS_SOLVED, smallest_solvable_limit
from optmem.solvers.registration import MethodFn, register

PROBLEM = "checkpoint"
DP_VARIANTS = ("paper", "rotor", "floating", "floating-printed")
FLOATING_MAX_LENGTH = 12
WORDING = Wording(peak="plan peaks at {peak} units, above the limit {limit}")


def discretize_for(problem: CheckpointProblem, options: SolveOptions) -> Discretized:
    """The discretised instance shared by all methods of one comparison."""
    return discretize(problem.chain, problem.memory_limit, options.slots)


def lower_bound(problem: CheckpointProblem) -> float:
    """Every forward with grad and every backward run once: sum of all op times."""
    return problem.chain.total_compute_time()


def plan_result(
    problem: CheckpointProblem,
    disc: Discretized,
    plan: Iterable[Op],
    *,
    method: str,
    status: Status,
    bound: float,
    variant: str | None = None,
    solver: str | None = None,
    claimed: float | None = None,
    report: dict | None = None,
) -> Result:
    """Replay ``plan`` on the discretised chain and build the result from the simulation.

    ``claimed`` is the method's own objective; it must equal the simulated makespan
    (:func:`optmem.simulate.verify.replay_result`), otherwise the result is an ``error``.
    A plan whose simulated peak exceeds the limit is an ``error`` too.
    """
    plan = tuple(plan)

    def replay() -> Replay:
        sim = simulate_checkpoint(disc.chain, plan)
        return Replay(sim.makespan, sim.peak_memory)

    return replay_result(PROBLEM, method, status, plan_strings(plan), replay, bound=bound,
                         claimed=claimed, memory_limit=disc.memory_limit, unit=disc.unit,
                         variant=variant, solver=solver, report=report, wording=WORDING)


def infeasible_result(
    problem: CheckpointProblem, disc: Discretized, *, method: str, variant: str | None,
    min_memory: int | None, report: dict | None = None,
) -> Result:
    """``status: infeasible`` with the smallest feasible memory when known."""
    info = dict(report or {})
    if min_memory is not None:
        info["hint"] = _min_memory_hint(problem, disc, min_memory)
    return Result(PROBLEM, method, Status.INFEASIBLE, bound=math.inf,
                  memory_limit=disc.memory_limit, unit=disc.unit, variant=variant,
                  min_feasible_memory=min_memory, report=info)


def _min_memory_hint(problem: CheckpointProblem, disc: Discretized, min_memory: int) -> str:
    del disc
    return (f"the smallest feasible memory is {min_memory} {problem.chain.memory_unit} "
            f"({AS_SOLVED})")


def dp_min_memory(problem: CheckpointProblem, options: SolveOptions, variant: str) -> int | None:
    """Least limit at which the persistent DP (``variant``) finds a plan, as solved.

    The min-max recurrence (:func:`min_memory_persistent`) on the chain rounded to each
    candidate unit, searched by :func:`optmem.solvers.hints.smallest_solvable_limit`;
    ``rotor`` keeps exactly ``S`` slots. ``floating`` uses the ``paper`` recurrence (its
    plans are floating plans too).
    """
    chain, slots = problem.chain, options.slots
    base = "rotor" if variant == "rotor" else "paper"

    def need(unit: int) -> int:
        return min_memory_persistent(chain.quantize(unit), base)

    def rotor_units(limit: int, unit: int) -> int:
        return min(slots, limit // unit)

    return smallest_solvable_limit(min_memory_persistent(chain, base), need, slots,
                                   units_of_limit=rotor_units if variant == "rotor" else None)


def plan_min_memory(chain: Chain, plans: Iterable[tuple[Op, ...]], slots: int) -> int | None:
    """Least limit at which one of ``plans`` fits after rounding (witness plans)."""
    plans = list(plans)
    if not plans:
        return None
    low = min(simulate_checkpoint(chain, plan).peak_memory for plan in plans)

    def need(unit: int) -> int:
        rounded = chain.quantize(unit)
        return min(simulate_checkpoint(rounded, plan).peak_memory for plan in plans)

    return smallest_solvable_limit(low, need, slots)


# ------------------------------------------------------------------ dynamic programs
@register(PROBLEM, "dp", exact=True, default=True,
          description="rotor dynamic programs (persistent: paper/rotor; floating)",
          compare_as=(("dp", None), ("dp:rotor", None), ("dp:floating", FLOATING_MAX_LENGTH)),
          extra=("segment_cost",), variants=DP_VARIANTS)
def solve_checkpoint_dp(problem: CheckpointProblem, options: SolveOptions) -> Result:
    """Optimal persistent (or floating) plan; ``optimal`` means optimal for the DP's model.

    With ``extra["segment_cost"] = c > 0`` (persistent variants), the DP minimises the
    makespan plus ``c`` per ``F_ck`` op (per recomputed segment). **It is exactly optimal for
    that model** (``model = "persistent + segment cost"``, ``report["model_status"] =
    "optimal"``, the minimum being ``report["objective_with_segments"]``): the plans the
    recurrence ranges over are the persistent plans, and the objective stays additive over
    its decisions. Proof sketch, by induction on ``t - s``: a persistent plan of the
    sub-chain ``(s, t)`` at memory ``m`` either starts with ``F_all s`` (no ``F_ck`` op of
    its own; its other ``F_ck`` ops are those of the sub-plan of ``(s+1, t)``) or with
    ``F_ck s, F_none s+1 .. s'-1`` (exactly one ``F_ck`` op, then the sub-plans of
    ``(s', t)`` and ``(s, s'-1)``, whose ``F_ck`` ops are disjoint and together all the
    others). So ``makespan + c * #F_ck`` of the plan is the decision's local cost (``+ c``
    on the ``F_ck`` branch only) plus that of its sub-plans, and the recurrence with ``C_ck
    + c`` is Bellman's equation for it over the same decisions and memory states as rotor's.
    ``tests/test_checkpoint_segment_cost.py`` checks it against a Dijkstra over every plan
    of the simulator's op model with the persistence rule of the ``ilp:persistent`` model
    (a value read by ``F_ck``/``F_all`` stays until its ``B``; no tape consumed), each
    ``F_ck`` edge charged ``c``. The result's ``status`` stays ``feasible``: ``objective``,
    ``bound`` and ``optimal`` are in the chain's time (CONTRACT section 2), and the plan
    does not minimise the chain's makespan alone.
    """
    variant = options.variant or "paper"
    if variant not in DP_VARIANTS:
        raise OptmemInputError(
            f"unknown dp variant {variant!r} (expected one of {', '.join(DP_VARIANTS)})",
            field="variant")
    segment_cost = _segment_cost(options)
    disc = discretize_for(problem, options)
    if variant.startswith("floating"):
        if segment_cost:
            raise OptmemInputError("segment_cost is a persistent dp option (variants paper "
                                   f"and rotor), not of {variant!r}", field="segment_cost")
        return _solve_floating(problem, options, disc, variant)
    limit = disc.memory_limit
    if variant == "rotor":  # the reference keeps exactly S slots (CONTRACT section 2)
        limit = min(options.slots, disc.memory_limit)
        disc = Discretized(disc.chain, limit, disc.unit)
    budget = limit - disc.chain.input_size
    if budget < 0:
        return infeasible_result(problem, disc, method="dp", variant=variant,
                                 min_memory=dp_min_memory(problem, options, variant))
    table = solve_persistent_table(disc.chain, budget, variant, segment_cost)
    value = table.value()
    report: dict[str, Any] = {"dp_states": table.states, "model": "persistent"}
    if not math.isfinite(value):
        return infeasible_result(problem, disc, method="dp", variant=variant,
                                 min_memory=dp_min_memory(problem, options, variant),
                                 report=report)
    plan = table.plan()
    if segment_cost:
        # optimal for the chain plus a cost per segment, not for the chain alone: the
        # claim is the value without the segments' charges, the bound the chain's own
        segments = sum(1 for op in plan if op.kind is OpKind.F_CK)
        report.update(model="persistent + segment cost", model_status=Status.OPTIMAL.value,
                      segment_cost=segment_cost, segments=segments,
                      objective_with_segments=value)
        result = plan_result(problem, disc, plan, method="dp", status=Status.FEASIBLE,
                             bound=lower_bound(problem), variant=variant, report=report)
        # The DP's claim is checked on its own scale, charges included: ``value - charges``
        # cancels (a 1e9 charge on a chain of microseconds left 1.907e-05 for 1.9e-05).
        charges = segment_cost * segments
        if result.status.has_plan and not claim_holds(value, result.objective + charges):
            error = WORDING.claim.format(claimed=value - charges, simulated=result.objective)
            return result.with_(status=Status.ERROR, report={**result.report, "error": error})
        return result
    return plan_result(problem, disc, plan, method="dp", status=Status.OPTIMAL,
                       bound=value, variant=variant, claimed=value, report=report)


def _segment_cost(options: SolveOptions) -> float:
    """``extra["segment_cost"]`` of the dp method: a time in ``[0, MAX_TOTAL_TIME]`` (0).

    The range of every time of a chain (CONTRACT section 1): a larger charge overflowed the
    DP's sums (``1e308`` made every plan with a segment infinite). A boolean (``bool`` or
    ``numpy.bool_``) is refused, not read as 0 or 1.
    """
    raw = options.extra.get("segment_cost", 0.0)
    try:
        cost = math.nan if isinstance(raw, (bool, np.bool_)) else float(raw)
    except (TypeError, ValueError, OverflowError):
        cost = math.nan
    if not (math.isfinite(cost) and 0 <= cost <= MAX_TOTAL_TIME):
        raise OptmemInputError(f"expected segment_cost in [0, {MAX_TOTAL_TIME:g}] (a time in "
                               f"the chain's unit), got {raw!r}", field="segment_cost")
    return cost


def _solve_floating(problem: CheckpointProblem, options: SolveOptions, disc: Discretized,
                    variant: str) -> Result:
    from optmem.solvers.checkpoint_floating import solve_floating

    if problem.chain.length > FLOATING_MAX_LENGTH * 2:
        raise OptmemInputError(
            f"the floating DP is O(M L^6); refusing L = {problem.chain.length} "
            f"(> {FLOATING_MAX_LENGTH * 2}); use the persistent DP or an exact model",
            field="variant")
    value, plan, states = solve_floating(disc.chain, disc.memory_limit,
                                         printed=variant == "floating-printed")
    report = {"dp_states": states, "model": "floating"}
    if plan is None:
        return infeasible_result(problem, disc, method="dp", variant=variant,
                                 min_memory=dp_min_memory(problem, options, "paper"),
                                 report=report)
    return plan_result(problem, disc, plan, method="dp", status=Status.OPTIMAL, bound=value,
                       variant=variant, claimed=value, report=report)


# ------------------------------------------------------------------ baselines
def _best_fitting(
    problem: CheckpointProblem, options: SolveOptions, method: str,
    candidates: Iterable[tuple[str, tuple[Op, ...]]],
) -> Result:
    """The fastest candidate plan whose simulated peak fits; infeasible if none does."""
    disc = discretize_for(problem, options)
    best: tuple[float, str, tuple[Op, ...]] | None = None
    plans = []
    for label, plan in candidates:
        plans.append(plan)
        sim = simulate_checkpoint(disc.chain, plan)
        if sim.peak_memory <= disc.memory_limit and (best is None or sim.makespan < best[0]):
            best = (sim.makespan, label, plan)
    if best is None:
        return infeasible_result(problem, disc, method=method, variant=None,
                                 min_memory=plan_min_memory(problem.chain, plans, options.slots))
    return plan_result(problem, disc, best[2], method=method, status=Status.FEASIBLE,
                       bound=lower_bound(problem), report={"choice": best[1]})


def _baseline(name: str, description: str,
              candidates: Callable[[CheckpointProblem], Iterable[tuple[str, tuple[Op, ...]]]],
              max_length: int | None = None) -> MethodFn:
    """The baseline method ``name``: the fastest of its candidate plans that fits."""
    def run(problem: CheckpointProblem, options: SolveOptions) -> Result:
        return _best_fitting(problem, options, name, candidates(problem))

    run.__doc__ = description
    run.__name__ = run.__qualname__ = f"solve_{name}"
    return register(PROBLEM, name, exact=False, description=description,
                    max_length=max_length)(run)


def _revolve_candidates(problem: CheckpointProblem) -> Iterable[tuple[str, tuple[Op, ...]]]:
    chain = problem.chain
    length = chain.length
    uf = sum(chain.fwd_time) / length
    ub = sum(chain.bwd_time) / length
    table = base.revolve_table(length, length + 2, uf, ub)
    for slots in range(3, length + 3):
        yield f"{slots} slots", base.revolve_plan(length, slots, uf, ub, table[:, :slots + 1])


solve_store_all = _baseline(
    "store_all", "store every tape (PyTorch default)",
    lambda p: [("store all", base.store_all_plan(p.chain.length))])
solve_recompute_all = _baseline(
    "recompute_all", "recompute from the input before every backward (rotor)",
    lambda p: [("recompute all", base.recompute_all_plan(p.chain.length))])
solve_chen = _baseline(
    "chen", "Chen et al. sqrt(n) equal segments",
    lambda p: [("sqrt(n) segments", base.chen_plan(p.chain.length))])
solve_sequential = _baseline(
    "sequential", "torch checkpoint_sequential, best segment count that fits",
    lambda p: ((f"{k} segments", plan) for k, plan in base.sequential_plans(p.chain.length)))
solve_revolve = _baseline(
    "revolve", "Revolve/binomial (optimal for uniform AD chains), F_all before each B",
    _revolve_candidates, max_length=400)


# ------------------------------------------------------------------ brute force
BRUTE_MAX_LENGTH = 5


@register(PROBLEM, "brute", exact=True, full_model=True, max_length=BRUTE_MAX_LENGTH,
          description="exhaustive search over op sequences (tiny chains only)")
def solve_checkpoint_brute(problem: CheckpointProblem, options: SolveOptions) -> Result:
    """Exact optimum of the full operation model by Dijkstra over memory states.

    Infeasible: ``min_feasible_memory`` is the least limit with a plan as solved (the least
    peak over all plans, :func:`brute_force_min_peak`, on the chain rounded to each unit).
    """
    if problem.chain.length > 2 * BRUTE_MAX_LENGTH:
        raise OptmemInputError(
            f"brute force is exponential; refusing L = {problem.chain.length}", field="method")
    disc = discretize_for(problem, options)
    found = brute_force_checkpoint(disc.chain, disc.memory_limit)
    if found is None:
        chain = problem.chain
        least = smallest_solvable_limit(brute_force_min_peak(chain),
                                        lambda unit: brute_force_min_peak(chain.quantize(unit)),
                                        options.slots)
        return infeasible_result(problem, disc, method="brute", variant=None, min_memory=least)
    value, plan = found
    return plan_result(problem, disc, plan, method="brute", status=Status.OPTIMAL, bound=value,
                       claimed=value, report={"model": "full"})
