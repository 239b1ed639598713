"""Pipeline problem: simulator, 1F1B*, contiguous search, baselines, goldens of madpipe.md 7."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.datasets.synthetic import random_pipeline_chain
from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan, PipelineStage, PipelineTask
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.simulate.verify import verify_plan
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.facade import solve


def thesis_chain(f, b, a, w=None) -> Chain:
    """Simple BP-transform chain: a = [a_0, ..., a_L], saved = output (stash = input)."""
    n = len(f)
    return Chain.from_lists(f, b, a[1:n + 1], a[1:n + 1], input_size=a[0], weight_size=w)


def brute_contiguous(problem: PipelineProblem) -> float:
    """Best 1F1B* period over every contiguous split into at most P stages."""
    found = contig.scan_contiguous(problem)
    return math.inf if found is None else found[0]


# ------------------------------------------------------------------ 1F1B* (madpipe.md 7.3)
def test_grouping_examples():
    assert contig.pseudo_groups([2, 2, 2], 2) == [3, 2, 1]
    assert contig.pseudo_groups([2, 2, 2], 3.9) == [3, 2, 1]
    assert contig.pseudo_groups([2, 2, 2], 4) == [2, 1, 1]
    assert contig.pseudo_groups([2, 2, 2], 6) == [1, 1, 1]
    loads = [3, 1, 1, 2, 4]
    assert contig.pseudo_groups(loads, 4) == [3, 2, 2, 2, 1]
    assert contig.pseudo_groups(loads, 5) == [3, 2, 2, 2, 1]
    assert contig.pseudo_groups(loads, 6) == [2, 2, 2, 1, 1]
    assert contig.pseudo_groups(loads, 7) == [2, 2, 1, 1, 1]
    assert contig.pseudo_groups(loads, 11) == [1] * 5


def test_oplus_examples():
    assert [contig.oplus(x, y, 4) for x, y in [(0, 3), (3, 1), (4, 1), (5, 2), (7, 2)]] == \
        [3, 4, 5, 7, 10]
    assert [contig.group_of(contig.oplus(v, u, 4), 4) for v, u in [(0, 3), (4, 1), (7, 2)]] \
        == [1, 2, 3]


def test_theorem16_instance_optimal_one_periodic():
    """madpipe.md 7.3: T* = 4, g = [2, 1, 1], memory [3, 2, 3] (C = 1, no buffers)."""
    chain = thesis_chain([1, 1, 1], [1, 1, 1], [1, 1, 1, 0], w=[1, 1, 2])
    p = PipelineProblem(chain, 3, 3, weight_copies=1, buffers=False)
    bounds = [(1, 1), (2, 2), (3, 3)]
    period, plan = contig.best_period_for_allocation(p, bounds)
    assert period == 4
    assert contig.stage_copies(p, bounds, 4) == [2, 1, 1]
    assert contig.stage_copies(p, bounds, 3.5) == [3, 2, 1]  # memory [4, 3, 3]: too much
    sim = simulate_pipeline(p, plan)
    assert sim.peaks == (3, 2, 3) and sim.nca == (2, 1, 1)
    # the closed form of madpipe.md 7.3 (f = b = 1, T = 4)
    start = {(t.op, t.stage): t.start for t in plan.tasks}
    assert (start[("F", 1)], start[("B", 1)]) == (0, 1)
    assert (start[("F", 2)], start[("B", 2)]) == (1, 0)
    assert (start[("F", 3)], start[("B", 3)]) == (2, 3)


def test_1f1b_star_is_1f1b_at_max_load():
    chain = thesis_chain([1, 1, 1], [1, 1, 1], [1, 1, 1, 0])
    p = PipelineProblem(chain, 3, 100, weight_copies=1, buffers=False)
    plan = contig.one_f_one_b_star(p, [(1, 1), (2, 2), (3, 3)], 2)
    assert simulate_pipeline(p, plan).nca == (3, 2, 1)  # Fig. 4.8: NCA_1 = P


# ------------------------------------------------------------------ madpipe.md 7.5 (contiguous)
@pytest.mark.parametrize(("gpus", "memory", "expected"), [
    (2, 6, None), (2, 8, 8.0), (2, 12, 6.0), (2, 14, 4.0), (2, 30, 4.0),
    (4, 12, 4.0), (4, 16, 4.0), (4, 20, 2.0), (4, 40, 2.0),
])
def test_contiguous_golden_75(gpus, memory, expected):
    chain = thesis_chain([1] * 4, [1] * 4, [4, 2, 1, 1, 0])
    p = PipelineProblem(chain, gpus, memory)  # C = 3, buffers, beta = inf
    r = solve(p, "contiguous")
    if expected is None:
        assert r.status is Status.INFEASIBLE
    else:
        assert r.status is Status.OPTIMAL and r.objective == expected
        assert brute_contiguous(p) == expected


def test_contiguous_vs_general_examples_71():
    """madpipe.md 7.1: contiguous periods 3 and 7 (general ones are 2 and 6: test_exact)."""
    c1 = thesis_chain([0.5, 1, 0.5], [0.5, 1, 0.5], [0, 0, 0, 0])
    assert solve(PipelineProblem(c1, 2, 10**6), "contiguous").objective == 3
    costs = [3, 2, 2, 1, 2, 2]
    c2 = thesis_chain([c / 2 for c in costs], [c / 2 for c in costs], [0] * 7)
    assert solve(PipelineProblem(c2, 2, 10**6), "contiguous").objective == 7


def test_theorem17_family_k2():
    eps = 0.2
    costs = [2, eps, 1, eps, 2, eps, 1, eps, 2, eps, 1]
    chain = thesis_chain([c / 2 for c in costs], [c / 2 for c in costs], [0] * 12)
    r = solve(PipelineProblem(chain, 5, 10**6), "contiguous")
    assert r.objective == pytest.approx(3.2)


def test_lemma10_no_contiguous_allocation():
    chain = thesis_chain([0.5, 1, 0.5], [0.5, 1, 0.5], [0, 0, 0, 0], w=[1, 2, 1])
    p = PipelineProblem(chain, 2, 2, weight_copies=1)
    assert solve(p, "contiguous").status is Status.INFEASIBLE


def test_theorem18_contiguous_k3():
    chain = thesis_chain([c / 2 for c in [1, 1, 1, 3, 2, 2, 2]],
                         [c / 2 for c in [1, 1, 1, 3, 2, 2, 2]], [0] * 8,
                         w=[3, 3, 3, 4, 1, 1, 1])
    r = solve(PipelineProblem(chain, 5, 4, weight_copies=1), "contiguous")
    assert r.status is Status.OPTIMAL and r.objective == 6


# ------------------------------------------------------------------ random profiles
def random_problem(seed: int, n: int, gpus: int, mem_factor: float, beta: float):
    chain = random_pipeline_chain(n, seed=seed, kind="cnn" if seed % 2 else "transformer",
                                  batch=2, width=256, sequence=128)
    lay = PipelineProblem(chain, gpus, 1).layers
    scale = 3 * sum(lay.w) + sum(lay.x) * 2
    bw = math.inf if beta == 0 else beta * sum(lay.a) / lay.load(1, lay.n)
    return PipelineProblem(chain, gpus, int(scale * mem_factor / gpus) + 1, chain_bandwidth=bw)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 7), gpus=st.integers(1, 4),
       mem=st.floats(0.3, 3.0), beta=st.sampled_from([0, 0.5, 4.0]))
def test_contiguous_equals_brute_force(seed, n, gpus, mem, beta):
    p = random_problem(seed, n, gpus, mem, beta)
    r = solve(p, "contiguous")
    brute = brute_contiguous(p)
    if not math.isfinite(brute):
        assert r.status is Status.INFEASIBLE
        return
    assert r.status.has_plan
    assert r.objective == pytest.approx(brute, rel=1e-9)
    assert r.peak_memory <= p.memory_per_gpu
    # baselines are never better than the contiguous optimum
    for m in ("equal", "pipedream"):
        rb = solve(p, m)
        if rb.status.has_plan:
            assert rb.objective >= r.objective * (1 - 1e-9)
            assert rb.peak_memory <= p.memory_per_gpu


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 8), gpus=st.integers(2, 5),
       beta=st.sampled_from([0, 1.0]), frac=st.floats(0, 1))
def test_1f1b_star_nca_and_optimal_period(seed, n, gpus, beta, frac):
    p = random_problem(seed, n, gpus, 100.0, beta)
    k = min(gpus, p.layers.n)
    bounds = contig.equal_split(p, k)
    f, b = contig.pseudo_loads(p, bounds)
    loads = [x + y for x, y in zip(f, b, strict=True)]
    period = max(loads) + frac * sum(loads)
    plan = contig.one_f_one_b_star(p, bounds, period)
    sim = simulate_pipeline(p, plan)
    copies = contig.stage_copies(p, bounds, period)
    assert list(sim.nca) == copies
    assert all(x >= y for x, y in itertools.pairwise(copies))  # Lemma 9
    assert max(copies) <= 2 * len(bounds) - 1  # pseudo-stages (links included)
    for (i, j), g, st_ in zip(bounds, copies, plan.stages, strict=True):
        assert sim.peaks[st_.gpu] == p.stage_memory(i, j, g)
    # exact period scan: feasible at T*, not just below
    need = max(sim.peaks)
    tight = replace(p, memory_per_gpu=need)
    tstar, _ = contig.best_period_for_allocation(tight, bounds)
    assert tstar <= period + 1e-9
    below = tstar * (1 - 1e-6)
    assert below < max(loads) or not contig.memory_fits(tight, bounds, below)


def test_period_non_increasing_in_memory():
    chain = random_pipeline_chain(8, seed=5, kind="cnn", batch=4, width=128)
    base = PipelineProblem(chain, 4, 1, chain_bandwidth=1e5)
    periods = []
    for mem in [2 * 10**8, 3 * 10**8, 5 * 10**8, 10**9, 10**10]:
        r = solve(replace(base, memory_per_gpu=mem), "contiguous")
        periods.append(r.objective if r.status.has_plan else math.inf)
    assert all(x >= y for x, y in itertools.pairwise(periods)), periods
    assert math.isfinite(periods[-1])


# ------------------------------------------------------------------ simulator
def two_stage_plan() -> tuple[PipelineProblem, PipelinePlan]:
    chain = thesis_chain([1, 1], [1, 1], [1, 1, 0])
    p = PipelineProblem(chain, 2, 100, weight_copies=1)
    return p, contig.one_f_one_b_star(p, [(1, 1), (2, 2)], 2)


def test_plan_round_trips():
    p, plan = two_stage_plan()
    assert PipelinePlan.from_strings(plan.to_strings()) == plan
    assert PipelinePlan.from_dict(plan.to_dict()) == plan
    out = verify_plan(p, {"plan": list(plan.to_strings())})
    assert out["objective"] == 2 and out["memory_limit"] == 100
    assert out["nca"] == [2, 1]
    # a stage or the period given twice: the last one won and the plan verified (stop 51)
    ops = list(plan.to_strings())
    stage = next(o for o in ops if o.startswith("stage 1 "))
    moved = stage.rsplit(" ", 1)[0] + " 1" if not stage.endswith(" 1") else \
        stage.rsplit(" ", 1)[0] + " 0"
    with pytest.raises(PlanError, match="stage 1 is defined twice"):
        PipelinePlan.from_strings([*ops, moved])
    with pytest.raises(PlanError, match="the period twice"):
        PipelinePlan.from_strings([*ops, "period 100"])


def _with_task(plan: PipelinePlan, op: str, stage: int, **changes) -> PipelinePlan:
    tasks = tuple(replace(t, **changes) if (t.op, t.stage) == (op, stage) else t
                  for t in plan.tasks)
    return replace(plan, tasks=tasks)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda pl: _with_task(pl, "B", 1, start=0.5), "overlap"),
    (lambda pl: _with_task(pl, "F", 2, shift=5), "before"),
    (lambda pl: replace(pl, tasks=pl.tasks[1:]), "missing"),
    (lambda pl: replace(pl, period=1.5), "longer than the period|outside|overlap"),
    (lambda pl: replace(pl, stages=(PipelineStage(1, 1, 0), PipelineStage(3, 3, 1))),
     "expected a range"),
    (lambda pl: replace(pl, stages=(PipelineStage(1, 1, 0), PipelineStage(2, 2, 0))),
     "unexpected task"),
    (lambda pl: replace(pl, tasks=(*pl.tasks, PipelineTask("F", 1, 0.0, 0))), "twice"),
])
def test_simulator_rejects_invalid(mutate, message):
    p, plan = two_stage_plan()
    with pytest.raises(PlanError, match=message):
        simulate_pipeline(p, mutate(plan))


def test_simulator_link_exclusivity():
    chain = thesis_chain([1, 1], [1, 1], [1, 4, 0])
    p = PipelineProblem(chain, 2, 100, chain_bandwidth=4.0, weight_copies=1)
    plan = contig.one_f_one_b_star(p, [(1, 1), (2, 2)], 4)
    simulate_pipeline(p, plan)
    bad = _with_task(plan, "grad", 1, start=plan.task("send", 1).start)
    with pytest.raises(PlanError, match="link 0-1"):
        simulate_pipeline(p, bad)


def test_verify_rejects_memory():
    p, plan = two_stage_plan()
    with pytest.raises(PlanError, match="above the memory"):
        verify_plan(replace(p, memory_per_gpu=2), plan.to_dict())


def test_problem_validation():
    chain = thesis_chain([1], [1], [1, 0])
    with pytest.raises(OptmemInputError, match="GPUs"):
        PipelineProblem(chain, 0, 10)
    with pytest.raises(OptmemInputError, match="bandwidth"):
        PipelineProblem(chain, 1, 10, chain_bandwidth=0)
    with pytest.raises(OptmemInputError, match="memory model"):
        PipelineProblem(chain, 1, 10, memory_model="nope")


# ------------------------------------------------------------------ CLI
def test_cli_solve_and_verify(tmp_path, capsys):
    import json

    from optmem.cli import main

    chain = random_pipeline_chain(6, seed=2, kind="cnn", batch=2, width=64)
    path = tmp_path / "chain.json"
    chain.save(path)
    common = ["--gpus", "3", "--memory", "1GiB", "--bandwidth", "12GB/s"]
    assert main(["solve", "pipeline", str(path), *common, "--method", "pipedream",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "feasible" and out["plan"][0].startswith("period")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(out))
    assert main(["verify", "pipeline", str(path), str(plan_file), *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["objective"] == pytest.approx(out["objective"])
    assert main(["solve", "pipeline", str(path), "--memory", "1GiB"]) == 2  # --gpus missing
    assert "--gpus" in capsys.readouterr().err


def test_strict_contiguous_is_simulated():
    chain = thesis_chain([1, 1, 1], [1, 1, 1], [1, 1, 1, 0])
    p = PipelineProblem(chain, 3, 6, memory_model="strict")
    r = solve(p, "contiguous")
    assert r.status is Status.FEASIBLE and r.peak_memory <= 6
    assert r.objective >= 4  # the ILP optimum of madpipe.md 7.6 Ex4 at M = 6


def test_contiguous_is_optimal_for_one_stage_per_gpu_not_for_every_contiguous_plan() -> None:
    """``contiguous``'s class is one stage per GPU (1F1B*): in the stash model a GPU whose
    run is split into one stage per layer frees each layer's stash at its own backward
    and can fit a shorter period on the same allocation. A hunt (stop 51) read the class
    as every plan of a contiguous allocation; the docs now say which it is, and this pins
    both facts: ``contiguous`` 19 (optimal in its class), the exact model 16 on its
    allocation, replayed, with a stage per layer on the two GPUs."""
    from optmem.result import SolveOptions
    from optmem.solvers.pipeline_common import run_model

    chain = Chain.from_lists([5, 3, 4, 3, 1], [4, 3, 1, 5, 2], [2, 2, 2, 2, 0],
                             [2, 2, 2, 2, 0], input_size=2, weight_size=[2, 2, 2, 2, 0])
    problem = PipelineProblem(chain, n_gpus=2, memory_per_gpu=27, weight_copies=3,
                              chain_bandwidth=1.0)
    best = solve(problem, "contiguous")
    assert best.status is Status.OPTIMAL and best.objective == best.bound == 19
    assert best.report["allocation"] == "GPU 0: 1,2; GPU 1: 3,4,5"
    options = SolveOptions(threads=1, seed=0, deterministic_time=10.0, warm_start=False)
    run = run_model(problem, "cpsat", options, gpu=[0, 0, 1, 1, 1])
    assert run.plan is not None and run.plan.period == 16
    replay = verify_plan(problem, list(run.plan.to_strings()))
    assert replay["objective"] == 16 and replay["peak_memory"] <= 27
    assert len(run.plan.stages) > 2  # one stage per layer: outside contiguous's class


def test_a_zero_time_task_at_anothers_start_is_at_its_boundary_within_the_tolerance() -> None:
    """A zero-time ``F 2`` at the start of ``B 2`` on the same GPU: accepted when the two
    starts were bit-equal, refused as an overlap when ``F 2`` started 2e-15 later (far
    within the 1e-6 tolerance), and ``contiguous`` then raised that error from its own
    replay (a hunt in stop 51). Inside the backward it is still an overlap."""
    from optmem.datasets.synthetic import random_chain

    chain = random_chain(3, seed=4)  # stage 2's forward takes no time
    assert chain.fwd_time[1] == 0
    problem = PipelineProblem(chain, 3, 10**6, chain_bandwidth=3.0, memory_model="strict")
    ops = ["period 14", "stage 1 layers 1-1 gpu 0", "stage 2 layers 2-2 gpu 1",
           "stage 3 layers 3-3 gpu 2", "B 1 start 5 shift 0", "F 1 start 0 shift 2",
           "grad 1 start 9.666666666666664 shift 1", "send 1 start 5 shift 2",
           "B 2 start 7.666666666666664 shift 1", "F 2 start {f2} shift 2",
           "grad 2 start 3 shift 1", "send 2 start 7.666666666666666 shift 2",
           "B 3 start 13 shift 2", "F 3 start 11 shift 2"]
    for f2 in ("7.666666666666664", "7.666666666666666"):
        plan = PipelinePlan.from_strings([o.replace("{f2}", f2) for o in ops])
        assert simulate_pipeline(problem, plan).period == 14
    inside = PipelinePlan.from_strings([o.replace("{f2}", "8.5") for o in ops])
    with pytest.raises(PlanError, match="GPU 1 runs B 2 .* overlap"):
        simulate_pipeline(problem, inside)
    result = solve(PipelineProblem(chain, 3, 67, chain_bandwidth=3.0, memory_model="strict"),
                   "contiguous")
    assert result.status.has_plan and result.objective == 17


def test_a_zero_link_names_the_field_it_was_given_in() -> None:
    """``PipelineProblem(..., chain_bandwidth=0)`` said ``field 'bandwidth': expected a
    positive bandwidth (or inf), got None`` (the unset ``bandwidth``) until stop 53."""
    chain = random_pipeline_chain(4, seed=1)
    with pytest.raises(OptmemInputError, match=r"field 'chain_bandwidth'.*got 0"):
        PipelineProblem(chain, n_gpus=2, memory_per_gpu=10**9, chain_bandwidth=0)
    with pytest.raises(OptmemInputError, match=r"field 'bandwidth'.*got '0'"):
        PipelineProblem(chain, n_gpus=2, memory_per_gpu=10**9, bandwidth="0")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_no_pipeline_plan_fits_below_the_memory_lower_bound(data: st.DataObject) -> None:
    """:meth:`PipelineProblem.memory_lower_bound` is a bound: the exact model proves every
    limit below it infeasible (stash, strict, strict with temporaries; 1-3 GPUs)."""
    problem = _unlimited_problem(data, 3)
    bound = problem.memory_lower_bound()
    if bound > 0:
        below = solve(replace(problem, memory_per_gpu=bound - 1), "cpsat",
                      options=SolveOptions(threads=1, deterministic_time=30))
        assert below.status is Status.INFEASIBLE


HEURISTICS = ("equal", "pipedream", "madpipe", "chunks")
"""Pipeline methods whose own search only finds plans: below
:meth:`PipelineProblem.memory_lower_bound` they prove infeasibility from the bound."""


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.data())
def test_plan_finding_methods_prove_limits_below_the_memory_lower_bound(
        data: st.DataObject) -> None:
    """Stop 71: below :meth:`PipelineProblem.memory_lower_bound` (which the exact model
    confirms, test above), ``equal``, ``pipedream``, ``madpipe`` and ``chunks`` answer
    ``infeasible`` (proven: bound infinite) with the bound in the report, where they said
    ``no_solution``; at or above it, every plan they find replays and peaks at least at the
    bound (stash, strict, strict with temporaries)."""
    problem = _unlimited_problem(data, 4)
    bound = problem.memory_lower_bound()
    above = replace(problem, memory_per_gpu=bound + data.draw(st.integers(0, 30)))
    options = SolveOptions(threads=1, deterministic_time=5, seed=0)
    for method in HEURISTICS:
        if bound > 0:
            below = solve(replace(problem, memory_per_gpu=bound - 1), method, options=options)
            assert below.status is Status.INFEASIBLE, (method, below)
            assert below.bound == math.inf and below.plan == ()
            assert below.report["memory_lower_bound"] == bound
        found = solve(above, method, options=options)
        assert found.status is not Status.INFEASIBLE or found.report.get(
            "memory_lower_bound") is None, (method, found)
        if found.status.has_plan:
            peak = simulate_pipeline(above, PipelinePlan.from_strings(found.plan)).peak_memory
            assert bound <= peak <= above.memory_per_gpu, (method, peak, bound)


def test_a_limit_below_the_memory_lower_bound_is_one_line_on_every_method(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Stop 71: ``optmem solve pipeline resnet50-b32-224 --gpus 4 --memory 1KiB`` answers
    ``infeasible`` (exit 0) with the least memory any plan needs, for ``chunks`` without
    ``family=all`` and ``madpipe`` too (they said ``no_solution``)."""
    from optmem.cli import main

    for method in HEURISTICS:
        code = main(["solve", "pipeline", "resnet50-b32-224", "--gpus", "4", "--memory",
                     "1KiB", "--method", method, "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["status"] == "infeasible", (method, out)
        assert out["report"]["memory_lower_bound"] > 1024


def _unlimited_problem(data: st.DataObject, layers: int) -> PipelineProblem:
    """A problem on a random chain of 1-``layers`` layers, 1-3 GPUs, memory 0 (stash,
    strict, strict with temporaries; 0-3 weight copies)."""
    chain = _random_layers_chain(data, data.draw(st.integers(1, layers)))
    model, temporaries = data.draw(st.sampled_from([("stash", False), ("strict", False),
                                                    ("strict", True)]))
    problem = PipelineProblem(chain, n_gpus=data.draw(st.integers(1, 3)), memory_per_gpu=0,
                              weight_copies=data.draw(st.integers(0, 3)),
                              memory_model=model, temporaries=temporaries)
    return problem


def _random_layers_chain(data: st.DataObject, n: int) -> Chain:
    """A small chain with random integer times and sizes (every field drawn)."""
    sizes = st.lists(st.integers(0, 5), min_size=n, max_size=n)
    out = data.draw(sizes)
    return Chain.from_lists([float(t) for t in data.draw(
                                st.lists(st.integers(0, 3), min_size=n, max_size=n))],
                            [float(t) for t in data.draw(
                                st.lists(st.integers(1, 3), min_size=n, max_size=n))],
                            out, [o + e for o, e in zip(out, data.draw(sizes), strict=True)],
                            input_size=data.draw(st.integers(0, 4)),
                            fwd_overhead=data.draw(sizes), bwd_overhead=data.draw(sizes),
                            weight_size=data.draw(sizes),
                            loss_bwd_overhead=data.draw(st.integers(0, 3)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_a_stage_never_uses_less_than_its_memory_floor(data: st.DataObject) -> None:
    """:meth:`PipelineProblem.stage_memory_floor` is a bound the simulator never beats:
    on every 1F1B* pattern of random contiguous splits (every candidate period), the GPU
    of each stage peaks at least at the stage's floor (stash, strict, strict with
    temporaries, buffers or not). ``contiguous`` under ``strict`` skips splits below it."""
    n = data.draw(st.integers(1, 5))
    chain = _random_layers_chain(data, n)
    model, temporaries = data.draw(st.sampled_from([("stash", False), ("strict", False),
                                                    ("strict", True)]))
    problem = PipelineProblem(chain, n_gpus=3, memory_per_gpu=10**9,
                              weight_copies=data.draw(st.integers(0, 3)),
                              buffers=data.draw(st.booleans()), chain_bandwidth=2.0,
                              memory_model=model, temporaries=temporaries)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=2)) if n > 1 else [])
    edges = [0, *cuts, n]
    bounds = [(edges[t] + 1, edges[t + 1]) for t in range(len(edges) - 1)]
    f, b = contig.pseudo_loads(problem, bounds)
    loads = [x + y for x, y in zip(f, b, strict=True)]
    for period in contig.period_candidates(loads, max(loads)):
        peaks = simulate_pipeline(problem, contig.one_f_one_b_star(problem, bounds,
                                                                   period)).peaks
        for gpu, (i, j) in enumerate(bounds):
            assert peaks[gpu] >= problem.stage_memory_floor(i, j)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_strict_contiguous_returns_the_full_scans_plan(data: st.DataObject) -> None:
    """``contiguous`` under ``strict`` (splits by least period, memory floors, periods
    cut at the best) returns the plan of the full scan it replaced in stop 55: every split
    in enumeration order, every candidate period, the first split of the least period."""
    n = data.draw(st.integers(1, 6))
    chain = _random_layers_chain(data, n)
    problem = PipelineProblem(chain, n_gpus=data.draw(st.integers(1, 4)), memory_per_gpu=0,
                              chain_bandwidth=data.draw(st.sampled_from([1.0, 4.0, math.inf])),
                              memory_model="strict", temporaries=data.draw(st.booleans()))
    limit = data.draw(st.integers(problem.memory_lower_bound(),
                                  problem.memory_lower_bound() + 30))
    problem = replace(problem, memory_per_gpu=limit)
    best = contig.scan_contiguous(problem)
    result = solve(problem, "contiguous")
    if best is None:
        assert result.status is Status.INFEASIBLE
    else:
        assert result.objective == best[0]
        assert result.plan == tuple(best[1].to_strings())
