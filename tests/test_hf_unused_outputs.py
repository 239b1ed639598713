"""Outputs the loss does not read: their parameters keep ``grad is None``, as in the model.

An audit (stop 75) found that a loss on an early hidden state (``output_hidden_states=True``,
the loss on ``hidden_states[1]``) gave the later layers of a wrapped Llama or BERT a zero
gradient where the plain model leaves ``None``: a joint re-run (``optmem.pytorch.joint``)
took zeros for its stage's outputs without gradient, and back-propagated them into the
stage's parameters. An optimizer with weight decay then moved weights the plain model's
step does not touch, and ``torch.autograd.grad`` on such a weight returned zeros where
torch raises.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")

from hf_helpers import bert, llama  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch import joint  # noqa: E402

# stage times that do not depend on the machine: the same plan (with its joint re-runs)
FIXED_TIMES: dict[str, Any] = {"repeats": 1, "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}


def _early_loss(out: Any) -> torch.Tensor:
    """A loss on the first layer's output only: the later layers take no part."""
    return out.hidden_states[1].pow(2).sum()


def _bert() -> tuple[torch.nn.Module, dict[str, Any]]:
    """BERT without dropout: its stages qualify for joint re-runs (no random op)."""
    return bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("factory", [llama, _bert], ids=["llama", "bert"])
@pytest.mark.parametrize("strip_suffix", [True, False])
def test_parameters_the_loss_does_not_reach_keep_no_gradient(
        monkeypatch: pytest.MonkeyPatch, factory: Any, strip_suffix: bool) -> None:
    model, kwargs = factory()
    ref = copy.deepcopy(model)
    runs = [0]
    real = joint._Job.run

    def counted(self: Any, grads: Any) -> Any:
        runs[0] += 1
        return real(self, grads)

    monkeypatch.setattr(joint._Job, "run", counted)
    wrapped = op.checkpoint(model, kwargs, memory_limit="60%", strip_suffix=strip_suffix,
                            **FIXED_TIMES)
    ids = kwargs["input_ids"]
    wrapped(input_ids=ids, output_hidden_states=True)  # the call's signature, extracted
    for call in (wrapped, ref):
        torch.manual_seed(0)  # the same dropout masks (BERT)
        _early_loss(call(input_ids=ids, output_hidden_states=True)).backward()
    assert runs[0] > 0  # the joint re-run path was taken (what the defect went through)
    names = [n for n, _ in ref.named_parameters()]
    for name, p, q in zip(names, model.parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    assert any(q.grad is None for q in ref.parameters())  # the case is exercised
    for opt in (torch.optim.AdamW(model.parameters(), lr=0.1),
                torch.optim.AdamW(ref.parameters(), lr=0.1)):
        opt.step()
    for name, p, q in zip(names, model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_autograd_grad_on_an_unused_weight_raises_as_the_model_does() -> None:
    model, kwargs = llama()
    ref = copy.deepcopy(model)
    wrapped = op.checkpoint(model, kwargs, memory_limit="60%", **FIXED_TIMES)
    ids = kwargs["input_ids"]
    for call, owner in ((wrapped, model), (ref, ref)):
        weight = owner.model.layers[1].self_attn.q_proj.weight
        out = call(input_ids=ids, output_hidden_states=True)
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(out.hidden_states[1].sum(), [weight])
