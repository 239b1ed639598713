"""The same input means the same thing on the command line and in Python (stop 55 hunt).

Each case was a place where one side accepted less than the other, or read the same text
another way: ``chain_bandwidth="2.5"`` (Python refused the text ``--chain-bandwidth 2.5``
takes), ``--methods ''`` (the CLI ran the default methods, Python refused an empty list),
``sweep(factory, "auto:20")`` and ``sweep(factory, limits)`` without methods (the CLI's
``--memory auto:20`` and default methods had no Python form), ``--time-limit 0`` (a second
check in the CLI, with its own wording). One parser serves both sides now.
"""

from __future__ import annotations

import json
import math

import pytest

from optmem import (
    Chain,
    CheckpointProblem,
    MinPeakProblem,
    OffloadProblem,
    OptmemInputError,
    PipelineProblem,
    PlanError,
    RematOffloadProblem,
    SolveOptions,
    compare,
    solve,
)
from optmem.cli import main
from optmem.simulate.verify import verify_plan
from optmem.solvers.facade import NO_METHODS
from optmem.sweep import CheckpointFactory, default_methods, sweep


def chain() -> Chain:
    return Chain.from_lists(
        [1.0, 2.0, 1.0, 3.0],
        [2.0, 3.0, 2.0, 4.0],
        [4, 6, 4, 5],
        [8, 10, 6, 7],
        input_size=4,
        name="par",
    )


@pytest.fixture
def chain_file(tmp_path):
    path = tmp_path / "par.json"
    chain().save(path)
    return str(path)


def run(capsys, *argv):  # noqa: ANN001, ANN201
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


LINKED = [
    (OffloadProblem, {"memory_limit": 40}),
    (RematOffloadProblem, {"memory_limit": 40}),
    (PipelineProblem, {"n_gpus": 2, "memory_per_gpu": 100}),
]


# ------------------------------------------------------------------ chain_bandwidth text
@pytest.mark.parametrize(("cls", "kwargs"), LINKED)
def test_python_reads_chain_bandwidth_text_as_the_cli_does(cls, kwargs):
    """Fails before: Python refused '2.5' ('expected a number ... got '2.5'')."""
    text = cls(chain(), chain_bandwidth="2.5", **kwargs)
    number = cls(chain(), chain_bandwidth=2.5, **kwargs)
    assert text.chain_bandwidth == 2.5 and text == number


@pytest.mark.parametrize(("cls", "kwargs"), LINKED)
@pytest.mark.parametrize("value", ["12GB/s", "x", "-1", "nan"])
def test_bad_chain_bandwidth_text_is_the_same_error_on_both_sides(
    capsys, chain_file, cls, kwargs, value
):
    with pytest.raises(OptmemInputError) as exc:
        cls(chain(), chain_bandwidth=value, **kwargs)
    assert exc.value.field == "chain_bandwidth"
    problem = {OffloadProblem: "offload", RematOffloadProblem: "remat-offload"}.get(cls, "pipeline")
    extra = ["--gpus", 2] if problem == "pipeline" else []
    memory = kwargs.get("memory_limit", kwargs.get("memory_per_gpu"))
    code, out, err = run(
        capsys, "solve", problem, chain_file, "-m", memory, *extra, "--chain-bandwidth", value
    )
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "field '--chain-bandwidth'" in err and exc.value.reason in err


def test_inf_chain_bandwidth_text_is_free_transfers_for_pipelines_only():
    assert PipelineProblem(chain(), 2, 100, chain_bandwidth="inf").chain_bandwidth == math.inf
    with pytest.raises(OptmemInputError, match="expected a number") as exc:
        OffloadProblem(chain(), 40, chain_bandwidth="inf")
    assert exc.value.field == "chain_bandwidth"


# ------------------------------------------------------------------ --methods ''
@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_an_empty_methods_list_is_refused_on_both_sides(capsys, chain_file, command):
    """Fails before: the CLI ran the default methods (exit 0) where Python refused."""
    memory = "40:60:2" if command == "sweep" else "40"
    extra = ["-q", "-j", 1] if command == "sweep" else []
    code, out, err = run(
        capsys, command, "checkpoint", chain_file, "-m", memory, "--methods", "", *extra
    )
    assert code == 2 and out == "" and "field 'methods'" in err and NO_METHODS in err
    with pytest.raises(OptmemInputError, match="at least one method"):
        compare(CheckpointProblem(chain(), 40), "")
    with pytest.raises(OptmemInputError, match="at least one method"):
        sweep(CheckpointFactory(chain()), [40], "")


# ------------------------------------------------------------------ sweep ranges and methods
@pytest.mark.parametrize("text", ["auto:3", "30:60:4", "40:40:1"])
def test_python_sweep_takes_the_cli_memory_ranges_and_default_methods(
    capsys, chain_file, tmp_path, text
):
    """Fails before: sweep(factory, 'auto:3') said 'expected a list of memory limits' and
    sweep(factory, limits) needed methods; the CLI had both."""
    out_json = tmp_path / "s.json"
    code, _, err = run(
        capsys, "sweep", "checkpoint", chain_file, "-m", text, "-q", "-j", 1, "--json", out_json
    )
    assert code == 0, err
    cli = json.loads(out_json.read_text())
    py = sweep(CheckpointFactory(chain()), text)
    assert list(py.limits) == cli["limits"]
    assert list(py.methods) == cli["methods"] == default_methods("checkpoint")


@pytest.mark.parametrize(
    ("text", "needle"),
    [("auto:x", "number of steps"), ("60:30:2", "FROM <= TO"), ("1:2", "FROM:TO:STEPS")],
)
def test_a_bad_range_is_the_same_error_on_both_sides(capsys, chain_file, text, needle):
    with pytest.raises(OptmemInputError, match=needle) as exc:
        sweep(CheckpointFactory(chain()), text, "dp")
    assert exc.value.field == "limits"
    code, out, err = run(capsys, "sweep", "checkpoint", chain_file, "-m", text, "-q")
    assert code == 2 and out == "" and "field '--memory'" in err and exc.value.reason in err


@pytest.mark.parametrize("limits", [[], ()])
def test_an_empty_list_of_limits_names_the_limits_argument(limits):
    """Field 'memory' before (sweep has no such argument; stop 55 review)."""
    with pytest.raises(OptmemInputError, match="at least one memory limit") as exc:
        sweep(CheckpointFactory(chain()), limits, "dp")
    assert exc.value.field == "limits"


# ------------------------------------------------------------------ --time-limit
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_refused_time_limit_reads_as_in_python(capsys, chain_file, value):
    """Fails before: the CLI checked --time-limit itself ('expected a positive time limit')
    before SolveOptions, which words it for both sides."""
    with pytest.raises(OptmemInputError) as exc:
        SolveOptions(time_limit_s=float(value))
    code, out, err = run(capsys, "solve", "checkpoint", chain_file, "-m", 40, "--time-limit", value)
    assert code == 2 and out == "" and "field '--time-limit'" in err and exc.value.reason in err


# ------------------------------------------------------------------ verify_plan inputs
@pytest.mark.parametrize(
    "problem",
    [
        CheckpointProblem(chain(), 40),
        OffloadProblem(chain(), 40, chain_bandwidth=2.5),
        PipelineProblem(chain(), 2, 100),
        MinPeakProblem(chain()),
    ],
    ids=lambda p: p.name,
)
def test_verify_plan_takes_every_form_of_a_plan_for_every_problem(problem):
    """Fails before: a Result was refused by every verifier, its plan tuple and JSON text
    by all but the pipeline one ('expected a JSON list of ops ...')."""
    result = solve(problem)
    expected = verify_plan(problem, result.to_json())
    for form in (result, tuple(result.plan), list(result.plan), json.dumps(result.to_json())):
        assert verify_plan(problem, form) == expected
    with pytest.raises(PlanError, match="not valid JSON"):
        verify_plan(problem, "F_all 1")


# ------------------------------------------------------------------ --node-limit
def test_node_limit_in_exponent_form_is_taken_as_in_python(capsys, chain_file):
    """Fails before: argparse's int refused '--node-limit 1e3', which Python's
    SolveOptions(node_limit=1e3) takes as 1000 (CONTRACT section 14)."""
    assert SolveOptions(node_limit=1e3).node_limit == 1000
    code, out, err = run(
        capsys,
        "solve",
        "checkpoint",
        chain_file,
        "-m",
        40,
        "--method",
        "ilp",
        "--node-limit",
        "1e3",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["status"] == "optimal"


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "inf"])
def test_a_refused_node_limit_reads_as_in_python(capsys, chain_file, value):
    with pytest.raises(OptmemInputError) as exc:
        SolveOptions(node_limit=float(value))
    assert "None" in exc.value.reason or "whole number" in exc.value.reason
    code, out, err = run(capsys, "solve", "checkpoint", chain_file, "-m", 40, "--node-limit", value)
    assert code == 2 and out == "" and "field '--node-limit'" in err
    assert exc.value.reason.split(", got")[0] in err


@pytest.mark.parametrize(
    ("key", "flag"),
    [("time_limit_s", "--time-limit"), ("node_limit", "--node-limit"), ("threads", "--threads"),
     ("work_budget", "--work-budget")],
)
def test_a_solve_options_field_given_as_an_option_names_its_flag(capsys, chain_file, key, flag):
    """``--option time_limit_s=3`` is Python's ``SolveOptions(time_limit_s=3)``, a flag on the
    command line: one error naming the flag (exit 2; until stop 55 it said "did you mean
    'time_limit_s'? ('time_limit_s' is a SolveOptions field, not an extra key)", the Python
    name the command line does not take). In Python the field is taken, the key refused."""
    code, out, err = run(capsys, "solve", "checkpoint", chain_file, "-m", 30, "--method", "ilp",
                         "--option", f"{key}=3")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "field '--option'" in err and f"it is {flag}" in err
    problem = CheckpointProblem(chain(), 30)
    assert solve(problem, "ilp", **{key: 3}).status.has_plan
    with pytest.raises(OptmemInputError, match="SolveOptions field"):
        solve(problem, "ilp", extra={key: 3})
