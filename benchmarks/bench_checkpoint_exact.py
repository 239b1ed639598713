"""Benchmark the exact checkpointing models (ILP on HiGHS/CBC, CP-SAT) against the DPs.

Part 1: model size and time to prove optimality for L = 5, 10, 15, 20, 30 (seeded random
chains, memory at 10 % and 30 %), each engine with 2 threads and a time limit per solve.
Part 2: how often and by how much the persistent DP (paper) is above the true optimum on
random chains (L = 6..12), proven by the ILP (HiGHS). Memory limits of parts 1-2 are the
fraction of the way from the persistent DP's smallest feasible limit to the store-all peak.
Part 3 (issue 15 item 6, checkpoint part): the bundled profiles (L = 10..68) at 10 %, 30 % and
60 % of the way from the smallest feasible memory to the store-all peak
(:func:`optmem.solvers.dataset_summary.dataset_summary`): the ILP (HiGHS, 2 threads) -- status, time
to proof or gap at the time limit, B&B nodes and LP iterations (deterministic work, read
from HiGHS's own report) -- against the persistent DP's value (how far the DP is from the
optimum).
Part 4: CP-SAT against the ILP on the instances ``compare`` gives both (chains of at most
``CPSAT_COMPARE_MAX`` stages): time to proof of each and the ratio.
Part 5: the headline instance, ResNet-152 (``resnet152-b32-224``, L = 56) at 30 %, run
``--repeat`` times.

The machine is shared: each part records ``uptime`` before it starts.

Usage::

    PYTHONPATH=. python benchmarks/bench_checkpoint_exact.py [--quick] [--time-limit S]
        [--parts 1,2,3,4,5] [--networks A,B] [--out benchmarks/results/checkpoint_exact.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from optmem.chain import Chain
from optmem.datasets import load_dataset
from optmem.datasets.synthetic import random_chain
from optmem.models.checkpoint_ilp import build_formulation
from optmem.problems.checkpoint import CheckpointProblem, discretize
from optmem.result import Result, SolveOptions
from optmem.solvers.checkpoint_dp import min_memory_persistent
from optmem.solvers.dataset_summary import dataset_summary
from optmem.solvers.facade import solve

ENGINES = ("highs", "cbc", "cpsat")
NETWORKS = ["unet-b4-512", "resnet18-b64-224", "vit-b16-b64-224", "gpt2-small-b8-1024",
            "resnet50-b32-224", "inception3-b32-299", "gpt2-medium-b4-1024",
            "resnet101-b32-224", "gpt2-large-b2-1024", "resnet152-b32-224",
            "densenet121-b32-224"]
HEADLINE = ("resnet152-b32-224", 0.3)
HIGHS_OPTIONS: dict[str, object] = {}
"""Extra HiGHS options of every ILP solve on HiGHS (``--highs-options``)."""
MODEL_OPTIONS: dict[str, object] = {}
"""Extra model options (``SolveOptions.extra``) of every exact solve (``--extra``), e.g.
``{"tape_chain": false}`` for the model without the tape-chain rows."""


# ------------------------------------------------------------------ helpers
def _limit(chain: Chain, frac: float) -> int:
    """``frac`` of the way from the persistent DP's smallest feasible limit to store-all."""
    low = min_memory_persistent(chain)
    return low + int(frac * (chain.store_all_peak() - low))


def _zoo_limit(name: str, frac: float) -> int:
    """``frac`` of the way from the smallest feasible memory to store-all (issue 15)."""
    s = dataset_summary(name)
    return int(s["min_feasible"] + frac * (s["store_all"] - s["min_feasible"]))


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "uptime unavailable"


@contextlib.contextmanager
def _captured_stdout() -> Iterator[list[str]]:
    """Capture what C libraries print on file descriptor 1 (the engines' own logs)."""
    out: list[str] = []
    fd, path = tempfile.mkstemp(prefix="optmem-bench-", suffix=".log")
    saved = os.dup(1)
    try:
        sys.stdout.flush()
        os.dup2(fd, 1)
        yield out
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)
        with open(path) as fh:
            out.append(fh.read())
        os.unlink(path)


def _work(log: str) -> tuple[str, str]:
    """B&B nodes and LP iterations from a HiGHS report, or branches and deterministic
    time from a CP-SAT log ('-' when absent)."""
    nodes = re.findall(r"^\s*Nodes\s+(\d+)", log, re.M)
    iters = re.findall(r"^\s*LP iterations\s+(\d+)", log, re.M)
    if nodes or iters:
        return (nodes[-1] if nodes else "-"), (iters[-1] if iters else "-")
    branches = re.findall(r"^#?\s*[Bb]ranches\s*:\s*(\d+)", log, re.M)
    dtime = re.findall(r"^deterministic_time\s*:\s*([0-9.eE+-]+)", log, re.M)
    return (branches[-1] if branches else "-"), (f"{float(dtime[-1]):.1f} dt" if dtime
                                                  else "-")


def _run(problem: CheckpointProblem, engine: str, time_limit: float | None,
         method: str | None = None) -> tuple[Result, float, str, str]:
    """Solve; return the result, wall time, nodes (branches) and LP iterations (det. time)."""
    method = method or ("cpsat" if engine == "cpsat" else "ilp")
    extra: dict[str, object] = dict(MODEL_OPTIONS)
    if engine == "highs" and HIGHS_OPTIONS:
        extra["highs_options"] = dict(HIGHS_OPTIONS)
    opts = SolveOptions(solver="highs" if engine == "cpsat" else engine,
                        time_limit_s=time_limit, threads=2, verbose=True, extra=extra)
    with _captured_stdout() as log:
        start = time.perf_counter()
        r = solve(problem, method, options=opts)
        elapsed = time.perf_counter() - start
    nodes, iters = _work(log[0])
    return r, elapsed, nodes, iters


def _fmt(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:g}"


def _gap(r: Result) -> str:
    return f"{100 * r.gap:.2f} %" if math.isfinite(r.gap) else "-"


# ------------------------------------------------------------------ part 1
def part_sizes(lengths: list[int], fracs: list[float], time_limit: float) -> list[str]:
    """Rows of the size / time-to-optimality table."""
    rows = ["| L | memory | variables | constraints | nonzeros | DP (persistent) | engine "
            "| status | objective | bound | gap | time (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        chain = random_chain(length, seed=length)
        for frac in fracs:
            memory = _limit(chain, frac)
            problem = CheckpointProblem(chain, memory)
            disc = discretize(chain, memory)
            size = build_formulation(disc.chain, disc.memory_limit).size
            dp = solve(problem, "dp")
            for engine in ENGINES:
                r, elapsed, _, _ = _run(problem, engine, time_limit)
                line = (f"| {length} | {memory} ({int(100 * frac)} %) | {size['variables']} | "
                        f"{size['constraints']} | {size['nonzeros']} | {_fmt(dp.objective)} | "
                        f"{engine} | {r.status} | {_fmt(r.objective)} | {_fmt(r.bound)} | "
                        f"{_gap(r)} | {elapsed:.1f} |")
                print(line, flush=True)
                rows.append(line)
    return rows


# ------------------------------------------------------------------ part 2
def part_dp_gap(count: int, lengths: range, fracs: list[float], time_limit: float
                ) -> list[str]:
    """How often the persistent DP is above the proven optimum, and by how much."""
    total = above = unproven = 0
    gaps: list[float] = []
    worst = (0.0, "")
    for seed in range(count):
        length = lengths[seed % len(lengths)]
        chain = random_chain(length, seed=1000 + seed)
        for frac in fracs:
            problem = CheckpointProblem(chain, _limit(chain, frac))
            dp = solve(problem, "dp")
            if not dp.status.has_plan:
                continue
            exact, _, _, _ = _run(problem, "highs", time_limit)
            if str(exact.status) != "optimal":
                unproven += 1
                continue
            total += 1
            assert exact.objective <= dp.objective + 1e-9
            if dp.objective > exact.objective + 1e-9:
                above += 1
                rel = dp.objective / exact.objective - 1
                gaps.append(rel)
                if rel > worst[0]:
                    worst = (rel, f"L={length}, seed={1000 + seed}, memory={problem.memory_limit}"
                                  f": DP {dp.objective:g} vs exact {exact.objective:g}")
    lines = [f"- instances with a proven optimum: {total} (not proven within the limit: "
             f"{unproven})",
             f"- persistent DP above the optimum: {above} ({100 * above / max(total, 1):.0f} %)"]
    if gaps:
        lines.append(f"- when above: mean {100 * statistics.mean(gaps):.1f} %, "
                     f"max {100 * max(gaps):.1f} % ({worst[1]})")
    for line in lines:
        print(line, flush=True)
    return lines


# ------------------------------------------------------------------ part 3
def part_networks(names: list[str], fracs: list[float], time_limit: float) -> list[str]:
    """Bundled profiles: persistent DP vs the ILP (HiGHS), proof times and work."""
    rows = ["| chain | L | memory | DP (persistent) | DP time (s) | ILP objective | status "
            "| bound | gap | DP above optimum | time (s) | nodes | LP iterations |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    proven = total = 0
    for name in names:
        chain = load_dataset(name)
        for frac in fracs:
            problem = CheckpointProblem(chain, _zoo_limit(name, frac))
            start = time.perf_counter()
            dp = solve(problem, "dp")
            dp_time = time.perf_counter() - start
            r, elapsed, nodes, iters = _run(problem, "highs", time_limit)
            total += 1
            proven += str(r.status) == "optimal"
            above = "-"
            if str(r.status) == "optimal" and dp.status.has_plan:
                above = f"{100 * (dp.objective / r.objective - 1):.2f} %"
            elif r.status.has_plan and dp.status.has_plan:
                above = f"<= {100 * (dp.objective / r.bound - 1):.2f} %"
            line = (f"| {name} | {chain.length} | {int(100 * frac)} % | {dp.objective:.3f} | "
                    f"{dp_time:.1f} | {r.objective:.3f} | {r.status} | {r.bound:.3f} | "
                    f"{_gap(r)} | {above} | {elapsed:.1f} | {nodes} | {iters} |")
            print(line, flush=True)
            rows.append(line)
    rows += ["", f"Proven optimal: {proven} of {total} (time limit {time_limit:g} s per solve)."]
    return rows


# ------------------------------------------------------------------ part 4
def cpsat_instances(quick: bool) -> list[tuple[str, CheckpointProblem]]:
    """Chains ``compare`` runs CP-SAT on by default (random L = 6..12, small networks)."""
    out = []
    for length in ([6, 10] if quick else [6, 8, 10, 12]):
        chain = random_chain(length, seed=length)
        for frac in (0.1, 0.3):
            out.append((f"random L={length} {int(100 * frac)} %",
                        CheckpointProblem(chain, _limit(chain, frac))))
    for name in (["unet-b4-512"] if quick else ["unet-b4-512", "resnet18-b64-224",
                                                "vit-b16-b64-224", "gpt2-small-b8-1024"]):
        for frac in (0.1, 0.3):
            out.append((f"{name} {int(100 * frac)} %",
                        CheckpointProblem(load_dataset(name), _zoo_limit(name, frac))))
    return out


def part_cpsat(quick: bool, time_limit: float) -> list[str]:
    """CP-SAT against the ILP (HiGHS) on the same instances: time to proof and ratio."""
    rows = ["| instance | L | ILP status | ILP time (s) | ILP nodes | CP-SAT status "
            "| CP-SAT time (s) | CP-SAT branches | CP-SAT / ILP |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, problem in cpsat_instances(quick):
        ilp, t_ilp, n_ilp, _ = _run(problem, "highs", time_limit)
        cp, t_cp, n_cp, _ = _run(problem, "cpsat", time_limit)
        both = str(ilp.status) == str(cp.status) == "optimal"
        ratio = f"{t_cp / t_ilp:.1f}" if both else "-"
        line = (f"| {label} | {problem.chain.length} | {ilp.status} | {t_ilp:.1f} | {n_ilp} | "
                f"{cp.status} ({_gap(cp)}) | {t_cp:.1f} | {n_cp} | {ratio} |")
        print(line, flush=True)
        rows.append(line)
    return rows


# ------------------------------------------------------------------ part 5
def part_headline(repeat: int, time_limit: float) -> list[str]:
    """ResNet-152 at 30 %: the ILP ``repeat`` times (wall time, nodes, LP iterations)."""
    name, frac = HEADLINE
    problem = CheckpointProblem(load_dataset(name), _zoo_limit(name, frac))
    dp = solve(problem, "dp")
    rows = [f"`{name}` at {int(100 * frac)} % (limit {problem.memory_limit} B), persistent "
            f"DP {dp.objective:.6f}:", "",
            "| run | load before | status | objective | bound | gap | time (s) | nodes "
            "| LP iterations |", "|---|---|---|---|---|---|---|---|---|"]
    for run in range(1, repeat + 1):
        load = _uptime().split("load average:")[-1].strip()
        r, elapsed, nodes, iters = _run(problem, "highs", time_limit)
        line = (f"| {run} | {load} | {r.status} | {r.objective:.6f} | {r.bound:.6f} | "
                f"{_gap(r)} | {elapsed:.1f} | {nodes} | {iters} |")
        print(line, flush=True)
        rows.append(line)
    return rows


# ------------------------------------------------------------------ main
def main() -> None:
    """Run the benchmark and write the Markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, short limits")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per solve")
    parser.add_argument("--headline-limit", type=float, default=600.0)
    parser.add_argument("--repeat", type=int, default=2, help="runs of the headline instance")
    parser.add_argument("--parts", default="1,2,3,4,5")
    parser.add_argument("--out", default="benchmarks/results/checkpoint_exact.md")
    parser.add_argument("--networks", default=None,
                        help="comma-separated bundled profiles for part 3 (default: all)")
    parser.add_argument("--fracs", default=None,
                        help="comma-separated memory fractions for part 3 (default 0.1,0.3,0.6)")
    parser.add_argument("--highs-options", default=None,
                        help='JSON dict of extra HiGHS options (ILP on HiGHS)')
    parser.add_argument("--extra", default=None,
                        help='JSON dict of model options, e.g. \'{"tape_chain": false}\'')
    args = parser.parse_args()
    if args.extra:
        MODEL_OPTIONS.update(json.loads(args.extra))
    if args.highs_options:
        HIGHS_OPTIONS.update(json.loads(args.highs_options))
    parts = {int(p) for p in args.parts.split(",")}
    if args.quick:
        lengths, fracs, limit = [5, 10], [0.1], args.time_limit or 10.0
        count, gap_lengths, nets = 8, range(6, 9), ["unet-b4-512", "resnet50-b32-224"]
    else:
        lengths, fracs, limit = [5, 10, 15, 20, 30], [0.1, 0.3], args.time_limit or 120.0
        count, gap_lengths, nets = 30, range(6, 13), NETWORKS
    if args.networks:
        nets = args.networks.split(",")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sections = []

    def section(title: str, part: Callable[[], list[str]]) -> None:
        load = _uptime()  # before the part runs
        sections.extend([f"## {title}", "", f"Load before the part: `{load}`.", "",
                         *part(), ""])

    if 1 in parts:
        print(f"## Time to prove optimality (limit {limit:g} s per solve, 2 threads)")
        load = _uptime()
        body = part_sizes(lengths, fracs, min(limit, 60.0))
        sections.extend([f"## Random chains: time to prove optimality (limit "
                         f"{min(limit, 60.0):g} s per solve)", "", f"Load before: `{load}`.",
                         "", *body, ""])
    if 2 in parts:
        load = _uptime()
        body = part_dp_gap(count, gap_lengths, [0.0, 0.1, 0.25], min(limit, 60.0))
        sections.extend([f"## Persistent DP vs proven optimum ({count} random chains, L = "
                         f"{gap_lengths.start}..{gap_lengths.stop - 1}, memory at 0/10/25 %)",
                         "", f"Load before: `{load}`.", "", *body, ""])
    net_fracs = [float(f) for f in args.fracs.split(",")] if args.fracs else [0.1, 0.3, 0.6]
    if 3 in parts:
        shown = "/".join(f"{round(100 * f)}" for f in net_fracs)
        options = f", HiGHS options {json.dumps(HIGHS_OPTIONS)}" if HIGHS_OPTIONS else ""
        section(f"Bundled profiles at {shown} % (ILP on HiGHS, 2 threads, limit {limit:g} s"
                f"{options})", lambda: part_networks(nets, net_fracs, limit))
    if 4 in parts:
        section(f"CP-SAT against the ILP where `compare` runs both (limit {limit:g} s)",
                lambda: part_cpsat(args.quick, limit))
    if 5 in parts:
        section(f"Headline: ResNet-152 at 30 % (limit {args.headline_limit:g} s, "
                f"{args.repeat} runs)", lambda: part_headline(args.repeat, args.headline_limit))
    text = "\n".join([
        "# Exact checkpointing models: measured figures",
        "",
        f"Run {started} on {platform.machine()} ({platform.python_version()}), "
        f"`bench_checkpoint_exact.py{' --quick' if args.quick else ''} --parts {args.parts}`, "
        "2 threads per solve, on the shared 2-core machine (the load average before each part "
        "is given: above 2 means other jobs shared the cores, so wall-clock times are "
        "inflated; nodes and LP iterations are the engine's own deterministic counts). Every "
        "objective is the simulated makespan of the returned plan; `bound` is the proven "
        "lower bound in the chain's time unit.",
        "", *sections,
    ])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
