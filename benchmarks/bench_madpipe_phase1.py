"""MadPipe's phase 1 at L = 56, P = 8: this tree against another, interleaved, same results.

For ResNet-152 (L = 56), P = 8, 12 GB/s and the memories of ``bench_madpipe.py``, each run
calls Algorithm 8 (``pipeline_madpipe.algorithm8``) at all 10 memory factors of the ladder
(``MEMORY_FACTORS``; a solve stops earlier at 8 and 16 GiB) and reports its CPU seconds
(``time.process_time``) and, per factor, the estimate, T-hat, allocation and DP states.
With ``--against DIR`` (another checkout's root, e.g. made by ``git worktree add``), the
two trees run alternately in fresh subprocesses, ``--repeat`` times each per memory, and
the table gives the medians and whether every rung agreed (states included).

Usage::

    python benchmarks/bench_madpipe_phase1.py --memory 6 --against /tmp/main-checkout
    python benchmarks/bench_madpipe_phase1.py --against ../main --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
PROFILE, GPUS, BANDWIDTH = "resnet152-b32-224", 8, "12GB/s"


def phase1(memory_gib: float) -> dict[str, object]:
    """Algorithm 8 at every memory factor (this process's ``optmem``): CPU s and rungs."""
    from optmem.cli_problems import parse_pipeline_bandwidth
    from optmem.datasets import resolve_chain
    from optmem.problems.pipeline import PipelineProblem
    from optmem.solvers import pipeline_madpipe as mp
    from optmem.solvers.pipeline_common import scaled

    chain = resolve_chain(PROFILE)
    bw = parse_pipeline_bandwidth(BANDWIDTH, chain.time_unit)
    problem = PipelineProblem(chain, GPUS, int(memory_gib * GIB), chain_bandwidth=bw)
    rungs, start = [], time.process_time()
    for factor in mp.MEMORY_FACTORS:
        sub = problem if factor == 1.0 else scaled(problem, factor)
        est, that, alloc, states = mp.algorithm8(sub, exact=False)
        rungs.append([factor, est, that, str(alloc), states])
    return {"cpu": time.process_time() - start, "rungs": rungs}


def measure(root: Path, memory_gib: float) -> dict[str, object]:
    """:func:`phase1` in a fresh subprocess importing ``optmem`` from ``root``."""
    code = (f"import sys, json; sys.path.insert(0, {str(root)!r}); "
            f"sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"from bench_madpipe_phase1 import phase1; print(json.dumps(phase1({memory_gib})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", nargs="+", type=float, default=[2, 3, 4, 6, 8, 12, 16],
                        help="memories per GPU in GiB")
    parser.add_argument("--against", type=Path, help="root of another checkout (old)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per tree and memory")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # here only: the measured subprocesses import no benchmark
    from benchmarks._common import uptime

    trees = [("new", ROOT)] + ([("old", args.against.resolve())] if args.against else [])
    print(f"load average at the start: {uptime()}", flush=True)
    print("| M (GiB) | DP states | " + " | ".join(
        f"phase 1 CPU {name} (s), runs" for name, _ in trees[::-1])
        + " | median " + " / ".join(name for name, _ in trees[::-1]) + " | same rungs |")
    print("|---" * (4 + len(trees)) + "|")
    for mem in args.memory:
        cpu: dict[str, list[float]] = {name: [] for name, _ in trees}
        rungs: dict[str, list[object]] = {}
        for _ in range(args.repeat):
            for name, root in trees[::-1]:  # old first, then new, alternately
                run = measure(root, mem)
                cpu[name].append(float(run["cpu"]))  # type: ignore[arg-type]
                if rungs.setdefault(name, run["rungs"]) != run["rungs"]:  # type: ignore[arg-type]
                    raise SystemExit(f"{name} is not deterministic at {mem} GiB")
        states = sum(r[4] for r in rungs["new"])  # type: ignore[index, misc]
        same = "yes" if len({json.dumps(r) for r in rungs.values()}) == 1 else "**NO**"
        runs = " | ".join(" ".join(f"{c:.2f}" for c in cpu[name]) for name, _ in trees[::-1])
        medians = " / ".join(f"{statistics.median(cpu[name]):.2f}" for name, _ in trees[::-1])
        print(f"| {mem:g} | {states} | {runs} | {medians} | {same} |", flush=True)
    print(f"load average at the end: {uptime()}")


if __name__ == "__main__":
    main()
