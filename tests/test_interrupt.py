"""Untimed Python work stops at its solve's deadline (stop 74, ``optmem.models.interrupt``).

Builds, emissions and DPs poll a predicate; the remat + offload exact methods answer with
what they have when it holds, the pipeline chunk scan stops its enumeration, and HiGHS gets
its model in three array calls. The predicates here count their own calls: no verdict
depends on the machine's clock or load.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from remat_offload_helpers import OPTS, check
from stop_helpers import after

from optmem.datasets.synthetic import random_chain, random_pipeline_chain
from optmem.models import interrupt
from optmem.models.formulation import Model, Relation, to_pulp
from optmem.models.interrupt import Interrupted, poll, poll_now, stop_when
from optmem.models.remat_offload import build_remat_offload
from optmem.problems.pipeline import PipelineProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers import pipeline_chunks as chunked
from optmem.solvers import remat_offload_exact as exact
from optmem.solvers.facade import solve

pytest.importorskip("highspy", reason="the HiGHS model pass is tested against PuLP's")


# ------------------------------------------------------------------ the mechanism
def test_poll_raises_only_inside_a_block_whose_predicate_holds() -> None:
    for _ in range(3 * interrupt.EVERY):
        poll()  # no block: never stops
    poll_now()
    with stop_when(None):
        poll_now()
    with stop_when(lambda: True):
        with pytest.raises(Interrupted):
            poll_now()
        for _ in range(interrupt.EVERY - 1):
            poll()  # evaluated once per EVERY calls
        with pytest.raises(Interrupted):
            poll()


def test_blocks_nest_and_restore_the_outer_predicate() -> None:
    with stop_when(lambda: False):
        with stop_when(lambda: True), pytest.raises(Interrupted):
            poll_now()
        poll_now()  # the outer one is back: it does not hold


def test_a_build_stops_where_its_predicate_first_holds() -> None:
    chain = random_chain(6, seed=3, max_size=8)
    full = build_remat_offload(chain, chain.store_all_peak() // 2, 1.0)
    rows = len(full.model.constraints)
    assert rows > 2 * interrupt.EVERY
    with stop_when(after(2)), pytest.raises(Interrupted):
        build_remat_offload(chain, chain.store_all_peak() // 2, 1.0)
    m = Model("rows")
    x = m.continuous("x", 0, 10)
    with stop_when(after(3)), pytest.raises(Interrupted):
        for k in range(10 * interrupt.EVERY):
            m.add(x >= k % 7, f"r{k}")
    assert len(m.constraints) == 3 * interrupt.EVERY - 1  # stopped at the third check


def test_the_emission_stops_too() -> None:
    m = Model("rows")
    x = m.continuous("x", 0, 10)
    for k in range(3 * interrupt.EVERY):
        m.add(x >= k % 7, f"r{k}")
    m.minimize(x)
    with stop_when(after(2)), pytest.raises(Interrupted):
        to_pulp(m)
    assert to_pulp(m).problem.numConstraints() == 3 * interrupt.EVERY


# ------------------------------------------------------------------ remat + offload
@contextmanager
def _stopping_after(n: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The exact methods' stop predicate replaced by one holding from evaluation ``n``."""
    real = exact.stop_when

    def fake(stop: Callable[[], bool] | None) -> Any:
        del stop
        return real(after(n))

    monkeypatch.setattr(exact, "stop_when", fake)
    yield
    monkeypatch.setattr(exact, "stop_when", real)


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_a_stopped_solve_answers_with_a_replayed_plan_and_a_valid_bound(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after 1, 2, 4, ... predicate checks (every stage in turn): never an error or
    a traceback; the plan replays (``check``), the bound is at most the unstopped proven
    optimum, and ``report["stopped"]`` names the stage. Without a stop the optimum is
    proven, as before."""
    chain = random_chain(6, seed=1, max_size=8)
    problem = RematOffloadProblem(chain, (chain.store_all_peak() * 2) // 3, chain_bandwidth=1.0)
    whole = solve(problem, method, options=OPTS)
    assert whole.status is Status.OPTIMAL and "stopped" not in whole.report
    stages = set()
    n = 1
    while True:
        with _stopping_after(n, monkeypatch):
            res = solve(problem, method, options=OPTS)
        check(problem, res, optimum=whole.objective)
        if "stopped" not in res.report:  # the predicate never held before the answer
            assert res.objective == pytest.approx(whole.objective)
            break
        stages.add(res.report["stopped"])
        assert res.status.has_plan  # the checkpoint-only plan fits at this limit
        if n == 1:  # the relaxation keeps what it has and says where it stopped
            assert "stopped (time)" in res.report["relaxation"].values()
        n *= 2
    labels = {f"time limit (during {s})" for s in (
        "the link relaxation", "the candidate plans", "the model's build", "the search")}
    assert len(stages) >= 2 and stages <= labels, stages


def test_a_solve_stopped_before_any_candidate_still_has_the_cheap_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    chain = random_chain(5, seed=2, max_size=8)
    problem = RematOffloadProblem(chain, (chain.store_all_peak() * 2) // 3, chain_bandwidth=1.0)
    with _stopping_after(1, monkeypatch):
        res = solve(problem, "ilp", options=OPTS)
    assert res.report["stopped"] == "time limit (during the candidate plans)"
    assert "stopped (time)" in res.report["relaxation"].values()  # no bound from it
    assert res.report["incumbent"] in ("checkpoint only (persistent dp)",
                                       "offload only (dynprog)")
    check(problem, res)
    assert res.bound >= problem.chain.total_compute_time() - 1e-9


def test_the_dp_stops_inside_its_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    from optmem.solvers.remat_offload import pofo_plan

    chain = random_chain(8, seed=4, max_size=8)
    problem = RematOffloadProblem(chain, chain.store_all_peak() // 2, chain_bandwidth=1.0)
    assert pofo_plan(problem, OPTS, "extended")[0] is not None
    with stop_when(after(3)), pytest.raises(Interrupted):
        pofo_plan(problem, OPTS, "extended")


# ------------------------------------------------------------------ MadPipe's phase 1
def test_madpipe_phase1_stops_once_it_has_an_allocation() -> None:
    """Algorithm 8 under a stop that holds at once: it ends after its first allocation
    (one DP call, fewer states) with a valid estimate; never before it has one."""
    from optmem.solvers.pipeline_madpipe import algorithm8

    problem = PipelineProblem(random_pipeline_chain(10, seed=3), 3, 10**12)
    whole = algorithm8(problem, exact=True)
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return True

    early = algorithm8(problem, exact=True, stop=stop)
    assert early[2] is not None and early[3] < whole[3] and calls[0] == 1
    assert early[0] >= whole[0]  # the first estimate is never below the best of the loop
    assert algorithm8(problem, exact=True, stop=lambda: False) == whole


def test_a_madpipe_solve_past_its_deadline_runs_no_phase1(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """With the deadline passed before phase 1 (a clock that jumps), MadPipe answers with
    the contiguous plan it computed first, and says why it stopped."""
    from optmem.solvers import pipeline_madpipe as mp

    problem = PipelineProblem(random_pipeline_chain(10, seed=3), 3, 10**12)
    now = [0.0]
    monkeypatch.setattr(mp.time, "perf_counter", lambda: now[0])
    real = mp._contiguous_candidate

    def slow(p: PipelineProblem, stop: Callable[[], bool] | None = None) -> Any:
        out = real(p, stop)
        now[0] += 100.0  # the contiguous DP takes the whole limit (it ends at once since
        return out  # stop 76 when the deadline passes during its search)

    monkeypatch.setattr(mp, "_contiguous_candidate", slow)
    res = solve(problem, "madpipe", options=OPTS.with_(time_limit_s=5.0))
    assert res.status.has_plan and res.report["source"] == "contiguous 1F1B*"
    assert res.report["attempts"] == [{"memory_factor": 1.0, "phase1": "time limit reached"}]


# ------------------------------------------------------------------ pipeline chunks
def test_the_chunk_enumeration_stops_at_a_passed_deadline() -> None:
    from optmem.models.pipeline import make_units

    chain = random_pipeline_chain(10, seed=3)
    problem = PipelineProblem(chain, 3, 10**12)
    units = make_units(problem)
    cap = units.big_m()
    family, truncated = chunked.ranked(problem, units, 2, cap)
    assert family and not truncated
    past = time.perf_counter() - 1.0
    stopped, truncated = chunked.ranked(problem, units, 2, cap, deadline=past)
    assert truncated and stopped == []


def test_the_allocations_bound_keeps_only_what_it_proved_by_a_passed_deadline() -> None:
    """A walk cut short by the deadline proves nothing: the bound falls back to ``low``;
    without a deadline it is higher (the walk proves something)."""
    from optmem.models.pipeline import make_units

    chain = random_pipeline_chain(8, seed=5)
    problem = PipelineProblem(chain, 2, 10**12)
    units = make_units(problem)
    low, cap = units.load(0), units.big_m()
    past = time.perf_counter() - 1.0
    whole = chunked.allocations_bound(units, 2, None, low, cap)
    assert whole > low
    assert chunked.allocations_bound(units, 2, None, low, cap, deadline=past) == low


# ------------------------------------------------------------------ HiGHS model pass
def _random_problem(seed: int) -> Any:
    import random

    import pulp

    rng = random.Random(seed)
    prob = pulp.LpProblem(f"r{seed}", pulp.LpMaximize if seed % 2 else pulp.LpMinimize)
    xs = [prob.add_variable(f"v{rng.randrange(1000)}_{i}", rng.choice([None, -3, 0]),
                            rng.choice([None, 5, 9]),
                            cat=rng.choice([pulp.LpContinuous, pulp.LpInteger, pulp.LpBinary]))
          for i in range(12)]
    prob += pulp.lpSum(rng.randint(-3, 3) * x for x in rng.sample(xs, 6))
    for k in range(15):
        terms = pulp.lpSum(rng.choice([0, 1, -2, 2.5]) * x for x in rng.sample(xs, 4))
        sense = rng.choice(["le", "ge", "eq"])
        rhs = rng.randint(-4, 8)
        prob += ((terms <= rhs) if sense == "le" else (terms >= rhs) if sense == "ge"
                 else (terms == rhs), f"c{k}")
    return prob


@pytest.mark.parametrize("seed", range(12))
def test_the_highs_model_pass_equals_pulps(seed: int) -> None:
    """The array pass gives HiGHS the model PuLP's ``buildSolverModel`` gives it: the same
    columns in the same order, costs, bounds, integrality, rows and coefficients."""
    import highspy
    import numpy as np
    import pulp

    from optmem.engines.adapters import _pass_model

    def lp_of(build: Callable[[Any, Any], None]) -> Any:
        prob = _random_problem(seed)
        prob.fixObjective()
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        prob.solverModel = h
        build(prob, h)
        return h.getLp(), [v.name for v in sorted(prob.variables(), key=lambda v: v.index)]

    solver = pulp.HiGHS(msg=False)
    theirs, their_cols = lp_of(lambda prob, h: solver.buildSolverModel(prob))
    mine, my_cols = lp_of(lambda prob, h: _pass_model(prob, h, highspy, mip=True))
    assert my_cols == their_cols
    for field in ("col_cost_", "col_lower_", "col_upper_", "row_lower_", "row_upper_"):
        assert np.array_equal(np.asarray(getattr(mine, field)),
                              np.asarray(getattr(theirs, field))), field
    assert list(mine.integrality_) == list(theirs.integrality_)

    def dense(lp: Any) -> Any:
        a = lp.a_matrix_
        out = np.zeros((lp.num_row_, lp.num_col_))
        start, index, value = list(a.start_), list(a.index_), list(a.value_)
        rowwise = a.format_ == highspy.MatrixFormat.kRowwise
        for k in range(lp.num_row_ if rowwise else lp.num_col_):
            for p in range(start[k], start[k + 1]):
                if rowwise:
                    out[k, index[p]] += value[p]
                else:
                    out[index[p], k] += value[p]
        return out

    assert np.array_equal(dense(mine), dense(theirs))


@pytest.mark.parametrize("seed", range(6))
def test_solve_pulp_answers_as_before(seed: int) -> None:
    """HiGHS through the array pass answers as CBC on the same random problems."""
    from optmem import engines

    prob = _random_problem(seed)
    out = engines.solve_pulp(prob, prob.variables(), "highs", time_limit_s=None)
    ref = _random_problem(seed)
    cbc = engines.solve_pulp(ref, ref.variables(), "cbc", time_limit_s=None)
    assert out.status is cbc.status, (out.message, cbc.message)
    if cbc.status is Status.OPTIMAL:
        assert out.objective == pytest.approx(cbc.objective, abs=1e-6)
        assert math.isfinite(out.bound)


def test_affine_rows_add_repeated_terms() -> None:
    """``to_pulp`` writes each row at once: a repeated variable's coefficients add up."""
    from optmem.models.formulation import Constraint

    m = Model("dup")
    x = m.continuous("x", 0, 4)
    y = m.continuous("y", 0, 4)
    m.add(Relation(x + y, 2.0, None), "r")
    m.constraints.append(Constraint("twice", ((0, 1.0), (0, 2.0), (1, 1.0)), None, 5.0, ()))
    m.minimize(x - y)
    pm = to_pulp(m)
    row = pm.problem.get_constraint_by_name("twice_hi")
    assert {v.name: c for v, c in row.items()} == {pm.variables[0].name: 3.0,
                                                  pm.variables[1].name: 1.0}


# ------------------------------------------------------------------ checkpoint, offload
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_a_checkpoint_build_stopped_answers_with_the_dp_plan(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build stopped at its first check: the persistent DP plan (computed before the
    build), replayed, with the compute-time bound, never above the proven optimum."""
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.solvers import checkpoint_exact

    chain = random_chain(12, seed=6, max_size=8)
    problem = CheckpointProblem(chain, (chain.store_all_peak() * 2) // 3)
    whole = solve(problem, method, options=OPTS)
    assert whole.status is Status.OPTIMAL and "stopped" not in whole.report
    real = checkpoint_exact.stop_when
    # the DP warm start whole: its own block polls at once since stop 80 (its table's
    # set-up), so a stop at the first check of every block stopped the DP, not the build
    stops = iter([lambda: False, after(1)])
    monkeypatch.setattr(checkpoint_exact, "stop_when", lambda stop: real(next(stops)))
    res = solve(problem, method, options=OPTS)
    assert res.report["stopped"] == "time limit (during the model's build)"
    assert res.status is Status.FEASIBLE and res.report["incumbent"] == "dp plan"
    assert whole.objective - 1e-9 <= res.objective
    assert res.bound <= whole.objective + 1e-9
    dp = solve(problem, "dp", options=OPTS.with_(variant="paper"))
    assert res.objective == pytest.approx(dp.objective)


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_an_offload_build_stopped_answers_with_the_warm_start(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from optmem.problems.offload import OffloadProblem
    from optmem.solvers import offload

    chain = random_chain(6, seed=7, max_size=8)
    problem = OffloadProblem(chain, (chain.store_all_peak() * 2) // 3, chain_bandwidth=1.0)
    whole = solve(problem, method, options=OPTS)
    assert whole.status.has_plan and "stopped" not in whole.report
    real = offload.stop_when
    stops = iter([lambda: False, after(1)])  # the warm start whole (it polls since stop 77)
    monkeypatch.setattr(offload, "stop_when", lambda stop: real(next(stops)))
    res = solve(problem, method, options=OPTS)
    assert res.report["stopped"] == "time limit (during the model's build)"
    assert res.status is Status.FEASIBLE and res.report["incumbent"].startswith("the warm")
    assert whole.bound - 1e-9 <= res.objective and res.bound <= res.objective + 1e-9
    if whole.status is Status.OPTIMAL:
        assert res.bound <= whole.objective + 1e-9


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_a_pipeline_search_stopped_answers_with_the_incumbent(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full pipeline model's search stopped at its first build: the best incumbent
    (contiguous 1F1B* or MadPipe), replayed, with the bound proven before the search."""
    from optmem.solvers import pipeline_exact

    chain = random_pipeline_chain(6, seed=2)
    problem = PipelineProblem(chain, 3, 10**12)
    whole = solve(problem, method, options=OPTS)
    assert whole.status is Status.OPTIMAL and "stopped" not in whole.report
    monkeypatch.setattr(interrupt, "EVERY", 1)  # small models: every row polls
    real = pipeline_exact.stop_when
    monkeypatch.setattr(pipeline_exact, "stop_when", lambda stop: real(after(1)))
    res = solve(problem, method, options=OPTS)
    assert res.report["stopped"] == "time limit (during the model's build)"
    assert res.status.has_plan and res.report["source"] in ("contiguous 1F1B*", "madpipe")
    assert res.objective >= whole.objective - 1e-6
    assert res.bound <= whole.objective + 1e-6 and res.bound <= res.objective + 1e-9
