"""DistributedDataParallel over ``optmem.pytorch.checkpoint`` (2 gloo processes).

Default DDP arguments, ``static_graph=True`` and ``find_unused_parameters=True``, with and
without suffix stripping: the gradients after DDP's all-reduce equal single-process training
on the whole batch. Rank 1
measures a 30x slower layer than rank 0: planned locally the ranks choose different plans,
with the default process group both run rank 0's plan. HuggingFace's GPT-2 (exported) works
the same way; inside DDP it is refused with a message naming the order that works.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch", reason="DDP needs torch")

import distributed_workers as w  # noqa: E402

from optmem.pytorch.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.distributed

LIMIT = 4088  # bytes: between the smallest feasible limit (3072) and store-all (7680); each
# rank's input is a view of half the batch, counted as its own 512 B since stop 81 (4600
# when its whole 1 KiB storage was counted: the same plans)


def test_ddp_over_checkpoint_plan_matches_single_process(tmp_path):
    jobs = [{"kind": "ddp", "ddp": ddp, "strip_suffix": strip, "process_group": None,
             "memory_limit": LIMIT}
            for ddp, strip in (({}, True), ({}, False), ({"static_graph": True}, False))]
    jobs.append({"kind": "ddp", "ddp": {}, "strip_suffix": True, "process_group": "local",
                 "memory_limit": LIMIT})
    # find_unused_parameters=True works too (the parameters are inputs of the plan's
    # autograd nodes, so DDP's search of the output's graph finds them)
    jobs += [{"kind": "ddp", "ddp": {"find_unused_parameters": True}, "strip_suffix": strip,
              "process_group": None, "memory_limit": LIMIT} for strip in (True, False)]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    model = w.residual_mlp()
    x, y = w.mlp_data(16)
    torch.nn.functional.mse_loss(model(x), y).backward()
    for k in (0, 1, 2, 4, 5):
        check_ranks([w.load(str(tmp_path), r, k) for r in range(2)], model)
    alone = [w.load(str(tmp_path), r, 3)["plan"] for r in range(2)]
    assert alone[0] != alone[1]  # the timings differ enough to change the plan
    assert alone[0] == w.load(str(tmp_path), 0, 0)["plan"]  # the shared plan is rank 0's


def test_ddp_all_reduces_buckets_while_the_plans_backward_runs(tmp_path):
    """Each parameter's gradient reaches DDP's reducer right after its last ``B`` op (the
    executor's release nodes), so with one bucket per parameter DDP starts all-reducing
    while the plan's backward still has ``B`` ops to run, as for the unmodified module;
    the gradients are still the single-process ones."""
    jobs = [{"kind": "ddp", "ddp": {"bucket_cap_mb": 1e-6}, "strip_suffix": False,
             "process_group": None, "memory_limit": LIMIT, "watch_buckets": True}]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    model = w.residual_mlp()
    x, y = w.mlp_data(16)
    torch.nn.functional.mse_loss(model(x), y).backward()
    ranks = [w.load(str(tmp_path), r, 0) for r in range(2)]
    check_ranks(ranks, model)
    for data in ranks:
        total = data["b_ops"]
        assert total == sum(op.startswith("B ") for op in data["plan"])
        hooks = data["bucket_hooks"]
        assert len(hooks) >= 4  # one bucket per parameter
        assert min(hooks) < total - 1, (hooks, total)  # before the plan's last B ops


def test_ddp_over_checkpoint_plan_of_huggingface_gpt2(tmp_path):
    """HuggingFace's GPT2LMHeadModel, exported with torch.export (side inputs, its own loss,
    tied head), in DDP with default arguments: the plan recomputes, both ranks run it, the
    gradients equal single-process training on the whole batch."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    # between the smallest feasible limit (100400 B) and store-all (176640 B)
    spawn(w.run_jobs, 2, [{"kind": "ddp_hf", "memory_limit": 140000}, {"kind": "refusals"}],
          str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    model = w.hf_gpt2()
    x, y = w.gpt_data(8)
    model(input_ids=x, labels=y).loss.backward()
    check_ranks([w.load(str(tmp_path), r, 0) for r in range(2)], model)
    check_refusals([w.load(str(tmp_path), r, 1) for r in range(2)])


def test_ddp_over_checkpoint_plan_of_a_lora_fine_tune(tmp_path):
    """A ``peft`` LoRA fine-tune of HF GPT-2 in DDP with default arguments: DDP's reducer
    holds the adapters only (the frozen weights are not in its buckets), the plan
    recomputes, the adapters' gradients equal single-process training, the frozen weights
    get none."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    pytest.importorskip("peft", reason="the LoRA fine-tune needs peft (dev extra)")
    spawn(w.run_jobs, 2, [{"kind": "ddp_hf", "memory_limit": 120000, "lora": True}],
          str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    model = w.hf_gpt2_lora()
    x, y = w.gpt_data(8)
    model(input_ids=x, labels=y).loss.backward()
    check_ranks([w.load(str(tmp_path), r, 0) for r in range(2)], model)


def check_refusals(ranks: list[dict]) -> None:
    """A model inside DDP (for ``checkpoint`` and ``pipeline``) and an optmem-wrapped model
    given to ``pipeline``: one ``OptmemInputError`` on the ``module`` field naming what to
    pass instead (before, all three said "cannot extract a chain from ...", quoted
    torch.export's and fx's errors and advised passing an nn.Sequential of its blocks)."""
    for out in ranks:
        field, message = out["checkpoint(ddp)"]
        assert field == "module" and message.startswith(
            "field 'module': the model is a DistributedDataParallel")
        assert "(its .module) and wrap the result in DistributedDataParallel" in message
        field, message = out["pipeline(ddp)"]
        assert field == "module" and "optmem.pytorch.pipeline would bypass" in message
        assert "no data parallelism around it" in message
        field, message = out["pipeline(cmodel)"]
        assert field == "module" and "already wrapped by optmem" in message


def check_ranks(ranks: list[dict], model: torch.nn.Module) -> None:
    """One plan on both ranks, one that recomputes, and the gradients of ``model`` (trained
    on the whole batch in one process) on every rank."""
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert any(op.startswith("F_none") or op.startswith("F_ck") for op in ranks[0]["plan"])
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for data in ranks:
        assert set(data["grads"]) == set(trained)  # a frozen weight gets no gradient
        for name, p in trained.items():
            torch.testing.assert_close(data["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def test_ddp_with_dynamic_padding_runs_each_ranks_lengths(tmp_path):
    """DDP over the wrapper while each rank pads to its own batch's longest sequence: at the
    same step the ranks see different lengths, some new to one rank only (at step 1 rank
    0's 10 runs its plan of 12 while rank 1's 13 is new; at step 2 rank 1's 16 is the
    sample's while rank 0's 14 is new). Each rank profiles and solves its own
    new sizes, so no rank waits for another; the gradients after every step's all-reduce
    are the mean of the plain model's gradients on each rank's batch. Before, a new
    length went through rank 0's decision: a length new to one rank only left it waiting
    for a broadcast (a hang until the group's timeout), and a rank given rank 0's decision
    ran a plan profiled on rank 0's length."""
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    spawn(w.run_jobs, 2, [{"kind": "ddp_lengths", "memory_limit": 150000}], str(tmp_path),
          init_file=str(tmp_path / "rendezvous"))
    ranks = [w.load(str(tmp_path), r, 0) for r in range(2)]
    assert any(op.startswith("F_none") or op.startswith("F_ck") for op in ranks[0]["plan"])
    model = w.hf_gpt2_long()

    def loss(rank: int, step: int) -> torch.Tensor:
        ids = w.lengths_batch(rank, step)
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    _assert_plain_means(ranks, model, len(w.LENGTHS), loss, rtol=1e-5, atol=1e-6)


def _assert_plain_means(ranks: list[dict], model: torch.nn.Module, steps: int,
                        loss: Callable[[int, int], torch.Tensor], **tolerance: float) -> None:
    """Each rank's gradients after each step's all-reduce are the mean over the two ranks
    of the plain ``model``'s gradients of ``loss(rank, step)``."""
    for step in range(steps):
        means: dict[str, torch.Tensor] = {}
        for rank in range(2):
            model.zero_grad(set_to_none=True)
            loss(rank, step).backward()
            for name, p in model.named_parameters():
                means[name] = means.get(name, 0) + p.grad / 2
        for data in ranks:
            assert set(data["steps"][step]) == set(means)
            for name, g in means.items():
                torch.testing.assert_close(data["steps"][step][name], g, **tolerance)


def test_ddp_with_ranks_on_different_sides_of_a_value_branch(tmp_path):
    """DDP over the wrapper of a model that branches on an input's value, the ranks on
    different sides at the same step (``distributed_workers.MASKED``). A rank whose batch
    takes the other side extracts, profiles and solves it alone (no rank waits for
    another), and the gradients after every all-reduce are the mean of the plain model's
    on each rank's batch."""
    spawn(w.run_jobs, 2, [{"kind": "ddp_branches"}], str(tmp_path),
          init_file=str(tmp_path / "rendezvous"))
    ranks = [w.load(str(tmp_path), r, 0) for r in range(2)]
    assert any(op.startswith(("F_none", "F_ck")) for op in ranks[0]["plan"])
    assert ranks[0]["branches"] == ranks[1]["branches"] == 1  # the masked side, each rank
    model = w.Branchy()
    _assert_plain_means(ranks, model, len(w.MASKED),
                        lambda rank, step: model(*w.branches_batch(rank, step)),
                        rtol=1e-6, atol=1e-7)
