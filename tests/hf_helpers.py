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
         args: tuple[Any, ...] = (), losses: int = 1) -> tuple[Any, list[torch.Tensor | None]]:
    """Output and parameter gradients (in ``owner``'s order) of one training step.

    ``losses=2``: ``out.loss.backward(retain_graph=True)``, then a second loss on the
    same output (the mean square of the logits) backpropagated.
    """
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = call(*args, **kwargs)
    out.loss.backward(retain_graph=losses > 1)
    if losses > 1:
        out.logits.float().square().mean().backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None
             for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return out, grads


def assert_same(got: Any, ref: Any, *, bitwise: bool = True) -> None:
    """Outputs (type, keys, loss and every tensor: the logits, ...) and gradients equal."""
    (out, grads), (ref_out, ref_grads) = got, ref
    assert type(out) is type(ref_out)
    # the wrapper calls with use_cache=False in training: no generation cache in the output
    # (named past_key_values up to transformers 5.23, cache from 5.24: matched by type)
    assert list(out.keys()) == [k for k, v in ref_out.items() if not isinstance(v, Cache)]
    kw = {"rtol": 0, "atol": 0} if bitwise else {}
    torch.testing.assert_close(out.loss, ref_out.loss, **kw)
    for key, value in out.items():  # the logits, or a time-series model's predictions
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, ref_out[key], **kw, msg=f"output {key}")
    assert len(grads) == len(ref_grads)
    for k, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        assert (a is None) == (b is None), f"parameter {k}"
        if a is not None:
            torch.testing.assert_close(a, b, **kw, msg=f"gradient of parameter {k}")


def check_one_liner(model: torch.nn.Module, kwargs: dict[str, Any], *, bitwise: bool = True,
                    fraction: float = 0.6, time_model: Any = None) -> tuple[Any, Any, Any]:
    """Wrap ``model`` at ``fraction`` of its store-all peak and check one training step.

    Through the executor (``fast_path=False``): exported, a plan that re-runs within the
    limit, the model's state-dict keys, the step equal to the model's (``bitwise`` or to
    rounding), and the real peak within the limit plus the plan's allowance. Returns the
    wrapper and its step and the model's (:func:`step`, seed 5). ``time_model``: the
    profile's stage times (``None``: measured, one repeat, so the plan may follow them).
    """
    import optmem.pytorch as op
    from optmem.pytorch.memory import measure_training_peak, plan_allowance

    cmodel = op.checkpoint(model, kwargs, memory_limit=f"{fraction:.0%}", repeats=1,
                           warmup=0, fast_path=False,  # the executor runs, never the model
                           time_model=time_model)
    limit = int(fraction * cmodel.chain.store_all_peak())
    assert cmodel.extraction is not None and cmodel.extraction.method == "export"
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan), "no re-run"
    assert cmodel.expected_peak_bytes <= limit
    assert list(cmodel.state_dict()) == list(model.state_dict())
    ref = step(model, model, kwargs, seed=5)
    got = step(cmodel, model, kwargs, seed=5)
    assert_same(got, ref, bitwise=bitwise)
    allowance = plan_allowance(cmodel.chain, cmodel.result.plan, list(cmodel.stages))
    real = measure_training_peak(lambda: cmodel(**kwargs).loss.backward(), model,
                                 list(kwargs.values()))
    model.zero_grad(set_to_none=True)
    assert real <= limit + allowance, (real, limit, allowance)
    return cmodel, got, ref


class TokenDataset(torch.utils.data.Dataset):
    """Eight sequences of 16 token ids, their own labels (a ``Trainer`` dataset)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
