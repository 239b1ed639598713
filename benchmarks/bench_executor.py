"""Per-stage overhead of the checkpoint executor (issue 13.6), on the HF configs of bench_hf.

For BERT and GPT-2 (the builders of :mod:`bench_hf`), measures the **process CPU time** of
one training step (``torch.set_num_threads(1)``, medians of interleaved rounds after a
warm-up) of:

* ``plain``: the unmodified model;
* ``store-all native``: optmem at the store-all limit (the whole plan stripped, the stages
  run as ordinary autograd code: the cost of the extracted graph alone);
* ``store-all plan``: the same plan run by the executor (``strip_suffix=False``): every
  stage goes through ``F_all``/``B``, so its ratio to ``plain`` is the executor overhead;
* ``mid plan``: optmem's plan at the limit halfway between its smallest and store-all;
* ``per-layer ckpt``: ``torch.utils.checkpoint`` around every layer (reference);
* ``... unfused``: the two plans run with ``fuse_stages=False`` (every stage its own
  autograd graph and ``autograd.grad`` call: the executor before stage fusion).

Every optmem setting's gradients are checked bitwise equal to the plain model's.

Usage::

    PYTHONPATH=. python benchmarks/bench_executor.py [--rounds 9] [--models bert,gpt2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_hf  # noqa: E402

import optmem.pytorch as op  # noqa: E402

MODELS = {s.name: s for s in bench_hf.FULL}


def step_cpu_ms(call: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> float:
    """Process CPU milliseconds of one training step (gradients reset outside)."""
    model.zero_grad(set_to_none=True)
    c0 = time.process_time()
    bench_hf.train_step(call, model, batch)
    cpu = time.process_time() - c0
    model.zero_grad(set_to_none=True)
    return cpu * 1e3


@contextmanager
def _plan(cmodel: Any, plan: tuple[str, ...], strip: bool, fuse: bool = True
          ) -> Iterator[Any]:
    executor = cmodel.executor
    saved = executor.strip_suffix, executor.fuse_stages
    executor.strip_suffix, executor.fuse_stages = strip, fuse
    executor.set_plan(plan)
    try:
        yield cmodel
    finally:
        executor.strip_suffix, executor.fuse_stages = saved
        executor.set_plan(plan)


def _run_lengths(plan: tuple[str, ...], n: int) -> list[int]:
    """Lengths of the runs the executor fuses in ``plan`` (its prefix, suffix stripped)."""
    from optmem.plan import parse_plan
    from optmem.pytorch.execute import fusable_runs, split_suffix

    prefix, j = split_suffix(parse_plan(plan), n)
    return [b - a + 1 for a, b, _, _ in fusable_runs(prefix, j - 1)] if j > 1 else []


def settings(name: str) -> tuple[nn.Module, dict[str, Any],
                                  dict[str, Callable[[], Any]]]:
    """The model, its batch and the settings to time (context managers yielding a call)."""
    model, batch = bench_hf.build(MODELS[name])
    chain = op.profile_chain(model, batch, repeats=3)
    top = int(chain.store_all_peak() * 1.02) + 1
    cmodel = op.checkpoint(model, batch, memory_limit=top, chain=chain)
    n = chain.length
    store_all = (*(f"F_all {i}" for i in range(1, n + 1)), "Loss",
                 *(f"B {i}" for i in range(n, 0, -1)))
    low = op.smallest_limit(chain)
    cmodel.resolve(memory_limit=(low + top) // 2)
    mid = tuple(cmodel.result.plan)
    print(f"{name}: {chain.length} stages; mid plan {len(mid)} ops "
          f"({sum(o.startswith('F_all') for o in mid)} F_all, "
          f"{sum(not o.startswith(('F_all', 'B', 'Loss')) for o in mid)} F_ck/F_none; "
          f"fusable runs of {_run_lengths(mid, n)} stages)")
    return model, batch, {
        "plain": lambda: bench_hf.store_all(model),
        "store-all native": lambda: _plan(cmodel, store_all, True),
        "store-all plan": lambda: _plan(cmodel, store_all, False),
        "mid plan": lambda: _plan(cmodel, mid, True),
        "store-all plan unfused": lambda: _plan(cmodel, store_all, False, False),
        "mid plan unfused": lambda: _plan(cmodel, mid, True, False),
        "per-layer ckpt": lambda: bench_hf.per_layer(model, 1),
    }


def check_gradients(model: nn.Module, batch: dict[str, Any],
                    runs: dict[str, Callable[[], Any]]) -> None:
    """Every optmem setting's gradients bitwise equal to the plain model's."""
    ref = bench_hf.gradients(model, model, batch)
    for label, enter in runs.items():
        if label in ("plain", "per-layer ckpt"):
            continue
        with enter() as call:
            got = bench_hf.gradients(call, model, batch)
        if bench_hf.grad_difference(got, ref) != 0.0:
            raise AssertionError(f"{label} changed the gradients")


def measure(name: str, rounds: int) -> dict[str, float]:
    """Median CPU ms per step of every setting (interleaved rounds after one warm-up)."""
    model, batch, runs = settings(name)
    check_gradients(model, batch, runs)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds + 1):
        for label, enter in runs.items():
            with enter() as call:
                ms = step_cpu_ms(call, model, batch)
            if r:
                times[label].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["plain"]
    for k, v in med.items():
        print(f"  {k:18s} {v:8.1f} ms  x{v / base:.3f}")
    print(f"  executor overhead (store-all plan / native): "
          f"x{med['store-all plan'] / med['store-all native']:.3f} "
          f"(unfused x{med['store-all plan unfused'] / med['store-all native']:.3f}); "
          f"mid plan / per-layer ckpt: x{med['mid plan'] / med['per-layer ckpt']:.3f}")
    return med


def main(argv: list[str] | None = None) -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--models", default="bert,gpt2")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        measure(name, args.rounds)


if __name__ == "__main__":
    main()
