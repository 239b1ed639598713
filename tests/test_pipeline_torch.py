"""Pipeline plans on torch.distributed.pipelining (gloo, CPU processes): gradients match.

Contiguous and non-contiguous plans (MadPipe, the exact CP-SAT model) run on PyTorch's
pipeline runtime with the plan's own action list, or with the action list loaded from the
plan's exported CSV; optmem's own point-to-point runner runs the same plans. Each gives the
single-process gradients and losses, tied weights (a GPT-2 embedding and head split over
ranks or on one rank) included. ``op.pipeline`` (the one call) gives the same plan on every
rank even when ranks measure different times.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the pipeline executor needs torch")

import distributed_workers as w  # noqa: E402
from pipeline_helpers import forwards_ahead_plan  # noqa: E402

from optmem.chain import Chain  # noqa: E402
from optmem.cli import main  # noqa: E402
from optmem.errors import OptmemInputError, PlanError  # noqa: E402
from optmem.pipeline_plan import PipelinePlan  # noqa: E402
from optmem.pipeline_schedule import (  # noqa: E402
    held_sends,
    rank_messages,
    rank_programs,
    write_schedule_csv,
)
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.pytorch import pipelining  # noqa: E402
from optmem.pytorch.distributed import spawn  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402

pytestmark = pytest.mark.distributed


def plan_for(costs: list[float], gpus: int, method: str, memory: int = 10**6) -> PipelinePlan:
    """A plan for a chain of unit-size layers with forward = backward = cost / 2."""
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [1] * len(costs), [1] * len(costs), input_size=1)
    problem = PipelineProblem(chain, gpus, memory)
    result = solve(problem, method)  # no limit: small instances, proven in well under a second
    assert result.status.has_plan, result.report
    return PipelinePlan.from_strings(result.plan)


def non_contiguous(plan: PipelinePlan) -> bool:
    gpus = [st.gpu for st in plan.stages]
    return any(g in gpus[:k] and gpus[k - 1] != g for k, g in enumerate(gpus))


def job(model: str, plan: PipelinePlan, runner: str = "runtime", microbatches: int = 4,
        **extra) -> dict:
    rows = 2 * microbatches
    return {"kind": "pipeline", "model": model, "plan": plan.to_dict(), "runner": runner,
            "microbatches": microbatches, "rows": rows, **extra}


def check_pipeline_jobs(jobs: list[dict], world: int, tmp_path) -> None:
    """Run the jobs on ``world`` ranks; every gradient equals the single-process one."""
    spawn(w.run_jobs, world, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for k, spec in enumerate(jobs):
        grads, losses = w.reference_grads(spec["model"], spec["microbatches"], spec["rows"],
                                          mean=False)
        got_losses: list[float] = []
        seen: set[str] = set()
        for rank in range(world):
            data = w.load(str(tmp_path), rank, k)
            got_losses += data["losses"]
            for name, g in data["grads"].items():  # a tied weight lives on several ranks
                torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-6)
                seen.add(name)
        assert seen == set(grads), f"job {k}: no rank holds {set(grads) - seen}"
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert all(math.isfinite(v) for v in got_losses)


def test_plans_on_two_ranks_match_single_process(tmp_path):
    """Non-contiguous optima (CP-SAT, MadPipe: stages 1 and 3 on rank 0) and contiguous plans,
    on PyTorch's runtime and on optmem's runner; the MadPipe plan of the tied GPT-2 (embedding
    and head on one rank) from its CSV, the contiguous one with them on two ranks, on both
    runners (optmem's runner left each rank the part of the tied gradient its stages made,
    0.84 off here, until stop 53)."""
    general = plan_for([1, 2, 1], 2, "cpsat")
    contiguous = plan_for([1, 1, 1, 1, 1, 1], 2, "contiguous")
    gpt_contiguous = plan_for([1, 2, 2, 2, 1], 2, "contiguous")
    # the MadPipe plan and its CSV as a user makes them: optmem solve / optmem export
    chain = Chain.from_lists([0.5, 1, 1, 1, 0.5], [0.5, 1, 1, 1, 0.5], [1] * 5, [1] * 5,
                             input_size=1)
    chain.save(tmp_path / "chain.json")
    csv = tmp_path / "madpipe.csv"
    options = ["pipeline", str(tmp_path / "chain.json"), "--gpus", "2", "--memory", "1000000",
               "--method", "madpipe"]
    assert main(["solve", *options, "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["export", *options, "--microbatches", "4", "-o", str(csv)]) == 0
    madpipe = PipelinePlan.from_any((tmp_path / "plan.json").read_text())
    assert non_contiguous(general) and non_contiguous(madpipe)
    assert madpipe.stages[0].gpu == madpipe.stages[-1].gpu  # tied weight on one rank
    assert gpt_contiguous.stages[0].gpu != gpt_contiguous.stages[-1].gpu  # on two ranks
    jobs = [job("mlp3", general), job("mlp3", general, "p2p"), job("mlp", contiguous),
            job("gpt", madpipe, csv=str(csv)), job("gpt", gpt_contiguous),
            job("mlp", contiguous, "p2p"), job("gpt", gpt_contiguous, "p2p")]
    check_pipeline_jobs(jobs, 2, tmp_path)


def test_plans_on_four_ranks_match_single_process(tmp_path):
    """A non-contiguous CP-SAT optimum; the tied GPT-2 split equally (embedding on rank 0,
    head on rank 3) and by the contiguous optimum (3 stages: rank 3 idle, head on rank 2)."""
    general = plan_for([1, 2, 1, 1, 2, 1], 4, "cpsat")
    equal = plan_for([1, 2, 2, 2, 1], 4, "equal")
    idle = plan_for([1, 2, 2, 2, 1], 4, "contiguous")
    assert non_contiguous(general)
    assert [st.gpu for st in equal.stages] == [0, 1, 2, 3]
    assert [st.gpu for st in idle.stages] == [0, 1, 2]
    jobs = [job("mlp", general, microbatches=6), job("gpt", equal), job("gpt", idle)]
    check_pipeline_jobs(jobs, 4, tmp_path)


def test_a_stage_boundary_at_a_transposed_view_runs(tmp_path):
    """gloo sends and receives contiguous tensors only, and PyTorch's runtime made its
    receive buffers with the strides of the sender's output (a transposed view) and of the
    receiver's input gradient (transposed back: ViT's patch embedding,
    ``flatten(2).transpose(1, 2)``, between two ranks): the step failed with "input tensor
    has to be contiguous" on one rank while the other waited for the group's timeout. Both
    runners now give the single-process gradients."""
    plan = plan_for([1, 1, 1, 1], 2, "contiguous")
    assert [(st.first, st.last) for st in plan.stages] == [(1, 2), (3, 4)]
    check_pipeline_jobs([job("transposing", plan), job("transposing", plan, "p2p")], 2,
                        tmp_path)


def test_running_statistics_take_each_micro_batch_once(tmp_path):
    """At its first step PyTorch's runtime runs every stage's forward once more to learn
    the shapes: on the first micro-batch on the first rank, on uninitialised tensors on the
    others. BatchNorm's running statistics took it in (HF's ResNet on 2 ranks: NaN and inf
    on rank 1, an extra update on rank 0). Now each rank's BatchNorm layers hold the
    statistics of single-process training over the micro-batches, on both runners."""
    plan = plan_for([1] * 6, 2, "contiguous")
    assert [(st.first, st.last) for st in plan.stages] == [(1, 3), (4, 6)]
    jobs = [job("batchnorm", plan), job("batchnorm", plan, "p2p")]
    check_pipeline_jobs(jobs, 2, tmp_path)
    build, data, loss_fn = w.MODELS["batchnorm"]
    model = build()
    x, y = data(8)
    for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
        loss_fn(model(xm), ym).backward()
    want = dict(model.named_buffers())
    for k in range(len(jobs)):
        ranks = [w.load(str(tmp_path), r, k)["buffers"] for r in range(2)]
        assert {n for n in ranks[0]} == {n for n in want if n.startswith("1.")}, k
        assert {n for n in ranks[1]} == {n for n in want if n.startswith("4.")}
        for got in ranks:
            for name, value in got.items():
                torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7)


def test_stages_on_different_ranks_draw_different_dropout_masks(tmp_path):
    """With the same seed on every rank (the same weights), each rank drew its dropout
    masks from its global generator, so rank 1's repeated rank 0's: two Dropout(0.5) on
    two ranks kept half the units (0.502), single-process training a quarter. Each stage
    now draws from its own stream: a quarter, and the same masks on both runners."""
    plan = plan_for([1, 1, 1, 1], 2, "contiguous")
    assert [(st.first, st.last) for st in plan.stages] == [(1, 2), (3, 4)]
    jobs = [job("dropout", plan, microbatches=8), job("dropout", plan, "p2p", microbatches=8)]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    runtime, p2p = (w.load(str(tmp_path), 1, k)["losses"] for k in range(2))
    assert len(runtime) == 8 and runtime == p2p
    assert abs(sum(runtime) / 8 - 0.25) < 0.05


def test_a_stage_stream_seeds_no_other_device(monkeypatch):
    """A stage's random stream was seeded with ``torch.manual_seed``, which seeds every GPU
    (``torch.cuda.manual_seed_all``; queued until CUDA starts when it has not), while
    ``fork_rng`` restores only the stage's device: building the stream re-seeded the
    process' other GPUs, and on the CPU every GPU once CUDA started, with the stage's seed.
    Now the CPU generator and the stage's device's are seeded, and the global ones are
    left as they were (a stage on a faked ``cuda:1`` of a two-GPU process here)."""
    from optmem.pytorch.pipelining import _StageStream

    seeded: list[Any] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(("all", seed)))
    cpu = torch.get_rng_state()
    stream = _StageStream(1, torch.device("cpu"), 7)
    assert seeded == [] and stream.state.devices == []
    assert torch.equal(torch.get_rng_state(), cpu)  # the caller's CPU state is kept

    class Generator:  # a GPU's default generator (none here)
        def __init__(self, index: int) -> None:
            self.index = index

        def manual_seed(self, seed: int) -> None:
            seeded.append((self.index, seed))

    real = torch.random.fork_rng
    monkeypatch.setattr(torch.random, "fork_rng",
                        lambda devices=None, **kw: real(devices=[], **kw))  # the CPU only
    monkeypatch.setattr(torch.cuda, "default_generators", (Generator(0), Generator(1)))
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda d=None: torch.tensor([d], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, d=None: None)
    on_gpu = _StageStream(1, torch.device("cuda", 1), 7)
    assert [d for d, _ in seeded] == [1] and on_gpu.state.devices == [1]
    with stream.running():  # same stage and base: the same CPU stream on any device
        a = torch.rand(4)
    with on_gpu.running():
        assert torch.equal(torch.rand(4), a)


def test_each_call_of_a_runner_draws_new_dropout_masks(tmp_path):
    """Stop 56 seeded each stage's stream from ``torch.initial_seed()`` when the runner was
    built, and ``run_plan`` and ``run_plan_pipelining`` build theirs at every call: a training
    loop drew the same dropout masks at every step (the kept fractions of two calls were
    equal). A call's streams now start from one draw of the global generator: new masks at
    each call, still the same on both runners."""
    plan = plan_for([1, 1, 1, 1], 2, "contiguous")
    jobs = [job("dropout", plan, microbatches=4, calls=2),
            job("dropout", plan, "p2p", microbatches=4, calls=2)]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    runtime, p2p = (w.load(str(tmp_path), 1, k)["losses"] for k in range(2))
    assert len(runtime) == 8 and runtime == p2p
    assert runtime[:4] != runtime[4:]


def test_run_plan_trains_after_a_frozen_first_stage(tmp_path):
    """A first stage whose layers are all frozen (a frozen embedding) outputs a tensor that
    needs no gradient: ``run_plan`` called ``backward`` on it at the stage's backward and
    failed ("element 0 of tensors does not require grad") while the other rank lost its
    peer; PyTorch's runtime skips it. The stage's backward now has nothing to do: both
    runners give the single-process gradients (none for the frozen layers)."""
    plan = plan_for([1] * 6, 2, "contiguous")
    assert [(st.first, st.last) for st in plan.stages] == [(1, 3), (4, 6)]
    check_pipeline_jobs([job("mlp-frozen-first", plan), job("mlp-frozen-first", plan, "p2p")],
                        2, tmp_path)


def test_run_plan_takes_a_last_stage_that_returns_a_tuple(tmp_path):
    """The last stage's output goes to ``loss_fn`` only, but ``run_plan`` dry-ran every
    stage for the shapes of its messages and failed on a head returning a tuple
    (``AttributeError: 'tuple' object has no attribute 'shape'`` on every rank; review of
    stop 56). Both runners now give the single-process gradients."""
    plan = plan_for([1] * 5, 2, "contiguous")
    assert plan.stages[-1].last == 5  # the tuple head is in the last stage
    check_pipeline_jobs([job("mlp-pair-head", plan), job("mlp-pair-head", plan, "p2p")], 2,
                        tmp_path)


def test_run_plan_names_a_stage_that_would_send_a_tuple():
    """A stage before the last that returns a tuple: one input error naming it and the
    runner that sends tuples (it was an ``AttributeError`` on every rank)."""
    model = w.pair_head_mlp()
    modules = [model[:4], model[4:]]
    with pytest.raises(OptmemInputError, match="stage 1 of the plan returns a tuple"):
        pipelining._shapes([model, torch.nn.Identity()], torch.zeros(2, 8))
    assert len(pipelining._shapes(modules, torch.zeros(2, 8))) == 1


def test_a_frozen_tied_weight_gets_no_gradient(tmp_path):
    """A tied weight held on two ranks got a zero gradient after every step even when it
    was frozen (in one process it has none), so an optimizer over ``piped.parameters()``
    stepped it: AdamW's weight decay moved BERT MLM's frozen tied embedding. Frozen, it
    now has no gradient on either rank, on both runners."""
    plan = plan_for([1] * 5, 2, "contiguous")
    gpus = [st.gpu for st in plan.stages]
    assert gpus[0] != gpus[-1]  # the embedding and the head (tied) on two ranks
    check_pipeline_jobs([job("gpt-frozen-tie", plan), job("gpt-frozen-tie", plan, "p2p")], 2,
                        tmp_path)
    for k in range(2):
        for rank in range(2):
            assert "embed.wte.weight" not in w.load(str(tmp_path), rank, k)["grads"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_run_plan_drops_a_sent_message_once_its_receiver_has_it(world, tmp_path):
    """On gloo a send completes in ``wait()`` only, and ``run_plan`` held every message it
    sent until the step ended (8 of 8 on each rank of the contiguous plan). It now waits on
    a send where the static schedule shows the receiver has it, which cannot wait for a peer:
    every plan runs to the end (no deadlock) with the single-process gradients, and no rank
    holds more sends than :func:`held_sends` computes from the plan (2 of 8 there). The
    2-rank plans of the other tests, a 3-rank MadPipe plan with an interleaved GPU (stages
    3, 4 and 6) and a 4-rank CP-SAT optimum. Where no message tells a rank that its send
    arrived (rank 0 of MadPipe's forwards-ahead plan runs 7 forwards before its first
    backward: rank 1 held 7 of its 8 gradients), it waits on the send once it would hold
    more than the plan's two buffers of the cut (``RankStep.wait``; 3 at most, counting the
    one just sent), which cannot deadlock either."""
    ranks = {2: [job("mlp", plan_for([1] * 6, 2, "contiguous"), "p2p", microbatches=8),
                 job("mlp3", plan_for([1, 2, 1], 2, "cpsat"), "p2p"),
                 job("gpt", plan_for([1, 2, 2, 2, 1], 2, "madpipe"), "p2p", microbatches=8),
                 job("mlp", forwards_ahead_plan(first_layers=3), "p2p", microbatches=8)],
             3: [job("mlp", plan_for([1, 2, 1, 1, 2, 1], 3, "madpipe", memory=60), "p2p",
                     microbatches=6)],
             4: [job("mlp", plan_for([1, 2, 1, 1, 2, 1], 4, "cpsat"), "p2p", microbatches=6)]}
    jobs = ranks[world]
    plans = [PipelinePlan.from_dict(spec["plan"]) for spec in jobs]
    assert world == 2 or all(non_contiguous(plan) for plan in plans)
    check_pipeline_jobs(jobs, world, tmp_path)
    for k, (spec, plan) in enumerate(zip(jobs, plans, strict=True)):
        steps = rank_messages(plan, spec["microbatches"])
        for rank in range(world):
            assert w.load(str(tmp_path), rank, k)["held"] <= held_sends(steps[rank]), (k, rank)
    if world == 2:
        steps = rank_messages(plans[0], 8)
        assert [held_sends(steps[g]) for g in (0, 1)] == [2, 2]
        assert all(sum(st.send is not None for st in steps[g]) == 8 for g in (0, 1))
        assert [w.load(str(tmp_path), g, 3)["held"] for g in (0, 1)] == [7, 3]


def test_run_plan_holds_no_stage_output_or_loss_to_its_backward(tmp_path):
    """Rank 1 of MadPipe's plan of the ``--temporaries`` bench (GPU 0: layers 1-4; GPU 1:
    stages of layers 5, 6 and 7) used 1537 KiB where its plan (strict + temporaries) says
    1409 (stop 56, hunt ``rank1``): ``run_plan`` kept each stage's output to the stage's
    backward (the root of ``backward()``), so the last stage held every micro-batch's
    loss, which for ``mse_loss`` keeps its 64 KiB of squared errors, and its loop variables
    held the last output, loss and waited send into the next operation. It now keeps the
    output's gradient edge: rank 1 uses 1409 KiB, rank 0 1281 (1345 before), with the
    single-process gradients and losses. Measured: every storage the step creates, alive
    at once (deterministic)."""
    from optmem.pytorch.api import profile_chain
    from optmem.simulate.pipeline import simulate_pipeline

    plan = forwards_ahead_plan()
    x, y = w.wide_data(64)
    chain = profile_chain(w.wide_mlp(), x, repeats=1, warmup=0, progress=False,
                          loss_fn=lambda out: torch.nn.functional.mse_loss(out, y))
    fwd = tuple(1.0 if size else 0.25 for size in chain.weight_size)  # the bench's times
    chain = replace(chain, fwd_time=fwd, bwd_time=tuple(2 * t for t in fwd),
                    loss_bwd_time=0.25)
    problem = PipelineProblem(chain, 2, 2**34, weight_copies=0, memory_model="strict",
                              temporaries=True)
    planned = simulate_pipeline(problem, plan).peaks
    assert planned == (2305 * 1024, 1409 * 1024)
    jobs = [{"kind": "pipeline_peak", "model": "wide", "plan": plan.to_dict(),
             "microbatches": 8, "rows": 8 * 64}]
    check_pipeline_jobs(jobs, 2, tmp_path)
    peaks = [w.load(str(tmp_path), rank, 0)["peak"] for rank in range(2)]
    assert all(p <= q for p, q in zip(peaks, planned, strict=True)), (peaks, planned)
    assert peaks == [1281 * 1024, 1409 * 1024]


def test_a_backward_root_keeps_no_output_storage():
    """``run_plan`` starts a stage's backward from the output's gradient edge: the loss's
    storage (``mse_loss`` keeps its squared errors there: 4 x 8 floats for one element)
    goes once the caller drops the loss, and the gradients are bitwise those of
    ``loss.backward()``. A loss of more than one element is refused at its forward."""
    import weakref

    lin = torch.nn.Linear(8, 8)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.nn.functional.mse_loss(lin(x), y).backward()
    expected = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(lin(x), y)
    storage = weakref.ref(loss.untyped_storage())
    assert loss.untyped_storage().nbytes() == 4 * 8 * 4
    root = pipelining._Root.of(loss, loss=True)
    del loss
    assert storage() is None
    root.backward(None)
    assert all(torch.equal(p.grad, g) for p, g in zip(lin.parameters(), expected, strict=True))
    with pytest.raises(OptmemInputError, match="loss_fn returned a tensor of shape"):
        pipelining._Root.of(lin(x), loss=True)


def test_one_call_same_plan_on_every_rank(tmp_path):
    """``op.pipeline`` on the tied GPT-2 (MadPipe) and the MLP (contiguous): rank 1 measures a
    30x slower layer, yet both ranks run rank 0's plan, with the single-process gradients
    of the whole batch (mean over micro-batches)."""
    jobs = [{"kind": "one_call", "model": "gpt", "method": "madpipe", "microbatches": 4,
             "rows": 8, "slow_layer": 1},
            {"kind": "one_call", "model": "mlp", "method": "contiguous", "microbatches": 4,
             "rows": 8, "slow_layer": 4}]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for k, spec in enumerate(jobs):
        grads, losses = w.reference_grads(spec["model"], spec["microbatches"], spec["rows"],
                                          mean=True)
        ranks = [w.load(str(tmp_path), r, k) for r in range(2)]
        assert ranks[0]["plan"] == ranks[1]["plan"] and ranks[0]["period"] == ranks[1]["period"]
        assert sorted(ranks[0]["stages"] + ranks[1]["stages"]) == \
            list(range(sum(1 for op in ranks[0]["plan"] if op.startswith("stage"))))
        for data in ranks:
            for name, g in data["grads"].items():
                torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-6)
        assert set(ranks[0]["grads"]) | set(ranks[1]["grads"]) == set(grads)
        assert ranks[0]["losses"] + ranks[1]["losses"] == pytest.approx(losses, rel=1e-5)
        # planned alone, the ranks would disagree: rank 0's plan is the one both ran
        alone = [local_plan(spec, rank) for rank in range(2)]
        assert alone[0] != alone[1] and tuple(ranks[0]["plan"]) == alone[0]


def check_one_call(jobs: list[dict], tmp_path) -> list[list[dict]]:
    """Run ``op.pipeline`` jobs on 2 ranks: one plan, the single-process gradients and losses
    (mean over micro-batches). Returns what each rank saved, per job."""
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    out = []
    for k, spec in enumerate(jobs):
        grads, losses = w.reference_grads(spec["model"], spec["microbatches"], spec["rows"],
                                          mean=True)
        ranks = [w.load(str(tmp_path), r, k) for r in range(2)]
        assert ranks[0]["plan"] == ranks[1]["plan"] and ranks[0]["gpus"] == ranks[1]["gpus"]
        for data in ranks:
            for name, g in data["grads"].items():  # a tied weight: on both ranks, reduced
                torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-6)
        assert set(ranks[0]["grads"]) | set(ranks[1]["grads"]) == set(grads)
        assert ranks[0]["losses"] + ranks[1]["losses"] == pytest.approx(losses, rel=1e-5)
        out.append(ranks)
    return out


def test_one_call_passes_temporaries(tmp_path):
    """``op.pipeline(..., memory_model="strict", temporaries=True)`` plans with them: the
    result says so, its peaks are the plan's replay under that problem (above the plain
    strict replay on the last rank: the loss step's ``delta_L``, the weight gradients), and
    training gives the single-process gradients. With the stash model: refused at once."""
    from optmem.simulate.pipeline import simulate_pipeline

    spec = {"kind": "one_call", "model": "mlp", "method": "contiguous", "microbatches": 4,
            "rows": 8, "slow_layer": 4, "memory_model": "strict", "temporaries": True}
    (ranks,) = check_one_call([spec], tmp_path)
    report = ranks[0]["report"]
    assert report["memory_model"] == "strict" and report["temporaries"] is True
    plan = PipelinePlan.from_strings(ranks[0]["plan"])
    problem = PipelineProblem(ranks[0]["chain"], 2, 2**30, bandwidth="10GB/s",
                              weight_copies=4, memory_model="strict", temporaries=True)
    with_t = simulate_pipeline(problem, plan).peaks
    plain = simulate_pipeline(replace(problem, temporaries=False), plan).peaks
    assert list(with_t) == report["peaks"] and ranks[0]["peak"] == max(with_t)
    last = plan.stages[-1].gpu
    assert with_t[last] > plain[last] and all(a >= b for a, b in zip(with_t, plain, strict=True))
    with pytest.raises(OptmemInputError, match="strict") as err:
        pipelining.pipeline(w.MODELS["mlp"][0](), torch.zeros(2, 8), temporaries=True)
    assert err.value.field == "temporaries"


def hf_job(model: str, method: str, slow: str, fast: str) -> dict:
    return {"kind": "one_call", "model": model, "method": method, "microbatches": 4,
            "rows": 8, "slow_layer": slow, "fast_ends": fast}


def test_one_call_on_huggingface_gpt2(tmp_path):
    """``op.pipeline`` on HuggingFace's GPT2LMHeadModel (tiny config, head tied to the token
    embedding), exported with torch.export, under 2 ranks: a MadPipe plan (non-contiguous:
    the embedding and the head on rank 0, the first block on rank 1; ``loss_fn`` on the
    logits) and a contiguous one with the model's own loss (``labels=``, the loss stage in the
    chain; the tied weight on both ranks, its gradient reduced between them). Rank 1 measures
    a slower block: both ranks still run rank 0's plan, with the single-process gradients."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    jobs = [hf_job("hf-gpt2", "madpipe", "transformer.h.1.mlp.c_fc.weight",
                   "transformer.wte.weight"),
            hf_job("hf-gpt2-labels", "contiguous", "transformer.h.1.mlp.c_fc.weight",
                   "transformer.wte.weight")]
    madpipe, contiguous = check_one_call(jobs, tmp_path)
    gpus = madpipe[0]["gpus"]
    assert non_contiguous(PipelinePlan.from_strings(madpipe[0]["plan"]))
    assert gpus[0] == gpus[-1]  # embedding and head (tied) on one rank
    gpus = contiguous[0]["gpus"]
    assert gpus == sorted(gpus) and gpus[0] != gpus[-1]  # tied weight on both ranks
    assert "transformer.wte.weight" in contiguous[0]["grads"]
    assert "transformer.wte.weight" in contiguous[1]["grads"]


def test_one_call_on_huggingface_llama(tmp_path):
    """A tiny LlamaForCausalLM (rotary cos/sin tables as side inputs of every attention
    stage, untied head) with its own loss: the single-process gradients on 2 ranks. A call
    of 6 rows for 4 micro-batches is the rows error on both ranks (it was "a micro-batch of
    this call differs from the sample", which did not name the rows)."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    (ranks,) = check_one_call([{**hf_job("hf-llama-labels", "madpipe",
                                         "model.layers.1.mlp.up_proj.weight",
                                         "model.embed_tokens.weight"), "short_batch": True}],
                              tmp_path)
    assert sorted(ranks[0]["stages"] + ranks[1]["stages"]) == list(range(len(ranks[0]["gpus"])))
    for data in ranks:
        assert "into 4 equal micro-batches along dimension 0, got 6 rows" in data["short"]


def test_one_call_on_huggingface_bart_with_carried_boundaries(tmp_path):
    """A tiny BartForConditionalGeneration: its decoder layers are cut with the encoder's
    output carried beside each boundary (a tuple between stages, sent between ranks), the
    single-process gradients on 2 ranks."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    (ranks,) = check_one_call([hf_job("hf-bart-labels", "contiguous",
                                      "model.decoder.layers.1.fc1.weight",
                                      "model.shared.weight")], tmp_path)
    assert ranks[0]["layers"] > 10  # 10 with the decoder in one stage (before 2026-11-30)
    assert sorted(ranks[0]["stages"] + ranks[1]["stages"]) == list(range(len(ranks[0]["gpus"])))


def local_plan(spec: dict, rank: int) -> tuple[str, ...]:
    """The plan ``rank`` of :func:`distributed_workers.one_call_job` would solve alone."""
    from optmem.pytorch.extract import extract_stages
    from optmem.pytorch.profile import profile_stages

    build, data, _ = w.MODELS[spec["model"]]
    stages = extract_stages(build())
    layers = [s.module for s in stages]

    def time_model(module, _x, _y):
        index = next(i for i, m in enumerate(layers) if m is module)
        return (30.0 if rank == 1 and index == spec["slow_layer"] else 1.0), 2.0

    sample = data(spec["rows"])[0].chunk(spec["microbatches"])[0]
    chain = profile_stages(stages, sample, repeats=1, warmup=0, time_model=time_model)
    problem = PipelineProblem(chain, 2, 2**30, "10GB/s", weight_copies=4)
    return solve(problem, spec["method"]).plan


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_one_call_on_two_gpus_with_nccl(tmp_path):
    """The one call on NCCL, one GPU per rank (``spawn`` picks NCCL when CUDA is present)."""
    spec = {"kind": "one_call", "model": "gpt", "method": "madpipe", "microbatches": 4,
            "rows": 8, "slow_layer": 1}
    spawn(w.run_jobs, 2, [spec], str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    grads, _ = w.reference_grads("gpt", 4, 8, mean=True)
    for rank in range(2):
        for name, g in w.load(str(tmp_path), rank, 0)["grads"].items():
            torch.testing.assert_close(g.cpu(), grads[name], rtol=1e-4, atol=1e-5)


def test_rank_programs_follow_the_pattern():
    plan = plan_for([1, 2, 1], 2, "contiguous")
    programs = rank_programs(plan, 4)
    assert sum(len(v) for v in programs.values()) == 2 * len(plan.stages) * 4
    for ops in programs.values():
        assert [o.time for o in ops] == sorted(o.time for o in ops)


def test_stage_modules_follow_the_flattened_chain():
    """A nested nn.Sequential head counts as its layers, as in the profile (was IndexError)."""
    model = w.tiny_gpt()
    plan = plan_for([1, 2, 2, 2, 1], 2, "madpipe")
    modules = pipelining.plan_stage_modules(model, plan)
    assert [len(m.layers) for m in modules] == [st.last - st.first + 1 for st in plan.stages]
    assert modules[-1].layers[0] is model.head.lm_head
    with pytest.raises(Exception, match="covers 5 chain layers but the model has 4"):
        pipelining.plan_stage_modules(w.tiny_gpt(blocks=1), plan)


def test_plans_that_do_not_partition_the_chain_are_refused():
    """A plan with a gap (layer 2 on no stage) built a 3-layer model of the 4 layers and
    trained it, one with overlapping stages ran layers 2-3 twice, one without tasks or on
    GPU -1 was taken too; the torch bridge now checks the structure as the simulator does."""
    model = pipelining.demo_model(8, 4)
    tasks = ["F 1 start 0 shift 1", "F 2 start 1 shift 1", "B 2 start 2 shift 0",
             "B 1 start 3 shift 0", "send 1 start 1 shift 1", "grad 1 start 3 shift 0"]
    cases = {"1-1 gpu 0|3-4 gpu 1": "stage 2 covers layers 3-4; expected a range starting "
                                    "at layer 2",
             "1-3 gpu 0|2-4 gpu 1": "stage 2 covers layers 2-4; expected a range starting "
                                    "at layer 4",
             "1-2 gpu -1|3-4 gpu 1": "stage 1 is on GPU -1; expected a GPU >= 0"}
    for stages, message in cases.items():
        ops = ["period 4", *(f"stage {k} layers {s}" for k, s in
                             enumerate(stages.split("|"), start=1)), *tasks]
        with pytest.raises(PlanError, match=message):
            pipelining.plan_stage_modules(model, PipelinePlan.from_strings(ops))
    bare = PipelinePlan.from_strings(["period 4", "stage 1 layers 1-2 gpu 0",
                                      "stage 2 layers 3-4 gpu 1"])
    with pytest.raises(PlanError, match="missing tasks: B 1, B 2, F 1, F 2, grad 1, send 1"):
        pipelining.plan_stage_modules(model, bare)
    good = PipelinePlan.from_strings(["period 4", "stage 1 layers 1-2 gpu 0",
                                      "stage 2 layers 3-4 gpu 1", *tasks])
    assert [len(m.layers) for m in pipelining.plan_stage_modules(model, good)] == [2, 2]


def test_result_and_its_plan_are_accepted():
    """``result.plan`` (as the docs show), the result itself and its JSON all give the plan."""
    chain = Chain.from_lists([1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], input_size=1)
    result = solve(PipelineProblem(chain, 2, 10**6), "contiguous")
    expected = PipelinePlan.from_strings(result.plan)
    for form in (result, result.plan, result.to_json(), expected.to_dict()):
        assert pipelining.as_pipeline_plan(form) == expected


def test_batches_the_runtime_cannot_run_are_one_error_on_every_rank(tmp_path):
    """PyTorch's runtime runs equal micro-batches, shaped as at the first step, and a CSV
    for as many micro-batches as the pipeline. A batch of 10 rows for 4 micro-batches, then
    (after a step of 8) one of 4 or 12 rows, failed inside the runtime on one rank (a shape
    error, "Expecting 4 arg_mbs but got 3") while the other waited for the group's timeout,
    or aborted it in gloo; a CSV for 8 micro-batches raised PyTorch's AssertionError; a step
    under no_grad PyTorch's advice to call eval(), which trains all the same; a step without
    the batch on the first stage's rank linear()'s TypeError. Each is now one input error on
    the ranks given the batch, before any message, and training goes on after it."""
    plan = plan_for([1] * 6, 2, "contiguous")
    csv = tmp_path / "eight.csv"
    write_schedule_csv(plan, 8, csv)
    spawn(w.run_jobs, 2, [{"kind": "pipeline_inputs", "plan": plan.to_dict(), "csv": str(csv)}],
          str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    grads, _ = w.reference_grads("mlp", 4, 8, mean=True)
    seen: set[str] = set()
    for rank in range(2):
        data = w.load(str(tmp_path), rank, 0)
        assert "does not fit this pipeline (4 micro-batches, 2 stages)" in data["csv"]
        assert "into 4 equal micro-batches along dimension 0, got 10 rows" in data["10 rows"]
        for name in ("4 rows", "12 rows"):
            assert "differ from the first step's ([2, 8] torch.float32)" in data[name]
        assert "outside torch.no_grad()" in data["no_grad"]
        assert data["8 rows"] == data["8 rows again"] == ""
        if rank == 0:  # was linear()'s TypeError on rank 0 and a timeout on rank 1
            assert "holds the pipeline's first stage: pass it the batch" in data["no call"]
        for name, g in data["grads"].items():  # two steps of the 8 rows, nothing else
            torch.testing.assert_close(g, 2 * grads[name], rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(grads)


class _Branchy(torch.nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it (torch.export can, given a call)."""

    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_run_plan_names_what_runs_a_module_it_cannot_extract():
    """``run_plan`` given a module torch.fx cannot trace (a HuggingFace model) repeated the
    extractor's advice, "Give a sample batch", which it takes none of (stop 56 hunt on
    Qwen2ForCausalLM); it now names the runtime's entry points that take one."""
    plan = plan_for([1], 1, "contiguous")
    xs = [torch.zeros(2, 4)]
    with pytest.raises(OptmemInputError, match="run_plan takes no sample") as err:
        pipelining.run_plan(_Branchy(), plan, xs, xs, torch.nn.functional.mse_loss)
    assert err.value.field == "module"
    assert "PipelinedModel(model, plan, sample=one_micro_batch_call" in str(err.value)
    assert "torch.fx cannot trace it" in str(err.value)  # the extractor's reason, kept


def test_micro_batch_counts_and_sizes_are_checked_before_any_rank_works():
    """``microbatches=0`` silently became the default (twice the stages); micro-batches of
    different sizes given to the runners failed inside a rank. Both are input errors now,
    raised before the process group is used."""
    plan = plan_for([1, 1, 1], 2, "contiguous")
    model = pipelining.demo_model(8, 3)
    with pytest.raises(OptmemInputError, match=r"field 'microbatches': .*got 0"):
        pipelining.PipelinedModel(model, plan, microbatches=0)
    xs = [torch.zeros(2, 8), torch.zeros(3, 8)]
    ys = [torch.zeros(2, 1), torch.zeros(3, 1)]
    for runner in (pipelining.run_plan, pipelining.run_plan_pipelining):
        with pytest.raises(OptmemInputError, match=r"micro-batch 1 is \[3, 8\] torch.float32"):
            runner(model, plan, xs, ys, torch.nn.functional.mse_loss)


def test_default_device_without_local_rank_is_the_current_one(monkeypatch):
    """Under NCCL without ``LOCAL_RANK`` (a group made by ``mp.spawn`` as in PyTorch's DDP
    tutorial, each rank having called ``torch.cuda.set_device(rank)``), ``default_device``
    made ``cuda:0`` current on every rank: ``run_once``'s broadcast then put all ranks on
    one GPU (NCCL refuses it) and the caller's device was changed. It is now the current
    device, left as set; with ``LOCAL_RANK`` it is ``cuda:LOCAL_RANK``, made current."""
    import torch.distributed as dist
    from pytorch_helpers import FakeCuda

    from optmem.pytorch.process_groups import default_device

    fake = FakeCuda(current=3).install(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert default_device() == torch.device("cuda", 3)
    assert fake.log == []
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cuda", 1)
    assert fake.log == [("set_device", 1)]


@pytest.mark.parametrize("spawned", [False, True])
def test_nccl_ranks_set_their_device_before_the_group_is_made(monkeypatch, spawned):
    """``init_distributed`` (torchrun) and ``spawn``'s ranks made the NCCL group first and
    set ``cuda:LOCAL_RANK`` after; PyTorch's DDP tutorial asks for ``set_device`` "before
    initializing the group process ... to prevent hangs or excessive memory utilization on
    GPU:0". The device is now current before ``init_process_group`` (gloo: untouched)."""
    import torch.distributed as dist
    from pytorch_helpers import FakeCuda

    from optmem.pytorch import distributed, process_groups

    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    made: list[str] = []

    def init_process_group(backend, **kwargs):
        fake.log.append(("init", backend))
        made.append(backend)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(made))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: made[-1])
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    if spawned:
        monkeypatch.setattr(dist, "barrier", lambda: None)
        monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
        monkeypatch.setattr(distributed, "end_process", lambda code=0: None)
        distributed._spawned(2, 4, "file:///nowhere", lambda rank, world: None, ())
    else:
        assert process_groups.init_distributed() == torch.device("cuda", 2)
    assert fake.log[:2] == [("set_device", 2), ("init", "nccl")]
    fake.log.clear()
    made.clear()
    assert process_groups.init_distributed("gloo") == torch.device("cpu")
    assert fake.log == [("init", "gloo")]


def test_run_plan_takes_the_ranks_device_and_runs_each_stage_where_it_is(monkeypatch):
    """``run_plan`` without ``device`` ran on the CPU even under NCCL (whose point-to-point
    messages must be CUDA tensors), unlike ``PipelinedModel`` and ``run_plan_pipelining``;
    it now takes ``default_device()``. Its shape dry run fed every stage the input on the
    rank's device, while only this rank's stages are moved there: on CUDA, the first stage
    of another rank (still on the CPU) failed. Each stage now runs where its weights are
    (here: the rank's stage and the input on the CPU, the other rank's stage on ``meta``;
    ``meta`` stands for the other device: no copy out of it)."""

    class Consulted(Exception):
        pass

    def default_device():
        raise Consulted

    plan = plan_for([1, 1], 2, "contiguous")
    model = pipelining.demo_model(4, 2)
    monkeypatch.setattr(pipelining, "default_device", default_device)
    monkeypatch.setattr(pipelining.dist, "get_rank", lambda group=None: 0)
    with pytest.raises(Consulted):
        pipelining.run_plan(model, plan, [torch.zeros(2, 4)], [torch.zeros(2, 1)],
                            torch.nn.functional.mse_loss)
    # the last stage's output is no message: not run since the review of stop 56
    model = pipelining.demo_model(4, 3)
    stages = [model[0], model[1].to("meta"), model[2].to("meta")]
    shapes = pipelining._shapes(stages, torch.zeros(2, 4))
    assert shapes == [(torch.Size([2, 4]), torch.float32)] * 2


def test_the_one_call_profiles_where_the_model_is(monkeypatch):
    """``op.pipeline(model, sample, device=d)`` profiled on ``d`` (where this rank's stages
    will run) while the model stays where it was built: ``optmem train-pipeline`` under
    NCCL (``device=cuda:r``, a model built on the CPU) failed in rank 0's profile on the
    device mismatch. The profile now runs where the model's weights are (here ``meta``
    stands for the GPU: the options say ``cpu``)."""

    class Profiled(Exception):
        pass

    seen = []

    def plan_stages(stages, x, options, *args, **kwargs):
        seen.append(options.device)
        raise Profiled

    monkeypatch.setattr(pipelining.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(pipelining.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(pipelining, "plan_stages", plan_stages)
    monkeypatch.setattr(pipelining, "resolve_group", lambda: None)
    model = pipelining.demo_model(4, 3)
    with pytest.raises(Profiled):
        pipelining.pipeline(model, torch.zeros(2, 4), gpus=2, device=torch.device("meta"),
                            loss_fn=torch.nn.functional.mse_loss)
    assert seen == ["cpu"]


def test_stage_output_is_made_contiguous_keeping_its_container() -> None:
    """``_contiguous`` (``tree_map``): every tensor contiguous, a named tuple kept (gloo)."""
    import collections

    import torch

    Pair = collections.namedtuple("Pair", "a b")
    t = torch.arange(6.0).reshape(2, 3).T
    assert not t.is_contiguous()
    out = pipelining._contiguous(Pair(t, (t, 3)))
    assert type(out) is Pair and out.b[1] == 3
    assert out.a.is_contiguous() and out.b[0].is_contiguous()
    assert torch.equal(out.a, t)
    single = pipelining._contiguous(t)
    assert single.is_contiguous() and torch.equal(single, t)


def test_a_target_with_other_rows_than_the_call_is_one_input_error():
    """Stop 75 audit: a target of 12 rows for a call of 16 (both multiples of 4
    micro-batches) failed in the loss on the last stage's rank while the others waited for
    a gradient; every rank given both now refuses it before any message."""
    from optmem.errors import OptmemInputError
    from optmem.pytorch.pipelining import _check_target_rows

    x = torch.randn(16, 8)
    _check_target_rows((x,), torch.randn(16, 4))  # the same rows
    _check_target_rows((x,), None)
    _check_target_rows((), torch.randn(12, 4))  # this rank was not given the call
    with pytest.raises(OptmemInputError, match="target has 12 rows and the call 16") as info:
        _check_target_rows((x,), torch.randn(12, 4))
    assert info.value.field == "target"


@pytest.mark.parametrize("runner", ["runtime", "p2p"])
def test_a_loss_that_fails_on_the_last_rank_is_one_error_on_every_rank(runner, tmp_path):
    """A ``loss_fn`` runs on the last stage's rank only. One that raised there (here on the
    last micro-batch) or returned a loss per row ended that rank's step while the other
    waited for its gradients: for the group's timeout in a process kept alive (30 minutes
    by default; the spawn's 120 s here). Now every rank raises the same input error at the
    end of the step, naming the rank and the loss's own message, and training goes on."""
    plan = plan_for([1] * 6, 2, "contiguous")
    spawn(w.run_jobs, 2, [{"kind": "pipeline_loss", "plan": plan.to_dict(), "runner": runner}],
          str(tmp_path), init_file=str(tmp_path / "rendezvous"), timeout_s=120.0,
          deadline_s=600.0)
    grads, _ = w.reference_grads("mlp", 4, 8, mean=runner == "runtime")
    datas = [w.load(str(tmp_path), rank, 0) for rank in range(2)]
    for data in datas:
        assert data["999"].startswith("field 'loss_fn': the loss failed on rank 1, which holds the "
                                      "pipeline's last stage: ValueError: a target of 999 "
                                      "in this micro-batch."), data["999"]
        assert "ValueError: loss_fn returned a tensor of shape (2,); expected a scalar" \
            in data["rows"], data["rows"]
    assert datas[0]["999"] == datas[1]["999"] and datas[0]["rows"] == datas[1]["rows"]
    seen: set[str] = set()
    for data in datas:  # the good step after the failed ones: the plain model's gradients
        for name, g in data["grads"].items():
            torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(grads)
