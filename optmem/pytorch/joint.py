"""Joint re-runs: ``F_all i`` and ``B i`` of a stage as one traced forward-and-backward graph.

When the plan re-runs stage ``i`` with ``F_all i`` and no later op reads its output
``a^i`` (the last stage of a segment, re-run just before its ``B``: every stage of HF's
per-layer checkpointing is one), only the tensors the backward needs have to be
recomputed. Torch's non-reentrant checkpoint gets part of this with its *early stop* (the
re-run stops once every saved tensor is back: GPT-2's MLP output projection and residual
add are skipped), at the price of saved-tensor hooks on every tensor. Here the stage's
forward and backward are traced once, with ``make_fx``, into one graph of aten ops
(``x, side inputs, parameters, buffers, delta^i -> delta^{i-1}, parameter gradients``);
dead-code elimination removes every forward op whose result only feeds ``a^i``, wherever
it sits in the stage. ``F_all i`` then records a :class:`_Deferred` autograd node (inputs
kept, outputs zero-storage placeholders of the right shape) and autograd's call of its
backward runs the graph.

Why the gradients are the unmodified stage's, bitwise: ``make_fx`` records the aten ops the
autograd engine dispatches when it back-propagates the stage once (the same backward
formulas, the same gradient sums in the same order), and replays them on the same kernels.
Memory: the forward part runs at ``B i``'s time instead of ``F_all i``'s, with nothing in
between in the plan (no op reads ``a^i``, and the op after ``F_all i`` that needs the
stage's tape is its ``B``), and each value is freed after its last use (fx's generated
code drops it), so the peak is at most that of ``F_all i`` followed by ``B i``, less
``a^i`` and whatever only fed it.

Only the stages of an extracted graph (:class:`~optmem.pytorch.graphcut.GraphStage`, a
straight-line graph already) qualify, and a traced graph is used only if it has no random
op (the RNG state of a re-run is restored around ``F_all i``, not at ``B i``), no in-place
write to an input (buffer updates: the re-run's scratch buffers), and no tensor constant
that requires grad; the executor also keeps the ordinary re-run under autocast, with
compiled stages and for FSDP units. A graph that spares no matrix product or convolution
is not used either: its backward ops would run one by one from Python instead of in
autograd's engine for nothing (measured 2.6 % slower on BERT, whose layers end with a
LayerNorm that saves its input, so nothing is left to skip). Graphs are cached per stage
and input signature (shapes, strides, dtypes, devices; non-tensor side inputs by value).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from optmem.plan import Op, OpKind
from optmem.pytorch.context import SideInputs
from optmem.pytorch.custom_functions import is_opaque_call
from optmem.pytorch.graphcut import GraphStage

__all__ = ["JointStage", "dead_outputs"]


def dead_outputs(plan: Sequence[Op], n: int) -> set[int]:
    """Positions of the ``F_all i`` ops whose output ``a^i`` no later op reads.

    Slot ``i`` is read by a forward of stage ``i + 1`` (by ``Loss`` when ``i = n``) and
    rebuilt by a forward of stage ``i``; ``F_all i`` at position ``p`` is *dead* when, after
    ``p``, no such read comes before the next forward of stage ``i`` (or the plan's end).

    Examples
    --------
    >>> from optmem.plan import parse_plan
    >>> plan = parse_plan(["F_ck 1", "F_all 2", "F_all 3", "Loss", "B 3", "B 2",
    ...                    "F_all 1", "B 1"])
    >>> sorted(dead_outputs(plan, 3))
    [6]
    >>> plan = parse_plan(["F_ck 1", "F_none 2", "Loss", "F_all 2", "B 2", "F_all 1",
    ...                    "B 1"])
    >>> sorted(dead_outputs(plan, 2))
    [3, 5]
    """
    dead: set[int] = set()
    for p, op in enumerate(plan):
        if op.kind is not OpKind.F_ALL:
            continue
        i, read = op.stage, False
        for later in plan[p + 1:]:
            if later.kind is OpKind.B:
                continue
            if (later.kind is OpKind.LOSS and i == n) or (
                    later.kind is not OpKind.LOSS and later.stage == i + 1):
                read = True
                break
            if later.kind is not OpKind.LOSS and later.stage == i:
                break
        if not read:
            dead.add(p)
    return dead


@dataclass
class _Traced:
    """One traced joint graph and how to call it."""

    graph: fx.GraphModule  # called through its forward (see _Job.run)
    module: nn.Module  # the stage's graph module (for the autograd path)
    names: list[str]  # its parameters then buffers, as the graph takes them
    out_meta: list[tuple[torch.Size, torch.dtype, torch.device]]
    out_spec: Any
    dx: tuple[int, ...]  # positions (in the input's tensor leaves) of the differentiable ones
    dp: tuple[int, ...]  # positions (in the stage's state) of the parameters requiring grad
    failed: bool = False  # its replay met real tensors it was not traced for (see _Job.run)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.dtype, t.device, t.storage_offset())


class _Job:
    """What the backward of one :class:`_Deferred` node needs: the traced graph and inputs."""

    __slots__ = ("leaves", "sides", "spec", "state", "traced")

    def __init__(self, traced: _Traced, leaves: list[torch.Tensor], spec: Any,
                 sides: list[Any], state: list[torch.Tensor]) -> None:
        self.traced = traced
        self.leaves = leaves
        self.spec = spec
        self.sides = sides
        self.state = state

    def run(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``delta^{i-1}`` and the parameter gradients: the joint graph, or autograd.

        The graph was traced with contiguous incoming gradients (its reshapes are views);
        a gradient laid out otherwise is back-propagated by autograd through a forward of
        the stage run now (the same ops and values: the stage has no random op). So is a
        call where some output has no gradient (``None``: the loss does not read it, e.g.
        the last hidden state when only an earlier one is used): the graph takes a
        gradient for every output, and zeros there gave the parameters that only feed such
        outputs a zero gradient where the model leaves ``None`` (an optimizer with weight
        decay then moved them).

        The graph was traced on fake tensors, whose layouts are those of torch's fake
        kernels. Where a real kernel returns another layout (CPU ``native_batch_norm`` on a
        transposed input: fake strides ``(256, 1, 32)``, real ``(256, 8, 1)``), a ``view``
        the trace recorded can fail on the real tensor (HF PatchTST: "view size is not
        compatible with input tensor's size and stride"). Such a failure (any error but
        running out of memory) is caught: the graph writes nothing outside itself
        (:func:`_replayable`), so autograd back-propagates through a forward run now, as
        above, and the stage never uses the graph again (:attr:`_Traced.failed`).
        """
        traced = self.traced
        got: Sequence[torch.Tensor | None] | None = None
        if all(g is not None and g.is_contiguous() for g in grads) and not traced.failed:
            try:
                # its forward, not its __call__: the joint graph is optmem's backward, not a
                # module of the model. Through __call__ the caller's module trackers
                # (ModTracker, hence FlopCounterMode and MemTracker) took it for one and
                # hooked its arguments, the parameters among them, which the executor's
                # autograd.grad cannot run ("A leaf node was passed to
                # _will_engine_execute_node")
                got = traced.graph.forward(self.leaves, self.sides, self.state, list(grads))
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                traced.failed = True
        if got is None:
            got = self._autograd(grads)
        self.leaves, self.sides, self.state = [], [], []
        return list(got)

    def _autograd(self, grads: Sequence[torch.Tensor | None]
                  ) -> Sequence[torch.Tensor | None]:
        traced = self.traced
        xs = [v.detach().requires_grad_(True) if k in traced.dx else v
              for k, v in enumerate(self.leaves)]
        state = dict(zip(traced.names, self.state, strict=True))
        wanted_n = len(traced.dx) + len(traced.dp)
        if all(g is None for g in grads):
            return [None] * wanted_n
        with torch.enable_grad():
            out = torch.func.functional_call(traced.module, state,
                                             (tree_unflatten(xs, self.spec), *self.sides))
            wanted = [xs[k] for k in traced.dx] + [self.state[k] for k in traced.dp]
            pairs = [(o, g) for o, g in zip(tree_flatten(out)[0], grads, strict=True)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if not pairs:
                return [None] * wanted_n
            return torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                       allow_unused=True)


class _Deferred(torch.autograd.Function):
    """``F_all i`` of a dead output: inputs kept, placeholders out; the joint graph at ``B i``."""

    @staticmethod
    def forward(ctx: Any, job: _Job, *inputs: torch.Tensor) -> Any:
        ctx.job = job
        ctx.set_materialize_grads(False)  # an output the loss does not read: None, not zeros
        return tuple(torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)
                     for shape, dtype, device in job.traced.out_meta)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        job, ctx.job = ctx.job, None
        if job is None:
            raise RuntimeError("a joint re-run of the optmem executor was back-propagated "
                               "twice (each backward of the plan re-runs its own; a second "
                               "backward of one is an optmem bug)")
        return (None, *job.run(grads))


class JointStage:
    """The joint graphs of one stage, traced on first use per input signature.

    Parameters
    ----------
    stage
        The stage module; only a :class:`~optmem.pytorch.graphcut.GraphStage` qualifies.
    """

    def __init__(self, stage: nn.Module) -> None:
        self.module = stage
        self.stage = stage if isinstance(stage, GraphStage) else None
        self._graphs: dict[tuple[Any, ...], _Traced | None] = {}
        self._modules: list[tuple[str, nn.Module]] | None = None

    def forget_modules(self) -> None:
        """Walk the stage's submodules again at the next call (one was added or removed)."""
        self._modules = None

    def _state(self) -> tuple[list[str], list[torch.Tensor]]:
        """``gm.named_parameters()`` then ``gm.named_buffers()``: names and current tensors.

        The same names, tensors and order as those two walks (each deduplicated by
        identity), read from the ``_parameters`` and ``_buffers`` dicts of the graph
        module's submodules, whose list (with their prefixes) is made once: a parameter or
        buffer replaced since (``load_state_dict(assign=True)``, the wrapper's rebinding,
        which may turn one into the other) is seen, a submodule added is seen after
        :meth:`forget_modules` (the executor calls it from ``set_plan``). Walking the
        module tree at every joint re-run cost about 0.1 ms each under cProfile on Llama's
        stages (``benchmarks/results/hf_overhead.md``).
        """
        assert self.stage is not None
        if self._modules is None:
            self._modules = [(f"{prefix}." if prefix else "", m)
                             for prefix, m in self.stage.gm.named_modules()]
        names: list[str] = []
        state: list[torch.Tensor] = []
        for kind in ("_parameters", "_buffers"):
            seen: set[int] = set()
            for prefix, m in self._modules:
                for name, t in getattr(m, kind).items():
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    names.append(prefix + name)
                    state.append(t)
        return names, state

    def call(self, x: Any, ctx: SideInputs | None) -> Any | None:
        """``a^i`` as placeholders on a :class:`_Deferred` node, or ``None`` (not eligible).

        ``x`` is the stage input as ``F_all`` gives it (float tensors requiring grad); the
        side inputs are read from ``ctx`` now and kept for the backward.
        """
        stage = self.stage
        if stage is None:
            return None
        leaves, spec = tree_flatten(x)
        if not all(isinstance(v, torch.Tensor) for v in leaves):
            return None
        if stage.side_names and ctx is None:
            return None
        sides = [ctx[n] for n in stage.side_names] if ctx is not None else []
        names, state = self._state()
        key = self._key(leaves, spec, sides, names, state)
        if key is None:
            return None
        if key not in self._graphs:
            # outside any dispatch mode of the caller (memory trackers, op counters): the
            # trace is not part of the step, and its fake tensors hold no memory
            with _disable_current_modes():
                self._graphs[key] = self._trace(leaves, spec, sides, names, state)
        traced = self._graphs[key]
        if traced is None:  # refused: the graph's structure, not the shapes, decided
            self.stage = None
            return None
        if traced.failed:  # its replay failed once (_Job.run): the ordinary re-run
            return None
        job = _Job(traced, [v.detach() for v in leaves], spec, sides, state)
        inputs = [leaves[k] for k in traced.dx] + [state[k] for k in traced.dp]
        outs = _Deferred.apply(job, *inputs)
        return tree_unflatten(list(outs), traced.out_spec)

    @staticmethod
    def _key(leaves: list[torch.Tensor], spec: Any, sides: list[Any], names: list[str],
             state: list[torch.Tensor]) -> tuple[Any, ...] | None:
        side_key: list[Any] = []
        for v in sides:
            if isinstance(v, torch.Tensor):
                side_key.append(_meta(v))
                continue
            try:
                hash(v)
            except TypeError:
                return None
            side_key.append((type(v), v))
        return (spec, tuple((*_meta(v), v.requires_grad) for v in leaves), tuple(side_key),
                tuple(names), tuple((*_meta(t), t.requires_grad) for t in state))

    def _trace(self, leaves: list[torch.Tensor], spec: Any, sides: list[Any],
               names: list[str], state: list[torch.Tensor]) -> _Traced | None:
        """Trace the joint graph (``make_fx`` on fake tensors, once); ``None`` if refused.

        Fake tensors: the trace runs no kernel, draws no random number and writes no
        buffer, so a refused stage re-runs exactly as without this module.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        assert self.stage is not None
        gm = self.stage.gm
        if any(is_opaque_call(node) for node in gm.graph.nodes):
            return None  # a custom autograd Function: its own forward and backward run it
        dx = tuple(k for k, v in enumerate(leaves) if v.requires_grad)
        dp = tuple(k for k, t in enumerate(state) if t.requires_grad)
        mode = FakeTensorMode()
        fxs = [mode.from_tensor(v.detach()) for v in leaves]
        fside = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in sides]
        fst = [mode.from_tensor(t.detach()) for t in state]
        try:
            with mode, torch.no_grad():
                sample = torch.func.functional_call(gm, dict(zip(names, fst, strict=True)),
                                                    (tree_unflatten(fxs, spec), *fside))
                outs, out_spec = tree_flatten(sample)
                if not outs or not all(isinstance(t, torch.Tensor) and t.is_floating_point()
                                       for t in outs):
                    return None
                out_meta = [(t.shape, t.dtype, t.device) for t in outs]
                grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in outs]
        except Exception:  # noqa: BLE001 - a stage fake tensors cannot run keeps its re-run
            return None

        def joint(xs: list[torch.Tensor], side: list[Any], st: list[torch.Tensor],
                  gs: list[torch.Tensor]) -> list[torch.Tensor | None]:
            xs = [x.detach().requires_grad_(True) if k in dx else x for k, x in enumerate(xs)]
            st = [t.detach().requires_grad_(True) if k in dp else t for k, t in enumerate(st)]
            with torch.enable_grad():
                out = torch.func.functional_call(gm, dict(zip(names, st, strict=True)),
                                                 (tree_unflatten(xs, spec), *side))
                flat = tree_flatten(out)[0]
                wanted = [xs[k] for k in dx] + [st[k] for k in dp]
                got = torch.autograd.grad(flat, wanted, gs, allow_unused=True)
            return list(got)

        try:
            traced = make_fx(joint, tracing_mode="fake")(fxs, fside, fst, grads)
        except Exception:  # noqa: BLE001 - an untraceable stage keeps the ordinary re-run
            return None
        products = _products(traced)
        traced.graph.eliminate_dead_code()
        traced.recompile()
        if not _replayable(traced) or _products(traced) >= products:
            return None
        return _Traced(traced, gm, names, out_meta, out_spec, dx, dp)


_PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "linear", "matmul",
                       "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_cudnn_attention"})


def _products(gm: torch.fx.GraphModule) -> int:
    """The matrix products and convolutions of a traced graph."""
    return sum(1 for node in gm.graph.nodes if node.op == "call_function"
               and isinstance(node.target, torch._ops.OpOverload)
               and node.target._opname in _PRODUCTS)


def _replayable(gm: torch.fx.GraphModule) -> bool:
    """No random op, no in-place write, no constant that requires grad."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return False
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return False
        if node.target._schema.is_mutable:
            return False
    return True
