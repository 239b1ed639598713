"""Models, references and per-rank workers of the multi-process tests (gloo, CPU processes).

The workers run in processes started by :func:`optmem.pytorch.distributed.spawn`, which
imports this module by name (pytest puts ``tests/`` on ``sys.path`` and spawned processes
inherit it). Each worker runs several jobs in one process group (starting processes costs
far more than the runs) and saves what it computed to ``out_dir/rank{r}_job{k}.pt``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import optmem.pytorch as op
from optmem.errors import OptmemInputError
from optmem.pytorch import pipelining
from optmem.pytorch.zoo.gpt2 import Block, Embedding

VOCAB, CONTEXT, DIM = 32, 8, 16


# ------------------------------------------------------------------ models and data
class Residual(nn.Module):
    """``x + tanh(W x + b)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def residual_mlp(width: int = 16, depth: int = 6, seed: int = 0) -> nn.Sequential:
    """Residual blocks and a linear head (one chain stage each)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Residual(width) for _ in range(depth)], nn.Linear(width, 1))


def mlp_data(rows: int, width: int = 16, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen), torch.randn(rows, 1, generator=gen)


def tiny_gpt(blocks: int = 2, seed: int = 0) -> nn.Sequential:
    """A GPT-2 of the zoo's blocks, head tied to the token embedding, in a nested head.

    Chain layers (nested ``nn.Sequential`` flattened): embed, h0..h{blocks-1}, ln_f,
    lm_head. No dropout, so runs are deterministic.
    """
    torch.manual_seed(seed)
    embed = Embedding(DIM, VOCAB, CONTEXT, dropout=0.0)
    mods: OrderedDict[str, nn.Module] = OrderedDict(embed=embed)
    for i in range(blocks):
        mods[f"h{i}"] = Block(DIM, 2, CONTEXT, dropout=0.0)
    lm_head = nn.Linear(DIM, VOCAB, bias=False)
    lm_head.weight = embed.wte.weight
    mods["head"] = nn.Sequential(OrderedDict(ln_f=nn.LayerNorm(DIM), lm_head=lm_head))
    return nn.Sequential(mods)


class Transpose(nn.Module):
    """``x.transpose(1, 2)``: a non-contiguous view (ViT's patch embedding ends in one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def transposing(seed: int = 0) -> nn.Sequential:
    """Linear, two transposes, Linear: cut after the first transpose, a stage returns a
    non-contiguous tensor and the next one's input gradient is transposed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), Transpose(), Transpose(), nn.Linear(6, 3))


def transposing_data(rows: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, 4, generator=gen), torch.randn(rows, 4, 3, generator=gen)


def batchnorm_mlp(seed: int = 0) -> nn.Sequential:
    """Linear, BatchNorm, Tanh twice and a linear head: running statistics in two halves."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def dropout_pair(seed: int = 0) -> nn.Sequential:
    """Identity, Dropout(0.5), identity, Dropout(0.5): each unit survives both with
    probability 1/4 when the two masks are independent, 1/2 when they are equal."""
    torch.manual_seed(seed)
    eyes = [nn.Linear(64, 64, bias=False) for _ in range(2)]
    with torch.no_grad():
        for lin in eyes:
            lin.weight.copy_(torch.eye(64))
    return nn.Sequential(eyes[0], nn.Dropout(0.5), eyes[1], nn.Dropout(0.5))


def kept_fraction(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The fraction of nonzero outputs (a loss with a gradient, zero)."""
    return (out * target).sum() + (out != 0).float().mean()


def tiny_gpt_frozen_tie(seed: int = 0) -> nn.Sequential:
    """:func:`tiny_gpt` with its tied embedding and head weight frozen."""
    model = tiny_gpt(seed=seed)
    model.embed.wte.weight.requires_grad_(False)
    return model


def frozen_first_mlp(seed: int = 0) -> nn.Sequential:
    """``demo_model(8, 6)`` with its first three blocks frozen (a frozen embedding's place):
    the output of a plan stage holding only them needs no gradient."""
    model = pipelining.demo_model(8, 6, seed=seed)
    model[:3].requires_grad_(False)
    return model


class _Pair(nn.Module):
    """Returns its input and twice it (a head with two outputs)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x


def pair_head_mlp(seed: int = 0) -> nn.Sequential:
    """``demo_model(8, 4)`` ending in :class:`_Pair`: the last stage returns a tuple."""
    model = pipelining.demo_model(8, 4, seed=seed)
    model.append(_Pair())
    return model


def pair_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out[0], target) + out[1].mean()


def gpt_data(rows: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, CONTEXT), generator=gen),
            torch.randint(0, VOCAB, (rows, CONTEXT), generator=gen))


def lm_loss(logits: Any, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)  # a HuggingFace output holds them
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hf_gpt2(seed: int = 0) -> nn.Module:
    """HuggingFace ``GPT2LMHeadModel`` (tied head) with a tiny config, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=DIM, n_head=2, vocab_size=VOCAB,
                        n_positions=CONTEXT, use_cache=False, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def hf_llama(seed: int = 0) -> nn.Module:
    """HuggingFace ``LlamaForCausalLM`` (rotary embeddings, untied head), tiny config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=DIM, intermediate_size=2 * DIM,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=CONTEXT, use_cache=False)
    return LlamaForCausalLM(config)


def hf_bart(seed: int = 0) -> nn.Module:
    """HuggingFace ``BartForConditionalGeneration``, tiny, no dropout: every decoder layer
    reads the encoder's output, carried beside the boundaries (``graphcut.long_lived``)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=VOCAB, d_model=DIM, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=2 * DIM, decoder_ffn_dim=2 * DIM,
                        max_position_embeddings=CONTEXT, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, use_cache=False, pad_token_id=1,
                        decoder_start_token_id=2, bos_token_id=0, eos_token_id=2)
    return BartForConditionalGeneration(config)


# name: (build, data(rows) -> (x, y), loss_fn(output, y)); loss_fn None: the model's own
# loss, the call passing labels= (model_call)
def wide_mlp(seed: int = 0) -> nn.Sequential:
    """Three ``Linear(256, 256)`` + ``Tanh`` and a ``Linear(256, 256)``: 7 chain layers, the
    MLP of ``benchmarks/bench_pipeline_runtime.py --temporaries``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    layers.append(nn.Linear(256, 256))
    return nn.Sequential(*layers)


def wide_data(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 256, generator=gen), torch.randn(rows, 256, generator=gen)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], Any]] = {
    "mlp": (lambda: pipelining.demo_model(8, 6), lambda rows: mlp_data(rows, 8),
            nn.functional.mse_loss),
    "mlp3": (lambda: pipelining.demo_model(8, 3), lambda rows: mlp_data(rows, 8),
             nn.functional.mse_loss),
    "wide": (wide_mlp, wide_data, nn.functional.mse_loss),
    "mlp-pair-head": (pair_head_mlp, lambda rows: mlp_data(rows, 8), pair_loss),
    "mlp-frozen-first": (frozen_first_mlp, lambda rows: mlp_data(rows, 8),
                         nn.functional.mse_loss),
    "gpt": (tiny_gpt, gpt_data, lm_loss),
    "gpt-frozen-tie": (tiny_gpt_frozen_tie, gpt_data, lm_loss),
    "transposing": (transposing, transposing_data, nn.functional.mse_loss),
    "batchnorm": (batchnorm_mlp, lambda rows: mlp_data(rows, 8), nn.functional.mse_loss),
    "dropout": (dropout_pair, lambda rows: (torch.ones(rows, 64), torch.zeros(rows, 64)),
                kept_fraction),
    "hf-gpt2": (hf_gpt2, gpt_data, lm_loss),
    "hf-gpt2-labels": (hf_gpt2, gpt_data, None),
    "hf-llama-labels": (hf_llama, gpt_data, None),
    "hf-bart-labels": (hf_bart, gpt_data, None),
}


def model_call(loss_fn: Any, x: torch.Tensor, y: torch.Tensor
               ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, target)`` of a call: ``model(x)`` with the target ``y`` of
    ``loss_fn``, or ``model(input_ids=x, labels=y)`` when the model computes the loss."""
    if loss_fn is None:
        return (), {"input_ids": x, "labels": y}, None
    return (x,), {}, y


def reference_grads(model_name: str, microbatches: int, rows: int, *, mean: bool
                    ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process gradients (summed or averaged over micro-batches) and losses; a
    parameter without a gradient (frozen) is left out."""
    from optmem.pytorch.pipelining import model_loss

    build, data, loss_fn = MODELS[model_name]
    model = build()
    x, y = data(rows)
    losses = []
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        args, kwargs, target = model_call(loss_fn, xm, ym)
        out = model(*args, **kwargs)
        loss = model_loss(out) if loss_fn is None else loss_fn(out, target)
        (loss / microbatches if mean else loss).backward()
        losses.append(float(loss.detach()))
    return _grads(model), losses


def _save(out_dir: str, rank: int, job: int, data: dict[str, Any]) -> None:
    torch.save(data, os.path.join(out_dir, f"rank{rank}_job{job}.pt"))


def load(out_dir: str, rank: int, job: int) -> dict[str, Any]:
    return torch.load(os.path.join(out_dir, f"rank{rank}_job{job}.pt"), weights_only=False)


def whole_batch_grads(model_name: str) -> dict[str, torch.Tensor]:
    """Single-process gradients on the whole batch of both ranks (FSDP averages)."""
    model, (x, y), loss_fn = _fsdp_case(model_name, 2)
    args, kwargs, target = model_call(loss_fn, x, y)
    out = model(*args, **kwargs)
    (out.loss if loss_fn is None else loss_fn(out, target)).backward()
    return _grads(model)


def assert_steps_match(steps: list[dict[str, torch.Tensor]],
                       expected: dict[str, torch.Tensor]) -> None:
    """Every step's gradients are ``expected`` (the same names; rtol 1e-5, atol 1e-6)."""
    for step in steps:
        assert step.keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(step[name], grad, rtol=1e-5, atol=1e-6)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------ pipelines
def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]], out_dir: str) -> None:
    """Run every job (``job["kind"]`` names the function below) and save its outcome."""
    torch.set_num_threads(1)
    kinds = {"pipeline": pipeline_job, "one_call": one_call_job, "ddp": ddp_job,
             "fsdp": fsdp_job, "fsdp_refusal": fsdp_refusal_job, "ddp_hf": ddp_hf_job,
             "ddp_lengths": ddp_lengths_job, "ddp_branches": ddp_branches_job,
             "refusals": refusals_job, "pipeline_inputs": pipeline_inputs_job,
             "pipeline_peak": pipeline_peak_job, "pipeline_loss": pipeline_loss_job,
             "offload_fsdp": offload_fsdp_job, "blocks_sharded_after": blocks_sharded_after_job,
             "offload_fsdp_planned": offload_fsdp_planned_job,
             "fsdp_gathered_units": fsdp_gathered_units_job,
             "fsdp_refused_calls": fsdp_refused_calls_job,
             "ddp_offload": ddp_offload_job, "ddp_optimizer_state": ddp_optimizer_state_job,
             "ddp_static_graph": ddp_static_graph_job, "fsdp_reduce_dtype": fsdp_reduce_dtype_job,
             "tensor_parallel": tensor_parallel_job,
             "tensor_parallel_export": tensor_parallel_export_job,
             "tensor_parallel_fsdp": tensor_parallel_fsdp_job}
    for k, job in enumerate(jobs):
        _save(out_dir, rank, k, kinds[job["kind"]](rank, world, job))
        dist.barrier()


class SendCount:
    """``isend`` handles alive and not waited on (a sent message a runner still holds)."""

    def __init__(self) -> None:
        self.held = self.peak = 0

    def _release(self, state: list[bool]) -> None:
        if not state[0]:
            state[0] = True
            self.held -= 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[SendCount]:
        """Count the sends of ``dist.isend`` while active."""
        isend = dist.isend

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = isend(tensor, *args, **kwargs)
            state = [False]  # waited on or dropped
            handle = _CountedWork(work, lambda: self._release(state))
            weakref.finalize(handle, self._release, state)
            self.held += 1
            self.peak = max(self.peak, self.held)
            return handle

        dist.isend = counted
        try:
            yield self
        finally:
            dist.isend = isend


class _CountedWork:
    """A send's work that reports its ``wait()``."""

    def __init__(self, work: Any, on_wait: Callable[[], None]) -> None:
        self.work, self.on_wait = work, on_wait

    def wait(self) -> Any:
        out = self.work.wait()
        self.on_wait()
        return out

    def is_completed(self) -> bool:
        return self.work.is_completed()


def pipeline_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``{"model", "plan", "microbatches", "rows", "runner", "csv"?, "calls"?}``.

    ``runner`` is ``"runtime"`` (PyTorch's pipeline runtime, the plan's own action list or the
    CSV file ``csv``) or ``"p2p"`` (optmem's runner). Gradients are summed over micro-batches.
    ``held``: the most sends ``run_plan`` held at once (:class:`SendCount`); ``buffers``: the
    model's buffers that the run changed on this rank. ``calls``: how many times the runner
    is called one after the other (default 1), the losses of each call in turn.
    """
    del rank, world
    build, data, loss_fn = MODELS[job["model"]]
    model = build()
    x, y = data(job["rows"])
    xs, ys = list(x.chunk(job["microbatches"])), list(y.chunk(job["microbatches"]))
    sends = SendCount()
    losses = []
    for _ in range(job.get("calls", 1)):  # the losses of every call, one after the other
        if job["runner"] == "p2p":
            with sends.counting():
                losses += pipelining.run_plan(model, job["plan"], xs, ys, loss_fn)
        else:  # PyTorch's runtime sends with batch_isend_irecv (not counted)
            losses += pipelining.run_plan_pipelining(model, job["plan"], xs, ys, loss_fn,
                                                     schedule_csv=job.get("csv"))
    initial = dict(build().named_buffers())
    moved = {n: b.clone() for n, b in model.named_buffers() if not torch.equal(b, initial[n])}
    return {"grads": _grads(model), "losses": losses, "held": sends.peak, "buffers": moved}


def pipeline_peak_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``{"model", "plan", "microbatches", "rows"}`` on ``run_plan``, two steps.

    ``peak``: :func:`~optmem.pytorch.memory.measure_training_peak` of the second step
    (every storage the step creates; weights and their gradients left out), whose
    gradients and losses are returned.
    """
    from optmem.pytorch.memory import measure_training_peak

    del rank, world
    build, data, loss_fn = MODELS[job["model"]]
    model = build()
    x, y = data(job["rows"])
    xs, ys = list(x.chunk(job["microbatches"])), list(y.chunk(job["microbatches"]))
    losses: list[float] = []

    def step() -> None:
        losses[:] = pipelining.run_plan(model, job["plan"], xs, ys, loss_fn)

    step()  # the first step sets up the process group's pairs
    model.zero_grad(set_to_none=True)
    dist.barrier()
    peak = measure_training_peak(step, model)
    return {"grads": _grads(model), "losses": losses, "peak": peak}


def pipeline_inputs_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """What a 6-layer MLP's ``PipelinedModel`` (4 micro-batches) says about bad inputs.

    ``{"plan", "csv"}``: ``csv`` is the plan's schedule for 8 micro-batches. Returns the
    message of each call (``""``: it ran): the CSV, then steps of 10 rows, 8, 4, 12, 8
    under ``torch.no_grad()`` and 8 again, and on rank 0 (the first stage) a step without
    the batch; ``grads`` after them (two 8-row steps).
    """
    from optmem.errors import OptmemInputError

    del world
    model = MODELS["mlp"][0]()
    loss_fn = nn.functional.mse_loss
    x, y = mlp_data(8, 8)
    out: dict[str, Any] = {}

    def attempt(name: str, call: Callable[[], Any]) -> None:
        try:
            call()
            out[name] = ""
        except OptmemInputError as exc:
            out[name] = str(exc)

    attempt("csv", lambda: pipelining.PipelinedModel(model, job["plan"], microbatches=4,
                                                     loss_fn=loss_fn, schedule_csv=job["csv"]))
    piped = pipelining.PipelinedModel(model, job["plan"], microbatches=4, loss_fn=loss_fn)
    attempt("10 rows", lambda: piped.step(torch.cat([x, x[:2]]), target=torch.cat([y, y[:2]])))
    attempt("8 rows", lambda: piped.step(x, target=y))
    attempt("4 rows", lambda: piped.step(x[:4], target=y[:4]))
    attempt("12 rows", lambda: piped.step(torch.cat([x, x[:4]]), target=torch.cat([y, y[:4]])))
    with torch.no_grad():
        attempt("no_grad", lambda: piped.step(x, target=y))
    attempt("8 rows again", lambda: piped.step(x, target=y))
    if rank == 0:  # the first stage's rank without the batch (the others wait for nothing)
        attempt("no call", lambda: piped.step(target=y))
    out["grads"] = _grads(model)
    return out


def flagged_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mse_loss``, or a ``ValueError`` for a micro-batch whose target holds a 999."""
    if bool((target == 999).any()):
        raise ValueError("a target of 999 in this micro-batch")
    return nn.functional.mse_loss(out, target)


def rows_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss per row: not a scalar."""
    return ((out - target) ** 2).mean(dim=1)


def pipeline_loss_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """A loss that fails on the last stage's rank, then a good step, on one runner.

    ``{"plan", "runner"}`` (``"runtime"``: :class:`PipelinedModel`; ``"p2p"``:
    ``run_plan``). Steps of 8 rows in 4 micro-batches: a target with a 999 in the last
    micro-batch (``flagged_loss`` raises there), a loss per row (``rows_loss``), then
    after ``zero_grad`` a good step. Returns the message of each failed step (``""``: it
    ran) and the gradients of the good step.
    """
    from optmem.errors import OptmemInputError

    del world
    model = MODELS["mlp"][0]()
    x, y = mlp_data(8, 8)
    bad = y.clone()
    bad[-1, 0] = 999.0
    out: dict[str, Any] = {}
    piped = None if job["runner"] == "p2p" else \
        pipelining.PipelinedModel(model, job["plan"], microbatches=4, loss_fn=flagged_loss)
    rows = None if job["runner"] == "p2p" else \
        pipelining.PipelinedModel(model, job["plan"], microbatches=4, loss_fn=rows_loss)

    def step(loss_fn: Any, target: torch.Tensor) -> None:
        if piped is None:
            pipelining.run_plan(model, job["plan"], list(x.chunk(4)), list(target.chunk(4)),
                                loss_fn)
        else:
            (piped if loss_fn is flagged_loss else rows).step(x, target=target)

    for name, loss_fn, target in (("999", flagged_loss, bad), ("rows", rows_loss, y)):
        try:
            step(loss_fn, target)
            out[name] = ""
        except OptmemInputError as exc:
            out[name] = str(exc)
    model.zero_grad()
    step(flagged_loss, y)
    out["grads"] = _grads(model)
    out["rank"] = rank
    return out


def one_call_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``op.pipeline(...)`` then one step; rank 1 profiles a slower layer than rank 0.

    ``{"model", "method", "microbatches", "rows", "slow_layer", "fast_ends"?,
    "memory_model"?, "temporaries"?, "short_batch"?}`` (``memory_model``, ``temporaries``:
    ``op.pipeline``'s options; ``short_batch``: then a step two rows short, its error in
    ``short``). The time
    model gives every layer 1 ms forward and 2 ms backward, and ``slow_layer`` 30 ms forward
    on rank 1 only: ranks that planned alone would split differently. ``slow_layer`` is the
    index of an ``nn.Sequential``'s layer, or for another model the name of a parameter of
    the slow stage. ``fast_ends``: the first and last stage (the stages holding the tied
    embedding) take a quarter of the time (MadPipe then puts them on one rank).
    """
    build, data, loss_fn = MODELS[job["model"]]
    model = build()
    slow = job["slow_layer"]
    params = dict(model.named_parameters())
    layers = [s.module for s in op.extract_stages(model)] if isinstance(slow, int) else []

    def time_model(module: nn.Module, _x: Any, _y: Any) -> tuple[float, float]:
        mine = {id(p) for p in module.parameters()}
        if isinstance(slow, int):
            is_slow = next(i for i, m in enumerate(layers) if m is module) == slow
        else:
            is_slow = id(params[slow]) in mine
        fast = job.get("fast_ends") and (not mine or id(params[job["fast_ends"]]) in mine)
        scale = 0.25 if fast else 1.0
        return (30.0 if rank == 1 and is_slow else scale), 2.0 * scale

    x, y = data(job["rows"])
    args, kwargs, target = model_call(loss_fn, x, y)
    m = job["microbatches"]
    sample_args, sample_kwargs, _ = model_call(loss_fn, x.chunk(m)[0], y.chunk(m)[0])
    sample = sample_kwargs or sample_args[0]
    piped = op.pipeline(model, sample, gpus=world, memory_per_gpu="1GiB", bandwidth="10GB/s",
                        loss_fn=loss_fn, method=job["method"], microbatches=m,
                        time_model=time_model, repeats=1, warmup=0,
                        memory_model=job.get("memory_model", "stash"),
                        temporaries=job.get("temporaries", False))
    losses = piped.step(*args, target=target, **kwargs)
    short = ""
    if job.get("short_batch"):  # two rows short: one input error, before any message
        try:
            piped.step(*[a[:-2] for a in args], target=target,
                       **{k: v[:-2] for k, v in kwargs.items()})
        except OptmemInputError as exc:
            short = str(exc)
    return {"grads": _grads(model), "losses": [float(v) for v in losses], "short": short,
            "plan": piped.result.plan, "period": piped.result.objective,
            "report": dict(piped.result.report), "peak": piped.result.peak_memory,
            "chain": piped.chain,
            "stages": piped.stage_indices,
            "gpus": [st.gpu for st in piped.plan.stages], "layers": piped.chain.length}


def ddp_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """DDP over ``op.checkpoint`` of the residual MLP; each rank trains on its data shard.

    ``{"ddp": DDP kwargs, "memory_limit", "strip_suffix", "process_group": None | "local"}``.
    Rank 1's time model makes layer 3 thirty times slower than rank 0's, so plans solved
    locally differ. Two iterations (the second checks that the reducer's state carries
    over); with ``"local"`` only the plan is returned.
    """
    from torch.nn.parallel import DistributedDataParallel

    model = residual_mlp()
    x_all, y_all = mlp_data(8 * world)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]
    index = {id(m): i for i, m in enumerate(model)}

    def time_model(module: nn.Module, _x: Any, _y: Any) -> tuple[float, float]:
        return (30.0 if rank == 1 and index.get(id(module)) == 3 else 1.0), 2.0

    cmodel = op.checkpoint(model, x, memory_limit=job["memory_limit"], time_model=time_model,
                           strip_suffix=job["strip_suffix"], process_group=job["process_group"])
    grads: dict[str, torch.Tensor] = {}
    b_ops = [0]  # B ops run in this step (a monitor), and that count when each bucket's
    hooked: list[int] = []  # all-reduce started (with "watch_buckets")
    if job["process_group"] is None:
        ddp = DistributedDataParallel(cmodel, **job["ddp"])
        monitor = _watch_buckets(ddp, b_ops, hooked) if job.get("watch_buckets") else None
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
            b_ops[0] = 0
            hooked.clear()
            nn.functional.mse_loss(ddp(x), y).backward()
        if monitor is not None:
            from optmem.pytorch.execute import remove_monitor

            remove_monitor(monitor)
        grads = _grads(model)
    return {"grads": grads, "plan": cmodel.result.plan, "b_ops": b_ops[0],
            "bucket_hooks": list(hooked)}


def _watch_buckets(ddp: nn.Module, b_ops: list[int], hooked: list[int]
                   ) -> Callable[..., None]:
    """Count the executor's ``B`` ops in ``b_ops[0]``, and record the count in ``hooked``
    when DDP all-reduces a bucket; returns the monitor (to remove)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from optmem.pytorch.execute import add_monitor

    def count(op: str, *_: Any) -> None:
        if op.startswith("B "):
            b_ops[0] += 1

    def hook(state: Any, bucket: Any) -> Any:
        hooked.append(b_ops[0])
        return allreduce_hook(state, bucket)

    # DDP checks the real annotations (this module's are strings: future annotations)
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}

    add_monitor(count)
    ddp.register_comm_hook(None, hook)  # type: ignore[operator]
    return count


def ddp_hf_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """DDP over ``op.checkpoint`` of HuggingFace's GPT-2 (exported; ``labels=``, tied head).

    ``{"memory_limit", "lora"}``; default DDP arguments, two iterations, each rank on its
    shard; with ``lora``, the ``peft`` fine-tune :func:`hf_gpt2_lora`.
    """
    from torch.nn.parallel import DistributedDataParallel

    model = hf_gpt2_lora() if job.get("lora") else hf_gpt2()
    x_all, y_all = gpt_data(4 * world)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]
    cmodel = op.checkpoint(model, {"input_ids": x, "labels": y},
                           memory_limit=job["memory_limit"], time_model=lambda *_: (1.0, 2.0))
    ddp = DistributedDataParallel(cmodel)
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        ddp(input_ids=x, labels=y).loss.backward()
    return {"grads": _grads(model), "plan": cmodel.result.plan}


LENGTHS = ((12, 9), (10, 13), (14, 16))  # per step: rank 0's length, rank 1's


def hf_gpt2_long(seed: int = 0) -> nn.Module:
    """:func:`hf_gpt2` with room for sequences of 32 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=DIM, n_head=2, vocab_size=VOCAB, n_positions=32,
                        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def lengths_batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s token ids at ``step`` of the dynamic-padding job (2 x its length)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, LENGTHS[step][rank]), generator=g)


def ddp_lengths_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """DDP over ``op.checkpoint`` of HuggingFace's GPT-2 with dynamic padding: the ranks
    see different sequence lengths at the same step (:data:`LENGTHS`), some new to one rank
    only. ``{"memory_limit"}``; the gradients after each step's all-reduce."""
    from torch.nn.parallel import DistributedDataParallel

    model = hf_gpt2_long()
    sample = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    cmodel = op.checkpoint(model, {"input_ids": sample, "labels": sample},
                           memory_limit=job["memory_limit"], time_model=lambda *_: (1.0, 2.0))
    ddp = DistributedDataParallel(cmodel)
    steps = []
    for step in range(len(LENGTHS)):
        ids = lengths_batch(rank, step)
        ddp.zero_grad(set_to_none=True)
        ddp(input_ids=ids, labels=ids).loss.backward()
        steps.append(_grads(model))
    return {"steps": steps, "plan": cmodel.result.plan}


class Branchy(nn.Module):
    """Scales by a mask only when one is set: a branch on an input's value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lins = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lins[0](x))
        if mask.any():
            h = h * mask
        for lin in self.lins[1:]:
            h = torch.tanh(lin(h))
        return h.square().mean()


#: Per step, whether rank 0 and rank 1 set a mask: at step 1 rank 1 alone takes the other
#: side of the branch, at step 2 both do, at step 3 rank 0 alone.
MASKED = [(False, False), (False, True), (True, True), (True, False)]


def branches_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, DIM, generator=g)
    mask = (torch.rand(8, DIM, generator=g) > 0.5).float() if MASKED[step][rank] \
        else torch.zeros(8, DIM)
    return x, mask


def ddp_branches_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """DDP over ``op.checkpoint`` of :class:`Branchy`, the ranks on different sides of its
    branch at the same step (:data:`MASKED`); the gradients after each all-reduce."""
    from torch.nn.parallel import DistributedDataParallel

    model = Branchy()
    sample = (torch.randn(8, DIM, generator=torch.Generator().manual_seed(7)),
              torch.zeros(8, DIM))
    cmodel = op.checkpoint(model, sample, memory_limit="70%", fast_path=False,
                           time_model=lambda *_: (1.0, 2.0))
    ddp = DistributedDataParallel(cmodel)
    steps = []
    for step in range(len(MASKED)):
        ddp.zero_grad(set_to_none=True)
        ddp(*branches_batch(rank, step)).backward()
        steps.append(_grads(model))
    return {"steps": steps, "plan": cmodel.result.plan,
            "branches": len(cmodel._main.branches)}


def fsdp_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_fsdp`` on a CPU device mesh; ``grad.full_tensor()`` of every weight.

    ``{"model": "mlp" | "gpt" | "hf-gpt2" | "hf-bart", "memory_limit", "accumulate"}``; two
    iterations, each over two micro-batches with ``accumulate`` (:func:`_accumulate_twice`).
    The HuggingFace models are exported (``labels=`` in the call: the model's own loss);
    the warnings of the iterations are returned.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from optmem.pytorch.distributed import checkpoint_fsdp

    mesh = init_device_mesh("cpu", (world,))
    model, (x_all, y_all), loss_fn = _fsdp_case(job["model"], world)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]
    args, kwargs, target = model_call(loss_fn, x, y)
    cmodel = checkpoint_fsdp(model, kwargs or args[0], job["memory_limit"], mesh=mesh,
                             time_model=lambda *_: (1.0, 2.0))
    units = [m for m in cmodel.stages if hasattr(m, "_get_fsdp_state")]
    sharded = []  # per step: each unit's parameters sharded again once the forward is over
    reduced_early = []  # with "accumulate": parameters with a gradient after the unsynced half
    after_step = []  # per step: each unit's parameters sharded again once the step is over
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cmodel.zero_grad(set_to_none=True)
            if job.get("accumulate"):
                reduced_early.append(_accumulate_twice(cmodel, loss_fn, x, y))
                continue
            out = cmodel(*args, **kwargs)
            sharded.append([u._get_fsdp_state()._fsdp_param_group.is_sharded for u in units])
            (out.loss if loss_fn is None else loss_fn(out, target)).backward()
            after_step.append([u._get_fsdp_state()._fsdp_param_group.is_sharded
                               for u in units])
    grads = {n: p.grad.full_tensor() for n, p in cmodel.named_parameters()
             if p.grad is not None}
    new_size = ""  # a shorter call on every rank: one error saying to pad (stop 51)
    if job["model"] == "hf-gpt2":
        from optmem.errors import OptmemInputError

        short = {k: v[:, :-2].contiguous() for k, v in kwargs.items()}
        try:
            cmodel(**short)
        except OptmemInputError as exc:
            new_size = str(exc)
    return {"grads": grads, "new_size": new_size,
            "sharded_after_forward": sharded, "sharded_after_step": after_step,
            "reduced_early": reduced_early,
            "warnings": [str(c.message) for c in caught],
            "plan": cmodel.result.plan, "chain": cmodel.chain.to_dict(),
            "units": [type(m).__name__ for m in cmodel.stages],
            "keys": sorted(cmodel.state_dict())}


def offload_fsdp_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``op.offload`` or ``op.remat_offload`` sharded per stage with FSDP2
    (``fully_shard_checkpointed``) on a CPU device mesh; ``grad.full_tensor()`` per step.

    ``{"wrap": "offload" | "remat_offload", "model": "mlp" | "hf-gpt2", "memory_limit"}``;
    two iterations on the rank's shard, the transfers of the last one returned.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from optmem.pytorch.distributed import fully_shard_checkpointed

    mesh = init_device_mesh("cpu", (world,))
    model, (x_all, y_all), loss_fn = _fsdp_case(job["model"], world)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]
    args, kwargs, target = model_call(loss_fn, x, y)
    wrap = getattr(op, job["wrap"])
    omodel = wrap(model, kwargs or args[0], memory_limit=job["memory_limit"],
                  bandwidth="1GB/s", time_model=lambda *_: (1.0, 2.0))
    fully_shard_checkpointed(omodel, mesh=mesh)
    steps = []
    for _ in range(2):
        omodel.zero_grad(set_to_none=True)
        out = omodel(*args, **kwargs)
        (out.loss if loss_fn is None else loss_fn(out, target)).backward()
        steps.append({n: p.grad.full_tensor() for n, p in omodel.named_parameters()
                      if p.grad is not None})
    return {"steps": steps, "plan": [str(o) for o in omodel.result.plan],
            "keys": sorted(omodel.state_dict())}


def offload_fsdp_planned_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint, offload or remat + offload plan under FSDP2 on a CPU device mesh: two
    steps' ``grad.full_tensor()``, the plan, its chain and claimed peak, and the measured peak.

    ``{"model": "mlp" | "hf-gpt2", "problem": "checkpoint" | "offload" | "remat_offload",
    "memory_limit", "route": "checkpoint_fsdp" | "fully_shard_checkpointed", "bandwidth",
    "late_release", "fsdp_kwargs"}`` (bandwidth default ``"1GB/s"``; ``late_release``: keep
    the buffers of the last that many collectives, :func:`released_late`; ``fsdp_kwargs``:
    of every ``fully_shard``, ``checkpoint_fsdp`` route only): the plan of
    ``checkpoint_fsdp(..., problem=...)`` (its chain counts FSDP's gathered parameters), or
    ``fully_shard_checkpointed`` of the one-liner (a chain without them, the route before).
    The peak is :func:`optmem.pytorch.memory.measure_training_peak` of a third step, host
    copies left out (the memory the plan holds on its compute device); ``unit_bytes`` are
    the unsharded parameter bytes of each stage unit (0: not a unit), ``root_bytes`` those
    the root unit holds (gathered for the whole step), ``allowance`` the plan's
    :func:`~optmem.pytorch.memory.plan_allowance` (what a step holds beyond any chain:
    the gradient at the hand-over to autograd, the loss scalars, the side inputs).
    """
    from optmem.pytorch.distributed import (
        checkpoint_fsdp,
        fully_shard_checkpointed,
        sharded_stage_indices,
        stage_parameter_bytes,
    )
    from optmem.pytorch.memory import measure_training_peak, plan_allowance

    mesh = _cpu_mesh(world)
    model, (x_all, y_all), loss_fn = _fsdp_case(job["model"], world)
    x, y = (t.chunk(world)[rank].clone() for t in (x_all, y_all))  # storages of their own
    args, kwargs, target = model_call(loss_fn, x, y)
    times = {"time_model": lambda *_: (1.0, 2.0)}
    link = {} if job["problem"] == "checkpoint" else {"bandwidth": job.get("bandwidth",
                                                                          "1GB/s")}
    if job["route"] == "checkpoint_fsdp":
        omodel = checkpoint_fsdp(model, kwargs or args[0], job["memory_limit"],
                                 problem=job["problem"], mesh=mesh, **link, **times,
                                 fsdp_kwargs=job.get("fsdp_kwargs"))
    else:
        omodel = getattr(op, job["problem"])(model, kwargs or args[0],
                                             memory_limit=job["memory_limit"],
                                             fast_path=False, **link, **times)
        fully_shard_checkpointed(omodel, mesh=mesh)
    stages = list(omodel.stages)
    unit_bytes = stage_parameter_bytes(stages)  # a DTensor's numel is the unsharded one
    in_units = {id(p) for k in sharded_stage_indices(stages) for p in stages[k].parameters()}
    root = {id(p): p for p in omodel.parameters() if id(p) not in in_units}
    root_bytes = sum(p.numel() * p.element_size() for p in root.values())

    def step() -> None:
        out = omodel(*args, **kwargs)
        (out.loss if loss_fn is None else loss_fn(out, target)).backward()

    steps = []
    for _ in range(2):
        omodel.zero_grad(set_to_none=True)
        step()
        steps.append({n: p.grad.full_tensor() for n, p in omodel.named_parameters()
                      if p.grad is not None})
    omodel.zero_grad(set_to_none=True)
    with released_late(job.get("late_release", 0)):
        peak = measure_training_peak(step, omodel, kwargs or args, host_copies=False)
    compute = [o for o in map(str, omodel.result.plan) if not o.startswith(("offload",
                                                                              "prefetch"))]
    allowance = plan_allowance(omodel.chain, compute, stages,
                               strip_suffix=job["problem"] == "checkpoint")
    return {"steps": steps, "plan": [str(o) for o in omodel.result.plan],
            "chain": omodel.chain.to_dict(), "claimed": omodel.expected_peak_bytes,
            "measured": peak, "unit_bytes": unit_bytes, "root_bytes": root_bytes,
            "allowance": allowance,
            "kind": next(c.__name__ for c in type(omodel).__mro__  # FSDP renames it
                         if c.__name__ in ("CheckpointedModule", "OffloadedModule",
                                           "RematOffloadedModule")),
            "keys": sorted(omodel.state_dict())}


@contextlib.contextmanager
def released_late(depth: int) -> Iterator[None]:
    """While active, FSDP2's collectives keep their buffers until ``depth`` more ran.

    What gloo's worker thread does when it drops a finished collective late (a loaded
    machine), made deterministic: ``dist.all_gather_single`` and
    ``dist.reduce_scatter_single`` (FSDP2's) hold a reference to their output and input
    until ``depth`` more collectives ran. ``0``: nothing changes.
    """
    held: deque[tuple[Any, ...]] = deque(maxlen=max(depth, 1))
    originals = {name: getattr(dist, name)
                 for name in ("all_gather_single", "reduce_scatter_single")}

    def holding(collective: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            held.append((*args, *kwargs.values()))  # the output and input among them
            return collective(*args, **kwargs)
        return call

    if depth:
        for name, collective in originals.items():
            setattr(dist, name, holding(collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
        held.clear()


def fsdp_gathered_units_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_fsdp`` of the residual MLP: after every op of the plan (the executor's
    monitor), the stages whose FSDP unit holds its parameters gathered; and the gradients.

    ``{"problem": "checkpoint" | "remat_offload", "memory_limit", "bandwidth"}`` (default
    ``"1GB/s"``); the second step is watched (the first one initialises FSDP2's state).
    """
    from optmem.pytorch.distributed import checkpoint_fsdp
    from optmem.pytorch.execute import add_monitor, remove_monitor

    model, (x_all, y_all), loss_fn = _fsdp_case("mlp", world)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]
    link = {} if job["problem"] == "checkpoint" else {"bandwidth": job.get("bandwidth",
                                                                          "1GB/s")}
    cmodel = checkpoint_fsdp(model, x, job["memory_limit"], problem=job["problem"],
                             mesh=_cpu_mesh(world), time_model=lambda *_: (1.0, 2.0), **link)
    stages = list(cmodel.stages)
    gathered: list[tuple[str, list[int]]] = []

    def watch(op_: Any, *_: Any) -> None:
        gathered.append((str(op_), [k + 1 for k, st in enumerate(stages)
                                    if hasattr(st, "_get_fsdp_state")
                                    and not st._get_fsdp_state()._fsdp_param_group.is_sharded]))

    steps = []
    for step in range(2):
        cmodel.zero_grad(set_to_none=True)
        if step:
            add_monitor(watch)
        try:
            loss_fn(cmodel(x), y).backward()
        finally:
            remove_monitor(watch)
        steps.append({n: p.grad.full_tensor() for n, p in cmodel.named_parameters()
                      if p.grad is not None})
    return {"gathered": gathered, "steps": steps, "plan": [str(o) for o in cmodel.result.plan]}


def blocks_sharded_after_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``op.checkpoint`` of HuggingFace's GPT-2, then ``fully_shard`` on its blocks and on
    the wrapper (PyTorch's per-layer recipe, in the order optmem asks for); the message of
    the call's error (``""``: none)."""
    from torch.distributed.fsdp import fully_shard

    mesh = _cpu_mesh(world)
    model = hf_gpt2()
    x, y = (t.chunk(world)[rank] for t in gpt_data(4 * world))
    cmodel = op.checkpoint(model, {"input_ids": x, "labels": y}, memory_limit="60%",
                           time_model=lambda *_: (1.0, 2.0))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(cmodel, mesh=mesh)
    try:
        cmodel(input_ids=x, labels=y).loss.backward()
    except OptmemInputError as exc:
        return {"message": str(exc)}
    return {"message": ""}


def fsdp_refused_calls_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_fsdp`` of HuggingFace's GPT-2 wrapped outside ``torch.autocast`` and in
    train mode, then called inside an autocast (bfloat16), and in eval mode under
    ``torch.no_grad()``; the message of each call's error (``""``: none)."""
    from optmem.pytorch.distributed import checkpoint_fsdp

    model = hf_gpt2()
    x, y = (t.chunk(world)[rank] for t in gpt_data(4 * world))
    cmodel = checkpoint_fsdp(model, {"input_ids": x, "labels": y}, "70%",
                             mesh=_cpu_mesh(world), time_model=lambda *_: (1.0, 2.0))
    calls = {"autocast": (torch.autocast("cpu", dtype=torch.bfloat16), True),
             "no_grad": (torch.no_grad(), False)}
    messages = {}
    for name, (context, training) in calls.items():
        cmodel.train(training)
        messages[name] = ""
        try:
            with context:
                cmodel(input_ids=x, labels=y)
        except OptmemInputError as exc:
            messages[name] = str(exc)
    return messages


def _cpu_mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def ddp_offload_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """DDP over ``op.offload`` / ``op.remat_offload`` of the residual MLP against DDP over the
    model itself, in the same process: two AdamW steps on the rank's own data.

    ``{"wrap": "offload" | "remat_offload", "ddp": DDP kwargs, "accumulate": bool,
    "autocast": bool}``; with ``accumulate`` each step is two micro-batches, the first under
    ``no_sync()``; with ``autocast`` the forwards run under bfloat16 ``torch.autocast``. Returns
    both runs (:func:`_ddp_steps`) and the plan.
    """
    model = residual_mlp()
    x, y = mlp_data(8 * world, seed=3 + rank)  # each rank its own batch
    wrapped = getattr(op, job["wrap"])(model, x, memory_limit="60%", bandwidth="1GB/s",
                                       time_model=lambda *_: (1.0, 2.0))
    return {"wrapped": _ddp_steps(wrapped, x, y, job),
            "plain": _ddp_steps(residual_mlp(), x, y, job),
            "plan": [str(o) for o in wrapped.result.plan]}


def ddp_optimizer_state_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``torch.distributed.checkpoint.state_dict`` on DDP over ``op.checkpoint`` of the
    residual MLP after one AdamW step: the optimizer state's keys and whether setting it
    back works, through the DDP module (``"ddp"``) and through ``ddp.module`` (``"inner"``).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel

    x, y = mlp_data(8, seed=3 + rank)
    cmodel = op.checkpoint(residual_mlp(), x, memory_limit="60%",
                           time_model=lambda *_: (1.0, 2.0))
    ddp = DistributedDataParallel(cmodel)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    out: dict[str, Any] = {}
    for name, module in (("ddp", ddp), ("inner", cmodel)):
        state = get_optimizer_state_dict(module, opt)
        try:
            set_optimizer_state_dict(module, opt, state)
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        out[name] = {"keys": sorted(state["state"]), "error": error}
    return out


def ddp_static_graph_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``DistributedDataParallel(static_graph=True)`` over ``op.checkpoint`` of HuggingFace's
    GPT-2, each rank its own batch, against the same DDP over the plain model.

    ``{"route": "other_sample" | "submodule" | "new_length"}``:

    * ``"other_sample"``: the whole model wrapped with a sample without ``labels``, called
      with them: the first forward must profile the call; returns its error message;
    * ``"submodule"``: ``model.transformer`` wrapped with ``op.submodule_sample`` (the
      call the parent makes), two AdamW steps;
    * ``"new_length"``: the whole model wrapped with the training call, then a shorter
      length at the second step (profiled in a later iteration), three steps.

    Returns ``{"message"}`` or ``{"wrapped", "plain"}``: the gradients of each step.
    """
    from torch.nn.parallel import DistributedDataParallel

    x, y = gpt_data(4, seed=5 + rank)
    lengths = {"new_length": (CONTEXT, CONTEXT - 2, CONTEXT - 2), "submodule": (CONTEXT, CONTEXT),
               "other_sample": (CONTEXT,)}[job["route"]]  # one step: before, the 2nd hung
    plan = {"memory_limit": "60%", "fast_path": False, "time_model": lambda *_: (1.0, 2.0)}

    def steps(wrapped: bool) -> list[dict[str, torch.Tensor]]:
        model = hf_gpt2()
        if wrapped and job["route"] == "submodule":
            sample = op.submodule_sample(model, "transformer", input_ids=x, labels=y)
            model.transformer = op.checkpoint(model.transformer, sample, **plan)
        elif wrapped:
            sample = {"input_ids": x} if job["route"] == "other_sample" else {
                "input_ids": x, "labels": y}
            model = op.checkpoint(model, sample, **plan)
        ddp = DistributedDataParallel(model, static_graph=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        grads = []
        for length in lengths:
            opt.zero_grad(set_to_none=True)
            ddp(input_ids=x[:, :length].contiguous(),
                labels=y[:, :length].contiguous()).loss.backward()
            grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                          for n, p in ddp.module.named_parameters()})
            opt.step()
        return grads

    if job["route"] == "other_sample":
        try:
            steps(True)
        except OptmemInputError as exc:
            return {"message": str(exc)}
        return {"message": ""}
    return {"wrapped": steps(True), "plain": steps(False)}


def fsdp_reduce_dtype_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_fsdp`` of HuggingFace's GPT-2 with ``MixedPrecisionPolicy(reduce_dtype=
    torch.bfloat16)`` against the plain model sharded per block with the same policy: the
    gradients (``full_tensor()``) of two AdamW steps, each rank its shard of the batch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from optmem.pytorch.distributed import checkpoint_fsdp

    mesh = _cpu_mesh(world)
    x_all, y_all = gpt_data(4 * world)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]
    policy = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}

    def steps(model: nn.Module) -> list[dict[str, torch.Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(input_ids=x, labels=y).loss.backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            opt.step()
        return grads

    plain = hf_gpt2()
    for block in plain.transformer.h:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(plain, mesh=mesh, **policy)
    wrapped = checkpoint_fsdp(hf_gpt2(), {"input_ids": x, "labels": y}, 116000, mesh=mesh,
                              fsdp_kwargs=policy, time_model=lambda *_: (1.0, 2.0))
    return {"wrapped": steps(wrapped), "plain": steps(plain)}


def tensor_parallel_mlp(seed: int = 0) -> nn.Sequential:
    """Two ``Linear`` pairs (up, ``Tanh``, down, ``Tanh``) and a head: 9 chain stages."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 1))


def _full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a ``DTensor``'s ``full_tensor()``, another tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _parallelized(model: nn.Sequential, mesh: Any) -> nn.Sequential:
    """``model`` with its up / down pairs column- / row-wise parallel over ``mesh``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
            "6": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)  # type: ignore[return-value]


def tensor_parallel_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Tensor parallelism (``parallelize_module``) around ``op.checkpoint`` of an MLP.

    ``{"order": "after" | "inner"}``: the one-liner wraps the parallelized model
    (``"after"``), or parallelizes the wrapper's ``.module`` (``"inner"``). Every rank sees
    the same batch (one tensor-parallel group); rank 1's time model makes stage
    ``job.get("slow", 2)`` (0-based) thirty times slower (stage 0 changes the plan at
    ``"60%"``, stage 2 does not). ``job.get("process_group")``: the one-liner's. When the
    ranks' first plans differ, nothing is trained (``"differ"``: other re-runs could hang
    the collectives). Three AdamW steps, the third on a
    batch twice as large (a new size, profiled again); against the same steps of the plain
    parallelized model. Returns both runs' losses and gradients (``full_tensor()``) and
    each plan.
    """
    mesh = _cpu_mesh(world)
    x, y = mlp_data(16)
    batches = [(x[:8], y[:8]), (x[:8], y[:8]), (x, y)]

    def time_model(module: nn.Module, _x: Any, _y: Any) -> tuple[float, float]:
        return (30.0 if rank == 1 and module is modules[job.get("slow", 2)] else 1.0), 2.0

    def steps(model: nn.Module) -> dict[str, Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out: dict[str, Any] = {"losses": [], "grads": []}
        for xs, ys in batches:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
            out["losses"].append(loss.detach())
            out["grads"].append({n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad)
                                 for n, p in model.named_parameters()})
            opt.step()
        return out

    plan = {"memory_limit": "60%", "fast_path": False, "time_model": time_model,
            "process_group": job.get("process_group")}
    modules = list(tensor_parallel_mlp())
    if job["order"] == "after":
        wrapped = op.checkpoint(_parallelized(nn.Sequential(*modules), mesh), x[:8], **plan)
    else:
        wrapped = op.checkpoint(nn.Sequential(*modules), x[:8], **plan)
        _parallelized(wrapped.module, mesh)
    first = [str(o) for o in wrapped.result.plan]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, first)
    if any(p != first for p in every):  # other re-runs: training would hang (stop 85, "local")
        return {"plans": [first], "differ": True}
    out = {"wrapped": steps(wrapped), "plain": steps(_parallelized(tensor_parallel_mlp(), mesh)),
           "differ": False}
    out["plans"] = [[str(o) for o in v.result.plan] for v in wrapped._sized.values()]
    out["plans"].insert(0, [str(o) for o in wrapped.result.plan])
    return out


def tensor_parallel_export_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """HuggingFace's Llama (exported) with its projections column- / row-wise parallel:
    ``op.checkpoint`` of the parallelized model, and the first call of a wrapper whose
    ``.module`` was parallelized after wrapping. Returns the two error messages."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _cpu_mesh(world)
    x, y = gpt_data(4)
    sample = {"input_ids": x, "labels": y}
    plan: dict[str, Any] = {}
    for i in range(2):
        plan[f"model.layers.{i}.self_attn.q_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
    messages = {}
    for order in ("after", "inner"):
        try:
            if order == "after":
                op.checkpoint(parallelize_module(hf_llama(), mesh, plan), sample,
                              memory_limit="60%", time_model=lambda *_: (1.0, 2.0))
            else:
                cmodel = op.checkpoint(hf_llama(), sample, memory_limit="60%",
                                       time_model=lambda *_: (1.0, 2.0))
                parallelize_module(cmodel.module, mesh, plan)
                cmodel(**sample)
            messages[order] = ""
        except OptmemInputError as exc:
            messages[order] = str(exc)
    return messages


def tensor_parallel_fsdp_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_fsdp`` of a parallelized MLP on a 2D mesh (``world`` x 1: FSDP2 over
    the ranks, tensor parallelism over one), against the plain model parallelized and
    sharded per ``Linear`` the same way: two AdamW steps, each rank its shard of the batch.

    ``{"problem", "memory_limit"}``. Returns both runs' gradients (``full_tensor()``), the
    plan, the stage units' bytes (:func:`stage_parameter_bytes`) of the parallelized MLP on
    a ``world`` x 1 and (``"split"``) on a 1 x ``world`` mesh, and whether a ``DTensor``
    parameter has a storage address (``storage_ptr``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optmem.pytorch.distributed import checkpoint_fsdp, stage_parameter_bytes
    from optmem.pytorch.offload import storage_ptr

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    x_all, y_all = mlp_data(16)
    x, y = x_all.chunk(world)[rank], y_all.chunk(world)[rank]

    def steps(model: nn.Module) -> list[dict[str, torch.Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
        return grads

    plain = _parallelized(tensor_parallel_mlp(), mesh["tp"])
    for k in range(0, 9, 2):
        fully_shard(plain[k], mesh=mesh["dp"])
    fully_shard(plain, mesh=mesh["dp"])
    wrapped = checkpoint_fsdp(_parallelized(tensor_parallel_mlp(), mesh["tp"]), x,
                              job["memory_limit"], problem=job["problem"], bandwidth="1GB/s",
                              mesh=mesh["dp"], time_model=lambda *_: (1.0, 2.0))
    split = _parallelized(tensor_parallel_mlp(), _cpu_mesh(world))
    return {"wrapped": steps(wrapped), "plain": steps(plain),
            "plan": [str(o) for o in wrapped.result.plan],
            "bytes": stage_parameter_bytes(list(tensor_parallel_mlp())),
            "split": stage_parameter_bytes(list(split)),
            "address": storage_ptr(split[0].weight) is not None}


def _ddp_steps(module: nn.Module, x: torch.Tensor, y: torch.Tensor, job: dict[str, Any]
               ) -> dict[str, Any]:
    """Two AdamW steps of ``DistributedDataParallel(module)``: the losses, the gradients of
    each step, the parameters after, and an evaluation under ``torch.no_grad()``."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, **job["ddp"])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    parts = 2 if job.get("accumulate") else 1
    losses, grads = [], []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        for k, (xm, ym) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            with ddp.no_sync() if k < parts - 1 else contextlib.nullcontext():
                with (torch.autocast("cpu", dtype=torch.bfloat16) if job.get("autocast")
                      else contextlib.nullcontext()):
                    loss = nn.functional.mse_loss(ddp(xm), ym)
                loss.backward()
            losses.append(loss.detach())
        grads.append(_grads(ddp.module))
        opt.step()
    ddp.eval()
    with torch.no_grad():
        evaluated = ddp(x)
    return {"losses": losses, "grads": grads, "eval": evaluated,
            "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
            "keys": list(ddp.module.state_dict())}


def _accumulate_twice(cmodel: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor
                      ) -> list[str]:
    """Gradient accumulation over two micro-batches (the shard twice: a sharded exported
    model keeps the sample's sizes), FSDP2's way: the root's
    ``set_requires_gradient_sync(False)`` for the first. Returns the parameters that hold a
    (reduce-scattered) gradient after it, which none should."""
    args, kwargs, target = model_call(loss_fn, x, y)
    early: list[str] = []
    for k in range(2):
        cmodel.set_requires_gradient_sync(k == 1)  # type: ignore[operator]
        out = cmodel(*args, **kwargs)
        ((out.loss if loss_fn is None else loss_fn(out, target)) / 2).backward()
        if k == 0:
            early = [n for n, p in cmodel.named_parameters() if p.grad is not None]
    return early


def _fsdp_case(name: str, world: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor],
                                                 Any]:
    if name == "mlp":
        return residual_mlp(), mlp_data(8 * world), nn.functional.mse_loss
    if name == "gpt":
        return tiny_gpt(), gpt_data(4 * world), lm_loss
    if name == "hf-bart":
        return hf_bart(), gpt_data(4 * world), None
    if name == "hf-gpt2-lora":
        return hf_gpt2_lora(), gpt_data(4 * world), None
    if name == "hf-llama-frozen":
        return hf_llama_frozen(), gpt_data(4 * world), None
    return hf_gpt2(), gpt_data(4 * world), None


def hf_llama_frozen(seed: int = 0) -> nn.Module:
    """:func:`hf_llama` with the first half of its parameters frozen: the embedding's unit
    and the first block's halves hold frozen parameters only (and get no gradient in)."""
    model = hf_llama(seed)
    params = list(model.parameters())
    for p in params[:len(params) // 2]:
        p.requires_grad_(False)
    return model


def hf_gpt2_lora(seed: int = 0) -> nn.Module:
    """:func:`hf_gpt2` fine-tuned with ``peft`` LoRA adapters on ``c_attn``: the embeddings'
    stages and the MLP halves hold frozen parameters only."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(hf_gpt2(seed), LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))


def fsdp_refusal_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """What ``op.checkpoint`` and ``op.pipeline`` say about a module sharded first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optmem.errors import OptmemInputError

    del rank, job
    mesh = init_device_mesh("cpu", (world,))
    model = residual_mlp()
    for block in list(model)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = {"message": "", "pipeline": ""}
    try:
        op.checkpoint(model, torch.zeros(2, 16), memory_limit="1MiB", process_group="local")
    except OptmemInputError as exc:
        out["message"] = str(exc)
    try:
        op.pipeline(model, torch.zeros(2, 16), memory_per_gpu="1MiB")
    except OptmemInputError as exc:
        out["pipeline"] = str(exc)
    return out


def refusals_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """What ``op.checkpoint`` and ``op.pipeline`` say about a model they cannot take.

    HuggingFace's GPT-2 inside ``DistributedDataParallel`` (both), and an optmem-wrapped
    model given to ``op.pipeline``: ``{call: (field, message)}``, ``("", "")`` when no
    error was raised.
    """
    from torch.nn.parallel import DistributedDataParallel

    from optmem.errors import OptmemInputError

    del rank, world, job
    x, y = gpt_data(4)
    sample = {"input_ids": x, "labels": y}
    model = hf_gpt2()
    calls: dict[str, Callable[[], Any]] = {
        "checkpoint(ddp)": lambda: op.checkpoint(DistributedDataParallel(model), sample,
                                                 memory_limit="60%"),
        "pipeline(ddp)": lambda: op.pipeline(DistributedDataParallel(model), sample,
                                             memory_per_gpu="1GiB"),
        "pipeline(cmodel)": lambda: op.pipeline(
            op.checkpoint(model, sample, memory_limit="60%", process_group="local"), sample,
            memory_per_gpu="1GiB")}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ("", "")
        except OptmemInputError as exc:
            out[name] = (exc.field, str(exc))
    return out


# ------------------------------------------------------------------ process exit
_KEPT: list[Any] = []  # alive until the process ends, as a script's globals are


def exit_hooks(rank: int, world: int, out_dir: str) -> None:
    """Leave work for the process's exit; each piece marks ``out_dir/{name}{rank}`` when done.

    An ``atexit`` handler, a non-daemon thread still sleeping, a thread pool never shut down
    (its task waits for the thread), a line printed to a redirected ``sys.stdout`` without a
    flush, and a DDP module kept alive (its reducer holds the process group past
    ``destroy_process_group``: the case the race of ``end_process`` needs).
    """
    import atexit
    import sys
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from torch.nn.parallel import DistributedDataParallel

    def mark(name: str) -> None:
        with open(os.path.join(out_dir, f"{name}{rank}"), "w") as fh:
            fh.write(name)

    ddp = DistributedDataParallel(nn.Linear(2, 2))
    ddp(torch.ones(1, 2)).sum().backward()
    done = threading.Event()
    atexit.register(mark, "atexit")
    threading.Thread(target=lambda: (time.sleep(0.5), mark("thread"), done.set())).start()
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: (done.wait(), mark("pool")))
    sys.stdout = open(os.path.join(out_dir, f"stdout{rank}"), "w")  # noqa: SIM115
    print(f"rank {rank} of {world}")  # no flush: the exit flushes it
    _KEPT.extend([ddp, pool])
