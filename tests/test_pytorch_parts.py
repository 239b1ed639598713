"""Planning one part of a model: a sample that comes out of the parent's graph.

A part's call is made by its parent: ``model.body = op.checkpoint(model.body, h)`` with
``h = model.emb(x)``, or the call :func:`optmem.pytorch.submodule_sample` captures. Before
(stop 40), the sample's tensors kept the parent's graph: the plain step optmem measures
while wrapping ran its backward on into that graph and freed it ("Trying to backward
through the graph a second time"), so wrapping failed; and a call with a new signature in
training (re-extracted while the parent's graph is alive) did the same to the user's step.
Now every sample and call optmem profiles is first made graph-free
(:func:`optmem.pytorch.wrapper.graph_free`).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.extract import plannable_part as failed_in_part  # noqa: E402
from optmem.pytorch.wrapper import graph_free  # noqa: E402

WIDTH, DEPTH = 32, 6


class Body(nn.Module):
    """Six tanh layers, optionally scaled (a second signature)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(DEPTH))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if scale is None else x * scale


class Parent(nn.Module):
    """An embedding that requires grad before the body, a head after it."""

    def __init__(self, body: nn.Module | None = None) -> None:
        super().__init__()
        self.emb = nn.Linear(8, WIDTH)
        self.body = body if body is not None else Body()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x)
        h = self.body(h) if scale is None else self.body(h, scale=scale)
        return self.head(h).square().mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _step(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, list[Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(*args, **kwargs)
    loss.backward()
    return loss.detach(), _grads(model)


def _same(got: tuple[torch.Tensor, list[Any]], ref: tuple[torch.Tensor, list[Any]]) -> None:
    assert torch.equal(got[0], ref[0])
    assert len(got[1]) == len(ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))


@pytest.mark.parametrize("kind", ["module", "sequential"])
def test_a_part_wrapped_on_a_sample_from_the_parents_graph(kind: str) -> None:
    torch.manual_seed(0)
    model = Parent() if kind == "module" else Parent(
        nn.Sequential(*(layer for layer in Body().layers)))
    x, scale = torch.randn(16, 8), torch.tensor(2.0)
    ref = _step(model, x)
    ref_scaled = _step(model, x, scale) if kind == "module" else None
    ref_wide = _step(model, torch.randn(24, 8, generator=torch.Generator().manual_seed(1)))
    model.zero_grad(set_to_none=True)

    h = model.emb(x)  # a sample in the parent's graph, which the caller still needs
    assert not h.is_leaf
    sample = (h,) if kind == "module" else h  # a call, or a Sequential's input
    model.body = op.checkpoint(model.body, sample, memory_limit="60%", repeats=1, warmup=0,
                               fast_path=False)
    assert any(o.startswith("F_ck") for o in model.body.result.plan), "no re-run"
    assert all(p.grad is None for p in model.parameters()), "wrapping left gradients"
    h.sum().backward()  # the caller's graph is intact
    assert model.emb.weight.grad is not None

    _same(_step(model, x), ref)
    if kind == "module":  # a new signature, extracted while the parent's graph is alive
        _same(_step(model, x, scale), ref_scaled)
    # a new size (re-profiled in training for the Sequential, a dynamic graph otherwise)
    _same(_step(model, torch.randn(24, 8, generator=torch.Generator().manual_seed(1))),
          ref_wide)


def test_graph_free_keeps_storage_requires_grad_and_aliasing() -> None:
    leaf = torch.randn(3, requires_grad=True)
    made = leaf * 2
    plain = torch.arange(3)
    out = graph_free({"a": made, "b": (made, leaf), "c": plain})
    a, (b, c) = out["a"], out["b"]
    assert a is b, "one tensor met twice gives one leaf"
    assert a.is_leaf and a.requires_grad and a.grad_fn is None
    assert a.data_ptr() == made.data_ptr()
    assert c is not leaf and c.is_leaf and c.data_ptr() == leaf.data_ptr()
    assert out["c"] is plain
    a.sum().backward()
    assert leaf.grad is None


def test_submodule_sample_is_the_parents_call_and_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = Parent()
    x = torch.randn(16, 8)
    state = torch.random.get_rng_state()
    sample = op.submodule_sample(model, "body", x, scale=torch.tensor(3.0))
    assert set(sample) == {"x", "scale"}  # the positional input bound to its name
    assert torch.equal(sample["x"], model.emb(x))
    assert sample["x"].requires_grad and sample["x"].is_leaf
    assert torch.equal(sample["scale"], torch.tensor(3.0))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)
    # the same by module, and the head never ran (stopped at the body's call)
    calls = []
    model.head.register_forward_hook(lambda *a: calls.append(1))
    again = op.submodule_sample(model, model.body, x)
    assert set(again) == {"x"} and not calls


def test_submodule_sample_refuses_what_is_not_a_called_part() -> None:
    model = Parent()
    x = torch.randn(4, 8)
    with pytest.raises(OptmemInputError, match="no submodule 'decoder'"):
        op.submodule_sample(model, "decoder", x)
    with pytest.raises(OptmemInputError, match="not a module of Parent"):
        op.submodule_sample(model, nn.Linear(2, 2), x)
    model.spare = nn.Linear(WIDTH, WIDTH)
    with pytest.raises(OptmemInputError, match="did not call Linear"):
        op.submodule_sample(model, "spare", x)


class Splitter(nn.Module):
    """Splits its rows where a computed value says: a size export cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        n = int((h[:, 0] > 0).sum()) + 1  # a router's choice, computed in the forward
        return torch.cat([h[:n].cumsum(0), h[n:]])


class TwoTowers(nn.Module):
    """A tower that cannot be exported before a body of layers that can (a VLM's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = Splitter()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.tower(x)).square().mean()


def test_an_export_failure_names_its_module_and_the_part_to_plan() -> None:
    torch.manual_seed(0)
    model = TwoTowers()
    x = torch.randn(12, 8)
    with pytest.raises(OptmemInputError) as info:
        op.checkpoint(model, x, memory_limit="60%", repeats=1, warmup=0)
    message = str(info.value)
    assert "in 'tower' (a Splitter)" in message
    assert "wrap 'body' (a Body, which does not run it) alone" in message
    # the remedy the message gives works, bitwise
    ref = _step(model, x)
    part = model.get_submodule("body")
    sample = op.submodule_sample(model, part, x)
    model.body = op.checkpoint(part, sample, memory_limit="60%", repeats=1, warmup=0,
                               fast_path=False)
    _same(_step(model, x), ref)


def test_no_part_is_suggested_when_every_layer_fails() -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(Splitter() for _ in range(3))
    assert failed_in_part(model, "layers.0") is None
    tower = TwoTowers()
    assert failed_in_part(tower, "tower") == "body"
    assert failed_in_part(tower, "tower.proj") is None  # Body holds Linears too
    holder = nn.Module()
    holder.tower = Splitter()
    holder.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
    assert failed_in_part(holder, "tower") is None  # a ModuleList is never called


def test_the_part_named_is_one_the_call_runs_and_naming_it_leaves_no_trace() -> None:
    """A module the forward never calls (HF Csm's ``codec_model``) is not named, even when
    it is the largest: before (stop 40's second sweep) the error named it, and
    ``submodule_sample`` then failed ("did not call"). Finding the called modules runs the
    model once, leaving the RNG states and buffers as they were."""
    import random

    torch.manual_seed(0)
    model = TwoTowers()
    model.spare = nn.Sequential(nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(8)))
    model.register_buffer("count", torch.zeros(()))
    x = torch.randn(12, 8)
    states = torch.random.get_rng_state(), random.getstate()
    with pytest.raises(OptmemInputError) as info:
        op.checkpoint(model, x, memory_limit="60%", repeats=1, warmup=0)
    assert "wrap 'body' (a Body" in str(info.value) and "spare" not in str(info.value)
    assert torch.equal(torch.random.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert failed_in_part(model, "tower") == "spare"  # without the call: the largest
