r"""Large-neighbourhood search on the remat + offload model: a primal improvement stage.

Opt-in (``extra["lns"]``, default :data:`LNS_DEFAULT`) for the ``cpsat`` method of
:mod:`optmem.solvers.remat_offload_exact`: starting from the best verified candidate plan,
each *window* frees the compute binaries of a few phases of the phase-indexed model
(:mod:`optmem.models.checkpoint_ilp`: phase ``L+1`` is the forward pass before ``Loss``,
phase ``k <= L`` runs between ``B k+1`` and ``B k``) and fixes those of every other phase to
the incumbent's; every transfer binary stays free. CP-SAT solves that restriction of the one
model (:func:`~optmem.models.remat_offload.build_remat_offload`, digest
``shared/design/offload.md`` 0.2 and 5) within ``extra["lns_work"]`` deterministic seconds,
hinted with the incumbent's completion and with every time bounded by the incumbent's model
makespan (the incumbent stays a solution of every window, so a window never loses it).

Windows (:func:`phase_windows`): ``extra["lns_width"]`` consecutive backward phases
``[k, k + width - 1]``, ``k = 1, 1 + step, ...`` (``extra["lns_step"]``; overlapping when the
step is below the width), last backward phases (``B 1`` side) first, each with the forward
phase ``L+1`` too when ``extra["lns_forward"]`` (default true: on ResNet-50 at 10 % the
windows of backward phases alone were all proven optimal at the DP's plan, 118.82; with the
forward phase free the first one found 118.57, ``benchmarks/results/remat_offload_exact.md``,
``ro19``). The windows are visited in order, cyclically, until ``extra["lns_windows"]``
window solves are done, a whole cycle passes without improvement, or the solve's deadline
is spent (:mod:`optmem.solvers.time_budget`: a window with less than
:data:`~optmem.solvers.remat_offload.LEAST_ENGINE_TIME_S` left is not started). The total
work is therefore at most ``lns_work * lns_windows`` deterministic seconds (plus one
completion of the start plan, at most ``lns_work`` too).

Acceptance (the only thing that makes a plan count): a window's decoded plan is replayed by
the simulator (:func:`optmem.simulate.offload.simulate_offload`, peak within the limit) and
replaces the incumbent only when its *simulated* makespan is below the incumbent's
(relative 1e-9); the engine's objective is never trusted (on the rounded time grid it may be
below the plan's true makespan). So the stage returns a plan that replays and is never worse
than its start. It is a primal heuristic only: no bound is derived from it (a window's
CP-SAT bound is a bound of the neighbourhood, reported as ``bound`` per window, not of the
problem).

Validity of the restriction: fixing variables of a model (``with_fixed``) and lowering the
time variables' upper bounds to the incumbent's makespan ``z_m`` keeps every solution of the
model whose fixed binaries agree and whose times are at most ``z_m`` (the model's times are
at most its makespan in every solution: the objective is the last item's end and every
start is before it); the incumbent's completion is one of them, so CP-SAT always has a
solution to return (its hint).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from optmem.chain import Chain
from optmem.engines import adapters as engines
from optmem.errors import OptmemInputError, PlanError
from optmem.models.checkpoint_ilp import Slot
from optmem.models.formulation import Kind, to_cpsat
from optmem.models.remat_offload import RematOffloadModel, with_fixed
from optmem.plan import AnyOp
from optmem.result import SolveOptions
from optmem.simulate.offload import simulate_offload
from optmem.solvers.options import flag, positive_float, positive_int
from optmem.solvers.remat_offload import LEAST_ENGINE_TIME_S
from optmem.solvers.time_budget import Deadline, left_for_engine

__all__ = ["LNS_DEFAULT", "LNS_EXTRA", "LnsOutcome", "LnsSettings", "clamped",
           "complete_plan", "engine_limit", "improve", "lns_settings", "phase_windows",
           "window_solve"]

LNS_DEFAULT = False  # extra["lns"]: the search runs (opt-in)
LNS_WORK = 20.0  # extra["lns_work"]: CP-SAT deterministic seconds per window (ro19: 20)
LNS_WINDOWS = 12  # extra["lns_windows"]: most window solves
LNS_WIDTH = 4  # extra["lns_width"]: backward phases per window (ro19: 4)
LNS_STEP = 2  # extra["lns_step"]: first backward phase of one window to the next's
LNS_FORWARD = True  # extra["lns_forward"]: the forward phase is free in every window
LNS_EXTRA = ("lns", "lns_work", "lns_windows", "lns_width", "lns_step", "lns_forward")
# CP-SAT parameters of the windows: a lighter presolve. On ResNet-50 at 10 % (78 k
# variables) the default presolve of a window took more than 8 deterministic seconds before
# any search (no solution returned, not even the hint); without probing and symmetry
# detection the window phases 1-4 + 23 from the DP's 118.82 found and proved 118.57 within
# 20 deterministic seconds (65 CPU s) where the default stopped at its limit (ro22,
# benchmarks/results/remat_offload_exact.md)
WINDOW_PARAMETERS = {"cp_model_probing_level": 0, "symmetry_level": 0}
LOG = logging.getLogger(__name__)
ACCEPT_TOLERANCE = 1e-9  # relative: a window's plan must be this much faster to count


@dataclass(frozen=True)
class LnsSettings:
    """The checked ``extra`` options of the search (:func:`lns_settings`)."""

    enabled: bool = LNS_DEFAULT
    work: float = LNS_WORK
    windows: int = LNS_WINDOWS
    width: int = LNS_WIDTH
    step: int = LNS_STEP
    forward: bool = LNS_FORWARD


def lns_settings(options: SolveOptions) -> LnsSettings:
    """The search's options from ``options.extra``; :class:`OptmemInputError` if one is bad.

    Checked whether or not ``lns`` is on (before any work).

    Examples
    --------
    >>> lns_settings(SolveOptions(extra={"lns": True, "lns_width": 6})).width
    6
    >>> lns_settings(SolveOptions(extra={"lns_work": 0}))
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'lns_work': expected a positive number lns_work, got 0
    """
    return LnsSettings(enabled=flag(options, "lns", LNS_DEFAULT),
                       work=positive_float(options, "lns_work", LNS_WORK),
                       windows=positive_int(options, "lns_windows", LNS_WINDOWS),
                       width=positive_int(options, "lns_width", LNS_WIDTH),
                       step=positive_int(options, "lns_step", LNS_STEP),
                       forward=flag(options, "lns_forward", LNS_FORWARD))


def phase_windows(length: int, width: int, step: int, forward: bool
                  ) -> list[frozenset[int]]:
    """The windows' free phases: ``[k, k + width - 1]`` (capped at ``L``), plus ``L+1``.

    ``k = 1, 1 + step, ...`` while the previous window did not reach phase ``L``; with
    ``width >= L`` one window frees every backward phase (and the forward one when
    ``forward``: then every compute binary is free and the window is the whole model).

    Examples
    --------
    >>> [sorted(w) for w in phase_windows(5, 2, 2, True)]
    [[1, 2, 6], [3, 4, 6], [5, 6]]
    >>> [sorted(w) for w in phase_windows(3, 4, 1, False)]
    [[1, 2, 3]]
    """
    if width < 1 or step < 1:
        raise OptmemInputError("lns_width and lns_step must be positive", field="lns_width")
    out: list[frozenset[int]] = []
    k = 1
    while True:
        last = min(length, k + width - 1)
        phases = set(range(k, last + 1))
        if forward:
            phases.add(length + 1)
        out.append(frozenset(phases))
        if last >= length:
            return out
        k += step


@dataclass(frozen=True)
class LnsOutcome:
    """The search's result: the best plan (replayed), its simulated makespan, a report."""

    plan: tuple[AnyOp, ...]
    makespan: float
    improved: bool
    report: dict[str, Any]


Accept = Callable[[tuple[AnyOp, ...]], float | None]


def clamped(built: RematOffloadModel, values: Sequence[float]) -> list[float]:
    """An assignment with continuous values within ``[lo, makespan]`` and binaries rounded.

    Unused time variables may sit anywhere below the model's horizon; every used one is at
    most the makespan, so the clamped assignment is still a solution (as in the exact
    solver's warm start) and a valid hint under the horizon ``makespan``.
    """
    value = values[built.objective_var]
    return [min(max(x, v.lo), value, v.hi) if v.kind is Kind.CONTINUOUS else float(round(x))
            for v, x in zip(built.model.vars, values, strict=True)]


def improve(built: RematOffloadModel, chain: Chain, memory_limit: int, beta: float,
            scale: int, start: tuple[float, tuple[AnyOp, ...]], settings: LnsSettings,
            options: SolveOptions, deadline: Deadline | None = None, *,
            accept: Accept | None = None,
            clock: Callable[[], float] = time.monotonic) -> LnsOutcome:
    """Improve the plan ``start = (simulated makespan, plan)`` by windows (module docstring).

    ``built`` is the full model of the discretised ``chain`` (``memory_limit`` in its units,
    bandwidth ``beta``), ``scale`` the CP-SAT time grid (``1 / scale``). ``accept`` (the
    tests' hook; default: the simulator) returns a plan's makespan, or ``None`` when the
    plan does not replay within the limit. ``report``: ``start``, ``completion`` (the start
    plan's completion in the model: status and model makespan, or why none), ``windows``
    (per window solve: its ``phases``, CP-SAT ``status``, ``model_objective``, ``makespan``
    (the replayed plan's, if any), ``accepted``, neighbourhood ``bound``,
    ``deterministic_time``, engine ``seconds`` and ``cpu_s``, the process's CPU seconds of the
    window, model emission included), ``best`` and ``cpu_s`` / ``seconds`` (the
    stage's process CPU and wall time).
    """
    began, cpu = clock(), time.process_time()
    deadline = Deadline(None) if deadline is None else deadline
    if accept is None:
        def accept(plan: tuple[AnyOp, ...]) -> float | None:
            try:
                return simulate_offload(chain, plan, beta, memory_limit).makespan
            except PlanError:  # engine tolerances: the simulator is the judge
                return None
    z, best = start
    report: dict[str, Any] = {"start": z, "windows": []}

    def done(note: str | None = None) -> LnsOutcome:
        if note is not None:
            report["note"] = note
        report["best"] = z
        report["seconds"] = round(clock() - began, 3)
        report["cpu_s"] = round(time.process_time() - cpu, 3)
        return LnsOutcome(best, z, z < start[0], report)

    fixed_plan = built.fixing(best)
    if fixed_plan is None:
        report["completion"] = "the start plan does not fit the model's slots"
        return done()
    hint = complete_plan(built, fixed_plan, scale, settings, options, deadline, report)
    if hint is None:
        return done()
    windows = phase_windows(chain.length, settings.width, settings.step, settings.forward)
    idle = 0  # window solves since the last improvement
    for n in range(settings.windows):
        if idle >= len(windows):
            return done("a whole cycle of windows without improvement")
        if deadline.spent(LEAST_ENGINE_TIME_S):
            return done("skipped (time)")
        phases = windows[n % len(windows)]
        entry, values = window_solve(built, hint, _in_phases(phases), scale, settings.work,
                                     options, deadline)
        entry = {"phases": sorted(phases), **entry}
        report["windows"].append(entry)
        idle += 1
        if values is None:
            continue
        plan = built.decode(values)
        sim = accept(plan)
        entry["makespan"] = sim
        entry["accepted"] = sim is not None and sim < z - ACCEPT_TOLERANCE * max(1.0, z)
        if entry["accepted"]:
            assert sim is not None
            z, best, idle = sim, plan, 0
            hint = clamped(built, values)
        LOG.info("lns window %d %s: %s, replayed %s, best %.6g, %.1f s", n, entry["phases"],
                 entry["status"], sim, z, entry["seconds"])
    return done("window count reached (lns_windows)")


def window_solve(built: RematOffloadModel, hint: Sequence[float],
                 free: Callable[[Slot], bool], scale: int, work: float,
                 options: SolveOptions, deadline: Deadline | None = None
                 ) -> tuple[dict[str, Any], list[float] | None]:
    """One window: CP-SAT with the compute binaries of the slots not ``free`` fixed to ``hint``.

    Times are bounded by ``hint``'s makespan and the solve is hinted with ``hint``, a
    solution of the model (a clamped completion: module docstring, validity); ``work`` is
    CP-SAT's deterministic seconds (:data:`WINDOW_PARAMETERS`, one thread).
    Returns the window's report (CP-SAT ``status``, ``deterministic_time``, engine
    ``seconds``, ``cpu_s`` with the emission, and with a solution its ``model_objective``
    and neighbourhood ``bound``) and the solution's values (``None`` without one). The
    phase windows of :func:`improve` and the benchmarks' stage x phase blocks
    (``benchmarks/bench_remat_offload_lns.py blocks``) use it.
    """
    fixed = {idx: float(round(hint[idx])) for slot in built.slots if not free(slot)
             for _, idx in slot.ops}
    window_cpu = time.process_time()
    cp = to_cpsat(with_fixed(built, fixed, hint[built.objective_var]), scale=scale)
    out = engines.solve_cpsat(
        cp.cp, cp.variables, hint=cp.hint(hint), threads=1, seed=options.seed,
        deterministic_time=work, time_limit_s=engine_limit(deadline),
        parameters=WINDOW_PARAMETERS)
    entry: dict[str, Any] = {"status": str(out.status),
                             "deterministic_time": out.info.get("deterministic_time"),
                             "seconds": round(out.time_s, 3),
                             "cpu_s": round(time.process_time() - window_cpu, 3)}
    if not out.status.has_plan or out.values is None:
        return entry, None
    values = cp.values(out.values)
    entry["model_objective"] = values[built.objective_var]
    if math.isfinite(out.bound):
        entry["bound"] = cp.objective(out.bound)
    return entry, values


def _in_phases(phases: frozenset[int]) -> Callable[[Slot], bool]:
    """A window's ``free``: the slots of ``phases``."""
    return lambda slot: slot.phase in phases


def engine_limit(deadline: Deadline | None) -> float | None:
    """An engine call's wall-clock limit: what ``deadline`` leaves, at least one minimum.

    The minimum is :data:`~optmem.solvers.remat_offload.LEAST_ENGINE_TIME_S`; ``None``
    when there is no deadline.
    """
    return left_for_engine(deadline, least=LEAST_ENGINE_TIME_S)


def complete_plan(built: RematOffloadModel, fixed: dict[int, float], scale: int,
                  settings: LnsSettings, options: SolveOptions, deadline: Deadline,
                  report: dict[str, Any]) -> list[float] | None:
    """The start plan's completion in the model (every plan binary fixed), clamped; or ``None``.

    CP-SAT within ``settings.work`` deterministic seconds; ``report["completion"]`` says what
    came of it. The completion is the first window's hint and bounds its times.
    """
    if deadline.spent(LEAST_ENGINE_TIME_S):
        report["completion"] = "skipped (time)"
        return None
    cp = to_cpsat(with_fixed(built, fixed), scale=scale)
    out = engines.solve_cpsat(cp.cp, cp.variables, threads=1, seed=options.seed,
                              deterministic_time=settings.work, time_limit_s=engine_limit(deadline))
    if not out.status.has_plan or out.values is None:
        report["completion"] = f"not completed ({out.status}: {out.message})"
        return None
    values = clamped(built, cp.values(out.values))
    if built.model.violated(values, tol=1e-5):
        report["completion"] = "completion not valid"
        return None
    report["completion"] = {"status": str(out.status),
                            "model_objective": values[built.objective_var],
                            "seconds": round(out.time_s, 3)}
    return values

