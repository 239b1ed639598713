"""The allocation decomposition of the exact pipeline model (``extra={"strategy": "benders"}``).

Cross-checks: brute force over allocations (each allocation's fixed-allocation optimum), the
full model where both prove, the incumbents (never above them), and a stopped run (a valid
bound, a replayed plan). No wall-clock limits: the instances are small enough to be proven,
and the stopped run uses CP-SAT's deterministic time on one worker.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.errors import OptmemInputError
from optmem.models.pipeline import (
    delay_tail,
    first_use,
    isolate_units,
    make_units,
    trim_units,
)
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_benders import solve_benders
from optmem.solvers.pipeline_common import lower_bound, run_model
from tests.test_pipeline_exact import (
    check,
    draw_chain,
    set_partitions,
    small_problems,
    thesis_chain,
)

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the decomposition's master needs OR-Tools")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(threads=1, seed=0)  # no limit: these instances always prove
BENDERS = {"strategy": "benders", "relaxation": False, "warm_madpipe": False}


def brute_force(problem: PipelineProblem) -> float:
    """The best fixed-allocation optimum over every allocation (``inf``: none fits)."""
    n = make_units(problem).n
    best = math.inf
    for gpu in set_partitions(n, problem.n_gpus):
        run = run_model(problem, "cpsat", replace(OPTS, warm_start=False), gpu=gpu)
        assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
        if run.plan is not None:
            best = min(best, run.plan.period)
    return best


def cold(problem: PipelineProblem, method: str = "cpsat", options: SolveOptions = OPTS):
    """The decomposition from no plan at all: every allocation goes through the master."""
    units = make_units(problem)
    return solve_benders(problem, method, options, period=units.big_m() + 1.0, plan=None,
                         bound=lower_bound(problem), deadline=None)


def cold_equals_brute_force(problem: PipelineProblem, options: SolveOptions = OPTS):
    """The cold loop's outcome, checked against brute force (``None``: nothing fits)."""
    expected = brute_force(problem)
    out = cold(problem, options=options)
    assert not out.stop, out.report
    if math.isinf(expected):
        assert out.plan is None
        return None
    assert out.plan is not None
    assert out.period == pytest.approx(expected, abs=1e-5)
    assert out.bound <= expected + 1e-9
    sim = simulate_pipeline(problem, out.plan)  # every plan of the loop replays
    assert sim.period == pytest.approx(out.period)
    assert sim.peak_memory <= problem.memory_per_gpu
    return out


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), strict=st.booleans())
def test_cold_decomposition_equals_brute_force(problem, strict):
    """Started without an incumbent, the loop finds and proves the brute-force optimum."""
    p = replace(problem, memory_model="strict") if strict else problem
    out = cold_equals_brute_force(p)
    if out is None:
        return
    for gpu, bound in out.cuts.items():  # every allocation's bound holds
        run = run_model(p, "cpsat", replace(OPTS, warm_start=False), gpu=list(gpu))
        if run.plan is not None:
            assert bound <= run.plan.period + 1e-9


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=small_problems(), method=st.sampled_from(["cpsat", "ilp"]))
def test_strategy_equals_full_model(problem, method):
    """Both strategies prove the same optimum (or infeasibility) and never exceed the DPs."""
    full = solve(problem, method, options=OPTS)
    ben = solve(problem, method, options=replace(OPTS, extra=BENDERS))
    assert ben.status is full.status, ben.report
    if full.status is not Status.OPTIMAL:
        return
    assert ben.objective == pytest.approx(full.objective, abs=1e-5)
    check(problem, ben)
    assert ben.bound <= ben.objective + 1e-9
    for name in ("contiguous", "madpipe"):
        other = solve(problem, name, options=OPTS)
        if other.status.has_plan:
            assert ben.objective <= other.objective + 1e-6


def chain_with_subproblems() -> PipelineProblem:
    """A chain where the master admits allocations that the subproblem must refute."""
    chain = thesis_chain([1, 3, 3, 1, 2], [4, 1, 1, 4, 3], [1, 1, 3, 3, 3, 1, 0], [1, 1, 3, 0, 0])
    return PipelineProblem(chain, 3, 25, chain_bandwidth=2.0)


def test_subproblems_run_and_agree(monkeypatch):
    """The loop evaluates allocations (not only the master) and ends at the optimum, with
    the master's window arcs (one allocation) and without them (at least three)."""
    from optmem.solvers import pipeline_benders

    problem = chain_with_subproblems()
    with_arcs = cold(problem)
    monkeypatch.setattr(pipeline_benders, "build_relaxation",
                        partial(pipeline_benders.build_relaxation, arcs=False))
    out = cold(problem)
    assert out.cuts, out.report
    assert out.report["benders_allocations"] == len(out.cuts) >= 3
    assert 1 <= with_arcs.report["benders_allocations"] < len(out.cuts)
    for method in ("cpsat", "ilp"):  # brute force over its 41 allocations: the hypothesis test
        full = solve(problem, method, options=OPTS)
        assert full.status is Status.OPTIMAL
        for run in (out, with_arcs):
            assert run.period == pytest.approx(full.objective, abs=1e-5)
            assert run.bound <= run.period + 1e-9


def test_stopped_run_keeps_a_valid_bound_and_plan():
    """A deterministic work limit stops phase 1: phase 2's bound stays below the optimum."""
    problem = chain_with_subproblems()
    optimum = solve(problem, "cpsat", options=OPTS).objective
    units = make_units(problem)
    limited = replace(OPTS, deterministic_time=1e-3)
    out = solve_benders(problem, "cpsat", limited, period=units.big_m() + 1.0, plan=None,
                        bound=lower_bound(problem), deadline=None)
    assert out.stop, out.report  # the limit stopped phase 1 (it proves without it)
    assert out.report["benders_phase1_stopped"] == out.stop
    assert lower_bound(problem) <= out.bound <= optimum + 1e-9
    if out.plan is not None:
        sim = simulate_pipeline(problem, out.plan)
        assert sim.peak_memory <= problem.memory_per_gpu
        assert optimum - 1e-9 <= sim.period == pytest.approx(out.period)
    # through the facade: the short full-model run first, then the loop; a replayed plan
    r = solve(problem, "cpsat", options=replace(limited, extra=BENDERS))
    assert r.status.has_plan, r.report
    check(problem, r)
    assert "full_model" in r.report and r.report["strategy"] == "benders"
    assert r.bound <= optimum + 1e-9 <= r.objective + 2e-9


def test_unknown_strategy_is_an_input_error():
    problem = chain_with_subproblems()
    with pytest.raises(OptmemInputError, match="strategy"):
        solve(problem, "cpsat", options=replace(OPTS, extra={"strategy": "magic"}))


@pytest.mark.parametrize("work", ["fast", -1.0, 0, True])
def test_bad_trim_work_is_an_input_error(work):
    problem = chain_with_subproblems()
    with pytest.raises(OptmemInputError, match="trim_work"):
        solve(problem, "cpsat", options=replace(OPTS, extra={**BENDERS, "trim_work": work}))


def test_failing_engine_returns_the_incumbent(monkeypatch):
    """An engine that fails inside the loop never crashes the solve: the incumbent, replayed."""
    from optmem.engines import adapters

    problem = chain_with_subproblems()
    monkeypatch.setattr(adapters, "solve_cpsat", lambda *a, **k: adapters.failed_result(
        "cpsat", "engine exploded"))
    r = solve(problem, "cpsat", options=replace(OPTS, extra=BENDERS))
    assert r.status is Status.FEASIBLE, r.report
    check(problem, r)
    assert "engine exploded" in r.report["benders_error"]
    assert r.report["source"] == "contiguous 1F1B*"
    assert r.bound == pytest.approx(lower_bound(problem))


# ------------------------------------------------------------------ trimmed refutations
@st.composite
def trimmable_problems(draw):
    """Chains of 3-4 layers (so that one or two units can be trimmed), 2-3 GPUs."""
    chain = draw_chain(draw, 3, 4, 3)
    gpus = draw(st.integers(2, 3))
    lay = PipelineProblem(chain, gpus, 0).layers
    memory = draw(st.integers(max(lay.x) + 3 * max(lay.w) + 2 * max(lay.a),
                              3 * sum(lay.w) + 3 * sum(lay.x) + 4 * sum(lay.a) + 1))
    beta = draw(st.sampled_from([math.inf, 1.0, 2.0]))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_trimmed_units_relax_every_allocation(problem, strict):
    """``trim_units`` is a relaxation: for every allocation with a plan of period ``p`` and
    every trimming, the trimmed partition has a plan at ``p`` (its optimum is ``<= p``, and
    the feasibility run the decomposition uses finds one at that cutoff)."""
    p = replace(problem, memory_model="strict") if strict else problem
    units = make_units(p)
    checked = 0
    for gpu, period in solved_allocations(p):
        for head in range(units.n - 1):
            for tail in range(units.n - 1 - head):
                if head + tail == 0:
                    continue
                assert_relaxes(p, trim_units(units, head, tail), gpu[head:units.n - tail],
                               period)
                checked += 1
    assert checked or not solved_allocations(p)


def solved_allocations(problem: PipelineProblem) -> list[tuple[list[int], float]]:
    """Every allocation with a plan, and its optimal period (brute force)."""
    out = []
    for gpu in set_partitions(make_units(problem).n, problem.n_gpus):
        run = run_model(problem, "cpsat", replace(OPTS, warm_start=False), gpu=gpu)
        assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
        if run.plan is not None:
            out.append((gpu, run.plan.period))
    return out


def assert_relaxes(problem: PipelineProblem, units, gpu, period: float) -> None:
    """``units`` with allocation ``gpu`` has an optimum ``<= period``, and the feasibility
    run the decomposition uses finds a plan at that cutoff."""
    opts = replace(OPTS, warm_start=False)
    best = run_model(problem, "cpsat", opts, units=units, gpu=list(gpu))
    assert best.status is Status.OPTIMAL, best.report
    assert best.plan is not None and best.plan.period <= period + 1e-6
    feas = run_model(problem, "cpsat", opts, units=units, gpu=list(gpu),
                     upper_bound=period * (1 + 1e-6), feasibility=True)
    assert feas.bound != math.inf and feas.plan is not None


def test_trim_units_keeps_the_range():
    """The kept units' data, the cuts between them; the new last unit sends nothing."""
    units = make_units(chain_with_subproblems())
    part = trim_units(units, 1, 2)
    assert part.n == units.n - 3 and part.bounds == units.bounds[1:units.n - 2]
    assert part.x == units.x[1:units.n - 2] and part.w == units.w[1:units.n - 2]
    assert part.dt == units.dt[1:units.n - 3] and part.buf == units.buf[1:units.n - 3]
    assert part.a_out[-1] == 0 and part.a_out[:-1] == units.a_out[1:units.n - 3]
    with pytest.raises(ValueError, match="cannot keep"):
        trim_units(units, 3, 2)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems())
def test_decomposition_with_range_nogoods_equals_brute_force(problem):
    """Longer chains (trimming applies): the loop still ends at the brute-force optimum, and
    every range no-good it keeps holds for every allocation that extends it."""
    out = cold_equals_brute_force(problem)
    if out is None:
        return
    units = make_units(problem)
    for (head, tail, labels), bound in out.ranges.items():
        for gpu in set_partitions(units.n, problem.n_gpus):
            if first_use(tuple(gpu[head:units.n - tail])) != labels:
                continue
            run = run_model(problem, "cpsat", replace(OPTS, warm_start=False), gpu=gpu)
            if run.plan is not None:
                assert bound <= run.plan.period + 1e-9


def trimming_chain() -> PipelineProblem:
    """Five layers on 3 GPUs where the master proposes allocations the subproblem refutes."""
    chain = thesis_chain([2, 2, 3, 3, 3], [3, 2, 4, 1, 3], [3, 2, 3, 1, 0, 1, 0],
                         [1, 1, 0, 1, 0])
    return PipelineProblem(chain, 3, 15, chain_bandwidth=1.0)


def test_refuted_allocations_are_generalised():
    """From the contiguous incumbent, refuted allocations go through trimmed solves, and
    the loop proves the full model's optimum."""
    from optmem.solvers.pipeline_exact import incumbents

    problem = trimming_chain()
    period, plan, _ = incumbents(problem, OPTS)[0]
    out = solve_benders(problem, "cpsat", OPTS, period=period, plan=plan,
                        bound=lower_bound(problem), deadline=None)
    assert out.report["benders_trimmed_solves"] >= 1, out.report
    assert out.report["benders_allocations"] >= 1
    full = solve(problem, "cpsat", options=OPTS)
    assert full.status is Status.OPTIMAL
    assert out.period == pytest.approx(full.objective, abs=1e-5)
    assert out.bound <= out.period + 1e-9 and not out.stop


def test_partition_nogood_excludes_every_relabelling():
    """The master with one range no-good per partition found never proposes a partition
    of the range twice (whatever its GPU labels), and runs out after at most Bell(3) = 5."""
    from optmem.engines import adapters as engines
    from optmem.models.formulation import to_cpsat
    from optmem.models.pipeline import build_relaxation
    from optmem.solvers.pipeline_benders import _partition_nogood

    problem = replace(trimming_chain(), memory_per_gpu=10**6)
    units = make_units(problem)
    head, tail = 1, 1
    seen: list[tuple[int, ...]] = []
    for _ in range(7):
        form = build_relaxation(units, problem.n_gpus, problem.memory_per_gpu, 10**4, 100)
        for labels in seen:
            form.model.add(_partition_nogood(form.z, head, labels), f"ng_{len(seen)}")
        cm = to_cpsat(form.model, 1)
        res = engines.solve_cpsat(cm.cp, cm.variables, threads=1, seed=0)
        if res.status is Status.INFEASIBLE:
            break
        values = cm.values(res.values)
        gpu = [max((p for p in range(form.n_gpus) if (q, p) in form.x),
                   key=lambda p, q=q: float(form.x[(q, p)].value(values)))
               for q in range(units.n)]
        labels = first_use(tuple(gpu[head:units.n - tail]))
        assert labels not in seen  # labels by first use: a relabelling is the same key
        seen.append(labels)
    assert 1 <= len(seen) <= 5 and res.status is Status.INFEASIBLE


# ------------------------------------------------------------------ GPUs in isolation
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_isolated_gpus_relax_every_allocation(problem, strict):
    """``isolate_units`` is a relaxation: for every allocation with an optimal plan of period
    ``p`` and every proper subset of its GPUs kept, the isolated instance has a plan at
    ``p`` (its optimum is ``<= p``, never above the brute-force optimum of the allocation)."""
    p = replace(problem, memory_model="strict") if strict else problem
    units = make_units(p)
    checked = 0
    for gpu, period in solved_allocations(p):
        used = sorted(set(gpu))
        for size in range(1, len(used)):
            for kept in itertools.combinations(used, size):
                relaxed, alloc = isolate_units(units, gpu, kept)
                assert_relaxes(replace(p, n_gpus=max(alloc) + 1), relaxed, alloc, period)
                checked += 1
    assert checked or all(len(set(g)) == 1 for g, _ in solved_allocations(p))


def test_isolate_units_frees_the_other_units():
    """Kept GPUs' units keep everything; the others hold nothing, each on a GPU of its own;
    cuts between two of them take no time and hold no buffers."""
    units = make_units(chain_with_subproblems())
    gpu = tuple([0, 1, 1, 0, 2][:units.n]) + (2,) * max(0, units.n - 5)
    relaxed, alloc = isolate_units(units, gpu, {1})
    inside = [g == 1 for g in gpu]
    assert alloc == first_use(alloc)
    assert len({alloc[q] for q in range(units.n) if inside[q]}) == 1
    assert len({alloc[q] for q in range(units.n) if not inside[q]}) == inside.count(False)
    for q in range(units.n):
        assert (relaxed.x[q], relaxed.w[q]) == ((units.x[q], units.w[q]) if inside[q]
                                                else (0, 0))
    for c in range(units.n - 1):
        kept = inside[c] or inside[c + 1]
        assert relaxed.dt[c] == (units.dt[c] if kept else 0.0)
        assert relaxed.buf[c] == (units.buf[c] if kept else 0)
    assert (relaxed.f, relaxed.b) == (units.f, units.b)
    with pytest.raises(ValueError, match="allocation of"):
        isolate_units(units, gpu[:-1], {1})


# ------------------------------------------------------------------ delayed tails
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_delayed_tails_relax_every_allocation(problem, strict):
    """``delay_tail`` is a relaxation no weaker than ``trim_units``: for every allocation
    with an optimal plan of period ``p`` and every head of it (units ``0 .. k - 1``, the
    later units pure delays), the relaxed instance has a plan at ``p``; and its optimum is
    at least the trimmed instance's (dropping its delays leaves a plan of the trimmed
    one)."""
    p = replace(problem, memory_model="strict") if strict else problem
    units = make_units(p)
    opts = replace(OPTS, warm_start=False)
    checked = 0
    for gpu, period in solved_allocations(p):
        for k in range(1, units.n + 1):
            relaxed, alloc = delay_tail(units, gpu[:k])
            wider = replace(p, n_gpus=max(alloc) + 1)
            assert_relaxes(wider, relaxed, alloc, period)
            if k < units.n:
                delayed = run_model(wider, "cpsat", opts, units=relaxed, gpu=list(alloc))
                trimmed = run_model(p, "cpsat", opts, units=trim_units(units, 0, units.n - k),
                                    gpu=list(gpu[:k]))
                assert delayed.plan is not None and trimmed.plan is not None
                assert delayed.plan.period >= trimmed.plan.period * (1 - 1e-6)
            checked += 1
    assert checked or not solved_allocations(p)


def test_delay_tail_keeps_the_head_and_delays_the_rest():
    """The head's units and the cuts inside it keep everything, the head's last unit sends
    nothing; the later units keep their durations, hold nothing and sit alone on GPUs of
    their own; the cuts from the head's last unit on take no time and hold no buffers."""
    units = make_units(chain_with_subproblems())
    head = (0, 1, 1)[:units.n - 1]
    k = len(head)
    relaxed, alloc = delay_tail(units, head)
    assert alloc[:k] == first_use(head) and alloc == first_use(alloc)
    assert len(set(alloc[k:])) == units.n - k and not set(alloc[k:]) & set(alloc[:k])
    assert (relaxed.f, relaxed.b) == (units.f, units.b)
    for q in range(units.n):
        inside = q < k
        assert (relaxed.x[q], relaxed.w[q], relaxed.a_in[q]) == (
            (units.x[q], units.w[q], units.a_in[q]) if inside else (0, 0, 0))
        assert relaxed.a_out[q] == (units.a_out[q] if q < k - 1 else 0)
    for c in range(units.n - 1):
        assert (relaxed.dt[c], relaxed.buf[c]) == (
            (units.dt[c], units.buf[c]) if c < k - 1 else (0.0, 0))
    with pytest.raises(ValueError, match="head of 0 units"):
        delay_tail(units, ())


ISOLATING = replace(OPTS, extra={"isolate": True})


def covered(units_n: int, head: int, tail: int, sets, gpu) -> bool:
    """Whether ``gpu`` has GPUs holding exactly ``sets`` among units ``head..n-tail-1``."""
    inside = range(head, units_n - tail)
    return all(len({gpu[q] for q in group}) == 1
               and {q for q in inside if gpu[q] == gpu[group[0]]} == set(group)
               for group in sets) and len({gpu[g[0]] for g in sets}) == len(sets)


def test_gpu_set_nogoods_hold_for_every_allocation_they_cover():
    """With ``isolate``, the loop proves the full model's optimum, and every GPU-set
    no-good's bound is at most the optimum of every allocation it covers (brute force)."""
    problem = trimming_chain()
    units = make_units(problem)
    out = cold_equals_brute_force(problem, ISOLATING)
    assert out is not None and out.report["benders_gpu_sets"] == len(out.sets)
    checked, solved = 0, solved_allocations(problem)
    for (head, tail, sets), bound in out.sets.items():
        for gpu, period in solved:
            if covered(units.n, head, tail, sets, gpu):
                assert bound <= period + 1e-9
                checked += 1
    assert out.sets and checked, out.report


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_decomposition_with_gpu_sets_equals_brute_force(problem, strict):
    """The loop with ``isolate`` ends at the brute-force optimum (both memory models)."""
    p = replace(problem, memory_model="strict") if strict else problem
    cold_equals_brute_force(p, ISOLATING)


@pytest.mark.parametrize("value", ["yes", 1])
def test_bad_isolate_is_an_input_error(value):
    problem = chain_with_subproblems()
    with pytest.raises(OptmemInputError, match="isolate"):
        solve(problem, "cpsat", options=replace(OPTS, extra={**BENDERS, "isolate": value}))
