"""Profiling: measure a chain of stages into an ``optmem.chain/1`` :class:`~optmem.chain.Chain`.

What is measured for each stage ``i`` (digest ``rotor.md`` section 6, rotor's
``measure_everything``, with the differences noted):

* ``fwd_time``, ``bwd_time``: ``warmup`` untimed runs, then the median of ``repeats`` timed
  runs (CUDA events on GPU, ``time.perf_counter`` on CPU), in milliseconds. The forward is
  timed with grad recording on (an ``F_all``); the backward is ``torch.autograd.backward``
  of the stage output with a gradient of ones.
* ``output_size``: bytes of the output tensors, from their shapes (``numel * itemsize``).
* ``saved_size``: the tape, measured with ``torch.autograd.graph.saved_tensors_hooks``: the
  bytes of the *distinct storages* of every tensor autograd saves during the forward,
  excluding parameters, buffers and the stage input (a^{i-1}), plus the output storages
  (the tape includes a^i by definition, CONTRACT section 1). Unlike rotor (which subtracts
  allocator counters) this is exact on any device, CPU and ``meta`` included.
* ``fwd_overhead``, ``bwd_overhead``: on CUDA, from ``torch.cuda`` memory statistics as
  rotor does (peak during the op minus what stays allocated, never negative). **On CPU and
  on meta they are 0**: there is no allocator peak counter there.
* ``weight_size``: bytes of the stage's parameters.
* The loss is outside the chain (the user computes it on the module's output), so the loss
  stage has time 0 and overhead 0, as in rotor.

``device="meta"`` profiles without running anything: the stages (copied to the meta device
unless already there) are run on meta tensors, which gives exact sizes of models too large
to instantiate. Times then come from ``time_model`` if given, else from a crude roofline:
``max(flops / flops_per_s, bytes / bytes_per_s)``, FLOPs counted by
``torch.utils.flop_counter.FlopCounterMode`` for the forward and the backward.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch
from torch import nn

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.pytorch.extract import Stage, extract_stages, value_tensors

__all__ = ["TimeModel", "profile_chain", "profile_stages", "roofline_time_model",
           "storage_key", "value_nbytes"]

TimeModel = Callable[[nn.Module, Any, Any], tuple[float, float]]
"""``time_model(stage_module, input, output) -> (fwd_ms, bwd_ms)``."""

DEFAULT_FLOPS_PER_S = 1e13
DEFAULT_BYTES_PER_S = 1e12


# ------------------------------------------------------------------ sizes
def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (shared by views, valid on meta too)."""
    return int(t.untyped_storage()._cdata)


def _storage_nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def value_nbytes(value: Any) -> int:
    """Bytes of the tensors of a value, from shapes (``numel * element_size``)."""
    return sum(t.numel() * t.element_size() for t in value_tensors(value))


def _weight_nbytes(module: nn.Module) -> int:
    seen: dict[int, int] = {}
    for p in module.parameters():
        seen[storage_key(p)] = _storage_nbytes(p)
    return sum(seen.values())


def _persistent_keys(modules: Sequence[nn.Module]) -> set[int]:
    keys: set[int] = set()
    for m in modules:
        for p in m.parameters():
            keys.add(storage_key(p))
        for b in m.buffers():
            keys.add(storage_key(b))
    return keys


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


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
    if isinstance(value, tuple | list):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _grad_targets(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [t for t in value_tensors(out) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


# ------------------------------------------------------------------ timing
class _Timer:
    """Wall-clock (CPU) or CUDA-event timer returning milliseconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


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
) -> Chain:
    """Profile already extracted stages on ``sample``; see :func:`profile_chain`."""
    if repeats < 1 or warmup < 0:
        raise OptmemInputError(f"expected repeats >= 1 and warmup >= 0, got {repeats}, {warmup}",
                               field="repeats")
    inputs = value_tensors(sample)
    if not inputs:
        raise OptmemInputError("the sample input holds no tensor", field="sample")
    dev = torch.device(device) if device is not None else inputs[0].device
    meta = dev.type == "meta"
    modules = [s.module for s in stages]
    if meta:
        modules = [m if all(p.is_meta for p in m.parameters()) else copy.deepcopy(m).to("meta")
                   for m in modules]
        sample = _to_meta(sample)
    elif dev != inputs[0].device:
        sample = _move(sample, dev)
    roofline = roofline_time_model(flops_per_s, bytes_per_s)
    timer = _Timer(dev)
    persistent = _persistent_keys(modules)
    cuda = dev.type == "cuda"

    params = [p for m in modules for p in m.parameters()]
    old_grads = [p.grad for p in params]
    for p in params:  # backward would accumulate into the caller's gradients otherwise
        p.grad = None
    buffers = [b for m in modules for b in m.buffers()]
    old_buffers = [b.detach().clone() for b in buffers] if not meta else []
    cols: dict[str, list[Any]] = {k: [] for k in (
        "fwd_time", "bwd_time", "output_size", "saved_size", "fwd_overhead", "bwd_overhead",
        "weight_size")}
    bar = _Progress(len(stages), progress)
    input_size = value_nbytes(sample)
    x_value = sample
    fork_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] \
        if cuda else []
    try:
        with torch.random.fork_rng(devices=fork_devices, enabled=True):
            for k, module in enumerate(modules):
                bar.update(k, stages[k].name)
                first = k == 0
                needs_grad = any(t.requires_grad for t in value_tensors(x_value)) or not first
                row = _profile_one(module, x_value, needs_grad=needs_grad, persistent=persistent,
                                   timer=timer, repeats=repeats, warmup=warmup, meta=meta,
                                   cuda=cuda, time_model=time_model, roofline=roofline)
                for key, v in row.items():
                    if key != "next":
                        cols[key].append(v)
                x_value = row["next"]
                for p in params:
                    p.grad = None
            bar.update(len(stages), "done")
    finally:
        bar.close()
        for p, g in zip(params, old_grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, old in zip(buffers, old_buffers, strict=False):
                b.copy_(old)
    return Chain(
        fwd_time=tuple(cols["fwd_time"]), bwd_time=tuple(cols["bwd_time"]),
        output_size=tuple(cols["output_size"]), saved_size=tuple(cols["saved_size"]),
        fwd_overhead=tuple(cols["fwd_overhead"]), bwd_overhead=tuple(cols["bwd_overhead"]),
        weight_size=tuple(cols["weight_size"]), input_size=input_size, name=name,
        time_unit="ms", memory_unit="B", stage_names=tuple(s.name for s in stages),
        extra={"profile": {"device": str(dev), "repeats": repeats, "warmup": warmup,
                           "torch": torch.__version__,
                           "times": "time_model" if time_model is not None else
                           ("roofline" if meta else "measured"),
                           "overheads": "cuda memory stats" if cuda else "0 (not measured)"}},
    )


def _move(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, tuple | list):
        return type(value)(_move(v, dev) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, dev) for k, v in value.items()}
    return value


def _profile_one(module: nn.Module, x_value: Any, *, needs_grad: bool, persistent: set[int],
                 timer: _Timer, repeats: int, warmup: int, meta: bool, cuda: bool,
                 time_model: TimeModel | None,
                 roofline: Callable[[float, float], float]) -> dict[str, Any]:
    """Measure one stage; returns the chain columns and ``next`` (its output, detached)."""
    x = _leaf(x_value, needs_grad)
    excluded = persistent | {storage_key(t) for t in value_tensors(x)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            key = storage_key(t)
        except (RuntimeError, NotImplementedError):  # e.g. sparse tensors
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            nbytes = _storage_nbytes(t)
        if key not in excluded:
            saved[key] = nbytes
        return t

    flops_f = flops_b = 0.0
    mem_before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    counter = _flop_counter(meta and time_model is None)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _identity), \
            counter:
        out = module(x)
    if meta and time_model is None:
        flops_f = float(counter.get_total_flops())  # type: ignore[union-attr]
    out_tensors = value_tensors(out)
    if not out_tensors:
        raise OptmemInputError("the stage returns no tensor", field="module")
    output_size = value_nbytes(out)
    for t in out_tensors:
        key = storage_key(t)
        if key not in persistent:
            saved[key] = _storage_nbytes(t)
    saved_size = max(sum(saved.values()), output_size)
    fwd_overhead = bwd_overhead = 0
    if cuda:
        peak_f = torch.cuda.max_memory_allocated() - mem_before
        delta = torch.cuda.memory_allocated() - mem_before
        fwd_overhead = max(0, peak_f - max(delta, saved_size))
    outs, grads = _grad_targets(out)
    if outs:
        if cuda:
            # gradient buffers of the weights allocated beforehand (as rotor does): they are
            # weight memory, not the backward's temporary memory
            for p in module.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            torch.cuda.synchronize()
            mem_before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        counter = _flop_counter(meta and time_model is None)
        with counter:
            torch.autograd.backward(outs, grads)
        if meta and time_model is None:
            flops_b = float(counter.get_total_flops())  # type: ignore[union-attr]
        if cuda:
            peak_b = torch.cuda.max_memory_allocated() - mem_before
            grad_in = value_nbytes([t.grad for t in value_tensors(x) if t.grad is not None])
            bwd_overhead = max(0, peak_b - grad_in)
    has_bwd = bool(outs)
    del outs, grads
    if time_model is not None:
        fwd_time, bwd_time = (float(v) for v in time_model(module, x, out))
    elif meta:
        moved = value_nbytes(x) + output_size + saved_size
        fwd_time = roofline(flops_f, moved)
        bwd_time = roofline(flops_b, moved + value_nbytes(x)) if has_bwd else 0.0
    else:
        fwd_time, bwd_time = _measure_times(module, x, timer, repeats, warmup)
    return {
        "fwd_time": fwd_time, "bwd_time": bwd_time, "output_size": output_size,
        "saved_size": saved_size, "fwd_overhead": fwd_overhead, "bwd_overhead": bwd_overhead,
        "weight_size": _weight_nbytes(module), "next": _leaf(out, False),
    }


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


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


def _measure_times(module: nn.Module, x: Any, timer: _Timer, repeats: int,
                   warmup: int) -> tuple[float, float]:
    """Median forward (with grad) and backward times in milliseconds."""

    def forward() -> Any:
        with torch.enable_grad():
            return module(x)

    for _ in range(warmup):
        out = forward()
        outs, grads = _grad_targets(out)
        if outs:
            torch.autograd.backward(outs, grads)
    fwd = [timer(forward) for _ in range(repeats)]
    bwd = []
    for _ in range(repeats):
        outs, grads = _grad_targets(forward())
        if not outs:
            bwd.append(0.0)
            continue
        def backward(o: list[torch.Tensor] = outs, g: list[torch.Tensor] = grads) -> None:
            torch.autograd.backward(o, g)

        bwd.append(timer(backward))
        for t in value_tensors(x):
            t.grad = None
    return float(statistics.median(fwd)), float(statistics.median(bwd))


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
        Timed runs (median taken) and untimed warm-up runs per stage.
    name
        Chain name (default: the module's class name).
    progress
        Progress bar on stderr: ``True``, ``False``, or ``None`` (only on a terminal).
    time_model
        ``time_model(stage_module, input, output) -> (fwd_ms, bwd_ms)`` replacing the timing
        (a device model such as a GPU roofline plugs in here).
    max_stages
        Merge the extracted stages into at most this many (balanced by parameter count).
    flops_per_s, bytes_per_s
        Roofline of the default meta-mode time model.

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
    stages = extract_stages(module, max_stages=max_stages, allow_single=True) \
        if isinstance(module, nn.Module) else extract_stages(list(module), allow_single=True,
                                                             max_stages=max_stages)
    if name is None:
        name = type(module).__name__ if isinstance(module, nn.Module) else "torch"
    return profile_stages(stages, sample, device=device, repeats=repeats, warmup=warmup,
                          name=name, progress=progress, time_model=time_model,
                          flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)
