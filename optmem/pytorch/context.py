"""Side inputs: the per-call values that travel beside the chain.

A chain extracted from a graph (:func:`optmem.pytorch.extract.extract_program`) keeps the
calling convention of every stage, ``value -> value`` (a tensor or a tuple of tensors), and
moves everything else a stage reads into the **side inputs** of the call: the model's
inputs (``input_ids``, ``attention_mask``, ``labels``, non-tensor flags) and every value
computed from them without parameters or a differentiable input (position ids, attention
masks, rotary ``cos``/``sin`` tables). Side inputs never require grad and are not
activations of the chain (the profile does not count them).

The protocol, in three steps:

1. The wrapper computes the side inputs once per call (the extraction's side program) and
   makes a :class:`SideInputs` of them.
2. It runs the chain inside ``with side_inputs(ctx):``; a stage reads its side inputs with
   :func:`current_side_inputs` (``ctx[name]``).
3. An executor that runs stages again later (recomputation in the backward pass) captures
   :func:`current_side_inputs_or_none` when the forward starts and re-enters it around each
   re-run, so that two calls in flight (gradient accumulation, micro-batches) never read
   each other's side inputs.

Examples
--------
>>> ctx = SideInputs({"mask": 1})
>>> with side_inputs(ctx):
...     current_side_inputs()["mask"]
1
>>> current_side_inputs_or_none() is None
True
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["SideInputs", "current_side_inputs", "current_side_inputs_or_none", "read_by",
           "side_inputs"]


class SideInputs(Mapping[str, Any]):
    """The side inputs of one call, by name (read-only mapping)."""

    __slots__ = ("_values", "peak_bytes")

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)
        #: the peak of the storages their computation made (temporaries included), when
        #: measured (:func:`optmem.pytorch.wrapper.traced_side_inputs`), else ``None``
        self.peak_bytes: int | None = None

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"SideInputs({', '.join(self._values)})"


_CURRENT: ContextVar[SideInputs | None] = ContextVar("optmem_side_inputs", default=None)


@contextmanager
def side_inputs(ctx: SideInputs | None) -> Iterator[SideInputs | None]:
    """Make ``ctx`` the side inputs of the stages run inside the block (``None``: none)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_side_inputs_or_none() -> SideInputs | None:
    """The side inputs of the running call, or ``None`` outside any call."""
    return _CURRENT.get()


def current_side_inputs() -> SideInputs:
    """The side inputs of the running call.

    Raises
    ------
    RuntimeError
        Outside a call: the stage was run directly, not through its wrapper.
    """
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "this stage reads side inputs (masks, position ids, ...) but was run outside its "
            "wrapper: run it inside `with optmem.pytorch.context.side_inputs(ctx):` with the "
            "SideInputs of the call (Extraction.side_inputs(*args, **kwargs))")
    return ctx


def read_by(ctx: SideInputs | None, stages: Iterable[object]) -> SideInputs | None:
    """The part of ``ctx`` that ``stages`` read, for an executor to keep into the backward.

    Plain autograd keeps a side input (the shifted labels of a loss, a mask) only while a
    node that saved it has not run; an executor that re-runs stages in the backward must
    keep the side inputs those stages read, but no more. Every stage that declares the
    names it reads (``side_names``, as :class:`~optmem.pytorch.graphcut.GraphStage` does)
    narrows the set; one stage that does not keeps the whole context (it may read any name).

    Examples
    --------
    >>> class Reads:
    ...     side_names = ("mask",)
    >>> ctx = SideInputs({"mask": 1, "labels": 2})
    >>> dict(read_by(ctx, [Reads()]))
    {'mask': 1}
    >>> read_by(ctx, [Reads(), object()]) is ctx
    True
    """
    if not ctx:
        return ctx
    names: set[str] = set()
    for stage in stages:
        declared = getattr(stage, "side_names", None)
        if declared is None:
            return ctx
        names.update(declared)
    return SideInputs({n: v for n, v in ctx.items() if n in names})
