"""GPT-2 large on two nodes of 8 GPUs: simulated pipeline plans (docs/distributed.md).

    python benchmarks/bench_distributed.py [--quick] [--time-limit 60]

The bundled profile ``gpt2-large-b2-1024`` (one micro-batch of 2 x 1024 tokens, float32,
V100 roofline times) is planned for P = 16 GPUs (two nodes) and P = 8 (one node) with 16 GiB
per GPU, 4 weight copies (weights, gradients, Adam's two moments: synchronous training) and
one link bandwidth: 12 GB/s (PCIe 3.0 inside a node, EDR InfiniBand between nodes) and, as
the optimistic bracket of NVLink nodes, 150 GB/s. Every plan is replayed by the simulator
(the facade does it); the table gives the period (ms per micro-batch), the ratio to the best
plan of the row and each solver's wall time. MadPipe (about 20 minutes on the 2 shared cores)
runs for the first setting only; ``--quick`` skips it.
"""

from __future__ import annotations

import argparse
import os
import time

from optmem.datasets import load_dataset
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions
from optmem.solvers.facade import solve

CHAIN = "gpt2-large-b2-1024"
MEMORY = 16 * 2**30
COPIES = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="no MadPipe (minutes per setting)")
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds per engine call of MadPipe's phase 2 (default 60)")
    args = ap.parse_args()
    chain = load_dataset(CHAIN)
    methods = ["equal", "pipedream", "contiguous"] + ([] if args.quick else ["madpipe"])
    settings = [(16, "12GB/s"), (16, "150GB/s"), (8, "12GB/s")]
    print(f"{CHAIN}: {chain.length} layers, {sum(chain.weight_size) / 2**30:.2f} GiB of "
          f"weights, compute {chain.total_compute_time():.0f} ms per micro-batch; 16 GiB per "
          f"GPU, {COPIES} weight copies; load average {os.getloadavg()[0]:.1f}")
    print("| GPUs | bandwidth | " + " | ".join(methods) + " | PipeDream / best | "
          "solve times (s) |")
    print("|---|---|" + "---|" * len(methods) + "---|---|")
    for gpus, bandwidth in settings:
        problem = PipelineProblem(chain, gpus, MEMORY, bandwidth,
                                  weight_copies=COPIES)
        periods, times = {}, {}
        for method in methods:
            if method == "madpipe" and (gpus, bandwidth) != settings[0]:
                periods[method], times[method] = float("nan"), 0.0  # 20 minutes each
                continue
            start = time.perf_counter()
            result = solve(problem, method,
                           options=SolveOptions(time_limit_s=args.time_limit, threads=1))
            times[method] = time.perf_counter() - start
            periods[method] = result.objective if result.status.has_plan else float("nan")
        best = min(v for v in periods.values() if v == v)
        cells = " | ".join(f"{periods[m]:.1f}" if periods[m] == periods[m] else "-"
                           for m in methods)
        print(f"| {gpus} | {bandwidth} | {cells} | {periods['pipedream'] / best:.2f} | "
              + ", ".join(f"{m} {times[m]:.1f}" for m in methods) + " |")
    lower = chain.total_compute_time() / 16
    print(f"lower bound for 16 GPUs (total compute / 16): {lower:.1f} ms")


if __name__ == "__main__":
    main()
