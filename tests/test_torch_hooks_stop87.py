"""Global module hooks that return a value, and what a hook reads, followed (stop 87).

Left by stop 86, each measured here against a deep copy of the model under the same
seeds (3 SGD steps: losses, every gradient and the parameters after, bitwise):

* a user's global module forward hook (``register_module_forward_hook``) returning
  ``o * alpha`` for every ``nn.Linear`` changed the plain model's numbers and not the
  wrapper's, under one warning (the tanh MLP's loss 0.0458 where the model gave 0.0039;
  the wrapper's setup runs without the global hooks, so the graph lacked it). It is now
  called on the model's modules while the wrapper exports, so its effect is in the graph;
  registering, removing it or changing what it reads extracts again; a hook that changes
  optmem's own modules' outputs too is refused with one ``OptmemInputError``;
* a steering value read by a function the hook calls (``steer(o)`` reading
  ``CFG.alpha``) or two attribute levels down (``cfg.steer.alpha``) was not recorded: a
  change after wrapping kept the trace's value;
* a module global sharing its name with an attribute the hook reads (``self.alpha`` and a
  global ``alpha``) was recorded: changing it extracted again for nothing.
"""

from __future__ import annotations

import copy
import io
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers", reason="the GPT-2 checks need transformers")

from pytorch_helpers import HUNT_FIXED, Mlp, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.modules.module import (  # noqa: E402
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

import optmem.pytorch.wrapper as wrapper_mod  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.wrapper import hook_reads  # noqa: E402

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
KINDS = ["checkpoint", "offload", "remat_offload"]

CFG = types.SimpleNamespace(alpha=0.5)  # read by the helper below, not by the hook itself
V = torch.linspace(-1, 1, 32)
alpha = 1.0  # a global sharing its name with the attribute Steering's hook reads


def steer(o: torch.Tensor) -> torch.Tensor:
    """A module-level helper a hook calls: the value it reads is ``CFG.alpha``."""
    return o + CFG.alpha * V[: o.shape[-1]]


class Steering:
    """A steering hook as an object: it reads ``self.alpha`` (an attribute, not the global)."""

    def __init__(self) -> None:
        self.alpha = 0.5

    def __call__(self, mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
        return out * self.alpha


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_loss(model: nn.Module) -> torch.Tensor:
    return model(input_ids=IDS, labels=IDS).loss


def _wrap(kind: str, model: nn.Module, sample: Any) -> nn.Module:
    wrap, options = hunt_kinds()[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inner hooks traced into the graph are named
        cmodel = wrap(model, sample, **HUNT_FIXED, **options)
    if kind == "checkpoint":
        assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan), "no re-run"
    return cmodel


def _steps(
    model: nn.Module, loss: Callable[[], torch.Tensor], between: Callable[[int], None], n: int = 3
) -> list[torch.Tensor]:
    """``n`` SGD steps: each loss and gradient, then the parameters; ``between(k)`` first."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    for k in range(n):
        between(k)
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        value = loss()
        value.backward()
        seen += [value.detach().clone(), *(p.grad.clone() for p in model.parameters())]
        opt.step()
    return seen + [p.detach().clone() for p in model.parameters()]


def _assert_same(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b), (a.flatten()[:3], b.flatten()[:3])


@pytest.fixture
def extractions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times the wrapper extracts (exports) a call, in a one-element list."""
    count = [0]
    original = wrapper_mod.extracted_call

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(wrapper_mod, "extracted_call", counting)
    yield count


@pytest.fixture
def handles() -> Iterator[list[Any]]:
    """The global hooks a test registers, removed after it whatever happens."""
    made: list[Any] = []
    yield made
    for handle in made:
        handle.remove()


@pytest.mark.parametrize("kind", KINDS)
def test_a_global_hook_returning_a_value_is_in_the_graph(kind: str, handles: list[Any]) -> None:
    """``o * alpha`` for every ``nn.Linear``, registered before wrapping, ``alpha`` changed
    between steps, removed before the last: before stop 87 the wrapper's numbers were the
    model's without the hook (loss 0.0458 for 0.0039), under one warning."""
    model = Mlp()
    ref = copy.deepcopy(model)
    state = {"alpha": 0.5}

    def scale(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        return out * state["alpha"] if isinstance(mod, nn.Linear) else None

    def schedule(k: int) -> None:
        state["alpha"] = 0.5 + 0.25 * k
        if k == 2:
            for handle in handles:
                handle.remove()
            handles.clear()

    handles.append(register_module_forward_hook(scale))
    cmodel = _wrap(kind, model, X)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "a global module forward hook is registered")
        got = _steps(model, lambda: cmodel(X), schedule)
    handles.append(register_module_forward_hook(scale))
    _assert_same(got, _steps(ref, lambda: ref(X), schedule))


@pytest.mark.parametrize("kind", KINDS)
def test_a_global_hook_registered_after_wrapping_gpt2(kind: str, handles: list[Any]) -> None:
    """GPT-2's head is an ``nn.Linear``: a global hook scaling it, registered after wrapping
    (and a global pre-hook on the same), ``alpha`` changed between steps."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    state = {"alpha": 0.5}

    def scale(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        return out * state["alpha"] if isinstance(mod, nn.Linear) else None

    def shift(mod: nn.Module, args: tuple[Any, ...]) -> Any:
        return (args[0] + 0.1,) if isinstance(mod, nn.Linear) else None

    def schedule(k: int) -> None:
        state["alpha"] = 0.5 + 0.25 * k

    cmodel = _wrap(kind, model, {"input_ids": IDS, "labels": IDS})
    handles += [register_module_forward_hook(scale), register_module_forward_pre_hook(shift)]
    got = _steps(model, lambda: _gpt2_loss(cmodel), schedule)
    _assert_same(got, _steps(ref, lambda: _gpt2_loss(ref), schedule))


def test_a_global_observer_stays_as_before(handles: list[Any], extractions: list[int]) -> None:
    """A global hook returning ``None`` is not in the graph: warned (it sees optmem's stage
    calls), bitwise; registered again around each step (a tracker of the user's) it
    extracts once, not at every step."""
    model = Mlp()
    ref = copy.deepcopy(model)
    cmodel = _wrap("checkpoint", model, X)
    start = extractions[0]
    seen: list[str] = []

    def note(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen.append(type(mod).__name__)

    def around(k: int) -> None:
        for handle in handles:
            handle.remove()
        handles[:] = [register_module_forward_hook(note)]

    with pytest.warns(UserWarning, match=r"global module forward hook is registered \(.*note"):
        got = _steps(model, lambda: cmodel(X), around)
    _assert_same(got, _steps(ref, lambda: ref(X), lambda k: None))
    assert extractions[0] == start + 1  # its first registration: then known to observe
    assert "OptmemStage" in seen  # called on optmem's stages, as before


def test_a_global_hook_changing_every_modules_output_is_refused(handles: list[Any]) -> None:
    """A hook scaling every module's output applies on the plain model at every level;
    on the wrapper it would apply to optmem's stages too: one ``OptmemInputError``
    (before stop 87 the loss was 0.0000 for 0.0020, under a warning)."""
    model = Mlp()
    cmodel = _wrap("checkpoint", model, X)

    def everywhere(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        return out * 0.5 if isinstance(out, torch.Tensor) else None

    handles.append(register_module_forward_hook(everywhere))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            OptmemInputError,
            match=r"everywhere changes the output of "
            r"optmem's own module",
        ):
            cmodel(X)


def test_a_saved_wrapper_without_its_global_hook_is_refused(handles: list[Any]) -> None:
    """Saved while a global hook was in its graph, loaded once the hook is gone: one
    ``OptmemInputError`` at the step (the graph still scales by 0.5, the model no more)."""
    model = Mlp()
    handles.append(
        register_module_forward_hook(
            lambda mod, args, out: out * 0.5 if isinstance(mod, nn.Linear) else None
        )
    )
    wrap, options = hunt_kinds()["checkpoint"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmodel = wrap(model, X, **{**HUNT_FIXED, "time_model": _fixed_times}, **options)
    twin = copy.deepcopy(cmodel)  # a copy in the process watches the hook as the original
    buffer = io.BytesIO()
    torch.save(cmodel, buffer)
    handles.pop().remove()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with pytest.raises(OptmemInputError, match="no longer registered"):
        loaded(X)
    assert torch.equal(twin(X), model(X))  # the copy extracted again: the model's numbers


def _fixed_times(*_: Any) -> tuple[float, float]:
    return 1.0, 2.0


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_read_by_a_helper_the_hook_calls_is_followed(kind: str) -> None:
    """``lambda m, a, o: steer(o)`` with ``steer`` reading ``CFG.alpha``: before stop 87
    the change after wrapping was ignored (the trace's value)."""
    model = Mlp()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.layers[2].register_forward_hook(lambda mod, a, o: steer(o))

    def schedule(k: int) -> None:
        CFG.alpha = 0.5 + 0.5 * k

    schedule(0)
    cmodel = _wrap(kind, model, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extracting again for the new value: warned
        got = _steps(model, lambda: cmodel(X), schedule)
    _assert_same(got, _steps(ref, lambda: ref(X), schedule))


def test_a_value_two_attribute_levels_down_is_followed_on_gpt2() -> None:
    """``o * cfg.steer.alpha`` on a GPT-2 block's MLP: before stop 87 one level was
    recorded (``cfg``'s own attributes), so the change was ignored."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    cfg = types.SimpleNamespace(steer=types.SimpleNamespace(alpha=0.5))
    for m in (model, ref):
        m.transformer.h[0].mlp.register_forward_hook(lambda mod, a, o: o * cfg.steer.alpha)

    def schedule(k: int) -> None:
        cfg.steer.alpha = 0.5 + 0.5 * k

    cmodel = _wrap("remat_offload", model, {"input_ids": IDS, "labels": IDS})
    with pytest.warns(UserWarning, match=r"reads alpha\b.*which changed"):
        got = _steps(model, lambda: _gpt2_loss(cmodel), schedule)
    _assert_same(got, _steps(ref, lambda: _gpt2_loss(ref), schedule))


def test_a_global_named_as_an_attribute_the_hook_reads_extracts_nothing(
    extractions: list[int],
) -> None:
    """``self.alpha`` in the hook, a module global ``alpha`` changed: before stop 87 the
    global was recorded too, and each change extracted again for nothing."""
    global alpha
    model = Mlp()
    ref = copy.deepcopy(model)
    model.layers[2].register_forward_hook(Steering())
    ref.layers[2].register_forward_hook(Steering())
    cmodel = _wrap("checkpoint", model, X)
    start = extractions[0]

    def schedule(k: int) -> None:
        global alpha
        alpha = 1.0 + k

    got = _steps(model, lambda: cmodel(X), schedule)
    assert extractions[0] == start
    alpha = 1.0
    _assert_same(got, _steps(ref, lambda: ref(X), schedule))


def test_hook_reads_walks_a_bounded_graph_of_user_values() -> None:
    """What :func:`hook_reads` records: through helpers and nested objects, each once,
    never into modules, tensors or library functions; nothing for a hook reading none."""
    assert hook_reads(lambda m, a, o: o * 2.0) == []
    assert hook_reads(lambda m, a, o: torch.tanh(o) if isinstance(m, nn.Linear) else None) == []
    looped = types.SimpleNamespace(gain=2.0)
    looped.me = looped  # a cycle
    names = {name for _, name, _ in hook_reads(lambda m, a, o: steer(o) * looped.gain)}
    assert names == {"alpha", "V", "gain"}  # through steer: CFG.alpha, V (by identity)
    assert {type(v) for _, _, v in hook_reads(lambda m, a, o: steer(o))} == {float, torch.Tensor}
    deep = types.SimpleNamespace(
        a=types.SimpleNamespace(
            b=types.SimpleNamespace(
                c=types.SimpleNamespace(d=types.SimpleNamespace(e=types.SimpleNamespace(f=1.0)))
            )
        )
    )
    assert hook_reads(lambda m, a, o: o * deep.a.b.c.d.e.f) == []  # past the depth limit
    layer = nn.Linear(2, 2)
    assert hook_reads(lambda m, a, o: layer(o)) == []  # a module's state is checked elsewhere
    assert [name for _, name, _ in hook_reads(Steering())] == ["alpha"]  # not the global
    state = types.SimpleNamespace(alpha=0.5, step=0)  # a counter the loop moves, unread
    assert [name for _, name, _ in hook_reads(lambda m, a, o: o * state.alpha)] == ["alpha"]
