"""HF's overflow guard in the families stop 86 did not try (stop 87; ``docs/pytorch.md``,
"Stop 87 (guard families)").

Two faults, both met on tiny random HF models: the guard held as ``aten.clamp`` gave, on
the finite side, the gradient in the guarded value's layout where the model (no clamp
there) passes it on in its own; equal values, other strides, and a later reduction summed
them in another order (HF Table Transformer: ``input_projection.bias``'s gradient 1.2e-7
off). And a refusal for a data-dependent size met past a guard named the guard's line
(HF OneFormer: its decoder's boolean index). Now the guard is ``optmem::overflow_clamp``,
whose gradient follows the side taken at run time, and the message names the size's line.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from pytorch_helpers import (  # noqa: E402
    HUNT_FIXED,
    assert_bitwise,
    float_outputs_step,
    hunt_kinds,
    square_step,
    tiny_detr_like,
)
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.overflow_guards import OVERFLOW_CLAMP  # noqa: E402

KINDS = hunt_kinds()
MAX = torch.finfo(torch.float32).max


class PermutedGuard(nn.Module):
    """Table Transformer's shape: a 1x1 convolution, flattened and transposed, then a
    guarded residual layer (no LayerNorm before the guard: the value stays transposed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Conv2d(4, 8, 1)
        self.lin, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).flatten(2).permute(0, 2, 1)
        h = (h + torch.tanh(self.lin(h))) * self.gain
        if self.training:  # noqa: SIM102 - HF's form
            if not torch.isfinite(h).all():
                clamp_value = torch.finfo(h.dtype).max - 1000
                h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        return self.head(h / self.gain)




@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("overflow", [False, True], ids=["finite_sample", "clamping_sample"])
def test_a_transposed_guarded_value_trains_bitwise(kind: str, overflow: bool) -> None:
    """Before: the convolution's bias gradient differed (the clamp's gradient came back in
    the transposed layout); now bitwise, the sample's side and the other at run time."""
    model = PermutedGuard().train()
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    if overflow:
        model.gain.fill_(3e38)
    plain = copy.deepcopy(model)
    wrap, extra = KINDS[kind]
    wrapped = wrap(model, x, **{**HUNT_FIXED, "memory_limit": "min"}, **extra)
    assert_bitwise(square_step(wrapped, model, x), square_step(plain, plain, x))
    for net in (model, plain):  # the other side
        net.gain.fill_(1.0 if overflow else 3e38)
    assert_bitwise(square_step(wrapped, model, x), square_step(plain, plain, x))


def _clamp_grads(h: torch.Tensor, grad: torch.Tensor, create: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = h.detach().requires_grad_(), h.detach().requires_grad_()
    (ga,) = torch.autograd.grad(OVERFLOW_CLAMP(a, MAX), a, grad, create_graph=create)
    (gb,) = torch.autograd.grad(torch.clamp(b, -MAX, MAX), b, grad, create_graph=create)
    return ga, gb


def test_the_held_clamp_gives_each_sides_gradient() -> None:
    """Finite values: the gradient as it came, in its layout (-0 and NaN kept); a value
    beyond: ``aten.clamp``'s gradient, bit for bit and in its layout."""
    h = torch.randn(6, 4).t()  # transposed
    grad = torch.randn(4, 6)
    grad[0, 0], grad[1, 1] = -0.0, float("nan")
    got, _ = _clamp_grads(h, grad)
    assert got.stride() == grad.stride() and torch.equal(_bits(got), _bits(grad))
    h = h.clone().t().contiguous().t()
    h[2, 3], h[0, 1] = float("inf"), float("nan")
    got, ref = _clamp_grads(h, grad)
    assert got.stride() == ref.stride()
    assert torch.equal(_bits(got), _bits(ref))
    assert torch.equal(_bits(OVERFLOW_CLAMP(h, MAX)), _bits(torch.clamp(h, -MAX, MAX)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


def test_the_held_clamp_differentiates_twice() -> None:
    """The gradient is linear in the incoming one: a double backward as the clamp's."""
    h = torch.randn(3, 5)
    h[1, 2] = float("inf")
    g = torch.randn(3, 5, requires_grad=True)
    got, ref = _clamp_grads(h, g, create=True)
    (gg,) = torch.autograd.grad(got.sum(), g)
    (rr,) = torch.autograd.grad(ref.sum(), g)
    assert_bitwise(gg, rr)


class SizeAfterGuard(PermutedGuard):
    """The guard, then a boolean index by value (HF OneFormer's masked attention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).flatten(2).permute(0, 2, 1)
        h = h + torch.tanh(self.lin(h))
        if not torch.isfinite(h).all():
            clamp_value = torch.finfo(h.dtype).max - 1000
            h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        mask = (h.sum(-1) > 0).unsqueeze(-1).expand_as(h).clone()
        mask[torch.where(mask.sum(-1) == mask.shape[-1])] = False
        return self.head(h * mask)


def test_a_size_past_the_guard_is_named_where_it_is() -> None:
    """Before: the message named the guard's line (the first export's failure)."""
    x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(OptmemInputError, match=r"size depends on values computed in the call"
                       r" at test_torch_guards_stop87\.py:\d+ \(`mask\[torch\.where"):
        op.checkpoint(SizeAfterGuard().train(), x, **HUNT_FIXED)


def _tiny_table_transformer() -> nn.Module:
    return tiny_detr_like(transformers.TableTransformerConfig,
                          transformers.TableTransformerForObjectDetection)


def _tiny_pp_doclayout_v4() -> nn.Module:
    torch.manual_seed(0)
    backbone = transformers.HGNetV2Config(
        embedding_size=8, depths=[1, 1, 1, 1], hidden_sizes=[16, 16, 32, 32],
        stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 16, 32],
        stage_mid_channels=[8, 8, 8, 8], stage_out_channels=[16, 16, 32, 32],
        stage_num_blocks=[1, 1, 1, 1], stage_numb_of_layers=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"])
    config = transformers.PPDocLayoutV4Config(
        backbone_config=backbone, encoder_in_channels=[16, 32, 32], feat_strides=[8, 16, 32],
        encoder_hidden_dim=16, d_model=16, encoder_ffn_dim=16, encoder_attention_heads=2,
        decoder_in_channels=[16, 16, 16], decoder_ffn_dim=16, decoder_layers=2,
        decoder_attention_heads=2, num_queries=5, num_denoising=4, num_labels=3,
        global_pointer_head_size=8, hidden_size=16, deform_conv_width=8)
    return transformers.PPDocLayoutV4ForObjectDetection(config).train()



@pytest.mark.parametrize(("family", "kind"), [("table_transformer", "offload"),
                                              ("pp_doclayout_v4", "checkpoint")])
def test_guarded_hf_family_steps_bitwise(family: str, kind: str) -> None:
    """Table Transformer: its input projection's bias gradient was 1.2e-7 off; PP-DocLayout
    v4 (refused before stop 86): one step and an eval call bitwise."""
    model = {"table_transformer": _tiny_table_transformer,
             "pp_doclayout_v4": _tiny_pp_doclayout_v4}[family]()
    plain = copy.deepcopy(model)
    kwargs = {"pixel_values": torch.randn(2, 3, 32, 32,
                                          generator=torch.Generator().manual_seed(1))}
    wrap, extra = KINDS[kind]
    wrapped = wrap(model, kwargs, **HUNT_FIXED, **extra)
    got, ref = float_outputs_step(wrapped, model, kwargs), float_outputs_step(plain, plain, kwargs)
    assert_bitwise(got, ref)
    assert sum(g is not None for g in got[1]) > 0.9 * len(got[1])
    wrapped.eval()
    plain.eval()
    with torch.no_grad():
        assert_bitwise([v for v in wrapped(**kwargs).values() if isinstance(v, torch.Tensor)],
                 [v for v in plain(**kwargs).values() if isinstance(v, torch.Tensor)])
