"""The CLI keeps CONTRACT section 4: JSON fields, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets.synthetic import random_chain

CONTRACT_FIELDS = {"problem", "method", "variant", "status", "objective", "peak_memory",
                   "memory_limit", "unit", "plan", "solve_time_s", "bound"}


@pytest.fixture
def chain_file(tmp_path: Path) -> Path:
    path = tmp_path / "h1.json"
    Chain.from_rotor([2, 3, 1, 4], [3, 5, 2, 6, 0], [2, 3, 1, 2, 3], [2, 5, 2, 4, 5],
                     [1, 0, 2, 1], [1, 2, 0, 1, 0], name="H1").save(path)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_solve_json_matches_contract(capsys, chain_file):
    code, out, err = run(capsys, "solve", "checkpoint", str(chain_file), "--memory", "16",
                         "--json")
    assert code == 0, err
    data = json.loads(out)  # exactly one JSON object
    assert set(data) >= CONTRACT_FIELDS
    assert data["status"] == "optimal" and data["objective"] == 32.0
    assert data["bound"] == 32.0 and data["variant"] == "paper" and data["unit"] == 1
    assert data["peak_memory"] <= data["memory_limit"] == 16
    assert data["plan"] == ["F_ck 1", "F_none 2", "F_ck 3", "F_all 4", "Loss", "B 4",
                            "F_all 3", "B 3", "F_all 1", "F_all 2", "B 2", "B 1"]


def test_rotor_and_floating_variants(capsys, chain_file):
    for variant in ("rotor", "floating"):
        code, out, _ = run(capsys, "solve", "checkpoint", str(chain_file), "-m", "20",
                           "--variant", variant, "--json")
        assert code == 0 and json.loads(out)["objective"] == 29.0


def test_infeasible_exits_zero_and_names_smallest_memory(capsys, chain_file):
    code, out, _ = run(capsys, "solve", "checkpoint", str(chain_file), "-m", "14", "--json")
    data = json.loads(out)
    assert code == 0 and data["status"] == "infeasible"
    assert data["min_feasible_memory"] == 15 and data["plan"] == []


def _solve_then_verify(capsys, chain_file, tmp_path) -> None:
    """Solve checkpoint at 18, write the plan, and verify it (objective 31)."""
    plan = tmp_path / "plan.json"
    code, _, _ = run(capsys, "solve", "checkpoint", str(chain_file), "-m", "18", "-o", str(plan))
    assert code == 0
    code, out, _ = run(capsys, "verify", "checkpoint", str(chain_file), str(plan), "-m", "18",
                       "--json")
    assert code == 0 and json.loads(out)["objective"] == 31.0


def test_verify_accepts_solve_output(capsys, chain_file, tmp_path):
    _solve_then_verify(capsys, chain_file, tmp_path)


def test_verify_checks_the_recorded_settings_once(capsys, chain_file, tmp_path,
                                                  monkeypatch):
    import optmem.simulate.verify as verify_module
    calls: list[object] = []
    real = verify_module.settings_as_solved

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_module, "settings_as_solved", counted)
    _solve_then_verify(capsys, chain_file, tmp_path)
    assert len(calls) == 1


def test_verify_warns_when_its_slots_give_another_unit(capsys, chain_file, tmp_path):
    """A result solved with --slots 7 (unit 2) replayed with the default slots (unit 1) was
    accepted without a word (the stop-52 hunt): now one warning line on stderr."""
    plan = tmp_path / "plan.json"
    code, _, _ = run(capsys, "solve", "checkpoint", str(chain_file), "-m", "20", "--slots", "7",
                     "-o", str(plan))
    assert code == 0 and json.loads(plan.read_text())["unit"] == 2
    code, out, err = run(capsys, "verify", "checkpoint", str(chain_file), str(plan), "-m", "20",
                         "--json")
    assert code == 0 and json.loads(out)["unit"] == 1
    assert "was solved with unit 2" in err and len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, "verify", "checkpoint", str(chain_file), str(plan), "-m", "20",
                         "--slots", "7", "--json")
    assert code == 0 and json.loads(out)["unit"] == 2 and err == ""


def test_verify_rejects_over_limit_plan_with_index(capsys, chain_file, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(["F_all 1", "F_all 2", "F_all 3", "F_all 4", "Loss", "B 4",
                                "B 3", "B 2", "B 1"]))
    code, out, err = run(capsys, "verify", "checkpoint", str(chain_file), str(plan), "-m", "20")
    assert code == 2 and out == ""
    assert "op 4: Loss needs 21" in err and "above the limit 20" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("mutation, needle", [
    (lambda d: d["stages"][1].pop("bwd_time"), "stage 2, field 'bwd_time'"),
    (lambda d: d["stages"][0].update(output_size=-3), "stage 1, field 'output_size'"),
    (lambda d: d["stages"][2].update(saved_size=0), "stage 3, field 'saved_size'"),
    (lambda d: d["stages"][3].update(fwd_time=float("nan")), "stage 4, field 'fwd_time'"),
    (lambda d: d.update(format="rotor/1"), "field 'format'"),
])
def test_malformed_chain_one_line_exit_2(capsys, chain_file, tmp_path, mutation, needle):
    data = json.loads(chain_file.read_text())
    mutation(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    code, out, err = run(capsys, "solve", "checkpoint", str(bad), "-m", "20", "--json")
    assert code == 2 and out == ""
    assert needle in err and str(bad) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["solve", "checkpoint", "CHAIN", "-m", "16", "--method", "nope"], "unknown method 'nope'"),
    (["solve", "checkpoint", "CHAIN", "-m", "-5"], "memory"),
    (["solve", "checkpoint", "CHAIN", "-m", "lots"], "expected a size"),
    (["solve", "nope", "CHAIN", "-m", "16"], "unknown problem 'nope'"),
    (["solve", "checkpoint", "no-such-dataset", "-m", "16"], "no chain file or bundled"),
    (["solve", "checkpoint", "CHAIN", "-m", "16", "--variant", "magic"], "unknown dp variant"),
    (["solve", "checkpoint", "CHAIN", "-m", "16", "--slots", "0"], "slots"),
    (["solve", "checkpoint"], "required"),
    (["solve", "remat-offload", "CHAIN", "-m", "16", "--bandwidth", "1", "--method",
      "autocapper", "--option", f"autocapper_values={2**70}"], "autocapper_values at most"),
])
def test_bad_arguments_one_line_exit_2(capsys, chain_file, argv, needle):
    argv = [str(chain_file) if a == "CHAIN" else a for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_not_json_chain_file(capsys, tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "solve", "checkpoint", str(bad), "-m", "16")
    assert code == 2 and "not valid JSON" in err and "Traceback" not in err


def test_no_output_file_written_on_error(capsys, tmp_path, chain_file):
    out_file = tmp_path / "out.json"
    code, _, _ = run(capsys, "solve", "checkpoint", str(chain_file), "-m", "16", "--method",
                     "nope", "-o", str(out_file))
    assert code == 2 and not out_file.exists()


def test_compare_json_lists_every_method(capsys, chain_file):
    code, out, _ = run(capsys, "compare", "checkpoint", str(chain_file), "-m", "17",
                       "--methods", "dp,dp:rotor,brute,chen,store_all", "--json")
    assert code == 0
    results = json.loads(out)["results"]
    assert [r["method"] for r in results] == ["dp", "dp", "brute", "chen", "store_all"]
    by = {(r["method"], r["variant"]): r for r in results}
    assert by[("brute", None)]["objective"] <= by[("dp", "paper")]["objective"]
    assert by[("store_all", None)]["status"] == "infeasible"


def test_compare_summary_dp_against_the_exact_bound(capsys, chain_file):
    """Issue 15 item 5: DP value, proven optimum and the DP's gap, text and JSON."""
    code, out, _ = run(capsys, "compare", "checkpoint", str(chain_file), "-m", "17",
                       "--methods", "dp,brute,chen", "--json")
    assert code == 0
    data = json.loads(out)
    by = {r["method"]: r for r in data["results"]}
    summary = data["summary"]
    assert summary["dp_method"] == "dp" and summary["dp"] == by["dp"]["objective"]
    assert summary["bound_method"] == "brute" and summary["bound"] == by["brute"]["bound"]
    assert summary["optimum"] == by["brute"]["objective"]
    dp, bound = summary["dp"], summary["bound"]
    assert summary["gap"] == pytest.approx(max(0.0, (dp - bound) / dp))
    code, out, _ = run(capsys, "compare", "checkpoint", str(chain_file), "-m", "17",
                       "--methods", "dp,chen")
    assert code == 0 and f"DP (dp) {dp:.6g}; no exact model ran" in out


def test_compare_summary_ignores_bounds_of_other_models(capsys, tmp_path):
    """The contiguous pipeline DP's bound holds among contiguous plans only: not used."""
    path = tmp_path / "c.json"
    random_chain(4, seed=3).save(path)
    code, out, _ = run(capsys, "compare", "pipeline", str(path), "-m", "1000000",
                       "--gpus", "2", "--methods", "contiguous,ilp", "--json")
    assert code == 0
    data = json.loads(out)
    ilp = next(r for r in data["results"] if r["method"] == "ilp")
    assert data["summary"]["dp_method"] == "contiguous"
    assert data["summary"]["bound_method"] == "ilp"
    assert data["summary"]["bound"] == ilp["bound"]


def test_compare_summary_ignores_restricted_variants():
    """A persistent-variant bound holds for persistent plans only: never the summary's bound.

    Results made by hand (the persistent optimum above the full one) so the check can fail.
    """
    from optmem.cli import dp_summary
    from optmem.result import Result, Status

    rows = [Result("checkpoint", "dp", Status.OPTIMAL, objective=110.0, bound=110.0,
                   variant="paper"),
            Result("checkpoint", "ilp", Status.OPTIMAL, objective=100.0, bound=100.0,
                   variant="full"),
            Result("checkpoint", "ilp", Status.OPTIMAL, objective=110.0, bound=110.0,
                   variant="persistent")]
    summary = dp_summary(rows)
    assert summary["bound"] == 100.0 and summary["bound_method"] == "ilp:full"
    assert summary["optimum"] == 100.0
    assert summary["gap"] == pytest.approx(10 / 110)
    assert dp_summary(rows[:1] + rows[2:])["bound"] is None


def test_memory_with_units_and_bundled_dataset(capsys):
    code, out, _ = run(capsys, "solve", "checkpoint", "resnet-like-40", "-m", "1GiB", "--json")
    data = json.loads(out)
    assert code == 0 and data["status"] == "optimal" and data["unit"] == 2**30 // 500


def test_datasets_list_and_path(capsys):
    code, out, _ = run(capsys, "datasets", "list", "--json")
    names = [row["name"] for row in json.loads(out)]
    assert code == 0 and "resnet-like-40" in names
    rows = {row["name"]: row for row in json.loads(out)}
    # the parameter count is a number in the JSON ("25.6M" until stop 52), text beside it
    assert rows["resnet50-b32-224"]["parameters"] == 25557032
    assert rows["resnet50-b32-224"]["parameters_h"] == "25.6M"
    assert rows["resnet-like-40"]["parameters"] is None
    code, out, _ = run(capsys, "datasets", "path", "resnet-like-40")
    assert code == 0 and Path(out.strip()).exists()


def test_datasets_table_cuts_descriptions_between_words(capsys):
    """The text table shortens each description to 60 characters at a word, with "...";
    it cut inside a word before ("float32" as "float3"), and padded every line with
    trailing blanks."""
    code, out, _ = run(capsys, "datasets", "list")
    rows = {row["name"]: row["description"]
            for row in json.loads(run(capsys, "datasets", "list", "--json")[1])}
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[0] == "name" and len(lines) == len(rows) + 1
    for line in lines[1:]:
        name = line.split()[0]
        shown = line[lines[0].index("description"):]
        assert line == line.rstrip() and len(shown) <= 60
        full = rows[name]
        assert shown == full or (shown.endswith("...") and full.startswith(shown[:-3])
                                 and full[len(shown) - 3] == " ")


def test_python_dash_m_entry_point(tmp_path):
    path = tmp_path / "c.json"
    random_chain(4, seed=3).save(path)
    proc = subprocess.run([sys.executable, "-m", "optmem", "solve", "checkpoint", str(path),
                           "-m", "1", "--json"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "infeasible"


def test_demo_compares_and_proves(capsys):
    code, out, _ = run(capsys, "demo", "--chain", "resnet-like-40")
    assert code == 0
    assert out.count("== memory limit") == 3 and "== exact check" in out
    exact = out.split("== exact check")[1]
    rows = {line.split()[0]: line.split() for line in exact.splitlines()[3:8]}
    assert rows["ilp:full"][1] == "optimal" and rows["dp"][1] == "optimal"
    assert float(rows["ilp:full"][2]) <= float(rows["dp"][2])


def test_option_flags_reach_the_method(capsys, tmp_path):
    """``--option KEY=VALUE`` is ``SolveOptions.extra``: the CLI accepts what the API does.

    That the value reaches the method is shown by ``strategy=nonsense`` failing below.
    """
    path = tmp_path / "c.json"
    random_chain(4, seed=3).save(path)
    base = ("solve", "pipeline", str(path), "-m", "1000000", "--gpus", "2", "--method",
            "cpsat", "--deterministic-time", "5", "--json")
    code, out, _ = run(capsys, *base, "--option", "strategy=benders")
    assert code == 0
    data = json.loads(out)
    # this chain has a layer without forward time: its own unit under stash (no merged class)
    assert data["status"] == "optimal" and "merged_units" not in data["report"]
    code, plain, _ = run(capsys, *base)
    assert code == 0 and json.loads(plain)["objective"] == data["objective"]


@pytest.mark.parametrize("flag, words", [
    ("strategy", "KEY=VALUE"),
    ("stratgy=benders", "strategy"),
    ("strategy=nonsense", "strategy"),
    ("colocate_order=spiral", "colocate_order"),
])
def test_bad_option_flags_exit_2_with_one_line(capsys, tmp_path, flag, words):
    path = tmp_path / "c.json"
    random_chain(4, seed=3).save(path)
    code, out, err = run(capsys, "solve", "pipeline", str(path), "-m", "1000000", "--gpus",
                         "2", "--method", "cpsat", "--option", flag)
    assert code == 2 and out == ""
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("percent", ["60%", "100%", "37.5%", "250%"])
def test_memory_as_a_percentage_of_store_all(capsys, chain_file, percent):
    peak = Chain.load(chain_file).store_all_peak()
    limit = int(float(percent[:-1]) * peak) // 100
    code, out, err = run(capsys, "solve", "checkpoint", str(chain_file), "-m", percent, "--json")
    by_percent = json.loads(out)
    code2, out2, _ = run(capsys, "solve", "checkpoint", str(chain_file), "-m", str(limit),
                         "--json")
    by_bytes = json.loads(out2)
    assert code == code2 == 0, err
    assert by_percent["memory_limit"] == by_bytes["memory_limit"] == limit
    for key in ("status", "objective", "plan", "peak_memory"):
        assert by_percent[key] == by_bytes[key]


@pytest.mark.parametrize(("argv", "needle"), [
    (["solve", "checkpoint", "{chain}", "-m", "0%"], "percentage of the store-all peak"),
    (["solve", "checkpoint", "{chain}", "-m", "x%"], "percentage of the store-all peak"),
    (["solve", "checkpoint", "{chain}", "--memory=-5%"], "percentage of the store-all peak"),
    (["solve", "pipeline", "{chain}", "--gpus", "2", "-m", "50%"], "give the pipeline problem"),
    (["solve", "min-peak", "{chain}", "-m", "50%"], "give the min-peak problem"),
])
def test_bad_percentages_exit_2_with_one_line(capsys, chain_file, argv, needle):
    code, out, err = run(capsys, *[a.format(chain=chain_file) for a in argv])
    assert code == 2 and out == ""
    assert needle in err and "--memory" in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_compare_summary_of_an_infeasible_limit_names_the_proof(capsys):
    """Exact models that prove the limit infeasible are named in the summary. Before, their
    infinite bounds were dropped and the line said "no exact model ran (...: name them with
    --methods)" although they had been named and had run."""
    code, out, _ = run(capsys, "compare", "checkpoint", "resnet18-b64-224", "--memory", "60%",
                       "--methods", "dp,ilp")
    assert code == 0
    assert out.strip().splitlines()[-1] == \
        "no DP plan; no plan fits the limit (proven infeasible by ilp:full)"
    code, out, _ = run(capsys, "compare", "checkpoint", "resnet18-b64-224", "--memory", "60%",
                       "--methods", "dp,ilp", "--json")
    assert json.loads(out)["summary"]["infeasible"] == "ilp:full"


@pytest.mark.parametrize("problem, options", [
    ("checkpoint", ["-m", "30"]),
    ("offload", ["-m", "30", "--bandwidth", "1000"]),
    ("remat-offload", ["-m", "30", "--bandwidth", "1000"]),
    ("pipeline", ["-m", "200", "--gpus", "2"]),
    ("min-peak", []),
])
def test_verify_json_has_the_contract_fields_for_every_problem(capsys, chain_file, tmp_path,
                                                               problem, options):
    """CONTRACT section 6: ``verify --json`` prints ``valid``, ``objective``, ``peak_memory``,
    ``memory_limit`` and ``unit`` for every problem (min-peak and pipeline had no ``unit``)."""
    plan = tmp_path / "plan.json"
    code, _, err = run(capsys, "solve", problem, str(chain_file), *options, "-o", str(plan))
    assert code == 0, err
    solved = json.loads(plan.read_text())
    code, out, err = run(capsys, "verify", problem, str(chain_file), str(plan), *options,
                         "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) >= {"valid", "objective", "peak_memory", "memory_limit", "unit"}
    assert data["unit"] == solved["unit"] and data["peak_memory"] == solved["peak_memory"]


def test_datasets_show_and_path_take_a_chain_file_as_chain_does(capsys, chain_file):
    """``datasets show small.json`` said "no chain file or bundled dataset named
    'small.json'" for a chain file that exists; NAME is now read as CHAIN is."""
    code, out, err = run(capsys, "datasets", "show", str(chain_file), "--json")
    assert code == 0, err
    row = json.loads(out)
    chain = Chain.load(chain_file)
    assert row["stages"] == chain.length and row["store_all"] == chain.store_all_peak()
    assert row["min_feasible"] == 15  # as test_infeasible_exits_zero_and_names_smallest_memory
    code, out, err = run(capsys, "datasets", "path", str(chain_file))
    assert code == 0 and Path(out.strip()) == chain_file.resolve()
    missing = chain_file.with_name("missing.json")
    code, out, err = run(capsys, "datasets", "show", str(missing))
    assert code == 2 and "missing.json: cannot read chain file" in err


def test_demo_takes_a_chain_file(capsys, chain_file):
    code, out, err = run(capsys, "demo", "--chain", str(chain_file), "--exact-chain",
                         str(chain_file), "--time-limit", "5")
    assert code == 0, err
    assert out.startswith("optmem demo: H1, 4 stages") and "exact check: H1" in out


@pytest.mark.parametrize("argv", [
    ["solve", "checkpoint", "{chain}", "-m", "18", "--method", "ilp"],
    ["solve", "checkpoint", "{chain}", "-m", "18", "--method", "cpsat"],
    ["compare", "checkpoint", "{chain}", "-m", "18", "--methods", "dp,ilp,cpsat"],
])
def test_json_with_verbose_prints_one_json_object_on_stdout(chain_file, argv):
    """CONTRACT section 4: ``--json`` prints exactly one JSON object on stdout. HiGHS and
    CP-SAT logged (``--verbose``) from C++ to stdout before it (the output did not parse);
    their logs now go to stderr under ``--json``."""
    cmd = [sys.executable, "-m", "optmem", *(a.format(chain=chain_file) for a in argv),
           "--threads", "1", "--verbose", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1
    json.loads(proc.stdout)
    assert proc.stderr.strip()  # the engine logs, on stderr


@pytest.mark.parametrize("limit", ["0", "-1", "nan"])
def test_demo_refuses_a_bad_time_limit_before_any_output(capsys, chain_file, limit):
    """``demo --time-limit 0`` ran with the default 20 s; -1 and nan exited 2 after the
    first lines of the demo. Now one line and exit 2 before anything, as ``solve``."""
    code, out, err = run(capsys, "demo", "--chain", str(chain_file), f"--time-limit={limit}")
    assert code == 2 and out == ""
    assert "--time-limit" in err and len(err.strip().splitlines()) == 1


def test_datasets_show_prints_sizes_in_the_chains_memory_unit(capsys, tmp_path):
    """A chain in ``KiB``: ``store_all_h`` said ``19 B`` for 19 KiB."""
    chain = Chain.from_rotor([2, 3, 1, 4], [3, 5, 2, 6, 0], [2, 3, 1, 2, 3], [2, 5, 2, 4, 5],
                             [1, 0, 2, 1], [1, 2, 0, 1, 0], name="H1")
    path = tmp_path / "kib.json"
    path.write_text(json.dumps({**chain.to_dict(), "memory_unit": "KiB"}))
    code, out, err = run(capsys, "datasets", "show", str(path), "--json")
    assert code == 0, err
    row = json.loads(out)
    assert row["store_all_h"] == f"{chain.store_all_peak()} KiB"
    assert row["min_feasible_h"] == "15 KiB"


def test_solve_text_prints_sizes_in_the_chains_memory_unit(capsys, tmp_path):
    """The text output put sizes of a ``KiB`` chain in bytes: ``(14 B)`` for 14 KiB."""
    chain = Chain.from_rotor([2, 3, 1, 4], [3, 5, 2, 6, 0], [2, 3, 1, 2, 3], [2, 5, 2, 4, 5],
                             [1, 0, 2, 1], [1, 2, 0, 1, 0], name="H1")
    path = tmp_path / "kib.json"
    path.write_text(json.dumps({**chain.to_dict(), "memory_unit": "KiB"}))
    code, out, err = run(capsys, "solve", "checkpoint", str(path), "-m", "18")
    assert code == 0, err
    assert "units of 1 KiB (18 KiB)" in out or "units of 1 KiB (17 KiB)" in out
    assert " B)" not in out
    code, out, err = run(capsys, "solve", "checkpoint", str(path), "-m", "14")
    assert "smallest feasible memory: 15 KiB (15 KiB)" in out


# ------------------------------------------------------------------ stop 53: variants
@pytest.mark.parametrize("argv", [
    ["--method", "chen:rotor"], ["--method", "chen", "--variant", "rotor"],
    ["--method", "store_all:x"], ["--method", "ilp:rotor"], ["--variant", "paperr"],
])
def test_a_variant_the_method_lacks_exits_2_naming_the_method(capsys, chain_file, argv):
    """``--method chen:rotor`` and ``--method chen --variant X`` ran ``chen`` (exit 0) until
    stop 53: a method without variants ignored any. Now one error naming the method and
    the variants of the problem's methods (each method declares its own)."""
    code, out, err = run(capsys, "solve", "checkpoint", str(chain_file), "-m", "16", *argv)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "field 'variant'" in err
    method = argv[1].split(":")[0] if argv[0] == "--method" else "dp"
    assert f"'{method}'" in err or f"unknown {method} variant" in err
    assert "rotor" in err  # the list of variants that exist


def test_python_refuses_a_variant_the_method_lacks(chain_file):
    from optmem.errors import OptmemInputError
    from optmem.problems import CheckpointProblem, MinPeakProblem
    from optmem.solvers.facade import export, solve

    problem = CheckpointProblem(Chain.load(chain_file), 16)
    for method, kwargs in [("chen:rotor", {}), ("chen", {"variant": "rotor"}),
                           ("revolve", {"variant": "x"}), ("dp", {"variant": "persistent"})]:
        with pytest.raises(OptmemInputError, match="field 'variant'"):
            solve(problem, method, **kwargs)
    with pytest.raises(OptmemInputError, match="field 'variant'"):
        export(problem, "ilp:rotor", "m.lp")
    with pytest.raises(OptmemInputError, match="'ilp' of min-peak has no variants"):
        solve(MinPeakProblem(Chain.load(chain_file)), "ilp:quadratic")
    assert solve(problem, "dp", variant="").variant == "paper"  # empty: the default


def test_every_declared_variant_runs():
    """The registry's variants are what the methods accept: each one solves."""
    from optmem.problems import (
        CheckpointProblem,
        MinPeakProblem,
        OffloadProblem,
        RematOffloadProblem,
    )
    from optmem.solvers.facade import methods, solve
    from optmem.solvers.min_peak import DP_VARIANTS

    chain = random_chain(3, seed=1)
    peak = chain.store_all_peak()
    problems = [CheckpointProblem(chain, peak), OffloadProblem(chain, peak, "1GB/s"),
                RematOffloadProblem(chain, peak, "1GB/s")]
    for problem in problems:
        for name, info in methods(problem.name).items():
            for variant in info.variants:
                result = solve(problem, f"{name}:{variant}", time_limit_s=20)
                assert result.variant == variant and result.status.has_plan, (name, variant)
    declared = methods("min-peak")["dp"].variants
    assert set(declared) == {v for names in DP_VARIANTS.values() for v in names}
    for model, names in DP_VARIANTS.items():
        for variant in names:
            assert solve(MinPeakProblem(chain, model=model), f"dp:{variant}").status.has_plan
    assert [n for n, i in methods("pipeline").items() if i.variants] == []


def test_compare_applies_a_variant_to_the_methods_that_declare_it(capsys, chain_file):
    """``compare --variant rotor`` gave ``ilp`` an ``error`` row (``ilp:rotor``) and ran
    ``chen`` silently; now the variant reaches the methods that declare it, the others run
    their default, and a variant no compared method declares exits 2."""
    code, out, err = run(capsys, "compare", "checkpoint", str(chain_file), "-m", "16",
                         "--variant", "rotor", "--methods", "dp,chen,ilp", "--json")
    assert code == 0, err
    rows = {r["method"]: r for r in json.loads(out)["results"]}
    assert rows["dp"]["variant"] == "rotor" and rows["ilp"]["variant"] == "full"
    assert rows["chen"]["variant"] is None
    assert all(r["status"] != "error" for r in rows.values())
    code, out, err = run(capsys, "compare", "checkpoint", str(chain_file), "-m", "16",
                         "--variant", "persistent", "--methods", "dp,ilp", "--json")
    rows = {r["method"]: r for r in json.loads(out)["results"]}
    assert code == 0 and rows["dp"]["variant"] == "paper"
    assert rows["ilp"]["variant"] == "persistent"
    for argv in (["--variant", "rotor", "--methods", "chen,store_all"],
                 ["--variant", "bogus"], ["--methods", "dp,chen:rotor"],
                 ["--variant", "rotor", "--methods", "dp:floating,chen"]):
        code, out, err = run(capsys, "compare", "checkpoint", str(chain_file), "-m", "16",
                             *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, argv
        assert "field 'variant'" in err


def test_sweep_applies_a_variant_as_compare_does(capsys, chain_file, tmp_path):
    from optmem.errors import OptmemInputError
    from optmem.sweep import CheckpointFactory, sweep

    factory = CheckpointFactory(Chain.load(chain_file))
    result = sweep(factory, [16, 20], ["dp", "chen"], variant="rotor")
    assert {p.status for p in result.points} <= {"optimal", "feasible", "infeasible"}
    for methods, variant in ((["chen", "store_all"], "rotor"), (["chen:rotor"], None),
                             (["dp"], "bogus")):
        with pytest.raises(OptmemInputError, match="field 'variant'"):
            sweep(factory, [16], methods, variant=variant)
    code, _, err = run(capsys, "sweep", "checkpoint", str(chain_file), "-m", "16:20:2",
                       "--methods", "chen,store_all", "--variant", "rotor", "-q", "-j", "1")
    assert code == 2 and "field 'variant'" in err


# ------------------------------------------------------------------ stop 53: --chain-bandwidth
@pytest.fixture
def kib_chain(tmp_path: Path) -> tuple[Path, Chain]:
    """A chain in KiB and steps: no rate per second reaches it, only chain units."""
    import dataclasses

    chain = dataclasses.replace(
        Chain.from_lists([1.0, 2.0, 1.0], [2.0, 3.0, 2.0], [4, 6, 4], [8, 10, 6],
                         input_size=4, name="kib"), time_unit="step", memory_unit="KiB")
    path = tmp_path / "kib.json"
    chain.save(path)
    return path, chain


@pytest.mark.parametrize("problem, extra", [
    ("offload", []), ("remat-offload", []), ("pipeline", ["--gpus", "2"])])
def test_chain_bandwidth_on_the_cli_is_the_apis_chain_bandwidth(capsys, kib_chain, problem,
                                                                  extra):
    """A chain whose time unit is no time could get a link from Python only
    (``chain_bandwidth=``); ``--bandwidth`` exited 2. ``--chain-bandwidth X`` is that
    keyword on every command taking ``--bandwidth``, and gives the API's result."""
    from optmem.cli_problems import HOOKS
    from optmem.solvers.facade import solve

    path, chain = kib_chain
    memory = "40" if problem != "pipeline" else "100"
    base = [str(path), "-m", memory, *extra]
    code, _, err = run(capsys, "solve", problem, *base, "--bandwidth", "1GB/s")
    assert code == 2 and "time unit 'step'" in err
    assert "--chain-bandwidth" in err  # the flag that works, not only the Python keyword
    code, out, err = run(capsys, "solve", problem, *base, "--chain-bandwidth", "2.5", "--json")
    assert code == 0, err
    data = json.loads(out)
    import argparse

    args = argparse.Namespace(gpus=2, chain_bandwidth=None, bandwidth=None)
    cls = type(HOOKS[problem].from_cli(chain, int(memory), argparse.Namespace(
        **{**vars(args), "chain_bandwidth": "2.5"})))
    kwargs = {"n_gpus": 2, "memory_per_gpu": int(memory)} if problem == "pipeline" \
        else {"memory_limit": int(memory)}
    expected = solve(cls(chain, chain_bandwidth=2.5, **kwargs))
    assert (data["objective"], data["plan"]) == (expected.objective, list(expected.plan))
    for cmd in (["compare", problem, *base, "--methods", "dp" if problem != "pipeline"
                 else "contiguous"], ["sweep", problem, str(path), "-m", f"{memory}:{memory}:1",
                                      *extra, "-q", "-j", "1"]):
        code, _, err = run(capsys, *cmd, "--chain-bandwidth", "2.5")
        assert code == 0, (cmd, err)
    plan = path.parent / "r.json"
    plan.write_text(out)
    code, out, err = run(capsys, "verify", problem, *base, str(plan), "--chain-bandwidth",
                         "2.5", "--json")
    assert code == 0 and json.loads(out)["objective"] == pytest.approx(data["objective"])


@pytest.mark.parametrize("value, needle", [
    ("1GB/s", "expected a number of memory units per chain time unit"),
    ("-1", "non-negative"), ("nan", "expected a number"), ("inf", "expected a number"),
    ("1e-12", "too slow to model"), ("BOTH", "not both")])
def test_bad_chain_bandwidth_exits_2_naming_the_flag(capsys, kib_chain, value, needle):
    path, _ = kib_chain
    link = ["--chain-bandwidth", "2", "--bandwidth", "1GB/s"] if value == "BOTH" \
        else ["--chain-bandwidth", value]
    for command in ("solve", "compare"):
        code, out, err = run(capsys, command, "offload", str(path), "-m", "40", *link)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert "field '--chain-bandwidth'" in err and needle in err, err
    code, _, err = run(capsys, "solve", "pipeline", str(path), "-m", "100", "--gpus", "2",
                       "--chain-bandwidth", "0")
    assert code == 2 and "field '--chain-bandwidth'" in err and "positive" in err
    code, out, err = run(capsys, "solve", "pipeline", str(path), "-m", "100", "--gpus", "2",
                         "--chain-bandwidth", "inf", "--json")
    assert code == 0 and json.loads(out)["status"] == "optimal"
    code, _, err = run(capsys, "solve", "offload", str(path), "-m", "40")
    assert code == 2 and "--chain-bandwidth" in err


# ------------------------------------------------------------------ stop 53: problem options
@pytest.mark.parametrize("command, problem, argv, flag", [
    ("solve", "checkpoint", ["-m", "16", "--bandwidth", "12GB/s"], "--bandwidth"),
    ("solve", "checkpoint", ["-m", "16", "--gpus", "4"], "--gpus"),
    ("compare", "offload", ["-m", "16", "--bandwidth", "1", "--gpus", "2"], "--gpus"),
    ("solve", "min-peak", ["--chain-bandwidth", "2"], "--chain-bandwidth"),
    ("solve", "pipeline", ["-m", "100", "--gpus", "2", "--ignore-input"], "--ignore-input"),
    ("export", "checkpoint", ["-m", "16", "--model", "static", "-o", "{d}/m.lp"], "--model"),
    ("sweep", "checkpoint", ["-m", "16:20:2", "--memory-model", "strict", "-q"],
     "--memory-model"),
])
def test_an_option_of_another_problem_exits_2(capsys, chain_file, tmp_path, command, problem,
                                              argv, flag):
    """Every command lists every problem's options; one the problem does not read was
    ignored in silence until stop 53 (``solve checkpoint --bandwidth 12GB/s`` solved plain
    checkpointing, exit 0). Now one error naming the flag and the problems that take it."""
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    code, out, err = run(capsys, command, problem, str(chain_file), *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"field '{flag}'" in err and f"not of {problem}" in err
    assert list(tmp_path.iterdir()) == [chain_file]


def test_work_budget_flag_reaches_solve_compare_and_sweep(capsys, chain_file, tmp_path):
    """``--work-budget S``: the ``work_*`` report keys on every row, the budget in force."""
    base = ("checkpoint", str(chain_file), "--memory", "16")
    code, out, err = run(capsys, "solve", *base, "--method", "cpsat", "--work-budget", "5",
                         "--json")
    assert code == 0, err
    report = json.loads(out)["report"]
    assert report["work_budget"] == 5.0 and 0 < report["work_used"] <= 5.0
    assert report["work_calls"] >= 1 and report["work_exhausted"] is False
    code, out, err = run(capsys, "compare", *base, "--methods", "dp,cpsat",
                         "--work-budget", "inf", "--json")
    assert code == 0, err
    rows = json.loads(out)["results"]
    assert [r["report"]["work_budget"] for r in rows] == [None, None]  # inf: JSON null
    assert rows[0]["report"]["work_calls"] == 0 and rows[1]["report"]["work_calls"] >= 1
    path = tmp_path / "sweep.json"
    code, _, err = run(capsys, "sweep", *base[:2], "--memory", "14:16:2", "--methods",
                       "cpsat", "--work-budget", "5", "--json", str(path), "-q")
    assert code == 0, err
    points = json.loads(path.read_text())["points"]
    assert [p["status"] for p in points] == ["infeasible", "optimal"]
    assert points[0]["work_used"] is not None and 0 < points[1]["work_used"] <= 5.0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "ten"])
def test_bad_work_budgets_exit_2_naming_the_flag(capsys, chain_file, value):
    code, out, err = run(capsys, "solve", "checkpoint", str(chain_file), "--memory", "16",
                         "--method", "cpsat", "--work-budget", value)
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "work-budget" in lines[0], lines


@pytest.mark.parametrize("flag", ["--work-budget", "--deterministic-time"])
def test_a_refused_limit_names_what_the_cli_takes_for_no_limit(capsys, chain_file, flag):
    """``--work-budget nan`` said ``expected a positive number or None, got nan``: ``None``
    is Python's spelling, which the flag refuses (``invalid float value: 'None'``); stop 54's
    budget fuzz (630 command lines). The message now names ``inf`` too, which both take."""
    code, out, err = run(capsys, "solve", "checkpoint", str(chain_file), "--memory", "16",
                         "--method", "cpsat", flag, "nan")
    assert code == 2 and not out
    assert err.strip().splitlines() == [
        f"optmem: error: field '{flag}': expected a positive number (inf or None: no limit), "
        "got nan"]
    code, out, err = run(capsys, "solve", "checkpoint", str(chain_file), "--memory", "16",
                         "--method", "cpsat", flag, "inf", "--json")
    assert code == 0, err
