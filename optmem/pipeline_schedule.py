"""A pipeline plan unrolled into per-rank action lists, and PyTorch's schedule CSV.

A plan (CONTRACT section 11) is a 1-periodic pattern: in repetition ``j`` the task of
stage ``s`` starts at ``j T + start`` on micro-batch ``j + shift``. One training step with a
flush runs micro-batches ``0..N-1``; every GPU executes its forwards and backwards of those
micro-batches in the order of their start times in the unrolled pattern (ties: micro-batch,
then dependency order). Because the pattern respects every dependency (the simulator checks
it), this order does too, so it can be handed to any runtime that executes a per-rank action
list: optmem's own point-to-point runner, or PyTorch's ``_PipelineScheduleRuntime``.

**The CSV** is the compute-only schedule format of ``torch.distributed.pipelining``
(``PipelineScheduleMulti._load_csv`` / ``_PipelineScheduleRuntime._load_csv``, the path
torchtitan's ``pipeline_parallel_schedule_csv`` uses): one row per pipeline rank, one cell per
action ``{stage}{F|B}{microbatch}`` with 0-based stage and micro-batch indices (``0F0``,
``2B3``); PyTorch inserts the sends and receives itself. Row ``r`` is the ``r``-th GPU the
plan uses in increasing order (the GPU ids themselves when every GPU holds a stage); plan
stage ``s`` (1-based) is PyTorch stage ``s - 1``. This module does not import torch.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan

__all__ = ["SEND_BUFFERS", "Message", "RankOp", "RankStep", "check_microbatches",
           "default_microbatches", "held_sends", "pipeline_ranks", "rank_messages",
           "rank_programs", "schedule_csv", "schedule_rows", "write_schedule_csv"]

Message = tuple[str, int, int]
"""A value crossing a cut: ``("a", s, m)`` is the output of 1-based stage ``s`` on micro-batch
``m`` (for stage ``s + 1``), ``("g", s, m)`` the gradient of that output (for stage ``s``)."""
Link = tuple[int, Message]  # (peer GPU, message)


@dataclass(frozen=True)
class RankOp:
    """One operation of a GPU: ``kind`` ("F"/"B") of 1-based ``stage`` on ``microbatch``."""

    time: float
    order: int
    kind: str
    stage: int
    microbatch: int

    def action(self) -> str:
        """The action string of ``torch.distributed.pipelining`` (``0F3``: 0-based stage)."""
        return f"{self.stage - 1}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class RankStep:
    """One operation of a GPU with its messages to and from other GPUs.

    Attributes
    ----------
    op
        The operation (:func:`rank_programs`).
    receive
        ``(peer, message)`` pairs received before it runs, in each peer's send order: the
        last is the one it needs, the others came earlier on the same link and are kept
        until their operation (a runner receives each link in order, no tags).
    send
        ``(peer, message)`` sent after it runs (``None``: its output stays on this GPU or
        it has none).
    release
        Messages this GPU sent earlier that are known received once ``receive`` is done:
        waiting on them there does not wait for any peer, and their buffers can go.
    wait
        Messages this GPU sent earlier, not known received, that it waits on before the
        operation (after ``release``) so that it holds at most :data:`SEND_BUFFERS` of a
        cut's messages besides its stash (:func:`_bounded_waits`): the wait may block
        until the receiver takes the message, which the replay of the step shows it does
        without waiting for this GPU.
    """

    op: RankOp
    receive: tuple[Link, ...] = ()
    send: Link | None = None
    release: tuple[Message, ...] = ()
    wait: tuple[Message, ...] = ()


def check_microbatches(microbatches: int) -> None:
    """Raise an :class:`~optmem.errors.OptmemInputError` unless ``microbatches`` is an int >= 1."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise OptmemInputError(f"expected a positive number of micro-batches, got "
                               f"{microbatches!r}", field="microbatches")


def rank_programs(plan: PipelinePlan, microbatches: int) -> dict[int, list[RankOp]]:
    """The operations of every GPU for micro-batches ``0..N-1``, sorted by start time.

    Keys are the plan's GPU ids. Ties (zero-length operations) are broken by micro-batch, then
    by dependency order (forwards by increasing stage, backwards by decreasing stage).

    Examples
    --------
    >>> plan = PipelinePlan.from_strings(["period 2", "stage 1 layers 1-1 gpu 0",
    ...     "stage 2 layers 2-2 gpu 1", "F 1 start 0 shift 1", "F 2 start 1 shift 1",
    ...     "B 2 start 0 shift 0", "B 1 start 1 shift 0"])
    >>> [op.action() for op in rank_programs(plan, 2)[0]]
    ['0F0', '0F1', '0B0', '0B1']
    """
    check_microbatches(microbatches)
    programs: dict[int, list[RankOp]] = defaultdict(list)
    n_stages = len(plan.stages)
    for t in plan.tasks:
        if t.op not in ("F", "B"):
            continue
        gpu = plan.stages[t.stage - 1].gpu
        order = t.stage if t.op == "F" else 2 * n_stages + 1 - t.stage
        for m in range(microbatches):
            start = (m - t.shift) * plan.period + t.start
            programs[gpu].append(RankOp(start, order, t.op, t.stage, m))
    for ops in programs.values():
        ops.sort(key=lambda o: (o.time, o.microbatch, o.order))
    _check_local_order(plan, programs)
    return dict(programs)


def _check_local_order(plan: PipelinePlan, programs: dict[int, list[RankOp]]) -> None:
    """A :class:`PlanError` unless every GPU runs an operation after its own it needs.

    A backward needs its stage's forward, a forward the previous stage's forward and a
    backward the next stage's backward when that stage is on the same GPU (messages
    between GPUs are checked by the replay, :func:`_replay`). A plan that broke one
    (shifts that put a backward before its forward) passed the replay, and ``run_plan``
    failed with a ``KeyError`` on one rank while its peers waited for it (review of stop
    56); the simulator refuses such a plan, a solver makes none.
    """
    gpu_of = [0, *(st.gpu for st in plan.stages)]  # 1-based stages
    for g, ops in programs.items():
        index = {(op.kind, op.stage, op.microbatch): k for k, op in enumerate(ops)}
        for k, op in enumerate(ops):
            s, m = op.stage, op.microbatch
            beside = s - 1 if op.kind == "F" else s + 1
            needs = [("F", s, m)] if op.kind == "B" else []
            if 1 <= beside < len(gpu_of) and gpu_of[beside] == g:
                needs.append((op.kind, beside, m))
            late = [ops[index[need]].action() for need in needs if index[need] > k]
            if late:
                raise PlanError(
                    f"the plan's operation order runs {op.action()} before {late[0]} on GPU "
                    f"{g}, which it needs (a backward before its forward, or a stage before "
                    "the one it follows on its GPU)")


def _links(plan: PipelinePlan, op: RankOp) -> tuple[Link | None, Link | None]:
    """The message ``op`` needs from another GPU and the one it sends to another, if any."""
    gpu_of = [0, *(st.gpu for st in plan.stages)]  # 1-based stages
    n, s, m, here = len(plan.stages), op.stage, op.microbatch, gpu_of[op.stage]
    if op.kind == "F":
        need = ("a", s - 1, m) if s > 1 else None
        out = ("a", s, m) if s < n else None
        source, target = s - 1, s + 1
    else:
        need = ("g", s, m) if s < n else None
        out = ("g", s - 1, m) if s > 1 else None
        source, target = s + 1, s - 1
    return ((gpu_of[source], need) if need and gpu_of[source] != here else None,
            (gpu_of[target], out) if out and gpu_of[target] != here else None)


def _receive_lists(programs: dict[int, list[RankOp]],
                   links: dict[int, list[tuple[Link | None, Link | None]]]
                   ) -> dict[int, list[tuple[Link, ...]]]:
    """What each operation receives: every message of the needed one's link up to it."""
    queues: dict[tuple[int, int], deque[Message]] = defaultdict(deque)
    for gpu, ops in links.items():  # each link carries its sender's order
        for _, send in ops:
            if send is not None:
                queues[(gpu, send[0])].append(send[1])
    lists: dict[int, list[tuple[Link, ...]]] = {}
    for gpu in programs:
        lists[gpu] = []
        taken: set[Message] = set()
        for need, _ in links[gpu]:
            got: list[Link] = []
            if need is not None and need[1] not in taken:
                queue = queues[(need[0], gpu)]
                while need[1] not in taken:
                    got.append((need[0], queue.popleft()))
                    taken.add(got[-1][1])
            lists[gpu].append(tuple(got))
    return lists


SEND_BUFFERS = 2
"""Messages of one cut a GPU may hold as buffers of their own when an operation starts: the
pipeline models count two buffers of the cut's size on each of its GPUs
(:meth:`~optmem.problems.pipeline.PipelineProblem.buffer_size`), and a runner that receives
a message when its operation runs has the receive side counted by that operation (its
input or output gradient) and the stash."""

Waits = dict[int, dict[int, tuple[Message, ...]]]  # GPU -> operation index -> messages


def _replay(programs: dict[int, list[RankOp]],
            receives: dict[int, list[tuple[Link, ...]]],
            links: dict[int, list[tuple[Link | None, Link | None]]],
            waits: Waits) -> tuple[dict[int, list[tuple[Message, ...]]], dict[int, int]]:
    """The sends known complete at each operation (vector clocks over the static order).

    ``clock[g][h] = k + 1``: GPU ``g`` has received news of GPU ``h``'s operation ``k``
    (its receives included). A send to ``h`` received at ``h``'s operation ``k`` is known
    complete on its sender once the sender's ``clock[h] > k``. The GPUs are replayed as a
    runner executes them: an operation takes its receives one by one (each blocks until its
    message is sent), then waits on its sends in ``waits`` (each blocks until the receiver
    has taken it), then runs and sends. A wait adds no news to the clock (the sender learns
    only that its message left).

    Returns
    -------
    tuple
        The releases of each GPU's operations done, and the GPUs that could not finish,
        each with the index of the operation it is blocked at (empty: no deadlock).
    """
    clock = {g: dict.fromkeys(programs, 0) for g in programs}
    stamp: dict[Message, dict[int, int]] = {}  # the sender's clock when it sent
    received: dict[Message, int] = {}  # 1 + the receiver's operation index
    outstanding: dict[int, list[Link]] = {g: [] for g in programs}
    done: dict[int, list[tuple[Message, ...]]] = {g: [] for g in programs}
    taken = dict.fromkeys(programs, 0)  # receives of the current operation taken
    progress = True
    while progress:
        progress = False
        for g, ops in programs.items():
            while (k := len(done[g])) < len(ops):
                mine, got = clock[g], receives[g][k]
                while taken[g] < len(got) and got[taken[g]][1] in stamp:
                    msg = got[taken[g]][1]
                    received[msg] = k + 1
                    for h, t in stamp[msg].items():
                        mine[h] = max(mine[h], t)
                    taken[g] += 1
                    progress = True
                if taken[g] < len(got) or not received.keys() >= set(waits[g].get(k, ())):
                    break
                taken[g] = 0
                mine[g] = k + 1
                free = [(h, msg) for h, msg in outstanding[g]
                        if received.get(msg, math.inf) <= mine[h]]
                done[g].append(tuple(msg for _, msg in free))
                outstanding[g] = [link for link in outstanding[g] if link not in free]
                send = links[g][k][1]
                if send is not None:
                    stamp[send[1]] = dict(mine)
                    outstanding[g].append(send)
                progress = True
    return done, {g: len(done[g]) for g, ops in programs.items() if len(done[g]) < len(ops)}


def _bounded_waits(programs: dict[int, list[RankOp]],
                   links: dict[int, list[tuple[Link | None, Link | None]]],
                   releases: dict[int, list[tuple[Message, ...]]]) -> Waits:
    """Where each GPU must wait on a send to hold at most :data:`SEND_BUFFERS` per cut.

    A sent gradient is a buffer of its own from the operation after the backward that made
    it; a sent activation shares its storage with the stage's stash until the stage's
    backward has run. When the third message of a cut becomes a buffer of its own, the
    first must be gone: a send whose release (:func:`_replay`) comes later, or never, is
    waited on at that operation, the latest point where the plan's count holds. Nothing
    is added where the releases keep within the bound.
    """
    waits: Waits = {}
    for g, ops in programs.items():
        index = {(op.kind, op.stage, op.microbatch): k for k, op in enumerate(ops)}
        freed = {msg: k for k, msgs in enumerate(releases[g]) for msg in msgs}
        alone: dict[tuple[str, int], list[tuple[int, Message]]] = defaultdict(list)
        for k, (_, send) in enumerate(links[g]):
            if send is not None:
                kind, s, m = send[1]
                own = k + 1 if kind == "g" else index[("B", s, m)] + 1
                alone[(kind, s)].append((own, send[1]))
        due: dict[int, list[Message]] = defaultdict(list)
        for sends in alone.values():
            sends.sort()
            for (_, msg), (at, _) in zip(sends, sends[SEND_BUFFERS:], strict=False):
                if at < len(ops) and freed.get(msg, math.inf) > at:
                    due[at].append(msg)
        waits[g] = {k: tuple(msgs) for k, msgs in due.items()}
    return waits


def _releases(programs: dict[int, list[RankOp]],
              receives: dict[int, list[tuple[Link, ...]]],
              links: dict[int, list[tuple[Link | None, Link | None]]]
              ) -> tuple[dict[int, list[tuple[Message, ...]]], Waits]:
    """The releases of every operation (:func:`_replay`) and the bounded waits.

    A plan whose order deadlocks without waits is a :class:`PlanError`. The waits of
    :func:`_bounded_waits` are replayed: a wait the replay finds blocked for good (its
    receiver needs a message this GPU sends later) is dropped, and the replay runs again,
    so the waits kept cannot deadlock.
    """
    no_waits: Waits = {g: {} for g in programs}
    releases, stuck = _replay(programs, receives, links, no_waits)
    if stuck:
        where = ", ".join(f"GPU {g} at {programs[g][k].action()}" for g, k in stuck.items())
        raise PlanError(f"the plan's operation order deadlocks: {where} waits for a message "
                        "sent after it (an order that breaks a dependency)")
    waits = _bounded_waits(programs, links, releases)
    while (stuck := _replay(programs, receives, links, waits)[1]):
        # a GPU blocked at a receive waits for one blocked at a wait: drop those waits
        dropped = [waits[g].pop(k) for g, k in stuck.items() if k in waits[g]]
        assert dropped, "without waits the replay finished"
    return releases, waits


def rank_messages(plan: PipelinePlan, microbatches: int) -> dict[int, list[RankStep]]:
    """Every GPU's operations (:func:`rank_programs`) with their messages.

    Examples
    --------
    >>> plan = PipelinePlan.from_strings(["period 2", "stage 1 layers 1-1 gpu 0",
    ...     "stage 2 layers 2-2 gpu 1", "F 1 start 0 shift 1", "F 2 start 1 shift 1",
    ...     "B 2 start 0 shift 0", "B 1 start 1 shift 0"])
    >>> [(st.op.action(), st.release) for st in rank_messages(plan, 2)[0]]
    [('0F0', ()), ('0F1', ()), ('0B0', (('a', 1, 0),)), ('0B1', (('a', 1, 1),))]
    """
    programs = rank_programs(plan, microbatches)
    links = {g: [_links(plan, op) for op in ops] for g, ops in programs.items()}
    receives = _receive_lists(programs, links)
    releases, waits = _releases(programs, receives, links)
    return {g: [RankStep(op, receives[g][k], links[g][k][1], releases[g][k],
                         waits[g].get(k, ())) for k, op in enumerate(ops)]
            for g, ops in programs.items()}


def held_sends(steps: list[RankStep]) -> int:
    """The most messages a GPU has sent and not released at once (after an operation's send).

    Released and waited messages go before the operation runs (a message at the first of
    its ``wait`` and ``release``); the others are held until the step ends.
    """
    held: set[Message] = set()
    peak = 0
    for step in steps:
        held -= {*step.release, *step.wait}
        if step.send is not None:
            held.add(step.send[1])
        peak = max(peak, len(held))
    return peak


def pipeline_ranks(plan: PipelinePlan) -> list[int]:
    """The GPUs holding at least one stage, in increasing order (the CSV's rows)."""
    return sorted({st.gpu for st in plan.stages})


def default_microbatches(plan: PipelinePlan) -> int:
    """Twice the number of stages: enough micro-batches to reach the steady state."""
    return 2 * len(plan.stages)


def schedule_rows(plan: PipelinePlan, microbatches: int) -> list[list[str]]:
    """The CSV's rows: the actions of every used GPU (see :func:`pipeline_ranks`)."""
    programs = rank_programs(plan, microbatches)
    return [[op.action() for op in programs[g]] for g in pipeline_ranks(plan)]


def schedule_csv(plan: PipelinePlan, microbatches: int) -> str:
    """The schedule as CSV text (``torch.distributed.pipelining`` compute-only format)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(schedule_rows(plan, microbatches))
    return buf.getvalue()


def write_schedule_csv(plan: PipelinePlan, microbatches: int, path: str | Path) -> None:
    """Write :func:`schedule_csv` to ``path`` (atomically: nothing is left on error)."""
    text = schedule_csv(plan, microbatches)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
