"""``contiguous`` under the strict memory model: the pruned scan against the full scan.

Under ``--memory-model strict`` the default pipeline method scans every contiguous split
(memory need not fall as the period grows, so the stash model's DP does not apply). Since
stop 55 it tries splits in order of their largest load, skips a split with a stage below
``PipelineProblem.stage_memory_floor`` and stops each period scan at the best period found.
This script times, back to back on the same problems (``time.process_time``), the full scan
it replaced (``pipeline_contiguous.scan_contiguous``) and ``solve(problem, "contiguous")``,
checks that both return the same period and plan, and prints the ratio; then the
``sweep --memory auto`` start (``sweep.pipeline_start``, a bisection of ``contiguous`` and
``madpipe`` runs) with each.

Usage::

    python benchmarks/bench_pipeline_strict.py
    python benchmarks/bench_pipeline_strict.py --quick
    python benchmarks/bench_pipeline_strict.py --markdown benchmarks/results/pipeline_strict.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import uptime  # noqa: E402
from optmem import sweep  # noqa: E402
from optmem.cli_problems import parse_pipeline_bandwidth  # noqa: E402
from optmem.datasets import resolve_chain  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.result import Result, SolveOptions, Status  # noqa: E402
from optmem.solvers import pipeline as pipeline_solvers  # noqa: E402
from optmem.solvers import pipeline_contiguous as contig  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402
from optmem.solvers.pipeline_common import infeasible, lower_bound, plan_result  # noqa: E402

GIB = 2**30
CASES = [("resnet50-b32-224", 4, (1.0, 1.28, 2.4, 3.0, 4.29)),
         ("gpt2-small-b8-1024", 4, (8.0,)),
         ("vgg16-b64-224", 4, (8.0,))]
QUICK = [("resnet50-b32-224", 4, (3.0,))]


def problem_at(name: str, gpus: int, memory: int) -> PipelineProblem:
    """The strict problem of ``name`` on ``gpus`` GPUs at 12 GB/s with ``memory`` per GPU."""
    chain = resolve_chain(name)
    return PipelineProblem(chain, n_gpus=gpus, memory_per_gpu=memory,
                           chain_bandwidth=parse_pipeline_bandwidth("12GB/s", chain.time_unit),
                           memory_model="strict")


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and its CPU seconds."""
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def contiguous_rows(cases: list[tuple[str, int, tuple[float, ...]]]) -> list[str]:
    """One table row per (profile, memory): both scans' periods, CPU s and the ratio."""
    rows = []
    for name, gpus, memories in cases:
        for gib in memories:
            problem = problem_at(name, gpus, int(gib * GIB))
            full, t_full = timed(lambda p=problem: contig.scan_contiguous(p))
            result, t_new = timed(lambda p=problem: solve(p, "contiguous"))
            same = (full is None and not result.status.has_plan) or (
                full is not None and result.objective == full[0]
                and result.plan == full[1].to_strings())
            if not same:
                raise SystemExit(f"{name} at {gib} GiB: the scans differ")
            period = "none" if full is None else f"{full[0]:.2f}"
            rows.append(f"| {name} | {gpus} | {gib} | {period} | {t_full:.2f} | {t_new:.2f} | "
                        f"{t_full / max(t_new, 1e-9):.1f}x |")
            print(rows[-1], flush=True)
    return rows


def sweep_start_row(name: str, gpus: int) -> str:
    """``pipeline_start`` (contiguous + madpipe, up to 4 GiB) with the full and pruned scan."""
    def start() -> int | None:
        def factory(memory: int) -> PipelineProblem:
            return replace(problem_at(name, gpus, 1), memory_per_gpu=memory)
        return sweep.pipeline_start(factory, ["contiguous", "madpipe"],
                                    SolveOptions(threads=1), 4 * GIB)

    def full_scan(problem: PipelineProblem, stop: object = None) -> Result:  # until stop 55
        del stop
        found = contig.scan_contiguous(problem)
        if found is None:
            return infeasible(problem, "contiguous", "no contiguous allocation fits")
        return plan_result(problem, found[1], method="contiguous", status=Status.FEASIBLE,
                           bound=lower_bound(problem), claimed=found[0])

    with mock.patch.object(pipeline_solvers, "_best_contiguous_strict", full_scan):
        old, t_old = timed(start)
    new, t_new = timed(start)
    if old != new:
        raise SystemExit(f"sweep start differs: {old} against {new}")
    row = (f"| {name} | {gpus} | {new} | {t_old:.1f} | {t_new:.1f} | "
           f"{t_old / max(t_new, 1e-9):.1f}x |")
    print(row, flush=True)
    return row


def main() -> None:
    """Run the comparison and print (or write) the Markdown section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one problem, no sweep start")
    parser.add_argument("--markdown", type=Path, help="append the section to this file")
    args = parser.parse_args()
    head = ("| profile | GPUs | GiB | period | full scan CPU s | contiguous CPU s | ratio |\n"
            "|---|---|---|---|---|---|---|")
    print(head)
    rows = contiguous_rows(QUICK if args.quick else CASES)
    start = []
    if not args.quick:
        start = ["", "| profile | GPUs | auto start (B) | full scan CPU s | pruned CPU s | "
                 "ratio |", "|---|---|---|---|---|---|", sweep_start_row("resnet50-b32-224", 4)]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([f"## Strict contiguous: pruned scan against the full scan ({when})", "",
                      "`python benchmarks/bench_pipeline_strict.py` (12 GB/s, strict memory "
                      f"model; load {uptime()}): same period and plan in every row.", "",
                      head, *rows, *start, ""])
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write("\n" + text)


if __name__ == "__main__":
    main()
