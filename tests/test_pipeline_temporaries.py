"""``PipelineProblem(..., memory_model="strict", temporaries=True)``: each task's temporaries.

Until this option a pipeline plan's per-GPU peak left out the chain's ``fwd_overhead``,
``bwd_overhead`` and ``loss.bwd_overhead`` (and ``delta_L``, and a forward's tape beyond its
output), so it bounded nothing a rank allocates (stop 53: the last rank of a 7-layer MLP
allocated 2.3-2.4x its plan). Checked here: the option's input rules (stash refused, CLI exit
2), every result unchanged when it adds nothing, the simulator's peak against a layer-by-layer
count written here from the chain's fields (not through ``Layers.strict_task``), every
method's plan replaying within the memory with its claimed period, the optimum never below
the one without, and the exact methods against brute force over allocations. Deterministic:
hypothesis derandomized, one solver thread, no time limit (the instances always prove).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_helpers import equal_split_plan, forwards_ahead_plan, split_stages

from optmem.chain import Chain
from optmem.cli import main
from optmem.errors import OptmemInputError
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.simulate.pipeline import simulate_pipeline
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_common import lower_bound
from tests.test_pipeline_benders import brute_force

pytest.importorskip("pulp", reason="the exact pipeline models need PuLP (optmem[engines])")
pytest.importorskip("ortools", reason="the CP-SAT pipeline model needs OR-Tools")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

OPTS = SolveOptions(threads=1, seed=0)  # no limit: these instances always prove
METHODS = {  # every pipeline method, and the options that make it run on 2-3 layers
    "contiguous": OPTS, "equal": OPTS, "pipedream": OPTS, "madpipe": OPTS,
    "ilp": OPTS, "cpsat": OPTS,
    "cpsat-benders": replace(OPTS, extra={"strategy": "benders", "relaxation": False}),
    "ilp-benders": replace(OPTS, extra={"strategy": "benders", "relaxation": False}),
    "cpsat-lns": replace(OPTS, extra={"lns": 2}),
    "chunks": replace(OPTS, extra={"chunks": 2}),
}


def run(problem: PipelineProblem, name: str):
    """Solve with one of :data:`METHODS` (``cpsat-lns``: ``cpsat`` with ``extra``)."""
    return solve(problem, name.split("-")[0], options=METHODS[name])


def chain_of(draw, n_max: int = 3, *, overheads: bool = True, last_out: bool = True,
             outputs: bool = True) -> Chain:
    """2..n_max layers, forwards 1..3, backwards 1..4, outputs 0..3, tapes output + 0..2,
    overheads 0..3, weights 0..2 (``overheads=False``: overheads and weights 0, tapes equal
    to outputs; ``outputs=False``: every output 0, the input 0..3)."""
    n = draw(st.integers(2, n_max))
    f = [draw(st.integers(1, 3)) for _ in range(n)]  # zero forwards: test_pipeline_zero_forward
    b = [draw(st.integers(1, 4)) for _ in range(n)]
    out = [draw(st.integers(0, 3)) if outputs else 0 for _ in range(n)]
    if not last_out:
        out[-1] = 0
    extra = [draw(st.integers(0, 2)) if overheads else 0 for _ in range(n)]
    saved = [o + e for o, e in zip(out, extra, strict=True)]
    ovh = st.integers(0, 3) if overheads else st.just(0)
    return Chain.from_lists(
        f, b, out, saved, input_size=draw(st.integers(0, 3)),
        weight_size=[draw(st.integers(0, 2)) if overheads else 0 for _ in range(n)],
        fwd_overhead=[draw(ovh) for _ in range(n)], bwd_overhead=[draw(ovh) for _ in range(n)],
        loss_bwd_overhead=draw(ovh))


@st.composite
def temp_problems(draw, n_max: int = 3, overheads: bool = True, last_out: bool = True,
                  outputs: bool = True):
    """A strict problem with temporaries, memory from tight to generous."""
    chain = chain_of(draw, n_max, overheads=overheads, last_out=last_out, outputs=outputs)
    gpus = draw(st.integers(1, 3))
    beta = draw(st.sampled_from([math.inf, 1.0, 2.0]))
    lay = PipelineProblem(chain, gpus, 0, memory_model="strict", temporaries=True).layers
    low = max(lay.x) + max(lay.tf) + max(lay.tb)
    heavy = 3 * sum(lay.w) + 2 * sum(lay.x) + 4 * sum(lay.a) + max(lay.tf) + max(lay.tb)
    memory = draw(st.integers(low, max(heavy, low) + 1))
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta, memory_model="strict",
                           temporaries=True)


def check(problem: PipelineProblem, result) -> None:
    """The result's plan replays to its objective within the memory."""
    assert result.status.has_plan, result.report
    sim = simulate_pipeline(problem, PipelinePlan.from_strings(result.plan))
    assert sim.period == pytest.approx(result.objective)
    assert sim.peak_memory <= problem.memory_per_gpu
    assert result.peak_memory == sim.peak_memory


# ------------------------------------------------------------------ input rules
def test_default_off_and_stash_refused():
    chain = Chain.from_lists([1, 1], [1, 1], [2, 3], [2, 3], input_size=1, fwd_overhead=[5, 5])
    assert PipelineProblem(chain, 2, 100).temporaries is False
    assert PipelineProblem(chain, 2, 100).layers.tf == ()
    with pytest.raises(OptmemInputError, match="strict") as err:
        PipelineProblem(chain, 2, 100, temporaries=True)
    assert err.value.field == "temporaries"
    with pytest.raises(OptmemInputError) as err:
        PipelineProblem(chain, 2, 100, memory_model="strict", temporaries=1)  # type: ignore
    assert err.value.field == "temporaries"


def test_layer_terms_from_the_chain_fields():
    """tf[k] = fwd_overhead + tape beyond output (layer L: whole tape), tb[k < L] =
    bwd_overhead + weight gradient + the output a_k the tape holds, tb[L] = max(delta_L +
    loss overhead - a_{L-1}, delta_L + bwd_overhead + weight gradient)."""
    chain = Chain.from_lists([1, 1, 1], [1, 1, 1], [2, 3, 4], [3, 3, 5], input_size=1,
                             fwd_overhead=[1, 2, 3], bwd_overhead=[4, 5, 6],
                             loss_bwd_overhead=7)
    lay = PipelineProblem(chain, 2, 100, memory_model="strict", temporaries=True).layers
    assert lay.tf == (0, 1 + 1, 2 + 0, 3 + 5)
    assert lay.tb == (0, 4 + 2, 5 + 3, max(4 + 7 - 3, 4 + 6))
    weighted = replace(chain, weight_size=(10, 20, 30))
    heavy = PipelineProblem(weighted, 2, 100, memory_model="strict", temporaries=True).layers
    assert heavy.tb == (0, 4 + 10 + 2, 5 + 20 + 3, max(4 + 7 - 3, 4 + 6 + 30))
    plain = PipelineProblem(chain, 2, 100, memory_model="strict").layers
    for i in range(1, 4):
        for j in range(i, 4):
            with_t, without = lay.strict_task(i, j), plain.strict_task(i, j)
            assert with_t[0] >= without[0] and with_t[1] >= without[1]
    # layer 3 alone: forward a_2 + tape 5 + 3; backward max(loss: 4 + 7, B: 4 + 3 + 6)
    assert lay.strict_task(3, 3) == (3 + 5 + 3, 4 + 3 + 6)
    chain = replace(chain, loss_bwd_overhead=20)
    lay = PipelineProblem(chain, 2, 100, memory_model="strict", temporaries=True).layers
    assert lay.strict_task(3, 3)[1] == 4 + 20  # the loss step is the larger


# ------------------------------------------------------------------ nothing added: as before
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=temp_problems(overheads=False, outputs=False),
       name=st.sampled_from(sorted(METHODS)))
def test_zero_temporaries_give_the_strict_results(problem, name):
    """Overheads and weights 0, tapes equal to outputs and every output 0 (the input
    not): every method's result is the plain strict model's (status, period, plan,
    peaks)."""
    plain = replace(problem, temporaries=False)
    assert problem.layers.strict_task(1, problem.layers.n) == \
        plain.layers.strict_task(1, plain.layers.n)
    a, b = run(problem, name), run(plain, name)
    assert a.status is b.status
    assert a.plan == b.plan and a.peak_memory == b.peak_memory
    if a.status.has_plan:
        assert a.objective == b.objective
        # both record memory_model 'strict' (since stop 55); a also temporaries
        assert {k: v for k, v in a.report.items() if k != "temporaries"
                and "time" not in k} == \
            {k: v for k, v in b.report.items() if "time" not in k}
        assert a.report["temporaries"] is True and "temporaries" not in b.report


# ------------------------------------------------------------------ independent peak
def independent_peaks(problem: PipelineProblem, plan: PipelinePlan, n_mb: int,
                      tol: float = 1e-6, at: dict | None = None) -> list[int]:
    """Per-GPU strict peak with temporaries, layer by layer from the chain's fields (and in
    ``at``, if given, each task's count by ``(op, stage, micro-batch)``).

    Same instants and windows as the simulator (a task's checks at its start; a stash alive
    from its forward's start to its backward's end; data waiting on the same GPU), but each
    layer's check is what the checkpoint simulator's op holds: ``F_all k`` the input
    ``a^{k-1}``, the tape ``abar^k`` and ``fwd_overhead``; ``Loss`` the micro-batch's stash,
    ``delta^L`` and ``loss.bwd_overhead``; ``B k`` the stash up to ``k`` with the whole tape
    ``abar^k`` (its output ``a^k`` included, as ``B k`` of the checkpoint simulator),
    ``delta^k``, ``delta^{k-1}``, ``bwd_overhead`` and the layer's weight gradient
    (``weight_size``).
    """
    c = problem.chain
    n = c.length
    size = [c.input_size, *c.output_size]  # a^k and delta^k, k = 0..n

    def x(k: int) -> int:  # stash of layer k: input + tape, its output left to layer k + 1
        return size[k - 1] + c.saved_size[k - 1] - (size[k] if k < n else 0)

    period, eps = plan.period, tol * max(1.0, plan.period)
    tasks = {(t.op, t.stage): t for t in plan.tasks}
    stages = plan.stages
    dur = {("F", s): sum(c.fwd_time[sg.first - 1:sg.last]) for s, sg in enumerate(stages, 1)}
    dur.update({("B", s): sum(c.bwd_time[sg.first - 1:sg.last])
                + (c.loss_bwd_time if sg.last == n else 0) for s, sg in enumerate(stages, 1)})

    def start(key, m):  # noqa: ANN001, ANN202
        return (m - tasks[key].shift) * period + tasks[key].start

    static = [0] * problem.n_gpus
    for s, sg in enumerate(stages, 1):
        static[sg.gpu] += problem.weight_copies * sum(c.weight_size[sg.first - 1:sg.last])
        if s < len(stages) and stages[s].gpu != sg.gpu:
            for g in (sg.gpu, stages[s].gpu):
                static[g] += 2 * size[sg.last]
    peaks = list(static)
    for s, sg in enumerate(stages, 1):
        g = sg.gpu
        whole = sum(x(k) for k in range(sg.first, sg.last + 1))
        for op in ("F", "B"):
            for m in range(n_mb):
                now = start((op, s), m)
                base = static[g]
                for s2, sg2 in enumerate(stages, 1):
                    if sg2.gpu != g:
                        continue
                    for m2 in range(n_mb):
                        if op == "F" and (s2, m2) == (s, m):
                            continue
                        if start(("F", s2), m2) <= now + eps < \
                                start(("B", s2), m2) + dur[("B", s2)]:
                            base += sum(x(k) for k in range(sg2.first, sg2.last + 1))
                for s2 in range(1, len(stages)):  # data waiting on the same GPU
                    if stages[s2 - 1].gpu != g or stages[s2].gpu != g:
                        continue
                    for prod, cons in ((("F", s2), ("F", s2 + 1)), (("B", s2 + 1), ("B", s2))):
                        if (op, s) in (prod, cons):
                            continue
                        for m2 in range(n_mb):
                            if start(prod, m2) + dur[prod] <= now + eps < start(cons, m2):
                                base += size[stages[s2 - 1].last]
                held = []
                if op == "F":
                    for k in range(sg.first, sg.last + 1):
                        before = sum(x(q) for q in range(sg.first, k))
                        held.append(before + size[k - 1] + c.saved_size[k - 1]
                                    + c.fwd_overhead[k - 1])
                else:  # base has the micro-batch's whole stash
                    if sg.last == n:
                        held.append(size[n] + c.loss_bwd_overhead)
                    for k in range(sg.last, sg.first - 1, -1):
                        freed = sum(x(q) for q in range(k + 1, sg.last + 1))
                        tape_out = size[k] if k < n else 0  # a^k, left to x(k + 1)
                        held.append(size[k] + size[k - 1] + c.bwd_overhead[k - 1]
                                    + c.weight_size[k - 1] + tape_out - freed)
                    assert whole >= 0
                peaks[g] = max(peaks[g], base + max(held))
                if at is not None:
                    at[(op, s, m)] = base + max(held)
    return peaks


@st.composite
def plans(draw):
    """A problem with temporaries and a plan of it: 1F1B* on the equal split, the same with
    one stage per layer, or CP-SAT's optimum without a memory limit (any allocation)."""
    problem = draw(temp_problems(n_max=4))
    kind = draw(st.sampled_from(["equal", "split", "cpsat"]))
    if kind == "cpsat":
        free = replace(problem, memory_per_gpu=10**6)
        result = solve(free, "cpsat", options=OPTS)
        return problem, PipelinePlan.from_strings(result.plan)
    plan = equal_split_plan(problem, draw(st.sampled_from([0.0, 0.3, 1.0])))
    if kind != "split":
        return problem, plan
    plan = split_stages(problem, plan)  # a layer's forward may start a period later: wrap
    tasks = tuple(replace(t, start=t.start - plan.period, shift=t.shift - 1)
                  if t.start >= plan.period else t for t in plan.tasks)
    return problem, replace(plan, tasks=tasks)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=plans())
def test_simulator_peak_equals_layer_by_layer_count(case):
    problem, plan = case
    sim = simulate_pipeline(problem, plan)
    at: dict = {}
    assert list(sim.peaks) == independent_peaks(problem, plan, sim.microbatches, at=at)
    assert sim.task_memory == at
    plain = simulate_pipeline(replace(problem, temporaries=False), plan)
    assert all(p >= q for p, q in zip(sim.peaks, plain.peaks, strict=True))


def test_task_memory_of_madpipes_rank_1_is_the_hand_count():
    """``task_memory`` at the peak of GPU 1 of MadPipe's plan of the ``--temporaries`` bench
    (``benchmarks/results/pipeline_runtime.md``, stop 56 ``rank1``): the backward of layer 5
    on micro-batch 2, counted by hand in KiB (``run_plan`` measures the same 1409)."""
    act, w = 64 * 1024, 257 * 1024  # a 64 x 256 activation; Linear(256, 256) weight + bias
    fwd = [1.0, 0.25] * 3 + [1.0]
    chain = Chain.from_lists(fwd, [2 * t for t in fwd], [act] * 7, [act] * 7, input_size=act,
                             weight_size=[w, 0] * 3 + [w], loss_bwd_time=0.25,
                             loss_bwd_overhead=act + 4)
    problem = PipelineProblem(chain, 2, 2**34, weight_copies=0, memory_model="strict",
                              temporaries=True)
    plan = forwards_ahead_plan()
    sim = simulate_pipeline(problem, plan, microbatches=8)
    kib = {key: v // 1024 for key, v in sim.task_memory.items()}
    buffers = 2 * 64  # the cut after layer 4
    mb2 = 64 + 64 + 64 + (257 + 64)  # stash a4, delta5 + delta4, weight gradient + a5
    mb3 = 64 + 64 + 64  # stashes a4, a5; delta6 waits for B 3
    mb4 = 64 + 64 + 128  # stashes a4, a5, a6 + a7 (layer 7 keeps its output for the loss)
    mb5 = 64 + 64 + 64  # stashes a4, a5; a6 waits for F 4
    mb6 = 64 + 64  # stash a4; a5 waits for F 3
    assert kib[("B", 2, 2)] == buffers + mb2 + mb3 + mb4 + mb5 + mb6 == 1409
    assert sim.peaks[1] == max(v for (_, s, _), v in sim.task_memory.items() if s > 1) \
        == 1409 * 1024
    assert set(sim.task_memory) == {(op, s, m) for op in "FB" for s in range(1, 5)
                                    for m in range(8)}


def store_all_op_peaks(chain: Chain) -> list[int]:
    """The checkpoint simulator's peak of each op of the store-all schedule of ``chain``
    (``F_all 1..L``, ``Loss``, ``B L..1``), each ``B k`` plus its weight gradient."""
    n = chain.length
    ops = [f"F_all {k}" for k in range(1, n + 1)] + ["Loss"] \
        + [f"B {k}" for k in range(n, 0, -1)]
    steps = simulate_checkpoint(chain, ops).timeline
    return [st.peak + (chain.weight_size[int(st.op.split()[1]) - 1]
                       if st.op.startswith("B ") else 0) for st in steps]


def test_one_gpu_backward_keeps_its_output_as_the_checkpoint_simulator():
    """Until stop 54 the backward of layer k < L was charged its tape without its output
    a_k (the stash leaves a_k to layer k + 1, freed by B_{k+1}), though the tape holds it
    (Tanh, ReLU, Sigmoid save their result) and the checkpoint simulator's ``B k`` counts
    it: here 18 where store-all's ``B 1`` holds 19 (with its weight gradient 22)."""
    chain = Chain.from_lists([3, 2], [3, 2], [4, 0], [6, 0], input_size=3,
                             weight_size=[3, 0], fwd_overhead=[0, 3], bwd_overhead=[3, 3],
                             loss_bwd_overhead=1)
    problem = PipelineProblem(chain, 1, 10**6, weight_copies=0, memory_model="strict",
                              temporaries=True)
    out = solve(problem, "contiguous", options=OPTS)
    assert max(store_all_op_peaks(chain)) == 22
    assert out.peak_memory == 22


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_gpu_peak_is_the_store_all_checkpoint_peak_with_weight_gradients(data):
    """One GPU, one stage, no weight copies: one micro-batch is in flight, so the strict
    peak with temporaries is the checkpoint simulator's store-all peak, each ``B k`` with
    its weight gradient (the pipeline's other terms are 0 here)."""
    chain = chain_of(data.draw, 5)
    problem = PipelineProblem(chain, 1, 10**6, weight_copies=0, memory_model="strict",
                              temporaries=True)
    out = solve(problem, "contiguous", options=OPTS)
    assert out.peak_memory == max(store_all_op_peaks(chain))


# ------------------------------------------------------------------ every method
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=temp_problems(), name=st.sampled_from(sorted(METHODS)))
def test_every_method_respects_the_temporaries(problem, name):
    """A plan replays within the memory (temporaries counted) at its claimed period; no
    method reports a plan that fits only without them."""
    out = run(problem, name)
    if out.status.has_plan:
        check(problem, out)
        assert out.report["memory_model"] == "strict" and out.report["temporaries"] is True
        assert out.bound <= out.objective + 1e-6
    else:
        assert out.status in (Status.INFEASIBLE, Status.NO_SOLUTION), out.report


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problem=temp_problems())
def test_exact_methods_equal_brute_force_and_never_beat_the_plain_optimum(problem):
    """ILP, CP-SAT and the decomposition prove the brute-force optimum over allocations
    (each allocation's fixed-allocation CP-SAT optimum); it is never below the plain strict
    optimum (memory only grows), and the memory-free bound holds for both."""
    expected = brute_force(problem)
    plain = solve(replace(problem, temporaries=False), "cpsat", options=OPTS)
    for name in ("cpsat", "ilp", "cpsat-benders"):
        out = run(problem, name)
        if math.isinf(expected):
            assert out.status is Status.INFEASIBLE, (name, out.report)
            continue
        assert out.status is Status.OPTIMAL, (name, out.report)
        assert out.objective == pytest.approx(expected, abs=1e-5)
        check(problem, out)
        assert plain.status is Status.OPTIMAL
        assert plain.objective <= out.objective + 1e-6
        assert lower_bound(problem) == lower_bound(replace(problem, temporaries=False))
        assert lower_bound(problem) <= out.objective + 1e-6


def test_last_stage_check_counts_the_loss():
    """One GPU, one layer: the backward holds delta_L with the larger of the loss step's
    and B_L's temporaries; a memory one below that has no plan, the plain model has one."""
    chain = Chain.from_lists([1], [1], [4], [4], input_size=2, loss_bwd_overhead=9,
                             bwd_overhead=[1], weight_size=[1])
    # weights 3 x 1; stash x = a_0 + tape = 6; loss: 6 + 4 + 9 = 19; B: 6 + 4 + 2 + 1 + 1
    fits = PipelineProblem(chain, 1, 3 + 19, memory_model="strict", temporaries=True)
    out = solve(fits, "cpsat", options=OPTS)
    check(fits, out)
    assert out.peak_memory == 3 + 19
    tight = replace(fits, memory_per_gpu=3 + 18)
    for name in ("cpsat", "ilp", "contiguous", "madpipe"):
        assert not run(tight, name).status.has_plan
    assert solve(replace(tight, temporaries=False), "cpsat", options=OPTS).status.has_plan


# ------------------------------------------------------------------ CLI
@pytest.fixture
def chain_file(tmp_path):
    path = tmp_path / "t.json"
    Chain.from_lists([1, 2, 1], [2, 2, 1], [3, 2, 4], [4, 2, 4], input_size=2,
                     fwd_overhead=[2, 1, 3], bwd_overhead=[1, 2, 2], loss_bwd_overhead=5,
                     name="T").save(path)
    return path


def cli(capsys, *argv):  # noqa: ANN001, ANN201
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", ["solve", "compare", "sweep", "export-csv"])
def test_cli_temporaries_needs_strict(capsys, chain_file, tmp_path, command):
    extra = {"solve": [], "compare": ["--methods", "contiguous"], "sweep": ["-q"],
             "export-csv": ["-o", str(tmp_path / "s.csv")]}[command]
    memory = "40:60:10" if command == "sweep" else "40"
    code, out, err = cli(capsys, command.split("-")[0], "pipeline", str(chain_file), "-m",
                         memory, "--gpus", "2", "--temporaries", *extra)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "field 'temporaries'" in err and "strict" in err
    assert not (tmp_path / "s.csv").exists()


def test_cli_temporaries_of_another_problem(capsys, chain_file):
    code, _, err = cli(capsys, "solve", "checkpoint", str(chain_file), "-m", "40",
                       "--temporaries")
    assert code == 2 and "field '--temporaries'" in err and "not of checkpoint" in err


def test_cli_solve_and_verify_with_temporaries(capsys, chain_file, tmp_path):
    base = ("pipeline", str(chain_file), "--gpus", "2", "--memory-model", "strict")
    code, out, err = cli(capsys, "solve", *base, "-m", "1000", "--temporaries", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["report"]["temporaries"] is True
    assert result["report"]["memory_model"] == "strict"
    code, out, _ = cli(capsys, "solve", *base, "-m", "1000", "--json")
    plain = json.loads(out)
    assert "temporaries" not in plain["report"]
    assert result["peak_memory"] > plain["peak_memory"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    code, out, err = cli(capsys, "verify", *base, "-m", "1000", "--temporaries", str(path),
                         "--json")
    assert code == 0, err
    checked = json.loads(out)
    assert checked["peak_memory"] == result["peak_memory"] and checked["temporaries"] is True
    # the plan's peak with temporaries is above the memory: verify refuses it with them, and
    # without the flag too (since stop 55 the result's recorded temporaries are replayed;
    # before, it replayed without them and said valid); its ops alone replay without them
    limit = str(result["peak_memory"] - 1)
    code, out, err = cli(capsys, "verify", *base, "-m", limit, "--temporaries", str(path))
    assert code != 0 and "above the memory" in (out + err)
    code, out, err = cli(capsys, "verify", *base, "-m", limit, str(path))
    assert code == 2 and "above the memory" in err and "temporaries true" in err
    path.write_text(json.dumps(result["plan"]))
    code, out, err = cli(capsys, "verify", *base, "-m", limit, str(path))
    assert code == 0, err


def test_train_pipeline_refuses_temporaries_with_stash(capsys):
    """``train-pipeline --temporaries`` without ``--memory-model strict``: exit 2 before any
    process group or profile (outside torchrun too)."""
    pytest.importorskip("torch", reason="train-pipeline needs torch")
    code, out, err = cli(capsys, "train-pipeline", "toy-resnet", "--temporaries")
    assert code == 2 and out == "" and "field 'temporaries'" in err
