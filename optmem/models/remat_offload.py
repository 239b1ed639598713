r"""One exact model of remat + offload (OFFREMAT_int): checkpoint slots, a link, O.7 memory.

Problem: thesis chapter 4, Problem 8 (digest ``shared/design/offload.md`` 0.2 and 5) with the
semantics of the simulator :mod:`optmem.simulate.offload` (CONTRACT sections 10 and 13), which
this model reproduces op by op. It is written once, on the solver-neutral layer
:mod:`optmem.models.formulation`, and emitted to PuLP (HiGHS, CBC, Gurobi: big-M from the
variable bounds) and to CP-SAT (times on a grid of ``1 / scale``).

Compute part
------------
The phase-indexed checkpoint formulation of :mod:`optmem.models.checkpoint_ilp` (its
docstring explains phases, sweeps and the exclusions), built by
:func:`~optmem.models.checkpoint_ilp.build_formulation` without its checkpoint-only
reductions (``reductions=False``: ``F_none`` may consume a tape, ``F_all j`` may run again) and
copied unchanged except for its memory rows, which lose the values that are on the host
(below). Its items (forward slots,
``Loss``, ``B k``) are numbered ``p = 0 .. n-1`` in execution order; an empty slot is an op of
duration 0.

Link part: positions
--------------------
After every item ``p`` (but the last) the model offers ``K`` link *positions*
(``transfers_per_gap``, default 1): each may hold one transfer, ``offload v`` or
``prefetch v``, of a value ``v`` (``a^i``, ``abar^i``) that may be stored there. The plan is
the items and positions in this order, which is exactly the simulator's issue order (plan
order); so the link runs the positions in order (O.1) and no pairwise disjunction is needed.

Notation (sizes in discretised units, times in the chain's unit)
----------------------------------------------------------------
=====================  ==============================================================
``S_p``, ``D_p``       start of item ``p`` and its duration (``sum uf[j] y`` for a slot)
``E_p``                ``S_p + D_p``
``T_q``                start of the transfer of position ``q`` (free when it is empty)
``off[v,q]``,          position ``q`` offloads / prefetches ``v``; ``tau_v = size_v / beta``
``pre[v,q]``
``H[v]``, ``P[v]``     state: ``v`` is offloaded and not prefetched (moved) / prefetched and
                       not read yet (binary, one variable per position or reading item)
``R[v]``, ``Pi[v]``    release time of the current offload (its end and the end of every op
                       that read ``v`` before it or while it ran), end of the last prefetch
``h[v,p]``             ``v`` is on the host during the whole of item ``p``
``late_q``             the prefetch of ``q`` starts after item ``p`` has ended
``eta[v,q]``           ``v`` is on the host when the prefetch of ``q`` starts
=====================  ==============================================================

Constraints (``[x, y]``: enforced when the binaries ``x`` and ``y`` are 1)
------------------------------------------------------------------------
* compute in plan order: ``S_{p+1} >= E_p``, ``S_0 = 0``; objective ``E_{n-1}``;
* issue order: ``T_q >= S_p`` for ``q`` after ``p``; ``S_{p+1} >= T_q`` if ``q`` holds a
  transfer; link:
  ``T_q >= T_{q'} + sum_v tau_v (off + pre)[v,q']`` for the previous position ``q'``;
* one transfer per position; ``off[v,q] <= stored_v``; ``off + H + P <= 1`` (the simulator's
  "already offloaded"); ``pre <= H``; ``H' = H + off - pre``; ``P' = P + pre``; a reading item
  resets ``P``;
* offload after its producer: ``T_q >= E_p`` ``[off, item p produces v]``;
* release: ``R' >= R``, ``R' >= T_q + tau_v`` ``[off]``, ``R' >= E_p`` ``[off, p reads v]``,
  and ``R >= E_p`` ``[p reads v, H]`` (a reader listed after the offload keeps the GPU copy);
  earlier readers end before ``S_p <= T_q``;
* prefetch: ``T_q >= R`` ``[pre]``; ``Pi' >= T_q + tau_v`` ``[pre]``; a reader waits:
  ``S_p >= Pi`` ``[p reads v]``; an item freeing ``v`` needs ``H = 0`` (the simulator's "frees
  while it is being offloaded");
* memory of item ``p`` (O.7): the checkpoint row minus ``sum_v size_v h[v,p]`` with
  ``h <= H``, ``h <= 1 - reads``, ``R <= S_p`` ``[h]`` and ``h <= 1 - pre[v,q] + late_q`` for
  the positions ``q`` after ``p`` (a prefetch starting during the op counts for it);
  ``late_q``: ``T_q >= E_p`` ``[late]``, ``T_q <= E_p`` ``[not late]``;
* memory when a prefetch starts between two ops (``[late_q, some pre at q]``):
  ``stored after p + held_p - sum_w size_w eta[w,q] <= M`` with ``eta <= H_w - pre[w,q]``
  and ``R_w <= T_q`` ``[eta]``; ``held_p`` is what the last op run by item ``p`` (or before
  it, after an empty slot) leaves held, the chain's ``fwd_held`` / ``bwd_held`` /
  ``loss_held`` (:func:`_held_terms`; 0 and no variable for a chain that holds nothing).
* no reader of ``v`` is listed after an item or gap that counted ``v`` on the host
  (``h`` or ``eta``) while ``v`` is still offloaded (``G[v]``, :func:`_host_since_offload`):
  the simulator releases an offloaded value only once every reader listed after the offload
  has run, which the release rows alone miss when ops take no time.
* link cuts (valid inequalities, no big-M; they lift the LP bound above the sum of compute
  times, which the big-M rows above leave free): the values on the host during item ``p``
  were offloaded one after the other before it starts and are prefetched after it ends,
  ``S_p >= sum_v tau_v h[v,p]`` and ``makespan >= E_p + sum_v tau_v h[v,p]``; every
  transfer ends before the last op (a value on the host is prefetched before it is freed),
  ``makespan >= sum_q busy_q``.

The engine's integrality tolerance and the big-Ms (stop 78)
-----------------------------------------------------------
The PuLP emission writes an enforced row with the M of the variable bounds, for a time row
about the horizon. On a slow link (transfers ~1e8 beside ops of 1-10) the transfer times
themselves, coefficients of 0/1 choices in the link, release and prefetch rows, are of the
same order, so a binary that HiGHS takes within its default integrality tolerance ``1e-6``
of 1 lets such a row slip by 10-200 time units, and the rounded plan overran the memory.
The exact methods pass HiGHS :attr:`RematOffloadModel.integrality_tolerance`, small enough
that no row slips by half the shortest duration (floored at ``1e-9``; ``1e-6``, HiGHS's
default, unless a model needs less).

Per-row Ms were tried and dropped. Only three rows have a valid M below the horizon
(``D^max_p`` the longest duration of item ``p``): ``avail`` and ``late`` (``T_q >= E_p``
when off: ``E_p - T_q <= D^max_p`` since ``T_q >= S_p`` holds at every point) and ``wait``
(``S_p >= Pi``: ``Pi - S_p <= tau_v`` once every ``Pi`` is lowered to the end of the last
prefetch listed before ``p``, which changes no other row). The rows that slipped in stop
77's cases have none: the release time ``R`` of an offload is one value for every item its
offload spans (a reader listed after the offload lifts it through ``Rkeep``), so ``R -
S_p``, ``R - T_q`` are unbounded below the horizon when ``hR``, ``preR``, ``pend`` are off,
and so are ``T_q - E_p`` (``early``), ``T_q - S_{p+1}`` (``issue``) and ``T_q + tau_v -
R'``, ``T_q + tau_v - Pi'`` (``Roff``, ``Pi``: a transfer may wait behind the link for any
time); the transfer coefficients of the link rows are no big-M at all. With the three Ms
and the default tolerance `ilp` proved 10 of those 42 cases (none before); with the
tolerance it proved 42 without them and 36 with them (the 6 lost on links of 1e-9, where
``1e-9`` times the horizon still exceeds the ops and either outcome is luck), so the model
keeps the bounds' M (``benchmarks/results/offload_exact.md``, "Stop 78").

A bound from outside the model
------------------------------
:func:`build_link_relaxation` keeps the compute binaries integral and aggregates the link
into one relief per item (its docstring proves that its optimum is at most the model's).
It is a checkpoint-sized MILP that HiGHS solves in seconds where the model's own LP leaves
the recompute choices fractional; the exact methods use its value as a proven bound, as a
row ``makespan >= bound`` and to stop at once when a candidate plan meets it.

Exactness
---------
For any plan, the simulator starts every op as early as its constraints allow, and all of
them are monotone (an earlier release or end never delays anything), so the decoded plan of
any solution replays in at most the model's makespan; conversely the simulator's schedule of
a plan in the class below satisfies every row with the indicators set to their definitions.
The optimum is therefore the best plan of the class:

* compute ops: at most ``sweeps`` increasing forward runs per phase (the checkpoint model's
  class and exclusions);
* transfers: at most ``K`` transfers listed between two consecutive ops of the plan (more
  are allowed after an empty slot, but only starting once the previous op has ended), any
  number of offload/prefetch pairs per value;

and any decoded plan is valid and no slower than the model says. With held terms (the
chain's ``fwd_held`` / ``bwd_held`` / ``loss_held``, stop 82) a plan outside the class can
be faster by a forward nothing reads, run only to end what the last op left held: after
``B 2`` a useless ``F_ck 2`` whose overhead is smaller than ``B 2``'s held term, during
which a prefetch starts (``tests/test_held_between_ops.py``). With every ``fwd_held`` (so
every ``fwd_overhead``) at least every ``bwd_held`` and ``loss_held`` no forward helps so,
and the tests find brute force and the model equal on such chains. On other chains with
held terms (a *held gap*) the solvers take their proofs from the same solve on the chain
without held terms (:func:`optmem.solvers.remat_offload_exact.outside_class`, stop 82
hunt). The tests check both directions: the DP, checkpoint-only and offload-only plans of
random chains, fixed in the model, get exactly their simulated makespan; the model's
optimum equals the brute force over compute sequences and transfer windows
(:mod:`optmem.solvers.remat_offload_exact`) on tiny chains and every decoded plan replays
to the model's value.

Times on a grid
---------------
``grid`` (for CP-SAT when the durations are not decimal) rounds every duration *down* to a
multiple of ``1 / grid``; the decoded plan's true makespan is the simulator's, and the
model's bound is that of the rounded durations (a schedule of the true durations maps onto
the grid up to one grid step per ``late`` decision), so callers claim optimality only when
the replayed plan meets it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from optmem.chain import Chain
from optmem.models import checkpoint_ilp as ck
from optmem.models.formulation import (
    Constraint,
    Expr,
    Literal,
    Model,
    Relation,
    Var,
    milp_integrality_tolerance,
)
from optmem.plan import AnyOp, Op, OpKind, TransferKind, TransferOp, offload, prefetch

Value = tuple[str, int]
A_, ABAR_ = "a", "abar"


@dataclass
class Position:
    """A link position after item ``item``: its start variable and transfer binaries."""

    item: int
    start: int
    off: dict[Value, int] = field(default_factory=dict)
    pre: dict[Value, int] = field(default_factory=dict)


@dataclass
class RematOffloadModel:
    """The built model and what decoding and warm starts need."""

    model: Model
    checkpoint: ck.Formulation
    starts: list[int]
    positions: list[Position]
    objective_var: int
    horizon: float
    chain: Chain
    info: dict[str, int] = field(default_factory=dict)
    resolution: float = math.inf
    """The smallest positive duration of an op or a transfer (``inf``: none): what the
    engine's tolerances must not blur (:func:`duration_resolution`)."""

    @cached_property
    def integrality_tolerance(self) -> float:
        """The MILP integrality tolerance of this model (stop 78).

        :func:`~optmem.models.formulation.milp_integrality_tolerance` of :attr:`model` at
        :attr:`resolution`: HiGHS's default ``1e-6`` unless a transfer time or a big-M is
        so large beside the shortest duration that a binary within ``1e-6`` of an integer
        would let a time row slip by half of it (very slow links). A horizon below the
        model's (:func:`with_fixed`) only shrinks the big-Ms, so it holds there too.
        """
        return milp_integrality_tolerance(self.model, self.resolution)

    @property
    def slots(self) -> list[ck.Slot]:
        """The compute sequence's slots (the items whose ops are binaries), in order."""
        return [item for item in self.checkpoint.sequence if isinstance(item, ck.Slot)]

    @property
    def plan_vars(self) -> list[int]:
        """The binaries that fix a plan (compute op and transfer variables)."""
        out = [idx for item in self.slots for _, idx in item.ops]
        for pos in self.positions:
            out += list(pos.off.values()) + list(pos.pre.values())
        return out

    def decode(self, values: Sequence[float]) -> tuple[AnyOp, ...]:
        """The plan of an assignment: items and positions in order."""
        plan: list[AnyOp] = []
        by_item: dict[int, list[Position]] = {}
        for pos in self.positions:
            by_item.setdefault(pos.item, []).append(pos)
        compute = self.checkpoint.decode([round(v) for v in values[:len(self.checkpoint.names)]])
        ci = 0
        for p, item in enumerate(self.checkpoint.sequence):
            if isinstance(item, Op) or any(values[idx] > 0.5 for _, idx in item.ops):
                plan.append(compute[ci])
                ci += 1
            for pos in by_item.get(p, ()):
                for v, idx in pos.off.items():
                    if values[idx] > 0.5:
                        plan.append(offload(*v))
                for v, idx in pos.pre.items():
                    if values[idx] > 0.5:
                        plan.append(prefetch(*v))
        return tuple(plan)

    def fixing(self, plan: Sequence[AnyOp]) -> dict[int, float] | None:
        """Values of :attr:`plan_vars` that encode ``plan`` (``None`` if it does not fit).

        Compute ops take the checkpoint model's slots; each transfer takes the first free
        position after the op listed before it (those listed before the first op start at 0
        as after it), later ones if those are taken: the encoded plan may then list a
        transfer later than ``plan`` (the engine's completion judges it).
        """
        compute = [op for op in plan if isinstance(op, Op)]
        # the compute ops' slots, memory aside (it depends on the transfers)
        cf = self.checkpoint
        free_memory = ck.build_formulation(self.chain, 2**60, cf.variant, cf.sweeps,
                                           reductions=cf.reductions)
        base = free_memory.assignment(compute)
        if base is None or free_memory.names != cf.names:
            return None
        fixed = {i: float(base[i]) for i in self.plan_vars if i < len(base)}
        items = [p for p, item in enumerate(self.checkpoint.sequence)
                 if isinstance(item, Op) or any(base[idx] for _, idx in item.ops)]
        for pos in self.positions:
            for idx in (*pos.off.values(), *pos.pre.values()):
                fixed[idx] = 0.0
        at, ci = 0, -1
        for op in plan:
            if isinstance(op, Op):
                ci += 1
                while ci > 0 and at < len(self.positions) and \
                        self.positions[at].item < items[ci]:
                    at += 1
                continue
            assert isinstance(op, TransferOp)
            table = "off" if op.kind is TransferKind.OFFLOAD else "pre"
            while at < len(self.positions) and op.key not in getattr(self.positions[at], table):
                at += 1
            if at == len(self.positions):
                return None
            fixed[getattr(self.positions[at], table)[op.key]] = 1.0
            at += 1
        return fixed


def _holds(x: Literal | bool) -> Expr:
    """A literal that may hold (not ``False``) as a 0/1 expression.

    1 for ``True``, its binary ``b`` for ``(i, True)``, ``1 - b`` for ``(i, False)``.
    """
    if x is True:
        return Expr((), 1.0)
    if x is False:
        raise ValueError("a literal that never holds has no expression here")
    b = Expr([(x[0], 1.0)])
    return b if x[1] else 1 - b


def _lit(e: ck.Expr | Expr) -> Literal | bool:
    """A binary expression as a literal, or its constant truth value."""
    if not e.terms:
        return e.const > 0.5
    if len(e.terms) == 1 and e.terms[0][1] == 1.0 and e.const == 0.0:
        return (e.terms[0][0], True)
    raise ValueError(f"not a single binary: {e!r}")


def _x(e: ck.Expr) -> Expr:
    return Expr(e.terms, e.const)


def _class_horizon(seq: Sequence[ck.Slot | Op], uf: Sequence[float], ub: Sequence[float],
                   longest: float, transfers_per_gap: int) -> float:
    """A makespan no plan of the class exceeds (the default horizon of the model).

    Every slot runs at most its slowest forward, every backward runs once, and at most
    ``transfers_per_gap`` transfers, each at most ``longest``, are listed between two
    consecutive items; the earliest schedule leaves the compute stream idle only while the
    link is busy, plus one time unit of slack.
    """
    slot_max = [max((uf[it.stage] for _ in it.ops), default=0.0)
                if isinstance(it, ck.Slot) else 0.0 for it in seq]
    return (sum(slot_max) + sum(ub) + (len(seq) - 1) * transfers_per_gap * longest + 1.0)


def duration_resolution(chain: Chain, bandwidth: float) -> float:
    """The smallest positive duration of a compute op or a transfer of ``chain`` (``inf``: none).

    What a MILP engine's tolerances must not blur on the model and its relaxations
    (:func:`~optmem.models.formulation.milp_integrality_tolerance`, stop 78).

    Examples
    --------
    >>> from optmem.datasets.synthetic import random_chain
    >>> c = random_chain(2, seed=1, integer_times=True)  # forwards 0, backwards 6, 7, loss 2
    >>> duration_resolution(c, 1e-8), duration_resolution(c, 2.0)
    (2.0, 1.5)
    """
    sizes = [chain.input_size, *chain.output_size, *chain.saved_size]
    tau = [x / bandwidth for x in sizes if x > 0] if bandwidth > 0 else []
    times = [*chain.fwd_time, *chain.bwd_time, chain.loss_bwd_time, *tau]
    return min((t for t in times if t > 0), default=math.inf)


def class_horizon(chain: Chain, memory_limit: int, bandwidth: float, *, sweeps: int = 1,
                  transfers_per_gap: int = 1) -> float:
    """The default horizon of :func:`build_remat_offload`, without building the model.

    No plan of the class (``sweeps``, ``transfers_per_gap``) on ``chain`` has a larger
    makespan, so a relaxation built with it as its horizon keeps a point for every plan.
    """
    cf = ck.build_formulation(chain, memory_limit, "full", sweeps, reductions=False)
    a = [chain.input_size, *chain.output_size]
    abar = [chain.input_size, *chain.saved_size]
    sizes = [*a, *abar[1:]]
    longest = max(sizes, default=0) / bandwidth if bandwidth > 0 else 0.0
    uf = [0.0, *chain.fwd_time]
    ub = [0.0, *chain.bwd_time, chain.loss_bwd_time]
    return _class_horizon(cf.sequence, uf, ub, longest, transfers_per_gap)


def build_remat_offload(chain: Chain, memory_limit: int, bandwidth: float, *,
                        sweeps: int = 1, transfers_per_gap: int = 1,
                        horizon: float | None = None, grid: int | None = None
                        ) -> RematOffloadModel:
    """Build the model (see the module docstring).

    Parameters
    ----------
    chain
        The discretised chain (integer sizes).
    memory_limit
        GPU memory limit in the chain's units.
    bandwidth
        Memory units per time unit (``<= 0``: no transfer).
    sweeps, transfers_per_gap
        The plan class: increasing forward runs per phase, link positions after each item.
    horizon
        An upper bound on the optimal makespan (e.g. a known plan's); every time variable is
        bounded by it (the big-M of the PuLP emission). Default: a bound on every plan of the
        class.
    grid
        Round every duration down to a multiple of ``1 / grid`` (a relaxation; see above).
    """
    cf = ck.build_formulation(chain, memory_limit, "full", sweeps, reductions=False)
    L = chain.length
    a = [chain.input_size, *chain.output_size]
    abar = [chain.input_size, *chain.saved_size]

    def rd(t: float) -> float:
        return t if grid is None else math.floor(t * grid + 1e-9) / grid

    uf = [0.0, *(rd(t) for t in chain.fwd_time)]
    ub = [0.0, *(rd(t) for t in chain.bwd_time), rd(chain.loss_bwd_time)]

    def size(v: Value) -> int:
        return a[v[1]] if v[0] == A_ else abar[v[1]]

    tau = {}
    if bandwidth > 0:
        for i in range(L + 1):
            for v in ((A_, i), (ABAR_, i)) if i else ((A_, 0),):
                if size(v) > 0:
                    tau[v] = rd(size(v) / bandwidth)
    seq = cf.sequence
    n = len(seq)
    if horizon is None:
        horizon = _class_horizon(seq, uf, ub, max(tau.values(), default=0.0),
                                 transfers_per_gap)
    U = float(horizon)
    m = Model("remat_offload")
    for nm in cf.names:
        m.binary(nm)
    for con in cf.constraints:
        if con.name.startswith("mem_"):
            continue
        m.add(Relation(Expr(con.terms), con.lo, con.hi), con.name)
    S = [m.continuous(f"S{p}", 0.0, 0.0 if p == 0 else U) for p in range(n)]
    D, reads, frees, makes, after_delta = _item_facts(m, cf, uf, ub, a)
    held = _held_terms(m, cf, chain)
    early_readers = _early_readers(D, reads)
    for p in range(n - 1):
        m.add(S[p + 1] >= S[p] + D[p], f"seq_{p}")
    E = [S[p] + D[p] for p in range(n)]

    def stored(state: tuple[dict[int, ck.Expr], dict[int, ck.Expr]]) -> Expr:
        A, T = state
        out = Expr()
        for i, e in A.items():
            out = out + _x(e) * a[i]
        for i, e in T.items():
            out = out + _x(e) * abar[i]
        return out

    def state_of(p: int, v: Value) -> ck.Expr:
        A, T = cf.states[p]
        table = A if v[0] == A_ else T
        return table.get(v[1], ck.Expr.of(0))

    def add(rel: Relation, name: str, lits: Sequence[Literal | bool]) -> None:
        if any(x is False for x in lits):
            return
        m.add(rel, name, only_if=tuple(x for x in lits if x is not True))  # type: ignore[misc]

    zero = Expr()
    H: dict[Value, Expr] = {v: zero for v in tau}
    P: dict[Value, Expr] = {v: zero for v in tau}
    R: dict[Value, Expr] = {v: zero for v in tau}
    Pi: dict[Value, Expr] = {v: zero for v in tau}
    G: dict[Value, Expr] = {v: zero for v in tau}  # host-only since the current offload
    positions: list[Position] = []
    prev: tuple[Expr, Expr] | None = None  # previous position's start and busy time
    last_used: tuple[int, Expr] | None = None  # item and use of the previous position
    n_h = 0
    cuts: list[tuple[str, Expr]] = []  # (name, link time that must follow item p)
    link_total = Expr()
    for p in range(n):
        # ---- item p: memory with the values on the host during the whole op
        host = Expr()
        hvars: dict[Value, Expr] = {}
        for v in tau:
            if not H[v].terms:
                continue
            rv = reads[p].get(v, False)
            if rv is True:
                continue
            h = m.binary(f"h_{v[0]}{v[1]}_{p}")
            n_h += 1
            m.add(h <= H[v], f"hH_{v[0]}{v[1]}_{p}")
            if rv is not False:
                m.add(h + Expr([(rv[0], 1.0)]) <= 1, f"hrd_{v[0]}{v[1]}_{p}")
            m.add(R[v] <= S[p], f"hR_{v[0]}{v[1]}_{p}", only_if=m.literal(h))
            host = host - h * size(v)
            hvars[v] = h
        name, mexpr = cf.memory_rows[p]
        m.add(_x(mexpr) + host <= memory_limit, name)
        if hvars:
            # link cuts: the values on the host during item p were offloaded (one after the
            # other, on the one link) before it starts and are prefetched after it ends
            moved = Expr.sum(h * tau[v] for v, h in hvars.items())
            m.add(S[p] >= moved, f"cut_off_{p}")
            cuts.append((f"cut_pre_{p}", E[p] + moved))
        # ---- item p: reads, frees
        for v in tau:
            rv = reads[p].get(v, False)
            if rv is False:
                continue
            if Pi[v].terms:
                add(S[p] >= Pi[v], f"wait_{v[0]}{v[1]}_{p}", [rv])
            if H[v].terms:
                add(R[v] >= E[p], f"pend_{v[0]}{v[1]}_{p}", [rv, _lit(H[v])])
                if G[v].terms:  # no reader after an item that had v on the host only
                    m.add(G[v] + H[v] + _holds(rv) <= 2, f"pendG_{v[0]}{v[1]}_{p}")
            if P[v].terms:
                if rv is True:
                    P[v] = zero
                else:
                    nv = m.binary(f"P_{v[0]}{v[1]}_{p}")
                    rx = _holds(rv)
                    m.add(nv <= P[v], f"Pa_{v[0]}{v[1]}_{p}")
                    m.add(nv + rx <= 1, f"Pb_{v[0]}{v[1]}_{p}")
                    m.add(nv >= P[v] - rx, f"Pc_{v[0]}{v[1]}_{p}")
                    P[v] = nv
            fv = frees[p].get(v, False)
            if fv is not False and H[v].terms:
                m.add(H[v] + _holds(fv) <= 1, f"free_{v[0]}{v[1]}_{p}")
        for v in tau:
            if v in early_readers[p]:
                _host_since_offload(m, G, v, H[v], [hvars[v]] if v in hvars else [], f"{p}")
            else:
                G[v] = zero
        if p == n - 1:
            break
        # ---- link positions after item p
        cands = [v for v in tau if state_of(p + 1, v).terms or state_of(p + 1, v).const > 0.5]
        if not cands:
            continue
        can_run = bool(D[p].terms) or D[p].const > 0
        etas: dict[Value, list[Expr]] = {}
        for kappa in range(transfers_per_gap):
            late: Expr | None = None
            tq = m.continuous(f"T{p}_{kappa}", 0.0, U)
            pos = Position(p, Model.index(tq))
            m.add(tq >= S[p], f"anchor_{p}_{kappa}")
            if prev is not None:
                m.add(tq >= prev[0] + prev[1], f"link_{p}_{kappa}")
            busy = Expr()
            used = Expr()
            prefetching = Expr()
            for v in cands:
                sv = _x(state_of(p + 1, v))
                o = m.binary(f"off_{v[0]}{v[1]}_{p}_{kappa}")
                pos.off[v] = Model.index(o)
                m.add(o <= sv, f"offst_{v[0]}{v[1]}_{p}_{kappa}")
                m.add(o + H[v] + P[v] <= 1, f"offfree_{v[0]}{v[1]}_{p}_{kappa}")
                mv = makes[p].get(v, False)
                add(tq >= E[p], f"avail_{v[0]}{v[1]}_{p}_{kappa}", [m.literal(o), mv])
                rnew = m.continuous(f"R_{v[0]}{v[1]}_{p}_{kappa}", 0.0, U)
                if R[v].terms:  # unchanged unless offloaded here (pending readers)
                    m.add(rnew >= R[v], f"Rmono_{v[0]}{v[1]}_{p}_{kappa}")
                m.add(rnew <= R[v], f"Rkeep_{v[0]}{v[1]}_{p}_{kappa}",
                      only_if=m.literal(o, False))
                m.add(rnew >= tq + tau[v], f"Roff_{v[0]}{v[1]}_{p}_{kappa}",
                      only_if=m.literal(o))
                add(rnew >= E[p], f"Rrd_{v[0]}{v[1]}_{p}_{kappa}",
                    [m.literal(o), reads[p].get(v, False)])
                busy = busy + o * tau[v]
                used = used + o
                hnext = H[v] + o
                if H[v].terms:
                    q = m.binary(f"pre_{v[0]}{v[1]}_{p}_{kappa}")
                    pos.pre[v] = Model.index(q)
                    m.add(q <= H[v], f"preH_{v[0]}{v[1]}_{p}_{kappa}")
                    m.add(tq >= R[v], f"preR_{v[0]}{v[1]}_{p}_{kappa}", only_if=m.literal(q))
                    pinew = m.continuous(f"Pi_{v[0]}{v[1]}_{p}_{kappa}", 0.0, U)
                    if Pi[v].terms:
                        m.add(pinew >= Pi[v], f"Pimono_{v[0]}{v[1]}_{p}_{kappa}")
                    m.add(pinew >= tq + tau[v], f"Pi_{v[0]}{v[1]}_{p}_{kappa}",
                          only_if=m.literal(q))
                    Pi[v] = pinew
                    busy = busy + q * tau[v]
                    used = used + q
                    prefetching = prefetching + q
                    hnext = hnext - q
                    pn = m.binary(f"P_{v[0]}{v[1]}_{p}_{kappa}")
                    m.add(pn == P[v] + q, f"Pdef_{v[0]}{v[1]}_{p}_{kappa}")
                    P[v] = pn
                    if v in hvars and can_run:
                        if late is None:
                            late = m.binary(f"late_{p}_{kappa}")
                            m.add(tq >= E[p], f"late_{p}_{kappa}", only_if=m.literal(late))
                            m.add(tq <= E[p], f"early_{p}_{kappa}",
                                  only_if=m.literal(late, False))
                            _late_after_empty_slot(m, seq[p], late, chain, f"{p}_{kappa}")
                        m.add(hvars[v] + q - late <= 1, f"during_{v[0]}{v[1]}_{p}_{kappa}")
                hn = m.binary(f"H_{v[0]}{v[1]}_{p}_{kappa}")
                m.add(hn == hnext, f"Hdef_{v[0]}{v[1]}_{p}_{kappa}")
                R[v] = rnew
                H[v] = hn
            # issue order: the next op waits for a transfer listed before it to start
            u = m.binary(f"use_{p}_{kappa}")
            m.add(u == used, f"use_{p}_{kappa}")
            m.add(S[p + 1] >= tq, f"issue_{p}_{kappa}", only_if=m.literal(u))
            # symmetry: positions fill in order, and one after an empty slot only once the
            # position before it is taken (same plan, never an earlier start)
            if kappa > 0 or (last_used is not None and last_used[0] == p - 1):
                assert last_used is not None
                item = seq[p]
                if kappa > 0:
                    m.add(u <= last_used[1], f"fill_{p}_{kappa}")
                elif isinstance(item, ck.Slot):
                    y = Expr([(idx, 1.0) for _, idx in item.ops])
                    m.add(u <= y + last_used[1], f"fill_{p}_{kappa}")
            last_used = (p, u)
            if prefetching.terms:
                for w, eta in _gap_check(m, p, kappa, tq, pos, prefetching, cands, H, R,
                                         size,
                                         stored(cf.states[p + 1]) + after_delta[p] + held[p],
                                         memory_limit, late).items():
                    etas.setdefault(w, []).append(eta)
            prev = (tq, busy)
            link_total = link_total + busy
            positions.append(pos)
        for v, host_at in etas.items():
            if v in early_readers[p]:
                _host_since_offload(m, G, v, None, host_at, f"{p}_gap")
    obj = m.continuous("makespan", 0.0, U)
    m.add(obj >= E[n - 1], "makespan")
    if link_total.terms:
        m.add(obj >= link_total, "cut_link")
    for nm, e in cuts:
        m.add(obj >= e, nm)
    m.minimize(obj)
    durations = [t for t in (*uf, *ub, *tau.values()) if t > 0]
    return RematOffloadModel(m, cf, [Model.index(s) for s in S], positions, Model.index(obj),
                             U, chain, {**m.size, "host_vars": n_h, "positions": len(positions)},
                             min(durations, default=math.inf))


def build_link_relaxation(chain: Chain, memory_limit: int, bandwidth: float, *,
                          sweeps: int = 1, horizon: float | None = None,
                          deadlines: bool = True, host_values: bool = True,
                          host_items: Collection[int] | None = None,
                          read_deadlines: bool = False, cumulative_reads: bool = False,
                          window_jobs: bool = False, compact: bool = False) -> Model:
    r"""A small relaxation of :func:`build_remat_offload`: integral compute, aggregated link.

    The compute part is the same checkpoint formulation (same slots, same class, exact
    durations); the per-value link positions are replaced by one continuous *relief*
    ``r_p`` per item (the memory the host holds for it), with the item starts ``S_p`` of the
    model, the makespan ``T`` and

    * memory: ``checkpoint row_p - r_p <= M``; ``r_p <= stored_p - sum_v size_v reads[v,p]``;
    * offloads: ``u_q >= r_q - r_{q-1}``, ``u_q >= 0`` (``r_{-1} = 0``) and
      ``beta S_p >= sum_{q <= p} u_q``;
    * prefetches: ``d_q >= r_{q-1} - r_q``, ``d_q >= 0`` (``r_n = 0``) and
      ``beta (T - E_p) >= sum_{q > p} d_q``; the link: ``beta T >= sum_q (u_q + d_q)``.

    Its optimum is a lower bound on the model's (used by the exact methods as a proven
    bound and as a row ``makespan >= bound``). Proof: take any solution of the model and
    raise every ``h[v,p]`` to 1 wherever the model's rows allow it (``H = 1``, ``v`` not read
    by ``p``, ``R_v <= S_p``, no prefetch of ``v`` starting during ``p``); every row stays
    satisfied (``h`` only relieves memory and appears with the right sign in the link cuts).
    Set ``r_p = sum_v size_v h[v,p]``: the memory rows are the model's. ``R_v`` changes only
    at an offload and ``R_v <= S_p`` persists, a read with ``H = 1`` pushes ``R_v`` past the
    reader and a prefetch ends ``H``, so for one offload the items with ``h[v,.] = 1`` are one
    contiguous run: every run starting at item ``q`` owns an offload of ``v`` that ends at
    ``R_v <= S_q`` and a prefetch that starts at or after the run's last item ends (the
    ``late``/``during`` rows) and ends before ``T`` (a prefetched value is read before it is
    freed, ``wait`` rows; ``off + H + P <= 1``). These jobs are distinct and run one after
    the other on the link from time 0, so the offloads of the runs starting at
    ``q <= p`` fit in ``[0, S_p]`` and the prefetches of the runs ending at ``q - 1 >= p``
    fit in ``[E_p, T]``; ``u_q = sum_v size_v (h[v,q] - h[v,q-1])^+`` (the runs starting
    at ``q``, at least ``r_q - r_{q-1}``) and the symmetric ``d_q`` satisfy the rows. With
    ``T`` the model's makespan the relaxation is feasible, so its optimum is at most the
    model's (in the chain's time unit; exact durations, no grid).

    **Prefetch deadlines** (``deadlines=True``; :func:`_deadline_rows`): for an item ``p``
    and a backward-type item ``q > p`` (``Loss``, ``B k``), let ``V`` be the values that
    ``Loss`` or a ``B`` of ``(p, q]`` reads whenever they are stored (``abar^k``, ``a^{k-1}``,
    ``abar^{k-1}`` for ``B k``). Every value of ``V`` stored at ``p`` is read in ``(p, q]``
    (it is still stored at the ``B`` that reads it, or an op that read it freed it before:
    no op frees a value it does not read), so a value of ``V`` on the host during ``p`` is
    prefetched by a job that starts after ``p`` ends (``late``/``during`` rows) and ends
    before its reader starts (``wait`` rows), inside ``[E_p, S_q]``; these jobs are distinct
    and share the one link. The host part outside ``V`` is at most the stored, unread size
    outside ``V``, so ``r_p - sum_{v not in V} size_v (stored_v - reads_v)_p <= beta (S_q -
    E_p)`` holds for the solution built above: the rows keep the relaxation a relaxation.
    They lift its bound where the link relaxation alone lets a large relief at the loss
    drain to the end of the schedule.

    **Values on the host** (``host_values=True``, the default; :func:`_host_relief`): the
    relief is no longer one number per item but the binaries ``h[v,p]`` of the proof above,
    one per value that may be stored unread at ``p`` (``h <= stored_v - reads_v``), with
    ``r_p = sum_v size_v h[v,p]``, per-value run starts and ends
    ``up[v,q] >= h[v,q] - h[v,q-1]``, ``dn[v,q] >= h[v,q-1] - h[v,q]`` and
    ``u_q >= sum_v size_v up[v,q]``, ``d_q >= sum_v size_v dn[v,q]``: exactly the solution
    the proof builds (``u_q`` is defined there as that sum), so they keep the relaxation a
    relaxation. The deadline rows then count the values of ``V`` themselves,
    ``sum_{v in V} size_v h[v,p] <= beta (S_q - E_p)`` (each such value's prefetch lies in
    ``[E_p, S_q]``, argument above; these rows imply the aggregated ones, which are left
    out). Digest ``offload.md`` 0.2 (O.1: one link; O.7: a value leaves the GPU only when its
    offload ends and returns when its prefetch starts). Measured on ``random_chain(10,
    seed=1)`` at its 10 % limit (59, bandwidth 1): the aggregated rows let a tape of 10
    (``abar^2``) and 5 of ``a^1`` return in the two time units between ``B 4`` and ``B 3``;
    the master's compute sequence is worth 87 in the model but 74 in the aggregated
    relaxation, 84 with these rows; the relaxation's optimum rises from 74 to 76.

    **Read deadlines** (``read_deadlines=True``, default false; :func:`_read_deadline`):
    the deadline rows above end only at ``Loss`` / ``B`` items, because only their reads are
    fixed by the stored state; a recomputation slot ``q`` (``F_*`` of the backward pass)
    reads ``a^{j-1}`` or ``abar^{j-1}`` as its ``rd`` binaries say. For an item ``p`` and a
    slot ``q > p`` let ``V`` be the values a ``Loss`` / ``B`` of ``(p, q)`` reads (as above)
    and ``W`` those ``q`` may read. A value ``w`` of ``W`` that ``q`` reads (``rd_w = 1``)
    and that is on the host during ``p`` (``h[w,p] = 1`` in the proof's point) is prefetched
    by a job that starts after ``p`` ends (the ``late``/``during`` rows) and ends before
    ``q`` starts (``q`` reads it: the ``wait`` rows), so inside ``[E_p, S_q]``, like the
    values of ``V``; the jobs are distinct and share the link. Hence ``sum_{v in V} size_v
    h[v,p] + sum_{w in W} size_w h[w,p] rd_w <= beta (S_q - E_p)``; the product is at least
    ``h + rd - 1``, which gives the row with host binaries. Without them the host part
    outside ``V`` and the read values of ``W`` is at most ``sum unread_v`` over the values
    outside ``V`` and ``W`` plus ``size_w (1 - rd_w)`` per ``w`` of ``W`` (``h <= 1``), so
    ``r_p`` minus these is at most the left side above: the aggregated row. Measured on
    ``random_chain(10, seed=1)`` at its 10 % limit (59, bandwidth 1): the host relaxation's
    own best compute sequence (76) is worth 90 in the model (CP-SAT, proven): the
    relaxation brings ``abar^1`` (14) back during the recomputation ``F_all 2`` that reads
    it; with these rows that sequence's bound is 85.

    **Cumulative reads** (``cumulative_reads=True``, with ``read_deadlines`` and
    ``host_values``; default false; :func:`_deadline_rows`, :func:`_read_before`): the read
    deadline of ``(p, q)`` counts only the values slot ``q`` itself reads, so values that
    *earlier* slots of ``(p, q)`` read were prefetched inside ``[E_p, S_q]`` too but are
    counted in no common row. For a value ``w`` outside ``V(p, q)`` that some slot ``q'``
    of ``(p, q]`` may read, let ``g[w,p,q]`` be 1 when ``w`` is on the host during ``p``
    (``h[w,p] = 1`` in the proof's point) and a slot of ``(p, q]`` reads it. Then its host
    copy is prefetched by a job that starts after ``p`` ends and ends before the first
    reader after ``p`` starts (the argument of the read deadlines: a reading slot has ``w``
    stored, and a value leaves the GPU only through an op that reads it), which is at or
    before ``q'``, inside ``[E_p, S_q]``; these jobs and those of ``V(p, q)`` are distinct,
    so ``sum_{v in V} size_v h[v,p] + sum_w size_w g[w,p,q] <= beta (S_q - E_p)``. The model
    carries a continuous ``z[w,p,q]`` in ``[0, 1]`` with ``z >= h[w,p] + rd_{w,q'} - 1`` for
    each slot ``q' <= q`` reading ``w`` (one row at each such slot, ``z[w,p,q] >=`` the
    previous one): ``g`` satisfies them, so the proof's point with ``z = g`` satisfies the
    rows (the row with ``z`` at its least value is weaker than with ``g``). A single ``rd``
    literal per value in the row (``h + rd - 1``, possibly negative) would be far weaker:
    an empty slot's ``rd = 0`` subtracts the value's size. Measured on ``random_chain(10,
    seed=3)`` at its 10 % limit (55): the host relaxation's own best sequence is worth 83
    in it and 90.86 in the model (CP-SAT, proven; the relaxation brings ``a^0`` and
    ``abar^3`` back in 11 time units for two reading slots where the link needs 17.6); with
    these rows that sequence's bound is 90.86, and the relaxation's optimum (host rows on
    every item) rises from 83 to 84.

    **Window jobs** (``window_jobs=True``, with ``host_values``; default false; ``ro20``;
    :func:`_window_job_rows`): the rows above bound the jobs of one kind in a window: the
    offloads before ``S_p`` (from time 0), the prefetches after ``E_p``, the prefetches due
    before a reader. For two items ``p < q`` with host binaries, every job below lies
    inside ``[E_p, S_q]`` in the proof's point, they are distinct and share the one link,
    so ``sum_v size_v (pf + g + o)[v,p,q] <= beta (S_q - E_p)``:

    * ``pf[v,p,q]``: the prefetch that ends ``v``'s host run through ``p``, when ``v`` is
      read by a ``Loss`` / ``B`` of ``(p, q]`` (``h[v,p]``; the deadline rows' argument),
      by a slot of ``(p, q]`` (``h[v,p] + rd - 1``; the read deadlines' argument) or when
      ``v`` is on the host again at an item ``q' <= q`` after an item ``r`` of ``(p, q')``
      where it is not (below). It starts after the run's last item ends (``late`` /
      ``during`` rows), at or after ``E_p``;
    * ``g[v,p,q] >= h[v,p] + (1 - h[v,r]) + h[v,q'] - 2`` for items ``p < r < q' <= q``
      with host binaries (``h[v,r] = 0`` where ``v`` has no binary at ``r``: it cannot be
      stored unread there): the run through ``p`` ended before ``r`` ends (the runs are
      contiguous, proof above: ``h`` is 1 wherever the rows allow while ``v`` is moved, and
      no reader follows an item that counted ``v`` on the host while it is still offloaded,
      the ``G`` rows), so ``q'`` lies in a later run, whose offload ends by ``S_{q'} <=
      S_q`` and starts after that prefetch ended (``off + H + P <= 1``: no offload of a
      moved or prefetched-unread value; one link): the prefetch and the re-offload both lie
      in the window, ``pf`` counts the first and ``g`` the second;
    * ``o[v,p,q] >= h[v,q'] - stored_v(p)`` for ``q'`` of ``(p, q]``: a value not stored
      (GPU or host: ``cf.states[p]``, a value on the host stays stored until it is
      prefetched) before ``p`` but on the host during ``q'`` was produced by an item at or
      after ``p`` (``nodup`` rows: never recomputed while stored), so the offload of its run
      through ``q'`` starts at or after ``E_p`` (offload after its producer) and ends by
      ``S_{q'}``. Such a value has ``h[v,p] = 0``, so no ``pf`` or ``g`` of it.

    Each indicator is a continuous variable in ``[0, 1]`` above these lower bounds (chained
    over ``q``), so the proof's point with the indicators at their values satisfies the
    rows. Measured: on 4-stage chains (``random_chain(4, seed, max_size=8)``, the proofs
    benchmark's link) they lift the host relaxation's own best sequence to its value in the
    model (seed 8 at 35: 26.37 -> 26.74; seed 29 at 32: 29.58 -> 30.16) and the relaxation's
    optimum with it (26.37 -> 26.74, 29.58 -> 30). On ``random_chain(12, seed=1)`` at its
    10 % limit (58) the host relaxation's best sequence (70.78) is worth 71.08 in the model
    (CP-SAT, proven): the relaxation brings ``a^0`` back and offloads it again between
    ``B 12`` and ``B 11`` (72 / 36 time units, where the two transfers need 230 / 36),
    which these rows forbid; but with host binaries on every item (210 k variables) HiGHS
    does not raise that sequence's bound above 70.78 in 600 s, and with them on the 34
    items the sequence uses, or on the lazy stage's items, the sequence's (and the
    relaxation's) optimum stays 70.78. Solve these
    models with HiGHS's presolve off: HiGHS 1.14.0's MIP presolve returned an optimum above
    a feasible point on 4-stage sequences with them (``random_chain(4, seed=18, max_size=8)``
    at 39 and 40: 47.2 against the sequence's value 42.2; ``seed=9`` at 47 with a first
    writing of the same rows, where ``pf`` was bounded by ``g``; presolve off and CBC agree
    with the model there).

    **Host rows on some items** (``host_items``, with ``host_values``; ``None``: every item):
    the items of ``host_items`` get the binaries ``h[v,p]`` and their rows as above, the
    others the aggregated relief ``r_p`` and its rows; the per-value run rows are written
    between two neighbouring items that both have binaries (and at the schedule's ends).
    Still a relaxation: the point the proof builds, with ``r_p = sum_v size_v h[v,p]`` on
    the items without binaries, satisfies the aggregated rows there (``h <= stored -
    reads``; the per-value deadline rows imply the aggregated ones) and the host rows on
    the others, and the rows kept are a subset of the two models' rows. Its optimum lies
    between the aggregated relaxation's and the one with host rows everywhere: the lazy
    host stage of :func:`~optmem.solvers.remat_offload_exact._relaxation_bound` adds items
    only where the current solution violates their rows (:func:`host_violations`).

    **Compact deadline rows** (``compact=True``, default false; :func:`_compact_outside`):
    the same relaxation written with fewer non-zeros. On the items without host binaries a
    deadline row of ``(p, q)`` subtracts from ``r_p`` the unread size of every value
    outside ``V(p, q)`` (and a read deadline outside ``W`` too): about 30 terms per row, and
    one row per pair, so the read deadlines alone had 1.08 M non-zeros on ResNet-50 at its
    10 % limit (L = 22; the plain relaxation 0.12 M). With ``compact`` each item ``p`` gets
    continuous ``y[p,k] = r_p - sum_{v not in V_k} unread_v`` for the successive sets
    ``V_k`` that ``V(p, q)`` takes as ``q`` advances, written as a chain of equalities
    (``y[p,0] = r_p - sum_v unread_v``, ``y[p,k] = y[p,k-1] + sum_{v in V_k - V_{k-1}}
    unread_v``), and each row reads ``y[p,k]`` (plus ``unread_w - size_w (1 - rd_w)`` for the
    at most two values of ``W``). The ``y`` are defined by equalities from the other
    variables, so the projection of the feasible set (LP and MILP) on the original
    variables is the same: same optimum, same LP bound (tested equal on random chains).
    The link rows read running sums the same way (:func:`_running_sums`: ``O(n)``
    non-zeros for the offload and prefetch rows instead of ``O(n^2)``; 0.09 M of the plain
    stage's 0.12 M on ResNet-50).
    """
    cf = ck.build_formulation(chain, memory_limit, "full", sweeps, reductions=False)
    a = [chain.input_size, *chain.output_size]
    abar = [chain.input_size, *chain.saved_size]
    uf = [0.0, *chain.fwd_time]
    ub = [0.0, *chain.bwd_time, chain.loss_bwd_time]
    n = len(cf.sequence)
    if horizon is None:
        horizon = (sum(uf) * n + sum(ub)
                   + (2 * (sum(a) + sum(abar)) / bandwidth if bandwidth > 0 else 0.0) + 1.0)
    U = float(horizon)
    m = Model("remat_offload_relaxation")
    for nm in cf.names:
        m.binary(nm)
    for con in cf.constraints:
        if not con.name.startswith("mem_"):
            m.add(Relation(Expr(con.terms), con.lo, con.hi), con.name)
    D, reads, _, _, _ = _item_facts(m, cf, uf, ub, a)
    S = [m.continuous(f"S{p}", 0.0, 0.0 if p == 0 else U) for p in range(n)]
    makespan = m.continuous("makespan", 0.0, U)
    for p in range(n - 1):
        m.add(S[p + 1] >= S[p] + D[p], f"seq_{p}")
    m.add(makespan >= S[n - 1] + D[n - 1], "makespan")

    def size(v: Value) -> int:
        return a[v[1]] if v[0] == A_ else abar[v[1]]

    relief: list[Expr] = []
    hosts: list[dict[Value, Expr] | None] = []
    for p in range(n):
        A, T = cf.states[p]
        name, mexpr = cf.memory_rows[p]
        if bandwidth <= 0:
            m.add(_x(mexpr) <= memory_limit, name)
            continue
        if host_values and (host_items is None or p in host_items):
            held = _host_relief(m, p, _unread(cf, p, reads, size), size)
            hosts.append(held)
            relief.append(Expr.sum(h * size(v) for v, h in held.items()))
            m.add(_x(mexpr) - relief[p] <= memory_limit, name)
            continue
        hosts.append(None)
        r = m.continuous(f"r{p}", 0.0, float(sum(a) + sum(abar)))
        free = Expr.sum([*(_x(e) * a[i] for i, e in A.items()),
                         *(_x(e) * abar[i] for i, e in T.items())])
        for v, lit in reads[p].items():
            if lit is True:
                free = free - size(v)
            elif lit is not False:
                free = free - _holds(lit) * size(v)
        m.add(r <= free, f"relief_{p}")
        m.add(_x(mexpr) - r <= memory_limit, name)
        relief.append(r)
    if relief and deadlines:
        _deadline_rows(m, cf, reads, relief, D, S, bandwidth, size, hosts,
                       read_deadlines=read_deadlines, cumulative=cumulative_reads,
                       compact=compact)
    if relief and window_jobs:
        _window_job_rows(m, cf, reads, hosts, D, S, bandwidth, size)
    if relief:
        cap = float(sum(a) + sum(abar))
        up: list[Expr] = []
        down: list[Expr] = []
        for q in range(n + 1):
            cur = relief[q] if q < n else Expr()
            prev = relief[q - 1] if q > 0 else Expr()
            u = m.continuous(f"u{q}", 0.0, cap)
            d = m.continuous(f"d{q}", 0.0, cap)
            m.add(u >= cur - prev, f"u{q}")
            m.add(d >= prev - cur, f"d{q}")
            cur_h = hosts[q] if q < n else {}
            prev_h = hosts[q - 1] if q > 0 else {}
            if cur_h is not None and prev_h is not None:
                runs = _run_changes(m, q, cur_h, prev_h, size)
                m.add(u >= runs[0], f"u_values{q}")
                m.add(d >= runs[1], f"d_values{q}")
            up.append(u)
            down.append(d)
        if compact:
            offloaded, prefetched = _running_sums(m, up, down, (n + 1) * cap)
        else:
            offloaded = [Expr.sum(up[:p + 1]) for p in range(n + 1)]
            prefetched = [Expr.sum(down[p:]) for p in range(n + 1)]
        for p in range(n):
            m.add(S[p] * bandwidth >= offloaded[p], f"offloads_{p}")
            m.add((makespan - S[p] - D[p]) * bandwidth >= prefetched[p + 1],
                  f"prefetches_{p}")
        m.add(makespan * bandwidth >= offloaded[n] + prefetched[0], "link")
    m.minimize(makespan)
    return m


HOST_ITEM_MAX_VALUES = 14  # most host binaries of one item host_violations enumerates


def host_item_rows(full: Model, aggregated: Model
                   ) -> dict[int, tuple[list[int], list[Constraint]]]:
    """Per item ``p``: its host binaries ``h[v,p]`` in ``full`` and the rows local to them.

    ``full`` is :func:`build_link_relaxation` with the host rows on every item, ``aggregated``
    the same without them (``host_items=()``). A row is local to ``p`` when the host
    binaries it holds are those of ``p`` only and its other variables are ``aggregated``'s
    (compute binaries, item starts, makespan) or the ``z[w,p,q]`` of ``p``
    (``cumulative_reads``): ``size_v h <= unread_v``, the memory row, the per-value
    deadline rows of ``p`` and the rows of its ``z``. The run rows (``up``/``dn``) are not
    local.
    """
    names = {v.name for v in aggregated.vars}
    item: dict[int, int] = {}
    for v in full.vars:
        if v.name.startswith("h_"):
            item[v.index] = int(v.name.rsplit("_", 1)[1])
        elif v.name.startswith("z_"):
            item[v.index] = int(v.name.split("_")[2])
    out: dict[int, tuple[list[int], list[Constraint]]] = {}
    for i, p in item.items():
        out.setdefault(p, ([], []))
        if full.vars[i].name.startswith("h_"):
            out[p][0].append(i)
    for con in full.constraints:
        held = {item[i] for i, _ in con.terms if i in item}
        if len(held) != 1 or con.enforce or any(
                i not in item and full.vars[i].name not in names for i, _ in con.terms):
            continue
        out[held.pop()][1].append(con)
    return out


def host_violations(full: Model, rows: dict[int, tuple[list[int], list[Constraint]]],
                    master: Model, values: Sequence[float], covered: Collection[int]
                    ) -> list[int]:
    """The items outside ``covered`` whose local host rows the master's solution violates.

    ``values`` is a solution of ``master`` (:func:`build_link_relaxation` with
    ``host_items=covered``); ``rows`` is :func:`host_item_rows`. An item is violated when no
    0/1 choice of its host binaries satisfies its local rows with the master's compute
    binaries and item starts (enumerated, each ``z`` at its least value given the choice;
    an item with more than :data:`HOST_ITEM_MAX_VALUES` binaries left free counts as
    violated). The choice only decides which rows a lazy master adds; every added row is
    valid whatever it picks.
    """
    index = {v.name: i for i, v in enumerate(master.vars)}
    fixed = {v.index: values[index[v.name]] for v in full.vars if v.name in index}
    out = []
    for p in sorted(rows):
        hs, cons = rows[p]
        if p in covered or not cons:
            continue
        if not _item_fits(hs, cons, fixed):
            out.append(p)
    return out


def _item_fits(hs: Sequence[int], cons: Sequence[Constraint], fixed: dict[int, float]) -> bool:
    """Whether some 0/1 values of ``hs`` satisfy ``cons`` with the rest ``fixed``.

    A variable of ``cons`` in neither (a ``z`` of ``cumulative_reads``) takes its least
    value: the largest of 0 and what its ``>=`` rows ask, in the order of the variables
    (each ``z`` is bounded below by earlier ones only).
    """
    derived = sorted({i for c in cons for i, _ in c.terms if i not in fixed and i not in hs})
    lower = {z: [c for c in cons if c.hi is None and c.lo is not None
                 and any(i == z and x > 0 for i, x in c.terms)
                 and all(i <= z or i not in derived for i, _ in c.terms)] for z in derived}

    def holds(con: Constraint, known: dict[int, float]) -> bool:
        s = sum(c * (known[i] if i in known else fixed[i]) for i, c in con.terms)
        return (con.lo is None or s >= con.lo - 1e-6) and (con.hi is None or s <= con.hi + 1e-6)

    def complete(chosen: dict[int, float]) -> dict[int, float]:
        known = dict(chosen)
        for z in derived:
            least = 0.0
            for c in lower[z]:
                coef = sum(x for i, x in c.terms if i == z)
                rest = sum(x * (known[i] if i in known else fixed[i])
                           for i, x in c.terms if i != z)
                assert c.lo is not None
                least = max(least, (c.lo - rest) / coef)
            known[z] = least
        return known

    free = [h for h in hs  # a binary its own bound row forces to 0 is not enumerated
            if all(holds(c, {h: 1}) for c in cons
                   if all(i == h or (i not in hs and i in fixed) for i, _ in c.terms))]
    if len(free) > HOST_ITEM_MAX_VALUES:
        return False
    zeros = {h: 0.0 for h in hs}
    for bits in itertools.product((0, 1), repeat=len(free)):
        known = complete({**zeros, **dict(zip(free, map(float, bits), strict=True))})
        if all(holds(c, known) for c in cons):
            return True
    return False


def _unread(cf: ck.Formulation, p: int, reads: Sequence[dict[Value, Literal | bool]],
            size: Callable[[Value], int]) -> dict[Value, Expr]:
    """``size_v (stored_v - reads_v)`` at item ``p``, per value that may be stored unread."""
    A, T = cf.states[p]
    stored: dict[Value, Expr] = {(A_, i): _x(e) for i, e in A.items()}
    stored.update({(ABAR_, i): _x(e) for i, e in T.items()})
    unread: dict[Value, Expr] = {}
    for v, e in stored.items():
        lit = reads[p].get(v, False)
        if lit is True:
            continue
        if lit is not False:
            e = e - _holds(lit)
        if e.terms or e.const > 0:
            unread[v] = e * size(v)
    return unread


def _host_relief(m: Model, p: int, unread: dict[Value, Expr],
                 size: Callable[[Value], int]) -> dict[Value, Expr]:
    """The binaries ``h[v,p]`` of :func:`build_link_relaxation` (``host_values``).

    One per value that may be stored unread at item ``p`` (``unread``: its size times
    ``stored - reads``, :func:`_unread`), with ``size_v h <= unread_v``.
    """
    out: dict[Value, Expr] = {}
    for v, e in unread.items():
        h = m.binary(f"h_{v[0]}{v[1]}_{p}")
        m.add(h * size(v) <= e, f"h_{v[0]}{v[1]}_{p}")
        out[v] = h
    return out


def _run_changes(m: Model, q: int, cur: dict[Value, Expr], prev: dict[Value, Expr],
                 size: Callable[[Value], int]) -> tuple[Expr, Expr]:
    """``sum_v size_v up[v,q]`` and ``sum_v size_v dn[v,q]`` (host runs starting / ending).

    ``up >= h[v,q] - h[v,q-1]`` and ``dn >= h[v,q-1] - h[v,q]``, continuous in ``[0, 1]``
    (a missing ``h`` is 0): :func:`build_link_relaxation` (``host_values``).
    """
    ups: list[Expr] = []
    downs: list[Expr] = []
    for v in sorted(cur.keys() | prev.keys()):
        now, before = cur.get(v, Expr()), prev.get(v, Expr())
        tag = f"{v[0]}{v[1]}_{q}"
        up = m.continuous(f"up_{tag}", 0.0, 1.0)
        dn = m.continuous(f"dn_{tag}", 0.0, 1.0)
        m.add(up >= now - before, f"up_{tag}")
        m.add(dn >= before - now, f"dn_{tag}")
        ups.append(up * size(v))
        downs.append(dn * size(v))
    return Expr.sum(ups), Expr.sum(downs)


def _deadline_rows(m: Model, cf: ck.Formulation, reads: Sequence[dict[Value, Literal | bool]],
                   relief: Sequence[Expr], D: Sequence[Expr], S: Sequence[Expr],
                   bandwidth: float, size: Callable[[Value], int],
                   hosts: Sequence[dict[Value, Expr] | None] = (), *,
                   read_deadlines: bool = False, cumulative: bool = False,
                   compact: bool = False) -> None:
    """The prefetch deadlines of the link relaxation (its docstring).

    For every item ``p`` and backward-type item ``q > p`` whose reads add a value that may
    be stored unread at ``p``: ``r_p - (stored, unread size at p outside V(p, q)) <= beta
    (S_q - E_p)``; with ``hosts`` (the ``h[v,p]``, ``host_values``) the stronger
    ``sum_{v in V(p, q)} size_v h[v,p] <= beta (S_q - E_p)``. ``read_deadlines``: also at
    every forward slot ``q`` (:func:`_read_deadline`). ``cumulative`` (with them, on the
    items with host binaries): every row of ``(p, q)`` also counts ``size_w z[w,p,q]`` for
    the values ``w`` outside ``V(p, q)`` that a slot of ``(p, q]`` may read, ``z`` continuous
    in ``[0, 1]`` with ``z[w,p,q] >= h[w,p] + rd_{w,q'} - 1`` for each such slot ``q'``
    (``build_link_relaxation``, **Cumulative reads**). ``compact`` (items without host
    binaries): the rows read :func:`_compact_outside`'s ``y[p,k]`` (same relaxation).
    """
    n = len(cf.sequence)
    for p in range(n):
        unread = _unread(cf, p, reads, size)
        held = hosts[p] if hosts else None
        seen: set[Value] = set()
        outside = _compact_outside(m, p, relief[p], unread, size) if compact and held is None \
            else None
        early: dict[Value, Expr] = {}  # cumulative: z[w,p,q] of the last slot q reading w
        for q in range(p + 1, n):
            if isinstance(cf.sequence[q], ck.Slot):
                if not read_deadlines:
                    continue
                wanted: dict[Value, Literal | bool] = {
                    w: lit for w, lit in reads[q].items()
                    if w not in seen and lit is not False and w in unread}
                if not wanted:
                    continue
                if not cumulative or held is None:
                    extra = {} if outside is None else {"outside": outside(seen)}
                    _read_deadline(m, p, q, wanted, seen, unread, held, relief[p], D, S,
                                   bandwidth, size, **extra)
                    continue
                for w, lit in wanted.items():
                    if w in held:
                        early[w] = _read_before(m, p, q, w, held[w], lit, early.get(w))
            else:
                new = set(reads[q]) - seen
                seen |= new
                if not new & unread.keys():
                    continue
            if held is not None:
                lhs = Expr.sum([*(h * size(v) for v, h in held.items() if v in seen),
                                *(z * size(w) for w, z in early.items() if w not in seen)])
            elif outside is not None:
                lhs = outside(seen)
            else:
                lhs = relief[p] - Expr.sum(e for v, e in unread.items() if v not in seen)
            m.add(lhs <= (S[q] - S[p] - D[p]) * bandwidth, f"deadline_{p}_{q}")


def _window_job_rows(m: Model, cf: ck.Formulation,
                     reads: Sequence[dict[Value, Literal | bool]],
                     hosts: Sequence[dict[Value, Expr] | None], D: Sequence[Expr],
                     S: Sequence[Expr], bandwidth: float, size: Callable[[Value], int]
                     ) -> None:
    r"""The window-job rows of the link relaxation (``window_jobs``; its docstring).

    For items ``p < q`` that both have host binaries, ``sum_v size_v (pf[v,p,q] + g[v,p,q]
    + o[v,p,q]) <= beta (S_q - E_p)`` with continuous ``[0, 1]`` lower bounds of the
    indicators of the jobs that lie inside ``[E_p, S_q]``:

    * ``pf``, the prefetch that ends ``v``'s host run at ``p``: ``h[v,p]`` for the values
      ``V(p, q)`` a ``Loss`` / ``B`` of ``(p, q]`` reads; otherwise ``>= h[v,p] + rd - 1``
      for a slot of ``(p, q]`` that reads ``v`` and ``>= g[v,p,q]``;
    * ``g``, the offload of a later host run: ``>= h[v,p] + k + h[v,q'] - 2`` for an item
      ``q'`` of ``(p, q]`` with host binaries and ``k`` the witness that ``v`` is off the
      host at an item between (``>= 1 - h[v,r]``, ``1`` where ``v`` has no host binary:
      it cannot be stored unread there);
    * ``o``, the offload of a value not stored before ``p``: ``>= h[v,q'] - stored_v(p)``.
    """
    n = len(cf.sequence)
    items = [q for q in range(n) if q < len(hosts) and hosts[q]]
    for p in items:
        held = hosts[p]
        assert held is not None
        A0, T0 = cf.states[p]
        seen: set[Value] = set()
        pf: dict[Value, Expr] = {}
        gap: dict[Value, Expr] = {}
        wit: dict[Value, Expr] = {}
        new: dict[Value, Expr] = {}

        def var(kind: str, v: Value, q: int, lows: list[Expr], prev: Expr | None,
                p: int = p) -> Expr:
            tag = f"w{kind}{len(m.vars)}_{v[0]}{v[1]}_{p}_{q}"
            x = m.continuous(tag, 0.0, 1.0)
            for i, lo in enumerate(lows):
                m.add(x >= lo, f"{tag}_{i}")
            if prev is not None:
                m.add(x >= prev, f"{tag}_p")
            return x

        for q in range(p + 1, n):
            item = cf.sequence[q]
            here = hosts[q] if q < len(hosts) else None
            changed = False
            if not isinstance(item, ck.Slot):
                for v in reads[q]:  # the dict's order: rows independent of the hash seed
                    if v in seen:
                        continue
                    seen.add(v)
                    if v in held:
                        pf[v] = held[v]
            else:
                for w, lit in reads[q].items():
                    if w in seen or w not in held or lit is False:
                        continue
                    pf[w] = var("pf", w, q, [held[w] + _holds(lit) - 1], pf.get(w))
            if here is not None:
                for v, h in here.items():
                    if v in held and v in wit:
                        low = held[v] + wit[v] + h - 2
                        gap[v] = var("g", v, q, [low], gap.get(v))
                        changed = True
                        if v not in seen:
                            pf[v] = var("pf", v, q, [low], pf.get(v))
                    st = _x((A0 if v[0] == A_ else T0)[v[1]])
                    if v not in held and not (not st.terms and st.const > 0.5):
                        new[v] = var("o", v, q, [h - st], new.get(v))
                        changed = True
                for v in held:
                    if v not in wit or wit[v].terms:
                        wit[v] = Expr((), 1.0) if v not in here else \
                            var("k", v, q, [1 - here[v]], wit.get(v))
            if not changed or here is None:
                continue
            lhs = Expr.sum([*(x * size(v) for v, x in pf.items()),
                            *(x * size(v) for v, x in gap.items()),
                            *(x * size(v) for v, x in new.items())])
            m.add(lhs <= (S[q] - S[p] - D[p]) * bandwidth, f"wjobs_{p}_{q}")


def _running_sums(m: Model, up: Sequence[Expr], down: Sequence[Expr], cap: float
                  ) -> tuple[list[Expr], list[Expr]]:
    """``sum(up[:p + 1])`` and ``sum(down[p:])`` for every ``p``, as chains of equalities.

    ``compact`` of :func:`build_link_relaxation`: continuous variables equal to the running
    sums (``U_p = U_{p-1} + u_p``, ``P_p = P_{p+1} + d_p``), so the link rows read one
    variable each instead of ``O(n)`` terms; defined by equalities, the relaxation is the
    same.
    """
    offloaded: list[Expr] = []
    for p, u in enumerate(up):
        total = m.continuous(f"cu_{p}", 0.0, cap)
        m.add(total == (offloaded[-1] + u if offloaded else u), f"cu_{p}")
        offloaded.append(total)
    prefetched: list[Expr] = [Expr()] * len(down)
    after: Expr | None = None
    for p in range(len(down) - 1, -1, -1):
        total = m.continuous(f"cd_{p}", 0.0, cap)
        m.add(total == (after + down[p] if after is not None else down[p]), f"cd_{p}")
        prefetched[p] = after = total
    return offloaded, prefetched


def _compact_outside(m: Model, p: int, relief: Expr, unread: dict[Value, Expr],
                     size: Callable[[Value], int]) -> Callable[[set[Value]], Expr]:
    """``seen -> y``: a variable equal to ``r_p - sum_{v not in seen} unread_v`` (``compact``).

    ``seen`` only grows between calls (the values read by the ``Loss`` / ``B`` items after
    ``p``, :func:`_deadline_rows`); a new ``y[p,k]`` is added when it grew by values of
    ``unread``, by the equality ``y[p,k] = y[p,k-1] + sum`` of their unread sizes
    (``y[p,0] = r_p - sum_v unread_v``). Equalities that define new variables from the
    others: the relaxation is the same (``build_link_relaxation``, **Compact deadline
    rows**).
    """
    # |y| <= sum_v size_v: r_p is at most the unread size (its relief row), each unread_v
    # at most size_v (stored at most 1): the bounds cut nothing
    cap = float(sum(size(v) for v in unread)) + 1.0
    counted: set[Value] = set()
    chain: list[Expr] = []

    def outside(seen: set[Value]) -> Expr:
        new = (seen & unread.keys()) - counted
        if not chain or new:
            y = m.continuous(f"y_{p}_{len(chain)}", -cap, cap)
            if not chain:
                rest = Expr.sum(e for v, e in unread.items() if v not in seen)
                m.add(y == relief - rest, f"y_{p}_{len(chain)}")
            else:
                m.add(y == chain[-1] + Expr.sum(unread[v] for v in sorted(new)),
                      f"y_{p}_{len(chain)}")
            counted.update(new)
            chain.append(y)
        return chain[-1]

    return outside


def _read_before(m: Model, p: int, q: int, w: Value, h: Expr, lit: Literal | bool,
                 before: Expr | None) -> Expr:
    """``z[w,p,q]``: ``w`` on the host at ``p`` and read by a slot of ``(p, q]`` (a lower bound).

    ``z >= h[w,p] + rd_{w,q} - 1`` (``rd`` the literal ``lit`` of slot ``q``) and ``z >=``
    ``before`` (the same at the previous slot reading ``w``); ``cumulative`` rows of
    :func:`_deadline_rows`.
    """
    tag = f"{w[0]}{w[1]}_{p}_{q}"
    z = m.continuous(f"z_{tag}", 0.0, 1.0)
    m.add(z >= h + _holds(lit) - 1, f"z_{tag}")
    if before is not None:
        m.add(z >= before, f"zz_{tag}")
    return z


def _read_deadline(m: Model, p: int, q: int, wanted: dict[Value, Literal | bool],
                   seen: set[Value], unread: dict[Value, Expr], held: dict[Value, Expr] | None,
                   relief: Expr, D: Sequence[Expr], S: Sequence[Expr], bandwidth: float,
                   size: Callable[[Value], int], *, outside: Expr | None = None) -> None:
    r"""The prefetch deadline of item ``p`` at an item ``q > p`` with slot reads ``wanted``.

    ``wanted`` (``W``) maps values a forward slot of ``(p, q]`` may read (``rd`` literals:
    ``a^{j-1}`` or ``abar^{j-1}``) that no ``Loss`` / ``B`` of ``(p, q]`` reads to the
    literal of one such slot (``read_deadlines``: the values slot ``q`` may read), ``seen``
    the values those read (``V(p, q)`` of :func:`build_link_relaxation`). With host
    binaries: ``sum_{v in seen} size_v h[v,p] + sum_{w in W} size_w (h[w,p] + rd_w - 1) <=
    beta (S_q - E_p)``; aggregated: ``r_p - sum_{v not in seen or W} unread_v - sum_{w in
    W} size_w (1 - rd_w) <= beta (S_q - E_p)``. Validity: see the docstring of
    :func:`build_link_relaxation` (**Read deadlines**, **Cumulative reads**). ``outside``
    (aggregated, ``compact``): an expression equal to ``r_p - sum_{v not in seen}
    unread_v``, which the row reads instead of the sum (same row).
    """
    if held is not None:
        lhs = Expr.sum([*(h * size(v) for v, h in held.items() if v in seen),
                        *((held[w] + _holds(lit) - 1) * size(w)
                          for w, lit in wanted.items() if w in held)])
    elif outside is not None:
        lhs = outside + Expr.sum([*(unread[w] for w in wanted),
                                  *((_holds(lit) - 1) * size(w) for w, lit in wanted.items())])
    else:
        lhs = relief - Expr.sum([*(e for v, e in unread.items()
                                   if v not in seen and v not in wanted),
                                 *((1 - _holds(lit)) * size(w) for w, lit in wanted.items())])
    m.add(lhs <= (S[q] - S[p] - D[p]) * bandwidth, f"rdeadline_{p}_{q}")


def _early_readers(D: Sequence[Expr], reads: Sequence[dict[Value, Literal | bool]]
                   ) -> list[set[Value]]:
    """Per item ``p``, the values an item after ``p`` may read early.

    Early: before the next item that always takes time (a backward op of positive
    duration), that item excluded. Only those readers can follow an item that counted the
    value on the host without the release rows excluding them (a reader ending after ``p``
    starts pushes the release past it), so ``G`` is needed for these values only
    (:func:`_host_since_offload`).
    """
    out: list[set[Value]] = [set() for _ in D]
    ahead: set[Value] = set()
    for p in range(len(D) - 1, -1, -1):
        out[p] = set(ahead)
        if not D[p].terms and D[p].const > 0:
            ahead = set()
        else:
            ahead |= {v for v, lit in reads[p].items() if lit is not False}
    return out


def _host_since_offload(m: Model, G: dict[Value, Expr], v: Value, H: Expr | None,
                        host: Sequence[Expr], tag: str) -> None:
    """Update ``G[v]``: ``v`` was on the host only (``h`` or ``eta``) since its offload.

    The simulator counts a value as on the host only once every reader listed after its
    offload (and before its prefetch) has been replayed, so no reader may follow such an
    item while the value is still offloaded (row ``pendG``: ``G + H + reads <= 2``). With
    positive durations the release rows already imply it (a later reader ends after the
    item starts); with zero-duration ops they do not. ``G`` only needs lower bounds:
    ``g >= host`` and, at an item (``H`` its state), ``g >= G + H - 1`` (the offload
    continues: ``H`` cannot drop and rise again between two items, a prefetched value must
    be read before it is offloaded again); at a gap (``H`` is ``None``) ``g >= G``.
    """
    if not G[v].terms or (H is not None and not H.terms):
        carry = Expr()
    else:
        carry = G[v] if H is None else G[v] + H - 1
    if not host and not carry.terms:
        G[v] = Expr()
        return
    g = m.binary(f"G_{v[0]}{v[1]}_{tag}")
    for k, x in enumerate(host):
        m.add(g >= x, f"Gh_{v[0]}{v[1]}_{tag}_{k}")
    if carry.terms:
        m.add(g >= carry, f"Gc_{v[0]}{v[1]}_{tag}")
    G[v] = g


def _gap_check(m: Model, p: int, kappa: int, tq: Expr, pos: Position, prefetching: Expr,
               cands: Sequence[Value], H: dict[Value, Expr], R: dict[Value, Expr],
               size: object, after: Expr, memory_limit: int, late: Expr | None
               ) -> dict[Value, Expr]:
    """Memory when the prefetch of position ``q`` starts after item ``p`` has ended.

    ``H`` and ``R`` are the states after the position (a value offloaded here has ``R``
    after ``T_q`` and the prefetched one ``H = 0``, so neither counts as host). Without
    ``late`` the row holds whenever a prefetch starts (implied by the op's row if it starts
    during the op). Returns the ``eta`` binaries (values counted on the host).
    """
    isp = m.binary(f"isp_{p}_{kappa}")
    m.add(isp == prefetching, f"isp_{p}_{kappa}")
    host = Expr()
    etas: dict[Value, Expr] = {}
    for w in cands:
        if not H[w].terms:
            continue
        eta = m.binary(f"eta_{w[0]}{w[1]}_{p}_{kappa}")
        m.add(eta <= H[w], f"etaH_{w[0]}{w[1]}_{p}_{kappa}")
        m.add(R[w] <= tq, f"etaR_{w[0]}{w[1]}_{p}_{kappa}", only_if=m.literal(eta))
        host = host - eta * size(w)  # type: ignore[operator]
        etas[w] = eta
    lits = [m.literal(isp)] + ([m.literal(late)] if late is not None else [])
    m.add(after + host <= memory_limit, f"gap_{p}_{kappa}", only_if=lits)
    return etas


def with_fixed(built: RematOffloadModel, fixed: dict[int, float],
               horizon: float | None = None) -> Model:
    """A copy of the model with some variables fixed and times bounded by ``horizon``.

    Fixed values are equality rows (the emitters give every binary the bounds 0 and 1).
    """
    model = built.model
    vs: list[Var] = []
    for v in model.vars:
        lo, hi = v.lo, v.hi
        if horizon is not None and v.kind.value == "continuous" and hi > horizon:
            hi = max(lo, horizon)
        vs.append(replace(v, lo=lo, hi=hi))
    out = replace(model, vars=vs, constraints=list(model.constraints))
    for i, x in fixed.items():
        out.add(Relation(Expr([(i, 1.0)]), x, x), f"fix_{i}")
    return out


def _item_facts(m: Model, cf: ck.Formulation, uf: Sequence[float], ub: Sequence[float],
                a: Sequence[int]) -> tuple[list[Expr], list[dict[Value, Literal | bool]],
                                           list[dict[Value, Literal | bool]],
                                           list[dict[Value, Literal | bool]], list[int]]:
    """Durations, reads (new ``rd`` binaries for slots), frees, productions, gradient after.

    A literal says when the item does it, ``True``/``False`` that it always / never does.
    """
    seq = cf.sequence
    L = cf.length
    names = {nm: i for i, nm in enumerate(cf.names)}
    D: list[Expr] = []
    reads: list[dict[Value, Literal | bool]] = []
    frees: list[dict[Value, Literal | bool]] = []
    makes: list[dict[Value, Literal | bool]] = []
    after_delta: list[int] = []
    for p, item in enumerate(seq):
        A, T = cf.states[p]
        if isinstance(item, ck.Slot):
            j, k = item.stage, item.phase
            ops = dict(item.ops)
            y = Expr([(idx, 1.0) for idx in ops.values()])
            D.append(y * uf[j])
            rdA = m.binary(f"rdA_{p}")
            r: dict[Value, Literal | bool] = {(A_, j - 1): m.literal(rdA)}
            if j > 1:
                rdT = m.binary(f"rdT_{p}")
                m.add(rdA + rdT == y, f"rd_{p}")
                m.add(rdA <= _x(A[j - 1]), f"rdA_{p}")
                m.add(rdT <= _x(T[j - 1]), f"rdT_{p}")
                r[(ABAR_, j - 1)] = m.literal(rdT)
            else:
                m.add(rdA == y, f"rd_{p}")
            reads.append(r)
            tag = f"{k}_{item.sweep}_{j}"
            fr: dict[Value, Literal | bool] = {}
            if f"zA_{tag}" in names:
                fr[(A_, j - 1)] = (names[f"zA_{tag}"], True)
            if f"zT_{tag}" in names:
                fr[(ABAR_, j - 1)] = (names[f"zT_{tag}"], True)
            frees.append(fr)
            mk: dict[Value, Literal | bool] = {}
            if OpKind.F_ALL in ops:
                mk[(ABAR_, j)] = (ops[OpKind.F_ALL], True)
            pa = [ops[kk] for kk in (OpKind.F_CK, OpKind.F_NONE) if kk in ops]
            if len(pa) == 1:
                mk[(A_, j)] = (pa[0], True)
            elif pa:
                pv = m.binary(f"prodA_{p}")
                m.add(pv == Expr([(i, 1.0) for i in pa]), f"prodA_{p}")
                mk[(A_, j)] = m.literal(pv)
            makes.append(mk)
            after_delta.append(a[k] if k <= L else 0)
        elif item.kind is OpKind.LOSS:
            D.append(Expr((), ub[L + 1]))
            reads.append({(A_, L): _lit(A[L]), (ABAR_, L): _lit(T[L])})
            frees.append({(A_, L): _lit(A[L])})
            makes.append({})
            after_delta.append(a[L])
        else:
            k = item.stage
            D.append(Expr((), ub[k]))
            r = {(ABAR_, k): _lit(T[k]), (A_, k - 1): _lit(A[k - 1])}
            if k > 1:
                r[(ABAR_, k - 1)] = _lit(T[k - 1])
            reads.append(r)
            frees.append({(ABAR_, k): _lit(T[k]), (A_, k - 1): _lit(A[k - 1])})
            makes.append({})
            after_delta.append(a[k - 1])
    return D, reads, frees, makes, after_delta


def _held_terms(m: Model, cf: ck.Formulation, chain: Chain) -> list[Expr]:
    """What the last op run by item ``p`` leaves held until the next op starts, per item.

    ``Loss`` and ``B k`` hold the chain's constants; a forward slot holds ``fwd_held`` of its
    stage if one of its ops runs, else what the item before it held: an integer ``g_p >=
    fwd_held * y_p`` and ``>= g_{p-1} - (max held) y_p``, exact at its least value (it only
    appears on the left of ``<= M`` rows). All zero (no variable) for a chain that holds
    nothing (:attr:`~optmem.chain.Chain.holds`), so such models are unchanged.
    """
    zero = Expr()
    if not chain.holds:
        return [zero] * len(cf.sequence)
    top = max(chain.loss_held, *chain.fwd_held, *chain.bwd_held)
    out: list[Expr] = []
    prev: Expr = zero
    for p, item in enumerate(cf.sequence):
        if isinstance(item, ck.Slot):
            h = chain.fwd_held[item.stage - 1]
            if h == 0 and not prev.terms and prev.const == 0:
                out.append(zero)
                continue
            g = m.integer(f"held_{p}", 0, top)
            y = Expr([(idx, 1.0) for _, idx in item.ops])
            if h:
                m.add(g >= y * h, f"held_{p}")
            if prev.terms or prev.const:
                m.add(g >= prev - y * top, f"held_{p}_before")
            prev = g
        elif item.kind is OpKind.LOSS:
            prev = Expr((), chain.loss_held)
        else:
            prev = Expr((), chain.bwd_held[item.stage - 1])
        out.append(prev)
    return out


def _late_after_empty_slot(m: Model, item: object, late: Expr, chain: Chain, tag: str) -> None:
    """A prefetch after an empty slot starts between ops: ``late >= 1 - y`` (held chains).

    The simulator knows no empty slot: such a prefetch starts after the last op that ran,
    so its gap row (with that op's held term) applies, not the slot's own memory row,
    which counts no held term. ``late = 1`` is always feasible there (``T_q >= S_p =
    E_p``). Only for a chain that holds memory between ops (otherwise the model is
    unchanged: the slot's row is then at least the gap row).
    """
    if chain.holds and isinstance(item, ck.Slot):
        y = Expr([(idx, 1.0) for _, idx in item.ops])
        m.add(late + y >= 1, f"late_empty_{tag}")


def summed_sequence(model: Model) -> Relation:
    """The sum of the rows ``seq_p`` and ``makespan``: ``makespan >= sum of durations``.

    Valid for every solution (a sum of rows); written out it lets CP-SAT bound the compute
    binaries by a cap on the times directly (a knapsack row: with every time at most ``c``,
    at most ``c`` minus the fixed work of recomputation).
    """
    acc: dict[int, float] = {}
    lo = 0.0
    for con in model.constraints:
        if con.name.startswith("seq_") or con.name == "makespan":
            if con.hi is not None or con.lo is None or con.enforce:
                raise ValueError(f"row {con.name} is not a plain lower bound")
            lo += con.lo
            for i, x in con.terms:
                acc[i] = acc.get(i, 0.0) + x
    return Relation(Expr([(i, x) for i, x in acc.items() if abs(x) > 1e-12]), lo, None)
