r"""The combined offloading + rematerialisation DP of thesis chapter 4 ("pofo").

Shilova, PhD thesis, chapter 4 (digest ``shared/design/offload.md`` section 5), under
Assumptions 4 (OR.1 persistence, OR.2 offload in the forward phase only, OR.3 offloads done
before the loss and prefetches after it, OR.5 progressive allocation/release):

* forward phase ``OC_x(s, A, dF, dB)`` (5.4): minimal time from the start of ``F_s`` to the
  end of ``B_s``; ``A`` kept GPU values (current input excluded), ``dF`` the offload
  backlog, ``dB`` what must be prefetched before ``B_{s-1}``, ``x`` whether the input is
  ``abar^{s-1}``. Case 1 (``F_all s``, eq. 4.3 first term) and Case 2 (``F_ck s``,
  ``F_none`` up to ``t``, backward of the segment by ``C_Delta``); for each, the input is
  offloaded (``v = 1``) or kept (``v = 2``) with the state update of Table 4.1;
* loss step (5.5) with the synchronisation wait ``eps_G = (dF' + dB') / beta``;
* backward sub-DP ``C_Delta(s, t, A, Delta)`` (5.6, eq. 4.4), remat only, with the pending
  prefetch volume ``Delta``; ``C_Delta(s, t, A, 0) = C_MP(s, t, M - A)`` (thesis Thm 6), so
  the ``Delta = 0`` states are read from the persistent checkpoint table of
  :mod:`optmem.solvers.checkpoint_dp` (values and decisions);
* answer ``OC_0(1, 0, 0, 0)`` (5.7), rebuilt from the arg-mins into compute ops and the set
  of offloaded segment inputs.

Memory is discretised into the units of the given chain (the caller coarsens it: thesis
``N = 50`` values); the backlogs ``dF``, ``dB``, ``Delta`` are rounded *up* to whole units
after each subtraction, so every state is conservative. The complexity is
``O(L^2 N^3 + L^3 N^2)`` in the worst case (Thm 12); states are explored top-down from the
answer, so only reachable ones are built.

``last_segment``: the text bounds the end of a forward ``F_ck`` segment by ``t <= L-1``
(reproduction mode, ``"thesis"``); the digest's ``t <= L`` variant (``"extended"``) also
lets the last segment end just before the loss, which makes the DP never worse than the
persistent checkpoint DP at ``beta = 0`` (digest 7.1 item 4, erratum 14).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optmem.chain import Chain
from optmem.models.interrupt import poll_now
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op
from optmem.simulate.checkpoint import ABAR, Value
from optmem.solvers.checkpoint_dp import (
    CHOICE_ALL,
    ChainArrays,
    PersistentTable,
    require_table_bytes,
    solve_persistent_table,
)

INF = math.inf
_EPS = 1e-9


@dataclass
class PofoSolution:
    """DP value (time under Assumptions 4), compute ops and offloaded segment inputs."""

    value: float
    ops: tuple[Op, ...] = ()
    offloaded: tuple[Value, ...] = ()
    states: int = 0
    info: dict = field(default_factory=dict)


class PofoDP:
    """The chapter 4 DP on an (already discretised) chain.

    Parameters
    ----------
    chain
        Chain with integer sizes in units.
    memory_limit
        ``M_GPU`` in units (includes ``a^0``).
    bandwidth
        Units per time unit (``0``: no offloading; the DP is then ``C_MP``).
    last_segment
        ``"thesis"`` (``t <= L-1``) or ``"extended"`` (``t <= L``).
    """

    def __init__(self, chain: Chain, memory_limit: int, bandwidth: float,
                 last_segment: str = "extended", mode: str = "table", backlog_unit: int = 1):
        if last_segment not in ("thesis", "extended"):
            raise ValueError(f"unknown last_segment {last_segment!r}")
        if mode not in ("table", "memo"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode = mode
        self.chain = chain
        self.ar = ChainArrays.from_chain(chain)
        self.L = chain.length
        self.M = int(memory_limit)
        self.beta = float(bandwidth)
        self.t_max = self.L - 1 if last_segment == "thesis" else self.L
        ar = self.ar
        self.a = [int(v) for v in ar.a]
        self.abar = [int(v) for v in ar.abar]
        self.of = [int(v) for v in ar.of]
        self.ob = [int(v) for v in ar.ob]
        self.uf = [float(v) for v in ar.uf]
        self.ub = [float(v) for v in ar.ub]
        self.table: PersistentTable = solve_persistent_table(chain, max(self.M, 0), "paper")
        self._fwd: dict[tuple[int, int, int, int, int], tuple[float, tuple]] = {}
        self._bwd: dict[tuple[int, int, int, int], tuple[float, tuple]] = {}
        # backlogs above M cannot be resident: such states are infeasible (both modes)
        self.q = max(1, int(backlog_unit))
        self.n_d = -(-max(self.M, 0) // self.q) + 1 if self.beta > 0 else 1
        require_table_bytes(8.0 * 2 * (self.L + 2) ** 2 * (self.M + 1) * self.n_d,
                            what="remat-offload DP", length=self.L, memory=self.M + 1,
                            field="grid or backlog_grid values")
        self._cd: np.ndarray | None = None
        self._oc_tab: dict[tuple[int, int], np.ndarray] = {}

    # ------------------------------------------------------------------ helpers
    def _eps(self, excess: float) -> float:
        """Waiting time for ``excess`` memory units to move over the link (4.1-4.2)."""
        if excess <= _EPS:
            return 0.0
        return INF if self.beta <= 0 else excess / self.beta

    def _qc(self, volume: float) -> int:
        """A remaining volume as a number of backlog units, rounded up (never below 0)."""
        return max(0, math.ceil(volume / self.q - _EPS))

    def _input(self, x: int, s: int) -> int:
        return self.abar[s - 1] if x else self.a[s - 1]

    def _mk_fwd(self, s: int, k: int) -> int:
        """``M^{s,L}_{F_k^none}`` with ``delta_{L+1} = 0`` (5.2)."""
        if k == s:
            return self.a[s] + self.of[s]
        return self.a[k - 1] + self.a[k] + self.of[k]

    # ------------------------------------------------------------------ backward sub-DP
    def cdelta(self, s: int, t: int, A: int, D: int) -> float:
        """``C_Delta(s, t, A, Delta)`` (5.6, eq. 4.4)."""
        if A > self.M or self.n_d <= D:
            return INF
        if D <= 0:
            m = self.M - A
            return float(self.table.cost[s, t, m])
        if self._cd is not None:
            return float(self._cd[s, t, A, D])
        key = (s, t, A, D)
        hit = self._bwd.get(key)
        if hit is None:
            hit = self._cdelta(s, t, A, D)
            self._bwd[key] = hit
        return hit[0]

    def _cdelta(self, s: int, t: int, A: int, D: int) -> tuple[float, tuple]:
        a, abar, of, ob, uf, ub, beta = (self.a, self.abar, self.of, self.ob, self.uf,
                                         self.ub, self.beta)
        q = self.q
        room = self.M - A
        m_f = a[t] + abar[s] + of[s]
        m_b = abar[s] + a[s] + a[s - 1] + ob[s]
        if s == t:
            if max(m_f, m_b) > room:
                return INF, ()
            e = max(self._eps(m_f - beta * ub[s] - room + D * q), self._eps(m_b - room + D * q))
            return uf[s] + ub[s] + e, ("base",)
        best: tuple[float, tuple] = (INF, ())
        if max(m_f, m_b) <= room:
            e_b = self._eps(m_b - room + D * q)
            d1 = self._qc(D * q - (ub[s] + e_b) * beta)
            sub = self.cdelta(s + 1, t, A + abar[s], d1)
            if sub < INF:
                d2 = max(d1 * q - sub * beta, 0.0)
                e_f = self._eps(m_f - room + d2)
                best = (uf[s] + sub + ub[s] + e_f + e_b, ("all", d1))
        m_null = max([a[t] + a[s] + of[s]] + [a[t] + a[k - 1] + a[k] + of[k]
                                               for k in range(s + 1, t)])
        if m_null <= room:
            sum_f = 0.0
            for sp in range(s, t):
                sum_f += uf[sp]
                right = self.cdelta(s, sp, A, D)
                if right == INF:
                    continue
                d2 = self._qc(D * q - right * beta)
                left = self.cdelta(sp + 1, t, A + a[sp], d2)
                if left == INF:
                    continue
                d3 = max(d2 * q - left * beta, 0.0)
                lemma, tail = -INF, 0.0
                for k in range(sp, s - 1, -1):  # distance to the end of the forward sweep
                    mk = (a[t] + a[s] + of[s]) if k == s else (a[t] + a[k - 1] + a[k] + of[k])
                    lemma = max(lemma, mk - beta * tail)
                    tail += uf[k]
                val = sum_f + left + right + self._eps(lemma - room + d3)
                if val < best[0]:
                    best = (val, ("ck", sp, d2))
        return best

    # ------------------------------------------------------------------ forward phase
    def oc(self, x: int, s: int, A: int, dF: int, dB: int) -> float:
        """``OC_x(s, A, dF, dB)`` (5.4, eq. 4.3; loss step 5.5)."""
        if A > self.M or dF >= self.n_d or dB >= self.n_d:
            return INF
        if self._oc_tab:
            return float(self._oc_tab[(x, s)][A, dF, dB])
        key = (x, s, A, dF, dB)
        hit = self._fwd.get(key)
        if hit is None:
            hit = self._oc(x, s, A, dF, dB)
            self._fwd[key] = hit
        return hit[0]

    def _next(self, v: int, A: int, dF: int, dB: int, inp: int, d_f: float, d_b: float
              ) -> tuple[int, int, int]:
        """Table 4.1."""
        q = self.q
        if v == 1:
            return A, self._qc(dF * q + inp - d_f), self._qc(max(dB * q - d_b, 0.0) + inp)
        return A + inp, self._qc(dF * q - d_f), self._qc(dB * q - d_b)

    def _choices(self, inp: int) -> tuple[int, ...]:
        return (2, 1) if self.beta > 0 and inp > 0 else (2,)

    def _oc(self, x: int, s: int, A: int, dF: int, dB: int) -> tuple[float, tuple]:
        a, abar, of, ob, uf, ub, beta, M = (self.a, self.abar, self.of, self.ob, self.uf,
                                            self.ub, self.beta, self.M)
        inp = self._input(x, s)
        room = M - A
        if s == self.L + 1:  # the loss: F_all L+1 then B L+1 (one Loss op)
            m_f, m_b = of[s], a[s - 1] + ob[s]
            if max(m_f, m_b) + inp > room:
                return INF, ()
            e_f = self._eps(m_f - room + dF * self.q + inp)
            e_b = self._eps(m_b - room + dB * self.q + inp)
            rest_f = max(dF * self.q - (uf[s] + e_f) * beta, 0.0)
            rest_b = max(dB * self.q - (ub[s] + e_b) * beta, 0.0)
            e_g = self._eps(rest_f + rest_b)
            return uf[s] + ub[s] + e_f + e_b + e_g, ("loss",)
        best: tuple[float, tuple] = (INF, ())
        # case 1: F_all s
        m_f = abar[s] + of[s]
        m_b = abar[s] + a[s] + a[s - 1] + ob[s]
        if max(m_f, m_b) + inp <= room:
            e_f = self._eps(m_f - room + dF * self.q + inp)
            e_b = self._eps(m_b - room + dB * self.q + inp)
            d_f, d_b = (uf[s] + e_f) * beta, (ub[s] + e_b) * beta
            for v in self._choices(inp):
                nxt = self._next(v, A, dF, dB, inp, d_f, d_b)
                val = uf[s] + ub[s] + e_f + e_b + self.oc(1, s + 1, *nxt)
                if val < best[0]:
                    best = (val, ("all", v, nxt))
        # case 2: F_ck s, F_none s+1..t
        sum_f, lemma, worst_rest = 0.0, -INF, -INF
        first = self._mk_fwd(s, s)
        if first + inp > room:
            return best
        for t in range(s, self.t_max + 1):
            mk = self._mk_fwd(s, t)
            if t > s:
                worst_rest = max(worst_rest, mk)
            lemma = max(lemma, mk - beta * sum_f)
            sum_f += uf[t]
            if worst_rest > room:
                break
            keep_ok = max(first, worst_rest) + inp <= room
            e_f = self._eps(lemma - room + dF * self.q + inp)
            c = self.cdelta(s, t, A + inp, dB)
            if c == INF:
                continue
            d_f, d_b = (sum_f + e_f) * beta, c * beta
            for v in self._choices(inp):
                if v == 2 and not keep_ok:
                    continue
                nxt = self._next(v, A, dF, dB, inp, d_f, d_b)
                val = sum_f + e_f + c + self.oc(0, t + 1, *nxt)
                if val < best[0]:
                    best = (val, ("ck", t, v, nxt))
        return best

    # ------------------------------------------------------------------ vectorised fill
    def _veps(self, excess: np.ndarray) -> np.ndarray:
        if self.beta <= 0:
            return np.where(excess > _EPS, INF, 0.0)
        return np.where(excess > _EPS, excess / self.beta, 0.0)

    def _flow(self, duration: np.ndarray) -> np.ndarray:
        """Volume moved by the link in ``duration`` (``inf`` stays ``inf``, no nan)."""
        duration = np.asarray(duration, dtype=float)
        finite = np.isfinite(duration)
        return np.where(finite, np.where(finite, duration, 0.0) * self.beta, INF)

    def _vceil(self, x: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`_qc`."""
        return np.ceil(np.maximum(x / self.q - _EPS, 0.0)).astype(np.int64)

    def _gather2(self, arr: np.ndarray, ai: np.ndarray, di: np.ndarray) -> np.ndarray:
        ok = (ai <= self.M) & (di < self.n_d)
        return np.where(ok, arr[np.minimum(ai, self.M), np.minimum(di, self.n_d - 1)], INF)

    def _gather3(self, arr: np.ndarray, ai: np.ndarray, fi: np.ndarray, bi: np.ndarray
                 ) -> np.ndarray:
        top = self.n_d - 1
        ok = (ai <= self.M) & (fi <= top) & (bi <= top)
        return np.where(ok, arr[np.minimum(ai, self.M), np.minimum(fi, top),
                                np.minimum(bi, top)], INF)

    def _fill_tables(self) -> None:
        """Fill ``C_Delta`` and ``OC`` for every state, vectorised over the memory axes.

        Same recurrences (and roundings) as :meth:`_cdelta` and :meth:`_oc`, which the
        reconstruction re-evaluates state by state.
        """
        L, M, n_d = self.L, self.M, self.n_d
        cd = np.full((L + 2, L + 2, M + 1, n_d), INF)
        mem = np.arange(M + 1)
        for d in range(L):
            for s in range(1, L + 1 - d):
                poll_now()  # stops at its solve's deadline (optmem.models.interrupt)
                t = s + d
                cd[s, t] = self._cd_cell(cd, s, t)
                cd[s, t, :, 0] = self.table.cost[s, t][M - mem]
        self._cd = cd
        for s in range(L + 1, 0, -1):
            for x in ((0, 1) if s > 1 else (0,)):
                poll_now()
                self._oc_tab[(x, s)] = self._oc_cell(x, s)

    def _cd_cell(self, cd: np.ndarray, s: int, t: int) -> np.ndarray:
        a, abar, of, ob, uf, ub = self.a, self.abar, self.of, self.ob, self.uf, self.ub
        M, beta = self.M, self.beta
        A = np.arange(M + 1)[:, None]
        D = np.arange(self.n_d)[None, :]
        Dq = D * self.q
        room = (M - A).astype(float)
        m_f = a[t] + abar[s] + of[s]
        m_b = abar[s] + a[s] + a[s - 1] + ob[s]
        ok = max(m_f, m_b) <= room
        if s == t:
            e = np.maximum(self._veps(m_f - beta * ub[s] - room + Dq),
                           self._veps(m_b - room + Dq))
            return np.where(ok, uf[s] + ub[s] + e, INF)
        out = np.full((M + 1, self.n_d), INF)
        if ok.any():
            e_b = self._veps(m_b - room + Dq)
            d1 = self._vceil(Dq - self._flow(ub[s] + e_b))
            sub = self._gather2(cd[s + 1, t], A + abar[s], d1)
            d2 = np.maximum(d1 * self.q - self._flow(sub), 0.0)
            e_f = self._veps(m_f - room + d2)
            out = np.where(ok, uf[s] + sub + ub[s] + e_f + e_b, INF)
        m_null = max([a[t] + a[s] + of[s]] + [a[t] + a[k - 1] + a[k] + of[k]
                                               for k in range(s + 1, t)])
        ok_null = m_null <= room
        if not ok_null.any():
            return out
        sum_f = 0.0
        for sp in range(s, t):
            poll_now()  # each split: a few vector ops over the (A, Delta) grid (stop 79)
            sum_f += uf[sp]
            right = cd[s, sp]
            d2i = self._vceil(Dq - self._flow(right))
            left = self._gather2(cd[sp + 1, t], A + a[sp], d2i)
            d3 = np.maximum(d2i * self.q - self._flow(left), 0.0)
            lemma, tail = -INF, 0.0
            for k in range(sp, s - 1, -1):
                mk = (a[t] + a[s] + of[s]) if k == s else (a[t] + a[k - 1] + a[k] + of[k])
                lemma = max(lemma, mk - beta * tail)
                tail += uf[k]
            val = sum_f + left + right + self._veps(lemma - room + d3)
            out = np.minimum(out, np.where(ok_null, val, INF))
        return out

    def _oc_cell(self, x: int, s: int) -> np.ndarray:
        a, abar, of, ob, uf, ub = self.a, self.abar, self.of, self.ob, self.uf, self.ub
        M, n_d = self.M, self.n_d
        A = np.arange(M + 1)[:, None, None]
        F = np.arange(n_d)[None, :, None]
        Bk = np.arange(n_d)[None, None, :]
        Fq, Bq = F * self.q, Bk * self.q
        room = (M - A).astype(float)
        inp = self._input(x, s)
        shape = (M + 1, n_d, n_d)
        if s == self.L + 1:
            m_f, m_b = of[s], a[s - 1] + ob[s]
            ok = max(m_f, m_b) + inp <= room
            e_f = self._veps(m_f - room + Fq + inp)
            e_b = self._veps(m_b - room + Bq + inp)
            rest_f = np.maximum(Fq - self._flow(uf[s] + e_f), 0.0)
            rest_b = np.maximum(Bq - self._flow(ub[s] + e_b), 0.0)
            val = uf[s] + ub[s] + e_f + e_b + self._veps(rest_f + rest_b)
            return np.broadcast_to(np.where(ok, val, INF), shape).copy()
        best = np.full(shape, INF)
        choices = self._choices(inp)
        # case 1: F_all s
        m_f = abar[s] + of[s]
        m_b = abar[s] + a[s] + a[s - 1] + ob[s]
        ok = max(m_f, m_b) + inp <= room
        if ok.any():
            e_f = self._veps(m_f - room + Fq + inp)
            e_b = self._veps(m_b - room + Bq + inp)
            d_f, d_b = self._flow(uf[s] + e_f), self._flow(ub[s] + e_b)
            base = uf[s] + ub[s] + e_f + e_b
            nxt = self._oc_tab[(1, s + 1)]
            for v in choices:
                sub = self._next_gather(nxt, v, A, F, Bk, inp, d_f, d_b)
                best = np.minimum(best, np.where(ok, base + sub, INF))
        # case 2: F_ck s, F_none s+1..t
        first = self._mk_fwd(s, s)
        ok_first = first + inp <= room
        if not ok_first.any():
            return best
        sum_f, lemma, worst_rest = 0.0, -INF, -INF
        for t in range(s, self.t_max + 1):
            poll_now()  # each segment end: a few gathers over the (A, dF, dB) grid (stop 79)
            mk = self._mk_fwd(s, t)
            if t > s:
                worst_rest = max(worst_rest, mk)
            lemma = max(lemma, mk - self.beta * sum_f)
            sum_f += uf[t]
            if worst_rest > M:
                break
            ok_off = ok_first & (worst_rest <= room)
            ok_keep = ok_first & (max(first, worst_rest) + inp <= room)
            e_f = self._veps(lemma - room + Fq + inp)
            c = self._gather2(self._cd[s, t], A + inp, Bk)  # type: ignore[index]
            d_f, d_b = self._flow(sum_f + e_f), self._flow(c)
            base = sum_f + e_f + c
            nxt = self._oc_tab[(0, t + 1)]
            for v in choices:
                sub = self._next_gather(nxt, v, A, F, Bk, inp, d_f, d_b)
                mask = ok_keep if v == 2 else ok_off
                best = np.minimum(best, np.where(mask, base + sub, INF))
        return best

    def _next_gather(self, nxt: np.ndarray, v: int, A: np.ndarray, F: np.ndarray,
                     Bk: np.ndarray, inp: int, d_f: np.ndarray, d_b: np.ndarray) -> np.ndarray:
        """``OC`` of the next state of Table 4.1, for every state at once."""
        q = self.q
        if v == 1:
            return self._gather3(nxt, A, self._vceil(F * q + inp - d_f),
                                 self._vceil(np.maximum(Bk * q - d_b, 0.0) + inp))
        return self._gather3(nxt, A + inp, self._vceil(F * q - d_f), self._vceil(Bk * q - d_b))

    # ------------------------------------------------------------------ answer
    def solve(self) -> PofoSolution:
        """``OC_0(1, 0, 0, 0)`` and its reconstruction (5.7).

        The ``table`` mode and the reconstruction use no deep recursion (an explicit stack);
        the ``memo`` mode (the top-down cross-check) recurses about ``3 L`` frames deep and
        fits Python's default recursion limit for chains of up to about 300 stages.
        """
        if self.mode == "table":
            self._fill_tables()
        value = self.oc(0, 1, 0, 0, 0)
        if value == INF:
            return PofoSolution(INF, states=self.states)
        ops: list[Op] = []
        offloaded: list[Value] = []
        self._rebuild(ops, offloaded)
        return PofoSolution(value, tuple(ops), tuple(offloaded), self.states)

    @property
    def states(self) -> int:
        """DP states (forward and backward with ``Delta > 0``)."""
        if self.mode == "table":
            fwd = sum(t.size for t in self._oc_tab.values())
            return fwd + (0 if self._cd is None else self._cd.size)
        return len(self._fwd) + len(self._bwd)

    def _rebuild(self, ops: list[Op], offloaded: list[Value]) -> None:
        """Append the ops of the optimal plan (and the offloaded values) in order.

        A depth-first walk of the decisions with an explicit stack whose items are
        forward states ``("fwd", x, s, A, dF, dB)``, backward states ``("bwd", s, t, A, D)``
        and ops to emit.
        """
        stack: list[tuple[Any, ...] | Op] = [("fwd", 0, 1, 0, 0, 0)]
        while stack:
            item = stack.pop()
            if isinstance(item, Op):
                ops.append(item)
            elif item[0] == "fwd":
                x, s, A, dF, dB = item[1:]
                stack.extend(reversed(self._expand_fwd(x, s, A, dF, dB, ops, offloaded)))
            else:
                s, t, A, D = item[1:]
                stack.extend(reversed(self._expand_bwd(s, t, A, D, ops)))

    def _expand_fwd(self, x: int, s: int, A: int, dF: int, dB: int, ops: list[Op],
                    offloaded: list[Value]) -> list[tuple[Any, ...] | Op]:
        """Emit the ops of forward state ``(x, s, A, dF, dB)``; return what follows, in order."""
        _, dec = self._oc(x, s, A, dF, dB)
        inp = self._input(x, s)
        value: Value = (ABAR, s - 1) if x and s > 1 else ("a", s - 1)
        if dec[0] == "loss":
            ops.append(LOSS)
            return []
        if dec[0] == "all":
            _, v, nxt = dec
            if v == 1:
                offloaded.append(value)
            ops.append(F_all(s))
            return [("fwd", 1, s + 1, nxt[0], nxt[1], nxt[2]), B(s)]
        _, t, v, nxt = dec
        if v == 1:
            offloaded.append(value)
        ops.append(F_ck(s))
        ops.extend(F_none(k) for k in range(s + 1, t + 1))
        return [("fwd", 0, t + 1, nxt[0], nxt[1], nxt[2]), ("bwd", s, t, A + inp, dB)]

    def _expand_bwd(self, s: int, t: int, A: int, D: int, ops: list[Op]
                    ) -> list[tuple[Any, ...] | Op]:
        """Emit the ops of backward state ``(s, t, A, D)``; return what follows, in order."""
        if D <= 0:
            ops.extend(checkpoint_subplan(self.table, s, t, self.M - A))
            return []
        _, dec = self._cdelta(s, t, A, D)
        if dec[0] == "base":
            ops.extend([F_all(s), B(s)])
            return []
        if dec[0] == "all":
            ops.append(F_all(s))
            return [("bwd", s + 1, t, A + self.abar[s], dec[1]), B(s)]
        _, sp, d2 = dec
        ops.append(F_ck(s))
        ops.extend(F_none(k) for k in range(s + 1, sp + 1))
        return [("bwd", sp + 1, t, A + self.a[sp], d2), ("bwd", s, sp, A, D)]


def checkpoint_subplan(table: PersistentTable, s: int, t: int, m: int) -> list[Op]:
    """Ops of the persistent checkpoint plan of sub-chain ``s..t`` with budget ``m``.

    Same reconstruction as :meth:`PersistentTable.plan`, from any cell ``(s, t, m)``.
    """
    L = table.arrays.L
    a, abar = table.arrays.a, table.arrays.abar
    out: list[Op] = []
    stack: list[tuple[int, int, int] | Op] = [(s, t, m)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            out.append(item)
            continue
        s0, t0, m0 = item
        if s0 == t0:
            out.extend([LOSS] if s0 == L + 1 else [F_all(s0), B(s0)])
            continue
        choice = table.choice(s0, t0, m0)
        if choice == CHOICE_ALL:
            out.append(F_all(s0))
            stack.extend([B(s0), (s0 + 1, t0, m0 - int(abar[s0]))])
        elif choice > 0:
            out.append(F_ck(s0))
            out.extend(F_none(j) for j in range(s0 + 1, choice))
            stack.extend([(s0, choice - 1, m0), (choice, t0, m0 - int(a[choice - 1]))])
        else:
            raise ValueError(f"no persistent plan for {(s0, t0, m0)}")
    return out
