"""A whole MadPipe solve at L = 56, P = 8: its prunings side by side.

For ResNet-152 (L = 56 layers), P = 8 GPUs, 12 GB/s and the memories of
``bench_pipeline.py``'s phase-1 table, this script runs ``solve(problem, "madpipe")`` (the
whole memory ladder, phase 2 on its deterministic work limits) with every pruning of
``pipeline_madpipe`` on, and times its phase 1 (every Algorithm 8 call of the ladder) and the
whole solve (``time.process_time``). Phase 1 is then run again on the same rungs without the
three prunings added after ``BOUNDS`` (``MEMORY_BOUND``, ``LIMIT_RUNS``, ``PREFIX_BOUND``:
``old``), checking
the same estimates, T-hats and allocations; ``--compare-skip`` also runs the whole solve
with ``SKIP_PHASE2 = False`` (every phase-2 model) and checks the same period, plan and
rungs (slow: each model may take its 30 deterministic seconds).

Usage::

    python benchmarks/bench_madpipe.py --memory 8
    python benchmarks/bench_madpipe.py --markdown benchmarks/results/madpipe_speed.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import print_and_write, uptime  # noqa: E402
from optmem.cli_problems import parse_pipeline_bandwidth  # noqa: E402
from optmem.datasets import resolve_chain  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.result import Result, SolveOptions  # noqa: E402
from optmem.solvers import pipeline_madpipe as mp  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402
from optmem.solvers.pipeline_common import scaled  # noqa: E402

GIB = 2**30
PROFILE, GPUS, BANDWIDTH = "resnet152-b32-224", 8, "12GB/s"  # bench_pipeline.py's phase-1 table


@contextmanager
def switches(**values: bool) -> Iterator[None]:
    """Set module switches of ``pipeline_madpipe`` (``BOUNDS``, ``MEMORY_BOUND``...)."""
    saved = {name: getattr(mp, name) for name in values}
    for name, value in values.items():
        setattr(mp, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mp, name, value)


@contextmanager
def phase1_clock() -> Iterator[list[float]]:
    """Count the CPU time of every Algorithm 8 call meanwhile."""
    spent = [0.0]
    inner: Callable[..., Any] = mp.algorithm8

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - start

    mp.algorithm8 = timed  # type: ignore[assignment]
    try:
        yield spent
    finally:
        mp.algorithm8 = inner  # type: ignore[assignment]


def one(problem: PipelineProblem, iterations: int, **values: bool
        ) -> tuple[Result, float, float]:
    """A whole MadPipe solve: ``(result, phase-1 CPU s, whole CPU s)``."""
    opts = SolveOptions(extra={"madpipe_iterations": iterations})
    with switches(**values), phase1_clock() as spent:
        start = time.process_time()
        result = solve(problem, "madpipe", options=opts)
        whole = time.process_time() - start
    return result, spent[0], whole


def ladder(result: Result) -> list[tuple[Any, ...]]:
    """The phase-1 rungs of a solve: memory factor, estimate, T-hat, allocation."""
    return [(a["memory_factor"], a["estimate"], a["t_hat"], a["allocation"])
            for a in result.report["attempts"] if "memory_factor" in a]


def old_phase1(problem: PipelineProblem, rungs: list[tuple[Any, ...]], iterations: int
               ) -> tuple[bool, int, float]:
    """Phase 1 on the same rungs without ``MEMORY_BOUND``, ``LIMIT_RUNS`` and
    ``PREFIX_BOUND``: whether it gives the same rungs, its DP states and CPU seconds."""
    same, states, start = True, 0, time.process_time()
    with switches(MEMORY_BOUND=False, LIMIT_RUNS=False, PREFIX_BOUND=False):
        for factor, est, that, alloc in rungs:
            sub = problem if factor == 1.0 else scaled(problem, factor)
            e, t, a, count = mp.algorithm8(sub, exact=False, iterations=iterations)
            states += count
            text = None if a is None else " ".join(f"{k}:{i}-{j}" for i, j, k in a)
            same &= (e, t, text) == (est, that, alloc)
    return same, states, time.process_time() - start


def run(args: argparse.Namespace) -> list[str]:
    chain = resolve_chain(args.profile)
    bw = parse_pipeline_bandwidth(args.bandwidth, chain.time_unit)
    rows = ["| M (GiB) | period | source | rungs | phase 1 same | DP states old / new | "
            "phase 1 CPU old / new (s) | ratio | phase-2 models run / skipped | whole CPU (s) "
            "| no-skip: same / whole CPU (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mem in args.memory:
        problem = PipelineProblem(chain, args.gpus, int(mem * GIB), chain_bandwidth=bw)
        new, p1_new, all_new = one(problem, args.iterations)
        same, states_old, p1_old = old_phase1(problem, ladder(new), args.iterations)
        noskip = "-"
        if args.compare_skip:
            ref, _, all_ref = one(problem, args.iterations, SKIP_PHASE2=False)
            agree = (ref.objective == new.objective and ref.plan == new.plan
                     and ladder(ref) == ladder(new))
            noskip = f"{'yes' if agree else '**NO**'} / {all_ref:.1f}"
        rows.append(
            f"| {mem:g} | {new.objective:.2f} | {new.report.get('source', '-')} | "
            f"{len(ladder(new))} | {'yes' if same else '**NO**'} | "
            f"{states_old} / {new.report['dp_states']} | "
            f"{p1_old:.1f} / {p1_new:.1f} | {p1_old / p1_new:.1f}x | "
            f"{new.report['phase2_models']} / {new.report['phase2_skipped']} | "
            f"{all_new:.1f} | {noskip} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", nargs="+", type=float, default=[2, 3, 4, 6, 8, 12, 16],
                        help="memories per GPU in GiB (`--memory 8` for a quick run)")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--compare-skip", action="store_true",
                        help="also run every phase-2 model (SKIP_PHASE2 = False) and compare")
    args = parser.parse_args()
    args.profile, args.gpus, args.bandwidth = PROFILE, GPUS, BANDWIDTH
    args.iterations = mp.K_ITERATIONS
    load, start = uptime(), time.perf_counter()
    rows = run(args)
    chain = resolve_chain(args.profile)
    text = "\n".join([
        "# A whole MadPipe solve at L = 56, P = 8 (`benchmarks/bench_madpipe.py`)", "",
        f"{args.profile} (L = {chain.length}), P = {args.gpus}, {args.bandwidth}, "
        f"K = {args.iterations}, the whole memory ladder, phase 2 on its deterministic work "
        "limits, every pruning on. Phase 1 `old`: the same rungs again without "
        "`MEMORY_BOUND`, `LIMIT_RUNS` and `PREFIX_BOUND` (the DP of `BOUNDS` only); "
        "`phase 1 same`: same "
        "estimates, T-hats and allocations. Phase-2 models run / skipped: CP-SAT models "
        "run, allocations whose models were skipped (`SKIP_PHASE2`). No-skip: the whole "
        "solve with every phase-2 model (`--compare-skip`; same period, plan and rungs). CPU "
        "seconds (`time.process_time`, nice 19; phase 1 = every Algorithm 8 call).", "",
        *rows, "",
        f"Run {datetime.date.today()}, wall time {time.perf_counter() - start:.0f} s. "
        f"Load average at the start: {load}; at the end: {uptime()}.", ""])
    print_and_write(text, args.markdown)


if __name__ == "__main__":
    main()
