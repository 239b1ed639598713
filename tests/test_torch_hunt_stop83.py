"""Hunt of the torch bridge on module-level operations (stop 83; ``docs/pytorch.md``,
"Stop 83 (module operations)").

Two ways a wrapped module did not behave like its model:

* With ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``cmodel.to()``,
  ``.double()`` and ``load_state_dict`` swap each parameter's contents
  (``torch.utils.swap_tensors``), which refuses a tensor that has a weak reference. The
  fake modes of ``torch.export`` kept one to every parameter for as long as the exported
  graph lived, so every conversion of a wrapped exported model failed with "_apply():
  Couldn't swap Embedding.weight" where the plain model converts. Extraction now drops
  them (``extract.forget_real_tensors``).
* A model built under ``torch.device("meta")`` failed to wrap with whatever torch raised
  at its first op ("Tensor.item() cannot be called on meta tensors", "Tensor on device
  meta is not on the expected device cpu!"): now one ``OptmemInputError`` saying to
  materialise and initialise it first.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers",
                                   reason="the HF tests need transformers (dev extra)")

from hf_helpers import assert_same, gpt2, llama, step  # noqa: E402
from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

FIXED = HUNT_FIXED
KINDS = hunt_kinds()


@contextmanager
def _swapping() -> Iterator[None]:
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_wrapped_model_converts_with_swapped_parameters(kind: str) -> None:
    """Under ``set_swap_module_params_on_conversion(True)``, ``cmodel.to(torch.float64)``
    after a step, then a step: the plain model's, bitwise; ``load_state_dict`` swaps too
    (main: "_apply(): Couldn't swap Embedding.weight")."""
    plain, sample = llama()
    model, _ = llama()
    wrap, options = KINDS[kind]
    cmodel = wrap(model, sample, **FIXED, **options)
    assert cmodel.extraction is not None and cmodel.extraction.method == "export"
    step(cmodel, model, sample)
    assert not any(weakref.getweakrefcount(p) for p in model.parameters())
    with _swapping():
        plain.to(torch.float64)
        assert cmodel.to(torch.float64) is cmodel
        state = {k: v * 0.5 for k, v in plain.state_dict().items()}
        plain.load_state_dict(state)
        cmodel.load_state_dict(state)
    assert_same(step(cmodel, model, sample, seed=3), step(plain, plain, sample, seed=3))


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                      for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().mean()


def test_a_model_on_the_meta_device_is_one_error_saying_to_materialise_it() -> None:
    """Built under ``torch.device("meta")``: one ``OptmemInputError`` naming the first meta
    parameter and ``to_empty`` (main: torch's "Tensor.item() cannot be called on meta
    tensors" or a device error from the model's first op), for an exported module and an
    ``nn.Sequential`` alike."""
    with torch.device("meta"):
        module = _Blocks()
    x = torch.randn(4, 16)
    for model in (module, module.blocks):
        with pytest.raises(OptmemInputError, match=r"\.0\.0\.weight is on the meta device.*"
                                                   r"to_empty"):
            op.checkpoint(model, x, **FIXED)


def test_a_meta_sequential_profiled_on_meta_then_materialised_trains_as_the_model() -> None:
    """``device="meta"`` still profiles an ``nn.Sequential`` built on meta; materialised and
    initialised after wrapping, it trains as the plain model built the same way."""
    def built() -> nn.Sequential:
        with torch.device("meta"):
            seq = _Blocks().blocks
        seq.to_empty(device="cpu")
        return seq

    with torch.device("meta"):
        model = _Blocks().blocks
    cmodel = op.checkpoint(model, torch.randn(4, 16), **{**FIXED, "device": "meta"})
    cmodel.to_empty(device="cpu")
    plain = built()
    for m in (plain, model):
        torch.manual_seed(0)
        for layer in m.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
    x = torch.randn(4, 16)
    cmodel(x).square().mean().backward()
    plain(x).square().mean().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def _freeze(model: nn.Module, flag: bool) -> None:
    model.transformer.wte.requires_grad_(flag)
    model.transformer.h[0].requires_grad_(flag)


def test_a_percentage_limit_too_tight_for_a_frozen_call_says_to_give_bytes() -> None:
    """GPT-2 under ``op.offload`` at ``"60%"``, embedding and first block frozen after
    wrapping: 60 % of the frozen step's own peak has no plan, and the error says to give
    the limit in bytes (main: no hint); given the sample's bytes, the frozen steps and
    the unfrozen one train as the plain model's, bitwise."""
    plain, sample = gpt2()
    model, _ = gpt2()
    cmodel = op.offload(model, sample, **FIXED, bandwidth="1MB/s")
    _freeze(model, False)
    with pytest.raises(OptmemInputError, match="which parameters require grad .*"
                                               "pass memory_limit in bytes"):
        cmodel(**sample)
    _freeze(model, True)
    budget = int(0.6 * cmodel.chain.store_all_peak())  # the sample's plan's bytes
    cmodel = op.offload(model, sample, **{**FIXED, "memory_limit": budget}, bandwidth="1MB/s")
    for flag in (False, True):
        _freeze(model, flag)
        _freeze(plain, flag)
        assert_same(step(cmodel, model, sample, seed=2), step(plain, plain, sample, seed=2))


class _Scale(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 1.5


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_first_call_inside_parametrize_cached_trains_as_the_model(kind: str) -> None:
    """A parametrization registered after wrapping, the next step inside
    ``parametrize.cached()``: extracted and measured there, the wrapper trains as the plain
    model (main: "Trying to backward through the graph a second time": the measuring
    step's backward had freed the cached weight's graph)."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    plain = _Blocks()
    model = _Blocks()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    wrap, options = KINDS[kind]
    cmodel = wrap(model, x, **{**FIXED, "memory_limit": "80%"}, **options)
    for m in (plain, model):
        parametrize.register_parametrization(m.blocks[1][0], "weight", _Scale())
    for m in (plain, cmodel):
        with parametrize.cached():
            m(x).backward()
        assert not parametrize._cache
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
