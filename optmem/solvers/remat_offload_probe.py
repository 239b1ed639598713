r"""The capped probe of the remat + offload model: close a gap from both sides at once.

Opt-in (``extra["probe_gap"]``, a share in (0, 1); ``extra["probe_work"]``, CP-SAT's
deterministic seconds, default :data:`PROBE_WORK`) for the ``cpsat`` method of
:mod:`optmem.solvers.remat_offload_exact`. When a solve ends ``feasible`` with a plan of
makespan ``z`` and a bound below ``(1 - g) z``, CP-SAT decides the whole model
(:func:`~optmem.models.remat_offload.build_remat_offload`, digest ``shared/design/
offload.md`` 0.2 and 5) with every time at most the *cap* ``c = (1 - g) z`` and the
summed sequence rows (:func:`~optmem.models.remat_offload.summed_sequence`: a knapsack row
on the compute binaries that the cap makes binding). Either verdict closes the gap to
``g``:

* **infeasible**: no plan of the model's class has a makespan ``<= c``, so ``c`` is a
  proven bound; the gap is then at most ``g``;
* **a solution**: its decoded plan, replayed by the simulator
  (:func:`~optmem.simulate.offload.simulate_offload`), becomes the plan when it is faster
  (a plan within ``c``, i.e. within ``g`` of every bound below ``c``);
* **undecided** within the work: nothing changes (``report["probe"]`` says so).

Validity of the cap (the argument of :mod:`optmem.solvers.remat_offload_lns`): every time
variable of the model is at most its makespan in the simulator's earliest schedule of a
plan, and an unused one can be lowered to its least value, so every plan of makespan
``<= c`` is a solution of the capped model. On CP-SAT's grid (``1 / scale``) the probe
proves something only when every duration and transfer time is on it
(``exact``; the plan's earliest schedule is then on the grid too); with rounded times it is
skipped. Measured: ResNet-50 at 10 % (``bench_exact.py``'s instance), cap 117.40 below the
best plan 118.57: infeasible after 961.6 deterministic seconds (1349 CPU s, one worker),
a gap of 0.98 % where the link relaxation's 117.25 left 1.12 %
(``benchmarks/results/remat_offload_exact.md``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optmem.engines import adapters as engines
from optmem.errors import PlanError
from optmem.models.formulation import grid_ceiling, to_cpsat
from optmem.models.remat_offload import RematOffloadModel, summed_sequence, with_fixed
from optmem.plan import AnyOp
from optmem.result import Result, SolveOptions, Status
from optmem.solvers.options import fraction, positive_float
from optmem.solvers.remat_offload import LEAST_ENGINE_TIME_S
from optmem.solvers.remat_offload_lns import WINDOW_PARAMETERS, engine_limit
from optmem.solvers.time_budget import Deadline

__all__ = ["PROBE_EXTRA", "PROBE_WORK", "ProbeOutcome", "capped_probe", "probe_result",
           "probe_settings"]

PROBE_WORK = 600.0  # extra["probe_work"]: CP-SAT deterministic seconds of the probe
PROBE_EXTRA = ("probe_gap", "probe_work")


def probe_settings(options: SolveOptions) -> tuple[float | None, float]:
    """``(probe_gap, probe_work)`` from ``options.extra``; the gap ``None`` when off.

    Checked before any work: the gap is a share in (0, 1), the work a positive number.

    Examples
    --------
    >>> probe_settings(SolveOptions(extra={"probe_gap": 0.01}))
    (0.01, 600.0)
    >>> probe_settings(SolveOptions())
    (None, 600.0)
    """
    return fraction(options, "probe_gap"), positive_float(options, "probe_work", PROBE_WORK)


@dataclass(frozen=True)
class ProbeOutcome:
    """What the probe proved or found: a bound, a faster plan, and the report entry."""

    report: dict[str, Any]
    bound: float = -math.inf
    plan: tuple[AnyOp, ...] | None = None
    makespan: float = math.inf


Replay = Callable[[tuple[AnyOp, ...]], float]


def capped_probe(built: RematOffloadModel, scale: int, exact: bool, cap: float,
                 work: float, options: SolveOptions, deadline: Deadline,
                 replay: Replay) -> ProbeOutcome:
    """CP-SAT on the model with every time at most ``cap`` (module docstring).

    ``replay(plan)`` is the simulated makespan of a decoded plan (``PlanError`` if it does
    not replay). Returns the proven bound ``cap`` when the capped model is infeasible, the
    plan and its makespan when one is found, and ``report`` (``cap``, CP-SAT ``status``,
    ``deterministic_time``, ``cpu_s``, ``seconds``).
    """
    report: dict[str, Any] = {"cap": cap}
    if not exact:
        report["status"] = "skipped (times rounded to CP-SAT's grid: no proof)"
        return ProbeOutcome(report)
    if deadline.spent(LEAST_ENGINE_TIME_S):
        report["status"] = "skipped (time)"
        return ProbeOutcome(report)
    began, cpu = time.monotonic(), time.process_time()
    model = with_fixed(built, {}, cap)
    model.add(summed_sequence(model), "summed_sequence")
    cp = to_cpsat(model, scale=scale)
    # the lns windows' lighter presolve: on ResNet-50 at 10 % the capped model with
    # CP-SAT's default presolve got no verdict in 300 deterministic seconds (790 CPU s),
    # the lighter one its infeasibility in 962 (benchmarks/results/remat_offload_exact.md)
    out = engines.solve_cpsat(cp.cp, cp.variables, threads=1, seed=options.seed,
                              deterministic_time=work, time_limit_s=engine_limit(deadline),
                              parameters=WINDOW_PARAMETERS)
    report.update(status=str(out.status), deterministic_time=out.info.get("deterministic_time"),
                  cpu_s=round(time.process_time() - cpu, 3),
                  seconds=round(time.monotonic() - began, 3))
    if out.status is Status.INFEASIBLE:
        return ProbeOutcome(report, bound=cap)
    if not out.status.has_plan or out.values is None:
        return ProbeOutcome(report)
    plan = built.decode(cp.values(out.values))
    try:
        makespan = float(replay(plan))
    except PlanError as exc:  # engine tolerances: the simulator is the judge
        report["plan"] = f"does not replay: {exc}"
        return ProbeOutcome(report)
    report["makespan"] = makespan
    return ProbeOutcome(report, plan=plan, makespan=makespan)


def probe_result(res: Result, built: RematOffloadModel, scale: int, exact: bool,
                 options: SolveOptions, deadline: Deadline, replay: Replay,
                 rebuild: Callable[[tuple[AnyOp, ...], dict[str, Any]], Result]) -> Result:
    """``res`` after the capped probe, when ``extra["probe_gap"]`` asks for it.

    Runs only on a ``feasible`` result whose bound is below the cap; ``replay(plan)`` is a
    plan's simulated makespan and ``rebuild(plan, report)`` the result of a faster plan
    found. When the capped model is infeasible the bound is the cap lifted to the time
    grid (:func:`~optmem.models.formulation.grid_ceiling`: every plan's makespan is on it),
    and the result ``optimal`` when that meets the plan.
    """
    gap, work = probe_settings(options)
    if gap is None or res.status is not Status.FEASIBLE or res.objective is None:
        return res
    z = res.objective
    cap = z * (1 - gap)
    bound = res.bound if res.bound is not None and math.isfinite(res.bound) else -math.inf
    report = dict(res.report)
    if bound >= cap:
        report["probe"] = {"cap": cap, "status": "skipped (the bound is within probe_gap)"}
        return res.with_(report=report)
    out = capped_probe(built, scale, exact, cap, work, options, deadline, replay)
    report["probe"] = out.report
    if out.plan is not None and out.makespan < z * (1 - 1e-9):
        return rebuild(out.plan, report).with_(bound=bound)
    if out.bound > bound:  # every plan is above the cap, and on the grid (exact times)
        lifted = grid_ceiling(out.bound, scale)
        if lifted >= z * (1 - 1e-9):
            report["note"] = "the capped probe's bound, lifted to the time grid, meets the plan"
            return res.with_(report=report, bound=z, status=Status.OPTIMAL)
        return res.with_(report=report, bound=lifted)
    return res.with_(report=report)
