"""Time scaling of the former OFF_int CP-SAT model (kept only for its last importer).

The OFF_int model now lives in :mod:`optmem.models.offload` (one formulation, emitted to
CP-SAT and to MILP engines). :func:`time_scale` stays here because
:mod:`optmem.models.remat_offload_cpsat` imports it; delete this module together with that
one (issue 15 item 1 replaces it).
"""

from __future__ import annotations

import math
from fractions import Fraction

MAX_SCALE = 10**6


def time_scale(values: list[float]) -> tuple[int, bool]:
    """Smallest integer scale making every value integral (``exact`` False if none <= 1e6).

    Examples
    --------
    >>> time_scale([0.5, 0.25]), time_scale([1 / 3])
    ((4, True), (3, True))
    """
    scale = 1
    for v in values:
        fr = Fraction(v).limit_denominator(10**6)
        if abs(float(fr) - v) > 1e-12 * max(1.0, abs(v)):
            return 1000, False
        scale = scale * fr.denominator // math.gcd(scale, fr.denominator)
        if scale > MAX_SCALE:
            return 1000, False
    return scale, True
