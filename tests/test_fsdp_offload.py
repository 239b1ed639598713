"""Offload and remat + offload plans under FSDP2 that count FSDP's memory.

``checkpoint_fsdp(..., problem="offload" | "remat_offload")`` solves the plan on the chain of
:func:`~optmem.pytorch.distributed.fsdp_chain` (each unit's gathered parameters and, in the
backward, its unsharded gradients and the prefetched parameters of the unit before, as per-op
temporaries), as it does for checkpointing. Before, an offload plan could be sharded
(``fully_shard_checkpointed(op.offload(...))``) but was solved without those terms: on the
residual MLP its claimed peak was below what the step held by more than two units'
parameters. And a unit re-run in the backward is resharded after the re-run (FSDP2 left it
gathered until its own backward), for checkpoint and remat + offload plans alike. The first
two tests need no processes; the last two spawn 2 gloo ranks.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 needs torch")

import distributed_workers as w  # noqa: E402

import optmem.pytorch as op  # noqa: E402
import optmem.pytorch.api as api  # noqa: E402
import optmem.pytorch.distributed as distributed  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.distributed import (  # noqa: E402
    checkpoint_fsdp,
    fsdp_chain,
    spawn,
    stage_parameter_bytes,
)
from optmem.simulate.offload import simulate_offload  # noqa: E402

TIMES = {"time_model": lambda *_: (1.0, 2.0)}


@pytest.mark.parametrize("problem", ["offload", "remat_offload"])
def test_offload_plans_of_checkpoint_fsdp_are_solved_on_the_fsdp_chain(monkeypatch, problem):
    """The plan's chain is the one-liner's chain plus FSDP's terms (``fsdp_chain`` of the
    stages' parameter bytes), the plan offloads and replays within the limit on that chain,
    and the module is the one-liner's class (sharding left out: no process group here)."""
    monkeypatch.setattr(distributed, "fully_shard_checkpointed", lambda m, **_: m)
    model = w.residual_mlp()
    x = w.mlp_data(8)[0]
    planned = checkpoint_fsdp(model, x, "80%", problem=problem, bandwidth="1GB/s", **TIMES)
    plain = getattr(op, problem)(w.residual_mlp(), x, bandwidth="1GB/s", **TIMES)
    assert type(planned) is type(plain)
    params = stage_parameter_bytes(list(model))
    assert params == [1088] * 6 + [68]  # Linear(16, 16) per block, Linear(16, 1) head
    expected = fsdp_chain(plain.chain, params)
    assert planned.chain.fwd_overhead == expected.fwd_overhead
    assert planned.chain.bwd_overhead == expected.bwd_overhead
    assert planned.chain.fwd_overhead[0] == plain.chain.fwd_overhead[0] + 1088
    assert planned.chain.bwd_overhead[1] == plain.chain.bwd_overhead[1] + 3 * 1088
    plan = [str(o) for o in planned.result.plan]
    assert any(o.startswith("offload") for o in plan)
    limit = int(0.8 * planned.chain.store_all_peak())
    replay = simulate_offload(planned.chain, planned.result.plan,
                              planned.result.report["bandwidth"], limit)
    assert replay.peak_memory <= limit
    assert planned.expected_peak_bytes <= limit
    assert not planned.fast_path  # the model itself would bypass the sharded stages


def test_checkpoint_fsdp_refuses_an_unknown_problem_before_the_profile(monkeypatch):
    """An unknown ``problem`` (the CLI's spelling ``remat-offload`` too) and a bandwidth for
    a checkpoint plan: one ``OptmemInputError`` each, naming the field, nothing profiled."""
    def no_profile(*args, **kwargs):
        raise AssertionError("profiled before the arguments were checked")

    monkeypatch.setattr(api, "build_planned", no_profile)
    model, x = w.residual_mlp(), w.mlp_data(8)[0]
    for problem in ("pipeline", "remat-offload", None):
        with pytest.raises(OptmemInputError, match="problem must be one of 'checkpoint', "
                                                   "'offload', 'remat_offload'") as info:
            checkpoint_fsdp(model, x, "80%", problem=problem)  # type: ignore[arg-type]
        assert info.value.field == "problem"
    with pytest.raises(OptmemInputError, match="a bandwidth is for problem='offload'") as info:
        checkpoint_fsdp(model, x, "80%", bandwidth="1GB/s")
    assert info.value.field == "bandwidth"
    for problem in ("checkpoint", "offload", "remat_offload"):  # valid: it goes on
        with pytest.raises(AssertionError, match="profiled"):
            checkpoint_fsdp(model, x, "80%", problem=problem)


@pytest.mark.distributed
def test_offload_plans_counting_fsdp_train_as_one_process_within_their_peak(tmp_path):
    """2 gloo ranks, a residual MLP and HuggingFace's GPT-2 at 80% of the FSDP chain's
    store-all peak (the plans offload), ``offload`` and ``remat_offload``:

    * ``grad.full_tensor()`` of two steps equals single-process training on both ranks'
      batches, and the ``state_dict`` keys are the model's;
    * the chain has FSDP's terms (the units' parameter bytes on every forward overhead);
    * the measured peak (``measure_training_peak``, host copies left out, FSDP2's resized
      storages counted) is at most the plan's claimed peak plus the documented terms left
      out of the chain: the root unit's parameters and the communication buffers (the
      all-gather output and the reduce-scatter input: two of the largest unit at most);
    * the route before (``fully_shard_checkpointed(op.offload(...))``, its plan solved
      without FSDP's terms) holds more than its claim plus those terms on the MLP (8588 B
      for a claimed 5676, where the new plan claims 8466).
    """
    pytest.importorskip("transformers", reason="the HuggingFace model needs transformers")
    cases = [(model, problem) for model in ("mlp", "hf-gpt2")
             for problem in ("offload", "remat_offload")]
    jobs = [{"kind": "offload_fsdp_planned", "model": model, "problem": problem,
             "memory_limit": "80%", "route": "checkpoint_fsdp"} for model, problem in cases]
    jobs.append({"kind": "offload_fsdp_planned", "model": "mlp", "problem": "offload",
                 "memory_limit": "80%", "route": "fully_shard_checkpointed"})
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for k, (model, problem) in enumerate(cases):
        expected = w.whole_batch_grads(model)
        keys = sorted(w._fsdp_case(model, 2)[0].state_dict())
        for r in range(2):
            got = w.load(str(tmp_path), r, k)
            assert got["kind"] == {"offload": "OffloadedModule",
                                   "remat_offload": "RematOffloadedModule"}[problem]
            assert any(o.startswith("offload") for o in got["plan"])
            assert got["keys"] == keys
            units, chain = got["unit_bytes"], Chain.from_dict(got["chain"])
            assert chain.name.endswith("+fsdp") and max(units) > 0
            assert all(f >= p for f, p in zip(chain.fwd_overhead, units, strict=True))
            allowance = got["root_bytes"] + 2 * max(units)
            assert got["measured"] <= got["claimed"] + allowance, (model, problem, got)
            w.assert_steps_match(got["steps"], expected)
    before = w.load(str(tmp_path), 0, len(cases))
    assert not Chain.from_dict(before["chain"]).name.endswith("+fsdp")
    assert before["measured"] > before["claimed"] + before["root_bytes"] + 2 * max(
        before["unit_bytes"])


@pytest.mark.distributed
def test_units_rerun_in_the_backward_are_sharded_until_their_own_backward(tmp_path):
    """A unit re-run in the backward is resharded after the re-run unless its own ``B``
    comes next (it is gathered again there), so at most that one unit holds its parameters
    between two ops, as the chain counts them. Before, FSDP2 left every re-run unit
    gathered until its ``B`` (a forward inside a backward): the checkpoint plan ``F_all 1,
    F_all 2, F_all 3, B 3`` held units 1, 2 and 3 at once, and the residual MLP's step
    measured 10116 B for a claimed 8384 (now 9028). The gradients stay single-process
    training's (checkpoint and remat + offload plans that re-run)."""
    jobs = [{"kind": "fsdp_gathered_units", "problem": "checkpoint", "memory_limit": "80%"},
            {"kind": "fsdp_gathered_units", "problem": "remat_offload", "memory_limit": "55%"}]
    spawn(w.run_jobs, 2, jobs, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    expected = w.whole_batch_grads("mlp")
    for k in range(len(jobs)):
        for r in range(2):
            got = w.load(str(tmp_path), r, k)
            plan = got["plan"]
            reruns = [o for o in plan[plan.index("Loss"):] if o.startswith("F_")]
            assert len(reruns) >= 3  # the plan re-runs units in the backward
            ops = [o for o, _ in got["gathered"]]
            for n, (o, units) in enumerate(got["gathered"]):
                following = ops[n + 1] if n + 1 < len(ops) else None
                stage = int(o.split()[-1])
                if o.startswith("F_all") and following == f"B {stage}":
                    assert units in ([], [stage]), (o, units)
                elif o == "B 1":  # resharded by the root's final callback, after the plan
                    assert units in ([], [1])
                else:
                    assert units == [], (o, units)
            w.assert_steps_match(got["steps"], expected)
