"""Hunt of the torch bridge on more HuggingFace families (stop 84; ``docs/pytorch.md``,
"Stop 84 (more HF families)").

HF BigBird's block-sparse attention calls ``np.random.seed(layer_index)`` in training, then
draws its random blocks with NumPy: the same blocks at every call, so an exported graph may
keep the trace's. The check on host randomness (``hooks.refuse_python_random``) compared
NumPy's global state before and after the trace: a model that seeds leaves it moved unless
it was already where the model leaves it, so wrapping was refused ("draws random numbers
from numpy.random ... only a change of its code helps") or accepted depending on what the
caller had drawn before (a plain BigBird call first: accepted). And the model leaves NumPy's
generator in a fixed state after each call, which a caller's next ``np.random`` draw sees;
the wrapper's stages left it untouched. A generator the forward seeds before its first draw
is now accepted whatever its state, and the wrapper leaves it as the model's call does.

HF Reformer's reversible layers are a custom autograd Function (kept whole: its own forward
and backward run) whose backward calls ``.backward()`` on its layers itself, so it writes
their parameters' ``.grad`` directly, and whose forward draws new dropout seeds into its
layers' attributes (``self.attention_seed = torch.seed()``) at every call. Two defects
followed: wrapping left profiling's gradients in those parameters (a first step without
``zero_grad`` trained on them), and every call after the first took the seeds' change for
a new call signature, so it extracted, profiled and solved again inside the user's step,
whose gradients then held profiling's (up to 320 off in a bias, at the second step). The
setup now puts every parameter's ``.grad`` back, and the attributes of modules passed to a
Function kept whole are not part of the signature (the Function reads them at run time).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import assert_same, step  # noqa: E402
from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

FIXED = HUNT_FIXED
KINDS = hunt_kinds()


def _bigbird() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Block-sparse attention at 64 tokens (blocks of 4, one random block per row)."""
    torch.manual_seed(0)
    config = transformers.BigBirdConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=128, attention_type="block_sparse",
        block_size=4, num_random_blocks=1)
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    return transformers.BigBirdForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}


def test_bigbird_block_sparse_wraps_whatever_numpys_state_and_leaves_it_as_the_model(
        ) -> None:
    """Wrapped after ``np.random.seed(123)`` (main: refused, "draws random numbers from
    numpy.random"), a step is the model's, bitwise, and the caller's next NumPy draw after
    it is the one after the model's step (main, wrapped after a plain call: another)."""
    model, sample = _bigbird()
    plain = copy.deepcopy(model)
    np.random.seed(123)  # noqa: NPY002
    cmodel = op.checkpoint(model, sample, **FIXED)
    assert cmodel.extraction is not None and cmodel.extraction.method == "export"
    np.random.seed(7)  # noqa: NPY002
    got = step(cmodel, model, sample, seed=3)
    after_wrapped = np.random.rand()  # noqa: NPY002
    np.random.seed(7)  # noqa: NPY002
    ref = step(plain, plain, sample, seed=3)
    assert np.random.rand() == after_wrapped  # noqa: NPY002
    assert_same(got, ref)


class _Shuffled(nn.Module):
    """Four blocks; the features permuted by NumPy between them (seeded or not)."""

    def __init__(self, seeds: bool) -> None:
        super().__init__()
        self.seeds = seeds
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            if self.seeds:
                np.random.seed(k)  # noqa: NPY002
            x = block(x)[:, torch.as_tensor(np.random.permutation(8))]  # noqa: NPY002
        return x.square().mean()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_forward_seeding_numpy_trains_as_the_model_and_one_that_does_not_is_refused(
        kind: str) -> None:
    """Seeded before each draw: wrapped (main: refused), loss and gradients bitwise, NumPy
    left as the model leaves it. Drawing without seeding: refused, as before."""
    torch.manual_seed(0)
    model, x = _Shuffled(seeds=True), torch.randn(4, 8)
    plain = copy.deepcopy(model)
    wrap, options = KINDS[kind]
    np.random.seed(99)  # noqa: NPY002
    cmodel = wrap(model, x, **FIXED, **options)
    np.random.seed(99)  # noqa: NPY002
    loss = cmodel(x)
    loss.backward()
    drawn = np.random.rand()  # noqa: NPY002
    np.random.seed(99)  # noqa: NPY002
    ref = plain(x)
    ref.backward()
    assert np.random.rand() == drawn  # noqa: NPY002
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(OptmemInputError, match="draws random numbers from numpy.random"):
        wrap(_Shuffled(seeds=False), x, **FIXED, **options)


def _reformer() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """LSH and local attention, deterministic (``hash_seed``, no dropout), 64 tokens."""
    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        vocab_size=100, hidden_size=16, attention_head_size=8, num_attention_heads=2,
        feed_forward_size=32, is_decoder=True, axial_pos_embds=False,
        max_position_embeddings=64, attn_layers=["local", "lsh"], lsh_attn_chunk_length=16,
        local_attn_chunk_length=16, num_buckets=4, num_hashes=1, hash_seed=0,
        hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    return transformers.ReformerModelWithLMHead(config).train(), {"input_ids": ids,
                                                                   "labels": ids}


def test_reformer_wrapping_leaves_no_gradient_and_steps_extract_once(caplog) -> None:
    """After wrapping no parameter has a ``.grad`` (main: profiling's, in every reversible
    layer); three steps without ``zero_grad`` before the first are the model's, bitwise,
    with no new extraction (main: one per step after the first, and gradients off)."""
    model, sample = _reformer()
    plain = copy.deepcopy(model)
    cmodel = op.checkpoint(model, sample, **{**FIXED, "memory_limit": "95%"})
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    assert all(p.grad is None for p in model.parameters())
    with caplog.at_level("INFO", logger="optmem"):
        for seed in (3, 4, 3):
            (out, grads), (ref, ref_grads) = step(cmodel, model, sample, seed=seed), \
                step(plain, plain, sample, seed=seed)
            torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
            torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
            for a, b in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "new call signature" not in caplog.text


def _rwkv(rescale_every: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.RwkvConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=4, attention_hidden_size=16,
        intermediate_size=32, context_length=32, rescale_every=rescale_every)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return transformers.RwkvForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def test_rwkv_rescaling_its_weights_in_eval_is_refused_and_without_it_trains_as_the_model(
        ) -> None:
    """``rescale_every=2`` with 4 layers: one error naming the field (main: wrapped, and a
    training step after an ``eval()`` call under ``no_grad`` ran on the halved weights,
    logits 0.98 off). With ``rescale_every=0`` the same sequence is bitwise."""
    model, sample = _rwkv(2)
    with pytest.raises(OptmemInputError, match="model.config.rescale_every = 0"):
        op.checkpoint(model, sample, **FIXED)
    model, sample = _rwkv(0)
    plain = copy.deepcopy(model)
    cmodel = op.checkpoint(model, sample, **FIXED)
    for wrapped, owner in ((cmodel, model), (plain, plain)):
        owner.eval()
        with torch.no_grad():
            wrapped(**sample)
        owner.train()
    got, ref = step(cmodel, model, sample, seed=2), step(plain, plain, sample, seed=2)
    torch.testing.assert_close(got[0].logits, ref[0].logits, rtol=0, atol=0)
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
