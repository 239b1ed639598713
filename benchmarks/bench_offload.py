"""Offloading benchmark (issue 6): makespan / lower bound per method, memory and bandwidth.

For ResNet-like chains (``optmem.datasets.synthetic.resnet_like_chain``; every other stage
named ``conv`` so that the vDNN-conv baseline has something to select), the memory limit is
swept between the smallest feasible memory of the store-all sequence (0 %) and its peak
(100 %), as in thesis Fig. 3.5, for several link bandwidths. Every plan is replayed by the
simulator; the ratio is makespan / max(Prop. 3, OFF_frac) (1 = optimal). A second table
compares the heuristics with the exact CP-SAT optimum on small random chains.

Usage: ``python benchmarks/bench_offload.py [--quick] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

from optmem.datasets.synthetic import random_chain, resnet_like_chain
from optmem.problems.offload import OffloadProblem
from optmem.result import SolveOptions
from optmem.solvers.facade import solve
from optmem.solvers.offload_comm import Layers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import memory_grid  # noqa: E402

METHODS = ("greedy", "dp", "vdnn", "vdnn_conv", "offload_all")


def named(chain):
    names = tuple(f"conv{i}" if i % 2 == 1 else f"bn_relu{i}"
                  for i in range(1, chain.length + 1))
    return dataclasses.replace(chain, stage_names=names)


def sweep(chain, alphas, bandwidths, options):
    lay = Layers.of(chain)
    rows = []
    for bw, beta, alpha, memory in memory_grid(chain, lay.min_memory(), lay.peak(), alphas,
                                               bandwidths):
        problem = OffloadProblem(chain, memory, chain_bandwidth=beta)
        row = {"bandwidth": bw, "alpha": alpha, "memory": memory}
        for method in METHODS:
            start = time.perf_counter()
            result = solve(problem, method, options=options)
            elapsed = time.perf_counter() - start
            assert result.status.value != "error", result.report
            ratio = result.objective / result.bound if result.status.has_plan else math.inf
            row[method] = (ratio, elapsed)
            row["bound"] = result.bound
        rows.append(row)
    return rows


def exact_table(seeds, options):
    out = []
    for seed in seeds:
        chain = random_chain(6, seed=seed, max_size=12)
        lay = Layers.of(chain)
        for alpha in (0.25, 0.5, 0.75):
            memory = int(math.ceil(lay.min_memory() + alpha * (lay.peak() - lay.min_memory())))
            problem = OffloadProblem(chain, memory, chain_bandwidth=2.0)
            start = time.perf_counter()
            exact = solve(problem, "cpsat", options=options.with_(time_limit_s=60))
            t_exact = time.perf_counter() - start
            if not exact.status.has_plan:
                continue
            row = {"seed": seed, "alpha": alpha, "exact": exact.objective,
                   "status": exact.status.value, "bound": exact.bound, "time": t_exact,
                   "frac": solve(problem, "frac").bound}
            for method in METHODS:
                r = solve(problem, method)
                row[method] = r.objective / exact.objective if r.status.has_plan else math.inf
            out.append(row)
    return out


def fmt(x):
    return "-" if not math.isfinite(x) else f"{x:.3f}"


def plot(rows_by_chain, bandwidths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows_by_chain)
    fig, axes = plt.subplots(len(names), len(bandwidths), figsize=(4 * len(bandwidths),
                             3.2 * len(names)), squeeze=False, sharey=True)
    for r, name in enumerate(names):
        for c, bw in enumerate(bandwidths):
            ax = axes[r][c]
            rows = [x for x in rows_by_chain[name] if x["bandwidth"] == bw]
            for method in METHODS:
                ys = [x[method][0] if math.isfinite(x[method][0]) else math.nan for x in rows]
                ax.plot([100 * x["alpha"] for x in rows], ys, marker="o", label=method)
            ax.set_title(f"{name}, {bw} (no marker: no plan)", fontsize=9)
            ax.set_xlabel("memory limit (% of min..peak)")
            ax.axhline(1.0, color="grey", lw=0.5)
            if c == 0:
                ax.set_ylabel("makespan / lower bound")
            ax.set_ylim(0.95, 3.05)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chains and points")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--slots", type=int, default=500)
    args = parser.parse_args()
    options = SolveOptions(slots=args.slots)
    if args.quick:
        chains = {"resnet-like-24-b32": named(resnet_like_chain(24, batch=32))}
        alphas = (0.1, 0.3, 0.5, 0.7, 0.9)
        bandwidths = ("12GB/s", "24GB/s")
        seeds = range(2)
    else:
        chains = {"resnet-like-40-b32": named(resnet_like_chain(40, batch=32)),
                  "resnet-like-40-b16-500px": named(resnet_like_chain(40, batch=16,
                                                                      resolution=500, seed=1))}
        alphas = (0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)
        bandwidths = ("12GB/s", "24GB/s", "36GB/s")
        seeds = range(5)
    lines = ["# Offloading benchmark (issue 6)", "",
             f"`python benchmarks/bench_offload.py{' --quick' if args.quick else ''}` "
             f"(slots {args.slots}). Ratio = simulated makespan / lower bound "
             "max(Prop. 3, OFF_frac); `inf` = no plan found. Memory: alpha in "
             "[0, 1] between the minimum memory of the store-all sequence and its peak.", ""]
    rows_by_chain = {}
    for name, chain in chains.items():
        rows = sweep(chain, alphas, bandwidths, options)
        rows_by_chain[name] = rows
        lines += [f"## {name} (L = {chain.length}, sum of compute "
                  f"{chain.total_compute_time():.1f} {chain.time_unit})", "",
                  "| bandwidth | alpha | bound | " + " | ".join(METHODS) + " |",
                  "|---|---|---|" + "---|" * len(METHODS)]
        for row in rows:
            lines.append(f"| {row['bandwidth']} | {row['alpha']:.2f} | {row['bound']:.1f} | "
                         + " | ".join(fmt(row[m][0]) for m in METHODS) + " |")
        lines.append("")
        for m in METHODS:
            ratios = [row[m][0] for row in rows if math.isfinite(row[m][0])]
            times = [row[m][1] for row in rows]
            worst = max(ratios) if ratios else math.inf
            lines.append(f"- `{m}`: solved {len(ratios)}/{len(rows)}, mean ratio "
                         f"{statistics.fmean(ratios) if ratios else math.inf:.3f}, worst "
                         f"{worst:.3f}, mean solve time {statistics.fmean(times):.3f} s, "
                         f"max {max(times):.3f} s")
        lines.append("")
        print("\n".join(lines[-len(METHODS) - 1:]))
    exact = exact_table(seeds, options)
    lines += ["## Heuristics against the exact CP-SAT optimum (random chains, L = 6, "
              "beta = 2)", "",
              "| seed | alpha | exact | status | frac bound | cpsat s | "
              + " | ".join(METHODS) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(METHODS)]
    for row in exact:
        lines.append(f"| {row['seed']} | {row['alpha']} | {row['exact']:.3f} | {row['status']} "
                     f"| {row['frac']:.3f} | {row['time']:.2f} | "
                     + " | ".join(fmt(row[m]) for m in METHODS) + " |")
    lines += ["", "(method columns: makespan / exact optimum)", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows_by_chain, bandwidths, out / "offload.png")
    lines.append("![ratios](offload.png)")
    (out / "offload.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'offload.md'} and {out / 'offload.png'}")


if __name__ == "__main__":
    main()
