"""CP-SAT's linearization level on fixed-allocation pipeline models, side by side.

Every model :func:`optmem.solvers.pipeline_common.run_model` builds with the allocation
fixed (MadPipe's phase 2, the chunk scan, the decomposition's subproblems, the co-location
climb) is solved with ``optmem.solvers.pipeline_common.FIXED_PARAMETERS`` (now
``linearization_level`` 2); ``{}`` is CP-SAT's default (level 1), the code before it. Both
run in one process, interleaved, one CP-SAT worker, deterministic work limits (so the
verdicts are the same on any machine; the CPU seconds are not).

Part 1 (random allocations): ``--chains`` random chains of 2-5 layers on 2-3 GPUs (sizes,
times, memory and link speed drawn as the property tests draw them; ``random.Random(seed)``),
every allocation of each, optimised without a cutoff (5 deterministic s) with the slim and
the general build: how many are proven (optimal or infeasible), the optima must agree, CPU.

Part 2 (chunk-scan questions on the headline): every ``--stride``-th allocation of the
two-chunk family of ResNet-50, 4 GPUs, 3 GiB, 12 GB/s, "any plan at or below 31.3865?"
(the scan's ``_decide``, 5 deterministic s): verdicts and CPU.

Part 3 (MadPipe): ``solve(problem, "madpipe")`` on the instances of
``bench_pipeline_fixed.py`` (phase 2 schedules fixed allocations): period and CPU.

Part 4 (``--parts sweep``, not in the default parts): MadPipe over ``bench_pipeline.py``'s 63
settings (ResNet-50, ResNet-101, Inception-v3; 2, 4, 8 GPUs; 2-16 GiB; 12 GB/s; its options):
period and CPU seconds at both levels.

Run: ``python benchmarks/bench_pipeline_linearization.py [--chains 60] [--stride 50] [--out F]``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optmem.chain import Chain
from optmem.models.pipeline import make_units
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.solvers import pipeline_chunks, pipeline_common
from optmem.solvers.facade import solve
from optmem.solvers.pipeline_common import run_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _common import print_and_write, uptime  # noqa: E402
from bench_pipeline_fixed import (  # noqa: E402
    CUTOFF,
    headline,
    madpipe_profiles,
    madpipe_rows,
    verdict,
)
from pipeline_helpers import set_partitions  # noqa: E402

LEVELS: dict[str, dict[str, Any]] = {"default (level 1)": {},
                                     "level 2": {"linearization_level": 2}}
WORK = 5.0


def with_parameters(params: dict[str, Any], fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` with ``FIXED_PARAMETERS = params``; its result and CPU seconds."""
    saved = pipeline_common.FIXED_PARAMETERS
    pipeline_common.FIXED_PARAMETERS = params
    cpu = time.process_time()
    try:
        return fn(), time.process_time() - cpu
    finally:
        pipeline_common.FIXED_PARAMETERS = saved


def random_problem(rng: random.Random) -> PipelineProblem:
    """A chain of 2-5 layers on 2-3 GPUs (the hunt's and the property tests' draws)."""
    n = rng.randint(2, 5)
    f = [rng.randint(1, 4) for _ in range(n)]
    b = [rng.randint(1, 5) for _ in range(n)]
    a = [rng.randint(0, 3) for _ in range(n + 1)]
    w = [rng.randint(0, 3) for _ in range(n)]
    gpus = rng.randint(2, 3)
    chain = Chain.from_lists(f, b, a[1:], a[1:], input_size=a[0], weight_size=w)
    lay = PipelineProblem(chain, gpus, 0).layers
    heavy = 3 * sum(lay.w) + 2 * sum(lay.x) + 4 * sum(lay.a)
    memory = rng.randint(max(lay.x) + 3 * max(lay.w), max(heavy, 1) + 1)
    beta = rng.choice([math.inf, 1.0, 2.0, 0.5])
    strict = rng.random() < 0.5
    return PipelineProblem(chain, gpus, memory, chain_bandwidth=beta,
                           memory_model="strict" if strict else "stash")


def part_random(chains: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    opts = SolveOptions(threads=1, seed=0, warm_start=False, deterministic_time=WORK)
    keys = [(slim, name) for slim in (True, False) for name in LEVELS]
    proven = dict.fromkeys(keys, 0)
    cpu = dict.fromkeys(keys, 0.0)
    count, disagree = 0, 0
    load = uptime()
    for _ in range(chains):
        problem = random_problem(rng)
        for gpu in set_partitions(make_units(problem).n, problem.n_gpus):
            count += 1
            optima = set()
            for slim, name in keys:
                run, seconds = with_parameters(
                    LEVELS[name],
                    lambda g=gpu, s=slim, p=problem: run_model(p, "cpsat", opts, gpu=g, slim=s))
                cpu[(slim, name)] += seconds
                if run.status in (Status.OPTIMAL, Status.INFEASIBLE):
                    proven[(slim, name)] += 1
                    optima.add(None if run.plan is None else round(run.plan.period, 5))
            disagree += len(optima) > 1
    rows = [f"{chains} chains (seed {seed}), {count} allocations, {WORK:g} deterministic s "
            f"each; load {load} / {uptime()}.", "",
            "| build | linearization | proven | not proven | CPU s |", "|---|---|---|---|---|"]
    for slim, name in keys:
        rows.append(f"| {'slim' if slim else 'general'} | {name} | {proven[(slim, name)]} | "
                    f"{count - proven[(slim, name)]} | {cpu[(slim, name)]:.1f} |")
    rows += ["", f"Proven optima that differ between the four: {disagree}."]
    return rows


def part_chunks(stride: int) -> list[str]:
    problem = headline()
    units = make_units(problem)
    family, _ = pipeline_chunks.ranked(problem, units, 2, 31.39)
    sample = [gpu for _, gpu in family[::stride]]
    times: dict[str, list[float]] = {name: [] for name in LEVELS}
    undecided = dict.fromkeys(LEVELS, 0)
    disagree = 0
    load = uptime()
    for gpu in sample:
        answers = {}
        for name, params in LEVELS.items():
            answers[name], seconds = with_parameters(
                params, lambda g=gpu: verdict(problem, units, g))
            times[name].append(seconds)
            undecided[name] += answers[name] == "undecided"
        decided = {a for a in answers.values() if a != "undecided"}
        disagree += len(decided) > 1
    rows = [f"{len(sample)} allocations (every {stride}th of {len(family)}), cutoff "
            f"{CUTOFF:.4f}; load {load} / {uptime()}.", "",
            "| linearization | undecided | median CPU s per question | total CPU s |",
            "|---|---|---|---|"]
    for name in LEVELS:
        rows.append(f"| {name} | {undecided[name]} | {statistics.median(times[name]):.3f} | "
                    f"{sum(times[name]):.1f} |")
    base, new = (sum(times[name]) for name in LEVELS)
    rows += ["", f"**Ratio default / level 2: {base / new:.2f}x** (total CPU); decided "
             f"verdicts that differ: {disagree}."]
    return rows


def part_madpipe(profiles: list[tuple[str, PipelineProblem]]) -> list[str]:
    return madpipe_rows(profiles, "linearization", {
        name: lambda fn, p=params: with_parameters(p, fn) for name, params in LEVELS.items()})


def part_sweep() -> list[str]:
    """MadPipe over ``bench_pipeline.py``'s 63 settings (its options), both levels."""
    from bench_pipeline_exact import parse_pipeline_bandwidth

    from optmem.datasets import resolve_chain

    rows = ["| profile | GPUs | GiB | default (level 1) | CPU s | level 2 | CPU s |",
            "|---|---|---|---|---|---|---|"]
    opts = SolveOptions(extra={"madpipe_iterations": 10, "warm_madpipe": False})
    totals = dict.fromkeys(LEVELS, 0.0)
    better = worse = 0
    for name in ("resnet50-b32-224", "resnet101-b8-1000", "inception3-b32-299"):
        chain = resolve_chain(name)
        bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
        for gpus in (2, 4, 8):
            for gib in (2, 3, 4, 6, 8, 12, 16):
                problem = PipelineProblem(chain, gpus, int(gib * 2**30), chain_bandwidth=bw)
                cells = []
                periods = []
                for level, params in LEVELS.items():
                    res, seconds = with_parameters(
                        params, lambda p=problem: solve(p, "madpipe", options=opts))
                    period = res.objective if res.status.has_plan else math.inf
                    periods.append(period)
                    totals[level] += seconds
                    cells += [f"{period:.2f}", f"{seconds:.1f}"]
                better += periods[1] < periods[0] * (1 - 1e-9)
                worse += periods[1] > periods[0] * (1 + 1e-9)
                rows.append(f"| {name} | {gpus} | {gib:g} | " + " | ".join(cells) + " |")
                print(rows[-1], flush=True)
    base, new = totals.values()
    rows += ["", f"Level 2 better in {better} settings, worse in {worse}; CPU s {base:.0f} "
             f"(level 1) against {new:.0f} (level 2)."]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stride", type=int, default=50)
    parser.add_argument("--parts", default="random,chunks,madpipe")
    parser.add_argument("--out")
    args = parser.parse_args()
    parts = args.parts.split(",")
    text = ["# Fixed-allocation models: CP-SAT's linearization level "
            "(`bench_pipeline_linearization.py`)", "",
            f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, Python "
            f"{sys.version.split()[0]}, one CP-SAT worker.", ""]
    if "random" in parts:
        text += ["## Part 1: every allocation of random small chains", "",
                 *part_random(args.chains, args.seed), ""]
        print("\n".join(text), flush=True)
    if "chunks" in parts:
        text += ["## Part 2: chunk-scan questions on the headline", "",
                 *part_chunks(args.stride), ""]
        print("\n".join(text[-8:]), flush=True)
    if "madpipe" in parts:
        text += ["## Part 3: MadPipe (phase 2 schedules fixed allocations)", "",
                 *part_madpipe(madpipe_profiles()), ""]
    if "sweep" in parts:
        text += ["## Part 4: MadPipe over `bench_pipeline.py`'s 63 settings", "",
                 *part_sweep(), ""]
    print_and_write("\n".join(text) + "\n", args.out)


if __name__ == "__main__":
    main()
