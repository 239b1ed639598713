"""The PyTorch bridge: the only part of optmem that imports torch.

>>> import torch
>>> import optmem.pytorch as op
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> sample = torch.randn(4, 8)
>>> cnet = op.checkpoint(net, sample, memory_limit="1MiB")
>>> cnet(sample).shape
torch.Size([4, 2])

Submodules: :mod:`~optmem.pytorch.extract` (module -> stages), :mod:`~optmem.pytorch.profile`
(stages -> chain), :mod:`~optmem.pytorch.execute` (plan -> training module),
:mod:`~optmem.pytorch.api` (all three), :mod:`~optmem.pytorch.memory` (activation tracking),
:mod:`~optmem.pytorch.models` (named model factories), :mod:`~optmem.pytorch.distributed`
(one plan for every rank, DDP, FSDP2), :mod:`~optmem.pytorch.pipelining` (pipeline plans on
``torch.distributed.pipelining``; ``pipeline`` is its one call) and :mod:`~optmem.pytorch.cli`
(``optmem profile``). Names are loaded lazily so that importing ``optmem.pytorch.cli`` or
``optmem.pytorch.models`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "checkpoint": "optmem.pytorch.api",
    "solve_chain": "optmem.pytorch.api",
    "smallest_limit": "optmem.pytorch.api",
    "CheckpointedModule": "optmem.pytorch.api",
    "CheckpointedChain": "optmem.pytorch.execute",
    "split_suffix": "optmem.pytorch.execute",
    "Stage": "optmem.pytorch.extract",
    "extract_stages": "optmem.pytorch.extract",
    "merge_stages": "optmem.pytorch.extract",
    "profile_chain": "optmem.pytorch.profile",
    "profile_stages": "optmem.pytorch.profile",
    "ActivationTracker": "optmem.pytorch.memory",
    "register_model": "optmem.pytorch.models",
    "pipeline": "optmem.pytorch.pipelining",
    "PipelinedModel": "optmem.pytorch.pipelining",
    "init_distributed": "optmem.pytorch.distributed",
    "resolve_spec": "optmem.pytorch.models",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optmem.pytorch' has no attribute {name!r}")
