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


def hf_gpt2(layers: int, dim: int, heads: int, vocab: int, context: int) -> nn.Module:
    """HuggingFace's ``GPT2LMHeadModel`` (head tied to the token embedding) of a small
    config, random weights, no dropout (needs ``transformers``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab,
                        n_positions=context, use_cache=False, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def hf_gpt2_call(batch: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A factory for ``optmem train-pipeline examples.common:hf_gpt2_call``: a 2-layer
    HuggingFace GPT-2 and one micro-batch call that makes it compute its loss."""
    model = hf_gpt2(2, 32, 4, 256, 32)
    ids = torch.randint(0, 256, (batch, 32))
    return model, {"input_ids": ids, "labels": ids}


def print_mean_loss(step: int, loss: torch.Tensor) -> None:
    """Rank 0 prints the loss of ``step`` averaged over the ranks (a collective call)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"step {step}: loss {mean.item() / world:.5f} (mean over {world} ranks)")
