"""U-Net as a chain of stages that carry the skip connections.

Ronneberger, Fischer and Brox ("U-Net: Convolutional Networks for Biomedical Image
Segmentation", MICCAI 2015, Fig. 1): four 2x2 max-pool downsamplings with double 3x3
convolutions (64 to 1024 channels), four 2x2 up-convolutions concatenated with the skip
connections, a final 1x1 convolution; 31.0 M parameters. Convolutions are padded ("same")
so that any input size divisible by 16 works, a common deviation from the paper's valid
convolutions that does not change the parameter count.

The skip connections make U-Net a chain only if the stages carry them: each stage takes and
returns a tuple ``(skip_1, ..., skip_k, x)``. The chain model then counts the carried skips in
every stage's ``a^i`` (a stored stage output keeps them alive): conservative, never
optimistic.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

WIDTHS = (64, 128, 256, 512, 1024)


def double_conv(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions with ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(inplace=True))


class Down(nn.Module):
    """Append ``double_conv(maxpool(x))`` (or of the input for the first stage)."""

    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        self.conv = double_conv(cin, cout)

    def forward(self, xs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``(s_1..s_k) -> (s_1..s_k, conv(pool(s_k)))``."""
        xs = (xs,) if isinstance(xs, torch.Tensor) else tuple(xs)
        if isinstance(self.pool, nn.Identity):
            return (self.conv(xs[-1]),)
        return (*xs, self.conv(self.pool(xs[-1])))


class Up(nn.Module):
    """Up-convolve the last tensor, concatenate with the last skip, double convolution."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = double_conv(cin, cout)

    def forward(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``(s_1..s_k, x) -> (s_1..s_{k-1}, conv(cat(s_k, up(x))))``."""
        *skips, skip, x = xs
        return (*skips, self.conv(torch.cat([skip, self.up(x)], 1)))


class OutConv(nn.Module):
    """Final 1x1 convolution to class scores."""

    def __init__(self, cin: int, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, classes, 1)

    def forward(self, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Per-pixel class scores."""
        return self.conv(xs[-1])


def unet(in_channels: int = 3, classes: int = 2) -> nn.Sequential:
    """U-Net as a chain of 10 stages (5 down, 4 up, output)."""
    mods: OrderedDict[str, nn.Module] = OrderedDict()
    cin = in_channels
    for i, w in enumerate(WIDTHS):
        mods[f"down{i}"] = Down(cin, w, pool=i > 0)
        cin = w
    for i, w in enumerate(reversed(WIDTHS[:-1])):
        mods[f"up{i}"] = Up(cin, w)
        cin = w
    mods["out"] = OutConv(cin, classes)
    return nn.Sequential(mods)
