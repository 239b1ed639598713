"""Memory/time trade-off sweeps: solve across memory limits, Pareto fronts, the curve.

``optmem sweep PROBLEM CHAIN --memory FROM:TO:STEPS --methods dp,chen,...`` solves the
problem at ``STEPS`` evenly spaced limits with every method (in parallel processes, with a
progress bar on stderr), keeps the Pareto front (memory, makespan) of each method, exports
CSV/JSON and draws the curve that every paper of the field shows (matplotlib, PNG or SVG).

On the plot: one step line per method through its Pareto front; filled markers for points
an exact method proved optimal, hollow ones for ``feasible`` points (time limit hit, or a
heuristic); a left-pointing triangle at the smallest memory where the method found a plan;
a star at its *store-all point*, the least memory at which it reaches its best makespan
(the no-recomputation makespan when it gets there); a grey band for the lower envelope
over all methods; dashed lines for the chain's store-all peak and no-recomputation time.

Python API::

    from optmem.sweep import sweep, CheckpointFactory
    result = sweep(CheckpointFactory(chain), limits, ["dp", "chen"], jobs=2)
    result.fronts()["dp"]; result.write_csv("s.csv"); result.plot("s.png")

The memory of a point is the plan's simulated peak in the chain's memory unit
(``peak_memory * unit``), not the limit it was solved under: a plan found under a large
limit may need much less, and the front keeps the least memory for each makespan.
matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from optmem.chain import Chain, check_text
from optmem.errors import OptmemInputError
from optmem.fileio import check_writable, write_atomic, write_text_atomic
from optmem.result import MAX_WORKERS, Result, SolveOptions, Status, check_integer
from optmem.units import MAX_SIZE, format_size, memory_size, parse_size

ProblemFactory = Callable[[int], Any]
CHECKPOINT_DEFAULT_METHODS = ("dp", "chen", "sequential", "revolve", "store_all")
CSV_FIELDS = ("method", "memory_limit", "status", "objective", "bound", "memory",
              "solve_time_s", "exact", "on_front", "min_feasible_memory", "error")


# ------------------------------------------------------------------ problem factories
@dataclass(frozen=True)
class CheckpointFactory:
    """``limit -> CheckpointProblem(chain, limit)`` (picklable, for worker processes)."""

    chain: Chain

    def __call__(self, memory_limit: int) -> Any:
        """The checkpoint problem at ``memory_limit``."""
        from optmem.problems import CheckpointProblem

        return CheckpointProblem(self.chain, memory_limit)


@dataclass(frozen=True)
class CliFactory:
    """``limit -> from_cli(chain, limit, args)`` of a problem's CLI hooks (picklable)."""

    problem: str
    chain: Chain
    args: dict[str, Any] = field(default_factory=dict)

    def __call__(self, memory_limit: int) -> Any:
        """The problem of the CLI arguments at ``memory_limit``."""
        from optmem.cli_problems import HOOKS

        if self.problem == "checkpoint":
            return CheckpointFactory(self.chain)(memory_limit)
        return HOOKS[self.problem].from_cli(self.chain, memory_limit,
                                            argparse.Namespace(**self.args))


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class SweepPoint:
    """One solve of the sweep.

    ``memory`` is the plan's peak in the chain's memory unit (``None`` without a plan);
    ``memory_limit`` the limit it was solved under; ``work_used`` the CP-SAT deterministic
    seconds the solve spent under a work budget (``SolveOptions.work_budget``; ``None``
    without one).
    """

    method: str
    memory_limit: int
    status: str
    objective: float | None
    bound: float | None
    memory: int | None
    solve_time_s: float
    exact: bool
    min_feasible_memory: int | None = None
    error: str | None = None
    work_used: float | None = None

    @property
    def has_plan(self) -> bool:
        """Whether the solve returned a plan."""
        return Status(self.status).has_plan and self.objective is not None

    @property
    def proven(self) -> bool:
        """Whether the point is a proven optimum (of the method's own model)."""
        return self.status == Status.OPTIMAL.value


def plan_memory(problem: Any, result: Result) -> int | None:
    """Peak of the result's plan in the chain's memory unit.

    Checkpoint plans are replayed on the chain itself (exact bytes); other problems report
    ``peak_memory * unit``, an upper bound (sizes were rounded up to units).
    """
    if not result.status.has_plan or result.peak_memory is None:
        return None
    if getattr(problem, "name", None) == "checkpoint":
        from optmem.simulate.checkpoint import simulate_checkpoint

        return simulate_checkpoint(problem.chain, result.plan).peak_memory
    return result.peak_memory * result.unit


def point_of(method: str, limit: int, result: Result, exact: bool,
             memory: int | None = None) -> SweepPoint:
    """Turn a :class:`Result` into a :class:`SweepPoint` (``memory``: the plan's peak)."""

    def num(v: float) -> float | None:
        return float(v) if v is not None and math.isfinite(v) else None

    if memory is None and result.status.has_plan and result.peak_memory is not None:
        memory = result.peak_memory * result.unit
    if not result.status.has_plan:
        memory = None
    return SweepPoint(method, limit, str(result.status), num(result.objective) if memory
                      is not None else None, num(result.bound), memory,
                      round(result.solve_time_s, 6), exact, result.min_feasible_memory,
                      result.report.get("error") if result.status is Status.ERROR else None,
                      result.report.get("work_used"))


def pareto_front(points: Iterable[SweepPoint]) -> list[SweepPoint]:
    """Points with a plan that no other point beats in both memory and makespan.

    Sorted by increasing memory; makespans strictly decrease along the front. Of equal
    points, a proven optimum is kept before a merely feasible one.

    Examples
    --------
    >>> p = [SweepPoint("dp", m, "optimal", t, t, m, 0.0, True) for m, t in
    ...      [(10, 5.0), (8, 6.0), (12, 5.0), (9, 7.0)]]
    >>> [(q.memory, q.objective) for q in pareto_front(p)]
    [(8, 6.0), (10, 5.0)]
    """
    usable = sorted((p for p in points if p.has_plan),
                    key=lambda p: (p.memory, p.objective, not p.proven))
    front: list[SweepPoint] = []
    for p in usable:
        assert p.objective is not None
        if not front or p.objective < (front[-1].objective or math.inf):
            if front and front[-1].memory == p.memory:
                front.pop()
            front.append(p)
    return front


@dataclass(frozen=True)
class SweepResult:
    """All points of a sweep and what is drawn from them."""

    problem: str
    chain_name: str
    memory_unit: str
    time_unit: str
    limits: tuple[int, ...]
    methods: tuple[str, ...]
    points: tuple[SweepPoint, ...]
    store_all_peak: int | None = None
    no_recompute_time: float | None = None
    wall_time_s: float = 0.0

    def method_points(self, method: str) -> list[SweepPoint]:
        """The points of one method, by increasing limit."""
        return sorted((p for p in self.points if p.method == method),
                      key=lambda p: p.memory_limit)

    def fronts(self) -> dict[str, list[SweepPoint]]:
        """Pareto front of every method."""
        return {m: pareto_front(self.method_points(m)) for m in self.methods}

    def envelope(self) -> list[SweepPoint]:
        """Lower envelope over all methods: the Pareto front of every point."""
        return pareto_front(self.points)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per method: smallest memory found, known smallest feasible memory, store-all point.

        The store-all point is the first front point at the method's best makespan; it is
        marked ``no_recompute`` when that makespan equals the chain's total compute time.
        """
        out: dict[str, dict[str, Any]] = {}
        for method, front in self.fronts().items():
            known = [p.min_feasible_memory for p in self.method_points(method)
                     if p.min_feasible_memory is not None]
            entry: dict[str, Any] = {
                "points": len(self.method_points(method)), "on_front": len(front),
                "min_memory": front[0].memory if front else None,
                "min_memory_makespan": front[0].objective if front else None,
                "min_feasible_memory": min(known) if known else None,
                "store_all_memory": front[-1].memory if front else None,
                "store_all_makespan": front[-1].objective if front else None,
                "no_recompute": bool(front and self.no_recompute_time is not None and
                                     front[-1].objective is not None and
                                     front[-1].objective <= self.no_recompute_time
                                     * (1 + 1e-9)),
                "solve_time_s": round(sum(p.solve_time_s for p in
                                          self.method_points(method)), 6),
            }
            out[method] = entry
        return out

    def to_json(self) -> dict[str, Any]:
        """Everything, as plain JSON values."""
        fronts = {m: [[p.memory, p.objective, p.status] for p in f]
                  for m, f in self.fronts().items()}
        return {
            "format": "optmem.sweep/1", "problem": self.problem, "chain": self.chain_name,
            "memory_unit": self.memory_unit, "time_unit": self.time_unit,
            "limits": list(self.limits), "methods": list(self.methods),
            "store_all_peak": self.store_all_peak, "no_recompute_time": self.no_recompute_time,
            "wall_time_s": round(self.wall_time_s, 3),
            "fronts": fronts, "summary": self.summary(),
            "points": [asdict(p) for p in self.points],
        }

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (atomically)."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n", field="json")

    def write_csv(self, path: str | Path) -> None:
        """One row per solve (``on_front`` marks the Pareto points), written atomically."""
        on_front = {(p.method, p.memory_limit) for f in self.fronts().values() for p in f}

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
                writer.writeheader()
                for p in self.points:
                    row = {k: v for k, v in asdict(p).items() if k in CSV_FIELDS}
                    row["on_front"] = (p.method, p.memory_limit) in on_front
                    writer.writerow(row)

        write_atomic(path, write, field="csv")

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Draw the memory/makespan curve to ``path`` (``.png``, ``.svg`` or ``.pdf``)."""
        from optmem.plotting import plot_sweep

        return plot_sweep(self, path, title=title)

    def table(self) -> str:
        """A plain-text summary, one line per method."""
        fmt = _memory_formatter(self.memory_unit)
        lines = [f"{'method':<14} {'points':>6} {'front':>5} {'min memory':>12} "
                 f"{'makespan':>10} {'store-all memory':>17} {'makespan':>10}"]
        for method, s in self.summary().items():
            def show(v: Any, f: Callable[[Any], str] = str) -> str:
                return "-" if v is None else f(v)

            lines.append(
                f"{method:<14} {s['points']:>6} {s['on_front']:>5} "
                f"{show(s['min_memory'], fmt):>12} {show(s['min_memory_makespan'], _t):>10} "
                f"{show(s['store_all_memory'], fmt):>17} {show(s['store_all_makespan'], _t):>10}")
        return "\n".join(lines)


def _t(v: float) -> str:
    return f"{v:.6g}"


def _memory_formatter(unit: str) -> Callable[[Any], str]:
    if unit == "B":
        return lambda v: format_size(v)
    return lambda v: f"{v} {unit}"


# ------------------------------------------------------------------ running
class Progress:
    """A one-line progress bar on a stream (stderr by default)."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()

    def update(self, label: str = "") -> None:
        """Count one finished task and redraw (at most ten times a second)."""
        self.done += 1
        now = time.perf_counter()
        if self.done < self.total and now - getattr(self, "_drawn", 0.0) < 0.1:
            return
        self._drawn = now
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        end = "\n" if self.done >= self.total else ""
        self.stream.write(f"\rsweep [{bar}] {self.done}/{self.total} {elapsed:5.1f}s "
                          f"{label[:30]:<30}{end}")
        self.stream.flush()


def _run_one(factory: ProblemFactory, method: str, limit: int,
             options: SolveOptions) -> SweepPoint:
    """Solve one (method, limit) task; unexpected failures become ``error`` points.

    A bad value of an ``extra`` key the method reads, or a variant it refuses, raises, as
    in :func:`solve` and ``compare``: it is bad input, not one failed point. The shared
    ``options.variant`` reaches the methods that declare it, as in ``compare``
    (:func:`optmem.solvers.facade.run_options`).
    """
    from optmem.solvers.facade import method_info, reraise_input_error, run_options, solve

    problem = factory(limit)
    info = method_info(problem.name, method)
    run = run_options(problem.name, info, method, options, shared=True)
    try:
        result = solve(problem, info.name, options=run)
        return point_of(method, limit, result, info.exact, plan_memory(problem, result))
    except OptmemInputError as exc:
        if reraise_input_error(exc, info, run):
            raise
        result = Result(problem.name, method, Status.ERROR, report={"error": str(exc)})
    except Exception as exc:  # noqa: BLE001 - one bad point must not end the sweep
        result = Result(problem.name, method, Status.ERROR,
                        report={"error": f"{type(exc).__name__}: {exc}"})
    return point_of(method, limit, result, info.exact)


def _run_parallel(factory: ProblemFactory, tasks: list[tuple[str, int]],
                  options: SolveOptions, jobs: int, done: dict[tuple[str, int], SweepPoint],
                  bar: Progress | None) -> None:
    """Run ``tasks`` on ``jobs`` worker processes into ``done``.

    A task that raises (a bad value of an ``extra`` key) does not end the run at once: the
    error raised is that of the first failing task in ``tasks`` order, the one the
    sequential run (``jobs=1``) raises, whatever order the workers finish in (it used to
    be the first to finish, so ``--jobs 2`` named one bad option or another from run to
    run). Tasks after a known failure that have not started are cancelled.
    """
    failed: dict[int, Exception] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
        futures = {pool.submit(_run_one, factory, m, limit, options): k
                   for k, (m, limit) in enumerate(tasks)}
        for fut in as_completed(futures):
            k = futures[fut]
            if fut.cancelled():
                continue
            try:
                done[tasks[k]] = fut.result()
            except Exception as exc:  # noqa: BLE001 - raised below, in the tasks' order
                failed[k] = exc
                for later, j in futures.items():
                    if j > k:
                        later.cancel()
                continue
            if bar:
                bar.update(f"{tasks[k][0]} @ {tasks[k][1]}")
    if failed:
        raise failed[min(failed)]


def _check_picklable(problem_factory: Callable[[int], Any], jobs: int) -> None:
    """Refuse, before any work, a factory the worker processes of ``jobs > 1`` cannot get.

    An error rather than a fall back to one process: ``jobs`` asks for the workers, and a
    run that silently takes ``jobs`` times longer is worse than one line saying why (a
    lambda raised ``PicklingError`` from inside the pool until the API audit).
    """
    import pickle

    try:
        pickle.dumps(problem_factory)
    except Exception as exc:  # PicklingError, AttributeError (local), TypeError
        raise OptmemInputError(
            f"with jobs={jobs} the factory goes to worker processes, which needs it "
            f"picklable ({type(exc).__name__}: {exc}): give a top-level function, a "
            f"functools.partial of one or CheckpointFactory, or jobs=1",
            field="problem_factory") from None


def sweep(
    problem_factory: ProblemFactory,
    limits: Sequence[int] | str,
    methods: Sequence[str] | str | None = None,
    *,
    options: SolveOptions | None = None,
    jobs: int = 1,
    progress: bool | Progress = False,
    **option_fields: Any,
) -> SweepResult:
    """Solve ``problem_factory(limit)`` with every method at every limit.

    Parameters
    ----------
    problem_factory
        ``limit -> problem``; must be picklable when ``jobs > 1`` (a top-level function,
        :class:`CheckpointFactory`, :class:`CliFactory`, ``functools.partial``).
    limits
        Memory limits in the chain's memory unit, each in any form of
        :func:`optmem.units.memory_size` (``2**30``, ``1e9``, ``"1GiB"``), or one string as
        the CLI's ``--memory`` takes it: ``"FROM:TO:STEPS"`` (``"1GiB:4GiB:20"``) or
        ``"auto[:STEPS]"`` (:func:`memory_limits`; since stop 55).
    methods
        Method labels of the facade (``dp``, ``dp:rotor``, ``chen``, ...), or one
        comma-separated string of them (as ``--methods``); ``None`` (default, since stop
        55): the CLI's default methods (:func:`default_methods`).
    options
        Shared :class:`SolveOptions` (slots, time limit, solver); keyword arguments set
        its fields (an unknown one raises, naming the closest).
    jobs
        Worker processes, 1..256 as ``--jobs`` (1: in this process).
    progress
        ``True`` for a progress bar on stderr, or a :class:`Progress`.

    Raises
    ------
    OptmemInputError
        For an unknown method, option or ``extra`` key, a bad ``jobs``, a factory that is
        no function (or, with ``jobs > 1``, that cannot be pickled: a lambda, a local
        function; field ``problem_factory``) or an empty list of limits, before anything
        runs; for a value of an
        ``extra`` key that a method reading it refuses, when that method runs (as
        :func:`optmem.solvers.facade.compare`).
    """
    from optmem.solvers.facade import (
        NO_METHODS,
        check_extra,
        check_shared_variant,
        distinct_methods,
        method_info,
        method_names_of,
        problem_name,
        resolve_options,
        run_options,
    )

    if isinstance(limits, bytes) or not isinstance(limits, str | Iterable):
        raise OptmemInputError(f"expected a list of memory limits or a range FROM:TO:STEPS / "
                               f"auto[:STEPS], got {limits!r}", field="limits")
    if not isinstance(limits, str):
        limits = sorted({memory_size(m, field="limits") for m in limits})
        if not limits:
            raise OptmemInputError("expected at least one memory limit", field="limits")
    given = method_names_of(methods)
    if given is not None and not given:
        raise OptmemInputError(NO_METHODS, field="methods")
    jobs = check_integer(jobs, "jobs", 1, MAX_WORKERS, "a number of worker processes")
    if not isinstance(progress, bool | Progress):
        raise OptmemInputError(f"expected True, False or a Progress, got {progress!r}",
                               field="progress")
    options = resolve_options(options, option_fields)
    if not callable(problem_factory):
        raise OptmemInputError(f"expected a function of the memory limit returning a problem, "
                               f"got {type(problem_factory).__name__}", field="problem_factory")
    if jobs > 1:
        _check_picklable(problem_factory, jobs)
    probe = problem_factory(0 if isinstance(limits, str) else limits[0])
    kind = problem_name(probe)
    methods = default_methods(kind) if given is None else given
    for m in methods:  # unknown methods and variants (dp:bogus, chen:rotor) fail here
        run_options(kind, method_info(kind, m), m, options, shared=True)
    check_extra(kind, options)
    check_shared_variant(kind, methods, options)
    methods = distinct_methods(kind, methods, options)  # dp,dp ran twice until the API audit
    if isinstance(limits, str):
        limits = memory_limits(limits, problem_factory, methods, options, field="limits")
    tasks = [(m, limit) for limit in limits for m in methods]
    bar = progress if isinstance(progress, Progress) else \
        Progress(len(tasks)) if progress else None
    start = time.perf_counter()
    done: dict[tuple[str, int], SweepPoint] = {}
    if jobs <= 1:
        for m, limit in tasks:
            done[(m, limit)] = _run_one(problem_factory, m, limit, options)
            if bar:
                bar.update(f"{m} @ {limit}")
    else:
        _run_parallel(problem_factory, tasks, options, jobs, done, bar)
    chain = getattr(probe, "chain", None)
    store_all = no_recompute = None
    if isinstance(chain, Chain):
        no_recompute = chain.total_compute_time()
        try:
            store_all = chain.store_all_peak()
        except Exception:  # noqa: BLE001 - a reference line only
            store_all = None
    return SweepResult(
        problem=probe.name, chain_name=chain.name if isinstance(chain, Chain) else "",
        memory_unit=chain.memory_unit if isinstance(chain, Chain) else "B",
        time_unit=chain.time_unit if isinstance(chain, Chain) else "",
        limits=tuple(limits), methods=tuple(methods),
        points=tuple(done[(m, limit)] for m in methods for limit in limits),
        store_all_peak=store_all, no_recompute_time=no_recompute,
        wall_time_s=time.perf_counter() - start)


# ------------------------------------------------------------------ CLI
def parse_memory_range(text: str, chain: Chain | None = None, *,
                       low: int | None = None, high: int | None = None,
                       field: str = "--memory") -> list[int]:
    """``FROM:TO:STEPS`` (sizes with units) or ``auto[:STEPS]`` into a list of limits.

    ``auto`` goes from ``low`` (default: the smallest limit at which the checkpoint DP
    finds a plan as solved, after discretisation; :func:`auto_start` gives the sweep's
    methods' own) to ``high`` (default: 5 % above the store-all peak of ``chain``;
    :func:`auto_end` gives the problem's own), or to ``low`` if that is higher.

    Examples
    --------
    >>> parse_memory_range("10:20:3")
    [10, 15, 20]
    >>> parse_memory_range("1GiB:2GiB:2")
    [1073741824, 2147483648]
    """
    parts = text.split(":")
    if parts[0] == "auto":
        if chain is None:
            raise OptmemInputError("'auto' needs a chain", field=field)
        steps = _steps(parts[1] if len(parts) > 1 else "20", field)
        if low is None:
            low = checkpoint_start(chain, SolveOptions())
        if high is None:
            high = math.ceil(chain.store_all_peak() * 1.05)
        high = max(low, high)
    elif len(parts) == 3:
        low = parse_size(parts[0], field=field)
        high = parse_size(parts[1], field=field)
        steps = _steps(parts[2], field)
    else:
        raise OptmemInputError(f"expected FROM:TO:STEPS (e.g. 1GiB:4GiB:20) or auto[:STEPS], "
                               f"got {text!r}", field=field)
    if high < low:
        raise OptmemInputError(f"expected FROM <= TO, got {text!r}", field=field)
    if steps == 1:
        return [low]
    return sorted({round(low + (high - low) * k / (steps - 1)) for k in range(steps)})


def memory_limits(text: str, problem_factory: ProblemFactory, methods: Sequence[str],
                  options: SolveOptions, *, field: str = "--memory") -> list[int]:
    """The limits of a sweep of ``methods`` given as ``FROM:TO:STEPS`` or ``auto[:STEPS]``.

    The CLI's ``--memory`` and Python's ``sweep(factory, "auto:20")``: ``auto`` starts
    where one of ``methods`` first finds a plan (:func:`auto_start`; a pipeline's from
    :func:`pipeline_start`; else the checkpoint DP's least memory) and ends where the
    limit stops mattering (:func:`auto_end`); :func:`parse_memory_range` spaces them.
    """
    if text.split(":")[0] != "auto":
        return parse_memory_range(text, field=field)
    probe = problem_factory(0)
    chain = probe.chain
    low = auto_start(problem_factory, methods, options)
    high = auto_end(problem_factory, probe.name, chain, options)
    if low is None and probe.name == "pipeline":  # a limit per GPU: not the DP's
        low = pipeline_start(problem_factory, methods, options, high)
    if low is None:
        low = checkpoint_start(chain, options)
    return parse_memory_range(text, chain, low=low, high=high, field=field)


def checkpoint_start(chain: Chain, options: SolveOptions) -> int:
    """Smallest limit at which the checkpoint DP finds a plan, as solved (``options.slots``)."""
    from optmem.problems import CheckpointProblem
    from optmem.solvers.checkpoint import dp_min_memory

    found = dp_min_memory(CheckpointProblem(chain, 0), options, "paper")
    return found if found is not None else chain.store_all_peak()


def auto_start(problem_factory: ProblemFactory, methods: Sequence[str],
               options: SolveOptions) -> int | None:
    """Smallest limit at which one of ``methods`` finds a plan, as solved.

    Each method is solved at limit 0 and reports its ``min_feasible_memory`` (a limit at
    which solving again succeeds, rounding included); the least of them, ``None`` if no
    method reports one.
    """
    from optmem.solvers.facade import method_info, run_options, solve

    found = []
    for method in methods:
        try:
            problem = problem_factory(0)
            run = run_options(problem.name, method_info(problem.name, method), method, options,
                              shared=True)
            result = solve(problem, method.partition(":")[0], options=run)
        except OptmemInputError:
            continue
        if result.status.has_plan:
            return 0
        if result.min_feasible_memory is not None:
            found.append(result.min_feasible_memory)
    return min(found, default=None)


def _any_plan(problem_factory: ProblemFactory, methods: Sequence[str], options: SolveOptions,
              limit: int) -> bool:
    """Whether one of ``methods`` finds a plan at ``limit`` (as :func:`auto_start` runs them)."""
    from optmem.solvers.facade import method_info, run_options, solve

    for method in methods:
        try:
            problem = problem_factory(limit)
            run = run_options(problem.name, method_info(problem.name, method), method, options,
                              shared=True)
            if solve(problem, method.partition(":")[0], options=run).status.has_plan:
                return True
        except OptmemInputError:
            continue
    return False


PIPELINE_START_TOLERANCE = 0.01
"""How close (relative to the sweep's end) :func:`pipeline_start` brackets its threshold."""


def pipeline_start(problem_factory: ProblemFactory, methods: Sequence[str],
                   options: SolveOptions, high: int) -> int | None:
    """Where ``auto`` starts a pipeline sweep whose methods report no least memory.

    Under the ``strict`` memory model no pipeline method reports ``min_feasible_memory``,
    and the checkpoint DP's least memory (where ``auto`` started until stop 54) says
    nothing of a limit per GPU: on one chain plans fit below it (missed), on another none
    fits above it (wasted points). From :meth:`PipelineProblem.memory_lower_bound`, below
    which no plan fits, a bisection up to ``high`` (the sweep's end) brackets the least
    limit at which one of ``methods`` finds a plan to within
    :data:`PIPELINE_START_TOLERANCE` of ``high`` (the limit returned has a plan; about 7
    rounds of the methods); ``None`` when no method finds one at ``high``.
    """
    low = int(problem_factory(0).memory_lower_bound())
    if _any_plan(problem_factory, methods, options, low):
        return low
    if not _any_plan(problem_factory, methods, options, high):
        return None
    step = max(1, math.ceil(PIPELINE_START_TOLERANCE * high))
    while high - low > step:  # no plan at low, a plan at high
        mid = (low + high) // 2
        low, high = (low, mid) if _any_plan(problem_factory, methods, options, mid) \
            else (mid, high)
    return high


def auto_end(problem_factory: ProblemFactory, problem: str, chain: Chain,
             options: SolveOptions) -> int:
    """Where ``auto`` ends: 5 % above the memory at which the limit stops mattering.

    The store-all peak of ``chain`` for the single-device problems. A pipeline's limit is
    per GPU and holds weights and several micro-batches' stashes: its default method
    (``contiguous``) solved with no limit (2^62) gives the peak of the fastest plan of its
    class (resnet18-b64-224 on 2 GPUs: 2.13 GiB per GPU against a store-all peak of
    1.35 GiB, where ``auto`` ended until stop 52, at a period 69 % above that plan's).
    """
    end = chain.store_all_peak()
    if problem == "pipeline":
        from optmem.solvers.facade import method_info, run_options, solve

        problem_at = problem_factory(MAX_SIZE)
        free = solve(problem_at, "auto", options=run_options(
            problem, method_info(problem, "auto"), "auto", options, shared=True))
        if free.status.has_plan and free.peak_memory is not None:
            end = free.peak_memory * free.unit
    return math.ceil(end * 1.05)


MAX_STEPS = 10_000  # limits of one sweep (each is solved by every method)


def _steps(text: str, field: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_STEPS:
        raise OptmemInputError(f"expected a number of steps in 1..{MAX_STEPS}, got {text!r}",
                               field=field)
    return int(text)


def default_methods(problem: str) -> list[str]:
    """Methods swept when ``--methods`` is not given: the default and every heuristic."""
    from optmem.solvers.facade import method_info, methods

    if problem == "checkpoint":
        return list(CHECKPOINT_DEFAULT_METHODS)
    first = method_info(problem, "auto").name
    rest = [n for n, info in methods(problem).items()
            if n != first and not info.exact and info.in_compare and info.is_available()]
    return [first, *rest]


def register_cli(subparsers: Any) -> None:
    """Add ``optmem sweep`` to the CLI."""
    from optmem.cli import add_engine_limits, add_option_flag, add_problem_options, worker_count

    p = subparsers.add_parser(
        "sweep", help="solve across memory limits: Pareto fronts, CSV/JSON, the curve",
        description="Solve PROBLEM on CHAIN at evenly spaced memory limits with several "
                    "methods and draw the memory/makespan trade-off.")
    p.add_argument("problem", help="checkpoint, offload, remat-offload, pipeline, min-peak")
    p.add_argument("chain", help="chain file or bundled dataset name")
    p.add_argument("--memory", "-m", default="auto",
                   help="FROM:TO:STEPS with sizes (1GiB:4GiB:20), or auto[:STEPS] (default: "
                        "from the smallest limit at which a swept method finds a plan, as "
                        "solved, to 5%% above the store-all peak)")
    p.add_argument("--methods", help="comma-separated methods (default: dp and baselines)")
    p.add_argument("--jobs", "-j", type=worker_count, default=min(2, os.cpu_count() or 1),
                   help="worker processes (default: 2)")
    p.add_argument("--csv", help="write one row per solve")
    p.add_argument("--json", help="write points, fronts and summary as JSON")
    p.add_argument("--plot", help="draw the curve (.png, .svg or .pdf)")
    p.add_argument("--title", help="plot title")
    p.add_argument("--variant", help="method variant for the methods that have it (the "
                                     "others run their default)")
    p.add_argument("--slots", type=int, default=500, help="memory slots (default 500)")
    add_engine_limits(p)
    p.add_argument("--solver", default="highs", help="ILP engine: highs, cbc, gurobi")
    p.add_argument("--threads", type=worker_count, default=1,
                   help="threads per exact solve (1..256)")
    p.add_argument("--verbose", action="store_true", help="show engine logs")
    add_option_flag(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_problem_options(p)
    p.set_defaults(func=cmd_sweep)


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before solving if ``--csv``, ``--json`` or ``--plot`` could not be written."""
    if args.title:
        check_text(args.title, name="--title", allow="\n")
    if args.plot:
        from optmem.plotting import check_plot_path

        check_plot_path(args.plot)
    seen: dict[str, str] = {}
    for name in ("csv", "json", "plot"):
        if getattr(args, name):
            check_writable(getattr(args, name), field=name)
            path = os.path.realpath(getattr(args, name))
            if path in seen:  # one output would overwrite the other
                raise OptmemInputError(f"--{seen[path]} and --{name} name the same file "
                                       f"{getattr(args, name)!r}", field=name)
            seen[path] = name


def cmd_sweep(args: argparse.Namespace) -> int:
    """Handler of ``optmem sweep``."""
    from optmem.cli import load_chain, options_from_args, problem_hooks
    from optmem.cli_problems import check_problem_options

    chain = load_chain(args.chain)
    problem_hooks(args.problem)  # unknown problems fail with the list of known ones
    check_problem_options(args.problem, args)  # checkpoint --gpus 4: an error
    check_outputs(args)
    extra = {k: v for k, v in vars(args).items() if k != "func"}
    factory = CliFactory(args.problem, chain, extra)
    options = options_from_args(args)
    try:  # --memory and --methods are read as sweep(...) reads them ('' is no method)
        result = sweep(factory, args.memory, args.methods, options=options, jobs=args.jobs,
                       progress=not args.quiet)
    except OptmemInputError as exc:
        if exc.field == "limits":
            raise OptmemInputError(exc.reason, field="--memory") from None
        raise
    print(f"{chain.name}: {args.problem}, {len(result.limits)} limits x "
          f"{len(result.methods)} methods in {result.wall_time_s:.1f}s")
    print(result.table())
    errors = [p for p in result.points if p.status == Status.ERROR.value]
    for p in errors[:5]:
        print(f"error: {p.method} at {p.memory_limit}: {p.error}", file=sys.stderr)
    if args.csv:
        result.write_csv(args.csv)
    if args.json:
        result.write_json(args.json)
    if args.plot:
        result.plot(args.plot, title=args.title)
        print(f"plot written to {args.plot}")
    return 0
