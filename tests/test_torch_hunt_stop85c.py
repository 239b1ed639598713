"""Hunt of the torch bridge on HF detection, segmentation and keypoint families (stop 85;
``docs/pytorch.md``, "Stop 85 (detection and segmentation)").

DETR, Conditional DETR, Deformable DETR, RT-DETR (v1, v2) and Mask2Former's pixel decoder
guard their training forward against overflow: ``if not torch.isfinite(h).all(): h =
torch.clamp(h, min=-c, max=c)`` (``c = finfo.max - 1000``). Every wrap of these models,
with or without labels, was refused as a branch on an intermediate value ("a router's
choice, LayerDrop's random draw"). In float32 the clamp is the identity on finite values,
so optmem now drops the guard's assertion and keeps the clamp
(:func:`optmem.pytorch.branches.drop_overflow_guards`): the models without labels (their
Hungarian-matched loss computed from the outputs) wrap and train bitwise as the plain model.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

KINDS = hunt_kinds()


class GuardedLayer(nn.Module):
    """A layer ending in HuggingFace's overflow guard, then a scale-down that shows a clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h + torch.tanh(self.lin(h))) * self.gain
        if self.training:  # noqa: SIM102 - HF's form (one `and` exports the other side)
            if not torch.isfinite(h).all():
                clamp_value = torch.finfo(h.dtype).max - 1000
                h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        return h / self.gain


class GuardedNet(nn.Module):
    """Four guarded layers and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(GuardedLayer() for _ in range(4))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _bitwise(got: Any, ref: Any) -> None:
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_overflow_guard_wraps_and_clamps_as_the_model() -> None:
    """The guard was refused; now a step is bitwise, and an overflow is clamped as plain."""
    model = GuardedNet()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    cmodel = op.checkpoint(model, x, **HUNT_FIXED)
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    got = cmodel(x)
    got.square().sum().backward()
    ref = plain(x)
    ref.square().sum().backward()
    _bitwise(got, ref)
    _bitwise(_grads(model), _grads(plain))
    with torch.no_grad():  # the other side: values overflow to inf, the model clamps them
        for net in (model, plain):
            net.layers[1].gain.fill_(1e38)
    got, ref = cmodel(x).detach(), plain(x).detach()
    assert torch.isfinite(ref).all()
    _bitwise(got, ref)


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


def _detr(kind: str) -> tuple[nn.Module, dict[str, Any]]:
    """Tiny DETR or RT-DETR (ResNet backbones, random init), no labels."""
    torch.manual_seed(0)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    if kind == "detr":
        backbone = transformers.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
            out_features=["stage1", "stage2"])
        config = transformers.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_queries=5,
            num_labels=3)
        return transformers.DetrForObjectDetection(config), {"pixel_values": pixels}
    backbone = transformers.RTDetrResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 1, 1], layer_type="basic",
        out_features=["stage1", "stage2", "stage3"])
    config = transformers.RTDetrConfig(
        backbone_config=backbone, use_pretrained_backbone=False, use_timm_backbone=False,
        d_model=16, encoder_in_channels=[8, 16, 16], feat_strides=[4, 8, 16],
        encoder_hidden_dim=16, encoder_ffn_dim=16, encoder_layers=1, decoder_layers=1,
        decoder_ffn_dim=16, num_queries=5, num_labels=3, num_feature_levels=3,
        decoder_in_channels=[16, 16, 16], encoder_attention_heads=2, decoder_attention_heads=2,
        num_denoising=4, decoder_n_points=2)
    return transformers.RTDetrForObjectDetection(config), {"pixel_values": pixels}


def _detection_step(call: Any, owner: nn.Module, kwargs: dict[str, Any]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A loss from the outputs (the logits and boxes), as a user computes it outside."""
    torch.manual_seed(5)
    out = call(**kwargs)
    (out.logits.square().mean() + out.pred_boxes.sum()).backward()
    return [out.logits.detach(), out.pred_boxes.detach()], _grads(owner)


@pytest.mark.parametrize(("family", "kind"), [("detr", "checkpoint"),
                                              ("rt_detr", "remat_offload")])
def test_detr_family_without_labels_is_bitwise(family: str, kind: str) -> None:
    """Refused at the encoder's guard before; now wrapped and a step bitwise the model's."""
    model, kwargs = _detr(family)
    model.train()
    plain = copy.deepcopy(model)
    wrap, extra = KINDS[kind]
    cmodel = wrap(model, kwargs, **HUNT_FIXED, **extra)
    got = _detection_step(cmodel, model, kwargs)
    ref = _detection_step(plain, plain, kwargs)
    _bitwise(got, ref)
    assert sum(g is not None for g in got[1]) > 0.9 * len(got[1])
