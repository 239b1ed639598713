"""Remat + offload combined (issue 7): the chapter 4 DP, heuristics, cross-checks."""

from __future__ import annotations

import inspect
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.plan import LOSS
from optmem.problems.checkpoint import CheckpointProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers.facade import methods, solve
from optmem.solvers.remat_offload_dp import PofoDP

# digest shared/design/offload.md 7.2 (worked example, exact rationals)
EXAMPLE = Chain.from_lists([2, 2, 2], [4, 4, 4], [2, 2, 2], [4, 4, 4], input_size=2)
POFO_TABLE = {10: [32, 26, 24, 23], 12: [22, 22, 21, 19.5], 14: [20, 20, 19, 18.5],
              16: [18, 18, 18, 18]}
BETAS = [0.5, 1, 2, 4]


@pytest.mark.parametrize("limit", sorted(POFO_TABLE))
@pytest.mark.parametrize("last", ["thesis", "extended"])
def test_worked_example_values(limit: int, last: str) -> None:
    for beta, expected in zip(BETAS, POFO_TABLE[limit], strict=True):
        for mode in ("table", "memo"):
            value = PofoDP(EXAMPLE, limit, beta, last, mode).solve().value
            assert value == pytest.approx(expected), (limit, beta, mode)


def test_worked_example_c_mp() -> None:
    # beta = 0: pofo is the persistent rematerialisation DP C_MP (digest 7.2 column)
    for limit, expected in ((12, 24), (14, 22), (16, 20), (18, 18)):
        assert PofoDP(EXAMPLE, limit, 0.0).solve().value == expected
    assert PofoDP(EXAMPLE, 10, 0.0).solve().value == math.inf


def _opts(**extra: object) -> SolveOptions:
    return SolveOptions(slots=64, extra=dict(extra))


def _check_replay(problem: RematOffloadProblem, result, options: SolveOptions) -> None:
    """The result's objective is the simulated makespan and its peak fits."""
    assert result.status.has_plan, result.report
    check = verify_plan(problem, list(result.plan), options)
    assert check["objective"] == pytest.approx(result.objective)
    assert result.peak_memory <= result.memory_limit
    assert check["peak_memory"] <= check["memory_limit"]
    assert result.objective >= result.bound - 1e-9


def test_methods_registered() -> None:
    names = set(methods("remat-offload"))
    assert {"dp", "remat_only", "offload_only", "opportunist", "autocapper"} <= names


@pytest.mark.parametrize("limit", [10, 12, 14, 16])
@pytest.mark.parametrize("beta", BETAS)
def test_example_every_method_replays(limit: int, beta: float) -> None:
    problem = RematOffloadProblem(EXAMPLE, limit, chain_bandwidth=beta)
    options = _opts()
    results = {m: solve(problem, m, options=options) for m in methods("remat-offload")
               if m not in ("brute",)}
    for name, res in results.items():
        assert res.status is not Status.ERROR, (name, res.report)
        if res.status.has_plan:
            _check_replay(problem, res, options)
    dp = results["dp"]
    assert dp.status.has_plan
    for other in ("remat_only", "offload_only"):
        if results[other].status.has_plan:
            assert dp.objective <= results[other].objective + 1e-9
    # at M = 10 neither pure method fits, the combination does (digest 7.2)
    if limit == 10:
        assert not results["remat_only"].status.has_plan
        assert not results["offload_only"].status.has_plan


def test_dp_value_matches_simulation_on_example() -> None:
    # when the link is fast enough, the placed plan reproduces the DP value exactly
    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    res = solve(problem, "dp", options=_opts().with_(variant="thesis"))
    assert res.report["dp_value"] == 22
    assert res.objective == pytest.approx(22)
    assert any(op.startswith("offload") for op in res.plan)
    assert any(op.startswith("F_ck") for op in res.plan)


def test_variants_and_errors() -> None:
    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError):
        solve(problem, "dp", options=_opts().with_(variant="nope"))
    with pytest.raises(OptmemInputError):
        RematOffloadProblem(EXAMPLE, 12, -1.0)
    res = solve(RematOffloadProblem(EXAMPLE, 3, chain_bandwidth=1.0), "dp", options=_opts())
    assert res.status in (Status.INFEASIBLE, Status.NO_SOLUTION)


# ------------------------------------------------------------------ random chains
@st.composite
def chains(draw: st.DrawFn, max_length: int = 6) -> Chain:
    n = draw(st.integers(1, max_length))
    small = st.integers(1, 6)
    out = draw(st.lists(small, min_size=n, max_size=n))
    extra = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return Chain.from_lists(
        draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)),
        draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)),
        out, [o + e for o, e in zip(out, extra, strict=True)],
        input_size=draw(small),
        fwd_overhead=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        bwd_overhead=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        loss_bwd_time=draw(st.integers(0, 3)))


@settings(max_examples=60, deadline=None)
@given(chain=chains(), limit=st.integers(4, 45), beta=st.sampled_from([0.3, 1.0, 2.5]),
       last=st.sampled_from(["thesis", "extended"]), q=st.integers(1, 3))
def test_table_equals_memo(chain: Chain, limit: int, beta: float, last: str, q: int) -> None:
    """The vectorised fill and the top-down recurrences agree (value and plan)."""
    table = PofoDP(chain, limit, beta, last, "table", q).solve()
    memo = PofoDP(chain, limit, beta, last, "memo", q).solve()
    assert table.value == pytest.approx(memo.value) or table.value == memo.value
    assert table.ops == memo.ops


@settings(max_examples=60, deadline=None)
@given(chain=chains(), limit=st.integers(4, 45))
def test_bandwidth_zero_is_checkpoint_dp(chain: Chain, limit: int) -> None:
    """beta = 0 (t <= L variant): the DP is the persistent checkpoint DP, value and plan."""
    options = _opts()
    ckpt = solve(CheckpointProblem(chain, limit), "dp", options=options)
    res = solve(RematOffloadProblem(chain, limit, chain_bandwidth=0.0), "dp",
                options=options.with_(variant="extended"))
    if not ckpt.status.has_plan:
        assert not res.status.has_plan
        return
    assert res.report["dp_value"] == pytest.approx(ckpt.objective)
    assert res.objective == pytest.approx(ckpt.objective)
    assert not any("fetch" in op or "offload" in op for op in res.plan)


@settings(max_examples=40, deadline=None)
@given(chain=chains(), limit=st.integers(4, 45), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_random_plans_replay_and_dominate(chain: Chain, limit: int, beta: float) -> None:
    """Every method's plan replays; never-worse dp <= min(remat-only, offload-only)."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    options = _opts()
    results = {m: solve(problem, m, options=options)
               for m in ("dp", "remat_only", "offload_only", "opportunist", "autocapper",
                         "delta")}
    for name, res in results.items():
        assert res.status is not Status.ERROR, (name, res.report)
        if res.status.has_plan:
            _check_replay(problem, res, options)
    pure = [results[m].objective for m in ("remat_only", "offload_only")
            if results[m].status.has_plan]
    if pure:
        assert results["dp"].status.has_plan
        assert results["dp"].objective <= min(pure) + 1e-9
    thesis = solve(problem, "dp", options=options.with_(variant="thesis"))
    assert thesis.status is not Status.ERROR, thesis.report
    if thesis.status.has_plan:
        _check_replay(problem, thesis, options)


@settings(max_examples=25, deadline=None)
@given(chain=chains(max_length=4), limit=st.integers(4, 40),
       beta=st.sampled_from([0.5, 2.0]))
def test_combined_vs_pure_optima(chain: Chain, limit: int, beta: float) -> None:
    """Like with like: the combined DP uses the same persistent model as the checkpoint DP,
    and the offload-only optimum's plan is a combined plan, so the never-worse DP is
    no worse than either exact pure optimum that is itself a replayable plan."""
    options = _opts()
    res = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "dp", options=options)
    ckpt = solve(CheckpointProblem(chain, limit), "dp", options=options)
    if ckpt.status.has_plan:
        assert res.objective <= ckpt.objective + 1e-9
    if chain.length <= 3:
        off = solve(OffloadProblem(chain, limit, chain_bandwidth=beta), "brute", options=options)
        if off.status.has_plan:
            # the offload optimum is a remat-offload plan with the same simulator
            check = verify_plan(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                list(off.plan), options)
            assert check["objective"] == pytest.approx(off.objective)


def test_real_chain_quick() -> None:
    """A bundled profile at a tight limit: pofo beats the pure methods, plans replay."""
    from optmem.datasets import resolve_chain

    chain = resolve_chain("resnet50-b16-500")
    limit = int(chain.store_all_peak() * 0.35)
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.2e7)  # 12 GB/s with ms and bytes
    options = SolveOptions(slots=200, extra={"grid": 100, "backlog_grid": 15})
    res = solve(problem, "dp", options=options)
    remat = solve(problem, "remat_only", options=options)
    _check_replay(problem, res, options)
    _check_replay(problem, remat, options)
    assert res.objective <= remat.objective + 1e-9


def test_delta_filter_and_director() -> None:
    """Digest hong_delta.md B.4: the filter takes the largest size x staleness; the director
    evicts when recomputing is cheaper than one transfer, offloads otherwise."""
    from optmem.solvers.remat_offload_delta import EVICTED, KEPT, OFFLOADED, delta_decisions

    chain = Chain.from_lists([1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [4, 2, 2, 2],
                             input_size=1)
    # slow link: recomputing abar^1 (1 time unit) beats moving 4 units at 0.5/unit
    slow = delta_decisions(chain, 9, 0.5)
    assert slow[1] == EVICTED and OFFLOADED not in slow[1:]
    # fast link: the swap (4 / 100) is cheaper than recomputing
    fast = delta_decisions(chain, 9, 100.0)
    assert fast[1] == OFFLOADED
    # no pressure: nothing is released
    assert delta_decisions(chain, 1000, 1.0) == [KEPT] * 5
    # no link: a^0 can never leave, tapes are evicted
    none = delta_decisions(chain, 9, 0.0)
    assert none[0] == KEPT and none[1] == EVICTED


def test_dp_leaves_the_interpreter_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table DP and its reconstruction need no deep recursion and no recursion limit.

    Issue 14.6: the plan is rebuilt with an explicit stack, so a 30-stage chain solves with
    only 25 frames to spare and ``sys.setrecursionlimit`` is never called.
    """
    length = 30
    chain = Chain.from_lists([1.0] * length, [2.0] * length, [1] * length, [1] * length,
                             input_size=1)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 25)

    def refuse(limit: int) -> None:
        raise AssertionError(f"sys.setrecursionlimit({limit}) called")

    try:
        monkeypatch.setattr(sys, "setrecursionlimit", refuse)
        sol = PofoDP(chain, 8, 0.5).solve()
    finally:
        monkeypatch.undo()
        sys.setrecursionlimit(old)
    assert math.isfinite(sol.value) and sol.ops.count(LOSS) == 1
    memo = PofoDP(chain, 8, 0.5, mode="memo").solve()  # the recursive cross-check
    assert (memo.value, memo.ops) == (sol.value, sol.ops)


def test_autocapper_below_the_least_forward_memory_names_no_checkpoint_hint() -> None:
    """Below the least memory of any forward, the autocapper answered with remat_only's
    result: ``infeasible`` and ``min_feasible_memory`` 58 (the persistent checkpoint DP's
    least memory), where the autocapper itself finds a plan at 49 (an offloading plan).
    Found by a hunt in stop 51. Now: ``infeasible`` (a proof: every plan holds some
    forward's input and output), no hint of another method's."""
    from optmem.datasets.synthetic import random_chain

    chain = random_chain(4, seed=1)
    at_zero = solve(RematOffloadProblem(chain, 0, chain_bandwidth=3.0), "autocapper")
    assert at_zero.status is Status.INFEASIBLE and math.isinf(at_zero.bound)
    assert at_zero.min_feasible_memory is None
    assert "every plan needs at least 18" in at_zero.report["hint"]
    at_49 = solve(RematOffloadProblem(chain, 49, chain_bandwidth=3.0), "autocapper")
    assert at_49.status.has_plan and at_49.peak_memory <= 49
    remat = solve(RematOffloadProblem(chain, 49, chain_bandwidth=3.0), "remat_only")
    assert not remat.status.has_plan  # the hint it gave was not the autocapper's
    useless = solve(RematOffloadProblem(chain, 0, chain_bandwidth=0.0), "autocapper")
    assert useless.status is Status.INFEASIBLE and useless.min_feasible_memory == 58


@pytest.mark.parametrize("method", ["dp", "remat_only"])
def test_hint_without_a_solvable_limit_names_the_slots(method: str) -> None:
    """Regression: with ``slots = 2`` no limit is solvable (every value takes a unit of
    half the limit) and the hints read ``a plan without transfers fits from None B`` and
    ``finds no plan below None B`` (``random_chain(4, seed=1)`` at 40 B). They now say that
    no limit fits with that many slots and to raise them."""
    from optmem.datasets.synthetic import random_chain

    problem = RematOffloadProblem(random_chain(4, seed=1, max_size=6), 40,
                                  chain_bandwidth=1.0)
    result = solve(problem, method, options=SolveOptions(slots=2))
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory is None
    assert "None" not in result.report["hint"] and "slots = 2" in result.report["hint"]


def test_remat_only_hint_does_not_say_below_when_the_least_limit_is_smaller() -> None:
    """Regression: after rounding, feasibility is not monotone in the limit
    (``random_chain(3, seed=1, max_size=8)``, 7 slots: the persistent DP fits 40 B, not
    42 B). ``remat_only``'s hint read "finds no plan below 40 B", false at 42; it now gives
    the smallest memory of a persistent plan, as solved."""
    from optmem.datasets.synthetic import random_chain

    problem = RematOffloadProblem(random_chain(3, seed=1, max_size=8), 42,
                                  chain_bandwidth=1.0)
    result = solve(problem, "remat_only", options=SolveOptions(slots=7))
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory == 40
    assert "below" not in result.report["hint"] and "is 40 B" in result.report["hint"]


PLAN_FINDERS = ("offload_only", "opportunist", "delta", "autocapper")
"""Remat + offload methods whose own search only finds plans."""


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=chains(max_length=2), beta=st.sampled_from([0.5, 1.0, 3.0]),
       above=st.integers(0, 40))
def test_limits_below_the_least_forward_memory_are_proven_infeasible(
        chain: Chain, beta: float, above: int) -> None:
    """Stop 71: below the least memory of every plan (some forward of each stage holds its
    input and output), ``offload_only``, ``opportunist``, ``delta`` and ``autocapper``
    answer ``infeasible`` with that bound in ``report.memory_lower_bound`` (the first three
    said ``no_solution``), and so do ``cpsat`` and ``ilp`` without a search; brute force
    agrees (no plan below it). At or above it, every plan found peaks at least at it."""
    inputs = (chain.input_size, *chain.output_size[:-1])
    least = max(x + y + o for x, y, o in zip(inputs, chain.output_size,
                                             chain.fwd_overhead, strict=True))
    options = SolveOptions(slots=64, threads=1, deterministic_time=20, seed=0)
    below = RematOffloadProblem(chain, least - 1, chain_bandwidth=beta)
    assert solve(below, "brute", options=options).status is Status.INFEASIBLE
    for method in (*PLAN_FINDERS, "cpsat", "ilp"):
        out = solve(below, method, options=options)
        assert out.status is Status.INFEASIBLE and out.unit == 1, (method, out)
        assert out.report["memory_lower_bound"] == least and math.isinf(out.bound)
        assert f"every plan needs at least {least} " in out.report["hint"]
    at = RematOffloadProblem(chain, least + above, chain_bandwidth=beta)
    for method in (*PLAN_FINDERS, "brute"):
        out = solve(at, method, options=options)
        assert "memory_lower_bound" not in out.report, (method, out.report)
        if out.status.has_plan:
            _check_replay(at, out, options)
            assert out.unit == 1 and least <= out.peak_memory <= least + above


@pytest.mark.parametrize("method", [*PLAN_FINDERS, "cpsat", "ilp"])
def test_a_bad_option_is_refused_below_the_least_forward_memory_too(method: str) -> None:
    """Stop 71: the early ``infeasible`` comes after the options are checked (a bad
    ``prefetch`` at 0 B was answered ``infeasible`` by ``offload_only`` in review)."""
    problem = RematOffloadProblem(EXAMPLE, 0, chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match="prefetch"):
        solve(problem, method, options=SolveOptions(extra={"prefetch": "bogus"}))
    assert solve(problem, method).status is Status.INFEASIBLE
