"""One deadline for a whole solve: every stage gets at most what is left of the time limit.

A solve made of several engine calls (the remat + offload ``cpsat`` method: link
relaxation stages, candidate completions, a warm-up search, Benders masters and
subproblems) used to give each call its own share of ``time_limit_s`` measured from
different starting points, so the shares could add up past the limit (ResNet-50 at its
10 % limit ran 342 s against 300 s, ``benchmarks/results/remat_offload_exact.md``, ``ro15``).
A :class:`Deadline` is taken once, when the solve starts, and every engine call's time limit
is capped by :meth:`Deadline.cap`; a stage whose engine would get less than the engine's
least useful time is skipped (:meth:`Deadline.spent`). :data:`REPLAY_MARGIN_S` of the limit
is kept back for what follows the last engine call (decoding, the simulator's replay, the
engines' own overshoot of their limits).

The clock is injectable (``Deadline.start(limit, clock=...)``) so that tests check the
plumbing on a fake clock, never on the machine's load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

REPLAY_MARGIN_S = 2.0  # kept back from a time limit for decoding, replay and engine overshoot
# (a HiGHS call starts its clock after PuLP has passed it the model: a few seconds on the
# 78 k-variable ResNet-50 model)


@dataclass(frozen=True)
class Deadline:
    """The instant (on ``clock``) by which a solve's engine calls must have ended.

    ``end`` is ``None`` when there is no time limit: then :meth:`left` is ``None`` and
    :meth:`cap` returns its argument unchanged.

    Examples
    --------
    >>> now = [0.0]
    >>> d = Deadline.start(10.0, clock=lambda: now[0], margin=1.0)
    >>> d.left(), d.cap(20.0), d.cap(None), d.cap(3.0)
    (9.0, 9.0, 9.0, 3.0)
    >>> now[0] = 8.5
    >>> d.left(), d.spent(1.0), d.within(5.0).left()
    (0.5, True, 0.5)
    >>> Deadline.start(None).cap(7.0), Deadline.start(None).spent(1.0)
    (7.0, False)
    """

    end: float | None
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def start(cls, limit_s: float | None, *, clock: Callable[[], float] = time.monotonic,
              margin: float = REPLAY_MARGIN_S) -> Deadline:
        """The deadline ``limit_s`` seconds from now, less ``margin`` (at most half of it)."""
        if limit_s is None:
            return cls(None, clock)
        return cls(clock() + limit_s - min(margin, 0.5 * limit_s), clock)

    def left(self) -> float | None:
        """Seconds left (never negative), ``None`` without a limit."""
        return None if self.end is None else max(0.0, self.end - self.clock())

    def cap(self, seconds: float | None) -> float | None:
        """``seconds`` (``None``: no limit of its own) capped by what is left."""
        left = self.left()
        if left is None:
            return seconds
        return left if seconds is None else min(seconds, left)

    def spent(self, least: float = 0.0) -> bool:
        """Whether at most ``least`` seconds are left (never without a limit)."""
        left = self.left()
        return left is not None and left <= least

    def within(self, seconds: float | None) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now (``None``: this one)."""
        if seconds is None:
            return self
        end = self.clock() + seconds
        return Deadline(end if self.end is None else min(end, self.end), self.clock)

    def stopper(self) -> Callable[[], bool] | None:
        """:meth:`spent` for :func:`optmem.models.interrupt.stop_when` (``None``: no limit)."""
        return None if self.end is None else self.spent


LEAST_ENGINE_LIMIT_S = 0.05
"""The least time limit :func:`left_for_engine` gives: an engine stops at once with what it
has (a warm start), rather than being refused a limit of zero."""


def left_for_engine(deadline: Deadline | None, limit: float | None = None,
                    least: float = LEAST_ENGINE_LIMIT_S) -> float | None:
    """An engine call's limit: ``limit`` capped by what ``deadline`` leaves, at least ``least``.

    ``None`` when neither bounds the call; ``limit`` as it is without a deadline. The one
    rule of every engine call under a solve's deadline (the remat + offload stages and LNS
    windows, the pipeline scan's questions and full model, the checkpoint and offload
    methods). The checkpoint and offload exact methods make one engine call, which got the
    whole ``time_limit_s`` after the model's build and the DP warm start had run (stop 74:
    ``--time-limit 10`` answered after 12 s on DenseNet-121, L = 68); they now start a
    :class:`Deadline` (no margin) and give the engine what is left.

    Examples
    --------
    >>> now = [0.0]
    >>> d = Deadline.start(10.0, clock=lambda: now[0], margin=0.0)
    >>> now[0] = 3.0
    >>> left_for_engine(d), left_for_engine(Deadline.start(None))
    (7.0, None)
    >>> now[0] = 12.0
    >>> left_for_engine(d), left_for_engine(d, 3.0, least=1.0), left_for_engine(None, 3.0)
    (0.05, 1.0, 3.0)
    """
    if deadline is None:
        return limit
    capped = deadline.cap(limit)
    return None if capped is None else max(capped, least)


def least_left(limit_s: float | None, least: float, margin: float = REPLAY_MARGIN_S) -> float:
    """The time a stage needs left to start: ``least``, or less under a short limit.

    At most half the working time of the solve's limit (``limit_s`` less the margin
    :meth:`Deadline.start` keeps back): with a working time below ``2 least``, a fixed
    ``least`` is never left, so a stage that asked for it never ran. The remat + offload
    search asked for 1 s (:data:`~optmem.solvers.remat_offload.LEAST_ENGINE_TIME_S`) and
    skipped itself under any limit of at most 2 s, even at L = 1 (stop 76); it now runs
    when half of the working time is left. Limits of at least ``max(2 least + margin,
    2 margin)`` (4 s for the search) are unchanged.

    Examples
    --------
    >>> least_left(None, 1.0), least_left(10.0, 1.0), least_left(4.0, 1.0)
    (1.0, 1.0, 1.0)
    >>> least_left(2.0, 1.0), least_left(1.0, 1.0), least_left(0.05, 1.0)
    (0.5, 0.25, 0.0125)
    """
    if limit_s is None:
        return least
    working = limit_s - min(margin, 0.5 * limit_s)
    return min(least, 0.5 * working)


def stopped_during(stage: str) -> str:
    """``report["stopped"]`` of a solve whose Python work reached its deadline in ``stage``.

    One wording for the checkpoint, offload, remat + offload and pipeline exact methods
    (CONTRACT: ``report.stopped``).

    Examples
    --------
    >>> stopped_during("the model's build")
    "time limit (during the model's build)"
    """
    return f"time limit (during {stage})"
