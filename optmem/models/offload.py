r"""Exact model of OFF_int (integral offloading), written once for every engine.

Problem: thesis (Shilova) chapter 3, Problem 7 / Beaumont et al. 2019, Problem 1 (digest
``shared/design/offload.md`` sections 0.2 and 1): run the store-all sequence
``F_all 1 .. F_all L, Loss, B L .. B 1`` and move saved activations to the host and back over
one link, under assumptions O.1-O.7; minimise the makespan. The memory semantics are those
of the simulator :mod:`optmem.simulate.offload` (CONTRACT section 10), so that a decoded
schedule replays to the model's objective.

The model is an *event-position* formulation: continuous times for the ``n = 2L + 1``
compute ops and the transfers, and binary variables that place each transfer event
(release of an offloaded value, start of its prefetch) between two compute-op boundaries.
It is a :class:`~optmem.models.formulation.Model`: :func:`~optmem.models.formulation.to_pulp`
emits it as a big-M MILP (HiGHS, CBC, Gurobi) and :func:`~optmem.models.formulation.to_cpsat`
for CP-SAT, where the link becomes an optional-interval ``NoOverlap``.

Data (:class:`OffloadData`, computed by the solver glue from the discretised chain)
----------------------------------------------------------------------------------------
``d_j`` duration of compute op ``j`` (``j = 0..n-1``; ``F_all k+1`` is op ``k``, ``Loss`` op
``L``, ``B k+1`` op ``c_k = 2L - k``); ``P_j`` its memory with nothing offloaded (checkpoint
peak) and ``A_j`` the memory after it (the values stored and what op ``j`` leaves held until
the next op starts, the chain's ``fwd_held`` / ``bwd_held`` / ``loss_held``); value
``k = 0..L-1`` is ``abar_k`` (``a^0`` for ``k = 0``) of size ``z_k``, produced by op
``k - 1``, read by op ``k``, needed back by op ``c_k``; its transfers take ``t_k = z_k /
beta``; ``M`` the memory limit; ``H`` the makespan of a known plan (every bound below uses
it) and ``LB`` a proven lower bound.

Variables and constraints
-------------------------
* ``s_j`` start of op ``j`` in ``[ES_j, H - tail_j]`` (earliest start, remaining compute),
  ``s_0 = 0``, ``s_{j+1} >= s_j + d_j``; makespan ``C >= s_{n-1} + d_{n-1}``, ``C >= LB``.
* per value ``k``: ``off_k`` (offloaded); offload start ``o_k``, prefetch start ``p_k``,
  release ``r_k`` (the GPU copy is freed, O.7); link intervals ``[o_k, o_k + t_k)`` and
  ``[p_k, p_k + t_k)`` present iff ``off_k``, in one no-overlap set (O.1). If ``off_k``:
  ``o_k >= s_{k-1} + d_{k-1}`` (produced), ``r_k >= o_k + t_k``, ``r_k >= s_k + d_k`` (its
  forward reader is done), ``p_k >= r_k``, ``p_k + t_k <= s_{c_k}``.
* release position ``R_{k,j} => r_k <= s_j`` and ``not R_{k,j} => r_k >= s_j`` for ops ``j``
  of the window ``k < j < c_k``; ``R_{k,j} <= R_{k,j+1}``, ``R <= off_k``.
* prefetch position ``U_{k,j} <=> p_k >= s_j`` and ``Q_{k,j} <=> p_k >= s_j + d_j``
  (both directions, each enforced when ``off_k``), monotone
  ``U_{k,j} >= Q_{k,j} >= U_{k,j+1}``, ``Q_{k,k} = off_k``. ``U and not Q`` places the
  prefetch start inside op ``j``; ``Q_{k,j} and not U_{k,j+1}`` in the gap after op ``j``.
  Non-strict inequalities suffice: at a boundary every classification the model may pick
  checks at least what the simulator checks (a prefetch starting at ``s_j + d_j`` counted
  in op ``j`` implies the gap check after it).
* memory of op ``j`` (O.7: a value is off the GPU only between its release and the start of
  its prefetch): ``sum_k z_k h_{k,j} >= P_j - M`` with ``h_{k,j} <= R_{k,j}``,
  ``h_{k,j} <= Q_{k,j}``; rows only for ops with ``P_j > M``.
* memory when a prefetch starts in the gap after op ``j``: ``sum_{k' != k} z_k' X_{k',k} >=
  A_j - M`` enforced by ``Q_{k,j} and not U_{k,j+1}``, where ``X_{k',k}`` (``k'`` is on the
  host when ``k``'s prefetch starts) needs ``off_k'``, ``r_k' <= p_k`` and
  ``p_k' >= p_k + t_k`` (the link is busy with ``k`` until then). One ``X`` per pair, not per
  op, since each prefetch starts once.

Valid inequalities (cuts; they remove no schedule)
--------------------------------------------------
* offload load: the offloads released by ``s_j`` of values ``k >= p`` ran on the link after
  ``k``'s producer ended: ``s_j >= s_{p-1} + d_{p-1} + sum_{k >= p} t_k R_{k,j}``;
* prefetch load: prefetches of values ``k >= c`` starting after op ``j`` end before
  ``B c+1`` starts: ``s_{c_c} >= s_j + d_j + sum_{k >= c} t_k Q_{k,j}``;
* link load: ``s_{c_0} >= 2 sum_k t_k off_k``; ``C >= LB`` (Prop. 3 and the OFF_frac
  optimum, thesis Theorem 8).

Symmetry breaking and reductions (dominance; brute force agrees, see the tests)
-------------------------------------------------------------------------------
* equal sizes ``z_a = z_b``, ``a < b``: ``off_b <= off_a``. If ``b`` is offloaded and ``a`` is
  not, giving ``a`` the link slots of ``b`` is as good: ``a`` is produced and read earlier,
  needed later, on the host for a superset of ops, and the sizes and durations are equal.
* a value none of whose window ops exceeds ``M`` (op or gap memory) is never offloaded: its
  transfers only take link time and memory.
* a value whose transfers cannot fit before ``H`` is never offloaded.

Times
-----
The MILP uses the durations as given, in units of ``2**e`` time units when the horizon ``H``
exceeds :data:`~optmem.models.formulation.MILP_HORIZON`
(:func:`~optmem.models.formulation.milp_time_unit`, :meth:`OffloadData.in_units`): on a very
slow link (``H`` ~1e10 against durations ~1) HiGHS called the model infeasible, the big-M
rows (``M`` ~ ``H``) out of its tolerances' reach; the unit is a power of two, so the
division is exact in floats and the model is the same one in other units.

CP-SAT needs integers: the glue picks a grid of ``1 / scale`` time units and builds the
model on :meth:`OffloadData.in_steps` (integer steps, emitted with ``to_cpsat(model, 1)``).
When every duration is a multiple of ``1 / scale`` (exact rational data:
:func:`exact_scale`) the steps are exact and CP-SAT's optimum is the optimum in the original
units. Otherwise the steps are rounded for a *relaxation*: every duration down, except the
upper end of "the prefetch starts inside op ``j``" (up), and ``LB`` down; flooring every
time of a true schedule then gives a schedule of the rounded model, so CP-SAT's bound is a
valid bound in the original units (its plans are replayed with the true durations by the
simulator).

Exact integer steps can be large: on a very slow link (transfers ~4e9 steps, ``H`` ~3e10
steps) CP-SAT 9.15's presolve proved optima up to 1.5x the true one, its
``presolve_inclusion_work_limit = 0`` or ``cp_model_presolve = False`` proved the right one
and so does a smaller ``H``. Wrong proofs appeared only when the largest coefficient times
the largest bound (:func:`~optmem.models.formulation.magnitude`, the size of a big-M
product) was above 1e20 (1 200 cases of a seeded sweep: none below); from
:data:`CPSAT_PRESOLVE_MAGNITUDE` on the model is solved without presolve
(:func:`cpsat_parameters`; stop 77).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction

from optmem.models import formulation
from optmem.models.formulation import Expr, Literal, Model

__all__ = ["OffloadData", "OffloadModel", "Schedule", "build_offload_model", "exact_scale",
           "cpsat_parameters"]

MAX_SCALE = 10**9
"""Largest exact time grid ``1 / scale`` the CP-SAT emission uses (times * scale < 2**53)."""

CPSAT_PRESOLVE_MAGNITUDE = 2.0**62
"""CP-SAT runs without presolve on models whose :func:`~optmem.models.formulation.magnitude`
reaches this (:func:`cpsat_parameters`)."""



@dataclass(frozen=True)
class OffloadData:
    """What the model needs, computed by the solver glue (see the module docstring).

    Attributes
    ----------
    durations
        ``d_j`` of the store-all sequence (``2L + 1`` ops).
    peaks, after
        ``P_j`` (op memory with nothing offloaded) and ``A_j`` (memory after op ``j``: the
        values stored and what the op leaves held, :func:`~optmem.simulate.checkpoint.held_after`).
    sizes, transfer
        ``z_k`` and ``t_k = z_k / beta`` of the values ``k = 0..L-1`` (``inf`` or ``nan`` for
        no link).
    memory
        ``M``.
    upper
        ``H``: the makespan of a known plan, or any valid horizon.
    lower
        ``LB``: a proven lower bound on the optimum (``0`` if none).
    durations_hi
        Durations for the upper bound "the prefetch starts inside op ``j``"
        (``None``: ``durations``); see :meth:`on_grid`.
    """

    durations: tuple[float, ...]
    peaks: tuple[int, ...]
    after: tuple[int, ...]
    sizes: tuple[int, ...]
    transfer: tuple[float, ...]
    memory: int
    upper: float
    lower: float = 0.0
    durations_hi: tuple[float, ...] | None = None

    @property
    def length(self) -> int:
        """``L``: the number of stages (and of offloadable values)."""
        return len(self.sizes)

    def consumer(self, k: int) -> int:
        """Index of ``B k+1``, the first op that needs value ``k`` back."""
        return 2 * self.length - k

    def in_units(self, unit: float) -> OffloadData:
        """The data with every time divided by ``unit`` (exact for a power of two).

        Examples
        --------
        >>> d = OffloadData((1.0, 3.0, 1.0), (1, 1, 1), (1, 1, 1), (1,), (2.0**33,), 1,
        ...                 upper=2.0**35, lower=2.0**34)
        >>> g = d.in_units(2.0**16)
        >>> g.durations[1] * 2**16, g.transfer, g.upper, g.lower
        (3.0, (131072.0,), 524288.0, 262144.0)
        """
        def div(xs: tuple[float, ...] | None) -> tuple[float, ...] | None:
            return None if xs is None else tuple(x / unit for x in xs)

        durations = div(self.durations)
        transfer = div(self.transfer)
        assert durations is not None and transfer is not None
        return replace(self, durations=durations, transfer=transfer,
                       durations_hi=div(self.durations_hi), upper=self.upper / unit,
                       lower=self.lower / unit)

    def in_steps(self, scale: int, exact: Sequence[Fraction] | None = None) -> OffloadData:
        """The data in integer steps of ``1 / scale`` time units (for CP-SAT).

        ``exact`` gives the durations then the transfer times as fractions that are
        multiples of ``1 / scale``: the steps are then exact. Without it the data are rounded
        for a *relaxation* (module docstring): durations, transfer times and ``LB`` down,
        the upper end of "the prefetch starts inside op ``j``" and ``H`` up. Integer data
        keep every sum of the model exact in floats (below ``2**53``).

        Examples
        --------
        >>> d = OffloadData((0.25, 1 / 3, 0.5), (1, 1, 1), (1, 1, 1), (1,), (2 / 3,), 1,
        ...                 upper=2.0, lower=1.0 / 3)
        >>> g = d.in_steps(10)
        >>> g.durations, g.durations_hi, g.transfer, g.lower, g.upper
        ((2.0, 3.0, 5.0), (3.0, 4.0, 5.0), (6.0,), 3.0, 20.0)
        >>> d.in_steps(12, [Fraction(1, 4), Fraction(1, 3), Fraction(1, 2), Fraction(2, 3)]
        ...            ).durations
        (3.0, 4.0, 6.0)
        """
        def steps(x: float, up: bool = False) -> float:
            if not math.isfinite(x):
                return x
            return float(math.ceil(x * scale) if up else math.floor(x * scale))

        n = len(self.durations)
        if exact is None:
            durations = tuple(steps(x) for x in self.durations)
            high = tuple(steps(x, up=True) for x in self.durations_hi or self.durations)
            transfer = tuple(steps(x) for x in self.transfer)
        else:
            if any((f * scale).denominator != 1 for f in exact):
                raise ValueError(f"the exact data are not multiples of 1/{scale}")
            durations = high = tuple(float(f * scale) for f in exact[:n])
            transfer = tuple(float(f * scale) if math.isfinite(x) else x
                             for f, x in zip(exact[n:], self.transfer, strict=True))
        return replace(self, durations=durations, durations_hi=high, transfer=transfer,
                       lower=steps(self.lower), upper=steps(self.upper, up=True))


def cpsat_parameters(model: Model) -> dict[str, bool]:
    """CP-SAT parameters for ``model`` in integer steps: presolve off when badly conditioned.

    ``{"cp_model_presolve": False}`` when :func:`~optmem.models.formulation.magnitude` of
    the model reaches :data:`CPSAT_PRESOLVE_MAGNITUDE` (module docstring, *Times*), else
    ``{}`` (CP-SAT's defaults).

    Examples
    --------
    >>> m = Model("m")
    >>> x, y = m.continuous("x", 0, 3.4e10), m.binary("y")
    >>> m.add(x >= 7e9 * y, "row")
    >>> cpsat_parameters(m)
    {'cp_model_presolve': False}
    """
    if formulation.magnitude(model) >= CPSAT_PRESOLVE_MAGNITUDE:
        return {"cp_model_presolve": False}
    return {}


def exact_scale(values: Iterable[Fraction], limit: int = MAX_SCALE) -> int | None:
    """The grid of exact rational data (:func:`optmem.models.formulation.exact_scale`).

    Examples
    --------
    >>> exact_scale([Fraction("0.25"), Fraction(7, 3)]), exact_scale([Fraction(1, 10**10)])
    (12, None)
    """
    return formulation.exact_scale(values, limit)


@dataclass(frozen=True)
class Schedule:
    """A schedule in model terms: compute-op starts and the transfer starts of each value."""

    starts: tuple[float, ...]
    offloads: Mapping[int, float]
    prefetches: Mapping[int, float]

    def map(self, fn: Callable[[float], float]) -> Schedule:
        """The schedule with every time ``t`` replaced by ``fn(t)`` (a change of units)."""
        return Schedule(tuple(fn(t) for t in self.starts),
                        {k: fn(t) for k, t in self.offloads.items()},
                        {k: fn(t) for k, t in self.prefetches.items()})


@dataclass
class OffloadModel:
    """The built model and the handles that :meth:`assignment` and :meth:`decode` use."""

    data: OffloadData
    model: Model
    start: list[Expr]
    makespan: Expr
    off: dict[int, Expr] = field(default_factory=dict)
    o_start: dict[int, Expr] = field(default_factory=dict)
    p_start: dict[int, Expr] = field(default_factory=dict)
    release: dict[int, Expr] = field(default_factory=dict)
    rel_at: dict[tuple[int, int], Expr] = field(default_factory=dict)  # R
    pre_start: dict[tuple[int, int], Expr] = field(default_factory=dict)  # U
    pre_end: dict[tuple[int, int], Expr] = field(default_factory=dict)  # Q
    host: dict[tuple[int, int], Expr] = field(default_factory=dict)  # h
    seen: dict[tuple[int, int], Expr] = field(default_factory=dict)  # X

    @property
    def values(self) -> list[int]:
        """The values the model may offload."""
        return sorted(self.off)

    def assignment(self, schedule: Schedule, tol: float = 1e-7) -> list[float]:
        """Values of every variable for ``schedule`` (a warm start; check with ``violated``).

        Values outside :attr:`values` must not be offloaded in ``schedule``.
        """
        data, vals = self.data, [0.0] * len(self.model.vars)
        d, t = data.durations, data.transfer
        starts = schedule.starts

        def put(x: Expr, v: float) -> None:
            vals[Model.index(x)] = float(v)

        def low(x: Expr) -> float:
            return self.model.vars[Model.index(x)].lo

        for j, x in enumerate(self.start):
            put(x, starts[j])
        put(self.makespan, max(starts[-1] + d[-1], low(self.makespan)))
        on = {k for k in schedule.offloads if k in self.off}
        rel, pre = {}, {}
        for k in self.off:
            o = schedule.offloads[k] if k in on else low(self.o_start[k])
            pre[k] = schedule.prefetches[k] if k in on else low(self.p_start[k])
            rel[k] = max(o + t[k], starts[k] + d[k]) if k in on else low(self.release[k])
            put(self.off[k], float(k in on))
            put(self.o_start[k], o)
            put(self.p_start[k], pre[k])
            put(self.release[k], rel[k])
        for (k, j), x in self.rel_at.items():
            put(x, float(k in on and rel[k] <= starts[j] + tol))
        for (k, j), x in self.pre_start.items():
            put(x, float(k in on and pre[k] >= starts[j] - tol))
        for (k, j), x in self.pre_end.items():
            put(x, float(k in on and pre[k] >= starts[j] + d[j] - tol))
        for (k, j), x in self.host.items():
            put(x, vals[Model.index(self.rel_at[k, j])] * vals[Model.index(self.pre_end[k, j])])
        for (k2, k), x in self.seen.items():
            put(x, float(k2 in on and k in on and rel[k2] <= pre[k] + tol
                         and pre[k2] >= pre[k] + t[k] - tol))
        return vals

    def decode(self, vals: Sequence[float]) -> Schedule:
        """The schedule of an assignment (offloaded values: ``off_k > 1/2``)."""
        def val(x: Expr) -> float:
            return float(vals[Model.index(x)])

        on = [k for k in self.off if val(self.off[k]) > 0.5]
        return Schedule(tuple(val(x) for x in self.start),
                        {k: val(self.o_start[k]) for k in on},
                        {k: val(self.p_start[k]) for k in on})


def build_offload_model(data: OffloadData, *, cuts: bool = True, symmetry: bool = True
                        ) -> OffloadModel:
    """Build the model of the module docstring.

    Parameters
    ----------
    data
        The instance (see :class:`OffloadData`).
    cuts, symmetry
        Add the valid inequalities / the symmetry breaking (both on by default; the tests
        check that the optimum does not change without them).
    """
    d, n = data.durations, len(data.durations)
    es = [0.0] * n
    for j in range(1, n):
        es[j] = es[j - 1] + d[j - 1]
    tail = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        tail[j] = tail[j + 1] + d[j]
    horizon = max(data.upper, tail[0])
    m = Model("offload")
    s = [m.continuous(f"s{j}", es[j], max(es[j], horizon - tail[j])) for j in range(n)]
    m.add(s[0] == 0, "start")
    for j in range(n - 1):
        m.add(s[j + 1] >= s[j] + d[j], f"chain{j}")
    cmax = m.continuous("makespan", min(max(data.lower, tail[0]), horizon), horizon)
    m.add(cmax >= s[n - 1] + d[n - 1], "makespan")
    om = OffloadModel(data, m, s, cmax)
    intervals: list[int] = []
    for k in _candidates(data, es, tail, horizon):
        intervals += _value(om, k, es, tail, horizon)
    if intervals:
        m.no_overlap("link", intervals)
    _op_memory(om)
    _gap_memory(om)
    if symmetry:
        for a in om.values:
            for b in om.values:
                if a < b and data.sizes[a] == data.sizes[b]:
                    m.add(om.off[b] <= om.off[a], f"equal_sizes{a}_{b}")
    if cuts:
        _cuts(om)
    m.minimize(cmax)
    return om


def _candidates(data: OffloadData, es: Sequence[float], tail: Sequence[float],
                horizon: float) -> list[int]:
    """Values worth offloading: a link, a window op over the limit, room before ``H``."""
    out = []
    for k in range(data.length):
        t = data.transfer[k]
        if data.sizes[k] <= 0 or not math.isfinite(t) or t <= 0:
            continue
        c = data.consumer(k)
        useful = any(data.peaks[j] > data.memory for j in range(k + 1, c)) or any(
            data.after[j] > data.memory for j in range(k, c))
        avail = es[k - 1] + data.durations[k - 1] if k >= 1 else 0.0
        latest = horizon - tail[c] - t  # latest prefetch start
        fits = latest >= max(avail + t, es[k] + data.durations[k]) - 1e-9 * max(1.0, horizon)
        if useful and fits:
            out.append(k)
    return out


def _value(om: OffloadModel, k: int, es: Sequence[float], tail: Sequence[float],
           horizon: float) -> list[int]:
    """Variables and constraints of value ``k``; returns its two link intervals."""
    data, m, s = om.data, om.model, om.start
    d, t = data.durations, data.transfer[k]
    hi = data.durations_hi or d
    c = data.consumer(k)
    avail = es[k - 1] + d[k - 1] if k >= 1 else 0.0
    latest = horizon - tail[c] - t  # latest prefetch start
    off = m.binary(f"off{k}")
    on = m.literal(off)
    first = max(avail + t, es[k] + d[k])  # earliest release
    latest = max(latest, first)
    o = m.continuous(f"o{k}", avail, max(avail, latest - t))
    p = m.continuous(f"p{k}", first, latest)
    r = m.continuous(f"r{k}", first, latest)
    om.off[k], om.o_start[k], om.p_start[k], om.release[k] = off, o, p, r
    ivs = [m.interval(f"O{k}", o, t, on), m.interval(f"P{k}", p, t, on)]
    if k >= 1:
        m.add(o >= s[k - 1] + d[k - 1], f"produced{k}", only_if=on)
    m.add(r >= o + t, f"offloaded{k}", only_if=on)
    m.add(r >= s[k] + d[k], f"read{k}", only_if=on)
    m.add(p >= r, f"released{k}", only_if=on)
    m.add(p + t <= s[c], f"back{k}", only_if=on)
    prev = None
    for j in range(k + 1, c):
        x = m.binary(f"R{k}_{j}")
        om.rel_at[k, j] = x
        m.add(r <= s[j], f"R{k}_{j}", only_if=m.literal(x))
        m.add(r >= s[j], f"notR{k}_{j}", only_if=[m.literal(x, False), on])
        m.add(x <= off, f"R{k}_{j}_off")
        if prev is not None:
            m.add(prev <= x, f"R{k}_{j}_order")
        prev = x
    chain: list[Expr] = []
    for j in range(k, c):
        if j > k:
            u = m.binary(f"U{k}_{j}")
            om.pre_start[k, j] = u
            m.add(p >= s[j], f"U{k}_{j}", only_if=m.literal(u))
            m.add(p <= s[j], f"notU{k}_{j}", only_if=[m.literal(u, False), on])
            chain.append(u)
        q = m.binary(f"Q{k}_{j}")
        om.pre_end[k, j] = q
        m.add(p >= s[j] + d[j], f"Q{k}_{j}", only_if=m.literal(q))
        m.add(p <= s[j] + hi[j], f"notQ{k}_{j}", only_if=[m.literal(q, False), on])
        chain.append(q)
    m.add(chain[0] == off, f"Q{k}_{k}_off")  # p_k >= r_k >= s_k + d_k
    for pos, (a, b) in enumerate(zip(chain, chain[1:], strict=False)):
        m.add(b <= a, f"P{k}_order{pos}")
    return ivs


def _op_memory(om: OffloadModel) -> None:
    """Memory of each compute op: the values on the host for the whole op."""
    data, m = om.data, om.model
    for j, peak in enumerate(data.peaks):
        if peak <= data.memory:
            continue
        terms = []
        for k in om.values:
            if k < j < data.consumer(k):
                h = m.binary(f"h{k}_{j}")
                om.host[k, j] = h
                m.add(h <= om.rel_at[k, j], f"h{k}_{j}_released")
                m.add(h <= om.pre_end[k, j], f"h{k}_{j}_not_back")
                terms.append(data.sizes[k] * h)
        m.add(Expr.sum(terms) >= peak - data.memory, f"memory{j}")


def _gap_memory(om: OffloadModel) -> None:
    """Memory at a prefetch start between two compute ops (the values still on the host)."""
    data, m = om.data, om.model
    for k in om.values:
        c = data.consumer(k)
        gaps = [j for j in range(k, c) if data.after[j] > data.memory]
        if not gaps:
            continue
        p = om.p_start[k]
        seen = {}
        for k2 in om.values:
            if k2 == k:
                continue
            x = m.binary(f"X{k2}_{k}")
            seen[k2] = om.seen[k2, k] = x
            m.add(x <= om.off[k2], f"X{k2}_{k}_off")
            m.add(om.release[k2] <= p, f"X{k2}_{k}_released", only_if=m.literal(x))
            m.add(om.p_start[k2] >= p + data.transfer[k], f"X{k2}_{k}_later",
                  only_if=m.literal(x))
        for j in gaps:
            lits: list[Literal] = [m.literal(om.pre_end[k, j])]
            if j + 1 < c:
                lits.append(m.literal(om.pre_start[k, j + 1], False))
            terms = [data.sizes[k2] * x for k2, x in seen.items()
                     if k2 <= j < data.consumer(k2)]
            m.add(Expr.sum(terms) >= data.after[j] - data.memory, f"gap{k}_{j}", only_if=lits)


def _cuts(om: OffloadModel) -> None:
    """The valid inequalities of the module docstring."""
    data, m, s = om.data, om.model, om.start
    d, t, n = data.durations, data.transfer, len(data.durations)
    values = om.values
    for j in range(1, n):
        for first in range(j):
            terms = [t[k] * om.rel_at[k, j] for k in values
                     if k >= first and (k, j) in om.rel_at]
            if terms:
                ready = s[first - 1] + d[first - 1] if first >= 1 else Expr.of(0.0)
                m.add(s[j] >= ready + Expr.sum(terms), f"offload_load{j}_{first}")
    for j in range(n):
        for c in range(data.length):
            terms = [t[k] * om.pre_end[k, j] for k in values
                     if k >= c and (k, j) in om.pre_end]
            if terms:
                m.add(s[data.consumer(c)] >= s[j] + d[j] + Expr.sum(terms),
                      f"prefetch_load{j}_{c}")
    if values:
        m.add(s[data.consumer(0)] >= Expr.sum(2 * t[k] * om.off[k] for k in values),
              "link_load")
