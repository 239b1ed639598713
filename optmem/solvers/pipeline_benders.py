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

Range no-goods (one refutation for many allocations)
    A refuted allocation is generalised by trimming: the units ``head .. n - tail - 1``
    alone, with the allocation's partition of them fixed
    (:func:`~optmem.models.pipeline.trim_units`), form a relaxation of *every* allocation
    that partitions them the same way, whatever it does with the dropped units (proof in
    its docstring: a plan restricted to a range of units is a plan of the trimmed units
    with the same period, within the same memory). When the trimmed model has no plan at
    the probe, the master gets the no-good of that partition, written on the "same GPU"
    variables (labels may differ): ``4^(head + tail)``-odd allocations go at once. Tails
    first (on the bundled profiles the last layers are small), steps doubling while the
    trimmed partition stays refuted; the next allocation first tries the last trimming that
    worked, before its full model.
GPU-set no-goods (``extra["isolate"]``, default ``False``)
    After the range no-good, two GPUs of the refuted partition are checked in isolation
    (:func:`~optmem.models.pipeline.isolate_units` on the trimmed units: the other units
    become delays without memory, each on a GPU of its own). When they have no plan at the
    probe, no allocation whose GPUs hold exactly those two unit sets within the range has
    one, however it splits the other units: the master gets that no-good on the "same GPU"
    variables (:func:`_sets_nogood`). Single GPUs in isolation are not tried: on the
    headline they never refute (``benchmarks/results/pipeline_exact.md``, part 6).
Co-location no-goods and the bound climb (``extra["colocate_step"]``, :func:`climb_bound`)
    A GPU set ``S`` of an allocation the master proposes is checked by the *full* model
    restricted to the allocations that put ``S`` on one GPU (every other unit free, the
    model's rows ``z(q, r) = 1`` for consecutive units of ``S``:
    :func:`~optmem.models.pipeline.build_pipeline_model`'s ``together``). That model's
    feasible set is exactly the plans of those allocations, so when CP-SAT proves it has no
    plan at a cutoff ``c`` (:func:`~optmem.solvers.pipeline_common.refute`: none at or
    below ``c - 2 / scale`` on its exact grid), no plan of *any* allocation co-locating
    ``S`` has a period ``<= c - 2 / scale``: the master gets ``sum_{consecutive q, r in S}
    z(q, r) <= |S| - 2`` (every allocation with ``S`` on one GPU has all those ``z`` at 1;
    every other one has one at 0, by transitivity), and ``S`` is first shrunk (units dropped,
    lightest stash first, while the smaller set stays refuted: dropping a unit relaxes the
    restriction, so a refuted subset excludes a superset of allocations). One refutation
    removes every allocation with ``S`` together: on the ResNet-50 headline at 30 ms the
    pairs ``{3, 4}``, ``{3, 5}`` and ``{4, 6}`` (the layer1 / layer2_0 stashes) are each
    refuted in 3-7 CPU s, where one fixed allocation excludes only itself. The climb probes
    ``bound x (1 + step)`` (at most just below the incumbent): the master with every
    no-good collected; infeasible closes the probe (a valid bound: each allocation is
    excluded by the relaxation or by a refuted set it co-locates) and the next is one step
    higher; an allocation none of whose GPU sets is refuted gets its own fixed-allocation
    refutation (an allocation no-good), and when that fails too the climb stops with the
    last closed probe. A refutation that finds a plan instead (replayed) lowers the
    incumbent and ends the climb (the plan lies within ``step`` of the bound; the full
    model takes it from there). ``extra["colocate_order"] = "bisect"`` probes halfway to the
    lowest probe found open instead (:meth:`Benders.climb`): same no-goods, same validity.
Ladder
    Phase 1 probes first at :data:`LADDER` gaps below the incumbent (1 %), then just below
    it: a closed rung is a valid bound, and its refutations (full allocations: bounds at the
    incumbent's cutoff) serve the later probes.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from optmem.engines import adapters as engines
from optmem.models.formulation import Expr, to_cpsat
from optmem.models.pipeline import (
    Units,
    build_relaxation,
    first_use,
    grid_scale,
    isolate_units,
    make_units,
    trim_units,
)
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.pipeline_common import (
    OPTIMALITY_TOLERANCE,
    fits,
    lower_bound,
    proven,
    refute,
    run_model,
)

Allocation = tuple[int, ...]
PHASE2_SHARE = 0.1
"""Share of the time left kept for phase 2 (the master's bisection) under a time limit."""
PHASE2_PRECISION = 1e-3
"""Phase 2 stops when the bound is within this (relative) of the incumbent's period."""
LADDER = (0.01,)
"""Relative gaps below the incumbent probed before the top probe (a closed one is a bound)."""
TRIM_PROBES = 6
"""Most trimmed solves spent on generalising one refuted allocation."""
TRIM_WORK = 2.0
"""Default ``extra["trim_work"]``: CP-SAT deterministic time of one trimmed solve (one
worker, so the same cuts on every run); ``None``: no limit."""
TRIM_MARGIN = 1e-4
"""A trimmed solve's cutoff: the probe's period times ``1 +`` this (its refutation must
hold strictly above the probe)."""
Range = tuple[int, int, Allocation]
"""``(head, tail, labels)``: the partition of units ``head .. n - tail - 1`` (first-use labels)."""
GpuSets = tuple[int, int, tuple[tuple[int, ...], ...]]
"""``(head, tail, sets)``: GPUs holding exactly these unit sets within units ``head ..
n - tail - 1`` (units numbered in the whole chain)."""
COLOCATE_WORK = 5.0
"""Default ``extra["colocate_work"]``: CP-SAT deterministic time of one co-location (or
fixed-allocation) refutation of the climb (one worker: the same no-goods on every run)."""
CLIMB_ORDERS = ("ladder", "bisect")
"""Values of ``extra["colocate_order"]`` (default ``ladder``): the climb's probe order."""
SHRINK_PROBES = 6
"""Most refutations spent on shrinking one refuted co-located set."""
ISOLATE = 2
"""GPUs kept together by ``extra["isolate"]`` (single GPUs never refute on the bundled
profiles: ``benchmarks/results/pipeline_exact.md``, part 6)."""


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
    ranges: dict[Range, float] = field(default_factory=dict)
    sets: dict[GpuSets, float] = field(default_factory=dict)
    together: dict[tuple[int, ...], float] = field(default_factory=dict)
    colocate_solves: int = 0
    report: dict[str, Any] = field(default_factory=dict)
    trims: int = 0
    probes: int = 0
    masters: int = 0
    stop: str = ""

    def __post_init__(self) -> None:
        self.units = make_units(self.problem)
        low = lower_bound(self.problem)
        self.scale, _ = grid_scale([*self.units.f, *self.units.b, *self.units.dt], low,
                                   refine=False)

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
            level = self.level(top, lo)
            verdict = self.probe(level, reserve)
            if verdict == "closed":
                self.bound = max(self.bound, level / self.scale)
                lo = max(lo, level)
            elif verdict != "improved":
                break
        if not proven(self.period, self.bound):
            self.stop = verdict or "no probe left"
            self.bisect(lo)
        self.report.update(benders_bound=self.bound, benders_probes=self.probes,
                           benders_masters=self.masters, benders_allocations=len(self.cuts),
                           benders_ranges=len(self.ranges), benders_trimmed_solves=self.trims,
                           benders_gpu_sets=len(self.sets))
        if self.stop:
            self.report["benders_phase1_stopped"] = self.stop
        return self

    def top(self) -> int:
        """The highest probe below the incumbent that would prove it optimal."""
        return math.floor(self.period * self.scale * (1 - OPTIMALITY_TOLERANCE / 2))

    def level(self, top: int, lo: int) -> int:
        """The next phase-1 probe: the first :data:`LADDER` rung above ``lo``, else ``top``.

        ``lo``: the highest probe closed so far (integer ticks, so a closed rung is never
        probed again).

        A closed rung is a bound within that gap of the incumbent, reached with far fewer
        allocations than the top probe admits; refutations made there serve later probes.
        """
        for gap in LADDER:
            rung = math.floor(self.period * (1 - gap) * self.scale)
            if lo < rung < top:
                return rung
        return top

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
            if self.refute_trimmed(gpu, target, left):
                continue
            verdict = self.subproblem(gpu, left)
            if verdict:
                return verdict
            if self.period <= target:
                return "improved"
            if self.cuts[gpu] <= target:
                aside.append(gpu)
            else:
                self.generalise(gpu, target, left)

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
        for k, ((head, _tail, labels), bound) in enumerate(self.ranges.items()):
            if bound > target:
                form.model.add(_partition_nogood(form.z, head, labels), f"rangenogood_{k}")
        for k, ((head, tail, sets), bound) in enumerate(self.sets.items()):
            if bound > target:
                form.model.add(_sets_nogood(form.z, range(head, u.n - tail), sets),
                               f"setnogood_{k}")
        for k, (group, bound) in enumerate(self.together.items()):
            if bound > target:
                form.model.add(_together_nogood(form.z, group), f"togethernogood_{k}")
        limit = self.left() if left is None else left
        if limit is not None and limit <= 0:
            return "time limit"
        cm = to_cpsat(form.model, 1)
        res = engines.solve_cpsat(cm.cp, cm.variables, **{
            **engines.cpsat_settings(self.options), "time_limit_s": limit})
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


    # ------------------------------------------------------------ trimmed refutations
    def trimmed_bound(self, gpu: Allocation, head: int, tail: int, target: float,
                      left: float | None) -> float | None:
        """Proven bound of every allocation that partitions units ``head..`` like ``gpu``.

        The fixed-allocation model of :func:`~optmem.models.pipeline.trim_units` (a
        relaxation of each such allocation, proof there; CP-SAT within ``extra["trim_work"]``,
        default :data:`TRIM_WORK`) as a feasibility problem with its
        period at most a cutoff just above ``target`` (feasibility is monotone in the
        period: stretching a plan's start times keeps it valid with the same copies). The
        bound is that cutoff (less the engine's grid) when it has no plan; ``None`` when it
        has one or the engine stops without an answer.
        """
        n = self.units.n
        return self.refuted(self.problem, trim_units(self.units, head, tail),
                            gpu[head:n - tail], target, left)

    def refuted(self, problem: PipelineProblem, units: Units, gpu: Allocation,
                target: float, left: float | None) -> float | None:
        """Proven bound of a relaxed instance (``None``: it has a plan, or no answer).

        A CP-SAT feasibility run of ``units`` with allocation ``gpu`` and the period at most
        a cutoff just above ``target``, within ``extra["trim_work"]``.
        """
        cutoff = min(self.period, target * (1 + TRIM_MARGIN))
        work = self.options.extra.get("trim_work", TRIM_WORK)
        if self.options.deterministic_time is not None:
            work = min(work, self.options.deterministic_time) if work is not None \
                else self.options.deterministic_time
        _, bound = refute(problem, self.options.with_(time_limit_s=left, deterministic_time=work),
                          cutoff, units=units, gpu=list(gpu))
        self.trims += 1
        return bound

    def record(self, gpu: Allocation, head: int, tail: int, bound: float) -> None:
        """Keep the range no-good of ``gpu``'s partition of units ``head .. n - tail - 1``."""
        labels = first_use(gpu[head:self.units.n - tail])
        key = (head, tail, labels)
        self.ranges[key] = max(bound, self.ranges.get(key, bound))

    def refute_trimmed(self, gpu: Allocation, target: float, left: float | None) -> bool:
        """Try the last trimming that refuted an allocation on ``gpu`` (before its full model).

        When it refutes ``gpu``, :meth:`generalise` goes on from it (the trimming that
        refuted the last allocation need not be the largest that refutes this one).
        """
        if not self.ranges:
            return False
        head, tail, _ = next(reversed(self.ranges))
        bound = self.trimmed_bound(gpu, head, tail, target, left)
        if bound is None or bound <= target:
            return False
        self.generalise(gpu, target, left, (head, tail, bound))
        return True

    def generalise(self, gpu: Allocation, target: float, left: float | None,
                   start: tuple[int, int, float] | None = None) -> None:
        """Drop units from the tail, then the head, while the trimmed partition stays refuted.

        Refutation is monotone in the trimming (trimming more relaxes more), so on each side
        steps double until a trimmed partition has a plan at the probe (or no answer), then
        bisect between the last refuted trimming and that one, within :data:`TRIM_PROBES`
        solves in all; the largest refuted trimming becomes a range no-good (at least two
        units are kept). ``start``: a trimming already refuted, with its bound.
        """
        n = self.units.n
        trim = [0, 0] if start is None else [start[0], start[1]]  # head, tail
        found = None if start is None else start[2]
        spent = 0
        for side in (1, 0):
            good, bad, step = trim[side], n - 1 - trim[1 - side], 1
            while bad - good > 1 and spent < TRIM_PROBES and not self.out_of_time():
                k = min(good + step, (good + bad) // 2) if step else (good + bad) // 2
                trial = [k, trim[1]] if side == 0 else [trim[0], k]
                bound = self.trimmed_bound(gpu, trial[0], trial[1], target, left)
                spent += 1
                if bound is None or bound <= target:
                    bad, step = k, 0  # bisect between the last refuted and this one
                else:
                    good, trim, found = k, trial, bound
                    step = 2 * step if step else 0
        if found is not None:
            self.record(gpu, trim[0], trim[1], found)
        if self.options.extra.get("isolate", False):
            self.isolate(gpu, trim[0], trim[1], target, left)

    def isolate(self, gpu: Allocation, head: int, tail: int, target: float,
                left: float | None) -> None:
        """Refute :data:`ISOLATE` GPUs of ``gpu``'s partition of units ``head..`` in isolation.

        :func:`~optmem.models.pipeline.isolate_units` on the trimmed units
        (:func:`~optmem.models.pipeline.trim_units`; relaxations compose: a plan of any
        allocation restricts to a plan of its trimmed partition, which isolates to a plan of
        the kept GPUs): when the kept GPUs have no plan at the probe, no allocation whose
        GPUs hold exactly those units within the range does, however it places the others.
        The first refuted subset becomes a GPU-set no-good.
        """
        n = self.units.n
        part = trim_units(self.units, head, tail) if head + tail else self.units
        labels = first_use(gpu[head:n - tail])
        used = sorted(set(labels))
        if len(used) <= ISOLATE:  # len(used) <= n_gpus
            return
        for kept in itertools.combinations(used, ISOLATE):
            if self.out_of_time():
                return
            relaxed, alloc = isolate_units(part, labels, kept)
            bound = self.refuted(replace(self.problem, n_gpus=max(alloc) + 1), relaxed,
                                 alloc, target, left)
            if bound is not None and bound > target:
                sets = tuple(tuple(head + q for q in range(len(labels)) if labels[q] == g)
                             for g in kept)
                key = (head, tail, sets)
                self.sets[key] = max(bound, self.sets.get(key, bound))
                return

    # ------------------------------------------------------------ co-location climb
    def climb(self, step: float, order: str = "ladder") -> None:
        """Raise :attr:`bound` by probes closed with co-location no-goods.

        ``order="ladder"``: probes ``bound x (1 + step)``, stopping at the first probe it
        cannot close. ``order="bisect"``: probes halfway between the bound and the ceiling
        (at first just below the incumbent), at least ``bound x (1 + step)``
        (:meth:`next_probe`): a closed probe raises the bound; an open one (an allocation
        none of whose GPU sets, nor itself, is refuted) lowers the ceiling below it; the
        climb stops when no step fits below the ceiling, or (as the ladder) at a plan met on
        the way (the new incumbent: going on below it, a probe at the top found plans a grid
        step better each time, without end, on a small chain). Either way the bound is the
        highest probe closed (valid: module docstring), and no-goods refuted at a high probe
        serve every lower one (:meth:`master` keeps those whose bound exceeds the probe).
        Stops at the deadline too.
        """
        probes = self.report.get("colocate_probes", 0)  # a resumed climb counts both
        closed = self.report.get("colocate_closed", 0)
        verdict = ""
        ceiling = self.top()
        while True:
            if self.out_of_time():
                verdict = "time limit"
                break
            ticks = self.next_probe(step, order, ceiling)
            if ticks is None:
                verdict = "no step below an open probe" if ceiling < self.top() \
                    else verdict or "incumbent reached"
                break
            probes += 1
            verdict = self.colocate_probe(ticks)
            if order == "bisect" and verdict == "allocation not refuted":
                ceiling = ticks - 1
                continue
            if verdict != "closed":
                break
            closed += 1
            self.bound = max(self.bound, ticks / self.scale)
        self.report.update(colocate_bound=self.bound, colocate_probes=probes,
                           colocate_closed=closed, colocate_nogoods=len(self.together),
                           colocate_allocations=len(self.cuts),
                           colocate_solves=self.colocate_solves,
                           colocate_masters=self.masters)
        if verdict and verdict != "closed":
            self.report["colocate_stopped"] = verdict

    def next_probe(self, step: float, order: str, ceiling: int) -> int | None:
        """The climb's next probe (integer ticks), ``None`` when none is left.

        ``ladder``: ``bound x (1 + step)``, at most :meth:`top`; ``bisect``: halfway
        between the bound and ``ceiling`` (the highest probe not found open), at least that
        rung (at most :meth:`top`). ``None`` when that probe is not above the bound, or the
        incumbent is proven, or (bisect) a probe below a full step was found open.
        """
        low = math.floor(self.bound * self.scale)
        rung = math.floor(self.bound * (1 + step) * self.scale)
        top = self.top()
        if order == "bisect" and ceiling < min(rung, top):
            return None
        ticks = min(rung, top) if order == "ladder" else max((low + ceiling) // 2, min(rung, top))
        if ticks <= low or proven(self.period, self.bound):
            return None
        return ticks

    def colocate_probe(self, ticks: int) -> str:
        """``closed`` when no plan has a period ``<= ticks / scale``, else why it stopped."""
        target = ticks / self.scale
        while True:
            if self.out_of_time():
                return "time limit"
            gpu = self.master(ticks)
            if isinstance(gpu, str):
                return gpu
            if gpu is None:
                return "closed"
            groups = sorted(({q for q in range(self.units.n) if gpu[q] == g}
                             for g in set(gpu)),
                            key=lambda grp: (-sum(self.units.x[q] for q in grp), min(grp)))
            verdict = ""
            for group in groups:
                if len(group) < 2:
                    continue
                verdict = self.refute_together(sorted(group), target)
                if verdict:
                    break
            if verdict == "refuted":
                continue
            if verdict:  # a plan at or below the probe
                return verdict
            bound = self.colocated_bound((), target, gpu)
            if isinstance(bound, str):
                return bound
            if bound is None or bound <= target:
                return "allocation not refuted"
            self.cuts[gpu] = max(bound, self.cuts.get(gpu, bound))

    def colocated_bound(self, group: tuple[int, ...], target: float,
                        gpu: Allocation | None = None) -> float | str | None:
        """Proven bound of every plan that puts ``group`` on one GPU (or of allocation ``gpu``).

        The full model with ``together=[group]`` (or ``gpu`` fixed), a feasibility run with
        the period at most a cutoff just above ``target`` (``extra["colocate_work"]``
        deterministic seconds, default :data:`COLOCATE_WORK`): the cutoff less the engine's
        grid when it has no plan; ``None`` undecided; ``"improved"`` when it found a plan
        (replayed within the memory: the new incumbent); ``"time limit"``.
        """
        # strictly above the probe, strictly below the incumbent (whose own allocation
        # would otherwise "refute" nothing at the top probe)
        cutoff = min(target * (1 + TRIM_MARGIN), (target + self.period) / 2)
        work = self.options.extra.get("colocate_work", COLOCATE_WORK)
        left = self.left()
        if left is not None and left <= 0:
            return "time limit"
        opts = self.options.with_(time_limit_s=left, deterministic_time=work)
        run, bound = refute(self.problem, opts, cutoff, lower=self.bound,
                            together=[group] if group else (),
                            gpu=None if gpu is None else list(gpu))
        self.colocate_solves += 1
        plan = run.plan
        if bound is None and plan is not None and not run.failed and fits(self.problem, plan) \
                and plan.period < self.period:
            self.found.append((plan.period, plan))
            self.period, self.plan = plan.period, plan
            return "improved"
        return bound

    def refute_together(self, group: list[int], target: float) -> str:
        """Refute ``group`` on one GPU at ``target``, shrink it, keep the no-good.

        ``"refuted"`` (a no-good was added), ``""`` (not refuted), or why it stopped
        (``"improved"``, ``"time limit"``; a refuted group is kept even then).
        """
        bound = self.colocated_bound(tuple(group), target)
        if isinstance(bound, str):
            return bound
        if bound is None or bound <= target:
            return ""
        for spent, q in enumerate(sorted(group, key=lambda r: (self.units.x[r], r))):
            if len(group) <= 2 or spent >= SHRINK_PROBES or self.out_of_time():
                break
            smaller = [r for r in group if r != q]
            found = self.colocated_bound(tuple(smaller), target)
            if isinstance(found, str):
                self.keep_together(group, bound)
                return found
            if found is not None and found > target:
                group, bound = smaller, found
        self.keep_together(group, bound)
        return "refuted"

    def keep_together(self, group: list[int], bound: float) -> None:
        """Record the co-location no-good of ``group`` (proven bound ``bound``)."""
        key = tuple(group)
        self.together[key] = max(bound, self.together.get(key, bound))


def _pairs_nogood(z: dict[tuple[int, int], Expr],
                  pairs: Iterable[tuple[int, int, bool]]) -> Any:
    """At least one of these unit pairs ``(q, r, together)``, ``q < r``, differs.

    Written on the "same GPU" variables ``z`` (any GPU labels): a pair agrees when ``z``
    is 1 for units ``together`` and 0 for units apart.
    """
    agree = [z[(q, r)] if together else 1 - z[(q, r)] for q, r, together in pairs]
    return Expr.sum(agree) <= len(agree) - 1


def _partition_nogood(z: dict[tuple[int, int], Expr], head: int, labels: Allocation) -> Any:
    """No allocation partitions units ``head .. head + len(labels) - 1`` as ``labels`` do.

    Every pair of the range, together where the labels agree (:func:`_pairs_nogood`).
    """
    return _pairs_nogood(z, ((head + i, head + j, labels[i] == labels[j])
                             for i, j in itertools.combinations(range(len(labels)), 2)))


def _sets_nogood(z: dict[tuple[int, int], Expr], units: range,
                 sets: tuple[tuple[int, ...], ...]) -> Any:
    """No allocation has GPUs holding exactly ``sets`` among ``units`` (any labels).

    The pairs of :func:`_pairs_nogood`: the units of one set together, two sets apart, no
    other unit of the range with a unit of a set.
    """
    member = {q: k for k, group in enumerate(sets) for q in group}
    return _pairs_nogood(z, ((min(q, r), max(q, r), member.get(r) == member[q])
                             for q in member for r in units
                             if r != q and not (r in member and r < q)))


def _together_nogood(z: dict[tuple[int, int], Expr], group: tuple[int, ...]) -> Any:
    """Not every unit of ``group`` (sorted) on one GPU: ``sum z(q, r) <= |group| - 2``.

    Over consecutive units ``q, r`` of the group: all ``|group| - 1`` of them are 1 exactly
    when the group shares a GPU ("same GPU" is an equivalence; ``z`` is derived exactly
    from the allocation).
    """
    return Expr.sum(z[(q, r)] for q, r in itertools.pairwise(group)) <= len(group) - 2


def climb_bound(problem: PipelineProblem, options: SolveOptions, *, period: float,
                plan: PipelinePlan | None, bound: float, deadline: float | None,
                step: float, order: str = "ladder", state: Benders | None = None) -> Benders:
    """Raise the proven ``bound`` by the co-location climb (``extra["colocate_step"]``).

    ``period``/``plan``: the incumbent (probes stay below it); ``deadline`` as in
    :func:`solve_benders`; ``order``: :data:`CLIMB_ORDERS` (``extra["colocate_order"]``,
    :meth:`Benders.climb`). The result's ``bound`` is valid (module docstring); ``found``
    holds the plans met on the way (replayed within the memory).

    ``state``: an earlier climb of the same problem (the one beside the search) to go on
    from: its no-goods, allocation bounds and plans are kept (each was proven or replayed
    for the problem, whatever the incumbent), it takes ``options`` (e.g. more threads),
    the better incumbent and the higher bound, and its report counts both climbs.
    """
    if state is None:
        out = Benders(problem, "cpsat", options, period, plan, bound, deadline)
    else:
        out = state
        if out.problem is not problem:
            raise ValueError("climb_bound: state belongs to another problem")
        out.options, out.deadline, out.bound = options, deadline, max(out.bound, bound)
        if period < out.period:
            out.period, out.plan = period, plan
        out.report.pop("colocate_stopped", None)
    out.climb(step, order)
    return out


def solve_benders(problem: PipelineProblem, method: str, options: SolveOptions, *,
                  period: float, plan: PipelinePlan | None, bound: float,
                  deadline: float | None) -> Benders:
    """Run the decomposition from an incumbent (``period``, ``plan``) and a proven ``bound``.

    ``plan`` may be ``None`` with ``period`` an upper bound on the optimum (e.g. the
    sequential period); ``deadline``: :func:`time.perf_counter` value to stop at (``None``:
    none). Engine calls each get ``options``' deterministic limits as they are.
    """
    return Benders(problem, method, options, period, plan, bound, deadline).run()


__all__ = ["CLIMB_ORDERS", "Benders", "climb_bound", "solve_benders"]
