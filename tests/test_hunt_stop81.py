"""Regressions of the stop 81 hunt (the solver features of stop 80 against brute force).

* The remat + offload exact methods' linkless solve (stop 80: a link slower than the
  checkpoint plan is solved without it) gave its nested solve at least
  ``LEAST_ENGINE_TIME_S`` (1 s), whatever was left of the caller's time limit: under
  ``time_limit_s=0.05`` a 40-stage chain on a 1e-9 link answered after 0.53 s (the nested
  solve's own deadline, half of its 1 s), where the same chain on a 1 B/ms link answered
  after 0.03 s. The nested solve now gets what is left (at least ``MIN_ENGINE_LIMIT_S``).
* A limit that stopped the guard's checkpoint DP (it polls since stop 80) answered with
  ``report["stopped"]`` naming the link relaxation, which had not started; it names the
  candidate plans (the guard computes the checkpoint-only one).
"""

from __future__ import annotations

import pytest

from optmem.datasets.synthetic import random_chain
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.solvers import remat_offload_exact as exact
from optmem.solvers.time_budget import Deadline
from tests.remat_offload_helpers import OPTS, check, limits

pytest.importorskip("ortools", reason="the exact models use OR-Tools CP-SAT")


@pytest.mark.parametrize("left", [0.02, 0.0])
def test_the_linkless_solve_keeps_to_what_is_left_of_the_limit(monkeypatch, left) -> None:
    """A fake clock leaves ``left`` seconds: the nested solve's limit is at most what is
    left (or the engine's least limit when nothing is), not 1 s. The nested solve itself
    runs without a limit here, so the answer does not depend on the machine."""
    chain = random_chain(5, seed=0, max_size=8)
    problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=1e-9)
    slow = exact._slower_than_checkpointing(problem, OPTS)
    assert slow is not None  # the guard applies: no transfer beats the checkpoint plan
    asked: list[float | None] = []
    solve_model = exact._solve_model

    def spy(twin: RematOffloadProblem, options: SolveOptions, method: str):
        asked.append(options.time_limit_s)
        return solve_model(twin, options.with_(time_limit_s=None), method)

    monkeypatch.setattr(exact, "_solve_model", spy)
    deadline = Deadline(end=left, clock=lambda: 0.0)
    res = exact._linkless(problem, OPTS, "cpsat", deadline, *slow)
    assert asked == [max(left, exact.MIN_ENGINE_LIMIT_S)]  # was [1.0]
    check(problem, res, OPTS)
    assert res.status is Status.OPTIMAL
    assert "linkless" in res.report


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_a_limit_that_stops_the_guard_names_the_candidate_plans(monkeypatch, method) -> None:
    """The guard computes the checkpoint-only candidate (the persistent DP, which polls the
    deadline since stop 80); a limit that stops it there named the link relaxation, which
    had not started. The answer is the fallback candidates', as before."""
    from optmem.models.interrupt import Interrupted
    from optmem.solvers.time_budget import stopped_during

    def stopped(problem: RematOffloadProblem, options: SolveOptions) -> None:
        raise Interrupted

    monkeypatch.setattr(exact, "_slower_than_checkpointing", stopped)
    chain = random_chain(5, seed=0, max_size=8)
    problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=1e-9)
    res = exact._solve_model(problem, OPTS, method)
    assert res.report["stopped"] == stopped_during("the candidate plans")  # was the relaxation
    check(problem, res, OPTS)
    assert res.status.has_plan
