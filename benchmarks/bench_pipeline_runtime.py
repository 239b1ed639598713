"""PyTorch's pipeline runtime vs optmem's point-to-point runner on the same plans.

    python benchmarks/bench_pipeline_runtime.py [--quick]
    python benchmarks/bench_pipeline_runtime.py --temporaries
    python benchmarks/bench_pipeline_runtime.py --waits 41
    python benchmarks/bench_pipeline_runtime.py --breakdown
    python benchmarks/bench_pipeline_runtime.py --agree 41

``--agree ROUNDS``: both runners with the losses' agreement after each step (stop 77: a
loss that fails on the last stage's rank is one error on every rank) against without it.

``--breakdown``: on the ``--temporaries`` plans, each rank's ``run_plan`` step op by op
(stop 56, hunt ``rank1``): the largest memory during each operation against the plan's at
that task (``PipelineSimulation.task_memory``, strict + temporaries), the operations above
it, and the storages alive at the rank's peak by the operation and aten op that made them.

``--waits ROUNDS``: ``run_plan`` with the schedule's waits (stop 56) against without them
(as before), on the ``--temporaries`` plans: peaks against the plan, step time ratio.

``--temporaries``: planned against measured per rank, each plan replayed under the
``stash``, ``strict`` and ``strict`` + ``temporaries=True`` models (see below ``temps_main``).

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
import contextlib
import os
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from optmem.chain import Chain
from optmem.pipeline_plan import PipelinePlan
from optmem.pipeline_schedule import RankStep, rank_messages
from optmem.problems.pipeline import PipelineProblem
from optmem.pytorch import pipelining
from optmem.pytorch.distributed import spawn
from optmem.pytorch.memory import StorageTrace, storage_key
from optmem.pytorch.pipeline_loss import LossFailure
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


# ------------------------------------------------------------------ --temporaries
TEMP_WIDTH, TEMP_ROWS, TEMP_MB = 256, 64, 8  # one activation: 64 x 256 floats = 64 KiB
AGREE_MB, AGREE_BLOCK = 8, 5  # micro-batches and steps per timed block of --agree


def temps_model() -> nn.Sequential:
    """Three ``Linear(256, 256)`` + ``Tanh`` and a ``Linear(256, 256)``: 7 chain layers."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(TEMP_WIDTH, TEMP_WIDTH), nn.Tanh()]
    layers.append(nn.Linear(TEMP_WIDTH, TEMP_WIDTH))
    return nn.Sequential(*layers)


def temps_data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return ([torch.randn(TEMP_ROWS, TEMP_WIDTH, generator=gen) for _ in range(TEMP_MB)],
            [torch.randn(TEMP_ROWS, TEMP_WIDTH, generator=gen) for _ in range(TEMP_MB)])


def temps_measure(runner: str, plan: PipelinePlan) -> int:
    """Exact activation peak of this rank's second step (``measure_training_peak``: every
    storage created during the step; weights, their gradients and the data made before
    the step are not counted)."""
    from optmem.pytorch.memory import measure_training_peak

    net = temps_model()
    xs, ys = temps_data()
    if runner == "p2p":
        def step() -> None:
            pipelining.run_plan(net, plan, xs, ys, nn.functional.mse_loss)
    else:
        piped = pipelining.PipelinedModel(net, plan, microbatches=TEMP_MB,
                                          loss_fn=nn.functional.mse_loss, scale_grads=False)
        x, y = torch.cat(xs), torch.cat(ys)

        def step() -> None:
            piped.step(x, target=y)
    net.zero_grad(set_to_none=True)
    dist.barrier()
    step()  # the first step builds the runtime's communicators and buffers
    net.zero_grad(set_to_none=True)
    dist.barrier()
    return measure_training_peak(step, net)


def temps_worker(rank: int, world: int, jobs: list[tuple[str, dict]], out: str) -> None:
    del world
    torch.set_num_threads(1)
    rows = [(name, rank, {r: temps_measure(r, PipelinePlan.from_dict(data))
                          for r in ("runtime", "p2p")}) for name, data in jobs]
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))


def temps_chain() -> Chain:
    """The profiled chain (sizes and overheads measured: deterministic), with fixed times
    (``Linear`` 1, ``Tanh`` 0.25, backward twice the forward, loss 0.25) so that the plans
    do not depend on the machine's load."""
    from optmem.pytorch.api import profile_chain

    xs, ys = temps_data()
    chain = profile_chain(temps_model(), xs[0], repeats=1, warmup=0, progress=False,
                          loss_fn=lambda out: nn.functional.mse_loss(out, ys[0]))
    fwd = tuple(1.0 if w else 0.25 for w in chain.weight_size)
    return replace(chain, fwd_time=fwd, bwd_time=tuple(2 * t for t in fwd), loss_bwd_time=0.25)


def temps_plans() -> tuple[PipelineProblem, list[tuple[str, PipelinePlan]]]:
    """The ``--temporaries`` problem (stash model) and its contiguous and MadPipe plans,
    each with its name."""
    base = PipelineProblem(temps_chain(), 2, 2**34, weight_copies=0)
    plans = []
    for method in ("contiguous", "madpipe"):
        plan = PipelinePlan.from_strings(
            solve(base, method, options=SolveOptions(threads=1)).plan)
        plans.append((f"{method} ({plan.describe()})", plan))
    return base, plans


def spawned_rows(worker: Callable[..., None], *args: Any) -> list[Any]:
    """The rows ``worker(rank, 2, *args, out)`` saved in ``out`` on each of 2 processes."""
    out = tempfile.mkdtemp()
    spawn(worker, 2, *args, out, init_file=os.path.join(out, "rendezvous"))
    return [r for k in range(2) for r in torch.load(os.path.join(out, f"rank{k}.pt"))]


def temps_main() -> None:
    """The stop-53 setup: planned per-GPU peaks (stash / strict / strict + temporaries)
    against the measured peak of each rank, on PyTorch's runtime and on ``run_plan``."""
    from optmem.simulate.pipeline import simulate_pipeline

    torch.set_num_threads(1)
    base, plans = temps_plans()
    chain = base.chain
    print(f"chain: {chain.length} layers; output {list(chain.output_size)}; saved "
          f"{list(chain.saved_size)}; fwd_overhead {list(chain.fwd_overhead)}; bwd_overhead "
          f"{list(chain.bwd_overhead)}; loss.bwd_overhead {chain.loss_bwd_overhead}")
    models = {"stash": base, "strict": replace(base, memory_model="strict"),
              "strict+temporaries": replace(base, memory_model="strict", temporaries=True)}
    jobs = []
    planned: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, plan in plans:
        planned[name] = {k: simulate_pipeline(p, plan).peaks for k, p in models.items()}
        jobs.append((name, plan.to_dict()))
    rows = spawned_rows(temps_worker, jobs)
    kib = 1024
    print("| plan | rank | planned stash | strict | strict+temporaries | measured runtime | "
          "measured run_plan | runtime / strict+temporaries | run_plan / "
          "strict+temporaries |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rank, measured in sorted(rows):
        peaks = planned[name]
        temp = peaks["strict+temporaries"][rank]
        print(f"| {name} | {rank} | {peaks['stash'][rank] / kib:.0f} | "
              f"{peaks['strict'][rank] / kib:.0f} | {temp / kib:.0f} | "
              f"{measured['runtime'] / kib:.0f} | {measured['p2p'] / kib:.0f} | "
              f"{measured['runtime'] / temp:.2f} | {measured['p2p'] / temp:.2f} |")
    sys.stdout.flush()


# ------------------------------------------------------------------ --waits
@contextlib.contextmanager
def without_waits() -> Iterator[None]:
    """``run_plan`` as before stop 56: the schedule's ``RankStep.wait`` left out (a send
    with no release point is held until the step ends)."""
    messages = pipelining.rank_messages

    def stripped(plan: PipelinePlan, microbatches: int) -> dict[int, list[RankStep]]:
        return {g: [replace(st, wait=()) for st in ops]
                for g, ops in messages(plan, microbatches).items()}

    pipelining.rank_messages = stripped
    try:
        yield
    finally:
        pipelining.rank_messages = messages


def waits_measure(plan: PipelinePlan, rounds: int) -> dict[str, tuple[int, float]]:
    """This rank's peak (as :func:`temps_measure`) and median step time with and without
    the waits, the two run alternately ``rounds`` times after a warm-up step each."""
    from optmem.pytorch.memory import measure_training_peak

    net = temps_model()
    xs, ys = temps_data()

    def step() -> None:
        pipelining.run_plan(net, plan, xs, ys, nn.functional.mse_loss)

    variants = {"waits": contextlib.nullcontext, "none": without_waits}
    peaks, times = {}, {k: [] for k in variants}
    for name, ctx in variants.items():
        with ctx():
            step()
            net.zero_grad(set_to_none=True)
            dist.barrier()
            peaks[name] = measure_training_peak(step, net)
    for _ in range(rounds):
        for name, ctx in variants.items():
            with ctx():
                dist.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return {k: (peaks[k], statistics.median(times[k])) for k in variants}


def waits_worker(rank: int, world: int, jobs: list[tuple[str, dict]], rounds: int,
                 out: str) -> None:
    del world
    torch.set_num_threads(1)
    rows = [(name, rank, waits_measure(PipelinePlan.from_dict(data), rounds))
            for name, data in jobs]
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))


def waits_main(rounds: int) -> None:
    """``run_plan`` with and without the schedule's waits on the ``--temporaries`` plans:
    each rank's peak against its plan (strict + temporaries) and the step time ratio."""
    from optmem.simulate.pipeline import simulate_pipeline

    torch.set_num_threads(1)
    base, plans = temps_plans()
    temps = replace(base, memory_model="strict", temporaries=True)
    jobs, planned = [], {}
    for name, plan in plans:
        planned[name] = simulate_pipeline(temps, plan).peaks
        waits = sum(len(st.wait) for ops in rank_messages(plan, TEMP_MB).values()
                    for st in ops)
        print(f"{name}: {waits} waits")
        jobs.append((name, plan.to_dict()))
    rows = spawned_rows(waits_worker, jobs, rounds)
    kib = 1024
    print(f"2 gloo processes, 1 thread each; load average {os.getloadavg()[0]:.1f}; medians "
          f"of {rounds} interleaved steps")
    print("| plan | rank | strict + temporaries | without waits | with | without / plan | "
          "with / plan | step without (ms) | with (ms) | with / without |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rank, m in sorted(rows):
        plan_peak = planned[name][rank]
        (p0, t0), (p1, t1) = m["none"], m["waits"]
        print(f"| {name} | {rank} | {plan_peak / kib:.0f} | {p0 / kib:.0f} | {p1 / kib:.0f} | "
              f"{p0 / plan_peak:.2f} | {p1 / plan_peak:.2f} | {t0 * 1e3:.2f} | "
              f"{t1 * 1e3:.2f} | {t1 / t0:.2f} |")
    sys.stdout.flush()


# ------------------------------------------------------------------ --agree
@contextlib.contextmanager
def without_agreement() -> Iterator[None]:
    """Both runners as before stop 77: no message after the step about the losses."""
    agree = LossFailure.agree
    LossFailure.agree = lambda self, **_: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        LossFailure.agree = agree  # type: ignore[method-assign]


def agree_measure(plan: PipelinePlan, rounds: int) -> dict[str, dict[str, float]]:
    """Median step time of each runner with and without the losses' agreement: blocks of
    ``AGREE_BLOCK`` steps back to back (a barrier before each block only: one step's
    time alone would end at this rank's last operation without the agreement and at the
    last rank's with it), the variants alternating, ``rounds`` blocks each."""
    net = model(6)
    xs, ys = data(AGREE_MB)
    piped = pipelining.PipelinedModel(net, plan, microbatches=AGREE_MB,
                                      loss_fn=nn.functional.mse_loss, scale_grads=False)
    x, y = torch.cat(xs), torch.cat(ys)
    steps = {"runtime": lambda: piped.step(x, target=y),
             "p2p": lambda: pipelining.run_plan(net, plan, xs, ys, nn.functional.mse_loss)}
    variants = {"agree": contextlib.nullcontext, "none": without_agreement}
    times: dict[str, dict[str, list[float]]] = {r: {v: [] for v in variants} for r in steps}
    for step in steps.values():
        step()
    for _ in range(rounds):
        for runner, step in steps.items():
            for name, ctx in variants.items():
                with ctx():
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(AGREE_BLOCK):  # back to back, as in training
                        step()
                    times[runner][name].append((time.perf_counter() - start) / AGREE_BLOCK)
    return {r: {v: statistics.median(t) for v, t in d.items()} for r, d in times.items()}


def agree_worker(rank: int, world: int, plan_data: dict, rounds: int, out: str) -> None:
    del world
    torch.set_num_threads(1)
    torch.save([(rank, agree_measure(PipelinePlan.from_dict(plan_data), rounds))],
               os.path.join(out, f"rank{rank}.pt"))


def agree_main(rounds: int) -> None:
    """Step time with the losses' agreement (stop 77) against without, both runners."""
    plan = plan_for([1.0] * 6, "contiguous")
    rows = spawned_rows(agree_worker, plan.to_dict(), rounds)
    print(f"2 gloo processes, 1 thread each; load average {os.getloadavg()[0]:.1f}; medians "
          f"of {rounds} interleaved blocks of {AGREE_BLOCK} steps; {plan.describe()}, "
          f"{AGREE_MB} micro-batches")
    print("| runner | rank | step without (ms) | with (ms) | with / without |")
    print("|---|---|---|---|---|")
    for rank, m in sorted(rows):
        for runner, t in m.items():
            print(f"| {runner} | {rank} | {t['none'] * 1e3:.2f} | {t['agree'] * 1e3:.2f} | "
                  f"{t['agree'] / t['none']:.3f} |")
    sys.stdout.flush()


# ------------------------------------------------------------------ --breakdown
class OpTrace(StorageTrace):
    """A :class:`StorageTrace` that labels each storage with the operation running (``op``,
    set from outside) and the aten op that made it."""

    def __init__(self, known: set[int]) -> None:
        super().__init__(known)
        self.op = "build"
        self.labels: list[str] = []  # per record
        self.marks: list[tuple[int, str]] = []  # (first event of the operation, op)

    def start(self, op: str) -> None:
        self.op = op
        self.marks.append((len(self.events), op))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        first = len(self.sizes)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.labels += [f"{self.op} {func._overloadpacket.__name__}"] * (len(self.sizes) - first)
        return out

    def breakdown(self, skip: set[int]) -> tuple[dict[str, int], str, dict[str, int]]:
        """Largest bytes during each operation, the one at the peak, and what is alive
        there (bytes by label); records in ``skip`` (weight gradients) left out."""
        starts = dict(self.marks)
        op, current, peak, per_op = "build", 0, -1, {"build": 0}
        alive: dict[int, int] = {}
        at_peak: tuple[str, dict[int, int]] = ("build", {})
        for i, (record, delta) in enumerate(self.events):
            if i in starts:
                op = starts[i]
                per_op[op] = current
            if record in skip:
                continue
            current += delta
            if delta > 0:
                alive[record] = delta
            else:
                alive.pop(record, None)
            per_op[op] = max(per_op[op], current)
            if current > peak:
                peak, at_peak = current, (op, dict(alive))
        held: dict[str, int] = {}
        for record, size in at_peak[1].items():
            held[self.labels[record]] = held.get(self.labels[record], 0) + size
        return per_op, at_peak[0], held


@contextlib.contextmanager
def labelled(trace: list[OpTrace | None]) -> Iterator[None]:
    """``run_plan`` tells ``trace[0]`` (when set) which operation it starts."""
    messages = pipelining.rank_messages

    def steps(st: RankStep) -> RankStep:
        if trace[0] is not None:
            trace[0].start(f"{st.op.kind}{st.op.stage},{st.op.microbatch}")
        return st

    def told(plan: PipelinePlan, microbatches: int) -> dict[int, Any]:
        return {g: map(steps, ops) for g, ops in messages(plan, microbatches).items()}

    pipelining.rank_messages = told
    try:
        yield
    finally:
        pipelining.rank_messages = messages


def breakdown_measure(plan: PipelinePlan) -> tuple[dict[str, int], str, dict[str, int]]:
    """:meth:`OpTrace.breakdown` of this rank's second step (as :func:`temps_measure`)."""
    net = temps_model()
    xs, ys = temps_data()
    box: list[OpTrace | None] = [None]
    with labelled(box):
        pipelining.run_plan(net, plan, xs, ys, nn.functional.mse_loss)
        net.zero_grad(set_to_none=True)
        dist.barrier()
        params = list(net.parameters())
        box[0] = trace = OpTrace({storage_key(t) for t in (*params, *net.buffers())})
        with trace:
            pipelining.run_plan(net, plan, xs, ys, nn.functional.mse_loss)
    grads = {trace.record_of(p.grad) for p in params if p.grad is not None}
    return trace.breakdown({r for r in grads if r is not None})


def breakdown_worker(rank: int, world: int, jobs: list[tuple[str, dict]], out: str) -> None:
    del world
    torch.set_num_threads(1)
    rows = [(name, rank, breakdown_measure(PipelinePlan.from_dict(data)))
            for name, data in jobs]
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))


def breakdown_main() -> None:
    """Each rank's ``run_plan`` op by op against the plan (strict + temporaries)."""
    from optmem.simulate.pipeline import simulate_pipeline

    torch.set_num_threads(1)
    base, plans = temps_plans()
    temps = replace(base, memory_model="strict", temporaries=True)
    jobs, planned = [], {}
    for name, plan in plans:
        planned[name] = simulate_pipeline(temps, plan, microbatches=TEMP_MB)
        jobs.append((name, plan.to_dict()))
    rows = spawned_rows(breakdown_worker, jobs)
    kib = 1024
    for name, rank, (per_op, peak_op, held) in sorted(rows):
        sim = planned[name]
        plan_at = {f"{k}{s},{m}": v for (k, s, m), v in sim.task_memory.items()}
        print(f"{name}, rank {rank}: peak {max(per_op.values()) / kib:.0f} KiB during "
              f"{peak_op} (operation 'kind stage,micro-batch'); plan {sim.peaks[rank] / kib:.0f}")
        print("  alive at the peak (made by 'operation aten-op': KiB): " + ", ".join(
            f"{label}: {size / kib:.0f}" for label, size in sorted(held.items())))
        above = [f"{op} {v / kib:.0f}/{plan_at[op] / kib:.0f}" for op, v in per_op.items()
                 if op in plan_at and v > plan_at[op]]
        print("  operations above the plan (measured/plan): " + (", ".join(above) or "none"))
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--temporaries", action="store_true",
                    help="planned (stash / strict / strict + temporaries) vs measured peaks")
    ap.add_argument("--waits", type=int, metavar="ROUNDS", default=0,
                    help="run_plan with and without the schedule's waits (stop 56), "
                         "ROUNDS interleaved steps each")
    ap.add_argument("--agree", type=int, metavar="ROUNDS", default=0,
                    help="both runners with and without the losses' agreement after each "
                         "step (stop 77), ROUNDS interleaved steps each")
    ap.add_argument("--breakdown", action="store_true",
                    help="run_plan op by op against the plan, on the --temporaries plans")
    args = ap.parse_args()
    if args.breakdown:
        breakdown_main()
        return
    if args.waits:
        waits_main(args.waits)
        return
    if args.agree:
        agree_main(args.agree)
        return
    if args.temporaries:
        temps_main()
        return
    from optmem.simulate.pipeline import simulate_pipeline

    steps = 1 if args.quick else 5
    cases = [("contiguous", [1.0] * 6), ("madpipe", [1.0, 2.0, 2.0, 2.0, 1.0])]
    plans = {label: plan_for(costs, label) for label, costs in cases}
    jobs = [(f"{label} ({plans[label].describe()})", len(costs), plans[label].to_dict(), n)
            for label, costs in cases for n in ((8,) if args.quick else (4, 16))]
    rows = sorted(spawned_rows(worker, jobs, steps))
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
