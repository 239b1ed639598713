"""Fixed-allocation pipeline models: the slim build against the general one, side by side.

With the allocation fixed, :func:`optmem.models.pipeline.build_pipeline_model` writes the
allocation's indicators as constants and leaves out the rows of pairs that never share a GPU
or link (``optmem.models.pipeline.SLIM_FIXED``; ``False`` builds the general model with
fixing rows, the code before it). Every MadPipe phase 2, every allocation of the chunk scan
and every Benders subproblem builds such a model.

Part 1 (allocations): the headline instance (ResNet-50, 21 units, 4 GPUs, 3 GiB, 12 GB/s);
every ``--stride``-th allocation of the two-chunk family with a floor below 31.39 ms (the
chunk scan's ranked list), each asked "any plan at or below 31.3865?" by CP-SAT (1 worker,
5 deterministic s) with both builds, interleaved (slim, general, slim, ...) in one process,
CPU seconds of build + engine per question. The verdicts must agree.

Part 2 (MadPipe): ``solve(problem, "madpipe")`` on the headline, UNet (2 GPUs, 8 GiB) and
ResNet-152 (8 GPUs, 6 and 8 GiB: the settings whose phase 2 runs several models,
``docs/pipeline.md``), 12 GB/s, with both builds (1 thread, seed 0, phase 2 limited by
deterministic work): period and CPU seconds.

Run: ``python benchmarks/bench_pipeline_fixed.py [--stride 50] [--repeats 3] [--out F]``
(``--quick``: stride 200, one repeat, MadPipe on the headline only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from optmem.datasets import resolve_chain
from optmem.models import pipeline as model
from optmem.models.pipeline import make_units
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions
from optmem.solvers import pipeline_chunks
from optmem.solvers.facade import solve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_and_write, uptime  # noqa: E402
from bench_pipeline_exact import headline_problem, parse_pipeline_bandwidth  # noqa: E402

CUTOFF = 31.3896 * (1 - 1e-4)


def headline() -> PipelineProblem:
    """ResNet-50 (batch 32, 224 px), 4 GPUs of 3 GiB, 12 GB/s links (part 3's instance)."""
    return headline_problem(resolve_chain("resnet50-b32-224"))


def linked(profile: str, gpus: int, gib: float) -> PipelineProblem:
    """``profile`` on ``gpus`` GPUs of ``gib`` GiB each, 12 GB/s links."""
    chain = resolve_chain(profile)
    return PipelineProblem(chain, gpus, int(gib * 2**30),
                           chain_bandwidth=parse_pipeline_bandwidth("12GB/s", chain.time_unit))


def madpipe_profiles() -> list[tuple[str, PipelineProblem]]:
    """Part 2's instances: the headline, UNet and ResNet-152 (where phase 2 runs several
    models), each with its label."""
    return [("ResNet-50, 4 GPUs, 3 GiB", headline()),
            ("UNet, 2 GPUs, 8 GiB", linked("unet-b4-512", 2, 8)),
            ("ResNet-152, 8 GPUs, 6 GiB", linked("resnet152-b32-224", 8, 6)),
            ("ResNet-152, 8 GPUs, 8 GiB", linked("resnet152-b32-224", 8, 8))]


def with_build(slim: bool, fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` with ``SLIM_FIXED = slim``; its result and CPU seconds."""
    saved = model.SLIM_FIXED
    model.SLIM_FIXED = slim
    cpu = time.process_time()
    try:
        return fn(), time.process_time() - cpu
    finally:
        model.SLIM_FIXED = saved


def verdict(problem: PipelineProblem, units: model.Units, gpu: tuple[int, ...]) -> str:
    """One chunk-scan question: ``refuted``, ``plan P``, ``undecided`` or ``failed``."""
    out = pipeline_chunks._decide(problem, units, gpu, CUTOFF, pipeline_chunks.CHUNK_WORK,
                                  0, None)
    if out.found is not None:
        return f"plan {out.found[0]:.4f}"
    return "refuted" if out.refuted else "failed" if out.failed else "undecided"


def part_allocations(stride: int, repeats: int) -> list[str]:
    problem = headline()
    units = make_units(problem)
    family, _ = pipeline_chunks.ranked(problem, units, 2, 31.39)
    sample = [gpu for _, gpu in family[::stride]]
    sizes = {}
    for slim in (True, False):
        form, _ = with_build(slim, lambda: model.build_pipeline_model(
            units, 4, problem.memory_per_gpu, gpu=sample[0], upper_bound=CUTOFF))
        sizes[slim] = form.model.size  # type: ignore[attr-defined]
    times: dict[bool, list[float]] = {True: [], False: []}
    disagree = 0
    load = uptime()
    for _ in range(repeats):
        for gpu in sample:
            answers = {}
            for slim in (True, False):
                answers[slim], cpu = with_build(slim, lambda g=gpu: verdict(problem, units, g))
                times[slim].append(cpu)
            disagree += answers[True] != answers[False]
    total = {slim: sum(v) for slim, v in times.items()}
    rows = [f"{len(sample)} allocations (every {stride}th of {len(family)}), {repeats} "
            f"repeat(s), CUTOFF {CUTOFF:.4f}; load {load} / {uptime()}.", "",
            "| build | variables | rows | intervals | median CPU s per question | total CPU s |",
            "|---|---|---|---|---|---|"]
    for slim, name in ((False, "general (fixing rows)"), (True, "slim")):
        s = sizes[slim]
        rows.append(f"| {name} | {s['variables']} | {s['constraints']} | {s['intervals']} | "
                    f"{statistics.median(times[slim]):.3f} | {total[slim]:.1f} |")
    rows += ["", f"**Ratio general / slim: {total[False] / total[True]:.2f}x** (total CPU); "
             f"median {statistics.median(times[False]) / statistics.median(times[True]):.2f}x;"
             f" verdicts that differ: {disagree}."]
    return rows


Variant = Callable[[Callable[[], object]], tuple[object, float]]
"""Runs a thunk under one setting (a build, CP-SAT parameters): its result and CPU s."""


def madpipe_rows(profiles: list[tuple[str, PipelineProblem]], column: str,
                 variants: dict[str, Variant]) -> list[str]:
    """``solve(problem, "madpipe")`` under each variant: period, CPU s, phase-2 models."""
    rows = [f"| instance | {column} | period | CPU s | phase-2 models |", "|---|---|---|---|---|"]
    opts = SolveOptions(threads=1, seed=0)
    for name, problem in profiles:
        for label, variant in variants.items():
            res, cpu = variant(lambda p=problem: solve(p, "madpipe", options=opts))
            rows.append(f"| {name} | {label} | "
                        f"{res.objective:.4f} | {cpu:.1f} | "  # type: ignore[attr-defined]
                        f"{res.report.get('phase2_models', '-')} |")  # type: ignore[attr-defined]
            print(rows[-1], flush=True)
    return rows


def part_madpipe(profiles: list[tuple[str, PipelineProblem]]) -> list[str]:
    return madpipe_rows(profiles, "build", {
        "general": lambda fn: with_build(False, fn), "slim": lambda fn: with_build(True, fn)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    profiles = madpipe_profiles()
    if args.quick:
        args.stride, args.repeats, profiles = 200, 1, profiles[:1]
    text = ["# Fixed-allocation models: slim against general (`bench_pipeline_fixed.py`)", "",
            f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Python "
            f"{sys.version.split()[0]}, one CP-SAT worker, `nice` as started.", "",
            "## Part 1: chunk-scan questions on the headline", "",
            *part_allocations(args.stride, args.repeats), "",
            "## Part 2: MadPipe (phase 2 schedules fixed allocations)", "",
            *part_madpipe(profiles), ""]
    print_and_write("\n".join(text) + "\n", args.out)


if __name__ == "__main__":
    main()
