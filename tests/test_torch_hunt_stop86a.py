"""HuggingFace's overflow guard, deterministic (stop 86; ``docs/pytorch.md``, "Stop 86 (HF's
overflow guard, deterministic)").

DETR's family and Mask2Former end each encoder layer's training forward with ``if not
torch.isfinite(h).all(): h = torch.clamp(h, min=-c, max=c)``, ``c = finfo.max - 1000``.
Two faults: the export with the sample's values gave every ``nn.Parameter`` a real value
of uninitialised memory (torch copies plain tensors only), so the side a guard took
changed from run to run; and the guard was refused as a branch on an intermediate value.
Now the parameters carry their values, and the exact guard (float32, bfloat16: ``c``
rounds to the largest value) is held as an unconditional clamp, whichever side the
sample took; any other guard stays refused.
"""

from __future__ import annotations

import copy
from typing import Any

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
from optmem.pytorch.branches import target_name  # noqa: E402
from optmem.pytorch.extract import _export  # noqa: E402
from optmem.pytorch.overflow_guards import overflow_guards  # noqa: E402

KINDS = hunt_kinds()
SAMPLE = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
BIG = 3e38  # a layer's scale at which a LayerNorm's output overflows float32


class GuardedLayer(nn.Module):
    """A layer ending in HuggingFace's overflow guard; ``gain`` can make it overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h + torch.tanh(self.lin(h))) * self.gain
        if self.training:  # noqa: SIM102 - HF's form
            if not torch.isfinite(h).all():
                clamp_value = torch.finfo(h.dtype).max - 1000
                h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        return h / self.gain


class OtherBound(GuardedLayer):
    """Clamps to half the largest value: not the identity on finite values."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h + torch.tanh(self.lin(h))) * self.gain
        if not torch.isfinite(h).all():
            clamp_value = torch.finfo(h.dtype).max / 2
            h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        return h / self.gain


class OtherRepair(GuardedLayer):
    """Replaces non-finite values instead of clamping."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h + torch.tanh(self.lin(h))) * self.gain
        if not torch.isfinite(h).all():
            h = torch.nan_to_num(h)
        return h / self.gain


class Aliased(GuardedLayer):
    """The exact guard, but another name keeps the unclamped tensor and is read after."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h + torch.tanh(self.lin(h))) * self.gain
        kept = h
        if not torch.isfinite(h).all():
            clamp_value = torch.finfo(h.dtype).max - 1000
            h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        return (h + kept) / self.gain


class GuardedNet(nn.Module):
    """Four guarded layers and a head."""

    def __init__(self, layer: type[GuardedLayer] = GuardedLayer,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(layer() for _ in range(4))
        self.head = nn.Linear(16, 2)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _overflowing(net: nn.Module, layer: int = 1) -> None:
    with torch.no_grad():
        net.layers[layer].gain.fill_(BIG)


def _count(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(n.op == "call_function" and target_name(n) == name for n in gm.graph.nodes)



def _adamw(call: Any, owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(owner.parameters(), lr=1e-2)
    for _ in range(2):
        call(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [t.detach().clone() for t in (*owner.parameters(), *owner.buffers())]



def test_the_sample_values_take_the_same_side_in_every_export() -> None:
    """The parameters' real values were uninitialised memory: 3 or 4 of 4 guards clamped."""
    net = GuardedNet().train()
    for _ in range(3):
        gm = _export(net, (SAMPLE,), {}, None).graph_module
        assert _count(gm, "clamp") == 0  # every value is finite: no guard clamps
        assert _count(gm, "isfinite") == 4


@pytest.mark.parametrize("overflow", [False, True], ids=["finite_sample", "clamping_sample"])
def test_either_side_is_held_as_one_clamp(overflow: bool) -> None:
    """Exported on either side, each guard becomes one clamp and no assertion."""
    net = GuardedNet().train()
    if overflow:
        _overflowing(net)
    gm = _export(net, (SAMPLE,), {}, None).module()
    assert _count(gm, "clamp") == (1 if overflow else 0)  # the side the sample took
    assert overflow_guards(gm) == 4
    # held as optmem's clamp (stop 87: its gradient keeps the finite side's layout)
    assert (_count(gm, "overflow_clamp"), _count(gm, "clamp"), _count(gm, "_assert_scalar"),
            _count(gm, "isfinite")) == (4, 0, 0, 0)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("overflow", [False, True], ids=["finite_sample", "clamping_sample"])
def test_guarded_toy_trains_bitwise(kind: str, overflow: bool) -> None:
    """Refused before; now a step and two AdamW steps equal the model's, on both sides."""
    model = GuardedNet().train()
    if overflow:
        _overflowing(model)
    plain = copy.deepcopy(model)
    wrap, extra = KINDS[kind]
    wrapped = wrap(model, SAMPLE, **HUNT_FIXED, **extra)
    assert_bitwise(square_step(wrapped, model, SAMPLE), square_step(plain, plain, SAMPLE))
    for net in (model, plain):  # the other side at run time
        if overflow:
            net.layers[1].gain.fill_(1.0)
        else:
            _overflowing(net, 2)
    got, ref = square_step(wrapped, model, SAMPLE), square_step(plain, plain, SAMPLE)
    assert_bitwise(got, ref)
    assert_bitwise(_adamw(wrapped, model, SAMPLE), _adamw(plain, plain, SAMPLE))


@pytest.mark.parametrize(("layer", "dtype"), [
    (OtherBound, torch.float32), (OtherRepair, torch.float32), (Aliased, torch.float32),
    (GuardedLayer, torch.float16)], ids=["other_bound", "other_repair", "aliased", "float16"])
def test_other_guards_stay_refused(layer: type[GuardedLayer], dtype: torch.dtype) -> None:
    """Not the exact guard (or float16, where ``c`` clamps finite values): one error."""
    net = GuardedNet(layer, dtype).train()
    with pytest.raises(OptmemInputError, match="intermediate tensor at .*isfinite"):
        op.checkpoint(net, SAMPLE.to(dtype), **HUNT_FIXED)


def _tiny_detr() -> nn.Module:
    return tiny_detr_like(transformers.DetrConfig, transformers.DetrForObjectDetection)



def test_detr_without_labels_wraps_and_steps_bitwise() -> None:
    """Refused at its encoder's guard (modeling_detr.py:643) before; now a step is bitwise."""
    model = _tiny_detr()
    plain = copy.deepcopy(model)
    kwargs = {"pixel_values": torch.randn(2, 3, 32, 32,
                                          generator=torch.Generator().manual_seed(1))}
    wrapped = op.checkpoint(model, kwargs, **HUNT_FIXED)
    got, ref = float_outputs_step(wrapped, model, kwargs), float_outputs_step(plain, plain, kwargs)
    assert_bitwise(got, ref)
    assert sum(g is not None for g in got[1]) > 0.9 * len(got[1])
