"""Sweeps: Pareto fronts are monotone and match direct solves; exports and plots are written."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets import resolve_chain
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError
from optmem.problems import CheckpointProblem
from optmem.problems.min_peak import MinPeakProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.checkpoint_dp import min_memory_persistent
from optmem.solvers.facade import solve
from optmem.sweep import (
    CheckpointFactory,
    CliFactory,
    Progress,
    SweepPoint,
    checkpoint_start,
    pareto_front,
    parse_memory_range,
    sweep,
)


def need_matplotlib() -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (optmem[plot])")


@pytest.fixture(scope="module")
def chain() -> Chain:
    return random_chain(7, seed=3)


@pytest.fixture(scope="module")
def limits(chain: Chain) -> list[int]:
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    return list(range(low - 2, high + 3))  # every integer: unit 1, no rounding


@pytest.fixture(scope="module")
def result(chain: Chain, limits: list[int]):
    return sweep(CheckpointFactory(chain), limits, ["dp", "chen", "revolve", "store_all"])


def assert_front_monotone(front: list[SweepPoint]) -> None:
    for a, b in zip(front, front[1:], strict=False):
        assert a.memory < b.memory and a.objective > b.objective


def test_fronts_are_monotone_and_match_direct_solves(chain: Chain, limits: list[int],
                                                      result) -> None:
    fronts = result.fronts()
    assert set(fronts) == {"dp", "chen", "revolve", "store_all"}
    for method, front in fronts.items():
        assert front, method
        assert_front_monotone(front)
        for p in front:
            direct = solve(CheckpointProblem(chain, p.memory_limit), method)
            assert direct.objective == p.objective
            assert direct.peak_memory == p.memory <= p.memory_limit
    # the DP is optimal at every limit: non-increasing in the limit, never beaten
    dp = {p.memory_limit: p for p in result.method_points("dp")}
    values = [p.objective for p in dp.values() if p.has_plan]
    assert values == sorted(values, reverse=True)
    for p in result.points:
        if p.has_plan:
            assert dp[p.memory_limit].objective <= p.objective + 1e-9
    # lower envelope: below the smallest feasible memory nothing fits
    assert not dp[limits[0]].has_plan and dp[limits[0]].status == "infeasible"
    summary = result.summary()["dp"]
    assert summary["min_memory"] == min_memory_persistent(chain)
    assert summary["min_feasible_memory"] == min_memory_persistent(chain)
    assert summary["no_recompute"] and summary["store_all_makespan"] == \
        pytest.approx(chain.total_compute_time())
    assert result.summary()["store_all"]["min_memory"] == chain.store_all_peak()
    assert [p.memory for p in result.envelope()][0] == min(
        s["min_memory"] for s in result.summary().values())


def test_parallel_sweep_gives_the_same_points(chain: Chain, limits: list[int], result) -> None:
    some = limits[::4]
    par = sweep(CheckpointFactory(chain), some, ["dp", "chen"], jobs=2)
    for p in par.points:
        same = next(q for q in result.points if (q.method, q.memory_limit) ==
                    (p.method, p.memory_limit))
        assert (p.status, p.objective, p.memory) == (same.status, same.objective, same.memory)


def test_exports_and_plot(tmp_path: Path, result) -> None:
    need_matplotlib()
    result.write_csv(tmp_path / "s.csv")
    result.write_json(tmp_path / "s.json")
    with open(tmp_path / "s.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(result.points)
    assert sum(r["on_front"] == "True" for r in rows) == sum(map(len, result.fronts().values()))
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["format"] == "optmem.sweep/1"
    assert [m for m, _, _ in data["fronts"]["dp"]] == [p.memory for p in result.fronts()["dp"]]
    for name in ("s.png", "s.svg"):
        out = result.plot(tmp_path / name)
        assert out.exists() and out.stat().st_size > 1000
    with pytest.raises(OptmemInputError):
        result.plot(tmp_path / "s.txt")


def test_pareto_front_prefers_proven_points() -> None:
    pts = [SweepPoint("ilp", 10, "feasible", 5.0, 4.0, 8, 0.0, True),
           SweepPoint("ilp", 11, "optimal", 5.0, 5.0, 8, 0.0, True),
           SweepPoint("ilp", 12, "infeasible", None, None, None, 0.0, True),
           SweepPoint("ilp", 13, "optimal", 4.0, 4.0, 9, 0.0, True)]
    front = pareto_front(pts)
    assert [(p.memory, p.status) for p in front] == [(8, "optimal"), (9, "optimal")]


def test_parse_memory_range(chain: Chain) -> None:
    assert parse_memory_range("10:20:3") == [10, 15, 20]
    assert parse_memory_range("1KiB:1KiB:5") == [1024]
    auto = parse_memory_range("auto:4", chain)
    assert auto[0] == min_memory_persistent(chain) and len(auto) == 4
    for bad in ("10:20", "20:10:3", "10:20:0", "a:b:3", "auto:x"):
        with pytest.raises(OptmemInputError):
            parse_memory_range(bad, chain)


def test_failures_become_error_points_and_bad_methods_fail_early(chain: Chain) -> None:
    long = random_chain(12, seed=1)
    r = sweep(CheckpointFactory(long), [200], ["brute", "chen"])
    assert r.method_points("brute")[0].status == Status.ERROR.value
    assert "exponential" in (r.method_points("brute")[0].error or "")
    with pytest.raises(OptmemInputError):
        sweep(CheckpointFactory(chain), [10], ["nope"])
    with pytest.raises(OptmemInputError):
        sweep(CheckpointFactory(chain), [], ["dp"])


def test_progress_bar_and_min_peak_sweep(chain: Chain) -> None:
    stream = io.StringIO()
    factory = CliFactory("min-peak", chain, {"model": "pytorch", "ignore_input": False})
    best = solve(MinPeakProblem(chain), "dp").objective
    limits = [int(best) - 1, int(best), int(best) + 5]
    r = sweep(factory, limits, ["dp", "chen"], progress=Progress(6, stream=stream))
    assert "6/6" in stream.getvalue()
    statuses = [p.status for p in r.method_points("dp")]
    assert statuses == ["infeasible", "optimal", "optimal"]
    assert r.fronts()["dp"][0].memory == best


def test_cli(tmp_path: Path, chain: Chain, capsys: pytest.CaptureFixture[str]) -> None:
    need_matplotlib()
    path = tmp_path / "c.json"
    chain.save(path)
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    code = main(["sweep", "checkpoint", str(path), "--memory", f"{low}:{high}:6",
                 "--methods", "dp,chen", "--jobs", "1", "--csv", str(tmp_path / "s.csv"),
                 "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "dp" in out and "sweep [" in err
    for name in ("s.csv", "s.json", "s.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert main(["sweep", "checkpoint", str(path), "--memory", "1:2:2", "--methods",
                 "nope", "-q"]) == 2
    assert main(["sweep", "checkpoint", str(path), "--memory", "1:2", "-q"]) == 2
    # two outputs on one file: one overwrote the other, exit 0 (a hunt in stop 51)
    same = tmp_path / "same.out"
    capsys.readouterr()
    assert main(["sweep", "checkpoint", str(path), "--memory", f"{low}:{high}:2", "-q",
                 "--json", str(same), "--csv", str(tmp_path / "." / "same.out")]) == 2
    assert "--csv and --json name the same file" in capsys.readouterr().err
    assert not same.exists()


def test_bundled_chain_curve(tmp_path: Path) -> None:
    need_matplotlib()
    chain = resolve_chain("resnet-like-40")
    r = sweep(CheckpointFactory(chain), parse_memory_range("auto:8", chain), ["dp"], jobs=2)
    assert len(r.fronts()["dp"]) >= 5
    assert r.plot(tmp_path / "r.png").stat().st_size > 1000


def test_cli_sweep_takes_option_as_solve_does(tmp_path: Path, chain: Chain,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """CONTRACT section 7: sweep takes the common options of solve; ``--option KEY=VALUE``
    was refused ("unrecognized arguments") although ``sweep(...)`` takes ``extra``."""
    path = tmp_path / "c.json"
    chain.save(path)
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    csv_path = tmp_path / "s.csv"
    code = main(["sweep", "checkpoint", str(path), "--memory", f"{low}:{high}:3", "-q",
                 "--methods", "dp", "--jobs", "1", "--option", "segment_cost=1.5",
                 "--csv", str(csv_path)])
    assert code == 0, capsys.readouterr().err
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    direct = [solve(CheckpointProblem(chain, int(row["memory_limit"])), "dp",
                    extra={"segment_cost": 1.5}) for row in rows]
    assert [row["status"] for row in rows] == [str(r.status) for r in direct]
    assert [float(row["objective"]) for row in rows] == [r.objective for r in direct]
    capsys.readouterr()
    assert main(["sweep", "checkpoint", str(path), "--memory", f"{low}:{high}:2", "-q",
                 "--methods", "dp", "--option", "nope=1"]) == 2


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_bad_value_of_a_read_extra_key_is_an_input_error(chain: Chain, jobs: int,
                                                           capsys) -> None:
    """As ``compare`` (stop 51): a value the method reading the key refuses is bad input,
    not one ``error`` point per limit with exit 0."""
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    with pytest.raises(OptmemInputError, match="segment_cost"):
        sweep(CheckpointFactory(chain), [low, high], ["chen", "dp"], jobs=jobs,
              extra={"segment_cost": -1})
    factory = CliFactory("checkpoint", chain, {})
    r = sweep(factory, [high], ["chen"], extra={"segment_cost": -1})  # chen does not read it
    assert r.method_points("chen")[0].status != Status.ERROR.value


def test_parallel_workers_raise_the_sequential_runs_error(chain: Chain,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Two bad values read by two methods: ``jobs=2`` raises the error ``jobs=1`` raises
    (the first failing task in order), whatever order the workers finish in. Before, it
    raised the first error to arrive: ``--methods ilp,dp --option sweeps=0 --option
    segment_cost=-1 --jobs 2`` named ``sweeps`` in four runs of five and ``segment_cost``
    in one. The workers' finishing order is scripted here (last task first)."""
    from concurrent.futures import wait

    import optmem.sweep as sweep_module

    def last_first(futures):  # every task done, then handed back in reverse task order
        futures = list(futures)
        wait(futures)
        return reversed(futures)

    low, high = min_memory_persistent(chain), chain.store_all_peak()
    bad = {"sweeps": 0, "segment_cost": -1}  # ilp refuses the first, dp the second
    with pytest.raises(OptmemInputError, match="sweeps") as alone:
        sweep(CheckpointFactory(chain), [low, high], ["ilp", "dp"], jobs=1, extra=bad)
    monkeypatch.setattr(sweep_module, "as_completed", last_first)
    with pytest.raises(OptmemInputError, match="sweeps") as parallel:
        sweep(CheckpointFactory(chain), [low, high], ["ilp", "dp"], jobs=2, extra=bad)
    assert str(parallel.value) == str(alone.value)


def test_auto_range_of_a_pipeline_reaches_its_fastest_plan(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """``auto`` ended 5 % above the chain's store-all peak, which a pipeline's limit per GPU
    (weights, several micro-batches' stashes) may never reach: on this chain ``auto:3`` gave
    one limit, below the memory of the fastest plan. It now ends 5 % above that plan's peak."""
    from optmem.problems import PipelineProblem

    chain = Chain.from_lists([1, 2, 1, 3], [2, 3, 1, 2], [2, 3, 1, 2], [3, 4, 2, 5],
                             input_size=2, fwd_overhead=[0, 1, 0, 0],
                             bwd_overhead=[0, 0, 1, 0], weight_size=[5, 5, 5, 5],
                             loss_bwd_time=0.5)
    path = tmp_path / "c.json"
    chain.save(path)
    free = solve(PipelineProblem(chain, n_gpus=2, memory_per_gpu=2**62), "contiguous")
    least = solve(PipelineProblem(chain, n_gpus=2, memory_per_gpu=0), "contiguous")
    assert free.peak_memory > chain.store_all_peak() * 1.05  # the case: store-all is too low
    csv_path = tmp_path / "p.csv"
    code = main(["sweep", "pipeline", str(path), "--gpus", "2", "--memory", "auto:3", "-q",
                 "--methods", "contiguous", "--jobs", "1", "--csv", str(csv_path)])
    assert code == 0, capsys.readouterr().err
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    limits = [int(row["memory_limit"]) for row in rows]
    assert limits[0] == least.min_feasible_memory and len(limits) == 3
    assert limits[-1] == -(-free.peak_memory * 105 // 100)
    assert float(rows[-1]["objective"]) == free.objective


# a chain on which the checkpoint DP's least memory (16 B, where ``auto`` started a strict
# pipeline sweep until stop 54) is above the least limit per GPU (14 B on 2 GPUs)
_STRICT_CHAIN = dict(fwd=[1.0, 2.0, 1.0], bwd=[2.0, 2.0, 1.0], out=[3, 2, 4], saved=[4, 2, 4],
                     fo=[2, 1, 3], bo=[1, 2, 2])


@pytest.mark.parametrize("temporaries", [False, True])
def test_auto_range_of_a_strict_pipeline_starts_where_a_method_finds_a_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], temporaries: bool) -> None:
    """Under ``strict`` no pipeline method reports a least memory, and ``auto`` started at
    the checkpoint DP's, which says nothing of a limit per GPU. It now starts where one of
    the swept methods finds a plan and none finds one a step below (bisection from
    :meth:`PipelineProblem.memory_lower_bound`)."""
    from optmem.problems import PipelineProblem

    spec = _STRICT_CHAIN
    chain = Chain.from_lists(spec["fwd"], spec["bwd"], spec["out"], spec["saved"],
                             input_size=2, fwd_overhead=spec["fo"], bwd_overhead=spec["bo"],
                             loss_bwd_overhead=5)
    path = tmp_path / "t.json"
    chain.save(path)

    def at(limit: int) -> PipelineProblem:
        return PipelineProblem(chain, n_gpus=2, memory_per_gpu=limit, memory_model="strict",
                               temporaries=temporaries)

    csv_path = tmp_path / "p.csv"
    flags = ["--temporaries"] if temporaries else []
    code = main(["sweep", "pipeline", str(path), "--gpus", "2", "--memory-model", "strict",
                 *flags, "--memory", "auto:4", "-q", "--methods", "contiguous",
                 "--jobs", "1", "--csv", str(csv_path)])
    assert code == 0, capsys.readouterr().err
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    start = min(int(row["memory_limit"]) for row in rows)
    assert start >= at(0).memory_lower_bound()
    assert solve(at(start), "contiguous").status.has_plan
    assert not solve(at(start - 1), "contiguous").status.has_plan
    assert start == (19 if temporaries else 14)
    assert checkpoint_start(chain, SolveOptions()) == 16  # where auto started before

