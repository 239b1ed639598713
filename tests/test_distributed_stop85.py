"""Stop 85's hunt of the distributed wrappers not tried before (2 gloo processes).

Tensor parallelism: ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``)
makes a model's parameters ``DTensor`` s and its forward a collective of the mesh's ranks.
``op.checkpoint`` of such a model profiled it on rank 0 alone while rank 1 waited in the
plan's broadcast: rank 0's first all-reduce never met a partner and both ranks waited for
the group's timeout. Now every rank profiles a model holding ``DTensor`` s together and
rank 0's plan is every rank's (``run_once(together=True)``). A new size is still profiled
by each rank alone (the ranks of one tensor-parallel group run the same batch, so they
profile in step, with the sample's chain's times: the same plan). An exported model
(HuggingFace) holding ``DTensor`` s is one clear error: torch.export does not trace them.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="tensor parallelism needs torch")

import distributed_workers as w  # noqa: E402
from pytorch_helpers import assert_trained_alike  # noqa: E402
from torch import nn  # noqa: E402

from optmem.pytorch.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.distributed

ORDERS = ("after", "inner")


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel")
    jobs = [{"kind": "tensor_parallel", "order": order} for order in ORDERS]
    jobs.append({"kind": "tensor_parallel_export"})
    jobs.append({"kind": "tensor_parallel_fsdp", "problem": "offload", "memory_limit": 13500})
    spawn(w.run_jobs, 2, jobs, str(out), init_file=str(out / "rendezvous"))
    return {name: [w.load(str(out), r, k) for r in range(2)]
            for k, name in enumerate((*ORDERS, "export", "fsdp"))}


@pytest.mark.parametrize("order", ORDERS)
def test_tensor_parallel_trains_as_the_plain_parallelized_model(tensor_parallel, order):
    """Wrapping the parallelized model (before: both ranks waited for the group's timeout,
    rank 0 profiling alone) and parallelizing the wrapper's ``.module``: three steps, the
    third on a new batch size, bitwise the plain parallelized model."""
    for rank in tensor_parallel[order]:
        assert_trained_alike(rank["wrapped"], rank["plain"])


@pytest.mark.parametrize("order", ORDERS)
def test_tensor_parallel_plans_are_rank_zeros(tensor_parallel, order):
    """Rank 1's time model makes a stage 30x slower: its own plan would differ, and with
    it the collectives of the re-runs. The sample's plan is rank 0's on both ranks, and so
    is the new size's (each rank's own, from the sample's chain's times); both re-run."""
    zero, one = tensor_parallel[order]
    assert len(zero["plans"]) == 2
    assert zero["plans"] == one["plans"]
    assert all(any(o.startswith("F_all") for o in p[p.index("Loss"):]) for p in zero["plans"])


def test_an_exported_tensor_parallel_model_is_one_clear_error(tensor_parallel):
    """A parallelized Llama wrapped, or a wrapped Llama's ``.module`` parallelized: one
    ``OptmemInputError`` on every rank naming the ways that work. Before: torch.export's
    error, blaming the first parallel ``Linear`` and suggesting an ``nn.Sequential`` of its
    blocks."""
    for rank in tensor_parallel["export"]:
        for message in rank.values():
            assert "holds DTensor parameters" in message and "checkpoint_fsdp" in message


def test_fsdp_over_tensor_parallel_offloads_activations_not_weights(tensor_parallel):
    """``checkpoint_fsdp(problem="offload")`` of a parallelized MLP on a 2 x 1 mesh. The
    saved tensors of a parallel ``Linear`` are ``DTensor`` s, which had no storage address
    (``storage_ptr``): the unit's gathered weight was no weight (O.6) and its copy to the
    host crashed both ranks (SIGSEGV). Now: bitwise the plain model sharded the same way,
    with activations moved (``offload`` ops)."""
    for rank in tensor_parallel["fsdp"]:
        assert rank["address"]
        assert any(o.startswith("offload") for o in rank["plan"])
        for got, expected in zip(rank["wrapped"], rank["plain"], strict=True):
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_fsdp_terms_count_a_parallel_parameters_local_part(tensor_parallel):
    """FSDP2 gathers the local part of a tensor-parallel parameter: the units' bytes of
    the MLP parallelized over 2 ranks are its local tensors' (before: the global sizes,
    2176 and 2112 B for 1088, a claim of 13.7 KB for a measured 9.5 KB on 2 x 2 ranks)."""
    for rank in tensor_parallel["fsdp"]:
        assert rank["bytes"] == [2176, 0, 2112, 0, 2176, 0, 2112, 0, 68]
        assert rank["split"] == [1088, 0, 1088, 0, 1088, 0, 1088, 0, 68]


def test_dtensor_predicate_and_together_outside_a_group():
    """``holds_dtensors`` is false for plain modules; ``run_once`` without a group runs the
    decision here, ``together`` or not (both new in stop 85)."""
    from optmem.pytorch.process_groups import holds_dtensors, run_once

    assert not holds_dtensors([nn.Linear(2, 2), nn.BatchNorm1d(2)])
    assert run_once(lambda: 7, None, together=True) == 7
