"""Typed plan ops (CONTRACT section 3) and their string form.

A checkpoint plan is a sequence of :class:`Op`. Stages are 1-based; the loss is the single
op ``Loss``. String forms: ``"F_all 3"``, ``"F_ck 1"``, ``"F_none 2"``, ``"Loss"``, ``"B 3"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from optmem.errors import PlanError
from optmem.fileio import read_json


class OpKind(StrEnum):
    """Kinds of checkpoint ops (rotor names in brackets)."""

    F_ALL = "F_all"  # Fe: forward with grad, keeps the tape abar^i
    F_CK = "F_ck"  # CF: forward without grad, keeps its input a^{i-1}
    F_NONE = "F_none"  # Fn: forward without grad, consumes its input
    LOSS = "Loss"  # L: a^L in, delta^L out
    B = "B"  # backward of stage i


_ROTOR_NAMES = {"Fe": OpKind.F_ALL, "CF": OpKind.F_CK, "Fn": OpKind.F_NONE, "B": OpKind.B}


@dataclass(frozen=True, order=True)
class Op:
    """One plan op: a kind and a 1-based stage (0 for ``Loss``)."""

    kind: OpKind
    stage: int = 0

    def __str__(self) -> str:
        return "Loss" if self.kind is OpKind.LOSS else f"{self.kind} {self.stage}"

    @classmethod
    def parse(cls, text: str, *, index: int | None = None) -> Op:
        """Parse ``"F_all 3"``-style text.

        Examples
        --------
        >>> Op.parse("F_ck 2")
        Op(kind=<OpKind.F_CK: 'F_ck'>, stage=2)
        >>> str(Op.parse("Loss"))
        'Loss'
        """
        if not isinstance(text, str):
            raise PlanError(f"expected an op string, got {text!r}", index=index)
        parts = text.split()
        if parts == ["Loss"]:
            return cls(OpKind.LOSS)
        if len(parts) != 2:
            raise PlanError(f"cannot parse op {text!r} (expected e.g. 'F_all 3' or 'Loss')",
                            index=index)
        try:
            kind = OpKind(parts[0])
        except ValueError:
            kinds = ", ".join(k.value for k in OpKind)
            raise PlanError(f"unknown op kind {parts[0]!r} (expected one of {kinds})",
                            index=index) from None
        if kind is OpKind.LOSS or not ascii_digits(parts[1]) or int(parts[1]) < 1:
            raise PlanError(f"bad stage in op {text!r} (expected a positive integer)",
                            index=index)
        return cls(kind, int(parts[1]))


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is an index written in ASCII digits (every plan parser's test).

    ``str.isdigit`` is also true for ``"²"``, which ``int`` refuses (a traceback from
    ``verify``), and for ``"١"``, which ``int`` reads as 1 (a hunt in stop 51).
    """
    return text.isascii() and text.isdigit()


def F_all(i: int) -> Op:  # noqa: N802 - paper notation
    """Return the op ``F_all i``."""
    return Op(OpKind.F_ALL, i)


def F_ck(i: int) -> Op:  # noqa: N802
    """Return the op ``F_ck i``."""
    return Op(OpKind.F_CK, i)


def F_none(i: int) -> Op:  # noqa: N802
    """Return the op ``F_none i``."""
    return Op(OpKind.F_NONE, i)


def B(i: int) -> Op:  # noqa: N802
    """Return the op ``B i``."""
    return Op(OpKind.B, i)


LOSS = Op(OpKind.LOSS)

Plan = tuple[Op, ...]


def parse_plan(ops: Iterable[str | Op]) -> Plan:
    """Parse a sequence of op strings (or ops) into a plan."""
    return tuple(op if isinstance(op, Op) else Op.parse(op, index=k) for k, op in enumerate(ops))


def store_all_plan(length: int) -> tuple[Op, ...]:
    """``F_all 1..L``, ``Loss``, ``B L..1`` (the store-all plan; no recomputation)."""
    return (*(F_all(i) for i in range(1, length + 1)), LOSS,
            *(B(i) for i in range(length, 0, -1)))


def segments_plan(bounds: Sequence[tuple[int, int]]) -> tuple[Op, ...]:
    """Checkpoint-sequential plan for contiguous segments ``[(first, last), ...]``.

    Every segment but the last runs ``F_ck first, F_none ...``; the last runs ``F_all``;
    in the backward each segment is replayed with ``F_all`` and then backpropagated.
    """
    ops: list[Op] = []
    for first, last in bounds[:-1]:
        ops.append(F_ck(first))
        ops.extend(F_none(k) for k in range(first + 1, last + 1))
    first, last = bounds[-1]
    ops.extend(F_all(k) for k in range(first, last + 1))
    ops.append(LOSS)
    ops.extend(B(k) for k in range(last, first - 1, -1))
    for first, last in reversed(bounds[:-1]):
        ops.extend(F_all(k) for k in range(first, last + 1))
        ops.extend(B(k) for k in range(last, first - 1, -1))
    return tuple(ops)


def plan_strings(plan: Sequence[Op]) -> tuple[str, ...]:
    """Return the string form of every op of ``plan``."""
    return tuple(str(op) for op in plan)


def from_rotor_sequence(text: str, length: int) -> Plan:
    """Convert rotor's printed sequence (``"Fe_0 CF_1 L B_0"``, 0-based) to a plan."""
    ops: list[Op] = []
    for k, token in enumerate(text.split()):
        if token == "L":
            ops.append(LOSS)
            continue
        name, _, idx = token.partition("_")
        if name not in _ROTOR_NAMES or not ascii_digits(idx):
            raise PlanError(f"cannot parse rotor op {token!r}", index=k)
        ops.append(Op(_ROTOR_NAMES[name], int(idx) + 1))
    return tuple(ops)


def read_plan_json(path: str | Path) -> dict[str, Any]:
    """Read a plan file as ``{"plan": [...], ...}``: a JSON list of ops, or an object.

    The ``--json`` output of ``optmem solve`` is accepted as it is (its other fields, such as
    ``memory_limit`` and ``unit``, are kept). Errors name the file.
    """
    path = Path(path)
    data: Any = read_json(path, error=PlanError, what="plan file")
    if isinstance(data, list):
        data = {"plan": data}
    if not isinstance(data, dict) or not isinstance(data.get("plan"), list):
        raise PlanError("expected a JSON list of ops or an object with a 'plan' list",
                        source=str(path))
    return data


def plan_file_int(data: dict[str, Any], name: str, *, default: int | None,
                  least: int) -> int | None:
    """The integer field ``name`` of a plan file or result (``unit``, ``memory_limit``), checked.

    ``default`` when absent or ``null``. The one check of ``optmem show`` and ``optmem
    verify`` (and Python's ``show_plan`` and ``verify_plan``).

    Raises
    ------
    PlanError
        (field ``name``) For a value that is no integer in ``least..2^62``.
    """
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 2**62:
        shown = value if not isinstance(value, int) or value < 10**30 else "a larger integer"
        raise PlanError(f"expected an integer in {least}..2^62 (a size in memory units), got "
                        f"{shown!r}", field=name)
    return value


def load_plan(path: str | Path) -> Plan:
    """Read and parse a checkpoint plan file (see :func:`read_plan_json`)."""
    try:
        return parse_plan(read_plan_json(path)["plan"])
    except PlanError as exc:
        raise exc if exc.source else exc.with_source(str(path)) from None


# ------------------------------------------------------------------ offload ops (CONTRACT 7)
class TransferKind(StrEnum):
    """Kinds of transfer ops on the GPU-CPU link (offloading plans, CONTRACT "Offload plans")."""

    OFFLOAD = "offload"  # O: copy a value to host memory, free the GPU copy when done
    PREFETCH = "prefetch"  # P: reserve GPU memory, copy the value back from host memory


TRANSFER_VALUES = ("a", "abar")


@dataclass(frozen=True, order=True)
class TransferOp:
    """One transfer op: ``offload a 0``, ``offload abar 3``, ``prefetch abar 3``.

    ``value`` is ``"a"`` (an activation ``a^i``; ``a 0`` is the chain input) or ``"abar"``
    (a tape ``abar^i``, ``i >= 1``). Gradients and weights are never transferred (O.5, O.6).
    """

    kind: TransferKind
    value: str
    stage: int

    def __str__(self) -> str:
        return f"{self.kind} {self.value} {self.stage}"

    @property
    def key(self) -> tuple[str, int]:
        """The transferred value as a ``(kind, index)`` pair of the checkpoint simulator."""
        return (self.value, self.stage)

    @classmethod
    def parse(cls, text: str, *, index: int | None = None) -> TransferOp:
        """Parse ``"offload abar 3"``-style text.

        Examples
        --------
        >>> str(TransferOp.parse("prefetch a 0"))
        'prefetch a 0'
        """
        parts = text.split() if isinstance(text, str) else []
        if len(parts) != 3 or parts[0] not in {k.value for k in TransferKind}:
            raise PlanError(f"cannot parse transfer op {text!r} (expected e.g. "
                            "'offload abar 3' or 'prefetch a 0')", index=index)
        if parts[1] not in TRANSFER_VALUES:
            raise PlanError(f"bad value in {text!r}: only 'a' and 'abar' can be transferred "
                            "(gradients stay on the GPU)", index=index)
        if not ascii_digits(parts[2]) or (parts[1] == "abar" and int(parts[2]) < 1):
            raise PlanError(f"bad index in op {text!r} (expected 'a i' with i >= 0 or "
                            "'abar i' with i >= 1)", index=index)
        return cls(TransferKind(parts[0]), parts[1], int(parts[2]))


def offload(value: str, i: int) -> TransferOp:
    """Return the op ``offload value i`` (``value`` is ``"a"`` or ``"abar"``)."""
    return TransferOp(TransferKind.OFFLOAD, value, i)


def prefetch(value: str, i: int) -> TransferOp:
    """Return the op ``prefetch value i``."""
    return TransferOp(TransferKind.PREFETCH, value, i)


AnyOp = Op | TransferOp
MixedPlan = tuple[AnyOp, ...]


def parse_op(text: str | AnyOp, *, index: int | None = None) -> AnyOp:
    """Parse a checkpoint op or a transfer op (ops are returned unchanged)."""
    if isinstance(text, Op | TransferOp):
        return text
    if isinstance(text, str) and text.split()[:1] in (["offload"], ["prefetch"]):
        return TransferOp.parse(text, index=index)
    return Op.parse(text, index=index)


def parse_mixed_plan(ops: Iterable[str | AnyOp]) -> MixedPlan:
    """Parse a plan of checkpoint ops and transfer ops (offload and remat-offload plans)."""
    return tuple(parse_op(op, index=k) for k, op in enumerate(ops))
