"""Stop 77's audit of the one-liners under distributed wrappers (2 gloo processes).

``op.offload`` and ``op.remat_offload`` sharded per stage with FSDP2
(``fully_shard_checkpointed``): the gradients (``grad.full_tensor()``) equal single-process
training on the whole batch. Before the fix the offload executors took the gathered
parameters of an FSDP unit for activations (their storages are not the sharded
parameters'), copied them to the host after the unit had freed them again, and trained on
garbage (gradients off by up to 1e28 on a residual MLP, 1e37 on a tiny GPT-2).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 needs torch")

import distributed_workers as w  # noqa: E402

from optmem.pytorch.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.distributed


def test_offload_plans_sharded_per_stage_train_as_the_plain_model(tmp_path):
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    cases = [(wrap, model) for model in ("mlp", "hf-gpt2")
             for wrap in ("offload", "remat_offload")]
    jobs = [{"kind": "offload_fsdp", "wrap": wrap, "model": model, "memory_limit": "60%"}
            for wrap, model in cases]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for k, (_, model) in enumerate(cases):
        expected = w.whole_batch_grads(model)
        keys = sorted(w._fsdp_case(model, 2)[0].state_dict())
        for r in range(2):
            got = w.load(str(tmp_path), r, k)
            assert any(op.startswith("offload") for op in got["plan"])  # the plan moves some
            assert got["keys"] == keys
            w.assert_steps_match(got["steps"], expected)


def test_blocks_sharded_after_wrapping_an_exported_model_is_one_clear_error(tmp_path):
    """``fully_shard`` on HuggingFace GPT-2's blocks after ``op.checkpoint``: the exported
    stages call the graph, not the blocks, so their hooks would never run. Before, the call
    was refused as a new call signature ("pad to the sample's sizes"), blaming the input."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    spawn(w.run_jobs, 2, [{"kind": "blocks_sharded_after"}], str(tmp_path),
          init_file=str(tmp_path / "rendezvous"))
    for r in range(2):
        message = w.load(str(tmp_path), r, 0)["message"]
        assert "fully_shard" in message and "checkpoint_fsdp" in message
        assert "fully_shard_checkpointed" in message and "pad" not in message


def test_calls_a_sharded_exported_model_cannot_run_are_one_clear_error(tmp_path):
    """``checkpoint_fsdp`` keeps the sample's call signature. A call under an autocast the
    sample was not made under is one error naming autocast and the way that works (wrap
    under it: checked bitwise against plain ``fully_shard`` in the audit); before, it said
    to pad to the sample's sizes, which no padding fixes. An evaluation under
    ``torch.no_grad()`` (documented as not supported: the model itself would run on the
    stages' shards) is one error saying what to do; before, it failed inside torch
    ("aten.embedding.default got mixed torch.Tensor and DTensor")."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    spawn(w.run_jobs, 2, [{"kind": "fsdp_refused_calls"}], str(tmp_path),
          init_file=str(tmp_path / "rendezvous"))
    for r in range(2):
        messages = w.load(str(tmp_path), r, 0)
        assert "differs in autocast" in messages["autocast"]
        assert "torch.autocast" in messages["autocast"] and "pad" not in messages["autocast"]
        assert "torch.no_grad()" in messages["no_grad"]
        assert "full_state_dict" in messages["no_grad"]


def test_ddp_over_the_offload_one_liners_is_ddp_over_the_model_bitwise(tmp_path):
    """``DistributedDataParallel(op.offload(model))`` and ``op.remat_offload``: two AdamW
    steps on each rank's own batch equal DDP over the model itself bit for bit (losses,
    gradients, parameters, evaluation under ``torch.no_grad()``, ``state_dict`` keys), with
    default arguments, ``static_graph=True``, ``find_unused_parameters=True``, ``no_sync()``
    accumulation and bfloat16 ``torch.autocast`` (the audit checked the HuggingFace families
    by hand)."""
    settings = [({}, False), ({"static_graph": True}, False),
                ({"find_unused_parameters": True}, True), ({}, True)]
    jobs = [{"kind": "ddp_offload", "wrap": wrap, "ddp": ddp, "accumulate": accumulate}
            for wrap in ("offload", "remat_offload") for ddp, accumulate in settings]
    jobs += [{"kind": "ddp_offload", "wrap": wrap, "ddp": {}, "autocast": True}
             for wrap in ("offload", "remat_offload")]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for k in range(len(jobs)):
        for r in range(2):
            got = w.load(str(tmp_path), r, k)
            assert any(op.startswith("offload") for op in got["plan"])  # the plan moves some
            wrapped, plain = got["wrapped"], got["plain"]
            assert wrapped["keys"] == plain["keys"]
            for a, b in zip(wrapped["losses"], plain["losses"], strict=True):
                assert torch.equal(a, b)
            for a, b in zip(wrapped["grads"], plain["grads"], strict=True):
                assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in b)
            assert all(torch.equal(wrapped["params"][n], t) for n, t in plain["params"].items())
            assert torch.equal(wrapped["eval"], plain["eval"])


@pytest.fixture(scope="module")
def ddp_optimizer_state(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_optimizer_state")
    spawn(w.run_jobs, 2, [{"kind": "ddp_optimizer_state"}], str(out),
          init_file=str(out / "rendezvous"))
    return [w.load(str(out), r, 0) for r in range(2)]


def test_optimizer_state_of_the_wrapper_inside_ddp_has_the_models_keys(ddp_optimizer_state):
    """The documented way under DDP: ``get_/set_optimizer_state_dict(ddp.module, opt)``."""
    keys = sorted(n for n, _ in w.residual_mlp().named_parameters())
    for rank in ddp_optimizer_state:
        assert rank["inner"] == {"keys": keys, "error": ""}


def test_optimizer_state_through_ddp_has_the_models_keys(ddp_optimizer_state):
    """``get_optimizer_state_dict(ddp, opt)`` through the DDP module itself names the
    model's keys (``0.weight``) and ``set_optimizer_state_dict`` takes them back. Before
    (found in stop 77, fixed in stop 78) torch's ``_get_fqns`` kept the wrapper's attribute
    when the wrapper was not the root: ``_optmem_module.0.weight``, then "Missing optimizer
    state for parameter '0.weight'" on the way back. The wrapper now holds the model as
    ``_checkpoint_wrapped_module``, the attribute of torch's own checkpoint wrapper, whose
    prefix torch's state-dict helpers strip."""
    keys = sorted(n for n, _ in w.residual_mlp().named_parameters())
    for rank in ddp_optimizer_state:
        assert rank["ddp"] == {"keys": keys, "error": ""}
