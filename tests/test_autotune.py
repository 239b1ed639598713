"""Measured plan selection (``op.checkpoint(..., autotune=True)``, optmem.pytorch.autotune).

No verdict depends on time: the clock is injected (a fake timer that runs the step and
returns scripted milliseconds), chains have fixed times, and what is checked is the choice
the fake timings imply, the candidates' validity (simulator replay within the limit),
bitwise gradients and the model's state.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402,F401  (one thread)

import optmem.pytorch as op  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.autotune import (  # noqa: E402
    Candidate,
    candidates,
    time_candidates,
)
from optmem.simulate import simulate_checkpoint  # noqa: E402


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                for _ in range(8)])
    return net, torch.randn(32, 64)


@pytest.fixture(scope="module")
def fixed():
    """The MLP, its sample, a chain with fixed times and a limit with two candidates.

    Sizes are exact (profiled); times are set (0.8 ms forward with the profile's 0.5 ms op
    charge, 0.6 ms backward) so that the settings disagree at 60 % of store-all.
    """
    net, x = _mlp()
    chain = op.profile_chain(net, x, repeats=1, warmup=0)
    chain = dataclasses.replace(chain, fwd_time=(0.8,) * chain.length,
                                bwd_time=(0.6,) * chain.length)
    return net, x, chain, int(chain.store_all_peak() * 0.6)


class FakeTimer:
    """Runs the step (the real code path) and returns scripted ms per plan id."""

    def __init__(self, ms: dict[str, float] | None = None, default: float = 10.0) -> None:
        self.ms = ms or {}
        self.default = default
        self.calls: list[str] = []

    def __call__(self, step, cand: Candidate) -> float:
        step()
        self.calls.append(cand.plan_id)
        return self.ms.get(cand.plan_id, self.default)


def _plan_ids(net, x, chain, limit) -> list[str]:
    base = op.checkpoint(net, x, memory_limit=limit, chain=chain)
    return [c.plan_id for c in candidates(base._planner, chain, limit, base.result)]


def test_off_by_default_is_todays_plan(fixed):
    net, x, chain, limit = fixed
    off = op.checkpoint(net, x, memory_limit=limit, chain=chain)
    explicit = op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=False)
    same = dataclasses.replace(explicit.result, solve_time_s=off.result.solve_time_s)
    assert off.result == same and "autotune" not in off.result.report
    assert tuple(off.plan) == tuple(explicit.plan)
    assert "autotune" not in off.summary()


def test_candidates_are_valid_distinct_plans(fixed):
    net, x, chain, limit = fixed
    base = op.checkpoint(net, x, memory_limit=limit, chain=chain)
    cands = candidates(base._planner, chain, limit, base.result)
    assert len(cands) == 2  # this chain and limit: the settings disagree
    assert cands[0].plan == tuple(base.result.plan) and cands[0].settings[0] == "profile"
    assert len({c.plan for c in cands}) == len(cands)
    seen = [s for c in cands for s in c.settings]
    assert sorted(seen) == sorted(["profile", "op ratio 0.05+0.2t", "no op charge",
                                   "3x segment charge"])
    for c in cands:
        sim = simulate_checkpoint(chain, c.plan)
        assert sim.peak_memory <= limit
        assert c.result.objective == pytest.approx(sim.makespan)
        assert c.model_objective == pytest.approx(sim.makespan + 1.0 * c.segments)
    # the profile's plan is the model's optimum among them
    assert cands[0].model_objective <= min(c.model_objective for c in cands)


@pytest.mark.parametrize("winner", [0, 1])
def test_the_choice_follows_the_timings(fixed, winner):
    net, x, chain, limit = fixed
    ids = _plan_ids(net, x, chain, limit)
    timer = FakeTimer({ids[winner]: 1.0})
    cmodel = op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                           autotune_timer=timer, autotune_rounds=3)
    record = cmodel.result.report["autotune"]
    assert record["chosen"] == ids[winner] and record["skipped"] is None
    assert [c["plan_id"] for c in record["candidates"]] == ids
    assert [c["measured_ms"] for c in record["candidates"]] == [
        1.0 if k == winner else 10.0 for k in range(2)]
    assert [c["chosen"] for c in record["candidates"]] == [k == winner for k in range(2)]
    # a warm-up step per candidate, then 3 interleaved rounds, order rotated each round
    assert len(timer.calls) == 2 * 4
    assert timer.calls[2:4] == ids[::-1] and timer.calls[4:6] == ids
    chosen = cmodel.result
    assert Candidate(tuple(cmodel.plan), chosen, []).plan_id == ids[winner]
    sim = simulate_checkpoint(chain, chosen.plan)  # the claimed objective is the simulated
    assert chosen.objective == pytest.approx(sim.makespan) and sim.peak_memory <= limit
    text = cmodel.summary()
    assert f"autotune: 2 candidate plans timed (median of 3 interleaved steps after 1 " \
           f"warm-up), plan {ids[winner]} kept" in text
    assert f"* {ids[winner]}" in text


def test_ties_keep_todays_plan(fixed):
    net, x, chain, limit = fixed
    ids = _plan_ids(net, x, chain, limit)
    cmodel = op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                           autotune_timer=FakeTimer(default=5.0), autotune_rounds=1)
    assert cmodel.result.report["autotune"]["chosen"] == ids[0]


def test_gradients_equal_the_plain_model_whatever_is_chosen(fixed):
    net, x, chain, limit = fixed
    ids = _plan_ids(net, x, chain, limit)

    def grads(call) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        call(x).sum().backward()
        out = [p.grad.clone() for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        return out

    ref = grads(net)
    for winner in ids:
        cmodel = op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                               autotune_timer=FakeTimer({winner: 1.0}), autotune_rounds=1)
        assert cmodel.result.report["autotune"]["chosen"] == winner
        assert not cmodel.fast_path_taken
        for a, b in zip(grads(cmodel), ref, strict=True):
            assert torch.equal(a, b)


def test_tuning_leaves_the_model_as_it_was():
    """Parameters, gradients (of parameters and of the sample), buffers and the RNG state
    are the same after timing (a model with BatchNorm statistics and dropout)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                              torch.nn.Dropout(0.5), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4))
    x = torch.randn(8, 16, requires_grad=True)
    cmodel = op.checkpoint(net, x, memory_limit="1GiB", repeats=1, warmup=0,
                           fast_path=False)
    for p in net.parameters():
        p.grad = torch.full_like(p, 3.0)
    x.grad = torch.full_like(x, 2.0)
    params = [p.detach().clone() for p in net.parameters()]
    grads = [p.grad for p in net.parameters()]
    buffers = [b.clone() for b in net.buffers()]
    rng = torch.get_rng_state()
    plan = tuple(cmodel.plan)
    store_all = tuple(cmodel.result.plan)
    cands = [Candidate(plan, cmodel.result, ["a"]), Candidate(store_all, cmodel.result, ["b"])]
    timer = FakeTimer()
    time_candidates(cmodel, x, cands, rounds=2, timer=timer)
    assert len(timer.calls) == 6 and all(len(c.times) == 2 for c in cands)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), params, strict=True))
    assert all(p.grad is g for p, g in zip(net.parameters(), grads, strict=True))
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert all(torch.equal(b, c) for b, c in zip(net.buffers(), buffers, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert tuple(cmodel.plan) == plan


def test_nothing_is_timed_on_the_fast_path(fixed):
    net, x, chain, _ = fixed
    timer = FakeTimer()
    cmodel = op.checkpoint(net, x, memory_limit="1GiB", chain=chain, autotune=True,
                           autotune_timer=timer)
    assert cmodel.fast_path_taken and timer.calls == []
    record = cmodel.result.report["autotune"]
    assert record["skipped"].startswith("store-all fast path")
    assert len(record["candidates"]) == 1 and record["candidates"][0]["measured_ms"] is None
    assert "autotune: nothing timed (store-all fast path" in cmodel.summary()


def test_one_candidate_is_not_timed(fixed):
    net, x, chain, _ = fixed
    timer = FakeTimer()
    limit = int(chain.store_all_peak() * 0.4)  # every setting gives the same plan here
    cmodel = op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                           autotune_timer=timer)
    assert timer.calls == [] and cmodel.result.report["autotune"]["skipped"] == "one candidate"


def test_autotune_is_a_checkpoint_option(fixed):
    net, x, chain, limit = fixed
    with pytest.raises(OptmemInputError, match="autotune_rounds: expected an integer >= 1"):
        op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                      autotune_rounds=0)
    with pytest.raises(OptmemInputError, match="autotune is a checkpoint option"):
        op.offload(net, x, memory_limit="1GiB", bandwidth="1GB/s", chain=chain,
                   autotune=True)
    # a timer that is not a function, or answers no duration: raw TypeError / ValueError
    # from inside the tuning, or NaN taken as a time, until stop 51 (a hunt)
    with pytest.raises(OptmemInputError, match="autotune_timer: expected a function"):
        op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                      autotune_timer=5)
    for answer in (None, "x", math.nan, -1.0, True):
        with pytest.raises(OptmemInputError, match="expected a finite number of milli"):
            op.checkpoint(net, x, memory_limit=limit, chain=chain, autotune=True,
                          autotune_timer=lambda step, cand, a=answer: a, autotune_rounds=1)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is in the test extra")
def test_an_exported_model_with_a_dict_sample():
    """GPT-2 (tiny, dropout off): the sample dict is the call (``labels=``: the backward
    starts from the loss); two plans timed, the model's gradients left as they were, and
    either plan gives the plain model's outputs and gradients bitwise."""
    from hf_helpers import assert_same, gpt2, step

    model, batch = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    chain = op.profile_chain(model, batch, repeats=1, warmup=0)
    low = op.smallest_limit(chain)
    cmodel = op.checkpoint(model, batch, memory_limit=(low + chain.store_all_peak()) // 2,
                           chain=chain, fast_path=False)
    lowest = cmodel._planner.solve(chain, memory_limit=low)
    cands = [Candidate(tuple(cmodel.result.plan), cmodel.result, ["mid"]),
             Candidate(tuple(lowest.plan), lowest, ["low"])]
    assert cands[0].plan != cands[1].plan
    timer = FakeTimer()
    time_candidates(cmodel, batch, cands, rounds=1, timer=timer)
    assert len(timer.calls) == 4
    assert all(p.grad is None for p in model.parameters())
    ref = step(model, model, batch)
    for cand in cands:
        cmodel.set_plan(list(cand.plan))
        assert_same(step(cmodel, model, batch), ref)


def test_the_default_timer_synchronises_the_models_cuda_devices(monkeypatch):
    """The default timer called ``torch.cuda.synchronize()``: the current device only, so a
    model on ``cuda:1`` (current device 0) was timed by its kernel launches. It now
    synchronises the devices of the model's and the sample's CUDA tensors."""
    from pytorch_helpers import FakeCuda, on_fake_cuda

    from optmem.pytorch import autotune

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    assert autotune.cuda_devices(net, x) == []
    assert autotune.cuda_devices(net, {"x": on_fake_cuda(x)}) == [torch.device("cuda", 1)]
    cmodel = op.checkpoint(net, x, memory_limit="1GiB", repeats=1, warmup=0, fast_path=False)
    fake = FakeCuda(current=0).install(monkeypatch)
    ms = autotune.default_timer(lambda: None, None, devices=[torch.device("cuda", 1)])
    assert ms >= 0 and fake.log == [("sync", 1), ("sync", 1)]
    fake.log.clear()
    assert autotune.default_timer(lambda: None, None) >= 0  # no devices: the current one
    assert fake.log == [("sync", 0), ("sync", 0)]
    seen = []
    monkeypatch.setattr(autotune, "cuda_devices", lambda model, sample: [torch.device("cuda", 1)])
    monkeypatch.setattr(autotune, "default_timer",
                        lambda step, cand, devices=None: seen.append(devices) or 1.0)
    cands = [Candidate(tuple(cmodel.plan), cmodel.result, ["a"])]
    time_candidates(cmodel, x, cands, rounds=1, warmup=0)
    assert seen == [[torch.device("cuda", 1)]]
