"""Hunt of the torch bridge on training-step and deployment patterns (stop 85;
``docs/pytorch.md``, "Stop 85 (training-step patterns)").

The training steps tried (one wrapped model called several times before one backward, GAN
steps with both nets wrapped, adversarial input gradients, partial and multi-output
backwards, user checkpointing around the wrapper, a wrapped part of a larger model, the
epoch's smaller last batch with accumulation, deterministic algorithms) were bitwise the
plain model's. Deploying was not: ``torch.export.export(cmodel, ...)`` failed with torch's
"Non-recursive torch.compiler.disable is not supported with torch.export" (an
``nn.Sequential``) or ``'_SignedForward' object has no attribute '__code__'`` (an exported
module), ``strict=True`` with dynamo's "Skip inlining ``torch.compiler.disable()``d
function"; ``torch.jit.trace(cmodel, x)`` with "unordered_map::at", a graph check error or an
``OptmemInputError`` from extracting again on traced values; the same for a larger model
holding a wrapped part. Now both record the plain model's own graph: the wrapper's call is
the model's while ``torch.export`` or ``torch.jit.trace`` traces it
(``wrapper.deployment_trace_active``), the wrapper's ``forward`` has the model's
``__code__``, and torch.export's non-strict trace of the wrapper reads the parameters under
the model's names (``PlannedModule.named_modules``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import gpt2  # noqa: E402
from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402

KINDS = hunt_kinds()


class Block(nn.Module):
    """A pre-norm residual block with dropout."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(self.norm(x))))


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), *[Block() for _ in range(4)], nn.Linear(32, 8))


class Net(nn.Module):
    """The same layers as :func:`_sequential` in a plain module (exported when wrapped)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Outer(nn.Module):
    """A user's model with a wrapped part (``inner``) between two layers of its own."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.pre, self.inner, self.post = nn.Linear(16, 16), inner, nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(torch.relu(self.pre(x))))


MAKERS = {"sequential": _sequential, "module": Net}
X = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
X2 = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
X5 = torch.randn(5, 16, generator=torch.Generator().manual_seed(5))


def _wrapped(kind: str, module: nn.Module, limit: str = "60%") -> nn.Module:
    wrap, options = KINDS[kind]
    return wrap(module, X, **{**HUNT_FIXED, "memory_limit": limit}, **options)


def _seeded(call: Any, *args: Any) -> torch.Tensor:
    torch.manual_seed(0)
    return call(*args)


def _same_step(cmodel: nn.Module, model: nn.Module, plain: nn.Module) -> None:
    """One training step of the wrapper is the plain model's, bitwise (the plan runs)."""
    for m in (cmodel, plain):
        m.train()
    got, ref = _seeded(cmodel, X), _seeded(plain, X)
    got.square().mean().backward()
    ref.square().mean().backward()
    assert torch.equal(got, ref)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def _exports_alike(cmodel: nn.Module, plain: nn.Module, strict: bool) -> None:
    program = torch.export.export(cmodel, (X2,), strict=strict)
    reference = torch.export.export(plain, (X2,), strict=strict)
    assert list(program.state_dict) == list(reference.state_dict) == list(plain.state_dict())
    assert torch.equal(_seeded(program.module(), X2), _seeded(reference.module(), X2))
    ops = [[n.target for n in p.graph.nodes if n.op == "call_function"]
           for p in (program, reference)]
    assert ops[0] == ops[1]  # the same graph (an nn.Sequential's input is named args_0)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", sorted(MAKERS))
def test_torch_export_of_the_wrapper_is_the_plain_models_program(shape, kind):
    plain, model = MAKERS[shape](), MAKERS[shape]()
    cmodel = _wrapped(kind, model)
    _exports_alike(cmodel, plain, strict=False)  # in training mode: dropout in the graph
    _same_step(cmodel, model, plain)  # training still runs the plan


@pytest.mark.parametrize("shape", sorted(MAKERS))
def test_a_strict_torch_export_of_the_wrapper_in_eval_mode(shape):
    plain, model = MAKERS[shape]().eval(), MAKERS[shape]()
    cmodel = _wrapped("checkpoint", model).eval()
    _exports_alike(cmodel, plain, strict=True)
    _same_step(cmodel, model, plain)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", sorted(MAKERS))
def test_torch_jit_trace_of_the_wrapper_is_the_plain_models_trace(shape, kind):
    plain, model = MAKERS[shape]().eval(), MAKERS[shape]()
    cmodel = _wrapped(kind, model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's own
        traced = torch.jit.trace(cmodel, X2)
        reference = torch.jit.trace(plain, X2)
    assert torch.equal(traced(X5), reference(X5))
    assert torch.equal(traced(X5), plain(X5))
    _same_step(cmodel, model, plain.train())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_larger_model_holding_a_wrapped_part_exports_and_traces(kind):
    torch.manual_seed(2)
    plain = Outer(_sequential())
    model = copy.deepcopy(plain)
    model.inner = _wrapped(kind, model.inner, "75%")
    for m in (plain, model):
        m.eval()
    for strict in (False, True):
        program = torch.export.export(model, (X2,), strict=strict)
        assert torch.equal(program.module()(X2), plain(X2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, X2)
    assert torch.equal(traced(X5), plain(X5))


def test_torch_export_of_a_wrapped_gpt2_is_the_plain_models():
    plain, sample = gpt2()
    model = copy.deepcopy(plain)
    cmodel = op.checkpoint(model, sample, **HUNT_FIXED).eval()
    plain.eval()
    call = {"input_ids": sample["input_ids"], "use_cache": False}
    program = torch.export.export(cmodel, (), call)
    reference = torch.export.export(plain, (), call)
    assert list(program.state_dict) == list(reference.state_dict)
    assert torch.equal(program.module()(**call).logits, plain(**call).logits)
    assert cmodel.forward.__code__ is type(plain).forward.__code__


class Scaled(Net):
    """:class:`Net` with a non-persistent buffer (as Llama's rotary ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].register_buffer("scale", torch.full((32,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.blocks[1].scale[:8]


def test_an_exported_wrapper_keeps_non_persistent_buffers_as_the_model_does():
    plain, model = Scaled().eval(), Scaled()
    cmodel = _wrapped("checkpoint", model).eval()
    program = torch.export.export(cmodel, (X2,))
    reference = torch.export.export(plain, (X2,))
    assert list(reference.constants) == ["blocks.1.scale"]
    assert list(program.constants) == list(reference.constants)
    assert list(program.state_dict) == list(reference.state_dict)
    assert list(cmodel.state_dict()) == list(plain.state_dict())  # not in the state dict
    cmodel.load_state_dict(plain.state_dict())
    assert torch.equal(program.module()(X2), plain(X2))
