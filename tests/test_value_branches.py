"""Forwards that branch on tensor values (``optmem.pytorch.branches``).

Before (until 2026-11-30) every such forward was refused at wrapping: "its forward branches
on the value of a tensor at ..." (ProphetNet's check of its labels, Longformer's and LED's
``if is_global_attn:``). Now a branch on the call's *inputs* is exported with the sample's
side, asserted before any stage runs; a call taking another side gets a plan of its own (or
the model itself runs it, raising its own error on invalid input). A branch on an
intermediate value is still refused, naming the line.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
import optmem.pytorch.wrapper as wrapper_module  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.branches import is_value_assert, is_value_branch_error  # noqa: E402
from optmem.pytorch.extract import extract_program  # noqa: E402

WIDTH, CLASSES = 32, 8


class Branchy(nn.Module):
    """Checks its labels (as HF heads do) and scales by a mask only when one is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> Any:
        if labels.max() >= CLASSES:
            raise ValueError("labels out of range")
        h = torch.tanh(self.lins[0](x))
        if mask.any():
            h = h * mask
        for lin in self.lins[1:]:
            h = torch.tanh(lin(h))
        return nn.functional.cross_entropy(self.head(h), labels)


class MidBranch(Branchy):
    """Branches on an intermediate value: no graph can hold it, so it is refused."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> Any:
        h = torch.tanh(self.lins[0](x))
        if (h > 0.5).any():
            h = h * 2
        for lin in self.lins[1:]:
            h = torch.tanh(lin(h))
        return nn.functional.cross_entropy(self.head(h), labels)


def _call(seed: int = 0, masked: bool = False, labels: int | None = None) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, WIDTH, generator=g)
    y = (torch.randint(0, CLASSES, (16,), generator=g) if labels is None
         else torch.full((16,), labels))
    mask = (torch.rand(16, WIDTH, generator=g) > 0.5).float() if masked else torch.zeros(16, WIDTH)
    return x, y, mask


def _step(call: Any, owner: nn.Module, args: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    owner.zero_grad(set_to_none=True)
    loss = call(*args)
    loss.backward()
    grads = [p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return loss, grads


def _assert_bitwise(got: tuple[Any, list[Any]], ref: tuple[Any, list[Any]]) -> None:
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))


def _wrap(model: nn.Module) -> op.PlannedModule:
    cmodel = op.checkpoint(model, _call(), memory_limit="70%", repeats=1, warmup=0,
                           fast_path=False)
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan), "no re-run"
    return cmodel


def test_a_branch_on_inputs_is_exported_with_the_samples_side_asserted_before_the_stages():
    torch.manual_seed(0)
    model = Branchy()
    ext = extract_program(model, _call())
    assert len(ext.value_branches) == 2
    assert "(`if labels.max() >= CLASSES:`)" in ext.value_branches[0]
    assert "(`if mask.any():`)" in ext.value_branches[1]
    side = ext.side.gm
    assert side is not None and any(is_value_assert(n) for n in side.graph.nodes)
    for stage in ext.stages:  # nothing asserted mid-step
        assert not any(is_value_assert(n) for n in stage.module.gm.graph.nodes)
    # the sample's side runs; the other side is refused before any stage, naming the line
    torch.testing.assert_close(ext.run(*_call(1)), model(*_call(1)), rtol=0, atol=0)
    with pytest.raises(RuntimeError) as err:
        ext.side_inputs(ext.flatten(_call(1, masked=True), {}))
    assert is_value_branch_error(err.value)
    assert "Branchy's forward at test_value_branches.py:" in str(err.value)
    assert "(`if mask.any():`)" in str(err.value)


def _wrapped_and_counted(monkeypatch: Any) -> tuple[nn.Module, Any, list[int]]:
    """A wrapped :class:`Branchy` and the list its later extractions append to."""
    torch.manual_seed(0)
    model = Branchy()
    cmodel = _wrap(model)
    extractions: list[int] = []
    real = wrapper_module.extract_program

    def counted(*args: Any, **kwargs: Any) -> Any:
        extractions.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(wrapper_module, "extract_program", counted)
    return model, cmodel, extractions


def test_a_call_taking_the_other_side_gets_its_own_plan_and_the_models_gradients(monkeypatch):
    model, cmodel, extractions = _wrapped_and_counted(monkeypatch)
    for seed, masked in [(1, False), (2, True), (3, False), (4, True), (5, True)]:
        args = _call(seed, masked=masked)
        _assert_bitwise(_step(cmodel, model, args), _step(model, model, args))
    main = cmodel._main
    assert len(extractions) == 1 and len(main.branches) == 1  # the masked side, once
    assert "branches on input values (the sample's side, checked at every call): " \
           "test_value_branches.py:" in cmodel.summary()
    other = main.branches[0]
    assert other.extraction is not None and other.extraction is not main.extraction
    assert any(o.startswith(("F_ck", "F_none")) for o in other.result.plan)
    assert other.limit is not None  # solved for "70%" of its own chain; its replay fits it
    assert (other.result.peak_memory or 0) * other.result.unit <= other.limit


def test_invalid_labels_raise_the_models_own_error_and_stop_being_extracted(monkeypatch):
    model, cmodel, extractions = _wrapped_and_counted(monkeypatch)
    for _ in range(wrapper_module.MAX_BRANCH_FAILURES + 2):
        with pytest.raises(ValueError, match="labels out of range") as err:
            cmodel(*_call(1, labels=CLASSES))
        assert type(err.value) is ValueError  # the model's, not optmem's
    assert len(extractions) == wrapper_module.MAX_BRANCH_FAILURES
    args = _call(2)  # calls of the sample's side still run the plan
    _assert_bitwise(_step(cmodel, model, args), _step(model, model, args))


def test_copies_keep_the_plans_of_both_sides():
    torch.manual_seed(0)
    model = Branchy()
    cmodel = _wrap(model)
    _step(cmodel, model, _call(1, masked=True))
    twin = copy.deepcopy(cmodel)
    assert len(twin._main.branches) == 1
    for masked in (True, False):
        args = _call(2, masked=masked)
        _assert_bitwise(_step(twin, twin.module, args), _step(twin.module, twin.module, args))


def test_a_branch_on_an_intermediate_value_is_refused_naming_the_line():
    """Its assertion would fail mid-step on the first batch that takes the other side."""
    with pytest.raises(OptmemInputError) as err:
        op.checkpoint(MidBranch(), _call(), memory_limit="70%", repeats=1, warmup=0)
    message = str(err.value)
    assert "MidBranch: its forward branches on the value of an intermediate tensor at " \
           "test_value_branches.py:" in message
    assert "(`if (h > 0.5).any():`)" in message and "\n" not in message


def test_hf_prophetnet_checks_its_labels_and_trains_bitwise():
    """ProphetNet asserts ``torch.all(shifted_input_ids >= 0).item()`` on its labels."""
    transformers = pytest.importorskip("transformers",
                                       reason="the HF tests need transformers (dev extra)")
    from hf_helpers import assert_same, step

    torch.manual_seed(0)
    model = transformers.ProphetNetForConditionalGeneration(transformers.ProphetNetConfig(
        vocab_size=100, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=2,
        num_decoder_attention_heads=2, max_position_embeddings=64, ngram=2, pad_token_id=0,
        decoder_start_token_id=0))
    model.train()
    g = torch.Generator().manual_seed(8)
    kwargs = {"input_ids": torch.randint(0, 100, (2, 16), generator=g),
              "labels": torch.randint(0, 100, (2, 8), generator=g)}
    cmodel = op.checkpoint(model, kwargs, memory_limit="85%", repeats=1, warmup=0,
                           fast_path=False)
    assert cmodel.extraction is not None
    assert any("modeling_prophetnet.py" in b for b in cmodel.extraction.value_branches)
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    assert list(cmodel.state_dict()) == list(model.state_dict())
    got, ref = step(cmodel, model, kwargs, seed=5), step(model, model, kwargs, seed=5)
    assert_same(got, ref, bitwise=False)
    torch.testing.assert_close(got[0].loss, ref[0].loss, rtol=0, atol=0)
    torch.testing.assert_close(got[0].logits, ref[0].logits, rtol=0, atol=0)
    # bitwise but for the word embeddings, tied three ways (encoder, decoder, head): the
    # executor sums their stages' contributions in its own order (docs: "Tied weights")
    for (name, _), a, b in zip(model.named_parameters(), got[1], ref[1], strict=True):
        if name != "prophetnet.word_embeddings.weight":
            assert torch.equal(a, b), name
