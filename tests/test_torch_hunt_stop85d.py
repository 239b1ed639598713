"""Hunt of the torch bridge on audio, speech-synthesis, time-series and OCR families (stop
85; ``docs/pytorch.md``, "Stop 85 (audio, speech synthesis, time series, OCR)").

PatchTSMixer, TimesFM, TrOCR (causal LM and ViT + TrOCR), Donut and Nougat (Swin + MBart),
DAC, Bark's semantic and fine models were bitwise the plain model's in every check. VITS
(MMS-TTS) is refused: it draws ``np.random.uniform(0, 1)`` for every encoder layer and
compares it with ``layerdrop``. The refusal advised ``model.config.layerdrop = 0.0``, after
which the model was refused again (it draws whatever the value): the first message now says
so, and the second names VITS beside MusicGen.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from pytorch_helpers import HUNT_FIXED  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402


def _vits() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny random VITS (MMS-TTS's architecture), LayerDrop 0.1 (its default)."""
    torch.manual_seed(0)
    config = transformers.VitsConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
        flow_size=16, spectrogram_bins=17, upsample_initial_channel=16, upsample_rates=[4, 4],
        upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
        prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=1,
        duration_predictor_num_flows=2, duration_predictor_filter_channels=16,
        posterior_encoder_num_wavenet_layers=1, depth_separable_num_layers=2, window_size=4)
    ids = torch.randint(1, 40, (1, 12), generator=torch.Generator().manual_seed(1))
    return transformers.VitsModel(config), {"input_ids": ids}


def _refusal(model: torch.nn.Module, sample: dict[str, torch.Tensor]) -> str:
    with pytest.raises(OptmemInputError) as err:
        op.checkpoint(model, sample, **HUNT_FIXED)
    return str(err.value)


def test_vits_layerdrop_advice_says_it_is_refused_again() -> None:
    """Before: "set model.config.layerdrop = 0.0 before wrapping." and nothing more; done,
    the model was refused again (its draws do not depend on the value)."""
    model, sample = _vits()
    first = _refusal(model, sample)
    assert "model.config.layerdrop = 0.0" in first
    assert "VITS" in first and "refused again" in first
    model.config.layerdrop = 0.0
    model.text_encoder.encoder.layerdrop = 0.0
    second = _refusal(model, sample)  # the advice's outcome, as the first message says
    assert "No random option of its config is on" in second
    assert "VITS" in second and "only a change of its code" in second


def test_fastspeech2_refusal_names_an_inputs_values() -> None:
    """Before: the length set by the input ``duration_labels`` was called "a value computed
    inside the forward (a router's choice, LayerDrop's random draw)" and nothing more."""
    torch.manual_seed(0)
    config = transformers.FastSpeech2ConformerConfig(
        vocab_size=40, hidden_size=16, encoder_layers=1, decoder_layers=1,
        encoder_num_attention_heads=2, decoder_num_attention_heads=2, encoder_linear_units=32,
        decoder_linear_units=32, num_mel_bins=8, duration_predictor_channels=16,
        pitch_predictor_channels=16, energy_predictor_channels=16,
        speech_decoder_postnet_units=16, speech_decoder_postnet_layers=2,
        encoder_kernel_size=3, decoder_kernel_size=3)
    g = torch.Generator().manual_seed(1)
    durations = torch.full((2, 6), 2)
    sample = {"input_ids": torch.randint(1, 40, (2, 6), generator=g),
              "duration_labels": durations,
              "spectrogram_labels": torch.randn(2, 12, 8, generator=g),
              "pitch_labels": torch.randn(2, 6, 1, generator=g),
              "energy_labels": torch.randn(2, 6, 1, generator=g)}
    message = _refusal(transformers.FastSpeech2ConformerModel(config), sample)
    assert "length_regulator" in message
    assert "a length read from an input's values" in message
    assert "{neither}" not in message and "neither torch.export" in message
