"""The one-liner on a LoRA fine-tune (``peft``): frozen base weights, trained adapters.

Fine-tuning with LoRA is how most users train a large HF model on one GPU, so the wrapped
``PeftModel`` must train as the model does: the adapters' gradients bitwise, no gradient
for a frozen weight, its state-dict keys (what ``save_pretrained`` writes), and a real
activation peak within the limit (frozen linears save less than trained ones, which the
profile measures rather than assumes).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")
peft = pytest.importorskip("peft", reason="the LoRA tests need peft (dev extra)")

from hf_helpers import check_one_liner  # noqa: E402

import optmem.pytorch as op  # noqa: E402

VOCAB = 100


def _lora_llama() -> tuple[Any, dict[str, Any]]:
    """A 4-layer Llama with rank-4 adapters on its query and value projections."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64))
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    model.train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    return model, {"input_ids": ids, "labels": ids}


def test_a_lora_fine_tune_trains_its_adapters_bitwise_within_the_limit() -> None:
    model, kwargs = _lora_llama()
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    _, got, _ = check_one_liner(model, kwargs)  # dropout on the adapters' input included
    frozen = [g for (_, p), g in zip(model.named_parameters(), got[1], strict=True)
              if not p.requires_grad]
    assert frozen and all(g is None for g in frozen)  # no gradient for a frozen weight


def test_adapters_trained_through_the_wrapper_save_and_load_with_peft(tmp_path) -> None:
    """Two SGD steps through the wrapper, then ``save_pretrained`` on the wrapper (the
    ``PeftModel``'s own, reached through it): the adapters loaded into a fresh base model
    are the trained ones, and they changed."""
    model, kwargs = _lora_llama()
    before = {k: v.clone() for k, v in model.state_dict().items() if "lora_B" in k}
    cmodel = op.checkpoint(model, kwargs, memory_limit="60%", repeats=1, warmup=0,
                           fast_path=False)
    optimizer = torch.optim.SGD([p for p in cmodel.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        cmodel(**kwargs).loss.backward()
        optimizer.step()
    cmodel.save_pretrained(str(tmp_path))
    fresh, _ = _lora_llama()
    loaded = peft.PeftModel.from_pretrained(fresh.get_base_model(), str(tmp_path))
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    restored = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert trained.keys() == restored.keys() and len(trained) == 16
    assert all(torch.equal(trained[k], restored[k]) for k in trained)
    assert not any(torch.equal(before[k], trained[k]) for k in before)
