"""The integrality tolerance of the remat + offload MILP on slow links (stop 78).

On very slow links (transfers ~1e7-1e9 beside ops of 1-10) HiGHS's default integrality
tolerance let the big-M and transfer rows slip, and `ilp` could not prove 42 of stop 77's
294 slow-link cases; the model now tells HiGHS a tolerance under which no time row slips
by half the shortest duration (`optmem.models.formulation.milp_integrality_tolerance`,
`benchmarks/results/offload_exact.md`, "Stop 78"; per-row big-Ms were tried and dropped:
the module docstring of `optmem.models.remat_offload`). Every work limit here is
deterministic (`deterministic_time`, `node_limit`).
"""

from __future__ import annotations

import pytest
from remat_offload_helpers import limits

from optmem.datasets.synthetic import random_chain
from optmem.engines import adapters as engines
from optmem.models.formulation import (
    MILP_DEFAULT_TOLERANCE,
    MILP_LEAST_TOLERANCE,
    largest_bound,
    milp_integrality_tolerance,
    milp_time_unit,
    to_pulp,
)
from optmem.models.remat_offload import (
    build_remat_offload,
    duration_resolution,
    with_fixed,
)
from optmem.plan import parse_mixed_plan
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers.facade import solve

# the options of stop 77's sweep (no warm start: the engine proves from scratch)
COLD = SolveOptions(threads=1).with_(warm_start=False, deterministic_time=20.0,
                                     node_limit=100_000)

# (seed, stages, integer times, bandwidth, limit): cases of stop 77's sweep where `ilp`'s
# plan did not replay (before stop 78: `feasible` up to 3.3x the optimum, or no plan)
SLOW_CASES = [(5, 4, True, 1e-7, 53), (9, 3, True, 1e-8, 45), (14, 4, False, 1e-7, 39),
              (21, 3, True, 1e-8, 38), (24, 4, True, 1e-8, 41), (26, 3, False, 1e-8, 33),
              (28, 3, False, 1e-6, 31), (31, 3, False, 1e-7, 33)]


def _checked(problem: RematOffloadProblem, res: Result, optimum: float | None) -> None:
    """No error; a plan replays to the objective; the bound is at most the objective and
    ``optimum``, equal to the objective when ``optimal`` (relative tolerances: the
    makespans of slow links reach 1e10)."""
    assert res.status is not Status.ERROR, res.report.get("error")
    if optimum is not None:
        assert res.bound <= optimum * (1 + 1e-6), (res.bound, optimum)
    if not res.status.has_plan:
        return
    replayed = verify_plan(problem, list(res.plan), COLD)["objective"]
    assert replayed == pytest.approx(res.objective, rel=1e-12)
    assert res.bound <= res.objective * (1 + 1e-12)
    if res.status is Status.OPTIMAL:
        assert res.bound == pytest.approx(res.objective, rel=1e-9)


def _problem(seed: int, stages: int, integer: bool, beta: float, limit: int
             ) -> RematOffloadProblem:
    chain = random_chain(stages, seed=3000 + seed, integer_times=integer)
    return RematOffloadProblem(chain, limit, chain_bandwidth=beta)


def test_tolerance_counts_big_ms_and_transfer_coefficients() -> None:
    from optmem.models.formulation import Model

    m = Model("m")
    t, s, y = m.continuous("t", 0, 4e6), m.continuous("s", 0, 4e6), m.binary("y")
    m.add(t >= s + 3, "order", only_if=m.literal(y))  # big-M 4e6 + 3
    assert milp_integrality_tolerance(m, 1.0) == pytest.approx(0.5 / (4e6 + 3))
    m.add(t >= 1e8 * y, "busy")  # a transfer time on a 0/1 choice: the larger
    assert milp_integrality_tolerance(m, 1.0) == pytest.approx(0.5e-8)
    assert milp_integrality_tolerance(m, 0.01) == MILP_LEAST_TOLERANCE
    assert milp_integrality_tolerance(m, 1e6) == MILP_DEFAULT_TOLERANCE
    assert milp_integrality_tolerance(m, float("inf")) == MILP_DEFAULT_TOLERANCE


def test_tolerance_is_the_default_on_ordinary_models() -> None:
    """Nothing changes where the coefficients are small beside the shortest duration."""
    chain = random_chain(4, seed=1)
    built = build_remat_offload(chain, limits(chain)[1], 1.0)
    assert built.resolution == duration_resolution(chain, 1.0)
    assert built.integrality_tolerance == MILP_DEFAULT_TOLERANCE
    slow = build_remat_offload(chain, limits(chain)[1], 1e-8)
    assert MILP_LEAST_TOLERANCE <= slow.integrality_tolerance < MILP_DEFAULT_TOLERANCE
    # invariant under the MILP's power-of-two time units
    unit = milp_time_unit(largest_bound(slow.model))
    assert unit > 1
    assert milp_integrality_tolerance(slow.model.in_units(unit), slow.resolution / unit) \
        == slow.integrality_tolerance


@pytest.mark.parametrize("beta", [1e-8, 1e-6, 0.5])
@pytest.mark.parametrize("seed", [1, 2])
def test_tight_rows_keep_the_schedule_of_every_plan(seed: int, beta: float) -> None:
    """The DP, checkpoint-only and offload-only plans, fixed in the emitted MILP (power-of-two
    units, the model's tolerance), keep a point: the model's value is at
    least the simulated makespan, and equal to it when the decoded plan is the plan."""
    chain = random_chain(3, seed=seed, integer_times=True)
    checked = 0
    for limit in limits(chain):
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        built = build_remat_offload(chain, limit, beta)
        for name in ("dp", "remat_only", "offload_only"):
            res = solve(problem, name, options=COLD)
            if not res.status.has_plan:
                continue
            fixed = built.fixing(parse_mixed_plan(res.plan))
            assert fixed is not None, name
            model = with_fixed(built, fixed)
            unit = milp_time_unit(largest_bound(model))
            pm = to_pulp(model.in_units(unit))
            out = engines.solve_pulp(
                pm.problem, pm.all_variables, "highs", threads=1,
                highs_options={"mip_feasibility_tolerance": built.integrality_tolerance})
            assert out.status is Status.OPTIMAL, name
            values = model.from_units(out.values[:len(model.vars)], unit)
            value = values[built.objective_var]
            assert value >= res.objective * (1 - 1e-9) - 1e-5, name
            if [str(op) for op in built.decode(values)] == list(res.plan):
                assert value == pytest.approx(res.objective, rel=1e-9, abs=1e-5), name
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_slow_link_cases_are_proven(case: tuple[int, int, bool, float, int]) -> None:
    """`ilp` proves what `cpsat` proves: `optimal`, the same optimum (relative 1e-6), a plan
    that replays to its objective."""
    problem = _problem(*case)
    exact = solve(problem, "cpsat", options=COLD)
    assert exact.status is Status.OPTIMAL
    res = solve(problem, "ilp", options=COLD)
    assert res.status is Status.OPTIMAL, res.report.get("warning")
    assert "warning" not in res.report
    assert res.report["integrality_tolerance"] < MILP_DEFAULT_TOLERANCE
    assert res.objective == pytest.approx(exact.objective, rel=1e-6)
    _checked(problem, res, exact.objective)


@pytest.mark.parametrize("seed", [1, 7, 9])
@pytest.mark.parametrize("beta", [1e-9, 1e-8, 1e-7, 1e-6])
def test_ilp_equals_brute_force_on_slow_links(beta: float, seed: int) -> None:
    """2-stage chains, the three limits below the least memory of a checkpoint-only plan and
    that one (where the optimum offloads, or no plan fits): `ilp` and brute force give the
    same status and optimum."""
    chain = random_chain(2, seed=seed, integer_times=True, max_size=5)
    top = limits(chain)[0]
    offloading = 0
    for limit in range(top - 3, top + 1):
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        brute = solve(problem, "brute", options=COLD)
        res = solve(problem, "ilp", options=COLD)
        assert brute.status is not Status.ERROR
        _checked(problem, res, brute.objective if brute.status.has_plan else None)
        if not brute.status.has_plan:
            assert res.status is Status.INFEASIBLE, limit
            continue
        assert res.status is Status.OPTIMAL, (limit, res.report.get("warning"))
        assert res.objective == pytest.approx(brute.objective, rel=1e-6), limit
        offloading += brute.objective > 1 / beta  # a plan that moves a value
    assert offloading > 0
