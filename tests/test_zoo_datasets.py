"""Bundled zoo chain files: they load, validate, summarise and solve; the synthetic pipelines."""

from __future__ import annotations

import json

import pytest

from optmem.chain import Chain
from optmem.datasets import dataset_path, list_datasets, load_dataset, resolve_chain
from optmem.datasets.build import SETTINGS, dataset_name
from optmem.datasets.summary import SUMMARY_KEYS, compute_summary, dataset_summary
from optmem.datasets.synthetic import random_pipeline_chain
from optmem.plan import parse_plan
from optmem.problems.checkpoint import CheckpointProblem
from optmem.result import SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers.facade import solve

ZOO_FILES = [dataset_name(m, b, s) for m, b, s, _ in SETTINGS]
# The persistent DP is O(L^3) Python-level work: 10-25 s per solve for ResNet-1001 (L = 339).
SLOW_DP = {n for n in ZOO_FILES if n.startswith("resnet1001")}


def test_every_setting_is_bundled_and_data_stays_small() -> None:
    names = {d.name for d in list_datasets()}
    assert set(ZOO_FILES) <= names
    total = sum(d.path.stat().st_size for d in list_datasets())
    assert total < 3 * 2**20


@pytest.mark.parametrize("name", ZOO_FILES)
def test_bundled_profile_loads_validates_and_records_provenance(name: str) -> None:
    chain = resolve_chain(name)
    assert chain.name == name
    data = json.loads(list(d for d in list_datasets() if d.name == name)[0].path.read_text())
    assert data["description"]
    prov = chain.extra["provenance"]
    assert prov["times"]["method"] == "roofline estimate"
    assert prov["times"]["device"]["name"] == "V100"
    assert prov["flops"] == "torch.utils.flop_counter.FlopCounterMode"
    assert chain.extra["parameters"] == sum(s["params"] for s in chain.stage_extra)
    assert chain.extra["model"]["batch"] >= 1
    assert min(chain.fwd_time) >= 0 and sum(chain.bwd_time) > sum(chain.fwd_time)
    assert all(s >= a for s, a in zip(chain.saved_size, chain.output_size, strict=True))
    assert sum(chain.weight_size) == 4 * chain.extra["parameters"]  # float32


@pytest.mark.parametrize("name", [n for n in ZOO_FILES if n not in SLOW_DP])
def test_bundled_profile_summary_matches_recomputation(name: str) -> None:
    stored = dataset_summary(name)
    fresh = compute_summary(load_dataset(name))
    assert {k: stored[k] for k in SUMMARY_KEYS} == fresh
    assert fresh["min_feasible"] < fresh["store_all"]


@pytest.mark.parametrize("name", [n for n in ZOO_FILES if n not in SLOW_DP] +
                         ["resnet1001-w64-b1-224"])
def test_bundled_profile_solves_with_the_dp_at_a_mid_range_limit(name: str) -> None:
    chain = load_dataset(name)
    summary = dataset_summary(name)
    limit = (summary["min_feasible"] + summary["store_all"]) // 2
    options = SolveOptions(slots=40 if name in SLOW_DP else 500)
    result = solve(CheckpointProblem(chain, limit), "dp", options=options)
    assert result.status is Status.OPTIMAL
    # the simulator accepts the plan on the discretised chain, within the limit
    unit = result.unit
    sim = simulate_checkpoint(chain.quantize(unit), parse_plan(result.plan))
    assert sim.peak_memory <= limit // unit
    assert sim.makespan == pytest.approx(result.objective)
    assert chain.total_compute_time() <= result.objective
    # a mid-range limit costs something, but far less than recomputing everything
    worst = solve(CheckpointProblem(chain, limit), "recompute_all", options=options)
    if worst.status is not Status.INFEASIBLE:
        assert result.objective <= worst.objective


@pytest.mark.parametrize("name", sorted(SLOW_DP - {"resnet1001-w64-b1-224"}))
def test_resnet1001_profiles_run_chen_sqrt_n_at_a_mid_range_limit(name: str) -> None:
    chain = load_dataset(name)
    summary = dataset_summary(name)
    limit = (summary["min_feasible"] + summary["store_all"]) // 2
    result = solve(CheckpointProblem(chain, limit), "chen")
    assert result.status is Status.FEASIBLE and result.peak_memory <= result.memory_limit


def test_listing_zoo_files_reads_their_precomputed_summary(monkeypatch) -> None:
    """Listing is fast because zoo files carry their summary: no DP runs for them.

    (Deterministic stand-in for a timing: the expensive step is forbidden, not timed.)
    """
    import optmem.solvers.checkpoint_dp as dp

    def forbidden(*args: object, **kwargs: object) -> int:
        raise AssertionError("a zoo file was summarised by running the DP")

    dataset_summary.cache_clear()
    monkeypatch.setattr(dp, "min_memory_persistent", forbidden)
    zoo = [d.name for d in list_datasets() if "summary" in json.loads(
        dataset_path(d.name).read_text())]
    assert len(zoo) >= 25
    rows = [dataset_summary(name) for name in zoo]
    assert all(r["stages"] > 0 and r["store_all"] > 0 for r in rows)
    dataset_summary.cache_clear()


def test_resnet101_batch1_store_all_matches_the_rotor_report() -> None:
    # rotor RR section 7.2: PyTorch peak 2.83 GiB for ResNet-101 at 1000x1000, batch 1
    # (device memory, so with the weights and their gradients).
    chain = load_dataset("resnet101-b1-1000")
    peak = dataset_summary("resnet101-b1-1000")["store_all"] + 2 * sum(chain.weight_size)
    assert abs(peak / 2**30 - 2.83) < 0.15 * 2.83
    # and the batch-8 store-all run does not fit the 15.75 GB V100 (the paper's "OOM")
    assert dataset_summary("resnet101-b8-1000")["store_all"] > 15.75e9


def test_resnet1001_w64_matches_the_rotor_report_estimate() -> None:
    # rotor RR section 7.2: PyTorch at batch 8 would need 225 GiB and run at 1.1 img/s
    # (1.18 in the thesis); sequential needs >= 6 segments at batch 1 on the 15.75 GB V100.
    s = dataset_summary("resnet1001-w64-b8-224")
    assert abs(s["store_all"] / 2**30 - 225) < 0.05 * 225
    assert abs(8 / s["compute_time"] * 1e3 - 1.1) < 0.15 * 1.1
    assert s["stages"] == 339


def test_optmem_solve_cli_on_a_bundled_zoo_chain(capsys: pytest.CaptureFixture) -> None:
    from optmem.cli import main

    code = main(["solve", "checkpoint", "resnet101-b8-1000", "--memory", "8GiB", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "optimal"


def test_build_is_deterministic(tmp_path) -> None:
    pytest.importorskip("torch", reason="rebuilding profiles needs torch")
    from optmem.datasets.build import main

    assert main(["unet-b4-512", "vgg16-b64-224", "--out", str(tmp_path)]) == 0
    for name in ("unet-b4-512", "vgg16-b64-224"):
        bundled = [d for d in list_datasets() if d.name == name][0].path.read_text()
        assert (tmp_path / f"{name}.json").read_text() == bundled


# ------------------------------------------------------------------ synthetic pipelines
@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_random_pipeline_chain(kind: str) -> None:
    chain = random_pipeline_chain(12, seed=5, kind=kind)
    assert chain == random_pipeline_chain(12, seed=5, kind=kind)
    assert chain != random_pipeline_chain(12, seed=6, kind=kind)
    assert chain.length == 12 and min(chain.weight_size) > 0
    assert all(b > 0 for b in chain.bwd_time)
    again = Chain.from_dict(chain.to_dict())
    assert again == chain
    if kind == "cnn":  # activations shrink, weights grow with depth
        assert chain.output_size[0] > chain.output_size[-1]
        assert chain.weight_size[0] < chain.weight_size[-1]


def test_random_pipeline_chain_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        random_pipeline_chain(3, kind="rnn")


# ------------------------------------------------------------------ offloading gadget
@pytest.mark.parametrize(("values", "partition"), [([1, 1, 2], True), ([1, 3, 4], True),
                                                   ([2, 2, 2], False), ([1, 1, 4], False)])
def test_offload_partition_gadget(values: list[int], partition: bool) -> None:
    """Thesis Theorem 9: makespan T = 2 under M = 2V iff the values have a partition."""
    pytest.importorskip("highspy", reason="the exact offloading ILP needs HiGHS")
    from optmem.datasets.synthetic import offload_partition_chain
    from optmem.problems.offload import OffloadProblem

    chain, memory, bandwidth, target = offload_partition_chain(values)
    result = solve(OffloadProblem(chain, memory, chain_bandwidth=bandwidth), "ilp")
    assert result.status is Status.OPTIMAL
    if partition:
        assert result.objective == pytest.approx(target)
    else:
        assert result.objective > target + 1e-6


def test_offload_partition_gadget_rejects_odd_sums() -> None:
    from optmem.datasets.synthetic import offload_partition_chain

    with pytest.raises(ValueError, match="even sum"):
        offload_partition_chain([1, 2])
