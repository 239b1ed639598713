"""Stop 87's census of vision, speech and multimodal HF families no sweep had tried.

Tiny configs (random init, nothing downloaded), transformers 5.25, one training step under
``op.checkpoint`` / ``op.offload`` / ``op.remat_offload`` against a deep copy, bitwise
(``docs/pytorch.md``, *Stop 87 (census: vision, speech, multimodal)*). The one defect found
is in a refusal's words: CLIPSeg (``CLIPSegForImageSegmentation``) returns every hidden state
of its frozen vision tower whatever its arguments, so its graph has no cut point; the
message advised calling it "without such outputs", which no argument does, and named no
other way out. It now names the outputs computed early and the two routes that work (a
module returning only the loss and logits, a part wrapped alone), both checked here.
A silent difference too: HF ColPali (PaliGemma's config sets
``use_bidirectional_attention=True``, so its Gemma attention says ``is_causal = False``)
attends over the whole sequence in eager mode when the batch has no padding, while the
exported graph held a causal mask, which the mask elision turned into ``is_causal=True``:
embeddings 0.085 off, in silence (PaliGemma itself without ``token_type_ids``: logits
0.045 off). The elision now follows the attention module's ``is_causal`` as HF's eager
call does.
The other tests pin representative new families: a Wav2Vec2-Conformer with rotary
embeddings (CTC loss), Splinter (question answering), MobileViTV2 (classification) and
Qwen3-VL's language model with its DeepStack visual features (the refusal's advice).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import assert_same, step  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

T = transformers
B = 2
FIXED: dict[str, Any] = {"fast_path": False, "repeats": 1, "warmup": 0,
                         "time_model": lambda *_: (1.0, 2.0)}
WRAPS: dict[str, Callable[..., Any]] = {
    "checkpoint": lambda m, x, lim: op.checkpoint(m, x, memory_limit=lim, **FIXED),
    "offload": lambda m, x, lim: op.offload(m, x, memory_limit=lim, bandwidth="1MB/s",
                                            **FIXED),
    "remat_offload": lambda m, x, lim: op.remat_offload(m, x, memory_limit=lim,
                                                        bandwidth="1MB/s", **FIXED),
}
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _clipseg() -> tuple[Any, dict[str, Any]]:
    """Four vision layers (two extracted for the decoder), two text layers, BCE loss."""
    torch.manual_seed(0)
    config = T.CLIPSegConfig(
        text_config=dict(vocab_size=100, max_position_embeddings=16, **VIT),
        vision_config=dict(image_size=32, patch_size=8, **{**VIT, "num_hidden_layers": 4}),
        projection_dim=16, extract_layers=[1, 3], reduce_dim=16,
        decoder_num_attention_heads=2, decoder_intermediate_size=32)
    return T.CLIPSegForImageSegmentation(config).train(), {
        "input_ids": torch.randint(0, 100, (B, 16), generator=_g(12)),
        "pixel_values": torch.randn(B, 3, 32, 32, generator=_g(10)),
        "labels": torch.rand(B, 32, 32, generator=_g(3))}


class LossAndLogits(torch.nn.Module):
    """What the refusal advises: a module returning only what the step needs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(**batch)
        return out.loss, out.logits


def test_clipseg_refusal_names_the_early_outputs_and_the_ways_out() -> None:
    """main: "Call it without such outputs" and nothing about a part or a smaller output."""
    model, batch = _clipseg()
    with pytest.raises(OptmemInputError, match="no cut point") as info:
        op.checkpoint(model, batch, memory_limit="60%", **FIXED)
    message = str(info.value)
    assert "an output computed early, such as hidden states it returns" in message
    assert "returns only what the step needs" in message
    assert "submodule_sample(model, part, **batch)" in message


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("wrap", ["checkpoint", "offload"])
def test_clipseg_routes_of_the_refusal_train_bitwise(wrap: str) -> None:
    """Both routes the message names: the loss and logits module, and the decoder wrapped
    alone on the call the model makes to it (``submodule_sample``)."""
    model, batch = _clipseg()
    plain = copy.deepcopy(model)
    torch.manual_seed(5)
    ref_loss, ref_logits = LossAndLogits(plain)(**batch)
    ref_loss.backward()
    ref = _grads(plain)

    wrapped = WRAPS[wrap](LossAndLogits(model), batch, "85%")
    assert len(wrapped.stages) > 1
    torch.manual_seed(5)
    loss, logits = wrapped(**batch)
    loss.backward()
    assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits)
    got = _grads(model)
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(got, ref, strict=True))

    other = copy.deepcopy(plain)
    sample = op.submodule_sample(other, other.decoder, **batch)
    other.decoder = WRAPS[wrap](other.decoder, sample, "60%")
    assert_same(step(other, other, batch, seed=5), step(plain, plain, batch, seed=5))


def _conformer() -> tuple[Any, dict[str, Any]]:
    """Wav2Vec2-Conformer with rotary position embeddings, CTC loss."""
    torch.manual_seed(0)
    config = T.Wav2Vec2ConformerConfig(
        **VIT, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32,
        layerdrop=0.0, mask_time_prob=0.0, conv_depthwise_kernel_size=3,
        position_embeddings_type="rotary")
    return T.Wav2Vec2ConformerForCTC(config), {
        "input_values": torch.randn(B, 1600, generator=_g(10)),
        "labels": torch.randint(1, 20, (B, 5), generator=_g(11))}


def _splinter() -> tuple[Any, dict[str, Any]]:
    """Splinter's question-answering head (dropout 0.1), start and end positions."""
    torch.manual_seed(0)
    config = T.SplinterConfig(vocab_size=100, max_position_embeddings=64, **VIT,
                              question_token_id=99)
    ids = torch.randint(0, 99, (B, 16), generator=_g(12))
    ids[:, 3] = 99
    return T.SplinterForQuestionAnswering(config), {
        "input_ids": ids, "start_positions": torch.tensor([5, 6]),
        "end_positions": torch.tensor([7, 9])}


def _mobilevitv2() -> tuple[Any, dict[str, Any]]:
    """MobileViTV2 (separable attention, BatchNorm) with its classification loss."""
    torch.manual_seed(0)
    config = T.MobileViTV2Config(image_size=64, width_multiplier=0.25,
                                 n_attn_blocks=[1, 1, 1], num_labels=3, ffn_dropout=0.1)
    return T.MobileViTV2ForImageClassification(config), {
        "pixel_values": torch.randn(B, 3, 64, 64, generator=_g(10)),
        "labels": torch.randint(0, 3, (B,), generator=_g(11))}


FAMILIES = {"wav2vec2_conformer_rotary": _conformer, "splinter": _splinter,
            "mobilevitv2": _mobilevitv2}
#: one one-liner or two per family (the census ran all three on each; MobileViTV2's
#: remat_offload solve alone takes about two minutes, left out)
CASES = [("wav2vec2_conformer_rotary", "checkpoint"),
         ("wav2vec2_conformer_rotary", "remat_offload"), ("splinter", "offload"),
         ("mobilevitv2", "offload")]


@pytest.mark.parametrize(("family", "wrap"), CASES)
def test_new_family_steps_bitwise_at_60_percent(family: str, wrap: str) -> None:
    model, batch = FAMILIES[family]()
    model.train()
    plain = copy.deepcopy(model)
    wrapped = WRAPS[wrap](model, batch, "60%")
    assert wrapped.expected_peak_bytes <= int(0.6 * wrapped.chain.store_all_peak())
    assert_same(step(wrapped, model, batch, seed=5), step(plain, plain, batch, seed=5))


def _qwen3_vl() -> tuple[Any, dict[str, Any]]:
    """One image of 4 x 4 patches (merged to 4 tokens), a DeepStack layer, M-RoPE."""
    torch.manual_seed(0)
    image, video, start, end = 250, 251, 252, 253
    config = T.Qwen3VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=16, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end)
    g = _g(1)
    ids = torch.randint(0, 200, (1, 24), generator=g)
    ids[0, 2], ids[0, 3:7], ids[0, 7] = start, image, end
    return T.Qwen3VLForConditionalGeneration(config).train(), {
        "input_ids": ids, "pixel_values": torch.randn(16, 3 * 2 * 16 * 16, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]), "labels": ids.clone(),
        "mm_token_type_ids": (ids == image).int()}


@pytest.mark.parametrize("wrap", ["checkpoint"])
def test_qwen3_vl_language_model_with_deepstack_features_as_advised(wrap: str) -> None:
    """The whole model is refused (its vision attention splits by ``lengths.tolist()``);
    the advice, its language model wrapped alone, receives the DeepStack visual features
    (a list of tensors from the vision tower) and the visual mask: bitwise, the vision
    tower's gradients through them included."""
    model, batch = _qwen3_vl()
    with pytest.raises(OptmemInputError, match="wrap 'model.language_model'"):
        op.checkpoint(model, batch, memory_limit="60%", **FIXED)
    plain = copy.deepcopy(model)
    part = model.model.language_model
    sample = op.submodule_sample(model, part, **batch)
    assert len(sample["deepstack_visual_embeds"]) == 1
    model.model.language_model = WRAPS[wrap](part, sample, "85%")
    got, ref = step(model, model, batch, seed=5), step(plain, plain, batch, seed=5)
    assert_same(got, ref)
    visual = [k for k, (n, _) in enumerate(model.named_parameters()) if "visual" in n]
    assert visual and all(got[1][k] is not None for k in visual)


def _paligemma_config() -> Any:
    """A tiny PaliGemma (SigLIP + Gemma), its default ``use_bidirectional_attention``."""
    return T.PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8,
                           **VIT),
        text_config=dict(model_type="gemma", vocab_size=100, hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, head_dim=16),
        image_token_index=99, projection_dim=32)


def _image_and_text() -> dict[str, Any]:
    """16 image tokens and 8 text tokens, no ``attention_mask``, no ``token_type_ids``."""
    ids = torch.cat([torch.full((B, 16), 99),
                     torch.randint(0, 99, (B, 8), generator=_g(12))], 1)
    return {"input_ids": ids, "pixel_values": torch.randn(B, 3, 32, 32, generator=_g(10))}


def _colpali() -> tuple[Any, dict[str, Any]]:
    """ColPali on the tiny PaliGemma."""
    torch.manual_seed(0)
    model = T.ColPaliForRetrieval(T.ColPaliConfig(vlm_config=_paligemma_config(),
                                                  embedding_dim=16))
    return model.train(), _image_and_text()


def test_paligemma_without_token_type_ids_steps_bitwise() -> None:
    """The same cause in PaliGemma itself, called with labels but without
    ``token_type_ids`` (which build an explicit prefix mask, bitwise before too). main:
    logits 0.045 off the plain model's."""
    torch.manual_seed(0)
    model = T.PaliGemmaForConditionalGeneration(_paligemma_config()).train()
    batch = _image_and_text()
    labels = batch["input_ids"].clone()
    labels[:, :16] = -100
    batch["labels"] = labels
    plain = copy.deepcopy(model)
    wrapped = WRAPS["remat_offload"](model, batch, "60%")
    assert_same(step(wrapped, model, batch, seed=5), step(plain, plain, batch, seed=5))


def test_colpali_attends_like_its_eager_call() -> None:
    """main: embeddings 0.085 off the plain model's (causal where eager is bidirectional)."""
    model, batch = _colpali()
    assert model.config.vlm_config.text_config.use_bidirectional_attention
    plain = copy.deepcopy(model)
    wrapped = WRAPS["checkpoint"](model, batch, "60%")
    torch.manual_seed(5)
    ref = plain(**batch).embeddings
    ref.square().mean().backward()
    torch.manual_seed(5)
    got = wrapped(**batch).embeddings
    got.square().mean().backward()
    assert torch.equal(got, ref)
    assert all(torch.equal(p.grad, q.grad) for p, q in
               zip(model.parameters(), plain.parameters(), strict=True) if q.grad is not None)
