"""Exact CP-SAT model of OFF_int (integral offloading) on small chains.

The papers leave an exact model as future work (thesis conclusion; digest section 4 sketches
one). This model follows the sketch, with the memory semantics of
:mod:`optmem.simulate.offload` made exact so that decode -> simulate reproduces the optimum:

* compute ops: the store-all sequence ``F_all 1..L, Loss, B L..1``, chained intervals
  (start ``s_j``, end ``e_j = s_j + d_j``), ``s_0 = 0``;
* for each offloadable value ``k`` (``abar_k``, ``k = 0..L-1``; ``abar_0 = a^0``): a boolean
  ``off_k`` and optional intervals ``O_k`` and ``P_k`` of length ``size_k / beta`` on the link,
  all in one ``NoOverlap`` (O.1); ``O_k`` starts after ``F_all k`` ends; the release
  ``r_k >= end(O_k), e(F_all k+1)`` (O.7: the GPU copy lives until the offload is complete
  and the forward reader is done); ``P_k`` starts at or after ``r_k`` and ends before
  ``B k+1`` starts;
* memory of compute op ``j`` (O.7: the prefetch reserves from its start):
  ``peak_j - sum_k size_k h_{k,j} <= M`` where ``h_{k,j}`` may be 1 only if ``off_k``,
  ``r_k <= s_j`` and ``start(P_k) >= e_j`` (the value is on the host during the whole op);
* memory at a prefetch start that falls between compute ops (``g_{k,j}``: ``e_j <= start(P_k)
  < s_{j+1}``): ``after_j - sum_{k' != k} size_k' x_{k',k} <= M`` where ``x`` may be 1 only if
  ``off_k'``, ``r_k' <= start(P_k)`` and ``start(P_k') > start(P_k)``;
* objective: the end of ``B 1``.

Memory is not a CP-SAT reservoir/cumulative: those net simultaneous events, which would
hide the memory of zero-duration ops (the hardness gadgets have many), and the per-op rule of
the simulator (a release during an op does not help it) is not a level constraint. Times are
scaled to integers (exact when every duration is a multiple of ``1/scale``).

Build -> solve -> decode are kept apart: :func:`build_offload_cpsat`,
:func:`solve_offload_cpsat`, :func:`decode_offload_cpsat`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from optmem.chain import Chain
from optmem.plan import AnyOp, Op, offload, prefetch
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.solvers.checkpoint_baselines import store_all_plan
from optmem.solvers.offload_schedule import value_op, value_sizes

MAX_SCALE = 10**6


def time_scale(values: list[float]) -> tuple[int, bool]:
    """Smallest integer scale making every value integral (``exact`` False if none <= 1e6)."""
    scale = 1
    for v in values:
        fr = Fraction(v).limit_denominator(10**6)
        if abs(float(fr) - v) > 1e-12 * max(1.0, abs(v)):
            return 1000, False
        scale = scale * fr.denominator // math.gcd(scale, fr.denominator)
        if scale > MAX_SCALE:
            return 1000, False
    return scale, True


@dataclass
class OffloadCPSAT:
    """The built model and the handles decode needs."""

    model: Any
    scale: int
    exact: bool
    starts: list[Any]
    durations: list[int]
    off: dict[int, Any]
    o_start: dict[int, Any]
    p_start: dict[int, Any]
    ops: tuple[Op, ...]
    makespan: Any
    info: dict[str, int] = field(default_factory=dict)


def build_offload_cpsat(chain: Chain, memory: int, beta: float,
                        hint: dict[int, tuple[float, float]] | None = None) -> OffloadCPSAT:
    """Build the CP-SAT model (``chain`` discretised, ``beta`` in memory units per time)."""
    from ortools.sat.python import cp_model

    n_stages = chain.length
    ops = store_all_plan(n_stages)
    sim = simulate_checkpoint(chain, ops)
    peaks = [s.peak for s in sim.timeline]
    after = [s.after for s in sim.timeline]
    times = [s.end - s.start for s in sim.timeline]
    sizes = value_sizes(chain)
    cand = [k for k in range(n_stages) if sizes[k] > 0 and beta > 0]
    tdur = {k: sizes[k] / beta for k in cand}
    scale, exact = time_scale(times + list(tdur.values()))
    dur = [round(t * scale) if exact else math.ceil(t * scale - 1e-9) for t in times]
    tcd = {k: round(v * scale) if exact else math.ceil(v * scale - 1e-9)
           for k, v in tdur.items()}
    horizon = sum(dur) + 2 * sum(tcd.values()) + 1
    m = cp_model.CpModel()
    n = len(ops)
    s = [m.new_int_var(0, horizon, f"s{j}") for j in range(n)]
    m.add(s[0] == 0)
    for j in range(n - 1):
        m.add(s[j + 1] >= s[j] + dur[j])
    off, os_, ps_, rel, intervals = {}, {}, {}, {}, []
    for k in cand:
        off[k] = m.new_bool_var(f"off{k}")
        os_[k] = m.new_int_var(0, horizon, f"os{k}")
        ps_[k] = m.new_int_var(0, horizon, f"ps{k}")
        rel[k] = m.new_int_var(0, horizon, f"r{k}")
        intervals.append(m.new_optional_interval_var(os_[k], tcd[k], os_[k] + tcd[k], off[k],
                                                  f"O{k}"))
        intervals.append(m.new_optional_interval_var(ps_[k], tcd[k], ps_[k] + tcd[k], off[k],
                                                  f"P{k}"))
        if k >= 1:
            m.add(os_[k] >= s[k - 1] + dur[k - 1]).only_enforce_if(off[k])
        m.add(rel[k] >= os_[k] + tcd[k]).only_enforce_if(off[k])
        m.add(rel[k] >= s[k] + dur[k]).only_enforce_if(off[k])
        m.add(ps_[k] >= rel[k]).only_enforce_if(off[k])
        m.add(ps_[k] + tcd[k] <= s[2 * n_stages - k]).only_enforce_if(off[k])
    if intervals:
        m.add_no_overlap(intervals)
    # memory of each compute op
    n_bool = 0
    for j in range(n):
        terms = []
        for k in cand:
            if not k < j < 2 * n_stages - k:
                continue
            h = m.new_bool_var(f"h{k}_{j}")
            n_bool += 1
            m.add_implication(h, off[k])
            m.add(rel[k] <= s[j]).only_enforce_if(h)
            m.add(ps_[k] >= s[j] + dur[j]).only_enforce_if(h)
            terms.append(sizes[k] * h)
        if peaks[j] > memory:
            m.add(peaks[j] - sum(terms) <= memory)
    # memory at a prefetch start between compute ops
    for k in cand:
        where = []
        for j in range(n):
            g = m.new_bool_var(f"g{k}_{j}")
            where.append(g)
            m.add(ps_[k] >= s[j] + dur[j]).only_enforce_if(g)
            if j + 1 < n:
                m.add(ps_[k] < s[j + 1]).only_enforce_if(g)
            if dur[j] > 0:
                inside = m.new_bool_var(f"in{k}_{j}")
                where.append(inside)
                m.add(ps_[k] >= s[j]).only_enforce_if(inside)
                m.add(ps_[k] < s[j] + dur[j]).only_enforce_if(inside)
            if after[j] <= memory:
                continue
            terms = []
            for k2 in cand:
                if k2 == k or not (k2 <= j + 1 and k2 <= j < 2 * n_stages - k2 + 1):
                    continue
                x = m.new_bool_var(f"x{k2}_{k}_{j}")
                n_bool += 1
                m.add_implication(x, off[k2])
                m.add(rel[k2] <= ps_[k]).only_enforce_if(x)
                m.add(ps_[k2] >= ps_[k] + 1).only_enforce_if(x)
                terms.append(sizes[k2] * x)
            m.add(after[j] - sum(terms) <= memory).only_enforce_if(g)
        m.add(sum(where) == 1).only_enforce_if(off[k])
    makespan = m.new_int_var(0, horizon, "makespan")
    m.add(makespan == s[n - 1] + dur[n - 1])
    m.minimize(makespan)
    if hint:
        for k, (o_t, p_t) in hint.items():
            if k in off:
                m.add_hint(off[k], 1)
                m.add_hint(os_[k], round(o_t * scale))
                m.add_hint(ps_[k], round(p_t * scale))
    return OffloadCPSAT(m, scale, exact, s, dur, off, os_, ps_, ops, makespan,
                        {"variables": len(m.proto.variables),
                         "constraints": len(m.proto.constraints), "booleans": n_bool})


def solve_offload_cpsat(built: OffloadCPSAT, *, time_limit_s: float | None = None,
                        threads: int = 2, verbose: bool = False) -> tuple[str, Any]:
    """Solve the model and map the CP-SAT status (the one place codes are mapped).

    Returns ``(status, solver)`` with status ``optimal``, ``feasible``, ``infeasible`` or
    ``no_solution``.
    """
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_search_workers = max(1, threads)
    solver.parameters.log_search_progress = verbose
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = float(time_limit_s)
    code = solver.solve(built.model)
    mapping = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
               cp_model.INFEASIBLE: "infeasible"}
    return mapping.get(code, "no_solution"), solver


def decode_offload_cpsat(built: OffloadCPSAT, solver: Any) -> tuple[tuple[AnyOp, ...], float]:
    """Return the plan and the model's makespan in chain time units.

    Each transfer is listed after the last compute op that started no later than it.
    """
    starts = [solver.value(v) for v in built.starts]
    transfers: list[tuple[int, int, AnyOp]] = []
    for k, flag in built.off.items():
        if solver.value(flag):
            transfers.append((solver.value(built.o_start[k]), 0, offload(*value_op(k))))
            transfers.append((solver.value(built.p_start[k]), 1, prefetch(*value_op(k))))
    transfers.sort(key=lambda t: (t[0], t[1]))
    plan: list[AnyOp] = []
    ti = 0
    for j, op in enumerate(built.ops):
        plan.append(op)
        nxt = starts[j + 1] if j + 1 < len(built.ops) else math.inf
        while ti < len(transfers) and transfers[ti][0] < nxt:
            plan.append(transfers[ti][2])
            ti += 1
    return tuple(plan), solver.value(built.makespan) / built.scale
