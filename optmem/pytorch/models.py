"""Named model factories for ``optmem profile NAME`` (and ``package.module:factory`` specs).

A factory returns an ``nn.Module`` or a ``(module, sample)`` pair. If it has a ``batch``
parameter, the requested batch size is passed. Register one with::

    from optmem.pytorch.models import register_model

    @register_model("my-net", description="what it is")
    def my_net(batch: int = 8):
        ...
        return module, torch.randn(batch, 3, 224, 224)

Importing this module does not import torch: factories import it when called. Modules in
``ZOO_MODULES`` are imported on the first lookup, so a bundled zoo registers itself there.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from optmem.errors import OptmemInputError

__all__ = ["ModelEntry", "ZOO_MODULES", "list_models", "register_model", "resolve_spec"]

Factory = Callable[..., Any]

# Modules whose import registers named models (a bundled zoo adds itself here).
ZOO_MODULES: list[str] = ["optmem.pytorch.toy", "optmem.pytorch.zoo.registry"]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model factory."""

    name: str
    factory: Factory
    description: str = ""


_REGISTRY: dict[str, ModelEntry] = {}
_loaded = False


def register_model(name: str, factory: Factory | None = None, *,
                   description: str = "") -> Any:
    """Register ``factory`` under ``name`` (usable directly or as a decorator)."""

    def deco(fn: Factory) -> Factory:
        doc = description or (inspect.getdoc(fn) or "").split("\n")[0].replace("``", "")
        _REGISTRY[name] = ModelEntry(name, fn, doc)
        return fn

    return deco(factory) if factory is not None else deco


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in ZOO_MODULES:
        if importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod)


def list_models() -> list[ModelEntry]:
    """Every registered model, sorted by name."""
    _load()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _factory_from_spec(spec: str) -> Factory:
    _load()
    if spec in _REGISTRY:
        return _REGISTRY[spec].factory
    if ":" not in spec:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise OptmemInputError(
            f"unknown model {spec!r}: expected a registered name ({known}) or "
            "'package.module:factory'", field="spec")
    mod_name, _, attr = spec.partition(":")
    if not all(part.isidentifier() for part in mod_name.split(".")):
        raise OptmemInputError(f"expected 'package.module:factory', got {spec!r}", field="spec")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise OptmemInputError(f"cannot import {mod_name!r} ({exc})", field="spec") from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise OptmemInputError(f"{mod_name!r} has no attribute {attr!r}", field="spec")
        obj = getattr(obj, part)
    if not callable(obj):
        raise OptmemInputError(f"{spec!r} is not callable", field="spec")
    return obj  # type: ignore[no-any-return]


def resolve_spec(spec: str, *, batch: int | None = None,
                 input_shape: Sequence[int] | None = None,
                 device: str | None = None) -> tuple[Any, Any]:
    """Build ``(module, sample)`` from a registered name or ``package.module:factory``.

    Parameters
    ----------
    spec
        Model name or ``package.module:factory``.
    batch
        Batch size, passed to the factory if it takes ``batch``; also the first dimension of
        the sample built from ``input_shape``.
    input_shape
        Shape of one example (without the batch dimension), used when the factory returns a
        module only.
    device
        ``"meta"`` builds the module and the sample on the meta device (nothing allocated).
    """
    import contextlib

    import torch
    from torch import nn

    factory = _factory_from_spec(spec)
    kwargs: dict[str, Any] = {}
    try:
        signature: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    if batch is not None and signature is not None and "batch" in signature.parameters:
        kwargs["batch"] = batch
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:  # e.g. json:dumps needs its object
            raise OptmemInputError(f"{spec!r} cannot be called as a model factory ({exc}); "
                                   "a factory takes no argument but an optional batch",
                                   field="spec") from None
    ctx = torch.device("meta") if device == "meta" else contextlib.nullcontext()
    with ctx:
        made = _call_factory(spec, factory, kwargs)
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
            module, sample = made
        elif isinstance(made, nn.Module):
            if not input_shape:
                raise OptmemInputError(
                    f"{spec!r} returns a module without a sample: give --input-shape "
                    "(e.g. 3,224,224)", field="input_shape")
            module = made
            sample = torch.randn(batch or 1, *input_shape)
        else:
            raise OptmemInputError(
                f"{spec!r} returned {type(made).__name__}: expected an nn.Module or a "
                "(module, sample) pair", field="spec")
    return module, sample


def _call_factory(spec: str, factory: Any, kwargs: dict[str, Any]) -> Any:
    """``factory(**kwargs)``; its failure is one :class:`OptmemInputError` on ``spec``.

    The error names the exception and the line of the factory's code that raised it (no
    traceback). Running out of memory is re-raised as it is (the callers turn it into a
    hint on the batch size).
    """
    import traceback

    try:
        return factory(**kwargs)
    except OptmemInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory: reported, not a traceback
        if out_of_memory(exc):
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" \
            if frames else ""
        raise OptmemInputError(f"{spec!r} raised {type(exc).__name__}{where}: {exc}",
                               field="spec") from None


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CPU allocator, CUDA or ``MemoryError``)."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in text \
        or "can't allocate memory" in text or "cannot allocate memory" in text
