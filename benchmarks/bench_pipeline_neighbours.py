"""The headline's best plans against every allocation within a few unit moves of them.

The chunk scan (``benchmarks/results/pipeline_exact.md``, stops 44-46) proves the headline's
31.39 ms (ResNet-50, 21 units, 4 GPUs, 3 GiB, 12 GB/s, stash model) optimal among plans whose
GPUs hold at most two runs of consecutive layers; stop 45 asked the allocations with one
three-chunk GPU at 5 deterministic seconds each (none better, 5 % undecided). This script asks
the allocations *near* the best plans instead, whatever their chunk count: every allocation
that reassigns at most ``--moves`` units of a seed allocation (GPUs renumbered by first use),
whose :func:`~optmem.solvers.pipeline_chunks.allocation_floor` lies below the cutoff (the
seed's period less the scan's step), and that has a GPU with three or more chunks (the others
are the two-chunk family, decided). Each is asked by
:func:`~optmem.solvers.pipeline_chunks.ask_family` (the chunk scan's pass: the exact model
with the allocation fixed, CP-SAT, one worker, ``--work`` deterministic seconds, any plan at
or below the cutoff; undecided ones once more with ``--retry``), by increasing floor. With
``--skip-moves J`` the allocations within ``J`` moves are left out (asked by an earlier run).

The result is deterministic (one worker, deterministic work, fixed seed): the same
allocations at the same cutoffs and the same verdicts on any machine; CPU and wall seconds
and the load are recorded beside it.

Usage::

    python benchmarks/bench_pipeline_neighbours.py [--moves K] [--skip-moves J]
        [--work S] [--retry S] [--seeds G,G,... ...] [--count-only]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from optmem.datasets import resolve_chain
from optmem.models.pipeline import Units, first_use, make_units
from optmem.result import SolveOptions
from optmem.solvers import pipeline_chunks
from optmem.solvers.pipeline_common import replayed_period, run_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import uptime  # noqa: E402
from bench_pipeline_exact import headline_problem  # noqa: E402

SEEDS = ("0,0,0,1,2,2,3,3,3,3,1,1,1,1,0,0,0,0,0,0,0", "0,1,1,2,0,0,3,3,3,3,2,2,2,2,1,1,1,1,1,1,1")
"""Two of the headline's 31.3896 allocations (stop 42's search, stop 44's scan; unit = layer
except units 19 = layers 20-21 and 20 = layer 22)."""


def chunk_counts(gpu: Sequence[int], n_gpus: int) -> list[int]:
    """Runs of consecutive units on each GPU."""
    count = [0] * n_gpus
    for q, g in enumerate(gpu):
        count[g] += q == 0 or gpu[q - 1] != g
    return count


def neighbours(seed: Sequence[int], moves: int, n_gpus: int) -> set[tuple[int, ...]]:
    """Allocations that reassign 1..``moves`` units of ``seed`` (numbered by first use)."""
    found: set[tuple[int, ...]] = set()
    for k in range(1, moves + 1):
        for units in itertools.combinations(range(len(seed)), k):
            for gpus in itertools.product(range(n_gpus), repeat=k):
                if any(seed[q] == g for q, g in zip(units, gpus, strict=True)):
                    continue
                gpu = list(seed)
                for q, g in zip(units, gpus, strict=True):
                    gpu[q] = g
                found.add(first_use(gpu))
    return found


def family(
    units: Units,
    seeds: Iterable[Sequence[int]],
    moves: int,
    skip: int,
    n_gpus: int,
    memory: int,
    cutoff: float,
) -> tuple[list[tuple[float, tuple[int, ...]]], Counter[str]]:
    """The neighbourhood's allocations to ask (by floor), and counts of what was left out."""
    near: set[tuple[int, ...]] = set()
    done: set[tuple[int, ...]] = set()
    for seed in seeds:
        near |= neighbours(seed, moves, n_gpus)
        if skip:
            done |= neighbours(seed, skip, n_gpus)
    counts: Counter[str] = Counter(distinct=len(near - done))
    asked = []
    for gpu in sorted(near - done):
        floor = pipeline_chunks.allocation_floor(units, gpu, n_gpus, memory, cutoff)
        if floor >= cutoff:
            counts["floor at or above the cutoff"] += 1
        elif max(chunk_counts(gpu, n_gpus)) <= 2:
            counts["two-chunk (decided)"] += 1
        else:
            chunks = sorted(chunk_counts(gpu, n_gpus))
            counts["one 3-chunk GPU" if chunks[-1] == 3 and chunks[-2] <= 2 else "more"] += 1
            asked.append((floor, gpu))
    asked.sort()
    return asked, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moves", type=int, default=3)
    parser.add_argument("--skip-moves", type=int, default=0)
    parser.add_argument("--work", type=float, default=pipeline_chunks.CHUNK_WORK)
    parser.add_argument("--retry", type=float, default=30.0)
    parser.add_argument("--seeds", nargs="+", default=list(SEEDS))
    parser.add_argument("--count-only", action="store_true")
    args = parser.parse_args()
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    units = make_units(problem)
    seeds = [first_use([int(g) for g in s.split(",")]) for s in args.seeds]
    cpu, wall, load = time.process_time(), time.perf_counter(), uptime()
    opts = SolveOptions(threads=1, deterministic_time=args.work, seed=0)
    run = run_model(problem, "cpsat", opts, units=units, gpu=list(seeds[0]), upper_bound=31.5)
    period = math.inf if run.plan is None else replayed_period(problem, run.plan)
    assert period is not None and run.plan is not None, "the first seed has no plan <= 31.5"
    cutoff = period * (1 - pipeline_chunks.CHUNK_STEP)
    asked, counts = family(
        units, seeds, args.moves, args.skip_moves, problem.n_gpus, problem.memory_per_gpu, cutoff
    )
    print(
        f"seed period {period!r} ({run.status.value}), cutoff {cutoff:.6f}; "
        f"moves {args.skip_moves + 1}..{args.moves}: {dict(counts)}",
        flush=True,
    )
    if args.count_only:
        return
    out = pipeline_chunks.ask_family(
        problem,
        units,
        period,
        run.plan,
        asked,
        work=args.work,
        step=pipeline_chunks.CHUNK_STEP,
        retry=args.retry,
    )
    bound = "-" if math.isnan(out.bound) else f"{out.bound:.4f}"
    print(
        "| moves | asked | refuted | undecided | plans below the cutoff | bound of these | "
        "best period | CPU s | wall s | load (start / end) |"
    )
    print(
        f"| {args.skip_moves + 1}..{args.moves} | {out.evaluated} | {out.refuted} | "
        f"{out.undecided} | {len(out.improvements)} | {bound} | {out.period:.4f} | "
        f"{time.process_time() - cpu:.0f} | {time.perf_counter() - wall:.0f} | "
        f"{load} / {uptime()} |"
    )
    if out.improvements and out.plan is not None:
        print("improvements", out.improvements, "plan", out.plan.to_dict())


if __name__ == "__main__":
    main()
