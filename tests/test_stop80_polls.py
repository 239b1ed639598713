"""Time limits kept everywhere in the remat + offload ``dp`` and the checkpoint DP (stop 80).

Three pieces of work ran unpolled under a ``time_limit_s``: the persistent checkpoint DP's
table set-up (0.9 GB first touched at L = 339: 0.6 s to 2 s before its fill's first poll),
the transfer placement after the chapter 4 DP, and the smallest-memory search of the hint
of a ``dp`` that found no plan (8.8 s at L = 339). Each polls now; a poll counts as the work
it stands for (:func:`optmem.models.interrupt.poll` with a weight), so a small table is set
up before any check, as before.

Stops are forced (predicates of the tests' own: a flag raised at a chosen point, or a call
count); no verdict depends on the machine's clock or load.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from optmem.datasets.synthetic import random_chain
from optmem.models import interrupt
from optmem.models.interrupt import Interrupted, stop_when
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers import checkpoint_dp as cdp
from optmem.solvers import remat_offload as ro
from optmem.solvers import remat_offload_dp as dpm
from optmem.solvers import remat_offload_schedule as sched
from optmem.solvers.facade import solve

ONE = SolveOptions(threads=1, slots=60, extra={"grid": 30, "backlog_grid": 6})
FAR = ONE.with_(time_limit_s=3600.0)  # a limit the real clock never reaches in a test
CHAIN = random_chain(10, seed=4, max_size=8)


def _problem(share: float) -> RematOffloadProblem:
    return RematOffloadProblem(CHAIN, int(CHAIN.store_all_peak() * share), chain_bandwidth=1.0)


def _cells_before_stop(chain: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """Cells the checkpoint DP filled before a predicate that always holds stopped it."""
    filled = [0]
    real = cdp._fill_cell

    def counted(*args: Any) -> None:
        filled[0] += 1
        real(*args)

    monkeypatch.setattr(cdp, "_fill_cell", counted)
    with stop_when(lambda: True), pytest.raises(Interrupted):
        cdp.solve_persistent_table(chain, chain.store_all_peak(), "paper")
    return filled[0]


# ------------------------------------------------------------------ the checkpoint DP
def test_the_checkpoint_table_set_up_polls_before_any_cell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At L = 40 the set-up's rows count as 42 cells each: a passed deadline stops the DP
    before its first cell (before stop 80: after 511 cells, its first check)."""
    assert _cells_before_stop(random_chain(40, seed=3, max_size=8), monkeypatch) == 0


def test_a_small_checkpoint_table_is_set_up_and_filled_before_any_check() -> None:
    """L = 6: fewer than :data:`~optmem.models.interrupt.EVERY` weighted polls in all, so a
    passed deadline never stops it (the exact methods' cheap candidate stays, stop 77)."""
    chain = random_chain(6, seed=3, max_size=8)
    asked = []
    with stop_when(lambda: asked.append(1) or True):
        table = cdp.solve_persistent_table(chain, chain.store_all_peak(), "paper")
    assert not asked and table.plan() == cdp.solve_persistent_table(
        chain, chain.store_all_peak(), "paper").plan()


def test_the_set_up_asks_once_per_row_when_every_poll_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every poll asking: 2 L + 3 questions (cost rows, the diagonal's stores) and L
    (``m_null``) before the first cell (1 before stop 80); the table is the same."""
    monkeypatch.setattr(interrupt, "EVERY", 1)
    chain = random_chain(9, seed=2, max_size=8)
    whole = cdp.solve_persistent_table(chain, chain.store_all_peak() // 2, "paper")
    asked, first = [0], []
    real = cdp._fill_cell

    def noted(*args: Any) -> None:
        if not first:
            first.append(asked[0])
        real(*args)

    monkeypatch.setattr(cdp, "_fill_cell", noted)

    def ask() -> bool:
        asked[0] += 1
        return False

    with stop_when(ask):
        again = cdp.solve_persistent_table(chain, chain.store_all_peak() // 2, "paper")
    length = chain.length
    assert first[0] == (length + 2) + length + (length + 1) + 1
    assert np.array_equal(again.cost, whole.cost) and again.plan() == whole.plan()


def test_the_least_memory_recurrence_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interrupt, "EVERY", 1)
    chain = random_chain(9, seed=2, max_size=8)
    whole = cdp.min_memory_persistent(chain)
    with stop_when(lambda: False):
        assert cdp.min_memory_persistent(chain) == whole
    with stop_when(lambda: True), pytest.raises(Interrupted):
        cdp.min_memory_persistent(chain)


# ------------------------------------------------------------------ remat + offload dp
def test_the_placement_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``static_replay``, ``backward_windows`` and ``place_transfers`` each ask (every poll
    asking); unstopped, the same placement."""
    monkeypatch.setattr(interrupt, "EVERY", 1)
    problem = _problem(0.5)
    disc, beta = ro.discretized(problem, ONE)
    ops = ro.remat_candidate(disc)
    assert ops is not None
    static = sched.static_replay(disc.chain, ops)
    values = [("a", op.stage - 1) for op in ops if op.kind.name == "F_CK"]
    windows = sched.backward_windows(disc.chain, ops, static, values)
    assert windows
    whole = sched.best_placement(disc.chain, beta, disc.memory_limit, ops, windows)
    calls: list[Any] = [
        lambda: sched.static_replay(disc.chain, ops),
        lambda: sched.backward_windows(disc.chain, ops, static, values),
        lambda: sched.place_transfers(disc.chain, beta, disc.memory_limit, ops, windows)]
    for call in calls:
        with stop_when(lambda: True), pytest.raises(Interrupted):
            call()
    with stop_when(lambda: False):
        again = sched.best_placement(disc.chain, beta, disc.memory_limit, ops, windows)
    assert whole is not None and again is not None and again[0] == whole[0]


def _stop_after_the_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solve's predicate holds once the chapter 4 DP has its value (every poll asks)."""
    done = [False]
    real_solve = dpm.PofoDP.solve

    def solved(self: dpm.PofoDP) -> dpm.PofoSolution:
        out = real_solve(self)
        done[0] = True
        return out

    monkeypatch.setattr(interrupt, "EVERY", 1)
    monkeypatch.setattr(dpm.PofoDP, "solve", solved)
    real_when = ro.stop_when
    monkeypatch.setattr(ro, "stop_when", lambda stop: real_when(lambda: done[0]))


@pytest.mark.parametrize("variant", ["never-worse", "extended"])
def test_a_dp_stopped_in_its_placement_answers_with_what_it_has(
        variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped once the DP has its value: ``report.stopped`` names the placement, the DP's
    keys are kept, the answer is a finished candidate (never-worse) or store-all / Chen,
    replayed (before stop 80 the placement ran whole and the solve was not stopped)."""
    problem = _problem(0.7)
    whole = solve(problem, "dp", options=ONE.with_(variant=variant))
    assert whole.status.has_plan and "dp_offloaded" in whole.report
    _stop_after_the_dp(monkeypatch)
    res = solve(problem, "dp", options=FAR.with_(variant=variant))
    assert res.report["stopped"] == "time limit (during the DP's transfer placement)"
    assert res.report["dp_value"] == whole.report["dp_value"]
    assert res.status is Status.FEASIBLE
    expected = ((ro.REMAT_LABEL, ro.OFFLOAD_LABEL) if variant == "never-worse" else
                ("store all", "sqrt(n) segments"))
    assert res.report["choice"] in expected
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)
    assert whole.objective <= res.objective + 1e-9


def test_a_dp_without_a_plan_stopped_in_its_hint_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The DPs proved no plan fits, then the predicate holds: the status stands, the hint
    says the search was stopped and names no memory (it ran whole before stop 80)."""
    problem = _problem(0.05)
    whole = solve(problem, "dp", options=ONE)
    assert whole.status is Status.INFEASIBLE
    assert whole.report["checkpoint_min_memory"] is not None and "stopped" not in whole.report
    done = [False]
    real_candidates = ro._dp_candidates

    def candidates(*args: Any) -> str | None:
        out = real_candidates(*args)
        done[0] = True
        return out

    monkeypatch.setattr(interrupt, "EVERY", 1)
    monkeypatch.setattr(ro, "_dp_candidates", candidates)
    real_when = ro.stop_when
    monkeypatch.setattr(ro, "stop_when", lambda stop: real_when(lambda: done[0]))
    res = solve(problem, "dp", options=FAR)
    assert res.status is Status.INFEASIBLE and not res.plan
    assert res.report["stopped"] == "time limit (during the smallest-memory search)"
    assert res.report["checkpoint_min_memory"] is None
    assert "time limit stopped the search" in res.report["hint"]
    assert res.report["dp_value"] == whole.report["dp_value"]
