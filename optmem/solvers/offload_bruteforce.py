"""Brute force for OFF_int on tiny chains: every offload set, transfer order and issue point.

An independent oracle for the exact model (digest section 4, last bullet): a plan is the
store-all compute sequence with, for each offloaded value ``k``, an ``offload`` issued after
``F_all k`` and a ``prefetch`` issued after ``F_all k+1`` and before ``B k+1``. The link runs
transfers in plan order, so enumerating the transfer order and a non-decreasing issue point
(the compute op each transfer is listed before) enumerates every such plan; each one is
replayed by :func:`optmem.simulate.offload.simulate_offload`. Any schedule of the model is
reproduced by the plan that lists each transfer after the last compute op started no later
than it (see the simulator's docstring), so the minimum is the OFF_int optimum.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.plan import AnyOp, offload, prefetch, store_all_plan
from optmem.simulate.offload import simulate_offload
from optmem.solvers.offload_schedule import value_op, value_sizes


def _orders(values: list[int]) -> Iterator[list[tuple[str, int]]]:
    """Transfer orders on the link with each offload before its prefetch."""
    items = [("O", k) for k in values] + [("P", k) for k in values]
    for perm in itertools.permutations(items):
        pos = {t: i for i, t in enumerate(perm)}
        if all(pos[("O", k)] < pos[("P", k)] for k in values):
            yield list(perm)


def _gaps(order: list[tuple[str, int]], length: int, lo: int = 0) -> Iterator[list[int]]:
    """Non-decreasing issue points: transfer ``t`` is listed before compute op ``gap``."""
    if not order:
        yield []
        return
    kind, k = order[0]
    first = max(lo, k if kind == "O" else k + 1)
    last = 2 * length - k
    for g in range(first, last + 1):
        for rest in _gaps(order[1:], length, g):
            yield [g, *rest]


def interleave_transfers(
    ops: Sequence[AnyOp], transfers: Sequence[tuple[str, tuple[str, int]]], gaps: Sequence[int]
) -> list[AnyOp]:
    """The compute ``ops`` with each transfer listed right before its compute op.

    Transfer ``t`` is ``("O"|"P", value)`` and goes before op ``gaps[t]``; transfers keep
    their order.
    """
    plan: list[AnyOp] = []
    ti = 0
    for j, op in enumerate(ops):
        while ti < len(transfers) and gaps[ti] == j:
            kind, value = transfers[ti]
            plan.append((offload if kind == "O" else prefetch)(*value))
            ti += 1
        plan.append(op)
    return plan


def brute_force_offload(chain: Chain, bandwidth: float, memory_limit: int
                        ) -> tuple[float, tuple[AnyOp, ...], int] | None:
    """Minimum makespan over all plans, the plan, and how many plans were simulated."""
    length = chain.length
    seq = store_all_plan(length)
    sizes = value_sizes(chain)
    cand = [k for k in range(length) if sizes[k] > 0 and bandwidth > 0]
    plans = (interleave_transfers(seq, [(kind, value_op(k)) for kind, k in order], gaps)
             for r in range(len(cand) + 1)
             for values in itertools.combinations(cand, r)
             for order in _orders(list(values))
             for gaps in _gaps(order, length))
    return fastest_plan(chain, bandwidth, memory_limit, plans)


def fastest_plan(chain: Chain, bandwidth: float, memory_limit: int,
                 plans: Iterable[Sequence[AnyOp]]
                 ) -> tuple[float, tuple[AnyOp, ...], int] | None:
    """The plan of least simulated makespan among ``plans``, and how many were simulated.

    Plans the simulator rejects (over the limit, invalid) are passed over; of equal
    makespans (within 1e-12) the first is kept. ``None`` when none replays.
    """
    best: tuple[float, tuple[AnyOp, ...]] | None = None
    count = 0
    for plan in plans:
        count += 1
        try:
            sim = simulate_offload(chain, plan, bandwidth, memory_limit)
        except PlanError:
            continue
        if best is None or sim.makespan < best[0] - 1e-12:
            best = (sim.makespan, tuple(plan))
    if best is None:
        return None
    return best[0], best[1], count


def check_brute_length(length: int, most: int) -> None:
    """Refuse a chain longer than ``most`` stages for a brute force (``method`` error)."""
    if length > most:
        raise OptmemInputError(f"brute force is for L <= {most}; got L = {length}",
                               field="method")
