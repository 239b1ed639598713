"""Smoke test: OR-Tools and highspy in one process (ortools 9.15 + highspy >= 1.15 crash)."""

from __future__ import annotations

import math

import pytest

ortools = pytest.importorskip("ortools", reason="CP-SAT engine (optmem[engines])")
highspy = pytest.importorskip("highspy", reason="HiGHS engine (optmem[engines])")
pulp = pytest.importorskip("pulp", reason="ILP modelling (optmem[engines])")

from optmem.engines import adapters as engines  # noqa: E402
from optmem.result import Status  # noqa: E402


def _knapsack() -> tuple[object, list[object]]:
    prob = pulp.LpProblem("smoke", pulp.LpMinimize)
    xs = [prob.add_variable(f"x{i}", 0, 1, cat=pulp.LpBinary) for i in range(3)]
    prob += 3 * xs[0] + 2 * xs[1] + 4 * xs[2] + 1  # with an objective constant
    prob += (2 * xs[0] + 3 * xs[1] + 4 * xs[2] >= 5, "cover")
    return prob, xs


@pytest.mark.parametrize("engine", ["highs", "cbc"])
def test_ilp_engines_solve_and_warm_start(engine: str) -> None:
    import ortools.sat.python.cp_model  # noqa: F401 - both libraries loaded together

    prob, xs = _knapsack()
    out = engines.solve_pulp(prob, xs, engine, threads=2,
                             initial=[1, 1, 1])
    assert out.status is Status.OPTIMAL
    assert out.objective == pytest.approx(6.0)  # x0 + x1: 3 + 2 + 1
    assert out.bound == pytest.approx(6.0)
    assert [round(v) for v in out.values or []] == [1, 1, 0]


def test_ilp_engine_infeasible() -> None:
    prob, xs = _knapsack()
    prob += (xs[0] + xs[1] + xs[2] >= 4, "impossible")
    for engine in ("highs", "cbc"):
        out = engines.solve_pulp(prob, xs, engine)
        assert out.status is Status.INFEASIBLE
        assert out.values is None and math.isnan(out.objective)


def test_cpsat_engine() -> None:
    import highspy as _h  # noqa: F401 - loaded in the same process on purpose
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    xs = [model.new_bool_var(f"x{i}") for i in range(3)]
    model.add(2 * xs[0] + 3 * xs[1] + 4 * xs[2] >= 5)
    model.minimize(3 * xs[0] + 2 * xs[1] + 4 * xs[2])
    out = engines.solve_cpsat(model, xs, threads=2, hint=[1, 1, 1])
    assert out.status is Status.OPTIMAL
    assert (out.objective, out.bound) == (5.0, 5.0)
    assert out.values == [1.0, 1.0, 0.0]


def test_unknown_or_missing_engine() -> None:
    from optmem.errors import OptmemInputError

    prob, xs = _knapsack()
    with pytest.raises(OptmemInputError, match="unknown ILP solver"):
        engines.solve_pulp(prob, xs, "nope")
    if not engines.is_available("gurobi"):
        with pytest.raises(OptmemInputError, match="not installed"):
            engines.check_engine("gurobi")


# ------------------------------------------------------------------ the solve's work budget
def _schedule(n: int = 18, seed: int = 0) -> tuple[object, list[object]]:
    """A one-machine schedule (weighted completion times) CP-SAT does not prove at once."""
    import random

    from ortools.sat.python import cp_model

    rng = random.Random(seed)
    model = cp_model.CpModel()
    variables, intervals, ends = [], [], []
    for i in range(n):
        size, release = rng.randint(1, 20), rng.randint(0, 60)
        start = model.new_int_var(release, 1000, f"s{i}")
        end = model.new_int_var(0, 1000, f"e{i}")
        intervals.append(model.new_interval_var(start, size, end, f"i{i}"))
        variables += [start, end]
        ends.append((rng.randint(1, 9), end))
    model.add_no_overlap(intervals)
    model.minimize(sum(w * e for w, e in ends))
    return model, variables


def test_a_work_budget_caps_the_sum_of_cpsat_calls_and_skips_calls_when_spent() -> None:
    """Each call gets ``min(deterministic_time, left)``; a call with nothing left is not run.

    Deterministic seconds only: the figures are the same on any machine and load.
    """
    model, xs = _schedule()
    with engines.work_budget(0.05) as budget:
        first = engines.solve_cpsat(model, xs, threads=2, deterministic_time=0.03)
        second = engines.solve_cpsat(model, xs, threads=2)  # no limit of its own: 0.02 left
        third = engines.solve_cpsat(model, xs, threads=2, deterministic_time=0.03)
    assert budget is not None and engines.active_budget() is None  # closed after the block
    assert first.status is Status.FEASIBLE and first.stopped_by == "deterministic_time"
    assert second.status is Status.FEASIBLE and second.stopped_by == "work_budget"
    assert second.info["deterministic_time"] == pytest.approx(0.02, abs=1e-3)
    assert third.status is Status.NO_SOLUTION and third.stopped_by == "work_budget"
    assert third.values is None and third.info == {"deterministic_time": 0.0, "skipped": True}
    report = budget.report()
    assert report["work_used"] == pytest.approx(0.05, abs=1e-3)
    assert (report["work_calls"], report["work_cut_calls"], report["work_skipped_calls"]) \
        == (2, 1, 1)
    assert report["work_exhausted"] is True


def test_a_work_budget_cannot_be_widened_by_a_call_s_parameters() -> None:
    """``parameters`` cannot lift the budget's limit nor add workers (no bypass)."""
    model, xs = _schedule()
    with engines.work_budget(0.01) as budget:
        out = engines.solve_cpsat(model, xs, threads=8, parameters={
            "max_deterministic_time": 100.0, "num_workers": 8})
    assert out.stopped_by == "work_budget"
    assert out.info["deterministic_time"] == pytest.approx(0.01, abs=1e-3)
    assert budget is not None and budget.used == out.info["deterministic_time"]


def test_threads_charge_the_budget_of_the_solve_that_started_them() -> None:
    """Context variables do not follow a thread; :func:`carry_budget` makes them."""
    import threading

    model, xs = _schedule()
    seen: list[object] = []

    def call() -> None:
        seen.append(engines.solve_cpsat(model, xs, threads=1, deterministic_time=0.01))

    with engines.work_budget(1.0) as budget:
        plain = threading.Thread(target=call)
        plain.start()
        plain.join()
        assert budget is not None and budget.calls == 0  # a bare thread is outside the solve
        carried = threading.Thread(target=engines.carry_budget(call))
        carried.start()
        carried.join()
        assert budget.calls == 1 and budget.used > 0


def test_nested_budgets_share_the_outermost_and_count_milp_calls() -> None:
    prob, xs = _knapsack()
    with engines.work_budget(1.0) as outer, engines.work_budget(5.0) as inner:
        assert inner is outer
        out = engines.solve_pulp(prob, xs, "highs")
    assert out.status is Status.OPTIMAL
    assert outer is not None and outer.report()["work_milp_calls"] == 1
    assert outer.used == 0.0
    with engines.work_budget(None) as none:
        assert none is None and engines.active_budget() is None


def test_an_unbounded_budget_measures_without_limiting() -> None:
    model, xs = _schedule(8)
    plain = engines.solve_cpsat(model, xs, threads=1, seed=3)
    with engines.work_budget(math.inf) as budget:
        measured = engines.solve_cpsat(model, xs, threads=1, seed=3)
    assert measured.status is plain.status is Status.OPTIMAL
    assert measured.objective == plain.objective and measured.stopped_by is None
    assert budget is not None and budget.used == pytest.approx(
        measured.info["deterministic_time"]) and budget.report()["work_exhausted"] is False
