"""The solve's work budget bounds HiGHS and CBC calls too (``milpbudget``, CONTRACT 14).

Before: :func:`~optmem.engines.adapters.solve_pulp` only counted its calls under a
``work_budget``; a checkpoint ``ilp`` solve under ``work_budget=0.1`` ran HiGHS to its
proof (682 limit checks, 21-41 s of wall clock on the 20-stage chain below, 519 s on a
40-stage one, under load), and what it returned depended on nothing the budget set. Now each
HiGHS call is interrupted at the limit check that spends what is left (50 checks per
deterministic second, one thread), each CBC call gets ``maxNodes`` from it (50 nodes per
deterministic second), both are charged what they used, and a call made with nothing left
is not run. Every verdict rests on deterministic counts: no test reads a clock.
"""

from __future__ import annotations

import math
import random

import pytest
from json_helpers import timeless

pulp = pytest.importorskip("pulp", reason="ILP modelling (optmem[engines])")
pytest.importorskip("highspy", reason="HiGHS engine (optmem[engines])")

from optmem.datasets.synthetic import random_chain  # noqa: E402
from optmem.engines import adapters as engines  # noqa: E402
from optmem.problems.checkpoint import CheckpointProblem  # noqa: E402
from optmem.result import Status  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402

HARD_OPTIMUM = 184.0
"""The optimum of :func:`_hard` (HiGHS and CP-SAT prove it without a budget)."""


def _hard() -> CheckpointProblem:
    """A 20-stage chain at 30 % of its store-all peak: HiGHS does not prove it at the root
    (bound 178 after 5 limit checks, 180 after 50; 682 checks to the proof from the DP
    warm start)."""
    chain = random_chain(20, seed=0)
    return CheckpointProblem(chain, memory_limit=int(chain.store_all_peak() * 0.3))


def _knapsack() -> tuple[object, list[object]]:
    prob = pulp.LpProblem("smoke", pulp.LpMinimize)
    xs = [prob.add_variable(f"x{i}", 0, 1, cat=pulp.LpBinary) for i in range(3)]
    prob += 3 * xs[0] + 2 * xs[1] + 4 * xs[2] + 1
    prob += (2 * xs[0] + 3 * xs[1] + 4 * xs[2] >= 5, "cover")
    return prob, xs


def _lp(n: int = 120, seed: int = 0) -> tuple[object, list[object]]:
    """A dense random covering LP (no integer variable) the simplex needs many
    iterations for."""
    rng = random.Random(seed)
    prob = pulp.LpProblem("lp", pulp.LpMinimize)
    xs = [prob.add_variable(f"x{i}", 0, 10) for i in range(n)]
    prob += pulp.lpSum(rng.randint(1, 9) * x for x in xs)
    for j in range(n):
        prob += (pulp.lpSum(rng.randint(0, 5) * x for x in xs) >= rng.randint(10, 50),
                 f"c{j}")
    return prob, xs


def test_an_ilp_under_a_tiny_budget_gives_the_same_json_twice_with_a_valid_bound() -> None:
    """HiGHS stops at the check that spends the budget: the same JSON twice (timings
    aside), ``feasible`` with a replayed plan and a bound at most the optimum, and the MILP
    work in the budget's report (before: ``optimal`` after the whole search, work 0)."""
    problem = _hard()
    first = solve(problem, "ilp", threads=2, work_budget=0.1)
    again = solve(problem, "ilp", threads=2, work_budget=0.1)
    assert timeless(first) == timeless(again)
    assert first.status is Status.FEASIBLE and first.plan
    assert first.bound <= HARD_OPTIMUM + 1e-9 <= first.objective + 1e-9
    report = first.report
    assert report["engine_stopped_by"] == "work_budget"
    assert report["work_milp_calls"] == 1 and report["work_milp_cut_calls"] == 1
    assert report["work_milp_skipped_calls"] == report["work_milp_unbounded_calls"] == 0
    # five checks at 50 per deterministic second: the grant, reached exactly
    assert report["work_used"] == report["work_milp_used"] == pytest.approx(0.1)
    assert report["work_exhausted"] is True and report["work_calls"] == 0


def _small() -> CheckpointProblem:
    chain = random_chain(12, seed=1)
    return CheckpointProblem(chain, memory_limit=int(chain.store_all_peak() * 0.5))


def test_a_budget_that_covers_the_search_proves_the_optimum_and_charges_its_checks() -> None:
    problem = _small()
    proven = solve(problem, "ilp", threads=1)
    out = solve(problem, "ilp", threads=1, work_budget=100.0)
    assert out.status is proven.status is Status.OPTIMAL
    assert out.objective == proven.objective and "engine_stopped_by" not in out.report
    assert 0.0 < out.report["work_milp_used"] < 100.0
    assert out.report["work_exhausted"] is False


@pytest.mark.parametrize("seed", range(4))
def test_bounds_under_a_budget_are_never_above_the_optimum(seed: int) -> None:
    """12-stage chains HiGHS proves without a budget; under 0.02 deterministic seconds
    (one check) every bound stays at most that optimum and every plan at least it."""
    chain = random_chain(12, seed=seed)
    problem = CheckpointProblem(chain, memory_limit=int(chain.store_all_peak() * 0.4))
    proven = solve(problem, "ilp", threads=1)
    assert proven.status is Status.OPTIMAL
    small = solve(problem, "ilp", threads=1, work_budget=0.02)
    assert small.report["engine_stopped_by"] == "work_budget"  # before: HiGHS ran on
    assert small.status in (Status.FEASIBLE, Status.OPTIMAL)
    assert small.bound <= proven.objective + 1e-9
    assert small.objective >= proven.objective - 1e-9
    if small.status is Status.OPTIMAL:
        assert small.objective == pytest.approx(proven.objective)


@pytest.mark.parametrize("engine", ["highs", "cbc"])
def test_a_spent_budget_skips_the_milp_call(engine: str) -> None:
    prob, xs = _knapsack()
    with engines.work_budget(0.5) as budget:
        assert budget is not None
        budget.charge(0.5, cut=False)  # spent by earlier calls
        out = engines.solve_pulp(prob, xs, engine, initial=[1, 1, 1])
    assert out.status is Status.NO_SOLUTION and out.stopped_by == "work_budget"
    assert out.values is None and out.info == {"work": 0.0, "skipped": True}
    report = budget.report()
    assert (report["work_milp_calls"], report["work_milp_skipped_calls"]) == (1, 1)
    assert report["work_milp_used"] == 0.0


@pytest.mark.slow
def test_cbc_gets_its_nodes_from_the_budget_and_is_charged_them() -> None:
    """CBC, single-threaded, ``maxNodes`` from what is left (the smaller of it and
    ``node_limit``): the same answer twice, stopped by the budget, bound at most the
    optimum."""
    if not engines.is_available("cbc"):
        pytest.skip("CBC is not available")
    problem = _hard()
    first = solve(problem, "ilp", solver="cbc", threads=2, work_budget=0.1)
    again = solve(problem, "ilp", solver="cbc", threads=2, work_budget=0.1)
    assert timeless(first) == timeless(again)
    assert first.status is Status.FEASIBLE
    assert first.bound <= HARD_OPTIMUM + 1e-9 <= first.objective + 1e-9
    assert first.report["engine_stopped_by"] == "work_budget"
    assert first.report["work_milp_used"] == pytest.approx(0.1)  # 5 nodes


def test_cbc_s_node_limit_is_the_smaller_of_the_user_s_and_the_budget_s() -> None:
    def nodes(grant: float | None, node_limit: int | None) -> tuple[int | None, bool]:
        return engines._cbc_nodes(engines._Settings(None, 1, None, False, node_limit, 0,
                                                    work_grant=grant))

    assert nodes(None, None) == (None, False) and nodes(None, 7) == (7, False)
    assert nodes(0.1, None) == (5, True) and nodes(0.1, 2) == (2, False)
    assert nodes(1e-9, None) == (1, True)  # at least the root
    assert nodes(math.inf, 7) == (7, False) and nodes(math.inf, None) == (None, False)


def test_a_pure_lp_is_bounded_by_simplex_iterations() -> None:
    """An LP makes no MIP limit check: HiGHS is interrupted at the simplex iteration that
    spends the grant (10,000 per deterministic second), with no bound claimed."""
    prob, xs = _lp()
    free = engines.solve_pulp(prob, xs, "highs", threads=1)
    assert free.status is Status.OPTIMAL
    with engines.work_budget(0.001) as budget:  # 10 iterations
        out = engines.solve_pulp(prob, xs, "highs", threads=1)
    assert out.status is Status.NO_SOLUTION and out.stopped_by == "work_budget"
    assert math.isnan(out.bound)
    assert out.info["lp_iterations"] >= 10 and out.info["checks"] == 0
    assert budget is not None and budget.milp_used == pytest.approx(
        out.info["lp_iterations"] / engines.HIGHS_LP_ITERATIONS_PER_SECOND)
    with engines.work_budget(100.0) as roomy:
        full = engines.solve_pulp(prob, xs, "highs", threads=1)
    assert full.status is Status.OPTIMAL and full.objective == pytest.approx(free.objective)
    assert roomy is not None and 0.0 < roomy.milp_used < 100.0


def test_an_unbounded_budget_measures_highs_without_limiting() -> None:
    problem = _small()
    plain = solve(problem, "ilp", threads=1)
    measured = solve(problem, "ilp", threads=1, work_budget=math.inf)
    assert measured.status is plain.status is Status.OPTIMAL
    assert measured.objective == plain.objective
    assert measured.report["work_milp_used"] > 0.0
    assert measured.report["work_exhausted"] is False


def test_the_pipeline_polish_lp_runs_even_when_the_mip_spent_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline ILP re-solves its LP with the integers fixed to read the plan exactly.

    Under a budget its MIP spends (0.02: one check), that LP was skipped with the rest
    (``no_solution``, ``work_budget``: found by this hunt, introduced by the change above)
    and the plan decoded from the unpolished values. It now runs outside the budget.
    """
    from test_pipeline_lns import missed_chain

    seen: list[engines.EngineResult] = []
    real = engines.solve_pulp

    def spy(*args: object, **kwargs: object) -> engines.EngineResult:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(out)
        return out

    monkeypatch.setattr(engines, "solve_pulp", spy)
    out = solve(missed_chain(), "ilp", threads=1, work_budget=0.02)
    assert out.status is Status.FEASIBLE and out.bound <= 12.0 <= out.objective
    assert [r.stopped_by for r in seen] == ["work_budget", None]
    assert seen[1].status is Status.OPTIMAL and not seen[1].info.get("skipped")
    assert out.report["work_milp_skipped_calls"] == 0
