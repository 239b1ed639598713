"""Place the transfers of a combined plan: compute sequence + offload windows -> full plan.

Every remat + offload method of :mod:`optmem.solvers.remat_offload` (the chapter 4 DP, the
opportunist and autocapper heuristics, the DELTA-style policy) decides *which compute ops
run* and *which stored values leave the GPU between two of their uses* (a window). This
module turns that into a plan of CONTRACT "Offload plans" by replaying it incrementally with
:class:`optmem.simulate.offload.Replay` (digest ``shared/design/offload.md`` 3.3 and 5.7):

* offloads are issued in window order, as early as possible (right after the value is
  produced) but never so early that the link would hold up the next compute op; an offload
  is forced when the next compute op does not fit without it; a window whose offload could
  not be issued before its consumer is dropped (the value just stays on the GPU);
* prefetches are issued in consumer order with one of the policies of
  :data:`PREFETCH_POLICIES`: ``alap`` (the thesis reading: at the last op after which it
  would be late, estimated with back-to-back compute), ``eager`` (as soon as every op until
  its consumer fits beside it) or ``lazy`` (just before the consumer); early prefetches are
  only issued when every compute op up to the consumer still fits beside the reservation.

The simulator has the final word: the result is an :class:`OffloadSimulation` of the plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.models.interrupt import poll
from optmem.plan import Op, OpKind, TransferOp, offload, prefetch
from optmem.simulate.checkpoint import Value, initial_state, transition, value_size
from optmem.simulate.offload import OffloadSimulation, Replay, reads

PREFETCH_POLICIES = ("alap", "eager", "lazy")
_EPS = 1e-9


@dataclass(frozen=True)
class Window:
    """Value ``value`` may live on the host between compute ops ``last`` and ``consumer``.

    ``first`` is the earliest plan position where its offload may be listed (just after
    the op producing it), ``last`` the last op before ``consumer`` that reads or produces
    it; no op strictly between ``last`` and ``consumer`` reads it.
    """

    value: Value
    first: int
    last: int
    consumer: int


@dataclass(frozen=True)
class Static:
    """Checkpoint-level facts of a compute sequence: op peaks and stored sets."""

    peaks: tuple[int, ...]
    before: tuple[frozenset[Value], ...]
    durations: tuple[float, ...]


def static_replay(chain: Chain, ops: Sequence[Op]) -> Static:
    """Replay the compute ops with checkpoint semantics (raises :class:`PlanError`).

    Polls a solve's deadline once per op (:func:`~optmem.models.interrupt.poll`), as
    :func:`backward_windows` once per value and :func:`place_transfers` once per op: the
    placement after the remat + offload DP ran unpolled until stop 80 (0.9 s at L = 339
    with 158 windows).
    """
    stored = initial_state()
    peaks, before, durations = [], [], []
    for k, op in enumerate(ops):
        poll()
        try:
            new, peak, duration = transition(chain, stored, op)
        except PlanError as exc:
            raise PlanError(exc.reason, index=k) from None
        peaks.append(peak)
        before.append(stored)
        durations.append(duration)
        stored = new
    return Static(tuple(peaks), tuple(before), tuple(durations))


def window_before(chain: Chain, ops: Sequence[Op], static: Static, value: Value,
                  consumer: int) -> Window | None:
    """The window of ``value`` ending at compute op ``consumer`` (``None`` if there is none).

    The value must be stored before ``consumer``, which must read it; the window starts at
    the previous op that reads or produces it.
    """
    length = chain.length
    if not 0 < consumer < len(ops) or value not in static.before[consumer]:
        return None
    if not reads(ops[consumer], value, length) or value_size(chain, value) == 0:
        return None
    k = consumer - 1
    while k >= 0:
        if value not in static.before[k]:  # produced by op k
            return Window(value, k + 1, k, consumer) if k + 1 < consumer else None
        if reads(ops[k], value, length):
            break
        k -= 1
    if k < 0:  # stored since the start (the input a^0)
        return None
    first = k
    while first > 0 and value in static.before[first]:
        first -= 1
    if value not in static.before[first]:
        first += 1
    return Window(value, first, k, consumer)


def backward_windows(chain: Chain, ops: Sequence[Op], static: Static,
                     values: Iterable[Value]) -> list[Window]:
    """Windows from the forward reader to the first reader after ``Loss`` (pofo: OR.2/OR.3)."""
    loss = next(k for k, op in enumerate(ops) if op.kind is OpKind.LOSS)
    out = []
    for value in values:
        poll()  # a scan of the ops per value (static_replay)
        consumer = next((k for k in range(loss + 1, len(ops))
                         if reads(ops[k], value, chain.length)
                         and value in static.before[k]), None)
        if consumer is None:
            continue
        w = _forward_window(chain, ops, static, value, consumer)
        if w is not None:
            out.append(w)
    return out


def _forward_window(chain: Chain, ops: Sequence[Op], static: Static, value: Value,
                    consumer: int) -> Window | None:
    if value == ("a", 0):  # the input: stored from the start
        last = max((k for k in range(consumer) if reads(ops[k], value, chain.length)),
                   default=-1)
        return Window(value, 0, max(last, 0), consumer) if last >= 0 else None
    return window_before(chain, ops, static, value, consumer)


def place_transfers(
    chain: Chain, bandwidth: float, memory_limit: int, ops: Sequence[Op],
    windows: Sequence[Window], policy: str = "alap", static: Static | None = None,
) -> tuple[tuple[Op | TransferOp, ...], OffloadSimulation]:
    """Interleave the transfers of ``windows`` with ``ops`` and replay the plan.

    Raises
    ------
    PlanError
        If the plan does not fit (some op waits for memory that is never freed).
    optmem.models.interrupt.Interrupted
        Inside :func:`~optmem.models.interrupt.stop_when` once its predicate holds (one
        :func:`~optmem.models.interrupt.poll` per op, since stop 80).
    """
    if policy not in PREFETCH_POLICIES:
        raise ValueError(f"unknown prefetch policy {policy!r}")
    static = static or static_replay(chain, ops)
    length = chain.length
    replay = Replay(chain, bandwidth, memory_limit)
    usable = [w for w in windows if bandwidth > 0 and value_size(chain, w.value) > 0]
    pend_off = sorted(usable, key=lambda w: (w.first, w.consumer))
    pend_pre: list[Window] = []  # offloaded, waiting for their prefetch (by consumer)
    loss = next((k for k, op in enumerate(ops) if op.kind is OpKind.LOSS), len(ops))
    for j, op in enumerate(ops):
        poll()  # a solve's deadline (static_replay)
        # offloads: FIFO, as early as they do not hold up compute (forced if op j needs them)
        while pend_off and pend_off[0].first <= j:
            w = pend_off[0]
            if j >= w.consumer or any(p.value == w.value for p in pend_pre):
                if j >= w.consumer:
                    pend_off.pop(0)
                    continue
                break
            start = replay.probe(op)
            st = replay.state
            ready = max(st.anchor, st.link_free, st.available.get(w.value, 0.0))
            if math.isfinite(start) and ready > start + _EPS:
                break  # the link is busy and op j fits without it: do not hold op j up
            readers = sum(1 for k in range(j, w.consumer) if reads(ops[k], w.value, length))
            replay.add(offload(*w.value), readers_after=readers)
            pend_off.pop(0)
            pend_pre.append(w)
            pend_pre.sort(key=lambda x: x.consumer)
        # prefetches: consumer order
        while pend_pre:
            w = pend_pre[0]
            if j <= w.last:
                break
            needed = j == w.consumer
            if not needed:
                if policy == "lazy":
                    break
                if policy == "alap" and not _late_if_deferred(replay, ops, static, j,
                                                              pend_pre, bandwidth):
                    break
                if policy == "eager" and j <= min(loss, w.consumer - 1) and w.consumer > loss:
                    break
                if not _fits_window(chain, static, memory_limit, w, j, pend_pre):
                    break
            try:
                replay.add(prefetch(*w.value))
            except PlanError:
                if needed:
                    raise
                break
            pend_pre.pop(0)
        replay.add(op)
    return tuple(replay.ops), replay.finish()


def _fits_window(chain: Chain, static: Static, limit: float, w: Window, j: int,
                 pending: Sequence[Window]) -> bool:
    """Whether every op from ``j`` to ``w``'s consumer fits with ``w`` back on the GPU."""
    for i in range(j, w.consumer):
        host = sum(value_size(chain, u.value) for u in pending
                   if u is not w and u.last < i < u.consumer)
        if static.peaks[i] - host > limit:
            return False
    return True


def _late_if_deferred(replay: Replay, ops: Sequence[Op], static: Static, j: int,
                      pending: Sequence[Window], bandwidth: float) -> bool:
    """Whether issuing the pending prefetches only after op ``j`` makes one of them late."""
    st = replay.state
    start = replay.probe(ops[j])
    if not math.isfinite(start):
        return False
    times = [start]
    for d in static.durations[j:]:
        times.append(times[-1] + d)
    link = max(st.link_free, start)
    for w in pending:
        moved = st.moved.get(w.value)
        release = moved.release if moved is not None else link
        begin = max(link, release if math.isfinite(release) else link)
        link = begin + value_size(replay.chain, w.value) / bandwidth
        if link > times[w.consumer - j] + _EPS:
            return True
    return False


def best_placement(
    chain: Chain, bandwidth: float, memory_limit: int, ops: Sequence[Op],
    windows: Sequence[Window], policies: Sequence[str] = PREFETCH_POLICIES,
) -> tuple[tuple[Op | TransferOp, ...], OffloadSimulation, str] | None:
    """The fastest placement over ``policies`` (``None`` if none fits)."""
    static = static_replay(chain, ops)
    best = None
    for policy in policies:
        try:
            plan, sim = place_transfers(chain, bandwidth, memory_limit, ops, windows, policy,
                                        static)
        except PlanError:
            continue
        if best is None or sim.makespan < best[1].makespan - 1e-12:
            best = (plan, sim, policy)
    return best
