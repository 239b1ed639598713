"""Smallest memory limits that are feasible *as solved*, after discretisation.

A method that reports ``min_feasible_memory`` promises that solving again at exactly that
limit (same slots) finds a plan. Without rounding the least limit is a number the method
computes (the persistent DP's min-max recurrence, the min-peak ILP, the smallest peak of a
baseline's plans). With rounding (CONTRACT section 2: ``unit = max(1, M // S)``, sizes
rounded up to units, limit ``M // unit``) that number can be infeasible: rounding adds up
to one unit per stored value. :func:`smallest_solvable_limit` finds the least limit at or
above it whose rounded instance is feasible, given ``need(unit)``: the units the method
needs on the chain rounded to ``unit`` (e.g. the DP recurrence on the rounded chain, or the
rounded peak of a witness plan).

With ``unit = 1`` (limits below ``2 S``) the answer is exact. Above, the search is per unit
(the least limit with unit ``u`` that fits is ``max(u S, need(u) u)``): Newton-like jumps up
to a fitting unit, then bisection to within 0.1 % of the unit (feasibility after rounding is
nearly but not exactly monotone in the limit); every returned limit has been checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from optmem.problems.checkpoint import unit_of

PRECISION = 1e-3
# how a hint qualifies its limit: a larger limit can round to fewer units and fail
AS_SOLVED = "as solved: sizes rounded up to the discretisation unit of that limit"
MAX_STEPS = 200
COARSEST = 2**62
"""A unit above every size of a chain (sizes add up to at most 2^50): every size is then
one unit, or none."""


def smallest_solvable_limit(
    low: int, need: Callable[[int], int | None], slots: int, *,
    units_of_limit: Callable[[int, int], int] | None = None,
) -> int | None:
    """The least limit ``M >= low`` with ``need(unit(M)) <= limit_units(M)``, or ``None``.

    Parameters
    ----------
    low
        A lower bound on every feasible limit (the least limit without rounding).
    need
        ``unit -> units needed`` on the chain rounded to ``unit`` (``None``: no plan).
    slots
        ``S`` of the discretisation.
    units_of_limit
        ``(M, unit) -> limit in units``; default ``M // unit`` (``dp:rotor`` keeps
        ``min(S, M // unit)``). Its value at the largest limit of a unit must not grow
        with the unit (both do not), and ``need`` must not grow with the unit (rounding
        up to a coarser unit never adds units): the search stops as soon as
        ``need(COARSEST)`` exceeds every coarser unit's largest limit.

    Examples
    --------
    >>> need = lambda u: -(-900 // u) + 3   # 900 bytes + 3 values rounded up
    >>> smallest_solvable_limit(903, need, slots=500)   # unit 1: exact
    903
    >>> m = smallest_solvable_limit(100_000, lambda u: -(-100_000 // u) + 3, slots=500)
    >>> m, m // unit_of(m, 500) >= -(-100_000 // unit_of(m, 500)) + 3
    (100701, True)
    >>> print(smallest_solvable_limit(2002, lambda u: 1002, slots=500))  # 1,002 values
    None
    """
    limit_units = units_of_limit or (lambda m, u: m // u)
    cache: dict[int, int | None] = {}

    def at_unit(u: int) -> int | None:
        """The least fitting limit whose unit is ``u`` (``None`` if none)."""
        if u not in cache:
            n = need(u)
            first, last = (0, 2 * slots - 1) if u == 1 else (u * slots, u * slots + slots - 1)
            found = None
            if n is not None:
                m = max(first, low, n * u)
                if m <= last and limit_units(m, u) >= n:
                    found = m
            cache[u] = found
        return cache[u]

    u = unit_of(max(0, low), slots)
    if at_unit(u) is not None:
        return at_unit(u)
    # every size rounds to one unit of COARSEST: no coarser unit needs fewer units, and no
    # coarser unit holds more than the limit with the largest M of its unit
    floor = need(COARSEST)
    bad, good = u, None
    for _ in range(MAX_STEPS):  # jump up until a unit fits
        if floor is not None and floor > limit_units(bad * slots + slots - 1, bad):
            return None  # (1,002 one-unit values and 500 slots: 400 rounded solves before)
        n = need(bad)
        if n is None:
            return None
        ratio = n / max(1, limit_units(bad * slots + slots - 1, bad) if bad > 1 else slots)
        nxt = max(bad + 1, math.ceil(bad * max(ratio, 1.0 + PRECISION)))
        if at_unit(nxt) is not None:
            good = nxt
            break
        bad = nxt
    if good is None:
        return None
    while good - bad > max(1, int(good * PRECISION)):
        mid = (bad + good) // 2
        if at_unit(mid) is not None:
            good = mid
        else:
            bad = mid
    return at_unit(good)


def too_few_slots() -> str:
    """The end of a hint when :func:`smallest_solvable_limit` finds no limit (``None``).

    Every stored value takes at least one unit, so with few slots no limit fits.
    """
    return "every stored value takes at least one slot; raise slots (--slots)"
