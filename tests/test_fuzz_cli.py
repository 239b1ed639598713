"""Short, deterministic fuzz run of the CLI and the loaders (issue 12 item 5).

The cases and the oracle are those of ``fuzz_harness.py`` (see its docstring): every case
ends with exit 0, or exit 2 and one stderr line naming the bad file (and stage and field);
no traceback, no output left behind by a failing run. Hypothesis runs derandomised (a fixed
sequence of examples), without deadline and with a bounded number of examples, so the file
takes well under a minute on a loaded 2-core machine. The long run is
``benchmarks/fuzz_cli.py --cases 10000``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fuzz_harness import (
    Case,
    Outcome,
    chain_docs,
    check_case,
    cli_cases,
    dumps,
    failure_report,
    held_floor_breaks,
    held_solve_cases,
    misc_cases,
    mutated_chain,
    run_case,
    show_cases,
    sweep_cases,
    verify_cases,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.errors import ChainError


def fuzz_settings(examples: int) -> settings:
    """Derandomised, no deadline, no database, a fixed number of examples."""
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    print_blob=True, suppress_health_check=list(HealthCheck))


def assert_contract(case: Case, outcome: Outcome | None = None) -> Outcome:
    """Run ``case`` (unless ``outcome`` is given) and fail with a full report if it breaks
    the CLI contract."""
    out = outcome or run_case(case)
    fails = check_case(case, out)
    assert not fails, failure_report(case, out, fails)
    return out


# ------------------------------------------------------------------ the chain loader
@fuzz_settings(200)
@given(doc=chain_docs(max_stages=8), data=st.data())
def test_chain_loader_accepts_or_names_file_stage_and_field(tmp_path_factory, doc, data):
    damaged = data.draw(mutated_chain(doc))
    path = tmp_path_factory.mktemp("chain") / "chain.json"
    path.write_bytes(damaged.data)
    try:
        chain = Chain.load(path)
    except ChainError as exc:
        message = str(exc)
        assert "\n" not in message and message.startswith(str(path)), message
        if damaged.where:
            stage, name = damaged.where
            assert name in message and (stage is None or f"stage {stage}" in message), message
        return
    assert not damaged.invalid, f"accepted a damaged chain: {damaged.note}"
    again = Chain.from_dict(json.loads(json.dumps(chain.to_dict())))
    assert again == chain  # what loads also round-trips


# ------------------------------------------------------------------ the CLI, in-process
@fuzz_settings(52)
@given(case=cli_cases(torch=False))
def test_cli_cases_keep_the_contract(case):
    assert_contract(case)


@fuzz_settings(8)
@given(case=held_solve_cases())
def test_held_chains_solve_replay_and_count_the_held_terms(case):
    """Stop 83: valid chains with held terms solve (or are infeasible); the plan replays
    with the claimed objective and peak, and every prefetch between compute ops fits with
    what the last op left held."""
    assert_contract(case)


@fuzz_settings(40)
@given(case=verify_cases())
def test_verify_plan_files_keep_the_contract(case):
    assert_contract(case)


@fuzz_settings(12)
@given(case=show_cases())
def test_show_plan_files_keep_the_contract(case):
    assert_contract(case)


@fuzz_settings(6)
@given(case=sweep_cases())
def test_sweep_keeps_the_contract(case):
    assert_contract(case)


@fuzz_settings(16)
@given(case=misc_cases(torch=False))
def test_datasets_profile_arguments_and_bad_command_lines_keep_the_contract(case):
    assert_contract(case)


# ------------------------------------------------------------------ a few real processes
def run_process(argv: list[str]) -> Outcome:
    """Run ``python -m optmem`` as a child process (real argv bytes, real pipes)."""
    env = {**os.environ, "PYTHONWARNINGS": "default", "LC_ALL": "C.UTF-8"}
    proc = subprocess.run([sys.executable, "-m", "optmem", *argv], capture_output=True,
                          env=env)
    err = proc.stderr.decode("utf-8", "backslashreplace")
    lines = [line for line in err.splitlines() if "Warning" not in line or
             "RuntimeWarning" in line]
    tb = "Traceback (most recent call last)" in err
    return Outcome(proc.returncode, proc.stdout.decode("utf-8", "backslashreplace"),
                   "\n".join(lines) + ("\n" if lines else ""),
                   exception=err if tb else None, exception_type="Traceback" if tb else None,
                   exception_where="subprocess" if tb else None)


GOOD_CHAIN = dumps({"format": "optmem.chain/1", "input_size": 2, "stages": [
    {"fwd_time": 1, "bwd_time": 2, "output_size": 2, "saved_size": 3},
    {"fwd_time": 1, "bwd_time": 2, "output_size": 2, "saved_size": 4}]}).encode()

PROCESS_CASES = [
    Case(["solve", "checkpoint", "{d}/chain.json", "-m", "20", "--json", "-o", "{d}/out.json"],
         {"chain.json": GOOD_CHAIN}, ["out.json"], note="valid"),
    Case(["verify", "offload", "{d}/chain.json", "{d}/plan.json", "-m", "20", "--bandwidth",
          "1"], {"chain.json": GOOD_CHAIN, "plan.json": b"\xff\xfe" + b"[" * 100000},
         blame="plan.json", must_fail=True, note="UTF-16 and deep nesting"),
    Case(["sweep", "checkpoint", "{d}/chain.json", "-m", "5:20:3", "-q", "--csv",
          "{d}/missing/s.csv"], {"chain.json": GOOD_CHAIN}, note="unwritable csv"),
    Case(["solve", "checkpoint", os.fsdecode(b"/nonexistent/\xff.json"), "-m", "1GiB"],
         note="non-UTF-8 argv bytes"),
    Case(["solve", "--help"], note="help"),
]


@pytest.mark.parametrize("case", PROCESS_CASES, ids=lambda c: c.note)
def test_real_processes_keep_the_contract(case):
    assert_contract(case, run_case(case, runner=run_process))


def test_help_exits_zero_in_process():
    assert run_case(Case(["solve", "--help"])).code == 0


def test_the_oracle_catches_what_it_must(tmp_path):
    """The oracle is not vacuous: a traceback, a second stderr line, an unnamed file, an
    output left behind and a temporary file are each reported."""
    case = Case(["solve"], files={"chain.json": b"{"}, outputs=["out.json"], blame="chain.json")
    assert check_case(case, Outcome(None, "", "", "Traceback ...\nValueError: x", "ValueError",
                                    "chain.py:load"))
    assert check_case(case, Outcome(2, "", "optmem: error: x\nmore\n"))
    assert check_case(case, Outcome(2, "", "optmem: error: bad memory\n"))
    left = Outcome(2, "", "optmem: error: {d}/chain.json: bad\n",
                   files_after=["chain.json", "out.json"])
    assert [f.klass for f in check_case(case, left)] == ["output left after a failing run"]
    tmp = Outcome(0, "", "", files_after=["chain.json", ".optmem-1-ab.tmp.json"])
    assert [f.klass for f in check_case(case, tmp)] == ["unexpected file written"]
    assert not check_case(case, Outcome(2, "", "optmem: error: {d}/chain.json: bad\n",
                                        files_after=["chain.json"]))
    solved = Case(["solve"], replay=["verify"])
    error = Outcome(0, "", "", result={"status": "error", "report": {"error": "claimed 3"}})
    assert [f.klass for f in check_case(solved, error)] == ["status error on valid input"]
    held = Outcome(0, "", "", result={"status": "optimal"},
                   held_floor=["op 5 prefetch a 0 after B 2: floor 11 > peak 10"])
    assert [f.klass for f in check_case(solved, held)] == ["held term not counted between ops"]


HELD_CHAIN = Chain.from_dict({"format": "optmem.chain/1", "input_size": 3, "stages": [
    {"fwd_time": 1, "bwd_time": 1, "output_size": 1, "saved_size": 1},
    {"fwd_time": 1, "bwd_time": 1, "output_size": 1, "saved_size": 1, "bwd_overhead": 6,
     "bwd_held": 6}]})
HELD_PLAN = ["F_all 1", "offload a 0", "F_all 2", "Loss", "B 2", "prefetch a 0", "B 1"]


def test_the_held_floor_catches_a_simulator_that_ignores_held_terms(monkeypatch):
    """The mutation check of stop 83 in small: with the simulator's ``held_after`` broken
    (0), a prefetch after ``B 2`` starts between ops at limit 10 although ``B 2`` left 6
    held (it needs 11); the oracle's own floor, read from the chain's fields, says so."""
    result = {"unit": 1, "plan": HELD_PLAN, "memory_limit": 10,
              "report": {"bandwidth_units": 1.0}}
    assert not held_floor_breaks(HELD_CHAIN, {**result, "memory_limit": 11})
    monkeypatch.setattr("optmem.simulate.offload.held_after", lambda chain, op: 0)
    assert held_floor_breaks(HELD_CHAIN, result) == [
        "op 5 prefetch a 0 after B 2: floor 11 > peak 10"]
