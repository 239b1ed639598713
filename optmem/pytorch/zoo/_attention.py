"""Multi-head self-attention written out (eager), shared by the GPT-2 and ViT models.

The attention matrix is materialised as in the reference implementations (HuggingFace GPT-2
eager attention, torchvision's ``nn.MultiheadAttention`` math path), so profiles show its
``O(T^2)`` memory; fused (flash) kernels would keep much less.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    """``softmax(Q K^T / sqrt(d_head) [+ causal mask]) V`` with fused QKV projection."""

    def __init__(self, dim: int, heads: int, *, causal: bool, max_len: int = 1024,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.causal = causal
        if causal:
            mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention over the sequence dimension of ``x`` (batch, length, dim)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        if self.causal:
            mask: torch.Tensor = self.mask  # type: ignore[assignment]
            att = att.masked_fill(~mask[:t, :t], float("-inf"))
        att = self.attn_drop(torch.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)
