r"""Dynamic programs for checkpointing heterogeneous chains (rotor, thesis chapter 2).

Persistent DP: RR-9302 Theorem 1 / Algorithms 1-2, thesis Theorem 6 / Algorithms 3-4, with the
errata of ``shared/design/rotor.md`` (sections 3.2, 3.6, 9): iterate by increasing ``t - s``;
``abar`` (not ``a``) in the ``F_all`` budget; ``delta^{s-1}`` in the backward peak;
``m_null`` over ``s < j < t``; the ``F_none`` run of the reconstruction stops at ``s'-1``.

Notation (paper indices, all sizes in discretised units; stage ``L+1`` is the loss):

============  ==================================================================
``uf[s]``     forward time u_f^s (``uf[L+1] = 0``)
``ub[s]``     backward time u_b^s (``ub[L+1]`` = loss time)
``a[s]``      size of a^s = size of delta^s (``a[0]`` input, ``a[L+1] = 0``)
``abar[s]``   size of the tape abar^s (``abar[L+1] = 0``)
``of, ob``    forward / backward overheads (``ob[L+1]`` = loss overhead)
``C[s,t,m]``  least makespan of a persistent schedule of sub-chain ``s..t`` that starts
              with a^{s-1} (not counted in ``m``) and delta^t (counted) and ends with
              delta^{s-1}, with peak <= ``m``
============  ==================================================================

Recurrences (thesis eq. 2.9-2.10)::

    C(s,s,m)  = uf[s] + ub[s]                       if m >= m_all(s,s)
    C(s,t,m)  = min(C_all, C_ck)                    for t > s
    C_all     = uf[s] + C(s+1,t,m-abar[s]) + ub[s]  if m >= m_all(s,t)
    C_ck      = min_{s'=s+1..t} sum(uf[s..s'-1]) + C(s',t,m-a[s'-1]) + C(s,s'-1,m)
                                                    if m >= m_null(s,t)
    m_all(s,t)  = max(a[t] + abar[s] + of[s], abar[s] + a[s] + a[s-1] + ob[s])
    m_null(s,t) = max(a[t] + a[s] + of[s], max_{s<j<t} a[t] + a[j-1] + a[j] + of[j])

The answer is ``C(1, L+1, M - a[0])``.

Variant ``rotor`` reproduces the reference implementation bit for bit (section 3.2.1): the
``F_all`` branch is tested against the base-case threshold ``m_all(s,s)`` and ``m_null`` is
applied to both branches; ties prefer ``F_ck`` then the smallest ``s'``; sums associate as in
the C code; the limit is exactly ``S`` slots.

Vectorisation: for every pair ``(s, t)`` all memory values and all split points ``s'`` are
handled by three numpy calls over a contiguous ``(t - s) x (M + 1)`` block: two additions
into a reused buffer (the running sums of ``uf`` are kept as a contiguous block per ``s``:
adding a broadcast column is several times slower) and one ``minimum.reduce``. The shifted
rows ``C(s', t, m - a[s'-1])`` are stored once, when ``C(s', t, .)`` is computed, in a second
table laid out by ``t``. Memory traffic bounds the speed, so pairs are visited in
``TILE x TILE`` tiles whose rows stay in cache; thresholds are precomputed as tables and the
per-pair loop uses plain Python scalars. Only costs are stored: a plan replays the decisions
of the cells on its path (:meth:`PersistentTable.choice`, ``O(L)`` each) with the same float
operations, so ties break exactly as in the fill. Time ``O(M L^3 / 6)`` element operations,
``O(L^2)`` numpy calls; memory ``2 (L+2)^2 (M+1)`` floats (about 0.9 GB at L = 339,
M = 500). Measured against a C transcription of rotor's ``persistent_compute_table`` in
``benchmarks/bench_checkpoint_dp.py`` (identical values and plans).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.models.interrupt import poll
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op

INF = np.inf
MAX_TABLE_BYTES = 4 * 2**30
"""Largest memory the DP tables of one solve may take. Tables grow as ``L^2 M`` (``L^3 M``
for the floating DP) and ``M`` grows with ``--slots``: without a cap, ``--slots 10^8``
asked numpy for 15 GiB and ``10^10`` for terabytes (a MemoryError, or the machine swapping).
ResNet-1001 at the default 500 slots needs 0.9 GB."""
TILE = 8  # the table is filled in TILE x TILE tiles of (s, t) pairs, for cache reuse
CHOICE_NONE = -1  # infeasible
CHOICE_ALL = 0  # F_all branch; a positive value s' is the F_ck branch with split s'


def require_table_bytes(nbytes: float, *, what: str, length: int, memory: int,
                        field: str = "slots") -> None:
    """Raise one clear error if a DP's tables would take more than :data:`MAX_TABLE_BYTES`.

    Raises
    ------
    OptmemInputError
        Naming ``field`` (the option that sets the number of memory values).

    Examples
    --------
    >>> require_table_bytes(2**40, what="persistent DP", length=3, memory=10**10)
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'slots': the persistent DP would need 1024.0 GiB \
for 3 stages and 10000000000 memory values (at most 4 GiB): use fewer slots
    """
    if nbytes > MAX_TABLE_BYTES:
        raise OptmemInputError(
            f"the {what} would need {nbytes / 2**30:.1f} GiB for {length} stages and {memory} "
            f"memory values (at most {MAX_TABLE_BYTES // 2**30} GiB): use fewer {field}",
            field=field)


@dataclass(frozen=True)
class ChainArrays:
    """The chain as paper-indexed numpy arrays of length ``L + 2`` (index 0 unused for stages)."""

    L: int
    uf: np.ndarray
    ub: np.ndarray
    a: np.ndarray
    abar: np.ndarray
    of: np.ndarray
    ob: np.ndarray

    @classmethod
    def from_chain(cls, chain: Chain) -> ChainArrays:
        """Pad the chain with the loss stage ``L+1`` (zero sizes, loss time and overhead)."""
        L = chain.length

        def pad(values: tuple, first: float, last: float, dtype: type) -> np.ndarray:
            return np.array([first, *values, last], dtype=dtype)

        return cls(
            L=L,
            uf=pad(chain.fwd_time, 0.0, 0.0, np.float64),
            ub=pad(chain.bwd_time, 0.0, chain.loss_bwd_time, np.float64),
            a=pad(chain.output_size, chain.input_size, 0, np.int64),
            abar=pad(chain.saved_size, chain.input_size, 0, np.int64),
            of=pad(chain.fwd_overhead, 0, 0, np.int64),
            ob=pad(chain.bwd_overhead, 0, chain.loss_bwd_overhead, np.int64),
        )

    def m_all(self, s: int, t: int) -> int:
        """Peak of ``F_all^s`` (delta^t held) and of ``B^s``, a^{s-1} not counted."""
        a, abar = self.a, self.abar
        return int(max(a[t] + abar[s] + self.of[s], abar[s] + a[s] + a[s - 1] + self.ob[s]))

    def m_null_table(self) -> np.ndarray:
        """``m_null(s, t)`` for all ``1 <= s < t <= L+1`` (row s, column t)."""
        L, a, of = self.L, self.a, self.of
        out = np.zeros((L + 2, L + 2), dtype=np.int64)
        pair = a[:-1] + a[1:] + of[1:]  # pair[j-1] = a[j-1] + a[j] + of[j]
        for s in range(1, L + 1):
            poll()  # a solve's deadline: L Python loops of L (0.06 s at L = 339)
            inner = a[s] + of[s]
            for t in range(s + 1, L + 2):
                out[s, t] = a[t] + inner
                inner = max(inner, int(pair[t - 1]))  # include j = t for the next t
        return out


@dataclass
class PersistentTable:
    """The filled DP table; plans are rebuilt by replaying the decisions of the fill."""

    arrays: ChainArrays
    cost: np.ndarray  # C[s, t, m]
    budget: int
    variant: str
    m_null: np.ndarray
    all_lo: np.ndarray
    segment_cost: float = 0.0  # added to every F_ck choice (see solve_persistent_table)

    @property
    def states(self) -> int:
        """Number of DP cells (pairs times memory values)."""
        L = self.arrays.L
        return (L + 1) * (L + 2) // 2 * (self.budget + 1)

    def value(self, budget: int | None = None) -> float:
        """Optimal makespan of the whole chain for ``budget`` (default: the table's)."""
        m = self.budget if budget is None else budget
        if m < 0:
            return INF
        return float(self.cost[1, self.arrays.L + 1, m])

    def choice(self, s: int, t: int, m: int) -> int:
        """The decision at ``(s, t, m)``: ``CHOICE_ALL``, a split ``s'`` or ``CHOICE_NONE``.

        Recomputes the candidates of cell ``(s, t, m)`` with the same float operations as
        the fill, so the decision is the one the fill's minimum came from: ``F_ck`` wins
        ties, and among splits the smallest ``s'`` (rotor's strict ``<`` scan).
        """
        ar, cost = self.arrays, self.cost
        if s == t:
            return CHOICE_ALL if np.isfinite(cost[s, s, m]) else CHOICE_NONE
        best, pick = INF, CHOICE_NONE
        if m >= self.m_null[s, t]:
            split = np.arange(s + 1, t + 1)
            index = m - ar.a[split - 1]
            sub = np.full(t - s, INF)
            ok = index >= 0
            sub[ok] = cost[split[ok], t, index[ok]]
            leaf = (_segment_sums(ar.uf[s:t], self.segment_cost) + sub) + cost[s, s:t, m]
            k = int(np.argmin(leaf))
            if np.isfinite(leaf[k]):
                best, pick = leaf[k], s + 1 + k
        if m >= self.all_lo[s, t]:
            sub_all = cost[s + 1, t, m - int(ar.abar[s])]
            if self.variant == "paper":
                cand = (ar.uf[s] + sub_all) + ar.ub[s]
            else:
                cand = cost[s, s, m] + sub_all
            if cand < best:
                pick = CHOICE_ALL
        return pick

    def plan(self, budget: int | None = None) -> tuple[Op, ...]:
        """Rebuild the optimal plan (RR Alg. 2 / thesis Alg. 4, without the off-by-one)."""
        m0 = self.budget if budget is None else budget
        L = self.arrays.L
        if m0 < 0 or not np.isfinite(self.cost[1, L + 1, m0]):
            raise ValueError("no feasible plan for this budget")
        a, abar = self.arrays.a, self.arrays.abar
        out: list[Op] = []
        # explicit stack: items are (s, t, m) sub-problems or ops to emit
        stack: list[tuple[int, int, int] | Op] = [(1, L + 1, m0)]
        while stack:
            item = stack.pop()
            if isinstance(item, Op):
                out.append(item)
                continue
            s, t, m = item
            choice = self.choice(s, t, m)
            if s == t:
                out.extend([LOSS] if s == L + 1 else [F_all(s), B(s)])
            elif choice == CHOICE_ALL:
                out.append(F_all(s))
                stack.extend([B(s), (s + 1, t, m - int(abar[s]))])
            elif choice > 0:
                sp = choice
                out.append(F_ck(s))
                out.extend(F_none(j) for j in range(s + 1, sp))
                stack.extend([(s, sp - 1, m), (sp, t, m - int(a[sp - 1]))])
            else:  # pragma: no cover - guarded by the finiteness check above
                raise AssertionError(f"inconsistent DP table at {(s, t, m)}")
        return tuple(out)


def _all_thresholds(ar: ChainArrays, variant: str, m_null: np.ndarray) -> np.ndarray:
    """Smallest ``m`` at which the ``F_all`` branch of ``(s, t)`` is tried, for all pairs.

    ``paper``: ``max(m_all(s,t), abar[s])``. ``rotor``: the base-case threshold (delta^s, not
    delta^t) and ``m_null`` on both branches: ``max(m_all(s,s), abar[s], m_null(s,t))``.
    """
    a, abar, of, ob = ar.a, ar.abar, ar.of, ar.ob
    s = np.arange(ar.L + 2)
    back = abar + a + np.concatenate(([0], a[:-1])) + ob  # B^s peak, a^{s-1} included
    if variant == "paper":
        fwd = a[None, :] + (abar + of)[:, None]  # F_all^s with delta^t held
        out = np.maximum(np.maximum(fwd, back[:, None]), abar[:, None])
    else:
        base = np.maximum(a + abar + of, back)  # m_all(s, s)
        out = np.maximum(np.maximum(base, abar)[:, None], m_null)
    out[0, :] = out[:, 0] = np.iinfo(np.int64).max // 4  # stage 0 does not exist
    del s
    return out


def _fill_cell(
    cost: np.ndarray, shifted: np.ndarray, sums: np.ndarray, buf: np.ndarray,
    s: int, t: int, lo: int, lo_all: int, shift_all: int, shift: int, uf: float, ub: float,
    paper: bool,
) -> None:
    """Fill ``C(s, t, .)`` for all memory values, and its shifted copy."""
    n_m = cost.shape[2]
    d = t - s
    row = cost[s, t]
    if lo < n_m:
        # leaf = ((sum uf[s..s'-1]) + C(s', t, m - a[s'-1])) + C(s, s'-1, m), s' = s+1..t, for
        # all m at once (contiguous blocks); the m below m_null are then reset to infinity
        block = buf[: d * n_m].reshape(d, n_m)
        np.add(sums[:d], shifted[t, s + 1:t + 1], out=block)
        np.add(block, cost[s, s:t], out=block)
        np.minimum.reduce(block, axis=0, out=row)
        row[:lo] = INF
    if lo_all < n_m:
        sub = cost[s + 1, t, lo_all - shift_all:n_m - shift_all]
        if paper:
            cand = (uf + sub) + ub
        else:
            cand = cost[s, s, lo_all:] + sub
        np.minimum(row[lo_all:], cand, out=row[lo_all:])
    shifted[t, s, :shift] = INF
    if shift < n_m:
        shifted[t, s, shift:] = row[: n_m - shift]


def _segment_sums(uf: np.ndarray, segment_cost: float) -> np.ndarray:
    """``uf[s] + ... + uf[s+k]`` for every k, plus ``segment_cost`` when it is not 0."""
    sums = np.cumsum(uf)
    return sums + segment_cost if segment_cost else sums


def _blank_tables(L: int, n_m: int) -> tuple[np.ndarray, np.ndarray]:
    """The cost table (all infinite) and the shifted table (unset) of ``L`` stages.

    The cost table is set one row of pairs ``(s, .)`` at a time, polling the solve's
    deadline before each (:func:`~optmem.models.interrupt.poll` with the weight of the
    ``L + 2`` cells the row holds, so a small table is set up before any check, as its
    fill): at L = 339 and 500 memory values the two tables take 0.9 GB, and touching them
    first, in one ``np.full`` and in the diagonal's stores, took 0.6 s to 2 s before the
    fill's first poll (stop 79's measurements; polled since stop 80).

    Examples
    --------
    >>> cost, shifted = _blank_tables(2, 3)
    >>> cost.shape, bool(np.isinf(cost).all()), shifted.shape
    ((4, 4, 3), True, (4, 4, 3))
    """
    cost = np.empty((L + 2, L + 2, n_m))
    for s in range(L + 2):
        poll(L + 2)
        cost[s] = INF
    return cost, np.empty((L + 2, L + 2, n_m))


def solve_persistent_table(chain: Chain, budget: int, variant: str = "paper",
                           segment_cost: float = 0.0) -> PersistentTable:
    """Fill the persistent DP table for memory values ``0..budget`` (a^0 excluded).

    Parameters
    ----------
    chain
        The discretised chain (integer sizes in units).
    budget
        Largest memory value ``M - a^0`` of the table.
    variant
        ``paper`` (thesis formula) or ``rotor`` (reference implementation).
    segment_cost
        A time charged once per ``F_ck`` choice, i.e. per recomputed segment (``C_ck`` of
        the recurrence gets ``+ segment_cost``): what an executor pays per segment beyond
        the stages' forward times (``docs/pytorch.md``, "What the chain counts (time)").
        The table's values then include it; the plan's makespan under the chain is the
        value minus ``segment_cost`` times its ``F_ck`` ops. 0 (default) is rotor's model.

    Raises
    ------
    optmem.models.interrupt.Interrupted
        Inside :func:`~optmem.models.interrupt.stop_when` once its predicate holds: the
        fill polls once per cell (:func:`~optmem.models.interrupt.poll`; the exact methods'
        warm start and fallback, 6.6 s at L = 339, ran past their time limit, stop 77),
        the table's set-up once per row of pairs (:func:`_blank_tables`, stop 80).
    """
    if variant not in ("paper", "rotor"):
        raise ValueError(f"unknown persistent variant {variant!r}")
    ar = ChainArrays.from_chain(chain)
    L, n_m = ar.L, max(budget, 0) + 1
    require_table_bytes(8.0 * (2 * (L + 2) ** 2 + L + 1) * n_m, what="persistent DP",
                        length=L, memory=n_m)
    a, uf, ub = ar.a, ar.uf, ar.ub
    cost, shifted = _blank_tables(L, n_m)  # shifted[t, s'] = C(s', t, m - a[s'-1])
    buf = np.empty((L + 1) * n_m)  # scratch for the (t - s) x M block of splits
    m_null = ar.m_null_table()
    mem = np.arange(n_m)
    # plain Python scalars for the per-pair loop (numpy scalar indexing is slow); the float
    # operations are the same IEEE double operations
    lo_null = m_null.tolist()
    lo_all = _all_thresholds(ar, variant, m_null).tolist()
    a_list, abar_list = a.tolist(), ar.abar.tolist()
    uf_list, ub_list = uf.tolist(), ub.tolist()
    paper = variant == "paper"

    def store(s: int, t: int) -> None:
        shift = int(a[s - 1])
        shifted[t, s, :shift] = INF
        if shift < n_m:
            shifted[t, s, shift:] = cost[s, t, : n_m - shift]

    for s in range(1, L + 2):
        poll(L + 2)  # each first touches the block shifted[s] of L + 2 rows (stop 80)
        cost[s, s] = np.where(mem >= ar.m_all(s, s), uf[s] + ub[s], INF)
        store(s, s)
    # C(s,t) reads C(s',t) (s' > s), C(s,t') (t' < t) and C(s+1,t). Tiles of TILE x TILE pairs,
    # s blocks decreasing, t blocks increasing, and inside a tile s decreasing then t
    # increasing, compute each of these first; a tile reuses the rows shifted[t, .] and C(s, .)
    # it shares while they are in cache (memory traffic is what bounds the speed).
    for s_hi in range(L, 0, -TILE):
        s_lo = max(1, s_hi - TILE + 1)
        # sums[s][k, m] = uf[s] + ... + uf[s+k] (added left to right like the reference) as a
        # contiguous block: adding it is much faster than broadcasting a column
        sums = {s: np.repeat(_segment_sums(uf[s:L + 1], segment_cost)[:, None], n_m, axis=1)
                for s in range(s_lo, s_hi + 1)}
        for t_lo in range(s_lo + 1, L + 2, TILE):
            for s in range(s_hi, s_lo - 1, -1):
                row_s = sums[s]
                for t in range(max(t_lo, s + 1), min(t_lo + TILE, L + 2)):
                    poll()  # a solve's deadline (optmem.models.interrupt): 6.6 s at L = 339
                    _fill_cell(cost, shifted, row_s, buf, s, t, lo_null[s][t], lo_all[s][t],
                               abar_list[s], a_list[s - 1], uf_list[s], ub_list[s], paper)
    return PersistentTable(ar, cost, budget, variant, m_null, np.array(lo_all),
                           float(segment_cost))


def min_memory_persistent(chain: Chain, variant: str = "paper") -> int:
    """Smallest limit (a^0 included) at which the persistent DP is feasible, exactly.

    Min-max version of the recurrence, independent of any discretisation:
    ``mm(s,t) = min(max(m_all, mm(s+1,t) + abar[s]), max(m_null, min_s' max(mm(s',t) +
    a[s'-1], mm(s,s'-1))))``.

    Raises
    ------
    optmem.models.interrupt.Interrupted
        Inside :func:`~optmem.models.interrupt.stop_when` once its predicate holds (one
        :func:`~optmem.models.interrupt.poll` per pair; since stop 80: the smallest-memory
        search of a remat + offload ``dp`` that found no plan calls it for many units,
        8.8 s at L = 339).
    """
    ar = ChainArrays.from_chain(chain)
    L = ar.L
    big = np.iinfo(np.int64).max // 4
    mm = np.full((L + 2, L + 2), big, dtype=np.int64)
    m_null = ar.m_null_table()
    for s in range(1, L + 2):
        mm[s, s] = ar.m_all(s, s)
    for d in range(1, L + 1):
        for s in range(1, L + 2 - d):
            poll()  # a solve's deadline, per pair as the table's fill (1 s at L = 339)
            t = s + d
            sp = np.arange(s + 1, t + 1)
            leaf = np.maximum(mm[sp, t] + ar.a[sp - 1], mm[s, sp - 1]).min()
            best = max(int(m_null[s, t]), int(leaf))
            if variant == "paper":
                thr = ar.m_all(s, t)
            else:
                thr = max(ar.m_all(s, s), int(m_null[s, t]))
            best = min(best, max(thr, int(mm[s + 1, t] + ar.abar[s])))
            mm[s, t] = best
    return int(mm[1, L + 1] + ar.a[0])
