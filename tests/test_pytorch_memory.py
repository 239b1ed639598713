"""Live activation bytes of a real training step stay within the plan's simulated peak.

The :class:`~optmem.pytorch.memory.ActivationTracker` counts distinct storages of every
tensor autograd saves (saved-tensor hooks) plus everything the executor holds (checkpoints,
tapes, the current gradient), reported after every plan op, plus the input batch. The chain
model is conservative (a tape counts its output even when autograd does not save it, and
sizes are rounded up to the discretisation unit), so the measured peak must not exceed the
prediction: the plan replayed by the simulator on the profiled chain in bytes (which is at
most ``result.peak_memory * result.unit``, the peak after rounding up to units).

Stated tolerance: the loss is outside the chain (``loss.bwd_time = 0``, sizes 0, as in
rotor), but the loss's own graph keeps the chain output ``a^L`` alive until its backward,
which the model frees at ``Loss``; so the bound is ``predicted + output_size[L]``.
On GPU, ``torch.cuda.max_memory_allocated`` is compared with the prediction plus the weights,
their gradients and a fixed allowance (test marked ``gpu``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import tightest_result  # noqa: E402

from optmem.problems.checkpoint import CheckpointProblem  # noqa: E402
from optmem.pytorch.execute import CheckpointedChain  # noqa: E402
from optmem.pytorch.extract import extract_stages  # noqa: E402
from optmem.pytorch.memory import ActivationTracker  # noqa: E402
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
def test_cuda_max_memory_allocated_matches_prediction():
    torch.manual_seed(2)
    module, x = resolve_spec("toy-cnn", batch=64)
    module, x = module.cuda(), x.cuda()
    stages = extract_stages(module)
    chain = profile_stages(stages, x, repeats=2, warmup=1)
    for p in module.parameters():  # gradient buffers allocated once, as rotor does
        p.grad = torch.zeros_like(p)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    for r in (tightest_result(chain), solve(CheckpointProblem(chain, chain.store_all_peak()),
                                            "dp")):
        cm = CheckpointedChain(stages, r.plan)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        step(cm, x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base_mem + x.numel() * x.element_size()
        predicted = r.peak_memory * r.unit
        # allocator rounding (512 B blocks), the loss and cuDNN workspaces: 10% + 2 MiB
        assert peak <= predicted * 1.1 + weights + 2 * 2**20, (peak, predicted)
