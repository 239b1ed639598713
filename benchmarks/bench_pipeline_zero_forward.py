"""``strict`` chains with zero-forward layers: the exact models against brute force (stop 80).

The 80 seeded chains of stop 79 (zero forwards): ``strict_zero_instance(seed, True)`` for
the 39 seeds of 0-79 with a forward of no time, ``zero_time_instance(seed)`` seeds 0-39
made ``strict`` at 1, 1.5, 2 or 3 times their least ``strict`` memory (``seed % 4``), and
stop 75's hunt chain under ``strict``. Each is solved by ``ilp`` and ``cpsat`` (one thread,
no warm start, ``stash_relaxation`` on, ``work_budget`` 10 s), every plan replayed, and
compared with brute force over stage partitions (``--oracle``): for every partition of the
layers into stages and every allocation of the stages to GPUs, the model of those stages
as units (one unit per stage, no joins: each row is its stage's own check) with the
allocation fixed, CP-SAT, kept where the simulator replays its plan.

``--wide``: seeds 0-39 of ``zero_forward_instance`` (3-6 layers, 2-3 GPUs) instead, with
``cpsat`` on the units before stop 80 (``STRICT_LAYERS = False``) beside. Run it on two
checkouts to compare (``PYTHONPATH=<checkout>``; ``--wide`` on this one only)::

    python benchmarks/bench_pipeline_zero_forward.py [--oracle] [--wide] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path += [str(ROOT), str(ROOT / "tests")]  # after PYTHONPATH: compare checkouts

from optmem import PipelineProblem, SolveOptions, solve  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.errors import PlanError  # noqa: E402
from optmem.models import pipeline as model  # noqa: E402
from optmem.simulate.verify import verify_plan  # noqa: E402
from tests.pipeline_helpers import stage_brute_force  # noqa: E402
from tests.test_pipeline_zero_forward import zero_forward_instance  # noqa: E402
from tests.test_pipeline_zero_ties import strict_zero_instance, zero_time_instance  # noqa: E402

ONE = SolveOptions(threads=1, warm_start=False, work_budget=10.0)
EXTRA = {"warm_madpipe": False, "stash_relaxation": True}
HUNT = Chain.from_lists([1.0, 0.0, 2.0], [4.0, 7.0, 1.0], [6, 5, 5], [11, 6, 7],
                        input_size=2, fwd_overhead=[3, 2, 1], bwd_overhead=[1, 2, 1],
                        weight_size=[5, 4, 4])


def chains() -> list[tuple[str, PipelineProblem]]:
    """The 80 chains (name, problem)."""
    out = []
    for seed in range(80):
        problem = strict_zero_instance(seed, True)
        if 0.0 in problem.chain.fwd_time:
            out.append((f"strict_zero_instance({seed}, True)", problem))
    for seed in range(40):
        base = zero_time_instance(seed)
        least = replace(base, memory_model="strict", memory_per_gpu=10**6).memory_lower_bound()
        memory = int(least * (1.0, 1.5, 2.0, 3.0)[seed % 4])
        out.append((f"zero_time_instance({seed}) strict",
                    replace(base, memory_model="strict", memory_per_gpu=memory)))
    out.append(("stop 75 hunt", PipelineProblem(HUNT, 2, 144, chain_bandwidth=3.0,
                                                memory_model="strict")))
    return out


def wide() -> list[tuple[str, PipelineProblem]]:
    """Seeds 0-39 of ``zero_forward_instance`` (3-6 layers, 2-3 GPUs)."""
    return [(f"zero_forward_instance({seed})", zero_forward_instance(seed))
            for seed in range(40)]


def merged(problem: PipelineProblem) -> dict:
    """``cpsat`` on the units before stop 80 (``STRICT_LAYERS = False``), for comparison."""
    model.STRICT_LAYERS = False
    try:
        res = solve(problem, "cpsat", options=ONE.with_(extra=EXTRA))
    finally:
        model.STRICT_LAYERS = True
    return {"status": res.status.value, "objective": res.objective}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--oracle", action="store_true", help="also run brute force")
    parser.add_argument("--wide", action="store_true",
                        help="the 3-6-layer chains of zero_forward_instance instead, with "
                        "the merged class's cpsat answer (this checkout only)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for name, problem in wide() if args.wide else chains():
        row: dict = {"chain": name, "merged": len(model.model_bounds(problem))
                     < problem.layers.n}
        for method in ("ilp", "cpsat"):
            t0 = time.process_time()
            res = solve(problem, method, options=ONE.with_(extra=EXTRA))
            cpu = time.process_time() - t0
            replay = None
            if res.status.has_plan:
                try:
                    replay = verify_plan(problem, res)["objective"]
                except PlanError as err:
                    replay = f"refused: {err}"
            row[method] = {"status": res.status.value, "objective": res.objective,
                           "bound": res.bound, "cpu_s": round(cpu, 3), "replay": replay}
        if args.wide:
            row["merged_cpsat"] = merged(problem)
        if args.oracle:
            row["oracle"] = stage_brute_force(problem, limit=5.0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
