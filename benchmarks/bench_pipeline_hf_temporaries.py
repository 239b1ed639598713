"""Planned against measured per-rank peaks of ``op.pipeline`` on tiny HuggingFace models.

    python benchmarks/bench_pipeline_hf_temporaries.py [gpt2,llama] [--loss-fn]
        [--layers 2] [--hidden 64] [--seq 64]

``GPT2LMHeadModel`` and ``LlamaForCausalLM`` from configs (random init, 2 layers, hidden 64,
vocabulary 128, sequences of 64, micro-batches of 8 rows = 128 KiB per activation, 4 per
step, the model's own loss with ``labels=``; ``--loss-fn``: a cross-entropy ``loss_fn`` on the
logits instead, which runs outside the chain, unprofiled), planned by ``op.pipeline(...,
memory_model="strict", temporaries=True, weight_copies=0)`` on 2 gloo processes (one thread
each) with fixed times (a stage with weights 1 forward / 2 backward, one without 0.25 / 0.5)
so that the plans do not depend on the machine's load, contiguous and MadPipe. Each plan is
replayed under the ``stash``, ``strict`` and ``strict`` + ``temporaries=True`` models
(*planned*, the simulator's per-GPU peak) and run on PyTorch's runtime (exported models run
on the runtime only, not on ``run_plan``); *measured* is ``measure_training_peak`` of the
rank's **second** step. Results: ``benchmarks/results/pipeline_runtime.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, ROWS, MB = 128, 8, 4


def build(name: str, layers: int, hidden: int, seq: int) -> nn.Module:
    """A tiny HuggingFace model, seeded, no dropout."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=2, vocab_size=VOCAB, n_positions=seq,
            use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=seq,
        use_cache=False))


def data(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randint(0, VOCAB, (ROWS * MB, seq), generator=gen),
            torch.randint(0, VOCAB, (ROWS * MB, seq), generator=gen))


def time_model(module: nn.Module, _x: Any, _y: Any) -> tuple[float, float]:
    return (1.0, 2.0) if any(True for _ in module.parameters()) else (0.25, 0.5)


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def worker(rank: int, world: int, jobs: list[tuple[str, str]], use_loss_fn: bool,
           size: tuple[int, int, int], out: str) -> None:
    import optmem.pytorch as op
    from optmem.problems.pipeline import PipelineProblem
    from optmem.pytorch.memory import measure_training_peak
    from optmem.simulate.pipeline import simulate_pipeline

    del world
    torch.set_num_threads(1)
    rows = []
    for name, method in jobs:
        model = build(name, *size)
        x, y = data(size[2])
        sample = x[:ROWS] if use_loss_fn else {"input_ids": x[:ROWS], "labels": y[:ROWS]}
        piped = op.pipeline(model, sample, gpus=2, memory_per_gpu="1GiB", method=method,
                            microbatches=MB, time_model=time_model, repeats=1, warmup=0,
                            memory_model="strict", temporaries=True, weight_copies=0,
                            loss_fn=lm_loss if use_loss_fn else None)

        def step(piped: Any = piped, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            if use_loss_fn:
                piped.step(x, target=y)
            else:
                piped.step(input_ids=x, labels=y)

        model.zero_grad(set_to_none=True)
        dist.barrier()
        step()  # the first step builds the runtime's communicators and buffers
        model.zero_grad(set_to_none=True)
        dist.barrier()
        measured = measure_training_peak(step, model)
        base = PipelineProblem(piped.chain, 2, 2**34, weight_copies=0)
        models = {"stash": base, "strict": replace(base, memory_model="strict"),
                  "temp": replace(base, memory_model="strict", temporaries=True)}
        planned = {k: simulate_pipeline(p, piped.plan).peaks[rank] for k, p in models.items()}
        rows.append((name, f"{method} ({piped.plan.describe()})", rank, planned, measured))
        dist.barrier()
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    from optmem.pytorch.distributed import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default="gpt2,llama")
    ap.add_argument("--loss-fn", action="store_true",
                    help="a cross-entropy loss_fn on the logits instead of labels=")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    jobs = [(name, method) for name in args.models.split(",")
            for method in ("contiguous", "madpipe")]
    out = tempfile.mkdtemp()
    spawn(worker, 2, jobs, args.loss_fn, (args.layers, args.hidden, args.seq), out,
          init_file=os.path.join(out, "rendezvous"))
    rows = sorted(r for k in range(2) for r in torch.load(os.path.join(out, f"rank{k}.pt")))
    kib = 1024
    print("| model | plan | rank | planned stash | strict | strict + temporaries | "
          "measured runtime | measured / strict+temp. |")
    print("|---|---|---|---|---|---|---|---|")
    for name, plan, rank, planned, measured in rows:
        print(f"| {name} | {plan} | {rank} | {planned['stash'] / kib:.0f} | "
              f"{planned['strict'] / kib:.0f} | {planned['temp'] / kib:.0f} | "
              f"{measured / kib:.0f} | {measured / planned['temp']:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
