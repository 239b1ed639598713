"""Memory accounting on any device (CPU and meta included): storages, traces, real peaks.

Three tools, all counting the bytes of *distinct storages* (views share their storage):

* :class:`StorageTrace`, a ``TorchDispatchMode`` that records when every storage created
  while it is active is created and freed (a weak-reference finalizer on the storage). Its
  :meth:`~StorageTrace.peak` is the largest total of such storages alive at once, optionally
  ignoring some (weight gradients). This is how :func:`optmem.pytorch.profile.profile_chain`
  measures the temporaries ``fwd_overhead`` and ``bwd_overhead`` of a stage on CPU and meta,
  where no allocator counter exists, and what :func:`measure_training_peak` replays.
* :class:`ActivationTracker`, hooks only: every tensor autograd saves, every value the
  checkpoint executor holds (reported after each plan op) and pinned tensors. It sees the
  plan's bookkeeping, not the temporaries of kernels.
* :func:`measure_training_peak`: the real activation peak of one training step, from a
  :class:`StorageTrace` of the whole step (exact and time-resolved), and
  :func:`memtracker_peak`, the same step seen by torch's own
  ``torch.distributed._tools.mem_tracker.MemTracker`` (the peak snapshot minus parameters,
  buffers, gradients and optimizer state).

What no tensor-level tool sees: memory a kernel allocates for itself without creating a
tensor (oneDNN scratchpads on CPU; cuDNN/cuBLAS workspaces on CUDA, which the CUDA
allocator statistics do count), and the allocator's own rounding and caching.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optmem.pytorch.hooks import buffers_restored, quiet_gradient_hooks

if TYPE_CHECKING:
    from optmem.chain import Chain

__all__ = ["LOSS_SCALARS", "ActivationTracker", "MemTrackerPeak", "StorageTrace",
           "cuda_training_peak", "live_bytes", "measure_training_peak", "memtracker_peak",
           "backward_roots", "backward_step", "buffers_restored", "gradients_restored",
           "plain_step_peak",
           "input_bytes", "plan_allowance", "storage_bytes", "storage_key"]

# ops whose output is a fresh tensor although it is also their input (``torch.tensor``)
_FRESH_OPS = ("lift_fresh", "lift_fresh_copy")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (shared by views, valid on meta too)."""
    return int(t.untyped_storage()._cdata)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def storage_bytes(value: Any, exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind the tensors of ``value`` (any pytree).

    Storages whose key is in ``exclude`` (parameters, say) are not counted.

    Examples
    --------
    >>> x = torch.zeros(10)
    >>> storage_bytes((x, x[:5], x.view(2, 5)))  # one storage of 10 floats
    40
    """
    seen: dict[int, int] = {}
    for t in _tensors(value):
        key = storage_key(t)
        if key not in exclude:
            seen[key] = _nbytes(t)
    return sum(seen.values())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[start, end)`` of ``t``'s storage that its elements occupy."""
    size = t.element_size()
    if t.numel() == 0:
        return 0, 0
    last = sum(int(n - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride(), strict=True))
    start = int(t.storage_offset()) * size
    return start, start + (last + 1) * size


def input_bytes(value: Any) -> int:
    """Bytes of the call input ``value``: per storage, the part its tensors occupy.

    The chain input ``a^0`` (and a measured step's input) is counted by what its tensors
    hold, not by their whole storages: a view of a larger tensor (``X[:16]`` of a dataset
    held in one tensor) counts its own elements, the rest of the storage being what the
    caller keeps alive (docs/pytorch.md, "What ``memory_limit`` counts"; stop 81: the
    whole storage was counted, and ``memory_limit="60%"`` was taken of a store-all peak
    that held the dataset). A tensor that fills its storage counts it whole, as
    :func:`storage_bytes` does.

    Examples
    --------
    >>> x = torch.zeros(10)
    >>> input_bytes(x), input_bytes(x[:5]), input_bytes((x[:2], x[6:8]))
    (40, 20, 16)
    >>> input_bytes(torch.zeros(4, 3)[:, :2])  # strided: from the first to the last element
    44
    """
    return sum(_occupied(value).values())


def _occupied(value: Any) -> dict[int, int]:
    """Per storage key (:func:`storage_key`), the bytes the tensors of ``value`` occupy."""
    spans: dict[int, list[tuple[int, int]]] = {}
    whole: dict[int, int] = {}
    for t in _tensors(value):
        key = storage_key(t)
        whole[key] = _nbytes(t)
        spans.setdefault(key, []).append(_span(t))
    return {key: min(whole[key], _union(parts)) for key, parts in spans.items()}


def _union(parts: list[tuple[int, int]]) -> int:
    """Length of the union of the intervals ``parts``."""
    total, end = 0, -1
    for a, b in sorted(parts):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def live_bytes(values: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors of ``values``."""
    return storage_bytes(list(values))


# ------------------------------------------------------------------ dispatch-level trace
@dataclass(frozen=True)
class _Sum:
    """How a trace saw a sum ``first + ...`` made (see :meth:`StorageTrace.summed_in_place`).

    Attributes
    ----------
    first
        The record of its first operand.
    event
        The index of the event that created the sum.
    whole
        The operand was not a view, contiguous and its whole storage.
    """

    first: int
    event: int
    whole: bool


class StorageTrace(TorchDispatchMode):
    """Record the creation and the release of every storage an op creates while active.

    Parameters
    ----------
    known
        Storage keys (:func:`storage_key`) that exist already and are never counted. A
        storage that an op returns but also received (in-place ops, views) is not counted
        either: it existed before.
    count_aliases
        Legacy accounting of the zoo's meta profiler (:mod:`optmem.pytorch.shapeprofile`),
        kept so that the bundled zoo chains rebuild byte for byte: count the storage of an
        op's output even when the op received it, unless it is known or already counted
        (a view of a tensor saved in the forward, taken in the backward, then counts as a
        new allocation: an over-estimate).

    Notes
    -----
    A storage is counted from the op that creates it until Python and autograd let go of it
    (a ``weakref.finalize`` on the storage object, which torch keeps unique per storage).
    A storage that grows (``resize_`` through an op) is re-counted at its new size.

    Examples
    --------
    >>> x = torch.randn(1000)
    >>> with StorageTrace() as trace:
    ...     y = (x * 2).exp()        # x * 2 is a temporary, freed once exp ran
    >>> trace.peak(), trace.alive()  # two buffers of 4000 B at once, one left
    (8000, 4000)
    """

    def __init__(self, known: Iterable[int] = (), *, count_aliases: bool = False) -> None:
        super().__init__()
        self.known = set(known)
        self.count_aliases = count_aliases
        self.sizes: list[int] = []
        self.events: list[tuple[int, int]] = []  # (record, +bytes | -bytes)
        self._live: dict[int, int] = {}  # storage key -> record
        self.left_out: set[int] = set()  # records removed from the whole history
        self.sums: dict[int, _Sum] = {}  # record of a sum made with grad mode off -> its making

    def _free(self, key: int, record: int) -> None:
        if self._live.get(key) == record:
            del self._live[key]
        self.events.append((record, -self.sizes[record]))

    def _track(self, t: torch.Tensor, inputs: set[int], fresh: bool) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        key = int(storage._cdata)
        nbytes = int(storage.nbytes())
        record = self._live.get(key)
        if record is not None:
            if not self.count_aliases:
                self._resize(record, nbytes)  # resized in place: count the difference
            return
        if key in self.known or (key in inputs and not fresh and not self.count_aliases):
            return
        self._start(storage, key, nbytes)

    def _resize(self, record: int, nbytes: int) -> None:
        """Record ``record``'s storage at ``nbytes`` from now (the difference as an event)."""
        if nbytes != self.sizes[record]:
            self.events.append((record, nbytes - self.sizes[record]))
            self.sizes[record] = nbytes

    def _start(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> None:
        """Count ``storage`` (``key``) at ``nbytes`` from now until it is freed."""
        record = len(self.sizes)
        self.sizes.append(nbytes)
        self._live[key] = record
        self.events.append((record, nbytes))
        weakref.finalize(storage, self._free, key, record)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in _tensors((args, kwargs)) if _has_storage(t)}
        fresh = func._overloadpacket.__name__ in _FRESH_OPS
        for t in _tensors(out):
            self._track(t, inputs, fresh)
        if func is torch.ops.aten.add.Tensor and not torch.is_grad_enabled():
            self._note_sum(out, args[0])
        return out

    def _note_sum(self, out: Any, first: Any) -> None:
        """Remember that ``out`` is ``first + ...`` (both storages created while active).

        With the event that created ``out`` and whether ``first`` is a tensor autograd may
        sum into in place: not a view, contiguous, its whole storage (a dense tensor in
        another layout is taken as not: the trace then counts a gradient more, not less).
        """
        if not (isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)):
            return
        record, operand = self.record_of(out), self.record_of(first)
        if (record is None or operand is None or record == operand
                or self.events[-1] != (record, self.sizes[record])):
            return  # not a storage this op created
        whole = (not first._is_view() and first.is_contiguous()
                 and first.numel() * first.element_size() == self.sizes[operand])
        self.sums[record] = _Sum(operand, len(self.events) - 1, whole)

    def summed_in_place(self, grads: Iterable[torch.Tensor]) -> set[int]:
        """Records of the storages that autograd, without a mode, sums ``grads`` into.

        Autograd sums the contributions of a tensor used several times (a tied embedding)
        in a buffer: ``old + new``, in place into ``old`` (``add_``) when ``old`` is its
        alone, not a view, dense and its whole storage (taken here as contiguous); so
        every sum after the first goes into the first (its own), and the first into the
        first contribution when that qualifies (an embedding's gradient; not the head's, a
        transposed view of a product): that storage becomes ``.grad``. Under a Python
        dispatch mode (this trace, torch's ``MemTracker``) ATen's ``isTensorSubclassLike``
        is true for every tensor, and autograd makes every sum out of place: one gradient
        more at each sum than the step holds. Walking back from each gradient through the
        sums made with grad mode off, each first operand of the same size that qualifies
        and that the sum frees at once (nothing else holds it) is a storage that, without
        the mode, is the gradient's.

        Parameters
        ----------
        grads
            The parameters' gradients after the step.

        Returns
        -------
        set[int]
            Their records, to leave out as the gradients are (:attr:`left_out`).

        Notes
        -----
        A gradient hook that adds to such a sum out of place (``lambda g: g + x``) looks
        the same, and its operand would be left out too.

        Examples
        --------
        >>> w = torch.randn(10, 4, requires_grad=True)
        >>> ids = torch.tensor([1, 2])
        >>> with StorageTrace() as trace:  # three contributions, all summed into the first
        ...     (w[ids] + w[ids] + w[ids]).sum().backward()
        >>> [trace.sizes[r] for r in sorted(trace.summed_in_place([w.grad]))]
        [160, 160]
        """
        frees = {record: k for k, (record, delta) in enumerate(self.events) if delta < 0}
        found: set[int] = set()
        for t in grads:
            record = self.record_of(t)
            while record is not None:
                record = self._summed_into(record, frees)
                if record is not None:
                    found.add(record)
        return found

    def _summed_into(self, record: int, frees: dict[int, int]) -> int | None:
        """The operand that the sum ``record`` is made into in place without a mode, if any."""
        made = self.sums.get(record)
        if made is None or not made.whole or self.sizes[made.first] != self.sizes[record]:
            return None
        freed = frees.get(made.first)
        if freed is None or freed < made.event:
            return None
        # freed by the sum itself: no storage created between the sum and that release
        if any(delta > 0 for _, delta in self.events[made.event + 1:freed]):
            return None
        return made.first

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Count a ``storage.resize_`` (no op: the dispatch mode does not see it).

        A storage the trace counts is counted at its new size; one it does not know that
        grows from nothing (FSDP2's gathered parameters: storages kept across steps,
        resized to full before a unit runs and to 0 after it) is counted from now on.
        """
        key = int(storage._cdata)
        nbytes = int(storage.nbytes())
        record = self._live.get(key)
        if record is not None:
            self._resize(record, nbytes)
        elif key not in self.known and nbytes > 0:
            self._start(storage, key, nbytes)

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of existing ``tensors`` as alive from now until they are freed.

        For a backward: the saved tensors autograd releases node by node lower the peak.

        Examples
        --------
        >>> saved = [torch.zeros(1000)]
        >>> with StorageTrace() as trace:
        ...     trace.hold(saved)
        ...     saved.clear()            # freed: 4000 B less
        ...     y = torch.ones(1000)
        >>> trace.peak()
        4000
        """
        for t in tensors:
            if _has_storage(t):
                self._track(t, set(), True)

    def alive(self) -> int:
        """Bytes of the storages created while active that are still alive."""
        return sum(self.sizes[r] for r in self._live.values())

    def record_of(self, t: torch.Tensor) -> int | None:
        """The record of ``t``'s storage if the trace created it and it is alive.

        ``None`` for a tensor without a storage (a sparse gradient): the trace counts none.
        """
        if not _has_storage(t):
            return None
        return self._live.get(storage_key(t))

    def leave_out(self, t: torch.Tensor) -> None:
        """Remove ``t``'s storage (created while active, alive now) from the whole history.

        For storages that are not on the measured device although they are on the same
        one (an offload executor's host copies on CPU).
        """
        record = self.record_of(t)
        if record is not None:
            self.left_out.add(record)

    def peak(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Largest total of created storages alive at once, ignoring those of ``exclude``.

        ``exclude`` are tensors alive now (weight gradients, say) whose storages the trace
        created: they are removed from the whole history, as are those of
        :meth:`leave_out`.
        """
        skip = {r for r in (self.record_of(t) for t in exclude) if r is not None}
        skip |= self.left_out
        current = best = 0
        for record, delta in self.events:
            if record not in skip:
                current += delta
                best = max(best, current)
        return best


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


# ------------------------------------------------------------------ real training peaks
def measure_training_peak(step: Callable[[], Any], module: nn.Module,
                          inputs: Any = (), *, host_copies: bool = True) -> int:
    """The exact activation peak of ``step()`` (forward, loss and backward), in bytes.

    A :class:`StorageTrace` of the whole step: the bytes of ``inputs`` plus the largest total
    of storages created during the step and alive at once, leaving out those that are
    parameter gradients at the end (weight gradients are not activations, whenever they
    were created). Parameters, buffers and existing gradients are never counted. Nothing
    is added to the step but a dispatch mode and weak references: lifetimes are unchanged,
    with one exception found in stop 77: under a Python dispatch mode autograd sums the
    gradient contributions of a tensor used several times (a tied embedding) out of place
    (ATen's ``isTensorSubclassLike`` is true for every tensor while a mode is active; a few
    backward formulas branch on it too), where without one it sums into the partial in
    place when that is its own, not a view and dense. Since stop 83 those storages are
    left out as the gradient they become without the mode is
    (:meth:`StorageTrace.summed_in_place`); before, a peak at
    such a sum counted one gradient more than the step holds (tiny BART under
    ``op.offload`` at ``"min"``: 57,736 B, 47,112 B now, and torch's profiler, without a
    mode, sees 47,120, a scalar more; torch's ``MemTracker`` still counts it). A storage
    resized during the step with ``UntypedStorage.resize_`` (FSDP2 gathers a unit's
    parameters into storages it keeps across steps and resizes itself) counts at its size
    from then on; before
    stop 78 such storages were left out, and with them every gathered parameter
    of a sharded step. The sharded gradients of FSDP2 (``DTensor``) are gradients too.

    Parameters
    ----------
    step
        Runs one forward and backward, e.g. ``lambda: loss_fn(model(x)).backward()``. Call
        it with the gradients of ``module`` at ``None`` (``zero_grad()``) to measure what a
        training loop does; no optimizer step inside (its state and temporaries are not
        activations).
    module
        The trained module.
    inputs
        Tensors made before the step that count as activations (the batch ``a^0``).
    host_copies
        Count the host copies of the offload executors
        (:class:`optmem.pytorch.offload.HostCopies`). On CPU they are on the measured
        device; ``False`` leaves them out, which gives the memory an offload plan holds on
        its compute device (what it runs on a GPU).

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    >>> x = torch.randn(32, 64)
    >>> measure_training_peak(lambda: net(x).sum().backward(), net, x)  # 4 x 8 KiB, 2 scalars
    32776
    """
    params = list(module.parameters())
    known = {storage_key(t) for t in (*params, *module.buffers(), *_tensors(inputs))}
    known |= {storage_key(p.grad) for p in params if p.grad is not None}
    trace = StorageTrace(known)
    with trace, _host_copies_left_out(trace, not host_copies), _resizes_counted(trace):
        step()
    # a DTensor's gradient (FSDP2: sharded) is stored in its local tensor
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
    trace.left_out |= trace.summed_in_place(grads)  # autograd's own sums, as without a mode
    return input_bytes(inputs) + trace.peak(exclude=grads)


@contextlib.contextmanager
def _resizes_counted(trace: StorageTrace) -> Iterator[None]:
    """While active, every ``torch.UntypedStorage.resize_`` is counted by ``trace``.

    FSDP2 all-gathers a unit's parameters into storages that it resizes itself
    (``alloc_storage`` / ``free_storage``: ``resize_`` of the storage, which no dispatch
    mode sees; torch's ``MemTracker`` patches it the same way). Without this, a step of
    sharded stages left out every gathered parameter.
    """
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        trace.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _host_copies_left_out(trace: StorageTrace, enabled: bool) -> Iterator[None]:
    """While active, every host copy an offload executor makes is left out of ``trace``."""
    if not enabled:
        yield
        return
    from optmem.pytorch.offload import HostCopies

    HostCopies.observers.append(trace.leave_out)
    try:
        yield
    finally:
        HostCopies.observers.remove(trace.leave_out)


def cuda_training_peak(step: Callable[[], Any], module: nn.Module, inputs: Any = ()) -> int:
    """``torch.cuda.max_memory_allocated`` during ``step()``, as activation bytes (CUDA only).

    The weight gradients are allocated (zeros) before the step, as rotor does, so that the
    peak above the memory allocated at the start (parameters, buffers, gradients, inputs,
    optimizer state, cuBLAS workspaces of earlier steps) is the activations' and the
    temporaries'; ``inputs`` are added back. Compared with the chain model it also counts
    the caching allocator's rounding (512-byte blocks), cuDNN workspaces, and the temporary
    of each in-place gradient accumulation (at most a stage's weights). Run one step
    before measuring, so that one-time allocations are in the base. The statistics are
    those of the device of the module's first CUDA parameter (else of the inputs' first
    CUDA tensor, else the current device): a model on ``cuda:1`` is measured there, not on
    the current device.
    """
    params = list(module.parameters())
    device = next((t.device for t in (*params, *_tensors(inputs)) if t.is_cuda), None)
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base + input_bytes(inputs)


def backward_roots(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Where to start the backward of a model's output, as the chain model does.

    A scalar that requires grad among the output's tensors is the loss: the backward starts
    from it alone (an HF model called with ``labels=`` returns the loss and the logits), with
    seed ``None`` (1). Otherwise every output tensor that requires grad gets an all-ones
    gradient, of the size of ``a^L`` (the chain's ``delta^L`` when the loss is outside the
    chain). Only the roots are returned, so that the rest of the output (the logits beside
    a loss) is freed before the backward, as in ``model(**batch).loss.backward()``.
    """
    outs = [t for t in _tensors(output) if t.requires_grad]
    losses = [t for t in outs if t.dim() == 0]
    if losses:
        return losses, None
    return outs, [torch.ones_like(t) for t in outs]


def backward_step(call: Callable[[], Any]) -> None:
    """One training step: ``call()``, then the backward from :func:`backward_roots`."""
    roots, seeds = backward_roots(call())  # the output itself is dropped here
    if roots:
        torch.autograd.backward(roots, seeds)


@contextlib.contextmanager
def gradients_restored(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Put back the ``.grad`` of every tensor of ``leaves`` on exit (steps measured or timed).

    Their gradient hooks do not run within (:func:`~optmem.pytorch.hooks.quiet_gradient_hooks`):
    the steps are the measurement's, not the training's.
    """
    saved = [t.grad for t in leaves]
    try:
        with quiet_gradient_hooks(leaves):
            yield
    finally:
        for t, g in zip(leaves, saved, strict=True):
            t.grad = g


def plain_step_peak(call: Callable[[], Any], module: nn.Module, inputs: Any = (),
                    steps: int = 2) -> int | None:
    """The real activation peak of the plain model's training step, in bytes.

    ``call()`` runs the model's forward; its output is back-propagated from
    :func:`backward_roots`. The step is measured as :func:`measure_training_peak` does (the
    definition of the real peak everywhere in optmem: the storages created and alive at once,
    weight gradients left out, plus ``inputs``); on CUDA the larger of that and
    :func:`cuda_training_peak` (allocator rounding, cuDNN workspaces). The largest of
    ``steps`` steps is kept (sizes are exact; the first step may allocate once-only
    buffers). The gradients of the parameters and of the inputs that require grad are
    restored afterwards. ``None`` when the step runs out
    of device memory (the plain model does not fit, whatever the limit).
    """
    params = list(module.parameters())
    # the parameters' and the inputs' gradients (an input that requires grad gets one)
    leaves = params + [t for t in _tensors(inputs) if t.is_leaf and t.requires_grad]
    cuda = any(t.is_cuda for t in (*params, *_tensors(inputs)))
    best = 0
    with gradients_restored(leaves):
        try:
            for _ in range(steps):
                for t in leaves:
                    t.grad = None
                best = max(best, measure_training_peak(lambda: backward_step(call), module,
                                                       inputs))
                if cuda:
                    for p in params:
                        p.grad = None
                    best = max(best, cuda_training_peak(lambda: backward_step(call), module,
                                                        inputs))
        except torch.OutOfMemoryError:
            return None
    return best


LOSS_SCALARS = 16
"""Bytes of the loss and its seed gradient (two scalars, float64 at most)."""


def _scratch_peak(ops: Sequence[Any], sizes: dict[int, int]) -> int:
    """The most bytes of scratch buffer copies a plan's re-runs hold at once.

    A re-run stage runs on scratch copies of its buffers (``execute._scratch_buffers``).
    After an ``F_ck`` or ``F_none`` re-run nothing holds them; an ``F_all`` re-run's
    autograd nodes may save them (batch norm saves its running statistics for its
    backward), so they live until the stage's ``B`` frees its tape, and consecutive
    ``F_all`` re-runs (a segment re-run in the backward) hold theirs together.

    Parameters
    ----------
    ops
        The plan's ops (:class:`~optmem.plan.Op`).
    sizes
        Bytes of the buffers of each stage the plan runs more than once.

    Examples
    --------
    >>> from optmem.plan import parse_plan
    >>> plan = parse_plan(["F_ck 1", "F_none 2", "F_all 3", "Loss", "B 3", "F_all 1",
    ...                    "F_all 2", "B 2", "B 1"])
    >>> _scratch_peak(plan, {1: 10, 2: 100})  # F_all 1 and F_all 2 held together
    110
    """
    from optmem.plan import OpKind

    ran: set[int] = set()
    held: dict[int, int] = {}
    peak = 0
    for op in ops:
        i = op.stage
        if op.kind is OpKind.B:
            peak = max(peak, sum(held.values()))  # the tape is freed after B runs
            held.pop(i, None)
        elif op.kind in (OpKind.F_ALL, OpKind.F_CK, OpKind.F_NONE):
            if i in ran and i in sizes:
                # a tape of an earlier run of the stage, if any, is replaced after this one
                peak = max(peak, sum(held.values()) + sizes[i])
                held.pop(i, None)
                if op.kind is OpKind.F_ALL:
                    held[i] = sizes[i]
            ran.add(i)
    return peak


def plan_allowance(chain: Chain, plan: Sequence[Any], stages: Sequence[Any] = (), *,
                   strip_suffix: bool = True, restore_buffers: bool = True) -> int:
    """Bytes a real step may hold beyond the plan's simulated peak (tensor level).

    The chain model frees a value at the op that consumes it; a training step through
    :class:`~optmem.pytorch.execute.CheckpointedChain` holds these things longer, and
    nothing else (``docs/pytorch.md``, "What memory_limit counts"):

    * the gradient of the value where the plan hands over to autograd: autograd keeps a
      ``Function``'s incoming gradient until its backward returns, so ``delta^L`` (or
      ``delta^{j-1}`` when the store-all suffix ``j..L`` runs natively) stays alive during
      the whole backward of the plan, where the model frees it at ``B L`` (``B j-1``);
    * the loss and its seed gradient (:data:`LOSS_SCALARS`), alive until the backward ends;
    * with ``restore_buffers``, scratch copies of the buffers of the stage being re-run,
      those of a stage re-run with ``F_all`` until its ``B`` (its autograd nodes may save
      them: batch norm's saves the running statistics), so several at once when ``F_all``
      re-runs follow each other (:func:`_scratch_peak`); and the copies of every re-run
      stage's buffers taken before its first run (kept for the buffers that run updated,
      until the step ends: a re-run starts from them);
    * the partial gradient of a parameter that several stages use (a tied embedding), from
      the first ``B`` that makes it until the plan's backward returns: each ``B`` hands its
      contribution to autograd (``execute._Release``), which sums them in a buffer that
      becomes ``.grad``, as for the plain model (counted here all the same: an upper
      bound);
    * the last stage's outputs that alias its input (``chain.extra["profile"]
      ["output_left_out"]``, left out of its ``output_size``), when the plan runs that stage
      with ``F_none``, which frees ``a^{L-1}`` in the model while ``a^L`` still holds it.

    And one thing the chain model does not count at all, by design: the side inputs
    (masks, position tables, the targets: computed once per call without gradients, read
    by the stages, alive through the step), with the temporaries of their computation,
    which runs before the chain: ``chain.extra["side_input_peak"]`` (the storages that
    computation made at their peak; ``side_input_bytes``, the side inputs alone, for a
    chain profiled before stop 41). Until stop 41 they were left out, and a model with
    large ones (Gemma 4's rotary tables for its 512-wide global heads) exceeded the bound
    by about their size.

    Parameters
    ----------
    chain, plan
        The profiled chain and the plan (op strings or :class:`~optmem.plan.Op`).
    stages
        The stages (modules or :class:`~optmem.pytorch.extract.Stage`), for their buffers.
    strip_suffix, restore_buffers
        The executor's options.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> chain = Chain.from_lists([1.0] * 3, [1.0] * 3, [100, 200, 300], [100, 200, 300],
    ...                          input_size=50)
    >>> plan = ["F_ck 1", "F_none 2", "F_all 3", "Loss", "B 3", "F_ck 1", "F_all 2", "B 2",
    ...         "F_all 1", "B 1"]
    >>> plan_allowance(chain, plan, strip_suffix=False)  # delta^3 (300 B) + the scalars
    316
    >>> plan_allowance(chain, plan)  # stage 3 runs natively: delta^2 (200 B) is held
    216
    """
    from optmem.plan import OpKind, parse_plan
    from optmem.pytorch.execute import split_suffix

    ops = parse_plan(plan)
    n = chain.length
    j = split_suffix(ops, n)[1] if strip_suffix else n + 1
    held = chain.output_size[j - 2] if j > 1 else 0
    runs: dict[int, int] = {}
    for op in ops:
        if op.kind in (OpKind.F_ALL, OpKind.F_CK, OpKind.F_NONE):
            runs[op.stage] = runs.get(op.stage, 0) + 1
    buffers = tied = 0
    modules = [getattr(s, "module", s) for s in stages]
    if restore_buffers and modules:
        rerun = {i: storage_bytes(list(modules[i - 1].buffers()))
                 for i, c in runs.items() if c > 1}
        # the snapshots taken before first runs, plus the scratch copies held at once
        buffers = sum(rerun.values()) + _scratch_peak(ops, rerun)
    if modules:
        tied = storage_bytes(_shared_parameters(modules))
    aliases = (chain.extra or {}).get("profile", {}).get("output_left_out") or ()
    passed = sum(int(aliases[op.stage - 1]) for op in set(ops)
                 if op.kind is OpKind.F_NONE and op.stage <= len(aliases))
    extra = chain.extra or {}
    side = int(extra.get("side_input_peak", extra.get("side_input_bytes", 0)))
    return held + LOSS_SCALARS + buffers + passed + tied + side


def _shared_parameters(modules: Sequence[Any]) -> list[torch.Tensor]:
    """Parameters (requiring grad) that more than one of ``modules`` uses."""
    users: dict[int, tuple[torch.Tensor, set[int]]] = {}
    for k, m in enumerate(modules):
        for p in m.parameters():
            if p.requires_grad:
                users.setdefault(id(p), (p, set()))[1].add(k)
    return [p for p, who in users.values() if len(who) > 1]


@dataclass(frozen=True)
class MemTrackerPeak:
    """torch's ``MemTracker`` view of one training step (see :func:`memtracker_peak`).

    Attributes
    ----------
    activations
        The peak snapshot's total minus parameters, buffers, gradients and optimizer state.
    snapshot
        That snapshot by kind (``Parameter``, ``Gradient``, ``Activation``, ``Temp``,
        ``Other``, ``Total``, ...), in bytes.
    """

    activations: int
    snapshot: dict[str, int] = field(default_factory=dict)


_PERSISTENT_KINDS = ("Parameter", "Buffer", "Gradient", "Optstate")


def memtracker_peak(step: Callable[[], Any], module: nn.Module,
                    inputs: Any = ()) -> MemTrackerPeak:
    """Measure ``step()`` with ``torch.distributed._tools.mem_tracker.MemTracker``.

    The recipe of ``shared/design/torch-notes.md``: track the module and the inputs, run the
    step, take the ``"peak"`` snapshot and subtract parameters, buffers, gradients and
    optimizer state. Three differences from :func:`measure_training_peak`, which is exact:
    the subtraction happens at the moment the *total* peaked (gradients grow during the
    backward, so activations may have peaked elsewhere); a weight gradient is labelled
    ``Temp`` from the op that computes it until autograd's hook relabels it ``Gradient``;
    and MemTracker's module tracker registers gradient hooks on every module's inputs that
    keep gradients alive longer in nested (re-entrant) backward calls, as the checkpoint
    executor makes, so the step it measures holds more memory than the unobserved step.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    >>> x = torch.randn(32, 64)
    >>> mt = memtracker_peak(lambda: net(x).sum().backward(), net, x)
    >>> mt.activations > 0 and mt.snapshot["Parameter"] == 4 * (64 * 64 + 64 + 64 + 1)
    True
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, *_tensors(inputs))
    with tracker:
        step()
    snap = {str(getattr(k, "value", k)): int(v)
            for dev in tracker.get_tracker_snapshot("peak").values() for k, v in dev.items()}
    persistent = sum(v for k, v in snap.items() if k in _PERSISTENT_KINDS)
    return MemTrackerPeak(snap.get("Total", 0) - persistent, snap)


# ------------------------------------------------------------------ hook-based tracker
class _Packed:
    """A saved tensor; its lifetime is the lifetime of the saved-tensor slot."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationTracker:
    """Context manager measuring the peak of live activation bytes, through hooks.

    Counts every tensor autograd saves for the backward (``saved_tensors_hooks``; a saved
    tensor is live from its pack until autograd releases it), parameters and buffers
    excluded; every value the checkpoint executor keeps (checkpoints ``a^i``, tapes and,
    unless ``gradients=False``, the current gradient ``delta^i``), reported by
    :func:`optmem.pytorch.execute.add_monitor` after each op; and the ``pinned`` tensors.
    Temporaries that autograd does not save (the output of an op consumed at once) are not
    seen: :func:`measure_training_peak` sees them.

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
        self.pinned = _occupied(list(pinned))  # counted as an input is (:func:`input_bytes`)
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
        # detached: a saved output's grad_fn holds ``packed``, a cycle through C++ nodes
        # that Python's collector never frees (a graph dropped without a backward)
        packed = _Packed(t.detach())
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
        from optmem.pytorch.execute import add_monitor

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        add_monitor(self._on_op)
        self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        from optmem.pytorch.execute import remove_monitor

        remove_monitor(self._on_op)
        self._hooks.__exit__(*exc)
        self._hooks = None
