"""The allocation decomposition of the exact pipeline model (``extra={"strategy": "benders"}``).

Cross-checks: brute force over allocations (each allocation's fixed-allocation optimum), the
full model where both prove, the incumbents (never above them), and a stopped run (a valid
bound, a replayed plan). No wall-clock limits: the instances are small enough to be proven,
and the stopped run uses CP-SAT's deterministic time on one worker.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.errors import OptmemInputError
from optmem.models.pipeline import make_units
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_benders import solve_benders
from optmem.solvers.pipeline_common import lower_bound, run_model
from tests.test_pipeline_exact import check, set_partitions, small_problems, thesis_chain

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the decomposition's master needs OR-Tools")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(threads=1, seed=0)  # no limit: these instances always prove
BENDERS = {"strategy": "benders", "relaxation": False, "warm_madpipe": False}


def brute_force(problem: PipelineProblem) -> float:
    """The best fixed-allocation optimum over every allocation (``inf``: none fits)."""
    n = make_units(problem).n
    best = math.inf
    for gpu in set_partitions(n, problem.n_gpus):
        run = run_model(problem, "cpsat", replace(OPTS, warm_start=False), gpu=gpu)
        assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
        if run.plan is not None:
            best = min(best, run.plan.period)
    return best


def cold(problem: PipelineProblem, method: str = "cpsat"):
    """The decomposition from no plan at all: every allocation goes through the master."""
    units = make_units(problem)
    return solve_benders(problem, method, OPTS, period=units.big_m() + 1.0, plan=None,
                         bound=lower_bound(problem), deadline=None)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_cold_decomposition_equals_brute_force(problem, strict):
    """Started without an incumbent, the loop finds and proves the brute-force optimum."""
    p = replace(problem, memory_model="strict") if strict else problem
    expected = brute_force(p)
    out = cold(p)
    assert not out.stop, out.report
    if math.isinf(expected):
        assert out.plan is None
        return
    assert out.plan is not None
    assert out.period == pytest.approx(expected, abs=1e-5)
    assert out.bound <= expected + 1e-9
    sim = simulate_pipeline(p, out.plan)
    assert sim.period == pytest.approx(out.period)
    assert sim.peak_memory <= p.memory_per_gpu
    for gpu, bound in out.cuts.items():  # every allocation's bound holds
        run = run_model(p, "cpsat", replace(OPTS, warm_start=False), gpu=list(gpu))
        if run.plan is not None:
            assert bound <= run.plan.period + 1e-9


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), method=st.sampled_from(["cpsat", "ilp"]))
def test_strategy_equals_full_model(problem, method):
    """Both strategies prove the same optimum (or infeasibility) and never exceed the DPs."""
    full = solve(problem, method, options=OPTS)
    ben = solve(problem, method, options=replace(OPTS, extra=BENDERS))
    assert ben.status is full.status, ben.report
    if full.status is not Status.OPTIMAL:
        return
    assert ben.objective == pytest.approx(full.objective, abs=1e-5)
    check(problem, ben)
    assert ben.bound <= ben.objective + 1e-9
    for name in ("contiguous", "madpipe"):
        other = solve(problem, name, options=OPTS)
        if other.status.has_plan:
            assert ben.objective <= other.objective + 1e-6


def chain_with_subproblems() -> PipelineProblem:
    """A chain where the master admits allocations that the subproblem must refute."""
    chain = thesis_chain([1, 3, 3, 1, 2], [4, 1, 1, 4, 3], [1, 1, 3, 3, 3, 1, 0], [1, 1, 3, 0, 0])
    return PipelineProblem(chain, 3, 25, chain_bandwidth=2.0)


def test_subproblems_run_and_agree():
    """The loop evaluates allocations (not only the master) and ends at the optimum."""
    problem = chain_with_subproblems()
    out = cold(problem)
    assert out.cuts, out.report
    assert out.report["benders_allocations"] == len(out.cuts) >= 3
    for method in ("cpsat", "ilp"):  # brute force over its 41 allocations: the hypothesis test
        full = solve(problem, method, options=OPTS)
        assert full.status is Status.OPTIMAL
        assert out.period == pytest.approx(full.objective, abs=1e-5)
    assert out.bound <= out.period + 1e-9


def test_stopped_run_keeps_a_valid_bound_and_plan():
    """A deterministic work limit stops phase 1: phase 2's bound stays below the optimum."""
    problem = chain_with_subproblems()
    optimum = solve(problem, "cpsat", options=OPTS).objective
    units = make_units(problem)
    limited = replace(OPTS, deterministic_time=1e-3)
    out = solve_benders(problem, "cpsat", limited, period=units.big_m() + 1.0, plan=None,
                        bound=lower_bound(problem), deadline=None)
    assert out.stop, out.report  # the limit stopped phase 1 (it proves without it)
    assert out.report["benders_phase1_stopped"] == out.stop
    assert lower_bound(problem) <= out.bound <= optimum + 1e-9
    if out.plan is not None:
        sim = simulate_pipeline(problem, out.plan)
        assert sim.peak_memory <= problem.memory_per_gpu
        assert optimum - 1e-9 <= sim.period == pytest.approx(out.period)
    # through the facade: the short full-model run first, then the loop; a replayed plan
    r = solve(problem, "cpsat", options=replace(limited, extra=BENDERS))
    assert r.status.has_plan, r.report
    check(problem, r)
    assert "full_model" in r.report and r.report["strategy"] == "benders"
    assert r.bound <= optimum + 1e-9 <= r.objective + 2e-9


def test_unknown_strategy_is_an_input_error():
    problem = chain_with_subproblems()
    with pytest.raises(OptmemInputError, match="strategy"):
        solve(problem, "cpsat", options=replace(OPTS, extra={"strategy": "magic"}))


def test_failing_engine_returns_the_incumbent(monkeypatch):
    """An engine that fails inside the loop never crashes the solve: the incumbent, replayed."""
    from optmem.engines import adapters

    problem = chain_with_subproblems()
    monkeypatch.setattr(adapters, "solve_cpsat", lambda *a, **k: adapters.failed_result(
        "cpsat", "engine exploded"))
    r = solve(problem, "cpsat", options=replace(OPTS, extra=BENDERS))
    assert r.status is Status.FEASIBLE, r.report
    check(problem, r)
    assert "engine exploded" in r.report["benders_error"]
    assert r.report["source"] == "contiguous 1F1B*"
    assert r.bound == pytest.approx(lower_bound(problem))
