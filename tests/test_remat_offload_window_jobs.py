"""Window-job rows of the link relaxation (``window_jobs``; ``ro20``).

For two items ``p < q`` with host binaries, the prefetches that end host runs through
``p`` and are due by ``q``, the re-offloads of values back on the host by ``q`` after a gap,
and the offloads of values produced after ``p`` all lie inside ``[E_p, S_q]``
(``build_link_relaxation(..., window_jobs=True)``, proof in its docstring). Checked per
compute sequence against brute force (L <= 2) and against the model's proven value of the
sequence (4-stage chains where the rows bind), over all sequences (never below the rows
without them, never above the optimum), and wrong versions (the re-offload counted twice;
the link 2x slower in the rows) are caught.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import BENDERS, OPTS, check, idle_op_chains
from test_remat_offload_exact import _fixed_sequences
from test_remat_offload_exact import _relaxation as exact_relaxation

from optmem.chain import Chain
from optmem.engines import adapters as engines
from optmem.errors import OptmemInputError
from optmem.models.remat_offload import build_remat_offload
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers.facade import solve

pytest.importorskip("ortools", reason="the exact remat-offload model uses OR-Tools CP-SAT")

ROWS = {"read_deadlines": True, "cumulative_reads": True}


def tiny() -> st.SearchStrategy[Chain]:
    """Chains of 1-3 stages whose forwards and backwards may take no time."""
    return idle_op_chains(3, 4, 5)


def _relaxation(chain: Chain, limit: int, beta: float, fixed: dict[int, float] | None = None,
                **rows: Any) -> float:
    """The link relaxation's optimum (HiGHS, proven; ``inf`` when infeasible).

    HiGHS 1.14.0's MIP presolve returns optima above feasible points on some of these
    models (docstring of build_link_relaxation, Window jobs): presolve off.
    """
    return exact_relaxation(chain, limit, beta, fixed, highs_options={"presolve": "off"},
                            **rows)


def _checked(chain: Chain, limit: int, beta: float, **rows: Any) -> int:
    """For every compute sequence of brute force's enumeration with a plan, the relaxation
    with the window rows (``rows``) and that sequence fixed is at most its best plan."""
    if chain.length > 2:
        return 0  # brute force's transfers: L <= 2
    checked = 0
    for ops, xhat, best in _fixed_sequences(chain, limit, beta):
        bound = _relaxation(chain, limit, beta, xhat, window_jobs=True,
                            **{**ROWS, **rows})
        assert bound <= best + 1e-6, (ops, bound, best)
        checked += 1
    return checked


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_window_jobs_of_a_sequence_never_exceed_its_brute_value(chain: Chain, limit: int,
                                                                 beta: float) -> None:
    """Per compute sequence (brute force's enumeration, L <= 2), the relaxation with the
    window-job rows is at most the sequence's best plan, also with ops that take no
    time."""
    checked = _checked(chain, limit, beta)
    if chain.length <= 2:
        assert checked > 0 or solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                    "brute", options=OPTS).status is Status.INFEASIBLE


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_window_jobs_only_lift_the_relaxation(chain: Chain, limit: int, beta: float) -> None:
    """Over all sequences the window rows never lower the host relaxation and never lift it
    above the optimum (brute force for L <= 2, the model's proven optimum for L = 3)."""
    before = _relaxation(chain, limit, beta, **ROWS)
    after = _relaxation(chain, limit, beta, window_jobs=True, **ROWS)
    assert after >= before - 1e-6
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    if chain.length <= 2:
        best = solve(problem, "brute", options=OPTS)
    else:
        best = solve(problem, "cpsat", options=OPTS.with_(
            threads=1, seed=1, deterministic_time=30.0, extra={"relaxation": False}))
    assert best.status is not Status.ERROR
    if best.status is Status.OPTIMAL:
        assert after <= best.objective + 1e-6
    elif best.status is Status.INFEASIBLE:
        assert after == math.inf or after <= 1e9


# 4-stage chains (random_chain(4, seed, max_size=8), the proofs benchmark's link) where the
# host relaxation's own best sequence (with the read and cumulative rows) is below its value
# in the model and the window rows lift it to that value: (seed, limit, sequence, value)
CASES = (
    (8, 35, ("F_all 1", "F_all 2", "F_ck 3", "F_all 4", "Loss", "B 4", "F_all 3", "B 3",
             "B 2", "B 1"), 26 + 14 / 19, 26 + 7 / 19),
    (29, 32, ("F_ck 1", "F_ck 2", "F_ck 3", "F_all 4", "Loss", "B 4", "F_all 3", "B 3",
              "F_all 2", "B 2", "F_all 1", "B 1"), 30 + 3 / 19, 29 + 11 / 19),
)


def _case(seed: int, limit: int, ops: tuple[str, ...]) -> tuple[Chain, float, dict[int, float],
                                                                   Any]:
    """The chain, link, compute binaries of ``ops`` and the built model of a case."""
    from optmem.datasets.synthetic import random_chain
    from optmem.plan import Op, parse_mixed_plan

    chain = random_chain(4, seed=seed, max_size=8)
    beta = sum(chain.output_size) / sum(chain.fwd_time) / 2
    built = build_remat_offload(chain, limit, beta)
    fixing = built.fixing([op for op in parse_mixed_plan(list(ops)) if isinstance(op, Op)])
    assert fixing is not None
    return chain, beta, {i: x for i, x in fixing.items()
                         if i < len(built.checkpoint.names)}, built


@pytest.mark.parametrize("case", CASES, ids=["seed8", "seed29"])
def test_window_jobs_lift_a_sequence_to_its_value(case: tuple[Any, ...]) -> None:
    """On the cases the window rows lift the sequence's relaxation from below its value in
    the model to exactly that value (CP-SAT with the sequence fixed, proven)."""
    from optmem.models.formulation import to_cpsat
    from optmem.models.remat_offload import with_fixed
    from optmem.solvers.remat_offload_exact import cpsat_time_scale

    seed, limit, ops, value, before = case
    chain, beta, xhat, built = _case(seed, limit, ops)
    scale, exact = cpsat_time_scale(chain, beta)
    assert exact
    cp = to_cpsat(with_fixed(built, xhat, 2 * value), scale=scale)
    out = engines.solve_cpsat(cp.cp, cp.variables, threads=1, seed=1, deterministic_time=20.0)
    assert out.status is Status.OPTIMAL
    assert cp.objective(out.objective) == pytest.approx(value)
    assert _relaxation(chain, limit, beta, xhat, **ROWS) == pytest.approx(before)
    assert _relaxation(chain, limit, beta, xhat, window_jobs=True, **ROWS) == \
        pytest.approx(value)


@pytest.mark.parametrize("case", CASES, ids=["seed8", "seed29"])
def test_a_wrong_window_row_is_caught(monkeypatch: pytest.MonkeyPatch,
                                      case: tuple[Any, ...]) -> None:
    """A deliberately wrong window row (the link 2x slower in it) lifts the sequence's
    relaxation above its value in the model: the check above would catch it."""
    import optmem.models.remat_offload as ro

    real = ro._window_job_rows

    def slow(m, cf, reads, hosts, D, S, bandwidth, size):
        return real(m, cf, reads, hosts, D, S, bandwidth / 2, size)

    seed, limit, ops, value, _ = case
    chain, beta, xhat, _ = _case(seed, limit, ops)
    monkeypatch.setattr(ro, "_window_job_rows", slow)
    assert _relaxation(chain, limit, beta, xhat, window_jobs=True, **ROWS) > value + 1e-3


@settings(max_examples=15, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_solve_with_window_jobs_agrees_with_brute_force(chain: Chain, limit: int,
                                                         beta: float) -> None:
    """``extra["relaxation_window_jobs"]`` (the lazy host rounds with the window rows) keeps
    the Benders strategy's answers consistent and equal to brute force's optimum (L <= 2),
    its bound never above it."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    opts = BENDERS.with_(extra={**BENDERS.extra, "relaxation_window_jobs": True,
                                "relaxation_read_deadlines": True,
                                "relaxation_cumulative_reads": True})
    res = solve(problem, "cpsat", options=opts)
    check(problem, res, opts)
    if chain.length <= 2:
        brute = solve(problem, "brute", options=OPTS)
        assert res.status == brute.status
        if brute.status is Status.OPTIMAL:
            assert res.objective == pytest.approx(brute.objective)
            assert res.bound <= brute.objective + 1e-6



# ``"relaxation": False``: no relaxation stage runs, so nothing else reads these flags
BAD_FLAGS = [{"relaxation_window_jobs": "abc"}, {"relaxation_window_jobs": 2},
             {"relaxation_compact": "maybe"},
             {"relaxation_window_jobs": "abc", "relaxation": False},
             {"relaxation_compact": "maybe", "relaxation": False}]
BENDERS_EXTRA = {"strategy": "benders"}


@pytest.mark.parametrize(("method", "extra"), [
    *(("ilp", e) for e in BAD_FLAGS), *(("cpsat", e) for e in BAD_FLAGS),
    *(("cpsat", {**e, **BENDERS_EXTRA}) for e in BAD_FLAGS)])
def test_bad_flag_values_are_refused_before_any_work(method: str, extra: dict[str, Any]) -> None:
    """A wrong value is one input error, also where the option would never be read.

    (``relaxation_window_jobs`` is read by the lazy host rounds only: before this check a
    ``strategy=full`` solve accepted ``"abc"`` in silence.)
    """
    chain = Chain.from_lists([2.0, 3.0, 1.0], [3.0, 4.0, 2.0], [2, 3, 2], [3, 4, 3], input_size=1,
                             name="bad-flags")
    problem = RematOffloadProblem(chain, 12, chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match=next(iter(extra))):
        solve(problem, method, options=OPTS.with_(extra=extra))
