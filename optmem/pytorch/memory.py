"""Activation memory tracking on any device (CPU included), through hooks.

:class:`ActivationTracker` counts the bytes of the *distinct storages* that hold
activations during a training step:

* every tensor autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``:
  a saved tensor is live from its pack until autograd releases it, after its backward or
  when the graph is dropped), parameters and buffers excluded;
* every value the checkpoint executor keeps (checkpoints ``a^i``, tapes and, unless
  ``gradients=False``, the current gradient ``delta^i``), reported by
  :func:`optmem.pytorch.execute.add_monitor` after each op;
* tensors pinned by the caller (the batch ``a^0``).

The running total is sampled at every pack and after every executor op; ``peak_bytes`` is its
maximum. Temporaries that autograd does not save (workspace of a convolution, the output of
an op consumed at once) are not seen: that is what ``fwd_overhead``/``bwd_overhead`` model,
and they are 0 on CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from optmem.pytorch.execute import add_monitor, remove_monitor
from optmem.pytorch.extract import value_tensors
from optmem.pytorch.profile import storage_key

__all__ = ["ActivationTracker"]


class _Packed:
    """A saved tensor; its lifetime is the lifetime of the saved-tensor slot."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationTracker:
    """Context manager measuring the peak of live activation bytes.

    Parameters
    ----------
    module
        Its parameters and buffers are not activations and are excluded.
    pinned
        Tensors counted as live the whole time (typically the input batch).
    gradients
        Count the activation gradient the executor holds between ops. Plain autograd's
        gradient buffers are invisible to hooks, so set it to ``False`` to compare a plan
        with code that does not run through the executor on an equal footing.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> x = torch.randn(16, 4)
    >>> with ActivationTracker(net, pinned=[x]) as tracker:
    ...     net(x).sum().backward()
    >>> tracker.peak_bytes  # x (256 B) + ReLU output saved twice (one storage, 512 B)
    768
    """

    def __init__(self, module: nn.Module | None = None,
                 pinned: Iterable[torch.Tensor] = (), *, gradients: bool = True) -> None:
        self.gradients = gradients
        self.excluded: set[int] = set()
        if module is not None:
            self.excluded |= {storage_key(p) for p in module.parameters()}
            self.excluded |= {storage_key(b) for b in module.buffers()}
        self.pinned = {storage_key(t): _nbytes(t) for t in pinned}
        self.saved: dict[int, list[int]] = {}  # key -> [nbytes, live count]
        self.executor: dict[int, int] = {}
        self.peak_bytes = 0
        self.samples = 0
        self._hooks: Any = None

    # -------------------------------------------------------------- accounting
    def current_bytes(self) -> int:
        """Bytes of the distinct live storages now."""
        live = dict(self.pinned)
        live.update(self.executor)
        for key, (nbytes, count) in self.saved.items():
            if count > 0:
                live[key] = nbytes
        return sum(live.values())

    def _sample(self) -> None:
        self.samples += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes())

    def _pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key in self.excluded:
            return t
        entry = self.saved.setdefault(key, [_nbytes(t), 0])
        entry[1] += 1
        packed = _Packed(t)
        weakref.finalize(packed, self._release, key)
        self._sample()
        return packed

    def _release(self, key: int) -> None:
        entry = self.saved.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self.saved[key]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _on_op(self, op: str, live: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        if self.gradients:
            live = live + grads
        self.executor = {storage_key(t): _nbytes(t) for t in live
                         if storage_key(t) not in self.excluded}
        self._sample()

    # -------------------------------------------------------------- context
    def __enter__(self) -> ActivationTracker:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        add_monitor(self._on_op)
        self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        remove_monitor(self._on_op)
        self._hooks.__exit__(*exc)
        self._hooks = None


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def live_bytes(values: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors of ``values``."""
    seen: dict[int, int] = {}
    for v in values:
        for t in value_tensors(v):
            seen[storage_key(t)] = _nbytes(t)
    return sum(seen.values())
