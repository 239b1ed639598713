"""Branches on tensor values: exported with the sample's side, checked at every call.

A forward that branches on a tensor's *value* (``if labels.max() >= vocab: raise``,
``assert torch.all(ids >= 0).item()``, Longformer's ``if is_global_attn:``) cannot be held
in one graph: ``torch.export`` stops with a data-dependent guard. Exported again with
real-tensor propagation (``torch._functorch.config.fake_tensor_propagate_real_tensors``, the
mechanism of ``torch.export.draft_export``), each such branch takes the side the sample
takes, and the graph gets a runtime assertion (``aten._assert_scalar``) that the value
still leads there. optmem keeps those assertions in the side-input program (run before
any stage), so a call whose values take the other side raises instead of silently running
the sample's side. Their messages name the model's line (:func:`explain_value_asserts`).
Only branches on the call's *inputs* are accepted (their assertions run before any stage,
so the wrapper can pick or extract a plan for the other side); a branch on an intermediate
value is refused at extraction (:class:`IntermediateBranch`).
Shape assertions of dynamic sizes are not value assertions: optmem checks sizes before
the call (``Extraction.accepts``) and drops them, as before.
One value is not a branch but a number: a BatchNorm with ``momentum=None`` (a cumulative
average) reads its counter ``num_batches_tracked`` as its factor, ``1 / n``, which export
bakes in with an assertion ``n == 1`` that every later step fails.
:func:`cumulative_batch_norms` reads the counter at run time instead, as the module does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import fx, nn

__all__ = ["BRANCH_MARK", "IntermediateBranch", "batch_norm_cumulative",
           "branch_location", "cumulative_batch_norms", "explain_value_asserts",
           "is_value_assert", "is_value_branch_error", "real_values", "target_name",
           "value_branches"]

#: Start of the message of every value assertion optmem keeps (:func:`is_value_branch_error`).
BRANCH_MARK = "optmem: this call's tensor values take the other side of a branch"

_SCALAR_READS = ("item", "_local_scalar_dense")


def target_name(node: fx.Node) -> str:
    """The name of what ``node`` calls.

    An aten op's name without namespace or overload (``_assert_scalar``), else the
    callable's ``__name__``; shared with :mod:`~optmem.pytorch.graphcut`, which imports
    this module.
    """
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema.name.split("::")[-1])
    return str(getattr(target, "__name__", target))


def _is_assert(node: fx.Node) -> bool:
    return node.op == "call_function" and target_name(node) in ("_assert_scalar", "_assert_async")


def _reads_a_value(node: fx.Node) -> bool:
    """Whether ``node``'s symbolic value comes from a tensor's value (``item``)."""
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and target_name(n) in _SCALAR_READS:
            return True
        value = n.meta.get("val")
        if isinstance(value, torch.Tensor) or n.op in ("placeholder", "get_attr"):
            continue  # a tensor or an input: its sizes are not values
        stack.extend(n.all_input_nodes)
    return False


def is_value_assert(node: fx.Node) -> bool:
    """Whether ``node`` asserts a branch on a tensor's value (kept), not on a size (dropped).

    ``_assert_async`` checks a tensor, so always a value; ``_assert_scalar`` when its
    condition reads a tensor's value through ``item`` (an unbacked symbol).
    """
    if not _is_assert(node):
        return False
    return target_name(node) == "_assert_async" or _reads_a_value(node)


def branch_location(node: fx.Node) -> str:
    """``file:line (`code`)`` of the model's line that made ``node``, or ``""``."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln for ln in trace.strip().splitlines() if ln.strip()]
    for k in range(len(lines) - 1, -1, -1):
        line = lines[k].strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "'):].partition('", line ')
            number = rest.split(",")[0]
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{os.path.basename(path)}:{number} (`{code}`)"
    return ""


def value_branches(gm: fx.GraphModule) -> list[str]:
    """Where the model branches on tensor values, one entry per line, in graph order."""
    return list(dict.fromkeys(branch_location(n) or "an unknown line" for n in gm.graph.nodes
                              if is_value_assert(n)))


def explain_value_asserts(gm: fx.GraphModule, model: str) -> None:
    """Give each value assertion of ``gm`` a message naming ``model``'s line and the fix."""
    for node in gm.graph.nodes:
        if not is_value_assert(node) or target_name(node) != "_assert_scalar":
            continue
        where = branch_location(node) or "a line of its forward"
        node.args = (node.args[0], (
            f"{BRANCH_MARK} of {model}'s forward at {where} than the sample it was wrapped "
            "with; optmem's graph of this call holds the sample's side only (a graph cannot "
            "branch on values). The model itself would take the other side here (e.g. raise "
            "its own error on invalid labels). Wrap it with a sample whose values take "
            "this side, or call it without the input that leads to the branch"))
    gm.recompile()


class IntermediateBranch(Exception):  # noqa: N818 - named for what the model does
    """The forward branches on the value of an intermediate tensor (not an input's).

    Its assertion would run mid-step, in the stage computing the value, and a call taking
    the other side would fail half-way through a training step. Such branches (a router
    looping over the experts hit, ``int(hidden.sum())``) usually change from batch to
    batch, so the extraction refuses them instead, naming the line (:attr:`where`).
    :attr:`drawn` says the value is a random draw (a LayerDrop written with ``torch.rand``).
    """

    def __init__(self, where: str, owner: str | None = None, *, drawn: bool = False) -> None:
        super().__init__(f"branches on the value of an intermediate tensor at {where}")
        self.where = where
        self.owner = owner  # the qualified name of the module computing the value, if known
        self.drawn = drawn


def is_value_branch_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a value assertion of an optmem graph failing (see above)."""
    return isinstance(exc, RuntimeError) and BRANCH_MARK in str(exc)


@contextmanager
def real_values() -> Iterator[None]:
    """Within: ``torch.export`` resolves value branches with the sample's real values.

    Each such branch then takes the sample's side and becomes a runtime assertion of the
    graph instead of a ``GuardOnDataDependentSymNode`` error; export runs the model on
    real tensors beside the fake ones (the caller restores buffers and the RNG).
    """
    import torch._functorch.config as functorch_config

    with functorch_config.patch(fake_tensor_propagate_real_tensors=True), \
            _parameters_copied():
        yield


def _plain(src: object) -> object:
    """``src``'s plain tensor if it is an ``nn.Parameter`` of a plain tensor, else ``src``."""
    if isinstance(src, nn.Parameter) and type(src.data) is torch.Tensor:
        return src.data
    return src


@contextmanager
def _parameters_copied() -> Iterator[None]:
    """Within: the fake copies of the model's parameters carry their real values.

    torch (2.13) gives each fake tensor of a real-values export a real tensor allocated
    with ``torch.empty_strided`` and fills it with ``_safe_copy`` (or makes it with
    ``_safe_clone``) in ``torch._subclasses.meta_utils``, which skip any source whose type
    is not exactly ``torch.Tensor``: an ``nn.Parameter``'s real tensor was left
    uninitialised memory (buffers and inputs were copied). Every value computed from a
    parameter, so every side the export took on such a value, was drawn from that memory:
    HF's overflow guard took its clamping side in some runs and not in others (stop 86).
    Here a parameter of a plain tensor is copied through its ``.data``; a torch without
    these helpers is left as it is.
    """
    from torch._subclasses import meta_utils

    copy = getattr(meta_utils, "_safe_copy", None)
    clone = getattr(meta_utils, "_safe_clone", None)
    if copy is None or clone is None:
        yield
        return

    def copied(dst: torch.Tensor, src: torch.Tensor | None) -> None:
        copy(dst, _plain(src))

    def cloned(src: torch.Tensor) -> torch.Tensor | None:
        return clone(_plain(src))

    meta_utils._safe_copy, meta_utils._safe_clone = copied, cloned
    try:
        yield
    finally:
        meta_utils._safe_copy, meta_utils._safe_clone = copy, clone


# ------------------------------------------------------------------ BatchNorm(momentum=None)
def batch_norm_cumulative(input: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, running_mean: torch.Tensor,
                          running_var: torch.Tensor, training: bool,
                          num_batches_tracked: torch.Tensor, eps: float,
                          cudnn_enabled: bool) -> torch.Tensor:
    """``aten.batch_norm`` with the factor of a cumulative average read from the counter.

    What ``nn.BatchNorm*(momentum=None)`` computes in training: ``1 / n`` with ``n`` the
    counter it has just incremented (the side program increments it before any stage).
    """
    factor = 1.0 / float(num_batches_tracked)
    return torch.ops.aten.batch_norm.default(input, weight, bias, running_mean, running_var,
                                             training, factor, eps, cudnn_enabled)


def cumulative_batch_norms(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make ``gm``'s BatchNorms with ``momentum=None`` read their counter at run time.

    Export bakes the factor ``1 / num_batches_tracked`` of the sample's step into the
    graph and asserts the counter's value, so that every later step takes "another side"
    (and was extracted again). Each such ``aten.batch_norm`` of a module of ``model``
    training with running statistics calls :func:`batch_norm_cumulative` on the counter,
    and the assertions on the counter's value are dropped (the increment stays).
    """
    counters: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        counter = _cumulative_counter(gm, model, node)
        if counter is None:
            continue
        args = list(node.args)
        args[6] = counter
        node.target = batch_norm_cumulative
        node.args = tuple(args)
        counters.add(counter)
    if counters:
        _drop_counter_asserts(gm, counters)
        gm.recompile()


def _cumulative_counter(gm: fx.GraphModule, model: nn.Module,
                        node: fx.Node) -> fx.Node | None:
    """The counter node of ``node``, an ``aten.batch_norm`` of a cumulative BatchNorm.

    ``None`` for any other node, or when the running mean is not a buffer of a
    ``_BatchNorm`` of ``model`` with ``momentum=None`` training with running statistics.
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.batch_norm.default:
        return None
    mean = node.args[3]
    if not isinstance(mean, fx.Node) or mean.op != "get_attr" or node.args[5] is not True:
        return None
    path, _, _ = str(mean.target).rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return None
    if not (isinstance(owner, nn.modules.batchnorm._BatchNorm) and owner.momentum is None
            and owner.training and owner.num_batches_tracked is not None):
        return None
    target = f"{path}.num_batches_tracked" if path else "num_batches_tracked"
    found = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target),
                 None)
    if found is not None:
        return found
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(target)


def _drop_counter_asserts(gm: fx.GraphModule, counters: set[fx.Node]) -> None:
    """Remove the value assertions on ``counters`` (and what computes only them)."""
    reads = [n for n in gm.graph.nodes if n.op == "call_function"
             and target_name(n) in _SCALAR_READS and _counter_of(n.args[0], counters)]
    dead: list[fx.Node] = []
    stack = list(reads)
    while stack:
        n = stack.pop()
        if n in dead:
            continue
        dead.append(n)
        stack.extend(n.users)
    if not all(is_value_assert(n) or not isinstance(n.meta.get("val"), torch.Tensor)
               for n in dead):
        return  # the value reaches a tensor: not only the factor's assertions, kept
    for n in reversed(_topological(gm, dead)):
        gm.graph.erase_node(n)


def _counter_of(arg: object, counters: set[fx.Node]) -> bool:
    """Whether ``arg`` is a counter or its in-place increment (``add_``)."""
    if not isinstance(arg, fx.Node):
        return False
    return arg in counters or (target_name(arg) == "add_" and arg.args[0] in counters)


def _topological(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` in the graph's order."""
    wanted = set(nodes)
    return [n for n in gm.graph.nodes if n in wanted]
