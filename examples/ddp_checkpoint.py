"""Data-parallel training (DDP) of a checkpointed model: one plan for every rank.

    torchrun --nproc_per_node 2 examples/ddp_checkpoint.py [--steps 3] [--memory-limit min]

``optmem.pytorch.checkpoint`` profiles and solves on rank 0 only and broadcasts the chain and
the plan, so every rank recomputes the same stages (ranks that planned alone could measure
different times and choose different plans). The checkpointed module goes into
``DistributedDataParallel`` with its default arguments (``find_unused_parameters`` must stay
False: docs/distributed.md). Each rank trains on its own shard of a synthetic batch; rank 0
prints the plan and the losses. NCCL and one GPU per rank when CUDA is available, gloo on
CPU processes otherwise. Several nodes: docs/distributed.md (rendezvous flags).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import print_mean_loss
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import optmem.pytorch as op


class Residual(nn.Module):
    """``x + MLP(LayerNorm(x))``: one chain stage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="examples per rank")
    ap.add_argument("--memory-limit", default="min",
                    help="activation memory per rank (e.g. 512KiB), or min (default)")
    args = ap.parse_args()

    device = op.init_distributed()  # from torchrun's environment; NCCL + cuda:LOCAL_RANK or gloo
    rank = dist.get_rank()
    torch.manual_seed(0)  # DDP copies rank 0's weights anyway
    model = nn.Sequential(*[Residual(args.width) for _ in range(args.depth)],
                          nn.Linear(args.width, 1)).to(device)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [(torch.randn(args.batch, args.width, generator=gen).to(device),
                torch.randn(args.batch, 1, generator=gen).to(device))
               for _ in range(args.steps)]

    cmodel = op.checkpoint(model, batches[0][0], memory_limit=args.memory_limit)
    ddp = DistributedDataParallel(cmodel, device_ids=[device] if device.type == "cuda" else None)
    if rank == 0:
        print(cmodel.summary())
        print("plan (the same on every rank):", " ".join(cmodel.result.plan))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP averages the gradients over the ranks
        opt.step()
        print_mean_loss(step, loss)
    dist.barrier()  # every rank done with its collectives before gloo tears down
    dist.destroy_process_group()
    op.end_process()  # skips finalisation, where gloo's threads can abort (docs/distributed.md)


if __name__ == "__main__":
    main()
