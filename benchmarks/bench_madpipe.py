"""A whole MadPipe solve at L = 56, P = 8: the DP without and with its child bounds.

For ResNet-152 (L = 56 layers), P = 8 GPUs, 12 GB/s and the memories of
``bench_pipeline.py``'s phase-1 table, this script runs ``solve(problem, "madpipe")`` (the
whole memory ladder, phase 2 on its deterministic work limits) twice: with
``pipeline_madpipe.BOUNDS = False`` (the capped DP's state space before the child bounds:
``old``) and ``True`` (``new``). It checks that both give the same period, plan, phase-1
estimates and allocations, and prints side by side the DP states, the CPU time of phase 1
(every Algorithm 8 call of the ladder) and of the whole solve (``time.process_time``), with
the ratios old / new.

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

from benchmarks.bench_pipeline_exact import uptime  # noqa: E402
from optmem.cli_problems import parse_pipeline_bandwidth  # noqa: E402
from optmem.datasets import resolve_chain  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.result import Result, SolveOptions  # noqa: E402
from optmem.solvers import pipeline_madpipe as mp  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402

GIB = 2**30
PROFILE, GPUS, BANDWIDTH = "resnet152-b32-224", 8, "12GB/s"  # bench_pipeline.py's phase-1 table


@contextmanager
def phase1_clock(bounds: bool) -> Iterator[list[float]]:
    """Set ``mp.BOUNDS``; count the CPU time of every Algorithm 8 call meanwhile."""
    spent = [0.0]
    inner: Callable[..., Any] = mp.algorithm8
    saved = mp.BOUNDS

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - start

    mp.algorithm8, mp.BOUNDS = timed, bounds  # type: ignore[assignment]
    try:
        yield spent
    finally:
        mp.algorithm8, mp.BOUNDS = inner, saved  # type: ignore[assignment]


def one(problem: PipelineProblem, bounds: bool, iterations: int) -> tuple[Result, float, float]:
    """A whole MadPipe solve: ``(result, phase-1 CPU s, whole CPU s)``."""
    opts = SolveOptions(extra={"madpipe_iterations": iterations})
    with phase1_clock(bounds) as spent:
        start = time.process_time()
        result = solve(problem, "madpipe", options=opts)
        whole = time.process_time() - start
    return result, spent[0], whole


def ladder(result: Result) -> list[tuple[Any, ...]]:
    """The phase-1 rungs of a solve: memory factor, estimate, T-hat, allocation."""
    return [(a["memory_factor"], a["estimate"], a["t_hat"], a["allocation"])
            for a in result.report["attempts"] if "memory_factor" in a]


def run(args: argparse.Namespace) -> list[str]:
    chain = resolve_chain(args.profile)
    bw = parse_pipeline_bandwidth(args.bandwidth, chain.time_unit)
    rows = ["| M (GiB) | period | source | rungs | same result | DP states old / new | "
            "phase 1 CPU old / new (s) | ratio | whole CPU old / new (s) | ratio |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for mem in args.memory:
        problem = PipelineProblem(chain, args.gpus, int(mem * GIB), chain_bandwidth=bw)
        old, p1_old, all_old = one(problem, False, args.iterations)
        new, p1_new, all_new = one(problem, True, args.iterations)
        same = (old.objective == new.objective and old.plan == new.plan
                and ladder(old) == ladder(new))
        rows.append(
            f"| {mem:g} | {new.objective:.2f} | {new.report.get('source', '-')} | "
            f"{len(ladder(new))} | {'yes' if same else '**NO**'} | "
            f"{old.report['dp_states']} / {new.report['dp_states']} | "
            f"{p1_old:.1f} / {p1_new:.1f} | {p1_old / p1_new:.1f}x | "
            f"{all_old:.1f} / {all_new:.1f} | {all_old / all_new:.1f}x |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", nargs="+", type=float, default=[2, 3, 4, 6, 8, 12, 16],
                        help="memories per GPU in GiB (`--memory 8` for a quick run)")
    parser.add_argument("--markdown", help="write the table here")
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
        "limits. `old`: the capped DP without its child bounds (`BOUNDS = False`), `new`: "
        "with them. Same result: same period, plan, phase-1 estimates, T-hats and "
        "allocations at every rung. CPU seconds (`time.process_time`, nice 19; phase 1 = "
        "every Algorithm 8 call of the ladder; the rest of the whole solve is phase 2 and "
        "the contiguous candidate).", "",
        *rows, "",
        f"Run {datetime.date.today()}, wall time {time.perf_counter() - start:.0f} s. "
        f"Load average at the start: {load}; at the end: {uptime()}.", ""])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
