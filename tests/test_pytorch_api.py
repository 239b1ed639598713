"""User API ``optmem.pytorch.checkpoint`` and the ``optmem profile`` command."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

from pytorch_helpers import reference_step  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.models import register_model, resolve_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def loss_fn(out):
    return out.square().mean()


def test_checkpoint_end_to_end():
    torch.manual_seed(0)
    module, x = resolve_spec("toy-cnn", batch=4)
    store = op.profile_chain(module, x, repeats=1, warmup=0).store_all_peak()
    limit = int(store * 0.65)
    cnet = op.checkpoint(module, x, memory_limit=limit, repeats=1, warmup=0)
    r = cnet.result
    # optimal for its model: the chain's, or the chain plus the measured segment cost
    assert (r.report.get("model_status") or r.status) == "optimal" and r.method == "dp"
    assert cnet.expected_peak_bytes <= limit
    assert cnet.expected_makespan >= cnet.chain.total_compute_time()
    assert any(o.startswith(("F_ck", "F_none")) for o in r.plan)
    ref = reference_step(module, x, loss_fn, seed=1)
    got = reference_step(cnet, x, loss_fn, seed=1, owner=module)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "expected activation peak" in cnet.summary()
    # re-solve: more memory, never slower; a baseline method
    r2 = cnet.resolve(memory_limit=store)
    assert r2.objective <= r.objective + 1e-9 and cnet.plan == tuple(
        __import__("optmem.plan", fromlist=["parse_plan"]).parse_plan(r2.plan))
    r3 = cnet.resolve(method="recompute_all")
    assert r3.method == "recompute_all"
    got = reference_step(cnet, x, loss_fn, seed=1, owner=module)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)


def test_checkpoint_infeasible_and_bad_inputs():
    module, x = resolve_spec("toy-mlp", batch=4)
    chain = op.profile_chain(module, x, repeats=1, warmup=0)
    with pytest.raises(OptmemInputError, match="smallest feasible limit"):
        op.checkpoint(module, x, memory_limit="1KiB", chain=chain)
    with pytest.raises(OptmemInputError, match="size like"):
        op.checkpoint(module, x, memory_limit="lots", chain=chain)
    with pytest.raises(OptmemInputError, match="stages"):
        op.checkpoint(module, x, memory_limit="1GiB", chain=chain, max_stages=3)
    cnet = op.checkpoint(module, x, memory_limit="min", chain=chain)
    assert cnet.expected_peak_bytes <= op.smallest_limit(chain)
    with pytest.raises(OptmemInputError, match="smallest feasible"):
        op.solve_chain(chain, int(op.smallest_limit(chain) * 0.97))
    cnet = op.checkpoint(module, x, memory_limit="1GiB", chain=chain)  # no profiling
    assert cnet.result.plan[-1] == "B 1"
    assert cnet.use_plan(["F_ck 1", *[f"F_all {i}" for i in range(2, chain.length + 1)],
                          "Loss", *[f"B {i}" for i in range(chain.length, 1, -1)],
                          "F_all 1", "B 1"]).objective > chain.total_compute_time()


def test_memory_limit_as_a_percentage_of_store_all():
    module, x = resolve_spec("toy-mlp", batch=4)
    chain = op.profile_chain(module, x, repeats=1, warmup=0)
    store = chain.store_all_peak()
    by_bytes = op.checkpoint(module, x, memory_limit=int(store * 0.7), chain=chain)
    cnet = op.checkpoint(module, x, memory_limit="70%", chain=chain)
    assert cnet.result.plan == by_bytes.result.plan
    assert cnet.expected_peak_bytes <= int(store * 0.7)
    assert cnet._main.limit == by_bytes._main.limit == store * 7 // 10
    cnet.resolve(memory_limit="100%")  # store-all fits: no re-run at all
    assert cnet._main.limit == store and cnet.result.objective == chain.total_compute_time()
    with pytest.raises(OptmemInputError, match="percentage of the store-all peak"):
        op.checkpoint(module, x, memory_limit="0%", chain=chain)
    with pytest.raises(OptmemInputError, match="smallest feasible limit"):
        op.checkpoint(module, x, memory_limit="1%", chain=chain)


def _argparser():
    from optmem.pytorch import cli

    ap = argparse.ArgumentParser(prog="optmem")
    cli.register_cli(ap.add_subparsers(dest="command"))
    return ap


FACTORY_MODULE = """
import torch
from torch import nn


def make_module_only():
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x, scale=1.0):
        for lin in self.lins:
            x = torch.tanh(lin(x)) * scale + x
        return x.sum()


def make_graph_model(batch=2):
    return Residual(), {"x": torch.randn(batch, 6), "scale": 0.5}


def make_broken():
    raise RuntimeError("boom in the factory")


def make_mismatched(batch=2):
    return nn.Sequential(nn.Linear(4, 4)), torch.randn(batch, 5)
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "optmem_test_factories.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "optmem_test_factories:make_module_only"


def test_cli_profile_writes_a_chain(tmp_path, capsys, factory_module):
    out = tmp_path / "chain.json"
    args = _argparser().parse_args(["profile", "toy-resnet", "-o", str(out), "--batch", "2",
                                    "--repeats", "1", "--warmup", "0", "--no-progress"])
    assert args.func(args) == 0
    chain = Chain.load(out)
    assert chain.length == 10 and chain.name == "toy-resnet"
    assert chain.input_size == 2 * 3 * 16 * 16 * 4
    args = _argparser().parse_args(["profile", "toy-resnet", "-o", str(out), "--batch", "2",
                                    "--device", "meta", "--max-stages", "4"])
    assert args.func(args) == 0
    assert Chain.load(out).length == 4
    args = _argparser().parse_args(["profile", factory_module, "--input-shape", "6", "--batch", "3",
                                    "--repeats", "1"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["input_size"] == 3 * 6 * 4 and len(printed["stages"]) == 3
    args = _argparser().parse_args(["profile", "--list"])
    assert args.func(args) == 0
    assert "toy-transformer" in capsys.readouterr().out


def test_cli_profile_of_a_graph_model_with_a_keyword_sample(capsys, factory_module):
    """A factory's ``(module, {keyword: value})`` of a module that is no ``nn.Sequential``
    is exported as ``op.profile_chain`` does. Before, the CLI went to the torch.fx-only
    profiler and refused it ("give a sample batch"), although the factory gave one."""
    spec = factory_module.replace("make_module_only", "make_graph_model")
    args = _argparser().parse_args(["profile", spec, "--batch", "3", "--repeats", "1",
                                    "--warmup", "0", "--no-progress"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["input_size"] == 3 * 6 * 4 and len(printed["stages"]) >= 3


def test_cli_profile_errors(factory_module):
    broken = factory_module.replace("make_module_only", "make_broken")
    for argv, match in ((["profile", "no-such-model"], "unknown model"),
                        (["profile", broken], r"make_broken' raised RuntimeError at "
                                              r"optmem_test_factories.py:\d+: boom in the "),
                        (["profile", factory_module], "input-shape"),
                        (["profile", "no_such_pkg.mod:f"], "cannot import"),
                        # the profile's own traceback, exit 1, until stop 51 (a hunt)
                        (["profile", factory_module.replace("make_module_only",
                                                            "make_mismatched")],
                         r"does not run on its own sample: RuntimeError: mat1 and mat2"),
                        (["profile", "toy-mlp", "--device", "tpu"], "cpu, cuda, cuda:N or meta")):
        args = _argparser().parse_args(argv)
        with pytest.raises(OptmemInputError, match=match):
            args.func(args)


def test_register_model_hook():
    @register_model("test-tiny", description="two layers")
    def tiny(batch: int = 2):
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), torch.randn(batch, 3)

    module, x = resolve_spec("test-tiny", batch=5)
    assert x.shape == (5, 3)
    from optmem.pytorch.models import list_models

    assert any(m.name == "test-tiny" and m.description == "two layers" for m in list_models())


def test_cli_module_does_not_import_torch():
    code = ("import sys, argparse; import optmem.pytorch.cli as c, optmem.pytorch.models; "
            "ap = argparse.ArgumentParser(); c.register_cli(ap.add_subparsers()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""}, check=True)
    assert out.stdout.strip() == "False"


def test_example_script_prints_same_losses(capsys, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "train_checkpointed", ROOT / "examples" / "train_checkpointed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["train_checkpointed.py", "--steps", "2", "--batch", "4"])
    mod.main()
    out = capsys.readouterr().out
    assert "same losses: True" in out and "DIFFERENT" not in out


def test_checkpoint_merges_stages_by_measured_time():
    torch.manual_seed(3)
    module, x = resolve_spec("toy-resnet", batch=2)
    cnet = op.checkpoint(module, x, memory_limit="min", max_stages=5, repeats=1, warmup=0)
    assert len(cnet.stages) == cnet.chain.length == 5
    assert cnet.chain.stage_names == tuple(cnet.stage_names)
    ref = reference_step(module, x, loss_fn, seed=4)
    got = reference_step(cnet, x, loss_fn, seed=4, owner=module)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _random_chain(rng):
    n = rng.randint(4, 10)
    outs = [rng.randint(1000, 100000) for _ in range(n)]
    return Chain.from_lists([rng.uniform(1, 5) for _ in range(n)],
                            [rng.uniform(1, 5) for _ in range(n)], outs,
                            [o + rng.randint(0, 100000) for o in outs],
                            input_size=rng.randint(1000, 50000))


def test_too_small_limit_error_names_a_limit_that_works():
    import random
    import re

    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.pytorch.planning import auto_slots
    from optmem.result import SolveOptions
    from optmem.solvers.facade import solve

    rng = random.Random(0)
    for _ in range(8):
        chain = _random_chain(rng)
        options = SolveOptions(slots=auto_slots(chain.length))  # the planner's default
        continuous = solve(CheckpointProblem(chain, 1), "dp", options=options).min_feasible_memory
        # the DP's hint is its threshold after discretisation: it works when passed back
        assert solve(CheckpointProblem(chain, continuous), "dp", options=options).status.has_plan
        with pytest.raises(OptmemInputError, match="smallest feasible limit") as err:
            op.solve_chain(chain, chain.input_size)
        least = int(re.search(r"\((\d+) B\)", str(err.value)).group(1))
        assert least >= continuous
        assert op.solve_chain(chain, least).status.has_plan  # the figure works passed back
        assert least == op.smallest_limit(chain)


def test_sequential_wrapper_keeps_the_models_face():
    torch.manual_seed(5)
    module, x = resolve_spec("toy-cnn", batch=4)
    cnet = op.checkpoint(module, x, memory_limit="min", repeats=1, warmup=0)
    assert list(cnet.state_dict()) == list(module.state_dict())
    assert [n for n, _ in cnet.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert [n for n, _ in cnet.named_buffers()] == [n for n, _ in module.named_buffers()]
    assert cnet[0] is module[0]
    cnet.load_state_dict(module.state_dict())
    cnet.eval()
    assert not module.training
    cnet.train()
    with pytest.raises(TypeError, match="one input"):
        cnet(x, x)



def test_forward_hooks_of_sequential_stages_run_at_every_run_of_the_stage():
    """The stages of an ``nn.Sequential`` are its modules, called by the executor: their
    forward hooks run at each ``F`` op of the plan (the first run and every re-run, as
    under ``torch.utils.checkpoint``), once under ``no_grad``; the hooks of the flattened
    containers (the ``Sequential`` itself, nested ones) are not called (documented)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 16, requires_grad=True)
    cnet = op.checkpoint(net, x, memory_limit="min", repeats=1, warmup=0, fast_path=False)
    calls: dict[str, int] = {}

    def count(name):
        def hook(module, args, out):
            calls[name] = calls.get(name, 0) + 1
        return hook

    for k, block in enumerate(net):
        block[0].register_forward_hook(count(f"{k}.0"))
        block.register_forward_hook(count(f"{k}"))
    net.register_forward_hook(count("net"))
    cnet(x).sum().backward()
    runs = {}
    for o in cnet.result.plan:
        if o.startswith("F_"):
            name = cnet.stage_names[int(o.split()[1]) - 1]
            runs[name] = runs.get(name, 0) + 1
    assert any(n > 1 for n in runs.values()), cnet.result.plan  # some stage re-runs
    assert calls == {name: n for name, n in runs.items() if name in calls}
    assert set(calls) == {f"{k}.0" for k in range(4)}  # the containers' hooks: not called
    calls.clear()
    with torch.no_grad():
        cnet(x)
    assert calls == {f"{k}.0": 1 for k in range(4)}

class MaskedBlocks(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, mask):
        m = (mask > 0).to(x.dtype)  # computed from an input: a side input, saved by mul
        for block in self.blocks:
            x = block(x) * m
        return x


def test_side_inputs_are_not_counted_as_activations():
    torch.manual_seed(6)
    net = MaskedBlocks()
    x, mask = torch.randn(4, 16), torch.randint(0, 2, (4, 16))
    chain = op.profile_chain(net, (x, mask), repeats=1, warmup=0)
    assert chain.extra["profile"]["op_overhead_ms"] > 0  # the default per-op constant
    bare = op.profile_chain(net, (x, mask), repeats=1, warmup=0, op_overhead=0.0)
    assert bare.extra["profile"]["op_overhead_ms"] == 0.0  # passed through the export route
    scaled = op.profile_chain(net, (x, mask), repeats=1, warmup=0, op_overhead_ratio=0.5)
    assert scaled.extra["profile"]["op_overhead_ratio"] == 0.5  # so is the ratio
    cnet = op.checkpoint(net, (x, mask), memory_limit=10 ** 9, op_overhead_ratio=0.25,
                         repeats=1, warmup=0)
    assert cnet.chain.extra["profile"]["op_overhead_ratio"] == 0.25  # and the one-liner's
    with pytest.raises(OptmemInputError, match="op_overhead_ratio"):
        op.checkpoint(net, (x, mask), memory_limit=10 ** 9, op_overhead_ratio=-1.0)
    nbytes = 4 * 16 * 4
    # each mul saves the linear's output and the mask: only the former is the stage's
    for i, name in enumerate(chain.stage_names):
        assert chain.saved_size[i] <= 2 * nbytes, (name, chain.saved_size)
    assert chain.extra["side_input_bytes"] >= nbytes
    cnet = op.checkpoint(net, (x, mask), memory_limit="min", chain=chain)
    ref = reference_step(lambda t: net(t, mask), x, loss_fn, seed=1, owner=net)
    got = reference_step(lambda t: cnet(t, mask), x, loss_fn, seed=1, owner=net)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["offload", "remat_offload"])
def test_offload_one_liners_with_tuples_between_stages(kind):
    from test_pytorch_execute import Join, Last, Split

    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(8, 8), Split(), Join(), Join(), Last(), nn.Linear(4, 3))
    x = torch.randn(5, 8, requires_grad=True)
    chain = op.profile_chain(net, x, repeats=1, warmup=0)
    wrap = getattr(op, kind)
    # 0.9: below store-all, above the smallest offload limit (960 of 1120 B)
    onet = wrap(net, x, memory_limit=int(0.9 * chain.store_all_peak()), bandwidth=1e9,
                chain=chain)
    assert any(o.startswith("offload") for o in onet.result.plan), onet.result.plan
    ref = reference_step(net, x, loss_fn, seed=2)
    got = reference_step(onet, x, loss_fn, seed=2, owner=net)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[3], ref[3], rtol=0, atol=0)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert list(onet.state_dict()) == list(net.state_dict())
    with pytest.raises(OptmemInputError, match="bandwidth"):
        wrap(net, x, memory_limit="1MiB", bandwidth="fast", chain=chain)


def test_one_liners_are_not_shadowed_by_the_executor_modules():
    import optmem.pytorch.offload
    import optmem.pytorch.remat_offload  # noqa: F401

    assert callable(op.offload) and callable(op.remat_offload)
    assert optmem.pytorch.offload.__name__ == "offload"  # the function, as documented
    from optmem.pytorch.offload import OffloadedChain  # the executor module still imports

    assert OffloadedChain.__module__ == "optmem.pytorch.offload"


# ------------------------------------------------------------------ planner: store-all, slots
def _planner_chain(length: int, seed: int) -> Chain:
    import random

    rng = random.Random(seed)
    out = [rng.randint(1000, 9000) for _ in range(length)]
    return Chain.from_lists([rng.uniform(1, 5) for _ in range(length)],
                            [rng.uniform(2, 9) for _ in range(length)],
                            out, [o + rng.randint(0, 20000) for o in out], input_size=1500)


def test_store_all_fast_path_refuses_a_variant_dp_does_not_declare():
    """Above the store-all peak the checkpoint ``dp`` returns store-all without solving; a
    variant ``dp`` does not declare is refused there as below it (stop 53's docs hunt:
    ``checkpoint(model, x, "1GiB", variant="bogus")`` returned a ``CheckpointedModule``
    while the same call at ``"60%"`` raised, and ``chen`` with ``variant="rotor"`` was
    refused at both limits)."""
    from optmem.pytorch.planning import Planner

    chain = _planner_chain(6, 0)
    peak = chain.store_all_peak()
    for limit in (peak, peak - 1):
        with pytest.raises(OptmemInputError, match="variant 'bogus'") as info:
            Planner("checkpoint", limit, variant="bogus").solve_at(chain, limit)
        assert info.value.field == "variant"
    assert Planner("checkpoint", peak, variant="rotor").solve_at(chain, peak) \
        .report["store_all_fits"]


@pytest.mark.parametrize("seed", range(4))
def test_dp_returns_store_all_whenever_it_fits(seed):
    from optmem.plan import store_all_plan
    from optmem.pytorch.planning import Planner
    from optmem.result import Status
    from optmem.simulate import simulate_checkpoint

    chain = _planner_chain(40, seed)
    peak = chain.store_all_peak()
    planner = Planner("checkpoint", peak)
    for limit in (peak, peak + 1, int(peak * 1.3)):
        result = planner.solve_at(chain, limit)
        assert result.plan == tuple(str(o) for o in store_all_plan(chain.length))
        assert result.method == "dp" and result.status is Status.OPTIMAL
        assert result.report["store_all_fits"]
        sim = simulate_checkpoint(chain, result.plan)
        assert result.objective == sim.makespan == result.bound
        assert sim.peak_memory <= limit == result.memory_limit * result.unit
    below = planner.solve_at(chain, peak - 1)
    assert "store_all_fits" not in below.report
    assert simulate_checkpoint(chain, below.plan).peak_memory <= peak - 1
    # the discretised DP alone recomputes at store-all's limit (the rounding loses memory)
    plain = op.solve_chain(chain, peak, slots=100)
    assert plain.report.get("store_all_fits") and plain.plan == result.plan
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.result import SolveOptions
    from optmem.solvers.facade import solve

    dp = solve(CheckpointProblem(chain, peak), "dp", options=SolveOptions(slots=100))
    assert dp.objective > result.objective


def test_auto_slots_only_for_the_checkpoint_dp():
    from optmem.pytorch.planning import DEFAULT_SLOTS, Planner, auto_slots

    chain = _planner_chain(40, 0)
    assert auto_slots(40) == 2000 and auto_slots(1000) == DEFAULT_SLOTS
    assert Planner("checkpoint", "1MB").options(chain).slots == auto_slots(40)
    assert Planner("checkpoint", "1MB").options(chain, "ilp").slots == DEFAULT_SLOTS
    assert Planner("checkpoint", "1MB", slots=321).options(chain).slots == 321
    assert Planner("offload", "1MB", bandwidth="1GB/s").options(chain).slots == DEFAULT_SLOTS


def test_checkpoint_with_a_segment_cost():
    """``segment_cost=`` reaches the DP (``extra``): a feasible result whose report counts
    the segments, no more segments than rotor's plan on the same chain, the same bitwise
    step; ``resolve(extra={"segment_cost": 0})`` switches it off again."""
    torch.manual_seed(0)
    module, x = resolve_spec("toy-cnn", batch=4)
    chain = op.profile_chain(module, x, repeats=1, warmup=0)
    limit = int(chain.store_all_peak() * 0.65)
    plain = op.checkpoint(module, x, memory_limit=limit, chain=chain, segment_cost=0)
    cnet = op.checkpoint(module, x, memory_limit=limit, chain=chain, segment_cost=5.0)
    r = cnet.result
    assert r.method == "dp" and r.status == "feasible"
    assert r.report["segment_cost"] == 5.0
    segments = sum(1 for o in r.plan if o.startswith("F_ck"))
    assert r.report["segments"] == segments
    assert segments <= sum(1 for o in plain.result.plan if o.startswith("F_ck"))
    assert cnet.expected_peak_bytes <= limit
    ref = reference_step(module, x, loss_fn, seed=1)
    got = reference_step(cnet, x, loss_fn, seed=1, owner=module)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    back = cnet.resolve(memory_limit=limit, extra={"segment_cost": 0})
    assert back.status == "optimal" and back.plan == plain.result.plan


def test_meta_profile_of_an_exported_model_with_buffers_is_one_clear_error():
    """``device="meta"`` needs an ``nn.Sequential``: an exported model with buffers (batch
    norm) gets that error. Before, restoring its buffers compared meta tensors and an
    ``aten::equal`` NotImplementedError replaced it."""

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for lin in self.lins:
                x = torch.tanh(lin(x)) + x
            return self.bn(x).sum()

    with torch.device("meta"):
        module, x = Normed(), torch.randn(2, 6)
    with pytest.raises(OptmemInputError, match="device='meta' profiles an nn.Sequential"):
        op.profile_chain(module, x, device="meta")


@pytest.mark.parametrize("wrap", ["checkpoint", "offload", "remat_offload"])
def test_qat_observers_that_resize_their_buffers_train_as_the_model(wrap):
    """``prepare_qat`` with the x86 qconfig: per-channel weight observers whose min/max
    buffers start empty and are resized in place by the first forward. Loss, gradients and
    every buffer after each step equal the plain model's. Before, wrapping failed: putting
    the buffers back after extracting copied an empty tensor into a resized one ("The size
    of tensor a (8) must match the size of tensor b (0)"). Past that, a stage re-run by
    the plan started from the buffers its first run had updated: the fused observer
    (``torch.fused_moving_avg_obs_fake_quant``) writes them in place without a new version,
    so the executor's snapshot dropped them, the re-run moved the averages twice and the
    gradients differed from the second batch on (2e-3 at ``"70%"``, in silence)."""
    import copy
    import warnings

    import torch.ao.quantization as quant

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for lin in self.lins:
                x = torch.relu(lin(x))
            return x

    torch.manual_seed(0)
    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        net.qconfig = quant.get_default_qat_qconfig("x86")
        quant.prepare_qat(net, inplace=True)
    ref = copy.deepcopy(net)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    options = {} if wrap == "checkpoint" else {"bandwidth": "1GB/s"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the observers' forward hooks are traced
        limit = "90%" if wrap == "offload" else "70%"  # re-runs under the other two
        wrapped = getattr(op, wrap)(net, x, limit, repeats=1, warmup=0, fast_path=False,
                                    **options)
    for step in range(3):  # a new batch each step: the observers' moving averages move
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 + step))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = reference_step(wrapped, x, lambda y: y.pow(2).sum(), owner=net)
        want = reference_step(ref, x, lambda y: y.pow(2).sum())
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for a, b in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for (n, a), b in zip(net.named_buffers(), ref.buffers(), strict=True):
            assert a.shape == b.shape and torch.equal(a, b), n


class _ScriptedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


class _WithScriptedBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(torch.jit.script(_ScriptedBlock()) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("wrap", ["checkpoint", "offload", "remat_offload"])
def test_torch_jit_scripted_submodules_train_as_the_model(wrap):
    """``torch.jit.script``-ed blocks inside a model (torch.export cannot call them; torch.fx
    keeps each whole, as one module call): loss and gradients bitwise the plain model's.
    Before, every call failed in the wrapper's model-state check ("'OrderedModuleDict'
    object has no attribute 'get'"); past it, fx traced into the scripted ``forward`` and
    the stages held none of the blocks' parameters ("uses 4 tensor(s) that require grad
    but are not its parameters")."""
    torch.manual_seed(0)
    net = _WithScriptedBlocks()
    torch.manual_seed(0)
    ref = _WithScriptedBlocks()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    options = {} if wrap == "checkpoint" else {"bandwidth": "1GB/s"}
    wrapped = getattr(op, wrap)(net, x, "90%", repeats=1, warmup=0, fast_path=False,
                                **options)
    for _ in range(2):
        got = reference_step(wrapped, x, lambda y: y.pow(2).sum(), owner=net)
        want = reference_step(ref, x, lambda y: y.pow(2).sum())
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert all(g is not None for g in got[2])
        for a, b in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _residual_mlp() -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for lin in self.lins:
                x = x + torch.tanh(lin(x))
            return self.head(x)

    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("wrap", ["checkpoint", "remat_offload"])
def test_functional_call_and_torch_func_transforms_give_the_models_results(wrap):
    """``torch.func.functional_call(cmodel, params, x)`` runs the plan with the given
    parameters (gradients reach them, bitwise the model's). Under a ``torch.func`` transform
    (``grad``, ``vmap`` of ``grad``: per-sample gradients) the model runs as it is, with one
    warning. Before, a transform's call (a new signature) re-extracted under the transform and
    failed in profiling: "NotImplementedError: Cannot access storage of TensorWrapper"."""
    import copy
    import warnings

    from torch.func import functional_call, grad, vmap

    net = _residual_mlp()
    ref = copy.deepcopy(net)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    options = {} if wrap == "checkpoint" else {"bandwidth": "1GB/s"}
    wrapped = getattr(op, wrap)(net, x, "80%", repeats=1, warmup=0, fast_path=False,
                                **options)
    fast = {n: (p.detach() * 1.5).requires_grad_() for n, p in ref.named_parameters()}
    fast_ref = {n: p.detach().clone().requires_grad_() for n, p in fast.items()}
    out = functional_call(wrapped, fast, (x,))
    out_ref = functional_call(ref, fast_ref, (x,))
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    out.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    for n, p in fast.items():
        torch.testing.assert_close(p.grad, fast_ref[n].grad, rtol=0, atol=0)
    assert all(p.grad is None for p in net.parameters())

    # some parameters only (the others the model's): before, a plain tensor put into a
    # parameter slot was bound to its stage as a buffer, and its gradient was lost in
    # silence (checkpoint) or refused ("not its parameters", remat_offload)
    some = {"lins.1.weight": ref.lins[1].weight.detach().mul(1.1).requires_grad_()}
    some_ref = {n: p.detach().clone().requires_grad_() for n, p in some.items()}
    for _ in range(2):
        for model, owner, given in ((wrapped, net, some), (ref, ref, some_ref)):
            owner.zero_grad(set_to_none=True)
            given["lins.1.weight"].grad = None
            functional_call(model, given, (x,)).pow(2).sum().backward()
        torch.testing.assert_close(some["lins.1.weight"].grad, some_ref["lins.1.weight"].grad,
                                   rtol=0, atol=0)
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    net.zero_grad(set_to_none=True)

    params = {n: p.detach() for n, p in net.named_parameters()}

    def loss(model: nn.Module):
        return lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()

    with pytest.warns(UserWarning, match="torch.func transform"):
        got = vmap(grad(loss(wrapped)), in_dims=(None, 0))(params, x)
    want = vmap(grad(loss(ref)), in_dims=(None, 0))(params, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per wrapper
        got_one = grad(loss(wrapped))(params, x[0])
    want_one = grad(loss(ref))(params, x[0])
    for n in params:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
        torch.testing.assert_close(got_one[n], want_one[n], rtol=0, atol=0)


@pytest.mark.parametrize("wrap", ["checkpoint", "remat_offload"])
def test_an_output_that_needs_no_gradient_does_not_need_one_through_the_plan(wrap):
    """Outputs computed without a gradient (a ``detach``-ed statistic beside the logits; a
    tail run under ``no_grad``) need none from the wrapper either, as from the model.
    Before, the plan's last stage returned every float output as differentiable: with
    ``remat_offload`` (and ``checkpoint(strip_suffix=False)``) ``h.detach()`` required grad,
    and a model whose output needs no gradient back-propagated in silence, every gradient
    ``None``, where the model raises "element 0 of tensors does not require grad"."""

    class Net(nn.Module):
        def __init__(self, tail_without_grad: bool) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.head = nn.Linear(8, 3)
            self.tail_without_grad = tail_without_grad

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.tanh(self.lins[0](x))
            with torch.set_grad_enabled(not self.tail_without_grad):
                for lin in self.lins[1:]:
                    x = x + torch.tanh(lin(x))
                return self.head(x), x.detach().pow(2).mean(-1)

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    options = ({"strip_suffix": False} if wrap == "checkpoint" else {"bandwidth": "1GB/s"})
    for tail_without_grad in (False, True):
        torch.manual_seed(0)
        net = Net(tail_without_grad)
        wrapped = getattr(op, wrap)(net, x, "100%", repeats=1, warmup=0, fast_path=False,
                                    **options)
        got, want = wrapped(x), net(x)
        assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [
            not tail_without_grad, False]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if tail_without_grad:
            with pytest.raises(RuntimeError, match="does not require grad"):
                got[0].sum().backward()


@pytest.mark.parametrize("wrap", ["checkpoint", "remat_offload"])
def test_functional_call_on_a_wrapped_sequential_reruns_with_the_given_tensors(wrap):
    """An ``nn.Sequential``'s stages are its own children: ``functional_call`` swaps the
    given tensors into them for the call only, and the plan re-runs stages in the backward,
    after the call returned. The re-runs compute with the tensors of the first run, as
    autograd's saved tensors do: gradients bitwise the plain model's. Before, a re-run read
    the model's restored parameters: refused at the first step ("uses 1 tensor(s) that
    require grad but are not its parameters"), wrong in silence at the next ones."""
    import copy

    from torch.func import functional_call

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), *[nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                           for _ in range(4)], nn.Linear(8, 3))
    ref = copy.deepcopy(net)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    options = {} if wrap == "checkpoint" else {"bandwidth": "1GB/s"}
    wrapped = getattr(op, wrap)(net, x, "60%", repeats=1, warmup=0, fast_path=False,
                                **options)
    plan = [str(o) for o in wrapped.result.plan]
    first_b = next(k for k, o in enumerate(plan) if o.startswith("B "))
    # re-runs in the backward (remat_offload offloads at this limit instead)
    assert any(o.startswith("F_all") for o in plan[first_b:]) == (wrap == "checkpoint")
    for step in range(2):
        given = {"2.0.weight": ref[2][0].weight.detach().mul(1.1 + step).requires_grad_(),
                 "0.bias": ref[0].bias.detach().mul(0.5).requires_grad_()}
        given_ref = {n: t.detach().clone().requires_grad_() for n, t in given.items()}
        for model, owner, tensors in ((wrapped, net, given), (ref, ref, given_ref)):
            owner.zero_grad(set_to_none=True)
            functional_call(model, tensors, (x,)).pow(2).sum().backward()
        for n in given:
            torch.testing.assert_close(given[n].grad, given_ref[n].grad, rtol=0, atol=0)
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", [op.offload, op.remat_offload])
def test_checkpoint_only_methods_name_their_wrapper_not_the_model(kind):
    """``resolve`` and ``use_plan`` belong to ``op.checkpoint``'s wrapper; asked of an
    offload wrapper, the attribute fell through to the model: "'Sequential' object has no
    attribute 'resolve'" (a hunt in stop 51)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8)
    wrapped = kind(net, x, memory_limit="100%", bandwidth="1GB/s", repeats=1, warmup=0)
    for name in ("resolve", "use_plan"):
        with pytest.raises(AttributeError, match=rf"Module has no {name}\(\): it is a method "
                                                 r"of the checkpoint wrapper"):
            getattr(wrapped, name)
    with pytest.raises(AttributeError, match="'Sequential' object has no attribute 'nope'"):
        wrapped.nope  # noqa: B018 - other names still reach the model
    assert wrapped.summary()  # a method of every wrapper


class _NoisyLayer(nn.Module):
    """Adds noise drawn from a generator it holds (noise injection, diffusion timesteps)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.lin, self.gen = nn.Linear(8, 8), gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + 0.1 * torch.randn(x.shape, generator=self.gen)


class _NoisyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.layers = nn.ModuleList(_NoisyLayer(gen) for _ in range(5))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _own_generators(model: nn.Module) -> list[torch.Generator]:
    return list({id(v): v for m in model.modules() for v in vars(m).values()
                 if isinstance(v, torch.Generator)}.values())


@pytest.mark.parametrize("sequential", [False, True], ids=["exported", "sequential"])
@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_a_generator_the_model_holds_is_drawn_as_in_the_plain_model(kind, sequential):
    """Before (stop 52): a model drawing from a ``torch.Generator`` of its own
    (``torch.randn(..., generator=self.gen)``) found it advanced by wrapping (profiling
    and the plain-step measurement drew from it: other noise at every later step, all
    three one-liners), and a checkpoint plan's re-runs drew fresh noise instead of the
    first run's: gradients 0.6 to 3.6 off in silence. Now wrapping puts the model's
    generators back, and a re-run restores them as it restores the global RNG: the
    gradients and the generators' states are the plain model's, bitwise, at every step
    (re-running plans: checkpoint at its smallest limit, remat + offload over a link of
    1 B/s)."""
    import copy

    torch.manual_seed(0)
    base = _NoisyNet()
    if sequential:
        base = nn.Sequential(*base.layers, base.head)
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    x = torch.randn(4, 8)
    options = {"checkpoint": {"memory_limit": "min"},
               "offload": {"memory_limit": "60%", "bandwidth": "1GB/s"},
               "remat_offload": {"memory_limit": "60%", "bandwidth": 1.0}}[kind]
    wrapped = getattr(op, kind)(model, x, repeats=1, warmup=0, fast_path=False, **options)
    if kind != "offload":
        assert any(o.startswith(("F_ck", "F_none")) for o in wrapped.result.plan)
    mine, theirs = _own_generators(model), _own_generators(plain)
    assert len(mine) == 1
    assert torch.equal(mine[0].get_state(), theirs[0].get_state())  # wrapping drew nothing
    for _ in range(2):
        plain(x).square().sum().backward()
        wrapped(x).square().sum().backward()
        for p, q in zip(plain.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        assert torch.equal(mine[0].get_state(), theirs[0].get_state())
        plain.zero_grad()
        model.zero_grad()


class _NoiseFromTheCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        for lin in self.lins:
            x = torch.tanh(lin(x)) + 0.1 * torch.randn(x.shape, generator=generator)
        return self.head(x)


def test_a_generator_passed_in_the_call_is_drawn_as_in_the_plain_model():
    """Before (stop 52): a ``generator=`` argument was advanced by wrapping (on the
    sample's generator) and by the extraction and profiling of every new signature (a new
    generator object is one), before the step drew from it: each step's noise was
    another, gradients 0.56-0.68 off in silence. Now those runs put it back: the same
    generator at every call, or a new one per call (each extracted again, as any new
    Python value of a call), trains as the plain model, bitwise."""
    import copy

    torch.manual_seed(0)
    plain = _NoiseFromTheCall()
    model = copy.deepcopy(plain)
    x = torch.randn(4, 8)
    kept, kept_plain = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    wrapped = op.checkpoint(model, {"x": x, "generator": kept}, memory_limit="min",
                            repeats=1, warmup=0, fast_path=False)
    assert any(o.startswith(("F_ck", "F_none")) for o in wrapped.result.plan)
    assert torch.equal(kept.get_state(), kept_plain.get_state())
    fresh = [(torch.Generator().manual_seed(s), torch.Generator().manual_seed(s)) for s in (4, 5)]
    for mine, theirs in [(kept, kept_plain), (kept, kept_plain), *fresh]:
        plain(x, generator=theirs).square().sum().backward()
        wrapped(x, generator=mine).square().sum().backward()
        for p, q in zip(plain.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        assert torch.equal(mine.get_state(), theirs.get_state())
        plain.zero_grad()
        model.zero_grad()


def test_a_copy_of_the_wrapper_draws_from_the_copied_models_generator():
    """Before (stop 52): export lifts the model's generator as a second Python object on
    its state, so ``copy.deepcopy`` of the wrapper gave the copy's stages a generator of
    their own, apart from the copied model's: reseeding the copy's model (or drawing from
    it in a call under ``no_grad``, which runs the model) changed nothing for the stages,
    whose noise went on from the old state. Now the stages hold the model's generator
    object itself, and the copy copies one."""
    import copy

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    wrapped = op.checkpoint(_NoisyNet(), x, memory_limit="min", repeats=1, warmup=0,
                            fast_path=False)
    twin = copy.deepcopy(wrapped)
    plain = copy.deepcopy(wrapped.module)
    for model in (plain, twin.module):
        _own_generators(model)[0].manual_seed(11)
    for _ in range(2):
        plain(x).square().sum().backward()
        twin(x).square().sum().backward()
        for p, q in zip(plain.parameters(), twin.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        plain.zero_grad()
        twin.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(twin(x), plain(x), rtol=0, atol=0)


class _SavedLoadedNet(nn.Module):
    """Noise of a static shape, a ``no_grad`` and an autocast region, a counter buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.teacher = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():
            target = self.teacher(x)
        x = x + 0.1 * target
        for k, lin in enumerate(self.lins):
            if k == 2:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = torch.tanh(lin(x)).float()
            else:
                x = torch.tanh(lin(x)) + 0.1 * torch.randn(x.shape)
        return self.head(x)


@pytest.mark.parametrize("kind", ["checkpoint", "remat_offload"])
def test_a_wrapper_saved_and_loaded_computes_what_the_model_computes(kind):
    """Before (stop 52): ``torch.load`` of a saved wrapper traced each stage's code again
    with ``torch.fx``, which runs every call none of whose arguments is traced: a draw of a
    static shape (``torch.randn(x.shape)``) became a constant (the same noise at every
    step), the side program's ``calls += 1`` ran once while loading and never again, and
    the ``no_grad`` and autocast regions (higher-order ops) were traced into and lost
    (gradients 0.06 off, or "Tensor dtype mismatch"). Now the stages and the side program
    are loaded by ``graphcut.ReloadTracer``, which keeps those ops as nodes: the loaded
    wrapper is bitwise the model, outputs, gradients and buffers, over two steps."""
    import copy
    import io

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    options = {"bandwidth": 1.0} if kind == "remat_offload" else {}
    wrapped = getattr(op, kind)(_SavedLoadedNet(), x, memory_limit="min", repeats=1,
                                warmup=0, fast_path=False, **options)
    assert any(o.startswith(("F_ck", "F_none")) for o in wrapped.result.plan)
    plain = copy.deepcopy(wrapped.module)
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected = plain(x)
        expected.square().sum().backward()
        torch.manual_seed(seed)
        got = loaded(x)
        got.square().sum().backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for p, q in zip(plain.parameters(), loaded.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
        for a, b in zip(plain.buffers(), loaded.module.buffers(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        plain.zero_grad()
        loaded.zero_grad()


def test_a_compiled_training_step_runs_the_plan_outside_dynamo(monkeypatch):
    """``backward()`` inside a ``torch.compile``-d step, three one-liners in one process.

    Autograd calls the executors' backward Python (re-runs, transfers, unpack and tensor
    hooks) with the caller's frame callback. Before, dynamo traced it: ``op.checkpoint``
    failed with a false ``OptmemInputError`` (a fake tensor of shape ``(0,)`` taken for a
    tensor that is not a parameter) and the offload executors' transfer functions were
    traced, one frame per call site (the recompile limit after a few wrappers). Now no
    transfer runs under dynamo, the stages still run compiled, gradients bitwise over two
    steps.
    """
    import copy

    from optmem.pytorch.offload import HostCopies

    traced: list[str] = []
    for name in ("to_host", "to_device"):
        original = getattr(HostCopies, name)

        def record(self, *args, _original=original, _name=name):
            if torch.compiler.is_compiling():
                traced.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(HostCopies, name, record)
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager")
    def train_step(module, x):
        module(x).square().sum().backward()

    for width in (8, 12):
        for kind in (op.checkpoint, op.offload, op.remat_offload):
            torch.manual_seed(width)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(5)])
            plain = copy.deepcopy(model)
            x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
            options = {} if kind is op.checkpoint else {"bandwidth": "1GB/s"}
            cmodel = kind(model, x, memory_limit="50%", **options)
            assert any(o.startswith(("F_ck", "offload")) for o in cmodel.result.plan)
            for _ in range(2):
                train_step(cmodel, x)
                plain(x).square().sum().backward()
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (kind.__name__, width)
            assert cmodel.executor._compiled is not None  # the stages ran compiled
    assert traced == []
    torch._dynamo.reset()


def test_wrappers_compiled_past_dynamos_recompile_limit_run_eager_stages():
    """Once the wrapper's ``forward`` hits the recompile limit, no stage gets inductor.

    Dynamo then runs the cached code of an earlier wrapper of the same class with its frame
    callback ``False`` (run-only). Before, the stages read no backend from it and were
    compiled with default options (inductor under ``backend="aot_eager"``: gradients 1.2e-7
    off the plain model's); now they run as they are, as dynamo runs what it gave up on.
    """
    import copy

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for i, kind in enumerate((op.offload, op.checkpoint, op.offload)):
            torch.manual_seed(i)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                    for _ in range(5)])
            plain = copy.deepcopy(model)
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
            options = {} if kind is op.checkpoint else {"bandwidth": "1GB/s"}
            cmodel = kind(model, x, memory_limit="50%", **options)
            compiled = torch.compile(cmodel, backend="aot_eager")
            for _ in range(2):
                compiled(x).square().sum().backward()
                plain(x).square().sum().backward()
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (i, kind.__name__)
            if i == 0:  # the first wrapper compiles its stages with the enclosing backend
                assert cmodel.executor._compiled_with["backend"] is not None
            else:  # past the limit: dynamo and the stages run eagerly
                assert cmodel.executor._compiled is None
    torch._dynamo.reset()


def test_a_list_of_stages_is_named_as_such_in_the_no_plan_error():
    """The error named a Python list of stage modules "torch" (the stop-52 hunt)."""
    torch.manual_seed(0)
    stages = [torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)]
    x = torch.randn(4, 8)
    with pytest.raises(OptmemInputError, match="plan for list of 3 stages within") as err:
        op.checkpoint(stages, x, memory_limit=1)
    assert "torch" not in str(err.value)
    with pytest.raises(OptmemInputError, match="plan for Sequential within"):
        op.checkpoint(torch.nn.Sequential(*stages), x, memory_limit=1)
    assert op.profile_chain(stages, x, repeats=1, warmup=0).name == "list of 3 stages"


def test_wrapping_restores_the_cuda_rng_of_a_model_without_cuda_buffers(monkeypatch):
    """``leaves_no_trace`` (around extraction, profiling and autotune timing) forked the
    CUDA RNG of the devices holding a *buffer* only: a model on a GPU without buffers (an
    MLP with dropout) had its CUDA generator advanced by wrapping, so training drew other
    masks than without the wrapper. Parameters' and the call's devices count now."""
    from pytorch_helpers import on_fake_cuda

    from optmem.pytorch import wrapper

    forked = []
    real = torch.random.fork_rng

    def fork_rng(devices=None, enabled=True, **kwargs):
        forked.append(list(devices))
        return real(devices=[], enabled=enabled)  # no GPU here: the CPU state only

    class OnGpu(nn.Module):  # a parameter on "cuda:1", no buffer
        def parameters(self, recurse: bool = True):
            yield on_fake_cuda(torch.zeros(2))

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    with wrapper.leaves_no_trace(OnGpu()):
        pass
    with wrapper.leaves_no_trace(nn.Linear(2, 2), ((on_fake_cuda(torch.zeros(2)),), {})):
        pass
    with wrapper.leaves_no_trace(nn.Linear(2, 2), ((torch.zeros(2),), {})):
        pass
    assert forked == [[1], [1], []]


def test_cli_profile_refuses_a_cuda_device_the_machine_lacks(monkeypatch, capsys):
    """``optmem profile --device cuda:3`` on a one-GPU machine, or a malformed ``cudax`` /
    ``cuda:-1``, failed in ``module.to`` with PyTorch's error (here, without CUDA, a raw
    ``AssertionError``; on a GPU machine ``invalid device ordinal`` or a message about the
    model). Each is one input error now, exit 2 (a one-GPU machine faked)."""
    from optmem.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device, match in (("cuda:3", "this machine has 1 CUDA device"),
                          ("cudax", "cpu, cuda, cuda:N or meta, got 'cudax'"),
                          ("cuda:-1", "cpu, cuda, cuda:N or meta, got 'cuda:-1'")):
        args = _argparser().parse_args(["profile", "toy-mlp", "--device", device])
        with pytest.raises(OptmemInputError, match=match):
            args.func(args)
        assert main(["profile", "toy-mlp", "--device", device]) == 2
        assert match.split(",")[0] in capsys.readouterr().err


def test_cli_profile_names_cuda_n_for_every_refused_device(capsys):
    """``optmem profile --device CPU`` (or ``mps``, ``cpu:0``) said ``expected cpu, cuda or
    meta`` while ``cudax`` said ``expected cpu, cuda, cuda:N or meta`` and ``cuda:1`` is
    taken (stop 54's fuzz, 66 device forms): every refused name now gets the one message
    that lists ``cuda:N``, and ``--help`` names it."""
    from optmem.cli import main

    for device in ("CPU", "mps", "cpu:0", ""):
        assert main(["profile", "toy-mlp", "--device", device]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"optmem: error: field 'device': expected cpu, cuda, cuda:N or meta, "
                       f"got {device!r}"]
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert "cpu, cuda, cuda:N, or meta" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_an_unknown_method_is_refused_before_the_profile(kind):
    """A method the problem does not have is one ``OptmemInputError`` naming the known
    ones, before any forward runs; until stop 78 it came after the whole profile (54
    forwards of a 6-layer MLP, minutes on a real model)."""
    forwards = []

    class Counted(nn.Linear):
        def forward(self, x):
            forwards.append(1)
            return super().forward(x)

    net = nn.Sequential(*[Counted(8, 8) for _ in range(4)])
    with pytest.raises(OptmemInputError, match="unknown method 'ilpp'") as err:
        getattr(op, kind)(net, torch.randn(2, 8), memory_limit="60%", method="ilpp")
    assert err.value.field == "method" and forwards == []
