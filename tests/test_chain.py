"""Chain files (CONTRACT section 1) and memory discretisation (CONTRACT section 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optmem.chain import FORMAT, Chain
from optmem.datasets import list_datasets, load_dataset, resolve_chain
from optmem.datasets.synthetic import random_chain, resnet_like_chain
from optmem.errors import ChainError, OptmemInputError
from optmem.problems import CheckpointProblem
from optmem.problems.checkpoint import discretize
from optmem.result import SolveOptions
from optmem.solvers.facade import solve


def valid_dict() -> dict:
    return {
        "format": FORMAT, "name": "tiny", "time_unit": "ms", "memory_unit": "B",
        "input_size": 4,
        "stages": [
            {"name": "conv", "fwd_time": 1.5, "bwd_time": 3, "output_size": 8, "saved_size": 12,
             "fwd_overhead": 1, "bwd_overhead": 2, "weight_size": 100},
            {"name": "fc", "fwd_time": 0.5, "bwd_time": 1.0, "output_size": 2, "saved_size": 2},
        ],
        "loss": {"bwd_time": 0.25, "bwd_overhead": 3},
    }


def write(tmp_path: Path, data, name: str = "chain.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ------------------------------------------------------------------ load and round-trip
def test_load_fields(tmp_path: Path) -> None:
    chain = Chain.load(write(tmp_path, valid_dict()))
    assert chain.length == 2
    assert chain.fwd_time == (1.5, 0.5) and chain.bwd_time == (3.0, 1.0)
    assert chain.output_size == (8, 2) and chain.saved_size == (12, 2)
    assert chain.fwd_overhead == (1, 0) and chain.bwd_overhead == (2, 0)  # defaults 0
    assert chain.weight_size == (100, 0)
    assert (chain.input_size, chain.loss_bwd_time, chain.loss_bwd_overhead) == (4, 0.25, 3)
    assert chain.stage_names == ("conv", "fc") and chain.name == "tiny"
    assert chain.total_compute_time() == 1.5 + 0.5 + 3 + 1 + 0.25


def test_round_trip_keeps_unknown_fields(tmp_path: Path) -> None:
    data = valid_dict()
    data["description"] = "kept"
    data["stages"][0]["flops"] = 123
    chain = Chain.load(write(tmp_path, data))
    out = tmp_path / "out.json"
    chain.save(out)
    again = Chain.load(out)
    assert again == chain
    saved = json.loads(out.read_text())
    assert saved["description"] == "kept" and saved["stages"][0]["flops"] == 123
    assert saved["format"] == FORMAT
    assert Chain.from_dict(chain.to_dict()) == chain


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_random(tmp_path: Path, seed: int) -> None:
    chain = random_chain(6, seed=seed, integer_times=False)
    path = tmp_path / "c.json"
    chain.save(path)
    assert Chain.load(path) == chain


def test_loss_is_optional(tmp_path: Path) -> None:
    data = valid_dict()
    del data["loss"]
    chain = Chain.load(write(tmp_path, data))
    assert (chain.loss_bwd_time, chain.loss_bwd_overhead) == (0.0, 0)


def test_bundled_datasets_load() -> None:
    names = [d.name for d in list_datasets()]
    assert names
    for name in names:
        assert load_dataset(name).length > 0
        assert resolve_chain(name) == load_dataset(name)


def test_from_rotor_convention() -> None:
    chain = Chain.from_rotor([2, 3], [3, 5, 1], [2, 3, 1], [0, 5, 2], [1, 0], [1, 2, 4])
    assert chain.input_size == 2 and chain.output_size == (3, 1)
    assert chain.saved_size == (5, 2) and chain.fwd_overhead == (1, 0)
    assert chain.bwd_overhead == (1, 2) and chain.bwd_time == (3.0, 5.0)
    assert (chain.loss_bwd_time, chain.loss_bwd_overhead) == (1.0, 4)


# ------------------------------------------------------------------ malformed files
def _mutate(path: tuple, value) -> dict:
    data = valid_dict()
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


_DELETE = object()

MALFORMED = [
    # (mutation path, new value, stage named in the message, field named)
    (("stages", 1, "saved_size"), _DELETE, 2, "saved_size"),
    (("stages", 0, "fwd_time"), _DELETE, 1, "fwd_time"),
    (("input_size",), _DELETE, None, "input_size"),
    (("stages", 0, "output_size"), -3, 1, "output_size"),
    (("stages", 1, "fwd_overhead"), -1, 2, "fwd_overhead"),
    (("input_size",), -5, None, "input_size"),
    (("stages", 0, "saved_size"), 7, 1, "saved_size"),  # < output_size 8
    (("stages", 1, "bwd_time"), float("nan"), 2, "bwd_time"),
    (("stages", 0, "fwd_time"), float("inf"), 1, "fwd_time"),
    (("stages", 0, "fwd_time"), -1.0, 1, "fwd_time"),
    (("stages", 0, "output_size"), 2.5, 1, "output_size"),
    (("stages", 0, "output_size"), "8", 1, "output_size"),
    (("stages", 0, "bwd_time"), True, 1, "bwd_time"),
    (("loss", "bwd_time"), float("nan"), None, "loss.bwd_time"),
    (("format",), "optmem.chain/2", None, "format"),
    (("format",), _DELETE, None, "format"),
    (("stages",), [], None, "stages"),
    (("stages",), {"a": 1}, None, "stages"),
    (("stages", 1), [1, 2], 2, None),
]


@pytest.mark.parametrize(("path", "value", "stage", "field"), MALFORMED,
                         ids=[f"{'.'.join(map(str, m[0]))}={m[1]!r}"[:40] for m in MALFORMED])
def test_malformed_chain_names_file_stage_field(tmp_path: Path, path, value, stage, field) -> None:
    data = _mutate(path, value)
    file = write(tmp_path, json.dumps(data))  # NaN/Infinity written as JSON literals
    with pytest.raises(ChainError) as info:
        Chain.load(file)
    err = info.value
    message = str(err)
    assert isinstance(err, OptmemInputError)
    assert str(file) in message and err.source == str(file)
    assert "\n" not in message
    if stage is not None:
        assert f"stage {stage}" in message and err.stage == stage
    if field is not None:
        assert f"'{field}'" in message and err.field == field


def test_not_json(tmp_path: Path) -> None:
    file = write(tmp_path, '{"format": "optmem.chain/1", "stages": [')
    with pytest.raises(ChainError, match="not valid JSON") as info:
        Chain.load(file)
    assert str(file) in str(info.value) and "line 1" in str(info.value)


def test_not_an_object_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ChainError, match="expected a JSON object"):
        Chain.load(write(tmp_path, "[1, 2]"))
    missing = tmp_path / "nope.json"
    with pytest.raises(ChainError, match="cannot read") as info:
        Chain.load(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(ChainError, match="no chain file or bundled dataset"):
        resolve_chain("no-such-dataset")


def test_constructor_validates_lengths() -> None:
    with pytest.raises(ChainError, match="one per stage"):
        Chain(fwd_time=(1.0, 2.0), bwd_time=(1.0,), output_size=(1, 1), saved_size=(1, 1),
              fwd_overhead=(0, 0), bwd_overhead=(0, 0), input_size=1)
    with pytest.raises(ChainError, match="at least one stage"):
        Chain.from_lists([], [], [], [], input_size=1)


# ------------------------------------------------------------------ discretisation
def test_discretisation_contract() -> None:
    chain = Chain.from_lists([1.0], [2.0], [1001], [1500], input_size=10,
                             fwd_overhead=[99], bwd_overhead=[100], loss_bwd_overhead=1)
    d = discretize(chain, 10_050, slots=100)
    assert d.unit == 100  # max(1, M // S)
    assert d.memory_limit == 100  # M // unit
    assert d.chain.output_size == (11,) and d.chain.saved_size == (15,)  # ceil
    assert d.chain.fwd_overhead == (1,) and d.chain.bwd_overhead == (1,)
    assert d.chain.input_size == 1 and d.chain.loss_bwd_overhead == 1
    assert d.chain.fwd_time == chain.fwd_time  # times are not discretised


@pytest.mark.parametrize("memory", [0, 1, 57, 500])
def test_small_limits_are_solved_on_their_own_integers(memory: int) -> None:
    chain = random_chain(4, seed=1)
    d = discretize(chain, memory, slots=500)
    assert d.unit == 1 and d.memory_limit == memory and d.chain is chain


def test_discretisation_rejects_bad_input() -> None:
    chain = random_chain(2, seed=0)
    with pytest.raises(OptmemInputError, match="slots"):
        discretize(chain, 10, slots=0)
    with pytest.raises(OptmemInputError, match="memory"):
        CheckpointProblem(chain, -1)
    with pytest.raises(OptmemInputError, match="memory"):
        CheckpointProblem(chain, 3.5)  # type: ignore[arg-type]


def test_results_report_the_unit_and_rotor_keeps_exactly_s_slots() -> None:
    chain = resnet_like_chain(12)
    memory = chain.store_all_peak() // 2
    options = SolveOptions(slots=100)
    unit = memory // 100
    paper = solve(CheckpointProblem(chain, memory), "dp", options=options)
    assert (paper.unit, paper.memory_limit) == (unit, memory // unit)
    rotor = solve(CheckpointProblem(chain, memory), "dp:rotor", options=options)
    assert (rotor.unit, rotor.memory_limit) == (unit, 100)
    # just under 2S: unit 1, the reference keeps S slots and wastes the rest
    small = random_chain(4, seed=2, max_size=60)
    limit = 199
    assert solve(CheckpointProblem(small, limit), "dp",
                 options=options).memory_limit == 199
    assert solve(CheckpointProblem(small, limit), "dp:rotor",
                 options=options).memory_limit == 100


@pytest.mark.parametrize("seed", range(60))
def test_store_all_peak_closed_form_matches_the_simulator(seed: int) -> None:
    """Chain.store_all_peak (closed form, no simulator import) equals the replayed peak."""
    from optmem.simulate import simulate_checkpoint
    from optmem.solvers.checkpoint_baselines import store_all_plan

    chain = random_chain(1 + seed % 12, seed=seed, overheads=seed % 3 != 0)
    simulated = simulate_checkpoint(chain, store_all_plan(chain.length)).peak_memory
    assert chain.store_all_peak() == simulated


@pytest.mark.parametrize("name", [d.name for d in list_datasets()])
def test_store_all_peak_closed_form_on_bundled_chains(name: str) -> None:
    from optmem.simulate import simulate_checkpoint
    from optmem.solvers.checkpoint_baselines import store_all_plan

    chain = load_dataset(name)
    simulated = simulate_checkpoint(chain, store_all_plan(chain.length)).peak_memory
    assert chain.store_all_peak() == simulated


def test_scaled_keeps_names_units_and_unknown_fields() -> None:
    data = valid_dict()
    data["stages"][0]["kind"] = "conv"
    data["origin"] = "profiler"
    chain = Chain.from_dict(data)
    big = chain.scaled(time=2.0, memory=3)
    assert big.fwd_time == (3.0, 1.0) and big.output_size == (24, 6)
    assert big.stage_names == chain.stage_names and big.memory_unit == chain.memory_unit
    assert big.extra == {"origin": "profiler"}
    assert big.stage_extra[0] == {"kind": "conv"} and big.stage_extra[1] == {}
    assert big.to_dict()["stages"][0]["kind"] == "conv"
