"""SDPA masks that require grad in training take the training kernel under ``no_grad`` too.

CPU ``scaled_dot_product_attention`` picks the math kernel for a mask that requires grad
and the flash kernel otherwise; they round differently. A relative-position bias computed
from a parameter (Wav2Vec2-BERT, SeamlessM4T) is such a mask, and a plan's ``F_ck`` and
``F_none`` run under ``no_grad``: a checkpointed stage's first forward differed from its
re-run and from the plain model (:func:`optmem.pytorch.attention.masks_as_in_training`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402, F401  (one thread)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.attention import as_in_training, masks_as_in_training  # noqa: E402

SEQ, DIM, HEADS = 24, 32, 2


class _BiasedAttention(nn.Module):
    """A block whose attention mask is a learned relative-position bias (a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.bias = nn.Parameter(torch.randn(2 * SEQ - 1, HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s)
        mask = self.bias[pos[:, None] - pos[None, :] + SEQ - 1].permute(2, 0, 1)[None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, s, DIM)).tanh()


class _Encoder(nn.Module):
    """Six such blocks in a loop (exported: one graph, cut into stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BiasedAttention() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Encoder()


def _step(call, owner: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    owner.zero_grad(set_to_none=True)
    loss = call(x).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("extract", ["export", "fx"])
def test_a_checkpointed_stage_with_a_learned_mask_is_bitwise_the_plain_model(extract):
    model = _model()
    x = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    ref = _step(model, model, x)
    cm = op.checkpoint(model, (x,), memory_limit="50%", repeats=1, warmup=0,
                       fast_path=False, extract=extract)
    assert cm.extraction is not None and cm.extraction.method == extract
    assert any(o.startswith(("F_ck", "F_none")) for o in cm.result.plan), "no re-run"
    got = _step(cm, model, x)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Masks(nn.Module):
    """Four SDPA calls: a mask from a parameter, one computed under ``no_grad``, one
    detached, one from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(SEQ, SEQ))

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ys = [F.scaled_dot_product_attention(x, x, x, attn_mask=self.bias * 2)]
        with torch.no_grad():
            off = self.bias + 1
        ys.append(F.scaled_dot_product_attention(x, x, x, attn_mask=off))
        ys.append(F.scaled_dot_product_attention(x, x, x, attn_mask=self.bias.detach()))
        ys.append(F.scaled_dot_product_attention(x, x, x, attn_mask=extra.tanh()))
        return sum(ys)


@pytest.mark.parametrize("extra_requires_grad", [False, True])
def test_only_masks_that_require_grad_in_training_are_routed(extra_requires_grad):
    x = torch.randn(1, HEADS, SEQ, DIM // HEADS)
    extra = torch.randn(SEQ, SEQ)
    gm = torch.export.export(_Masks(), (x, extra), strict=False).module()
    changed = masks_as_in_training(gm, [x, extra.detach().requires_grad_(extra_requires_grad)])
    assert changed == 1 + extra_requires_grad
    routed = [n for n in gm.graph.nodes if n.target is as_in_training]
    assert len(routed) == changed
    ref = _Masks()(x, extra)
    torch.testing.assert_close(gm(x, extra), ref, rtol=0, atol=0)


def test_the_alias_requires_grad_only_without_grad_and_shares_the_storage():
    mask = torch.randn(3, 3)
    assert as_in_training(mask) is mask  # grad enabled: as it is
    with torch.no_grad():
        alias = as_in_training(mask)
    assert alias.requires_grad and alias.is_leaf
    assert alias.data_ptr() == mask.data_ptr()
    assert not mask.requires_grad
