"""Exact remat + offload (``cpsat`` / ``ilp``): proven-optimal rate, time to proof, DP distance.

For each instance (seeded ``random_chain`` of 8-12 stages, bundled networks) and three memory
limits (fractions of the way from the persistent checkpoint DP's least memory to the
store-all peak), with a link that moves half of the activations the forward pass produces in
its own time, it runs the chapter 4 DP (``dp``, never-worse variant) and the exact methods
with a time limit and 2 threads, and prints one row per run: status, objective, proven bound,
gap, engine time, model size and how far the DP is from the exact method's bound (an upper
bound on its distance from the optimum; the distance itself when proven).

Rows are appended to the Markdown file as they finish (``--out``), so a long run that is
stopped still leaves its figures. Wall-clock times depend on the machine's load: the header
records ``os.getloadavg()``; the model sizes are deterministic.

Usage::

    python benchmarks/bench_remat_offload_exact.py --lengths 8,10,12 --time-limit 300 \
        --out benchmarks/results/remat_offload_exact.md
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from optmem.chain import Chain
from optmem.datasets import load_dataset, synthetic
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.solvers.checkpoint_baselines import store_all_plan
from optmem.solvers.checkpoint_dp import min_memory_persistent
from optmem.solvers.facade import solve


def limits(chain: Chain, fractions: list[float]) -> list[int]:
    """Memory limits at ``fractions`` of the way from the least checkpoint memory to store-all."""
    lo = min_memory_persistent(chain)
    hi = simulate_checkpoint(chain, store_all_plan(chain.length)).peak_memory
    return [int(lo + f * (hi - lo)) for f in fractions]


def bandwidth(chain: Chain) -> float:
    """Half of the activations produced per unit of forward time (chain units)."""
    return sum(chain.output_size) / max(sum(chain.fwd_time), 1e-12) / 2


def instances(args: argparse.Namespace) -> list[tuple[str, Chain]]:
    """The benchmark chains."""
    out = [(f"random_chain({n}, seed={s})", synthetic.random_chain(n, seed=s))
           for n in args.lengths for s in args.seeds]
    for name in args.networks:
        out.append((name, load_dataset(name)))
    return out


def row(label: str, limit: int, method: str, res: Result, dp: Result, seconds: float) -> str:
    """One Markdown row."""
    gap = res.gap if res.status.has_plan else float("nan")
    dp_far = (dp.objective / res.bound - 1) if res.bound and dp.status.has_plan else float("nan")
    model = res.report.get("model", {})
    relaxed = res.report.get("relaxation", {})
    relax = (f"{relaxed['bound']:.4g} ({relaxed.get('seconds', 0):.1f} s)"
             if isinstance(relaxed.get("bound"), float) else "-")
    work = res.report.get("engine_work", {})
    count = (f"{work['deterministic_time']:.0f} dt / {work.get('branches', 0)} br"
             if "deterministic_time" in work else
             f"{work.get('nodes', '-')} nodes" if work else "-")
    grid = res.report.get("time_scale", "-")
    if res.report.get("exact_times") is False:
        grid = f"{grid} (rounded)"
    return (f"| {label} | {limit} | {method} | {res.status} | {res.objective:.4g} | "
            f"{res.bound:.4g} | {relax} | {100 * gap:.2f} % | "
            f"{res.report.get('engine_time_s', 0):.1f} | {seconds:.1f} | {count} | {grid} | "
            f"{model.get('variables', '')} / {model.get('constraints', '')} | "
            f"{dp.objective:.4g} | {100 * dp_far:.2f} % |")


def main() -> None:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8,10,12")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--fractions", default="0.1,0.3,0.6")
    ap.add_argument("--methods", default="cpsat,ilp")
    ap.add_argument("--networks", default="")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=500)
    ap.add_argument("--out", default="")
    ap.add_argument("--extra", default="{}", help="method options (JSON), e.g. "
                    "'{\"relaxation\": false}'")
    ap.add_argument("--bandwidth", type=float, default=0.0,
                    help="link bandwidth in bytes/s (default: half of the activations the "
                         "forward pass produces in its own time, in chain units)")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    args.networks = [x for x in args.networks.split(",") if x]
    fractions = [float(x) for x in args.fractions.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    opts = SolveOptions(threads=args.threads, time_limit_s=args.time_limit, slots=args.slots,
                        extra=json.loads(args.extra))
    head = [f"\n## run of {time.strftime('%Y-%m-%d %H:%M')}: time limit {args.time_limit:g} s, "
            f"{args.threads} threads, options {args.extra}, load average at start "
            f"{', '.join(f'{x:.0f}' for x in os.getloadavg())} (2 cores)\n",
            "| instance | memory | method | status | objective | bound | relaxation bound | gap | "
            "engine s | total s | engine work | time grid | variables / rows | dp | "
            "dp vs bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    emit(args.out, head)
    proven = total = 0
    proof_times: list[float] = []
    for label, chain in instances(args):
        beta = bandwidth(chain)
        for limit in limits(chain, fractions):
            problem = (RematOffloadProblem(chain, limit, bandwidth=args.bandwidth)
                       if args.bandwidth > 0 else
                       RematOffloadProblem(chain, limit, chain_bandwidth=beta))
            dp = solve(problem, "dp", options=opts)
            for method in methods:
                t0 = time.perf_counter()
                res = solve(problem, method, options=opts)
                seconds = time.perf_counter() - t0
                total += 1
                if res.status in (Status.OPTIMAL, Status.INFEASIBLE):
                    proven += 1
                    proof_times.append(res.report.get("engine_time_s", seconds))
                emit(args.out, [row(label, limit, method, res, dp, seconds)])
    proof_times.sort()
    median = proof_times[len(proof_times) // 2] if proof_times else float("nan")
    emit(args.out, [f"\nproven: {proven} / {total}; median engine time to proof {median:.1f} s; "
                    f"load average at end {', '.join(f'{x:.0f}' for x in os.getloadavg())}\n"])


def emit(path: str, lines: list[str]) -> None:
    """Print lines and append them to ``path`` (if given)."""
    for line in lines:
        print(line, flush=True)
    if path:
        with Path(path).open("a") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
