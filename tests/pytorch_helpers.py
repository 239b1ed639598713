"""Shared helpers of the torch bridge tests (models, reference runs, tightest limits)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from optmem.chain import Chain
from optmem.problems.checkpoint import CheckpointProblem
from optmem.result import Result
from optmem.solvers.facade import solve

# Tiny kernels: one thread is much faster than oversubscribed threads on a shared machine.
torch.set_num_threads(1)


def reference_step(module: torch.nn.Module, x: Any, loss_fn, seed: int = 0,
                   owner: torch.nn.Module | None = None):
    """Loss, output, parameter gradients (in ``owner``'s order) and input gradient of a step."""
    owner = owner if owner is not None else module
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(x)
    loss = loss_fn(out)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None
             for p in owner.parameters()]
    xg = None
    if isinstance(x, torch.Tensor) and x.grad is not None:
        xg = x.grad.detach().clone()
        x.grad = None
    owner.zero_grad(set_to_none=True)
    return loss.detach(), out.detach(), grads, xg


def loss_grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``model``'s parameters for ``loss``, in order (``.grad`` cleared)."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def tightest_result(chain: Chain, method: str = "dp", slots: int = 500) -> Result:
    """The plan at (about) the smallest limit the method accepts, after discretisation.

    Starts from the method's ``min_feasible_memory`` when it reports one, otherwise bisects
    between the input size and the store-all peak.
    """
    from optmem.result import SolveOptions

    opts = SolveOptions(slots=slots)

    def attempt(limit: int) -> Result:
        return solve(CheckpointProblem(chain, limit), method, options=opts)

    first = attempt(1)
    if first.min_feasible_memory is not None:
        low = first.min_feasible_memory
        for k in range(50):
            r = attempt(low + k * max(1, low // slots))
            if r.status.has_plan:
                return r
        raise AssertionError("no feasible limit found")
    lo, hi = chain.input_size, chain.store_all_peak()
    # rounding every live value up to the unit can push store-all just above the limit
    hi += max(1, hi // slots) * (2 * chain.length + 4)
    best = attempt(hi)
    assert best.status.has_plan
    while hi - lo > max(1, hi // 200):
        mid = (lo + hi) // 2
        r = attempt(mid)
        if r.status.has_plan:
            hi, best = mid, r
        else:
            lo = mid
    return best


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


TANH_TRANSFER_PLAN = ["F_all 1", "F_all 2", "offload abar 1", "F_all 3", "offload abar 2",
                      "F_all 4", "offload abar 3", "Loss", "prefetch abar 3", "B 4",
                      "prefetch abar 2", "B 3", "prefetch abar 1", "B 2", "B 1"]
"""A store-all plan that moves out every tape but the last and brings each back in time."""


def tanh_chain() -> tuple[list[torch.nn.Module], torch.nn.Sequential, torch.Tensor]:
    """Four ``Linear(256, 256) + Tanh`` stages, their ``nn.Sequential`` and a batch of 64.

    One activation is 64 KiB; each ``Tanh`` output is saved twice (by the ``Tanh`` and by
    the next stage's ``Linear``), the case of a tensor moved out by two holders.
    """
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
              for _ in range(4)]
    return stages, torch.nn.Sequential(*stages), torch.randn(64, 256)


# ------------------------------------------------------------------ a fake torch.cuda
class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:1`` (``is_cuda``, ``device``): for checking,
    without a GPU, which device the CUDA paths pick."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)


def on_fake_cuda(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a :class:`FakeCudaTensor` (same storage)."""
    return torch.Tensor._make_subclass(FakeCudaTensor, t)


def dropout_stages_with_cuda_rng_log(monkeypatch: Any) -> tuple[list[Any], list[tuple]]:
    """Three ``Linear + Dropout(0.5)`` stages, stage 2 holding a parameter on a faked
    ``cuda:1``, and the log of the CUDA generator calls (``torch.cuda.get_rng_state`` /
    ``set_rng_state`` as ``("get" | "set", device)``, ``fork_rng`` as ``("fork", devices)``;
    the fork keeps the CPU state only: no GPU here)."""
    from torch import nn

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)) for _ in range(3)]
    stages[1][0]._parameters["extra"] = on_fake_cuda(torch.zeros(1)).requires_grad_()
    seen: list[tuple] = []
    real = torch.random.fork_rng

    def fork_rng(devices: Any = None, enabled: bool = True, **kwargs: Any) -> Any:
        seen.append(("fork", list(devices)))
        return real(devices=[], enabled=enabled)

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda d=None: seen.append(("get", d)) or torch.zeros(1, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d=None: seen.append(("set", d)))
    return stages, seen


class FakeCuda:
    """``torch.cuda``'s stream, event, synchronisation and allocator statistics, faked.

    ``install(monkeypatch)`` replaces them; every call that targets a device is logged as
    ``(what, device index)``, with ``None`` resolved to the current device (``current``,
    0 unless set), as PyTorch resolves it. ``stats[d] = (allocated, peak)``.
    """

    def __init__(self, current: int = 0) -> None:
        self.current = current
        self.log: list[tuple[str, int]] = []
        self.stats = {0: (0, 0), 1: (100, 600), 3: (0, 0)}

    def index(self, device: Any) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return d.index if d.index is not None else self.current

    def install(self, monkeypatch: Any) -> FakeCuda:
        fake = self

        class Stream:
            def __init__(self, device: Any = None) -> None:
                self.device = torch.device("cuda", fake.index(device))

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                pass

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", (stream or Stream()).device.index))

            def elapsed_time(self, other: Any) -> float:
                return 1.0

        def logged(what: str, value: Any = None) -> Any:
            def call(device: Any = None) -> Any:
                fake.log.append((what, fake.index(device)))
                return value(fake.index(device)) if value is not None else None
            return call

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
        monkeypatch.setattr(torch.cuda, "synchronize", logged("sync"))
        monkeypatch.setattr(torch.cuda, "set_device", logged("set_device"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", logged("reset"))
        monkeypatch.setattr(torch.cuda, "memory_allocated",
                            logged("allocated", lambda d: fake.stats[d][0]))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                            logged("peak", lambda d: fake.stats[d][1]))
        return self


HUNT_FIXED: dict[str, Any] = {"memory_limit": "60%", "fast_path": False, "repeats": 1,
                              "warmup": 0, "time_model": lambda *_: (1.0, 2.0)}
"""The hunts' wrapping options: stages re-run at 60 %, fixed stage times (no timing)."""


def hunt_kinds() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """The three one-liners and their options in the hunts (a slow link: values move)."""
    import optmem.pytorch as op

    return {"checkpoint": (op.checkpoint, {}), "offload": (op.offload, {"bandwidth": "1MB/s"}),
            "remat_offload": (op.remat_offload, {"bandwidth": "1MB/s"})}


class EmaTarget(torch.nn.Module):
    """BYOL's shape: an online encoder and a target encoder updated in ``forward`` by EMA."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.online = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.target = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.target.requires_grad_(False)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        p = self.online(x1)
        with torch.no_grad():
            for t, o in zip(self.target.parameters(), self.online.parameters(), strict=True):
                t.mul_(0.9).add_(o, alpha=0.1)
            z = self.target(x2)
        cos = torch.nn.functional.cosine_similarity(p, z, dim=-1)
        return 2 - 2 * cos.mean()


def assert_trained_alike(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """A worker's recorded ``losses`` and per-step ``grads`` dicts equal bitwise."""
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], expected["losses"],
                                                 strict=True))
    for a, b in zip(got["grads"], expected["grads"], strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in b)


class Mlp(torch.nn.Module):
    """Six tanh layers and a head: an nn.Module, so it is exported (not stages of its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(6)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).square().mean()


def assert_bitwise(got: Any, ref: Any) -> None:
    """Equal bit for bit (NaNs where the reference has them), any nesting of tensors."""
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def square_step(call: Any, owner: torch.nn.Module, x: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One step of ``call(x)`` with the loss ``out.square().mean()``: output and gradients."""
    out = call(x)
    out.square().mean().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return out.detach(), grads


def float_outputs_step(call: Any, owner: torch.nn.Module, kwargs: dict[str, Any]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """One step of an HF model without labels: the loss sums its float outputs' mean squares.

    Seeded (5) before the call; returns the float outputs and the parameters' gradients.
    """
    torch.manual_seed(5)
    out = call(**kwargs)
    outs = [v for v in out.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    sum(t.square().mean() for t in outs if t.requires_grad).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return [t.detach() for t in outs], grads


def tiny_detr_like(config_class: Any, model_class: Any) -> torch.nn.Module:
    """A DETR-shaped HF detector (DETR, Table Transformer) on a tiny HF ResNet, training mode."""
    import transformers

    torch.manual_seed(0)
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        out_features=["stage1", "stage2"])
    config = config_class(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_queries=5,
        num_labels=3)
    return model_class(config).train()
