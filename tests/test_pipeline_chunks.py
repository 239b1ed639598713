"""The chunk scan (:mod:`optmem.solvers.pipeline_chunks`, method ``chunks``).

Checked against brute force over every allocation (each solved by the exact model with the
allocation fixed): the enumeration is exactly the allocations with at most ``k`` chunks per
GPU under the load cap; the floor never exceeds an allocation's optimum (stash and strict
models, with and without link times); the method's plan is the best of the family (within its
step) when it reports a family bound, never beats the problem's optimum, and equals it when
``k`` allows every allocation; engine failures are counted and survived; bad options are
refused with one clear error.
"""

from __future__ import annotations

import math
import os
import pathlib
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from optmem.engines.adapters import work_budget
from optmem.errors import OptmemInputError
from optmem.models.pipeline import build_pipeline_model, delay_tail, make_units, plan_gpus
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.solvers import pipeline_chunks as chunked
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_common import (
    ModelRun,
    build_model,
    lower_bound,
    proven,
    refute,
    replayed_period,
    run_model,
)
from tests.test_pipeline import thesis_chain
from tests.test_pipeline_benders import solved_allocations, trimmable_problems
from tests.test_pipeline_exact import set_partitions

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the scan decides each allocation with CP-SAT")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

FAST = SolveOptions(threads=1, seed=0, extra={"warm_madpipe": False})
BRUTE = SolveOptions(threads=1, seed=0, deterministic_time=5.0, warm_start=False)


def decided_allocations(problem: PipelineProblem) -> list[tuple[list[int], float]] | None:
    """Every allocation with a plan and its optimal period (brute force, 5 deterministic s
    each); ``None`` when some allocation is undecided in that work (the example is dropped)."""
    out = []
    for gpu in set_partitions(make_units(problem).n, problem.n_gpus):
        run = run_model(problem, "cpsat", BRUTE, gpu=gpu)
        if run.status not in (Status.OPTIMAL, Status.INFEASIBLE):
            return None
        if run.plan is not None:
            out.append((gpu, run.plan.period))
    return out


def n_chunks(gpu) -> dict[int, int]:
    """Chunks (runs of consecutive units) per GPU label."""
    out: dict[int, int] = {}
    for q, g in enumerate(gpu):
        if q == 0 or gpu[q - 1] != g:
            out[g] = out.get(g, 0) + 1
    return out


@st.composite
def five_layer_problems(draw):
    """Five layers, 2 GPUs, a memory between one layer's needs and plenty, links of
    speed inf, 2 or 4: enough layers for families of one or two chunks to differ."""
    n = 5
    f = [draw(st.integers(1, 6)) for _ in range(n)]
    b = [draw(st.integers(1, 6)) for _ in range(n)]
    a = [draw(st.integers(0, 4)) for _ in range(n + 1)] + [0]
    w = [draw(st.integers(0, 2)) for _ in range(n)]
    chain = thesis_chain(f, b, a, w)
    gpus = 2
    lay = PipelineProblem(chain, gpus, 0).layers
    memory = draw(st.integers(max(lay.x) + 3 * max(lay.w) + 2 * max(lay.a),
                              3 * sum(lay.w) + 3 * sum(lay.x) + 4 * sum(lay.a) + 1))
    beta = draw(st.sampled_from([math.inf, 2.0, 4.0]))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(loads=st.lists(st.integers(1, 9), min_size=1, max_size=7), gpus=st.integers(1, 3),
       chunks=st.integers(1, 3), cap=st.integers(1, 40))
def test_enumeration_is_the_family(loads, gpus, chunks, cap):
    """:func:`chunk_allocations` lists each allocation with at most ``chunks`` chunks per GPU
    and every GPU's load at most ``cap`` once, and nothing else (brute force)."""
    chain = thesis_chain(loads, [1] * len(loads), [0] * (len(loads) + 2), [0] * len(loads))
    units = make_units(PipelineProblem(chain, gpus, 10**9))
    expected = set()
    for gpu in set_partitions(units.n, gpus):
        per = [sum(units.load(q) for q in range(units.n) if gpu[q] == g) for g in set(gpu)]
        if max(n_chunks(gpu).values()) <= chunks and max(per) <= cap + 1e-9:
            expected.add(tuple(gpu))
    listed = list(chunked.chunk_allocations(units, gpus, chunks, float(cap)))
    assert len(listed) == len(set(listed))
    assert set(listed) == expected


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_floor_never_exceeds_an_allocations_optimum(problem, strict):
    """:func:`allocation_floor` (memory rows in the stash model only) is at most the optimal
    period of every allocation's fixed model, and ``inf`` only above the cap."""
    p = replace(problem, memory_model="strict") if strict else problem
    units = make_units(p)
    memory = None if strict else p.memory_per_gpu
    for gpu, period in solved_allocations(p):
        floor = chunked.allocation_floor(units, gpu, p.n_gpus, memory, units.big_m())
        assert floor <= period * (1 + 1e-9), (gpu, floor, period)
        assert chunked.allocation_floor(units, gpu, p.n_gpus, memory, period) <= period


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=five_layer_problems(), chunks=st.integers(1, 2))
def test_chunks_is_the_best_of_its_family(problem, chunks):
    """With a family bound, the plan is the best over the family's allocations (brute force,
    within the step) and the bound is at most that; the plan never beats the optimum over
    every allocation and replays (the facade's result is the simulator's); the bound is
    withheld only when some allocation was undecided. The contiguous incumbent is in every
    family, so an empty family means no plan."""
    solved = decided_allocations(problem)
    assume(solved is not None)
    assert solved is not None
    family = [period for gpu, period in solved if max(n_chunks(gpu).values()) <= chunks]
    overall = min((period for _, period in solved), default=math.inf)
    res = solve(problem, "chunks", options=replace(FAST, extra={**FAST.extra, "chunks": chunks}))
    if not family:
        assert not res.status.has_plan
        return
    best = min(family)
    assert res.status.has_plan, res.report
    assert res.objective >= overall * (1 - 1e-6)
    assert res.report["allocations_bound"] <= overall * (1 + 1e-9), res.report
    assert res.bound <= overall * (1 + 1e-9), res.report
    bound = res.report["chunks_bound"]
    assert bound is not None or res.report["chunks_undecided"] > 0, res.report
    if bound is not None:
        assert res.objective <= best * (1 + chunked.CHUNK_STEP) + 1e-6
        assert bound <= best + 1e-6


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems())
def test_enough_chunks_is_the_exact_optimum(problem):
    """With as many chunks as units every allocation is in the family: with a family bound,
    the scan's plan is the exact optimum (brute force) within its step, and the bound is a
    bound of it."""
    solved = decided_allocations(problem)
    assume(solved is not None)
    assert solved is not None
    overall = min((period for _, period in solved), default=math.inf)
    n = make_units(problem).n
    res = solve(problem, "chunks", options=replace(FAST, extra={**FAST.extra, "chunks": n}))
    if math.isinf(overall):
        assert not res.status.has_plan
        return
    assert res.objective >= overall * (1 - 1e-6)
    bound = res.report["chunks_bound"]
    assert bound is not None or res.report["chunks_undecided"] > 0, res.report
    if bound is not None:
        assert res.objective == pytest.approx(overall, rel=2 * chunked.CHUNK_STEP)
        assert bound <= overall + 1e-6


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=five_layer_problems(), keep=st.integers(1, 2**16 - 1))
def test_asking_any_family_gives_its_best_and_a_bound_of_it(problem, keep):
    """:func:`ask_family` over an arbitrary set of allocations (a bit mask over the
    allocations, not a chunk family) from no plan: with a bound, the plan is the best of
    that set (brute force) within the step and replays, the bound is at most that best, and
    an allocation outside the set never shows; the bound is withheld only when some
    allocation was undecided."""
    solved = decided_allocations(problem)
    assume(solved is not None)
    assert solved is not None
    units = make_units(problem)
    every = list(set_partitions(units.n, problem.n_gpus))
    assert len(every) == 16
    chosen = {tuple(gpu) for k, gpu in enumerate(every) if keep >> k & 1}
    cap = units.big_m()
    family = sorted((chunked.allocation_floor(units, gpu, problem.n_gpus,
                                              problem.memory_per_gpu, cap), gpu)
                    for gpu in chosen)
    family = [(floor, gpu) for floor, gpu in family if floor < math.inf]
    periods = [period for gpu, period in solved if tuple(gpu) in chosen]
    out = chunked.ask_family(problem, units, math.inf, None, family, work=5.0,
                             step=chunked.CHUNK_STEP)
    assert out.family == len(family)
    if not periods:
        assert out.plan is None
        assert out.undecided > 0 or not math.isnan(out.bound)
        return
    best = min(periods)
    assert out.plan is not None, out
    assert plan_gpus(units, out.plan) in chosen
    assert replayed_period(problem, out.plan) == pytest.approx(out.period, rel=1e-9)
    assert out.period >= best * (1 - 1e-6)
    assert out.undecided > 0 or not math.isnan(out.bound), out
    if not math.isnan(out.bound):
        assert out.period <= best * (1 + chunked.CHUNK_STEP) + 1e-6
        assert out.bound <= best + 1e-6


@st.composite
def small_problems(draw):
    """4-6 layers, 2-3 GPUs, a memory between one layer's needs and plenty or none binding
    (10**9), links of speed inf, 2 or 4."""
    n = draw(st.integers(4, 6))
    f = [draw(st.integers(1, 6)) for _ in range(n)]
    b = [draw(st.integers(1, 6)) for _ in range(n)]
    a = [draw(st.integers(0, 4)) for _ in range(n + 1)] + [0]
    w = [draw(st.integers(0, 2)) for _ in range(n)]
    chain = thesis_chain(f, b, a, w)
    gpus = draw(st.integers(2, 3))
    lay = PipelineProblem(chain, gpus, 0).layers
    memory = draw(st.one_of(st.just(10**9), st.integers(
        max(lay.x) + 3 * max(lay.w) + 2 * max(lay.a),
        3 * sum(lay.w) + 3 * sum(lay.x) + 4 * sum(lay.a) + 1)))
    beta = draw(st.sampled_from([math.inf, 2.0, 4.0]))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(problem=small_problems(), data=st.data())
def test_partial_floor_never_exceeds_a_completions_floor(problem, data):
    """The floor of a prefix (:func:`allocation_floor` of units ``0..m-1`` placed) only grows
    as units are placed, so it never exceeds the floor of any completion; and the pruned
    enumeration with no chunk limit lists exactly the allocations whose floor is finite at
    the cap (brute force over every allocation): the pruning loses none."""
    units = make_units(problem)
    memory = problem.memory_per_gpu
    gpu = data.draw(st.lists(st.integers(0, problem.n_gpus - 1), min_size=units.n,
                             max_size=units.n))
    cap = units.big_m()
    floors = [chunked.allocation_floor(units, gpu[:m], problem.n_gpus, memory, cap)
              for m in range(1, units.n + 1)]
    for shorter, longer in zip(floors, floors[1:], strict=False):
        assert shorter <= longer * (1 + 1e-9), (gpu, floors)
    cap = data.draw(st.floats(0.3, 1.0)) * units.big_m()
    expected = {tuple(g) for g in set_partitions(units.n, problem.n_gpus)
                if chunked.allocation_floor(units, g, problem.n_gpus, memory, cap) < math.inf}
    listed = list(chunked.chunk_allocations(units, problem.n_gpus, units.n, cap, memory))
    assert len(listed) == len(set(listed))
    assert set(listed) == expected


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems())
def test_the_complete_family_is_the_exact_optimum(problem):
    """``family="all"``: with every allocation decided (``complete_bound`` set) the plan is
    the optimum over every allocation (brute force: each allocation's fixed model solved),
    replayed by the simulator (an ``error`` result otherwise), and the status ``optimal``
    with a bound at most that optimum; with no plan anywhere, ``infeasible``. Without the
    bound some allocation was undecided."""
    solved = decided_allocations(problem)
    assume(solved is not None)
    assert solved is not None
    overall = min((period for _, period in solved), default=math.inf)
    res = solve(problem, "chunks", options=replace(FAST, extra={**FAST.extra, "family": "all"}))
    closed = res.report["complete_bound"] is not None
    assert closed or res.report["complete_undecided"] > 0, res.report
    if math.isinf(overall):
        assert not res.status.has_plan
        assert res.status is (Status.INFEASIBLE if closed else Status.NO_SOLUTION)
        return
    assert res.status in (Status.OPTIMAL, Status.FEASIBLE), res.report
    assert res.objective >= overall * (1 - 1e-6)
    assert res.report["allocations_bound"] <= overall * (1 + 1e-9), res.report
    if closed:
        assert res.status is Status.OPTIMAL, res.report
        assert res.objective == pytest.approx(overall, rel=1e-6)
        assert res.report["complete_bound"] <= overall * (1 + 1e-9)
        # every allocation asked: the least over them is the plan, up to the grid and step
        assert res.report["allocations_bound"] >= res.objective * (1 - 1e-6) - 1e-6, \
            res.report


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), gap=st.sampled_from([0.02, 0.1, 0.3]))
def test_a_proof_gap_proves_the_plan_within_it(problem, gap):
    """Stop 70, ``extra["proof_gap"]``: the complete family's pass asks at the plan's period
    less ``gap``. Closed, its bound is at most the optimum over every allocation (brute
    force) and at least the plan's period less ``gap``: the plan is within ``gap`` of the
    optimum, and the result's gap is at most ``gap``; ``optimal`` only with a bound that
    proves it."""
    solved = decided_allocations(problem)
    assume(solved is not None and solved)
    assert solved is not None
    overall = min(period for _, period in solved)
    res = solve(problem, "chunks", options=replace(FAST, extra={
        **FAST.extra, "family": "all", "proof_gap": gap}))
    assert res.report["complete_proof_gap"] == gap
    assume(res.report["complete_bound"] is not None)  # some allocation left undecided
    assert res.status.has_plan, res.report
    assert res.objective >= overall * (1 - 1e-6)
    assert res.bound <= overall * (1 + 1e-9), res.report
    assert res.report["complete_bound"] <= overall * (1 + 1e-9), res.report
    assert res.report["complete_bound"] >= res.objective * (1 - gap) * (1 - 1e-6) - 1e-6
    assert res.objective <= overall / (1 - gap) * (1 + 1e-6)
    assert res.gap <= gap + 1e-6, res
    assert (res.status is Status.OPTIMAL) == proven(res.objective, res.bound)


def test_a_proof_gap_asks_at_the_lowered_cutoff():
    """On a fixed instance the pass with ``proof_gap`` 5 % closes at the plan's period less
    5 % (the cutoff, up to CP-SAT's grid), with the plan of the exact proof, and asks no more
    heads than the exact proof (here one each; on the headline 1,280 against 4,139); the
    report names the gap (``None`` for the exact proof)."""
    problem = tail_light_problem(11)
    extra = {**FAST.extra, "family": "all", "head_step": 1}
    exact = solve(problem, "chunks", options=replace(FAST, extra=extra))
    near = solve(problem, "chunks", options=replace(FAST, extra={**extra, "proof_gap": 0.05}))
    assert exact.status is Status.OPTIMAL and exact.report["complete_proof_gap"] is None
    assert near.status is Status.FEASIBLE, near.report
    assert near.objective == pytest.approx(exact.objective, rel=1e-9)
    assert near.report["complete_bound"] == pytest.approx(near.objective * 0.95, rel=1e-6)
    assert exact.objective * 0.95 * (1 - 1e-6) <= near.bound <= exact.objective
    assert near.report["complete_heads"] <= exact.report["complete_heads"], near.report


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), data=st.data())
def test_the_allocations_bound_is_the_least_bound_of_every_allocation(problem, data):
    """``allocations_bound`` is the least over every allocation (brute force over the set
    partitions, GPUs numbered by first use) of its floor, or of what was proven for it
    when that is larger, capped at ``cap`` and never below ``low``; a work limit of one
    prefix gives ``low`` or a value the brute force confirms; a deadline already past gives
    ``low`` (stop 71; ``cap`` when no allocation is listed below it), none in reach the same
    bound."""
    units = make_units(problem)
    memory = problem.memory_per_gpu if problem.memory_model == "stash" else None
    cap = data.draw(st.floats(0.3, 1.0)) * units.big_m()
    parts = [tuple(g) for g in set_partitions(units.n, problem.n_gpus)]
    decided = {g: data.draw(st.floats(0.0, 1.2 * units.big_m())) for g in parts
               if data.draw(st.booleans())}
    least = min(max(chunked.allocation_floor(units, g, problem.n_gpus, memory, cap),
                    decided.get(g, 0.0)) for g in parts)
    expected = min(least, cap)
    low = data.draw(st.floats(0.0, 1.0)) * expected
    got = chunked.allocations_bound(units, problem.n_gpus, memory, low, cap, decided)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)
    short = chunked.allocations_bound(units, problem.n_gpus, memory, low, cap, decided,
                                      work=1)
    assert low <= short <= expected * (1 + 1e-9) + 1e-9
    late = chunked.allocations_bound(units, problem.n_gpus, memory, low, cap, decided,
                                     deadline=time.perf_counter() - 1.0)
    # stop 71: a walk past its deadline stops (one that lists nothing at cap proves cap)
    assert late == low or late == got == cap, (late, low, got, cap)
    assert chunked.allocations_bound(units, problem.n_gpus, memory, low, cap, decided,
                                     deadline=math.inf) == got


def test_a_complete_family_above_its_limit_is_not_asked():
    """More allocations below the cutoff than ``family_limit``: the complete family is not
    asked (``complete_truncated``, ``complete_stopped = "limit"``), no problem bound is
    claimed, and the k-chunk scan's plan is returned."""
    chain = thesis_chain([1, 3, 1, 4, 4, 4], [6, 4, 2, 1, 4, 1], [3, 3, 4, 0, 3, 2, 1, 0],
                         [2, 0, 1, 0, 0, 0])
    problem = PipelineProblem(chain, 3, 52)
    extra = {**FAST.extra, "family": "all", "heads": False}  # heads refute them all here
    whole = solve(problem, "chunks", options=replace(FAST, extra=extra))
    assert whole.status is Status.OPTIMAL, whole.report
    assert whole.report["complete_family"] >= 2, whole.report
    capped = solve(problem, "chunks", options=replace(FAST, extra={**extra, "family_limit": 1}))
    assert capped.report["complete_truncated"] is True
    assert capped.report["complete_stopped"] == "limit"
    assert capped.report["complete_bound"] is None
    assert capped.report["complete_evaluated"] == 0
    assert capped.objective == pytest.approx(
        solve(problem, "chunks", options=FAST).objective, rel=1e-9)


@pytest.mark.parametrize("workers", [1, 2])
def test_allocations_whose_floor_reached_the_cutoff_are_not_asked(workers):
    """The window of questions in flight is filled only with allocations whose floor is
    below the cutoff: one allocation with a plan, one whose (given) floor is the incumbent's
    period. Before stop 56 two workers asked both (the window was filled before the front's
    floor was checked again)."""
    chain = thesis_chain([1, 3, 1, 4, 4, 4], [6, 4, 2, 1, 4, 1], [3, 3, 4, 0, 3, 2, 1, 0],
                         [2, 0, 1, 0, 0, 0])
    problem = PipelineProblem(chain, 3, 52)
    units = make_units(problem)
    run = run_model(problem, "cpsat", BRUTE, gpu=[0, 0, 0, 1, 1, 1])
    assert run.plan is not None
    period = replayed_period(problem, run.plan)
    assert period is not None
    family = [(0.0, (0, 0, 0, 1, 1, 1)), (period, (0, 0, 1, 1, 2, 2))]
    out = chunked.ask_family(problem, units, period, run.plan, family, work=5.0,
                             step=chunked.CHUNK_STEP, workers=workers)
    assert (out.evaluated, out.skipped) == (1, 1), out


def eight_layer_problem(seed: int, n: int = 8, tail_light: bool = False) -> PipelineProblem:
    """Eight layers (``n``), 3 GPUs, a tight memory: families of 30 allocations, several
    asked. ``tail_light``: the activations of the second half small (as in the ResNets)."""
    rng = random.Random(seed)
    f = [rng.randint(1, 6) for _ in range(n)]
    b = [rng.randint(1, 8) for _ in range(n)]
    a = [(rng.randint(2, 6) if i < n // 2 else rng.randint(0, 1)) if tail_light
         else rng.randint(0, 4) for i in range(n + 1)] + [0]
    w = [rng.randint(0, 2) for _ in range(n)]
    chain = thesis_chain(f, b, a, w)
    lay = PipelineProblem(chain, 3, 0).layers
    lo = max(lay.x) + 3 * max(lay.w) + 2 * max(lay.a)
    hi = 3 * sum(lay.w) + 3 * sum(lay.x) + 4 * sum(lay.a)
    return PipelineProblem(chain, 3, lo + (hi - lo) // 12,
                           chain_bandwidth=rng.choice([math.inf, 2.0, 4.0]))


NO_WAITS = replace(FAST, extra={**FAST.extra, "waits": False})
"""The scan without the waits rows (stop 59): every allocation below the cutoff is asked,
for the tests of the asking itself (batches, retries)."""


@pytest.mark.parametrize("seed", [1, 5])
def test_parallel_scan_is_deterministic_and_finds_the_same_best(seed):
    """Two and three workers (threads; batches asked at one cutoff, settled in order): the
    same report on a second run, the same best period and family bound as one worker (the
    family's optimum either way); several allocations are asked (without the waits rows,
    which refute most of them here), so batches are used."""
    problem = eight_layer_problem(seed)

    def run(threads):
        return solve(problem, "chunks", options=replace(NO_WAITS, threads=threads))

    one = run(1)
    assert one.report["chunks_bound"] is not None, one.report
    assert one.report["chunks_evaluated"] >= 3, one.report
    for threads in (2, 3):
        first, again = run(threads), run(threads)
        keys = [k for k in first.report if k.startswith("chunks_")]
        assert {k: first.report[k] for k in keys} == {k: again.report[k] for k in keys}
        assert first.objective == again.objective
        assert first.status is one.status
        assert first.objective == pytest.approx(one.objective, rel=2 * chunked.CHUNK_STEP)
        assert first.report["chunks_bound"] == pytest.approx(one.report["chunks_bound"])


@pytest.mark.parametrize("threads", [1, 2])
def test_time_limit_keeps_a_plan_and_withholds_the_bound(threads):
    """A time limit (a tiny one here) returns a replayed plan; whenever the scan stopped on
    time, no family bound is claimed (invariants that hold however far the scan got)."""
    problem = eight_layer_problem(5)
    res = solve(problem, "chunks", options=replace(FAST, threads=threads, time_limit_s=0.05))
    assert res.status.has_plan, res.report
    assert res.report["chunks_stopped"] in ("done", "time")
    if res.report["chunks_stopped"] == "time":
        assert res.report["chunks_bound"] is None


def test_retry_pass_decides_with_its_own_work(monkeypatch):
    """``chunk_retry_work``: the allocations a tiny ``chunk_work`` leaves undecided are asked
    again with that much work; enough of it decides them and gives the family bound, while
    a retry no larger than ``chunk_work`` (it is raised to it) leaves them undecided. (The
    stash counts' rows off: with them this instance leaves nothing undecided even then.)"""
    monkeypatch.setattr(chunked, "STASH_FLOORS", False)
    problem = eight_layer_problem(3)

    def run(work, retry):
        extra = {**NO_WAITS.extra, "chunk_work": work, "chunk_retry_work": retry}
        return solve(problem, "chunks", options=replace(FAST, extra=extra))

    short, long = run(0.002, 0.001), run(0.002, 5.0)
    assert short.report["chunks_undecided"] >= 1, short.report
    assert short.report["chunks_bound"] is None
    assert long.report["chunks_undecided"] == 0, long.report
    assert long.report["chunks_bound"] <= long.objective * (1 + 1e-9)
    assert long.objective <= short.objective * (1 + 1e-9)


def test_engine_failures_are_counted_and_survived(monkeypatch):
    """An engine that fails on every allocation leaves the incumbent, counts the failures as
    undecided, and withholds the family bound."""
    chain = thesis_chain([1, 3, 1, 4, 4, 4], [6, 4, 2, 1, 4, 1], [3, 3, 4, 0, 3, 2, 1, 0],
                         [2, 0, 1, 0, 0, 0])
    problem = PipelineProblem(chain, 3, 52)

    def broken(*args, **kwargs):
        return ModelRun(Status.ERROR, None, math.nan, {}, engine=SimpleNamespace(failed=True))

    monkeypatch.setattr(chunked, "run_model", broken)
    res = solve(problem, "chunks", options=FAST)
    assert res.status.has_plan
    assert res.report["chunks_failed"] == res.report["chunks_evaluated"] > 0
    assert res.report["chunks_undecided"] == res.report["chunks_failed"]
    assert res.report["chunks_bound"] is None
    assert res.report["source"] == "contiguous 1F1B*"


@pytest.mark.parametrize(("extra", "field"), [
    ({"chunks": 0}, "chunks"), ({"chunks": True}, "chunks"), ({"chunks": 1.5}, "chunks"),
    ({"chunk_work": 0}, "chunk_work"), ({"chunk_step": 1.0}, "chunk_step"),
    ({"chunk_step": -1}, "chunk_step"), ({"chunk_retry_work": 0}, "chunk_retry_work"),
    ({"chunk_retry_work": "x"}, "chunk_retry_work"), ({"family": "every"}, "family"),
    ({"family": True}, "family"), ({"family_limit": 0}, "family_limit"),
    ({"family_limit": 10**7}, "family_limit"), ({"relaxation": "yes"}, "relaxation"),
    ({"waits": "on"}, "waits"), ({"waits": 1}, "waits"), ({"trim": "off"}, "trim"),
    ({"trim_tail": 0}, "trim_tail"), ({"trim_tail": 2.5}, "trim_tail"),
    ({"trim_share": 0}, "trim_share"), ({"trim_share": "x"}, "trim_share"),
    ({"heads": "yes"}, "heads"), ({"head_step": 0}, "head_step"),
    ({"head_floor": "yes"}, "head_floor"),
    ({"head_contents": 2}, "head_contents"),
    ({"head_step": 1.5}, "head_step"),
    ({"family": "all", "proof_gap": 1.0}, "proof_gap"),
    ({"family": "all", "proof_gap": 0}, "proof_gap"),
    ({"family": "all", "proof_gap": "1%"}, "proof_gap"),
    ({"family": "all", "proof_gap": True}, "proof_gap"),
    ({"proof_gap": 0.01}, "proof_gap"),  # the k-chunk family alone proves nothing
])
def test_bad_options_are_refused(extra, field):
    """One clear error naming the option."""
    problem = PipelineProblem(thesis_chain([1, 2, 3], [1, 2, 3], [1, 1, 1, 1, 0], [0, 0, 0]),
                              2, 10**6)
    with pytest.raises(OptmemInputError) as err:
        solve(problem, "chunks", options=replace(FAST, extra={**FAST.extra, **extra}))
    assert err.value.field == field


def test_the_relaxation_raises_the_bound_and_can_be_skipped():
    """Before the scan, the lifetime relaxation's bisection below the incumbent (as ``ilp``
    runs it): ``relaxation_bound`` reported and ``bound`` at least it, never above the
    plan; ``relaxation=False`` skips it (no key) and the plan is the same."""
    problem = PipelineProblem(thesis_chain([1, 3, 1, 4, 4, 4], [6, 4, 2, 1, 4, 1],
                                           [3, 3, 4, 0, 3, 2, 1, 0], [2, 0, 1, 0, 0, 0]),
                              3, 52)
    on = solve(problem, "chunks", options=replace(FAST, extra={**FAST.extra, "chunks": 1}))
    off = solve(problem, "chunks", options=replace(
        FAST, extra={**FAST.extra, "chunks": 1, "relaxation": False}))
    assert on.report["relaxation_probes"] >= 1, on.report
    assert "relaxation_bound" not in off.report
    assert on.bound >= on.report["relaxation_bound"] - 1e-9
    assert on.bound <= on.objective * (1 + 1e-9)
    assert on.objective == pytest.approx(off.objective, rel=1e-12)
    # here the relaxation is above the load bound (11.67), its start, and below the plan
    assert lower_bound(problem) < on.report["relaxation_bound"] <= on.objective


def test_not_in_the_default_comparison():
    """A scan can take minutes: ``compare`` and ``sweep`` run ``chunks`` only when named."""
    from optmem.solvers.facade import method_info
    from optmem.sweep import default_methods

    assert not method_info("pipeline", "chunks").in_compare
    assert "chunks" not in default_methods("pipeline")


def test_a_work_budget_asks_one_allocation_at_a_time_whatever_the_threads():
    """Under ``work_budget`` the scan asks one allocation at a time: what a question in
    flight is granted of the budget would depend on when it starts. So three threads give
    the very result of one (timings aside), with the budget spent part-way through (0.1 of
    the 0.26 deterministic seconds the scan takes without a budget)."""
    from json_helpers import timeless

    problem = eight_layer_problem(1)
    opts = replace(FAST, work_budget=0.1, extra={**FAST.extra, "chunk_work": 0.05,
                                                 "chunk_retry_work": 0.05})
    one = solve(problem, "chunks", options=opts)
    three = solve(problem, "chunks", options=replace(opts, threads=3))
    assert one.report["work_exhausted"] is True and one.status.has_plan
    assert one.report["work_calls"] >= 3 and one.report["work_skipped_calls"] >= 1
    assert timeless(one) == timeless(three)


def test_without_an_incumbent_a_plan_at_the_cap_is_found():
    """From no plan (``warm_start=False``) the scan's cap is ``Units.big_m``, which one GPU
    running five layers in sequence reaches exactly: that allocation is asked, not skipped.
    Before stop 55 it was skipped (its floor equals the cap) and ``chunks`` answered
    ``no_solution`` with a family bound of 10 where the optimum is 10."""
    chain = thesis_chain([1] * 5, [1] * 5, [0] * 7, [0] * 5)
    problem = PipelineProblem(chain, 1, 0)
    res = solve(problem, "chunks", options=SolveOptions(threads=1, seed=0, warm_start=False))
    assert res.status is Status.OPTIMAL, res.report
    assert res.objective == pytest.approx(10.0)
    assert res.report["chunks_skipped"] == 0


ROUNDS = chunked.WAIT_ROUNDS
"""The waits floor's rounds where it is asked (the scan's check before each question)."""


def first_use(gpu) -> list[int]:
    """``gpu`` renumbered by first use (the exact model's symmetry breaking)."""
    names: dict[int, int] = {}
    return [names.setdefault(g, len(names)) for g in gpu]


def old_floor(units, gpu, n_gpus: int, memory: int) -> float:
    """The floor before stop 57 (loads and lifetime rows at the path's least lengths)."""
    return chunked._old_floor(units, gpu, n_gpus, memory, units.big_m())


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=st.one_of(small_problems(), trimmable_problems(), five_layer_problems()),
       data=st.data())
def test_the_waits_floor_is_valid_and_never_below_the_old(problem, data):
    """Stop 57's floor (waits between the ops of one GPU and the transfers of one link,
    :func:`waits_check`) is at least the floor of loads and lifetimes, and at most the
    optimum of the exact model with the allocation fixed, proven by CP-SAT (integer
    durations: its grid is exact; 5 deterministic seconds; undecided runs are dropped); at
    that optimum ``waits_check`` itself passes; an allocation whose floor is ``inf`` below
    the cap has no plan at or below the cap."""
    units = make_units(problem)
    memory = problem.memory_per_gpu
    gpu = first_use(data.draw(st.lists(st.integers(0, problem.n_gpus - 1),
                                       min_size=units.n, max_size=units.n)))
    old = old_floor(units, gpu, problem.n_gpus, memory)
    new = chunked.allocation_floor(units, gpu, problem.n_gpus, memory, units.big_m(), ROUNDS)
    assert new >= old * (1 - 1e-12), (gpu, old, new)
    run = run_model(problem, "cpsat", BRUTE, gpu=gpu)
    assume(run.status in (Status.OPTIMAL, Status.INFEASIBLE))
    if run.plan is None:
        return
    period = run.plan.period
    assert new <= period * (1 + 1e-9), (gpu, old, new, period)
    assert chunked.waits_check(units, gpu, problem.n_gpus, memory, old)(period)
    assert chunked.allocation_floor(units, gpu, problem.n_gpus, memory, period,
                                    ROUNDS) <= period
    assert chunked.within(units, gpu, problem.n_gpus, memory, period, ROUNDS)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(problem=st.one_of(small_problems(), trimmable_problems(), five_layer_problems()),
       data=st.data(), rounds=st.sampled_from([1, 2, 4]))
def test_within_answers_as_the_floor_does_without_its_last_bisection(problem, data, rounds):
    """Stop 69: :func:`within` with waits rounds skips the last round's bisection (it asks
    only whether the floor is finite at the cap): for every drawn allocation and caps
    from below its floor to above it, its answer is whether :func:`allocation_floor` with
    the same rounds is finite there."""
    units = make_units(problem)
    memory = problem.memory_per_gpu
    gpu = first_use(data.draw(st.lists(st.integers(0, problem.n_gpus - 1),
                                       min_size=units.n, max_size=units.n)))
    floor = chunked.allocation_floor(units, gpu, problem.n_gpus, memory, units.big_m(), rounds)
    assume(math.isfinite(floor))
    answers = set()
    for scale in (0.9, 0.99, 1.0, 1.0 + 1e-6, 1.01, 1.2, 2.0):
        cap = floor * scale
        finite = chunked.allocation_floor(units, gpu, problem.n_gpus, memory, cap,
                                          rounds) < math.inf
        assert chunked.within(units, gpu, problem.n_gpus, memory, cap, rounds) is finite, \
            (gpu, cap, floor)
        answers.add(finite)
    assert answers == {False, True}, (gpu, floor)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=st.one_of(small_problems(), trimmable_problems(), five_layer_problems()),
       data=st.data(), slack=st.sampled_from([1.0, 1.3]))
def test_stash_floors_hold_in_the_optimal_plan_of_each_allocation(problem, data, slack):
    """Stop 66: the least stash counts (:func:`stash_floors`, the waits rows' counts at a
    cap) hold in a plan with a period at most the cap: the optimal plan of a drawn
    allocation (exact model with the allocation fixed, CP-SAT, 5 deterministic seconds),
    written into the model with the rows at the cap (its optimum, or 1.3 times it),
    violates no row; and the model with the rows has the same optimum."""
    units = make_units(problem)
    memory = problem.memory_per_gpu
    gpu = first_use(data.draw(st.lists(st.integers(0, problem.n_gpus - 1),
                                       min_size=units.n, max_size=units.n)))
    run = run_model(problem, "cpsat", BRUTE, gpu=gpu)
    assume(run.status is Status.OPTIMAL and run.plan is not None)
    assert run.plan is not None
    cap = run.plan.period * slack
    floors = chunked.stash_floors(units, gpu, problem.n_gpus, memory, 0.0, cap)
    assert all(k >= 1 and gpu[r] == gpu[q] for (r, q), k in floors.items()), floors
    form = build_pipeline_model(units, problem.n_gpus, memory, gpu=gpu, upper_bound=cap,
                                stash_floors=floors)
    values = form.encode(run.plan)
    assert values is not None
    assert not form.model.violated(values, tol=1e-6), (gpu, floors)
    again = run_model(problem, "cpsat", BRUTE, gpu=gpu, upper_bound=cap, stash_floors=floors)
    assert again.status is Status.OPTIMAL and again.plan is not None, again.report
    assert again.plan.period == pytest.approx(run.plan.period, abs=1e-6)


def test_stash_floors_are_rows_of_the_fixed_model_only():
    """The rows need a fixed allocation and pairs of one GPU (one clear error otherwise);
    without a memory limit there are none; on the tail-light instance some count exceeds
    the one copy every stash has at the allocation's floor."""
    problem = tail_light_problem(11)
    units = make_units(problem)
    gpu = [0, 0, 0, 0, 0, 1, 0, 1, 0]
    assert chunked.stash_floors(units, gpu, 3, None, 0.0, units.big_m()) == {}
    cap = chunked.allocation_floor(units, gpu, 3, problem.memory_per_gpu, units.big_m())
    floors = chunked.stash_floors(units, gpu, 3, problem.memory_per_gpu, 0.0, cap)
    assert max(floors.values()) >= 2, floors
    with pytest.raises(ValueError, match="fixed allocation"):
        build_pipeline_model(units, 3, problem.memory_per_gpu, stash_floors=floors)
    with pytest.raises(ValueError, match="not on one GPU"):
        build_pipeline_model(units, 3, problem.memory_per_gpu, gpu=gpu,
                             stash_floors={(0, 5): 1})


def test_the_method_with_and_without_stash_floors(monkeypatch):
    """:data:`STASH_FLOORS` (default on) changes no answer of the method ``chunks``: the
    complete family closes at the same optimum and bound, with as many allocations and
    heads refuted, as with the rows off."""
    assert chunked.STASH_FLOORS
    problem = tail_light_problem(11)
    options = replace(FAST, extra={**FAST.extra, "family": "all"})
    on = solve(problem, "chunks", options=options)
    monkeypatch.setattr(chunked, "STASH_FLOORS", False)
    off = solve(problem, "chunks", options=options)
    assert on.status is off.status is Status.OPTIMAL
    assert on.objective == pytest.approx(off.objective, rel=1e-9)
    assert on.bound == pytest.approx(off.bound, rel=1e-9)
    for key in ("complete_heads_refuted", "complete_family", "chunks_refuted"):
        assert on.report[key] == off.report[key], key


def test_the_waits_floor_is_strictly_stronger_on_a_handmade_instance():
    """Three layers on two GPUs, the middle one apart (f = 2, 4, 3; b = 3, 4, 1; memory 2:
    one stash of size 1, layer 1's, and at most two copies of it): the loads and lifetimes
    give 9 (GPU 0's load; layer 1's stash lives at least its path, 17, and two copies fit), while
    on GPU 0 the ops of layers 1 and 3 cannot all follow one another at their path delays
    modulo the period: the waits floor is 11 after one round, 12 (the exact optimum) after
    two."""
    problem = PipelineProblem(thesis_chain([2, 4, 3], [3, 4, 1], [1, 0, 0, 0, 0]), 2, 2)
    units = make_units(problem)
    gpu = [0, 1, 0]
    old = old_floor(units, gpu, 2, 2)
    new = chunked.allocation_floor(units, gpu, 2, 2, units.big_m(), ROUNDS)
    assert old == pytest.approx(9.0)
    assert new == pytest.approx(12.0)
    assert chunked.allocation_floor(units, gpu, 2, 2, units.big_m(), 1) == pytest.approx(11.0)
    assert chunked.allocation_floor(units, gpu, 2, 2, units.big_m()) == pytest.approx(9.0)
    # the walk with the waits floor lists it only from 12 on; without, from 9
    assert tuple(gpu) not in set(chunked.chunk_allocations(units, 2, 3, 11.9, 2,
                                                             rounds=ROUNDS))
    assert tuple(gpu) in set(chunked.chunk_allocations(units, 2, 3, 11.9, 2))
    assert chunked.allocations_bound(units, 2, 2, 0.0, units.big_m(), rounds=ROUNDS) >= \
        chunked.allocations_bound(units, 2, 2, 0.0, units.big_m()) - 1e-9
    run = run_model(problem, "cpsat", BRUTE, gpu=gpu)
    assert run.status is Status.OPTIMAL and run.plan is not None
    assert run.plan.period >= new * (1 - 1e-9)
    assert not chunked.waits_check(units, gpu, 2, 2, old)(10.9)
    assert chunked.memory_check(units, gpu, 2, 2)(10.9)


def test_the_waits_floor_is_valid_where_it_is_stronger():
    """Random small instances (3-5 layers, 2-3 GPUs, links of speed inf, 1 or 2, tight
    memory, fixed seed) until twelve allocations whose waits floor exceeds the old floor:
    each one's exact optimum (CP-SAT, 5 deterministic seconds, proven optimal or infeasible)
    is at least the waits floor. About one random allocation in 60 is strengthened."""
    rng = random.Random(57)
    checked = 0
    for _ in range(5000):
        n, gpus = rng.randint(3, 5), rng.randint(2, 3)
        f = [rng.randint(1, 5) for _ in range(n)]
        b = [rng.randint(1, 5) for _ in range(n)]
        a = [rng.randint(0, 3) for _ in range(n + 1)] + [0]
        chain = thesis_chain(f, b, a)
        lay = PipelineProblem(chain, gpus, 0).layers
        memory = rng.randint(max(lay.x), 2 * sum(lay.x) + 2 * sum(lay.a))
        problem = PipelineProblem(chain, gpus, memory,
                                  chain_bandwidth=rng.choice([math.inf, 1.0, 2.0]))
        units = make_units(problem)
        gpu = first_use([rng.randrange(gpus) for _ in range(units.n)])
        old = old_floor(units, gpu, gpus, memory)
        new = chunked.allocation_floor(units, gpu, gpus, memory, units.big_m(), ROUNDS)
        if not new > old + 1e-6:
            continue
        run = run_model(problem, "cpsat", BRUTE, gpu=gpu)
        assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
        if run.plan is not None:
            assert new <= run.plan.period * (1 + 1e-9), (f, b, a, memory, gpu, old, new)
            checked += 1
        if checked == 12:
            break
    assert checked == 12


def test_the_waits_floor_on_the_parallel_scan_instance_stays_below_the_optima():
    """Stop 58, the eight-layer instance (seed 5) on which one and two workers ended with
    different statuses when the waits floor was on (FEASIBLE, bound 30.9969, vs OPTIMAL,
    both at 31): an order effect, not a floor above the truth. The two allocations with
    the least waits floor (30.25, old floor 28) have the exact optimum 31 (CP-SAT with the
    allocation fixed); the least bound over every allocation is at most that optimum."""
    problem = eight_layer_problem(5)
    units = make_units(problem)
    memory = chunked.floor_memory(problem)
    cap = units.big_m()
    for gpu in ([0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 0, 0, 0, 2, 2]):
        old = chunked.allocation_floor(units, gpu, 3, memory, cap)
        new = chunked.allocation_floor(units, gpu, 3, memory, cap, ROUNDS)
        assert old < new, (old, new)
        run = run_model(problem, "cpsat", BRUTE, gpu=gpu)
        assert run.status is Status.OPTIMAL and run.plan is not None
        assert run.plan.period == pytest.approx(31.0, rel=1e-6)
        assert new <= run.plan.period * (1 + 1e-9)
    bound = chunked.allocations_bound(units, 3, memory, 0.0, cap, rounds=ROUNDS)
    assert bound <= 31.0 * (1 + 1e-9)
    assert bound >= chunked.allocations_bound(units, 3, memory, 0.0, cap)


@pytest.mark.parametrize("seed", [3, 5])
def test_the_waits_rows_in_the_scan_refute_without_asking_and_keep_the_best(seed):
    """Stop 59: the method asks the waits rows (:func:`waits_check`, from each allocation's
    floor, at the cutoff in force) before the exact model. On the eight-layer instances
    they refute allocations without a question (``chunks_waited``, counted in
    ``chunks_refuted``), so fewer questions are asked; the plan is the scan's without them
    (the family's best, up to the step), the family bound holds, and the run is the same
    on a second run and with two workers up to the order effect of stop 58 (the status)."""
    problem = eight_layer_problem(seed)
    plain = solve(problem, "chunks", options=NO_WAITS)
    waited = solve(problem, "chunks", options=FAST)
    assert plain.report["chunks_waited"] == 0
    assert waited.report["chunks_waited"] >= 1, waited.report
    assert waited.report["chunks_refuted"] >= waited.report["chunks_waited"]
    assert waited.report["chunks_evaluated"] < plain.report["chunks_evaluated"]
    assert waited.objective == pytest.approx(plain.objective, rel=2 * chunked.CHUNK_STEP)
    assert waited.report["chunks_bound"] is not None, waited.report
    assert waited.report["chunks_bound"] <= plain.objective * (1 + 1e-9)
    assert waited.bound <= waited.objective * (1 + 1e-9)
    again = solve(problem, "chunks", options=FAST)
    assert {k: v for k, v in again.report.items() if k.startswith("chunks_")} == \
        {k: v for k, v in waited.report.items() if k.startswith("chunks_")}
    two = solve(problem, "chunks", options=replace(FAST, threads=2))
    assert two.objective == pytest.approx(waited.objective, rel=2 * chunked.CHUNK_STEP)
    assert two.bound <= two.objective * (1 + 1e-9)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=st.one_of(small_problems(), five_layer_problems()))
def test_the_allocations_bound_with_waits_lies_between_the_plain_one_and_the_optimum(problem):
    """``allocations_bound(waits=True)`` (stop 59: each allocation listed at a step is
    asked the waits rows from the bound proven so far) is at least the bound without them
    and at most the optimum over every allocation (brute force: each allocation's fixed
    model, CP-SAT, 5 deterministic seconds; instances with an undecided one are dropped)."""
    solved = decided_allocations(problem)
    assume(solved is not None)
    assert solved is not None
    overall = min((period for _, period in solved), default=math.inf)
    units = make_units(problem)
    memory = chunked.floor_memory(problem)
    cap = units.big_m()
    plain = chunked.allocations_bound(units, problem.n_gpus, memory, 0.0, cap)
    waited = chunked.allocations_bound(units, problem.n_gpus, memory, 0.0, cap, waits=True)
    assert waited >= plain * (1 - 1e-12)
    assert waited <= min(overall, cap) * (1 + 1e-9), (plain, waited, overall)


def test_the_allocations_bound_with_waits_is_stronger_on_the_handmade_instance():
    """The three-layer instance above (old floor 9, waits floor 12, its optimum 12): over
    every allocation the bound with the waits rows exceeds the one without, and stays at
    most the best allocation's optimum (brute force)."""
    problem = PipelineProblem(thesis_chain([2, 4, 3], [3, 4, 1], [1, 0, 0, 0, 0]), 2, 2)
    units = make_units(problem)
    solved = decided_allocations(problem)
    assert solved is not None
    overall = min(period for _, period in solved)
    plain = chunked.allocations_bound(units, 2, 2, 0.0, units.big_m())
    waited = chunked.allocations_bound(units, 2, 2, 0.0, units.big_m(), waits=True)
    assert plain < waited <= overall * (1 + 1e-9), (plain, waited, overall)


def tail_light_problem(seed: int) -> PipelineProblem:
    """Nine layers, 3 GPUs, a tight memory, the stashes of the last layers small (as in the
    ResNets): the trimmed questions (stop 62) refute allocations by their first layers."""
    return eight_layer_problem(seed, n=9, tail_light=True)


@pytest.mark.parametrize(("seed", "tail"), [(4, 1), (4, 2), (11, 1)])
def test_trimmed_questions_refute_only_what_brute_force_refutes(seed, tail):
    """Stop 62: the complete family asked with trimmed questions (the first ``n - tail``
    units' allocation alone, :func:`~optmem.models.pipeline.trim_units`) refutes some
    allocations without their own question, and whatever it proves for an allocation
    (:attr:`Scan.decided`, trimmed or not) is at most the period of a plan of that
    allocation (its fixed model solved, 5 deterministic seconds); the pass closes with the
    same best period and a family bound at most it, as without trimmed questions; with two
    workers the same scan twice."""
    problem = tail_light_problem(seed)
    units = make_units(problem)
    best = solve(problem, "chunks", options=replace(NO_WAITS, extra={
        **NO_WAITS.extra, "family": "all", "trim": False}))
    assert best.status is Status.OPTIMAL and best.plan is not None
    family, _ = chunked.ranked(problem, units, units.n, best.objective * (1 + 1e-6))

    def ask(workers: int) -> chunked.Scan:
        return chunked.ask_family(problem, units, math.inf, None, family, work=5.0,
                                  step=chunked.PROOF_STEP, workers=workers, tail=tail,
                                  share=1e-9)  # every level, however few share a prefix

    out = ask(1)
    assert out.trimmed >= 1 and out.trim_questions >= 1, out
    assert out.refuted >= out.trimmed
    assert out.undecided == 0 and not math.isnan(out.bound), out
    assert out.period == pytest.approx(best.objective, rel=1e-6)
    assert out.bound <= best.objective * (1 + 1e-9)
    assert out.plan is not None
    assert replayed_period(problem, out.plan) == pytest.approx(out.period, rel=1e-9)
    for gpu, proven_at in out.decided.items():
        run = run_model(problem, "cpsat", BRUTE, gpu=list(gpu))  # a plan: its optimum or above
        if run.plan is not None:
            assert proven_at <= run.plan.period * (1 + 1e-9), (gpu, proven_at)
    first, again = ask(2), ask(2)
    assert first == again
    assert first.period == pytest.approx(out.period, rel=1e-6)
    assert first.trimmed >= 1 and not math.isnan(first.bound)


def test_trimmed_questions_are_on_by_default_and_can_be_turned_off():
    """``extra["trim"]`` (default true), ``extra["trim_tail"]`` (default
    :data:`~optmem.solvers.pipeline_chunks.TRIM_TAIL`) and ``extra["trim_share"]``: with
    them off no trimmed question is asked; with them on the plan and the complete family's
    bound are the same."""
    problem = tail_light_problem(11)
    extra = {**NO_WAITS.extra, "family": "all", "trim_tail": 1, "trim_share": 1e-9,
             "heads": False}  # the head pass would leave no allocation to trim here
    on = solve(problem, "chunks", options=replace(NO_WAITS, extra=extra))
    off = solve(problem, "chunks", options=replace(NO_WAITS, extra={**extra, "trim": False}))
    assert chunked.settings(SolveOptions()).tail == chunked.TRIM_TAIL
    assert off.report["complete_trim_questions"] == off.report["complete_trimmed"] == 0
    assert on.report["complete_trimmed"] >= 1, on.report
    assert on.report["complete_evaluated"] < off.report["complete_evaluated"]
    assert on.objective == pytest.approx(off.objective, rel=1e-9)
    assert on.status is off.status is Status.OPTIMAL
    assert on.report["complete_bound"] == pytest.approx(off.report["complete_bound"],
                                                        rel=1e-6)


def test_trim_levels_keep_the_levels_whose_prefixes_are_shared():
    """:func:`trim_levels`: a level is kept when the family holds at least ``share``
    allocations per prefix of it (most units dropped first, at least two units kept)."""
    family = [(0.0, gpu) for gpu in [(0, 0, 1, 1, 0), (0, 0, 1, 1, 1), (0, 0, 1, 0, 0),
                                     (0, 1, 1, 1, 0), (0, 1, 0, 0, 0), (0, 1, 2, 2, 2)]]
    # prefixes: 3 units dropped {00, 01} (3 each), 2 dropped {001, 011, 010, 012}, 1 dropped 5
    assert chunked.trim_levels(family, 5, 4) == chunked.trim_levels(family, 5, 3, 2.5) == (3,)
    assert chunked.trim_levels(family, 5, 4, 1.5) == (3, 2)
    assert chunked.trim_levels(family, 5, 4, 1.0) == (3, 2, 1)
    assert chunked.trim_levels(family, 5, 2, 1.0) == (2, 1)
    assert chunked.trim_levels([], 5, 4, 1.0) == ()


# ------------------------------------------------------------------ heads (stop 63)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(problem=small_problems(), data=st.data())
def test_heads_and_skips_list_what_the_full_walk_lists(problem, data):
    """:func:`chunk_allocations` with ``depth``: exactly the distinct heads of that length of
    the allocations it lists, in their order; with ``skip``: exactly those allocations that
    extend no skipped head (brute force over the full listing)."""
    units = make_units(problem)
    cap = data.draw(st.floats(0.3, 1.0)) * units.big_m()
    full = list(chunked.chunk_allocations(units, problem.n_gpus, units.n, cap,
                                          problem.memory_per_gpu))
    depth = data.draw(st.integers(1, units.n))
    heads = list(chunked.chunk_allocations(units, problem.n_gpus, units.n, cap,
                                           problem.memory_per_gpu, depth=depth))
    assert heads == list(dict.fromkeys(gpu[:depth] for gpu in full))
    skip = {gpu[:data.draw(st.integers(1, units.n))] for gpu in full
            if data.draw(st.booleans())}
    kept = list(chunked.chunk_allocations(units, problem.n_gpus, units.n, cap,
                                          problem.memory_per_gpu, skip=skip))
    assert kept == [gpu for gpu in full if not any(gpu[:k] in skip for k in range(units.n + 1))]
    contents: dict[int, set[int]] = {}  # stop 65: GPU contents of units 0 .. k - 1
    for gpu in full:
        if data.draw(st.booleans()):
            k = data.draw(st.integers(1, units.n))
            units_on = [q for q in range(k) if gpu[q] == gpu[data.draw(st.integers(0, k - 1))]]
            contents.setdefault(k, set()).add(sum(1 << q for q in units_on))
    both = chunked.Skip(frozenset(skip), contents)
    kept = list(chunked.chunk_allocations(units, problem.n_gpus, units.n, cap,
                                          problem.memory_per_gpu, skip=both))

    def covered(gpu: tuple[int, ...]) -> bool:  # some GPU holds exactly a mask of units < k
        return any({sum(1 << q for q in range(k) if gpu[q] == g) for g in gpu[:k]}
                   & masks for k, masks in contents.items())

    assert kept == [gpu for gpu in full if not covered(gpu)
                    and not any(gpu[:k] in skip for k in range(units.n + 1))]


def test_skip_checks_heads_and_gpu_contents_at_their_length():
    """:class:`~optmem.solvers.pipeline_chunks.Skip` (stop 65): a prefix is skipped when it
    is a refuted head or one of its GPUs holds exactly a refuted content of its length."""
    skip = chunked.Skip(frozenset({(0, 1)}), {3: {0b101}})
    assert (0, 1) in skip and (0, 1, 0) in skip  # GPU 0 holds units 0 and 2
    assert (0, 0, 1) not in skip and (0, 1, 1) not in skip and (0, 1, 0, 2) not in skip
    assert [0, 1] not in skip and not chunked.Skip() and skip
    assert chunked.gpu_masks((0, 1, 0, 2), 3) == [0b101, 0b010]
    assert chunked.gpu_masks((0, 1, 0, 2), 4) == [0b101, 0b010, 0b1000]


@pytest.mark.parametrize("seed", [4, 11])
def test_refuted_heads_bound_every_allocation_extending_them(seed):
    """Stop 63: :func:`head_pass` at the best plan's period refutes heads (the later units
    delayed, :func:`~optmem.models.pipeline.delay_tail`), and every allocation extending a
    refuted head has no plan below the bound it proves (each allocation's fixed model
    solved, 5 deterministic seconds); two workers give the same pass. Stop 64: with the
    heads' floor (:data:`~optmem.solvers.pipeline_chunks.HEAD_ROUNDS` rounds) some heads
    are refuted without a question, and their bounds hold the same way."""
    problem = tail_light_problem(seed)
    units = make_units(problem)
    best = solve(problem, "chunks", options=replace(FAST, extra={
        **FAST.extra, "family": "all", "heads": False}))
    assert best.status is Status.OPTIMAL
    cap = best.objective * (1 + 1e-6)
    depths = chunked.head_depths(units.n, 1)

    def heads(workers: int, rounds: int, deadline: float | None = None) -> chunked.Heads:
        return chunked.head_pass(problem, units, cap, best.objective, depths=depths,
                                 work=5.0, limit=10_000, workers=workers, rounds=rounds,
                                 deadline=deadline)

    plain, floored = heads(1, 0), heads(1, chunked.HEAD_ROUNDS)
    for out in (plain, floored):
        assert out.stopped == "done" and out.depths == depths
        assert out.cut, out
        assert [level[0] for level in out.levels] == depths
        assert sum(level[1] for level in out.levels) == out.asked
        assert sum(level[2] for level in out.levels) == len(out.cut)
        assert sum(level[3] for level in out.levels) == out.floored
    assert plain.floored == 0 and floored.floored >= 1, floored
    assert heads(2, chunked.HEAD_ROUNDS, deadline=time.perf_counter() + 1e6) == floored
    by_floor = {head for head, b in floored.cut.items() if b == best.objective}  # no grid
    assert len(by_floor) == floored.floored
    cut = {**plain.cut, **floored.cut}
    memory = chunked.floor_memory(problem)
    checked = bounds_hold(  # allocations extending a head the floor refuted, and the others
        problem, lambda gpu: [cut[gpu[:k]] for k in range(1, units.n) if gpu[:k] in cut],
        lambda gpu: int(not any(gpu[:k] in by_floor for k in range(1, units.n))), memory)
    assert checked[0] >= 1, checked  # the floor's heads; on seed 4 every head refuted is one


def on_a_lone_thread(body: str) -> None:
    """Run the function ``body`` of this module here if this process may fork worker
    processes (:func:`chunked.can_fork`, once idle tqdm monitors are stopped), else in a
    fresh interpreter, where it may on Linux: tests run earlier in the suite can leave
    Python threads behind (stop 71: in the whole suite, tqdm's monitor, started by a
    ``torch.compile`` test), and the head pass then keeps to threads, as it should."""
    chunked.stop_idle_tqdm_monitors()
    if chunked.can_fork() or not sys.platform.startswith("linux"):
        globals()[body]()
        return
    root = pathlib.Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]; "
            f"import tests.test_pipeline_chunks as t; t.{body}()")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-6000:]


def test_head_pass_on_processes_asks_and_answers_as_on_threads():
    """Stop 69: the head pass on two forked worker processes (where :func:`can_fork`: Linux,
    one Python thread) gives the same heads, levels and bounds as on two threads and as
    asked in turn; the method reports where its heads were asked
    (``complete_head_pool``) and closes at the same plan and bound with processes or
    threads. Run on a lone thread (:func:`on_a_lone_thread`), so processes are used on
    Linux."""
    on_a_lone_thread("processes_answer_as_threads")


def processes_answer_as_threads() -> None:
    """The body of :func:`test_head_pass_on_processes_asks_and_answers_as_on_threads`."""
    problem = tail_light_problem(4)
    units = make_units(problem)
    best = solve(problem, "chunks", options=replace(FAST, extra={
        **FAST.extra, "family": "all", "heads": False}))
    depths = chunked.head_depths(units.n, 1)

    def heads(workers: int, processes: bool) -> chunked.Heads:
        return chunked.head_pass(problem, units, best.objective * (1 + 1e-6), best.objective,
                                 depths=depths, work=5.0, limit=10_000, workers=workers,
                                 processes=processes)

    forks = sys.platform.startswith("linux") and threading.active_count() == 1
    assert chunked.can_fork() is forks
    serial, threads, processes = heads(1, True), heads(2, False), heads(2, True)
    assert serial.cut and serial == threads == processes, (serial, processes)
    assert (serial.pool, threads.pool) == ("serial", "threads")
    assert processes.pool == ("processes" if forks else "threads")
    extra = {**FAST.extra, "family": "all"}
    two = replace(FAST, threads=2)
    on = solve(problem, "chunks", options=replace(two, extra=extra))
    off = solve(problem, "chunks", options=replace(two, extra={**extra,
                                                               "head_processes": False}))
    assert on.report["complete_head_pool"] == ("processes" if forks else "threads")
    assert off.report["complete_head_pool"] == "threads"
    assert on.status is off.status is Status.OPTIMAL
    assert on.objective == off.objective and on.bound == off.bound
    assert on.report["complete_head_levels"] == off.report["complete_head_levels"]


def test_head_pool_forks_only_from_a_lone_thread_and_never_under_a_budget():
    """Stop 69: :func:`head_pool` gives no pool to one worker, threads where another
    Python thread runs (a fork would copy only the forking thread, and any lock another
    holds would stay held in the child) or when processes are not asked, and processes
    otherwise on Linux."""
    assert chunked.head_pool(1, True) is None
    with work_budget(10.0):
        assert chunked.head_pool(2, True) is None
    with chunked.head_pool(2, False) as pool:
        assert isinstance(pool, ThreadPoolExecutor)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not chunked.can_fork()
        with chunked.head_pool(2, True) as pool:
            assert isinstance(pool, ThreadPoolExecutor)
    finally:
        release.set()
        other.join()
    if chunked.can_fork():
        with chunked.head_pool(2, True) as pool:
            assert isinstance(pool, ProcessPoolExecutor)
            assert pool.submit(sum, (1, 2)).result() == 3


_PARENT = os.getpid()
_ASK_HEAD = chunked.ask_head


def _ask_or_die(problem: PipelineProblem, units, head: tuple[int, ...], **kwargs):
    """:func:`chunked.ask_head`, except that a worker process asked a head of 6 or more
    units exits at once (a worker killed, as by the kernel's out-of-memory killer)."""
    if os.getpid() != _PARENT and len(head) >= 6:
        os._exit(1)
    return _ASK_HEAD(problem, units, head, **kwargs)


def test_head_pass_survives_its_worker_processes_dying():
    """Stop 69: when the worker processes of :func:`head_pass` die (every question of a
    later level kills its worker, breaking the pool with questions in flight), the heads
    in flight and all later ones are asked in the solving process: the pass ends with the
    same heads, levels and bounds as asked in turn, and nothing is raised. Run on a lone
    thread (:func:`on_a_lone_thread`), so the workers are processes."""
    if not sys.platform.startswith("linux"):
        pytest.skip("worker processes are forked on Linux only")
    on_a_lone_thread("pass_survives_dying_workers")


def test_an_idle_tqdm_monitor_does_not_keep_the_head_pass_on_threads():
    """Stop 71: ``torch.fx``'s interpreter (``torch.compile`` with ``aot_eager``) opens a
    tqdm bar, whose monitor thread then lived to the end of the process and kept
    :func:`chunked.can_fork` false: the head pass ran on threads after any compile (found in
    the suite by ``test_fast_path.py::test_hf_model_on_the_fast_path``). With no bar open
    the monitor is stopped and the pool forks processes; with a bar open it is left alone
    (threads); the next bar starts a new monitor. Run on a lone thread."""
    if not sys.platform.startswith("linux"):
        pytest.skip("worker processes are forked on Linux only")
    on_a_lone_thread("idle_tqdm_monitor_is_stopped")


def idle_tqdm_monitor_is_stopped() -> None:
    """The body of :func:`test_an_idle_tqdm_monitor_does_not_keep_the_head_pass_on_threads`."""
    import io

    from tqdm import tqdm

    def monitors() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "tqdm_monitor" and t.is_alive()]

    assert threading.active_count() == 1 and chunked.can_fork()
    bar = tqdm(total=2, file=io.StringIO())
    assert len(monitors()) == 1 and not chunked.can_fork()
    pool = chunked.head_pool(2, True)
    assert isinstance(pool, ThreadPoolExecutor) and len(monitors()) == 1  # a bar is open
    pool.shutdown()
    bar.close()
    pool = chunked.head_pool(2, True)
    assert isinstance(pool, ProcessPoolExecutor), pool
    assert not monitors() and threading.active_count() == 1
    pool.shutdown()
    with tqdm(total=1, file=io.StringIO()) as again:  # tqdm goes on: a new monitor
        again.update()
        assert len(monitors()) == 1
    assert chunked.stop_idle_tqdm_monitors() == 1 and not monitors()


def pass_survives_dying_workers() -> None:
    """The body of :func:`test_head_pass_survives_its_worker_processes_dying`."""
    assert chunked.can_fork()
    problem = tail_light_problem(4)
    units = make_units(problem)
    best = solve(problem, "chunks", options=replace(FAST, extra={
        **FAST.extra, "family": "all", "heads": False}))
    depths = chunked.head_depths(units.n, 1)
    assert min(depths) < 6 <= max(depths), depths  # some levels on workers, then they die

    def heads(workers: int) -> chunked.Heads:
        return chunked.head_pass(problem, units, best.objective * (1 + 1e-6), best.objective,
                                 depths=depths, work=5.0, limit=10_000, workers=workers,
                                 processes=True)

    serial = heads(1)
    chunked.ask_head = _ask_or_die  # type: ignore[assignment]
    try:
        dying = heads(2)
    finally:
        chunked.ask_head = _ASK_HEAD  # type: ignore[assignment]
    assert dying.pool == "processes"
    assert serial.cut and dying == serial, (serial, dying)
    assert dying.levels == serial.levels


def bounds_hold(problem: PipelineProblem, bounds_of, kind_of, memory: int, most: int = 6
                ) -> list[int]:
    """Allocations of each kind (0 or 1) with bounds whose plan (fixed model solved, 5
    deterministic seconds: its optimum or above) is at least each bound: up to ``most``
    of each kind checked, their counts returned."""
    units = make_units(problem)
    checked = [0, 0]
    for gpu in chunked.chunk_allocations(units, problem.n_gpus, units.n, units.big_m(),
                                         memory):
        bounds, kind = bounds_of(gpu), kind_of(gpu)
        if not bounds or checked[kind] == most:
            continue
        run = run_model(problem, "cpsat", BRUTE, gpu=list(gpu))
        if run.plan is not None:
            assert max(bounds) <= run.plan.period * (1 + 1e-9), (gpu, bounds)
            checked[kind] += 1
    return checked


def test_heads_are_on_by_default_and_can_be_turned_off():
    """``extra["heads"]`` (default true) and ``extra["head_step"]`` (default
    :data:`~optmem.solvers.pipeline_chunks.HEAD_STEP`): with heads the complete family asks
    fewer allocations and closes at the same plan and bound as without; off, no head is
    asked; a level with more heads than the limit stops the pass before it (``"limit"``)."""
    problem = tail_light_problem(11)
    extra = {**FAST.extra, "family": "all", "head_step": 1}
    on = solve(problem, "chunks", options=replace(FAST, extra=extra))
    off = solve(problem, "chunks", options=replace(FAST, extra={**extra, "heads": False}))
    assert chunked.settings(SolveOptions()).head_step == chunked.HEAD_STEP
    assert off.report["complete_heads"] == off.report["complete_heads_refuted"] == 0
    assert chunked.settings(SolveOptions()).head_rounds == 0  # measured: no time saved
    assert not chunked.settings(SolveOptions()).head_contents
    assert chunked.settings(SolveOptions(extra={"head_contents": True})).head_contents
    assert chunked.settings(SolveOptions(extra={"head_floor": True})).head_rounds \
        == chunked.HEAD_ROUNDS
    levels = on.report["complete_head_levels"]
    assert [level[0] for level in levels] == chunked.head_depths(9, 1)
    assert [sum(level[i] for level in levels) for i in (1, 2, 3)] == [
        on.report[f"complete_heads{key}"] for key in ("", "_refuted", "_floored")]
    assert on.report["complete_heads_refuted"] >= 1, on.report
    assert on.report["complete_head_depths"] == chunked.head_depths(9, 1)
    assert on.report["complete_family"] < off.report["complete_family"], on.report
    assert on.objective == pytest.approx(off.objective, rel=1e-9)
    assert on.status is off.status is Status.OPTIMAL
    assert on.report["complete_bound"] == pytest.approx(off.report["complete_bound"],
                                                        rel=1e-6)
    units = make_units(problem)
    first = len(list(chunked.chunk_allocations(units, 3, units.n, units.big_m(),
                                               chunked.floor_memory(problem), depth=4)))
    capped = chunked.head_pass(problem, units, units.big_m(), on.objective, depths=[4, 5],
                               work=5.0, limit=first - 1)
    assert first >= 2 and capped == chunked.Heads(stopped="limit")


@pytest.mark.parametrize("seed", [8, 13])
def test_refuted_gpu_contents_bound_every_allocation_putting_them_on_a_gpu(seed):
    """Stop 65: with ``contents``, :func:`head_pass` asks each GPU of a refuted head alone
    (:func:`~optmem.solvers.pipeline_chunks.refuted_contents`); every allocation whose
    first ``k`` units put a refuted content on one GPU has no plan below its bound (each
    allocation's fixed model solved, 5 deterministic seconds, including allocations
    extending no refuted head); later heads holding one are refuted without a question
    (seed 8, a lag of one answer); two workers give the same pass; the method closes at
    the same plan and bound with ``head_contents=true`` as without."""
    problem = tail_light_problem(seed)
    units = make_units(problem)
    extra = {**FAST.extra, "family": "all", "head_step": 1}
    best = solve(problem, "chunks", options=replace(FAST, extra={**extra, "heads": False}))
    assert best.status is Status.OPTIMAL

    def heads(workers: int, lag: int = 1) -> chunked.Heads:
        return chunked.head_pass(problem, units, best.objective * (1 + 1e-6), best.objective,
                                 depths=chunked.head_depths(units.n, 1), work=5.0,
                                 limit=10_000, workers=workers, contents=True, lag=lag)

    out = heads(1)
    assert out.contents and out.questions[1] == len(out.contents), out
    assert sum(level[4] for level in out.levels) == out.covered
    assert out.covered >= (seed == 8), out
    assert heads(2) == out
    wide = heads(2, chunked.HEAD_LAG)  # contents applied later: fewer heads covered
    assert wide.covered <= out.covered and set(wide.cut) >= set(out.cut) - {
        head for head in out.cut if any(head[:k] in wide.cut for k in range(len(head)))}
    assert all(b < best.objective for b in out.contents.values())
    checked = bounds_hold(  # allocations holding a content: extending a refuted head, or not
        problem, lambda gpu: [b for (k, mask), b in out.contents.items()
                              if mask in chunked.gpu_masks(gpu, k)],
        lambda gpu: int(not any(gpu[:k] in out.cut for k in range(1, units.n))),
        chunked.floor_memory(problem))
    assert checked[1] >= 1, checked
    on = solve(problem, "chunks", options=replace(FAST, extra={**extra, "head_contents": True}))
    off = solve(problem, "chunks", options=replace(FAST, extra=extra))
    assert on.status is off.status is Status.OPTIMAL
    assert on.objective == pytest.approx(off.objective, rel=1e-9)
    assert on.report["complete_bound"] == pytest.approx(off.report["complete_bound"],
                                                        rel=1e-6)
    assert on.report["complete_head_contents"][2] >= 1, on.report
    assert off.report["complete_head_contents"] == [0, 0, 0]
    assert on.report["complete_family"] <= off.report["complete_family"], on.report


def test_head_questions_refute_what_cpsat_defaults_refute():
    """Stop 65: :func:`~optmem.solvers.pipeline_chunks.head_question` (first with
    :data:`~optmem.solvers.pipeline_chunks.HEAD_PARAMETERS` and a share of the work, then
    CP-SAT's defaults if that run leaves the head open) refutes every head of every length
    that one run with the defaults refutes, at the same bound, and none in which that run
    finds a plan."""
    problem = tail_light_problem(11)
    units = make_units(problem)
    best = solve(problem, "chunks", options=replace(FAST, extra={
        **FAST.extra, "family": "all", "heads": False}))
    low = lower_bound(problem)
    answers = []
    for depth in chunked.head_depths(units.n, 1):
        for head in chunked.chunk_allocations(units, problem.n_gpus, units.n,
                                              best.objective * (1 + 1e-6),
                                              chunked.floor_memory(problem), depth=depth):
            relaxed, alloc = delay_tail(units, head)
            run, plain = refute(replace(problem, n_gpus=max(alloc) + 1),
                                chunked._question_options(5.0, 0, None), best.objective,
                                units=relaxed, gpu=list(alloc), lower=low)
            method = chunked.head_question(problem, relaxed, alloc, best.objective, work=5.0,
                                           seed=0, deadline=None, lower=low)
            answers.append((plain, method, run.plan is not None))
    assert any(plain is not None for plain, _, _ in answers), answers
    assert any(plan for _, _, plan in answers), answers
    assert all(method == plain for plain, method, _ in answers if plain is not None), answers
    assert all(method is None for _, method, plan in answers if plan), answers


def test_head_instance_builds_the_model_the_head_question_solves(monkeypatch):
    """Stop 68: :func:`~optmem.solvers.pipeline_chunks.head_instance` and
    :func:`~optmem.solvers.pipeline_common.build_model` (what ``bench_cpsat_writer.py``
    builds) give, for every head of two lengths, the very model CP-SAT receives from
    :func:`~optmem.solvers.pipeline_chunks.head_question` (the same proto), stash floors
    included."""
    from optmem.engines import adapters
    from optmem.models.formulation import to_cpsat

    problem = tail_light_problem(11)
    units = make_units(problem)
    cap = units.big_m()
    low = lower_bound(problem)
    sent = []
    real = adapters.solve_cpsat

    def spy(cp, *args, **kwargs):
        sent.append(str(cp.Proto()))
        return real(cp, *args, **kwargs)

    monkeypatch.setattr(adapters, "solve_cpsat", spy)
    checked = floored = 0
    for depth in (6, 8):
        for head in list(chunked.chunk_allocations(units, problem.n_gpus, units.n, cap,
                                                   chunked.floor_memory(problem),
                                                   depth=depth))[:6]:
            relaxed, alloc = delay_tail(units, head)
            cutoff = 1.05 * chunked.allocation_floor(relaxed, alloc, max(alloc) + 1,
                                                     problem.memory_per_gpu, cap)
            sent.clear()
            chunked.head_question(problem, relaxed, alloc, cutoff, work=5.0, seed=0,
                                  deadline=None, lower=low)
            shape, floors = chunked.head_instance(problem, relaxed, alloc, cutoff, low)
            form = build_model(shape, units=relaxed, gpu=list(alloc), upper_bound=cutoff,
                               lower=low, feasibility=True, stash_floors=floors)
            written = to_cpsat(form.model, form.time_scale()[0])
            assert sent and sent[0] == str(written.cp.Proto())
            checked += 1
            floored += bool(floors)
    assert checked == 12 and floored >= 1, (checked, floored)


def test_heads_reached_after_the_deadline_are_neither_asked_nor_counted():
    """Stop 65: a head the pass reaches once the deadline has passed gets no question and
    is not counted as asked (until then, the heads of the level the deadline fell in were
    counted: ResNet-50 3x, 326 "asked" heads of 17 units, 5 refuted). No clock is raced:
    the deadline has passed before the pass starts."""
    problem = tail_light_problem(11)
    units = make_units(problem)
    late = chunked.head_pass(problem, units, units.big_m(), 1e9, depths=[4, 5], work=5.0,
                             limit=10_000, deadline=time.perf_counter() - 1.0)
    assert late == chunked.Heads(depths=[4], levels=[[4, 0, 0, 0, 0]], stopped="time")
    assert late.report()["complete_heads"] == 0
    now = time.perf_counter()
    assert not chunked.passed(None) and chunked.passed(now - 1.0)
    assert not chunked.passed(now + 1e6)
    assert chunked.time_limit(None) is None and chunked.time_limit(now - 1.0) == 1e-3
    assert 1e6 - 60 < chunked.time_limit(now + 1e6) <= 1e6


def test_head_depths():
    """Half the units first, then every ``step`` units, below ``n``."""
    assert chunked.head_depths(21, 2) == [10, 12, 14, 16, 18, 20]
    assert chunked.head_depths(9, 1) == [4, 5, 6, 7, 8]
    assert chunked.head_depths(2, 3) == [1]
    assert chunked.head_depths(1, 1) == []


def test_compare_summary_takes_the_complete_familys_proof():
    """Stop 71: ``chunks`` is a full-model method for ``compare``'s summary (its bound,
    ``optimal`` and ``infeasible`` hold for every plan, as ``ilp``'s): with
    ``family="all"`` it gives the proven optimum and the DP's gap to it, and its
    ``infeasible`` below the least memory is reported as proven; ``madpipe``'s is not (a
    plan-finding method)."""
    from optmem.cli import dp_summary

    problem = tail_light_problem(4)
    dp = solve(problem, "contiguous")
    whole = solve(problem, "chunks", options=replace(FAST, extra={**FAST.extra,
                                                                  "family": "all"}))
    assert whole.status is Status.OPTIMAL, whole.report
    summary = dp_summary([dp, solve(problem, "madpipe"), whole])
    assert summary["bound_method"] == "chunks" and summary["optimum"] == whole.objective
    assert summary["dp"] == dp.objective >= whole.objective
    assert summary["gap"] == pytest.approx((dp.objective - whole.bound) / dp.objective)
    tiny = replace(problem, memory_per_gpu=problem.memory_lower_bound() - 1)
    assert dp_summary([solve(tiny, "madpipe")])["infeasible"] is None
    assert dp_summary([solve(tiny, "madpipe"), solve(tiny, "chunks", options=FAST)]
                      )["infeasible"] == "chunks"
