"""Exact CP-SAT model of the transfers of a combined (remat + offload) plan.

Thesis chapter 4 leaves no exact model; this one is "POET-like" (choose, per stored value,
whether it leaves the GPU between two of its uses) but with the transfers overlapped with
compute on one link and the makespan as objective. It generalises the OFF_int model of
:mod:`optmem.models.offload_cpsat` (same memory semantics as
:mod:`optmem.simulate.offload`, O.1-O.7) from the store-all sequence to *any* compute
sequence and its windows (:class:`optmem.solvers.remat_offload_schedule.Window`):

* compute ops in plan order: chained intervals ``s_j``, ``e_j = s_j + d_j``, ``s_0 = 0``;
* per window ``w`` a boolean ``off_w`` and optional link intervals ``O_w``, ``P_w`` of length
  ``size / beta`` in one ``NoOverlap`` (O.1); ``O_w`` starts after the op producing the
  value ends; the release ``r_w >= end(O_w), e(last reader)`` (O.7); ``P_w`` starts at or
  after ``r_w`` and ends before the consumer starts; two windows of one value are used in
  order (the second offload starts after the first prefetch);
* memory of compute op ``j``: ``peak_j - sum_w size_w h_{w,j} <= M`` with ``h_{w,j} = 1``
  only if ``off_w``, ``r_w <= s_j`` and ``start(P_w) >= e_j``;
* memory at a prefetch start between two compute ops: ``after_j - sum_{w' != w} size_w'
  x_{w',w,j} <= M`` (``x`` = 1 only if ``w'`` is on the host at that instant);
* objective: the end of the last op.

The combined optimum over compute sequences is the minimum of this model over the sequences
enumerated by :mod:`optmem.solvers.remat_offload_exact`. Build -> solve -> decode are kept
apart: :func:`build_transfer_cpsat`, :func:`solve_transfer_cpsat`,
:func:`decode_transfer_cpsat`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optmem.chain import Chain
from optmem.models.offload_cpsat import time_scale
from optmem.plan import AnyOp, Op, offload, prefetch
from optmem.simulate.checkpoint import simulate_checkpoint, value_size
from optmem.solvers.remat_offload_schedule import Window

if TYPE_CHECKING:
    from optmem.solvers.engines import EngineResult


@dataclass
class TransferCPSAT:
    """The built model and the handles decode needs."""

    model: Any
    scale: int
    exact: bool
    starts: list[Any]
    durations: list[int]
    windows: list[Window]
    off: list[Any]
    o_start: list[Any]
    p_start: list[Any]
    ops: tuple[Op, ...]
    makespan: Any
    info: dict[str, int] = field(default_factory=dict)


def build_transfer_cpsat(chain: Chain, memory: int, beta: float, ops: Sequence[Op],
                         windows: Sequence[Window]) -> TransferCPSAT:
    """Build the model for compute sequence ``ops`` (``chain`` discretised)."""
    from ortools.sat.python import cp_model

    ops = tuple(ops)
    sim = simulate_checkpoint(chain, ops)
    peaks = [s.peak for s in sim.timeline]
    after = [s.after for s in sim.timeline]
    times = [s.end - s.start for s in sim.timeline]
    wins = [w for w in windows if beta > 0 and value_size(chain, w.value) > 0]
    sizes = [value_size(chain, w.value) for w in wins]
    tdur = [z / beta for z in sizes]
    scale, exact = time_scale(times + tdur)
    dur = [round(t * scale) if exact else math.ceil(t * scale - 1e-9) for t in times]
    tcd = [round(v * scale) if exact else math.ceil(v * scale - 1e-9) for v in tdur]
    horizon = sum(dur) + 2 * sum(tcd) + 1
    m = cp_model.CpModel()
    n = len(ops)
    s = [m.new_int_var(0, horizon, f"s{j}") for j in range(n)]
    m.add(s[0] == 0)
    for j in range(n - 1):
        m.add(s[j + 1] >= s[j] + dur[j])
    off, os_, ps_, rel, intervals = [], [], [], [], []
    for i, w in enumerate(wins):
        off.append(m.new_bool_var(f"off{i}"))
        os_.append(m.new_int_var(0, horizon, f"os{i}"))
        ps_.append(m.new_int_var(0, horizon, f"ps{i}"))
        rel.append(m.new_int_var(0, horizon, f"r{i}"))
        intervals.append(m.new_optional_interval_var(os_[i], tcd[i], os_[i] + tcd[i], off[i],
                                                     f"O{i}"))
        intervals.append(m.new_optional_interval_var(ps_[i], tcd[i], ps_[i] + tcd[i], off[i],
                                                     f"P{i}"))
        if w.first >= 1:  # produced by op first - 1
            m.add(os_[i] >= s[w.first - 1] + dur[w.first - 1]).only_enforce_if(off[i])
        m.add(rel[i] >= os_[i] + tcd[i]).only_enforce_if(off[i])
        m.add(rel[i] >= s[w.last] + dur[w.last]).only_enforce_if(off[i])
        m.add(ps_[i] >= rel[i]).only_enforce_if(off[i])
        m.add(ps_[i] + tcd[i] <= s[w.consumer]).only_enforce_if(off[i])
    if intervals:
        m.add_no_overlap(intervals)
    for i1, w1 in enumerate(wins):  # a value is back before it leaves again
        for i2, w2 in enumerate(wins):
            if w1.value == w2.value and w1.consumer <= w2.last:
                m.add(os_[i2] >= ps_[i1] + tcd[i1]).only_enforce_if([off[i1], off[i2]])
    n_bool = 0
    for j in range(n):
        terms = []
        for i, w in enumerate(wins):
            if not w.last < j < w.consumer:
                continue
            h = m.new_bool_var(f"h{i}_{j}")
            n_bool += 1
            m.add_implication(h, off[i])
            m.add(rel[i] <= s[j]).only_enforce_if(h)
            m.add(ps_[i] >= s[j] + dur[j]).only_enforce_if(h)
            terms.append(sizes[i] * h)
        if peaks[j] > memory:
            m.add(peaks[j] - sum(terms) <= memory)
    for i in range(len(wins)):
        where = []
        for j in range(n):
            g = m.new_bool_var(f"g{i}_{j}")
            where.append(g)
            m.add(ps_[i] >= s[j] + dur[j]).only_enforce_if(g)
            if j + 1 < n:
                m.add(ps_[i] < s[j + 1]).only_enforce_if(g)
            if dur[j] > 0:
                inside = m.new_bool_var(f"in{i}_{j}")
                where.append(inside)
                m.add(ps_[i] >= s[j]).only_enforce_if(inside)
                m.add(ps_[i] < s[j] + dur[j]).only_enforce_if(inside)
            if after[j] <= memory:
                continue
            terms = []
            for i2, w2 in enumerate(wins):
                if i2 == i or not w2.last <= j < w2.consumer:
                    continue
                x = m.new_bool_var(f"x{i2}_{i}_{j}")
                n_bool += 1
                m.add_implication(x, off[i2])
                m.add(rel[i2] <= ps_[i]).only_enforce_if(x)
                m.add(ps_[i2] >= ps_[i] + 1).only_enforce_if(x)
                terms.append(sizes[i2] * x)
            m.add(after[j] - sum(terms) <= memory).only_enforce_if(g)
        m.add(sum(where) == 1).only_enforce_if(off[i])
    makespan = m.new_int_var(0, horizon, "makespan")
    m.add(makespan == s[n - 1] + dur[n - 1])
    m.minimize(makespan)
    return TransferCPSAT(m, scale, exact, s, dur, wins, off, os_, ps_, ops, makespan,
                         {"variables": len(m.proto.variables),
                          "constraints": len(m.proto.constraints), "booleans": n_bool})


def transfer_variables(built: TransferCPSAT) -> list[Any]:
    """The variables :func:`decode_transfer_cpsat` reads, in the order of its ``values``."""
    return [*built.starts, *built.off, *built.o_start, *built.p_start, built.makespan]


def solve_transfer_cpsat(built: TransferCPSAT, **settings: Any) -> EngineResult:
    """Solve the model with the CP-SAT adapter (:func:`optmem.solvers.engines.solve_cpsat`).

    ``settings`` are the adapter's (``time_limit_s``, ``threads``, ``deterministic_time``,
    ``seed``, ``verbose``; :func:`~optmem.solvers.engines.cpsat_settings`). Values follow
    :func:`transfer_variables`; ``objective`` and ``bound`` are in scaled integer time.
    """
    from optmem.solvers.engines import solve_cpsat

    return solve_cpsat(built.model, transfer_variables(built), **settings)


def decode_transfer_cpsat(built: TransferCPSAT, values: Sequence[float]
                          ) -> tuple[tuple[AnyOp, ...], float]:
    """The plan and the model's makespan in chain time units (``values`` of a solve).

    Each transfer is listed after the last compute op started no later than it.
    """
    val = {v.index: x for v, x in zip(transfer_variables(built), values, strict=True)}

    def value(v: Any) -> int:
        return round(val[v.index])

    starts = [value(v) for v in built.starts]
    transfers: list[tuple[int, int, AnyOp]] = []
    for i, w in enumerate(built.windows):
        if value(built.off[i]):
            transfers.append((value(built.o_start[i]), 0, offload(*w.value)))
            transfers.append((value(built.p_start[i]), 1, prefetch(*w.value)))
    transfers.sort(key=lambda t: (t[0], t[1]))
    plan: list[AnyOp] = []
    ti = 0
    for j, op in enumerate(built.ops):
        plan.append(op)
        nxt = starts[j + 1] if j + 1 < len(built.ops) else math.inf
        while ti < len(transfers) and transfers[ti][0] < nxt:
            plan.append(transfers[ti][2])
            ti += 1
    return tuple(plan), value(built.makespan) / built.scale
