"""Constant integer buffers: exported as the values they hold (stop 86).

HF's EnCodec keeps its convolutions' ``stride``, ``kernel_size`` and ``padding_total`` as
non-persistent ``int64`` buffers of one element and computes its padding from them
(``if length <= max_pad:``, ``F.pad(x, (left, right))``). ``torch.export`` makes every
buffer a graph input, so these sizes depend on input values and the export failed with a
data-dependent guard. Exported again with each such buffer read as the constant it holds
(a fresh ``torch.tensor(value)`` at every read, which the trace folds), the sizes are
known.

Only buffers that are integer (or boolean), of one element, not in the ``state_dict``
(non-persistent) and plain tensors are candidates (:func:`candidate_buffers`), and only
when the first export failed on a value; the export is refused (the first failure stands)
when the forward writes one (:func:`written`) or computes a tensor of more than one element
from one (:func:`read_as_values`). The graph then holds the values: the wrapper records
them (:data:`SPECIALISED`, read by :class:`~optmem.pytorch.wrapper.TensorState`) and
extracts again when one changes after wrapping, as for a changed Python attribute.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import fx, nn

_TRACKED: ContextVar[bool] = ContextVar("optmem_constants_tracked", default=False)


@contextmanager
def tracked() -> Iterator[None]:
    """Within: an extraction may hold buffers as constants (:func:`enabled`).

    Only the planned wrappers extract within it: their
    :class:`~optmem.pytorch.wrapper.TensorState` sees a change of such a buffer and extracts
    again. The pipeline and the chain-file profiler do not, and keep the first failure.
    """
    token = _TRACKED.set(True)
    try:
        yield
    finally:
        _TRACKED.reset(token)


def enabled() -> bool:
    """Whether the extraction running may hold buffers as constants (:func:`tracked`)."""
    return _TRACKED.get()


SPECIALISED: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = \
    weakref.WeakKeyDictionary()
"""The buffers (names, by owning module) an exported graph holds as constants."""

Candidate = tuple[nn.Module, str, torch.Tensor]


def is_candidate(module: nn.Module, name: str, t: torch.Tensor | None) -> bool:
    """Whether buffer ``name`` of ``module`` may be exported as the value it holds."""
    return (t is not None and type(t) is torch.Tensor and name in module._non_persistent_buffers_set
            and not (t.is_floating_point() or t.is_complex()) and t.numel() == 1
            and not t.is_meta)


def candidate_buffers(model: nn.Module) -> list[Candidate]:
    """The non-persistent integer buffers of one element in ``model`` (module, name, tensor).

    Modules that cannot change class (TorchScript) are left out.
    """
    return [(m, name, t) for m in model.modules()
            if not isinstance(m, torch.jit.ScriptModule)
            for name, t in m._buffers.items() if t is not None and is_candidate(m, name, t)]


def _reader(name: str, value: Any, t: torch.Tensor, made: list[torch.Tensor]) -> property:
    dtype, device, shape = t.dtype, t.device, t.shape

    def read(_: nn.Module) -> torch.Tensor:
        fresh = torch.tensor(value, dtype=dtype, device=device)
        fresh = fresh.reshape(shape) if shape else fresh
        made.append(fresh)
        return fresh

    read.__name__ = name
    return property(read)


@contextmanager
def buffers_as_constants(candidates: Sequence[Candidate]) -> Iterator[list[torch.Tensor]]:
    """Within: each candidate buffer reads as a fresh tensor of its value.

    The owning module's class is swapped for a subclass of the same name with one read-only
    property per buffer, and the buffer leaves ``_buffers`` (which keeps its identity and,
    after, its order). Yields the list of the tensors read, for :func:`written`.
    """
    made: list[torch.Tensor] = []
    owners: dict[int, tuple[nn.Module, dict[str, property]]] = {}
    for m, name, t in candidates:
        owners.setdefault(id(m), (m, {}))[1][name] = _reader(name, t.item(), t, made)
    swapped: list[tuple[nn.Module, type, dict[str, Any]]] = []
    try:
        for m, props in owners.values():
            cls = type(m)
            sub = type(cls.__name__, (cls,), {**props, "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__})
            before = dict(m._buffers)
            m.__class__ = sub
            swapped.append((m, cls, before))
            for name in props:
                del m._buffers[name]
        yield made
    finally:
        for m, cls, before in reversed(swapped):
            m.__class__ = cls
            m._buffers.clear()
            m._buffers.update(before)


def written(made: Sequence[torch.Tensor]) -> bool:
    """Whether the traced forward wrote a tensor read from a candidate (in place)."""
    return any(t._version != 0 for t in made)


def read_as_values(ep: torch.export.ExportedProgram, candidates: Sequence[Candidate],
                   model: nn.Module) -> bool:
    """Whether a tensor of more than one element is computed from a folded constant.

    The constants the trace lifted in a module owning a candidate (named
    ``<module path>.lifted_tensor_<k>``; a constant the module's own code made is counted
    too, which only refuses more) are followed through their users: a size (``.item()``,
    a Python number) ends the walk, a tensor of more than one element is a value read.
    """
    from torch.export.graph_signature import InputKind

    paths = {n for n, m in model.named_modules() if any(m is c[0] for c in candidates)}
    owned = {s.arg.name for s in ep.graph_signature.input_specs
             if s.kind == InputKind.CONSTANT_TENSOR and s.target is not None
             and s.target.rpartition(".")[0] in paths}
    todo: list[fx.Node] = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in owned]
    seen: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            val = user.meta.get("val")
            if isinstance(val, torch.Tensor):
                if val.numel() != 1:
                    return True
                todo.append(user)
    return False


def record(candidates: Sequence[Candidate]) -> None:
    """Record the candidates as held by a graph (:data:`SPECIALISED`)."""
    for m, name, _ in candidates:
        SPECIALISED[m] = SPECIALISED.get(m, frozenset()) | {name}


def pinned_names(model: nn.Module) -> frozenset[str]:
    """The qualified names of the buffers of ``model`` a graph holds as constants."""
    return frozenset(f"{path}.{name}" if path else name for path, m in model.named_modules()
                     for name in SPECIALISED.get(m, ()))


def pin_names(model: nn.Module, names: frozenset[str]) -> None:
    """Record the buffers ``names`` of ``model`` (a copy's) as held by a graph."""
    for qualified in names:
        path, _, name = qualified.rpartition(".")
        m = model.get_submodule(path)
        SPECIALISED[m] = SPECIALISED.get(m, frozenset()) | {name}


def is_pinned(module: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` of ``module`` is held by a graph as a constant."""
    return name in SPECIALISED.get(module, ())
