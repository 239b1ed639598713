"""The pipeline's large-neighbourhood search (:mod:`optmem.solvers.pipeline_lns`).

A move keeps the "same GPU" relation of the units it does not free
(``build_pipeline_model(..., same_gpu=...)``) and asks CP-SAT for a faster plan. Checked
here: the restricted model's optimum is the best over the allocations that keep the
relation (brute force over every allocation), the search never claims a plan the simulator
does not replay nor one faster than the proven optimum (hypothesis), it finds the optimum
that the contiguous and MadPipe incumbents miss on a fixed chain, a solve takes its plan,
engine failures are counted and survived, and bad option values are refused.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_helpers import timeless

from optmem.errors import OptmemInputError
from optmem.models.pipeline import make_units, plan_gpus
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers import pipeline_lns as lns
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_common import ModelRun, run_model
from optmem.solvers.pipeline_exact import incumbents
from tests.test_pipeline import thesis_chain
from tests.test_pipeline_benders import OPTS, solved_allocations, trimmable_problems

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the search's moves are CP-SAT runs")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

NO_LNS = SolveOptions(threads=1, seed=0, extra={"lns": 0})


def missed_chain() -> PipelineProblem:
    """Six layers on 3 GPUs: the contiguous and MadPipe plans take 13, the optimum is 12."""
    chain = thesis_chain([1, 3, 1, 4, 4, 4], [6, 4, 2, 1, 4, 1], [3, 3, 4, 0, 3, 2, 1, 0],
                         [2, 0, 1, 0, 0, 0])
    return PipelineProblem(chain, 3, 52)


def keeps(gpu, relation) -> bool:
    """Whether allocation ``gpu`` has the "same GPU" relation ``relation`` on its pairs."""
    return all((gpu[q] == gpu[r]) == same for (q, r), same in relation.items())


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), data=st.data())
def test_kept_relation_model_is_the_allocations_that_keep_it(problem, data):
    """The model with ``same_gpu`` fixed has the optimum of the best allocation with that
    relation (brute force over allocations), and no plan when none has one."""
    n = make_units(problem).n
    solved = solved_allocations(problem)
    opts = replace(OPTS, warm_start=False)
    pairs = list(itertools.combinations(range(n), 2))
    for _ in range(3):
        chosen = data.draw(st.lists(st.sampled_from(pairs), max_size=3, unique=True))
        relation = {pair: data.draw(st.booleans()) for pair in chosen}
        expected = min((period for gpu, period in solved if keeps(gpu, relation)),
                       default=math.inf)
        run = run_model(problem, "cpsat", opts, same_gpu=relation)
        assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
        if math.isinf(expected):
            assert run.plan is None
        else:
            assert run.plan is not None and keeps(plan_gpus(make_units(problem), run.plan),
                                                  relation)
            assert run.plan.period == pytest.approx(expected, abs=1e-5)


def test_kept_relation_is_the_allocation_outside_the_freed_units():
    gpu = (0, 0, 1, 2, 1)
    kept = lns.kept_relation(gpu, frozenset({1, 3}))
    assert kept == {(0, 2): False, (0, 4): False, (2, 4): True}
    assert lns.kept_relation(gpu, frozenset(range(5))) == {}


def test_neighbourhoods_are_units_of_the_chain():
    """Every kind is drawn: windows of 3-7 units, two GPUs' units, random handfuls."""
    import random

    rng = random.Random(0)
    gpu = (0, 0, 1, 1, 2, 2, 0, 3, 3, 1, 2)
    pairs = {frozenset(q for q in range(len(gpu)) if gpu[q] in pair)
             for pair in itertools.combinations(range(4), 2)}
    seen = set()
    for _ in range(60):
        free = lns.neighbourhood(rng, gpu)
        assert free and free <= set(range(len(gpu)))
        if free in pairs:
            seen.add("gpus")
        elif max(free) - min(free) + 1 == len(free):
            assert 3 <= len(free) <= 7
            seen.add("window")
        else:
            assert 3 <= len(free) <= 6
            seen.add("random")
    assert seen == {"gpus", "window", "random"}
    assert lns.neighbourhood(random.Random(1), (0, 1)) == {0, 1}


def test_the_search_finds_the_optimum_the_incumbents_miss():
    """From the 13 of the contiguous and MadPipe plans to the proven optimum 12."""
    problem = missed_chain()
    period, plan, _ = incumbents(problem, OPTS)[0]
    assert period == pytest.approx(13.0)
    full = solve(problem, "cpsat", options=NO_LNS)
    assert full.status is Status.OPTIMAL and full.objective == pytest.approx(12.0)
    found = lns.improve(problem, period, plan, moves=8, work=2.0, seed=0)
    assert found.improvements and found.period == pytest.approx(12.0)
    sim = simulate_pipeline(problem, found.plan)
    assert sim.period == pytest.approx(found.period)
    assert sim.peak_memory <= problem.memory_per_gpu
    again = lns.improve(problem, period, plan, moves=8, work=2.0, seed=0)
    assert again.improvements == found.improvements  # deterministic work limits, one worker


def test_a_solve_takes_the_search_plan():
    problem = missed_chain()
    out = solve(problem, "cpsat", options=SolveOptions(
        threads=1, seed=0, extra={"lns": 4, "relaxation": False}))
    assert out.status is Status.OPTIMAL and out.objective == pytest.approx(12.0)
    assert out.report["lns_moves"] >= 1 and out.report["lns_improvements"][-1] == 12.0
    assert out.report["incumbents"]["lns"] == pytest.approx(12.0)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), seed=st.integers(0, 5))
def test_the_search_never_beats_the_optimum_and_every_plan_replays(problem, seed):
    """Hypothesis: each improvement replays (simulator) within the memory, and the best is
    never below the proven optimum of the whole model."""
    starts = incumbents(problem, OPTS)
    if not starts:
        return
    period, plan, _ = starts[0]
    found = lns.improve(problem, period, plan, moves=3, work=1.0, seed=seed)
    optimum = solve(problem, "cpsat", options=NO_LNS)
    assert optimum.status is Status.OPTIMAL
    assert found.period >= optimum.objective - 1e-6
    assert found.period <= period
    sim = simulate_pipeline(problem, found.plan)
    assert sim.period == pytest.approx(found.period)
    assert sim.peak_memory <= problem.memory_per_gpu
    assert found.improvements == sorted(found.improvements, reverse=True)


def test_engine_failures_are_counted_and_survived(monkeypatch):
    problem = missed_chain()
    period, plan, _ = incumbents(problem, OPTS)[0]
    calls = []

    def failing(*args, **kwargs):
        calls.append(kwargs)
        return ModelRun(Status.ERROR, None, math.nan, {}, engine=SimpleNamespace(failed=True))

    monkeypatch.setattr(lns, "run_model", failing)
    found = lns.improve(problem, period, plan, moves=3, work=1.0)
    assert len(calls) == 3 and found.failed == 3 and not found.improvements
    assert found.period == period and found.plan is plan
    out = solve(problem, "cpsat", options=SolveOptions(threads=1, seed=0,
                                                       extra={"lns": 2, "relaxation": False}))
    assert out.status is Status.OPTIMAL and out.report["lns_failed"] == 2


def test_the_search_stops_at_a_deadline_and_at_the_bound():
    problem = missed_chain()
    period, plan, _ = incumbents(problem, OPTS)[0]
    late = lns.improve(problem, period, plan, moves=5, work=1.0,
                       deadline=time.perf_counter() - 1.0)
    assert late.moves == 0 and late.stopped == "time"
    met = lns.improve(problem, period, plan, moves=5, work=1.0, bound=period)
    assert met.moves == 0 and met.stopped == "bound met"


def test_defaults_and_bad_values():
    assert lns.settings(SolveOptions(), 21).moves == 0  # no limit: a proof is asked for
    assert lns.settings(SolveOptions(time_limit_s=60), 21).moves == lns.LNS_MOVES
    assert lns.settings(SolveOptions(time_limit_s=60), lns.LNS_MIN_UNITS - 1).moves == 0
    assert lns.settings(SolveOptions(extra={"lns": 3}), 4).moves == 3
    for bad in (-1, True, "3", 2.5):
        with pytest.raises(OptmemInputError, match="lns"):
            lns.settings(SolveOptions(extra={"lns": bad}), 21)
    for bad in (0, -1.0, "fast", False):
        with pytest.raises(OptmemInputError, match="lns_work"):
            lns.settings(SolveOptions(extra={"lns_work": bad}), 21)
    with pytest.raises(OptmemInputError, match="lns"):
        solve(missed_chain(), "cpsat", options=SolveOptions(extra={"lns": -2}))


def test_no_hidden_time_limit(monkeypatch):
    """Without ``time_limit_s`` every move runs to its deterministic work, no wall clock."""
    from optmem.engines import adapters as engines

    problem = missed_chain()
    period, plan, _ = incumbents(problem, OPTS)[0]
    seen = []
    real = engines.solve_cpsat

    def spy(*args, **kwargs):
        seen.append((kwargs.get("time_limit_s"), kwargs.get("deterministic_time")))
        return real(*args, **kwargs)

    monkeypatch.setattr(engines, "solve_cpsat", spy)
    found = lns.improve(problem, period, plan, moves=3, work=1.5)
    assert found.moves == 3 and seen == [(None, 1.5)] * 3


# ------------------------------------------------------------------ the solve's work budget
@pytest.mark.parametrize("extra", [{"strategy": "benders"}, {"lns": 4},
                                   {"probe_step": 0.02, "lns": 2}, {"colocate_step": 0.05}])
def test_a_work_budget_gives_the_same_result_twice_with_a_valid_bound(extra):
    """One budget of 0.003 deterministic seconds for every CP-SAT call of the solve (the
    relaxation's bisection, probes, Benders masters, LNS moves, the climb): the same JSON
    twice (timings aside), work within the budget plus the last call's overshoot, and a
    replayed plan whose bound is at most the optimum 12, proven without a budget."""
    problem = missed_chain()
    opts = SolveOptions(threads=1, seed=0, deterministic_time=5.0, extra=extra)
    first = solve(problem, "cpsat", options=opts.with_(work_budget=0.003))
    again = solve(problem, "cpsat", options=opts.with_(work_budget=0.003))
    assert timeless(first) == timeless(again)
    assert first.status in (Status.FEASIBLE, Status.OPTIMAL)
    assert first.bound <= 12.0 + 1e-9 and first.objective >= 12.0 - 1e-9
    assert first.plan  # replayed by the simulator on the one result path
    if first.status is Status.OPTIMAL:
        assert first.objective == pytest.approx(12.0)
    report = first.report
    assert report["work_exhausted"] is True and 0.003 <= report["work_used"] <= 0.0033
    assert report["work_calls"] >= 2


def test_a_spent_budget_skips_calls_and_never_claims_optimal():
    """With next to nothing left, the solve skips its later CP-SAT calls and returns the
    best incumbent (13 or 14 against the optimum 12) as ``feasible``, never an error."""
    problem = missed_chain()
    out = solve(problem, "cpsat", options=SolveOptions(
        threads=1, seed=0, work_budget=1e-4, extra={"strategy": "benders"}))
    assert out.status is Status.FEASIBLE and out.objective > 12.0
    assert out.bound <= 12.0 and out.report["work_skipped_calls"] >= 1
