"""Replay a plan file's plan for one problem and report what the simulator measured.

``optmem verify`` (and tests) call :func:`verify_plan`, which picks the verifier of the
problem's class. Each verifier accepts the shapes a plan file may take (a list of op
strings, or a ``solve --json`` object), replays the plan in this package's simulators and
returns the verified ``objective``, ``peak_memory`` and ``memory_limit`` with per-problem
details. Checkpoint plans are verified by :func:`optmem.cli.verify_checkpoint_plan` (it
discretises first). This module imports only the core and the simulators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan
from optmem.plan import parse_mixed_plan
from optmem.problems.checkpoint import DEFAULT_SLOTS
from optmem.problems.min_peak import (
    MinPeakProblem,
    checkpoint_plan,
    checkpoints_of_plan,
    normalize_checkpoints,
)
from optmem.problems.offload import OffloadProblem
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.simulate.min_peak import model_peak
from optmem.simulate.offload import simulate_offload
from optmem.simulate.pipeline import simulate_pipeline

__all__ = ["verify_min_peak_plan", "verify_offload_plan", "verify_pipeline_plan", "verify_plan"]


def verify_min_peak_plan(problem: MinPeakProblem, plan_data: Any,
                         options: SolveOptions | None = None) -> dict[str, Any]:
    """Check a min-peak plan and return its peak under the problem's model.

    ``plan_data`` is a list of op strings (the ``plan`` of ``optmem solve min-peak``), a
    list of checkpoint indices, or an object with a ``plan`` or ``checkpoints`` list.

    Raises
    ------
    PlanError
        If the plan is not a checkpoint plan, or its peak exceeds the memory limit.
    """
    del options
    data = plan_data
    if isinstance(data, dict):
        data = data.get("checkpoints", data.get("plan"))
    if not isinstance(data, list | tuple):
        raise PlanError("expected a list of ops, a list of checkpoints, or an object with "
                        "'plan' or 'checkpoints'")
    n = problem.n
    if all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        checkpoints = normalize_checkpoints(data, n)
    else:
        checkpoints = checkpoints_of_plan(data, n)
    peak = model_peak(problem, checkpoints)
    sim = simulate_checkpoint(problem.chain, checkpoint_plan(checkpoints))
    if problem.memory_limit is not None and peak > problem.memory_limit:
        raise PlanError(f"peak {peak} under the {problem.model} model exceeds the limit "
                        f"{problem.memory_limit}")
    return {
        "objective": peak, "peak_memory": peak, "memory_limit": problem.memory_limit,
        "model": problem.model, "checkpoints": list(checkpoints),
        "checkpoint_plan_makespan": sim.makespan, "checkpoint_plan_peak": sim.peak_memory,
    }


def verify_offload_plan(problem: OffloadProblem, plan_data: Any,
                        options: Any = None) -> dict[str, Any]:
    """Replay an offload (or combined remat + offload) plan (ops or ``solve --json`` output).

    Raises
    ------
    PlanError
        With the index of the first invalid op and the reason.
    """
    ops = plan_data.get("plan") if isinstance(plan_data, dict) else plan_data
    if not isinstance(ops, list):
        raise PlanError("expected a JSON list of ops or an object with a 'plan' list")
    slots = getattr(options, "slots", DEFAULT_SLOTS)
    disc = problem.discretize(slots)
    sim = simulate_offload(disc.chain, parse_mixed_plan(ops), problem.unit_bandwidth(disc.unit),
                           disc.memory_limit)
    if sim.peak_memory > disc.memory_limit:
        raise PlanError(f"the plan peaks at {sim.peak_memory}, above {disc.memory_limit}")
    return {"objective": sim.makespan, "peak_memory": sim.peak_memory,
            "memory_limit": disc.memory_limit, "unit": disc.unit, "ops": len(ops),
            "idle_time": sim.idle_time, "offloaded": sim.offloaded_size}


def verify_pipeline_plan(problem: PipelineProblem, plan_data: Any,
                         options: Any = None) -> dict[str, Any]:
    """Replay a pipeline plan (a result JSON, a plan JSON or a list of op strings).

    Returns ``objective`` (the period), ``peak_memory`` (largest GPU peak), ``memory_limit``,
    ``peaks`` (per GPU) and ``nca`` (per stage). Raises :class:`optmem.errors.PlanError`.
    """
    del options
    plan = PipelinePlan.from_any(plan_data)
    sim = simulate_pipeline(problem, plan)
    if sim.peak_memory > problem.memory_per_gpu:
        worst = max(range(len(sim.peaks)), key=lambda g: sim.peaks[g])
        raise PlanError(f"GPU {worst} peaks at {sim.peaks[worst]}, above the memory per GPU "
                        f"{problem.memory_per_gpu}")
    return {"objective": sim.period, "peak_memory": sim.peak_memory,
            "memory_limit": problem.memory_per_gpu, "peaks": list(sim.peaks),
            "nca": list(sim.nca)}


def verify_plan(problem: Any, plan_data: Any, options: Any = None) -> dict[str, Any]:
    """Replay ``plan_data`` for ``problem`` with the verifier of its class.

    Remat + offload problems are offload problems (their plans may also recompute).

    Raises
    ------
    PlanError
        If the plan is invalid or exceeds the memory limit.
    OptmemInputError
        If ``problem`` has no verifier here (checkpoint plans: ``optmem verify``).
    """
    for cls, verifier in _VERIFIERS:
        if isinstance(problem, cls):
            return verifier(problem, plan_data, options)
    raise OptmemInputError(f"no plan verifier for {type(problem).__name__}", field="problem")


_VERIFIERS: tuple[tuple[type, Callable[..., dict[str, Any]]], ...] = (
    (MinPeakProblem, verify_min_peak_plan),
    (OffloadProblem, verify_offload_plan),
    (PipelineProblem, verify_pipeline_plan),
)
