"""Real training steps: optmem's plan against ``torch.utils.checkpoint.checkpoint_sequential``.

For each model and each segment count ``k`` of ``checkpoint_sequential`` (reentrant, the
chain's stages as the sequence), the memory limit given to optmem is the *predicted* peak of
that torch plan (its op sequence replayed by optmem's simulator on the profiled chain), so
both run under the same budget in the same model. One training step is then measured for

* plain PyTorch (no checkpointing),
* ``checkpoint_sequential(stages, k)``,
* optmem's DP plan under that limit,

printing the measured activation peak (``optmem.pytorch.ActivationTracker`` with
``gradients=False``: saved tensors plus the checkpoints each method keeps, input batch
included; activation gradients are invisible to hooks in plain autograd, so they are left
out for both), the median step time, and the predicted step times (simulated makespans,
independent of the noise of a shared machine). Gradients of the optmem run are checked
bitwise against plain PyTorch.

Usage::

    PYTHONPATH=. python benchmarks/bench_pytorch.py --quick     # toy CNN only
    PYTHONPATH=. python benchmarks/bench_pytorch.py              # + zoo ResNet-18 (if present)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.extract import extract_stages  # noqa: E402
from optmem.pytorch.models import resolve_spec  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402
from optmem.solvers.checkpoint_baselines import segments_plan  # noqa: E402
from optmem.units import format_size  # noqa: E402


def torch_segments(length: int, k: int) -> list[tuple[int, int]]:
    """The 1-based stage ranges of ``checkpoint_sequential(functions, k)`` (torch 2.x)."""
    size = length // k
    bounds, start = [], 1
    for _ in range(k - 1):
        bounds.append((start, start + size - 1))
        start += size
    bounds.append((start, length))
    return bounds


def measure(run, owner: nn.Module, x: torch.Tensor, repeats: int) -> tuple[int, float, list]:
    peak, times = 0, []
    for _ in range(repeats):
        owner.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(0)
        with op.ActivationTracker(owner, pinned=[x], gradients=False) as tracker:
            t0 = time.perf_counter()
            run(x).float().square().mean().backward()
            times.append(time.perf_counter() - t0)
        peak = max(peak, tracker.peak_bytes)
    grads = [p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return peak, statistics.median(times) * 1e3, grads


def bench(name: str, module: nn.Module, x: torch.Tensor, repeats: int) -> list[str]:
    x = x.clone().requires_grad_(x.is_floating_point())
    stages = extract_stages(module)
    seq = nn.Sequential(*[s.module for s in stages])
    chain = op.profile_stages(stages, x, repeats=2, warmup=1, name=name)
    plain_peak, plain_time, plain_grads = measure(module, module, x, repeats)
    smallest = op.smallest_limit(chain)
    lines = [f"### {name}: {chain.length} stages, batch {x.shape[0]}", "",
             f"plain PyTorch: activation peak {format_size(plain_peak)}, "
             f"step {plain_time:.0f} ms", "",
             "| k | limit (torch plan's predicted peak) | torch measured | optmem measured "
             "| torch ms | optmem ms | measured ratio | predicted torch ms "
             "| predicted optmem ms | predicted ratio | same grads |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in (2, 3, 4, 6, 8):
        if k > chain.length:
            break
        torch_plan = segments_plan(torch_segments(chain.length, k))
        sim = simulate_checkpoint(chain, torch_plan)
        t_peak, t_time, t_grads = measure(
            lambda v, k=k: checkpoint_sequential(seq, k, v, use_reentrant=True), module, x,
            repeats)
        # rounding sizes up to units can make the exact limit infeasible: take the smallest
        # limit the DP accepts when it is (marginally) above the torch plan's peak
        limit = max(sim.peak_memory, smallest)
        cnet = op.checkpoint(module, x, memory_limit=limit, chain=chain)
        o_peak, o_time, o_grads = measure(cnet, module, x, repeats)
        same = all(torch.equal(a, b) for a, b in zip(o_grads, plain_grads, strict=True))
        pred_optmem = cnet.expected_makespan
        lines.append(
            f"| {k} | {format_size(limit)}{'*' if limit > sim.peak_memory else ''} | "
            f"{format_size(t_peak)} | "
            f"{format_size(o_peak)} | {t_time:.0f} | {o_time:.0f} | {o_time / t_time:.2f} | "
            f"{sim.makespan:.1f} | {pred_optmem:.1f} | {pred_optmem / sim.makespan:.3f} | "
            f"{'yes' if same else 'NO'} |")
    lines += ["", "`*`: the torch plan's predicted peak was infeasible for the DP after rounding "
              "sizes to units; the smallest feasible limit (marginally above) is used."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy CNN only, 2 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", help="also write the tables to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    runs = [("toy-cnn", {"batch": 32})]
    if not args.quick:
        runs += [("resnet18", {"batch": 4})]
    out = [f"torch {torch.__version__}, CPU, 1 thread, median of "
           f"{2 if args.quick else args.repeats} steps", ""]
    for spec, kw in runs:
        try:
            module, x = resolve_spec(spec, **kw)
        except Exception as exc:  # noqa: BLE001 - a missing zoo model is skipped
            print(f"skipping {spec}: {exc}", file=sys.stderr)
            continue
        out += bench(spec, module, x, 2 if args.quick else args.repeats) + [""]
        print("\n".join(out[-12:]))
    text = "\n".join(out)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
