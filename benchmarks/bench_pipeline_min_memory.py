"""The smallest memory per GPU of a contiguous pipeline plan: the DP against the search.

    python benchmarks/bench_pipeline_min_memory.py [--quick] [--cap 300] [--out FILE.md]

``contiguous`` answers an infeasible limit with the smallest feasible memory per GPU
(``optmem.solvers.pipeline.min_memory_contiguous``). Until stop 75 that was a doubling
search and a bisection over ``best_contiguous`` (its whole period search at each step); it is
now a min-max partition DP. Both run here side by side on bundled profiles, 4 GPUs, 12 GB/s
(the search in a child process killed after ``--cap`` seconds): seconds, the ratio, and
whether the thresholds agree.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from _common import print_and_write, uptime

from optmem.datasets import load_dataset
from optmem.problems.pipeline import PipelineProblem
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.pipeline import min_memory_contiguous

PROFILES = ("resnet50-b32-224", "resnet101-b32-224", "densenet121-b32-224",
            "resnet1001-b8-224")


def _search_child(name: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    began = time.perf_counter()
    value = contig.min_memory_by_search(PipelineProblem(load_dataset(name), 4, 1, "12GB/s"))
    out.put((value, time.perf_counter() - began))


def row(name: str, cap: float) -> str:
    """One profile: the DP, then the search (capped), in this order."""
    problem = PipelineProblem(load_dataset(name), 4, 1, "12GB/s")
    began = time.perf_counter()
    least = min_memory_contiguous(problem)
    dp_s = time.perf_counter() - began
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    child = mp.Process(target=_search_child, args=(name, queue))
    child.start()
    child.join(cap)
    if child.is_alive():
        child.kill()
        child.join()
        return (f"| {name} | {problem.layers.n} | {least:,} | {dp_s:.3f} | > {cap:.0f} "
                f"(killed) | > {cap / dp_s:.0f}x | - |")
    value, search_s = queue.get()
    return (f"| {name} | {problem.layers.n} | {least:,} | {dp_s:.3f} | {search_s:.1f} | "
            f"{search_s / dp_s:.0f}x | {'yes' if value == least else 'NO: ' + str(value)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ResNet-50 only")
    parser.add_argument("--cap", type=float, default=300.0, help="seconds before the search "
                                                                 "is killed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    began = uptime()
    lines = ["| profile | L | threshold (B) | DP s | search s | ratio | same |",
             "|---|---|---|---|---|---|---|"]
    for name in PROFILES[:1] if args.quick else PROFILES:
        lines.append(row(name, args.cap))
        print(lines[-1], flush=True)
    print_and_write(f"load {began} before, {uptime()} after\n\n" + "\n".join(lines) + "\n",
                    args.out)


if __name__ == "__main__":
    main()
