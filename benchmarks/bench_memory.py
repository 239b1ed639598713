"""Predicted against real activation peaks of checkpoint plans (issue 13, item 4).

For every bundled zoo model (small batches and resolutions, so that it runs on a CPU) and for
HuggingFace ``transformers`` models built from small configs (random initialisation, nothing
downloaded), the chain is profiled with the loss (``op.profile_chain(..., loss_fn=...)``,
so that the limit covers the loss too), then at three limits (the smallest feasible one,
the midpoint, and store-all) one training step runs through ``op.checkpoint(..., chain=)``:

* **predicted**: the plan replayed by optmem's simulator on the byte chain
  (``cmodel.expected_peak_bytes``);
* **real**: the exact activation peak of the step
  (:func:`optmem.pytorch.memory.measure_training_peak`: every storage created during the
  step, weight gradients excluded, plus the input batch);
* **MemTracker**: torch's ``torch.distributed._tools.mem_tracker.MemTracker`` on the same
  step, run separately (peak snapshot minus parameters, buffers, gradients and optimizer
  state; see :func:`optmem.pytorch.memory.memtracker_peak` for why it differs);
* **allowance**: what the docs say the limit does not count and a step holds
  (:func:`optmem.pytorch.memory.plan_allowance`); the check is
  ``real <= limit + allowance``;
* **CUDA**: with ``--device cuda``, ``torch.cuda.max_memory_allocated`` as activation bytes
  (:func:`optmem.pytorch.memory.cuda_training_peak`); skipped without a GPU.

Plain PyTorch (no wrapper) is measured the same way beside the store-all prediction. The
``same plan`` column profiles the model a second time and compares the plans at the
midpoint limit (profiles are deterministic in bytes; times are pooled over identical stages
and rounded, see ``docs/pytorch.md``).

HuggingFace models go through the public one-liner (``op.profile_chain(model, ...)``); until
its ``torch.export`` extraction lands, the row says why extraction failed. GPT-2 also runs
from a hand-written list of stages (embeddings, one stage per block, ``ln_f`` + head).

Usage::

    PYTHONPATH=. python benchmarks/bench_memory.py            # everything, writes the results
    PYTHONPATH=. python benchmarks/bench_memory.py --quick    # three small models, no file
    PYTHONPATH=. python benchmarks/bench_memory.py --models resnet18,hf-gpt2-stages
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.extract import Stage  # noqa: E402
from optmem.pytorch.memory import (  # noqa: E402
    cuda_training_peak,
    measure_training_peak,
    memtracker_peak,
    plan_allowance,
)
from optmem.pytorch.zoo import ZOO  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402

MIB = 2**20
RESULTS = ROOT / "benchmarks" / "results" / "memory.md"
RAW = RESULTS.with_suffix(".json")

# zoo name -> (batch, resolution or sequence length): small enough for a CPU
ZOO_SMALL: dict[str, tuple[int, int]] = {
    "resnet18": (2, 64), "resnet34": (2, 64), "resnet50": (2, 64), "resnet101": (1, 64),
    "resnet152": (1, 64), "resnet200": (1, 64), "resnet1001": (1, 32),
    "resnet1001-w64": (1, 32), "densenet121": (2, 64), "densenet169": (2, 64),
    "vgg16": (2, 32), "vgg19": (2, 32), "inception3": (2, 75), "unet": (1, 64),
    "gpt2-small": (1, 64), "gpt2-medium": (1, 32), "gpt2-large": (1, 32), "vit-b16": (2, 32),
}
QUICK = ["resnet18", "vit-b16", "hf-gpt2-stages"]
HF_VOCAB, HF_BATCH, HF_TOKENS = 4096, 2, 64


@dataclass
class Case:
    """One model: what to profile and wrap, its sample, loss, and plain training step."""

    name: str
    config: str
    module: Any  # nn.Module or a list of stages
    sample: Any
    loss_fn: Callable[[Any], torch.Tensor]
    owner: nn.Module  # holds every parameter
    plain: Callable[[], torch.Tensor]  # plain PyTorch forward (returns the loss)


# ------------------------------------------------------------------ models
def zoo_case(name: str, device: str) -> Case:
    """A bundled zoo model at its small setting."""
    entry = ZOO[name]
    batch, size = ZOO_SMALL[name]
    with torch.device(device):
        net = entry.build(size).train()
        x = entry.sample(batch, size, device=None)
    loss_fn = entry.loss_fn()
    return Case(name, f"zoo, batch {batch}, {'length' if entry.input == 'tokens' else 'px'} "
                      f"{size}", net, x, loss_fn, net, lambda: loss_fn(net(x)))


def logits(out: Any) -> torch.Tensor:
    """The logits of a model output (``ModelOutput``, tuple or tensor)."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, tuple | list):
        return out[0]
    return out


def cross_entropy(out: Any) -> torch.Tensor:
    """Cross-entropy of the logits against class 0 (language models: every token)."""
    y = logits(out)
    flat = y.reshape(-1, y.shape[-1])
    return nn.functional.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long,
                                                         device=flat.device))


def hf_model(kind: str) -> tuple[nn.Module, torch.Tensor, str]:
    """A small ``transformers`` model (random init) and a sample batch."""
    import transformers as tf

    torch.manual_seed(0)
    ids = torch.randint(0, HF_VOCAB, (HF_BATCH, HF_TOKENS))
    images = torch.randn(HF_BATCH, 3, 32, 32)
    text = dict(vocab_size=HF_VOCAB, hidden_size=128, num_hidden_layers=6,
                num_attention_heads=4, max_position_embeddings=128)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=HF_VOCAB, n_embd=128, n_layer=6, n_head=4,
                            n_positions=128)
        return tf.GPT2LMHeadModel(cfg), ids, "6 layers, width 128, vocab 4096"
    if kind == "llama":
        cfg = tf.LlamaConfig(intermediate_size=352, num_key_value_heads=2, **text)
        return tf.LlamaForCausalLM(cfg), ids, "6 layers, width 128, GQA 4/2, vocab 4096"
    if kind == "bert":
        cfg = tf.BertConfig(intermediate_size=512, **text)
        return tf.BertForMaskedLM(cfg), ids, "6 layers, width 128, vocab 4096"
    if kind == "vit":
        cfg = tf.ViTConfig(image_size=32, patch_size=4, hidden_size=128, num_hidden_layers=6,
                           num_attention_heads=4, intermediate_size=512, num_labels=10)
        return tf.ViTForImageClassification(cfg), images, "6 layers, width 128, 32 px"
    if kind == "resnet":
        cfg = tf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                              depths=[2, 2, 2, 2], layer_type="basic", num_labels=10)
        return tf.ResNetForImageClassification(cfg), torch.randn(HF_BATCH, 3, 64, 64), \
            "basic blocks [2, 2, 2, 2], widths 32-256, 64 px"
    raise ValueError(kind)


def hf_case(kind: str, device: str) -> Case:
    """A ``transformers`` model through the public one-liner's extraction."""
    model, sample, config = hf_model(kind)
    model = model.to(device).train()
    sample = sample.to(device)

    def plain() -> torch.Tensor:
        return cross_entropy(model(sample))

    return Case(f"hf-{kind}", f"transformers, {config}, batch {HF_BATCH}", model, sample,
                cross_entropy, model, plain)


class GPT2Embeddings(nn.Module):
    """Token + position embeddings and dropout of a ``transformers`` GPT-2."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos))


class GPT2Head(nn.Module):
    """Final layer norm and (tied) language-model head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.lm_head(self.ln_f(h))


def gpt2_stages_case(device: str) -> Case:
    """``transformers`` GPT-2 as a hand-written list of stages (logits bitwise equal)."""
    model, ids, config = hf_model("gpt2")
    model = model.to(device).train()
    ids = ids.to(device)
    tr = model.transformer
    stages = [Stage("embeddings", GPT2Embeddings(tr)),
              *[Stage(f"h.{i}", block) for i, block in enumerate(tr.h)],
              Stage("ln_f+lm_head", GPT2Head(model))]
    return Case("hf-gpt2-stages", f"transformers, {config}, batch {HF_BATCH}, "
                f"hand-written stages", stages, ids, cross_entropy, model,
                lambda: cross_entropy(model(ids, use_cache=False)))


def make_case(name: str, device: str) -> Case:
    if name == "hf-gpt2-stages":
        return gpt2_stages_case(device)
    if name.startswith("hf-"):
        return hf_case(name[3:], device)
    return zoo_case(name, device)


ALL = [*ZOO_SMALL, "hf-gpt2-stages", "hf-gpt2", "hf-llama", "hf-bert", "hf-vit", "hf-resnet"]


# ------------------------------------------------------------------ measuring
@dataclass
class Row:
    """One (model, limit) measurement, in bytes."""

    label: str
    limit: int
    predicted: int
    real: int
    memtracker: int | None
    allowance: int
    cuda: int | None


@dataclass
class Report:
    """Everything measured for one model (stored in ``memory.json``)."""

    name: str
    config: str
    stages: int = 0
    params: int = 0
    store_predicted: int = 0
    plain_real: int = 0
    plain_memtracker: int | None = None
    same_plan: bool | None = None
    plan_gap: float = 0.0  # the second profile's plan on the first chain: slower by this
    profile_s: float = 0.0
    rows: list[Row] | None = None
    error: str = ""
    measured: str = ""  # date, device and machine load of the run

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        rows = data.get("rows")
        return cls(**{**data, "rows": None if rows is None else [Row(**r) for r in rows]})


MEMTRACKER_MAX_MODULES = 1000
"""MemTracker's cost grows with ops x modules (a ResNet-1001 step: 20 s traced, 550 s)."""


def measure_step(case: Case, forward: Callable[[], torch.Tensor],
                 device: str) -> tuple[int, int | None, int | None]:
    """Real (trace), MemTracker and CUDA activation peaks of one training step."""
    def step() -> None:
        forward().backward()

    case.owner.zero_grad(set_to_none=True)
    real = measure_training_peak(step, case.owner, case.sample)
    mt = None
    if sum(1 for _ in case.owner.modules()) <= MEMTRACKER_MAX_MODULES:
        case.owner.zero_grad(set_to_none=True)
        mt = memtracker_peak(step, case.owner, case.sample).activations
    cuda = None
    if device == "cuda":
        case.owner.zero_grad(set_to_none=True)
        step()  # one-time allocations (cuBLAS workspace, ...) before the measured step
        cuda = cuda_training_peak(step, case.owner, case.sample)
    case.owner.zero_grad(set_to_none=True)
    return real, mt, cuda


def feasible(chain: Any, limit: int) -> int:
    """``limit``, or the next limit the DP accepts: rounding sizes up to the unit
    (``limit // 500``) can make a limit just above the smallest feasible one infeasible."""
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.solvers.facade import solve

    step = max(1, limit // 500)
    for k in range(4 * chain.length + 8):
        if solve(CheckpointProblem(chain, limit + k * step), "dp").status.has_plan:
            return limit + k * step
    raise RuntimeError(f"no plan near {limit} B")


def run_case(name: str, device: str, repeats: int) -> Report:
    torch.manual_seed(0)
    case = make_case(name, device)
    report = Report(name, case.config,
                    measured=f"{datetime.date.today()}, {device}, load {load()}")
    report.params = sum(p.numel() for p in case.owner.parameters())
    try:
        t0 = time.perf_counter()
        chain = op.profile_chain(case.module, case.sample, loss_fn=case.loss_fn,
                                 repeats=repeats, name=name)
        report.profile_s = time.perf_counter() - t0
    except Exception as exc:  # extraction of HF models lands with the torch.export path
        report.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
        return report
    report.stages = chain.length
    report.store_predicted = chain.store_all_peak()
    real, mt, _ = measure_step(case, case.plain, device)
    report.plain_real, report.plain_memtracker = real, mt
    low = op.smallest_limit(chain)
    store = chain.store_all_peak()
    rows = []
    mid_plan = None
    for label, limit in (("smallest", low), ("midpoint", feasible(chain, (low + store) // 2)),
                         ("store-all", feasible(chain, store))):
        cmodel = op.checkpoint(case.module, case.sample, memory_limit=limit, chain=chain)
        predicted = cmodel.expected_peak_bytes
        real, mt, cuda = measure_step(case, lambda c=cmodel: case.loss_fn(c(case.sample)),
                                      device)
        allowance = plan_allowance(chain, cmodel.result.plan, list(cmodel.stages))
        rows.append(Row(label, limit, predicted, real, mt, allowance, cuda))
        if label == "midpoint":
            mid_plan = cmodel.result.plan
        del cmodel
        gc.collect()
    again = op.profile_chain(case.module, case.sample, loss_fn=case.loss_fn, repeats=repeats,
                             name=name)
    sizes_equal = all(getattr(again, f) == getattr(chain, f) for f in (
        "output_size", "saved_size", "fwd_overhead", "bwd_overhead", "input_size",
        "loss_bwd_overhead"))
    plan2 = op.solve_chain(again, rows[1].limit).plan
    report.same_plan = sizes_equal and tuple(plan2) == tuple(mid_plan)
    report.plan_gap = simulate_checkpoint(chain, plan2).makespan \
        / simulate_checkpoint(chain, mid_plan).makespan - 1
    report.rows = rows
    return report


# ------------------------------------------------------------------ output
def mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MIB:.2f}"


def md_row(*cells: object) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(reports: list[Report], device: str) -> list[str]:
    lines = [md_row("model", "limit", "limit MiB", "predicted", "real", "MemTracker",
                    "real / predicted", "allowance", "real <= limit + allowance", "CUDA"),
             "|---|---|---:|---:|---:|---:|---:|---:|:---:|---:|"]
    for rep in reports:
        for row in rep.rows or []:
            ok = "yes" if row.real <= row.limit + row.allowance else "**NO**"
            lines.append(md_row(
                rep.name, row.label, mib(row.limit), mib(row.predicted), mib(row.real),
                mib(row.memtracker) if row.memtracker is not None else "skipped",
                f"{row.real / row.predicted:.3f}",
                f"{row.allowance / 1024:.1f} KiB", ok,
                mib(row.cuda) if device == "cuda" else "no GPU"))
    return lines


def models_table(reports: list[Report]) -> list[str]:
    lines = [md_row("model", "setting", "parameters", "stages", "store-all predicted",
                    "plain real", "plain MemTracker", "same plan twice", "profile s"),
             "|---|---|---:|---:|---:|---:|---:|:---:|---:|"]
    for rep in reports:
        head = (rep.name, rep.config, f"{rep.params / 1e6:.2f} M")
        if rep.rows is None:
            lines.append(md_row(*head, "-", "-", "-", "-", "-",
                                f"extraction failed: `{rep.error}`"))
        else:
            lines.append(md_row(*head, rep.stages, mib(rep.store_predicted),
                                mib(rep.plain_real),
                                mib(rep.plain_memtracker) if rep.plain_memtracker is not None
                                else "skipped",
                                "yes" if rep.same_plan else
                                f"no (+{100 * rep.plan_gap:.2f} %)", f"{rep.profile_s:.1f}"))
    return lines


def summary(reports: list[Report]) -> list[str]:
    rows = [(rep, r) for rep in reports if rep.rows for r in rep.rows]
    if not rows:
        return []
    within = sum(r.real <= r.limit + r.allowance for _, r in rows)
    under = sum(r.real <= r.predicted for _, r in rows)
    worst = max(rows, key=lambda p: p[1].real / p[1].predicted)
    best = min(rows, key=lambda p: p[1].real / p[1].predicted)
    same = sum(bool(rep.same_plan) for rep in reports if rep.rows)
    tracked = [r for _, r in rows if r.memtracker is not None]
    mt_over = sum(r.memtracker > r.real for r in tracked)
    return [
        f"* **{within} of {len(rows)}** steps stay within `limit + allowance` (real, exact "
        f"trace); {under} of {len(rows)} are at or below the predicted peak itself.",
        f"* real / predicted ranges from {best[1].real / best[1].predicted:.3f} "
        f"({best[0].name}, {best[1].label}) to {worst[1].real / worst[1].predicted:.3f} "
        f"({worst[0].name}, {worst[1].label}).",
        f"* A second profile gave the same plan at the midpoint limit for **{same} of "
        f"{sum(1 for rep in reports if rep.rows)}** models (sizes identical in every case); "
        "the others are near-ties: the second plan is at most "
        f"{100 * max((rep.plan_gap for rep in reports if rep.rows), default=0):.2f} % "
        "slower on the first chain.",
        f"* MemTracker reads more than the exact trace in {mt_over} of {len(tracked)} steps "
        f"(skipped on models of more than {MEMTRACKER_MAX_MODULES} modules, where one step "
        "takes minutes): "
        "its module tracker's gradient hooks keep input gradients alive in the executor's "
        "nested backward calls, and a new weight gradient counts as `Temp` until autograd's "
        "hook relabels it; it reads less where the total peaked after activations had "
        "started to shrink (`memtracker_peak`).",
    ]


# ------------------------------------------------------------------ stability
STABILITY = ["resnet18", "vit-b16", "gpt2-small", "densenet121", "hf-gpt2-stages"]
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)


def stability(name: str, runs: int, repeats: int) -> tuple[list[str], Case]:
    """Profile ``name`` ``runs`` times; distinct plans at several limits, with and without
    the pooling of identical stages, and the spread of the measured times."""
    import statistics

    import optmem.pytorch.profile as prof
    from optmem.chain import Chain
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.solvers.facade import solve

    torch.manual_seed(0)
    case = make_case(name, "cpu")
    chains = [op.profile_chain(case.module, case.sample, repeats=repeats, time_resolution=0,
                               name=name) for _ in range(runs)]
    raw = [op.profile_chain(case.module, case.sample, repeats=repeats, time_resolution=0,
                            name=name, pool_identical=False) for _ in range(runs)]
    spread = statistics.median(
        abs(c.fwd_time[i] / statistics.median(d.fwd_time[i] for d in raw) - 1)
        for c in raw for i in range(c.length))
    low, store = op.smallest_limit(chains[0]), chains[0].store_all_peak()
    cells = []
    for label, group, res in (("unpooled", raw, 0.0), ("pooled", chains, 0.0),
                              ("pooled, 1/64", chains, 1 / 64), ("pooled, 1/4", chains, 0.25)):
        counts, gap = [], 0.0
        for frac in FRACTIONS:
            limit = feasible(chains[0], int(low + frac * (store - low)))
            found: list[tuple[Chain, Any]] = []
            for c in group:
                d = c.to_dict()
                for st in d["stages"]:
                    st["fwd_time"] = prof.round_time(st["fwd_time"], res)
                    st["bwd_time"] = prof.round_time(st["bwd_time"], res)
                r = solve(CheckpointProblem(Chain.from_dict(d), limit), "dp")
                found.append((c, r.plan if r.status.has_plan else None))
            plans = {p for _, p in found}
            counts.append(str(len(plans)))
            for c, own in found:  # every profile's plan, timed on every profile's chain
                for other in (plans - {own, None}) if own is not None else ():
                    gap = max(gap, simulate_checkpoint(c, other).makespan
                              / simulate_checkpoint(c, own).makespan - 1)
        cells.append(f"{label}: {' '.join(counts)} (<= {100 * gap:.2f} %)")
    classes = len(set(zip(chains[0].fwd_time, chains[0].bwd_time, strict=True)))
    return [md_row(name, chains[0].length, classes, f"{100 * spread:.1f} %", *cells)], case


def write_stability(names: list[str], runs: int, repeats: int) -> None:
    start, t0 = load(), time.perf_counter()
    rows = []
    for name in names:
        lines, _ = stability(name, runs, repeats)
        rows += lines
        print(lines[0], flush=True)
    out = RESULTS.with_name("memory_stability.md")
    out.write_text("\n".join([
        "# Do two profiles give the same plan?",
        "",
        f"Produced by `PYTHONPATH=. python benchmarks/bench_memory.py --stability {runs}` "
        f"({datetime.date.today()}, CPU, torch {torch.__version__}, one thread, {repeats} "
        f"timed rounds per profile, {(time.perf_counter() - t0) / 60:.0f} min). Machine: "
        f"2 cores shared with other jobs, load average {start} at the start and {load()} at "
        "the end: a hostile setting on purpose.",
        "",
        f"Each model is profiled {runs} times with pooling of identical stages (the default) "
        f"and {runs} times without; each cell gives the number of distinct DP plans among "
        f"the {runs} profiles at limits {', '.join(f'{int(100 * f)} %' for f in FRACTIONS)} "
        "of the way from the smallest feasible limit to store-all (1 everywhere = perfectly "
        "stable), with times as measured (rounded to `2**-16` ms), or rounded to a relative "
        "resolution of 1/64 (the default) or 1/4. `spread`: median relative deviation of a "
        "stage's unpooled forward time from its median over the profiles. `classes`: "
        "distinct (forward, backward) times in a pooled profile. In brackets: the largest "
        "gap, over the profiles, between the predicted step time of a profile's own optimal "
        "plan and that of another profile's plan, both timed on the former profile's chain "
        "(what choosing the other plan would cost).",
        "",
        "| model | stages | classes | spread | distinct plans | | | |",
        "|---|---:|---:|---:|---|---|---|---|",
        *rows,
        "",
    ]))
    print(f"wrote {out}")


def load() -> str:
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def store(reports: list[Report]) -> list[Report]:
    """Merge ``reports`` into ``memory.json`` (raw data); return every stored report."""
    data = json.loads(RAW.read_text()) if RAW.exists() else {}
    for rep in reports:
        data[rep.name] = asdict(rep)
    order = {n: k for k, n in enumerate(ALL)}
    data = dict(sorted(data.items(), key=lambda kv: order.get(kv[0], len(order))))
    RAW.write_text(json.dumps(data, indent=1) + "\n")
    return [Report.from_dict(v) for v in data.values()]


def write(reports: list[Report], device: str) -> None:
    dates = sorted({rep.measured.split(",")[0] for rep in reports if rep.measured})
    loads = [float(rep.measured.split("load ")[1].split()[0]) for rep in reports
             if "load " in rep.measured]
    span = f"{min(loads):.0f} to {max(loads):.0f}" if loads else "unknown"
    lines = [
        "# Predicted against real activation peaks of checkpoint plans",
        "",
        f"Produced by `PYTHONPATH=. python benchmarks/bench_memory.py` ({device.upper()}, "
        f"torch {torch.__version__}, `torch.set_num_threads(1)`; raw data in "
        f"`memory.json`), {', '.join(dates)}. Machine: 2 cores shared with other jobs, "
        f"1-minute load average {span} at the start of the models. Sizes and "
        "peaks are bytes counted exactly (no timing is involved in them); profile times "
        "are wall-clock and only indicative.",
        "",
        "How to read it. Each model is profiled with its loss (`op.profile_chain(..., "
        "loss_fn=...)`), then trained for one step through `op.checkpoint(..., chain=chain)` "
        "at three limits: the smallest feasible one (`op.smallest_limit`), the midpoint "
        "between it and store-all, and store-all. **predicted** is the plan replayed by the "
        "simulator on the byte chain (`cmodel.expected_peak_bytes`); **real** is the exact "
        "activation peak of the step (`optmem.pytorch.memory.measure_training_peak`: every "
        "storage created during the step, weight gradients excluded, plus the input batch); "
        "**MemTracker** is torch's `MemTracker` on the same step run again (peak snapshot "
        "minus parameters, buffers, gradients and optimizer state); **allowance** is what "
        "`docs/pytorch.md` (\"What memory_limit counts\") says a step holds beyond the "
        "chain model (`plan_allowance`: the gradient autograd holds at the plan's boundary, "
        "the loss scalars, buffer copies of re-run stages). **CUDA** is "
        "`torch.cuda.max_memory_allocated` as activation bytes (`--device cuda`; this "
        "machine has no GPU, so the column is empty). MiB throughout.",
        "",
        "## Findings",
        "",
        *summary(reports),
        "",
        "## Steps",
        "",
        *table(reports, device),
        "",
        "## Models",
        "",
        "`plain` is the unwrapped model (plain autograd, no plan) measured the same way; "
        "`store-all predicted` is the chain model's figure for it. `same plan twice`: a "
        "second profile gave identical sizes and the same plan at the midpoint limit; "
        "where it did not, the percentage is how much slower the second profile's plan is "
        "on the first profile's chain (a near-tie: within the timing noise).",
        "",
        *models_table(reports),
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--models", help=f"comma-separated, from: {', '.join(ALL)}")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5, help="timed profiling rounds")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--stability", type=int, metavar="N",
                        help="instead: profile each model N times and count distinct plans "
                             f"(default models: {', '.join(STABILITY)})")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (none here)")
    torch.set_num_threads(1)
    if args.stability:
        write_stability(args.models.split(",") if args.models else STABILITY, args.stability,
                        args.repeats)
        return 0
    names = QUICK if args.quick else (args.models.split(",") if args.models else ALL)
    reports = []
    for name in names:
        t = time.perf_counter()
        rep = run_case(name, args.device, args.repeats)
        reports.append(rep)
        status = rep.error or ", ".join(
            f"{r.label} {mib(r.predicted)}/{mib(r.real)}" for r in rep.rows or [])
        print(f"{name}: {status} ({time.perf_counter() - t:.0f} s)", flush=True)
        if not (args.quick or args.no_write):
            write(store([rep]), args.device)  # after every model: a long run keeps its data
        gc.collect()
    for line in summary(reports):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
