"""The exact pipeline model: proven-optimal rate, time to proof, and the DPs against it.

Part 1 (P||Cmax): seeded random 8-layer chains with free transfers and no memory limit on
P = 2, 3, 4 GPUs; both emitters (``ilp`` on HiGHS, ``cpsat``) without a time limit: time
to proof, branch-and-bound nodes, and the optimum against brute force.

Part 2 (bundled profiles): full profiles (no coarsening) at P GPUs, 12 GB/s links, and three
memory limits per GPU: 1.1x, 1.5x and 3x the smallest memory with a contiguous plan. For
each: the best contiguous 1F1B* period (a DP, optimal among contiguous allocations),
MadPipe (its phase-1 DP estimate and its valid period) and both exact emitters with a time
limit: status, period, proven bound, gap, time; then how far each DP is from the best
proven bound (and from the optimum where it is proven).

Part 3 (headline): ResNet-50 (batch 32, 224 px; 21 units), 4 GPUs, 3 GiB, 12 GB/s, both
emitters with a 600 s limit.

Part 4 (allocations): the headline instance with the allocation fixed (the contiguous
optimum's, the relaxation's at two periods, two hand-made non-contiguous ones) and the period
capped just below the best known plan's: does any of them admit a better plan?

Part 5 (strategies): ``cpsat`` with the full model against ``cpsat`` with the allocation
decomposition (``extra={"strategy": "benders"}``, :mod:`optmem.solvers.pipeline_benders`) on
ResNet-18 and ResNet-50 at 1.1x / 1.5x / 3x the smallest contiguous memory (4 GPUs, 12 GB/s,
``--time-limit`` each), then the decomposition on the headline (``--headline`` seconds).

Part 6 (bounds, only with ``--parts bounds``): on the headline instance, the
allocation-independent packing bound (load and memory per GPU, copies from lifetimes without
waits), and for three allocations every subset of 1-3 GPUs checked in isolation at the 1 %
rung (the other units as delays without memory): which GPUs a refutation needs.

Part 8 (climb, only with ``--parts climb``): the co-location climb alone on the headline
from the relaxation's bound below the best plan (``extra["colocate_order"]``: each order
within ``--climb-cpu`` CPU seconds, 1 thread, seed 0): bound, refutations, no-goods.

Part 9 (lns, only with ``--parts lns``): the large-neighbourhood search
(:mod:`optmem.solvers.pipeline_lns`) on the headline from MadPipe's plan, ``--lns-moves``
moves of ``--lns-work`` deterministic seconds (1 worker, each seed of ``--lns-seeds``),
against the full model on CP-SAT from the same warm start with the same deterministic
budget (moves x work, 1 worker, same seed): the period after each budget, side by side.

Part 10 (chunks, only with ``--parts chunks``): the chunk scan
(:mod:`optmem.solvers.pipeline_chunks`, method ``chunks``) on the headline from each start of
``--chunks-starts`` (MadPipe's plan, the contiguous 1F1B* plan), ``--chunks-work``
deterministic seconds per allocation, 1 worker: the period, the evaluation that found each
improvement, allocations refuted (by the waits rows, stop 59; by trimmed questions,
``--chunks-trim``, stop 62) and undecided, the family bound, CPU seconds; against the
search of part 9 from the same start (``--lns-moves`` x ``--lns-work``, seed 0; skipped with
``--chunks-no-search``).

Every engine runs on 2 threads (parts 8, 9 and 10: 1). HiGHS nodes come from the engine;
CP-SAT's branches are read from its own log (the engine adapter does not report them).
Machine load is recorded (``uptime``) before each part: the machine is shared, wall times
vary with it.

Usage::

    python benchmarks/bench_pipeline_exact.py [--quick] [--time-limit S] [--headline S]
        [--parts pcmax profiles headline allocations strategies bounds probes climb lns chunks]
        [--climb-cpu S] [--climb-orders ladder bisect]
        [--lns-moves N] [--lns-work S] [--lns-seeds K ...]
        [--chunks-starts madpipe contiguous] [--chunks-work S] [--chunks-no-search]
        [--chunks-workers W] [--chunks-waits on|off] [--chunks-trim N]
        [--out benchmarks/results/pipeline_exact.md]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optmem.chain import Chain  # noqa: E402
from optmem.cli import parse_extra_options  # noqa: E402
from optmem.cli_problems import parse_pipeline_bandwidth  # noqa: E402
from optmem.datasets import resolve_chain  # noqa: E402
from optmem.models.pipeline import (  # noqa: E402
    Units,
    isolate_units,
    load_bound,
    make_units,
)
from optmem.pipeline_plan import PipelinePlan  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.result import Result, SolveOptions, Status  # noqa: E402
from optmem.solvers import pipeline_chunks, pipeline_lns  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402
from optmem.solvers.pipeline import min_memory_contiguous  # noqa: E402
from optmem.solvers.pipeline_benders import CLIMB_ORDERS, Benders  # noqa: E402
from optmem.solvers.pipeline_common import refute, run_model  # noqa: E402
from optmem.solvers.pipeline_exact import incumbents  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_and_write, uptime  # noqa: E402

GIB = 2**30
PROFILES = ("unet-b4-512", "resnet18-b64-224", "vit-b16-b64-224", "gpt2-small-b8-1024",
            "resnet50-b32-224")
FACTORS = (1.1, 1.5, 3.0)


@contextlib.contextmanager
def captured_stdout() -> Iterator[list[str]]:
    """Capture what C++ code writes to file descriptor 1 (CP-SAT's log)."""
    out: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield out
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read())


def run(problem: PipelineProblem, method: str, limit: float | None, **extra) -> dict:
    """Solve and measure; CP-SAT's branches from its log."""
    opts = SolveOptions(time_limit_s=limit, threads=2, verbose=method == "cpsat",
                        extra=extra)
    start = time.perf_counter()
    with captured_stdout() as log:
        result = solve(problem, method, options=opts)
    wall = time.perf_counter() - start
    nodes = result.report.get("nodes")
    if method == "cpsat":
        found = re.findall(r"^branches: (\d+)", "".join(log), re.MULTILINE)
        nodes = int(found[-1]) if found else None
    return {"result": result, "time": wall, "nodes": nodes}


def found_trail(found_at: list[int], periods: list[float]) -> list[str]:
    """``"move: period"`` of each improvement of a search or a scan."""
    return [f"{m}: {p:.2f}" for m, p in zip(found_at, periods, strict=True)]


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.{digits}f}"


def gap(result: Result) -> str:
    g = result.gap
    return "-" if not math.isfinite(g) else f"{100 * g:.2f} %"


# ------------------------------------------------------------------ part 1
def pcmax_instance(seed: int, gpus: int) -> tuple[PipelineProblem, float]:
    """An 8-layer P||Cmax instance and its brute-force optimum."""
    rng = random.Random(seed)
    f = [rng.randint(1, 20) for _ in range(8)]
    b = [rng.randint(1, 40) for _ in range(8)]
    chain = Chain.from_lists(f, b, [1] * 8, [1] * 8, input_size=1, name=f"pcmax-{seed}")
    loads = [x + y for x, y in zip(f, b, strict=True)]
    best = min(max(sum(load for load, g in zip(loads, labels, strict=True) if g == k)
                   for k in range(gpus))
               for labels in itertools.product(range(gpus), repeat=8))
    return PipelineProblem(chain, gpus, 10**12), best


def part_pcmax(seeds: list[int]) -> list[str]:
    rows = [f"Load: {uptime()}.", "",
            "| seed | P | brute force | engine | status | period | bound | time (s) | nodes |",
            "|---|---|---|---|---|---|---|---|---|"]
    proved = total = 0
    times: list[float] = []
    for seed, gpus in itertools.product(seeds, (2, 3, 4)):
        problem, best = pcmax_instance(seed, gpus)
        for method in ("ilp", "cpsat"):
            out = run(problem, method, None)
            r = out["result"]
            total += 1
            if r.status is Status.OPTIMAL and abs(r.objective - best) <= 1e-6 * best:
                proved += 1
                times.append(out["time"])
            rows.append(f"| {seed} | {gpus} | {best:g} | {method} | {r.status} | "
                        f"{fmt(r.objective)} | {fmt(r.bound, 4)} | {out['time']:.2f} | "
                        f"{out['nodes'] if out['nodes'] is not None else '-'} |")
            print(rows[-1], flush=True)
    rows += ["", f"Proven optimal and equal to brute force: {proved} of {total}; time to "
             f"proof median {sorted(times)[len(times) // 2]:.2f} s, max {max(times):.2f} s "
             "(wall, model building and the warm-start heuristics included)."
             if times else f"Proven: {proved} of {total}."]
    return rows


# ------------------------------------------------------------------ part 2
def part_profiles(profiles: list[str], gpus: list[int], limit: float) -> list[str]:
    rows = [f"Load: {uptime()}.", "",
            "| profile | L | P | memory (GiB) | contiguous | MadPipe estimate | MadPipe | "
            "engine | status | period | bound | gap | time (s) | nodes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for name, p in itertools.product(profiles, gpus):
        chain = resolve_chain(name)
        bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
        low = min_memory_contiguous(PipelineProblem(chain, p, 1, chain_bandwidth=bw))
        for factor in FACTORS:
            problem = PipelineProblem(chain, p, int(low * factor), chain_bandwidth=bw)
            contig = solve(problem, "contiguous")
            mad = solve(problem, "madpipe", options=SolveOptions(
                threads=2, time_limit_s=min(limit, 60.0)))
            best_bound, best_period, proven = 0.0, math.inf, False
            for method in ("cpsat", "ilp"):
                out = run(problem, method, limit, warm_madpipe=False)
                r = out["result"]
                if math.isfinite(r.bound):
                    best_bound = max(best_bound, r.bound)
                if r.status.has_plan:
                    best_period = min(best_period, r.objective)
                proven |= r.status is Status.OPTIMAL
                rows.append(
                    f"| {name} | {chain.length} | {p} | {problem.memory_per_gpu / GIB:.2f} | "
                    f"{fmt(contig.objective)} | "
                    f"{fmt(mad.report.get('phase1_estimate', math.nan))} | "
                    f"{fmt(mad.objective)} | {method} | {r.status} | {fmt(r.objective)} | "
                    f"{fmt(r.bound)} | {gap(r)} | {out['time']:.1f} | "
                    f"{out['nodes'] if out['nodes'] is not None else '-'} |")
                print(rows[-1], flush=True)
            summary.append((name, p, factor, contig.objective, mad.objective, best_bound,
                            best_period, proven))
    rows += ["", "How far the DPs are from the exact model (best bound of the two engines; "
             "`=` where the optimum is proven):", "",
             "| profile | P | memory factor | contiguous / bound | MadPipe / bound | best "
             "period / bound |", "|---|---|---|---|---|---|"]
    for name, p, factor, c, m, bound, period, proven in summary:
        mark = " (=)" if proven else ""
        rows.append(f"| {name} | {p} | {factor} | {fmt(c / bound, 3)} | {fmt(m / bound, 3)} | "
                    f"{fmt(period / bound, 3)}{mark} |")
    return rows


# ------------------------------------------------------------------ part 3
def part_headline(limit: float, methods: tuple[str, ...] = ("cpsat", "ilp"),
                  extra: dict | None = None) -> list[str]:
    """The headline with each engine (``extra``: ``SolveOptions.extra``, e.g. the
    co-location climb's ``{"colocate_step": 0.01}``)."""
    chain = resolve_chain("resnet50-b32-224")
    problem = headline_problem(chain)
    rows = [f"Load: {uptime()}." + (f" Options: {extra}." if extra else ""), "",
            "| engine | status | period | bound | gap | time (s) | CPU s | nodes | incumbents |",
            "|---|---|---|---|---|---|---|---|---|"]
    climbs = []
    for method in methods:
        cpu = time.process_time()
        out = run(problem, method, limit, **(extra or {}))
        cpu = time.process_time() - cpu
        r = out["result"]
        inc = ", ".join(f"{k} {v:.2f}" for k, v in r.report.get("incumbents", {}).items())
        rows.append(f"| {method} | {r.status} | {fmt(r.objective)} | {fmt(r.bound)} | "
                    f"{gap(r)} | {out['time']:.0f} | {cpu:.0f} | "
                    f"{out['nodes'] if out['nodes'] is not None else '-'} | {inc} |")
        print(rows[-1], flush=True)
        climb = {k: v for k, v in r.report.items() if k.startswith("colocate_")}
        if climb:
            climbs.append(f"{method} climb: " + ", ".join(
                f"{k} {fmt(v, 3) if isinstance(v, float) else v}" for k, v in climb.items()))
    return [*rows, "", f"Load after: {uptime()}.", *([""] + climbs if climbs else [])]


def headline_problem(chain: Chain) -> PipelineProblem:
    """The headline instance: ``chain`` on 4 GPUs of 3 GiB each, linked at 12 GB/s."""
    bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
    return PipelineProblem(chain, 4, 3 * GIB, chain_bandwidth=bw)


# ------------------------------------------------------------------ part 4
CHECKED_ALLOCATIONS = (
    ("contiguous optimum (1-4 / 5-7 / 8-13 / 14-22)",
     (0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)),
    ("relaxation's allocation at T = 33",
     (0, 1, 2, 0, 2, 3, 3, 1, 1, 1, 1, 1, 3, 3, 0, 2, 0, 0, 2, 2, 2)),
    ("relaxation's allocation at T = 34.5",
     (0, 1, 1, 2, 3, 3, 0, 0, 0, 0, 2, 2, 1, 1, 2, 2, 1, 1, 1, 0, 3)),
    ("first units with the last ones (1-4 + 17-22 / 5-7 / 8-11 / 12-16)",
     (0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0)),
    ("first units with the last ones (1-4 + 19-22 / 5-7 / 8-12 / 13-18)",
     (0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 0, 0, 0)),
)
"""Allocations of ResNet-50's 21 units (GPU per unit) checked by part 4."""


def part_allocations(cutoff: float, limit: float) -> list[str]:
    """The exact model with the allocation fixed and the period below ``cutoff`` (CP-SAT).

    ``infeasible`` proves that no 1-periodic pattern of that allocation has a period
    ``<= cutoff``: evidence on whether better non-contiguous plans exist, where the
    free-allocation model proves nothing.
    """
    chain = resolve_chain("resnet50-b32-224")
    problem = headline_problem(chain)
    rows = [f"Load: {uptime()}.", "",
            "| allocation | GPU loads | status | period | time (s) |", "|---|---|---|---|---|"]
    units = make_units(problem)
    for name, gpu in CHECKED_ALLOCATIONS:
        start = time.perf_counter()
        run = run_model(problem, "cpsat", SolveOptions(time_limit_s=limit, threads=2, seed=0),
                        gpu=list(gpu), upper_bound=cutoff)
        per_gpu = [sum(units.load(q) for q in range(units.n) if gpu[q] == g)
                   for g in range(problem.n_gpus)]
        rows.append(f"| {name} | {', '.join(f'{x:.2f}' for x in per_gpu)} | {run.status} | "
                    f"{fmt(run.plan.period) if run.plan else '-'} | "
                    f"{time.perf_counter() - start:.0f} |")
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------ part 5
STRATEGY_PROFILES = ("resnet18-b64-224", "resnet50-b32-224")


def strategy_row(label: str, problem: PipelineProblem, strategy: str, limit: float) -> str:
    """One solve of ``cpsat`` with ``strategy``, as a table row."""
    out = run(problem, "cpsat", limit, strategy=strategy)
    r = out["result"]
    rep = r.report
    work = (f"{rep.get('benders_allocations', '-')} / {rep.get('benders_masters', '-')}"
            if strategy == "benders" else "-")
    row = (f"| {label} | {strategy} | {r.status} | {fmt(r.objective)} | {fmt(r.bound)} | "
           f"{gap(r)} | {out['time']:.0f} | {work} |")
    print(row, flush=True)
    return row


def part_strategies(limit: float, headline: float) -> list[str]:
    rows = [f"Load: {uptime()}.", "",
            "| instance | strategy | status | period | bound | gap | time (s) | "
            "allocations / master solves |", "|---|---|---|---|---|---|---|---|"]
    for name in STRATEGY_PROFILES:
        chain = resolve_chain(name)
        bw = parse_pipeline_bandwidth("12GB/s", chain.time_unit)
        low = min_memory_contiguous(PipelineProblem(chain, 4, 1, chain_bandwidth=bw))
        for factor in FACTORS:
            problem = PipelineProblem(chain, 4, int(low * factor), chain_bandwidth=bw)
            for strategy in ("full", "benders"):
                rows.append(strategy_row(f"{name} {factor}x", problem, strategy, limit))
    if headline:
        chain = resolve_chain("resnet50-b32-224")
        problem = headline_problem(chain)
        rows.append(f"Load before the headline: {uptime()}.")
        rows.append(strategy_row("resnet50 3 GiB (headline)", problem, "benders", headline))
    return rows


# ------------------------------------------------------------------ part 7
def part_probes(limit: float, work: float = 60.0, step: float = 0.01) -> list[str]:
    """The headline with full-model probes above the relaxation (``probe_step``)."""
    chain = resolve_chain("resnet50-b32-224")
    problem = headline_problem(chain)
    rows = ["| lifetime cuts | load (start / end) | status | period | bound | gap | time (s) | "
            "relaxation bound | probes (period: status, engine s) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for cuts in (False, True):
        before = uptime()
        out = run(problem, "cpsat", limit, probe_step=step, probe_work=work,
                  lifetime_cuts=cuts)
        r = out["result"]
        probes = ", ".join(f"{p['period']:.2f}: {p['status']}, {p.get('engine_time_s', 0):.0f}"
                           for p in r.report.get("probes", []))
        rows.append(f"| {'on' if cuts else 'off'} | {before} / {uptime()} | {r.status} | "
                    f"{fmt(r.objective)} | {fmt(r.bound)} | {gap(r)} | {out['time']:.0f} | "
                    f"{fmt(r.report.get('relaxation_bound'))} | {probes} |")
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------ part 6
BOUND_ALLOCATIONS = (
    ("contiguous optimum (1-4 / 5-7 / 8-13 / 14-22)", CHECKED_ALLOCATIONS[0][1]),
    ("master's first allocation at T = 35.22",
     (0, 1, 2, 2, 0, 3, 1, 1, 0, 0, 0, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1)),
    ("master's second allocation at T = 35.22",
     (0, 0, 0, 1, 2, 0, 3, 2, 3, 3, 2, 3, 3, 1, 1, 1, 1, 1, 2, 2, 1)),
)
"""Allocations (GPU per unit) checked by part 6; the master's come from
``Benders.master`` at 35.22 ms (CP-SAT, 2 threads, seed 0), the second after a no-good on
the first."""
BOUND_PERIOD = 35.22
"""The 1 % rung below the best known plan (35.58)."""


def packing_bound(units: Units, n_gpus: int, memory: int) -> float:
    """The allocation-independent bound of the pipe5 brief, by bisection (CP-SAT).

    Smallest ``T`` (to 1e-3) such that the units pack on ``n_gpus`` GPUs with load at most
    ``T`` and memory ``sum(w_q + x_q ceil(D_q / T)) <= M``, ``D_q = sum_{r >= q} (f_r + b_r)``
    (lifetime without waits or transfers).
    """
    from ortools.sat.python import cp_model

    def fits_at(period: float) -> bool:
        n, grid = units.n, 10**6
        copies = [math.ceil(sum(units.load(r) for r in range(q, n)) / period - 1e-12)
                  for q in range(n)]
        model = cp_model.CpModel()
        x = {(q, p): model.NewBoolVar(f"x{q}_{p}") for q in range(n) for p in range(n_gpus)}
        for q in range(n):
            model.AddExactlyOne(x[q, p] for p in range(n_gpus))
        for p in range(n_gpus):
            model.Add(sum(int(units.load(q) * grid) * x[q, p] for q in range(n))
                      <= int(period * grid))
            model.Add(sum((units.w[q] + units.x[q] * copies[q]) * x[q, p] for q in range(n))
                      <= memory)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        return solver.Solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)

    lo, hi = load_bound(units, n_gpus) - 1e-3, sum(units.load(q) for q in range(units.n))
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits_at(mid) else (mid, hi)
    return hi


def isolated_status(problem: PipelineProblem, gpu: tuple[int, ...], kept: tuple[int, ...],
                    period: float, work: float) -> str:
    """Has the allocation, GPUs ``kept`` in isolation, a plan of period ``<= period``?

    :func:`~optmem.models.pipeline.isolate_units`: a relaxation of every allocation whose
    kept GPUs hold exactly these units.
    """
    units, alloc = isolate_units(make_units(problem), gpu, kept)
    run, bound = refute(replace(problem, n_gpus=max(alloc) + 1),
                        SolveOptions(threads=1, seed=0, deterministic_time=work), period,
                        units=units, gpu=list(alloc))
    if bound is not None:
        return "refuted"
    return "plan" if run.plan is not None else "undecided"


def part_bounds(work: float = 5.0) -> list[str]:
    """The brief's packing bound, and GPU subsets of three allocations in isolation."""
    chain = resolve_chain("resnet50-b32-224")
    problem = headline_problem(chain)
    units = make_units(problem)
    rows = [f"Load: {uptime()}.", "",
            f"Packing bound (load and memory per GPU, copies ceil(D_q / T)): "
            f"{packing_bound(units, problem.n_gpus, problem.memory_per_gpu):.2f}; load bound "
            f"{load_bound(units, problem.n_gpus):.2f}.", "",
            f"GPU subsets in isolation at T <= {BOUND_PERIOD} (CP-SAT, 1 worker, seed 0, "
            f"deterministic time {work:g} each; `refuted` holds for every allocation whose "
            "kept GPUs hold exactly these units; `undecided`: no answer within the work):", "",
            "| allocation | kept GPUs | status | time (s) |", "|---|---|---|---|"]
    for name, gpu in BOUND_ALLOCATIONS:
        for size in (1, 2, 3):
            for kept in itertools.combinations(range(problem.n_gpus), size):
                start = time.perf_counter()
                status = isolated_status(problem, gpu, kept, BOUND_PERIOD, work)
                rows.append(f"| {name} | {', '.join(map(str, kept))} | {status} | "
                            f"{time.perf_counter() - start:.1f} |")
                print(rows[-1], flush=True)
    return rows


CLIMB_FROM = (28.03, 33.46)
"""Part 8's start: the relaxation's headline bound (rounded down) and the best plan's period."""


class CpuClimb(Benders):
    """The co-location climb stopped by a CPU budget (``time.process_time``, engine threads
    included: comparable under any load), recording each probe."""

    budget: float = math.inf
    cpu0: float = 0.0
    trail: list[tuple[float, float, str, int, int, int]]

    def out_of_time(self) -> bool:
        return time.process_time() - self.cpu0 > self.budget

    def colocate_probe(self, ticks: int) -> str:
        verdict = super().colocate_probe(ticks)
        self.trail.append((time.process_time() - self.cpu0, ticks / self.scale, verdict,
                           self.colocate_solves, len(self.together), len(self.cuts)))
        return verdict


def part_climb(budget: float, orders: tuple[str, ...], step: float = 0.01,
               work: float = 5.0) -> list[str]:
    """The climb alone on the headline from :data:`CLIMB_FROM`, each order within ``budget``
    CPU seconds (1 thread, seed 0: the same refutations on every run)."""
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    options = SolveOptions(threads=1, seed=0, extra={"colocate_work": work})
    rows = [f"From bound {CLIMB_FROM[0]} below incumbent {CLIMB_FROM[1]}, step {step:g}, "
            f"colocate_work {work:g}, {budget:g} CPU s each.", "",
            "| order | bound | gap | probes (closed) | refutations | no-goods | allocation "
            "no-goods | masters | CPU s | wall s | load (start / end) | stopped |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    trails = []
    for order in orders:
        load, wall = uptime(), time.perf_counter()
        out = CpuClimb(problem, "cpsat", options, CLIMB_FROM[1], None, CLIMB_FROM[0])
        out.trail, out.budget, out.cpu0 = [], budget, time.process_time()
        out.climb(step, order)
        r = out.report
        rows.append(f"| {order} | {out.bound:.3f} | "
                    f"{100 * (CLIMB_FROM[1] - out.bound) / CLIMB_FROM[1]:.2f} % | "
                    f"{r['colocate_probes']} ({r['colocate_closed']}) | {r['colocate_solves']} | "
                    f"{r['colocate_nogoods']} | {r['colocate_allocations']} | "
                    f"{r['colocate_masters']} | {time.process_time() - out.cpu0:.0f} | "
                    f"{time.perf_counter() - wall:.0f} | {load} / {uptime()} | "
                    f"{r.get('colocate_stopped', '-')} |")
        print(rows[-1], flush=True)
        trails += [f"{order}: " + "; ".join(f"{p:.3f} {v} at {c:.0f} CPU s ({n} refutations, "
                                            f"{g} no-goods, {a} allocations)"
                                            for c, p, v, n, g, a in out.trail)]
        print(trails[-1], flush=True)
    return [*rows, "", "Probes (period, verdict, CPU s when it ended):", "",
            *(f"* {t}" for t in trails)]


def part_lns(moves: int, work: float, seeds: list[int], bound: float = 0.0,
             full: bool = True) -> list[str]:
    """The search against the full model with the same deterministic budget, from MadPipe.

    ``bound``: a proven lower bound given to both (a row ``T >= bound``, as a solve gives
    the relaxation's; it changes CP-SAT's search); ``full``: also run the full model.
    """
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    start = solve(problem, "madpipe", options=SolveOptions(threads=1, seed=0))
    plan = PipelinePlan.from_strings(start.plan)
    rows = [f"From MadPipe's {start.objective:.2f}; {moves} moves x {work:g} deterministic s "
            f"against the full model with {moves * work:g} deterministic s; 1 worker; "
            f"lower bound row {bound:g}.", "",
            "| seed | search: period | improvements (move: period) | CPU s | wall s | "
            "full model: period | CPU s | wall s | full / search | load (start / end) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for seed in seeds:
        load = uptime()
        cpu, wall = time.process_time(), time.perf_counter()
        found = pipeline_lns.improve(problem, start.objective, plan, moves=moves, work=work,
                                     seed=seed, bound=bound)
        trail = found_trail(found.found_at, found.improvements)
        cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - wall
        full_period = math.nan
        if full:
            cpu, wall = time.process_time(), time.perf_counter()
            run = run_model(problem, "cpsat", SolveOptions(
                threads=1, seed=seed, deterministic_time=moves * work),
                upper_bound=start.objective, warm=plan, lower=bound)
            full_period = run.plan.period if run.plan is not None else start.objective
        other = (f"{full_period:.2f} | {time.process_time() - cpu:.0f} | "
                 f"{time.perf_counter() - wall:.0f} | {full_period / found.period:.3f}"
                 if full else "- | - | - | -")
        rows.append(f"| {seed} | {found.period:.2f} | {'; '.join(trail) or '-'} | "
                    f"{cpu_s:.0f} | {wall_s:.0f} | {other} | {load} / {uptime()} |")
        print(rows[-1], flush=True)
    return rows


def part_chunks(starts: tuple[str, ...], work: float, moves: int, move_work: float,
                search: bool = True, workers: int = 1, waits: bool = True,
                tail: int = pipeline_chunks.TRIM_TAIL) -> list[str]:
    """The chunk scan from each start, and the search of part 9 from the same start.

    ``waits``: the scan's waits rows (stop 59, the method's default; ``--chunks-waits off``
    for the scan before it). ``tail``: the trimmed questions (stop 62, the method's
    default; ``--chunks-trim 0`` for the scan before it).
    """
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    units = make_units(problem)
    plans = {c[2]: c for c in incumbents(problem, SolveOptions(threads=1, seed=0))}
    names = {"madpipe": "madpipe", "contiguous": "contiguous 1F1B*"}
    rows = [f"{work:g} deterministic s per allocation, one CP-SAT worker each, {workers} "
            f"allocation(s) asked at once, waits rows {'on' if waits else 'off'}, trimmed "
            f"questions {f'from {tail} units dropped, where shared' if tail else 'off'}, "
            "at most "
            f"{pipeline_chunks.MAX_CHUNKS} chunks per GPU; the search: {moves} moves x "
            f"{move_work:g} deterministic s, seed 0.", "",
            "| start | method | period | found at (evaluation or move: period) | evaluated "
            "| refuted (by the waits rows / trimmed of trimmed questions) | undecided "
            "| family bound | CPU s | wall s "
            "| load (start / end) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for start in starts:
        period, plan, _ = plans[names[start]]
        load = uptime()
        cpu, wall = time.process_time(), time.perf_counter()
        found = pipeline_chunks.scan(problem, units, period, plan,
                                     chunks=pipeline_chunks.MAX_CHUNKS, work=work,
                                     step=pipeline_chunks.CHUNK_STEP, workers=workers,
                                     waits=waits, tail=tail)
        trail = found_trail(found.found_at, found.improvements)
        rows.append(f"| {start} {period:.2f} | chunks | {found.period:.2f} | "
                    f"{'; '.join(trail[-4:]) or '-'} | {found.evaluated} | {found.refuted} "
                    f"({found.waited} / {found.trimmed} of {found.trim_questions}) | "
                    f"{found.undecided} | {fmt(None if math.isnan(found.bound) else found.bound)}"
                    f" | {time.process_time() - cpu:.0f} | {time.perf_counter() - wall:.0f} | "
                    f"{load} / {uptime()} |")
        print(rows[-1], flush=True)
        if not search:
            continue
        load = uptime()
        cpu, wall = time.process_time(), time.perf_counter()
        moved = pipeline_lns.improve(problem, period, plan, moves=moves, work=move_work,
                                     seed=0, units=units)
        trail = found_trail(moved.found_at, moved.improvements)
        rows.append(f"| {start} {period:.2f} | search | {moved.period:.2f} | "
                    f"{'; '.join(trail[-4:]) or '-'} | {moved.moves} | - | - | - | "
                    f"{time.process_time() - cpu:.0f} | {time.perf_counter() - wall:.0f} | "
                    f"{load} / {uptime()} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer instances, short limits")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--headline", type=float, default=600.0,
                        help="time limit of part 3 (0 to skip)")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--gpus", nargs="+", type=int, default=[4])
    parser.add_argument("--parts", nargs="+",
                        choices=("pcmax", "profiles", "headline", "allocations",
                                 "strategies", "bounds", "probes", "climb", "lns", "chunks"),
                        default=["pcmax", "profiles", "headline", "allocations",
                                 "strategies"],
                        help="parts to run")
    parser.add_argument("--headline-methods", nargs="+", default=["cpsat", "ilp"],
                        choices=("cpsat", "ilp"), help="engines of part 3")
    parser.add_argument("--headline-option", action="append", default=[],
                        metavar="KEY=VALUE", help="SolveOptions.extra of part 3 (as the "
                        "CLI's --option, e.g. colocate_step=0.01)")
    parser.add_argument("--climb-cpu", type=float, default=600.0,
                        help="CPU seconds of each climb of part 8")
    parser.add_argument("--climb-orders", nargs="+", default=list(CLIMB_ORDERS),
                        choices=CLIMB_ORDERS, help="climb orders of part 8")
    parser.add_argument("--lns-moves", type=int, default=40, help="moves of part 9")
    parser.add_argument("--lns-work", type=float, default=10.0,
                        help="deterministic seconds per move of part 9")
    parser.add_argument("--lns-seeds", nargs="+", type=int, default=[0],
                        help="seeds of part 9")
    parser.add_argument("--lns-bound", type=float, default=0.0,
                        help="lower bound row of part 9 (a solve gives the relaxation's)")
    parser.add_argument("--lns-no-full", action="store_true",
                        help="part 9 without the full model's run")
    parser.add_argument("--chunks-starts", nargs="+", default=["madpipe", "contiguous"],
                        choices=("madpipe", "contiguous"), help="starts of part 10")
    parser.add_argument("--chunks-work", type=float, default=pipeline_chunks.CHUNK_WORK,
                        help="deterministic seconds per allocation of part 10")
    parser.add_argument("--chunks-no-search", action="store_true",
                        help="part 10 without the search's rows")
    parser.add_argument("--chunks-workers", type=int, default=1,
                        help="allocations asked at once by part 10's scan (threads)")
    parser.add_argument("--chunks-waits", choices=("on", "off"), default="on",
                        help="part 10's scan with the waits rows (stop 59) or without")
    parser.add_argument("--chunks-trim", type=int, default=pipeline_chunks.TRIM_TAIL,
                        help="part 10's trimmed questions from this many units dropped "
                             "(stop 62; 0: off)")
    parser.add_argument("--out", help="write the Markdown here")
    args = parser.parse_args()
    seeds = [0, 1, 2, 3, 4]
    if args.quick:
        seeds, args.profiles, args.time_limit, args.headline = [0], ["unet-b4-512"], 5.0, 0
    start = time.perf_counter()
    text = ["# Exact pipeline model (`benchmarks/bench_pipeline_exact.py`)", ""]
    if "pcmax" in args.parts:
        text += ["## P||Cmax: 8 layers, free transfers, no memory limit (no time limit)", "",
                 *part_pcmax(seeds), ""]
    if "profiles" in args.parts:
        text += [f"## Bundled profiles: P = {', '.join(map(str, args.gpus))}, 12 GB/s, memory "
                 f"1.1x / 1.5x / 3x the smallest contiguous one, {args.time_limit:g} s per "
                 "engine", "", *part_profiles(args.profiles, args.gpus, args.time_limit), ""]
    if args.headline and "headline" in args.parts:
        text += [f"## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s, {args.headline:g} s per engine", "",
                 *part_headline(args.headline, tuple(args.headline_methods),
                                parse_extra_options(args.headline_option)), ""]
    if "allocations" in args.parts:
        text += ["## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: fixed allocations, period <= 35.5 "
                 "(CP-SAT, 300 s each)", "", *part_allocations(35.5, 300.0), ""]
    if "strategies" in args.parts:
        text += [f"## Full model against the allocation decomposition (CP-SAT, "
                 f"{args.time_limit:g} s each; headline {args.headline:g} s)", "",
                 *part_strategies(args.time_limit, args.headline), ""]
    if "bounds" in args.parts:
        text += ["## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: bounds against allocations (part 6)",
                 "", *part_bounds(), ""]
    if "climb" in args.parts:
        text += [f"## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: the co-location climb alone (part 8, "
                 f"CP-SAT, 1 thread, {args.climb_cpu:g} CPU s per order)", "",
                 *part_climb(args.climb_cpu, tuple(args.climb_orders)), ""]
    if "probes" in args.parts:
        text += [f"## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: full-model probes (part 7, CP-SAT, "
                 f"{args.headline:g} s)", "", *part_probes(args.headline), ""]
    if "lns" in args.parts:
        text += ["## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: the large-neighbourhood search "
                 "against the full model (part 9, CP-SAT, 1 worker)", "",
                 *part_lns(args.lns_moves, args.lns_work, args.lns_seeds, args.lns_bound,
                           not args.lns_no_full), ""]
    if "chunks" in args.parts:
        text += ["## ResNet-50, 4 GPUs, 3 GiB, 12 GB/s: the chunk scan against the search "
                 f"(part 10, CP-SAT, {args.chunks_workers} thread(s))", "",
                 *part_chunks(tuple(args.chunks_starts), args.chunks_work, args.lns_moves,
                              args.lns_work, not args.chunks_no_search,
                              args.chunks_workers, args.chunks_waits == "on",
                              args.chunks_trim), ""]
    text += [f"Total wall time {time.perf_counter() - start:.0f} s; 2 threads per engine."]
    print_and_write("\n".join(text) + "\n", args.out)


if __name__ == "__main__":
    main()
