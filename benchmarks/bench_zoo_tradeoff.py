"""The rotor papers' experiment, reproduced in shape on the bundled zoo profiles.

For ResNet-101 (1000x1000, batch 8) and DenseNet-121 (1000x1000, batch 8), profiled on the
meta device with the V100 roofline model (the papers' GPU), compare at memory limits from the
smallest feasible one up to the store-all peak:

* ``dp``: the optimal persistent DP (rotor),
* ``chen``: Chen et al.'s sqrt(n) equal segments,
* ``sequential``: torch ``checkpoint_sequential``, best segment count that fits the limit,
* ``store_all``: PyTorch's default,

all through ``optmem.solvers.facade.solve(CheckpointProblem(chain, M), method)`` (every plan
replayed by the simulator) with 2000 memory slots (``--slots``): every stored value is
rounded up to a unit of ``M / slots``, so with 500 slots a store-all run of DenseNet-121
(about 70 values) needs up to 14 % more than its exact peak. The figure follows rotor RR
Fig. 3 / thesis Fig. 2.5: throughput (images/s) against peak memory, one marker per plan
(every segment count of ``checkpoint_sequential`` from 2 to 2 sqrt(L), the DP at every
limit), plus a second panel of
makespan overhead against the memory limit. Writes ``benchmarks/results/zoo_tradeoff.png``
and prints the table summarised in ``benchmarks/results/zoo.md``.

``--resnet1001`` adds rotor's Fig. 4 in numbers: ResNet-1001 (the 4x wide variant) at
224 px, batches 1-8, on the 15.75 GB V100 (limit = 15.75 GB minus weights and gradients):
fewest ``checkpoint_sequential`` segments that fit, best throughputs.

Usage: ``python benchmarks/bench_zoo_tradeoff.py [--quick] [--limits N] [--no-plot]
[--resnet1001]``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from optmem.datasets import load_dataset
from optmem.problems.checkpoint import CheckpointProblem
from optmem.result import SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers import checkpoint_baselines as base
from optmem.solvers.dataset_summary import dataset_summary
from optmem.solvers.facade import solve

NETWORKS = ["resnet101-b8-1000", "densenet121-b8-1000"]
METHODS = ["dp", "chen", "sequential", "store_all"]
V100_GIB = 15.75  # the papers' V100 memory, drawn for reference
OUT = Path(__file__).parent / "results"


def sweep(name: str, limits: int, slots: int) -> dict:
    chain = load_dataset(name)
    s = dataset_summary(name)
    batch = chain.extra["model"]["batch"]
    base_time = chain.total_compute_time()
    # from just above the smallest feasible limit (sizes round up to units of M/500) to
    # just above the store-all peak, so that store-all fits after rounding too
    lo, hi = int(s["min_feasible"] * 1.03), int(s["store_all"] * 1.08)
    grid = [int(lo + (hi - lo) * k / (limits - 1)) for k in range(limits)]
    rows = []
    for m in grid:
        row = {"limit": m}
        for method in METHODS:
            r = solve(CheckpointProblem(chain, m), method, options=SolveOptions(slots=slots))
            if r.status in (Status.OPTIMAL, Status.FEASIBLE):
                row[method] = (r.objective, r.peak_memory * r.unit)
            else:
                row[method] = None
        rows.append(row)
    # every checkpoint_sequential plan (rotor plots segment counts 2..2 sqrt(L))
    seq_points = []
    for k, plan in base.sequential_plans(chain.length):
        if 2 <= k <= max(2, round(2 * math.sqrt(chain.length))):
            sim = simulate_checkpoint(chain, plan)
            seq_points.append((k, sim.makespan, sim.peak_memory))
    chen = simulate_checkpoint(chain, base.chen_plan(chain.length))
    store = simulate_checkpoint(chain, base.store_all_plan(chain.length))
    return {"name": name, "chain": chain, "batch": batch, "base": base_time, "rows": rows,
            "seq": seq_points, "chen": (chen.makespan, chen.peak_memory),
            "store": (store.makespan, store.peak_memory), "summary": s}


def report(res: dict) -> list[str]:
    base_time, batch = res["base"], res["batch"]
    lines = [f"### {res['name']} ({res['chain'].length} stages, store-all "
             f"{res['summary']['store_all'] / 2**30:.2f} GiB, smallest feasible "
             f"{res['summary']['min_feasible'] / 2**30:.2f} GiB, store-all throughput "
             f"{batch / base_time * 1e3:.2f} img/s)", "",
             "| limit (GiB) | " + " | ".join(f"{m} overhead" for m in METHODS) +
             " | dp vs sequential throughput |",
             "|---|" + "---|" * (len(METHODS) + 1)]
    gains = []
    for row in res["rows"]:
        cells = []
        for m in METHODS:
            v = row[m]
            cells.append("-" if v is None else f"{100 * (v[0] / base_time - 1):.1f} %")
        gain = "-"
        if row["dp"] and row["sequential"]:
            g = row["sequential"][0] / row["dp"][0] - 1
            gains.append(g)
            gain = f"+{100 * g:.1f} %"
        lines.append(f"| {row['limit'] / 2**30:.2f} | " + " | ".join(cells) + f" | {gain} |")
    if gains:
        seq = ", ".join(f"{k}: {thr:.2f} img/s @ {p / 2**30:.2f} GiB" for k, thr, p in
                        sorted(((k, batch / t * 1e3, p) for k, t, p in res["seq"]))[:4])
        lines += ["", f"checkpoint_sequential by segment count: {seq}, ..."]
        lines += ["", f"Average throughput gain of dp over the best fitting "
                  f"checkpoint_sequential at equal limit: +{100 * sum(gains) / len(gains):.1f} % "
                  f"(max +{100 * max(gains):.1f} %) over {len(gains)} limits."]
    return lines


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4.2 * len(results)), squeeze=False)
    for (ax, ax2), res in zip(axes, results, strict=True):
        batch, base_time = res["batch"], res["base"]

        def thr(t: float, batch: int = batch) -> float:
            return batch / t * 1e3

        dp = [r["dp"] for r in res["rows"] if r["dp"]]
        ax.plot([p / 2**30 for _, p in dp], [thr(t) for t, _ in dp], "b^", ms=7,
                label="optimal (dp)")
        ax.plot([p / 2**30 for _, _, p in res["seq"]], [thr(t) for _, t, _ in res["seq"]],
                "x", color="purple", ms=8, label="sequential (2..2√L segments)")
        ax.plot([res["chen"][1] / 2**30], [thr(res["chen"][0])], "o", color="green",
                mfc="none", ms=9, label="chen √n")
        ax.plot([res["store"][1] / 2**30], [thr(res["store"][0])], "rs", ms=8,
                label="store all (PyTorch)")
        ax.axvline(V100_GIB, color="grey", ls=":", lw=1)
        ax.text(V100_GIB, 0.98, " V100 15.75 GB", color="grey", fontsize=8, va="top",
                transform=ax.get_xaxis_transform())
        ax.set_xlabel("peak activation memory (GiB)")
        ax.set_ylabel("throughput (images/s, V100 model)")
        ax.set_title(f"{res['name']}: throughput vs memory")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        limits = [r["limit"] / 2**30 for r in res["rows"]]
        styles = (("^-", "blue"), ("o--", "green"), ("x-", "purple"), ("s-", "red"))
        for method, (style, color) in zip(METHODS, styles, strict=True):
            ys = [100 * (r[method][0] / base_time - 1) if r[method] else math.nan
                  for r in res["rows"]]
            ax2.plot(limits, ys, style, label=method, color=color, ms=6)
        ax2.set_xlabel("memory limit (GiB)")
        ax2.set_ylabel("makespan overhead over store-all (%)")
        ax2.set_title(f"{res['name']}: overhead vs limit")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def resnet1001_table(slots: int = 200) -> list[str]:
    """Rotor Fig. 4 in numbers: ResNet-1001 (w64) at 224 px on a 15.75 GB V100."""
    lines = ["| batch | store-all (GiB) | store-all img/s | sequential: fewest segments that "
             "fit | best sequential img/s | optimal (dp) img/s |", "|---|---|---|---|---|---|"]
    for batch in (1, 2, 4, 8):
        chain = load_dataset(f"resnet1001-w64-b{batch}-224")
        limit = int(V100_GIB * 1e9) - 2 * sum(chain.weight_size)  # weights + gradients
        fits = []
        for k, plan in base.sequential_plans(chain.length):
            if k > round(2 * math.sqrt(chain.length)):
                break
            sim = simulate_checkpoint(chain, plan)
            if sim.peak_memory <= limit:
                fits.append((k, batch / sim.makespan * 1e3))
        dp = solve(CheckpointProblem(chain, limit), "dp", options=SolveOptions(slots=slots))
        s = dataset_summary(chain.name)
        lines.append(
            f"| {batch} | {s['store_all'] / 2**30:.1f} | {batch / s['compute_time'] * 1e3:.2f} | "
            f"{fits[0][0] if fits else 'none <= 2 sqrt(L)'} | "
            f"{max(t for _, t in fits) if fits else 0:.2f} | "
            f"{batch / dp.objective * 1e3 if dp.status is Status.OPTIMAL else 0:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ResNet-101 only, 6 limits")
    parser.add_argument("--limits", type=int, default=16, help="memory limits per network")
    parser.add_argument("--slots", type=int, default=2000,
                        help="memory units per limit (rounding error about L/slots)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--resnet1001", action="store_true",
                        help="also the ResNet-1001 table (rotor Fig. 4; about 2 minutes)")
    parser.add_argument("--out", type=Path, default=OUT / "zoo_tradeoff.png")
    args = parser.parse_args(argv)
    nets = NETWORKS[:1] if args.quick else NETWORKS
    limits = 6 if args.quick else args.limits
    results = []
    for name in nets:
        start = time.perf_counter()
        results.append(sweep(name, limits, 500 if args.quick else args.slots))
        print("\n".join(report(results[-1])))
        print(f"({time.perf_counter() - start:.1f} s)\n")
    if args.resnet1001:
        print("\n".join(resnet1001_table()))
    if not args.no_plot:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
