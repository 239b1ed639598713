"""GPT-2 style decoder as a flat chain of transformer blocks.

Radford et al., "Language Models are Unsupervised Multitask Learners", 2019, Table 2;
layout of the released model / HuggingFace ``GPT2LMHeadModel``: learned
token and position embeddings, pre-LayerNorm blocks (causal attention, 4x MLP with tanh
GELU), final LayerNorm, language-model head tied to the token embedding.

Stages: ``embed``, one per block, ``ln_f``, ``lm_head``. Sizes: small 124 M parameters
(12 layers, width 768, 12 heads), medium 355 M (24, 1024, 16), large 774 M (36, 1280, 20).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from optmem.pytorch.zoo._attention import SelfAttention

GPT2_CONFIGS: dict[str, tuple[int, int, int]] = {
    "small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20),
    "xl": (48, 1600, 25),
}
VOCAB = 50257
CONTEXT = 1024


class Embedding(nn.Module):
    """Token plus position embedding, then dropout."""

    def __init__(self, dim: int, vocab: int = VOCAB, context: int = CONTEXT,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, length) to hidden states (batch, length, dim)."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos))


class Block(nn.Module):
    """Pre-LN transformer decoder block."""

    def __init__(self, dim: int, heads: int, context: int = CONTEXT,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal=True, max_len=context, dropout=dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * dim, dim)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""
        x = x + self.drop1(self.attn(self.ln_1(x)))
        return x + self.drop2(self.proj(self.act(self.fc(self.ln_2(x)))))


def gpt2(size: str = "small", *, vocab: int = VOCAB, context: int = CONTEXT,
         dropout: float = 0.1) -> nn.Sequential:
    """GPT-2 ``size`` (small, medium, large, xl) as a flat chain, head tied to ``wte``."""
    layers, dim, heads = GPT2_CONFIGS[size]
    embed = Embedding(dim, vocab, context, dropout)
    mods: OrderedDict[str, nn.Module] = OrderedDict(embed=embed)
    for i in range(layers):
        mods[f"h{i}"] = Block(dim, heads, context, dropout)
    mods["ln_f"] = nn.LayerNorm(dim)
    head = nn.Linear(dim, vocab, bias=False)
    head.weight = embed.wte.weight
    mods["lm_head"] = head
    return nn.Sequential(mods)
