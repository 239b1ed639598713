"""The remat + offload large-neighbourhood search (``extra["lns"]``) on ResNet-50 (issue 15.1).

Two modes:

* ``stage`` (default): the search alone, from a given start plan (the chapter 4 DP's plan on
  ``--grid`` x ``--backlog-grid``, 118.82 at 10 % with 200 x 150), on
  ``bench_exact.py``'s ``resnet50-b32-224`` instance at ``--memory`` (10 / 30 / 60 % of the
  way from the smallest feasible memory to store-all), 12 GB/s, 500 slots: each window's
  status, replayed makespan, deterministic and CPU seconds;
* ``solve``: whole ``cpsat`` solves (``strategy=benders`` and ``--extra``) with and without
  the search, printing plan, bound, gap, the search's report, wall and CPU seconds;
* ``blocks``: windows of stages x phases (``--blocks '[[s_lo, s_hi, p_lo, p_hi], ...]'``,
  ``null`` phases: all) from ``--start`` (default: the best known 10 % plan, 118.57,
  ``benchmarks/results/remat_offload_resnet50_10pct_118.57.json``), each solved by
  :func:`~optmem.solvers.remat_offload_lns.window_solve` and replayed;
* ``probe``: the whole model with every time at most ``--cap`` (and the sum of its sequence
  rows, ``makespan >= sum of durations``, as one more row) solved by CP-SAT within
  ``--work`` deterministic seconds: ``infeasible`` proves every plan of the class slower
  than the cap (on the exact time grid), a solution is a plan within it (replayed).

Every figure is printed with the load average (1 min). One thread, run under ``nice -n 19``.

Usage::

    python benchmarks/bench_remat_offload_lns.py stage --memory 10% [--width 4 --step 2
        --work 20 --windows 12 --no-forward --start plan.json --save best.json]
    python benchmarks/bench_remat_offload_lns.py solve --memory 10% --time-limit 300
        --extra '{"lns": true, "relaxation_compact": true}'
    python benchmarks/bench_remat_offload_lns.py blocks --work 20
        --blocks '[[1, 4, null, null], [1, 9, 1, 12]]'
    python benchmarks/bench_remat_offload_lns.py probe --cap 117.40 --work 300 [--light]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks.bench_remat_offload_exact import bandwidth, limits
from optmem import RematOffloadProblem, SolveOptions, solve
from optmem.datasets import load_dataset, synthetic
from optmem.engines import adapters as engines
from optmem.errors import PlanError
from optmem.models.checkpoint_ilp import Slot
from optmem.models.formulation import to_cpsat
from optmem.models.remat_offload import (
    RematOffloadModel,
    build_remat_offload,
    summed_sequence,
    with_fixed,
)
from optmem.plan import AnyOp, parse_mixed_plan
from optmem.simulate.offload import simulate_offload
from optmem.solvers.dataset_summary import dataset_summary
from optmem.solvers.remat_offload import discretized, pofo_plan
from optmem.solvers.remat_offload_exact import cpsat_time_scale
from optmem.solvers.remat_offload_lns import (
    WINDOW_PARAMETERS,
    clamped,
    complete_plan,
    improve,
    lns_settings,
    window_solve,
)
from optmem.solvers.time_budget import Deadline

CHAIN = "resnet50-b32-224"
BANDWIDTH = "12GB/s"
BEST_10 = os.path.join(os.path.dirname(__file__), "results",
                       "remat_offload_resnet50_10pct_118.57.json")


def load() -> str:
    """The 1-minute load average."""
    return f"{os.getloadavg()[0]:.2f}"


def problem(name: str, memory: str) -> RematOffloadProblem:
    """``bench_exact.py``'s instance (``memory`` a percentage), or ``random:L:seed``."""
    alpha = float(memory.rstrip("%")) / 100
    if name.startswith("random:"):  # bench_remat_offload_proofs.py's instances
        _, n, seed = name.split(":")
        chain = synthetic.random_chain(int(n), seed=int(seed))
        limit = limits(chain, [alpha])[0]
        return RematOffloadProblem(chain, limit, chain_bandwidth=bandwidth(chain))
    chain, summary = load_dataset(name), dataset_summary(name)
    low, high = summary["min_feasible"], summary["store_all"]
    return RematOffloadProblem(chain, int(low + alpha * (high - low)), BANDWIDTH)


def stage(args: argparse.Namespace) -> None:
    """The search alone from the DP plan of ``--grid`` x ``--backlog-grid``."""
    prob = problem(args.chain, args.memory)
    extra = {"lns": True, "lns_work": args.work, "lns_windows": args.windows,
             "lns_width": args.width, "lns_step": args.step, "lns_forward": args.forward}
    options = SolveOptions(threads=1, extra={"grid": args.grid, "backlog_grid": args.backlog_grid})
    disc, beta = discretized(prob, options)
    t, c = time.perf_counter(), time.process_time()
    if args.start:
        with open(args.start) as f:
            plan = tuple(parse_mixed_plan(json.load(f)["plan"]))
    else:
        found = pofo_plan(prob, options, "extended")[0]
        assert found is not None
        plan = tuple(found)
    z = simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan
    print(f"start {z:.6f} ({time.process_time() - c:.1f} CPU s, load {load()})", flush=True)
    scale, exact = cpsat_time_scale(disc.chain, beta)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta,
                                grid=None if exact else scale)
    settings = lns_settings(SolveOptions(extra=extra))
    c, t = time.process_time(), time.perf_counter()
    out = improve(built, disc.chain, disc.memory_limit, beta, scale, (z, plan), settings,
                  options)
    for w in out.report["windows"]:
        print(json.dumps(w), f"load {load()}", flush=True)
    print(f"best {out.makespan:.6f} from {z:.6f}; completion {out.report['completion']}; "
          f"{out.report.get('note')}; {time.process_time() - c:.1f} CPU s, "
          f"{time.perf_counter() - t:.1f} s, load {load()}", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"makespan": out.makespan, "plan": [str(op) for op in out.plan]}, f)
    print("plan:", ", ".join(str(op) for op in out.plan))


def whole(args: argparse.Namespace) -> None:
    """One ``cpsat`` solve, ``strategy=benders`` plus ``--extra``."""
    prob = problem(args.chain, args.memory)
    extra = {"strategy": "benders", **json.loads(args.extra)}
    c, t = time.process_time(), time.perf_counter()
    res = solve(prob, "cpsat", options=SolveOptions(threads=1, time_limit_s=args.time_limit,
                                                     extra=extra))
    gap = (res.objective - res.bound) / res.bound if res.bound else float("nan")
    rep = res.report
    lns = rep.get("lns")
    short = None if lns is None else {k: v for k, v in lns.items() if k != "windows"}
    print(json.dumps({"chain": args.chain, "memory": args.memory, "extra": extra,
                      "status": str(res.status), "objective": res.objective,
                      "bound": res.bound, "gap_percent": round(100 * gap, 3),
                      "lns": short,
                      "lns_windows": None if lns is None else [
                          (w["phases"], w.get("makespan"), w["status"], w["seconds"])
                          for w in lns["windows"]],
                      "dp_ladder": rep.get("dp_ladder"),
                      "relaxation": {k: v for k, v in rep.get("relaxation", {}).items()
                                     if k.endswith("bound") or k in ("relaxation_s", "status")},
                      "wall_s": round(time.perf_counter() - t, 1),
                      "cpu_s": round(time.process_time() - c, 1), "load": load()},
                     default=str), flush=True)


def _model(args: argparse.Namespace) -> tuple[RematOffloadProblem, RematOffloadModel, int]:
    """The instance's problem, its exact model and CP-SAT's time scale."""
    prob = problem(args.chain, args.memory)
    disc, beta = discretized(prob, SolveOptions(threads=1))
    scale, exact = cpsat_time_scale(disc.chain, beta)
    return prob, build_remat_offload(disc.chain, disc.memory_limit, beta,
                                     grid=None if exact else scale), scale


def _replay(prob: RematOffloadProblem, plan: tuple[AnyOp, ...]) -> float | str:
    """The simulator's makespan of ``plan``, or why it does not replay."""
    disc, beta = discretized(prob, SolveOptions(threads=1))
    try:
        return simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan
    except PlanError as e:
        return f"does not replay: {e}"


def _block(s_lo: int, s_hi: int, p_lo: int | None, p_hi: int | None
           ) -> Callable[[Slot], bool]:
    """The slots of stages ``s_lo..s_hi`` in phases ``p_lo..p_hi`` (``None``: every phase)."""
    return lambda slot: s_lo <= slot.stage <= s_hi and (
        p_lo is None or p_hi is None or p_lo <= slot.phase <= p_hi)


def blocks(args: argparse.Namespace) -> None:
    """Stage x phase windows from ``--start``; an accepted plan becomes the next start."""
    prob, built, scale = _model(args)
    with open(args.start or BEST_10) as f:
        plan = tuple(parse_mixed_plan(json.load(f)["plan"]))
    z = _replay(prob, plan)
    fixed = built.fixing(plan)
    assert isinstance(z, float) and fixed is not None, z
    options = SolveOptions(threads=1)
    report: dict[str, Any] = {}
    settings = lns_settings(SolveOptions(extra={"lns": True, "lns_work": args.work}))
    hint = complete_plan(built, fixed, scale, settings, options, Deadline(None), report)
    print(f"start {z:.6f}, completion {report['completion']}, load {load()}", flush=True)
    assert hint is not None
    for s_lo, s_hi, p_lo, p_hi in json.loads(args.blocks):
        free = _block(s_lo, s_hi, p_lo, p_hi)
        t = time.perf_counter()
        entry, values = window_solve(built, hint, free, scale, args.work, options)
        entry["block"] = [s_lo, s_hi, p_lo, p_hi]
        entry["free_slots"] = sum(1 for slot in built.slots if free(slot))
        if values is not None:
            entry["makespan"] = sim = _replay(prob, built.decode(values))
            if isinstance(sim, float) and sim < z * (1 - 1e-9):
                z, hint = sim, clamped(built, values)
        print(json.dumps(entry), f"best {z:.6f}, wall {time.perf_counter() - t:.1f} s, "
              f"load {load()}, {time.strftime('%H:%M:%S', time.gmtime())} UTC", flush=True)


def probe(args: argparse.Namespace) -> None:
    """The whole model with every time at most ``--cap``: CP-SAT's verdict."""
    prob, built, scale = _model(args)
    model = with_fixed(built, {}, args.cap)
    model.add(summed_sequence(model), "summed_sequence")
    c, t = time.process_time(), time.perf_counter()
    cp = to_cpsat(model, scale=scale)
    out = engines.solve_cpsat(cp.cp, cp.variables, threads=1, seed=0,
                              deterministic_time=args.work,
                              parameters=WINDOW_PARAMETERS if args.light else None)
    res = {"cap": args.cap, "light": args.light, "status": str(out.status),
           "message": out.message, "deterministic_time": out.info.get("deterministic_time"),
           "cpu_s": round(time.process_time() - c, 1),
           "wall_s": round(time.perf_counter() - t, 1), "load": load()}
    if out.status.has_plan and out.values is not None:
        res["makespan"] = _replay(prob, built.decode(cp.values(out.values)))
    print(json.dumps(res, default=str), flush=True)


def main() -> None:
    """Parse the command line and run one mode."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("stage", "solve", "blocks", "probe"), nargs="?",
                   default="stage")
    p.add_argument("--chain", default=CHAIN)
    p.add_argument("--memory", default="10%")
    p.add_argument("--grid", type=int, default=200)
    p.add_argument("--backlog-grid", type=int, default=150)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--work", type=float, default=20.0)
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--no-forward", dest="forward", action="store_false")
    p.add_argument("--start", help="a JSON file with a start plan ({'plan': [...]})")
    p.add_argument("--save", help="write the best plan to this JSON file")
    p.add_argument("--time-limit", type=float, default=300.0)
    p.add_argument("--extra", default="{}")
    p.add_argument("--blocks", default="[[1, 4, null, null]]",
                   help="blocks: [[first stage, last stage, first phase, last phase], ...]")
    p.add_argument("--cap", type=float, default=117.40, help="probe: every time at most this")
    p.add_argument("--light", action="store_true", help="probe: the windows' lighter presolve")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("optmem.solvers.remat_offload_benders").setLevel(logging.WARNING)
    print(f"# {args.mode} {vars(args)} at {time.strftime('%H:%M:%S', time.gmtime())} UTC, "
          f"load {load()}", flush=True)
    {"stage": stage, "solve": whole, "blocks": blocks, "probe": probe}[args.mode](args)


if __name__ == "__main__":
    main()
