"""The checkpointed module computes exactly what the unmodified module computes.

For an MLP, a small ResNet (torch.fx segments) and a small transformer (torch.fx), over
store-all, DP at several limits down to the tightest feasible one, recompute-all, Chen,
and exhaustive (brute) plans on a tiny merged chain: the loss, every parameter gradient and
the input gradient are bitwise equal (CPU kernels are deterministic), with and without
suffix stripping. Dropout gives identical masks on recomputation (RNG restore), BatchNorm
running statistics are updated once, tuples flow between stages, and ``torch.no_grad()``
inference matches.
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import reference_step, tightest_result  # noqa: E402
from torch import nn  # noqa: E402

from optmem.errors import OptmemInputError, PlanError  # noqa: E402
from optmem.problems.checkpoint import CheckpointProblem  # noqa: E402
from optmem.pytorch.execute import CheckpointedChain, split_suffix  # noqa: E402
from optmem.pytorch.extract import extract_stages  # noqa: E402
from optmem.pytorch.models import resolve_spec  # noqa: E402
from optmem.pytorch.profile import profile_stages  # noqa: E402
from optmem.solvers import checkpoint_baselines as base  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402


def loss_fn(out):
    return out.float().square().mean()


def assert_same_step(module, cm, x, *, seed=0, bitwise=True):
    ref = reference_step(module, x, loss_fn, seed=seed)
    got = reference_step(cm, x, loss_fn, seed=seed, owner=module)
    kw = {"rtol": 0, "atol": 0} if bitwise else {}
    torch.testing.assert_close(got[0], ref[0], **kw)
    torch.testing.assert_close(got[1], ref[1], **kw)
    assert len(got[2]) == len(ref[2])
    for k, (a, b) in enumerate(zip(got[2], ref[2], strict=True)):
        assert (a is None) == (b is None), f"parameter {k}"
        if a is not None:
            torch.testing.assert_close(a, b, **kw, msg=f"gradient of parameter {k}")
    if ref[3] is not None:
        torch.testing.assert_close(got[3], ref[3], **kw)


MODELS = {
    "mlp": lambda: resolve_spec("toy-mlp", batch=16),
    "resnet": lambda: resolve_spec("toy-resnet", batch=4),
    "transformer": lambda: resolve_spec("toy-transformer", batch=4),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request):
    torch.manual_seed(0)
    module, x = MODELS[request.param]()
    stages = extract_stages(module)
    chain = profile_stages(stages, x, repeats=1, warmup=0)
    return request.param, module, x, stages, chain


def _plans(chain):
    length = chain.length
    store = chain.store_all_peak()
    tight = tightest_result(chain)
    plans = {
        "store_all": base.store_all_plan(length),
        "recompute_all": base.recompute_all_plan(length),
        "chen": base.chen_plan(length),
        "dp_tightest": tight.plan,
    }
    assert tight.plan != tuple(str(o) for o in base.store_all_plan(length))
    for frac in (0.6, 0.8):
        limit = int(tight.memory_limit * tight.unit + frac * (store - tight.memory_limit
                                                               * tight.unit))
        r = solve(CheckpointProblem(chain, limit), "dp")
        assert r.status.has_plan
        plans[f"dp_{frac}"] = r.plan
    return plans


@pytest.mark.parametrize(("strip", "release"), [(True, True), (False, True), (False, False)])
def test_gradients_equal_over_plans(setup, strip, release):
    name, module, x, stages, chain = setup
    for label, plan in _plans(chain).items():
        cm = CheckpointedChain(stages, plan, strip_suffix=strip, release_early=release)
        try:
            assert_same_step(module, cm, x)
        except AssertionError as exc:
            raise AssertionError(f"{name}, plan {label}: {exc}") from None


def test_input_gradient_equal():
    torch.manual_seed(1)
    module, x = resolve_spec("toy-mlp", batch=8)
    stages = extract_stages(module)
    x = x.requires_grad_(True)
    for plan in (base.recompute_all_plan(len(stages)), base.chen_plan(len(stages))):
        assert_same_step(module, CheckpointedChain(stages, plan), x)


def test_brute_plan_on_tiny_chain():
    torch.manual_seed(2)
    module, x = resolve_spec("toy-resnet", batch=2)
    stages = extract_stages(module, max_stages=4)
    assert len(stages) == 4
    chain = profile_stages(stages, x, repeats=1, warmup=0)
    tight = tightest_result(chain, "brute")
    dp = solve(CheckpointProblem(chain, tight.memory_limit * tight.unit), "dp")
    # the exhaustive optimum is never worse than the persistent DP at the same limit
    assert not dp.status.has_plan or tight.objective <= dp.objective + 1e-9
    assert_same_step(module, CheckpointedChain(stages, tight.plan), x)


def test_floating_plan():
    torch.manual_seed(3)
    module, x = resolve_spec("toy-mlp", batch=8, )
    stages = extract_stages(module, max_stages=6)
    chain = profile_stages(stages, x, repeats=1, warmup=0)
    r = tightest_result(chain, "dp:floating")
    assert_same_step(module, CheckpointedChain(stages, r.plan), x)


def test_dropout_identical_with_rng_restore():
    torch.manual_seed(4)
    from optmem.pytorch.toy import toy_transformer

    module, x = toy_transformer(batch=4, dropout=0.3)
    stages = extract_stages(module)
    plan = base.recompute_all_plan(len(stages))
    assert_same_step(module, CheckpointedChain(stages, plan), x, seed=5)
    # without the restore, recomputed dropout masks differ and so do the gradients
    cm = CheckpointedChain(stages, plan, preserve_rng_state=False)
    ref = reference_step(module, x, loss_fn, seed=5)
    got = reference_step(cm, x, loss_fn, seed=5, owner=module)
    assert any(not torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))


def test_global_rng_advances_as_without_plan():
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5),
                        nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stages = extract_stages(net)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    torch.manual_seed(7)
    loss_fn(net(x)).backward()
    after_ref = torch.rand(3)
    torch.manual_seed(7)
    loss_fn(cm(x)).backward()
    torch.testing.assert_close(torch.rand(3), after_ref, rtol=0, atol=0)


def test_batchnorm_running_stats_updated_once():
    torch.manual_seed(8)
    module, x = resolve_spec("toy-cnn", batch=4, )
    twin = copy.deepcopy(module)
    stages = extract_stages(module)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    torch.manual_seed(11)
    loss_fn(twin(x)).backward()
    torch.manual_seed(11)
    loss_fn(cm(x)).backward()
    for b1, b2 in zip(module.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b1, b2, rtol=0, atol=0)
    for p1, p2 in zip(module.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=0, atol=0)


class Split(nn.Module):
    def forward(self, x):
        return x[:, :4] * 2, x[:, 4:].sin()


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair):
        a, b = pair
        return self.lin(a) * b, b


class Last(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


def test_tuples_between_stages():
    torch.manual_seed(9)
    net = nn.Sequential(nn.Linear(8, 8), Split(), Join(), Join(), Last(), nn.Linear(4, 3))
    x = torch.randn(5, 8, requires_grad=True)
    stages = extract_stages(net)
    chain = profile_stages(stages, x, repeats=1, warmup=0)
    for plan in (base.recompute_all_plan(6), tightest_result(chain).plan,
                 base.chen_plan(6)):
        assert_same_step(net, CheckpointedChain(stages, plan), x)


def test_no_grad_inference_matches():
    torch.manual_seed(10)
    module, x = resolve_spec("toy-resnet", batch=2)
    module.eval()
    stages = extract_stages(module)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    with torch.no_grad():
        torch.testing.assert_close(cm(x), module(x), rtol=0, atol=0)
        assert not cm(x).requires_grad


def test_invalid_plan_is_rejected():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(PlanError, match="op 1"):
        CheckpointedChain(extract_stages(net), ["F_all 1", "F_all 1", "Loss", "B 2", "B 1"])


def test_split_suffix():
    ops = base.store_all_plan(4)
    assert split_suffix(ops, 4) == ((), 1)
    plan = base.recompute_all_plan(3)
    rest, j = split_suffix(plan, 3)
    assert j == 4 and rest == plan  # recompute-all ends with F_none L: nothing to strip
    assert math.isfinite(len(rest))


# ------------------------------------------------------------------ torch semantics
def test_autograd_grad_and_backward_inputs_over_plans(setup):
    name, module, x, stages, chain = setup
    params = list(module.parameters())
    ref = reference_step(module, x, loss_fn, seed=12)[2]
    for label, plan in _plans(chain).items():
        cm = CheckpointedChain(stages, plan)
        torch.manual_seed(12)
        got = torch.autograd.grad(loss_fn(cm(x)), params, allow_unused=True)
        assert all(p.grad is None for p in params), label
        for k, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert (a is None) == (b is None), (label, k)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{label} {k}")
        first = params[0]  # backward(inputs=...) fills only what was asked
        torch.manual_seed(12)
        loss_fn(cm(x)).backward(inputs=[first])
        torch.testing.assert_close(first.grad, ref[0], rtol=0, atol=0)
        assert all(p.grad is None for p in params[1:])
        first.grad = None


def test_shared_layer_in_two_stages_gets_both_contributions():
    torch.manual_seed(13)
    shared = nn.Linear(8, 8)
    net = nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), shared, nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stages = extract_stages(net)
    for plan in (base.recompute_all_plan(len(stages)), base.chen_plan(len(stages))):
        assert_same_step(net, CheckpointedChain(stages, plan), x)  # bitwise: two summands


class UsesOutsideWeight(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.__dict__["outside"] = weight  # not registered: invisible to .parameters()

    def forward(self, x):
        return x @ self.outside


def test_a_stage_using_an_unregistered_tensor_is_refused():
    weight = nn.Parameter(torch.randn(4, 4))
    stages = [nn.Linear(4, 4), UsesOutsideWeight(weight), nn.Linear(4, 2)]
    cm = CheckpointedChain(stages, base.recompute_all_plan(3))
    with pytest.raises(OptmemInputError, match="not its parameters"):
        cm(torch.randn(2, 4)).sum().backward()


def test_double_backward_and_retain_graph_follow_autograd():
    """Stop 81: ``create_graph=True`` and ``retain_graph=True`` work through the plan (they
    raised before); a backward after one that did not retain the graph is refused, as
    autograd refuses it for the plain module."""
    module, x = resolve_spec("toy-mlp", batch=4)
    stages = extract_stages(module)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    params = list(module.parameters())
    want = torch.autograd.grad(loss_fn(module(x)), params, create_graph=True)
    got = torch.autograd.grad(loss_fn(cm(x)), params, create_graph=True)
    assert all(g.requires_grad for g in got)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    out = cm(x)
    loss_fn(out).backward(retain_graph=True)
    loss_fn(out).backward()
    with pytest.raises(RuntimeError, match="already backpropagated without retain_graph"):
        loss_fn(out).backward()
    module.zero_grad(set_to_none=True)


def test_gradient_of_the_chain_output_is_freed_at_its_backward():
    """``delta^L`` lives until ``B L`` (as the simulator counts it), not the whole backward.

    A wide last stage (the logits of a model) whose gradient autograd would otherwise keep
    alive while the Function's backward runs the rest of the plan.
    """
    import weakref

    from optmem.pytorch.execute import add_monitor, remove_monitor

    torch.manual_seed(15)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 512))
    x = torch.randn(4, 8)
    stages = extract_stages(module)
    n = len(stages)
    cm = CheckpointedChain(stages, base.recompute_all_plan(n), strip_suffix=False)
    out = cm(x)
    seen: list[weakref.ref] = []
    out.register_hook(lambda g: seen.append(weakref.ref(g)) or None)
    alive: list[tuple[str, bool]] = []  # after each op of the backward

    def record(op, stored, gradients):
        if seen:
            alive.append((op, seen[0]() is not None))

    add_monitor(record)
    try:
        loss_fn(out).backward()
    finally:
        remove_monitor(record)
    last = [op for op, _ in alive].index(f"B {n}")
    assert all(a for _, a in alive[:last + 1])  # needed up to B L (the re-runs before it)
    assert len(alive) > last + 1 and not any(a for _, a in alive[last + 1:])
    ref = reference_step(module, x, loss_fn)
    got = reference_step(cm, x, loss_fn, owner=module)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_compile_of_the_executor_compiles_each_stage():
    torch.manual_seed(14)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stages = extract_stages(module)
    ref = reference_step(module, x, loss_fn, seed=1)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    got = reference_step(torch.compile(cm, backend="eager"), x, loss_fn, seed=1, owner=module)
    assert cm._compiled is not None and len(cm._compiled) == len(stages)
    for a, b in zip(got[2], ref[2], strict=True):  # compiled: equal to float rounding
        torch.testing.assert_close(a, b)



def _counting_backend(graphs):
    """A ``torch.compile`` backend that runs the graph as it is and records it."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def test_torch_compile_of_the_executor_compiles_stages_with_its_backend():
    """The stages take the enclosing compile's backend; ``compile_stages`` options win."""
    from optmem.pytorch.execute import enclosing_compile_options

    assert enclosing_compile_options() == {}  # no compile encloses the caller
    torch.manual_seed(15)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                           nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stages = extract_stages(module)
    ref = reference_step(module, x, loss_fn, seed=1)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    outer: list = []
    got = reference_step(torch.compile(cm, backend=_counting_backend(outer)), x, loss_fn,
                         seed=1, owner=module)
    assert len(outer) >= len(stages)  # every stage compiled by the enclosing backend
    for a, b in zip(got[2], ref[2], strict=True):  # graphs run as they are: bitwise
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other: list = []  # another enclosing backend: the stages are compiled anew with it
    reference_step(torch.compile(cm, backend=_counting_backend(other)), x, loss_fn, seed=1,
                   owner=module)
    assert len(other) >= len(stages)
    chosen: list = []
    cm.compile_stages(backend=_counting_backend(chosen))
    n_outer = len(outer)
    reference_step(torch.compile(cm, backend=_counting_backend(outer)), x, loss_fn, seed=1,
                   owner=module)
    assert len(chosen) >= len(stages)  # explicit options win over the enclosing ones
    assert len(outer) - n_outer < len(stages)  # at most the wrapper's own frame

# ------------------------------------------------------------------ stage fusion
def test_fusable_runs_on_hand_made_plans():
    from optmem.plan import parse_plan
    from optmem.pytorch.execute import fusable_runs

    store_all = parse_plan(["F_all 1", "F_all 2", "F_all 3", "F_all 4", "Loss",
                            "B 4", "B 3", "B 2", "B 1"])
    assert fusable_runs(store_all, 4) == ((1, 3, (0, 1, 2), 6),)  # stage L never fused
    # rotor's shape: a checkpoint, then a run mirrored by its backwards
    rotor = parse_plan(["F_ck 1", "F_all 2", "F_all 3", "F_all 4", "Loss", "B 4", "B 3",
                        "B 2", "F_all 1", "B 1"])
    assert fusable_runs(rotor, 4) == ((2, 3, (1, 2), 6),)
    # forwards apart (a re-forward between): linked through the tape of stage 1
    apart = parse_plan(["F_all 1", "F_ck 2", "F_all 3", "F_all 4", "Loss", "B 4", "B 3",
                        "F_all 2", "B 2", "B 1"])
    assert fusable_runs(apart, 4) == ((1, 2, (0, 7), 8),)
    # a re-run between B 3 and B 2 cuts the run
    split = parse_plan(["F_all 1", "F_all 2", "F_ck 3", "F_all 4", "F_all 5", "Loss",
                        "B 5", "B 4", "F_all 3", "B 3", "B 2", "B 1"])
    assert fusable_runs(split, 5) == ((1, 3, (0, 1, 8), 9),)
    # defeated: every B follows a re-forward (recompute-all)
    defeated = parse_plan(["F_ck 1", "F_ck 2", "F_all 3", "Loss", "B 3", "F_all 2", "B 2",
                           "F_all 1", "B 1"])
    assert fusable_runs(defeated, 3) == ()
    for plan, n in ((store_all, 4), (rotor, 4), (apart, 4), (split, 5), (defeated, 3)):
        CheckpointedChain([nn.Linear(2, 2) for _ in range(n)], plan)  # valid plans


def test_runs_are_split_at_a_parameter_shared_within_them():
    from optmem.pytorch.execute import _split_runs

    # stages 1 and 3 share parameter 0: the run 1..4 becomes 1..2 and 3..4
    fusion = _split_runs([(1, 4, (0, 1, 2, 3), 7)], {1: [0], 2: [1], 3: [0, 2], 4: [3]},
                         set())
    assert fusion.close == {1: (1, 2), 3: (3, 4)}
    assert fusion.start == {7: (3, 4), 9: (1, 2)}
    assert fusion.link == {1, 3} and fusion.skip == {8, 10}
    # an FSDP unit (stage 2) is left out of every run; positions need not be consecutive
    fusion = _split_runs([(1, 4, (0, 1, 5, 6), 7)], {1: [0], 2: [], 3: [1], 4: [2]}, {2})
    assert fusion.close == {6: (3, 4)} and fusion.start == {7: (3, 4)}
    assert fusion.link == {6} and fusion.skip == {8}


def _fused_plans(chain):
    plans = dict(_plans(chain))
    plans["store_all"] = base.store_all_plan(chain.length)
    return plans


def test_fused_and_unfused_runs_give_bitwise_equal_steps(setup):
    """Stage fusion changes the autograd calls, not the ops: same loss, gradients, real peak.

    The real peak is the exact trace of every storage of the step (no timing): fused and
    per-stage runs free the same values at the same points (gradients inside a run no
    later), so the fused peak is at most the per-stage one, and mostly equal.
    """
    from optmem.pytorch.execute import add_monitor, fusable_runs, remove_monitor
    from optmem.pytorch.memory import measure_training_peak

    name, module, x, stages, chain = setup
    fused_somewhere = False
    equal_peaks = 0
    for label, plan in _fused_plans(chain).items():
        for strip in (True, False):
            fused = CheckpointedChain(stages, plan, strip_suffix=strip)
            plain = CheckpointedChain(stages, plan, strip_suffix=strip, fuse_stages=False)
            j = fused._suffix_start
            runs = fusable_runs(fused._prefix_plan, j - 1) if j > 1 else ()
            fused_somewhere = fused_somewhere or bool(runs)
            a = reference_step(fused, x, loss_fn, owner=module)
            b = reference_step(plain, x, loss_fn, owner=module)
            for u, v in zip(a[2], b[2], strict=True):
                assert (u is None) == (v is None)
                if u is not None:
                    assert torch.equal(u, v), (name, label, strip)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            peaks = []
            for c in (fused, plain):
                module.zero_grad(set_to_none=True)  # no .grad to accumulate into
                peaks.append(measure_training_peak(lambda c=c: loss_fn(c(x)).backward(),
                                                   module, x))
            module.zero_grad(set_to_none=True)
            # never above; below where a gradient inside a run is consumed before the run's
            # call returns (per stage, B k holds delta^k until its call returns)
            assert peaks[0] <= peaks[1], (name, label, strip, peaks)  # exact bytes
            equal_peaks += peaks[0] == peaks[1]
            seen: list[str] = []

            def record(op, stored, gradients, seen=seen):
                seen.append(op)

            add_monitor(record)
            try:
                loss_fn(fused(x)).backward()
            finally:
                remove_monitor(record)
            module.zero_grad(set_to_none=True)
            assert seen == [str(o) for o in fused._prefix_plan if str(o) != "Loss"]
    assert fused_somewhere, name
    assert equal_peaks >= 5, name  # mostly the very same bytes


def test_a_parameter_used_in_and_outside_a_run_sums_in_b_order():
    """``shared`` in stages of one fused run and after it: the sums of plain autograd."""
    torch.manual_seed(16)
    shared = nn.Linear(8, 8)
    net = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(), shared,
                        nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stages = extract_stages(net)
    n = len(stages)
    assert n >= 4
    for strip in (True, False):
        cm = CheckpointedChain(stages, base.store_all_plan(n), strip_suffix=strip)
        assert_same_step(net, cm, x)


class _Block(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.lin = nn.Linear(a, b)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _cache_net():
    torch.manual_seed(21)
    net = nn.Sequential(*(_Block(a, b) for a, b in ((8, 16), (16, 16), (16, 16), (16, 2))))
    return net, torch.randn(4, 8)


def test_the_parameter_setup_is_kept_between_steps_and_plans():
    """The second step of a plan reuses the first one's setup (no module walk), also when
    plans alternate (as bench_hf switches them); the steps stay bitwise the plain model's."""
    net, x = _cache_net()
    stages = extract_stages(net)
    n = len(stages)
    plans = [base.recompute_all_plan(n), base.chen_plan(n)]
    cm = CheckpointedChain(stages, plans[0], strip_suffix=False)
    setups = {}
    for step in range(4):
        plan = plans[step % 2]
        cm.set_plan(plan)
        assert_same_step(net, cm, x)
        cache = cm._setup_caches[cm._prefix_plan]
        assert cache.setup is not None
        if step >= 2:  # the same setup object as two steps ago: nothing was collected
            assert cache.setup is setups[step % 2]
        setups[step % 2] = cache.setup
    assert len(cm._setup_caches) == 2


@pytest.mark.parametrize("change", ["replace", "freeze", "swap_module"])
def test_a_changed_parameter_is_seen_at_the_next_step(change):
    """A parameter replaced (``load_state_dict(assign=True)``) or frozen after a step, or a
    submodule swapped (then ``set_plan``, as for any new submodule), invalidates the kept
    setup, also when the plan is the same: the next step is the plain model's."""
    net, x = _cache_net()
    stages = extract_stages(net)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)), strip_suffix=False)
    assert_same_step(net, cm, x)
    before = cm._setup_caches[cm._prefix_plan].setup
    block = stages[1].module
    assert block is net[1]  # the stages are the model's blocks, shared
    lin = block.lin
    if change == "replace":
        lin.weight = nn.Parameter(lin.weight.detach() * 0.5)
    elif change == "freeze":
        lin.weight.requires_grad_(False)
    else:
        block.lin = swapped = nn.Linear(lin.in_features, lin.out_features)
        cm.set_plan(cm.plan)  # a new submodule is seen after set_plan (stage_modules)
    assert_same_step(net, cm, x)
    after = cm._setup_caches[cm._prefix_plan].setup
    assert after is not before
    params = after[0]
    if change == "replace":
        assert any(p is lin.weight for p in params)
    elif change == "freeze":
        assert not any(p is lin.weight for p in params)
    else:
        assert any(p is swapped.weight for p in params)


def test_parameter_gradients_reach_autograd_as_soon_as_they_are_final():
    """Each parameter's gradient reaches ``.grad`` (and its hooks, DDP's reducer) right
    after the last ``B`` op that adds to it, while the plan's backward goes on (a
    :class:`_Release` node per such op); a parameter shared by two stages, only after the
    earlier stage's ``B``. Gradients bitwise the unmodified module's."""
    from optmem.pytorch.execute import add_monitor, remove_monitor

    torch.manual_seed(13)
    shared = nn.Linear(8, 8)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), shared, nn.Tanh(), nn.Linear(8, 8),
                        nn.Tanh(), shared, nn.Linear(8, 2))
    stages = extract_stages(net)
    plan = base.recompute_all_plan(len(stages))
    x = torch.randn(4, 8)
    assert_same_step(net, CheckpointedChain(stages, plan), x)
    events: list[str] = []
    names = {id(p): n for n, p in net.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(
        lambda p: events.append(f"grad {names[id(p)]}")) for p in net.parameters()]
    monitor = lambda op, *_: events.append(op)  # noqa: E731
    add_monitor(monitor)
    try:
        net.zero_grad(set_to_none=True)
        CheckpointedChain(stages, plan)(x).square().sum().backward()
    finally:
        remove_monitor(monitor)
        for h in handles:
            h.remove()
    b_of = {f"B {i}": k for k, e in enumerate(events) if e.startswith("B ")
            for i in [int(e.split()[1])]}
    grad_at = {e.split()[1]: k for k, e in enumerate(events) if e.startswith("grad ")}
    n = len(stages)
    assert grad_at["7.weight"] < b_of[f"B {n - 1}"]  # the head's, before the next B
    assert grad_at["0.weight"] > b_of["B 1"]
    assert b_of["B 3"] < grad_at["2.weight"] < b_of["B 2"]  # shared: after its earlier B
    assert grad_at["4.weight"] < b_of["B 3"]


def test_a_parameter_three_stages_use_sums_as_plain_autograd_with_a_native_suffix():
    """A weight used by two re-run stages and by one in the native suffix (BART's embedding:
    encoder, decoder, tied head). Plain autograd sums ``(head + decoder) + encoder``; the
    executor summed the plan's two contributions first, ``head + (decoder + encoder)``,
    1.5e-8 apart on BART. Each ``B`` now hands its contribution to autograd, which sums
    them in the order they arrive: bitwise."""
    torch.manual_seed(17)
    shared = nn.Linear(8, 8)
    net = nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), shared, nn.Tanh(),
                        nn.Linear(8, 8), nn.Tanh(), shared, nn.Linear(8, 2))
    stages = extract_stages(net)
    n = len(stages)
    uses = [i for i, s in enumerate(stages, 1) if any(p is shared.weight
                                                      for p in s.module.parameters())]
    k = uses[1]  # the first two uses re-run, the last one is in the native suffix
    plan = (["F_ck 1"] + [f"F_none {i}" for i in range(2, k + 1)]
            + [f"F_all {i}" for i in range(k + 1, n + 1)] + ["Loss"]
            + [f"B {i}" for i in range(n, k, -1)]
            + [f"F_all {i}" for i in range(1, k + 1)] + [f"B {i}" for i in range(k, 0, -1)])
    assert uses[2] > k
    for seed in range(5):  # several draws, so that a different association shows
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
        assert_same_step(net, CheckpointedChain(stages, plan), x)


def test_fullgraph_error_on_an_executor_names_compile_stages():
    """``torch.compile(executor, fullgraph=True)``: the error names what works there.

    The reason named only ``cmodel.compile(fullgraph=True)`` (the wrappers' method): on an
    executor that is ``nn.Module.compile``, which fails with the same error (the stop-53
    hunt, on ``DeltaChain`` and ``CheckpointedChain``). It now names
    ``executor.compile_stages(fullgraph=True, ...)``, and that works.
    """
    import inspect

    if "reason" not in inspect.signature(torch.compiler.disable).parameters:
        pytest.skip("this torch's compiler.disable takes no reason (before 2.7)")
    torch._dynamo.reset()
    torch.manual_seed(16)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8)
    stages = extract_stages(module)
    ref = reference_step(module, x, loss_fn, seed=1)
    cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)))
    with pytest.raises(Exception, match=r"executor\.compile_stages\(fullgraph=True"):
        reference_step(torch.compile(cm, backend="eager", fullgraph=True), x, loss_fn,
                       seed=1, owner=module)
    cm.compile_stages(backend="eager", fullgraph=True)
    got = reference_step(cm, x, loss_fn, seed=1, owner=module)
    assert cm._compiled is not None and cm._compiled_with["fullgraph"] is True
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch._dynamo.reset()


def test_reruns_restore_the_cuda_rng_of_the_stages_devices(monkeypatch):
    """The CUDA RNG states a re-run restores were those of the devices of the chain *input*
    only: a chain placed over two GPUs (input on ``cuda:0``, later stages on ``cuda:1``)
    re-ran its dropout on ``cuda:1`` with fresh masks, so the gradients were those of other
    masks, in silence. The stages' parameters' devices count now (here stage 2 holds a
    parameter on a faked ``cuda:1``; the input is on the CPU)."""
    from pytorch_helpers import dropout_stages_with_cuda_rng_log

    stages, seen = dropout_stages_with_cuda_rng_log(monkeypatch)
    plan = ["F_ck 1", "F_ck 2", "F_all 3", "Loss", "B 3", "F_all 2", "B 2", "F_all 1", "B 1"]
    x = torch.randn(2, 4, requires_grad=True)
    CheckpointedChain(stages, plan)(x).sum().backward()
    assert seen == [("get", 1), ("get", 1), ("fork", [1]), ("set", 1), ("fork", [1]),
                    ("set", 1)]
