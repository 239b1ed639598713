"""Stop 85: ``op.pipeline`` and ``op.PipelinedModel`` check their own arguments.

Found by ``tools/fuzz_pipeline_args.py`` (``docs/pytorch.md``, "Stop 85 (pipeline
arguments)"). Each bad value is one ``OptmemInputError`` naming the argument, on every rank,
before any work (the model as it was, the process group still working). On main some
failed in Python (``gpus="abc"``: ``TypeError``; ``device="gpu0"``: ``RuntimeError``), some
after rank 0's profile in the problem's CLI spelling (``weight-copies``, ``memory-model``,
``memory``), some were taken (``loss_fn=3``, ``scale_grads="no"``) and
``microbatches=2**70`` never ended. The runtime's first-step shape inference ran a stage's
forward without the in-place parameter check the other setups apply since stop 84, and
``run_plan``'s shape dry run too: a forward moving an EMA teacher is now refused there on
every rank.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the pipeline bridge needs torch")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pipeline_plan import PipelinePlan  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.pytorch.arguments import check_options  # noqa: E402
from optmem.pytorch.distributed import spawn  # noqa: E402
from optmem.pytorch.pipelining import run_plan  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402

EMA = r"forward modifies its parameter '1.teacher.weight' in place"


class EmaLayer(nn.Module):
    """A layer whose forward moves its teacher towards its student (BYOL's target)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(8, 8)
        self.teacher = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        with torch.no_grad():
            self.teacher.weight.mul_(0.9).add_(self.student.weight, alpha=0.1)
            target = self.teacher(x)
        return self.student(x) + target


def mlp(ema: bool = False) -> nn.Sequential:
    """Three chain layers (the second an :class:`EmaLayer` with ``ema``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), EmaLayer() if ema else nn.Linear(8, 8),
                         nn.Linear(8, 4))


def plan_of(gpus: int) -> PipelinePlan:
    """A contiguous plan of the three layers on ``gpus`` GPUs (two: layers 1-2 and 3)."""
    chain = Chain.from_lists([1.0, 1.0, 2.0], [2.0, 2.0, 4.0], [1] * 3, [1] * 3, input_size=1)
    return PipelinePlan.from_strings(solve(PipelineProblem(chain, gpus, 10**6),
                                           "contiguous").plan)


TWO_STAGES_ONE_GPU = PipelinePlan.from_strings([
    "period 9", "stage 1 layers 1-2 gpu 0", "stage 2 layers 3-3 gpu 0", "F 1 start 0 shift 0",
    "F 2 start 2 shift 0", "B 2 start 3 shift 0", "B 1 start 5 shift 0"])
"""Both stages on one GPU: the first (with the EMA layer) is dry-run by ``run_plan``."""


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of the tests."""
    return nn.functional.mse_loss(out, target)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the state dict."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    """Whether ``model``'s state is bitwise ``before``."""
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


FAST = dict(loss_fn=mse, repeats=1, warmup=0, memory_per_gpu="1GiB")
PIPELINE_BAD = [("gpus", "abc"), ("gpus", 0.5), ("memory_per_gpu", None),
                ("memory_per_gpu", "abc"), ("weight_copies", -1), ("memory_model", "nope"),
                ("loss_fn", 3), ("max_stages", "abc"), ("device", "gpu0"), ("device", "cuda:99"),
                ("time_limit_s", float("nan")), ("bandwidth", "12 GB"),
                ("microbatches", 2.5), ("method", "nope")]


def group_works() -> bool:
    """An ``all_reduce`` over the default group gives the world size."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


@pytest.mark.parametrize(("name", "value"), PIPELINE_BAD)
def test_pipeline_names_each_bad_argument(name, value, one_rank):
    """main: ``TypeError`` (gpus, max_stages), ``RuntimeError`` (device), the problem's
    CLI spelling after the profile (``memory``, ``weight-copies``, ``memory-model``),
    ``time_limit_s=nan`` and ``bandwidth='12 GB'`` after the profile, ``loss_fn=3``
    taken."""
    model = mlp()
    before = state(model)
    with pytest.raises(OptmemInputError) as info:
        op.pipeline(model, torch.randn(2, 8), **{**FAST, name: value})
    assert info.value.field == name, str(info.value)
    assert unchanged(model, before) and group_works()


MODEL_BAD = [("plan", "abc"), ("plan", [1]), ("device", "gpu0"), ("device", 0.5),
             ("scale_grads", "no"), ("schedule_csv", 1.5), ("schedule_csv", ["a.csv"]),
             ("schedule_csv", "/nonexistent/schedule.csv"), ("device", "cuda:99"),
             ("loss_fn", "mse"), ("extract", "abc")]


@pytest.mark.parametrize(("name", "value"), MODEL_BAD)
def test_pipelined_model_names_each_bad_argument(name, value, one_rank):
    """main: ``plan`` errors without a field, ``RuntimeError``/``TypeError`` (device),
    ``TypeError`` (schedule_csv; an int was taken as a file descriptor: ``True`` closed
    stdout), ``scale_grads='no'`` and ``loss_fn='mse'`` taken."""
    model = mlp()
    before = state(model)
    kw: dict[str, Any] = {"plan": plan_of(1), "loss_fn": mse, "microbatches": 2,
                          name: value}
    with pytest.raises(OptmemInputError) as info:
        op.PipelinedModel(model, kw.pop("plan"), **kw)
    assert info.value.field == name, str(info.value)
    assert unchanged(model, before) and group_works()


def test_microbatches_have_a_bound():
    """The bound that refuses ``microbatches=2**70`` (main: not checked at all)."""
    check_options({"microbatches": 100_000, "gpus": None})
    for value in (2**70, 0, True, "4"):
        with pytest.raises(OptmemInputError, match="microbatches"):
            check_options({"microbatches": value})


def test_the_shape_inference_refuses_an_ema_forward(one_rank):
    """main: the first step trained, the teacher moved once more by the shape inference."""
    piped = op.PipelinedModel(mlp(ema=True), plan_of(1), microbatches=2, loss_fn=mse)
    with pytest.raises(OptmemInputError, match=EMA) as info:
        piped.step(torch.randn(4, 8), target=torch.randn(4, 4))
    assert info.value.field == "module" and group_works()


def test_run_plan_dry_run_refuses_an_ema_forward(one_rank):
    """main: ``run_plan`` ran, its shape dry run moved the teacher once more."""
    model = mlp(ema=True)
    before = state(model)
    with pytest.raises(OptmemInputError, match=EMA):
        run_plan(model, TWO_STAGES_ONE_GPU, [torch.randn(2, 8)] * 2, [torch.randn(2, 4)] * 2,
                 mse)
    assert not unchanged(model, before)  # the dry run's one update, refused after it
    assert group_works()


def two_ranks(rank: int, world: int, out_dir: str) -> None:
    """The bad calls on two ranks; ``{call: (field or class, message, group works)}``."""
    torch.set_num_threads(1)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    calls = {
        "gpus": lambda: op.pipeline(mlp(), x[:2], gpus="abc", **FAST),
        "weight_copies": lambda: op.pipeline(mlp(), x[:2], weight_copies=-1, **FAST),
        "plan": lambda: op.PipelinedModel(mlp(), "abc", loss_fn=mse),
        "device": lambda: op.PipelinedModel(mlp(), plan_of(world), loss_fn=mse,
                                            device="gpu0"),
        "step": lambda: op.PipelinedModel(mlp(ema=True), plan_of(world), microbatches=2,
                                          loss_fn=mse).step(x, target=y),
        "run_plan": lambda: run_plan(mlp(ema=True), plan_of(world), list(x.chunk(2)),
                                     list(y.chunk(2)), mse),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            got = ("", "")
        except OptmemInputError as exc:
            got = (exc.field or "", str(exc))
        except Exception as exc:  # noqa: BLE001 - recorded: the test fails on it
            got = (type(exc).__name__, str(exc))
        out[name] = (*got, group_works())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(out, fh)


@pytest.mark.distributed
def test_every_rank_raises_the_same_error(tmp_path):
    """Two gloo ranks: each bad call is the same input error on both, and the group works
    after it. main: ``TypeError`` for ``gpus``, the plan error without its field, a
    ``RuntimeError`` for the device, and the EMA stage trained (step, run_plan)."""
    spawn(two_ranks, 2, str(tmp_path), init_file=str(tmp_path / "rendezvous"),
          timeout_s=120.0, deadline_s=600.0)
    got = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as fh:
            got.append(pickle.load(fh))
    assert got[0] == got[1]
    for name, (field, message, works) in got[0].items():
        assert works, name
        expected = "module" if name in ("step", "run_plan") else name
        assert field == expected, (name, field, message)
    assert "'1.teacher.weight' in place" in got[0]["step"][1]
    assert "'1.teacher.weight' in place" in got[0]["run_plan"][1]


@pytest.mark.parametrize(("name", "value"), [("plan", "abc"), ("device", "gpu0"),
                                             ("loss_fn", "mse")])
def test_run_plan_names_each_bad_argument(name, value, one_rank):
    """main: the plan error without its field, ``RuntimeError`` (device), and ``loss_fn``
    failing in the step (reported as a failed loss)."""
    kw: dict[str, Any] = {"plan": TWO_STAGES_ONE_GPU, "loss_fn": mse, name: value}
    with pytest.raises(OptmemInputError) as info:
        run_plan(mlp(), kw.pop("plan"), [torch.randn(2, 8)] * 2, [torch.randn(2, 4)] * 2,
                 **kw)
    assert info.value.field == name, str(info.value)
