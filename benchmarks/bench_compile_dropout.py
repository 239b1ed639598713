"""Dropout masks under ``torch.compile``: the wrapper compiled against the plain model compiled.

Issue 13 item 2: with dropout on, ``torch.compile(cmodel, backend="aot_eager")`` of
``cmodel = optmem.pytorch.checkpoint(model, sample, memory_limit=...)`` gave another loss
than the model (eager, or compiled with the same backend). Cause: the wrapper compiled its
stages (and, on the store-all fast path, the model) with ``cmodel.compile``'s options, or
with *default* ones (inductor) when ``cmodel.compile`` was never called; inductor draws its
own random numbers (per-op seeds taken from the generator), not eager's Bernoulli masks.
The stages now take the enclosing compile's backend
(:func:`optmem.pytorch.execute.run_compiled`).

For tiny HF models (random init, ``tests/hf_helpers.py``, dropout 0.1, train mode, the
same ``torch.manual_seed`` before each step) and each compile setting, one training step:
the loss and the largest gradient difference of the wrapper compiled against the plain
model compiled with the same options, and against eager. Settings:

* ``aot_eager``: ``torch.compile(cmodel, backend="aot_eager")``;
* ``aot_eager, stages inductor``: ``cmodel.compile()`` first (default options), then
  ``torch.compile(cmodel, backend="aot_eager")``: the stages run inductor, as every
  ``torch.compile(cmodel, backend=...)`` did before the fix (the defect);
* ``inductor``: ``torch.compile(cmodel)`` (default options);
* ``inductor, fallback_random``: ``options={"fallback_random": True}``.

Inductor runs with ``compile_threads = 1`` (its compile work stays in this process, so
``time.process_time`` counts it). Nothing is timed but the whole row (CPU and wall).

Usage::

    PYTHONPATH=. nice -n 19 python benchmarks/bench_compile_dropout.py [--quick] \\
        [--markdown benchmarks/results/compile_dropout.md]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from _common import uptime  # noqa: E402
from hf_helpers import bert, gpt2, step  # noqa: E402

import optmem.pytorch as op  # noqa: E402

SETTINGS: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "aot_eager": ({"backend": "aot_eager"}, None),
    "aot_eager, stages inductor": ({"backend": "aot_eager"}, {}),
    "inductor": ({}, None),
    "inductor, fallback_random": ({"options": {"fallback_random": True}}, None),
}
"""Setting -> (options of ``torch.compile``, options of ``cmodel.compile`` or None)."""


def models(quick: bool) -> dict[str, Any]:
    """Name -> factory (4 layers)."""
    out = {"GPT-2": lambda: gpt2(n_layer=4)}
    if not quick:
        out["BERT"] = lambda: bert(num_hidden_layers=4)
    return out


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference of two steps' gradients."""
    return max(float((x - y).abs().max()) for x, y in zip(a[1], b[1], strict=True)
               if x is not None)


def row(name: str, factory: Any, limit: str, setting: str) -> dict[str, Any]:
    """One step per call; figures of one model, limit and compile setting."""
    outer, inner = SETTINGS[setting]
    cpu, wall = time.process_time(), time.perf_counter()
    load = uptime()
    torch._dynamo.reset()
    model, kwargs = factory()
    model.train()
    cmodel = op.checkpoint(model, kwargs, memory_limit=limit)
    ref = step(model, model, kwargs, seed=3)
    plain = step(torch.compile(model, **outer), model, kwargs, seed=3)
    torch._dynamo.reset()
    if inner is not None:
        cmodel.compile(**inner)
    got = step(torch.compile(cmodel, **outer), model, kwargs, seed=3)
    loss = got[0].loss.item()
    return {
        "model": name, "limit": limit, "fast": cmodel.fast_path_taken, "setting": setting,
        "eager": ref[0].loss.item(), "plain": plain[0].loss.item(), "wrapper": loss,
        "dloss_plain": abs(loss - plain[0].loss.item()), "dgrad_plain": max_diff(got, plain),
        "dloss_eager": abs(loss - ref[0].loss.item()), "dgrad_eager": max_diff(got, ref),
        "cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall, "load": load}


def markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    """The results section."""
    rev = subprocess.run(["git", "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True,
                         text=True, cwd=HERE, check=False).stdout.strip() or "?"
    day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Dropout masks under torch.compile (wrapper compiled vs plain model compiled)",
        "",
        f"`benchmarks/bench_compile_dropout.py{' --quick' if quick else ''}`, branch {rev}, "
        f"{day}, torch {torch.__version__}, 1 thread, `nice -n 19`. Tiny HF models (4 "
        "layers, hidden 32, random init), dropout 0.1, train mode, seed 3 before each step; "
        "`memory_limit=\"60%\"` (a plan that recomputes) or `\"100%\"` (the store-all fast "
        "path: the model itself runs). Losses of eager, of the plain model compiled and of "
        "the wrapper compiled with the same options; differences of the wrapper compiled "
        "(loss, largest gradient difference) against both. CPU s and wall s of the whole "
        "row (profiling, planning, compiling, three steps), load averages before it.",
        "",
        "| model | limit | setting | eager | plain compiled | wrapper compiled "
        "| vs plain: loss / grad | vs eager: loss / grad | CPU s | wall s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = f"{r['limit']}{' (fast path)' if r['fast'] else ''}"
        lines.append(
            f"| {r['model']} | {where} | {r['setting']} | {r['eager']:.6f} | {r['plain']:.6f} "
            f"| {r['wrapper']:.6f} | {r['dloss_plain']:.2g} / {r['dgrad_plain']:.2g} "
            f"| {r['dloss_eager']:.2g} / {r['dgrad_eager']:.2g} | {r['cpu']:.1f} "
            f"| {r['wall']:.1f} | {r['load']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the matrix and print (or write) the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2, 60 %%, aot_eager only")
    parser.add_argument("--markdown", type=Path, help="write the section to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    limits = ["60%"] if args.quick else ["60%", "100%"]
    settings = ["aot_eager", "aot_eager, stages inductor"] if args.quick else list(SETTINGS)
    rows = []
    for name, factory in models(args.quick).items():
        for limit in limits:
            for setting in settings:
                rows.append(row(name, factory, limit, setting))
                print(rows[-1], flush=True)
    text = markdown(rows, args.quick)
    if args.markdown:
        args.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
