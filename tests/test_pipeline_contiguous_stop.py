"""The contiguous period search stops at its solve's time limit (stop 76).

:func:`~optmem.solvers.pipeline_contiguous.best_contiguous` did not poll: 3.8 s at L = 339
(ResNet-1001, 4 GPUs, 24 GiB, 12 GB/s), which ``contiguous`` ran whole under any limit and
``madpipe --time-limit 5`` spent before its phase 1 (5.9-6.5 s in all). It now checks a
stop before each DP call and inside the DP; stopped, it answers with the split of the least
period found so far. The stops here are forced: predicates that count their own calls, or
a clock that moves only when a DP call is made. No verdict depends on the machine's clock
or load.
"""

from __future__ import annotations

from typing import Any

import pytest
from stop_helpers import after

from optmem.datasets.synthetic import random_pipeline_chain
from optmem.models.interrupt import Interrupted, stop_when
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers import pipeline_madpipe as mp
from optmem.solvers.facade import solve
from optmem.solvers.time_budget import Deadline

ONE = SolveOptions(threads=1)
FAR = ONE.with_(time_limit_s=3600.0)  # a limit the real clock never reaches in a test
CHAIN = random_pipeline_chain(10, seed=3)
PROBLEMS = {"links": PipelineProblem(CHAIN, 3, 2 * 10**9, bandwidth="12GB/s"),
            "free links": PipelineProblem(CHAIN, 3, 2 * 10**9)}


def _forced(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """``best_contiguous``'s stop replaced by one holding from evaluation ``n``."""
    monkeypatch.setattr(contig, "stop_when", lambda stop: stop_when(after(n)))


def _replays(problem: PipelineProblem, res: Result, optimum: float) -> None:
    """The plan replays at its objective, which is not below ``optimum``; the bound is not
    above ``optimum`` nor the objective."""
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)
    assert res.objective >= optimum * (1 - 1e-9)
    assert res.bound <= optimum * (1 + 1e-9) and res.bound <= res.objective * (1 + 1e-9)


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_a_stopped_search_keeps_its_best_split(name: str) -> None:
    """Stopped at each step in turn: the split of the least period found feasible so far,
    scheduled at its exact period (not below the optimum, never proven), or ``Interrupted``
    before the first split; a stop that never holds changes nothing."""
    problem = PROBLEMS[name]
    whole = contig.best_contiguous(problem)
    assert whole is not None and whole.proven and not whole.stopped
    assert contig.best_contiguous(problem, stop=lambda: False) == whole
    periods = []
    n = 1
    while True:
        try:
            found = contig.best_contiguous(problem, stop=after(n))
        except Interrupted:
            assert n == 1  # the first check comes before the first DP call
            n += 1
            continue
        assert found is not None
        if not found.stopped:
            assert found == whole
            break
        assert not found.proven and found.period >= whole.period * (1 - 1e-12)
        assert found.period == contig.best_period_for_allocation(problem, found.bounds)[0]
        periods.append(found.period)
        n += 1
    assert len(periods) >= 3 and periods == sorted(periods, reverse=True)
    assert periods[-1] == pytest.approx(whole.period)


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_a_stopped_contiguous_solve_answers_with_a_replayed_plan(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``contiguous`` method under a forced stop: ``no_solution`` with the load bound
    before any split, then ``feasible`` plans that replay, with ``report["stopped"]``; the
    unlimited answer is unchanged (``optimal``)."""
    problem = PROBLEMS[name]
    whole = solve(problem, "contiguous", options=ONE)
    assert whole.status is Status.OPTIMAL and "stopped" not in whole.report
    assert solve(problem, "contiguous", options=FAR).objective == whole.objective
    seen = set()
    n = 1
    while True:
        _forced(monkeypatch, n)
        res = solve(problem, "contiguous", options=FAR)
        if "stopped" not in res.report:
            assert (res.status, res.objective, res.bound) == \
                (whole.status, whole.objective, whole.bound)
            break
        assert res.report["stopped"] == "time limit (during the contiguous period search)"
        seen.add(res.status)
        if res.status is Status.NO_SOLUTION:
            assert n == 1 and res.bound <= whole.objective
        else:
            assert res.status is Status.FEASIBLE
            _replays(problem, res, whole.objective)
        n += 1
    assert seen == {Status.NO_SOLUTION, Status.FEASIBLE}


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _slow_dp(monkeypatch: pytest.MonkeyPatch, clock: _Clock, seconds: float) -> list[int]:
    """Every DP call of the search "takes" ``seconds`` on ``clock``; returns the call count."""
    calls = [0]
    real = contig.feasible_contiguous_split

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        clock.now += seconds
        return real(*args, **kwargs)

    monkeypatch.setattr(contig, "feasible_contiguous_split", slow)
    return calls


def test_the_contiguous_method_keeps_to_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """DP calls of 1 s each on an injected clock, a limit of 5 s: the search stops after the
    fifth call (it ran all 45 before stop 76) with a replayed plan."""
    problem = PROBLEMS["links"]
    whole = solve(problem, "contiguous", options=ONE)
    clock = _Clock()
    real_start = Deadline.start.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Deadline, "start", classmethod(
        lambda cls, limit_s, **kw: real_start(cls, limit_s, **{**kw, "clock": clock})))
    calls = _slow_dp(monkeypatch, clock, 1.0)
    res = solve(problem, "contiguous", options=ONE.with_(time_limit_s=5.0))
    assert calls[0] == 5 and "stopped" in res.report
    _replays(problem, res, whole.objective)


def test_madpipe_stops_its_contiguous_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """MadPipe computes the contiguous candidate first; under a limit its search now stops
    at the deadline (3 DP calls of 2 s for 5 s): the candidate found so far is the answer
    (no phase 1 once the deadline passed), replayed, with ``report["stopped"]``."""
    problem = PROBLEMS["links"]
    whole = solve(problem, "contiguous", options=ONE)
    clock = _Clock()
    monkeypatch.setattr(mp.time, "perf_counter", clock)
    calls = _slow_dp(monkeypatch, clock, 2.0)
    res = solve(problem, "madpipe", options=ONE.with_(time_limit_s=5.0))
    assert calls[0] == 3
    assert res.report["stopped"] == "time limit (during the contiguous candidate)"
    assert res.report["source"] == "contiguous 1F1B*"
    assert res.report["attempts"] == [{"memory_factor": 1.0, "phase1": "time limit reached"}]
    assert res.status is Status.FEASIBLE
    _replays(problem, res, whole.objective)


def test_madpipe_keeps_the_first_contiguous_split() -> None:
    """MadPipe's candidate asks the stop only once it has a split (``keep_first``): a stop
    that holds at once still leaves it the first split's plan (as before stop 76, when it
    always had one), marked stopped; without a stop, the contiguous optimum."""
    problem = PROBLEMS["links"]
    whole, stopped = mp._contiguous_candidate(problem)
    assert whole is not None and stopped is False
    first = contig.best_contiguous(problem, stop=lambda: True, keep_first=True)
    assert first is not None and first.stopped and not first.proven
    candidate, stopped = mp._contiguous_candidate(problem, after(1))
    assert stopped is True and candidate is not None
    assert candidate[0] == first.period >= whole[0] * (1 - 1e-12)


def test_a_stopped_strict_scan_answers_with_its_best_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the strict memory model ``contiguous`` scans the splits (9.5 s at L = 339,
    24 GiB, where it did not poll): stopped at each poll in turn, ``no_solution`` before
    the first plan, then replayed ``feasible`` plans not faster than the whole scan's, which
    comes back once the stop no longer holds."""
    from optmem.models import interrupt
    from optmem.solvers import pipeline as pl

    problem = PipelineProblem(random_pipeline_chain(6, seed=2), 3, 2 * 10**9,
                              bandwidth="12GB/s", memory_model="strict")
    whole = solve(problem, "contiguous", options=ONE)
    assert whole.status is Status.FEASIBLE and "stopped" not in whole.report
    monkeypatch.setattr(interrupt, "EVERY", 1)  # small chains: every poll checks
    seen = set()
    n = 1
    while True:
        monkeypatch.setattr(pl, "stop_when", lambda stop, k=n: stop_when(after(k)))
        res = solve(problem, "contiguous", options=FAR)
        if "stopped" not in res.report:
            assert (res.status, res.objective, res.plan) == \
                (whole.status, whole.objective, whole.plan)
            break
        assert res.report["stopped"] == "time limit (during the contiguous period search)"
        seen.add(res.status)
        if res.status is Status.FEASIBLE:
            _replays(problem, res, whole.objective)
        else:
            assert res.status is Status.NO_SOLUTION
        n += 1
    assert seen == {Status.NO_SOLUTION, Status.FEASIBLE}


def test_the_exact_methods_incumbent_search_stops_too(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """``ilp``, ``cpsat`` and ``chunks`` start from the contiguous optimum
    (:func:`~optmem.solvers.pipeline_exact.incumbents`); under a limit its search now stops
    once it has a split: an incumbent that fits, not below the optimum; without a limit
    the same as before."""
    from optmem.solvers import pipeline_exact

    problem = PROBLEMS["links"]
    alone = ONE.with_(extra={"warm_madpipe": False})
    whole = pipeline_exact.incumbents(problem, alone)
    assert [source for _, _, source in whole] == ["contiguous 1F1B*"]
    assert pipeline_exact.incumbents(problem, alone.with_(time_limit_s=3600.0)) == whole
    periods = []
    calls = _slow_dp(monkeypatch, _Clock(), 0.0)  # counts the DP calls
    for n in (1, 2, 3):  # the first split is kept whatever the stop (keep_first)
        calls[0] = 0
        monkeypatch.setattr(Deadline, "stopper", lambda self, k=n: after(k))
        (period, plan, source), = pipeline_exact.incumbents(problem,
                                                            alone.with_(time_limit_s=3600.0))
        assert source == "contiguous 1F1B*" and period >= whole[0][0] * (1 - 1e-12)
        assert plan.period == period
        periods.append(period)
        assert calls[0] == n  # the first split, then one more per check that did not hold
    assert periods == sorted(periods, reverse=True)
