"""The offload one-liners on a tiny T5 in eval mode at ``memory_limit="min"`` (stop 77).

An audit in stop 76 measured the device peak (``measure_training_peak(...,
host_copies=False)``) above the documented terms: ``cmodel.expected_peak_bytes``, plus the
batch when the plan moves ``a 0``, plus the tied embedding's bytes (its partial gradient),
plus the side inputs and their computation (``side_input_peak``: T5's position bias and
masks). ``op.offload`` peaked at 125,736 B (404 B above), ``op.remat_offload`` at 132,588 B
(7,256 B above). The cause: the host copies were made per *view* (keyed by storage, offset,
sizes and strides), and autograd saves several views of one storage (a ``Linear``'s input
``x.view(-1, d)`` beside ``x``, the attention weights ``p`` and ``p.view(b * h, s, s)`` that
the ``bmm`` saves), so a prefetched tape came back as more device storages than the
model holds and the chain counts: the encoder block's tape (67,872 B in the chain) came
back as 85,232 B. In train mode, dropout makes new storages between most of these views,
and the peak fell elsewhere. Since stop 77 a tensor moves with its whole storage, once
(:class:`optmem.pytorch.offload.HostCopies`): 111,528 and 117,228 B.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

import optmem.pytorch as op  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.pytorch.memory import (  # noqa: E402
    _shared_parameters,
    measure_training_peak,
    storage_bytes,
)
from optmem.pytorch.offload import HostCopies  # noqa: E402

VOCAB = 100


def _t5() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """2 + 2 layers, ``d_model`` 32, 4 heads; 2 x 12 tokens, one row padded; 8 targets."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0))
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    labels = torch.randint(1, VOCAB, (2, 8), generator=g)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture(scope="module")
def t5_eval() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Chain]:
    model, batch = _t5()
    model.eval()
    chain = op.profile_chain(model, batch, repeats=1, warmup=0,
                             time_model=lambda *_: (1.0, 2.0))  # plans fixed on any machine
    return model, batch, chain


@pytest.mark.parametrize("kind", [op.offload, op.remat_offload],
                         ids=["offload", "remat_offload"])
def test_t5_in_eval_mode_at_the_least_limit_is_within_the_documented_terms(
        t5_eval: tuple[torch.nn.Module, dict[str, Any], Chain], kind: Any) -> None:
    model, batch, chain = t5_eval
    cmodel = kind(model, batch, memory_limit="min", chain=chain, bandwidth="1GB/s")
    plan = cmodel.result.plan
    assert sum(o.startswith("offload abar") for o in plan) >= 9, plan  # the tapes move
    model.zero_grad(set_to_none=True)
    real = measure_training_peak(lambda: cmodel(**batch).loss.backward(), model, batch,
                                 host_copies=False)
    model.zero_grad(set_to_none=True)
    held = storage_bytes(batch) if "offload a 0" in plan else 0
    tied = storage_bytes(_shared_parameters(list(cmodel.stages)))
    side = int(chain.extra["side_input_peak"])
    assert real <= cmodel.expected_peak_bytes + held + tied + side, \
        (real, cmodel.expected_peak_bytes, held, tied, side)


def test_views_of_one_storage_share_their_host_and_device_copies() -> None:
    """A tensor and its views (the saved ``x`` and ``x.view(-1, d)`` of a ``Linear``) make
    one host copy and, brought back, one device copy, with each view's layout."""
    copies = HostCopies(None)
    x = torch.randn(2, 12, 32)
    views = [x, x.view(-1, 32), x.transpose(1, 2), x[:, 3:]]
    hosts = [copies.to_host(v)[0] for v in views]
    assert len({h.untyped_storage().data_ptr() for h in hosts}) == 1
    assert hosts[0].untyped_storage().nbytes() == x.untyped_storage().nbytes()
    backs = [copies.to_device(h, x.device)[0] for h in hosts]
    assert len({b.untyped_storage().data_ptr() for b in backs}) == 1
    for v, b in zip(views, backs, strict=True):
        assert torch.equal(b, v)
        assert (b.stride(), b.storage_offset()) == (v.stride(), v.storage_offset())
