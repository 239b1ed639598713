"""Remat + offload proofs at 8-12 stages (issue 15 item 1): which instances are proven in 300 s.

For each ``random_chain(L, seed)`` and memory fraction (limits and bandwidth as
``bench_remat_offload_exact.py``: fractions of the way from the persistent checkpoint DP's
least memory to the store-all peak, a link that moves half of the activations the forward
pass produces in its own time), it runs ``cpsat`` with the given options (``--extra``,
default ``strategy=benders``) under one label (``--label``, e.g. ``before`` / ``after``) and
appends one row per solve to ``--out``: status, plan, proven bound, gap, which side the
gap is on where it can tell (the relaxation's stages' bounds: ``plain`` / ``deadline`` /
``host``), the relaxation's time, the process's CPU seconds (engine threads included) and
the wall seconds, and the load average after the solve.

``--compare before,after`` reads the rows of ``--out`` and appends the side-by-side table
of the two labels (the instances both have), with the proven counts. Wall-clock times
depend on the machine's load (2 shared cores): the load average is written with every row.

Usage::

    nice -n 19 python benchmarks/bench_remat_offload_proofs.py --label before \
        --lengths 8,10,12 --seeds 1,2,3 --out benchmarks/results/remat_offload_proofs.md
    python benchmarks/bench_remat_offload_proofs.py --compare before,after \
        --out benchmarks/results/remat_offload_proofs.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_remat_offload_exact import bandwidth, emit, limits
from optmem.datasets import synthetic
from optmem.engines import adapters as engines
from optmem.models.formulation import Expr, Relation, to_cpsat, to_pulp
from optmem.models.remat_offload import build_link_relaxation, build_remat_offload, with_fixed
from optmem.plan import Op, parse_mixed_plan
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers.facade import solve
from optmem.solvers.remat_offload import discretized
from optmem.solvers.remat_offload_exact import cpsat_time_scale

COLUMNS = ("label", "instance", "fraction", "memory", "status", "plan", "bound", "gap",
           "stages: plain / deadline / host", "relax s", "CPU s", "wall s", "load after")


def load() -> str:
    """The 1-minute load average."""
    return f"{os.getloadavg()[0]:.1f}"


def stages(report: dict[str, Any]) -> str:
    """The relaxation stages' bounds (or why a stage was skipped)."""
    info = report.get("relaxation", {})
    out = []
    for key in ("plain_bound", "deadline_bound", "host_bound"):
        value = info.get(key, "-")
        out.append(f"{value:.4g}" if isinstance(value, float) else str(value).split(" (")[0])
    return " / ".join(out)


def row(label: str, name: str, fraction: float, limit: int, res: Result, cpu: float,
        wall: float) -> str:
    """One Markdown row (``COLUMNS``)."""
    gap = f"{100 * res.gap:.2f} %" if res.status.has_plan else "-"
    relax = res.report.get("relaxation", {}).get("relaxation_s", "-")
    return (f"| {label} | {name} | {fraction:g} | {limit} | {res.status} | {res.objective:.4g} | "
            f"{res.bound:.4g} | {gap} | {stages(res.report)} | {relax} | {cpu:.0f} | "
            f"{wall:.0f} | {load()} |")


def run(args: argparse.Namespace) -> None:
    """Solve every instance under ``args.label`` and append the rows."""
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           check=False).stdout.strip()
    opts = SolveOptions(threads=args.threads, time_limit_s=args.time_limit, slots=args.slots,
                        extra=json.loads(args.extra))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    emit(args.out, [f"\n### `{args.label}`: run of {when}, "
                    f"commit {commit}, lengths {args.lengths}, seeds {args.seeds}, time limit "
                    f"{args.time_limit:g} s, {args.threads} threads, options `{args.extra}`, "
                    f"load at start {load()}\n",
                    "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)])
    for n in args.lengths:
        for seed in args.seeds:
            chain = synthetic.random_chain(n, seed=seed)
            beta = bandwidth(chain)
            for fraction, limit in zip(args.fractions, limits(chain, args.fractions), strict=True):
                problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
                cpu0, wall0 = time.process_time(), time.perf_counter()
                res = solve(problem, "cpsat", options=opts)
                name = f"random_chain({n}, seed={seed})"
                emit(args.out, [row(args.label, name, fraction, limit, res,
                                    time.process_time() - cpu0, time.perf_counter() - wall0)])
                if args.plans and res.status.has_plan:
                    with Path(args.plans).open("a") as fh:
                        fh.write(json.dumps({"label": args.label, "n": n, "seed": seed,
                                             "fraction": fraction, "limit": limit,
                                             "status": str(res.status),
                                             "objective": res.objective, "bound": res.bound,
                                             "plan": list(res.plan)}) + "\n")


def parse_rows(path: str) -> dict[tuple[str, str, str], list[str]]:
    """The rows of ``path`` by (label, instance, fraction); a later row replaces an earlier."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(COLUMNS) and re.match(r"random_chain", cells[1]):
            out[(cells[0], cells[1], cells[2])] = cells
    return out


def compare(args: argparse.Namespace) -> None:
    """Append the side-by-side table of the two labels of ``args.compare``."""
    first, second = args.compare.split(",")
    rows = parse_rows(args.out)
    keys = sorted({(k[1], k[2]) for k in rows if k[0] == first} &
                  {(k[1], k[2]) for k in rows if k[0] == second},
                  key=lambda k: (int(re.findall(r"\d+", k[0])[0]), k[0], float(k[1])))
    idx = {c: i for i, c in enumerate(COLUMNS)}
    lines = [f"\n### `{first}` against `{second}` (rows above; plan / bound (gap), CPU s)\n",
             f"| instance | fraction | {first} | {second} |", "|---|---|---|---|"]
    proven = [0, 0]
    for name, fraction in keys:
        cells = []
        for i, label in enumerate((first, second)):
            r = rows[(label, name, fraction)]
            proven[i] += r[idx["status"]] == str(Status.OPTIMAL)
            mark = "**optimal** " if r[idx["status"]] == str(Status.OPTIMAL) else ""
            cells.append(f"{mark}{r[idx['plan']]} / {r[idx['bound']]} ({r[idx['gap']]}), "
                         f"{r[idx['CPU s']]} s")
        lines.append(f"| {name} | {fraction} | {cells[0]} | {cells[1]} |")
    lines.append(f"\nproven: {first} {proven[0]} / {len(keys)}, "
                 f"{second} {proven[1]} / {len(keys)}\n")
    emit(args.out, lines)


def on_sequence(problem: RematOffloadProblem, opts: SolveOptions, fixed: dict[int, float]
                ) -> tuple[str, str]:
    """The relaxation's value and the model's optimum with the compute binaries ``fixed``.

    The link relaxation with every stage's rows (deadline and per-value host rows; HiGHS)
    and the one model (CP-SAT on its exact time grid), both within ``opts``' time limit,
    each as ``value (status)`` (the model's with its bound).
    """
    disc, beta = discretized(problem, opts)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta)
    relax = build_link_relaxation(disc.chain, disc.memory_limit, beta)
    for i, x in fixed.items():
        relax.add(Relation(Expr([(i, 1.0)]), x, x), f"fix_{i}")
    pm = to_pulp(relax)
    rel = engines.solve_pulp(pm.problem, pm.all_variables, "highs",
                             **{**engines.pulp_settings(opts), "time_limit_s": opts.time_limit_s})
    scale, _ = cpsat_time_scale(disc.chain, beta)
    cp = to_cpsat(with_fixed(built, fixed), scale=scale)
    out = engines.solve_cpsat(cp.cp, cp.variables, time_limit_s=opts.time_limit_s,
                              threads=opts.threads)
    value = cp.objective(out.objective) if out.status.has_plan else math.nan
    return (f"{rel.bound:.4g} ({rel.status})",
            f"{value:.4g} ({cp.objective(out.bound):.4g}, {out.status})")


def plan_sequence(problem: RematOffloadProblem, opts: SolveOptions, plan: list[str]
                  ) -> dict[int, float] | None:
    """The checkpoint binaries of ``plan``'s compute ops (``None`` if they do not fit)."""
    disc, beta = discretized(problem, opts)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta)
    full = built.fixing([op for op in parse_mixed_plan(plan) if isinstance(op, Op)])
    if full is None:
        return None
    return {i: x for i, x in full.items() if i < len(built.checkpoint.names)}


def master_sequence(problem: RematOffloadProblem, opts: SolveOptions
                    ) -> tuple[float, dict[int, float] | None]:
    """The Benders loop's first master (relaxation with deadline rows): value, sequence."""
    disc, beta = discretized(problem, opts)
    relax = build_link_relaxation(disc.chain, disc.memory_limit, beta, host_values=False)
    n_ck = len(build_remat_offload(disc.chain, disc.memory_limit, beta).checkpoint.names)
    pm = to_pulp(relax)
    out = engines.solve_pulp(pm.problem, pm.all_variables, "highs",
                             **{**engines.pulp_settings(opts), "time_limit_s": opts.time_limit_s})
    if out.values is None:
        return out.bound, None
    return out.bound, {i: float(round(out.values[i])) for i in range(n_ck)}


def diagnose(args: argparse.Namespace) -> None:
    """Append the fixed-sequence table for the plans of ``args.plans`` that are not proven."""
    opts = SolveOptions(threads=args.threads, time_limit_s=args.time_limit, slots=args.slots)
    lines = [f"\n### Where the gap is: each unproven plan's compute sequence fixed "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.time_limit:g} s "
             f"per engine call, load at start {load()})\n",
             "| label | instance | fraction | plan / bound | plan's sequence: relaxation | "
             "model (bound) | master (deadline rows) | master's sequence: relaxation | "
             "model (bound) | CPU s | load after |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    emit(args.out, lines)
    for line in Path(args.plans).read_text().splitlines():
        rec = json.loads(line)
        if rec["status"] == str(Status.OPTIMAL) or args.label not in ("run", rec["label"]):
            continue
        chain = synthetic.random_chain(rec["n"], seed=rec["seed"])
        problem = RematOffloadProblem(chain, rec["limit"], chain_bandwidth=bandwidth(chain))
        cpu0 = time.process_time()
        fixed = plan_sequence(problem, opts, rec["plan"])
        plan_cells = on_sequence(problem, opts, fixed) if fixed else ("-", "-")
        value, master = master_sequence(problem, opts)
        master_cells = on_sequence(problem, opts, master) if master else ("-", "-")
        emit(args.out, [f"| {rec['label']} | random_chain({rec['n']}, seed={rec['seed']}) | "
                        f"{rec['fraction']:g} | {rec['objective']:.4g} / {rec['bound']:.4g} | "
                        f"{' | '.join(plan_cells)} | {value:.4g} | {' | '.join(master_cells)} | "
                        f"{time.process_time() - cpu0:.0f} | {load()} |"])


def main() -> None:
    """Run or compare (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run", help="the rows' label (--diagnose: only this label's "
                    "plans; all of them by default)")
    ap.add_argument("--lengths", default="8,10,12")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--fractions", default="0.1,0.3")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=500)
    ap.add_argument("--extra", default='{"strategy": "benders"}')
    ap.add_argument("--out", default="")
    ap.add_argument("--plans", default="", help="append each plan (JSON lines) here")
    ap.add_argument("--commit", default="", help="the code's commit (default: git's HEAD)")
    ap.add_argument("--diagnose", action="store_true",
                    help="fix each unproven plan's compute sequence (from --plans) and the "
                         "first master's")
    ap.add_argument("--compare", default="", help="two labels: append their side-by-side table")
    args = ap.parse_args()
    if args.compare:
        compare(args)
        return
    if args.diagnose:
        diagnose(args)
        return
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    run(args)


if __name__ == "__main__":
    main()
