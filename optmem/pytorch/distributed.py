"""Plans inside multi-process training: one decision for every rank, DDP and FSDP2.

Three pieces, used by :func:`optmem.pytorch.checkpoint` and :func:`optmem.pytorch.pipeline`:

* :func:`run_once`: the profile and the solve run on one rank (rank 0 of the group) and the
  outcome (chain and plan) is broadcast, so every rank trains with the **same** plan. Two ranks
  that profiled separately could measure different times, choose different plans, and then
  disagree on when parameters are used (DDP's reducer, FSDP's all-gathers and the pipeline's
  point-to-point messages all assume the same program on every rank). A tensor-parallel
  model (``DTensor`` parameters), whose forward is a collective, is profiled by every rank
  at once and rank 0's outcome kept (``together``).
* DDP: ``DistributedDataParallel(optmem.pytorch.checkpoint(model, sample, ...))`` needs no
  special argument (``find_unused_parameters=True`` is not needed, and works: see
  ``docs/distributed.md``).
* FSDP2: :func:`fully_shard_checkpointed` shards the stages of a checkpointed module (one
  FSDP unit per stage, the root holding what stages share), and :func:`fsdp_chain` adds what
  FSDP holds while a stage runs (its gathered parameters and all-gather buffer, in the
  backward its unsharded gradients, the communication buffers other units leave in flight,
  and the root unit's parameters) to the chain's per-op overheads, so that the plan's
  memory limit accounts for it.
  :func:`checkpoint_fsdp` does both in one call, for a checkpoint plan or (``problem=``) an
  offload or remat + offload plan.

Backends: NCCL when CUDA is available (one GPU per local rank), gloo otherwise (CPU processes,
what the tests use). :func:`init_distributed` initialises from ``torchrun``'s environment.
The process-group helpers live in :mod:`optmem.pytorch.process_groups` (the wrapper uses
them without this module, which imports the one-liners for :func:`checkpoint_fsdp`).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.pytorch.process_groups import (
    LOCAL,
    default_device,
    init_distributed,
    is_fsdp_module,
    refuse_sharded,
    resolve_group,
    run_once,
    set_local_device,
)

__all__ = ["FSDP_PROBLEMS", "LOCAL", "checkpoint_fsdp", "default_device", "end_process",
           "fsdp_chain", "fully_shard_checkpointed", "init_distributed", "is_fsdp_module",
           "refuse_sharded", "resolve_group", "root_parameter_bytes", "run_once",
           "set_local_device", "spawn", "stage_parameter_bytes"]


# ------------------------------------------------------------------ FSDP2
def _shared_parameter_ids(stages: Sequence[nn.Module]) -> set[int]:
    """Ids of parameters that appear in more than one stage (tied weights)."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for k, st in enumerate(stages):
        for p in st.parameters():
            if owner.setdefault(id(p), k) != k:
                shared.add(id(p))
    return shared


def sharded_stage_indices(stages: Sequence[nn.Module]) -> list[int]:
    """Stages that become their own FSDP unit: those with parameters shared with no other.

    A parameter in two stages (a tied embedding and head) cannot belong to two FSDP units;
    the stages holding one stay with the root unit, whose parameters are gathered for the
    whole step.
    """
    shared = _shared_parameter_ids(stages)
    return [k for k, st in enumerate(stages)
            if any(True for _ in st.parameters())
            and not any(id(p) in shared for p in st.parameters())]


def fully_shard_checkpointed(cmodule: nn.Module, mesh: Any = None, **fsdp_kwargs: Any
                             ) -> nn.Module:
    """Shard a checkpointed module with FSDP2: one unit per stage, then the root.

    ``cmodule`` is what :func:`optmem.pytorch.checkpoint` returned (its ``stages``). Stages
    with parameters of their own become FSDP units (``fully_shard(stage, mesh=mesh,
    **fsdp_kwargs)``); stages sharing a parameter with another stage stay in the root unit.
    The stages of an exported model (``torch.export``) hold the model's parameters in their
    own graph modules: the model's modules are pointed at the sharded parameters too (so
    ``state_dict()``, ``parameters()`` and the executor see one object), and the root unit
    leaves them to the stage units. Returns ``cmodule`` (sharded in place, as
    ``fully_shard`` does).

    Each stage unit gets ``reshard_after_forward=True`` unless ``fsdp_kwargs`` says
    otherwise. The stages are not submodules the root's FSDP state finds, so each unit is
    an FSDP root of its own, and FSDP2's default (``None``) does not reshard a root after
    its forward: every unit kept its gathered parameters from its forward to its
    backward, against the chain (:func:`fsdp_chain`: gathered during the unit's own op),
    and a unit whose parameters are all frozen (a LoRA fine-tune's embeddings) has no
    backward, so it was never resharded and a second step failed.
    """
    from torch.distributed.fsdp import fully_shard

    if getattr(cmodule, "extraction", None) is not None:
        refuse_mixed_precision(type(cmodule.module).__name__, fsdp_kwargs)
    stages = list(cmodule.stages)  # type: ignore[arg-type]
    held: set[nn.Parameter] = set(fsdp_kwargs.pop("ignored_params", None) or ())
    units = [stages[k] for k in sharded_stage_indices(stages)]
    for unit in units:
        before = _parameter_slots(unit)
        if hasattr(unit, "unview_outputs"):  # a graph stage: no view out of FSDP2
            unit.unview_outputs = True
        fully_shard(unit, mesh=mesh, **{"reshard_after_forward": True, **fsdp_kwargs})
        _drop_reduce_scatter_input(unit)
        held |= _point_model_at(cmodule, before, _parameter_slots(unit))
    fully_shard(cmodule, mesh=mesh, ignored_params=held, **fsdp_kwargs)
    for sharded in (*units, cmodule):
        _free_buffers_when_dropped(sharded)
    for name in _RECURSIVE_SETTERS:
        if hasattr(cmodule, name):  # FSDP2's setters differ between torch versions
            setattr(cmodule, name, _setter_of_every_unit(getattr(cmodule, name), units))
    return cmodule


def _drop_reduce_scatter_input(unit: nn.Module) -> None:
    """Free the reduce-scatter buffer of ``unit`` after its reduce-scatter, if it is a root.

    FSDP2 keeps a unit's flattened unsharded gradients (its reduce-scatter input) until the
    next unit of the same root reduces, or until that root's final callback. The stage units
    of an exported model are FSDP roots of their own (the root unit's module tree does not
    contain them), so each kept its buffer until the callback, at the end of the whole
    backward when the plan's ops run in the caller's backward (an offload plan, a store-all
    suffix): a tiny GPT-2's offload plan held four such buffers at once, 21888 B (stop 79).
    After the post-backward of a unit that is a root, its compute stream now waits for the
    reduce-scatter (as the final callback does) and the buffer is dropped. Units under a
    shared root (an ``nn.Sequential``'s stages) keep FSDP2's behaviour: one buffer in
    flight, which :func:`fsdp_chain` counts.
    """
    state = unit._get_fsdp_state()  # type: ignore[operator]
    for group in _param_groups(state):
        group.post_backward = _dropping_after(group.post_backward, state)


def _param_groups(state: Any) -> list[Any]:
    """The parameter groups of an FSDP2 ``state`` (older torch: at most one)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
    return list(groups)


def _dropping_after(post_backward: Callable[..., Any], state: Any) -> Callable[..., Any]:
    """``post_backward`` (of a group of ``state``), then the drop of ``state``'s buffers."""
    @functools.wraps(post_backward)
    def run(*args: Any, **kwargs: Any) -> Any:
        out = post_backward(*args, **kwargs)
        context = getattr(state, "_comm_ctx", None)
        kept = getattr(context, "reduce_scatter_states", None)
        if getattr(state, "_is_root", False) and kept:
            stream = state._device_handle.current_stream()
            for kept_state in kept:
                if kept_state.event is not None:
                    stream.wait_event(kept_state.event)
            kept.clear()
        return out
    return run


def _free_buffers_when_dropped(module: nn.Module) -> None:
    """Free the CPU communication buffers of ``module``'s FSDP2 unit where FSDP2 drops them.

    FSDP2 lets go of an all-gather buffer after the copy-out or, in a forward, when the next
    unit's copy-out or the forward root's post-forward replaces it, and of a reduce-scatter
    buffer when a later unit reduces or the backward ends; the memory returns when the last
    reference goes. On CPU, gloo's worker thread holds a collective's buffers too, until it
    gets round to dropping its finished work, after the collective returned: on a loaded
    machine a buffer could outlive FSDP2's release, and the step held one more than the
    chain counts (stop 80: a remat + offload plan of the residual MLP claimed 7575 B and
    held 8072 in a CI run; 8584 B with every buffer's release forced two collectives
    late). Each CPU buffer's storage is now resized to nothing at FSDP2's release (the
    collective is complete by then), so what a step holds does not depend on when another
    thread runs. CUDA buffers are left to FSDP2 and the caching allocator, whose reuse
    follows the streams.
    """
    state = module._get_fsdp_state()  # type: ignore[operator]
    _freeing_context(state._comm_ctx)
    for group in _param_groups(state):
        group.wait_for_unshard = _freeing_gathered(group.wait_for_unshard, group)


def _free_cpu_storage(t: torch.Tensor | None) -> None:
    """Resize ``t``'s storage to nothing if it is a CPU tensor (a released buffer)."""
    if t is not None and t.device.type == "cpu":
        t.untyped_storage().resize_(0)


def _free_gathered(result: Any) -> None:
    """Free the buffer of an all-gather's ``AllGatherResult``.

    Not on one rank: there FSDP2's result holds the group's own persistent placeholder and
    no input splits (nothing was gathered).
    """
    if result.all_gather_input_split_sizes:
        _free_cpu_storage(result.all_gather_output)


def _get_gathered(ctx: Any) -> Any:
    return ctx.__dict__.get("_optmem_all_gather_state")


def _set_gathered(ctx: Any, new: Any) -> None:
    """Set ``ctx.all_gather_state``, freeing the buffer of the state it replaces."""
    old = ctx.__dict__.get("_optmem_all_gather_state")
    ctx.__dict__["_optmem_all_gather_state"] = new
    if old is not None and (new is None or new.all_gather_result is not old.all_gather_result):
        _free_gathered(old.all_gather_result)


def _get_reduced(ctx: Any) -> Any:
    try:
        return ctx.__dict__["_optmem_reduce_scatter_states"]
    except KeyError:  # before FSDP2's lazy init, as without the property
        raise AttributeError("reduce_scatter_states") from None


def _set_reduced(ctx: Any, states: list[Any]) -> None:
    """Set ``ctx.reduce_scatter_states`` to a :class:`_FreeingStates` of ``states``."""
    ctx.__dict__["_optmem_reduce_scatter_states"] = _FreeingStates(states)


class _FreeingStates(list):  # type: ignore[type-arg]
    """FSDP2's kept reduce-scatter states: a state popped or cleared frees its CPU buffer."""

    def pop(self, index: Any = -1) -> Any:
        """Remove and return the state at ``index``; its buffer is freed."""
        state = super().pop(index)
        _free_cpu_storage(state.reduce_scatter_input)
        return state

    def clear(self) -> None:
        """Remove every state; their buffers are freed."""
        for state in self:
            _free_cpu_storage(state.reduce_scatter_input)
        super().clear()


_FREEING_CONTEXTS: dict[type, type] = {}


def _freeing_context(ctx: Any) -> None:
    """Make FSDP2's communication context ``ctx`` free the CPU buffers it drops.

    Its class becomes a subclass whose ``all_gather_state`` frees the replaced state's
    all-gather buffer and whose ``reduce_scatter_states`` is a :class:`_FreeingStates`. The
    context is shared by the units under one root after FSDP2's lazy init: done once.
    """
    base = type(ctx)
    if base in _FREEING_CONTEXTS.values():
        return
    if base not in _FREEING_CONTEXTS:
        _FREEING_CONTEXTS[base] = type(f"Freeing{base.__name__}", (base,), {
            "all_gather_state": property(_get_gathered, _set_gathered),
            "reduce_scatter_states": property(_get_reduced, _set_reduced)})
    gathered = ctx.__dict__.pop("all_gather_state", None)
    reduced = ctx.__dict__.pop("reduce_scatter_states", None)
    ctx.__class__ = _FREEING_CONTEXTS[base]
    ctx.__dict__["_optmem_all_gather_state"] = gathered
    if reduced is not None:  # FSDP2 sets both at its lazy init, after the sharding
        ctx.reduce_scatter_states = reduced


def _freeing_gathered(wait_for_unshard: Callable[..., Any], group: Any) -> Callable[..., Any]:
    """``wait_for_unshard`` of ``group``, then the free of its all-gather buffer if dropped.

    FSDP2 drops it right after the copy-out in a backward; in a forward it keeps it in the
    communication context (freed when replaced: :func:`_freeing_context`).
    """
    @functools.wraps(wait_for_unshard)
    def run(*args: Any, **kwargs: Any) -> Any:
        current = group._all_gather_result
        out = wait_for_unshard(*args, **kwargs)
        kept = group.comm_ctx.all_gather_state
        if current is not None and group._all_gather_result is None and (
                kept is None or kept.all_gather_result is not current):
            _free_gathered(current)
        return out
    return run


# FSDPModule setters that set an option on every FSDP unit of ``self.modules()`` (recurse)
_RECURSIVE_SETTERS = ("set_requires_gradient_sync", "set_requires_all_reduce",
                      "set_reshard_after_forward", "set_reshard_after_backward",
                      "set_reduce_scatter_unused_params", "set_reduce_scatter_max_input_buffers",
                      "set_separate_reduce_scatter_group")


def _setter_of_every_unit(root_setter: Callable[..., None], units: Sequence[nn.Module]
                          ) -> Callable[..., None]:
    """``root_setter`` (a bound FSDP2 setter of the root unit) that reaches the stage units.

    The stages are no submodules of the root (each unit is an FSDP root of its own), so
    FSDP2's recursion over ``self.modules()`` missed them: ``set_requires_gradient_sync(
    False)`` for gradient accumulation left every stage unit reduce-scattering each
    micro-batch (a hunt in stop 55). With ``recurse=False`` the root alone, as in FSDP2.
    """
    @functools.wraps(root_setter)
    def set_everywhere(*args: Any, recurse: bool = True, **kwargs: Any) -> None:
        root_setter(*args, recurse=recurse, **kwargs)
        for unit in units if recurse else ():
            getattr(unit, root_setter.__name__)(*args, recurse=True, **kwargs)
    return set_everywhere


def refuse_mixed_precision(name: str, fsdp_kwargs: dict[str, Any]) -> None:
    """One error for FSDP2 mixed precision on the stages of an exported model.

    Its stages are graphs exported from the float32 model and keep its dtypes, where
    ``MixedPrecisionPolicy(param_dtype=...)`` casts the gathered parameters: a tiny Llama
    failed inside a stage ("expected m1 and m2 to have the same dtype"), GPT-2 with a
    message about extraction (a hunt in stop 51); ``output_dtype`` casts a stage's
    outputs, which the next stage's graph reads in the model's dtype. ``reduce_dtype``
    alone changes only the dtype the gradients are reduce-scattered in, which no stage
    sees: it is taken (until stop 82 it was refused too; tiny GPT-2 with
    ``reduce_dtype=torch.float32`` or ``torch.bfloat16``: bitwise plain ``fully_shard``
    with the same policy). An ``nn.Sequential``'s stages are the model's own modules and
    take every policy.
    """
    policy = fsdp_kwargs.get("mp_policy")
    dtypes = {k: getattr(policy, k, None) for k in ("param_dtype", "output_dtype")}
    given = {k: v for k, v in dtypes.items() if v is not None}
    if given:
        shown = ", ".join(f"{k}={v}" for k, v in given.items())
        raise OptmemInputError(
            f"FSDP2 mixed precision (mp_policy with {shown}) is not supported on the "
            f"exported stages of {name}: they keep the dtypes of the float32 model they "
            "were exported from. Shard without mp_policy, or pass an nn.Sequential of the "
            "model's blocks, whose stages take the policy (reduce_dtype alone is taken "
            "by both)", field="fsdp_kwargs")


def _parameter_slots(module: nn.Module) -> dict[tuple[int, str], nn.Parameter]:
    """Every ``(submodule, name) -> parameter`` registration inside ``module``."""
    return {(id(m), name): p for m in module.modules() for name, p in m._parameters.items()
            if p is not None}


def _point_model_at(cmodule: nn.Module, before: dict[tuple[int, str], nn.Parameter],
                    after: dict[tuple[int, str], nn.Parameter]) -> set[nn.Parameter]:
    """Replace, everywhere in ``cmodule``, each parameter ``fully_shard`` replaced in a stage.

    Returns the new (sharded) parameters.
    """
    new = {id(old): after[slot] for slot, old in before.items()
           if slot in after and after[slot] is not old}
    for m in cmodule.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[name] = new[id(p)]
    return set(new.values())


def stage_parameter_bytes(stages: Sequence[nn.Module], world: int = 1) -> list[int]:
    """Bytes of the unsharded parameters of every stage that is an FSDP unit, else 0.

    ``world`` is the number of ranks a unit is sharded over: FSDP2 shards every parameter
    on its first dimension, padded to a multiple of ``world``, and gathers the padded
    tensor (a ``Linear(16, 1)`` of 68 B gathers 136 B on 2 ranks; stop 79). The default 1
    counts no padding, as before.
    """
    units = set(sharded_stage_indices(stages))
    return [sum(_gathered_bytes(p, world) for p in st.parameters()) if k in units else 0
            for k, st in enumerate(stages)]


def _gathered_bytes(p: torch.Tensor, world: int) -> int:
    """Bytes of ``p`` as FSDP2 gathers it over ``world`` ranks (first dimension padded).

    A ``DTensor`` (tensor parallelism before FSDP2: a 2D mesh) counts its local tensor, the
    part FSDP2 shards and gathers on this rank; before (stop 85) its global size, a claim
    of 13.7 KB for a measured 9.5 KB on a tiny MLP over 2 x 2 ranks.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        p = p.to_local()
    if p.dim() == 0:
        return world * p.element_size()  # a scalar is sharded as one row
    rows = p.shape[0]
    padded = -(-rows // world) * world
    return padded * (p.numel() // rows if rows else 0) * p.element_size()


def root_parameter_bytes(stages: Sequence[nn.Module], world: int = 1) -> int:
    """Bytes of the distinct parameters of the stages that are no FSDP unit (the root's).

    Those stages (a tied embedding and head) stay in the root unit, whose parameters are
    gathered for the whole step (first dimensions padded to a multiple of ``world``, as
    in :func:`stage_parameter_bytes`).
    """
    units = set(sharded_stage_indices(stages))
    held = {id(p): p for k, st in enumerate(stages) if k not in units for p in st.parameters()}
    return sum(_gathered_bytes(p, world) for p in held.values())


def fsdp_chain(chain: Chain, param_bytes: Sequence[int], *, prefetch: bool = True,
               root_bytes: int = 0, recompute: bool = True,
               kept: Literal["tape", "ops"] | None = None) -> Chain:
    """``chain`` with what FSDP2 holds while each stage runs added to its overheads.

    ``P_i = param_bytes[i]`` are the unsharded parameters of stage ``i`` (0 if it is not an
    FSDP unit), ``below(i)`` / ``above(i)`` those of the nearest unit before / after it (0
    if none). FSDP2 gathers a unit's parameters through an all-gather buffer of ``P_i``
    bytes, which is alive beside them while they are copied out, and flattens its unsharded
    gradients into a reduce-scatter buffer of ``P_i`` bytes. Measured on 2 gloo ranks
    (stop 79, ``docs/distributed.md``), an op of stage ``i`` holds besides its activations:

    * a first forward: ``2 P_i`` (the gathered parameters and the all-gather buffer) and
      ``below(i)``: the previous unit's all-gather buffer, which FSDP2 keeps until the next
      unit's parameters are copied out (to overlap the two);
    * a forward in the backward (a re-run; ``recompute``): ``2 P_i`` and the buffers the
      last backward left: the reduce-scatter buffer of that unit ``k > i`` (kept until the
      next unit's reduce-scatter) and the all-gather buffer of ``below(k)``, which FSDP2
      prefetches in ``k``'s backward (``prefetch``): at most ``max_{k > i} P_k +
      below(k)``;
    * a backward: ``2 P_i`` (the gathered parameters and the unsharded gradients),
      ``above(i)`` (the reduce-scatter buffer of the unit reduced before) and, with
      ``prefetch``, ``below(i)`` (the all-gather buffer FSDP2 prefetches);
    * the loss: ``below(L + 1)``, the last unit's all-gather buffer.

    The stages of an exported model are FSDP roots of their own (the root unit's module
    tree does not contain them): FSDP2 does not prefetch for them (``prefetch=False``, what
    :func:`checkpoint_fsdp` passes), and frees a unit's buffers at its own post-forward and
    post-backward (the reduce-scatter one since stop 79: :func:`fully_shard_checkpointed`),
    but not always before the next unit's: a tiny Llama's embedding buffer was released
    after the next unit's all-gather in one run and before it in another (same plan; the
    release depends on when Python drops the last reference). So ``below(i)`` and
    ``above(i)`` stay counted for them.

    The root unit's parameters (``root_bytes``: gathered for the whole step) count in every
    op, and once more in the forwards (its all-gather buffer, alive until the root's
    forward ends or the first unit's parameters are copied out): a constant term, which the
    chain, having no field for it, carries in every op's overhead. These are temporaries of
    one op, i.e. the chain's ``fwd_overhead`` / ``bwd_overhead`` / ``loss_bwd_overhead``
    (CONTRACT section 5), so the plan's peak counts them. Not counted: the sharded
    parameters, gradients and optimizer state (always resident, like parameters without
    FSDP). ``recompute=False`` drops the re-run term (an offload plan runs every forward
    once, before the loss).

    What FSDP2 keeps *between* two ops (after a forward of unit ``i`` the root's parameters
    and ``i``'s all-gather buffer, ``R + P_i``; after a backward of unit ``k``, ``R + P_k +
    below(k)``) is set as the chain's ``fwd_held`` / ``bwd_held`` / ``loss_held`` (stop 82,
    :func:`_held_between_ops`): a transfer that starts between two ops counts it.

    ``kept`` (stop 82): the units keep their gathered parameters from a forward with grad
    to their backward (``fully_shard``'s ``reshard_after_forward`` not ``True``; a run
    without grad is resharded by the executor), counted by :func:`_kept_gathered`:
    ``"tape"`` adds ``P_i`` to stage ``i``'s tape (``saved_size``, alive from ``F_all i``
    to ``B i`` as the parameters are; the backward's own ``P_i`` then leaves its overhead),
    exact for a checkpoint plan; ``"ops"`` adds to each op the units that may be gathered
    while it runs (for plans whose tapes move to the host without the parameters: before
    ``B k`` at most the units ``i < k`` beside ``k``, every unit at the loss, every other
    unit in a re-run forward or, without ``recompute``, the units before it). An int
    ``reshard_after_forward`` keeps less (a smaller shard): counted as the whole ``P_i``.
    Measured (residual MLP, 2 gloo ranks, offload plan at 8000 B): 11916 B held for a claim
    of 7936 before; see ``docs/distributed.md``, "Stop 82".

    Before stop 79 the chain counted ``P_i`` in a forward and ``2 P_i + P_{i-1}`` (with
    ``prefetch``) in a backward, and neither the buffers nor the root's parameters: the
    measured peak of a residual MLP's remat + offload plan was 7496 B for a claimed 5844.
    """
    n = chain.length
    if len(param_bytes) != n:
        raise OptmemInputError(f"expected {n} parameter sizes, got {len(param_bytes)}",
                               field="param_bytes")
    units = [int(p) for p in param_bytes]
    root = int(root_bytes)
    if any(p < 0 for p in units):
        raise OptmemInputError("parameter sizes must be non-negative", field="param_bytes")
    if root < 0:
        raise OptmemInputError("root_bytes must be non-negative", field="root_bytes")
    below, above = _nearest_units(units)
    held = [p + (b if prefetch else 0) for p, b in zip(units, below, strict=True)]
    rerun = _largest_after(held, units) if recompute else [0] * n
    fwd_extra = [2 * p + max(b, r) for p, b, r in zip(units, below, rerun, strict=True)]
    bwd_extra = [2 * p + a + (b if prefetch else 0)
                 for p, a, b in zip(units, above, below, strict=True)]
    loss_extra = next((p for p in reversed(units) if p), 0)
    fwd_held, bwd_held = _held_between_ops(units, below, above, rerun, root, prefetch)
    adjusted = replace(chain,
                   fwd_overhead=tuple(o + e + 2 * root
                                      for o, e in zip(chain.fwd_overhead, fwd_extra,
                                                      strict=True)),
                   bwd_overhead=tuple(o + e + root
                                      for o, e in zip(chain.bwd_overhead, bwd_extra,
                                                      strict=True)),
                   loss_bwd_overhead=chain.loss_bwd_overhead + loss_extra + root,
                   fwd_held=tuple(h + e for h, e in zip(chain.fwd_held, fwd_held, strict=True)),
                   bwd_held=tuple(h + e for h, e in zip(chain.bwd_held, bwd_held, strict=True)),
                   loss_held=chain.loss_held + loss_extra + root,
                   name=f"{chain.name}+fsdp")
    return adjusted if kept is None else _kept_gathered(adjusted, units, kept, recompute)


def _kept_gathered(chain: Chain, units: Sequence[int], kept: Literal["tape", "ops"],
                   recompute: bool) -> Chain:
    """``chain`` with the units' parameters kept gathered from their forward to their backward.

    ``"tape"``: ``P_i`` joins stage ``i``'s tape (``saved_size``) and leaves its backward's
    overhead (the tape is alive during ``B i``). ``"ops"``: ``B k`` gets ``sum_{i<k} P_i``
    (held after it too), the loss ``sum P`` (held too), a forward ``F j`` the other units
    (``sum_{i != j} P_i``; ``sum_{i<j} P_i`` without ``recompute``) and held after it the
    same plus its own ``P_j``. Each held term stays within its overhead (the FSDP terms
    already hold ``P_j`` beside the held ones). See :func:`fsdp_chain`.
    """
    if kept == "tape":
        return replace(chain, saved_size=tuple(s + p for s, p in zip(chain.saved_size, units,
                                                                      strict=True)),
                       bwd_overhead=tuple(o - p for o, p in zip(chain.bwd_overhead, units,
                                                                 strict=True)))
    total, before = sum(units), list(itertools.accumulate(units, initial=0))[:-1]
    fwd = [total - p if recompute else b for p, b in zip(units, before, strict=True)]
    return replace(
        chain,
        fwd_overhead=tuple(o + f for o, f in zip(chain.fwd_overhead, fwd, strict=True)),
        fwd_held=tuple(h + f + p for h, f, p in zip(chain.fwd_held, fwd, units, strict=True)),
        bwd_overhead=tuple(o + b for o, b in zip(chain.bwd_overhead, before, strict=True)),
        bwd_held=tuple(h + b for h, b in zip(chain.bwd_held, before, strict=True)),
        loss_bwd_overhead=chain.loss_bwd_overhead + total, loss_held=chain.loss_held + total)


def _held_between_ops(units: Sequence[int], below: Sequence[int], above: Sequence[int],
                      rerun: Sequence[int], root: int, prefetch: bool
                      ) -> tuple[list[int], list[int]]:
    """What FSDP2 keeps after each forward and backward until the next op starts.

    An op's FSDP terms (:func:`fsdp_chain`) less what FSDP2 frees at its end: a unit's
    gathered parameters (its forward) or unsharded gradients' copy (its backward), the
    buffer of the unit before (freed at this unit's copy-out) and the root's all-gather
    buffer (freed at the first unit's copy-out). So after a forward of unit ``i``: ``R +
    P_i`` (its all-gather buffer) and, in a re-run, the buffers the last backward left;
    after a forward of a stage that is no unit: ``R + max(below(i), re-run term)`` and the
    root's buffer until a unit ran; after a backward of unit ``k``: ``R + P_k`` (its
    reduce-scatter buffer) ``+ below(k)`` (the prefetched all-gather buffer, ``prefetch``);
    after a backward of a stage that is no unit: ``R + above(i) + below(i)`` (with
    ``prefetch``). Each is at most the op's FSDP term, so within its overhead.
    """
    fwd, bwd, seen = [], [], False
    for p, b, a, r in zip(units, below, above, rerun, strict=True):
        seen = seen or p > 0
        fwd.append(root + (p + r if p else max(b, r)) + (0 if seen else root))
        bwd.append(root + (p if p else a) + (b if prefetch else 0))
    return fwd, bwd


def _nearest_units(units: Sequence[int]) -> tuple[list[int], list[int]]:
    """For each stage, the bytes of the nearest unit before it and after it (0: none)."""
    below, above = [0] * len(units), [0] * len(units)
    for i in range(1, len(units)):
        below[i] = units[i - 1] or below[i - 1]
    for i in range(len(units) - 2, -1, -1):
        above[i] = units[i + 1] or above[i + 1]
    return below, above


def _largest_after(held: Sequence[int], units: Sequence[int]) -> list[int]:
    """For each stage ``i``, the largest ``held[k]`` over the units ``k > i`` (0: none)."""
    out, best = [0] * len(units), 0
    for i in range(len(units) - 1, -1, -1):
        out[i] = best
        if units[i]:
            best = max(best, held[i])
    return out


def _shard_count(mesh: Any) -> int:
    """Ranks a unit is sharded over: the mesh's last dimension, else the default group."""
    if mesh is not None:
        return int(mesh.shape[-1])
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# the problems checkpoint_fsdp solves over the FSDP units (the planner's kinds)
FSDP_PROBLEMS = ("checkpoint", "offload", "remat_offload")


def checkpoint_fsdp(module: nn.Module | Sequence[nn.Module], sample: Any,
                    memory_limit: int | str = "2GiB", method: str = "dp", *,
                    problem: str = "checkpoint", bandwidth: float | str | None = None,
                    mesh: Any = None, process_group: Any = None, prefetch: bool = True,
                    fsdp_kwargs: dict[str, Any] | None = None, **checkpoint_kwargs: Any
                    ) -> nn.Module:
    """A plan over the stages of ``module`` that counts FSDP2's memory, then one unit per stage.

    The stages are those of :func:`optmem.pytorch.checkpoint` (an ``nn.Sequential``'s
    children, or the ``torch.export`` stages of any other module, e.g. a HuggingFace model
    called as ``sample``). The profile runs on rank 0 of ``process_group`` (default: the
    default group) on the unsharded module, :func:`fsdp_chain` adds FSDP's gathered
    parameters, gradients and communication buffers and the root unit's parameters to the
    per-op overheads (measured: ``docs/distributed.md``, "Stop 79"; exported stages are
    FSDP roots of their own, which FSDP2 does not prefetch; an offload plan re-runs
    nothing, ``recompute=False``), the plan is solved under
    ``memory_limit`` once and broadcast, and the stages are sharded
    (:func:`fully_shard_checkpointed`).

    Parameters
    ----------
    module, sample, memory_limit, method
        As for :func:`optmem.pytorch.checkpoint` (``method`` names a method of ``problem``).
    problem
        The plan: ``"checkpoint"`` (default: recomputation, as
        :func:`optmem.pytorch.checkpoint`), ``"offload"`` (store-all compute, saved
        activations moved to host memory and back, :func:`optmem.pytorch.offload`) or
        ``"remat_offload"`` (both, :func:`optmem.pytorch.remat_offload`). The FSDP terms are
        per-op temporaries in all three problems (CONTRACT sections 5, 10 and 13), which no
        plan can offload: the executors never transfer a unit's gathered parameters
        (:func:`optmem.pytorch.offload.weight_test`), and FSDP frees them itself.
    bandwidth
        The host link of an offload plan (bytes per second or a rate such as ``"12GB/s"``;
        ``None``: ``"12GB/s"``, the default of :func:`optmem.pytorch.offload`). Not with
        ``problem="checkpoint"``.
    mesh
        The device mesh of ``fully_shard``.
    process_group
        Ranks that decide together (``docs/distributed.md``, "One plan for every rank").
    prefetch
        Count the all-gather buffer FSDP2 prefetches for the next unit of the backward
        (:func:`fsdp_chain`; never for an exported model's stages, which FSDP2 does not
        prefetch).
    fsdp_kwargs
        Keyword arguments of every ``fully_shard`` (``mp_policy`` with ``param_dtype`` or
        ``output_dtype`` is refused for an exported model). A ``reshard_after_forward``
        other than ``True`` keeps the units gathered from forward to backward, which the
        chain then counts (:func:`fsdp_chain`'s ``kept``).
    **checkpoint_kwargs
        The other options of the one-liner of ``problem`` (``max_stages`` and ``chain`` are
        not supported: the chain's stages are the FSDP units). The store-all fast path is
        off: the plan always runs the sharded stages.

    Returns
    -------
    nn.Module
        The sharded :class:`~optmem.pytorch.api.CheckpointedModule`,
        :class:`~optmem.pytorch.api.OffloadedModule` or
        :class:`~optmem.pytorch.api.RematOffloadedModule`; ``.chain`` is the FSDP-adjusted
        chain and ``.expected_peak_bytes`` the plan's peak on it.

    Raises
    ------
    OptmemInputError
        Before any profile: an unknown ``problem``, a ``bandwidth`` with
        ``problem="checkpoint"``, ``max_stages`` or ``chain``, FSDP2 mixed precision on an
        exported model; after the solve, no plan within ``memory_limit``.
    """
    from optmem.pytorch.api import (
        CheckpointedModule,
        OffloadedModule,
        RematOffloadedModule,
        build_planned,
    )
    from optmem.pytorch.wrapper import is_plain_chain

    if problem not in FSDP_PROBLEMS:  # before the profile: it would be for nothing
        raise OptmemInputError(f"checkpoint_fsdp: problem must be one of "
                               f"{', '.join(map(repr, FSDP_PROBLEMS))}, got {problem!r}",
                               field="problem")
    if problem == "checkpoint" and bandwidth is not None:
        raise OptmemInputError("checkpoint_fsdp: a bandwidth is for problem='offload' or "
                               "'remat_offload'; a checkpoint plan moves nothing to the host",
                               field="bandwidth")
    if not is_plain_chain(module):
        refuse_mixed_precision(type(module).__name__, fsdp_kwargs or {})
    if "max_stages" in checkpoint_kwargs or "chain" in checkpoint_kwargs:
        raise OptmemInputError("checkpoint_fsdp profiles the module's stages itself: "
                               "max_stages and chain are not supported", field="max_stages")

    # an exported model's stage units are FSDP roots of their own: FSDP2 does not prefetch
    prefetched = prefetch and is_plain_chain(module)
    # units that keep their parameters gathered from forward to backward (stop 82)
    kept: Literal["tape", "ops"] | None = None
    if (fsdp_kwargs or {}).get("reshard_after_forward", True) is not True:
        kept = "tape" if problem == "checkpoint" else "ops"

    def adjust(stages: Sequence[Any], chain: Chain) -> Chain:
        modules, world = [s.module for s in stages], _shard_count(mesh)
        return fsdp_chain(chain, stage_parameter_bytes(modules, world), prefetch=prefetched,
                          root_bytes=root_parameter_bytes(modules, world),
                          recompute=problem != "offload", kept=kept)

    cls = {"checkpoint": CheckpointedModule, "offload": OffloadedModule,
           "remat_offload": RematOffloadedModule}[problem]
    link = None if problem == "checkpoint" else ("12GB/s" if bandwidth is None else bandwidth)
    # no store-all fast path: the model itself would bypass the sharded stages, and its
    # plain peak does not count FSDP's gathered parameters
    cmodule = build_planned(cls, problem, module, sample, memory_limit, method, link,
                            {**checkpoint_kwargs, "adjust_chain": adjust,
                             "process_group": process_group, "fast_path": False})
    return fully_shard_checkpointed(cmodule, mesh=mesh, **(fsdp_kwargs or {}))


# ------------------------------------------------------------------ launching
def _spawned(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple,
             timeout_s: float = 600.0) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = rank % torch.cuda.device_count() if backend == "nccl" else rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    set_local_device(backend)  # cuda:LOCAL_RANK is current before NCCL's group is made
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
        dist.barrier()  # all ranks done before teardown (gloo aborts on a peer's early exit)
    finally:
        dist.destroy_process_group()
    end_process(0)


def end_process(code: int = 0) -> NoReturn:
    """End a rank's process once its job is done and its process group destroyed.

    Waits for the threads that are not daemons (after ``threading``'s own exit hooks, which
    stop idle thread pools), runs the ``atexit`` handlers (``multiprocessing``'s finalizers
    among them) and flushes the standard streams, as a normal exit does, then leaves with
    ``os._exit(code)``, skipping the interpreter's finalisation. There, gloo's threads still
    held by a C++ object (DDP's reducer keeps its process group alive past
    ``destroy_process_group``) can abort a finished rank with "terminate called without an
    active exception" (pytorch/pytorch PR 179291 describes the race; seen in this project's
    CI on the DDP example and once on the FSDP2 LoRA test, after every rank had saved its
    results). :func:`spawn`'s ranks and ``optmem train-pipeline`` end with it; a torchrun
    script may call it as its last line.
    """
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit calls
    if shutdown is not None:
        shutdown()  # threading's own exit hooks (thread pools), then non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def spawn(fn: Callable[..., Any], world: int, *args: Any, init_file: str,
          timeout_s: float = 600.0, deadline_s: float | None = 1800.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes (``torch.multiprocessing``).

    ``init_file`` is a path (not existing yet) for the ``file://`` rendezvous. The backend is
    NCCL when CUDA is available (one GPU per rank), gloo otherwise. ``fn`` must be importable
    (a module-level function); the caller's script needs the ``if __name__ == "__main__":``
    guard (spawn start method).

    Nothing waits forever: the process group gets ``timeout_s`` (a collective or
    point-to-point message a rank waits on longer fails that rank, and a failed rank stops
    the others), and if the processes have not all finished ``deadline_s`` seconds after the
    start (``None``: no deadline) they are terminated and :class:`TimeoutError` is raised.
    Both are guards against hangs, not measurements: set them well above the job's run time.
    A rank whose ``fn`` returned ends with :func:`end_process` (a normal exit's work, without
    the interpreter's finalisation, where gloo can abort a finished rank).

    Raises
    ------
    OptmemInputError
        With CUDA, when ``world`` exceeds the GPUs: NCCL does not take two ranks on one GPU
        (before, ranks ``r`` and ``r + count`` shared a GPU and failed inside NCCL).
    """
    import torch.multiprocessing as mp

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and world > count:
        raise OptmemInputError(f"spawn: {world} processes but {count} CUDA device(s): NCCL "
                               "takes one GPU per rank (hide the GPUs, "
                               "CUDA_VISIBLE_DEVICES='', to run gloo on the CPU)",
                               field="world")
    context = mp.start_processes(_spawned, args=(world, f"file://{init_file}", fn, args,
                                                 timeout_s),
                                 nprocs=world, join=False, start_method="spawn")
    start = time.monotonic()
    while not context.join(timeout=1.0):  # raises when a rank failed (and stops the others)
        if deadline_s is not None and time.monotonic() - start > deadline_s:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(10)
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"spawn: {world} processes of {fn.__name__} still running "
                               f"after {deadline_s:g} s; terminated")
