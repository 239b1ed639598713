"""Run a pipeline plan on ``torch.distributed`` (one process per GPU of the plan).

The plan (:class:`optmem.pipeline_plan.PipelinePlan`, from any ``pipeline`` method) places
stages, i.e. runs of consecutive children of an ``nn.Sequential`` (chain layer ``q`` is child
``q - 1``), on ranks, possibly several non-adjacent stages per rank (MadPipe, the exact
models). :func:`run_plan` unrolls the 1-periodic pattern over ``N`` micro-batches and every
rank executes its own forward and backward operations in the order of their start times,
which respects every dependency because the pattern is valid (the simulator checks it).

Communication is point-to-point (``isend`` / ``irecv``) and never relies on tags: every rank
knows the whole schedule, so it posts the receives from one peer in the order that peer sends,
buffering messages that arrive before they are needed. This is what NCCL requires and it also
runs on gloo (CPU processes, used by the tests).

``torch.distributed.pipelining`` fits contiguous plans only: its schedules (GPipe, 1F1B,
interleaved) fix their own operation order and stage placement (``stage_index % world_size``
for looped schedules), while a MadPipe or ILP plan prescribes both. :func:`run_plan_pipelining`
runs a contiguous plan's allocation with ``Schedule1F1B`` (PyTorch's order, not the plan's
1F1B* order); :func:`run_plan` executes any plan's own order.

Weights are not updated inside :func:`run_plan`: gradients of the ``N`` micro-batches are
accumulated in ``.grad`` (one flush), which is what the tests compare with single-process
training; an optimizer step after the call gives synchronous (GPipe-like) semantics.
Launch with :func:`spawn` (``torch.multiprocessing``) or ``torchrun`` (see :func:`main`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optmem.pipeline_plan import PipelinePlan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Op:
    """One operation of a rank: ``kind`` ("F"/"B") of 1-based ``stage`` on ``microbatch``."""

    time: float
    order: int
    kind: str
    stage: int
    microbatch: int


def rank_programs(plan: PipelinePlan, microbatches: int) -> dict[int, list[Op]]:
    """The operations of every rank, sorted by their start time in the unrolled pattern."""
    programs: dict[int, list[Op]] = defaultdict(list)
    n_stages = len(plan.stages)
    for t in plan.tasks:
        if t.op not in ("F", "B"):
            continue
        gpu = plan.stages[t.stage - 1].gpu
        # dependency order breaks ties between zero-length operations
        order = t.stage if t.op == "F" else 2 * n_stages + 1 - t.stage
        for m in range(microbatches):
            start = (m - t.shift) * plan.period + t.start
            programs[gpu].append(Op(start, order, t.op, t.stage, m))
    for ops in programs.values():
        ops.sort(key=lambda o: (o.time, o.microbatch, o.order))
    return dict(programs)


class _Mailbox:
    """Receives from each peer in that peer's send order (no tags needed)."""

    def __init__(self, expected: dict[int, list[tuple[str, int, int]]],
                 shapes: dict[tuple[str, int, int], tuple[torch.Size, torch.dtype]],
                 device: torch.device) -> None:
        self.queues = {peer: deque(keys) for peer, keys in expected.items()}
        self.shapes = shapes
        self.device = device
        self.box: dict[tuple[str, int, int], torch.Tensor] = {}

    def get(self, peer: int, key: tuple[str, int, int]) -> torch.Tensor:
        while key not in self.box:
            nxt = self.queues[peer].popleft()
            shape, dtype = self.shapes[nxt]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src=peer)
            assert work is not None
            work.wait()
            self.box[nxt] = buf
        return self.box.pop(key)


def _shapes(model: nn.Sequential, plan: PipelinePlan, sample: torch.Tensor
            ) -> list[tuple[torch.Size, torch.dtype]]:
    """Output shape and dtype of every stage for one micro-batch (a no-grad dry run)."""
    out = []
    x = sample
    with torch.no_grad():
        for st in plan.stages:
            for q in range(st.first, st.last + 1):
                x = model[q - 1](x)
            out.append((x.shape, x.dtype))
    return out


def run_plan(
    model: nn.Sequential, plan: PipelinePlan, inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor], loss_fn: LossFn, *, device: torch.device | None = None,
) -> list[float]:
    """Execute ``plan`` on this rank for the micro-batches ``inputs`` (one flush).

    Every rank holds the same ``model`` definition (only its own stages are used and moved
    to ``device``). Returns the losses of the micro-batches whose last stage ran here.
    """
    rank = dist.get_rank()
    device = device or torch.device("cpu")
    n_mb = len(inputs)
    n_stages = len(plan.stages)
    gpu_of = {k: st.gpu for k, st in enumerate(plan.stages, start=1)}
    mine = [k for k, g in gpu_of.items() if g == rank]
    for k in mine:
        st = plan.stages[k - 1]
        for q in range(st.first, st.last + 1):
            model[q - 1].to(device)
    shapes = _shapes(model, plan, inputs[0].to(device) if mine else inputs[0])
    programs = rank_programs(plan, n_mb)
    # messages: ("a", s, m) = output of stage s sent to s+1; ("g", s, m) = grad to stage s
    sends: dict[tuple[int, int], list[tuple[float, tuple[str, int, int]]]] = defaultdict(list)
    msg_shapes: dict[tuple[str, int, int], tuple[torch.Size, torch.dtype]] = {}
    for gpu, ops in programs.items():
        for op in ops:
            if op.kind == "F" and op.stage < n_stages and gpu_of[op.stage + 1] != gpu:
                key = ("a", op.stage, op.microbatch)
                sends[(gpu, gpu_of[op.stage + 1])].append((op.time, key))
                msg_shapes[key] = shapes[op.stage - 1]
            if op.kind == "B" and op.stage > 1 and gpu_of[op.stage - 1] != gpu:
                key = ("g", op.stage - 1, op.microbatch)
                sends[(gpu, gpu_of[op.stage - 1])].append((op.time, key))
                msg_shapes[key] = shapes[op.stage - 2]
    order = {pair: [k for _, k in sorted(v, key=lambda item: item[0])]
             for pair, v in sends.items()}
    # a rank's sends to one peer follow its own program order, which is sorted by time
    mailbox = _Mailbox({src: keys for (src, dst), keys in order.items() if dst == rank},
                       msg_shapes, device)
    pending: list[Any] = []
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    local: dict[tuple[str, int, int], torch.Tensor] = {}
    losses: list[float] = []
    for op in programs.get(rank, []):
        st = plan.stages[op.stage - 1]
        m = op.microbatch
        if op.kind == "F":
            if op.stage == 1:
                x_in = inputs[m].to(device)
                leaf = None
            else:
                prev = gpu_of[op.stage - 1]
                got = local.pop(("a", op.stage - 1, m)) if prev == rank else \
                    mailbox.get(prev, ("a", op.stage - 1, m))
                leaf = got.detach().requires_grad_(True)
                x_in = leaf
            x = x_in
            for q in range(st.first, st.last + 1):
                x = model[q - 1](x)
            if op.stage == n_stages:
                loss = loss_fn(x, targets[m].to(device))
                losses.append(float(loss.detach()))
                stash[(op.stage, m)] = (leaf, loss)
            else:
                stash[(op.stage, m)] = (leaf, x)
                nxt = gpu_of[op.stage + 1]
                if nxt == rank:
                    local[("a", op.stage, m)] = x.detach()
                else:
                    pending.append(dist.isend(x.detach().contiguous(), dst=nxt))
        else:
            leaf, out = stash.pop((op.stage, m))
            if op.stage == n_stages:
                out.backward()
            else:
                nxt = gpu_of[op.stage + 1]
                grad = local.pop(("g", op.stage, m)) if nxt == rank else \
                    mailbox.get(nxt, ("g", op.stage, m))
                out.backward(grad)
            if op.stage > 1:
                assert leaf is not None and leaf.grad is not None
                prev = gpu_of[op.stage - 1]
                if prev == rank:
                    local[("g", op.stage - 1, m)] = leaf.grad
                else:
                    pending.append(dist.isend(leaf.grad.contiguous(), dst=prev))
    for req in pending:
        req.wait()
    return losses


def fits_pipelining(plan: PipelinePlan) -> bool:
    """Whether ``torch.distributed.pipelining`` can run the plan: stage ``k`` on rank ``k-1``."""
    return all(st.gpu == k for k, st in enumerate(plan.stages))


def run_plan_pipelining(
    model: nn.Sequential, plan: PipelinePlan, inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor], loss_fn: LossFn, *, device: torch.device | None = None,
) -> list[float]:
    """Run a contiguous plan with ``torch.distributed.pipelining`` (``Schedule1F1B``).

    Uses the plan's allocation (one stage per rank, in rank order, see
    :func:`fits_pipelining`) with PyTorch's own 1F1B order, which keeps at most ``P - s + 1``
    micro-batches on stage ``s``: as many as 1F1B* at the smallest period, possibly more than
    the plan's 1F1B* at a larger one. Gradients are summed over micro-batches, as in
    :func:`run_plan`. Returns the micro-batch losses on the last rank.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if not fits_pipelining(plan) or len(plan.stages) != dist.get_world_size():
        raise ValueError("torch.distributed.pipelining needs stage k on rank k-1 and one stage "
                         "per rank; use run_plan")
    rank = dist.get_rank()
    device = device or torch.device("cpu")
    n_stages = len(plan.stages)
    st = plan.stages[rank]
    sub = nn.Sequential(*[model[q - 1] for q in range(st.first, st.last + 1)]).to(device)
    stage = PipelineStage(sub, rank, n_stages, device)
    schedule = Schedule1F1B(stage, len(inputs), loss_fn=loss_fn, scale_grads=False)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(torch.cat(list(inputs)).to(device))
    elif rank == n_stages - 1:
        schedule.step(target=torch.cat(list(targets)).to(device), losses=losses)
    else:
        schedule.step()
    return [float(v.detach()) for v in losses]


# ------------------------------------------------------------------ launching
def _worker(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, init_file: str) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes (``torch.multiprocessing``).

    ``init_file`` is a path (not existing yet) for the ``file://`` rendezvous. The backend is
    NCCL when CUDA is available, gloo otherwise.
    """
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, f"file://{init_file}", fn, args), nprocs=world, join=True)


def demo_model(width: int = 16, depth: int = 4, seed: int = 0) -> nn.Sequential:
    """A small MLP as an ``nn.Sequential`` of ``depth`` blocks (one chain layer each)."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.Tanh())
                               for _ in range(depth - 1)]
    blocks.append(nn.Linear(width, 1))
    return nn.Sequential(*blocks)


def demo_batches(width: int, microbatches: int, seed: int = 1
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Seeded micro-batches (inputs, targets) for :func:`demo_model`."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(4, width, generator=gen) for _ in range(microbatches)]
    ys = [torch.randn(4, 1, generator=gen) for _ in range(microbatches)]
    return xs, ys


def gradient_worker(rank: int, world: int, jobs: list[tuple[dict, int, str]], width: int,
                    microbatches: int, out_dir: str) -> None:
    """Run each ``(plan_data, depth, runner)`` job on the demo MLP; save this rank's results.

    ``runner`` is ``"p2p"`` (:func:`run_plan`) or ``"pipelining"``
    (:func:`run_plan_pipelining`).

    Writes ``out_dir/rank{rank}_job{k}.pt``: ``{"grads": {param name: grad}, "losses": [...]}``
    with the gradients of the parameters of the stages this rank holds. Several jobs share one
    process group (spawning processes costs more than the runs).
    """
    del world
    torch.set_num_threads(1)
    for k, (plan_data, depth, runner) in enumerate(jobs):
        plan = PipelinePlan.from_any(plan_data)
        model = demo_model(width, depth)
        xs, ys = demo_batches(width, microbatches)
        run = run_plan_pipelining if runner == "pipelining" else run_plan
        losses = run(model, plan, xs, ys, nn.functional.mse_loss)
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
                 if p.grad is not None}
        torch.save({"grads": grads, "losses": losses},
                   os.path.join(out_dir, f"rank{rank}_job{k}.pt"))
        dist.barrier()


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun --nproc_per_node P -m optmem.pytorch.pipeline PLAN.json``: run a demo MLP.

    The plan must be for a chain of ``--depth`` layers; rank 0 prints the micro-batch losses.
    """
    from optmem.pipeline_plan import PipelinePlan as Plan

    parser = argparse.ArgumentParser(prog="optmem.pytorch.pipeline")
    parser.add_argument("plan", help="a pipeline plan or result JSON file")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)
    with open(args.plan) as fh:
        plan = Plan.from_any(fh.read())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") \
        if backend == "nccl" else torch.device("cpu")
    model = demo_model(args.width, args.depth)
    xs, ys = demo_batches(args.width, args.microbatches)
    losses = run_plan(model, plan, xs, ys, nn.functional.mse_loss, device=device)
    if losses:
        print(f"rank {rank}: losses " + " ".join(f"{v:.4f}" for v in losses))
    dist.destroy_process_group()
    return 0 if all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
