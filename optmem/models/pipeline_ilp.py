r"""The chapter 6 ILP for PIPE_{S^1&A}: allocation and 1-periodic pattern at once (PuLP).

Thesis chapter 6 (digest ``madpipe.md`` section 4) with the digest's corrections (4.5):

1. transitivity of "same GPU" in all three orientations of every triple (eq. 6.1 covers one);
2. transfer durations count only between different GPUs: ``D_c = dt_c (1 - z_{c,c+1})``
   in (6.14)-(6.18), (6.21), (6.23)-(6.30);
3. ``w_{t,t'} + w_{t',t} = z`` for the order of two tasks on one GPU (same for links);
4. index ranges as the digest fixes them.

Reformulations (equivalent, smaller):

* ``z`` is indexed by *units* (layers, or MadPipe stages) instead of tasks: (6.4) puts
  ``F_q`` and ``B_q`` on one GPU, so ``z`` over tasks is ``z`` over units.
* Link sharing (6.8)-(6.13) is written per pair of cuts; the forward and backward transfers
  of one cut always share their link.
* Shifts use the lower-side constraints only ((6.24), (6.26), (6.28), (6.30)): larger shifts
  are valid but cost memory, so optimal solutions take the smallest; the decoder recomputes
  the smallest shifts from the times anyway. Each dependency crosses at most two periods.
* The memory of the running task's own stash (``stash`` model, forward tasks) and the
  chapter 6 transients (``strict`` model: the task's input and output, eq. 6.36 ``M^(ACT)``,
  and ``M^(DIR)`` eq. 6.22) follow :mod:`optmem.problems.pipeline`.

Variables (units ``q, r``; tasks ``t``: ``F_q``, ``B_q``; cuts ``c`` after unit ``c``)
-------------------------------------------------------------------------------------
``T`` period; ``tau_t`` task starts (6.17); ``z_{q,r}`` same GPU; ``first_q`` (6.2);
``w_{t,t'}`` order on a GPU (6.5)-(6.7); ``tau~`` transfer starts; ``zl_{c,c'}`` shared link
(6.8)-(6.13); ``wl`` order on a link (6.14)-(6.16); ``v1, v2`` shift of a dependency >= 1,
= 2 ((6.23)-(6.30)); ``sig_{r,q}`` stashes of unit ``q`` counted on unit ``r``'s GPU
(6.31)-(6.32); ``buf_{r,c}`` buffers (6.34)-(6.35); ``o_{t,d}`` pending data (6.22).
Objective: minimise ``T``; memory (6.36) at the start of every task.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from optmem.models.pipeline_common import Units, decode_plan
from optmem.pipeline_plan import PipelinePlan
from optmem.result import Status

Task = tuple[str, int]  # ("F"|"B"|"S"|"G", unit/cut)


@dataclass
class PipelineModel:
    """A built model: the engine object and the handles the decoder needs."""

    units: Units
    memory: int
    strict: bool
    model: Any
    period: Any
    tau: dict[Task, Any]
    ztab: dict[tuple[int, int], Any]
    variables: list[Any] = field(default_factory=list)
    size: dict[str, int] = field(default_factory=dict)


def _dependency_nodes(units: Units) -> list[Task]:
    """Tasks along one micro-batch: F_0, S_0, F_1, ..., F_{n-1}, B_{n-1}, G_{n-2}, ..., B_0."""
    n = units.n
    order: list[Task] = []
    for q in range(n):
        order.append(("F", q))
        if q < n - 1:
            order.append(("S", q))
    for q in range(n - 1, -1, -1):
        order.append(("B", q))
        if q > 0:
            order.append(("G", q - 1))
    return order


def build_pipeline_ilp(
    units: Units, n_gpus: int, memory: int, *, strict: bool = False,
    gpu: Sequence[int] | None = None, upper_bound: float | None = None,
    lower_bound: float = 0.0,
) -> PipelineModel:
    """Build the corrected chapter 6 ILP.

    Parameters
    ----------
    units
        What to place (layers, or the stages of a fixed partitioning).
    n_gpus, memory
        ``P`` and ``M``.
    strict
        Memory model ``strict`` (ch. 6 eq. 6.36) instead of ``stash``.
    gpu
        Fix the allocation (MadPipe phase 2 with a fixed assignment): GPU label per unit.
    upper_bound, lower_bound
        Known bounds on the optimal period (a valid incumbent's period; loads).
    """
    import pulp

    n = units.n
    big = units.big_m()
    mdl = pulp.LpProblem("pipeline", pulp.LpMinimize)
    period = pulp.LpVariable("T", lowBound=max(0.0, lower_bound), upBound=big)
    if upper_bound is not None:
        period.upBound = min(big, upper_bound * (1 + 1e-9))
    allvars: list[Any] = [period]
    mdl += period

    def binvar(name: str) -> Any:
        v = pulp.LpVariable(name, cat="Binary")
        allvars.append(v)
        return v

    # ---- same-GPU relation over units (6.1)-(6.4)
    ztab: dict[tuple[int, int], Any] = {}

    def z(q: int, r: int) -> Any:
        if q == r:
            return 1
        return ztab[(min(q, r), max(q, r))]

    for q, r in itertools.combinations(range(n), 2):
        if gpu is not None:
            ztab[(q, r)] = 1 if gpu[q] == gpu[r] else 0
        else:
            ztab[(q, r)] = binvar(f"z_{q}_{r}")
    if gpu is None:
        for q, r, s in itertools.combinations(range(n), 3):
            mdl += z(q, s) >= z(q, r) + z(r, s) - 1
            mdl += z(q, r) >= z(q, s) + z(r, s) - 1
            mdl += z(r, s) >= z(q, r) + z(q, s) - 1
        first = [binvar(f"first_{q}") for q in range(n)]
        for q in range(n):
            mdl += first[q] >= 1 - pulp.lpSum(z(r, q) for r in range(q))
        mdl += pulp.lpSum(first) <= n_gpus
    elif len(set(gpu)) > n_gpus:
        raise ValueError(f"the fixed allocation uses {len(set(gpu))} GPUs > {n_gpus}")

    # ---- tasks (6.5)-(6.7), (6.17), (6.19), (6.20)
    tasks: list[Task] = [("F", q) for q in range(n)] + [("B", q) for q in range(n - 1, -1, -1)]
    dur = {("F", q): units.f[q] for q in range(n)} | {("B", q): units.b[q] for q in range(n)}
    tau: dict[Task, Any] = {}
    for t in tasks:
        tau[t] = pulp.LpVariable(f"tau_{t[0]}{t[1]}", lowBound=-big, upBound=big)
        allvars.append(tau[t])
        mdl += tau[t] + dur[t] >= 0
        mdl += tau[t] + dur[t] <= period
    mdl += tau[("F", 0)] == 0
    wtab: dict[tuple[Task, Task], Any] = {}

    def prec(t: Task, u: Task) -> Any:
        """1 iff ``t`` runs before ``u`` in the window of their common GPU."""
        if t == u:
            return 0
        if (t, u) in wtab:
            return wtab[(t, u)]
        return z(t[1], u[1]) - wtab[(u, t)]

    for t, u in itertools.combinations(tasks, 2):
        same = z(t[1], u[1])
        if isinstance(same, int) and same == 0:
            wtab[(t, u)] = 0
            continue
        w = binvar(f"w_{t[0]}{t[1]}_{u[0]}{u[1]}")
        wtab[(t, u)] = w
        if not isinstance(same, int):
            mdl += w <= same
        mdl += tau[u] - tau[t] - dur[t] >= -2 * big * (1 - w)
        mdl += tau[t] - tau[u] - dur[u] >= -2 * big * (1 - same + w)
        mdl += period >= tau[t] + dur[t] - tau[u] - 2 * big * (1 - same)
        mdl += period >= tau[u] + dur[u] - tau[t] - 2 * big * (1 - same)

    # ---- transfers and links (6.8)-(6.16), (6.18), (6.21)
    def cut(c: int) -> Any:
        return 1 - z(c, c + 1)

    tdur: dict[Task, Any] = {}
    for c in range(n - 1):
        for kind in ("S", "G"):
            tau[(kind, c)] = pulp.LpVariable(f"tau_{kind}{c}", lowBound=-big, upBound=big)
            allvars.append(tau[(kind, c)])
            tdur[(kind, c)] = units.dt[c] * cut(c)
            mdl += tau[(kind, c)] + tdur[(kind, c)] >= 0
            mdl += tau[(kind, c)] + tdur[(kind, c)] <= period
    if units.comm:
        timed = [c for c in range(n - 1) if units.dt[c] > 0]
        zl: dict[tuple[int, int], Any] = {}
        for c, d in itertools.combinations(timed, 2):
            v = binvar(f"zl_{c}_{d}")
            zl[(c, d)] = v
            mdl += v >= z(c, d) + z(c + 1, d + 1) - z(c, c + 1) - 1
            mdl += v >= z(c, d + 1) + z(c + 1, d) - z(c, c + 1) - 1
            mdl += v <= cut(c)
            mdl += v <= cut(d)
            mdl += v <= z(c, d) + z(c + 1, d)
            mdl += v <= z(c, d + 1) + z(c + 1, d + 1)
        transfers = [(k, c) for c in timed for k in ("S", "G")]
        for t, u in itertools.combinations(transfers, 2):
            same = cut(t[1]) if t[1] == u[1] else zl[(min(t[1], u[1]), max(t[1], u[1]))]
            if isinstance(same, int) and same == 0:
                continue
            w = binvar(f"wl_{t[0]}{t[1]}_{u[0]}{u[1]}")
            mdl += w <= same
            dt_t, dt_u = units.dt[t[1]], units.dt[u[1]]
            mdl += tau[u] - tau[t] - dt_t >= -2 * big * (1 - w)
            mdl += tau[t] - tau[u] - dt_u >= -2 * big * (1 - same + w)
            mdl += period >= tau[t] + dt_t - tau[u] - 2 * big * (1 - same)
            mdl += period >= tau[u] + dt_u - tau[t] - 2 * big * (1 - same)

    # ---- shifts along the dependencies (6.23)-(6.30), lower sides
    nodes = _dependency_nodes(units)

    def dur_of(t: Task) -> Any:
        return dur[t] if t[0] in ("F", "B") else tdur[t]

    shift: list[Any] = []
    for k, (x, y) in enumerate(itertools.pairwise(nodes)):
        v1, v2 = binvar(f"v1_{k}"), binvar(f"v2_{k}")
        mdl += v2 <= v1
        mdl += tau[y] - tau[x] - dur_of(x) + 2 * big * v1 >= 0
        mdl += tau[y] + period - tau[x] - dur_of(x) + 2 * big * v2 >= 0
        shift.append(v1 + v2)
    pos = {t: k for k, t in enumerate(nodes)}
    sigma = [pulp.lpSum(shift[pos[("F", q)]:pos[("B", q)]]) for q in range(n)]
    max_sigma = 2 * len(shift)

    # ---- memory (6.31)-(6.36)
    sig: dict[tuple[int, int], Any] = {}
    for r in range(n):
        for q in range(n):
            if q == r:
                sig[(r, q)] = sigma[q]
                continue
            same = z(q, r)
            if isinstance(same, int) and same == 0:
                continue
            s = pulp.LpVariable(f"sig_{r}_{q}", lowBound=0)
            allvars.append(s)
            mdl += s >= sigma[q] - max_sigma * (1 - same)
            sig[(r, q)] = s
    bufs: dict[int, list[Any]] = {r: [] for r in range(n)}
    for r in range(n):
        for c in range(n - 1):
            if units.buf[c] == 0:
                continue
            a, b = z(r, c), z(r, c + 1)
            if isinstance(a, int) and isinstance(b, int):
                if a != b:
                    bufs[r].append(units.buf[c])
                continue
            bv = pulp.LpVariable(f"buf_{r}_{c}", lowBound=0, upBound=1)
            allvars.append(bv)
            mdl += bv >= a - b
            mdl += bv >= b - a
            bufs[r].append(units.buf[c] * bv)
    # data waiting on the same GPU (strict): producer, consumer, size
    direct = []
    if strict:
        for q in range(n - 1):
            if units.a_out[q]:
                direct.append((("F", q), ("F", q + 1), units.a_out[q]))
                direct.append((("B", q + 1), ("B", q), units.a_out[q]))
        if units.a_out[n - 1]:
            direct.append((("F", n - 1), ("B", n - 1), units.a_out[n - 1]))
    n_mem = 0
    for t in tasks:
        r = t[1]
        expr = [pulp.lpSum(units.w[q] * z(q, r) for q in range(n))] + bufs[r]
        for q in range(n):
            if (r, q) not in sig:
                continue
            expr.append(units.x[q] * (sig[(r, q)] + prec(("F", q), t) - prec(("B", q), t)))
        if not strict and t[0] == "F":
            expr.append(units.x[r])
        if strict:
            if t[0] == "F":
                expr.append(units.a_in[r] + units.a_out[r])
            else:
                expr.append(units.a_out[r] + units.a_in[r])
            for k, (x, y, size) in enumerate(direct):
                if t in (x, y):
                    continue
                same = z(x[1], r)
                if isinstance(same, int) and same == 0:
                    continue
                o = pulp.LpVariable(f"o_{t[0]}{t[1]}_{k}", lowBound=0, upBound=1)
                allvars.append(o)
                mdl += o >= prec(x, t) + prec(t, y) + prec(y, x) - 1
                expr.append(size * o)
        mdl += pulp.lpSum(expr) <= memory
        n_mem += 1
    model_size = {"variables": len(mdl.variables()), "constraints": len(mdl.constraints),
                  "binaries": sum(1 for v in mdl.variables() if v.cat == "Integer")}
    return PipelineModel(units, memory, strict, mdl, period, tau, ztab, allvars, model_size)


def solve_pipeline_ilp(built: PipelineModel, *, engine: str = "highs", **settings: Any) -> Any:
    """Solve with an engine adapter of :mod:`optmem.solvers.engines` (HiGHS, CBC, Gurobi).

    ``settings`` are :func:`~optmem.solvers.engines.solve_pulp`'s (``time_limit_s``,
    ``node_limit``, ``threads``, ``seed``, ``verbose``).
    """
    from dataclasses import replace

    from optmem.solvers.engines import solve_pulp

    # No warm start: the adapter's setInitialValue(None) rejects bounded variables, so the
    # variables are read back here instead of through the adapter.
    res = solve_pulp(built.model, [], engine, **settings)
    if res.status.has_plan:
        values = [float(v.varValue) if v.varValue is not None else 0.0
                  for v in built.variables]
        threads = int(settings.get("threads", 2))
        res = replace(res, values=_polish(built, values, engine, threads) or values)
    return res


def _polish(built: PipelineModel, values: list[float], engine: str, threads: int
            ) -> list[float] | None:
    """Re-solve the LP with every binary fixed to its rounded value.

    MIP engines accept binaries within an integrality tolerance, which the big-M constraints
    multiply into time errors of about ``1e-6 K``: enough to shift a task by a period in the
    decoder. With the binaries fixed the LP's vertex is exact up to the LP tolerance.
    """
    import pulp

    from optmem.solvers.engines import solve_pulp

    saved = []
    for v in built.model.variables():
        if v.cat == pulp.LpInteger:
            x = round(v.varValue or 0.0)
            saved.append((v, v.lowBound, v.upBound))
            v.cat = pulp.LpContinuous
            v.lowBound = v.upBound = x
    try:
        res = solve_pulp(built.model, [], engine, threads=threads)  # an LP: no limit needed
        if res.status is not Status.OPTIMAL:
            return None
        return [float(v.varValue) if v.varValue is not None else 0.0 for v in built.variables]
    finally:
        for v, lo, hi in saved:
            v.cat = pulp.LpInteger
            v.lowBound, v.upBound = lo, hi


def decode_pipeline_ilp(built: PipelineModel, values: Sequence[float]) -> PipelinePlan:
    """Turn a solution (values in ``built.variables`` order) into a plan."""
    val = {id(v): x for v, x in zip(built.variables, values, strict=True)}
    units = built.units
    n = units.n

    def get(v: Any) -> float:
        return float(v) if isinstance(v, int | float) else float(val[id(v)])

    gpu = list(range(n))
    for q in range(n):
        for r in range(q):
            if get(built.ztab[(r, q)]) > 0.5:
                gpu[q] = gpu[r]
                break
    period = get(built.period)
    tau = built.tau
    return decode_plan(
        units, gpu, period,
        [get(tau[("F", q)]) for q in range(n)], [get(tau[("B", q)]) for q in range(n)],
        {c: get(tau[("S", c)]) for c in range(n - 1)},
        {c: get(tau[("G", c)]) for c in range(n - 1)},
    )


def period_value(built: PipelineModel, values: Sequence[float]) -> float:
    """The period of a solution."""
    for v, x in zip(built.variables, values, strict=True):
        if v is built.period:
            return float(x)
    return math.nan
