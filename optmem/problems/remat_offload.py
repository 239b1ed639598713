"""Rematerialisation and offloading combined: problem OFFREMAT(L, M_GPU, beta).

Thesis (Shilova) chapter 4, Problems 8 / 11 (digest ``shared/design/offload.md`` section 5):
train the chain with any sequence of the checkpoint ops of CONTRACT section 3 (``F_all``,
``F_ck``, ``F_none``, ``Loss``, ``B``) *and* move stored values to host memory and back over
one link of bandwidth ``beta`` running concurrently with compute (``offload X`` /
``prefetch X`` of CONTRACT "Offload plans"), so that GPU memory stays within ``M_GPU``;
minimise the makespan.

The simulator is the offload one, :func:`optmem.simulate.offload.simulate_offload`, which
already replays combined plans (compute stream + link, assumptions O.1-O.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optmem.chain import Chain
from optmem.problems.offload import (
    OffloadProblem,
    add_cli_options,
    bandwidth_from_cli,
    verify_plan,
)

__all__ = ["RematOffloadProblem", "add_cli_options", "problem_from_cli", "verify_plan"]


@dataclass(frozen=True)
class RematOffloadProblem(OffloadProblem):
    """OFFREMAT: the fastest remat + offload plan of ``chain`` under ``memory_limit``.

    Same data and validation as :class:`~optmem.problems.offload.OffloadProblem`; plans may
    also recompute (any checkpoint op). ``bandwidth = 0`` makes it plain checkpointing. The
    CLI options and ``verify_plan`` are the offload problem's.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> c = Chain.from_lists([1], [2], [4], [6], input_size=4)
    >>> p = RematOffloadProblem(c, 12, chain_bandwidth=2.0)
    >>> p.name, p.bandwidth, p.chain_bandwidth
    ('remat-offload', 2000.0, 2.0)
    """

    name = "remat-offload"


def problem_from_cli(chain: Chain, memory_limit: int, args: Any) -> RematOffloadProblem:
    """Build the problem from CLI arguments (``--bandwidth`` is required)."""
    return RematOffloadProblem(chain, memory_limit, bandwidth_from_cli(args, "remat-offload"))
