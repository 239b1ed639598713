"""Remat + offload benchmark (issue 7): activation-memory reduction against time overhead.

For bundled chains (profiles in ``optmem/datasets/data``), the memory limit is swept as in
thesis chapter 4 (Fig. 4.2/4.3): ``M = (1 - alpha) M_low + alpha M_high`` with ``M_high`` the
peak of the store-all sequence and ``M_low`` the peak of recompute-all, for several link
bandwidths (thesis: 12-36 GB/s). Methods: checkpoint only (persistent DP), offload only
(DYNPROG), the combined chapter 4 DP (``dp``, never-worse mode, and ``dp:thesis``),
autocapper and the DELTA-style online policy. Every plan is replayed by the simulator.

Reported per point: the memory reduction ``M_high / M`` and the overhead
``makespan / sum(u_F + u_B) - 1``; per chain and bandwidth, the largest reduction each
method reaches with an overhead of at most 20 % (the thesis headline: 4-6x below 20 %).

Usage: ``python benchmarks/bench_remat_offload.py [--quick] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from optmem.datasets import resolve_chain
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.solvers.checkpoint_baselines import recompute_all_plan, store_all_plan
from optmem.solvers.facade import solve
from optmem.units import parse_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import memory_grid  # noqa: E402

METHODS = (("remat_only", None, "checkpoint only"), ("offload_only", None, "offload only"),
           ("dp", None, "combined (pofo, never-worse)"), ("dp", "thesis", "pofo (thesis)"),
           ("autocapper", None, "autocapper"), ("delta", None, "DELTA policy"))
HEADLINE = 0.20


def memory_range(chain):
    low = simulate_checkpoint(chain, recompute_all_plan(chain.length)).peak_memory
    high = simulate_checkpoint(chain, store_all_plan(chain.length)).peak_memory
    return low, high


def sweep(chain, alphas, bandwidths, options):
    low, high = memory_range(chain)
    total = chain.total_compute_time()
    rows = []
    for bw, beta, alpha, memory in memory_grid(chain, low, high, alphas, bandwidths):
        problem = RematOffloadProblem(chain, memory, chain_bandwidth=beta)
        row = {"bandwidth": bw, "alpha": alpha, "memory": memory, "reduction": high / memory}
        for method, variant, label in METHODS:
            start = time.perf_counter()
            res = solve(problem, method, options=options.with_(variant=variant))
            row[label] = (res.objective / total - 1) if res.status.has_plan else math.inf
            row[label + " time"] = time.perf_counter() - start
            row[label + " status"] = str(res.status)
        rows.append(row)
        print(f"{chain.name} {bw} alpha={alpha:.2f} M_high/M={high / memory:.2f}: "
              + ", ".join(f"{lab}={_pct(row[lab])}" for _, _, lab in METHODS), flush=True)
    return rows


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}%"


def headline(rows, bandwidth):
    out = {}
    for _, _, label in METHODS:
        ok = [r["reduction"] for r in rows if r["bandwidth"] == bandwidth
              and r[label] <= HEADLINE + 1e-12]
        out[label] = max(ok, default=math.nan)
    return out


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    bws = sorted({r["bandwidth"] for rows in results.values() for r in rows},
                 key=lambda b: parse_bandwidth(b))
    fig, axes = plt.subplots(len(names), len(bws), figsize=(4.2 * len(bws), 3.4 * len(names)),
                             squeeze=False)
    for i, name in enumerate(names):
        for j, bw in enumerate(bws):
            ax = axes[i][j]
            rows = [r for r in results[name] if r["bandwidth"] == bw]
            for _, _, label in METHODS:
                pts = [(r["reduction"], 100 * r[label]) for r in rows if math.isfinite(r[label])]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=label)
            ax.axhline(100 * HEADLINE, color="grey", lw=0.8, ls="--")
            ax.set_title(f"{name}, {bw}", fontsize=9)
            ax.set_xlabel("activation memory reduction (M_high / M)")
            ax.set_ylabel("time overhead (%)")
            ax.set_ylim(0, 100)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_md(results, path, args, elapsed):
    lines = ["# Remat + offload benchmark (issue 7)", "",
             "Command: `python benchmarks/bench_remat_offload.py"
             f"{' --quick' if args.quick else ''}`"
             f" (total {elapsed:.0f} s on the shared 2-core machine).", "",
             "Memory limit `M = (1 - alpha) M_low + alpha M_high` (thesis ch. 4): `M_high` = "
             "store-all peak, `M_low` = recompute-all peak. Overhead = makespan / sum of "
             "compute times - 1, every plan replayed by the offload simulator "
             "(`optmem.simulate.offload`). `-`: no plan.", "",
             "![overhead vs memory](remat_offload.png)", ""]
    for name, rows in results.items():
        lines += [f"## {name}", ""]
        bws = sorted({r["bandwidth"] for r in rows}, key=lambda b: parse_bandwidth(b))
        lines += [f"Largest memory reduction with overhead <= {int(HEADLINE * 100)} %:", "",
                  "| bandwidth | " + " | ".join(lab for _, _, lab in METHODS) + " |",
                  "|---" * (len(METHODS) + 1) + "|"]
        for bw in bws:
            h = headline(rows, bw)
            lines.append(f"| {bw} | " + " | ".join(
                "-" if math.isnan(h[lab]) else f"{h[lab]:.2f}x" for _, _, lab in METHODS) + " |")
        lines += ["", "Overhead per point:", "",
                  "| bandwidth | alpha | M_high/M | " + " | ".join(
                      lab for _, _, lab in METHODS) + " | dp time (s) |",
                  "|---" * (len(METHODS) + 4) + "|"]
        for r in rows:
            lines.append(f"| {r['bandwidth']} | {r['alpha']:.2f} | {r['reduction']:.2f} | "
                         + " | ".join(_pct(r[lab]) for _, _, lab in METHODS)
                         + f" | {r['combined (pofo, never-worse) time']:.1f} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one chain, coarser DP grid")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.quick:
        chains = ["resnet50-b16-500"]
        alphas = [0.05, 0.1, 0.2, 0.4, 0.7]
        bandwidths = ["12GB/s", "36GB/s"]
        options = SolveOptions(slots=200, extra={"grid": 100, "backlog_grid": 15})
    else:
        chains = ["resnet101-b16-500", "densenet121-b16-500"]
        alphas = [0.0, 0.05, 0.1, 0.2, 0.4, 0.7]
        bandwidths = ["12GB/s", "24GB/s", "36GB/s"]
        options = SolveOptions(slots=500, extra={"grid": 120, "backlog_grid": 16})
    start = time.perf_counter()
    results = {name: sweep(resolve_chain(name), alphas, bandwidths, options)
               for name in chains}
    elapsed = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "remat_offload.png")
    write_md(results, out / "remat_offload.md", args, elapsed)
    for name, rows in results.items():
        for bw in sorted({r["bandwidth"] for r in rows}, key=lambda b: parse_bandwidth(b)):
            h = headline(rows, bw)
            print(f"{name} {bw}: max reduction at <= 20% overhead: " + ", ".join(
                f"{k}={v:.2f}x" for k, v in h.items() if not math.isnan(v)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
