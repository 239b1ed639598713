"""Up-front checks of the one-liners' own arguments (stop 84, ``docs/pytorch.md``).

``op.checkpoint``, ``op.offload``, ``op.remat_offload`` and ``op.profile_chain`` check every
option they take here, before any export, profile or solve: a bad value is one
:class:`~optmem.errors.OptmemInputError` naming the option and what it takes, and the model
is left untouched. Before, many values reached the profiler or the solver and failed there
with Python's own ``TypeError`` (``repeats="3"``, ``time_model="a100"``, ``chain={}``) or
torch's ``RuntimeError`` (``device="gpu0"``), some only on one path (``slots=-1`` was
accepted when the store-all plan fits, ``extract="abc"`` for an ``nn.Sequential``), some
were taken as something else (``progress="no"`` read as true, ``repeats=True`` as 1,
``op_overhead=True`` as 1 ms), and ``repeats=2**70`` ran for ever.

Examples
--------
>>> check_options({"repeats": 3, "progress": False})
>>> check_options({"repeats": True})
Traceback (most recent call last):
...
optmem.errors.OptmemInputError: field 'repeats': expected a whole number (1..10000), got True
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.problems.pipeline import MAX_GPUS, MAX_WEIGHT_COPIES, MEMORY_MODELS
from optmem.result import check_integer

__all__ = ["EXTRACT_METHODS", "MAX_MICROBATCHES", "MAX_REPEATS", "check_device", "check_module",
           "check_options", "check_rounds", "check_usable_device", "flag", "plan_argument"]

EXTRACT_METHODS = ("auto", "export", "fx")
"""The values of ``extract=``."""

MAX_REPEATS = 10_000
"""Most timed runs (``repeats``, ``warmup``, ``autotune_rounds``) a one-liner takes."""

MAX_CHARGE_MS = 1e9
"""Largest per-op charge (``op_overhead`` ms, ``op_overhead_ratio``): larger ones only make
the chain's times leave the range a chain holds (1e12)."""

MAX_MICROBATCHES = 100_000
"""Most micro-batches per pipeline step (``microbatches``): the runtime makes an action and
receive buffers for each (``2**70`` built its action list for ever, stop 85)."""

MAX_SEGMENT_COST_MS = 1e12
"""Largest ``segment_cost`` (ms): the checkpoint ``dp``'s own range (CONTRACT section 15)."""


def _count(low: int, high: int | None = MAX_REPEATS) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        check_integer(value, name, low, high, "a whole number")
    return check


def _optional(check: Callable[[Any, str], object]) -> Callable[[Any, str], None]:
    def optional(value: Any, name: str) -> None:
        if value is not None:
            check(value, name)
    return optional


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool if it is one (numpy's too); otherwise one error naming ``name``."""
    if not isinstance(value, bool | np.bool_):
        raise OptmemInputError(f"expected True or False, got {value!r}", field=name)
    return bool(value)


def _charge(value: Any, name: str, high: float = MAX_CHARGE_MS) -> None:
    number = math.nan
    if not isinstance(value, bool | np.bool_) and isinstance(value, Real):
        try:
            number = float(value)
        except OverflowError:  # an int past a float's range
            number = math.inf
    if not 0 <= number <= high:
        raise OptmemInputError(f"expected a number of milliseconds (or a ratio) in "
                               f"0..{high:g}, got {value!r}", field=name)


def check_rounds(rounds: Any, name: str = "autotune_rounds") -> None:
    """One error unless ``rounds`` (``autotune_rounds``) is a whole number in 1..10,000.

    In autotune's own words since stop 51 (:func:`~optmem.pytorch.autotune.autotune`).
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or \
            not 1 <= rounds <= MAX_REPEATS:
        raise OptmemInputError(f"{name}: expected an integer >= 1 (at most "
                               f"{MAX_REPEATS}), got {rounds!r}", field=name)


def _segment_cost(value: Any, name: str) -> None:
    _charge(value, name, MAX_SEGMENT_COST_MS)


def _callable(value: Any, name: str) -> None:
    if not callable(value) or isinstance(value, type):
        raise OptmemInputError(f"expected a function, got {value!r}", field=name)


def _extract(value: Any, name: str) -> None:
    if not isinstance(value, str) or value not in EXTRACT_METHODS:
        raise OptmemInputError(f"expected one of {', '.join(map(repr, EXTRACT_METHODS))}, got "
                               f"{value!r}", field=name)


def _chain(value: Any, name: str) -> None:
    if not isinstance(value, Chain):
        raise OptmemInputError(f"expected an optmem Chain (op.profile_chain(...) or "
                               f"Chain.load(path)), got {type(value).__name__}", field=name)


def _name(value: Any, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise OptmemInputError(f"expected a non-empty string, got {value!r}", field=name)


def _choice(choices: Sequence[str]) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if not isinstance(value, str) or value not in choices:
            raise OptmemInputError(f"expected one of {', '.join(map(repr, choices))}, got "
                                   f"{value!r}", field=name)
    return check


def _path(value: Any, name: str) -> None:
    """A file name: a non-empty string or a path (an int is a file descriptor to ``open``)."""
    if not (isinstance(value, str) and value) and not isinstance(value, os.PathLike):
        raise OptmemInputError(f"expected the path of a file, got {value!r}", field=name)


def check_device(value: Any, name: str = "device") -> None:
    """One error unless torch parses ``value`` as a device (``None``: the sample's).

    Examples
    --------
    >>> check_device("cpu"); check_device("meta"); check_device(None)
    >>> check_device("gpu0")
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'device': expected a device such as 'cpu', \
'cuda:0' or 'meta', got 'gpu0'
    """
    if value is None:
        return
    if isinstance(value, bool | np.bool_) or not isinstance(value, str | torch.device | int):
        raise OptmemInputError(f"expected a device such as 'cpu', 'cuda:0' or 'meta', got "
                               f"{value!r}", field=name)
    try:  # where the weights are is the profile's check (it names the fix)
        torch.device(value)
    except (RuntimeError, TypeError, ValueError, OverflowError):
        raise OptmemInputError(f"expected a device such as 'cpu', 'cuda:0' or 'meta', got "
                               f"{value!r}", field=name) from None


def check_usable_device(value: Any, name: str = "device") -> None:
    """:func:`check_device`, and a CUDA device must be one of this machine's.

    For the pipeline's ``device`` (where this rank's stages are moved): ``"cuda:99"`` or
    ``0`` on a machine without it failed in ``torch.cuda`` (``AssertionError``) after the
    profile (stop 85).
    """
    check_device(value, name)
    if value is None:
        return
    device = torch.device(value)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise OptmemInputError(f"expected a device of this machine, got {value!r} ({count} "
                               f"CUDA device(s))", field=name)


_CHECKS: dict[str, Callable[[Any, str], object]] = {
    "repeats": _count(1), "warmup": _count(0), "max_stages": _optional(_count(1, None)),
    "autotune_rounds": _optional(check_rounds), "progress": _optional(flag),
    "measure_segments": _optional(flag), "dynamic": flag, "fast_path": flag,
    "autotune": flag, "preserve_rng_state": flag, "restore_buffers": flag,
    "strip_suffix": flag, "op_overhead": _optional(_charge),
    "op_overhead_ratio": _optional(_charge), "segment_cost": _optional(_segment_cost),
    "time_model": _optional(_callable), "loss_fn": _optional(_callable),
    "segment_timer": _optional(_callable),
    "adjust_chain": _optional(_callable), "extract": _extract, "chain": _optional(_chain),
    "device": check_device, "name": _optional(_name),
    # the pipeline's (stop 85)
    "gpus": _optional(_count(1, MAX_GPUS)),
    "microbatches": _optional(_count(1, MAX_MICROBATCHES)),
    "weight_copies": _count(0, MAX_WEIGHT_COPIES), "memory_model": _choice(MEMORY_MODELS),
    "scale_grads": flag, "schedule_csv": _optional(_path),
}


def check_options(options: Mapping[str, Any]) -> None:
    """Check each known option of ``options`` (the others are the callee's to check).

    Raises
    ------
    OptmemInputError
        Naming the first bad option and what it takes.
    """
    for name, value in options.items():
        check = _CHECKS.get(name)
        if check is not None:
            check(value, name)


def check_module(module: Any) -> None:
    """One error unless ``module`` is an ``nn.Module`` or a list of modules and stages."""
    from torch import nn

    from optmem.pytorch.extract import Stage

    if isinstance(module, nn.Module):
        if type(module).forward is nn.Module.forward and "forward" not in vars(module):
            raise OptmemInputError(f"{type(module).__name__} has no forward (a ModuleList or "
                                   f"ModuleDict: pass an nn.Sequential or a list of its "
                                   f"modules)", field="module")
        return
    if isinstance(module, Sequence) and not isinstance(module, str | bytes):
        bad = next((k for k, m in enumerate(module) if not isinstance(m, nn.Module | Stage)),
                   None)
        if bad is None:
            return
        raise OptmemInputError(f"item {bad} of the list of stages is a "
                               f"{type(module[bad]).__name__}, not an nn.Module or a Stage",
                               field="module")
    raise OptmemInputError(f"expected an nn.Module or a list of stage modules, got a "
                           f"{type(module).__name__}", field="module")


def plan_argument(plan: Any) -> Sequence[Any]:
    """``plan`` if it is a list or tuple of ops (strings such as ``"F1"``), else one error."""
    if isinstance(plan, str | bytes) or not isinstance(plan, Sequence):
        raise OptmemInputError(f"expected a list of ops such as ['F1', 'F2', 'B2', 'B1'], "
                               f"got {plan!r}", field="plan")
    return plan

