"""The per-segment form of the min-peak models (Hong et al.; digest ``hong_delta.md`` part A).

Both the ``pytorch`` and the ``optmem`` model of a single-pass checkpoint set ``C`` have a
peak of the form ``max over segments (h,i] of sum_{c in C, c <= h} w_c + U(h,i)``: this
module gives the weights ``w`` and the segment costs ``U`` of a problem. The dynamic
programs (:mod:`optmem.solvers.min_peak_dp`) and the exact ILP
(:mod:`optmem.models.min_peak_ilp`) both read them, so they live in the model layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from optmem.problems.min_peak import MinPeakProblem

__all__ = ["SegmentRow", "optmem_weights_and_row", "pytorch_row", "segment_model"]

SegmentRow = Callable[[int], Sequence[float]]
"""``row(i) = [U(i, j) for j = i+1..n]``."""


def pytorch_row(d: Sequence[int]) -> SegmentRow:
    """``row(i) = [U(i,j) for j = i+1..n]`` of the PyTorch model (eqs. 11, 16)."""
    n = len(d) - 1

    def row(i: int) -> list[int]:
        out = []
        total, top = 0, d[i]
        for j in range(i + 1, n + 1):  # total = sum_{i<k<j} d_k, top = max_{i<=k<j} d_k
            out.append(total + top + d[j])
            total += d[j]
            top = max(top, d[j])
        return out

    return row


# ------------------------------------------------------------------ optmem accounting
def optmem_weights_and_row(
    a: Sequence[int], abar: Sequence[int], of: Sequence[int], ob: Sequence[int],
    loss_overhead: int,
) -> tuple[list[int], SegmentRow]:
    """Weights and segment costs of the single-pass class under optmem's simulator.

    ``a[0..n]`` activation sizes (``a[0]`` the input), ``abar[1..n]``, ``of[1..n]``,
    ``ob[1..n]`` (index 0 unused). For a segment ``(h, i]`` with checkpoints ``c <= h``
    resident (``w_c = a_c``, ``w_n = 0``: the last segment is taped, not checkpointed)::

        F_all k:  sum_{h<q<=k} abar_q + of_k + [i < n] a_i        (delta^i is held)
        Loss:     sum_{h<q<=n} abar_q + a_n + o_loss                (i = n only)
        B k:      sum_{h<q<=k} abar_q + a_k + a_{k-1} + ob_k        (delta^k, delta^{k-1})

    ``U(h, i)`` is the largest of these; forward ``F_ck``/``F_none`` never exceed them.
    """
    n = len(a) - 1
    w = [*a[:n], 0]

    def row(h: int) -> list[int]:
        out = []
        tape = 0
        fwd_peak = 0  # max_k sum_{h<q<=k} abar_q + of_k
        bwd_peak = 0
        for i in range(h + 1, n + 1):
            tape += abar[i]
            fwd_peak = max(fwd_peak, tape + of[i])
            bwd_peak = max(bwd_peak, tape + a[i] + a[i - 1] + ob[i])
            if i < n:
                out.append(max(fwd_peak + a[i], bwd_peak))
            else:
                out.append(max(fwd_peak, tape + a[n] + loss_overhead, bwd_peak))
        return out

    return w, row


# ------------------------------------------------------------------ per-problem data
def segment_model(problem: MinPeakProblem) -> tuple[list[int], SegmentRow]:
    """Weights ``w`` and segment costs ``U`` of a ``pytorch`` or ``optmem`` problem.

    Both models are ``max over segments (h,i] of sum_{c in C, c <= h} w_c + U(h,i)``;
    the PyTorch model has ``w = d`` and ``U(h,i) = s(h,i) + d_i`` (eq. 12 rewritten as in
    eq. 13).
    """
    if problem.model == "pytorch":
        d = list(problem.sizes())
        return d, pytorch_row(d)
    if problem.model == "optmem":
        c = problem.chain
        return optmem_weights_and_row(
            [c.input_size, *c.output_size], [0, *c.saved_size], [0, *c.fwd_overhead],
            [0, *c.bwd_overhead], c.loss_bwd_overhead)
    raise ValueError(f"the {problem.model} model has no per-segment form")
