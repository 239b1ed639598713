"""The store-all fast path: the wrapper calls the model itself when its plain step fits.

The plain model's real activation peak is measured while profiling
(``chain.extra["profile"]["plain_peak"]``, :func:`optmem.pytorch.memory.plain_step_peak`,
the definition of a real peak everywhere in optmem: :func:`measure_training_peak`). When it
is at most the memory limit, ``PlannedModule`` runs the model (no executor, no stages);
below it, or with ``fast_path=False``, the plan runs through the executor. No verdict
depends on time: the peaks are exact storage bytes, and whether the executor ran is counted
at its entry point.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402,F401  (one thread)

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.memory import measure_training_peak  # noqa: E402
from optmem.pytorch.wrapper import PLAIN_PEAK, with_plain_peak  # noqa: E402
from optmem.units import format_size  # noqa: E402

STORE_ALL = "store-all: the module is called directly; measured plain peak"


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers), torch.randn(8, 32)


class _ExecutorCalls:
    """Counts the calls of a wrapped model's executor (the plan's way in)."""

    def __init__(self, cmodel) -> None:
        self.executor = cmodel.executor
        self.calls = 0

    def __enter__(self) -> _ExecutorCalls:
        run = type(self.executor)._forward

        def counted(x, compiled):
            self.calls += 1
            return run(self.executor, x, compiled)

        self.executor._forward = counted
        return self

    def __exit__(self, *exc: object) -> None:
        del self.executor._forward


def _plain_step(net, x):
    """Loss (the output's sum), output and gradients of one step of ``net``."""
    net.zero_grad(set_to_none=True)
    out = net(x)
    loss = out.sum()
    loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    return out.detach(), grads


def _ops_of_step(cmodel, x):
    """Executor calls and the result of one step of ``cmodel``."""
    with _ExecutorCalls(cmodel) as count:
        got = _plain_step(cmodel, x)
    return count.calls, got


@pytest.fixture(scope="module")
def mlp():
    net, x = _mlp()
    chain = op.profile_chain(net, x, repeats=1, warmup=0)
    return net, x, chain


def test_plain_peak_is_the_measured_real_peak(mlp):
    net, x, chain = mlp
    peak = chain.extra["profile"][PLAIN_PEAK]
    assert all(p.grad is None for p in net.parameters())  # measuring left no gradient
    # the same step measured by hand: the output's backward with an all-ones seed (delta^L)
    real = measure_training_peak(lambda: net(x).backward(torch.ones(8, 32)), net, x)
    net.zero_grad(set_to_none=True)
    assert peak == real > 0


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_taken_at_the_plain_peak_and_not_below(mlp, kind):
    net, x, chain = mlp
    peak = chain.extra["profile"][PLAIN_PEAK]
    wrap = getattr(op, kind)
    options = {} if kind == "checkpoint" else {"bandwidth": "1GB/s"}
    ref = _plain_step(net, x)
    cmodel = wrap(net, x, memory_limit=peak, chain=chain, **options)
    assert cmodel.fast_path_taken
    ops, got = _ops_of_step(cmodel, x)
    assert ops == 0  # no executor: the model itself ran
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))
    net.zero_grad(set_to_none=True)
    real = measure_training_peak(lambda: cmodel(x).sum().backward(), net, x)
    assert real <= peak  # the same measure as the profile's, within the limit
    size = f"{format_size(peak)} ({peak} B)"
    assert f"{STORE_ALL} {size} <= limit {size}" in cmodel.summary()

    below = wrap(net, x, memory_limit=peak - 1, chain=chain, **options)
    assert not below.fast_path_taken
    ops, got = _ops_of_step(below, x)
    assert ops > 0 and torch.equal(got[0], ref[0])
    assert f"the plan runs through the executor (measured plain peak {size} > limit" \
        in below.summary()


def test_option_off_forces_the_executor(mlp):
    net, x, chain = mlp
    peak = chain.extra["profile"][PLAIN_PEAK]
    cmodel = op.checkpoint(net, x, memory_limit=2 * peak, chain=chain, fast_path=False)
    assert not cmodel.fast_path_taken
    ops, got = _ops_of_step(cmodel, x)
    ref = _plain_step(net, x)
    assert ops > 0 and torch.equal(got[0], ref[0])
    assert "the plan runs through the executor (fast_path=False;" in cmodel.summary()
    cmodel.fast_path = True  # an attribute: switched on again without a new solve
    assert cmodel.fast_path_taken and _ops_of_step(cmodel, x)[0] == 0


def test_resolve_and_use_plan_decide_again(mlp):
    net, x, chain = mlp
    peak = chain.extra["profile"][PLAIN_PEAK]
    cmodel = op.checkpoint(net, x, memory_limit=peak, chain=chain)
    cmodel.resolve(memory_limit=peak - 1)
    assert not cmodel.fast_path_taken
    cmodel.resolve(memory_limit=peak)
    assert cmodel.fast_path_taken
    plan = cmodel.result.plan
    cmodel.use_plan(plan)  # a given plan without a limit: the executor runs it
    assert not cmodel.fast_path_taken and "a given plan, no limit" in cmodel.summary()
    cmodel.use_plan(plan, memory_limit=peak)
    assert cmodel.fast_path_taken
    cmodel.use_plan(plan, memory_limit=peak - 1)
    assert not cmodel.fast_path_taken


def test_injected_peak_decides(mlp):
    net, x, chain = mlp
    store = chain.store_all_peak()
    # a plain peak below the chain's store-all: the limit admits the model, not the chain's
    # store-all plan (the dp recomputes), and the model is called
    low = with_plain_peak(chain, store // 2)
    cmodel = op.checkpoint(net, x, memory_limit=store // 2, chain=low)
    assert cmodel.result.plan != tuple(op.checkpoint(net, x, memory_limit=store,
                                                     chain=chain).result.plan)
    assert cmodel.fast_path_taken and _ops_of_step(cmodel, x)[0] == 0
    unknown = with_plain_peak(chain, None)  # not measured: never taken, and not re-measured
    cmodel = op.checkpoint(net, x, memory_limit=10 * store, chain=unknown)
    assert cmodel.chain.extra["profile"][PLAIN_PEAK] is None
    assert not cmodel.fast_path_taken and "was not measured" in cmodel.summary()


def test_measured_when_the_given_chain_lacks_it(mlp):
    net, x, chain = mlp
    profile = {k: v for k, v in chain.extra["profile"].items() if k != PLAIN_PEAK}
    old = dataclasses.replace(chain, extra={**chain.extra, "profile": profile})
    cmodel = op.checkpoint(net, x, memory_limit=chain.store_all_peak(), chain=old)
    assert cmodel.chain.extra["profile"][PLAIN_PEAK] == chain.extra["profile"][PLAIN_PEAK]


def test_wrapper_profile_records_it_without_a_chain():
    net, x = _mlp()
    cmodel = op.checkpoint(net, x, memory_limit="1MiB", repeats=1, warmup=0)
    assert cmodel.fast_path_taken
    assert cmodel.chain.extra["profile"][PLAIN_PEAK] > 0


def test_meta_profile_records_none():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    chain = op.profile_chain(net, torch.randn(4, 8, device="meta"), device="meta")
    assert chain.extra["profile"][PLAIN_PEAK] is None


def test_hf_model_on_the_fast_path():
    pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")
    from hf_helpers import assert_same, gpt2, step

    model, kwargs = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    chain = op.profile_chain(model, kwargs, repeats=1, warmup=0)
    peak = chain.extra["profile"][PLAIN_PEAK]
    cmodel = op.checkpoint(model, kwargs, memory_limit=peak, chain=chain)
    assert cmodel.fast_path_taken
    with _ExecutorCalls(cmodel) as count:
        got = step(cmodel, model, kwargs, seed=4)
    assert count.calls == 0
    assert_same(got, step(model, model, kwargs, seed=4), bitwise=True)  # type, keys, grads
    assert list(cmodel.state_dict()) == list(model.state_dict())
    params = list(model.parameters())
    ours = torch.autograd.grad(cmodel(**kwargs).loss, params, allow_unused=True)
    ref = torch.autograd.grad(model(**kwargs, use_cache=False).loss, params,
                              allow_unused=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    model.zero_grad(set_to_none=True)
    real = measure_training_peak(lambda: cmodel(**kwargs).loss.backward(), model,
                                 list(kwargs.values()))
    model.zero_grad(set_to_none=True)
    assert 0 < real <= peak
    with torch.no_grad():
        assert torch.equal(cmodel(**kwargs).logits, model(**kwargs).logits)
    compiled = torch.compile(cmodel, backend="aot_eager")
    assert_same(step(compiled, model, kwargs, seed=4), step(model, model, kwargs, seed=4),
                bitwise=False)
    assert cmodel._compiled_module is not None  # the model itself ran compiled
    cmodel.compile(backend="aot_eager")  # compiled in place: the next call compiles anew
    assert cmodel._compiled_module is None
    assert_same(step(cmodel, model, kwargs, seed=4), step(model, model, kwargs, seed=4),
                bitwise=False)
    assert cmodel._compiled_module is not None


def test_measuring_leaves_the_input_gradient_alone():
    net, _ = _mlp()
    x = torch.randn(8, 32, requires_grad=True)
    chain = op.profile_chain(net, x, repeats=1, warmup=0)
    assert chain.extra["profile"][PLAIN_PEAK] > 0
    assert x.grad is None and all(p.grad is None for p in net.parameters())


def test_the_fast_path_dispatches_the_plain_models_ops():
    """The same aten ops in the same order as the plain model's step (tiny BERT)."""
    pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")
    from hf_helpers import bert
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model, kwargs = bert()
    chain = op.profile_chain(model, kwargs, repeats=1, warmup=0)
    cmodel = op.checkpoint(model, kwargs, memory_limit=chain.extra["profile"][PLAIN_PEAK],
                           chain=chain)
    seen = []
    for call in (model, cmodel, model):
        model.zero_grad(set_to_none=True)
        with Ops() as trace:
            call(**kwargs).loss.backward()
        seen.append(trace.ops)
    model.zero_grad(set_to_none=True)
    assert seen[0] == seen[2]  # the trace itself is reproducible
    assert seen[1] == seen[0] and len(seen[0]) > 100


@pytest.mark.parametrize("option", ["fast_path", "autotune"])
def test_switches_take_bools_only(option: str) -> None:
    """``fast_path="no"`` is one clear error, not a truthy string that turns the path on."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(OptmemInputError, match=option):
        op.checkpoint(model, torch.randn(4, 8), memory_limit=10**9, **{option: "no"})
