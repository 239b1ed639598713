"""Hunt of the torch bridge on HF detection, segmentation and keypoint families (stop 85;
``docs/pytorch.md``, "Stop 85 (detection and segmentation)").

MaskFormer's loss matches predictions to labels in NumPy (SciPy's Hungarian algorithm on
``cost.cpu()``), which no graph holds: the error named export's and fx's failures only, and
now says to call the model without labels and compute the loss from its outputs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import HUNT_FIXED  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402


class NumpyMatched(nn.Module):
    """Two layers, then a loss that matches rows in NumPy (as MaskFormer's Hungarian one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.layers(x)
        if labels is None:
            return out
        order = torch.as_tensor(out.detach().numpy().argsort(axis=0)[:, 0].copy())
        return (out[order] - labels).square().mean()


def test_a_loss_matched_in_numpy_says_to_drop_the_labels() -> None:
    """The error named export's and fx's failures only; now it says what to do."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    with pytest.raises(OptmemInputError, match="without labels and compute the loss"):
        op.checkpoint(NumpyMatched(), {"x": x, "labels": x}, **HUNT_FIXED)
