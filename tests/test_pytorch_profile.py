"""Profiling: exact sizes from saved-tensor hooks, meta mode, time models, no side effects."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402, F401  (one thread)
from torch import nn  # noqa: E402

from optmem.chain import Chain  # noqa: E402
from optmem.pytorch.extract import extract_stages  # noqa: E402
from optmem.pytorch.models import resolve_spec  # noqa: E402
from optmem.pytorch.profile import _Progress, profile_chain, profile_stages  # noqa: E402


def test_mlp_sizes_are_exact():
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    chain = profile_chain(net, x, repeats=1, warmup=0)
    f = 4  # float32
    assert chain.input_size == 5 * 8 * f
    assert chain.output_size == (5 * 16 * f, 5 * 16 * f, 5 * 4 * f)
    # Linear saves its input (excluded) and weight (a parameter): the tape is the output.
    # Tanh saves its output. The last Linear saves its input only.
    assert chain.saved_size == chain.output_size
    assert chain.weight_size == ((8 * 16 + 16) * f, 0, (16 * 4 + 4) * f)
    assert all(t >= 0 for t in chain.fwd_time + chain.bwd_time)
    assert chain.fwd_overhead == (0, 0, 0)  # CPU: not measured
    assert Chain.from_dict(chain.to_dict()) == chain


def test_saved_size_counts_distinct_storages_beyond_the_output():
    class Twice(nn.Module):
        def forward(self, x):
            y = x.exp()          # saves its result y
            return (y * y).sum(1)  # saves y twice (one storage)

    x = torch.randn(4, 6, requires_grad=True)  # otherwise nothing is recorded at all
    chain = profile_chain([Twice()], x, repeats=1, warmup=0)
    assert chain.output_size == (4 * 4,)
    assert chain.saved_size == (4 * 6 * 4 + 4 * 4,)  # y once, plus the output


def test_meta_mode_gives_the_same_sizes():
    module, x = resolve_spec("toy-resnet", batch=2)
    real = profile_chain(module, x, repeats=1, warmup=0)
    with torch.device("meta"):
        meta_module, _ = resolve_spec("toy-resnet", batch=2)
    meta = profile_chain(meta_module, x, device="meta")
    for field in ("output_size", "saved_size", "weight_size", "input_size", "stage_names"):
        assert getattr(meta, field) == getattr(real, field), field
    assert meta.extra["profile"]["times"] == "roofline"
    assert all(t > 0 for t in meta.fwd_time)
    # a CPU module profiled on meta is copied, not moved
    meta2 = profile_chain(module, x, device="meta")
    assert meta2.saved_size == real.saved_size
    assert all(not p.is_meta for p in module.parameters())


def test_time_model_hook_is_used():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    calls = []

    def model(stage, inp, out):
        calls.append((type(stage).__name__, tuple(inp.shape), tuple(out.shape)))
        return 2.0, 3.0

    chain = profile_chain(net, torch.randn(3, 4), time_model=model, device="meta")
    assert chain.fwd_time == (2.0, 2.0, 2.0) and chain.bwd_time == (3.0, 3.0, 3.0)
    assert calls[0] == ("Linear", (3, 4), (3, 4))


def test_profiling_has_no_side_effects():
    torch.manual_seed(0)
    module, x = resolve_spec("toy-cnn", batch=2)
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)
    buffers = [b.clone() for b in module.buffers()]
    state = torch.get_rng_state()
    profile_stages(extract_stages(module), x, repeats=2, warmup=1)
    assert torch.equal(torch.get_rng_state(), state)
    for b, old in zip(module.buffers(), buffers, strict=True):
        assert torch.equal(b, old)
    assert all(torch.all(p.grad == 7.0) for p in module.parameters())


def test_progress_bar_writes_to_the_stream():
    stream = io.StringIO()
    bar = _Progress(3, True, stream)
    for k in range(4):
        bar.update(k, f"stage{k}")
    bar.close()
    text = stream.getvalue()
    assert "3/3" in text and text.endswith("\n")
    quiet = io.StringIO()
    _Progress(3, None, quiet).update(1, "x")  # not a terminal: silent
    assert quiet.getvalue() == ""
