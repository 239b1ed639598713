"""VGG-16/19 as flat chains of layers.

Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
Recognition", ICLR 2015, Table 1 configurations D and E; torchvision layout without batch
norm; every layer (convolution, ReLU, pooling, linear, dropout) is one stage.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

VGG_CONFIGS: dict[int, tuple[int | str, ...]] = {
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
         512, 512, 512, "M"),
    19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"),
}


def vgg(depth: int = 16, num_classes: int = 1000) -> nn.Sequential:
    """VGG-``depth`` (16 or 19) for ImageNet, as a flat chain."""
    mods: OrderedDict[str, nn.Module] = OrderedDict()
    cin = 3
    for k, v in enumerate(VGG_CONFIGS[depth]):
        if v == "M":
            mods[f"pool{k}"] = nn.MaxPool2d(2, 2)
        else:
            assert isinstance(v, int)
            mods[f"conv{k}"] = nn.Conv2d(cin, v, 3, padding=1)
            mods[f"relu{k}"] = nn.ReLU(inplace=True)
            cin = v
    mods["avgpool"] = nn.AdaptiveAvgPool2d(7)
    mods["flatten"] = nn.Flatten(1)
    mods["fc1"] = nn.Linear(512 * 7 * 7, 4096)
    mods["relu_fc1"] = nn.ReLU(inplace=True)
    mods["drop1"] = nn.Dropout()
    mods["fc2"] = nn.Linear(4096, 4096)
    mods["relu_fc2"] = nn.ReLU(inplace=True)
    mods["drop2"] = nn.Dropout()
    mods["fc3"] = nn.Linear(4096, num_classes)
    return nn.Sequential(mods)
