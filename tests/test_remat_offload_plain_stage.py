"""``extra["relaxation_plain"] = False``: the link relaxation starts at its deadline stage.

Not a new bound: the deadline stage's model is the plain stage's with more rows
(:func:`~optmem.models.remat_offload.build_link_relaxation`, ``deadlines=True``), so its
optimum is never below the plain one and, like every stage, at most the model's optimum;
skipping the plain stage only gives its time to the deadline stage. Checked: on tiny chains
(hypothesis, derandomised) the bound without the plain stage is the deadline stage's bound
with it, at least the plain bound and at most brute force's optimum; a deliberately wrong
version (the stage's bound scaled up by 5 %) fails the same check; on an injected clock the
deadline stage gets the first stage's budget (the plain stage's time is not spent), and
the report names the skipped stage. HiGHS to optimality or on a fake clock: no verdict
depends on the machine's load.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import BENDERS, OPTS, brute_optimum, check, limits
from test_remat_offload_exact import tiny

import optmem.solvers.remat_offload_exact as exact
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.engines import adapters
from optmem.errors import OptmemInputError
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers.facade import solve
from optmem.solvers.time_budget import Deadline

pytest.importorskip("highspy", reason="the link relaxation is solved by HiGHS")

NO_PLAIN = {"relaxation_plain": False, "relaxation_values": False}
WITH_PLAIN = {"relaxation_values": False}


def _bound(chain: Chain, limit: int, beta: float, extra: dict[str, Any]) -> exact._Relaxed:
    return exact._relaxation_bound(chain, limit, beta, 1, OPTS.with_(extra=extra), "cpsat")


def _valid(chain: Chain, limit: int, beta: float) -> exact._Relaxed:
    """The bound without the plain stage, checked at most brute force's optimum."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    skipped = _bound(chain, limit, beta, NO_PLAIN)
    if brute.status.has_plan:
        assert skipped.bound <= brute.objective + 1e-6, (skipped.bound, brute.objective)
    return skipped


def _check(chain: Chain, limit: int, beta: float) -> None:
    skipped = _valid(chain, limit, beta)
    full = _bound(chain, limit, beta, WITH_PLAIN)
    if not math.isfinite(full.bound):  # no link relaxation here (no plan, or infeasible)
        return
    assert skipped.info["plain_bound"] == "skipped (relaxation_plain false)"
    assert skipped.bound == pytest.approx(full.info["deadline_bound"], abs=1e-6)
    assert skipped.bound >= full.info["plain_bound"] - 1e-6


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_without_the_plain_stage_the_bound_is_the_deadline_stages(chain: Chain, limit: int,
                                                                  beta: float) -> None:
    """The bound without the plain stage is the deadline stage's (with it), never below
    the plain bound, never above brute force's optimum."""
    _check(chain, limit, beta)


# a chain, limit and link where the deadline stage is tight (its bound and the brute
# optimum are 17.67, the plain stage's 17)
TIGHT = (Chain.from_lists([3, 4], [6, 4], [3, 2], [3, 2], input_size=2,
                          fwd_overhead=[1, 0]), 10, 3.0)


def test_a_bound_scaled_up_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check with the stage's bound scaled up by 5 % (a wrong bound) fails."""
    chain, limit, beta = TIGHT
    _check(chain, limit, beta)
    real = exact._better

    def wrong(best: float, out: adapters.EngineResult) -> float:
        return 1.05 * real(best, out)

    monkeypatch.setattr(exact, "_better", wrong)
    with pytest.raises(AssertionError, match="17.6"):  # above the brute optimum 17.67
        _valid(chain, limit, beta)


def test_the_deadline_stage_gets_the_first_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that moves only by what each engine call is given, the deadline stage is
    the first call and gets the whole first budget (with the plain stage: what it left)."""
    now = [0.0]
    limits: list[float | None] = []
    real = adapters.solve_pulp

    def greedy(*args: Any, time_limit_s: float | None = None, **kwargs: Any) -> Any:
        limits.append(time_limit_s)
        out = real(*args, **kwargs)
        now[0] += 0.5 * (time_limit_s or 0.0)  # each stage takes half of its limit
        return out

    monkeypatch.setattr(adapters, "solve_pulp", greedy)
    chain, limit, beta = TIGHT
    opts = OPTS.with_(time_limit_s=100.0)
    for extra, expected in ((NO_PLAIN, [100.0]), (WITH_PLAIN, [100.0, 50.0])):
        limits.clear()
        relaxed = exact._relaxation_bound(chain, limit, beta, 1, opts.with_(
            extra={**extra, "relaxation_share": 1.0}), "cpsat", clock=lambda: now[0])
        assert limits == pytest.approx(expected), extra
        assert relaxed.out is not None and relaxed.out.status is Status.OPTIMAL


def test_bad_values_are_refused() -> None:
    chain, limit, beta = TIGHT
    with pytest.raises(OptmemInputError, match="relaxation_plain"):
        solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "cpsat",
              options=OPTS.with_(extra={"relaxation_plain": "no"}))


# ------------------------------------------------------------------ relaxation_first
FIRST = BENDERS.with_(extra={**BENDERS.extra, "relaxation_first": True,
                             "relaxation_plain": False, "relaxation_compact": True})


@settings(max_examples=20, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_benders_with_the_relaxation_first_agrees_with_brute(chain: Chain, limit: int,
                                                             beta: float) -> None:
    """``relaxation_first`` with the plain stage skipped (and compact rows): plan replayed,
    bound at most brute force's optimum, optimal = optimum."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    res = solve(problem, "cpsat", options=FIRST)
    check(problem, res, FIRST, optimum=brute_optimum(problem))


def test_the_ladder_runs_after_the_relaxation(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``relaxation_first`` the ladder's DP runs come after the relaxation's engine
    calls (before them without it); the report lists them either way."""
    chain = random_chain(4, seed=0, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=1.0)
    events: list[str] = []
    real_pofo, real_relax = exact.pofo_plan, exact._relaxation_bound

    def pofo(problem_, options, variant):  # type: ignore[no-untyped-def]
        events.append("dp" if "backlog_grid" in options.extra else "default dp")
        return real_pofo(problem_, options, variant)

    def relax(*args: Any, **kwargs: Any) -> exact._Relaxed:
        events.append("relaxation")
        return real_relax(*args, **kwargs)

    monkeypatch.setattr(exact, "pofo_plan", pofo)
    monkeypatch.setattr(exact, "_relaxation_bound", relax)
    for opts, order in ((BENDERS, ["default dp", "dp", "relaxation"]),
                        (FIRST, ["default dp", "relaxation", "dp"])):
        events.clear()
        res = solve(problem, "cpsat", options=opts)
        check(problem, res, opts)
        assert [e for i, e in enumerate(events) if e != "dp" or events[i - 1] != "dp"] == order
        assert "autocapper" in res.report["dp_ladder"]


def test_the_prior_skips_a_first_run_that_would_pass_the_deadline() -> None:
    """With ``prior`` (relaxation_first) the first DP run is predicted too: with 5 s left on a
    fake clock and a prior of 1 s per state nothing runs; without it the first one runs."""
    chain = random_chain(4, seed=0, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=1.0)
    near = Deadline(5.0, clock=lambda: 0.0)
    opts = OPTS.with_(extra={"dp_ladder": [[16, 8]]}, time_limit_s=300.0)
    notes: dict = {}
    assert exact._ladder_plans(problem, opts, near, notes, prior=1.0) == []
    assert notes == {"chapter 4 dp (grid 16, backlog_grid 8)": "skipped (time)"}
    notes.clear()
    assert len(exact._ladder_plans(problem, opts, near, notes)) == 1
