"""Profiling: measure a chain of stages into an ``optmem.chain/1`` :class:`~optmem.chain.Chain`.

What is measured for each stage ``i`` (digest ``rotor.md`` sections 1.2 and 6, rotor's
``measure_everything``, with the differences noted). Sizes are **exact and deterministic**:
two profiles of the same stages on the same input give the same bytes, on CPU, meta or CUDA.

* ``output_size``: bytes of the distinct storages behind the output tensors (a view keeps
  its whole storage alive), parameters excluded.
* ``saved_size``: the tape, from ``torch.autograd.graph.saved_tensors_hooks``: the distinct
  storages of every tensor autograd saves during the forward, excluding parameters,
  buffers and the stage input (a^{i-1}), plus the output storages (the tape includes a^i by
  definition, CONTRACT section 1).
* ``fwd_overhead``: the temporaries of a forward, measured at dispatch level by a
  :class:`~optmem.pytorch.memory.StorageTrace` (every storage an op creates, until it is
  freed). The chain model charges a forward ``stored + output + o_f``, with output the tape
  for ``F_all`` and ``a^i`` for ``F_ck``/``F_none``; so
  ``o_f = max(peak_grad - saved_size, peak_nograd - output_size, 0)`` where ``peak_grad``
  and ``peak_nograd`` are the traced peaks of a forward with and without grad recording.
* ``bwd_overhead``: the traced peak of the backward (``torch.autograd.backward`` of the
  stage outputs with all-ones gradients) minus ``delta^{i-1}`` (charged by the model, of
  the size of ``a^{i-1}``); weight gradients are not activations and are excluded. A
  parameter also used by a later stage (tied weights) already has a gradient when this
  stage's backward runs, so it is profiled that way: the in-place accumulation's temporary
  is counted.
* On CUDA, the overheads are the larger of the trace and rotor's allocator protocol
  (``torch.cuda.max_memory_allocated`` around each op, weight gradients allocated before
  the backward), so that cuDNN/cuBLAS workspaces and the allocator's rounding count.
* ``weight_size``: bytes of the stage's parameters.
* The loss: with ``loss_fn``, the loss stage is profiled like a stage (``loss.bwd_time`` is
  its forward+backward time, ``loss.bwd_overhead`` its traced peak minus ``delta^L``), so
  the memory limit covers it; without, it has time 0 and overhead 0, as in rotor.
* ``fwd_time``, ``bwd_time``: ``warmup`` untimed rounds, then ``repeats`` timed rounds; a
  round times every stage once (forward with grad recording, then its backward), so a
  burst of load on the machine spoils one sample of every stage rather than every sample
  of one stage; the median over rounds is kept. Stages that run the same kernels on the
  same shapes (a fingerprint of the dispatched ops, :class:`_OpLog`: the blocks of a
  transformer) pool their samples and get one time, since any difference between them is
  noise. Times are then rounded to ``time_resolution`` (relative) and to a multiple of
  ``2**-16`` ms, so that sums are exact (see :func:`round_time`). The clock: CUDA events
  on CUDA; on CPU the thread's CPU time (``time.thread_time``) when torch runs on one
  thread, which does not advance while the process waits for a core, so other processes'
  load does not inflate it; wall-clock (``perf_counter``) with several threads.

* ``segment_cost_ms`` (in ``extra["profile"]``): what a recomputed segment costs the
  executor beyond its stages' forward times; :data:`DEFAULT_SEGMENT_COST_MS` unless
  ``measure_segments=True`` measures it by running two plans that re-forward the same
  stages in one and in many segments (:mod:`optmem.pytorch.segments`); the bridge's
  checkpoint DP charges it per ``F_ck`` by default (``segment_cost_source`` says which).

``device="meta"`` profiles without running anything: the stages (copied to the meta device
unless already there) are run on meta tensors, which gives the same exact sizes for models
too large to instantiate. Times then come from ``time_model`` if given, else from a crude
roofline: ``max(flops / flops_per_s, bytes / bytes_per_s)``, FLOPs counted by
``torch.utils.flop_counter.FlopCounterMode`` for the forward and the backward.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.plan import parse_plan
from optmem.pytorch.execute import run_in_order
from optmem.pytorch.extract import Stage, extract_stages, merge_stages, value_tensors
from optmem.pytorch.hooks import generators_restored, module_generators
from optmem.pytorch.memory import (
    StorageTrace,
    buffers_restored,
    gradients_restored,
    input_bytes,
    storage_bytes,
    storage_key,
)
from optmem.pytorch.segments import (
    MIN_STAGES,
    SegmentCost,
    SegmentTimer,
    measure_segment_cost,
)

__all__ = ["DEFAULT_OP_OVERHEAD_MS", "DEFAULT_OP_OVERHEAD_RATIO", "DEFAULT_SEGMENT_COST_MS",
           "DEFAULT_TIME_RESOLUTION", "LossFn", "TimeModel", "model_name",
           "profile_chain", "profile_stages", "roofline_time_model", "round_time", "storage_key",
           "carried_generations_error", "merge_inplace_writers", "unshared_carried",
           "value_nbytes", "with_op_charge"]

TimeModel = Callable[[nn.Module, Any, Any], tuple[float, float]]
"""``time_model(stage_module, input, output) -> (fwd_ms, bwd_ms)``."""

LossFn = Callable[[Any], torch.Tensor]
"""``loss_fn(chain_output) -> scalar loss`` (targets closed over)."""

DEFAULT_FLOPS_PER_S = 1e13
DEFAULT_BYTES_PER_S = 1e12
DEFAULT_TIME_RESOLUTION = 1 / 64
"""Relative resolution of profiled times (about 1.6 %): see :func:`round_time`."""
DEFAULT_OP_OVERHEAD_MS = 0.5
"""The executor's own cost of one forward op (ms), added to every measured ``fwd_time``.

The chain counts the kernels of a stage; running one ``F`` op through
:class:`~optmem.pytorch.execute.CheckpointedChain` also costs Python and autograd work
(context re-entry, RNG state, a taped source, an unfused backward call) that the profile
does not see. Every stage runs at least one ``F``, so the constant shifts every plan by the
same ``L * c`` plus ``c`` per re-forward: the solver sees that a re-forward of a tiny stage
(a LayerNorm, 0.04 ms of kernels) is not free. Measured on this project's CPU (one
thread, shared machine): 0.07 ms per re-forward of tiny ``Linear(8, 8)`` stages, 0.55 ms
per re-forwarded stage of BERT's exported chain, its unfused backward call included
(``docs/pytorch.md``, "What the chain counts").
"""
DEFAULT_OP_OVERHEAD_RATIO = 0.0
"""The executor's cost of one forward op in proportion to the stage's kernels.

The charge per ``F`` op of a stage with measured forward ``t`` is ``op_overhead +
op_overhead_ratio * t`` (ms): its ``fwd_time`` is ``t * (1 + op_overhead_ratio) +
op_overhead``, rounded to the profile's time resolution. A constant, not a measurement, so
that two profiles of one model give one plan (issue 13 item 4). What an extra re-forward
costs beyond its profiled kernels grows with the stage on bench_hf's models (about 0.05 ms
on BERT's small stages, 0.4-0.5 ms, about +20 % of the kernels, on GPT-2's ten times
larger ones: ``docs/pytorch.md``, "What the chain counts"). The default stays 0: the
candidate ``0.05 ms + 0.2 * t`` gave faster plans on BERT but slower ones on GPT-2 and
Llama at one bench_hf memory each in interleaved runs (same section).
"""
DEFAULT_SEGMENT_COST_MS = 1.0
"""What one recomputed segment costs the executor beyond its stages' forward times (ms).

Recorded as ``chain.extra["profile"]["segment_cost_ms"]`` on chains with measured times and
at least 3 stages unless ``measure_segments`` asks for a measurement (``True``) or for none
(``False``: 0, rotor's model). A constant by default, like :data:`DEFAULT_OP_OVERHEAD_MS`, so
that two profiles of one model give the same plan: the measurement
(:func:`~optmem.pytorch.segments.measure_segment_cost`) is a difference of two noisy train
steps, and on 2 loaded cores it gave 0-1.6 ms for BERT in eight profiles
(``benchmarks/results/hf_segment.md``). 1.0 ms is the figure of the quiet diagnosis
(1.1-1.3 ms per extra segment on BERT, ``benchmarks/results/hf_bert_diagnosis.md``) rounded
down, and the value with which bench_hf's worst ratio improved on GPT-2, Llama and BERT in
the same interleaved rounds.
"""


# ------------------------------------------------------------------ sizes
def value_nbytes(value: Any) -> int:
    """Bytes of the tensors of a value, from shapes (``numel * element_size``)."""
    return sum(t.numel() * t.element_size() for t in value_tensors(value))


def _weight_nbytes(module: nn.Module) -> int:
    return storage_bytes(list(module.parameters()))


def _persistent_keys(modules: Sequence[nn.Module]) -> set[int]:
    return {storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}


def _leaf(value: Any, requires_grad: bool) -> Any:
    """Detached copy of ``value`` whose floating tensors require grad when asked."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t
    if isinstance(value, tuple | list):
        return type(value)(_leaf(v, requires_grad) for v in value)
    if isinstance(value, dict):
        return {k: _leaf(v, requires_grad) for k, v in value.items()}
    return value


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _to_meta(value: Any) -> Any:
    return _map_tensors(value, lambda t: torch.empty_like(t, device="meta").requires_grad_(
        t.requires_grad))


def move_to(value: Any, dev: torch.device) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) moved to ``dev``."""
    return _map_tensors(value, lambda t: t.to(dev))


def _rng_devices(dev: torch.device) -> list[int]:
    """The CUDA devices whose RNG state a profile on ``dev`` forks (none off CUDA)."""
    if dev.type != "cuda":
        return []
    return [dev.index if dev.index is not None else torch.cuda.current_device()]


def _returned_beside_loss(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The last stage's outputs returned beside a loss: none unless a scalar is returned.

    When the chain output holds a 0-dimensional floating tensor that requires grad (the
    loss of an HF model called with ``labels=``), that is what the backward starts from;
    the other tensors (the logits) are returned for inspection and get no gradient.
    """
    if len(outs) < 2 or not any(_is_loss(t) for t in outs):
        return []
    return [t for t in outs if not _is_loss(t)]


def _is_loss(t: torch.Tensor) -> bool:
    return t.dim() == 0 and t.requires_grad and t.is_floating_point()


def _grad_targets(out: Any, skip: set[int] | frozenset[int] = frozenset()
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs that get a gradient (all-ones), those on storages in ``skip`` left out."""
    outs = [t for t in value_tensors(out) if t.requires_grad and storage_key(t) not in skip]
    return outs, [torch.ones_like(t) for t in outs]


def _clear_grads(value: Any) -> None:
    for t in value_tensors(value):
        t.grad = None


# ------------------------------------------------------------------ timing
TIME_QUANTUM_EXPONENT = 16
"""Profiled times are multiples of ``2**-16`` ms (15 ns): see :func:`round_time`."""


def round_time(t: float, resolution: float) -> float:
    """Round a time ``t >= 0`` to a relative ``resolution``, then to a multiple of ``2**-16``.

    ``t > 0`` goes to the nearest point of the grid ``(1 + resolution)**k`` (k integer), a
    relative resolution: the result is within a factor ``sqrt(1 + resolution)`` of ``t``, and
    two measurements closer than the grid's spacing get the same value unless a grid point
    falls between them (``resolution = 0`` skips this). Then it is rounded to a multiple of
    ``2**-16`` (in the chain's unit, ms): sums of such numbers are exact in floating point
    (below ``2**37`` ms), so two plans that run the same ops in another order cost exactly
    the same, and a solver breaks such ties the same way whatever the measured values.

    Examples
    --------
    >>> round_time(1.0, 0.25), round_time(1.1, 0.25), round_time(1.2, 0.25)
    (1.0, 1.0, 1.25)
    >>> round_time(0.1, 0) * 2**16
    6554.0
    """
    if not math.isfinite(t) or t <= 0:
        return max(0.0, float(t)) if math.isfinite(t) else float(t)
    if resolution > 0:
        step = math.log1p(resolution)
        t = math.exp(round(math.log(t) / step) * step)
    return math.ldexp(round(math.ldexp(t, TIME_QUANTUM_EXPONENT)), -TIME_QUANTUM_EXPONENT)


class _Timer:
    """Milliseconds of ``fn()``: CUDA events, the thread's CPU time, or the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cpu_time = not self.cuda and torch.get_num_threads() == 1
        self.clock = "cuda events" if self.cuda else (
            "thread cpu time" if self.cpu_time else "wall clock")

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            # on the profiled device's stream: ``record()`` and ``synchronize()`` without one
            # take the current device's, which times nothing when the stages run on another
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            value = fn()
            end.record(stream)
            torch.cuda.synchronize(self.device)
            return float(start.elapsed_time(end)), value
        clock = time.thread_time_ns if self.cpu_time else time.perf_counter_ns
        t0 = clock()
        value = fn()
        return (clock() - t0) / 1e6, value


def roofline_time_model(flops_per_s: float = DEFAULT_FLOPS_PER_S,
                        bytes_per_s: float = DEFAULT_BYTES_PER_S) -> Callable[..., float]:
    """``time_ms(flops, nbytes)`` of a crude roofline: ``max(flops/F, bytes/B)``."""

    def time_ms(flops: float, nbytes: float) -> float:
        return 1e3 * max(flops / flops_per_s, nbytes / bytes_per_s)

    return time_ms


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and total > 1
        self.enabled = enabled

    def update(self, done: int, label: str) -> None:
        if not self.enabled:
            return
        width = 30
        fill = int(width * done / max(1, self.total))
        self.stream.write(f"\rprofiling [{'#' * fill}{'.' * (width - fill)}] "
                          f"{done}/{self.total} {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class _NullContext:
    def __enter__(self) -> _NullContext:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _flop_counter(enabled: bool) -> Any:
    if not enabled:
        return _NullContext()
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


class _OpLog(TorchDispatchMode):
    """Fingerprint of the kernels a stage runs: op names, tensor shapes, dtypes, strides.

    Two stages with the same fingerprint compute the same thing on the same shapes (the
    blocks of a transformer, the repeated units of a ResNet group), so they cost the same:
    their timing samples are pooled and they get one time (:func:`_time_rounds`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.digest = hashlib.sha1()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        leaves = tree_leaves((args, kwargs or {}))
        self.digest.update(repr((str(func), tuple(_describe(v) for v in leaves))).encode())
        return func(*args, **(kwargs or {}))


def _describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), str(v.dtype), tuple(v.stride()) if v.layout == torch.strided
                else str(v.layout))
    if v is None or isinstance(v, bool | int | float | str | torch.dtype | torch.device |
                               torch.layout | torch.memory_format):
        return repr(v)
    return type(v).__name__


# ------------------------------------------------------------------ memory of one stage
@dataclass
class _Setting:
    """What every stage's measurement shares."""

    persistent: set[int]
    meta: bool
    cuda: bool
    count_flops: bool
    device: torch.device = torch.device("cpu")  # the profiled device (its allocator's stats)


@dataclass
class _StageMemory:
    output_size: int
    saved_size: int
    fwd_overhead: int
    bwd_overhead: int
    fwd_flops: float
    bwd_flops: float
    has_bwd: bool
    out: Any
    signature: str
    alias: int = 0  # bytes of input storages left out of output_size (last stage only)
    # values passed through unchanged: storage -> (bytes, gets a gradient)
    carried: dict[int, tuple[int, bool]] = field(default_factory=dict)
    tape_size: int = 0  # what autograd saved (outputs included), before the max with a^i
    in_size: int = 0  # the size of a^{i-1} the overheads were measured against
    peaks: dict[str, int] = field(default_factory=dict)  # raw traced peaks (_shared)


def _stage_memory(module: nn.Module, x: Any, in_size: int, tied: Sequence[nn.Parameter],
                  s: _Setting, last: bool = False) -> _StageMemory:
    """Sizes and traced temporaries of one stage on its leaf input ``x``.

    ``in_size`` is the chain's size of ``a^{i-1}`` (the model charges ``delta^{i-1}`` that
    much); ``tied`` are the stage's parameters that a later stage also uses; ``last``: the
    stage is the last one (its output is the chain output, whose gradient is the loss's).

    Outputs that share a storage with the input (a pass-through: an HF model's last stage
    returns the loss and the logits it received) are not counted again in the tape, since
    the tape is pinned to ``a^{i-1}`` (CONTRACT section 5); in the last stage's output they
    are not counted either (``alias`` reports them, for :func:`~optmem.pytorch.memory.
    plan_allowance`).
    """
    excluded = s.persistent | {storage_key(t) for t in value_tensors(x)}
    versions = {storage_key(t): t._version for t in value_tensors(x)}
    saved: dict[int, int] = {}
    tape: list[weakref.ref[torch.Tensor]] = []  # what autograd saved, to watch it go

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            key = storage_key(t)
        except (RuntimeError, NotImplementedError):  # e.g. sparse tensors
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            nbytes = int(t.untyped_storage().nbytes())
        if key not in excluded:
            saved[key] = nbytes
            tape.append(weakref.ref(t))
        return t

    counter = _flop_counter(s.count_flops)
    trace_f = StorageTrace(excluded)
    oplog = _OpLog()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _identity), \
            trace_f, counter, oplog:
        out = module(x)
    fwd_flops = float(counter.get_total_flops()) if s.count_flops else 0.0
    out_tensors = value_tensors(out)
    if not out_tensors:
        raise OptmemInputError("the stage returns no tensor", field="module")
    side = _returned_beside_loss(out_tensors) if last else []
    kept = [t for t in out_tensors if not any(t is u for u in side)]
    for t in kept:
        key = storage_key(t)
        if key not in excluded:  # an output aliasing the input is a^{i-1}, kept anyway
            saved[key] = int(t.untyped_storage().nbytes())
    output_size = storage_bytes(out, s.persistent)
    alias = output_size - storage_bytes(kept, excluded)
    carried = {} if last else _passed_through(out_tensors, versions, s.persistent)
    if last:  # the chain output: its input aliases are a^{L-1}, held until B L
        output_size -= alias
    tape_size = sum(saved.values())
    saved_size = max(tape_size, output_size)
    trace_n = StorageTrace(excluded)
    with torch.no_grad(), trace_n:
        module(x)
    peaks = {"fwd": trace_f.peak(), "no_grad": trace_n.peak()}
    fwd_overhead = max(0, peaks["fwd"] - saved_size, peaks["no_grad"] - output_size)

    outs, grads = _grad_targets(kept, excluded if last else frozenset())
    bwd_overhead, bwd_flops = 0, 0.0
    if outs:
        for p in tied:  # a later stage's backward accumulated into it already
            p.grad = torch.zeros_like(p)
        known = s.persistent | {storage_key(p.grad) for p in tied}  # type: ignore[arg-type]
        counter = _flop_counter(s.count_flops)
        trace_b = StorageTrace(known)
        # the tape is charged whole by the model at B i, and autograd frees it node by node
        # while the backward allocates: the trace holds it and watches it go
        trace_b.hold([t for t in (r() for r in tape) if t is not None]
                     + [t for t in kept if storage_key(t) not in excluded])
        held = trace_b.alive()
        with trace_b, counter, oplog:
            torch.autograd.backward(outs, grads)
        bwd_flops = float(counter.get_total_flops()) if s.count_flops else 0.0
        wgrads = [p.grad for p in module.parameters() if p.grad is not None]
        peaks["bwd"] = trace_b.peak(exclude=wgrads) - held
        bwd_overhead = max(0, peaks["bwd"] - in_size)
        del wgrads
        _clear_grads(list(module.parameters()))
        _clear_grads(x)
    has_bwd = bool(outs)
    del outs, grads
    if s.cuda:
        f_cuda, b_cuda = _cuda_overheads(module, x, saved_size, output_size, in_size,
                                        s.device)
        fwd_overhead, bwd_overhead = max(fwd_overhead, f_cuda), max(bwd_overhead, b_cuda)
        peaks.update(cuda_fwd=f_cuda, cuda_bwd=b_cuda)
    return _StageMemory(output_size, saved_size, fwd_overhead, bwd_overhead, fwd_flops,
                        bwd_flops, has_bwd, _leaf(out, False), oplog.digest.hexdigest(),
                        alias if last else 0, carried, tape_size, in_size, peaks)


def _shared(row: _StageMemory, strip_out: int, strip_in: int, strip_tape: int,
            fwd_charge: int, bwd_charge: int) -> _StageMemory:
    """``row`` with carried values left out of its output, its tape and its input.

    ``strip_out`` bytes leave its output, ``strip_tape`` its tape (the stage making a
    value: its outputs are part of its tape), ``strip_in`` its input (``delta^{i-1}``):
    the sizes and overheads :func:`_stage_memory` would give with those sizes (the CUDA
    allocator's overheads, measured at the full sizes, grow by what was left out: an
    upper bound), then the charges (:func:`_share_carried`) added to the overheads.
    """
    if not strip_out and not strip_in:
        return dataclasses.replace(row, fwd_overhead=row.fwd_overhead + fwd_charge,
                                   bwd_overhead=row.bwd_overhead + bwd_charge)
    p = row.peaks
    out = row.output_size - strip_out
    saved = max(row.tape_size - strip_tape, out)
    fwd = max(0, p["fwd"] - saved, p["no_grad"] - out)
    bwd = max(0, p["bwd"] - (row.in_size - strip_in)) if "bwd" in p else 0
    if "cuda_fwd" in p:
        fwd = max(fwd, p["cuda_fwd"] + strip_out)
        bwd = max(bwd, p["cuda_bwd"] + strip_in) if row.has_bwd else bwd
    return dataclasses.replace(row, output_size=out, saved_size=saved,
                               fwd_overhead=fwd + fwd_charge, bwd_overhead=bwd + bwd_charge)


def _passed_through(outs: Sequence[torch.Tensor], versions: dict[int, int],
                    persistent: set[int]) -> dict[int, tuple[int, bool]]:
    """Output storages that are input storages the stage did not write: carried values.

    A value read across layers crosses each boundary beside the boundary's own value
    (``graphcut.long_lived``, a skip tensor in a tuple): it is one storage, which every
    boundary holding it would count again. Returns ``{storage key: (bytes, gets a
    gradient)}``. An in-place stage (``ReLU(inplace=True)``) bumps the input's version:
    its output is new data, not a carried value; the first output is the boundary itself
    (an identity stage passes it through, and it is no long-lived value).
    """
    found: dict[int, tuple[int, bool]] = {}
    first = storage_key(outs[0]) if outs else None
    for t in outs[1:]:
        key = storage_key(t)
        if key in versions and key not in persistent and key != first \
                and t._version == versions[key]:
            found[key] = (int(t.untyped_storage().nbytes()),
                          t.requires_grad and (t.is_floating_point() or t.is_complex()))
    return found


class _CudaPeak:
    """``torch.cuda.max_memory_allocated`` of ``device`` above its allocation at entry.

    Synchronised. The device is explicit: the statistics of ``device=None`` are the current
    device's, not those of a profile on another one (``cuda:1``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.base


def _cuda_overheads(module: nn.Module, x: Any, saved_size: int, output_size: int,
                    in_size: int, device: torch.device) -> tuple[int, int]:
    """Rotor's allocator protocol: peaks of the CUDA caching allocator around each op.

    Counts what the trace cannot see (cuDNN/cuBLAS workspaces, the allocator's rounding to
    512-byte blocks). The weight gradients are allocated before the backward, as rotor does,
    so that they are not part of its peak; the temporary of each accumulation then is
    (conservative when gradients start at ``None``). The statistics are ``device``'s.
    """
    with torch.no_grad(), _CudaPeak(device) as nograd:
        module(x)
    with torch.enable_grad(), _CudaPeak(device) as grad:
        out = module(x)
    fwd = max(0, grad.peak - saved_size, nograd.peak - output_size)
    outs, grads = _grad_targets(out)
    bwd = 0
    if outs:
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        with _CudaPeak(device) as back:
            torch.autograd.backward(outs, grads)
        bwd = max(0, back.peak - in_size)
        _clear_grads(list(module.parameters()))
        _clear_grads(x)
    return fwd, bwd


def _loss_memory(loss_fn: LossFn, y: Any, out_size: int, s: _Setting) -> int:
    """``loss.bwd_overhead``: traced peak of the loss forward+backward minus ``delta^L``."""
    x = _leaf(y, True)
    trace = StorageTrace(s.persistent | {storage_key(t) for t in value_tensors(x)})
    with torch.enable_grad(), trace:
        loss = loss_fn(x)
        if loss.requires_grad:
            torch.autograd.backward(loss)
    del loss
    _clear_grads(x)
    return max(0, trace.peak() - out_size)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# ------------------------------------------------------------------ times
def _time_rounds(modules: Sequence[nn.Module], inputs: Sequence[Any], classes: Sequence[str],
                 timer: _Timer, repeats: int, warmup: int, loss_fn: LossFn | None,
                 loss_input: Any) -> tuple[list[float], list[float], float]:
    """Median forward / backward times of every stage (and the loss), by interleaved rounds.

    Stages of one class (same kernel fingerprint, :class:`_OpLog`) pool their samples and
    get the same median.
    """
    fwd: dict[str, list[float]] = {c: [] for c in classes}
    bwd: dict[str, list[float]] = {c: [] for c in classes}
    loss_times: list[float] = []
    for r in range(warmup + repeats):
        for module, x, cls in zip(modules, inputs, classes, strict=True):
            def forward(m: nn.Module = module, v: Any = x) -> Any:
                with torch.enable_grad():
                    return m(v)

            f_ms, out = timer(forward)
            outs, grads = _grad_targets(out)
            b_ms = (timer(lambda o=outs, g=grads: torch.autograd.backward(o, g))[0]  # type: ignore[misc]
                    if outs else 0.0)
            del out, outs, grads
            _clear_grads(list(module.parameters()))
            _clear_grads(x)
            if r >= warmup:
                fwd[cls].append(f_ms)
                bwd[cls].append(b_ms)
        if loss_fn is not None:
            def loss_step() -> None:
                with torch.enable_grad():
                    loss = loss_fn(loss_input)
                    if loss.requires_grad:
                        torch.autograd.backward(loss)

            ms = timer(loss_step)[0]
            _clear_grads(loss_input)
            if r >= warmup:
                loss_times.append(ms)
    med = statistics.median
    return ([float(med(fwd[c])) for c in classes], [float(med(bwd[c])) for c in classes],
            float(med(loss_times)) if loss_times else 0.0)



def _profile_device(modules: Sequence[nn.Module], device: str | torch.device | None,
                    inputs: Sequence[torch.Tensor]) -> torch.device:
    """Where a profile runs: ``device`` (default the sample's), a bare ``cuda`` made exact.

    ``torch.device("cuda")`` is the *current* device wherever it is used (``.to``,
    ``current_stream``, ``synchronize``), while ``"cuda"`` stands for any CUDA device when
    the weights are checked (:func:`_check_weights_on`). Before, a model on ``cuda:1``
    profiled with ``device="cuda"`` (current device 0) passed the check, then had its
    sample moved to ``cuda:0`` (PyTorch's device mismatch in the first stage, even for a
    sample already on ``cuda:1``), and its events and RNG taken on ``cuda:0``. A bare
    ``cuda`` is now the device of the first CUDA weight (without one it stays bare: the
    check refuses weights elsewhere, and a model without weights runs on the current device).
    """
    dev = torch.device(device) if device is not None else inputs[0].device
    if dev.type != "cuda" or dev.index is not None:
        return dev
    return next((t.device for m in modules for t in (*m.parameters(), *m.buffers())
                 if t.is_cuda), dev)


def _check_weights_on(modules: Sequence[nn.Module], dev: torch.device) -> None:
    """Refuse to move the sample to ``dev`` when none of the stages' weights is there.

    The profile moves the sample only (it leaves the caller's model where it is): a model on
    the CPU profiled with ``device="cuda"`` failed in its first stage with PyTorch's
    device mismatch (or, without CUDA, "Torch not compiled with CUDA enabled"). A model
    placing some weights elsewhere on purpose (an embedding kept on the CPU) is accepted as
    long as one of them is on ``dev`` (``"cuda"`` stands for any CUDA device).
    """
    held = [t.device for m in modules for t in (*m.parameters(), *m.buffers())]
    if held and not any(d.type == dev.type and dev.index in (None, d.index) for d in held):
        raise OptmemInputError(
            f"the model's weights are on {held[0]}, the profile's device is {dev}: move the "
            f"model there first (model.to({str(dev)!r})); the profile moves the sample only",
            field="device")


# ------------------------------------------------------------------ profiling
def profile_stages(
    stages: Sequence[Stage],
    sample: Any,
    *,
    device: str | torch.device | None = None,
    repeats: int = 5,
    warmup: int = 1,
    name: str = "torch",
    progress: bool | None = None,
    time_model: TimeModel | None = None,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    bytes_per_s: float = DEFAULT_BYTES_PER_S,
    loss_fn: LossFn | None = None,
    time_resolution: float = DEFAULT_TIME_RESOLUTION,
    pool_identical: bool = True,
    op_overhead: float = DEFAULT_OP_OVERHEAD_MS,
    measure_segments: bool | None = None,
    segment_timer: SegmentTimer | None = None,
    op_overhead_ratio: float = DEFAULT_OP_OVERHEAD_RATIO,
) -> Chain:
    """Profile already extracted stages on ``sample``; see :func:`profile_chain`."""
    if repeats < 1 or warmup < 0:
        raise OptmemInputError(f"expected repeats >= 1 and warmup >= 0, got {repeats}, {warmup}",
                               field="repeats")
    if not (time_resolution >= 0 and math.isfinite(time_resolution)):
        raise OptmemInputError(f"expected time_resolution >= 0, got {time_resolution}",
                               field="time_resolution")
    _check_charge("op_overhead", op_overhead, "ms")
    _check_charge("op_overhead_ratio", op_overhead_ratio, "of a stage's forward time")
    inputs = value_tensors(sample)
    if not inputs:
        raise OptmemInputError("the sample input holds no tensor", field="sample")
    modules = [s.module for s in stages]
    dev = _profile_device(modules, device, inputs)
    meta = dev.type == "meta"
    if meta:
        modules = [m if all(p.is_meta for p in m.parameters()) else copy.deepcopy(m).to("meta")
                   for m in modules]
        sample = _to_meta(sample)
    elif dev != inputs[0].device:
        _check_weights_on(modules, dev)
        sample = move_to(sample, dev)
    setting = _Setting(_persistent_keys(modules), meta, dev.type == "cuda",
                       count_flops=meta and time_model is None, device=dev)
    timer = _Timer(dev)

    params = [p for m in modules for p in m.parameters()]
    bar = _Progress(len(stages), progress)
    fork_devices = _rng_devices(dev)
    try:
        with torch.random.fork_rng(devices=fork_devices, enabled=True), \
                generators_restored(module_generators(modules)), gradients_restored(params), \
                buffers_restored(modules if not meta else []):  # only what changed
            for p in params:  # backward would accumulate into the caller's gradients otherwise
                p.grad = None
            rows, leaves, last = _profile_memory(modules, stages, sample, setting, bar)
            rows, carried = _share_carried(rows, input_bytes(sample))
            loss_overhead = _loss_memory(loss_fn, last, rows[-1].output_size, setting) \
                if loss_fn is not None else 0
            bar.update(len(stages), "timing")
            if not pool_identical:
                for k, row in enumerate(rows):
                    row.signature = f"{k}:{row.signature}"
            fwd_time, bwd_time, loss_time = _stage_times(
                modules, leaves, rows, setting, timer, repeats, warmup, time_model,
                roofline_time_model(flops_per_s, bytes_per_s), loss_fn, last)
            segments = None
            if measure_segments is True and not meta and len(stages) >= MIN_STAGES \
                    and (time_model is None or segment_timer is not None):
                segments = measure_segment_cost(
                    stages, sample, segment_timer or (lambda fn: timer(fn)[0]),
                    repeats=2 * repeats + 1, warmup=warmup)
            bar.update(len(stages), "done")
    finally:
        bar.close()
    times = "time_model" if time_model is not None else ("roofline" if meta else "measured")
    q = (lambda t: round_time(t, time_resolution)) if times == "measured" else float
    per_op = op_overhead if times == "measured" else 0.0
    ratio = op_overhead_ratio if times == "measured" else 0.0
    segment_ms, segment_source = _segment_cost(segments, measure_segments,
                                               times == "measured" and len(stages) >= MIN_STAGES)
    return Chain(
        fwd_time=tuple(q(_charged(t, per_op, ratio)) for t in fwd_time),
        bwd_time=tuple(q(t) for t in bwd_time),
        output_size=tuple(r.output_size for r in rows),
        saved_size=tuple(r.saved_size for r in rows),
        fwd_overhead=tuple(r.fwd_overhead for r in rows),
        bwd_overhead=tuple(r.bwd_overhead for r in rows),
        weight_size=tuple(_weight_nbytes(m) for m in modules),
        input_size=input_bytes(sample), loss_bwd_time=q(loss_time) if loss_time else 0.0,
        loss_bwd_overhead=loss_overhead + carried.get("carried_reserve", 0), name=name,
        time_unit="ms", memory_unit="B", stage_names=tuple(s.name for s in stages),
        extra={"profile": {
            "device": str(dev), "repeats": repeats, "warmup": warmup,
            "torch": torch.__version__, "times": times,
            "overheads": ("dispatch trace + cuda allocator" if setting.cuda
                          else "dispatch trace"),
            "clock": timer.clock if times == "measured" else None,
            "time_resolution": time_resolution if times == "measured" else 0.0,
            "op_overhead_ms": per_op,
            "op_overhead_ratio": ratio,
            "segment_cost_ms": q(segment_ms) if segment_ms else 0.0,
            "segment_cost_source": segment_source,
            "segment_cost": segments.as_dict() if segments is not None else None,
            "time_classes": len({r.signature for r in rows}) if times == "measured" else None,
            "loss": "loss_fn" if loss_fn is not None else "not profiled",
            "output_left_out": [r.alias for r in rows],
            **carried}},
    )


def _share_carried(rows: Sequence[_StageMemory], input_size: int
                   ) -> tuple[list[_StageMemory], dict[str, Any]]:
    """Count the values carried up to the loss once, not in every boundary holding them.

    A value read across layers crosses each boundary beside the boundary's own value
    (``graphcut.long_lived``: an encoder's output read by every decoder layer; a skip
    tensor in a tuple). It is one storage, which each stored boundary would count again.
    A value carried by at least half of the stages from the first one that passes it on
    to the last (an encoder's output through the decoder) is left out of the boundaries'
    sizes (and out of the tape of the stage making it) and counted once in the overheads,
    its gradient (one storage the backward accumulates into) too when it gets one:

    * the backward of the stage making it and of every later one, and the loss: value
      and gradient;
    * the forward of a stage after the one making it: value and gradient (the gradient
      lives while the backward re-runs stages);
    * the forward of the stage making it (whose traced overhead holds the value it makes)
      or of an earlier one: the gradient only. An earlier stage runs before the value
      exists or, in the backward, once no stored value holds it any more: plans that
      re-run from the latest stored value (rotor's DPs) never run it while the value is
      held (:func:`carried_generations_error` refuses the others).

    An upper bound: the gradient is counted in the first forward too. Values carried
    across a shorter part of the chain (T5's position bias within its encoder) stay
    counted in each boundary: a charge through the whole step would cost more. And the
    values are shared only when that lowers the chain's store-all peak (with ``input_size``
    the chain input's bytes): where the charges cost more than the boundaries saved
    (Gemma 3 with its vision tower, whose image features are made late in a short chain),
    every boundary keeps counting them.

    Returns the rows (their overheads charged) and the profile's keys: the bytes left out
    of each stage's output and tape, the charges added to each stage's forward and
    backward overheads and to the loss's, and each shared value's stage that makes it and
    first and last stage whose output holds it (1-based); no keys without shared values.
    """
    passes: dict[int, list[int]] = {}
    for k, row in enumerate(rows):
        for key in row.carried:
            passes.setdefault(key, []).append(k)
    shared = {key: value for k, row in enumerate(rows) for key, value in row.carried.items()
              if 2 * len(passes[key]) >= len(rows) - passes[key][0]}
    if not shared:
        return list(rows), {}
    made = {key: passes[key][0] for key in shared}  # 1-based: the stage before the first
    strips = [sum(n for k, (n, _) in row.carried.items() if k in shared) for row in rows]
    tapes = [0] * len(rows)
    for key, (n, _) in shared.items():
        if made[key] >= 1:  # the value is an output of stage made (not the chain input)
            strips[made[key] - 1] += n
            tapes[made[key] - 1] += n
    fwd = [sum((n if k + 1 > made[key] else 0) + (n if grad else 0)
               for key, (n, grad) in shared.items()) for k in range(len(rows))]
    bwd = [sum(n * (2 if grad else 1) for key, (n, grad) in shared.items()
               if k + 1 >= made[key]) for k in range(len(rows))]
    reserve = sum(n * (2 if grad else 1) for n, grad in shared.values())
    out = [_shared(row, strips[k], strips[k - 1] if k else 0, tapes[k], fwd[k], bwd[k])
           for k, row in enumerate(rows)]
    if _store_all_peak(out, reserve, input_size) >= _store_all_peak(rows, 0, input_size):
        return list(rows), {}
    keys = {"carried_left_out": strips,
            "carried_saved_left_out": [r.saved_size - o.saved_size
                                       for r, o in zip(rows, out, strict=True)],
            "carried_fwd": fwd, "carried_bwd": bwd, "carried_reserve": reserve,
            "carried_ranges": sorted({(made[key], passes[key][0] + 1, passes[key][-1] + 1)
                                      for key in shared})}
    return out, keys


def _store_all_peak(rows: Sequence[_StageMemory], loss: int, input_size: int) -> int:
    """The store-all peak of ``rows``, the loss's overhead ``loss``."""
    n = len(rows)
    return Chain.from_lists(
        [1.0] * n, [1.0] * n, [r.output_size for r in rows], [r.saved_size for r in rows],
        input_size=input_size, fwd_overhead=[r.fwd_overhead for r in rows],
        bwd_overhead=[r.bwd_overhead for r in rows], loss_bwd_overhead=loss).store_all_peak()


def carried_generations_error(chain: Chain, plan: Sequence[Any]) -> str | None:
    """Why ``plan`` does not fit a chain that counts its carried values once, or ``None``.

    Counting a carried value once (:func:`_share_carried`) assumes that no stage up to
    the one making it runs while the output of that stage or of a later one holds it (a
    forward before the maker does not count the value; a re-run of the maker would make
    a second copy). Plans that re-run from the latest stored value (rotor's DPs) never
    do; a plan that does is refused (``chain.extra["profile"]["carried_ranges"]``: the
    stage making each shared value and the first and last stage whose output holds it,
    1-based).

    Examples
    --------
    >>> chain = Chain.from_lists([1.0] * 3, [1.0] * 3, [4] * 3, [4] * 3, input_size=4)
    >>> chain = dataclasses.replace(chain, extra={"profile": {"carried_ranges": [[1, 2, 2]]}})
    >>> carried_generations_error(chain, ["F_ck 1", "F_ck 2", "F_all 3", "Loss", "B 3",
    ...                                   "F_all 2", "B 2", "F_all 1", "B 1"]) is None
    True
    >>> carried_generations_error(chain, ["F_ck 1", "F_none 2", "F_all 1", "F_all 3",
    ...                                   "Loss", "B 3", "F_all 2", "B 2", "B 1"])
    'op 2 (F_all 1) re-runs a stage up to the one making a carried value while a^2 holds it'
    """
    from optmem.simulate.checkpoint import initial_state, transition

    ranges = ((chain.extra or {}).get("profile") or {}).get("carried_ranges") or ()
    if not ranges:
        return None
    stored = initial_state()
    for k, op in enumerate(parse_plan(plan)):
        for made, _, last in ranges if op.kind.name.startswith("F") else ():
            held = sorted(f"{kind}^{s}" for kind, s in stored
                          if kind != "delta" and made <= s <= last)
            if op.stage <= made and held:
                return (f"op {k} ({op}) re-runs a stage up to the one making a carried "
                        f"value while {held[0]} holds it")
        stored = transition(chain, stored, op)[0]
    return None


def unshared_carried(chain: Chain) -> Chain:
    """``chain`` with its carried values counted in every boundary that holds them again.

    :func:`profile_stages` counts the values carried up to the loss once
    (``extra["profile"]["carried_reserve"]``, see ``docs/pytorch.md``), which holds for
    checkpoint plans. Offload plans move a stored boundary whole (its carried values with
    it) and pipelines send them between GPUs: they need the per-boundary sizes. The sizes
    are restored exactly; the overheads lose the reserve and keep what was measured
    against the smaller sizes (an upper bound of the per-boundary ones), never below the
    op's held term (``fwd_held`` / ``bwd_held`` / ``loss_held``, which the overhead
    contains; stop 82: a chain given with both raised a ``ChainError``). A chain without
    carried values is returned as it is.

    Examples
    --------
    >>> chain = Chain.from_lists([1.0] * 2, [1.0] * 2, [4, 4], [6, 4], input_size=4,
    ...                          fwd_overhead=[10, 10], bwd_overhead=[1, 10])
    >>> chain = dataclasses.replace(chain, extra={"profile": {
    ...     "carried_left_out": [0, 8], "carried_saved_left_out": [0, 8],
    ...     "carried_fwd": [10, 10], "carried_bwd": [0, 10], "carried_reserve": 10}})
    >>> full = unshared_carried(chain)
    >>> full.output_size, full.saved_size, full.fwd_overhead, full.bwd_overhead
    ((4, 12), (6, 12), (0, 0), (1, 0))
    """
    prof = dict((chain.extra or {}).get("profile") or {})
    left_out = prof.pop("carried_left_out", None)
    if not left_out:
        return chain
    saved_left_out = prof.pop("carried_saved_left_out")
    fwd, bwd = prof.pop("carried_fwd"), prof.pop("carried_bwd")
    reserve = int(prof.pop("carried_reserve"))
    prof.pop("carried_ranges", None)
    out = tuple(n + k for n, k in zip(chain.output_size, left_out, strict=True))
    return dataclasses.replace(
        chain, output_size=out,
        saved_size=tuple(s + k for s, k in zip(chain.saved_size, saved_left_out, strict=True)),
        fwd_overhead=tuple(max(h, o - c) for o, c, h in zip(chain.fwd_overhead, fwd,
                                                            chain.fwd_held, strict=True)),
        bwd_overhead=tuple(max(h, o - c) for o, c, h in zip(chain.bwd_overhead, bwd,
                                                            chain.bwd_held, strict=True)),
        loss_bwd_overhead=max(chain.loss_held, chain.loss_bwd_overhead - reserve),
        extra=dict(chain.extra or {}, profile=prof))


def _charged(t: float, op_overhead: float, op_overhead_ratio: float) -> float:
    """A stage's ``fwd_time`` before rounding: its kernels ``t`` plus the per-``F``-op charge."""
    return t * (1 + op_overhead_ratio) + op_overhead


def _check_charge(field: str, value: float, unit: str) -> None:
    """One :class:`OptmemInputError` naming ``field`` unless ``value`` is finite and >= 0."""
    if not (value >= 0 and math.isfinite(value)):
        raise OptmemInputError(f"expected {field} >= 0 ({unit}), got {value}", field=field)


def with_op_charge(chain: Chain, op_overhead: float, op_overhead_ratio: float = 0.0) -> Chain:
    """``chain`` with another per-``F``-op charge: ``t * (1 + op_overhead_ratio) + op_overhead``.

    The stages' kernel times ``t`` are recovered from the recorded charge
    (``chain.extra["profile"]``'s ``op_overhead_ms`` and ``op_overhead_ratio``, 0 when
    absent), the new charge is applied and the result rounded to the profile's
    ``time_resolution`` as :func:`profile_stages` rounds (so up to one rounding step from
    a fresh profile with the new charge). Re-plans a stored profile under other constants
    without profiling again; backward times, sizes and the segment cost are unchanged.

    Examples
    --------
    >>> chain = Chain.from_lists([1.0, 3.0], [1.0, 1.0], [4, 4], [4, 4], input_size=4)
    >>> with_op_charge(chain, 0.5, 0.25).fwd_time
    (1.75, 4.25)
    """
    _check_charge("op_overhead", op_overhead, "ms")
    _check_charge("op_overhead_ratio", op_overhead_ratio, "of a stage's forward time")
    prof = dict((chain.extra or {}).get("profile") or {})
    a0 = float(prof.get("op_overhead_ms") or 0.0)
    r0 = float(prof.get("op_overhead_ratio") or 0.0)
    res = float(prof.get("time_resolution") or 0.0)
    fwd = tuple(round_time(_charged(max(0.0, (t - a0) / (1 + r0)), op_overhead,
                                    op_overhead_ratio), res) for t in chain.fwd_time)
    prof.update(op_overhead_ms=op_overhead, op_overhead_ratio=op_overhead_ratio)
    return dataclasses.replace(chain, fwd_time=fwd, extra=dict(chain.extra or {}, profile=prof))


def _segment_cost(segments: SegmentCost | None, measure: bool | None,
                  measured_times: bool) -> tuple[float, str | None]:
    """The cost per recomputed segment to record, and where it comes from.

    A measurement when one was taken; else :data:`DEFAULT_SEGMENT_COST_MS` on chains with
    measured times of at least 3 stages unless ``measure`` is ``False``; else 0 (``None``).
    """
    if segments is not None:
        return segments.ms, "measured"
    if measure is None and measured_times:
        return DEFAULT_SEGMENT_COST_MS, "default"
    return 0.0, None


# ------------------------------------------------------------------ in-place writers
_FAILED = object()
"""A dry run that failed otherwise than by writing into its input (the profile reports it)."""
_WRITES_INPUT = object()
"""A dry run whose stages write in place into their input (or a view of it)."""


def _writes_into_leaf(exc: BaseException) -> bool:
    """Autograd's refusal of an in-place write into a leaf that requires grad, or a view of one."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "leaf Variable that requires grad" in text \
        and "in-place operation" in text


def _inplace_message(k: int, name: str, exc: BaseException) -> str:
    return (f"stage {k + 1} ({name}) writes in place into its input ("
            f"{str(exc).splitlines()[0].rstrip('.')}): the plan runs a stage on a stored "
            "input and may run it again; make the write out of place (x = x + 1 rather "
            "than x.add_(1), inplace=False), or put it in one module with the stage that "
            "makes its input")


def _dry_run(modules: Sequence[nn.Module], value: Any) -> Any:
    """Run ``modules`` in order on a detached leaf of ``value``, as the executor runs a stage.

    Returns the output, :data:`_WRITES_INPUT` when autograd refuses an in-place write into
    the leaf (or a view of it) and the same modules run on a fresh copy of it, or
    :data:`_FAILED` on any other error.
    """
    leaf = _leaf(value, True)
    try:
        return run_in_order(modules, leaf)
    except RuntimeError as exc:
        if not _writes_into_leaf(exc):
            return _FAILED
    except Exception:  # noqa: BLE001 - the profile meets it again and reports it
        return _FAILED
    try:  # a non-leaf copy: the write was into the input, not into a parameter
        run_in_order(modules, _map_tensors(leaf, torch.Tensor.clone))
    except Exception:  # noqa: BLE001 - as above
        return _FAILED
    return _WRITES_INPUT


def merge_inplace_writers(stages: Sequence[Stage], sample: Any,
                          device: str | torch.device | None = None) -> list[Stage]:
    """Merge every stage that writes in place into its input into the stage before it.

    The executor runs a stage on a stored input (a checkpoint, or a leaf that requires
    grad): a stage that writes into it (``x.add_(1)``, ``ReLU(inplace=True)`` after a
    stage returning a view of its input, such as ``nn.Flatten`` on a 2-D tensor) would
    overwrite the checkpoint, and autograd refuses it on the leaf. A dry run (one forward
    of every stage, with gradients, on a detached leaf of its input; buffers and RNG state
    restored) finds them: such a stage is merged with the one before it, again while the
    merged stage still writes into its own input (the stage before returned a view of its
    input too). A run that fails otherwise stops the dry run (the profile reports that
    error); so does a ``device`` of ``"meta"`` when the stages have real parameters (the
    profile then names the stage).

    Parameters
    ----------
    stages
        The chain's stages, in order.
    sample
        Their input (one batch).
    device
        Where the profile runs (``None``: the sample's device).

    Returns
    -------
    list of Stage
        ``stages``, with every writer merged into the stage before it
        (:func:`~optmem.pytorch.extract.merge_stages` names them ``first..last``).

    Raises
    ------
    OptmemInputError
        Naming the stage, when it writes in place into the model input (the first stage,
        or through views every stage before it returns): the plan may run it again on
        the input it wrote.
    """
    stages = list(stages)
    inputs = value_tensors(sample)
    if not stages or not inputs:
        return stages
    modules = [s.module for s in stages]
    dev = _profile_device(modules, device, inputs)
    if dev.type == "meta":
        if not all(p.is_meta for m in modules for p in m.parameters()):
            return stages
        sample = _to_meta(sample)
    elif dev != inputs[0].device:
        _check_weights_on(modules, dev)
        sample = move_to(sample, dev)
    fork = _rng_devices(dev)
    groups: list[tuple[int, int]] = []
    starts: list[Any] = []  # the input of every group
    x = sample
    with torch.random.fork_rng(devices=fork), generators_restored(module_generators(modules)), \
            buffers_restored(modules), torch.enable_grad():
        for k in range(len(stages)):
            before = list(groups)
            first, value = k, x
            out = _dry_run(modules[k:k + 1], value)
            while out is _WRITES_INPUT:
                if not groups:
                    through = "" if not k else (", through the view stage 1 returns," if k == 1
                                                else f", through the views stages 1-{k} return,")
                    raise OptmemInputError(
                        f"stage {k + 1} ({stages[k].name}) writes in place into the model "
                        f"input{through} and the plan may run it again on the input it "
                        "wrote; make the write out of place (x = x + 1 rather than "
                        "x.add_(1), inplace=False), or clone the input first",
                        stage=k + 1, field="module")
                first, _ = groups.pop()
                value = starts.pop()
                out = _dry_run(modules[first:k + 1], value)
            if out is _FAILED:  # the profile meets it again and reports it
                groups = before + [(j, j) for j in range(k, len(stages))]
                break
            groups.append((first, k))
            starts.append(value)
            x = _leaf(out, False)
    if len(groups) == len(stages):
        return stages
    return merge_stages(stages, len(groups), groups=groups)


def _profile_memory(modules: Sequence[nn.Module], stages: Sequence[Stage], sample: Any,
                    s: _Setting, bar: _Progress) -> tuple[list[_StageMemory], list[Any], Any]:
    """The memory pass: every stage in order on the previous stage's output.

    Returns the rows, the leaf input of every stage (kept for timing) and the chain output.
    """
    last_use: dict[int, int] = {}
    for k, m in enumerate(modules):
        for p in m.parameters():
            last_use[id(p)] = k
    rows: list[_StageMemory] = []
    leaves: list[Any] = []
    x_value = sample
    in_size = input_bytes(sample)
    for k, module in enumerate(modules):
        bar.update(k, stages[k].name)
        needs_grad = k > 0 or any(t.requires_grad for t in value_tensors(x_value))
        x = _leaf(x_value, needs_grad)
        tied = [p for p in module.parameters() if p.requires_grad and last_use[id(p)] > k]
        try:
            row = _stage_memory(module, x, in_size, tied, s, last=k == len(modules) - 1)
        except RuntimeError as exc:
            if not _writes_into_leaf(exc):
                raise
            raise OptmemInputError(_inplace_message(k, stages[k].name, exc), stage=k + 1,
                                   field="module") from None
        except TypeError as exc:
            if k > 0:
                raise
            raise OptmemInputError(_sample_message(stages[0].name, exc), stage=1,
                                   field="sample") from None
        rows.append(row)
        leaves.append(x)
        x_value, in_size = row.out, row.output_size
    return rows, leaves, x_value


def _sample_message(name: str, exc: TypeError) -> str:
    """Why the first stage cannot take the sample (a tuple given to an ``nn.Sequential``).

    An ``nn.Sequential`` (or a list of stages) takes the sample as its one input, as
    ``nn.Sequential.forward`` does: a tuple is passed to the first stage whole. Before stop
    75 ``op.checkpoint(seq, (x,), ...)`` ended in the stage's raw ``TypeError``.
    """
    return (f"the first stage ({name}) cannot take the sample: {exc}; an nn.Sequential or a "
            f"list of stages takes the sample as its one input, and a tuple is passed to "
            f"its first stage whole (give the tensor itself)")


def _model_times(value: Any) -> tuple[float, float]:
    """A time model's answer as (forward, backward) ms; one error naming it otherwise."""
    try:
        fwd, bwd = (float(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        raise OptmemInputError(f"a time model returns (forward_ms, backward_ms), got "
                               f"{value!r}", field="time_model") from None
    return fwd, bwd


def _stage_times(modules: Sequence[nn.Module], leaves: Sequence[Any],
                 rows: Sequence[_StageMemory], s: _Setting, timer: _Timer, repeats: int,
                 warmup: int, time_model: TimeModel | None,
                 roofline: Callable[[float, float], float], loss_fn: LossFn | None,
                 last: Any) -> tuple[list[float], list[float], float]:
    """Forward, backward and loss times: a time model, the meta roofline, or measured."""
    if time_model is not None:
        pairs = [_model_times(time_model(m, x, r.out))
                 for m, x, r in zip(modules, leaves, rows, strict=True)]
        return [p[0] for p in pairs], [p[1] for p in pairs], 0.0
    if s.meta:
        fwd, bwd = [], []
        for x, r in zip(leaves, rows, strict=True):
            moved = value_nbytes(x) + r.output_size + r.saved_size
            fwd.append(roofline(r.fwd_flops, moved))
            bwd.append(roofline(r.bwd_flops, moved + value_nbytes(x)) if r.has_bwd else 0.0)
        return fwd, bwd, 0.0
    loss_input = _leaf(last, True) if loss_fn is not None else None
    return _time_rounds(modules, leaves, [r.signature for r in rows], timer, repeats, warmup,
                        loss_fn, loss_input)


def model_name(module: Any) -> str:
    """The name of a model in chains and messages: its class, or ``list of N stages``.

    Examples
    --------
    >>> model_name(nn.Sequential()), model_name([nn.ReLU(), nn.ReLU()])
    ('Sequential', 'list of 2 stages')
    """
    if isinstance(module, nn.Module):
        return type(module).__name__
    return f"list of {len(module)} stages" if isinstance(module, Sized) else "torch"


def profile_chain(
    module: nn.Module | Sequence[nn.Module | Stage],
    sample: Any,
    *,
    device: str | torch.device | None = None,
    repeats: int = 5,
    warmup: int = 1,
    name: str | None = None,
    progress: bool | None = None,
    time_model: TimeModel | None = None,
    max_stages: int | None = None,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    bytes_per_s: float = DEFAULT_BYTES_PER_S,
    loss_fn: LossFn | None = None,
    time_resolution: float = DEFAULT_TIME_RESOLUTION,
    pool_identical: bool = True,
    op_overhead: float = DEFAULT_OP_OVERHEAD_MS,
    measure_segments: bool | None = None,
    segment_timer: SegmentTimer | None = None,
    op_overhead_ratio: float = DEFAULT_OP_OVERHEAD_RATIO,
) -> Chain:
    """Extract the chain of ``module`` and profile it on ``sample``.

    Parameters
    ----------
    module
        An ``nn.Module`` (see :func:`~optmem.pytorch.extract.extract_stages`) or a list of
        stages / stage modules.
    sample
        One batch: a tensor or a tuple of tensors (the module's input).
    device
        ``None`` (the sample's device), ``"cpu"``, ``"cuda"`` or ``"meta"`` (sizes only, no
        computation; times from ``time_model`` or the FLOPs roofline).
    repeats, warmup
        Timed and untimed rounds (every stage once per round; the median is kept).
    name
        Chain name (default: the module's class name).
    progress
        Progress bar on stderr: ``True``, ``False``, or ``None`` (only on a terminal).
    time_model
        ``time_model(stage_module, input, output) -> (fwd_ms, bwd_ms)`` replacing the timing
        (a device model such as a GPU roofline plugs in here; deterministic times give
        deterministic plans).
    max_stages
        Merge the extracted stages into at most this many (balanced by parameter count).
    flops_per_s, bytes_per_s
        Roofline of the default meta-mode time model.
    loss_fn
        ``loss_fn(output) -> loss``: profile the loss too (its time and temporaries become
        the chain's ``loss`` stage), so that a memory limit covers it. ``None``: the loss
        costs nothing in the chain (rotor's default).
    time_resolution
        Relative resolution of measured times (:func:`round_time`; 0 keeps them as
        measured).
    pool_identical
        Give stages that run the same kernels on the same shapes (the blocks of a
        transformer) one time, the median of their pooled samples (``False``: time every
        stage on its own samples).
    op_overhead
        Milliseconds added to every measured forward time: the executor's own cost of an
        ``F`` op (:data:`DEFAULT_OP_OVERHEAD_MS`; 0 gives the kernels' times alone). Not
        added to times from ``time_model`` or the roofline.
    op_overhead_ratio
        The part of an ``F`` op's executor cost proportional to the stage's measured forward
        ``t``: ``fwd_time = t * (1 + op_overhead_ratio) + op_overhead``
        (:data:`DEFAULT_OP_OVERHEAD_RATIO`). Not applied to ``time_model`` or roofline times.
        Both charges are recorded in ``chain.extra["profile"]`` (``op_overhead_ms``,
        ``op_overhead_ratio``).
    measure_segments
        The cost per recomputed segment recorded in
        ``chain.extra["profile"]["segment_cost_ms"]``, which the bridge's checkpoint DP
        charges by default. ``None`` (default): :data:`DEFAULT_SEGMENT_COST_MS` on chains
        with measured times and at least 3 stages, else 0. ``True``: measure it
        (:func:`~optmem.pytorch.segments.measure_segment_cost`, ``2 * repeats + 1`` rounds
        of two train steps after ``warmup``; not on meta, and with ``time_model`` only with
        a ``segment_timer``; noisy under load). ``False``: 0 (rotor's model).
    segment_timer
        ``timer(fn) -> ms`` for that measurement (default: the profiler's clock).

    Returns
    -------
    Chain
        Sizes in bytes (``memory_unit = "B"``), times in milliseconds.

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    >>> chain = profile_chain(net, torch.randn(4, 8), repeats=1, warmup=0)
    >>> chain.length, chain.input_size, chain.output_size
    (3, 128, (256, 256, 32))
    """
    stages = extract_stages(module if isinstance(module, nn.Module) else list(module),
                            allow_single=True)
    stages = merge_inplace_writers(stages, sample, device)  # as the wrapper's, before max_stages
    if max_stages is not None and len(stages) > max_stages:
        stages = merge_stages(stages, max_stages)
    if name is None:
        name = model_name(module)
    return profile_stages(stages, sample, device=device, repeats=repeats, warmup=warmup,
                          name=name, progress=progress, time_model=time_model,
                          flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, loss_fn=loss_fn,
                          time_resolution=time_resolution, pool_identical=pool_identical,
                          op_overhead=op_overhead, measure_segments=measure_segments,
                          segment_timer=segment_timer, op_overhead_ratio=op_overhead_ratio)
