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

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op
from optmem.simulate.checkpoint import Value, initial_state, is_final, transition


def _candidate_ops(length: int) -> list[Op]:
    ops: list[Op] = [LOSS]
    for i in range(1, length + 1):
        ops.extend([F_all(i), F_ck(i), F_none(i), B(i)])
    return ops


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
    start = initial_state()
    if chain.input_size > memory_limit:
        return None
    ops = _candidate_ops(chain.length)
    tie = itertools.count()
    frontier: list[tuple[float, int, frozenset[Value]]] = [(0.0, next(tie), start)]
    best: dict[frozenset[Value], float] = {start: 0.0}
    parent: dict[frozenset[Value], tuple[frozenset[Value], Op]] = {}
    settled: set[frozenset[Value]] = set()
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
            if peak > memory_limit or nxt in settled:
                continue
            new_cost = cost + duration
            if new_cost < best.get(nxt, float("inf")):
                best[nxt] = new_cost
                parent[nxt] = (state, op)
                heapq.heappush(frontier, (new_cost, next(tie), nxt))
    return None


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
    start = initial_state()
    ops = _candidate_ops(chain.length)
    tie = itertools.count()
    frontier: list[tuple[int, int, frozenset[Value]]] = [(chain.input_size, next(tie), start)]
    best: dict[frozenset[Value], int] = {start: chain.input_size}
    settled: set[frozenset[Value]] = set()
    while frontier:
        peak_so_far, _, state = heapq.heappop(frontier)
        if state in settled:
            continue
        settled.add(state)
        if len(settled) > max_states:
            raise RuntimeError(f"brute force gave up after {max_states} states")
        if is_final(state):
            return peak_so_far
        for op in ops:
            try:
                nxt, peak, _duration = transition(chain, state, op)
            except PlanError:
                continue
            new_peak = max(peak_so_far, peak)
            if nxt not in settled and new_peak < best.get(nxt, new_peak + 1):
                best[nxt] = new_peak
                heapq.heappush(frontier, (new_peak, next(tie), nxt))
    raise RuntimeError("no final state reachable")  # pragma: no cover - store-all is a plan
