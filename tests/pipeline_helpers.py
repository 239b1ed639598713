"""Pipeline test helpers: 1F1B* plans of an equal split, and the model-versus-simulator check.

Shared by ``test_pipeline_exact.py`` (the general model) and ``test_pipeline_fixed.py`` (the
slim fixed-allocation model): a plan encoded in a model violates nothing iff the simulator
accepts it, else only memory rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import combinations

import pytest

from optmem.pipeline_plan import PipelinePlan, PipelineStage, PipelineTask
from optmem.problems.pipeline import PipelineProblem
from optmem.simulate.pipeline import simulate_pipeline


def equal_split_plan(problem: PipelineProblem, frac: float) -> PipelinePlan:
    """1F1B* on the equal split into ``min(P, L)`` stages, at a period ``frac`` of the way
    from the heaviest stage's load to the sequential period."""
    from optmem.solvers import pipeline_contiguous as contig

    k = min(problem.n_gpus, problem.layers.n)
    bounds = contig.equal_split(problem, k)
    f, b = contig.pseudo_loads(problem, bounds)
    loads = [x + y for x, y in zip(f, b, strict=True)]
    period = max(loads) + frac * (sum(loads) - max(loads))
    return contig.one_f_one_b_star(problem, bounds, period)


def assert_model_agrees_with_simulator(form, problem: PipelineProblem,
                                       plan: PipelinePlan) -> list[float]:
    """``plan`` encoded in ``form`` violates nothing iff the simulator accepts it (then the
    objective is its period), else it violates memory rows only. Returns the encoding."""
    values = form.encode(plan)
    assert values is not None
    bad = form.model.violated(values)
    fits = simulate_pipeline(problem, plan).peak_memory <= problem.memory_per_gpu
    if fits:
        assert not bad, bad
        assert form.model.evaluate(values) == pytest.approx(plan.period)
    else:
        assert bad and all(name.startswith("mem") for name in bad), bad
    return values


def assert_replays(problem: PipelineProblem, plan: PipelinePlan) -> None:
    """The simulator replays ``plan`` (a model's decoded plan) to its period within memory."""
    sim = simulate_pipeline(problem, plan)
    assert sim.peak_memory <= problem.memory_per_gpu
    assert sim.period == pytest.approx(plan.period, abs=1e-6)


def split_stages(problem: PipelineProblem, plan: PipelinePlan) -> PipelinePlan:
    """The same execution with one stage per layer: a stage's forward becomes its layers'
    forwards back to back from the same start, its backward their backwards in reverse."""
    lay = problem.layers
    stages: list[PipelineStage] = []
    first_of: dict[int, int] = {}  # old stage -> its first new stage
    for s, st in enumerate(plan.stages, start=1):
        first_of[s] = len(stages) + 1
        stages.extend(PipelineStage(k, k, st.gpu) for k in range(st.first, st.last + 1))
    tasks: list[PipelineTask] = []
    for t in plan.tasks:
        st = plan.stages[t.stage - 1]
        base = first_of[t.stage]
        if t.op == "F":
            tasks.extend(PipelineTask("F", base + k - st.first,
                                      t.start + lay.fwd(st.first, k - 1), t.shift)
                         for k in range(st.first, st.last + 1))
        elif t.op == "B":
            tasks.extend(PipelineTask("B", base + k - st.first,
                                      t.start + lay.bwd(k + 1, st.last), t.shift)
                         for k in range(st.first, st.last + 1))
        else:  # a transfer after the stage's last layer
            tasks.append(PipelineTask(t.op, base + st.last - st.first, t.start, t.shift))
    return PipelinePlan(plan.period, tuple(stages), tuple(tasks))


def forwards_ahead_plan(first_layers: int = 4) -> PipelinePlan:
    """MadPipe's plan of ``bench_pipeline_runtime.py --temporaries`` (GPU 0: layers 1-4, GPU
    1: the next three, one stage each): GPU 0 runs 7 forwards before its first backward,
    so GPU 1 hears back from it once only after its first gradient. ``first_layers``: the
    layers of stage 1 (3 for a 6-layer model; the schedule does not change)."""
    k = first_layers
    return PipelinePlan.from_strings([
        "period 7.5", f"stage 1 layers 1-{k} gpu 0", f"stage 2 layers {k + 1}-{k + 1} gpu 1",
        f"stage 3 layers {k + 2}-{k + 2} gpu 1", f"stage 4 layers {k + 3}-{k + 3} gpu 1",
        "B 1 start 0 shift 0", "F 1 start 5 shift 7", "grad 1 start 2 shift 1",
        "send 1 start 0 shift 6", "B 2 start 0 shift 1", "F 2 start 6 shift 6",
        "B 3 start 2 shift 2", "F 3 start 5.75 shift 5", "B 4 start 2.5 shift 3",
        "F 4 start 4.75 shift 4"])


def set_partitions(n: int, parts: int) -> Iterator[list[int]]:
    """GPU labels of every allocation of ``n`` layers to at most ``parts`` GPUs (up to symmetry:
    labels by first use), depth first (``bench_pipeline_linearization.py`` enumerates with it)."""
    def rec(prefix: list[int], used: int) -> Iterator[list[int]]:
        if len(prefix) == n:
            yield list(prefix)
            return
        for g in range(min(used + 1, parts)):
            yield from rec([*prefix, g], max(used, g + 1))
    yield from rec([], 0)


def stage_partitions(n: int) -> Iterator[list[tuple[int, int]]]:
    """Every partition of layers ``1..n`` into consecutive stages (1-based ranges)."""
    for k in range(n):
        for cuts in combinations(range(1, n), k):
            edges = [0, *cuts, n]
            yield [(edges[i] + 1, edges[i + 1]) for i in range(len(edges) - 1)]


def stage_brute_force(problem: PipelineProblem, *, limit: float | None = None) -> float:
    """Brute force over plans' stages (stop 80): the best replayed period (``inf``: none).

    For every partition of the layers into stages and every allocation of the stages to
    GPUs, the model of those stages as units (one unit per stage, each row its stage's own
    check: no joins), CP-SAT with the allocation fixed and the best period so far as a
    cutoff; a plan counts only where the simulator replays it within memory. It does not
    depend on how the layer model joins units into stages (``_Builder.stage_joins``,
    switched off here). ``limit``: deterministic seconds per model (``None``: none); an
    unproven model makes the answer ``nan``.
    """
    from optmem.models import pipeline as model
    from optmem.result import SolveOptions, Status
    from optmem.solvers.pipeline_common import run_model

    joins = model._Builder.stage_joins
    model._Builder.stage_joins = lambda self: None  # type: ignore[method-assign]
    best, proven = float("inf"), True
    options = SolveOptions(threads=1, warm_start=False, deterministic_time=limit)
    try:
        for bounds in stage_partitions(problem.layers.n):
            units = model.make_units(problem, bounds)
            for gpu in set_partitions(units.n, problem.n_gpus):
                cutoff = None if best == float("inf") else best - 1e-6
                run = run_model(problem, "cpsat", options, units=units, gpu=gpu,
                                upper_bound=cutoff)
                proven &= run.status in (Status.OPTIMAL, Status.INFEASIBLE)
                if run.plan is None:
                    continue
                sim = simulate_pipeline(problem, run.plan)
                if sim.peak_memory <= problem.memory_per_gpu:
                    best = min(best, sim.period)
    finally:
        model._Builder.stage_joins = joins  # type: ignore[method-assign]
    return best if proven else float("nan")
