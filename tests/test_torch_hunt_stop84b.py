"""Hunt of the torch bridge on PEFT adapter methods and the RLHF patterns built on them
(stop 84; ``docs/pytorch.md``, "Stop 84 (PEFT adapters)").

* A backbone wrapped inside a ``PeftModel`` (``pm.base_model.model.transformer =
  op.checkpoint(...)``) holds PEFT's tuner layers but not the ``LoraModel``, whose public
  ``active_adapter`` the whole-model wrapper records. The layers keep the active adapter and
  the disabled flag in private attributes (``_active_adapter``, ``_disable_adapters``),
  which the wrapper did not check: ``set_adapter("b")`` (or ``disable_adapter()``) without
  a change of which parameters require grad kept computing with the old adapter, in
  silence. They are part of the wrapper's state now, as the training modes are
  (``wrapper._adapter_state``): a state met before reuses its graph, so the DPO pattern
  (a reference call under ``disable_adapter()`` and ``no_grad`` at every step) extracts
  nothing again.
* Prefix tuning passes its prefix into the model as ``past_key_values`` (a
  ``DynamicCache``): a wrapped backbone was refused with torch.export's and fx's raw errors,
  a wrapped Llama ``PeftModel`` (which returns the cache it is given) with advice to
  register ``DynamicCache`` as a pytree. Now one error each saying what works.
* LoHa and LoKr layers draw ``torch.rand(1)`` at every call in training: refused with the
  generic advice to pass an ``nn.Sequential`` of blocks (which draw it too); now one error
  naming the layer and LoRA.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers", reason="the HF tests need transformers")
peft = pytest.importorskip("peft", reason="the PEFT tests need peft (dev extra)")

from hf_helpers import gpt2, llama  # noqa: E402
from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402

import optmem.pytorch as op  # noqa: E402
import optmem.pytorch.extract as extract  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

FIXED = HUNT_FIXED
KINDS = hunt_kinds()


def _two_adapters() -> tuple[Any, dict[str, Any]]:
    """LoRA GPT-2 with adapters ``default`` and ``b`` (non-zero ``lora_B``), both trainable."""
    model, sample = gpt2()
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                    lora_dropout=0.1))
    pm.add_adapter("b", peft.LoraConfig(r=2, target_modules=["c_attn"]))
    torch.manual_seed(1)
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    _all_adapters_trainable(pm)
    return pm.train(), sample


def _all_adapters_trainable(pm: Any) -> None:
    for name, p in pm.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)


def _steps(pm: Any, sample: dict[str, Any]) -> list[torch.Tensor]:
    """Loss and adapter gradients with ``default``, then ``b``, then both, then ``default``
    active (every adapter trainable throughout), and the logits with adapters disabled."""
    out: list[torch.Tensor] = []
    for active in ("default", "b", ["default", "b"], "default"):
        pm.base_model.set_adapter(active)
        _all_adapters_trainable(pm)  # the same parameters require grad at every step
        pm.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = pm(**sample).loss
        loss.backward()
        out += [loss.detach(), *(p.grad for p in pm.parameters() if p.grad is not None)]
    with pm.disable_adapter():  # adapters frozen inside: only the layer norms train
        for name, p in pm.named_parameters():
            p.requires_grad_("ln_" in name)
        torch.manual_seed(0)
        out.append(pm(**sample).logits.detach())
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_wrapped_backbone_follows_the_active_adapter(kind: str) -> None:
    """``set_adapter`` and ``disable_adapter`` on a ``PeftModel`` whose backbone is wrapped:
    the plain ``PeftModel``'s losses, gradients and logits, bitwise (main: the second step
    still used adapter ``default``, loss 6.3e-3 apart, and the disabled call kept them)."""
    pm, sample = _two_adapters()
    expected = _steps(pm, sample)
    pm, sample = _two_adapters()
    wrap, extra = KINDS[kind]
    inner = pm.get_base_model()
    inner.transformer = wrap(inner.transformer, {"input_ids": sample["input_ids"]},
                             **FIXED, **extra)
    got = _steps(pm, sample)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_prefix_tuning_is_refused_where_no_graph_takes_its_cache() -> None:
    """A backbone inside a prefix-tuned ``PeftModel`` is called with a ``DynamicCache``;
    a prefix-tuned Llama returns it: one error each naming the cache and what works (main:
    torch.export's "Unsupported input type" and fx's errors; "register it before
    wrapping, torch.export.register_dataclass(DynamicCache)")."""
    config = peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM")
    model, sample = gpt2()
    pm = peft.get_peft_model(model, config).train()
    inner = pm.get_base_model()
    inner.transformer = op.checkpoint(inner.transformer, {"input_ids": sample["input_ids"]},
                                      **FIXED)
    with pytest.raises(OptmemInputError, match=r"generation cache \(DynamicCache, past_key"
                       r"_values\) in training.*prefix tuning.*wrap the whole PeftModel"):
        pm(**sample)
    model, sample = llama()
    pm = peft.get_peft_model(model, config).train()
    with pytest.raises(OptmemInputError, match=r"returns a generation cache \(DynamicCache\)"
                       r" although the wrapper calls it with use_cache=False.*prompt tuning"):
        op.checkpoint(pm, sample, **FIXED)


@pytest.mark.parametrize("config", ["LoHaConfig", "LoKrConfig"])
def test_loha_and_lokr_are_refused_naming_the_layer(config: str) -> None:
    """Main: "branches on the value of an intermediate tensor ... pass an nn.Sequential of
    its blocks", whose blocks draw the same ``torch.rand(1)``."""
    model, sample = llama()
    pm = peft.get_peft_model(model, getattr(peft, config)(r=2, target_modules=["q_proj"]))
    with pytest.raises(OptmemInputError, match=r"layers\.0\.self_attn\.q_proj is a PEFT "
                       r"LyCORIS adapter layer.*torch\.rand\(1\).*use LoRA"):
        op.checkpoint(pm.train(), sample, **FIXED)


def _dpo(pm: Any, call: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Three DPO steps by hand: reference log-probs with the adapters disabled under
    ``no_grad``, the policy's with them, chosen ``ids`` against rejected ``ids.flip(1)``."""
    def logp(y: torch.Tensor) -> torch.Tensor:
        logits = call(input_ids=y).logits[:, :-1]
        return logits.log_softmax(-1).gather(-1, y[:, 1:, None]).squeeze(-1).sum(-1)

    pair = (ids, ids.flip(1))
    optimizer = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    out: list[torch.Tensor] = []
    for seed in range(3):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with torch.no_grad(), pm.disable_adapter():
            ref = [logp(y) for y in pair]
        chosen, rejected = (logp(y) - r for y, r in zip(pair, ref, strict=True))
        loss = -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)).mean()
        loss.backward()
        optimizer.step()
        out += [loss.detach(), *(p.detach().clone() for p in pm.parameters()
                                 if p.requires_grad)]
    return out


def test_a_dpo_loop_through_a_wrapped_peft_model_extracts_nothing_again(monkeypatch) -> None:
    """The plain ``PeftModel``'s DPO losses and adapters, bitwise, and no extraction after
    wrapping: the disabled flag toggled at every step is a state the wrapper has met (a
    first version of the fix recorded it as an attribute, and every step extracted)."""
    model, sample = gpt2()
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                    lora_dropout=0.1)).train()
    plain = copy.deepcopy(pm)
    ids = sample["input_ids"]
    cmodel = op.checkpoint(pm, {"input_ids": ids}, **FIXED)
    calls: list[int] = []
    original = extract._extract_program
    monkeypatch.setattr(extract, "_extract_program",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    got = _dpo(pm, cmodel, ids)
    assert not calls
    for a, b in zip(got, _dpo(plain, plain, ids), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
