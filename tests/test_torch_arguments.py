"""Stop 84: the one-liners' own arguments, each bad value one error naming it, model untouched.

``tools/fuzz_bridge_args.py`` called ``op.checkpoint``, ``op.offload``, ``op.remat_offload``
and ``op.profile_chain`` with nasty values, one argument at a time (``docs/pytorch.md``,
"Stop 84 (bridge arguments)"). Each case below stands for one class of the escapes it found.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import pytorch_helpers  # noqa: F401  (one thread)
import torch
from torch import nn

import optmem.pytorch as op
from optmem.errors import OptmemInputError

FAST = {"repeats": 1, "warmup": 0}


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)


def _state(model: nn.Module) -> tuple[object, ...]:
    """What a refused call must leave as it was."""
    mods = dict(model.named_modules())
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: (id(p), p.requires_grad, p.grad) for k, p in model.named_parameters()},
            {k: (m.training, tuple(m._forward_hooks), tuple(m._forward_pre_hooks),
                 tuple(m._backward_hooks), tuple(sorted(m.__dict__))) for k, m in mods.items()},
            torch.get_rng_state(), torch.is_grad_enabled())


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    (sa, pa, ma, ra, ga), (sb, pb, mb, rb, gb) = a, b
    return (sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)  # type: ignore[attr-defined]
            and pa == pb and ma == mb and torch.equal(ra, rb) and ga == gb)  # type: ignore[arg-type]


CALLS = {
    "checkpoint": lambda m, x, **kw: op.checkpoint(m, x, **{"memory_limit": "100%", **FAST,
                                                            **kw}),
    "offload": lambda m, x, **kw: op.offload(m, x, **{"memory_limit": "100%", **FAST, **kw}),
    "remat_offload": lambda m, x, **kw: op.remat_offload(m, x, **{"memory_limit": "100%",
                                                                  **FAST, **kw}),
    "profile_chain": lambda m, x, **kw: op.profile_chain(m, x, **{**FAST, **kw}),
}

# (entry, option, value): each was an escape (a raw TypeError/RuntimeError/AttributeError),
# a value taken as another one, or an option not checked on the store-all path
BAD = [
    # a raw TypeError or AttributeError from inside the profiler or the wrapper
    ("checkpoint", "repeats", "3"), ("offload", "warmup", 0.5),
    ("remat_offload", "max_stages", "2"), ("checkpoint", "op_overhead", "1"),
    ("checkpoint", "time_model", "a100"), ("offload", "chain", {"stages": []}),
    ("profile_chain", "loss_fn", 3), ("profile_chain", "op_overhead_ratio", [1]),
    # torch's RuntimeError/ValueError for the device
    ("checkpoint", "device", "gpu0"), ("profile_chain", "device", 2**70),
    # a value taken as another one
    ("checkpoint", "progress", "no"), ("checkpoint", "repeats", True),
    ("offload", "op_overhead", True), ("profile_chain", "warmup", False),
    ("checkpoint", "max_stages", math.nan),
    ("remat_offload", "restore_buffers", "no"), ("checkpoint", "strip_suffix", 1),
    # not checked where the store-all plan fits (no solve) or for an nn.Sequential
    ("checkpoint", "slots", -1), ("checkpoint", "time_limit_s", -1.0),
    ("checkpoint", "segment_cost", "x"),
    ("checkpoint", "extract", "abc"), ("profile_chain", "extract", None),
    ("offload", "variant", ""),
    # a charge past what a chain holds: named, not a chain time error
    ("checkpoint", "op_overhead", 1e300),
]


@pytest.mark.parametrize(("entry", "name", "value"), BAD,
                         ids=[f"{e}-{n}-{v!r}" for e, n, v in BAD])
def test_a_bad_option_is_one_error_naming_it(entry: str, name: str, value: object) -> None:
    model, x = _mlp()
    before = _state(model)
    kw = {name: value, **({"autotune": True} if name.startswith("autotune_") else {})}
    with pytest.raises(OptmemInputError) as info:
        CALLS[entry](model, x, **kw)
    assert info.value.field == name, str(info.value)
    assert _same(before, _state(model))


@pytest.mark.parametrize(("name", "value"), [("repeats", np.int64(2)), ("progress", False),
                                             ("op_overhead", np.float32(0.5)),
                                             ("preserve_rng_state", np.bool_(False)),
                                             ("device", "cpu"), ("max_stages", 2)])
def test_good_values_of_every_kind_still_work(name: str, value: object) -> None:
    model, x = _mlp()
    cmodel = CALLS["checkpoint"](model, x, **{name: value})
    assert torch.equal(cmodel(x), model(x))


@pytest.mark.parametrize("module", [[nn.Linear(8, 8), 3], 3, None,
                                    nn.ModuleList([nn.Linear(8, 8)])])
def test_a_module_of_the_wrong_kind_is_one_error(module: object) -> None:
    for entry in ("checkpoint", "profile_chain"):
        with pytest.raises(OptmemInputError) as info:
            CALLS[entry](module, torch.randn(4, 8))
        assert info.value.field == "module", str(info.value)


@pytest.mark.parametrize("plan", [None, 3, "F1"])
def test_a_plan_that_is_no_list_of_ops_is_one_error(plan: object) -> None:
    model, x = _mlp()
    cmodel = CALLS["checkpoint"](model, x)
    for call in (cmodel.use_plan, cmodel.set_plan):
        with pytest.raises(OptmemInputError) as info:
            call(plan)
        assert info.value.field == "plan", str(info.value)


def test_a_refused_resolve_leaves_the_planner_as_it_was() -> None:
    """A limit without a plan was kept: the next new batch size failed on it."""
    model, x = _mlp()
    cmodel = CALLS["checkpoint"](model, x, memory_limit="2MiB")
    with pytest.raises(OptmemInputError):
        cmodel.resolve("1B")
    with pytest.raises(OptmemInputError):
        cmodel.resolve(slots=-1)
    x2 = torch.randn(6, 8)
    assert torch.equal(cmodel(x2), model(x2))  # solved at its own limit, 2 MiB


def test_a_time_model_returning_no_pair_is_one_error() -> None:
    model, x = _mlp()
    with pytest.raises(OptmemInputError) as info:
        CALLS["profile_chain"](model, x, time_model=lambda *a: 1.0)
    assert info.value.field == "time_model"


def test_profile_chain_takes_none_for_the_default_charges() -> None:
    model, x = _mlp()
    chain = CALLS["profile_chain"](model, x, op_overhead=None, op_overhead_ratio=None)
    assert chain.length == 3
