"""CP-SAT model of checkpointing on the full operation model (thesis ch. 2, Problem 6).

The same phase-indexed formulation as :mod:`optmem.models.checkpoint_ilp` (variables,
constraints and their exactness argument are documented there; RR-9302 Table 1 = thesis
Table 2.1 semantics), emitted to OR-Tools CP-SAT: every variable is a ``BoolVar``, every
constraint a linear constraint with the integer sizes of the discretisation (CONTRACT
section 2) as coefficients.

Times are floats; CP-SAT needs integers. The objective uses ``round(u * scale)`` with
``scale = 10**d`` for the smallest ``d <= 6`` at which every forward time is integral
(``exact_scale``). When no such ``d`` exists, times are rounded to micro-units; then the
proven bound is shifted down by the largest possible rounding error (half a micro-unit per
forward slot), so the bound reported for the true float makespan stays valid
(:meth:`CheckpointCpsat.true_bound`). The plan's makespan always comes from the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from optmem.models.checkpoint_ilp import Formulation, build_formulation
from optmem.plan import Op
from optmem.problems.checkpoint import Discretized

MAX_DECIMALS = 6


def time_scale(times: Sequence[float]) -> tuple[int, bool]:
    """Smallest ``10**d`` (``d <= 6``) making every time integral, and whether one exists.

    Examples
    --------
    >>> time_scale([1.0, 2.0]), time_scale([0.25, 1.5]), time_scale([1 / 3])
    ((1, True), (100, True), (1000000, False))
    """
    for d in range(MAX_DECIMALS + 1):
        scale = 10**d
        if all(abs(t * scale - round(t * scale)) <= 1e-9 * max(1.0, abs(t * scale))
               for t in times):
            return scale, True
    return 10**MAX_DECIMALS, False


@dataclass
class CheckpointCpsat:
    """A CP-SAT model of a :class:`Formulation`.

    Attributes
    ----------
    formulation
        The neutral model.
    model, variables
        The ``CpModel`` and its ``BoolVar`` list (formulation order).
    scale, exact_scale
        Objective scale (integer objective = ``scale`` x float objective) and whether
        every forward time was integral at that scale.
    """

    formulation: Formulation
    model: Any
    variables: list[Any]
    scale: int
    exact_scale: bool

    def true_objective(self, scaled: float) -> float:
        """Float objective of an integer objective value (backward times added exactly)."""
        return scaled / self.scale + self.formulation.objective_const

    def true_bound(self, scaled_bound: float) -> float:
        """A lower bound on the float optimum from CP-SAT's integer bound."""
        if not math.isfinite(scaled_bound):
            return scaled_bound
        slack = 0.0 if self.exact_scale else 0.5 * len(self.formulation.objective)
        return (scaled_bound - slack) / self.scale + self.formulation.objective_const


def build_checkpoint_cpsat(disc: Discretized, variant: str = "full",
                           sweeps: int = 1) -> CheckpointCpsat:
    """Build the CP-SAT model of the discretised instance ``disc``."""
    return emit_cpsat(build_formulation(disc.chain, disc.memory_limit, variant, sweeps))


def emit_cpsat(form: Formulation) -> CheckpointCpsat:
    """Write ``form`` as a CP-SAT model (booleans, integer linear constraints)."""
    from ortools.sat.python import cp_model

    if form.peak_var is not None:
        raise ValueError("the min-peak model is emitted to PuLP only")
    model = cp_model.CpModel()
    xs = [model.new_bool_var(n) for n in form.names]
    for con in form.constraints:
        if not con.terms:
            model.add_bool_or([])  # a violated constant row: infeasible
            continue
        coefs = [int(round(c)) for _, c in con.terms]
        expr = sum(c * xs[i] for (i, _), c in zip(con.terms, coefs, strict=True))
        lo = -math.inf if con.lo is None else con.lo
        hi = math.inf if con.hi is None else con.hi
        if lo == hi:
            model.add(expr == int(round(lo)))
            continue
        if con.hi is not None:
            model.add(expr <= math.floor(hi + 1e-9))
        if con.lo is not None:
            model.add(expr >= math.ceil(lo - 1e-9))
    scale, exact = time_scale(list(form.objective.values()))
    model.minimize(sum(int(round(c * scale)) * xs[i] for i, c in form.objective.items()))
    return CheckpointCpsat(form, model, xs, scale, exact)


def decode_checkpoint_cpsat(model: CheckpointCpsat, values: Sequence[float]) -> tuple[Op, ...]:
    """The plan of a CP-SAT solution (one value per variable)."""
    return model.formulation.decode([round(v) for v in values])
