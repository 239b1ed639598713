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
handled by one numpy expression over a ``(t - s) x (M + 1)`` block. The shifted rows
``C(s', t, m - a[s'-1])`` are stored once, when ``C(s', t, .)`` is computed, in a second table
laid out by ``t`` so that the block is contiguous. Time ``O(M L^3 / 6)`` element operations,
``O(L^2)`` numpy calls; memory ``2 (L+2)^2 (M+1)`` floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optmem.chain import Chain
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op

INF = np.inf
CHOICE_NONE = -1  # infeasible
CHOICE_ALL = 0  # F_all branch; a positive value s' is the F_ck branch with split s'


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
            inner = a[s] + of[s]
            for t in range(s + 1, L + 2):
                out[s, t] = a[t] + inner
                inner = max(inner, int(pair[t - 1]))  # include j = t for the next t
        return out


@dataclass
class PersistentTable:
    """The filled DP table and the choices needed to rebuild plans."""

    arrays: ChainArrays
    cost: np.ndarray  # C[s, t, m]
    choice: np.ndarray  # CHOICE_* or s'
    budget: int
    variant: str

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
            choice = int(self.choice[s, t, m])
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


def solve_persistent_table(chain: Chain, budget: int, variant: str = "paper") -> PersistentTable:
    """Fill the persistent DP table for memory values ``0..budget`` (a^0 excluded).

    Parameters
    ----------
    chain
        The discretised chain (integer sizes in units).
    budget
        Largest memory value ``M - a^0`` of the table.
    variant
        ``paper`` (thesis formula) or ``rotor`` (reference implementation).
    """
    if variant not in ("paper", "rotor"):
        raise ValueError(f"unknown persistent variant {variant!r}")
    ar = ChainArrays.from_chain(chain)
    L, n_m = ar.L, max(budget, 0) + 1
    cost = np.full((L + 2, L + 2, n_m), INF)
    shifted = np.full((L + 2, L + 2, n_m), INF)  # shifted[t, s'] = C(s', t, m - a[s'-1])
    choice = np.full((L + 2, L + 2, n_m), CHOICE_NONE, dtype=np.int16 if L < 32000 else np.int32)
    m_null = ar.m_null_table()
    mem = np.arange(n_m)

    def store(s: int, t: int, row: np.ndarray) -> None:
        cost[s, t] = row
        shift = int(ar.a[s - 1])
        if shift < n_m:
            shifted[t, s, shift:] = row[: n_m - shift]

    for s in range(1, L + 2):
        base = ar.uf[s] + ar.ub[s]
        row = np.where(mem >= ar.m_all(s, s), base, INF)
        choice[s, s] = np.where(np.isfinite(row), CHOICE_ALL, CHOICE_NONE)
        store(s, s, row)
    for d in range(1, L + 1):
        for s in range(1, L + 2 - d):
            t = s + d
            row, pick = _best_split(ar, cost, shifted, s, t, int(m_null[s, t]), n_m)
            row, pick = _consider_all_branch(ar, cost, s, t, row, pick, variant,
                                             int(m_null[s, t]))
            choice[s, t] = pick
            store(s, t, row)
    return PersistentTable(ar, cost, choice, budget, variant)


def _best_split(
    ar: ChainArrays, cost: np.ndarray, shifted: np.ndarray, s: int, t: int, lo: int, n_m: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``F_ck`` branch for all ``m``: best split ``s'`` and its cost (inf below ``lo``)."""
    row = np.full(n_m, INF)
    pick = np.full(n_m, CHOICE_NONE, dtype=np.int32)
    if lo >= n_m:
        return row, pick
    acc = np.cumsum(ar.uf[s:t])  # acc[k] = uf[s] + ... + uf[s+k], summed left to right
    # leaf = ((sum uf[s..s'-1]) + C(s', t, m - a[s'-1])) + C(s, s'-1, m), s' = s+1..t
    block = acc[:, None] + shifted[t, s + 1:t + 1, lo:]
    block += cost[s, s:t, lo:]
    best = np.argmin(block, axis=0)  # first minimum: the smallest s' wins ties
    row[lo:] = block[best, np.arange(n_m - lo)]
    finite = np.isfinite(row[lo:])
    pick[lo:] = np.where(finite, best + s + 1, CHOICE_NONE)
    return row, pick


def _consider_all_branch(
    ar: ChainArrays, cost: np.ndarray, s: int, t: int, row: np.ndarray, pick: np.ndarray,
    variant: str, m_null: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Take the ``F_all`` branch where it is strictly better (ties keep ``F_ck``)."""
    n_m = row.shape[0]
    shift = int(ar.abar[s])
    if variant == "paper":
        lo = max(ar.m_all(s, t), shift)
    else:  # rotor: base-case threshold (delta^s, not delta^t) and m_null on both branches
        lo = max(ar.m_all(s, s), shift, m_null)
    if lo >= n_m:
        return row, pick
    sub = cost[s + 1, t, lo - shift:n_m - shift]
    if variant == "paper":
        cand = (ar.uf[s] + sub) + ar.ub[s]
    else:
        cand = cost[s, s, lo:] + sub
    better = cand < row[lo:]
    row = row.copy()
    row[lo:] = np.where(better, cand, row[lo:])
    pick = pick.copy()
    pick[lo:] = np.where(better, CHOICE_ALL, pick[lo:])
    return row, pick


def min_memory_persistent(chain: Chain, variant: str = "paper") -> int:
    """Smallest limit (a^0 included) at which the persistent DP is feasible, exactly.

    Min-max version of the recurrence, independent of any discretisation:
    ``mm(s,t) = min(max(m_all, mm(s+1,t) + abar[s]), max(m_null, min_s' max(mm(s',t) +
    a[s'-1], mm(s,s'-1))))``.
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
