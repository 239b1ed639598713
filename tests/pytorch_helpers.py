"""Shared helpers of the torch bridge tests (models, reference runs, tightest limits)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from optmem.chain import Chain
from optmem.problems.checkpoint import CheckpointProblem
from optmem.result import Result
from optmem.solvers.facade import solve

# Tiny kernels: one thread is much faster than oversubscribed threads on a shared machine.
torch.set_num_threads(1)


def reference_step(module: torch.nn.Module, x: Any, loss_fn, seed: int = 0,
                   owner: torch.nn.Module | None = None):
    """Loss, output, parameter gradients (in ``owner``'s order) and input gradient of a step."""
    owner = owner if owner is not None else module
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(x)
    loss = loss_fn(out)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None
             for p in owner.parameters()]
    xg = None
    if isinstance(x, torch.Tensor) and x.grad is not None:
        xg = x.grad.detach().clone()
        x.grad = None
    owner.zero_grad(set_to_none=True)
    return loss.detach(), out.detach(), grads, xg


def loss_grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``model``'s parameters for ``loss``, in order (``.grad`` cleared)."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def tightest_result(chain: Chain, method: str = "dp", slots: int = 500) -> Result:
    """The plan at (about) the smallest limit the method accepts, after discretisation.

    Starts from the method's ``min_feasible_memory`` when it reports one, otherwise bisects
    between the input size and the store-all peak.
    """
    from optmem.result import SolveOptions

    opts = SolveOptions(slots=slots)

    def attempt(limit: int) -> Result:
        return solve(CheckpointProblem(chain, limit), method, options=opts)

    first = attempt(1)
    if first.min_feasible_memory is not None:
        low = first.min_feasible_memory
        for k in range(50):
            r = attempt(low + k * max(1, low // slots))
            if r.status.has_plan:
                return r
        raise AssertionError("no feasible limit found")
    lo, hi = chain.input_size, chain.store_all_peak()
    # rounding every live value up to the unit can push store-all just above the limit
    hi += max(1, hi // slots) * (2 * chain.length + 4)
    best = attempt(hi)
    assert best.status.has_plan
    while hi - lo > max(1, hi // 200):
        mid = (lo + hi) // 2
        r = attempt(mid)
        if r.status.has_plan:
            hi, best = mid, r
        else:
            lo = mid
    return best


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


TANH_TRANSFER_PLAN = ["F_all 1", "F_all 2", "offload abar 1", "F_all 3", "offload abar 2",
                      "F_all 4", "offload abar 3", "Loss", "prefetch abar 3", "B 4",
                      "prefetch abar 2", "B 3", "prefetch abar 1", "B 2", "B 1"]
"""A store-all plan that moves out every tape but the last and brings each back in time."""


def tanh_chain() -> tuple[list[torch.nn.Module], torch.nn.Sequential, torch.Tensor]:
    """Four ``Linear(256, 256) + Tanh`` stages, their ``nn.Sequential`` and a batch of 64.

    One activation is 64 KiB; each ``Tanh`` output is saved twice (by the ``Tanh`` and by
    the next stage's ``Linear``), the case of a tensor moved out by two holders.
    """
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
              for _ in range(4)]
    return stages, torch.nn.Sequential(*stages), torch.randn(64, 256)
