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

Values between stages may be tensors or tuples of tensors; stages may read side inputs
(:mod:`optmem.pytorch.context`): nothing is re-run, so the call's context is enough.
:class:`HostCopies` (the copy engine) is shared with :mod:`optmem.pytorch.remat_offload`.

A tensor that is unpacked while still on the host (the plan did not prefetch it) is copied
back synchronously and counted in :attr:`OffloadedChain.late_unpacks`. Gradients are those of
the unmodified chain: saved tensors are copied bit for bit.

Only store-all compute plans are executed here (``F_all``, ``Loss``, ``B`` in order, plus
transfers); recomputation is executed by :mod:`optmem.pytorch.execute`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from optmem.errors import PlanError
from optmem.plan import AnyOp, Op, OpKind, TransferKind, TransferOp, parse_mixed_plan
from optmem.pytorch.execute import (
    CompileRequest,
    StageCalls,
    backward_outside_dynamo,
    modified_in_place,
    run_in_order,
)
from optmem.pytorch.extract import Stage, value_tensors

__all__ = ["HostCopies", "OffloadedChain", "check_unmodified", "kept_storages",
           "offload_plan_actions", "storage_ptr", "value_device", "weight_test"]

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


def storage_bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat ``uint8`` tensor over all of ``storage`` (a view: nothing is allocated)."""
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def view_in(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """``like``'s view (dtype, offset, sizes, strides) of another ``storage`` of its size.

    Examples
    --------
    >>> x = torch.arange(12.0).view(3, 4)[:, 1:3]
    >>> y = view_in(x.untyped_storage(), x)
    >>> y.stride() == x.stride() and y.storage_offset() == x.storage_offset()
    True
    """
    out = torch.empty(0, dtype=like.dtype, device=storage.device)
    return out.set_(storage, like.storage_offset(), like.size(), like.stride())


class HostCopies:
    """Copies between the compute device and host memory, one storage at a time.

    On CUDA: on a dedicated side stream, into pinned host buffers, ``non_blocking``; each
    copy waits for the kernels that produced its source (an event recorded on the compute
    stream) and records an event of its own; the source's memory is kept from reuse by the
    caching allocator until the side stream is done with it (``record_stream``). A copy
    brought back is used on the compute stream only after :meth:`ready` (the compute stream
    waits for its event). Elsewhere (CPU, for tests): synchronous copies, no events.

    **One storage, one copy.** A tensor is moved with its whole storage, and what comes
    back is the same view (dtype, offset, sizes, strides) of the copied storage: a backward
    kernel gets its saved tensor to the bit and in layout (a contiguous copy of a strided
    view computes in another order: wav2vec2's ``conv(x)[:, :, :-1]``). Every tensor of a
    storage moved while that storage is alive, unchanged (the version counter its views
    share), gets a view of the same host copy; every host view brought back while the first
    device copy of its host storage is alive gets a view of that device copy. So a plan
    holds on the device what the model holds and what the chain counts (a storage, once),
    however many views of it autograd saved. Until stop 77 the copies were per view
    (keyed by storage, offset, sizes and strides): the views of one storage that autograd
    saves (a ``Linear``'s input ``x.view(-1, d)`` beside ``x``, attention's softmax output
    and its ``bmm`` operand ``p.view(b * h, s, s)``) came back as separate device copies:
    a tiny T5 in eval mode at ``memory_limit="min"`` peaked at 125,736 B under
    ``op.offload`` and 132,588 B under ``op.remat_offload``, above the documented terms,
    where the same plans now hold 111,528 and 117,228 B (in train mode dropout makes new
    storages between most such views). Copies are remembered through weak references
    only: nothing here keeps a tensor alive.

    ``observers`` (class-wide) are called with every new host copy
    (:func:`optmem.pytorch.memory.measure_training_peak` with ``host_copies=False`` leaves
    them out: the memory an offload plan holds on its compute device).

    Examples
    --------
    >>> copies = HostCopies(None)
    >>> x = torch.randn(4, 6)
    >>> a, _ = copies.to_host(x)
    >>> b, _ = copies.to_host(x.view(-1)[6:])  # another view of the same storage
    >>> a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    True
    >>> back, _ = copies.to_device(b, x.device)
    >>> torch.equal(back, x.view(-1)[6:]), back.storage_offset()
    (True, 6)
    """

    observers: ClassVar[list[Callable[[torch.Tensor], None]]] = []

    def __init__(self, device: torch.device | None) -> None:
        self.stream = (torch.cuda.Stream(device=device)
                       if device is not None and device.type == "cuda" else None)
        self._hosts: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
        self._devices: dict[tuple[int, str], tuple[Any, Any, Any]] = {}

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host copy of ``t`` (a view of its storage's) and the event that marks it done."""
        # no storage to share (sparse, nested, a DTensor: its placements): a copy of its own
        key = None if hasattr(t, "_local_tensor") else _storage_version(t)
        if key is None:
            alone = t.detach().to("cpu", copy=True)
            for observe in self.observers:
                observe(alone)
            return alone, None
        source = t.untyped_storage()
        known = self._hosts.get(key)
        if known is not None and known[0]() is source and (kept := known[1]()) is not None:
            return view_in(kept, t), known[2]
        flat, event = self._copy_to_host(source, t.device)
        for observe in self.observers:
            observe(flat)
        host = flat.untyped_storage()
        self._hosts[key] = (weakref.ref(source), weakref.ref(host), event)
        return view_in(host, t), event

    def _copy_to_host(self, source: torch.UntypedStorage, device: torch.device
                      ) -> tuple[torch.Tensor, Any]:
        src = storage_bytes_view(source, device)
        if self.stream is None:
            host = torch.empty(src.numel(), dtype=torch.uint8)
            host.copy_(src)
            return host, None
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A device copy of ``host`` (a view of its storage's) and the event that marks it."""
        if hasattr(host, "_local_tensor") or storage_ptr(host) is None:  # a DTensor's copy
            return host.to(device, copy=True), None
        source = host.untyped_storage()
        key = (int(source.data_ptr()), str(device))
        known = self._devices.get(key)
        if known is not None and known[0]() is source and (dev := known[1]()) is not None:
            return view_in(dev, host), known[2]
        flat, event = self._copy_to_device(source, device)
        dev = flat.untyped_storage()
        self._devices[key] = (weakref.ref(source), weakref.ref(dev), event)
        return view_in(dev, host), event

    def _copy_to_device(self, source: torch.UntypedStorage, device: torch.device
                        ) -> tuple[torch.Tensor, Any]:
        src = storage_bytes_view(source, source.device)
        if self.stream is None or device.type != "cuda":
            dev = torch.empty(src.numel(), dtype=torch.uint8, device=device)
            dev.copy_(src)
            return dev, None
        with torch.cuda.stream(self.stream):  # after the offload of ``host`` (same stream)
            dev = torch.empty(src.numel(), dtype=torch.uint8, device=device)
            dev.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return dev, done

    @staticmethod
    def ready(t: torch.Tensor, event: Any) -> torch.Tensor:
        """``t``, usable on the compute stream (which waits for ``event``)."""
        if event is not None:
            stream = torch.cuda.current_stream(t.device)
            stream.wait_event(event)
            t.record_stream(stream)
        return t


def _storage_version(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors' storages the same data: the storage and the version.

    The version counter (shared by a tensor and its views): a storage updated in place
    after its first copy (saved tensor hooks bypass autograd's version check) is new data
    and gets a copy of its own.
    """
    ptr = storage_ptr(t)
    if ptr is None:
        return None
    return (ptr, str(t.device), t._version)


def storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (``None`` for tensors without one).

    A ``DTensor`` (tensor parallelism) has none of its own: its local tensor's. Before (stop
    85) it had none, so a tensor-parallel weight was no weight (O.6) and moved to the host
    like an activation; under FSDP2 on a 2D mesh the copy crashed the process (SIGSEGV).
    """
    t = getattr(t, "_local_tensor", t)  # a DTensor's local tensor
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:  # pragma: no cover - tensors without storage
        return None


def kept_storages(module: nn.Module) -> set[int]:
    """Storages never transferred.

    Parameters and buffers (O.6) and the side inputs of the running call (computed once per
    call, shared by the stages that save them).
    """
    from optmem.pytorch.context import current_side_inputs_or_none

    tensors = [*module.parameters(), *module.buffers()]
    ctx = current_side_inputs_or_none()
    if ctx is not None:
        tensors += [t for v in ctx.values() for t in value_tensors(v)]
    return {p for t in tensors if (p := storage_ptr(t)) is not None}


def weight_test(weights: set[int], stage: nn.Module) -> Callable[[int | None], bool]:
    """Whether a storage saved while ``stage`` runs is a weight (never transferred, O.6).

    Parameters
    ----------
    weights
        The storages of the parameters, buffers and side inputs when the call started
        (:func:`kept_storages`).
    stage
        The stage module that runs.

    Returns
    -------
    Callable[[int | None], bool]
        The test of a storage address (``None``: no storage, not a weight).

    Notes
    -----
    A stage sharded by FSDP2 (``fully_shard`` on it or on a submodule) swaps in freshly
    gathered parameters while it runs, after the call started: their storages are none of
    ``weights``, so the stage's current parameters are read at each test. Before (stop 77)
    they were taken for activations, copied to the host after the unit had freed them again,
    and the backward read garbage (gradients off by up to 1e28).
    """
    from optmem.pytorch.process_groups import is_fsdp_module

    if not is_fsdp_module(stage):
        return lambda ptr: ptr is not None and ptr in weights

    def test(ptr: int | None) -> bool:
        if ptr is None:
            return False
        return ptr in weights or any(storage_ptr(p) == ptr for p in stage.parameters())

    return test


def value_device(value: Any, default: nn.Module | None = None) -> torch.device:
    """The device of the first tensor of ``value`` (else of ``default``'s parameters)."""
    for t in value_tensors(value):
        return t.device
    param = next(default.parameters(), None) if default is not None else None
    return param.device if param is not None else torch.device("cpu")


def check_unmodified(modified: bool, original: torch.Tensor | None, version: int) -> None:
    """Autograd's check of a saved tensor, which saved-tensor hooks turn off.

    ``modified``: changed in place before it was copied to the host; ``original``: the
    saved tensor itself (``None`` once only copies are left), saved at ``version``.
    """
    if modified:
        raise modified_in_place("a tensor the forward saved was modified in place before "
                                "the offload plan copied it to the host")
    if original is not None and original._version != version:
        raise modified_in_place(
            f"a tensor the forward saved {list(original.shape)} is at version "
            f"{original._version}; expected version {version} instead")


@dataclass
class _Packed:
    """One saved tensor: on the device, on the host, or on its way."""

    device_tensor: torch.Tensor | None
    device: torch.device
    host: torch.Tensor | None = None
    event: Any = None  # completion of the last copy
    version: int = 0  # the saved tensor's version when autograd saved it
    modified: bool = False  # modified in place before it was copied to the host


@dataclass
class _Group:
    """The saved tensors of one value, held weakly.

    Autograd owns the packed tensors (until the node that saved one has run its backward);
    the group only finds them for the value's transfers, so a tensor is freed once its
    backward ran, not kept (with the prefetched device copies) until the next forward.
    """

    refs: list[weakref.ref[_Packed]] = field(default_factory=list)
    state: str = "device"  # device -> host -> prefetched

    @property
    def packed(self) -> list[_Packed]:
        """The packed tensors autograd still holds."""
        return [p for r in self.refs if (p := r()) is not None]


@dataclass
class _Call:
    """What one training call of :class:`OffloadedChain` moves: its values' saved tensors.

    Each call has its own, so two forwards before one backward (two losses summed) keep
    their saved tensors apart; the hooks of a call see only its own groups.
    """

    weights: set[int]
    copies: HostCopies
    groups: dict[Key, _Group] = field(default_factory=dict)


class OffloadedChain(StageCalls, nn.Module):
    """Train a chain of stages following an offload plan.

    Parameters
    ----------
    stages
        The stages (each takes and returns one value: a tensor or a tuple of tensors), in
        order.
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

    def __init__(self, stages: Sequence[Stage | nn.Module], plan: Sequence[AnyOp | str]):
        super().__init__()
        self.stage_names = [s.name if isinstance(s, Stage) else f"stage{k + 1}"
                            for k, s in enumerate(stages)]
        self.stages = nn.ModuleList([s.module if isinstance(s, Stage) else s for s in stages])
        self.plan = parse_mixed_plan(plan)
        self.after_forward, self.before_backward = offload_plan_actions(self.plan, len(stages))
        self.late_unpacks = 0
        self.transfers: list[str] = []
        self._groups: dict[Key, _Group] = {}

    def set_plan(self, plan: Sequence[AnyOp | str]) -> None:
        """Replace the plan."""
        self.plan = parse_mixed_plan(plan)
        self.after_forward, self.before_backward = offload_plan_actions(self.plan,
                                                                        len(self.stages))

    def __getstate__(self) -> dict[str, Any]:
        """Copied or pickled (``torch.save``): without the latest call's saved-tensor groups.

        They are weak references to what autograd holds (:class:`_Group`), which pickle
        refuses: ``torch.save`` of a wrapper that had trained one step failed with "cannot
        pickle 'weakref.ReferenceType' object" (stop 75 audit). A copy starts with none, as
        a new wrapper does; :meth:`resident` then reports nothing until its next call.
        """
        state = dict(super().__getstate__())
        state["_groups"] = {}
        return state

    # ------------------------------------------------------------------ forward
    def _forward(self, x: Any, compiled: CompileRequest) -> Any:
        functions = self.stage_functions(compiled)
        if not torch.is_grad_enabled():
            return run_in_order(functions, x)
        # one state per call: a second forward before the first one's backward (two losses
        # summed, a contrastive pair) must not take over the first call's saved tensors
        call = _Call(kept_storages(self), HostCopies(value_device(x, self)))
        self._groups = call.groups  # the latest call's, for :meth:`resident`
        self.transfers = []
        self.late_unpacks = 0
        self._issue(call, self.after_forward.get(0, []))
        for i, stage in enumerate(functions, start=1):
            inputs = {p for t in value_tensors(x) if (p := storage_ptr(t)) is not None}
            is_weight = weight_test(call.weights, self.stages[i - 1])
            with torch.autograd.graph.saved_tensors_hooks(self._packer(call, i, inputs,
                                                                       is_weight),
                                                          self._unpack_with(call)):
                x = stage(x)
            self._issue(call, self.after_forward.get(i, []))
            actions = self.before_backward.get(i, [])  # i == L: listed after Loss
            if actions and torch.is_grad_enabled():
                self._hook_once(call, [t for t in value_tensors(x) if t.requires_grad],
                                actions)
        return x

    @staticmethod
    def _packer(call: _Call, i: int, inputs: set[int],
                is_weight: Callable[[int | None], bool]) -> Any:
        def pack(t: torch.Tensor) -> _Packed:
            ptr = storage_ptr(t)
            # detached: a saved output comes with its grad_fn, the node that holds this
            # packed object; kept as it is, that cycle runs through C++ nodes Python's
            # collector never sees, and a forward whose graph was dropped without a
            # backward kept every saved tensor for good (before stop 80)
            packed = _Packed(t.detach(), t.device, version=t._version)
            if is_weight(ptr):
                return packed  # weights and buffers are never transferred (O.6)
            key = _key(i - 1) if ptr is not None and ptr in inputs else ("abar", i)
            call.groups.setdefault(key, _Group()).refs.append(weakref.ref(packed))
            return packed

        return pack

    def _hook_once(self, call: _Call, outputs: list[torch.Tensor],
                   actions: list[TransferOp]) -> None:
        """Issue ``actions`` when the first gradient of the stage's outputs arrives."""
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self._issue(call, actions)

        outside = backward_outside_dynamo(hook)
        for t in outputs:
            t.register_hook(outside)

    # ------------------------------------------------------------------ transfers
    def _issue(self, call: _Call, actions: list[TransferOp]) -> None:
        for op in actions:
            group = call.groups.get(op.key)
            self.transfers.append(str(op))
            if group is None:  # nothing saved under this value (e.g. a stage without tape)
                continue
            if op.kind is TransferKind.OFFLOAD:
                self._offload(call.copies, group)
            else:
                self._prefetch(call.copies, group)

    @staticmethod
    def _offload(copies: HostCopies, group: _Group) -> None:
        if group.state != "device":
            raise PlanError("offload of a value that is not on the device")
        for p in group.packed:
            t = p.device_tensor
            if t is None:
                continue
            p.modified = p.modified or t._version != p.version
            p.host, p.event = copies.to_host(t)
            p.device_tensor = None  # the device memory returns once the copy is done
        group.state = "host"

    @staticmethod
    def _prefetch(copies: HostCopies, group: _Group) -> None:
        if group.state != "host":
            raise PlanError("prefetch of a value that is not on the host")
        for p in group.packed:
            if p.host is not None:
                p.device_tensor, p.event = copies.to_device(p.host, p.device)
        group.state = "prefetched"

    def _unpack_with(self, call: _Call) -> Callable[[_Packed], torch.Tensor]:
        def unpack(p: _Packed) -> torch.Tensor:
            check_unmodified(p.modified, p.device_tensor if p.host is None else None,
                             p.version)
            if p.device_tensor is None:  # never prefetched: copied back now
                self.late_unpacks += 1
                assert p.host is not None
                p.device_tensor, p.event = call.copies.to_device(p.host, p.device)
            t = HostCopies.ready(p.device_tensor, p.event)
            p.event = None
            return t

        return backward_outside_dynamo(unpack)

    # ------------------------------------------------------------------ introspection
    def resident(self) -> dict[Key, int]:
        """Bytes of saved tensors currently held on the device, per value."""
        out = {}
        for key, group in self._groups.items():
            out[key] = sum(p.device_tensor.untyped_storage().nbytes()
                           for p in group.packed if p.device_tensor is not None)
        return out
