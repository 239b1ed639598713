"""DenseNet-121/169 as flat chains of dense layers.

Huang, Liu, van der Maaten and Weinberger, "Densely Connected Convolutional Networks", CVPR
2017, Table 1: DenseNet-BC, growth rate 32, bottleneck 4x, compression 0.5; torchvision
layout.

A dense block is not a chain of its layers as written in the paper, but it becomes one when
each layer is the stage ``x -> cat([x, H(x)])`` (the "virtual layers" of the offloading
papers, ``offload.md`` section 6.1): the output of a stage is the concatenation of every
feature map so far, which is what the block keeps alive anyway. Transitions (BN, ReLU,
1x1 convolution, 2x2 average pooling) are one stage each.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

DENSENET_BLOCKS: dict[int, tuple[int, ...]] = {
    121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32),
}


class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1(4k)-BN-ReLU-conv3x3(k), output concatenated to the input."""

    def __init__(self, cin: int, growth: int = 32, bn_size: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``cat([x, H(x)])``."""
        new = self.conv1(self.relu1(self.norm1(x)))
        new = self.conv2(self.relu2(self.norm2(new)))
        return torch.cat([x, new], 1)


class Transition(nn.Module):
    """BN-ReLU-conv1x1 (halving channels)-avgpool 2x2."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transition between dense blocks."""
        return self.pool(self.conv(self.relu(self.norm(x))))


def densenet(depth: int = 121, num_classes: int = 1000, growth: int = 32) -> nn.Sequential:
    """DenseNet-``depth`` (121, 169, 201) for ImageNet, as a flat chain."""
    blocks = DENSENET_BLOCKS[depth]
    c = 2 * growth
    mods: OrderedDict[str, nn.Module] = OrderedDict(
        conv0=nn.Conv2d(3, c, 7, 2, 3, bias=False), norm0=nn.BatchNorm2d(c),
        relu0=nn.ReLU(inplace=True), pool0=nn.MaxPool2d(3, 2, 1))
    for b, count in enumerate(blocks, 1):
        for i in range(count):
            mods[f"block{b}_{i}"] = DenseLayer(c, growth)
            c += growth
        if b < len(blocks):
            mods[f"transition{b}"] = Transition(c, c // 2)
            c //= 2
    mods["norm5"] = nn.BatchNorm2d(c)
    mods["relu"] = nn.ReLU(inplace=True)
    mods["avgpool"] = nn.AdaptiveAvgPool2d(1)
    mods["flatten"] = nn.Flatten(1)
    mods["classifier"] = nn.Linear(c, num_classes)
    return nn.Sequential(mods)
