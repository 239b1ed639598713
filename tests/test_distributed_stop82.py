"""Stop 82's hunt of the distributed and training-stack wrappers (2 gloo processes).

FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)`` alone (the gradients reduce-scattered in
another dtype, the parameters left as they are) was refused on an exported model with the
policies that cast parameters; it is taken now, bitwise plain ``fully_shard``.

``DistributedDataParallel(static_graph=True)`` counts, in its first iteration, how many
times each parameter's gradient hook runs. A wrapped model whose first call differs from
its sample (the whole model wrapped without ``labels`` and called with them, or a backbone
wrapped with its own sample, ``model.transformer = op.checkpoint(model.transformer,
{"input_ids": ids})``, which its parent calls with more arguments) is profiled inside that
first forward, and the profile's backward ran the hooks too: the profiling rank skipped
every reduction from the second step on (tiny GPT-2: gradients 0.13 off) and the other
rank waited forever. Now one ``OptmemInputError`` naming the sample made like the training
call (``op.submodule_sample`` for a part); with it, and for a new signature in a later
iteration, training is bitwise DDP over the plain model.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="DDP needs torch")
pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")

import distributed_workers as w  # noqa: E402

from optmem.pytorch.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.distributed

ROUTES = ("other_sample", "submodule", "new_length", "reduce_dtype")


@pytest.fixture(scope="module")
def static_graph(tmp_path_factory):
    out = tmp_path_factory.mktemp("static_graph")
    jobs = [{"kind": "ddp_static_graph", "route": route} for route in ROUTES[:3]]
    jobs.append({"kind": "fsdp_reduce_dtype"})
    spawn(w.run_jobs, 2, jobs, str(out), init_file=str(out / "rendezvous"))
    return {route: [w.load(str(out), r, k) for r in range(2)]
            for k, route in enumerate(ROUTES)}


def test_a_profile_in_static_graphs_first_forward_is_one_clear_error(static_graph):
    """Before: no error, and from the second step on rank 0's gradients were its own
    (not reduced) while rank 1 waited for the reduction until the group's timeout."""
    for rank in static_graph["other_sample"]:
        message = rank["message"]
        assert "static_graph=True" in message and "op.submodule_sample" in message


@pytest.mark.parametrize("route", ["submodule", "new_length", "reduce_dtype"])
def test_trains_as_the_same_wrapper_over_the_plain_model(static_graph, route):
    """DDP(static_graph=True): a backbone wrapped with the call its parent makes; a new
    length after the first iteration (profiled then, which DDP does not count). FSDP2 with
    ``reduce_dtype=torch.bfloat16`` alone on an exported GPT-2 (before: refused). Bitwise
    the plain model under the same wrapper."""
    for rank in static_graph[route]:
        for got, expected in zip(rank["wrapped"], rank["plain"], strict=True):
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_reduce_dtype_alone_is_taken_on_an_exported_model():
    """Before stop 82 ``refuse_mixed_precision`` refused ``reduce_dtype`` like the dtypes
    that cast what the exported stages read; ``param_dtype`` and ``output_dtype`` still are."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from optmem.errors import OptmemInputError
    from optmem.pytorch.distributed import refuse_mixed_precision

    refuse_mixed_precision("GPT2LMHeadModel", {
        "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)})
    for cast in ({"param_dtype": torch.bfloat16}, {"output_dtype": torch.bfloat16}):
        with pytest.raises(OptmemInputError, match="mixed precision"):
            refuse_mixed_precision("GPT2LMHeadModel", {
                "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32, **cast)})
