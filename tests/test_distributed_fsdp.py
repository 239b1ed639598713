"""FSDP2 (``fully_shard`` per stage on a CPU device mesh) with a checkpoint plan, 2 processes.

``checkpoint_fsdp`` profiles the unsharded model on rank 0, adds what FSDP gathers while a
stage runs to the chain's per-op overheads, solves once, and shards one FSDP unit per stage.
The gradients (``grad.full_tensor()``) equal single-process training on the whole batch, for a
residual MLP and for a GPT-2 whose tied embedding and head stay in the root unit. Sharding
first and checkpointing after is refused with a message naming the supported order.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 needs torch")

import distributed_workers as w  # noqa: E402

from optmem.chain import Chain  # noqa: E402
from optmem.pytorch.distributed import fsdp_chain, spawn  # noqa: E402

pytestmark = pytest.mark.distributed


def test_fsdp2_with_checkpoint_plan_matches_single_process(tmp_path):
    # limits between the smallest feasible one and store-all of the FSDP-adjusted chains
    jobs = [{"kind": "fsdp", "model": "mlp", "memory_limit": 9000},
            {"kind": "fsdp", "model": "gpt", "memory_limit": 110000},
            {"kind": "fsdp_refusal"}]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for k, (build, (x, y), loss_fn) in enumerate(
            [(w.residual_mlp, w.mlp_data(16), torch.nn.functional.mse_loss),
             (w.tiny_gpt, w.gpt_data(8), w.lm_loss)]):
        model = build()
        loss_fn(model(x), y).backward()
        ranks = [w.load(str(tmp_path), r, k) for r in range(2)]
        assert ranks[0]["plan"] == ranks[1]["plan"]
        assert any(op.startswith("F_none") or op.startswith("F_ck") for op in ranks[0]["plan"])
        chain = Chain.from_dict(ranks[0]["chain"])
        assert chain.name.endswith("+fsdp")
        for data in ranks:
            assert set(data["grads"]) == {n for n, _ in model.named_parameters()}
            for name, p in model.named_parameters():
                torch.testing.assert_close(data["grads"][name], p.grad, rtol=1e-5, atol=1e-6)
    units = w.load(str(tmp_path), 0, 1)["units"]
    assert units[0] == "Embedding" and units[-1] == "Linear"  # tied: left to the root
    assert all(u.startswith("FSDP") for u in units[1:-1])
    for r in range(2):
        message = w.load(str(tmp_path), r, 2)["message"]
        assert "already sharded with fully_shard" in message and "checkpoint_fsdp" in message


def test_fsdp_chain_counts_gathered_parameters():
    chain = Chain.from_lists([1, 1, 1], [1, 1, 1], [10, 10, 10], [10, 10, 10], input_size=10)
    out = fsdp_chain(chain, [100, 0, 7])
    assert out.fwd_overhead == (100, 0, 7)
    assert out.bwd_overhead == (200, 100, 14)  # own params + grads, prefetch of the previous
    assert fsdp_chain(chain, [100, 0, 7], prefetch=False).bwd_overhead == (200, 0, 14)
    assert out.store_all_peak() > chain.store_all_peak()
