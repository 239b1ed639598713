"""Memory of a single-pass checkpoint set under Hong et al.'s models: the min-peak oracle.

Two independent ways to get the peak of a set ``C`` (digest ``hong_delta.md`` part A):

* closed forms: eq. 6 (static model) and eqs. 9-12 (PyTorch-trace model);
* phase-by-phase replays that keep a set of live tensors (digest A.2.5): forward phases
  ``k = 1..n``, then backward phases ``i = n..1`` with the per-segment gradient buffer of
  Alg. 4. Their maximum equals the closed form (a test checks it on random sets).

The ``optmem`` model has no closed form here: its oracle is the checkpoint simulator
(:func:`optmem.simulate.checkpoint.simulate_checkpoint`) replaying
:func:`optmem.problems.min_peak.checkpoint_plan`.

Notation: ``d[0..n]`` tensor sizes (``d[0]`` the input), ``C`` a sorted set containing 0
and ``n``; ``h`` and ``i`` two consecutive checkpoints (segment ``(h, i]``).
"""

from __future__ import annotations

from collections.abc import Sequence

from optmem.problems.min_peak import MinPeakProblem, checkpoint_plan, normalize_checkpoints


def segment_cost(d: Sequence[int], h: int, i: int) -> int:
    """``s(h,i) = sum_{h<k<i} d_k + max_{h<=k<i} d_k`` (Hong eq. 11)."""
    return sum(d[h + 1:i]) + max(d[h:i])


def pytorch_checkpoint_memory(d: Sequence[int], checkpoints: Sequence[int]) -> dict[int, int]:
    """``m(i)`` of every checkpoint ``i > 0`` (Hong eq. 9 / eq. 12).

    Examples
    --------
    >>> pytorch_checkpoint_memory([1, 1, 1, 3, 1], (0, 3, 4))
    {3: 7, 4: 8}
    """
    out = {}
    for h, i in zip(checkpoints, checkpoints[1:], strict=False):
        resident = sum(d[c] for c in checkpoints if c <= i)
        out[i] = resident + segment_cost(d, h, i)
    return out


def pytorch_peak(d: Sequence[int], checkpoints: Sequence[int]) -> int:
    """Peak of the PyTorch-trace model: ``max_i m(i)`` (Hong eq. 12)."""
    return max(pytorch_checkpoint_memory(d, checkpoints).values())


def static_cost(d: Sequence[int], checkpoints: Sequence[int]) -> int:
    """Static objective: checkpoint sum plus the largest segment (Hong eq. 6).

    Examples
    --------
    >>> static_cost([1, 1, 1, 3, 1], (0, 2, 4))
    6
    """
    largest = max(sum(d[h + 1:i]) for h, i in zip(checkpoints, checkpoints[1:], strict=False))
    return sum(d[c] for c in checkpoints) + largest


def _forward_trace(d: Sequence[int], cset: set[int]) -> list[int]:
    """Memory during each forward phase: live checkpoints, the input and the output."""
    trace = []
    for k in range(1, len(d)):
        live = {c for c in cset if c < k} | {k - 1, k}
        trace.append(sum(d[x] for x in live))
    return trace


def pytorch_trace(d: Sequence[int], checkpoints: Sequence[int]) -> list[int]:
    """Memory of every phase under Hong's Alg. 4, replayed with a live-tensor set.

    Backward at checkpoint ``i`` (previous checkpoint ``h``): recompute ``d_{h+1..i-1}``,
    swap the gradient buffer for one of size ``max(d_h..d_{i-1})``; every step ``k`` is
    sampled while ``d_k`` is still live, then frees it (eqs. 9-10, not the transient of the
    listing's order, digest A.1.4).
    """
    cset = set(checkpoints)
    trace = _forward_trace(d, cset)
    live = set(cset)
    buffer = 0
    prev = {i: h for h, i in zip(checkpoints, checkpoints[1:], strict=False)}
    for k in range(len(d) - 1, 0, -1):
        if k in cset:
            h = prev[k]
            live |= set(range(h + 1, k))
            buffer = max(d[h:k])
        trace.append(sum(d[x] for x in live) + buffer)
        live.discard(k)
    return trace


def static_trace(d: Sequence[int], checkpoints: Sequence[int]) -> list[int]:
    """Memory of every phase under eq. 6's assumptions (checkpoints resident, block frees)."""
    cset = set(checkpoints)
    trace = _forward_trace(d, cset)
    resident = sum(d[c] for c in cset)
    for h, i in reversed(list(zip(checkpoints, checkpoints[1:], strict=False))):
        segment = 0
        for k in range(h + 1, i):
            segment += d[k]
            trace.append(resident + segment)
        trace.append(resident + segment)
    return trace


def model_peak(problem: MinPeakProblem, checkpoints: Sequence[int]) -> int:
    """Peak memory of a checkpoint set under ``problem.model`` (by replay, not formula)."""
    cps = normalize_checkpoints(checkpoints, problem.n)
    if problem.model == "optmem":
        from optmem.simulate.checkpoint import simulate_checkpoint

        return simulate_checkpoint(problem.chain, checkpoint_plan(cps)).peak_memory
    d = problem.sizes()
    trace = pytorch_trace(d, cps) if problem.model == "pytorch" else static_trace(d, cps)
    return max(trace)
