"""Register every zoo model with :func:`optmem.pytorch.models.register_model`.

Importing this module (listed in ``optmem.pytorch.models.ZOO_MODULES``) makes the zoo names
usable as ``optmem profile resnet101 --batch 8 --device meta``. Each factory takes
``batch`` (default 8) and ``size`` (resolution or sequence length, default the model's) and
returns ``(module, sample)`` built on the current default device; nothing imports torch
until a factory runs.
"""

from __future__ import annotations

from typing import Any

from optmem.pytorch.models import register_model
from optmem.pytorch.zoo import ZOO, ZooModel


def _factory(entry: ZooModel) -> Any:
    def make(batch: int = 8, size: int | None = None) -> tuple[Any, Any]:
        net = entry.build(size)
        net.train()
        return net, entry.sample(batch, size, device=None)

    make.__name__ = entry.name.replace("-", "_")
    make.__doc__ = f"{entry.description} (zoo; input {entry.input}, default size {entry.size})"
    return make


for _entry in ZOO.values():
    register_model(_entry.name, _factory(_entry), description=f"zoo: {_entry.description}")
