"""Small built-in models (CPU-sized) for tests, examples and ``optmem profile toy-*``.

``toy-mlp``, ``toy-cnn`` (an ``nn.Sequential``), ``toy-resnet`` (residual blocks, traced by
``torch.fx``) and ``toy-transformer`` (pre-norm encoder blocks, traced by ``torch.fx``).
Factories import torch when called, so registering them does not.
"""

from __future__ import annotations

from typing import Any

from optmem.pytorch.models import register_model


@register_model("toy-mlp")
def toy_mlp(batch: int = 32, width: int = 256, depth: int = 6) -> tuple[Any, Any]:
    """MLP of ``depth`` Linear+ReLU layers (nn.Sequential), width 256."""
    import torch
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers), torch.randn(batch, width)


@register_model("toy-cnn")
def toy_cnn(batch: int = 8, channels: int = 16, size: int = 32) -> tuple[Any, Any]:
    """Small VGG-like CNN (nn.Sequential) on 3x32x32 images."""
    import torch
    from torch import nn

    c = channels
    net = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True)),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c),
                      nn.ReLU(inplace=True)),
        nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c),
                      nn.ReLU(inplace=True)),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(2 * c * (size // 4) ** 2, 10),
    )
    return net, torch.randn(batch, 3, size, size)


def _resnet_classes() -> tuple[Any, Any]:
    from torch import nn

    class BasicBlock(nn.Module):
        """ResNet basic block (two 3x3 convolutions and a skip connection)."""

        def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x: Any) -> Any:
            identity = x if self.down is None else self.down(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out = out + identity
            return self.relu(out)

    class SmallResNet(nn.Module):
        """ResNet with ``blocks`` basic blocks per stage, three stages."""

        def __init__(self, blocks: int = 2, width: int = 8, classes: int = 10) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(width)
            self.relu = nn.ReLU(inplace=True)
            layers = []
            cin = width
            for k, cout in enumerate((width, 2 * width, 4 * width)):
                for b in range(blocks):
                    layers.append(BasicBlock(cin, cout, 2 if (b == 0 and k > 0) else 1))
                    cin = cout
            self.layers = nn.ModuleList(layers)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x: Any) -> Any:
            x = self.relu(self.bn(self.stem(x)))
            for layer in self.layers:
                x = layer(x)
            x = x.mean(dim=(2, 3))
            return self.fc(x)

    return BasicBlock, SmallResNet


@register_model("toy-resnet")
def toy_resnet(batch: int = 4, blocks: int = 2, width: int = 8,
               size: int = 16) -> tuple[Any, Any]:
    """Small ResNet (3 stages of basic blocks), traced by torch.fx."""
    import torch

    _, small_resnet = _resnet_classes()
    return small_resnet(blocks, width), torch.randn(batch, 3, size, size)


def _transformer_class() -> Any:
    from torch import nn

    class Block(nn.Module):
        """Pre-norm transformer encoder block (self-attention + MLP, residuals)."""

        def __init__(self, dim: int, heads: int, dropout: float) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
            self.ln2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout),
                                     nn.Linear(4 * dim, dim))

        def forward(self, x: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyTransformer(nn.Module):
        """Token embedding, ``depth`` blocks, final norm and head."""

        def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 3,
                     dropout: float = 0.0) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(depth))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return TinyTransformer


@register_model("toy-transformer")
def toy_transformer(batch: int = 4, seq: int = 16, depth: int = 3,
                    dropout: float = 0.0) -> tuple[Any, Any]:
    """Tiny pre-norm transformer over 64 tokens (fx-traced, cut only between residuals)."""
    import torch

    tiny = _transformer_class()
    return tiny(depth=depth, dropout=dropout), torch.randint(0, 64, (batch, seq))
