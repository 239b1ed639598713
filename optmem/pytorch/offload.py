"""Execute an offload plan (CONTRACT "Offload plans") with ``saved_tensors_hooks``.

:class:`OffloadedChain` runs a chain of stages with the store-all compute sequence and moves
the tensors autograd saves to host memory and back as the plan says:

* **Values.** While stage ``i`` runs forward, every tensor autograd saves is packed into
  the group of value ``abar i`` (its tape), except tensors sharing storage with the stage's
  input ``a^{i-1}``: those belong to value ``i - 1`` (``a 0`` for the chain input, else
  ``abar i-1``, whose size contains ``a^{i-1}``), as in the chain model where ``abar_{k}`` is
  the input of layer ``k + 1``. Tensors that share storage with a parameter or a buffer
  (a ``Linear`` saves its weight) are never transferred (O.6).
* **Issue points.** Transfers listed after ``F_all i`` are issued right after stage ``i``'s
  forward; those listed after ``Loss`` or a ``B`` op are issued from a gradient hook on the
  stage output, i.e. when ``delta^i`` is ready, just before ``B i`` runs.
* **CUDA** (the chain runs on a CUDA device): transfers run on a dedicated side stream, the
  host copies live in pinned buffers (``non_blocking`` copies, overlapped with compute),
  events order them (an offload waits for the producing kernels; a saved tensor is unpacked
  only after its prefetch event; ``record_stream`` keeps the caching allocator from reusing
  memory still being copied). The GPU copy of an offloaded tensor is dropped once the copy
  is issued; its memory returns to the allocator when the side stream is done with it.
* **CPU** (tests): the same bookkeeping with synchronous host copies (``clone``), so the
  semantics (which tensor lives where, when) are exercised without a GPU.

A tensor that is unpacked while still on the host (the plan did not prefetch it) is copied
back synchronously and counted in :attr:`OffloadedChain.late_unpacks`. Gradients are those of
the unmodified chain: saved tensors are copied bit for bit.

Only store-all compute plans are executed here (``F_all``, ``Loss``, ``B`` in order, plus
transfers); recomputation is executed by :mod:`optmem.pytorch.execute`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optmem.errors import PlanError
from optmem.plan import AnyOp, Op, OpKind, TransferKind, TransferOp, parse_mixed_plan

__all__ = ["OffloadedChain", "offload_plan_actions"]

Key = tuple[str, int]


def _key(k: int) -> Key:
    return ("a", 0) if k == 0 else ("abar", k)


def offload_plan_actions(plan: Sequence[AnyOp | str], length: int
                         ) -> tuple[dict[int, list[TransferOp]], dict[int, list[TransferOp]]]:
    """Split a store-all offload plan into issue points.

    Returns ``(after_forward, before_backward)``: transfers issued after the forward of stage
    ``i`` (an offload of value ``k`` no earlier than after stage ``k + 1``, whose forward
    packs the last of its tensors), and transfers issued when ``delta^i`` is ready (before
    ``B i``; key ``L`` also takes those listed after ``Loss``).

    Raises
    ------
    PlanError
        If the compute ops are not the store-all sequence.
    """
    ops = parse_mixed_plan(plan)
    compute = [op for op in ops if isinstance(op, Op)]
    expected = [Op(OpKind.F_ALL, i) for i in range(1, length + 1)] + [Op(OpKind.LOSS)] + \
        [Op(OpKind.B, i) for i in range(length, 0, -1)]
    if compute != expected:
        raise PlanError("the torch offload executor runs store-all plans only (F_all 1..L, "
                        "Loss, B L..1 with transfers); use optmem.pytorch.execute for "
                        "recomputation")
    after_forward: dict[int, list[TransferOp]] = {}
    before_backward: dict[int, list[TransferOp]] = {}
    where: tuple[str, int] = ("fwd", 0)
    for op in ops:
        if isinstance(op, TransferOp):
            if where[0] == "fwd":
                # the value's tensors are packed by its forward reader (stage k + 1): an
                # offload listed before it is issued right after it (the simulator frees
                # the GPU copy only then too)
                at = where[1]
                if op.kind is TransferKind.OFFLOAD:
                    at = max(at, min(op.stage + 1, length))
                after_forward.setdefault(at, []).append(op)
            else:
                before_backward.setdefault(where[1], []).append(op)
        elif op.kind is OpKind.F_ALL:
            where = ("fwd", op.stage)
        elif op.kind is OpKind.LOSS:
            where = ("bwd", length)
        else:  # B i: what follows is issued before B i-1
            where = ("bwd", op.stage - 1)
    return after_forward, before_backward


@dataclass
class _Packed:
    """One saved tensor: on the device, on the host, or on its way."""

    device_tensor: torch.Tensor | None
    host: torch.Tensor | None = None
    offload_event: Any = None
    prefetch_event: Any = None


@dataclass
class _Group:
    packed: list[_Packed] = field(default_factory=list)
    state: str = "device"  # device -> host -> prefetched


class OffloadedChain(nn.Module):
    """Train a chain of stages following an offload plan.

    Parameters
    ----------
    stages
        The stages (each takes and returns one tensor), in order.
    plan
        A store-all offload plan (op strings or ops), e.g. ``Result.plan`` of
        ``solve(OffloadProblem(...), "dp")``.

    Examples
    --------
    >>> net = OffloadedChain([nn.Linear(4, 4), nn.ReLU()],
    ...     ["F_all 1", "offload a 0", "F_all 2", "Loss", "B 2", "prefetch a 0", "B 1"])
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> net(x).sum().backward()
    >>> x.grad.shape
    torch.Size([3, 4])
    """

    def __init__(self, stages: Sequence[nn.Module], plan: Sequence[AnyOp | str]):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.plan = parse_mixed_plan(plan)
        self.after_forward, self.before_backward = offload_plan_actions(self.plan, len(stages))
        self.late_unpacks = 0
        self.transfers: list[str] = []
        self._groups: dict[Key, _Group] = {}
        self._weights: set[int] = set()
        self._stream: Any = None

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the stages, packing saved tensors by value and issuing transfers."""
        self._groups = {}
        self.transfers = []
        self.late_unpacks = 0
        self._weights = {t.untyped_storage().data_ptr()
                         for t in (*self.parameters(), *self.buffers())}
        if x.is_cuda:
            self._stream = torch.cuda.Stream(device=x.device)
        self._issue(self.after_forward.get(0, []))
        for i, stage in enumerate(self.stages, start=1):
            inp = x
            with torch.autograd.graph.saved_tensors_hooks(self._packer(i, inp), self._unpack):
                x = stage(x)
            self._issue(self.after_forward.get(i, []))
            if torch.is_grad_enabled() and x.requires_grad:
                actions = self.before_backward.get(i, [])  # i == L: listed after Loss
                if actions:
                    x.register_hook(self._hook(actions))
        return x

    def _packer(self, i: int, inp: torch.Tensor) -> Any:
        try:
            input_ptr = inp.untyped_storage().data_ptr()
        except RuntimeError:  # pragma: no cover - tensors without storage
            input_ptr = None

        def pack(t: torch.Tensor) -> _Packed:
            try:
                ptr = t.untyped_storage().data_ptr()
            except RuntimeError:  # pragma: no cover - tensors without storage
                ptr = None
            packed = _Packed(t)
            if ptr is not None and ptr in self._weights:
                return packed  # weights and buffers are never transferred (O.6)
            key = _key(i - 1) if ptr is not None and ptr == input_ptr else ("abar", i)
            self._groups.setdefault(key, _Group()).packed.append(packed)
            return packed

        return pack

    def _hook(self, actions: list[TransferOp]) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._issue(actions)

        return hook

    # ------------------------------------------------------------------ transfers
    def _issue(self, actions: list[TransferOp]) -> None:
        for op in actions:
            group = self._groups.get(op.key)
            self.transfers.append(str(op))
            if group is None:  # nothing saved under this value (e.g. a stage without tape)
                continue
            if op.kind is TransferKind.OFFLOAD:
                self._offload(group)
            else:
                self._prefetch(group)

    def _offload(self, group: _Group) -> None:
        if group.state != "device":
            raise PlanError("offload of a value that is not on the device")
        for p in group.packed:
            t = p.device_tensor
            if t is None:
                continue
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    host = torch.empty_like(t, device="cpu", pin_memory=True)
                    host.copy_(t, non_blocking=True)
                    t.record_stream(self._stream)
                    done = torch.cuda.Event()
                    done.record(self._stream)
                p.offload_event = done
            else:
                host = t.detach().to("cpu", copy=True)
            p.host, p.device_tensor = host, None
        group.state = "host"

    def _prefetch(self, group: _Group) -> None:
        if group.state != "host":
            raise PlanError("prefetch of a value that is not on the host")
        for p in group.packed:
            if p.host is None:
                continue
            p.device_tensor, p.prefetch_event = self._to_device(p)
        group.state = "prefetched"

    def _device(self) -> torch.device:
        param = next(self.parameters(), None)
        if self._stream is not None:
            return self._stream.device
        return param.device if param is not None else torch.device("cpu")

    def _to_device(self, p: _Packed) -> tuple[torch.Tensor, Any]:
        host = p.host
        assert host is not None
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                dev = torch.empty_like(host, device=self._stream.device)
                dev.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            return dev, ev
        return host.to(self._device(), copy=True), None

    def _unpack(self, p: _Packed) -> torch.Tensor:
        if p.device_tensor is None:  # never prefetched: synchronous copy back
            self.late_unpacks += 1
            p.device_tensor, p.prefetch_event = self._to_device(p)
        t = p.device_tensor
        if p.prefetch_event is not None:
            torch.cuda.current_stream(t.device).wait_event(p.prefetch_event)
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    # ------------------------------------------------------------------ introspection
    def resident(self) -> dict[Key, int]:
        """Bytes of saved tensors currently held on the device, per value."""
        out = {}
        for key, group in self._groups.items():
            out[key] = sum(p.device_tensor.untyped_storage().nbytes()
                           for p in group.packed if p.device_tensor is not None)
        return out
