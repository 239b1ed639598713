"""Large-neighbourhood search over pipeline plans: the exact solve's primal heuristic.

The exact model (:mod:`optmem.models.pipeline`) proves bounds slowly on real profiles, and
its engine improves the incumbent slowly too: on ResNet-50 (21 units, 4 GPUs, 3 GiB,
12 GB/s) CP-SAT took 600 s to go from MadPipe's 34.04 ms to 33.46. A search that frees only
a few units at a time finds much better plans: each *move* keeps the "same GPU" relation of
every pair of units outside a small set (``same_gpu`` of
:func:`~optmem.models.pipeline.build_pipeline_model`) and asks CP-SAT, hinted with the
incumbent and limited by deterministic work, for the fastest plan of that neighbourhood
below the incumbent's period. The schedule (start times, shifts, orders) is free in every
move, so a move also reschedules the fixed units around the freed ones.

Neighbourhoods (Shaw-style, in turn from a seeded generator): a *window* of 3-7 consecutive
units (a boundary between GPUs moves, or a run of units changes GPU), the units of *two
GPUs* (their split is redone), or a *random* handful of 3-6 units. Moves are
deterministic: one CP-SAT worker, ``work`` deterministic seconds each, the seed of the
move; only a wall-clock deadline (a solve's ``time_limit_s``) can end the search or a move
earlier than its work. There is no hidden wall-clock limit.

Soundness: a plan is taken only after the simulator replays it within the memory limit
(:func:`~optmem.solvers.pipeline_common.replayed_period`) with a smaller period; the restricted
models' bounds are bounds of a neighbourhood, not of the problem, and are never reported.
An engine that fails on a move is counted (``lns_failed``) and the search goes on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from optmem.errors import OptmemInputError
from optmem.models.pipeline import Units, make_units, plan_gpus
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions
from optmem.solvers.options import check_work_count, positive_float
from optmem.solvers.pipeline_common import proven, replayed_period, run_model

LNS_MOVES = 40
"""Default ``extra["lns"]`` (moves) under a time limit, on chains of at least
:data:`LNS_MIN_UNITS` units (without a limit the default is 0: a solve without one is a
request for a proof, which the search does not give, and it would run every move)."""
LNS_MIN_UNITS = 10
"""Below this many units the search is off by default: the whole model is small enough
(the pipeline tests' chains, P||Cmax instances of 8 layers) for the engine alone."""
LNS_WORK = 10.0
"""Default ``extra["lns_work"]``: CP-SAT deterministic seconds of one move."""
LNS_SHARE = 0.5
"""Share of the time left (under a limit) that the search may use."""
LEAST_MOVE_TIME_S = 1.0
"""Under a deadline, no move starts with less time left than this (seconds)."""
KINDS = ("window", "gpus", "random")


@dataclass(frozen=True)
class LnsSettings:
    """``extra["lns"]`` (moves; 0: off) and ``extra["lns_work"]``, checked by :func:`settings`."""

    moves: int
    work: float


def settings(options: SolveOptions, n_units: int) -> LnsSettings:
    """The search's settings (defaults: :data:`LNS_MOVES`, :data:`LNS_WORK`).

    By default on under a time limit (``options.time_limit_s``) from :data:`LNS_MIN_UNITS`
    units on; ``extra["lns"]`` sets the number of moves (0: off) whatever the limit, at
    most ``WORK_COUNT_MAX["lns"]`` (:func:`~optmem.solvers.options.check_work_count`).
    """
    on = options.time_limit_s is not None and n_units >= LNS_MIN_UNITS
    default = LNS_MOVES if on else 0
    moves = options.extra.get("lns", default)
    if isinstance(moves, bool) or not isinstance(moves, int) or moves < 0:
        raise OptmemInputError(f"expected a number of moves (an integer >= 0) for lns, got "
                               f"{moves!r}", field="lns")
    check_work_count("lns", moves)  # each move is one CP-SAT solve: 2**70 ran for ever
    return LnsSettings(moves, positive_float(options, "lns_work", LNS_WORK))


@dataclass
class Search:
    """Outcome of :func:`improve`: the best plan and what the moves did.

    ``improvements``: the periods found, in order; ``found_at``: the move (1-based) of each.
    """

    period: float
    plan: PipelinePlan
    moves: int = 0
    improvements: list[float] = field(default_factory=list)
    found_at: list[int] = field(default_factory=list)
    failed: int = 0
    stopped: str = "moves"

    def report(self) -> dict[str, object]:
        """Report keys (``lns_*``) of a solve."""
        return {"lns_moves": self.moves, "lns_improvements": list(self.improvements),
                "lns_failed": self.failed, "lns_stopped": self.stopped}


def neighbourhood(rng: random.Random, gpu: Sequence[int]) -> frozenset[int]:
    """Units (0-based) one move frees: a window, two GPUs' units, or a random handful."""
    n = len(gpu)
    kind = rng.choice(KINDS)
    if kind == "window":
        k = min(n, rng.randint(3, 7))
        first = rng.randint(0, n - k)
        return frozenset(range(first, first + k))
    if kind == "gpus" and len(set(gpu)) >= 2:
        pair = rng.sample(sorted(set(gpu)), 2)
        return frozenset(q for q in range(n) if gpu[q] in pair)
    return frozenset(rng.sample(range(n), min(n, rng.randint(3, 6))))


def kept_relation(gpu: Sequence[int], free: frozenset[int]) -> dict[tuple[int, int], bool]:
    """"Same GPU" of every pair of units outside ``free``, as in the allocation ``gpu``."""
    kept = [q for q in range(len(gpu)) if q not in free]
    return {(q, r): gpu[q] == gpu[r] for i, q in enumerate(kept) for r in kept[i + 1:]}


def improve(problem: PipelineProblem, period: float, plan: PipelinePlan, *,
            moves: int, work: float, seed: int = 0, bound: float = 0.0,
            deadline: float | None = None, units: Units | None = None) -> Search:
    """Improve ``plan`` (period ``period``, replayed) by at most ``moves`` moves.

    Stops early when the incumbent meets ``bound`` (a proven lower bound), at ``deadline``
    (``time.perf_counter()``), or when the plan's units cannot be read (a stage that splits
    a unit: not the model's plan). Each move: :func:`neighbourhood`, :func:`kept_relation`,
    the exact model with the period at most the incumbent's, CP-SAT on one worker.
    """
    units = units if units is not None else make_units(problem)
    found = Search(period, plan)
    rng = random.Random(seed)
    for move in range(moves):
        gpu = plan_gpus(units, found.plan)
        if gpu is None:
            found.stopped = "plan not representable"
            break
        if proven(found.period, bound):
            found.stopped = "bound met"
            break
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left < LEAST_MOVE_TIME_S:
            found.stopped = "time"
            break
        free = neighbourhood(rng, gpu)
        opts = SolveOptions(threads=1, deterministic_time=work, seed=seed + move,
                            time_limit_s=left)
        run = run_model(problem, "cpsat", opts, units=units, upper_bound=found.period,
                        warm=found.plan, lower=bound, same_gpu=kept_relation(gpu, free))
        found.moves += 1
        if run.failed:
            found.failed += 1
            continue
        replayed = None if run.plan is None else replayed_period(problem, run.plan)
        if replayed is not None and replayed < found.period * (1 - 1e-9):
            found.period, found.plan = replayed, run.plan  # type: ignore[assignment]
            found.improvements.append(replayed)
            found.found_at.append(move + 1)
    return found


__all__ = ["KINDS", "LEAST_MOVE_TIME_S", "LNS_MIN_UNITS", "LNS_MOVES", "LNS_SHARE", "LNS_WORK",
           "LnsSettings", "Search", "improve", "kept_relation", "neighbourhood", "settings"]
