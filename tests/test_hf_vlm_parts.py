"""A vision-language model whose vision tower cannot be exported: plan its language model.

Qwen2-VL's vision attention splits its patches by image (``torch.split(t,
lengths.tolist())``), Qwen2.5-VL's vision tower builds its window index from the grid's
values: sizes that ``torch.export`` cannot hold, so the whole model cannot be one graph.
The error names the module where the export failed and the remedy: wrap the language model
alone, on the call the model makes to it (:func:`optmem.pytorch.submodule_sample`); the
vision tower runs eagerly. Before (stop 40) such a sample failed at wrapping: its
``inputs_embeds`` came out of the model's graph and the plain step optmem measures ran its
backward into it.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import assert_same, step  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.memory import measure_training_peak, plan_allowance  # noqa: E402

IMAGE, VIDEO, START = 250, 251, 252
PATCHES = 16  # one image of 4 x 4 patches, merged 2 x 2 into 4 tokens


TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
VISION = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
#: model class, config class, vision config, where the export fails
VLMS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig",
                 dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
                 "model.visual.blocks.0.attn"),  # torch.split(t, lengths.tolist())
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                   dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                        num_heads=2, window_size=56, fullatt_block_indexes=[1]),
                   "model.visual"),  # its window index, built from the grid's values
}


def _vlm(name: str) -> tuple[Any, dict[str, Any]]:
    """A tiny model in training mode and a call with one image and labels."""
    model_cls, config_cls, vision, _ = VLMS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        text_config=TEXT, vision_config={**VISION, **vision},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)
    model = getattr(transformers, model_cls)(config)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (1, 24), generator=g)
    ids[0, 2] = START
    ids[0, 3:3 + PATCHES // 4] = IMAGE
    call = dict(input_ids=ids, pixel_values=torch.randn(PATCHES, 3 * 2 * 14 * 14, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]]), labels=ids.clone(),
                mm_token_type_ids=(ids == IMAGE).int())
    return model, call


@pytest.mark.parametrize("name", sorted(VLMS))
def test_the_whole_model_names_the_vision_part_and_the_remedy(name: str) -> None:
    model, call = _vlm(name)
    with pytest.raises(OptmemInputError) as info:
        op.checkpoint(model, call, memory_limit="60%", repeats=1, warmup=0)
    message = str(info.value)
    assert f"in {VLMS[name][3]!r}" in message
    assert "wrap 'model.language_model' (a " in message
    assert "submodule_sample(model, part, **batch)" in message


@pytest.mark.parametrize("name", sorted(VLMS))
def test_its_language_model_trains_under_a_plan_bitwise(name: str) -> None:
    model, call = _vlm(name)
    keys = list(model.state_dict())
    ref = step(model, model, call, seed=5)
    part = model.model.language_model
    sample = op.submodule_sample(model, part, **call)
    assert sample["inputs_embeds"].requires_grad and sample["inputs_embeds"].is_leaf
    assert tuple(sample["position_ids"].shape) == (3, 1, 24)  # M-RoPE's three rows
    assert all(p.grad is None for p in model.parameters())
    wrapped = op.checkpoint(part, sample, memory_limit="60%", repeats=1, warmup=0,
                            fast_path=False)
    model.model.language_model = wrapped
    assert any(o.startswith("F_ck") for o in wrapped.result.plan), "no re-run"
    limit = int(0.6 * wrapped.chain.store_all_peak())
    assert wrapped.expected_peak_bytes <= limit
    assert list(model.state_dict()) == keys
    got = step(model, model, call, seed=5)
    assert_same(got, ref)  # the vision tower's gradients too: they flow through the plan
    assert got[1][0] is not None
    # the language model's real peak, measured on the sample, within the plan's allowance
    allowance = plan_allowance(wrapped.chain, wrapped.result.plan, list(wrapped.stages))
    real = measure_training_peak(lambda: wrapped(**sample).last_hidden_state.sum().backward(),
                                 part, list(sample.values()))
    model.zero_grad(set_to_none=True)
    assert real <= limit + allowance, (real, limit, allowance)
