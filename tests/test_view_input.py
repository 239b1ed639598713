"""Stop 81: a chain input that is a view of a larger tensor counts its own elements.

``X[:16]`` of a dataset held in one tensor used to count the dataset's whole storage as
``a^0`` (``storage_bytes``): ``memory_limit="60%"`` was taken of a store-all peak that held
the dataset, and no plan fitted; a call on ``x[:2]`` of the sample (a new size) was refused
the same way. The input is now counted by what its tensors occupy
(:func:`optmem.pytorch.memory.input_bytes`), in the profile and in the measured peaks alike.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import optmem.pytorch as op
from optmem.pytorch.memory import input_bytes, measure_training_peak, plan_allowance

torch.set_num_threads(1)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])


def test_a_view_of_a_dataset_plans_as_its_copy():
    """Failed before: ``OptmemInputError`` "no dp checkpoint plan ... within 312.00 KiB"."""
    model = _mlp()
    data = torch.randn(1024, 64)
    copy = op.checkpoint(model, data[:16].clone(), memory_limit="60%", fast_path=False)
    view = op.checkpoint(model, data[:16], memory_limit="60%", fast_path=False)
    assert view.chain.input_size == copy.chain.input_size == 16 * 64 * 4
    assert view.expected_peak_bytes == copy.expected_peak_bytes
    assert [str(o) for o in view.result.plan] == [str(o) for o in copy.result.plan]
    assert any(str(o).startswith("F_none") for o in view.result.plan)  # it re-runs


def test_a_call_on_a_slice_of_the_sample_trains_as_the_model():
    """Failed before: the new size's re-plan counted the sample's storage and found none."""
    model = _mlp()
    x = torch.randn(16, 64)
    wrapped = op.checkpoint(model, x, memory_limit="60%", fast_path=False)
    wrapped(x[4:6]).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x[4:6]).square().mean().backward()
    for a, b in zip(got, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_measured_peak_of_a_view_input_holds_the_claim():
    """The measured step counts the input as the profile does: within claim + allowance."""
    model = _mlp()
    data = torch.randn(1024, 64)
    x = data[32:48]
    wrapped = op.checkpoint(model, x, memory_limit="60%", fast_path=False)
    allowance = plan_allowance(wrapped.chain, wrapped.result.plan, list(wrapped.stages))
    model.zero_grad(set_to_none=True)
    real = measure_training_peak(lambda: wrapped(x).square().mean().backward(), model, x)
    assert real <= wrapped.expected_peak_bytes + allowance
    assert input_bytes(x) == 16 * 64 * 4 < data.untyped_storage().nbytes()
