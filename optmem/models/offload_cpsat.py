"""Exact CP-SAT model of OFF_int (integral offloading) on small chains.

The papers leave an exact model as future work (thesis conclusion; digest section 4 sketches
one). This model follows the sketch, with the memory semantics of
:mod:`optmem.simulate.offload` made exact so that decode -> simulate reproduces the optimum:

* compute ops: the store-all sequence ``F_all 1..L, Loss, B L..1``, chained intervals
  (start ``s_j``, end ``e_j = s_j + d_j``), ``s_0 = 0``;
* for each offloadable value ``k`` (``abar_k``, ``k = 0..L-1``; ``abar_0 = a^0``): a boolean
  ``off_k`` and optional intervals ``O_k`` and ``P_k`` of length ``size_k / beta`` on the link,
  all in one ``NoOverlap`` (O.1); ``O_k`` starts after ``F_all k`` ends; the release
  ``r_k >= end(O_k), e(F_all k+1)`` (O.7: the GPU copy lives until the offload is complete
  and the forward reader is done); ``P_k`` starts at or after ``r_k`` and ends before
  ``B k+1`` starts;
* memory of compute op ``j`` (O.7: the prefetch reserves from its start):
  ``peak_j - sum_k size_k h_{k,j} <= M`` where ``h_{k,j}`` may be 1 only if ``off_k``,
  ``r_k <= s_j`` and ``start(P_k) >= e_j`` (the value is on the host during the whole op);
* memory at a prefetch start that falls between compute ops (``g_{k,j}``: ``e_j <= start(P_k)
  < s_{j+1}``): ``after_j - sum_{k' != k} size_k' x_{k',k} <= M`` where ``x`` may be 1 only if
  ``off_k'``, ``r_k' <= start(P_k)`` and ``start(P_k') > start(P_k)``;
* objective: the end of ``B 1``.

Memory is not a CP-SAT reservoir/cumulative: those net simultaneous events, which would
hide the memory of zero-duration ops (the hardness gadgets have many), and the per-op rule of
the simulator (a release during an op does not help it) is not a level constraint. Times are
scaled to integers (exact when every duration is a multiple of ``1/scale``).

The formulation is written once, for any compute sequence, in
:mod:`optmem.models.remat_offload_cpsat` (its windows generalise the ``k`` above: a value may
be on the host between two of its uses); OFF_int is that model on the store-all sequence,
which :func:`build_offload_cpsat` builds. Solve and decode are the general model's
(:func:`~optmem.models.remat_offload_cpsat.solve_transfer_cpsat`,
:func:`~optmem.models.remat_offload_cpsat.decode_transfer_cpsat`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from optmem.chain import Chain

if TYPE_CHECKING:
    from optmem.models.remat_offload_cpsat import TransferCPSAT

MAX_SCALE = 10**6


def time_scale(values: list[float]) -> tuple[int, bool]:
    """Smallest integer scale making every value integral (``exact`` False if none <= 1e6)."""
    scale = 1
    for v in values:
        fr = Fraction(v).limit_denominator(10**6)
        if abs(float(fr) - v) > 1e-12 * max(1.0, abs(v)):
            return 1000, False
        scale = scale * fr.denominator // math.gcd(scale, fr.denominator)
        if scale > MAX_SCALE:
            return 1000, False
    return scale, True


def build_offload_cpsat(chain: Chain, memory: int, beta: float) -> TransferCPSAT:
    """OFF_int: the transfer model of the store-all sequence (``chain`` discretised)."""
    from optmem.models.remat_offload_cpsat import build_transfer_cpsat
    from optmem.plan import store_all_plan
    from optmem.solvers.remat_offload_exact import all_windows

    ops = store_all_plan(chain.length)
    return build_transfer_cpsat(chain, memory, beta, ops, all_windows(chain, ops))
