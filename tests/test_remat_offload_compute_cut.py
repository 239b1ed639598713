"""``extra["benders_compute_cut"]``: after a refutation, the Benders loop refutes the
proposal's whole compute class (every plan of at least its compute time, CP-SAT with the
row ``compute_time >= C``) and adds ``compute_time <= C - 1 / s`` to the master
(:func:`optmem.solvers.remat_offload_benders._compute_cut`).

Checked against brute force (hypothesis, derandomised, ``L <= 2``, with and without ops
that take no time) and the monolithic model's proven optimum on 4-stage chains, with the
loop's own incumbents and with a stale one (the path where refutations, hence class
checks, happen); a deliberately wrong version (the class row added without the CP-SAT
check) must fail the same check. Deterministic: CP-SAT runs with a deterministic-time
limit and a fixed seed, the loops with an iteration cap; no verdict depends on wall-clock
time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import check
from test_remat_offload_exact import tiny, tiny_with_idle_ops
from test_remat_offload_window import (
    SEEDED,
    WINDOW,
    assert_benders_equals_brute,
    assert_stopped_loops_valid,
)

from optmem.chain import Chain
from optmem.models.formulation import Relation
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers import remat_offload_benders as bd

pytest.importorskip("ortools", reason="the Benders subproblem uses OR-Tools CP-SAT")

CLASSES = {**WINDOW, "benders_compute_cut": True, "benders_compute_work": 5.0}


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_compute_cut_benders_equals_brute(chain: Chain, limit: int, beta: float) -> None:
    """``strategy=benders`` with the compute-class cuts and no warm-up equals brute force."""
    assert_benders_equals_brute(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                CLASSES)


def test_compute_cut_loop_bounds_are_valid() -> None:
    """Loops stopped after 2 and 4 iterations: the bound at most the proven optimum, a
    plan replays to its objective, ``optimal`` only at the optimum."""
    assert_stopped_loops_valid(CLASSES)


def _case_loop(monkeypatch: pytest.MonkeyPatch, *, stale: bool) -> tuple[object, object]:
    """``random_chain(4, seed=29, max_size=8)`` at 32 (optimum 30; the relaxation's own
    sequence, master value 29.58, is worth 30 + 3/19 in the model: test_remat_offload_window_jobs'
    ``CASES``): the loop from that sequence's best plan as the incumbent, so the relaxation's
    sequence is refuted while a faster sequence of no smaller compute time exists; ``stale``:
    the loop's better plans not taken. Returns the problem and the result."""
    from test_remat_offload_window_jobs import CASES, _case

    from optmem.engines import adapters as engines
    from optmem.models.formulation import to_cpsat
    from optmem.models.remat_offload import with_fixed
    from optmem.simulate.offload import simulate_offload
    from optmem.solvers.remat_offload_exact import cpsat_time_scale

    seed, limit, ops, value, _ = CASES[1]
    chain, beta, xhat, built = _case(seed, limit, ops)
    scale, exact = cpsat_time_scale(chain, beta)
    assert exact
    cp = to_cpsat(with_fixed(built, xhat, 2 * value), scale=scale)
    out = engines.solve_cpsat(cp.cp, cp.variables, threads=1, seed=1, deterministic_time=20.0)
    assert out.status is Status.OPTIMAL and out.values is not None
    plan = built.decode(cp.values(out.values))
    makespan = simulate_offload(chain, plan, beta, limit).makespan
    assert makespan == pytest.approx(value)
    if stale:
        monkeypatch.setattr(bd, "_improve", lambda loop, plan: None)
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    res = bd.solve_benders(problem, SEEDED.with_(extra={**CLASSES, "benders_iterations": 8}),
                           built=built, scale=scale, incumbent=(makespan, plan), report={})
    return problem, res


CASE_OPTIMUM = 30.0


def test_compute_cut_refutes_a_class_and_proves_the_case(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """From the worse incumbent the loop proves the optimum 30: the refuted sequence's
    class check finds a plan of 30 (the new incumbent), the next refuted proposal's class
    is refuted below 30 (a class row) and the window empties."""
    problem, res = _case_loop(monkeypatch, stale=False)
    check(problem, res, optimum=CASE_OPTIMUM)
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(CASE_OPTIMUM)
    counts = res.report["benders"]
    assert counts["improvements"] >= 1 and counts["compute_cuts"] >= 1
    assert counts["window_proofs"] == 1


def test_compute_cut_with_a_stale_incumbent_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The incumbent kept at 30 + 3/19: the refuted sequence's class holds a plan of 30, so
    its check finds one and adds no row; the bound stays at most 30 and no ``optimal``
    claim is made for the worse plan."""
    problem, res = _case_loop(monkeypatch, stale=True)
    check(problem, res, optimum=CASE_OPTIMUM)
    assert res.report["benders"]["refutation_cuts"] >= 1
    assert res.report["benders"]["compute_checks"]
    assert res.report["benders"]["compute_cuts"] == 0


def test_unproven_compute_cut_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class row added for every refuted proposal without CP-SAT's check cuts the
    optimum's class on the stale case: the loop then claims the worse plan optimal, which
    the check catches."""
    def wrong(loop: bd._Loop, xhat: dict[int, int], n: int) -> None:
        expr = bd.compute_time(loop.built)
        c = expr.const + sum(coef * xhat[i] for i, coef in expr.terms)
        loop.master.add(Relation(expr, None, c - 1.0 / loop.scale), f"wrong_{n}")
        loop.state.counts["compute_cuts"] += 1

    monkeypatch.setattr(bd, "_compute_cut", wrong)
    problem, res = _case_loop(monkeypatch, stale=True)
    assert res.report["benders"]["compute_cuts"] >= 1
    with pytest.raises(AssertionError):
        check(problem, res, optimum=CASE_OPTIMUM)


@pytest.mark.parametrize("option", ["benders_compute_cut=bad", "benders_compute_work=0",
                                    "benders_compute_work=-2"])
def test_bad_compute_cut_options_exit_2_with_one_line(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path, option: str) -> None:
    """A bad value of the new options is one line on stderr and exit 2 on the CLI."""
    from optmem.cli import main
    from optmem.datasets.synthetic import random_chain

    path = tmp_path / "c.json"
    random_chain(3, seed=1).save(path)
    code = main(["solve", "remat-offload", str(path), "-m", "60%", "--bandwidth", "1",
                 "--method", "cpsat", "--option", option])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert option.split("=")[0] in err and len(err.strip().splitlines()) == 1
