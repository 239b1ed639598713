"""Bundled chain profiles (package data) and synthetic generators.

A chain argument anywhere in optmem (Python or CLI) is either a path to an
``optmem.chain/1`` file or the name of a bundled dataset (``optmem datasets list``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from optmem.chain import Chain
from optmem.errors import ChainError

DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class DatasetInfo:
    """One bundled chain file: name, path and the description it carries."""

    name: str
    path: Path
    description: str


@cache
def _index() -> dict[str, DatasetInfo]:
    out = {}
    for path in sorted(DATA_DIR.glob("*.json")):
        try:
            desc = json.loads(path.read_text()).get("description", "")
        except (OSError, json.JSONDecodeError):
            desc = ""
        out[path.stem] = DatasetInfo(path.stem, path, str(desc))
    return out


def list_datasets() -> list[DatasetInfo]:
    """Every bundled chain, sorted by name."""
    return list(_index().values())


def dataset_path(name: str) -> Path:
    """Path of a bundled chain; unknown names get one clear error."""
    index = _index()
    if name not in index:
        close = [n for n in index if name.lower() in n.lower()][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else \
            " (see 'optmem datasets list')"
        raise ChainError(f"no chain file or bundled dataset named {name!r}{hint}")
    return index[name].path


def load_dataset(name: str) -> Chain:
    """Load a bundled chain by name."""
    return Chain.load(dataset_path(name))


def is_chain_path(spec: str | Path) -> bool:
    """Whether ``spec`` names a chain file rather than a bundled dataset.

    A path that exists, ends in ``.json`` or contains a ``/`` is a file (read with
    :meth:`Chain.load`, which names it when it cannot be read); anything else is a name.
    """
    path = Path(spec)
    try:
        exists = path.exists()
    except OSError:  # a name too long for the file system: Chain.load says so
        exists = True
    return exists or path.suffix == ".json" or "/" in str(spec)


def resolve_chain(spec: str | Path) -> Chain:
    """Load ``spec`` as a chain file if it exists, else as a bundled dataset name."""
    if is_chain_path(spec):
        return Chain.load(Path(spec))
    return load_dataset(str(spec))
