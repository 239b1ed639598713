"""EnCodec's constant integer buffers (stop 86; ``docs/pytorch.md``, "Stop 86 (EnCodec and
XLNet)").

HF's EnCodec computes its convolutions' padding from non-persistent ``int64`` buffers of one
element (``stride``, ``kernel_size``, ``padding_total``). The export made them graph inputs,
so the padding was a size depending on values and the model was refused ("a tensor whose
size depends on values computed in the call at modeling_encodec.py:150"). The extraction now
reads such buffers as the constants they hold (only when the first export failed on a
value, and not when the forward writes one or computes a tensor of more than one element
from one), and the wrapper extracts again when one changes after wrapping.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402

from optmem.errors import OptmemInputError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
nn = torch.nn


def _encodec() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny random EnCodec (24 kHz layout: reflect padding, LSTM, RVQ)."""
    torch.manual_seed(0)
    config = transformers.EncodecConfig(
        hidden_size=8, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
        codebook_size=16, codebook_dim=8, num_lstm_layers=1, audio_channels=1,
        sampling_rate=800, target_bandwidths=[1.5], chunk_length_s=None)
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(1))
    return transformers.EncodecModel(config), {"input_values": x}


def _step(model: torch.nn.Module, sample: dict[str, Any], seed: int
          ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    out = model(**sample)
    loss = out.audio_values.pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [loss.detach(), out.audio_values.detach(), out.audio_codes], grads


def _assert_steps_equal(wrapped: torch.nn.Module, plain: torch.nn.Module,
                        sample: dict[str, Any], seed: int) -> None:
    got, got_grads = _step(wrapped, sample, seed)
    want, want_grads = _step(plain, sample, seed)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 0
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_encodec_wraps_and_trains_bitwise(kind: str) -> None:
    """Before: refused at ``modeling_encodec.py:150`` (``if length <= max_pad:``).

    oneDNN's LSTM rounds differently without grad (``docs/pytorch.md``, Limitations), which
    a stage re-run under ``no_grad`` meets: the check runs with oneDNN off.
    """
    wrap, extra = hunt_kinds()[kind]
    model, sample = _encodec()
    plain = copy.deepcopy(model)
    with torch.backends.mkldnn.flags(enabled=False):
        wrapped = wrap(model, sample, **{**HUNT_FIXED, **extra})
        _assert_steps_equal(wrapped, plain, sample, 3)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, plain)]
        for k in range(2):
            for m, opt in zip((wrapped, plain), optimizers, strict=True):
                torch.manual_seed(10 + k)
                m(**sample).audio_values.pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        got, want = wrapped.state_dict(), plain.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        wrapped.eval()
        plain.eval()
        with torch.no_grad():
            assert torch.equal(wrapped(**sample).audio_values, plain(**sample).audio_values)


class _Pad(nn.Module):
    """EnCodec's reflect padding, computed from a non-persistent ``int64`` buffer."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.use = use
        self.lin = nn.Linear(8, 8)
        self.register_buffer("pad", torch.tensor(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == "written":
            self.pad.add_(0)
        y = self.lin(x)
        left, right = self.pad - self.pad // 2, self.pad // 2
        if y.shape[-1] <= max(left, right):
            y = nn.functional.pad(y, (0, 1))
        y = nn.functional.pad(y, (left, right), mode="reflect")
        if self.use == "value":
            y = y * self.pad
        return y[..., self.pad - 2:self.pad + 8].tanh()


class _Toy(nn.Module):
    def __init__(self, use: str = "size") -> None:
        super().__init__()
        self.pad = _Pad(use)
        self.head = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                                  nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pad(x)).sum()


def _toy(use: str = "size") -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Toy(use), torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))


def _wrap(model: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    import optmem.pytorch as op

    return op.checkpoint(model, (x,), **{**HUNT_FIXED, "memory_limit": "min"})


def _assert_toy_steps_equal(wrapped: torch.nn.Module, plain: torch.nn.Module,
                            x: torch.Tensor) -> None:
    got, want = wrapped(x), plain(x)
    got.backward()
    want.backward()
    assert torch.equal(got, want)
    for a, b in zip(wrapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
        a.grad = b.grad = None


def test_a_buffer_changed_after_wrapping_extracts_again() -> None:
    """The graph holds the buffer's value; a change after wrapping (in place, through
    ``.data``, by assignment, in a deep copy) is followed, as the plain model follows it.
    Before: the toy was refused at wrapping."""
    model, x = _toy()
    plain = copy.deepcopy(model)
    wrapped = _wrap(model, x)
    _assert_toy_steps_equal(wrapped, plain, x)
    twin, twin_plain = copy.deepcopy(wrapped), copy.deepcopy(plain)
    for m in (twin, twin_plain):
        m.pad.pad.fill_(5)
    _assert_toy_steps_equal(twin, twin_plain, x)
    changes = [lambda m: m.pad.pad.fill_(4), lambda m: setattr(m.pad.pad, "data", torch.tensor(6)),
               lambda m: setattr(m.pad, "pad", torch.tensor(3))]
    for change in changes:
        before = wrapped(x).detach()
        change(model)
        change(plain)
        assert not torch.equal(plain(x).detach(), before)  # the change matters
        _assert_toy_steps_equal(wrapped, plain, x)


@pytest.mark.parametrize("use", ["written", "value"])
def test_a_buffer_written_or_computed_with_stays_refused(
        use: str, caplog: pytest.LogCaptureFixture) -> None:
    """A buffer the forward writes, or multiplies a tensor by, is not read as a constant:
    the first export's failure stands (the size-only toy beside it wraps, which it did not
    before)."""
    model, x = _toy(use)
    with caplog.at_level(logging.INFO, logger="optmem"), \
            pytest.raises(OptmemInputError, match="size depends on values computed"):
        _wrap(model, x)
    assert "writes or computes with its integer buffers" in caplog.text
    model, x = _toy()
    _assert_toy_steps_equal(_wrap(model, x), copy.deepcopy(model), x)


def _xlnet(perm: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny XLNet LM (2 layers, dropout 0.1); with ``perm``, two-stream attention."""
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=2,
                                      d_inner=64, dropout=0.1)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    if not perm:
        return transformers.XLNetLMHeadModel(config), {"input_ids": ids, "labels": ids}
    perm_mask = torch.zeros(2, 12, 12)
    perm_mask[:, :, -1] = 1.0  # no token sees the last one
    target_mapping = torch.zeros(2, 1, 12)
    target_mapping[:, 0, -1] = 1.0  # which is predicted
    return transformers.XLNetLMHeadModel(config), {
        "input_ids": ids, "perm_mask": perm_mask, "target_mapping": target_mapping,
        "labels": ids[:, -1:]}


@pytest.mark.parametrize(("perm", "kind"), [(True, "checkpoint"), (True, "offload"),
                                            (True, "remat_offload"), (False, "checkpoint")])
def test_xlnet_layers_are_cut_apart(perm: bool, kind: str) -> None:
    """Before: no boundary between XLNet's layers. Each layer reads the previous one's
    alias of the position embedding (``r.type(dtype)`` returns ``r``), and with
    ``perm_mask`` two streams cross every layer boundary; no plan below 97-98 % of the
    store-all peak with ``perm_mask`` (74-75 % without). Both are now carried beside the
    boundaries (``graphcut.side_streams``): plans at 60 %, steps and AdamW bitwise."""
    wrap, extra = hunt_kinds()[kind]
    model, sample = _xlnet(perm)
    plain = copy.deepcopy(model)
    wrapped = wrap(model, sample, **{**HUNT_FIXED, **extra})
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, plain)]
    for k in range(2):
        outs = []
        for m, opt in zip((wrapped, plain), optimizers, strict=True):
            torch.manual_seed(10 + k)
            out = m(**sample)
            out.loss.backward()
            outs.append((out.loss.detach(), out.logits.detach(),
                         {n: p.grad.clone() for n, p in m.named_parameters()
                          if p.grad is not None}))
            opt.step()
            opt.zero_grad()
        (loss, logits, grads), (want_loss, want_logits, want_grads) = outs
        assert torch.equal(loss, want_loss) and torch.equal(logits, want_logits)
        assert grads.keys() == want_grads.keys() and len(want_grads) > 0
        assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
    got, want = wrapped.state_dict(), plain.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
