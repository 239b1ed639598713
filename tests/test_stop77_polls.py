"""The fallback work before an exact search stops at its solve's time limit (stop 77).

Four pieces of pure-Python work ran whole under any ``time_limit_s`` (measured at L = 339,
ResNet-1001, load about 8): the remat + offload checkpoint-only and offload-only candidate
plans (10.5 s), the checkpoint exact methods' persistent DP warm start (6.6 s), the offload
exact methods' DYNPROG warm start (2.8 s) and MadPipe's phase 1 before it has an
allocation (6.0 s for a 5 s limit). They now poll the solve's deadline
(:mod:`optmem.models.interrupt`), and a stopped solve answers with what it has: the plans
finished so far, a plan that needs no DP (store-all when it fits, else Chen's sqrt(L)
segments), or ``no_solution`` with the proven bound; every plan is replayed.

The stops are forced (:func:`stop_helpers.after`: a predicate that counts its own calls,
with :data:`~optmem.models.interrupt.EVERY` set to 1 so every poll asks it); no verdict
depends on the machine's clock or load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from stop_helpers import after

from optmem.datasets.synthetic import random_chain, random_pipeline_chain
from optmem.models import interrupt
from optmem.models.interrupt import Interrupted, stop_when
from optmem.problems.checkpoint import CheckpointProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.pipeline import PipelineProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers import checkpoint_exact, offload
from optmem.solvers import pipeline_madpipe as mp
from optmem.solvers import remat_offload_exact as exact
from optmem.solvers.checkpoint_dp import solve_persistent_table
from optmem.solvers.facade import solve
from optmem.solvers.offload_comm import solve_comm_dp
from optmem.solvers.offload_schedule import ordered_plan

ONE = SolveOptions(threads=1)
FAR = ONE.with_(time_limit_s=3600.0)  # a limit the real clock never reaches in a test


@pytest.fixture(autouse=True)
def _every_poll_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every :func:`~optmem.models.interrupt.poll` evaluates the predicate."""
    monkeypatch.setattr(interrupt, "EVERY", 1)


def _force(monkeypatch: pytest.MonkeyPatch, module: Any, stop: Callable[[], bool]) -> None:
    """``module``'s solve-level predicates replaced by ``stop`` (one shared count)."""
    real = stop_when
    monkeypatch.setattr(module, "stop_when", lambda _: real(stop))


def _stopped_solve(module: Any, problem: Any, method: str, n: int,
                   monkeypatch: pytest.MonkeyPatch) -> Result:
    """``solve`` with ``module``'s solve-level predicates holding from their ``n``-th call."""
    _force(monkeypatch, module, after(n))
    return solve(problem, method, options=FAR)


def _replays(problem: Any, res: Result, optimum: float) -> None:
    """A plan that replays within memory at its objective, not below ``optimum``; a bound
    at most ``optimum`` and the objective."""
    assert res.status is not Status.ERROR, res.report
    assert res.bound <= optimum + 1e-9 * max(1.0, optimum)
    if not res.status.has_plan:
        return
    replay = verify_plan(problem, list(res.plan))
    assert replay["objective"] == pytest.approx(res.objective)
    assert replay["peak_memory"] <= replay["memory_limit"]
    assert res.objective >= optimum - 1e-9 * max(1.0, optimum)
    assert res.bound <= res.objective + 1e-9


def _stops(solve_once: Callable[[int], Result], step: Callable[[int], int] = lambda n: 2 * n,
           within: str | None = None) -> dict[int, Result]:
    """``solve_once(n)`` for n = 1, step(1), ... until the stop no longer holds in time
    (``within``: until the first stop elsewhere than that stage, included)."""
    out, n = {}, 1
    while True:
        res = solve_once(n)
        if "stopped" not in res.report:
            return out
        out[n] = res
        if within is not None and res.report["stopped"] != within:
            return out
        n = step(n)


# ------------------------------------------------------------------ the DPs poll
def test_the_checkpoint_dp_polls_inside_its_table() -> None:
    chain = random_chain(12, seed=6, max_size=8)
    whole = solve_persistent_table(chain, chain.store_all_peak(), "paper")
    with stop_when(lambda: False):
        again = solve_persistent_table(chain, chain.store_all_peak(), "paper")
    assert again.value() == whole.value() and again.plan() == whole.plan()
    with stop_when(after(5)), pytest.raises(Interrupted):
        solve_persistent_table(chain, chain.store_all_peak(), "paper")


def test_dynprog_and_greedy_poll_while_they_place_transfers() -> None:
    """The no-wait plan of an offload set (DYNPROG's, GREEDY's) checks every 32 ops; the
    OFF_comm DP once per layer."""
    chain = random_chain(40, seed=7, max_size=8)
    plan, _ = ordered_plan(chain, 1.0, None, range(40))
    with stop_when(lambda: False):
        assert ordered_plan(chain, 1.0, None, range(40))[0] == plan
    with stop_when(after(2)), pytest.raises(Interrupted):
        ordered_plan(chain, 1.0, None, range(40))
    memory = chain.store_all_peak() // 2
    whole = solve_comm_dp(chain, memory, 1.0)
    with stop_when(lambda: False):
        assert solve_comm_dp(chain, memory, 1.0) == whole
    with stop_when(after(2)), pytest.raises(Interrupted):
        solve_comm_dp(chain, memory, 1.0)


# ------------------------------------------------------------------ checkpoint
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
@pytest.mark.parametrize("share", [2 / 3, 1.0])
def test_a_checkpoint_solve_stopped_in_its_dp_answers_without_it(
        method: str, share: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped inside the persistent DP (its first cell): store-all when it fits, else
    Chen's sqrt(L) segments, replayed, with the compute-time bound; stopped later, the DP's
    plan as before (stop 74)."""
    chain = random_chain(12, seed=6, max_size=8)
    problem = CheckpointProblem(chain, int(chain.store_all_peak() * share))
    whole = solve(problem, method, options=ONE)
    assert whole.status is Status.OPTIMAL
    seen = _stops(lambda n: _stopped_solve(checkpoint_exact, problem, method, n, monkeypatch))
    first = seen[1]
    assert first.report["stopped"] == "time limit (during the DP warm start)"
    assert first.status is Status.FEASIBLE
    assert first.report["incumbent"] == ("store all" if share == 1.0 else "sqrt(n) segments")
    assert first.bound == pytest.approx(chain.total_compute_time())
    later = {r.report["stopped"] for r in seen.values()}
    assert "time limit (during the model's build)" in later
    for res in seen.values():
        _replays(problem, res, whole.objective)



def test_a_checkpoint_solve_stopped_in_its_dp_with_no_cheap_plan_has_no_solution(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither store-all nor Chen's plan fits: ``no_solution`` with the compute-time bound."""
    chain = random_chain(12, seed=6, max_size=8)
    problem = CheckpointProblem(chain, int(chain.store_all_peak() * 0.4))
    whole = solve(problem, "ilp", options=ONE)
    assert whole.status is Status.OPTIMAL
    res = _stopped_solve(checkpoint_exact, problem, "ilp", 1, monkeypatch)
    assert res.report["stopped"] == "time limit (during the DP warm start)"
    assert res.status is Status.NO_SOLUTION and "incumbent" not in res.report
    assert res.bound == pytest.approx(chain.total_compute_time())
    _replays(problem, res, whole.objective)


# ------------------------------------------------------------------ offload
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_an_offload_solve_stopped_in_its_warm_start(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped in DYNPROG: ``no_solution`` with the lower bound (store-all does not fit);
    in GREEDY: DYNPROG's plan; later: the warm start in the build, as before (stop 74)."""
    chain = random_chain(6, seed=7, max_size=8)
    problem = OffloadProblem(chain, (chain.store_all_peak() * 2) // 3, chain_bandwidth=1.0)
    whole = solve(problem, method, options=ONE)
    assert whole.status is Status.OPTIMAL
    seen = _stops(lambda n: _stopped_solve(offload, problem, method, n, monkeypatch),
                  lambda n: n + 1, within="time limit (during the warm start)")
    first = seen[1]
    assert first.report["stopped"] == "time limit (during the warm start)"
    assert first.status is Status.NO_SOLUTION and first.bound > 0
    answers = {(r.report["stopped"], r.report.get("incumbent")) for r in seen.values()}
    assert ("time limit (during the warm start)", "the warm start (dp)") in answers
    assert any(stage == "time limit (during the model's build)" for stage, _ in answers)
    for res in seen.values():
        _replays(problem, res, whole.objective)



def test_an_offload_solve_stopped_at_once_answers_store_all_when_it_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    chain = random_chain(6, seed=7, max_size=8)
    problem = OffloadProblem(chain, chain.store_all_peak(), chain_bandwidth=1.0)
    whole = solve(problem, "cpsat", options=ONE)
    res = _stopped_solve(offload, problem, "cpsat", 1, monkeypatch)
    assert res.report["stopped"] == "time limit (during the warm start)"
    assert res.status is Status.FEASIBLE and res.report["incumbent"] == "store all"
    _replays(problem, res, whole.objective)
    assert res.objective == pytest.approx(whole.objective)  # nothing beats store-all


# ------------------------------------------------------------------ remat + offload
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_a_remat_offload_solve_stopped_in_its_cheap_candidates_keeps_the_finished_ones(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a limit the checkpoint-only and offload-only plans come first; stopped in the
    checkpoint DP (one count for the whole solve: the stopped solve does not run them
    again), the answer is Chen's plan or ``no_solution`` with the bound; stopped in
    DYNPROG, the checkpoint DP's plan, which was finished."""
    chain = random_chain(6, seed=1, max_size=8)
    problem = RematOffloadProblem(chain, (chain.store_all_peak() * 7) // 8,
                                  chain_bandwidth=1.0)
    whole = solve(problem, method, options=ONE)
    assert whole.status is Status.OPTIMAL
    seen = _stops(lambda n: _stopped_solve(exact, problem, method, n, monkeypatch),
                  within="time limit (during the candidate plans)")
    first = seen[1]
    assert first.report["stopped"] == "time limit (during the candidate plans)"
    assert first.report.get("incumbent") == "sqrt(n) segments"
    assert first.bound >= chain.total_compute_time() - 1e-9
    in_candidates = [r for r in seen.values()
                     if r.report["stopped"] == "time limit (during the candidate plans)"]
    assert any(r.report.get("incumbent") == "checkpoint only (persistent dp)"
               for r in in_candidates)
    for res in seen.values():
        _replays(problem, res, whole.objective)



def test_a_solve_stopped_inside_its_cheap_candidates_does_not_run_them_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped in the checkpoint DP (its first cell), with a fresh predicate for every
    block: the DP is not run again in the fallback (it was just cut short; a solve stopped
    before it started runs it there), the answer is Chen's plan."""
    chain = random_chain(6, seed=1, max_size=8)
    problem = RematOffloadProblem(chain, (chain.store_all_peak() * 7) // 8,
                                  chain_bandwidth=1.0)
    calls = []
    real = exact.remat_candidate
    monkeypatch.setattr(exact, "remat_candidate", lambda disc: calls.append(1) or real(disc))
    monkeypatch.setattr(exact, "stop_when", lambda _: stop_when(after(1)))
    res = solve(problem, "ilp", options=FAR)
    assert res.report["stopped"] == "time limit (during the candidate plans)"
    assert res.report["incumbent"] == "sqrt(n) segments" and len(calls) == 1
    _replays(problem, res, solve(problem, "ilp", options=ONE).objective)


def test_a_remat_offload_solve_with_no_cheap_plan_has_no_solution_and_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    chain = random_chain(6, seed=1, max_size=8)
    problem = RematOffloadProblem(chain, (chain.store_all_peak() * 2) // 3,
                                  chain_bandwidth=1.0)
    whole = solve(problem, "ilp", options=ONE)
    res = _stopped_solve(exact, problem, "ilp", 1, monkeypatch)
    assert res.report["stopped"] == "time limit (during the candidate plans)"
    assert res.status is Status.NO_SOLUTION
    assert res.bound == pytest.approx(chain.total_compute_time())
    _replays(problem, res, whole.objective)


# ------------------------------------------------------------------ MadPipe's phase 1
MADPIPE = PipelineProblem(random_pipeline_chain(10, seed=3), 3, 10**12)


def test_algorithm8_stops_inside_a_dp_call_even_before_an_allocation() -> None:
    """Stopped at once: ``Interrupted`` (no allocation to answer with); stopped later, inside
    a DP call, the best allocation so far; a stop that never holds changes nothing."""
    whole = mp.algorithm8(MADPIPE, exact=True)
    with stop_when(lambda: False):
        assert mp.algorithm8(MADPIPE, exact=True) == whole
    with stop_when(after(1)), pytest.raises(Interrupted):
        mp.algorithm8(MADPIPE, exact=True)
    n, kept = 2, []
    while True:
        with stop_when(after(n)):
            try:
                out = mp.algorithm8(MADPIPE, exact=True)
            except Interrupted:
                n *= 2
                continue
        if out == whole:
            break
        assert out[2] is not None and out[0] >= whole[0] and out[3] < whole[3]
        kept.append(out)
        n *= 2
    assert kept  # some stop fell inside a DP call after the first allocation


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_madpipe_solve_stopped_in_phase1_before_an_allocation(
        contiguous: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 1 stopped in its first DP call: the contiguous candidate it computed first, or
    ``no_solution`` with the load bound; ``report.stopped`` says where."""
    whole = solve(MADPIPE, "madpipe", options=ONE)
    assert whole.status.has_plan
    if not contiguous:
        monkeypatch.setattr(mp, "_contiguous_candidate", lambda p, stop=None: (None, False))
    _force(monkeypatch, mp, after(1))
    res = solve(MADPIPE, "madpipe", options=FAR)
    assert res.report["stopped"] == "time limit (during phase 1)"
    assert res.report["attempts"] == [{"memory_factor": 1.0, "phase1": "time limit reached"}]
    if contiguous:
        assert res.status is Status.FEASIBLE and res.report["source"] == "contiguous 1F1B*"
        assert verify_plan(MADPIPE, res)["objective"] == pytest.approx(res.objective)
    else:
        assert res.status is Status.NO_SOLUTION and math.isfinite(res.bound)
    assert res.bound <= whole.objective * (1 + 1e-9)
