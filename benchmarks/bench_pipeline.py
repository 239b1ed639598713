"""Pipeline periods: equal split, PipeDream, best contiguous, MadPipe and the exact model.

For bundled profiles (full: every layer of the profile; ``--layers K`` coarsens to K layers
by merging neighbours with the smallest combined time, as the thesis' linearisation does),
P GPUs and a range of memories per GPU, this script solves the ``pipeline`` problem with

* ``equal``: equal layer counts per GPU + optimal 1F1B* (torch.distributed.pipelining style),
* ``pipedream``: PipeDream's planner + optimal 1F1B* (the thesis' fair baseline, 7.3.3),
* ``contiguous``: the best contiguous allocation + optimal 1F1B* (thesis ch. 5),
* ``madpipe``: MadPipe (ch. 7), non-contiguous (phase 2 on its deterministic work limits, so
  the column does not depend on the machine's load; ``--madpipe-time-limit`` for a
  wall-clock limit on the whole run instead),
* ``exact``: the CP-SAT emission of the exact model of all allocations and 1-periodic
  patterns with the contiguous optimum as warm start and cutoff, the lifetime relaxation's
  bound, and a deterministic work limit per CP-SAT call (``--deterministic-time``, 10
  deterministic seconds: the column does not depend on the machine's load; ``--wall-clock``
  for the former wall-clock limit ``--time-limit`` instead; ``feasible`` when the limit
  stops it),

prints the periods and their ratios to MadPipe's, writes a markdown table and a PNG plot.
Every plan is replayed by the simulator inside ``solve``. A second table times MadPipe's
phase 1 (Algorithm 8, the vectorised DP) on ResNet-152 (L = 56) with P = 8 GPUs.

``--quick`` (a smoke run: 16 CPU seconds, 71 s wall at load 5.6 on 2 cores) covers every method and
both tables on ResNet-50 coarsened to 12 layers (unless ``--layers``), P = 2 and 4, 3 and
12 GiB, MadPipe K = 4, 0.5 deterministic s per `exact` CP-SAT call (1 s wall with
``--wall-clock``), and phase 1 timed on ResNet-50 at P = 4, 4 GiB. Its numbers are no
results: on the full profile `exact` alone took 74 s of a 77 s row at 3 deterministic s
per call (it makes many calls: relaxation probes, full model, decomposition), 4-5 minutes
in all. The full run is unchanged.

Usage::

    python benchmarks/bench_pipeline.py --quick
    python benchmarks/bench_pipeline.py --markdown benchmarks/results/pipeline.md \
        --plot benchmarks/results/pipeline.png
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import print_and_write, uptime  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.cli_problems import parse_pipeline_bandwidth  # noqa: E402
from optmem.datasets import resolve_chain  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.result import SolveOptions  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402
from optmem.solvers.pipeline_madpipe import algorithm8  # noqa: E402

METHODS = ("equal", "pipedream", "contiguous", "madpipe", "exact")
GIB = 2**30


def coarsen(chain: Chain, layers: int) -> Chain:
    """Merge neighbouring stages (smallest combined time first) until ``layers`` remain.

    A merged stage keeps the stash of its parts: times and weights add up, the output is
    the last part's, ``saved_size`` is the sum of the parts' (see ``problems/pipeline.py``).
    """
    groups = [[q] for q in range(chain.length)]

    def time_of(g: list[int]) -> float:
        return sum(chain.fwd_time[q] + chain.bwd_time[q] for q in g)

    while len(groups) > layers:
        k = min(range(len(groups) - 1), key=lambda i: time_of(groups[i]) + time_of(groups[i + 1]))
        groups[k:k + 2] = [groups[k] + groups[k + 1]]
    return Chain.from_lists(
        [sum(chain.fwd_time[q] for q in g) for g in groups],
        [sum(chain.bwd_time[q] for q in g) for g in groups],
        [chain.output_size[g[-1]] for g in groups],
        [sum(chain.saved_size[q] for q in g) for g in groups],
        input_size=chain.input_size,
        weight_size=[sum(chain.weight_size[q] for q in g) for g in groups],
        loss_bwd_time=chain.loss_bwd_time, name=f"{chain.name}-{layers}",
    )


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name in args.profiles:
        chain = resolve_chain(name)
        if args.layers:
            chain = coarsen(chain, args.layers)
        bw = parse_pipeline_bandwidth(args.bandwidth, chain.time_unit)
        for gpus in args.gpus:
            for mem in args.memory:
                problem = PipelineProblem(chain, gpus, int(mem * GIB), chain_bandwidth=bw)
                row = {"profile": name, "gpus": gpus, "memory_gib": mem}
                for method in METHODS:
                    limit = args.madpipe_time_limit if method == "madpipe" else \
                        args.time_limit if args.wall_clock else None
                    work = args.deterministic_time if method == "exact" and \
                        not args.wall_clock else None
                    opts = SolveOptions(time_limit_s=limit, deterministic_time=work, extra={
                        "madpipe_iterations": args.iterations, "warm_madpipe": False})
                    start = time.perf_counter()
                    r = solve(problem, "cpsat" if method == "exact" else method, options=opts)
                    row[method] = r.objective if r.status.has_plan else math.inf
                    row[method + "_status"] = str(r.status)
                    row[method + "_s"] = time.perf_counter() - start
                    if method == "exact":
                        row["exact_bound"] = r.bound
                    if method == "madpipe":
                        row["madpipe_source"] = r.report.get("source", "")
                        row["madpipe_estimate"] = r.report.get("phase1_estimate", math.nan)
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _fmt(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.2f}"


def _ratio(a: float, b: float) -> str:
    if not math.isfinite(b):
        return "-"
    if not math.isfinite(a):
        return "inf"
    return f"{a / b:.2f}"


def _line(row: dict) -> str:
    periods = " ".join(f"{m}={_fmt(row[m])}" for m in METHODS)
    return (f"{row['profile']:>20} P={row['gpus']} M={row['memory_gib']:>4}GiB  {periods}  "
            f"pipedream/madpipe={_ratio(row['pipedream'], row['madpipe'])} "
            f"equal/madpipe={_ratio(row['equal'], row['madpipe'])} "
            f"[madpipe {row['madpipe_s']:.1f}s, exact {row['exact_s']:.1f}s "
            f"{row['exact_status']}]")


def geomean(values: list[float]) -> float:
    vals = [v for v in values if math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else math.nan


def dp_times(args: argparse.Namespace) -> list[str]:
    """CPU and wall time of MadPipe's phase 1 (Algorithm 8, K iterations) at L = 56, P = 8."""
    chain = resolve_chain(args.dp_profile)
    bw = parse_pipeline_bandwidth(args.bandwidth, chain.time_unit)
    rows = [f"## MadPipe phase 1 (Algorithm 8, K = {args.iterations}) on {args.dp_profile} "
            f"(L = {chain.length}), P = {args.dp_gpus}", "",
            "| memory (GiB) | estimate | T-hat | DP states | CPU (s) | wall (s) |",
            "|---|---|---|---|---|---|"]
    for mem in args.dp_memory:
        problem = PipelineProblem(chain, args.dp_gpus, int(mem * GIB), chain_bandwidth=bw)
        cpu, wall = time.process_time(), time.perf_counter()
        est, that, _, states = algorithm8(problem, exact=False, iterations=args.iterations)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        rows.append(f"| {mem:g} | {_fmt(est)} | {_fmt(that)} | {states} | {cpu:.1f} | "
                    f"{wall:.1f} |")
        print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, wall: float) -> str:
    layers = f"coarsened to {args.layers} layers" if args.layers else "full (every layer)"
    mp_limit = ("phase 2 on its deterministic work limits" if args.madpipe_time_limit is None
                else f"{args.madpipe_time_limit} s for the whole MadPipe run")
    exact_limit = (f"time limit {args.time_limit} s per engine call" if args.wall_clock else
                   f"{args.deterministic_time} deterministic s per CP-SAT call of `exact`")
    out = ["# Pipeline benchmark (`benchmarks/bench_pipeline.py`)", "",
           f"Profiles {layers}, bandwidth {args.bandwidth}, C = 3 "
           f"weight copies, stash memory model, MadPipe K = {args.iterations} ({mp_limit}), "
           f"{exact_limit} (`exact` = CP-SAT with the contiguous "
           f"optimum as cutoff and the lifetime relaxation's bound). Periods in ms per "
           f"micro-batch; `-` = no plan fits. Wall time {wall:.0f} s.", "",
           "| profile | P | M (GiB) | equal | PipeDream | contiguous | MadPipe (phase 1) | "
           "exact | PipeDream / MadPipe | equal / MadPipe | MadPipe source |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exact = _fmt(r["exact"]) + ("*" if r["exact_status"] in ("feasible", "no_solution")
                                    else "")
        if r["exact_status"] == "feasible" and math.isfinite(r["exact_bound"]):
            exact += f" (>= {r['exact_bound']:.2f})"
        out.append(
            f"| {r['profile']} | {r['gpus']} | {r['memory_gib']} | {_fmt(r['equal'])} | "
            f"{_fmt(r['pipedream'])} | {_fmt(r['contiguous'])} | {_fmt(r['madpipe'])} "
            f"({_fmt(r['madpipe_estimate'])}) | {exact} | "
            f"{_ratio(r['pipedream'], r['madpipe'])} | {_ratio(r['equal'], r['madpipe'])} | "
            f"{r['madpipe_source']} |")
    both = [(r["pipedream"], r["madpipe"]) for r in rows if math.isfinite(r["madpipe"])]
    pd = geomean([a / b for a, b in both if math.isfinite(a)])
    worst = max((a / b for a, b in both if math.isfinite(a)), default=math.nan)
    no_pd = sum(1 for a, _ in both if not math.isfinite(a))
    eq = geomean([r["equal"] / r["madpipe"] for r in rows
                  if math.isfinite(r["madpipe"]) and math.isfinite(r["equal"])])
    no_eq = sum(1 for r in rows if math.isfinite(r["madpipe"]) and not math.isfinite(r["equal"]))
    out += ["", "`*` exact model stopped by its limit: best plan found (the contiguous "
            "optimum when it found nothing better) and CP-SAT's proven lower bound.", "",
            f"Geometric mean PipeDream / MadPipe: {pd:.3f} (worst {worst:.2f}; PipeDream "
            f"finds no plan in {no_pd} of {len(both)} cases where MadPipe does). "
            f"Equal split / MadPipe: {eq:.3f} (no plan in {no_eq} cases).", ""]
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({r["profile"] for r in rows})
    gpus = sorted({r["gpus"] for r in rows})
    fig, axes = plt.subplots(len(profiles), len(gpus), figsize=(4 * len(gpus),
                                                                 3.2 * len(profiles)),
                             squeeze=False)
    for i, prof in enumerate(profiles):
        for j, p in enumerate(gpus):
            ax = axes[i][j]
            sel = [r for r in rows if r["profile"] == prof and r["gpus"] == p]
            for m, style in zip(METHODS, ("s:", "v--", "o-", "D-", "x-"), strict=True):
                xs = [r["memory_gib"] for r in sel if math.isfinite(r[m])]
                ys = [r[m] for r in sel if math.isfinite(r[m])]
                ax.plot(xs, ys, style, label=m, markersize=4)
            ax.set_title(f"{prof}, P={p}", fontsize=9)
            ax.set_xlabel("memory per GPU (GiB)")
            ax.set_ylabel("period (ms)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one profile, fewer settings")
    parser.add_argument("--profiles", nargs="+",
                        default=["resnet50-b32-224", "resnet101-b8-1000", "inception3-b32-299"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--memory", nargs="+", type=float, default=[2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--layers", type=int, default=None,
                        help="coarsen each profile to this many layers (default: full)")
    parser.add_argument("--dp-profile", default="resnet152-b32-224")
    parser.add_argument("--dp-gpus", type=int, default=8)
    parser.add_argument("--dp-memory", nargs="+", type=float,
                        default=[2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--bandwidth", default="12GB/s")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--deterministic-time", type=float, default=10.0,
                        help="CP-SAT work limit of each `exact` call, deterministic seconds")
    parser.add_argument("--wall-clock", action="store_true",
                        help="`exact` under the wall-clock --time-limit instead (as before)")
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="wall-clock limit per engine call with --wall-clock")
    parser.add_argument("--madpipe-time-limit", type=float, default=None,
                        help="wall-clock limit of a MadPipe run (default: none, phase 2 on "
                             "its deterministic work limits)")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--plot", help="write a PNG here")
    args = parser.parse_args()
    if args.quick:  # see QUICK in the docstring: `exact` took 74 s of each 77 s row
        args.profiles, args.gpus, args.memory = ["resnet50-b32-224"], [2, 4], [3, 12]
        args.layers = args.layers or 12
        args.iterations, args.time_limit, args.dp_memory = 4, 1.0, [4]
        args.deterministic_time, args.dp_profile, args.dp_gpus = 0.5, "resnet50-b32-224", 4
    start = time.perf_counter()
    load = uptime()
    rows = run(args)
    wall = time.perf_counter() - start
    text = markdown(rows, args, wall) + f"\nLoad average when the run started: {load}.\n\n"
    text += "\n".join(dp_times(args)) + f"\n\nLoad average after: {uptime()}.\n"
    print_and_write(text, args.markdown)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
