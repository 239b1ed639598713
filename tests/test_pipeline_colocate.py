"""Co-location no-goods and the bound climb (``extra["colocate_step"]``).

:func:`optmem.solvers.pipeline_benders.climb_bound` refutes "these units share a GPU" with
the full model restricted to the allocations that co-locate them
(:func:`optmem.models.pipeline.build_pipeline_model`'s ``together``) and hands the master
the no-good. Checked here against brute force over every allocation of random chains: the
restricted model's optimum is the best over the co-locating allocations, every no-good's
bound is at most the optimum of every allocation it excludes, the climb never rises above
the optimum, and a climb whose refutations are over-stated (bounds doubled) does.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.errors import OptmemInputError
from optmem.models.pipeline import make_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers import pipeline_benders, pipeline_exact
from optmem.solvers import pipeline_lns as lns
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_benders import CLIMB_ORDERS, Benders, climb_bound
from optmem.solvers.pipeline_common import lower_bound, run_model
from tests.test_pipeline_benders import (
    OPTS,
    chain_with_subproblems,
    solved_allocations,
    trimmable_problems,
    trimming_chain,
)

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the climb's master needs OR-Tools")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

STEP = 0.1


def together(gpu, group) -> bool:
    """Whether allocation ``gpu`` puts every unit of ``group`` on one GPU."""
    return len({gpu[q] for q in group}) == 1


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_together_model_is_the_colocating_allocations(problem, strict):
    """The model with ``together=[S]`` has the optimum of the best allocation that puts S on
    one GPU (brute force over allocations), and no plan when none has one."""
    p = replace(problem, memory_model="strict") if strict else problem
    n = make_units(p).n
    solved = solved_allocations(p)
    opts = replace(OPTS, warm_start=False)
    for size in range(2, n + 1):
        for group in itertools.combinations(range(n), size):
            expected = min((period for gpu, period in solved if together(gpu, group)),
                           default=math.inf)
            run = run_model(p, "cpsat", opts, together=[group])
            assert run.status in (Status.OPTIMAL, Status.INFEASIBLE), run.report
            if math.isinf(expected):
                assert run.plan is None
            else:
                assert run.plan is not None and together(_unit_gpus(p, run.plan), group)
                assert run.plan.period == pytest.approx(expected, abs=1e-5)


def _unit_gpus(problem: PipelineProblem, plan) -> list[int]:
    """The GPU of each unit of ``problem`` in ``plan`` (its stages cover the layers)."""
    units = make_units(problem)
    gpu_of_layer = {}
    for stage in plan.stages:
        for layer in range(stage.first, stage.last + 1):
            gpu_of_layer[layer] = stage.gpu
    return [gpu_of_layer[i] for i, _ in units.bounds]


def cold_climb(problem: PipelineProblem, options: SolveOptions = OPTS, order: str = "ladder"):
    """The climb from the load bound with no plan (every probe up to the sequential period)."""
    units = make_units(problem)
    return climb_bound(problem, options, period=units.big_m() + 1.0, plan=None,
                       bound=lower_bound(problem), deadline=None, step=STEP, order=order)


@functools.cache
def solved_chain(make) -> list[tuple[list[int], float]]:
    """Brute force of a fixed chain (``make``: its constructor), computed once."""
    return solved_allocations(make())


def climb_is_valid(problem: PipelineProblem, *, cold: bool = True,
                   solved: list[tuple[list[int], float]] | None = None,
                   order: str = "ladder") -> bool:
    """Whether the climb's bound, and every no-good's, is at most the optimum of what it
    excludes (brute force), and every plan it met replays at its period.

    ``cold``: from no incumbent (probes up to the sequential period: a wrong no-good can
    lift the bound above the optimum); else from the optimum's period (probes up to just
    below it, and no plan ends the climb early: every rung is closed with no-goods).
    ``order``: ``extra["colocate_order"]``.
    """
    solved = solved_allocations(problem) if solved is None else solved
    best = min((period for _, period in solved), default=math.inf)
    if cold or math.isinf(best):
        out = cold_climb(problem, order=order)
    else:
        out = climb_bound(problem, OPTS, period=best, plan=None, bound=lower_bound(problem),
                          deadline=None, step=STEP, order=order)
    for period, plan in out.found:
        sim = simulate_pipeline(problem, plan)
        assert sim.period == pytest.approx(period)
        assert sim.peak_memory <= problem.memory_per_gpu
    if out.bound > best + 1e-9:
        return False
    return all(bound <= period + 1e-9 for group, bound in out.together.items()
               for gpu, period in solved if together(gpu, group))


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_climb_never_exceeds_the_optimum(problem, strict):
    """The climb's bound and each co-location no-good hold (both memory models)."""
    p = replace(problem, memory_model="strict") if strict else problem
    assert climb_is_valid(p, cold=False)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=trimmable_problems(), strict=st.booleans())
def test_bisected_climb_never_exceeds_the_optimum(problem, strict):
    """The same with ``colocate_order="bisect"`` (probes from just below the incumbent down,
    no-goods of high probes kept for the lower ones)."""
    p = replace(problem, memory_model="strict") if strict else problem
    assert climb_is_valid(p, cold=False, order="bisect")


@pytest.mark.parametrize("order", CLIMB_ORDERS)
@pytest.mark.parametrize("make", [trimming_chain, chain_with_subproblems])
def test_climb_is_valid_where_nogoods_are_made(make, order):
    """The same check on the chains used below, where the climb refutes co-locations."""
    assert climb_is_valid(make(), solved=solved_chain(make), order=order)
    assert climb_is_valid(make(), cold=False, solved=solved_chain(make), order=order)


def test_climb_proves_the_optimum_with_nogoods():
    """On a chain where the master admits allocations that only the full model refutes, the
    climb from the load bound reaches the optimum (23) with co-location no-goods."""
    problem = trimming_chain()
    units = make_units(problem)
    out = climb_bound(problem, OPTS, period=23.0, plan=None, bound=lower_bound(problem),
                      deadline=None, step=STEP)
    assert out.together, out.report
    assert 22.9 < out.bound <= 23.0
    assert out.report["colocate_nogoods"] == len(out.together)
    assert all(2 <= len(group) < units.n for group in out.together)
    for group, bound in out.together.items():  # each no-good against brute force
        assert all(bound <= period + 1e-9 for gpu, period in solved_chain(trimming_chain)
                   if together(gpu, group))


def test_bisected_climb_proves_the_optimum_in_fewer_probes():
    """``colocate_order="bisect"`` reaches the same bound as the ladder on the chain above
    with its no-goods (each checked by brute force), in fewer probes and master solves."""
    problem = trimming_chain()
    runs = {order: climb_bound(problem, OPTS, period=23.0, plan=None,
                               bound=lower_bound(problem), deadline=None, step=STEP,
                               order=order) for order in CLIMB_ORDERS}
    ladder, bisect = runs["ladder"], runs["bisect"]
    assert 22.9 < bisect.bound <= 23.0
    assert bisect.bound == pytest.approx(ladder.bound)
    assert bisect.together, bisect.report
    assert bisect.report["colocate_probes"] < ladder.report["colocate_probes"]
    assert bisect.report["colocate_masters"] < ladder.report["colocate_masters"]
    for group, bound in bisect.together.items():
        assert all(bound <= period + 1e-9 for gpu, period in solved_chain(trimming_chain)
                   if together(gpu, group))


def test_bisected_probes_stay_between_a_step_and_the_ceiling():
    """:meth:`Benders.next_probe`: the ladder's rung, or halfway to the ceiling but at least
    that rung; none once a probe less than a step above the bound was found open."""
    problem = trimming_chain()
    out = Benders(problem, "cpsat", OPTS, 23.0, None, 20.0, None)
    low, top = math.floor(20.0 * out.scale), out.top()
    rung = math.floor(20.0 * (1 + 0.01) * out.scale)
    assert out.next_probe(0.01, "ladder", top) == rung
    assert out.next_probe(0.01, "bisect", top) == (low + top) // 2 > rung
    assert out.next_probe(0.01, "bisect", rung + 2) == rung
    assert out.next_probe(0.01, "bisect", rung - 1) is None
    assert out.next_probe(0.5, "bisect", top) == out.next_probe(0.5, "ladder", top) == top
    out.bound = 23.0
    assert out.next_probe(0.01, "bisect", top) is None


@pytest.mark.parametrize("order", CLIMB_ORDERS)
def test_overstated_refutations_fail_the_check(monkeypatch, order):
    """A climb whose co-location refutations claim twice their bound rises above the
    optimum on one of these chains (cold or warm): the check above catches a wrong no-good."""
    real = pipeline_benders.Benders.colocated_bound

    def doubled(self, group, target, gpu=None):
        out = real(self, group, target, gpu)
        return 2 * out if isinstance(out, float) else out

    monkeypatch.setattr(pipeline_benders.Benders, "colocated_bound", doubled)
    assert not all(climb_is_valid(make(), cold=cold, solved=solved_chain(make), order=order)
                   for make in (trimming_chain, chain_with_subproblems)
                   for cold in (True, False))


def test_solve_with_the_climb_proves_the_same_optimum():
    """``extra["colocate_step"]`` keeps the optimum, reports the climb, replays the plan."""
    problem = trimming_chain()
    extra = {"warm_madpipe": False, "colocate_step": STEP}
    res = solve(problem, "cpsat", options=replace(OPTS, extra=extra))
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(23.0)
    assert res.bound <= 23.0 + 1e-9
    assert {"colocate_bound", "colocate_probes", "colocate_nogoods"} <= set(res.report)


def test_solve_with_the_bisected_climb_proves_the_same_optimum(monkeypatch):
    """``extra["colocate_order"]="bisect"`` reaches the climb and keeps the optimum."""
    orders: list[str] = []
    real = Benders.climb

    def spy(self, step, order="ladder"):
        orders.append(order)
        return real(self, step, order)

    monkeypatch.setattr(Benders, "climb", spy)
    problem = trimming_chain()
    extra = {"warm_madpipe": False, "colocate_step": STEP, "colocate_order": "bisect"}
    res = solve(problem, "cpsat", options=replace(OPTS, extra=extra))
    assert orders == ["bisect"] and res.report["colocate_probes"] >= 1
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(23.0)
    assert res.bound <= 23.0 + 1e-9
    sim = simulate_pipeline(problem, PipelinePlan.from_strings(res.plan))
    assert sim.period == pytest.approx(res.objective)
    assert sim.peak_memory <= problem.memory_per_gpu


@pytest.mark.parametrize("extra", [{"colocate_step": 0}, {"colocate_step": 1.5},
                                   {"colocate_step": True}, {"colocate_step": "x"},
                                   {"colocate_work": 0}, {"colocate_work": False},
                                   {"colocate_order": "spiral"}, {"colocate_order": 1},
                                   {"colocate_order": None}, {"colocate_beside": "yes"},
                                   {"colocate_beside": 1}])
def test_bad_colocate_options_are_input_errors(extra):
    with pytest.raises(OptmemInputError):
        solve(trimming_chain(), "cpsat", options=replace(OPTS, extra=extra))


@pytest.mark.parametrize("calls", [0, 1, 2, 3, 5, 8])
def test_deadline_passing_mid_climb_keeps_a_valid_bound(monkeypatch, calls):
    """A deadline that passes between any two engine calls (a scripted clock: ``left`` is
    positive for the first ``calls`` reads) stops the climb cleanly with a valid bound."""
    reads = iter(range(10_000))
    monkeypatch.setattr(pipeline_benders.Benders, "left",
                        lambda self: 1.0 if next(reads) < calls else -1.0)
    problem = trimming_chain()
    out = climb_bound(problem, OPTS, period=23.0, plan=None, bound=lower_bound(problem),
                      deadline=0.0, step=STEP)
    assert lower_bound(problem) <= out.bound <= 23.0
    assert out.report["colocate_stopped"] == "time limit"



BESIDE = SolveOptions(threads=2, seed=0, time_limit_s=3600.0,
                      extra={"warm_madpipe": False, "lns": 3})
"""The climb beside the search: a time limit (never reached here), two threads, a search."""
QUICK_BESIDE = BESIDE.with_(deterministic_time=2.0)
"""The same, the full model after the search stopped by CP-SAT's deterministic work (the
climb, whose bound would let it prove 23 at once, is stopped or off in these tests)."""


def spied_beside(monkeypatch) -> list[tuple[pipeline_exact.BesideSearch, tuple]]:
    """Each :class:`~optmem.solvers.pipeline_exact.BesideSearch` a solve starts, with the
    incumbent and the bound it started from."""
    made: list[tuple[pipeline_exact.BesideSearch, tuple]] = []
    real = pipeline_exact.BesideSearch.__init__

    def init(self, problem, options, best, bound, deadline, step, order):
        real(self, problem, options, best, bound, deadline, step, order)
        made.append((self, (best, bound, step, order)))

    monkeypatch.setattr(pipeline_exact.BesideSearch, "__init__", init)
    return made


def test_the_climb_beside_the_search_proves_what_it_proves_alone(monkeypatch):
    """Beside the search, the climb (one worker, deterministic work) reaches the bound and
    the no-goods the same climb reaches alone, when the search waits for it to end: the
    thread changes when it runs, not what it proves. The solve keeps the optimum, reports
    the climb, and its bound is at least the climb's."""
    made = spied_beside(monkeypatch)
    real = lns.improve

    def after_the_climb(*args, **kwargs):
        made[-1][0].thread.join()  # the climb ends on its own (its deadline is an hour away)
        return real(*args, **kwargs)

    monkeypatch.setattr(lns, "improve", after_the_climb)
    problem = trimming_chain()
    res = solve(problem, "cpsat", options=BESIDE)
    assert len(made) == 1
    beside, (best, bound, step, order) = made[0]
    assert not beside.thread.is_alive() and (step, order) == (pipeline_exact.BESIDE_STEP,
                                                                "ladder")
    climbed = beside.climber
    alone = climb_bound(problem, BESIDE.with_(threads=1), period=best[0], plan=best[1],
                        bound=bound, deadline=None, step=step)
    assert climbed.bound == alone.bound > bound
    assert climbed.together == alone.together and climbed.together
    assert res.report["colocate_beside"] is True
    assert res.report["colocate_bound"] == climbed.bound
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(23.0)
    assert climbed.bound <= res.bound <= 23.0 + 1e-9
    sim = simulate_pipeline(problem, PipelinePlan.from_strings(res.plan))
    assert sim.period == pytest.approx(res.objective)
    assert sim.peak_memory <= problem.memory_per_gpu


def test_the_climb_beside_the_search_stops_with_it(monkeypatch):
    """A climb that would never end on its own (it waits for its deadline) is stopped when
    the search returns: the solve ends, the thread is gone."""
    made = spied_beside(monkeypatch)

    def endless(self, step, order="ladder"):
        while not self.out_of_time():
            time.sleep(0.001)
        self.report["colocate_stopped"] = "time limit"

    monkeypatch.setattr(Benders, "climb", endless)
    res = solve(trimming_chain(), "cpsat", options=QUICK_BESIDE)
    assert len(made) == 1 and not made[0][0].thread.is_alive()
    assert res.report["colocate_beside"] is True
    assert res.report["colocate_stopped"] == "time limit"
    assert res.objective == pytest.approx(23.0) and res.bound <= 23.0 + 1e-9


def test_an_error_in_the_climb_reaches_the_solve(monkeypatch):
    """An exception on the climb's thread is raised by the solve, not lost with the thread."""
    def broken(self, step, order="ladder"):
        raise RuntimeError("climb broke")

    monkeypatch.setattr(Benders, "climb", broken)
    with pytest.raises(RuntimeError, match="climb broke"):
        solve(trimming_chain(), "cpsat", options=BESIDE)


def test_an_error_in_the_search_stops_the_climb(monkeypatch):
    """The search raising ends the climb too: no thread left running after the solve."""
    made = spied_beside(monkeypatch)

    def endless(self, step, order="ladder"):
        while not self.out_of_time():
            time.sleep(0.001)

    def broken(*args, **kwargs):
        raise RuntimeError("search broke")

    monkeypatch.setattr(Benders, "climb", endless)
    monkeypatch.setattr(lns, "improve", broken)
    with pytest.raises(RuntimeError, match="search broke"):
        solve(trimming_chain(), "cpsat", options=BESIDE)
    assert len(made) == 1 and not made[0][0].thread.is_alive()


@pytest.mark.parametrize("change", [{"threads": 1}, {"time_limit_s": None},
                                    {"extra": {**BESIDE.extra, "colocate_beside": False}},
                                    {"extra": {**BESIDE.extra, "lns": 0}}])
def test_no_climb_beside_without_a_limit_a_second_thread_or_a_search(monkeypatch, change):
    """Off without a time limit (a request for a proof stays deterministic), on one thread
    (no idle core), when turned off, and when no search runs."""
    made = spied_beside(monkeypatch)
    res = solve(trimming_chain(), "cpsat", options=replace(QUICK_BESIDE, **change))
    assert made == [] and "colocate_beside" not in res.report
    assert res.objective == pytest.approx(23.0) and res.bound <= 23.0 + 1e-9


def test_a_resumed_climb_keeps_what_it_refuted(monkeypatch):
    """``climb_bound(..., state=...)`` goes on from an earlier climb: stopped after its
    first probe and resumed, the climb reaches the bound and no-goods of one climb run
    through, with the same number of co-location refutations in all (none asked twice),
    and its report counts the probes of both parts."""
    problem = trimming_chain()
    whole = climb_bound(problem, OPTS, period=23.0, plan=None, bound=lower_bound(problem),
                        deadline=None, step=STEP)
    real = Benders.colocate_probe

    def one_probe(self, ticks):
        verdict = real(self, ticks)
        self.deadline = time.perf_counter() - 1.0  # the limit passes after the first probe
        return verdict

    monkeypatch.setattr(Benders, "colocate_probe", one_probe)
    first = climb_bound(problem, OPTS, period=23.0, plan=None, bound=lower_bound(problem),
                        deadline=time.perf_counter() + 3600.0, step=STEP)
    monkeypatch.setattr(Benders, "colocate_probe", real)
    assert first.report["colocate_probes"] == 1
    assert first.report["colocate_stopped"] == "time limit"
    assert first.bound < whole.bound
    done = first.colocate_solves
    resumed = climb_bound(problem, OPTS.with_(threads=2), period=23.0, plan=None,
                          bound=lower_bound(problem), deadline=None, step=STEP, state=first)
    assert resumed is first and resumed.options.threads == 2
    assert resumed.bound == whole.bound and resumed.together == whole.together
    assert resumed.colocate_solves == whole.colocate_solves > done
    assert resumed.report["colocate_probes"] == whole.report["colocate_probes"]
    assert "colocate_stopped" not in resumed.report or \
        resumed.report["colocate_stopped"] == whole.report.get("colocate_stopped")


def test_a_resumed_climb_takes_the_better_incumbent_and_the_higher_bound():
    """The state's incumbent and bound are replaced only by better ones, and a state of
    another problem is refused."""
    problem = trimming_chain()
    state = Benders(problem, "cpsat", OPTS, 30.0, None, 20.0, time.perf_counter() - 1.0)
    out = climb_bound(problem, OPTS, period=40.0, plan=None, bound=10.0,
                      deadline=time.perf_counter() - 1.0, step=STEP, state=state)
    assert (out.period, out.bound) == (30.0, 20.0)
    out = climb_bound(problem, OPTS, period=25.0, plan=None, bound=21.0,
                      deadline=time.perf_counter() - 1.0, step=STEP, state=state)
    assert (out.period, out.bound) == (25.0, 21.0)
    with pytest.raises(ValueError, match="another problem"):
        climb_bound(replace(problem), OPTS, period=25.0, plan=None, bound=21.0,
                    deadline=None, step=STEP, state=state)


def test_with_a_step_the_climb_after_the_search_goes_on_from_the_one_beside(monkeypatch):
    """With ``colocate_step`` set, the climb after the search is handed the state of the
    climb beside it (its no-goods kept), with the solve's threads; the solve still proves
    the optimum 23 and its plan replays."""
    made = spied_beside(monkeypatch)
    handed = []
    real_climb, real_bound = Benders.climb, pipeline_exact.climb_bound

    def beside_idle(self, step, order="ladder"):  # the beside climb is stopped at once
        if threading.current_thread().name == "optmem-colocate-climb":
            self.report["colocate_stopped"] = "time limit"
            return
        real_climb(self, step, order)

    def spy(*args, **kwargs):
        handed.append(kwargs.get("state"))
        return real_bound(*args, **kwargs)

    monkeypatch.setattr(Benders, "climb", beside_idle)
    monkeypatch.setattr(pipeline_exact, "climb_bound", spy)
    options = QUICK_BESIDE.with_(extra={**QUICK_BESIDE.extra, "colocate_step": STEP})
    res = solve(trimming_chain(), "cpsat", options=options)
    assert len(made) == 1 and not made[0][0].thread.is_alive()
    assert handed == [made[0][0].climber]
    assert handed[0].options.threads == 2
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(23.0)
    sim = simulate_pipeline(trimming_chain(), PipelinePlan.from_strings(res.plan))
    assert sim.period == pytest.approx(res.objective)


def test_the_climb_beside_the_search_charges_the_solve_s_work_budget(monkeypatch):
    """The climb's thread draws on the budget of the solve that started it: every CP-SAT
    call, on either thread, sees the solve's :class:`~optmem.engines.adapters.WorkBudget`
    (a thread does not inherit context variables; before ``carry_budget`` the climb's
    calls were outside every budget)."""
    from optmem.engines import adapters

    made = spied_beside(monkeypatch)
    real_improve, real_cpsat = lns.improve, adapters.solve_cpsat
    seen: list[tuple[str, object]] = []

    def after_the_climb(*args, **kwargs):
        made[-1][0].thread.join()
        return real_improve(*args, **kwargs)

    def spy(*args, **kwargs):
        seen.append((threading.current_thread().name, adapters.active_budget()))
        return real_cpsat(*args, **kwargs)

    monkeypatch.setattr(lns, "improve", after_the_climb)
    monkeypatch.setattr(adapters, "solve_cpsat", spy)
    res = solve(trimming_chain(), "cpsat", options=BESIDE.with_(work_budget=math.inf))
    assert len(made) == 1 and res.report["colocate_beside"] is True
    climb = [b for name, b in seen if name == "optmem-colocate-climb"]
    assert climb and all(b is not None for _, b in seen)
    assert len({id(b) for _, b in seen}) == 1  # one budget for the whole solve
    assert res.report["work_calls"] == len(seen)
