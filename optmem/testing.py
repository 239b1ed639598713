"""Assertions shared by the test suite: every plan goes through the simulator."""

from __future__ import annotations

import math

from optmem.problems.checkpoint import CheckpointProblem
from optmem.result import Result, SolveOptions
from optmem.simulate.checkpoint import SimulationResult, simulate_checkpoint


def assert_plan_valid(
    problem: CheckpointProblem, result: Result, options: SolveOptions | None = None
) -> SimulationResult:
    """Replay ``result.plan`` and check objective == makespan and peak <= limit.

    The plan is replayed on the problem's own discretisation (``options.slots``), not on
    anything the method reported, so a method cannot vouch for itself.
    """
    assert result.status.has_plan, f"{result.method}: no plan ({result.status})"
    disc = problem.discretize((options or SolveOptions()).slots)
    sim = simulate_checkpoint(disc.chain, result.plan, disc.memory_limit)
    assert math.isclose(sim.makespan, result.objective, rel_tol=1e-9, abs_tol=1e-9), (
        f"{result.method}: claimed {result.objective}, simulated {sim.makespan}")
    assert sim.peak_memory == result.peak_memory, (
        f"{result.method}: claimed peak {result.peak_memory}, simulated {sim.peak_memory}")
    assert sim.peak_memory <= disc.memory_limit
    return sim
