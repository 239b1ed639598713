"""The exact OFF_int model (:mod:`optmem.models.offload`): one formulation, two emitters.

* Both emissions of the one model (HiGHS through :func:`to_pulp`, CP-SAT through
  :func:`to_cpsat`) agree on status and optimum on random small instances (exact time grid:
  equal; rounded grid: the CP-SAT relaxation is at most the MILP optimum and its replayed
  plan at least it), each engine's solution satisfies the model (:meth:`Model.violated`,
  independent of both engines), and its decoded plan replays to the model's objective.
* The methods ``cpsat`` and ``ilp`` equal brute force on tiny chains; the bound never
  exceeds the objective; they are never worse than DYNPROG / GREEDY; every plan replays.
* The warm start is a feasible assignment; the cuts and the symmetry breaking do not change
  the optimum; a stopped engine returns the verified warm-start plan with a valid bound.

Every hypothesis test is derandomised; no verdict depends on time (no limits are set: the
instances are solved to optimality).
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_offload import check  # the one replay check of the offload tests

from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.models.formulation import to_cpsat, to_pulp
from optmem.models.offload import OffloadData, build_offload_model, exact_scale
from optmem.plan import parse_mixed_plan
from optmem.problems.offload import OffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.offload import simulate_offload
from optmem.solvers import engines
from optmem.solvers import offload as glue
from optmem.solvers.facade import solve
from optmem.solvers.offload_comm import Layers

# OFFLOAD_EXAMPLES=2000 for a long run
EXAMPLES = int(os.environ.get("OFFLOAD_EXAMPLES", 200))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(max_examples=max(10, EXAMPLES // 8), deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, lengths=(1, 4), integer_times=None):
    """A random chain, a memory between the smallest feasible one and the peak, a bandwidth."""
    n = draw(st.integers(*lengths))
    exact = draw(st.booleans()) if integer_times is None else integer_times
    chain = random_chain(n, seed=draw(st.integers(0, 10**6)),
                         max_size=draw(st.sampled_from([4, 6, 10])), integer_times=exact)
    lay = Layers.of(chain)
    low, high = math.ceil(lay.min_memory()), int(lay.peak())
    memory = low + int(draw(st.floats(0.0, 1.0)) * (high - low))
    beta = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 1.25]))
    return OffloadProblem(chain, memory, chain_bandwidth=beta)


def engine_runs(problem: OffloadProblem, warm_start: bool):
    """The model of ``problem`` solved by HiGHS and CP-SAT (no limits, one thread)."""
    inst = glue.exact_instance(problem, SolveOptions(warm_start=warm_start))
    om = build_offload_model(inst.data)
    pm = to_pulp(om.model)
    highs = engines.solve_pulp(pm.problem, pm.all_variables, "highs", threads=1)
    cp_model = build_offload_model(inst.steps)  # integer steps of 1 / inst.scale
    cm = to_cpsat(cp_model.model, 1)
    cp = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
    return inst, (om, highs), (cp_model, cm, cp)


def replay(problem: OffloadProblem, om, values, scale: int = 1) -> float:
    """The simulated makespan of a model solution (times divided by ``scale``)."""
    disc = problem.discretize()
    schedule = om.decode(values).map(lambda t: t / scale)
    plan = glue.schedule_plan(disc.chain.length, schedule, 1e-6 if scale == 1 else 0.0)
    sim = simulate_offload(disc.chain, plan, problem.unit_bandwidth(disc.unit),
                           disc.memory_limit)
    assert sim.peak_memory <= disc.memory_limit
    return sim.makespan


# ------------------------------------------------------------------ the two emitters
@SETTINGS
@given(problems(), st.booleans())
def test_emitters_agree(problem, warm_start):
    inst, (om, highs), (cp_om, cm, cp) = engine_runs(problem, warm_start)
    if highs.status is Status.INFEASIBLE:  # only without a warm start (it is a solution)
        assert not warm_start or inst.start is None
        assert cp.status is Status.INFEASIBLE
        return
    assert highs.status is Status.OPTIMAL and cp.status is Status.OPTIMAL
    values = highs.values[:len(om.model.vars)]
    assert not om.model.violated(values, tol=1e-5)
    cp_values = cm.values(cp.values)
    assert cm.exact and not cp_om.model.violated(cp_values, tol=1e-9)
    cp_objective = cm.objective(cp.objective) / inst.scale
    tol = 1e-6 * max(1.0, highs.objective)
    assert replay(problem, om, values) <= highs.objective + tol
    cp_replayed = replay(problem, cp_om, cp_values, inst.scale)
    if inst.exact:
        assert cp_objective == pytest.approx(highs.objective, rel=1e-6, abs=1e-6)
        assert cp_replayed == pytest.approx(cp_objective, rel=1e-12, abs=1e-12)
    else:  # the rounded CP-SAT model is a relaxation: its optimum is a bound
        assert cp_objective <= highs.objective + tol
        assert cp_replayed >= highs.objective - tol


def test_rounded_grid_is_stated():
    data = OffloadData((1 / 3, 0.0, 1 / 3), (1, 1, 1), (1, 1, 1), (1,), (2 / 3,), 1, 5.0)
    assert exact_scale([]) == 1
    steps = data.in_steps(1000)
    assert steps.durations == (333, 0, 333) and steps.durations_hi == (334, 0, 334)
    assert steps.transfer == (666,) and steps.upper == 5000
    assert to_cpsat(build_offload_model(steps).model, 1).exact  # integers: no rounding
    assert not to_cpsat(build_offload_model(data).model, 1000).exact
    with pytest.raises(ValueError, match="not multiples"):
        data.in_steps(1000, [Fraction(1, 3)] * 4)


# ------------------------------------------------------------------ methods
def _methods(problem, options=None):
    out = {}
    for name in ("cpsat", "ilp", "dp", "greedy", "frac"):
        result = solve(problem, name, options=options)
        check(problem, result)
        out[name] = result
    return out


def _assert_exact(res) -> None:
    """cpsat and ilp agree; on a rounded time grid cpsat proves only a bound (feasible)."""
    cp, ilp = res["cpsat"], res["ilp"]
    assert cp.status.has_plan is ilp.status.has_plan
    if not cp.status.has_plan:
        assert cp.status is ilp.status
        return
    if cp.report["exact_times"]:
        assert cp.status is ilp.status is Status.OPTIMAL
    else:
        assert ilp.status is Status.OPTIMAL and cp.gap < 1e-6
    assert cp.objective == pytest.approx(ilp.objective, rel=1e-6, abs=1e-6)
    optimum = min(cp.objective, ilp.objective)
    assert res["frac"].bound <= optimum + 1e-9
    for name in ("dp", "greedy"):
        if res[name].status.has_plan:
            assert cp.objective <= res[name].objective + 1e-9, name
            assert ilp.objective <= res[name].objective + 1e-9, name
    if cp.report["exact_times"]:
        assert cp.bound == cp.objective
        assert cp.report["model_objective"] == pytest.approx(cp.objective, rel=1e-9)


@SMALL
@given(problems(lengths=(1, 2)))
def test_exact_equals_brute_force(problem):
    res = _methods(problem)
    brute = solve(problem, "brute")
    check(problem, brute)
    _assert_exact(res)
    assert res["ilp"].status is brute.status
    if brute.status is Status.OPTIMAL:
        assert res["ilp"].status is Status.OPTIMAL
        assert res["ilp"].objective == pytest.approx(brute.objective, rel=1e-6, abs=1e-6)
        assert res["cpsat"].objective == pytest.approx(brute.objective, rel=1e-9, abs=1e-9)
        if res["cpsat"].report["exact_times"]:
            assert res["cpsat"].status is Status.OPTIMAL


@pytest.mark.parametrize("seed", range(3))
def test_exact_equals_brute_force_three_stages(seed):
    chain = random_chain(3, seed=100 + seed, max_size=6)
    lay = Layers.of(chain)
    memory = (math.ceil(lay.min_memory()) + int(lay.peak())) // 2
    problem = OffloadProblem(chain, memory, chain_bandwidth=1.0)
    brute = solve(problem, "brute")
    res = _methods(problem)
    _assert_exact(res)
    assert brute.status is Status.OPTIMAL and res["cpsat"].status is Status.OPTIMAL
    assert res["cpsat"].objective == pytest.approx(brute.objective)


@SMALL
@given(problems(lengths=(3, 6), integer_times=True))
def test_methods_on_longer_chains(problem):
    _assert_exact(_methods(problem))


@SMALL
@given(problems(lengths=(2, 5)))
def test_warm_start_is_a_solution_of_the_model(problem):
    inst = glue.exact_instance(problem, SolveOptions())
    if inst.start is None:
        return
    om = build_offload_model(inst.data)
    values = om.assignment(inst.start.schedule)
    assert not om.model.violated(values, tol=1e-6)
    assert om.model.evaluate(values) == pytest.approx(inst.start.makespan)


def test_warm_start_is_a_solution_of_the_cpsat_emission_on_a_bundled_profile():
    """Realistic magnitudes (times * scale ~ 1e9): the warm start fixed in CP-SAT is feasible.

    Guards the scaled emission against float noise (a bound rounded up past the grid point
    made CP-SAT call ViT-B/16 at 20 % infeasible while the warm start fitted).
    """
    from optmem.datasets import load_dataset
    from optmem.datasets.summary import dataset_summary

    chain, summary = load_dataset("vit-b16-b64-224"), dataset_summary("vit-b16-b64-224")
    low, high = summary["min_feasible"], summary["store_all"]
    problem = OffloadProblem(chain, int(low + 0.2 * (high - low)), "12GB/s")
    inst = glue.exact_instance(problem, SolveOptions())
    assert inst.exact and inst.start is not None
    om = build_offload_model(inst.data)
    assert not om.model.violated(om.assignment(inst.start.schedule), tol=1e-9)
    steps = build_offload_model(inst.steps)
    values = steps.assignment(inst.start.schedule.map(lambda t: round(t * inst.scale)), 0.5)
    assert not steps.model.violated(values, tol=0.0)
    cm = to_cpsat(steps.model, 1)
    assert cm.exact
    for var, value in zip(cm.variables, cm.hint(values), strict=True):
        cm.cp.add(var == value)
    fixed = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
    assert fixed.status is Status.OPTIMAL
    assert cm.objective(fixed.objective) / inst.scale == pytest.approx(inst.start.makespan,
                                                                     rel=1e-12)


@SMALL
@given(problems(lengths=(2, 4), integer_times=True))
def test_cuts_and_symmetry_keep_the_optimum(problem):
    inst = glue.exact_instance(problem, SolveOptions(warm_start=False))
    found = set()
    for cuts, symmetry in ((True, True), (False, False), (True, False)):
        om = build_offload_model(inst.steps, cuts=cuts, symmetry=symmetry)
        cm = to_cpsat(om.model, 1)
        out = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
        assert out.status in (Status.OPTIMAL, Status.INFEASIBLE)
        found.add((out.status, round(cm.objective(out.objective), 9)
                   if out.status is Status.OPTIMAL else None))
    assert len(found) == 1


def test_canonical_plan_moves_equal_sizes_to_low_indices():
    chain = Chain.from_lists([1, 2, 2, 1], [2, 3, 3, 2], [3, 3, 3, 3], [4, 4, 4, 4],
                             input_size=4)  # a^0 and every abar^i have size 4
    plan = parse_mixed_plan(["F_all 1", "F_all 2", "offload abar 2", "F_all 3", "F_all 4",
                             "Loss", "B 4", "prefetch abar 2", "B 3", "B 2", "B 1"])
    moved = glue.canonical_plan(chain, plan)
    assert [str(op) for op in moved if op.kind.value in ("offload", "prefetch")] == [
        "offload a 0", "prefetch a 0"]
    assert simulate_offload(chain, plan[:2] + plan[3:7] + plan[8:], 1.0).peak_memory == 26
    before = simulate_offload(chain, plan, 1.0, 23)  # fits only thanks to the offload
    after = simulate_offload(chain, moved, 1.0, 23)
    assert (before.makespan, after.makespan) == (21.0, 16.0)


# ------------------------------------------------------------------ limits and failures
def _resnet_like(n: int = 8) -> OffloadProblem:
    chain = random_chain(n, seed=5, max_size=12)
    lay = Layers.of(chain)
    memory = math.ceil(lay.min_memory() + 0.3 * (lay.peak() - lay.min_memory()))
    return OffloadProblem(chain, memory, chain_bandwidth=2.0)


@pytest.mark.parametrize("method, adapter", [("cpsat", "solve_cpsat"), ("ilp", "solve_pulp")])
@pytest.mark.parametrize("status", [Status.NO_SOLUTION, Status.ERROR])
def test_stopped_engine_returns_the_verified_warm_start(monkeypatch, method, adapter, status):
    problem = _resnet_like()
    dp = solve(problem, "dp")

    def stopped(*args, **kwargs):
        return engines.EngineResult(status, None, math.nan, math.nan, "stub", 0.0, "stopped")

    monkeypatch.setattr(engines, adapter, stopped)
    result = solve(problem, method)
    check(problem, result)
    assert result.status is Status.FEASIBLE
    assert result.objective <= dp.objective + 1e-9
    assert result.bound == pytest.approx(solve(problem, "frac").bound)
    assert result.report["warm_start"]["method"] in ("dp", "greedy")


def test_stopped_engine_without_warm_start_has_no_plan(monkeypatch):
    problem = _resnet_like()

    def stopped(*args, **kwargs):
        return engines.EngineResult(Status.NO_SOLUTION, None, math.nan, math.nan, "stub", 0.0)

    monkeypatch.setattr(engines, "solve_cpsat", stopped)
    result = solve(problem, "cpsat", options=SolveOptions(warm_start=False))
    assert result.status is Status.NO_SOLUTION and not result.plan
    assert result.bound == pytest.approx(solve(problem, "frac").bound)


def test_rounded_grid_gives_a_valid_bound(monkeypatch):
    problem = _resnet_like(3)
    exact = solve(problem, "cpsat")
    assert exact.status is Status.OPTIMAL and exact.report["exact_times"]
    monkeypatch.setattr(glue, "exact_scale", lambda values: None)
    rounded = solve(problem, "cpsat")
    check(problem, rounded)
    assert not rounded.report["exact_times"]
    assert rounded.report["time_rounding"].startswith("relaxation")
    assert rounded.bound <= exact.objective + 1e-9 <= rounded.objective + 2e-9
    assert rounded.objective == pytest.approx(exact.objective)


def test_proven_optimum_reports_work_and_grid():
    problem = _resnet_like()
    result = solve(problem, "cpsat")
    check(problem, result)
    assert result.status is Status.OPTIMAL and result.gap == 0
    assert result.report["time_rounding"] == "exact"
    assert result.report["time_scale"] == 2  # integer times, transfers z / 2: half units
    assert set(result.report["work"]) == {"branches", "conflicts", "deterministic_time"}
    assert result.report["model"]["intervals"] > 0


def test_ilp_reports_its_node_count():
    problem = _resnet_like()
    result = solve(problem, "ilp")
    check(problem, result)
    assert result.status is Status.OPTIMAL
    assert set(result.report["work"]) == {"nodes"} and result.report["work"]["nodes"] >= 0
    assert result.objective == pytest.approx(solve(problem, "cpsat").objective, rel=1e-6)
