"""Leftovers of stop 83 closed at stop 84: a forward that modifies a parameter in place.

Stop 83 refused a forward that updates a *parameter* in place (an EMA teacher, BYOL's target
encoder) on the one-liners' export path (``hooks.parameters_unmodified`` in
``wrapper._extract_variant``). Every other path that runs the model's forward during setup
accepted it in silence, the update applied once per run: ``op.profile_chain`` (exported and
``nn.Sequential``), ``op.submodule_sample``, the ``nn.Sequential`` and list-of-stages routes of
``op.checkpoint`` / ``op.offload`` / ``op.remat_offload`` (with ``autotune=True`` too) and
``op.pipeline``; on data-parallel ranks the error was raised after the decision's broadcast,
on rank 0 only (the profile runs there), so the other ranks went on to their first step.
Each path now raises the same ``OptmemInputError`` naming the parameter; on ranks it is
raised within the decision that rank 0 broadcasts.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import EmaTarget  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch import process_groups  # noqa: E402

torch.set_num_threads(1)

FIXED: dict[str, Any] = {"memory_limit": "min", "fast_path": False, "repeats": 1,
                         "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}
EXPORTED = r"EmaTarget's forward modifies its parameter 'target.0.weight' in place"
SEQUENTIAL = r"forward modifies its parameter '3.teacher.weight' in place"



class EmaStage(nn.Module):
    """A stage of an ``nn.Sequential`` that moves its teacher towards another stage's weight."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.source = [source]  # not a submodule: the stage before holds it
        self.teacher = nn.Linear(32, 32).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.teacher.weight.mul_(0.9).add_(self.source[0].weight, alpha=0.1)
        return x + self.teacher(x)


def ema_sequential() -> nn.Sequential:
    """Four stages, the fourth (``3``) an :class:`EmaStage` of the third."""
    torch.manual_seed(0)
    middle = nn.Linear(32, 32)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), middle, EmaStage(middle),
                         nn.Linear(32, 4))


def pair() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 16), torch.randn(32, 16)


def one_step_timer(step: Any, _candidate: Any) -> float:
    step()
    return 1.0


SEQUENTIAL_WRAPS = {
    "checkpoint": lambda m, x: op.checkpoint(m, x, **FIXED),
    "offload": lambda m, x: op.offload(m, x, bandwidth="1MB/s", **FIXED),
    "remat_offload": lambda m, x: op.remat_offload(m, x, bandwidth="1MB/s", **FIXED),
    "autotune": lambda m, x: op.checkpoint(m, x, autotune=True, autotune_timer=one_step_timer,
                                           **FIXED),
    "list of stages": lambda m, x: op.checkpoint(list(m), x, **FIXED),
    "profile_chain": lambda m, x: op.profile_chain(m, x, repeats=1, warmup=0),
}


@pytest.mark.parametrize("wrap", sorted(SEQUENTIAL_WRAPS))
def test_an_nn_sequential_whose_stage_updates_a_parameter_is_refused(wrap):
    """main: accepted, the teacher moved once per profile run (and once per re-run of its
    stage in a checkpoint plan)."""
    model = ema_sequential()
    with pytest.raises(OptmemInputError, match=SEQUENTIAL):
        SEQUENTIAL_WRAPS[wrap](model, torch.randn(8, 16))


def test_profile_chain_of_an_exported_model_refuses_it():
    """main: the chain returned, the target encoder moved by every profiled run."""
    with pytest.raises(OptmemInputError, match=EXPORTED):
        op.profile_chain(EmaTarget(), pair(), repeats=1, warmup=0)


def test_submodule_sample_refuses_a_forward_that_updates_before_the_submodule():
    """main: the sample returned, the target encoder moved once by the partial forward."""
    with pytest.raises(OptmemInputError, match=EXPORTED):
        op.submodule_sample(EmaTarget(), "target", *pair())


def test_submodule_sample_reached_before_the_update_is_taken():
    """The forward stops at ``online``, before the update: nothing was modified."""
    model = EmaTarget()
    before = [p.clone() for p in model.parameters()]
    x1, x2 = pair()
    sample = op.submodule_sample(model, "online", x1, x2)
    assert torch.equal(sample["input"], x1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("kind", ["exported", "sequential"])
def test_pipeline_refuses_it(kind, one_rank):
    """main: the pipeline built, the teacher moved by rank 0's profile runs only."""
    model, sample, match = ((EmaTarget(), pair(), EXPORTED) if kind == "exported"
                            else (ema_sequential(), torch.randn(8, 16), SEQUENTIAL))
    with pytest.raises(OptmemInputError, match=match):
        op.pipeline(model, sample, gpus=1, loss_fn=lambda out, _target: out.sum(), repeats=1,
                    warmup=0, time_model=lambda *_: (1.0, 2.0))


def test_on_ranks_the_error_is_raised_within_rank_0s_decision(monkeypatch):
    """``run_once`` gives every rank the exception its decision raised on rank 0. main: the
    decision returned (rank 0 alone raised afterwards), so the other ranks, whose parameters
    no profile had touched, went on to train."""
    raised_within: list[bool] = []

    def run_once(decide: Any, group: Any = None, *, together: bool = False) -> Any:
        try:
            value = decide()
        except OptmemInputError:
            raised_within.append(True)
            raise
        raised_within.append(False)
        return value

    monkeypatch.setattr(process_groups, "run_once", run_once)
    with pytest.raises(OptmemInputError, match=EXPORTED):
        op.checkpoint(EmaTarget(), pair(), **FIXED)
    assert raised_within == [True]
