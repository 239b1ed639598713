"""``verify`` replays a result under the settings it was solved with (stop 55).

A pipeline result records in its ``report`` the settings of its memory check that differ
from their defaults (``memory_model``, ``temporaries``, ``weight_copies``, ``buffers``,
``chain_bandwidth``), a min-peak result its ``model`` and ``count_input``. Until stop 55
``optmem verify pipeline ... result.json`` without ``--temporaries`` (or ``--memory-model
strict``) replayed a plan solved with them under the weaker default model and said
``valid plan``. Now: a setting the command line leaves out is taken from the file
(``from_plan``), one it gives differently is one error (exit 2, field ``report.NAME``); in
Python ``verify_plan`` refuses a problem whose settings differ unless ``as_solved=True``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem import Chain, MinPeakProblem, OptmemInputError, PipelineProblem, solve
from optmem.cli import main
from optmem.simulate.verify import verify_plan


def chain() -> Chain:
    """Three layers with overheads (temporaries change the strict peaks)."""
    return Chain.from_lists(
        [1, 2, 1],
        [2, 2, 1],
        [3, 2, 4],
        [4, 2, 4],
        input_size=2,
        fwd_overhead=[2, 1, 3],
        bwd_overhead=[1, 2, 2],
        loss_bwd_overhead=5,
        name="T",
    )


@pytest.fixture
def chain_file(tmp_path):
    path = tmp_path / "t.json"
    chain().save(path)
    return path


def cli(capsys, *argv):  # noqa: ANN001, ANN201
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def solved(capsys, tmp_path, chain_file, *flags) -> tuple[dict, str]:
    """``solve pipeline --json`` on 2 GPUs, 1000 per GPU, with ``flags``; result and path."""
    code, out, err = cli(
        capsys, "solve", "pipeline", chain_file, "--gpus", 2, "-m", 1000, "--json", *flags
    )
    assert code == 0, err
    path = tmp_path / "result.json"
    path.write_text(out)
    return json.loads(out), str(path)


STRICT_T = ("--memory-model", "strict", "--temporaries")


# ------------------------------------------------------------------ what a result records
def test_a_result_records_the_settings_that_differ_from_the_defaults(capsys, tmp_path, chain_file):
    plain, _ = solved(capsys, tmp_path, chain_file)
    for key in ("memory_model", "temporaries", "weight_copies", "buffers", "chain_bandwidth"):
        assert key not in plain["report"]
    strict, _ = solved(capsys, tmp_path, chain_file, "--memory-model", "strict")
    assert strict["report"]["memory_model"] == "strict" and "temporaries" not in strict["report"]
    full, _ = solved(
        capsys, tmp_path, chain_file, *STRICT_T, "--weight-copies", 5, "--chain-bandwidth", 2
    )
    assert {
        k: full["report"][k]
        for k in ("memory_model", "temporaries", "weight_copies", "chain_bandwidth")
    } == {"memory_model": "strict", "temporaries": True, "weight_copies": 5, "chain_bandwidth": 2.0}


# ------------------------------------------------------------------ CLI: left out -> as solved
@pytest.mark.parametrize(
    "flags",
    [STRICT_T, ("--memory-model", "strict"), ("--weight-copies", "5"), ("--chain-bandwidth", "2")],
)
def test_verify_without_the_flags_replays_as_solved(capsys, tmp_path, chain_file, flags):
    """Fails before stop 55: the replay used the defaults (a smaller peak, no from_plan)."""
    result, path = solved(capsys, tmp_path, chain_file, *flags)
    code, out, err = cli(
        capsys, "verify", "pipeline", chain_file, path, "--gpus", 2, "-m", 1000, "--json"
    )
    assert code == 0 and err == "", err
    checked = json.loads(out)
    assert checked["peak_memory"] == result["peak_memory"]
    assert checked["objective"] == pytest.approx(result["objective"])
    recorded = {
        k: v
        for k, v in result["report"].items()
        if k in ("memory_model", "temporaries", "weight_copies", "chain_bandwidth")
    }
    assert recorded and checked["from_plan"] == recorded
    assert {k: checked[k] for k in recorded} == recorded
    code, out, err = cli(capsys, "verify", "pipeline", chain_file, path, "--gpus", 2, "-m", 1000)
    assert code == 0 and "valid plan" in out and "replayed as solved: " in out
    assert path in out.splitlines()[-1]


def test_the_flags_given_as_solved_take_nothing_from_the_plan(capsys, tmp_path, chain_file):
    _, path = solved(capsys, tmp_path, chain_file, *STRICT_T, "--weight-copies", 5)
    base = ("verify", "pipeline", chain_file, path, "--gpus", 2, "-m", 1000)
    code, out, err = cli(capsys, *base, *STRICT_T, "--weight-copies", 5, "--json")
    assert code == 0, err
    assert "from_plan" not in json.loads(out)
    # partly given: the rest comes from the plan
    code, out, err = cli(capsys, *base, "--memory-model", "strict", "--json")
    assert code == 0, err
    assert json.loads(out)["from_plan"] == {"temporaries": True, "weight_copies": 5}


def test_temporaries_alone_take_the_strict_model_from_the_plan(capsys, tmp_path, chain_file):
    """``--temporaries`` without ``--memory-model`` on a strict result: the model left out
    is the plan's (stop 55 review; before, the default ``stash`` refused the flag, naming no
    file). A bare plan records no model: still the refusal."""
    result, path = solved(capsys, tmp_path, chain_file, *STRICT_T, "--weight-copies", 5)
    base = ("verify", "pipeline", chain_file, path, "--gpus", 2, "-m", 1000, "--temporaries")
    code, out, err = cli(capsys, *base, "--json")
    assert code == 0, err
    checked = json.loads(out)
    assert checked["peak_memory"] == result["peak_memory"]
    assert checked["from_plan"] == {"memory_model": "strict", "weight_copies": 5}
    code, out, err = cli(capsys, *base)
    assert code == 0 and 'replayed as solved: memory_model "strict", weight_copies 5' in out
    code, out, err = cli(capsys, *base[:-2], result["peak_memory"] - 1, "--temporaries")
    assert code == 2 and "above the memory" in err and 'memory_model "strict"' in err
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps(result["plan"]))
    code, out, err = cli(capsys, *base[:3], ops, *base[4:])
    assert code == 2 and "field 'temporaries'" in err and "--memory-model strict" in err


def test_a_refusal_under_the_recorded_settings_says_so(capsys, tmp_path, chain_file):
    result, path = solved(capsys, tmp_path, chain_file, *STRICT_T)
    code, out, err = cli(
        capsys, "verify", "pipeline", chain_file, path, "--gpus", 2, "-m", result["peak_memory"] - 1
    )
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert (
        "above the memory" in err
        and 'replayed as solved: memory_model "strict", temporaries true' in err
    )


def test_the_ops_alone_replay_under_the_command_line(capsys, tmp_path, chain_file):
    result, path = solved(capsys, tmp_path, chain_file, *STRICT_T)
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps(result["plan"]))
    code, out, err = cli(
        capsys, "verify", "pipeline", chain_file, ops, "--gpus", 2, "-m", 1000, "--json"
    )
    assert code == 0, err
    checked = json.loads(out)
    assert "from_plan" not in checked and "memory_model" not in checked
    assert checked["peak_memory"] < result["peak_memory"]  # the stash model's


# ------------------------------------------------------------------ CLI: given otherwise -> 2
@pytest.mark.parametrize(
    ("solve_flags", "verify_flags", "field"),
    [
        (STRICT_T, ("--memory-model", "stash"), "report.memory_model"),
        (("--weight-copies", "5"), ("--weight-copies", "3"), "report.weight_copies"),
        (("--chain-bandwidth", "2"), ("--bandwidth", "inf"), "report.chain_bandwidth"),
        (("--chain-bandwidth", "2"), ("--chain-bandwidth", "3"), "report.chain_bandwidth"),
    ],
)
def test_a_flag_that_contradicts_the_plan_is_one_error(
    capsys, tmp_path, chain_file, solve_flags, verify_flags, field
):
    _, path = solved(capsys, tmp_path, chain_file, *solve_flags)
    code, out, err = cli(
        capsys, "verify", "pipeline", chain_file, path, "--gpus", 2, "-m", 1000, *verify_flags
    )
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"field '{field}'" in err and path in err and "Traceback" not in err
    assert "as_solved=True" in err and verify_flags[0] in err


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("memory_model", "weird", "unknown memory model"),
        ("temporaries", "yes", "expected True or False"),
        ("weight_copies", -1, "non-negative integer"),
        ("weight_copies", 1000, "at most 64"),
        ("chain_bandwidth", "x", "expected a number"),
        ("chain_bandwidth", 0, "positive bandwidth"),
        ("buffers", 1, "expected True or False"),
    ],
)
def test_a_bad_recorded_setting_is_one_error(capsys, tmp_path, chain_file, key, value, expected):
    result, path = solved(capsys, tmp_path, chain_file, *STRICT_T)
    result["report"][key] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(result))
    code, out, err = cli(capsys, "verify", "pipeline", chain_file, bad, "--gpus", 2, "-m", 1000)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"field 'report.{key}'" in err and expected in err and str(bad) in err
    with pytest.raises(OptmemInputError, match=expected) as exc:
        verify_plan(PipelineProblem(chain(), 2, 1000), result, as_solved=True)
    assert exc.value.field == f"report.{key}"


def test_temporaries_recorded_without_the_strict_model_is_one_error(capsys, tmp_path, chain_file):
    result, path = solved(capsys, tmp_path, chain_file, *STRICT_T)
    del result["report"]["memory_model"]
    Path(path).write_text(json.dumps(result))
    code, _, err = cli(capsys, "verify", "pipeline", chain_file, path, "--gpus", 2, "-m", 1000)
    assert code == 2 and "field 'report.temporaries'" in err and "strict" in err


def test_verify_of_another_problem_still_refuses_pipeline_flags(capsys, tmp_path, chain_file):
    _, path = solved(capsys, tmp_path, chain_file)
    code, _, err = cli(
        capsys, "verify", "checkpoint", chain_file, path, "-m", 40, "--memory-model", "strict"
    )
    assert code == 2 and "--memory-model is an option of pipeline" in err


# ------------------------------------------------------------------ min-peak
def test_min_peak_verify_takes_the_model_from_the_plan(capsys, tmp_path, chain_file):
    """Fails before stop 55: a 'static' result replayed under the 'pytorch' model."""
    code, out, err = cli(
        capsys, "solve", "min-peak", chain_file, "--model", "static", "--ignore-input", "--json"
    )
    assert code == 0, err
    path = tmp_path / "mp.json"
    path.write_text(out)
    result = json.loads(out)
    code, out, err = cli(capsys, "verify", "min-peak", chain_file, path, "--json")
    assert code == 0, err
    checked = json.loads(out)
    assert checked["from_plan"] == {"model": "static", "count_input": False}
    assert checked["model"] == "static" and checked["count_input"] is False
    assert checked["peak_memory"] == result["peak_memory"]
    code, out, err = cli(capsys, "verify", "min-peak", chain_file, path, "--model", "pytorch")
    assert code == 2 and out == "" and "field 'report.model'" in err


# ------------------------------------------------------------------ Python
def test_python_refuses_other_settings_unless_as_solved():
    problem = PipelineProblem(chain(), 2, 1000, memory_model="strict", temporaries=True)
    result = solve(problem).to_json()
    plain = PipelineProblem(chain(), 2, 1000)
    with pytest.raises(OptmemInputError, match="solved with memory_model 'strict'") as exc:
        verify_plan(plain, result)
    assert exc.value.field == "report.memory_model"
    checked = verify_plan(plain, result, as_solved=True)
    assert checked["from_plan"] == {"memory_model": "strict", "temporaries": True}
    assert checked["peak_memory"] == result["peak_memory"]
    assert "from_plan" not in verify_plan(problem, result)
    assert verify_plan(plain, result["plan"])["peak_memory"] < result["peak_memory"]


@pytest.mark.parametrize("flag", ["no", 1, None, "False"])
def test_as_solved_is_a_bool(flag):
    """``as_solved="no"`` replayed as solved (a truthy string); now one error (stop 55
    review)."""
    problem = PipelineProblem(chain(), 2, 1000, memory_model="strict")
    result = solve(problem).to_json()
    with pytest.raises(OptmemInputError, match="expected True or False") as exc:
        verify_plan(PipelineProblem(chain(), 2, 1000), result, as_solved=flag)
    assert exc.value.field == "as_solved"


def test_python_min_peak_refuses_another_model():
    result = solve(MinPeakProblem(chain(), model="static")).to_json()
    with pytest.raises(OptmemInputError) as exc:
        verify_plan(MinPeakProblem(chain()), result)
    assert exc.value.field == "report.model"
    assert verify_plan(MinPeakProblem(chain()), result, as_solved=True)["from_plan"] == {
        "model": "static"
    }


@settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    model=st.sampled_from(["stash", "strict", "strict+t"]),
    copies=st.integers(0, 5),
    beta=st.sampled_from([math.inf, 1.0, 2.5]),
    buffers=st.booleans(),
    gpus=st.integers(1, 3),
)
def test_as_solved_replays_every_recorded_setting(model, copies, beta, buffers, gpus):
    """Solved under random settings, replayed from the plain problem with as_solved: the
    result's period and peak, and from_plan = exactly its non-default settings."""
    problem = PipelineProblem(
        chain(),
        gpus,
        10_000,
        chain_bandwidth=beta,
        weight_copies=copies,
        memory_model=model.split("+")[0],
        buffers=buffers,
        temporaries=model.endswith("+t"),
    )
    result = solve(problem, "contiguous").to_json()
    assert result["status"] in ("optimal", "feasible")
    checked = verify_plan(PipelineProblem(chain(), gpus, 10_000), result, as_solved=True)
    assert checked["peak_memory"] == result["peak_memory"]
    assert checked["objective"] == pytest.approx(result["objective"], rel=1e-9)
    assert checked.get("from_plan", {}) == problem.settings_report()
    assert "from_plan" not in verify_plan(problem, result)


@pytest.mark.parametrize(
    ("problem", "flags"),
    [
        ("checkpoint", ["-m", "40"]),
        ("offload", ["-m", "40", "--bandwidth", "2"]),
        ("remat-offload", ["-m", "40", "--bandwidth", "2"]),
        ("min-peak", []),
        ("pipeline", ["--gpus", "2", "-m", "1000", "--weight-copies", "5"]),
    ],
)
def test_a_replay_that_differs_from_the_recorded_result_warns(
    capsys, tmp_path, chain_file, problem, flags
):
    """``verify`` of a result under its own settings gives its objective and peak back, in
    silence; under settings it does not record (a pipeline result written before stop 55
    has no ``weight_copies``), one warning line names both values (since stop 55; before,
    ``valid plan`` with another peak than the file's, in silence)."""
    code, out, err = cli(capsys, "solve", problem, chain_file, *flags, "--json")
    assert code == 0, err
    result = json.loads(out)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    code, out, err = cli(capsys, "verify", problem, chain_file, path, *flags)
    assert code == 0 and "valid plan" in out and err == "", err
    result["peak_memory"] += 1  # as a result solved under settings it does not record
    result["report"].pop("weight_copies", None)
    path.write_text(json.dumps(result))
    code, out, err = cli(capsys, "verify", problem, chain_file, path, *flags)
    assert code == 0 and "valid plan" in out
    assert err.count("\n") == 1 and "optmem: warning:" in err
    assert f"where it records {result['peak_memory']}" in err
