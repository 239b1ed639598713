"""optmem: given a network and a memory limit, the fastest way to train it, proven optimal.

Quick start
-----------
>>> from optmem import Chain, CheckpointProblem, solve
>>> chain = Chain.from_rotor([1], [2, 0], [1, 1], [1, 2])
>>> solve(CheckpointProblem(chain, 5)).objective
3.0
"""

from optmem.chain import Chain
from optmem.errors import ChainError, OptmemInputError, PlanError
from optmem.problems import (
    CheckpointProblem,
    MinPeakProblem,
    OffloadProblem,
    PipelineProblem,
    RematOffloadProblem,
)
from optmem.result import Result, SolveOptions, Status
from optmem.solvers.facade import available_methods, compare, solve

__version__ = "0.1.0"

__all__ = [
    "Chain", "ChainError", "CheckpointProblem", "MinPeakProblem", "OffloadProblem",
    "OptmemInputError", "PipelineProblem", "PlanError", "RematOffloadProblem", "Result",
    "SolveOptions", "Status", "available_methods", "compare", "solve",
]
