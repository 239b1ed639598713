"""The remat + offload ``cpsat`` solve keeps to its time limit, and ``strategy=benders`` runs
on the rounded time grid with bounds valid in the original units (``ro17``).

* Time: one :class:`~optmem.solvers.time_budget.Deadline` per solve caps every engine call.
  Checked on an injected clock that advances only when an engine is called, by the whole
  time limit the engine was given (the worst case: every engine runs to its limit), while
  the real engines run with deterministic limits: the clock never passes the time limit
  and every call gets a limit. No verdict depends on wall-clock time.
* Grid: chains whose durations lie on no coarse grid, with the grid forced to ``1 / 10``
  (rounded, ``exact = False``): the Benders strategy really runs (``report.strategy``),
  its bound is never above brute force's optimum (hypothesis, derandomised, ``L <= 2``)
  nor the proven optimum of 3-stage chains on their exact grid; the deliberately wrong
  version (the rounded grid treated as exact: bounds lifted to it, refutations proving
  the incumbent) reports a bound above the optimum on a fixed chain.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from json_helpers import timeless
from remat_offload_helpers import OPTS, brute_optimum, check, limits

import optmem.solvers.remat_offload_exact as exact
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.engines import adapters
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers import remat_offload_benders as bd
from optmem.solvers.facade import solve
from optmem.solvers.time_budget import Deadline

pytest.importorskip("ortools", reason="the exact remat-offload model runs on CP-SAT")

COARSE = 10  # the forced rounded grid of the grid tests


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _greedy_engines(monkeypatch: pytest.MonkeyPatch, clock: _Clock) -> list[tuple[str, Any]]:
    """Every engine call runs for real and then "takes" its whole time limit on ``clock``,
    every model emission :data:`EMIT_S` (more than the deadline's margin: a limit computed before
    the emission overran).

    Returns the list of ``(engine, time limit given)``."""
    calls: list[tuple[str, Any]] = []
    real_pulp, real_cpsat = adapters.solve_pulp, adapters.solve_cpsat

    def pulp(*args: Any, time_limit_s: float | None = None, **kwargs: Any) -> Any:
        calls.append(("pulp", time_limit_s))
        out = real_pulp(*args, time_limit_s=None, **kwargs)
        clock.now += time_limit_s or 0.0
        return out

    def cpsat(*args: Any, time_limit_s: float | None = None, **kwargs: Any) -> Any:
        calls.append(("cpsat", time_limit_s))
        out = real_cpsat(*args, time_limit_s=None, **kwargs)
        clock.now += time_limit_s or 0.0
        return out

    monkeypatch.setattr(adapters, "solve_pulp", pulp)
    monkeypatch.setattr(adapters, "solve_cpsat", cpsat)
    for module in (exact, bd):  # an emission takes a second (3-5 s on ResNet-50)
        for name in ("to_pulp", "to_cpsat"):
            monkeypatch.setattr(module, name, _slow(getattr(module, name), clock, EMIT_S))
    real_start = Deadline.start.__func__  # type: ignore[attr-defined]

    def start(cls: type, limit_s: float | None, **kwargs: Any) -> Deadline:
        return real_start(cls, limit_s, **{**kwargs, "clock": clock})

    monkeypatch.setattr(Deadline, "start", classmethod(start))
    return calls


EMIT_S = 3.0  # the injected clock's seconds per model emission: above the 2 s margin


def _slow(emit: Any, clock: _Clock, seconds: float) -> Any:
    def slow(*args: Any, **kwargs: Any) -> Any:
        clock.now += seconds
        return emit(*args, **kwargs)

    return slow


def _chain() -> Chain:
    return Chain.from_lists([2, 3, 1, 2], [3, 4, 2, 3], [3, 2, 4, 2], [5, 4, 6, 3],
                            input_size=2, loss_bwd_time=1)


@pytest.mark.parametrize("limit_s", [3.0, 10.0, 60.0, 300.0])
@pytest.mark.parametrize("extra", [{}, {"strategy": "benders"},
                                   {"strategy": "benders", "benders_warmup": 0.0}],
                         ids=["full", "benders", "benders-no-warmup"])
def test_every_engine_call_keeps_within_the_time_limit(monkeypatch: pytest.MonkeyPatch,
                                                       limit_s: float,
                                                       extra: dict[str, Any]) -> None:
    """Engines that run to their limits never take the solve past ``time_limit_s``: each
    call is given what is left of the solve's deadline (at most), a stage with less than
    the engine's least time left is skipped, and the result is the best verified plan."""
    clock = _Clock()
    calls = _greedy_engines(monkeypatch, clock)
    chain = _chain()
    problem = RematOffloadProblem(chain, 16, chain_bandwidth=1.0)
    began = clock.now
    opts = OPTS.with_(seed=1, time_limit_s=limit_s, deterministic_time=2.0, node_limit=200,
                      extra=extra)
    res = solve(problem, "cpsat", options=opts)
    assert calls or limit_s < 10, "no engine was called"  # 3 s: the emissions take it
    assert all(limit is not None and limit > 0 for _, limit in calls), calls
    assert clock.now - began <= limit_s, (clock.now - began, calls)
    check(problem, res, opts)
    assert res.status.has_plan  # the candidate plans at least


def test_the_overrun_before_this_fix_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails for the old plumbing: stages given their shares of the time
    limit from their own starting points (here: a deadline that never caps) add up past it.
    """
    clock = _Clock()
    calls = _greedy_engines(monkeypatch, clock)
    monkeypatch.setattr(Deadline, "start", classmethod(lambda cls, limit_s, **kw: cls(None)))
    problem = RematOffloadProblem(_chain(), 16, chain_bandwidth=1.0)
    began = clock.now
    solve(problem, "cpsat", options=OPTS.with_(seed=1, time_limit_s=60.0,
                                               deterministic_time=2.0, node_limit=200,
                                               extra={"strategy": "benders"}))
    assert calls
    assert clock.now - began > 60.0


def test_a_spent_deadline_skips_the_relaxation() -> None:
    """``_relaxation_bound`` with no time left starts no stage."""
    clock = _Clock()
    deadline = Deadline.start(10.0, clock=clock, margin=0.0)
    clock.now += 9.5
    chain = _chain()
    relaxed = exact._relaxation_bound(chain, 16, 1.0, 1, OPTS.with_(time_limit_s=100.0),
                                      "cpsat", clock=clock, deadline=deadline)
    assert relaxed.info["plain_bound"] == "skipped (time)"
    assert relaxed.master is None


# ------------------------------------------------------------------ the rounded grid
FRACTIONS = (0.0, 0.13, 0.37, 0.71)  # durations off the 1/10 grid


@st.composite
def off_grid(draw: st.DrawFn, max_length: int = 2) -> Chain:
    """Tiny chains (as ``tiny`` of test_remat_offload_exact) with durations off 1/10."""
    n = draw(st.integers(1, max_length))
    out = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    extra = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))

    def times(lo: int, hi: int) -> list[float]:
        whole = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
        return [w + draw(st.sampled_from(FRACTIONS)) for w in whole]

    return Chain.from_lists(times(1, 4), times(1, 6), out,
                            [o + e for o, e in zip(out, extra, strict=True)],
                            input_size=draw(st.integers(1, 4)),
                            loss_bwd_time=draw(st.integers(0, 2)) + draw(
                                st.sampled_from(FRACTIONS)))


def _force_grid(monkeypatch: pytest.MonkeyPatch, exact_flag: bool = False) -> None:
    """CP-SAT's grid forced to ``1 / COARSE`` (``exact_flag``: wrongly declared exact)."""
    monkeypatch.setattr(exact, "cpsat_time_scale", lambda chain, beta: (COARSE, exact_flag))


ROUNDED_BENDERS = OPTS.with_(seed=1, deterministic_time=5.0,
                             extra={"strategy": "benders", "benders_work": 5.0,
                                    "benders_iterations": 8, "benders_warmup": 0.0})


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=off_grid(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_benders_on_the_rounded_grid_never_bounds_above_brute(chain: Chain, limit: int,
                                                              beta: float) -> None:
    """``strategy=benders`` runs on the rounded grid (no fallback to ``full``); its bound
    is at most brute force's optimum, its plan replays, ``optimal`` only at the optimum."""
    with pytest.MonkeyPatch.context() as mp:
        _force_grid(mp)
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        res = solve(problem, "cpsat", options=ROUNDED_BENDERS)
    optimum = brute_optimum(problem)
    check(problem, res, ROUNDED_BENDERS, optimum=optimum)
    assert res.status.has_plan == (optimum is not None)
    if res.status is Status.INFEASIBLE:
        return
    assert res.report["exact_times"] is False
    assert str(res.report.get("strategy", "benders")).startswith("benders")
    assert optimum is not None and res.objective >= optimum - 1e-9


def _three_stage() -> list[RematOffloadProblem]:
    """3-stage chains with durations in hundredths (exact grid 1/100, off the 1/10 grid)."""
    chains = [Chain.from_lists([1.37, 2.71, 1.13], [2.13, 3.37, 1.71], [3, 2, 4], [5, 3, 6],
                               input_size=2, loss_bwd_time=0.37),
              Chain.from_lists([2.71, 1.13, 1.37], [1.71, 2.37, 3.13], [2, 4, 3], [4, 6, 4],
                               input_size=3, loss_bwd_time=0.71)]
    return [RematOffloadProblem(chain, m, chain_bandwidth=1.0)
            for chain in chains for m in limits(chain)[:2]]


@pytest.mark.parametrize("index", range(4))
def test_benders_on_the_rounded_grid_never_bounds_above_the_exact_optimum(
        monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """3-stage chains: the optimum proven on the exact grid (1/100) bounds the rounded
    Benders' bound from above and its plan from below."""
    problem = _three_stage()[index]
    proven = solve(problem, "cpsat", options=OPTS.with_(seed=1, deterministic_time=60.0))
    assert proven.status is Status.OPTIMAL
    _force_grid(monkeypatch)
    res = solve(problem, "cpsat", options=ROUNDED_BENDERS)
    check(problem, res, ROUNDED_BENDERS, optimum=proven.objective)
    assert res.report["strategy"] == "benders"
    assert res.objective >= proven.objective - 1e-9


_PROVEN: dict[int, float] = {}  # the proven optima of _stale_rounded_loops' instances


def _stale_rounded_loops(exact_flag: bool) -> list[tuple[RematOffloadProblem, float, Any]]:
    """The loop on the rounded grid (durations rounded down to ``1 / COARSE``) from the
    persistent checkpoint plan, its better plans not taken (an incumbent above the optimum
    where offloading helps), 6 iterations at most; with the proven optimum (exact grid).
    ``exact_flag``: the wrong version, the rounded grid treated as exact (bounds lifted to
    it, a refutation taken to prove the incumbent's makespan)."""
    from optmem.models.remat_offload import build_remat_offload
    from optmem.plan import parse_mixed_plan
    from optmem.solvers.remat_offload import discretized

    out = []
    for k, problem in enumerate(_three_stage() + _four_stage()):
        if k not in _PROVEN:
            proven = solve(problem, "cpsat", options=OPTS.with_(seed=1, deterministic_time=60.0))
            assert proven.status is Status.OPTIMAL
            _PROVEN[k] = proven.objective
        disc, beta = discretized(problem, OPTS)
        start = solve(problem, "remat_only", options=OPTS)
        incumbent = (start.objective, tuple(parse_mixed_plan(start.plan))) \
            if start.status.has_plan else None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bd, "_improve", lambda loop, plan: None)
            res = bd.solve_benders(problem, OPTS.with_(seed=1, extra={
                "benders_iterations": 6, "benders_work": 5.0, "relaxation_window": True}),
                built=build_remat_offload(disc.chain, disc.memory_limit, beta, grid=COARSE),
                scale=COARSE, incumbent=incumbent, report={}, exact=exact_flag)
        out.append((problem, _PROVEN[k], res))
    return out


def _four_stage() -> list[RematOffloadProblem]:
    """4-stage random chains with durations moved off the 1/10 grid (hundredths)."""
    from optmem.datasets.synthetic import random_chain

    out = []
    for seed in range(2):
        base = random_chain(4, seed=seed, max_size=6)
        chain = Chain.from_lists([t + FRACTIONS[(i + seed) % 4] for i, t in
                                  enumerate(base.fwd_time)],
                                 [t + FRACTIONS[(i + seed + 1) % 4] for i, t in
                                  enumerate(base.bwd_time)],
                                 list(base.output_size), list(base.saved_size),
                                 input_size=base.input_size, loss_bwd_time=0.37)
        out += [RematOffloadProblem(chain, m, chain_bandwidth=1.0) for m in limits(chain)[:2]]
    return out


def test_rounded_loop_with_a_stale_incumbent_bounds_validly() -> None:
    """The rounded-grid loop's bound is at most the optimum proven on the exact grid."""
    for problem, optimum, res in _stale_rounded_loops(exact_flag=False):
        check(problem, res, OPTS, optimum=optimum)
        assert res.report["exact_times"] is False


def test_rounded_grid_taken_as_exact_is_caught() -> None:
    """The deliberately wrong version (``exact=True`` on the rounded grid) reports a bound
    above the proven optimum on some instance (or claims a plan above it optimal)."""
    wrong = []
    for _, optimum, res in _stale_rounded_loops(exact_flag=True):
        wrong.append(res.bound > optimum + 1e-6 or
                     (res.status is Status.OPTIMAL and res.objective > optimum + 1e-6))
    assert any(wrong)


# ------------------------------------------------------------------ the solve's work budget
@pytest.mark.parametrize(("strategy", "budget"), [("full", 0.33), ("benders", 0.8)])
def test_a_work_budget_gives_the_same_result_twice_with_a_valid_bound(strategy: str,
                                                                    budget: float) -> None:
    """``work_budget`` bounds the engine work of the whole solve, not of each call.

    A 5-stage chain whose solve needs several engine calls (HiGHS relaxation stages, the
    CP-SAT model; Benders masters on HiGHS and subproblems on CP-SAT). The budget covers
    the HiGHS calls (0.28 deterministic seconds, 14 limit checks, for ``full``; 0.74 for
    ``benders``; ``milpbudget``: before, HiGHS was not charged and the budget was 0.01) and
    stops a CP-SAT call: the same JSON twice (timings aside), the work used within the
    budget plus the last call's overshoot, a replayed plan whose bound is at most the
    optimum proven without a budget, and ``optimal`` only where the bound meets the plan.
    """
    problem = RematOffloadProblem(random_chain(5, seed=0), 48, chain_bandwidth=1.0)
    opts = OPTS.with_(threads=1, seed=1, deterministic_time=1.0,
                      extra={"strategy": strategy})
    proven = solve(problem, "cpsat", options=opts)
    assert proven.status is Status.OPTIMAL
    first = solve(problem, "cpsat", options=opts.with_(work_budget=budget))
    again = solve(problem, "cpsat", options=opts.with_(work_budget=budget))
    assert timeless(first) == timeless(again)
    check(problem, first, opts, optimum=proven.objective)
    report = first.report
    assert report["work_exhausted"] is True and report["work_calls"] >= 1
    assert report["work_cut_calls"] >= 1 and report["work_milp_used"] > 0
    assert budget <= report["work_used"] <= budget * 1.1
    if strategy == "full":  # the budget ends the search above the optimum: not proven
        assert first.status is Status.FEASIBLE and first.objective > proven.objective
    roomy = solve(problem, "cpsat", options=opts.with_(work_budget=100.0))
    assert roomy.status is Status.OPTIMAL and roomy.objective == proven.objective
    assert roomy.report["work_exhausted"] is False


def test_benders_stops_at_the_first_subproblem_the_spent_budget_skips(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A subproblem the spent work budget does not run gives no cut, so the master would
    propose the same sequence again, each master a HiGHS solve the budget does not bound:
    before stop 53's fix the loop ran to its iteration cap (40 here; none by default: the
    `unet` solve with ``--work-budget 5`` ran for more than 20 minutes). Now it stops at the
    first skipped subproblem with the plan and bound it holds. (Since ``milpbudget`` the
    masters are charged too, and a master the budget cuts ends the loop first; here they
    run outside the budget so that the subproblem path is the one tested.)"""
    from optmem.models.remat_offload import build_remat_offload
    from optmem.plan import parse_mixed_plan
    from optmem.solvers.remat_offload import discretized

    problem = _three_stage()[1]
    disc, beta = discretized(problem, OPTS)
    start = solve(problem, "remat_only", options=OPTS)
    incumbent = (start.objective, tuple(parse_mixed_plan(start.plan)))
    monkeypatch.setattr(bd, "_improve", lambda loop, plan: None)  # keep the loop going
    real_pulp = adapters.solve_pulp

    def unbudgeted(*args: Any, **kwargs: Any) -> Any:
        token = adapters._BUDGET.set(None)
        try:
            return real_pulp(*args, **kwargs)
        finally:
            adapters._BUDGET.reset(token)

    monkeypatch.setattr(adapters, "solve_pulp", unbudgeted)
    with adapters.work_budget(1e-6) as budget:
        res = bd.solve_benders(problem, OPTS.with_(seed=1, extra={
            "benders_iterations": 40, "benders_work": 5.0}),
            built=build_remat_offload(disc.chain, disc.memory_limit, beta, grid=COARSE),
            scale=COARSE, incumbent=incumbent, report={}, exact=False)
    assert budget is not None and budget.exhausted
    assert budget.skipped_calls == 1 and res.report["benders"]["iterations"] < 40
    check(problem, res, OPTS)
    assert res.status is Status.FEASIBLE and res.objective == start.objective


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
@pytest.mark.parametrize("limit_s", [0.05, 1.0, 2.0])
def test_a_short_limit_still_runs_the_search(monkeypatch: pytest.MonkeyPatch, method: str,
                                             limit_s: float) -> None:
    """A limit of at most 2 s left at most 1 s after the deadline's margin, and the search
    asked for :data:`LEAST_ENGINE_TIME_S` (1 s): it was skipped even at L = 1 without a warm
    start (``no_solution``, stop 76). On a clock that never moves (engines run for real,
    without their limits) the search now runs, within what the deadline leaves, and proves
    the brute-force optimum."""
    clock = _Clock()
    calls: list[Any] = []
    for name in ("solve_pulp", "solve_cpsat"):
        real = getattr(adapters, name)

        def unlimited(*args: Any, time_limit_s: float | None = None, _real: Any = real,
                      **kwargs: Any) -> Any:
            calls.append(time_limit_s)
            return _real(*args, time_limit_s=None, **kwargs)

        monkeypatch.setattr(adapters, name, unlimited)
    real_start = Deadline.start.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Deadline, "start", classmethod(
        lambda cls, limit, **kw: real_start(cls, limit, **{**kw, "clock": clock})))
    chain = random_chain(1, seed=72, max_size=4, integer_times=False)
    problem = RematOffloadProblem(chain, chain.store_all_peak(), chain_bandwidth=3.0)
    optimum = brute_optimum(problem)
    res = solve(problem, method, options=OPTS.with_(time_limit_s=limit_s, warm_start=False))
    assert res.report.get("search") != "skipped (time)"
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(optimum)
    assert calls and all(0 < limit <= limit_s / 2 for limit in calls), calls
    check(problem, res)
