"""A link relaxation with no point proves the remat + offload model infeasible (stop 72).

``ilp`` and ``cpsat`` answer ``infeasible`` as soon as the relaxation's plain stage, solved
again at the class horizon (a makespan no plan of the class exceeds), has no point, with no
search; before, the search went on (``ilp`` on ResNet-18 at 60 % of its store-all peak ran
more than 12 minutes without a verdict). Checked here against brute force, against the
model's own horizon, and against engines that are wrong.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import OPTS, check

from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.engines.adapters import EngineResult
from optmem.models.remat_offload import build_remat_offload, class_horizon
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers import remat_offload_exact as exact
from optmem.solvers.facade import solve

pytest.importorskip("ortools", reason="the exact remat-offload model uses OR-Tools CP-SAT")

NOTE = "the link relaxation has no point"
EXAMPLE = Chain.from_lists([2, 2, 2], [4, 4, 4], [2, 2, 2], [4, 4, 4], input_size=2)


def _by_relaxation(res: Any) -> bool:
    return NOTE in str(res.report.get("note"))


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_limits_up_to_the_first_feasible_one_agree_with_brute_force(method: str) -> None:
    """Every limit from 1 up to the least one brute force finds a plan at, on 2-stage chains:
    the method is ``infeasible`` exactly where brute force has no plan, and the relaxation
    proves some of those limits (the path is taken, not only the older checks)."""
    by_relaxation = infeasible = 0
    for seed, beta in ((0, 0.5), (1, 2.0), (2, 0.5), (3, 2.0), (4, 1.0)):
        chain = random_chain(2, seed=seed, max_size=8)
        for limit in range(1, chain.store_all_peak() + 1):
            problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
            res = solve(problem, method, options=OPTS)
            brute = solve(problem, "brute", options=OPTS)
            assert brute.status is not Status.ERROR
            check(problem, res, optimum=brute.objective if brute.status.has_plan else None)
            assert (res.status is Status.INFEASIBLE) == (not brute.status.has_plan), \
                (seed, beta, limit, res.status, brute.status)
            infeasible += res.status is Status.INFEASIBLE
            by_relaxation += _by_relaxation(res)
            if brute.status.has_plan:
                break
    assert 0 < by_relaxation <= infeasible


@settings(max_examples=30, deadline=None, derandomize=True)
@given(length=st.integers(1, 3), seed=st.integers(0, 10_000), limit=st.integers(1, 30),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_an_empty_relaxation_is_an_empty_class(length: int, seed: int, limit: int,
                                               beta: float) -> None:
    """Where the relaxation proves the limit infeasible, no method finds a plan and the
    model itself (CP-SAT, no relaxation) is infeasible too."""
    chain = random_chain(length, seed=seed, max_size=8)
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    res = solve(problem, "ilp", options=OPTS)
    check(problem, res)
    if not _by_relaxation(res):
        return
    assert res.status is Status.INFEASIBLE
    assert "engine_status" not in res.report  # answered with no search
    alone = solve(problem, "cpsat", options=OPTS.with_(extra={"relaxation": False}))
    assert alone.status is Status.INFEASIBLE, alone.report
    for name in ("dp", "remat_only", "offload_only", "opportunist", "autocapper"):
        assert not solve(problem, name, options=OPTS).status.has_plan, name


@settings(max_examples=25, deadline=None, derandomize=True)
@given(length=st.integers(1, 4), seed=st.integers(0, 10_000), sweeps=st.integers(1, 2),
       per_gap=st.integers(1, 2), beta=st.sampled_from([0.0, 0.5, 3.0]))
def test_class_horizon_is_the_models_horizon(length: int, seed: int, sweeps: int,
                                             per_gap: int, beta: float) -> None:
    chain = random_chain(length, seed=seed, max_size=8)
    limit = chain.store_all_peak()
    built = build_remat_offload(chain, limit, beta, sweeps=sweeps, transfers_per_gap=per_gap)
    assert class_horizon(chain, limit, beta, sweeps=sweeps, transfers_per_gap=per_gap) == \
        pytest.approx(built.horizon, rel=1e-12)


def test_resnet18_at_60_percent_is_proven_without_a_search() -> None:
    """The instance that ran unbounded: the plain stage has no point (0.1 s)."""
    from optmem.datasets import load_dataset

    problem = RematOffloadProblem(load_dataset("resnet18-b64-224"), "60%", bandwidth="12GB/s")
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=OPTS.with_(time_limit_s=600))
        assert res.status is Status.INFEASIBLE, (method, res.report)
        assert _by_relaxation(res) and "engine_status" not in res.report
        assert res.report["relaxation"]["infeasible"].startswith(
            "the plain stage has no point at the class horizon")


def _relaxation_says_infeasible(monkeypatch: pytest.MonkeyPatch, calls: int) -> list[int]:
    """The first ``calls`` relaxation solves answer ``infeasible`` (a wrong engine)."""
    real = exact.engines.solve_pulp
    seen = [0]

    def wrong(problem: Any, variables: Any, engine: str = "highs", **kw: Any) -> EngineResult:
        if problem.name == "remat_offload_relaxation":
            seen[0] += 1
            if seen[0] <= calls:
                return EngineResult(Status.INFEASIBLE, None, math.inf, math.inf, engine, 0.0,
                                    "infeasible")
        return real(problem, variables, engine, **kw)

    monkeypatch.setattr(exact.engines, "solve_pulp", wrong)
    return seen


@pytest.mark.parametrize("strategy", ["full", "benders"])
def test_a_wrong_verdict_with_a_replaying_candidate_is_not_taken(
        monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    """The relaxation (stage and confirmation) says infeasible where the DP's plan fits:
    an engine fault, reported; the solve goes on to the proven optimum (22)."""
    _relaxation_says_infeasible(monkeypatch, calls=2)
    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    opts = OPTS.with_(seed=1, extra={"strategy": strategy, "benders_work": 30.0})
    res = solve(problem, "cpsat", options=opts)
    check(problem, res)
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(22)
    assert "replays" in res.report["relaxation"]["engine_error"]


def test_an_unconfirmed_stage_verdict_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage says infeasible, the confirmation at the class horizon does not: no early
    answer, no bound from the relaxation, the same optimum."""
    seen = _relaxation_says_infeasible(monkeypatch, calls=1)
    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    res = solve(problem, "cpsat", options=OPTS)
    check(problem, res)
    assert seen[0] == 2  # the stage, then its confirmation; no later stage
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(22)
    assert res.report["relaxation"]["infeasible"].startswith("not confirmed")
    assert "engine_error" not in res.report["relaxation"]


def test_a_confirmed_verdict_without_a_candidate_is_taken(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The early answer rests on the confirmation: with no candidate plan to contradict it,
    a (wrongly) empty relaxation answers ``infeasible`` at once. This is why the candidates
    are checked: here, with the DPs' plans removed, nothing else could catch it."""
    _relaxation_says_infeasible(monkeypatch, calls=2)
    monkeypatch.setattr(exact, "_candidates", lambda *args, **kwargs: [])
    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    res = solve(problem, "ilp", options=OPTS)
    assert res.status is Status.INFEASIBLE and _by_relaxation(res)


def _first_limit_by_relaxation() -> RematOffloadProblem:
    """The first 2-stage instance (seeds, then limits) the relaxation proves infeasible."""
    for seed in range(10):
        chain = random_chain(2, seed=seed, max_size=8)
        for limit in range(1, chain.store_all_peak() + 1):
            problem = RematOffloadProblem(chain, limit, chain_bandwidth=0.5)
            if _by_relaxation(solve(problem, "ilp", options=OPTS)):
                return problem
    raise AssertionError("no 2-stage limit is proven by the relaxation")


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``exact.<name>`` (a one-element list, updated in place)."""
    calls = [0]
    real = getattr(exact, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(exact, name, counted)
    return calls


@pytest.mark.parametrize("method, strategy", [("ilp", "full"), ("cpsat", "full"),
                                              ("cpsat", "benders")])
def test_the_model_is_not_built_when_the_relaxation_has_no_point(
        monkeypatch: pytest.MonkeyPatch, method: str, strategy: str) -> None:
    """Stop 73: the relaxation runs before the model's build, so an empty one answers
    without it (ResNet-50 at 25 %: the build was 5.5 of 13.6 s); a feasible limit builds it
    once and reaches the same optimum as brute force."""
    problem = _first_limit_by_relaxation()
    builds = _counted(monkeypatch, "build_remat_offload")
    opts = OPTS.with_(extra={"strategy": strategy}) if method == "cpsat" else OPTS
    res = solve(problem, method, options=opts)
    assert res.status is Status.INFEASIBLE and _by_relaxation(res) and builds[0] == 0
    assert "model" not in res.report
    if strategy == "benders":
        assert "link relaxation has no point" in res.report["strategy"]
    fits = RematOffloadProblem(problem.chain, problem.chain.store_all_peak(),
                               chain_bandwidth=0.5)
    res = solve(fits, method, options=opts)
    check(fits, res, optimum=solve(fits, "brute", options=OPTS).objective)
    assert builds[0] == 1 and res.report["model"]["variables"] > 0


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_under_a_time_limit_the_cheap_candidates_are_computed_once(
        monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """A solve under a time limit computes the checkpoint-only and offload-only plans first;
    an empty relaxation's check of its verdict reuses them (stop 74 computed them twice on
    that path: up to 5 s at L = 339). The verdict is the same as without a limit."""
    problem = _first_limit_by_relaxation()
    calls = _counted(monkeypatch, "_cheap_candidates")
    res = solve(problem, method, options=OPTS.with_(time_limit_s=600))
    assert res.status is Status.INFEASIBLE and _by_relaxation(res)
    assert calls[0] == 1
    calls[0] = 0
    res = solve(problem, method, options=OPTS)
    assert res.status is Status.INFEASIBLE and _by_relaxation(res) and calls[0] == 1


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_without_a_warm_start_the_cross_check_reuses_the_cheap_candidates(
        monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """Stop 76: without a warm start the engine's proof is checked against the cheap
    candidates (``_cross_check``); under a time limit the solve computed them first, and the
    check computed them again (up to 10 s at L = 339 under load). The answer is the same."""
    problem = RematOffloadProblem(random_chain(2, seed=4), random_chain(2, seed=4)
                                  .store_all_peak(), chain_bandwidth=0.5)
    cold = OPTS.with_(warm_start=False)
    calls = _counted(monkeypatch, "_cheap_candidates")
    res = solve(problem, method, options=cold.with_(time_limit_s=600))
    check(problem, res, optimum=solve(problem, "brute", options=OPTS).objective)
    assert res.report["cross_check"] is not None and calls[0] == 1
    calls[0] = 0
    unlimited = solve(problem, method, options=cold)
    assert unlimited.objective == res.objective and calls[0] == 1
