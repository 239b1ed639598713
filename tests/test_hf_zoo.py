"""The one-liner on 35 more HuggingFace families (tiny configs, random init, no download).

``test_hf_models.py`` checks the five models of issue 13 in depth (autograd.grad, compile,
autocast, state-dict round trips). This file checks that the front door reaches the families
people train beyond those five: decoder LMs (Qwen2/3, Mistral, Gemma, Gemma2, Phi, Phi-3,
OPT, GPT-NeoX, GPT-J, Falcon, Bloom, Mixtral with its routed experts, GPTBigCode, MPT,
CodeGen, OLMo, Granite, StarCoder2), encoders (RoBERTa, XLM-R, DistilBERT, ELECTRA, ALBERT
with one layer shared by all, Longformer), encoder-decoders (T5, BART, LED, Whisper;
Longformer and LED branch on their attention mask's values, ``optmem.pytorch.branches``),
vision-language models (LLaVA, Gemma 3) and vision models (DeiT, Swin, SegFormer,
MobileViT). Each is wrapped with ``memory_limit="60%"`` (of its profiled store-all peak)
with its default dropout, and one training step through the executor must give the model's
output type and keys, its loss and logits and every parameter gradient: **bitwise** on CPU,
except where noted in :data:`ROUNDING` (the model's own rounding, checked without optmem
below). The state-dict keys are the model's, the plan really recomputes within the limit,
and the real peak of a training step (the exact storage trace of
:func:`~optmem.pytorch.memory.measure_training_peak`) is within the limit plus
:func:`~optmem.pytorch.memory.plan_allowance` (what ``docs/pytorch.md`` says the chain does
not count).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import check_one_liner  # noqa: E402

BATCH, SEQ, VOCAB = 2, 16, 100
T = transformers
DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=64, max_position_embeddings=64)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _lm(model: Callable[[], Any]) -> Callable[[], tuple[Any, dict[str, Any]]]:
    def build() -> tuple[Any, dict[str, Any]]:
        torch.manual_seed(0)
        ids = _ids(7)
        return model(), {"input_ids": ids, "labels": ids}
    return build


def _seq2seq(model: Callable[[], Any]) -> Callable[[], tuple[Any, dict[str, Any]]]:
    def build() -> tuple[Any, dict[str, Any]]:
        torch.manual_seed(0)
        return model(), {"input_ids": _ids(8), "labels": _ids(9)[:, :SEQ // 2].contiguous()}
    return build


def _image(model: Callable[[], Any]) -> Callable[[], tuple[Any, dict[str, Any]]]:
    def build() -> tuple[Any, dict[str, Any]]:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(10)
        return model(), {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
                         "labels": torch.randint(0, 3, (BATCH,), generator=g)}
    return build


def _llava() -> tuple[Any, dict[str, Any]]:
    """LLaVA: a CLIP vision tower, its features scattered into a Llama's embeddings."""
    torch.manual_seed(0)
    vision = T.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32,
                                num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64)
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=vision, text_config=T.LlamaConfig(**DEC, num_key_value_heads=1),
        image_token_id=VOCAB - 1, vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_seq_length=16))
    ids = torch.cat([torch.full((BATCH, 16), VOCAB - 1), _ids(3)], 1)  # 16 image tokens
    labels = ids.clone()
    labels[:, :16] = -100
    g = torch.Generator().manual_seed(10)
    return model, {"input_ids": ids, "labels": labels,
                   "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


def _gemma3_vl() -> tuple[Any, dict[str, Any]]:
    """Gemma 3 with its SigLIP tower: its image mask is built with ``torch.vmap``."""
    torch.manual_seed(0)
    vision = dict(model_type="siglip_vision_model", image_size=32, patch_size=8,
                  hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64)
    text = dict(model_type="gemma3_text", **DEC, num_key_value_heads=1, head_dim=16)
    image = VOCAB - 1
    model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        vision_config=vision, text_config=text, image_token_index=image,
        mm_tokens_per_image=4, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2))
    ids = torch.cat([torch.full((BATCH, 4), image), _ids(3)[:, :12]], 1)
    g = torch.Generator().manual_seed(10)
    return model, {"input_ids": ids, "labels": ids, "token_type_ids": (ids == image).long(),
                   "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


def _whisper() -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(0)
    model = T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32,
        pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
        suppress_tokens=None, begin_suppress_tokens=None))
    g = torch.Generator().manual_seed(10)
    return model, {"input_features": torch.randn(BATCH, 8, 32, generator=g),
                   "labels": _ids(9)[:, :SEQ // 2].contiguous()}


ZOO: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "qwen2": _lm(lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DEC, num_key_value_heads=1))),
    "qwen3": _lm(lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**DEC, num_key_value_heads=1,
                                                          head_dim=16))),
    "mistral": _lm(lambda: T.MistralForCausalLM(T.MistralConfig(**DEC, num_key_value_heads=1))),
    "gemma": _lm(lambda: T.GemmaForCausalLM(T.GemmaConfig(**DEC, num_key_value_heads=1,
                                                          head_dim=16))),
    "mixtral": _lm(lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **DEC, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2))),
    "phi": _lm(lambda: T.PhiForCausalLM(T.PhiConfig(**DEC))),
    "gpt_neox": _lm(lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**DEC))),
    "gptj": _lm(lambda: T.GPTJForCausalLM(T.GPTJConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=64, rotary_dim=8))),
    "opt": _lm(lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32))),
    "falcon": _lm(lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2))),
    "bloom": _lm(lambda: T.BloomForCausalLM(T.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2))),
    "roberta": _lm(lambda: T.RobertaForMaskedLM(T.RobertaConfig(**DEC))),
    "distilbert": _lm(lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=64))),
    "electra": _lm(lambda: T.ElectraForMaskedLM(T.ElectraConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))),
    "t5": _seq2seq(lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0))),
    "bart": _seq2seq(lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, decoder_start_token_id=2,
        pad_token_id=1))),
    "albert": _lm(lambda: T.AlbertForMaskedLM(T.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))),
    "xlm_roberta": _lm(lambda: T.XLMRobertaForMaskedLM(T.XLMRobertaConfig(**DEC))),
    "gpt_bigcode": _lm(lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64))),
    "mpt": _lm(lambda: T.MptForCausalLM(T.MptConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=64))),
    "codegen": _lm(lambda: T.CodeGenForCausalLM(T.CodeGenConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=64, rotary_dim=8))),
    "olmo": _lm(lambda: T.OlmoForCausalLM(T.OlmoConfig(**DEC))),
    "granite": _lm(lambda: T.GraniteForCausalLM(T.GraniteConfig(**DEC))),
    "starcoder2": _lm(lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(
        **DEC, num_key_value_heads=1))),
    "gemma2": _lm(lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**DEC, num_key_value_heads=1,
                                                             head_dim=16))),
    "phi3": _lm(lambda: T.Phi3ForCausalLM(T.Phi3Config(**DEC, pad_token_id=0))),
    # branch on input values (`if is_global_attn:`): exported with the sample's side
    "longformer": _lm(lambda: T.LongformerForMaskedLM(T.LongformerConfig(
        **DEC, attention_window=4))),
    "led": _seq2seq(lambda: T.LEDForConditionalGeneration(T.LEDConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=4, pad_token_id=1,
        decoder_start_token_id=2))),
    # long-lived values carried beside the boundaries (graphcut.long_lived): the encoder's
    # output every decoder layer reads; the image features LLaVA also returns
    "whisper": _whisper,
    "llava": _llava,
    "gemma3_vl": _gemma3_vl,  # and a torch.vmap mask (graphcut.vmap_regions)
    "deit": _image(lambda: T.DeiTForImageClassification(T.DeiTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=3))),
    "swin": _image(lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=3))),
    "segformer": _image(lambda: T.SegformerForImageClassification(T.SegformerConfig(
        num_labels=3, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
        decoder_hidden_size=32))),
    "mobilevit": _image(lambda: T.MobileViTForImageClassification(T.MobileViTConfig(
        image_size=32, num_labels=3, hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]))),
}

def fixed_times(_stage: Any, _input: Any, _output: Any) -> tuple[float, float]:
    """Every stage 1 ms forward and 2 ms backward: the plan follows the sizes alone.

    With measured times (one repeat) the 60 % plan of a chain with near-equal candidates
    followed the machine's timing: MobileViT's took three plans in 13 runs (predicted
    peak 827.5, 899.6 or 906.7 KiB; ``benchmarks/results/hf_zoo.md``, "Stop 84").
    """
    return 1.0, 2.0


#: Families whose outputs and gradients match to float rounding only, and why (measured
#: without optmem: the differences are the model's own under what the executor must do).
ROUNDING: dict[str, str] = {
    "t5": "torch.export's graph of T5 alone (no optmem) gave logits 1.1e-6 from eager's "
          "on some CPUs (own_rounding: excused only where it still does)",
}
# Bitwise since stop 41, were to rounding: ALBERT (one shared layer, four contributions per
# parameter), BART and LED (an embedding tied three ways: encoder, decoder, head), whose
# contributions the executor summed itself, in another association than autograd's (each
# B now hands its contribution to autograd); Swin (its relative-position bias is SDPA's
# mask and requires grad, so F_ck/F_none under no_grad took another CPU kernel: such masks
# now take the training kernel, test_swin_differs_under_no_grad_which_the_plan_undoes).
#: GPT-J and Falcon run attention and MLP in parallel: one stage per layer, so two layers
#: are too few stages for a 60 % plan; they get four.


@functools.cache
def own_rounding(name: str) -> bool:
    """Whether the family's own exported graph (no optmem) rounds away from eager *here*.

    Measured on this machine, each run: whether torch.export's graph of the model alone
    gives other logits than eager (they must still be close). The difference depends on
    the CPU's kernels, not on optmem: T5 differed by 1.1e-6 on the machine of stop 41 and
    is bitwise on the one of stop 60 (same torch, transformers 5.20-5.25), where the fixed
    expectation "differs" failed CI. Where the model's own graph is bitwise, the family
    gets the bitwise check.
    """
    model, kwargs = ZOO[name]()
    model.train()
    exported = torch.export.export(model, (), kwargs={**kwargs, "use_cache": False},
                                   strict=False).module()
    torch.manual_seed(5)
    eager = model(**kwargs).logits
    torch.manual_seed(5)
    graph = exported(**kwargs, use_cache=False)["logits"]
    torch.testing.assert_close(eager, graph)
    return not torch.equal(eager, graph)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_one_liner_reaches_the_family(name: str) -> None:
    bitwise = name not in ROUNDING or not own_rounding(name)
    model, kwargs = ZOO[name]()
    model.train()
    check_one_liner(model, kwargs, bitwise=bitwise, time_model=fixed_times)


def test_the_rounding_exceptions_are_the_models_own() -> None:
    """Each :data:`ROUNDING` entry is justified by the model alone (no optmem involved).

    Its own exported graph is close to eager (and, where it is not bitwise on this
    machine, :func:`own_rounding` grants the family the rounding); no other family is
    excused.
    """
    assert set(ROUNDING) == {"t5"}
    for name in ROUNDING:
        own_rounding(name)  # asserts the model's own graph is close to eager


def test_swin_differs_under_no_grad_which_the_plan_undoes() -> None:
    """Swin's own forward under ``no_grad`` (where ``F_ck``/``F_none`` run) differs from its
    forward with grad (its mask, a learned bias, takes another CPU SDPA kernel), so the
    bitwise zoo check of Swin above depends on ``attention.masks_as_in_training``."""
    model, kwargs = ZOO["swin"]()
    model.train()
    torch.manual_seed(5)
    with_grad = model(**kwargs).logits
    with torch.no_grad():
        torch.manual_seed(5)
        without = model(**kwargs).logits
    assert not torch.equal(with_grad, without)
    torch.testing.assert_close(with_grad, without)
