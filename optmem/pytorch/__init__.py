"""The PyTorch bridge: the only part of optmem that imports torch.

>>> import torch
>>> import optmem.pytorch as op
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> sample = torch.randn(4, 8)
>>> cnet = op.checkpoint(net, sample, memory_limit="1MiB")
>>> cnet(sample).shape
torch.Size([4, 2])

Submodules: :mod:`~optmem.pytorch.extract` (module -> stages; :mod:`~optmem.pytorch.graphcut`
cuts exported graphs, :mod:`~optmem.pytorch.context` carries side inputs),
:mod:`~optmem.pytorch.profile` (stages -> chain), :mod:`~optmem.pytorch.execute`,
:mod:`~optmem.pytorch.offload`, :mod:`~optmem.pytorch.remat_offload` (plan -> training
module), :mod:`~optmem.pytorch.planning` (chain -> plan), :mod:`~optmem.pytorch.wrapper`
and :mod:`~optmem.pytorch.api` (all of it, behind the model's own face),
:mod:`~optmem.pytorch.memory` (activation tracking),
:mod:`~optmem.pytorch.models` (named model factories), :mod:`~optmem.pytorch.distributed`
(one plan for every rank, DDP, FSDP2), :mod:`~optmem.pytorch.pipelining` (pipeline plans on
``torch.distributed.pipelining``; ``pipeline`` is its one call) and :mod:`~optmem.pytorch.cli`
(``optmem profile``). Names are loaded lazily so that importing ``optmem.pytorch.cli`` or
``optmem.pytorch.models`` does not import torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_LAZY = {
    "checkpoint": "optmem.pytorch.api",
    "offload": "optmem.pytorch.api",
    "remat_offload": "optmem.pytorch.api",
    "profile_chain": "optmem.pytorch.api",
    "solve_chain": "optmem.pytorch.api",
    "smallest_limit": "optmem.pytorch.api",
    "submodule_sample": "optmem.pytorch.api",
    "CheckpointedModule": "optmem.pytorch.api",
    "OffloadedModule": "optmem.pytorch.api",
    "RematOffloadedModule": "optmem.pytorch.api",
    "PlannedModule": "optmem.pytorch.wrapper",
    "CheckpointedChain": "optmem.pytorch.execute",
    "OffloadedChain": "optmem.pytorch.offload",
    "RematOffloadChain": "optmem.pytorch.remat_offload",
    "split_suffix": "optmem.pytorch.execute",
    "Stage": "optmem.pytorch.extract",
    "Extraction": "optmem.pytorch.extract",
    "extract_program": "optmem.pytorch.extract",
    "extract_stages": "optmem.pytorch.extract",
    "merge_stages": "optmem.pytorch.extract",
    "SideInputs": "optmem.pytorch.context",
    "side_inputs": "optmem.pytorch.context",
    "profile_stages": "optmem.pytorch.profile",
    "ActivationTracker": "optmem.pytorch.memory",
    "register_model": "optmem.pytorch.models",
    "pipeline": "optmem.pytorch.pipelining",
    "PipelinedModel": "optmem.pytorch.pipelining",
    "init_distributed": "optmem.pytorch.distributed",
    "end_process": "optmem.pytorch.distributed",
    "resolve_spec": "optmem.pytorch.models",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optmem.pytorch' has no attribute {name!r}")


# ``op.offload`` and ``op.remat_offload`` are functions, but ``optmem.pytorch.offload`` and
# ``optmem.pytorch.remat_offload`` are also submodules (the executors), and importing a
# submodule binds it as an attribute of its package. Keep the functions: the package ignores
# that binding (``from optmem.pytorch.offload import OffloadedChain`` still works, through
# ``sys.modules``).
_FUNCTIONS_NAMED_LIKE_SUBMODULES = frozenset({"offload", "remat_offload"})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS_NAMED_LIKE_SUBMODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
