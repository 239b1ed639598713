"""The exact pipeline model (one formulation, two emitters) and MadPipe: goldens of madpipe.md
7, brute force, bound relations, the emitters cross-checked on random instances.

Every solve runs without a time limit (the verdicts never depend on the clock): the
instances are small enough to be proven.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_helpers import (
    assert_model_agrees_with_simulator,
    assert_replays,
    equal_split_plan,
    set_partitions,
    split_stages,
)

from optmem.chain import Chain
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_common import lower_bound, run_model
from optmem.solvers.pipeline_madpipe import algorithm8

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the CP-SAT pipeline model needs OR-Tools")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(warm_start=False, threads=1)  # no limit: these instances always prove


def thesis_chain(f, b, a, w=None) -> Chain:
    n = len(f)
    return Chain.from_lists(f, b, a[1:n + 1], a[1:n + 1], input_size=a[0], weight_size=w)


def half(costs):
    return [c / 2 for c in costs]


def check(problem: PipelineProblem, result) -> None:
    """The result's plan replays to its objective within the memory."""
    assert result.status.has_plan, result.report
    sim = simulate_pipeline(problem, PipelinePlan.from_strings(result.plan))
    assert sim.period == pytest.approx(result.objective)
    assert sim.peak_memory <= problem.memory_per_gpu


EX1 = thesis_chain(half([1, 2, 1]), half([1, 2, 1]), [0, 0, 0, 0])
EX2 = thesis_chain(half([1, 2, 1]), half([1, 2, 1]), [0, 1, 1, 0])
EX3 = thesis_chain([1, 1], [1, 1], [1, 1, 0])
EX4 = thesis_chain([1, 1, 1], [1, 1, 1], [1, 1, 1, 0])

# madpipe.md 7.6 (strict memory model of ch. 6, zero-cost loss layer)
GOLDEN_76 = [
    ("ex1-p2", EX1, 2, 10**6, math.inf, 2.0),
    ("ex1-p1", EX1, 1, 10**6, math.inf, 4.0),
    ("ex2-b1", EX2, 2, 10**6, 1.0, 3.0),
    ("ex2-b4", EX2, 2, 10**6, 4.0, 2.0),
    ("ex3-m2", EX3, 2, 2, math.inf, None),
    ("ex3-m3", EX3, 2, 3, math.inf, 4.0),
    ("ex3-m5", EX3, 2, 5, math.inf, 4.0),
    ("ex3-m6", EX3, 2, 6, math.inf, 2.0),
    ("ex3-b025", EX3, 2, 3, 0.25, 4.0),
    ("ex4-m3", EX4, 3, 3, math.inf, None),
    ("ex4-m4", EX4, 3, 4, math.inf, 6.0),
    ("ex4-m6", EX4, 3, 6, math.inf, 4.0),
    ("ex4-m8", EX4, 3, 8, math.inf, 2.0),
]


CASES_76 = [(method, *g) for method in ("cpsat", "ilp") for g in GOLDEN_76]


@pytest.mark.parametrize(("method", "name", "chain", "gpus", "memory", "beta", "expected"),
                         CASES_76, ids=[f"{c[0]}-{c[1]}" for c in CASES_76])
def test_golden_76_strict(method, name, chain, gpus, memory, beta, expected):
    p = PipelineProblem(chain, gpus, memory, chain_bandwidth=beta, memory_model="strict")
    r = solve(p, method, options=OPTS)
    if expected is None:
        assert r.status is Status.INFEASIBLE
        return
    assert r.status is Status.OPTIMAL
    assert r.objective == pytest.approx(expected, abs=1e-6)
    check(p, r)


def test_ex3_peak_six_at_b1():
    p = PipelineProblem(EX3, 2, 6, memory_model="strict")
    r = solve(p, "cpsat", options=OPTS)
    assert r.objective == 2 and r.peak_memory == 6


@pytest.mark.parametrize(("name", "problem", "general", "contiguous"), [
    ("71a", PipelineProblem(EX1, 2, 10**6), 2.0, 3.0),
    ("lemma10", PipelineProblem(thesis_chain(half([1, 2, 1]), half([1, 2, 1]), [0] * 4,
                                             w=[1, 2, 1]), 2, 2, weight_copies=1), 2.0, None),
    ("thm18", PipelineProblem(thesis_chain(half([1, 1, 1, 3, 2, 2, 2]),
                                           half([1, 1, 1, 3, 2, 2, 2]), [0] * 8,
                                           w=[3, 3, 3, 4, 1, 1, 1]), 5, 4, weight_copies=1),
     3.0, 6.0),
])
def test_general_vs_contiguous(name, problem, general, contiguous):
    """madpipe.md 7.1-7.2: non-contiguous allocations beat contiguous ones."""
    r = solve(problem, "cpsat", options=OPTS)
    assert r.status is Status.OPTIMAL and r.objective == general
    check(problem, r)
    rc = solve(problem, "contiguous")
    if contiguous is None:
        assert rc.status is Status.INFEASIBLE
    else:
        assert rc.objective == contiguous
    rm = solve(problem, "madpipe", options=OPTS)
    check(problem, rm)
    assert general <= rm.objective <= (contiguous or math.inf)


def test_theorem18_madpipe_is_four():
    chain = thesis_chain(half([1, 1, 1, 3, 2, 2, 2]), half([1, 1, 1, 3, 2, 2, 2]), [0] * 8,
                         w=[3, 3, 3, 4, 1, 1, 1])
    p = PipelineProblem(chain, 5, 4, weight_copies=1)
    assert algorithm8(p, exact=True)[0] == 4
    assert solve(p, "madpipe", options=OPTS).objective == 4


# madpipe.md 7.5: MadPipe phase 1 (exact DP, Algorithm 8 with K = 10)
@pytest.mark.parametrize(("gpus", "memory", "estimate"), [
    (2, 8, 4.0), (2, 12, 4.0), (2, 14, 4.0), (4, 12, 4.0), (4, 16, 2.0), (4, 20, 2.0),
    (3, 8, 769 / 192), (3, 12, 769 / 192),
])
def test_madpipe_phase1_golden_75(gpus, memory, estimate):
    chain = thesis_chain([1] * 4, [1] * 4, [4, 2, 1, 1, 0])
    p = PipelineProblem(chain, gpus, memory)
    est, _, alloc, _ = algorithm8(p, exact=True)
    assert est == pytest.approx(estimate, rel=1e-12)
    assert Fraction(769, 192) == Fraction(est).limit_denominator(1000) or estimate != 769 / 192
    r = solve(p, "madpipe", options=OPTS)
    check(p, r)
    rc = solve(p, "contiguous")
    assert r.objective <= rc.objective  # never worse than the best contiguous allocation
    assert alloc is not None


def test_madpipe_phase2_repairs_optimistic_phase1():
    """P = 4, M = 16: phase 1 says 2 (special GPU charged g - 1 copies); valid period is 4."""
    chain = thesis_chain([1] * 4, [1] * 4, [4, 2, 1, 1, 0])
    p = PipelineProblem(chain, 4, 16)
    r = solve(p, "madpipe", options=OPTS)
    assert r.report["phase1_estimate"] == 2.0
    assert r.objective == 4.0
    check(p, r)


def test_madpipe_finer_memory_ladder_on_resnet50():
    """ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: phase 1 at x0.9 of the memory gives a
    non-contiguous plan below the best contiguous one (x1.0 and x0.85 do not); an
    allocation phase 1 gives twice is scheduled once. Phase 2 on its deterministic limits."""
    from optmem.cli_problems import parse_pipeline_bandwidth
    from optmem.datasets import resolve_chain

    chain = resolve_chain("resnet50-b32-224")
    p = PipelineProblem(chain, 4, 3 * 2**30,
                        chain_bandwidth=parse_pipeline_bandwidth("12GB/s", chain.time_unit))
    r = solve(p, "madpipe", options=SolveOptions(threads=1, seed=0))
    check(p, r)
    assert r.objective < solve(p, "contiguous").objective - 1.0
    assert r.report["source"] == "phase 2, memory x0.9"
    attempts = [a for a in r.report["attempts"] if "memory_factor" in a]
    scheduled = [a["allocation"] for a in attempts if "phase2" not in a]
    assert len(scheduled) == len(set(scheduled))
    assert any(a.get("phase2") == "allocation already scheduled" for a in attempts)


# ------------------------------------------------------------------ random small instances
@st.composite
def small_problems(draw):
    n = draw(st.integers(1, 3))
    f = [draw(st.integers(1, 3)) for _ in range(n)]  # zero forwards: test_pipeline_zero_ties
    b = [draw(st.integers(1, 4)) for _ in range(n)]
    a = [draw(st.integers(0, 3)) for _ in range(n + 1)] + [0]
    w = [draw(st.integers(0, 3)) for _ in range(n)]
    gpus = draw(st.integers(1, 3))
    beta = draw(st.sampled_from([math.inf, 1.0, 2.0]))
    chain = thesis_chain(f, b, a, w)
    lay = PipelineProblem(chain, gpus, 0).layers
    heavy = 3 * sum(lay.w) + 2 * sum(lay.x) + 4 * sum(lay.a)
    memory = draw(st.integers(max(lay.x) + 3 * max(lay.w), max(heavy, 1) + 1))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems())
def test_exact_le_madpipe_le_contiguous(problem):
    rc = solve(problem, "contiguous")
    rs = solve(problem, "cpsat", options=OPTS)
    rm = solve(problem, "madpipe", options=OPTS)
    if rs.status is Status.INFEASIBLE:
        assert not rc.status.has_plan and not rm.status.has_plan
        return
    assert rs.status is Status.OPTIMAL
    check(problem, rs)
    if rm.status.has_plan:
        check(problem, rm)
        assert rs.objective <= rm.objective + 1e-6
    if rc.status.has_plan:
        assert rm.status.has_plan and rm.objective <= rc.objective + 1e-9
        assert rs.objective <= rc.objective + 1e-6


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_ilp_equals_cpsat(problem, strict):
    p = replace(problem, memory_model="strict") if strict else problem
    ri = solve(p, "ilp", options=OPTS)
    rs = solve(p, "cpsat", options=OPTS)
    assert ri.status is rs.status
    if rs.status is Status.OPTIMAL:
        assert ri.objective == pytest.approx(rs.objective, abs=1e-6)
        check(p, ri)
        check(p, rs)


@pytest.mark.parametrize(("gpus", "memory", "expected", "fixed_fails"), [
    (4, 16, 8.0, False), (4, 20, 4.0, False), (2, 14, 8.0, False), (2, 12, 8.0, False),
    (2, 11, 8.0, True),
])
def test_madpipe_phase2_golden_75_strict(gpus, memory, expected, fixed_fails):
    """madpipe.md 7.5 phase 2 (strict ILP memory): 8, 4, 8, 8.

    The digest's prototype ran phase 2 on the coarse chain, one task per stage, so it
    charged the stage ``1-2`` backward its input and output (4 + 1) over its whole stash
    (6) and 2 of buffers: 13 > 12, so ``P = 2, M = 12`` needed free GPUs. optmem checks
    every layer (eq. 6.36's tasks are layers, ``Layers.strict_task``): layer 2's backward
    holds 6 + 1 + 2 and layer 1's 4 + 2 + 4 (layer 2's stash freed), 11 and 12 with the
    buffers, so the fixed allocation fits at ``M = 12`` and fails at ``M = 11``.
    """
    chain = thesis_chain([1] * 4, [1] * 4, [4, 2, 1, 1, 0])
    p = PipelineProblem(chain, gpus, memory, memory_model="strict")
    r = solve(p, "madpipe", options=OPTS)
    assert r.objective == expected
    check(p, r)
    first = [a for a in r.report["attempts"] if "phase2" in a][0]
    assert (first["period"] is None) == fixed_fails


# ------------------------------------------------------------------ one formulation, two emitters
EMITTER_EXAMPLES = int(os.environ.get("PIPE_EXAMPLES", 200))


@settings(max_examples=EMITTER_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_emitters_agree(problem, strict):
    """HiGHS (PuLP emission) and CP-SAT (CP-SAT emission) solve the same model alike."""
    p = replace(problem, memory_model="strict") if strict else problem
    runs = {m: run_model(p, m, OPTS) for m in ("ilp", "cpsat")}
    ilp, cp = runs["ilp"], runs["cpsat"]
    assert ilp.status is cp.status, {m: r.report for m, r in runs.items()}
    if ilp.status is Status.INFEASIBLE:
        return
    assert ilp.status is Status.OPTIMAL
    assert ilp.plan.period == pytest.approx(cp.plan.period, abs=cp.step + 1e-6)
    for run in runs.values():
        sim = simulate_pipeline(p, run.plan)
        assert sim.peak_memory <= p.memory_per_gpu
        assert run.bound <= sim.period + 1e-6
        assert sim.period <= run.bound + cp.step + 1e-6


# ------------------------------------------------------------------ brute force
def allocation_brute_force(problem: PipelineProblem) -> float:
    """No memory limit: the best allocation's busiest GPU or link (digest 2, Lemma 15)."""
    lay = problem.layers
    n = lay.n
    best = math.inf
    for labels in set_partitions(n, problem.n_gpus):
        gpu_load = [0.0] * problem.n_gpus
        links: dict[tuple[int, int], float] = {}
        for q in range(n):
            gpu_load[labels[q]] += lay.load(q + 1, q + 1)
            if q and labels[q] != labels[q - 1]:
                key = (min(labels[q], labels[q - 1]), max(labels[q], labels[q - 1]))
                links[key] = links.get(key, 0.0) + 2 * problem.transfer_time(q)
        best = min(best, max([*gpu_load, *links.values()]))
    return best


def draw_unlimited(draw, lengths, f_max, b_max, betas, gpus) -> PipelineProblem:
    """A random chain without a binding memory limit (sizes drawn, memory 10^9)."""
    n = draw(st.integers(*lengths))
    f = [draw(st.integers(1, f_max)) for _ in range(n)]
    b = [draw(st.integers(1, b_max)) for _ in range(n)]
    a = [0] + [draw(st.integers(0, 4)) for _ in range(n - 1)] + [0]
    beta = draw(st.sampled_from(betas))
    return PipelineProblem(thesis_chain(f, b, a), draw(st.integers(*gpus)), 10**9, beta,
                           weight_copies=1)


@st.composite
def unlimited_problems(draw):
    return draw_unlimited(draw, (2, 5), 6, 6, [math.inf, 1.0, 2.0, 4.0], (1, 3))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=unlimited_problems(), method=st.sampled_from(["ilp", "cpsat"]))
def test_no_memory_limit_equals_brute_force(problem, method):
    """Without memory pressure the optimum is the best allocation's busiest resource."""
    r = solve(problem, method, options=OPTS)
    assert r.status is Status.OPTIMAL
    assert r.objective == pytest.approx(allocation_brute_force(problem), abs=1e-6)
    check(problem, r)


@pytest.mark.parametrize("gpus", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_pcmax_eight_layers_proven(gpus, seed, method):
    """Free transfers, no memory limit: P||Cmax on 8 layers, proven, equals brute force."""
    rng = random.Random(seed)
    f = [rng.randint(1, 20) for _ in range(8)]
    b = [rng.randint(1, 40) for _ in range(8)]
    problem = PipelineProblem(thesis_chain(f, b, [1] * 9), gpus, 10**9)
    r = solve(problem, method, options=OPTS.with_(warm_start=True))
    assert r.status is Status.OPTIMAL
    loads = [x + y for x, y in zip(f, b, strict=True)]
    best = min(max(sum(load for load, g in zip(loads, labels, strict=True) if g == k)
                   for k in range(gpus)) for labels in set_partitions(8, gpus))
    assert r.objective == pytest.approx(best, abs=1e-6)
    assert best * (1 - 1e-6) <= r.bound <= best  # proven (CP-SAT: one grid step below)
    check(problem, r)


@pytest.mark.parametrize("memory", [7, 8, 30])
def test_single_gpu(memory):
    """One GPU: the sequential period if one copy of every stash fits, else infeasible."""
    chain = thesis_chain([1, 2, 1], [2, 1, 1], [1, 2, 1, 0], w=[1, 1, 1])
    problem = PipelineProblem(chain, 1, memory, weight_copies=1)
    need = sum(problem.layers.w) + sum(problem.layers.x)
    for method in ("ilp", "cpsat"):
        r = solve(problem, method, options=OPTS)
        if memory < need:
            assert r.status is Status.INFEASIBLE
        else:
            assert r.status is Status.OPTIMAL and r.objective == pytest.approx(8.0)
            check(problem, r)


# ------------------------------------------------------------------ the model and the simulator
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(problem=small_problems(), frac=st.floats(0, 1))
def test_contiguous_plans_are_model_solutions(problem, frac, strict, shared):
    """A 1F1B* plan is an assignment of the model (objective: its period) iff it fits.

    The model's memory rows and the simulator agree on every such plan, in both memory
    models, written with multi-layer stages or one stage per layer: a plan the simulator
    accepts violates nothing, one it rejects violates a memory row and nothing else.
    ``shared``: fewer GPUs than layers, so that some stage has several layers.
    """
    from optmem.models.pipeline import build_pipeline_model, make_units

    if strict:
        problem = replace(problem, memory_model="strict")
    if shared:
        problem = with_fewer_gpus(problem)
    plan = equal_split_plan(problem, frac)
    form = build_pipeline_model(make_units(problem), problem.n_gpus,
                                problem.memory_per_gpu, strict=strict)
    for p in (plan, split_stages(problem, plan)):  # also with one stage per layer
        assert_model_agrees_with_simulator(form, problem, p)


@pytest.mark.parametrize("memory", [1, 2])
def test_strict_memory_of_a_two_layer_stage(memory):
    """Strict memory checks every layer of a stage (eq. 6.36's tasks are layers).

    Layer 1 stashes 1 and outputs 1; layer 2 stashes and outputs nothing. When layer 2's
    backward starts, layer 1's stash (1) and layer 2's input gradient (1) are both held: 2,
    whether the two layers form one stage or two. (The simulator once counted only the
    stage's own input and output, 0 + 0, and accepted memory 1 where the model did not.)
    """
    from optmem.models.pipeline import build_pipeline_model, make_units

    chain = Chain.from_lists([1, 1], [1, 1], [1, 0], [1, 0], input_size=0)
    problem = PipelineProblem(chain, 1, memory, memory_model="strict")
    plan = equal_split_plan(problem, 0.0)
    assert [(s.first, s.last) for s in plan.stages] == [(1, 2)]
    for p in (plan, split_stages(problem, plan)):
        assert simulate_pipeline(problem, p).peak_memory == 2
    form = build_pipeline_model(make_units(problem), 1, memory, strict=True)
    assert_model_agrees_with_simulator(form, problem, plan)
    r = solve(problem, "ilp", options=OPTS)
    assert r.status is (Status.OPTIMAL if memory >= 2 else Status.INFEASIBLE)


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems())
def test_strict_exact_le_contiguous_with_shared_gpus(problem):
    """Strict memory, fewer GPUs than layers: the exact model's optimum is never above the
    best contiguous 1F1B* plan (whose stages hold several layers). The model counts each
    layer of a stage as the simulator does, so it represents that plan; when it counted
    differently it could refuse it and claim a worse optimum."""
    problem = with_fewer_gpus(replace(problem, memory_model="strict"))
    rc = solve(problem, "contiguous")
    rs = solve(problem, "cpsat", options=OPTS)
    if rs.status is Status.INFEASIBLE:
        assert not rc.status.has_plan, rc.report
        return
    assert rs.status is Status.OPTIMAL, rs.report
    check(problem, rs)
    if rc.status.has_plan:
        check(problem, rc)
        assert rs.objective <= rc.objective * (1 + 1e-6)


@pytest.mark.parametrize("model", ["stash", "strict"])
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems())
def test_coarse_units_restrict_the_layer_model(problem, model):
    """MadPipe's phase 2 schedules coarse units (whole stages, layers back to back); the
    layer model with the same allocation may interleave them. So with the allocation fixed
    the coarse optimum is never below the layer optimum, and a coarse plan means a layer
    plan exists; both replay (memory counted per layer in either, ``Layers.strict_task``)."""
    from optmem.models.pipeline import make_units
    from optmem.solvers import pipeline_contiguous as contig

    problem = with_fewer_gpus(replace(problem, memory_model=model))
    bounds = contig.equal_split(problem, min(problem.n_gpus, problem.layers.n))
    fine_gpu = [s for s, (i, j) in enumerate(bounds) for _ in range(i, j + 1)]
    coarse = run_model(problem, "cpsat", OPTS, units=make_units(problem, bounds),
                       gpu=list(range(len(bounds))))
    fine = run_model(problem, "cpsat", OPTS, gpu=fine_gpu)
    assert coarse.status in (Status.OPTIMAL, Status.INFEASIBLE), coarse.report
    assert fine.status in (Status.OPTIMAL, Status.INFEASIBLE), fine.report
    if coarse.status is Status.INFEASIBLE:
        return
    assert fine.status is Status.OPTIMAL
    for run in (coarse, fine):
        assert_replays(problem, run.plan)
    assert fine.plan.period <= coarse.plan.period + max(fine.step, coarse.step) + 1e-6


def with_fewer_gpus(problem: PipelineProblem) -> PipelineProblem:
    """``problem`` on fewer GPUs than layers where it has 2 layers or more."""
    return replace(problem, n_gpus=max(1, min(problem.n_gpus, problem.layers.n - 1)))


@pytest.mark.parametrize("model", ["stash", "strict"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(problem=small_problems(), frac=st.floats(0, 1))
def test_memory_does_not_depend_on_the_grouping_into_stages(problem, frac, model):
    """One execution, written with multi-layer stages or with one stage per layer, has the
    same period and the same peak on every GPU, in both memory models."""
    problem = with_fewer_gpus(replace(problem, memory_model=model))
    plan = equal_split_plan(problem, frac)
    split = split_stages(problem, plan)
    a, b = simulate_pipeline(problem, plan), simulate_pipeline(problem, split)
    assert a.period == pytest.approx(b.period)
    assert a.peaks == b.peaks


def test_no_hidden_time_limit(monkeypatch):
    """``time_limit_s=None`` reaches every engine call as no limit."""
    from optmem.engines import adapters as engines

    seen = []
    for name in ("solve_pulp", "solve_cpsat"):
        real = getattr(engines, name)

        def spy(*args, _real=real, **kwargs):
            seen.append(kwargs.get("time_limit_s"))
            return _real(*args, **kwargs)
        monkeypatch.setattr(engines, name, spy)
    problem = PipelineProblem(EX2, 2, 10**6, 1.0)
    for method in ("ilp", "cpsat", "madpipe"):
        solve(problem, method, options=SolveOptions())
    assert seen and all(limit is None for limit in seen)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems())
def test_exact_at_least_load_bound_and_warm_start_agrees(problem):
    """The optimum is the same with incumbents and cutoff; never below the load bound."""
    cold = solve(problem, "cpsat", options=OPTS)
    warm = solve(problem, "cpsat", options=OPTS.with_(warm_start=True))
    assert cold.status is warm.status
    if cold.status is Status.OPTIMAL:
        assert warm.objective == pytest.approx(cold.objective, abs=1e-6)
        assert cold.objective >= lower_bound(problem) - 1e-9
        check(problem, warm)


# ------------------------------------------------------------------ MadPipe's DP by enumeration
def dp_paths(problem: PipelineProblem, that: float, exact: bool):
    """Every allocation of MadPipe-DP's class with its estimate, by plain enumeration.

    The recursion of ``madpipe.md`` 5.3 unrolled (scalar arithmetic, no tables): last
    stages ``i..j`` from the right, normal (``P - 1`` at most) or special; with no normal
    GPU left the prefix is one special stage. Estimate: ``max(A, t_P)`` (``A``: the largest
    normal stage or link), with the grids of section 5.5 when not ``exact``.
    """
    from optmem.solvers.pipeline_contiguous import group_of, oplus

    lay, limit, n = problem.layers, problem.memory_per_gpu, problem.layers.n
    cost = [0.0] + [2 * problem.transfer_time(j) for j in range(1, n)]
    total = lay.load(1, n)
    steps = (total / 100 or 1.0, limit / 10 or 1.0, (total + sum(cost)) / 50 or 1.0)

    def up(x: float, k: int) -> float:
        return x if exact else math.ceil(x / steps[k] - 1e-9) * steps[k]

    def walk(j, p, t, m, v, a, alloc):
        if j == 0:
            yield max(a, t), alloc
            return
        if p == 0:
            g = group_of(oplus(v, lay.load(1, j), that), that)
            if m + problem.stage_memory(1, j, 0) + (g - 1) * lay.stash(1, j) <= limit:
                yield max(a, lay.load(1, j) + t), [(1, j, "S"), *alloc]
            return
        for i in range(j, 0, -1):
            u, c = lay.load(i, j), cost[i - 1] if i > 1 else 0.0
            static, stash = problem.stage_memory(i, j, 0), lay.stash(i, j)
            vs = oplus(v, u, that)
            g = group_of(vs, that)
            vn = up(oplus(vs, c, that), 2) if i > 1 else 0.0
            if static + g * stash <= limit:
                yield from walk(i - 1, p - 1, t, m, vn, max(a, u, c), [(i, j, "N"), *alloc])
            t2, m2 = up(t + u, 0), up(m + static + (g - 1) * stash, 1)
            if m2 <= limit:
                yield from walk(i - 1, p, t2, m2, vn, max(a, c), [(i, j, "S"), *alloc])

    yield from walk(n, problem.n_gpus - 1, 0.0, 0.0, 0.0, 0.0, [])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(problem=small_problems(), ratio=st.floats(0.3, 3.0), exact=st.booleans(),
       extra_layers=st.integers(0, 3))
def test_madpipe_dp_equals_enumeration(problem, ratio, exact, extra_layers):
    """The vectorised DP's value is the least estimate of its class; its allocation has it."""
    from optmem.solvers.pipeline_madpipe import DPTables, feasibility_run, madpipe_dp

    if extra_layers:
        c = problem.chain
        chain = thesis_chain([*c.fwd_time, *[1.0] * extra_layers],
                             [*c.bwd_time, *[2.0] * extra_layers],
                             [c.input_size, *c.output_size[:-1], *[1] * extra_layers, 0])
        problem = replace(problem, chain=chain)
    that = ratio * problem.layers.load(1, problem.layers.n) / problem.n_gpus
    value, alloc, _ = madpipe_dp(problem, that, exact=exact)
    paths = dict((tuple(a), est) for est, a in dp_paths(problem, that, exact))
    best = min(paths.values(), default=math.inf)
    assert value == best
    if math.isfinite(best):
        assert paths[tuple(alloc)] == best
    else:
        assert alloc is None
    tables = DPTables.of(problem)
    if not exact:  # the relaxed tables bound the DP's value from below
        top = problem.layers.n, problem.n_gpus - 1, 0
        assert tables.relaxed[top] <= best
        assert max(tables.relaxed_memory(that)[(slice(None), *top)]) <= best
    for cap in (best, best * 1.01, math.inf):  # a cap only hides values at or above it
        capped, _, _ = madpipe_dp(problem, that, exact=exact, cap=cap)
        assert capped == (best if best < cap else math.inf)
        bound, _, prune = feasibility_run(tables, that, exact, cap)
        assert bound <= best or best >= cap  # a capped run without t_P: still a bound
        pruned, palloc, _ = madpipe_dp(problem, that, exact=exact, cap=cap, tables=tables,
                                       prune=prune)
        assert pruned == capped
        if math.isfinite(pruned):
            assert paths[tuple(palloc)] == best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(keys=st.lists(st.integers(0, 40), max_size=60))
def test_dense_unique_is_numpy_unique(keys):
    """The table behind the grid DP's state merge: ``np.unique``'s inverse, and a
    representative of each key in key order."""
    import numpy as np

    from optmem.solvers.pipeline_madpipe import _dense_unique

    key = np.array(keys, dtype=np.int64)
    first, inverse = _dense_unique(key, 41)
    values, expected = np.unique(key, return_inverse=True)
    assert inverse.tolist() == expected.ravel().tolist()
    assert key[first].tolist() == values.tolist()


@st.composite
def longer_problems(draw):
    """Chains of 6-16 layers on 2-8 GPUs, on the thesis grids (longer than EXACT_MAX_LAYERS
    when drawn so), at a memory between the largest layer and store-all."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(6, 16))
    f = [rng.randint(1, 9) for _ in range(n)]
    b = [rng.randint(1, 12) for _ in range(n)]
    a = [rng.randint(1, 20) for _ in range(n + 1)] + [0]
    w = [rng.randint(0, 10) for _ in range(n)]
    gpus = draw(st.integers(2, 8))
    chain = thesis_chain(f, b, a, w)
    lay = PipelineProblem(chain, gpus, 0).layers
    heavy = 3 * sum(lay.w) + 2 * sum(lay.x) + 4 * sum(lay.a)
    memory = rng.randint(max(lay.x) + 3 * max(lay.w), heavy + 1)
    beta = draw(st.sampled_from([math.inf, 2.0, 8.0]))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problem=longer_problems())
def test_grid_dp_dense_merge_equals_sorted_merge(problem):
    """Algorithm 8 on the grids gives the same estimate, T-hat, allocation and state count
    whether the states are merged by the dense table or by ``np.unique``'s sort (the merge
    the DP used before), at three rungs of the memory ladder."""
    import optmem.solvers.pipeline_madpipe as mp
    from optmem.solvers.pipeline_common import scaled

    for factor in (1.0, 0.85, 0.6):
        sub = problem if factor == 1.0 else scaled(problem, factor)
        dense = mp.algorithm8(sub, exact=False)
        saved = mp.DENSE_KEYS
        mp.DENSE_KEYS = 0
        try:
            sorted_ = mp.algorithm8(sub, exact=False)
        finally:
            mp.DENSE_KEYS = saved
        assert dense == sorted_


@contextlib.contextmanager
def dp_bounds(on: bool, switch: str = "BOUNDS"):
    """MadPipe with (``True``) or without one of its prunings (a module switch: ``BOUNDS``,
    the DP's child bounds; ``MEMORY_BOUND``; ``LIMIT_RUNS``; ``PREFIX_BOUND``;
    ``SKIP_PHASE2``)."""
    import optmem.solvers.pipeline_madpipe as mp

    saved = getattr(mp, switch)
    setattr(mp, switch, on)
    try:
        yield
    finally:
        setattr(mp, switch, saved)


def ladder_both(problem: PipelineProblem, factors, switch: str = "BOUNDS") -> list[tuple]:
    """``algorithm8`` on the grids at each memory factor, without and with a pruning."""
    from optmem.solvers.pipeline_common import scaled

    out = []
    for factor in factors:
        sub = problem if factor == 1.0 else scaled(problem, factor)
        with dp_bounds(False, switch):
            old = algorithm8(sub, exact=False)
        with dp_bounds(True, switch):
            new = algorithm8(sub, exact=False)
        out.append((old, new))
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problem=longer_problems())
def test_dp_bounds_keep_algorithm8(problem):
    """The child bounds of the capped DP (relaxed table, Prune, capped run without t_P)
    change no estimate, T-hat or allocation of Algorithm 8 at any rung of the ladder."""
    for old, new in ladder_both(problem, (1.0, 0.85, 0.6)):
        assert old[:3] == new[:3]


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=longer_problems())
def test_dp_bounds_keep_madpipe_solves(problem):
    """A whole MadPipe solve gives the same period, plan and ladder with and without them."""
    runs = []
    for on in (False, True):
        with dp_bounds(on):
            runs.append(solve(problem, "madpipe", options=OPTS))
    old, new = runs
    assert (old.status, old.plan) == (new.status, new.plan)
    assert old.objective == new.objective or math.isnan(old.objective) and math.isnan(
        new.objective)
    assert old.report["attempts"] == new.report["attempts"]


def test_dp_bounds_on_resnet152_same_result_less_work():
    """ResNet-152 (L = 56), P = 8, 8 GiB, 12 GB/s (``bench_madpipe.py``): Algorithm 8 gives
    the same estimate, T-hat and allocation with the bounds, on over 3x fewer DP states
    (deterministic counts: 852 671 without, 227 651 with, at the full memory, before
    :data:`PREFIX_BOUND`)."""
    from optmem.cli_problems import parse_pipeline_bandwidth
    from optmem.datasets import resolve_chain

    chain = resolve_chain("resnet152-b32-224")
    bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
    problem = PipelineProblem(chain, 8, 8 * 2**30, chain_bandwidth=bw)
    ((old, new),) = ladder_both(problem, (1.0,))
    assert old[:3] == new[:3]
    assert math.isfinite(new[0]) and new[2] is not None
    assert 3 * new[3] < old[3]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problem=longer_problems(), switch=st.sampled_from(["MEMORY_BOUND", "LIMIT_RUNS"]))
def test_memory_bound_and_limit_runs_keep_algorithm8(problem, switch):
    """The memory-aware bound (:meth:`DPTables.relaxed_memory`) and the runs without
    ``t_P`` at each cap tried change no estimate, T-hat or allocation of Algorithm 8."""
    for old, new in ladder_both(problem, (1.0, 0.85, 0.6), switch):
        assert old[:3] == new[:3]


def test_phase1_prunings_on_resnet152_same_result_less_work():
    """ResNet-152 (L = 56), P = 8, 8 GiB, 12 GB/s: Algorithm 8 gives the same estimate,
    T-hat and allocation without and with each of the memory-aware bound and the runs
    without ``t_P`` at each cap; both together need fewer DP states (deterministic
    counts: 227 651 with neither, 185 996 / 218 434 with either, 166 878 with both, before
    :data:`PREFIX_BOUND`)."""
    import optmem.solvers.pipeline_madpipe as mp
    from optmem.cli_problems import parse_pipeline_bandwidth
    from optmem.datasets import resolve_chain

    chain = resolve_chain("resnet152-b32-224")
    bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
    problem = PipelineProblem(chain, 8, 8 * 2**30, chain_bandwidth=bw)
    counts = {}
    for memory, limits in itertools.product((False, True), repeat=2):
        with dp_bounds(memory, "MEMORY_BOUND"), dp_bounds(limits, "LIMIT_RUNS"):
            counts[memory, limits] = mp.algorithm8(problem, exact=False)
    assert all(r[:3] == counts[False, False][:3] for r in counts.values())
    assert math.isfinite(counts[True, True][0])
    assert counts[True, True][3] < counts[False, False][3]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problem=longer_problems(), frac=st.sampled_from([0.3, 0.6, 1.0, 1.5]))
def test_bound_thresholds_are_the_bound_checks(problem, frac):
    """The threshold table of the capped runs' bounds (``_Bounds.kmax``): ``k < kmax`` is
    the check of :attr:`DPTables.relaxed` and :meth:`DPTables.relaxed_memory` at ``t_P = k
    step_t``, for every child, ``p``, ``m_P`` on the grid and ``k`` (also past the table)."""
    import numpy as np

    from optmem.solvers.pipeline_madpipe import DPTables, _Bounds

    tables = DPTables.of(problem)
    that = tables.total / problem.n_gpus
    bounds = _Bounds(tables, that, frac * tables.total, None)
    assert bounds.kmax is not None
    step_t, step_m, _ = tables.steps()
    h, g = bounds.h, bounds.g
    k = np.arange(h.shape[2] + 3)
    for child, p, m in itertools.product(range(tables.n + 1), range(problem.n_gpus),
                                         range(g.shape[3])):
        t = k * step_t
        direct = (h[child, p, np.minimum(k, h.shape[2] - 1)] < bounds.limit) & (
            np.maximum(g[0, child, p, m], t + g[1, child, p, m]) < bounds.limit)
        assert (k < bounds.kmax[child, p, m]).tolist() == direct.tolist()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problem=longer_problems(), switch=st.sampled_from(["THRESHOLDS", "STAGE_TABLES"]))
def test_dp_lookup_tables_keep_algorithm8(problem, switch):
    """Algorithm 8 gives the same estimates, T-hats, allocations and DP states with the
    threshold table of the bounds (:data:`THRESHOLDS`) and the per-level tables of the
    moves' terms (:data:`STAGE_TABLES`) as when computing them per state."""
    for old, new in ladder_both(problem, (1.0, 0.85, 0.6), switch):
        assert old == new


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problem=longer_problems())
def test_prefix_bound_keeps_algorithm8(problem):
    """The prefix bound of the runs without ``t_P`` (:data:`PREFIX_BOUND`: each state
    carries the least ``t_P`` of the paths reaching it) changes no estimate, T-hat or
    allocation of Algorithm 8 at any rung of the ladder."""
    for old, new in ladder_both(problem, (1.0, 0.85, 0.6), "PREFIX_BOUND"):
        assert old[:3] == new[:3]


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=longer_problems())
def test_prefix_bound_keeps_madpipe_solves(problem):
    """A whole MadPipe solve: same status, period, plan and ladder with and without it."""
    agree, _ = solves_agree(problem, "PREFIX_BOUND")
    assert agree


def test_prefix_bound_on_resnet152_less_work_and_a_wrong_one_is_caught(monkeypatch):
    """ResNet-152 (L = 56), P = 8, 8 GiB, 12 GB/s: the prefix bound keeps Algorithm 8's
    estimate, T-hat and allocation on 2.7x fewer DP states (deterministic counts: 166 878
    without, 60 960 with); a deliberately wrong one (each state's least ``t_P`` doubled,
    no longer a lower bound of its paths') prunes completions below the cap and changes the
    estimate (41.01 -> 43.19)."""
    import optmem.solvers.pipeline_madpipe as mp
    from optmem.cli_problems import parse_pipeline_bandwidth
    from optmem.datasets import resolve_chain

    chain = resolve_chain("resnet152-b32-224")
    bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
    problem = PipelineProblem(chain, 8, 8 * 2**30, chain_bandwidth=bw)
    ((old, new),) = ladder_both(problem, (1.0,), "PREFIX_BOUND")
    assert old[:3] == new[:3] and math.isfinite(new[0])
    assert (old[3], new[3]) == (166_878, 60_960)
    real = mp._collect

    def doubled(chunks, steps, prefix=False):
        states = real(chunks, steps, prefix)
        if prefix:
            states[:, 1] *= 2.0
        return states

    monkeypatch.setattr(mp, "_collect", doubled)
    with dp_bounds(True, "PREFIX_BOUND"):
        wrong = algorithm8(problem, exact=False)
    assert wrong[:3] != new[:3] and wrong[0] > new[0]


def solves_agree(problem: PipelineProblem, switch: str = "SKIP_PHASE2") -> tuple[bool, Any]:
    """Whether MadPipe gives the same status, period, plan and ladder (rungs: memory
    factor, estimate, T-hat, allocation) without and with a pruning; the second result."""
    runs = []
    for on in (False, True):
        with dp_bounds(on, switch):
            runs.append(solve(problem, "madpipe", options=OPTS))
    old, new = runs
    rungs = [[a for a in r.report["attempts"] if "memory_factor" in a] for r in runs]
    same_objective = old.objective == new.objective or math.isnan(old.objective) and \
        math.isnan(new.objective)
    return (old.status, old.plan) == (new.status, new.plan) and same_objective and \
        rungs[0] == rungs[1], new


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=longer_problems())
def test_phase2_skips_keep_madpipe_solves(problem):
    """Skipping the phase-2 models that cannot matter keeps the period, plan and ladder."""
    agree, new = solves_agree(problem)
    assert agree
    assert new.report["phase2_skipped"] >= 0 and new.report["phase2_models"] >= 0


def test_phase2_skip_counts_and_an_invalid_skip_is_caught(monkeypatch):
    """EX1 on 2 GPUs (madpipe.md 7.1: phase 2's non-contiguous plan, period 2, beats the
    contiguous 3): the valid skip keeps it; a deliberately invalid bound (10x too high)
    skips its models and the comparison catches the worse plan."""
    import optmem.solvers.pipeline_madpipe as mp

    problem = PipelineProblem(EX1, 2, 10**6)
    agree, new = solves_agree(problem)
    assert agree and new.objective == 2.0 and new.report["phase2_models"] >= 1
    real = mp.allocation_bound
    monkeypatch.setattr(mp, "allocation_bound", lambda p, units: 10 * real(p, units))
    agree, new = solves_agree(problem)
    assert not agree
    assert new.objective == 3.0 and new.report["phase2_skipped"] >= 1


# ------------------------------------------------------------------ the lifetime relaxation
def relaxation_feasible(problem: PipelineProblem, period: float,
                        gpu: list[int] | None = None, arcs: bool = True) -> bool:
    """Whether the relaxation admits a plan of ``period`` (with the given allocation)."""
    from optmem.engines import adapters as engines
    from optmem.models.formulation import rational_time_scale, to_cpsat
    from optmem.models.pipeline import build_relaxation, make_units

    units = make_units(problem)
    scale, _ = rational_time_scale([*units.f, *units.b, *units.dt], resolution=1e-3)
    form = build_relaxation(units, problem.n_gpus, problem.memory_per_gpu,
                            math.ceil(period * scale - 1e-9), scale,
                            strict=problem.memory_model == "strict", gpu=gpu, arcs=arcs)
    cm = to_cpsat(form.model, 1)
    res = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
    assert res.status in (Status.OPTIMAL, Status.INFEASIBLE)
    return res.status is Status.OPTIMAL


@settings(max_examples=40, deadline=None, derandomize=True)
@given(problem=small_problems(), frac=st.floats(0, 1), strict=st.booleans())
def test_relaxation_admits_every_valid_plan(problem, frac, strict):
    """The relaxation is a relaxation: every 1F1B* plan that fits satisfies it, allocation too."""
    from optmem.solvers import pipeline_contiguous as contig

    if strict:
        problem = replace(problem, memory_model="strict")
    bounds = contig.equal_split(problem, min(problem.n_gpus, problem.layers.n))
    f, b = contig.pseudo_loads(problem, bounds)
    loads = [x + y for x, y in zip(f, b, strict=True)]
    plan = contig.one_f_one_b_star(problem, bounds, max(loads) + frac * sum(loads))
    if simulate_pipeline(problem, plan).peak_memory > problem.memory_per_gpu:
        return
    gpu = [st_.gpu for st_ in plan.stages for _ in range(st_.first, st_.last + 1)]
    assert relaxation_feasible(problem, plan.period, gpu)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_relaxation_bound_never_exceeds_the_optimum(problem, strict):
    """At the proven optimum the relaxation is feasible; its bisection stays below it."""
    from optmem.solvers.pipeline_exact import relaxation_bound

    if strict:
        problem = replace(problem, memory_model="strict")
    r = solve(problem, "cpsat", options=OPTS)
    if r.status is not Status.OPTIMAL:
        return
    assert relaxation_feasible(problem, r.objective)
    bound, _ = relaxation_bound(problem, r.objective * 1.5, OPTS, None)
    assert bound <= r.objective + 1e-9


def unit_gpus(problem: PipelineProblem, plan: PipelinePlan) -> list[int]:
    """The GPU of each unit of ``problem`` in ``plan`` (the stage holding its first layer)."""
    from optmem.models.pipeline import make_units

    return [next(s.gpu for s in plan.stages if s.first <= i <= s.last)
            for i, _ in make_units(problem).bounds]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_relaxation_admits_every_plan_the_methods_return(problem, strict):
    """Every replayed plan of ``cpsat``, ``madpipe`` and ``contiguous`` (non-contiguous
    allocations and any window order included) satisfies the relaxation with the window
    arcs, with its own allocation fixed, at its simulated period: the relaxation's bound
    never exceeds a plan the methods return."""
    if strict:
        problem = replace(problem, memory_model="strict")
    for method in ("cpsat", "madpipe", "contiguous"):
        r = solve(problem, method, options=OPTS)
        if not r.status.has_plan:
            continue
        check(problem, r)
        plan = PipelinePlan.from_strings(r.plan)
        assert relaxation_feasible(problem, r.objective, unit_gpus(problem, plan)), method


def draw_chain(draw, f_max: int, b_max: int, a_max: int) -> Chain:
    """3-4 layers: forwards 1..f_max (none zero: tests/test_pipeline_zero_forward.py), backwards
    1..b_max, activation sizes 0..a_max (the loss output 0), weights 0..2."""
    n = draw(st.integers(3, 4))
    f = [draw(st.integers(1, f_max)) for _ in range(n)]
    b = [draw(st.integers(1, b_max)) for _ in range(n)]
    a = [draw(st.integers(0, a_max)) for _ in range(n + 1)] + [0]
    w = [draw(st.integers(0, 2)) for _ in range(n)]
    return thesis_chain(f, b, a, w)


@st.composite
def tight_problems(draw):
    """3-4 layers on 2-3 GPUs with a memory at most half of a generous one (stashes bind)."""
    chain = draw_chain(draw, 4, 6, 4)
    gpus = draw(st.integers(2, 3))
    lay = PipelineProblem(chain, gpus, 0).layers
    low = max(lay.x) + 3 * max(lay.w)
    high = (3 * sum(lay.w) + 2 * sum(lay.x) + 4 * sum(lay.a)) // 2 + 1
    memory = draw(st.integers(low, max(low, high)))
    beta = draw(st.sampled_from([math.inf, 2.0, 4.0]))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=tight_problems())
def test_relaxation_admits_the_optimum_under_memory_pressure(problem):
    """Where the window arcs bind (several stashes per GPU, tight memory): the proven
    optimum's plan, its allocation fixed, satisfies the relaxation at its period."""
    r = solve(problem, "cpsat", options=SolveOptions(threads=1, seed=0,
                                                      extra={"relaxation": False}))
    if r.status is not Status.OPTIMAL:
        return
    check(problem, r)
    plan = PipelinePlan.from_strings(r.plan)
    assert relaxation_feasible(problem, r.objective, unit_gpus(problem, plan))


def test_window_arcs_raise_the_relaxation_bound():
    """Random instance (4 layers, 3 GPUs, memory 12) whose proven optimum is 16: without the
    window arcs the relaxation admits period 12.5 (every stash counted one copy short at
    the other forwards of its GPU, every lifetime ending just before its next forward);
    with them it does not, and at the optimum it still does."""
    p = PipelineProblem(thesis_chain([4, 4, 2, 1], [5, 3, 1, 5], [1, 1, 1, 1, 2, 0],
                                     [1, 0, 2, 2]), 3, 12)
    r = solve(p, "cpsat", options=OPTS)
    assert r.status is Status.OPTIMAL and r.objective == pytest.approx(16.0)
    assert relaxation_feasible(p, 12.5, arcs=False)
    assert not relaxation_feasible(p, 12.5)
    assert relaxation_feasible(p, r.objective)
    plan = PipelinePlan.from_strings(r.plan)
    assert relaxation_feasible(p, r.objective, unit_gpus(p, plan))


def test_window_arcs_admit_a_non_contiguous_optimum():
    """Its proven optimum (12) puts layers 1 and 4 on one GPU, 2-3 on the other: the
    relaxation with the window arcs admits that plan at 12 (found by a random search as an
    instance where an over-charged "outside" row would cut the optimum off)."""
    p = PipelineProblem(thesis_chain([1, 2, 2, 4], [5, 6, 2, 2], [1, 0, 3, 1, 1, 0],
                                     [0, 0, 0, 1]), 2, 9, chain_bandwidth=2.0)
    r = solve(p, "cpsat", options=OPTS)
    assert r.status is Status.OPTIMAL and r.objective == pytest.approx(12.0)
    run = run_model(p, "cpsat", OPTS, gpu=[0, 1, 1, 0])
    assert run.plan is not None and run.plan.period == pytest.approx(12.0)
    sim = simulate_pipeline(p, run.plan)
    assert sim.period == pytest.approx(12.0) and sim.peak_memory <= 9
    assert relaxation_feasible(p, 12.0, [0, 1, 1, 0])


@st.composite
def unlimited_uneven_problems(draw):
    return draw_unlimited(draw, (3, 7), 30, 40, [math.inf, 1.0, 4.0], (2, 4))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(problem=unlimited_uneven_problems())
def test_relaxation_admits_the_best_allocation_without_memory_pressure(problem):
    """Lifetimes (hence copies) grow with every wait; only memory may bound them.

    Without memory pressure the best allocation of the brute force reaches its busiest
    resource's load, so the relaxation must admit that allocation at that period.
    """
    period = allocation_brute_force(problem)
    lay = problem.layers
    for labels in set_partitions(lay.n, problem.n_gpus):
        loads = [sum(lay.load(q + 1, q + 1) for q in range(lay.n) if labels[q] == g)
                 for g in range(problem.n_gpus)]
        links: dict[tuple[int, int], float] = {}
        for q in range(1, lay.n):
            if labels[q] != labels[q - 1]:
                key = (min(labels[q], labels[q - 1]), max(labels[q], labels[q - 1]))
                links[key] = links.get(key, 0.0) + 2 * problem.transfer_time(q)
        if max([*loads, *links.values()]) == period:
            assert relaxation_feasible(problem, period, labels)
            return



def test_madpipe_stops_its_ladder_at_the_time_limit(monkeypatch):
    """A limit that runs out between two rungs of the memory ladder ends the ladder with
    the plans found so far (it used to hand phase 2 a limit of 0 s, which ``SolveOptions``
    rejects: the solve crashed). Scripted clock: the limit is left whole for the first rung
    and runs out at the end of the second rung's phase 1; on this instance (digest 7.5, P =
    4, M = 16) the ladder otherwise schedules three allocations."""
    from types import SimpleNamespace

    from optmem.solvers import pipeline_madpipe

    now, phase1 = [0.0], [0]
    monkeypatch.setattr(pipeline_madpipe, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    real = pipeline_madpipe.algorithm8

    def timed(*args, **kwargs):
        phase1[0] += 1
        out = real(*args, **kwargs)
        if phase1[0] == 2:
            now[0] = 100.0  # the second rung's phase 1 took the rest of the limit
        return out

    monkeypatch.setattr(pipeline_madpipe, "algorithm8", timed)
    p = PipelineProblem(thesis_chain([1, 1, 1, 1], [1, 1, 1, 1], [4, 2, 1, 1, 0]), 4, 16)
    r = solve(p, "madpipe", options=SolveOptions(threads=1, seed=0, time_limit_s=60.0))
    check(p, r)
    rungs = [a for a in r.report["attempts"] if "memory_factor" in a]
    assert [a["memory_factor"] for a in rungs] == [1.0, 0.95]
    assert rungs[-1]["phase2"] == "time limit reached"


@pytest.mark.parametrize("method", ["cpsat", "ilp", "madpipe"])
def test_exact_grid_fits_cpsat_integers(method: str) -> None:
    """A chain at the contract's ranges (a 1e9 ms layer, a 2^46 B value at 1e15 B/s) solves.

    Before: the exact grid of the transfer times (1 / 2.8e12) put the period's bounds at
    2.8e21, beyond CP-SAT's 64-bit domains: a raw ``TypeError`` from OR-Tools escaped
    ``solve`` (``madpipe`` and the ``ilp``'s MadPipe warm start too).
    """
    chain = Chain.from_lists([0.0, 1e9, 7.0], [0.1, 0.0, 1e-6], [0, 2**46, 1],
                             [2**20, 2**46 + 2, 2**30 + 1], input_size=3,
                             weight_size=[1000, 2, 2], loss_bwd_time=1e-6)
    problem = PipelineProblem(chain, n_gpus=2, memory_per_gpu=140738563145735,
                              bandwidth=1e15)
    best = solve(problem, "contiguous", threads=1)
    result = solve(problem, method, threads=1)
    assert result.status.has_plan
    assert result.bound <= best.objective * (1 + 1e-6)
    assert result.objective == pytest.approx(best.objective, rel=1e-6)


def test_period_bounds_without_a_grid_point_are_no_engine_error() -> None:
    """A period bounded by lower = upper between two grid points is no CP-SAT fault.

    One layer of 2e-9 + 5e-9 ms on 2 GPUs with 0 bytes each: the period is bounded by
    7e-9 on both sides, on a grid of 7e-18 that has no point there. Before: the empty
    domain was CP-SAT's ``MODEL_INVALID`` (``status: error``) where ``ilp`` proves the
    instance infeasible; now ``no_solution`` (rounded times prove no infeasibility).
    """
    chain = Chain.from_lists([2e-9], [0.0], [2], [5], input_size=2, fwd_overhead=[3],
                             bwd_overhead=[2], weight_size=[1], loss_bwd_time=5e-9)
    problem = PipelineProblem(chain, n_gpus=2, memory_per_gpu=0)
    assert solve(problem, "ilp", threads=1).status is Status.INFEASIBLE
    result = solve(problem, "cpsat", threads=1)
    assert result.status in (Status.INFEASIBLE, Status.NO_SOLUTION)
    assert "engine_error" not in result.report
    fits = solve(PipelineProblem(chain, n_gpus=2, memory_per_gpu=12), "cpsat", threads=1)
    assert fits.status is Status.OPTIMAL
    assert fits.objective == pytest.approx(7e-9)


def test_resolution_keeps_the_grid_within_cpsat_integers() -> None:
    """1e-6 ms layers beside 1.1e6 ms transfers (2^40 B at 1e9 B/s) get a grid CP-SAT holds.

    Before: the grid's resolution, relative to the period's lower bound (3.5e-6), refined
    it to 1 / 2.9e14, the transfer rows reached -3.1e20 and a raw ``TypeError`` escaped
    ``solve`` (``ilp`` and ``contiguous``: infeasible).
    """
    size = 2**40
    chain = Chain.from_lists([1e-6] * 3, [1e-6] * 3, [size] * 3, [2 * size] * 3,
                             input_size=size, fwd_overhead=[size] * 3,
                             bwd_overhead=[size] * 3, weight_size=[size] * 3,
                             loss_bwd_time=1e-6)
    problem = PipelineProblem(chain, n_gpus=2, memory_per_gpu=10 * size - 1, bandwidth=1e9)
    assert solve(problem, "ilp", threads=1).status is Status.INFEASIBLE
    result = solve(problem, "cpsat", threads=1)
    assert result.status in (Status.INFEASIBLE, Status.NO_SOLUTION)
    assert result.report["time_scale"] * 2 * size / 1e6 < 2**62


def test_relaxation_grid_fits_cpsat_integers() -> None:
    """The relaxation's bisection and the decomposition use the model's capped grid.

    Backward times of 1e9 ms beside 0.1 ms ones: the relaxation's own grid (1 / 1.3e11)
    put its period at 2.6e20, and a raw ``TypeError`` escaped ``solve`` (``cpsat`` and the
    ``ilp``) after the model's grid was capped.
    """
    chain = Chain.from_lists([1e6, 0.0, 1e3], [1e9, 0.1, 1e9], [2, 7, 2], [5, 2**40 + 7, 2],
                             input_size=0, fwd_overhead=[0, 2**20, 3], bwd_overhead=[3, 1, 1],
                             weight_size=[0, 7, 2**20], loss_bwd_time=0.1)
    problem = PipelineProblem(chain, n_gpus=2, memory_per_gpu=1099512676364, bandwidth=1e9)
    best = solve(problem, "contiguous", threads=1)
    for method in ("cpsat", "ilp"):
        result = solve(problem, method, threads=1)
        # layer 2 has no forward time: its own unit under stash (one unit per layer, the
        # problem's optimum; tests/test_pipeline_zero_ties.py), no merged class
        assert result.status is Status.OPTIMAL and "merged_units" not in result.report
        assert result.objective <= best.objective * (1 + 1e-9)
    benders = solve(problem, "cpsat", threads=1, extra={"strategy": "benders"})
    assert benders.status.has_plan


@pytest.mark.parametrize("strategy", ["full", "benders"])
def test_a_time_limit_spent_before_the_engine_run_gives_the_incumbent_not_an_input_error(
        monkeypatch, strategy: str) -> None:
    """A ``time_limit_s`` that the warm start, the relaxation and the probes use up before
    the final engine run (here a scripted clock: every reading 1000 s after the last, far
    in the past for the real clock the other modules read) left that run
    ``time_limit_s=0.0``, which ``SolveOptions`` refuses: the user's valid limit came back
    as ``OptmemInputError: field 'time_limit_s': ... got 0.0`` (CLI exit 2; ``optmem solve
    pipeline resnet18-b64-224 --gpus 2 --memory 4GiB --method cpsat --time-limit 0.1``).
    Now the run gets ``MIN_ENGINE_LIMIT_S`` and the solve returns the best replayed plan
    with a bound at most the optimum."""
    from types import SimpleNamespace

    from optmem.datasets.synthetic import random_chain
    from optmem.solvers import pipeline_exact

    chain = random_chain(5, seed=0)
    lay = PipelineProblem(chain, 2, 0).layers
    memory = (max(lay.x) + 3 * max(lay.w) + 2 * max(lay.a)
              + 3 * sum(lay.w) + 3 * sum(lay.x) + 4 * sum(lay.a)) // 2
    problem = PipelineProblem(chain, 2, memory, chain_bandwidth=2.0)
    optimum = solve(problem, "cpsat", options=OPTS.with_(seed=0))
    assert optimum.status is Status.OPTIMAL
    readings = itertools.count(-1e9, 1000.0)
    monkeypatch.setattr(pipeline_exact, "time",
                        SimpleNamespace(perf_counter=lambda: next(readings)))
    r = solve(problem, "cpsat", options=SolveOptions(threads=1, seed=0, time_limit_s=60.0,
                                                     extra={"strategy": strategy}))
    check(problem, r)
    assert r.status in (Status.FEASIBLE, Status.OPTIMAL)
    assert r.objective >= optimum.objective - 1e-9
    assert r.bound <= optimum.objective + 1e-9
