"""Hunt of the torch bridge on plain PyTorch models written by hand (stop 83;
``docs/pytorch.md``, "Stop 83 (plain PyTorch models)").

A VAE that samples with ``torch.distributions.Normal(mu, std).rsample()`` could not be
wrapped: the distribution checks its arguments' values when built (``validate_args``, on by
default), a branch on computed values that no graph holds, and the error blamed "a branch on
the value of a tensor" and told to call the model without an input. It is now one
``OptmemInputError`` naming the distribution and ``validate_args=False``; with that, the
wrapped VAE trains as the plain one, bitwise (its noise replayed where a stage re-runs).
An RNN fed a ``PackedSequence`` failed with torch's own two errors (export's "zeros():
argument 'size' ... FakeTensor", fx's "__cuda_array_interface__"); it is now one error
naming the packed batch and what to do (an ``nn.Sequential`` with the packing inside a
stage trains bitwise).
A BYOL-style model updating its target encoder's parameters in place inside ``forward``
(an EMA under ``no_grad``) had that update applied at each of the wrapping's runs, in
silence: the target 4.5e-8 off after wrapping, the loss 0.29 off after a re-extraction. It
is now one error naming the parameter.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import torch.nn.functional as F  # noqa: E402
from pytorch_helpers import EmaTarget  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

torch.set_num_threads(1)

FIXED: dict[str, Any] = {"memory_limit": "min", "fast_path": False, "repeats": 1,
                         "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}
WRAPS = {
    "checkpoint": lambda m, s: op.checkpoint(m, s, **FIXED),
    "offload": lambda m, s: op.offload(m, s, bandwidth="1MB/s", **FIXED),
    "remat_offload": lambda m, s: op.remat_offload(m, s, bandwidth="1MB/s", **FIXED),
}


class VAE(nn.Module):
    """A VAE drawing its latent with ``Normal(mu, std).rsample()``; loss: reconstruction + KL."""

    def __init__(self, validate: bool | None) -> None:
        super().__init__()
        self.validate = validate
        self.enc = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.mu, self.log_var = nn.Linear(128, 8), nn.Linear(128, 8)
        self.dec = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, log_var = self.mu(h), self.log_var(h)
        normal = torch.distributions.Normal(mu, torch.exp(0.5 * log_var),
                                            validate_args=self.validate)
        z = normal.rsample()
        kl = -0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp())
        return F.mse_loss(self.dec(z), x, reduction="sum") + kl, z


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_a_validated_distribution_is_one_error_naming_validate_args(wrap):
    """main: "its forward branches on the value of a tensor ... Call it without the input
    that leads there", which no call of a VAE can follow. ``validate_args=True``: the
    default is off in a process that has run ``torch.compile`` (dynamo's setup calls
    ``Distribution.set_default_validate_args(False)``), as the full suite has."""
    torch.manual_seed(0)
    with pytest.raises(OptmemInputError, match=r"Normal\(\.\.\., validate_args=False\)"):
        WRAPS[wrap](VAE(validate=True), torch.randn(64, 16))


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_a_vae_without_validation_trains_as_the_plain_model(wrap):
    """Two AdamW steps, then another batch size: loss, latent and every gradient bitwise."""
    torch.manual_seed(0)
    model, x = VAE(validate=False), torch.randn(64, 16)
    ref = copy.deepcopy(model)
    cmodel = WRAPS[wrap](model, x)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, batch in enumerate((x, x, torch.randn(40, 16))):
        torch.manual_seed(10 + step)
        loss_ref, z_ref = ref(batch)
        loss_ref.backward()
        torch.manual_seed(10 + step)
        loss, z = cmodel(batch)
        loss.backward()
        assert torch.equal(loss, loss_ref) and torch.equal(z, z_ref)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()


class PackedRNN(nn.Module):
    """An embedding, a bidirectional LSTM on the packed batch, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.rnn = nn.LSTM(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(48, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                      enforce_sorted=False)
        out, _ = self.rnn(packed)
        return self.head(pad_packed_sequence(out, batch_first=True)[0])


def test_an_rnn_on_a_packed_sequence_is_one_error_naming_it():
    """main: torch's export and fx errors, none naming the packed batch."""
    torch.manual_seed(0)
    sample = (torch.randint(0, 20, (4, 10)), torch.tensor([10, 7, 3, 9]))
    with pytest.raises(OptmemInputError, match=r"PackedSequence .* in 'rnn' \(a LSTM\)"):
        op.checkpoint(PackedRNN(), sample, **FIXED)



@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_a_parameter_updated_in_the_forward_is_one_error_naming_it(wrap):
    """main: wrapping applied the EMA update at each of its runs, in silence."""
    torch.manual_seed(0)
    model = EmaTarget()
    with pytest.raises(OptmemInputError, match=r"modifies its parameter 'target.0.weight'"):
        WRAPS[wrap](model, (torch.randn(32, 16), torch.randn(32, 16)))
