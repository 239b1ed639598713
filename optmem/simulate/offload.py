"""Offload (and remat + offload) plans: replay a plan on one compute stream and one link.

Model: thesis chapter 3 assumptions O.1-O.7 (digest ``shared/design/offload.md`` 0.2):

* **Two resources.** Checkpoint ops (``F_all``, ``F_ck``, ``F_none``, ``Loss``, ``B``) run in
  plan order on the compute stream; transfer ops (``offload X``, ``prefetch X``) run in plan
  order on the link, one at a time (O.1), concurrently with compute (O.3, O.4). A transfer of
  ``x`` memory units takes ``x / bandwidth`` (O.2). Gradients are never transferred (O.5).
* **Logical state = checkpoint semantics.** Which values exist, what each compute op reads,
  produces and frees, its duration and its memory (``stored + outputs + overhead``) are those
  of :func:`optmem.simulate.checkpoint.transition`, reused as is: an offloaded value still
  exists (on the host), so the no-duplicate and pinning rules apply to it unchanged.
* **Plan order is issue order.** A transfer cannot start before the compute op listed just
  before it has started; a compute op cannot start before every transfer listed before it has
  started. Within that, every op starts as early as its inputs, the link and memory allow.
  A plan therefore says *when* each transfer is issued (e.g. a prefetch placed just before the
  compute op during which it should run): the builders of
  :mod:`optmem.solvers.offload_schedule` place offloads as early and prefetches as late as
  possible (thesis Prop. 1 reading, digest erratum 10), and any schedule found by an exact
  model is reproduced by listing each transfer after the last compute op that started no later
  than it.
* **Memory (O.7).** An offloaded value keeps its full size on the GPU until its offload has
  completed *and* every compute op listed between the offload and the value's next prefetch
  that reads it has finished (the release time). A prefetch reserves the full size when it
  starts and the value is usable once it ends. A compute op waits until its inputs are on the
  GPU (prefetch ended) and until it fits: its memory is the checkpoint op peak minus the
  values that are on the host during the *whole* op (released no later than its start and not
  being prefetched by a transfer listed before it); a release during the op does not help it,
  and a prefetch that starts during a compute op counts for that op. A prefetch that starts
  between compute ops must fit in the memory at that instant: the stored values not on the
  host, the prefetched value, and what the last compute op left held (the chain's
  ``fwd_held`` / ``bwd_held`` / ``loss_held``, 0 by default). Gradients and overheads as in
  the checkpoint simulator.
* **Errors.** Reading or freeing a value that is on the host (or still being offloaded),
  transferring a value that does not exist, prefetching a value that is not on the host,
  waiting for memory that is never freed: :class:`~optmem.errors.PlanError` with the 0-based
  index of the op and the reason.

The makespan is the end of the last op; ``idle_time`` is the time the compute stream waits
(for memory or a prefetch). Both timelines are returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.plan import AnyOp, Op, OpKind, TransferKind, TransferOp, parse_mixed_plan
from optmem.simulate.checkpoint import (
    ABAR,
    Value,
    held_after,
    initial_state,
    is_final,
    transition,
    value_size,
)

_EPS = 1e-9


@dataclass(frozen=True)
class ComputeStep:
    """One compute op as replayed: when it ran, its GPU memory, how long it waited."""

    index: int
    op: str
    start: float
    end: float
    memory: int
    idle: float


@dataclass(frozen=True)
class TransferStep:
    """One transfer on the link: when it ran and how many memory units it moved."""

    index: int
    op: str
    start: float
    end: float
    size: int


@dataclass(frozen=True)
class OffloadSimulation:
    """Makespan, peak GPU memory and both timelines of a replayed plan."""

    makespan: float
    peak_memory: int
    compute: tuple[ComputeStep, ...]
    link: tuple[TransferStep, ...]
    idle_time: float
    offloaded_size: int

    @property
    def transfer_time(self) -> float:
        """Total busy time of the link."""
        return sum(s.end - s.start for s in self.link)


def reads(op: Op, value: Value, length: int) -> bool:
    """Whether compute ``op`` reads ``value`` (``a^i`` or ``abar^i``) as an input."""
    kind, i = value
    if op.kind is OpKind.LOSS:
        return i == length
    if op.kind is OpKind.B:
        return (kind == ABAR and i == op.stage) or i == op.stage - 1
    return i == op.stage - 1


@dataclass
class _Moved:
    """Where an offloaded value is: its offload, release and prefetch."""

    offload_index: int
    offload_end: float
    pending_readers: int
    release: float = math.inf  # inf while a listed reader has not run
    reader_end: float = 0.0
    prefetch_index: int | None = None
    prefetch_start: float = math.inf
    prefetch_end: float = math.inf


@dataclass
class _State:
    stored: frozenset[Value] = field(default_factory=initial_state)
    moved: dict[Value, _Moved] = field(default_factory=dict)
    available: dict[Value, float] = field(default_factory=dict)
    compute: list[ComputeStep] = field(default_factory=list)
    link: list[TransferStep] = field(default_factory=list)
    compute_end: float = 0.0
    anchor: float = 0.0  # start of the last compute op (issue point of transfers)
    issued: float = 0.0  # latest start of an issued transfer
    link_free: float = 0.0
    peak: int = 0
    offloaded: int = 0

    def host_only(self, value: Value, at: float) -> bool:
        """Whether ``value`` is off the GPU at ``at`` and not being prefetched."""
        moved = self.moved.get(value)
        return moved is not None and moved.prefetch_index is None and moved.release <= at + _EPS


def _static_readers(ops: Sequence[AnyOp], length: int) -> dict[int, int]:
    """Count, for each offload, the readers listed after it and before the next prefetch.

    Those compute ops keep the GPU copy alive until they end.
    """
    out: dict[int, int] = {}
    for k, op in enumerate(ops):
        if not (isinstance(op, TransferOp) and op.kind is TransferKind.OFFLOAD):
            continue
        count = 0
        for later in ops[k + 1:]:
            if isinstance(later, TransferOp):
                if later.key == op.key:
                    break
                continue
            if reads(later, op.key, length):
                count += 1
        out[k] = count
    return out


class Replay:
    """Incremental replay: add ops one by one (plan builders use it to place transfers).

    Parameters
    ----------
    chain, bandwidth, memory_limit
        As for :func:`simulate_offload`.

    ``add(op, readers_after=n)`` tells, for an offload, how many compute ops listed after it
    (before the value's prefetch) read the value; :func:`simulate_offload` counts them from
    the whole plan.
    """

    def __init__(self, chain: Chain, bandwidth: float, memory_limit: int | None = None):
        if not bandwidth >= 0:
            raise PlanError(f"expected a non-negative bandwidth, got {bandwidth!r}")
        self.chain = chain
        self.bandwidth = bandwidth
        self.limit: float = math.inf if memory_limit is None else memory_limit
        self.ops: list[AnyOp] = []
        self.state = _State()

    def add(self, op: AnyOp | str, *, readers_after: int = 0) -> None:
        """Replay one more op (raises :class:`PlanError` naming its index)."""
        k = len(self.ops)
        parsed = parse_mixed_plan([op])[0] if isinstance(op, str) else op
        if isinstance(parsed, TransferOp):
            _transfer(self.chain, self.state, k, parsed, self.bandwidth, self.limit,
                      {k: readers_after})
        else:
            if is_final(self.state.stored):
                raise PlanError(f"{parsed} runs after the last backward", index=k)
            _compute(self.chain, self.state, k, parsed, self.limit)
        self.ops.append(parsed)

    def probe(self, op: Op) -> float:
        """Earliest start of compute ``op`` if added now (``inf`` if it could never fit)."""
        return self.probe_memory(op)[0]

    def probe_memory(self, op: Op) -> tuple[float, float]:
        """Earliest start and memory of compute ``op`` if added now (``inf`` if it never fits)."""
        try:
            start, memory, _, _ = compute_start(self.chain, self.state, len(self.ops), op,
                                                self.limit)
        except PlanError:
            return math.inf, math.inf
        return start, memory

    def finish(self) -> OffloadSimulation:
        """Check the plan is complete and return the simulation."""
        st = self.state
        if not is_final(st.stored):
            raise PlanError("the plan ends before B 1 has run (delta^0 is not computed)",
                            index=len(self.ops))
        makespan = max([st.compute_end] + [s.end for s in st.link])
        idle = sum(s.idle for s in st.compute)
        return OffloadSimulation(makespan, st.peak, tuple(st.compute), tuple(st.link), idle,
                                 st.offloaded)


def simulate_offload(
    chain: Chain,
    plan: Iterable[AnyOp | str],
    bandwidth: float,
    memory_limit: int | None = None,
) -> OffloadSimulation:
    """Replay an offload plan (checkpoint ops and transfer ops) on ``chain``.

    Parameters
    ----------
    chain
        The chain (sizes as given: discretise first if needed).
    plan
        Ops or op strings of CONTRACT sections 3 and 7.
    bandwidth
        Memory units per time unit moved by the link.
    memory_limit
        GPU memory limit; ``None`` means unlimited (no op ever waits for memory).

    Raises
    ------
    PlanError
        Naming the index of the first invalid op and why.

    Examples
    --------
    >>> c = Chain.from_lists([2, 2], [4, 4], [2, 2], [4, 4], input_size=2)
    >>> plan = ["F_all 1", "offload a 0", "F_all 2", "Loss", "B 2", "prefetch a 0", "B 1"]
    >>> r = simulate_offload(c, plan, bandwidth=1.0, memory_limit=12)
    >>> r.makespan, r.peak_memory, r.idle_time
    (14.0, 12, 2.0)
    """
    ops = parse_mixed_plan(plan)
    replay = Replay(chain, bandwidth, memory_limit)
    readers = _static_readers(ops, chain.length)
    for k, op in enumerate(ops):
        replay.add(op, readers_after=readers.get(k, 0))
    return replay.finish()


def compute_start(chain: Chain, st: _State, k: int, op: Op, limit: float
                  ) -> tuple[float, int, frozenset[Value], float]:
    """Earliest start of compute ``op`` given the replayed prefix (state is not changed).

    Returns ``(start, memory, stored_after, duration)``.
    """
    length = chain.length
    try:
        new, op_peak, duration = transition(chain, st.stored, op)
    except PlanError as exc:
        raise PlanError(exc.reason, index=k) from None
    earliest = max(st.compute_end, st.issued)
    for value, moved in st.moved.items():
        if not reads(op, value, length) or value not in st.stored:
            continue
        if moved.prefetch_index is not None:
            earliest = max(earliest, moved.prefetch_end)
        elif moved.pending_readers <= 0:
            raise PlanError(f"{op} needs {value[0]}^{value[1]} on the GPU, but it was "
                            f"offloaded at op {moved.offload_index} and not prefetched", index=k)
    for value in st.stored - new:  # values this op frees
        leaving = st.moved.get(value)
        if leaving is not None and leaving.prefetch_index is None:
            raise PlanError(f"{op} frees {value[0]}^{value[1]} while it is being offloaded "
                            f"(op {leaving.offload_index}); drop the offload", index=k)
    # the op's memory: its checkpoint peak minus values on the host for the whole op
    candidates = sorted({earliest} | {m.release for m in st.moved.values()
                                      if earliest < m.release < math.inf})
    memory = 0
    for t in candidates:
        off = sum(value_size(chain, v) for v in st.moved if v in st.stored
                  and st.host_only(v, t))
        memory = op_peak - off
        if memory <= limit:
            return t, memory, new, duration
    raise PlanError(f"{op} needs {memory} memory, above the limit {limit:g}, even after "
                    "every pending offload completes", index=k)


def _compute(chain: Chain, st: _State, k: int, op: Op, limit: float) -> None:
    length = chain.length
    start, memory, new, duration = compute_start(chain, st, k, op, limit)
    end = start + duration
    # readers listed after an offload keep the GPU copy until they end
    for value, moved in st.moved.items():
        if moved.prefetch_index is None and reads(op, value, length) and value in st.stored:
            moved.pending_readers -= 1
            moved.reader_end = max(moved.reader_end, end)
            if moved.pending_readers <= 0:
                moved.release = max(moved.offload_end, moved.reader_end)
    for value in st.stored - new:
        st.moved.pop(value, None)
        st.available.pop(value, None)
    for value in new - st.stored:
        st.available[value] = end
    # a prefetched value that is back and read is an ordinary GPU value again
    for value in [v for v, m in st.moved.items() if m.prefetch_index is not None
                  and reads(op, v, length)]:
        st.available[value] = st.moved.pop(value).prefetch_end
    st.stored = new
    st.compute.append(ComputeStep(k, str(op), start, end, int(memory), start - st.compute_end))
    st.compute_end = end
    st.anchor = start
    st.peak = max(st.peak, int(memory))


def _transfer(chain: Chain, st: _State, k: int, op: TransferOp, bandwidth: float,
              limit: float, readers: dict[int, int]) -> None:
    value = op.key
    name = f"{value[0]}^{value[1]}"
    least = 0 if value[0] == "a" else 1  # a^0 is the chain input; tapes start at abar^1
    if not least <= value[1] <= chain.length:
        raise PlanError(f"{op}: index {value[1]} out of range {least}..{chain.length} (the "
                        f"chain has {chain.length} stages)", index=k)
    if value not in st.stored:
        raise PlanError(f"{op}: {name} is not in memory", index=k)
    size = value_size(chain, value)
    if size == 0:
        duration = 0.0
    elif bandwidth <= 0:
        raise PlanError(f"{op}: the bandwidth is 0, so no transfer ever completes", index=k)
    else:
        duration = size / bandwidth
    earliest = max(st.anchor, st.link_free)
    if op.kind is TransferKind.OFFLOAD:
        if value in st.moved:
            raise PlanError(f"{op}: {name} is already offloaded (op "
                            f"{st.moved[value].offload_index})", index=k)
        start = max(earliest, st.available.get(value, 0.0))
        end = start + duration
        count = readers.get(k, 0)
        moved = _Moved(k, end, count)
        if count == 0:
            moved.release = max(end, _last_read(st, chain, value))
        st.moved[value] = moved
        st.offloaded += size
    else:
        back = st.moved.get(value)
        if back is None or back.prefetch_index is not None:
            raise PlanError(f"{op}: {name} is not on the host (offload it first)", index=k)
        moved = back
        if not math.isfinite(moved.release):
            raise PlanError(f"{op}: {name} is still read on the GPU by an op listed after its "
                            "offload (prefetch it after that op)", index=k)
        start = max(earliest, moved.release)
        start = _prefetch_start(chain, st, k, op, start, size, limit)
        end = start + duration
        moved.prefetch_index, moved.prefetch_start, moved.prefetch_end = k, start, end
    st.link_free = end
    st.issued = max(st.issued, start)
    st.link.append(TransferStep(k, str(op), start, end, size))


def _last_read(st: _State, chain: Chain, value: Value) -> float:
    """End of the last compute op so far that read ``value`` (its GPU copy lives until then)."""
    ends = [s.end for s in st.compute if reads(Op.parse(s.op), value, chain.length)]
    return max(ends, default=0.0)


def _prefetch_start(chain: Chain, st: _State, k: int, op: TransferOp, earliest: float,
                    size: int, limit: float) -> float:
    """Earliest start >= ``earliest`` at which the reservation of ``size`` fits."""
    last = st.compute[-1] if st.compute else None
    times = {earliest}
    if last is not None and earliest < last.end:
        times.add(last.end)
    times |= {m.release for m in st.moved.values() if earliest < m.release < math.inf}
    # what the last compute op left held (the same at every candidate between ops)
    held = held_after(chain, Op.parse(last.op)) if last is not None and chain.holds else 0
    need = 0.0
    for t in sorted(times):
        if last is not None and t < last.end - _EPS and last.end > last.start:
            # starts during the last compute op: that op must fit with the reservation
            counted = st.host_only(op.key, last.start)  # v was left out of that op
            need = last.memory + (size if counted else 0)
            if need <= limit:
                st.compute[-1] = replace(last, memory=int(need))
                st.peak = max(st.peak, int(need))
                return t
            continue
        stored = sum(value_size(chain, v) for v in st.stored)
        off = sum(value_size(chain, v) for v in st.moved if v in st.stored and v != op.key
                  and st.host_only(v, t))
        need = stored - off + held
        if need <= limit:
            st.peak = max(st.peak, int(need))
            return t
    raise PlanError(f"{op} needs {need:g} memory, above the limit {limit:g}, whenever it "
                    "could start", index=k)
