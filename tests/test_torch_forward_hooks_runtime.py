"""Forward hooks of inner modules that return None run at every step, as on the plain model.

Until stop 85 a forward hook or pre-hook registered on an inner module of a wrapped model
ran once, while the model was exported, on fake tensors, and the steps never called it
(one ``UserWarning`` said so): activation logging, counters and feature extraction saw
nothing. Now each such *observer* is called once per forward of a step with the stages'
real values, in the plain model's order, never again when the plan re-runs a stage in
the backward, and not by the measuring runs (:mod:`optmem.pytorch.observers`). Each test
records, over two AdamW steps and an ``eval()`` call under ``no_grad``, the list of
(hook, kind, every tensor it received) on the plain model and on the wrapper, under the
same seeds, and compares them bitwise, with the losses and gradients.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import hf_helpers  # noqa: E402
from pytorch_helpers import HUNT_FIXED, Mlp, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

Record = list[tuple[str, str, list[tuple[torch.Tensor, bool]]]]


def _tensors(value: Any) -> list[tuple[torch.Tensor, bool]]:
    """Each tensor's values and whether it requires grad (as the model's hook sees it)."""
    return [(t.detach().clone(), t.requires_grad) for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor)]


def _install(model: nn.Module, hooks: list[tuple[str, str]], log: Record) -> None:
    """Observers on ``model``'s inner modules: ``fwd``, ``fwdkw`` (with kwargs), ``pre``,
    ``prekw``; each appends (module, kind, the tensors it received) to ``log``."""
    for name, kind in hooks:
        sub = model.get_submodule(name)

        def note(*received: Any, n: str = name, k: str = kind) -> None:
            log.append((n, k, _tensors(received[1:])))

        if kind.startswith("fwd"):
            sub.register_forward_hook(note, with_kwargs=kind == "fwdkw")
        else:
            sub.register_forward_pre_hook(note, with_kwargs=kind == "prekw")


def _same(got: Record, ref: Record) -> None:
    assert [(n, k, len(v)) for n, k, v in got] == [(n, k, len(v)) for n, k, v in ref]
    for (name, kind, a), (_, _, b) in zip(got, ref, strict=True):
        for (x, x_grad), (y, y_grad) in zip(a, b, strict=True):
            assert torch.equal(x, y) and x_grad == y_grad, (name, kind)


MLP_HOOKS = [("layers.1", "fwd"), ("layers.2", "pre"), ("layers.3", "fwdkw"),
             ("layers.4", "prekw"), ("head", "fwd")]


def _wrap(kind: str, model: nn.Module, sample: Any) -> tuple[nn.Module, list[str]]:
    """The wrapper, and the warnings about forward hooks wrapping gave (none expected)."""
    wrap, options = hunt_kinds()[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmodel = wrap(model, sample, **HUNT_FIXED, **options)
    if kind == "checkpoint":
        assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan), "no re-run"
    return cmodel, [str(w.message) for w in caught if "forward hooks" in str(w.message)]


def _steps(call: Callable[[], torch.Tensor], model: nn.Module) -> list[torch.Tensor]:
    """Two AdamW steps (losses and gradients), then an eval call under no_grad."""
    opt = torch.optim.AdamW(model.parameters())
    seen = []
    for seed in range(2):
        opt.zero_grad()
        torch.manual_seed(seed)
        loss = call()
        loss.backward()
        seen += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        opt.step()
    model.eval()
    with torch.no_grad():
        seen.append(call())
    model.train()
    return seen


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_observers_of_an_mlp_run_at_every_step_in_the_models_order(kind: str) -> None:
    model, x = Mlp(), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    got_log: Record = []
    ref_log: Record = []
    _install(model, MLP_HOOKS, got_log)
    _install(ref, MLP_HOOKS, ref_log)
    fake: list[bool] = []
    model.layers[1].register_forward_hook(
        lambda m, a, o: fake.append(isinstance(o, FakeTensor)))
    cmodel, warned = _wrap(kind, model, x)
    # wrapping called each observer once, at the export, on fake tensors; the measuring
    # runs of the real model did not call it
    assert fake == [True]
    assert [(n, k) for n, k, _ in got_log] == MLP_HOOKS
    got_log.clear()
    fake.clear()
    got = _steps(lambda: cmodel(x), model)
    ref_seen = _steps(lambda: ref(x), ref)
    for a, b in zip(got, ref_seen, strict=True):
        assert torch.equal(a, b)
    assert len(ref_log) == 3 * len(MLP_HOOKS)  # once per forward: 2 steps and the eval
    _same(got_log, ref_log)
    assert fake == [False] * 3
    assert warned == []  # before stop 85: "forward hooks on ...: not called again"


def test_a_hook_removed_after_wrapping_is_not_called_and_a_modifier_stays_warned() -> None:
    model, x = Mlp(), torch.randn(8, 16)
    log: Record = []
    _install(model, [("layers.2", "fwd")], log)
    handle = model.layers[4].register_forward_hook(lambda m, a, o: o * 2)
    wrap, options = hunt_kinds()["checkpoint"]
    with pytest.warns(UserWarning, match=r"forward hooks on Mlp\.layers\.4 \(Linear\): "):
        cmodel = wrap(model, x, **HUNT_FIXED, **options)
    log.clear()
    cmodel(x).backward()
    assert [n for n, _, _ in log] == ["layers.2"]  # the observer, once
    handle.remove()
    observer = next(iter(model.layers[2]._forward_hooks))
    model.layers[2]._forward_hooks.pop(observer)  # as its handle's remove() does
    log.clear()
    cmodel(x).backward()
    assert log == []


@pytest.mark.parametrize(("name", "kind"), [("gpt2", "checkpoint"), ("llama", "remat_offload")])
def test_observers_of_hf_blocks_see_the_plain_models_values(name: str, kind: str) -> None:
    model, kwargs = hf_helpers.MODELS[name]()
    hooks = {"gpt2": [("transformer.wte", "fwd"), ("transformer.h.0.attn", "prekw"),
                      ("transformer.h.0", "fwd"), ("transformer.h.1.mlp", "fwd"),
                      ("transformer.h.1", "fwdkw"), ("transformer.ln_f", "pre")],
             "llama": [("model.embed_tokens", "fwd"), ("model.rotary_emb", "fwd"),
                       ("model.layers.0.self_attn", "prekw"), ("model.layers.0", "fwdkw"),
                       ("model.layers.1.mlp", "fwd"), ("model.norm", "fwd")]}[name]
    ref = copy.deepcopy(model)
    got_log: Record = []
    ref_log: Record = []
    _install(model, hooks, got_log)
    _install(ref, hooks, ref_log)
    cmodel, warned = _wrap(kind, model, kwargs)
    got_log.clear()
    got = _steps(lambda: cmodel(**kwargs).loss, model)
    ref_seen = _steps(lambda: ref(**kwargs).loss, ref)
    for a, b in zip(got, ref_seen, strict=True):
        assert torch.equal(a, b)
    assert len(ref_log) == 3 * len(hooks)
    _same(got_log, ref_log)
    assert warned == []


def test_a_stand_alone_extraction_still_warns_about_observers() -> None:
    """``extract_program`` (no wrapper to call the hooks: ``op.pipeline``, a user's own
    runner) keeps the warning; the wrapper's extraction (``observe=True``) lists them."""
    from optmem.pytorch.extract import extract_program

    model, x = Mlp(), torch.randn(8, 16)
    _install(model, [("layers.2", "fwd")], [])
    with pytest.warns(UserWarning, match=r"forward hooks on Mlp\.layers\.2"):
        assert not extract_program(model, (x,)).observers.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ext = extract_program(model, (x,), observe=True)
    assert [(c.module_name, c.pre) for c in ext.observers.calls] == [("layers.2", False)]


def test_a_hooks_tensor_in_a_loss_raises_instead_of_losing_gradients() -> None:
    """The model's hook receives tensors that require grad: the wrapper's too. A loss made
    from them (a perceptual loss on hooked features) would get no gradient through the
    plan's stages: its backward raises one OptmemInputError, naming the module."""
    from optmem.errors import OptmemInputError

    model, x = Mlp(), torch.randn(8, 16)
    feats: dict[str, torch.Tensor] = {}
    model.layers[3].register_forward_hook(lambda m, a, o: feats.update(out=o))
    cmodel, _ = _wrap("checkpoint", model, x)
    loss = cmodel(x)
    assert feats["out"].requires_grad
    with pytest.raises(OptmemInputError, match=r"forward hook of layers\.3 received"):
        (loss + feats["out"].square().mean()).backward()


class SharedLayer(Mlp):
    """The Mlp with one more layer called before and after the others (ALBERT's sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(torch.tanh(self.shared(x))).square().mean()


def test_a_module_called_twice_per_forward_calls_its_observers_twice() -> None:
    """One call signature per call of the module (``shared``, ``shared@1``): each hook call
    gets the values of its own call (before stop 85 it was warned, never called)."""
    model, x = SharedLayer(), torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    got_log: Record = []
    ref_log: Record = []
    hooks = [("shared", "fwd"), ("shared", "pre"), ("layers.2", "fwd")]
    _install(model, hooks, got_log)
    _install(ref, hooks, ref_log)
    cmodel, warned = _wrap("remat_offload", model, x)
    got_log.clear()
    got = _steps(lambda: cmodel(x), model)
    for a, b in zip(got, _steps(lambda: ref(x), ref), strict=True):
        assert torch.equal(a, b)
    assert len(ref_log) == 3 * 5  # two calls of shared (pre and forward), one of layers.2
    _same(got_log, ref_log)
    assert warned == []
