"""``strict`` chains with layers without forward time, each layer its own unit (stop 80).

Until stop 80 the ``strict`` models kept such a layer with its predecessor
(``zero_forward_merged``), so their proofs covered that class only, and stop 79 counted 23
of 80 seeded chains where a plan of another allocation was better. Now every layer is a
unit, and joins (``_Builder.stage_joins``) also write the stages whose trailing layers take
no forward time (the simulator checks a stage's layers where the stage starts). The checks:

* random plans (stages of 1-3 layers, zero forward and backward times, temporaries or not):
  encoded in the layer model, the rows hold iff the simulator fits the plan the model reads
  (a stage boundary that no join writes is read as two stages, which hold no more), and
  fail only memory rows one below its peak;
* seeded tiny chains (3-6 layers, 2-3 GPUs): ``ilp`` and ``cpsat`` equal brute force over
  stage partitions and allocations (``stage_brute_force``: no joins, each stage a unit),
  their plans replay at their objective, and the merged class's answer
  (``STRICT_LAYERS = False``) is worse on some of them.
"""

from __future__ import annotations

import math
import random

import pytest
from pipeline_helpers import stage_brute_force

from optmem import PipelineProblem, SolveOptions, solve
from optmem.chain import Chain
from optmem.models import pipeline as pipeline_model
from optmem.models.pipeline import make_units, model_bounds, separation
from optmem.pipeline_plan import PipelinePlan
from optmem.result import Status
from optmem.simulate.pipeline import simulate_pipeline
from optmem.simulate.verify import verify_plan
from optmem.solvers.pipeline_common import build_model
from tests.test_pipeline_zero_ties import plans_at_their_peak, sized_chain

pytest.importorskip("ortools", reason="the exact models use OR-Tools CP-SAT")
pytest.importorskip("pulp", reason="method ilp uses PuLP")

ONE = SolveOptions(threads=1, warm_start=False).with_(extra={"warm_madpipe": False})


def zero_forward_instance(seed: int) -> PipelineProblem:
    """A seeded ``strict`` chain of 3-6 layers, 2-3 GPUs, some forwards (and backwards)
    without time, at 1-2x its least memory."""
    rng = random.Random(seed)
    n = rng.choice([3, 3, 4, 4, 5, 6])
    fwd = [float(rng.choice([0, 0, 1, 2, 3])) for _ in range(n)]
    bwd = [float(rng.choice([0, 1, 2, 4])) for _ in range(n)]
    if 0.0 not in fwd[1:]:
        fwd[rng.randrange(1, n)] = 0.0
    if sum(fwd) + sum(bwd) == 0:
        bwd[0] = 1.0
    chain = sized_chain(rng, fwd, bwd)
    gpus = rng.choice([2, 3])
    bandwidth = rng.choice([None, None, 2.0])
    kw = {} if bandwidth is None else {"chain_bandwidth": bandwidth}
    least = PipelineProblem(chain, gpus, 10**6, memory_model="strict",
                            **kw).memory_lower_bound()
    memory = int(least * rng.choice([1.0, 1.2, 1.5, 2.0])) + rng.randint(0, 3)
    return PipelineProblem(chain, gpus, memory, memory_model="strict", **kw)


def random_chain(rng: random.Random) -> tuple[Chain, bool]:
    """2-4 layers with forwards and backwards of zero time; temporaries or not."""
    n = rng.choice([2, 3, 4])
    fwd = [float(rng.choice([0, 0, 1, 2])) for _ in range(n)]
    bwd = [float(rng.choice([0, 0, 1, 2])) for _ in range(n)]
    if sum(fwd) + sum(bwd) == 0:
        fwd[0] = 1.0
    return sized_chain(rng, fwd, bwd), rng.random() < 0.3


@pytest.mark.parametrize("seed", range(8))
def test_rows_hold_iff_the_simulator_fits_the_plan_the_model_reads(seed: int) -> None:
    """Random plans of chains with zero forward and backward times, on one unit per layer.

    Before stop 80 (no joins for zero-length forwards; a stage's stash counted twice at a
    tie, ``held`` beside ``near``, and freed at a zero-length backward while its stage
    ran on) such plans fitted the rows below their peak (unsound) or failed them at it.
    """
    rng = random.Random(1000 + seed)
    checked = 0
    for _ in range(12):
        chain, temporaries = random_chain(rng)
        base = PipelineProblem(chain, 2, 10**6, memory_model="strict",
                               temporaries=temporaries)
        layers = [(q, q) for q in range(1, base.layers.n + 1)]
        for memory, peak, plan in plans_at_their_peak(rng, base, 20):
            problem = PipelineProblem(chain, 2, memory, memory_model="strict",
                                      temporaries=temporaries)
            form = build_model(problem, units=make_units(problem, layers))
            values = form.encode(plan)
            if values is None:  # a period outside the model's bounds
                continue
            bad = form.model.violated(values)
            read = form.decode(values)
            fits = simulate_pipeline(problem, read).peak_memory <= memory
            if read.stages == plan.stages:  # joins as the plan's stages: the same plan
                assert fits is (memory >= peak)
            assert (not bad) is fits, (plan.to_strings(), bad)
            assert all(name.startswith("mem") for name in bad), bad
            checked += 1
    assert checked >= 20


# a plan of seed 225 of the one-off run: layers 1-2 one stage (no forward time, B 2 none),
# its stash alive until B 1 ends; before stop 80, B 3's row (tied before B 2) freed it
STAGE_STASH = Chain.from_lists([0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0], [5, 6, 3, 5],
                               [6, 12, 4, 9], input_size=3, fwd_overhead=[2, 0, 3, 3],
                               bwd_overhead=[1, 0, 2, 3], weight_size=[5, 2, 1, 2])
STAGE_STASH_PLAN = ("period 2", "stage 1 layers 1-2 gpu 0", "stage 2 layers 3-3 gpu 0",
                    "stage 3 layers 4-4 gpu 0", "F 1 start 1 shift 1", "B 1 start 1 shift 0",
                    "F 2 start 1 shift 1", "B 2 start 1 shift 0", "F 3 start 0 shift 0",
                    "B 3 start 0 shift 0")


def test_a_stage_stash_lives_until_its_last_backward_ends() -> None:
    """Stage 1 (layers 1-2) runs ``B 2`` (no time) at 1, then ``B 1`` until 2: the
    simulator counts the stage's stash, layer 2's included, at ``B 3``'s check at 1.
    The rows count it (``ended`` is 0 while a backward that takes time follows in the
    stage): they hold at the replayed peak and fail one below it."""
    plan = PipelinePlan.from_strings(list(STAGE_STASH_PLAN))
    base = PipelineProblem(STAGE_STASH, 1, 10**6, memory_model="strict")
    peak = simulate_pipeline(base, plan).peak_memory
    for memory in (peak, peak - 1):
        problem = PipelineProblem(STAGE_STASH, 1, memory, memory_model="strict")
        form = build_model(problem, units=make_units(problem, [(q, q) for q in range(1, 5)]))
        values = form.encode(plan)
        assert values is not None and form.decode(values).stages == plan.stages
        assert bool(form.model.violated(values)) is (memory < peak)


def exact_answers(problem: PipelineProblem) -> dict[str, object]:
    return {m: solve(problem, m, options=ONE) for m in ("ilp", "cpsat")}


# seeds of zero_forward_instance whose brute force runs in a few seconds at most
SEEDS = [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_answers_equal_brute_force_over_stages(seed: int) -> None:
    problem = zero_forward_instance(seed)
    assert 0.0 in problem.chain.fwd_time
    assert len(model_bounds(problem)) == problem.layers.n
    expected = stage_brute_force(problem)
    for method, res in exact_answers(problem).items():
        assert "merged_units" not in res.report, method
        if math.isinf(expected):
            assert res.status is Status.INFEASIBLE, (method, res.status)
            continue
        assert res.status in (Status.OPTIMAL, Status.FEASIBLE), (method, res.status)
        # the models' optimum, up to the tie separation (a plan at the infimum may need a
        # start closer than it after a zero-length task: ``feasible`` then)
        assert res.objective <= expected + separation(expected) + 1e-6, method
        assert res.bound <= expected + 1e-6, method
        if res.status is Status.OPTIMAL:
            assert res.objective == pytest.approx(expected, abs=1e-5), method
        assert verify_plan(problem, res)["objective"] == pytest.approx(res.objective)


def test_the_merged_class_loses_where_layers_move(monkeypatch) -> None:
    """On some of these chains the best plan puts a layer without forward time on another
    GPU than its predecessor's, or in a stage of its own: the merged class's answer
    (``STRICT_LAYERS = False``, the units before stop 80) is worse or has no plan."""
    worse = 0
    for seed in SEEDS:
        problem = zero_forward_instance(seed)
        new = solve(problem, "cpsat", options=ONE)
        monkeypatch.setattr(pipeline_model, "STRICT_LAYERS", False)
        old = solve(problem, "cpsat", options=ONE)
        monkeypatch.setattr(pipeline_model, "STRICT_LAYERS", True)
        if new.status.has_plan:
            worse += not old.status.has_plan or old.objective > new.objective + 1e-6
        else:
            assert not old.status.has_plan
    assert worse >= 2
