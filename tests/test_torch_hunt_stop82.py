"""Hunt of the torch bridge on Qwen3, Qwen3-MoE, Gemma 3, ModernBERT, DeBERTa-v2, CLIP,
Wav2Vec2, DINOv2 and Swin (stop 82; ``docs/pytorch.md``, "Stop 82").

One way a wrapped module did not behave like its model: ``torch.export`` with dynamic
sizes marks the dynamic dimensions on the tensors it is given and leaves the marks there
(torch 2.13). A call of a new batch size is exported once with its sizes dynamic; where
that failed (Wav2Vec2's CTC loss selects the targets by a mask: a data-dependent size),
the call was exported on its own, with the marks still on its tensors, and failed too:
"cannot extract a chain from Wav2Vec2ForCTC", where the model trains. Every export now
leaves the caller's tensors as they were.

Under ``torch.autocast``, the same model's labels check cannot be exported (torch's
real-tensor propagation fails, exporting the model alone too): the error now says so.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import step  # noqa: E402
from pytorch_helpers import HUNT_FIXED  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.extract import export_dynamic  # noqa: E402

FIXED = HUNT_FIXED
MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_has_dynamo_dim_marking")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.blocks(x) - y).square().mean()


def test_an_export_leaves_the_callers_dimension_marks_as_they_were() -> None:
    """Exported with its batch dynamic, the call's tensors carry no marks after; a mark the
    caller set (``torch._dynamo.maybe_mark_dynamic``) is kept."""
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    torch._dynamo.maybe_mark_dynamic(y, 0)
    mine = dict(y.__dict__)
    assert export_dynamic(_Net(), (), {"x": x, "y": y}, [(0, 0), (1, 0)]) is not None
    assert not any(hasattr(x, m) for m in MARKS)  # main: {0} left on x
    assert y.__dict__ == mine


def _wav2vec2() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32,
        layerdrop=0.0, mask_time_prob=0.0, hidden_dropout=0.1, attention_dropout=0.1)
    model = transformers.Wav2Vec2ForCTC(config).train()

    def batch(seed: int, size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"input_values": torch.randn(size, 1600, generator=g),
                "labels": torch.randint(1, 20, (size, 5), generator=g)}
    return model, batch


def test_wav2vec2_ctc_at_another_batch_size_trains_as_the_model() -> None:
    """The CTC loss's data-dependent size fails the dynamic export of batch 6 (profiled at
    2); the call, exported on its own, trains bitwise as the model (main: an
    ``OptmemInputError`` "cannot extract a chain from Wav2Vec2ForCTC")."""
    model, batch = _wav2vec2()
    cmodel = op.checkpoint(model, batch(1, 2), **FIXED)
    big = batch(2, 6)
    (out, grads), (ref, ref_grads) = step(cmodel, model, big), step(model, model, big)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not any(hasattr(t, m) for t in big.values() for m in MARKS)


def test_wav2vec2_ctc_under_autocast_is_one_error_naming_autocast() -> None:
    """Under ``torch.autocast`` the labels check's export with the sample's values fails in
    torch (real-tensor propagation, as exporting the model alone): one error that says
    so and how to call instead (main: the same error without naming autocast)."""
    model, batch = _wav2vec2()
    cmodel = op.checkpoint(model, batch(1, 2), **FIXED)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(OptmemInputError, match="under autocast.*outside autocast"):
        cmodel(**batch(1, 2))
