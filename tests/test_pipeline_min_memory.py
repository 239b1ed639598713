"""The smallest memory per GPU of a contiguous pipeline plan (``min_memory_contiguous``).

Since stop 75 a min-max partition DP; before, a doubling search and a bisection over
:func:`best_contiguous` (111 s to answer ``infeasible`` on ResNet-1001, 4 GPUs, 12 GiB).
Checked against that search (``pipeline_contiguous.min_memory_by_search``, kept as the
reference) and against the solver itself: ``contiguous`` has a plan at the threshold and
none one byte below.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.datasets import load_dataset
from optmem.datasets.synthetic import random_chain
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Status
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.facade import solve
from optmem.solvers.pipeline import min_memory_contiguous


@settings(max_examples=60, deadline=None, derandomize=True)
@given(length=st.integers(1, 9), seed=st.integers(0, 10_000), gpus=st.integers(1, 4),
       copies=st.integers(0, 3), buffers=st.booleans(),
       bandwidth=st.sampled_from([0.5, 2.0, float("inf")]))
def test_the_dp_is_the_searched_threshold(length: int, seed: int, gpus: int, copies: int,
                                          buffers: bool, bandwidth: float) -> None:
    chain = random_chain(length, seed=seed)
    problem = PipelineProblem(chain, gpus, 1, weight_copies=copies, buffers=buffers,
                              chain_bandwidth=bandwidth)
    least = min_memory_contiguous(problem)
    assert least == contig.min_memory_by_search(problem)
    assert contig.best_contiguous(replace(problem, memory_per_gpu=least)) is not None
    if least > 1:
        assert contig.best_contiguous(replace(problem, memory_per_gpu=least - 1)) is None


def test_a_long_chain_answers_infeasible_with_its_threshold() -> None:
    """ResNet-1001 (L = 339) on 4 GPUs of 12 GiB: ``infeasible`` with the threshold, which
    the solver then fits (one byte less it does not)."""
    chain = load_dataset("resnet1001-b8-224")
    problem = PipelineProblem(chain, 4, 12 * 2**30, "12GB/s")
    result = solve(problem, "contiguous")
    assert result.status is Status.INFEASIBLE
    least = result.min_feasible_memory
    assert least is not None and least > 12 * 2**30
    assert contig.best_contiguous(replace(problem, memory_per_gpu=least)) is not None
    assert contig.best_contiguous(replace(problem, memory_per_gpu=least - 1)) is None
