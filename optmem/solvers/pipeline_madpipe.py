r"""MadPipe (thesis chapter 7): a DP for non-contiguous allocations, then an exact schedule.

Phase 1, MadPipe-DP(T-hat) (digest ``madpipe.md`` 5.1-5.3): ``P - 1`` *normal* GPUs hold one
stage each, one *special* GPU holds any set of stages. State ``T(j, p, t_P, m_P, V)``: the
smallest period estimate for layers ``1..j`` with ``p`` normal GPUs left, the special GPU
already carrying load ``t_P`` and memory ``m_P``, and ``V`` the group-aware accumulated load
of the pseudo-chain to the right (``(+)`` operator). Last stage ``i..j``:

* ``V' = (V (+) U(i, j)) (+) C(i - 1)``, ``g = ceil((V (+) U(i, j)) / T-hat)``;
* normal: ``M(i, j, g) <= M`` and ``T_N = max(U(i, j), C(i-1), T(i-1, p-1, t_P, m_P, V'))``;
* special: ``t'_P = t_P + U(i, j)``, ``m'_P = m_P + M(i, j, g - 1) <= M`` (the deliberate
  under-estimate of 5.2), ``T_S = max(t'_P, C(i-1), T(i-1, p, t'_P, m'_P, V'))``;
* ``T(0, ...) = t_P``; ``T(j, 0, ...)`` puts the whole prefix on the special GPU.

Algorithm 8 chooses ``T-hat`` by the bisection-like loop of the thesis (``K`` iterations).
``t_P``, ``m_P`` and ``V`` are exact (memoised on their values) for short chains and rounded
*up* to the thesis grids (101, 11 and 51 values, section 5.5) otherwise.

Phase 2 (section 7.2): the stages become the units of a coarse chain and the chapter 6 model
finds a valid 1-periodic schedule (``options.extra["phase2"]``: ``"cpsat"``, the default when
OR-Tools is installed, solves it as :mod:`optmem.models.pipeline_cpsat`, much faster than
``"ilp"``, :mod:`optmem.models.pipeline_ilp`, the thesis' choice), first with the DP's GPU
assignment fixed, then with a free assignment of the stages when the fixed one is infeasible
under the exact memory model (the digest's 5.6 ambiguity). While no valid period reaches the
phase-1 estimate, phase 1 runs again with the memory reduced by a safety margin (x0.85, x0.7,
x0.55), the digest's fallback. Without a user limit, each phase-2 model gets a
deterministic work limit (``PHASE2_NODE_LIMIT`` nodes for the ILP, ``PHASE2_DETERMINISTIC_TIME``
for CP-SAT), so the heuristic's answer does not depend on the machine's load. A DP
allocation that is contiguous is scheduled by 1F1B*
instead (optimal for it, Theorem 15). The best valid plan
found is returned; since contiguous allocations belong to the DP's class but phase 2 cannot
always recover them, the best contiguous 1F1B* plan is a candidate too (reported as the
source).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from optmem.models.pipeline_common import make_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.pipeline_contiguous import group_of, oplus

EXACT_MAX_LAYERS = 12
GRID_T, GRID_M, GRID_V = 101, 11, 51
K_ITERATIONS = 10
MEMORY_FACTORS = (1.0, 0.85, 0.7, 0.55)
PHASE2_NODE_LIMIT = 20_000
"""Default ILP work limit of each phase-2 model (branch-and-bound nodes) when no limit is set."""
PHASE2_DETERMINISTIC_TIME = 30.0
"""Default CP-SAT work limit of each phase-2 model (deterministic seconds) likewise."""

Allocation = list[tuple[int, int, str]]  # (first, last, "N"|"S") in chain order


def madpipe_dp(problem: PipelineProblem, that: float, *, exact: bool = True
               ) -> tuple[float, Allocation | None, int]:
    """MadPipe-DP(``that``): ``(period estimate, allocation, states)``; ``inf`` if none."""
    lay = problem.layers
    n = lay.n
    limit = problem.memory_per_gpu
    total = lay.load(1, n)
    cost = [0.0] + [2 * problem.transfer_time(j) for j in range(1, n)]
    if exact:
        def rt(t: float) -> float:
            return t

        def rm(m: float) -> float:
            return m

        def rv(v: float) -> float:
            return v
    else:
        st = total / (GRID_T - 1) or 1.0
        sm = limit / (GRID_M - 1) or 1.0
        sv = (total + sum(cost)) / (GRID_V - 1) or 1.0

        def rt(t: float) -> float:
            return math.ceil(t / st - 1e-9) * st

        def rm(m: float) -> float:
            return math.ceil(m / sm - 1e-9) * sm

        def rv(v: float) -> float:
            return math.ceil(v / sv - 1e-9) * sv

    memo: dict[tuple, tuple[float, Any]] = {}
    inf = math.inf
    # U(i, j), weights + buffers, and stash of every stage i..j (O(n^2) tables)
    load = [[0.0] * (n + 1) for _ in range(n + 1)]
    static = [[0] * (n + 1) for _ in range(n + 1)]
    stash = [[0] * (n + 1) for _ in range(n + 1)]
    grows = [[0] * (n + 1) for _ in range(n + 1)]  # static without the buffer before i
    for i in range(1, n + 1):
        for j in range(i, n + 1):
            load[i][j] = lay.load(i, j)
            stash[i][j] = lay.stash(i, j)
            static[i][j] = problem.stage_memory(i, j, 0)
            grows[i][j] = problem.static_memory(i, j, cut_before=False, cut_after=j < n)

    def rec(j: int, p: int, tp: float, mp: float, v: float) -> float:
        key = (j, p, tp, mp, v)
        if key in memo:
            return memo[key][0]
        if j == 0:
            memo[key] = (tp, None)
            return tp
        if p == 0:
            g = group_of(oplus(v, load[1][j], that), that)
            ok = mp + static[1][j] + (g - 1) * stash[1][j] <= limit
            val = load[1][j] + tp if ok else inf
            memo[key] = (val, (1, "S", None))
            return val
        best, choice = inf, None
        for i in range(j, 0, -1):
            u = load[i][j]
            if u >= best:
                break  # stages only grow as i decreases
            if grows[i][j] + mp > limit and grows[i][j] + stash[i][j] > limit:
                break  # neither kind of GPU can hold i..j, nor any longer stage
            c = cost[i - 1] if i > 1 else 0.0
            if c >= best:
                continue
            vs = oplus(v, u, that)
            g = group_of(vs, that)
            vn = rv(oplus(vs, c, that)) if i > 1 else 0.0
            if static[i][j] + g * stash[i][j] <= limit:
                val = max(u, c, rec(i - 1, p - 1, tp, mp, vn))
                if val < best:
                    best, choice = val, (i, "N", (i - 1, p - 1, tp, mp, vn))
            tp2 = rt(tp + u)
            mp2 = rm(mp + static[i][j] + (g - 1) * stash[i][j])
            if mp2 <= limit and max(tp2, c) < best:
                val = max(tp2, c, rec(i - 1, p, tp2, mp2, vn))
                if val < best:
                    best, choice = val, (i, "S", (i - 1, p, tp2, mp2, vn))
        memo[key] = (best, choice)
        return best

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10 * n + 1000))
    try:
        start = (n, problem.n_gpus - 1, 0.0, 0.0, 0.0)
        value = rec(*start)
    finally:
        sys.setrecursionlimit(old)
    if not math.isfinite(value):
        return inf, None, len(memo)
    alloc: Allocation = []
    key: Any = start
    j = n
    while key is not None and key[0] > 0:
        _, choice = memo[key]
        i, kind, nxt = choice
        alloc.append((i, j, kind))
        j = i - 1
        key = nxt
    return value, alloc[::-1], len(memo)


def algorithm8(problem: PipelineProblem, *, exact: bool, iterations: int = K_ITERATIONS
               ) -> tuple[float, float, Allocation | None, int]:
    """Algorithm 8: ``(estimate max(DP, T-hat), T-hat, allocation, DP states)``."""
    lay = problem.layers
    total = lay.load(1, lay.n)
    lb = total / problem.n_gpus
    ub = total + sum(2 * problem.transfer_time(j) for j in range(1, lay.n))
    that = lb
    best: tuple[float, float, Allocation | None] = (math.inf, math.nan, None)
    states = 0
    for _ in range(iterations):
        value, alloc, count = madpipe_dp(problem, that, exact=exact)
        states += count
        tilde = max(value, that)
        if tilde < best[0]:
            best = (tilde, that, alloc)
        lb = max(lb, min(value, that))
        ub = min(ub, tilde)
        that = (lb + ub) / 2
    if best[2] is None:  # last chance: the loosest T-hat
        value, alloc, count = madpipe_dp(problem, ub, exact=exact)
        states += count
        if alloc is not None:
            best = (max(value, ub), ub, alloc)
    return best[0], best[1], best[2], states


def gpu_labels(alloc: Allocation) -> list[int]:
    """GPU of each stage: special stages on GPU 0, normal ones on GPUs 1, 2, ..."""
    labels, nxt = [], 1
    for _, _, kind in alloc:
        if kind == "S":
            labels.append(0)
        else:
            labels.append(nxt)
            nxt += 1
    if 0 not in labels:
        labels = [g - 1 for g in labels]
    return labels


def _phase2(problem: PipelineProblem, alloc: Allocation, options: SolveOptions,
            log: list[dict[str, Any]]) -> tuple[float, PipelinePlan] | None:
    """Schedule the DP's allocation: 1F1B* if contiguous, else the ILP (fixed, then free)."""
    from optmem.solvers.pipeline_exact import run_model

    bounds = [(i, j) for i, j, _ in alloc]
    labels = gpu_labels(alloc)
    if len(set(labels)) == len(labels) and problem.memory_model == "stash":
        found = contig.best_period_for_allocation(problem, bounds)
        log.append({"phase2": "1F1B*", "period": found[0] if found else None})
        return found
    units = make_units(problem, bounds)
    method = str(options.extra.get("phase2", "cpsat" if _has_ortools() else "ilp"))
    if options.time_limit_s is None and options.node_limit is None \
            and options.deterministic_time is None:
        options = options.with_(node_limit=PHASE2_NODE_LIMIT,
                                deterministic_time=PHASE2_DETERMINISTIC_TIME)
    for mode, gpu in (("fixed", labels), ("free", None)):
        res, plan, size = run_model(problem, units, method, options, gpu=gpu)
        log.append({"phase2": f"{method}-{mode}", "status": str(res.status),
                    "period": plan.period if plan is not None else None,
                    "model_size": size})
        if plan is not None:
            return plan.period, plan
    return None


def solve_madpipe(problem: PipelineProblem, options: SolveOptions) -> Result:
    """MadPipe: phase 1 (Algorithm 8), phase 2 with fallbacks; the best valid plan."""
    from optmem.solvers.pipeline import infeasible, lower_bound, plan_result

    grid = str(options.extra.get("madpipe_grid", "auto"))
    iterations = int(options.extra.get("madpipe_iterations", K_ITERATIONS))
    exact = grid == "exact" or (grid == "auto" and problem.layers.n <= EXACT_MAX_LAYERS)
    log: list[dict[str, Any]] = []
    candidates: list[tuple[float, PipelinePlan, str]] = []
    estimate = math.nan
    total_states = 0
    for factor in MEMORY_FACTORS:
        sub = problem if factor == 1.0 else _with_memory(problem, factor)
        est, that, alloc, states = algorithm8(sub, exact=exact, iterations=iterations)
        total_states += states
        entry: dict[str, Any] = {"memory_factor": factor, "estimate": est, "t_hat": that}
        log.append(entry)
        if alloc is None:
            entry["allocation"] = None
            break  # less memory cannot help phase 1
        entry["allocation"] = " ".join(f"{k}:{i}-{j}" for i, j, k in alloc)
        if factor == 1.0:
            estimate = est
        found = _phase2(problem, alloc, options, log)
        if found is not None and not _valid(problem, found[1]):
            log.append({"phase2": "rejected by the simulator"})
            found = None
        if found is not None:
            candidates.append((found[0], found[1], f"phase 2, memory x{factor}"))
            if min(c[0] for c in candidates) <= estimate * (1 + 1e-6):
                break  # the valid period reaches the phase-1 estimate of the full memory
    best_contig = None
    if problem.memory_model == "stash":
        best_contig = contig.best_contiguous(problem)
        if best_contig is not None:
            sched = contig.best_period_for_allocation(problem, best_contig[1])
            if sched is not None:
                candidates.append((sched[0], sched[1], "contiguous 1F1B*"))
    report = {"phase1_estimate": estimate, "attempts": log, "dp_states": total_states,
              "grid": "exact" if exact else f"{GRID_T}x{GRID_M}x{GRID_V}"}
    if not candidates:
        return infeasible(problem, "madpipe", "phase 1 found no allocation or phase 2 could "
                          "not schedule it", proven=False, report=report)
    period, plan, source = min(candidates, key=lambda c: c[0])
    report["source"] = source
    return plan_result(problem, plan, method="madpipe", status=Status.FEASIBLE,
                       bound=lower_bound(problem), claimed=period,
                       solver=options.solver, report=report)


def _valid(problem: PipelineProblem, plan: PipelinePlan) -> bool:
    from optmem.errors import PlanError
    from optmem.simulate.pipeline import simulate_pipeline

    try:
        return simulate_pipeline(problem, plan).peak_memory <= problem.memory_per_gpu
    except PlanError:
        return False


def _has_ortools() -> bool:
    import importlib.util

    return importlib.util.find_spec("ortools") is not None


def _with_memory(problem: PipelineProblem, factor: float) -> PipelineProblem:
    from dataclasses import replace

    return replace(problem, memory_per_gpu=int(problem.memory_per_gpu * factor))
