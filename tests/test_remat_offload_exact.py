"""Exact remat + offload optima (CP-SAT model, brute force) against the DP and pure optima."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.problems.checkpoint import CheckpointProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.remat_offload import RematOffloadProblem, verify_plan
from optmem.result import SolveOptions, Status
from optmem.solvers.facade import solve

pytest.importorskip("ortools", reason="the exact remat-offload model uses OR-Tools CP-SAT")

EXAMPLE = Chain.from_lists([2, 2, 2], [4, 4, 4], [2, 2, 2], [4, 4, 4], input_size=2)
OPTS = SolveOptions(slots=64)


@pytest.mark.parametrize(("limit", "beta", "expected"), [
    (10, 0.5, 32), (10, 1.0, 26), (10, 2.0, 24), (12, 1.0, 22), (12, 2.0, 21), (14, 1.0, 20),
])
def test_example_exact(limit: int, beta: float, expected: float) -> None:
    problem = RematOffloadProblem(EXAMPLE, limit, chain_bandwidth=beta)
    exact = solve(problem, "cpsat", options=OPTS)
    assert exact.status is Status.OPTIMAL
    assert exact.objective == pytest.approx(expected)
    assert verify_plan(problem, list(exact.plan), OPTS)["objective"] == pytest.approx(expected)
    dp = solve(problem, "dp", options=OPTS)
    assert exact.objective <= dp.objective + 1e-9


def test_example_exact_infeasible() -> None:
    assert solve(RematOffloadProblem(EXAMPLE, 8, chain_bandwidth=1.0), "cpsat",
                 options=OPTS).status is Status.INFEASIBLE


@st.composite
def tiny(draw: st.DrawFn) -> Chain:
    n = draw(st.integers(1, 2))
    out = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    extra = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return Chain.from_lists(
        draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)),
        draw(st.lists(st.integers(1, 6), min_size=n, max_size=n)),
        out, [o + e for o, e in zip(out, extra, strict=True)],
        input_size=draw(st.integers(1, 4)),
        fwd_overhead=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        loss_bwd_time=draw(st.integers(0, 2)))


@settings(max_examples=30, deadline=None)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_exact_equals_brute_and_bounds(chain: Chain, limit: int, beta: float) -> None:
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    exact = solve(problem, "cpsat", options=OPTS)
    brute = solve(problem, "brute", options=OPTS)
    assert exact.status is not Status.ERROR and brute.status is not Status.ERROR
    assert exact.status.has_plan == brute.status.has_plan
    if not exact.status.has_plan:
        for name in ("dp", "remat_only", "offload_only", "autocapper"):
            assert not solve(problem, name, options=OPTS).status.has_plan, name
        return
    assert exact.objective == pytest.approx(brute.objective)
    assert verify_plan(problem, list(exact.plan), OPTS)["objective"] == \
        pytest.approx(exact.objective)
    # exact <= every heuristic plan (they live in the same simulator's plan space)
    for name in ("dp", "remat_only", "offload_only", "opportunist", "autocapper"):
        res = solve(problem, name, options=OPTS)
        if res.status.has_plan:
            assert exact.objective <= res.objective + 1e-9, name
    # like with like: exact pure optima (full checkpoint model, exact OFF_int)
    ckpt = solve(CheckpointProblem(chain, limit), "brute", options=OPTS)
    if ckpt.status.has_plan:
        assert exact.objective <= ckpt.objective + 1e-9
    off = solve(OffloadProblem(chain, limit, chain_bandwidth=beta), "brute", options=OPTS)
    if off.status.has_plan:
        assert exact.objective <= off.objective + 1e-9
