"""The slim fixed-allocation pipeline model (``SLIM_FIXED``) against the general one.

With the allocation fixed, :func:`~optmem.models.pipeline.build_pipeline_model` writes the
allocation's indicators as constants and leaves out the rows of pairs that never share a
GPU or link. These tests check that this changes the size of the model and nothing else:
the same optimum (both proven, both emitters), the same plans accepted, and far fewer rows.
Every solve runs without a time limit (small instances that always prove).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the CP-SAT pipeline model needs OR-Tools")

from pipeline_helpers import (  # noqa: E402
    assert_model_agrees_with_simulator,
    assert_replays,
    equal_split_plan,
)

import optmem.models.pipeline as mp  # noqa: E402
from optmem.models.pipeline import build_pipeline_model, first_use, make_units  # noqa: E402
from optmem.solvers.pipeline_common import run_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(warm_start=False, threads=1)


@st.composite
def fixed_problems(draw):
    """A chain of 2-5 layers, 2-3 GPUs, a link of three speeds, and one allocation."""
    n = draw(st.integers(2, 5))
    f = [draw(st.integers(1, 3)) for _ in range(n)]
    b = [draw(st.integers(1, 4)) for _ in range(n)]
    a = [draw(st.integers(0, 3)) for _ in range(n)] + [0]
    w = [draw(st.integers(0, 3)) for _ in range(n)]
    gpus = draw(st.integers(2, 3))
    chain = Chain.from_lists(f, b, a[1:], a[1:], input_size=a[0], weight_size=w)
    lay = PipelineProblem(chain, gpus, 0).layers
    heavy = 3 * sum(lay.w) + 2 * sum(lay.x) + 4 * sum(lay.a)
    memory = draw(st.integers(max(lay.x) + 3 * max(lay.w), max(heavy, 1) + 1))
    beta = draw(st.sampled_from([math.inf, 1.0, 2.0]))
    problem = PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)
    if draw(st.booleans()):
        problem = replace(problem, memory_model="strict")
    gpu = first_use([draw(st.integers(0, gpus - 1)) for _ in range(n)])
    return problem, list(gpu)


def solve_fixed(problem: PipelineProblem, gpu: list[int], method: str, slim: bool):
    saved = mp.SLIM_FIXED
    mp.SLIM_FIXED = slim
    try:
        return run_model(problem, method, OPTS, gpu=gpu)
    finally:
        mp.SLIM_FIXED = saved


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=fixed_problems(), method=st.sampled_from(["cpsat", "ilp"]))
def test_slim_equals_general_model(case, method):
    """Same status and proven optimum for the fixed allocation; both plans replay."""
    problem, gpu = case
    slim = solve_fixed(problem, gpu, method, True)
    general = solve_fixed(problem, gpu, method, False)
    assert slim.status is general.status, (slim.report, general.report)
    if slim.status is Status.INFEASIBLE:
        return
    assert slim.status is Status.OPTIMAL
    tol = max(slim.step, general.step) + 1e-6
    assert slim.plan.period == pytest.approx(general.plan.period, abs=tol)
    for run in (slim, general):
        assert_replays(problem, run.plan)
        assert mp.plan_gpus(make_units(problem), run.plan) == tuple(gpu)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=fixed_problems(), frac=st.floats(0, 1))
def test_slim_model_accepts_what_the_simulator_accepts(case, frac):
    """A 1F1B* plan of a contiguous allocation, encoded in the slim model of that allocation,
    violates nothing iff the simulator accepts it (else only memory rows), as in the general
    model; its objective is the plan's period."""
    problem, _ = case
    plan = equal_split_plan(problem, frac)
    units = make_units(problem)
    gpu = mp.plan_gpus(units, plan)
    assert gpu is not None
    form = build_pipeline_model(units, problem.n_gpus, problem.memory_per_gpu,
                                strict=problem.memory_model == "strict", gpu=gpu)
    values = assert_model_agrees_with_simulator(form, problem, plan)
    assert form.decode(values).period == pytest.approx(plan.period)


def test_slim_model_is_smaller_on_resnet50():
    """ResNet-50's 21 units on 4 GPUs, one two-chunk allocation: a tenth of the rows."""
    from optmem.datasets import resolve_chain

    problem = PipelineProblem(resolve_chain("resnet50-b32-224"), 4, 3 * 2**30,
                              bandwidth=12e9)
    units = make_units(problem)
    gpu = [0] * 3 + [1] * 5 + [2] * 5 + [3] * 5 + [0] * (units.n - 18)
    sizes = {}
    for slim in (True, False):
        saved = mp.SLIM_FIXED
        mp.SLIM_FIXED = slim
        try:
            form = build_pipeline_model(units, 4, problem.memory_per_gpu, gpu=gpu,
                                        upper_bound=40.0)
        finally:
            mp.SLIM_FIXED = saved
        sizes[slim] = form.model.size
    assert sizes[True]["constraints"] * 5 < sizes[False]["constraints"], sizes
    assert sizes[True]["variables"] * 3 < sizes[False]["variables"], sizes
    asked = build_pipeline_model(units, 4, problem.memory_per_gpu, gpu=gpu,
                                 upper_bound=40.0, slim=False)
    assert asked.model.size == sizes[False]  # slim=False: the general model on request


def test_madpipe_phase2_schedules_on_the_general_model(monkeypatch):
    """Phase 2 asks for the general fixed-allocation model (``PHASE2_SLIM``): the same
    solutions, and under its work limit a search that did better on the bench (ResNet-101,
    P = 8, 12 GiB: 240.04 against 258.97), in less CPU over its 63 settings."""
    from optmem.solvers import pipeline_madpipe
    from tests.test_pipeline_exact import EX1

    seen: list[tuple[bool, bool]] = []
    real = pipeline_madpipe.run_model

    def spy(*args, **kwargs):
        seen.append((kwargs.get("gpu") is not None, kwargs["slim"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_madpipe, "run_model", spy)
    res = pipeline_madpipe.solve_madpipe(PipelineProblem(EX1, 2, 10**6), OPTS)
    assert res.objective == 2.0  # madpipe.md 7.1: phase 2's non-contiguous plan
    assert seen and seen[0] == (True, False)
    assert all(slim is False for _, slim in seen) and pipeline_madpipe.PHASE2_SLIM is False


def test_lifetime_cuts_keep_the_general_model():
    """``lifetime_cuts`` rows need the indicator variables: the general model is built."""
    problem = PipelineProblem(Chain.from_lists([1, 2, 1], [2, 2, 2], [1, 1, 0], [1, 1, 0],
                                               input_size=1), 2, 40, chain_bandwidth=1.0)
    units = make_units(problem)
    form = build_pipeline_model(units, 2, 40, gpu=[0, 1, 0], upper_bound=9.0,
                                lifetime_cuts=True)
    assert all(v.terms for v in form.x.values())
    cut = run_model(problem, "cpsat", OPTS, gpu=[0, 1, 0], upper_bound=9.0,
                    lifetime_cuts=True)
    plain = run_model(problem, "cpsat", OPTS, gpu=[0, 1, 0], upper_bound=9.0)
    assert cut.status is plain.status  # valid rows: the same answer as the slim model's
    if plain.plan is not None:
        assert cut.plan.period == pytest.approx(plain.plan.period, abs=cut.step + 1e-6)


# ------------------------------------------------------------------ CP-SAT's linearization
def stalling_chain() -> PipelineProblem:
    """4 layers, 3 GPUs, a slow link: with CP-SAT's default linearization (level 1) the
    allocation ``[0, 1, 2, 1]`` stayed at a plan of 22.99 with the bound 13 after 60
    deterministic seconds (slim build); its optimum is 16 (the general build and HiGHS)."""
    chain = Chain.from_lists([3.0, 4.0, 1.0, 3.0], [3.0, 4.0, 2.0, 2.0], [3, 2, 1, 2],
                             [3, 2, 1, 2], input_size=0, weight_size=[1, 3, 2, 3])
    return PipelineProblem(chain, 3, 41, chain_bandwidth=0.5)


@pytest.mark.parametrize("slim", [True, False])
def test_fixed_allocations_are_solved_with_level_2_linearization(monkeypatch, slim):
    """``FIXED_PARAMETERS`` (``linearization_level`` 2) reach CP-SAT when a fixed
    allocation's period is minimised (not for the free allocation, nor for feasibility
    questions), and prove the allocation that stalled at level 1 within 2 deterministic
    seconds; the plan replays. With CP-SAT's default the slim build does not
    prove it within the same work (the reason for the parameter)."""
    from optmem.engines import adapters
    from optmem.solvers import pipeline_common

    problem, gpu = stalling_chain(), [0, 1, 2, 1]
    seen = []
    real = adapters.solve_cpsat

    def spy(*args, **kwargs):
        seen.append(kwargs.get("parameters"))
        return real(*args, **kwargs)

    monkeypatch.setattr(adapters, "solve_cpsat", spy)
    opts = replace(OPTS, deterministic_time=2.0)
    run = run_model(problem, "cpsat", opts, gpu=gpu, slim=slim)
    assert seen == [{"linearization_level": 2}]
    assert run.status is Status.OPTIMAL and run.plan is not None
    assert run.plan.period == pytest.approx(16.0)
    assert_replays(problem, run.plan)
    run_model(problem, "cpsat", opts)  # the allocation free: CP-SAT's defaults
    assert seen[-1] is None
    run_model(problem, "cpsat", opts, gpu=gpu, slim=slim, upper_bound=16.0,
              feasibility=True)  # a feasibility question (the chunk scan's): the defaults
    assert seen[-1] is None
    if slim:
        monkeypatch.setattr(pipeline_common, "FIXED_PARAMETERS", {})
        stalled = run_model(problem, "cpsat", opts, gpu=gpu, slim=True)
        assert stalled.status is not Status.OPTIMAL


def stalling_subproblems_chain() -> PipelineProblem:
    """5 layers, 3 GPUs: ``strategy=benders`` without a time limit ran for minutes on it
    (one subproblem at level 1); its optimum is 16 (the full model)."""
    chain = Chain.from_lists([1.0, 1.0, 3.0, 1.0, 2.0], [5.0, 4.0, 4.0, 5.0, 4.0],
                             [3, 2, 1, 3, 0], [3, 2, 1, 3, 0], input_size=0,
                             weight_size=[1, 2, 1, 0, 3])
    return PipelineProblem(chain, 3, 19, chain_bandwidth=1.0)


def decomposed(problem: PipelineProblem, monkeypatch) -> tuple[object, list[Status]]:
    """``solve(..., "cpsat")`` with ``strategy=benders`` and no limit (the loop runs at once,
    from the solve's incumbent and bound), each engine call of the loop held to 5
    deterministic seconds; the result and the status of each subproblem."""
    from optmem.solvers import pipeline_benders, pipeline_exact
    from optmem.solvers.facade import solve

    real, real_run = pipeline_exact.solve_benders, pipeline_benders.run_model
    statuses: list[Status] = []

    def limited(problem, method, options, **kwargs):
        return real(problem, method, options.with_(deterministic_time=5.0), **kwargs)

    def subproblem(*args, **kwargs):
        run = real_run(*args, **kwargs)
        statuses.append(run.status)
        return run

    monkeypatch.setattr(pipeline_exact, "solve_benders", limited)
    monkeypatch.setattr(pipeline_benders, "run_model", subproblem)
    res = solve(problem, "cpsat", options=SolveOptions(threads=1, seed=0,
                                                       extra={"strategy": "benders"}))
    monkeypatch.undo()
    return res, statuses


def test_decomposition_proves_a_small_chain_its_subproblems_stalled_on(monkeypatch):
    """Without a limit the decomposition proves the full model's optimum 16, every
    subproblem of its loop decided within 5 deterministic seconds, and its plan replays;
    with CP-SAT's default linearization a subproblem is not decided within that work (with
    no limit at all it ran for minutes)."""
    from optmem.pipeline_plan import PipelinePlan
    from optmem.solvers import pipeline_common
    from optmem.solvers.facade import solve

    problem = stalling_subproblems_chain()
    full = solve(problem, "cpsat", options=SolveOptions(threads=1, seed=0))
    assert full.status is Status.OPTIMAL and full.objective == pytest.approx(16.0)
    res, statuses = decomposed(problem, monkeypatch)
    assert res.report["strategy"] == "benders" and statuses
    assert all(s in (Status.OPTIMAL, Status.INFEASIBLE) for s in statuses), statuses
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(16.0)
    assert_replays(problem, PipelinePlan.from_strings(res.plan))
    monkeypatch.setattr(pipeline_common, "FIXED_PARAMETERS", {})
    _, stalled = decomposed(problem, monkeypatch)
    assert any(s not in (Status.OPTIMAL, Status.INFEASIBLE) for s in stalled), stalled
