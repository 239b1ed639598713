"""Baseline plans: valid, sized by the facade, and what Revolve equals on uniform chains."""

from __future__ import annotations

import math

import pytest

from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain, resnet_like_chain, uniform_chain
from optmem.plan import OpKind
from optmem.problems import CheckpointProblem
from optmem.result import SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers import checkpoint_baselines as base
from optmem.solvers.checkpoint_dp import min_memory_persistent, solve_persistent_table
from optmem.solvers.facade import solve
from optmem.testing import assert_plan_valid

BASELINES = ["store_all", "recompute_all", "chen", "sequential", "revolve"]


def all_plans(length: int) -> list[tuple[str, tuple]]:
    plans = [("store_all", base.store_all_plan(length)),
             ("recompute_all", base.recompute_all_plan(length)),
             ("chen", base.chen_plan(length))]
    plans += [(f"sequential-{k}", p) for k, p in base.sequential_plans(length)]
    plans += [(f"revolve-{m}", base.revolve_plan(length, m)) for m in range(3, length + 3)]
    return plans


@pytest.mark.parametrize("length", [1, 2, 3, 7, 16])
def test_every_baseline_plan_is_valid(length: int) -> None:
    chain = random_chain(length, seed=length)
    for _, plan in all_plans(length):
        sim = simulate_checkpoint(chain, plan)  # raises on any invalid op
        kinds = [(op.kind, op.stage) for op in plan]
        assert all(kinds.count((OpKind.B, i)) == 1 for i in range(1, length + 1))
        assert sim.makespan >= chain.total_compute_time()


def test_segments_match_checkpoint_sequential() -> None:
    assert base.torch_segments(10, 3) == [(1, 3), (4, 6), (7, 10)]
    assert base.torch_segments(5, 5) == [(k, k) for k in range(1, 6)]
    assert base.torch_segments(4, 1) == [(1, 4)]
    assert base.chen_plan(9) == base.segments_plan(base.torch_segments(9, 3))


def test_store_all_and_recompute_all_extremes() -> None:
    chain = random_chain(6, seed=4)
    store = simulate_checkpoint(chain, base.store_all_plan(6))
    assert store.makespan == pytest.approx(chain.total_compute_time())
    assert store.peak_memory == chain.store_all_peak()
    recompute = simulate_checkpoint(chain, base.recompute_all_plan(6))
    assert recompute.peak_memory <= store.peak_memory


@pytest.mark.parametrize("name", BASELINES)
def test_facade_baselines_fit_and_report(name: str) -> None:
    chain = resnet_like_chain(16)
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    for memory in (high, (low + high) // 2):
        result = solve(CheckpointProblem(chain, memory), name)
        assert result.status in (Status.FEASIBLE, Status.INFEASIBLE)
        if result.status is Status.FEASIBLE:
            assert_plan_valid(CheckpointProblem(chain, memory), result)
            assert result.bound == pytest.approx(chain.total_compute_time())
            dp = solve(CheckpointProblem(chain, memory), "dp")
            assert result.objective >= dp.objective - 1e-9
    tiny = solve(CheckpointProblem(chain, chain.input_size), name)
    assert tiny.status is Status.INFEASIBLE


def test_sequential_picks_the_best_fitting_segment_count() -> None:
    chain = resnet_like_chain(20)
    options = SolveOptions(slots=500)
    for fraction in (0.35, 0.5, 0.8, 1.0):
        memory = int(chain.store_all_peak() * fraction)
        result = solve(CheckpointProblem(chain, memory), "sequential", options=options)
        disc = CheckpointProblem(chain, memory).discretize(500)
        fitting = []
        for k, plan in base.sequential_plans(chain.length):
            sim = simulate_checkpoint(disc.chain, plan)
            if sim.peak_memory <= disc.memory_limit:
                fitting.append((sim.makespan, k))
        if not fitting:
            assert result.status is Status.INFEASIBLE
            continue
        best = min(fitting)
        assert result.status is Status.FEASIBLE
        assert result.objective == best[0]
        assert result.report["choice"] == f"{best[1]} segments"
    small = random_chain(6, seed=3)  # sizes below 500: no rounding
    whole = solve(CheckpointProblem(small, small.store_all_peak()), "sequential")
    assert whole.report["choice"] == "1 segments"  # one segment = store all
    assert whole.objective == pytest.approx(small.total_compute_time())


@pytest.mark.parametrize(("length", "tape"), [(5, 10), (7, 20), (12, 40)])
def test_revolve_equals_opt0_with_fused_backward(length: int, tape: int) -> None:
    """What the Revolve baseline equals on uniform chains (documented in docs/checkpointing.md).

    Its DNN plan runs ``F_all l`` right before ``B l``: AD's backward step costs
    ``u_f + u_b``. With the loss also costing ``u_f + u_b`` its makespan is exactly
    ``Opt_0(L, m)`` of thesis Theorem 1 with ``u_b := u_f + u_b``; with unit activations its
    peak is ``m + abar + 1``. The DNN models are not the same problem: the DP at that peak is
    never worse, and strictly better here, because the forward phase (no tape held) has room
    for more checkpoints than the AD slot count, and an early ``F_all`` saves a recomputation.
    """
    uf, ub = 1.0, 2.0
    chain = Chain.from_lists([uf] * length, [ub] * length, [1] * length, [tape] * length,
                             input_size=1, loss_bwd_time=uf + ub)
    opt0 = base.revolve_table(length, length + 2, uf, uf + ub)
    for slots in range(3, length + 3):
        sim = simulate_checkpoint(chain, base.revolve_plan(length, slots, uf, ub))
        assert sim.makespan == opt0[length, slots]
        assert sim.peak_memory == min(slots, length + 1) + tape + 1
        dp = solve_persistent_table(chain, sim.peak_memory - 1).value()
        assert dp <= sim.makespan
        if slots < length:
            assert dp < sim.makespan


def test_revolve_unit_costs_match_o6() -> None:
    # with u_f = u_b = 1 and a loss of 0 the DNN makespan is Opt_0(L, m; 1, 2) - 2
    length = 6
    chain = uniform_chain(length, fwd_time=1.0, bwd_time=1.0, output_size=1, saved_size=1)
    opt0 = base.revolve_table(length, 8, 1.0, 2.0)
    for slots in range(3, 9):
        sim = simulate_checkpoint(chain, base.revolve_plan(length, slots))
        assert sim.makespan == opt0[length, slots] - 2


def test_revolve_needs_three_slots() -> None:
    with pytest.raises(ValueError, match="at least 3 slots"):
        base.revolve_plan(4, 2)
    assert math.isinf(base.revolve_table(4, 2, 1.0, 1.0)[4, 2])
