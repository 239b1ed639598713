"""Exhaustive search over op sequences: the independent oracle for tiny chains.

Dijkstra over memory states (sets of stored values), with the op semantics of
:func:`optmem.simulate.transition`: every valid op whose peak fits the limit is an edge
weighted by its duration. The first final state popped is optimal for the full operation
model (no persistence assumption, pinning rule, no free discard). Exponential: meant for
``L <= 5`` or so.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op
from optmem.simulate.checkpoint import Value, initial_state, is_final, transition


def _candidate_ops(length: int) -> list[Op]:
    ops: list[Op] = [LOSS]
    for i in range(1, length + 1):
        ops.extend([F_all(i), F_ck(i), F_none(i), B(i)])
    return ops


State = frozenset[Value]
Step = Callable[[float, int, float], float | None]


def _search(chain: Chain, start_cost: float, step: Step, max_states: int
            ) -> tuple[float, tuple[Op, ...]] | None:
    """Label-setting search over memory states from the empty one to a final one.

    ``step(cost, peak, duration)`` is the cost after an op of that peak and duration from a
    state of that cost (``None``: the op is not allowed); it must never decrease the cost
    (Dijkstra's condition), as a sum of durations or a running maximum of peaks do.

    Returns
    -------
    (cost, plan) or None
        The least cost of a final state and the ops reaching it; ``None`` when none is
        reachable.

    Raises
    ------
    RuntimeError
        If more than ``max_states`` states are settled (the chain is too long).
    """
    start = initial_state()
    ops = _candidate_ops(chain.length)
    tie = itertools.count()
    frontier: list[tuple[float, int, State]] = [(start_cost, next(tie), start)]
    best: dict[State, float] = {start: start_cost}
    parent: dict[State, tuple[State, Op]] = {}
    settled: set[State] = set()
    while frontier:
        cost, _, state = heapq.heappop(frontier)
        if state in settled:
            continue
        settled.add(state)
        if len(settled) > max_states:
            raise RuntimeError(f"brute force gave up after {max_states} states")
        if is_final(state):
            return cost, _rebuild(parent, state)
        for op in ops:
            try:
                nxt, peak, duration = transition(chain, state, op)
            except PlanError:
                continue
            new_cost = step(cost, peak, duration)
            if new_cost is None or nxt in settled:
                continue
            if new_cost < best.get(nxt, float("inf")):
                best[nxt] = new_cost
                parent[nxt] = (state, op)
                heapq.heappush(frontier, (new_cost, next(tie), nxt))
    return None


def brute_force_checkpoint(
    chain: Chain, memory_limit: int, *, max_states: int = 2_000_000
) -> tuple[float, tuple[Op, ...]] | None:
    """Least makespan over all valid plans with peak <= ``memory_limit``.

    Returns
    -------
    (makespan, plan) or None
        ``None`` when no plan fits.

    Raises
    ------
    RuntimeError
        If more than ``max_states`` states are settled (the chain is too long).
    """
    if chain.input_size > memory_limit:
        return None
    return _search(chain, 0.0,
                   lambda cost, peak, duration: None if peak > memory_limit else cost + duration,
                   max_states)


def _rebuild(
    parent: dict[frozenset[Value], tuple[frozenset[Value], Op]], state: frozenset[Value]
) -> tuple[Op, ...]:
    ops: list[Op] = []
    while state in parent:
        state, op = parent[state]
        ops.append(op)
    return tuple(reversed(ops))


def brute_force_min_peak(chain: Chain, *, max_states: int = 2_000_000) -> int:
    """Least peak memory over all valid plans: the least limit at which a plan exists.

    The same search as :func:`brute_force_checkpoint` over the same ops, with the peak so
    far (the max of each op's peak, from the input alone) in place of the elapsed time: a
    bottleneck shortest path, exhaustive like it (storing every activation is always a plan,
    so there is one).

    Raises
    ------
    RuntimeError
        If more than ``max_states`` states are settled (the chain is too long).
    """
    found = _search(chain, chain.input_size, lambda cost, peak, _duration: max(cost, peak),
                    max_states)
    if found is None:  # pragma: no cover - store-all is a plan
        raise RuntimeError("no final state reachable")
    return int(found[0])
