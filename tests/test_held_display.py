"""Stop 83: the held terms of a chain (stop 82) in ``optmem datasets show`` and the loader.

``datasets show`` of a chain with held terms adds ``held`` (JSON: the non-zero terms,
``[stage, size]`` pairs) and ``held_h`` (one line of text); a chain without them prints the
same keys as before, in the same order. The loader refuses a held list of the wrong length
(the Python API; a chain file gives one term per stage).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from optmem.chain import Chain
from optmem.cli import held_text, main
from optmem.errors import ChainError
from optmem.solvers.dataset_summary import held_summary

BASE = Chain.from_lists([1, 1], [1, 1], [1, 1], [1, 1], input_size=3, fwd_overhead=[4, 0],
                        bwd_overhead=[0, 6000], loss_bwd_overhead=2, loss_bwd_time=1)
HELD = dataclasses.replace(BASE, fwd_held=(3, 0), bwd_held=(0, 6000), loss_held=2)
# the keys of `datasets show` before stop 83, in order
KEYS = ["name", "description", "time_unit", "memory_unit", "stages", "parameters",
        "store_all", "min_feasible", "compute_time", "store_all_h", "min_feasible_h",
        "parameters_h"]


def show(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stdout of ``optmem datasets show ARGV`` (exit 0)."""
    assert main(["datasets", "show", *argv]) == 0
    return capsys.readouterr().out


def test_show_names_the_held_terms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "held.json"
    HELD.save(path)
    row = json.loads(show(capsys, str(path), "--json"))
    assert list(row) == KEYS[:9] + ["held"] + KEYS[9:] + ["held_h"]
    assert row["held"] == {"fwd_held": [[1, 3]], "bwd_held": [[2, 6000]], "loss.held": 2}
    held_line = "held_h: fwd_held 3 B (stage 1); bwd_held 5.86 KiB (stage 2); loss.held 2 B"
    text = show(capsys, str(path)).splitlines()
    assert text[-1] == held_line and not any(line.startswith("held:") for line in text)


def test_show_of_a_chain_without_held_terms_is_unchanged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plain.json"
    BASE.save(path)
    assert list(json.loads(show(capsys, str(path), "--json"))) == KEYS
    assert [line.split(":")[0] for line in show(capsys, str(path)).splitlines()] == KEYS
    assert list(json.loads(show(capsys, "resnet-like-40", "--json"))) == KEYS


def test_held_text_summarises_many_stages() -> None:
    chain = Chain.from_lists([1] * 6, [1] * 6, [1] * 6, [1] * 6, input_size=1,
                             bwd_overhead=[2**20 * k for k in range(1, 7)])
    chain = dataclasses.replace(chain, bwd_held=chain.bwd_overhead)
    assert held_text(held_summary(chain), "B") == "bwd_held 6 stages, 1.00 MiB .. 6.00 MiB"
    assert held_text(held_summary(HELD), "KiB") == \
        "fwd_held 3 KiB (stage 1); bwd_held 6000 KiB (stage 2); loss.held 2 KiB"


@pytest.mark.parametrize(("field", "value"), [("fwd_held", (3,)), ("bwd_held", (0, 0, 0))])
def test_a_held_list_of_the_wrong_length_is_refused(field: str, value: tuple[int, ...]
                                                    ) -> None:
    with pytest.raises(ChainError, match=f"field '{field}': expected 2 values"):
        dataclasses.replace(BASE, **{field: value})


@pytest.mark.parametrize("precomputed", [False, True])
def test_a_bundled_chain_with_held_terms_is_loaded_once(
        precomputed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop 84: ``dataset_summary`` built the chain twice for a file with held terms and no
    complete precomputed summary (its figures, then its held terms); now once, and at most
    once with one. The figures are those of the chain file's summary."""
    from optmem.solvers import dataset_summary as module

    path = tmp_path / "held.json"
    data = HELD.to_dict()
    if precomputed:
        data["summary"] = module.compute_summary(HELD)
    path.write_text(json.dumps(data))
    monkeypatch.setattr(module, "dataset_path", lambda name: path)
    built: list[int] = []
    from_dict = Chain.from_dict

    def counted(*args: object, **kwargs: object) -> Chain:
        built.append(1)
        return from_dict(*args, **kwargs)

    monkeypatch.setattr(Chain, "from_dict", counted)
    summary = module.dataset_summary.__wrapped__(f"held-{precomputed}")
    monkeypatch.undo()
    expected = {k: v for k, v in module.chain_file_summary(str(path)).items() if k != "name"}
    assert len(built) == 1
    assert {k: v for k, v in summary.items() if k != "name"} == expected
