"""Passing a model to HiGHS: PuLP's ``buildSolverModel`` against optmem's array pass.

    python benchmarks/bench_highs_pass.py [--repeats 3] [--quick] [--out FILE.md]

Every HiGHS call of optmem goes through PuLP. PuLP hands the model over one ``addCol`` /
``addRow`` call per column and row and scans every row again to list the variables; no
engine time limit bounds that time. Since stop 74 ``optmem.engines.adapters._pass_model``
passes the same model (same columns in the same order, same rows; checked against PuLP's by
``tests/test_interrupt.py``) in three array calls. Both are timed here on the same emitted
models, interleaved, on a fresh ``highspy.Highs`` each (the pass only, no solve), median of
``--repeats``: the checkpoint ILP of ResNet-152 (L = 56) at 30 % and the remat + offload
link relaxation (plain stage) of ResNet-101 (L = 39) and DenseNet-121 (L = 68) at 50 %,
12 GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import print_and_write, uptime

from optmem.datasets import load_dataset
from optmem.models.formulation import Model, to_pulp
from optmem.result import SolveOptions


def checkpoint_model(name: str, share: float) -> Model:
    """The checkpoint ILP (as ``solve checkpoint --method ilp`` builds it)."""
    from optmem.models.checkpoint_ilp import build_formulation
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.solvers.checkpoint import discretize_for
    from optmem.solvers.checkpoint_dp import min_memory_persistent

    chain = load_dataset(name)
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    problem = CheckpointProblem(chain, int(low + share * (high - low)))
    disc = discretize_for(problem, SolveOptions())
    return build_formulation(disc.chain, disc.memory_limit, "full", 1).model


def relaxation_model(name: str) -> Model:
    """The plain stage of the remat + offload link relaxation (50 %, 12 GB/s)."""
    from optmem.models.remat_offload import build_link_relaxation
    from optmem.problems.remat_offload import RematOffloadProblem
    from optmem.solvers.remat_offload import discretized

    chain = load_dataset(name)
    problem = RematOffloadProblem(chain, int(0.5 * chain.store_all_peak()),
                                  chain_bandwidth=12e9)
    disc, beta = discretized(problem, SolveOptions())
    return build_link_relaxation(disc.chain, disc.memory_limit, beta, deadlines=False,
                                 host_values=False)


def timed(model: Model, way: str) -> float:
    """Seconds to pass ``model`` (emitted afresh) to a new HiGHS, ``pulp`` or ``arrays``."""
    import highspy
    import pulp

    from optmem.engines.adapters import _pass_model

    pm = to_pulp(model)
    prob = pm.problem
    prob.fixObjective()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    prob.solverModel = h
    began = time.perf_counter()
    if way == "pulp":
        pulp.HiGHS(msg=False).buildSolverModel(prob)
    else:
        _pass_model(prob, h, highspy, mip=True)
    return time.perf_counter() - began


INSTANCES: tuple[tuple[str, Callable[[], Model]], ...] = (
    ("checkpoint ILP, ResNet-152 (L = 56), 30 %", lambda: checkpoint_model("resnet152-b32-224",
                                                                          0.3)),
    ("link relaxation, ResNet-101 (L = 39)", lambda: relaxation_model("resnet101-b32-224")),
    ("link relaxation, DenseNet-121 (L = 68)", lambda: relaxation_model("densenet121-b32-224")),
)


def table(instances: tuple[tuple[str, Callable[[], Model]], ...], repeats: int) -> str:
    """Rows: model size, PuLP's pass, the array pass, the ratio (medians)."""
    rows = ["| model | rows | nonzeros | PuLP pass s | array pass s | ratio |",
            "|---|---|---|---|---|---|"]
    for label, make in instances:
        model = make()
        times: dict[str, list[float]] = {"pulp": [], "arrays": []}
        for _ in range(repeats):
            for way in ("pulp", "arrays"):  # interleaved
                times[way].append(timed(model, way))
        old, new = statistics.median(times["pulp"]), statistics.median(times["arrays"])
        size: dict[str, Any] = model.size
        row = f"| {label} | {size['constraints']:,} | {size['nonzeros']:,} | {old:.2f} | " \
              f"{new:.2f} | {old / new:.1f}x |"
        rows.append(row)
        print(row, flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the first model, one repeat")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    began = uptime()
    text = table(INSTANCES[:1] if args.quick else INSTANCES, 1 if args.quick else args.repeats)
    print_and_write(f"load {began} before, {uptime()} after\n\n{text}\n", args.out)


if __name__ == "__main__":
    main()
