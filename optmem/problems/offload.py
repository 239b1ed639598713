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

import argparse
from dataclasses import dataclass
from typing import Any

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.problems.checkpoint import (
    DEFAULT_SLOTS,
    Discretized,
    check_bandwidth,
    check_memory_limit,
    discretize,
)


@dataclass(frozen=True)
class OffloadProblem:
    """OFF_int: the fastest offloading plan of ``chain`` under ``memory_limit``.

    Parameters
    ----------
    chain
        The chain to train.
    memory_limit
        GPU memory for activations, in the chain's memory unit; includes ``a^0``.
    bandwidth
        Link bandwidth in memory units per chain time unit (``12GB/s`` with a chain in
        milliseconds is ``1.2e7``). ``0`` means no link: nothing can be offloaded.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> p = OffloadProblem(Chain.from_lists([1], [2], [4], [6], input_size=4), 12, 2.0)
    >>> p.name, p.bandwidth
    ('offload', 2.0)
    """

    chain: Chain
    memory_limit: int
    bandwidth: float

    name = "offload"

    def __post_init__(self) -> None:
        check_memory_limit(self.memory_limit)
        bw = check_bandwidth(self.bandwidth)
        object.__setattr__(self, "bandwidth", self.chain.check_rate(bw))

    def discretize(self, slots: int = DEFAULT_SLOTS) -> Discretized:
        """Return the discretised instance (CONTRACT section 2)."""
        return discretize(self.chain, self.memory_limit, slots)

    def unit_bandwidth(self, unit: int) -> float:
        """Bandwidth in discretised units (of ``unit`` bytes) per time unit."""
        return self.bandwidth / unit


# ------------------------------------------------------------------ CLI hooks
def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``optmem solve offload``: ``--bandwidth``."""
    parser.add_argument(
        "--bandwidth", default=None,
        help="offload link bandwidth, e.g. 12GB/s (converted with the chain's time unit), "
             "or a bare number of memory units per chain time unit")


def bandwidth_from_cli(chain: Chain, args: Any, problem: str) -> float:
    """The ``--bandwidth`` of ``args`` in memory units per chain time unit (required)."""
    from optmem.units import parse_bandwidth

    text = getattr(args, "bandwidth", None)
    if text is None:
        raise OptmemInputError(f"the {problem} problem needs --bandwidth (e.g. 12GB/s)",
                               field="bandwidth")
    return parse_bandwidth(text, time_unit=chain.time_unit)


def problem_from_cli(chain: Chain, memory_limit: int, args: Any) -> OffloadProblem:
    """Build the problem from CLI arguments (``--bandwidth`` is required)."""
    return OffloadProblem(chain, memory_limit, bandwidth_from_cli(chain, args, "offload"))


def verify_plan(problem: OffloadProblem, plan_data: Any, options: Any = None) -> dict[str, Any]:
    """Replay an offload (or combined remat + offload) plan (ops or ``solve --json`` output).

    Raises
    ------
    PlanError
        With the index of the first invalid op and the reason.
    """
    from optmem.plan import parse_mixed_plan
    from optmem.simulate.offload import simulate_offload

    ops = plan_data.get("plan") if isinstance(plan_data, dict) else plan_data
    if not isinstance(ops, list):
        raise PlanError("expected a JSON list of ops or an object with a 'plan' list")
    slots = getattr(options, "slots", DEFAULT_SLOTS)
    disc = problem.discretize(slots)
    sim = simulate_offload(disc.chain, parse_mixed_plan(ops), problem.unit_bandwidth(disc.unit),
                           disc.memory_limit)
    if sim.peak_memory > disc.memory_limit:
        raise PlanError(f"the plan peaks at {sim.peak_memory}, above {disc.memory_limit}")
    return {"objective": sim.makespan, "peak_memory": sim.peak_memory,
            "memory_limit": disc.memory_limit, "unit": disc.unit, "ops": len(ops),
            "idle_time": sim.idle_time, "offloaded": sim.offloaded_size}
