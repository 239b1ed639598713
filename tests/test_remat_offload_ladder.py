"""``extra["dp_ladder"]`` and ``extra["autocapper_candidate"]``: more candidate plans for
the exact remat + offload methods (:func:`optmem.solvers.remat_offload_exact._ladder_plans`).

The new plans are primal heuristics: they enter only through the simulator
(:func:`~optmem.solvers.remat_offload.best_candidate`), so no bound depends on them. Checked:
every candidate's value is its replay; the candidates with the ladder include the default
ones, so the fastest is never slower; the exact solves with them stay consistent with brute
force (hypothesis, derandomised, ``L <= 2``); a plan that does not replay (a deliberately
wrong ladder entry) never becomes a candidate nor the answer; with the deadline spent no DP
run starts (a fake clock, no wall-clock verdict); bad option values are refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import BENDERS, OPTS, brute_optimum, check, limits
from test_remat_offload_exact import tiny

import optmem.solvers.remat_offload as ro
import optmem.solvers.remat_offload_exact as exact
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError
from optmem.plan import Op, parse_mixed_plan, store_all_plan
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.simulate.offload import simulate_offload
from optmem.solvers.facade import solve
from optmem.solvers.time_budget import Deadline

pytest.importorskip("ortools", reason="the exact remat + offload methods use OR-Tools")

LADDER = {"dp_ladder": [[16, 8], [64, 32]], "autocapper_candidate": True}


def _problems() -> list[RematOffloadProblem]:
    """Random 5-stage chains at their three limits, two bandwidths."""
    out = []
    for seed in range(3):
        chain = random_chain(5, seed=seed, max_size=6)
        for limit in limits(chain):
            for beta in (0.5, 2.0):
                out.append(RematOffloadProblem(chain, limit, chain_bandwidth=beta))
    return out


@pytest.mark.parametrize("problem", _problems())
def test_ladder_candidates_replay_and_are_never_slower(problem: RematOffloadProblem) -> None:
    """Every candidate's value is its simulated makespan within the limit; the ladder's
    candidates include the default ones, so the fastest is never slower."""
    plain = exact._candidates(problem, OPTS)
    report: dict = {}
    more = exact._candidates(problem, OPTS.with_(extra=LADDER), report=report)
    disc, beta = ro.discretized(problem, OPTS)
    for value, _, plan in more:
        sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
        assert sim.makespan == pytest.approx(value)
        assert sim.peak_memory <= disc.memory_limit
    assert {label for _, label, _ in plain} <= {label for _, label, _ in more}
    if plain:
        assert more[0][0] <= plain[0][0] + 1e-12
    # one report entry per plan tried: its makespan, or why there is none
    assert set(report["dp_ladder"]) == {"autocapper", "chapter 4 dp (grid 16, backlog_grid 8)",
                                        "chapter 4 dp (grid 64, backlog_grid 32)"}


@pytest.mark.parametrize("opts", [OPTS.with_(extra=LADDER), BENDERS], ids=["full", "benders"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_solves_with_the_ladder_agree_with_brute(chain: Chain, limit: int, beta: float,
                                                 opts) -> None:
    """With the ladder (``full`` by option, ``benders`` by default) the exact solve is
    consistent: plan replayed, bound at most brute force's optimum, optimal = optimum."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    res = solve(problem, "cpsat", options=opts)
    check(problem, res, optimum=brute_optimum(problem))


def _bad_ladder(monkeypatch: pytest.MonkeyPatch) -> RematOffloadProblem:
    """A ladder whose DP 'plan' is store-all at a limit it does not fit (a wrong entry)."""
    chain = random_chain(5, seed=1, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=0.5)
    real = exact.pofo_plan

    def wrong(problem_: RematOffloadProblem, options, last: str):
        if options.extra.get("backlog_grid") == 8:
            return tuple(store_all_plan(chain.length)), {}
        return real(problem_, options, last)

    monkeypatch.setattr(exact, "pofo_plan", wrong)
    return problem


def test_a_plan_that_does_not_replay_is_never_a_candidate(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The wrong entry's plan is too fast to be true (store-all, no recomputation) but
    over the limit: the simulator keeps it out of the candidates and of the answer."""
    problem = _bad_ladder(monkeypatch)
    disc, beta = ro.discretized(problem, OPTS)
    store_all = tuple(Op.parse(str(op)) for op in store_all_plan(problem.chain.length))
    assert simulate_offload(disc.chain, store_all, beta, 10**9).peak_memory > \
        disc.memory_limit  # the wrong plan does not fit
    report: dict = {}
    found = exact._candidates(problem, OPTS.with_(extra=LADDER), report=report)
    assert all(plan != store_all for _, _, plan in found)
    assert report["dp_ladder"]["chapter 4 dp (grid 16, backlog_grid 8)"] == "no plan"
    res = solve(problem, "cpsat", options=OPTS.with_(extra=LADDER, deterministic_time=5.0))
    check(problem, res)
    assert tuple(parse_mixed_plan(res.plan)) != store_all


def test_trusting_the_ladder_would_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrong version: candidates taken at their claimed value without the replay
    would put the over-limit plan first (what the replay prevents above)."""
    problem = _bad_ladder(monkeypatch)
    plans = exact._ladder_plans(problem, OPTS.with_(extra=LADDER), None, {})
    disc, beta = ro.discretized(problem, OPTS)
    claimed = [(simulate_offload(disc.chain, plan, beta, 10**9).makespan, plan)
               for _, plan in plans if plan is not None]  # no limit: trusted
    fastest = min(claimed, key=lambda t: t[0])[1]
    with pytest.raises(Exception):  # noqa: B017 - the simulator's PlanError
        simulate_offload(disc.chain, fastest, beta, disc.memory_limit)


def test_no_dp_run_starts_when_the_deadline_is_spent() -> None:
    """A spent deadline (fake clock) skips every DP run of the ladder, deterministically."""
    problem = _problems()[0]
    spent = Deadline(0.0, clock=lambda: 1.0)
    notes: dict = {}
    plans = exact._ladder_plans(problem, OPTS.with_(extra=LADDER, time_limit_s=300.0),
                                spent, notes)
    assert [label for label, _ in plans] == ["autocapper"]
    assert notes["chapter 4 dp (grid 16, backlog_grid 8)"] == "skipped (time)"
    assert notes["chapter 4 dp (grid 64, backlog_grid 32)"] == "skipped (time)"


@pytest.mark.parametrize(("prior", "second"), [(None, "skipped (time)"), (1e-9, "no plan")])
def test_the_ladder_stops_at_its_share_of_the_limit(monkeypatch: pytest.MonkeyPatch,
                                                    prior: float | None, second: str) -> None:
    """On the deadline's clock (fake here): a DP run that uses up the ladder's quarter of the
    time limit is the last one; the deadline itself is far away. With ``prior``
    (``relaxation_first``) the ladder has no share of its own: the next run still starts."""
    problem = _problems()[0]
    now = [0.0]
    pofo = exact.pofo_plan

    def slow(problem, options, variant):  # type: ignore[no-untyped-def]
        now[0] += 80.0  # more than a quarter of 300 s
        return pofo(problem, options, variant)

    monkeypatch.setattr(exact, "pofo_plan", slow)
    notes: dict = {}
    far = Deadline.start(10_000.0, clock=lambda: now[0])
    exact._ladder_plans(problem, OPTS.with_(extra={"dp_ladder": [[16, 8], [64, 32]]},
                                            time_limit_s=300.0), far, notes, prior=prior)
    assert notes == {"chapter 4 dp (grid 16, backlog_grid 8)": "no plan",
                     "chapter 4 dp (grid 64, backlog_grid 32)": second}


def test_grids_are_capped_at_the_slots_and_deduplicated() -> None:
    """``grid`` above ``slots`` runs at ``slots``; two pairs that become one run once."""
    problem = _problems()[0]
    notes: dict = {}
    exact._ladder_plans(problem, OPTS.with_(extra={"dp_ladder": [[200, 10], [500, 10]]}),
                        None, notes)
    assert list(notes) == [f"chapter 4 dp (grid {OPTS.slots}, backlog_grid 10)"]


def test_a_pair_already_solved_is_taken_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ladder pair equal to the caller's own grid takes the plan already solved (no second
    DP run of the same grid), and the candidates are the same as with the run."""
    problem = _problems()[0]
    extra = {"grid": 16, "backlog_grid": 8, "dp_ladder": [[16, 8], [64, 32]]}
    options = OPTS.with_(extra=extra)
    ran = exact._candidates(problem, options)
    grids: list[tuple[int, int]] = []
    pofo = exact.pofo_plan

    def counted(problem, options, variant):  # type: ignore[no-untyped-def]
        grids.append(ro.grid_of(options))
        return pofo(problem, options, variant)

    monkeypatch.setattr(exact, "pofo_plan", counted)
    report: dict = {}
    assert exact._candidates(problem, options, report=report) == ran
    assert grids == [(16, 8), (64, 32)]  # the default once, then the other pair only
    assert report["dp_ladder"]["chapter 4 dp (grid 16, backlog_grid 8)"] != "no plan"


def test_benders_reports_its_default_ladder() -> None:
    """Under ``strategy=benders`` the ladder is on (``report["dp_ladder"]``); under ``full``
    it is off by default (no key)."""
    chain = random_chain(4, seed=0, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=1.0)
    res = solve(problem, "cpsat", options=BENDERS)
    check(problem, res)
    assert "autocapper" in res.report["dp_ladder"]
    full = solve(problem, "cpsat", options=OPTS.with_(deterministic_time=5.0))
    assert "dp_ladder" not in full.report


@pytest.mark.parametrize("extra", [{"dp_ladder": [[0, 5]]}, {"dp_ladder": [[5]]},
                                   {"dp_ladder": 5}, {"dp_ladder": [[True, 5]]},
                                   {"autocapper_candidate": 1}])
def test_bad_values_are_refused(extra: dict) -> None:
    chain = random_chain(3, seed=0, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError):
        solve(problem, "cpsat", options=OPTS.with_(extra=extra))
