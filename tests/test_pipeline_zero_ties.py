"""Pipeline exact models on chains with tasks of zero duration (ties at one instant).

Under ``stash`` the model's units are the layers (``model_bounds``): the largest memory
row at an instant counts what the simulator counts there, so ``ilp`` and ``cpsat`` prove
the problem's optimum on chains with zero forward (and backward) times (the orders of
tied zero-length tasks transitive; last layers without any time joined to the last one
with time). Under ``strict``
each task's row has its own terms: the rows of a zero-length task count what the
simulator counts at its start (stop 78, ``tie_vars``), and since stop 80 every layer is a
unit there too (joins for zero-length forwards: ``tests/test_pipeline_zero_forward.py``);
before, layers without forward time joined their predecessor (``zero_forward_merged``,
still the units with ``STRICT_LAYERS = False``).
"""

from __future__ import annotations

import math
import random
import types
from collections.abc import Iterator

import pytest

from optmem import PipelineProblem, SolveOptions, solve
from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.models import pipeline as pipeline_model
from optmem.models.pipeline import make_units, model_bounds, separation, zero_forward_merged
from optmem.pipeline_plan import PipelinePlan, minimal_shifts
from optmem.result import Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.simulate.verify import verify_plan
from optmem.solvers import pipeline as solvers_pipeline
from optmem.solvers.pipeline import stash_relaxation
from optmem.solvers.pipeline_common import build_model
from tests.pipeline_helpers import assert_model_agrees_with_simulator
from tests.test_pipeline_benders import brute_force

pytest.importorskip("ortools", reason="the exact models use OR-Tools CP-SAT")
pytest.importorskip("pulp", reason="method ilp uses PuLP")

ONE = SolveOptions(threads=1, warm_start=False)
RELAXED = {"warm_madpipe": False, "stash_relaxation": True}  # the stash relaxation asked


def sized_chain(rng: random.Random, fwd: list[float], bwd: list[float]) -> Chain:
    """A chain with these times and random small sizes (outputs, tapes, overheads, weights)."""
    n = len(fwd)
    out = [rng.randint(1, 6) for _ in range(n)]
    return Chain.from_lists(fwd, bwd, out, [o + rng.randint(0, 6) for o in out],
                            input_size=rng.randint(1, 6),
                            fwd_overhead=[rng.randint(0, 3) for _ in range(n)],
                            bwd_overhead=[rng.randint(0, 3) for _ in range(n)],
                            weight_size=[rng.randint(0, 6) for _ in range(n)])


def zero_time_instance(seed: int) -> PipelineProblem:
    """A seeded ``stash`` chain of 2-4 layers, some with zero forward or backward time."""
    rng = random.Random(seed)
    n = rng.choice([2, 3, 3, 4])
    fwd = [float(rng.choice([0, 0, 1, 2, 3])) for _ in range(n)]
    bwd = [float(rng.choice([0, 0, 1, 2, 4])) for _ in range(n)]
    if 0.0 not in fwd:
        fwd[rng.randrange(n)] = 0.0
    bwd[-1] = float(rng.choice([1, 2, 4]))  # no last layers without time (merged: below)
    chain = sized_chain(rng, fwd, bwd)
    gpus = rng.choice([2, 2, 3])
    bandwidth = rng.choice([None, 1.0, 2.0])
    kw = {} if bandwidth is None else {"chain_bandwidth": bandwidth}
    least = PipelineProblem(chain, gpus, 10**6, **kw).memory_lower_bound()
    memory = int(least * rng.choice([1.0, 1.2, 1.5, 2.0, 3.0])) + rng.randint(0, 5)
    return PipelineProblem(chain, gpus, memory, **kw)


# seeds whose instances the three runs below solve to optimality in a few seconds at most
SEEDS = [1, 2, 4, 6, 7, 10, 11, 12, 13, 18, 19, 20, 21, 22, 23, 26, 28, 29, 30, 33]


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_methods_prove_the_optimum_with_zero_time_tasks(seed: int) -> None:
    problem = zero_time_instance(seed)
    assert len(model_bounds(problem)) == problem.layers.n  # one unit per layer
    assert 0.0 in problem.chain.fwd_time
    runs = {"ilp": solve(problem, "ilp", options=ONE.with_(extra={"warm_madpipe": False})),
            "cpsat": solve(problem, "cpsat", options=ONE.with_(extra={"warm_madpipe": False})),
            "plain": solve(problem, "ilp", options=ONE.with_(  # no relaxation bound
                extra={"warm_madpipe": False, "relaxation": False}))}
    for res in runs.values():
        assert res.status is Status.OPTIMAL and "merged_units" not in res.report
        replay = verify_plan(problem, res)  # within memory, else PlanError
        assert replay["objective"] == pytest.approx(res.objective)
    optimum = runs["ilp"].objective
    assert runs["cpsat"].objective == pytest.approx(optimum, rel=1e-6)
    assert runs["plain"].objective == pytest.approx(optimum, rel=1e-6)
    heuristic = solve(problem, "madpipe", options=SolveOptions(threads=1))
    if heuristic.status.has_plan:
        assert heuristic.objective >= optimum * (1 - 1e-6)


def test_ties_of_zero_length_tasks_are_ordered_transitively() -> None:
    """Forwards and backwards of layers 1-3 (no forward time) start at one instant.

    Without the ``tie_*`` rows their pairwise orders could be cyclic, each row missing a
    stash there: both methods decoded a period-11 plan that replays at 46 > 43 and
    answered ``no_solution`` ("rejected by the simulator"); MadPipe replays 12.
    """
    chain = Chain.from_lists([0.0, 0.0, 0.0, 2.0], [1.0, 0.0, 0.0, 1.0], [2, 3, 4, 5],
                             [4, 5, 5, 8], input_size=1, fwd_overhead=[2, 1, 2, 3],
                             bwd_overhead=[2, 0, 1, 3], weight_size=[1, 3, 4, 5])
    problem = PipelineProblem(chain, 2, 43, chain_bandwidth=1.0)
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=ONE.with_(extra={"warm_madpipe": False}))
        assert res.status is Status.OPTIMAL and res.objective == pytest.approx(12.0)
        assert verify_plan(problem, res)["objective"] == pytest.approx(12.0)


def test_last_layers_without_time_join_the_last_one_with_time() -> None:
    """A stash that may live no time (forward and backward at one instant) stays merged.

    The simulator counts it at its forward's start while that row may miss a forward
    starting then (a hunt: plans decoded at 24 replayed at 32), so layer 2 (no time at
    all) joins layer 1 and the proof covers that class: ``feasible``, ``merged_units``.
    """
    chain = Chain.from_lists([2.0, 0.0], [0.0, 0.0], [5, 3], [11, 7], input_size=2,
                             fwd_overhead=[3, 1], bwd_overhead=[3, 1], weight_size=[1, 3])
    problem = PipelineProblem(chain, 3, 24, chain_bandwidth=2.0)
    assert model_bounds(problem) == [(1, 2)]
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=ONE.with_(extra={"warm_madpipe": False}))
        assert "merged_units" in res.report
        if res.status.has_plan:
            assert res.status is Status.FEASIBLE
            assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)


# a hunt's plan: layer 1 has no forward or backward time; F 1, B 1 and F 2 start at 0
STRICT_TIE = Chain.from_lists([0.0, 3.0, 1.0], [0.0, 1.0, 5.0], [3, 1, 3], [9, 1, 4],
                              input_size=6, fwd_overhead=[3, 2, 3], bwd_overhead=[1, 2, 2],
                              weight_size=[0, 0, 0])
STRICT_TIE_PLAN = ("period 10", "stage 1 layers 1-1 gpu 0", "stage 2 layers 2-2 gpu 0",
                   "stage 3 layers 3-3 gpu 0", "B 1 start 0 shift 0", "F 1 start 0 shift 1",
                   "B 2 start 9 shift 1", "F 2 start 0 shift 1", "B 3 start 4 shift 1",
                   "F 3 start 3 shift 1")


def test_strict_rows_of_one_layer_units_count_a_tied_stash() -> None:
    """The hunt's plan: one unit per layer, ``B 1``'s row now counts ``F 2``'s stash.

    Before stop 78 the rows accepted the plan at 21 (``B 1`` ordered before ``F 2``, its
    row without that stash); the tie indicators (``tie_vars``) count it as the simulator
    does, so the rows need what it replays at (36).
    """
    plan = PipelinePlan.from_strings(list(STRICT_TIE_PLAN))
    layers = [(q, q) for q in (1, 2, 3)]
    for memory, fits in ((21, False), (35, False), (36, True)):
        problem = PipelineProblem(STRICT_TIE, 3, memory, memory_model="strict")
        sim = simulate_pipeline(problem, plan)
        # B 1 at 0; 36 since stop 76, when the simulator counts a backward's own stash at
        # its start also when it takes no time (24 before)
        assert sim.peak_memory == 36 and sim.task_memory[("B", 1, 3)] == 36
        form = build_model(problem, units=make_units(problem, layers))
        values = form.encode(plan)
        assert values is not None
        assert form.model.violated(values) == ([] if fits else ["mem_B0"])
    assert zero_forward_merged(problem) == [(1, 2), (3, 3)]  # the units until stop 80
    assert model_bounds(problem) == layers  # since stop 80: the plan is one of the model's
    assert build_model(problem).model.violated(build_model(problem).encode(plan)) == []


# stop 78's chain: B 1 (no backward time) and F 2 may start at one instant
ZERO_BACKWARD = Chain.from_lists([2.0, 2.0], [0.0, 5.0], [6, 5], [9, 6], input_size=1,
                                 fwd_overhead=[0, 2], bwd_overhead=[1, 1], weight_size=[0, 3])
ZERO_BACKWARD_PLAN = ("period 9", "stage 1 layers 1-1 gpu 0", "stage 2 layers 2-2 gpu 0",
                      "B 1 start 0 shift 0", "F 1 start 7 shift 2", "B 2 start 2 shift 1",
                      "F 2 start 0 shift 1")


def test_strict_rows_count_a_stash_tied_with_a_zero_length_backward() -> None:
    """``B 1`` (no backward time) and ``F 2`` start at 0: ``B 1``'s row counts ``F 2``'s stash.

    The order binaries put ``B 1``'s row first; until stop 78 it missed the stash ``F 2``
    starts, which the simulator counts there: the rows accepted the plan at 31, it replays
    at 36, and ``ilp`` answered ``no_solution`` (its plan "rejected by the simulator")
    where ``cpsat`` and MadPipe found 9. The tie indicators count it (``near``), so the
    rows need 36, and both methods prove 9.
    """
    plan = PipelinePlan.from_strings(list(ZERO_BACKWARD_PLAN))
    for memory in (31, 35, 36):
        problem = PipelineProblem(ZERO_BACKWARD, 2, memory, memory_model="strict")
        sim = simulate_pipeline(problem, plan)
        assert sim.peak_memory == 36 and sim.task_memory[("B", 1, 3)] == 36
        assert model_bounds(problem) == [(1, 1), (2, 2)]  # no zero forward: nothing merged
        form = build_model(problem)
        values = form.encode(plan)
        assert values is not None
        assert form.model.violated(values) == ([] if memory >= 36 else ["mem_B0"])
    problem = PipelineProblem(ZERO_BACKWARD, 2, 31, memory_model="strict")
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=ONE.with_(extra={"warm_madpipe": False}))
        assert res.objective == pytest.approx(9.0)
        assert_tie_proof(res)
        assert "engine_plan" not in res.report  # the engine's own plan replays
        replay = verify_plan(problem, res)  # within memory, else PlanError
        assert replay["objective"] == pytest.approx(9.0) and replay["peak_memory"] <= 31


def strict_zero_instance(seed: int, zero_forward: bool = False) -> PipelineProblem:
    """A seeded ``strict`` chain of 2-3 layers with zero backward (and forward) times."""
    rng = random.Random(seed)
    n = rng.choice([2, 2, 3])
    fwd = [float(rng.choice([0, 1, 2, 3] if zero_forward else [1, 2, 3])) for _ in range(n)]
    bwd = [float(rng.choice([0, 0, 1, 2, 4])) for _ in range(n)]
    if 0.0 not in bwd:
        bwd[rng.randrange(n)] = 0.0
    if sum(fwd) + sum(bwd) == 0:
        fwd[0] = 1.0
    chain = sized_chain(rng, fwd, bwd)
    gpus = rng.choice([1, 2, 2, 3])
    bandwidth = rng.choice([None, None, 2.0])
    kw = {} if bandwidth is None else {"chain_bandwidth": bandwidth}
    least = PipelineProblem(chain, gpus, 10**6, memory_model="strict",
                            **kw).memory_lower_bound()
    memory = int(least * rng.choice([1.0, 1.1, 1.3, 1.6, 2.0])) + rng.randint(0, 4)
    return PipelineProblem(chain, gpus, memory, memory_model="strict", **kw)


# seeds of strict_zero_instance: zero backward times (each solved in well under a second)
STRICT_SEEDS = [0, 2, 3, 5, 6, 7, 11, 13, 15, 18, 20, 22, 24, 25, 41, 58, 66, 70]
# with zero forward times too (their layers merged: zero_forward_merged)
STRICT_FORWARD_SEEDS = [1, 4, 8, 10, 12]


@pytest.mark.parametrize("seed, zero_forward", [(s, False) for s in STRICT_SEEDS]
                         + [(s, True) for s in STRICT_FORWARD_SEEDS])
def test_strict_exact_methods_equal_brute_force_with_zero_time_tasks(seed: int,
                                                                     zero_forward: bool):
    """``ilp`` and ``cpsat`` find the best over every allocation (brute force: each fixed
    allocation's model, CP-SAT), their plans replay within memory, and no heuristic plan
    beats them (stop 78: before, ``ilp`` answered ``no_solution`` on 6 of 40 such chains,
    its plan above the memory in the simulator). Since stop 79 the tie-relaxed model's
    bound proves them ``optimal`` (``feasible`` at stop 78 on 7 of these seeds: 0, 2, 3,
    6, 20, 22, 58), except on seed 24, whose infimum no plan attains (test below)."""
    problem = strict_zero_instance(seed, zero_forward)
    assert 0.0 in problem.chain.bwd_time
    merged = len(model_bounds(problem)) < problem.layers.n
    expected = brute_force(problem)
    heuristics = [solve(problem, m, options=SolveOptions(threads=1))
                  for m in ("contiguous", "madpipe")]
    best_plan = min((h.objective for h in heuristics if h.status.has_plan), default=math.inf)
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=ONE.with_(extra=RELAXED))
        assert ("merged_units" in res.report) is merged
        if math.isinf(expected):
            assert not res.status.has_plan
            assert res.status in (Status.NO_SOLUTION, Status.INFEASIBLE)
            if res.status is Status.INFEASIBLE:  # merged: proven by the stash relaxation
                assert math.isinf(best_plan)
            continue
        if merged:  # the bound is the stash relaxation's (stop 79, zero forwards)
            assert "stash_relaxation" in res.report
            assert res.bound <= best_plan + 1e-9
            if res.status is Status.OPTIMAL:
                assert best_plan >= res.objective * (1 - 1e-6)
        else:
            assert_tie_proof(res)
            assert res.status is (Status.FEASIBLE if seed == 24 else Status.OPTIMAL)
        assert res.objective == pytest.approx(expected, abs=1e-5)
        assert res.bound <= expected + 1e-9
        replay = verify_plan(problem, res)  # within memory, else PlanError
        assert replay["objective"] == pytest.approx(res.objective)
        if not merged:
            assert best_plan >= res.objective * (1 - 1e-6)


def assert_tie_proof(res) -> None:
    """The models' optimum under ``strict`` ties, reported soundly (``tie_separated``).

    Starts closer than the separation after a zero-length task count as tied in the
    models, so their optimum is proven for the problem only up to it: the bound is the
    tie-relaxed model's (stop 79), ``optimal`` where it meets the plan, else ``feasible``
    with ``report["tie_separation"]`` and a bound at least the plan less the separation."""
    if res.status is Status.OPTIMAL:
        return
    assert res.status is Status.FEASIBLE and "tie_separation" in res.report
    assert "tie_relaxation" in res.report
    assert res.objective - separation(res.objective) - 1e-5 <= res.bound < res.objective


def test_a_strict_optimum_above_the_infimum_is_not_called_optimal():
    """Seed 24 (stop 78): the models' best plan replays at 4.000305, but plans reach
    4 + any epsilon (a zero-length task just before another start, closer than the
    models' separation). ``optimal`` 4.000305 would be a wrong proof: the answer is
    ``feasible`` with a bound at most 4, the problem's infimum. The tie-relaxed model
    (stop 79) proves 4 itself: its bound is the infimum, not a separation below it."""
    problem = strict_zero_instance(24, False)
    for method in ("ilp", "cpsat"):
        res = solve(problem, method, options=ONE.with_(extra={"warm_madpipe": False}))
        assert res.objective == pytest.approx(4.000305, abs=1e-5)
        assert res.status is Status.FEASIBLE and res.bound <= 4.0 + 1e-9
        assert res.bound == pytest.approx(4.0, abs=1e-6)
        assert "tie_separation" in res.report


def test_cpsat_bounds_a_chain_without_backward_time_from_the_tie_relaxed_model():
    """Stop 78's slow chain (3 layers, every backward without time, 3 GPUs): ``cpsat``
    had no bound above 7.5 after 5 deterministic s (its search on the rows ``neara``),
    where ``ilp`` proves the models' 11.00073 at once. Since stop 79 the tie-relaxed model
    (no rows ``neara``; CP-SAT proves 11 in a few milliseconds) bounds the problem first and
    the full model starts from it: both answer 11.00073 with the bound 11, the infimum
    (``feasible``: the plans at 11 need a start closer than the separation)."""
    problem = strict_zero_instance(24, True)
    assert set(problem.chain.bwd_time) == {0.0} and problem.n_gpus == 3
    for method in ("cpsat", "ilp"):
        res = solve(problem, method, options=ONE.with_(deterministic_time=0.5,
                                                      extra={"warm_madpipe": False}))
        assert res.objective == pytest.approx(11.000733, abs=1e-5)
        assert res.bound == pytest.approx(11.0, abs=1e-5)
        assert res.report["tie_relaxation"]["engine_status"] == "optimal"
        assert_tie_proof(res)
        assert res.status is Status.FEASIBLE
        assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)


def random_plan(rng: random.Random, problem: PipelineProblem) -> PipelinePlan:
    """A random pattern: stages of 1-3 layers on 2 GPUs, integer starts, zero-time transfers."""
    lay, n = problem.layers, problem.layers.n
    cuts = [q for q in range(1, n) if rng.random() < 0.6]
    bounds = list(zip([1] + [c + 1 for c in cuts], [*cuts, n], strict=True))
    gpus = [rng.choice([0, 0, 1]) for _ in bounds]
    period = rng.randint(2, max(2, int(lay.fwd(1, n) + lay.bwd(1, n))))  # at most the model's
    lines = [f"period {period}"]
    labels: dict[int, int] = {}
    for k, (i, j) in enumerate(bounds):
        gpu = labels.setdefault(gpus[k], len(labels))
        lines.append(f"stage {k + 1} layers {i}-{j} gpu {gpu}")
    starts = {}
    for k in range(1, len(bounds) + 1):
        starts[("F", k)] = rng.randrange(period)
        starts[("B", k)] = rng.randrange(period)
    for k in range(1, len(bounds)):
        if gpus[k - 1] != gpus[k]:
            i, j = bounds[k - 1]
            starts[("send", k)] = (starts[("F", k)] + lay.fwd(i, j)) % period
            starts[("grad", k)] = (starts[("B", k + 1)] + lay.bwd(*bounds[k])) % period
    # shifts: the smallest along the path (PipelinePlan.from_strings needs them)
    durs = {("F", k): lay.fwd(i, j) for k, (i, j) in enumerate(bounds, start=1)}
    durs.update({("B", k): lay.bwd(i, j) for k, (i, j) in enumerate(bounds, start=1)})
    durs.update({key: 0.0 for key in starts if key[0] in ("send", "grad")})
    shifts = minimal_shifts({k: float(v) for k, v in starts.items()}, durs, len(bounds),
                            float(period))
    lines += [f"{op} {k} start {v} shift {shifts[(op, k)]}" for (op, k), v in starts.items()]
    return PipelinePlan.from_strings(lines)


@pytest.mark.parametrize("seed", range(12))
def test_strict_rows_hold_iff_the_simulator_fits_with_zero_time_tasks(seed: int) -> None:
    """Random plans (stages of one or more layers, zero backward times): encoded
    in the model, the rows hold at the simulator's peak and a memory row fails one below it.

    The rows of a task count, at a tie of zero-length tasks, what the simulator counts
    (``tie_vars``), and a stage whose last backward takes no time is checked where it
    starts (``stage_joins``). Before stop 78, 48 of 254 such plans (single-layer stages)
    fitted the rows one below their peak.
    """
    rng = random.Random(seed)
    n = rng.choice([2, 3])
    chain = Chain.from_lists([float(rng.choice([1, 2])) for _ in range(n)],
                             [float(rng.choice([0, 0, 1, 2])) for _ in range(n)],
                             out := [rng.randint(1, 6) for _ in range(n)],
                             [o + rng.randint(0, 6) for o in out], input_size=rng.randint(1, 6),
                             fwd_overhead=[rng.randint(0, 3) for _ in range(n)],
                             bwd_overhead=[rng.randint(0, 3) for _ in range(n)],
                             weight_size=[rng.randint(0, 6) for _ in range(n)])
    base = PipelineProblem(chain, 2, 10**6, memory_model="strict")
    checked = 0
    for memory, _peak, plan in plans_at_their_peak(rng, base, 80):
        problem = PipelineProblem(chain, 2, memory, memory_model="strict")
        form = build_model(problem)
        if form.encode(plan) is not None:
            assert_model_agrees_with_simulator(form, problem, plan)
            checked += 1
    assert checked >= 2


def plans_at_their_peak(rng: random.Random, base: PipelineProblem, tries: int
                        ) -> Iterator[tuple[int, int, PipelinePlan]]:
    """``(memory, peak, plan)``: ``tries`` random plans of ``base`` that replay, each at its
    simulated peak and one below it."""
    for _ in range(tries):
        plan = random_plan(rng, base)
        try:
            peak = simulate_pipeline(base, plan).peak_memory
        except PlanError:
            continue
        for memory in (peak, peak - 1):
            yield memory, peak, plan


def nudged_plan(rng: random.Random, plan: PipelinePlan, lay) -> PipelinePlan:
    """``plan`` with some forwards that start with a zero-length backward moved 1e-4 later:
    closer than the tie separation, farther than the simulator's tolerance (not tied)."""
    bounds = [(st.first, st.last) for st in plan.stages]
    zero = {t.start for t in plan.tasks if t.op == "B" and lay.bwd(*bounds[t.stage - 1]) == 0}
    lines = []
    for line in plan.to_strings():
        words = line.split()
        if words[0] == "F" and float(words[3]) in zero and rng.random() < 0.7:
            words[3] = repr(float(words[3]) + 1e-4)
        lines.append(" ".join(words))
    return PipelinePlan.from_strings(lines)


def test_tie_relaxed_rows_hold_iff_the_simulator_fits_closer_than_the_separation() -> None:
    """Random plans with a forward 1e-4 after a zero-length backward (not tied for the
    simulator, closer than the separation): the tie-relaxed model's rows (stop 79, no rows
    ``neara``; the bound of ``solvers.pipeline.tie_relaxed_bound``) hold at the simulator's
    peak and fail one below it, so every such plan is one of its solutions at its period,
    where the models' rows count the forward as tied and reject some of them at their peak
    (the separation's over-count that kept stop 78's answers ``feasible``)."""
    checked = over = 0
    for seed in range(6):
        rng = random.Random(seed)
        n = rng.choice([2, 3])
        out = [rng.randint(1, 6) for _ in range(n)]
        chain = Chain.from_lists([float(rng.choice([1, 2])) for _ in range(n)],
                                 [float(rng.choice([0, 0, 1, 2])) for _ in range(n)],
                                 out, [o + rng.randint(0, 6) for o in out],
                                 input_size=rng.randint(1, 6),
                                 fwd_overhead=[rng.randint(0, 3) for _ in range(n)],
                                 bwd_overhead=[rng.randint(0, 3) for _ in range(n)],
                                 weight_size=[rng.randint(0, 6) for _ in range(n)])
        base = PipelineProblem(chain, 2, 10**6, memory_model="strict")
        for _ in range(150):
            try:
                plan = nudged_plan(rng, random_plan(rng, base), base.layers)
                peak = simulate_pipeline(base, plan).peak_memory
            except PlanError:
                continue
            for memory in (peak, peak - 1):
                problem = PipelineProblem(chain, 2, memory, memory_model="strict")
                assert_model_agrees_with_simulator(build_model(problem, tie_relaxed=True),
                                                   problem, plan)
                checked += 1
                form = build_model(problem)
                values = form.encode(plan)
                over += memory == peak and values is not None \
                    and bool(form.model.violated(values))
    assert checked >= 100 and over >= 1


def test_the_stash_relaxation_never_checks_more_than_strict() -> None:
    """Random plans on chains with zero forward and backward times (stages of one to three
    layers, temporaries or not): replayed under :func:`stash_relaxation`, each has the
    period it has under ``strict`` and no GPU peak above its ``strict`` peak, so the
    relaxation's optimum bounds the ``strict`` problem's over every allocation (stop 79,
    zero forwards: the ``strict`` models keep such layers with their predecessor)."""
    checked = 0
    for seed in range(40):
        rng = random.Random(seed)
        n = rng.choice([2, 3, 4])
        fwd = [float(rng.choice([0, 0, 1, 2])) for _ in range(n)]
        bwd = [float(rng.choice([0, 0, 1, 2])) for _ in range(n)]
        fwd[-1] = 1.0
        chain = sized_chain(rng, fwd, bwd)
        strict = PipelineProblem(chain, 2, 10**6, memory_model="strict",
                                 temporaries=rng.random() < 0.5)
        relaxed = stash_relaxation(strict)
        assert relaxed.memory_model == "stash"
        assert all(r <= s for r, s in zip(relaxed.layers.x, strict.layers.x, strict=True))
        for _ in range(25):
            plan = random_plan(rng, strict)
            try:
                sim = simulate_pipeline(strict, plan)
            except PlanError:
                continue
            low = simulate_pipeline(relaxed, plan)
            assert low.period == sim.period
            assert all(r <= s for r, s in zip(low.peaks, sim.peaks, strict=True))
            checked += 1
    assert checked >= 200


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_strict_answers_with_zero_forward_layers_are_proven_by_the_stash_relaxation(
        method: str, monkeypatch) -> None:
    """Seeds 1 and 19 (a layer without forward time, merged with its predecessor in the
    ``strict`` models until stop 80, ``STRICT_LAYERS = False`` here): before stop 79
    (zero forwards) every method answered ``feasible``
    with the load bound on seed 1 and ``no_solution`` on seed 19 (nothing of the merged
    class fits). The stash relaxation's optimum meets the merged class's plan on seed 1,
    so the answer is ``optimal``, equal to brute force over the merged class's
    allocations, and no heuristic plan (any allocation) beats it; on seed 19 it proves
    that no plan of any allocation fits: ``infeasible``. Since stop 80 the models prove
    both themselves (``test_pipeline_zero_forward.py``)."""
    monkeypatch.setattr(pipeline_model, "STRICT_LAYERS", False)
    problem = strict_zero_instance(1, True)
    assert len(model_bounds(problem)) < problem.layers.n
    default = solve(problem, method, options=ONE.with_(extra={"warm_madpipe": False}))
    assert "stash_relaxation" not in default.report  # asked only with the option
    res = solve(problem, method, options=ONE.with_(extra=RELAXED))
    assert res.status is Status.OPTIMAL
    assert "merged_units" in res.report and "stash_relaxation" in res.report
    assert res.objective == pytest.approx(brute_force(problem), abs=1e-5)
    assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)
    for heuristic in ("contiguous", "madpipe"):
        other = solve(problem, heuristic, options=SolveOptions(threads=1))
        if other.status.has_plan:
            assert other.objective >= res.objective * (1 - 1e-6)
    none = strict_zero_instance(19, True)
    assert len(model_bounds(none)) < none.layers.n
    assert none.memory_per_gpu >= none.memory_lower_bound()
    res = solve(none, method, options=ONE.with_(extra=RELAXED))
    assert res.status is Status.INFEASIBLE and "stash_relaxation" in res.report
    assert math.isinf(brute_force(none))
    for heuristic in ("contiguous", "madpipe"):
        assert not solve(none, heuristic, options=SolveOptions(threads=1)).status.has_plan


def test_the_stash_relaxation_keeps_to_what_is_left_of_the_time_limit(monkeypatch) -> None:
    """The relaxation is a second exact solve: it gets what the first left of
    ``time_limit_s`` (at first it ran with the whole limit again, doubling a limited solve),
    and none when nothing is left. A fake clock, so the verdict does not depend on time:
    each reading is 1 s after the last, and with a limit of 0.5 s nothing is left."""
    ticks = iter(range(10**6))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(solvers_pipeline, "time", clock)  # this module's clock only
    seen: list[float | None] = []

    def method(problem: PipelineProblem, options: SolveOptions):
        seen.append(options.time_limit_s)
        return solve(problem, "cpsat", options=ONE)

    options = ONE.with_(time_limit_s=0.5, extra={"stash_relaxation": True})
    run = solvers_pipeline.stash_relaxed(method, options)
    assert run is not None and run(strict_zero_instance(1, True)) is None and seen == []
    run = solvers_pipeline.stash_relaxed(method, options.with_(time_limit_s=100.0))
    assert run is not None and run(strict_zero_instance(1, True)) is not None
    assert seen == [99.0]
    assert solvers_pipeline.stash_relaxed(method, ONE) is None  # off by default
