"""A plan given by ``use_plan`` survives the wrapper's re-extractions when it still applies.

A forward hook registered after wrapping (or a submodule replaced, or a new call
signature) makes the next call extract the model again (``TensorState``). Before, the new
graph ran the planner's plan and the given one was silently lost. Now the given plan is
kept when the new chain has as many stages and the plan replays on it (within the given
``memory_limit``); otherwise one ``UserWarning`` says why it was dropped.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402,F401  (one thread)
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402


class Residual(nn.Module):
    """Four residual tanh layers and a scalar loss: a graph (not a Sequential) to extract."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            x = torch.tanh(lin(x)) + x
        return x.square().mean()


def _wrapped(limit: str = "60%"
             ) -> tuple[Residual, torch.Tensor, op.CheckpointedModule, list[str]]:
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(2, 8)
    cmodel = op.checkpoint(model, (x,), memory_limit=limit, repeats=1, warmup=0,
                           fast_path=False)
    n = cmodel.chain.length
    plan = ["F_ck 1", *[f"F_all {i}" for i in range(2, n + 1)], "Loss",
            *[f"B {i}" for i in range(n, 1, -1)], "F_all 1", "B 1"]
    assert tuple(plan) != cmodel.result.plan  # not the planner's plan
    return model, x, cmodel, plan


def _new_variant(cmodel: op.CheckpointedModule):
    assert len(cmodel._variants) == 2  # the call extracted again
    return list(cmodel._variants.values())[-1]


def _call_after_a_hook(model: Residual, x: torch.Tensor, cmodel: op.CheckpointedModule
                       ) -> list[warnings.WarningMessage]:
    model.lins[3].register_forward_hook(lambda m, i, o: o * 2.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = cmodel(x)
        loss.backward()
    assert loss.item() == pytest.approx(model(x).item())  # the hook is in the new graph
    return [w for w in seen if "use_plan" in str(w.message)]


def test_a_given_plan_is_kept_after_a_hook_extracts_again() -> None:
    model, x, cmodel, plan = _wrapped()
    cmodel.use_plan(plan)
    dropped = _call_after_a_hook(model, x, cmodel)
    assert dropped == []
    variant = _new_variant(cmodel)
    assert tuple(map(str, variant.executor.plan)) == tuple(plan)
    assert variant.result.plan == tuple(plan)
    assert variant.result.report["source"] == "use_plan"
    assert variant.result.objective == pytest.approx(
        simulate_checkpoint(variant.chain, plan).makespan)
    assert variant.limit is None  # as given: no limit, no fast path


def test_a_given_plan_over_its_limit_on_the_new_chain_is_dropped_with_a_warning() -> None:
    model, x, cmodel, plan = _wrapped()
    peak = simulate_checkpoint(cmodel.chain, plan).peak_memory
    cmodel.use_plan(plan, memory_limit=peak - 1)  # run as given (not checked here)
    dropped = _call_after_a_hook(model, x, cmodel)
    assert len(dropped) == 1
    assert issubclass(dropped[0].category, UserWarning)
    assert "above the limit" in str(dropped[0].message)
    variant = _new_variant(cmodel)
    assert variant.result.report.get("source") != "use_plan"
    assert tuple(map(str, variant.executor.plan)) == variant.result.plan != tuple(plan)


def test_a_given_plan_for_another_stage_count_is_dropped_with_a_warning() -> None:
    model, x, cmodel, plan = _wrapped("100%")  # the planner's plan fits the shorter chain
    cmodel.use_plan(plan)
    del model.lins[1:]  # one layer left: a shorter chain
    with pytest.warns(UserWarning, match=r"use_plan\(\) is dropped .* stages"):
        cmodel(x).backward()
    variant = _new_variant(cmodel)
    assert variant.chain.length < cmodel.chain.length
    assert variant.result.report.get("source") != "use_plan"


def test_resolve_returns_to_the_planner() -> None:
    model, x, cmodel, plan = _wrapped()
    cmodel.use_plan(plan)
    cmodel.resolve(memory_limit="60%", method="dp")
    dropped = _call_after_a_hook(model, x, cmodel)
    assert dropped == []
    assert _new_variant(cmodel).result.report.get("source") != "use_plan"


def test_resolve_after_use_plan_takes_the_planners_method_and_limit() -> None:
    """``resolve()`` with no argument after ``use_plan`` solves with the planner's method
    and the wrapper's limit (the given plan has neither). Before: "unknown method
    'custom'" (the given plan's label) or "the current plan has no memory limit"."""
    _, _, cmodel, plan = _wrapped()
    planned = cmodel.result
    cmodel.use_plan(plan)
    again = cmodel.resolve()
    assert (again.method, again.plan, again.objective) == (
        planned.method, planned.plan, planned.objective)
    peak = simulate_checkpoint(cmodel.chain, plan).peak_memory
    cmodel.use_plan(plan, memory_limit=peak)  # the given plan's own limit is the default
    limited = cmodel.resolve()
    assert limited.memory_limit * limited.unit == peak
    assert limited.peak_memory * limited.unit <= peak
