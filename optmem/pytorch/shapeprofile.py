"""Profile an ``nn.Sequential`` from shapes alone (meta device): sizes, FLOPs, roofline times.

This is the zoo's profiler. It follows the measurement protocol of the rotor code
(``shared/design/rotor.md`` section 6.2, ``inspection.measure_everything``) with the CUDA
allocator replaced by exact storage accounting, so that it runs on the ``meta`` device, where
tensors have shapes but no data (a 1000x1000 ResNet or GPT-2 large costs nothing):

* every storage created by a kernel while a stage runs is counted when it is created and
  uncounted when Python/autograd frees it (weak-reference finalizers on the storage);
  the stage's inputs, parameters and buffers are not counted;
* forward with grad on a detached input: ``Delta`` = bytes still alive afterwards (output plus
  everything autograd keeps), ``saved_size = max(Delta, output_size)`` (``abar``, rotor's
  ``x_bar``), ``fwd_overhead = peak - saved_size``;
* backward with an all-ones gradient: ``bwd_overhead = peak - input_size`` where ``peak``
  counts the new allocations of the backward; weight gradients are excluded (they belong to
  the weights budget, rotor pre-allocates them), so ``o_b`` is the model's
  "``delta^{i-1}`` + temporaries" of the checkpoint simulator;
* FLOPs are counted by :class:`torch.utils.flop_counter.FlopCounterMode` (forward and backward
  separately); times come from a :class:`~optmem.pytorch.devices.DeviceModel` roofline per
  kernel, summed per stage;
* the loss (a user-supplied ``loss_fn(output)``) is profiled like a stage: its forward and
  backward times make ``loss.bwd_time``, its peak minus ``delta^L`` is ``loss.bwd_overhead``.

Stages are those of the torch bridge, :func:`optmem.pytorch.extract.extract_stages` (the
children of an ``nn.Sequential``, nested containers flattened as rotor does, a stage that
starts in place merged into the one before), so that a plan computed on a profile runs on
the same stages with :mod:`optmem.pytorch.execute`. Inputs and outputs may be
tensors or tuples of tensors. Every chain records how it was obtained in ``provenance``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from optmem.chain import Chain
from optmem.pytorch.devices import DeviceModel, get_device
from optmem.pytorch.extract import extract_stages
from optmem.pytorch.memory import StorageTrace, input_bytes, storage_bytes, storage_key

_FREE_OPS = ("empty", "new_empty", "empty_like", "empty_strided")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class _Tracker(StorageTrace):
    """A :class:`~optmem.pytorch.memory.StorageTrace` that also times every kernel.

    Views and allocations (no data moved) cost nothing; other kernels cost the roofline time
    of their FLOPs and of the bytes they read and write.
    """

    def __init__(self, known: set[int], device: DeviceModel | None) -> None:
        super().__init__(known, count_aliases=True)
        self.device = device
        self.seconds = 0.0
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        in_keys = {storage_key(t) for t in ins}
        name = func._overloadpacket.__name__
        alias = not func._schema.is_mutable and all(storage_key(t) in in_keys for t in outs)
        if alias or name in _FREE_OPS:
            return out
        nbytes = sum(t.numel() * t.element_size() for t in (*ins, *outs))
        flops = 0
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
        dtype = str(outs[0].dtype if outs else ins[0].dtype).removeprefix("torch.") \
            if (outs or ins) else "float32"
        self.nbytes += nbytes
        if self.device is not None:
            self.seconds += self.device.op_time(flops=flops, nbytes=nbytes, dtype=dtype)
        return out


def _prepare(value: Any) -> tuple[list[torch.Tensor], Any]:
    """Detached leaves requiring grad, and non-leaf clones of them (in-place ops allowed).

    ``clone`` runs outside the tracker and its backward is an identity, so the stage sees a
    tensor it may modify in place (``ReLU(inplace=True)`` as a stage) at no measured cost.
    """
    leaves: list[torch.Tensor] = []

    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            t = t.detach()
            if t.is_floating_point():
                t.requires_grad_(True)
                leaves.append(t)
                t = t.clone()
        return t
    return leaves, tree_map(leaf, value)


def _run(fn: Callable[[], Any], known: set[int],
         device: DeviceModel | None) -> tuple[Any, _Tracker, int]:
    counter = FlopCounterMode(display=False)
    tracker = _Tracker(known, device)
    with counter, tracker:
        value = fn()
    return value, tracker, int(counter.get_total_flops())


def profile_stage(stage: nn.Module, x: Any, device: DeviceModel | None) -> tuple[dict, Any]:
    """Profile one stage on input ``x``; return the stage record and its detached output."""
    leaves, xin = _prepare(x)
    params = [p for p in stage.parameters()]
    known = {storage_key(t) for t in (*leaves, *_tensors(xin), *params, *stage.buffers())}
    for p in params:
        p.grad = None
    y, fwd, fwd_flops = _run(lambda: stage(xin), known, device)
    ys = _tensors(y)
    out_size = storage_bytes(y)
    # outputs that alias the input (in-place stages, carried skip tensors) are part of a^i
    carried = storage_bytes([t for t in ys if storage_key(t) in known])
    saved = max(fwd.alive() + carried, out_size)
    rec: dict[str, Any] = {
        "output_size": out_size, "saved_size": saved,
        "fwd_overhead": max(0, fwd.peak() - saved),
        "fwd_time": fwd.seconds * 1e3, "fwd_flops": fwd_flops, "fwd_bytes": fwd.nbytes,
    }
    outs = [t for t in ys if t.requires_grad]
    in_size = storage_bytes(leaves)
    if outs:
        grads = [torch.ones_like(t) for t in outs]
        known_b = known | {storage_key(t) for t in (*ys, *grads)}
        _, bwd, bwd_flops = _run(lambda: torch.autograd.backward(outs, grads), known_b, device)
        wgrads = [p.grad for p in params if p.grad is not None]
        rec.update(bwd_overhead=max(0, bwd.peak(wgrads) - in_size),
                   bwd_time=bwd.seconds * 1e3, bwd_flops=bwd_flops, bwd_bytes=bwd.nbytes)
        for p in params:
            p.grad = None
    else:
        rec.update(bwd_overhead=0, bwd_time=0.0, bwd_flops=0, bwd_bytes=0)
    out = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return rec, out


def profile_loss(loss_fn: Callable[[Any], torch.Tensor], x: Any,
                 device: DeviceModel | None) -> dict[str, Any]:
    """Profile ``loss_fn(a^L)`` forward + backward: the chain's ``Loss`` op."""
    leaves, xin = _prepare(x)
    known = {storage_key(t) for t in (*leaves, *_tensors(xin))}
    holder: dict[str, Any] = {}

    def both() -> None:
        loss = loss_fn(xin)
        torch.autograd.backward(loss)
        holder["grads"] = [t.grad for t in leaves if t.grad is not None]

    _, tracker, flops = _run(both, known, device)
    delta = storage_bytes(holder["grads"])
    return {"bwd_time": tracker.seconds * 1e3,
            "bwd_overhead": max(0, tracker.peak() - delta), "flops": flops}


def profile_meta(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: DeviceModel | str | None = "v100",
    name: str = "chain",
    extra: dict[str, Any] | None = None,
) -> Chain:
    """Profile ``model`` (an ``nn.Sequential``) on ``sample`` and return its chain.

    Parameters
    ----------
    model
        Cut into stages by :func:`~optmem.pytorch.extract.extract_stages`. Build it on the
        meta device for large inputs.
    sample
        The chain input ``a^0`` (tensor or tuple), on the model's device.
    loss_fn
        Maps the last output to a scalar loss; ``None`` gives a free loss (rotor default).
    device
        Device model (or its name) timing the kernels; ``None`` leaves every time at 0.
    name
        Chain name.
    extra
        Top-level fields added to the chain file (``description``, ...).

    Returns
    -------
    Chain
        Bytes and milliseconds; per-stage ``fwd_flops``/``bwd_flops``/``params`` kept as
        extra stage fields; ``provenance`` and ``parameters`` (count) as top-level fields.
    """
    dev = get_device(device) if isinstance(device, str) else device
    stages = [(st.name, st.module) for st in extract_stages(model)]
    seen_params: set[int] = set()
    records, names = [], []
    x = sample
    input_size = input_bytes(sample)
    total_params = 0
    for stage_name, stage in stages:
        rec, x = profile_stage(stage, x, dev)
        own = [p for p in stage.parameters() if id(p) not in seen_params]
        seen_params.update(id(p) for p in own)
        rec["params"] = sum(p.numel() for p in own)
        rec["weight_size"] = sum(p.numel() * p.element_size() for p in own)
        total_params += rec["params"]
        records.append(rec)
        names.append(stage_name)
    loss = profile_loss(loss_fn, x, dev) if loss_fn is not None else \
        {"bwd_time": 0.0, "bwd_overhead": 0, "flops": 0}
    known = ("fwd_time", "bwd_time", "output_size", "saved_size", "fwd_overhead",
             "bwd_overhead", "weight_size")
    data: dict[str, Any] = dict(extra or {})
    data.update({
        "format": "optmem.chain/1", "name": name, "time_unit": "ms", "memory_unit": "B",
        "input_size": input_size,
        "parameters": total_params,
        "provenance": {
            "sizes": "exact storage bytes on the meta device (optmem.pytorch.shapeprofile, "
                     "rotor measurement protocol)",
            "flops": "torch.utils.flop_counter.FlopCounterMode",
            "times": ({"method": "roofline estimate", "device": dev.describe()}
                      if dev is not None else {"method": "none (all times 0)"}),
            "torch": torch.__version__,
            "loss_flops": loss["flops"],
        },
        "stages": [
            {"name": n, **{k: r[k] for k in known},
             **{k: r[k] for k in ("params", "fwd_flops", "bwd_flops")}}
            for n, r in zip(names, records, strict=True)
        ],
        "loss": {"bwd_time": loss["bwd_time"], "bwd_overhead": loss["bwd_overhead"]},
    })
    return Chain.from_dict(data)


def device_time_model(device: DeviceModel | str) -> Callable[[nn.Module, Any, Any],
                                                              tuple[float, float]]:
    """A ``time_model`` for :func:`optmem.pytorch.profile.profile_chain` (meta device).

    ``time_model(stage, input, output) -> (fwd_ms, bwd_ms)`` re-runs the stage on its
    input under the roofline of ``device`` (a :class:`~optmem.pytorch.devices.DeviceModel`
    or a name such as ``"a100"``), as :func:`profile_meta` does.
    """
    dev = get_device(device) if isinstance(device, str) else device

    def model(stage: nn.Module, x: Any, y: Any) -> tuple[float, float]:
        del y
        rec, _ = profile_stage(stage, x, dev)
        return float(rec["fwd_time"]), float(rec["bwd_time"])

    return model
