"""Wrong proofs a hunt found (stop 75), each against a plan that replays below them.

* Remat + offload ``ilp`` lifted its bounds to the integers although transfer times of
  ``size / 3`` (or fractional durations) put makespans between them: ``optimal`` 16.667
  where 16.333 replays (``cpsat`` and ``ilp`` without a warm start find it), and a bound
  of 5 above an optimum of 4.6009 under a time limit.
* Pipeline ``ilp``, ``cpsat`` and ``chunks`` kept a layer without forward time on its
  predecessor's GPU (``zero_forward_merged``) and reported that class's optimum as the
  problem's: ``optimal`` 10 where MadPipe replays 8. Under ``stash`` the units are the
  layers since (the model counts ties of zero-length tasks as the simulator does): they
  prove 8; under ``strict`` the units stay merged and the answer ``feasible``.
"""

from __future__ import annotations

import pytest
from remat_offload_helpers import check

from optmem import PipelineProblem, RematOffloadProblem, SolveOptions, solve
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.models import pipeline as pipeline_model
from optmem.result import Status
from optmem.simulate.verify import verify_plan

pytest.importorskip("ortools", reason="the exact models use OR-Tools CP-SAT")

ONE = SolveOptions(threads=1)


@pytest.mark.parametrize("options", [ONE, ONE.with_(warm_start=False)])
def test_remat_offload_ilp_bounds_stay_below_fractional_optima(options: SolveOptions) -> None:
    problem = RematOffloadProblem(random_chain(3, seed=16, max_size=6), 27,
                                  chain_bandwidth=3.0)
    reference = solve(problem, "cpsat", options=ONE)
    assert reference.status is Status.OPTIMAL and reference.objective == pytest.approx(49 / 3)
    res = solve(problem, "ilp", options=options)
    check(problem, res, optimum=reference.objective)
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(49 / 3)


@pytest.mark.parametrize("limit", [0.05, 1.0])
def test_a_limited_remat_offload_ilp_bound_is_below_the_optimum(limit: float) -> None:
    chain = random_chain(1, seed=72, max_size=4, integer_times=False)
    problem = RematOffloadProblem(chain, chain.store_all_peak(), chain_bandwidth=3.0)
    optimum = solve(problem, "brute").objective
    res = solve(problem, "ilp", options=ONE.with_(time_limit_s=limit, warm_start=False))
    assert res.bound <= optimum * (1 + 1e-9)


ZERO_FORWARD = Chain.from_lists([1.0, 0.0, 2.0], [4.0, 7.0, 1.0], [6, 5, 5], [11, 6, 7],
                                input_size=2, fwd_overhead=[3, 2, 1], bwd_overhead=[1, 2, 1],
                                weight_size=[5, 4, 4])


EXACT = [("ilp", {"warm_madpipe": False}), ("cpsat", {"warm_madpipe": False}),
         ("chunks", {"warm_madpipe": False, "family": "all"})]


@pytest.mark.parametrize("method, extra", EXACT)
def test_pipeline_proofs_with_zero_forward_layers_are_the_problems(method: str, extra: dict
                                                                    ) -> None:
    problem = PipelineProblem(ZERO_FORWARD, 2, 144, chain_bandwidth=3.0)
    better = solve(problem, "madpipe", options=ONE)
    assert verify_plan(problem, better)["objective"] == pytest.approx(8.0)
    res = solve(problem, method, options=ONE.with_(extra=extra))
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(8.0)
    assert "merged_units" not in res.report
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)


@pytest.mark.parametrize("method, extra", EXACT)
def test_strict_proofs_on_merged_units_are_not_the_problems(method: str, extra: dict,
                                                            monkeypatch) -> None:
    """Under ``strict`` the layer without forward time joined its predecessor until stop
    80 (``STRICT_LAYERS = False``): ``feasible`` 12 (the merged class's best) with a bound
    at most MadPipe's 8. Since stop 80 every layer is a unit: ``optimal`` 8."""
    problem = PipelineProblem(ZERO_FORWARD, 2, 144, chain_bandwidth=3.0,
                              memory_model="strict")
    better = solve(problem, "madpipe", options=ONE)
    assert verify_plan(problem, better)["objective"] == pytest.approx(8.0)
    res = solve(problem, method, options=ONE.with_(extra=extra))
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(8.0)
    assert "merged_units" not in res.report
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)
    monkeypatch.setattr(pipeline_model, "STRICT_LAYERS", False)
    res = solve(problem, method, options=ONE.with_(extra=extra))
    assert res.status is Status.FEASIBLE and res.bound <= better.objective
    assert "merged_units" in res.report
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)
    plain = PipelineProblem(Chain.from_lists(
        [1.0, 0.5, 2.0], [4.0, 7.0, 1.0], [6, 5, 5], [11, 6, 7], input_size=2,
        fwd_overhead=[3, 2, 1], bwd_overhead=[1, 2, 1], weight_size=[5, 4, 4]), 2, 144,
        chain_bandwidth=3.0, memory_model="strict")
    proven = solve(plain, method, options=ONE.with_(extra=extra))  # no zero forward time
    assert proven.status is Status.OPTIMAL and "merged_units" not in proven.report
