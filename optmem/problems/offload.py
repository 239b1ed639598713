"""Offloading activations to CPU memory: problem OFF_int(L, M_GPU, beta).

Thesis (Shilova) chapter 3, Problem 7 / Beaumont, Eyraud-Dubois, Shilova 2019, Problem 1
(digest ``shared/design/offload.md`` section 0.2): train the chain with the store-all
sequence (``F_all 1 .. F_all L``, ``Loss``, ``B L .. B 1``) and move saved activations to
host memory and back over one link of bandwidth ``beta`` that runs concurrently with compute
(assumptions O.1-O.7), so that GPU memory stays within ``M_GPU``; minimise the makespan.

Plans mix the checkpoint ops of CONTRACT section 3 with the transfer ops ``offload a i``,
``offload abar i``, ``prefetch a i``, ``prefetch abar i`` (CONTRACT "Offload plans"); the simulator
is :func:`optmem.simulate.offload.simulate_offload`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.problems.checkpoint import (
    DEFAULT_SLOTS,
    Discretized,
    check_chain,
    check_memory_limit,
    discretize,
)
from optmem.units import parse_chain_bandwidth, rate_per_second, seconds_per


def link_bandwidths(chain: Chain, bandwidth: Any, chain_bandwidth: Any, *,
                    allow_inf: bool = False) -> tuple[float | None, float]:
    """``(per second, per chain time unit)`` of a bandwidth given either way (one place).

    ``bandwidth`` is memory units (bytes) per second or a rate string (``"12GB/s"``);
    ``chain_bandwidth`` is memory units per chain time unit, a number or its text (``"2.5"``,
    the CLI's ``--chain-bandwidth``: one parser). Give one (or both, consistent).
    The per-second value is ``None`` when the chain's time unit is not a time.
    """
    if bandwidth is None and chain_bandwidth is None:
        raise OptmemInputError("expected a bandwidth (bytes per second, or a rate like "
                               "12GB/s)", field="bandwidth")
    per_chain = None if chain_bandwidth is None else \
        parse_chain_bandwidth(chain_bandwidth, allow_inf=allow_inf)
    if bandwidth is None:
        assert per_chain is not None
        if per_chain == 0 or math.isinf(per_chain):
            return per_chain, per_chain
        try:
            return per_chain / seconds_per(chain.time_unit), per_chain
        except OptmemInputError:
            return None, per_chain
    per_second = rate_per_second(bandwidth, allow_inf=allow_inf)
    converted = per_second if per_second == 0 or math.isinf(per_second) else \
        per_second * seconds_per(chain.time_unit)
    if per_chain is not None and not math.isclose(per_chain, converted, rel_tol=1e-9):
        raise OptmemInputError(f"bandwidth={bandwidth!r} (per second) and chain_bandwidth="
                               f"{chain_bandwidth!r} (per {chain.time_unit}) disagree: give "
                               f"one of them", field="bandwidth")
    return per_second, converted


@dataclass(frozen=True)
class OffloadProblem:
    """OFF_int: the fastest offloading plan of ``chain`` under ``memory_limit``.

    Parameters
    ----------
    chain
        The chain to train (a :class:`Chain`, a chain file path or a bundled dataset name).
    memory_limit
        GPU memory for activations, in the chain's memory unit; includes ``a^0``. Any form
        of :func:`optmem.units.memory_size` (``2 * 2**30``, ``2e9``, ``"2GiB"``).
    bandwidth
        Link bandwidth in **memory units (bytes) per second** or a rate string (``"12GB/s"``);
        ``0`` means no link: nothing can be offloaded. Stored as a float per second (``None``
        when the chain's time unit is not a time and ``chain_bandwidth`` was given).
    chain_bandwidth
        Keyword only, instead of ``bandwidth``: memory units per chain time unit (what the
        models and the simulator use; ``12GB/s`` with a chain in milliseconds is ``1.2e7``),
        a number or its text (``"1.2e7"``, as ``--chain-bandwidth``). Always set, as a
        float, after construction.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> c = Chain.from_lists([1], [2], [4], [6], input_size=4)
    >>> p = OffloadProblem(c, 12, "2kB/s")
    >>> p.name, p.bandwidth, p.chain_bandwidth
    ('offload', 2000.0, 2.0)
    >>> OffloadProblem(c, 12, chain_bandwidth=2.0) == p
    True
    """

    chain: Chain
    memory_limit: int  # any MemoryLike is accepted and normalised to int
    bandwidth: float | str | None = None  # per second; a rate string is normalised to float
    chain_bandwidth: float = field(default=None, kw_only=True)  # type: ignore[assignment]

    name = "offload"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", check_chain(self.chain))
        object.__setattr__(self, "memory_limit",
                           check_memory_limit(self.memory_limit, chain=self.chain))
        per_second, per_chain = link_bandwidths(self.chain, self.bandwidth,
                                                self.chain_bandwidth)
        object.__setattr__(self, "bandwidth", per_second)
        object.__setattr__(self, "chain_bandwidth", self.chain.check_rate(per_chain))

    def discretize(self, slots: int = DEFAULT_SLOTS) -> Discretized:
        """Return the discretised instance (CONTRACT section 2)."""
        return discretize(self.chain, self.memory_limit, slots)

    def unit_bandwidth(self, unit: int) -> float:
        """Bandwidth in discretised units (of ``unit`` bytes) per chain time unit."""
        return self.chain_bandwidth / unit
