"""Random architectures through the bridge: a wrapped module trains like the module it wraps.

Hypothesis draws small models from a zoo of blocks that each stress one promise of the
executors:

* ``drop`` and ``noise``: random ops, whose re-run must draw what the first run drew;
* ``bn``: buffers a training forward updates (a re-run must not update them twice);
* ``buffer`` / ``buffer_np``: persistent and non-persistent buffers read by the forward;
* ``tied``: one ``Linear`` called at two places of the chain;
* ``frozen``: parameters without gradients; ``detach``: a branch cut from autograd;
* ``inplace`` / ``iadd`` / ``imul``: in-place ops inside a stage;
* long skips: a block's output added to the input of a later block (values that live
  across stages).

Each model is wrapped by ``op.checkpoint`` (through the executor: ``fast_path=False``),
``op.offload`` or ``op.remat_offload`` at a drawn fraction of its store-all peak (the
smallest feasible limit when that fraction has no plan) and must give the plain model's
output, loss, parameter and input gradients bitwise, the same ``state_dict`` keys, and the
same buffers after the step. ``test_the_comparison_catches_a_double_buffer_update`` shows
the comparison can fail: with ``restore_buffers=False`` a re-run batch norm updates its
running statistics twice.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402,F401  (one thread)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.plan import Op, OpKind  # noqa: E402

D = 16
"""Feature width of every block."""

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}
KINDS = ("linear", "act", "ln", "bn", "drop", "noise", "res", "gate", "detach", "buffer",
         "buffer_np", "frozen", "inplace", "iadd", "imul", "tied")
FORWARDS = (OpKind.F_ALL, OpKind.F_CK, OpKind.F_NONE)
METHODS = {"checkpoint": "checkpoint", "offload": "offload", "remat_offload": "remat_offload"}


class Residual(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.a, self.b, self.act = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), ACTS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.act(self.a(x)))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(x))


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * self.a(x).detach() + self.a(x)


class Buffered(nn.Module):
    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D), persistent=persistent)
        self.a = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.scale


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x))


class Inplace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1.0).relu_()


class IAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).tanh()
        x = x * 1.0
        x += y
        return x


class IMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.mul_(torch.sigmoid(x))
        return y


class Noise(nn.Module):
    """A random op other than dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x)


def block(kind: str, act: str, linears: list[nn.Module]) -> nn.Module:
    """One block of the zoo; ``tied`` reuses the first ``linear`` drawn (or makes one)."""
    simple: dict[str, Any] = {
        "act": lambda: ACTS[act](), "ln": lambda: nn.LayerNorm(D),
        "bn": lambda: nn.BatchNorm1d(D), "drop": lambda: nn.Dropout(0.2), "noise": Noise,
        "res": lambda: Residual(act), "gate": Gate, "detach": Detached,
        "buffer": lambda: Buffered(True), "buffer_np": lambda: Buffered(False),
        "frozen": Frozen, "inplace": Inplace, "iadd": IAdd, "imul": IMul}
    if kind in simple:
        return simple[kind]()
    if kind == "tied" and linears:
        return linears[0]
    linear = nn.Linear(D, D)
    linears.append(linear)
    return linear


class Looped(nn.Module):
    """A forward that loops over its blocks (the ``torch.export`` path), with long skips."""

    def __init__(self, blocks: list[nn.Module], skips: list[tuple[int, int]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.skips = skips
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for i, b in enumerate(self.blocks):
            for src, dst in self.skips:
                if dst == i:
                    x = x + outs[src]
            x = b(x)
            outs.append(x)
        return self.head(x)


@st.composite
def models(draw: Any) -> tuple[list[tuple[str, str]], bool, list[tuple[int, int]]]:
    """A block list, whether the model is a ``Sequential`` or a loop, and its long skips."""
    spec = draw(st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(sorted(ACTS))),
                         min_size=2, max_size=7))
    looped = draw(st.booleans())
    skips: list[tuple[int, int]] = []
    if looped:
        pairs = [(s, d) for d in range(len(spec)) for s in range(d)]
        skips = draw(st.lists(st.sampled_from(pairs), max_size=2, unique=True))
    return spec, looped, skips


def build(spec: list[tuple[str, str]], looped: bool, skips: list[tuple[int, int]]
          ) -> nn.Module:
    torch.manual_seed(0)
    linears: list[nn.Module] = []
    blocks = [block(kind, act, linears) for kind, act in spec]
    if looped:
        return Looped(blocks, skips)
    return nn.Sequential(*blocks, nn.Linear(D, 3))


def wrap(module: nn.Module, sample: Any, method: str, percent: int, **options: Any
         ) -> nn.Module:
    """``method``'s wrapper at ``percent`` % of store-all, or at its smallest limit."""
    kwargs: dict[str, Any] = {"repeats": 1, "warmup": 0, **options}
    if method == "checkpoint":
        kwargs.setdefault("fast_path", False)
    fn = getattr(op, METHODS[method])
    try:
        return fn(module, sample, memory_limit=f"{percent}%", **kwargs)
    except OptmemInputError:
        return fn(module, sample, memory_limit="min", **kwargs)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().mean()


def train_step(call: Any, owner: nn.Module, x: torch.Tensor) -> list[Any]:
    """Output, loss, parameter gradients, input gradient and buffers after one step."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    y = call(x)
    loss = loss_of(y)
    loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in owner.parameters()]
    xg = None if x.grad is None else x.grad.clone()
    x.grad = None
    owner.zero_grad(set_to_none=True)
    return [y.detach(), loss.detach(), *grads, xg, *[b.clone() for b in owner.buffers()]]


def assert_same(ref: list[Any], got: list[Any]) -> None:
    assert len(ref) == len(got)
    for k, (u, v) in enumerate(zip(ref, got, strict=True)):
        assert (u is None) == (v is None), f"item {k}: None on one side only"
        if u is not None:
            assert u.shape == v.shape and torch.equal(u, v), (
                f"item {k} differs by {(u.float() - v.float()).abs().max().item():.3g}")


@settings(max_examples=12)
@given(model=models(), method=st.sampled_from(sorted(METHODS)),
       percent=st.integers(5, 100), train=st.booleans(), input_grad=st.booleans())
def test_random_models_train_like_the_plain_model(model, method, percent, train, input_grad):
    plain = build(*model).train(train)
    work = copy.deepcopy(plain)
    x = torch.randn(6, D, requires_grad=input_grad)
    wrapped = wrap(work, x, method, percent).train(train)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert_same(train_step(plain, plain, x), train_step(wrapped, work, x))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, wrapped.state_dict()[key]), key


def grad_and_steps(call: Any, owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``autograd.grad`` of one call, then three SGD steps: losses, parameters, buffers."""
    params = [p for p in owner.parameters() if p.requires_grad]
    torch.manual_seed(3)
    y = call(x)
    grads = torch.autograd.grad(loss_of(y), params, allow_unused=True)
    out = [y.detach(), *[g for g in grads if g is not None]]
    sgd = torch.optim.SGD(params, lr=0.1)
    for _ in range(3):
        sgd.zero_grad(set_to_none=True)
        loss = loss_of(call(x))
        loss.backward()
        sgd.step()
        out.append(loss.detach())
    return out + [p.detach().clone() for p in params] + [b.clone() for b in owner.buffers()]


@settings(max_examples=6)
@given(model=models(), method=st.sampled_from(sorted(METHODS)),
       percent=st.integers(5, 100), train=st.booleans())
def test_random_models_under_autograd_grad_and_an_optimizer(model, method, percent, train):
    plain = build(*model).train(train)
    work = copy.deepcopy(plain)
    x = torch.randn(6, D)
    wrapped = wrap(work, x, method, percent).train(train)
    assert_same(grad_and_steps(plain, plain, x), grad_and_steps(wrapped, work, x))


def test_the_comparison_catches_a_double_buffer_update():
    """Without ``restore_buffers`` the re-run batch norm's statistics are updated twice."""
    spec = [("linear", "relu"), ("bn", "relu"), ("act", "relu"), ("linear", "relu"),
            ("act", "relu")]
    plain = build(spec, False, []).train()
    x = torch.randn(6, D)
    steps = {}
    for restore in (True, False):
        work = copy.deepcopy(plain)
        wrapped = wrap(work, x, "checkpoint", 0, restore_buffers=restore).train()
        ops = [Op.parse(text) for text in wrapped.result.plan]
        forwards = Counter(o.stage for o in ops if o.kind in FORWARDS)
        assert max(forwards.values()) > 1, "the plan re-runs no stage"
        steps[restore] = train_step(wrapped, work, x)
    ref = train_step(plain, plain, x)
    assert_same(ref, steps[True])
    with pytest.raises(AssertionError, match="differs"):
        assert_same(ref, steps[False])
