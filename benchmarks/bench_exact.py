"""Proven-optimal rate and time to proof of every exact model, against the DPs (issue 15.6).

One table for the four problems, on bundled profiles at three memory limits, 2 threads:

* **checkpoint**: ``ilp`` (HiGHS) against the persistent DP (``dp``); limits ``alpha`` = 10,
  30, 60 % of the way from the smallest feasible memory to the store-all peak (the dataset
  summary's figures, as in the issue).
* **offload**: ``cpsat`` (exact time grid) against DYNPROG (``dp``), 12 GB/s; the same limits
  (an ``alpha`` below the offloading minimum reports ``infeasible``).
* **remat-offload**: ``cpsat`` against the chapter-4 DP (``dp``), 12 GB/s, the same limits.
* **pipeline**: ``chunks`` with ``family="all"`` (every allocation decided by the exact
  model with the allocation fixed: a bound of every plan, 1-periodic patterns as ``ilp``;
  ``ilp`` until stop 71, which proves little past 8 layers) against MadPipe (``madpipe``),
  4 GPUs, 12 GB/s, memory per GPU 1.1x, 1.5x and 3x the smallest contiguous allocation's.

Every row is a result of :func:`optmem.solve` (each plan is replayed by the simulator
there); ``DP / optimum`` is the DP's value over the exact method's proven bound (the DP's
distance from the optimum when the optimum is proven, an upper bound on it otherwise). The
per-problem scripts (``bench_<problem>_exact.py``) go deeper on one problem each (engines
side by side, random chains, deterministic work counts); this one is the overview.

Usage::

    python benchmarks/bench_exact.py [--quick] [--time-limit S] [--profiles a,b]
        [--problems checkpoint,offload] [--exact remat-offload=ilp]
        [--threads N] [--options '{"strategy": "benders"}'] [--memories 10%,60%]
        [--out benchmarks/results/exact.md]

``--options`` is the ``extra`` of every exact solve (the DPs get only the threads);
``--memories`` keeps the instances with these labels. Defaults: 2 threads, no extra, all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optmem import (
    CheckpointProblem,
    OffloadProblem,
    PipelineProblem,
    RematOffloadProblem,
    SolveOptions,
    Status,
    solve,
)
from optmem.datasets import load_dataset
from optmem.result import Result
from optmem.solvers.dataset_summary import dataset_summary
from optmem.solvers.pipeline import min_memory_contiguous

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import uptime  # noqa: E402

BANDWIDTH = "12GB/s"
ALPHAS = (0.1, 0.3, 0.6)
GPU_FACTORS = (1.1, 1.5, 3.0)
GPUS = 4
PROFILES = ("resnet18-b64-224", "resnet50-b32-224", "gpt2-small-b8-1024",
            "inception3-b32-299")
QUICK_PROFILES = ("resnet18-b64-224", "resnet50-b32-224")


@dataclass(frozen=True)
class Setting:
    """How one problem is benchmarked: its exact method, its DP, and its instances.

    ``extra``: ``SolveOptions.extra`` entries of the exact method (under ``--options``;
    dropped when ``--exact`` names another method).
    """

    exact: str
    dp: str
    instances: Callable[[str], Iterator[tuple[str, Any]]]
    extra: tuple[tuple[str, Any], ...] = ()


def checkpoint_like(cls: type, **kwargs: Any) -> Callable[[str], Iterator[tuple[str, Any]]]:
    """Instances at ``ALPHAS`` of the way from the smallest feasible memory to store-all."""

    def make(name: str) -> Iterator[tuple[str, Any]]:
        chain, summary = load_dataset(name), dataset_summary(name)
        low, high = summary["min_feasible"], summary["store_all"]
        for alpha in ALPHAS:
            yield f"{alpha:.0%}", cls(chain, int(low + alpha * (high - low)), **kwargs)

    return make


def pipeline_instances(name: str) -> Iterator[tuple[str, Any]]:
    """``GPU_FACTORS`` times the smallest contiguous allocation's memory per GPU."""
    chain = load_dataset(name)
    low = min_memory_contiguous(PipelineProblem(chain, GPUS, 1, BANDWIDTH))
    for factor in GPU_FACTORS:
        yield f"{factor}x", PipelineProblem(chain, GPUS, int(low * factor), BANDWIDTH)


SETTINGS = {
    "checkpoint": Setting("ilp", "dp", checkpoint_like(CheckpointProblem)),
    "offload": Setting("cpsat", "dp", checkpoint_like(OffloadProblem, bandwidth=BANDWIDTH)),
    "remat-offload": Setting("cpsat", "dp",
                             checkpoint_like(RematOffloadProblem, bandwidth=BANDWIDTH)),
    "pipeline": Setting("chunks", "madpipe", pipeline_instances, (("family", "all"),)),
}


def timed(problem: Any, method: str, options: SolveOptions) -> tuple[Result, float]:
    """One :func:`optmem.solve` call and its wall-clock time."""
    start = time.perf_counter()
    result = solve(problem, method, options=options)
    return result, time.perf_counter() - start


def fmt(x: float | None, digits: int = 2) -> str:
    """A number, or ``-`` where there is none."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.{digits}f}"


def percent(x: float) -> str:
    """A fraction as a percentage, or ``-``."""
    return "-" if not math.isfinite(x) else f"{100 * x:.2f} %"


def ratio(dp: Result, exact: Result) -> str:
    """``DP value / proven bound``, marked ``=`` where the bound is the proven optimum."""
    if not (dp.status.has_plan and math.isfinite(exact.bound) and exact.bound > 0):
        return "-"
    mark = " (=)" if exact.status is Status.OPTIMAL else " (<=)"
    return f"{dp.objective / exact.bound:.4f}{mark}"


def run(problems: list[str], profiles: list[str], limit: float,
        options: SolveOptions | None = None, memories: list[str] | None = None) -> list[str]:
    """The rows of the table, then a summary per problem.

    ``options`` (default: 2 threads and ``limit`` seconds) go to every exact solve, and its
    threads to the DP; ``memories`` keeps only the instances with these labels (``10%``).
    """
    rows = ["| problem | profile | L | memory | DP | DP value | exact | status | objective | "
            "bound | gap | time (s) | DP / optimum |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if options is None:
        options = SolveOptions(threads=2, time_limit_s=limit)
    tally: dict[str, list[tuple[bool, float]]] = {p: [] for p in problems}
    for pname in problems:
        setting = SETTINGS[pname]
        for profile in profiles:
            for label, problem in setting.instances(profile):
                if memories is not None and label not in memories:
                    continue
                dp, _ = timed(problem, setting.dp, SolveOptions(threads=options.threads))
                exact, seconds = timed(problem, setting.exact, options.with_(
                    extra={**dict(setting.extra), **options.extra}))
                if exact.status is Status.INFEASIBLE:
                    proven = True
                else:
                    proven = exact.status is Status.OPTIMAL
                tally[pname].append((proven, seconds))
                rows.append(
                    f"| {pname} | {profile} | {problem.chain.length} | {label} | {setting.dp} | "
                    f"{fmt(dp.objective)} | {setting.exact} | {exact.status} | "
                    f"{fmt(exact.objective)} | {fmt(exact.bound)} | "
                    f"{percent(exact.gap)} | {seconds:.1f} | {ratio(dp, exact)} |")
                print(rows[-1], flush=True)
    rows += ["", "| problem | proven (optimal or infeasible) | median time to proof (s) | "
             "max time to proof (s) |", "|---|---|---|---|"]
    for pname, runs in tally.items():
        proofs = [s for ok, s in runs if ok]
        med = fmt(statistics.median(proofs), 1) if proofs else "-"
        top = fmt(max(proofs), 1) if proofs else "-"
        rows.append(f"| {pname} | {len(proofs)} / {len(runs)} | {med} | {top} |")
    return rows


def _command_line(argv: list[str]) -> str:
    """The arguments as given, for the file's first line (until stop 56 only ``--quick``).

    The default ``--out`` is left out; every other option is what reproduces the table.
    """
    if argv[-2:-1] == ["--out"] and argv[-1] == "benchmarks/results/exact.md":
        argv = argv[:-2]
    return "".join(" " + shlex.quote(a) for a in argv)


def main() -> None:
    """Run the table and write it as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"profiles {', '.join(QUICK_PROFILES)} and 60 s per solve")
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds per exact solve (default 600: the issue's 10 minutes)")
    parser.add_argument("--profiles", help="comma-separated bundled profiles")
    parser.add_argument("--problems", default=",".join(SETTINGS),
                        help="comma-separated subset of " + ", ".join(SETTINGS))
    parser.add_argument("--exact", action="append", default=[], metavar="PROBLEM=METHOD",
                        help="another exact method for a problem (e.g. remat-offload=ilp)")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads per solve (default 2)")
    parser.add_argument("--options", default="{}", metavar="JSON",
                        help='extra options of the exact solves, e.g. \'{"strategy": "benders"}\'')
    parser.add_argument("--memories",
                        help="comma-separated memory labels to keep (e.g. 10%%,60%%; "
                             "pipeline: 1.1x); default all")
    parser.add_argument("--out", default="benchmarks/results/exact.md")
    args = parser.parse_args()
    limit = 60.0 if args.quick and args.time_limit == 600.0 else args.time_limit
    profiles = (args.profiles.split(",") if args.profiles
                else list(QUICK_PROFILES if args.quick else PROFILES))
    problems = args.problems.split(",")
    unknown = sorted(set(problems) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown problem(s) {', '.join(unknown)}")
    for item in args.exact:
        pname, _, method = item.partition("=")
        if pname not in SETTINGS or not method:
            parser.error(f"--exact {item}: expected PROBLEM=METHOD, PROBLEM one of "
                         + ", ".join(SETTINGS))
        SETTINGS[pname] = dataclasses.replace(SETTINGS[pname], exact=method, extra=())
    try:
        extra = json.loads(args.options)
    except json.JSONDecodeError as err:
        parser.error(f"--options: not JSON ({err})")
    if not isinstance(extra, dict):
        parser.error("--options: expected a JSON object")
    options = SolveOptions(threads=args.threads, time_limit_s=limit, extra=extra)
    memories = args.memories.split(",") if args.memories else None
    start = uptime()
    rows = run(problems, profiles, limit, options, memories)
    head = [
        "# Exact models of the four problems: proven-optimal rate and time to proof",
        "",
        f"Produced by `python benchmarks/bench_exact.py{_command_line(sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"Python {platform.python_version()}): {limit:.0f} s and {args.threads} "
        f"thread{'s' if args.threads != 1 else ''} per exact solve"
        f"{f', options {extra}' if extra else ''}, "
        f"{BANDWIDTH} link for offloading and pipelines. Load average at the start "
        f"{start}, at the end {uptime()} (2 shared cores: wall-clock figures are noisy, "
        "statuses and bounds are what the time limit allowed).",
        "",
    ]
    Path(args.out).write_text("\n".join(head + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
