"""Offload exact models on a very slow link (hunt, stop 76): wrong proofs without a warm start.

* ``ilp`` (HiGHS) answered ``infeasible`` where ``brute`` replays a plan: the big-M rows of
  the model (horizon ~1e10 against durations ~1) defeat the engine's tolerances.
* ``cpsat`` answered ``optimal`` 1.2e10 (``exact_times``, ``time_scale`` 1) where ``brute``
  replays 8e9: CP-SAT's presolve (OR-Tools 9.15) loses the optimum of the exact integer
  model, which accepts the 8e9 schedule and is solved to 8e9 with presolve off.

Every answer is held to the invariants: ``bound <= brute optimum <= objective``, ``optimal``
only at the optimum, the plan replays with its claimed makespan within the memory limit.
"""

from __future__ import annotations

import itertools
import math

import pytest

from optmem import OffloadProblem, SolveOptions, solve
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers.offload import min_memory

pytest.importorskip("ortools", reason="the exact models use OR-Tools CP-SAT")
pytest.importorskip("pulp", reason="the ilp method uses PuLP")

ONE = SolveOptions(threads=1)
COLD = ONE.with_(warm_start=False)

SLOW_LINK = Chain.from_lists([4.0, 0.0, 1.0], [0.0, 6.0, 0.0], [2, 3, 1], [6, 7, 5],
                             input_size=4, bwd_overhead=[0, 2, 2], loss_bwd_time=1.0)

NO_ZERO_TIMES = Chain.from_lists([4.0, 2.0, 2.0], [8.0, 8.0, 7.0], [3, 2, 5], [3, 7, 6],
                                input_size=5)


def check_against_brute(problem: OffloadProblem, res: Result, brute: Result) -> None:
    """The invariants of an exact method's answer against the brute-force optimum."""
    if brute.status is Status.INFEASIBLE:
        assert res.status in (Status.INFEASIBLE, Status.NO_SOLUTION), res.status
        return
    assert brute.status is Status.OPTIMAL
    best = brute.objective
    assert res.status is not Status.INFEASIBLE, res.report
    assert not res.bound > best * (1 + 1e-9) + 1e-9, (res.bound, best, res.report)
    if not res.status.has_plan:
        return
    replay = verify_plan(problem, res)
    assert replay["objective"] == pytest.approx(res.objective, rel=1e-9)
    assert replay["peak_memory"] <= problem.memory_limit
    assert res.objective >= best * (1 - 1e-9) - 1e-9
    if res.status is Status.OPTIMAL:
        assert res.objective == pytest.approx(best, rel=1e-9), res.report


@pytest.mark.parametrize("chain, bandwidth, optimum", [(SLOW_LINK, 1e-9, 20000000006.0),
                                                       (NO_ZERO_TIMES, 1e-8, 1600000015.0)])
def test_offload_ilp_without_warm_start_is_not_infeasible_on_a_slow_link(
        chain: Chain, bandwidth: float, optimum: float) -> None:
    problem = OffloadProblem(chain, 20, chain_bandwidth=bandwidth)
    brute = solve(problem, "brute", options=ONE)
    assert brute.status is Status.OPTIMAL
    assert verify_plan(problem, brute)["objective"] == pytest.approx(optimum)
    assert solve(problem, "cpsat", options=ONE).objective == pytest.approx(optimum)
    res = solve(problem, "ilp", options=COLD)
    # was: Status.INFEASIBLE, bound inf
    assert res.status is not Status.INFEASIBLE
    assert not res.bound > brute.objective * (1 + 1e-9)
    if res.status is Status.OPTIMAL:
        assert res.objective == pytest.approx(brute.objective)
    check_against_brute(problem, res, brute)


def test_offload_cpsat_without_warm_start_optimal_is_the_optimum_on_a_slow_link() -> None:
    problem = OffloadProblem(SLOW_LINK, 24, chain_bandwidth=1e-9)
    brute = solve(problem, "brute", options=ONE)
    assert verify_plan(problem, brute)["objective"] == pytest.approx(8e9)
    assert solve(problem, "cpsat", options=ONE).objective == pytest.approx(8e9)
    res = solve(problem, "cpsat", options=COLD)
    # was: optimal 12000000010.0, bound 12000000010.0 (report exact_times True)
    assert res.bound <= brute.objective * (1 + 1e-6)
    if res.status is Status.OPTIMAL:
        assert res.objective == pytest.approx(brute.objective)
    check_against_brute(problem, res, brute)


BANDWIDTHS = (1e-9, 1e-8, 3e-8, 1e-7)


def _sweep_cases() -> list[tuple[int, bool, float, int]]:
    """40 seeded chains (1-3 stages, both time kinds), each at one bandwidth, 2 limits."""
    cases = []
    for seed, integer in itertools.product(range(20), (True, False)):
        n = 1 + seed % 3
        bandwidth = BANDWIDTHS[(seed + integer) % len(BANDWIDTHS)]
        chain = random_chain(n, seed=1000 + seed, integer_times=integer)
        least = min_memory(OffloadProblem(chain, 10**6, chain_bandwidth=bandwidth),
                           ONE.slots)
        assert least is not None
        cases += [(seed, integer, bandwidth, least), (seed, integer, bandwidth, least + 1)]
    return cases


@pytest.mark.parametrize("seed, integer, bandwidth, limit", _sweep_cases())
def test_offload_exact_without_warm_start_slow_link_sweep(
        seed: int, integer: bool, bandwidth: float, limit: int) -> None:
    chain = random_chain(1 + seed % 3, seed=1000 + seed, integer_times=integer)
    problem = OffloadProblem(chain, limit, chain_bandwidth=bandwidth)
    brute = solve(problem, "brute", options=ONE)
    for method in ("ilp", "cpsat"):
        check_against_brute(problem, solve(problem, method, options=COLD), brute)


# --- remat + offload: the same model shape, the same check -----------------------------------

@pytest.mark.parametrize("integer, bandwidth", [(True, 1e-9), (False, 1e-9), (False, 1e-8),
                                                (False, 1e-7)])
def test_remat_offload_ilp_without_warm_start_optimal_is_the_optimum_on_a_slow_link(
        integer: bool, bandwidth: float) -> None:
    """``ilp`` (HiGHS and CBC alike) answered ``optimal`` with a decoded plan 2.4 time units
    (``integer``: 2e9) above the brute-force optimum, inside its relative tolerance ``1e-6``
    of a 1e8 makespan but no optimum; the cross-check plan (DYNPROG's) is the optimum."""
    problem = RematOffloadProblem(random_chain(2, seed=2001, integer_times=integer), 20,
                                  chain_bandwidth=bandwidth)
    brute = solve(problem, "brute", options=ONE)
    assert brute.status is Status.OPTIMAL
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=COLD)
        assert not res.bound > brute.objective * (1 + 1e-9)
        replay = verify_plan(problem, res)
        assert replay["objective"] == pytest.approx(res.objective, rel=1e-9)
        assert res.objective >= brute.objective * (1 - 1e-9)
        if res.status is Status.OPTIMAL:
            assert res.objective == pytest.approx(brute.objective, rel=1e-9), method


@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("method, adapter", [("cpsat", "solve_cpsat"), ("ilp", "solve_pulp")])
def test_offload_engine_infeasible_with_a_plan_proves_nothing(
        monkeypatch: pytest.MonkeyPatch, method: str, adapter: str, warm: bool) -> None:
    """An engine ``infeasible`` (bound ``inf``) where the DP's plan fits proves nothing:
    ``feasible`` with the OFF_frac bound, with a warm start (as before) and without one
    (before: ``infeasible``)."""
    from optmem.engines import adapters as engines

    problem = OffloadProblem(random_chain(3, seed=0), 40, chain_bandwidth=1.0)
    brute = solve(problem, "brute", options=ONE)
    frac = solve(problem, "frac", options=ONE).bound
    assert brute.objective > frac * (1 + 1e-6)  # the bounds alone prove no optimum here

    def wrong(*args: object, **kwargs: object) -> engines.EngineResult:
        return engines.EngineResult(Status.INFEASIBLE, None, math.nan, math.inf, "stub", 0.0,
                                    "infeasible")

    monkeypatch.setattr(engines, adapter, wrong)
    res = solve(problem, method, options=ONE.with_(warm_start=warm))
    assert res.status is Status.FEASIBLE, res.report
    assert res.bound == pytest.approx(frac)
    assert "infeasible" in res.report["warning"]
    check_against_brute(problem, res, brute)
