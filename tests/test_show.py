"""Plan pictures: checkpoint, min-peak and offload plans are replayed and drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError, PlanError
from optmem.problems import CheckpointProblem
from optmem.show import is_offload_plan, read_plan_file, show_plan
from optmem.solvers.facade import solve

pytest.importorskip("matplotlib", reason="plots need matplotlib (optmem[plot])")


@pytest.fixture
def chain_file(tmp_path: Path) -> Path:
    path = tmp_path / "c.json"
    random_chain(6, seed=5).save(path)
    return path


def test_checkpoint_plan_from_solve_json(tmp_path: Path, chain_file: Path) -> None:
    chain = Chain.load(chain_file)
    limit = (chain.store_all_peak() * 2) // 3
    r = solve(CheckpointProblem(chain, limit), "dp")
    (tmp_path / "p.json").write_text(json.dumps(r.to_json()))
    data = read_plan_file(tmp_path / "p.json")
    info = show_plan(chain, data, tmp_path / "p.png")
    assert info["kind"] == "checkpoint"
    assert info["makespan"] == pytest.approx(r.objective)
    assert info["peak_memory"] <= info["memory_limit"] == r.memory_limit * r.unit
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_plain_list_svg_and_min_peak(tmp_path: Path, chain_file: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "ops.json"
    plan.write_text(json.dumps(["F_ck 1", "F_none 2", "F_all 3", "F_all 4", "F_all 5",
                                "F_all 6", "Loss", "B 6", "B 5", "B 4", "B 3",
                                "F_all 1", "F_all 2", "B 2", "B 1"]))
    assert main(["show", str(plan), "--chain", str(chain_file), "-o",
                 str(tmp_path / "ops.svg"), "--memory", "1000"]) == 0
    assert "picture written" in capsys.readouterr().out
    assert (tmp_path / "ops.svg").stat().st_size > 1000
    out = tmp_path / "mp.json"
    assert main(["solve", "min-peak", str(chain_file), "--json", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out), "--chain", str(chain_file)]) == 0
    assert (tmp_path / "mp.png").stat().st_size > 1000


def test_bad_plans_are_one_line_errors(tmp_path: Path, chain_file: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(["F_all 1", "B 1"]))
    assert main(["show", str(bad), "--chain", str(chain_file)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and len(err.strip().splitlines()) == 1
    bad.write_text("{}")
    with pytest.raises(PlanError):
        read_plan_file(bad)
    assert main(["show", str(bad), "--chain", str(chain_file), "-o",
                 str(tmp_path / "x.txt")]) == 2


@pytest.mark.parametrize("option, value", [("--memory", "1.5"), ("--memory", "-1"),
                                           ("--bandwidth", "fast"), ("--bandwidth", "-2")])
def test_a_bad_option_value_names_the_option(tmp_path: Path, chain_file: Path, option: str,
                                             value: str, capsys) -> None:
    """CONTRACT section 14: errors name the field as given (``--memory``, as ``solve``);
    ``show`` said ``field 'memory'`` / ``field 'bandwidth'``."""
    plan = tmp_path / "ops.json"
    plan.write_text(json.dumps(["F_all 1", "F_all 2", "F_all 3", "F_all 4", "F_all 5",
                                "F_all 6", "Loss", "B 6", "B 5", "B 4", "B 3", "B 2", "B 1"]))
    assert main(["show", str(plan), "--chain", str(chain_file), f"{option}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"field '{option}'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ops.png").exists()


def test_offload_plan_two_lanes(tmp_path: Path) -> None:
    chain = Chain.from_lists([2, 2], [4, 4], [2, 2], [4, 4], input_size=2)
    ops = ["F_all 1", "offload a 0", "F_all 2", "Loss", "B 2", "prefetch a 0", "B 1"]
    assert is_offload_plan(ops) and not is_offload_plan(["F_all 1"])
    data = {"plan": ops, "memory_limit": 12, "unit": 1}
    info = show_plan(chain, data, tmp_path / "o.png", chain_bandwidth=1.0)
    assert (info["kind"], info["makespan"], info["peak_memory"]) == ("offload", 14.0, 12)
    assert (tmp_path / "o.png").stat().st_size > 1000
    with pytest.raises(OptmemInputError):
        show_plan(chain, data, tmp_path / "o2.png")


def test_a_solve_files_bandwidth_is_in_chain_units(tmp_path: Path) -> None:
    """``report.bandwidth`` of ``solve --json`` is in chain units (per ms); it was parsed
    as bytes per second, so ``optmem show result.json`` drew an offload plan of 137.8 ms
    with a link 1000x slower: 112,140 ms (a hunt in stop 51). A rate string still works,
    and a pipeline file is one clear error (it said "unknown op kind 'period'")."""
    from optmem.datasets import load_dataset
    from optmem.problems import OffloadProblem
    from optmem.solvers.facade import solve

    chain = load_dataset("resnet-like-40")
    result = solve(OffloadProblem(chain, 800 * 2**20, bandwidth="12GB/s"), "dp")
    data = result.to_json()
    assert data["report"]["bandwidth"] == pytest.approx(1.2e7)  # bytes per ms
    info = show_plan(chain, data, tmp_path / "r.png")
    assert info["makespan"] == pytest.approx(result.objective)
    as_rate = {**data, "bandwidth": "12GB/s"}
    assert show_plan(chain, as_rate, tmp_path / "s.png")["makespan"] == pytest.approx(
        result.objective)
    pipeline = {"problem": "pipeline", "plan": ["period 2", "stage 1 layers 1-1 gpu 0"]}
    with pytest.raises(PlanError, match="not pipeline plans"):
        show_plan(chain, pipeline, tmp_path / "p.png")


def _solved(tmp_path: Path, problem: str, *argv: str) -> Path:
    out = tmp_path / f"{problem}.json"
    assert main(["solve", problem, *argv, "--json", "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("problem, argv, lower", [
    ("checkpoint", ["--memory", "700MB"], "300MB"),
    ("min-peak", [], "100MB"),
    ("offload", ["--memory", "800MiB", "--bandwidth", "12GB/s"], "300MB"),
    ("remat-offload", ["--memory", "500MiB", "--bandwidth", "12GB/s"], "200MiB"),
])
def test_a_plan_above_the_limit_is_drawn_with_a_warning_for_every_problem(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str, argv: list[str],
        lower: str) -> None:
    """One rule for every problem (stop 53): ``show`` drew a checkpoint plan whose peak is
    above ``--memory`` in silence and refused an offload plan in the same case (exit 2,
    "op 6: F_all 5 needs 181 memory, above the limit 178"). Now a plan that fits the limit
    is replayed under it (as solved); one that does not is drawn as replayed without it,
    with one warning line naming the first op above it, exit 0, for each problem."""
    plan = _solved(tmp_path, problem, "resnet-like-40", *argv)
    capsys.readouterr()
    assert main(["show", str(plan), "--chain", "resnet-like-40", "-o",
                 str(tmp_path / "fits.png")]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "above the limit" not in out
    assert main(["show", str(plan), "--chain", "resnet-like-40", "--memory", lower, "-o",
                 str(tmp_path / "above.png")]) == 0
    out, err = capsys.readouterr()
    assert "(above the limit)" in out and (tmp_path / "above.png").stat().st_size > 1000
    assert len(err.strip().splitlines()) == 1 and err.startswith("optmem: warning: ")
    assert "does not fit the limit" in err and "op " in err
    data = read_plan_file(plan)
    info = show_plan(_bundled(), data, tmp_path / "api.png", memory_limit=_limit(lower),
                     bandwidth="12GB/s" if "--bandwidth" in argv else None)
    assert info["above_limit"] is not None and info["peak_memory"] > info["memory_limit"]


def _bundled() -> Chain:
    from optmem.datasets import load_dataset

    return load_dataset("resnet-like-40")


def _limit(text: str) -> int:
    from optmem.units import parse_size

    return parse_size(text)


def test_an_offload_plan_above_the_limit_is_drawn_as_replayed_without_it(
        tmp_path: Path) -> None:
    chain = Chain.from_lists([2, 2], [4, 4], [2, 2], [4, 4], input_size=2)
    ops = ["F_all 1", "offload a 0", "F_all 2", "Loss", "B 2", "prefetch a 0", "B 1"]
    fits = show_plan(chain, {"plan": ops, "memory_limit": 12, "unit": 1}, tmp_path / "a.png",
                     chain_bandwidth=1.0)
    assert fits["above_limit"] is None and fits["peak_memory"] == 12
    above = show_plan(chain, {"plan": ops, "memory_limit": 11, "unit": 1},
                      tmp_path / "b.png", chain_bandwidth=1.0)
    assert above["peak_memory"] > above["memory_limit"] == 11
    assert "above the limit 11" in above["above_limit"]
    with pytest.raises(PlanError):  # a plan invalid in itself is still refused
        show_plan(chain, {"plan": ops[:-1] + ["B 2"], "memory_limit": 11, "unit": 1},
                  tmp_path / "c.png", chain_bandwidth=1.0)


def test_show_takes_the_link_in_chain_units(tmp_path: Path, capsys) -> None:
    """``--chain-bandwidth`` (stop 53): the link in memory units per chain time unit, as
    ``solve``'s, exclusive with ``--bandwidth``, its value checked as ``--bandwidth``'s."""
    plan = _solved(tmp_path, "offload", "resnet-like-40", "--memory", "800MiB",
                   "--chain-bandwidth", "1.2e7")
    data = json.loads(plan.read_text())
    capsys.readouterr()
    (tmp_path / "ops.json").write_text(json.dumps({**data, "report": {}}))  # no bandwidth
    assert main(["show", str(tmp_path / "ops.json"), "--chain", "resnet-like-40",
                 "--chain-bandwidth", "1.2e7"]) == 0
    assert f"makespan {data['objective']:.6g}" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "ops.json"), "--chain", "resnet-like-40"]) == 2
    assert "--chain-bandwidth" in capsys.readouterr().err
    for extra in (["--chain-bandwidth", "12GB/s"], ["--chain-bandwidth=-1e-9"],
                  ["--chain-bandwidth", "1", "--bandwidth", "1GB/s"]):
        assert main(["show", str(tmp_path / "ops.json"), "--chain", "resnet-like-40",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert "field '--chain-bandwidth'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("field, value", [("method", "dp \udcff"), ("problem", "a\x07"),
                                          ("method", 5)])
def test_a_plan_files_text_fields_are_checked(tmp_path: Path, chain_file: Path, field: str,
                                              value: object, capsys) -> None:
    """Fuzz seed 5 (stop 53): a plan file whose ``method`` held an unpaired surrogate
    (``"\\udcff"`` in its JSON) reached the figure's title and matplotlib raised a
    ``TypeError`` traceback (7 of 3,000 cases). Now one error naming the file and field."""
    plan = tmp_path / "p.json"
    ops = ["F_all 1", "F_all 2", "F_all 3", "F_all 4", "F_all 5", "F_all 6", "Loss", "B 6",
           "B 5", "B 4", "B 3", "B 2", "B 1"]
    plan.write_text(json.dumps({"plan": ops, field: value}))
    assert main(["show", str(plan), "--chain", str(chain_file)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"field '{field}'" in err and "p.json" in err
    assert not (tmp_path / "p.png").exists()
