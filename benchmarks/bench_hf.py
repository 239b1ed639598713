"""HuggingFace models: optmem's plans against HF's and torch's checkpointing, at equal real memory.

For GPT-2, Llama and BERT configs from ``transformers`` (random initialisation, nothing
downloaded; 12-24 layers, small hidden size and sequence so that a step takes a fraction
of a second on one CPU thread), one training step (forward with ``labels=``, the model's own
loss, backward; every method calls with the same keyword arguments, ``use_cache=False`` where
the model takes it: :func:`step_kwargs`) is run by

* **store-all**: the plain model;
* **HF**: ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
  {"use_reentrant": False})`` (every layer checkpointed);
* **per-layer k**: ``torch.utils.checkpoint.checkpoint(layer.forward, ...,
  use_reentrant=False)`` around every k-th layer (layers 0, k, 2k, ...; k = 1 is what HF
  does);
* **sequential s**: ``torch.utils.checkpoint.checkpoint_sequential`` over the model's own
  layer list in ``s`` segments (non-reentrant; the last segment is not checkpointed);
* **optmem**: ``optmem.pytorch.checkpoint`` of the whole model (one profile, then
  ``cmodel.resolve(memory_limit=...)`` for every limit), gradients checked equal to the plain
  model's; the DP charges the cost per recomputed segment the profile records (1.0 ms by
  default, ``DEFAULT_SEGMENT_COST_MS``); ``--segment-cost MS`` adds a series
  ``optmem seg=MS`` with that charge instead (``0``: no charge, the default before); from
  the plain model's measured peak up (``chain.extra["profile"]["plain_peak"]``) the wrapper
  calls the model itself (the store-all fast path, ``docs/pytorch.md``): such settings are
  labelled :data:`FAST`, and the limit grid reaches that peak;

**Memory is measured, not predicted**: the exact activation peak of one step
(:func:`optmem.pytorch.memory.measure_training_peak`: every storage created during the step,
weight gradients left out; parameters, buffers and gradients are not activations), and for
the main settings also torch's ``torch.distributed._tools.mem_tracker.MemTracker`` view
(:func:`optmem.pytorch.memory.memtracker_peak`). For every baseline's real peak, the optmem
limit whose plan really fits under it is searched (a grid of limits, then bisection between
the two grid limits around it: the real peak is not monotone in the limit), and step times
are compared at equal real memory; the plan at optmem's smallest feasible limit is kept as
well. Every optmem plan's real peak is checked against its limit plus
:func:`~optmem.pytorch.memory.plan_allowance` and the side inputs (column "real <= limit +
allowance"). Gradients: every optmem plan bitwise equal to the plain model's
(``torch.equal``), every baseline within :data:`GRAD_RTOL` (the largest difference is
printed). Times are process CPU time, medians of interleaved rounds (every setting in a
fixed order in every round, after a warm-up round), with the interquartile range. In a round
a setting runs ``--steps-per-round`` steps in a row (3) and keeps the fastest: interference
only adds time. Python's garbage collector runs before each timed step and is off during it,
and the script restarts itself with fixed glibc malloc settings (:data:`MALLOC_ENV`) so that
no setting pays page faults for memory the one before it gave back (``--no-malloc-env``:
glibc's defaults); the page faults per step are printed. The three measures are the same
for every method. **Noise floor**: the plain model is timed twice in every round, as the
first and as the last setting (``plain model, timed again``); the ratio of its two medians
is printed under the target verdicts (:func:`noise_floor`): a ratio to the best baseline
within that factor of 1 is below what the run resolves (the verdicts do not use it).

**Paired verdict** (``--paired N``): the strict verdicts compare medians of separate
settings, so on a 2-core machine whose noise floor is 1-3 % a near-tie falls either way.
With ``--paired N`` the comparisons the targets rest on (:func:`paired_comparisons`: at
every memory, optmem against the best baseline under it and every baseline within
:data:`NEAR` of it; optmem at halfway and at HF's memory against HF) are timed again in
``N`` rounds, each pair back to back in alternating order (:func:`time_pairs`), and judged
on the per-round ratios: their median and its distribution-free interval
(:func:`median_interval`; 96.5 % for ``N = 15``). A comparison is ``slower`` only when the
whole interval lies above 1; target 1 then reads "never measurably slower", target 2 uses
the median ratio (<= 0.90), target 3 "not measurably slower than HF". Both verdicts are
printed.

**Measured selection** (opt-in series): ``--autotune`` adds ``optmem autotune``
(:func:`autotune_series`: ``op.checkpoint(..., autotune=True)``'s candidates at the default
series' limits, those above the memory dropped); ``--autotune-per-memory`` adds ``optmem
autotune per memory`` (:func:`per_memory_series`): for every target memory, each autotune
cost-model setting's plan at that setting's *own* largest limit whose real peak fits the
memory, timed as autotune times them, the fastest kept (ties to the default plan). Its
comparisons join the ``--paired`` rounds and get their own paired verdict.

Usage::

    PYTHONPATH=. python benchmarks/bench_hf.py --quick            # GPT-2 only, short
    PYTHONPATH=. python benchmarks/bench_hf.py --markdown benchmarks/results/hf.md
    PYTHONPATH=. python benchmarks/bench_hf.py --rounds 5 --paired 15 --markdown out.md

The full run (3 models, 7 rounds, 3 steps per round, MemTracker) took 14.8 minutes under
load 3-4 on 2026-11-24's machine (about 11 of them CPU time of the script), of which the
interleaved timing is about 4 minutes of CPU; ``--steps-per-round 2`` saves about a third of
that, ``--no-memtracker`` the slow MemTracker pass.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import os
import re
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optmem.pytorch as op  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op  # noqa: E402
from optmem.pytorch.memory import (  # noqa: E402
    measure_training_peak,
    memtracker_peak,
    plan_allowance,
)
from optmem.simulate import simulate_checkpoint  # noqa: E402

MiB = 2 ** 20


# ------------------------------------------------------------------ models
@dataclass(frozen=True)
class Spec:
    """One model configuration: the builder's options and the batch shape."""

    name: str
    layers: int
    hidden: int
    seq: int
    batch: int
    vocab: int = 2048


FULL = [Spec("gpt2", 12, 128, 128, 4), Spec("llama", 16, 128, 128, 4),
        Spec("bert", 24, 128, 128, 2)]
QUICK = [Spec("gpt2", 12, 64, 64, 2)]


def build(spec: Spec) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (train mode, dropout off) and one batch ``{"input_ids", "labels"}``."""
    import transformers
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = max(2, spec.hidden // 32)
    if spec.name == "gpt2":
        model: nn.Module = GPT2LMHeadModel(GPT2Config(
            n_layer=spec.layers, n_embd=spec.hidden, n_head=heads, vocab_size=spec.vocab,
            n_positions=spec.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0))
    elif spec.name == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=spec.layers, hidden_size=spec.hidden,
            intermediate_size=spec.hidden * 8 // 3, num_attention_heads=heads,
            num_key_value_heads=heads, vocab_size=spec.vocab,
            max_position_embeddings=spec.seq))
    elif spec.name == "bert":
        model = BertForMaskedLM(BertConfig(
            num_hidden_layers=spec.layers, hidden_size=spec.hidden,
            intermediate_size=spec.hidden * 4, num_attention_heads=heads,
            vocab_size=spec.vocab, max_position_embeddings=spec.seq,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    else:
        raise ValueError(f"unknown model {spec.name!r}")
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq),
                        generator=torch.Generator().manual_seed(1))
    return model.train(), {"input_ids": ids, "labels": ids}


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer layers (its longest ``nn.ModuleList``)."""
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)


# ------------------------------------------------------------------ baselines


@contextmanager
def store_all(model: nn.Module) -> Iterator[nn.Module]:
    """The plain model."""
    yield model


@contextmanager
def hf_checkpointing(model: nn.Module) -> Iterator[nn.Module]:
    """HF's own gradient checkpointing (every layer, non-reentrant), the model as before after.

    ``gradient_checkpointing_enable`` also registers a forward hook on the input embeddings
    (``enable_input_require_grads``) that ``gradient_checkpointing_disable`` leaves in
    place: it is removed too, or an optmem wrapper of the same model would see a hook
    registered after wrapping and extract again (without the plan given by ``use_plan``).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield model
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()  # type: ignore[operator]
        model.disable_input_require_grads()  # type: ignore[operator]


@contextmanager
def per_layer(model: nn.Module, every: int) -> Iterator[nn.Module]:
    """``torch.utils.checkpoint`` around layers 0, k, 2k, ... (an instance ``forward``)."""
    chosen = [m for k, m in enumerate(layer_list(model)) if k % every == 0]
    for m in chosen:
        m.forward = partial(checkpoint, m.forward, use_reentrant=False)
    try:
        yield model
    finally:
        for m in chosen:
            del m.forward


class _Segments(nn.Module):
    """Stands for the first layer: runs all of them with ``checkpoint_sequential``."""

    def __init__(self, layers: list[nn.Module], segments: int) -> None:
        super().__init__()
        # registered here (the list of the model holds the stand-ins meanwhile), so that
        # model.parameters() keeps its order
        self.layers = nn.ModuleList(layers)
        self.segments = segments

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
        functions = [partial(_call_layer, m, args, kwargs) for m in self.layers]
        return checkpoint_sequential(functions, self.segments, hidden, use_reentrant=False)


def _call_layer(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                hidden: torch.Tensor) -> torch.Tensor:
    return layer(hidden, *args, **kwargs)


class _Pass(nn.Module):
    """Stands for the other layers: the hidden state goes through."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
        return hidden


@contextmanager
def sequential(model: nn.Module, segments: int) -> Iterator[nn.Module]:
    """``checkpoint_sequential`` over the model's layer list, ``segments`` segments."""
    layers = layer_list(model)
    saved = list(layers)
    layers[0] = _Segments(saved, segments)
    for k in range(1, len(saved)):
        layers[k] = _Pass()
    try:
        yield model
    finally:
        for k, m in enumerate(saved):
            layers[k] = m


# ------------------------------------------------------------------ measurement
def step_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments every method's call gets beside the batch: ``use_cache=False``.

    HF's causal models build a generation cache by default (``use_cache=True``), useless in
    training: GPT-2's plain step peaks at 102.70 MiB with it, 96.70 without. optmem's
    wrapper already calls with ``use_cache=False``
    (:func:`optmem.pytorch.wrapper.canonical_call`), so every method gets it, for memories
    and times that compare like for like. Empty for a model without that argument (BERT).
    """
    return {"use_cache": False} if "use_cache" in inspect.signature(
        model.forward).parameters else {}


def train_step(call: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> None:
    """One forward (the model's loss) and backward, with :func:`step_kwargs` for every method."""
    call(**batch, **step_kwargs(model)).loss.backward()


def real_peak(call: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> int:
    """The exact activation peak of one step (``measure_training_peak``; gradients None)."""
    model.zero_grad(set_to_none=True)
    peak = measure_training_peak(lambda: train_step(call, model, batch), model,
                                 list(batch.values()))
    model.zero_grad(set_to_none=True)
    return peak


def tracker_peak(call: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> int:
    """The same step seen by torch's ``MemTracker`` (``memtracker_peak``)."""
    model.zero_grad(set_to_none=True)
    peak = memtracker_peak(lambda: train_step(call, model, batch), model,
                           list(batch.values())).activations
    model.zero_grad(set_to_none=True)
    return peak


@dataclass(frozen=True)
class Timing:
    """What one round measured for one setting: the fastest of its ``k`` steps."""

    wall: float  # wall-clock ms of the step with the least CPU time
    cpu: float  # process CPU ms, the least of the k steps
    faults: float  # minor page faults per step (mean over the k steps)


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_steps(call: Callable[..., Any], model: nn.Module, batch: dict[str, Any],
                k: int = 1, *, gc_off: bool = True) -> Timing:
    """``k`` steps in a row, the fastest kept (gradients set to ``None`` before each).

    Interference (another process, an interrupt) only adds time, so the least of ``k``
    steps is the robust figure of a round. With ``gc_off``, Python's garbage collector is
    run before each step and disabled during it (a collection would land in one step or
    another).
    """
    best: tuple[float, float] | None = None
    faults = 0
    for _ in range(k):
        model.zero_grad(set_to_none=True)
        if gc_off:
            gc.collect()
            gc.disable()
        try:
            f0 = _minflt()
            w0, c0 = time.perf_counter(), time.process_time()
            train_step(call, model, batch)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            faults += _minflt() - f0
        finally:
            if gc_off:
                gc.enable()
        model.zero_grad(set_to_none=True)
        if best is None or cpu < best[1]:
            best = (wall, cpu)
    assert best is not None
    return Timing(best[0] * 1e3, best[1] * 1e3, faults / max(1, k))


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2 ** 20),
              "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)}
"""glibc malloc settings the benchmark runs under (``--no-malloc-env``: glibc's defaults).

With glibc's defaults, blocks above a dynamic threshold are ``mmap``-ed and freed memory
at the top of the heap is returned to the system, so a step that needs more memory than
the step before page-faults its activations in again (10,000 minor faults a step for GPT-2
store-all after a low-memory setting: +10 % time, and the IQR doubles). A fixed mmap
threshold (32 MiB, glibc's largest; every tensor of these configs is smaller) and no
trimming keep the pages mapped, so every setting runs on warm memory. glibc reads these
variables once, at start-up: :func:`reexec_with_malloc_env` restarts the process with
them."""


def reexec_with_malloc_env(argv: list[str]) -> None:
    """Restart this script with :data:`MALLOC_ENV` unless it is already set (no return)."""
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    env = {**os.environ, **MALLOC_ENV}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def gradients(call: Callable[..., Any], model: nn.Module,
              batch: dict[str, Any]) -> list[torch.Tensor | None]:
    """Parameter gradients of one step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    train_step(call, model, batch)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


# ------------------------------------------------------------------ predicted peaks
def stage_layers(names: tuple[str, ...] | list[str]) -> list[int | None]:
    """For every stage, the index of the transformer layer it belongs to (None outside)."""
    out: list[int | None] = []
    for name in names:
        m = re.search(r"\.(?:h|layers|layer)\.(\d+)(?:[.:]|$)", name)
        out.append(int(m.group(1)) if m else None)
    return out


def grouped_plan(groups: list[tuple[int, int, bool]]) -> tuple[Op, ...]:
    """The plan of stage groups ``(first, last, checkpointed)`` covering ``1..L`` in order.

    A checkpointed group keeps its input only and is re-run with ``F_all`` before its
    backward (``torch.utils.checkpoint`` on the group); the others keep their tapes.
    """
    fwd: list[Op] = []
    bwd: list[Op] = []
    for first, last, ck in groups:
        stages = range(first, last + 1)
        if ck:
            fwd += [F_ck(first), *(F_none(k) for k in stages[1:])]
            bwd = [*(F_all(k) for k in stages), *(B(k) for k in reversed(stages))] + bwd
        else:
            fwd += [F_all(k) for k in stages]
            bwd = [B(k) for k in reversed(stages)] + bwd
    return (*fwd, LOSS, *bwd)


def layer_groups(layers_of: list[int | None], checkpointed: list[list[int]]
                 ) -> list[tuple[int, int, bool]]:
    """Stage groups for checkpointed layer groups (lists of layer indices); rest stored."""
    group_of = {layer: g for g, members in enumerate(checkpointed) for layer in members}
    out: list[list[Any]] = []
    previous = None
    for s, layer in enumerate(layers_of, start=1):
        key = group_of.get(layer) if layer is not None else None
        if key is not None and key == previous:
            out[-1][1] = s
        else:
            out.append([s, s, key is not None])
        previous = key
    return [(a, b, c) for a, b, c in out]


def torch_segments(n: int, segments: int) -> list[list[int]]:
    """The layers of each checkpointed segment of ``checkpoint_sequential`` (torch 2.x)."""
    size = n // segments
    return [list(range(k * size, (k + 1) * size)) for k in range(segments - 1)]


# ------------------------------------------------------------------ one model
@dataclass
class Setting:
    """One way to train, with what was measured for it."""

    method: str
    setting: str
    enter: Callable[[], Any]  # a context manager yielding the callable to train with
    predicted_peak: int | None = None
    predicted_ms: float | None = None
    real_peak: int = 0  # exact activation peak of a step (measure_training_peak), bytes
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)  # minor page faults per step, by round
    limit: int | None = None
    allowance: int | None = None  # plan_allowance of an optmem plan (bytes)
    tracker: int | None = None  # MemTracker's activation peak of the same step (bytes)
    autotune: dict[str, Any] = field(default_factory=dict)  # the autotune record, if tuned

    @property
    def median(self) -> float:
        """Median process CPU time of a step (ms): the figure compared."""
        return statistics.median(self.cpu)

    @property
    def iqr(self) -> float:
        """Interquartile range of the CPU times (ms)."""
        if len(self.cpu) < 2:
            return 0.0
        q = statistics.quantiles(self.cpu, n=4, method="inclusive")
        return q[2] - q[0]

    @property
    def faults_median(self) -> float:
        """Median minor page faults per timed step (0 when the heap stays mapped)."""
        return statistics.median(self.faults) if self.faults else 0.0

    @property
    def wall_median(self) -> float:
        """Median wall-clock time of a step (ms)."""
        return statistics.median(self.wall)

    @property
    def label(self) -> str:
        return f"{self.method} {self.setting}"


class OptmemSearch:
    """The DP plans of one profiled chain at many limits, with their real peaks."""

    def __init__(self, cmodel: Any, model: nn.Module, batch: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> None:
        self.cmodel = cmodel
        self.extra = dict(extra or {})  # the dp method's extra options (segment_cost)
        self.model = model
        self.batch = batch
        self.chain: Chain = cmodel.chain
        self.smallest = op.smallest_limit(self.chain)
        # up to the plain model's measured peak, where the store-all fast path starts
        self.top = max(int(self.chain.store_all_peak() * 1.02) + 1, plain_peak(self.chain))
        self.by_plan: dict[tuple[tuple[str, ...], bool], int] = {}
        self.by_limit: dict[int, tuple[tuple[str, ...], int, float, int]] = {}
        self.fast: dict[int, bool] = {}  # limit -> the store-all fast path is taken there

    def at(self, limit: int) -> tuple[tuple[str, ...], int, float, int]:
        """``(plan, predicted peak, predicted ms, real peak)`` of the DP plan at ``limit``.

        Where the store-all fast path is taken (the plain model's measured peak fits), the
        model itself runs: predicted peak and time are the plain model's measured peak and
        the chain's store-all time.
        """
        if limit not in self.by_limit:
            plan = tuple(self.cmodel.resolve(memory_limit=limit, extra=dict(self.extra)).plan)
            self.fast[limit] = bool(self.cmodel.fast_path_taken)
            self._record(limit, plan, self.fast[limit])
        return self.by_limit[limit]

    def _record(self, limit: int, plan: tuple[str, ...], fast: bool) -> None:
        """``by_limit[limit]`` for ``plan``, which ``cmodel`` runs now (real peak measured once)."""
        if (plan, fast) not in self.by_plan:
            self.by_plan[plan, fast] = real_peak(self.cmodel, self.model, self.batch)
        sim = simulate_checkpoint(self.chain, plan)
        pred = (plain_peak(self.chain), self.chain.total_compute_time()) if fast else \
            (int(sim.peak_memory), float(sim.makespan))
        self.by_limit[limit] = (plan, pred[0], float(pred[1]), self.by_plan[plan, fast])

    def grid(self, points: int) -> list[int]:
        """Limits from the smallest feasible one to just above store-all."""
        return [int(self.smallest + (self.top - self.smallest) * k / (points - 1))
                for k in range(points)]

    def fit(self, memory: int, points: int, steps: int) -> int | None:
        """The largest limit seen whose plan's real peak is at most ``memory``.

        Scans the grid, then bisects ``steps`` times between the largest fitting grid limit
        and the next one (the real peak is not monotone in the limit, so the grid comes
        first); ``None`` when no plan fits.
        """
        grid = self.grid(points)
        fitting = [lim for lim in grid if self.at(lim)[3] <= memory]
        if not fitting:
            return None
        lo = max(fitting)
        above = [lim for lim in grid if lim > lo]
        if above:
            hi = min(above)
            for _ in range(steps):
                mid = (lo + hi) // 2
                if mid in (lo, hi):
                    break
                if self.at(mid)[3] <= memory:
                    lo = mid
                else:
                    hi = mid
        return lo


@dataclass
class Series:
    """optmem on one chain: the plan found for every target memory, and its settings."""

    name: str
    search: OptmemSearch
    matched: dict[str, int | None] = field(default_factory=dict)
    settings: dict[int, Setting] = field(default_factory=dict)

    def at_target(self, label: str) -> Setting | None:
        """The setting that optmem uses under target ``label`` (None: no plan fits)."""
        limit = self.matched.get(label)
        return None if limit is None else self.settings[limit]


def plain_peak(chain: Chain) -> int:
    """The plain model's measured real peak recorded by the profile (0: not measured)."""
    return int(((chain.extra or {}).get("profile") or {}).get("plain_peak") or 0)


@contextmanager
def _with_plan(cmodel: Any, plan: tuple[str, ...], limit: int) -> Iterator[Any]:
    cmodel.use_plan(plan, method="dp", memory_limit=limit)  # fast path as resolve() decides
    yield cmodel


FAST = " (fast path: the module itself)"
"""Appended to an optmem setting's label where the store-all fast path is taken."""

SMALLEST = "optmem's smallest limit"
"""The label of the plan at the smallest feasible limit (below every target memory)."""

REPEAT = "plain model, timed again"
"""The plain model's second setting: timed last in every round (the plain model itself is
timed first), so the two are independent settings of the same code and the ratio of their
medians is the run's noise floor (:func:`noise_floor`)."""


def run_series(name: str, cmodel: Any, model: nn.Module, batch: dict[str, Any],
               targets: dict[str, int], grid: int, steps: int,
               extra: dict[str, Any] | None = None) -> Series:
    """Find, for every target memory, the optmem limit whose plan really fits under it.

    Also keeps the plan at the smallest feasible limit (label :data:`SMALLEST`), the least
    memory optmem can train in.
    """
    series = Series(name, OptmemSearch(cmodel, model, batch, extra))
    for label, memory in targets.items():
        series.matched[label] = series.search.fit(memory, grid, steps)
    series.matched[SMALLEST] = series.search.smallest
    for limit in series.matched.values():
        if limit is not None and limit not in series.settings:
            plan, pred_peak, pred_ms, peak = series.search.at(limit)
            cmodel.use_plan(plan, method="dp", memory_limit=limit)
            fast = series.search.fast[limit]
            assert fast == cmodel.fast_path_taken
            # the fast path runs the model itself: its measured peak is within the limit
            allowance = 0 if fast else plan_allowance(cmodel.chain, plan, list(
                cmodel.stages)) + cmodel.side_input_bytes()
            label = f"limit {limit / MiB:.2f} MiB" + (FAST if fast else "")
            series.settings[limit] = Setting(name, label,
                                             partial(_with_plan, cmodel, plan, limit),
                                             pred_peak, pred_ms, peak, limit=limit,
                                             allowance=allowance)
    return series


AUTOTUNE = "optmem autotune"
"""The name of the series whose plans :func:`optmem.pytorch.autotune.autotune` chose."""


def autotune_series(base: Series, cmodel: Any, model: nn.Module, batch: dict[str, Any],
                    targets: dict[str, int]) -> Series:
    """optmem with measured plan selection at the limits ``base`` matched to each memory.

    At every limit of ``base``, the candidates of :func:`optmem.pytorch.autotune.autotune`
    (the plans of its cost-model settings at that limit) are formed; those whose real
    peak exceeds a target memory the limit was matched to are dropped (the candidates fit
    the limit in the chain model, not necessarily the real memory the limit was searched
    for; the default plan always fits), the rest timed as autotune times them (wall clock,
    interleaved, on the batch) and the fastest median kept. Where the store-all fast path
    is taken nothing is timed.
    """
    from optmem.pytorch.autotune import (
        AUTOTUNE_ROUNDS,
        candidates,
        chosen_record,
        fastest,
        time_candidates,
    )

    ser = Series(AUTOTUNE, base.search, dict(base.matched))
    for limit, default in base.settings.items():
        cmodel.resolve(memory_limit=limit)
        fast = bool(cmodel.fast_path_taken)
        cands = candidates(cmodel._planner, cmodel.chain, limit, cmodel.result)
        room = min((targets.get(label, default.real_peak) for label, lim in
                    base.matched.items() if lim == limit), default=default.real_peak)
        peaks = {cands[0].plan_id: default.real_peak}
        for cand in cands[1:] if not fast else []:
            cmodel.use_plan(cand.plan, method="dp", memory_limit=limit)
            peaks[cand.plan_id] = real_peak(cmodel, model, batch)
        fitting = [c for c in (cands[:1] if fast else cands) if peaks[c.plan_id] <= room]
        skipped = "store-all fast path" if fast else None if len(fitting) > 1 else \
            "one candidate fits the memory"
        if skipped is None:
            cmodel.use_plan(cands[0].plan, method="dp", memory_limit=limit)
            time_candidates(cmodel, batch, fitting)
        best = fitting[fastest(fitting)]
        record = {"rounds": AUTOTUNE_ROUNDS, "warmup": 1, "skipped": skipped,
                  **chosen_record(cands, cands.index(best))}
        for row in record["candidates"]:
            row["real_peak"] = peaks.get(row["plan_id"])
        plan = tuple(str(p) for p in best.plan)
        sim = simulate_checkpoint(cmodel.chain, plan)
        cmodel.use_plan(plan, method="dp", memory_limit=limit)
        allowance = 0 if fast else plan_allowance(cmodel.chain, plan, list(
            cmodel.stages)) + cmodel.side_input_bytes()
        pred = (default.predicted_peak, default.predicted_ms) if fast else \
            (int(sim.peak_memory), float(sim.makespan))
        ser.settings[limit] = Setting(AUTOTUNE, default.setting,
                                      partial(_with_plan, cmodel, plan, limit), pred[0],
                                      pred[1], peaks[best.plan_id], limit=limit,
                                      allowance=allowance, autotune=record)
    return ser


PER_MEMORY = "optmem autotune per memory"
"""The series whose plans autotune's settings chose for each target memory itself."""

NO_FIT = sys.maxsize
"""The real peak recorded for a limit where a setting has no plan (nothing fits under it)."""


class SettingSearch(OptmemSearch):
    """The plans of one autotune cost-model setting at many limits, with their real peaks.

    ``at(limit)`` is the plan :func:`optmem.pytorch.autotune._solve_under` gives at ``limit``
    on the chain re-charged per ``setting`` (sizes unchanged, so the plan fits ``limit`` in
    the chain model too); :meth:`OptmemSearch.fit` then finds the largest limit whose plan
    of *this* setting really fits under a memory. The predicted peak and time are the
    simulator's on the profiled chain. Where the store-all fast path is taken the plan is
    irrelevant (the module itself runs), as in :class:`OptmemSearch`.
    """

    def __init__(self, cmodel: Any, model: nn.Module, batch: dict[str, Any],
                 setting: Any) -> None:
        super().__init__(cmodel, model, batch)
        self.setting = setting

    def at(self, limit: int) -> tuple[tuple[str, ...], int, float, int]:
        """``(plan, predicted peak, predicted ms, real peak)`` of the setting at ``limit``."""
        from optmem.pytorch.autotune import _solve_under

        if limit not in self.by_limit:
            result = _solve_under(self.cmodel._planner, self.chain, limit, self.setting)
            if result is None or not result.status.has_plan:
                self.by_limit[limit] = ((), 0, 0.0, NO_FIT)
                return self.by_limit[limit]
            plan = tuple(str(x) for x in result.plan)
            self.cmodel.use_plan(plan, method="dp", memory_limit=limit)  # decides the fast path
            self.fast[limit] = bool(self.cmodel.fast_path_taken)
            self._record(limit, plan, self.fast[limit])
        return self.by_limit[limit]


def per_memory_series(base: Series, cmodel: Any, model: nn.Module, batch: dict[str, Any],
                      targets: dict[str, int], grid: int, steps: int,
                      timer: Any = None) -> Series:
    """optmem with measured plan selection among plans that fit each target memory.

    For every target memory and every cost-model setting of
    :data:`optmem.pytorch.autotune.SETTINGS`, the largest limit whose plan *of that setting*
    really fits under the memory (:class:`SettingSearch`, the default series' own search for
    the profile's setting); the distinct plans found are timed as
    :func:`optmem.pytorch.autotune.autotune` times its candidates (wall clock, one warm-up
    step, then interleaved rounds; ``timer`` replaces the clock) and the fastest median is
    kept, ties to the default plan. Where the default plan is the store-all fast path
    nothing is timed. Unlike :func:`autotune_series` (candidates formed at the default
    series' limit, dropped when they exceed the memory), every setting gets its own limit
    here, so a plan with fewer segments that needs a slightly smaller limit competes.
    """
    from optmem.pytorch.autotune import (
        AUTOTUNE_ROUNDS,
        SETTINGS,
        Candidate,
        chosen_record,
        fastest,
        replayed,
        time_candidates,
    )

    searches = [base.search] + [SettingSearch(cmodel, model, batch, s) for s in SETTINGS[1:]]
    cost = float(cmodel._planner.options(cmodel.chain).extra.get("segment_cost", 0.0))
    ser = Series(PER_MEMORY, base.search)
    kept: dict[tuple[tuple[str, ...], int], int] = {}  # (plan, limit) -> key of ser.settings
    for label, memory in targets.items():
        found: list[Found] = []
        for setting, search in zip(SETTINGS, searches, strict=True):
            limit = base.matched.get(label) if search is base.search else \
                search.fit(memory, grid, steps)
            if limit is None or search.at(limit)[3] > memory:
                continue
            plan = search.at(limit)[0]
            same = next((f for f in found if f.candidate.plan == plan), None)
            if same is not None:
                same.candidate.settings.append(setting.name)
                continue
            result = replayed(cmodel.chain, limit, plan, cost, setting.name)
            found.append(Found(Candidate(plan, result, [setting.name]), limit, search))
        if not found or found[0].search is not base.search:  # the default series has none
            ser.matched[label] = None
            continue
        fast = base.search.fast[found[0].limit]
        cands = [f.candidate for f in found]
        skipped = "store-all fast path" if fast else None if len(cands) > 1 else \
            "one candidate fits the memory"
        if skipped is None:
            cmodel.use_plan(cands[0].plan, method="dp", memory_limit=found[0].limit)
            time_candidates(cmodel, batch, cands, timer=timer)
        best = 0 if skipped else fastest(cands)
        record = {"rounds": AUTOTUNE_ROUNDS, "warmup": 1, "skipped": skipped,
                  **chosen_record(cands, best)}
        for row, f in zip(record["candidates"], found, strict=True):
            row["limit"] = f.limit
            row["real_peak"] = f.search.at(f.limit)[3]
        ser.matched[label] = _per_memory_setting(ser, kept, cmodel, found[best], record)
    least = base.search.smallest
    plan = base.search.at(least)[0]
    smallest = Found(Candidate(plan, replayed(cmodel.chain, least, plan, cost, SETTINGS[0].name),
                               [SETTINGS[0].name]), least, base.search)
    ser.matched[SMALLEST] = _per_memory_setting(ser, kept, cmodel, smallest, {
        "skipped": "the smallest limit: the default plan"})
    return ser


@dataclass
class Found:
    """A candidate of :func:`per_memory_series`: its plan, the limit and search that gave it."""

    candidate: Any
    limit: int
    search: OptmemSearch


def _per_memory_setting(ser: Series, kept: dict[tuple[tuple[str, ...], int], int],
                        cmodel: Any, found: Found, record: dict[str, Any]) -> int:
    """The key in ``ser.settings`` of the setting running ``found`` (one per plan and limit)."""
    limit = found.limit
    plan, pred_peak, pred_ms, peak = found.search.at(limit)
    key = kept.get((plan, limit))
    if key is not None:
        return key
    fast = found.search.fast[limit]
    cmodel.use_plan(plan, method="dp", memory_limit=limit)
    assert fast == cmodel.fast_path_taken
    allowance = 0 if fast else plan_allowance(cmodel.chain, plan, list(
        cmodel.stages)) + cmodel.side_input_bytes()
    label = f"limit {limit / MiB:.2f} MiB" + (FAST if fast else "") + \
        ("" if found.search is ser.search else f" ({', '.join(found.candidate.settings)})")
    key = kept[plan, limit] = len(kept)
    ser.settings[key] = Setting(PER_MEMORY, label, partial(_with_plan, cmodel, plan, limit),
                                pred_peak, pred_ms, peak, limit=limit, allowance=allowance,
                                autotune=record)
    return key


def autotune_table(ser: Series) -> list[str]:
    """Every limit of the autotune series: its candidates, measured medians and the choice."""
    rows = _header("limit MiB", "candidate plan", "settings", "segments", "model ms",
                   "real peak MiB", "measured ms (median)", "chosen")
    for st in sorted(ser.settings.values(), key=lambda x: x.limit or 0):
        record = st.autotune
        note = f" ({record['skipped']})" if record.get("skipped") else ""
        for c in record.get("candidates", []):
            ms = "-" if c["measured_ms"] is None else f"{c['measured_ms']:.1f}"
            rows.append(f"| {_mib(c.get('limit', st.limit))} | {c['plan_id']} | "
                        f"{', '.join(c['settings'])} | {c['segments']} | "
                        f"{c['model_objective']:.2f} | "
                        f"{_mib(c.get('real_peak'))} | {ms} | "
                        f"{'yes' if c['chosen'] else ''}{note if c['chosen'] else ''} |")
    return rows


def grad_difference(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Largest absolute difference of two gradient lists (0.0: bitwise equal).

    ``inf`` when one list has a gradient where the other has none.
    """
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None and y is not None and not torch.equal(x, y):
            worst = max(worst, float((x - y).abs().max()))
    return worst


GRAD_RTOL = 1e-5
"""Tolerance for the baselines' gradients: ``torch.testing.assert_close`` with this rtol and
``atol = GRAD_RTOL * max |g|`` per tensor. HF's checkpointing runs the same kernels, but its
recomputed forward may sum in another order (SDPA), so bitwise equality is not promised;
optmem's plans must be bitwise equal (checked with ``torch.equal``)."""


def check_close(got: list[torch.Tensor | None], ref: list[torch.Tensor | None],
                what: str) -> None:
    """Raise ``AssertionError`` unless ``got`` is within :data:`GRAD_RTOL` of ``ref``."""
    for k, (x, y) in enumerate(zip(got, ref, strict=True)):
        if x is None or y is None:
            if x is not y:
                raise AssertionError(f"{what}: gradient {k} is None on one side only")
            continue
        torch.testing.assert_close(x, y, rtol=GRAD_RTOL,
                                   atol=GRAD_RTOL * float(y.abs().max()) + 1e-12,
                                   msg=lambda m, w=what, i=k: f"{w}, gradient {i}: {m}")


def baselines(model: nn.Module, chain: Chain, layers_of: list[int | None], layers: int,
              more: bool) -> list[Setting]:
    """store-all and HF, then (``more``) per-layer and sequential checkpointing."""
    def baseline(method: str, setting: str, enter: Callable[[], Any],
                 ck_layers: list[list[int]]) -> Setting:
        sim = simulate_checkpoint(chain, grouped_plan(layer_groups(layers_of, ck_layers)))
        return Setting(method, setting, enter, int(sim.peak_memory), float(sim.makespan))

    settings = [baseline("store-all", "plain model", partial(store_all, model), []),
                baseline("HF", "gradient_checkpointing_enable",
                         partial(hf_checkpointing, model), [[k] for k in range(layers)])]
    if more:
        for k in (k for k in (2, 3, 4, 6) if k < layers):
            settings.append(baseline("per-layer", f"every {k}", partial(per_layer, model, k),
                                     [[j] for j in range(0, layers, k)]))
        for s in (s for s in (2, 3, 4, 6) if s <= layers):
            settings.append(baseline("sequential", f"{s} segments",
                                     partial(sequential, model, s), torch_segments(layers, s)))
    return settings


def bench_model(spec: Spec, *, rounds: int, grid: int, steps: int, sweep: int,
                repeats: int, more: bool = True,
                memtracker: bool = True, segment_cost: float | None = None,
                per_round: int = 1, log: Callable[[str], None] = print,
                tune: bool = False, paired: int = 0,
                tune_per_memory: bool = False) -> dict[str, Any]:
    """Measure every setting on one model (memory first, then interleaved timing).

    Every round runs every setting ``per_round`` steps in a row and keeps the fastest
    (:func:`timed_steps`). With ``paired`` > 0, the comparisons the targets rest on
    (:func:`paired_comparisons`, on the default series) are then timed in ``paired`` more
    rounds, each pair back to back (:func:`time_pairs`); with ``tune_per_memory`` also the
    series :data:`PER_MEMORY` (:func:`per_memory_series`), whose comparisons are timed in the
    same paired rounds.
    """
    model, batch = build(spec)
    layers = len(layer_list(model))
    log(f"{spec.name}: {layers} layers, hidden {spec.hidden}, batch {spec.batch} x {spec.seq}")
    t0 = time.perf_counter()
    chain = op.profile_chain(model, batch, repeats=repeats)
    top = int(chain.store_all_peak() * 1.02) + 1
    cmodel = op.checkpoint(model, batch, memory_limit=top, chain=chain)
    log(f"  extracted and profiled: {chain.length} stages in {time.perf_counter() - t0:.0f} s")
    settings = baselines(model, chain, stage_layers(cmodel.stage_names), layers, more)
    for st in settings:
        with st.enter() as call:
            st.real_peak = real_peak(call, model, batch)
    plain, hf = settings[0], settings[1]
    log("  real peaks (MiB): " + ", ".join(f"{s.label} {s.real_peak / MiB:.2f}"
                                           for s in settings))

    # the memories to compare at: every baseline's, halfway, and a sweep from HF's up
    targets = {s.label: s.real_peak for s in settings}
    targets["halfway"] = (hf.real_peak + plain.real_peak) // 2
    for k in range(sweep):
        targets[f"sweep {k + 1}/{sweep}"] = hf.real_peak + (
            plain.real_peak - hf.real_peak) * (k + 1) // (sweep + 1)
    series = [run_series("optmem", cmodel, model, batch, targets, grid, steps)]
    if segment_cost is not None:  # the DP with another charge per recomputed segment
        series.append(run_series(f"optmem seg={segment_cost:g}", cmodel, model, batch,
                                 targets, grid, steps, {"segment_cost": segment_cost}))
    if tune:  # measured selection at the default series' limits
        t1 = time.perf_counter()
        series.append(autotune_series(series[0], cmodel, model, batch, targets))
        log(f"  {AUTOTUNE}: {len(series[-1].settings)} limits tuned in "
            f"{time.perf_counter() - t1:.0f} s")
    if tune_per_memory:  # measured selection among each setting's plans per memory
        t1 = time.perf_counter()
        series.append(per_memory_series(series[0], cmodel, model, batch, targets, grid, steps))
        log(f"  {PER_MEMORY}: {len(series[-1].settings)} settings kept in "
            f"{time.perf_counter() - t1:.0f} s")
    for ser in series:
        log(f"  {ser.name}: smallest limit {ser.search.smallest / MiB:.2f} MiB, "
            f"{len(ser.search.by_plan)} plans measured, {len(ser.settings)} kept")
    optmem_settings = [st for ser in series for st in
                       sorted(ser.settings.values(), key=lambda s: s.limit or 0)]

    # gradients: every optmem plan bitwise, every baseline within GRAD_RTOL
    ref = gradients(model, model, batch)
    grad_diff: dict[str, float] = {}
    for st in settings[1:] + optmem_settings:
        with st.enter() as call:
            got = gradients(call, model, batch)
        grad_diff[st.label] = grad_difference(got, ref)
        if st.method.startswith("optmem"):
            if grad_diff[st.label] != 0.0:
                raise AssertionError(f"{spec.name}: {st.label} changed the gradients "
                                     f"(max |diff| {grad_diff[st.label]:.3g})")
        else:
            check_close(got, ref, f"{spec.name}: {st.label}")
    if memtracker:  # torch's own view of the main settings (slow: once each)
        for st in [plain, hf, *optmem_settings]:
            with st.enter() as call:
                st.tracker = tracker_peak(call, model, batch)

    # interleaved timing: a warm-up round, then `rounds` rounds over every setting; the plain
    # model runs twice per round, first and last, as two settings: the bench's noise floor
    again = replace(plain, setting=REPEAT, cpu=[], wall=[], faults=[])
    everything = settings + optmem_settings + [again]
    for r in range(rounds + 1):
        for st in everything:
            with st.enter() as call:
                timing = timed_steps(call, model, batch, per_round)
            if r > 0:
                st.wall.append(timing.wall)
                st.cpu.append(timing.cpu)
                st.faults.append(timing.faults)
    res = {"spec": spec, "layers": layers, "chain": chain, "settings": settings,
           "series": series, "targets": targets, "grad_diff": grad_diff,
           "per_round": per_round, "again": again}
    if paired > 0:
        pairs = paired_comparisons(res, series[0])
        more_pairs = {ser.name: paired_comparisons(res, ser) for ser in series
                      if ser.name == PER_MEMORY}
        every = pairs + [p for ps in more_pairs.values() for p in ps]
        log(f"  paired verdict: {len(every)} comparisons, {paired} rounds")
        time_pairs(every, model, batch, paired, per_round)
        res["paired"] = pairs
        res["paired_series"] = more_pairs
    return res


# ------------------------------------------------------------------ report
def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:.2f}"


def best_baseline(settings: list[Setting], memory: int) -> Setting | None:
    """The fastest baseline whose real peak is at most ``memory``."""
    fits = [s for s in settings if s.real_peak <= memory]
    return min(fits, key=lambda s: s.median) if fits else None


def checks(res: dict[str, Any], ser: Series) -> list[str]:
    """The three targets for one optmem series, one line each."""
    settings: list[Setting] = res["settings"]
    plain, hf = settings[0], settings[1]
    rows = []
    for label, memory in res["targets"].items():
        if hf.real_peak <= memory <= plain.real_peak:
            base = best_baseline(settings, memory)
            assert base is not None  # HF fits under every memory of this range
            rows.append((memory, label, base, ser.at_target(label)))
    missing = [r for r in rows if r[3] is None]
    slower = [r for r in rows if r[3] is not None and r[3].median > r[2].median]
    first = f"1. never slower than the best baseline at equal real memory ({len(rows)} " \
            f"memories from {hf.real_peak / MiB:.2f} to {plain.real_peak / MiB:.2f} MiB): "
    if not missing and not slower:
        first += "**met**"
    else:
        worst = max((r[3].median / r[2].median for r in slower), default=None)
        first += "**not met**: " + "; ".join(filter(None, [
            f"no plan fits under {len(missing)} ({', '.join(r[1] for r in missing)})"
            if missing else "",
            f"slower at {len(slower)} ({', '.join(r[1] for r in slower)}; worst "
            f"{worst:.3f}x)" if slower else ""]))
    lines = [first]
    half = ser.at_target("halfway")
    memory = res["targets"]["halfway"]
    if half is None:
        lines.append(f"2. halfway ({memory / MiB:.2f} MiB), 10 % faster than HF: **not met**, "
                     "no plan fits")
    else:
        gain = 1 - half.median / hf.median
        lines.append(f"2. halfway ({memory / MiB:.2f} MiB), 10 % faster than HF: "
                     f"{half.median:.0f} ms (real {half.real_peak / MiB:.2f} MiB) vs HF "
                     f"{hf.median:.0f} ms, {100 * gain:.1f} % faster: "
                     f"**{'met' if gain >= 0.10 else 'not met'}**")
    at_hf = ser.at_target(hf.label)
    if at_hf is None:
        least = min(ser.search.by_plan.values(), default=0)
        lines.append(f"3. at HF's memory ({hf.real_peak / MiB:.2f} MiB), as fast as HF: "
                     f"**not met**, no plan fits (smallest limit "
                     f"{ser.search.smallest / MiB:.2f} MiB; least real peak of the plans "
                     f"tried {least / MiB:.2f} MiB)")
    else:
        lines.append(f"3. at HF's memory ({hf.real_peak / MiB:.2f} MiB), as fast as HF: "
                     f"{at_hf.median:.0f} ms (real {at_hf.real_peak / MiB:.2f} MiB) vs HF "
                     f"{hf.median:.0f} ms: "
                     f"**{'met' if at_hf.median <= hf.median else 'not met'}**")
    return lines


def noise_floor(res: dict[str, Any]) -> float | None:
    """The ratio (>= 1) of the plain model's two medians in one run, None without the second.

    The same code timed as two settings in the same interleaved rounds (first and last of
    every round): any difference between them is the run's own noise, so a ratio to the
    best baseline within this factor of 1 is below what the run resolves.

    Examples
    --------
    >>> a = Setting("store-all", "plain model", dict, cpu=[100.0, 104.0, 102.0])
    >>> b = Setting("store-all", REPEAT, dict, cpu=[101.0, 103.0, 103.0])
    >>> noise_floor({"settings": [a], "again": b})
    1.0098039215686274
    """
    plain, again = res["settings"][0], res.get("again")
    if again is None or not again.cpu or not plain.cpu:
        return None
    low, high = sorted((plain.median, again.median))
    return high / low


def resolution_line(res: dict[str, Any]) -> str:
    """The noise floor beside the target verdicts (the verdicts do not use it)."""
    floor = noise_floor(res)
    if floor is None:
        return "noise floor: not measured (no second timing of the plain model)"
    plain, again = res["settings"][0], res["again"]
    return (f"noise floor of this run: the plain model timed twice per round (first and "
            f"last setting) gives medians {plain.median:.1f} and {again.median:.1f} ms, "
            f"{floor:.3f}x apart; a ratio to the best baseline within {floor:.3f}x of 1 is "
            "below what this run resolves (the verdicts above stay strict)")


# ------------------------------------------------------------------ paired verdict
NEAR = 1.03
"""A baseline whose median is within this factor of the best one under a memory is paired
with optmem too: the main run's ranking of such near-ties is its noise."""


def median_interval(xs: list[float], confidence: float = 0.95
                    ) -> tuple[float, float, float, float]:
    """The median of ``xs`` and a distribution-free confidence interval for the true median.

    For ``n`` independent samples the order statistics ``[x_(r), x_(n+1-r)]`` cover the true
    median with probability ``1 - 2 P(Bin(n, 1/2) < r)`` whatever the distribution (the sign
    test's interval); ``r`` is the largest rank whose coverage is at least ``confidence``
    (``r = 1``, the whole range, when ``n`` is too small for it). Returns ``(median, low,
    high, coverage)``. Deterministic: no resampling.

    Examples
    --------
    >>> median_interval([float(x) for x in range(1, 16)])  # n = 15: ranks 4 and 12
    (8.0, 4.0, 12.0, 0.96484375)
    >>> median_interval([3.0, 1.0, 2.0])  # too few rounds for 95 %: the range, 75 %
    (2.0, 1.0, 3.0, 0.75)
    """
    if not xs:
        raise ValueError("median_interval needs at least one sample")
    ys, n = sorted(xs), len(xs)
    below, r, coverage = 0.0, 1, 1 - 2 * 0.5 ** n  # P(Bin < 1) = P(Bin = 0)
    for rank in range(2, (n + 1) // 2 + 1):
        below += math.comb(n, rank - 1) * 0.5 ** n
        if 1 - 2 * (below + 0.5 ** n) < confidence:
            break
        r, coverage = rank, 1 - 2 * (below + 0.5 ** n)
    return statistics.median(ys), ys[r - 1], ys[n - r], coverage


@dataclass
class Pair:
    """An optmem setting against one baseline, both timed in every paired round."""

    optmem: Setting
    baseline: Setting
    labels: list[str]  # the target memories (and targets) this comparison decides
    ratios: list[float] = field(default_factory=list)  # optmem / baseline CPU ms, by round

    def verdict(self) -> str:
        """``slower`` / ``faster`` when the whole interval is above / below 1, else ``tie``."""
        _, low, high, _ = median_interval(self.ratios)
        return "slower" if low > 1 else "faster" if high < 1 else "tie"


def paired_comparisons(res: dict[str, Any], ser: Series) -> list[Pair]:
    """The comparisons the three targets rest on, each once.

    Target 1: at every memory from HF's to store-all's, optmem's setting against the best
    baseline under that memory and every baseline within :data:`NEAR` of it; targets 2 and
    3: optmem at halfway and at HF's memory against HF.
    """
    settings: list[Setting] = res["settings"]
    plain, hf = settings[0], settings[1]
    pairs: dict[tuple[int, int], Pair] = {}

    def add(st: Setting | None, base: Setting, label: str) -> None:
        if st is not None:
            pair = pairs.setdefault((id(st), id(base)), Pair(st, base, []))
            pair.labels.append(label)

    for label, memory in sorted(res["targets"].items(), key=lambda kv: kv[1]):
        if hf.real_peak <= memory <= plain.real_peak:
            best = best_baseline(settings, memory)
            assert best is not None  # HF fits under every memory of this range
            for base in settings:
                if base.real_peak <= memory and base.median <= NEAR * best.median:
                    add(ser.at_target(label), base, label)
    add(ser.at_target("halfway"), hf, "target 2")
    add(ser.at_target(hf.label), hf, "target 3")
    return list(pairs.values())


def time_pairs(pairs: list[Pair], model: nn.Module, batch: dict[str, Any], rounds: int,
               per_round: int) -> None:
    """A warm-up round, then ``rounds`` rounds timing every pair's two settings back to back.

    The order within a pair alternates from round to round and from pair to pair, so neither
    side is always first; each side keeps the fastest of ``per_round`` steps
    (:func:`timed_steps`), and the round's ratio is optmem's CPU time over the baseline's.
    Pairing inside a round cancels what drifts between rounds (load, frequency), which the
    medians of the main interleaved run do not.
    """
    for r in range(rounds + 1):
        for i, pair in enumerate(pairs):
            first, second = (pair.optmem, pair.baseline) if (r + i) % 2 == 0 else \
                (pair.baseline, pair.optmem)
            times = {}
            for st in (first, second):
                with st.enter() as call:
                    times[id(st)] = timed_steps(call, model, batch, per_round).cpu
            if r > 0:
                pair.ratios.append(times[id(pair.optmem)] / times[id(pair.baseline)])


def paired_report(res: dict[str, Any], pairs: list[Pair] | None = None) -> list[str]:
    """The paired comparisons' table and the three targets judged on them (Markdown).

    ``pairs``: another series' comparisons (default: the default series', ``res["paired"]``).
    """
    pairs = res.get("paired") or [] if pairs is None else pairs
    if not pairs:
        return []
    n = len(pairs[0].ratios)
    cover = median_interval(pairs[0].ratios)[3]
    out = [f"Paired verdict ({n} rounds after a warm-up; in every round each optmem setting "
           f"and its baseline run back to back, in alternating order; ratio = optmem / "
           f"baseline CPU time of the round; median and its {100 * cover:.1f} % "
           "distribution-free interval; `slower` / `faster` only when the whole interval is "
           "above / below 1):", ""]
    out += _header("optmem setting", "baseline", "at the memory of", "median ratio",
                   "interval", "verdict")
    for p in pairs:
        med, low, high, _ = median_interval(p.ratios)
        out.append(f"| {p.optmem.setting} | {p.baseline.label} | {', '.join(p.labels)} | "
                   f"{med:.3f} | {low:.3f}-{high:.3f} | {p.verdict()} |")
    target1 = [p for p in pairs if any(not x.startswith("target") for x in p.labels)]
    slower = [p for p in target1 if p.verdict() == "slower"]
    worst = max(target1, key=lambda p: median_interval(p.ratios)[0], default=None)
    out += ["", "Targets of issue 13.6 on the paired rounds:", ""]
    line = (f"- 1. never measurably slower than a baseline at equal real memory "
            f"({len(target1)} comparisons): ")
    line += "**met**" if not slower else f"**not met**: slower at {len(slower)} (" + \
        "; ".join(f"{p.optmem.setting} vs {p.baseline.label}" for p in slower) + ")"
    if worst is not None:
        med, low, high, _ = median_interval(worst.ratios)
        line += (f"; largest median ratio {med:.3f} ({low:.3f}-{high:.3f}, "
                 f"{worst.optmem.setting} vs {worst.baseline.label})")
    out.append(line)
    for name, goal in (("target 2", "2. halfway, at least 10 % faster than HF"),
                       ("target 3", "3. at HF's memory, as fast as HF")):
        pair = next((p for p in pairs if name in p.labels), None)
        if pair is None:
            out.append(f"- {goal}: **not met**, no plan fits")
            continue
        med, low, high, _ = median_interval(pair.ratios)
        ok = med <= 0.90 if name == "target 2" else pair.verdict() != "slower"
        speed = f"{100 * (1 - med):.1f} % faster" if med <= 1 else \
            f"{100 * (med - 1):.1f} % slower"
        out.append(f"- {goal}: median ratio {med:.3f} ({speed}; interval {low:.3f}-"
                   f"{high:.3f}): **{'met' if ok else 'not met'}**")
    return out


def _header(*columns: str) -> list[str]:
    """A Markdown table's header and rule."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def within(st: Setting) -> str:
    """``yes``/``NO``: an optmem plan's real peak is within its limit plus the allowance."""
    if st.limit is None or st.allowance is None:
        return "-"
    return "yes" if st.real_peak <= st.limit + st.allowance else "NO"


def summary(res: dict[str, Any]) -> list[str]:
    """store-all, HF and optmem at HF's memory and below it, ratios side by side."""
    settings: list[Setting] = res["settings"]
    plain, hf = settings[0], settings[1]
    rows = _header("setting", "real peak MiB", "MemTracker MiB", "memory / HF", "CPU ms",
                   "time / HF", "time / store-all", "gradients vs plain")

    def row(name: str, st: Setting | None) -> str:
        if st is None:
            return f"| {name} | no plan fits | - | - | - | - | - | - |"
        diff = res["grad_diff"].get(st.label, 0.0)
        grads = "reference" if st is plain else (
            "bitwise equal" if diff == 0.0 else f"max abs diff {diff:.2g}")
        return (f"| {name} | {_mib(st.real_peak)} | {_mib(st.tracker)} | "
                f"{st.real_peak / hf.real_peak:.2f} | {st.median:.0f} | "
                f"{st.median / hf.median:.3f} | {st.median / plain.median:.3f} | {grads} |")

    rows += [row("store-all", plain), row("HF gradient checkpointing", hf)]
    for ser in res["series"]:
        rows.append(row(f"{ser.name}, halfway HF..store-all", ser.at_target("halfway")))
        rows.append(row(f"{ser.name} at HF's memory", ser.at_target(hf.label)))
        smallest = ser.at_target(SMALLEST)
        rows.append(row(f"{ser.name}, {SMALLEST} ({_mib(ser.search.smallest)} MiB)",
                        smallest))
    return rows


def table(res: dict[str, Any]) -> list[str]:
    """Every setting: memory predicted and real, step times."""
    settings: list[Setting] = res["settings"]
    plain, hf = settings[0], settings[1]
    rows = _header("method", "setting", "predicted peak", "real peak", "MemTracker",
                   "real <= limit + allowance", "CPU ms (median)", "IQR", "wall ms",
                   "/ store-all", "/ HF", "predicted ms", "page faults / step")
    again = [res["again"]] if res.get("again") is not None else []
    everything = settings + again + [st for ser in res["series"] for st in
                                     sorted(ser.settings.values(), key=lambda s: s.limit)]
    for st in everything:
        rows.append(f"| {st.method} | {st.setting} | {_mib(st.predicted_peak)} | "
                    f"{_mib(st.real_peak)} | {_mib(st.tracker)} | {within(st)} | "
                    f"{st.median:.0f} | {st.iqr:.0f} | {st.wall_median:.0f} | "
                    f"{st.median / plain.median:.3f} | {st.median / hf.median:.3f} | "
                    f"{st.predicted_ms or 0:.0f} | {st.faults_median:.0f} |")
    return rows


def matched_table(res: dict[str, Any]) -> list[str]:
    """For every target memory: the best baseline and each series' plan under it."""
    settings: list[Setting] = res["settings"]
    series: list[Series] = res["series"]
    head = "| memory of | MiB | best baseline under it | ms |"
    rule = "|---|---|---|---|"
    for ser in series:
        head += f" {ser.name}: limit | real | ms | / best |"
        rule += "---|---|---|---|"
    rows = [head, rule]
    for label, memory in sorted(res["targets"].items(), key=lambda kv: kv[1]):
        base = best_baseline(settings, memory)
        row = f"| {label} | {memory / MiB:.2f} | {base.label if base else '-'} | " \
              f"{f'{base.median:.0f}' if base else '-'} |"
        for ser in series:
            st = ser.at_target(label)
            if st is None:
                row += " - | - | - | - |"
            else:
                ratio = f"{st.median / base.median:.3f}" if base else "-"
                row += f" {_mib(st.limit)} | {_mib(st.real_peak)} | {st.median:.0f} | " \
                       f"{ratio} |"
        rows.append(row)
    return rows


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Step time against real peak, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        groups: dict[str, list[Setting]] = {}
        for st in res["settings"]:
            groups.setdefault(st.method, []).append(st)
        for ser in res["series"]:
            groups[ser.name] = list(ser.settings.values())
        for method, sts in groups.items():
            sts = sorted(sts, key=lambda s: s.real_peak)
            line = "-" if method.startswith("optmem") else "none"
            ax.plot([s.real_peak / MiB for s in sts], [s.median for s in sts], marker="o",
                    linestyle=line, label=method)
        ax.set_title(f"{res['spec'].name}, {res['layers']} layers")
        ax.set_xlabel("real activation peak (MiB, MemTracker)")
        ax.set_ylabel("step CPU time (ms, median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: list[dict[str, Any]], rounds: int, loads: list[str],
           when: str | None = None) -> str:
    """The tables and target checks of every model (Markdown); ``when``: the run's dates."""
    out = ["# HuggingFace models: optmem against HF's gradient checkpointing", "",
           "Produced by `PYTHONPATH=. python benchmarks/bench_hf.py` (see its docstring for "
           "what is measured and how).", "",
           f"torch {torch.__version__}, transformers {_transformers_version()}, CPU, "
           f"`torch.set_num_threads(1)`, medians of {rounds} interleaved rounds "
           f"({_per_round(results)}); {_malloc_note()}; "
           f"load average (1 min) during the run: {', '.join(loads)}"
           + (f"; run {when}." if when else "."), ""]
    for res in results:
        spec = res["spec"]
        out += [f"### {spec.name}: {res['layers']} layers, hidden {spec.hidden}, batch "
                f"{spec.batch} x {spec.seq} tokens, vocabulary {spec.vocab}", "",
                f"optmem chain: {res['chain'].length} stages; cost per recomputed segment "
                f"recorded by the profile (the dp's default `segment_cost`): "
                f"{_segment_cost(res['chain'])}; {op_charge(res['chain'])}.", ""]
        out += summary(res) + ["", "Every setting (MiB; predicted: the chain model's "
                                   "simulation of the setting's plan):", ""]
        out += table(res) + ["", "At equal real memory (CPU ms):", ""] + matched_table(res)
        for ser in res["series"]:
            out += ["", f"Targets of issue 13.6, {ser.name}:", ""]
            out += [f"- {x}" for x in checks(res, ser)] + [f"- {resolution_line(res)}"]
            if ser is res["series"][0] and res.get("paired"):
                out += [""] + paired_report(res)
            if ser.name in (res.get("paired_series") or {}):
                out += [""] + paired_report(res, res["paired_series"][ser.name])
            if ser.name == AUTOTUNE:
                out += ["", "What autotune timed at each limit (wall-clock ms on the batch, "
                        "while tuning; `model ms`: makespan + segment charges):", ""]
                out += autotune_table(ser)
            if ser.name == PER_MEMORY:
                out += ["", "What autotune timed for each memory (each candidate at its own "
                        "setting's limit; wall-clock ms on the batch, while tuning; `model "
                        "ms`: makespan + segment charges on the profiled chain):", ""]
                out += autotune_table(ser)
        out.append("")
    return "\n".join(out)


def _segment_cost(chain: Chain) -> str:
    profile = (chain.extra or {}).get("profile") or {}
    measured = profile.get("segment_cost") or {}
    if not measured:
        ms = float(profile.get("segment_cost_ms") or 0.0)
        return f"{ms:.3f} ms ({profile.get('segment_cost_source') or 'none'})"
    samples = ", ".join(f"{x:.2f}" for x in measured["samples"])
    return (f"{measured['ms']:.3f} ms ({measured['groups']} segments against 1 over "
            f"{measured['reforwards']} re-forwarded stages; per-round samples {samples})")


def op_charge(chain: Chain) -> str:
    """The profile's charge per ``F`` op (``op_overhead_ms + op_overhead_ratio * t``).

    Examples
    --------
    >>> c = Chain.from_lists([1.0], [1.0], [4], [4], input_size=4)
    >>> op_charge(replace(c, extra={"profile": {"op_overhead_ms": 0.05,
    ...                                         "op_overhead_ratio": 0.2}}))
    'charge per F op beyond its kernels t: 0.050 ms + 0.200 x t'
    """
    profile = (chain.extra or {}).get("profile") or {}
    return (f"charge per F op beyond its kernels t: "
            f"{float(profile.get('op_overhead_ms') or 0.0):.3f} ms + "
            f"{float(profile.get('op_overhead_ratio') or 0.0):.3f} x t")


def _per_round(results: list[dict[str, Any]]) -> str:
    k = max((res.get("per_round", 1) for res in results), default=1)
    return "one step per setting and round" if k == 1 else \
        f"per setting and round the fastest of {k} steps in a row"


def _malloc_note() -> str:
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return "glibc malloc with " + ", ".join(f"`{k}={v}`" for k, v in MALLOC_ENV.items())
    return "glibc malloc's default settings"


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark (see the module docstring); returns the measured results."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small GPT-2 only, 3 rounds")
    ap.add_argument("--models", default=None, help="comma-separated subset: gpt2,llama,bert")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (9; quick 3)")
    ap.add_argument("--hf-only", action="store_true",
                    help="baselines store-all and HF only (no per-layer, no sequential)")
    ap.add_argument("--no-memtracker", action="store_true",
                    help="skip MemTracker's second view of the peaks (slow on big models)")
    ap.add_argument("--segment-cost", type=float, default=None, metavar="MS",
                    help="also run optmem's dp with extra segment_cost=MS per recomputed "
                         "segment instead of the measured one (series 'optmem seg=MS'; 0: "
                         "rotor's model, the default before the measured cost)")
    ap.add_argument("--autotune", action="store_true",
                    help=f"also run optmem with measured plan selection (series "
                         f"'{AUTOTUNE}': op.checkpoint's autotune at every limit of the "
                         "default series)")
    ap.add_argument("--autotune-per-memory", action="store_true",
                    help=f"also run series '{PER_MEMORY}': for every target memory, each "
                         "autotune setting's plan at its own largest limit that fits the "
                         "memory, timed, the fastest kept (its comparisons join --paired)")
    ap.add_argument("--steps-per-round", type=int, default=None, metavar="K",
                    help="steps in a row per setting and round, the fastest kept (3; quick 1)")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="then time the comparisons the targets rest on in N paired rounds "
                         "(each optmem setting and its baseline back to back; 0: off; 15 "
                         "gives a 96.5 %% interval for each median ratio)")
    ap.add_argument("--no-malloc-env", action="store_true",
                    help="keep glibc malloc's defaults (no restart with MALLOC_ENV)")
    ap.add_argument("--markdown", help="write the tables to this file")
    ap.add_argument("--plot", help="write the time/memory plot (PNG) to this file")
    args = ap.parse_args(argv)
    if argv is None and not args.no_malloc_env:  # run as a script: glibc reads it at start
        reexec_with_malloc_env(sys.argv[1:])
    torch.set_num_threads(1)
    specs = list(QUICK if args.quick else FULL)
    if args.models:
        wanted = args.models.split(",")
        specs = [s for s in specs if s.name in wanted]
    rounds = args.rounds or (3 if args.quick else 9)
    options: dict[str, Any] = dict(grid=6, steps=2, sweep=1, repeats=1) if args.quick else \
        dict(grid=8, steps=6, sweep=1, repeats=3)
    loads = [_load()]
    started = _now()
    results = []
    for spec in specs:
        results.append(bench_model(spec, rounds=rounds,
                                   more=not args.hf_only, memtracker=not args.no_memtracker,
                                   segment_cost=args.segment_cost, tune=args.autotune,
                                   paired=args.paired,
                                   tune_per_memory=args.autotune_per_memory,
                                   per_round=args.steps_per_round or (1 if args.quick else 3),
                                   **options))
        loads.append(_load())
    text = report(results, rounds, loads, f"{started} to {_now()}")
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return results


if __name__ == "__main__":
    main()
