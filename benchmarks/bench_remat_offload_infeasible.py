"""Infeasible remat + offload limits: the empty link relaxation against the search alone.

    python benchmarks/bench_remat_offload_infeasible.py [--time-limit 60] [--quick] [--out FILE.md]

Since stop 72 ``ilp`` and ``cpsat`` answer ``infeasible`` with no search when the link
relaxation has no point at the class horizon and no candidate plan replays
(``docs/remat_offload.md``, "An empty relaxation is a proof"). Before, the relaxation's
emptiness gave no bound and the search had to decide alone; the baseline here is that
search alone (``extra["relaxation"] = False``), each row run side by side with the default
on the same instance, both under ``--time-limit`` seconds and 2 threads. Instances: bundled
profiles at percentages of their store-all peak below the least memory of any plan but
above the least-forward bound of stop 71 (the check that answers before any model is
built), 12 GB/s. The table gives each run's status and wall time and the ratio
baseline / default (a baseline with no verdict counts its whole time limit, marked ``>=``).
"""

from __future__ import annotations

import argparse
import time

from _common import print_and_write, uptime

from optmem.datasets import load_dataset
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.facade import solve

INSTANCES = (("resnet18-b64-224", "60%"), ("resnet18-b64-224", "50%"),
             ("resnet50-b32-224", "25%"), ("resnet50-b32-224", "29%"))
QUICK = INSTANCES[:1]


def run(problem: RematOffloadProblem, method: str, options: SolveOptions
        ) -> tuple[str, float, bool]:
    """``(status, wall seconds, decided)`` of one solve (decided: ``infeasible`` proven)."""
    began = time.perf_counter()
    res = solve(problem, method, options=options)
    return str(res.status), time.perf_counter() - began, res.status is Status.INFEASIBLE


def table(instances: tuple[tuple[str, str], ...], limit: float) -> str:
    """The side-by-side table (Markdown) of the default and the search alone."""
    rows = ["| profile | memory | method | default: status / s | search alone: status / s "
            "| ratio |", "|---|---|---|---|---|---|"]
    for name, memory in instances:
        problem = RematOffloadProblem(load_dataset(name), memory, bandwidth="12GB/s")
        for method in ("ilp", "cpsat"):
            base = SolveOptions(time_limit_s=limit)
            status, seconds, _ = run(problem, method, base)
            alone, alone_s, decided = run(
                problem, method, base.with_(extra={"relaxation": False}))
            ratio = f"{alone_s / seconds:.1f}x" if decided else f">= {alone_s / seconds:.1f}x"
            rows.append(f"| {name} | {memory} | {method} | {status} / {seconds:.1f} | "
                        f"{alone} / {alone_s:.1f} | {ratio} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds per solve (default 60)")
    ap.add_argument("--quick", action="store_true", help="one instance only")
    ap.add_argument("--out", help="also write the report to this Markdown file")
    args = ap.parse_args()
    start = uptime()
    body = table(QUICK if args.quick else INSTANCES, args.time_limit)
    print_and_write(f"{body}\n\nLoad average at the start {start}, at the end {uptime()}.\n",
                    args.out)


if __name__ == "__main__":
    main()
