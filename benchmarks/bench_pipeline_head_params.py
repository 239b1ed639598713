"""The head pass's questions: CP-SAT's defaults against ``head_question`` (``HEAD_PARAMETERS``).

The headline instance (ResNet-50, 21 units, 4 GPUs, 3 GiB, 12 GB/s) at its proven optimum
31.3896: for each head length given, ``--sample`` heads drawn with a fixed seed among those
:func:`~optmem.solvers.pipeline_chunks.chunk_allocations` lists at that length (no head
refuted before), each asked the head pass's question (the later units delayed,
:func:`~optmem.models.pipeline.delay_tail`; one CP-SAT worker, 5 deterministic seconds) with
CP-SAT's default parameters and as the method asks it
(:func:`~optmem.solvers.pipeline_chunks.head_question`:
:data:`~optmem.solvers.pipeline_chunks.HEAD_PARAMETERS`, then the defaults if that run
leaves the head open), in alternating order (the defaults first when ``i`` is even), both
without the stash counts' rows (``STASH_FLOORS`` off: this script measures the parameters
alone; ``bench_pipeline_stash_floors.py`` measures the rows).
Prints the CPU seconds of each, their ratio, the median of the per-head ratios, and how
many heads got the same answer (refuted or not; the others to stderr). ``--whole``: whole
allocations of the complete family (every 97th of the first 400,000 listed) instead of
heads, asked at the same cutoff (there the method keeps the defaults).
CPU seconds are the process's (the questions run on one CP-SAT worker, in this thread).

Usage::

    python benchmarks/bench_pipeline_head_params.py [--lengths 12 14 16] [--sample 40]
        [--whole]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from optmem.datasets import resolve_chain
from optmem.models.pipeline import delay_tail, make_units
from optmem.problems.pipeline import PipelineProblem
from optmem.solvers import pipeline_chunks
from optmem.solvers.pipeline_common import lower_bound, refute

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline_exact import headline_problem  # noqa: E402

OPTIMUM = 31.3896  # proven in stop 63
SEED = 2


def samples(problem: PipelineProblem, lengths: list[int], size: int, whole: bool
            ) -> Iterator[tuple[str, list[tuple[int, ...]]]]:
    """``(label, heads)`` per length (or whole allocations), ``size`` drawn with :data:`SEED`."""
    units = make_units(problem)
    memory = pipeline_chunks.floor_memory(problem)
    for length in ([units.n] if whole else lengths):
        if whole:
            pool = list(itertools.islice(pipeline_chunks.chunk_allocations(
                units, problem.n_gpus, units.n, OPTIMUM, memory), 0, 400_000, 97))
            label = "whole allocations"
        else:
            pool = list(pipeline_chunks.chunk_allocations(units, problem.n_gpus, units.n,
                                                          OPTIMUM, memory, depth=length))
            label = f"heads of {length} units"
        yield label, random.Random(SEED).sample(pool, min(size, len(pool)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[12, 14, 16])
    parser.add_argument("--sample", type=int, default=40)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    pipeline_chunks.STASH_FLOORS = False
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    units = make_units(problem)
    cutoff = OPTIMUM * (1 - pipeline_chunks.PROOF_STEP)
    low = lower_bound(problem)

    def ask(gpu: tuple[int, ...], method: bool) -> tuple[float, str]:
        relaxed, alloc = (units, gpu) if args.whole else delay_tail(units, gpu)
        start = time.process_time()
        if method and not args.whole:
            bound = pipeline_chunks.head_question(problem, relaxed, alloc, cutoff, work=5.0,
                                                  seed=0, deadline=None, lower=low)
        else:
            _, bound = refute(replace(problem, n_gpus=max(alloc) + 1),
                              pipeline_chunks._question_options(5.0, 0, None), cutoff,
                              units=relaxed, gpu=list(alloc), lower=low,
                              parameters=pipeline_chunks.HEAD_PARAMETERS if method else None)
        return time.process_time() - start, "refuted" if bound is not None else "not refuted"

    print("| questions | sample | default CPU s | the method's CPU s | ratio | "
          "median per-question ratio | same answer |")
    print("|---|---|---|---|---|---|---|")
    for label, picked in samples(problem, args.lengths, args.sample, args.whole):
        compare(label, picked, ask)


def compare(label: str, picked: list[tuple[int, ...]],
            ask: Callable[[tuple[int, ...], bool], tuple[float, str]]) -> None:
    """Ask each of ``picked`` both ways (``ask(gpu, False)`` the baseline), interleaved.

    Prints one table row: CPU seconds of each, their ratio, the median per-question ratio
    and how many got the same answer (the others to stderr).
    """
    spent = [0.0, 0.0]
    ratios, same = [], 0
    for i, gpu in enumerate(picked):
        order = [False, True]
        runs = [ask(gpu, m) for m in (order if i % 2 == 0 else order[::-1])]
        base, tuned = runs if i % 2 == 0 else runs[::-1]
        spent[0] += base[0]
        spent[1] += tuned[0]
        ratios.append(tuned[0] / max(base[0], 1e-9))
        same += base[1] == tuned[1]
        if base[1] != tuned[1]:
            print(f"{label}: {gpu}: baseline {base[1]} ({base[0]:.1f} s), "
                  f"the other {tuned[1]} ({tuned[0]:.1f} s)", file=sys.stderr)
    print(f"| {label} | {len(picked)} | {spent[0]:.1f} | {spent[1]:.1f} | "
          f"{spent[1] / spent[0]:.3f} | {statistics.median(ratios):.3f} | "
          f"{same} / {len(picked)} |", flush=True)

if __name__ == "__main__":
    main()
