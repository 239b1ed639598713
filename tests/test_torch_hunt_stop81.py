"""Hunt of the torch bridge on models that carry values beside the boundaries (stop 81).

Tiny T5, BART, Whisper, ViT, HF ResNet, Mixtral (``output_router_logits=True``) and a
``peft`` LoRA GPT-2 under the three one-liners (``docs/pytorch.md``, "Stop 81") found two
ways a wrapped module did not behave like its model:

* ``torch.compile(cmodel, backend="aot_eager")`` of Whisper failed in the backward with
  "view size is not compatible with input tensor's size and stride": a stage whose input
  is laid out as a permuted tensor (Whisper's convolutions' output, transposed) compiled
  to a backward torch's AOT autograd cannot run (torch 2.13; the plain model, compiled
  whole, never feeds such a value to a graph). Such a call now runs the stage uncompiled.
* ``peft.get_peft_model(cmodel, config)`` (LoRA applied to the wrapper) froze every
  parameter, adapters included, in silence (the backward then raised "element 0 of
  tensors does not require grad"): peft matches the modules' names, which the wrapper
  gives under ``_checkpoint_wrapped_module.``, with the parameters', which it gives under
  the model's. It is now one ``OptmemInputError`` naming the order that works.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")
peft = pytest.importorskip("peft", reason="the LoRA tests need peft (dev extra)")

from hf_helpers import gpt2, step  # noqa: E402
from pytorch_helpers import HUNT_FIXED  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.graphcut import permuted_grad_input  # noqa: E402

# stage times that do not depend on the machine: the same plan on every run
FIXED = HUNT_FIXED
KINDS = {"checkpoint": (op.checkpoint, {}), "offload": (op.offload, {"bandwidth": "1MB/s"}),
         "remat_offload": (op.remat_offload, {"bandwidth": "1MB/s"})}


class _Block(nn.Module):
    """Pre-norm MLP block with a residual and dropout: ``x + dropout(fc(norm(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.dropout(self.fc(self.norm(x)), 0.1, self.training)


class _Speech(nn.Module):
    """Whisper's encoder in miniature: a convolution whose output is transposed (a permuted
    layout, not copied), a position embedding, blocks, a head and a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(12, 16) * 0.1)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.conv(features)).permute(0, 2, 1) + self.pos
        x = nn.functional.dropout(x, 0.1, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _compiled_step(call: Any, owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = call(x)
    loss.backward()
    out = [loss.detach(), *(p.grad.clone() for p in owner.parameters())]
    owner.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_compiled_stage_with_a_permuted_input_trains_as_the_model(kind):
    """``torch.compile(cmodel, backend="aot_eager")``: loss and every gradient the plain
    model's compiled, bitwise (its dropout masks too). Before: the backward of the stage
    whose input is the transposed convolution output raised "view size is not compatible
    with input tensor's size and stride" (every one-liner; Whisper the same)."""
    torch.manual_seed(0)
    model = _Speech()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(1))
    one_liner, options = KINDS[kind]
    cmodel = one_liner(model, x, **options, **FIXED)
    assert len(cmodel.stages) > 3
    got = _compiled_step(torch.compile(cmodel, backend="aot_eager"), model, x)
    ref = _compiled_step(torch.compile(plain, backend="aot_eager"), plain, x)
    eager = _compiled_step(plain, plain, x)
    for k, (a, b, c) in enumerate(zip(got, ref, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"item {k}")
        torch.testing.assert_close(a, c, rtol=0, atol=0, msg=f"item {k} (eager)")


def test_permuted_inputs_are_told_from_contiguous_and_channels_last_ones():
    """Only a tensor that requires grad in a layout neither contiguous nor channels-last."""
    t = torch.zeros(2, 3, 4, 5, requires_grad=True)
    assert not permuted_grad_input((t, [t.detach().permute(0, 2, 1, 3)]))
    assert not permuted_grad_input(t.contiguous(memory_format=torch.channels_last))
    assert permuted_grad_input({"x": t.permute(0, 2, 1, 3)})
    assert permuted_grad_input(t[:, :, :, 0].transpose(1, 2))


def _lora(model: nn.Module) -> Any:
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_peft_applied_to_the_wrapper_is_one_error(kind):
    """``get_peft_model(cmodel, config)``: one ``OptmemInputError`` naming the order that
    works. Before: peft froze every parameter, its adapters too, and the backward raised
    torch's "element 0 of tensors does not require grad"."""
    model, kwargs = gpt2()
    one_liner, options = KINDS[kind]
    cmodel = one_liner(model, kwargs, **options, **FIXED)
    with pytest.raises(OptmemInputError, match=rf"peft was applied to the optmem wrapper "
                       rf"\({type(cmodel).__name__}\).*op\.{kind}\(peft\.get_peft_model"):
        _lora(cmodel)


def test_lora_applied_before_or_after_wrapping_trains_as_the_peft_model():
    """The orders that work: LoRA applied to the model, then wrapped; or LoRA injected into
    the wrapped model (``get_peft_model(cmodel.module, ...)``), the wrapper extracting it
    again. Loss, logits and every gradient the PeftModel's (its ``use_cache=False`` call),
    bitwise; no gradient for a frozen weight."""
    base, kwargs = gpt2()
    plain = _lora(copy.deepcopy(base))
    ref = step(plain, plain, {**kwargs, "use_cache": False}, seed=2)
    after = _lora(copy.deepcopy(base))
    cmodel = op.checkpoint(after, kwargs, **FIXED)
    got_after = step(cmodel, after, kwargs, seed=2)
    before = copy.deepcopy(base)
    cmodel = op.checkpoint(before, kwargs, **FIXED)
    _lora(before)
    got_before = step(cmodel, before, kwargs, seed=2)
    for got in (got_after, got_before):
        torch.testing.assert_close(got[0].loss, ref[0].loss, rtol=0, atol=0)
        torch.testing.assert_close(got[0].logits, ref[0].logits, rtol=0, atol=0)
        assert len(got[1]) == len(ref[1]) and sum(g is not None for g in ref[1]) == 4
        for a, b in zip(got[1], ref[1], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0)
