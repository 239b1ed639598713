"""Infeasible limits say the smallest feasible memory (pipeline, remat-offload)."""

from __future__ import annotations

from optmem.datasets import load_dataset
from optmem.problems.pipeline import PipelineProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers.checkpoint_dp import min_memory_persistent
from optmem.solvers.facade import solve


def test_pipeline_contiguous_smallest_memory_is_tight():
    chain = load_dataset("resnet50-b32-224")
    result = solve(PipelineProblem(chain, 2, 10**6, chain_bandwidth=12e6), "contiguous")
    assert result.status is Status.INFEASIBLE
    least = result.min_feasible_memory
    assert least is not None and least > 10**6
    at_least = solve(PipelineProblem(chain, 2, least, chain_bandwidth=12e6), "contiguous")
    assert at_least.status.has_plan
    below = solve(PipelineProblem(chain, 2, least - 1, chain_bandwidth=12e6), "contiguous")
    assert below.status is Status.INFEASIBLE


def test_remat_offload_infeasible_names_a_feasible_memory():
    chain = load_dataset("resnet-like-40")
    result = solve(RematOffloadProblem(chain, 1, chain_bandwidth=12e6), "dp")
    assert result.status is Status.INFEASIBLE
    least = result.report["checkpoint_min_memory"]
    assert least >= min_memory_persistent(chain)  # rounding to units needs a little more
    assert str(least) in result.report["hint"]
    # the plan without transfers (the dp's remat candidate) fits there; the dp itself at
    # that limit is checked on small chains in test_solvable_hints.py (49 s on this one)
    at_least = solve(RematOffloadProblem(chain, least, chain_bandwidth=12e6), "remat_only")
    assert at_least.status.has_plan
