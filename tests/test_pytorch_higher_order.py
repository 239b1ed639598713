"""``retain_graph=True`` and double backward (``create_graph=True``) through the one-liners.

Stop 81: the checkpoint and remat + offload executors refused both (one ``RuntimeError``);
the offload executor supported double backward already. Every check compares with the
unwrapped model (same initialisation, same dropout seed): two losses on one trunk, one loss
backpropagated twice, a WGAN-GP gradient penalty, ``torch.autograd.functional.jacobian``,
and a normal step afterwards, which still follows the plan at the same exact peak. Plans
come from a constant time model (no timing decides them); the toy is in float64.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402, F401  (one thread)
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.memory import measure_training_peak  # noqa: E402

KINDS = {
    "checkpoint": (op.checkpoint, {}),
    "remat_offload": (op.remat_offload, {"bandwidth": "1MB/s"}),  # re-runs and transfers
    "offload": (op.offload, {"bandwidth": "10MB/s"}),
}


def _toy() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.2)) for _ in range(6)]
    return nn.Sequential(*blocks, nn.Linear(32, 3)).double()


X = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request):
    """``(plain, model, wrapper)``: the plain model, and a twin wrapped at 40 %."""
    kind, options = KINDS[request.param]
    model = _toy()
    wrapper = kind(model, X, memory_limit="40%", time_model=lambda *_: (1.0, 2.0),
                   repeats=1, warmup=0, fast_path=False, **options)
    plan = wrapper.result.plan
    if request.param != "offload":  # the plan re-runs stages in its backward
        forwards = [o.split()[1] for o in plan if o.startswith("F_")]
        assert len(forwards) > len(set(forwards)), plan
    if request.param != "checkpoint":
        assert any(o.startswith("offload") for o in plan), plan
    return _toy(), model, wrapper


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    out = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _assert_same(got, want, atol: float = 0.0) -> None:
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), k
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=f"tensor {k}")


def _both(pair, step):
    """``step(f)`` on the plain model, then on the wrapper (same dropout seed): for each,
    the parameter gradients, then what ``step`` returned."""
    plain, model, wrapper = pair
    results = []
    for f, m in ((plain, plain), (wrapper, model)):
        torch.manual_seed(5)
        extra = step(f)
        results.append([*_grads(m), *(extra or [])])
    return results


def test_two_losses_on_one_trunk(pair):
    def two_losses(f):
        out = f(X)
        out.square().sum().backward(retain_graph=True)
        out.sin().sum().backward()

    _assert_same(*_both(pair, two_losses))


def test_one_loss_backpropagated_twice_doubles_the_gradients(pair):
    plain, model, wrapper = pair
    firsts = []

    def twice(f):
        loss = f(X).square().mean()
        loss.backward(retain_graph=True)
        firsts.append([p.grad.clone() for p in (model if f is wrapper else plain).parameters()])
        loss.backward()

    got, want = _both(pair, twice)
    _assert_same(got, want)
    _assert_same(got, [2 * g for g in firsts[1]])


def test_gradient_penalty(pair):
    """WGAN-GP: ``autograd.grad(..., create_graph=True)``, then the penalty's backward.

    Parameter and input gradients: bitwise under remat + offload and offload; under
    checkpoint to float64 rounding (measured 4.3e-19): the native suffix's second-order
    term reaches the plan's stages through its normal backward, summed in another order.
    """
    def penalty(f):
        x = X.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        assert g.requires_grad
        (g.norm() ** 2).backward()
        return [x.grad, g.detach()]

    suffix = type(pair[2].executor).__name__ == "CheckpointedChain"  # a native suffix
    atol = 1e-15 if suffix else 0.0
    _assert_same(*_both(pair, penalty), atol=atol)


def test_jacobian(pair):
    """``torch.autograd.functional.jacobian``: one retained backward per output element."""
    got = []
    for f in pair[0], pair[2]:
        torch.manual_seed(6)
        got.append(torch.autograd.functional.jacobian(f, X))
    assert got[0].shape == (16, 3, 16, 32)
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)


def test_a_normal_step_afterwards_is_the_plans(pair):
    """A plain step after retained and double backwards: same gradients, same exact peak
    (on the compute device: the offload executor's host copies left out)."""
    plain, model, wrapper = pair

    def step(f):
        return lambda: f(X).square().mean().backward()

    def peak(f, m):
        torch.manual_seed(7)
        return measure_training_peak(step(f), m, X, host_copies=False)

    before = peak(wrapper, model)
    _grads(model)
    for f in (plain, wrapper):
        out = f(X)
        out.sum().backward(retain_graph=True)
        x = X.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        g.square().sum().backward()
        out.square().sum().backward()
    _grads(model)
    _grads(plain)
    assert peak(wrapper, model) == before < peak(plain, plain)
    _assert_same(*_both(pair, lambda f: step(f)()))


def _replays(wrapper) -> bool:
    """Whether the wrapper's executor runs a plan Function (not autograd's own graph)."""
    return type(wrapper.executor).__name__ != "OffloadedChain"


def test_a_second_backward_without_retain_graph_is_refused(pair):
    """As autograd refuses it for the plain model: the plan's error, or autograd's own
    where autograd's graph is met first (the checkpoint wrapper's native suffix, the
    offload executor)."""
    _, model, wrapper = pair
    out = wrapper(X)
    out.sum().backward()
    message = ("already backpropagated without retain_graph|"
               "backward through the graph a second time")
    with pytest.raises(RuntimeError, match=message):
        out.sum().backward()
    _grads(model)


def test_a_double_backward_needs_the_plans_input_alive(pair):
    """The plan's re-run starts from its input: freed (a temporary), one clear error."""
    _, model, wrapper = pair
    x0 = X.clone().requires_grad_()
    out = wrapper(x0 * 2)  # the plan's input is freed when the call returns
    if _replays(wrapper):
        with pytest.raises(RuntimeError, match="re-runs its stages from the plan's input"):
            torch.autograd.grad(out.sum(), x0, create_graph=True)
    else:  # the offload executor keeps autograd's graph: nothing to re-run
        (g,) = torch.autograd.grad(out.sum(), x0, create_graph=True)
        assert g.requires_grad
    _grads(model)


@pytest.mark.parametrize("once", [True, False])
def test_spectral_norm_under_a_double_backward(once):
    """A stage that updates its buffers in its forward (spectral norm's power iteration):
    re-run by the plan, its double backward replays it from the buffers its first run saw
    (the plain model's gradients, float64 rounding); run once (nothing saved before that
    run), one clear error instead of gradients 3e-3 off (measured before the check)."""
    import copy

    from torch.nn.utils.parametrizations import spectral_norm

    from optmem.pytorch.execute import CheckpointedChain

    torch.manual_seed(0)
    stages = [spectral_norm(nn.Linear(4, 4)).double(), nn.Tanh(), nn.Linear(4, 2).double()]
    ref = copy.deepcopy(stages)
    plan = (["F_all 1", "F_ck 2", "F_all 3", "Loss", "B 3", "F_all 2", "B 2", "B 1"] if once
            else ["F_ck 1", "F_ck 2", "F_all 3", "Loss", "B 3", "F_all 2", "B 2", "F_all 1",
                  "B 1"])
    chain = CheckpointedChain(stages, plan, strip_suffix=False)

    def penalty(f, params):
        x = X[:3, :4].clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x).square().sum(), x, create_graph=True)
        return torch.autograd.grad(g.square().sum(), params)

    want = penalty(nn.Sequential(*ref), [p for s in ref for p in s.parameters()])
    params = [p for s in stages for p in s.parameters()]
    if once:
        with pytest.raises(RuntimeError, match="updated its buffers in its only run"):
            penalty(chain, params)
    else:
        for a, b in zip(penalty(chain, params), want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
