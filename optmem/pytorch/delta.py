"""DELTA-style runtime memory policy (Tang et al.) through ``saved_tensors_hooks``.

Digest ``shared/design/hong_delta.md`` part B, at stage granularity on a chain of stages:
the tensors autograd saves while stage ``i`` runs form the group ``i``. Before each stage
of the forward pass, while the saved bytes are at or above ``trigger`` (0.75) of
``budget`` (or the stage's estimated need does not fit):

* **filter** (Alg. 2, ``h_base = 1 / (m s)``): pick the stored group with the largest
  bytes x staleness (time since its last use), the previous stage's group excepted;
* **director** (Alg. 3, Eq. 4): recompute cost ``c_r`` (the stage's forward time, plus
  those of evicted predecessors it would need) against the swap cost
  ``c_s = kappa bytes / (eta bandwidth)``: **evict** the group (drop it; it is recomputed
  from the stage input when backward unpacks it, as non-reentrant checkpointing does, with
  the RNG state and buffers of the first run) if ``c_r <= c_s``, otherwise **offload** it
  (host copy; it is reloaded on first unpack).

Releases happen in the forward pass only (assumption A2). Deviations: reloads are
synchronous on first unpack (no prefetcher thread; Alg. 4 is modelled by the simulated
baseline ``delta`` of :mod:`optmem.solvers.remat_offload_delta`); the input of an evicted
stage is kept (a strong reference), DTR's recursive rematerialisation of evicted inputs is
not needed on a chain because the input is an ordinary activation. Gradients equal the
unmodified chain's: copies are bit for bit, and a recomputation replays the first run's
random states (the CPU's, the CUDA generators of the devices of the input and the
parameters, the stage's own generators) under the forward's autocast, as the checkpoint
executor's re-runs do (before stop 56 the CPU state only, without autocast: a stage
drawing on a GPU or from its own generator was recomputed with other random numbers, and
a forward under ``torch.autocast`` failed in the backward on mixed dtypes).

**torch.compile**: as the other executors (:mod:`optmem.pytorch.execute`), the policy never
runs under dynamo: ``torch.compile(chain)`` or a compiled training step breaks the graph at
the forward (:func:`~optmem.pytorch.execute.run_compiled`), the stages run compiled with the
enclosing compile's options, and the unpack hook (which autograd calls with the caller's
frame callback when ``backward()`` runs inside the compiled step) is wrapped in
``torch.compiler.disable`` (:func:`~optmem.pytorch.execute.backward_outside_dynamo`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from optmem.pytorch.context import (
    SideInputs,
    current_side_inputs_or_none,
    read_by,
    side_inputs,
)
from optmem.pytorch.execute import (
    CompileRequest,
    StageCalls,
    _RngState,
    autocast_modes,
    backward_outside_dynamo,
    run_in_order,
)
from optmem.pytorch.extract import Stage, value_tensors
from optmem.pytorch.hooks import cuda_indices, generators_restored, module_generators
from optmem.pytorch.offload import kept_storages

__all__ = ["DeltaChain"]

EVICT, OFFLOAD = "evict", "offload"


@dataclass
class _Group:
    stage: int
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    devices: list[torch.device] = field(default_factory=list)
    nbytes: int = 0
    last_use: float = 0.0
    state: str = "resident"  # resident | evicted | offloaded
    inp: Any = None  # the stage input (a tensor or a tuple), detached
    rng: _RngState | None = None  # CPU, CUDA and the stage's own generators, before its run
    autocast: list[tuple[str, torch.dtype]] = field(default_factory=list)
    autocast_cache: bool = True
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = field(default_factory=list)
    order: list[bool] = field(default_factory=list)  # per pack call: released or not


@dataclass
class _Handle:
    group: _Group
    index: int


class DeltaChain(StageCalls, nn.Module):
    """Train a chain of stages under a saved-activation budget, DELTA style.

    Parameters
    ----------
    stages
        The stages, in order (each takes and returns one value: a tensor or a tuple of
        tensors; side inputs of the call are re-entered for recomputations).
    budget
        Bytes of saved activations the policy aims to stay under.
    bandwidth
        Host link bandwidth in bytes per second (``c_s``).
    fwd_time
        Forward time of each stage in seconds (``c_r``); default 1 ms each.
    trigger, kappa, eta
        Early-release threshold (0.75), swap factor (1: one transfer) and bandwidth
        derating (1.0; the paper uses 0.35 of the nominal PCIe bandwidth).

    Attributes
    ----------
    decisions
        ``(stage, "evict" | "offload")`` of the last forward pass.
    recomputed, reloaded
        Stages recomputed / groups reloaded in the last backward pass.
    """

    def __init__(self, stages: Sequence[Stage | nn.Module], budget: int, bandwidth: float, *,
                 fwd_time: Sequence[float] | None = None, trigger: float = 0.75,
                 kappa: float = 1.0, eta: float = 1.0) -> None:
        super().__init__()
        self.stages = nn.ModuleList([s.module if isinstance(s, Stage) else s for s in stages])
        self.budget = int(budget)
        self.bandwidth = float(bandwidth)
        self.fwd_time = list(fwd_time) if fwd_time is not None else [1e-3] * len(stages)
        self.trigger, self.kappa, self.eta = trigger, kappa, eta
        self.decisions: list[tuple[int, str]] = []
        self.recomputed: list[int] = []
        self.reloaded: list[int] = []
        self._groups: list[_Group] = []
        self._weights: set[int] = set()
        self._context: SideInputs | None = None
        self._functions: list[Any] = []

    # ------------------------------------------------------------------ forward
    def _forward(self, x: Any, compiled: CompileRequest) -> Any:
        functions = self.stage_functions(compiled)
        if not torch.is_grad_enabled():
            return run_in_order(functions, x)
        self._groups = []
        self.decisions, self.recomputed, self.reloaded = [], [], []
        self._weights = kept_storages(self)
        self._context = read_by(current_side_inputs_or_none(), self.stages)
        self._functions = functions
        unpack = backward_outside_dynamo(self._unpack)
        # what a recomputation replays: the CUDA generators of the input's and the stages'
        # devices (dropout on a GPU), the stages' own generators, the forward's autocast
        devices = cuda_indices([*value_tensors(x), *self.parameters()])
        autocast, cache = autocast_modes(), torch.is_autocast_cache_enabled()
        clock = 0.0
        for i, stage in enumerate(functions):
            self._release(i, clock, x)
            group = _Group(i, inp=tree_map(_detached, x), autocast=autocast,
                           autocast_cache=cache)
            group.rng = _RngState(devices, module_generators(self.stages[i]))
            group.buffers = [(sub, name, buf.detach().clone())
                             for sub in self.stages[i].modules()
                             for name, buf in sub._buffers.items() if buf is not None]
            with torch.autograd.graph.saved_tensors_hooks(self._packer(group), unpack):
                x = stage(x)
            clock += self.fwd_time[i]
            group.last_use = clock
            if i > 0:
                self._groups[i - 1].last_use = clock - self.fwd_time[i]
            self._groups.append(group)
        return x

    def _packer(self, group: _Group) -> Any:
        def pack(t: torch.Tensor) -> Any:
            try:
                keep = t.untyped_storage().data_ptr() in self._weights
            except RuntimeError:  # pragma: no cover - tensors without storage
                keep = True
            group.order.append(not keep)
            if keep:
                return t  # weights and buffers are never released
            group.tensors.append(t.detach())  # without its grad_fn: no uncollectable cycle
            group.devices.append(t.device)
            group.nbytes += t.numel() * t.element_size()
            return _Handle(group, len(group.tensors) - 1)

        return pack

    def _used(self) -> int:
        return sum(g.nbytes for g in self._groups if g.state == "resident")

    def _release(self, i: int, clock: float, x: Any) -> None:
        # rough estimate of the stage's saved bytes
        need = sum(t.numel() * t.element_size() for t in value_tensors(x))
        while self._used() >= self.trigger * self.budget or self._used() + need > self.budget:
            cand = [g for g in self._groups if g.state == "resident" and g.stage != i - 1]
            if not cand:
                return
            g = max(cand, key=lambda g: (g.nbytes * (clock - g.last_use), -g.stage))  # filter
            c_r = self.fwd_time[g.stage]
            c_s = (self.kappa * g.nbytes / (self.eta * self.bandwidth)
                   if self.bandwidth > 0 else float("inf"))
            if c_r <= c_s:  # director
                g.tensors = [None] * len(g.tensors)
                g.state = "evicted"
                self.decisions.append((g.stage, EVICT))
            else:
                g.tensors = [_host(t) for t in g.tensors]
                g.state = "offloaded"
                self.decisions.append((g.stage, OFFLOAD))

    # ------------------------------------------------------------------ backward
    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h
        g = h.group
        if g.state == "evicted":
            self._recompute(g)
        elif g.state == "offloaded":
            g.tensors = [_device(t, d) if t is not None else None
                         for t, d in zip(g.tensors, g.devices, strict=True)]
            g.state = "resident"
            self.reloaded.append(g.stage)
        t = g.tensors[h.index]
        if t is None:
            raise RuntimeError(f"saved tensor {h.index} of stage {g.stage + 1} is gone")
        return t

    def _recompute(self, g: _Group) -> None:
        """Re-run the stage from its kept input, capturing the saved tensors in order."""
        fresh: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> Any:
            fresh.append(t.detach())
            return None

        stage = self._functions[g.stage] if self._functions else self.stages[g.stage]
        with contextlib.ExitStack() as stack:
            stack.enter_context(side_inputs(self._context))
            assert g.rng is not None
            stack.enter_context(torch.random.fork_rng(devices=g.rng.devices))
            stack.enter_context(generators_restored(gen for gen, _ in g.rng.generators))
            g.rng.restore()
            for device_type, dtype in g.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=g.autocast_cache))
            for sub, name, first in g.buffers:
                live = sub._buffers[name]
                if live is not None:
                    stack.callback(setattr_buffer, sub, name, live)
                sub._buffers[name] = first.clone()
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _never))
            assert g.inp is not None
            stage(tree_map(_detached, g.inp))
        if len(fresh) != len(g.order):
            raise RuntimeError(f"stage {g.stage + 1} saved {len(fresh)} tensors on "
                               f"recomputation, {len(g.order)} the first time")
        g.tensors = [t for t, released in zip(fresh, g.order, strict=True) if released]
        g.state = "resident"
        self.recomputed.append(g.stage)


def _detached(v: Any) -> Any:
    """A detached alias of a tensor that requires grad as the original does."""
    if not isinstance(v, torch.Tensor):
        return v
    return v.detach().requires_grad_(v.requires_grad)


def _never(_: Any) -> torch.Tensor:  # pragma: no cover - the recomputed graph is dropped
    raise RuntimeError("the recomputation graph is not differentiated")


def setattr_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put a buffer back (no in-place write: autograd may check its version)."""
    module._buffers[name] = value


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().clone() if t.device.type == "cpu" else t.detach().to("cpu")


def _device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.clone() if device.type == "cpu" else t.to(device)
