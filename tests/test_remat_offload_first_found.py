"""``extra["benders_first_found"]``: a windowed Benders master stops at its first solution
in the window (HiGHS ``mip_max_improving_sols = 1``), whose compute sequence is the next
proposal (:func:`optmem.solvers.remat_offload_benders.solve_benders`, ``_subproblem``'s
``least``).

Checked against brute force (hypothesis, derandomised, ``L <= 2``) and the monolithic
model's proven optimum (CP-SAT, deterministic time) on 4-stage chains, with the loop's own
incumbents and with a stale one (the path where stopped masters propose); a deliberately
wrong version (a stopped master's makespan, scaled up, taken as a value cut's bound) must
fail the same check. Deterministic: CP-SAT runs with a deterministic-time limit and a
fixed seed, the loops with an iteration cap, HiGHS with its first-solution limit or to
optimality; no verdict depends on wall-clock time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import check
from test_remat_offload_exact import tiny
from test_remat_offload_window import (
    WINDOW,
    _windowed_loops,
    assert_benders_equals_brute,
    assert_stopped_loops_valid,
)

from optmem.chain import Chain
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.solvers import remat_offload_benders as bd

pytest.importorskip("ortools", reason="the Benders subproblem uses OR-Tools CP-SAT")

FIRST = {**WINDOW, "benders_first_found": True}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_first_found_benders_equals_brute(chain: Chain, limit: int, beta: float) -> None:
    """``strategy=benders`` with first-found masters and no warm-up equals brute force."""
    assert_benders_equals_brute(RematOffloadProblem(chain, limit, chain_bandwidth=beta), FIRST)


def _loops(iterations: int) -> Iterator[tuple[RematOffloadProblem, float, object]]:
    """The loop with first-found masters on the 4-stage instances (proven optima), from
    the persistent checkpoint plan, no warm-up, at most ``iterations``."""
    return _windowed_loops(iterations, FIRST)


def test_first_found_loop_bounds_are_valid() -> None:
    """Loops stopped after 2 and 4 iterations: the bound at most the proven optimum, a
    plan replays to its objective, ``optimal`` only at the optimum."""
    assert_stopped_loops_valid(FIRST)


def _stale(monkeypatch: pytest.MonkeyPatch, iterations: int = 8
           ) -> tuple[list[bool], int, int]:
    """Per instance, the loop kept on the persistent checkpoint plan (its better plans not
    taken, so its windowed masters have solutions to stop at): whether the bound is at
    most the proven optimum; the stopped masters' proposals and the value cuts made."""
    monkeypatch.setattr(bd, "_improve", lambda loop, plan: None)
    out, found, cuts = [], 0, 0
    for problem, optimum, res in _loops(iterations):
        check(problem, res)
        out.append(res.bound <= optimum + 1e-6)
        found += res.report["benders"]["first_found"]
        cuts += res.report["benders"]["value_cuts"]
    return out, found, cuts


def test_first_found_with_a_stale_incumbent_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped masters do propose (and value cuts follow) and every bound stays valid."""
    valid, found, cuts = _stale(monkeypatch)
    assert all(valid)
    assert found >= 1 and cuts >= 1


def test_wrong_first_found_value_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped master's makespan (scaled up by a half) taken as a value cut's ``b``, as
    an optimal master's least makespan may be, is not a bound: some instance then reports
    a bound above its proven optimum."""
    real = bd._subproblem

    def wrong(loop, xhat, work, value, *, least=True):
        out = real(loop, xhat, work, value, least=least)
        if not least:
            loop.cut(loop.slots, xhat, 1.5 * value, f"wrong_{len(loop.master.constraints)}")
        return out

    monkeypatch.setattr(bd, "_subproblem", wrong)
    valid, found, _ = _stale(monkeypatch)
    assert found >= 1
    assert not all(valid)
