"""Stop 85's leftovers of the torch bridge (``docs/pytorch.md``, "Stop 85 (leftovers)").

* Tensor parallelism with ``process_group="local"``: each rank profiled and solved alone, so
  a time model (or measured times) that differs by rank gave each rank its own plan, and
  with it other re-runs of a forward that is a collective (on main, rank 1 re-ran a
  ``RowwiseParallel`` stage once more than rank 0: a hang). Stages holding ``DTensor`` s
  now agree on their mesh's group even under ``"local"`` (``decision_group``).
* A sample an exported model cannot take (``sample=3``, ``"abc"``, ``{}`` for GPT-2) made
  ``op.pipeline`` raise the extractor's "cannot extract a chain" (field ``module``); now the
  plain model's own error, as ``op.checkpoint`` raises (``wrapper.extracted_call``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import distributed_workers as w  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_helpers import gpt2  # noqa: E402
from pytorch_helpers import assert_trained_alike  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def local_tensor_parallel(tmp_path_factory):
    out = tmp_path_factory.mktemp("local_tensor_parallel")
    jobs = [{"kind": "tensor_parallel", "order": "after", "process_group": "local",
             "slow": 0}]
    spawn(w.run_jobs, 2, jobs, str(out), init_file=str(out / "rendezvous"))
    return [w.load(str(out), r, 0) for r in range(2)]


@pytest.mark.distributed
def test_local_tensor_parallel_ranks_follow_one_plan(local_tensor_parallel):
    """Rank 1's time model makes the first ``Linear`` 30x slower. On main each rank solved
    alone under ``"local"``: rank 0 re-ran stage 3 (``RowwiseParallel``, an all-reduce)
    twice, rank 1 three times (the job then stops before training, which would hang). Now
    rank 0's plan on both ranks (decided on the mesh's group), and three steps (the third a
    new size) bitwise the plain parallelized model."""
    zero, one = local_tensor_parallel
    assert not zero["differ"] and not one["differ"]
    assert zero["plans"] == one["plans"] and len(zero["plans"]) == 2
    for rank in local_tensor_parallel:
        assert_trained_alike(rank["wrapped"], rank["plain"])


def test_decision_group_without_dtensors_is_resolve_groups(one_rank):
    """Plain stages under ``"local"`` decide here (``None``), as before; a one-rank group
    too; a bad value is ``resolve_group``'s error (``decision_group`` is new in stop 85)."""
    from optmem.pytorch.process_groups import decision_group, mesh_group

    stages = [nn.Linear(2, 2), nn.Tanh()]
    assert decision_group("local", stages) is None
    assert mesh_group(stages) is None
    assert decision_group(None, stages) is None  # one member: local
    with pytest.raises(OptmemInputError, match="process_group"):
        decision_group("nope", stages)


def test_a_dtensor_on_a_two_dimensional_mesh_under_local_is_one_clear_error(one_rank):
    """No single group of a 2D mesh covers its ranks: one error naming ``process_group``
    and what to pass instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from optmem.pytorch.process_groups import decision_group

    mesh = init_device_mesh("cpu", (1, 1))
    layer = nn.Linear(2, 2)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh,
                                                  [Replicate(), Replicate()]))
    with pytest.raises(OptmemInputError, match="process_group=None") as info:
        decision_group("local", [layer])
    assert info.value.field == "process_group"
    assert dist.get_world_size() == 1


BAD_SAMPLES = [(3, AttributeError, "'int' object has no attribute 'size'"),
               ("abc", AttributeError, "'str' object has no attribute 'size'"),
               ({}, ValueError, "You have to specify either input_ids or inputs_embeds")]


@pytest.mark.parametrize(("sample", "kind", "message"), BAD_SAMPLES)
def test_a_bad_pipeline_sample_raises_the_models_own_error(sample, kind, message, one_rank):
    """``op.pipeline`` of the tiny GPT-2 with a sample it cannot take: the plain model's
    exception, as ``op.checkpoint`` raises (main: an ``OptmemInputError`` on ``module``,
    "cannot extract a chain"); the model's parameters as they were."""
    model, _ = gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(kind, match=message) as info:
        op.pipeline(model, sample, gpus=1, memory_per_gpu="1GiB", repeats=1, warmup=0)
    assert not isinstance(info.value, OptmemInputError)
    with pytest.raises(kind, match=message):
        op.checkpoint(gpt2()[0], sample, memory_limit="60%")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
