"""Fractional models of offloading: OFF_frac (lower bound) and OFF_comm (exact DP).

Thesis chapter 3 (Shilova) / Beaumont et al. 2019, digested in ``shared/design/offload.md``
sections 3.1-3.2. Notation (layers ``l = 1 .. L+1``, layer ``L+1`` is the loss):

==============  ==========================================================================
symbol          meaning (optmem chain field)
==============  ==========================================================================
``abar[l]``     tape of layer l (``saved_size``); ``abar[0] = input_size``, ``abar[L+1]=0``
``delta[l]``    gradient produced by B_{l+1} (``output_size``); ``delta[0]=input_size``,
                ``delta[L+1] = 0``
``mf[l]``       memory of F_l besides its input: ``o_F + abar[l]``            (3.1)
``mb[l]``       memory of B_l besides its input: ``o_B + abar[l] + delta[l] + delta[l-1]`` (3.2)
``A``           kept (not offloaded) saved activations among ``abar[0..i-2]``
``DF``, ``DB``  offload backlog after F_{i-1}; amount to prefetch before B_{i-1} (may be < 0:
                idle link time times beta)
==============  ==========================================================================

Per-layer recurrences (3.4)-(3.15), feasibility (3.8)-(3.9), junction idle (3.16)-(3.17),
the DP of Algorithm 5 (Theorem 10: optimal for OFF_comm among ordered no-wait schedules),
and the OFF_frac optimum of Theorem 8 (the eager, ordered, no-wait schedule that offloads
exactly ``M_peak - M``), evaluated with the same recurrences with fractional decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optmem.chain import Chain
from optmem.models.interrupt import poll_now


@dataclass(frozen=True)
class Layers:
    """The chain in thesis layer indexing (lists of length ``L + 2``, index 0 unused for u/o)."""

    uf: list[float]
    ub: list[float]
    abar: list[float]
    mf: list[float]
    mb: list[float]
    length: int

    @classmethod
    def of(cls, chain: Chain) -> Layers:
        """Build the layer view of ``chain`` (the loss is layer ``L + 1``)."""
        n = chain.length
        abar = [chain.input_size, *chain.saved_size, 0]
        delta = [chain.input_size, *chain.output_size, 0]
        uf = [0.0, *chain.fwd_time, 0.0]
        ub = [0.0, *chain.bwd_time, chain.loss_bwd_time]
        of = [0, *chain.fwd_overhead, 0]
        ob = [0, *chain.bwd_overhead, chain.loss_bwd_overhead]
        mf = [0.0] + [of[i] + abar[i] for i in range(1, n + 2)]
        mb = [0.0] + [ob[i] + abar[i] + delta[i] + delta[i - 1] for i in range(1, n + 2)]
        return cls(uf, ub, [float(x) for x in abar], mf, mb, n)

    def peak(self) -> float:
        """M_peak of the store-all sequence (3.3)."""
        best, prefix = 0.0, 0.0
        for i in range(1, self.length + 2):
            prefix += self.abar[i - 1]
            best = max(best, max(self.mf[i], self.mb[i]) + prefix)
        return best

    def min_memory(self) -> float:
        """Smallest memory in which the chain runs at all in this model (digest 1.1)."""
        return max(max(self.mf[i], self.mb[i]) + self.abar[i - 1]
                   for i in range(1, self.length + 2))


def _pos(x: float) -> float:
    return x if x > 0 else 0.0


def junction(lay: Layers, memory: float, beta: float, df: float, db: float, a_last: float,
             cheap: bool = False) -> float:
    """Idle time between F_{L+1} and B_{L+1}, (3.16)/(3.17) (``cheap``: (DF+ + DB+)/beta).

    ``a_last`` is ``A_{L+2}`` (kept saved activations), so ``M_F = a_last + DF+`` and
    ``M_B = a_last + DB+``.
    """
    if cheap or beta <= 0:
        total = _pos(df) + _pos(db)
        return 0.0 if total == 0 else (math.inf if beta <= 0 else total / beta)
    n = lay.length
    if df <= 0 and db <= 0:
        return 0.0
    if df > 0 and db > 0:
        return (df + db) / beta
    if df > 0:  # offloading continues into the first backward ops, before any prefetch
        avail = -db / beta
        m_f = a_last + df
        best = max(df / beta - avail, 0.0)
        u_acc, freed = 0.0, 0.0
        for j in range(n + 1, 0, -1):  # B_{L+1}, B_L, ...: U^B_j = sum_{i>j} u_B_i
            if u_acc >= avail:
                break
            need = lay.mb[j] - lay.abar[j] - freed  # R_{B_j}: delta_{j-1}+delta_j+o_B_j - freed
            best = max(best, (need - memory + m_f) / beta - u_acc)
            u_acc += lay.ub[j]
            freed += lay.abar[j]
        return best
    avail = -df / beta  # prefetching starts during the last forward ops
    m_b = a_last + db
    best = max(db / beta - avail, 0.0)
    u_acc, freed = 0.0, 0.0
    for j in range(n + 1, 0, -1):
        if u_acc >= avail:
            break
        need = lay.mf[j] - lay.abar[j] - freed  # R_{F_j} = o_F_j - sum_{i>=j+1} abar_i
        best = max(best, (need - memory + m_b) / beta - u_acc)
        u_acc += lay.uf[j]
        freed += lay.abar[j]
    return best


def evaluate(chain: Chain, memory: float, beta: float, fractions: Sequence[float],
             cheap_junction: bool = False) -> float:
    """OFF_comm makespan of the ordered no-wait schedule offloading ``fractions``.

    ``fractions[k]`` of ``abar_k`` (``k = 0 .. L-1``) is offloaded; the value follows
    (3.4)-(3.17) and is ``inf`` if infeasible.

    With 0/1 fractions this is the OFF_comm value of an offload set; with an eager vector of
    total ``M_peak - M`` it is the OFF_frac optimum (Theorem 8).
    """
    lay = Layers.of(chain)
    n = lay.length
    a = df = db = 0.0
    total = 0.0
    for i in range(1, n + 2):
        x = lay.abar[i - 1]
        f = fractions[i - 1] if i - 1 < len(fractions) and i <= n else 0.0
        free = memory - a - x
        if lay.mf[i] > free + 1e-9 or lay.mb[i] > free + 1e-9:
            return math.inf
        m_f = a + _pos(df) + x
        m_b = a + _pos(db) + x
        if beta <= 0:
            if m_f + lay.mf[i] > memory + 1e-9 or m_b + lay.mb[i] > memory + 1e-9 or f > 0:
                return math.inf
            eps_f = eps_b = 0.0
        else:
            eps_f = _pos((lay.mf[i] - memory + m_f) / beta)
            eps_b = _pos((lay.mb[i] - memory + m_b) / beta)
        cap_f = (eps_f + lay.uf[i]) * beta
        cap_b = (eps_b + lay.ub[i]) * beta
        if f > 0:
            df = _pos(df) + f * x - cap_f
            db = _pos(db - cap_b) + f * x
        else:
            df = df - cap_f
            db = db - cap_b
        a += (1 - f) * x
        total += lay.uf[i] + eps_f + lay.ub[i] + eps_b
    return total + junction(lay, memory, beta, df, db, a, cheap_junction)


def eager_fractions(chain: Chain, amount: float) -> list[float]:
    """Eager vector: offload ``abar_0, abar_1, ...`` in full, the last one partially."""
    lay = Layers.of(chain)
    out = []
    left = amount
    for k in range(lay.length):
        x = lay.abar[k]
        if left <= 0 or x == 0:
            out.append(0.0)
            continue
        f = min(1.0, left / x)
        out.append(f)
        left -= f * x
    return out


def fractional_bound(chain: Chain, memory: float, beta: float) -> float:
    """OFF_frac optimum (Theorem 8): a lower bound on every offload plan's makespan.

    ``inf`` when the limit is below the minimum memory of the model (digest 1.1).
    """
    lay = Layers.of(chain)
    if memory < lay.min_memory():
        return math.inf
    need = lay.peak() - memory
    if need <= 0:
        return evaluate(chain, memory, beta, [0.0] * lay.length)
    if beta <= 0:
        return math.inf
    return evaluate(chain, memory, beta, eager_fractions(chain, need))


def prop3_bound(chain: Chain, memory: float, beta: float) -> float:
    """Prop. 3: ``max(sum of compute, 2 (M_peak - M) / beta)``."""
    need = Layers.of(chain).peak() - memory
    compute = chain.total_compute_time()
    if need <= 0:
        return compute
    return math.inf if beta <= 0 else max(compute, 2 * need / beta)


# ------------------------------------------------------------------ the DP (Algorithm 5)
@dataclass(frozen=True)
class DPResult:
    """Optimal OFF_comm value of the discretised instance and its offload set."""

    value: float
    offloaded: tuple[int, ...]
    states: int


def solve_comm_dp(chain: Chain, memory: int, beta: float, *, cheap_junction: bool = False,
                  max_states: int = 2_000_000, layers: Layers | None = None) -> DPResult:
    """Algorithm 5 on integer memory (``chain`` already discretised, ``beta`` in units/time).

    Transfer capacities ``u * beta`` are rounded down through prefix sums (digest 3.2.6), so
    the value is exact when every ``u * beta`` is an integer. Negative backlogs are clamped at
    ``-memory`` (a larger idle credit can never be used: at most ``memory`` is in flight).
    ``layers`` replaces the layer sizes of ``chain`` (integers; see :func:`thesis_layers`).
    """
    lay = layers if layers is not None else Layers.of(chain)
    n = lay.length
    m = int(memory)
    if beta <= 0:
        v = evaluate(chain, memory, 0.0, [0.0] * n)
        return DPResult(v, (), 1)

    abar = [int(x) for x in lay.abar]
    # a capacity above everything that could ever be in flight is as good as unlimited; the
    # cap keeps u * beta finite (a bandwidth of 1e308, or one made inf by the thesis'
    # discretisation, gave prefix sums inf - inf = NaN and 0 * inf = NaN)
    cap = float(m + sum(abar) + 1)
    positive = [t for t in (*lay.uf[1:], *lay.ub[1:]) if t > 0]
    rate = min(beta, cap / min(positive)) if positive else 0.0

    def rounded(times: list[float]) -> list[int]:
        capacity = np.minimum(np.asarray(times[1:], dtype=float) * rate, cap)
        prefix = np.floor(np.cumsum(capacity) + 1e-9)
        return [0, *np.diff(np.concatenate([[0.0], prefix])).astype(np.int64).tolist()]

    cf, cb = rounded(lay.uf), rounded(lay.ub)
    mf = [int(x) for x in lay.mf]
    mb = [int(x) for x in lay.mb]
    A = np.zeros(1, np.int64)
    DF = np.zeros(1, np.int64)
    DB = np.zeros(1, np.int64)
    val = np.zeros(1)
    parents: list[tuple[np.ndarray, np.ndarray]] = []
    states = 1
    for i in range(1, n + 2):
        poll_now()  # a solve's deadline (optmem.models.interrupt): one check per layer
        x = abar[i - 1]
        ok = (mf[i] <= m - A - x) & (mb[i] <= m - A - x)
        A, DF, DB, val = A[ok], DF[ok], DB[ok], val[ok]
        idx = np.flatnonzero(ok)
        if A.size == 0:
            return DPResult(math.inf, (), states)
        m_f = A + np.maximum(DF, 0) + x
        m_b = A + np.maximum(DB, 0) + x
        ef = np.maximum(mf[i] - m + m_f, 0)  # epsilon_F * beta, in units (3.6)
        eb = np.maximum(mb[i] - m + m_b, 0)  # (3.7)
        cost = val + lay.uf[i] + lay.ub[i] + (ef + eb) / beta
        capf, capb = ef + cf[i], eb + cb[i]
        keep = (A + x, DF - capf, DB - capb)
        options = [(keep, 0)]
        if i <= n and x > 0:
            off = (A, np.maximum(DF, 0) + x - capf, np.maximum(DB - capb, 0) + x)
            options.append((off, 1))
        nA = np.concatenate([o[0][0] for o in options])
        nF = np.maximum(np.concatenate([o[0][1] for o in options]), -m)
        nB = np.maximum(np.concatenate([o[0][2] for o in options]), -m)
        nv = np.concatenate([cost] * len(options))
        bit = np.concatenate([np.full(A.size, b, np.int8) for _, b in options])
        par = np.concatenate([idx] * len(options))
        # keep the best value per state
        key = (nA * (2 * m + 1) + (nF + m)) * (2 * m + 1) + (nB + m)
        order = np.lexsort((nv, key))
        key, first = key[order], np.ones(order.size, bool)
        first[1:] = key[1:] != key[:-1]
        sel = order[first]
        A, DF, DB, val = nA[sel], nF[sel], nB[sel], nv[sel]
        parents.append((par[sel], bit[sel]))
        states += int(sel.size)
        if sel.size > max_states:
            raise MemoryError(f"OFF_comm DP: {sel.size} states at layer {i}; use fewer slots")
    totals = np.array([v + junction(lay, m, beta, float(f), float(b), float(a),
                                    cheap_junction)
                       for a, f, b, v in zip(A, DF, DB, val, strict=True)])
    low = totals.min()
    ties = np.flatnonzero(totals <= low + 1e-9 * max(1.0, abs(low)))
    best = int(ties[np.argmax(A[ties])])  # among optima, offload the least
    value = float(totals[best])
    chosen = []
    j = best
    for i in range(n + 1, 0, -1):
        par, bit = parents[i - 1]
        if bit[j]:
            chosen.append(i - 1)
        j = int(par[j])
    return DPResult(value, tuple(sorted(chosen)), states)


def thesis_unit(memory: int, slots: int) -> float:
    """Bytes per slot of the thesis discretisation: ``memory / slots``.

    A limit of 0 uses ``1 / slots`` (and :func:`thesis_layers` then keeps 0 slots, so only
    sizes of 0 fit) instead of dividing every size by 0.
    """
    return (memory or 1) / slots


def thesis_layers(chain: Chain, memory: int, beta: float, slots: int,
                  rounded_up: frozenset[int] = frozenset()) -> tuple[Layers, int, float]:
    """The discretisation of thesis section 3.3.3.2 (digest 3.2.6, erratum 15).

    ``slots`` slots of ``memory / slots`` bytes; overheads and gradients rounded up; the
    saved activations through their prefix sums rounded up (optimistic: single values may be
    rounded down), except the indices in ``rounded_up``, rounded up individually. Returns
    the layers, the limit in slots and the bandwidth in slots per time unit.
    """
    lay = Layers.of(chain)
    n = lay.length
    unit = thesis_unit(memory, slots)
    abar = [0] * (n + 2)
    prefix_true, prefix_done = 0.0, 0
    for k in range(n + 2):
        prefix_true += lay.abar[k] / unit
        if k in rounded_up:
            abar[k] = math.ceil(lay.abar[k] / unit - 1e-9)
        else:
            abar[k] = max(0, math.ceil(prefix_true - 1e-9) - prefix_done)
        prefix_done += abar[k]
    # the other memory terms: mf = o_F + abar, mb = o_B + abar + delta_l + delta_{l-1}
    mf = [0.0] + [math.ceil((lay.mf[i] - lay.abar[i]) / unit - 1e-9) + abar[i]
                  for i in range(1, n + 2)]
    mb = [0.0] + [math.ceil((lay.mb[i] - lay.abar[i]) / unit - 1e-9) + abar[i]
                  for i in range(1, n + 2)]
    return (Layers(lay.uf, lay.ub, [float(x) for x in abar], mf, mb, n),
            slots if memory > 0 else 0, beta / unit)


def solve_comm_dp_thesis(chain: Chain, memory: int, beta: float, slots: int = 500, *,
                         cheap_junction: bool = False) -> tuple[DPResult, int]:
    """DYNPROG with the thesis discretisation and its iterative fix (digest 3.2.6).

    Runs the DP on optimistically rounded sizes; while the chosen set is infeasible in the
    continuous OFF_comm model (:func:`evaluate` on the original sizes), the value rounded
    down the most below its true size is rounded up and the DP re-run. Returns the result
    (its ``value`` re-evaluated on the original sizes) and the number of DP runs.
    """
    lay = Layers.of(chain)
    n = lay.length
    fixed: set[int] = set()
    runs = 0
    while True:
        layers, m, b = thesis_layers(chain, memory, beta, slots, frozenset(fixed))
        runs += 1
        dp = solve_comm_dp(chain, m, b, cheap_junction=cheap_junction, layers=layers)
        if not math.isfinite(dp.value):
            return dp, runs
        fractions = [1.0 if k in dp.offloaded else 0.0 for k in range(n)]
        value = evaluate(chain, memory, beta, fractions, cheap_junction)
        unit = thesis_unit(memory, slots)
        down = [(lay.abar[k] / unit - layers.abar[k], k) for k in range(n + 2)
                if k not in fixed and layers.abar[k] < lay.abar[k] / unit - 1e-9]
        if math.isfinite(value) or not down:
            return DPResult(value, dp.offloaded, dp.states), runs
        fixed.add(min(down)[1])
