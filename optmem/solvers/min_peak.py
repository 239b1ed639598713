"""Min-peak methods behind the facade: Hong's DPs, the exact ILP, brute force, baselines.

Every method returns a checkpoint set; :func:`set_result` replays it with the independent
phase-by-phase simulator of :mod:`optmem.simulate.min_peak` (or the checkpoint simulator for
the ``optmem`` model) and refuses a claimed peak that the replay does not reproduce. The
result's ``objective`` and ``peak_memory`` are that peak (chain memory units, ``unit`` 1);
``plan`` is the equivalent checkpoint op plan (each segment recomputed once), whose makespan
and peak under optmem's own accounting are in ``report``.

Methods (``optmem solve min-peak CHAIN --method M [--variant V] [--model ...]``):

* ``dp``: ``static`` model Alg. 3 (``cubic``); ``pytorch`` model Alg. 6 (``linear``,
  default) or Alg. 5 (``quadratic``); ``optmem`` model Alg. 5 with optmem's segment cost.
* ``ilp``: :mod:`optmem.models.min_peak_ilp` (HiGHS, CBC fallback).
* ``brute``: every subset of ``{1..n-1}`` (``n <= 16``).
* ``chen``: Hong's O(sqrt n) baseline, a checkpoint every ``round(sqrt n)`` tensors.
* ``every``: every tensor a checkpoint.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from optmem.engines.results import engine_failure
from optmem.errors import OptmemInputError
from optmem.plan import plan_strings
from optmem.problems.min_peak import (
    MinPeakProblem,
    checkpoint_plan,
    normalize_checkpoints,
)
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.simulate.min_peak import model_peak, pytorch_checkpoint_memory
from optmem.simulate.verify import CLAIM_TOLERANCE, Replay, Wording, replay_result
from optmem.solvers import min_peak_dp as dp
from optmem.solvers.registration import register, register_exporter

PROBLEM = "min-peak"
DP_VARIANTS = {"pytorch": ("linear", "quadratic"), "static": ("cubic",),
               "optmem": ("quadratic",)}
DP_VARIANT_NAMES = tuple(dict.fromkeys(v for names in DP_VARIANTS.values() for v in names))
"""Every variant of ``dp`` over the models (each model accepts its own, ``DP_VARIANTS``)."""
BRUTE_MAX_LENGTH = 16
WORDING = Wording(claim="claimed peak {claimed} but the replay says {simulated}")


def set_result(
    problem: MinPeakProblem,
    checkpoints: Sequence[int],
    *,
    method: str,
    status: Status,
    bound: float,
    variant: str | None = None,
    solver: str | None = None,
    claimed: float | None = None,
    report: dict[str, Any] | None = None,
    engine_tolerance: bool = False,
) -> Result:
    """Replay ``checkpoints`` and build the result from the replay (not from the claim).

    A claimed peak the replay does not reproduce makes the result an ``error``. A peak
    above ``problem.memory_limit`` makes it ``infeasible`` (exact methods: proven, with
    the least peak as ``min_feasible_memory``) or ``no_solution`` (baselines). With
    ``engine_tolerance`` (the ILP: sizes scaled to coefficients of at most 1e4, solved in
    floating point), a peak above the limit by at most :data:`CLAIM_TOLERANCE` (relative)
    is not a proof: the engine cannot tell such sets apart (on activations of 2^40 bytes
    HiGHS returned a set one byte above the least peak), so the result is ``no_solution``.
    """
    cps = normalize_checkpoints(checkpoints, problem.n)
    plan = checkpoint_plan(cps)

    def replay() -> Replay:
        peak = model_peak(problem, cps)
        sim = simulate_checkpoint(problem.chain, plan)
        info: dict[str, Any] = {
            "model": problem.model, "count_input": problem.count_input,
            "checkpoints": list(cps),
            "checkpoint_plan_makespan": sim.makespan, "checkpoint_plan_peak": sim.peak_memory,
            **(report or {}),
        }
        if problem.model == "pytorch":
            info["checkpoint_memory"] = pytorch_checkpoint_memory(problem.sizes(), cps)
        return Replay(float(peak), peak, info)

    out = replay_result(PROBLEM, method, status, plan_strings(plan), replay, bound=bound,
                        claimed=claimed, memory_limit=problem.memory_limit, unit=1,
                        variant=variant, solver=solver, wording=WORDING, check_peak=False)
    peak = out.peak_memory
    if (out.status is not Status.ERROR and peak is not None
            and problem.memory_limit is not None and peak > problem.memory_limit):
        info = out.report
        info["hint"] = (f"the least peak found is {peak} {problem.chain.memory_unit}, above "
                        f"the limit {problem.memory_limit}")
        unresolved = engine_tolerance and peak <= problem.memory_limit * (1 + CLAIM_TOLERANCE)
        if unresolved:
            info["hint"] += (", within the engine's tolerance of it: not proven infeasible "
                             "(the dp method is exact)")
        if status is Status.OPTIMAL and not unresolved:
            return Result(PROBLEM, method, Status.INFEASIBLE, bound=math.inf,
                          memory_limit=problem.memory_limit, unit=1, variant=variant,
                          solver=solver, min_feasible_memory=peak, report=info)
        return Result(PROBLEM, method, Status.NO_SOLUTION, memory_limit=problem.memory_limit,
                      unit=1, variant=variant, solver=solver, report=info)
    return out


def _check(problem: Any) -> MinPeakProblem:
    if not isinstance(problem, MinPeakProblem):
        raise OptmemInputError(f"expected a MinPeakProblem, got {type(problem).__name__}",
                               field="problem")
    return problem


# ------------------------------------------------------------------ dynamic programs
@register(PROBLEM, "dp", exact=True, default=True,
          description="Hong et al. DPs: Alg. 3 (static), Alg. 6/5 (pytorch), Alg. 5 (optmem)",
          variants=DP_VARIANT_NAMES)
def solve_min_peak_dp(problem: MinPeakProblem, options: SolveOptions) -> Result:
    """Least peak by the DP of the problem's model (variants in ``DP_VARIANTS``)."""
    problem = _check(problem)
    allowed = DP_VARIANTS[problem.model]
    variant = options.variant or allowed[0]
    if variant not in allowed:
        raise OptmemInputError(
            f"unknown dp variant {variant!r} for the {problem.model} model (expected one of "
            f"{', '.join(allowed)})", field="variant")
    if problem.model == "static":
        value, cps = dp.static_min_peak(problem.sizes())
    elif variant == "linear":
        value, cps = dp.linear_min_peak(problem.sizes())
    else:
        w, row = dp.segment_model(problem)
        raw, cps, _ = dp.suffix_min_peak(w, row)
        value = int(raw)
    return set_result(problem, cps, method="dp", status=Status.OPTIMAL, bound=value,
                      variant=variant, claimed=value)


# ------------------------------------------------------------------ exact ILP
@register(PROBLEM, "ilp", exact=True, full_model=True, requires=("pulp",), max_length=30,
          description="exact ILP over checkpoint sets (PuLP; HiGHS, CBC fallback)")
def solve_min_peak_ilp(problem: MinPeakProblem, options: SolveOptions) -> Result:
    """Least peak by the ILP of :mod:`optmem.models.min_peak_ilp`."""
    from optmem.models import min_peak_ilp as ilp

    problem = _check(problem)
    model = ilp.build_min_peak_ilp(problem)
    initial = None
    start: tuple[int, ...] | None = None
    if options.warm_start:
        first = solve_min_peak_dp(problem, options.with_(variant=None))
        start = tuple(first.report["checkpoints"])
        initial = ilp.initial_values(model, problem, start)
    outcome = ilp.solve_min_peak_ilp(model, options, initial)
    report: dict[str, Any] = {"variables": len(model.lp.variables()),
                              "constraints": model.lp.numConstraints()}
    if outcome.engine is not None and outcome.engine.failed:
        return _ilp_failed(problem, outcome.engine, start, report)
    if outcome.engine is not None:
        report.update(outcome.engine.report())
    if not outcome.status.has_plan:
        return Result(PROBLEM, "ilp", outcome.status, memory_limit=problem.memory_limit,
                      solver=outcome.solver, report=report)
    cps, claimed = ilp.decode_min_peak_ilp(model), outcome.objective
    peak = model_peak(problem, cps)
    if start is not None and (start_peak := model_peak(problem, start)) < peak:
        cps, claimed, peak = start, float(start_peak), start_peak
        report["incumbent"] = "dp set (the engine's set peaks higher, within its tolerances)"
    bound = min(outcome.bound, float(peak))  # the engine's, to tolerance
    return set_result(problem, cps, method="ilp", status=outcome.status, bound=bound,
                      solver=outcome.solver, claimed=claimed, report=report,
                      engine_tolerance=True)


def _ilp_failed(problem: MinPeakProblem, out: Any, start: tuple[int, ...] | None,
                report: dict[str, Any]) -> Result:
    """``feasible`` with the DP's set (the warm start, replayed), else ``error``."""
    fallback = None
    if start is not None:
        cps = start

        def fallback(info: dict[str, Any]) -> Result:
            return set_result(problem, cps, method="ilp", status=Status.FEASIBLE,
                              bound=math.nan, solver=out.engine,
                              report={**info, "incumbent": "dp set"})

    return engine_failure(PROBLEM, "ilp", out, report=report, fallback=fallback,
                          memory_limit=problem.memory_limit)


@register_exporter(PROBLEM, "ilp")
def export_min_peak_ilp(problem: MinPeakProblem, options: SolveOptions, path: str) -> None:
    """Write the ILP to ``path`` (``.lp``/``.mps``)."""
    from optmem.models.min_peak_ilp import write_min_peak_ilp

    del options
    write_min_peak_ilp(_check(problem), path)


# ------------------------------------------------------------------ brute force
def brute_force_min_peak(problem: MinPeakProblem) -> tuple[int, tuple[int, ...]]:
    """Least peak over every subset of ``{1..n-1}`` by replay (ties: more checkpoints)."""
    n = problem.n
    best: tuple[int, int, tuple[int, ...]] | None = None
    for r in range(n):
        for inner in itertools.combinations(range(1, n), r):
            cps = (0, *inner, n)
            peak = model_peak(problem, cps)
            key = (peak, -len(cps), cps)
            if best is None or key < best:
                best = key
    assert best is not None
    return best[0], best[2]


@register(PROBLEM, "brute", exact=True, full_model=True, max_length=BRUTE_MAX_LENGTH,
          description="every checkpoint subset (tiny chains only)")
def solve_min_peak_brute(problem: MinPeakProblem, options: SolveOptions) -> Result:
    """Exhaustive search over the ``2^(n-1)`` checkpoint sets."""
    problem = _check(problem)
    del options
    if problem.n > BRUTE_MAX_LENGTH + 4:
        raise OptmemInputError(f"brute force is exponential; refusing n = {problem.n} "
                               f"(> {BRUTE_MAX_LENGTH + 4})", field="method")
    value, cps = brute_force_min_peak(problem)
    return set_result(problem, cps, method="brute", status=Status.OPTIMAL, bound=value,
                      claimed=value)


# ------------------------------------------------------------------ baselines
def chen_checkpoints(n: int) -> tuple[int, ...]:
    """Hong's O(sqrt n) baseline: a checkpoint every ``round(sqrt n)`` tensors.

    Examples
    --------
    >>> chen_checkpoints(24)
    (0, 5, 10, 15, 20, 24)
    >>> chen_checkpoints(15)
    (0, 4, 8, 12, 15)
    """
    step = max(1, round(math.sqrt(n)))
    return normalize_checkpoints(range(0, n + 1, step), n)


@register(PROBLEM, "chen", exact=False,
          description="O(sqrt n) equal segments (Chen et al., as in Hong's Table 2)")
def solve_min_peak_chen(problem: MinPeakProblem, options: SolveOptions) -> Result:
    """Peak of Chen's sqrt(n) set."""
    problem = _check(problem)
    del options
    return set_result(problem, chen_checkpoints(problem.n), method="chen",
                      status=Status.FEASIBLE, bound=math.nan)


@register(PROBLEM, "every", exact=False, description="every tensor a checkpoint")
def solve_min_peak_every(problem: MinPeakProblem, options: SolveOptions) -> Result:
    """Peak when every tensor is a checkpoint (every segment is one stage)."""
    problem = _check(problem)
    del options
    return set_result(problem, range(problem.n + 1), method="every", status=Status.FEASIBLE,
                      bound=math.nan)
