"""Remat + offload exact methods on links too slow for any transfer (stop 80).

A plan that moves a value of positive size takes at least that transfer's time (the
simulator's makespan includes the end of every transfer). When the optimal persistent
checkpoint plan is faster than the shortest transfer, the exact methods solve the problem
without the link (``report["linkless"]``). Before, on 1e-9 links, HiGHS's answer to the
link relaxation's rows (coefficients of 1e9) gave a wrong ``optimal``.
"""

from __future__ import annotations

import pytest

from optmem.datasets.synthetic import random_chain
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.facade import solve
from optmem.solvers.remat_offload import discretized, shortest_transfer
from tests.remat_offload_helpers import OPTS, check, limits

pytest.importorskip("ortools")


def test_the_wrong_optimal_of_stop_80_is_the_linkless_optimum() -> None:
    """The reproducer of ``benchmarks/results/offload_exact.md``, "Stop 80": ``optimal``
    143.0598 before, where the linkless optimum (a plan without transfers) is 142.8322."""
    chain = random_chain(12, seed=1, max_size=8, integer_times=False)
    opts = SolveOptions(threads=1, extra={"strategy": "benders"})
    slow = RematOffloadProblem(chain, 35, chain_bandwidth=1e-9)
    linkless = solve(RematOffloadProblem(chain, 35, chain_bandwidth=0.0), "cpsat",
                     options=opts)
    res = solve(slow, "cpsat", options=opts)
    check(slow, res, opts)
    assert linkless.status is Status.OPTIMAL
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(linkless.objective, rel=1e-9)
    assert res.objective == pytest.approx(142.8322226531276, rel=1e-9)
    assert "linkless" in res.report


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_slow_link_answers_the_linkless_problem(method: str, seed: int) -> None:
    """On a link slower than the checkpoint plan, each exact method's answer is the
    linkless problem's, proven, and says why."""
    chain = random_chain(5, seed=seed, max_size=8)
    for limit in limits(chain):
        slow = RematOffloadProblem(chain, limit, chain_bandwidth=1e-9)
        linkless = solve(RematOffloadProblem(chain, limit, chain_bandwidth=0.0), method,
                         options=OPTS)
        res = solve(slow, method, options=OPTS)
        check(slow, res, OPTS, optimum=linkless.objective)
        assert res.status is Status.OPTIMAL is linkless.status
        assert res.objective == pytest.approx(linkless.objective, rel=1e-9)
        assert "linkless" in res.report
        assert not any(op.startswith(("offload", "prefetch")) for op in res.plan)


def test_a_link_that_can_pay_off_is_modelled() -> None:
    """A transfer shorter than the compute time: the guard does not apply (the model with
    the link is solved)."""
    chain = random_chain(5, seed=0, max_size=8)
    limit = limits(chain)[0]
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
    disc, beta = discretized(problem, OPTS)
    assert shortest_transfer(disc.chain, beta) < chain.total_compute_time()
    res = solve(problem, "cpsat", options=OPTS)
    check(problem, res, OPTS)
    assert "linkless" not in res.report


def test_shortest_transfer_skips_empty_values() -> None:
    """The least positive size over the bandwidth; no link or no positive size: ``inf``."""
    from optmem.chain import Chain

    chain = Chain.from_lists([1, 1], [1, 1], [0, 2], [6, 3], input_size=5)
    assert shortest_transfer(chain, 4.0) == 0.5
    assert shortest_transfer(chain, 0.0) == float("inf")
    empty = Chain.from_lists([1], [1], [0], [0], input_size=0)
    assert shortest_transfer(empty, 1.0) == float("inf")
