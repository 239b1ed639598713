"""Helpers the benchmark scripts share (not a benchmark: no ``bench_`` prefix).

Scripts run as ``python benchmarks/bench_X.py`` find this module next to them; those that
are imported (tests, other scripts) put their own folder on ``sys.path`` first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from optmem.chain import Chain
from optmem.units import parse_bandwidth


def uptime() -> str:
    """The load averages (1, 5, 15 min), as ``uptime`` prints them (``0.52, 0.58, 0.59``)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def print_and_write(text: str, path: str | Path | None) -> None:
    """Print a report and, when a path is given, write it there too."""
    print(text)
    if path:
        Path(path).write_text(text)


def memory_grid(chain: Chain, low: float, high: float, alphas: Iterable[float],
                bandwidths: Iterable[str]) -> Iterator[tuple[str, float, float, int]]:
    """The sweep of the offloading benchmarks: ``(bandwidth, chain units, alpha, memory)``.

    For every bandwidth string (``"12GB/s"``) its rate in memory units per chain time unit,
    then for every ``alpha`` the memory ``ceil(low + alpha * (high - low))``.
    """
    alphas = list(alphas)
    for bw in bandwidths:
        beta = parse_bandwidth(bw, time_unit=chain.time_unit)
        for alpha in alphas:
            yield bw, beta, alpha, int(math.ceil(low + alpha * (high - low)))
