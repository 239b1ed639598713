"""FSDP2 (``fully_shard`` per block) with an optmem checkpoint plan over the blocks.

    torchrun --nproc_per_node 2 examples/fsdp_checkpoint.py [--steps 3] [--layers 4]
             [--model gpt|hf-gpt2] [--problem checkpoint|offload|remat_offload]

``optmem.pytorch.distributed.checkpoint_fsdp`` profiles the *unsharded* model on rank 0, adds
to every stage's per-op memory what FSDP gathers while it runs (its unsharded parameters, and
in the backward its unsharded gradients and the prefetched parameters of the block before),
solves the checkpoint plan under ``--memory-limit`` once, broadcasts it, and shards one FSDP
unit per block (the tied embedding and head stay in the root unit). The order matters:
checkpoint first, shard after (docs/distributed.md). A small GPT-2 of the zoo's blocks
(``--model gpt``, default) or HuggingFace's ``GPT2LMHeadModel`` (``--model hf-gpt2``, exported
with ``torch.export``: every stage with parameters of its own, each attention and MLP half,
is an FSDP unit) trains for a few AdamW steps; rank 0 prints the plan and the losses.
``--problem offload`` (or ``remat_offload``) plans offloading (and recomputation) over the
same FSDP-adjusted chain instead, over a host link of ``--bandwidth``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import hf_gpt2, print_mean_loss, small_gpt
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import optmem.pytorch as op
from optmem.pytorch.distributed import checkpoint_fsdp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt", choices=("gpt", "hf-gpt2"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--memory-limit", default="min",
                    help="activation + FSDP memory per rank (e.g. 4MiB), or min (default)")
    ap.add_argument("--problem", default="checkpoint",
                    choices=("checkpoint", "offload", "remat_offload"))
    ap.add_argument("--bandwidth", default=None,
                    help="host link of an offload plan (default 12GB/s)")
    args = ap.parse_args()

    device = op.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    build = hf_gpt2 if args.model == "hf-gpt2" else small_gpt
    model = build(args.layers, args.dim, 4, args.vocab, args.context).to(device)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=gen)
               .to(device) for _ in range(args.steps)]

    def call(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """A HuggingFace model computes its loss from labels= (it shifts them itself)."""
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1]}

    sample = call(batches[0]) if args.model == "hf-gpt2" else batches[0][:, :-1]
    cmodel = checkpoint_fsdp(model, sample, args.memory_limit, problem=args.problem,
                             bandwidth=args.bandwidth, mesh=mesh)
    if rank == 0:
        print(cmodel.summary())
        print("plan (the same on every rank):", " ".join(map(str, cmodel.result.plan)))
        print("FSDP units:", ", ".join(type(m).__name__ for m in cmodel.stages))
    opt = torch.optim.AdamW(cmodel.parameters(), lr=1e-3)
    for step, tokens in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if args.model == "hf-gpt2":
            loss = cmodel(**call(tokens)).loss
        else:
            logits = cmodel(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                               tokens[:, 1:].reshape(-1))
        loss.backward()  # FSDP reduce-scatters (averages) the gradients
        opt.step()
        print_mean_loss(step, loss)
    dist.barrier()  # every rank done with its collectives before gloo tears down
    dist.destroy_process_group()
    op.end_process()  # skips finalisation, where gloo's threads can abort (docs/distributed.md)


if __name__ == "__main__":
    main()
