r"""The floating-checkpoint DP (thesis chapter 2, Theorem 5, Algorithms 1-2, eqs. 2.4-2.8).

``C_FL(s, t, l, m)`` (``s <= l <= t <= L+1``) is the least makespan of a schedule that starts
with a^{s-1} (the *floating* input, not counted in ``m``) and delta^t (counted), runs the
backward steps ``B^t .. B^l`` and ends with delta^{l-1} alone, the floating input used up,
with peak ``<= m``. The answer is ``C_FL(1, L+1, 1, M - a^0)``. Notation as in
:mod:`optmem.solvers.checkpoint_dp` (paper indices, stage ``L+1`` is the loss, sizes in units).

Recurrences (thesis eqs. 2.4-2.8, ``shared/design/rotor.md`` section 3.3)::

    C_FL(s,s,s,m) = uf[s] + ub[s]                          if m >= m_all(s,s)        (2.4)
    C_FL(s,t,l,m) = min(C1, C2, C3)                                                  (2.5)
    C1 = uf[s] + C_FL(s+1, t, s+1, m - abar[s]) + ub[s]     if s == l, m >= m_all(s,t) (2.8)
    C2 = min over s <= r <= l, r <= s' < t', l < t' <= t of                          (2.7)
           sum(uf[s..s']) + C_FL(s'+1, t, t', m - a[s'] - a[r-1] + a[s-1])
                          + C_FL(r, t'-1, l, m - a[r-1] + a[s-1])
    C3 = sum(uf[s..l-1]) + C_FL(l, t, l, m - a[l-1] + a[s-1])  if s < l   (the missing case)

``C2`` runs the forwards ``s..s'`` without grad, ``F_ck`` at ``r`` (the floating
checkpoint moves from a^{s-1} to a^{r-1}; ``F_none`` elsewhere), keeps a^{s'} as the new
floating value, processes ``B^t .. B^{t'}`` and then ``B^{t'-1} .. B^l`` from a^{r-1}.
``C3`` is the case the printed recurrence misses (``rotor.md``, findings item 1): move the
floating value to a^{l-1} with ``F_none`` and continue with ``F_all^l``. Without it
``C_FL(s, t, t, m)`` is infinite for ``s < t``, and the printed DP is sometimes worse than
the exact optimum.

Feasibility tests. The printed recurrence tests ``C2`` against ``m_null(s,t)`` only, which
does **not** cover the forward run ``F_none^{r+1..s'}`` while a^{r-1} is held with
``r > s``: its peak is ``delta^t + a^{r-1} + a^{h-1} + a^h + o_f^h``, to be compared with
``m + a^{s-1}`` (the floating a^{s-1} is gone by then). Taken literally the printed DP
returns plans above the limit. Deviation: both variants check that peak explicitly.

The default variant (``printed=False``) replaces every threshold by the exact peak of the ops
the case runs, each compared with what the budget allows at that moment (``m`` while the
floating input is held, ``m + a^{s-1}`` once it is consumed), and drops the size condition
``a^{s-1} <= a^{r-1}`` of Corollary 1 (a pruning rule: it only removes options). Every
option is then a valid schedule and every valid option of the recurrence's shape is
considered. ``printed=True`` keeps the printed thresholds (``m_null`` over ``s <= j < t``,
errata 4), the size condition and no ``C3``, plus the safety check above.

Evaluation: by increasing ``t - s`` (every case reads entries with a smaller ``t - s``), one
numpy row over all memory values ``0..M`` per ``(s, t, l)``. Along any path from the top
call the budget never exceeds ``M`` (``m`` plus the floating input's size never grows), so
reads past ``M`` are unreachable and treated as infeasible. Time ``O(M L^6)`` element
operations (``O(L^5)`` numpy calls), memory ``O(M L^3)``: for short chains only.
"""

from __future__ import annotations

import numpy as np

from optmem.chain import Chain
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op
from optmem.solvers.checkpoint_dp import ChainArrays, require_table_bytes

INF = np.inf
_NONE, _ALL, _C3 = -1, 0, 1  # choice codes; C2 choices are 2 + encoded (r, s', t')


class FloatingTable:
    """The filled floating DP table and the choices to rebuild plans.

    Parameters
    ----------
    chain
        The discretised chain.
    budget
        Largest memory value of the table (``M - a^0`` for the top call).
    printed
        Reproduce the printed recurrence (see the module docstring).
    literal
        With ``printed``, also drop the safety check of the ``F_none^{r+1..s'}`` run: the
        recurrence exactly as printed (for tests; its plans are not checked by construction).
    """

    def __init__(self, chain: Chain, budget: int, *, printed: bool = False,
                 literal: bool = False) -> None:
        self.arrays = ar = ChainArrays.from_chain(chain)
        self.budget = budget
        self.printed = printed
        self.literal = literal
        L = ar.L
        self.K = K = L + 2
        n_m = max(budget, 0) + 1
        self.n_m = n_m
        # costs with infinite padding on both sides of the memory axis, so that a shifted
        # row C(., m - k) is a view (shifts are bounded by the sizes, or everything is inf)
        big = int(max(ar.abar.max(), 2 * ar.a.max(), 0))
        self._left = min(n_m, big)
        self._right = min(n_m, int(ar.a.max()))
        require_table_bytes(K**3 * (8.0 * (self._left + n_m + self._right) + 4.0 * n_m),
                            what="floating DP", length=L, memory=n_m)
        self._store = np.full((K, K, K, self._left + n_m + self._right), INF)
        self.cost = self._store[..., self._left:self._left + n_m]
        self.choice = np.full((K, K, K, n_m), _NONE, dtype=np.int32)
        self._fill()

    # ------------------------------------------------------------------ helpers
    def _shifted(self, index: tuple, k: int) -> np.ndarray:
        """View of ``cost[index + (m - k,)]`` for ``m = 0..M`` (inf outside ``0..M``)."""
        n = self.n_m
        if -self._right <= k <= self._left:
            start = self._left - k
            return self._store[index + (slice(start, start + n),)]
        return np.broadcast_to(INF, self.cost[index].shape)  # |k| > M: nothing fits

    def _encode(self, r: int, sp: int, tp: int) -> int:
        return 2 + (r * self.K + sp) * self.K + tp

    def _decode(self, code: int) -> tuple[int, int, int]:
        code -= 2
        tp = code % self.K
        code //= self.K
        return code // self.K, code % self.K, tp

    def _take(self, s: int, t: int, ell: int, cand: np.ndarray, lo: int, code: int) -> None:
        """Keep ``cand`` (valid for ``m >= lo``) where it is strictly better, with ``code``."""
        lo = max(lo, 0)
        if lo >= self.n_m:
            return
        row = self.cost[s, t, ell, lo:]
        cand = cand[lo:]
        better = cand < row
        if better.any():
            np.copyto(row, cand, where=better)
            np.copyto(self.choice[s, t, ell, lo:], code, where=better)

    # ------------------------------------------------------------------ the recurrence
    def _fill(self) -> None:
        ar, L, n_m = self.arrays, self.arrays.L, self.n_m
        a, abar, uf, ub, of = ar.a, ar.abar, ar.uf, ar.ub, ar.of
        mem = np.arange(n_m)
        for s in range(1, L + 2):  # (2.4)
            feasible = mem >= ar.m_all(s, s)
            self.cost[s, s, s] = np.where(feasible, uf[s] + ub[s], INF)
            self.choice[s, s, s] = np.where(feasible, _ALL, _NONE)
        m_null = ar.m_null_table()
        for d in range(1, L + 1):
            for s in range(1, L + 2 - d):
                t = s + d
                # peaks of the no-grad forwards with delta^t held (a^{s-1} not counted)
                p0 = int(a[t] + a[s] + of[s])  # F^s (F_ck or F_none), input outside
                pn = [0] * (t + 1)  # pn[h] = delta^t + a^{h-1} + a^h + o_f^h, s < h < t
                for h in range(s + 1, t):
                    pn[h] = int(a[t] + a[h - 1] + a[h] + of[h])
                for ell in range(s, t + 1):
                    if self.printed:
                        self._printed_cases(s, t, ell, p0, pn, int(m_null[s, t]))
                    else:
                        self._exact_cases(s, t, ell, p0, pn)
                    if ell == s:  # C1 (2.8): F_all^s, then B^{t..s+1} from abar^s, then B^s
                        sub = self._shifted((s + 1, t, s + 1), int(abar[s]))
                        cand = (uf[s] + sub) + ub[s]
                        self._take(s, t, ell, cand, ar.m_all(s, t), _ALL)

    def _c2_block(self, s: int, t: int, ell: int, r: int, sp: int, lo: int, run: float) -> None:
        """C2 with fixed ``(r, s')`` for every ``t'`` in ``max(s'+1, ell+1)..t``, ``m >= lo``.

        ``run`` is ``uf[s] + ... + uf[s']``.
        """
        a = self.arrays.a
        tp0 = max(sp + 1, ell + 1)
        if tp0 > t or lo >= self.n_m:
            return
        first = self._shifted((sp + 1, t, slice(tp0, t + 1)), int(a[sp] + a[r - 1] - a[s - 1]))
        second = self._shifted((r, slice(tp0 - 1, t), ell), int(a[r - 1] - a[s - 1]))
        block = (run + first) + second
        for k, tp in enumerate(range(tp0, t + 1)):
            self._take(s, t, ell, block[k], lo, self._encode(r, sp, tp))

    def _exact_cases(self, s: int, t: int, ell: int, p0: int, pn: list[int]) -> None:
        """C3 and C2 with the exact peak of every forward they run."""
        a, uf = self.arrays.a, self.arrays.uf
        gone = int(a[s - 1])  # budget freed once the floating a^{s-1} is consumed
        if s < ell:  # C3: F_none^s .. F_none^{ell-1}, then C_FL(ell, t, ell)
            lo = max([p0] + [pn[h] - gone for h in range(s + 1, ell)])
            sub = self._shifted((ell, t, ell), int(a[ell - 1]) - gone)
            self._take(s, t, ell, float(np.sum(uf[s:ell])) + sub, lo, _C3)
        if ell == t:
            return
        prefix, before = p0, 0.0  # F_none^s .. F_none^{r-1}, F_ck^r; before = sum uf[s..r-1]
        for r in range(s, ell + 1):
            if r > s:
                prefix = max(prefix, pn[r] - gone)
                before += float(uf[r - 1])
            held = int(a[r - 1]) - gone if r > s else 0
            lo, run = prefix, before
            for sp in range(r, t):
                if sp > r:  # F_none^{sp} while a^{r-1} is held
                    lo = max(lo, pn[sp] + held)
                run += float(uf[sp])
                self._c2_block(s, t, ell, r, sp, lo, run)

    def _printed_cases(self, s: int, t: int, ell: int, p0: int, pn: list[int],
                       m_null: int) -> None:
        """C2 as printed (``m >= m_null(s,t)``, ``a^{s-1} <= a^{r-1}``) plus the safety check."""
        a, uf = self.arrays.a, self.arrays.uf
        if ell == t:
            return
        for r in range(s, ell + 1):
            if a[r - 1] < a[s - 1]:
                continue
            held = int(a[r - 1] - a[s - 1]) if r > s else 0
            lo, run = m_null, float(np.sum(uf[s:r]))
            for sp in range(r, t):
                # deviation: the run F_none^{r+1..s'} holds a^{r-1}
                if sp > r and r > s and not self.literal:
                    lo = max(lo, pn[sp] + held)
                run += float(uf[sp])
                self._c2_block(s, t, ell, r, sp, lo, run)

    # ------------------------------------------------------------------ results
    @property
    def states(self) -> int:
        """Number of DP cells ``(s, t, ell, m)``."""
        L = self.arrays.L
        triples = sum((t - s + 1) for s in range(1, L + 2) for t in range(s, L + 2))
        return triples * self.n_m

    def value(self) -> float:
        """Optimal makespan of the whole chain (``inf`` when infeasible)."""
        if self.budget < 0:
            return INF
        return float(self.cost[1, self.arrays.L + 1, 1, self.budget])

    def plan(self) -> tuple[Op, ...]:
        """Rebuild the optimal plan (thesis Alg. 2 OptRecFL, plus ``C3``)."""
        L = self.arrays.L
        if not np.isfinite(self.value()):
            raise ValueError("no feasible plan for this budget")
        a, abar = self.arrays.a, self.arrays.abar
        out: list[Op] = []
        stack: list[tuple[int, int, int, int] | Op] = [(1, L + 1, 1, self.budget)]
        while stack:
            item = stack.pop()
            if isinstance(item, Op):
                out.append(item)
                continue
            s, t, ell, m = item
            code = int(self.choice[s, t, ell, m])
            if code == _NONE:  # pragma: no cover - guarded by the finiteness checks
                raise AssertionError(f"inconsistent floating DP table at {item}")
            if s == t:
                out.extend([LOSS] if s == L + 1 else [F_all(s), B(s)])
            elif code == _ALL:
                out.append(F_all(s))
                stack.extend([B(s), (s + 1, t, s + 1, m - int(abar[s]))])
            elif code == _C3:
                out.extend(F_none(h) for h in range(s, ell))
                stack.append((ell, t, ell, m - int(a[ell - 1]) + int(a[s - 1])))
            else:
                r, sp, tp = self._decode(code)
                out.extend(F_ck(h) if h == r else F_none(h) for h in range(s, sp + 1))
                stack.append((r, tp - 1, ell, m - int(a[r - 1]) + int(a[s - 1])))
                stack.append((sp + 1, t, tp, m - int(a[sp] + a[r - 1]) + int(a[s - 1])))
        return tuple(out)


def solve_floating(
    chain: Chain, memory_limit: int, printed: bool = False
) -> tuple[float, tuple[Op, ...] | None, int]:
    """Optimal floating-checkpoint plan of a discretised chain.

    Parameters
    ----------
    chain
        The discretised chain (integer sizes).
    memory_limit
        The limit in units, a^0 included (as the simulator counts it).
    printed
        Reproduce the thesis's printed recurrence (no ``C3``, printed thresholds) instead of
        the corrected DP; see the module docstring.

    Returns
    -------
    value, plan, states
        Optimal makespan (``inf`` when infeasible), the plan (``None`` when infeasible) and
        the number of DP cells.

    Examples
    --------
    >>> c = Chain.from_rotor([1], [2, 0], [1, 1], [1, 2])
    >>> value, plan, _ = solve_floating(c, 5)
    >>> value, [str(op) for op in plan]
    (3.0, ['F_all 1', 'Loss', 'B 1'])
    """
    budget = memory_limit - chain.input_size
    if budget < 0:
        return INF, None, 0
    table = FloatingTable(chain, budget, printed=printed)
    value = table.value()
    if not np.isfinite(value):
        return INF, None, table.states
    return value, table.plan(), table.states
