"""Process groups: one decision for every rank (:func:`run_once`), and refusing sharded modules.

The low-level half of :mod:`optmem.pytorch.distributed` (which re-exports every name here):
the wrapper and the one-liners use these helpers, and ``distributed`` builds
:func:`~optmem.pytorch.distributed.checkpoint_fsdp` on the one-liners, so keeping them apart
leaves no import circle.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from optmem.errors import OptmemInputError

__all__ = ["LOCAL", "decision_group", "default_device", "holds_dtensors", "init_distributed",
           "is_fsdp_module", "mesh_group", "refuse_modules_sharded_after",
           "refuse_profile_in_static_graph_start", "refuse_sharded",
           "refuse_tensor_parallel_export", "resolve_group", "run_once", "set_local_device"]

T = TypeVar("T")
LOCAL = "local"


def init_distributed(backend: str | None = None) -> torch.device:
    """Initialise the default process group from ``torchrun``'s environment if needed.

    Returns this process' device: ``cuda:LOCAL_RANK`` with NCCL (set as the current device),
    the CPU with gloo. ``backend`` defaults to NCCL when CUDA is available, gloo otherwise.
    With NCCL the device is made current before the group is made, as PyTorch's DDP
    tutorial asks ("before initializing the group process, call set_device ... to prevent
    hangs or excessive memory utilization on GPU:0"); before, it was set after.
    """
    if not dist.is_available():
        raise OptmemInputError("torch.distributed is not available in this PyTorch build",
                               field="backend")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise OptmemInputError(
                "no process group: launch with torchrun (or call "
                "torch.distributed.init_process_group first)", field="backend")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        set_local_device(backend)
        dist.init_process_group(backend)
    return default_device()


def set_local_device(backend: str) -> None:
    """Make ``cuda:LOCAL_RANK`` the current device when ``backend`` is NCCL (else nothing).

    Called before ``init_process_group``, so that NCCL's communicators and CUDA contexts
    are made on this rank's GPU, not on ``cuda:0``.
    """
    local = os.environ.get("LOCAL_RANK")
    if backend == "nccl" and local is not None:
        torch.cuda.set_device(int(local))


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (made current) when the default group uses NCCL, else the CPU.

    Without ``LOCAL_RANK`` (a group made without torchrun, e.g. by ``mp.spawn``): the current
    CUDA device, which the caller sets per rank with ``torch.cuda.set_device``, as
    PyTorch's object collectives require. Before, every such rank was made to use
    ``cuda:0``: NCCL refuses two ranks on one GPU, and the caller's device was changed.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        local = os.environ.get("LOCAL_RANK")
        if local is None:
            return torch.device("cuda", torch.cuda.current_device())
        device = torch.device("cuda", int(local))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def resolve_group(process_group: Any = None) -> Any:
    """The group that must agree on a plan, or ``None`` to decide locally.

    ``None`` (the default of the public calls): the default group when ``torch.distributed``
    is initialised with more than one process, else local. ``"local"``: always local (each
    process profiles and solves on its own, e.g. when ranks hold different modules).
    A ``ProcessGroup``: that group (local if it has one member).
    """
    if isinstance(process_group, str):
        if process_group != LOCAL:
            raise OptmemInputError(f"expected a ProcessGroup, None or 'local', got "
                                   f"{process_group!r}", field="process_group")
        return None
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise OptmemInputError("a process group was given but torch.distributed is not "
                                   "initialised", field="process_group")
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def run_once(decide: Callable[[], T], group: Any = None, *, together: bool = False) -> T:
    """Run ``decide()`` on rank 0 of ``group`` only and give its value to every rank.

    With ``group=None`` this is just ``decide()``. The value is pickled
    (``broadcast_object_list``); an exception raised by ``decide`` on rank 0 is raised on
    every rank (as :class:`~optmem.errors.OptmemInputError` when it was one), so no rank is
    left waiting.

    ``together``: every rank of ``group`` runs ``decide()`` at once and rank 0's outcome
    (value or exception) is the one every rank gets. For a model whose parameters are
    ``DTensor`` s (tensor parallelism: :func:`holds_dtensors`), whose forward is a
    collective: profiled on rank 0 alone, its first all-reduce waited for ranks that were
    waiting for rank 0's broadcast (a hang until the group's timeout, stop 85).
    """
    if group is None:
        return decide()
    src = dist.get_global_rank(group, 0)
    box: list[Any] = [None]
    if together or dist.get_rank() == src:
        try:
            box[0] = ("ok", decide())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", exc)
    device = default_device() if dist.get_backend(group) == "nccl" else None
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    kind, value = box[0]
    if kind == "error":
        if isinstance(value, BaseException):
            raise value
        raise RuntimeError(str(value))
    return value


def holds_dtensors(modules: Iterable[nn.Module]) -> bool:
    """Whether a parameter or buffer of ``modules`` is a ``DTensor`` (tensor parallelism).

    ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ...) makes a module's
    parameters ``DTensor`` s and its forward a collective of the mesh's ranks, so such a
    model is profiled by every rank at once (:func:`run_once`'s ``together``).
    """
    return dist.is_available() and any(True for _ in _dtensors(modules))


def _dtensors(modules: Iterable[nn.Module]) -> Iterator[Any]:
    """The parameters and buffers of ``modules`` that are ``DTensor`` s."""
    from torch.distributed.tensor import DTensor

    for m in modules:
        yield from (t for t in itertools.chain(m.parameters(), m.buffers())
                    if isinstance(t, DTensor))


def decision_group(process_group: Any, modules: Iterable[nn.Module]) -> Any:
    """:func:`resolve_group`, except that ``"local"`` stages holding ``DTensor`` s agree.

    Parameters
    ----------
    process_group
        As for :func:`resolve_group`.
    modules
        The stages about to be profiled and planned.

    Returns
    -------
    Any
        The group whose rank 0 decides for all (``None``: here). With ``"local"`` and
        stages whose parameters are ``DTensor`` s (tensor parallelism), the group of their
        mesh (:func:`mesh_group`): their forward is a collective of that group, so a plan
        solved on each rank alone (a ``time_model`` or measured times that differ by rank)
        ran other re-runs and so other collectives on each rank (a hang or wrong values;
        stop 85). The mesh's ranks run the same batch anyway, so agreeing costs one
        broadcast.
    """
    group = resolve_group(process_group)
    if group is not None or process_group != LOCAL:
        return group
    return mesh_group(modules)


def mesh_group(modules: Iterable[nn.Module]) -> Any:
    """The process group of the mesh of ``modules``' ``DTensor`` s (``None``: none, or one rank).

    Raises
    ------
    OptmemInputError
        When the ``DTensor`` s are on several meshes or on a mesh of more than one
        dimension, which no single group covers: pass ``process_group=None`` (the default
        group) or a ``ProcessGroup`` of every rank of the mesh instead of ``"local"``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    meshes: list[Any] = []
    for t in _dtensors(modules):
        if all(t.device_mesh != k for k in meshes):
            meshes.append(t.device_mesh)
    if not meshes:
        return None
    if len(meshes) > 1 or meshes[0].ndim != 1:
        raise OptmemInputError(
            "process_group='local' with DTensor parameters on a mesh of more than one "
            "dimension or on several meshes: their ranks must follow one plan (the forward "
            "is a collective) and no single group of that mesh covers them; pass "
            "process_group=None (the default group) or a ProcessGroup of every rank of "
            "the mesh", field="process_group")
    group = meshes[0].get_group()
    return group if dist.get_world_size(group) > 1 else None


def is_fsdp_module(module: Any) -> bool:
    """Whether ``module`` (or a submodule) was already sharded by ``fully_shard``."""
    if not isinstance(module, nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def refuse_sharded(module: Any) -> None:
    """Raise a clear error for a module sharded before ``optmem.pytorch.checkpoint``.

    The executor calls the chain's stages itself, so the root FSDP module's forward (which
    gathers what the root owns and sets up the backward) would never run: shard after.
    """
    if is_fsdp_module(module):
        raise OptmemInputError(
            f"{type(module).__name__} is already sharded with fully_shard: call "
            "optmem.pytorch.checkpoint on the unsharded model first, then shard its stages "
            "with optmem.pytorch.distributed.fully_shard_checkpointed(cmodel, mesh=mesh) (or "
            "use checkpoint_fsdp); see docs/distributed.md", field="module")


def refuse_tensor_parallel_export(module: nn.Module) -> None:
    """One error for a model to export whose parameters are ``DTensor`` s.

    Parameters
    ----------
    module
        The model about to be extracted with ``torch.export`` (not an ``nn.Sequential`` or
        a list of stages, whose modules the executor runs as they are).

    Raises
    ------
    OptmemInputError
        When a parameter or buffer of ``module`` is a ``DTensor`` and no ``fully_shard``
        made it (those have their own errors): tensor parallelism
        (``parallelize_module``), applied before wrapping or to the wrapper's ``.module``
        after it. ``torch.export`` does not trace ``DTensor`` parameters; before (stop
        85) the extractor's error blamed the first parallel ``Linear`` and suggested an
        ``nn.Sequential`` of its blocks.
    """
    if not holds_dtensors([module]) or is_fsdp_module(module):
        return
    raise OptmemInputError(
        f"{type(module).__name__} holds DTensor parameters (tensor parallelism, "
        "parallelize_module): torch.export, which cuts a model that is not an "
        "nn.Sequential, cannot trace them. Apply tensor parallelism to an nn.Sequential "
        "or a list of stage modules (before or after wrapping it: the plan runs those "
        "modules and their hooks), or shard the model with "
        "optmem.pytorch.distributed.checkpoint_fsdp instead; see docs/distributed.md",
        field="module")


def refuse_modules_sharded_after(module: nn.Module) -> None:
    """Raise a clear error for an exported model's modules sharded after wrapping it.

    Parameters
    ----------
    module
        The wrapped model, extracted with ``torch.export`` (its stages call the graph).

    Raises
    ------
    OptmemInputError
        When ``fully_shard`` was applied to ``module`` or one of its submodules (PyTorch's
        per-layer recipe on HuggingFace's blocks): the stages never call those modules, so
        their FSDP hooks would never run. Before (stop 77) the call was refused as a new
        call signature, saying to pad to the sample's sizes.
    """
    if is_fsdp_module(module):
        raise OptmemInputError(
            f"fully_shard was applied to {type(module).__name__} or its submodules after "
            "wrapping it: its stages (extracted with torch.export) call the graph, not those "
            "modules, so their FSDP hooks would never run; shard the stages instead: "
            "optmem.pytorch.distributed.checkpoint_fsdp(model, sample, limit, mesh=mesh), or "
            "fully_shard_checkpointed(cmodel, mesh=mesh) on the unsharded wrapper; see "
            "docs/distributed.md", field="module")


def refuse_profile_in_static_graph_start(name: str) -> None:
    """One error for a profile inside the first forward of ``DDP(static_graph=True)``.

    ``DistributedDataParallel(static_graph=True)`` counts, in its first iteration, how
    many times each parameter's gradient hook runs, and from the second iteration on
    reduces a parameter only after that many. A call whose signature the wrapper has not
    planned yet is profiled inside DDP's forward, and the profile's backward runs those
    hooks too: the rank that profiled (rank 0, which decides for all) then waited for a
    second hook per parameter that never came, skipped every reduction from the second
    step on (its gradients its own, 0.13 off on a tiny GPT-2) and left the other ranks
    waiting (a hang; stop 82). Later iterations count nothing: a new signature there is
    profiled without harm.

    Parameters
    ----------
    name
        The wrapped model's class name, for the message.

    Raises
    ------
    OptmemInputError
        When called inside the first forward of a ``DistributedDataParallel`` with
        ``static_graph=True`` (its ``_active_ddp_module``, set during its forward).
    """
    if not dist.is_available():
        return
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or not ddp.static_graph or ddp._static_graph_delay_allreduce_enqueued:
        return
    raise OptmemInputError(
        f"{name}: this call differs from the sample and would be profiled inside the first "
        "forward of DistributedDataParallel(static_graph=True), which counts the "
        "profile's gradient hooks as the step's and then skips the reduction of every "
        "later step on the profiling rank (wrong gradients, then a hang). Wrap with a "
        "sample made like the training call (for a part of the model, "
        "op.submodule_sample(model, part, **batch)), or leave static_graph off",
        field="sample")
