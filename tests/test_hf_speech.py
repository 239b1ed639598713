"""The one-liner on HF speech models: CTC heads, SpecAugment masks, LayerDrop.

Before (stop 38's sweep), every ``...ForCTC`` model (Wav2Vec2, HuBERT, WavLM,
Data2VecAudio, SEW, UniSpeech) failed with a misleading error naming its check of the
labels: the real stop was ``torch.ctc_loss``, whose fake kernel has no size for the alphas
it keeps (``DynamicOutputShapeException``), and past it the NumPy draws of SpecAugment.
Now ``torch.ctc_loss`` is kept whole through export
(:mod:`optmem.pytorch.custom_functions`), SpecAugment's time masks train when passed as
``mask_time_indices`` (a ``dropout(p=0)`` returning its input no longer hides the mask's
in-place write from the cut: ``graphcut._returns_its_input``), and what cannot be held in
a graph (LayerDrop, masks drawn inside) is one error naming the config field to set.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")
np = pytest.importorskip("numpy", reason="SpecAugment's masks are drawn with NumPy")

from hf_helpers import assert_same, check_one_liner, step  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

T = transformers
BATCH, SAMPLES = 2, 1600
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32,
             num_labels=3, mask_time_length=2)
#: (model class, config class, extra config): every CTC family of the sweep, and one head
#: without CTC that only LayerDrop stopped
SPEECH: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "wav2vec2": (T.Wav2Vec2ForCTC, T.Wav2Vec2Config, {}),
    "hubert": (T.HubertForCTC, T.HubertConfig, {}),
    # its relative position bias is carried beside the boundaries (read by every layer):
    # with two layers it sets the store-all peak (smallest plan at 93 %), with four it is
    # counted once and 60 % re-runs
    "wavlm": (T.WavLMForCTC, T.WavLMConfig, {"num_hidden_layers": 4}),
    "data2vec_audio": (T.Data2VecAudioForCTC, T.Data2VecAudioConfig, {}),
    "sew": (T.SEWForCTC, T.SEWConfig, {"squeeze_factor": 2}),
    "unispeech": (T.UniSpeechForCTC, T.UniSpeechConfig, {}),
    "wav2vec2_cls": (T.Wav2Vec2ForSequenceClassification, T.Wav2Vec2Config, {}),
}


def _model(name: str, **config: Any) -> tuple[Any, dict[str, Any]]:
    """The tiny model in training mode, and a sample call with labels."""
    model_cls, config_cls, extra = SPEECH[name]
    torch.manual_seed(0)
    settings = {"layerdrop": 0.0, "mask_time_prob": 0.0, **extra, **config}
    model = model_cls(config_cls(**{**AUDIO, **settings}))
    model.train()
    g = torch.Generator().manual_seed(10)
    labels = (torch.randint(0, 3, (BATCH,), generator=g) if name.endswith("_cls")
              else torch.randint(1, 20, (BATCH, 5), generator=g))
    return model, {"input_values": torch.randn(BATCH, SAMPLES, generator=g), "labels": labels}


def _time_masks(model: Any, seed: int) -> torch.Tensor:
    """SpecAugment's time masks as HF draws them, drawn outside the model."""
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices

    frames = int(model._get_feat_extract_output_lengths(SAMPLES))
    np.random.seed(seed)  # noqa: NPY002 - HF's helper draws from NumPy's global generator
    return torch.tensor(_compute_mask_indices((BATCH, frames), mask_prob=0.2, mask_length=2,
                                              min_masks=2))


@pytest.mark.parametrize("name", sorted(SPEECH))
def test_speech_models_train_with_their_ctc_loss(name: str) -> None:
    model, kwargs = _model(name)
    cmodel, _, _ = check_one_liner(model, kwargs)
    if not name.endswith("_cls"):  # the loss stage runs torch's own CTC op (restored)
        from optmem.pytorch.custom_functions import ctc_loss

        last = cmodel.stages[-1]
        targets = [n.target for n in last.gm.graph.nodes if n.op == "call_function"]
        assert ctc_loss in targets


def test_specaugment_masks_passed_in_train_and_change_every_call() -> None:
    """``mask_time_prob`` > 0 with the masks drawn outside: they are an input of the graph.

    The mask is written in place into the projection's output through a ``dropout(p=0)``
    (HF's default ``feat_proj_dropout``), which returns that very tensor: before
    ``graphcut._returns_its_input``, a boundary was cut there and the write hit a stage's
    input ("a leaf Variable that requires grad is being used in an in-place operation").
    """
    model, kwargs = _model("wav2vec2", mask_time_prob=0.2)
    assert model.config.feat_proj_dropout == 0.0
    kwargs["mask_time_indices"] = _time_masks(model, seed=0)
    cmodel, _, _ = check_one_liner(model, kwargs)
    other = dict(kwargs, mask_time_indices=_time_masks(model, seed=1))
    assert not torch.equal(other["mask_time_indices"], kwargs["mask_time_indices"])
    assert_same(step(cmodel, model, other, seed=5), step(model, model, other, seed=5),
                bitwise=True)


@pytest.mark.parametrize(("config", "named", "why"), [
    ({"layerdrop": 0.1}, "model.config.layerdrop = 0.0", "intermediate tensor"),
    ({"mask_time_prob": 0.05}, "model.config.mask_time_prob = 0.0", "numpy.random"),
])
def test_what_draws_inside_the_forward_is_one_error_naming_the_config_field(
        config: dict[str, Any], named: str, why: str) -> None:
    """LayerDrop (a branch on ``torch.rand``) and SpecAugment's masks drawn inside (NumPy)
    change the graph at every step. Before, both were reported as the labels check ("Call
    it without the input that leads there"), which was not what stopped the export."""
    model, kwargs = _model("wav2vec2", **config)
    with pytest.raises(OptmemInputError) as err:
        op.checkpoint(model, kwargs, memory_limit="60%", repeats=1, warmup=0)
    message = str(err.value)
    assert named in message and why in message
    assert "labels.max()" not in message
    if "mask_time_prob" in config:
        assert "mask_time_indices=" in message  # how to keep the masks
    else:
        assert "modeling_wav2vec2.py:" in message and "skip_the_layer" in message
    for key in config:  # set to 0 as the message says: the model wraps
        setattr(model.config, key, 0.0)
    assert op.checkpoint(model, kwargs, memory_limit="60%", repeats=1, warmup=0).chain.length > 3


@pytest.mark.parametrize("kind", ["offload", "remat_offload"])
def test_offload_executors_bring_back_saved_views_with_their_strides(kind: str) -> None:
    """Wav2Vec2's positional conv saves a strided view (``conv(x)[:, :, :-1]``). The offload
    executors copied it to host and back with ``clone()``, which made it contiguous, and
    the gradients of every stage before it differed from the model's by rounding (11
    parameters, up to 4.8e-7). Copies now keep the strides (since stop 77, views of a copy
    of the whole storage: ``offload.HostCopies``)."""
    model, kwargs = _model("wav2vec2")
    wrap = getattr(op, kind)
    cmodel = wrap(model, kwargs, memory_limit="60%", repeats=1, warmup=0, fast_path=False)
    assert any(o.startswith("offload") for o in cmodel.result.plan)
    assert_same(step(cmodel, model, kwargs, seed=5), step(model, model, kwargs, seed=5),
                bitwise=True)
