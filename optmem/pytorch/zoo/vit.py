"""Vision Transformer ViT-B/16 as a flat chain of encoder blocks.

Dosovitskiy et al. ("An Image is Worth 16x16 Words", ICLR
2021, Table 1: 12 layers, width 768, MLP 3072, 12 heads; torchvision ``vit_b_16`` layout,
86.6 M parameters at 224x224).

Stages: ``embed`` (16x16 patch convolution, class token, position embedding), one per
encoder block, ``head`` (final LayerNorm, class token, linear classifier).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from optmem.pytorch.zoo._attention import SelfAttention

VIT_CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    # name: (patch, layers, dim, mlp, heads)
    "b16": (16, 12, 768, 3072, 12), "l16": (16, 24, 1024, 4096, 16),
}


class PatchEmbed(nn.Module):
    """Patchify, prepend the class token, add position embeddings."""

    def __init__(self, image: int, patch: int, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, dim, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (batch, 3, H, W) to tokens (batch, 1 + HW/p^2, dim)."""
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.drop(x + self.pos_embedding)


class EncoderBlock(nn.Module):
    """Pre-LN encoder block (LayerNorm eps 1e-6, GELU MLP)."""

    def __init__(self, dim: int, mlp: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = SelfAttention(dim, heads, causal=False)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, mlp)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.proj(self.act(self.fc(self.ln_2(x)))))


class Head(nn.Module):
    """Final LayerNorm, class token, linear classifier."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.fc(self.ln(x)[:, 0])


def vit(name: str = "b16", image: int = 224, num_classes: int = 1000) -> nn.Sequential:
    """ViT-``name`` (b16, l16) for ``image`` x ``image`` inputs, as a flat chain."""
    patch, layers, dim, mlp, heads = VIT_CONFIGS[name]
    mods: OrderedDict[str, nn.Module] = OrderedDict(embed=PatchEmbed(image, patch, dim))
    for i in range(layers):
        mods[f"encoder{i}"] = EncoderBlock(dim, mlp, heads)
    mods["head"] = Head(dim, num_classes)
    return nn.Sequential(mods)
