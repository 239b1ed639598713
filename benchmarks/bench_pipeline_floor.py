"""The waits floor (stop 57) against the loads-and-lifetimes floor, over every allocation.

For each instance of ``bench_pipeline_family.instances()`` (the six bench_exact pipeline
rows and the headline; stash model): the least floor over every allocation (GPUs numbered
by first use), below the best known plan (:data:`bench_pipeline_family.KNOWN`), with the
floor before stop 57 (``old``: ``rounds=0``, the lifetimes floor, what the method ``chunks``
uses) and with the waits floor (``new``: ``--rounds`` rounds of
:func:`~optmem.solvers.pipeline_chunks.waits_check` on complete allocations), as
:func:`~optmem.solvers.pipeline_chunks.allocations_bound` finds it (no allocation decided,
``low = 0``, its deterministic work limit of prefixes); and, with ``--count``, how many
allocations have a floor below the known plan (stopped at ``--max``).

Usage::

    python benchmarks/bench_pipeline_floor.py [--count [--max N]] [--only NAME ...]
        [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from optmem.models.pipeline import make_units
from optmem.solvers import pipeline_chunks as chunked

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline_family import KNOWN, instances  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", action="store_true")
    parser.add_argument("--max", type=int, default=2_000_000)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=chunked.WAIT_ROUNDS,
                        help="rounds of the waits floor (the new column)")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}")
    print("| instance | known plan | least floor old | least floor new |"
          + (" below plan old | below plan new |" if args.count else ""))
    print("|---|---|---|---|" + ("---|---|" if args.count else ""))
    for name, problem in instances():
        if args.only and name not in args.only:
            continue
        units = make_units(problem)
        memory = problem.memory_per_gpu
        cap = KNOWN[name] * (1 - chunked.PROOF_STEP)
        row = [name, f"{KNOWN[name]:.2f}"]
        counts = []
        for rounds in (0, args.rounds):
            start = time.perf_counter()
            least = chunked.allocations_bound(units, problem.n_gpus, memory, 0.0, cap,
                                              rounds=rounds)
            row.append(f"{least:.2f} ({time.perf_counter() - start:.0f} s)")
            if args.count:
                start = time.perf_counter()
                k = 0
                for k, _ in enumerate(chunked.chunk_allocations(
                        units, problem.n_gpus, units.n, cap, memory, rounds=rounds), 1):
                    if k >= args.max:
                        break
                counts.append(f"{k:,}{'+' if k >= args.max else ''} "
                              f"({time.perf_counter() - start:.0f} s)")
        print("| " + " | ".join(row + counts) + " |", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
