"""Checkpointing (rematerialisation) of a heterogeneous chain: problem Remat(L, M).

Thesis chapter 2, Problem 6: find a valid sequence of the ops of CONTRACT section 3
(``F_all``, ``F_ck``, ``F_none``, ``Loss``, ``B``) whose peak memory is at most ``M`` and
whose makespan is minimal. The chain input a^0 counts against ``M``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from optmem.chain import Chain
from optmem.datasets import resolve_chain
from optmem.errors import OptmemInputError
from optmem.result import check_integer
from optmem.units import memory_percent, memory_size, relative_memory

DEFAULT_SLOTS = 500


def unit_of(limit: int, slots: int) -> int:
    """The discretisation unit of ``limit``: ``max(1, limit // slots)`` (CONTRACT section 2).

    Examples
    --------
    >>> unit_of(10_000, 100), unit_of(50, 100)
    (100, 1)
    """
    return max(1, limit // slots)


@dataclass(frozen=True)
class Discretized:
    """A chain and a limit on integer memory (CONTRACT section 2).

    Parameters
    ----------
    chain
        The chain with every size rounded up to units.
    memory_limit
        The limit in units (``M // unit``).
    unit
        Bytes (chain memory units) per discretised unit.
    """

    chain: Chain
    memory_limit: int
    unit: int


def discretize(chain: Chain, memory_limit: int, slots: int = DEFAULT_SLOTS) -> Discretized:
    """Discretise memory as CONTRACT section 2 says.

    ``unit = max(1, M // S)``, sizes become ``ceil(size / unit)``, the limit ``M // unit``.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> c = Chain.from_lists([1], [1], [1000], [1500], input_size=10)
    >>> d = discretize(c, 10_000, slots=100)
    >>> d.unit, d.memory_limit, d.chain.saved_size, d.chain.input_size
    (100, 100, (15,), 1)
    """
    slots = check_integer(slots, "slots", 1, None, "an integer number of slots")
    if memory_limit < 0:
        raise OptmemInputError(f"expected a non-negative memory limit, got {memory_limit}",
                               field="memory")
    unit = unit_of(memory_limit, slots)
    return Discretized(chain.quantize(unit), memory_limit // unit, unit)


def check_chain(value: object) -> Chain:
    """A problem's chain: a :class:`Chain`, a chain file path or a bundled dataset name.

    Strings and paths are read as the CLI reads its ``CHAIN`` argument
    (:func:`optmem.datasets.resolve_chain`); anything else raises one
    :class:`OptmemInputError` naming the field ``chain``.
    """
    if isinstance(value, Chain):
        return value
    if isinstance(value, str | os.PathLike):
        return resolve_chain(os.fspath(value))
    raise OptmemInputError(f"expected a Chain, a chain file path or a bundled dataset name, "
                           f"got {type(value).__name__}", field="chain")


def check_memory_limit(value: object, *, field: str = "memory_limit",
                       chain: Chain | None = None) -> int:
    """Normalise a memory limit to bytes (:func:`optmem.units.memory_size`) or raise.

    With ``chain``, a percentage (``"60%"``) is of its store-all peak, rounded down
    (:func:`optmem.units.relative_memory`), as the CLI's ``--memory 60%`` and the torch
    bridge's ``memory_limit="60%"`` read it.
    """
    if chain is not None and memory_percent(value, field=field) is not None:
        return relative_memory(value, chain.store_all_peak(), field=field)
    return memory_size(value, field=field)


@dataclass(frozen=True)
class CheckpointProblem:
    """Remat(L, M): the fastest checkpointing plan of ``chain`` under ``memory_limit``.

    Parameters
    ----------
    chain
        The chain to train: a :class:`Chain`, a chain file path or a bundled dataset name
        (as the CLI's ``CHAIN``, :func:`check_chain`).
    memory_limit
        Memory limit in the chain's memory unit (bytes by default); includes a^0. An int,
        a numpy integer, an integral float (``2e9``), a size string (``"2GiB"``) or a
        percentage of the chain's store-all peak (``"60%"``, rounded down); stored as an
        int (:func:`check_memory_limit`).

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> c = Chain.from_lists([1], [1], [1000], [1500], input_size=10)
    >>> CheckpointProblem(c, "1.5KiB").memory_limit, CheckpointProblem(c, 2e3).memory_limit
    (1536, 2000)
    """

    chain: Chain
    memory_limit: int  # any MemoryLike is accepted and normalised to int

    name = "checkpoint"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", check_chain(self.chain))
        object.__setattr__(self, "memory_limit",
                           check_memory_limit(self.memory_limit, chain=self.chain))

    def discretize(self, slots: int = DEFAULT_SLOTS) -> Discretized:
        """Return the discretised instance (CONTRACT section 2)."""
        return discretize(self.chain, self.memory_limit, slots)
