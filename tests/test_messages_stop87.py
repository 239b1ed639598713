"""Stop 87's refusal words: four refusals that named the wrong obstacle.

Each refusal was right (one ``OptmemInputError``), its words misled (``docs/pytorch.md``,
*Stop 87 (refusal words)*): HF OmniASR branches on a ``torch.rand`` draw whatever its
``layerdrop`` (0 too), and was told nothing of it; Pixtral through LLaVA splits its patches
by the image sizes, which none of the examples described; Kolibri 1.1's sizes come from the
attention mask, not "from step to step"; HF UDOP's labels assert reached optmem in torch
2.13's ``Caused by: (file:line in fn)`` form, which was not parsed, so no line was named.
A toy reproduces OmniASR's draw; the three HF models run tiny (random init).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.extract import data_dependent_branch  # noqa: E402

FIXED = {"fast_path": False, "repeats": 1, "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}


def _refusal(model: nn.Module, sample: dict[str, torch.Tensor]) -> str:
    with pytest.raises(OptmemInputError) as err:
        op.checkpoint(model, sample, "60%", **FIXED)
    return str(err.value)


class _DrawsWithTorch(nn.Module):
    """OmniASR's LayerDrop: ``torch.rand([])`` for every layer, compared with ``layerdrop``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(layerdrop=0.0)
        self.layerdrop = 0.0
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = torch.tanh(layer(x))
        return x.sum()


def test_a_torch_draw_made_whatever_layerdrop_says_only_code_helps() -> None:
    """Before: "a value computed inside the forward (a router's choice, LayerDrop's random
    draw, ...)" and "Instead, pass an nn.Sequential ...": nothing said that no setting
    of ``layerdrop`` helps."""
    torch.manual_seed(0)
    message = _refusal(_DrawsWithTorch().train(), {"x": torch.randn(2, 4)})
    assert "a random draw made inside the forward" in message
    assert "No random option of its config is on" in message
    assert "only a change of its code (drawing only when layerdrop > 0) helps" in message
    assert message.count("No random option") == 1


def _pixtral_through_llava() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Pixtral through LLaVA: one 32x32 image (16 patches), its sizes given."""
    T = pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")
    torch.manual_seed(0)
    vision = T.PixtralVisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        head_dim=16,
    )
    text = T.MistralConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        head_dim=16,
    )
    config = T.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=99,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        image_seq_length=16,
        vision_feature_select_strategy="full",
    )
    ids = torch.randint(0, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    ids[0, 2:18] = 99
    return T.LlavaForConditionalGeneration(config).train(), {
        "input_ids": ids,
        "labels": ids,
        "image_sizes": torch.tensor([[32, 32]]),
        "pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
    }


def test_a_split_by_image_sizes_is_among_the_examples() -> None:
    """Before: the examples were a router, LayerDrop and FastSpeech2's durations only."""
    message = _refusal(*_pixtral_through_llava())
    assert "modeling_llava.py" in message
    assert "a size or split read from an input's values" in message
    assert "a vision tower splitting its patches by the image sizes" in message


def test_sizes_from_the_inputs_are_not_said_to_change_every_step() -> None:
    """Kolibri 1.1. Before: "which changes from step to step", for values read from the
    attention mask alone; and "Instead, pass ... instead"."""
    pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import census_hf

    message = _refusal(*census_hf.build("kolibri1_1"))
    assert "modeling_kolibri1_1.py" in message
    assert "may change with the inputs" in message
    assert "step to step" not in message
    assert "Instead, pass" in message and "stage modules instead" not in message


def test_the_caused_by_form_names_the_line() -> None:
    """Before: ``None`` (the form was not parsed), so no line was named."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    import optmem.pytorch.extract as extract

    line = extract.data_dependent_branch.__code__.co_firstlineno
    exc = GuardOnDataDependentSymNode(
        None,
        "Could not guard on data-dependent expression Eq(u0, 1)\n\nconsider using "
        f"...\nCaused by: (optmem/pytorch/extract.py:{line} in data_dependent_branch)\n",
    )
    assert (
        data_dependent_branch(exc)
        == f"extract.py:{line} (`def data_dependent_branch(exc: BaseException) -> str | None:`)"
    )


def test_udop_names_its_labels_assert() -> None:
    """HF UDOP with labels: its ``_shift_right`` assert, reported as ``Caused by:``."""
    transformers = pytest.importorskip(
        "transformers", reason="the HF tests need transformers (dev extra)"
    )
    torch.manual_seed(0)
    config = transformers.UdopConfig(
        vocab_size=100,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        image_size=32,
        patch_size=8,
        relative_bias_args=[{"type": "1d"}],
        max_2d_position_embeddings=64,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    g = torch.Generator().manual_seed(1)
    sample = {
        "input_ids": torch.randint(3, 100, (2, 8), generator=g),
        "bbox": torch.tensor([[0.1, 0.1, 0.3, 0.3]]).repeat(2, 8, 1),
        "pixel_values": torch.randn(2, 3, 32, 32, generator=g),
        "labels": torch.randint(3, 100, (2, 5), generator=g),
    }
    message = _refusal(transformers.UdopForConditionalGeneration(config).train(), sample)
    assert "modeling_udop.py:814 (`assert torch.all(shifted_input_ids >= 0).item()" in message
    assert "without labels" in message
