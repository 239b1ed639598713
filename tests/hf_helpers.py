"""Tiny HuggingFace models (random initialisation, nothing downloaded) and reference steps."""

from __future__ import annotations

from typing import Any

import pytorch_helpers  # noqa: F401  (one thread)
import torch
import transformers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)
from transformers.cache_utils import Cache

transformers.logging.set_verbosity_error()
BATCH, SEQ, VOCAB = 2, 16, 100


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def gpt2(**overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """2 layers, hidden 32; dropout 0.1 everywhere (the GPT-2 default)."""
    torch.manual_seed(0)
    options = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                   bos_token_id=0, eos_token_id=0)
    config = GPT2Config(**{**options, **overrides})
    ids = _ids(1)
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def llama(**overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """2 layers, hidden 32, rotary embeddings, pre-norm (RMSNorm)."""
    torch.manual_seed(0)
    options = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                   num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                   max_position_embeddings=64)
    config = LlamaConfig(**{**options, **overrides})
    ids = _ids(2)
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def bert(**overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """2 layers, hidden 32, post-norm, masked-LM head."""
    torch.manual_seed(0)
    options = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                   num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    config = BertConfig(**{**options, **overrides})
    ids = _ids(3)
    return BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def vit(**overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """2 layers, hidden 32, 32x32 images in 8x8 patches, 10 classes."""
    torch.manual_seed(0)
    options = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                   num_attention_heads=2, image_size=32, patch_size=8, num_labels=10)
    config = ViTConfig(**{**options, **overrides})
    g = torch.Generator().manual_seed(4)
    return ViTForImageClassification(config), {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g)}


def resnet(**overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Basic blocks, two stages of two blocks (16 and 32 channels), BatchNorm."""
    torch.manual_seed(0)
    options = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2],
                   layer_type="basic", num_labels=10)
    config = ResNetConfig(**{**options, **overrides})
    g = torch.Generator().manual_seed(5)
    return ResNetForImageClassification(config), {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g)}


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet": resnet}
TRANSFORMER_LAYERS = {"gpt2": 2, "llama": 2, "bert": 2, "vit": 2}


def step(call: Any, owner: torch.nn.Module, kwargs: dict[str, Any], seed: int = 0,
         args: tuple[Any, ...] = ()) -> tuple[Any, list[torch.Tensor | None]]:
    """Output and parameter gradients (in ``owner``'s order) of one training step."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = call(*args, **kwargs)
    out.loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None
             for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return out, grads


def assert_same(got: Any, ref: Any, *, bitwise: bool = True) -> None:
    """Outputs (loss, logits, type, keys) and gradients equal."""
    (out, grads), (ref_out, ref_grads) = got, ref
    assert type(out) is type(ref_out)
    # the wrapper calls with use_cache=False in training: no generation cache in the output
    # (named past_key_values up to transformers 5.23, cache from 5.24: matched by type)
    assert list(out.keys()) == [k for k, v in ref_out.items() if not isinstance(v, Cache)]
    kw = {"rtol": 0, "atol": 0} if bitwise else {}
    torch.testing.assert_close(out.loss, ref_out.loss, **kw)
    torch.testing.assert_close(out.logits, ref_out.logits, **kw)
    assert len(grads) == len(ref_grads)
    for k, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        assert (a is None) == (b is None), f"parameter {k}"
        if a is not None:
            torch.testing.assert_close(a, b, **kw, msg=f"gradient of parameter {k}")
