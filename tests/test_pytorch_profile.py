"""Profiling: exact sizes, temporaries traced at dispatch level, stable times, no side effects."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402, F401  (one thread)
from torch import nn  # noqa: E402

from optmem.chain import Chain  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.problems.checkpoint import CheckpointProblem  # noqa: E402
from optmem.pytorch import profile as profile_module  # noqa: E402
from optmem.pytorch.api import smallest_limit  # noqa: E402
from optmem.pytorch.extract import extract_stages  # noqa: E402
from optmem.pytorch.models import resolve_spec  # noqa: E402
from optmem.pytorch.profile import (  # noqa: E402
    _Progress,
    profile_chain,
    profile_stages,
    round_time,
    with_op_charge,
)
from optmem.solvers.facade import solve  # noqa: E402

SIZES = ("output_size", "saved_size", "fwd_overhead", "bwd_overhead", "weight_size",
         "input_size", "loss_bwd_overhead", "stage_names")


def test_mlp_sizes_are_exact():
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    chain = profile_chain(net, x, repeats=1, warmup=0)
    f = 4  # float32
    assert chain.input_size == 5 * 8 * f
    assert chain.output_size == (5 * 16 * f, 5 * 16 * f, 5 * 4 * f)
    # Linear saves its input (excluded) and weight (a parameter): the tape is the output.
    # Tanh saves its output. The last Linear saves its input only.
    assert chain.saved_size == chain.output_size
    assert chain.weight_size == ((8 * 16 + 16) * f, 0, (16 * 4 + 4) * f)
    assert all(t >= 0 for t in chain.fwd_time + chain.bwd_time)
    # traced on CPU too: a Linear or a Tanh allocates its output and nothing else
    assert chain.fwd_overhead == (0, 0, 0)
    assert Chain.from_dict(chain.to_dict()) == chain


def test_saved_size_counts_distinct_storages_beyond_the_output():
    class Twice(nn.Module):
        def forward(self, x):
            y = x.exp()          # saves its result y
            return (y * y).sum(1)  # saves y twice (one storage)

    x = torch.randn(4, 6, requires_grad=True)  # otherwise nothing is recorded at all
    chain = profile_chain([Twice()], x, repeats=1, warmup=0)
    assert chain.output_size == (4 * 4,)
    assert chain.saved_size == (4 * 6 * 4 + 4 * 4,)  # y once, plus the output


def test_meta_mode_gives_the_same_sizes():
    module, x = resolve_spec("toy-resnet", batch=2)
    real = profile_chain(module, x, repeats=1, warmup=0)
    with torch.device("meta"):
        meta_module, _ = resolve_spec("toy-resnet", batch=2)
    meta = profile_chain(meta_module, x, device="meta")
    for field in ("output_size", "saved_size", "weight_size", "input_size", "stage_names"):
        assert getattr(meta, field) == getattr(real, field), field
    assert meta.extra["profile"]["times"] == "roofline"
    assert all(t > 0 for t in meta.fwd_time)
    # a CPU module profiled on meta is copied, not moved
    meta2 = profile_chain(module, x, device="meta")
    assert meta2.saved_size == real.saved_size
    assert all(not p.is_meta for p in module.parameters())


def test_time_model_hook_is_used():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    calls = []

    def model(stage, inp, out):
        calls.append((type(stage).__name__, tuple(inp.shape), tuple(out.shape)))
        return 2.0, 3.0

    chain = profile_chain(net, torch.randn(3, 4), time_model=model, device="meta")
    assert chain.fwd_time == (2.0, 2.0, 2.0) and chain.bwd_time == (3.0, 3.0, 3.0)
    assert calls[0] == ("Linear", (3, 4), (3, 4))


def test_profiling_has_no_side_effects():
    torch.manual_seed(0)
    module, x = resolve_spec("toy-cnn", batch=2)
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)
    buffers = [b.clone() for b in module.buffers()]
    state = torch.get_rng_state()
    profile_stages(extract_stages(module), x, repeats=2, warmup=1)
    assert torch.equal(torch.get_rng_state(), state)
    for b, old in zip(module.buffers(), buffers, strict=True):
        assert torch.equal(b, old)
    assert all(torch.all(p.grad == 7.0) for p in module.parameters())


def test_progress_bar_writes_to_the_stream():
    stream = io.StringIO()
    bar = _Progress(3, True, stream)
    for k in range(4):
        bar.update(k, f"stage{k}")
    bar.close()
    text = stream.getvalue()
    assert "3/3" in text and text.endswith("\n")
    quiet = io.StringIO()
    _Progress(3, None, quiet).update(1, "x")  # not a terminal: silent
    assert quiet.getvalue() == ""


# ------------------------------------------------------------------ temporaries (CPU)
class Scale(nn.Module):
    def forward(self, x):
        return (x * 2).relu()


class LinearGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return nn.functional.gelu(self.fc(x))


def test_cpu_temporaries_are_traced_exactly():
    f = 4
    x = torch.randn(4, 20, requires_grad=True)
    chain = profile_chain([Scale()], x, repeats=1, warmup=0)
    n = 4 * 20 * f
    assert chain.output_size == chain.saved_size == (n,)  # relu keeps its output
    assert chain.fwd_overhead == (n,)  # x * 2 lives until relu has run
    assert chain.bwd_overhead == (n,)  # relu's gradient beside delta^0 (charged apart)
    # the same stage on an input that needs no gradient: no delta^0 is ever made
    chain = profile_chain([Scale()], x.detach(), repeats=1, warmup=0)
    assert chain.bwd_overhead == (0,)


def test_forward_overhead_covers_the_no_grad_forward():
    """``F_ck``/``F_none`` are charged ``a^i + o_f``: the no-grad peak must fit in it.

    With grad, Linear's output is saved by GELU (tape 2 x 256 B, nothing more at the peak);
    without grad, the same two buffers coexist but only the GELU output is ``a^i``.
    """
    chain = profile_chain([LinearGelu()], torch.randn(4, 8), repeats=1, warmup=0)
    out = 4 * 16 * 4
    assert chain.output_size == (out,) and chain.saved_size == (2 * out,)
    assert chain.fwd_overhead == (out,)


class Tied(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


def test_tied_weight_accumulation_is_a_temporary():
    """A weight also used by a later stage already has a gradient when this stage's backward
    runs: the new gradient is a temporary added into it, not the stored gradient."""
    first = nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    tied = profile_chain([first, Tied(first.weight)], x, repeats=1, warmup=0)
    alone = profile_chain([first, Tied(nn.Parameter(first.weight.detach().clone()))], x,
                          repeats=1, warmup=0)
    assert alone.bwd_overhead[0] == 0  # the weight gradient is stolen into .grad
    assert tied.bwd_overhead[0] == 8 * 8 * 4  # the 8x8 gradient, added then freed
    assert tied.bwd_overhead[1] == alone.bwd_overhead[1] == 0
    assert first.weight.grad is None  # restored


def test_output_size_counts_the_storage_a_view_keeps():
    class First(nn.Module):
        def forward(self, x):
            return x.exp()[:, 0]  # keeps the whole exp(x) storage alive

    chain = profile_chain([First()], torch.randn(4, 6), repeats=1, warmup=0)
    assert chain.output_size == (4 * 6 * 4,)


def test_loss_is_profiled_when_given():
    module, x = resolve_spec("toy-mlp", batch=4)

    def loss_fn(y):
        return nn.functional.cross_entropy(y, torch.zeros(y.shape[0], dtype=torch.long))

    plain = profile_chain(module, x, repeats=1, warmup=0)
    with_loss = profile_chain(module, x, repeats=1, warmup=0, loss_fn=loss_fn)
    assert plain.loss_bwd_overhead == 0 and plain.loss_bwd_time == 0
    assert plain.extra["profile"]["loss"] == "not profiled"
    # log-softmax output and the gradient of the logits (4 x 10 floats each) at least
    assert with_loss.loss_bwd_overhead >= 4 * 10 * 4
    assert with_loss.loss_bwd_time > 0 and with_loss.extra["profile"]["loss"] == "loss_fn"


# ------------------------------------------------------------------ stable profiles
def test_two_profiles_have_identical_sizes():
    """Sizes and temporaries are counted, not timed: bit-identical across profiles, and the
    smallest feasible limit of one profile is feasible for the other (at the facade's 500 slots)."""
    torch.manual_seed(0)
    module, x = resolve_spec("toy-cnn", batch=4)
    a = profile_chain(module, x, repeats=1, warmup=0)
    b = profile_chain(module, x, repeats=1, warmup=0)
    assert all(getattr(a, f) == getattr(b, f) for f in SIZES)
    assert sum(a.fwd_overhead) > 0 and sum(a.bwd_overhead) > 0  # CPU temporaries counted
    assert solve(CheckpointProblem(b, smallest_limit(a, slots=500)), "dp").status.has_plan


def test_identical_stages_share_one_time():
    from optmem.pytorch.toy import toy_mlp

    module, x = toy_mlp(batch=4, width=32, depth=4)
    chain = profile_chain(module, x, repeats=2, warmup=0)
    # Linear, ReLU, ..., Linear(32, 10); the first Linear computes no input gradient
    for times in (chain.fwd_time, chain.bwd_time):
        assert len({times[i] for i in (2, 4, 6)}) == 1
        assert len({times[i] for i in (1, 3, 5, 7)}) == 1
    assert all((t * 2**16).is_integer() for t in chain.fwd_time + chain.bwd_time)


def test_two_profiles_of_a_zoo_model_give_the_same_plan():
    """Eight blocks of the zoo's GPT-2 (width 128), profiled twice on CPU, times measured.

    Robust by construction, whatever the load: the blocks run the same kernels on the same
    shapes, so they form one class and get one pooled time ``t_f``, ``t_b``; every plan's
    makespan is then ``n_F t_f + 8 t_b`` with ``n_F`` its number of forward ops, and times
    are multiples of ``2**-16`` so these sums are exact: the optimum is the plan with the
    fewest forwards that fits, whatever ``t_f > 0`` is, and ties break the same way. Sizes
    are exact. So both profiles give the same plan at every limit.
    """
    from optmem.pytorch.zoo.gpt2 import Block

    torch.manual_seed(0)
    blocks = [Block(128, 4, context=32) for _ in range(8)]
    x = torch.randn(2, 32, 128, requires_grad=True)  # a chain in the middle of a network
    a = profile_chain(blocks, x, repeats=2, warmup=1)
    b = profile_chain(blocks, x, repeats=2, warmup=1)
    assert all(getattr(a, f) == getattr(b, f) for f in SIZES)
    assert len(set(a.fwd_time)) == 1 and len(set(a.bwd_time)) == 1
    low, store = smallest_limit(a, slots=500), a.store_all_peak()
    plans = set()
    for frac in (0.0, 0.25, 0.5, 0.75):
        limit = int(low + frac * (store - low))
        pa = solve(CheckpointProblem(a, limit), "dp").plan
        assert pa == solve(CheckpointProblem(b, limit), "dp").plan, frac
        plans.add(pa)
    assert len(plans) > 1  # the limits really differ


def _work_clock(disturbed: set[int]):
    """A fake ``_Timer.__call__``: time = number of aten ops run (deterministic work), times
    ``50`` for the calls whose index is in ``disturbed`` (a burst of load)."""
    calls = [0]

    class Count(profile_module._OpLog):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def call(self, fn):
        with Count() as counter:
            value = fn()
        k = calls[0]
        calls[0] += 1
        return counter.ops * 0.01 * (50 if k in disturbed else 1), value

    return call


def test_median_of_interleaved_rounds_ignores_bursts(monkeypatch):
    """Load that spoils fewer than half of the timed rounds changes nothing (deterministic:
    the clock is injected; a round times each stage's forward and backward once)."""
    torch.manual_seed(0)
    module, x = resolve_spec("toy-resnet", batch=2)
    stages = extract_stages(module)
    per_round = 2 * len(stages)

    def profile(bad_rounds: set[int], repeats: int = 5) -> Chain:
        disturbed = {r * per_round + k for r in bad_rounds for k in range(per_round)}
        monkeypatch.setattr(profile_module._Timer, "__call__", _work_clock(disturbed))
        return profile_stages(stages, x, repeats=repeats, warmup=0)

    calm, a, b = profile(set()), profile({0, 3}), profile({1, 4})
    assert calm == a == b
    assert profile({0}, repeats=1) != calm  # one sample: the burst would show
    low, store = smallest_limit(calm, slots=500), calm.store_all_peak()
    mid = (low + store) // 2
    assert solve(CheckpointProblem(a, mid), "dp").plan == \
        solve(CheckpointProblem(b, mid), "dp").plan


def test_round_time_grid():
    for t in (1e-4, 0.0123, 0.5, 1.0, 7.77, 1234.5):
        for res in (0.0, 1 / 64, 0.25):
            q = round_time(t, res)
            assert (q * 2**16).is_integer()
            assert abs(q - t) <= t * ((1 + res) ** 0.5 - 1) + 2**-17
    assert round_time(1.0, 0.25) == round_time(1.1, 0.25) == 1.0
    assert round_time(0.0, 0.1) == 0.0
    with pytest.raises(OptmemInputError, match="time_resolution"):
        profile_chain(nn.Linear(2, 2), torch.randn(1, 2), time_resolution=-1)


# ------------------------------------------------------------------ pass-through outputs
class LossAndLogits(nn.Module):
    """An HF-style head: returns a loss and the logits it received (the same storage)."""

    def __init__(self, pass_through: bool = True) -> None:
        super().__init__()
        self.pass_through = pass_through

    def forward(self, x):
        loss = nn.functional.log_softmax(x, dim=1)[:, 0].mean().neg()  # saves log-softmax
        return (loss, x) if self.pass_through else loss


class KeepAndExp(nn.Module):
    """Returns its input beside ``exp`` of it (an intermediate pass-through)."""

    def forward(self, x):
        return x, x.exp()


class Add(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


def test_last_stage_pass_through_is_counted_once():
    """The logits a last stage returns beside the loss are a^{L-1}: no second count.

    Not in its output (so no gradient as large either: only the loss gets one), not in
    its tape, and its backward is profiled without a gradient for them; the bytes left out
    are recorded for ``plan_allowance``.
    """
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    logits = 4 * 10 * 4
    chains = [profile_chain([nn.Linear(8, 10), LossAndLogits(p)], x, repeats=1, warmup=0)
              for p in (True, False)]
    with_logits, loss_only = chains
    assert with_logits.output_size == (logits, 4)  # the loss scalar only
    assert with_logits.saved_size == (logits, logits + 4)  # log-softmax and the loss
    for name in ("output_size", "saved_size", "fwd_overhead", "bwd_overhead"):
        assert getattr(with_logits, name) == getattr(loss_only, name), name
    assert with_logits.extra["profile"]["output_left_out"] == [0, logits]
    assert loss_only.extra["profile"]["output_left_out"] == [0, 0]


def test_intermediate_pass_through_stays_in_output_and_tape():
    x = torch.randn(4, 8)
    chain = profile_chain([nn.Linear(8, 10), KeepAndExp(), Add()], x, repeats=1, warmup=0)
    y = 4 * 10 * 4
    # a^2 = (a^1, exp a^1): both count in a^2 (a^1 may be freed while a^2 lives, by
    # F_none 2), and the tape contains a^2 by definition (CONTRACT: saved >= output)
    assert chain.output_size == (y, 2 * y, y)
    assert chain.saved_size == (y, 2 * y, y)
    assert chain.extra["profile"]["output_left_out"] == [0, 0, 0]


def test_allowance_covers_a_pass_through_stage_run_without_its_input():
    from optmem.pytorch.memory import LOSS_SCALARS, plan_allowance

    x = torch.randn(4, 8)
    chain = profile_chain([nn.Linear(8, 10), LossAndLogits()], x, repeats=1, warmup=0)
    logits = 4 * 10 * 4
    plain = ["F_ck 1", "F_all 2", "Loss", "B 2", "F_all 1", "B 1"]
    dropping = ["F_ck 1", "F_none 2", "Loss", "F_all 1", "F_all 2", "B 2", "B 1"]
    base = plan_allowance(chain, plain, strip_suffix=False)
    assert base == chain.output_size[-1] + LOSS_SCALARS
    assert plan_allowance(chain, dropping, strip_suffix=False) == base + logits


def test_op_overhead_is_added_to_measured_forward_times(monkeypatch):
    """Each measured ``fwd_time`` carries the executor's per-op constant (deterministic
    clock); backward times, time models and the roofline do not."""
    from optmem.pytorch.profile import DEFAULT_OP_OVERHEAD_MS, round_time

    torch.manual_seed(0)
    module, x = resolve_spec("toy-resnet", batch=2)
    stages = extract_stages(module)
    monkeypatch.setattr(profile_module._Timer, "__call__", _work_clock(set()))
    bare = profile_stages(stages, x, repeats=1, warmup=0, op_overhead=0.0)
    default = profile_stages(stages, x, repeats=1, warmup=0)
    more = profile_stages(stages, x, repeats=1, warmup=0, op_overhead=3.0)
    assert default.bwd_time == bare.bwd_time == more.bwd_time
    assert default.extra["profile"]["op_overhead_ms"] == DEFAULT_OP_OVERHEAD_MS
    assert bare.extra["profile"]["op_overhead_ms"] == 0.0
    for t0, t1, t3 in zip(bare.fwd_time, default.fwd_time, more.fwd_time, strict=True):
        assert t0 < t1 < t3
        # the raw time is rounded once, after the constant is added
        assert abs(t3 - round_time(t0 + 3.0, 1 / 64)) <= 0.02 * (t0 + 3.0)
    # the store-all plan's predicted time grows by L * c exactly as the chain says
    assert sum(more.fwd_time) > sum(bare.fwd_time) + 0.9 * 3.0 * len(stages)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    meta = profile_chain(net, torch.randn(3, 4), device="meta", op_overhead=5.0)
    assert meta.extra["profile"]["op_overhead_ms"] == 0.0 and max(meta.fwd_time) < 1.0
    with pytest.raises(OptmemInputError, match="op_overhead"):
        profile_chain(net, torch.randn(3, 4), op_overhead=-1.0)


def test_op_overhead_ratio_scales_measured_forward_times(monkeypatch):
    """``fwd_time = t * (1 + ratio) + op_overhead`` rounded once (deterministic clock), both
    charges recorded; backward times, time models and the roofline are not charged."""
    torch.manual_seed(0)
    module, x = resolve_spec("toy-resnet", batch=2)
    stages = extract_stages(module)
    monkeypatch.setattr(profile_module._Timer, "__call__", _work_clock(set()))
    bare = profile_stages(stages, x, repeats=1, warmup=0, op_overhead=0.0)
    both = profile_stages(stages, x, repeats=1, warmup=0, op_overhead=0.25,
                          op_overhead_ratio=0.5)
    assert both.bwd_time == bare.bwd_time
    assert both.extra["profile"]["op_overhead_ms"] == 0.25
    assert both.extra["profile"]["op_overhead_ratio"] == 0.5
    assert bare.extra["profile"]["op_overhead_ratio"] == profile_module.DEFAULT_OP_OVERHEAD_RATIO
    for t0, t in zip(bare.fwd_time, both.fwd_time, strict=True):
        want = t0 * 1.5 + 0.25  # t0 is itself rounded: within two rounding steps
        assert abs(t - want) <= 0.02 * want
    # re-charging the bare profile gives the same chain up to one rounding step
    again = with_op_charge(bare, 0.25, 0.5)
    assert again.extra["profile"]["op_overhead_ratio"] == 0.5
    for t1, t2 in zip(both.fwd_time, again.fwd_time, strict=True):
        assert abs(t1 - t2) <= 0.02 * t1
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    meta = profile_chain(net, torch.randn(3, 4), device="meta", op_overhead_ratio=5.0)
    assert meta.extra["profile"]["op_overhead_ratio"] == 0.0 and max(meta.fwd_time) < 1.0


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_op_charges_give_one_error_naming_the_field(bad):
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for field in ("op_overhead", "op_overhead_ratio"):
        with pytest.raises(OptmemInputError, match=field) as err:
            profile_chain(net, torch.randn(3, 4), repeats=1, warmup=0, **{field: bad})
        assert err.value.field == field
        chain = Chain.from_lists([1.0], [1.0], [4], [4], input_size=4)
        with pytest.raises(OptmemInputError, match=field) as err:
            with_op_charge(chain, **{"op_overhead": 0.0, "op_overhead_ratio": 0.0, field: bad})
        assert err.value.field == field


def test_op_overhead_ratio_changes_the_bert_plan_as_predicted():
    """On bench_hf's stored BERT profile at ``checkpoint_sequential(2)``'s memory
    (``benchmarks/results/hf_bert_tie.md``): the old charge (0.5 ms per ``F``) picks 2
    segments with 46 re-forwards; 0.05 ms + 20 % of the stage's kernels picks one segment
    of 48 (``F_ck 5``), the plan that runs faster. Both replayed by the simulator."""
    import json
    from pathlib import Path

    from optmem.plan import OpKind, parse_plan
    from optmem.pytorch.planning import Planner
    from optmem.simulate import simulate_checkpoint

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/hf_bert_tie_chain.json"
    stored = Chain.from_dict(json.loads(path.read_text()))
    limit = 32967715  # the limit bench_hf uses under seq2's real peak
    found = {}
    for a, r in ((0.5, 0.0), (0.05, 0.2)):
        chain = with_op_charge(stored, a, r)
        if (a, r) == (0.5, 0.0):
            assert chain.fwd_time == stored.fwd_time  # the stored chain's own charge
        else:  # every stage pays 0.05 ms + 20 % of its kernels
            for old, new in zip(stored.fwd_time, chain.fwd_time, strict=True):
                want = (old - 0.5) * 1.2 + 0.05
                assert abs(new - want) <= 0.02 * want
        result = Planner("checkpoint", limit).solve_at(chain, limit)
        plan = parse_plan(result.plan)
        sim = simulate_checkpoint(chain, plan)
        assert sim.peak_memory <= limit and sim.makespan == result.objective
        found[a, r] = ([str(o) for o in plan if o.kind is OpKind.F_CK],
                       sum(o.kind in (OpKind.F_CK, OpKind.F_NONE) for o in plan))
    assert found[0.5, 0.0] == (["F_ck 8", "F_ck 12"], 46)
    assert found[0.05, 0.2] == (["F_ck 5"], 48)


def test_cuda_timing_and_peaks_are_those_of_the_profiled_device(monkeypatch):
    """A model profiled on ``cuda:1`` while the current device is ``cuda:0`` (a model on the
    second GPU, ``profile --device cuda:1``): the timing events were recorded on the current
    device's stream and only it was synchronised (times of nothing), and the allocator's
    peak was read there (0). Events, synchronisation and statistics are now the profiled
    device's (PyTorch: ``Event.record()`` uses ``current_stream()``, and ``synchronize``,
    ``reset_peak_memory_stats``, ``max_memory_allocated`` default to ``current_device()``)."""
    from pytorch_helpers import FakeCuda

    fake = FakeCuda(current=0).install(monkeypatch)
    cuda1 = torch.device("cuda", 1)
    assert profile_module._Timer(cuda1)(lambda: 7) == (1.0, 7)
    assert fake.log == [("record", 1), ("record", 1), ("sync", 1)]
    fake.log.clear()
    with profile_module._CudaPeak(cuda1) as peak:
        pass
    assert peak.peak == 500  # fake.stats: 100 allocated at entry, peak 600
    fwd, bwd = profile_module._cuda_overheads(nn.Linear(2, 2), torch.ones(3, 2), 0, 0, 0,
                                              cuda1)
    assert (fwd, bwd) == (500, 500)
    assert {d for _, d in fake.log} == {1}


def test_profiling_on_a_device_the_model_is_not_on_is_one_input_error():
    """``profile_chain(model_on_cpu, x, device="cuda")`` moved the sample only, and the first
    stage failed with PyTorch's device mismatch (here, without CUDA, a raw "Torch not
    compiled with CUDA enabled"). It is one input error naming the fix now; the model is
    not moved (the profile leaves it where it is)."""
    import optmem.pytorch as op

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    for profile in (profile_module.profile_chain, op.profile_chain):
        with pytest.raises(OptmemInputError, match=r"weights are on cpu, the profile's "
                                                   r"device is cuda: move the model there"):
            profile(net, x, device="cuda", repeats=1, warmup=0)
    assert all(p.device.type == "cpu" for p in net.parameters())


def test_a_bare_cuda_device_is_the_one_holding_the_model(monkeypatch):
    """``device="cuda"`` is the current device wherever PyTorch takes it (``.to``, streams,
    ``synchronize``), but any CUDA device when the weights are checked: a model on
    ``cuda:1`` (current device 0) profiled with ``device="cuda"`` passed the check, then had
    its sample moved to ``cuda:0`` (a device mismatch in the first stage, even when the
    sample was on ``cuda:1`` already) and its events and RNG taken on ``cuda:0``. The bare
    name now means the device of the model's first CUDA weight (a faked ``cuda:1``)."""
    from pytorch_helpers import on_fake_cuda

    from optmem.pytorch.extract import extract_stages

    class Stop(Exception):
        pass

    moved: list[torch.device] = []

    def move_to(value, dev):
        moved.append(dev)
        raise Stop

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    net[0].weight = nn.Parameter(on_fake_cuda(net[0].weight.detach()))
    monkeypatch.setattr(profile_module, "move_to", move_to)
    stages = extract_stages(net)
    for run in (profile_module.profile_stages, profile_module.merge_inplace_writers):
        with pytest.raises(Stop):
            run(stages, torch.randn(2, 4), device="cuda")
    assert moved == [torch.device("cuda", 1)] * 2
    assert profile_module._profile_device([nn.Linear(2, 2)], "cuda", []) == torch.device("cuda")
