"""Stop 82's hunt of the distributed and training-stack wrappers (2 gloo processes).

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

ROUTES = ("other_sample", "submodule", "new_length")


@pytest.fixture(scope="module")
def static_graph(tmp_path_factory):
    out = tmp_path_factory.mktemp("static_graph")
    jobs = [{"kind": "ddp_static_graph", "route": route} for route in ROUTES]
    spawn(w.run_jobs, 2, jobs, str(out), init_file=str(out / "rendezvous"))
    return {route: [w.load(str(out), r, k) for r in range(2)]
            for k, route in enumerate(ROUTES)}


def test_a_profile_in_static_graphs_first_forward_is_one_clear_error(static_graph):
    """Before: no error, and from the second step on rank 0's gradients were its own
    (not reduced) while rank 1 waited for the reduction until the group's timeout."""
    for rank in static_graph["other_sample"]:
        message = rank["message"]
        assert "static_graph=True" in message and "op.submodule_sample" in message


@pytest.mark.parametrize("route", ["submodule", "new_length"])
def test_static_graph_trains_as_ddp_over_the_plain_model(static_graph, route):
    """A backbone wrapped with the call its parent makes; a new length after the first
    iteration (profiled then, which DDP does not count): bitwise the plain model's."""
    for rank in static_graph[route]:
        for got, expected in zip(rank["wrapped"], rank["plain"], strict=True):
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[n], expected[n]) for n in expected)
