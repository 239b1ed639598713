"""Regression tests, one per defect the fuzz harness found (issue 12 item 5).

Each test is named after what the fuzzer found; it runs the smallest input that showed the
defect, through the CLI where the defect was a CLI one, and checks the contract: exit 2 and
one stderr line naming the file (stage, field), no traceback, nothing left behind.
"""

from __future__ import annotations

import json

import pytest
from fuzz_harness import (
    DIR,
    Case,
    Raw,
    check_case,
    dumps,
    failure_report,
    reference_plans,
    run_case,
)

from optmem.chain import Chain
from optmem.errors import ChainError, OptmemInputError, PlanError
from optmem.fileio import check_writable, read_json, write_text_atomic
from optmem.pipeline_plan import PipelinePlan

CHAIN = {"format": "optmem.chain/1", "input_size": 2, "stages": [
    {"fwd_time": 1, "bwd_time": 2, "output_size": 2, "saved_size": 3, "weight_size": 1},
    {"fwd_time": 2, "bwd_time": 3, "output_size": 1, "saved_size": 2, "weight_size": 2},
    {"fwd_time": 1, "bwd_time": 1, "output_size": 2, "saved_size": 4, "weight_size": 1}]}


def chain_bytes(**changes) -> bytes:
    doc = json.loads(json.dumps(CHAIN))
    for key, value in changes.items():
        if key.startswith("stage1_"):
            doc["stages"][0][key[len("stage1_"):]] = value
        else:
            doc[key] = value
    return dumps(doc).encode()


def run(argv: list[str], files: dict, *, outputs=(), blame: str | None = None,
        must_fail: bool = False, where=None):
    """Run the case and assert the contract; return the outcome."""
    case = Case(list(argv), dict(files), list(outputs), blame, where, must_fail=must_fail)
    out = run_case(case)
    fails = check_case(case, out)
    assert not fails, failure_report(case, out, fails)
    return out


def rejects(argv: list[str], files: dict, blame: str | None = None, where=None) -> str:
    """The case exits 2 with one line (naming ``blame``); return that line."""
    out = run(argv, files, blame=blame, must_fail=blame is not None, where=where)
    assert out.code == 2, out.stdout
    return out.stderr


# ------------------------------------------------------------------ reading files
@pytest.mark.parametrize("data", [b"\xff\xfe{\x00}\x00", b'{"format": "optmem.chain/1"\xc3\x28}',
                                  '{"name": "\u00e9"}'.encode("latin-1")])
def test_non_utf8_chain_file_is_one_error_not_a_unicode_traceback(data):
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "10"], {"c.json": data},
                  blame="c.json")
    assert "not UTF-8" in err


@pytest.mark.parametrize("command", ["verify", "show"])
def test_non_utf8_plan_file_is_one_error(command):
    argv = (["verify", "checkpoint", "{d}/c.json", "{d}/p.json", "-m", "10"]
            if command == "verify" else ["show", "{d}/p.json", "--chain", "{d}/c.json"])
    err = rejects(argv, {"c.json": chain_bytes(), "p.json": b'["F_all 1\xff"]'},
                  blame="p.json")
    assert "not UTF-8" in err


@pytest.mark.parametrize("depth", [5000, 100000])
def test_deeply_nested_json_is_one_error_not_a_recursion_error(depth):
    deep = b"[" * depth + b"]" * depth
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "10"], {"c.json": deep},
                  blame="c.json")
    assert "nested too deeply" in err or "expected a JSON object" in err
    rejects(["verify", "offload", "{d}/c.json", "{d}/p.json", "-m", "10", "--bandwidth", "1"],
            {"c.json": chain_bytes(), "p.json": deep}, blame="p.json")


def test_integer_of_5000_digits_is_one_error_not_a_value_error():
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "10"],
                  {"c.json": chain_bytes(input_size=Raw("9" * 5000))},
                  blame="c.json")
    assert "not valid JSON" in err


def test_read_json_names_the_file_for_every_failure(tmp_path):
    for name, data in [("empty", b""), ("bad", b"\xff"), ("deep", b"[" * 50000)]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(PlanError, match=str(path)):
            read_json(path, error=PlanError, what="plan file")
    with pytest.raises(PlanError, match="cannot read plan file"):
        read_json(tmp_path, error=PlanError, what="plan file")


def test_chain_name_too_long_for_the_file_system_is_one_error_not_an_os_error():
    err = rejects(["solve", "offload", "a" * 300, "-m", "10", "--bandwidth", "1"], {})
    assert "File name too long" in err


# ------------------------------------------------------------------ chain values
@pytest.mark.parametrize("value", [2**64, 2**63, 2**51, 10**400])
def test_sizes_beyond_int64_are_rejected_naming_stage_and_field_not_an_overflow(value):
    data = chain_bytes(stage1_output_size=value, stage1_saved_size=value)
    for problem in ("checkpoint", "remat-offload"):
        err = rejects(["solve", problem, "{d}/c.json", "-m", "100", "--bandwidth", "1"],
                      {"c.json": data}, blame="c.json", where=(1, "output_size"))
        assert "at most 2^50" in err and len(err) < 200


def test_sizes_adding_up_beyond_2_to_the_50_are_rejected():
    doc = {**CHAIN, "stages": [dict(CHAIN["stages"][0], output_size=2**47, saved_size=2**47)
                               for _ in range(6)]}
    with pytest.raises(ChainError, match="add up to .* above 2\\^50"):
        Chain.from_dict(doc)


@pytest.mark.parametrize("value", [10**400, 1e300, 1e13, 5e-324, 1e-12])
def test_times_beyond_what_engines_handle_are_rejected_naming_stage_and_field(value):
    err = rejects(["solve", "pipeline", "{d}/c.json", "-m", "40", "--gpus", "2"],
                  {"c.json": chain_bytes(stage1_fwd_time=value)}, blame="c.json",
                  where=(1, "fwd_time"))
    assert "expected 0 or a time in [1e-09, 1e+12]" in err and len(err) < 200


def test_tiny_times_do_not_make_the_pipeline_cpsat_period_zero():
    """All times 1e-9 counted as integral (0 ticks) at scale 1: period 0, a math domain error
    in the decoder."""
    tiny = {**CHAIN, "stages": [dict(s, fwd_time=1e-9, bwd_time=1e-9) for s in CHAIN["stages"]]}
    out = run(["solve", "pipeline", "{d}/c.json", "-m", "40", "--gpus", "2", "--method",
               "cpsat", "--json"], {"c.json": dumps(tiny).encode()})
    result = json.loads(out.stdout)
    assert out.code == 0 and result["status"] in ("optimal", "feasible")
    assert result["objective"] > 0


# ------------------------------------------------------------------ writing files
UNWRITABLE = {
    "missing directory": ("{d}/missing/out.json", {}),
    "directory in the way": ("{d}/out.json", {"out.json": DIR}),
    "parent is a file": ("{d}/f.txt/out.json", {"f.txt": b"x"}),
    "name too long": ("{d}/" + "x" * 300 + ".json", {}),
}


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_unwritable_solve_output_is_one_error_and_leaves_nothing(kind):
    target, extra = UNWRITABLE[kind]
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "20", "-o", target],
                  {"c.json": chain_bytes(), **extra})
    assert "cannot write" in err


def test_write_atomic_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(OptmemInputError):
        write_text_atomic(tmp_path / "missing" / "x.json", "new")
    write_text_atomic(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("flag,suffix", [("--csv", ".csv"), ("--json", ".json"),
                                         ("--plot", ".png"), ("--plot", ".txt")])
def test_sweep_checks_every_output_before_solving_and_leaves_nothing(flag, suffix):
    """A bad --plot used to fail after the CSV was written; an unwritable --csv raised
    FileNotFoundError."""
    argv = ["sweep", "checkpoint", "{d}/c.json", "-m", "10:20:3", "-q", "--csv", "{d}/s.csv",
            "--json", "{d}/s.json", flag, "{d}/missing/out" + suffix]
    rejects(argv, {"c.json": chain_bytes()})


def test_sweep_checks_an_output_name_too_long_before_writing_any():
    """Fuzz seed 4 (stop 53): ``--json <300 x>.json`` passed the check of every output
    (its temporary file has a short name), the sweep solved, wrote ``--csv`` and exited 2
    at the rename of the JSON, leaving the CSV behind."""
    long_name = "{d}/" + "x" * 300 + ".json"
    err = rejects(["sweep", "checkpoint", "{d}/c.json", "-m", "10:20:2", "-q", "-j", "1",
                   "--csv", "{d}/s.csv", "--json", long_name], {"c.json": chain_bytes()})
    assert "File name too long" in err and "field 'json'" in err
    with pytest.raises(OptmemInputError, match="File name too long"):
        check_writable("x" * 300 + ".csv")


def test_export_writes_atomically_and_names_the_target_not_a_temporary_file():
    err = rejects(["export", "checkpoint", "{d}/c.json", "-m", "12", "-o", "{d}/missing/m.mps"],
                  {"c.json": chain_bytes()})
    assert "{d}/missing/m.mps" in err and ".optmem-" not in err
    out = run(["export", "pipeline", "{d}/c.json", "-m", "40", "--gpus", "2", "-o", "{d}/m.lp"],
              {"c.json": chain_bytes()}, outputs=["m.lp"])
    assert out.code == 0


# ------------------------------------------------------------------ command-line values
def test_sweep_with_a_billion_steps_is_rejected_not_an_out_of_memory_kill():
    err = rejects(["sweep", "checkpoint", "{d}/c.json", "-m", "1:1e15:1000000000", "-q"],
                  {"c.json": chain_bytes()})
    assert "1..10000" in err


def test_sweep_steps_in_other_digits_are_rejected_not_a_value_error():
    rejects(["sweep", "checkpoint", "{d}/c.json", "-m", "auto:\u00b2", "-q"],
            {"c.json": chain_bytes()})


@pytest.mark.parametrize("threads", ["100000", "257", "0", "-1"])
def test_threads_beyond_256_are_rejected_before_an_engine_aborts_the_process(threads):
    """HiGHS with --threads 100000 killed the interpreter (std::terminate); 8192 threads
    took two minutes to start; CP-SAT called such a model invalid."""
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "12", "--method", "ilp",
                   "--threads", threads], {"c.json": chain_bytes()})
    assert "--threads" in err
    rejects(["sweep", "checkpoint", "{d}/c.json", "-q", "--jobs", threads],
            {"c.json": chain_bytes()})


def test_memory_of_400_digits_is_one_error_not_an_overflow():
    """parse_size('9' * 400) overflowed float to inf, then int(inf) raised."""
    rejects(["solve", "checkpoint", "{d}/c.json", "-m", "9" * 400], {"c.json": chain_bytes()})


@pytest.mark.parametrize("spec", [":", ".x:f", "a b:f"])
def test_profile_spec_without_a_module_name_is_one_error_not_a_value_error(spec):
    rejects(["profile", spec, "--device", "meta"], {})


# ------------------------------------------------------------------ plan files
@pytest.mark.parametrize("problem", ["offload", "remat-offload", "pipeline", "min-peak"])
def test_verify_errors_of_every_problem_name_the_plan_file(problem):
    """Only checkpoint plan errors named the file; the other problems' did not."""
    opts, _ = reference_plans()[problem]
    rejects(["verify", problem, "{d}/c.json", "{d}/p.json", *opts],
            {"c.json": chain_bytes(), "p.json": b'{"plan": 5}'}, blame="p.json")


@pytest.mark.parametrize("field,value", [("unit", "x"), ("unit", [1]), ("unit", 0),
                                         ("memory_limit", "x"), ("memory_limit", float("nan")),
                                         ("memory_limit", -5), ("bandwidth", "12GB/s!"),
                                         ("bandwidth", [1])])
def test_show_checks_the_plan_files_own_fields_not_a_value_or_type_error(field, value):
    _, result = reference_plans()["offload"]
    plan = {**result, field: value}
    err = rejects(["show", "{d}/p.json", "--chain", "{d}/c.json", "-o", "{d}/o.png"],
                  {"c.json": chain_bytes(), "p.json": dumps(plan).encode()}, blame="p.json")
    assert f"field '{field}'" in err


def test_show_accepts_a_rate_string_as_the_files_bandwidth():
    _, result = reference_plans()["offload"]
    plan = {"plan": result["plan"], "bandwidth": "2B/ms", "unit": result["unit"]}
    out = run(["show", "{d}/p.json", "--chain", "{d}/c.json", "-o", "{d}/o.png"],
              {"c.json": chain_bytes(), "p.json": dumps(plan).encode()}, outputs=["o.png"])
    assert out.code == 0


@pytest.mark.parametrize("title", ["$x^{$", "$\\frac{", "cost in $"])
def test_show_draws_dollar_signs_literally_not_a_mathtext_error(title):
    plan = reference_plans()["checkpoint"][1]
    doc = json.loads(chain_bytes())
    doc["name"] = "net$^{"
    out = run(["show", "{d}/p.json", "--chain", "{d}/c.json", "-o", "{d}/o.png", "--title",
               title], {"c.json": dumps(doc).encode(), "p.json": dumps(plan).encode()},
              outputs=["o.png"])
    assert out.code == 0


@pytest.mark.parametrize("shift", [10**9, 10**18, -10**12])
def test_pipeline_plan_with_huge_shifts_is_rejected_not_replayed_forever(shift):
    _, result = reference_plans()["pipeline"]
    plan = PipelinePlan.from_any(result).to_dict()
    plan["tasks"][0]["shift"] = shift
    err = rejects(["verify", "pipeline", "{d}/c.json", "{d}/p.json", "-m", "40", "--gpus", "2"],
                  {"c.json": chain_bytes(), "p.json": dumps(plan).encode()}, blame="p.json")
    assert "shifts span" in err


@pytest.mark.parametrize("key,value,message", [
    ("start", 10**400, "too large"), ("shift", 1.5, "expected an integer"),
    ("shift", True, "expected an integer"), ("op", None, "expected one of"),
    ("stage", "1", "expected an integer")])
def test_pipeline_plan_objects_name_the_bad_field_not_an_overflow(key, value, message):
    _, result = reference_plans()["pipeline"]
    plan = PipelinePlan.from_any(result).to_dict()
    plan["tasks"][0][key] = value
    with pytest.raises(PlanError, match=f"tasks\\[0\\].{key}: .*{message}"):
        PipelinePlan.from_dict(json.loads(dumps(plan)))
    plan = PipelinePlan.from_any(result).to_dict()
    plan["period"] = Raw("1" + "0" * 400)
    with pytest.raises(PlanError, match="period: .*too large"):
        PipelinePlan.from_dict(json.loads(dumps(plan)))


@pytest.mark.parametrize("method", ["contiguous", "equal", "pipedream", "madpipe", "ilp",
                                    "cpsat"])
def test_pipeline_of_a_chain_without_times_is_one_error_not_a_division_by_zero(method):
    """Every time 0: every pipeline method divided by a period of 0."""
    zero = {**CHAIN, "stages": [dict(s, fwd_time=0, bwd_time=0) for s in CHAIN["stages"]]}
    err = rejects(["solve", "pipeline", "{d}/c.json", "-m", "40", "--gpus", "2", "--method",
                   method], {"c.json": dumps(zero).encode()})
    assert "every time of the chain is 0" in err


def test_datasets_path_with_json_prints_json():
    out = run(["datasets", "path", "vgg16-b64-224", "--json"], {})
    assert json.loads(out.stdout).endswith("vgg16-b64-224.json")


def test_profile_factory_that_needs_arguments_is_one_error_not_a_type_error():
    err = rejects(["profile", "json:dumps", "--device", "meta"], {})
    assert "cannot be called as a model factory" in err


def test_profile_batch_beyond_memory_is_one_error_not_an_allocator_traceback():
    """toy-cnn with batch 10^9 on the CPU: 12 TB of input; torch's allocator raised."""
    err = rejects(["profile", "toy-cnn", "--device", "cpu", "--batch", "1000000000",
                   "--no-progress", "-o", "{d}/c.json"], {})
    assert "not enough memory" in err


@pytest.mark.parametrize("method", ["dp", "dp:rotor", "dp:floating"])
def test_dp_tables_beyond_4_gib_are_one_error_not_a_memory_error(method):
    """--slots 10^8 made the persistent DP ask numpy for 15.5 GiB, 10^10 for terabytes."""
    big = {**CHAIN, "input_size": 2 * 2**40, "stages": [
        dict(s, output_size=s["output_size"] * 2**40, saved_size=s["saved_size"] * 2**40)
        for s in CHAIN["stages"]]}
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "12TiB", "--slots", "100000000",
                   "--method", method], {"c.json": dumps(big).encode()})
    assert "use fewer slots" in err


def test_autocapper_at_memory_0_on_a_byte_scale_chain_answers_not_tabulates_bytes():
    """With -m 0 the unit is 1 byte and the autocapper tabulated the persistent DP up to the
    store-all peak: 2 * 10^14 memory values on a chain of 2^44-byte activations."""
    big = {**CHAIN, "input_size": 2 * 2**44, "stages": [
        dict(s, output_size=s["output_size"] * 2**44, saved_size=s["saved_size"] * 2**44)
        for s in CHAIN["stages"]]}
    out = run(["solve", "remat-offload", "{d}/c.json", "-m", "0", "--bandwidth", "12GB/s",
               "--method", "autocapper", "--json"], {"c.json": dumps(big).encode()})
    assert out.code == 0 and json.loads(out.stdout)["status"] == "infeasible"


def test_offload_thesis_dp_at_memory_0_does_not_divide_by_zero():
    """A chain of zero sizes fits in 0 bytes; the thesis discretisation divided by 0."""
    zero = {**CHAIN, "input_size": 0, "stages": [
        dict(s, output_size=0, saved_size=0, weight_size=0) for s in CHAIN["stages"]]}
    out = run(["compare", "offload", "{d}/c.json", "-m", "0", "--bandwidth", "2", "--methods",
               "dp:thesis,dp", "--json"], {"c.json": dumps(zero).encode()})
    assert [r["status"] for r in json.loads(out.stdout)["results"]] == ["feasible"] * 2


@pytest.mark.parametrize("method", ["dp", "dp:thesis", "dp:cheap"])
def test_offload_dp_with_a_bandwidth_of_1e308_has_finite_capacities_not_a_nan_cast(method):
    """u * beta overflowed to inf, prefix differences gave NaN, cast to int64 with a
    RuntimeWarning (and garbage capacities)."""
    out = run(["solve", "offload", "{d}/c.json", "-m", "11", "--bandwidth", "1e308",
               "--method", method, "--json"], {"c.json": chain_bytes()})
    assert out.code == 0 and not out.warnings
    assert json.loads(out.stdout)["status"] in ("optimal", "feasible")


@pytest.mark.parametrize("option,value,message", [
    ("--gpus", "10000000000", "at most 4096 GPUs"),
    ("--weight-copies", "1" + "0" * 30, "at most 64 weight copies")])
def test_pipeline_gpus_and_weight_copies_are_bounded_not_a_memory_error(option, value, message):
    """--gpus 10^10: the simulator's per-GPU lists raised MemoryError and the CP-SAT model
    never finished building; --weight-copies 10^30 overflowed CP-SAT (TypeError) and HiGHS."""
    err = rejects(["solve", "pipeline", "{d}/c.json", "-m", "40", "--gpus", "2", option, value],
                  {"c.json": chain_bytes()})
    assert message in err


@pytest.mark.parametrize("problem", ["offload", "remat-offload", "pipeline"])
def test_links_too_slow_for_the_chain_are_rejected_not_an_engine_overflow(problem):
    """--bandwidth 1e-300 made transfer times of 1e300: CP-SAT raised TypeError, HiGHS an
    IndexError. Moving the largest value (2^40 B) must take at most 1e12 time units: 1 B/ms
    is too slow, 2 B/ms is fine (rates per ms, so the bound is checked in chain units)."""
    big = {**CHAIN, "input_size": 2**40}
    opts = ["--gpus", "2"] if problem == "pipeline" else []
    base = ["solve", problem, "{d}/c.json", "-m", "2TiB", *opts, "--method",
            "equal" if problem == "pipeline" else "dp", "--bandwidth"]
    err = rejects([*base, "1B/ms"], {"c.json": dumps(big).encode()})
    assert "too slow to model" in err
    assert run([*base, "2B/ms"], {"c.json": dumps(big).encode()}).code == 0


@pytest.mark.parametrize("method", ["dp", "ilp", "cpsat"])
def test_remat_offload_at_a_bandwidth_of_1e308_answers_as_a_fast_link(method):
    """--chain-bandwidth 1e308 (a fuzz case of stop 78) overflowed the remat + offload DP
    (``OverflowError`` in ``_qc``: a traceback; on 3 stages a wrong ``infeasible``) and
    the exact models' rows ("Cannot set constraint RHS to NaN/inf values"). The solvers
    now cap the link at ``LINK_CAP``: the answer is the one at 1e9, without a warning."""
    chain = {"c.json": chain_bytes()}
    argv = ["solve", "remat-offload", "{d}/c.json", "-m", "14", "--method", method,
            "--json", "--chain-bandwidth"]
    fast, usual = run([*argv, "1e308"], chain), run([*argv, "1e9"], chain)
    assert fast.code == usual.code == 0 and not fast.warnings
    got, want = json.loads(fast.stdout), json.loads(usual.stdout)
    assert got["status"] == want["status"] and got["status"] in ("optimal", "feasible")
    assert got["objective"] == pytest.approx(want["objective"], rel=1e-9)


@pytest.mark.parametrize("rate", [1e308, 1e30, 1e20])
def test_every_method_at_a_very_fast_link_runs_and_agrees(rate):
    """At chain bandwidths of 1e20 to 1e308 every offload and remat + offload method of a
    2-stage chain answers without an exception or a float warning, and the exact ones
    prove the compute time, as brute force does. Before stop 78, at 1e20 and 1e30 the
    offload MILP's warm start raised PuLP's "initial value ... is greater than upBound
    0.0" through the solve, and at 1e308 the remat + offload DP and models overflowed."""
    import warnings

    from optmem import SolveOptions, solve
    from optmem.datasets.synthetic import random_chain
    from optmem.problems.offload import OffloadProblem
    from optmem.problems.remat_offload import RematOffloadProblem
    from optmem.solvers.facade import available_methods

    for seed in (5, 7):
        chain = random_chain(2, seed=seed)
        for kind in (OffloadProblem, RematOffloadProblem):
            problem = kind(chain, int(chain.store_all_peak() * 0.9), chain_bandwidth=rate)
            for method in available_methods(problem):
                with warnings.catch_warnings():
                    warnings.simplefilter("error", RuntimeWarning)
                    result = solve(problem, method, options=SolveOptions(
                        threads=1, time_limit_s=None, node_limit=10_000))
                assert result.status.value != "error", (seed, kind.name, method)
                if method in ("brute", "ilp", "cpsat"):
                    assert result.status.value == "optimal"
                    assert result.objective == pytest.approx(chain.total_compute_time(),
                                                             rel=1e-9)


@pytest.mark.parametrize("name", ["\udcff", "a\x00b", "a\nb"])
def test_chain_names_that_no_output_can_print_are_rejected_not_a_unicode_error(name):
    """A JSON escape gave a lone surrogate as the chain name: print() raised
    UnicodeEncodeError (solve, compare, sweep) and matplotlib a TypeError (show)."""
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "12"],
                  {"c.json": chain_bytes(name=name)}, blame="c.json", where=(None, "name"))
    assert "expected printable text" in err


@pytest.mark.parametrize(("field", "value"), [("name", None), ("memory_unit", 3),
                                               ("time_unit", False), ("stage name", [1]),
                                               ("loss", 0), ("loss", False)])
def test_text_fields_that_are_not_text_are_rejected_not_turned_into_text(field, value):
    """``str()`` made ``None``, ``3`` and ``[1]`` the texts 'None', '3' and '[1]', and a
    ``loss`` of 0 or false read as no loss, in silence (a hunt in stop 51)."""
    doc = json.loads(json.dumps(CHAIN))
    if field == "stage name":
        doc["stages"][0]["name"], where = value, (1, "name")
    else:
        doc[field], where = value, (None, field)
    err = rejects(["solve", "checkpoint", "{d}/c.json", "-m", "12"],
                  {"c.json": dumps(doc).encode()}, blame="c.json", where=where)
    assert "expected" in err


@pytest.mark.parametrize("title", ["\udcff", "\x00"])
def test_titles_that_fonts_cannot_draw_are_rejected_before_drawing(title):
    plan = reference_plans()["checkpoint"][1]
    for argv in (["show", "{d}/p.json", "--chain", "{d}/c.json", "-o", "{d}/o.png"],
                 ["sweep", "checkpoint", "{d}/c.json", "-m", "5:12:2", "-q", "--plot",
                  "{d}/o.png"]):
        err = rejects([*argv, "--title", title],
                      {"c.json": chain_bytes(), "p.json": dumps(plan).encode()})
        assert "--title" in err


@pytest.mark.parametrize("plan", ["[-1, 2]", "[1" + "0" * 80 + "]"])
def test_min_peak_checkpoint_lists_out_of_range_name_the_plan_file(plan):
    """The long fuzz run: ``verify min-peak`` of ``[-1, ...]`` or a checkpoint of 80 digits
    named the field but not the plan file."""
    rejects(["verify", "min-peak", "{d}/c.json", "{d}/plan.json"],
            {"c.json": chain_bytes(), "plan.json": plan.encode()}, blame="plan.json")


@pytest.mark.parametrize("field", ["unit", "memory_limit"])
def test_show_of_a_plan_file_with_a_400_digit_unit_is_one_error(field):
    """The long fuzz run: ``show`` of an offload plan whose ``unit`` had 400 digits raised
    OverflowError (int too large to convert to float)."""
    plan = {**reference_plans()["offload"][1], field: 10 ** 400}
    err = rejects(["show", "{d}/p.json", "--chain", "{d}/c.json", "--bandwidth", "12GB/s",
                   "-o", "{d}/o.png"],
                  {"c.json": chain_bytes(), "p.json": dumps(plan).encode()}, blame="p.json")
    assert field in err


def test_show_of_a_pipeline_result_names_the_file():
    """``optmem show`` of a pipeline ``solve --json`` output: "unknown op kind 'period'"
    until stop 51, then one line without the file's name (the long fuzz run, seed 2)."""
    plan = {"problem": "pipeline", "plan": ["period 7", "stage 1 layers 1-1 gpu 0",
                                            "stage 2 layers 2-3 gpu 1"]}
    err = rejects(["show", "{d}/plan.json", "--chain", "{d}/chain.json", "-o",
                   "{d}/plan.png"],
                  {"plan.json": dumps(plan).encode(), "chain.json": dumps(CHAIN).encode()},
                  blame="plan.json")
    assert "not pipeline plans" in err
