"""The chunk scan's questions with and without the least stash counts (``STASH_FLOORS``).

The headline instance (ResNet-50, 21 units, 4 GPUs, 3 GiB, 12 GB/s) at its proven optimum
31.3896: heads drawn as in ``bench_pipeline_head_params.py`` (``--lengths``, ``--sample``,
seed 2), each asked the head pass's question
(:func:`~optmem.solvers.pipeline_chunks.head_question`, one CP-SAT worker, 5 deterministic
seconds) with :data:`~optmem.solvers.pipeline_chunks.STASH_FLOORS` off (the baseline) and on
(:func:`~optmem.solvers.pipeline_chunks.stash_floors`: rows with the waits rows' least
stash counts at the cutoff), in alternating order. ``--whole``: whole allocations of the
complete family (every 97th of the first 400,000 listed), each asked the scan's question
(``_decide``: a plan at most the cutoff, polished when found) both ways. Prints the CPU
seconds of each (the floors' computation included), their ratio, the median per-question
ratio, and how many got the same answer (refuted or not; the others to stderr).

Usage::

    python benchmarks/bench_pipeline_stash_floors.py [--lengths 10 12 14 16] [--sample 30]
        [--whole]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from optmem.datasets import resolve_chain
from optmem.models.pipeline import delay_tail, make_units
from optmem.solvers import pipeline_chunks
from optmem.solvers.pipeline_common import lower_bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline_exact import headline_problem  # noqa: E402
from bench_pipeline_head_params import OPTIMUM, compare, samples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 12, 14, 16])
    parser.add_argument("--sample", type=int, default=30)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    units = make_units(problem)
    cutoff = OPTIMUM * (1 - pipeline_chunks.PROOF_STEP)
    low = lower_bound(problem)

    def ask(gpu: tuple[int, ...], floors: bool) -> tuple[float, str]:
        pipeline_chunks.STASH_FLOORS = floors
        start = time.process_time()
        if args.whole:
            outcome = pipeline_chunks._decide(problem, units, gpu, cutoff, 5.0, 0, None)
            answer = "refuted" if outcome.refuted else \
                "plan" if outcome.found is not None else "open"
        else:
            relaxed, alloc = delay_tail(units, gpu)
            bound = pipeline_chunks.head_question(problem, relaxed, alloc, cutoff, work=5.0,
                                                  seed=0, deadline=None, lower=low)
            answer = "refuted" if bound is not None else "not refuted"
        return time.process_time() - start, answer

    print("| questions | sample | rows off CPU s | rows on CPU s | ratio | "
          "median per-question ratio | same answer |")
    print("|---|---|---|---|---|---|---|")
    for label, picked in samples(problem, args.lengths, args.sample, args.whole):
        compare(label, picked, ask)


if __name__ == "__main__":
    main()
