"""ResNets as flat ``nn.Sequential`` chains of blocks.

* :func:`resnet` (18/34/50/101/152): He, Zhang, Ren and Sun, "Deep Residual Learning for Image
  Recognition", CVPR 2016, Table 1, with torchvision's layout (stride on the 3x3 convolution
  of the bottleneck, "ResNet v1.5"). Stages: ``conv1, bn1, relu, maxpool``, one stage per
  residual block, ``avgpool, flatten, fc`` (40 stages for ResNet-101), the chain rotor
  extracts from the torchvision model (``rotor.md`` section 6.2).
* :func:`preact_resnet` (1001): He, Zhang, Ren and Sun, "Identity Mappings in Deep Residual
  Networks", ECCV 2016, section 4: pre-activation bottleneck units (BN-ReLU-conv), the CIFAR
  design with ``(depth - 2) / 9`` units per group and widths 16/32/64 (x4). ResNet-1001 has
  3 x 111 units; with ``conv1``, the final ``bn, relu, avgpool, flatten, fc`` the chain has
  339 stages, the length of the rotor report (RR section 6).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _projection(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand (x4), post-activation."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * 4)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _projection(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _projection(cin: int, cout: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


RESNET_LAYERS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, ...]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
    200: (Bottleneck, (3, 24, 36, 3)),
}


def resnet(depth: int, num_classes: int = 1000) -> nn.Sequential:
    """ResNet-``depth`` (18, 34, 50, 101, 152, 200) for ImageNet, as a flat chain."""
    block, counts = RESNET_LAYERS[depth]
    mods: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(3, 64, 7, 2, 3, bias=False), bn1=nn.BatchNorm2d(64),
        relu=nn.ReLU(inplace=True), maxpool=nn.MaxPool2d(3, 2, 1))
    cin = 64
    for g, (planes, count) in enumerate(zip((64, 128, 256, 512), counts, strict=True), 1):
        for i in range(count):
            mods[f"layer{g}_{i}"] = block(cin, planes, 2 if (i == 0 and g > 1) else 1)
            cin = planes * block.expansion
    mods["avgpool"] = nn.AdaptiveAvgPool2d(1)
    mods["flatten"] = nn.Flatten(1)
    mods["fc"] = nn.Linear(cin, num_classes)
    return nn.Sequential(mods)


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck unit (He et al. 2016, Fig. 4(e) / Fig. 1(b)).

    ``BN-ReLU-conv1x1, BN-ReLU-conv3x3(stride), BN-ReLU-conv1x1(x4)`` plus the shortcut; a
    1x1 projection of the pre-activated input where the shape changes (authors' code).
    """

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = _conv1x1(cin, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * 4)
        self.relu = nn.ReLU(inplace=False)
        self.shortcut = (None if stride == 1 and cin == planes * 4
                         else _conv1x1(cin, planes * 4, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activation residual unit."""
        pre = self.relu(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return out + identity


def preact_resnet(depth: int = 1001, num_classes: int = 1000,
                  width: int = 16) -> nn.Sequential:
    """Pre-activation ResNet-``depth`` (``depth = 9n + 2``: 164, 1001), CIFAR design.

    ``width`` is the number of channels of the stem and of the first group's bottlenecks
    (16 in He et al.; groups use ``width``, ``2 width``, ``4 width``, times 4 at the output).
    """
    if (depth - 2) % 9:
        raise ValueError(f"depth must be 9n + 2, got {depth}")
    n = (depth - 2) // 9
    mods: OrderedDict[str, nn.Module] = OrderedDict(conv1=_conv3x3(3, width))
    cin = width
    for g, planes in enumerate((width, 2 * width, 4 * width), 1):
        for i in range(n):
            mods[f"layer{g}_{i}"] = PreActBottleneck(cin, planes, 2 if (i == 0 and g > 1) else 1)
            cin = planes * 4
    mods["bn"] = nn.BatchNorm2d(cin)
    mods["relu"] = nn.ReLU()  # not in place: a stage of its own (339 stages for 1001)
    mods["avgpool"] = nn.AdaptiveAvgPool2d(1)
    mods["flatten"] = nn.Flatten(1)
    mods["fc"] = nn.Linear(cin, num_classes)
    return nn.Sequential(mods)
