"""The one-liner on HuggingFace models: GPT-2, Llama, BERT, ViT and ResNet (tiny configs).

Each is wrapped at 60 % of its store-all activations: the plan recomputes, and the loss, the
logits and every parameter gradient are **bitwise** equal to the unmodified model's on CPU
(GPT-2's tied embedding/head weight included: two contributions, summed by autograd as for
the model), ``torch.autograd.grad`` included; the output type, its keys and the state-dict
keys are the model's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")

from hf_helpers import MODELS, TRANSFORMER_LAYERS, assert_same, step  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.wrapper import canonical_call  # noqa: E402


@pytest.fixture(scope="module", params=sorted(MODELS))
def wrapped(request):
    name = request.param
    model, kwargs = MODELS[name]()
    model.train()
    chain = op.profile_chain(model, kwargs, repeats=1, warmup=0)
    limit = int(0.6 * chain.store_all_peak())
    cmodel = op.checkpoint(model, kwargs, memory_limit=limit, chain=chain)
    return name, model, kwargs, cmodel, limit


def test_wrapped_at_60_percent_recomputes_within_the_limit(wrapped):
    name, model, kwargs, cmodel, limit = wrapped
    assert cmodel.extraction is not None and cmodel.extraction.method == "export"
    plan = cmodel.result.plan
    # optimal for its model: the chain's, or the chain plus the measured segment cost
    assert (cmodel.result.report.get("model_status") or cmodel.result.status) == "optimal"
    assert any(op_.startswith(("F_ck", "F_none")) for op_ in plan), plan
    assert cmodel.expected_peak_bytes <= limit
    assert cmodel.expected_makespan >= cmodel.chain.total_compute_time()


def test_same_loss_gradients_and_output_type(wrapped):
    name, model, kwargs, cmodel, limit = wrapped
    ref = step(model, model, kwargs, seed=3)
    got = step(cmodel, model, kwargs, seed=3)
    assert_same(got, ref, bitwise=True)


def test_autograd_grad_gives_the_plain_gradients(wrapped):
    name, model, kwargs, cmodel, limit = wrapped
    params = list(model.parameters())
    ref = step(model, model, kwargs, seed=4)[1]
    torch.manual_seed(4)
    got = torch.autograd.grad(cmodel(**kwargs).loss, params, allow_unused=True)
    assert all(p.grad is None for p in params)  # autograd.grad accumulates nothing
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert (a is None) == (b is None), f"parameter {k}"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_and_parameter_names_are_the_models(wrapped):
    name, model, kwargs, cmodel, limit = wrapped
    assert list(cmodel.state_dict()) == list(model.state_dict())
    assert [n for n, _ in cmodel.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(cmodel.parameters(), model.parameters(), strict=True))


def test_transformer_layers_give_attention_and_mlp_stages(wrapped):
    name, model, kwargs, cmodel, limit = wrapped
    if name not in TRANSFORMER_LAYERS:
        assert cmodel.chain.length >= 8  # ResNet: stem pieces, one stage per block, head
        return
    names = cmodel.stage_names
    for layer in range(TRANSFORMER_LAYERS[name]):
        here = [n for n in names if f".{layer}" in n.split(":")[0]]
        assert len(here) >= 2, (layer, names)


def test_side_inputs_never_require_grad(wrapped):
    name, model, kwargs, cmodel, limit = wrapped
    ext = cmodel.extraction
    # the call as the wrapper makes it (use_cache=False where the model would cache)
    flat = ext.flatten(*canonical_call(model, (), dict(kwargs)))
    ctx = ext.side_inputs(flat)
    tensors = [v for v in ctx.values() if isinstance(v, torch.Tensor)]
    assert tensors and not any(t.requires_grad for t in tensors)
    if name in ("gpt2", "llama", "bert"):  # masks, positions, rotary tables: side inputs
        assert ext.side.output_names


def test_logits_returned_beside_the_loss_are_no_chain_value(wrapped):
    """The model returns the loss and the logits: no cut at the logits (the head and the
    loss form the last stage), and the logits are neither in ``a^L`` nor in its gradient:
    ``a^L`` is the loss (a scalar), the logits count in the last stage's temporaries."""
    name, model, kwargs, cmodel, limit = wrapped
    chain = cmodel.chain
    assert chain.output_size[-1] <= 16, (name, chain.output_size[-1])
    logits = model(**kwargs).logits
    nbytes = logits.numel() * logits.element_size()
    assert chain.fwd_overhead[-1] >= nbytes
    assert chain.extra["profile"]["output_left_out"][-1] >= nbytes


def test_side_inputs_read_only_by_the_native_suffix_are_not_kept(wrapped, monkeypatch):
    """The executor keeps into the backward only the side inputs its stages read
    (``context.read_by``): GPT-2's and Llama's shifted labels, read by the loss in the native
    suffix alone, are freed when autograd has used them, as in the plain model. Keeping the
    whole context (the old behaviour) gives a higher real peak there and never a lower one."""
    name, model, kwargs, cmodel, limit = wrapped
    from optmem.pytorch import execute
    from optmem.pytorch.memory import measure_training_peak

    def peak() -> int:
        model.zero_grad(set_to_none=True)
        out = measure_training_peak(lambda: cmodel(**kwargs).loss.backward(), model,
                                    list(kwargs.values()))
        model.zero_grad(set_to_none=True)
        return out

    narrowed = peak()
    monkeypatch.setattr(execute, "read_by", lambda ctx, stages: ctx)
    whole = peak()
    assert narrowed <= whole
    if name in ("gpt2", "llama"):
        assert narrowed < whole
