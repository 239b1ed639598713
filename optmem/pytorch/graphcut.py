"""Cut a data-flow graph (``torch.export`` or ``torch.fx``) into a chain of stages.

Every node of the graph gets one of four roles:

* **state**: parameters, buffers, constants and submodules (``get_attr``), shared with the
  model and available to every stage;
* **side**: everything that depends neither on a parameter nor on an input that needs a
  gradient, nor is random: the model's other inputs and what is computed from them alone
  (position ids, attention masks, rotary ``cos``/``sin`` tables). The side program computes
  them once per call; stages read them from the call's
  :class:`~optmem.pytorch.context.SideInputs`;
* **chain**: the rest (everything a gradient flows through, and random ops, kept in their
  order so that dropout masks are those of the unmodified model);
* **drop**: export guards and metadata assertions (``_guards_fn``,
  ``aten._assert_tensor_metadata``), which would pin dtypes (autocast) and shapes that the
  wrapper already checks.

A stage boundary is a chain node ``d`` that every path from the input to the output goes
through: a **dominator** of the output in the chain's data-flow graph (networkx
``immediate_dominators``). Such a ``d`` is the only value that crosses the boundary: a
chain node not dominated by ``d`` that still reaches the output is an ancestor of ``d``,
and no edge goes from an ancestor to a node dominated by ``d``. Chain nodes that read only
state and side inputs (an embedding lookup, a random mask) are pinned after the chain node
that precedes them in the graph's order, so they run where the unmodified model runs them.
A boundary is skipped when a later node writes ``d`` in place (it would overwrite a
checkpoint), when ``d`` is not a tensor, and when nothing follows it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import networkx as nx  # type: ignore[import-untyped]
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from optmem.pytorch.branches import is_value_assert, target_name
from optmem.pytorch.context import SideInputs, current_side_inputs
from optmem.pytorch.custom_functions import is_opaque_call
from optmem.pytorch.hooks import module_generators, same_generator
from optmem.pytorch.observers import observe

__all__ = ["CHAIN", "DROP", "SIDE", "STATE", "Cut", "GraphStage", "SideProgram", "classify",
           "cut_graph", "drawn_at_random", "long_lived", "vmap_regions"]

STATE, SIDE, CHAIN, DROP = "state", "side", "chain", "drop"
_SOURCE, _SINK = "__optmem_source__", "__optmem_sink__"

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.iand, operator.ior, operator.ixor, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.ilshift, operator.irshift}
_RANDOM_NAMES = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                 "feature_alpha_dropout", "rand", "randn", "randint", "rand_like",
                 "randn_like", "randint_like", "bernoulli", "multinomial", "normal",
                 "randperm", "rrelu", "poisson", "bernoulli_", "uniform_", "normal_",
                 "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
#: The random ops that draw a value a model may branch on (a dropout's mask is not one).
_DRAW_NAMES = {n for n in _RANDOM_NAMES if "dropout" not in n and n != "rrelu"}
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
                 "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten",
                 "narrow", "select", "unfold", "as_strided", "contiguous", "to", "type_as",
                 "float", "half", "double", "bfloat16", "detach", "chunk", "split",
                 "__getitem__", "unbind", "movedim", "swapaxes", "diagonal"}


# ------------------------------------------------------------------ node properties
def _module(root: nn.Module, node: fx.Node) -> nn.Module:
    return root.get_submodule(str(node.target))


def attribute_of(root: nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` node's ``target`` names (``"layers.0.weight"``)."""
    owner, _, name = target.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name)


def _is_random(node: fx.Node, root: nn.Module) -> bool:
    target = node.target
    if is_opaque_call(node):
        return True  # a custom autograd Function: what it draws is not seen (kept in the chain)
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if node.op == "call_module":
        mod = _module(root, node)
        return isinstance(mod, nn.modules.dropout._DropoutNd | nn.RReLU)
    return target_name(node) in _RANDOM_NAMES


def drawn_at_random(node: fx.Node) -> bool:
    """Whether ``node``'s value derives from a random draw (``torch.rand``, not a dropout).

    HF OmniASR's LayerDrop draws ``torch.rand([])`` for every encoder layer in training and
    branches on it, whatever ``layerdrop`` is (0 too): no config turns that branch off.
    """
    seen, todo = {node}, [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in seen:
                continue
            if arg.op == "call_function" and target_name(arg) in _DRAW_NAMES:
                return True
            seen.add(arg)
            todo.append(arg)
    return False


def _is_dropped(node: fx.Node) -> bool:
    if node.op == "call_module" and str(node.target) == "_guards_fn":
        return True
    if node.op != "call_function":
        return False
    name = target_name(node)
    if name.startswith("_assert"):
        return not is_value_assert(node)  # a size assertion (checked before the call)
    return name.startswith("sym_constrain_range")


def written_args(node: fx.Node, root: nn.Module) -> list[fx.Node]:
    """The nodes whose tensors ``node`` writes in place."""
    target = node.target
    positions: list[int] = []
    if isinstance(target, torch._ops.OpOverload):
        for k, arg in enumerate(target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                positions.append(k)
        out: list[fx.Node] = []
        for k in positions:
            arg = target._schema.arguments[k]
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            out.extend(v for v in _flat_nodes(value))
        return out
    if node.op == "call_module":
        inplace = bool(getattr(_module(root, node), "inplace", False))
    elif node.op == "call_method":
        name = str(target)
        inplace = name.endswith("_") and not name.endswith("__")
    elif node.op == "call_function":
        name = target_name(node)
        inplace = (target in _INPLACE_OPERATORS or bool(node.kwargs.get("inplace", False))
                   or (name.endswith("_") and not name.endswith("__")))
    else:
        inplace = False
    if inplace and node.args and isinstance(node.args[0], fx.Node):
        return [node.args[0]]
    return []


def _flat_nodes(value: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(value, out.append)
    return out


_VMAP_OPEN, _VMAP_CLOSE = "_vmap_increment_nesting", "_vmap_decrement_nesting"
_VMAP_LOAD = "lazy_load_decompositions"


def vmap_regions(order: Sequence[fx.Node]) -> dict[fx.Node, tuple[int, int]]:
    """The outermost ``torch.vmap`` region of every node inside one: ``(open, close)``.

    Export traces ``torch.vmap`` (HF's mask functions, Gemma 3's image mask) into calls
    that open and close a vmap level around the batched ops; the calls have no users, so
    only their order ties them to the region. A region must run whole, in one program:
    positions from ``lazy_load_decompositions`` before the first open to the last close.
    """
    regions: dict[fx.Node, tuple[int, int]] = {}
    depth, start = 0, -1
    members: list[fx.Node] = []
    for k, node in enumerate(order):
        name = target_name(node) if node.op == "call_function" else ""
        if name == _VMAP_OPEN:
            if depth == 0:
                start = k - 1 if k and target_name(order[k - 1]) == _VMAP_LOAD else k
                members = list(order[start:k])
            depth += 1
        if depth:
            members.append(node)
        if name == _VMAP_CLOSE and depth:
            depth -= 1
            if depth == 0:
                regions.update((m, (start, k)) for m in members)
    return regions


def _is_vmap_bracket(node: fx.Node) -> bool:
    return node.op == "call_function" and target_name(node) in (_VMAP_OPEN, _VMAP_CLOSE,
                                                                    _VMAP_LOAD)


_DROPOUTS = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")


def _returns_its_input(node: fx.Node) -> bool:
    """Whether ``node`` is a dropout that returns its input tensor itself.

    ``aten.dropout(x, p, train)`` returns ``x`` (the same tensor, not a copy) when ``p`` is
    0 or ``train`` is false, though its schema declares no alias. HF wav2vec2 with the
    default ``feat_proj_dropout=0.0`` then writes SpecAugment's mask into the projection's
    output through it (``hidden_states[mask_time_indices] = ...``).
    """
    if target_name(node) not in _DROPOUTS or len(node.args) < 3:
        return False
    p, train = node.args[1], node.args[2]
    return bool(p == 0) or train is False


def _alias_root(node: fx.Node, through_dropouts: bool = False) -> fx.Node:
    """Follow views back to the node that owns the storage (best effort).

    ``through_dropouts`` also follows a dropout that returns its input
    (:func:`_returns_its_input`): for in-place writes, whose target is then that input.
    Boundaries are not merged across such a dropout (a stage of it alone stays a stage).
    """
    seen = 0
    while seen < 10_000:
        seen += 1
        target = node.target
        arg0 = node.args[0] if node.args else None
        if not isinstance(arg0, fx.Node):
            return node
        if isinstance(target, torch._ops.OpOverload):
            returns = target._schema.returns
            if returns and returns[0].alias_info is not None and \
                    not returns[0].alias_info.is_write \
                    or through_dropouts and _returns_its_input(node):
                node = arg0
                continue
            return node
        if node.op == "call_method" and str(target) in _VIEW_METHODS:
            node = arg0
            continue
        if node.op == "call_function" and (target is operator.getitem
                                           or target_name(node) in _VIEW_METHODS):
            node = arg0
            continue
        return node
    return node


def _tensor_meta(node: fx.Node) -> Any:
    """The example value of a node: a tensor-like, another value, or ``...`` (unknown)."""
    if "val" in node.meta:
        return node.meta["val"]
    if "tensor_meta" in node.meta:
        return node.meta["tensor_meta"]
    return ...


def _is_tensor_value(node: fx.Node) -> bool:
    meta = _tensor_meta(node)
    if meta is ...:
        return True  # no metadata (torch.fx without a sample): as before, trust the graph
    return isinstance(meta, torch.Tensor) or type(meta).__name__ == "TensorMetadata"


# ------------------------------------------------------------------ roles
def classify(gm: fx.GraphModule, chain_inputs: set[str] | None, *,
             side: bool = True) -> dict[fx.Node, str]:
    """Give every node its role: ``state``, ``side``, ``chain`` or ``drop``.

    Parameters
    ----------
    gm
        The graph and its root (targets of ``get_attr`` and ``call_module``).
    chain_inputs
        Names of the placeholders a gradient must reach (floating inputs that require
        grad); ``None``: every placeholder.
    side
        Allow side nodes; otherwise everything that is not state is in the chain.
    """
    forced: set[fx.Node] = set()
    while True:
        kinds = _classify_once(gm, chain_inputs, side, forced)
        written = _side_written_by_chain(gm, kinds)
        if not written:
            break
        forced |= written
    _bracket_kinds(gm, kinds)
    return kinds


def _classify_once(gm: fx.GraphModule, chain_inputs: set[str] | None, side: bool,
                   forced: set[fx.Node]) -> dict[fx.Node, str]:
    """:func:`classify`'s pass over the nodes, with the ``forced`` nodes in the chain."""
    kinds: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "get_attr":
            kinds[node] = STATE
            continue
        if _is_dropped(node):
            kinds[node] = DROP
            continue
        if node.op == "placeholder":
            chain = chain_inputs is None or node.target in chain_inputs or not side
            kinds[node] = CHAIN if chain else SIDE
            continue
        kinds[node] = CHAIN if (not side or node in forced or _needs_chain(node, gm, kinds)) \
            else SIDE
    return kinds


def _side_written_by_chain(gm: fx.GraphModule, kinds: dict[fx.Node, str]) -> set[fx.Node]:
    """Side values a chain node writes in place (through views): they belong to the chain.

    A scratch tensor the forward allocates and then fills with computed values (HF xLSTM:
    ``matC_states = torch.zeros(...)``, then ``matC_states[..., k] = matC_k``) depends on
    no input, so it would be a side input, computed once per call under ``no_grad``: the
    stage's write into its view then fails ("A view was created in no_grad mode and is
    being modified inplace"), and a re-run would write into the shared tensor again. Such
    a tensor is allocated by the stage instead. Inputs and state are left as they are.
    """
    out: set[fx.Node] = set()
    for node, kind in kinds.items():
        if kind != CHAIN or node.op in ("placeholder", "get_attr"):
            continue
        for w in written_args(node, gm):
            root = _alias_root(w, through_dropouts=True)
            if kinds.get(root) == SIDE and root.op not in ("placeholder", "get_attr"):
                out.add(root)
    return out


def _bracket_kinds(gm: fx.GraphModule, kinds: dict[fx.Node, str]) -> None:
    """Give a vmap region's open and close calls the kind of the region's ops.

    They run where the ops run: with the chain if one of them is in the chain, else with
    the side inputs (:func:`vmap_regions`).
    """
    regions = vmap_regions(list(gm.graph.nodes))
    chained = {span for node, span in regions.items() if kinds.get(node) == CHAIN}
    for node, span in regions.items():
        if _is_vmap_bracket(node):
            kinds[node] = CHAIN if span in chained else SIDE


def _needs_chain(node: fx.Node, gm: fx.GraphModule, kinds: dict[fx.Node, str]) -> bool:
    for arg in node.all_input_nodes:
        kind = kinds.get(arg)
        if kind == CHAIN:
            return True
        if kind == STATE and isinstance(attribute_of(gm, str(arg.target)), nn.Parameter):
            return True
    if node.op == "call_module":
        mod = _module(gm, node)
        if any(True for _ in mod.parameters()):
            return True
    return _is_random(node, gm)


# ------------------------------------------------------------------ cuts
@dataclass
class Cut:
    """The chain part of a graph cut into stages.

    Attributes
    ----------
    stages
        The chain nodes of every stage, in graph order.
    boundaries
        ``boundaries[k]`` is the node whose value goes from stage ``k`` to stage ``k + 1``.
    outputs
        The chain nodes the model returns (computed by the last stage, or carried to it).
    kinds
        The role of every node.
    carried
        ``carried[k]``: the long-lived values that cross boundary ``k`` beside
        ``boundaries[k]`` (:func:`long_lived`); the value between stages ``k`` and ``k + 1``
        is then the tuple ``(boundaries[k], *carried[k])``. Empty lists for a plain chain.
    """

    stages: list[list[fx.Node]]
    boundaries: list[fx.Node]
    outputs: list[fx.Node]
    kinds: dict[fx.Node, str]
    carried: list[list[fx.Node]]


def _dataflow(order: list[fx.Node], kinds: dict[fx.Node, str],
              outputs: Iterable[fx.Node], carried: set[fx.Node]) -> nx.DiGraph:
    """The chain's data-flow graph with a source before the inputs and a sink after outputs.

    Edges out of ``carried`` values are left out: they reach their readers beside the
    boundaries (:func:`long_lived`), so they do not keep a cut from dominating.
    """
    graph = nx.DiGraph()
    graph.add_node(_SOURCE)
    previous: Any = _SOURCE
    for node in order:
        if kinds.get(node) != CHAIN:
            continue
        graph.add_node(node)
        preds = [a for a in node.all_input_nodes if kinds.get(a) == CHAIN and a not in carried]
        if node.op == "placeholder":
            graph.add_edge(_SOURCE, node)
        elif preds:
            graph.add_edges_from((p, node) for p in preds)
        else:
            # reads only state and side inputs: pinned where the model computes it
            graph.add_edge(previous, node)
        previous = node
    graph.add_node(_SINK)
    graph.add_edges_from((o, _SINK) for o in outputs if o not in carried)
    return graph


def _dominators_of_sink(graph: nx.DiGraph) -> list[fx.Node]:
    """Chain nodes that dominate the sink, from the input side to the output side."""
    if _SINK not in nx.descendants(graph, _SOURCE):
        return []
    idom = nx.immediate_dominators(graph, _SOURCE)
    out = []
    node = idom[_SINK]
    while node != _SOURCE:
        out.append(node)
        node = idom[node]
    return out[::-1]


def cut_graph(gm: fx.GraphModule, kinds: dict[fx.Node, str]) -> Cut:
    """Find the boundaries of ``gm`` and the chain nodes of every stage.

    Single-value boundaries first (the dominators of the output). When the graph has
    long-lived values (:func:`long_lived`: an encoder's output that every decoder layer
    reads, a position bias shared by all layers, an early value the model also returns),
    the cut that carries them beside the boundaries is taken instead if it has more
    stages.
    """
    order = list(gm.graph.nodes)
    output_node = order[-1]
    outputs = list(dict.fromkeys(n for n in _flat_nodes(output_node.args[0])
                                 if kinds.get(n) == CHAIN))
    if not outputs:
        raise ValueError("the model's output does not depend on any parameter or input "
                         "that needs a gradient")
    cut = _cut_carrying(gm, order, kinds, outputs, set())
    carried = long_lived(order, kinds, outputs)
    if carried:
        wide = _cut_carrying(gm, order, kinds, outputs, carried)
        if len(wide.stages) > len(cut.stages):
            cut = wide
    streams = side_streams(order, kinds) - carried
    if streams:  # stop 86: XLNet's query stream and its aliases of the position embedding
        wider = _cut_carrying(gm, order, kinds, outputs, carried | streams)
        if len(wider.stages) > len(cut.stages):
            cut = wider
    return cut


def _cut_carrying(gm: fx.GraphModule, order: list[fx.Node], kinds: dict[fx.Node, str],
                  outputs: list[fx.Node], carried: set[fx.Node]) -> Cut:
    """The cut of ``gm`` whose boundaries carry ``carried`` beside their own value."""
    position = {n: k for k, n in enumerate(order)}
    graph = _dataflow(order, kinds, outputs, carried)
    useful = nx.ancestors(graph, _SINK)
    held = {_alias_root(v) for v in carried}
    inside = vmap_regions(order)  # a cut would split a region between two stages
    candidates = [d for d in _dominators_of_sink(graph) if d.op != "placeholder"
                  and _is_tensor_value(d) and _alias_root(d) not in held and d not in inside]
    last_useful = max(position[n] for n in useful if n != _SOURCE)
    writes = _writes_after(order, kinds, gm)
    bounds = _drop_aliases([d for d in candidates if position[d] < last_useful
                            and not any(p > position[d] for p in
                                        writes.get(_alias_root(d, through_dropouts=True), ()))])
    bounds = _drop_returned_tail(bounds, outputs)
    stages = _assign(order, kinds, bounds, useful, position)
    draws = [n for n in order if kinds.get(n) == CHAIN and _is_random(n, gm)]  # model order
    while True:
        bad = _unavailable(stages, bounds, kinds, carried) or _reordered_draws(stages, draws)
        if bad is None:
            break
        first, last = bad  # merge stages first..last: drop the boundaries between them
        bounds = bounds[:first] + bounds[last:]
        stages = _assign(order, kinds, bounds, useful, position)
    return Cut(stages, bounds, outputs, kinds, _carried_at(stages, carried, outputs))


def _carried_at(stages: list[list[fx.Node]], carried: set[fx.Node],
                outputs: list[fx.Node]) -> list[list[fx.Node]]:
    """``out[k]``: the carried values made at or before stage ``k`` and read after it."""
    stage_of = {n: s for s, nodes in enumerate(stages) for n in nodes}
    last = len(stages) - 1
    out: list[list[fx.Node]] = [[] for _ in range(last)]
    for v in sorted(carried, key=lambda n: stage_of.get(n, -1)):
        if v not in stage_of:
            continue
        reads = [stage_of[u] for u in v.users if u in stage_of]
        if v in outputs:
            reads.append(last)
        for k in range(stage_of[v], max(reads, default=stage_of[v])):
            out[k].append(v)
    return out


def _layer(node: fx.Node) -> str | None:
    """The numbered layer a node belongs to (``model.decoder.layers.1``), if any."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    parts = str(list(stack.values())[-1][0]).split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return None


def long_lived(order: list[fx.Node], kinds: dict[fx.Node, str],
               outputs: list[fx.Node]) -> set[fx.Node]:
    """Chain values that live across layers, carried beside the boundaries.

    A value is long-lived when two or more numbered layers other than its own read it (an
    encoder's output read by every decoder layer's cross-attention, T5's position bias
    made by the first layer and added by every later one), or when the model returns it
    while another returned value depends on it (LLaVA's ``image_hidden_states``, BART's
    ``encoder_last_hidden_state``, hidden states with ``output_hidden_states=True``).
    With such a value no single tensor crosses between two later layers, and the whole
    decoder is one stage; carried beside the boundaries, it lets every layer be cut.
    Layers are read from export's module stacks (``torch.fx`` graphs have none). A view
    made outside the layers reads for the layers that read it (Gemma 4's per-layer inputs,
    one tensor sliced per layer in the text model's loop: ``per_layer_inputs[:, :, i]``).
    """
    out: set[fx.Node] = set()
    for node in order:
        if kinds.get(node) != CHAIN or node.op == "placeholder" or not _is_tensor_value(node):
            continue
        own = _layer(node)
        if len(_reader_layers(node, own, kinds) - {own, None}) >= 2:
            out.add(node)
    feeds = set().union(*(_ancestors(o, kinds) for o in outputs))  # each output once
    for node in outputs:
        if node in feeds and node.op != "placeholder" and _is_tensor_value(node):
            out |= {node, _made_in_layer(node, kinds)}
    return out


def side_streams(order: list[fx.Node], kinds: dict[fx.Node, str]) -> set[fx.Node]:
    """Chain values that cross from one numbered layer to another beside the main one.

    Two kinds (stop 86, XLNet): a view made in a layer of a value made outside the layers
    (XLNet's ``r.type(dtype)`` returns its position embedding itself, and export binds the
    next layer's read of it to the first layer's node, so no boundary lies between the
    layers); and, where two or more values made in other layers enter a layer (XLNet's
    two-stream attention: the content stream ``h`` and the query stream ``g``), all but the
    largest. Carried beside the boundaries, they let the largest be the boundary.
    """
    entering: dict[str, list[fx.Node]] = {}
    out: set[fx.Node] = set()
    for node in order:
        if kinds.get(node) != CHAIN or node.op == "placeholder" or not _is_tensor_value(node):
            continue
        own = _layer(node)
        readers = _reader_layers(node, own, kinds) - {own, None} if own is not None else set()
        if not readers:
            continue
        root = _alias_root(node)
        if root is not node and _layer(root) is None and kinds.get(root) == CHAIN:
            out.add(node)
            continue
        for layer in readers:
            if layer is not None:
                entering.setdefault(layer, []).append(node)
    for values in entering.values():
        if len(values) > 1:
            largest = max(values, key=_numel)
            out |= {v for v in values if v is not largest}
    return out


def _numel(node: fx.Node) -> int:
    meta = _tensor_meta(node)
    return meta.numel() if isinstance(meta, torch.Tensor) else 0


def _made_in_layer(node: fx.Node, kinds: dict[fx.Node, str]) -> fx.Node:
    """The value a layer made, when ``node`` is an alias of it made outside the layers.

    HF's MoE models return each layer's router logits through the load-balancing loss's
    ``layer_gate.to(device)``, a no-op alias made after the last layer: export binds the
    returned tensor to that late node. Carrying it would leave the layer's own node read
    from the last stage, and no later layer boundary would dominate the output (Mixtral's
    chain was 3 stages with ``output_router_logits=True``). The layer's value is carried
    too (the alias is the same storage, counted once).
    """
    current = node
    while _layer(current) is None:
        parent = _alias_parent(current)
        if parent is None or kinds.get(parent) != CHAIN or parent.op == "placeholder":
            return node
        current = parent
    return current


def _alias_parent(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node`` views, one step back (None if not a view)."""
    root = _alias_root(node)
    if root is node:
        return None
    arg0 = node.args[0]
    return arg0 if isinstance(arg0, fx.Node) else None


def _reader_layers(node: fx.Node, own: str | None, kinds: dict[fx.Node, str]) -> set[str | None]:
    """The layers whose chain ops read ``node``, directly or through views.

    Views of it made in ``own``'s scope (``x[:, :, i]`` before calling layer ``i``) are
    followed to who reads them. Empty when the one chain op reading ``node`` is such a
    view (``linear(...).reshape``): the view is the value to carry, not its base.
    """
    users = [u for u in node.users if kinds.get(u) == CHAIN]
    if len(users) == 1 and _view_outside(users[0], node, own):
        return set()
    layers: set[str | None] = set()
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if kinds.get(u) != CHAIN or u in seen:
                continue
            seen.add(u)
            if _view_outside(u, n, own):
                stack.append(u)  # who reads the view
            else:
                layers.add(_layer(u))
    return layers


def _view_outside(u: fx.Node, n: fx.Node, own: str | None) -> bool:
    """Whether ``u`` is a view of ``n`` made in ``own``'s scope (outside the layers)."""
    return (_layer(u) in (own, None) and bool(u.args) and u.args[0] is n
            and _alias_root(u) is _alias_root(n))


def _ancestors(node: fx.Node, kinds: dict[fx.Node, str]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen and kinds.get(a) == CHAIN:
                seen.add(a)
                stack.append(a)
    return seen


def _drop_returned_tail(bounds: list[fx.Node], outputs: list[fx.Node]) -> list[fx.Node]:
    """Drop the last boundaries that the model also returns (the logits beside the loss).

    A cut at a returned value makes a last stage that passes it through: the chain model
    then keeps it as ``a^{L-1}`` until ``B L`` although the loss's backward does not need
    it (cross-entropy saves its log-softmax), and the caller drops it once it has the loss.
    Without the cut the value is a returned output of the last stage, alive until ``Loss``.
    """
    returned = {_alias_root(n) for n in outputs}
    while bounds and _alias_root(bounds[-1]) in returned:
        bounds = bounds[:-1]
    return bounds


def _drop_aliases(bounds: list[fx.Node]) -> list[fx.Node]:
    """Keep one boundary per storage.

    A view or no-op cast of the previous boundary (an ``alias``, ``x.float()`` of a float,
    a ``reshape``) would make an empty stage whose output the profile counts twice.
    """
    out: list[fx.Node] = []
    for d in bounds:
        root = _alias_root(d)
        if out and _alias_root(out[-1]) is root:
            continue
        elif root.op == "placeholder" and not out:
            continue  # a view of the input: no stage before it
        else:
            out.append(d)
    return out


def _writes_after(order: list[fx.Node], kinds: dict[fx.Node, str],
                  gm: fx.GraphModule) -> dict[fx.Node, list[int]]:
    """Positions at which the storage of each node is written in place."""
    out: dict[fx.Node, list[int]] = {}
    for k, node in enumerate(order):
        if node.op in ("placeholder", "get_attr", "output") or kinds.get(node) == DROP:
            continue
        for w in written_args(node, gm):
            out.setdefault(_alias_root(w, through_dropouts=True), []).append(k)
    return out


def _assign(order: list[fx.Node], kinds: dict[fx.Node, str], bounds: list[fx.Node],
            useful: set[Any], position: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """Chain nodes per stage: by position between boundaries, dead ends with their inputs."""
    cut_at = [position[b] for b in bounds]
    stage_of: dict[fx.Node, int] = {}
    stages: list[list[fx.Node]] = [[] for _ in range(len(bounds) + 1)]
    k = 0
    for node in order:
        if kinds.get(node) != CHAIN or node.op == "placeholder":
            continue
        if node in useful:
            while k < len(cut_at) and position[node] > cut_at[k]:
                k += 1
            s = k
        else:  # a dead end (its value is never used): with its latest chain input
            inputs = [stage_of[a] for a in node.all_input_nodes if a in stage_of]
            if not inputs:  # none (a vmap level's open or close): where it stands
                while k < len(cut_at) and position[node] > cut_at[k]:
                    k += 1
            s = max(inputs, default=k)
        stage_of[node] = s
        stages[s].append(node)
    return stages


def _unavailable(stages: list[list[fx.Node]], bounds: list[fx.Node],
                 kinds: dict[fx.Node, str], carried: set[fx.Node]) -> tuple[int, int] | None:
    """A pair of stages to merge because a chain value would skip a boundary, or None."""
    stage_of = {n: s for s, nodes in enumerate(stages) for n in nodes}
    for s, nodes in enumerate(stages):
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg in carried:
                    continue  # crosses the boundaries beside them
                if kinds.get(arg) != CHAIN or arg.op == "placeholder":
                    if arg.op == "placeholder" and kinds.get(arg) == CHAIN and s > 0:
                        return 0, s
                    continue
                t = stage_of[arg]
                if t < s and not (t == s - 1 and bounds[s - 1] is arg):
                    return t, s
    return None


def _reordered_draws(stages: list[list[fx.Node]],
                     draws: list[fx.Node]) -> tuple[int, int] | None:
    """A pair of stages to merge because their random ops would draw out of order, or None.

    ``draws``: the chain's random ops, in the model's order. A dead end goes with its
    latest chain input (:func:`_assign`): a dropout whose value is never used (Pegasus-X's
    last encoder layer drops its global-token branch) then runs in an earlier stage than a
    random op before it in the model, and takes the random numbers meant for that one.
    Merging the stages from the dead end's to the other's keeps every draw in the model's
    order.
    """
    stage_of = {n: s for s, nodes in enumerate(stages) for n in nodes}
    latest = -1
    for s in (stage_of[n] for n in draws if n in stage_of):
        if s < latest:
            return s, latest
        latest = max(latest, s)
    return None


# ------------------------------------------------------------------ stage modules
def _holds_a_proxy(value: Any) -> bool:
    found: list[fx.Proxy] = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, fx.Proxy) else a)
    return bool(found)


class ReloadTracer(fx.Tracer):
    """The tracer that rebuilds a stage's graph when a pickled stage is loaded.

    ``torch.load`` of a ``GraphModule`` traces its generated code again, and
    ``torch.fx.Tracer`` runs every call none of whose arguments is traced: an op of the
    exported graph whose arguments are all constants (``aten.randn.default([4, 16])`` of a
    ``torch.randn(x.shape)``, a draw from a generator the model holds, an in-place update
    of a buffer in the side program) ran once while loading, and its result became a
    constant of the graph. A loaded wrapper (``torch.save(cmodel)``) then added the same
    noise at every step. A higher-order op (a ``no_grad`` or autocast region) was traced
    into, its region lost. Here each such op is a node again, as in the graph that was
    saved; a generator or submodule it reads is the attribute that holds it. The calls
    handing values to observing hooks (:func:`~optmem.pytorch.observers.observe`, which
    returns nothing) stay nodes too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("autowrap_functions", (observe,))
        super().__init__(*args, **kwargs)

    def trace(self, root: nn.Module | Callable[..., Any],
              concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """Trace ``root`` with every ATen op a node, whatever its arguments."""
        tracer = self

        class _OpsAsNodes(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if isinstance(func, torch._ops.OpOverload) and not _holds_a_proxy((args, kwargs)):
                    return tracer.create_proxy("call_function", func, tuple(args), kwargs)
                return func(*args, **kwargs)

        def hop_as_node(op: Any, *args: Any, **kwargs: Any) -> Any:
            return tracer.create_proxy("call_function", op, args, kwargs)

        # higher-order ops run their body when called (``wrap_with_autocast`` enters
        # autocast and calls the submodule): each class defining ``__call__`` is patched
        classes, stack = [], [torch._ops.HigherOrderOperator]
        while stack:
            cls = stack.pop()
            stack.extend(cls.__subclasses__())
            if "__call__" in vars(cls):
                classes.append((cls, vars(cls)["__call__"]))
        for cls, _ in classes:
            cls.__call__ = hop_as_node  # type: ignore[method-assign]
        try:
            with _OpsAsNodes():
                return super().trace(root, concrete_args)
        finally:
            for cls, call in classes:
                cls.__call__ = call  # type: ignore[method-assign]

    def create_arg(self, a: Any) -> Any:
        """A ``torch.Generator`` or a submodule of the traced module is read as its attribute.

        A submodule is an argument of a higher-order op (``wrap_with_set_grad_enabled``,
        ``wrap_with_autocast``: a ``no_grad`` or autocast region of the forward).
        """
        if isinstance(a, torch.Generator):
            for name, value in vars(self.root).items():
                if value is a:
                    return self.create_node("get_attr", name, (), {})
        if isinstance(a, nn.Module):
            return self.create_node("get_attr", self.path_of_module(a), (), {})
        return super().create_arg(a)


class GraphStage(nn.Module):
    """A piece of a graph as a module ``value -> value``; side inputs from the context.

    ``gm`` takes the stage input, then the side inputs named in ``side_names`` (read from
    :func:`~optmem.pytorch.context.current_side_inputs` at each call). Parameters and
    buffers are the model's own objects (re-bound by :meth:`rebind` if the model replaces
    them).

    ``unview_outputs`` (set on the stages FSDP2 shards) returns output views as aliases
    that are not views (:func:`unviewed`): FSDP2 hands a unit its inputs as views, so a
    value carried beside the boundaries comes out as one, and FSDP2 warns about every
    view a unit returns.
    """

    def __init__(self, gm: fx.GraphModule, side_names: Sequence[str],
                 bindings: Sequence[tuple[nn.Module, str, nn.Module, str]]) -> None:
        super().__init__()
        gm._tracer_cls = gm.graph._tracer_cls = ReloadTracer  # torch.save / torch.load
        self.gm = gm
        self.side_names = tuple(side_names)
        self._bindings = list(bindings)
        self.unview_outputs = False

    def forward(self, x: Any) -> Any:  # noqa: D102 - see the class docstring
        if not self.side_names:
            out = self.gm(x)
        else:
            ctx = current_side_inputs()
            out = self.gm(x, *[ctx[n] for n in self.side_names])
        return unviewed(out) if getattr(self, "unview_outputs", False) else out

    def rebind(self) -> None:
        """Point the stage at the model's current parameters and buffers."""
        _rebind(self._bindings)

    def compiled_call(self, compile_part: Callable[[nn.Module], Any],
                      options: dict[str, Any]) -> Callable[[Any], Any]:
        """The stage, its graph module compiled (side inputs read eagerly)."""
        gm = torch.compile(self.gm, **options)
        names = self.side_names

        def run(x: Any) -> Any:
            if permuted_grad_input(x):
                return self.forward(x)  # what a compiled backward cannot take
            if not names:
                return gm(x)
            ctx = current_side_inputs()
            return gm(x, *[ctx[n] for n in names])

        return run


_LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}
"""The memory formats besides the contiguous one that a compiled stage takes as they are."""


def permuted_grad_input(x: Any) -> bool:
    """Whether ``x`` holds a tensor that requires grad laid out as a permuted one.

    torch 2.13's AOT autograd traces a backward that can ``view`` a gradient laid out as
    such an input: ``torch.compile(lambda x: x + dropout(linear(x)))`` on ``x =
    t.permute(0, 2, 1)`` fails in its backward ("view size is not compatible with input
    tensor's size and stride") whatever the gradient's layout. Inside a model compiled
    whole the value never enters a graph; at a stage boundary it does (Whisper's encoder,
    whose hidden states are its convolutions' output transposed: stop 81). A compiled
    stage runs such a call as it is, uncompiled (a contiguous copy would draw other
    dropout masks: ``bernoulli_`` fills in memory order). Contiguous and channels-last
    tensors, and tensors that do not require grad, go to the compiled graph.

    Examples
    --------
    >>> t = torch.zeros(2, 3, 4, requires_grad=True)
    >>> permuted_grad_input(t), permuted_grad_input((t.permute(0, 2, 1),))
    (False, True)
    >>> permuted_grad_input(t.detach().permute(0, 2, 1))
    False
    """
    for t in tree_flatten(x)[0]:
        if not isinstance(t, torch.Tensor) or not t.requires_grad or t.is_contiguous():
            continue
        layout = _LAYOUTS.get(t.dim())
        if layout is None or not t.is_contiguous(memory_format=layout):
            return True
    return False


class _Alias(torch.autograd.Function):
    """Identity whose output shares the input's storage without being a view of it."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # noqa: D102 - identity
        ctx.set_materialize_grads(False)  # no gradient in, none out (not zeros: stop 75)
        return t.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:  # noqa: D102
        return grad


def unviewed(value: Any) -> Any:
    """``value`` with each tensor that is a view replaced by an alias that is not one.

    Same storage, same gradient (an identity in autograd), nothing copied.

    >>> base = torch.zeros(4, requires_grad=True)
    >>> out = unviewed((base.view(2, 2), 1))
    >>> out[0]._base is None, out[0].data_ptr() == base.data_ptr(), out[1]
    (True, True, 1)
    """
    leaves, spec = tree_flatten(value)
    return tree_unflatten([_Alias.apply(t) if isinstance(t, torch.Tensor)
                           and t._base is not None else t for t in leaves], spec)


def _rebind(bindings: Sequence[tuple[nn.Module, str, nn.Module, str]]) -> None:
    """Bind each stage attribute to the model's current tensor, in the model's kind of slot.

    A parameter slot stays one whatever it holds: ``torch.func.functional_call`` puts plain
    tensors (fast weights, requiring grad) into the model's ``_parameters``. Bound as a
    buffer, such a tensor was no parameter of its stage: its gradient was lost in silence
    (or refused, "uses 1 tensor(s) that require grad but are not its parameters").
    """
    for mine, name, owner, owner_name in bindings:
        current = getattr(owner, owner_name)
        if (mine._parameters.get(name) if name in mine._parameters
                else mine._buffers.get(name)) is current:
            continue
        if owner_name in owner._parameters or isinstance(current, nn.Parameter):
            mine._buffers.pop(name, None)
            mine._parameters[name] = current
        else:
            mine._parameters.pop(name, None)
            mine._buffers[name] = current


def _bindings(gm: fx.GraphModule, model: nn.Module | None
              ) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Pairs (attribute of ``gm``, attribute of ``model``) for parameters and buffers."""
    if model is None:
        return []
    names = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr" or str(node.target) not in names:
            continue
        path, _, attr = str(node.target).rpartition(".")
        try:
            mine = gm.get_submodule(path) if path else gm
            owner = model.get_submodule(path) if path else model
        except AttributeError:  # pragma: no cover - target not in the module tree
            continue
        out.append((mine, attr, owner, attr))
    return out


@dataclass
class _StageGraph:
    graph: fx.Graph
    side_names: list[str] = field(default_factory=list)
    tapped: frozenset[str] = frozenset()


def build_stage_graph(nodes: list[fx.Node], kinds: dict[fx.Node, str],
                      inputs: dict[fx.Node, Callable[[fx.Graph, fx.Node], fx.Node]],
                      returns: Any, taps: Collection[str] = ()) -> _StageGraph:
    """Copy ``nodes`` into a new graph ``(x, *side) -> returns``.

    ``inputs`` maps the nodes read from the stage input to a function building their value
    from the ``x`` placeholder; state nodes are copied, side nodes become placeholders.
    A node named in ``taps`` that the stage computes or reads is followed by a call
    ``observe(name, value)`` (:func:`~optmem.pytorch.observers.observe`: the value goes to
    the hooks observing a step); ``tapped`` names them.
    """
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {}
    side_nodes: list[fx.Node] = []
    for node, make in inputs.items():
        env[node] = make(graph, x)

    def lookup(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        kind = kinds.get(n)
        if kind == STATE:
            with graph.inserting_after(_last_state_or(graph, x)):
                env[n] = graph.node_copy(n, lookup)
            return env[n]
        if kind == SIDE or n.op == "placeholder":
            with graph.inserting_after(side_nodes and env[side_nodes[-1]] or x):
                env[n] = graph.placeholder(f"side_{n.name}")
            side_nodes.append(n)
            return env[n]
        raise RuntimeError(f"internal error: node {n.name} is not available in this stage")

    for node in nodes:
        if node in env:
            continue
        env[node] = graph.node_copy(node, lookup)
    graph.output(fx.node.map_arg(returns, lookup))
    tapped = _add_taps(graph, {n.name: copy for n, copy in env.items() if n.name in taps})
    return _StageGraph(graph, [n.name for n in side_nodes], tapped)


def _add_taps(graph: fx.Graph, copies: dict[str, fx.Node]) -> frozenset[str]:
    """After each value of ``copies`` (a placeholder: after the last one), observe it."""
    last = _last_state_or(graph, next(iter(graph.nodes)))
    for name, copy in copies.items():
        where = last if copy.op == "placeholder" else copy
        with graph.inserting_after(where):
            graph.call_function(observe, (name, copy))
    return frozenset(copies)


def _last_state_or(graph: fx.Graph, default: fx.Node) -> fx.Node:
    last = default
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            last = n
        else:
            break
    return last


def make_stage(root: nn.Module, model: nn.Module | None, built: _StageGraph,
               class_name: str = "OptmemStage") -> GraphStage:
    """A :class:`GraphStage` of a built graph; state shared with ``root`` / ``model``."""
    built.graph.lint()
    gm = fx.GraphModule(root, built.graph, class_name=class_name)
    if model is not None:
        _share_generators(gm, model)
    return GraphStage(gm, built.side_names, _bindings(gm, model))


def _share_generators(gm: fx.GraphModule, model: nn.Module) -> None:
    """Hold the model's own ``torch.Generator`` objects where ``gm`` holds another on them.

    Export lifts a generator the forward draws from (``generator=self.gen``) as a constant,
    a second Python object on the same state. A copy of the wrapper (``copy.deepcopy``,
    ``torch.save``) would make it a generator of its own, apart from the copied model's:
    the copy's stages drew from a stream that the model's generator (reseeded by the user,
    or drawn from by a call under ``no_grad``, which runs the model) never saw. Holding
    the model's object itself, a copy copies one generator.
    """
    own = module_generators(model)
    if not own:
        return
    for sub in gm.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Generator) and all(value is not g for g in own):
                match = next((g for g in own if same_generator(g, value)), None)
                if match is not None:
                    setattr(sub, name, match)


# ------------------------------------------------------------------ side program
class SideProgram(nn.Module):
    """Computes the side inputs of a call from the flat user inputs (run under no_grad)."""

    def __init__(self, gm: fx.GraphModule | None, input_names: Sequence[str],
                 output_names: Sequence[str],
                 bindings: Sequence[tuple[nn.Module, str, nn.Module, str]]) -> None:
        super().__init__()
        if gm is not None:
            gm._tracer_cls = gm.graph._tracer_cls = ReloadTracer  # torch.save / torch.load
        self.gm = gm
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self._bindings = list(bindings)
        self._written: list[str] | None = None  # get_attr targets written (see below)

    def forward(self, flat: Sequence[Any]) -> SideInputs:  # noqa: D102
        values = dict(zip(self.input_names, flat, strict=True))
        if self.gm is not None and (self.output_names or len(self.gm.graph.nodes)):
            with torch.no_grad(), self._writes_undone_on_error():
                out = self.gm(*flat)
            values.update(zip(self.output_names, out, strict=True))
        return SideInputs(values)

    @contextmanager
    def _writes_undone_on_error(self) -> Iterator[None]:
        """Within: a failing program leaves the buffers it writes in place as they were.

        A program that asserts a value branch (:mod:`optmem.pytorch.branches`) may first
        write a buffer (BatchNorm's ``num_batches_tracked.add_(1)`` before its branch on
        the counter): a call rejected for taking another side must not have counted, or
        the plan tried next counts it again. Only programs holding both are guarded.
        """
        written = self._guarded_writes()
        if not written:
            yield
            return
        saved = [(t, t.detach().clone()) for t in written]
        try:
            yield
        except BaseException:
            for t, old in saved:
                t.data.copy_(old)  # through .data, as buffers_restored: no new version
            raise

    def _guarded_writes(self) -> list[torch.Tensor]:
        """The model tensors this program writes in place, if it also asserts values."""
        if self._written is None:
            gm = self.gm
            assert gm is not None
            nodes = list(gm.graph.nodes)
            targets: list[str] = []
            if any(is_value_assert(n) for n in nodes):
                targets = list(dict.fromkeys(
                    str(w.target) for n in nodes if n.op == "call_function"
                    for w in written_args(n, gm) if w.op == "get_attr"))
            self._written = targets
        assert self.gm is not None
        return [attribute_of(self.gm, t) for t in self._written]

    def rebind(self) -> None:
        """Point the program at the model's current parameters and buffers."""
        _rebind(self._bindings)


def build_side_program(gm: fx.GraphModule, model: nn.Module | None,
                       kinds: dict[fx.Node, str], needed: Iterable[fx.Node],
                       returned: Iterable[fx.Node] = ()) -> SideProgram:
    """The side nodes that stages or the output read, plus side nodes that write state.

    Value assertions that read side values only (a check on the labels) run here too,
    before any stage (:mod:`optmem.pytorch.branches`). A parameter or buffer in
    ``returned`` (the nodes the model output holds) is an output of the program too: the
    model returns that tensor itself (a learned temperature, a codebook), and the stages
    read their own copies of the state they use.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    wanted = {n for n in needed if kinds.get(n) == SIDE and n.op != "placeholder"}
    wanted |= {n for n in returned if kinds.get(n) == STATE}
    effects = [n for n in gm.graph.nodes if kinds.get(n) == SIDE
               and (written_args(n, gm) or is_value_assert(n))]
    keep: set[fx.Node] = set()
    stack = list(wanted) + effects
    while stack:
        n = stack.pop()
        if n in keep or n.op == "placeholder":
            continue
        keep.add(n)
        stack.extend(a for a in n.all_input_nodes if kinds.get(a) in (SIDE, STATE))
    regions = vmap_regions(list(gm.graph.nodes))
    spans = {regions[n] for n in keep if n in regions}
    keep |= {n for n, span in regions.items() if span in spans and _is_vmap_bracket(n)}
    names = [n.name for n in placeholders]
    if not keep:
        return SideProgram(None, names, [], [])
    graph = fx.Graph()
    env = {p: graph.placeholder(p.name) for p in placeholders}
    for n in gm.graph.nodes:
        if n in keep:
            env[n] = graph.node_copy(n, lambda a: env[a])
    ordered = [n for n in gm.graph.nodes if n in wanted]
    graph.output(tuple(env[n] for n in ordered))
    graph.lint()
    side_gm = fx.GraphModule(gm, graph, class_name="OptmemSideInputs")
    return SideProgram(side_gm, names, [n.name for n in ordered], _bindings(side_gm, model))


# ------------------------------------------------------------------ outputs
@dataclass(frozen=True)
class OutputLayout:
    """How the model output is assembled from the chain output and the side inputs.

    ``leaves[k]`` is ``("chain", j)`` (element ``j`` of the chain output), ``("side", name)``
    or ``("const", value)``; ``spec`` unflattens them.
    """

    leaves: tuple[tuple[str, Any], ...]
    spec: Any
    chain_tuple: bool

    def assemble(self, chain_out: Any, ctx: SideInputs | None) -> Any:
        """The model output of one call."""
        chain = chain_out if self.chain_tuple else (chain_out,)
        out = []
        for kind, ref in self.leaves:
            if kind == "chain":
                out.append(chain[ref])
            elif kind == "side":
                assert ctx is not None
                out.append(ctx[ref])
            else:
                out.append(ref)
        return tree_unflatten(out, self.spec)


def output_layout(output_node: fx.Node, outputs: list[fx.Node], kinds: dict[fx.Node, str],
                  spec: Any = None) -> OutputLayout:
    """The layout of ``output_node``'s value; ``spec`` overrides the flat structure."""
    leaves, flat_spec = tree_flatten(output_node.args[0])
    index = {n: k for k, n in enumerate(outputs)}
    refs: list[tuple[str, Any]] = []
    for leaf in leaves:
        if isinstance(leaf, fx.Node):
            refs.append(("chain", index[leaf]) if kinds.get(leaf) == CHAIN
                        else ("side", leaf.name))
        else:
            refs.append(("const", leaf))
    return OutputLayout(tuple(refs), spec if spec is not None else flat_spec,
                        len(outputs) > 1)
