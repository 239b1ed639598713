"""The Python API validates what the CLI validates: one OptmemInputError, before any work.

Each case here escaped as a TypeError, ValueError, AttributeError or OverflowError from inside
a solver, or was silently misread (a truthy string taken for ``True``, 0 threads, a seed the
engines cannot take), before the checks of ``SolveOptions``, the facade, the problem
constructors and the method options (``docs/fuzzing.md``, "The Python API").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets import dataset_path, load_dataset
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
from optmem.solvers.facade import compare, export, solve

CHAIN = random_chain(3, seed=1)
MEMORY = CHAIN.store_all_peak()
DATASET = "resnet-like-40"


# ------------------------------------------------------------------ SolveOptions
@pytest.mark.parametrize(("field", "value"), [
    ("slots", 1.5), ("slots", None), ("slots", "10"), ("slots", True), ("slots", 0),
    ("threads", 0), ("threads", -1), ("threads", 1000), ("threads", "2"), ("threads", 2.0),
    ("seed", 2**70), ("seed", 2**31), ("seed", 1.0),
    ("node_limit", 1.5), ("node_limit", math.inf), ("node_limit", -3),
    ("time_limit_s", 10**400), ("deterministic_time", np.bool_(True)),
    ("work_budget", 0), ("work_budget", -1.0), ("work_budget", math.nan),
    ("work_budget", "10"), ("work_budget", True), ("work_budget", 10**400),
    ("warm_start", "no"), ("warm_start", None), ("verbose", "no"),
    ("variant", 3), ("solver", None),
    ("extra", None), ("extra", [1]), ("extra", {1: 2}),
])
def test_solve_options_reject_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(OptmemInputError, match=f"field '{field}'"):
        SolveOptions(**{field: value})


def test_work_budget_takes_positive_numbers_and_inf() -> None:
    """``work_budget`` (stop 53): a number > 0 as a float, ``inf`` (measure only), ``None``."""
    assert SolveOptions(work_budget=np.int64(2)).work_budget == 2.0
    assert SolveOptions(work_budget=math.inf).work_budget == math.inf
    assert SolveOptions().work_budget is None
    res = solve(CheckpointProblem(CHAIN, MEMORY), "dp", work_budget=1.0)
    assert res.report["work_calls"] == 0 and res.report["work_used"] == 0.0


def test_solve_options_normalise_numpy_integers_and_integral_floats() -> None:
    opts = SolveOptions(slots=np.int64(500), threads=np.int32(1), seed=np.uint8(3),
                        node_limit=1e3, time_limit_s=np.int64(5), warm_start=np.bool_(False))
    assert (opts.slots, opts.threads, opts.seed, opts.node_limit) == (500, 1, 3, 1000)
    assert [type(v) for v in (opts.slots, opts.threads, opts.seed, opts.node_limit)] == [int] * 4
    assert opts.time_limit_s == 5.0 and opts.warm_start is False
    assert solve(CheckpointProblem(CHAIN, MEMORY), "dp", options=opts).status is Status.OPTIMAL


def test_cli_threads_and_seed_ranges_are_the_python_ranges(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.json"
    CHAIN.save(path)
    assert main(["solve", "checkpoint", str(path), "--memory", str(MEMORY),
                 "--seed", str(2**31)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["optmem: error: field '--seed': expected a non-negative integer seed "
                   "(0..2147483647), got 2147483648"]


# ------------------------------------------------------------------ the facade
def test_facade_rejects_what_is_not_a_problem_method_or_options(tmp_path: Path) -> None:
    problem = CheckpointProblem(CHAIN, MEMORY)
    for call, field in [
        (lambda: solve(None), "problem"), (lambda: solve("checkpoint"), "problem"),
        (lambda: compare(CHAIN, ["dp"]), "problem"),
        (lambda: solve(problem, None), "method"), (lambda: solve(problem, 3), "method"),
        (lambda: compare(problem, [None]), "method"), (lambda: compare(problem, 5), "methods"),
        (lambda: solve(problem, options={"slots": 3}), "options"),
        (lambda: export(problem, "ilp", None), "output"),
        (lambda: export(problem, "ilp", str(tmp_path / "m.mps"), extra={"sweep": 2}), "sweep"),
    ]:
        with pytest.raises(OptmemInputError, match=f"field '{field}'"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_compare_takes_a_comma_separated_string_as_the_cli() -> None:
    results = compare(CheckpointProblem(CHAIN, MEMORY), "dp, chen")
    assert [r.method for r in results] == ["dp", "chen"]


@pytest.mark.parametrize("empty", [",", " , ", []])
def test_compare_refuses_an_empty_list_of_methods(empty, capsys) -> None:
    """``compare --methods ,`` printed an empty table (summary "no exact model ran (: name
    them with --methods)") and exited 0; ``sweep`` already refused no methods."""
    with pytest.raises(OptmemInputError, match="field 'methods'"):
        compare(CheckpointProblem(CHAIN, MEMORY), empty)
    if isinstance(empty, str):
        assert main(["compare", "checkpoint", DATASET, "-m", "1GiB", "--methods", empty]) == 2
        assert "at least one method" in capsys.readouterr().err


# ------------------------------------------------------------------ the problems
def every_problem(chain: Any) -> list[Any]:
    return [CheckpointProblem(chain, "60%"), OffloadProblem(chain, "60%", "12GB/s"),
            RematOffloadProblem(chain, "60%", "12GB/s"), PipelineProblem(chain, 2, "8GiB"),
            MinPeakProblem(chain)]


def test_problems_take_a_chain_file_or_dataset_name_as_the_cli() -> None:
    expected = every_problem(load_dataset(DATASET))
    path = dataset_path(DATASET)
    for given in (DATASET, str(path), path):
        built = every_problem(given)
        assert built == expected
        assert all(isinstance(p.chain, Chain) for p in built)


@pytest.mark.parametrize("chain", [None, 5, CHAIN.to_dict(), [CHAIN]])
def test_a_chain_that_is_no_chain_is_one_input_error(chain: Any) -> None:
    for make in (lambda: CheckpointProblem(chain, 10), lambda: OffloadProblem(chain, 10, 1e9),
                 lambda: RematOffloadProblem(chain, 10, 1e9),
                 lambda: PipelineProblem(chain, 2, 10), lambda: MinPeakProblem(chain)):
        with pytest.raises(OptmemInputError, match="field 'chain'"):
            make()


def test_a_missing_chain_name_is_one_input_error() -> None:
    with pytest.raises(OptmemInputError, match="no chain file or bundled dataset named"):
        CheckpointProblem("no-such-dataset", 10)


def test_problem_switches_are_booleans_and_counts_integers() -> None:
    with pytest.raises(OptmemInputError, match="field 'buffers'"):
        PipelineProblem(CHAIN, 2, 10**6, buffers="no")
    with pytest.raises(OptmemInputError, match="field 'count_input'"):
        MinPeakProblem(CHAIN, count_input="no")
    p = PipelineProblem(CHAIN, np.int64(2), 10**6, weight_copies=np.int32(3))
    assert (p.n_gpus, p.weight_copies) == (2, 3) and type(p.n_gpus) is int


# ------------------------------------------------------------------ method options
PIPE = Chain.from_lists([1, 2, 1], [1, 2, 1], [1, 1, 1], [1, 1, 1], input_size=1)
SMALL = random_chain(2, seed=0)
MAKERS = {
    "offload": lambda: OffloadProblem(CHAIN, MEMORY, chain_bandwidth=2.0),
    "remat-offload": lambda: RematOffloadProblem(SMALL, 46, chain_bandwidth=1.0),
    "pipeline": lambda: PipelineProblem(PIPE, 2, 10**6),
}
BAD_EXTRA = [
    ("remat-offload", "dp", "grid", None), ("remat-offload", "dp", "grid", "x"),
    ("remat-offload", "dp", "grid", math.nan), ("remat-offload", "dp", "grid", 1.5),
    ("remat-offload", "dp", "backlog_grid", math.inf), ("remat-offload", "ilp", "grid", []),
    ("remat-offload", "cpsat", "backlog_grid", "x"),
    ("remat-offload", "autocapper", "autocapper_values", None),
    ("remat-offload", "autocapper", "autocapper_values", 0),
    ("remat-offload", "delta", "delta_trigger", [1]),
    ("remat-offload", "delta", "delta_kappa", math.nan),
    ("remat-offload", "delta", "delta_eta", -1),
    ("remat-offload", "cpsat", "relaxation", "no"),
    ("offload", "greedy", "prefetch", "x"), ("offload", "dp", "prefetch", None),
    ("pipeline", "madpipe", "madpipe_iterations", [[1]]),
    ("pipeline", "madpipe", "madpipe_iterations", 0),
    ("pipeline", "madpipe", "madpipe_grid", "x"), ("pipeline", "madpipe", "phase2", "glpk"),
    ("pipeline", "ilp", "warm_madpipe", "no"), ("pipeline", "cpsat", "relaxation", "no"),
    ("pipeline", "cpsat", "madpipe_iterations", math.inf),
    # work counts far above any real use ran for ever until stop 52 (now bounded)
    ("pipeline", "madpipe", "madpipe_iterations", 2**70),
    ("pipeline", "cpsat", "madpipe_iterations", 10_001),
    ("pipeline", "chunks", "chunks", 2**70),
    ("remat-offload", "autocapper", "autocapper_values", 2**70),
    ("remat-offload", "cpsat", "autocapper_values", 10_001),
    ("remat-offload", "ilp", "transfers_per_gap", 2**70),
    ("remat-offload", "cpsat", "transfers_per_gap", 101),
    ("remat-offload", "dp", "grid", 2**70),
    ("remat-offload", "dp", "backlog_grid", 2**70),
    ("remat-offload", "cpsat", "lns_windows", 2**70),
    ("remat-offload", "cpsat", "benders_iterations", 2**70),
]


@pytest.mark.parametrize(("problem", "method", "key", "value"), BAD_EXTRA,
                         ids=[f"{p}-{m}-{k}-{v!r}" for p, m, k, v in BAD_EXTRA])
def test_bad_method_options_are_one_input_error(problem: str, method: str, key: str,
                                                value: Any, monkeypatch) -> None:
    import optmem.engines.adapters as engines

    def no_engine(*args: Any, **kwargs: Any) -> Any:  # the check comes before any engine
        raise AssertionError("an engine ran before the options were checked")

    monkeypatch.setattr(engines, "solve_pulp", no_engine)
    monkeypatch.setattr(engines, "solve_cpsat", no_engine)
    with pytest.raises(OptmemInputError, match=f"field '{key}'"):
        solve(MAKERS[problem](), method, extra={key: value}, time_limit_s=2, threads=1)
    # compare too (until stop 51 it made an error row, and the CLI exited 0)
    with pytest.raises(OptmemInputError, match=f"field '{key}'"):
        compare(MAKERS[problem](), [method], extra={key: value}, time_limit_s=2, threads=1)


# ------------------------------------------------------------------ chains
def chain_kwargs(**changes: Any) -> dict[str, Any]:
    base = {"fwd_time": (1,), "bwd_time": (1,), "output_size": (1,), "saved_size": (1,),
            "fwd_overhead": (0,), "bwd_overhead": (0,), "input_size": 1}
    return {**base, **changes}


@pytest.mark.parametrize(("make", "field"), [
    (lambda: Chain.from_lists(None, [1], [1], [1], input_size=1), "fwd_time"),
    (lambda: Chain.from_lists(5, [1], [1], [1], input_size=1), "fwd_time"),
    (lambda: Chain.from_lists([1], "1", [1], [1], input_size=1), "bwd_time"),
    (lambda: Chain(**chain_kwargs(saved_size=None)), "saved_size"),
    (lambda: Chain(**chain_kwargs(time_unit=3)), "time_unit"),
    (lambda: Chain(**chain_kwargs(stage_names=(3,))), "name"),
    (lambda: Chain(**chain_kwargs(extra=[1])), "extra"),
    (lambda: Chain(**chain_kwargs(stage_extra=(5,))), "extra"),
    (lambda: Chain(**chain_kwargs(stage_extra=({}, {}))), "stage_extra"),
    (lambda: Chain.from_rotor(None, None, None, None), "fw"),
])
def test_chain_constructors_name_the_bad_field(make: Any, field: str) -> None:
    with pytest.raises(OptmemInputError, match=f"field '{field}'"):
        make()


def test_chain_constructors_refuse_empty_and_unreadable_input() -> None:
    with pytest.raises(OptmemInputError, match="at least one stage"):
        Chain.from_rotor([], [], [], [])
    for path in (None, 5, "a\0b.json"):
        with pytest.raises(OptmemInputError, match="chain file"):
            Chain.load(path)


def test_chain_takes_numpy_arrays_and_scalars() -> None:
    lists = Chain.from_lists([1.5, 2], [1, 2], [3, 4], [5, 6], input_size=7)
    arrays = Chain.from_lists(np.array([1.5, 2.0], dtype=np.float32), np.array([1, 2]),
                              np.array([3, 4], dtype=np.int32), np.array([5.0, 6.0]),
                              input_size=np.int64(7))
    assert arrays == lists
    assert [type(v) for v in (*arrays.fwd_time, *arrays.output_size, arrays.input_size)] == \
        [float, float, int, int, int]


def test_discretize_checks_its_slots() -> None:
    for slots in (1.5, None, "10", 0):
        with pytest.raises(OptmemInputError, match="field 'slots'"):
            CheckpointProblem(CHAIN, MEMORY).discretize(slots)


# ------------------------------------------------------------------ sweep
def test_sweep_checks_jobs_and_its_arguments_before_any_process_starts(monkeypatch) -> None:
    import optmem.sweep as sweep_module
    from optmem.sweep import CheckpointFactory, sweep

    def no_pool(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a process pool started before the arguments were checked")

    monkeypatch.setattr(sweep_module, "ProcessPoolExecutor", no_pool)
    factory = CheckpointFactory(CHAIN)
    for kwargs, field in [
        ({"jobs": 10_000}, "jobs"), ({"jobs": 0}, "jobs"), ({"jobs": 1.5}, "jobs"),
        ({"progress": "x"}, "progress"), ({"extra": {"sweep": 2}}, "sweep"),
        ({"options": {}}, "options"),
    ]:
        with pytest.raises(OptmemInputError, match=f"field '{field}'"):
            sweep(factory, [MEMORY], ["dp"], **kwargs)
    for args, field in [((None, [MEMORY], ["dp"]), "problem_factory"),
                        ((factory, None, ["dp"]), "limits"),
                        ((lambda m: None, [MEMORY], ["dp"]), "problem")]:
        with pytest.raises(OptmemInputError, match=f"field '{field}'"):
            sweep(*args)


def test_sweep_takes_a_comma_separated_string_of_methods() -> None:
    from optmem.sweep import CheckpointFactory, sweep

    result = sweep(CheckpointFactory(CHAIN), [MEMORY], "dp,chen")
    assert result.methods == ("dp", "chen")
    assert {p.method for p in result.points} == {"dp", "chen"}


def test_available_methods_of_no_problem_is_one_input_error() -> None:
    from optmem.solvers.facade import available_methods

    with pytest.raises(OptmemInputError, match="field 'problem'"):
        available_methods(None)


@pytest.mark.parametrize("kind", ["checkpoint", "remat-offload"])
@pytest.mark.parametrize("method", ["ilp", "cpsat"])
def test_a_huge_sweeps_is_refused_before_the_model_is_built(kind, method):
    # sweeps=10**30 grew the formulation without bound (2.4 GB before it was killed)
    chain = random_chain(4, seed=0)
    problem = (CheckpointProblem(chain, "100%") if kind == "checkpoint" else
               RematOffloadProblem(chain, "100%", chain_bandwidth=1.0))
    for sweeps in (10**30, 10**6):
        with pytest.raises(OptmemInputError, match="compute slots") as info:
            solve(problem, method, options=SolveOptions(extra={"sweeps": sweeps}))
        assert info.value.field == "sweeps"
    assert solve(problem, method, options=SolveOptions(extra={"sweeps": 2})).status in (
        Status.OPTIMAL, Status.FEASIBLE)
