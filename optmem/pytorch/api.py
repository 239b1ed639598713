"""User API: ``checkpoint``, ``offload`` and ``remat_offload`` of a model in one call.

Three steps, as rotor's ``Checkpointable`` (digest ``rotor.md`` section 6): extract the
chain of stages (:mod:`optmem.pytorch.extract`: an ``nn.Sequential`` is flattened, any
other module is exported with ``torch.export``, ``torch.fx`` as fallback), profile it on the
sample (:mod:`optmem.pytorch.profile`), solve the problem with any registered method
(``dp`` by default) and wrap the model in a module that follows the plan and otherwise
behaves like the model (:class:`~optmem.pytorch.wrapper.PlannedModule`).

``memory_limit`` bounds the *activation* memory of one training step as the chain model
counts it: the input batch, the stored activations, tapes and gradients of activations
(plus the measured overheads on CUDA). Parameters, their gradients, optimizer state and
side inputs (masks, position tables: computed once per step beside the chain) are not part
of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.pytorch.arguments import (
    check_module,
    check_options,
    flag,
    plan_argument,
)
from optmem.pytorch.extract import Stage, derives_from, extract_program
from optmem.pytorch.hooks import parameters_unmodified
from optmem.pytorch.planning import Planner
from optmem.pytorch.profile import TimeModel
from optmem.pytorch.wrapper import (
    GIVEN_SOURCE,
    GivenPlan,
    PlannedModule,
    ProfileOptions,
    call_of,
    canonical_call,
    graph_free,
    is_plain_chain,
    leaves_no_trace,
    solved_limit,
    traced_side_inputs,
)
from optmem.result import Result
from optmem.units import parse_size

__all__ = ["CheckpointedModule", "OffloadedModule", "PlannedModule", "RematOffloadedModule",
           "checkpoint", "offload", "profile_chain", "remat_offload", "smallest_limit",
           "solve_chain"]


def solve_chain(chain: Chain, memory_limit: int | str, method: str = "dp", *,
                slots: int | None = None, variant: str | None = None,
                time_limit_s: float | None = None, **extra: Any) -> Result:
    """Solve the checkpoint problem of ``chain`` and raise a clear error without a plan.

    The error names the smallest limit at which ``method`` finds a plan after
    discretisation: passing that figure back works.
    """
    return Planner("checkpoint", memory_limit, method, slots=slots, variant=variant,
                   time_limit_s=time_limit_s, extra=dict(extra)).solve(chain)


def smallest_limit(chain: Chain, method: str = "dp", *, slots: int | None = None) -> int:
    """The smallest memory limit (bytes) at which ``method`` finds a checkpoint plan.

    Starts from the method's ``min_feasible_memory`` when it reports one (the DPs do),
    otherwise from the input size, and returns a limit at which a solve was seen to succeed.
    """
    return Planner("checkpoint", "min", method, slots=slots).smallest_limit(chain)


class CheckpointedModule(PlannedModule):
    """A model trained with a checkpointing plan under a memory limit.

    Attributes
    ----------
    chain
        The profiled chain (bytes, milliseconds).
    result
        The :class:`~optmem.result.Result` of the solve: ``plan``, ``objective`` (expected
        makespan in ms), ``peak_memory`` in units of ``unit`` bytes.
    """

    @property
    def expected_peak_bytes(self) -> int:
        """Predicted activation peak in bytes: the plan replayed on the (byte) chain.

        At most ``result.peak_memory * result.unit`` (the peak after rounding sizes up to
        the discretisation unit, which is what the limit was checked against).
        """
        from optmem.simulate import simulate_checkpoint

        return int(simulate_checkpoint(self.chain, self.result.plan).peak_memory)

    def set_plan(self, plan: Sequence[Any]) -> None:
        """Run another plan on the main signature's stages (validated by the executor)."""
        self.executor.set_plan(plan_argument(plan))  # type: ignore[operator]

    def resolve(self, memory_limit: int | str | None = None, method: str | None = None,
                **options: Any) -> Result:
        """Solve again (new limit and/or method) and switch to the new plan.

        After :meth:`use_plan`, the defaults are the given plan's limit (else the planner's)
        and the planner's method: a given plan has neither a method nor a limit of its own.
        """
        planner = self._planner
        given = self.result.report.get("source") == GIVEN_SOURCE
        if memory_limit is None and given:
            memory_limit = self._main.limit if self._main.limit is not None else \
                planner.memory_limit
        if memory_limit is None:
            if self.result.memory_limit is None:
                raise OptmemInputError("the current plan has no memory limit: give one",
                                       field="memory_limit")
            memory_limit = self.result.memory_limit * self.result.unit
        for key in options:
            if key in ("kind", "executor_options") or not hasattr(planner, key):
                raise OptmemInputError(f"unknown solver option {key!r}", field=key)
        # a new planner (checked by its __post_init__), kept only once it has a plan: a
        # refused limit or option left the old one changed (stop 84)
        planner = dataclasses.replace(
            planner, **options, memory_limit=memory_limit,
            method=method or (planner.method if given else self.result.method))
        result = planner.solve(self.chain)
        self._planner = planner
        self._set_result(result, limit=solved_limit(planner.memory_limit, result, self.chain))
        return result

    def use_plan(self, plan: Sequence[str], method: str = "custom",
                 memory_limit: int | str | None = None) -> Result:
        """Run a given plan (validated by the simulator); ``.result`` describes it.

        ``memory_limit``: the limit the plan is run under (``None``: none). With one, the
        store-all fast path applies as after :meth:`resolve` (the model itself is called
        when its measured plain peak fits); the plan is not checked against it.

        The plan is kept when the wrapper extracts the model again (a hook registered, a
        submodule replaced, a new call signature) if the new chain has the same number of
        stages and the plan replays on it (within ``memory_limit`` when given); otherwise
        one :class:`UserWarning` says why it was dropped and the planner solves the new
        chain. :meth:`resolve` returns to the planner's plans.
        """
        plan = plan_argument(plan)
        result = GivenPlan(tuple(str(p) for p in plan), method, self.chain.length,
                           None).result(self.chain)
        limit = None if memory_limit is None else parse_size(memory_limit,
                                                             field="memory_limit")
        self._set_result(result, plan, limit, given=True)
        return result


class OffloadedModule(PlannedModule):
    """A model trained with an offloading plan.

    Store-all compute; saved tensors moved to host memory and back over a link
    (:class:`~optmem.pytorch.offload.OffloadedChain`).
    """

    _plan_has_jvp = True  # saved-tensor hooks on the model's own autograd graph
    _plan_packs_saved_tensors = True
    _one_liner = "op.offload"


class RematOffloadedModule(PlannedModule):
    """A model trained with a remat + offload plan.

    Recomputation and transfers (:class:`~optmem.pytorch.remat_offload.RematOffloadChain`).
    """

    _plan_packs_saved_tensors = True  # its transfers: saved_tensors_hooks
    _one_liner = "op.remat_offload"


_PROFILE_OPTIONS = ("device", "repeats", "warmup", "progress", "time_model", "max_stages",
                    "extract", "dynamic", "adjust_chain", "op_overhead", "op_overhead_ratio",
                    "measure_segments", "segment_timer")
_SOLVER_OPTIONS = ("slots", "variant", "time_limit_s", "process_group", "extra")
_EXECUTOR_OPTIONS = {"checkpoint": ("preserve_rng_state", "restore_buffers", "strip_suffix"),
                     "offload": (), "remat_offload": ("preserve_rng_state", "restore_buffers")}


def build_planned(cls: type[PlannedModule], kind: str, module: Any, sample: Any,
                  memory_limit: int | str, method: str, bandwidth: float | str | None,
                  options: dict[str, Any]) -> Any:
    """Split the options of a one-liner, then extract, profile, solve and wrap.

    Under ``torch.inference_mode()`` it runs with inference mode off, on a copy of the
    sample's inference tensors (:func:`outside_inference_mode`): profiling runs backwards.
    """
    check_module(module)
    extra = options.get("extra")
    check_options({**options, **(extra if isinstance(extra, Mapping) else {})})  # stop 84
    refuse_inference_tensors(module)
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return build_planned(cls, kind, module, outside_inference_mode(sample),
                                 memory_limit, method, bandwidth, options)
    sample = graph_free(sample)  # its steps must not run into the caller's graph
    options = dict(options)
    chain = options.pop("chain", None)
    fast_path = flag(options.pop("fast_path", True), "fast_path")
    tune = {k: options.pop(k) for k in _AUTOTUNE_OPTIONS if k in options}
    pick = {group: {k: options.pop(k) for k in keys if k in options}
            for group, keys in (("profile", _PROFILE_OPTIONS), ("solver", _SOLVER_OPTIONS),
                                ("executor", _EXECUTOR_OPTIONS[kind]))}
    if options:
        raise TypeError(f"{kind}() got unexpected keyword argument(s) "
                        f"{', '.join(sorted(options))}")
    refuse_meta_tensors(module, pick["profile"].get("device"))
    refuse_random_adapters(module)
    planner = Planner(kind, memory_limit, method, bandwidth=bandwidth,
                      executor_options=pick["executor"], **pick["solver"])
    # a value carried beside the boundaries is counted once for rotor's DPs only: their
    # plans never copy it twice (profile.carried_generations_error)
    profile = ProfileOptions(**pick["profile"],
                             share_carried=kind == "checkpoint" and method == "dp")
    wants_tuning = flag(tune.pop("autotune", False), "autotune")
    if wants_tuning:
        _check_autotune(kind, planner)
        timer = tune.get("autotune_timer")
        if timer is not None and not callable(timer):  # was a raw TypeError mid-tuning
            raise OptmemInputError(f"autotune_timer: expected a function (step, candidate) "
                                   f"-> milliseconds, got {timer!r}", field="autotune_timer")
    planned = cls.build(module, sample, planner, profile, chain=chain, fast_path=fast_path)
    if wants_tuning:
        from optmem.pytorch.autotune import AUTOTUNE_ROUNDS, autotune

        rounds = tune.get("autotune_rounds")
        autotune(planned, sample, timer=tune.get("autotune_timer"),
                 rounds=AUTOTUNE_ROUNDS if rounds is None else rounds)
    return planned


_AUTOTUNE_OPTIONS = ("autotune", "autotune_timer", "autotune_rounds")


def refuse_inference_tensors(module: Any) -> None:
    """One clear error for a model whose parameters or buffers are inference tensors.

    Tensors made under ``torch.inference_mode()`` (the model built or loaded there) cannot
    be saved for a backward, nor updated outside it: the model cannot be trained.

    Raises
    ------
    OptmemInputError
        On the ``module`` field, naming the first such parameter or buffer.
    """
    parts = module if isinstance(module, Sequence) else [module]
    for part in parts:
        if not isinstance(part, nn.Module):
            continue
        for name, t in (*part.named_parameters(), *part.named_buffers()):
            if t.is_inference():
                raise OptmemInputError(
                    f"{type(part).__name__}.{name} is an inference tensor (made under "
                    "torch.inference_mode()), which autograd cannot train: build or load "
                    "the model outside torch.inference_mode() before wrapping it",
                    field="module")


def refuse_random_adapters(module: Any) -> None:
    """One clear error for PEFT LoHa or LoKr adapters in a model wrapped in training mode.

    PEFT's LyCORIS layers (``LoHaConfig``, ``LoKrConfig``) draw ``torch.rand(1)`` against
    their ``module_dropout`` at every call in training, at ``0.0`` too, and branch on it:
    no extracted graph holds a branch on a random value, and extraction failed with the
    generic advice to pass an ``nn.Sequential`` of blocks, whose blocks draw it as well
    (stop 84). In eval mode they draw nothing.

    Raises
    ------
    OptmemInputError
        On the ``module`` field, naming the first such layer.
    """
    parts = module if isinstance(module, Sequence) else [module]
    for part in parts:
        if not isinstance(part, nn.Module):
            continue
        for name, sub in part.named_modules():
            if sub.training and derives_from(type(sub), "LycorisLayer", "peft"):
                raise OptmemInputError(
                    f"{type(part).__name__}.{name} is a PEFT LyCORIS adapter layer "
                    f"({type(sub).__module__}.{type(sub).__name__}), which in training draws "
                    "torch.rand(1) against its module_dropout at every call (at 0.0 too) and "
                    "branches on it: no extracted graph holds that. Train it without optmem, "
                    "or use LoRA (peft.LoraConfig, use_dora=True included), which trains "
                    "as the model", field="module")


def refuse_meta_tensors(module: Any, device: Any) -> None:
    """One clear error for a model on the meta device profiled on another device.

    A model built under ``torch.device("meta")`` has no values: wrapping profiles it on the
    sample's device, where its first op failed with torch's "Tensor.item() cannot be
    called on meta tensors" or "Tensor on device meta is not on the expected device cpu!"
    (stop 83). Wrapped once materialised (``model.to_empty(device=...)``, then its
    weights initialised), it trains as the model, and ``cmodel.to_empty(...)`` of a wrapper
    keeps training as the model's does. ``device="meta"`` (an ``nn.Sequential`` or a list
    of stages) profiles a meta model as it is.

    Raises
    ------
    OptmemInputError
        On the ``module`` field, naming the first meta parameter or buffer.
    """
    if str(device).split(":")[0] == "meta":  # a bad device is the profile's error
        return
    parts = module if isinstance(module, Sequence) else [module]
    for part in parts:
        if not isinstance(part, nn.Module):
            continue
        for name, t in (*part.named_parameters(), *part.named_buffers()):
            if t.is_meta:
                raise OptmemInputError(
                    f"{type(part).__name__}.{name} is on the meta device (the model was "
                    "built under torch.device('meta')), which has no values to profile: "
                    "materialise and initialise the model first (model.to_empty(device="
                    "'cpu' or 'cuda'), then its init, e.g. model.apply(model._init_weights) "
                    "or reset_parameters()), then wrap it",
                    field="module")


def outside_inference_mode(sample: Any) -> Any:
    """``sample`` with each inference tensor copied into a normal one (call it outside).

    A model wrapped under ``torch.inference_mode()`` is profiled with inference mode off
    (its backward is measured): the sample's tensors made under inference mode cannot be
    used there, their copies can.
    """
    if isinstance(sample, Mapping):  # a tokenizer's BatchEncoding: its tensors too
        sample = dict(sample)
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t.is_inference() else t,
                         sample)


def _check_autotune(kind: str, planner: Planner) -> None:
    """One clear error where measured selection does not apply (see :func:`checkpoint`)."""
    from optmem.pytorch.process_groups import resolve_group

    if kind != "checkpoint":
        raise OptmemInputError(f"autotune is a checkpoint option (it re-solves the "
                               f"checkpoint plan under other per-op and per-segment "
                               f"charges); {kind} plans are not chosen that way",
                               field="autotune")
    if resolve_group(planner.process_group) is not None:
        raise OptmemInputError("autotune times the plans in this process: with several "
                               "ranks they could choose differently; pass "
                               "process_group='local' or autotune=False", field="autotune")


def checkpoint(
    module: nn.Module | Sequence[nn.Module | Stage],
    sample: Any,
    memory_limit: int | str = "2GiB",
    method: str = "dp",
    *,
    max_stages: int | None = None,
    slots: int | None = None,
    variant: str | None = None,
    time_limit_s: float | None = None,
    chain: Chain | None = None,
    device: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    progress: bool | None = None,
    time_model: TimeModel | None = None,
    preserve_rng_state: bool = True,
    restore_buffers: bool = True,
    strip_suffix: bool = True,
    extract: str = "auto",
    dynamic: bool = True,
    process_group: Any = None,
    segment_cost: float | None = None,
    op_overhead: float | None = None,
    op_overhead_ratio: float | None = None,
    fast_path: bool = True,
    autotune: bool = False,
    autotune_timer: Callable[[Callable[[], None], Any], float] | None = None,
    autotune_rounds: int | None = None,
) -> CheckpointedModule:
    """Return ``module`` wrapped to train with the optimal checkpointing plan under a limit.

    Parameters
    ----------
    module
        Any ``nn.Module`` (exported with ``torch.export``, ``torch.fx`` as fallback; an
        ``nn.Sequential`` is flattened), or a list of stage modules.
    sample
        A call like the ones the module will train on: a tensor (one argument), a tuple
        (positional arguments) or a dict (keyword arguments, e.g. ``{"input_ids": ids,
        "labels": ids}``). For an ``nn.Sequential`` or a list of stages: the one input.
    memory_limit
        Activation memory for one step: bytes or a size such as ``"2GiB"``, ``"512MB"``;
        a percentage of the profiled store-all peak (``"60%"``, rounded down to a byte);
        ``"min"`` takes the smallest limit at which ``method`` finds a plan.
    method
        Any checkpoint method of the facade: ``dp`` (optimal persistent), ``dp:floating``,
        ``ilp``, ``brute``, or a baseline (``store_all``, ``recompute_all``, ``chen``,
        ``sequential``, ``revolve``).
    max_stages
        Merge the extracted stages into at most this many, balanced by measured
        forward+backward time (a quick extra profile), or by parameter count with
        ``device="meta"`` or a given ``chain``.
    slots, variant, time_limit_s
        Solver options (CONTRACT section 2 and :class:`~optmem.result.SolveOptions`).
    chain
        A chain profiled earlier for the same stages (:func:`profile_chain`; skips
        profiling).
    device, repeats, warmup, progress, time_model
        Profiling options (:func:`~optmem.pytorch.profile.profile_stages`).
    preserve_rng_state, restore_buffers, strip_suffix
        Executor options (:class:`~optmem.pytorch.execute.CheckpointedChain`).
    extract
        ``"auto"`` (``torch.export``, then ``torch.fx``), ``"export"`` or ``"fx"``.
    dynamic
        Calls that differ from an earlier one in tensor sizes only (another sequence
        length, a smaller last batch) share one ``torch.export`` graph with those sizes
        dynamic, and a size at most :data:`~optmem.pytorch.wrapper.SIZE_SLACK` times smaller
        than a solved one runs that plan (``docs/pytorch.md``, "Sizes"). ``False``: every
        size is exported, profiled and solved on its own.
    process_group
        Ranks that must train with the same plan (``docs/distributed.md``): by default, when
        ``torch.distributed`` is initialised, rank 0 of the default group profiles and
        solves and broadcasts the chain and the plan; a ``ProcessGroup`` does so within it;
        ``"local"`` decides in this process alone.
    segment_cost
        Milliseconds charged per recomputed segment by the ``dp`` method (its ``extra``
        option ``segment_cost``; ``docs/pytorch.md``, "What the chain counts (time)"): the
        DP then prefers fewer, longer recomputed segments. ``None`` (default): the cost the
        profile recorded for this model (1.0 ms,
        :data:`~optmem.pytorch.profile.DEFAULT_SEGMENT_COST_MS`, or a measurement with
        ``measure_segments=True``, :mod:`optmem.pytorch.segments`; 0 for a chain without
        one); ``0``: rotor's model, no charge. With a charge the result is
        ``feasible`` for the chain and ``report["model_status"] == "optimal"``: optimal
        for the chain plus the charges.
    op_overhead, op_overhead_ratio
        The profile's charge per ``F`` op, ``op_overhead + op_overhead_ratio * t`` ms for a
        stage of measured forward ``t`` (``None``: the defaults
        :data:`~optmem.pytorch.profile.DEFAULT_OP_OVERHEAD_MS` and
        :data:`~optmem.pytorch.profile.DEFAULT_OP_OVERHEAD_RATIO`; ``docs/pytorch.md``,
        "What the chain counts (time)"). Not used with a given ``chain``.
    fast_path
        The store-all fast path (``docs/pytorch.md``): when the plain model's own training
        step, measured while profiling (``chain.extra["profile"]["plain_peak"]``), fits
        ``memory_limit``, the wrapper calls the model itself (no executor, no stages).
        ``False``: the plan always runs through the executor.
    autotune, autotune_timer, autotune_rounds
        Measured plan selection (:mod:`optmem.pytorch.autotune`, ``docs/pytorch.md``),
        off by default because it makes the plan depend on timings: with ``True``, the
        DP's optima at the same limit under a few cost-model settings (the profile's
        charges, other per-op charges, a heavier segment charge), deduplicated and
        replayed within the limit, are each timed on ``sample`` (a warm-up step, then
        ``autotune_rounds`` interleaved training steps, 5 by default; the model's
        gradients, buffers and RNG state restored) and the fastest median is kept;
        ``.result.report["autotune"]`` and :meth:`summary` list them. Nothing is timed when
        the store-all fast path is taken or one plan remains. ``autotune_timer(step,
        candidate) -> ms`` replaces the wall clock (tests). Not with several ranks.

    Returns
    -------
    CheckpointedModule
        Behaves like ``module`` (call, output type, ``state_dict``, parameters shared);
        ``.result`` has the plan and predictions.

    Raises
    ------
    OptmemInputError
        When no chain can be extracted or no plan fits the limit (the message says the
        smallest feasible limit when known).

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    >>> x = torch.randn(8, 32)
    >>> cnet = checkpoint(net, x, memory_limit="6KiB", repeats=1, warmup=0)
    >>> torch.allclose(cnet(x), net(x))
    True
    >>> cnet.expected_peak_bytes <= 6 * 1024
    True
    """
    return build_planned(CheckpointedModule, "checkpoint", module, sample, memory_limit, method,
                         None, dict(max_stages=max_stages, slots=slots, variant=variant,
                                    time_limit_s=time_limit_s, chain=chain, device=device,
                                    repeats=repeats, warmup=warmup, progress=progress,
                                    time_model=time_model,
                                    preserve_rng_state=preserve_rng_state,
                                    restore_buffers=restore_buffers, strip_suffix=strip_suffix,
                                    extract=extract, dynamic=dynamic,
                                    process_group=process_group,
                                    op_overhead=op_overhead,
                                    op_overhead_ratio=op_overhead_ratio,
                                    fast_path=fast_path, autotune=autotune,
                                    autotune_timer=autotune_timer,
                                    autotune_rounds=autotune_rounds,
                                    **({} if segment_cost is None
                                       else {"extra": {"segment_cost": segment_cost}})))


def offload(module: nn.Module | Sequence[nn.Module | Stage], sample: Any,
            memory_limit: int | str = "2GiB", bandwidth: float | str = "12GB/s",
            method: str = "dp", **options: Any) -> OffloadedModule:
    """Return ``module`` wrapped to train with the fastest offloading plan under a limit.

    Same conventions and ``options`` as :func:`checkpoint` (``max_stages``, ``slots``,
    ``variant``, ``time_limit_s``, ``chain``, ``device``, ``repeats``, ``warmup``,
    ``progress``, ``time_model``, ``extract``, ``dynamic``, ``fast_path``). ``bandwidth`` is
    the host link: bytes per second, or a rate such as ``"12GB/s"``. Activations saved for
    the backward are copied to host memory and back as the plan says: on CUDA on a side stream
    into pinned buffers, overlapped with compute; on CPU synchronously (the plan's
    placement, for tests).

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    >>> x = torch.randn(8, 32)
    >>> onet = offload(net, x, memory_limit="5KiB", bandwidth="1GB/s", repeats=1, warmup=0)
    >>> torch.allclose(onet(x), net(x))
    True
    """
    return build_planned(OffloadedModule, "offload", module, sample, memory_limit, method,
                         bandwidth, options)


def remat_offload(module: nn.Module | Sequence[nn.Module | Stage], sample: Any,
                  memory_limit: int | str = "2GiB", bandwidth: float | str = "12GB/s",
                  method: str = "dp", **options: Any) -> RematOffloadedModule:
    """Return ``module`` wrapped to train with a combined remat + offload plan.

    Same conventions as :func:`offload`; ``options`` also take ``preserve_rng_state`` and
    ``restore_buffers`` (executor options, as for :func:`checkpoint`).

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    >>> x = torch.randn(8, 32)
    >>> rnet = remat_offload(net, x, memory_limit="5KiB", bandwidth=1e9, repeats=1, warmup=0)
    >>> torch.allclose(rnet(x), net(x))
    True
    """
    return build_planned(RematOffloadedModule, "remat_offload", module, sample, memory_limit,
                         method, bandwidth, options)


def profile_chain(module: nn.Module | Sequence[nn.Module | Stage], sample: Any, *,
                  extract: str = "auto", **options: Any) -> Chain:
    """Extract the chain of ``module`` as :func:`checkpoint` does and profile it.

    ``options`` are those of :func:`optmem.pytorch.profile.profile_chain` (``device``,
    ``repeats``, ``warmup``, ``name``, ``progress``, ``time_model``, ``max_stages``, ...).
    An ``nn.Sequential`` or a list of stages goes there directly; any other module is
    exported (:func:`~optmem.pytorch.extract.extract_program`) and profiled with its side
    inputs (not counted as activations). ``max_stages`` merges by parameter count, as
    ``checkpoint(..., chain=chain, max_stages=...)`` does, so the chain can be passed back.

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
    ...                           torch.nn.Linear(16, 2))
    >>> chain = profile_chain(net, torch.randn(4, 8), repeats=1, warmup=0)
    >>> chain.length, chain.input_size, chain.output_size
    (3, 128, (256, 256, 32))
    """
    check_module(module)
    check_options({**options, "extract": extract})  # before any work (stop 84)
    for name in ("op_overhead", "op_overhead_ratio"):  # None: the default, as in checkpoint
        if name in options and options[name] is None:
            del options[name]
    return _profile_chain(module, sample, extract, options)


def _profile_chain(module: nn.Module | Sequence[nn.Module | Stage], sample: Any, extract: str,
                   options: dict[str, Any]) -> Chain:
    """:func:`profile_chain` once its arguments are checked."""
    from optmem.pytorch import profile as prof
    from optmem.pytorch.wrapper import (
        plain_measure,
        profile_stage_chain,
        stage_groups,
        with_plain_peak,
    )

    sample = graph_free(sample)  # its steps must not run into the caller's graph
    if is_plain_chain(module) or not isinstance(module, nn.Module):
        modules = [s if isinstance(s, nn.Module) else s.module for s in
                   (module if not isinstance(module, nn.Module) else [module])]
        whole = module if isinstance(module, nn.Module) else nn.ModuleList(modules)
        with parameters_unmodified(whole):
            chain = prof.profile_chain(module, sample, **options)
            measure = plain_measure(nn.Sequential(*modules), (sample,), {},
                                    ProfileOptions(device=options.get("device")),
                                    options.get("loss_fn"))
            return with_plain_peak(chain, None if measure is None else measure())
    max_stages = options.pop("max_stages", None)
    name = options.pop("name", None) or type(module).__name__
    loss_fn = options.pop("loss_fn", None)
    unknown = set(options) - set(_PROFILE_OPTIONS)
    if unknown:  # the roofline options apply to device="meta", which needs a Sequential
        raise OptmemInputError(f"profile_chain of an exported model does not take "
                               f"{', '.join(sorted(unknown))}", field="options")
    args, kw = canonical_call(module, *call_of(sample))
    with parameters_unmodified(module):  # profiling and measuring run the forward
        with leaves_no_trace(module, (args, kw)):
            ext = extract_program(module, args, kw, method=extract, allow_single=True)
            flat = ext.flatten(args, kw)
            stages = ext.stages
            if max_stages is not None and len(stages) > max_stages:
                from optmem.pytorch.extract import merge_stages

                stages = merge_stages(stages, max_stages, groups=stage_groups(
                    len(stages), max_stages, None, stages))
            profile = ProfileOptions(**{"repeats": 5, **options, "extract": extract})
            chain = profile_stage_chain(stages, ext.chain_input(flat), profile, name,
                                        traced_side_inputs(ext, flat), loss_fn=loss_fn)
        # with loss_fn the chain ends at the loss, whose input need not be the model's output
        measure = None if loss_fn is not None else plain_measure(module, args, kw, profile)
        return with_plain_peak(chain, None if measure is None else measure())


class _Captured(Exception):
    """Raised by :func:`submodule_sample`'s hook to stop the parent's forward there."""


def submodule_sample(model: nn.Module, submodule: str | nn.Module, *args: Any,
                     **kwargs: Any) -> Any:
    """The call ``model(*args, **kwargs)`` makes to ``submodule``, as a sample for it.

    To plan one part of a model, wrap that part with the call its parent makes, e.g. the
    language model of a vision-language model whose vision tower cannot be exported::

        lm = model.model.language_model
        sample = op.submodule_sample(model, lm, **batch)
        model.model.language_model = op.checkpoint(lm, sample, memory_limit="60%")

    ``model`` runs with gradients enabled up to ``submodule``'s first call and stops there,
    so the tensors that require grad in training (the input embeddings) require grad in
    the sample, without the rest of the forward. It leaves no trace: buffers and RNG state
    are restored, the sample's tensors hold no graph (:func:`graph_free`).

    Parameters
    ----------
    model
        The model as it is called in training.
    submodule
        One of its modules, or its qualified name (``"model.language_model"``).
    *args, **kwargs
        A training call of ``model`` (one batch).

    Returns
    -------
    dict or tuple
        The keyword arguments of the call (positional ones bound to their names), or the
        positional arguments of a forward that takes ``*args``.

    Raises
    ------
    OptmemInputError
        ``submodule`` is not a module of ``model`` or is not called by that call.
    """
    part = _submodule(model, submodule)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def grab(_: nn.Module, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> None:
        seen.append((call_args, dict(call_kwargs)))
        raise _Captured

    handle = part.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with parameters_unmodified(model), leaves_no_trace(model, (args, kwargs)), \
                contextlib.suppress(_Captured):
            model(*args, **kwargs)
    finally:
        handle.remove()
    if not seen:
        raise OptmemInputError(f"{type(model).__name__}'s call did not call "
                               f"{type(part).__name__}", field="submodule")
    call_args, call_kwargs = graph_free(seen[0])
    pos, kw = canonical_call(part, call_args, call_kwargs)
    if pos and kw:
        raise OptmemInputError(
            f"{type(part).__name__} is called with arguments that cannot all be named "
            f"(*args and keywords): a sample is either a tuple or a dict", field="submodule")
    return pos if pos else kw


def _submodule(model: nn.Module, submodule: str | nn.Module) -> nn.Module:
    """``submodule`` of ``model``, given as itself or by its qualified name."""
    if isinstance(submodule, str):
        try:
            return model.get_submodule(submodule)
        except AttributeError:
            raise OptmemInputError(f"{type(model).__name__} has no submodule "
                                   f"{submodule!r}", field="submodule") from None
    if not any(m is submodule for m in model.modules()):
        raise OptmemInputError(f"{type(submodule).__name__} is not a module of "
                               f"{type(model).__name__}", field="submodule")
    return submodule
