"""The remat + offload ``dp`` keeps ``time_limit_s`` (stop 79).

Its chapter 4 DP ran whole under any limit (6 s at L = 40 under ``--time-limit 0.05``).
Stops are forced (:func:`optmem.models.interrupt.stop_when` with a predicate of the test's
own), never by the machine's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from stop_helpers import after

from optmem.datasets.synthetic import random_chain
from optmem.models.interrupt import Interrupted, stop_when
from optmem.plan import AnyOp
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers import remat_offload as ro
from optmem.solvers import remat_offload_dp as dpm
from optmem.solvers.facade import solve

ONE = SolveOptions(threads=1, slots=60, extra={"grid": 30, "backlog_grid": 6})
FAR = ONE.with_(time_limit_s=3600.0)  # a limit the real clock never reaches in a test
CHAIN = random_chain(10, seed=4, max_size=8)


def _problem(share: float) -> RematOffloadProblem:
    return RematOffloadProblem(CHAIN, int(CHAIN.store_all_peak() * share), chain_bandwidth=1.0)


def _replays(problem: RematOffloadProblem, res: Result) -> None:
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)


def _stop_in_the_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solve's predicate holds once the chapter 4 DP has started (its first poll)."""
    started = [False]
    real_plan = ro.pofo_plan

    def pofo_plan(*args: object) -> tuple[Sequence[AnyOp] | None, dict]:
        started[0] = True
        return real_plan(*args)  # type: ignore[arg-type]

    real_when = ro.stop_when
    monkeypatch.setattr(ro, "pofo_plan", pofo_plan)
    monkeypatch.setattr(ro, "stop_when", lambda stop: real_when(lambda: started[0]))


def test_stopped_in_the_dp_answers_with_the_fastest_pure_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``never-worse`` under a limit runs the checkpoint-only and offload-only DPs first; a
    stop in the chapter 4 DP answers the faster of their plans, ``feasible``, replayed."""
    problem = _problem(0.5)
    whole = solve(problem, "dp", options=FAR)
    assert "stopped" not in whole.report
    pure = [solve(problem, m, options=ONE) for m in ("remat_only", "offload_only")]
    _stop_in_the_dp(monkeypatch)
    res = solve(problem, "dp", options=FAR)
    assert res.status is Status.FEASIBLE
    assert res.report["stopped"] == "time limit (during the DP)"
    assert res.report["choice"] in (ro.REMAT_LABEL, ro.OFFLOAD_LABEL)
    assert res.objective == pytest.approx(min(r.objective for r in pure if r.status.has_plan))
    assert whole.objective <= res.objective + 1e-9 and res.bound <= res.objective
    _replays(problem, res)


@pytest.mark.parametrize("variant", ["thesis", "extended"])
def test_stopped_at_once_answers_store_all_or_chen(
        variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped at the first poll (the chapter 4 DP had not finished): store-all when it
    fits, else Chen's segments, replayed; never ``infeasible``."""
    real_when = ro.stop_when
    for share, label in ((1.0, "store all"), (0.7, "sqrt(n) segments")):
        problem = _problem(share)
        monkeypatch.setattr(ro, "stop_when", lambda stop: real_when(after(1)))
        res = solve(problem, "dp", options=FAR.with_(variant=variant))
        assert res.status is Status.FEASIBLE and res.report["choice"] == label
        assert res.report["stopped"].startswith("time limit (during the ")
        _replays(problem, res)


def test_stopped_without_a_plan_is_no_solution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chen's plan does not fit and no DP finished: ``no_solution`` with the compute-time
    bound (the DP, run whole, finds a plan there: not ``infeasible``)."""
    problem = _problem(0.45)
    thesis = ONE.with_(variant="thesis")
    assert solve(problem, "dp", options=thesis).status.has_plan
    real_when = ro.stop_when
    monkeypatch.setattr(ro, "stop_when", lambda stop: real_when(after(1)))
    res = solve(problem, "dp", options=FAR.with_(variant="thesis"))
    assert res.status is Status.NO_SOLUTION and not res.plan
    assert res.report["stopped"] == "time limit (during the DP)"
    assert res.bound == pytest.approx(CHAIN.total_compute_time())


@pytest.mark.parametrize("variant", ["thesis", "never-worse"])
@pytest.mark.parametrize("share", [0.3, 0.45, 0.7, 1.0])
def test_a_limit_not_reached_changes_nothing(variant: str, share: float) -> None:
    """The same plan, objective and report with and without a (never reached) limit."""
    problem = _problem(share)
    free = solve(problem, "dp", options=ONE.with_(variant=variant))
    bounded = solve(problem, "dp", options=FAR.with_(variant=variant))
    assert bounded.status is free.status and bounded.plan == free.plan
    assert bounded.objective == free.objective or not free.status.has_plan
    assert {k: v for k, v in bounded.report.items() if k != "runtime_s"} == \
        {k: v for k, v in free.report.items() if k != "runtime_s"}


def _polls(stop: Callable[[], bool]) -> Callable[[], bool]:
    calls = [0]

    def counted() -> bool:
        calls[0] += 1
        return stop()

    counted.calls = calls  # type: ignore[attr-defined]
    return counted


def test_the_dp_polls_inside_its_cells() -> None:
    """The DP asks the predicate in its inner loops (segment ends, splits), not only once
    per table cell: one cell of the forward table costs up to L gathers."""
    coarse = ro.discretize(CHAIN, int(CHAIN.store_all_peak() * 0.5), 30)
    dp = dpm.PofoDP(coarse.chain, coarse.memory_limit, 1.0 / coarse.unit, "extended")
    count = _polls(lambda: False)
    with stop_when(count):
        dp.solve()
    length = CHAIN.length
    cells = length * (length + 1) // 2 + 2 * (length + 1) - 1
    assert count.calls[0] > 2 * cells  # type: ignore[attr-defined]
    with stop_when(after(cells)), pytest.raises(Interrupted):  # stops within the tables
        dpm.PofoDP(coarse.chain, coarse.memory_limit, 1.0 / coarse.unit, "extended").solve()
