"""Pipeline exact models (ILP of ch. 6, CP-SAT) and MadPipe: goldens of madpipe.md 7, orders."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_madpipe import algorithm8

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the CP-SAT pipeline model needs OR-Tools")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(warm_start=False)  # no limit: these instances prove in well under a second


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


SLOW_FOR_ILP = ("ex4-m6", "ex2-b1")  # a few seconds each with HiGHS; CP-SAT covers them
CASES_76 = [("cpsat", *g) for g in GOLDEN_76] + [("ilp", *g) for g in GOLDEN_76
                                                 if g[0] not in SLOW_FOR_ILP]


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


# ------------------------------------------------------------------ random small instances
@st.composite
def small_problems(draw):
    n = draw(st.integers(1, 3))
    f = [draw(st.integers(1, 3)) for _ in range(n)]  # zero forwards: see zero_forward_merged
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


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_ilp_equals_cpsat(problem, strict):
    from dataclasses import replace

    p = replace(problem, memory_model="strict") if strict else problem
    ri = solve(p, "ilp", options=OPTS)
    rs = solve(p, "cpsat", options=OPTS)
    assert ri.status is rs.status
    if rs.status is Status.OPTIMAL:
        assert ri.objective == pytest.approx(rs.objective, abs=1e-6)
        check(p, ri)
        check(p, rs)


@pytest.mark.parametrize(("gpus", "memory", "expected", "fixed_fails"), [
    (4, 16, 8.0, False), (4, 20, 4.0, False), (2, 14, 8.0, False), (2, 12, 8.0, True),
])
def test_madpipe_phase2_golden_75_strict(gpus, memory, expected, fixed_fails):
    """madpipe.md 7.5 phase 2 (strict ILP memory): 8, 4, 8; P=2, M=12 needs free GPUs."""
    chain = thesis_chain([1] * 4, [1] * 4, [4, 2, 1, 1, 0])
    p = PipelineProblem(chain, gpus, memory, memory_model="strict")
    r = solve(p, "madpipe", options=OPTS)
    assert r.objective == expected
    check(p, r)
    first = [a for a in r.report["attempts"] if "phase2" in a][0]
    assert (first["period"] is None) == fixed_fails
