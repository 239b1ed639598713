"""PyTorch's pipeline runtime vs optmem's point-to-point runner on the same plans.

    python benchmarks/bench_pipeline_runtime.py [--quick]

Two gloo processes run one plan (contiguous 1F1B*, and MadPipe's non-contiguous plan) for a
wide MLP: each runner executes the plan's own operation order. Per rank we measure the peak
of the bytes of live tensor storages allocated during construction and one step (a
``TorchDispatchMode`` sees every allocation; deterministic; parameters and their
pre-allocated gradients are not counted; ``MemTracker`` cannot be used: its module hooks
reject the ``autograd.grad`` calls of PyTorch's pipeline stages), and the median time of a
step (interleaved runners, one thread per process). The plan's own prediction (the
simulator's stash, buffers excluded) is printed beside. Results: ``benchmarks/results/
pipeline_runtime.md``, reading in ``docs/pipeline.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from optmem.chain import Chain
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.pytorch import pipelining
from optmem.pytorch.distributed import spawn
from optmem.result import SolveOptions
from optmem.solvers.facade import solve

WIDTH, ROWS = 512, 64  # one activation: 64 x 512 floats = 128 KiB


def model(depth: int) -> nn.Sequential:
    return pipelining.demo_model(WIDTH, depth)


def data(microbatches: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return ([torch.randn(ROWS, WIDTH, generator=gen) for _ in range(microbatches)],
            [torch.randn(ROWS, 1, generator=gen) for _ in range(microbatches)])


def problem_for(costs: list[float]) -> PipelineProblem:
    """Two GPUs, unbounded memory; every layer's activation is one micro-batch's 128 KiB."""
    act, depth = ROWS * WIDTH * 4, len(costs)
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [act] * depth, [act] * depth, input_size=act)
    return PipelineProblem(chain, 2, 2**34, weight_copies=0)


def plan_for(costs: list[float], method: str) -> PipelinePlan:
    result = solve(problem_for(costs), method, options=SolveOptions(threads=1))
    return PipelinePlan.from_strings(result.plan)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created while active and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live and storage.nbytes() > 0:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def measure(runner: str, depth: int, plan: PipelinePlan, microbatches: int, steps: int
            ) -> tuple[int, float]:
    """Peak of non-parameter memory (bytes) over build + the first step, and the median time
    of the ``steps`` steps after it (the runtime sets up its communicators in the first)."""
    net = model(depth)
    for p in net.parameters():  # gradients in place: not counted as new allocations
        p.grad = torch.zeros_like(p)
    xs, ys = data(microbatches)
    dist.barrier()
    with LiveBytes() as tracker:
        if runner == "p2p":
            def step() -> None:
                pipelining.run_plan(net, plan, xs, ys, nn.functional.mse_loss)
        else:
            piped = pipelining.PipelinedModel(net, plan, microbatches=microbatches,
                                              loss_fn=nn.functional.mse_loss,
                                              scale_grads=False)
            x, y = torch.cat(xs), torch.cat(ys)

            def step() -> None:
                piped.step(x, target=y)
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return tracker.peak, statistics.median(times)


def worker(rank: int, world: int, jobs: list[tuple[str, int, dict, int]], steps: int,
           out: str) -> None:
    del world
    torch.set_num_threads(1)
    rows = []
    for name, depth, plan_data, microbatches in jobs:
        plan = PipelinePlan.from_dict(plan_data)
        result = {runner: measure(runner, depth, plan, microbatches, steps)
                  for runner in ("runtime", "p2p")}
        rows.append((name, microbatches, rank, result["runtime"][0], result["p2p"][0],
                     result["runtime"][1], result["p2p"][1]))
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from optmem.simulate.pipeline import simulate_pipeline

    steps = 1 if args.quick else 5
    cases = [("contiguous", [1.0] * 6), ("madpipe", [1.0, 2.0, 2.0, 2.0, 1.0])]
    plans = {label: plan_for(costs, label) for label, costs in cases}
    jobs = [(f"{label} ({plans[label].describe()})", len(costs), plans[label].to_dict(), n)
            for label, costs in cases for n in ((8,) if args.quick else (4, 16))]
    out = tempfile.mkdtemp()
    spawn(worker, 2, jobs, steps, out, init_file=os.path.join(out, "rendezvous"))
    rows = sorted(r for k in range(2) for r in torch.load(os.path.join(out, f"rank{k}.pt")))
    print(f"2 gloo processes, 1 thread each; load average {os.getloadavg()[0]:.1f}; "
          f"median of {steps} steps after the first")
    print("| plan | micro-batches | rank | runtime peak (KiB) | p2p peak (KiB) | ratio | "
          "runtime step (s) | p2p step (s) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, rank, rt_peak, p2p_peak, rt_time, p2p_time in rows:
        print(f"| {name} | {n} | {rank} | {rt_peak / 1024:.0f} | {p2p_peak / 1024:.0f} | "
              f"{rt_peak / max(p2p_peak, 1):.2f} | {rt_time:.3f} | {p2p_time:.3f} | "
              f"{rt_time / p2p_time:.2f} |")
    for label, costs in cases:
        sim = simulate_pipeline(problem_for(costs), plans[label])
        print(f"{label}: the plan's steady-state stash and buffers per GPU: "
              + ", ".join(f"GPU {g} {p / 1024:.0f} KiB" for g, p in enumerate(sim.peaks)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
