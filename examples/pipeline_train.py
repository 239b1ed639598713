"""Pipeline-parallel training with an optmem plan on PyTorch's pipeline runtime, in one call.

    torchrun --nproc_per_node 2 examples/pipeline_train.py [--model gpt|resnet18|hf-gpt2]
             [--method madpipe] [--memory-per-gpu 1GiB] [--bandwidth 12GB/s] [--steps 2]

``optmem.pytorch.pipeline`` profiles the model on rank 0 (one micro-batch), solves the
pipeline problem for ``P = world size`` GPUs (MadPipe by default: stages may be placed
non-contiguously), broadcasts the chain and the plan, and builds this rank's stages on
``torch.distributed.pipelining`` with the plan's own operation order. Each ``step`` runs one
flush of ``--microbatches`` micro-batches; weights shared by stages on different ranks (the
tied embedding and head of GPT-2) get their gradient summed between those ranks.

Models: ``gpt`` (a small GPT-2 of the zoo's blocks, tied head; default), ``resnet18`` (the
zoo's, on 32 px images), ``hf-gpt2`` (HuggingFace ``GPT2LMHeadModel`` with a small config,
tied head, exported with ``torch.export``; needs ``transformers``). Every rank passes the
batch to ``step`` (an exported model's side inputs, position ids and masks, are computed on
every rank). Rank 0 prints the plan; the rank(s) holding the last stage print the losses.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import optmem.pytorch as op


def build(name: str, args: argparse.Namespace) -> tuple[nn.Module, Callable[[int], Any],
                                                         Callable[..., torch.Tensor]]:
    """The model (same weights on every rank), a batch maker and the loss of a micro-batch."""
    torch.manual_seed(0)
    if name == "resnet18":
        from optmem.pytorch.zoo.resnet import resnet

        def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

        return resnet(18, num_classes=10), images, nn.functional.cross_entropy

    def tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, args.vocab, (n, args.context + 1))
        return ids[:, :-1], ids[:, 1:]

    def lm_loss(logits: Any, target: torch.Tensor) -> torch.Tensor:
        logits = getattr(logits, "logits", logits)
        return nn.functional.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))

    from common import hf_gpt2, small_gpt  # the same small GPT-2s as the FSDP example

    build = hf_gpt2 if name == "hf-gpt2" else small_gpt
    return build(args.layers, args.dim, 4, args.vocab, args.context), tokens, lm_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt", choices=("gpt", "resnet18", "hf-gpt2"))
    ap.add_argument("--method", default="madpipe", help="any pipeline method of optmem")
    ap.add_argument("--memory-per-gpu", default="1GiB")
    ap.add_argument("--bandwidth", default="12GB/s")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--context", type=int, default=32)
    args = ap.parse_args()

    device = op.init_distributed()
    rank = dist.get_rank()
    model, batch, loss_fn = build(args.model, args)
    torch.manual_seed(100)  # the same data on every rank: the first stage reads the inputs,
    batches = [batch(args.microbatches * args.microbatch_size)  # the last the targets
               for _ in range(args.steps)]
    sample = batches[0][0][:args.microbatch_size]
    piped = op.pipeline(model, sample, gpus=dist.get_world_size(),
                        memory_per_gpu=args.memory_per_gpu, bandwidth=args.bandwidth,
                        loss_fn=loss_fn, method=args.method, microbatches=args.microbatches)
    if rank == 0:
        result = piped.result
        print(f"{args.model}: {result.method} plan ({result.status}), predicted period "
              f"{result.objective:.3f} ms per micro-batch; {result.report.get('allocation')}")
        print("plan (the same on every rank):", " ".join(result.plan))
    print(f"rank {rank}: stages {piped.stage_indices}", flush=True)
    opt = torch.optim.AdamW(piped.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        losses = piped.step(x.to(device), target=y.to(device))
        opt.step()
        if losses:
            mean = sum(float(v) for v in losses) / len(losses)
            print(f"rank {rank} step {step}: mean micro-batch loss {mean:.5f}", flush=True)
    dist.barrier()  # every rank done with its collectives before gloo tears down
    dist.destroy_process_group()
    op.end_process()  # skips finalisation, where gloo's threads can abort (docs/distributed.md)


if __name__ == "__main__":
    main()
