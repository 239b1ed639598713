"""Run pipeline plans on ``torch.distributed.pipelining`` (one process per GPU of the plan).

A pipeline plan (:class:`optmem.pipeline_plan.PipelinePlan`, from any ``pipeline`` method)
places *stages*, runs of consecutive chain layers, on GPUs (several non-adjacent stages per
GPU for MadPipe and the exact models) and fixes a 1-periodic operation order. This module
executes it on PyTorch's own pipeline runtime:

* one ``PipelineStage`` per stage of the plan (:class:`PlanStage` runs the stage's layers),
  on the rank of the plan's GPU;
* a ``_PipelineScheduleRuntime`` (the runtime behind ``PipelineScheduleMulti`` that
  torchtitan loads custom schedules into) given the plan's own per-rank action list
  (:func:`optmem.pipeline_schedule.schedule_rows`, the same rows as the exported CSV);
  PyTorch adds the sends and receives. A plan's CSV (``optmem export pipeline ... -o
  schedule.csv``) can be loaded the same way (``schedule_csv=``).

:class:`PipelinedModel` is the per-rank training object (``step(batch, target=...)`` runs
one flush of ``microbatches`` micro-batches); :func:`pipeline` is the one call (profile on
rank 0, solve, broadcast chain and plan, split, build stages). Weights shared by stages on
different ranks (a tied embedding and head) get their gradient summed between the ranks
holding them after every step, so each copy sees the full gradient.

:func:`run_plan` is optmem's own point-to-point runner, kept for what the runtime does not
do: PyTorch allocates a receive buffer for every micro-batch of every cut up front (input
and gradient) and keeps them for the whole step, while the plan's memory model (and
:func:`run_plan`) holds the messages in flight only; ``docs/pipeline.md`` gives the measured
difference. Launch with :func:`optmem.pytorch.distributed.spawn` or ``torchrun`` (see
``examples/pipeline_train.py`` and ``optmem train-pipeline``).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan
from optmem.pipeline_schedule import (
    RankOp,
    default_microbatches,
    pipeline_ranks,
    rank_programs,
    schedule_rows,
)
from optmem.pytorch.distributed import default_device, resolve_group, run_once, spawn
from optmem.pytorch.extract import Stage, extract_stages, merge_stages
from optmem.pytorch.profile import TimeModel, profile_stages
from optmem.result import Result

__all__ = ["PipelinedModel", "PlanStage", "as_pipeline_plan", "pipeline", "plan_stage_modules",
           "rank_programs", "run_plan", "run_plan_pipelining", "spawn"]

LossFn = Callable[..., torch.Tensor]
Op = RankOp  # the name of earlier versions


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


class PlanStage(nn.Module):
    """The chain layers of one plan stage, run one after the other.

    Takes the positional tensors PyTorch's pipeline passes (one value, or the members of a
    tuple value the previous stage returned) and returns the last layer's value.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any) -> Any:  # noqa: D102 - see the class docstring
        x: Any = args[0] if len(args) == 1 else tuple(args)
        for layer in self.layers:
            x = layer(x)
        return x


def _layers(model: nn.Module | Sequence[nn.Module | Stage]) -> list[nn.Module]:
    """The chain layers of ``model`` (:func:`~optmem.pytorch.extract.extract_stages`)."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module) \
            and all(isinstance(s, Stage) for s in model):
        return [s.module for s in model]  # type: ignore[union-attr]
    return [s.module for s in extract_stages(model, allow_single=True)]


def plan_stage_modules(model: nn.Module | Sequence[nn.Module | Stage], plan: Any
                       ) -> list[PlanStage]:
    """One :class:`PlanStage` per stage of ``plan`` (parameters shared with ``model``).

    Chain layer ``q`` is the ``q``-th stage :func:`~optmem.pytorch.extract.extract_stages`
    finds (nested ``nn.Sequential`` containers are flattened, as when profiling).
    """
    plan = as_pipeline_plan(plan)
    layers = _layers(model)
    n = plan.stages[-1].last if plan.stages else 0
    if n != len(layers):
        raise OptmemInputError(
            f"the plan covers {n} chain layers but the model has {len(layers)} (the stages "
            "extract_stages finds, nested nn.Sequential flattened): profile and plan the same "
            "model", field="plan")
    return [PlanStage(layers[st.first - 1:st.last]) for st in plan.stages]


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


class _ScaledLoss:
    """``loss_fn / N``: the mean over micro-batches, whoever holds the parameters."""

    def __init__(self, loss_fn: LossFn, factor: float) -> None:
        self.loss_fn = loss_fn
        self.factor = factor

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(output, target) / self.factor


# ------------------------------------------------------------------ PyTorch's runtime
class PipelinedModel(nn.Module):
    """The part of a pipeline plan this rank runs, on ``torch.distributed.pipelining``.

    Parameters
    ----------
    model
        The whole model on every rank (same initial weights): an ``nn.Sequential``, any
        module :func:`~optmem.pytorch.extract.extract_stages` cuts, or a list of stages.
        Only the layers of this rank's stages are moved to ``device`` and used.
    plan
        A pipeline plan, a pipeline :class:`~optmem.result.Result`, ``result.plan``, or its
        JSON (:func:`as_pipeline_plan`).
    microbatches
        Micro-batches per :meth:`step` (one flush); the batch is split along dimension 0.
    loss_fn
        ``loss_fn(output, target)`` of one micro-batch, on the rank of the last stage.
    device
        Default: ``cuda:LOCAL_RANK`` with NCCL, else the CPU.
    scale_grads
        Divide the gradients by ``microbatches`` (the mean over micro-batches, as one
        single-process step on the whole batch with a mean loss); ``False`` sums them.
    schedule_csv
        Load the action list from this CSV (``optmem export pipeline ... -o schedule.csv``)
        instead of deriving it from ``plan`` (both must describe the same allocation).

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

    def __init__(self, model: nn.Module | Sequence[nn.Module | Stage], plan: Any, *,
                 microbatches: int | None = None, loss_fn: LossFn | None = None,
                 device: torch.device | str | None = None, scale_grads: bool = True,
                 schedule_csv: str | None = None) -> None:
        super().__init__()
        self.plan = as_pipeline_plan(plan)
        self.microbatches = microbatches or default_microbatches(self.plan)
        self.device = torch.device(device) if device is not None else default_device()
        self.chain: Chain | None = None
        self.result: Result | None = None
        rank, size = dist.get_rank(), dist.get_world_size()
        used = pipeline_ranks(self.plan)
        if used[-1] >= size:
            raise OptmemInputError(f"the plan uses GPU {used[-1]} but only {size} processes run",
                                   field="gpus")
        modules = plan_stage_modules(model, self.plan)
        gpu_of = [st.gpu for st in self.plan.stages]
        self.stage_indices = [k for k, g in enumerate(gpu_of) if g == rank]
        self.stages = nn.ModuleList([modules[k] for k in self.stage_indices]).to(self.device)
        self.pp_group = dist.group.WORLD if used == list(range(size)) else dist.new_group(used)
        self._tied = self._tied_groups(modules, gpu_of, rank)
        self.has_first = 0 in self.stage_indices
        self.has_last = len(gpu_of) - 1 in self.stage_indices
        self.scale_grads = scale_grads
        self.schedule = self._build_schedule(modules, loss_fn, schedule_csv) \
            if self.stage_indices else None

    def _tied_groups(self, modules: Sequence[nn.Module], gpu_of: Sequence[int], rank: int
                     ) -> list[tuple[nn.Parameter, Any]]:
        """Tied parameters held here, each with the group of its holders (made on all ranks)."""
        groups: dict[tuple[int, ...], Any] = {}
        mine = []
        for param, gpus in _tied_parameters(modules, gpu_of):
            if gpus not in groups:  # every rank creates every group, in the same order
                groups[gpus] = dist.new_group(list(gpus))
            if rank in gpus:
                mine.append((param, groups[gpus]))
        return mine

    def _build_schedule(self, modules: Sequence[nn.Module], loss_fn: LossFn | None,
                        schedule_csv: str | None) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

        n_stages = len(modules)
        stages = [PipelineStage(modules[k], k, n_stages, self.device, group=self.pp_group)
                  for k in self.stage_indices]
        scaled = None if loss_fn is None else \
            _ScaledLoss(loss_fn, self.microbatches if self.scale_grads else 1)
        schedule = _PipelineScheduleRuntime(stages, self.microbatches, loss_fn=scaled,
                                            scale_grads=False)
        if schedule_csv is not None:
            schedule._load_csv(schedule_csv)
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

    def step(self, *inputs: Any, target: Any = None) -> list[torch.Tensor]:
        """One training step (forward and backward of every micro-batch, no weight update).

        ``inputs`` (the first stage's arguments) are used on the rank of the first stage and
        ``target`` on the rank of the last; other ranks may pass them or not. Returns the
        micro-batch losses on the rank holding the last stage, ``[]`` elsewhere. Gradients
        accumulate in ``.grad`` (call ``zero_grad()`` between steps, as usual).
        """
        before = [(p, None if p.grad is None else p.grad.detach().clone())
                  for p, _ in self._tied]
        losses: list[torch.Tensor] = []
        if self.schedule is not None:
            args = tuple(_to(x, self.device) for x in inputs) if self.has_first else ()
            tgt = _to(target, self.device) if self.has_last else None
            self.schedule.step(*args, target=tgt, losses=losses, return_outputs=False)
        self._reduce_tied(before)
        factor = self.microbatches if self.scale_grads else 1
        return [loss.detach() * factor for loss in losses]

    def _reduce_tied(self, before: list[tuple[nn.Parameter, torch.Tensor | None]]) -> None:
        """Sum this step's gradient of every tied weight over the ranks holding it."""
        for (param, group), (_, old) in zip(self._tied, before, strict=True):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            delta = grad if old is None else grad - old
            dist.all_reduce(delta, group=group)
            param.grad = delta if old is None else old + delta

    def extra_repr(self) -> str:  # noqa: D102
        return (f"stages={self.stage_indices} of {len(self.plan.stages)}, "
                f"microbatches={self.microbatches}, period={self.plan.period:g}")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value


def run_plan_pipelining(
    model: nn.Module | Sequence[nn.Module | Stage], plan: Any,
    inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], loss_fn: LossFn, *,
    device: torch.device | None = None, schedule_csv: str | None = None,
) -> list[float]:
    """Run any plan once on PyTorch's pipeline runtime, micro-batch gradients summed.

    ``inputs`` and ``targets`` are the micro-batches (equal sizes). Returns the micro-batch
    losses on the rank of the last stage. Same results as :func:`run_plan`.
    """
    piped = PipelinedModel(model, plan, microbatches=len(inputs), loss_fn=loss_fn,
                           device=device, scale_grads=False, schedule_csv=schedule_csv)
    losses = piped.step(torch.cat(list(inputs)), target=torch.cat(list(targets)))
    return [float(v) for v in losses]


# ------------------------------------------------------------------ one call
def pipeline(
    model: nn.Module | Sequence[nn.Module | Stage],
    sample: Any,
    gpus: int | None = None,
    memory_per_gpu: int | str = "16GiB",
    bandwidth: float | str | None = None,
    *,
    loss_fn: LossFn,
    microbatches: int | None = None,
    method: str = "madpipe",
    weight_copies: int = 4,
    memory_model: str = "stash",
    max_stages: int | None = None,
    time_limit_s: float | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    time_model: TimeModel | None = None,
    progress: bool | None = False,
) -> PipelinedModel:
    """Profile, solve, split and build the pipeline of ``model`` on ``gpus`` ranks.

    Run it on every rank (``torchrun --nproc_per_node P``): rank 0 profiles the chain on
    ``sample`` and solves the pipeline problem; the chain and the plan are broadcast, so
    every rank builds its part of the **same** plan.

    Parameters
    ----------
    model
        The same model on every rank (same weights: seed before building it).
    sample
        **One micro-batch** (the chain is profiled per micro-batch, like the period).
    gpus
        GPUs of the plan (default: the number of processes); GPU ``g`` is rank ``g``.
    memory_per_gpu
        Memory of each GPU: bytes or a size such as ``"16GiB"``.
    bandwidth
        Link bandwidth (``"12GB/s"`` or bytes per ms); ``None``: transfers are free.
    loss_fn
        ``loss_fn(output, target)`` of one micro-batch.
    microbatches
        Micro-batches per step (default: twice the number of stages).
    method
        Any ``pipeline`` method (``madpipe``, ``contiguous``, ``pipedream``, ``cpsat``, ...).
    weight_copies
        Copies of every weight a GPU holds: weights, gradients and Adam's two moments = 4
        (this runtime keeps one weight version: synchronous training with a flush).
    memory_model, time_limit_s
        Problem and solver options (``docs/pipeline.md``).
    max_stages
        Merge the extracted layers into at most this many, balanced by measured time.
    device
        As in :class:`PipelinedModel`.
    repeats, warmup, time_model, progress
        Profiling options (:func:`~optmem.pytorch.profile.profile_stages`).

    Returns
    -------
    PipelinedModel
        With ``.result`` (the solve: ``objective`` = predicted period in ms per micro-batch),
        ``.chain`` and ``.plan``; identical on every rank.
    """
    from optmem.problems.pipeline import PipelineProblem
    from optmem.result import SolveOptions
    from optmem.solvers.facade import solve
    from optmem.units import chain_rate, format_size, parse_size

    if not dist.is_initialized():
        raise OptmemInputError("optmem.pytorch.pipeline runs under torch.distributed: launch "
                               "with torchrun and call init_distributed() (or "
                               "init_process_group) first", field="backend")
    world = dist.get_world_size()
    gpus = world if gpus is None else gpus
    if gpus > world:
        raise OptmemInputError(f"the plan is for {gpus} GPUs but only {world} ranks run",
                               field="gpus")
    stages = extract_stages(model, allow_single=True)
    merge = max_stages is not None and len(stages) > max_stages
    name = type(model).__name__ if isinstance(model, nn.Module) else "torch"
    memory = parse_size(memory_per_gpu)

    def decide() -> tuple[list[float] | None, Chain, Result]:
        costs, merged = None, stages
        if merge:
            fine = profile_stages(stages, sample, device=device, repeats=1, warmup=1,
                                  name=name, progress=progress, time_model=time_model)
            costs = [f + b for f, b in zip(fine.fwd_time, fine.bwd_time, strict=True)]
            merged = merge_stages(stages, max_stages, costs)  # type: ignore[arg-type]
        chain = profile_stages(merged, sample, device=device, repeats=repeats, warmup=warmup,
                               name=name, progress=progress, time_model=time_model)
        beta = math.inf if bandwidth is None else \
            chain_rate(bandwidth, chain.time_unit, allow_inf=True)
        problem = PipelineProblem(chain, gpus, memory, chain_bandwidth=beta,
                                  weight_copies=weight_copies, memory_model=memory_model)
        result = solve(problem, method, options=SolveOptions(time_limit_s=time_limit_s))
        if not result.status.has_plan:
            hint = "" if result.min_feasible_memory is None else \
                f"; the smallest feasible memory is about {format_size(result.min_feasible_memory)}"
            raise OptmemInputError(f"no {method} pipeline plan for {name} on {gpus} GPUs with "
                                   f"{format_size(memory)} each: status {result.status}{hint}",
                                   field="memory_per_gpu")
        return costs, chain, result

    costs, chain, result = run_once(decide, resolve_group())
    if merge:
        stages = merge_stages(stages, max_stages, costs)  # type: ignore[arg-type]
    piped = PipelinedModel(stages, result, microbatches=microbatches, loss_fn=loss_fn,
                           device=device)
    piped.chain, piped.result = chain, result
    return piped


# ------------------------------------------------------------------ optmem's own runner
class _Mailbox:
    """Receives from each peer in that peer's send order (no tags needed)."""

    def __init__(self, expected: dict[int, list[tuple[str, int, int]]],
                 shapes: dict[tuple[str, int, int], tuple[torch.Size, torch.dtype]],
                 device: torch.device) -> None:
        self.queues = {peer: deque(keys) for peer, keys in expected.items()}
        self.shapes = shapes
        self.device = device
        self.box: dict[tuple[str, int, int], torch.Tensor] = {}

    def get(self, peer: int, key: tuple[str, int, int]) -> torch.Tensor:
        while key not in self.box:
            nxt = self.queues[peer].popleft()
            shape, dtype = self.shapes[nxt]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src=peer)
            assert work is not None
            work.wait()
            self.box[nxt] = buf
        return self.box.pop(key)


def _shapes(modules: Sequence[nn.Module], sample: torch.Tensor
            ) -> list[tuple[torch.Size, torch.dtype]]:
    """Output shape and dtype of every stage for one micro-batch (a no-grad dry run)."""
    out = []
    x = sample
    with torch.no_grad():
        for mod in modules:
            x = mod(x)
            out.append((x.shape, x.dtype))
    return out


def run_plan(
    model: nn.Module | Sequence[nn.Module | Stage], plan: Any,
    inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], loss_fn: LossFn, *,
    device: torch.device | None = None,
) -> list[float]:
    """Execute ``plan`` on this rank with optmem's point-to-point runner (one flush).

    Every rank holds the same ``model`` (only its own stages are moved to ``device``); the
    operations run in the plan's order (:func:`~optmem.pipeline_schedule.rank_programs`),
    with ``isend``/``irecv`` received in the sender's order (no tags: NCCL and gloo). Stage
    outputs must be single tensors. Gradients of the micro-batches are summed in ``.grad``.
    Returns the losses of the micro-batches whose last stage ran here.
    """
    plan = as_pipeline_plan(plan)
    modules = plan_stage_modules(model, plan)
    rank = dist.get_rank()
    device = device or torch.device("cpu")
    n_stages = len(plan.stages)
    gpu_of = {k: st.gpu for k, st in enumerate(plan.stages, start=1)}
    for k, g in gpu_of.items():
        if g == rank:
            modules[k - 1].to(device)
    shapes = _shapes(modules, inputs[0].to(device))
    programs = rank_programs(plan, len(inputs))
    # messages: ("a", s, m) = output of stage s sent to s+1; ("g", s, m) = grad to stage s
    sends: dict[tuple[int, int], list[tuple[float, tuple[str, int, int]]]] = defaultdict(list)
    msg_shapes: dict[tuple[str, int, int], tuple[torch.Size, torch.dtype]] = {}
    for gpu, ops in programs.items():
        for op in ops:
            if op.kind == "F" and op.stage < n_stages and gpu_of[op.stage + 1] != gpu:
                key = ("a", op.stage, op.microbatch)
                sends[(gpu, gpu_of[op.stage + 1])].append((op.time, key))
                msg_shapes[key] = shapes[op.stage - 1]
            if op.kind == "B" and op.stage > 1 and gpu_of[op.stage - 1] != gpu:
                key = ("g", op.stage - 1, op.microbatch)
                sends[(gpu, gpu_of[op.stage - 1])].append((op.time, key))
                msg_shapes[key] = shapes[op.stage - 2]
    order = {pair: [k for _, k in sorted(v, key=lambda item: item[0])]
             for pair, v in sends.items()}
    mailbox = _Mailbox({src: keys for (src, dst), keys in order.items() if dst == rank},
                       msg_shapes, device)
    pending: list[Any] = []
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    local: dict[tuple[str, int, int], torch.Tensor] = {}
    losses: list[float] = []

    def receive(kind: str, stage: int, m: int, peer: int) -> torch.Tensor:
        key = (kind, stage, m)
        return local.pop(key) if peer == rank else mailbox.get(peer, key)

    def deliver(kind: str, stage: int, m: int, peer: int, value: torch.Tensor) -> None:
        if peer == rank:
            local[(kind, stage, m)] = value
        else:
            pending.append(dist.isend(value.contiguous(), dst=peer))
        pending[:] = [req for req in pending if not req.is_completed()]  # free sent buffers

    for op in programs.get(rank, []):
        m, s = op.microbatch, op.stage
        if op.kind == "F":
            leaf = None
            if s == 1:
                x = inputs[m].to(device)
            else:
                leaf = receive("a", s - 1, m, gpu_of[s - 1]).detach().requires_grad_(True)
                x = leaf
            out = modules[s - 1](x)
            if s == n_stages:
                out = loss_fn(out, targets[m].to(device))
                losses.append(float(out.detach()))
            else:
                deliver("a", s, m, gpu_of[s + 1], out.detach())
            stash[(s, m)] = (leaf, out)
        else:
            leaf, out = stash.pop((s, m))
            if s == n_stages:
                out.backward()
            else:
                out.backward(receive("g", s, m, gpu_of[s + 1]))
            if s > 1:
                assert leaf is not None and leaf.grad is not None
                deliver("g", s - 1, m, gpu_of[s - 1], leaf.grad)
    for req in pending:
        req.wait()
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
