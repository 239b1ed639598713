"""The lifetime relaxation's copy rows inside the full pipeline model (``lifetime_cuts``).

They are valid inequalities (proof: :class:`optmem.models.pipeline._LifetimeCuts`): every
plan of every allocation, written as an assignment of the model with the rows at its own
period, must satisfy them, in both memory models; and the model with them proves the same
optimum as brute force over allocations without them. No wall-clock limits: the
instances are small enough to be proven, CP-SAT runs on one worker with a fixed seed.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.models.pipeline import build_pipeline_model, make_units
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.pipeline_common import run_model
from tests.test_pipeline_benders import trimmable_problems
from tests.test_pipeline_exact import set_partitions, thesis_chain

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the lifetime cuts are checked with CP-SAT")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(threads=1, seed=0, warm_start=False)


@st.composite
def chains(draw) -> PipelineProblem:
    """3-4 layers, 2-3 GPUs, links free or slow, memory from tight to loose, either model."""
    problem = draw(trimmable_problems())
    return replace(problem, memory_model=draw(st.sampled_from(["stash", "strict"])))


def rows(problem: PipelineProblem, **kwargs):
    return build_pipeline_model(make_units(problem), problem.n_gpus, problem.memory_per_gpu,
                                strict=problem.memory_model == "strict", lifetime_cuts=True,
                                **kwargs)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=chains())
def test_every_allocation_optimum_satisfies_the_rows(problem):
    """Each allocation's optimal plan violates no row of the model with the cuts at its period.

    Also: the full model with the cuts proves the brute-force optimum over allocations.
    """
    n = make_units(problem).n
    best = math.inf
    for gpu in set_partitions(n, problem.n_gpus):
        run = run_model(problem, "cpsat", OPTS, gpu=gpu)
        assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
        if run.plan is None:
            continue
        best = min(best, run.plan.period)
        for fixed in (None, gpu):
            form = rows(problem, upper_bound=run.plan.period, gpu=fixed)
            values = form.encode(run.plan)
            assert values is not None
            assert not form.model.violated(values, tol=1e-6), gpu
    full = run_model(problem, "cpsat", OPTS, lifetime_cuts=True,
                     upper_bound=None if math.isinf(best) else best * (1 + 1e-9))
    if math.isinf(best):
        assert full.status is Status.INFEASIBLE
    else:
        assert full.status is Status.OPTIMAL, full.report
        assert full.plan is not None
        assert full.plan.period == pytest.approx(best, abs=1e-6)


def test_rows_are_in_the_model_when_memory_binds():
    """The option adds the copy and chain rows; without a binding memory it adds nothing."""
    chain = thesis_chain([1, 2, 1], [2, 3, 2], [1, 3, 2, 1, 0], [1, 1, 1])
    tight = PipelineProblem(chain, 2, 12, chain_bandwidth=1.0)
    form = rows(tight, upper_bound=8.0)
    names = [c.name for c in form.model.constraints]
    assert sum(name.startswith("lt_own_") for name in names) == 3
    assert any(name.startswith("chain_") for name in names)
    # a cut's link copies are the model's own expression (shifts + order), no free integer
    assert any(name.startswith("chain_link") for name in names)
    assert not any(v.name.startswith("kl_") for v in form.model.vars)
    loose = replace(tight, memory_per_gpu=10**6)
    assert not any(c.name.startswith(("lt_own_", "chain_"))
                   for c in rows(loose, upper_bound=8.0).model.constraints)


PROBES = {"probe_step": 0.05, "probe_work": 5.0, "lifetime_cuts": True,
          "warm_madpipe": False}


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=chains(), method=st.sampled_from(["cpsat", "ilp"]))
def test_probes_keep_the_optimum(problem, method):
    """With probes and cuts the exact method proves the optimum it proves without them."""
    from optmem.solvers.facade import solve
    from tests.test_pipeline_exact import check

    opts = replace(OPTS, warm_start=True)
    plain = solve(problem, method, options=opts)
    probed = solve(problem, method, options=replace(opts, extra=PROBES))
    assert probed.status is plain.status, probed.report
    if plain.status is Status.OPTIMAL:
        check(problem, probed)
        assert probed.objective == pytest.approx(plain.objective, abs=1e-5)
        assert probed.report.get("probe_bound", 0.0) <= plain.objective + 1e-9


def test_probes_raise_the_load_bound():
    """Probes from the load bound (relaxation off) prove more than it, never above the optimum."""
    from optmem.solvers.facade import solve
    from optmem.solvers.pipeline_common import lower_bound
    from tests.test_pipeline_benders import chain_with_subproblems

    problem = chain_with_subproblems()
    optimum = solve(problem, "cpsat", options=replace(OPTS, warm_start=True))
    assert optimum.status is Status.OPTIMAL
    for cuts in (False, True):
        out = solve(problem, "cpsat", options=replace(OPTS, warm_start=True, extra={
            **PROBES, "relaxation": False, "lifetime_cuts": cuts}))
        assert out.status is Status.OPTIMAL
        assert out.objective == pytest.approx(optimum.objective, abs=1e-6)
        probes = out.report["probes"]
        assert probes and probes[0]["status"] == "infeasible", probes
        assert lower_bound(problem) < out.report["probe_bound"] <= optimum.objective + 1e-9


def test_stopped_probe_keeps_a_valid_bound():
    """A probe without enough work proves nothing; the bound stays the relaxation's."""
    from optmem.solvers.facade import solve
    from tests.test_pipeline_benders import chain_with_subproblems

    problem = chain_with_subproblems()
    optimum = solve(problem, "cpsat", options=replace(OPTS, warm_start=True)).objective
    out = solve(problem, "cpsat", options=replace(
        OPTS, warm_start=True, deterministic_time=1e-6,
        extra={**PROBES, "probe_work": 1e-6}))
    assert out.report["probe_bound"] <= optimum + 1e-9
    assert out.bound <= optimum + 1e-9


@pytest.mark.parametrize("extra", [{"probe_step": 2}, {"probe_step": True},
                                   {"probe_work": 0}, {"lifetime_cuts": "yes"}])
def test_bad_probe_options(extra):
    from optmem.errors import OptmemInputError
    from optmem.solvers.facade import solve
    from tests.test_pipeline_benders import chain_with_subproblems

    with pytest.raises(OptmemInputError):
        solve(chain_with_subproblems(), "cpsat", options=replace(OPTS, extra=extra))


def test_refute_bounds_below_the_optimum_and_finds_a_plan_at_it():
    """``refute`` (the one feasibility check of probes, trimmed and isolated solves): below
    the proven optimum it proves a bound at most the optimum; at the optimum it has a plan."""
    from optmem.solvers.facade import solve
    from optmem.solvers.pipeline_common import refute
    from tests.test_pipeline_benders import chain_with_subproblems

    problem = chain_with_subproblems()
    optimum = solve(problem, "cpsat", options=replace(OPTS, warm_start=True))
    assert optimum.status is Status.OPTIMAL
    below = optimum.objective * 0.98
    run, bound = refute(problem, OPTS, below)
    assert run.status is Status.INFEASIBLE
    assert bound == pytest.approx(below - 2 * run.step) and 0 < run.step < 1e-3 * below
    run, bound = refute(problem, OPTS, optimum.objective * (1 + 1e-9))
    assert bound is None and run.plan is not None
    assert run.plan.period <= optimum.objective * (1 + 1e-9) + 1e-9
