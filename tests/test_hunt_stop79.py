"""Regressions of the stop 79 hunt (the solver features of stops 70-78 against brute force).

* ``_lift`` (the waits rows of ``chunks``, stop 59) looped until float rounding ended it
  when no plan has a period in its range: a head question of ``family="all"`` at a cutoff
  below the proven bound (``low > period``) ran ~7e7 rounds of the loop (19 s on a
  two-layer chain, outside any time limit: ``time_limit_s=1`` answered after 19 s) and
  returned delays of 1.8e16. Such a range has no plan, so the delay is returned unlifted.
"""

from __future__ import annotations

import math
import types

import pytest

from optmem import SolveOptions, solve
from optmem.result import Status
from optmem.simulate.verify import verify_plan
from optmem.solvers import pipeline_chunks
from optmem.solvers.pipeline_chunks import _lift
from tests.test_pipeline_zero_ties import zero_time_instance

pytest.importorskip("ortools", reason="the exact models use OR-Tools CP-SAT")

FLOOR_CALLS_MAX = 100_000  # the fixed loop takes a handful per lift


def test_lift_returns_the_delay_when_the_range_has_no_plan() -> None:
    # low > period: an empty range (was 1.8e16, after 670 rounds of its loop)
    assert _lift(1.0, 1.0, 1.0, 2.0, 1.9) == 1.0
    # two ops of 1 + 1 on one resource never fit a period of 1.95 (was 2.9: vacuous too)
    assert _lift(1.0, 1.0, 1.0, 1.9, 1.95) == 1.0
    # a real range: one window moves the delay, and only one (unchanged)
    assert _lift(2.5, 1.0, 1.0, 2.0, 3.0) == 3.0
    assert _lift(0.5, 1.0, 1.0, 2.0, 3.0) == 0.5


def test_the_complete_family_on_a_tiny_chain_does_not_spin_in_the_waits(monkeypatch) -> None:
    """``zero_time_instance(149)`` (2 layers, 2 GPUs): the head pass asks at 1.999999 with
    the proven bound 2.0. Before, ``_lift(1, 1, 1, 2.0, 1.999999)`` called ``math.floor``
    45 million times (19 s); counted here, not timed."""
    calls = {"floor": 0}

    def floor(x: float) -> int:
        calls["floor"] += 1
        if calls["floor"] > FLOOR_CALLS_MAX:
            raise AssertionError("the waits loop spins")
        return math.floor(x)

    counting = types.SimpleNamespace(**{k: getattr(math, k) for k in dir(math)
                                        if not k.startswith("_")})
    counting.floor = floor
    monkeypatch.setattr(pipeline_chunks, "math", counting)
    problem = zero_time_instance(149)
    res = solve(problem, "chunks", options=SolveOptions(threads=1, warm_start=False)
                .with_(extra={"family": "all"}))
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(2.0)
    assert verify_plan(problem, res)["objective"] == pytest.approx(2.0)
