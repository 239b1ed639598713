"""Baseline checkpointing plans: what users run today, as plans the simulator can judge.

* ``store_all``: PyTorch's default (every forward with grad).
* ``recompute_all``: rotor's ``recompute_all``: recompute from a^0 before every backward.
* ``chen``: Chen et al.'s sqrt(n) segments (rotor's ``chen_sqrt``).
* ``sequential``: ``torch.utils.checkpoint.checkpoint_sequential`` with the best segment count
  that fits the limit.
* ``revolve``: the homogeneous optimum Opt_0 of thesis chapter 1 (Theorem 1, eqs. 1.1-1.3;
  Griewank-Walther's binomial checkpointing) turned into a DNN plan by running ``F_all``
  right before each ``B`` (thesis 2.2); optimal for uniform AD chains only, evaluated on the
  real chain by the simulator with the best number of checkpoint slots that fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from optmem.chain import Chain
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op, segments_plan
from optmem.plan import store_all_plan as store_all_plan  # the store-all baseline (core)
from optmem.solvers.checkpoint_dp import require_table_bytes


def recompute_all_plan(length: int) -> tuple[Op, ...]:
    """Recompute from a^0 before every backward (rotor's ``recompute_all``)."""
    ops: list[Op] = []
    for j in range(length + 1, 0, -1):
        if j >= 2:
            ops.append(F_ck(1))
            ops.extend(F_none(k) for k in range(2, j))
        ops.extend([LOSS] if j == length + 1 else [F_all(j), B(j)])
    return tuple(ops)


def torch_segments(length: int, segments: int) -> list[tuple[int, int]]:
    """Segments of ``checkpoint_sequential``: size ``L // k``, the last takes the rest."""
    size = length // segments
    bounds = [(k * size + 1, (k + 1) * size) for k in range(segments - 1)]
    bounds.append(((segments - 1) * size + 1, length))
    return bounds


def chen_plan(length: int, segments: int | None = None) -> tuple[Op, ...]:
    """Chen's sqrt(n) plan: ``round(sqrt(L))`` equal segments (rotor's ``chen_sqrt``)."""
    k = segments or max(1, round(math.sqrt(length)))
    return segments_plan(torch_segments(length, min(k, length)))


def store_all_or_chen(chain: Chain, memory_limit: float) -> tuple[str, tuple[Op, ...]]:
    """A plan without a DP: store-all when its peak fits ``memory_limit``, else Chen's.

    What a solve stopped before its DP finished answers with (the checkpoint and remat +
    offload exact methods, stop 77), labelled ``"store all"`` or ``"sqrt(n) segments"``;
    the caller replays it (Chen's plan may not fit either).
    """
    if chain.store_all_peak() <= memory_limit:
        return "store all", store_all_plan(chain.length)
    return "sqrt(n) segments", chen_plan(chain.length)


def sequential_plans(length: int) -> Iterator[tuple[int, tuple[Op, ...]]]:
    """Every ``checkpoint_sequential`` plan, by segment count ``1..L``."""
    for k in range(1, length + 1):
        yield k, segments_plan(torch_segments(length, k))


def revolve_table(length: int, slots: int, uf: float, ub: float) -> np.ndarray:
    """Opt_0(l, m) of thesis Theorem 1 for ``l = 0..length`` and ``m = 0..slots``.

    ``Opt_0(0, m) = ub`` for m >= 2; ``Opt_0(l, m) = +inf`` for l >= 1, m <= 2;
    ``Opt_0(l, m) = min_{1<=i<=l} i*uf + Opt_0(l-i, m-1) + Opt_0(i-1, m)`` (eq. 1.3).
    """
    require_table_bytes(8.0 * (length + 1) * (slots + 1), what="Revolve table", length=length,
                        memory=slots + 1)
    opt = np.full((length + 1, slots + 1), np.inf)
    opt[0, 2:] = ub
    for m in range(3, slots + 1):
        for ell in range(1, length + 1):
            i = np.arange(1, ell + 1)
            opt[ell, m] = np.min(i * uf + opt[ell - i, m - 1] + opt[i - 1, m])
    return opt


def revolve_plan(
    length: int, slots: int, uf: float = 1.0, ub: float = 1.0, table: np.ndarray | None = None
) -> tuple[Op, ...]:
    """The Revolve plan with ``slots`` AD slots, as DNN ops (F_all right before each B).

    The AD chain ADJCHAIN(L, m) covers stages 1..L+1, the loss being the last backward.
    ``table`` is a precomputed :func:`revolve_table` with at least ``slots + 1`` columns.
    """
    opt = revolve_table(length, slots, uf, ub) if table is None else table
    if not np.isfinite(opt[length, slots]):
        raise ValueError(f"revolve needs at least 3 slots for {length} stages")
    ops: list[Op] = []

    def backward_of(stage: int) -> list[Op]:
        return [LOSS] if stage == length + 1 else [F_all(stage), B(stage)]

    # stack of (first stage s, forward steps l, slots m): ADJCHAIN(l, m) from a^{s-1}
    stack: list[tuple[int, int, int] | Op] = [(1, length, slots)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            ops.append(item)
            continue
        s, ell, m = item
        if ell == 0:
            ops.extend(backward_of(s))
            continue
        i = np.arange(1, ell + 1)
        i_best = int(i[np.argmin(i * uf + opt[ell - i, m - 1] + opt[i - 1, m])])
        ops.append(F_ck(s))
        ops.extend(F_none(k) for k in range(s + 1, s + i_best))
        stack.extend([(s, i_best - 1, m), (s + i_best, ell - i_best, m - 1)])
    return tuple(ops)
