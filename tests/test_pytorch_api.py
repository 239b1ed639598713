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
    assert r.status == "optimal" and r.method == "dp"
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


def _argparser():
    from optmem.pytorch import cli

    ap = argparse.ArgumentParser(prog="optmem")
    cli.register_cli(ap.add_subparsers(dest="command"))
    return ap


FACTORY_MODULE = """
from torch import nn


def make_module_only():
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
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


def test_cli_profile_errors(factory_module):
    for argv, match in ((["profile", "no-such-model"], "unknown model"),
                        (["profile", factory_module], "input-shape"),
                        (["profile", "no_such_pkg.mod:f"], "cannot import"),
                        (["profile", "toy-mlp", "--device", "tpu"], "cpu, cuda or meta")):
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
