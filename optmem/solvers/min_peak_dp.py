r"""Dynamic programs for the least peak memory of a single-pass checkpoint set (Hong et al.).

Digest ``shared/design/hong_delta.md`` part A, with its errata applied:

* :func:`static_min_peak`: Alg. 3 (Theorem 1, eq. 8), optimum of eq. 6 in O(n^3). **d_n is
  forced** into the set (``c_s = d_n + M(n-1, s)``; the paper's ``M(n, s)`` optimises a
  different objective), the window is updated before it is read, and values of ``s`` that
  cannot beat the incumbent are skipped.
* :func:`suffix_min_peak`: Alg. 5 (Theorem 2, eqs. 13-16) in O(n^2), written for any
  segment cost: with checkpoint weights ``w`` and segment costs ``U(h, i)``, it minimises
  ``max over segments (h,i] of sum_{c in C, c <= h} w_c + U(h, i)``; ``j`` ranges over
  ``i < j <= n`` (the paper's ``j < n`` is an erratum) and the answer is ``M(0)``.
* :func:`linear_min_peak`: Alg. 6 (Lemmas 1-4) for the PyTorch model, amortised O(n)
  after an O(n log n) sparse table: a **queue** of undominated candidates (Lemma 3), the
  crossing candidate compared with its **neighbour in the queue** (not the literal index
  ``j+1`` of line 13), and a **range-max structure** instead of the paper's incremental
  maximum, which cannot shrink when the window moves.

Notation (Hong's indices; ``d_0`` the input, ``d_n`` the last output)::

    M(i)   = least peak of the suffix i..n when d_i is a checkpoint, checkpoints left of i
             not counted                                                    (eq. 13)
    U(i,j) = s(i,j) + d_j,  s(i,j) = sum_{i<k<j} d_k + max_{i<=k<j} d_k       (eqs. 11, 16)
    M(n)   = d_n,  M(i) = d_i + min_{i<j<=n} max(M(j), U(i,j))              (eq. 14)

These functions work on plain integer lists; the facade methods live in
:mod:`optmem.solvers.min_peak`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optmem.models.min_peak_segments import (
    SegmentRow,
    optmem_weights_and_row,
    pytorch_row,
    segment_model,
)

__all__ = ["SegmentRow", "linear_min_peak", "optmem_weights_and_row", "pytorch_row",
           "quadratic_min_peak", "segment_model", "static_min_peak", "suffix_min_peak"]


def _path(nxt: Sequence[int], n: int) -> tuple[int, ...]:
    out = [0]
    while out[-1] != n:
        out.append(nxt[out[-1]])
    return tuple(out)


# ------------------------------------------------------------------ Alg. 3 (static model)
def static_min_peak(d: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Optimum of the static objective (eq. 6) and one optimal set, by Alg. 3.

    Examples
    --------
    >>> static_min_peak([1, 1, 1, 3, 1])
    (6, (0, 2, 4))
    """
    n = len(d) - 1
    if n < 1:
        raise ValueError("a chain needs at least one stage")
    prefix = np.concatenate([[0], np.cumsum(np.asarray(d, dtype=np.int64))])
    # candidate largest-segment sums: 0 and every d_a + ... + d_b, 1 <= a <= b <= n-1
    sums = {0}
    for a in range(1, n):
        sums.update((prefix[a + 1:n + 1] - prefix[a]).tolist())
    best: int | None = None
    best_set: tuple[int, ...] = (0, n)
    floor = d[0] + d[n]  # every set pays d_0 + d_n
    for s in sorted(sums):
        if best is not None and s + floor >= best:
            break  # larger s cannot do better (c_s >= d_0 + d_n)
        value, arg = _static_for_bound(d, int(s))
        if best is None or value < best:
            best = value
            best_set = _static_set(arg, n)
    assert best is not None
    return int(best), best_set


def _static_for_bound(d: Sequence[int], s: int) -> tuple[int, list[int]]:
    """``s + c_s`` and the argmins of eq. 8 for one bound ``s`` (monotone-deque window)."""
    n = len(d) - 1
    M = [0] * (n + 1)
    arg = [0] * (n + 1)
    M[0] = d[0]

    def val(j: int) -> int:  # d_j + M(j-1), with M(-1) = 0
        return d[j] + (M[j - 1] if j >= 1 else 0)

    window: list[int] = [0]  # indices with increasing val; head at position `head`
    head = 0
    left = 0  # l(i): smallest j with sum_{j<k<=i} d_k <= s
    run = 0  # sum_{left<k<=i} d_k
    for i in range(1, n):
        v = val(i)
        while len(window) > head and val(window[-1]) >= v:
            window.pop()
        window.append(i)
        run += d[i]
        while run > s:
            left += 1
            run -= d[left]
        while window[head] < left:
            head += 1
        M[i] = val(window[head])
        arg[i] = window[head]
    c_s = d[n] + (M[n - 1] if n >= 1 else 0)
    return s + c_s, arg


def _static_set(arg: Sequence[int], n: int) -> tuple[int, ...]:
    cps = {0, n}
    i = n - 1
    while i >= 1:
        j = arg[i]
        if j == 0:
            break
        cps.add(j)
        i = j - 1
    return tuple(sorted(cps))


# ------------------------------------------------------------------ Alg. 5 (any segment cost)
def suffix_min_peak(
    w: Sequence[float], row: SegmentRow
) -> tuple[float, tuple[int, ...], list[float]]:
    """Least ``max_{(h,i]} sum_{c<=h} w_c + U(h,i)`` over sets containing 0 and ``n``.

    Parameters
    ----------
    w
        Checkpoint weights ``w_0..w_n`` (Hong: ``w = d``).
    row
        ``row(h)`` returns ``[U(h, h+1), ..., U(h, n)]``.

    Returns
    -------
    peak, checkpoints, M
        The optimum ``M(0)``, one optimal set (smallest next checkpoint on ties, i.e. more
        checkpoints and less recomputation) and the table ``M``.
    """
    n = len(w) - 1
    M = [0.0] * (n + 1)
    nxt = [n] * (n + 1)
    M[n] = -np.inf  # no segment after the last checkpoint
    for i in range(n - 1, -1, -1):
        costs = row(i)
        best, arg = np.inf, n
        for off, u in enumerate(costs):
            j = i + 1 + off
            v = max(M[j], u)
            if v < best:
                best, arg = v, j
        M[i] = w[i] + best
        nxt[i] = arg
    return M[0], _path(nxt, n), M


def quadratic_min_peak(d: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Optimum of the PyTorch model (eq. 12) by Alg. 5, O(n^2).

    Examples
    --------
    >>> quadratic_min_peak([1, 1, 1, 3, 1])
    (8, (0, 3, 4))
    """
    peak, cps, _ = suffix_min_peak(d, pytorch_row(d))
    return int(peak), cps


# ------------------------------------------------------------------ Alg. 6 (PyTorch model)
class SparseMax:
    """Range maximum in O(1) after O(n log n) preprocessing (sparse table)."""

    def __init__(self, values: Sequence[int]) -> None:
        table = [list(values)]
        width = 1
        while 2 * width <= len(values):
            prev = table[-1]
            table.append([max(prev[k], prev[k + width]) for k in range(len(prev) - width)])
            width *= 2
        self._table = table

    def query(self, lo: int, hi: int) -> int:
        """``max(values[lo..hi])`` (inclusive bounds, ``lo <= hi``)."""
        level = (hi - lo + 1).bit_length() - 1
        row = self._table[level]
        return max(row[lo], row[hi - (1 << level) + 1])


def linear_min_peak(d: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Optimum of the PyTorch model (eq. 12) by the corrected Alg. 6, amortised O(n).

    The queue holds the undominated candidates ``j`` (Lemma 3); read from the most recent
    (smallest index) to the oldest, ``M`` decreases and ``U(i, .)`` increases (Lemmas 1-2),
    so ``max(M(j), U(i,j))`` is valley-shaped and its minimum sits at the crossing, found
    by a pointer that only moves towards smaller indices (Lemma 4).

    Examples
    --------
    >>> linear_min_peak([1, 1, 1, 3, 1])
    (8, (0, 3, 4))
    """
    n = len(d) - 1
    prefix = [0]
    for x in d:
        prefix.append(prefix[-1] + x)
    rmq = SparseMax(d)

    def U(i: int, j: int) -> int:  # noqa: N802 - paper notation
        return (prefix[j] - prefix[i + 1]) + rmq.query(i, j - 1) + d[j]

    M = [0] * (n + 1)
    nxt = [n] * (n + 1)
    M[n] = d[n]
    queue = [n]  # position 0: largest index (oldest); last position: smallest index
    ptr = 0
    for i in range(n - 1, -1, -1):
        p = min(ptr, len(queue) - 1)
        top = len(queue) - 1
        while p != top and U(i, queue[p]) >= M[queue[p]]:
            p += 1  # towards smaller indices
        best_pos = p
        best = max(M[queue[p]], U(i, queue[p]))
        if p > 0:  # neighbour on the larger-index side
            other = max(M[queue[p - 1]], U(i, queue[p - 1]))
            if other < best:
                best, best_pos = other, p - 1
        j = queue[best_pos]
        M[i] = d[i] + best
        nxt[i] = j
        ptr = best_pos
        while queue and M[queue[-1]] >= M[i]:
            queue.pop()
        queue.append(i)
        if ptr >= len(queue) - 1:  # j was popped (or is the new top's slot)
            ptr = len(queue) - 1
    return M[0], _path(nxt, n)
