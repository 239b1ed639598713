"""The bridge's checkpoint DP refined by rounding sizes down (refine_by_rounding_down).

The DP rounds sizes up to ``limit // slots`` (CONTRACT section 2); the bridge also solves on
sizes rounded down and keeps that plan when it fits at exact sizes and is better. Checked
against the same DP at exact sizes (``slots = limit``: unit 1), every plan replayed.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch", reason="optmem.pytorch.planning imports torch")

from optmem.chain import Chain  # noqa: E402
from optmem.plan import parse_plan  # noqa: E402
from optmem.problems.checkpoint import CheckpointProblem  # noqa: E402
from optmem.pytorch.planning import Planner, refine_by_rounding_down, rounded_down  # noqa: E402
from optmem.result import SolveOptions, Status  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402

SLOTS = 12


def _chain(length: int, seed: int) -> Chain:
    rng = random.Random(seed)
    out = [rng.randint(5, 60) for _ in range(length)]
    return Chain.from_lists([rng.uniform(1, 5) for _ in range(length)],
                            [rng.uniform(2, 9) for _ in range(length)],
                            out, [o + rng.randint(0, 80) for o in out],
                            input_size=rng.randint(5, 40))


def _value(result) -> float:
    return float(result.report.get("objective_with_segments", result.objective))


def _exact(chain: Chain, limit: int, charge: float):
    """The DP at exact sizes: ``slots = limit`` gives unit 1."""
    extra = {"segment_cost": charge} if charge else {}
    return solve(CheckpointProblem(chain, limit), "dp",
                 options=SolveOptions(slots=limit, extra=extra))


def _model_value(chain: Chain, plan, charge: float) -> tuple[float, int]:
    ops = parse_plan(plan)
    sim = simulate_checkpoint(chain, ops)
    return sim.makespan + charge * sum(o.kind.name == "F_CK" for o in ops), sim.peak_memory


@settings(max_examples=60, deadline=None)
@given(length=st.integers(2, 7), seed=st.integers(0, 10_000), where=st.floats(0.35, 1.0),
       charge=st.sampled_from([0.0, 1.5]))
def test_refined_plan_fits_is_never_worse_and_first_try_is_exact_optimum(length, seed, where,
                                                                          charge):
    chain = _chain(length, seed)
    low, high = chain.input_size, chain.store_all_peak() - 1
    limit = int(low + where * (high - low))
    planner = Planner("checkpoint", limit, slots=SLOTS,
                      extra={"segment_cost": charge} if charge else {})
    options = planner.options(chain)
    rounded = solve(CheckpointProblem(chain, limit), "dp", options=options)
    got = planner.solve_at(chain, limit)
    exact = _exact(chain, limit, charge)
    if got.status.has_plan:
        value, peak = _model_value(chain, got.plan, charge)
        assert peak <= limit  # replayed at exact sizes
        assert value == pytest.approx(_value(got))
        assert exact.status.has_plan and _value(exact) <= value + 1e-9
        if rounded.status.has_plan:
            assert value <= _value(rounded) + 1e-9  # never worse than the DP alone
    else:
        assert not rounded.status.has_plan
    if got.report.get("rounding") == "down":
        assert got.unit == 1 and got.memory_limit == limit
        if got.report["rounding_tries"] == 1:  # proven at exact sizes
            assert _value(got) == pytest.approx(_value(exact))
            key = "model_status" if charge else "status"
            assert (got.report[key] if charge else got.status.value) == "optimal", key
        else:
            assert got.report["model_bound"] <= _value(exact) + 1e-9
            assert got.status is Status.FEASIBLE


@settings(max_examples=60, deadline=None)
@given(length=st.integers(2, 7), seed=st.integers(0, 10_000), where=st.floats(0.0, 1.0))
def test_rounding_down_is_a_relaxation(length, seed, where):
    """The DP on sizes rounded down is never above the DP at exact sizes (a valid bound)."""
    chain = _chain(length, seed)
    limit = int(chain.input_size + where * chain.store_all_peak())
    unit = max(1, limit // SLOTS)
    down = solve(CheckpointProblem(rounded_down(chain, unit), limit), "dp",
                 options=SolveOptions(slots=SLOTS))
    exact = _exact(chain, limit, 0.0)
    if exact.status.has_plan:
        assert down.status.has_plan and down.objective <= exact.objective + 1e-9


# (length, seed, limit) of _chain where the pass helps, found by a scan of random instances
IMPROVED = {1: (5, 552, 313), 2: (6, 2201, 353)}


@pytest.mark.parametrize("tries", sorted(IMPROVED))
def test_rounding_down_finds_a_strictly_better_plan(tries):
    length, seed, limit = IMPROVED[tries]
    chain = _chain(length, seed)
    planner = Planner("checkpoint", limit, slots=SLOTS)
    rounded = solve(CheckpointProblem(chain, limit), "dp", options=planner.options(chain))
    got = planner.solve_at(chain, limit)
    assert got.report["rounding"] == "down" and got.report["rounding_tries"] == tries
    assert rounded.status.has_plan and got.objective < rounded.objective
    assert simulate_checkpoint(chain, parse_plan(got.plan)).peak_memory <= limit
    exact = _exact(chain, limit, 0.0)
    if tries == 1:  # the first try is the optimum at exact sizes
        assert got.status is Status.OPTIMAL and got.objective == pytest.approx(exact.objective)
        assert got.bound == pytest.approx(got.objective)
    else:
        assert got.status is Status.FEASIBLE
        assert got.bound == got.report["model_bound"] <= exact.objective + 1e-9


def test_rounding_down_finds_a_plan_where_the_rounded_dp_has_none():
    chain, limit = _chain(3, 1741), 260
    planner = Planner("checkpoint", limit, slots=SLOTS)
    rounded = solve(CheckpointProblem(chain, limit), "dp", options=planner.options(chain))
    got = planner.solve_at(chain, limit)
    assert rounded.status is Status.INFEASIBLE and got.status is Status.OPTIMAL
    assert simulate_checkpoint(chain, parse_plan(got.plan)).peak_memory <= limit
    assert got.objective == pytest.approx(_exact(chain, limit, 0.0).objective)
    smallest = planner.smallest_limit(chain)  # the error's figure still works passed back
    assert planner.solve_at(chain, smallest).status.has_plan


def test_unit_one_and_other_variants_are_left_alone():
    chain = _chain(5, 3)
    limit = chain.store_all_peak() - 1
    exact = _exact(chain, limit, 0.0)
    assert refine_by_rounding_down(chain, limit, SolveOptions(slots=limit), exact) is exact
    rotor = Planner("checkpoint", limit, slots=SLOTS, variant="rotor").solve_at(chain, limit)
    assert "rounding" not in rotor.report
