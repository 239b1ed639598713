"""Comparing results as JSON, whatever the wall clock."""

from __future__ import annotations

from typing import Any


def timeless(result: Any) -> dict[str, Any]:
    """The JSON result without its wall-clock figures (keys ending ``_s``, ``seconds``).

    Two solves of the same input under the same deterministic limits give equal
    ``timeless`` results on any machine and load (the work budget's promise, CONTRACT 14).
    """
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()
                    if not (k.endswith("_s") or k == "seconds")}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(result.to_json())
