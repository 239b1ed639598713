"""Torch execution of offload plans: gradients equal the unmodified chain's (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch executor needs torch")

from torch import nn  # noqa: E402

from optmem.datasets.synthetic import uniform_chain  # noqa: E402
from optmem.errors import PlanError  # noqa: E402
from optmem.problems.offload import OffloadProblem  # noqa: E402
from optmem.pytorch.offload import OffloadedChain, offload_plan_actions  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402


def make_stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
            nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())]


def grads(stages: list[nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for s in stages for p in s.parameters()]


def reference(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    stages = make_stages(seed)
    x = x.clone().requires_grad_(True)
    y = x
    for s in stages:
        y = s(y)
    (y ** 2).sum().backward()
    return x.grad, grads(stages)


def solved_plan(memory: int) -> tuple[str, ...]:
    chain = uniform_chain(4, fwd_time=1.0, bwd_time=2.0, output_size=2, saved_size=4)
    result = solve(OffloadProblem(chain, memory, chain_bandwidth=2.0), "dp")
    assert result.status.has_plan
    return result.plan


@pytest.mark.parametrize("memory", [12, 16, 100])
def test_gradients_equal_unmodified(memory):
    plan = solved_plan(memory)
    x = torch.randn(5, 8)
    ref_x, ref_g = reference(x, seed=1)
    stages = make_stages(1)
    net = OffloadedChain(stages, plan)
    xi = x.clone().requires_grad_(True)
    out = net(xi)
    offloaded = {op.split(" ", 1)[1] for op in plan if op.startswith("offload")}
    resident = net.resident()
    for value in offloaded:  # the device copies are gone before the backward pass
        kind, k = value.split()
        assert resident.get((kind, int(k)), 0) == 0
    weights = {p.untyped_storage().data_ptr() for s in stages for p in s.parameters()}
    for group in net._groups.values():  # weights are never packed into a value
        assert not any(p.device_tensor is not None and
                       p.device_tensor.untyped_storage().data_ptr() in weights
                       for p in group.packed)
    (out ** 2).sum().backward()
    assert net.late_unpacks == 0
    assert torch.equal(xi.grad, ref_x)
    for a, b in zip(grads(stages), ref_g, strict=True):
        assert torch.equal(a, b)
    assert sum(op.startswith("prefetch") for op in net.transfers) == len(offloaded)


def test_missing_prefetch_is_copied_back_late():
    plan = ["F_all 1", "offload abar 1", "F_all 2", "F_all 3", "F_all 4", "Loss", "B 4",
            "B 3", "B 2", "B 1"]
    x = torch.randn(3, 8)
    ref_x, ref_g = reference(x, seed=2)
    stages = make_stages(2)
    net = OffloadedChain(stages, plan)
    xi = x.clone().requires_grad_(True)
    (net(xi) ** 2).sum().backward()
    assert net.late_unpacks > 0
    assert torch.equal(xi.grad, ref_x)


def test_actions_split_and_rejects_recomputation():
    after, before = offload_plan_actions(
        ["offload a 0", "F_all 1", "offload abar 1", "F_all 2", "Loss", "prefetch abar 1",
         "B 2", "prefetch a 0", "B 1"], 2)
    assert [str(o) for o in after[1]] == ["offload a 0"]
    assert [str(o) for o in after[2]] == ["offload abar 1"]
    assert [str(o) for o in before[2]] == ["prefetch abar 1"]
    assert [str(o) for o in before[1]] == ["prefetch a 0"]
    with pytest.raises(PlanError, match="store-all plans only"):
        offload_plan_actions(["F_ck 1", "F_all 2", "Loss", "B 2", "F_all 1", "B 1"], 2)


def test_offloaded_tensors_leave_the_device_once_and_are_freed_after_use():
    """Device memory of a step (host copies left out): offloading every tape saves it.

    A ``Tanh`` output is saved twice (by the ``Tanh`` and by the next stage's ``Linear``);
    before, each got its own host copy and its own device copy when prefetched, and the
    groups kept every prefetched copy until the next forward: the device peak was 1.7x the
    plain step's (655368 against 393224 bytes) and 448 KiB stayed alive after the step.
    """
    from pytorch_helpers import TANH_TRANSFER_PLAN as plan
    from pytorch_helpers import tanh_chain

    from optmem.pytorch.memory import measure_training_peak

    stages, plain, x = tanh_chain()  # one activation: 64 KiB
    before = measure_training_peak(lambda: plain(x).sum().backward(), plain, x)
    net = OffloadedChain(stages, plan)
    plain.zero_grad(set_to_none=True)
    out = measure_training_peak(lambda: net(x).sum().backward(), plain, x, host_copies=False)
    assert net.late_unpacks == 0
    assert out <= before - 64 * 1024
    assert sum(net.resident().values()) == 0  # nothing held after the step
    with_host = measure_training_peak(lambda: net(x).sum().backward(), plain, x)
    assert with_host > out  # the host copies are on the CPU too: counted by default


def test_a_tensor_updated_in_place_gets_a_new_host_copy():
    # one copy per storage, but not across an in-place update: saved tensor hooks bypass
    # autograd's version check, so a stale copy would silently give wrong gradients
    from optmem.pytorch.offload import HostCopies

    copies = HostCopies(None)
    t = torch.arange(4.0)
    first, _ = copies.to_host(t)
    again, _ = copies.to_host(t)
    assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    t.add_(1)
    updated, _ = copies.to_host(t)
    torch.testing.assert_close(updated, t)
    torch.testing.assert_close(first, torch.arange(4.0))


def test_two_forwards_before_one_backward():
    """Two calls whose losses are summed, then one backward (a contrastive pair): each call
    keeps its own saved tensors and transfers, and the gradients are the unmodified
    chain's. Before, the second forward replaced the first call's groups and the first
    call's prefetch failed ("prefetch of a value that is not on the host")."""
    plan = ["F_all 1", "offload a 0", "F_all 2", "offload abar 1", "F_all 3", "F_all 4",
            "Loss", "B 4", "B 3", "prefetch abar 1", "B 2", "prefetch a 0", "B 1"]
    x1, x2 = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    ref = make_stages(1)

    def run(f):
        return (f(x1) ** 2).sum() + 0.5 * (f(x2) ** 2).sum()

    run(lambda x: ref[3](ref[2](ref[1](ref[0](x))))).backward()
    want = [x1.grad.clone(), x2.grad.clone(), *grads(ref)]
    x1.grad = x2.grad = None
    stages = make_stages(1)
    net = OffloadedChain(stages, plan)
    run(net).backward()
    got = [x1.grad, x2.grad, *grads(stages)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert net.late_unpacks == 0


def test_double_backward_through_an_offload_plan_is_the_plain_models():
    """``create_graph=True`` through an offload plan (a gradient penalty): the plan only
    moves the tensors autograd saves, so the second-order gradients (input and every
    parameter) are bitwise the unmodified chain's. The backward graph's own saved tensors
    are autograd's (not moved, not in the limit). A checkpoint plan gives them too (stop 81:
    its double backward re-runs the stages as one graph; refused before)."""
    import optmem.pytorch as op

    plan = ["F_all 1", "offload a 0", "F_all 2", "offload abar 1", "F_all 3", "F_all 4",
            "Loss", "B 4", "B 3", "prefetch abar 1", "B 2", "prefetch a 0", "B 1"]
    x = torch.randn(5, 8, requires_grad=True)

    def penalty(f, params):
        (g,) = torch.autograd.grad((f(x) ** 2).sum(), x, create_graph=True)
        return torch.autograd.grad((g ** 2).sum(), [x, *params])

    ref = make_stages(2)
    want = penalty(lambda v: ref[3](ref[2](ref[1](ref[0](v)))),
                   [p for s in ref for p in s.parameters()])
    stages = make_stages(2)
    net = OffloadedChain(stages, plan)
    got = penalty(net, [p for s in stages for p in s.parameters()])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stages = make_stages(2)
    cnet = op.checkpoint(nn.Sequential(*stages), x, memory_limit="50%", repeats=1, warmup=0)
    got = penalty(cnet, [p for s in stages for p in s.parameters()])  # refused before stop 81
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
