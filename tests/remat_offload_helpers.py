"""Shared helpers of the exact remat + offload tests: options, memory limits, the result check.

Used by tests/test_remat_offload_exact.py, tests/test_remat_offload_benders.py and their
neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.verify import verify_plan

# threads as the default: HiGHS keeps one global thread pool per process, and a solve
# with another thread count after it fails (kNotset)
OPTS = SolveOptions(slots=64)
# the logic-based Benders strategy of cpsat (optmem/solvers/remat_offload_benders.py)
BENDERS = OPTS.with_(seed=1, extra={"strategy": "benders", "benders_work": 30.0})


def limits(chain: Chain) -> list[int]:
    """Three memory limits: the persistent DP's least memory, 1/3 and 2/3 of the way to the
    store-all peak."""
    from optmem.solvers.checkpoint_dp import min_memory_persistent

    lo = min_memory_persistent(chain)
    hi = chain.store_all_peak()
    return sorted({lo, (2 * lo + hi) // 3, (lo + 2 * hi) // 3})


def check(problem: RematOffloadProblem, res: Result, opts: SolveOptions = OPTS,
          optimum: float | None = None) -> None:
    """The result of an exact method is consistent, whatever its strategy.

    * no error; a plan replays to the reported objective;
    * the bound is at most the objective, and equal to it when ``optimal`` (and the model's
      value, when the report has it); ``infeasible`` has the bound ``inf``;
    * ``optimum`` (a proven optimum from elsewhere, e.g. brute force): the bound is at most
      it, and an optimal objective equals it.
    """
    assert res.status is not Status.ERROR, res.report.get("error")
    if res.status is Status.INFEASIBLE:
        assert res.bound == math.inf
        assert optimum is None
        return
    if optimum is not None:
        assert res.bound <= optimum + 1e-6 * max(1.0, abs(optimum)), (res.bound, optimum)
    if not res.status.has_plan:
        return
    assert verify_plan(problem, list(res.plan), opts)["objective"] == \
        pytest.approx(res.objective)
    assert res.bound <= res.objective + 1e-9
    if res.status is Status.OPTIMAL:
        assert res.bound == pytest.approx(res.objective)
        if "model_objective" in res.report:
            assert res.report["model_objective"] == pytest.approx(res.objective, abs=1e-5)
        if optimum is not None:
            assert res.objective == pytest.approx(optimum)


def idle_op_chains(max_stages: int, max_fwd: int, max_bwd: int) -> st.SearchStrategy[Chain]:
    """Chains of 1 to ``max_stages`` stages whose forwards and backwards may take no time.

    Forward times in ``[0, max_fwd]``, backward times in ``[0, max_bwd]``, outputs 1-4,
    saved sizes up to 3 more, forward overheads 0-2, a loss backward of 0 or 1.
    """

    @st.composite
    def chains(draw: st.DrawFn) -> Chain:
        n = draw(st.integers(1, max_stages))
        out = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
        return Chain.from_lists(
            draw(st.lists(st.integers(0, max_fwd), min_size=n, max_size=n)),
            draw(st.lists(st.integers(0, max_bwd), min_size=n, max_size=n)),
            out, [o + x for o, x in zip(out, draw(st.lists(st.integers(0, 3), min_size=n,
                                                            max_size=n)), strict=True)],
            input_size=draw(st.integers(1, 5)),
            fwd_overhead=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
            loss_bwd_time=draw(st.integers(0, 1)))

    return chains()


def brute_optimum(problem: RematOffloadProblem) -> float | None:
    """Brute force's optimum of ``problem`` (``None``: no plan fits), after checking that
    it ran (no ``error`` status)."""
    from optmem.solvers.facade import solve

    brute = solve(problem, "brute", options=OPTS)
    assert brute.status is not Status.ERROR
    return brute.objective if brute.status.has_plan else None


def refused_before_any_work(monkeypatch: pytest.MonkeyPatch, extra: dict,
                            settings: Callable[[SolveOptions], object]) -> None:
    """``extra`` is refused by ``cpsat`` before the model is built, and by ``settings``."""
    import optmem.solvers.remat_offload_exact as exact
    from optmem.datasets.synthetic import random_chain
    from optmem.errors import OptmemInputError
    from optmem.solvers.facade import solve

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(exact, "build_remat_offload", no_work)
    chain = random_chain(3, seed=1, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError):
        solve(problem, "cpsat", options=OPTS.with_(extra=extra))
    with pytest.raises(OptmemInputError):
        settings(SolveOptions(extra=extra))


def needs_cpsat(extra: dict) -> None:
    """``ilp`` refuses ``extra`` (a CP-SAT stage), naming cpsat."""
    from optmem.datasets.synthetic import random_chain
    from optmem.errors import OptmemInputError
    from optmem.solvers.facade import solve

    pytest.importorskip("pulp")
    chain = random_chain(3, seed=1, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match="cpsat"):
        solve(problem, "ilp", options=OPTS.with_(extra=extra))
