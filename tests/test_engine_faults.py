"""Engine faults are survived (issue 12): injected failures, never timers.

A CBC binary that segfaults, exits 1 or is missing (``engines.CBC_PATH``), a HiGHS that
raises, a CP-SAT model that is invalid or a CP-SAT that raises: ``solve`` and ``compare``
return ``status: error`` with the engine's message, or ``feasible`` with the verified warm
start; the CLI keeps its exit codes (1 for ``error``, 0 otherwise) and prints no traceback.
"""

from __future__ import annotations

import json
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pulp", reason="the exact models need PuLP (optmem[engines])")
pytest.importorskip("highspy", reason="HiGHS engine (optmem[engines])")
pytest.importorskip("ortools", reason="CP-SAT engine (optmem[engines])")

from optmem.chain import Chain  # noqa: E402
from optmem.cli import main  # noqa: E402
from optmem.datasets.synthetic import random_chain  # noqa: E402
from optmem.engines import adapters as engines  # noqa: E402
from optmem.problems import (  # noqa: E402
    CheckpointProblem,
    MinPeakProblem,
    OffloadProblem,
    PipelineProblem,
    RematOffloadProblem,
)
from optmem.result import Result, SolveOptions, Status  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402
from optmem.solvers.facade import compare, solve  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices

CHAIN = random_chain(5, seed=2)
MEMORY = (CHAIN.input_size + 2 * CHAIN.store_all_peak()) // 3
OFFLOAD_MEMORY = 48  # between the all-offloaded minimum (40) and the store-all peak (57)
SCRIPTS = {"segfault": "kill -SEGV $$\n", "exit1": "echo 'cbc: broken' >&2\nexit 1\n"}


def fake_cbc(tmp_path: Path, kind: str) -> str:
    """A CBC stand-in that dies by a signal (``segfault``) or exits 1 (``exit1``)."""
    path = tmp_path / f"cbc-{kind}"
    path.write_text("#!/bin/sh\n" + SCRIPTS[kind])
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def check_survived(result: Result) -> None:
    """``error`` with the engine's message, or ``feasible`` with a replayed warm start."""
    assert result.status in (Status.ERROR, Status.FEASIBLE), result
    assert "engine_error" in result.report
    if result.status is Status.ERROR:
        assert result.report["error"] == result.report["engine_error"]
        assert not result.plan
    else:
        assert result.plan and "failed" in result.report["note"]
        assert result.bound <= result.objective + 1e-9 or result.bound != result.bound


# ------------------------------------------------------------------ the adapters
@pytest.mark.parametrize("kind", ["segfault", "exit1", "missing"])
def test_cbc_crash_exit_or_missing_binary_is_an_error_result(tmp_path, monkeypatch,
                                                             kind: str) -> None:
    import pulp

    path = str(tmp_path / "no-such-cbc") if kind == "missing" else fake_cbc(tmp_path, kind)
    monkeypatch.setattr(engines, "CBC_PATH", path)
    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = prob.add_variable("x", 0, 1, cat=pulp.LpBinary)
    prob += x
    prob += (x >= 0, "c")
    out = engines.solve_pulp(prob, [x], "cbc", time_limit_s=5, initial=[1])  # retry path too
    assert out.status is Status.ERROR and out.failed
    assert "PulpSolverError" in out.message
    assert out.report()["engine_error"].startswith("cbc failed: PulpSolverError")


@pytest.mark.parametrize("kind", ["segfault", "exit1", "ok"])
def test_a_cbc_run_leaves_no_files_behind(tmp_path, monkeypatch, kind: str) -> None:
    """PuLP deletes its model, start and solution files only when CBC succeeds; a crashed
    run used to leave them in ``/tmp`` (two per crash, 1887 files seen on this machine)."""
    import pulp

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for name in ("TMPDIR", "TMP", "TEMP"):  # where PuLP and tempfile would write
        monkeypatch.setenv(name, str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    if kind != "ok":
        monkeypatch.setattr(engines, "CBC_PATH", fake_cbc(tmp_path, kind))
    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = prob.add_variable("x", 0, 1, cat=pulp.LpBinary)
    prob += x
    prob += (x >= 0, "c")
    out = engines.solve_pulp(prob, [x], "cbc", time_limit_s=5, initial=[1])  # retry path too
    assert out.status is (Status.OPTIMAL if kind == "ok" else Status.ERROR)
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_highs_exception_is_an_error_result(monkeypatch) -> None:
    import highspy
    import pulp

    def boom(self: Any) -> None:
        raise RuntimeError("injected HiGHS failure")

    monkeypatch.setattr(highspy.Highs, "run", boom)
    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = prob.add_variable("x", 0, 1, cat=pulp.LpBinary)
    prob += x
    out = engines.solve_pulp(prob, [x], "highs")
    assert out.status is Status.ERROR and out.message == "RuntimeError: injected HiGHS failure"


@pytest.mark.parametrize("engine", ["highs", "cbc"])
def test_a_warm_start_outside_a_bound_never_raises(engine) -> None:
    """A warm start 8e-20 above a bound of 0 (float noise: the offload MILP at a chain
    bandwidth of 1e20, stop 78) is taken on the bound; one far outside is left unset. Before,
    PuLP's ``setInitialValue`` raised "initial value ... is greater than upBound" through
    the solve."""
    import pulp

    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = prob.add_variable("x", 0, 0)
    y = prob.add_variable("y", 1, 3)
    prob += x + y
    prob += x + y >= 2
    for start in ([8e-20, 2.0], [5.0, -4.0]):
        out = engines.solve_pulp(prob, [x, y], engine, time_limit_s=5, threads=1,
                                 initial=start)
        assert out.status is Status.OPTIMAL and out.objective == pytest.approx(2.0)
    engines._set_initial(x, 8e-20)
    engines._set_initial(y, 5.0)
    assert (x.varValue, y.varValue) == (0.0, None)


def invalidate(model: Any) -> None:
    """Make a CP-SAT model invalid: a constraint whose terms overflow 64-bit integers."""
    x, y = (model.new_int_var(0, 10, f"injected{i}") for i in range(2))
    model.add(x * 2**61 + y * 2**61 <= 5)


def test_highs_with_fewer_threads_than_an_earlier_run() -> None:
    """HiGHS sizes one global thread pool at its first run; later runs may ask for fewer."""
    import pulp

    for threads in (2, 1, 2, 1):
        prob = pulp.LpProblem("threads", pulp.LpMinimize)
        x, y = pulp.LpVariable("x", cat="Binary"), pulp.LpVariable("y", cat="Binary")
        prob += x + 2 * y
        prob += x + y >= 1
        out = engines.solve_pulp(prob, [x, y], "highs", threads=threads)
        assert out.status is Status.OPTIMAL, (threads, out.message)
        assert out.objective == 1 and out.values == [1, 0]


def test_cpsat_model_invalid_is_an_error_result() -> None:
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x = model.new_bool_var("x")
    model.minimize(x)
    invalidate(model)
    out = engines.solve_cpsat(model, [x])
    assert out.status is Status.ERROR
    assert out.message.startswith("MODEL_INVALID: Possible integer overflow")


# ------------------------------------------------------------------ every exact method
def _pipeline_chain() -> Chain:
    return Chain.from_lists([1, 2, 1], [1, 2, 1], [1, 1, 1], [1, 1, 1], input_size=1)


EXACT: list[tuple[str, Callable[[], Any], str, dict[str, Any]]] = [
    ("checkpoint", lambda: CheckpointProblem(CHAIN, MEMORY), "ilp", {"solver": "cbc"}),
    ("checkpoint", lambda: CheckpointProblem(CHAIN, MEMORY), "cpsat", {}),
    ("offload", lambda: OffloadProblem(CHAIN, OFFLOAD_MEMORY, chain_bandwidth=2.0), "ilp",
     {"solver": "cbc"}),
    ("offload", lambda: OffloadProblem(CHAIN, OFFLOAD_MEMORY, chain_bandwidth=2.0), "cpsat", {}),
    # without the link relaxation (HiGHS): its bound would prove this tiny instance at once
    ("remat-offload", lambda: RematOffloadProblem(random_chain(2, seed=0), 46,
                                                   chain_bandwidth=1.0), "cpsat",
     {"extra": {"relaxation": False}}),
    ("pipeline", lambda: PipelineProblem(_pipeline_chain(), 2, 10**6), "ilp",
     {"solver": "cbc"}),
    ("pipeline", lambda: PipelineProblem(_pipeline_chain(), 2, 10**6), "cpsat", {}),
    ("min-peak", lambda: MinPeakProblem(CHAIN), "ilp", {"solver": "cbc"}),
]


def break_engines(monkeypatch, tmp_path: Path) -> None:
    """CBC segfaults, CP-SAT raises: every engine call of every method fails."""
    from ortools.sat.python import cp_model

    def raising_solve(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected CP-SAT failure")

    monkeypatch.setattr(engines, "CBC_PATH", fake_cbc(tmp_path, "segfault"))
    monkeypatch.setattr(cp_model.CpSolver, "solve", raising_solve)


@pytest.mark.parametrize(("name", "make", "method", "opts"), EXACT,
                         ids=[f"{e[0]}-{e[2]}" for e in EXACT])
@pytest.mark.parametrize("warm_start", [True, False])
def test_every_exact_method_survives_a_failing_engine(
        monkeypatch, tmp_path, name: str, make: Callable[[], Any], method: str,
        opts: dict[str, Any], warm_start: bool) -> None:
    break_engines(monkeypatch, tmp_path)
    problem = make()
    options = SolveOptions(warm_start=warm_start, **opts)
    result = solve(problem, method, options=options)
    check_survived(result)
    message = result.report["engine_error"]
    assert "PulpSolverError" in message or "injected CP-SAT failure" in message
    [again] = compare(problem, [method], options=options)
    assert (again.status, again.report.get("engine_error")) == (result.status, message)


def test_warm_started_method_returns_the_verified_dp_plan(monkeypatch, tmp_path) -> None:
    """With the DP plan as warm start, a crashed engine still gives that plan, replayed."""
    break_engines(monkeypatch, tmp_path)
    problem = CheckpointProblem(CHAIN, MEMORY)
    dp = solve(problem, "dp")
    for method, solver in (("ilp", "cbc"), ("cpsat", "highs")):
        result = solve(problem, method, solver=solver)
        assert result.status is Status.FEASIBLE
        assert result.plan == dp.plan and result.objective == dp.objective
        assert result.report["incumbent"] == "dp plan"
        assert result.bound == pytest.approx(CHAIN.total_compute_time())
        sim = simulate_checkpoint(problem.discretize().chain, result.plan)
        assert sim.peak_memory <= result.memory_limit
        cold = solve(problem, method, solver=solver, warm_start=False)
        assert cold.status is Status.ERROR and not cold.plan


def test_invalid_cpsat_model_inside_a_method(monkeypatch) -> None:
    import optmem.models.checkpoint_cpsat as emitter

    real = emitter.emit_cpsat

    def broken(form: Any) -> Any:
        built = real(form)
        invalidate(built.model)
        return built

    monkeypatch.setattr(emitter, "emit_cpsat", broken)
    problem = CheckpointProblem(CHAIN, MEMORY)
    warm = solve(problem, "cpsat")
    assert warm.status is Status.FEASIBLE
    assert "MODEL_INVALID" in warm.report["engine_error"]
    cold = solve(problem, "cpsat", warm_start=False)
    assert cold.status is Status.ERROR and "MODEL_INVALID" in cold.report["error"]


def test_infeasible_hint_search_survives_a_failing_engine(monkeypatch) -> None:
    """The engine proves infeasibility, then fails in the hint's min-peak search."""
    chain = random_chain(4, seed=1)
    problem = CheckpointProblem(chain, chain.input_size + 1)
    assert solve(problem, "ilp").min_feasible_memory is not None  # the search runs
    real = engines.solve_pulp
    calls: list[int] = []

    def first_call_only(*args: Any, **kwargs: Any) -> engines.EngineResult:
        calls.append(1)
        if len(calls) == 1:
            return real(*args, **kwargs)
        return engines.failed_result("highs", RuntimeError("injected failure"))

    monkeypatch.setattr(engines, "solve_pulp", first_call_only)
    result = solve(problem, "ilp")
    assert len(calls) == 2
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory is None


# ------------------------------------------------------------------ the CLI keeps its codes
def test_cli_exit_codes_with_a_crashing_engine(monkeypatch, tmp_path, capsys) -> None:
    break_engines(monkeypatch, tmp_path)
    path = tmp_path / "c.json"
    CHAIN.save(path)
    common = [str(path), "--memory", str(MEMORY), "--json"]
    # warm-started: feasible with the DP plan, exit 0
    assert main(["solve", "checkpoint", *common, "--method", "ilp", "--solver", "cbc"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["status"] == "feasible" and "Traceback" not in err
    # warm-started offload model: feasible with the verified DP/GREEDY plan, exit 0
    offload_args = ["solve", "offload", str(path), "--memory", str(OFFLOAD_MEMORY),
                    "--bandwidth", "2kB/s", "--method", "cpsat", "--json"]
    assert main(offload_args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["status"] == "feasible" and "Traceback" not in err
    # no warm start (none found): status error, exit 1, one JSON object, no traceback
    import optmem.solvers.offload as offload_glue

    monkeypatch.setattr(offload_glue, "_warm_start", lambda *a, **k: None)
    assert main(["solve", "offload", str(path), "--memory", str(OFFLOAD_MEMORY), "--bandwidth",
                 "2kB/s", "--method", "cpsat", "--json"]) == 1
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["status"] == "error" and "injected CP-SAT failure" in data["report"]["error"]
    assert "Traceback" not in err
    # compare reports the error in its table and exits 0
    assert main(["compare", "checkpoint", *common, "--methods", "dp,ilp,cpsat",
                 "--solver", "cbc"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["status"] for r in results] == ["optimal", "feasible", "feasible"]


# ------------------------------------------------------------------ a misbehaving engine
def garbage(mode: str) -> Callable[[engines.EngineResult], engines.EngineResult]:
    """An engine outcome that claims a solution it does not have."""
    import dataclasses

    def corrupt(out: engines.EngineResult) -> engines.EngineResult:
        n = len(out.values or ())
        values = {"none": None, "zeros": [0.0] * n, "ones": [1.0] * n,
                  "short": (out.values or [])[: n // 2], "nan": [float("nan")] * n}[mode]
        return dataclasses.replace(out, status=Status.OPTIMAL, values=values)

    return corrupt


def corrupt_engines(monkeypatch: pytest.MonkeyPatch,
                    corrupt: Callable[[engines.EngineResult], engines.EngineResult]) -> None:
    """Every PuLP and CP-SAT solve returns ``corrupt`` of its real result."""
    real_pulp, real_cpsat = engines.solve_pulp, engines.solve_cpsat
    monkeypatch.setattr(engines, "solve_pulp", lambda *a, **k: corrupt(real_pulp(*a, **k)))
    monkeypatch.setattr(engines, "solve_cpsat", lambda *a, **k: corrupt(real_cpsat(*a, **k)))


@pytest.mark.parametrize("mode", ["none", "zeros", "ones", "short", "nan"])
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_checkpoint_engine_claiming_a_bad_solution_is_an_engine_fault(
        monkeypatch, method: str, mode: str) -> None:
    """A solution without values, NaN, too few values or rows violated: not decoded.

    Before, it was an ``optimal`` result without a plan (``none``), a ``PlanError`` (an
    input error) from replaying the decoded garbage, or an ``IndexError``/``ValueError``
    from the decoder.
    """
    corrupt_engines(monkeypatch, garbage(mode))
    problem = CheckpointProblem(CHAIN, MEMORY)
    warm = solve(problem, method)
    check_survived(warm)
    assert warm.status is Status.FEASIBLE and warm.report["incumbent"] == "dp plan"
    assert "without values" in warm.report["engine_error"] or \
        "invalid solution" in warm.report["engine_error"]
    cold = solve(problem, method, warm_start=False)
    check_survived(cold)
    assert cold.status is Status.ERROR


# problem, extra of the cold solve, extra of the warm one (None: no warm start to check)
UNDECODABLE: dict[str, tuple[Callable[[], Any], dict[str, Any], dict[str, Any] | None]] = {
    "pipeline": (lambda: PipelineProblem(_pipeline_chain(), 2, 10**6), {"relaxation": False},
                 {"relaxation": False, "warm_madpipe": False}),
    "offload": (lambda: OffloadProblem(CHAIN, OFFLOAD_MEMORY, chain_bandwidth=2.0), {}, {}),
    "remat-offload": (lambda: RematOffloadProblem(random_chain(2, seed=0), 46,
                                                  chain_bandwidth=1.0), {}, None),
}


@pytest.mark.parametrize(("kind", "mode"), [("pipeline", "zeros"), ("pipeline", "short"),
                                            ("pipeline", "nan"), ("offload", "short"),
                                            ("offload", "nan"), ("remat-offload", "short"),
                                            ("remat-offload", "nan")])
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_an_engine_solution_that_does_not_decode_is_an_engine_fault(
        monkeypatch, method: str, kind: str, mode: str) -> None:
    """Before: ``IndexError`` / ``ValueError`` (math domain, NaN to integer, zip) out of the
    pipeline and offload decoders and the remat-offload relaxation's lazy rounds."""
    corrupt_engines(monkeypatch, garbage(mode))
    make, cold_extra, warm_extra = UNDECODABLE[kind]
    problem = make()
    cold = solve(problem, method, warm_start=False, extra=cold_extra)
    check_survived(cold)
    assert cold.status is Status.ERROR and "does not decode" in cold.report["error"]
    if warm_extra is not None:
        warm = solve(problem, method, extra=warm_extra)
        check_survived(warm)
        assert warm.status is Status.FEASIBLE


@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_checkpoint_engine_infeasible_against_its_warm_start_is_an_engine_fault(
        monkeypatch, method: str) -> None:
    """The DP plan is a solution of the model: an ``infeasible`` engine is refuted.

    Before: ``status: infeasible`` although the verified DP plan fits.
    """
    import dataclasses

    def lie(out: engines.EngineResult) -> engines.EngineResult:
        return dataclasses.replace(out, status=Status.INFEASIBLE, values=None)

    corrupt_engines(monkeypatch, lie)
    result = solve(CheckpointProblem(CHAIN, MEMORY), method)
    check_survived(result)
    assert result.status is Status.FEASIBLE
    assert "warm-start plan is a solution" in result.report["engine_error"]
