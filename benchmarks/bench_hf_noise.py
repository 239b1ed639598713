"""Where bench_hf's step-time noise comes from: the same settings timed four ways.

For one model of ``bench_hf`` (GPT-2 by default) three settings (store-all, HF's
checkpointing, optmem's plan halfway between its smallest limit and store-all) are timed in
interleaved rounds, each in four ways inside the same rounds:

* ``one step``: one step per setting and round (bench_hf before the fix);
* ``gc off``: the same, with ``gc.collect()`` before the step and the collector off during it;
* ``min of 3``: the fastest of three steps in a row;
* ``gc off, min of 3``: both (what bench_hf does now).

The whole comparison runs twice, in two child processes: under glibc malloc's defaults and
under ``bench_hf.MALLOC_ENV`` (glibc reads it at start-up). Each row gives the median CPU time,
the interquartile range and the minor page faults per step (``ru_minflt``).

Usage::

    PYTHONPATH=. python benchmarks/bench_hf_noise.py --markdown benchmarks/results/hf_noise.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"one step": (False, 1), "gc off": (True, 1), "min of 3": (False, 3),
            "gc off, min of 3": (True, 3)}


def child(name: str, rounds: int) -> dict[str, Any]:
    """Time the settings in this process (its malloc settings are the environment's)."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_hf as b

    import optmem.pytorch as op

    torch.set_num_threads(1)
    spec = {s.name: s for s in b.FULL}[name]
    model, batch = b.build(spec)
    chain = op.profile_chain(model, batch, repeats=3)
    top = int(chain.store_all_peak() * 1.02) + 1
    cmodel = op.checkpoint(model, batch, memory_limit=top, chain=chain)
    halfway = (op.smallest_limit(chain) + top) // 2
    plan = tuple(cmodel.resolve(memory_limit=halfway).plan)
    settings = {"store-all": lambda: b.store_all(model), "HF": lambda: b.hf_checkpointing(model),
                "optmem halfway": lambda: b._with_plan(cmodel, plan, halfway)}
    cpu: dict[str, list[float]] = {f"{s}|{v}": [] for s in settings for v in VARIANTS}
    faults: dict[str, list[float]] = {k: [] for k in cpu}
    for r in range(rounds + 1):
        for s, enter in settings.items():
            for v, (gc_off, k) in VARIANTS.items():
                with enter() as call:
                    t = b.timed_steps(call, model, batch, k, gc_off=gc_off)
                if r:
                    cpu[f"{s}|{v}"].append(t.cpu)
                    faults[f"{s}|{v}"].append(t.faults)
    return {"cpu": cpu, "faults": faults, "load": os.getloadavg()[0],
            "malloc": {k: os.environ[k] for k in b.MALLOC_ENV if k in os.environ}}


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:  # one round: no spread to measure
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[2] - q[0]


def run(name: str, rounds: int) -> list[dict[str, Any]]:
    """Both children, glibc defaults first."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_hf import MALLOC_ENV

    out = []
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    for env in (base, {**base, **MALLOC_ENV}):
        done = subprocess.run([sys.executable, __file__, "--child", name, "--rounds",
                               str(rounds)], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"bench_hf_noise: the child process failed:\n{done.stderr}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def report(name: str, rounds: int, runs: list[dict[str, Any]]) -> str:
    """One table, a row per malloc setting, setting and way of timing."""
    rows = [f"# bench_hf's noise: {name}, {rounds} interleaved rounds", "",
            "Produced by `PYTHONPATH=. python benchmarks/bench_hf_noise.py` (see its "
            "docstring). CPU ms of one training step, `torch.set_num_threads(1)`.", "",
            "| malloc | setting | timing | median ms | IQR ms | IQR / median "
            "| page faults / step |",
            "|---|---|---|---|---|---|---|"]
    for res in runs:
        malloc = ", ".join(f"{k}={v}" for k, v in res["malloc"].items()) or "glibc defaults"
        malloc += f" (load {res['load']:.1f})"
        for key, xs in res["cpu"].items():
            setting, variant = key.split("|")
            med, iqr = statistics.median(xs), _iqr(xs)
            rows.append(f"| {malloc} | {setting} | {variant} | {med:.1f} | {iqr:.1f} | "
                        f"{100 * iqr / med:.1f} % | "
                        f"{statistics.median(res['faults'][key]):.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """Run both children and print (or write) the table."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="gpt2", help="gpt2, llama or bert")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--markdown", help="write the table to this file")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.rounds)))
        return
    text = report(args.model, args.rounds, run(args.model, args.rounds))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
