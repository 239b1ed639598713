"""Torch execution of remat + offload plans: gradients equal the unmodified chain's (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch executor needs torch")

from torch import nn  # noqa: E402

from optmem.datasets.synthetic import uniform_chain  # noqa: E402
from optmem.problems.remat_offload import RematOffloadProblem  # noqa: E402
from optmem.pytorch.remat_offload import RematOffloadChain, split_mixed_plan  # noqa: E402
from optmem.result import SolveOptions  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402


def make_stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(8, 8), nn.Sigmoid()), nn.Linear(8, 8),
            nn.Sequential(nn.Linear(8, 8), nn.GELU())]


def reference(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    stages = make_stages(seed)
    x = x.clone().requires_grad_(True)
    y = x
    torch.manual_seed(123)
    for s in stages:
        y = s(y)
    (y ** 2).sum().backward()
    return x.grad, [p.grad.clone() for s in stages for p in s.parameters()]


def combined_plan(memory: int, beta: float, method: str = "dp") -> tuple[str, ...]:
    chain = uniform_chain(6, fwd_time=1.0, bwd_time=2.0, output_size=2, saved_size=4)
    result = solve(RematOffloadProblem(chain, memory, chain_bandwidth=beta), method,
                   options=SolveOptions(slots=64))
    assert result.status.has_plan, result.report
    return result.plan


@pytest.mark.parametrize(("memory", "beta", "method"), [
    (12, 1.0, "dp"), (10, 0.5, "dp"), (14, 2.0, "dp"), (12, 1.0, "autocapper"),
    (16, 1.0, "delta"), (14, 2.0, "opportunist")])
def test_gradients_equal_unmodified(memory: int, beta: float, method: str) -> None:
    plan = combined_plan(memory, beta, method)
    ops, transfers = split_mixed_plan(plan)
    x = torch.randn(5, 8)
    ref_x, ref_p = reference(x, 0)
    stages = make_stages(0)
    net = RematOffloadChain(stages, plan)
    xx = x.clone().requires_grad_(True)
    torch.manual_seed(123)
    (net(xx) ** 2).sum().backward()
    assert torch.allclose(xx.grad, ref_x, rtol=0, atol=1e-6)
    for g, r in zip([p.grad for s in stages for p in s.parameters()], ref_p, strict=True):
        assert torch.allclose(g, r, rtol=0, atol=1e-6)
    assert len(net.issued) == sum(len(v) for v in transfers.values())
    assert net.late_reads == 0
    offloads = sum(1 for v in transfers.values() for t in v if t.kind.value == "offload")
    assert net.moved_out == offloads


def test_plan_mixes_recompute_and_transfers() -> None:
    plan = combined_plan(10, 0.5)
    ops, transfers = split_mixed_plan(plan)
    assert transfers, plan
    assert len([o for o in ops if o.kind.value.startswith("F")]) > 6, plan


def _delta_stages(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()),
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(16, 16), nn.Sigmoid()), nn.Linear(16, 16),
            nn.Sequential(nn.Linear(16, 8), nn.GELU())]


@pytest.mark.parametrize("fast_link", [False, True])
def test_delta_policy_gradients(fast_link: bool) -> None:
    from optmem.pytorch.delta import EVICT, OFFLOAD, DeltaChain

    x = torch.randn(5, 8)

    def run(policy: bool) -> tuple[list[torch.Tensor], DeltaChain | None, list]:
        stages = _delta_stages(1)
        xx = x.clone().requires_grad_(True)
        torch.manual_seed(7)
        net: DeltaChain | None = None
        if policy:
            # c_s = bytes / bandwidth; fwd times alternate so both actions appear
            net = DeltaChain(stages, budget=1200, bandwidth=1e12 if fast_link else 1e3,
                             fwd_time=[1e-3, 1e-9, 1e-3, 1e-9, 1e-3, 1e-9])
            y = net(xx)
        else:
            y = xx
            for s in stages:
                y = s(y)
        (y ** 2).sum().backward()
        buffers = [b.clone() for s in stages for b in s.buffers()]
        return [xx.grad, *(p.grad for s in stages for p in s.parameters())], net, buffers

    ref, _, ref_buf = run(False)
    got, net, buf = run(True)
    assert net is not None and net.decisions
    kinds = {k for _, k in net.decisions}
    assert (OFFLOAD in kinds) if fast_link else (EVICT in kinds)
    if EVICT in kinds:
        assert net.recomputed
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, rtol=0, atol=1e-6)
    for b, r in zip(buf, ref_buf, strict=True):  # BatchNorm statistics updated once
        assert torch.equal(b, r)


class _OwnNoise(nn.Module):
    """``tanh(W x * u)``, ``u`` drawn from a generator the module holds (noise injection)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * torch.rand(x.shape, generator=self.gen))


def _delta_and_plain_grads(make, autocast: bool = False, device: str = "cpu"):
    """Gradients of the input and the parameters: plain chain, then DELTA evicting all."""
    from optmem.pytorch.delta import EVICT, DeltaChain

    out = []
    for policy in (False, True):
        torch.manual_seed(0)
        stages = [m.to(device) for m in make()]
        x = torch.randn(3, 8, device=device, requires_grad=True)
        net = DeltaChain(stages, budget=100, bandwidth=0.0) if policy else nn.Sequential(*stages)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = net(x)
        y.float().square().sum().backward()
        out.append([x.grad, *(p.grad for s in stages for p in s.parameters())])
        if policy:
            assert {k for _, k in net.decisions} == {EVICT} and net.recomputed
    return out


@pytest.mark.parametrize("case", ["own generator", "autocast"])
def test_delta_recomputation_replays_generators_and_autocast(case: str) -> None:
    """DELTA's recomputation restored the CPU RNG state only and ran without the forward's
    autocast (the checkpoint executor's re-runs restore the stages' own generators and the
    CUDA generators, and re-enter autocast): a stage drawing from a generator it holds was
    recomputed with other numbers (gradients 0.065 off the plain chain's), and a forward
    under ``torch.autocast`` failed in the backward ("mat1 and mat2 must have the same
    dtype"). Both now equal the plain chain's, bitwise."""
    if case == "own generator":
        plain, got = _delta_and_plain_grads(lambda: [_OwnNoise() for _ in range(4)])
    else:
        plain, got = _delta_and_plain_grads(
            lambda: [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)], autocast=True)
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)


def test_delta_recomputation_restores_the_cuda_rng_of_the_stages_devices(monkeypatch):
    """The CUDA generators a recomputation restores: those of the devices of the input and
    the parameters (here a parameter on a faked ``cuda:1``); before, none (dropout on a GPU
    was recomputed with fresh masks)."""
    from pytorch_helpers import dropout_stages_with_cuda_rng_log

    from optmem.pytorch.delta import DeltaChain

    stages, seen = dropout_stages_with_cuda_rng_log(monkeypatch)
    net = DeltaChain(stages, budget=10, bandwidth=0.0)
    net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert net.recomputed == [0]
    assert seen == [("get", 1)] * 3 + [("fork", [1]), ("set", 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
def test_delta_recomputes_cuda_dropout_with_its_masks() -> None:
    """On a GPU: dropout recomputed by DELTA draws the masks of the first run."""
    plain, got = _delta_and_plain_grads(
        lambda: [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(4)],
        device="cuda")
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)


def test_device_memory_of_a_transfer_plan_is_the_offload_executors() -> None:
    """The same store-all transfer plan: the remat+offload executor holds on the device
    what the offload executor holds (but the loss scalars). Before, a stage input that the
    next stage saved stayed on the device when its value was moved out, the groups kept
    every tensor until the backward ended, the slots kept every output, and a tensor moved
    out by the slot and by a group was copied twice: 917516 bytes against 327688; with one
    host copy per tensor remembered only while the source tensor object lived (not its
    storage), 393228."""
    from pytorch_helpers import TANH_TRANSFER_PLAN as plan
    from pytorch_helpers import tanh_chain

    from optmem.pytorch.memory import LOSS_SCALARS, measure_training_peak
    from optmem.pytorch.offload import OffloadedChain

    stages, owner, x = tanh_chain()  # one activation: 64 KiB
    peaks = []
    for cls in (OffloadedChain, RematOffloadChain):
        net = cls(stages, plan)
        owner.zero_grad(set_to_none=True)
        peaks.append(measure_training_peak(lambda net=net: net(x).sum().backward(), owner, x,
                                           host_copies=False))
    assert peaks[1] <= peaks[0] + LOSS_SCALARS


@pytest.mark.parametrize("fast_link", [False, True])
def test_delta_policy_in_a_compiled_training_step_runs_outside_dynamo(fast_link, monkeypatch):
    """``backward()`` inside a ``torch.compile``-d step: DELTA's Python is never traced.

    Before (the stop-53 hunt), ``DeltaChain.forward`` had no graph break: dynamo traced the
    policy (``_forward``, ``_release``, the pack hooks: 9 graph breaks on 5 stages, the
    stages inlined into the caller's graphs), and under inductor with dropout the outputs and
    gradients were not the plain model's compiled (gradients 2.2 apart). Now the policy runs
    under ``torch.compiler.disable`` as the other executors (its unpack hook too, which
    autograd calls with the caller's frame callback), the stages run compiled with the
    enclosing backend, gradients bitwise over two steps.
    """
    import copy

    from optmem.pytorch.delta import EVICT, OFFLOAD, DeltaChain

    traced: list[str] = []
    for name in ("_release", "_unpack", "_recompute"):
        original = getattr(DeltaChain, name)

        def record(self, *args, _original=original, _name=name):
            if torch.compiler.is_compiling():
                traced.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(DeltaChain, name, record)
    torch._dynamo.reset()
    stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3)) for _ in range(5)]
    plain = nn.Sequential(*copy.deepcopy(stages))
    net = DeltaChain(stages, budget=200, bandwidth=1e12 if fast_link else 1.0)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    def train_step(module, x):
        out = module(x)
        out.square().sum().backward()
        return out

    compiled = torch.compile(train_step, backend="aot_eager")
    for seed in (3, 4):
        torch.manual_seed(seed)
        got = compiled(net, x)
        torch.manual_seed(seed)
        ref = train_step(plain, x)
        assert torch.equal(got, ref)
    assert {k for _, k in net.decisions} == {OFFLOAD if fast_link else EVICT}
    assert net.recomputed or net.reloaded
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert net._compiled is not None  # the stages ran compiled
    assert traced == []
    torch._dynamo.reset()
