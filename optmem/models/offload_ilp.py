"""Exact MILP of OFF_int (integral offloading) on small chains, solved through PuLP.

The same schedule model as :mod:`optmem.models.offload_cpsat` (read its docstring for the
semantics), written as a big-M mixed-integer program with continuous times, so that no time
scaling is needed and any PuLP engine (HiGHS, CBC, Gurobi) can solve or export it.

Notation (``H`` = horizon, the big-M for times; ``n = 2L + 1`` compute ops):

* ``s_j`` start of compute op ``j`` (store-all order), ``e_j = s_j + d_j``; ``s_0 = 0``;
* ``off_k`` (binary), ``os_k``, ``ps_k``, ``r_k``: offload start, prefetch start and release
  of value ``k`` (``abar_k``); ``t_k = size_k / beta``;
* link (O.1): for every pair of transfers of different values a binary ``y`` orders them
  (``start_b >= end_a - H (1 - y) - H (2 - off_a - off_b)`` and symmetrically); the offload
  of a value precedes its prefetch through ``ps_k >= r_k >= os_k + t_k``;
* ``h_{k,j}`` (value ``k`` on the host during op ``j``): ``r_k <= s_j``, ``ps_k >= e_j``;
  memory ``peak_j - sum size_k h_{k,j} <= M``;
* ``g_{k,j}`` / ``in_{k,j}``: the prefetch of ``k`` starts in the gap after op ``j``
  (``e_j <= ps_k <= s_{j+1}``) or inside op ``j`` (``s_j <= ps_k <= e_j - eps``); exactly one
  when ``off_k``; in a gap ``after_j - sum size_k' x_{k',k,j} <= M`` where ``x`` needs
  ``r_k' <= ps_k`` and ``ps_k' >= ps_k + t_k`` (``k'`` is prefetched later on the link).

``eps`` (1e-3 of the shortest positive duration) stands for the strict inequality of the
CP-SAT model; the decoded plan is replayed by the simulator, which is the judge.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optmem.chain import Chain
from optmem.plan import AnyOp, Op, offload, prefetch, store_all_plan
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.solvers.offload_schedule import value_op, value_sizes


@dataclass
class OffloadILP:
    """The PuLP problem, its variables (engine order) and the handles decode needs."""

    problem: Any
    variables: list[Any]
    starts: list[Any]
    off: dict[int, Any]
    o_start: dict[int, Any]
    p_start: dict[int, Any]
    ops: tuple[Op, ...]
    eps: float = 0.0
    info: dict[str, int] = field(default_factory=dict)


def build_offload_ilp(chain: Chain, memory: int, beta: float) -> OffloadILP:
    """Build the MILP (``chain`` discretised, ``beta`` in memory units per time unit)."""
    import pulp  # type: ignore[import-untyped]

    length = chain.length
    ops = store_all_plan(length)
    sim = simulate_checkpoint(chain, ops)
    peaks = [s.peak for s in sim.timeline]
    after = [s.after for s in sim.timeline]
    dur = [s.end - s.start for s in sim.timeline]
    sizes = value_sizes(chain)
    cand = [k for k in range(length) if sizes[k] > 0 and beta > 0]
    t = {k: sizes[k] / beta for k in cand}
    horizon = sum(dur) + 2 * sum(t.values()) + 1.0
    big = horizon
    positive = [d for d in (*dur, *t.values()) if d > 0]
    eps = 1e-3 * min(positive, default=1.0)  # well above the engines' 1e-6 tolerances
    n = len(ops)
    prob = pulp.LpProblem("offload", pulp.LpMinimize)
    s = [prob.add_variable(f"s{j}", 0, horizon) for j in range(n)]
    prob += s[n - 1] + dur[n - 1]
    prob += s[0] == 0
    for j in range(n - 1):
        prob += s[j + 1] >= s[j] + dur[j]
    off, os_, ps_, rel = {}, {}, {}, {}
    for k in cand:
        off[k] = prob.add_variable(f"off{k}", 0, 1, cat=pulp.LpBinary)
        os_[k] = prob.add_variable(f"os{k}", 0, horizon)
        ps_[k] = prob.add_variable(f"ps{k}", 0, horizon)
        rel[k] = prob.add_variable(f"r{k}", 0, horizon)
        if k >= 1:
            prob += os_[k] >= s[k - 1] + dur[k - 1] - big * (1 - off[k])
        prob += rel[k] >= os_[k] + t[k] - big * (1 - off[k])
        prob += rel[k] >= s[k] + dur[k]
        prob += ps_[k] >= rel[k] - big * (1 - off[k])
        prob += ps_[k] + t[k] <= s[2 * length - k] + big * (1 - off[k])
    # the link: one transfer at a time (pairs of transfers of different values)
    transfers = [(k, "O", os_[k]) for k in cand] + [(k, "P", ps_[k]) for k in cand]
    n_pairs = 0
    for (ka, _, sa), (kb, _, sb) in itertools.combinations(transfers, 2):
        if ka == kb:
            continue
        y = prob.add_variable(f"y{n_pairs}", 0, 1, cat=pulp.LpBinary)
        n_pairs += 1
        absent = big * (2 - off[ka] - off[kb])
        prob += sb >= sa + t[ka] - big * (1 - y) - absent
        prob += sa >= sb + t[kb] - big * y - absent
    # memory of each compute op
    for j in range(n):
        terms = []
        for k in cand:
            if not k < j < 2 * length - k:
                continue
            h = prob.add_variable(f"h{k}_{j}", 0, 1, cat=pulp.LpBinary)
            prob += h <= off[k]
            prob += rel[k] <= s[j] + big * (1 - h)
            prob += ps_[k] >= s[j] + dur[j] - big * (1 - h)
            terms.append(sizes[k] * h)
        if peaks[j] > memory:
            prob += peaks[j] - pulp.lpSum(terms) <= memory
    # memory at a prefetch start between compute ops
    mem_big = max([*after, *peaks, 0]) + 1
    for k in cand:
        where = []
        for j in range(n):
            g = prob.add_variable(f"g{k}_{j}", 0, 1, cat=pulp.LpBinary)
            where.append(g)
            prob += ps_[k] >= s[j] + dur[j] - big * (1 - g)
            if j + 1 < n:
                prob += ps_[k] <= s[j + 1] + big * (1 - g)
            if dur[j] > 0:
                inside = prob.add_variable(f"in{k}_{j}", 0, 1, cat=pulp.LpBinary)
                where.append(inside)
                prob += ps_[k] >= s[j] - big * (1 - inside)
                prob += ps_[k] <= s[j] + dur[j] - eps + big * (1 - inside)
            if after[j] <= memory:
                continue
            terms = []
            for k2 in cand:
                if k2 == k or not (k2 <= j + 1 and k2 <= j < 2 * length - k2 + 1):
                    continue
                x = prob.add_variable(f"x{k2}_{k}_{j}", 0, 1, cat=pulp.LpBinary)
                prob += x <= off[k2]
                prob += rel[k2] <= ps_[k] + big * (1 - x)
                prob += ps_[k2] >= ps_[k] + t[k] - big * (1 - x)
                terms.append(sizes[k2] * x)
            prob += after[j] - pulp.lpSum(terms) <= memory + mem_big * (1 - g)
        prob += pulp.lpSum(where) == off[k]
    variables = list(prob.variables())
    return OffloadILP(prob, variables, s, off, os_, ps_, ops, eps,
                      {"variables": len(variables), "constraints": prob.numConstraints(),
                       "link_pairs": n_pairs})


def decode_offload_ilp(model: OffloadILP, values: list[float]) -> tuple[AnyOp, ...]:
    """The plan: each transfer listed after the last compute op started no later than it.

    Times closer than ``eps / 4`` count as equal (the engines' feasibility tolerances).
    """
    value_of = {v.name: x for v, x in zip(model.variables, values, strict=True)}

    def val(v: Any) -> float:
        return float(value_of.get(v.name, 0.0) or 0.0)

    starts = [val(v) for v in model.starts]
    tol = model.eps / 4  # engine tolerances: times that close are equal
    transfers: list[tuple[float, int, AnyOp]] = []
    for k, flag in model.off.items():
        if val(flag) > 0.5:
            transfers.append((val(model.o_start[k]), 0, offload(*value_op(k))))
            transfers.append((val(model.p_start[k]), 1, prefetch(*value_op(k))))
    transfers.sort(key=lambda tr: (tr[0], tr[1]))
    plan: list[AnyOp] = []
    ti = 0
    for j, op in enumerate(model.ops):
        plan.append(op)
        nxt = starts[j + 1] - tol if j + 1 < len(model.ops) else float("inf")
        while ti < len(transfers) and transfers[ti][0] < nxt:
            plan.append(transfers[ti][2])
            ti += 1
    return tuple(plan)


def write_offload_ilp(model: OffloadILP, path: str | Path) -> None:
    """Write the model as ``.mps`` or ``.lp``."""
    path = Path(path)
    if path.suffix.lower() == ".lp":
        model.problem.writeLP(str(path))
    else:
        model.problem.writeMPS(str(path))
