"""The chain: per-stage cost profile of one network for one batch (``optmem.chain/1``).

Notation (rotor report RR-9302 / Shilova thesis chapter 2, see ``shared/design/rotor.md``):

==================  =======================  ==========================================
field               paper                    meaning
==================  =======================  ==========================================
``input_size``      omega_a^0                size of the chain input a^0 (counts)
``fwd_time[i]``     u_f^i                    one forward of stage i
``bwd_time[i]``     u_b^i                    one backward of stage i
``output_size[i]``  omega_a^i                size of a^i (and of the gradient delta^i)
``saved_size[i]``   omega_abar^i             tape abar^i kept by F_all^i, includes a^i
``fwd_overhead[i]`` o_f^i                    temporary memory during F^i
``bwd_overhead[i]`` o_b^i                    temporary memory during B^i
``weight_size[i]``  W_i                      parameters (pipeline problems only)
``loss_bwd_time``   u_b^{L+1}                the loss stage (fwd time 0, sizes 0)
``loss_bwd_overhead`` o_b^{L+1}              temporary memory of the loss
``fwd_held[i]``     (none)                   memory ``F^i`` leaves held until the next
                                             compute op starts (``<= fwd_overhead[i]``)
``bwd_held[i]``     (none)                   the same for ``B^i`` (``<= bwd_overhead[i]``)
``loss_held``       (none)                   the same for ``Loss`` (``<= loss_bwd_overhead``)
==================  =======================  ==========================================

The held terms (default 0, omitted from the JSON when 0) count only at an instant between
two compute ops, where a transfer may start (the offload simulator, CONTRACT section 10):
memory a data-parallel runtime keeps beyond the stored values, e.g. FSDP2's communication
buffers (:func:`optmem.pytorch.distributed.fsdp_chain`). Being at most the op's overhead,
they never raise a compute op's own peak.

Python tuples are 0-based (``fwd_time[0]`` is stage 1); plans and messages are 1-based.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from optmem.errors import ChainError
from optmem.fileio import read_json, write_text_atomic

FORMAT = "optmem.chain/1"

_STAGE_SIZE_FIELDS = ("output_size", "saved_size", "fwd_overhead", "bwd_overhead", "weight_size",
                      "fwd_held", "bwd_held")
_STAGE_TIME_FIELDS = ("fwd_time", "bwd_time")
_STAGE_REQUIRED = ("fwd_time", "bwd_time", "output_size", "saved_size")
_STAGE_OPTIONAL = ("fwd_held", "bwd_held")  # written only when not 0
_STAGE_KNOWN = {"name", *_STAGE_TIME_FIELDS, *_STAGE_SIZE_FIELDS}
_TOP_KNOWN = {"format", "name", "time_unit", "memory_unit", "input_size", "stages", "loss"}
MAX_TOTAL_TIME = 1e12
"""Largest sum of every time of a chain (forward, backward, loss). Exact engines work on
these numbers (HiGHS fails on coefficients near 1e14; CP-SAT scales times to int64), and a
training step of 1e12 time units is beyond any real network in s, ms, us or ns."""
MIN_TIME = 1e-9
"""Smallest non-zero time: a picosecond in ms; below it a time is noise, and all-tiny times
make the integer time scales of the exact models overflow."""
MAX_TOTAL_SIZE = 2**50
"""Largest sum of every size of a chain (1 PiB in bytes): the DPs add sizes and limits in
int64, the simulators in float64, and the exact models use sizes as coefficients; no real
chain comes near (the largest bundled one sums to 0.5 TiB)."""


def _show(value: Any) -> str:
    """``repr(value)``, cut short (a 400-digit number is not worth printing)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _as_tuple(value: Any, *, name: str) -> tuple[Any, ...]:
    """``value`` (a list, tuple, numpy array, ...) as a tuple, or one error naming ``name``."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ChainError(f"expected a list with one value per stage, got {_show(value)}",
                         field=name)
    return tuple(value)


def _check_time(value: Any, *, stage: int | None, name: str) -> float:
    """Return ``value`` as a float if it is 0 or a time in ``[MIN_TIME, MAX_TOTAL_TIME]``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real):
        raise ChainError(f"expected a non-negative number, got {_show(value)}", stage=stage,
                         field=name)
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float: beyond the range too
        number = math.inf
    if not (number == 0 or MIN_TIME <= number <= MAX_TOTAL_TIME):  # NaN fails both
        raise ChainError(f"expected 0 or a time in [{MIN_TIME:g}, {MAX_TOTAL_TIME:g}], got "
                         f"{_show(value)}", stage=stage, field=name)
    return number


def _check_size(value: Any, *, stage: int | None, name: str) -> int:
    """Return ``value`` as an int if it is a non-negative integer (``12.0`` is accepted)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real):
        raise ChainError(f"expected a non-negative integer, got {_show(value)}", stage=stage,
                         field=name)
    if isinstance(value, Integral):
        value = int(value)
    else:
        number = float(value)
        if not math.isfinite(number) or not number.is_integer():
            raise ChainError(f"expected an integer size, got {_show(value)}", stage=stage,
                             field=name)
        value = int(number)
    if value < 0:
        raise ChainError(f"expected a non-negative size, got {_show(value)}", stage=stage,
                         field=name)
    if value > MAX_TOTAL_SIZE:
        raise ChainError(f"expected a size of at most 2^50, got {_show(value)}", stage=stage,
                         field=name)
    return int(value)


def check_text(value: str, *, stage: int | None = None, name: str, allow: str = "") -> str:
    """Return ``value`` if it is printable text (the characters of ``allow`` aside).

    No unpaired surrogate (what a JSON escape of a lone surrogate gives, which no output
    can encode) and no control character (which fonts cannot draw and which break the
    one-line messages).
    """
    if not isinstance(value, str):
        raise ChainError(f"expected text, got {_show(value)}", stage=stage, field=name)
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cs") and c not in allow),
               None)
    if bad is not None:
        raise ChainError(f"expected printable text, got {_show(value)} (character "
                         f"U+{ord(bad):04X})", stage=stage, field=name)
    return value


@dataclass(frozen=True)
class Chain:
    """Validated, immutable cost profile of a chain of ``L`` stages followed by a loss.

    Parameters
    ----------
    fwd_time, bwd_time
        Durations of one forward / backward of each stage (length ``L``).
    output_size, saved_size
        Sizes of ``a^i`` and of the tape ``abar^i`` (``saved_size >= output_size``).
    fwd_overhead, bwd_overhead
        Temporary memory while ``F^i`` / ``B^i`` runs.
    input_size
        Size of the chain input ``a^0``; it counts against the memory limit.
    weight_size
        Parameter sizes (pipeline problems); defaults to zeros.
    loss_bwd_time, loss_bwd_overhead
        Duration and temporary memory of the loss step (``Loss`` op).
    fwd_held, bwd_held, loss_held
        Memory ``F^i`` / ``B^i`` / ``Loss`` leaves held, beyond the stored values, until the
        next compute op starts (each at most the op's overhead); default zeros.
    name, time_unit, memory_unit, stage_names
        Descriptive metadata.
    extra
        Unknown top-level fields, kept for round-trips and otherwise ignored.

    Examples
    --------
    >>> c = Chain.from_lists([1, 2], [2, 3], [4, 4], [6, 5], input_size=4)
    >>> c.length, c.saved_size
    (2, (6, 5))
    """

    fwd_time: tuple[float, ...]
    bwd_time: tuple[float, ...]
    output_size: tuple[int, ...]
    saved_size: tuple[int, ...]
    fwd_overhead: tuple[int, ...]
    bwd_overhead: tuple[int, ...]
    input_size: int
    weight_size: tuple[int, ...] = ()
    loss_bwd_time: float = 0.0
    loss_bwd_overhead: int = 0
    name: str = "chain"
    time_unit: str = "ms"
    memory_unit: str = "B"
    stage_names: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    stage_extra: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, repr=False)
    fwd_held: tuple[int, ...] = ()
    bwd_held: tuple[int, ...] = ()
    loss_held: int = 0

    def __post_init__(self) -> None:
        for name in (*_STAGE_TIME_FIELDS, *_STAGE_SIZE_FIELDS, "stage_names", "stage_extra"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name), name=name))
        n = len(self.fwd_time)
        if n == 0:
            raise ChainError("a chain needs at least one stage", field="stages")
        for name in ("weight_size", *_STAGE_OPTIONAL):
            object.__setattr__(self, name, getattr(self, name) or (0,) * n)
        object.__setattr__(self, "stage_names", self.stage_names or _default_names(n))
        object.__setattr__(self, "stage_extra", self.stage_extra or ({},) * n)
        for name in ("name", "time_unit", "memory_unit"):
            check_text(getattr(self, name), stage=None, name=name)
        for i, text in enumerate(self.stage_names):
            check_text(text, stage=i + 1, name="name")
        if not isinstance(self.extra, Mapping) or not all(
                isinstance(extra, Mapping) for extra in self.stage_extra):
            raise ChainError("expected a dict of extra fields (and one per stage)",
                             field="extra")
        for name in (*_STAGE_TIME_FIELDS, *_STAGE_SIZE_FIELDS, "stage_names", "stage_extra"):
            if len(getattr(self, name)) != n:
                raise ChainError(
                    f"expected {n} values (one per stage), got {len(getattr(self, name))}",
                    field=name,
                )
        times = {f: tuple(_check_time(v, stage=i + 1, name=f) for i, v in
                          enumerate(getattr(self, f))) for f in _STAGE_TIME_FIELDS}
        sizes = {f: tuple(_check_size(v, stage=i + 1, name=f) for i, v in
                          enumerate(getattr(self, f))) for f in _STAGE_SIZE_FIELDS}
        for f, v in {**times, **sizes}.items():
            object.__setattr__(self, f, v)
        object.__setattr__(self, "input_size",
                           _check_size(self.input_size, stage=None, name="input_size"))
        object.__setattr__(self, "loss_bwd_time",
                           _check_time(self.loss_bwd_time, stage=None, name="loss.bwd_time"))
        object.__setattr__(self, "loss_bwd_overhead",
                           _check_size(self.loss_bwd_overhead, stage=None,
                                       name="loss.bwd_overhead"))
        object.__setattr__(self, "loss_held",
                           _check_size(self.loss_held, stage=None, name="loss.held"))
        self._check_held()
        total = self.input_size + self.loss_bwd_overhead + sum(
            sum(getattr(self, f)) for f in _STAGE_SIZE_FIELDS if f not in _STAGE_OPTIONAL)
        if total > MAX_TOTAL_SIZE:
            raise ChainError(f"the sizes of the chain add up to {total}, above 2^50",
                             field="stages")
        if self.total_compute_time() > MAX_TOTAL_TIME:
            raise ChainError(f"the times of the chain add up to {self.total_compute_time():g}, "
                             f"above {MAX_TOTAL_TIME:g}", field="stages")
        for i, (a, abar) in enumerate(zip(self.output_size, self.saved_size, strict=True)):
            if abar < a:
                raise ChainError(
                    f"saved_size ({abar}) must be >= output_size ({a}): the tape includes a^i",
                    stage=i + 1, field="saved_size",
                )

    def _check_held(self) -> None:
        """Each held term is at most its op's overhead (so no op's own peak changes)."""
        for held, over in (("fwd_held", "fwd_overhead"), ("bwd_held", "bwd_overhead")):
            for i, (h, o) in enumerate(zip(getattr(self, held), getattr(self, over),
                                           strict=True)):
                if h > o:
                    raise ChainError(f"{held} ({h}) must be <= {over} ({o}): memory held "
                                     "after the op is part of its temporary memory",
                                     stage=i + 1, field=held)
        if self.loss_held > self.loss_bwd_overhead:
            raise ChainError(f"loss.held ({self.loss_held}) must be <= loss.bwd_overhead "
                             f"({self.loss_bwd_overhead})", field="loss.held")

    @functools.cached_property
    def holds(self) -> bool:
        """Whether any op leaves memory held between compute ops (a held term is not 0)."""
        return bool(self.loss_held or any(self.fwd_held) or any(self.bwd_held))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_lists(
        cls,
        fwd_time: Sequence[float],
        bwd_time: Sequence[float],
        output_size: Sequence[int],
        saved_size: Sequence[int],
        *,
        input_size: int,
        fwd_overhead: Sequence[int] | None = None,
        bwd_overhead: Sequence[int] | None = None,
        weight_size: Sequence[int] | None = None,
        loss_bwd_time: float = 0.0,
        loss_bwd_overhead: int = 0,
        name: str = "chain",
    ) -> Chain:
        """Build a chain from per-stage lists (overheads and weights default to 0)."""
        fwd_time = _as_tuple(fwd_time, name="fwd_time")
        n = len(fwd_time)
        return cls(
            fwd_time=tuple(fwd_time), bwd_time=tuple(bwd_time),
            output_size=tuple(output_size), saved_size=tuple(saved_size),
            fwd_overhead=tuple(fwd_overhead) if fwd_overhead is not None else (0,) * n,
            bwd_overhead=tuple(bwd_overhead) if bwd_overhead is not None else (0,) * n,
            weight_size=tuple(weight_size) if weight_size is not None else (0,) * n,
            input_size=input_size, loss_bwd_time=loss_bwd_time,
            loss_bwd_overhead=loss_bwd_overhead, name=name,
        )

    @classmethod
    def from_rotor(
        cls,
        fw: Sequence[float],
        bw: Sequence[float],
        x: Sequence[int],
        xbar: Sequence[int],
        ftmp: Sequence[int] | None = None,
        btmp: Sequence[int] | None = None,
        *,
        name: str = "chain",
    ) -> Chain:
        """Build a chain from the rotor code convention (digest ``rotor.md`` section 8).

        ``fw[0..L-1]``, ``bw[0..L]`` (``bw[L]`` is the loss), ``x[0..L]`` (``x[0]`` is the
        input), ``xbar[0..L]`` (``xbar[0]`` unused), ``ftmp[0..L-1]``, ``btmp[0..L]``.
        """
        fw, bw, x, xbar = (_as_tuple(v, name=name) for v, name in
                           ((fw, "fw"), (bw, "bw"), (x, "x"), (xbar, "xbar")))
        n = len(fw)
        ftmp = _as_tuple(ftmp, name="ftmp") if ftmp is not None else (0,) * n
        btmp = _as_tuple(btmp, name="btmp") if btmp is not None else (0,) * (n + 1)
        return cls.from_lists(
            fw, bw[:n], x[1:n + 1], xbar[1:n + 1], input_size=x[0] if x else 0,
            fwd_overhead=ftmp[:n], bwd_overhead=btmp[:n],
            loss_bwd_time=bw[n] if len(bw) > n else 0.0,
            loss_bwd_overhead=btmp[n] if len(btmp) > n else 0, name=name,
        )

    # ------------------------------------------------------------------ properties
    @property
    def length(self) -> int:
        """Number of stages ``L`` (the loss not included)."""
        return len(self.fwd_time)

    def store_all_peak(self) -> int:
        """Peak memory of the store-all plan (every F_all, Loss, every B).

        Closed form of the checkpoint simulator's accounting (CONTRACT section 3) for
        ``F_all 1..L, Loss, B L..1``, so that this value class imports no simulator:
        ``F_all i`` peaks at ``a^0 + abar^1..abar^i + o_f^i``; ``Loss`` at
        ``a^0 + abar^1..abar^L + delta^L + o_b^{L+1}``; ``B i`` at
        ``a^0 + abar^1..abar^i + delta^i + delta^{i-1} + o_b^i`` (``delta^0`` has the size
        of ``a^0``). ``tests/test_chain.py`` checks it against
        :func:`optmem.simulate.simulate_checkpoint` on random chains.

        Examples
        --------
        >>> Chain.from_rotor([1], [2, 0], [1, 1], [1, 2]).store_all_peak()
        5
        """
        L = self.length
        taped = [self.input_size]  # a^0 + abar^1..abar^i, i = 0..L
        for s in self.saved_size:
            taped.append(taped[-1] + s)
        grad = [self.input_size, *self.output_size]  # size of delta^i, i = 0..L
        peaks = [taped[i] + self.fwd_overhead[i - 1] for i in range(1, L + 1)]
        peaks.append(taped[L] + grad[L] + self.loss_bwd_overhead)
        peaks += [taped[i] + grad[i] + grad[i - 1] + self.bwd_overhead[i - 1]
                  for i in range(1, L + 1)]
        return int(max(peaks))

    def check_rate(self, bandwidth: float, *, field: str = "bandwidth") -> float:
        """Return ``bandwidth`` (memory units per time unit) if transfers stay in range.

        Moving the largest value of the chain must take at most ``MAX_TOTAL_TIME`` (the
        range of every time): beyond, transfer times overflow the exact models just as
        such stage times would. ``0`` (no link) and ``inf`` (free transfers) pass.

        Raises
        ------
        ChainError
            Naming ``field``, for a link too slow for this chain.

        Examples
        --------
        >>> c = Chain.from_lists([1], [1], [2**40], [2**40], input_size=0)
        >>> c.check_rate(2.0)
        2.0
        >>> c.check_rate(1.0)
        Traceback (most recent call last):
        ...
        optmem.errors.ChainError: field 'bandwidth': a bandwidth of 1 B per ms moves the \
largest value (1099511627776 B) in 1.09951e+12 ms, above 1e+12: too slow to model
        """
        if bandwidth == 0 or math.isinf(bandwidth):
            return bandwidth
        largest = max(self.input_size, *self.saved_size, *self.output_size)
        if largest / bandwidth > MAX_TOTAL_TIME:
            raise ChainError(
                f"a bandwidth of {bandwidth:g} {self.memory_unit} per {self.time_unit} moves "
                f"the largest value ({largest} {self.memory_unit}) in {largest / bandwidth:g} "
                f"{self.time_unit}, above {MAX_TOTAL_TIME:g}: too slow to model", field=field)
        return bandwidth

    def total_compute_time(self) -> float:
        """Sum of every forward, backward and the loss: a lower bound on any makespan."""
        return float(sum(self.fwd_time) + sum(self.bwd_time) + self.loss_bwd_time)

    # ------------------------------------------------------------------ transforms
    def map_sizes(self, fn: Callable[[int], int], *, memory_unit: str | None = None) -> Chain:
        """Return the chain with ``fn`` applied to every size (times and names unchanged).

        Every size field: the stages' ``output_size``, ``saved_size``, ``fwd_overhead``,
        ``bwd_overhead``, ``weight_size``, ``fwd_held``, ``bwd_held``, and ``input_size``,
        ``loss_bwd_overhead``, ``loss_held``. ``fn`` must be monotone (a held term stays at
        most its overhead).
        ``memory_unit`` renames the unit (kept by default).
        """
        sizes: dict[str, Any] = {f: tuple(map(fn, getattr(self, f))) for f in _STAGE_SIZE_FIELDS}
        return dataclasses.replace(
            self, **sizes, input_size=fn(self.input_size),
            loss_bwd_overhead=fn(self.loss_bwd_overhead), loss_held=fn(self.loss_held),
            memory_unit=self.memory_unit if memory_unit is None else memory_unit)

    def quantize(self, unit: int) -> Chain:
        """Return the chain with every size replaced by ``ceil(size / unit)`` (CONTRACT 2)."""
        if unit < 1:
            raise ChainError(f"the memory unit must be >= 1, got {unit}", field="unit")
        if unit == 1:
            return self
        return self.map_sizes(lambda v: -(-v // unit), memory_unit=f"{unit}*{self.memory_unit}")

    def scaled(self, *, time: float = 1.0, memory: int = 1) -> Chain:
        """Return the chain with times multiplied by ``time`` and sizes by ``memory``.

        Names, units and the unknown fields (``extra``, ``stage_extra``) are kept as they are.
        """
        return dataclasses.replace(
            self.map_sizes(lambda v: v * memory),
            fwd_time=tuple(v * time for v in self.fwd_time),
            bwd_time=tuple(v * time for v in self.bwd_time),
            loss_bwd_time=self.loss_bwd_time * time)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Return the ``optmem.chain/1`` dictionary of this chain (unknown fields kept)."""
        stages = []
        for i in range(self.length):
            stage: dict[str, Any] = dict(self.stage_extra[i])
            stage.update({
                "name": self.stage_names[i],
                "fwd_time": self.fwd_time[i], "bwd_time": self.bwd_time[i],
                "output_size": self.output_size[i], "saved_size": self.saved_size[i],
                "fwd_overhead": self.fwd_overhead[i], "bwd_overhead": self.bwd_overhead[i],
                "weight_size": self.weight_size[i],
            })
            stage.update({f: getattr(self, f)[i] for f in _STAGE_OPTIONAL if getattr(self, f)[i]})
            stages.append(stage)
        out: dict[str, Any] = dict(self.extra)
        out.update({
            "format": FORMAT, "name": self.name, "time_unit": self.time_unit,
            "memory_unit": self.memory_unit, "input_size": self.input_size, "stages": stages,
            "loss": {"bwd_time": self.loss_bwd_time, "bwd_overhead": self.loss_bwd_overhead,
                     **({"held": self.loss_held} if self.loss_held else {})},
        })
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> Chain:
        """Validate and build a chain from an ``optmem.chain/1`` dictionary.

        Raises
        ------
        ChainError
            With a message naming ``source``, the stage and the field.
        """
        try:
            return cls._from_dict(data)
        except ChainError as exc:
            raise exc.with_source(source) if source else exc from None

    @classmethod
    def _from_dict(cls, data: Any) -> Chain:
        if not isinstance(data, Mapping):
            raise ChainError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ChainError(f"expected \"{FORMAT}\", got {data.get('format')!r}", field="format")
        if "input_size" not in data:
            raise ChainError("missing required field", field="input_size")
        stages = data.get("stages")
        if not isinstance(stages, list) or not stages:
            raise ChainError("expected a non-empty list of stages", field="stages")
        columns: dict[str, list[Any]] = {f: [] for f in (*_STAGE_TIME_FIELDS, *_STAGE_SIZE_FIELDS)}
        names, extras = [], []
        for i, stage in enumerate(stages, start=1):
            if not isinstance(stage, Mapping):
                raise ChainError("expected a JSON object", stage=i)
            for f in _STAGE_REQUIRED:
                if f not in stage:
                    raise ChainError("missing required field", stage=i, field=f)
            for f in columns:
                columns[f].append(stage.get(f, 0))
            names.append(stage.get("name", f"stage{i}"))  # text, checked: never str()
            extras.append({k: v for k, v in stage.items() if k not in _STAGE_KNOWN})
        loss = data.get("loss", {})
        if not isinstance(loss, Mapping):  # 0 and false were taken as no loss until stop 51
            raise ChainError("expected an object with bwd_time and bwd_overhead", field="loss")
        return cls(
            **{f: tuple(v) for f, v in columns.items()},
            input_size=data["input_size"],
            loss_bwd_time=loss.get("bwd_time", 0.0),
            loss_bwd_overhead=loss.get("bwd_overhead", 0), loss_held=loss.get("held", 0),
            name=data.get("name", "chain"), time_unit=data.get("time_unit", "ms"),
            memory_unit=data.get("memory_unit", "B"), stage_names=tuple(names),
            extra={k: v for k, v in data.items() if k not in _TOP_KNOWN},
            stage_extra=tuple(extras),
        )

    def save(self, path: str | Path) -> None:
        """Write the chain as an ``optmem.chain/1`` JSON file (atomically)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Chain:
        """Read and validate a chain file; errors name the file, stage and field."""
        # NaN/Infinity literals parse to floats so that validation names stage and field.
        data = read_json(path, error=ChainError, what="chain file")
        return cls.from_dict(data, source=str(path))


def _default_names(n: int) -> tuple[str, ...]:
    return tuple(f"stage{i}" for i in range(1, n + 1))
