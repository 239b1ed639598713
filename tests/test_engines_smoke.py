"""Smoke test: OR-Tools and highspy in one process (ortools 9.15 + highspy >= 1.15 crash)."""

from __future__ import annotations

import math

import pytest

ortools = pytest.importorskip("ortools", reason="CP-SAT engine (optmem[engines])")
highspy = pytest.importorskip("highspy", reason="HiGHS engine (optmem[engines])")
pulp = pytest.importorskip("pulp", reason="ILP modelling (optmem[engines])")

from optmem.result import Status  # noqa: E402
from optmem.solvers import engines  # noqa: E402


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
