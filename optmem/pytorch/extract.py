"""Chain extraction: turn an ``nn.Module`` into a sequence of stages (a chain).

Three routes, all returning stages (a name and an ``nn.Module`` that takes one value, a
tensor or a tuple of tensors, and returns one value):

* ``nn.Sequential`` is flattened directly, nested ``Sequential`` containers included, as
  rotor does (digest ``rotor.md`` section 6.2, ``extract_children_from_sequential``).
  A ``Sequential`` subclass that overrides ``forward`` (or sets
  ``not_really_sequential = True``) is kept whole.
* :func:`extract_program` (any module, with a sample call): ``torch.export.export``
  (non-strict) first, ``torch.fx.symbolic_trace`` as fallback; the graph is cut by
  :mod:`optmem.pytorch.graphcut` where one value crosses (dominators of the output, with
  networkx), and what needs no gradient (masks, position ids, rotary tables, the other
  inputs) travels beside the chain as side inputs (:mod:`optmem.pytorch.context`). The
  result, an :class:`Extraction`, also assembles the model's own output.
* :func:`extract_stages` on another module without a sample traces it with ``torch.fx``
  and cuts it the same way, every input part of the chain input (no side inputs).

Residual blocks and inception modules have no single-value cut inside them, so they stay
whole; a pre-norm transformer layer is cut between its two residual additions. A stage
never starts with an in-place op on its input (``ReLU(inplace=True)``, ``x.add_(...)``):
that would overwrite a checkpoint or the stage's input leaf.

:func:`merge_stages` groups consecutive stages into at most ``N`` balanced stages (exact
linear-partition DP minimising the costliest group).
"""

from __future__ import annotations

import copy
import inspect
import io
import linecache
import logging
import operator
import os
import re
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils._pytree import tree_flatten, tree_map_only

from optmem.errors import OptmemInputError
from optmem.pytorch.attention import constant_value, elide_constant_masks, masks_as_in_training
from optmem.pytorch.branches import (
    IntermediateBranch,
    branch_location,
    cumulative_batch_norms,
    explain_value_asserts,
    is_value_assert,
    real_values,
    value_branches,
)
from optmem.pytorch.constants import (
    buffers_as_constants,
    candidate_buffers,
    enabled,
    read_as_values,
    record,
    written,
)
from optmem.pytorch.context import SideInputs, side_inputs
from optmem.pytorch.custom_functions import opaque_functions, refuse_functions, restore_functions
from optmem.pytorch.graphcut import (
    CHAIN,
    Cut,
    GraphStage,
    OutputLayout,
    SideProgram,
    build_side_program,
    build_stage_graph,
    classify,
    cut_graph,
    drawn_at_random,
    make_stage,
    output_layout,
)
from optmem.pytorch.hooks import (
    SeededDraws,
    buffers_restored,
    callers_tools_suspended,
    check_backward_hooks,
    check_module_hooks,
    cuda_indices,
    draws_whatever_config,
    generators_restored,
    host_random_restored,
    module_generators,
    random_config,
    refuse_inference_rescaling,
    refuse_python_random,
    refuse_tensor_hooks,
    warn_forward_hooks,
)
from optmem.pytorch.observers import (
    GlobalHook,
    HookCall,
    ObserverPlan,
    global_hooks_traced,
    hooked_modules,
    hooks_recorded,
    observer_plan,
)
from optmem.pytorch.overflow_guards import overflow_guards

__all__ = ["Extraction", "Stage", "derives_from", "export_dynamic", "extract_program",
           "extract_stages", "flattened_containers", "merge_stages", "partition_costs",
           "stage_cost"]

_log = logging.getLogger("optmem")


@dataclass(frozen=True)
class Stage:
    """One stage of the chain: a display name and a module ``value -> value``."""

    name: str
    module: nn.Module


class StageGroup(nn.Module):
    """Several stages run one after the other as one stage (result of merging)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, x: Any) -> Any:  # noqa: D102 - runs the parts in order
        for part in self.parts:
            x = part(x)
        return x

    def compiled_call(self, compile_part: Callable[[nn.Module], Any],
                      options: dict[str, Any]) -> Callable[[Any], Any]:
        """The parts compiled one by one (``compile_part``), run in order."""
        parts = [compile_part(p) for p in self.parts]

        def run(x: Any) -> Any:
            for part in parts:
                x = part(x)
            return x

        return run


# ------------------------------------------------------------------ nn.Sequential
def is_plain_sequential(module: nn.Module) -> bool:
    if not isinstance(module, nn.Sequential):
        return False
    if getattr(module, "not_really_sequential", False):
        return False
    return type(module).forward is nn.Sequential.forward


def _flatten_sequential(module: nn.Sequential, prefix: str) -> list[Stage]:
    out: list[Stage] = []
    # as Sequential.forward: every entry, a module that appears twice runs twice
    for name, child in module._modules.items():
        if child is None:
            continue
        full = f"{prefix}.{name}" if prefix else name
        if is_plain_sequential(child):
            out.extend(_flatten_sequential(child, full))  # type: ignore[arg-type]
        else:
            out.append(Stage(full, child))
    return out


def flattened_containers(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The ``nn.Sequential`` containers :func:`_flatten_sequential` flattens, ``module`` first.

    ``(name, container)`` pairs; their own hooks never run in a plan's stage calls
    (:func:`~optmem.pytorch.hooks.warn_container_hooks`).
    """
    out: list[tuple[str, nn.Module]] = [(prefix, module)]
    for name, child in module._modules.items():
        full = f"{prefix}.{name}" if prefix else name
        if child is not None and is_plain_sequential(child):
            out.extend(flattened_containers(child, full))
    return out


def _module_is_inplace(module: nn.Module) -> bool:
    return bool(getattr(module, "inplace", False))


def _merge_inplace_heads(stages: list[Stage]) -> list[Stage]:
    """Merge every stage that starts with an in-place op into the stage before it."""
    out: list[Stage] = []
    for st in stages:
        if out and _module_is_inplace(st.module):
            prev = out.pop()
            parts = (list(prev.module.parts) if isinstance(prev.module, StageGroup)
                     else [prev.module])
            out.append(Stage(f"{_first_name(prev.name)}..{st.name}",
                             StageGroup([*parts, st.module])))
        else:
            out.append(st)
    return out


def _first_name(name: str) -> str:
    return name.split("..")[0]


# ------------------------------------------------------------------ graphs
def _module_path(node: fx.Node) -> str | None:
    """The module a node belongs to: its ``call_module`` target or export's module stack."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return None


def _common_module_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for group in zip(*parts, strict=False):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    if len(names) > 1 and len(common) == min(len(p) for p in parts):
        common = common[:-1] if len(common) > 1 else common
    return ".".join(common)


def _segment_name(nodes: list[fx.Node], detailed: bool = False) -> str:
    """A stage name from the modules its nodes belong to.

    ``detailed`` (exported graphs, where every node knows its module): the common module
    and the children it covers, ``model.layers.0:input_layernorm+self_attn``.
    """
    body = [n for n in nodes if n.op not in ("get_attr", "placeholder")]
    names = [str(n.target) if n.op == "call_module" else n.name for n in body]
    if not names:
        return "input"
    if detailed:
        label = _module_label([p for p in map(_module_path, body) if p is not None])
        if label:
            return label
    modules = [str(n.target) for n in body if n.op == "call_module"]
    prefix = _common_module_prefix(modules) if len(modules) > 1 else ""
    if prefix:
        return prefix
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _module_label(paths: list[str]) -> str:
    """``common.module:child1+child2`` for the modules of a stage (empty if none)."""
    split = [p.split(".") if p else [] for p in dict.fromkeys(paths)]
    if not split:
        return ""
    common: list[str] = []
    for group in zip(*split, strict=False):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    children = list(dict.fromkeys(p[len(common)] for p in split if len(p) > len(common)))
    if len(children) > 3:
        children = [children[0], "..", children[-1]]
    label = "+".join(children).replace("+..+", "..")
    prefix = ".".join(common)
    return f"{prefix}:{label}" if prefix and label else prefix or label


def _inputs_of_first_stage(placeholders: list[fx.Node], positions: dict[str, int],
                           count: int) -> dict[fx.Node, Callable[[fx.Graph, fx.Node], fx.Node]]:
    """The placeholders read from ``a^0``: the value itself, or one item of its tuple."""
    out: dict[fx.Node, Callable[[fx.Graph, fx.Node], fx.Node]] = {}
    for p in placeholders:
        if p.name not in positions:
            continue
        out[p] = _whole if count == 1 else _item(positions[p.name])
    return out


def _whole(graph: fx.Graph, x: fx.Node) -> fx.Node:
    return x


def _item(k: int) -> Callable[[fx.Graph, fx.Node], fx.Node]:
    def make(graph: fx.Graph, x: fx.Node) -> fx.Node:
        return graph.call_function(operator.getitem, (x, k))

    return make


def _boundary_inputs(boundary: fx.Node, carried: list[fx.Node]
                     ) -> dict[fx.Node, Callable[[fx.Graph, fx.Node], fx.Node]]:
    """What a stage reads from its input: the boundary, or the tuple ``(boundary, *carried)``."""
    if not carried:
        return {boundary: _whole}
    return {v: _item(k) for k, v in enumerate([boundary, *carried])}


def _graph_stages(gm: fx.GraphModule, model: nn.Module | None, cut: Cut,
                  first_inputs: dict[fx.Node, Callable[[fx.Graph, fx.Node], fx.Node]],
                  detailed: bool, taps: Collection[str] = (),
                  tapped: set[str] | None = None) -> list[Stage]:
    """The stages of ``cut``; the values named in ``taps`` observed where met (``tapped``)."""
    stages: list[Stage] = []
    last = len(cut.stages) - 1
    for s, nodes in enumerate(cut.stages):
        inputs: dict[fx.Node, Callable[[fx.Graph, fx.Node], fx.Node]] = (
            first_inputs if s == 0
            else _boundary_inputs(cut.boundaries[s - 1], cut.carried[s - 1]))
        returns: Any
        if s < last:  # the boundary, or the tuple (boundary, *carried)
            returns = (cut.boundaries[s], *cut.carried[s]) if cut.carried[s] \
                else cut.boundaries[s]
        else:
            returns = tuple(cut.outputs) if len(cut.outputs) > 1 else cut.outputs[0]
        built = build_stage_graph(nodes, cut.kinds, inputs, returns, taps)
        if tapped is not None:
            tapped |= built.tapped
        stages.append(Stage(_segment_name(nodes, detailed), make_stage(gm, model, built)))
    return stages


def _symbolic_trace(module: nn.Module, seeded: SeededDraws | None = None) -> fx.GraphModule:
    """``torch.fx``'s trace, refusing what its graph would drop.

    Python randomness and tensor hooks (:mod:`~optmem.pytorch.hooks`), custom autograd
    Functions (:func:`~optmem.pytorch.custom_functions.refuse_functions`). ``seeded``
    receives the host generators the module seeds itself (:class:`SeededDraws`).
    """
    name = type(module).__name__
    with refuse_python_random(name, module, seeded), refuse_tensor_hooks(name), \
            refuse_functions(name):
        tracer = _Tracer()
        graph = tracer.trace(module)
        return fx.GraphModule(tracer.root, graph, name)


class _Tracer(fx.Tracer):
    """``fx.symbolic_trace``'s tracer, keeping ``torch.jit.script``-ed submodules whole.

    fx would trace into a scripted module's ``forward`` and record a call of its C++ object
    (``self.block._c.forward(x)``), whose parameters no stage module holds: the stage's
    backward would lose their gradients. Called as a module, the stage holds it, with its
    parameters.
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, torch.jit.ScriptModule) or super().is_leaf_module(
            m, module_qualified_name)


def _trace(module: nn.Module) -> fx.GraphModule:
    check_module_hooks(module)
    try:
        return _symbolic_trace(module)
    except OptmemInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear message
        raise OptmemInputError(
            f"cannot extract a chain from {type(module).__name__}: it is not an nn.Sequential "
            f"and torch.fx cannot trace it ({_first_line(exc)}). Give a sample batch "
            "(torch.export is tried first then), wrap the traceable parts in an "
            "nn.Sequential, or pass a list of stages.", field="module") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _fx_stages(module: nn.Module) -> list[Stage]:
    """Legacy route without a sample: every placeholder is part of ``a^0``, no side inputs."""
    gm = _trace(module)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise OptmemInputError(f"{type(module).__name__}.forward takes no input", field="module")
    kinds = classify(gm, None, side=False)
    cut = _cut(gm, kinds, module)
    positions = {p.name: k for k, p in enumerate(placeholders)}
    return _graph_stages(gm, None, cut,
                         _inputs_of_first_stage(placeholders, positions, len(placeholders)),
                         detailed=False)


def _cut(gm: fx.GraphModule, kinds: dict[fx.Node, str], module: nn.Module) -> Cut:
    try:
        return cut_graph(gm, kinds)
    except ValueError as exc:
        raise OptmemInputError(f"no chain found in {type(module).__name__}: {exc}",
                               field="module") from None


# ------------------------------------------------------------------ programs (with a sample)
@dataclass
class Extraction:
    """A module cut into a chain, with what runs beside it.

    Attributes
    ----------
    stages
        The chain: modules ``value -> value``. The first takes ``a^0``, the tuple of the
        call's tensors (or the tensor alone); stages read their side inputs from the
        context (:mod:`optmem.pytorch.context`).
    side
        Computes the side inputs of a call from its flat inputs.
    output
        Assembles the module's output (a ``ModelOutput``, a tuple, a tensor) from the chain
        output and the side inputs.
    method
        ``"export"`` (``torch.export``, non-strict) or ``"fx"`` (``torch.fx`` fallback).
    """

    stages: list[Stage]
    side: SideProgram
    output: OutputLayout
    method: str
    in_spec: Any
    signature: inspect.Signature | None
    input_names: tuple[str, ...]
    tensor_positions: tuple[int, ...]
    _graph_stages: list[GraphStage] | None = field(default=None, init=False, repr=False,
                                                    compare=False)
    accepts: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = field(
        default=None, repr=False, compare=False)
    """For a graph exported with dynamic sizes (:func:`export_dynamic`): whether a call's
    inputs meet the graph's size constraints (``None``: the graph is specialised to the
    sizes of the call it was extracted from)."""
    carried: tuple[str, ...] = field(default=(), compare=False)
    """The long-lived values carried beside the boundaries (their modules), if any
    (:func:`~optmem.pytorch.graphcut.long_lived`)."""
    value_branches: tuple[str, ...] = field(default=(), compare=False)
    """Where the forward branches on tensor values (``file:line (`code`)``): the graph holds
    the sample's side of each and asserts it at every call (:mod:`optmem.pytorch.branches`)."""
    seeded: SeededDraws = field(default_factory=SeededDraws, compare=False)
    """The host generators the forward seeds itself and draws from (HF BigBird's NumPy), as
    a call leaves them; a run of the stages leaves them so too (:meth:`SeededDraws.replay`)."""
    observers: ObserverPlan = field(default_factory=ObserverPlan, compare=False)
    """The forward hooks of inner modules that return ``None``, called with the stages'
    values at every step (:mod:`optmem.pytorch.observers`)."""

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The call's inputs in the graph's placeholder order."""
        if self.in_spec is not None:
            return list(fx_pytree.tree_flatten_spec((args, kwargs), self.in_spec))
        assert self.signature is not None
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return [bound.arguments[name] for name in self.input_names]

    def chain_input(self, flat: Sequence[Any]) -> Any:
        """``a^0``: the call's tensors (a tuple), or the only one."""
        tensors = tuple(flat[k] for k in self.tensor_positions)
        return tensors[0] if len(tensors) == 1 else tensors

    def side_inputs(self, flat: Sequence[Any]) -> SideInputs:
        """The side inputs of a call (computed without gradients)."""
        return self.side(flat)

    def rebind(self) -> None:
        """Point every stage at the model's current parameters and buffers.

        Called at every step: the :class:`GraphStage` modules of the stages are listed once
        (the stages' module trees do not change after the extraction); each compares its
        bindings with the model's current attributes.
        """
        self.side.rebind()
        if self._graph_stages is None:
            self._graph_stages = [m for st in self.stages for m in st.module.modules()
                                  if isinstance(m, GraphStage)]
        for m in self._graph_stages:
            m.rebind()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Reference forward: the stages one after the other, output assembled."""
        flat = self.flatten(args, kwargs)
        ctx = self.side_inputs(flat)
        with side_inputs(ctx):
            out = run_stages(self.stages, self.chain_input(flat))
        return self.output.assemble(out, ctx)


def extract_program(module: nn.Module, args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None, *,
                    method: str = "auto", allow_single: bool = False,
                    observe: bool = False) -> Extraction:
    """Cut ``module`` called as ``module(*args, **kwargs)`` into a chain.

    ``torch.export.export(..., strict=False)`` first (``method="auto"`` or ``"export"``),
    ``torch.fx.symbolic_trace`` as fallback (``"auto"`` or ``"fx"``). The graph is
    specialised to the call: its shapes, dtypes, flags, which keyword arguments are given,
    the training mode and the autocast state. ``allow_single`` accepts a chain of one
    stage (nothing to checkpoint). ``observe``: the forward hooks of inner modules that
    return ``None`` go to :attr:`Extraction.observers` (the wrapper calls them at every
    step, running its stages under :func:`~optmem.pytorch.observers.observing`); otherwise
    (and for the hooks left out) a warning says they are not called again.

    Raises
    ------
    OptmemInputError
        Naming the module, why each route failed, and what to do.
    """
    ext = _extract_program(module, args, kwargs, method, observe)
    if len(ext.stages) == 1 and not allow_single:
        raise OptmemInputError(_single_stage_message(module), field="module")
    return ext


def _single_stage_message(module: nn.Module) -> str:
    """Why a graph of one stage saves nothing, and the three ways out.

    A value live from the start to the end crosses every boundary: the input read again at
    the end, or an output computed early. HF CLIPSeg returns every hidden state of its
    frozen vision tower (``vision_model_output``), whatever ``output_hidden_states``
    says: a module around it that returns only what the step needs has a chain (stop 87).
    """
    return (f"no chain found in {type(module).__name__}: its graph has no cut point (a "
            "value such as the input is used again at the very end, or an output computed "
            "early, such as hidden states it returns), so it is one stage "
            "and checkpointing cannot save memory. Call it without such outputs "
            "(output_hidden_states=False; when the model returns them whatever its "
            "arguments, wrap an nn.Module whose forward returns only what the step needs, "
            "e.g. the loss and logits), wrap a part of it that holds its layers alone "
            "(`sample = optmem.pytorch.submodule_sample(model, part, **batch)`, then "
            "`optmem.pytorch.checkpoint(part, sample, memory_limit)` in its place), or "
            "split it into an nn.Sequential of blocks or a list of stage modules "
            "(extract_stages/extract_program accept a single stage with allow_single=True)")


def _extract_program(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                     method: str, observe: bool = False) -> Extraction:
    kwargs = dict(kwargs or {})
    name = type(module).__name__
    if method not in ("auto", "export", "fx"):
        raise OptmemInputError(f"expected method auto, export or fx, got {method!r}",
                               field="extract")
    check_backward_hooks(module)
    refuse_cache_input(name, (args, kwargs))
    refuse_inference_rescaling(module)
    errors = []
    branch, intermediate, again, owner, size = None, False, "", None, False
    drawn = False  # the intermediate branch is on a random draw (OmniASR's LayerDrop)
    if method in ("auto", "export"):
        try:
            ext = _export_program(module, args, kwargs, observe=observe)
            warn_forward_hooks(module, ext.observers.hook_ids)
            return ext
        except OptmemInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported below, with the fx attempt
            unknown = unknown_output_type(exc)
            if unknown is not None:  # fx would cut a graph whose output hides its tensors
                raise OptmemInputError(_unknown_output_message(name, unknown),
                                       field="module") from None
            checked = validated_distribution(exc)
            if checked is not None:  # its value check cannot be a graph; fx fails there too
                raise OptmemInputError(_distribution_message(name, checked),
                                       field="module") from None
            if passes_packed_sequence(exc):  # its batch sizes are values; fx fails too
                packed_in = _failed_at(module, failed_in(exc, module))
                raise OptmemInputError(_packed_message(name, packed_in),
                                       field="module") from None
            errors.append(f"torch.export: {_first_line(exc)}")
            branch = data_dependent_branch(exc)
            owner = _known_module(module, getattr(exc, "owner", None)) or failed_in(exc, module)
            intermediate = isinstance(exc, IntermediateBranch)
            drawn = intermediate and getattr(exc, "drawn", False)
            again = _real_values_failure(exc)
            size = bool(getattr(exc, "data_dependent_size", False))
            if size:
                branch, owner = _size_site(exc, branch, owner)
    if method in ("auto", "fx"):
        try:
            fx_ext = _fx_program(module, args, kwargs)
            warn_forward_hooks(module)
            return fx_ext
        except OptmemInputError:
            raise
        except Exception as exc:  # noqa: BLE001
            errors.append(f"torch.fx: {_first_line(exc)}")
    hint = _part_hint(module, owner, (args, kwargs))
    if branch is not None:
        tried = " nor ".join(e.split(":")[0] for e in errors)
        # a random draw first (NLLB-MoE's LayerDrop, then its experts' loop): say that
        if intermediate or (size and random_config(module)):
            raise OptmemInputError(
                _intermediate_message(module, branch, tried, owner, hint, drawn=drawn),
                field="module")
        if size:
            raise OptmemInputError(_size_message(module, branch, tried, owner, hint),
                                   field="module")
        why = (f" (exported again with the sample's values, to take its side, the export "
               f"failed further on: {again}{_autocast_note(again)})") if again else ""
        raise OptmemInputError(
            f"cannot extract a chain from {name}: its forward branches on the value of a "
            f"tensor at {branch}{_failed_at(module, owner)}, which "
            f"{'neither ' if ' nor ' in tried else ''}{tried} can hold in a graph{why}. Call "
            "it without the input that leads there (for a check on labels: without labels, "
            f"computing the loss from the outputs), {hint or 'or '}pass an "
            "nn.Sequential of its blocks or a list of stage modules instead", field="module")
    raise OptmemInputError(
        f"cannot extract a chain from {name} ({'; '.join(errors)}){_failed_at(module, owner)}:"
        f"{_missing_mask_hint(module, kwargs, errors)}{_lifted_hint(errors)}"
        f"{_numpy_hint(errors)} "
        f"{hint}pass an "
        "nn.Sequential of its blocks or a list of stage modules instead", field="module")


def _size_site(exc: BaseException, branch: str | None, owner: str | None
               ) -> tuple[str | None, str | None]:
    """Where the export with the sample's values met its data-dependent size, if known.

    Only when the first failure was an ``if`` on a value, which those values resolved (HF
    OneFormer's overflow guard, then its decoder's boolean index); a first failure that
    is a loop over such a tensor (``for e in hit:``, the experts a router picked) is
    where the size is, and stays named. ``(branch, owner)`` of the first failure
    otherwise.
    """
    at, at_owner = getattr(exc, "size_at", (None, None))
    resolved = branch is not None and ("(`if " in branch or "(`elif " in branch)
    return (at, at_owner) if at is not None and resolved else (branch, owner)


def failed_in(exc: BaseException, model: nn.Module) -> str | None:
    """The qualified name of the innermost submodule of ``model`` whose code raised ``exc``.

    Read from the frames of the failure's traceback (non-strict ``torch.export`` runs the
    model's Python code): the last frame whose ``self`` is a module of ``model`` other than
    ``model`` itself. ``None`` when no such frame is found.
    """
    found = _failing_frame(exc, model, itself=False)
    return None if found is None else found[0]


def failed_line(exc: BaseException, model: nn.Module) -> str | None:
    """``file:line (`code`)`` in the innermost submodule's code that raised ``exc``.

    The frame :func:`failed_in` names the module of, or ``model``'s own; ``None``
    without one.
    """
    found = _failing_frame(exc, model, itself=True)
    if found is None:
        return None
    frame = found[1]
    path, line = frame.f_code.co_filename, frame.f_lineno
    return _site(path, line, linecache.getline(path, line))


def _failing_frame(exc: BaseException, model: nn.Module, *, itself: bool
                   ) -> tuple[str, FrameType] | None:
    """The innermost frame of ``exc``'s chain a submodule of ``model`` runs, and its name.

    ``model``'s own frames count too if ``itself``.
    """
    names = {id(m): n for n, m in model.named_modules() if n or itself}
    for current in _exception_chain(exc):
        found: tuple[str, FrameType] | None = None
        for frame in _frames(current):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                found = (names[id(owner)], frame)
        if found is not None:
            return found
    return None


PART_SHARE = 0.25
"""The least share of a model's parameters a part must hold to be suggested for wrapping."""


def called_modules(model: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> set[int] | None:
    """The ids of the modules ``model(*args, **kwargs)`` runs, or ``None`` if it fails.

    One plain call under ``no_grad`` (only on an extraction's error path) that leaves no
    trace: torch's, Python's and NumPy's random states and the buffers are restored, the
    caller's tools (``FlopCounterMode``, ...) see nothing.
    """
    called: set[int] = set()

    def note(module: nn.Module, _: Any) -> None:
        called.add(id(module))

    devices = cuda_indices([*model.parameters(), *model.buffers()])
    try:
        with callers_tools_suspended(), torch.random.fork_rng(devices=devices), \
                generators_restored(module_generators(model)), host_random_restored(), \
                buffers_restored([model]), torch.no_grad():
            # registered inside: the suspension takes the global hooks away meanwhile
            handle = nn.modules.module.register_module_forward_pre_hook(note)
            try:
                model(*args, **kwargs)
            finally:
                handle.remove()
    except Exception:  # noqa: BLE001 - no call, no part to name
        return None
    return called


def plannable_part(model: nn.Module, failed: str, called: set[int] | None = None
                   ) -> str | None:
    """The largest part of ``model`` worth wrapping alone when the export failed in ``failed``.

    The part with the most parameters (at least :data:`PART_SHARE` of the model's) that
    holds a list of two or more blocks (an ``nn.ModuleList``: the layers, where the
    activation memory is) and no module of the failed one's class (whose code would fail
    the same way), is called by the sample's call (``called``, :func:`called_modules`, when
    given; never a ``ModuleList`` or ``ModuleDict``), and is neither the failed module nor
    one of its ancestors: Qwen2-VL's language model when its vision attention failed.
    ``None`` when there is none (a failure in every layer of the model).
    """
    kind = type(model.get_submodule(failed))
    total = sum(p.numel() for p in model.parameters())
    best: tuple[int, str] | None = None
    for name, sub in model.named_modules():
        if (not name or failed == name or failed.startswith(name + ".")
                or isinstance(sub, (nn.ModuleList, nn.ModuleDict))  # never called
                or called is not None and id(sub) not in called):
            continue
        inside = list(sub.modules())
        if any(isinstance(m, kind) for m in inside) or not any(
                isinstance(m, nn.ModuleList) and len(m) > 1 for m in inside):
            continue
        size = sum(p.numel() for p in sub.parameters())
        if size >= PART_SHARE * total and (best is None or size > best[0]):
            best = (size, name)
    return None if best is None else best[1]


def _known_module(model: nn.Module, name: str | None) -> str | None:
    """``name`` if it names a submodule of ``model`` (not ``model`` itself), else ``None``."""
    if not name:
        return None
    try:
        model.get_submodule(name)
    except AttributeError:
        return None
    return name


def _autocast_note(again: str) -> str:
    """Why the export with the sample's values failed under autocast, if it did there.

    ``torch.export``'s real-tensor propagation (which takes the sample's side of a value
    branch) finds its real and fake tensors disagreeing under autocast (Wav2Vec2's
    GroupNorm under CPU bfloat16), and the export of the model alone fails the same way
    (torch 2.13; stop 82, Wav2Vec2's CTC labels check).
    """
    if "MetadataMismatchError" not in again or not any(
            torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        return ""
    return ("; under autocast, where torch.export's real-tensor propagation fails on this "
            "model, as it does exporting the model alone: call it outside autocast, or "
            "without the input that leads to the branch")


def _failed_at(model: nn.Module, owner: str | None) -> str:
    """``" in 'name' (a Class)"``: the module where the export failed, if known."""
    if owner is None:
        return ""
    return f" in {owner!r} (a {type(model.get_submodule(owner)).__name__})"


def _part_hint(model: nn.Module, owner: str | None,
               call: tuple[tuple[Any, ...], dict[str, Any]]) -> str:
    """How to plan the part of ``model`` that does not run the failed module, if any.

    Only a module the sample's ``call`` runs is named; none if the call fails. The call is
    made only when some module qualifies without it (the called ones are fewer).
    """
    if owner is None or plannable_part(model, owner) is None:
        return ""
    called = called_modules(model, *call)
    part = None if called is None else plannable_part(model, owner, called)
    if part is None:
        return ""
    kind = type(model.get_submodule(part)).__name__
    return (f"wrap {part!r} (a {kind}, which does not run it) alone: `part = "
            f"model.get_submodule({part!r}); sample = optmem.pytorch.submodule_sample(model, "
            "part, **batch)`, then put `optmem.pytorch.checkpoint(part, sample, "
            "memory_limit)` in its place, or ")


def _lifted_hint(errors: list[str]) -> str:
    """A hint when export found a fake tensor among the graph's constants.

    Torch names the constant (``model.layers.0.lifted_tensor_0``), not the code. A tensor
    the forward makes outside autograd's view of the parameters does this, typically an
    in-place write to a parameter's ``.data`` (HF Gemma 3n's AltUp clamps
    ``prediction_coefs.weight.data`` in training).
    """
    if not any("fake tensor in the exported program constant" in e for e in errors):
        return ""
    return (" its forward makes a tensor outside autograd, typically by writing a "
            "parameter's .data in place, which export cannot hold (HF Gemma 3n clamps its "
            "AltUp coefficients so in training; model.config.altup_coef_clip = None turns "
            "that off, and changes its training);")


def _numpy_hint(errors: list[str]) -> str:
    """A hint when the forward converts a traced tensor to NumPy (stop 85).

    HF MaskFormer's loss matches predictions to labels with SciPy's Hungarian algorithm on
    ``cost.cpu()`` (NumPy): no graph holds it, with or without the sample's values.
    """
    if not any(".numpy() is not supported" in e for e in errors):
        return ""
    return (" its forward converts a tensor to NumPy (a Hungarian matching in a detection "
            "or segmentation loss, MaskFormer's), which no graph holds: call it without "
            "labels and compute the loss from its outputs, or")


def _missing_mask_hint(module: nn.Module, kwargs: dict[str, Any], errors: list[str]) -> str:
    """A hint when export met a ``None`` where an ``attention_mask`` the call left out goes.

    Some HF code builds its mask from ``attention_mask`` while tracing and fills it in only
    in eager mode (``if attention_mask is None and not is_torchdynamo_compiling()``:
    LongT5, SwitchTransformers), so the export meets ``None`` where the eager model has a
    tensor of ones.
    """
    try:
        takes_mask = "attention_mask" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return ""
    met_none = any("NoneType" in e for e in errors if e.startswith("torch.export"))
    if not takes_mask or "attention_mask" in kwargs or not met_none:
        return ""
    return (" its export met None where eager code builds a default mask (HF's LongT5 and "
            "SwitchTransformers fill in attention_mask only outside tracing): call it "
            "with attention_mask=torch.ones_like(input_ids), or")


def _intermediate_message(module: nn.Module, where: str, tried: str,
                          owner: str | None = None, hint: str = "", *,
                          drawn: bool = False) -> str:
    """Why a branch on an intermediate value stops extraction, and what to do.

    ``drawn``: the value is a random draw (:func:`~optmem.pytorch.graphcut.drawn_at_random`).
    """
    neither = "neither " if " nor " in tried else ""
    what = ("a random draw made inside the forward (LayerDrop's torch.rand)" if drawn else
            "a value computed inside the forward (a router's choice, LayerDrop's random draw, "
            "a length read from an input's values: FastSpeech2's durations, repeated with "
            "repeat_interleave, or a size or split read from an input's values: a vision "
            "tower splitting its patches by the image sizes)")
    return (f"cannot extract a chain from {type(module).__name__}: its forward branches on "
            f"the value of an intermediate tensor at {where}{_failed_at(module, owner)}, "
            f"{what}, which may take another side at every step and which {neither}{tried} "
            f"can hold in a graph.{_what_to_do(module, hint, drawn=drawn)}")


def _size_message(module: nn.Module, where: str, tried: str, owner: str | None,
                  hint: str) -> str:
    """Why a size that depends on computed values stops extraction, and what to do.

    The export failed on a data-dependent guard, and again with the sample's values: the
    guard is on a size no input value fixes (``nonzero``, boolean indexing, ``tolist``, a
    loop over such a tensor: the experts a router picked). Such values may come from the
    inputs alone (Kolibri 1.1's indexer groups by the attention mask's values).
    """
    neither = "neither " if " nor " in tried else ""
    return (f"cannot extract a chain from {type(module).__name__}: its forward makes a "
            f"tensor whose size depends on values computed in the call at {where}"
            f"{_failed_at(module, owner)} (torch.nonzero, boolean indexing, .tolist(), or a "
            "loop over such a tensor, e.g. over the experts a router picked), which may "
            f"change with the inputs and which {neither}{tried} can hold in a graph, even "
            f"with the sample's values.{_what_to_do(module, hint)}")


#: The code change :func:`_what_to_do` names for a branch on a draw made whatever the config.
_DRAW_FIX = "drawing only when layerdrop > 0"


def _what_to_do(module: nn.Module, hint: str, *, drawn: bool = False) -> str:
    """The advice closing :func:`_intermediate_message` and :func:`_size_message`.

    The config fields that draw at random first (:func:`random_config`), then the generic
    advice; a part to plan alone (``hint``) only without them (the part has the same
    config: M2M100's decoder has its own LayerDrop). A branch on a draw (``drawn``) with no
    such field on: the model draws whatever its config (:func:`draws_whatever_config`).
    """
    config = random_config(module)
    rest = f"{'' if config else hint}pass an nn.Sequential of its blocks or a list of " \
        "stage modules"
    if config:
        return f"{config} Otherwise {rest} instead"
    if drawn:
        return f"{draws_whatever_config(_DRAW_FIX)}. Otherwise {rest} instead"
    return f" Instead, {rest}"


_UNKNOWN_OUTPUT = re.compile(r"Found <class '([^']+)'> in output, which is not a known type")


_DISTRIBUTION_FILE = os.path.join("torch", "distributions", "distribution.py")
_VALIDATING = ("__init__", "_validate_sample")


def validated_distribution(exc: BaseException) -> str | None:
    """The ``torch.distributions`` class whose argument check stopped the export, if one did.

    A distribution built with validation on (``validate_args=None`` under Python's default
    ``__debug__``) checks its parameters' values (``Normal``'s ``scale > 0``) in
    ``Distribution.__init__`` and a sample's in ``_validate_sample``: a branch on a
    computed value, which no graph holds. Read from the frames of ``exc`` and the
    exceptions it chains (the export runs the model's Python code).
    """
    for frame in _failure_frames(exc):
        code = frame.f_code
        if code.co_filename.endswith(_DISTRIBUTION_FILE) and code.co_name in _VALIDATING:
            return type(frame.f_locals.get("self")).__name__
    return None


def passes_packed_sequence(exc: BaseException) -> bool:
    """Whether a frame ``exc`` went through held a ``PackedSequence`` (an RNN's packed batch).

    ``pack_padded_sequence`` makes ``batch_sizes`` from the lengths' values, and the RNN
    kernel sizes its work from them: no graph holds that (export and fx both fail inside
    the RNN).
    """
    from torch.nn.utils.rnn import PackedSequence

    return any(isinstance(value, PackedSequence)
               for frame in _failure_frames(exc) for value in frame.f_locals.values())


def _failure_frames(exc: BaseException) -> Iterator[FrameType]:
    """The frames of ``exc``'s traceback and of the exceptions it chains, outermost first."""
    for current in _exception_chain(exc):
        yield from _frames(current)


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it chains (``__cause__``, else ``__context__``), once each."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _frames(exc: BaseException) -> Iterator[FrameType]:
    """The frames of ``exc``'s own traceback, outermost first."""
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _packed_message(name: str, where: str) -> str:
    """Why an RNN on a ``PackedSequence`` stops extraction, and what to do."""
    return (f"cannot extract a chain from {name}: its forward passes a PackedSequence "
            f"(pack_padded_sequence) to an RNN{where}, whose batch sizes are values of the "
            "lengths that no graph can hold. Run the RNN on the padded batch (mask the "
            "padded steps in the loss), or pass an nn.Sequential of its blocks or a list "
            "of stage modules, with the packing and the RNN inside one stage")


def _distribution_message(name: str, distribution: str) -> str:
    """Why a validated ``torch.distributions`` object stops extraction, and what to do."""
    return (f"cannot extract a chain from {name}: its forward builds a "
            f"torch.distributions.{distribution} that validates its arguments' values "
            "(validate_args, on by default), a check on values computed in the call that no "
            f"graph can hold. Build it with {distribution}(..., validate_args=False), or call "
            "torch.distributions.Distribution.set_default_validate_args(False) before "
            "wrapping (rsample() and log_prob() are the same without the check)")


def unknown_output_type(exc: BaseException) -> str | None:
    """The class ``torch.export`` found in a model's output and cannot flatten, if that failed.

    Examples
    --------
    >>> unknown_output_type(RuntimeError("Found <class 'm.Out'> in output, which is not a "
    ...                                  "known type. If this type holds tensors, ..."))
    'm.Out'
    >>> unknown_output_type(RuntimeError("something else")) is None
    True
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        match = _UNKNOWN_OUTPUT.search(str(current))
        if match:
            return match.group(1)
        current = current.__cause__ or current.__context__
    return None


def derives_from(cls: type, name: str, package: str) -> bool:
    """Whether ``cls`` or a base of it is the class ``name`` of ``package`` (not imported).

    Examples
    --------
    >>> derives_from(bool, "int", "builtins"), derives_from(dict, "Cache", "x")
    (True, False)
    """
    return any(c.__name__ == name and (c.__module__ == package or
                                       c.__module__.startswith(package + "."))
               for c in cls.__mro__)


def _is_hf_cache(value: Any) -> bool:
    """Whether ``value`` is a HuggingFace generation cache (``transformers`` ``Cache``)."""
    return derives_from(type(value), "Cache", "transformers")


_CACHE_ADVICE = ("PEFT's prefix tuning passes its prefix so: wrap the whole PeftModel "
                 "(op.checkpoint(peft_model, ...), which builds the prefix inside the "
                 "graph) on a model that does not return the cache it is given (GPT-2, "
                 "not Llama), or use prompt tuning or P-tuning "
                 "(PromptTuningConfig, PromptEncoderConfig), which prepend embeddings")


def refuse_cache_input(name: str, call: Any) -> None:
    """One clear error for a generation cache among a training call's inputs.

    A ``transformers`` ``Cache`` (``DynamicCache``) is no pytree: ``torch.export`` refuses
    it as an input and ``torch.fx`` fails inside the attention (stop 84: a backbone wrapped
    inside a prefix-tuned ``PeftModel``, which passes its prefix as ``past_key_values``).

    Raises
    ------
    OptmemInputError
        On the ``module`` field, naming the cache's class.
    """
    leaves, _ = tree_flatten(call)
    cache = next((v for v in leaves if _is_hf_cache(v)), None)
    if cache is not None:
        raise OptmemInputError(
            f"{name} is called with a generation cache ({type(cache).__name__}, "
            "past_key_values) in training, which no extracted graph can take as an input: "
            f"{_CACHE_ADVICE}", field="module")


def _unknown_output_message(name: str, cls: str) -> str:
    short = cls.rsplit(".", 1)[-1]
    if short.endswith("Cache") and cls.startswith("transformers"):
        return (f"{name} returns a generation cache ({short}) although the wrapper calls "
                "it with use_cache=False: its model returns the cache it is given as "
                f"past_key_values, which no graph can hold; {_CACHE_ADVICE}")
    return (f"{name} returns a {cls}, which torch cannot look into (not a registered pytree), "
            f"so no graph can hold its output: register it before wrapping, "
            f"torch.export.register_dataclass({short}) for a dataclass "
            "(torch.utils._pytree.register_pytree_node otherwise), or return a tuple or a dict")


def _hidden_tensor_types(flat: Sequence[Any]) -> list[str]:
    """Names of the dataclasses among the call's leaves: objects whose tensors torch cannot see."""
    import dataclasses

    return sorted({type(v).__name__ for v in flat
                   if dataclasses.is_dataclass(v) and not isinstance(v, type)})


_RAISED_AT = re.compile(r'The following call raised this error:\s*\n\s*File "([^"]+)", line '
                        r"(\d+), in \S+\s*\n\s*(.+)")


def data_dependent_branch(exc: BaseException) -> str | None:
    r"""Where ``torch.export`` met a branch on a tensor's value: ``file:line (`code`)``.

    ``None`` unless ``exc`` is such a failure naming the user's line: a
    ``GuardOnDataDependentSymNode`` export could not resolve even with the sample's values
    (the sample's side raises: HF's ``if labels.max() >= vocab_size: raise`` on labels out
    of range), or a branch on an intermediate value (:class:`IntermediateBranch`).

    Examples
    --------
    >>> from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    >>> exc = GuardOnDataDependentSymNode(None, "Could not guard on data-dependent "
    ...     'expression\n\nThe following call raised this error:\n  File "/x/m.py", '
    ...     "line 7, in forward\n    if y.max() > 3:\n")
    >>> data_dependent_branch(exc)
    'm.py:7 (`if y.max() > 3:`)'

    torch 2.13 may name the place as ``Caused by: (file:line in fn)`` instead (HF UDOP's
    labels assert): the line is then read from the loaded module's file.

    >>> exc = GuardOnDataDependentSymNode(None, "Could not guard on data-dependent "
    ...     "expression Eq(u0, 1)\nCaused by: (optmem/pytorch/nowhere.py:3 in f)\n")
    >>> data_dependent_branch(exc)
    'nowhere.py:3 (in f)'
    """
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(exc, IntermediateBranch):
        return exc.where
    if not isinstance(exc, GuardOnDataDependentSymNode):
        return None
    found = _RAISED_AT.search(str(exc))
    if found is not None:
        path, line, code = found.groups()
        return _site(path, line, code)
    caused = _CAUSED_BY.search(str(exc))
    if caused is None:
        return None
    path, line, function = caused.groups()
    code = linecache.getline(_module_file(path), int(line)).strip()
    return _site(path, line, code) if code else f"{os.path.basename(path)}:{line} (in {function})"


def _site(path: str, line: int | str, code: str) -> str:
    """``file:line (`code`)``: a line of the model's code, as the messages name it."""
    return f"{os.path.basename(path)}:{line} (`{code.strip()}`)"


#: torch 2.13's other form of the guard's place: ``Caused by: (pkg/mod.py:814 in fn)``.
_CAUSED_BY = re.compile(r"Caused by: \(([^\s()]+\.py):(\d+) in (\S+)\)")


def _module_file(path: str) -> str:
    """The file ``path`` names: absolute as given, else the loaded module's file ending so.

    torch prints a path relative to its package root (``transformers/models/udop/...``).
    """
    if os.path.isabs(path):
        return path
    tail = os.sep + os.path.normpath(path)
    files = (getattr(m, "__file__", None) for m in list(sys.modules.values()))
    return next((f for f in files if isinstance(f, str) and f.endswith(tail)), path)


def _chain_inputs(names: Sequence[str], flat: Sequence[Any]) -> set[str]:
    """Placeholders a gradient must reach: floating tensors that require grad."""
    return {n for n, v in zip(names, flat, strict=True)
            if isinstance(v, torch.Tensor) and v.requires_grad}


def _program(gm: fx.GraphModule, model: nn.Module, flat: list[Any], *, method: str,
             in_spec: Any, out_spec: Any, signature: inspect.Signature | None,
             observers: ObserverPlan | None = None) -> Extraction:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = tuple(p.name for p in placeholders)
    kinds = classify(gm, _chain_inputs(names, flat))
    mid = next((n for n in gm.graph.nodes if kinds.get(n) == CHAIN and is_value_assert(n)), None)
    if mid is not None:
        raise IntermediateBranch(branch_location(mid) or "a line of its forward",
                                 owner=_module_path(mid), drawn=drawn_at_random(mid))
    cut = _cut(gm, kinds, model)
    tensor_positions = tuple(k for k, v in enumerate(flat) if isinstance(v, torch.Tensor))
    if not tensor_positions:
        hidden = _hidden_tensor_types(flat)
        why = (f" (torch sees no tensor inside a {', '.join(hidden)}: register it as a pytree "
               f"before wrapping, torch.export.register_dataclass({hidden[0]}), or pass its "
               "tensors as arguments)") if hidden else ""
        raise OptmemInputError(f"{type(model).__name__} was called without any tensor{why}",
                               field="sample")
    positions = {names[k]: j for j, k in enumerate(tensor_positions)}
    taps = observers.taps if observers else frozenset()
    tapped: set[str] = set()
    stages = _graph_stages(gm, model, cut,
                           _inputs_of_first_stage(placeholders, positions,
                                                  len(tensor_positions)),
                           detailed=method == "export", taps=taps, tapped=tapped)
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    needed = [a for st in cut.stages for n in st for a in n.all_input_nodes]
    returned = _flat_graph_nodes(output_node.args[0])
    needed += returned
    needed += [n for n in gm.graph.nodes if n.name in taps]  # side values a hook receives
    side = build_side_program(gm, model, cut.kinds, needed, returned)
    layout = output_layout(output_node, cut.outputs, cut.kinds, spec=out_spec)
    ext = Extraction(_unique_names(stages), side, layout, method, in_spec, signature,
                     names, tensor_positions)
    if observers is not None:
        grad_path = {n.name for n in gm.graph.nodes if cut.kinds.get(n) == CHAIN} | \
            _chain_inputs(names, flat)
        ext.observers = observers.keep({*tapped, *names, *side.output_names}, grad_path)
    carried = dict.fromkeys(v for held in cut.carried for v in held)
    ext.carried = tuple(_module_path(v) or v.name for v in carried)
    return ext


def _flat_graph_nodes(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


@contextmanager
def _idle_moves() -> Iterator[None]:
    """Within: ``module.to(...)`` that changes nothing returns the module, as in eager mode.

    Some forwards move a submodule to the dtype it already has (HF SwitchTransformers'
    router: ``self.classifier = self.classifier.to(self.dtype)``). In eager mode that is a
    no-op; under ``torch.export`` the parameters are fake tensors and ``Module._apply``
    fails to swap them ("Couldn't swap Linear.weight"). A call that would convert some
    tensor still goes to ``nn.Module.to``.
    """
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None and all(_stays(t, device, dtype) for t in
                                         (*self.parameters(), *self.buffers())):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


#: What torch.export's ``dynamic_shapes`` (``Dim.AUTO``) writes onto the tensors it is given
_DIMENSION_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices",
                    "_dynamo_dynamic_range", "_dynamo_static_indices",
                    "_dynamo_unbacked_indices", "_has_dynamo_dim_marking")


@contextmanager
def dimension_marks_kept(value: Any) -> Iterator[None]:
    """Within: an export may mark the dimensions of ``value``'s tensors; after, as before.

    ``torch.export`` with ``dynamic_shapes`` marks the dynamic dimensions on the caller's
    tensors themselves (``torch._dynamo.maybe_mark_dynamic``'s attributes) and leaves the
    marks there, failed or not (torch 2.13). Every later export of those tensors then
    took those dimensions as dynamic: a call of a new size whose dynamic export failed
    (Wav2Vec2's CTC loss, a data-dependent size) was exported on its own, but with the
    marks, and failed too, where the model runs (stop 82); a ``torch.compile`` of the
    caller's own would also meet them. The marks each tensor had before are put back.
    """
    tensors = value_tensors(value)
    before = [{a: t.__dict__[a] for a in _DIMENSION_MARKS if a in t.__dict__} for t in tensors]
    try:
        yield
    finally:
        for t, had in zip(tensors, before, strict=True):
            for attr in _DIMENSION_MARKS:
                t.__dict__.pop(attr, None)
            t.__dict__.update(had)


def _stays(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether ``Module.to(device, dtype)`` leaves ``t`` as it is (only floats change dtype)."""
    if device is not None and (device.type != t.device.type or (
            device.index is not None and device.index != t.device.index)):
        return False
    return dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype


@contextmanager
def _quiet_export() -> Iterator[None]:
    """Within: a failed export does not dump its partial graph on stderr.

    On a data-dependent branch ``torch.export`` prints the whole graph traced so far to
    ``sys.stderr`` (``partial_fx_graph``: thousands of lines on a real model) and its
    symbolic-shapes logger warns, before raising; optmem reports the failure in one line
    (:func:`data_dependent_branch`). Everything else written to stderr meanwhile
    (warnings) is written out as it was, after the call.
    """
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    captured = io.StringIO()
    graph = None
    try:
        with redirect_stderr(captured):
            yield
    except Exception as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        raise
    finally:
        logger.setLevel(level)
        text = captured.getvalue()
        if graph is not None:
            text = text.replace(f"{graph}\n", "")
        if text:
            sys.stderr.write(text)


def _export_program(module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any], dynamic_shapes: Any = None, *,
                    observe: bool = False) -> Extraction:
    name = type(module).__name__
    seeded = SeededDraws()
    met: list[HookCall] = []
    global_met: list[GlobalHook] = []
    ep = _export(module, args, kwargs, dynamic_shapes, seeded, met if observe else None,
                 global_met)
    gm = ep.module()
    constants = _constant_arguments(gm, ep.module_call_graph) if met else {}
    forget_real_tensors(gm)
    cumulative_batch_norms(gm, module)
    overflow_guards(gm)
    explain_value_asserts(gm, name)
    restore_functions(gm)
    elide_constant_masks(gm, module)
    flat = list(fx_pytree.tree_flatten_spec((args, kwargs), ep.call_spec.in_spec))
    masks_as_in_training(gm, flat)
    graph_names = {n.name for n in gm.graph.nodes}
    observers = observer_plan(module, met, ep.module_call_graph, graph_names.__contains__,
                              constants, global_met)
    ext = _program(gm, module, flat, method="export", in_spec=ep.call_spec.in_spec,
                   out_spec=ep.call_spec.out_spec, signature=None, observers=observers)
    ext.value_branches = tuple(value_branches(gm))
    ext.seeded = seeded
    if ext.value_branches:
        _log.info("optmem: %s branches on tensor values at %s: exported with the sample's "
                  "side of each, asserted at every call", name, "; ".join(ext.value_branches))
    if dynamic_shapes is not None:
        ext.accepts = _size_guard(gm)
    return ext


def _constant_arguments(gm: fx.GraphModule, call_graph: Sequence[Any]
                        ) -> dict[str, torch.Tensor]:
    """The module call arguments and outputs computed from no input, by node name.

    A constant attention mask (GPT-2's causal mask) is elided from the graph; a forward
    hook of a block receives it all the same (its value, evaluated once here).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    named = {a.name for e in call_graph if e.signature is not None
             for a in (*e.signature.inputs, *e.signature.outputs) if hasattr(a, "name")}
    found = {name: constant_value(nodes[name]) for name in named
             if name in nodes and nodes[name].op == "call_function"}
    return {name: value for name, value in found.items() if value is not None}


def forget_real_tensors(gm: fx.GraphModule) -> None:
    """Drop the weak references the export's fake modes keep to the model's tensors.

    Each node's ``meta["val"]`` holds a fake tensor, whose fake mode keeps, as long as
    the graph lives, a table from every real tensor it converted (the model's parameters
    and buffers) to an id, through a weak reference to each (torch 2.13:
    ``MetaTensorDescriber.lookup_tensor``). ``torch.utils.swap_tensors`` refuses a tensor
    that has a weak reference, so with ``torch.__future__.
    set_swap_module_params_on_conversion(True)`` a wrapped model's ``.to()``,
    ``.double()`` (and ``load_state_dict``) failed with "_apply(): Couldn't swap
    Embedding.weight", where the plain model converts (stop 83). The tables only serve
    the conversions of a trace, which is over.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.weak import WeakIdKeyDictionary
    >>> lin = torch.nn.Linear(2, 2)
    >>> gm = torch.export.export(lin, (torch.randn(1, 2),)).module()
    >>> forget_real_tensors(gm)
    >>> import weakref
    >>> weakref.getweakrefcount(lin.weight)
    0
    """
    modes = {id(m): m for node in gm.graph.nodes
             if (m := getattr(node.meta.get("val"), "fake_mode", None)) is not None}
    for mode in modes.values():
        converter = getattr(mode, "fake_tensor_converter", None)
        describer = getattr(getattr(converter, "meta_converter", None), "describer", None)
        for table in ("lookup_tensor", "lookup_storage"):
            memo = getattr(describer, table, None)
            if memo is not None:
                memo.clear()


_REAL_VALUES_NOTE = "optmem: exported again with the sample's values: "


def _real_values_failure(exc: BaseException) -> str:
    """Why the export with the sample's values failed too (a note :func:`_export` adds)."""
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith(_REAL_VALUES_NOTE)]
    return notes[0][len(_REAL_VALUES_NOTE):] if notes else ""


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            dynamic_shapes: Any, seeded: SeededDraws | None = None,
            met: list[HookCall] | None = None, global_met: list[GlobalHook] | None = None
            ) -> torch.export.ExportedProgram:
    """``torch.export.export`` (non-strict); again with real values on a value branch.

    ``seeded`` receives the host generators the module seeds itself (:class:`SeededDraws`),
    ``met`` the calls of the user's forward hooks of inner modules, whose modules' call
    signatures the export keeps (:func:`~optmem.pytorch.observers.hooks_recorded`; if the
    export cannot keep them, it runs again without, and ``met`` stays empty), ``global_met``
    the user's global module forward hooks the wrapper's setup suspended, called on the
    module's own modules (:func:`~optmem.pytorch.observers.global_hooks_traced`).

    A forward that branches on a tensor's value stops the first export; the second takes
    the sample's side of each such branch and asserts it at run time
    (:mod:`optmem.pytorch.branches`), except a ``torch.distributions`` argument check
    (:func:`validated_distribution`): with the sample's values it may pass and leave an
    assertion mid-chain, refused then as a branch on an intermediate value, whose message
    does not name the distribution. The first failure is raised if the second fails too,
    unless the second found what optmem refuses past the branch (NumPy draws, tensor
    hooks, a custom Function it cannot keep): that error says more.
    """
    name = type(module).__name__
    args, kwargs = unaliased((args, kwargs))

    preserved = hooked_modules(module) if met is not None else ()
    recording: Callable[[], AbstractContextManager[list[HookCall]]] = (
        (lambda: hooks_recorded(module)) if met is not None else (lambda: nullcontext([])))

    def run(preserve: tuple[str, ...]) -> torch.export.ExportedProgram:
        with refuse_python_random(name, module, seeded), refuse_tensor_hooks(name), \
                opaque_functions(name), _idle_moves(), _quiet_export(), \
                dimension_marks_kept((args, kwargs)), recording() as calls, \
                global_hooks_traced(module, [] if global_met is None else global_met):
            ep = torch.export.export(module, args, kwargs=kwargs, strict=False,
                                     dynamic_shapes=dynamic_shapes,
                                     preserve_module_call_signature=preserve)
        if met is not None:
            met[:] = calls if preserve else []
        return ep

    try:
        return _exported_keeping_calls(run, preserved, name)
    except Exception as exc:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        if not isinstance(exc, GuardOnDataDependentSymNode) or validated_distribution(exc):
            raise  # a distribution's value check: refused as such, whatever the values
        ep = _exported_with_constants(module, run, preserved, name)
        if ep is not None:
            return ep
        try:
            with real_values():
                ep = _exported_keeping_calls(run, preserved, name)
        except OptmemInputError:  # found past the branch (numpy draws, hooks): clearer
            raise
        except Exception as again:  # noqa: BLE001 - the first failure says what the model does
            exc.add_note(f"{_REAL_VALUES_NOTE}{_first_line(again).split(' tensor([')[0]}")
            # still a data-dependent guard with the sample's values: a size (nonzero, a
            # boolean mask, tolist) that no value of the call fixes
            exc.data_dependent_size = _size_failure(again)  # type: ignore[attr-defined]
            # where that size is, past the branches the sample's values resolved (HF
            # OneFormer: its encoder's overflow guard first, then a boolean index in its
            # decoder); the first failure's line named the guard (stop 87)
            exc.size_at = (  # type: ignore[attr-defined]
                data_dependent_branch(again) or failed_line(again, module),
                failed_in(again, module))
            raise exc from None
        return ep


def _exported_with_constants(module: nn.Module,
                             run: Callable[[tuple[str, ...]], torch.export.ExportedProgram],
                             preserved: tuple[str, ...], name: str
                             ) -> torch.export.ExportedProgram | None:
    """The export with the module's constant integer buffers read as their values.

    ``None`` when the module has none (:func:`~optmem.pytorch.constants.candidate_buffers`),
    the caller does not follow them (:func:`~optmem.pytorch.constants.tracked`: only the
    planned wrappers do), or this export fails too, or the forward writes one or computes
    a tensor of more than one element from one: the caller goes on with the first failure.
    On success the
    buffers are recorded as held by the graph (the wrapper extracts again when one
    changes; stop 86, EnCodec's padding).
    """
    candidates = candidate_buffers(module) if enabled() else []
    if not candidates:
        return None
    try:
        with buffers_as_constants(candidates) as made:
            ep = _exported_keeping_calls(run, preserved, name)
    except OptmemInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the first failure says what the model does
        _log.info("optmem: %s not exported with its integer buffers as constants either: %s",
                  name, _first_line(exc))
        return None
    if written(made) or read_as_values(ep, candidates, module):
        _log.info("optmem: %s writes or computes with its integer buffers: not exported "
                  "with them as constants", name)
        return None
    record(candidates)
    _log.info("optmem: %s exported with its %d non-persistent integer buffers as constants "
              "(extracted again if one changes)", name, len(candidates))
    return ep


def _exported_keeping_calls(run: Callable[[tuple[str, ...]], torch.export.ExportedProgram],
                            preserved: tuple[str, ...], name: str
                            ) -> torch.export.ExportedProgram:
    """``run()``; if it fails keeping the call signatures of ``preserved``, again without."""
    try:
        return run(preserved)
    except OptmemInputError:
        raise
    except Exception as exc:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        if not preserved or isinstance(exc, GuardOnDataDependentSymNode):
            raise  # a value branch: the caller exports again with the sample's values
        _log.info("optmem: %s not exported keeping the calls of its hooked modules (%s): "
                  "their forward hooks are not called at every step", name, _first_line(exc))
        return run(())


def unaliased(value: Any) -> Any:
    """``value`` with each tensor met a second time replaced by a copy (what is exported).

    ``torch.export`` gives a tensor one fake tensor, however many arguments pass it: from
    the sample ``{"input_ids": ids, "labels": ids}`` (the docs' five-minute start),
    the graph read both arguments from one placeholder. A later call with other labels
    (``-100`` at the padding, an MLM's targets) then ran the embedding on the labels: an
    ``IndexError``, or with valid tokens wrong outputs and gradients in silence (tiny
    Mistral: loss 0.68 and gradients 0.33 from the model's). Exported on a copy, each
    argument has its own placeholder; calls passing one tensor twice still run it. Same
    values, strides and ``requires_grad``.
    """
    seen: set[int] = set()

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in seen:
            seen.add(id(t))
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    return tree_map_only(torch.Tensor, fresh, value)


def _size_failure(exc: BaseException) -> bool:
    """Whether the export with the sample's values failed on a data-dependent size.

    A guard on a size still unknown (``GuardOnDataDependentSymNode``), an op whose output
    size is such a symbol (``PendingUnbackedSymbolNotFound``: HF NLLB-MoE), or real-tensor
    propagation finding another size than the fake one (``MetadataMismatchError``: "size
    mismatch between fake shape ... and real shape").
    """
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, GuardOnDataDependentSymNode) or (
        type(exc).__name__ == "PendingUnbackedSymbolNotFound") or (
        type(exc).__name__ == "MetadataMismatchError"
        and "size mismatch between fake shape" in str(exc))


def export_dynamic(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   dims: Sequence[tuple[int, int]]) -> Extraction | None:
    """Export ``module(*args, **kwargs)`` with some input sizes left symbolic.

    ``dims`` lists ``(leaf, dim)``: dimension ``dim`` of the ``leaf``-th value of
    ``tree_flatten((args, dict(sorted(kwargs.items()))))``, each given to
    ``torch.export`` as ``Dim.AUTO`` (export infers the relations between them, e.g. equal
    sequence lengths of ``input_ids`` and ``labels``, and their ranges). The stages then run
    any call whose sizes meet the graph's constraints (:attr:`Extraction.accepts`), without
    exporting again. Returns ``None`` when export fails or specialises every such size
    (the model then stays exported per call signature, as before).
    """
    try:
        named = _named_keywords(module, kwargs)
        ext = _export_program(named, args, kwargs, _dynamic_shapes(named, args, kwargs, dims),
                              observe=True)
    except Exception as exc:  # noqa: BLE001 - the static route stays, one log line says why
        _log.info("optmem: %s not exported with dynamic sizes (%s): exported per size",
                  type(module).__name__, _first_line(exc))
        return None
    return ext if ext.accepts is not None else None


def _named_keywords(module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
    """``module``, or a shallow copy whose forward names the keywords ``**kwargs`` takes.

    torch 2.13's export lists a keyword that goes to ``**kwargs`` twice when it matches
    ``dynamic_shapes`` to the inputs (``use_cache`` of a BERT call: "Must provide a
    tree_name"). The copy shares the model's parameters, buffers and submodules (same
    names in the graph); only its forward's signature names every keyword given.
    """
    signature = inspect.signature(module.forward)
    params = list(signature.parameters.values())
    if not any(p.kind is p.VAR_KEYWORD for p in params) or \
            all(k in signature.parameters for k in kwargs):
        return module
    named = [p for p in params if p.kind is not p.VAR_KEYWORD]
    named += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in kwargs
              if k not in signature.parameters]
    forward = module.forward

    def call(*args: Any, **kw: Any) -> Any:
        return forward(*args, **kw)

    call.__signature__ = signature.replace(parameters=named)  # type: ignore[attr-defined]
    shim = copy.copy(module)
    shim.forward = call  # type: ignore[method-assign]
    return shim


def _dynamic_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    dims: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """``torch.export``'s ``dynamic_shapes``, keyed by the forward's parameter names.

    ``module`` as :func:`_named_keywords` gives it: every keyword of the call named.
    """
    leaves, spec = tree_flatten((args, dict(sorted(kwargs.items()))))
    wanted: dict[int, dict[int, Any]] = {}
    for leaf, dim in dims:
        wanted.setdefault(leaf, {})[dim] = torch.export.Dim.AUTO
    per_leaf = [wanted.get(k) if isinstance(v, torch.Tensor) else None
                for k, v in enumerate(leaves)]
    s_args, s_kwargs = spec.unflatten(per_leaf)
    return dict(inspect.signature(module.forward).bind(*s_args, **s_kwargs).arguments)


def _size_guard(gm: fx.GraphModule) -> _SizeGuard | None:
    """The check of :class:`_SizeGuard` on ``gm``.

    ``None`` when no input size of ``gm`` is symbolic (export specialised them all).
    """
    symbolic = any(isinstance(d, torch.SymInt)
                   for n in gm.graph.find_nodes(op="placeholder")
                   if isinstance(n.meta.get("val"), torch.Tensor)
                   for d in n.meta["val"].shape)
    return _SizeGuard(gm) if symbolic else None


class _SizeGuard:
    """Whether a call meets the size constraints ``torch.export`` recorded on ``gm``.

    The check is the one ``ExportedProgram.module()`` runs before each call: ranges of the
    symbolic sizes, equal sizes where export found them equal, the static sizes. Any
    violation (or a graph that lost its constraints, e.g. through pickling) is ``False``:
    the call is then extracted on its own.
    """

    def __init__(self, gm: fx.GraphModule | None) -> None:
        self.gm = gm

    def __deepcopy__(self, memo: dict[int, Any]) -> _SizeGuard:
        return _SizeGuard(self.gm)  # the check only reads the graph's placeholders

    def __getstate__(self) -> dict[str, Any]:
        return {"gm": None}  # export's graph module does not pickle: sizes go one by one

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        from torch.export._unlift import _check_input_constraints_for_module

        if self.gm is None:
            return False
        try:
            _check_input_constraints_for_module(self.gm, args, kwargs)
        except Exception:  # noqa: BLE001 - any violation means: not this graph
            return False
        return True


def _fx_program(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Extraction:
    from torch.fx.passes.shape_prop import ShapeProp

    before = torch.random.get_rng_state()
    seeded = SeededDraws()
    gm = _symbolic_trace(module, seeded)
    if not torch.equal(before, torch.random.get_rng_state()):
        torch.random.set_rng_state(before)
        raise RuntimeError(
            "torch's RNG drew while tracing: a random op on no traced value (LayerDrop's "
            "torch.rand([])) runs once at trace time, and the graph would keep its value")
    signature = inspect.signature(module.forward)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    flat = [bound.arguments[n] for n in names]
    # the propagation runs the model (its dropout draws): the caller's generators are kept,
    # the CUDA ones too (fork_rng forks the CPU's and the ``devices`` given only)
    devices = cuda_indices([*module.parameters(), *module.buffers(),
                            *(v for v in flat if isinstance(v, torch.Tensor))])
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        ShapeProp(gm).propagate(*flat)
    masks_as_in_training(gm, flat)
    ext = _program(gm, module, flat, method="fx", in_spec=None, out_spec=None,
                   signature=signature)
    ext.seeded = seeded
    return ext


# ------------------------------------------------------------------ public API
def extract_stages(
    module: nn.Module | Sequence[nn.Module | Stage],
    *,
    max_stages: int | None = None,
    costs: Sequence[float] | None = None,
    allow_single: bool = False,
) -> list[Stage]:
    """Cut ``module`` into a chain of stages.

    Parameters
    ----------
    module
        An ``nn.Sequential`` (flattened), any ``torch.fx``-traceable module (cut at
        single-value cut points), or an explicit list of stage modules.
    max_stages
        If given, merge consecutive stages into at most this many, balanced by ``costs``
        (default: :func:`stage_cost`, a parameter-and-op count estimate).
    costs
        Cost of each extracted stage (e.g. measured times) used for balancing.
    allow_single
        Accept a chain of one stage (nothing to checkpoint); otherwise that is an error.

    Returns
    -------
    list of Stage
        Modules sharing their parameters with ``module`` (no copies).

    Raises
    ------
    OptmemInputError
        Naming the module when it cannot be traced or has no cut point.
    """
    if isinstance(module, Sequence) and not isinstance(module, nn.Module):
        stages = [m if isinstance(m, Stage) else Stage(f"stage{k + 1}", m)
                  for k, m in enumerate(module)]
    elif is_plain_sequential(module):
        stages = _merge_inplace_heads(_flatten_sequential(module, ""))  # type: ignore[arg-type]
    elif isinstance(module, nn.Module):
        stages = _fx_stages(module)
    else:
        raise OptmemInputError(
            f"expected an nn.Module or a list of modules, got {type(module).__name__}",
            field="module")
    if not stages:
        raise OptmemInputError(f"{type(module).__name__} has no stages (empty Sequential?)",
                               field="module")
    if len(stages) == 1 and not allow_single:
        raise OptmemInputError(_single_stage_message(module), field="module")  # type: ignore[arg-type]
    if max_stages is not None and len(stages) > max_stages:
        stages = merge_stages(stages, max_stages, costs)
    return _unique_names(stages)


def _unique_names(stages: list[Stage]) -> list[Stage]:
    counts: dict[str, int] = {}
    for s in stages:
        counts[s.name] = counts.get(s.name, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for s in stages:
        if counts[s.name] > 1:
            seen[s.name] = seen.get(s.name, 0) + 1
            s = Stage(f"{s.name}#{seen[s.name]}", s.module)
        out.append(s)
    return out


def stage_cost(module: nn.Module) -> float:
    """Rough cost of a stage without profiling: parameter count plus one per submodule."""
    return float(sum(p.numel() for p in module.parameters()) + sum(1 for _ in module.modules()))


def partition_costs(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` into at most ``parts`` contiguous groups minimising the largest sum.

    Exact linear-partition DP, ``O(parts * n^2)``; returns ``[(first, last), ...]`` 0-based.

    Examples
    --------
    >>> partition_costs([1, 1, 1, 3], 2)
    [(0, 2), (3, 3)]
    """
    n = len(costs)
    if parts < 1:
        raise OptmemInputError(f"expected at least one stage, got {parts}", field="max_stages")
    parts = min(parts, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: smallest max-group cost splitting the first j items into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    arg = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], arg[k][j] = v, i
    bounds = []
    j = n
    for k in range(parts, 0, -1):
        i = arg[k][j]
        bounds.append((i, j - 1))
        j = i
    return bounds[::-1]


def merge_stages(stages: Sequence[Stage], max_stages: int,
                 costs: Sequence[float] | None = None, *,
                 groups: Sequence[tuple[int, int]] | None = None) -> list[Stage]:
    """Group consecutive stages into at most ``max_stages`` stages of balanced cost.

    ``groups`` (``[(first, last), ...]``, 0-based) gives the grouping instead.
    """
    if groups is None:
        if costs is None:
            costs = [stage_cost(s.module) for s in stages]
        if len(costs) != len(stages):
            raise OptmemInputError(f"expected {len(stages)} costs, got {len(costs)}",
                                   field="costs")
        groups = partition_costs(costs, max_stages)
    out = []
    for first, last in groups:
        if first == last:
            out.append(stages[first])
            continue
        group = stages[first:last + 1]
        out.append(Stage(f"{_first_name(group[0].name)}..{group[-1].name.split('..')[-1]}",
                         StageGroup([s.module for s in group])))
    return out


def run_stages(stages: Sequence[Stage], x: Any,
               callback: Callable[[int, Any], None] | None = None) -> Any:
    """Run the stages one after the other (reference forward)."""
    for k, st in enumerate(stages):
        x = st.module(x)
        if callback is not None:
            callback(k, x)
    return x


def value_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a value (a tensor or a pytree of tuples, lists and dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
