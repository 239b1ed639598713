"""Custom ``torch.autograd.Function`` calls kept whole through extraction.

``torch.export`` (and ``torch.fx``) trace a custom ``torch.autograd.Function`` through its
``forward`` and drop its ``backward``: the extracted graph holds the forward's aten ops, and
autograd then differentiates those. Where the Function's backward is not the derivative of
its forward, gradients are silently wrong: a straight-through estimator (``round`` forward,
identity backward) gets ``round``'s zero gradient, a gradient-reversal layer the un-reversed
gradient. Where it is the derivative, memory changes: Bloom's ``GeLUFunction`` saves its
input and recomputes in its backward, its inlined forward saves every intermediate (about
8x as much).

While optmem exports a module, :func:`opaque_functions` routes the ``apply`` of every custom
Function (one whose class is defined outside ``torch``) through one custom op,
``optmem::autograd_function``. Its fake kernel runs the Function's forward on the export's
fake tensors, so the exported graph holds one node per call, with the call's tensors as
inputs. :func:`restore_functions` then points each such node at :func:`call_function`,
which calls the Function's own ``apply`` on real tensors: forward and backward are the
Function's, as in the eager model. Non-tensor arguments are kept per call site (the graph
is specialised to its call anyway).

``torch.fx`` cannot keep them (its proxies run the forward), so :func:`refuse_functions`
turns a custom Function met while fx traces into an :class:`~optmem.errors.OptmemInputError`
naming it, never a graph with the wrong backward.

The same route keeps whole one aten op whose output's *size* fake tensors cannot know:
``torch.ctc_loss`` with lengths given as tensors (HF's ``ForCTCLoss``, used by every
``...ForCTC`` speech model, and ``nn.CTCLoss``). Its fake kernel has no size for the
alphas it keeps for the backward (they depend on the longest target's value), so export
stopped with ``DynamicOutputShapeException``. While optmem exports, :func:`opaque_functions`
routes such calls through ``optmem::ctc_loss``, whose loss has a known size, and
:func:`restore_functions` points the node back at ``torch.ctc_loss`` (:func:`ctc_loss`):
the eager op, forward and backward.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from optmem.errors import OptmemInputError

__all__ = ["CTC_OP", "OPAQUE_OP", "call_function", "ctc_loss", "is_opaque_call",
           "live_namespaces", "opaque_functions", "refuse_functions", "restore_functions"]

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"].__func__
_ORIGINAL_CTC = torch.ctc_loss
_STATE = threading.local()


@dataclass
class _Call:
    """One call site: the Function, its non-tensor arguments, the shape of its output."""

    fn: type[torch.autograd.Function]
    template: tuple[Any, ...]  # the arguments, ``None`` where a tensor goes
    tensor_positions: tuple[int, ...]
    single: bool | None = None  # forward returned one tensor (None: not run yet)

    def bind(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The call's arguments with ``tensors`` at their positions."""
        args = list(self.template)
        for k, t in zip(self.tensor_positions, tensors, strict=True):
            args[k] = t
        return args


_CALLS: list[_Call] = []
_LIVE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""The modules passed to a Function kept whole, and their submodules (:func:`live_namespaces`)."""


def live_namespaces() -> set[int]:
    """The ``id`` of the ``__dict__`` of every module that a Function kept whole is passed.

    Such a module's Python runs at every call of the stages (HF Reformer's reversible
    layers, given to ``_ReversibleFunction`` as a ``ModuleList``): no graph holds its
    attributes, the Function reads them then, and it may write them (Reformer draws new
    dropout seeds, ``self.attention_seed``, at every forward). The wrapper does not take
    a change of them for a new call signature
    (:class:`~optmem.pytorch.wrapper.TensorState`).
    """
    return {id(m.__dict__) for m in _LIVE}


@dataclass
class _Session:
    """What one extraction met: how to treat custom Functions, and which it met."""

    mode: str  # "opaque" (export) or "refuse" (fx)
    met: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


def _is_custom(cls: type) -> bool:
    """A Function defined outside torch (torch's own are traced as torch means them)."""
    module = getattr(cls, "__module__", "") or ""
    return not (module == "torch" or module.startswith("torch."))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _session() -> _Session | None:
    return getattr(_STATE, "session", None)


def _depth() -> int:
    return int(getattr(_STATE, "depth", 0))


@contextmanager
def _inside() -> Iterator[None]:
    """Calls of ``apply`` made while running a Function for a kernel go to the original."""
    depth = _depth()
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def _as_list(out: Any, call: _Call, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    single = isinstance(out, torch.Tensor)
    outs = [out] if single else list(out) if isinstance(out, tuple | list) else None
    if outs is None or not all(isinstance(o, torch.Tensor) for o in outs):
        raise OptmemInputError(
            f"the custom autograd Function {_name(call.fn)} returns "
            f"{type(out).__name__} values other than tensors; optmem can keep only Functions "
            "that return a tensor or a tuple of tensors", field="module")
    call.single = single
    # a fresh tensor per output: the op's outputs may not alias its inputs
    alias = torch._C._is_alias_of  # type: ignore[attr-defined]
    return [o.clone() if any(alias(o, t) for t in inputs) else o for o in outs]


def _run(handle: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The op's kernel, fake and real alike: the Function's forward, without grad."""
    call = _CALLS[handle]
    with torch.no_grad():
        with _inside():
            out = _ORIGINAL_APPLY(call.fn, *call.bind(inputs))
        return _as_list(out, call, inputs)


@torch.library.custom_op("optmem::autograd_function", mutates_args=())
def _opaque(handle: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A custom Function's call as one op (only traced: :func:`restore_functions`)."""
    return _run(handle, inputs)


_opaque.register_fake(_run)


OPAQUE_OP = torch.ops.optmem.autograd_function.default


def call_function(handle: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run call site ``handle``'s Function on ``inputs`` (its own forward and backward)."""
    call = _CALLS[handle]
    out = call.fn.apply(*call.bind(inputs))
    return [out] if call.single else list(out)


call_function._optmem_opaque = True  # type: ignore[attr-defined]


def is_opaque_call(node: fx.Node) -> bool:
    """Whether ``node`` runs a custom Function kept whole (:func:`call_function`)."""
    return node.op == "call_function" and node.target in (call_function, OPAQUE_OP)


# ------------------------------------------------------------------ CTC loss
_CTC_ARGS = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction",
             "zero_infinity")
_CTC_DEFAULTS = {"blank": 0, "reduction": 1, "zero_infinity": False}


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, blank: int, reduction: int,
             zero_infinity: bool) -> torch.Tensor:
    """``torch.ctc_loss`` itself: what a restored ``optmem::ctc_loss`` node runs.

    ``reduction`` is torch's enum (0 none, 1 mean, 2 sum), as ``nn.functional.ctc_loss``
    passes it.
    """
    return _ORIGINAL_CTC(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                         zero_infinity)


@torch.library.custom_op("optmem::ctc_loss", mutates_args=())
def _ctc_op(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
            target_lengths: torch.Tensor, blank: int, reduction: int,
            zero_infinity: bool) -> torch.Tensor:
    """``torch.ctc_loss`` as one op of known output size (only traced, then restored)."""
    return ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                    zero_infinity)


@_ctc_op.register_fake
def _ctc_fake(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
              target_lengths: torch.Tensor, blank: int, reduction: int,
              zero_infinity: bool) -> torch.Tensor:
    """The loss's size: one per sequence with ``reduction`` none, else a scalar."""
    batched = log_probs.dim() == 3
    shape = (log_probs.shape[1],) if reduction == 0 and batched else ()
    return log_probs.new_empty(shape)


def _ctc_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.options = inputs[4:]


def _ctc_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The gradient of ``log_probs``, from the eager op run again.

    The op is only traced: a restored graph runs :func:`ctc_loss` and its own backward.
    """
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    with torch.enable_grad():
        x = log_probs.detach().requires_grad_()
        loss = ctc_loss(x, targets, input_lengths, target_lengths, *ctx.options)
        (dx,) = torch.autograd.grad(loss, x, grad)
    return dx, None, None, None, None, None, None


_ctc_op.register_autograd(_ctc_backward, setup_context=_ctc_setup)

CTC_OP = torch.ops.optmem.ctc_loss.default


def _ctc(*args: Any, **kwargs: Any) -> Any:
    """``torch.ctc_loss`` while patched: tensor lengths go through ``optmem::ctc_loss``.

    Integer-list lengths have a fake size already (the longest target is known), and calls
    made while running a kernel or outside an export session go to the original.
    """
    session = _session()
    bound = dict(_CTC_DEFAULTS, **dict(zip(_CTC_ARGS, args, strict=False)), **kwargs)
    tensors = all(isinstance(bound.get(k), torch.Tensor) for k in _CTC_ARGS[:4])
    if session is None or session.mode != "opaque" or _depth() > 0 or not tensors \
            or set(bound) != set(_CTC_ARGS):
        return _ORIGINAL_CTC(*args, **kwargs)
    return CTC_OP(*(bound[k] for k in _CTC_ARGS))


def _is_reentrant_checkpoint(cls: type) -> bool:
    """Whether ``cls`` is torch's reentrant checkpoint, ``CheckpointFunction``."""
    from torch.utils.checkpoint import CheckpointFunction

    return cls is CheckpointFunction


def _reentrant_checkpoint(args: tuple[Any, ...]) -> Any:
    """Trace ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` as eager.

    It calls ``CheckpointFunction.apply(fn, preserve_rng_state, *args)``, whose forward runs
    ``fn`` under ``no_grad`` and whose backward runs it again. Traced by ``torch.export``,
    the backward is dropped and the ``no_grad`` does not end with the call: the block's
    output and everything after it needed no gradient (a silent ``None`` for every later
    parameter, or "element 0 of tensors does not require grad"). The block is traced as a
    plain call instead (optmem's plan decides what is recomputed), the same computation
    with the same gradients; when no tensor argument requires grad, under ``no_grad``, as
    eager (whose block then gets no gradient: torch warns).
    """
    fn, call_args = args[0], args[2:]
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in call_args):
        return fn(*call_args)
    with torch.no_grad():
        return fn(*call_args)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    session = _session()
    if session is not None and _depth() == 0 and not kwargs and _is_reentrant_checkpoint(cls):
        return _reentrant_checkpoint(args)
    if session is None or _depth() > 0 or not _is_custom(cls):
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    session.met.append(_name(cls))
    if session.mode == "refuse" or kwargs:
        if kwargs:
            session.unsupported.append(f"{_name(cls)} (called with keyword arguments)")
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    positions = tuple(k for k, a in enumerate(args) if isinstance(a, torch.Tensor))
    template = tuple(None if k in positions else a for k, a in enumerate(args))
    for a in template:
        if isinstance(a, torch.nn.Module):
            _LIVE.update(a.modules())
    _CALLS.append(_Call(cls, template, positions))
    handle = len(_CALLS) - 1
    outs = OPAQUE_OP(handle, [args[k] for k in positions])
    return outs[0] if _CALLS[handle].single else tuple(outs)


@contextmanager
def _patched(mode: str) -> Iterator[_Session]:
    if _session() is not None:
        raise RuntimeError("nested extraction of custom autograd Functions")
    session = _Session(mode)
    _STATE.session = session
    current = torch.autograd.Function.__dict__["apply"]  # restored as found
    ctc = torch.ctc_loss
    torch.autograd.Function.apply = classmethod(_apply)  # type: ignore[method-assign,assignment]
    torch.ctc_loss = _ctc  # type: ignore[assignment]
    try:
        yield session
    finally:
        torch.autograd.Function.apply = current  # type: ignore[method-assign]
        torch.ctc_loss = ctc  # type: ignore[assignment]
        _STATE.session = None


@contextmanager
def opaque_functions(module_name: str) -> Iterator[_Session]:
    """Within: every custom Function's call is one ``optmem::autograd_function`` op.

    Raises
    ------
    OptmemInputError
        On leaving, when a Function could not be kept whole (keyword arguments), naming it.
    """
    with _patched("opaque") as session:
        yield session
    if session.unsupported:
        raise OptmemInputError(
            f"cannot keep the custom autograd Function {', '.join(session.unsupported)} of "
            f"{module_name} whole: tracing it would drop its backward. Call it with "
            "positional arguments, or pass a list of stage modules", field="module")


@contextmanager
def refuse_functions(module_name: str) -> Iterator[_Session]:
    """Within (``torch.fx`` tracing): a custom Function met raises on leaving.

    Raises
    ------
    OptmemInputError
        Naming the Functions: fx runs their forward on proxies and drops their backward.
    """
    with _patched("refuse") as session:
        yield session
    if session.met:
        names = ", ".join(sorted(set(session.met)))
        raise OptmemInputError(
            f"{module_name} calls the custom autograd Function {names}: torch.fx would trace "
            "its forward and drop its backward (wrong gradients). torch.export keeps it "
            "whole; where export fails, pass an nn.Sequential of blocks or a list of stage "
            "modules", field="module")


def restore_functions(gm: fx.GraphModule) -> int:
    """Point every ``optmem::autograd_function`` node of ``gm`` at :func:`call_function`.

    And every ``optmem::ctc_loss`` node at :func:`ctc_loss`. Returns the number of calls
    restored.
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (OPAQUE_OP, CTC_OP):
            node.target = call_function if node.target is OPAQUE_OP else ctc_loss
            count += 1
    if count:
        gm.recompile()
    return count
