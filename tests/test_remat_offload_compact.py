"""``build_link_relaxation(..., compact=True)``: the deadline rows with fewer non-zeros.

A reformulation, not a new bound: the continuous ``y[p,k]`` are defined by equalities from
the other variables (``build_link_relaxation``, **Compact deadline rows**), so for every
compute sequence the compact relaxation must have exactly the optimum of the written-out
one, and therefore stay at most brute force's optimum. Checked on every compute sequence
of brute force's enumeration on tiny chains (hypothesis, derandomised), over all
sequences, on a 10-stage chain, and a deliberately wrong version (``y`` not raised by the
values a ``Loss`` / ``B`` reads) must fail the same check. HiGHS to optimality, no time
limit: no verdict depends on the machine's load.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import OPTS
from test_remat_offload_exact import _fixed_sequences, _relaxation, tiny, tiny_with_idle_ops

import optmem.models.remat_offload as ro
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.models.remat_offload import build_link_relaxation
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers.facade import solve

pytest.importorskip("highspy", reason="the link relaxation is solved by HiGHS")

ROWS: tuple[dict[str, Any], ...] = (
    {"host_values": False, "deadlines": False},
    {"host_values": False},
    {"host_values": False, "read_deadlines": True},
    {"host_values": False, "read_deadlines": True, "cumulative_reads": True},
    {"host_items": (), "read_deadlines": True},
)


def _per_sequence(chain: Chain, limit: int, beta: float) -> int:
    """For every compute sequence with a plan (brute force's enumeration), the compact
    relaxation with that sequence fixed equals the written-out one and is at most the
    sequence's best plan; returns how many sequences were checked."""
    checked = 0
    for ops, xhat, best in _fixed_sequences(chain, limit, beta):
        for kw in ROWS:
            written = _relaxation(chain, limit, beta, xhat, **kw)
            compact = _relaxation(chain, limit, beta, xhat, compact=True, **kw)
            assert compact == pytest.approx(written, abs=1e-6), (ops, kw, compact, written)
            assert compact <= best + 1e-6, (ops, kw, compact, best)
        checked += 1
    return checked


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_compact_rows_give_the_same_relaxation_per_sequence(chain: Chain, limit: int,
                                                            beta: float) -> None:
    """Per compute sequence: the same optimum as the written-out rows, at most brute
    force's best plan of the sequence (also with ops that take no time)."""
    checked = _per_sequence(chain, limit, beta)
    assert checked > 0 or solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                "brute", options=OPTS).status is Status.INFEASIBLE


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_compact_rows_give_the_same_relaxation(chain: Chain, limit: int, beta: float) -> None:
    """Over all sequences: the same optimum, never above brute force's optimum."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    for kw in ROWS:
        written = _relaxation(chain, limit, beta, **kw)
        compact = _relaxation(chain, limit, beta, compact=True, **kw)
        assert compact == pytest.approx(written, abs=1e-6) or \
            (math.isinf(compact) and math.isinf(written))
        if brute.status.has_plan:
            assert compact <= brute.objective + 1e-6


def _sizes(model: Any) -> int:
    return sum(len(c.terms) for c in model.constraints)


def test_compact_rows_on_a_longer_chain() -> None:
    """``random_chain(8, seed=1)`` at a tight limit: the same optimum with the read
    deadlines and the cumulative rows, fewer non-zeros."""
    chain = random_chain(8, seed=1)
    limit = (chain.store_all_peak() + 3 * min(chain.output_size)) // 4
    kw = {"host_values": False, "read_deadlines": True, "cumulative_reads": True}
    written = build_link_relaxation(chain, limit, 1.0, **kw)
    compact = build_link_relaxation(chain, limit, 1.0, compact=True, **kw)
    assert _sizes(compact) < _sizes(written)
    assert _relaxation(chain, limit, 1.0, compact=True, **kw) == pytest.approx(
        _relaxation(chain, limit, 1.0, **kw), abs=1e-6)


# a chain, limit and link where a deadline row binds (the READ_ROW_CASE of
# tests/test_remat_offload_exact.py)
ROW_CASE = (Chain.from_lists([3, 4], [6, 4], [3, 2], [3, 2], input_size=2,
                             fwd_overhead=[1, 0]), 10, 3.0)


def test_a_wrong_compact_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong ``y`` chain (``y = r_p``: the unread size outside ``V(p, q)`` never
    subtracted, as if all of the relief had to come back before ``q``) fails the
    per-sequence check."""
    real = ro._compact_outside

    def wrong(m, p, relief, unread, size):  # type: ignore[no-untyped-def]
        inner = real(m, p, relief, unread, size)
        return lambda seen: inner(set(unread))

    chain, limit, beta = ROW_CASE
    assert _per_sequence(chain, limit, beta) > 0
    monkeypatch.setattr(ro, "_compact_outside", wrong)
    with pytest.raises(AssertionError):
        _per_sequence(chain, limit, beta)
