"""Pipeline plans: an allocation of stages to GPUs and a 1-periodic pattern.

CONTRACT section "Pipeline plans and the ``pipeline`` problem". A plan has a period ``T``, a
list of stages (consecutive layer ranges of ``1..L`` in chain order; the loss runs with layer
``L``) each on a GPU, and one task per periodic operation, with a start time ``0 <= start <
T`` within the pattern and an integer shift ``h``. In repetition ``j`` the
task starts at ``j T + start`` and processes micro-batch ``j + h`` (thesis section 4.2; the
backward of stage 1 has ``h = 0`` by convention, forwards have larger shifts).

Ops (string form, 1-based stages):

* ``period T``
* ``stage S layers I-J gpu G``
* ``F S start t shift h`` / ``B S start t shift h``: forward / backward of stage ``S``
* ``send S start t shift h``: transfer of stage ``S``'s output activation to stage ``S+1``
  (only when the two stages are on different GPUs)
* ``grad S start t shift h``: transfer of the gradient from stage ``S+1`` back to stage ``S``
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optmem.errors import PlanError
from optmem.plan import ascii_digits

FORMAT = "optmem.pipeline-plan/1"
TASK_OPS = ("F", "B", "send", "grad")


@dataclass(frozen=True)
class PipelineStage:
    """Layers ``first..last`` (1-based, inclusive) on GPU ``gpu`` (0-based)."""

    first: int
    last: int
    gpu: int


@dataclass(frozen=True)
class PipelineTask:
    """One periodic operation: ``op`` of stage ``stage`` at ``start`` with shift ``shift``."""

    op: str
    stage: int
    start: float
    shift: int


def _num(v: float) -> str:
    """Shortest round-tripping text of a float (integers without ``.0``)."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline plan: period, stages and tasks (see module docstring)."""

    period: float
    stages: tuple[PipelineStage, ...]
    tasks: tuple[PipelineTask, ...]

    # ------------------------------------------------------------ views
    def gpu_layers(self) -> dict[int, list[int]]:
        """Layers held by each GPU."""
        out: dict[int, list[int]] = {}
        for st in self.stages:
            out.setdefault(st.gpu, []).extend(range(st.first, st.last + 1))
        return out

    def task(self, op: str, stage: int) -> PipelineTask | None:
        """The task ``op`` of ``stage`` (``None`` if absent)."""
        for t in self.tasks:
            if t.op == op and t.stage == stage:
                return t
        return None

    def describe(self) -> str:
        """One line per GPU: its layers."""
        return "; ".join(f"GPU {g}: " + ",".join(map(str, layers))
                         for g, layers in sorted(self.gpu_layers().items()))

    # ------------------------------------------------------------ strings
    def to_strings(self) -> tuple[str, ...]:
        """The plan as op strings (the ``plan`` field of a result)."""
        out = [f"period {_num(self.period)}"]
        out += [f"stage {k} layers {s.first}-{s.last} gpu {s.gpu}"
                for k, s in enumerate(self.stages, start=1)]
        out += [f"{t.op} {t.stage} start {_num(t.start)} shift {t.shift}" for t in self.tasks]
        return tuple(out)

    @classmethod
    def from_strings(cls, ops: Iterable[Any]) -> PipelinePlan:
        """Parse op strings (see the module docstring)."""
        period: float | None = None
        stages: dict[int, PipelineStage] = {}
        tasks: list[PipelineTask] = []
        for index, text in enumerate(ops):
            if not isinstance(text, str):
                raise PlanError(f"expected an op string, got {text!r}", index=index)
            parts = text.split()
            # given twice, the last one won in silence until stop 51 (two GPUs for one stage)
            if parts[:1] == ["period"] and period is not None:
                raise PlanError("the plan gives the period twice", index=index)
            if (parts[:1] == ["stage"] and len(parts) > 1 and ascii_digits(parts[1])
                    and int(parts[1]) in stages):
                raise PlanError(f"stage {parts[1]} is defined twice", index=index)
            try:
                if parts[:1] == ["period"] and len(parts) == 2:
                    period = float(parts[1])
                elif (parts[:1] == ["stage"] and len(parts) == 6 and parts[2] == "layers"
                      and parts[4] == "gpu"):
                    first, _, last = parts[3].partition("-")
                    stages[int(parts[1])] = PipelineStage(int(first), int(last or first),
                                                          int(parts[5]))
                elif (parts[:1] and parts[0] in TASK_OPS and len(parts) == 6
                      and parts[2] == "start" and parts[4] == "shift"):
                    tasks.append(PipelineTask(parts[0], int(parts[1]), float(parts[3]),
                                              int(parts[5])))
                else:
                    raise ValueError
            except (ValueError, IndexError):
                raise PlanError(
                    f"cannot parse pipeline op {text!r} (expected 'period T', 'stage S layers "
                    "I-J gpu G' or 'F|B|send|grad S start t shift h')", index=index) from None
        if period is None:
            raise PlanError("the plan has no 'period T' op")
        if sorted(stages) != list(range(1, len(stages) + 1)):
            raise PlanError(f"stages must be numbered 1..{len(stages)}, got {sorted(stages)}")
        return cls(period, tuple(stages[k] for k in sorted(stages)), tuple(tasks))

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The ``optmem.pipeline-plan/1`` JSON object."""
        return {
            "format": FORMAT, "period": self.period,
            "stages": [{"layers": [s.first, s.last], "gpu": s.gpu} for s in self.stages],
            "tasks": [{"op": t.op, "stage": t.stage, "start": t.start, "shift": t.shift}
                      for t in self.tasks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelinePlan:
        """Parse an ``optmem.pipeline-plan/1`` object (errors name the bad field)."""
        if data.get("format") != FORMAT:
            raise PlanError(f"expected format {FORMAT!r}, got {data.get('format')!r}")
        stages = []
        for k, s in enumerate(_items(data, "stages")):
            layers = s.get("layers")
            if not isinstance(layers, list) or len(layers) != 2:
                raise PlanError(f"stages[{k}].layers: expected [first, last], got {layers!r}")
            stages.append(PipelineStage(_integer(layers[0], f"stages[{k}].layers[0]"),
                                        _integer(layers[1], f"stages[{k}].layers[1]"),
                                        _integer(s.get("gpu"), f"stages[{k}].gpu")))
        tasks = []
        for k, t in enumerate(_items(data, "tasks")):
            if t.get("op") not in TASK_OPS:
                raise PlanError(f"tasks[{k}].op: expected one of {', '.join(TASK_OPS)}, got "
                                f"{t.get('op')!r}")
            tasks.append(PipelineTask(t["op"], _integer(t.get("stage"), f"tasks[{k}].stage"),
                                      _number(t.get("start"), f"tasks[{k}].start"),
                                      _integer(t.get("shift"), f"tasks[{k}].shift")))
        return cls(_number(data.get("period"), "period"), tuple(stages), tuple(tasks))

    @classmethod
    def from_any(cls, data: Any) -> PipelinePlan:
        """Accept a plan, a plan JSON object, a result JSON object or a list of op strings."""
        if isinstance(data, PipelinePlan):
            return data
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError:
                raise PlanError("not valid JSON") from None
        if isinstance(data, Mapping):
            if data.get("format") == FORMAT:
                return cls.from_dict(data)
            if "plan" in data:
                return cls.from_any(data["plan"])
            raise PlanError("expected a pipeline plan object or a result with a 'plan' field")
        if isinstance(data, Sequence):
            return cls.from_strings(data)
        raise PlanError(f"cannot read a pipeline plan from {type(data).__name__}")


def _items(data: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    """The list of JSON objects ``data[name]`` (``stages`` or ``tasks``), checked."""
    items = data.get(name)
    if not isinstance(items, list) or not all(isinstance(x, Mapping) for x in items):
        raise PlanError(f"{name}: expected a list of JSON objects, got {items!r}")
    return items


def _integer(value: Any, name: str) -> int:
    """``value`` as an int if it is an integer (``3`` or ``3.0``), else a clear error."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise PlanError(f"{name}: expected an integer, got {value!r}")


def _number(value: Any, name: str) -> float:
    """``value`` as a float if it is a number that a float can hold, else a clear error."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(f"{name}: expected a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise PlanError(f"{name}: expected a number, got one too large for a float") from None


def minimal_shifts(
    starts: Mapping[tuple[str, int], float],
    durations: Mapping[tuple[str, int], float],
    n_stages: int,
    period: float,
    *,
    tol: float = 1e-9,
) -> dict[tuple[str, int], int]:
    """Smallest shifts making the pattern respect the dependencies (``B 1`` gets 0).

    ``starts`` and ``durations`` are keyed by ``(op, stage)``; transfers that are absent are
    skipped. Along each dependency ``X -> Y`` the shift drops by
    ``ceil((start_X + d_X - start_Y) / T)``, the fewest periods ``Y`` must lag behind ``X``.
    """
    order: list[tuple[str, int]] = []
    for s in range(1, n_stages + 1):
        order.append(("F", s))
        if s < n_stages and ("send", s) in starts:
            order.append(("send", s))
    for s in range(n_stages, 0, -1):
        order.append(("B", s))
        if s > 1 and ("grad", s - 1) in starts:
            order.append(("grad", s - 1))
    shifts: dict[tuple[str, int], int] = {order[-1]: 0}
    eps = tol * max(1.0, period)
    for k in range(len(order) - 2, -1, -1):
        x, y = order[k], order[k + 1]
        gap = (starts[x] + durations[x] - starts[y]) / period
        shifts[x] = shifts[y] + max(0, math.ceil(gap - eps / period))
    return shifts


def phase(t: float, period: float, rel_tol: float) -> float:
    """``t`` modulo ``period`` in ``[0, period)``; within ``rel_tol * period`` of it is 0."""
    r = math.fmod(t, period)
    if r < 0:
        r += period
    if r >= period * (1 - rel_tol):
        r = 0.0
    return r
