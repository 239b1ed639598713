"""CP-SAT model of checkpointing on the full operation model (thesis ch. 2, Problem 6).

The same phase-indexed formulation as :mod:`optmem.models.checkpoint_ilp` (variables,
constraints and their exactness argument are documented there; RR-9302 Table 1 = thesis
Table 2.1 semantics), written for OR-Tools CP-SAT by the shared emitter
:func:`optmem.models.formulation.to_cpsat`: every variable is a ``BoolVar``, every
constraint a linear constraint with the integer sizes of the discretisation (CONTRACT
section 2) as coefficients.

:mod:`optmem.solvers.checkpoint_exact` builds the formulation with running memory variables
(``build_formulation(..., running_memory=True)``: one integer-valued stored size per state
change instead of rows over every state), with which CP-SAT's linear propagation proves the
chains ``compare`` gives it in seconds.

Times are floats; CP-SAT needs integers. The package's one time-scaling policy
(:func:`optmem.models.formulation.time_scale`) gives the objective scale: the smallest
``10**d`` (``d <= 6``) at which every forward time is integral (``exact_scale``). When no such
``d`` exists, the scaled times are rounded to integers (micro-units); the proven bound is
then lowered by the largest rounding error of the objective coefficients times their number,
so the bound reported for the true float makespan stays valid
(:meth:`CheckpointCpsat.true_bound`). The plan's makespan always comes from the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from optmem.models.checkpoint_ilp import Formulation
from optmem.models.formulation import CpsatModel, time_scale, to_cpsat

__all__ = ["CheckpointCpsat", "emit_cpsat", "time_scale"]


@dataclass
class CheckpointCpsat:
    """A CP-SAT model of a :class:`Formulation`.

    Attributes
    ----------
    formulation
        The neutral model.
    emitted
        The shared emitter's result (``CpModel``, variables, scales).
    """

    formulation: Formulation
    emitted: CpsatModel

    @property
    def model(self) -> Any:
        """The ``CpModel``."""
        return self.emitted.cp

    @property
    def variables(self) -> list[Any]:
        """The CP-SAT variables (formulation order)."""
        return self.emitted.variables

    @property
    def scale(self) -> int:
        """Objective scale: integer objective = ``scale`` x float objective."""
        return int(self.emitted.objective_scale)

    @property
    def exact_scale(self) -> bool:
        """Whether every forward time was integral at :attr:`scale` (no rounding)."""
        return self.emitted.exact

    def hint(self, values: Sequence[float] | None) -> list[int] | None:
        """Integer hint values from model values (``None`` passes through)."""
        return self.emitted.hint(values)

    def true_objective(self, scaled: float) -> float:
        """Float objective of an integer objective value (backward times added exactly)."""
        return self.emitted.objective(scaled)

    def true_bound(self, scaled_bound: float) -> float:
        """A lower bound on the float optimum from CP-SAT's integer bound."""
        if not math.isfinite(scaled_bound):
            return scaled_bound
        slack = 0.0 if self.exact_scale else (self.emitted.max_rounding
                                              * len(self.formulation.objective))
        return self.emitted.objective(scaled_bound - slack)


def emit_cpsat(form: Formulation) -> CheckpointCpsat:
    """Write ``form`` as a CP-SAT model (booleans, integer linear constraints)."""
    if form.peak_var is not None:
        raise ValueError("the min-peak model is emitted to PuLP only")
    scale, _ = time_scale(form.objective.values())
    return CheckpointCpsat(form, to_cpsat(form.model, scale=1, objective_scale=scale))
