"""Pieces shared by the distributed examples (run them with torchrun from the checkout)."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from optmem.pytorch.zoo.gpt2 import Block, Embedding


def small_gpt(layers: int, dim: int, heads: int, vocab: int, context: int) -> nn.Sequential:
    """GPT-2 layout (zoo blocks), head tied to the token embedding, no dropout."""
    embed = Embedding(dim, vocab, context, dropout=0.0)
    nn.init.normal_(embed.wte.weight, std=0.02)  # GPT-2's initialisation of the tied matrix
    mods: OrderedDict[str, nn.Module] = OrderedDict(embed=embed)
    for i in range(layers):
        mods[f"h{i}"] = Block(dim, heads, context, dropout=0.0)
    mods["ln_f"] = nn.LayerNorm(dim)
    head = nn.Linear(dim, vocab, bias=False)
    head.weight = embed.wte.weight
    mods["lm_head"] = head
    return nn.Sequential(mods)


def print_mean_loss(step: int, loss: torch.Tensor) -> None:
    """Rank 0 prints the loss of ``step`` averaged over the ranks (a collective call)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"step {step}: loss {mean.item() / world:.5f} (mean over {world} ranks)")
