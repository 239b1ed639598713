"""The chunk scan's complete family (``extra["family"] = "all"``) on the bench_exact pipeline rows.

The six pipeline rows of ``benchmarks/bench_exact.py`` (ResNet-18 and ResNet-50, 4 GPUs,
12 GB/s, memory 1.1x / 1.5x / 3x the smallest contiguous one) and the headline (ResNet-50,
4 GPUs, 3 GiB, 12 GB/s), stash model.

``--count-only``: for each instance, the allocations of the complete family (every
allocation, GPUs numbered by first use) whose floor
(:func:`~optmem.solvers.pipeline_chunks.allocation_floor`) is below a period (the best known
plan's, :data:`KNOWN`, less :data:`~optmem.solvers.pipeline_chunks.PROOF_STEP`), counted by
the enumeration the method uses (pruned by the partial floor; stopped at ``--max``), with
the prefixes it tried and how many of them the loads and the partial floor cut;
``--count-waits``: and how many of them the waits rows
(:func:`~optmem.solvers.pipeline_chunks.within`, ``WAIT_ROUNDS`` rounds, what the scan asks
before each question since stop 59) leave at that period.

Otherwise: ``solve(problem, "chunks", extra={"family": "all"})`` on each instance (2
threads, the defaults otherwise, ``--time-limit`` seconds): status, period, bound, the least
bound of an allocation (``report["allocations_bound"]``, stop 57), the k-chunk scan's and the
complete family's counts (asked / refuted, of which by the waits rows without a question,
stop 59, and by trimmed questions of how many asked, stop 62 / undecided), CPU and wall
seconds, the load. ``--waits off`` runs the method without the waits rows
(``extra["waits"] = False``, the method before stop 59); ``--trim off`` without the trimmed
questions (``extra["trim"] = False``, the method before stop 62); ``--heads off`` without
the head pass (``extra["heads"] = False``, the method before stop 63; the table's heads
column: heads asked / refuted by :func:`~optmem.solvers.pipeline_chunks.head_pass`, of
which by the heads' floor without a question, and how the pass ended; the heads of each
length, ``[length, asked, refuted, by the floor, by a GPU content]``, go to stderr);
``--head-floor on`` with the heads' floor (``extra["head_floor"] = True``, stop 64; off by
default, as in the method); ``--head-contents on`` with the GPU contents of refuted heads
(``extra["head_contents"] = True``, stop 65; off by default, as in the method: the heads
column then adds the heads a content refuted without a question and the contents asked /
refuted). ``--proof-gap G`` proves the plan within the share ``G`` instead of optimal
(``extra["proof_gap"]``, stop 70; e.g. 0.01).

``--floor-gap N``: how far the floors are from what the exact model proves. For each
instance, the first ``N`` allocations of the complete family in the scan's order (increasing
loads-and-lifetimes floor) that the waits rows leave at the cutoff (what the scan would ask
next): the old floor, the waits floor (``allocation_floor`` with ``WAIT_ROUNDS`` rounds), the
scan's question at the cutoff (``_decide``, ``CHUNK_WORK`` deterministic seconds: refuted or
a plan) with its CPU seconds, and the allocation's own optimum (the fixed-allocation model
minimising the period, one worker, ``--optimum-work`` deterministic seconds; simulated).

Usage::

    python benchmarks/bench_pipeline_family.py [--count-only [--max N] [--count-waits]]
        [--only NAME ...] [--time-limit S] [--family-limit N] [--waits on|off]
        [--trim on|off] [--heads on|off] [--head-floor on|off] [--head-contents on|off]
        [--proof-gap G] [--floor-gap N [--optimum-work S]]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from optmem import PipelineProblem, SolveOptions, solve
from optmem.datasets import resolve_chain
from optmem.models.pipeline import make_units
from optmem.solvers import pipeline_chunks
from optmem.solvers.pipeline_common import replayed_period, run_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_exact import pipeline_instances  # noqa: E402
from bench_pipeline_exact import headline_problem  # noqa: E402

KNOWN = {
    "resnet18 1.1x": 91.64148533333334, "resnet18 1.5x": 82.33949533333333,
    "resnet18 3.0x": 32.149554, "resnet50 1.1x": 108.984662, "resnet50 1.5x": 66.08,
    "resnet50 3.0x": 33.45, "headline": 31.3896,
}
"""Best periods known (stop 56's proofs where it proved one; ``bench_exact``'s 60 s ``ilp``
plans, two decimals, and the headline's 31.3896 otherwise). ResNet-50 at 1.5x was proven
optimal at 66.0826 in stop 61; its entry stays 66.08 so that stop 60's counts reproduce.
The headline's 31.3896 was proven optimal in stop 63 (the head pass), ResNet-50 at 3x at
30.0079 in stop 66; its entry stays 33.45 so that the earlier counts reproduce."""


def instances() -> Iterator[tuple[str, PipelineProblem]]:
    """The six bench_exact pipeline rows, then the headline."""
    for name in ("resnet18-b64-224", "resnet50-b32-224"):
        for label, problem in pipeline_instances(name):
            yield f"{name.split('-')[0]} {label}", problem
    yield "headline", headline_problem(resolve_chain("resnet50-b32-224"))


def load() -> str:
    """The 1-minute load average."""
    return f"{os.getloadavg()[0]:.1f}"


def count(name: str, problem: PipelineProblem, most: int, waits: bool = False) -> None:
    """One row of the count table (``waits``: and how many the waits rows leave)."""
    units = make_units(problem)
    cutoff = KNOWN[name] * (1 - pipeline_chunks.PROOF_STEP)
    memory = pipeline_chunks.floor_memory(problem)
    stats: dict[str, int] = {}
    cpu, start = time.process_time(), load()
    family = []
    for gpu in pipeline_chunks.chunk_allocations(units, problem.n_gpus, units.n, cutoff,
                                                 memory, stats):
        family.append(gpu)
        if len(family) >= most:
            break
    found = len(family)
    shown = f">= {found:,}" if found >= most else f"{found:,}"
    cut = stats["floor"] / max(1, stats["tried"] - stats["load"])
    left = "-"
    if waits:
        kept = sum(pipeline_chunks.within(units, gpu, problem.n_gpus, memory, cutoff,
                                          pipeline_chunks.WAIT_ROUNDS) for gpu in family)
        left = f"{kept:,}"
    print(f"| {name} | {units.n} | {cutoff:.4f} | {shown} | {stats['tried']:,} | "
          f"{stats['load']:,} | {stats['floor']:,} ({cut:.0%}) | {left} | "
          f"{time.process_time() - cpu:.1f} | {start} / {load()} |", flush=True)


def floor_gap(name: str, problem: PipelineProblem, most: int, work: float) -> None:
    """Rows of the floor-gap table: the next ``most`` questions of the complete family."""
    units = make_units(problem)
    memory = pipeline_chunks.floor_memory(problem)
    cutoff = KNOWN[name] * (1 - pipeline_chunks.PROOF_STEP)
    family, _ = pipeline_chunks.ranked(problem, units, units.n, cutoff,
                                       limit=pipeline_chunks.FAMILY_LIMIT)
    rounds = pipeline_chunks.WAIT_ROUNDS
    shown = 0
    for old, gpu in family:
        if shown >= most:
            break
        waits = pipeline_chunks.allocation_floor(units, gpu, problem.n_gpus, memory, cutoff,
                                                 rounds)
        if waits == math.inf:  # what ``within`` answers: the waits rows refute it
            continue
        shown += 1
        cpu = time.process_time()
        answer = pipeline_chunks._decide(problem, units, gpu, cutoff,
                                         pipeline_chunks.CHUNK_WORK, 0, None)
        asked = time.process_time() - cpu
        verdict = ("refuted" if answer.refuted else
                   f"plan {answer.found[0]:.2f}" if answer.found else "undecided")
        cpu = time.process_time()
        best = run_model(problem, "cpsat", SolveOptions(threads=1, deterministic_time=work),
                         units=units, gpu=list(gpu), upper_bound=4 * KNOWN[name])
        period = None if best.plan is None else replayed_period(problem, best.plan)
        optimum = "-" if period is None else f"{period:.2f} ({best.status.value})"
        print(f"| {name} | {''.join(map(str, gpu))} | {old:.2f} | {waits:.2f} | {verdict} | "
              f"{asked:.1f} | {optimum} | {time.process_time() - cpu:.1f} |", flush=True)


def cpu_time() -> float:
    """CPU seconds of this process and of its children waited for (the head pass's worker
    processes, stop 69: ``time.process_time`` alone does not count them)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run(name: str, problem: PipelineProblem, limit: float | None, family_limit: int,
        waits: bool = True, trim: bool = True, heads: bool = True, head_floor: bool = False,
        head_contents: bool = False, proof_gap: float | None = None) -> None:
    """One row of the solve table (the heads of each length to stderr)."""
    extra = {"family": "all", "family_limit": family_limit, "waits": waits, "trim": trim,
             "heads": heads, "head_floor": head_floor, "head_contents": head_contents,
             "proof_gap": proof_gap}
    cpu, wall, start = cpu_time(), time.perf_counter(), load()
    res = solve(problem, "chunks", options=SolveOptions(threads=2, time_limit_s=limit,
                                                        extra=extra))
    cpu, wall = cpu_time() - cpu, time.perf_counter() - wall
    r = res.report

    def part(prefix: str) -> str:
        return (f"{r[prefix + '_family']:,} / {r[prefix + '_evaluated']:,} / "
                f"{r[prefix + '_refuted']:,} ({r.get(prefix + '_waited', 0):,} / "
                f"{r.get(prefix + '_trimmed', 0):,} of {r.get(prefix + '_trim_questions', 0):,}) / "
                f"{r[prefix + '_undecided']:,}")

    gap = (res.objective - res.bound) / res.objective if math.isfinite(res.bound) else math.nan
    label = name + ("" if waits else " (waits off)") + ("" if trim else " (trim off)") \
        + ("" if heads else " (heads off)") + (" (head floor on)" if head_floor else "") \
        + (" (head contents on)" if head_contents else "") \
        + ("" if proof_gap is None else f" (proof gap {proof_gap:g})")
    asked = (f"{r.get('complete_heads', 0):,} / {r.get('complete_heads_refuted', 0):,} "
             f"({r.get('complete_heads_floored', 0):,} by the floor"
             + (f", {r.get('complete_heads_covered', 0):,} by a GPU content; contents "
                f"asked / refuted {r.get('complete_head_contents', [0, 0])[0]:,} / "
                f"{r.get('complete_head_contents', [0, 0])[1]:,}" if head_contents else "")
             + ") "
             f"({r.get('complete_heads_stopped', '-')})")
    print(f"{label}: heads [length, asked, refuted, by the floor, by a GPU content]: "
          f"{r.get('complete_head_levels', [])}", file=sys.stderr, flush=True)
    print(f"| {label} | {res.status.value} | {res.objective:.4f} | {res.bound:.4f} | "
          f"{gap:.2%} | {r['allocations_bound']:.4f} | {part('chunks')} | "
          f"{asked} | {part('complete')} ({r['complete_stopped']}) | "
          f"{cpu:.0f} | {wall:.0f} | {start} / {load()} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count-only", action="store_true")
    parser.add_argument("--max", type=int, default=pipeline_chunks.MAX_ALLOCATIONS)
    parser.add_argument("--only", nargs="+", default=None,
                        help="instances by name ('resnet18 1.5x', 'headline', ...)")
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--family-limit", type=int, default=pipeline_chunks.FAMILY_LIMIT)
    parser.add_argument("--waits", choices=("on", "off"), default="on")
    parser.add_argument("--trim", choices=("on", "off"), default="on")
    parser.add_argument("--heads", choices=("on", "off"), default="on")
    parser.add_argument("--head-floor", choices=("on", "off"), default="off")
    parser.add_argument("--head-contents", choices=("on", "off"), default="off")
    parser.add_argument("--proof-gap", type=float, default=None,
                        help="prove the plan within this share (extra['proof_gap'])")
    parser.add_argument("--count-waits", action="store_true",
                        help="with --count-only: how many the waits rows leave")
    parser.add_argument("--floor-gap", type=int, default=0,
                        help="the next N questions of the complete family, with optima")
    parser.add_argument("--optimum-work", type=float, default=30.0)
    args = parser.parse_args()
    if args.floor_gap:
        print("| instance | allocation | old floor | waits floor | question at the cutoff | "
              "CPU s | allocation's optimum | CPU s |")
        print("|---|---|---|---|---|---|---|---|")
    elif args.count_only:
        print("| instance | units | cutoff | allocations below it | prefixes tried | "
              "cut by loads | cut by the partial floor | left by the waits rows | CPU s | "
              "load (start / end) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| instance | status | period | bound | gap | least bound of an allocation | "
              "k-chunk family / asked / refuted (waits / trimmed of trimmed questions) / "
              "undecided | heads asked / refuted (by the floor) (pass) | complete family / "
              "asked / refuted (waits / trimmed of trimmed questions) / undecided | CPU s | "
              "wall s | load (start / end) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, problem in instances():
        if args.only and name not in args.only:
            continue
        if args.floor_gap:
            floor_gap(name, problem, args.floor_gap, args.optimum_work)
        elif args.count_only:
            count(name, problem, args.max, args.count_waits)
        else:
            run(name, problem, args.time_limit, args.family_limit, args.waits == "on",
                args.trim == "on", args.heads == "on", args.head_floor == "on",
                args.head_contents == "on", args.proof_gap)


if __name__ == "__main__":
    main()
