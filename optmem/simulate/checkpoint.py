"""Checkpoint plans: replay a plan and recompute its makespan and peak memory.

Semantics: the operation table of the rotor report (RR Table 1 = thesis Table 2.1), as
digested in ``shared/design/rotor.md`` section 2, with these rules made explicit:

* Memory holds values ``a^i`` (activation, ``output_size``; ``a^0`` is the input),
  ``abar^i`` (tape, ``saved_size``, contains ``a^i``) and ``delta^i`` (gradient, same size
  as ``a^i``). At the start it holds ``a^0`` only. Sizes are summed.
* ``F_all i`` / ``F_ck i`` / ``F_none i`` need ``a^{i-1}`` (or the tape ``abar^{i-1}``, which
  contains it). ``F_all`` adds ``abar^i``; ``F_ck`` adds ``a^i``; ``F_none`` adds ``a^i`` and
  then frees its input (``a^{i-1}`` if stored, else ``abar^{i-1}``). Peak of the op: all
  stored values + its output + ``fwd_overhead``.
* ``Loss`` needs ``a^L`` or ``abar^L``, adds ``delta^L`` and frees ``a^L`` if stored. Peak:
  stored + ``delta^L`` + ``loss.bwd_overhead``. Duration ``loss.bwd_time``.
* ``B i`` needs ``delta^i``, ``abar^i`` and ``a^{i-1}`` (or ``abar^{i-1}``); adds
  ``delta^{i-1}`` and frees ``delta^i``, ``abar^i`` and ``a^{i-1}`` (a tape ``abar^{i-1}`` is
  kept for ``B i-1``). Peak: stored + ``delta^{i-1}`` + ``bwd_overhead``.
* No free discard: values leave memory only as above.
* **No duplicates**: an op may not produce a value that memory already holds in either form
  (``a^i`` while ``a^i`` or ``abar^i`` is stored).
* **Pinning rule** of the digest: a stage's input cannot be freed while its tape is alive.
  Two ops could: ``F_none i`` frees ``a^{i-1}`` (it would also duplicate ``a^i`` while
  ``abar^i`` is alive), and ``B i`` frees ``abar^i``, which holds ``a^i``, the input of
  stage ``i+1``: a plan that runs ``F_all i+1`` again after ``B i+1`` (a tape nothing will
  read) and then ``B i``. Both are refused (the second since stop 51: a torch step of such
  a plan held ``a^i`` through the new tape, one activation above the replayed peak).
* A complete plan runs ``Loss`` once (a second ``Loss``, even after ``B L``, is refused) and
  ends with ``delta^0`` in memory (every ``B`` done).

The makespan is the sum of op durations; the peak is the maximum op peak.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.plan import Op, OpKind, parse_plan

A, ABAR, DELTA = "a", "abar", "delta"
Value = tuple[str, int]


class Step(NamedTuple):
    """One replayed op: when it ran and how much memory it used."""

    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: the op's index
    op: str
    start: float
    end: float
    peak: int
    after: int


@dataclass(frozen=True)
class SimulationResult:
    """Makespan, peak memory and memory timeline of a replayed plan."""

    makespan: float
    peak_memory: int
    timeline: tuple[Step, ...]

    @property
    def peak_index(self) -> int:
        """Index of the first op that reaches the peak."""
        return next(s.index for s in self.timeline if s.peak == self.peak_memory)


def value_size(chain: Chain, value: Value) -> int:
    """Size of ``a^i``, ``abar^i`` or ``delta^i`` in ``chain``."""
    kind, i = value
    if i == 0:
        return chain.input_size
    if kind == ABAR:
        return chain.saved_size[i - 1]
    return chain.output_size[i - 1]


def held_after(chain: Chain, op: Op) -> int:
    """Memory ``op`` leaves held beyond the stored values until the next compute op starts.

    The chain's ``fwd_held`` (any forward), ``bwd_held`` or ``loss_held``; 0 unless the
    chain sets them (e.g. FSDP2's buffers, :func:`optmem.pytorch.distributed.fsdp_chain`).

    Examples
    --------
    >>> c = Chain.from_lists([1], [1], [2], [2], input_size=1, fwd_overhead=[3])
    >>> held_after(c, Op.parse("F_all 1"))
    0
    """
    if op.kind is OpKind.LOSS:
        return chain.loss_held
    if op.kind is OpKind.B:
        return chain.bwd_held[op.stage - 1]
    return chain.fwd_held[op.stage - 1]


def _name(value: Value) -> str:
    return f"{value[0]}^{value[1]}"


def _stored_input(stored: frozenset[Value], i: int) -> Value | None:
    """The stored form of ``a^{i}`` (activation first, else tape), or ``None``."""
    if (A, i) in stored:
        return (A, i)
    if i >= 1 and (ABAR, i) in stored:
        return (ABAR, i)
    return None


def transition(
    chain: Chain, stored: frozenset[Value], op: Op, used: int | None = None
) -> tuple[frozenset[Value], int, float]:
    """Apply ``op`` to the set of stored values.

    ``used`` is the total size of ``stored`` when the caller tracks it (computed otherwise).

    Returns
    -------
    new_stored, op_peak, duration
        The values after the op, the memory while it runs (including the stored values)
        and its duration.

    Raises
    ------
    PlanError
        If the op's inputs are missing or it breaks a rule (without an index).
    """
    L = chain.length
    if used is None:
        used = sum(value_size(chain, v) for v in stored)
    i = op.stage
    if op.kind is OpKind.LOSS:
        src = _stored_input(stored, L)
        if src is None:
            raise PlanError(f"Loss needs a^{L} in memory")
        if any(kind == DELTA for kind, _ in stored):  # delta^L, or what B made of it
            raise PlanError("Loss runs twice")
        peak = used + value_size(chain, (DELTA, L)) + chain.loss_bwd_overhead
        after = stored | {(DELTA, L)}
        if src[0] == A:
            after -= {src}
        return frozenset(after), peak, chain.loss_bwd_time
    if not 1 <= i <= L:
        raise PlanError(f"stage {i} out of range 1..{L}")
    if op.kind is OpKind.B:
        return _backward(chain, stored, used, i)
    src = _stored_input(stored, i - 1)
    if src is None:
        raise PlanError(f"{op} needs a^{i - 1} in memory")
    out: Value = (ABAR, i) if op.kind is OpKind.F_ALL else (A, i)
    if (A, i) in stored or (ABAR, i) in stored:
        held = (A, i) if (A, i) in stored else (ABAR, i)
        raise PlanError(f"{op} would duplicate {_name(held)}, already in memory")
    peak = used + value_size(chain, out) + chain.fwd_overhead[i - 1]
    grown = set(stored) | {out}
    if op.kind is OpKind.F_NONE:
        if (ABAR, i) in stored:  # pinning rule (implied by the no-duplicate rule above)
            raise PlanError(f"{op} would free the input of stage {i} while abar^{i} is alive")
        if src == (A, 0):
            raise PlanError(f"{op} would consume the chain input a^0, which cannot be recomputed")
        grown.discard(src)
    return frozenset(grown), peak, chain.fwd_time[i - 1]


def _backward(
    chain: Chain, stored: frozenset[Value], used: int, i: int
) -> tuple[frozenset[Value], int, float]:
    for need in ((DELTA, i), (ABAR, i)):
        if need not in stored:
            raise PlanError(f"B {i} needs {_name(need)} in memory")
    src = _stored_input(stored, i - 1)
    if src is None:
        raise PlanError(f"B {i} needs a^{i - 1} in memory")
    if (ABAR, i + 1) in stored:  # pinning rule: abar^i holds a^i, the input of stage i+1
        raise PlanError(f"B {i} would free a^{i}, the input of stage {i + 1}, while "
                        f"abar^{i + 1} is alive")
    peak = used + value_size(chain, (DELTA, i - 1)) + chain.bwd_overhead[i - 1]
    after = (set(stored) - {(DELTA, i), (ABAR, i)}) | {(DELTA, i - 1)}
    if src[0] == A:
        after.discard(src)
    return frozenset(after), peak, chain.bwd_time[i - 1]


def initial_state() -> frozenset[Value]:
    """Memory at the start of every plan: the input ``a^0``."""
    return frozenset({(A, 0)})


def is_final(stored: frozenset[Value]) -> bool:
    """Whether every backward has run (``delta^0`` is in memory)."""
    return (DELTA, 0) in stored


def simulate_checkpoint(
    chain: Chain, plan: Iterable[Op | str], memory_limit: int | None = None
) -> SimulationResult:
    """Replay a checkpoint plan on ``chain`` (sizes as given: discretise first if needed).

    Parameters
    ----------
    chain
        The chain (its sizes are used as they are).
    plan
        Ops or op strings.
    memory_limit
        If given, an op whose peak exceeds it makes the plan invalid.

    Raises
    ------
    PlanError
        Naming the index of the first invalid op and why.

    Examples
    --------
    >>> c = Chain.from_rotor([1], [2, 0], [1, 1], [1, 2])
    >>> r = simulate_checkpoint(c, ["F_all 1", "Loss", "B 1"])
    >>> r.makespan, r.peak_memory
    (3.0, 5)
    """
    ops: Sequence[Op] = parse_plan(plan)
    stored = initial_state()
    clock, peak, after = 0.0, 0, chain.input_size
    steps: list[Step] = []
    for k, op in enumerate(ops):
        if is_final(stored):
            raise PlanError(f"{op} runs after the last backward", index=k)
        try:
            new, op_peak, duration = transition(chain, stored, op, after)
        except PlanError as exc:
            raise PlanError(exc.reason, index=k) from None
        if memory_limit is not None and op_peak > memory_limit:
            raise PlanError(f"{op} needs {op_peak} memory, above the limit {memory_limit}",
                            index=k)
        after += sum(value_size(chain, v) for v in new - stored)
        after -= sum(value_size(chain, v) for v in stored - new)
        stored = new
        steps.append(Step(k, str(op), clock, clock + duration, op_peak, after))
        clock += duration
        peak = max(peak, op_peak)
    if not is_final(stored):
        raise PlanError("the plan ends before B 1 has run (delta^0 is not computed)",
                        index=len(ops))
    return SimulationResult(clock, peak, tuple(steps))
