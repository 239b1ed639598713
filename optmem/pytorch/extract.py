"""Chain extraction: turn an ``nn.Module`` into a sequence of stages (a chain).

Two routes, both returning a list of :class:`Stage` (a name and an ``nn.Module`` that takes
one value, a tensor or a tuple of tensors, and returns one value):

* ``nn.Sequential`` is flattened directly, nested ``Sequential`` containers included, as
  rotor does (digest ``rotor.md`` section 6.2, ``extract_children_from_sequential``).
  A ``Sequential`` subclass that overrides ``forward`` (or sets
  ``not_really_sequential = True``) is kept whole.
* Any other module is traced with ``torch.fx.symbolic_trace`` and its graph is cut at
  *single-value cut points*: positions in the topological order where exactly one value
  computed before is still needed after. Residual blocks, inception modules and
  transformer blocks have no such point inside them, so they stay whole.

A stage never starts with an in-place op on its input (``ReLU(inplace=True)``,
``x.add_(...)``): that would overwrite a checkpoint or the stage's input leaf, so such ops
are merged into the stage before them.

:func:`merge_stages` groups consecutive stages into at most ``N`` balanced stages (exact
linear-partition DP minimising the costliest group).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from optmem.errors import OptmemInputError

__all__ = ["Stage", "extract_stages", "merge_stages", "partition_costs", "stage_cost"]


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


# ------------------------------------------------------------------ nn.Sequential
def _is_plain_sequential(module: nn.Module) -> bool:
    if not isinstance(module, nn.Sequential):
        return False
    if getattr(module, "not_really_sequential", False):
        return False
    return type(module).forward is nn.Sequential.forward


def _flatten_sequential(module: nn.Sequential, prefix: str) -> list[Stage]:
    out: list[Stage] = []
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if _is_plain_sequential(child):
            out.extend(_flatten_sequential(child, full))  # type: ignore[arg-type]
        else:
            out.append(Stage(full, child))
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


# ------------------------------------------------------------------ torch.fx
_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.iand, operator.ior, operator.ixor}


def _node_is_inplace(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        return _module_is_inplace(root.get_submodule(str(node.target)))
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS:
            return True
        if node.kwargs.get("inplace", False):
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    return False


class _Segment(nn.Module):
    """A contiguous piece of a traced graph, as a module of one value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, x: Any) -> Any:  # noqa: D102
        return self.gm(x)


def _trace(module: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(module)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear message
        raise OptmemInputError(
            f"cannot extract a chain from {type(module).__name__}: it is not an nn.Sequential "
            f"and torch.fx cannot trace it ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            "Wrap the traceable parts in an nn.Sequential, or pass a list of stages.",
            field="module") from None


def _cut_positions(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[int]:
    """Positions ``k`` such that only ``nodes[k]`` is live between ``k`` and ``k + 1``."""
    index = {n: k for k, n in enumerate(nodes)}
    last_use: dict[fx.Node, int] = {}
    for k, n in enumerate(nodes):
        for arg in n.all_input_nodes:
            if arg.op != "get_attr":
                last_use[arg] = k
    # live values crossing each boundary, counted with a sweep
    starts = [0] * (len(nodes) + 1)
    for n, last in last_use.items():
        d = index[n]
        if last > d:
            starts[d] += 1
            starts[last] -= 1
    cuts = []
    live = 0
    for k, n in enumerate(nodes[:-1]):
        live += starts[k]
        if n.op in ("get_attr", "placeholder"):
            continue
        # exactly one live value, and it is n itself
        if live == 1 and last_use.get(n, -1) > k:
            nxt = nodes[k + 1]
            users_after = [u for u in n.users if index[u] > k]
            if any(_node_is_inplace(u, gm) and u.args and u.args[0] is n
                   for u in users_after):
                continue
            if nxt.op == "output":
                continue
            cuts.append(k)
    return cuts


def _build_segment(gm: fx.GraphModule, nodes: list[fx.Node], first: int, last: int,
                   inp: fx.Node | list[fx.Node], returns: fx.Node | Any) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    x = graph.placeholder("x")
    if isinstance(inp, list):  # the first segment unpacks the module's arguments
        if len(inp) == 1:
            env[inp[0]] = x
        else:
            for k, p in enumerate(inp):
                env[p] = graph.call_function(operator.getitem, (x, k))
    else:
        env[inp] = x

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise RuntimeError(f"internal error: node {n.name} not available in segment")
            env[n] = graph.node_copy(n, lookup)
        return env[n]

    for n in nodes[first:last + 1]:
        if n.op in ("placeholder",):
            continue
        env[n] = graph.node_copy(n, lookup)
    graph.output(fx.node.map_arg(returns, lookup))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="OptmemSegment")


def _segment_name(nodes: list[fx.Node], first: int, last: int) -> str:
    names = [str(n.target) if n.op == "call_module" else n.name
             for n in nodes[first:last + 1] if n.op not in ("get_attr", "placeholder")]
    if not names:
        return "input"
    modules = [str(n.target) for n in nodes[first:last + 1] if n.op == "call_module"]
    prefix = _common_module_prefix(modules) if len(modules) > 1 else ""
    if prefix:
        return prefix
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


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


def _fx_stages(module: nn.Module) -> list[Stage]:
    gm = _trace(module)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        raise OptmemInputError(f"{type(module).__name__}.forward takes no input", field="module")
    out_node = nodes[-1]
    # Do not let get_attr/placeholder nodes decide segment boundaries: compute cuts on all nodes.
    cuts = _cut_positions(gm, nodes)
    bounds: list[tuple[int, int]] = []
    start = 0
    for k in cuts:
        bounds.append((start, k))
        start = k + 1
    bounds.append((start, len(nodes) - 2))
    stages: list[Stage] = []
    prev: fx.Node | list[fx.Node] = placeholders
    for s, (first, last) in enumerate(bounds):
        is_last = s == len(bounds) - 1
        returns = out_node.args[0] if is_last else nodes[last]
        seg = _build_segment(gm, nodes, first, last, prev, returns)
        stages.append(Stage(_segment_name(nodes, first, last), _Segment(seg)))
        if not is_last:
            prev = nodes[last]
    return stages


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
    elif _is_plain_sequential(module):
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
        raise OptmemInputError(
            f"no chain found in {type(module).__name__}: its graph has no single-tensor cut "
            "point, so it is one stage and checkpointing cannot save memory. Split it into an "
            "nn.Sequential of blocks, or pass allow_single=True.", field="module")
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
                 costs: Sequence[float] | None = None) -> list[Stage]:
    """Group consecutive stages into at most ``max_stages`` stages of balanced cost."""
    if costs is None:
        costs = [stage_cost(s.module) for s in stages]
    if len(costs) != len(stages):
        raise OptmemInputError(f"expected {len(stages)} costs, got {len(costs)}", field="costs")
    out = []
    for first, last in partition_costs(costs, max_stages):
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
