"""A module that trains another one by following a plan, and keeps its face.

:class:`PlannedModule` wraps a model (``self.module``) and runs it as a chain of stages
(:mod:`optmem.pytorch.extract`) with an executor (checkpointing, offloading, both). To the
rest of PyTorch it is the model itself:

* **call signature and output**: ``cmodel(*args, **kwargs)`` takes what the model takes
  (positional or keyword, ``attention_mask=``, ``labels=``, ...) and returns what it
  returns (a ``ModelOutput`` with ``.logits``, and ``.loss`` when ``labels=`` is given);
* **state**: ``state_dict()`` has the model's keys and ``load_state_dict`` takes them (a
  state-dict post-hook strips the wrapper's prefix, a load pre-hook puts it back, as
  PyTorch's ``checkpoint_wrapper`` does), and reports missing and unexpected keys under
  the model's names (:meth:`PlannedModule.load_state_dict`);
  ``named_parameters()``/``named_buffers()`` give the model's names; parameters and
  buffers are the model's own objects;
* **attributes** missing on the wrapper are looked up on the model (``cmodel.config``);
* **modes**: ``train()``/``eval()`` reach the model; under ``torch.no_grad()`` or
  ``torch.inference_mode()`` the model runs as it is (nothing to save for a backward),
  compiled as on the fast path when the wrapper is (:meth:`PlannedModule.compile`, or
  ``torch.compile(cmodel)``);
* **autograd**: ``retain_graph=True`` and ``create_graph=True`` give the model's gradients
  (such a backward runs above the plan's limit: :mod:`optmem.pytorch.execute`); under a
  ``torch.func`` transform, or with a forward-mode AD dual tensor among the inputs or
  parameters (a checkpoint or remat + offload plan has no ``jvp``), or, for an offload or
  remat + offload plan, inside ``torch.autograd.graph.disable_saved_tensors_hooks``, the
  model runs as it is, with one warning per wrapper (:data:`FUNCTORCH_WARNING`,
  :data:`FORWARD_AD_WARNING`, :data:`SAVED_TENSORS_WARNING`);
* **the store-all fast path**: when the plain model's real activation peak, measured while
  profiling (``chain.extra["profile"]["plain_peak"]``), is at most the memory limit, the
  model itself is called, no executor and no stages (``fast_path=False`` turns it off;
  :attr:`PlannedModule.fast_path_taken`).

**Specialisation.** An exported chain is specialised to the call it was extracted from:
shapes, dtypes, flags, which keyword arguments are given, ``training``, the autocast state,
which inputs require grad, each input tensor's memory layout (:func:`memory_layout`), the
dtypes and devices of the model's parameters and buffers, which of them require grad (what
a step stores depends on it: :meth:`TensorState.grads`), and what the graph traced of the
model: their shapes, which are tied, the module tree, its hooks and training modes, every
dropout's ``p`` and the plain Python attributes the forward reads (:class:`TensorState`).
A call with another *signature* is extracted again (about a second), profiled again (sizes
only when its stages match the first chain's: its times are scaled from the first profile;
in full otherwise) and solved again with the same limit and method; the last
:data:`MAX_VARIANTS` signatures are kept. Models given as an ``nn.Sequential`` or a list of
stages are not specialised (no graph): their plans follow the input's sizes as below
(*Sizes*), with the sample's plan as the first solved size, and which input tensors and
parameters require grad is their signature (a call that differs there is profiled and
solved on its own).

**Sizes** (``dynamic=True``, the default). Calls that differ from a known signature in
tensor sizes only (another sequence length, a smaller last batch) form a *family*. At the
first such call the model is exported once more with the dimensions that changed dynamic
(``torch.export``'s ``Dim.AUTO``, :func:`~optmem.pytorch.extract.export_dynamic`), and that
graph runs every later call of the family it accepts (the ranges and equalities export
recorded, checked as ``ExportedProgram.module()`` checks them): no export per size. Each
size is profiled and solved once, except that a call whose dynamic sizes are each at most
:data:`SIZE_SLACK` times smaller than a solved size runs that size's plan: every tensor of
its step is no larger, so its peak is no higher than the plan's (memory-safe; the plan may
recompute more than the call needs). When export specialises the sizes or fails, each size
is exported again, as with ``dynamic=False``. A new size is profiled and solved by the rank
that makes the call, not by rank 0 for every rank (data-parallel ranks see different lengths
at one step; their gradients do not depend on the plan). Not under FSDP2.

**Value branches.** A forward that branches on a tensor's value (a check on the labels,
``if mask.any():``) is exported with the sample's side of each branch, asserted at every
call (:mod:`optmem.pytorch.branches`). A call whose *input* values take another side fails
those assertions before any stage runs; it runs the plan of an earlier call of its
signature whose assertions it meets, or is extracted, profiled and solved on its own
values (by the rank that makes it) and kept beside the first. If that extraction fails (the
model raises on these values: labels out of range), the call runs the model itself, which
raises its own error; after :data:`MAX_BRANCH_FAILURES` such failures a plan stops trying.
Under FSDP2 a call taking another side raises the assertion's ``RuntimeError``, naming the
model's line. A branch on an intermediate value (``if (hidden > 100).any():``) is refused
at extraction (:class:`~optmem.pytorch.branches.IntermediateBranch`): its assertion would
fail mid-step. One is held instead: HuggingFace's overflow guard in float32 or bfloat16
(:mod:`optmem.pytorch.overflow_guards`), as the unconditional clamp it equals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import inspect
import logging
import operator
import sysconfig
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_map_only
from torch.utils.hooks import RemovableHandle

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.pytorch.branches import is_value_branch_error
from optmem.pytorch.constants import (
    candidate_buffers,
    is_candidate,
    is_pinned,
    pin_names,
    pinned_names,
)
from optmem.pytorch.constants import tracked as constants_tracked
from optmem.pytorch.context import SideInputs, side_inputs
from optmem.pytorch.custom_functions import live_namespaces
from optmem.pytorch.execute import (
    CompileRequest,
    autocast_modes,
    compile_options_for,
    run_compiled,
    run_in_order,
)
from optmem.pytorch.extract import (
    Extraction,
    Stage,
    export_dynamic,
    extract_program,
    extract_stages,
    flattened_containers,
    is_plain_sequential,
    merge_stages,
    value_tensors,
)
from optmem.pytorch.hooks import (
    callers_tools_suspended,
    cuda_indices,
    generators_restored,
    module_generators,
    parameters_unmodified,
    saved_tensors_hooks_disabled,
    warn_container_hooks,
)
from optmem.pytorch.memory import buffers_restored, gradients_restored, storage_bytes
from optmem.pytorch.observers import (
    ObserverPlan,
    call_with_root_hooks,
    has_root_hooks,
    observers_silenced,
    observing,
    root_hooks_suspended,
    user_global_hooks,
    warn_global_hooks,
)
from optmem.pytorch.planning import Planner, refuse_second_copies
from optmem.result import Result, Status
from optmem.units import format_size, memory_percent

__all__ = ["MAX_VARIANTS", "PLAIN_PEAK", "USE_CACHE_WARNING", "PlannedModule", "ProfileOptions",
           "extracted_call", "leaves_no_trace", "memory_layout", "plan_stages",
           "with_plain_peak"]

MAX_VARIANTS = 8
MAX_BRANCH_FAILURES = 3
"""Failed extractions of other sides of value branches after which a variant stops trying
(its calls that take other sides then run the model itself; *Value branches*)."""
MAX_SIZE_VARIANTS = 32
"""Plans kept per family of calls that differ in tensor sizes only (see *Sizes*)."""
SIZE_SLACK = 1.25
"""A plan solved for sizes at most this factor above a call's runs that call (*Sizes*)."""
PLAIN_PEAK = "plain_peak"
"""Key of the plain model's measured real activation peak in ``chain.extra["profile"]``."""
USE_CACHE_WARNING = (
    "use_cache=True is incompatible with optmem's plan (as with gradient checkpointing): "
    "setting use_cache=False, the output has no generation cache; call the model under "
    "torch.no_grad() (or cmodel.generate) for one")
"""The warning of a call with grad enabled that asks for a generation cache."""
_PREFIX = "_checkpoint_wrapped_module."
"""The model's attribute in the wrapper, and its keys' prefix there. The name is that of
torch's own checkpoint wrapper (``checkpoint_wrapper._CHECKPOINT_PREFIX``), which torch's
state-dict helpers (``torch.distributed.checkpoint.state_dict``, FSDP) and accelerate strip:
``get_optimizer_state_dict(DistributedDataParallel(wrapper), opt)`` names the model's keys.
Until stop 77 it was ``_optmem_module``, which they kept there."""

_EXPORT_ROOT = "_export_root"
"""The name ``torch.export``'s non-strict trace gives the module it exports (its own
module holds it as that attribute; ``torch.export._trace``)."""
_log = logging.getLogger("optmem")
PEFT_ON_WRAPPER = (
    "peft was applied to the optmem wrapper ({cls}): peft finds its adapters by the "
    "modules' names, which the wrapper gives under '_checkpoint_wrapped_module.' and its "
    "parameters and state dict under the model's, so no adapter would train or be saved. "
    "Apply peft to the model, then wrap the result: "
    "{fn}(peft.get_peft_model(model, config), sample, ...). The model now holds the "
    "adapters peft injected (and its own weights frozen): build it again")
"""The error of ``peft.get_peft_model(cmodel, ...)`` (stop 81): raised when peft sets
``peft_config`` on the wrapper, after injecting its layers into the model."""


@dataclass
class ProfileOptions:
    """How chains are profiled (:func:`~optmem.pytorch.profile.profile_stages`)."""

    device: str | None = None
    repeats: int = 3
    warmup: int = 1
    progress: bool | None = None
    time_model: Any = None
    max_stages: int | None = None
    extract: str = "auto"
    dynamic: bool = True  # calls that differ in sizes share one export (module doc, *Sizes*)
    op_overhead: float | None = None  # ms per F op (None: profile.DEFAULT_OP_OVERHEAD_MS)
    op_overhead_ratio: float | None = None  # per F op, x its fwd (None: profile's default)
    measure_segments: bool | None = None  # segment cost: None constant, True measure, False 0
    segment_timer: Any = None  # its clock, timer(fn) -> ms (None: the profiler's)
    # what the profile does not see but the plan must count: (stages, chain) -> chain
    # (FSDP2's gathered parameters: optmem.pytorch.distributed.fsdp_chain)
    adjust_chain: Callable[[Sequence[Stage], Chain], Chain] | None = None
    # values carried up to the loss counted once (checkpoint plans); False: in every boundary
    # holding them (offload plans move boundaries whole; pipelines send them between GPUs)
    share_carried: bool = True


@dataclass
class _Family:
    """Calls that differ from a known signature in tensor sizes only (module doc, *Sizes*)."""

    reference: tuple[tuple[int, ...] | None, ...]  # per input leaf: its shape (None: no tensor)
    dims: frozenset[tuple[int, int]] = frozenset()  # (leaf, dim) exported dynamic
    extraction: Extraction | None = None  # the graph exported with ``dims`` dynamic
    refused: set[frozenset[tuple[int, int]]] = field(default_factory=set)  # dims export
    # specialised or failed on: calls that need them are exported one by one
    variants: OrderedDict[tuple[tuple[int, ...] | None, ...], _Variant] = field(
        default_factory=OrderedDict)  # solved sizes -> their plan

    def keep(self, sizes: tuple[tuple[int, ...] | None, ...], variant: _Variant) -> None:
        """Record the plan solved at ``sizes`` (the last :data:`MAX_SIZE_VARIANTS` kept)."""
        self.variants[sizes] = variant
        while len(self.variants) > MAX_SIZE_VARIANTS:
            self.variants.popitem(last=False)

    def covering(self, sizes: tuple[tuple[int, ...] | None, ...]) -> _Variant | None:
        """The plan of the smallest solved sizes that run ``sizes`` within :data:`SIZE_SLACK`."""
        best: tuple[int, tuple[tuple[int, ...] | None, ...]] | None = None
        for have in self.variants:
            if covers(have, sizes, self.dims):
                total = sum(_dim_size(have, leaf, d) for leaf, d in self.dims)
                if best is None or total < best[0]:
                    best = (total, have)
        if best is None:
            return None
        self.variants.move_to_end(best[1])
        return self.variants[best[1]]


def _dim_size(sizes: tuple[tuple[int, ...] | None, ...], leaf: int, dim: int) -> int:
    shape = sizes[leaf]
    assert shape is not None, "a dynamic dimension is a tensor's"
    return shape[dim]


def covers(have: tuple[tuple[int, ...] | None, ...], want: tuple[tuple[int, ...] | None, ...],
           dims: frozenset[tuple[int, int]]) -> bool:
    """A plan solved at sizes ``have`` runs a call of sizes ``want`` (module doc, *Sizes*).

    Every dynamic size of ``want`` is at most the one of ``have`` and at least
    ``1 / SIZE_SLACK`` of it; the other sizes are equal.

    >>> covers(((2, 100),), ((2, 90),), frozenset({(0, 1)}))
    True
    >>> covers(((2, 100),), ((2, 101),), frozenset({(0, 1)}))
    False
    >>> covers(((2, 100),), ((2, 70),), frozenset({(0, 1)}))
    False
    """
    for leaf, (h, w) in enumerate(zip(have, want, strict=True)):
        if h is None or w is None:
            if h != w:
                return False
            continue
        for d, (a, b) in enumerate(zip(h, w, strict=True)):
            if (leaf, d) in dims:
                if not b <= a <= SIZE_SLACK * b:
                    return False
            elif a != b:
                return False
    return True


@contextmanager
def _for_sizes(sizes: tuple[tuple[int, ...] | None, ...],
               reference: tuple[tuple[int, ...] | None, ...]) -> Iterator[None]:
    """Name the call's sizes in an input error raised while planning them.

    A byte limit the wrapping sample met may be too small for a larger batch or a longer
    sequence: the error says which call it was.
    """
    try:
        yield
    except OptmemInputError as exc:
        shapes = ", ".join(str(list(s)) for s in sizes if s is not None)
        sample = ", ".join(str(list(s)) for s in reference if s is not None)
        raise OptmemInputError(f"{exc.reason} (for a call with input sizes {shapes}; the "
                               f"sample's were {sample})", source=exc.source,
                               stage=exc.stage, field=exc.field) from None


@contextmanager
def _for_signature(key: Any, reference: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any], hint: str = "") -> Iterator[None]:
    """Name how a call differs from the sample in an input error raised while planning it.

    A limit the sample met may not hold for a call whose input requires grad where the
    sample's did not (its gradient is then stored and computed too): the error says so.
    ``hint`` (:func:`percentage_hint`) is added to an error on the memory limit.
    """
    try:
        yield
    except OptmemInputError as exc:
        raise OptmemInputError(
            f"{exc.reason} (for a call that differs from the sample in "
            f"{signature_difference(key, reference, args, kwargs)})"
            f"{hint if exc.field == 'memory_limit' else ''}", source=exc.source,
            stage=exc.stage, field=exc.field) from None


def percentage_hint(memory_limit: Any, sample_limit: int | None) -> str:
    """What to pass instead when a percentage limit has no plan for a new signature.

    A percentage is of each signature's own store-all peak, so a call that needs less
    than the sample (parameters frozen after wrapping: 60 % of a smaller peak) may get a
    limit below what its plans need, where the plain model trains (stop 83: tiny GPT-2
    under ``op.offload`` at ``"60%"``, frozen embedding and first block: 60 % of the frozen
    step's 320,768 B has no plan, the smallest is 197,394 B, the sample's plan had
    209,664 B).

    Examples
    --------
    >>> percentage_hint("60%", 1000).split(": ")[1]
    "pass memory_limit in bytes (the sample's plan"
    >>> percentage_hint("2GiB", 1000)
    ''
    """
    if sample_limit is None or memory_percent(memory_limit) is None:
        return ""
    return (f"; a percentage limit is of each call signature's own store-all peak: pass "
            f"memory_limit in bytes (the sample's plan: {sample_limit} B) to keep one budget "
            "for every call")


def _grad_free(key: Any) -> Any:
    """An :func:`input_key` with every tensor's ``requires_grad`` left out."""
    return (key[0], tuple(p[:4] if p[0] == "T" else p for p in key[1]))


@contextmanager
def _for_input_grad(key: Any, reference: Any, hint: str = "") -> Iterator[None]:
    """Name the inputs whose ``requires_grad`` differs from the sample's in an input error.

    :func:`_for_signature` for an ``nn.Sequential`` or a list of stages (``key`` and
    ``reference``: :func:`input_key` of the call and of the sample, each followed by
    :meth:`TensorState.grads`, which parameters require grad, also named when they differ;
    ``hint`` as there).
    """
    try:
        yield
    except OptmemInputError as exc:
        parts, parts0 = key[1], reference[1]
        what = [f"{'x' if len(parts) == 1 else f'x leaf {i}'} requires_grad ({new[4]}, the "
                f"sample {old[4]})" for i, (new, old) in enumerate(zip(parts, parts0, strict=True))
                if new[0] == old[0] == "T" and new[4] != old[4]]
        if key[2] != reference[2]:
            what.append(_grads_difference(key[2], reference[2]))
        raise OptmemInputError(f"{exc.reason} (for a call that differs from the sample in "
                               f"{'; '.join(what)})"
                               f"{hint if exc.field == 'memory_limit' else ''}",
                               source=exc.source, stage=exc.stage, field=exc.field) from None


_TENSOR_FIELDS = ("sizes", "dtype", "device", "requires_grad", "memory layout")
"""The fields of a tensor's entry in :func:`signature_key`, after its tag."""


def signature_difference(key: Any, reference: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> str:
    """How :func:`signature_key` ``key`` differs from ``reference``, in words.

    ``args``, ``kwargs``: the call of ``key`` (the names of its inputs).

    Examples
    --------
    >>> m = nn.Linear(2, 2)
    >>> x = torch.zeros(3, 2)
    >>> old = signature_key(m, (x,), {})
    >>> new = signature_key(m, (x.requires_grad_(),), {})
    >>> signature_difference(new, old, (x,), {})
    'args[0] requires_grad (True, the sample False)'
    """
    spec, parts, training, autocast, tensors = key
    spec0, parts0, training0, autocast0, tensors0 = reference
    what: list[str] = []
    if spec != spec0 or len(parts) != len(parts0):
        what.append("which arguments are given")
    else:
        paths = [_argument_name(path) for path, _ in tree_flatten_with_path(
            (args, dict(sorted(kwargs.items()))))[0]]
        for name, new, old in zip(paths, parts, parts0, strict=True):
            if new[0] == old[0] == "T":
                what += [f"{name} {field} ({a}, the sample {b})" for field, a, b
                         in zip(_TENSOR_FIELDS, new[1:], old[1:], strict=True) if a != b]
            elif new != old:
                what.append(f"{name}'s value")
    if training != training0:
        what.append(f"training {training} (the sample {training0})")
    if autocast != autocast0:
        what.append("autocast")
    if tensors != tensors0:
        what.append(_tensor_state_difference(tensors, tensors0))
    return "; ".join(what) or "nothing optmem records"


def _tensor_state_difference(tensors: Any, reference: Any) -> str:
    """How two :meth:`TensorState.key` differ, in words (``None``: not recorded)."""
    if tensors is not None and reference is not None and tensors[:-1] == reference[:-1]:
        return _grads_difference(tensors[-1], reference[-1])
    return ("the model's parameters or buffers (dtypes, devices or structure), its hooks or "
            "the Python attributes its forward reads")


def _grads_difference(grads: int, reference: int) -> str:
    """Name how the model's tensors that require grad differ from the sample's (bit sets)."""
    more, fewer = bin(grads & ~reference).count("1"), bin(reference & ~grads).count("1")
    return (f"which parameters require grad ({more} more and {fewer} fewer than for the "
            "sample)")


def _argument_name(path: tuple[Any, ...]) -> str:
    """``args[0]``, ``input_ids``, ``pixel_values[1]``: a leaf of ``(args, kwargs)``."""
    first, *rest = path
    head = f"args{rest[0]}" if first.idx == 0 and rest else ""
    if first.idx == 1 and rest:
        head = str(getattr(rest[0], "key", rest[0]))
    return head + "".join(str(k) for k in rest[1:])


def input_key(x: Any) -> Any:
    """The sizes, dtypes and devices of the tensors in ``x``, as :func:`signature_key` has them.

    For an ``nn.Sequential`` or a list of stages, whose one input is ``x``.
    """
    leaves, spec = tree_flatten(x)
    return (repr(spec), tuple(("T", tuple(v.shape), v.dtype, str(v.device),
                               bool(v.requires_grad)) if isinstance(v, torch.Tensor)
                              else ("V", type(v).__name__) for v in leaves))


def call_sizes(key: Any) -> tuple[tuple[int, ...] | None, ...]:
    """The tensor shapes of a :func:`signature_key`, per input leaf (``None``: no tensor)."""
    return tuple(p[1] if p[0] == "T" else None for p in key[1])


def size_free(key: Any) -> Any:
    """A :func:`signature_key` with each tensor's shape replaced by its rank (its family)."""
    parts = tuple(("T", len(p[1]), *p[2:]) if p[0] == "T" else p for p in key[1])
    return (key[0], parts, *key[2:])


def sharded_call_advice(key: Any, reference: Any) -> str:
    """What to do about a call of an FSDP2-sharded wrapper that differs from its sample's.

    Parameters
    ----------
    key, reference
        The :func:`signature_key` of the call and of the sample.

    Returns
    -------
    str
        To pad when the sizes alone differ; else to make the sample's call as the training
        calls are made. Before (stop 77) every difference was told to pad, a call under
        ``torch.autocast`` included, which no padding fixes.
    """
    if size_free(key) == size_free(reference):
        return "pad to the sample's sizes (or wrap again with a sample of these)"
    return ("wrap the model with a sample called as the training calls are (inside the same "
            "torch.autocast, train/eval mode and arguments), or call it as the sample was")


def changed_dims(a: tuple[tuple[int, ...] | None, ...],
                 b: tuple[tuple[int, ...] | None, ...]) -> frozenset[tuple[int, int]]:
    """The ``(leaf, dim)`` whose sizes differ between two calls of one family."""
    return frozenset((leaf, d) for leaf, (x, y) in enumerate(zip(a, b, strict=True))
                     if x is not None and y is not None
                     for d, (u, v) in enumerate(zip(x, y, strict=True)) if u != v)


@dataclass
class _Variant:
    """One specialisation: stages, their profile, the plan and its executor."""

    extraction: Extraction | None
    stages: list[Stage]
    groups: list[tuple[int, int]] | None  # how fine stages were merged (max_stages)
    fine_names: tuple[str, ...]
    chain: Chain
    result: Result
    executor: nn.Module
    limit: int | None = None  # the memory limit (bytes) the plan was solved for, if any
    # the same call with other sides of value branches (*Value branches*), newest last
    branches: list[_Variant] = field(default_factory=list)
    branch_failures: int = 0  # calls of other sides whose extraction failed

    @property
    def plain_peak(self) -> int | None:
        """The plain model's measured real activation peak (bytes), if it was measured."""
        peak = ((self.chain.extra or {}).get("profile") or {}).get(PLAIN_PEAK)
        return None if peak is None else int(peak)

    def plain_fits(self) -> bool:
        """The plain model's own step fits the limit (the store-all fast path applies)."""
        peak = self.plain_peak
        return self.limit is not None and peak is not None and peak <= self.limit


GIVEN_SOURCE = "use_plan"
"""``report["source"]`` of a result that runs a plan given by ``use_plan``."""


@dataclass
class GivenPlan:
    """A checkpoint plan given by ``use_plan``: kept on the chains extracted later.

    ``stages``: the number of stages of the chain it was given for; ``limit``: the memory
    limit (bytes) it is run under, if any; ``warned``: whether a re-extraction dropped it
    (one warning per given plan).
    """

    plan: tuple[str, ...]
    method: str
    stages: int
    limit: int | None
    warned: bool = False

    def result(self, chain: Chain) -> Result:
        """The plan replayed on ``chain``.

        Raises :class:`OptmemInputError` if ``chain`` has another number of stages, or the
        plan does not replay on it (within :attr:`limit`, when set), or it copies a value
        the chain counts once (:func:`~optmem.pytorch.planning.refuse_second_copies`).
        """
        from optmem.simulate import simulate_checkpoint

        if chain.length != self.stages:
            raise OptmemInputError(f"it is for {self.stages} stages and the model now has "
                                   f"{chain.length}", field="plan")
        sim = simulate_checkpoint(chain, self.plan, self.limit)
        refuse_second_copies(chain, self.plan, "the given plan")
        return Result("checkpoint", self.method, Status.FEASIBLE, objective=sim.makespan,
                      plan=self.plan, peak_memory=sim.peak_memory, memory_limit=None, unit=1,
                      report={"source": GIVEN_SOURCE})

    def solve(self, planner: Planner, name: str) -> Callable[[Chain], Result]:
        """What solves a re-extracted chain: this plan if it replays on it, else ``planner``.

        The first time the plan is dropped, one :class:`UserWarning` says why.
        """

        def solve(chain: Chain) -> Result:
            try:
                return self.result(chain)
            except OptmemInputError as exc:
                if not self.warned:
                    self.warned = True
                    warnings.warn(f"optmem: {name} was extracted again (the model or the "
                                  f"call changed); the plan given by use_plan() is dropped "
                                  f"for the planner's ({planner.method}): {exc}",
                                  UserWarning, stacklevel=2)
                return planner.solve(chain)

        return solve


def is_plain_chain(module: Any) -> bool:
    """Modules run as they are: an ``nn.Sequential`` (flattened) or a list of stages."""
    from optmem.pytorch.extract import is_plain_sequential

    if isinstance(module, Sequence) and not isinstance(module, nn.Module):
        return True
    return isinstance(module, nn.Module) and is_plain_sequential(module)


def call_of(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample as a call ``(args, kwargs)``.

    A tensor is one argument, a tuple the positional arguments, a dict (any mapping, such
    as the ``BatchEncoding`` a HuggingFace tokenizer returns) the keyword arguments.
    """
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


@contextmanager
def _side_buffers(stages: Sequence[Stage], ctx: SideInputs) -> Iterator[None]:
    """Show the side tensors to the profiler as buffers of every stage.

    The profiler counts what autograd saves, minus parameters, buffers and the stage input;
    side inputs (masks, rotary tables) are allocated once per call, not by the stage: they
    must not be counted as its activations. Each storage is shown once, as a flat byte
    tensor on the same storage.
    """
    holders = []
    storages: dict[int, torch.Tensor] = {}
    for value in ctx.values():
        for t in value_tensors(value):
            key = t.untyped_storage()._cdata
            if key not in storages:
                flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                storages[key] = flat.set_(t.untyped_storage())
    for st in stages:
        holder = nn.Module()
        for k, flat in enumerate(storages.values()):
            holder.register_buffer(f"side{k}", flat, persistent=False)
        st.module.add_module("_optmem_side", holder)
        holders.append(st.module)
    try:
        yield
    finally:
        for m in holders:
            del m._modules["_optmem_side"]


def _size(b: int) -> str:
    return f"{format_size(b)} ({b} B)"


def _model_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict's ``_metadata`` (per module: its version) under the model's names.

    The wrapper's ``state_dict()`` keeps the metadata of its own tree (``""`` the
    wrapper, ``"_checkpoint_wrapped_module"`` the model); a plain model's is kept as it is.
    """
    root = _PREFIX[:-1]
    if root not in metadata:
        return dict(metadata)
    return {("" if k == root else k[len(_PREFIX):]): v for k, v in metadata.items()
            if k == root or k.startswith(_PREFIX)}


def _replace_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


_CHECKPOINT_ONLY = ("resolve", "use_plan")
"""Methods of ``CheckpointedModule`` alone (named when another wrapper is asked for them)."""


class PlannedModule(nn.Module):
    """A model trained by following a plan; behaves like the model (see the module doc)."""

    #: whether the plan composes with forward-mode AD (dual tensors); when not, such a
    #: call runs the model as it is (:data:`FORWARD_AD_WARNING`)
    _plan_has_jvp: bool = False
    #: whether the plan packs the tensors autograd saves (``saved_tensors_hooks``); when it
    #: does, a call where the caller disabled such hooks runs the model as it is
    #: (:data:`SAVED_TENSORS_WARNING`)
    _plan_packs_saved_tensors: bool = False
    #: the one-liner that builds this wrapper (named in errors)
    _one_liner: str = "op.checkpoint"

    def __init__(self, module: nn.Module, planner: Planner, profile: ProfileOptions,
                 main: _Variant, main_key: Any, *, fast_path: bool = True) -> None:
        super().__init__()
        self.fast_path = fast_path
        self._checkpoint_wrapped_module = module
        # torch.export reads the non-persistent buffers of the module it exports from that
        # module's own set and its submodules' (under the wrapper's attribute): listed here
        # too, under the names named_buffers gives them, they stay out of its state dict
        self._non_persistent_buffers_set.update(non_persistent_buffers(module))
        self._planner = planner
        self._profile = profile
        self._variants: OrderedDict[Any, _Variant] = OrderedDict([(main_key, main)])
        self._main_key = main_key
        self._families: OrderedDict[Any, _Family] = OrderedDict()  # size-free key -> family
        self._sized: OrderedDict[Any, _Variant] = OrderedDict()  # call key -> family plan
        self._compile_options: dict[str, Any] | None = None
        self._compiled_module: Callable[..., Any] | None = None
        self._compiled_module_with: dict[str, Any] | None = None
        self._plain = main.extraction is None
        self._plain_stages: list[Stage] = []  # an nn.Sequential's or a list's stages
        # the nn.Sequential containers of those stages: their own hooks are not called
        self._containers = flattened_containers(module) if self._plain and \
            is_plain_sequential(module) else []
        self._container_hooks = RemovableHandle.next_id  # warned up to this registration
        self._signature = None if self._plain else inspect.signature(module.forward)
        self._tensor_state = TensorState(module, attributes=not self._plain)
        if main.extraction is not None:
            self._tensor_state.watch(main.extraction.observers)
        self._given: GivenPlan | None = None
        if not self._plain:
            self.forward = _SignedForward(self)  # type: ignore[method-assign]
        self.register_state_dict_post_hook(PlannedModule._strip_prefix)
        self.register_load_state_dict_pre_hook(PlannedModule._add_prefix)
        self.register_load_state_dict_post_hook(PlannedModule._strip_reported)

    # -------------------------------------------------------------- construction
    @classmethod
    def build(cls, module: Any, sample: Any, planner: Planner, profile: ProfileOptions, *,
              chain: Chain | None = None, name: str | None = None,
              fast_path: bool = True) -> PlannedModule:
        """Extract, profile, solve and wrap ``module`` (``sample``: one batch or call).

        ``sample`` holds no graph of the caller's (:func:`graph_free`: the one-liners'
        :func:`~optmem.pytorch.api.build_planned` makes it so before calling this).

        ``fast_path``: call the model itself when its measured plain step fits the limit
        (:attr:`fast_path_taken`).
        """
        refuse_wrapped(module, "optmem")
        if is_plain_chain(module):
            from optmem.pytorch.profile import merge_inplace_writers, model_name

            if is_plain_sequential(module):
                warn_container_hooks(flattened_containers(module))

            wrapped = module if isinstance(module, nn.Module) else nn.ModuleList(
                [s.module if isinstance(s, Stage) else s for s in module])
            with parameters_unmodified(wrapped):  # its dry run calls the stages
                stages = merge_inplace_writers(extract_stages(module), sample, profile.device)
            label = name or model_name(module)
            variant = _make_variant(None, stages, sample, planner, profile, chain, label,
                                    ctx=None, like=None,
                                    plain=_plain_measure(stages, sample, profile),
                                    unmodified=wrapped)
            planned = cls(wrapped, planner, profile, variant,
                          (*input_key(sample), TensorState(wrapped).key()[-1]),
                          fast_path=fast_path)
            planned._plain_stages = stages
            return planned
        if not isinstance(module, nn.Module):
            raise OptmemInputError(f"expected an nn.Module or a list of modules, got "
                                   f"{type(module).__name__}", field="module")
        args, kwargs = canonical_call(module, *call_of(sample))
        key = signature_key(module, args, kwargs, TensorState(module).key())
        variant = _extract_variant(module, args, kwargs, planner, profile, chain,
                                   name or type(module).__name__, like=None)
        return cls(module, planner, profile, variant, key, fast_path=fast_path)

    # -------------------------------------------------------------- face of the model
    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        return self._checkpoint_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_checkpoint_wrapped_module":
                raise
            try:
                return getattr(self._checkpoint_wrapped_module, name)
            except AttributeError:
                if name in _CHECKPOINT_ONLY:  # it blamed the model (a hunt in stop 51)
                    raise AttributeError(
                        f"{type(self).__name__} has no {name}(): it is a method of the "
                        "checkpoint wrapper (op.checkpoint); to plan again, call this "
                        "one-liner again (with chain= to skip the profile)") from None
                raise

    def __setattr__(self, name: str, value: Any) -> None:
        """Set an attribute of the wrapper; refuse peft's (:data:`PEFT_ON_WRAPPER`)."""
        if name == "peft_config":
            raise OptmemInputError(PEFT_ON_WRAPPER.format(
                cls=type(self).__name__, fn=self._one_liner), field="module")
        super().__setattr__(name, value)

    def __getitem__(self, key: Any) -> Any:
        return self._checkpoint_wrapped_module[key]  # type: ignore[index]

    def __len__(self) -> int:
        """The model's length (an ``nn.Sequential``'s layers); ``TypeError`` as the model's."""
        return len(self._checkpoint_wrapped_module)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        """Iterates as the model does (an ``nn.Sequential``'s layers)."""
        return iter(self._checkpoint_wrapped_module)  # type: ignore[call-overload]

    def __bool__(self) -> bool:
        """Always true, as a module (``__len__`` must not decide it, nor raise)."""
        return True

    def _get_name(self) -> str:
        """The model's name (``_get_name()``; a PEFT model's: its base model's).

        HuggingFace's ``Trainer`` shifts the labels of its label smoothing only when this
        name is a causal language model's (of a ``PeftModel``: its base model's); the
        wrapper's own class name made it smooth unshifted labels in silence (stop 83).
        ``repr`` still names the wrapper.
        """
        return inspected_model(self._checkpoint_wrapped_module)._get_name()

    def __repr__(self) -> str:
        """The module's ``repr`` headed by the wrapper's class, not the model's name."""
        return type(self).__name__ + super().__repr__()[len(self._get_name()):]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters, under the model's names."""
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, "", 1), p

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """The wrapper, then the model's modules under ``_checkpoint_wrapped_module.``.

        Except in ``torch.export``'s non-strict trace of the wrapper itself, which reads
        the parameters of the module it exports through a module of its own (the wrapper
        as its ``_export_root``): the model's modules under the wrapper's name there, so
        that those parameter names are :meth:`named_parameters`'s, as its other reads.
        """
        if prefix != _EXPORT_ROOT or not torch.compiler.is_exporting():
            yield from super().named_modules(memo, prefix, remove_duplicate)
            return
        memo = set() if memo is None else memo
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self._checkpoint_wrapped_module.named_modules(memo, prefix, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's buffers, under the model's names."""
        for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, "", 1), b

    @staticmethod
    def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any) -> None:
        _replace_prefix(state_dict, prefix + _PREFIX, prefix)

    @staticmethod
    def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                    *args: Any) -> None:
        if any(k.startswith(prefix + _PREFIX) for k in state_dict):
            return  # already the wrapper's own keys
        _replace_prefix(state_dict, prefix, prefix + _PREFIX)

    @staticmethod
    def _strip_reported(module: nn.Module, keys: Any) -> None:
        """The missing and unexpected keys of a load under the model's names (in place).

        Also when a parent loads its state and this wrapper is one of its parts.
        """
        for found in (keys.missing_keys, keys.unexpected_keys):
            found[:] = [k.replace(_PREFIX, "", 1) for k in found]

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """The model's ``load_state_dict``: its result and errors name the model's keys.

        The model loads ``state_dict`` itself (keys with the wrapper's prefix are taken
        too), so that its missing and unexpected keys, and the error of ``strict``, are
        those of the plain model. With load hooks registered on the wrapper, the wrapper
        loads it through them (the reported keys are still the model's).
        """
        if len(self._load_state_dict_pre_hooks) != 1 or \
                len(self._load_state_dict_post_hooks) != 1:  # others than the wrapper's
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        own: OrderedDict[str, Any] = OrderedDict(state_dict)
        _replace_prefix(own, _PREFIX, "")
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            own._metadata = _model_metadata(metadata)  # type: ignore[attr-defined]
        return self._checkpoint_wrapped_module.load_state_dict(own, strict=strict, assign=assign)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to()``/``cuda()``/``half()``: the model, and the stages' constants with it."""
        super()._apply(fn, recurse)
        seen: set[int] = set()
        for v in self._all_variants():
            ext = v.extraction
            if ext is not None and id(ext) not in seen:  # a family's plans share its stages
                seen.add(id(ext))
                for st in ext.stages:
                    st.module._apply(fn)
                ext.side._apply(fn)
                ext.rebind()
        return self

    def _all_variants(self) -> list[_Variant]:
        """Every plan kept: the signatures' and the size families' (each once)."""
        out = {id(v): v for v in self._variants.values()}
        for family in self._families.values():
            out.update((id(v), v) for v in family.variants.values())
        out.update((id(v), v) for v in self._sized.values())
        return list(out.values())

    def _percentage_hint(self, frozen_only: bool) -> str:
        """:func:`percentage_hint`, for a call that differs only in frozen parameters.

        ``frozen_only``: the call differs from the sample only in which parameters require
        grad (a step that freezes more stores less than the sample's).
        """
        return percentage_hint(self._planner.memory_limit, self._main.limit) \
            if frozen_only else ""

    # -------------------------------------------------------------- the main plan
    @property
    def _main(self) -> _Variant:
        return self._variants[self._main_key]

    @property
    def executor(self) -> nn.Module:
        """The executor of the main plan (the sample's signature)."""
        return self._main.executor

    @property
    def stages(self) -> nn.ModuleList:
        """The stage modules of the main plan."""
        return self._main.executor.stages  # type: ignore[return-value]

    @property
    def stage_names(self) -> list[str]:
        """The stage names of the main plan."""
        return [s.name for s in self._main.stages]

    @property
    def chain(self) -> Chain:
        """The profiled chain of the main plan (bytes, milliseconds)."""
        return self._main.chain

    @property
    def result(self) -> Result:
        """The solver's result for the main plan."""
        return self._main.result

    @property
    def plan(self) -> tuple[Any, ...]:
        """The plan the executor runs."""
        return self._main.executor.plan  # type: ignore[return-value]

    @property
    def extraction(self) -> Extraction | None:
        """How the model was cut (``None`` for an ``nn.Sequential`` or a list of stages)."""
        return self._main.extraction

    @property
    def variants(self) -> list[tuple[str, ...]]:
        """Stage names of every signature seen (the main one first)."""
        return [tuple(s.name for s in v.stages) for v in self._variants.values()]

    def _set_result(self, result: Result, plan: Sequence[Any] | None = None,
                    limit: int | None = None, given: bool = False) -> None:
        """Run ``result``'s plan (or ``plan``) on the main signature.

        ``given``: the plan comes from ``use_plan``; the signatures extracted later run it
        too when it replays on their chains (:class:`GivenPlan`); otherwise they are solved.
        """
        main = self._main
        main.result = result
        main.limit = limit
        self._given = GivenPlan(tuple(str(p) for p in (plan or result.plan)), result.method,
                                main.chain.length, limit) if given else None
        main.executor.set_plan(list(plan if plan is not None else result.plan))  # type: ignore[operator]
        for key in [k for k in self._variants if k != self._main_key]:
            del self._variants[key]  # re-derived from the new policy when called again
        self._sized.clear()
        for family in self._families.values():
            family.variants.clear()

    # -------------------------------------------------------------- compile
    def compile(self, *args: Any, **options: Any) -> None:
        """Compile every stage (``torch.compile(stage, **options)``).

        The plan itself runs in Python. Calls that run the model itself (the store-all
        fast path, ``no_grad``) run it compiled with these options. ``torch.compile(cmodel,
        ...)`` compiles the stages too, with these options; if this was never called, with
        that enclosing compile's backend and ``dynamic=``
        (:func:`~optmem.pytorch.execute.run_compiled`).
        ``torch.compile(cmodel, fullgraph=True)`` cannot hold (the plan is a graph break);
        ``cmodel.compile(fullgraph=True)`` compiles each stage as one graph.
        """
        if args:
            raise TypeError("PlannedModule.compile takes keyword options only")
        self._compile_options = dict(options)
        self._compiled_module = None
        for v in self._all_variants():
            _compile_executor(v.executor, self._compile_options)

    # -------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - see the class doc
        if deployment_trace_active():  # what is deployed is the model's own graph
            return self._checkpoint_wrapped_module(*args, **kwargs)
        if torch.compiler.is_compiling():
            return run_compiled(_forward_disabled, self, args, kwargs)
        return self._forward(args, kwargs, None)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 compiled: CompileRequest) -> Any:
        model = self._checkpoint_wrapped_module
        transformed = self._runs_as_it_is(args, kwargs)
        if self._plain:
            if RemovableHandle.next_id != self._container_hooks:  # a hook was registered
                self._container_hooks = RemovableHandle.next_id
                warn_container_hooks(self._containers)
            if kwargs or len(args) != 1:
                raise TypeError(f"{type(model).__name__} takes one input (a tensor or a "
                                f"tuple of tensors), got {len(args)} positional and "
                                f"{len(kwargs)} keyword arguments")
            variant = self._main if transformed else self._plain_variant(args[0])
            executor = variant.executor
            if transformed or self._fast(variant):  # the stages in order: the model's
                return run_in_order(executor.stage_functions(compiled), args[0])  # type: ignore[operator]
            return _run_executor(executor, args[0], compiled)
        absorbing = self._tensor_state.absorbing  # the model's Python runs (what it writes)
        if transformed:
            with absorbing():
                return model(*args, **kwargs)
        if not torch.is_grad_enabled():  # nothing to save: the model, compiled if asked
            self._refuse_sharded_stages_without_grad()
            with absorbing():
                return self._module_call(compiled)(*args, **kwargs)
        given = args, kwargs
        args, kwargs = canonical_call(model, args, kwargs, self._signature)
        variant = self._variant(args, kwargs)
        if self._fast(variant):
            with absorbing():
                return self._module_call(compiled)(*args, **kwargs)
        if _global_forward_hooks or _global_forward_pre_hooks:
            ext = variant.extraction
            warn_global_hooks(self.__dict__.setdefault("_global_hooks_warned", set()),
                              {k for k, _ in ext.observers.global_modifiers} if ext else ())
        if has_root_hooks(model):  # called here, around the plan, as the model's call does
            return call_with_root_hooks(model, *given, lambda a, k: self._planned(
                args, kwargs, compiled, variant) if a is given[0] and k is given[1]
                else self._planned(a, k, compiled, None))
        return self._planned(args, kwargs, compiled, variant)

    def _planned(self, args: tuple[Any, ...], kwargs: dict[str, Any], compiled: CompileRequest,
                 variant: _Variant | None) -> Any:
        """The call run by the plan of ``variant`` (``None``: of its signature's).

        The model's own forward hooks are not called (:meth:`_forward` calls them around
        this): with new arguments from a pre-hook, the store-all fast path calls the model
        without them.
        """
        model = self._checkpoint_wrapped_module
        absorbing = self._tensor_state.absorbing
        if variant is None:
            args, kwargs = canonical_call(model, args, kwargs, self._signature)
            variant = self._variant(args, kwargs)
            if self._fast(variant):
                with absorbing(), root_hooks_suspended(model):
                    return self._module_call(compiled)(*args, **kwargs)
        sides = _side_inputs(variant, args, kwargs)
        if isinstance(sides, RuntimeError):  # another side of a value branch
            if self._sharded():
                raise sides  # every rank must run the stages FSDP2 sharded: it says why
            found = self._branch_variant(variant, args, kwargs)
            if found is None:  # the model's own way for these values (its error, if any)
                with absorbing(), root_hooks_suspended(model):  # (called around)
                    return model(*args, **kwargs)
            variant, sides = found
        flat, ctx = sides
        ext = variant.extraction
        assert ext is not None
        with side_inputs(ctx), observing(ext.observers, ctx):
            out = _run_executor(variant.executor, ext.chain_input(flat), compiled)
        ext.seeded.replay()  # the host generators the model seeds, left as its call leaves them
        return ext.output.assemble(out, ctx)

    def _branch_variant(self, variant: _Variant, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[_Variant, tuple[list[Any], SideInputs]] | None:
        """The plan of a call whose input values take another side of a value branch.

        ``variant``'s side-input program asserts the sample's side of every branch that
        reads inputs only (*Value branches*), before any stage runs. The call runs the
        first plan extracted for the same signature whose assertions its values meet;
        otherwise it is extracted on its own values (by this rank: ranks see different
        batches), profiled and solved, and kept (the last :data:`MAX_VARIANTS`). ``None``
        when that extraction fails: the call then runs the model itself, which takes
        the branch its own way (and raises its own error on invalid input, such as labels
        out of range).
        """
        for other in reversed(variant.branches):
            sides = _side_inputs(other, args, kwargs)
            if not isinstance(sides, RuntimeError):
                return other, sides
        if variant.branch_failures >= MAX_BRANCH_FAILURES:
            return None
        name = type(self._checkpoint_wrapped_module).__name__
        _log.info("optmem: %s called with values that take another side of a branch: "
                  "extracting, profiling and solving them", name)
        try:
            other = self._new_variant(args, kwargs, None, local=True)
        except Exception as exc:
            # optmem's error, or the model's own on these values (:func:`extracted_call`): a
            # failed extraction either way, counted; the model then runs the call itself
            if not isinstance(exc, OptmemInputError) and not getattr(exc, _PLAIN_ERROR, False):
                raise
            variant.branch_failures += 1
            _log.info("optmem: %s runs this call itself (%s)%s", name, exc,
                      "; later calls of other sides too, without trying to extract them"
                      if variant.branch_failures >= MAX_BRANCH_FAILURES else "")
            return None
        variant.branches.append(other)
        del variant.branches[:-MAX_VARIANTS]
        sides = _side_inputs(other, args, kwargs)
        if isinstance(sides, RuntimeError):  # extracted on these very values: never
            raise sides
        return other, sides

    def _runs_as_it_is(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call runs the model as it is, with one warning per wrapper and reason.

        Under a ``torch.func`` transform, (for a plan run by an autograd Function, which
        has no ``jvp``) when a forward-mode AD dual tensor is among the call's tensors or the
        model's parameters and buffers, and (for a plan that moves saved tensors with
        ``saved_tensors_hooks``) with grad inside the caller's
        ``torch.autograd.graph.disable_saved_tensors_hooks`` region.
        """
        if functorch_transform_active():
            reason = FUNCTORCH_WARNING
        elif not self._plan_has_jvp and dual_tensors_in(self._checkpoint_wrapped_module,
                                                        (args, kwargs)):
            reason = FORWARD_AD_WARNING
        elif self._plan_packs_saved_tensors and torch.is_grad_enabled() \
                and saved_tensors_hooks_disabled():
            reason = SAVED_TENSORS_WARNING
        else:
            return False
        warned = self.__dict__.setdefault("_plain_run_warned", set())
        if reason not in warned:
            warned.add(reason)
            warnings.warn(reason, stacklevel=4)
        return True

    # -------------------------------------------------------------- store-all fast path
    def _fast(self, variant: _Variant) -> bool:
        return self.fast_path and variant.plain_fits()

    @property
    def fast_path_taken(self) -> bool:
        """The main signature calls the model itself (no executor, no stages).

        True when :attr:`fast_path` is on and the plain model's measured real activation
        peak (``chain.extra["profile"]["plain_peak"]``) is at most the memory limit the plan
        was solved for; a plan given by :meth:`use_plan` without a limit never takes it.
        """
        return self._fast(self._main)

    def _module_call(self, compiled: CompileRequest) -> Callable[..., Any]:
        """The model, or the model compiled (``compiled``, or ``None`` after :meth:`compile`).

        Compiled with the options of :meth:`compile` if it was called, else with those of
        the enclosing ``torch.compile`` (``compiled`` a dict), else default ones.
        """
        options = compile_options_for(compiled, self._compile_options)
        if options is None:
            return self._checkpoint_wrapped_module
        if self._compiled_module is None or self._compiled_module_with != options:
            self._compiled_module = torch.compile(self._checkpoint_wrapped_module, **options)
            self._compiled_module_with = dict(options)
        return self._compiled_module

    def _variant(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Variant:
        key = signature_key(self._checkpoint_wrapped_module, args, kwargs, self._tensor_state.key())
        variant = self._variants.get(key)
        if variant is not None:
            self._variants.move_to_end(key)
            return variant
        variant = self._sized.get(key)
        if variant is not None:
            self._sized.move_to_end(key)
            return variant
        resized = False  # a size-only change of a known signature: decided by this rank
        if self._dynamic_sizes():
            variant = self._family_variant(key, args, kwargs)
            if variant is not None:
                return self._remember(key, variant)
            resized = size_free(key) in self._families
        if self._sharded():  # the stages hold DTensors: nothing can be exported again
            if not self._plain:  # the model's own modules sharded: their hooks never run
                from optmem.pytorch.process_groups import refuse_modules_sharded_after

                refuse_modules_sharded_after(self._checkpoint_wrapped_module)
            main = self._main_key
            if key[:4] == main[:4] and key[4][:-1] == main[4][:-1]:
                # only which parameters require grad differs: the executor follows it at
                # run time, on the sample's profile (as before stop 52; not re-planned)
                return self._main
            raise OptmemInputError(
                f"{type(self._checkpoint_wrapped_module).__name__} is sharded by FSDP2 "
                "(checkpoint_fsdp), so every call keeps the sample's signature; this call "
                "differs in " + signature_difference(key, self._main_key, args, kwargs)
                + ": " + sharded_call_advice(key, self._main_key), field="sample")
        _log.info("optmem: new call signature for %s: extracting, profiling and solving "
                  "again", type(self._checkpoint_wrapped_module).__name__)
        main = self._main_key
        frozen_only = key[:4] == main[:4] and None not in (key[4], main[4]) and \
            key[4][:-1] == main[4][:-1]
        with _for_signature(key, main, args, kwargs, self._percentage_hint(frozen_only)):
            variant = self._new_variant(args, kwargs, None, local=resized)
        return self._keep_signature(key, variant, plain=False)

    def _refuse_sharded_stages_without_grad(self) -> None:
        """Raise one clear error for a call without gradients when FSDP2 shards the stages.

        Without gradients the wrapper runs the exported model itself, whose parameters are
        then the stage units' shards (``DTensor``), which no FSDP hook gathers there: the
        call failed inside torch ("aten.embedding.default got mixed torch.Tensor and
        DTensor", stop 77).

        Raises
        ------
        OptmemInputError
            When the main plan's stages are FSDP2 units (``checkpoint_fsdp``).
        """
        from optmem.pytorch.process_groups import is_fsdp_module

        if any(is_fsdp_module(st.module) for st in self._main.stages):
            raise OptmemInputError(
                f"{type(self._checkpoint_wrapped_module).__name__}'s stages are sharded by FSDP2 "
                "(checkpoint_fsdp), and under torch.no_grad() the wrapper runs the model "
                "itself, which would read the stages' shards: evaluate with gradients "
                "enabled, called as the sample was (train mode), or load the full weights "
                "(get_model_state_dict with StateDictOptions(full_state_dict=True)) into an "
                "unsharded copy of the model", field="call")

    def _dynamic_sizes(self) -> bool:
        """Whether calls of new sizes form families (*Sizes*).

        They do with ``dynamic``, for an exported model not sharded by FSDP2 (its stages are
        sharded for the sample's graph, and every rank must run one plan: new sizes are
        extracted as new signatures there).
        """
        if not self._profile.dynamic or self._plain or self._profile.adjust_chain is not None:
            return False
        return not self._sharded()

    def _sharded(self) -> bool:
        """Whether FSDP2 shards the model or the main plan's stages."""
        from optmem.pytorch.process_groups import is_fsdp_module

        return is_fsdp_module(self._checkpoint_wrapped_module) or any(
            is_fsdp_module(st.module) for st in self._main.stages)

    def _plain_variant(self, x: Any) -> _Variant:
        """The plan of an ``nn.Sequential`` or a list of stages for input ``x`` (*Sizes*).

        Their stages run any size, so the sample's plan (the main one) runs every input of
        its sizes or up to :data:`SIZE_SLACK` times smaller; another size (a larger batch,
        which the sample's plan would run over the limit) is profiled and solved once, by
        this rank. Which input tensors require grad is part of the signature, as for an
        exported model: a call that differs from the sample there (its input's gradient
        is computed too, with the temporaries of the first stage's backward) is profiled
        and solved on its own, and its sizes follow from it in the same way. Without
        ``dynamic``, that signature's first plan runs all its sizes; without gradients or
        for inputs of another structure, dtype or device, the main plan runs, as before.
        """
        if not torch.is_grad_enabled():
            return self._main
        key = (*input_key(x), self._tensor_state.key()[-1])
        variant = self._variants.get(key)
        if variant is not None:
            self._variants.move_to_end(key)
            return variant
        known = next((k for k in self._variants if size_free(k) == size_free(key)), None)
        if known is None:
            if _grad_free(size_free(key)) != _grad_free(size_free(self._main_key)):
                return self._main  # another structure, dtype or device: as before
            return self._plain_signature(key, x)
        if not self._profile.dynamic:
            return self._variants[known]
        variant = self._sized.get(key)
        if variant is not None:
            self._sized.move_to_end(key)
            return variant
        family_key = size_free(key)
        family = self._families.get(family_key)
        if family is None:
            family = self._families[family_key] = _Family(call_sizes(known))
        sizes = call_sizes(key)
        family.dims |= changed_dims(family.reference, sizes)
        variant = family.covering(sizes)
        if variant is None and covers(family.reference, sizes, family.dims):
            variant = self._variants[known]
        if variant is None:
            _log.info("optmem: %s called with new sizes: profiling and solving them",
                      self._main.chain.name)
            with _for_sizes(sizes, family.reference):
                variant = self._plain_plan(x, local=True)
            family.keep(sizes, variant)
        return self._remember(key, variant)

    def _plain_signature(self, key: Any, x: Any) -> _Variant:
        """Profile and solve an input whose tensors' ``requires_grad`` differ from the sample's.

        Kept beside the main plan (the last :data:`MAX_VARIANTS` signatures) and decided by
        rank 0 for every rank, as a new signature of an exported model is.
        """
        _log.info("optmem: new call signature for %s: profiling and solving again",
                  self._main.chain.name)
        with _for_input_grad(key, self._main_key,
                             self._percentage_hint(key[:2] == self._main_key[:2])):
            variant = self._plain_plan(x, local=False)
        return self._keep_signature(key, variant, plain=True)

    def _keep_signature(self, key: Any, variant: _Variant, *, plain: bool) -> _Variant:
        """Keep ``variant`` for signature ``key`` beside the main plan (the last few).

        ``plain`` (an ``nn.Sequential``'s signature): the size family of ``key`` and of an
        evicted signature go too, since they grow from that signature's plan; an exported
        model's families hold their own dynamic export and are bounded where they are made
        (:meth:`_family_variant`), so they stay.
        """
        if plain:
            self._families.pop(size_free(key), None)  # sizes of a signature solved before
        self._variants[key] = variant
        while len(self._variants) > MAX_VARIANTS:
            oldest = next(k for k in self._variants if k != self._main_key)
            del self._variants[oldest]
            if plain:
                self._families.pop(size_free(oldest), None)
        return variant

    def _plain_plan(self, x: Any, *, local: bool) -> _Variant:
        """Profile and solve the plain stages on input ``x``.

        ``local``: by this rank alone (a new size, *Sizes*); otherwise by rank 0 for every
        rank, as a new signature of an exported model.
        """
        from optmem.pytorch.process_groups import refuse_profile_in_static_graph_start

        refuse_profile_in_static_graph_start(self._main.chain.name)
        free = graph_free(x)
        return self._finished(_make_variant(
            None, self._plain_stages, free, self._planner, self._profile, None,
            self._main.chain.name, ctx=None, like=self._main,
            plain=_plain_measure(self._plain_stages, free, self._profile),
            solve=self._solver(), local=local))

    def _remember(self, key: Any, variant: _Variant) -> _Variant:
        """Run ``variant`` for every later call of ``key`` (the last ones kept)."""
        self._sized[key] = variant
        while len(self._sized) > 8 * MAX_SIZE_VARIANTS:
            self._sized.popitem(last=False)
        return variant

    def _solver(self) -> Callable[[Chain], Result] | None:
        """How a new chain is solved: ``use_plan``'s plan when given, else the planner."""
        given = self._given
        return None if given is None else given.solve(self._planner, self._main.chain.name)

    def _finished(self, variant: _Variant) -> _Variant:
        """A new plan under ``use_plan``'s limit and ``compile``'s options, if any."""
        given = self._given
        if given is not None and variant.result.report.get("source") == GIVEN_SOURCE:
            variant.limit = given.limit  # as use_plan's (None: never the fast path)
        if self._compile_options is not None:
            _compile_executor(variant.executor, self._compile_options)
        if variant.extraction is not None:
            self._tensor_state.watch(variant.extraction.observers)
        return variant

    def _new_variant(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                     ext: Extraction | None, *, local: bool = False) -> _Variant:
        """Extract (unless ``ext`` is given), profile and solve one call.

        ``local``: profiled and solved by this rank alone, not by rank 0 for every rank (a new
        size: ranks of data-parallel training see different lengths at the same step, and
        gradients do not depend on the plan; see *Sizes*).
        """
        from optmem.pytorch.process_groups import refuse_profile_in_static_graph_start

        refuse_profile_in_static_graph_start(type(self._checkpoint_wrapped_module).__name__)
        args, kwargs = graph_free((args, kwargs))  # a call made inside the caller's graph
        with self._tensor_state.absorbing():  # extraction and profiling run the model
            variant = _extract_variant(
                self._checkpoint_wrapped_module, args, kwargs, self._planner, self._profile, None,
                self._main.chain.name, like=self._main, solve=self._solver(), ext=ext,
                local=local)
        return self._finished(variant)

    def _family_variant(self, key: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> _Variant | None:
        """The plan of a call that differs from a known one in sizes only (*Sizes*).

        ``None``: no such known call, or the sizes cannot share one export (the caller
        extracts the call on its own).
        """
        family_key = size_free(key)
        sizes = call_sizes(key)
        family = self._families.get(family_key)
        if family is None:
            known = next((k for k in reversed(self._variants) if size_free(k) == family_key),
                         None)
            if known is None:
                return None  # the first call of this kind: no size has changed yet
            family = self._families[family_key] = _Family(call_sizes(known))
            while len(self._families) > MAX_VARIANTS:
                self._families.popitem(last=False)
        ext = family.extraction
        dims = family.dims | changed_dims(family.reference, sizes)
        if ext is None or dims != family.dims:
            if dims in family.refused or any(_dim_size(sizes, leaf, d) <= 1 for leaf, d in dims):
                return None  # export specialises sizes 0 and 1: such a call on its own
            _log.info("optmem: %s called with other sizes: exporting once with dimensions "
                      "%s dynamic", type(self._checkpoint_wrapped_module).__name__, sorted(dims))
            with leaves_no_trace(self._checkpoint_wrapped_module, (args, kwargs)), \
                    root_hooks_suspended(self._checkpoint_wrapped_module), \
                    constants_tracked():
                ext = export_dynamic(self._checkpoint_wrapped_module, args, kwargs, sorted(dims))
            if ext is None or ext.accepts is None or not ext.accepts(args, kwargs):
                family.refused.add(dims)
                return None
            family.extraction, family.dims = ext, dims
            family.variants.clear()  # plans of the previous graph stay where already used
        elif ext.accepts is None or not ext.accepts(args, kwargs):
            return None  # outside the dynamic graph's ranges: this call on its own
        variant = family.covering(sizes)
        if variant is not None:
            return variant
        _log.info("optmem: %s called with new sizes: profiling and solving them (no export)",
                  type(self._checkpoint_wrapped_module).__name__)
        with _for_sizes(sizes, family.reference):
            variant = self._new_variant(args, kwargs, ext, local=True)
        family.keep(sizes, variant)
        return variant

    # -------------------------------------------------------------- reporting
    def side_input_bytes(self) -> int:
        """Bytes of the main signature's side inputs (not counted in the limit)."""
        return int(self._main.chain.extra.get("side_input_bytes", 0))

    def summary(self) -> str:
        """A few lines: stages, plan, predicted step time and memory."""
        chain, result = self.chain, self.result
        lines = [f"{chain.name}: {chain.length} stages, {self._planner.kind} plan by "
                 f"{result.method} ({result.status}), {len(result.plan)} ops",
                 f"expected step time {float(result.objective):.3f} {chain.time_unit} "
                 f"(no recomputation, nothing moved: {chain.total_compute_time():.3f})",
                 f"expected activation peak {format_size(self.expected_peak_bytes)} "
                 f"(store all: {format_size(chain.store_all_peak())})"]
        charge = result.report.get("segment_cost")
        if charge:
            lines.append(f"the plan's {result.report.get('segments')} recomputed segments are "
                         f"charged {float(charge):.3f} {chain.time_unit} each when planning "
                         f"(segment_cost; with them "
                         f"{result.report['objective_with_segments']:.3f})")
        lines.append(self._path_line())
        lines += _autotune_lines(result.report.get("autotune"), chain.time_unit)
        side = self.side_input_bytes()
        if side:
            lines.append(f"side inputs (masks, position tables; not in the limit): "
                         f"{format_size(side)}")
        ext = self._main.extraction
        if ext is not None and ext.carried:
            lines.append(f"carried beside the boundaries (read across layers): "
                         f"{_listed(ext.carried)}")
        if ext is not None and ext.value_branches:
            lines.append("branches on input values (the sample's side, checked at every "
                         f"call): {_listed(ext.value_branches)}")
        return "\n".join(lines)

    def _path_line(self) -> str:
        """Which path runs the main signature, and why (the store-all fast path or not)."""
        main = self._main
        peak, limit = main.plain_peak, main.limit
        if peak is None:
            return "the plan runs through the executor (the plain model's peak was not measured)"
        measured = f"measured plain peak {_size(peak)}"
        if limit is None:
            return f"the plan runs through the executor (a given plan, no limit; {measured})"
        if not main.plain_fits():
            return f"the plan runs through the executor ({measured} > limit {_size(limit)})"
        if not self.fast_path:
            return (f"the plan runs through the executor (fast_path=False; {measured} <= "
                    f"limit {_size(limit)})")
        return f"store-all: the module is called directly; {measured} <= limit {_size(limit)}"

    @property
    def expected_makespan(self) -> float:
        """Predicted duration of one forward+backward in the chain's time unit (ms)."""
        return float(self.result.objective)

    @property
    def expected_peak_bytes(self) -> int:
        """Predicted activation peak in bytes (the plan replayed on the byte chain)."""
        return int((self.result.peak_memory or 0) * self.result.unit)

    def extra_repr(self) -> str:  # noqa: D102
        return f"{self._planner.kind}: {len(self.result.plan)} ops over " \
               f"{self.chain.length} stages"


def _side_inputs(variant: _Variant, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[list[Any], SideInputs] | RuntimeError:
    """The call's flat inputs and side inputs under ``variant``'s extraction.

    Or the error of a value assertion the call's values fail: another side of a branch
    (*Value branches*).
    """
    ext = variant.extraction
    assert ext is not None
    ext.rebind()
    flat = ext.flatten(args, kwargs)
    try:
        return flat, ext.side_inputs(flat)
    except RuntimeError as exc:
        if not is_value_branch_error(exc):
            raise
        return exc


def _listed(items: Sequence[str], most: int = 3) -> str:
    """The first ``most`` items, and how many more."""
    more = len(items) - most
    return "; ".join(items[:most]) + (f" (and {more} more)" if more > 0 else "")


def _autotune_lines(record: dict[str, Any] | None, unit: str) -> list[str]:
    """The measured selection (``report["autotune"]``, :mod:`optmem.pytorch.autotune`)."""
    if not record:
        return []
    cands = record.get("candidates") or []
    if record.get("skipped"):
        return [f"autotune: nothing timed ({record['skipped']}); {len(cands)} candidate(s)"]
    lines = [f"autotune: {len(cands)} candidate plans timed (median of {record['rounds']} "
             f"interleaved steps after {record['warmup']} warm-up), plan "
             f"{record['chosen']} kept"]
    for c in cands:
        lines.append(f"  {'*' if c['chosen'] else ' '} {c['plan_id']} "
                     f"({', '.join(c['settings'])}): {c['segments']} segments, model "
                     f"{c['model_objective']:.3f} {unit}, measured {c['measured_ms']:.3f} ms")
    return lines


# ------------------------------------------------------------------ calls and signatures
def canonical_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   signature: inspect.Signature | None = None
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call with every argument that can be a keyword given as one.

    ``module(ids)`` and ``module(input_ids=ids)`` become the same call; ``use_cache`` (a
    generation cache, useless in training and not exportable) is set to ``False`` when the
    model takes it and the call does not give it or gives ``None`` (the model's default, as
    a parent model passes it to a wrapped backbone: ``LlamaForCausalLM`` calls its
    ``model`` with ``use_cache=None``). A call that asks for the cache (``use_cache=True``)
    gets it turned off too, with a warning (:data:`USE_CACHE_WARNING`), as HuggingFace's
    own gradient checkpointing does in training: before, such a call tried to extract a
    graph that returns the cache and failed with ``torch.export``'s error on it.

    A model with forward hooks or pre-hooks of its own keeps the arguments given
    positionally as positional: its hooks receive them (``args[0]``), as when the caller
    calls the model. Before (until stop 52), a pre-hook reading ``args[0]`` failed with
    ``IndexError`` when wrapping or at the call, since the model was called ``model(x=x)``.
    """
    signature = signature or inspect.signature(module.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{type(module).__name__}: {exc}") from None
    # the model's own forward hooks see its positional arguments as the caller gave them
    hooked = bool(module._forward_pre_hooks or module._forward_hooks)
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    for index, (name, value) in enumerate(bound.arguments.items()):
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return args, dict(kwargs)  # cannot name them: keep the call as it is
            continue
        if kind is inspect.Parameter.POSITIONAL_ONLY or (
                hooked and kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and index < len(args)):
            pos.append(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            kw.update(value)
        else:
            kw[name] = value
    if "use_cache" in signature.parameters or _passes_use_cache(module, signature):
        if kw.get("use_cache"):
            warnings.warn(USE_CACHE_WARNING, stacklevel=2)
        kw["use_cache"] = False
    return tuple(pos), kw


def _passes_use_cache(module: nn.Module, signature: inspect.Signature) -> bool:
    """Whether a pass-through wrapper hands ``use_cache`` to a model that would cache.

    A wrapper such as PEFT's ``PeftModel`` (``forward(*args, **kwargs)``, ``config`` of the
    model it wraps) names no ``use_cache`` but passes its keywords on to a HuggingFace
    model whose ``config.use_cache`` turns the generation cache on: its output would hold
    the cache, which ``torch.export`` cannot return. HuggingFace models read a ``use_cache``
    keyword whenever their config has the flag. A composite model (LLaVA, PaliGemma: a
    vision tower beside a language model) has it on its text config only
    (``config.get_text_config()``), and takes ``use_cache`` among its ``**kwargs``.
    """
    takes_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD
                         for p in signature.parameters.values())
    config = getattr(module, "config", None)
    flag = getattr(config, "use_cache", None)
    text = getattr(config, "get_text_config", None)
    if flag is None and callable(text):
        flag = getattr(text(), "use_cache", None)
    return takes_keywords and flag is True


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


class _Unpickled(list[Any]):
    """A list a deep copy keeps (its items shared) and pickling drops (saved empty).

    The user's global hooks and code objects a :class:`TensorState` watches: a copy in
    the same process watches them too; a wrapper saved to a file holds none (a lambda
    or a code object would not pickle; a global hook is not the model's).
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> _Unpickled:
        return _Unpickled(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Unpickled, ())


class TensorState:
    """What an exported graph baked in of the model, checked cheaply per call.

    An exported graph bakes in what it traced of the model:

    * the dtype conversions (Llama's RMSNorm computes in float32 and casts back to the dtype
      of its input *at trace time*): after ``model.to(torch.float64)`` the float32 graph
      would return float32 logits;
    * the shapes of parameters (``model.resize_token_embeddings(n)`` resizes in place: the
      graph's views of the logits kept the old vocabulary, and the call failed);
    * the module tree: each stage reads the parameters of the *modules it was traced with*,
      so a submodule replaced after wrapping (``model.lm_head = nn.Linear(...)``, adapters
      injected in place of layers) was silently ignored: the old weights computed the
      output, and the new ones got no gradient;
    * which parameters are one object: the graph of a model with tied weights (GPT-2's
      embedding and head) reads one parameter for both uses, so untying them after
      wrapping silently computed the embedding with the new head;
    * the training mode of every submodule, not only the model's (BatchNorm frozen with
      ``bn.eval()`` after wrapping kept normalising with batch statistics and updating the
      running ones);
    * the probability ``p`` of every ``nn.Dropout`` (and its 1-3d, alpha and feature
      variants): export bakes it in as a constant, so a dropout schedule that sets ``p``
      between steps was silently ignored (a hunt in stop 57);
    * the plain Python attributes the forward reads: export bakes them in as constants too
      (``LayerNorm.eps``, a temperature ``self.tau = 0.5``, an HF ``config`` flag such as
      ``output_hidden_states``, PEFT's LoRA ``scaling`` dict, a tensor attribute that is
      neither a parameter nor a buffer, by identity), so setting one after wrapping was
      silently ignored: a temperature annealed after wrapping kept the first value
      (outputs 0.73 and gradients up to 17 apart on a toy, an audit in stop 76). Recorded:
      every public attribute of every module whose value is a bool, int, float, str,
      ``None``, a plain tensor or a tuple, list or dict of at most 64 of those, and
      every such attribute of the configuration objects modules hold (a class whose name
      ends in ``Config``, nested ones included). What the model's own forward writes
      (HF's ``config.problem_type`` at the first call with labels, a call counter) is
      taken as the new value when the wrapper ran the model's Python (extraction, the
      fast path, ``no_grad``; :meth:`absorb`), so it extracts nothing;
    * PEFT's active adapters and disabled flags, private attributes of its tuner layers
      (``set_adapter``, ``disable_adapter``): part of the token, as the training modes
      (:func:`_adapter_state`, stop 84);
    * the module hooks: forward hooks and pre-hooks are traced into the graph, backward
      hooks are refused (:mod:`optmem.pytorch.hooks`); a hook registered or removed after
      wrapping was silently ignored. Not the *global* module hooks of torch's tools
      (``MemTracker``, ``ModTracker``, ``FlopCounterMode``): they run on the wrapper's
      stage calls (extraction and profiling run without them:
      :func:`~optmem.pytorch.hooks.callers_tools_suspended`). The user's own global
      forward hooks are (stop 87: the export calls them on the model's modules,
      :func:`~optmem.pytorch.observers.global_hooks_traced`), but for those whose code
      an export found to return ``None`` everywhere (:meth:`watch`). Not the model's own
      forward hooks and pre-hooks, which the wrapper calls around the plan (stop 86);
    * what the hooks of inner modules (and the global hooks) that returned a value read
      (:meth:`watch`, :func:`hook_reads`): a steering strength ``alpha`` changed after
      wrapping was silently ignored (stop 86).

    The state is part of the signature, so any such change extracts again (and a new
    backward hook is then refused, a new forward hook reported, as when wrapping). The
    token is the set of (dtype, device) of the tensors, a version that counts the changes
    of shapes, module tree and hooks, and which modules train: moving the model back to
    its dtype, or its submodules back to their modes, reuses the graph of that state.
    Replacing a parameter by one of the same shape and dtype (``load_state_dict(assign=
    True)``), without tying or untying any, changes nothing: the stages follow it
    (:meth:`~optmem.pytorch.extract.Extraction.rebind`).

    Per call it looks up every parameter and buffer in its module and compares it, its
    dtype and shape with the recorded ones (when one was replaced: which are one object),
    every child module with the recorded one, the devices of the first and last tensors,
    the number of submodules, parameters and buffers (an addition), the number of hooks of
    every module that has some (a removal), the id of the next hook handle torch will
    make (any registration; when it moved, which hooks every module holds) and every
    module's training flag and every dropout module's ``p`` and recorded Python attribute
    (``attributes=False``: not those, for an ``nn.Sequential`` or a list of stages, whose
    modules run as they are); it recomputes the state when one differs.
    """

    def __init__(self, module: nn.Module, *, attributes: bool = True) -> None:
        self.module = module
        self._version = 0
        self._attributes = attributes
        self._modifiers: list[Any] = []  # hooks in the graph: what they read is recorded
        self._global_modifiers: list[Any] = []  # the user's global hooks in the graph
        self._observer_codes: frozenset[Any] = frozenset()  # global hooks found to observe
        self._refresh()

    def __getstate__(self) -> dict[str, Any]:
        """Copied or pickled: the module, the version, the watched hooks (the rest recomputed).

        A change made since the last call is taken first (:meth:`key`): the copy records the
        state it copies, so without it a copy made after, say, ``model.eps = 0.5`` took the
        new value as its recorded one and kept computing with the graph of the old.
        """
        self.key()
        return {"module": self.module, "_version": self._version,
                "_attributes": self._attributes, "_modifiers": self._modifiers,
                "_global_modifiers": _Unpickled(self._global_modifiers),
                "_observer_codes": _Unpickled(self._observer_codes),
                "_pinned": pinned_names(self.module)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Recompute the state of the (copied) module: its modules, hooks and modes.

        The buffers the original's graphs hold as constants are recorded for the copy's
        modules (its graphs, copied, hold them too).
        """
        pin_names(state["module"], state.pop("_pinned", frozenset()))
        # (none in a wrapper saved before)
        self.__dict__.update({"_modifiers": [], **state})
        self._global_modifiers = list(state.get("_global_modifiers", ()))
        self._observer_codes = frozenset(state.get("_observer_codes", ()))
        self._refresh()

    def _refresh(self) -> None:
        modules = list(self.module.modules())
        tensors: list[tuple[dict[str, Any], str, Any]] = []
        children: list[tuple[dict[str, Any], str, Any]] = []
        for m in modules:
            children += [(m._modules, name, sub) for name, sub in m._modules.items()]
            for slots in (m._parameters, m._buffers):
                for name, t in slots.items():
                    (children if t is None else tensors).append((slots, name, t))
        self._tensors = [(slots, name, t, t.dtype, t.shape) for slots, name, t in tensors]
        self._constants = [_ConstantBuffer(m, name, t) for m, name, t in
                           candidate_buffers(self.module)]
        self._objects = [t for _, _, t in tensors]  # for grads()
        self._sharing = _sharing(t for _, _, t in tensors)
        self._children = children
        self._devices = [(slots, name, t.device) for slots, name, t in tensors[:1] + tensors[-1:]]
        self._entries = [d for m in modules for d in (m._modules, m._parameters, m._buffers)]
        self._n_entries = sum(map(len, self._entries))  # additions change it
        # the global module hooks are the tools' (torch's ModTracker, MemTracker,
        # FlopCounterMode): they run on the stage calls and are not traced (see the class doc)
        # the model's own forward hooks are called around the plan, outside the graph
        # (stop 86): registering or removing one extracts nothing
        self._all_hooks = [d for m in modules for d in _hook_dicts(m)
                           if m is not self.module or not self._attributes
                           or d is m._backward_hooks or d is m._backward_pre_hooks]
        self._globals = user_global_hooks(self._observer_codes) if self._attributes else ()
        self._hook_ids = self._hook_keys()
        self._hooks = [(d, len(d)) for d in self._all_hooks if d]  # removals change these
        self._handle_id = RemovableHandle.next_id  # every registration moves it
        self._modes = [(m, m.training) for m in modules]
        self._dropout = [(m, m.p) for m in modules if isinstance(m, _DropoutNd)]
        live = live_namespaces()
        self._attrs = _Attributes([e for e in _python_attributes(modules) if id(e[0]) not in live]
                                  if self._attributes else [])
        self._hook_reads = self._read_by_hooks()
        self._adapter_layers = [m for m in modules if _is_adapter_layer(m)]
        self._adapters = _adapter_state(self._adapter_layers)
        self.token = (frozenset((t.dtype, str(t.device)) for _, _, t in tensors),
                      self._version, sum(1 << k for k, m in enumerate(modules) if m.training),
                      self._adapters)

    def watch(self, plan: ObserverPlan) -> None:
        """Record what an extraction's modifying hooks read, its global observers (no new version).

        A hook that returns a value is in the graph with the values its code read when it
        was traced (:func:`hook_reads`): when one changes, the graph no longer applies, as
        for a module's attribute. A global hook whose code returned ``None`` on every module
        (:attr:`ObserverPlan.global_observers`) is left out of the hook check from now on:
        registering or removing one again changes nothing in the graph.
        """
        known = {id(h) for h in (*self._modifiers, *self._global_modifiers)}
        added = [h for h in plan.modifiers if id(h) not in known]
        added_global = [h for h in plan.global_hooks if id(h) not in known]
        if added or added_global:
            self._modifiers += added
            self._global_modifiers += added_global
            self._hook_reads = self._read_by_hooks()
        if not plan.global_observers <= self._observer_codes:
            self._observer_codes = self._observer_codes | plan.global_observers
            self._globals = user_global_hooks(self._observer_codes)
            self._hook_ids = self._hook_keys()

    def _read_by_hooks(self) -> _Attributes:
        """What the watched hooks still registered on the model read (:func:`hook_reads`)."""
        if not (self._modifiers or self._global_modifiers):
            return _Attributes([])
        live = {id(h) for d in self._all_hooks for h in d.values()}
        self._modifiers = [h for h in self._modifiers if id(h) in live]
        live = {id(h) for d in (_global_forward_hooks, _global_forward_pre_hooks)
                for h in d.values()}
        self._global_modifiers = [h for h in self._global_modifiers if id(h) in live]
        return _Attributes([e for h in (*self._modifiers, *self._global_modifiers)
                            for e in hook_reads(h)])

    def changed_hook_reads(self) -> list[str]:
        """The names of the watched hooks' values that differ from the recorded ones."""
        return [name for namespace, name, value in self._hook_reads.entries
                if not _Attributes([(namespace, name, value)]).same()]

    def _warn_hook_reads(self) -> None:
        """Say once that a hook in the graph read a value that changed: extracting again."""
        if self.__dict__.get("_hooks_warned"):
            return
        self._hooks_warned = True
        names = ", ".join(sorted(set(self.changed_hook_reads()))[:3])
        warnings.warn(
            f"a forward hook of {type(self.module).__name__} that returns a value (it is "
            f"traced into optmem's graph) reads {names}, which changed since it was traced: "
            "optmem extracts, profiles and solves the model again for the new value (each "
            "change costs one extraction; 8 graphs are kept). A value that changes every "
            "step is cheaper read from a tensor updated in place (v.fill_(alpha)), which the "
            "graph reads at every call, or in a hook on the model itself, which optmem calls "
            "at every step", stacklevel=5)

    def _hook_keys(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Which hook dictionaries hold which hooks (by handle id; ``-1``: the user's global)."""
        return (*((k, tuple(d)) for k, d in enumerate(self._all_hooks) if d),
                (-1, user_global_hooks(self._observer_codes) if self._attributes else ()))

    def _change(self) -> int:
        """How the model differs from the recorded state.

        0: not at all; 1: dtypes, devices, parameter objects, a module's training mode or
        PEFT's active adapters (the graph of that state applies, the stages follow the
        objects); 2: shapes, tied
        weights, module tree, hooks or a dropout probability (the graph does not apply).
        """
        if sum(map(len, self._entries)) != self._n_entries or \
                any(len(d) != n for d, n in self._hooks) or \
                any(m.p != p for m, p in self._dropout) or not self._attrs.same() or \
                self._globals and user_global_hooks(self._observer_codes) != self._globals:
            return 2
        if not self._hook_reads.same():
            self._warn_hook_reads()
            return 2
        if RemovableHandle.next_id != self._handle_id:  # a hook of any kind, anywhere
            if self._hook_keys() != self._hook_ids:
                return 2
            self._handle_id = RemovableHandle.next_id
        if any(_entry(d, name) is not value for d, name, value in self._children):
            return 2
        moved = [c.change() for c in self._constants if is_pinned(c.module, c.name)]
        if 2 in moved:  # a value a graph holds: extracted again
            return 2
        replaced = retyped = False
        for slots, name, before, dtype, shape in self._tensors:
            t = _entry(slots, name)
            if t is None or t.shape != shape:
                return 2
            replaced |= t is not before
            retyped |= t.dtype is not dtype
        if replaced and _sharing(slots[name] for slots, name, *_ in self._tensors) != \
                self._sharing:  # weights tied or untied: the graph traced one or two
            return 2
        return 1 if replaced or retyped or 1 in moved or any(
            d[name].device != device for d, name, device in self._devices) or any(
            m.training is not mode for m, mode in self._modes) or \
            _adapter_state(self._adapter_layers) != self._adapters else 0

    @contextmanager
    def absorbing(self) -> Iterator[None]:
        """Run the model's Python (``with``): take what it writes of the recorded attributes.

        The model's own forward may set attributes (HF's ``config.problem_type`` at its
        first call with labels, a call counter): that is not a change made after wrapping,
        and without this every later call would extract again. What differs on entry was
        set by the caller since the last call (before a ``no_grad`` call, say): a new
        version, as :meth:`key` makes it, not taken as the model's own write.
        """
        if not self._attrs.same() or not self._hook_reads.same():
            self._version += 1
            self._refresh()
        try:
            yield
        finally:
            self.absorb()

    def absorb(self) -> None:
        """Record the current value of every recorded Python attribute (no new version).

        The attributes of modules a custom Function kept whole is passed are no longer
        recorded (:func:`~optmem.pytorch.custom_functions.live_namespaces`): the Function
        reads them at every call, and may write them then.
        """
        if not self._hook_reads.same():  # a hook's own write while it was traced
            self._hook_reads = self._read_by_hooks()
        live = live_namespaces()
        if not self._attrs.same() or (live and any(id(d) in live
                                                   for d, _, _ in self._attrs.entries)):
            self._attrs = _Attributes([(d, name, _recorded(d.get(name, _ABSENT)))
                                       for d, name, _ in self._attrs.entries
                                       if id(d) not in live])

    def key(self) -> tuple[Any, ...]:
        """The module's state now.

        The set of (dtype, device) of its tensors, the version of its structure, which
        modules are in training mode (a bit per module), PEFT's active adapters and disabled
        flags (:func:`_adapter_state`) and which of its parameters require grad
        (:meth:`grads`).
        """
        change = self._change()
        if change:
            self._version += change == 2
            self._refresh()
        return (*self.token, self.grads())

    def grads(self) -> int:
        """Which of the module's tensors require grad now (a byte per recorded tensor).

        What a step stores and computes depends on it: a linear layer whose weight is
        frozen saves no input for its weight's gradient, and the plain step of a model
        frozen but for its head is far smaller. A profile (its tapes, its backward
        temporaries and the plain peak of the store-all fast path) holds for the
        parameters that required grad when it was measured, so unfreezing after wrapping
        is a new signature. Call after :meth:`key` (which records replaced tensors).
        """
        return int.from_bytes(bytes(map(_REQUIRES_GRAD, self._objects)), "little")


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _ConstantBuffer:
    """A non-persistent integer buffer as recorded (a graph may hold its value; stop 86).

    Compared per call by object, version counter and data pointer; by value too when on
    the CPU (cheap there; it also sees a write through ``.data``, which moves no counter).
    On another device or of another dtype it is a change (the graph made its constant so).
    """

    def __init__(self, module: nn.Module, name: str, t: torch.Tensor) -> None:
        self.module, self.name, self.tensor, self.kind = module, name, t, (t.dtype, t.device)
        self.version, self.pointer, self.value = t._version, t.data_ptr(), t.item()

    def change(self) -> int:
        """0: as recorded; 1: another tensor or version of the same value; 2: changed."""
        t = _entry(self.module._buffers, self.name)
        if t is None or not is_candidate(self.module, self.name, t) or \
                (t.dtype, t.device) != self.kind:
            return 2
        if t is self.tensor and t._version == self.version and \
                t.data_ptr() == self.pointer and not t.is_cpu:
            return 0
        if t.item() != self.value:
            return 2
        return 0 if t is self.tensor and t._version == self.version and \
            t.data_ptr() == self.pointer else 1


def _entry(entries: Any, name: str) -> Any:
    """``entries[name]``, ``None`` when absent.

    ``entries`` is a module's ``_modules``, ``_parameters`` or ``_buffers``: a dict, or for
    a ``torch.jit.script``-ed module torch's wrapper of one, which has no ``get``.
    """
    return entries[name] if name in entries else None  # noqa: SIM401 - no .get, see above


FUNCTORCH_WARNING = (
    "optmem: called under a torch.func transform (grad, vmap, jacrev, functional_call inside "
    "one, ...): the model runs as it is, without optmem's plan, whose autograd Function does "
    "not compose with torch.func (results are the model's; no activation memory is saved). "
    "Call the wrapper outside torch.func to train with the plan.")


FORWARD_AD_WARNING = (
    "optmem: called with a forward-mode AD dual tensor (torch.autograd.forward_ad) among the "
    "inputs or the model's parameters: the model runs as it is, without optmem's plan, whose "
    "autograd Function has no jvp (outputs, tangents and gradients are the model's; no "
    "activation memory is saved). Call the wrapper without dual tensors to train with the "
    "plan.")


SAVED_TENSORS_WARNING = (
    "optmem: called with grad inside torch.autograd.graph.disable_saved_tensors_hooks: the "
    "model runs as it is, without optmem's plan, which moves the tensors autograd saves with "
    "saved_tensors_hooks (results are the model's; no activation memory is saved). Call the "
    "wrapper outside that region to train with the plan, or wrap with op.checkpoint, whose "
    "plan registers no such hooks.")


def dual_tensors_in(module: nn.Module, values: Any) -> bool:
    """Whether a forward-mode AD level is open and a tensor of ``values`` or ``module`` is dual.

    Examples
    --------
    >>> import torch.autograd.forward_ad as fwAD
    >>> layer = nn.Linear(2, 2)
    >>> dual_tensors_in(layer, (torch.ones(2),))
    False
    >>> with fwAD.dual_level():
    ...     dual_tensors_in(layer, (fwAD.make_dual(torch.ones(2), torch.ones(2)),))
    True
    """
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level open: none is dual
        return False
    tensors = [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]
    return any(forward_ad.unpack_dual(t).tangent is not None
               for t in (*tensors, *module.parameters(), *module.buffers()))


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s non-persistent buffers, its submodules' included.

    Examples
    --------
    >>> m = nn.Sequential(nn.Linear(2, 2))
    >>> m[0].register_buffer("scale", torch.ones(1), persistent=False)
    >>> non_persistent_buffers(m)
    {'0.scale'}
    """
    return {f"{name}.{b}" if name else b
            for name, m in module.named_modules(remove_duplicate=False)
            for b in m._non_persistent_buffers_set}


def deployment_trace_active() -> bool:
    """Whether ``torch.export`` or ``torch.jit.trace`` is tracing the call.

    They record a graph to deploy (``torch.onnx.export`` runs one of them): the wrapper's
    call is then the model's own, so the graph is the plain model's. The plan is a
    schedule of the training step's forward and backward, which such a graph does not
    hold.

    Examples
    --------
    >>> deployment_trace_active()
    False
    """
    return bool(torch.compiler.is_exporting() or torch.jit.is_tracing())


def functorch_transform_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) is running.

    Examples
    --------
    >>> functorch_transform_active()
    False
    >>> torch.func.grad(lambda x: (x * functorch_transform_active()).sum())(torch.ones(2))
    tensor([1., 1.])
    """
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


class _SignedForward:
    """A wrapper's ``forward`` that shows the wrapped model's signature.

    Code that reads the model's signature reads the wrapped model's: HuggingFace's
    ``Trainer`` keeps the dataset columns its model's ``forward`` names, and the
    wrapper's own ``forward(*args, **kwargs)`` names none. ``inspect.signature`` follows
    ``__wrapped__`` (accelerate's hooks give a model's ``forward`` the same way). Calls go
    to :meth:`PlannedModule.forward`; the wrapper is held weakly (no reference cycle: a
    deleted wrapper is freed at once, as the plain model is), and copies and pickles
    rebuild it on their own wrapper.
    """

    def __init__(self, owner: PlannedModule) -> None:
        self._owner = weakref.ref(owner)

    def _wrapper(self) -> PlannedModule:
        owner = self._owner()
        assert owner is not None, "the wrapper of this forward was freed"
        return owner

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The wrapped model's ``forward`` (read when asked: a copy sets its state later).

        A PEFT model's is its base model's (:func:`inspected_model`), which it passes its
        arguments to.
        """
        return inspected_model(self._wrapper()._checkpoint_wrapped_module).forward

    @property
    def __code__(self) -> types.CodeType:
        """The wrapped model's ``forward`` code (``torch.export`` reads it for its names)."""
        return self.__wrapped__.__code__  # type: ignore[attr-defined, no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._wrapper()
        return type(owner).forward(owner, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _SignedForward, (self._owner(),)


def inspected_model(module: nn.Module) -> nn.Module:
    """The model that HuggingFace's ``Trainer`` inspects for ``module``.

    A PEFT model (``peft_config`` and ``get_base_model()``, as ``PeftModel``) is read
    through its base model: ``Trainer`` keeps the dataset columns the base model's
    ``forward`` names and shifts the labels of its label smoothing by the base model's
    name. Any other module is itself. The wrapper shows this model's signature and name,
    so that ``Trainer`` treats a wrapped ``PeftModel`` as the ``PeftModel``: before stop 83
    a ``PeftModel`` without a task type (``forward(*args, **kwargs)``) had every column
    dropped ("You have to specify either input_ids or inputs_embeds").

    Parameters
    ----------
    module
        The wrapped model.

    Returns
    -------
    torch.nn.Module
        ``module.get_base_model()`` for a PEFT model, else ``module``.
    """
    base = getattr(module, "get_base_model", None)
    if hasattr(module, "peft_config") and callable(base):
        found = base()
        if isinstance(found, nn.Module):
            return found
    return module


def refuse_wrapped(module: Any, call: str, *, wrap_after: bool = True) -> None:
    """One clear error for a model already wrapped in a way optmem cannot wrap again.

    ``call`` names the optmem entry point in the message; ``wrap_after``: its result can be
    wrapped in ``DistributedDataParallel`` (not a pipeline's). Refused: a model sharded with
    ``fully_shard``, wrapped by ``DistributedDataParallel`` or ``DataParallel`` (or holding
    such a part), compiled with ``torch.compile`` (an ``OptimizedModule``; a compiled *part*
    is exported through and works), or already wrapped by optmem. Each message names the
    order that works.

    Raises
    ------
    OptmemInputError
        Naming the wrapper and what to do instead.
    """
    from optmem.pytorch.process_groups import is_fsdp_module, refuse_sharded

    if not wrap_after and is_fsdp_module(module):
        raise OptmemInputError(
            f"{type(module).__name__} is already sharded with fully_shard: {call} places "
            "the model's stages on the ranks and runs them itself, which the shards' "
            "gathers would bypass; pass the unsharded model; see docs/distributed.md",
            field="module")
    refuse_sharded(module)
    for part in module if isinstance(module, Sequence) else [module]:
        if not isinstance(part, nn.Module):
            continue
        for name, sub in part.named_modules():
            where = (f"{type(part).__name__}.{name} is a {type(sub).__name__}" if name else
                     f"the model is a {type(sub).__name__}")
            if isinstance(sub, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
                after = (f" and wrap the result in {type(sub).__name__} afterwards, e.g. "
                         "DistributedDataParallel(optmem.pytorch.checkpoint(model, sample, "
                         "memory_limit=...))" if wrap_after else
                         " (a pipeline spans every process of the job: no data parallelism "
                         "around it)")
                raise OptmemInputError(
                    f"{where}: its forward drives the replicas and their gradient "
                    f"synchronisation, which {call} would bypass; pass the plain model "
                    f"(its .module){after}; see docs/distributed.md", field="module")
            if not name and isinstance(sub, torch._dynamo.eval_frame.OptimizedModule):
                raise OptmemInputError(
                    f"{where} (compiled with torch.compile): {call} extracts and runs the "
                    "plain model's stages; pass the plain model (its ._orig_mod) and compile "
                    "the result instead, torch.compile(cmodel, ...), which compiles every "
                    "stage with your backend and options", field="module")
    _refuse_nested(module)


_SCALARS = (bool, int, float, str, type(None))
_ABSENT = object()
# what a PEFT tuner layer's forward reads and set_adapter / disable_adapter change: private
# attributes, which _python_attributes leaves out (a class default until first set)
_PEFT_STATE = ("_active_adapter", "_disable_adapters")


def _is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT tuner layer (it has :data:`_PEFT_STATE`, maybe by class)."""
    return all(hasattr(type(module), name) or name in module.__dict__ for name in _PEFT_STATE)


def _adapter_state(layers: Sequence[nn.Module]) -> tuple[Any, ...]:
    """The active adapters and the disabled flag of each PEFT tuner layer (hashable).

    Part of :attr:`TensorState.token`, as the training modes are: a state met before
    reuses its graph, so a DPO step's reference call under ``disable_adapter()`` and
    ``no_grad`` extracts nothing. Before stop 84 these were not checked: a backbone wrapped
    inside a ``PeftModel`` (which holds the layers, not the ``LoraModel`` whose public
    ``active_adapter`` is a recorded attribute) kept computing with the old adapter after
    ``set_adapter`` when no parameter's ``requires_grad`` changed.
    """
    return tuple((tuple(a) if isinstance(a := m._active_adapter, list) else a,
                  m._disable_adapters) for m in layers)


def _python_attributes(modules: Iterable[nn.Module]) -> list[tuple[dict[str, Any], str, Any]]:
    """The plain Python attributes an exported graph may have baked in (:class:`TensorState`).

    ``(namespace, name, value)`` for every public attribute of every module whose value is
    a bool, int, float, str, ``None`` or a plain tensor (neither a parameter nor a buffer,
    compared by identity), and every bool, int, float, str or ``None`` attribute of the
    configuration objects the modules hold (a class whose name ends in ``Config``: HF's
    ``config``, nested ones included). ``training`` is left out (modes are checked on their
    own, and a graph per mode is kept).
    """
    out: list[tuple[dict[str, Any], str, Any]] = []
    seen: set[int] = set()

    def config(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        namespace = vars(obj)
        for name, value in namespace.items():
            if type(value) in _SCALARS:
                out.append((namespace, name, value))
            elif _is_config(value):
                config(value)

    for m in modules:
        namespace = m.__dict__
        for name, value in namespace.items():
            if name[0] == "_" or name == "training":
                continue
            if type(value) in _SCALARS or type(value) is torch.Tensor or _small_container(value):
                out.append((namespace, name, _recorded(value)))
            elif _is_config(value):
                config(value)
    return out


class _Cells(Mapping[str, Any]):
    """A function's closure as a namespace: its free variables' current values, by name."""

    def __init__(self, names: Sequence[str], cells: Sequence[Any]) -> None:
        self._cells = dict(zip(names, cells, strict=True))

    def __getitem__(self, name: str) -> Any:
        try:
            return self._cells[name].cell_contents
        except ValueError:  # an empty cell: the variable was deleted
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._cells)

    def __len__(self) -> int:
        return len(self._cells)


def hook_reads(hook: Any) -> list[tuple[Any, str, Any]]:
    """The Python values a forward hook's code may read, as :class:`_Attributes` entries.

    A hook that returns a value is traced into the graph (stop 86): the numbers it reads
    at that time are constants there, so a steering strength ``alpha`` changed between
    steps changed nothing. Recorded (``(namespace, name, value)``): the values whose type
    is a bool, int, float, str, ``None``, a plain tensor (by identity) or a small container
    of those, met on a bounded walk (:class:`_ReadWalk`) from the hook's free variables and
    the globals its code loads (``LOAD_GLOBAL``; not a global that only shares its name
    with an attribute the code reads), for a bound method or a callable object from the
    attributes of its object (``self.alpha``), for a ``functools.partial`` from its
    keywords. The walk goes into dicts, plain objects (``cfg.steer.alpha``) and the
    user's own functions the code names (a helper ``steer(o)`` reading ``CFG.alpha``: its
    globals and closure), :data:`READ_DEPTH` levels down, each object once; never into a
    module, tensor, class or a library's function; of an object, only the attributes
    some walked code (or a method of its class) reads by that name (since stop 87: before,
    one level down, every attribute, not into functions).
    """
    walk = _ReadWalk()
    if isinstance(hook, functools.partial):
        walk.mapping(hook.keywords, 1)
        hook = hook.func
    owner = getattr(hook, "__self__", None)
    if isinstance(hook, types.MethodType):
        hook = hook.__func__
    elif owner is None and not isinstance(hook, types.FunctionType) and \
            hasattr(hook, "__dict__"):
        owner, hook = hook, type(hook).__call__  # a callable object
    if owner is not None and hasattr(owner, "__dict__") and not isinstance(owner, nn.Module):
        walk.instance(owner, 1)
    if isinstance(hook, types.FunctionType):
        walk.function(hook, 0)
    return walk.entries()


READ_DEPTH = 4
"""How many levels down from a hook :func:`hook_reads` looks (an object, a function each)."""


class _ReadWalk:
    """The walk of :func:`hook_reads`: each namespace and function once, bounded in depth.

    An object's attributes are kept only under a name some walked code reads as an
    attribute (the hook's, a helper's, a method of the object's class): a counter the
    training loop moves on the same object is not what the hook reads.
    """

    def __init__(self) -> None:
        self.out: list[tuple[Any, str, Any]] = []
        self.seen: set[int] = set()
        self.attributes: set[str] = set()  # names read as attributes by the code walked
        self.instances: set[int] = set()  # the ids of objects' ``vars``

    def entries(self) -> list[tuple[Any, str, Any]]:
        """What was met: an object's attribute only under a name the code reads."""
        return [e for e in self.out if id(e[0]) not in self.instances
                or e[1] in self.attributes]

    def _first(self, obj: Any) -> bool:
        if id(obj) in self.seen:
            return False
        self.seen.add(id(obj))
        return True

    def function(self, fn: types.FunctionType, depth: int) -> None:
        """The free variables and the loaded globals of a user's function."""
        if depth > READ_DEPTH or not self._first(fn):
            return
        code = fn.__code__
        globals_read, attributes = _code_names(code)
        self.attributes.update(attributes)
        if fn.__closure__:
            cells = _Cells(code.co_freevars, fn.__closure__)
            for name in cells:
                with contextlib.suppress(KeyError):  # an empty cell
                    self.value(cells, name, cells[name], depth)
        glob = fn.__globals__
        for name in globals_read:
            if name in glob:
                self.value(glob, name, glob[name], depth)

    def instance(self, obj: Any, depth: int) -> None:
        """A plain object: its attributes, and what its class's methods read of it."""
        namespace = vars(obj)
        self.instances.add(id(namespace))
        for klass in type(obj).__mro__[:-1]:
            for member in vars(klass).values():
                fget = getattr(member, "fget", None)  # a property's
                fn = getattr(member, "__func__", fget if fget is not None else member)
                if isinstance(fn, types.FunctionType) and _user_function(fn):
                    self.attributes.update(_code_names(fn.__code__)[1])
        self.mapping(namespace, depth)

    def mapping(self, namespace: Mapping[Any, Any], depth: int) -> None:
        """The string-keyed entries of a dict or an object's ``vars``."""
        if depth > READ_DEPTH or not self._first(namespace):
            return
        for name, value in list(namespace.items()):
            if isinstance(name, str):
                self.value(namespace, name, value, depth)

    def value(self, namespace: Mapping[str, Any], name: str, value: Any, depth: int) -> None:
        """Record ``value`` if a graph bakes it in, else walk into it."""
        if _readable(value):
            self.out.append((namespace, name, _recorded(value)))
        if type(value) is dict:  # its entries too: the warning names them
            self.mapping(value, depth + 1)
        elif _plain_object(value):
            self.instance(value, depth + 1)
        elif isinstance(value, types.MethodType) and _plain_object(value.__self__):
            self.instance(value.__self__, depth + 1)
            self.value(namespace, name, value.__func__, depth)
        elif isinstance(value, types.FunctionType) and _user_function(value):
            self.function(value, depth + 1)


@functools.lru_cache(maxsize=512)
def _code_names(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names ``code`` (and the functions defined in it) loads as globals, as attributes.

    Globals: ``LOAD_GLOBAL`` / ``LOAD_NAME`` only (stop 87): ``self.alpha`` names
    ``alpha`` in ``co_names`` too, as an attribute, which a global ``alpha`` of the module
    does not feed. Attributes: ``LOAD_ATTR`` / ``LOAD_METHOD``.

    Examples
    --------
    >>> _code_names((lambda m, a, o: o * scale + m.alpha).__code__)
    (('scale',), ('alpha',))
    """
    found: dict[str, dict[str, None]] = {"global": {}, "attribute": {}}
    for i in dis.get_instructions(code):
        kind = _NAME_KINDS.get(i.opname)
        if kind is not None:
            found[kind][i.argval] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner = _code_names(const)
            found["global"].update(dict.fromkeys(inner[0]))
            found["attribute"].update(dict.fromkeys(inner[1]))
    return tuple(found["global"]), tuple(found["attribute"])


_NAME_KINDS = {"LOAD_GLOBAL": "global", "LOAD_NAME": "global", "LOAD_ATTR": "attribute",
               "LOAD_METHOD": "attribute"}


def _user_function(fn: types.FunctionType) -> bool:
    """A function of the user's code, not of torch, a library or Python's own modules."""
    root = (fn.__module__ or "").partition(".")[0]
    where = fn.__code__.co_filename
    return root not in _LIBRARY_ROOTS and not where.startswith(_LIBRARY_DIRS) and \
        "site-packages" not in where and not where.startswith("<frozen")


_LIBRARY_ROOTS = frozenset({"torch", "optmem", "numpy", "transformers", "functools", "builtins"})
_LIBRARY_DIRS = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def _readable(value: Any) -> bool:
    """A value a graph bakes in: a scalar, a plain tensor, a small container of scalars."""
    return type(value) in _SCALARS or type(value) is torch.Tensor or _small_container(value)


def _plain_object(value: Any) -> bool:
    """A user's plain object (a config, a steering state), not a module, class or function."""
    return hasattr(value, "__dict__") and type(value).__module__ != "builtins" and \
        not isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType,
                               types.FunctionType, types.MethodType, functools.partial))


def _small_container(value: Any) -> bool:
    """A tuple, list or dict of at most 64 bools, ints, floats, strs or ``None`` (keys too).

    PEFT's LoRA layers keep their scale in one (``scaling = {"default": 2.0}``).
    """
    if type(value) not in (tuple, list, dict) or len(value) > 64:
        return False
    items = [*value.keys(), *value.values()] if type(value) is dict else value
    return all(type(v) in _SCALARS for v in items)


def _recorded(value: Any) -> Any:
    """What is recorded of an attribute's value: a copy of a list or dict (mutable)."""
    return type(value)(value) if type(value) in (list, dict) else value


def _is_config(value: Any) -> bool:
    return type(value).__name__.endswith("Config") and hasattr(value, "__dict__") and \
        not isinstance(value, (nn.Module, torch.Tensor, type))


class _Attributes:
    """Recorded attributes (:func:`_python_attributes`), compared at C speed per namespace.

    Per namespace, one ``itemgetter`` of its recorded names and the tuple of their values
    (compared with ``==``: a value set again to an equal one, ``1`` or ``1.0``, is no
    change; the same object is no change either, so a NaN attribute is not a change at every
    call); a tensor attribute must be the same object.
    """

    def __init__(self, entries: list[tuple[dict[str, Any], str, Any]]) -> None:
        self.entries = entries
        groups: dict[int, tuple[dict[str, Any], list[str], list[Any]]] = {}
        self._tensors: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for namespace, name, value in entries:
            if isinstance(value, torch.Tensor):
                self._tensors.append((namespace, name, value))
                continue
            group = groups.setdefault(id(namespace), (namespace, [], []))
            group[1].append(name)
            group[2].append(value)
        self._groups = [(namespace, operator.itemgetter(*names),
                         tuple(values) if len(values) > 1 else values[0])
                        for namespace, names, values in groups.values()]

    def same(self) -> bool:
        """Whether every recorded attribute still holds its recorded value."""
        try:
            return all((now := get(namespace)) is values or now == values
                       for namespace, get, values in self._groups) \
                and all(namespace.get(name, _ABSENT) is value
                        for namespace, name, value in self._tensors)
        except (KeyError, RuntimeError):  # deleted; a tensor where a number was
            return False


def _sharing(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """Which tensors are one object: for each, the index of the first one that is it."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), k) for k, t in enumerate(tensors))


def _hook_dicts(module: nn.Module) -> tuple[dict[int, Any], ...]:
    """The dictionaries of a module's forward and backward hooks (and pre-hooks)."""
    return (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
            module._backward_pre_hooks)


def _refuse_nested(module: Any) -> None:
    """One plan per model: a part already wrapped by optmem cannot be wrapped again.

    Raises
    ------
    OptmemInputError
        Naming the wrapped part.
    """
    parts = module if isinstance(module, Sequence) else [module]
    for part in parts:
        if not isinstance(part, nn.Module):
            continue
        if isinstance(part, PlannedModule):
            raise OptmemInputError(f"{type(part.module).__name__} is already wrapped by optmem:"
                                   " wrap the plain model (cmodel.module) instead",
                                   field="module")
        for name, sub in part.named_modules():
            if isinstance(sub, PlannedModule):
                raise OptmemInputError(
                    f"{type(part).__name__}.{name} is already wrapped by optmem: wrap either "
                    f"the whole {type(part).__name__} or that part, not both (one plan per "
                    "model)", field="module")


def signature_key(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  tensors: Any = None) -> Any:
    """What an exported chain is specialised to (see the module docstring).

    ``tensors``: :meth:`TensorState.key` of the module (its parameters' dtypes and devices,
    and the version of its structure).
    """
    leaves, spec = tree_flatten((args, dict(sorted(kwargs.items()))))
    parts: list[tuple[Any, ...]] = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            parts.append(("T", tuple(v.shape), v.dtype, str(v.device),
                          bool(v.requires_grad), memory_layout(v)))
        else:
            parts.append(("V", type(v).__name__, _hashable(v)))
    autocast = tuple(autocast_modes())
    return (repr(spec), tuple(parts), module.training, autocast, tensors)


def memory_layout(t: torch.Tensor) -> str | tuple[int, ...]:
    """How ``t``'s elements lie in memory, whatever its sizes (part of :func:`signature_key`).

    ``"contiguous"``, ``"channels_last"`` (4-d), ``"channels_last_3d"`` (5-d), else the
    order of its dimensions from the largest stride to the smallest (a transposed input).
    A graph holds what the sample's layout made of stride-dependent code: ``x.contiguous()``
    of a contiguous sample is no op in it, and a transposed call would fail in its ``view``.

    Examples
    --------
    >>> x = torch.zeros(2, 3, 4)
    >>> memory_layout(x), memory_layout(x.transpose(1, 2))
    ('contiguous', (0, 2, 1))
    >>> memory_layout(torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last))
    'channels_last'
    """
    if t.layout != torch.strided:
        return str(t.layout)
    if t.is_contiguous():
        return "contiguous"
    formats = {4: ("channels_last", torch.channels_last),
               5: ("channels_last_3d", torch.channels_last_3d)}
    if t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()][1]):
        return formats[t.dim()][0]
    strides = t.stride()
    return tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))


# ------------------------------------------------------------------ variants
@contextmanager
def leaves_no_trace(module: nn.Module, call: Any = None) -> Iterator[None]:
    """Restore the buffers and the CPU/CUDA RNG state of ``module`` on exit.

    Extracting and profiling run the model's code (BatchNorm statistics and counters,
    random draws): the model must not notice, not even through the version counters of
    buffers that code only read (:func:`~optmem.pytorch.memory.buffers_restored`), or the
    states of the generators it holds (:func:`~optmem.pytorch.hooks.module_generators`) or
    that ``call`` (the arguments extracted or profiled on) passes it
    (``generator=torch.Generator()``). Nor must the caller's tools (``FlopCounterMode``,
    ``MemTracker``): they are suspended within
    (:func:`~optmem.pytorch.hooks.callers_tools_suspended`). The CUDA RNG states restored
    are those of every device holding a parameter, a buffer or a tensor of ``call``: a
    model whose CUDA tensors are all parameters (no buffer) draws its dropout masks there.
    The parameters' ``.grad`` are put back too (:func:`~optmem.pytorch.memory.
    gradients_restored`): a custom autograd Function kept whole may write them itself (HF
    Reformer's reversible layers run ``.backward()`` on their own modules inside their
    backward), past the stages' own parameters that profiling clears.
    """
    leaves = tree_flatten(call)[0]
    parameters = list(module.parameters())
    tensors = [*parameters, *module.buffers(),
               *(v for v in leaves if isinstance(v, torch.Tensor))]
    devices = cuda_indices(tensors)
    generators = module_generators(module)
    generators += [v for v in leaves if isinstance(v, torch.Generator)]
    with callers_tools_suspended(), torch.random.fork_rng(devices=devices), \
            generators_restored(generators), buffers_restored([module]), \
            gradients_restored(parameters):
        yield


def graph_free(value: Any) -> Any:
    """``value`` with each tensor that requires grad replaced by a leaf with no history.

    Extracting, profiling and measuring run forwards and backwards on a sample or a call. A
    tensor of it may come out of the caller's own graph (a backbone's input made by the
    parent's embedding, ``model.model = op.checkpoint(model.model, ...)``): a backward
    that reached it would run on into that graph, free its saved tensors (the caller's own
    backward then fails: "Trying to backward through the graph a second time") and leave
    gradients in the caller's parameters. A leaf that requires grad is replaced too, so its
    ``.grad`` is never touched. Same storage, same ``requires_grad``; a tensor met twice
    gives one leaf (aliasing is kept).
    """
    seen: dict[int, torch.Tensor] = {}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if not t.requires_grad:
            return t
        if id(t) not in seen:
            seen[id(t)] = t.detach().requires_grad_()
        return seen[id(t)]

    return tree_map_only(torch.Tensor, leaf, value)


def _extract_variant(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     planner: Planner, profile: ProfileOptions, chain: Chain | None,
                     name: str, like: _Variant | None,
                     solve: Callable[[Chain], Result] | None = None,
                     ext: Extraction | None = None, local: bool = False) -> _Variant:
    with parameters_unmodified(module), leaves_no_trace(module, (args, kwargs)), \
            root_hooks_suspended(module):  # the wrapper calls them around the plan
        if ext is None:
            with constants_tracked():
                ext = extracted_call(module, args, kwargs, profile.extract)
        flat = ext.flatten(args, kwargs)
        ctx = traced_side_inputs(ext, flat)
        return _make_variant(ext, ext.stages, ext.chain_input(flat), planner, profile,
                             chain, name, ctx=ctx, like=like,
                             plain=plain_measure(module, args, kwargs, profile,
                                                 observers=ext.observers.hook_ids),
                             solve=solve,
                             local=local, unmodified=module)


def extracted_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   method: str, *, allow_single: bool = False, observe: bool = True
                   ) -> Extraction:
    """:func:`extract_program` of a call, or the model's own error if the call fails on it.

    A wrong input (a float ``input_ids``, an id past the vocabulary) makes the export fail,
    and the extractor's error blames the model ("cannot extract a chain from ... pass an
    nn.Sequential of its blocks"). When extraction fails, the model is called plainly on the
    same arguments (under ``no_grad``; the caller restores buffers and RNG states): if that
    raises too, its exception is raised, as a call of the plain model would.
    ``allow_single`` and ``observe`` go to :func:`extract_program` (the pipeline extracts
    with ``allow_single=True, observe=False``; stop 85).
    """
    from optmem.pytorch.process_groups import refuse_tensor_parallel_export

    refuse_tensor_parallel_export(module)
    try:
        return extract_program(module, args, kwargs, method=method, observe=observe,
                               allow_single=allow_single)
    except OptmemInputError as exc:
        plain = _plain_call_error(module, args, kwargs)
        if plain is None:
            raise
        plain.add_note(f"optmem: raised by {type(module).__name__} itself on this call "
                       f"(extracting it failed: {exc.reason[:200]})")
        with contextlib.suppress(AttributeError):  # a failed extraction all the same
            setattr(plain, _PLAIN_ERROR, True)  # (:meth:`_branch_variant` counts it)
        raise plain from None


_PLAIN_ERROR = "_optmem_failed_extraction"
"""Set on the model's own exception that :func:`extracted_call` raises (failed extraction)."""


def _plain_call_error(module: nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Exception | None:
    """The exception ``module(*args, **kwargs)`` raises under ``no_grad``, or ``None``.

    Running out of memory is no verdict on the call (``None``): the extractor's error stays.
    """
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    except (torch.OutOfMemoryError, MemoryError):
        return None
    except Exception as exc:  # noqa: BLE001 - handed back, raised by the caller
        return exc
    return None


def traced_side_inputs(ext: Extraction, flat: Sequence[Any]) -> SideInputs:
    """The side inputs of a call, with the peak of the storages computing them made.

    The side program runs once per call, before the chain, and its temporaries (an
    ``arange`` before its ``sin``) may peak above the side inputs it leaves:
    ``peak_bytes`` goes to the chain (``extra["side_input_peak"]``) and to the bound's
    allowance (:func:`~optmem.pytorch.memory.plan_allowance`).
    """
    from optmem.pytorch.memory import StorageTrace

    with StorageTrace() as trace:
        ctx = ext.side_inputs(flat)
    ctx.peak_bytes = trace.peak()
    return ctx


def _make_variant(ext: Extraction | None, fine: list[Stage], x: Any, planner: Planner,
                  profile: ProfileOptions, chain: Chain | None, name: str,
                  ctx: SideInputs | None, like: _Variant | None,
                  plain: Callable[[], int | None] | None = None,
                  solve: Callable[[Chain], Result] | None = None,
                  local: bool = False, unmodified: nn.Module | None = None) -> _Variant:
    """Merge (``max_stages``), profile and solve one list of stages, build its executor.

    The decision runs once for every rank (:func:`plan_stages`), or in this process alone
    with ``local`` (a new size, see *Sizes*); the executor is built on every rank. ``plain``
    measures the plain model's real peak (recorded in the chain); ``solve`` (default
    ``planner.solve``) decides the plan; ``unmodified``: as for :func:`plan_stages`.
    """
    from optmem.pytorch.process_groups import decision_group

    groups, stages, chain, result = plan_stages(
        fine, x, profile, name, ctx, solve or planner.solve, chain=chain, like=like,
        group=None if local else decision_group(planner.process_group,
                                                [s.module for s in fine]),
        plain=plain, unmodified=unmodified)
    executor = planner.executor(stages, result.plan)
    return _Variant(ext, stages, groups, tuple(s.name for s in fine), chain, result, executor,
                    limit=solved_limit(planner.memory_limit, result, chain))


def solved_limit(wanted: int | str, result: Result, chain: Chain) -> int:
    """The memory limit in bytes a plan was solved for (``"min"``: the result's own).

    A percentage (``"60%"``) is of ``chain``'s store-all peak, as the planner reads it.
    """
    from optmem.units import relative_memory

    if wanted == "min":
        return int((result.memory_limit or 0) * result.unit)
    return relative_memory(wanted, chain.store_all_peak(), field="memory_limit")


def plain_measure(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  profile: ProfileOptions, loss_fn: Callable[[Any], Any] | None = None,
                  observers: Collection[int] = ()) -> Callable[[], int | None] | None:
    """What measures the plain step ``module(*args, **kwargs)`` (``None`` on meta).

    :func:`~optmem.pytorch.memory.plain_step_peak` of the call (of ``loss_fn`` of its output
    when given), leaving no trace (buffers, RNG state and gradients restored), without
    calling the forward hooks whose ids are in ``observers`` (the extraction's
    :attr:`~optmem.pytorch.extract.Extraction.observers`: they see the user's steps only).
    """
    from optmem.pytorch.memory import plain_step_peak

    if profile.device == "meta" or any(t.is_meta for t in value_tensors((args, kwargs))):
        return None

    def call() -> Any:
        out = module(*args, **kwargs)
        return out if loss_fn is None else loss_fn(out)

    def measure() -> int | None:
        with leaves_no_trace(module, (args, kwargs)), observers_silenced(module, observers):
            return plain_step_peak(call, module, (args, kwargs))

    return measure


def _plain_measure(stages: Sequence[Stage], x: Any,
                   profile: ProfileOptions) -> Callable[[], int | None] | None:
    """:func:`plain_measure` of an ``nn.Sequential`` or a list of stages (run in order)."""
    return plain_measure(nn.Sequential(*[s.module for s in stages]), (x,), {}, profile)


def with_plain_peak(chain: Chain, peak: int | None) -> Chain:
    """``chain`` with the plain model's real peak recorded (:data:`PLAIN_PEAK`).

    ``None`` records "not measured" (no fast path), so that it is not measured later on
    another call than the chain's (a loss outside the model, a meta profile).
    """
    extra = dict(chain.extra or {})
    extra["profile"] = {**(extra.get("profile") or {}),
                        PLAIN_PEAK: None if peak is None else int(peak)}
    return dataclasses.replace(chain, extra=extra)


def plan_stages(fine: list[Stage], x: Any, profile: ProfileOptions, name: str,
                ctx: SideInputs | None, solve: Callable[[Chain], Result], *,
                chain: Chain | None = None, like: _Variant | None = None, group: Any = None,
                plain: Callable[[], int | None] | None = None,
                unmodified: nn.Module | None = None
                ) -> tuple[list[tuple[int, int]] | None, list[Stage], Chain, Result]:
    """Merge (``profile.max_stages``), profile and ``solve`` a list of stages, once.

    The merge, the profile and the solve run on rank 0 of ``group``
    (:func:`~optmem.pytorch.distributed.run_once`; ``None``: here), so every rank follows
    the same plan; stages holding ``DTensor`` s (tensor parallelism, whose forward is a
    collective) are profiled by every rank at once, and rank 0's decision is kept. ``x``
    is the chain input and ``ctx`` the side inputs of the sample call (``None`` for an
    ``nn.Sequential`` or a list of stages); a profiled chain goes through
    ``profile.adjust_chain`` before the solve; ``plain()`` measures the plain model's real
    activation peak, recorded as ``chain.extra["profile"]["plain_peak"]`` unless the chain
    has it. ``unmodified``: the model whose parameters the profile and ``plain()`` must
    leave as they were (:func:`~optmem.pytorch.hooks.parameters_unmodified`, checked on
    rank 0 within the decision, so that every rank raises its error). Returns the merge
    groups (or ``None``), the merged stages, the chain and the result.
    """
    from optmem.pytorch.process_groups import holds_dtensors, run_once

    fine_names = tuple(s.name for s in fine)
    limit = profile.max_stages

    def merged(groups: list[tuple[int, int]] | None) -> list[Stage]:
        return fine if groups is None else merge_stages(fine, limit, costs=None,  # type: ignore[arg-type]
                                                        groups=groups)

    def decide() -> tuple[list[tuple[int, int]] | None, Chain, Result]:
        groups = None
        if limit is not None and len(fine) > limit:
            if like is not None and like.groups is not None and like.fine_names == fine_names:
                groups = like.groups
            elif chain is None and profile.device != "meta":
                quick = profile_stage_chain(fine, x, profile, name, ctx, repeats=1, warmup=1,
                                            measure_segments=False)
                costs = [f + b for f, b in zip(quick.fwd_time, quick.bwd_time, strict=True)]
                groups = stage_groups(len(fine), limit, costs)
            else:
                groups = stage_groups(len(fine), limit, None, fine)
        stages = merged(groups)
        prof = chain
        if prof is None:
            same = like is not None and tuple(s.name for s in like.stages) == \
                tuple(s.name for s in stages)
            prof = profile_stage_chain(stages, x, profile, name, ctx,
                                       time_model=_scaled_times(like, stages) if same else None)
            if same:
                assert like is not None
                prof = _same_segment_cost(prof, like.chain)
            if profile.adjust_chain is not None:
                prof = profile.adjust_chain(stages, prof)
        else:
            check_given_chain(prof, stages)
            if not profile.share_carried:  # a profile_chain file counts carried values once
                from optmem.pytorch.profile import unshared_carried

                prof = unshared_carried(prof)
        if plain is not None and PLAIN_PEAK not in ((prof.extra or {}).get("profile") or {}):
            prof = with_plain_peak(prof, plain())
        return groups, prof, solve(prof)

    def checked() -> tuple[list[tuple[int, int]] | None, Chain, Result]:
        if unmodified is None:
            return decide()
        with parameters_unmodified(unmodified):
            return decide()

    groups, chain, result = run_once(checked, group,
                                     together=holds_dtensors(s.module for s in fine))
    return groups, merged(groups), chain, result


def check_given_chain(chain: Chain, stages: Sequence[Stage]) -> None:
    """Refuse a chain that was not profiled on these stages (``chain=`` of another model).

    The stage count, and the parameter bytes of every stage (``weight_size``, exact in a
    profile of bytes), must match; a chain with no weights recorded is checked on its
    length only.

    Raises
    ------
    OptmemInputError
        On the ``chain`` field, naming the first stage that differs.
    """
    if chain.length != len(stages):
        raise OptmemInputError(
            f"the given chain has {chain.length} stages but the module has {len(stages)}",
            field="chain")
    if chain.memory_unit != "B" or not any(chain.weight_size):
        return
    for k, stage in enumerate(stages):
        have = storage_bytes(list(stage.module.parameters()))
        if have != chain.weight_size[k]:
            raise OptmemInputError(
                f"the given chain was profiled on another model: its stage {k + 1} "
                f"({chain.stage_names[k]}) has {chain.weight_size[k]} bytes of parameters, "
                f"the module's ({stage.name}) {have}; profile this module "
                "(optmem.pytorch.profile_chain(module, sample)) or leave chain= out",
                field="chain")


def stage_groups(n: int, limit: int, costs: Sequence[float] | None,
                 stages: Sequence[Stage] | None = None) -> list[tuple[int, int]]:
    """At most ``limit`` contiguous groups of ``n`` stages balancing ``costs``.

    Without ``costs``, each stage's static cost (:func:`optmem.pytorch.extract.stage_cost`).
    """
    from optmem.pytorch.extract import partition_costs, stage_cost

    if costs is None:
        assert stages is not None
        costs = [stage_cost(s.module) for s in stages]
    return partition_costs(costs, limit)


def profile_stage_chain(stages: Sequence[Stage], x: Any, profile: ProfileOptions, name: str,
                        ctx: SideInputs | None, *, repeats: int | None = None,
                        warmup: int | None = None, time_model: Any = None,
                        loss_fn: Any = None, measure_segments: bool = True) -> Chain:
    """Profile ``stages`` into a chain with the options of ``profile`` (side inputs ``ctx``)."""
    from optmem.pytorch.profile import profile_stages, unshared_carried

    kw = dict(device=profile.device, repeats=repeats or profile.repeats,
              warmup=profile.warmup if warmup is None else warmup, name=name,
              progress=profile.progress, time_model=time_model or profile.time_model,
              loss_fn=loss_fn, measure_segments=measure_segments and profile.measure_segments,
              segment_timer=profile.segment_timer)
    for key in ("op_overhead", "op_overhead_ratio"):
        if getattr(profile, key) is not None:
            kw[key] = getattr(profile, key)
    if ctx is None:
        chain = profile_stages(stages, x, **kw)
        return chain if profile.share_carried else unshared_carried(chain)
    if profile.device == "meta":
        raise OptmemInputError("device='meta' profiles an nn.Sequential or a list of stages "
                               "only; profile an exported model on a real device",
                               field="device")
    with side_inputs(ctx), _side_buffers(stages, ctx):
        chain = profile_stages(stages, x, **kw)
    if not profile.share_carried:
        chain = unshared_carried(chain)
    # a side input that is the chain input itself (ResNet's pixel_values, read again for a
    # check) is a^0, counted in the chain: it was counted twice until stop 51 (a hunt)
    chain_input = {t.untyped_storage()._cdata for t in value_tensors(x)}
    side = sum(_storage_bytes(ctx.values(), skip=chain_input))
    extra = dict(chain.extra or {})
    extra["side_input_bytes"] = side
    extra["side_input_peak"] = max(side, ctx.peak_bytes or 0)
    return dataclasses.replace(chain, extra=extra)


def _storage_bytes(values: Any, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
    seen: dict[int, int] = {}
    for v in values:
        for t in value_tensors(v):
            if t.untyped_storage()._cdata not in skip:
                seen[t.untyped_storage()._cdata] = int(t.untyped_storage().nbytes())
    return list(seen.values())


def _same_segment_cost(chain: Chain, like: Chain) -> Chain:
    """``chain`` with the segment cost measured on ``like`` (same stages, other shapes)."""
    measured = (like.extra or {}).get("profile") or {}
    extra = dict(chain.extra or {})
    profile = dict(extra.get("profile") or {})
    for key in ("segment_cost_ms", "segment_cost_source", "segment_cost"):
        if key in measured:
            profile[key] = measured[key]
    extra["profile"] = profile
    return dataclasses.replace(chain, extra=extra)


def _scaled_times(like: _Variant | None, stages: Sequence[Stage]) -> Any:
    """A time model giving the first profile's times, scaled by the output size."""
    assert like is not None
    index = {id(s.module): k for k, s in enumerate(stages)}
    base = like.chain

    def time_model(module: nn.Module, x: Any, out: Any) -> tuple[float, float]:
        k = index[id(module)]
        size = sum(t.numel() * t.element_size() for t in value_tensors(out))
        scale = size / base.output_size[k] if base.output_size[k] else 1.0
        return base.fwd_time[k] * scale, base.bwd_time[k] * scale

    return time_model


# ------------------------------------------------------------------ executors
def _run_executor(executor: nn.Module, x: Any, compiled: CompileRequest) -> Any:
    run = getattr(executor, "_forward", None)
    if run is None:
        return executor(x)
    return run(x, compiled)


def _compile_executor(executor: nn.Module, options: dict[str, Any]) -> None:
    compile_stages = getattr(executor, "compile_stages", None)
    if compile_stages is None:
        raise OptmemInputError(f"{type(executor).__name__} cannot compile its stages",
                               field="compile")
    compile_stages(**options)


@torch.compiler.disable
def _forward_disabled(module: PlannedModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                      options: CompileRequest) -> Any:
    """The wrapper's forward outside dynamo (a graph break); the stages run compiled.

    ``options``: the enclosing compile's (:func:`~optmem.pytorch.execute.run_compiled`),
    used unless :meth:`PlannedModule.compile` gave some; ``None`` when dynamo compiles
    nothing new (its recompile limit hit): as :meth:`PlannedModule.compile` asked.
    """
    return module._forward(args, kwargs, options)
