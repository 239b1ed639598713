"""One-line summaries of bundled chains (and chain files) for ``optmem datasets``.

:func:`dataset_summary` returns the number of stages, the parameter count, the store-all
activation peak (:meth:`optmem.chain.Chain.store_all_peak`) and the smallest memory at which
checkpointing is feasible (:func:`optmem.solvers.checkpoint_dp.min_memory_persistent`, exact,
no discretisation). Zoo files carry these figures precomputed in a ``summary`` field
(written by :mod:`optmem.pytorch.build_datasets`; ``tests/test_zoo_datasets.py`` checks that they
match a recomputation), so that listing every bundled file takes well under a second; files
without it are summarised on the fly. A chain with held terms (``fwd_held``, ``bwd_held``,
``loss.held``, stop 82) also gets ``held`` (:func:`held_summary`, since stop 83).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from optmem.chain import Chain
from optmem.datasets import dataset_path

SUMMARY_KEYS = ("stages", "parameters", "store_all", "min_feasible", "compute_time")
HELD_KEYS = ("fwd_held", "bwd_held", "loss.held")


def held_summary(chain: Chain) -> dict[str, Any]:
    """The held terms of ``chain`` that are not 0 (stop 83; empty for most chains).

    Returns
    -------
    dict
        ``fwd_held`` and ``bwd_held`` as lists of ``[stage, size]`` (1-based stages, only
        the stages whose term is not 0, only when there is one) and ``loss.held`` (only
        when not 0): the fields of the chain file (CONTRACT section 1).

    Examples
    --------
    >>> from dataclasses import replace
    >>> c = Chain.from_lists([1, 1], [1, 1], [1, 1], [1, 1], input_size=1,
    ...                      bwd_overhead=[0, 6])
    >>> held_summary(c), held_summary(replace(c, bwd_held=(0, 4)))
    ({}, {'bwd_held': [[2, 4]]})
    """
    out: dict[str, Any] = {}
    for name in HELD_KEYS[:2]:
        terms = [[i, size] for i, size in enumerate(getattr(chain, name), start=1) if size]
        if terms:
            out[name] = terms
    if chain.loss_held:
        out["loss.held"] = chain.loss_held
    return out


def _file_holds(data: Any) -> bool:
    """Whether a chain file's JSON sets a held term (without building the chain)."""
    stages = data.get("stages") if isinstance(data, dict) else None
    loss = data.get("loss") if isinstance(data, dict) else None
    return any(isinstance(s, dict) and (s.get("fwd_held") or s.get("bwd_held"))
               for s in stages or ()) or bool(isinstance(loss, dict) and loss.get("held"))


def compute_summary(chain: Chain) -> dict[str, Any]:
    """Summary figures of ``chain`` (sizes in its memory unit, time in its time unit).

    Returns
    -------
    dict
        ``stages``, ``parameters`` (from the chain's ``parameters`` field, else ``None``),
        ``store_all`` (store-all peak), ``min_feasible`` (smallest feasible memory of the
        persistent DP) and ``compute_time`` (sum of all op times, the makespan of store-all).
    """
    from optmem.solvers.checkpoint_dp import min_memory_persistent

    params = chain.extra.get("parameters")
    return {
        "stages": chain.length,
        "parameters": int(params) if isinstance(params, int) else None,
        "store_all": chain.store_all_peak(),
        "min_feasible": min_memory_persistent(chain),
        "compute_time": round(chain.total_compute_time(), 6),
    }


def chain_file_summary(path: str) -> dict[str, Any]:
    """:func:`dataset_summary` of the chain file ``path`` (always recomputed, not cached).

    ``name`` is ``path`` as given; the figures come from the chain, never from a ``summary``
    field the file may carry.
    """
    chain = Chain.load(path)
    held = held_summary(chain)
    return {"name": path, "description": str(chain.extra.get("description", "")),
            "time_unit": chain.time_unit, "memory_unit": chain.memory_unit,
            **compute_summary(chain), **({"held": held} if held else {})}


@cache
def dataset_summary(name: str) -> dict[str, Any]:
    """Summary of the bundled chain ``name`` (see :func:`compute_summary`).

    Adds ``name``, ``description``, ``time_unit`` and ``memory_unit``. Uses the file's
    precomputed ``summary`` field when it has every key, else loads and computes.

    Examples
    --------
    >>> s = dataset_summary("resnet-like-40")
    >>> s["stages"], s["min_feasible"] < s["store_all"]
    (40, True)
    """
    path = dataset_path(name)
    data = json.loads(path.read_text())
    stored = data.get("summary")
    chain: Chain | None = None  # loaded once, when a figure needs it
    if isinstance(stored, dict) and all(k in stored for k in SUMMARY_KEYS):
        figures = {k: stored[k] for k in SUMMARY_KEYS}
    else:
        chain = Chain.from_dict(data, source=str(path))
        figures = compute_summary(chain)
    if _file_holds(data):
        if chain is None:
            chain = Chain.from_dict(data, source=str(path))
        figures["held"] = held_summary(chain)
    return {"name": name, "description": str(data.get("description", "")),
            "time_unit": data.get("time_unit", "ms"), "memory_unit": data.get("memory_unit", "B"),
            **figures}
