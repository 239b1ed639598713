"""Audit of the torch bridge as a PyTorch user (stop 76): what a wrapped module must keep.

Plain Python attributes the forward reads (a temperature, ``LayerNorm.eps``, an HF
``config`` flag, a tensor held as a plain attribute) are baked into the exported graph as
constants. Set after wrapping, they were silently ignored: the wrapped step kept computing
with the values of the wrapping time (a temperature annealed after wrapping: outputs 0.73
and gradients up to 17 apart from the model's). They are now part of what
``optmem.pytorch.wrapper.TensorState`` checks per call, so the next call extracts again;
what the model's own forward writes (HF's ``config.problem_type``, a call counter) does not.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")

from hf_helpers import bert, vit  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch import wrapper  # noqa: E402

# stage times that do not depend on the machine: the same plan on every run
FIXED_TIMES: dict[str, Any] = {"repeats": 1, "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}


class _Tempered(nn.Module):
    """Four ``tanh(linear(x) / temperature) * scale`` layers: a float and a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.temperature = 1.0
        self.scale = torch.tensor(1.0)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x) / self.temperature) * self.scale
        return x


def _assert_same_step(model: nn.Module, ref: nn.Module, out: torch.Tensor,
                      ref_out: torch.Tensor) -> None:
    assert torch.equal(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("fast_path", [False, True])
@pytest.mark.parametrize("change", ["temperature", "scale"])
def test_a_python_attribute_set_after_wrapping_is_what_the_step_computes(
        change: str, fast_path: bool) -> None:
    torch.manual_seed(0)
    model = _Tempered()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16)
    limit = "100%" if fast_path else "60%"
    wrapped = op.checkpoint(model, x, memory_limit=limit, fast_path=fast_path, **FIXED_TIMES)
    assert wrapped.fast_path_taken == fast_path
    wrapped(x).sum().backward()  # a first step with the values of the wrapping time
    model.zero_grad(set_to_none=True)
    for m in (model, ref):
        if change == "temperature":
            m.temperature = 0.5  # an annealed temperature
        else:
            m.scale = torch.tensor(3.0)  # rebound: another tensor object
    out, ref_out = wrapped(x), ref(x)
    out.sum().backward()
    ref_out.sum().backward()
    _assert_same_step(model, ref, out, ref_out)


def test_an_attribute_set_before_a_call_without_gradients_is_not_taken_as_the_models() -> None:
    torch.manual_seed(0)
    model = _Tempered()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16)
    wrapped = op.checkpoint(model, x, memory_limit="60%", fast_path=False, **FIXED_TIMES)
    for m in (model, ref):
        m.temperature = 0.5
    with torch.no_grad():  # the model itself runs: what it writes is the model's own
        assert torch.equal(wrapped(x), ref(x))
    out, ref_out = wrapped(x), ref(x)
    out.sum().backward()
    ref_out.sum().backward()
    _assert_same_step(model, ref, out, ref_out)


@pytest.mark.parametrize("change", ["temperature", "dropout"])
def test_a_copy_made_after_a_change_computes_what_the_changed_model_does(change: str) -> None:
    """``copy.deepcopy`` between the change and the next call: the copy's recorded state was
    recomputed from the changed model, so it took the change as the state of the old graph
    (also for a dropout's ``p``, checked since stop 57)."""
    torch.manual_seed(0)
    model = _Tempered()
    model.layers[1] = nn.Sequential(nn.Dropout(0.0), model.layers[1])
    x = torch.randn(8, 16)
    wrapped = op.checkpoint(model, x, memory_limit="60%", fast_path=False, **FIXED_TIMES)
    if change == "temperature":
        model.temperature = 0.5
    else:
        model.layers[1][0].p = 0.5
    copied = copy.deepcopy(wrapped)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    out = copied(x)
    torch.manual_seed(1)
    ref_out = ref(x)
    out.sum().backward()
    ref_out.sum().backward()
    _assert_same_step(copied.module, ref, out, ref_out)


def test_a_module_attribute_of_an_hf_model_set_after_wrapping() -> None:
    model, batch = bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref = copy.deepcopy(model)
    wrapped = op.checkpoint(model, batch, memory_limit="60%", **FIXED_TIMES)
    assert not wrapped.fast_path_taken
    for m in (model, ref):
        for sub in m.modules():
            if isinstance(sub, nn.LayerNorm):
                sub.eps = 0.5
    out, ref_out = wrapped(**batch), ref(**batch)
    out.loss.backward()
    ref_out.loss.backward()
    _assert_same_step(model, ref, out.logits, ref_out.logits)
    assert torch.equal(out.loss, ref_out.loss)


def test_an_hf_config_flag_set_after_wrapping() -> None:
    model, batch = bert()
    wrapped = op.checkpoint(model, batch, memory_limit="60%", **FIXED_TIMES)
    model.config.output_hidden_states = True
    out = wrapped(**batch)
    assert sorted(out.keys()) == ["hidden_states", "logits", "loss"]
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1


class _Counted(nn.Module):
    """A model whose forward writes Python attributes (a call counter, the last output)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.calls = 0
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        self.last = x.detach()
        return x


@pytest.mark.parametrize("fast_path", [False, True])
def test_attributes_the_forward_writes_extract_nothing_again(
        monkeypatch: pytest.MonkeyPatch, fast_path: bool) -> None:
    extractions = [0]
    real = wrapper._extract_variant

    def counted(*args: Any, **kwargs: Any) -> Any:
        extractions[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(wrapper, "_extract_variant", counted)
    limit = "100%" if fast_path else "60%"
    torch.manual_seed(0)
    net = _Counted()
    x = torch.randn(4, 8)
    cnet = op.checkpoint(net, x, memory_limit=limit, fast_path=fast_path, **FIXED_TIMES)
    model, batch = vit()  # its forward sets config.problem_type at the first call with labels
    cvit = op.checkpoint(model, batch, memory_limit=limit, fast_path=fast_path, **FIXED_TIMES)
    assert cnet.fast_path_taken == cvit.fast_path_taken == fast_path
    for _ in range(3):
        cnet(x).sum().backward()
        cvit(**batch).loss.backward()
        with torch.no_grad():  # the model itself runs
            cnet(x)
            cvit(**batch)
    assert extractions[0] == 2  # one per wrapper, when wrapping


def test_a_lora_scale_set_after_wrapping() -> None:
    """PEFT keeps each LoRA layer's scale in a dict (``scaling = {"default": 2.0}``): set
    after wrapping, the wrapped step kept the old scale (loss 0.0033 and the adapters'
    gradients up to 0.039 apart from the ``PeftModel``'s)."""
    peft = pytest.importorskip("peft", reason="the LoRA test needs peft (dev extra)")
    from hf_helpers import llama

    base, batch = llama()
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ref = copy.deepcopy(model)
    wrapped = op.checkpoint(model, batch, memory_limit="60%", **FIXED_TIMES)
    assert not wrapped.fast_path_taken
    scaled = 0
    for m in (model, ref):
        for sub in m.modules():
            if isinstance(getattr(sub, "scaling", None), dict) and "default" in sub.scaling:
                sub.scaling["default"] = 5.0  # in place, as peft's set_scale does
                scaled += 1
    assert scaled > 0
    out, ref_out = wrapped(**batch), ref(**batch, use_cache=False)
    out.loss.backward()
    ref_out.loss.backward()
    assert torch.equal(out.loss, ref_out.loss)
    _assert_same_step(model, ref, out.logits, ref_out.logits)


def test_a_nan_attribute_is_no_change_at_every_call() -> None:
    # the one recorded attribute of a module is compared bare (no tuple's identity check):
    # NaN != NaN made every call a new version, so every call extracted again
    module = nn.Module()
    module.eps = float("nan")
    state = wrapper.TensorState(module)
    first = state.key()
    assert state.key() == first
    module.eps = 0.5  # a change is still one: a new version
    assert state.key() != first
