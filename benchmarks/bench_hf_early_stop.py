"""HF's plan run four ways: what torch's checkpoint *early stop* is worth at HF's memory.

At HF's own memory the only plan that fits is HF's (every layer checkpointed, its input
kept; ``bench_hf.py`` finds optmem's plan there equal to it in the chain model). This script
runs that one plan

* **HF**: ``model.gradient_checkpointing_enable()`` (non-reentrant ``torch.utils.checkpoint``
  per layer, torch's default *early stop*: the re-run of a layer stops once every tensor its
  backward saved is recomputed, so the ops after the last one, GPT-2's MLP output
  projection and residual add, are not re-run);
* **HF, early stop off**: the same under ``torch.utils.checkpoint.set_checkpoint_early_stop(
  False)`` (each layer re-run whole);
* **optmem, HF's plan**: the optmem wrapper executing HF's plan on its extracted chain
  (``bench_hf.grouped_plan``), with its default *joint re-runs* (``optmem.pytorch.joint``:
  the last stage of each segment re-run and back-propagated as one traced graph, without
  the ops that only feed its output);
* **optmem, joint re-runs off**: the same with ``joint_reruns=False`` (every stage of a
  layer re-run whole, as ``F_all`` does);

in interleaved rounds (the order rotated every round, one thread, CPU time, the fastest of
two steps per setting and round), and reports each setting's median, its median ratio to HF
over the rounds with the distribution-free interval of ``bench_hf.median_interval``, and the
number of matrix products (``aten.mm`` and ``aten.addmm``) and of all aten ops one step
dispatches (a ``TorchDispatchMode``
count, outside the timed steps).

Run: ``PYTHONPATH=. python benchmarks/bench_hf_early_stop.py [--models gpt2,llama,bert]
[--rounds 15] [--markdown FILE]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf as bh  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402

HF = "HF"
NO_EARLY_STOP = "HF, early stop off"
OPTMEM = "optmem, HF's plan"
OPTMEM_EAGER = "optmem, joint re-runs off"


class _OpCount(TorchDispatchMode):
    """Count the aten ops dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def settings(spec: bh.Spec) -> tuple[dict[str, Callable[[], None]], Any]:
    """The four steps of one model (each leaves the gradients at None) and the plan."""
    model, batch = bh.build(spec)
    chain = op.profile_chain(model, batch, repeats=3)
    cmodel = op.checkpoint(model, batch, memory_limit=int(chain.store_all_peak() * 1.02) + 1,
                           chain=chain)
    layers = len(bh.layer_list(model))
    plan = bh.grouped_plan(bh.layer_groups(bh.stage_layers(cmodel.stage_names),
                                           [[k] for k in range(layers)]))
    cmodel.use_plan(plan, method="dp",
                    memory_limit=int(simulate_checkpoint(chain, plan).peak_memory) + 1)
    assert not cmodel.fast_path_taken

    def hf(early_stop: bool) -> Callable[[], None]:
        def step() -> None:
            with bh.hf_checkpointing(model) as call, set_checkpoint_early_stop(early_stop):
                bh.train_step(call, model, batch)
            model.zero_grad(set_to_none=True)
        return step

    executor = cmodel.executor

    def optmem(joint: bool) -> Callable[[], None]:
        def step() -> None:
            executor.joint_reruns = joint
            bh.train_step(cmodel, model, batch)
            model.zero_grad(set_to_none=True)
        return step

    return {HF: hf(True), NO_EARLY_STOP: hf(False), OPTMEM: optmem(True),
            OPTMEM_EAGER: optmem(False)}, plan


def _cpu_ms(step: Callable[[], None]) -> float:
    t = time.process_time()
    step()
    return (time.process_time() - t) * 1e3


def measure(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Interleaved rounds, the order rotated each round; per round the fastest of two."""
    names = list(steps)
    for step in steps.values():  # warm-up
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(min(_cpu_ms(steps[name]) for _ in range(2)))
    return times


def _matmuls(ops: Counter[str]) -> int:
    return ops["aten.mm.default"] + ops["aten.addmm.default"]


def report(spec: bh.Spec, times: dict[str, list[float]], counts: dict[str, Counter[str]]
           ) -> list[str]:
    """One model's table."""
    rows = [f"### {spec.name}: {spec.layers} layers, hidden {spec.hidden}, batch "
            f"{spec.batch} x {spec.seq}", "",
            "| setting | CPU ms (median) | ratio to HF (median) | interval | matmuls / step | "
            "aten ops / step |", "|---|---|---|---|---|---|"]
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, times[HF], strict=True)]
        mid, lo, hi, level = bh.median_interval(ratios)
        rows.append(f"| {name} | {statistics.median(ts):.1f} | {mid:.3f} "
                    f"| {lo:.3f}-{hi:.3f} ({level:.1%}) | {_matmuls(counts[name])} | "
                    f"{sum(counts[name].values())} |")
    return rows + [""]


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama,bert")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--markdown", help="write the tables to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    specs = {s.name: s for s in bh.FULL}
    lines = ["# HF's plan with and without torch's early stop, and in optmem's executor", "",
             f"`PYTHONPATH=. python benchmarks/bench_hf_early_stop.py --rounds {args.rounds}`"
             f"; torch {torch.__version__}, one thread, {bh._now()}, load {bh._load()}.", ""]
    for name in args.models.split(","):
        spec = specs[name]
        steps, _ = settings(spec)
        counts = {}
        for k, step in steps.items():
            with _OpCount() as mode:
                step()
            counts[k] = mode.ops
        lines += report(spec, measure(steps, args.rounds), counts)
        print("\n".join(lines[-8:]), flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
