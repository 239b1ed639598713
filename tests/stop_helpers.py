"""Forced stops for tests: a predicate that holds from its ``n``-th evaluation on.

Tests stop a search at a chosen point (:func:`optmem.models.interrupt.stop_when`) instead
of a wall-clock limit, so no verdict depends on the machine's speed or load.
"""

from __future__ import annotations

from collections.abc import Callable


def after(n: int) -> Callable[[], bool]:
    """A predicate that holds from its ``n``-th evaluation on."""
    seen = [0]

    def stop() -> bool:
        seen[0] += 1
        return seen[0] >= n

    return stop
