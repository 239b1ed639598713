"""Engine layer: one adapter per exact backend (HiGHS, CBC, Gurobi through PuLP; CP-SAT).

This layer imports only the core (:mod:`optmem.errors`, :mod:`optmem.result`); exact models
(:mod:`optmem.models`) and solvers (:mod:`optmem.solvers`) sit above it
(``docs/architecture.md``).

* :mod:`optmem.engines.adapters`: build settings, solve, one status mapping per engine,
  engine faults turned into an ``error`` :class:`EngineResult`.
* :mod:`optmem.engines.results`: :func:`engine_failure`, a failed engine call turned into a
  :class:`~optmem.result.Result` (error, or ``feasible`` with a verified warm start).

Tests and callers that patch an adapter's globals (``CBC_PATH``, ``solve_pulp``) patch
:mod:`optmem.engines.adapters`, the module whose functions read them.
"""

from optmem.engines.adapters import (
    ILP_ENGINES,
    MAX_COEFFICIENT,
    EngineResult,
    WorkBudget,
    active_budget,
    carry_budget,
    check_engine,
    coefficient_scale,
    cpsat_settings,
    failed_result,
    is_available,
    outside_budget,
    pulp_settings,
    solve_cpsat,
    solve_pulp,
    work_budget,
)
from optmem.engines.results import FALLBACK_NOTE, engine_failure

__all__ = [
    "FALLBACK_NOTE",
    "ILP_ENGINES",
    "MAX_COEFFICIENT",
    "EngineResult",
    "WorkBudget",
    "active_budget",
    "carry_budget",
    "check_engine",
    "coefficient_scale",
    "cpsat_settings",
    "engine_failure",
    "failed_result",
    "is_available",
    "outside_budget",
    "pulp_settings",
    "solve_cpsat",
    "solve_pulp",
    "work_budget",
]
