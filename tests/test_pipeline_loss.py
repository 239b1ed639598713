"""The last stage's loss failure record (:mod:`optmem.pytorch.pipeline_loss`), one process.

The agreement between ranks is tested on two gloo processes in
``tests/test_pipeline_torch.py::test_a_loss_that_fails_on_the_last_rank_is_one_error_on_every_rank``.
"""

from __future__ import annotations

import pytest
import torch

from optmem.pytorch.pipeline_loss import LossFailure, zero_loss


def test_the_zero_loss_sends_zero_gradients_of_each_input_shape():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    frozen = torch.randn(5)
    loss = zero_loss((a, {"b": b, "frozen": frozen, "n": 3}))
    assert loss.shape == () and float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(a.grad, torch.zeros(3, 4))
    assert torch.equal(b.grad, torch.zeros(2, dtype=torch.float64))
    assert not zero_loss(frozen).requires_grad


def test_the_first_failure_is_kept_and_later_losses_are_not_called():
    failure = LossFailure()
    x = torch.ones(2, requires_grad=True)
    calls = []

    def loss(fail: bool) -> torch.Tensor:
        calls.append(fail)
        if fail:
            raise IndexError("target 7 is out of bounds")
        return (x * 2).sum()

    assert float(failure.attempt(lambda: loss(False), x).detach()) == 4.0
    assert float(failure.attempt(lambda: loss(True), x).detach()) == 0.0
    assert float(failure.attempt(lambda: loss(False), x).detach()) == 0.0  # not called again
    assert calls == [False, True]
    assert failure.message == "IndexError: target 7 is out of bounds"


@pytest.mark.parametrize(("result", "message"), [
    (torch.ones(3), "ValueError: loss_fn returned a tensor of shape (3,); expected a scalar"),
    (1.5, "TypeError: loss_fn returned a float; expected a scalar tensor"),
])
def test_a_loss_that_is_not_a_scalar_tensor_is_a_failure(result, message):
    failure = LossFailure()
    x = torch.ones(3, requires_grad=True)
    assert float(failure.attempt(lambda: result, x).detach()) == 0.0
    assert failure.message == message
