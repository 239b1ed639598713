"""Execute a combined remat + offload plan: recomputation and transfers in one executor.

:class:`RematOffloadChain` is the checkpoint executor of :mod:`optmem.pytorch.execute`
(:class:`~optmem.pytorch.execute.CheckpointedChain`: every compute op of CONTRACT section 3,
RNG and buffer handling for re-run stages) extended with the transfer ops of CONTRACT
"Offload plans", with the value grouping of :mod:`optmem.pytorch.offload`:

* ``abar i``: the tensors autograd saves while ``F_all i`` runs (packed through
  ``saved_tensors_hooks``; weights and buffers are never moved, O.6) and the stored output
  ``a^i`` of that stage; a re-run ``F_all i`` starts a new group;
* ``a i``: the stored activation ``a^i`` of a ``F_ck``/``F_none`` (``a 0``: the input);
* a transfer is issued just before the compute op it is listed before (transfers listed
  before ``Loss`` at the end of the forward, those after it when the backward starts).

Copies go through :class:`optmem.pytorch.offload.HostCopies`: on CUDA on a side stream
into pinned host memory, ordered by events (a value brought back is used only after its
copy's event; a stage reading a stored value that was brought back waits for it), so the
link overlaps compute as the plan intends; on CPU synchronous clones (tests). A value read
or unpacked while on the host is copied back on the spot and counted in
:attr:`RematOffloadChain.late_reads`; :attr:`RematOffloadChain.moved_out` counts the values
moved to the host. Gradients are
those of the unmodified chain: every copy is bit for bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from optmem.errors import PlanError
from optmem.plan import AnyOp, Op, OpKind, TransferKind, TransferOp, parse_mixed_plan
from optmem.pytorch.execute import CheckpointedChain, PlanRunner
from optmem.pytorch.extract import Stage, value_tensors
from optmem.pytorch.offload import (
    HostCopies,
    check_unmodified,
    kept_storages,
    storage_ptr,
    value_device,
    weight_test,
)

__all__ = ["RematOffloadChain", "split_mixed_plan"]

Key = tuple[str, int]


def split_mixed_plan(plan: Sequence[AnyOp | str]) -> tuple[tuple[Op, ...],
                                                          dict[int, list[TransferOp]]]:
    """Compute ops, and the transfers listed before each compute op (by compute index)."""
    ops: list[Op] = []
    before: dict[int, list[TransferOp]] = {}
    for op in parse_mixed_plan(plan):
        if isinstance(op, TransferOp):
            before.setdefault(len(ops), []).append(op)
        else:
            ops.append(op)
    return tuple(ops), before


@dataclass
class _Packed:
    tensor: torch.Tensor
    device: torch.device
    on_host: bool = False
    event: Any = None  # completion of the last copy
    version: int = 0  # the saved tensor's version when autograd saved it
    moved: bool = False  # ``tensor`` is a copy (the saved tensor went to the host)
    modified: bool = False  # modified in place before it was copied to the host


@dataclass
class _Group:
    """The tensors autograd saved during one ``F_all``, held weakly (autograd owns them).

    A tensor is freed once the backward that reads it ran, as without the plan; before,
    the groups kept every saved tensor (and every copy brought back) until the plan's
    backward ended.
    """

    refs: list[weakref.ref[_Packed]] = field(default_factory=list)
    on_host: bool = False

    @property
    def packed(self) -> list[_Packed]:
        """The packed tensors autograd still holds."""
        return [p for r in self.refs if (p := r()) is not None]


class _OffloadRunner(PlanRunner):
    """The checkpoint runner, plus transfers and saved-tensor groups.

    Not fused: each stage's saved tensors form a group of their own (moved on its own).
    A backward that keeps the graph (``retain_graph=True``) does not run the plan, whose
    transfers move the forward's values, but re-runs the stages as one graph
    (:meth:`~optmem.pytorch.execute.PlanRunner.replay_backward`).
    """

    owner: RematOffloadChain
    fusable = False
    joint_reruns = False
    retains = False  # transfers move the forward's values: a retained backward replays

    def __init__(self, owner: RematOffloadChain, plan: tuple[Op, ...], n_stages: int) -> None:
        super().__init__(owner, plan, n_stages)
        self.groups: dict[int, _Group] = {}
        # tensors saved by an F_all of stage i + 1 that alias its input a^i: they are a^i
        # (the chain's tapes exclude the stage input), so they move with slot i
        self.input_groups: dict[int, _Group] = {}
        self.host_slots: dict[int, list[torch.device | None]] = {}
        self.slot_events: dict[int, list[Any]] = {}  # copies of a slot not waited for yet
        self.copies = HostCopies(None)
        self.deferred: dict[int, list[Key]] = {}  # offloads waiting for a listed reader

    # -------------------------------------------------------------- transfers
    def _last_reader(self, key: Key, k: int) -> int | None:
        """Index of the last compute op from ``k`` on that reads value ``key``.

        Only ops before the key's next transfer count; the GPU copy lives until that op has
        run (as in the simulator).
        """
        kind, i = key
        last = None
        for j in range(k, len(self.plan)):
            if any(t.key == key for t in self.owner.transfers.get(j, []) if j > k):
                break
            op = self.plan[j]
            if op.kind is OpKind.LOSS:
                hit = i == self.n
            elif op.kind is OpKind.B:
                hit = kind == "abar" and op.stage == i
            else:
                hit = op.stage == i + 1
            if hit:
                last = j
        return last

    def _issue(self, k: int) -> None:
        for op in self.owner.transfers.get(k, []):
            self.owner.issued.append(str(op))
            if op.kind is TransferKind.OFFLOAD:
                reader = self._last_reader(op.key, k)
                if reader is not None:
                    self.deferred.setdefault(reader, []).append(op.key)
                    continue
                self._move_out(op.key)
            else:
                kind, i = op.key
                if kind == "abar" and i in self.groups:
                    self._group_back(self.groups[i])
                if i in self.input_groups:
                    self._group_back(self.input_groups[i])
                self._slot_back(i)

    def _move_out(self, key: Key) -> None:
        kind, i = key
        self.owner.moved_out += 1
        groups = [self.groups.get(i) if kind == "abar" else None, self.input_groups.get(i)]
        for group in groups:
            if group is not None:
                for p in group.packed:
                    if not p.on_host:
                        p.modified = p.modified or (not p.moved
                                                    and p.tensor._version != p.version)
                        p.tensor, p.event = self.copies.to_host(p.tensor)
                        p.on_host = p.moved = True
                group.on_host = True
        self._slot_to_host(i)

    def _slot_to_host(self, i: int) -> None:
        slot = self.storage.get(i)
        if slot is None or slot.value is None or i in self.host_slots:
            return
        leaves, spec = tree_flatten(slot.value)
        devices = [v.device if isinstance(v, torch.Tensor) else None for v in leaves]
        moved = [self.copies.to_host(v) if isinstance(v, torch.Tensor) else (v, None)
                 for v in leaves]
        slot.value = tree_unflatten([v for v, _ in moved], spec)
        self.host_slots[i] = devices

    def _slot_back(self, i: int) -> None:
        devices = self.host_slots.pop(i, None)
        slot = self.storage.get(i)
        if devices is None or slot is None or slot.value is None:
            return
        leaves, spec = tree_flatten(slot.value)
        back = [self.copies.to_device(v, d) if isinstance(v, torch.Tensor) and d is not None
                else (v, None) for v, d in zip(leaves, devices, strict=True)]
        slot.value = tree_unflatten([v for v, _ in back], spec)
        self.slot_events[i] = [e for _, e in back]

    def _slot_ready(self, i: int) -> None:
        """Make the compute stream wait for the copies that brought slot ``i`` back."""
        events = self.slot_events.pop(i, None)
        slot = self.storage.get(i)
        if not events or slot is None or slot.value is None:
            return
        for v, e in zip(tree_flatten(slot.value)[0], events, strict=True):
            if isinstance(v, torch.Tensor):
                HostCopies.ready(v, e)

    def _group_back(self, group: _Group) -> None:
        for p in group.packed:
            if p.on_host:
                p.tensor, p.event = self.copies.to_device(p.tensor, p.device)
                p.on_host = False
        group.on_host = False

    # -------------------------------------------------------------- ops
    def _run(self, op: Op) -> None:
        k = self.index
        self._issue(k)
        super()._run(op)
        for key in self.deferred.pop(k, []):
            self._move_out(key)

    def _run_stage(self, op: Op) -> None:
        i = op.stage
        if i - 1 in self.host_slots:  # read while on the host: copy back on the spot
            self.owner.late_reads += 1
            self._slot_back(i - 1)
        self._slot_ready(i - 1)
        if op.kind is not OpKind.F_ALL:
            super()._run_stage(op)
            return
        group = _Group()
        self.groups[i] = group
        is_weight = weight_test(self.owner.weight_ptrs, self.owner.stages[i - 1])
        inputs = {p for t in value_tensors(self.storage[i - 1].value)
                  if (p := storage_ptr(t)) is not None}

        # autograd keeps both hooks in the tape's nodes, which the runner's storage holds:
        # a reference to the runner there would be a cycle through C++ nodes that Python's
        # collector never sees, so a forward whose graph is dropped without a backward kept
        # its runner and every activation it stored, for good (before stop 80)
        chain, copies, input_groups = self.owner, self.copies, self.input_groups

        def pack(t: torch.Tensor) -> Any:
            ptr = storage_ptr(t)
            # detached: a saved output comes with its grad_fn, the node that will hold
            # what this returns (the same uncollectable cycle as above)
            p = _Packed(t.detach(), t.device, version=t._version)
            if is_weight(ptr):
                return p  # weights and buffers are never moved (O.6)
            owner = (input_groups.setdefault(i - 1, _Group())
                     if ptr is not None and ptr in inputs else group)
            owner.refs.append(weakref.ref(p))
            return p

        def unpack(p: Any) -> torch.Tensor:
            if not isinstance(p, _Packed):
                return p
            check_unmodified(p.modified, None if p.moved else p.tensor, p.version)
            if p.on_host:
                chain.late_reads += 1
                t, event = copies.to_device(p.tensor, p.device)
                return HostCopies.ready(t, event)
            t = HostCopies.ready(p.tensor, p.event)
            p.event = None
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            super()._run_stage(op)

    def forward(self, value: Any) -> list[torch.Tensor]:
        self.copies = HostCopies(value_device(value, self.owner))
        out = super().forward(value)
        self._issue(self.loss)  # transfers listed just before Loss
        return out

    def backward(self, grads: Sequence[torch.Tensor | None] | None = None
                 ) -> list[torch.Tensor | None]:
        out = super().backward(grads)
        self.groups.clear()
        self.input_groups.clear()
        self.host_slots.clear()
        return out


class RematOffloadChain(CheckpointedChain):
    """A chain of stages that trains by following a remat + offload plan.

    Parameters
    ----------
    stages
        The stages, in order (parameters shared with the original module).
    plan
        Compute ops and transfer ops (e.g. ``Result.plan`` of
        ``solve(RematOffloadProblem(...), "dp")``).
    preserve_rng_state, restore_buffers
        As for :class:`~optmem.pytorch.execute.CheckpointedChain`.
    """

    def __init__(self, stages: Sequence[Stage | nn.Module], plan: Sequence[AnyOp | str], *,
                 preserve_rng_state: bool = True, restore_buffers: bool = True) -> None:
        self.transfers: dict[int, list[TransferOp]] = {}
        self.issued: list[str] = []
        self.late_reads = 0
        self.moved_out = 0
        self.weight_ptrs: set[int] = set()
        super().__init__(stages, plan, preserve_rng_state=preserve_rng_state,  # type: ignore[arg-type]
                         restore_buffers=restore_buffers, strip_suffix=False,
                         release_early=True)

    def set_plan(self, plan: Sequence[AnyOp | str]) -> None:  # type: ignore[override]
        """Replace the plan (compute ops validated as by the checkpoint executor)."""
        ops, before = split_mixed_plan(plan)
        for k, transfers in before.items():
            if k == 0 and any(t.key != ("a", 0) for t in transfers):
                raise PlanError("only a 0 can be transferred before the first op", index=0)
        super().set_plan(ops)
        self.transfers = before

    def _run_plan(self, plan: tuple[Op, ...], n: int, x: Any, input_needs_grad: bool,
                  functions: list[Callable[[Any], Any]] | None = None) -> Any:
        self.issued = []
        self.late_reads = 0
        self.moved_out = 0
        self.weight_ptrs = kept_storages(self)
        return super()._run_plan(plan, n, x, input_needs_grad, functions)

    def _make_runner(self, plan: tuple[Op, ...], n: int) -> _OffloadRunner:
        return _OffloadRunner(self, plan, n)
