"""Problem definitions: one frozen dataclass per problem, data only (no ``solve``).

Every problem takes its memory limit in any form of :func:`optmem.units.memory_size` and
(offload, remat-offload, pipeline) its bandwidth in bytes per second or as a rate string
(:func:`optmem.units.chain_rate`), or in chain units through ``chain_bandwidth=``.
"""

from optmem.problems.checkpoint import CheckpointProblem, Discretized, discretize
from optmem.problems.min_peak import MinPeakProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.pipeline import PipelineProblem
from optmem.problems.remat_offload import RematOffloadProblem

__all__ = ["CheckpointProblem", "Discretized", "MinPeakProblem", "OffloadProblem",
           "PipelineProblem", "RematOffloadProblem", "discretize"]
