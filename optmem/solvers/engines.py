"""Engine adapters: PuLP + HiGHS (default), CBC (bundled with PuLP), Gurobi (optional), CP-SAT.

Each adapter maps its backend's status codes to :class:`optmem.result.Status` in exactly one
place (the ``_STATUS`` tables and ``_status`` helpers below) and returns an
:class:`EngineResult` with the variable values, the engine's objective, its proven bound and
its run time. Every adapter accepts a time limit, a thread count and a warm start (initial
values for every variable) and asks for a zero optimality gap.

PuLP, highspy and OR-Tools are imported inside the functions (ortools 9.15 and highspy >= 1.15
crash in one process; optmem pins highspy 1.14).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from optmem.errors import OptmemInputError, UnavailableError
from optmem.result import Status

ILP_ENGINES = ("highs", "cbc", "gurobi")
_REQUIRES = {"highs": ("pulp", "highspy"), "cbc": ("pulp",), "gurobi": ("pulp", "gurobipy"),
             "cpsat": ("ortools",)}


@dataclass(frozen=True)
class EngineResult:
    """What an engine reports.

    Attributes
    ----------
    status
        ``optimal`` (proven), ``feasible`` (a solution, limit hit), ``infeasible`` (proven),
        ``no_solution`` (limit hit without a solution) or ``error``.
    values
        One value per variable (``None`` without a solution).
    objective, bound
        The engine's objective and proven lower bound (``nan`` when unknown).
    engine
        Adapter name (``highs``, ``cbc``, ``gurobi``, ``cpsat``).
    time_s
        Wall-clock time of the engine call.
    message
        The backend's own status text.
    info
        Deterministic work counts: ``nodes`` (HiGHS); ``branches``, ``conflicts``,
        ``deterministic_time`` (CP-SAT).
    """

    status: Status
    values: list[float] | None
    objective: float
    bound: float
    engine: str
    time_s: float
    message: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def is_available(engine: str) -> bool:
    """Whether ``engine`` (``highs``, ``cbc``, ``gurobi``, ``cpsat``) can run here."""
    if engine not in _REQUIRES:
        return False
    if not all(importlib.util.find_spec(m) is not None for m in _REQUIRES[engine]):
        return False
    if engine == "cbc":
        import pulp  # type: ignore[import-untyped]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(pulp.PULP_CBC_CMD(msg=False).available())
    return True


def check_engine(engine: str) -> None:
    """Raise a clear error if ``engine`` is unknown or not installed."""
    if engine not in ILP_ENGINES:
        raise OptmemInputError(f"unknown ILP solver {engine!r} (expected one of "
                               f"{', '.join(ILP_ENGINES)})", field="solver")
    if not is_available(engine):
        raise UnavailableError(f"ILP solver {engine!r} is not installed "
                               f"(needs {', '.join(_REQUIRES[engine])})", field="solver")


# ------------------------------------------------------------------ PuLP engines
def solve_pulp(
    problem: Any, variables: Sequence[Any], engine: str = "highs", *,
    time_limit_s: float | None = None, threads: int = 2, initial: Sequence[float] | None = None,
    verbose: bool = False,
) -> EngineResult:
    """Solve a PuLP minimisation ``problem`` with ``engine``.

    Parameters
    ----------
    problem, variables
        The PuLP problem and its variables (the order of ``values`` and ``initial``).
    engine
        ``highs``, ``cbc`` or ``gurobi``.
    time_limit_s, threads, verbose
        Engine settings.
    initial
        A feasible assignment to start from (warm start), or ``None``.
    """
    check_engine(engine)
    if initial is not None:
        for v, x in zip(variables, initial, strict=True):
            v.setInitialValue(x)
    else:
        for v in variables:
            v.varValue = None
    start = time.perf_counter()
    if engine == "highs":
        status, bound, message = _solve_highs(problem, time_limit_s, threads, initial, verbose)
    elif engine == "cbc":
        status, bound, message = _solve_cbc(problem, time_limit_s, threads, initial, verbose)
    else:
        status, bound, message = _solve_gurobi(problem, time_limit_s, threads, initial, verbose)
    elapsed = time.perf_counter() - start
    values = None
    objective = math.nan
    if status.has_plan:
        values = [v.varValue if v.varValue is not None else 0.0 for v in variables]
        value = problem.objective.value()  # None for an empty objective (PuLP's dummy)
        objective = float(problem.objective.constant if value is None else value)
        if status is Status.OPTIMAL:
            bound = objective
    info = _highs_work(problem) if engine == "highs" else {}
    return EngineResult(status, values, objective, bound, engine, elapsed, message, info=info)


def _highs_work(problem: Any) -> dict[str, Any]:
    """HiGHS's deterministic work count: branch-and-bound ``nodes`` of the last run."""
    model = getattr(problem, "solverModel", None)
    if model is None:
        return {}
    return {"nodes": int(model.getInfo().mip_node_count)}


_HIGHS_STATUS: dict[str, Status] = {
    "kOptimal": Status.OPTIMAL,
    "kInfeasible": Status.INFEASIBLE,
    "kTimeLimit": Status.NO_SOLUTION,  # FEASIBLE when a primal solution exists
    "kIterationLimit": Status.NO_SOLUTION,
    "kSolutionLimit": Status.NO_SOLUTION,
    "kInterrupt": Status.NO_SOLUTION,
    "kHighsInterrupt": Status.NO_SOLUTION,
    "kMemoryLimit": Status.NO_SOLUTION,
    "kObjectiveBound": Status.NO_SOLUTION,
    "kObjectiveTarget": Status.NO_SOLUTION,
}


def _highs_status(model_status: Any, has_solution: bool) -> Status:
    """HiGHS model status -> Status (the one mapping for HiGHS)."""
    name = getattr(model_status, "name", str(model_status).split(".")[-1])
    status = _HIGHS_STATUS.get(name, Status.ERROR)
    if status is Status.NO_SOLUTION and has_solution:
        return Status.FEASIBLE
    return status


def _solve_highs(problem: Any, time_limit_s: float | None, threads: int,
                 initial: Sequence[float] | None, verbose: bool) -> tuple[Status, float, str]:
    import highspy  # type: ignore[import-untyped]
    import pulp  # type: ignore[import-untyped]

    class _Highs(pulp.HiGHS):  # type: ignore[misc, name-defined]
        """PuLP's highspy interface plus a warm start and the final info."""

        captured: dict[str, Any] = {}

        def callSolver(self, lp: Any) -> None:  # noqa: N802 - PuLP's name
            h = lp.solverModel
            if initial is not None:
                cols = sorted(lp.variables(), key=lambda v: v.index)
                sol = highspy.HighsSolution()
                sol.col_value = [float(v.varValue or 0.0) for v in cols]
                sol.value_valid = True
                h.setSolution(sol)
            # HiGHS keeps one global thread pool, sized by the first run of the process: a
            # later run asking for another thread count fails (kNotset) unless it is reset
            h.resetGlobalScheduler(True)
            h.run()
            info = h.getInfo()
            self.captured = {"status": h.getModelStatus(),
                             "bound": float(info.mip_dual_bound),
                             "has_solution": int(info.primal_solution_status) == 2}

    solver = _Highs(msg=verbose, gapRel=0.0, gapAbs=1e-9, threads=threads,
                    timeLimit=time_limit_s)
    problem.solve(solver)
    cap = solver.captured
    status = _highs_status(cap["status"], cap["has_solution"])
    bound = cap["bound"] + problem.objective.constant
    if not math.isfinite(bound):
        bound = math.nan
    return status, bound, str(cap["status"]).split(".")[-1]


_CBC_RESULT = re.compile(r"Result - (.*)")
_CBC_LOWER = re.compile(r"Lower bound:\s*([-+0-9.eE]+)")


def _cbc_status(result_line: str, pulp_status: int, sol_status: int) -> Status:
    """CBC result line and PuLP codes -> Status (the one mapping for CBC)."""
    import pulp  # type: ignore[import-untyped]

    text = result_line.lower()
    if "optimal solution found" in text:
        return Status.OPTIMAL
    if "infeasible" in text or pulp_status == pulp.LpStatusInfeasible:
        return Status.INFEASIBLE
    if "stopped" in text or "time limit" in text:
        has = sol_status == pulp.LpSolutionIntegerFeasible
        return Status.FEASIBLE if has else Status.NO_SOLUTION
    if pulp_status == pulp.LpStatusOptimal:
        return Status.OPTIMAL
    return Status.ERROR


def _run_cbc(problem: Any, time_limit_s: float | None, threads: int, warm: bool,
             verbose: bool, log: str, time_mode: str) -> int:
    """Run CBC once (``time_mode``: ``elapsed`` or ``cpu`` seconds) and return PuLP's status."""
    import pulp  # type: ignore[import-untyped]

    with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC for 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=verbose, timeLimit=time_limit_s, threads=threads,
                                   gapRel=0.0, gapAbs=1e-9, warmStart=warm, logPath=log,
                                   timeMode=time_mode)
    return int(problem.solve(solver))


def _solve_cbc(problem: Any, time_limit_s: float | None, threads: int,
               initial: Sequence[float] | None, verbose: bool) -> tuple[Status, float, str]:
    import pulp  # type: ignore[import-untyped]

    fd, log = tempfile.mkstemp(suffix=".log", prefix="optmem-cbc-")
    os.close(fd)
    try:
        warm = initial is not None
        try:
            pulp_status = _run_cbc(problem, time_limit_s, threads, warm, verbose, log, "elapsed")
        except pulp.PulpSolverError:
            if not warm or time_limit_s is None:
                raise
            # the bundled CBC 2.10 segfaults when an elapsed-time limit hits while it is
            # still processing a MIP start (limits of a fraction of a second); counting CPU
            # time avoids the crash
            pulp_status = _run_cbc(problem, time_limit_s, threads, warm, verbose, log, "cpu")
        with open(log) as fh:
            text = fh.read()
    finally:
        os.unlink(log)
    result = _CBC_RESULT.findall(text)
    status = _cbc_status(result[-1] if result else "", pulp_status, problem.sol_status)
    low = _CBC_LOWER.findall(text)
    # PuLP does not give CBC the objective constant: add it back
    bound = float(low[-1]) + float(problem.objective.constant) if low else math.nan
    return status, bound, result[-1] if result else f"pulp status {pulp_status}"


def _gurobi_status(code: int, solutions: int) -> Status:
    """Gurobi status code -> Status (the one mapping for Gurobi)."""
    if code == 2:
        return Status.OPTIMAL
    if code in (3, 4):
        return Status.INFEASIBLE
    if code in (7, 8, 9, 10, 11, 13, 16, 17):
        return Status.FEASIBLE if solutions > 0 else Status.NO_SOLUTION
    return Status.ERROR


def _solve_gurobi(problem: Any, time_limit_s: float | None, threads: int,
                  initial: Sequence[float] | None, verbose: bool) -> tuple[Status, float, str]:
    import pulp  # type: ignore[import-untyped]

    solver = pulp.GUROBI(msg=verbose, timeLimit=time_limit_s, warmStart=initial is not None,
                         gapRel=0.0, Threads=threads)
    problem.solve(solver)
    model = problem.solverModel
    status = _gurobi_status(int(model.Status), int(model.SolCount))
    bound = float(model.ObjBound) + problem.objective.constant if model.SolCount else math.nan
    return status, bound, f"gurobi status {model.Status}"


# ------------------------------------------------------------------ CP-SAT
def _cpsat_status(code: Any, cp_model: Any) -> Status:
    """CP-SAT status -> Status (the one mapping for CP-SAT)."""
    return {
        cp_model.OPTIMAL: Status.OPTIMAL,
        cp_model.FEASIBLE: Status.FEASIBLE,
        cp_model.INFEASIBLE: Status.INFEASIBLE,
        cp_model.UNKNOWN: Status.NO_SOLUTION,
    }.get(code, Status.ERROR)


def solve_cpsat(
    model: Any, variables: Sequence[Any], *, time_limit_s: float | None = None,
    threads: int = 2, hint: Sequence[int] | None = None, verbose: bool = False,
) -> EngineResult:
    """Solve an OR-Tools ``CpModel`` (minimisation of an integer objective).

    ``objective`` and ``bound`` are in the model's integer units; ``hint`` (one value per
    variable) is passed with ``add_hint`` as a warm start.
    """
    if not is_available("cpsat"):
        raise UnavailableError("CP-SAT needs ortools", field="method")
    from ortools.sat.python import cp_model

    model.clear_hints()
    if hint is not None:
        for v, x in zip(variables, hint, strict=True):
            model.add_hint(v, int(x))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, threads)
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.log_search_progress = verbose
    solver.parameters.relative_gap_limit = 0.0
    solver.parameters.absolute_gap_limit = 0.0
    start = time.perf_counter()
    code = solver.solve(model)
    elapsed = time.perf_counter() - start
    status = _cpsat_status(code, cp_model)
    values = None
    objective = bound = math.nan
    if status.has_plan:
        values = [float(solver.value(v)) for v in variables]
        objective = float(solver.objective_value)
        bound = objective if status is Status.OPTIMAL else float(solver.best_objective_bound)
    work = {"branches": int(solver.num_branches), "conflicts": int(solver.num_conflicts),
            "deterministic_time": float(solver.deterministic_time)}  # deterministic counts
    return EngineResult(status, values, objective, bound, "cpsat", elapsed,
                        solver.status_name(code), info=work)
