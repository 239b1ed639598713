r"""PIPE_{S^1&A} as a CP-SAT model with interval variables (OR-Tools).

The same problem as :mod:`optmem.models.pipeline_ilp` (thesis chapter 6 with the digest's
corrections, ``madpipe.md`` 4.5), written the constraint-programming way:

* allocation: ``x[q][p]`` puts unit ``q`` on GPU ``p`` (``p <= q``: GPUs are identical, so
  units are only offered GPUs up to their index, which breaks the symmetry); ``z(q, r)``, the
  same-GPU relation of the ILP, is ``sum_p x[q][p] x[r][p]``;
* resources: every task has one *optional interval* per GPU, present iff its unit is there,
  and ``AddNoOverlap`` per GPU replaces the big-M pairs (6.5)-(6.7); every transfer has one
  optional interval per link ``{p, p'}``, present iff the cut joins ``p`` and ``p'``
  (replacing (6.8)-(6.16)); windows of length ``T`` per GPU and per link ((6.20), (6.21));
* shifts: two literals per dependency (shift >= 1, shift = 2) with enforced linear
  constraints ((6.23)-(6.30));
* memory (6.31)-(6.36): order literals ``w`` between the tasks of one GPU, stash counts
  ``sig``, buffers and (``strict``) pending data, exactly as in the ILP.

Times must be integers: durations are multiplied by a scale that makes them integral when one
exists (the model is then exact); otherwise they are rounded *up* at a fine scale (the
pattern stays valid for the true durations, and the result is only ``feasible``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from optmem.models.pipeline_common import Units, decode_plan
from optmem.pipeline_plan import PipelinePlan

Task = tuple[str, int]
_SCALES = (1, 2, 4, 5, 8, 10, 20, 25, 40, 50, 100, 1000, 10_000, 100_000, 1_000_000)


@dataclass
class PipelineCpModel:
    """A built CP-SAT model and the handles the decoder needs."""

    units: Units
    model: Any
    period: Any
    tau: dict[Task, Any]
    assign: list[list[Any]]
    scale: float
    rounded: bool
    variables: list[Any] = field(default_factory=list)
    size: dict[str, int] = field(default_factory=dict)


def time_scale(values: Sequence[float]) -> tuple[float, bool]:
    """A scale making every value integral (``(scale, False)``), else a rounding scale.

    A non-zero value must not round to 0 ticks (times of 1e-9 would otherwise all count as
    integral at scale 1, and a period of 0 follows).

    Examples
    --------
    >>> time_scale([0.25, 1.5]), time_scale([1e-9, 2e-9])
    ((4.0, False), (100000000000000, True))
    """
    total = sum(values) or 1.0
    for s in _SCALES:
        if total * s > 1e9:
            break
        if all(abs(v * s - round(v * s)) <= 1e-9 * max(1.0, v * s) and (v == 0 or round(v * s))
               for v in values):
            return float(s), False
    return 10 ** max(0, math.ceil(math.log10(1e5 / total))), True


def build_pipeline_cpsat(
    units: Units, n_gpus: int, memory: int, *, strict: bool = False,
    gpu: Sequence[int] | None = None, upper_bound: float | None = None,
    lower_bound: float = 0.0,
) -> PipelineCpModel:
    """Build the CP-SAT model (parameters as :func:`~.pipeline_ilp.build_pipeline_ilp`)."""
    from ortools.sat.python import cp_model

    n = units.n
    scale, rounded = time_scale([*units.f, *units.b, *units.dt])

    def ticks(v: float) -> int:
        return math.ceil(v * scale - 1e-9)

    f = [ticks(v) for v in units.f]
    b = [ticks(v) for v in units.b]
    dt = [ticks(v) for v in units.dt]
    big = sum(f) + sum(b) + 2 * sum(dt) or 1
    m = cp_model.CpModel()
    lo = min(big, max(0, math.floor(lower_bound * scale - 1e-6)))
    hi = big if upper_bound is None else min(big, ticks(upper_bound * (1 + 1e-9)) + 0)
    hi = max(hi, lo)
    period = m.new_int_var(lo, hi, "T")
    m.minimize(period)
    gpus = range(n_gpus)
    # ---- allocation
    assign: list[list[Any]] = []
    for q in range(n):
        row: list[Any] = []
        for p in gpus:
            if gpu is not None:
                row.append(1 if gpu[q] == p else 0)
            elif p <= q:
                row.append(m.new_bool_var(f"x_{q}_{p}"))
            else:
                row.append(0)
        assign.append(row)
        if gpu is None:
            m.add_exactly_one([v for v in row if not isinstance(v, int)])
    if gpu is not None and max(gpu) >= n_gpus:
        raise ValueError("the fixed allocation names a GPU beyond n_gpus")

    def both(u: Any, v: Any, name: str) -> Any:
        if isinstance(u, int) and isinstance(v, int):
            return u * v
        if isinstance(u, int):
            return v if u else 0
        if isinstance(v, int):
            return u if v else 0
        y = m.new_bool_var(name)
        m.add_bool_and([u, v]).only_enforce_if(y)
        m.add_bool_or([u.negated(), v.negated()]).only_enforce_if(y.negated())
        return y

    ztab: dict[tuple[int, int], Any] = {}
    for q, r in itertools.combinations(range(n), 2):
        terms = [both(assign[q][p], assign[r][p], f"y_{q}_{r}_{p}") for p in gpus]
        consts = sum(t for t in terms if isinstance(t, int))
        lits = [t for t in terms if not isinstance(t, int)]
        if not lits:
            ztab[(q, r)] = consts
        else:
            zv = m.new_bool_var(f"z_{q}_{r}")
            m.add(zv == sum(lits) + consts)
            ztab[(q, r)] = zv

    def z(q: int, r: int) -> Any:
        return 1 if q == r else ztab[(min(q, r), max(q, r))]

    def lit(v: Any) -> Any:
        """A literal usable in OnlyEnforceIf (constants become true/false)."""
        return m.new_constant(int(v)) if isinstance(v, int) else v

    # ---- tasks on GPUs
    tasks: list[Task] = [("F", q) for q in range(n)] + [("B", q) for q in range(n - 1, -1, -1)]
    dur = {("F", q): f[q] for q in range(n)} | {("B", q): b[q] for q in range(n)}
    tau: dict[Task, Any] = {}
    for t in tasks:
        tau[t] = m.new_int_var(-big, big, f"tau_{t[0]}{t[1]}")
        m.add(tau[t] + dur[t] >= 0)
        m.add(tau[t] + dur[t] <= period)
    m.add(tau[("F", 0)] == 0)
    for p in gpus:
        window = m.new_int_var(-big, big, f"win_{p}")
        intervals = []
        for t in tasks:
            pres = assign[t[1]][p]
            if isinstance(pres, int) and pres == 0:
                continue
            intervals.append(m.new_optional_fixed_size_interval_var(
                tau[t], dur[t], lit(pres), f"iv_{t[0]}{t[1]}_{p}"))
            m.add(tau[t] >= window).only_enforce_if(lit(pres))
            m.add(tau[t] + dur[t] <= window + period).only_enforce_if(lit(pres))
        m.add_no_overlap(intervals)
    wtab: dict[tuple[Task, Task], Any] = {}
    for t, u in itertools.combinations(tasks, 2):
        same = z(t[1], u[1])
        if isinstance(same, int) and same == 0:
            wtab[(t, u)] = 0
            continue
        w = m.new_bool_var(f"w_{t[0]}{t[1]}_{u[0]}{u[1]}")
        wtab[(t, u)] = w
        m.add(w <= same)
        m.add(tau[u] >= tau[t] + dur[t]).only_enforce_if(w)
        wb = m.new_bool_var(f"w_{u[0]}{u[1]}_{t[0]}{t[1]}")
        m.add(w + wb == same)
        m.add(tau[t] >= tau[u] + dur[u]).only_enforce_if(wb)
        wtab[(u, t)] = wb

    def prec(t: Task, u: Task) -> Any:
        return 0 if t == u else wtab.get((t, u), 0)

    # ---- transfers and links
    end: dict[Task, Any] = {t: tau[t] + dur[t] for t in tasks}
    for c in range(n - 1):
        for kind in ("S", "G"):
            key = (kind, c)
            tau[key] = m.new_int_var(-big, big, f"tau_{kind}{c}")
            end[key] = tau[key] + dt[c] * (1 - z(c, c + 1))
            m.add(end[key] >= 0)
            m.add(end[key] <= period)
    if any(dt):
        for p, pp in itertools.combinations(gpus, 2):
            window = m.new_int_var(-big, big, f"lwin_{p}_{pp}")
            intervals = []
            for c in range(n - 1):
                if dt[c] == 0:
                    continue
                e1 = both(assign[c][p], assign[c + 1][pp], f"e1_{c}_{p}_{pp}")
                e2 = both(assign[c][pp], assign[c + 1][p], f"e2_{c}_{p}_{pp}")
                if isinstance(e1, int) and isinstance(e2, int):
                    if e1 + e2 == 0:
                        continue
                    on: Any = m.new_constant(1)
                else:
                    on = m.new_bool_var(f"on_{c}_{p}_{pp}")
                    m.add(on == e1 + e2)
                for kind in ("S", "G"):
                    key = (kind, c)
                    intervals.append(m.new_optional_fixed_size_interval_var(
                        tau[key], dt[c], on, f"liv_{kind}{c}_{p}_{pp}"))
                    m.add(tau[key] >= window).only_enforce_if(on)
                    m.add(tau[key] + dt[c] <= window + period).only_enforce_if(on)
            m.add_no_overlap(intervals)
    # ---- shifts
    nodes: list[Task] = []
    for q in range(n):
        nodes.append(("F", q))
        if q < n - 1:
            nodes.append(("S", q))
    for q in range(n - 1, -1, -1):
        nodes.append(("B", q))
        if q > 0:
            nodes.append(("G", q - 1))
    shift: list[Any] = []
    for k, (x, y) in enumerate(itertools.pairwise(nodes)):
        v1, v2 = m.new_bool_var(f"v1_{k}"), m.new_bool_var(f"v2_{k}")
        m.add_implication(v2, v1)
        m.add(tau[y] >= end[x]).only_enforce_if(v1.negated())
        m.add(tau[y] + period >= end[x]).only_enforce_if(v2.negated())
        m.add(tau[y] + 2 * period >= end[x])
        shift.append(v1 + v2)
    pos = {t: k for k, t in enumerate(nodes)}
    sigma = [sum(shift[pos[("F", q)]:pos[("B", q)]]) for q in range(n)]
    # ---- memory
    sig: dict[tuple[int, int], Any] = {}
    for r in range(n):
        for q in range(n):
            if q == r:
                sig[(r, q)] = sigma[q]
                continue
            same = z(q, r)
            if isinstance(same, int) and same == 0:
                continue
            s = m.new_int_var(0, 2 * len(shift), f"sig_{r}_{q}")
            m.add(s >= sigma[q]).only_enforce_if(lit(same))
            sig[(r, q)] = s
    bufs: dict[int, list[Any]] = {r: [] for r in range(n)}
    for r in range(n):
        for c in range(n - 1):
            if units.buf[c] == 0:
                continue
            u, v = z(r, c), z(r, c + 1)
            if isinstance(u, int) and isinstance(v, int):
                if u != v:
                    bufs[r].append(units.buf[c])
                continue
            bv = m.new_bool_var(f"buf_{r}_{c}")
            m.add(bv >= u - v)
            m.add(bv >= v - u)
            bufs[r].append(units.buf[c] * bv)
    direct = []
    if strict:
        for q in range(n - 1):
            if units.a_out[q]:
                direct.append((("F", q), ("F", q + 1), units.a_out[q]))
                direct.append((("B", q + 1), ("B", q), units.a_out[q]))
        if units.a_out[n - 1]:
            direct.append((("F", n - 1), ("B", n - 1), units.a_out[n - 1]))
    for t in tasks:
        r = t[1]
        expr: list[Any] = [sum(units.w[q] * z(q, r) for q in range(n))] + bufs[r]
        for q in range(n):
            if (r, q) in sig:
                expr.append(units.x[q] * (sig[(r, q)] + prec(("F", q), t) - prec(("B", q), t)))
        if not strict and t[0] == "F":
            expr.append(units.x[r])
        if strict:
            expr.append(units.a_in[r] + units.a_out[r])
            for k, (x, y, size) in enumerate(direct):
                if t in (x, y):
                    continue
                if isinstance(z(x[1], r), int) and z(x[1], r) == 0:
                    continue
                o = m.new_bool_var(f"o_{t[0]}{t[1]}_{k}")
                m.add(o >= prec(x, t) + prec(t, y) + prec(y, x) - 1)
                expr.append(size * o)
        m.add(sum(expr) <= memory)
    proto = m.proto
    model_size = {"variables": len(proto.variables), "constraints": len(proto.constraints)}
    return PipelineCpModel(units, m, period, tau, assign, scale, rounded, [], model_size)


def solve_pipeline_cpsat(built: PipelineCpModel, **settings: Any) -> Any:
    """Solve with the CP-SAT adapter of :mod:`optmem.solvers.engines`.

    ``settings`` are :func:`~optmem.solvers.engines.solve_cpsat`'s (``time_limit_s``,
    ``deterministic_time``, ``threads``, ``seed``, ``verbose``).
    """
    from optmem.solvers.engines import solve_cpsat

    handles = [built.period, *built.tau.values()]
    assign = [v for row in built.assign for v in row if not isinstance(v, int)]
    res = solve_cpsat(built.model, handles + assign, **settings)
    built.variables = handles + assign
    info = {"scale": built.scale, "rounded": built.rounded, "scaled": built.scale != 1}
    objective = res.objective / built.scale if math.isfinite(res.objective) else res.objective
    bound = res.bound / built.scale if math.isfinite(res.bound) and not built.rounded \
        else math.nan
    return replace(res, objective=objective, bound=bound, info=info)


def decode_pipeline_cpsat(built: PipelineCpModel, values: Sequence[float]) -> PipelinePlan:
    """Turn a solution (values of ``built.variables``) into a plan."""
    val = {id(v): x for v, x in zip(built.variables, values, strict=True)}
    units = built.units
    n = units.n
    gpu = []
    for q in range(n):
        for p, v in enumerate(built.assign[q]):
            on = v if isinstance(v, int) else val[id(v)]
            if on > 0.5:
                gpu.append(p)
                break
    s = built.scale
    tau = {k: val[id(v)] / s for k, v in built.tau.items()}
    return decode_plan(
        units, gpu, val[id(built.period)] / s,
        [tau[("F", q)] for q in range(n)], [tau[("B", q)] for q in range(n)],
        {c: tau[("S", c)] for c in range(n - 1)}, {c: tau[("G", c)] for c in range(n - 1)},
    )
