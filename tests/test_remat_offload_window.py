"""``extra["relaxation_window"]``: the relaxation's re-solves get the proven bound as a floor
(lazy host rounds, Benders masters) and the Benders masters the incumbent as a cut-off
(:func:`optmem.solvers.remat_offload_benders._window`, ``_lazy_host``'s ``floor``).

Checked against brute force (hypothesis, derandomised, ``L <= 2``) and the monolithic
model's proven optimum (CP-SAT, deterministic time) on 3-4-stage chains; two deliberately
wrong versions (the floor scaled up) must fail the same checks. Deterministic: CP-SAT runs
with a deterministic-time limit and a fixed seed, the loops with an iteration cap, HiGHS to
optimality; no verdict depends on wall-clock time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import BENDERS, OPTS, brute_optimum, check, limits
from test_remat_offload_exact import tiny, tiny_with_idle_ops

import optmem.solvers.remat_offload_exact as exact
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.models.formulation import Model
from optmem.plan import parse_mixed_plan
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers import remat_offload_benders as bd
from optmem.solvers.facade import solve

pytest.importorskip("ortools", reason="the Benders subproblem uses OR-Tools CP-SAT")

SEEDED = OPTS.with_(seed=1)
ROWS = {"relaxation_read_deadlines": True, "relaxation_cumulative_reads": True}
WINDOW = {**ROWS, "relaxation_window": True}


def _optimum(problem: RematOffloadProblem) -> float:
    full = solve(problem, "cpsat", options=SEEDED.with_(deterministic_time=60.0))
    assert full.status is Status.OPTIMAL, full.report
    return full.objective


_OPTIMA: dict[tuple[int, int], float] = {}


def _instances() -> Iterator[tuple[RematOffloadProblem, float]]:
    """4-stage chains at their three limits, bandwidth 1, with their proven optima."""
    for seed in range(3):
        chain = random_chain(4, seed=seed, max_size=6)
        for limit in limits(chain):
            problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
            if (seed, limit) not in _OPTIMA:
                _OPTIMA[seed, limit] = _optimum(problem)
            yield problem, _OPTIMA[seed, limit]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_floored_lazy_stage_never_exceeds_the_brute_optimum(chain: Chain, limit: int,
                                                            beta: float) -> None:
    """The lazy host stage with the floor rows: at most brute force's optimum, and never
    below the same stage without them."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    floored = exact._relaxation_bound(chain, limit, beta, 1, OPTS.with_(extra=WINDOW),
                                      "cpsat")
    plain = exact._relaxation_bound(chain, limit, beta, 1, OPTS.with_(extra=ROWS), "cpsat")
    if brute.status.has_plan:
        assert floored.bound <= brute.objective + 1e-6
        assert floored.bound >= plain.bound - 1e-6


def _lazy_bounds_valid(scale: Callable[[float], float], monkeypatch: pytest.MonkeyPatch
                       ) -> tuple[bool, int]:
    """Whether the floored lazy stage stays at most the proven optimum on every instance,
    with the floor passed through ``scale``; and how many rounds ran."""
    real = exact._lazy_host

    def scaled(*args, floor: float = -math.inf, **kwargs):
        return real(*args, floor=scale(floor) if math.isfinite(floor) else floor, **kwargs)

    monkeypatch.setattr(exact, "_lazy_host", scaled)
    valid, rounds = True, 0
    for problem, optimum in _instances():
        relaxed = exact._relaxation_bound(problem.chain, problem.memory_limit, 1.0, 1,
                                          OPTS.with_(extra=WINDOW), "cpsat")
        rounds += relaxed.info.get("host_rounds", 0)
        valid = valid and relaxed.bound <= optimum + 1e-6
    monkeypatch.setattr(exact, "_lazy_host", real)
    return valid, rounds


def test_floored_lazy_stage_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the 4-stage chains the floored lazy stage is at most the proven optimum (with
    rounds run), and the same check fails for a floor scaled up by a half (not a proven
    bound): the check can see a wrong floor."""
    valid, rounds = _lazy_bounds_valid(lambda f: f, monkeypatch)
    assert valid and rounds >= 1
    wrong, _ = _lazy_bounds_valid(lambda f: 1.5 * f, monkeypatch)
    assert not wrong




@settings(max_examples=20, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_windowed_benders_equals_brute(chain: Chain, limit: int, beta: float) -> None:
    """``strategy=benders`` with the window and no warm-up (the loop does the work) equals
    brute force on tiny chains."""
    assert_benders_equals_brute(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                {"relaxation_window": True})


def assert_benders_equals_brute(problem: RematOffloadProblem, extra: dict) -> None:
    """``strategy=benders`` with ``extra`` and no warm-up: brute force's status and value,
    ``optimal`` where there is a plan, every plan replayed (:func:`check`)."""
    optimum = brute_optimum(problem)
    res = solve(problem, "cpsat", options=BENDERS.with_(
        extra={**BENDERS.extra, **extra, "benders_warmup": 0}))
    check(problem, res, optimum=optimum)
    assert res.status.has_plan == (optimum is not None)
    if optimum is not None:
        assert res.status is Status.OPTIMAL, res.report
        assert res.objective == pytest.approx(optimum)


def assert_stopped_loops_valid(extra: dict) -> None:
    """Loops with ``extra`` stopped after 2 and 4 iterations (:func:`_windowed_loops`): the
    bound at most the proven optimum, a plan replays to its objective, ``optimal`` only at
    the optimum."""
    for iterations in (2, 4):
        for problem, optimum, res in _windowed_loops(iterations, extra):
            check(problem, res, optimum=optimum)
            if res.status is Status.OPTIMAL:
                assert res.objective == pytest.approx(optimum)


def _windowed_loops(iterations: int, extra: dict | None = None
                    ) -> Iterator[tuple[RematOffloadProblem, float, object]]:
    """The loop on each 4-stage instance from the persistent checkpoint plan (an incumbent
    above the optimum where offloading helps), no warm-up, ``iterations`` at most; with
    ``extra`` (default :data:`WINDOW`) as its options."""
    from optmem.models.remat_offload import build_remat_offload
    from optmem.solvers.remat_offload import discretized
    from optmem.solvers.remat_offload_exact import cpsat_time_scale

    for problem, optimum in _instances():
        disc, beta = discretized(problem, OPTS)
        scale, exact_grid = cpsat_time_scale(disc.chain, beta)
        assert exact_grid
        start = solve(problem, "remat_only", options=OPTS)
        incumbent = (start.objective, tuple(parse_mixed_plan(start.plan))) \
            if start.status.has_plan else None
        report: dict = {}
        res = bd.solve_benders(problem, SEEDED.with_(extra={
            **(WINDOW if extra is None else extra), "benders_iterations": iterations}),
            built=build_remat_offload(disc.chain, disc.memory_limit, beta), scale=scale,
            incumbent=incumbent, report=report)
        yield problem, optimum, res


def test_windowed_loop_bounds_are_valid() -> None:
    """Loops stopped after 2-4 iterations (the first windowed master is the second): the
    bound is at most the proven optimum, a plan replays to its objective, ``optimal`` only
    at the optimum; at 4 iterations some instance is proven by the window or the loop."""
    proven = 0
    for iterations in (2, 4):
        for problem, optimum, res in _windowed_loops(iterations):
            check(problem, res, optimum=optimum)
            assert res.bound <= optimum + 1e-6
            if res.status is Status.OPTIMAL:
                assert res.objective == pytest.approx(optimum)
                proven += iterations == 4
            assert "window_proofs" in res.report["benders"]
    assert proven >= 1


def _stale_bounds_valid(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per instance: the stopped loop's bound at most the proven optimum, with the loop's
    better plans not taken (the incumbent stays the persistent checkpoint plan, above the
    optimum on 5 of the 8 instances: the window's cut-off then lies above the optimum)."""
    monkeypatch.setattr(bd, "_improve", lambda loop, plan: None)
    out = []
    for problem, optimum, res in _windowed_loops(3):
        check(problem, res)
        out.append(res.bound <= optimum + 1e-6)
    return out


def test_window_with_a_stale_incumbent_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(_stale_bounds_valid(monkeypatch))


def test_wrong_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window whose floor is not a proven bound (the loop's bound scaled up by a half)
    reports a bound above the proven optimum on some instance: the check above sees it."""
    real = bd._window

    def wrong(master: Model, theta: int, bound: float, makespan: float, scale: int) -> Model:
        return real(master, theta, 1.5 * bound, makespan, scale)

    monkeypatch.setattr(bd, "_window", wrong)
    assert not all(_stale_bounds_valid(monkeypatch))
