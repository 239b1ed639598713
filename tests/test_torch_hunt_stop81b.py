"""Hunt of ``retain_graph=True`` and double backward through the one-liners (stop 81b).

Compared with the unwrapped model under a fixed dropout seed (``docs/pytorch.md``, "Stop
81: hunting retain_graph and double backward"): Llama, BERT, T5, BART, ViT, HF ResNet and
Mixtral, autocast, ``torch.compile``, gradient accumulation, ``backward(inputs=...)``,
partial ``autograd.grad``, hidden states, input-embedding and R1 penalties, ``torch.func``,
``hessian``, DDP and dropped forwards all behaved as the model. One did not: a double
backward through a wrapped Mixtral failed with torch's "Trying to backward through
transformers.grouped_mm_fallback_backward.default but no autograd formula was registered"
where the model differentiates twice (in eager mode its experts call ``torch._grouped_mm``;
under torch.export, for float32 weights, transformers' custom ``grouped_mm_fallback``,
whose backward has no derivative). It is now one ``OptmemInputError`` naming the operator
and the experts implementation that works (``batched_mm``: the model's gradients).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

import pytorch_helpers  # noqa: E402, F401  (one thread)
from hf_helpers import BATCH, SEQ, VOCAB  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.execute import underivable_op  # noqa: E402

FIXED: dict[str, Any] = {"fast_path": False, "repeats": 1, "warmup": 0,
                         "time_model": lambda *_: (1.0, 2.0)}
KINDS = {"checkpoint": (op.checkpoint, {}),
         "remat_offload": (op.remat_offload, {"bandwidth": "1MB/s"})}


def _mixtral(implementation: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """2 layers, hidden 32, 4 experts (2 per token), router logits in the output."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        attention_dropout=0.3)
    if implementation is not None:
        config._experts_implementation = implementation
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return transformers.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


def _penalty(call: Any, owner: nn.Module, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The loss plus the squared norm of its parameter gradients (``create_graph=True``)."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = call(**kwargs).loss
    grads = torch.autograd.grad(loss, list(owner.parameters()), create_graph=True)
    (loss + sum(g.square().sum() for g in grads)).backward()
    out = [p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_double_backward_through_exported_moe_experts_is_one_error(kind):
    """The model differentiates twice; the wrapper's exported experts cannot: one
    ``OptmemInputError`` (before: torch's RuntimeError about a missing formula)."""
    model, kwargs = _mixtral()
    plain = copy.deepcopy(model)
    wrap, options = KINDS[kind]
    cmodel = wrap(model, kwargs, memory_limit="80%", **FIXED, **options)
    assert all(g is not None for g in _penalty(plain, plain, kwargs))
    with pytest.raises(OptmemInputError, match="grouped_mm_fallback.*batched_mm"):
        _penalty(cmodel, model, kwargs)
    model.zero_grad(set_to_none=True)


def test_the_batched_mm_experts_differentiate_twice_as_the_model():
    """The implementation the error names: the model's gradients (float32 rounding of a
    second-order sum in another order; measured 5.1e-7)."""
    model, kwargs = _mixtral("batched_mm")
    plain = copy.deepcopy(model)
    cmodel = op.checkpoint(model, kwargs, memory_limit="80%", **FIXED)
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    for got, want in zip(_penalty(cmodel, model, kwargs), _penalty(plain, plain, kwargs),
                         strict=True):
        torch.testing.assert_close(got, want)


def test_underivable_custom_operators_are_told_from_the_others():
    """A custom operator without ``register_autograd`` (a backward operator) is named; one
    with a formula, and torch's own nodes, are not."""
    lib = "optmem_test81b"

    @torch.library.custom_op(f"{lib}::square_backward", mutates_args=())
    def square_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return 2 * x * grad

    @torch.library.custom_op(f"{lib}::square", mutates_args=())
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    def setup(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    square.register_autograd(lambda ctx, grad: square_backward(*ctx.saved_tensors, grad),
                             setup_context=setup)
    x = torch.randn(4, requires_grad=True)
    y = square(x)
    assert underivable_op(y.grad_fn) is None
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert "square_backward" in str(underivable_op(g.grad_fn))
    assert underivable_op(x.square().grad_fn) is None
