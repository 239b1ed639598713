"""Training with dynamic padding: one export for every length, against one export per length.

A GPT-2 (12 layers, hidden 128, random initialisation) wrapped by ``op.checkpoint`` at a
sample of length ``--max-len`` and a byte limit (60 % of that sample's store-all peak), then
trained ``--steps`` steps whose lengths are drawn uniformly from ``[--min-len, --max-len]``
(fixed seed: the same lengths for every setting), as a ``DataCollatorWithPadding`` batch
pads to the longest sequence of each batch. Settings, each in a fresh subprocess:

* ``dynamic=False`` (the code before: every new length exported, profiled and solved, the
  last ``MAX_VARIANTS`` kept);
* ``dynamic=True`` (the default now: one export with the length dynamic, each length
  profiled and solved once, a length at most ``SIZE_SLACK`` times shorter than a solved one
  runs its plan);
* the plain model (no plan: the floor).

Printed: total and per-step seconds (CPU and wall, one thread), exports, profiles, and the
ratio of each setting to ``dynamic=False``. The counts are machine-independent; the times
are this machine's.

Usage::

    python benchmarks/bench_dynamic_sizes.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(setting: str, steps: int, min_len: int, max_len: int, seed: int) -> dict[str, object]:
    """Train ``steps`` steps in this process; the timings and counts of ``setting``."""
    import torch
    import transformers

    import optmem.pytorch as op
    from optmem.pytorch import extract, profile

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    counts = {"exports": 0, "profiles": 0}
    export, prof = extract._export_program, profile.profile_stages

    def counting_export(*args: object, **kwargs: object) -> object:
        counts["exports"] += 1
        return export(*args, **kwargs)  # type: ignore[arg-type]

    def counting_profile(*args: object, **kwargs: object) -> object:
        counts["profiles"] += 1
        return prof(*args, **kwargs)  # type: ignore[arg-type]

    extract._export_program = counting_export  # type: ignore[assignment]
    profile.profile_stages = counting_profile  # type: ignore[assignment]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=128, n_head=4, vocab_size=1000,
                                     n_positions=max_len)
    model = transformers.GPT2LMHeadModel(config).train()
    rng = torch.Generator().manual_seed(seed)

    def batch(length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1000, (4, length), generator=rng)
        return {"input_ids": ids, "labels": ids}

    lengths = torch.randint(min_len, max_len + 1, (steps,), generator=rng).tolist()
    start_cpu, start = time.process_time(), time.perf_counter()
    call = model
    if setting != "plain":
        chain = op.profile_chain(model, batch(max_len), repeats=1, warmup=0)
        call = op.checkpoint(model, batch(max_len), memory_limit=int(0.6 * chain.store_all_peak()),
                             dynamic=setting == "dynamic", repeats=1, warmup=0)
    wrap_cpu, wrap = time.process_time() - start_cpu, time.perf_counter() - start
    for length in lengths:
        call(**batch(length)).loss.backward()
        model.zero_grad(set_to_none=True)
    return {"setting": setting, "cpu_s": time.process_time() - start_cpu,
            "wall_s": time.perf_counter() - start, "wrap_cpu_s": wrap_cpu, "wrap_wall_s": wrap,
            "distinct_lengths": len(set(lengths)), **counts}


def main() -> None:
    """Run every setting in a subprocess and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(args.one, args.steps, args.min_len, args.max_len, args.seed)))
        return
    rows = []
    for setting in ("static", "dynamic", "plain"):
        out = subprocess.run([sys.executable, __file__, "--one", setting, "--steps",
                              str(args.steps), "--min-len", str(args.min_len), "--max-len",
                              str(args.max_len), "--seed", str(args.seed)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{args.steps} steps, lengths {args.min_len}-{args.max_len} "
          f"({base['distinct_lengths']} distinct), batch 4, 1 thread")
    print("| setting | exports | profiles | CPU s (wrap) | CPU s total | wall s total | "
          "CPU vs dynamic=False |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        name = {"static": "dynamic=False", "dynamic": "dynamic=True", "plain": "plain"}[
            str(row["setting"])]
        print(f"| {name} | {row['exports']} | {row['profiles']} | {row['wrap_cpu_s']:.1f} | "
              f"{row['cpu_s']:.1f} | {row['wall_s']:.1f} | "
              f"{float(row['cpu_s']) / float(base['cpu_s']):.3f} |")


if __name__ == "__main__":
    main()
