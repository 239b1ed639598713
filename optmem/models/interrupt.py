"""Stop a model's build, its emission or a dynamic program when its solve's time is up.

An engine call keeps its time limit, but the pure-Python work around it did not: building
the remat + offload model of ResNet-101 (L = 39) took 12.8 s, its link relaxation's PuLP
emission 3.2 s and the chapter 4 DP 5.9 s, so ``solve --time-limit 10`` answered after 27 s;
at L = 68 the build alone ran 220 s and took 5 GB (stop 73's measurements, stop 74's
profile). None of that work can be given a limit from outside, so it polls one:

* a solve runs its stages inside :func:`stop_when` with a predicate (its deadline has
  passed);
* long loops call :func:`poll` (cheap: the predicate is evaluated once every
  :data:`EVERY` calls) or :func:`poll_now`; once the predicate holds they raise
  :class:`Interrupted`;
* the solve catches it and answers with what it has: the best replayed plan and the best
  proven bound so far (``feasible``), or ``no_solution`` with the bound.

The predicate lives in a :class:`contextvars.ContextVar`, so threads and nested solves do not
see each other's, and code run without :func:`stop_when` never stops (``poll`` costs one
variable read and a counter). Tests drive it with a predicate of their own (a call count),
never with the machine's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["EVERY", "Interrupted", "poll", "poll_now", "stop_when"]

EVERY = 512  # poll() evaluates the predicate once per this many calls


class Interrupted(Exception):  # noqa: N818 (not an error: the caller answers with what it has)
    """The work stopped because its solve's predicate held (its time limit is spent)."""


@dataclass
class _Watch:
    stop: Callable[[], bool]
    calls: int = 0


_WATCH: ContextVar[_Watch | None] = ContextVar("optmem_interrupt", default=None)


@contextmanager
def stop_when(stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, :func:`poll` raises :class:`Interrupted` once ``stop()`` holds.

    ``stop=None``: nothing stops (a solve without a time limit). The previous predicate
    (an enclosing block's) is restored on exit.

    Examples
    --------
    >>> calls = []
    >>> with stop_when(lambda: len(calls) >= 2):
    ...     try:
    ...         for _ in range(10):
    ...             calls.append(1)
    ...             poll_now()
    ...     except Interrupted:
    ...         pass
    >>> len(calls)
    2
    """
    token = _WATCH.set(None if stop is None else _Watch(stop))
    try:
        yield
    finally:
        _WATCH.reset(token)


def poll(weight: int = 1) -> None:
    """Raise :class:`Interrupted` if the predicate holds (checked once per :data:`EVERY`).

    ``weight``: how many calls this one counts as, for a step worth that many of the loop's
    usual steps (the checkpoint DP's table set-up counts a row of pairs as the ``L + 2``
    cells whose memory it first touches, stop 80). The predicate is asked when the count
    passes a multiple of :data:`EVERY`, so a small job finishes before any check, as with
    single calls, and a large one is checked as often as its work warrants.

    Examples
    --------
    >>> asked = []
    >>> with stop_when(lambda: asked.append(1) or False):
    ...     poll(EVERY - 1)
    ...     n0 = len(asked)
    ...     poll(2)
    >>> n0, len(asked)
    (0, 1)
    """
    watch = _WATCH.get()
    if watch is None:
        return
    before = watch.calls
    watch.calls = before + weight
    if before // EVERY != watch.calls // EVERY and watch.stop():
        raise Interrupted


def poll_now() -> None:
    """Raise :class:`Interrupted` if the predicate holds (checked at every call)."""
    watch = _WATCH.get()
    if watch is not None and watch.stop():
        raise Interrupted
