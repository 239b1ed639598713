"""Forward hooks that change after wrapping, hooks on the model itself, global hooks (stop 86).

Stop 85 made the *observers* of inner modules (hooks returning ``None``) run at every step.
Left were silent differences, each measured here against a deep copy of the model under
the same seeds (losses and gradients bitwise, the hooks' calls):

* a hook that returns a value is traced into the graph: a steering strength ``alpha``
  (a Python float its code reads) changed between steps changed nothing (the loss of the
  tanh MLP 0.0384 where the model gave 0.0315). The values such a hook reads are now
  recorded and a change extracts again, with one warning;
* a hook that returns ``None`` but writes its output in place (``o.mul_(0.5)``) was both
  traced and called at every step: applied twice (``op.checkpoint``), or an autograd error
  about a view (``op.offload``). It is now in the graph only;
* the model's own hooks (``model.register_forward_hook``) were traced at wrapping and
  never called by a step: an observer saw no step, one returning a value kept the
  values of the trace. The wrapper now calls them around the plan, as ``nn.Module``'s call
  does;
* a global module forward hook (``register_module_forward_hook``) returning a value for
  ``nn.Linear`` modules changed the plain model's numbers and not the wrapper's: warned.
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

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def _wrap(kind: str, model: nn.Module, sample: Any) -> nn.Module:
    wrap, options = hunt_kinds()[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hooks traced into the graph are named
        cmodel = wrap(model, sample, **HUNT_FIXED, **options)
    assert cmodel.extraction is not None
    if kind == "checkpoint":
        assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan), "no re-run"
    return cmodel


def _step(call: Callable[[], torch.Tensor], model: nn.Module, seed: int) -> list[torch.Tensor]:
    """One training step's loss and gradients (then cleared)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = call()
    loss.backward()
    seen = [loss.detach(), *(p.grad.clone() for p in model.parameters())]
    model.zero_grad(set_to_none=True)
    return seen


def _assert_same(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b), (a.flatten()[:3], b.flatten()[:3])


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_a_steering_hooks_strength_changed_after_wrapping_is_followed(kind: str) -> None:
    """``return out + alpha * v`` with ``alpha`` a float changed between steps: before
    stop 86 the graph kept the alpha of the trace (loss 0.0384 for 0.0315, in silence)."""
    model = Mlp()
    ref = copy.deepcopy(model)
    state = {"alpha": 0.5}
    v = torch.linspace(-1, 1, 16)
    for m in (model, ref):
        m.layers[2].register_forward_hook(lambda mod, a, o: o + state["alpha"] * v)
    cmodel = _wrap(kind, model, X)
    _assert_same(_step(lambda: cmodel(X), model, 0), _step(lambda: ref(X), ref, 0))
    state["alpha"] = 2.0
    with pytest.warns(UserWarning, match=r"returns a value .* reads alpha\b.*which changed"):
        got = _step(lambda: cmodel(X), model, 1)
    _assert_same(got, _step(lambda: ref(X), ref, 1))
    state["alpha"] = -1.0  # a no_grad call first (the model runs itself), then a step
    with torch.no_grad():
        assert torch.equal(cmodel(X), ref(X))
    _assert_same(_step(lambda: cmodel(X), model, 2), _step(lambda: ref(X), ref, 2))
    v.add_(1.0)  # a tensor updated in place: the graph reads it at every call
    _assert_same(_step(lambda: cmodel(X), model, 3), _step(lambda: ref(X), ref, 3))


class Steering:
    """A steering hook as an object (its strength an attribute), on a pre-hook with kwargs."""

    def __init__(self) -> None:
        self.alpha = 1.0

    def __call__(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (args[0] * self.alpha, *args[1:]), kwargs


def test_a_pre_hook_object_on_a_gpt2_block_follows_its_attribute() -> None:
    model, kwargs = hf_helpers.gpt2()
    ref = copy.deepcopy(model)
    steer, steer_ref = Steering(), Steering()
    model.transformer.h[1].mlp.register_forward_pre_hook(steer, with_kwargs=True)
    ref.transformer.h[1].mlp.register_forward_pre_hook(steer_ref, with_kwargs=True)
    cmodel = _wrap("checkpoint", model, kwargs)
    _assert_same(_step(lambda: cmodel(**kwargs).loss, model, 0),
                 _step(lambda: ref(**kwargs).loss, ref, 0))
    steer.alpha = steer_ref.alpha = 3.0
    with pytest.warns(UserWarning, match=r"reads alpha\b.*which changed"):
        got = _step(lambda: cmodel(**kwargs).loss, model, 1)
    _assert_same(got, _step(lambda: ref(**kwargs).loss, ref, 1))


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_a_hook_writing_its_output_in_place_is_applied_once(kind: str) -> None:
    """It returns ``None`` but ``o.mul_(0.5)``: before stop 86 it was taken for an
    observer, so traced and called again at every step (the loss 0.0394 for 0.0418 under
    op.checkpoint; under op.offload an autograd error about a view modified in place)."""
    model = Mlp()
    ref = copy.deepcopy(model)

    def halve(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        out.mul_(0.5)

    for m in (model, ref):
        m.layers[2].register_forward_hook(halve)
    cmodel = _wrap(kind, model, X)
    for seed in range(2):
        _assert_same(_step(lambda: cmodel(X), model, seed), _step(lambda: ref(X), ref, seed))


def _root_hooks(model: nn.Module, log: list[str], state: dict[str, float]) -> None:
    def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        log.append("pre")
        return (args[0] * state["alpha"],), dict(kwargs)  # new arguments

    def post(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        log.append("post")
        return out * state["beta"]

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post)
    model.register_forward_hook(lambda mod, a, o: log.append("observer"), prepend=True)


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_the_models_own_hooks_are_called_around_the_plan_at_every_step(kind: str) -> None:
    """Before stop 86 the model's own hooks ran at wrapping (on fake tensors, then twice on
    real ones in the measuring runs) and never in a step; their values stayed those of
    the trace."""
    model = Mlp()
    ref = copy.deepcopy(model)
    log: list[str] = []
    ref_log: list[str] = []
    state = {"alpha": 0.5, "beta": 2.0}
    _root_hooks(model, log, state)
    _root_hooks(ref, ref_log, state)
    cmodel = _wrap(kind, model, X)
    assert log == []  # neither the export nor the measuring runs called them
    ext = cmodel.extraction
    for seed in range(3):
        _assert_same(_step(lambda: cmodel(X), model, seed), _step(lambda: ref(X), ref, seed))
        assert log == ref_log == ["pre", "observer", "post"] * (seed + 1)
        state["alpha"], state["beta"] = state["alpha"] + 0.25, state["beta"] - 0.5
    late = model.register_forward_hook(lambda mod, a, o: o + 1.0)
    late_ref = ref.register_forward_hook(lambda mod, a, o: o + 1.0)
    _assert_same(_step(lambda: cmodel(X), model, 3), _step(lambda: ref(X), ref, 3))
    late.remove()
    late_ref.remove()
    _assert_same(_step(lambda: cmodel(X), model, 4), _step(lambda: ref(X), ref, 4))
    assert cmodel.extraction is ext  # the model's own hooks are outside the graph


def test_the_root_hooks_of_gpt2_see_each_steps_output() -> None:
    model, kwargs = hf_helpers.gpt2()
    ref = copy.deepcopy(model)
    seen: list[float] = []
    ref_seen: list[float] = []
    for m, out in ((model, seen), (ref, ref_seen)):
        m.register_forward_hook(lambda mod, a, o, out=out: out.append(o.loss.item()))
    cmodel = _wrap("remat_offload", model, kwargs)
    for seed in range(2):
        _assert_same(_step(lambda: cmodel(**kwargs).loss, model, seed),
                     _step(lambda: ref(**kwargs).loss, ref, seed))
    assert seen == ref_seen and len(seen) == 2


def test_a_users_global_forward_hook_is_warned_and_torchs_tools_are_not() -> None:
    """A global hook changing ``nn.Linear`` outputs changed the plain model's numbers, not
    the wrapper's (its stages are optmem's), in silence: one warning per hook in stop 86;
    since stop 87 such a hook is traced into the graph (``test_torch_hooks_stop87.py``),
    and a global *observer* is warned (it sees optmem's stage calls)."""
    from torch.nn.modules.module import register_module_forward_hook
    from torch.utils.module_tracker import ModuleTracker

    model = Mlp()
    cmodel = _wrap("checkpoint", model, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModuleTracker():  # torch's own tool: its global hooks are not named
            cmodel(X).backward()
    seen: list[str] = []

    def note(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen.append(type(mod).__name__)

    handle = register_module_forward_hook(note)
    try:
        with pytest.warns(UserWarning, match=r"global module forward hook is registered "
                                             r"\(.*note"):
            cmodel(X).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per hook
            cmodel(X).backward()
    finally:
        handle.remove()
