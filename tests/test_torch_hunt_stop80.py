"""Hunt of the torch bridge as a PyTorch user (stop 80): what a wrapped module must keep.

Forward-mode AD (``torch.autograd.forward_ad`` dual tensors: a Jacobian-vector product in
train mode or in eval with grad enabled) failed through a checkpoint or remat + offload plan
with torch's raw "You must implement the jvp function for custom autograd.Function": the
plan's autograd Function has no ``jvp``. Such a call now runs the model as it is (one
warning per wrapper), as under a ``torch.func`` transform: outputs, tangents and gradients
the model's. ``len(cmodel)`` of a wrapped ``nn.Sequential`` raised ``TypeError``; it is the
model's length now, and iterating the wrapper iterates the model.
"""

from __future__ import annotations

import copy
import gc
import importlib
import warnings
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from torch import nn  # noqa: E402
from torch.autograd import forward_ad  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch import wrapper  # noqa: E402

# stage times that do not depend on the machine: the same plan on every run
FIXED_TIMES: dict[str, Any] = {"repeats": 1, "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}
KINDS = {"checkpoint": (op.checkpoint, {}),
         "remat_offload": (op.remat_offload, {"bandwidth": "1GB/s"})}


class _Block(nn.Module):
    """Pre-norm MLP block with a residual and dropout (masks must match the model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class _Net(nn.Module):
    """Four blocks and a head: exported by torch.export (not a plain sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(sequential: bool) -> nn.Module:
    torch.manual_seed(0)
    if sequential:
        return nn.Sequential(*(_Block() for _ in range(4)), nn.Linear(16, 4))
    return _Net()


def _jvp_step(call: Any, owner: nn.Module, x: torch.Tensor, tangent: torch.Tensor
              ) -> list[torch.Tensor | None]:
    """Output, its tangent and the parameters' gradients of a step on a dual input."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout masks
    with forward_ad.dual_level():
        out = call(forward_ad.make_dual(x, tangent))
        primal, out_tangent = forward_ad.unpack_dual(out)
        result = [primal.detach().clone(),
                  None if out_tangent is None else out_tangent.detach().clone()]
        primal.square().mean().backward()
    result += [None if p.grad is None else p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize(("kind", "sequential"), [
    ("checkpoint", True), ("checkpoint", False), ("remat_offload", False)],
    ids=["checkpoint-sequential", "checkpoint-exported", "remat_offload-exported"])
def test_forward_mode_ad_through_a_wrapper_gives_the_models_tangents(kind, sequential,
                                                                      monkeypatch):
    """A dual input in train mode with grad enabled: output, tangent and every gradient
    are the model's, bitwise; the plan runs again for a call without dual tensors. Before:
    ``NotImplementedError: You must implement the jvp function`` (checkpoint, remat +
    offload; an offload plan, saved-tensor hooks on the model's own graph, composes with
    it and keeps running its plan)."""
    one_liner, options = KINDS[kind]
    model = _model(sequential)
    plain = copy.deepcopy(model)
    x, tangent = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    cmodel = one_liner(model, x, memory_limit="60%", fast_path=False, **options,
                       **FIXED_TIMES)
    with pytest.warns(UserWarning, match="forward-mode AD") as caught:
        got = _jvp_step(cmodel, model, x, tangent)
        _jvp_step(cmodel, model, x, tangent)  # warned once per wrapper
    assert sum("forward-mode AD" in str(w.message) for w in caught) == 1
    ref = _jvp_step(plain, plain, x, tangent)
    assert len(got) == len(ref) and got[1] is not None
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert (a is None) == (b is None), k
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"item {k}")
    ran: list[int] = []  # without dual tensors the plan (its executor) runs again
    real = wrapper._run_executor
    monkeypatch.setattr(wrapper, "_run_executor", lambda *a: ran.append(1) or real(*a))
    torch.manual_seed(3)
    cmodel(x).square().mean().backward()
    assert ran == [1]


def test_dual_tensors_are_found_in_the_call_or_the_model():
    """Only inside a dual level, in a nested input or in a parameter (``functional_call``)."""
    layer = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    assert not wrapper.dual_tensors_in(layer, ((x,), {"y": [x]}))
    with forward_ad.dual_level():
        assert not wrapper.dual_tensors_in(layer, ((x,), {}))
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        assert wrapper.dual_tensors_in(layer, ((), {"y": [dual]}))
        weight = forward_ad.make_dual(layer.weight.detach(), torch.ones(2, 2))
        params = {"weight": weight, "bias": layer.bias}
        with torch.nn.utils.stateless._reparametrize_module(layer, params):
            assert wrapper.dual_tensors_in(layer, ((x,), {}))


def test_a_wrapped_sequential_has_the_models_length_and_items():
    """``len``, iteration and slicing as on the ``nn.Sequential``; a model without a length
    raises the model's ``TypeError``; the wrapper is true either way. Before: ``len`` raised
    "object of type 'CheckpointedModule' has no len()"."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)))
    cmodel = op.checkpoint(model, torch.randn(2, 8), memory_limit="60%", fast_path=False,
                           **FIXED_TIMES)
    assert len(cmodel) == len(model) == 5
    assert [id(m) for m in cmodel] == [id(m) for m in model]
    assert len(cmodel[1:3]) == 2 and bool(cmodel)
    net = op.checkpoint(_Net(), torch.randn(2, 3, 16), memory_limit="60%", **FIXED_TIMES)
    assert bool(net)
    with pytest.raises(TypeError, match="'_Net' has no len"):
        len(net)
    with pytest.raises(TypeError, match="'_Net' object is not iterable"):
        iter(net)


class _Scored(_Net):
    """Returns its output and a loss computed from it (as an HF model given labels)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return out, out.square().mean()


@pytest.mark.parametrize(("kind", "options"), [("remat_offload", {"bandwidth": "1GB/s"})],
                         ids=["remat_offload"])  # checkpoint(strip_suffix=False): the same
def test_a_hook_on_an_output_the_plan_computes_another_from_is_warned(kind, options):
    """The loss is computed from the output inside the plan: ``out.retain_grad()`` then
    ``loss.backward()`` leaves ``out.grad`` None where the model sets it (the gradient flows
    inside the plan's backward, not through the output tensor). One warning says so (before:
    nothing, a silent ``None``); the parameters' gradients are the model's, and a step
    without a hook warns nothing."""
    torch.manual_seed(0)
    model = _Scored()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 6, 16)
    cmodel = getattr(op, kind)(model, x, memory_limit="60%", fast_path=False, **options,
                               **FIXED_TIMES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hook: no warning
        torch.manual_seed(3)
        cmodel(x)[1].backward()
    model.zero_grad(set_to_none=True)
    got, ref = [], []
    for call, owner, grads in ((cmodel, model, got), (plain, plain, ref)):
        torch.manual_seed(3)
        out, loss = call(x)
        out.retain_grad()
        if call is cmodel:
            with pytest.warns(UserWarning, match="sees only the gradient that reaches it"):
                loss.backward()
        else:
            loss.backward()
        grads.extend([out.grad, *(p.grad for p in owner.parameters())])
    assert got[0] is None and ref[0] is not None  # what the warning is about
    for a, b in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["offload", "remat_offload"])
def test_a_forward_dropped_without_backward_frees_what_it_saved(kind, monkeypatch):
    """Three forwards whose graphs are dropped without a backward (a validation pass with
    grad enabled, a step skipped on a non-finite loss) free every tensor the plan saved, as
    the plain model does; a training step after them is the model's, bitwise. Before: the
    saved-tensor hooks kept each saved output with its grad_fn, a cycle through autograd's
    C++ nodes that Python's collector never frees, and remat + offload's hooks also held
    their runner with its stored activations (six 64-wide MLP blocks, batch 8 x 16, three
    such forwards: 81 of the offload plan's 87 saved tensors, 6.6 MiB, and all 51 of remat
    + offload's, 5.0 MiB, stayed alive for good)."""
    module = importlib.import_module(f"optmem.pytorch.{kind}")
    packed: list[weakref.ref[Any]] = []
    real_init = module._Packed.__init__

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        packed.append(weakref.ref(self))

    monkeypatch.setattr(module._Packed, "__init__", recording)
    model = _model(sequential=False)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 6, 16)
    cmodel = getattr(op, kind)(model, x, memory_limit="60%", fast_path=False,
                               bandwidth="1GB/s", **FIXED_TIMES)
    packed.clear()
    for _ in range(3):
        cmodel(x).square().mean()  # dropped: no backward
    gc.collect()
    assert packed and all(ref() is None for ref in packed)
    for call in (cmodel, plain):
        torch.manual_seed(3)
        call(x).square().mean().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "sequential"), [
    ("checkpoint", True), ("offload", False), ("remat_offload", True)])
def test_a_parameter_modified_between_forward_and_backward_raises_as_autograd_does(
        kind, sequential):
    """An optimizer step (here ``mul_``) on a weight between the forward and the backward:
    the plain model's backward raises autograd's "modified by an inplace operation"; so
    does the wrapper's. Before, the wrapper's ran in silence under checkpoint on an
    ``nn.Sequential``, offload and remat + offload (exported or not; checkpoint on an
    exported graph raised, its stored tapes checked by autograd): a re-run computed with the
    modified weight, and the offload executors' saved-tensor hooks turn autograd's check
    off. Put back, the same step runs and is the model's, bitwise."""
    one_liner, options = {"checkpoint": (op.checkpoint, {}),
                          "offload": (op.offload, {"bandwidth": "1GB/s"}),
                          "remat_offload": (op.remat_offload, {"bandwidth": "1GB/s"})}[kind]
    model = _model(sequential)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 6, 16)
    cmodel = one_liner(model, x, memory_limit="60%", fast_path=False, **options,
                       **FIXED_TIMES)
    for call, owner in ((plain, plain), (cmodel, model)):
        weight = [p for p in owner.parameters() if p.dim() == 2][0]  # the first block's up
        torch.manual_seed(3)
        loss = call(x).square().mean()
        with torch.no_grad():
            weight.mul_(1.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        with torch.no_grad():
            weight.div_(1.5)
        owner.zero_grad(set_to_none=True)
    for call in (plain, cmodel):
        torch.manual_seed(3)
        call(x).square().mean().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
