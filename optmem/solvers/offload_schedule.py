"""Build the offload plan of an offload set: the "no-wait, ordered" schedule of OFF_int.

Digest ``shared/design/offload.md`` 3.3 (thesis chapter 3, Prop. 1 and Lemma 7): GREEDY,
DYNPROG and the vDNN baselines all choose *which* saved activations ``abar_k`` to offload and
then run the store-all sequence with offloads in increasing index order, as early as
possible, and prefetches in decreasing index order, as late as possible.

Value ``k`` is the input of layer ``k + 1``: ``a 0`` (the chain input) for ``k = 0``, the tape
``abar k`` for ``1 <= k < L``. Its forward reader is ``F_all k+1`` and its backward consumer
``B k+1`` (which needs it back); ``B k`` frees it.

The plan places each transfer where it is issued (CONTRACT "Offload plans"): an offload is issued
before the first compute op that would not start earlier than the link can take it; a
prefetch is issued before the last compute op after which issuing it would make a prefetch
late, estimated with the compute ops running back to back (as late as possible at op
granularity).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.models.interrupt import poll_now
from optmem.plan import AnyOp, Op, OpKind, TransferOp, offload, prefetch, store_all_plan
from optmem.simulate.checkpoint import value_size
from optmem.simulate.offload import OffloadSimulation, Replay

_EPS = 1e-9


def value_op(k: int) -> tuple[str, int]:
    """The value ``k`` of the offload set as an op argument: ``("a", 0)`` or ``("abar", k)``."""
    return ("a", 0) if k == 0 else ("abar", k)


def value_sizes(chain: Chain) -> list[int]:
    """Sizes of the offloadable values ``abar_0 .. abar_{L-1}`` (``abar_0 = a^0``)."""
    return [value_size(chain, value_op(k)) for k in range(chain.length)]


def consumer_index(length: int, k: int) -> int:
    """Index of ``B k+1`` in the store-all sequence."""
    return 2 * length - k


PREFETCH_POLICIES = ("alap", "eager", "lazy")
POLL_OPS = 32
""":func:`ordered_plan` checks its solve's deadline once per this many ops (each op is
about 1 ms at L = 339: 2L + 1 ops per plan, three policies per offload set)."""


def ordered_plan(
    chain: Chain, bandwidth: float, memory_limit: int | None, offloaded: Iterable[int],
    prefetch_policy: str = "alap",
) -> tuple[tuple[AnyOp, ...], OffloadSimulation]:
    """The ordered, no-wait plan that offloads the values ``offloaded`` (indices ``0..L-1``).

    ``prefetch_policy``: ``alap`` issues a prefetch at the last compute op after which it
    would be late (thesis reading); ``eager`` issues it as soon as the backward pass has
    started and the next compute op still fits beside it (better when memory is so tight
    that a deferred prefetch finds no room later); ``lazy`` issues it just before its
    consumer (never reserves memory early, may leave the compute stream waiting).

    Raises
    ------
    PlanError
        If the plan does not fit (some op waits for memory that is never freed).
    optmem.models.interrupt.Interrupted
        Inside :func:`~optmem.models.interrupt.stop_when` once its predicate holds
        (checked every :data:`POLL_OPS` ops: DYNPROG's and GREEDY's plans took 2.8 s at
        L = 339 under load and ran past the offload exact methods' time limit, stop 77).
    """
    length = chain.length
    seq = store_all_plan(length)
    sizes = value_sizes(chain)
    todo = sorted({k for k in offloaded if 0 <= k < length and sizes[k] > 0})
    replay = Replay(chain, bandwidth, memory_limit)
    back: list[int] = []  # offloaded values, prefetched in decreasing order
    for pos, op in enumerate(seq):
        if pos % POLL_OPS == 0:  # a solve's deadline (optmem.models.interrupt)
            poll_now()
        _issue_offloads(replay, seq, pos, op, todo, back, length)
        _issue_prefetches(replay, seq, pos, op, todo, back, length, prefetch_policy)
        replay.add(op)
    return tuple(replay.ops), replay.finish()


def _duration(replay: Replay, k: int) -> float:
    size = value_size(replay.chain, value_op(k))
    return 0.0 if size == 0 else size / replay.bandwidth


def _issue_offloads(replay: Replay, seq: tuple[Op, ...], pos: int, op: Op, todo: list[int],
                    back: list[int], length: int) -> None:
    st = replay.state
    while todo:
        k = todo[0]
        if pos < k:  # abar_k is produced by F_all k (index k - 1)
            return
        if pos > length:  # the backward pass has started: too late to be worth it
            todo.clear()
            return
        ready = max(st.anchor, st.link_free, st.available.get(value_op(k), 0.0))
        if pos < length and ready > replay.probe(op) + _EPS:
            return
        replay.add(offload(*value_op(k)), readers_after=1 if pos <= k else 0)
        todo.pop(0)
        back.insert(0, k)


def _issue_prefetches(replay: Replay, seq: tuple[Op, ...], pos: int, op: Op, todo: list[int],
                      back: list[int], length: int, policy: str = "alap") -> None:
    st = replay.state
    while back:
        needed_now = any(pos == consumer_index(length, k) for k in back)
        if not math.isfinite(st.moved[value_op(back[0])].release):
            return  # its forward reader has not run yet
        if not needed_now and (todo or pos < length or policy == "lazy" or not (
                policy == "eager" or _late_if_deferred(replay, seq, pos, op, back, length))):
            return
        todo.clear()  # prefetches come after every offload on the link
        k = back[0]
        if not needed_now:
            _, memory = replay.probe_memory(op)
            if memory + value_size(replay.chain, value_op(k)) > replay.limit:
                return  # issuing it now would not leave room for the next op
        try:
            replay.add(prefetch(*value_op(k)))
        except PlanError:
            if needed_now:
                raise
            return  # no room during this op: issue it after the op
        back.pop(0)


def _late_if_deferred(replay: Replay, seq: tuple[Op, ...], pos: int, op: Op, back: list[int],
                      length: int) -> bool:
    """Whether issuing the pending prefetches only after ``op`` makes one of them late."""
    st = replay.state
    start = replay.probe(op)
    if not math.isfinite(start):
        return False
    times = [start]
    for later in seq[pos:]:
        times.append(times[-1] + _op_time(replay.chain, later))
    link = max(st.link_free, start)
    for k in back:
        moved = st.moved[value_op(k)]
        begin = max(link, moved.release if math.isfinite(moved.release) else link)
        link = begin + _duration(replay, k)
        due = times[consumer_index(length, k) - pos]
        if link > due + _EPS:
            return True
    return False


def _op_time(chain: Chain, op: Op) -> float:
    if op.kind is OpKind.LOSS:
        return chain.loss_bwd_time
    if op.kind is OpKind.B:
        return chain.bwd_time[op.stage - 1]
    return chain.fwd_time[op.stage - 1]


def offloaded_set(plan: Iterable[AnyOp]) -> list[int]:
    """The offload set of an ordered plan (value indices)."""
    out = []
    for op in plan:
        if isinstance(op, TransferOp) and op.kind.value == "offload":
            out.append(op.stage)
    return sorted(out)
