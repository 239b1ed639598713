r"""Allocation decomposition (logic-based Benders) of the exact pipeline model.

The strategy ``extra={"strategy": "benders"}`` of methods ``ilp`` and ``cpsat``
(:mod:`optmem.solvers.pipeline_exact`). The full model of :mod:`optmem.models.pipeline`
decides the allocation and the 1-periodic pattern together; here they are split:

Master (allocations)
    The lifetime relaxation :func:`~optmem.models.pipeline.build_relaxation` at a probe
    period ``T`` (GPU and link loads, stash copies bounded by lifetimes, memory; GPUs
    numbered by their lowest unit, so each allocation appears once), plus one no-good row
    per allocation ``A`` already evaluated whose proven bound ``b_A`` exceeds ``T``:
    ``sum_q x[q, A_q] <= n - 1``. Its infeasibility (CP-SAT, exact integer ticks, durations
    rounded down) proves that no plan of any allocation has a period ``<= T``: the
    allocations it admits are all excluded by their own bound, the others by the relaxation.
Subproblem (one allocation)
    The full model with the allocation fixed (``gpu=A``, the model of
    :func:`~optmem.solvers.pipeline_common.run_model`) minimises the period below the
    incumbent. Its proven bound ``b_A`` (the optimum when proven, the incumbent when no plan
    of ``A`` beats it) holds at every later probe, so no allocation is solved twice; a plan
    it finds is replayed by the simulator and becomes the incumbent.
Probes
    Bisection on the relaxation's integer grid between the proven bound and the incumbent
    (the bound starts at ``lower``: the load bound or the relaxation's bisection). A probe
    ends when the master is infeasible (the bound rises to it), when a subproblem finds a
    plan at or below it (the incumbent falls), or at a limit / a subproblem that stops
    without proof (the loop ends; the bound stays the last one proven: valid).

No-goods are the only cuts: a refuted allocation gives no valid statement about others
(measured on the ResNet-50 headline: the relaxation admits tens of allocations per probe
near the bound, see ``benchmarks/results/pipeline_exact.md``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from optmem.engines import adapters as engines
from optmem.models.formulation import Expr, rational_time_scale, to_cpsat
from optmem.models.pipeline import TIME_RESOLUTION, Units, build_relaxation, make_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.pipeline_common import (
    OPTIMALITY_TOLERANCE,
    fits,
    lower_bound,
    proven,
    run_model,
)

Allocation = tuple[int, ...]
PHASE2_SHARE = 0.1
"""Share of the time left kept for phase 2 (the master's bisection) under a time limit."""
PHASE2_PRECISION = 1e-3
"""Phase 2 stops when the bound is within this (relative) of the incumbent's period."""


@dataclass
class Benders:
    """State and outcome of the decomposition (see the module docstring).

    ``bound``: proven lower bound on every plan's period (chain units); ``period``/``plan``:
    the incumbent (``plan`` replayed within the memory); ``cuts``: the proven bound of
    every evaluated allocation (GPU labels by first use); ``found``: plans the subproblems
    found, replayed and within the memory.
    """

    problem: PipelineProblem
    method: str
    options: SolveOptions
    period: float
    plan: PipelinePlan | None
    bound: float
    deadline: float | None = None
    units: Units = field(init=False)
    scale: int = field(init=False)
    cuts: dict[Allocation, float] = field(default_factory=dict)
    found: list[tuple[float, PipelinePlan]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    probes: int = 0
    masters: int = 0
    stop: str = ""

    def __post_init__(self) -> None:
        self.units = make_units(self.problem)
        low = lower_bound(self.problem)
        self.scale, _ = rational_time_scale([*self.units.f, *self.units.b, *self.units.dt],
                                            resolution=TIME_RESOLUTION * low)

    # ------------------------------------------------------------ limits
    def left(self) -> float | None:
        """Wall-clock seconds left (``None``: no limit)."""
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def out_of_time(self) -> bool:
        """Whether the wall-clock limit has passed."""
        left = self.left()
        return left is not None and left <= 0

    # ------------------------------------------------------------ the loop
    def run(self) -> Benders:
        """Refute every allocation below the incumbent, then bound what is left.

        Phase 1 probes just below the incumbent: the master proposes allocations, the
        subproblems bound each; it proves the incumbent optimal when the master runs out
        of allocations. When it cannot (a limit, or a subproblem stopped without proof),
        phase 2 bisects the master alone with every bound collected: its largest infeasible
        probe is a valid bound (the master's bound).
        """
        lo = max(math.floor(self.bound * self.scale) - 1, 0)
        reserve = self.deadline
        if self.deadline is not None:
            reserve = self.deadline - PHASE2_SHARE * max(0.0, self.left() or 0.0)
        verdict = ""
        while not proven(self.period, self.bound):
            top = self.top()
            if top <= lo:
                break
            verdict = self.probe(top, reserve)
            if verdict == "closed":
                self.bound = max(self.bound, top / self.scale)
            elif verdict != "improved":
                break
        if not proven(self.period, self.bound):
            self.stop = verdict or "no probe left"
            self.bisect(lo)
        self.report.update(benders_bound=self.bound, benders_probes=self.probes,
                           benders_masters=self.masters, benders_allocations=len(self.cuts))
        if self.stop:
            self.report["benders_phase1_stopped"] = self.stop
        return self

    def top(self) -> int:
        """The highest probe below the incumbent that would prove it optimal."""
        return math.floor(self.period * self.scale * (1 - OPTIMALITY_TOLERANCE / 2))

    def bisect(self, lo: int) -> None:
        """Phase 2: the master alone, bisected between ``lo`` and the incumbent."""
        hi = self.top()
        while hi - lo > max(1, PHASE2_PRECISION * hi) and not self.out_of_time():
            probe = (lo + hi) // 2
            self.probes += 1
            gpu = self.master(probe)
            if gpu is None:
                lo = probe
                self.bound = max(self.bound, probe / self.scale)
            elif isinstance(gpu, str):
                break
            else:
                hi = probe

    def probe(self, ticks: int, reserve: float | None) -> str:
        """Phase 1 at ``ticks``: ``closed``, ``improved``, or why it stopped undecided.

        ``closed``: no plan has a period ``<= ticks / scale``; ``improved``: the incumbent
        fell to or below it.

        Allocations whose subproblem stops without proof are set aside (no-goods of this
        probe only): enumeration goes on, but the probe can then not close.
        """
        self.probes += 1
        target = ticks / self.scale
        aside: list[Allocation] = []
        while True:
            left = None if reserve is None else reserve - time.perf_counter()
            if left is not None and left <= 0:
                return "time limit"
            gpu = self.master(ticks, aside, left)
            if isinstance(gpu, str):
                return gpu
            if gpu is None:
                return "subproblems stopped without proof" if aside else "closed"
            verdict = self.subproblem(gpu, left)
            if verdict:
                return verdict
            if self.period <= target:
                return "improved"
            if self.cuts[gpu] <= target:
                aside.append(gpu)

    def master(self, ticks: int, aside: list[Allocation] | None = None,
               left: float | None = None) -> Allocation | str | None:
        """An allocation the relaxation admits at ``ticks`` (``None``: none; str: why unknown).

        Excluded: allocations whose bound exceeds the probe, and ``aside``.
        """
        u, problem = self.units, self.problem
        target = ticks / self.scale
        form = build_relaxation(u, problem.n_gpus, problem.memory_per_gpu, ticks, self.scale,
                                strict=problem.memory_model == "strict")
        for k, (gpu, bound) in enumerate(self.cuts.items()):
            if bound > target or gpu in (aside or ()):
                form.model.add(Expr.sum(form.x[(q, gpu[q])] for q in range(u.n)) <= u.n - 1,
                               f"nogood_{k}")
        cm = to_cpsat(form.model, 1)
        res = engines.solve_cpsat(cm.cp, cm.variables, **{
            **engines.cpsat_settings(self.options),
            "time_limit_s": self.left() if left is None else left})
        self.masters += 1
        if res.failed:
            self.report["benders_error"] = res.report()["engine_error"]
            return "master failed"
        if res.status is Status.INFEASIBLE:
            return None
        if not res.status.has_plan or res.values is None:
            return "master stopped without an answer"
        values = cm.values(res.values)
        return tuple(max((p for p in range(form.n_gpus) if (q, p) in form.x),
                         key=lambda p: float(form.x[(q, p)].value(values)))
                     for q in range(u.n))

    def subproblem(self, gpu: Allocation, left: float | None) -> str:
        """Solve the allocation's model below the incumbent; record its bound (``""``: done)."""
        opts = self.options.with_(time_limit_s=left)
        run = run_model(self.problem, self.method, opts, gpu=list(gpu),
                        upper_bound=self.period, warm=self.plan, lower=self.bound)
        if run.failed:
            if run.engine is not None:
                self.report["benders_error"] = run.engine.report().get("engine_error", "")
            return "subproblem failed"
        plan = run.plan
        if plan is not None and plan.period < self.period and fits(self.problem, plan):
            self.found.append((plan.period, plan))
            self.period, self.plan = plan.period, plan
        if run.bound == math.inf:  # no plan of this allocation at or below the cutoff
            bound = self.period - 2 * run.step
        elif run.status is Status.OPTIMAL and plan is not None:
            bound = min(plan.period, run.bound) if math.isfinite(run.bound) else plan.period
        else:
            bound = run.bound if math.isfinite(run.bound) else self.bound
        self.cuts[gpu] = bound
        return ""


def solve_benders(problem: PipelineProblem, method: str, options: SolveOptions, *,
                  period: float, plan: PipelinePlan | None, bound: float,
                  deadline: float | None) -> Benders:
    """Run the decomposition from an incumbent (``period``, ``plan``) and a proven ``bound``.

    ``plan`` may be ``None`` with ``period`` an upper bound on the optimum (e.g. the
    sequential period); ``deadline``: :func:`time.perf_counter` value to stop at (``None``:
    none). Engine calls each get ``options``' deterministic limits as they are.
    """
    return Benders(problem, method, options, period, plan, bound, deadline).run()


__all__ = ["Benders", "solve_benders"]
