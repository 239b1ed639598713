"""A pipeline loss that fails on the last stage's rank becomes one error on every rank.

The loss of a pipeline runs on the rank of its last stage only. A ``loss_fn`` that raised
there (a target out of range for ``cross_entropy``, a loss that is not a scalar, a model
output without a loss) ended that rank's step while the other ranks waited for the
gradients it would have sent: in a script the process ended and they stopped with gloo's
"Connection closed by peer", but in a process kept alive (a notebook, a ``try``/``except``
around ``step``) they waited for the group's timeout, 30 minutes by default
(``docs/pipeline.md``, found by the hunt of stop 53, documented since).

Now the last stage records the failure (:meth:`LossFailure.attempt`) and stands in a zero
loss (:class:`ZeroLoss`: gradient zero for every input), so the step's messages all flow;
after the step the ranks agree on whether a loss failed (:meth:`LossFailure.agree`: the
last stage's rank sends each other rank of the pipeline one integer per step, and the
message only when a loss failed) and every rank raises the same
:class:`~optmem.errors.OptmemInputError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from optmem.errors import OptmemInputError

AGREE_TAG = 70417  # the tag of the agreement's messages (gloo matches tags; NCCL has none)


class ZeroLoss(torch.autograd.Function):
    """A scalar zero standing for a failed loss; its gradient for every input is zero.

    Its backward sends zero gradients to the stage's inputs, so the previous stages get
    the gradient messages the schedule expects and add nothing to any weight.
    """

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.likes = [(t.shape, t.dtype, t.device) for t in tensors]
        return torch.zeros((), dtype=tensors[0].dtype, device=tensors[0].device)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        del grads
        return tuple(torch.zeros(shape, dtype=dtype, device=device)
                     for shape, dtype, device in ctx.likes)


def zero_loss(value: Any) -> torch.Tensor:
    """A zero loss depending on the floating tensors of ``value`` that need a gradient.

    Without such a tensor (nothing to train before the loss) a plain zero.
    """
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)
               and t.requires_grad and t.is_floating_point()]
    if not tensors:
        return torch.zeros(())
    return ZeroLoss.apply(*tensors)


def _check_scalar(loss: Any) -> torch.Tensor:
    """``loss`` when it is a one-element tensor; else the error the step reports."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn returned a {type(loss).__name__}; expected a scalar tensor")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; expected "
                         "a scalar")
    return loss


def _send_all(tensor: torch.Tensor, peers: Sequence[int], group: Any) -> None:
    """Send ``tensor`` to every rank of ``peers`` at once, and wait for the sends."""
    works = [dist.isend(tensor, dst=peer, group=group, tag=AGREE_TAG) for peer in peers]
    for work in works:
        if work is not None:  # None: this rank is outside ``group`` (never here)
            work.wait()


class LossFailure:
    """The first failure of a step's losses on this rank, and the ranks' agreement on it."""

    def __init__(self) -> None:
        self.message: str | None = None

    def attempt(self, loss: Callable[[], Any], value: Any) -> torch.Tensor:
        """``loss()``, or a zero loss on ``value`` once a loss of this step has failed.

        The first exception (or a result that is not a one-element tensor) is recorded;
        later micro-batches of the step take the zero loss without calling ``loss``.
        """
        if self.message is None:
            try:
                return _check_scalar(loss())
            except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
                self.message = f"{type(exc).__name__}: {exc}"
        return zero_loss(value)

    def agree(self, *, src: int, ranks: Sequence[int], group: Any,
              device: torch.device) -> None:
        """Raise the same error on every rank of ``ranks`` when a loss failed on ``src``.

        Point to point, so that no rank outside the pipeline takes part: ``src`` (the
        global rank of the last stage) sends every other rank of ``ranks`` the length of
        its message (0: every loss of the step ran), then the message when there is one.
        The record is cleared, so the next step starts afresh.
        """
        rank = dist.get_rank()
        message, self.message = self.message, None
        if rank not in ranks:  # a rank without a stage of the plan
            return
        if rank == src:
            data = (message or "").encode()
            peers = [r for r in ranks if r != src]
            size = torch.tensor([len(data)], dtype=torch.int64, device=device)
            _send_all(size, peers, group)
            if data:
                _send_all(torch.tensor(list(data), dtype=torch.uint8, device=device), peers,
                          group)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(size, src=src, group=group, tag=AGREE_TAG)
            if int(size.item()):
                body = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
                dist.recv(body, src=src, group=group, tag=AGREE_TAG)
                message = bytes(body.tolist()).decode()
        if message is None:
            return
        raise OptmemInputError(
            f"the loss failed on rank {src}, which holds the pipeline's last stage: "
            f"{message}. Every rank stopped at the end of this step; its gradients are "
            "incomplete (zero them before the next step). Try the loss on the plain "
            "model's output of one micro-batch first", field="loss_fn")
