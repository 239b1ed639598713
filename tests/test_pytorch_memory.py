"""Real memory of training steps against the plan's prediction and the limit.

Two measures of a real step:

* :func:`~optmem.pytorch.memory.measure_training_peak`, exact: every storage created during
  the step (dispatch-level trace, temporaries included), weight gradients excluded, plus the
  input batch. The documented bound (``docs/pytorch.md``, "What memory_limit counts") is
  ``real <= predicted + plan_allowance <= limit + plan_allowance``, where the allowance is the
  gradient autograd holds at the plan's boundary, the loss scalars and buffer copies of
  re-run stages; the chain is profiled with the loss so that the limit covers it.
* :class:`~optmem.pytorch.memory.ActivationTracker`, hooks only (saved tensors and what the
  executor holds, no temporaries): at most the prediction plus the model output (the loss
  keeps it alive; the chain here is profiled without the loss).

On GPU, ``torch.cuda.max_memory_allocated`` is compared with the prediction plus the
documented CUDA allowance (test marked ``gpu``).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import tightest_result  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.problems.checkpoint import CheckpointProblem  # noqa: E402
from optmem.pytorch.execute import CheckpointedChain  # noqa: E402
from optmem.pytorch.extract import extract_stages  # noqa: E402
from optmem.pytorch.memory import (  # noqa: E402
    LOSS_SCALARS,
    ActivationTracker,
    cuda_training_peak,
    measure_training_peak,
    memtracker_peak,
    plan_allowance,
)
from optmem.pytorch.models import resolve_spec  # noqa: E402
from optmem.pytorch.profile import profile_stages  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402
from optmem.solvers import checkpoint_baselines as base  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402


def step(module, x):
    module(x).float().square().mean().backward()


@pytest.mark.parametrize("spec", ["toy-mlp", "toy-cnn", "toy-resnet", "toy-transformer"])
def test_measured_peak_within_prediction(spec):
    torch.manual_seed(0)
    module, x = resolve_spec(spec)
    stages = extract_stages(module)
    chain = profile_stages(stages, x, repeats=1, warmup=0)
    with ActivationTracker(module, pinned=[x]) as native:
        step(module, x)
    tight = tightest_result(chain)
    store = chain.store_all_peak()
    mid = solve(CheckpointProblem(chain, (tight.memory_limit * tight.unit + store) // 2), "dp")
    results = [tight, mid]
    measured = []
    for r in results:
        for strip in (True, False):
            cm = CheckpointedChain(stages, r.plan, strip_suffix=strip)
            with ActivationTracker(module, pinned=[x]) as tracker:
                step(cm, x)
            # the plan replayed on the byte chain (<= r.peak_memory * r.unit, the rounded peak)
            predicted = simulate_checkpoint(chain, r.plan).peak_memory
            assert predicted <= r.peak_memory * r.unit
            tolerance = chain.output_size[-1]
            assert tracker.samples > len(r.plan) // 2
            assert tracker.peak_bytes <= predicted + tolerance, (spec, r.plan, strip)
            measured.append(tracker.peak_bytes)
    # the tightest plan really saves memory compared with plain PyTorch
    assert measured[0] < native.peak_bytes
    assert native.peak_bytes <= store + chain.output_size[-1]


def test_tracker_sees_checkpoints_and_tapes():
    torch.manual_seed(1)
    module, x = resolve_spec("toy-mlp", batch=8)
    stages = extract_stages(module)
    seen = []

    def record(op, live, grads):
        seen.append(op)

    from optmem.pytorch.execute import add_monitor, remove_monitor

    add_monitor(record)
    try:
        cm = CheckpointedChain(stages, base.recompute_all_plan(len(stages)),
                               strip_suffix=False)
        step(cm, x)
    finally:
        remove_monitor(record)
    plan = [str(o) for o in base.recompute_all_plan(len(stages)) if str(o) != "Loss"]
    assert seen == plan


def loss_of(y):
    return y.float().square().mean()


@pytest.mark.parametrize("spec", ["toy-cnn", "toy-transformer", "toy-resnet"])
def test_real_peak_within_limit_plus_allowance(spec):
    """The CI check of issue 13: a real step never exceeds the limit plus the allowance."""
    torch.manual_seed(0)
    module, x = resolve_spec(spec)
    chain = op.profile_chain(module, x, repeats=1, warmup=0, loss_fn=loss_of)
    low, store = op.smallest_limit(chain), chain.store_all_peak()
    for limit in (low, (low + store) // 2):
        for strip in (True, False):
            cm = op.checkpoint(module, x, memory_limit=limit, chain=chain, strip_suffix=strip)
            allowance = plan_allowance(chain, cm.result.plan, list(cm.stages),
                                       strip_suffix=strip)
            predicted = cm.expected_peak_bytes
            assert predicted <= limit
            reals = []
            for joint in (False, True):
                cm.executor.joint_reruns = joint
                module.zero_grad(set_to_none=True)
                reals.append(measure_training_peak(lambda c=cm: loss_of(c(x)).backward(),
                                                   module, x))
                assert reals[-1] <= predicted + allowance <= limit + allowance, \
                    (spec, limit, strip, joint)
            # temporaries are counted on CPU now: the prediction is not a loose bound for
            # the re-runs the chain model describes; joint re-runs (the default) skip what
            # only fed a dead output, and never add to the peak
            assert reals[0] >= 0.8 * predicted, (spec, limit, strip, reals, predicted)
            assert reals[1] <= reals[0], (spec, limit, strip, reals)
    module.zero_grad(set_to_none=True)


def test_real_peak_tracks_the_plan_on_the_conv_net():
    """The conv net of issue 13: the real peak now falls with the limit as predicted.

    Before temporaries were counted on CPU, the issue measured a real saving of 39 % of the
    predicted one (56 -> 45.5 MiB real for 57 -> 30 MiB tracked); here it is 77 %: plain
    autograd also stays below the store-all prediction (a tape always counts its output).
    """
    torch.manual_seed(0)
    module, x = resolve_spec("toy-cnn", batch=16)
    chain = op.profile_chain(module, x, repeats=1, warmup=0, loss_fn=loss_of)
    module.zero_grad(set_to_none=True)
    plain = measure_training_peak(lambda: loss_of(module(x)).backward(), module, x)
    tight = op.checkpoint(module, x, memory_limit=op.smallest_limit(chain), chain=chain)
    module.zero_grad(set_to_none=True)
    real = measure_training_peak(lambda: loss_of(tight(x)).backward(), module, x)
    saved = plain - real
    predicted_saved = chain.store_all_peak() - tight.expected_peak_bytes
    assert plain <= chain.store_all_peak()
    assert saved >= 0.7 * predicted_saved > 0  # the saving is real, not only predicted
    module.zero_grad(set_to_none=True)


def test_measure_training_peak_leaves_out_weight_gradients():
    net = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    x = torch.randn(8, 64)
    f = 4
    real = measure_training_peak(lambda: net(x).sum().backward(), net, x)
    # x, h = x W1^T (saved for W2's gradient), then the output (forward) or the gradient of
    # h (backward), plus the loss and its seed gradient (4 B each); the two 16 KiB weight
    # gradients are left out
    assert real == 3 * (8 * 64 * f) + LOSS_SCALARS // 2
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad(set_to_none=True)
    mt = memtracker_peak(lambda: net(x).sum().backward(), net, x)
    assert mt.snapshot["Parameter"] == 2 * 64 * 64 * f
    assert mt.activations > 0


def test_measure_training_peak_counts_storages_resized_in_the_step():
    """FSDP2 gathers a unit's parameters into storages it keeps across steps and resizes
    itself (``UntypedStorage.resize_``, which no dispatch mode sees): full before the unit
    runs, 0 after. Before, such a step's peak left them out (stop 78 found
    it measuring offload plans under FSDP2)."""
    net = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64)
    gathered = torch.empty(1024).untyped_storage()  # made before the step, as FSDP2's
    gathered.resize_(0)

    def step(size: int) -> None:
        gathered.resize_(size)  # the all-gather's destination, for the forward
        y = net(x)
        gathered.resize_(0)  # resharded after the forward
        y.sum().backward()

    plain = measure_training_peak(lambda: step(0), net, x)
    net.zero_grad(set_to_none=True)
    # x and the output y beside the 4 KiB gathered in the forward (the loss scalars come
    # after it was freed); before, the forward counted x and y only
    assert plain == 2 * (8 * 64 * 4) + LOSS_SCALARS // 2
    assert measure_training_peak(lambda: step(4096), net, x) == 2 * (8 * 64 * 4) + 4096
    net.zero_grad(set_to_none=True)
    assert torch.UntypedStorage.resize_ is type(gathered).resize_  # restored
    assert gathered.nbytes() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
def test_cuda_max_memory_allocated_within_limit():
    """CUDA allowance (docs/pytorch.md): ``plan_allowance``, the temporary of the in-place
    accumulation into the pre-allocated weight gradients (at most one stage's weights) and
    the caching allocator's 512-byte rounding of every value alive (2L + 4 of them)."""
    torch.manual_seed(2)
    module, x = resolve_spec("toy-cnn", batch=64)
    module, x = module.cuda(), x.cuda()
    chain = op.profile_chain(module, x, repeats=2, warmup=1, loss_fn=loss_of)
    low, store = op.smallest_limit(chain), chain.store_all_peak()
    for limit in (low, (low + store) // 2):
        cm = op.checkpoint(module, x, memory_limit=limit, chain=chain)
        def step(c=cm):
            loss_of(c(x)).backward()

        step()  # one-time allocations (cuBLAS workspace) before measuring
        peak = cuda_training_peak(step, module, x)
        allowance = plan_allowance(chain, cm.result.plan, list(cm.stages)) \
            + max(chain.weight_size) + 512 * (2 * chain.length + 4)
        assert peak <= limit + allowance, (peak, limit, allowance)


class _LossAndLogits(nn.Module):
    """An HF-style head: the loss and the logits it received (a pass-through)."""

    def forward(self, x):
        return nn.functional.log_softmax(x, dim=1)[:, 0].mean().neg(), x


def test_real_peak_within_limit_with_a_pass_through_head():
    """The last stage's pass-through logits are counted once: the guarantee still holds."""
    torch.manual_seed(0)
    stages = [nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32),
              _LossAndLogits()]
    module = nn.Sequential(*stages)
    x = torch.randn(32, 16)

    def loss(out):
        return out[0]

    chain = op.profile_chain(list(stages), x, repeats=1, warmup=0, loss_fn=loss)
    assert chain.extra["profile"]["output_left_out"][-1] == 32 * 32 * 4
    low, store = op.smallest_limit(chain), chain.store_all_peak()
    for limit in (low, (low + store) // 2, store):
        for strip in (True, False):
            cm = op.checkpoint(list(stages), x, memory_limit=limit, chain=chain,
                               strip_suffix=strip)
            module.zero_grad(set_to_none=True)
            real = measure_training_peak(lambda c=cm: loss(c(x)).backward(), module, x)
            allowance = plan_allowance(chain, cm.result.plan, list(cm.stages),
                                       strip_suffix=strip)
            assert real <= cm.expected_peak_bytes + allowance <= limit + allowance, \
                (limit, strip, real)
    module.zero_grad(set_to_none=True)


class _NewGelu(nn.Module):
    """GPT-2's ``gelu_new``, written out: five activation-sized saved intermediates."""

    def forward(self, x):
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(8, 32), _NewGelu(), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(x)))


def test_backward_overhead_credits_the_tape_autograd_frees():
    """``bwd_overhead`` is the backward's peak of tape still alive plus new buffers, minus
    the tape and ``delta^{i-1}`` (the model charges both whole): autograd frees a saved
    tensor once its node ran, so a long stage (an MLP with gelu_new) costs far less than
    the new buffers' peak on top of the whole tape; and a real step stays within the bound.
    """
    from optmem.pytorch.memory import StorageTrace, storage_key

    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), _Mlp(), _Mlp(), nn.Linear(8, 4)]
    module = nn.Sequential(*stages)
    x = torch.randn(4, 8)
    chain = op.profile_chain(list(stages), x, repeats=1, warmup=0, loss_fn=loss_of)
    # what the new buffers alone peak at (the accounting before): tape not credited
    h = torch.randn(4, 8, requires_grad=True)
    out = stages[1](h)
    trace = StorageTrace({storage_key(p) for p in module.parameters()})
    with trace:
        out.backward(torch.ones_like(out))
    wgrads = [p.grad for p in stages[1].parameters()]
    new_only = trace.peak(exclude=wgrads) - chain.output_size[0]
    module.zero_grad(set_to_none=True)
    assert 0 < chain.bwd_overhead[1] < new_only
    assert chain.bwd_overhead[1] + chain.saved_size[1] >= new_only  # never below the new
    low, store = op.smallest_limit(chain), chain.store_all_peak()
    for limit in (low, (low + store) // 2, store):
        cm = op.checkpoint(list(stages), x, memory_limit=limit, chain=chain)
        module.zero_grad(set_to_none=True)
        real = measure_training_peak(lambda c=cm: loss_of(c(x)).backward(), module, x)
        allowance = plan_allowance(chain, cm.result.plan, list(cm.stages))
        assert real <= cm.expected_peak_bytes + allowance, (limit, real)
    module.zero_grad(set_to_none=True)


def test_allowance_counts_the_partial_gradient_of_a_tied_parameter():
    """A weight two stages use: the executor holds its first partial gradient itself."""
    from optmem.chain import Chain

    shared = nn.Linear(16, 16)  # 16 x 16 + 16 floats
    stages = [shared, nn.Tanh(), shared]
    chain = Chain.from_lists([1.0] * 3, [1.0] * 3, [64] * 3, [64] * 3, input_size=64)
    plan = ["F_all 1", "F_all 2", "F_all 3", "Loss", "B 3", "B 2", "B 1"]
    plain = plan_allowance(chain, plan, strip_suffix=False)
    assert plain == 64 + LOSS_SCALARS
    assert plan_allowance(chain, plan, stages, strip_suffix=False) == plain + (16 * 16 + 16) * 4
    assert plan_allowance(chain, plan, [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)],
                          strip_suffix=False) == plain


def _bn_stack_loss(y):
    return y.float().square().mean()


_BN_PERSISTENT = ["F_ck 1", "F_none 2", "F_none 3", "F_none 4", "F_none 5", "F_all 6", "Loss",
                  "B 6", "F_ck 1", "F_all 2", "F_all 3", "F_all 4", "F_all 5", "B 5", "B 4",
                  "B 3", "B 2", "F_all 1", "B 1"]


@pytest.mark.parametrize("how", ["plan", "dp", "dp:floating"])
def test_allowance_counts_the_scratch_buffers_of_consecutive_f_all_reruns(how, monkeypatch):
    """Batch norm saves its running statistics for its backward: an ``F_all`` re-run's
    scratch copies live until its ``B``, those of consecutive re-runs together.

    Four ``BatchNorm1d(256)`` (2 KiB of statistics each) on a batch of 2, re-run with ``F_all``
    in a row by a hand plan (``use_plan``) and by ``dp`` and ``dp:floating`` at a limit where
    their plans do: the real peak is within ``expected_peak_bytes + plan_allowance``, the
    gradients and running statistics are the plain model's, bit for bit. Before: the
    allowance counted one scratch copy at a time, and each step exceeded it (by 4060, 2012
    and 988 bytes).
    """
    import copy

    from optmem.pytorch import memory

    width = 256
    torch.manual_seed(0)
    base_net = nn.Sequential(nn.Linear(width, width), *[nn.BatchNorm1d(width) for _ in range(4)],
                             nn.Linear(width, 3))
    x = torch.randn(2, width)
    chain = op.profile_chain(copy.deepcopy(base_net), x, loss_fn=_bn_stack_loss, repeats=1,
                             warmup=0)
    net, plain = copy.deepcopy(base_net), copy.deepcopy(base_net)
    if how == "plan":
        cm = op.checkpoint(net, x, memory_limit=chain.store_all_peak(), chain=chain,
                           fast_path=False, strip_suffix=False, repeats=1, warmup=0)
        cm.use_plan(_BN_PERSISTENT)
    else:
        cm = op.checkpoint(net, x, memory_limit=16396, method=how, chain=chain,
                           strip_suffix=False, fast_path=False, repeats=1, warmup=0)
    plan = [str(o) for o in cm.result.plan]
    real = measure_training_peak(lambda: _bn_stack_loss(cm(x)).backward(), net, x)
    _bn_stack_loss(plain(x)).backward()
    for (name, p), q in zip(net.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(net.named_buffers(), plain.buffers(), strict=True):
        assert torch.equal(b, c), name
    stages = list(cm.stages)
    bound = cm.expected_peak_bytes + plan_allowance(chain, plan, stages, strip_suffix=False)
    assert real <= bound, (plan, real, bound)
    # before: one scratch copy at a time (the largest re-run stage's buffers) is exceeded
    monkeypatch.setattr(memory, "_scratch_peak", lambda ops, sizes: max(sizes.values()))
    old = cm.expected_peak_bytes + plan_allowance(chain, plan, stages, strip_suffix=False)
    assert bound - old >= 2 * width * 4  # at least one more pair of statistics held
    assert real > old, (plan, real, old)


def test_buffers_restored_writes_only_what_changed() -> None:
    from optmem.pytorch.memory import buffers_restored

    bn = nn.BatchNorm1d(3)
    bn.register_buffer("table", torch.arange(4))
    kept = bn.table
    before = {n: (b._version, b.clone()) for n, b in bn.named_buffers()}
    with buffers_restored([bn]):
        bn(torch.randn(5, 3))  # running statistics updated in place
        bn.table = torch.zeros(4, dtype=torch.long)  # a buffer replaced
        assert not torch.equal(bn.running_mean, before["running_mean"][1])
    assert bn.table is kept
    for n, b in bn.named_buffers():
        torch.testing.assert_close(b, before[n][1])
    # read only: no write, so the version counter (which autograd checks) does not move;
    # the restore writes none either (the counter moved by the body's own ``add_`` only)
    assert bn.table._version == before["table"][0]
    assert bn.running_mean._version == before["running_mean"][0]
    assert bn.num_batches_tracked._version == before["num_batches_tracked"][0] + 1
    versions = {n: b._version for n, b in bn.named_buffers()}
    bn.eval()  # reads its statistics, updates nothing
    with buffers_restored([bn]):
        bn(torch.randn(5, 3))
    assert {n: b._version for n, b in bn.named_buffers()} == versions


class _BigTable(nn.Module):
    """Builds a large table from shapes alone (as rotary ``cos``/``sin`` tables are): a side
    input, computed once per call before the chain, through a temporary as large."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))

    def forward(self, x):
        table = torch.arange(x.shape[0] * 2048, dtype=x.dtype).reshape(x.shape[0], 2048).sin()
        bias = table[:, :32]
        for layer in self.layers:
            x = torch.tanh(layer(x) * bias + x)
        return x


@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_the_allowance_counts_the_side_inputs_and_their_computation(fraction):
    """Side inputs are not in the limit (by design), but a step holds them, and computing
    them (``arange`` then ``sin``: two 128 KiB tables at once) peaks before the chain runs.
    Before stop 41 the allowance left both out: this step's real peak, 264192 B, exceeded
    limit + allowance by up to 106 KiB (HF Gemma 4 with 512-wide global heads by 70 KiB)."""
    torch.manual_seed(0)
    model = _BigTable()
    x = torch.randn(16, 32, requires_grad=True)
    cmodel = op.checkpoint(model, x, memory_limit=f"{fraction:.0%}", repeats=1, warmup=0,
                           fast_path=False)
    extra = cmodel.chain.extra
    assert extra["side_input_peak"] >= 2 * 128 * 1024 > extra["side_input_bytes"]
    limit = int(fraction * cmodel.chain.store_all_peak())
    allowance = plan_allowance(cmodel.chain, cmodel.result.plan, list(cmodel.stages))
    real = measure_training_peak(lambda: cmodel(x).sum().backward(), model, x)
    assert real <= limit + allowance, (real, limit, allowance)
    assert real > limit + allowance - extra["side_input_peak"]  # not met without them


def test_cuda_training_peak_reads_the_models_device(monkeypatch):
    """``cuda_training_peak`` synchronised and read the allocator statistics of the current
    device: for a model on ``cuda:1`` (current device 0) it returned only the inputs' bytes
    (12 here). It now reads the device of the model's (or the inputs') CUDA tensors."""
    from pytorch_helpers import FakeCuda, on_fake_cuda

    fake = FakeCuda(current=0).install(monkeypatch)
    net = nn.Linear(2, 2).requires_grad_(False)
    x = on_fake_cuda(torch.zeros(3))  # 12 bytes on "cuda:1"
    assert cuda_training_peak(lambda: None, net, x) == 500 + 12
    assert {d for _, d in fake.log} == {1}
