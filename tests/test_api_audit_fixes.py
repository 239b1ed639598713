"""Fixes of the CLI and Python API audit: each test failed before its fix."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from optmem.cli import main
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError, PlanError
from optmem.problems import OffloadProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.simulate.verify import verify_plan

# the checkpoint ILP's optimum on random_chain(6, seed=1) at 60: it recomputes
CHECKPOINT_PLAN = ["F_ck 1", "F_ck 2", "F_none 3", "F_all 4", "F_all 5", "F_all 6", "Loss",
                   "B 6", "B 5", "B 4", "F_all 2", "F_all 3", "B 3", "B 2", "F_all 1", "B 1"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def c6(tmp_path: Path) -> Path:
    path = tmp_path / "c6.json"
    random_chain(6, seed=1).save(path)
    return path


def write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------ 1: offload compute sequence
def test_verify_offload_refuses_a_plan_that_recomputes(capsys, tmp_path, c6):
    plan = write(tmp_path, "plan.json", CHECKPOINT_PLAN)
    code, out, err = run(capsys, "verify", "offload", str(c6), str(plan), "--memory", "60",
                         "--bandwidth", "0")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "op 0: F_ck 1 is not in the offload problem's compute sequence" in err
    assert "F_all 1 here" in err and "remat-offload" in err and "Traceback" not in err
    code, out, err = run(capsys, "verify", "remat-offload", str(c6), str(plan), "--memory",
                         "60", "--bandwidth", "0")
    assert code == 0 and out.startswith("valid plan"), err


def test_verify_plan_offload_refuses_another_compute_order():
    chain = random_chain(6, seed=1)
    problem = OffloadProblem(chain, 60, 0)
    with pytest.raises(PlanError, match="op 0: F_ck 1 is not in the offload problem's"):
        verify_plan(problem, CHECKPOINT_PLAN)
    swapped = [f"F_all {i}" for i in range(1, 7)] + ["Loss", "B 6", "B 4", "B 5", "B 3",
                                                     "B 2", "B 1"]
    with pytest.raises(PlanError, match="op 8: B 4 .* which has B 5 here"):
        verify_plan(problem, swapped)
    extra = [*swapped[:8], "B 5", "B 4", "B 3", "B 2", "B 1", "F_all 1"]
    with pytest.raises(PlanError, match="op 13: F_all 1 .* which has ended here"):
        verify_plan(OffloadProblem(chain, 10**6, 0), extra)
    store_all = [*swapped[:8], "B 5", "B 4", "B 3", "B 2", "B 1"]
    assert verify_plan(OffloadProblem(chain, 10**6, 0), store_all)["objective"] > 0
    remat = RematOffloadProblem(chain, 60, 0)
    assert verify_plan(remat, CHECKPOINT_PLAN)["objective"] == 42.0


# ------------------------------------------------------------------ 2: pipeline lns bounded
def test_pipeline_lns_moves_are_bounded(capsys, monkeypatch, c6):
    pytest.importorskip("ortools")
    from optmem.problems.pipeline import PipelineProblem
    from optmem.result import SolveOptions
    from optmem.solvers import pipeline_lns
    from optmem.solvers.facade import solve

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran: lns was not refused before any work")

    monkeypatch.setattr(pipeline_lns, "improve", no_search)
    assert pipeline_lns.settings(SolveOptions(extra={"lns": 100_000}), 21).moves == 100_000
    with pytest.raises(OptmemInputError, match="lns at most 100,000") as info:
        pipeline_lns.settings(SolveOptions(extra={"lns": 100_001}), 21)
    assert info.value.field == "lns"
    problem = PipelineProblem(random_chain(6, seed=1), n_gpus=2, memory_per_gpu=10**6)
    with pytest.raises(OptmemInputError, match="lns at most"):
        solve(problem, "cpsat", extra={"lns": 2**70})
    code, out, err = run(capsys, "solve", "pipeline", str(c6), "--gpus", "2", "--memory",
                         "1000000", "--method", "cpsat", "--option", f"lns={2**70}")
    assert code == 2 and out == "" and "'lns'" in err and "at most 100,000" in err


# ------------------------------------------------------------------ 3: exported files' mode
@pytest.mark.parametrize("method,name", [("ilp", "m.mps"), ("ilp", "m.lp"),
                                         ("cpsat", "m.pb"), ("cpsat", "m.mps")])
def test_exported_models_get_the_mode_of_every_other_output(capsys, tmp_path, c6, method,
                                                            name):
    pytest.importorskip("pulp")
    if method == "cpsat":
        pytest.importorskip("ortools")
    from optmem.fileio import write_text_atomic
    from optmem.problems import CheckpointProblem
    from optmem.solvers.facade import export

    old = os.umask(0o027)
    try:
        reference = write_text_atomic(tmp_path / "ref.json", "{}")
        code, _, err = run(capsys, "export", "checkpoint", str(c6), "--memory", "60",
                           "--method", method, "-o", str(tmp_path / name))
        assert code == 0, err
        export(CheckpointProblem(random_chain(6, seed=1), 60), method, tmp_path / f"py-{name}")
    finally:
        os.umask(old)
    want = stat.S_IMODE(reference.stat().st_mode)
    assert want == 0o640
    assert stat.S_IMODE((tmp_path / name).stat().st_mode) == want
    assert stat.S_IMODE((tmp_path / f"py-{name}").stat().st_mode) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c6.json", "ref.json", name, f"py-{name}"])  # no temporary file left


# ------------------------------------------------------------------ 4: conflicting variants
def test_a_variant_given_twice_must_agree(capsys, c6):
    from optmem.problems import CheckpointProblem
    from optmem.solvers.facade import solve

    problem = CheckpointProblem(random_chain(6, seed=1), 60)
    with pytest.raises(OptmemInputError, match="'dp:rotor' names the variant 'rotor'") as info:
        solve(problem, "dp:rotor", variant="paper")
    assert info.value.field == "variant"
    assert solve(problem, "dp:rotor", variant="rotor").variant == "rotor"  # equal: fine
    assert solve(problem, "dp:rotor", variant="").variant == "rotor"  # "": not given
    code, out, err = run(capsys, "solve", "checkpoint", str(c6), "--memory", "60", "--method",
                         "dp:rotor", "--variant", "paper")
    assert code == 2 and out == "" and "field 'variant'" in err and "'paper'" in err
    code, out, err = run(capsys, "solve", "checkpoint", str(c6), "--memory", "60", "--method",
                         "dp:rotor", "--variant", "rotor", "--json")
    assert code == 0 and json.loads(out)["variant"] == "rotor", err


# ------------------------------------------------------------------ 5: the result's own fields
@pytest.mark.parametrize("unit", [0, -3, "x", 2**70, True])
def test_verify_checks_the_result_unit_as_show_does(capsys, tmp_path, c6, unit):
    from optmem.problems import CheckpointProblem
    from optmem.solvers.facade import solve

    problem = CheckpointProblem(random_chain(6, seed=1), 60)
    data = {**solve(problem, "dp").to_json(), "unit": unit}
    path = write(tmp_path, "r.json", data)
    code, out, err = run(capsys, "verify", "checkpoint", str(c6), str(path), "--memory", "60")
    assert code == 2 and out == "" and "field 'unit': expected an integer in 1..2^62" in err
    _, _, shown = run(capsys, "show", str(path), "--chain", str(c6), "-o",
                      str(tmp_path / "o.png"))
    assert shown == err  # one check, one message
    with pytest.raises(PlanError, match="expected an integer in 1..2") as info:
        verify_plan(problem, data)
    assert info.value.field == "unit"
    with pytest.raises(PlanError, match="memory_limit"):
        verify_plan(problem, {**data, "unit": 1, "memory_limit": -1})


def test_verify_refuses_a_result_of_another_kind_of_plan(capsys, tmp_path, c6):
    """A pipeline result is no list of ops (and the reverse): one error naming ``problem``.
    Results of the problems that share the ops replay in each other, as before the audit:
    an offload result in remat-offload, a checkpoint one in remat-offload and min-peak."""
    from optmem.problems.pipeline import PipelineProblem
    from optmem.solvers.facade import solve

    chain = random_chain(6, seed=1)
    result = solve(OffloadProblem(chain, 60, "12GB/s"), "dp")
    path = write(tmp_path, "r.json", result.to_json())
    code, out, err = run(capsys, "verify", "remat-offload", str(c6), str(path), "--memory",
                         "60", "--bandwidth", "12GB/s")
    assert code == 0 and "valid plan" in out
    remat = RematOffloadProblem(chain, 60, "12GB/s")
    assert verify_plan(remat, result)["objective"] == result.objective
    pipe = solve(PipelineProblem(chain, n_gpus=2, memory_per_gpu=100, chain_bandwidth=1e6),
                 "contiguous")
    assert pipe.status.has_plan
    path = write(tmp_path, "p.json", pipe.to_json())
    code, out, err = run(capsys, "verify", "remat-offload", str(c6), str(path), "--memory",
                         "60", "--bandwidth", "12GB/s")
    assert code == 2 and out == "" and "field 'problem'" in err
    assert "result of the pipeline problem, whose plans are not remat-offload plans" in err
    with pytest.raises(PlanError, match="not remat-offload plans") as info:
        verify_plan(remat, pipe)
    assert info.value.field == "problem"
    with pytest.raises(PlanError, match="not pipeline plans") as info:
        verify_plan(PipelineProblem(chain, n_gpus=2, memory_per_gpu=100,
                                    chain_bandwidth=1e6), result)
    assert info.value.field == "problem"


# ------------------------------------------------------------------ 6: misleading messages
def test_slots_must_be_an_integer_says_so():
    from optmem.result import SolveOptions

    with pytest.raises(OptmemInputError, match="expected an integer number of slots") as info:
        SolveOptions(slots=1000.0)
    assert info.value.field == "slots"


def test_a_plan_file_holding_a_json_string_says_what_is_expected(capsys, tmp_path, c6):
    path = write(tmp_path, "p.json", "F_all 1")
    code, out, err = run(capsys, "verify", "checkpoint", str(c6), str(path), "--memory", "60")
    assert code == 2 and out == "" and "not valid JSON" not in err
    assert "expected a JSON list of ops" in err and "result object" in err
    assert "got the JSON string 'F_all 1'" in err


def test_verify_min_peak_names_the_bad_item(capsys, tmp_path, c6):
    for plan, k in (([0, 1.5], 1), ([0, 3, 9], 2), (["F_ck 1", 3], 1)):
        path = write(tmp_path, "p.json", plan)
        code, out, err = run(capsys, "verify", "min-peak", str(c6), str(path))
        assert code == 2 and out == "" and f"item {k}: " in err and "op 0" not in err, err


@pytest.mark.parametrize("op,least", [("offload a 9", 0), ("offload abar 9", 1),
                                      ("prefetch a 7", 0)])
def test_verify_offload_names_an_index_out_of_range(capsys, tmp_path, c6, op, least):
    plan = ["F_all 1", op, *(f"F_all {i}" for i in range(2, 7)), "Loss",
            *(f"B {i}" for i in range(6, 0, -1))]
    path = write(tmp_path, "p.json", plan)
    code, out, err = run(capsys, "verify", "offload", str(c6), str(path), "--memory", "1000",
                         "--bandwidth", "1e9")
    assert code == 2 and out == ""
    assert f"op 1: {op}: index {op.split()[-1]} out of range {least}..6" in err


def test_extra_is_not_an_option_key(capsys, c6):
    from optmem.problems import CheckpointProblem
    from optmem.solvers.facade import solve

    code, out, err = run(capsys, "solve", "checkpoint", str(c6), "--memory", "60", "--option",
                         "extra=1")
    assert code == 2 and "did you mean" not in err and "'extra' is not an option key" in err
    with pytest.raises(OptmemInputError, match="'extra' is not an option key") as info:
        solve(CheckpointProblem(random_chain(6, seed=1), 60), extra={"extra": {"sweeps": 2}})
    assert info.value.field == "extra" and "did you mean" not in str(info.value)


@pytest.mark.parametrize("method,name", [("ilp", "m.MPS"), ("ilp", "m.Lp"),
                                         ("cpsat", "m.PBTXT")])
def test_export_takes_a_suffix_in_any_case(capsys, tmp_path, c6, method, name):
    pytest.importorskip("pulp")
    if method == "cpsat":
        pytest.importorskip("ortools")
    from optmem.problems import CheckpointProblem
    from optmem.solvers.facade import export

    code, out, err = run(capsys, "export", "checkpoint", str(c6), "--memory", "60",
                         "--method", method, "-o", str(tmp_path / name))
    assert code == 0, err
    export(CheckpointProblem(random_chain(6, seed=1), 60), method, tmp_path / f"py-{name}")
    lower = tmp_path / f"lower{Path(name).suffix.lower()}"
    export(CheckpointProblem(random_chain(6, seed=1), 60), method, lower)
    text = lower.read_text()  # the same format: .PBTXT is text, as .pbtxt
    assert (tmp_path / name).read_text() == text == (tmp_path / f"py-{name}").read_text()


# ------------------------------------------------------------------ 7: duplicate methods
def test_compare_and_sweep_run_each_method_and_variant_once(capsys, c6):
    from optmem.problems import CheckpointProblem
    from optmem.solvers.facade import compare
    from optmem.sweep import sweep

    chain = random_chain(6, seed=1)
    labels = [r.method + (f":{r.variant}" if r.variant else "") for r in compare(
        CheckpointProblem(chain, 60), "dp,chen,dp,dp:paper,dp:rotor,chen")]
    assert labels == ["dp:paper", "chen", "dp:rotor"]
    code, out, err = run(capsys, "compare", "checkpoint", str(c6), "--memory", "60",
                         "--methods", "dp,dp", "--json")
    assert code == 0 and len(json.loads(out)["results"]) == 1, err
    result = sweep(lambda m: CheckpointProblem(chain, m), [50, 60], "dp,dp,chen,dp",
                   progress=False)
    assert list(result.methods) == ["dp", "chen"] and len(result.points) == 4
    code, out, err = run(capsys, "sweep", "checkpoint", str(c6), "--memory", "50:60:2",
                         "--methods", "dp,dp", "-q")
    assert code == 0 and "2 limits x 1 methods" in out, err


# ------------------------------------------------------------------ 8: unpicklable factory
def test_sweep_refuses_an_unpicklable_factory_before_any_work():
    from optmem.problems import CheckpointProblem
    from optmem.sweep import sweep

    chain = random_chain(6, seed=1)
    calls = []

    def factory(m):
        calls.append(m)
        return CheckpointProblem(chain, m)

    for bad in (lambda m: CheckpointProblem(chain, m), factory):
        with pytest.raises(OptmemInputError, match="picklable") as info:
            sweep(bad, [60], "dp", jobs=2, progress=False)
        assert info.value.field == "problem_factory"
    assert calls == []  # before any work, the probe included
    assert len(sweep(factory, [60], "dp", jobs=1, progress=False).points) == 1


# ------------------------------------------------------------------ 9: --version
def test_version_prints_the_package_version(capsys):
    import optmem

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    out, err = capsys.readouterr()
    assert info.value.code == 0 and out == f"optmem {optmem.__version__}\n" and err == ""


# ------------------------------------------------------------------ show_plan: the CLI's inputs
def test_show_plan_takes_what_optmem_show_takes(capsys, tmp_path, c6):
    """Python's ``show_plan`` takes the chain by path or name, the plan as a Path, a
    ``Result``, a list of ops or JSON text, the limit as a size or a percentage, and the
    link as the problems take it (a bare number is bytes per second, as on the CLI); until
    stop 75 it took a ``Chain``, a dict and an int only, and a bare number in chain units."""
    from optmem.chain import Chain
    from optmem.show import show_plan
    from optmem.solvers.facade import solve

    chain = Chain.load(c6)
    result = solve(OffloadProblem(chain, 60, bandwidth=1e3), "dp")
    assert result.status.has_plan
    path = write(tmp_path, "r.json", result.to_json())
    code, out, _ = run(capsys, "show", str(path), "--chain", str(c6), "--bandwidth", "1e3",
                       "--memory", "60", "-o", str(tmp_path / "cli.png"))
    assert code == 0
    cli_makespan = float(out.split("makespan ")[1].split()[0])
    for chain_arg in (chain, str(c6)):
        for data in (path, result, list(result.plan), json.dumps(result.to_json())):
            info = show_plan(chain_arg, data, tmp_path / "py.png", bandwidth=1e3,
                             memory_limit="60")
            assert f"{info['makespan']:.6g}" == f"{cli_makespan:.6g}"
            assert info["memory_limit"] == 60
    rate = show_plan(c6, path, tmp_path / "r.png", bandwidth="1kB/s")
    assert rate["makespan"] == pytest.approx(cli_makespan, rel=1e-6)
    per_ms = show_plan(c6, path, tmp_path / "u.png", chain_bandwidth=1.0)  # 1 B/ms = 1e3 B/s
    assert per_ms["makespan"] == pytest.approx(cli_makespan, rel=1e-6)
    assert show_plan(c6, path, tmp_path / "p.png", bandwidth=1e3,
                     memory_limit="100%")["memory_limit"] == chain.store_all_peak()
    for bad, field in (({"memory_limit": -1}, "memory_limit"),
                       ({"bandwidth": -1.0}, "bandwidth"),
                       ({"bandwidth": 1e3, "chain_bandwidth": 1.0}, "chain_bandwidth")):
        with pytest.raises(OptmemInputError) as info:
            show_plan(c6, path, tmp_path / "bad.png", **bad)
        assert info.value.field == field
        assert not (tmp_path / "bad.png").exists()
    with pytest.raises(PlanError, match="plan is empty"):
        show_plan(c6, [], tmp_path / "bad.png")


def test_methods_takes_a_problem_object_or_its_name():
    """``methods(problem)`` as CONTRACT writes it: a problem object is taken by its name;
    anything else is one line naming the type, not the object's whole ``repr``."""
    from optmem.solvers.facade import methods

    problem = OffloadProblem(random_chain(6, seed=1), 60, "12GB/s")
    assert methods(problem) == methods("offload")
    with pytest.raises(OptmemInputError, match="expected a problem object") as info:
        methods(random_chain(6, seed=1))
    assert info.value.field == "problem" and "\n" not in str(info.value)
    assert len(str(info.value)) < 300
