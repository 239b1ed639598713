"""Benchmark the exact offloading model (OFF_int, issue 15 items 2 and 6) on bundled profiles.

For every bundled profile with at most ``--max-length`` stages, at three memory limits
(``alpha`` of the way from the smallest feasible checkpointing memory to the store-all
peak, the dataset summary's figures, as in the issue; an ``alpha`` below the offloading
minimum is reported as infeasible) and a 12 GB/s link: DYNPROG (``dp``), GREEDY, the
fractional bound (``frac``) and the exact model on CP-SAT (``cpsat``, 2 threads, a time
limit per solve). Reported: status, objective, proven bound and gap (in the chain's time
unit: CP-SAT runs on an exact time grid), time, CP-SAT's deterministic work counts
(branches, deterministic seconds) and how far DYNPROG and GREEDY are above the optimum (or
above the best bound when not proven). ``--ilp`` adds the MILP emission of the same model
(HiGHS) on the instances it lists.

The machine is shared: ``uptime`` is recorded before and after; wall-clock times are noisy,
the deterministic counts are not (up to the two workers' interleaving).

Usage::

    python benchmarks/bench_offload_exact.py [--quick] [--time-limit S] [--profiles a,b]
        [--alphas 0.2,0.3,0.5] [--ilp resnet50-b32-224] [--out benchmarks/results/...]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from optmem.datasets import list_datasets, load_dataset
from optmem.problems.offload import OffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers.dataset_summary import dataset_summary

sys.path.insert(0, str(Path(__file__).parent))
from bench_exact import fmt, timed  # noqa: E402  (the overview script's shared helpers)

BANDWIDTH = "12GB/s"
TARGET = ("resnet50-b32-224", 0.3)


def problem(name: str, alpha: float) -> OffloadProblem:
    """``alpha`` of the way from the smallest feasible (checkpointing) memory to store-all."""
    chain, summary = load_dataset(name), dataset_summary(name)
    low, high = summary["min_feasible"], summary["store_all"]
    return OffloadProblem(chain, int(low + alpha * (high - low)), BANDWIDTH)




def pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.2f} %"


def above(value: float, reference: float) -> float:
    if not (math.isfinite(value) and math.isfinite(reference)) or reference <= 0:
        return math.nan
    return value / reference - 1


def run_instance(name: str, alpha: float, limit: float, methods: tuple[str, ...]) -> dict:
    prob = problem(name, alpha)
    row: dict = {"name": name, "L": prob.chain.length, "alpha": alpha,
                 "memory": prob.memory_limit}
    fast = SolveOptions(threads=2)
    for heuristic in ("dp", "greedy", "frac"):
        row[heuristic], row[heuristic + "_t"] = timed(prob, heuristic, fast)
    for method in methods:
        result, seconds = timed(prob, method, SolveOptions(threads=2, time_limit_s=limit))
        assert result.status is not Status.ERROR, result.report
        row[method], row[method + "_t"] = result, seconds
        print(f"{name} alpha={alpha} {method}: {result.status} {fmt(result.objective, 4)} "
              f"bound {fmt(result.bound, 4)} gap {pct(result.gap)} {seconds:.1f} s "
              f"dp {fmt(row['dp'].objective, 4)}", flush=True)
    return row


def table(rows: list[dict], method: str) -> list[str]:
    count = "B&B nodes" if method == "ilp" else "branches | det. time"
    out = ["| profile | L | alpha | memory (GiB) | status | objective | bound | gap | time (s) "
           f"| {count} | DP | DP above opt. | GREEDY above opt. | OFF_frac |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
           + ("" if method == "ilp" else "---|")]
    for row in rows:
        res: Result = row[method]
        dp, greedy = row["dp"], row["greedy"]
        work = res.report.get("work", {})
        counts = (f"{work.get('nodes', '-')}" if method == "ilp" else
                  f"{work.get('branches', '-')} | {fmt(work.get('deterministic_time'))}")
        ref = res.objective if res.status is Status.OPTIMAL else res.bound
        sign = "" if res.status is Status.OPTIMAL else "<= "
        out.append(
            f"| {row['name']} | {row['L']} | {row['alpha']:.2f} | "
            f"{row['memory'] / 2**30:.2f} | {res.status} | {fmt(res.objective)} | "
            f"{fmt(res.bound)} | {pct(res.gap)} | {row[method + '_t']:.1f} | "
            f"{counts} | "
            f"{fmt(dp.objective)} | {sign}{pct(above(dp.objective, ref))} | "
            f"{sign}{pct(above(greedy.objective, ref))} | {fmt(row['frac'].bound)} |")
    return out


def summary(rows: list[dict], method: str) -> list[str]:
    feasible = [r for r in rows if r[method].status.has_plan]
    proven = [r for r in feasible if r[method].status is Status.OPTIMAL]
    within = [r for r in feasible if r[method].gap <= 0.005]
    times = [r[method + "_t"] for r in proven]
    dp_gaps = [above(r["dp"].objective, r[method].objective) for r in proven
               if r["dp"].status.has_plan]
    lines = [
        f"- instances with a plan: {len(feasible)} of {len(rows)} "
        f"({len(rows) - len(feasible)} below the offloading minimum: infeasible, proven)",
        f"- proven optimal: {len(proven)} of {len(feasible)}; gap <= 0.5 %: "
        f"{len(within)} of {len(feasible)}",
    ]
    if times:
        lines.append(f"- time to proof: median {statistics.median(times):.1f} s, "
                     f"max {max(times):.1f} s")
    if dp_gaps:
        exact = sum(1 for g in dp_gaps if g <= 1e-9)
        lines.append(f"- DYNPROG above the proven optimum: mean {pct(statistics.mean(dp_gaps))}, "
                     f"max {pct(max(dp_gaps))}; optimal in {exact} of {len(dp_gaps)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two profiles, one limit, 60 s")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve")
    parser.add_argument("--max-length", type=int, default=40)
    parser.add_argument("--profiles", default=None, help="comma-separated dataset names")
    parser.add_argument("--alphas", default="0.2,0.3,0.5")
    parser.add_argument("--ilp", default="", help="profiles to also solve with the MILP")
    parser.add_argument("--ilp-alphas", default=None, help="their limits (default --alphas)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                               "offload_exact.md"))
    args = parser.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    if args.profiles:
        names = args.profiles.split(",")
    else:
        names = [d.name for d in list_datasets()
                 if dataset_summary(d.name)["stages"] <= args.max_length]
    limit = args.time_limit
    if args.quick:
        names, alphas, limit = ["unet-b4-512", "resnet50-b32-224"], [0.3], 60.0
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [run_instance(n, a, limit, ("cpsat",)) for n in names for a in alphas]
    ilp_alphas = [float(a) for a in args.ilp_alphas.split(",")] if args.ilp_alphas else alphas
    ilp_rows = [run_instance(n, a, limit, ("ilp",)) for n in args.ilp.split(",") if n
                for a in ilp_alphas]
    load_after = os.getloadavg()
    skipped = [d.name for d in list_datasets() if d.name not in names]
    text = [
        "# Exact offloading model (OFF_int): measured figures",
        "",
        f"Run {started} on {platform.machine()} (Python {platform.python_version()}), "
        f"`bench_offload_exact.py{' --quick' if args.quick else ''}`: {BANDWIDTH}, 500 "
        f"memory slots, CP-SAT with 2 workers and {limit:g} s per solve, shared 2-core "
        f"machine (load average {load_before[0]:.1f} / {load_before[1]:.1f} at the start, "
        f"{load_after[0]:.1f} / {load_after[1]:.1f} at the end: wall-clock times are "
        "inflated accordingly; CP-SAT's branch count and deterministic time measure the "
        "work). Memory: `alpha` of the way from the smallest feasible checkpointing memory "
        "to the store-all peak (the dataset summary). `objective` is the simulated makespan "
        "(ms) of the returned plan, `bound` the proven lower bound in the same units (CP-SAT "
        "runs on an exact time grid); `DP above opt.` is DYNPROG's makespan over the proven "
        "optimum (`<=` over the bound when not proven).",
        "",
        "## CP-SAT (`--method cpsat`)",
        "",
        *table(rows, "cpsat"),
        "",
        *summary(rows, "cpsat"),
        "",
    ]
    if ilp_rows:
        text += ["## MILP emission of the same model (`--method ilp`, HiGHS)", "",
                 *table(ilp_rows, "ilp"), "", *summary(ilp_rows, "ilp"), ""]
    if skipped:
        text += [f"Not run (more than {args.max_length} stages or not selected): "
                 + ", ".join(skipped) + ".", ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
