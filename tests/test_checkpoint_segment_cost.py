"""The persistent DP with a cost per recomputed segment (``extra={"segment_cost": c}``).

Issue 13.6 target 1: a re-forward inside a long recomputed segment costs its kernels, each
segment costs more (``docs/pytorch.md``, "What the chain does not count"). With
``segment_cost = c`` the DP minimises ``makespan + c * (number of F_ck ops)``; the result is
replayed by the simulator like any other (claim = value minus the segments' charges),
``feasible`` (not optimal for the chain alone), with the extended objective in its report.
"""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "fast"])
def test_a_bad_segment_cost_is_an_input_error(bad):
    chain = random_chain(4, seed=1)
    with pytest.raises(OptmemInputError, match="segment_cost"):
        _solve(chain, chain.store_all_peak() // 2, bad)


def test_the_floating_dp_refuses_a_segment_cost():
    chain = random_chain(4, seed=2)
    with pytest.raises(OptmemInputError, match="segment_cost"):
        solve(CheckpointProblem(chain, chain.store_all_peak() // 2), "dp",
              options=SolveOptions(variant="floating", extra={"segment_cost": 1.0}))
