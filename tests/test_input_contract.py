"""One input contract (issue 12): memory limits, bandwidths and option names, Python and CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

import optmem
from optmem import problems
from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError
from optmem.problems import (
    CheckpointProblem,
    MinPeakProblem,
    OffloadProblem,
    PipelineProblem,
    RematOffloadProblem,
)
from optmem.result import SolveOptions, Status
from optmem.solvers.facade import compare, solve
from optmem.sweep import CheckpointFactory, sweep
from optmem.units import chain_rate, memory_size, parse_size, rate_per_second

CHAIN = random_chain(4, seed=1).scaled(memory=2**20)
GIB2 = 2 * 2**30


def every_problem(memory: object) -> list[object]:
    """Each problem class built with the memory limit ``memory``."""
    return [CheckpointProblem(CHAIN, memory), OffloadProblem(CHAIN, memory, "12GB/s"),
            RematOffloadProblem(CHAIN, memory, "12GB/s"),
            PipelineProblem(CHAIN, 2, memory), MinPeakProblem(CHAIN, memory_limit=memory)]


def limit_of(problem: object) -> int:
    return getattr(problem, "memory_per_gpu", getattr(problem, "memory_limit", None))


@pytest.mark.parametrize("memory", [GIB2, np.int64(GIB2), np.uint32(2**31), float(GIB2),
                                    np.float64(GIB2), "2GiB", "2 GiB", "2147483648",
                                    "2.147483648e9", "0.001953125TiB"])
def test_every_problem_accepts_every_memory_form(memory: object) -> None:
    for problem in every_problem(memory):
        assert limit_of(problem) == GIB2
        assert type(limit_of(problem)) is int


def test_decimal_and_fractional_units() -> None:
    assert memory_size("512MB") == 512 * 10**6
    assert memory_size("1.5GiB") == 3 * 2**29
    assert memory_size(2e9) == 2 * 10**9
    assert memory_size("1.1GB") == 1_100_000_000  # exact decimal, not float rounding


@pytest.mark.parametrize("bad", [True, np.bool_(False), -1, "-5", math.nan, math.inf,
                                 "nan", "inf", 2.7, "2.7", "0.3KiB", "lots", "12GB/s", None,
                                 [1], 2**70, "1e400"])
def test_every_problem_rejects_bad_memory_naming_the_field(bad: object) -> None:
    with pytest.raises(OptmemInputError, match="field 'memory_limit'"):
        CheckpointProblem(CHAIN, bad)
    for make in (lambda: OffloadProblem(CHAIN, bad, "12GB/s"),
                 lambda: RematOffloadProblem(CHAIN, bad, "12GB/s"),
                 lambda: MinPeakProblem(CHAIN, memory_limit=bad) if bad is not None else
                 MinPeakProblem(CHAIN, memory_limit=[])):
        with pytest.raises(OptmemInputError, match="memory_limit"):
            make()
    with pytest.raises(OptmemInputError, match="field 'memory_per_gpu'"):
        PipelineProblem(CHAIN, 2, bad)


def test_parse_size_no_longer_truncates_fractions() -> None:
    with pytest.raises(OptmemInputError, match="whole number of bytes"):
        parse_size("2.7")


# ------------------------------------------------------------------ bandwidth
@pytest.mark.parametrize("bandwidth", [12e9, np.float64(12e9), 12_000_000_000, "12GB/s",
                                       "12000MB/s", "12e6B/ms", "12000000000", " 12 GB / s "])
def test_one_bandwidth_convention(bandwidth: object) -> None:
    """A number is bytes per second, a string a rate; both become chain units (ms here)."""
    for problem in (OffloadProblem(CHAIN, GIB2, bandwidth),
                    RematOffloadProblem(CHAIN, GIB2, bandwidth),
                    PipelineProblem(CHAIN, 2, GIB2, bandwidth)):
        assert problem.bandwidth == pytest.approx(12e9)
        assert problem.chain_bandwidth == pytest.approx(12e6)  # bytes per ms


def test_chain_units_are_a_named_alternative() -> None:
    p = OffloadProblem(CHAIN, GIB2, chain_bandwidth=12e6)
    assert p == OffloadProblem(CHAIN, GIB2, "12GB/s")
    assert PipelineProblem(CHAIN, 2, GIB2).chain_bandwidth == math.inf  # default: free
    assert PipelineProblem(CHAIN, 2, GIB2, "inf").chain_bandwidth == math.inf
    with pytest.raises(OptmemInputError, match="disagree"):
        OffloadProblem(CHAIN, GIB2, 1e9, chain_bandwidth=12e6)
    cycles = dataclasses.replace(Chain.from_lists([1], [1], [4], [4], input_size=1),
                                 time_unit="cycles")
    with pytest.raises(OptmemInputError, match="chain_bandwidth"):
        OffloadProblem(cycles, 16, "12GB/s")
    unitless = OffloadProblem(cycles, 16, chain_bandwidth=2.0)
    assert unitless.bandwidth is None and unitless.chain_bandwidth == 2.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "12GB", "fast", "5/h", None])
def test_bad_bandwidths_name_the_field(bad: object) -> None:
    with pytest.raises(OptmemInputError, match="bandwidth"):
        OffloadProblem(CHAIN, GIB2, bad)
    assert rate_per_second("inf", allow_inf=True) == math.inf
    assert chain_rate(0, "cycles") == 0.0


def test_cli_bandwidth_means_what_python_means(tmp_path, capsys) -> None:
    """``--bandwidth 12GB/s`` and a bare number of bytes per second give the same solve."""
    path = tmp_path / "c.json"
    CHAIN.save(path)
    outs = []
    for text in ("12GB/s", "12000000000"):
        assert main(["solve", "offload", str(path), "--memory", "64MiB", "--bandwidth", text,
                     "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    python = solve(OffloadProblem(CHAIN, "64MiB", 12e9))
    assert outs[0]["objective"] == outs[1]["objective"] == python.objective
    assert outs[0]["report"]["bandwidth"] == pytest.approx(12e6)
    assert main(["solve", "offload", str(path), "--memory", "64MiB", "--bandwidth",
                 "12GB"]) == 2
    assert "bandwidth" in capsys.readouterr().err


# ------------------------------------------------------------------ names and entry points
def test_every_problem_importable_from_optmem_and_problems() -> None:
    for name in ("CheckpointProblem", "OffloadProblem", "RematOffloadProblem",
                 "PipelineProblem", "MinPeakProblem"):
        assert getattr(optmem, name) is getattr(problems, name)
        assert name in optmem.__all__ and name in problems.__all__


def test_unknown_keyword_options_raise_naming_the_closest() -> None:
    problem = CheckpointProblem(CHAIN, "64MiB")
    with pytest.raises(OptmemInputError, match="did you mean 'time_limit_s'"):
        SolveOptions(time_limt_s=5)
    with pytest.raises(OptmemInputError, match="did you mean 'time_limit_s'"):
        SolveOptions().with_(time_limt_s=5)
    with pytest.raises(OptmemInputError, match="did you mean 'time_limit_s'"):
        solve(problem, "dp", time_limt_s=5)
    with pytest.raises(OptmemInputError, match="did you mean 'node_limit'"):
        compare(problem, ["dp"], node_limt=5)
    with pytest.raises(OptmemInputError, match="did you mean 'seed'"):
        sweep(CheckpointFactory(CHAIN), ["64MiB"], ["dp"], sed=1)
    with pytest.raises(OptmemInputError, match="did you mean 'sweeps'"):
        solve(problem, "ilp", options=SolveOptions(extra={"swepes": 2}))
    with pytest.raises(OptmemInputError, match="did you mean 'sweeps'"):
        compare(problem, ["dp", "ilp"], options=SolveOptions(extra={"sweep": 2}))
    # a key some method of the problem reads is fine for all of them (shared options)
    assert solve(problem, "dp", options=SolveOptions(extra={"sweeps": 2})).status.has_plan
    assert solve(problem, "dp", slots=100).status.has_plan


def test_torch_bridge_rejects_a_misspelt_option() -> None:
    pytest.importorskip("torch", reason="the torch bridge needs torch (optmem[torch])")
    from optmem.pytorch.api import solve_chain

    with pytest.raises(OptmemInputError, match="did you mean 'time_limit_s'"):
        solve_chain(CHAIN, "64MiB", time_limt_s=5)
    assert solve_chain(CHAIN, np.int64(64 * 2**20)).status is Status.OPTIMAL
    assert solve_chain(CHAIN, 64.0 * 2**20).memory_limit == solve_chain(CHAIN, "64MiB").memory_limit


def test_entry_points_take_every_memory_form() -> None:
    for memory in ("64MiB", 64.0 * 2**20, np.int64(64 * 2**20)):
        assert solve(CheckpointProblem(CHAIN, memory)).status is Status.OPTIMAL
        assert compare(CheckpointProblem(CHAIN, memory), ["dp"])[0].status is Status.OPTIMAL
    result = sweep(CheckpointFactory(CHAIN), ["64MiB", 64.0 * 2**20, np.int64(2**26)], ["dp"])
    assert result.limits == (64 * 2**20,)
    with pytest.raises(OptmemInputError, match="limits"):
        sweep(CheckpointFactory(CHAIN), [2.5], ["dp"])


class Recording(dict):
    """An ``extra`` dict that records every key a method looks up."""

    seen: set[str]

    def __init__(self) -> None:
        super().__init__()
        self.seen = set()

    def get(self, key: str, default: object = None) -> object:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> object:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)


def tiny_problems() -> dict[str, object]:
    pipe = Chain.from_lists([1, 2, 1], [1, 2, 1], [1, 1, 1], [1, 1, 1], input_size=1)
    small = random_chain(2, seed=0)
    return {"checkpoint": CheckpointProblem(small, 48),
            "offload": OffloadProblem(small, 46, chain_bandwidth=1.0),
            "remat-offload": RematOffloadProblem(small, 46, chain_bandwidth=1.0),
            "pipeline": PipelineProblem(pipe, 2, 10**6),
            "min-peak": MinPeakProblem(small)}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_method_declares_the_extra_keys_it_reads() -> None:
    """Every key a method looks up is declared by ``register(..., extra=...)``."""
    from optmem.solvers.facade import methods

    read: set[str] = set()
    for name, problem in tiny_problems().items():
        for method, info in methods(name).items():
            extra = Recording()
            result = solve(problem, method, options=SolveOptions(extra=extra))
            assert result.status is not Status.ERROR, (name, method, result.report)
            assert extra.seen <= set(info.extra), (name, method, extra.seen)
            read |= extra.seen
    assert {"sweeps", "prefetch", "grid", "autocapper_values", "delta_kappa"} <= read


def test_problems_take_a_percentage_of_store_all_as_the_cli_does():
    from optmem.datasets.synthetic import random_chain
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.problems.offload import OffloadProblem
    from optmem.problems.remat_offload import RematOffloadProblem

    chain = random_chain(6, seed=1)
    peak = chain.store_all_peak()
    assert CheckpointProblem(chain, "60%").memory_limit == peak * 60 // 100
    assert OffloadProblem(chain, "50%", chain_bandwidth=1.0).memory_limit == peak // 2
    assert RematOffloadProblem(chain, "100%", chain_bandwidth=1.0).memory_limit == peak
    with pytest.raises(OptmemInputError, match="percentage of the store-all peak"):
        CheckpointProblem(chain, "0%")


BOOLEANS = [True, False, np.bool_(True), np.bool_(False)]


@pytest.mark.parametrize(("problem", "method", "key"), [
    ("checkpoint", "dp", "segment_cost"), ("checkpoint", "ilp", "sweeps"),
    ("remat-offload", "dp", "grid"), ("remat-offload", "dp", "backlog_grid"),
    ("remat-offload", "delta", "delta_trigger"),
    ("remat-offload", "autocapper", "autocapper_values")])
@pytest.mark.parametrize("value", BOOLEANS, ids=repr)
def test_a_boolean_is_not_a_number_option(problem: str, method: str, key: str,
                                          value: object) -> None:
    """``True`` / ``False`` (and numpy's booleans) are refused by every numeric ``extra``
    reader, naming the key (``float(True)`` is 1.0: ``segment_cost=true`` was a cost of 1)."""
    with pytest.raises(OptmemInputError) as err:
        solve(tiny_problems()[problem], method, options=SolveOptions(extra={key: value}))
    assert err.value.field == key


@pytest.mark.parametrize("value", ["true", "false"])
def test_cli_refuses_a_boolean_segment_cost(capsys: pytest.CaptureFixture[str],
                                            value: str) -> None:
    code = main(["solve", "checkpoint", "resnet18-b64-224", "--memory", "60%", "--method",
                 "dp", "--option", f"segment_cost={value}"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "segment_cost" in err
