"""Problem definitions: one frozen dataclass per problem, data only (no ``solve``)."""

from optmem.problems.checkpoint import CheckpointProblem, Discretized, discretize

__all__ = ["CheckpointProblem", "Discretized", "discretize"]
