"""Custom ``torch.autograd.Function`` calls keep their own backward through extraction.

``torch.export`` traces a custom Function's forward and drops its backward; before
:mod:`optmem.pytorch.custom_functions`, a wrapped straight-through estimator silently got
zero gradients. Each test runs the executor (``fast_path=False``) and compares with the
plain model bitwise; one test checks that the inlined graph (the old behaviour, forced by
monkeypatching) is indeed caught as wrong by the same comparison. Hooks an extracted graph
would drop (module backward hooks, tensor hooks registered in the forward) are refused with
one clear error; forward hooks get a warning (``optmem.pytorch.hooks``).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch import custom_functions  # noqa: E402
from optmem.pytorch.extract import extract_program, extract_stages  # noqa: E402


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: rounds forward, passes the gradient unchanged."""

    @staticmethod
    def forward(ctx, x, step):  # noqa: ANN001, ANN205
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g, None


class Reverse(torch.autograd.Function):
    """Gradient reversal (domain adaptation): identity forward (a view), ``-scale * g``."""

    @staticmethod
    def forward(ctx, x, scale):  # noqa: ANN001, ANN205
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return -ctx.scale * g, None


class LeanGelu(torch.autograd.Function):
    """Saves its input only and recomputes in its backward (as Bloom's ``GeLUFunction``)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
            (dx,) = torch.autograd.grad(y, x, g)
        return dx


class SplitScale(torch.autograd.Function):
    """Two outputs: ``(2x, x^2)``, backward by hand."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        return 2 * x, x * x

    @staticmethod
    def backward(ctx, g1, g2):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        return 2 * g1 + 2 * x * g2


class Net(nn.Module):
    def __init__(self, kind: str, layers: int = 6, width: int = 32) -> None:
        super().__init__()
        self.kind = kind
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = torch.tanh(lin(x))
            if self.kind == "ste":
                h = RoundSTE.apply(h, 0.25)
            elif self.kind == "reverse":
                h = Reverse.apply(h, 0.5) + 0.1 * h
            elif self.kind == "gelu":
                h = LeanGelu.apply(h)
            elif self.kind == "split":
                a, b = SplitScale.apply(h)
                h = a - b
            x = h + x
        return x.square().mean()


def _grads(call, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = call(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("kind", ["ste", "reverse", "gelu", "split"])
def test_custom_functions_keep_their_backward(kind: str) -> None:
    torch.manual_seed(0)
    model, x = Net(kind), torch.randn(8, 32)
    cmodel = op.checkpoint(model, (x,), memory_limit="60%", repeats=1, warmup=0,
                           fast_path=False)
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    ref = _grads(model, model, x)
    got = _grads(cmodel, model, x)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    graphs = [s.module.gm for s in extract_program(model, (x,)).stages]
    calls = sum(custom_functions.is_opaque_call(n) for gm in graphs for n in gm.graph.nodes)
    assert calls == 6  # one node per call, run by the Function itself


def test_the_inlined_forward_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deliberately wrong version (export's inlining, the old behaviour) differs."""
    monkeypatch.setattr(custom_functions, "_is_custom", lambda cls: False)
    torch.manual_seed(0)
    model, x = Net("ste"), torch.randn(8, 32)
    cmodel = op.checkpoint(model, (x,), memory_limit="60%", repeats=1, warmup=0,
                           fast_path=False)
    ref = _grads(model, model, x)
    got = _grads(cmodel, model, x)
    assert not all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))


def test_a_lean_function_is_profiled_as_lean() -> None:
    """Kept whole, LeanGelu saves its input only: the chain saves less than when inlined."""
    torch.manual_seed(0)
    model, x = Net("gelu", layers=2, width=64), torch.randn(16, 64)
    kept = op.profile_chain(model, (x,), repeats=1, warmup=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(custom_functions, "_is_custom", lambda cls: False)
        inlined = op.profile_chain(model, (x,), repeats=1, warmup=0)
    assert kept.store_all_peak() < inlined.store_all_peak()
    assert sum(kept.saved_size) < sum(inlined.saved_size)


def test_fx_refuses_custom_functions_with_one_clear_error() -> None:
    with pytest.raises(OptmemInputError, match=r"custom autograd Function .*RoundSTE.*torch\.fx"):
        extract_stages(Net("ste"))
    assert custom_functions._session() is None  # Function.apply is restored
    assert torch.autograd.Function.__dict__["apply"].__func__ is custom_functions._ORIGINAL_APPLY


class KeywordCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            x = RoundSTE.apply(torch.tanh(lin(x)), step=0.5)
        return x.sum()


def test_keyword_calls_are_refused_not_inlined() -> None:
    with pytest.raises(OptmemInputError, match="RoundSTE .*keyword arguments"):
        extract_program(KeywordCall(), (torch.randn(2, 8),))
    assert custom_functions._session() is None


class Hooked(nn.Module):
    def __init__(self, tensor_hook: bool = False) -> None:
        super().__init__()
        self.tensor_hook = tensor_hook
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = torch.tanh(lin(x))
            if self.tensor_hook and h.requires_grad:
                h.register_hook(lambda g: g * 0.5)
            x = h + x
        return x.square().mean()


def test_hooks_a_graph_would_drop_are_refused_or_reported() -> None:
    """Backward hooks and tensor hooks change gradients: refused, not silently lost.
    Forward hooks are traced: a warning says their side effects do not run again."""
    x = torch.randn(2, 8)
    model = Hooked()
    handle = model.lins[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    with pytest.raises(OptmemInputError, match=r"Hooked\.lins\.1 \(Linear\) has a backward hook"):
        op.checkpoint(model, (x,), memory_limit="60%", repeats=1, warmup=0)
    with pytest.raises(OptmemInputError, match="backward hook"):
        extract_stages(model)
    handle.remove()
    with pytest.raises(OptmemInputError, match=r"registers a tensor hook in its forward"):
        extract_program(Hooked(tensor_hook=True), (x,))
    assert torch.Tensor.register_hook.__qualname__ == "Tensor.register_hook"  # restored
    seen: list[tuple[int, ...]] = []
    model.lins[2].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    handle = model.lins[2].register_forward_hook(lambda m, i, o: o * 1.0)
    with pytest.warns(UserWarning, match=r"forward hooks on Hooked\.lins\.2"):
        cmodel = op.checkpoint(model, (x,), memory_limit="60%", repeats=1, warmup=0,
                               fast_path=False)
    seen.clear()
    cmodel(x).backward()
    assert seen == []  # next to a hook returning a value: as the warning says, not called
    handle.remove()  # an observer alone (stop 85): called once by each step, not warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cmodel = op.checkpoint(model, (x,), memory_limit="60%", repeats=1, warmup=0,
                               fast_path=False)
    seen.clear()
    cmodel(x).backward()
    assert seen == [(2, 8)]
    # the sequential route keeps the user's modules as stages: their hooks run
    seq = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    calls: list[int] = []
    seq[2].register_full_backward_hook(lambda m, gi, go: calls.append(1))
    cseq = op.checkpoint(seq, x, memory_limit="100%", repeats=1, warmup=0, fast_path=False)
    cseq(x).square().mean().backward()
    assert calls


class PythonLayerDrop(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        for lin in self.lins:
            draw = random.random() if self.source == "random" else np.random.random()  # noqa: NPY002
            if self.training and draw < 0.5:
                continue  # LayerDrop: the trace would skip the same layers forever
            x = torch.tanh(lin(x)) + x
        return x.square().mean()


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_python_randomness_in_the_forward_is_refused(source: str) -> None:
    x = torch.randn(2, 8)
    with pytest.raises(OptmemInputError, match=r"draws random numbers from .*random"):
        op.checkpoint(PythonLayerDrop(source), (x,), memory_limit="60%", repeats=1, warmup=0)
    model = PythonLayerDrop(source).eval()  # no draw decides anything... but draws happen
    with pytest.raises(OptmemInputError, match="layerdrop=0"):
        extract_program(model, (x,))


class EmaNorm(nn.Module):
    """Subtracts a running mean that it updates first (the output reads the new value)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.steps.add_(1)
        return x - self.mean


class EmaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.norms = nn.ModuleList(EmaNorm(16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.lins, self.norms, strict=True):
            x = torch.tanh(norm(lin(x))) + x
        return x.square().mean()


@pytest.mark.parametrize("spectral", [False, True])
def test_reruns_start_from_the_buffers_the_first_run_saw(spectral: bool) -> None:
    """Two steps: buffers updated once per step and gradients bitwise, for EMA normalisers
    and for spectral norm (its power iteration updates ``u`` before computing the weight).
    Starting re-runs from the updated buffers (the old behaviour) is caught."""
    import copy
    import warnings

    from optmem.pytorch import execute

    torch.manual_seed(0)
    model, x = EmaNet(), torch.randn(4, 16)
    if spectral:
        for lin in model.lins:
            nn.utils.spectral_norm(lin)
    plain = copy.deepcopy(model)

    def two_steps(call, owner):
        owner.zero_grad(set_to_none=True)
        for _ in range(2):
            call(x).backward()
        return [p.grad.clone() for p in owner.parameters()], {
            k: v.clone() for k, v in owner.state_dict().items()}

    ref = two_steps(plain, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # spectral norm's forward pre-hooks
        cmodel = op.checkpoint(model, (x,), memory_limit="70%", repeats=1, warmup=0,
                               fast_path=False)
    assert any(o.startswith("F_ck") for o in cmodel.result.plan)
    start = copy.deepcopy(model.state_dict())
    got = two_steps(cmodel, model)
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0], strict=True))
    assert all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    with pytest.MonkeyPatch.context() as mp:  # the old behaviour: no snapshot
        mp.setattr(execute._BufferSnapshot, "keep_changed", lambda self: False)
        model.load_state_dict(start)
        old = two_steps(cmodel, model)
    assert not all(torch.equal(a, b) for a, b in zip(old[0], ref[0], strict=True))


def test_parameter_hooks_run_once_per_step_and_never_while_profiling() -> None:
    """``p.register_hook`` (a gradient mask) and a post-accumulate hook (an optimizer step
    in the backward): the executor's own ``autograd.grad`` into the parameters must not run
    them (the hook halved the gradient twice), nor may profiling's steps (the
    post-accumulate hook ran once per profiled step). A no-op quieting is caught."""
    import contextlib

    from optmem.pytorch import execute

    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(2, 8)
    model.lins[1].weight.register_hook(lambda g: g * 0.5)
    calls: list[int] = []
    model.lins[2].weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    ref = _grads(model, model, x)
    assert calls == [1]
    cmodel = op.checkpoint(model, (x,), memory_limit="60%", repeats=1, warmup=0,
                           fast_path=False)
    assert calls == [1]  # wrapping (export, profiling, the plain measure) ran no hook
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    got = _grads(cmodel, model, x)
    assert calls == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(execute, "quiet_gradient_hooks",
                   lambda tensors, **kw: contextlib.nullcontext())
        wrong = _grads(cmodel, model, x)
    assert not all(torch.equal(a, b) for a, b in zip(wrong[1], ref[1], strict=True))


@pytest.mark.parametrize("wrap", ["checkpoint", "offload", "remat_offload"])
def test_torch_reentrant_checkpoint_inside_the_forward_trains_as_the_model(wrap):
    """``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)`` in the user's
    forward (HF's ``gradient_checkpointing_enable`` with ``use_reentrant: True``): on a
    block whose input needs no gradient (the first, on the data) and on blocks whose input
    does, loss and every gradient are bitwise the plain model's. Before, torch.export traced
    the Function's ``no_grad`` forward and the ``no_grad`` covered the rest of the graph:
    ``remat_offload`` gave every later parameter a ``None`` gradient in silence,
    ``checkpoint`` and ``offload`` failed with "element 0 of tensors does not require grad"."""
    import copy
    import warnings

    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, width_in: int = 8) -> None:
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(width_in, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin2(torch.relu(self.lin1(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.blocks[0], x, use_reentrant=True)  # x needs no grad
            for block in self.blocks[1:]:
                x = x + checkpoint(block, x, use_reentrant=True)
            return self.head(x)

    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    options = {} if wrap == "checkpoint" else {"bandwidth": "1GB/s"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: the first block's input needs no grad
        wrapped = getattr(op, wrap)(net, x, "100%", repeats=1, warmup=0, fast_path=False,
                                    **options)
    for _ in range(2):
        grads = []
        for model, owner in ((wrapped, net), (ref, ref)):
            owner.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = model(x).pow(2).mean()
            loss.backward()
            grads.append([loss] + [p.grad for p in owner.parameters()])
        assert [g is None for g in grads[0]] == [g is None for g in grads[1]]
        assert grads[1][1] is None and grads[1][-1] is not None  # the first block: no grad
        for a, b in zip(*grads, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0)


class CtcNet(nn.Module):
    """Frames -> log-probabilities -> ``nn.CTCLoss`` with lengths as tensors (as HF's)."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 6)
        self.loss = nn.CTCLoss(blank=0, reduction=reduction)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor
                ) -> torch.Tensor:
        for lin in self.lins:
            x = torch.tanh(lin(x))
        log_probs = self.head(x).log_softmax(-1).transpose(0, 1)  # (time, batch, classes)
        frames = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return self.loss(log_probs, targets, frames, lengths).sum()


def _ctc_sample(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 5])
    targets = torch.randint(1, 6, (int(lengths.sum()),), generator=g)  # concatenated
    return torch.randn(2, 12, 8, generator=g), targets, lengths


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ctc_loss_with_tensor_lengths_is_kept_whole_and_trains_as_the_model(reduction):
    """Before: ``DynamicOutputShapeException: aten._ctc_loss.Tensor`` (its fake kernel has
    no size for the alphas), so every HF ``...ForCTC`` model failed to extract. The
    traced graph holds ``optmem::ctc_loss``, restored to torch's own op."""
    torch.manual_seed(0)
    net = CtcNet(reduction)
    sample = _ctc_sample(1)
    ext = extract_program(net, sample)
    targets = [n.target for st in ext.stages for n in st.module.gm.graph.nodes]
    assert custom_functions.ctc_loss in targets and custom_functions.CTC_OP not in targets
    wrapped = op.checkpoint(net, sample, memory_limit="60%", repeats=1, warmup=0,
                            fast_path=False)
    other = _ctc_sample(2)  # other targets, other alphas: the same graph
    for call in (sample, other):
        net.zero_grad(set_to_none=True)
        wrapped(*call).backward()
        got = [p.grad.clone() for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        net(*call).backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(got, net.parameters(), strict=True))
    assert torch.ctc_loss is custom_functions.ctc_loss.__globals__["_ORIGINAL_CTC"]


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_traced_ctc_op_has_torchs_values_and_gradients(reduction):
    """``optmem::ctc_loss`` is only traced, but its own kernel and backward are right too."""
    g = torch.Generator().manual_seed(3)
    log_probs = torch.randn(12, 2, 6, generator=g).log_softmax(-1).requires_grad_()
    _, targets, lengths = _ctc_sample(4)
    frames = torch.full((2,), 12, dtype=torch.long)
    args = (targets, frames, lengths, 0, reduction, False)
    ours = custom_functions.CTC_OP(log_probs, *args)
    theirs = torch.ctc_loss(log_probs, *args)
    assert torch.equal(ours, theirs)
    weights = torch.rand(theirs.shape, generator=g)
    (mine,) = torch.autograd.grad(ours, log_probs, weights)
    (ref,) = torch.autograd.grad(theirs, log_probs, weights)
    assert torch.equal(mine, ref)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (log_probs.detach(), *args[:3])]
    with mode:
        fake = custom_functions.CTC_OP(*fakes, *args[3:])
    assert fake.shape == theirs.shape and fake.dtype == theirs.dtype
