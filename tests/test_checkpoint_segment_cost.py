"""The persistent DP with a cost per recomputed segment (``extra={"segment_cost": c}``).

Issue 13.6 target 1: a re-forward inside a long recomputed segment costs its kernels, each
segment costs more (``docs/pytorch.md``, "What the chain counts (time)"). With
``segment_cost = c`` the DP minimises ``makespan + c * (number of F_ck ops)``; the result is
replayed by the simulator like any other (the DP's value checked against the replayed makespan
plus the segments' charges),
``feasible`` (not optimal for the chain alone), with the extended objective in its report.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError
from optmem.plan import OpKind, parse_plan
from optmem.problems import CheckpointProblem
from optmem.result import SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers.facade import solve


def _segments(plan) -> int:
    return sum(1 for op in parse_plan(plan) if op.kind is OpKind.F_CK)


def _solve(chain: Chain, limit: int, cost: float | None):
    extra = {} if cost is None else {"segment_cost": cost}
    return solve(CheckpointProblem(chain, limit), "dp",
                 options=SolveOptions(slots=10_000, extra=extra))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cost", [0.5, 4.0, 50.0])
def test_extended_objective_is_replayed_and_never_worse(seed, cost):
    """The claim holds (status not error), the report's extended objective is the
    simulated makespan plus the charges, and it is at most the rotor plan's."""
    chain = random_chain(7, seed=300 + seed, max_size=8)
    store = chain.store_all_peak()
    low = max(chain.input_size, store // 3)
    for limit in (low, (low + store) // 2, store - 1):
        base = _solve(chain, limit, None)
        got = _solve(chain, limit, cost)
        assert base.status.has_plan == got.status.has_plan, (seed, limit)
        if not base.status.has_plan:
            continue
        assert base.status is Status.OPTIMAL and got.status is Status.FEASIBLE
        assert got.peak_memory <= got.memory_limit
        n = _segments(got.plan)
        sim = simulate_checkpoint(chain, got.plan)
        assert got.report["segments"] == n
        extended = got.report["objective_with_segments"]
        assert math.isclose(extended, sim.makespan + cost * n, rel_tol=1e-9)
        rotor = base.objective + cost * _segments(base.plan)
        assert extended <= rotor + 1e-9 * max(1.0, rotor)
        assert got.objective >= base.objective - 1e-9 * max(1.0, base.objective)


def test_a_segment_cost_of_zero_is_rotors_dp():
    chain = random_chain(9, seed=5, max_size=8)
    limit = chain.store_all_peak() // 2
    a, b = _solve(chain, limit, None), _solve(chain, limit, 0.0)
    assert a.status is b.status is Status.OPTIMAL
    assert a.plan == b.plan and a.objective == b.objective


def _segments_chain() -> Chain:
    """24 stages in 12 pairs: a cheap small stage (a LayerNorm) then a costly big one."""
    fwd, bwd, out, saved = [], [], [], []
    for _ in range(12):
        fwd += [0.5, 1.0]
        bwd += [0.5, 2.0]
        out += [4, 4]
        saved += [5, 10]
    return Chain.from_lists(fwd, bwd, out, saved, input_size=4)


def test_a_segment_cost_trades_more_recomputation_for_fewer_segments():
    """Rotor's DP re-runs only the costly stages, one segment each; with a cost per segment
    it re-runs longer segments: fewer segments, a smaller total with their charges."""
    chain = _segments_chain()
    limit = (chain.store_all_peak() * 6) // 10
    base, seg = _solve(chain, limit, None), _solve(chain, limit, 3.0)
    assert base.status.has_plan and seg.status.has_plan
    assert _segments(seg.plan) < _segments(base.plan)
    assert seg.objective >= base.objective  # never better for the chain alone
    assert seg.report["objective_with_segments"] < base.objective + 3.0 * _segments(base.plan)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf, "fast", True, False,
                                 np.bool_(True), np.bool_(False), 1.0000001e12, 1e300, 2**70])
def test_a_bad_segment_cost_is_an_input_error(bad):
    chain = random_chain(4, seed=1)
    with pytest.raises(OptmemInputError, match="segment_cost"):
        _solve(chain, chain.store_all_peak() // 2, bad)


@pytest.mark.parametrize("cost", [1e9, 1e12])
def test_a_large_segment_cost_on_a_chain_of_microseconds_keeps_its_plan(cost):
    """Charges of up to 1e12 (the range of every time) dwarf a chain of microseconds: the
    claim ``value - charges`` cancelled (1.907e-05 for 1.9e-05) and the plan was an error."""
    chain = Chain.from_rotor([1e-6, 2e-6, 1e-6, 3e-6], [2e-6, 3e-6, 1e-6, 2e-6, 0],
                             [2, 2, 3, 1, 2], [2, 3, 4, 2, 5])
    result = _solve(chain, 14, cost)
    assert result.status is Status.FEASIBLE, result.report
    assert _segments(result.plan) >= 1
    assert result.objective == simulate_checkpoint(chain, parse_plan(result.plan)).makespan
    assert math.isclose(result.report["objective_with_segments"],
                        result.objective + cost * _segments(result.plan), rel_tol=1e-9)


def test_the_floating_dp_refuses_a_segment_cost():
    chain = random_chain(4, seed=2)
    with pytest.raises(OptmemInputError, match="segment_cost"):
        solve(CheckpointProblem(chain, chain.store_all_peak() // 2), "dp",
              options=SolveOptions(variant="floating", extra={"segment_cost": 1.0}))


# ------------------------------------------------------------------ exact for its model
def _persistent_brute_force(chain: Chain, limit: int, cost: float) -> float:
    """Least ``makespan + cost * F_ck ops`` over every persistent plan (inf if none).

    Dijkstra over the simulator's op model (:func:`optmem.simulate.checkpoint.transition`)
    with the persistence rule of the ``ilp:persistent`` model: ``a^{j-1}`` read by a keeping
    op (``F_ck j`` / ``F_all j``) stays until ``B j`` (no ``F_none j`` consumes it), and no
    ``F_none`` consumes a tape. Independent of the DP's recurrence.
    """
    import heapq
    import itertools

    from optmem.errors import PlanError
    from optmem.plan import LOSS, B, F_all, F_ck, F_none
    from optmem.simulate.checkpoint import A, initial_state, is_final, transition

    if chain.input_size > limit:
        return math.inf
    ops = [LOSS] + [f(i) for i in range(1, chain.length + 1) for f in (F_all, F_ck, F_none, B)]
    tie = itertools.count()
    start = (initial_state(), frozenset())
    frontier = [(0.0, next(tie), start)]
    settled = set()
    while frontier:
        value, _, state = heapq.heappop(frontier)
        if state in settled:
            continue
        settled.add(state)
        stored, kept = state
        if is_final(stored):
            return value
        for op in ops:
            j = op.stage
            if op.kind is OpKind.F_NONE and j - 1 in kept:
                continue
            try:
                after, peak, duration = transition(chain, stored, op)
            except PlanError:
                continue
            if peak > limit or any(v[0] != A for v in stored - after
                                   if op.kind is OpKind.F_NONE):
                continue
            if op.kind in (OpKind.F_CK, OpKind.F_ALL):
                nxt = (after, kept | {j - 1})
            elif op.kind is OpKind.B:
                nxt = (after, kept - {j - 1})
            else:
                nxt = (after, kept)
            if nxt not in settled:
                charge = cost if op.kind is OpKind.F_CK else 0.0
                heapq.heappush(frontier, (value + duration + charge, next(tie), nxt))
    return math.inf


@pytest.mark.parametrize("seed", range(10))
def test_the_dp_is_exact_for_persistent_plans_plus_segment_charges(seed):
    """``objective_with_segments`` equals the brute-force minimum over every persistent plan
    of makespan + cost * F_ck (cost 0: rotor's value), and the report says
    ``model_status: optimal``. Without the persistence rule the brute force finds cheaper
    plans on some of these chains (the full model is larger)."""
    chain = random_chain(3 + seed % 3, seed=seed, max_size=6)
    store = chain.store_all_peak()
    for limit in range(chain.input_size, store + 1, max(1, (store - chain.input_size) // 4)):
        for cost in (0.0, 0.7, 5.0, 40.0):
            got = _solve(chain, limit, cost or None)
            assert got.unit == 1
            brute = _persistent_brute_force(chain, limit, cost)
            if not got.status.has_plan:
                assert brute == math.inf, (seed, limit, cost)
                continue
            value = got.report.get("objective_with_segments", got.objective)
            assert math.isclose(value, brute, rel_tol=1e-12, abs_tol=1e-12), (seed, limit, cost)
            if cost:
                assert got.report["model_status"] == "optimal"
