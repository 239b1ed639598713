"""Attention masks that ``torch.export`` materialises where the eager model passes none.

HuggingFace's attention-mask builders (``create_causal_mask``, ``create_bidirectional_mask``)
return ``None`` in eager mode when the batch has no padding, so that
``scaled_dot_product_attention`` runs with ``attn_mask=None`` (and ``is_causal=True`` for a
decoder). While a model is traced (``torch.export``), the data-dependent "no padding" test
cannot run, so the exported graph builds the full ``[batch, 1, seq, seq]`` mask and passes
it to every attention call. Without an ``attention_mask`` argument that mask depends only on
the (specialised) shapes: it is a constant of the exported graph, all ``True`` (encoder) or
lower-triangular (decoder).

:func:`elide_constant_masks` evaluates every such constant mask once and, when it is
trivial, gives the attention call what the eager model gives it: no mask, or
``is_causal=True`` for the causal pattern. The kernels then compute the same values as the
eager model (an all-``True`` mask adds zeros to the scores, a causal mask removes exactly
the entries ``is_causal`` skips); the gradients stay bitwise equal to the plain model's
(``tests/test_hf_wrapper.py``). The mask's memory and the kernel's masked path are saved.

A mask computed from a parameter (a relative-position bias: Wav2Vec2-BERT, SeamlessM4T)
requires grad in training, and SDPA picks its kernel from that: on CPU a mask that
requires grad takes the math kernel, one that does not the flash kernel, which rounds
otherwise. A plan's ``F_ck``/``F_none`` run under ``no_grad``, where no mask requires
grad: a checkpointed stage's first forward then differed from its re-run and from the
plain model in the last bits (1.3e-4 in Wav2Vec2-BERT's summed gradients).
:func:`masks_as_in_training` gives every SDPA call whose mask requires grad in training,
when it runs without grad, an alias of its mask that requires grad
(:func:`as_in_training`: the same storage, no copy, no graph recorded), so the call takes
the training kernel whatever the grad mode.

Grouped-query attention follows the mask. HF's ``sdpa_attention_forward`` repeats the key
and value heads (``repeat_kv``: unsqueeze, expand, reshape: a copy) only when it passes a
mask; without one it calls ``scaled_dot_product_attention(..., enable_gqa=True)`` on the
unrepeated heads (``use_gqa_in_sdpa``: no mask and head dims at most 256). So where the
mask is elided, the repeated key and value are replaced by the originals and
``enable_gqa=True`` is set (:func:`_unrepeated`), as in the eager model: its kernel, its
values to the bit under bfloat16 autocast (the repeated path differed by bfloat16 rounding
in 13 of a GQA Llama's gradients), and no copy of the repeated heads kept for the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from optmem.pytorch.branches import target_name
from optmem.pytorch.graphcut import attribute_of

__all__ = ["as_in_training", "constant_value", "elide_constant_masks", "masks_as_in_training"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_DETACHES = frozenset({"detach", "detach_"})
#: SDPA as ``torch.export`` records it and as ``torch.fx`` traces it
_SDPA_CALLS = frozenset({_SDPA, torch.nn.functional.scaled_dot_product_attention})


def elide_constant_masks(gm: fx.GraphModule, model: nn.Module | None = None) -> int:
    """Drop trivial constant attention masks from ``gm``'s SDPA calls, in place.

    A mask is *constant* when every node it is computed from is a deterministic
    ``call_function`` (no placeholder, no parameter or buffer, no random op), so it is the
    same at every call of the specialised graph. An all-``True`` boolean or all-zero
    floating mask becomes ``attn_mask=None``; a boolean mask equal to the top-left causal
    pattern of a square ``seq x seq`` score matrix becomes ``is_causal=True``, unless the
    attention module of ``model`` that makes the call says ``is_causal = False``: HF's
    eager call then passes no mask and ``is_causal=False`` (``sdpa_attention_forward``),
    and so does the graph (:func:`_eager_is_causal`). Other masks are kept. Returns the
    number of attention calls changed; nodes left unused are removed.
    """
    changed = 0
    values: dict[fx.Node, torch.Tensor | None] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        named = _named_args(node)
        mask = named.get("attn_mask")
        if not isinstance(mask, fx.Node) or named.get("is_causal", False):
            continue
        if mask not in values:
            values[mask] = constant_value(mask)
        kind = _trivial_kind(values[mask], node)
        if kind is None:
            continue
        if kind == "causal" and not _eager_is_causal(node, model):
            kind = "none"
        named["attn_mask"] = None
        named["is_causal"] = kind == "causal"
        _use_gqa(named)
        node.args = tuple(named.pop(k) for k in _SDPA_ARGS[:3])
        node.kwargs = {k: v for k, v in named.items()
                       if not (k == "attn_mask" or (k == "is_causal" and v is False))}
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


def _eager_is_causal(node: fx.Node, model: nn.Module | None) -> bool:
    """The ``is_causal`` attribute of the module of ``model`` that makes the SDPA call.

    HF's eager ``sdpa_attention_forward`` passes ``is_causal=True`` only where its mask
    builder returned no mask and the attention module's ``is_causal`` is true. PaliGemma's
    config sets ``use_bidirectional_attention=True`` by default (so its Gemma attention
    says ``is_causal = False``) while the model builds a causal mask: an unpadded batch
    then attends over the whole sequence in eager mode, and a causal mask elided to
    ``is_causal=True`` gave HF ColPali embeddings 0.085 off the plain model's (stop 87).
    ``True`` when the module is unknown (no ``model``, no module stack), says nothing, or
    is not a ``transformers`` module (another module's explicit mask is what it passes).
    """
    stack = node.meta.get("nn_module_stack")
    if model is None or not stack:
        return True
    path = list(stack.values())[-1][0]
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return True
    return (not type(owner).__module__.startswith("transformers.")
            or getattr(owner, "is_causal", True) is not False)


def _use_gqa(named: dict[str, Any]) -> None:
    """Unrepeated key and value with ``enable_gqa=True``, where HF's eager call has them.

    HF's ``use_gqa_in_sdpa`` (CPU and CUDA): no mask (elided here) and
    ``key.shape[-1] == value.shape[-1] <= 256``; both repeated by the same factor.
    """
    key, value = _unrepeated(named["key"]), _unrepeated(named["value"])
    if key is None or value is None or key[1] != value[1]:
        return
    k_dim, v_dim = key[0].meta["val"].shape[-1], value[0].meta["val"].shape[-1]
    if k_dim != v_dim or k_dim > 256:
        return
    named["key"], named["value"], named["enable_gqa"] = key[0], value[0], True


def _unrepeated(node: Any) -> tuple[fx.Node, int] | None:
    """``(x, n_rep)`` if ``node`` is HF's ``repeat_kv(x, n_rep)``, else ``None``.

    ``reshape(expand(unsqueeze(x, 2), [b, h, n_rep, s, d]), [b, h * n_rep, s, d])``, as
    torch.export traces ``x[:, :, None, :, :].expand(...).reshape(...)``.
    """
    if not _is_call(node, "reshape", "view", "_unsafe_view"):
        return None
    expand = node.args[0]
    if not _is_call(expand, "expand"):
        return None
    unsqueeze = expand.args[0]
    if not _is_call(unsqueeze, "unsqueeze") or unsqueeze.args[1] != 2:
        return None
    source = unsqueeze.args[0]
    values = [n.meta.get("val") for n in (source, unsqueeze, expand, node)
              if isinstance(n, fx.Node)]
    shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]
    if len(shapes) != 4:
        return None
    x, _, wide, out = shapes
    if len(x) != 4 or len(wide) != 5:
        return None
    b, h, s, d = x
    n_rep = wide[2]
    if wide != (b, h, n_rep, s, d) or out != (b, h * n_rep, s, d):
        return None
    return source, int(n_rep)


def _is_call(node: Any, *names: str) -> bool:
    """Whether ``node`` calls the aten op ``names`` (any overload)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and \
        isinstance(node.target, torch._ops.OpOverload) and target_name(node) in names


def _named_args(node: fx.Node) -> dict[str, Any]:
    """An SDPA call's arguments by name."""
    named = dict(zip(_SDPA_ARGS, node.args, strict=False))
    named.update(node.kwargs)
    return named


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and what it is computed from, in graph order; ``None`` if not constant."""
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function" or _is_random(n):
            return None
        seen[n] = None
        stack.extend(n.all_input_nodes)
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    return True  # an unknown Python function: not evaluated


def constant_value(node: fx.Node) -> torch.Tensor | None:
    """The value of a constant node (evaluated once), or ``None``."""
    nodes = _ancestors(node)
    if nodes is None:
        return None
    env: dict[fx.Node, Any] = {}
    try:
        with torch.no_grad():
            for n in nodes:
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - not evaluable here (another device, say): keep it
        return None
    value = env[node]
    return value if isinstance(value, torch.Tensor) else None


def _trivial_kind(mask: torch.Tensor | None, node: fx.Node) -> str | None:
    """``"none"`` (the mask keeps everything), ``"causal"``, or ``None`` (keep it)."""
    if mask is None or mask.dim() < 2:
        return None
    if mask.dtype == torch.bool:
        if bool(mask.all()):
            return "none"
        rows, cols = mask.shape[-2:]
        query = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        key = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        if query is None or key is None or rows != cols:
            return None
        if query.shape[-2] != rows or key.shape[-2] != cols:
            return None  # a broadcast mask row: is_causal would use other sizes
        causal = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
        return "causal" if bool((mask == causal).all()) else None
    if mask.is_floating_point() and bool((mask == 0).all()):
        return "none"
    return None


def as_in_training(mask: torch.Tensor) -> torch.Tensor:
    """``mask``, or without grad an alias of it that requires grad (a leaf, no copy).

    Inserted before an SDPA call whose mask requires grad in training
    (:func:`masks_as_in_training`): with grad enabled the mask is passed as it is; under
    ``no_grad`` (a plan's ``F_ck``/``F_none``) the alias makes the kernel choice the
    training one, and records nothing (no graph under ``no_grad``).
    """
    if torch.is_grad_enabled() or mask.requires_grad:
        return mask
    return mask.detach().requires_grad_()


def masks_as_in_training(gm: fx.GraphModule, inputs: Sequence[Any]) -> int:
    """Route each SDPA mask that requires grad in training through :func:`as_in_training`.

    Parameters
    ----------
    gm : fx.GraphModule
        An exported graph (``ExportedProgram.module()``) or a ``torch.fx`` trace (after
        ``ShapeProp``): parameters as ``get_attr`` (or inside ``call_module``), the flat
        user inputs as placeholders. Changed in place.
    inputs : sequence
        The flat user inputs of the sample, one per placeholder: whether each requires grad
        is read from them.

    Returns
    -------
    int
        The number of SDPA calls changed.
    """
    carried = _requires_grad_in_training(
        gm, [isinstance(v, torch.Tensor) and v.requires_grad for v in inputs])
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_CALLS:
            continue
        mask = _named_args(node).get("attn_mask")
        if not isinstance(mask, fx.Node) or mask not in carried:
            continue
        with gm.graph.inserting_before(node):
            alias = gm.graph.call_function(as_in_training, (mask,))
        alias.meta.update({k: v for k, v in mask.meta.items()
                           if k in ("val", "tensor_meta", "stack_trace", "nn_module_stack")})
        node.replace_input_with(mask, alias)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _requires_grad_in_training(gm: fx.GraphModule, inputs: list[bool]) -> set[fx.Node]:
    """The nodes whose value requires grad when ``gm`` runs with grad enabled.

    Autograd's rule on the graph: a floating result of an op with an input that requires
    grad (or of a submodule with a parameter that does), unless grad is off there
    (``_set_grad_enabled``, ``wrap_with_set_grad_enabled``) or the op detaches; a
    parameter that requires grad; a user input that does.
    """
    carried: set[fx.Node] = set()
    placeholders = iter(inputs)
    enabled = True
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if next(placeholders, False):
                carried.add(node)
        elif node.op == "get_attr":
            value = attribute_of(gm, str(node.target))
            if isinstance(value, torch.Tensor) and value.requires_grad:
                carried.add(node)
        elif node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif node.op in ("call_function", "call_method", "call_module") \
                and _grad_flows(node, carried, enabled, gm):
            carried.add(node)
    return carried


def _grad_flows(node: fx.Node, carried: set[fx.Node], enabled: bool,
                gm: fx.GraphModule) -> bool:
    """Whether the result of the call ``node`` requires grad in training."""
    name = target_name(node)
    if name == "wrap_with_set_grad_enabled":
        enabled = bool(node.args[0])
    if not enabled or name in _DETACHES or not _floating(node.meta):
        return False
    if any(n in carried for n in node.all_input_nodes):
        return True
    if node.op == "call_module":
        owned = gm.get_submodule(str(node.target)).parameters()
        return any(p.requires_grad for p in owned)
    return False


def _floating(meta: dict[str, Any]) -> bool:
    """Whether a node's recorded result can require grad (a floating or complex tensor).

    Read from ``val`` (``torch.export``) or ``ShapeProp``'s ``tensor_meta``. A node
    without a recorded result counts as floating.
    """
    if "val" in meta:
        return _floating_value(meta["val"])
    info = meta.get("tensor_meta")
    if info is None:
        return True
    infos = [info] if hasattr(info, "dtype") else list(info)  # one TensorMetadata, or many
    return any(getattr(t, "dtype", None) is not None
               and (t.dtype.is_floating_point or t.dtype.is_complex) for t in infos)


def _floating_value(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or value.is_complex()
    if isinstance(value, list | tuple):
        return any(_floating_value(v) for v in value)
    return not isinstance(value, int | bool | torch.SymInt | torch.SymBool)
