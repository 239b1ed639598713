"""Run pipeline plans on ``torch.distributed.pipelining`` (one process per GPU of the plan).

A pipeline plan (:class:`optmem.pipeline_plan.PipelinePlan`, from any ``pipeline`` method)
places *stages*, runs of consecutive chain layers, on GPUs (several non-adjacent stages per
GPU for MadPipe and the exact models) and fixes a 1-periodic operation order. This module
executes it on PyTorch's own pipeline runtime:

* the chain is extracted as :func:`optmem.pytorch.checkpoint` extracts it: an
  ``nn.Sequential`` or a list of stages as it is, any other module (a HuggingFace model)
  with ``torch.export`` on the sample call (:func:`~optmem.pytorch.extract.extract_program`);
  every rank holds the whole model and extracts the same chain;
* one ``PipelineStage`` per stage of the plan (:class:`PlanStage` runs the stage's layers),
  on the rank of the plan's GPU; only the chain value crosses ranks. Side inputs (masks,
  position ids, rotary tables, labels) are computed for each micro-batch on every rank from
  the micro-batch's call and entered around each stage's forward
  (:mod:`optmem.pytorch.context`);
* a ``_PipelineScheduleRuntime`` (the runtime behind ``PipelineScheduleMulti`` that
  torchtitan loads custom schedules into) given the plan's own per-rank action list
  (:func:`optmem.pipeline_schedule.schedule_rows`, the same rows as the exported CSV);
  PyTorch adds the sends and receives. A plan's CSV (``optmem export pipeline ... -o
  schedule.csv``) can be loaded the same way (``schedule_csv=``).

The loss runs inside the last stage: ``loss_fn(output, target)`` on the model's output of
the micro-batch (a ``ModelOutput`` for a HuggingFace model), or, without ``loss_fn``, the
model's own loss (``output.loss``: the call passes ``labels=``, and the loss is then the
last stage of the exported chain, counted in the plan).

:class:`PipelinedModel` is the per-rank training object (``step(*call, target=...)`` runs
one flush of ``microbatches`` micro-batches); :func:`pipeline` is the one call (profile on
rank 0, solve, broadcast chain and plan, split, build stages). Weights shared by stages on
different ranks (a tied embedding and head) get their gradient summed between the ranks
holding them after every step, so each copy sees the full gradient.

:func:`run_plan` is optmem's own point-to-point runner, kept for what the runtime does not
do: PyTorch allocates a receive buffer for every micro-batch of every cut up front (input
and gradient) and keeps them for the whole step, while the plan's memory model counts two
buffers per cut and :func:`run_plan` holds a sent message until it knows, from the static
schedule, that the receiver has it; ``docs/pipeline.md`` gives the measured difference.
Launch with :func:`optmem.pytorch.distributed.spawn` or ``torchrun`` (see
``examples/pipeline_train.py`` and ``optmem train-pipeline``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan
from optmem.pipeline_schedule import (
    Message,
    RankOp,
    RankStep,
    default_microbatches,
    pipeline_ranks,
    rank_messages,
    rank_programs,
    schedule_rows,
)
from optmem.pytorch.arguments import check_module, check_options, check_usable_device
from optmem.pytorch.context import SideInputs, current_side_inputs, side_inputs
from optmem.pytorch.distributed import default_device, resolve_group, spawn
from optmem.pytorch.execute import _RngState
from optmem.pytorch.extract import Extraction, Stage, extract_stages
from optmem.pytorch.graphcut import OutputLayout
from optmem.pytorch.hooks import parameters_unmodified
from optmem.pytorch.pipeline_loss import LossFailure
from optmem.pytorch.profile import TimeModel, model_name, move_to
from optmem.pytorch.wrapper import (
    ProfileOptions,
    call_of,
    canonical_call,
    extracted_call,
    is_plain_chain,
    leaves_no_trace,
    plan_stages,
    refuse_wrapped,
    signature_key,
)
from optmem.result import Result, SolveOptions
from optmem.simulate.pipeline import check_plan_structure

__all__ = ["PipelinedModel", "PlanStage", "as_pipeline_plan", "pipeline", "plan_stage_modules",
           "rank_programs", "run_plan", "run_plan_pipelining", "spawn"]

LossFn = Callable[..., torch.Tensor]
Op = RankOp  # the name of earlier versions
TARGET = "__optmem_target__"  # the micro-batch's target, in its pipeline context


# ------------------------------------------------------------------ plans and stages
def as_pipeline_plan(plan: Any) -> PipelinePlan:
    """A :class:`PipelinePlan` from any form a user holds.

    Accepts a plan, a pipeline :class:`~optmem.result.Result` or its ``plan``, a plan or
    result JSON object or text, or a list of op strings.
    """
    if isinstance(plan, Result):
        if plan.problem != "pipeline":
            raise PlanError(f"expected a pipeline result, got a {plan.problem} result")
        if not plan.status.has_plan:
            raise PlanError(f"the result has no plan (status {plan.status})")
        plan = plan.plan
    return PipelinePlan.from_any(plan)


def _plan_argument(plan: Any) -> PipelinePlan:
    """:func:`as_pipeline_plan` of a runner's ``plan`` argument, its error naming ``plan``."""
    try:
        return as_pipeline_plan(plan)
    except PlanError as exc:
        if exc.field:
            raise
        raise PlanError(f"expected a pipeline plan (a PipelinePlan, a pipeline Result, its "
                        f"JSON or its op strings): {exc}", field="plan") from None


class PlanStage(nn.Module):
    """The chain layers of one plan stage, run one after the other.

    Takes the positional tensors PyTorch's pipeline passes (one value, or the members of a
    tuple value the previous stage returned) and returns the last layer's value, its
    tensors made contiguous; the last stage of a plan also computes the loss (``head``, a
    :class:`LossHead`). PyTorch's runtime makes a stage's gradient receive buffers with
    the strides of its outputs (``empty_strided``), and gloo refuses to receive into a
    non-contiguous one: a stage ending in a transposed view (ViT's patch embedding,
    ``flatten(2).transpose(1, 2)``) failed in its first backward receive while the next
    rank waited for the group's timeout.
    """

    def __init__(self, layers: Sequence[nn.Module], head: LossHead | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = head

    def forward(self, *args: Any) -> Any:  # noqa: D102 - see the class docstring
        x: Any = args[0] if len(args) == 1 else tuple(args)
        for layer in self.layers:
            x = layer(x)
        return _contiguous(x) if self.head is None else self.head(x)


def _contiguous(value: Any) -> Any:
    """``value`` (a tensor or a tuple of them) with every tensor contiguous.

    gloo sends contiguous buffers only; ``tree_map`` also keeps a named tuple's type.
    """
    return tree_map(lambda v: v.contiguous() if isinstance(v, torch.Tensor) else v, value)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss``, ``output["loss"]`` or a scalar."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise OptmemInputError(
            f"the model's output ({type(output).__name__}) holds no loss: give loss_fn= or "
            "call the model so that it computes its loss (labels=...)", field="loss_fn")
    return loss


class LossHead:
    """The loss of one micro-batch, computed at the end of the plan's last stage.

    The chain output is assembled into the model's output (``layout``: a ``ModelOutput``
    of an exported model; ``None``: the chain output as it is), then
    ``loss_fn(output, target)`` with the micro-batch's target from its pipeline context, or
    the model's own loss (:func:`model_loss`) without ``loss_fn``. A loss that raises or
    is not a scalar is recorded in ``failure`` and stands in a zero loss
    (:mod:`optmem.pytorch.pipeline_loss`), so that the step ends on every rank.
    """

    def __init__(self, layout: OutputLayout | None, loss_fn: LossFn | None) -> None:
        self.layout = layout
        self.loss_fn = loss_fn
        self.failure = LossFailure()  # read by PipelinedModel.step on every rank

    def __call__(self, value: Any) -> torch.Tensor:  # noqa: D102 - see the class docstring
        return self.failure.attempt(lambda: self._loss(value), value)

    def _loss(self, value: Any) -> torch.Tensor:
        ctx = current_side_inputs()
        output = value if self.layout is None else self.layout.assemble(value, ctx)
        if self.loss_fn is None:
            return model_loss(output)
        return self.loss_fn(output, ctx.get(TARGET))


class _Program:
    """The chain a pipeline runs, and how a call becomes micro-batches of it.

    ``extraction`` is ``None`` for an ``nn.Sequential``, a list of stages or an fx-traced
    module (a call is one input, the chain input); otherwise the ``torch.export``
    extraction of the sample call, specialised to its signature (``key``). ``source``: the
    model given (``None`` for a list of stages), whose parameter names errors use.
    """

    def __init__(self, stages: list[Stage], extraction: Extraction | None = None,
                 module: nn.Module | None = None, key: Any = None, x: Any = None,
                 ctx: SideInputs | None = None, source: nn.Module | None = None) -> None:
        self.stages = stages
        self.source = module if source is None else source
        self.extraction = extraction
        self.module = module
        self.key = key
        self.x = x  # the sample's chain input
        self.ctx = ctx  # the sample's side inputs

    @classmethod
    def build(cls, model: Any, sample: Any = None, extract: str = "auto") -> _Program:
        """Extract ``model`` as the checkpoint wrapper does (``sample``: one micro-batch)."""
        if isinstance(model, _Program):
            return model
        refuse_wrapped(model, "optmem.pytorch.pipeline", wrap_after=False)
        if is_plain_chain(model) or sample is None:
            return cls(extract_stages(model, allow_single=True), x=sample,
                       source=model if isinstance(model, nn.Module) else None)
        if not isinstance(model, nn.Module):
            raise OptmemInputError(f"expected an nn.Module or a list of modules, got "
                                   f"{type(model).__name__}", field="module")
        args, kwargs = canonical_call(model, *call_of(sample))
        with parameters_unmodified(model), leaves_no_trace(model, (args, kwargs)):
            ext = extracted_call(model, args, kwargs, extract, allow_single=True,
                                 observe=False)
        ext.rebind()
        flat = ext.flatten(args, kwargs)
        return cls(ext.stages, ext, model, signature_key(model, args, kwargs),
                   ext.chain_input(flat), ext.side_inputs(flat))

    def with_stages(self, stages: list[Stage]) -> _Program:
        """The same program with other (merged) stages."""
        return _Program(stages, self.extraction, self.module, self.key, self.x, self.ctx,
                        self.source)

    @property
    def layout(self) -> OutputLayout | None:
        """How the model's output is assembled (``None``: the chain output is the output)."""
        return None if self.extraction is None else self.extraction.output

    def has_loss(self) -> bool | None:
        """Whether the model's output holds a loss (``None``: not known before running)."""
        layout = self.layout
        if layout is None:
            return None
        keys = getattr(layout.spec, "context", None)
        return isinstance(keys, list | tuple) and "loss" in keys

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any], n: int
              ) -> tuple[tuple[Any, ...], list[SideInputs | None]]:
        """The chain input of a whole-batch call and the side inputs of its micro-batches.

        The runtime splits the chain input along dimension 0 into ``n`` micro-batches
        (``split_args_kwargs_into_chunks``); the call is split the same way here and each
        micro-batch's side inputs computed from its own call.
        """
        ext = self.extraction
        if ext is None:
            if kwargs:
                raise TypeError(f"a pipelined nn.Sequential or list of stages takes one "
                                f"positional input, got keyword arguments {', '.join(kwargs)}")
            return args, [None] * n
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        assert self.module is not None
        if not args and not kwargs:
            raise OptmemInputError(
                "every rank passes the batch to step(): the side inputs of an exported "
                "model (masks, position ids, labels) are computed on every rank",
                field="inputs")
        args, kwargs = canonical_call(self.module, args, kwargs)
        a0 = ext.chain_input(ext.flatten(args, kwargs))
        contexts: list[SideInputs | None] = []
        for a, k in zip(*split_args_kwargs_into_chunks(args, kwargs, n), strict=True):
            if signature_key(self.module, a, k) != self.key:
                raise OptmemInputError(
                    f"a micro-batch of this call differs from the sample the pipeline of "
                    f"{type(self.module).__name__} was exported for (shapes, dtypes, "
                    f"arguments, training mode): pass {n} micro-batches shaped like the "
                    "sample, stacked along dimension 0", field="inputs")
            contexts.append(ext.side_inputs(ext.flatten(a, k)))
        return (a0 if isinstance(a0, tuple) else (a0,)), contexts

    def to(self, device: torch.device) -> None:
        """Move the side program's constants to ``device`` (the stages move with the rank)."""
        if self.extraction is not None:
            self.extraction.side.to(device)


def plan_stage_modules(model: nn.Module | Sequence[nn.Module | Stage] | _Program, plan: Any,
                       *, sample: Any = None, head: LossHead | None = None
                       ) -> list[PlanStage]:
    """One :class:`PlanStage` per stage of ``plan`` (parameters shared with ``model``).

    Chain layer ``q`` is the ``q``-th stage the extraction finds: for an ``nn.Sequential``
    its children (nested containers flattened, as when profiling), for another module with
    a ``sample`` call the stages of its ``torch.export`` graph. ``head`` computes the loss
    at the end of the last stage.
    """
    plan = _plan_argument(plan)
    layers = [s.module for s in _Program.build(model, sample).stages]
    n = plan.stages[-1].last if plan.stages else 0
    if n != len(layers):
        raise OptmemInputError(
            f"the plan covers {n} chain layers but the model has {len(layers)} (the stages "
            "the extraction finds, nested nn.Sequential flattened): profile and plan the "
            "same model", field="plan")
    check_plan_structure(plan, n)  # a gap or an overlap would train another model
    last = len(plan.stages) - 1
    return [PlanStage(layers[st.first - 1:st.last], head if k == last else None)
            for k, st in enumerate(plan.stages)]


def _whole_model(model: Any, modules: Sequence[nn.Module]) -> nn.Module:
    """The module whose parameters a setup must leave unmodified: ``model``, or ``modules``.

    ``modules`` stand for a ``model`` given as a list of stages.
    """
    return model if isinstance(model, nn.Module) else nn.ModuleList(modules)


def _tied_parameters(modules: Sequence[nn.Module], gpu_of: Sequence[int]
                     ) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    """Parameters held by stages on several GPUs, with those GPUs (in first-use order)."""
    holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
    order: list[int] = []
    for mod, gpu in zip(modules, gpu_of, strict=True):
        for p in mod.parameters():
            if id(p) not in holders:
                holders[id(p)] = (p, set())
                order.append(id(p))
            holders[id(p)][1].add(gpu)
    return [(holders[k][0], tuple(sorted(holders[k][1]))) for k in order
            if len(holders[k][1]) > 1]


def _tied_groups(modules: Sequence[nn.Module], gpu_of: Sequence[int], rank: int
                 ) -> list[tuple[nn.Parameter, Any]]:
    """Tied parameters held on ``rank``, each with the group of its holders.

    Collective: every rank of the default group calls it (every group is made on all ranks,
    in the same order).
    """
    groups: dict[tuple[int, ...], Any] = {}
    mine = []
    for param, gpus in _tied_parameters(modules, gpu_of):
        if gpus not in groups:
            groups[gpus] = dist.new_group(list(gpus))
        if rank in gpus:
            mine.append((param, groups[gpus]))
    return mine


def _grads_before(tied: Sequence[tuple[nn.Parameter, Any]]
                  ) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
    """A copy of each tied parameter's gradient before a step (``None``: no gradient)."""
    return [(p, None if p.grad is None else p.grad.detach().clone()) for p, _ in tied]


def _reduce_tied(tied: Sequence[tuple[nn.Parameter, Any]],
                 before: Sequence[tuple[nn.Parameter, torch.Tensor | None]]) -> None:
    """Sum a step's gradient of every tied weight over the ranks holding it.

    Only what the step added (the gradient minus ``before``) is reduced, so gradients
    accumulated over earlier steps are not counted twice. A frozen weight
    (``requires_grad=False``, the same on every rank) is left without a gradient: it got
    a zero one, which an optimizer over ``piped.parameters()`` then stepped (AdamW's
    weight decay moved BERT's frozen tied embedding, stop 56).
    """
    for (param, group), (_, old) in zip(tied, before, strict=True):
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        delta = grad if old is None else grad - old
        dist.all_reduce(delta, group=group)
        param.grad = delta if old is None else old + delta


class _StageStream:
    """The random stream of one plan stage in one step (its dropout masks), on any rank.

    Each stage draws from its own CPU (and CUDA) generator state, seeded from the step's
    ``base`` (:func:`_step_base`) and the stage's 0-based index, and kept between its
    forwards of the step. Until stop 56 every rank drew from its global generator, which
    the docs' ``manual_seed`` (the same weights on every rank) made identical on every
    rank: rank 1's dropout masks repeated rank 0's (two ``Dropout(0.5)`` on two ranks kept
    half the units, not a quarter). A stage's masks now depend on its layers and the
    global generator's state at the step only, so both runners draw the same ones for a
    plan.

    Only the CPU generator and that of the stage's device are seeded: ``torch.manual_seed``
    seeds every GPU (``torch.cuda.manual_seed_all``, queued for CUDA's lazy initialisation
    when it has not started), and ``fork_rng`` restores the ``devices`` it is given only, so
    building a stage's stream re-seeded the process' other GPUs (on the CPU, every GPU once
    CUDA started) with the stage's seed.
    """

    def __init__(self, stage: int, device: torch.device, base: int) -> None:
        devices = [] if device.type != "cuda" else \
            [device.index if device.index is not None else torch.cuda.current_device()]
        seed = hash((base, stage)) % 2**63  # a tuple of ints: no hash salt
        with torch.random.fork_rng(devices=devices):  # CUDA is initialised for ``devices``
            torch.default_generator.manual_seed(seed)
            for d in devices:
                torch.cuda.default_generators[d].manual_seed(seed)
            self.state = _RngState(devices)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Draw from this stage's stream within; the global generators are left as they were."""
        with torch.random.fork_rng(devices=self.state.devices):
            self.state.restore()
            yield
            self.state = _RngState(self.state.devices)


def _step_base() -> int:
    """The base of a step's stage streams (:class:`_StageStream`): one global CPU draw.

    Each step (each call of :func:`run_plan`) advances the global CPU generator by that
    draw (before stop 56 by the masks its stages drew, in stop 56 not at all). Stop 56
    seeded the streams from ``torch.initial_seed()`` when the runner was built:
    ``run_plan`` and ``run_plan_pipelining``, which build theirs at every call, drew the
    same dropout masks at every step of a training loop.
    """
    return int(torch.randint(2**62, ()))


class _ScaledLoss:
    """The runtime's loss: the last stage's output (the loss) divided by ``factor``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        return output / self.factor


class _Modified:
    """A parameter the runtime's shape inference modified in place, agreed on by the ranks.

    The runtime's first step runs each stage's forward once more to learn its shapes
    (``_forward_metadata_inference``), with the other ranks waiting for those shapes: a
    forward that updates a parameter in place (BYOL's EMA target) applied its update once
    more there, unseen (the other setup paths refuse it since stop 84). Raising on the
    rank that ran it would leave the next rank waiting for the shapes, so the modification
    is recorded (:meth:`recording`) and, after the step, every rank of the pipeline raises
    the same error (:meth:`agree`).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model  # the whole model (not a submodule of the PipelinedModel)
        self.message: str | None = None
        self.agreed = False  # after the first step (the one with the shape inference)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within: a shape inference; a parameter of the model it modified is recorded."""
        done = False
        try:
            with parameters_unmodified(self.model):
                yield
                done = True
        except OptmemInputError as exc:
            if not done:  # the forward's own error
                raise
            if self.message is None:
                self.message = f"{exc.reason} (rank {dist.get_rank()}: PyTorch's shape " \
                    "inference at the first step ran it once more)"

    def agree(self, group: Any, device: torch.device) -> None:
        """After the first step: the same error on every rank of ``group`` if one recorded it.

        Collective at the first completed step only (every rank of the pipeline counts
        its steps alike; the runtime infers shapes at its first step).
        """
        if self.agreed:
            return
        message, self.message, self.agreed = self.message, None, True
        flag = torch.tensor([0 if message is None else 1], device=device)
        dist.all_reduce(flag, group=group)
        if not int(flag.item()):
            return
        got: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, message, group=group)
        first = next(m for m in got if m)
        raise OptmemInputError(f"{first}. Every rank of the pipeline stopped after this "
                               "step; its gradients and that parameter are not the plain "
                               "model's", field="module")


@functools.cache
def _stage_class() -> type:
    """``PipelineStage`` running each micro-batch's forward in that micro-batch's context."""
    from torch.distributed.pipelining import PipelineStage

    class CallStage(PipelineStage):
        """A ``PipelineStage`` whose forward of micro-batch ``m`` sees ``contexts[m]``."""

        contexts: list[SideInputs] = []
        stream: _StageStream
        modified: _Modified  # what the shape inference modified, agreed after the step

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            with side_inputs(self.contexts[fwd_chunk_id]), self.stream.running():
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            """The runtime's shape inference, leaving the stage's buffers and RNG as they were.

            At the first step the runtime runs each stage's forward once more to learn its
            shapes, on the first micro-batch on the first stage and on uninitialised
            tensors (``torch.empty`` of the received shapes) on the others: BatchNorm's
            running statistics took that forward in (HF's ResNet: NaN and inf on the second
            rank after one step, an extra update on the first), and dropout drew one mask
            more. :func:`~optmem.pytorch.wrapper.leaves_no_trace` restores them.

            The forward must not modify a parameter in place either (an EMA target's
            update, :func:`~optmem.pytorch.hooks.parameters_unmodified`): such a
            modification is recorded in ``modified`` and raised on every rank after the
            step (stop 85; raised here, the next rank waited for its shapes).
            """
            out: list[Any] = []
            with leaves_no_trace(self.submod), self.modified.recording():
                out.append(super()._forward_metadata_inference(*args, **kwargs))
            return out[0]

        def _create_grad_recv_info(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
            """The runtime's gradient receive buffers, each made contiguous.

            The runtime shapes them after the gradient the next stage's autograd makes
            for its input, strides included (``empty_strided``), and gloo receives into
            contiguous tensors only: ViT's patch embedding, ``flatten(2).transpose(1,
            2)``, has a transposed gradient, and its stage failed in its first backward
            receive ("input tensor has to be contiguous") while the next rank waited for
            the group's timeout. What the next stage sends is its input's ``.grad``,
            laid out as that input, a contiguous receive buffer (:class:`PlanStage`
            returns contiguous outputs), so the bytes are read in that order.
            """
            infos = super()._create_grad_recv_info(*args, **kwargs)
            for info in infos:
                if info.buffer is not None and not info.buffer.is_contiguous():
                    info.buffer = torch.empty(info.buffer.shape, dtype=info.buffer.dtype,
                                              device=info.buffer.device)
            return infos

    return CallStage


# ------------------------------------------------------------------ PyTorch's runtime
class PipelinedModel(nn.Module):
    """The part of a pipeline plan this rank runs, on ``torch.distributed.pipelining``.

    Parameters
    ----------
    model
        The whole model on every rank (same initial weights): an ``nn.Sequential``, a list
        of stages, or any module with ``sample`` (exported with ``torch.export``, as
        :func:`optmem.pytorch.checkpoint` does; without ``sample`` it must be fx-traceable).
        Only the layers of this rank's stages are moved to ``device`` and used.
    plan
        A pipeline plan, a pipeline :class:`~optmem.result.Result`, ``result.plan``, or its
        JSON (:func:`as_pipeline_plan`).
    sample
        One micro-batch call (a tensor, a tuple of positional or a dict of keyword
        arguments) the model is exported for; every micro-batch must look like it.
    microbatches
        Micro-batches per :meth:`step` (one flush; ``None``: twice the plan's stages); the
        call is split along dimension 0 into that many equal micro-batches, which must have
        the shapes of the first step's (PyTorch's runtime fixes its receive buffers then).
    loss_fn
        ``loss_fn(output, target)`` of one micro-batch (``output``: what the model returns,
        a ``ModelOutput`` for a HuggingFace model), run at the end of the last stage.
        ``None``: the model's own loss (``output.loss``; the call passes ``labels=``).
    device
        Default: ``cuda:LOCAL_RANK`` with NCCL, else the CPU.
    scale_grads
        Divide the gradients by ``microbatches`` (the mean over micro-batches, as one
        single-process step on the whole batch with a mean loss); ``False`` sums them.
    schedule_csv
        Load the action list from this CSV (``optmem export pipeline ... -o schedule.csv``)
        instead of deriving it from ``plan`` (both must describe the same allocation).
    extract
        ``"auto"`` (``torch.export``, then ``torch.fx``), ``"export"`` or ``"fx"``.

    Every process of the default group constructs it (GPU ``g`` of the plan is rank ``g``;
    subgroups are made for the pipeline when the plan leaves ranks empty, and for every set
    of ranks sharing a tied weight). Ranks holding no stage take no part in the schedule.

    Attributes
    ----------
    plan
        The :class:`~optmem.pipeline_plan.PipelinePlan`.
    stages
        This rank's :class:`PlanStage` modules (``parameters()`` gives what to optimise).
    stage_indices
        Their 0-based stage indices.
    chain, result
        Set by :func:`pipeline`: the profiled chain and the solve's result.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module | Stage] | _Program, plan: Any, *,
                 sample: Any = None, microbatches: int | None = None,
                 loss_fn: LossFn | None = None, device: torch.device | str | None = None,
                 scale_grads: bool = True, schedule_csv: str | None = None,
                 extract: str = "auto") -> None:
        super().__init__()
        # every argument before any work, the same error on every rank (stop 85)
        check_options(dict(microbatches=microbatches, loss_fn=loss_fn, device=device,
                           scale_grads=scale_grads, schedule_csv=schedule_csv,
                           extract=extract))
        check_usable_device(device)
        if schedule_csv is not None and not os.path.isfile(schedule_csv):
            raise OptmemInputError(f"no such file: {os.fspath(schedule_csv)!r}",
                                   field="schedule_csv")
        self.plan = _plan_argument(plan)
        self.microbatches = default_microbatches(self.plan) if microbatches is None \
            else microbatches
        self.device = torch.device(device) if device is not None else default_device()
        self.chain: Chain | None = None
        self.result: Result | None = None
        rank, size = dist.get_rank(), dist.get_world_size()
        used = pipeline_ranks(self.plan)
        if used[-1] >= size:
            raise OptmemInputError(f"the plan uses GPU {used[-1]} but only {size} processes run",
                                   field="gpus")
        self.program = _Program.build(model, sample, extract)
        if loss_fn is None and self.program.has_loss() is False:
            raise OptmemInputError(
                f"the output of {type(self.program.module).__name__} on the sample call holds "
                "no loss: give loss_fn=, or pass labels= in the call so that the model "
                "computes its loss", field="loss_fn")
        self._head = LossHead(self.program.layout, loss_fn)
        modules = plan_stage_modules(self.program, self.plan, head=self._head)
        gpu_of = [st.gpu for st in self.plan.stages]
        self.stage_indices = [k for k, g in enumerate(gpu_of) if g == rank]
        self.stages = nn.ModuleList([modules[k] for k in self.stage_indices]).to(self.device)
        self.program.to(self.device)
        self.pp_group = dist.group.WORLD if used == list(range(size)) else dist.new_group(used)
        self._tied = _tied_groups(modules, gpu_of, rank)
        self.has_first = 0 in self.stage_indices
        self.has_last = len(gpu_of) - 1 in self.stage_indices
        self.scale_grads = scale_grads
        self._contexts: list[SideInputs] = []
        self._micro_shapes: list[tuple[tuple[int, ...], torch.dtype]] | None = None
        self._stages: list[Any] = []  # this rank's PipelineStages (_build_schedule)
        # what the first step's shape inference modified (stop 85)
        self._modified = _Modified(_whole_model(self.program.source,
                                                [s.module for s in self.program.stages]))
        self.schedule = self._build_schedule(modules, schedule_csv) \
            if self.stage_indices else None

    def _build_schedule(self, modules: Sequence[nn.Module], schedule_csv: str | None) -> Any:
        from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

        n_stages = len(modules)
        stages = []
        for k in self.stage_indices:
            stage = _stage_class()(modules[k], k, n_stages, self.device, group=self.pp_group)
            stage.contexts = self._contexts  # filled by every step
            stage.modified = self._modified
            stages.append(stage)
        self._stages = stages  # their streams are set by every step
        schedule = _PipelineScheduleRuntime(
            stages, self.microbatches,
            loss_fn=_ScaledLoss(self.microbatches if self.scale_grads else 1),
            scale_grads=False)
        if schedule_csv is not None:
            try:
                schedule._load_csv(schedule_csv)
            except AssertionError as exc:  # PyTorch's validation of the action list
                raise OptmemInputError(
                    f"the schedule {schedule_csv} does not fit this pipeline "
                    f"({self.microbatches} micro-batches, {n_stages} stages): {exc}",
                    field="schedule_csv") from None
        else:
            actions = {r: [_Action.from_str(a) for a in row]
                       for r, row in enumerate(schedule_rows(self.plan, self.microbatches))}
            schedule.pipeline_order = actions
            schedule._prepare_schedule_with_comms(actions)
        placed = schedule.stage_index_to_group_rank
        expected = {k: pipeline_ranks(self.plan).index(st.gpu)
                    for k, st in enumerate(self.plan.stages)}
        if placed != expected:
            raise OptmemInputError(f"the schedule places stages on ranks {placed}, the plan on "
                                   f"{expected}", field="schedule_csv")
        return schedule

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> list[torch.Tensor]:
        """One training step (forward and backward of every micro-batch, no weight update).

        ``args`` and ``kwargs`` are the call of the whole batch (``microbatches`` micro-
        batches stacked along dimension 0), ``target`` the targets of ``loss_fn``. For an
        ``nn.Sequential`` or a list of stages only the rank of the first stage needs the
        call (the first stage's input) and only the rank of the last the target; for an
        exported model every rank passes the call (each computes the side inputs of every
        micro-batch). Returns the micro-batch losses on the rank holding the last stage,
        ``[]`` elsewhere. Gradients accumulate in ``.grad`` (call ``zero_grad()`` between
        steps, as usual). A batch that is not a positive multiple of ``microbatches`` rows,
        micro-batches shaped unlike the first step's, or a call under ``torch.no_grad()``
        (there is no forward-only pass) raise :class:`~optmem.errors.OptmemInputError`
        before any message.
        """
        before = _grads_before(self._tied)
        losses: list[torch.Tensor] = []
        base = _step_base()  # on every rank, as run_plan
        for stage in self._stages:
            stage.stream = _StageStream(stage.stage_index, self.device, base)
        if self.schedule is not None:
            if not torch.is_grad_enabled():
                raise OptmemInputError(
                    "PipelinedModel.step() trains (the forward and backward of every "
                    "micro-batch) and has no forward-only pass: call it with gradients "
                    "enabled, outside torch.no_grad() (docs/pipeline.md)", field="inputs")
            n = self.microbatches
            args, kwargs = move_to(args, self.device), move_to(kwargs, self.device)
            _check_rows([t for t in tree_flatten((args, kwargs))[0]
                         if isinstance(t, torch.Tensor) and t.dim() > 0], n)
            chain_args, calls = self.program.split(args, kwargs, n)
            if self.has_first and not chain_args:
                raise OptmemInputError(
                    f"rank {dist.get_rank()} holds the pipeline's first stage: pass it the "
                    "batch, step(x, target=...) (every rank may pass it)", field="inputs")
            self._check_batch(chain_args, target)
            targets = list(torch.tensor_split(move_to(target, self.device), n)) \
                if isinstance(target, torch.Tensor) else [target] * n
            self._contexts[:] = [SideInputs({**(ctx or {}), TARGET: t})
                                 for ctx, t in zip(calls, targets, strict=True)]
            # the last stage's loss is its output: the runtime's target is a placeholder
            dummy = torch.zeros(n, device=self.device) if self.has_last else None
            with side_inputs(self._contexts[0]):  # the runtime's first-step shape inference
                self.schedule.step(*(chain_args if self.has_first else ()), target=dummy,
                                   losses=losses, return_outputs=False)
            self._contexts.clear()
            self._head.failure.agree(src=self.plan.stages[-1].gpu,
                                     ranks=pipeline_ranks(self.plan), group=self.pp_group,
                                     device=self.device)
            self._modified.agree(self.pp_group, self.device)
        _reduce_tied(self._tied, before)
        factor = self.microbatches if self.scale_grads else 1
        return [loss.detach() * factor for loss in losses]

    def _check_batch(self, chain_args: tuple[Any, ...], target: Any) -> None:
        """One input error for a batch PyTorch's runtime cannot split or receive.

        The runtime splits every tensor of the chain input (and ``step`` the target) along
        dimension 0 into ``microbatches`` pieces, and its stages fix their receive buffers
        to the micro-batch shapes of the first step. A batch that is not a positive multiple
        of ``microbatches`` rows, or micro-batches shaped unlike the first step's, failed
        inside the runtime on one rank (a shape error, ``Expecting 4 arg_mbs but got 3``)
        while the next rank waited for the group's timeout, or aborted a rank in gloo
        ("Received data size doesn't match expected size"). Checked on every rank that
        passes the call or the target, before any message.
        """
        n = self.microbatches
        # step() checked the rows of the call's tensors: left are a scalar chain input
        # (that check skips scalars) and the target
        tensors = [t for t in chain_args if isinstance(t, torch.Tensor) and t.dim() == 0]
        if isinstance(target, torch.Tensor) and target.dim() > 0:
            tensors.append(target)
        _check_rows(tensors, n)
        _check_target_rows(chain_args, target)
        shapes = [((t.shape[0] // n, *t.shape[1:]), t.dtype) for t in chain_args
                  if isinstance(t, torch.Tensor)]
        if not shapes:  # this rank was not given the call
            return
        if self._micro_shapes is None:
            self._micro_shapes = shapes
        elif shapes != self._micro_shapes:
            def show(s: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
                return ", ".join(f"{list(shape)} {dtype}" for shape, dtype in s)
            raise OptmemInputError(
                f"the micro-batches of this step ({show(shapes)}) differ from the first "
                f"step's ({show(self._micro_shapes)}): PyTorch's pipeline runtime fixes its "
                "receive buffers at the first step, so every step must have the same "
                "micro-batch shapes (pad every batch to one size)", field="inputs")

    def extra_repr(self) -> str:  # noqa: D102
        return (f"stages={self.stage_indices} of {len(self.plan.stages)}, "
                f"microbatches={self.microbatches}, period={self.plan.period:g}")


def _check_target_rows(chain_args: tuple[Any, ...], target: Any) -> None:
    """One input error when a rank's target and call have different row counts.

    The runtime splits both into the same micro-batches, so micro-batch ``k``'s target must
    be the rows of micro-batch ``k``'s input. A target of 12 rows for a call of 16 (both
    multiples of 4 micro-batches) failed inside the loss on the last stage's rank only,
    while the other ranks waited for a gradient (stop 75 audit). Checked where a rank is
    given both (every rank, in the usual ``step(x, target=y)`` on all ranks).
    """
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        return
    rows = [t.shape[0] for t in chain_args if isinstance(t, torch.Tensor) and t.dim() > 0]
    if rows and rows[0] != target.shape[0]:
        raise OptmemInputError(
            f"the target has {target.shape[0]} rows and the call {rows[0]}: step() splits "
            "both into the same micro-batches, so they need the same rows (one target row "
            "per input row)", field="target")


def _check_rows(tensors: Sequence[torch.Tensor], n: int) -> None:
    """One input error unless every tensor has a positive multiple of ``n`` rows.

    Checked on the whole call before it is split: an exported model's call of 10 rows for
    4 micro-batches was refused as "a micro-batch of this call differs from the sample",
    which did not say that the rows were the fault (stop 56).
    """
    for t in tensors:
        if t.dim() == 0 or t.shape[0] < n or t.shape[0] % n:
            rows = "a scalar" if t.dim() == 0 else f"{t.shape[0]} rows"
            raise OptmemInputError(
                f"step() splits the batch into {n} equal micro-batches along dimension "
                f"0, got {rows}: pass a multiple of {n} rows (PyTorch's pipeline runtime "
                "runs equal micro-batches; pad or drop a short last batch)", field="inputs")


def _check_equal(micro: Sequence[Any], field: str) -> None:
    """One input error unless ``micro`` is a non-empty list of tensors of one shape and dtype.

    The runners size every message (and PyTorch's runtime its receive buffers) from the
    first micro-batch: unequal ones failed inside a rank, or aborted it in gloo.
    """
    if not micro:
        raise OptmemInputError("expected at least one micro-batch", field=field)
    def show(t: Any) -> str:
        return f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__

    first = micro[0]
    for k, t in enumerate(micro):
        if not isinstance(t, torch.Tensor) or not isinstance(first, torch.Tensor) \
                or t.shape != first.shape or t.dtype != first.dtype:
            raise OptmemInputError(
                f"the micro-batches must be tensors of one shape and dtype: micro-batch {k} "
                f"is {show(t)}, micro-batch 0 {show(first)} (pad them to one size)",
                field=field)


@contextlib.contextmanager
def _takes_no_sample(runner: str, model: Any) -> Iterator[None]:
    """A model the runner cannot extract: one error saying what runs it.

    The extractor's advice, "give a sample batch", does not fit a runner that takes none
    (stop 56 hunt, a Qwen2ForCausalLM given to ``run_plan``).
    """
    try:
        yield
    except OptmemInputError as exc:
        if exc.field != "module":
            raise
        name = type(model).__name__
        raise OptmemInputError(
            f"{runner} takes no sample: it runs an nn.Sequential, a list of stages or a module "
            f"torch.fx traces, and {name} is none of them. Run {name} on PyTorch's runtime, "
            "which exports it from a sample call: PipelinedModel(model, plan, "
            "sample=one_micro_batch_call, ...) or optmem.pytorch.pipeline(model, sample, ...) "
            f"(the extraction said: {exc.reason})", field="module") from None


def run_plan_pipelining(
    model: nn.Module | Sequence[nn.Module | Stage], plan: Any,
    inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], loss_fn: LossFn, *,
    device: torch.device | None = None, schedule_csv: str | None = None,
) -> list[float]:
    """Run any plan once on PyTorch's pipeline runtime, micro-batch gradients summed.

    ``inputs`` and ``targets`` are the micro-batches (equal sizes). Returns the micro-batch
    losses on the rank of the last stage. Same results as :func:`run_plan`.
    """
    _check_equal(inputs, "inputs")
    with _takes_no_sample("run_plan_pipelining", model):
        piped = PipelinedModel(model, plan, microbatches=len(inputs), loss_fn=loss_fn,
                               device=device, scale_grads=False, schedule_csv=schedule_csv)
    losses = piped.step(torch.cat(list(inputs)), target=torch.cat(list(targets)))
    return [float(v) for v in losses]


# ------------------------------------------------------------------ one call
def _check_one_call(model: Any, *, memory_per_gpu: Any, bandwidth: Any, method: Any,
                    time_limit_s: Any, memory_model: Any, temporaries: Any,
                    options: dict[str, Any]) -> tuple[int, SolveOptions]:
    """Check :func:`pipeline`'s arguments before any work; its memory and solve options.

    Each bad value is one :class:`~optmem.errors.OptmemInputError` naming the argument, the
    same on every rank (the arguments are; nothing is exchanged). Before stop 85 some
    failed in Python (``gpus="abc"``: ``TypeError``), some after the profile on rank 0 in
    the problem's own CLI spelling (``weight-copies``, ``memory-model``, ``memory``), some
    were taken (``loss_fn=3`` until the first step) and ``microbatches=2**70`` never ended.
    """
    from optmem.problems.checkpoint import check_memory_limit
    from optmem.problems.pipeline import check_temporaries
    from optmem.solvers.facade import method_info
    from optmem.units import rate_per_second

    check_module(model)
    check_options(options)
    check_usable_device(options["device"])
    check_temporaries(memory_model, temporaries)
    method_info("pipeline", method)
    memory = check_memory_limit(memory_per_gpu, field="memory_per_gpu")
    if bandwidth is not None:
        rate_per_second(bandwidth, field="bandwidth", allow_inf=True)
    return memory, SolveOptions(time_limit_s=time_limit_s)


def pipeline(
    model: nn.Module | Sequence[nn.Module | Stage],
    sample: Any,
    gpus: int | None = None,
    memory_per_gpu: int | str = "16GiB",
    bandwidth: float | str | None = None,
    *,
    loss_fn: LossFn | None = None,
    microbatches: int | None = None,
    method: str = "madpipe",
    weight_copies: int = 4,
    memory_model: str = "stash",
    temporaries: bool = False,
    max_stages: int | None = None,
    time_limit_s: float | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    time_model: TimeModel | None = None,
    progress: bool | None = False,
    extract: str = "auto",
) -> PipelinedModel:
    """Profile, solve, split and build the pipeline of ``model`` on ``gpus`` ranks.

    Run it on every rank (``torchrun --nproc_per_node P``): every rank extracts the chain
    (as :func:`optmem.pytorch.checkpoint` does: ``torch.export`` for a module that is not
    an ``nn.Sequential``), rank 0 profiles it on ``sample`` and solves the pipeline problem;
    the chain and the plan are broadcast, so every rank builds its part of the **same**
    plan.

    Parameters
    ----------
    model
        The same model on every rank (same weights: seed before building it): an
        ``nn.Sequential``, a list of stages, or any module (a HuggingFace model).
    sample
        **One micro-batch** (the chain is profiled per micro-batch, like the period): the
        input of an ``nn.Sequential``, or a call of the module (a tensor, a tuple of
        positional or a dict of keyword arguments, e.g. ``{"input_ids": ids, "labels":
        ids}``).
    gpus
        GPUs of the plan (default: the number of processes); GPU ``g`` is rank ``g``.
    memory_per_gpu
        Memory of each GPU: bytes or a size such as ``"16GiB"``.
    bandwidth
        Link bandwidth (``"12GB/s"`` or a number of bytes per second, CONTRACT section
        14); ``None``: transfers are free.
    loss_fn
        ``loss_fn(output, target)`` of one micro-batch (``output``: what the model returns).
        ``None``: the model's own loss (``output.loss``; the sample passes ``labels=``, and
        the loss is the last stage of the chain, profiled and planned with it).
    microbatches
        Micro-batches per step (default: twice the number of stages).
    method
        Any ``pipeline`` method (``madpipe``, ``contiguous``, ``pipedream``, ``cpsat``, ...).
    weight_copies
        Copies of every weight a GPU holds: weights, gradients and Adam's two moments = 4
        (this runtime keeps one weight version: synchronous training with a flush).
    memory_model, temporaries, time_limit_s
        Problem and solver options (``docs/pipeline.md``; ``temporaries=True`` needs
        ``memory_model="strict"`` and makes the plan's per-rank peak count each task's
        temporaries, the loss's included when it is the model's own, ``loss_fn=None``: a
        ``loss_fn`` runs outside the profiled chain, so only its ``delta_L`` is counted).
    max_stages
        Merge the extracted layers into at most this many, balanced by measured time.
    device
        As in :class:`PipelinedModel` (where this rank's stages run). The profile runs
        where the model's weights are, the sample moved there: CPU times for a model built
        on the CPU (``time_model`` gives a GPU's).
    repeats, warmup, time_model, progress
        Profiling options (:func:`~optmem.pytorch.profile.profile_stages`).
    extract
        ``"auto"`` (``torch.export``, then ``torch.fx``), ``"export"`` or ``"fx"``.

    Returns
    -------
    PipelinedModel
        With ``.result`` (the solve: ``objective`` = predicted period in ms per micro-batch),
        ``.chain`` and ``.plan``; identical on every rank.
    """
    from optmem.problems.pipeline import PipelineProblem
    from optmem.solvers.facade import solve
    from optmem.units import chain_rate, format_size

    # every argument before anything else (stop 85): the same error on every rank
    memory, solve_options = _check_one_call(
        model, memory_per_gpu=memory_per_gpu, bandwidth=bandwidth, method=method,
        time_limit_s=time_limit_s, memory_model=memory_model, temporaries=temporaries,
        options=dict(gpus=gpus, loss_fn=loss_fn, microbatches=microbatches,
                     weight_copies=weight_copies, memory_model=memory_model,
                     max_stages=max_stages, device=device, repeats=repeats, warmup=warmup,
                     time_model=time_model, progress=progress, extract=extract))
    if not dist.is_initialized():
        raise OptmemInputError("optmem.pytorch.pipeline runs under torch.distributed: launch "
                               "with torchrun and call init_distributed() (or "
                               "init_process_group) first", field="backend")
    world = dist.get_world_size()
    gpus = world if gpus is None else gpus
    if gpus > world:
        raise OptmemInputError(f"the plan is for {gpus} GPUs but only {world} ranks run",
                               field="gpus")
    program = _Program.build(model, sample, extract)
    name = model_name(model)

    def solve_pipeline(chain: Chain) -> Result:
        beta = math.inf if bandwidth is None else \
            chain_rate(bandwidth, chain.time_unit, allow_inf=True)
        problem = PipelineProblem(chain, gpus, memory, chain_bandwidth=beta,
                                  weight_copies=weight_copies, memory_model=memory_model,
                                  temporaries=temporaries)
        result = solve(problem, method, options=solve_options)
        if not result.status.has_plan:
            hint = "" if result.min_feasible_memory is None else \
                f"; the smallest feasible memory is about {format_size(result.min_feasible_memory)}"
            raise OptmemInputError(f"no {method} pipeline plan for {name} on {gpus} GPUs with "
                                   f"{format_size(memory)} each: status {result.status}{hint}",
                                   field="memory_per_gpu")
        return result

    # the profile runs where the model is (it moves the sample only): ``device`` is where
    # this rank's stages will run, and the whole model is there only if the caller put it
    # there (``optmem train-pipeline`` under NCCL gave cuda:r with the model on the CPU,
    # and rank 0's profile failed on the device mismatch)
    held = next((t.device for s in program.stages
                 for t in itertools.chain(s.module.parameters(), s.module.buffers())), None)
    options = ProfileOptions(device=None if held is None else str(held), repeats=repeats,
                             warmup=warmup, progress=progress, time_model=time_model,
                             max_stages=max_stages, share_carried=False)
    whole = _whole_model(model, [s.module for s in program.stages])
    _, stages, chain, result = plan_stages(program.stages, program.x, options, name,
                                           program.ctx, solve_pipeline,
                                           group=resolve_group(), unmodified=whole)
    if chain.stage_names != tuple(s.name for s in stages):
        raise OptmemInputError(
            f"rank {dist.get_rank()} extracted other stages than rank 0 "
            f"({[s.name for s in stages]} against {list(chain.stage_names)}): build the same "
            "model and sample on every rank", field="model")
    piped = PipelinedModel(program.with_stages(stages), result, microbatches=microbatches,
                           loss_fn=loss_fn, device=device)
    piped.chain, piped.result = chain, result
    return piped


# ------------------------------------------------------------------ optmem's own runner
def _receive(peer: int, shape: tuple[torch.Size, torch.dtype], device: torch.device
             ) -> torch.Tensor:
    """The next message from ``peer`` (links carry their sender's order: no tags needed)."""
    buf = torch.empty(shape[0], dtype=shape[1], device=device)
    work = dist.irecv(buf, src=peer)
    assert work is not None
    work.wait()
    return buf


def _shapes(modules: Sequence[nn.Module], sample: torch.Tensor
            ) -> list[tuple[torch.Size, torch.dtype]]:
    """Output shape and dtype of every stage but the last: the messages (a no-grad dry run).

    The last stage's output goes to ``loss_fn`` only and may be anything it takes (a
    tuple); until the review of stop 56 it was dry-run too, and a tuple failed there
    (``AttributeError``) on every rank. Another stage's output is a message: one that is
    not a tensor is an :class:`~optmem.errors.OptmemInputError`. Each stage runs where
    its parameters (or buffers) are: this rank's stages on its
    device, the others' where the model was built (a stage without either where its input
    is). Before, every stage got the input on the rank's device, and ``run_plan`` on CUDA
    with a model built on the CPU failed in the first stage of another rank. The run leaves
    no trace (:func:`~optmem.pytorch.wrapper.leaves_no_trace`): it updated the BatchNorm
    running statistics of every stage on every rank, and drew dropout masks.
    """
    out = []
    x = sample
    with torch.no_grad(), leaves_no_trace(nn.ModuleList(modules)):
        for k, mod in enumerate(modules[:-1], start=1):
            held = next(itertools.chain(mod.parameters(), mod.buffers()), None)
            x = mod(x if held is None else x.to(held.device))
            if not isinstance(x, torch.Tensor):
                raise OptmemInputError(
                    f"run_plan sends single tensors between stages; stage {k} of the plan "
                    f"returns a {type(x).__name__}: run the model on PyTorch's runtime "
                    "(run_plan_pipelining, PipelinedModel), which sends tuples", field="model")
            out.append((x.shape, x.dtype))
    return out


class _Root:
    """Where :func:`run_plan` starts a stage's backward: its output's gradient edge.

    A stash that kept the output tensor kept its storage to the backward: the output is
    the next stage's input (its stash counts it), a message, or part of the tape (then the
    tape keeps it), and a loss may keep more than its one element (``mse_loss`` of
    PyTorch 2.13 returns a view of its 64 KiB squared errors: rank 1 of the ``--temporaries``
    MadPipe plan held 64 KiB per micro-batch from its loss to its backward, stop 56). An
    output that needs no gradient (a first stage of frozen layers) has no backward to run
    (``edge`` None), as on PyTorch's runtime; until the review of stop 56 its backward
    raised ("element 0 of tensors does not require grad") and the other ranks lost their
    peer.
    """

    def __init__(self, edge: Any, like: tuple[torch.Size, torch.dtype, torch.device] | None
                 ) -> None:
        self.edge, self.like = edge, like

    @classmethod
    def of(cls, out: torch.Tensor, *, loss: bool) -> _Root:
        """The root of ``out``'s backward (``loss``: its gradient is one, a scalar)."""
        if not out.requires_grad:
            return cls(None, None)
        if loss and out.numel() != 1:
            raise OptmemInputError(f"loss_fn returned a tensor of shape {tuple(out.shape)}; "
                                   "expected a scalar", field="loss_fn")
        like = (out.shape, out.dtype, out.device) if loss else None
        return cls(get_gradient_edge(out), like)

    def backward(self, grad: torch.Tensor | None) -> None:
        """``out.backward(grad)`` (a loss: ``grad`` None, ``out.backward()``).

        Nothing for an output that needs no gradient.
        """
        if self.edge is None:
            return
        if grad is None and self.like is not None:
            shape, dtype, device = self.like
            grad = torch.ones(shape, dtype=dtype, device=device)
        torch.autograd.backward([self.edge], None if grad is None else [grad])


def run_plan(
    model: nn.Module | Sequence[nn.Module | Stage], plan: Any,
    inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], loss_fn: LossFn, *,
    device: torch.device | None = None,
) -> list[float]:
    """Execute ``plan`` on this rank with optmem's point-to-point runner (one flush).

    Every rank holds the same ``model`` (only its own stages are moved to ``device``); the
    operations run in the plan's order (:func:`~optmem.pipeline_schedule.rank_programs`),
    with ``isend``/``irecv`` received in the sender's order (no tags: NCCL and gloo). A sent
    message is waited on and dropped at the first operation that happens after its
    receiver took it (:func:`~optmem.pipeline_schedule.rank_messages`: the peer then sent
    something this rank has received, so the wait does not wait for a peer), or earlier,
    where the rank would otherwise hold more than two messages of a cut besides its stash
    (``RankStep.wait``: the wait may wait for the receiver to take it, which the static
    replay shows never needs this rank); other messages are held until the step ends.
    A stage's output is kept only by those who need it (the next stage's input, a message,
    the tape): the backward starts from its gradient edge (stop 56, before from the output,
    which kept it and the micro-batch's loss to the backward).
    Stage outputs must be single tensors and ``loss_fn`` must return one element.
    Gradients of the micro-batches are summed in ``.grad``;
    a weight shared by stages on several ranks (a tied embedding and head) gets the sum
    over those ranks on each, as with :class:`PipelinedModel`.
    Returns the losses of the micro-batches whose last stage ran here. ``device``: as for
    :class:`PipelinedModel` (default ``cuda:LOCAL_RANK`` with NCCL, else the CPU; before,
    the CPU always, whose tensors NCCL refuses).
    """
    check_options(dict(loss_fn=loss_fn, device=device))  # on every rank alike (stop 85)
    check_usable_device(device)
    plan = _plan_argument(plan)
    _check_equal(inputs, "inputs")
    with _takes_no_sample("run_plan", model):
        modules = plan_stage_modules(model, plan)
    rank = dist.get_rank()
    device = device or default_device()
    n_stages = len(plan.stages)
    gpu_of = {k: st.gpu for k, st in enumerate(plan.stages, start=1)}
    base = _step_base()
    streams = {}
    for k, g in gpu_of.items():
        if g == rank:
            modules[k - 1].to(device)
            streams[k] = _StageStream(k - 1, device, base)
    tied = _tied_groups(modules, list(gpu_of.values()), rank)
    before = _grads_before(tied)
    with parameters_unmodified(_whole_model(model, modules)):  # on every rank (stop 85)
        shapes = _shapes(modules, inputs[0].to(device))
    box: dict[Message, torch.Tensor] = {}  # received (or kept here) until their operation
    held: dict[Message, Any] = {}  # sent, not yet known received (gloo: until wait())
    # per stage and micro-batch: the input leaf (None for stage 1) and the root of the
    # backward (_Root: the output's gradient edge, not the output, whose storage is
    # the next stage's, the message's or the tape's to keep)
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, _Root]] = {}
    losses: list[float] = []
    failure = LossFailure()  # a loss that fails is one error on every rank, after the step

    def deliver(step: RankStep, key: Message, value: torch.Tensor) -> None:
        if step.send is None:
            box[key] = value
        else:
            held[key] = dist.isend(value.contiguous(), dst=step.send[0])
        for done in [k for k, req in held.items() if req.is_completed()]:
            del held[done]  # NCCL may complete a send early; gloo only in wait()

    def forward(step: RankStep) -> None:
        m, s = step.op.microbatch, step.op.stage
        leaf = None
        if s == 1:
            x = inputs[m].to(device)
        else:
            leaf = x = box.pop(("a", s - 1, m)).detach().requires_grad_(True)
        with streams[s].running():
            out = modules[s - 1](x)
        if s == n_stages:
            out = failure.attempt(functools.partial(loss_fn, out, targets[m].to(device)), out)
            losses.append(float(out.detach()))
        else:
            deliver(step, ("a", s, m), out.detach())
        stash[(s, m)] = (leaf, _Root.of(out, loss=s == n_stages))

    def backward(step: RankStep) -> None:
        m, s = step.op.microbatch, step.op.stage
        leaf, root = stash.pop((s, m))
        root.backward(None if s == n_stages else box.pop(("g", s, m)))
        if s > 1:
            assert leaf is not None and leaf.grad is not None
            deliver(step, ("g", s - 1, m), leaf.grad)

    def settle(step: RankStep) -> None:
        for key in (*step.release, *step.wait):
            req = held.pop(key, None)
            if req is not None:
                req.wait()  # gloo's work keeps its tensor: dropped with it on return

    # settle / forward / backward are functions: their locals (a stage's output, the loss,
    # a send waited on) go when they return, not when the loop's next operation rebinds
    # them
    for step in rank_messages(plan, len(inputs)).get(rank, []):
        for peer, key in step.receive:
            box[key] = _receive(peer, shapes[key[1] - 1], device)
        # release: the peer has it, wait() does not wait for the peer; wait: the plan's
        # buffers are full, wait() may wait until the peer takes it (never for this rank)
        settle(step)
        (forward if step.op.kind == "F" else backward)(step)
    for req in held.values():
        req.wait()
    failure.agree(src=gpu_of[n_stages], ranks=pipeline_ranks(plan), group=None, device=device)
    _reduce_tied(tied, before)
    return losses


# ------------------------------------------------------------------ a small model for tests
class _TanhLinear(nn.Module):
    """``tanh(W x + b)``: one chain layer (a nested ``nn.Sequential`` would be two)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def demo_model(width: int = 16, depth: int = 4, seed: int = 0) -> nn.Sequential:
    """A small MLP as an ``nn.Sequential`` of ``depth`` blocks (one chain layer each)."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [_TanhLinear(width) for _ in range(depth - 1)]
    blocks.append(nn.Linear(width, 1))
    return nn.Sequential(*blocks)
