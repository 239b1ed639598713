"""Hunt of the torch bridge with PyTorch's training tools around a wrapped model (stop 86;
``docs/pytorch.md``, "Stop 86 (training tools)").

``torch.autograd.graph.disable_saved_tensors_hooks(message)`` makes every registration of
saved-tensor hooks raise ``RuntimeError(message)``. The plain model trains inside it; the
wrapper failed with the caller's message: an offload or remat + offload step (their plans
move saved tensors with such hooks), and any wrapping or first call of a new signature
(profiling counts each stage's tape with them). Now optmem's setup may register its own
hooks there (the region is disabled again, with the caller's message, on exit), and an
offload or remat + offload call inside the region runs the model as it is, with one
warning per wrapper; a checkpoint plan registers no such hooks and runs inside.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import HUNT_FIXED, hunt_kinds  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.execute import add_monitor, remove_monitor  # noqa: E402
from optmem.pytorch.wrapper import SAVED_TENSORS_WARNING  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MESSAGE = "no saved-tensor hooks in this region"


def _no_hooks() -> Any:
    return torch.autograd.graph.disable_saved_tensors_hooks(MESSAGE)


def _disabled_message() -> str | None:
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()


class Blocks(nn.Module):
    """Four pre-norm residual blocks with dropout between two linear layers (exported)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.2))
            for _ in range(4))
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 32),
                         nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def _batch(rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(1))


def _steps(call: Callable[[torch.Tensor], torch.Tensor], owner: nn.Module, x: torch.Tensor,
           inside: bool) -> list[torch.Tensor]:
    """Losses, gradients and parameters of two AdamW steps (inside the region or not)."""
    opt = torch.optim.AdamW(owner.parameters(), lr=1e-2)
    seen: list[torch.Tensor] = []
    for step in range(2):
        torch.manual_seed(10 + step)
        if inside:
            with _no_hooks():
                loss = call(x).square().mean()
                loss.backward()
        else:
            loss = call(x).square().mean()
            loss.backward()
        seen += [loss.detach(), *(p.grad.clone() for p in owner.parameters())]
        opt.step()
        opt.zero_grad()
    return [*seen, *(p.detach().clone() for p in owner.parameters())]


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("kind", ["offload", "remat_offload"])
@pytest.mark.parametrize("build", [Blocks, _sequential], ids=["exported", "sequential"])
def test_offload_plans_run_the_model_inside_the_region(kind: str, build: Any) -> None:
    """Before: the step raised the caller's ``RuntimeError`` (the plan's hooks); now the
    model runs as it is, bitwise, one warning per wrapper; outside, the plan again."""
    plain, x = build(), _batch()
    fn, options = hunt_kinds()[kind]
    cmodel = fn(copy.deepcopy(plain), x, **HUNT_FIXED, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _steps(cmodel, cmodel.module, x, inside=True)
    assert [str(w.message) for w in caught] == [SAVED_TENSORS_WARNING]
    assert _disabled_message() is None
    _assert_equal(got, _steps(plain, plain, x, inside=True))
    _assert_equal(_steps(cmodel, cmodel.module, x, inside=False),
                  _steps(plain, plain, x, inside=False))


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_wrapping_inside_the_region_works_and_leaves_it_disabled(kind: str) -> None:
    """Before: profiling raised the caller's message; now the wrapper is built, the region
    stays disabled with the caller's message, and the wrapper trains as the model."""
    plain, x = Blocks(), _batch()
    fn, options = hunt_kinds()[kind]
    with _no_hooks():
        cmodel = fn(copy.deepcopy(plain), x, **HUNT_FIXED, **options)
        assert _disabled_message() == MESSAGE
        with pytest.raises(RuntimeError, match=MESSAGE):
            torch.autograd.graph.save_on_cpu().__enter__()
    assert _disabled_message() is None
    _assert_equal(_steps(cmodel, cmodel.module, x, inside=False),
                  _steps(plain, plain, x, inside=False))


def test_a_checkpoint_plan_runs_a_new_signature_inside_the_region() -> None:
    """Before: a first call at a new batch size raised the caller's message (profiling);
    now it is extracted, profiled and solved there, and its plan runs, bitwise."""
    plain, x = Blocks(), _batch()
    cmodel = op.checkpoint(copy.deepcopy(plain), x, **HUNT_FIXED)
    ops: list[str] = []
    monitor: Callable[..., None] = lambda op_, *_: ops.append(op_)  # noqa: E731
    add_monitor(monitor)
    try:
        got = _steps(cmodel, cmodel.module, _batch(5), inside=True)
    finally:
        remove_monitor(monitor)
    assert any(o.startswith(("F_ck", "F_none")) for o in ops)  # the plan ran, re-runs
    _assert_equal(got, _steps(plain, plain, _batch(5), inside=True))
