"""``compare`` with a limit runs each problem's exact model on chains of any length (stop 73).

Issue 15, item 5: ``compare`` shows the DP's value against a proven bound for every problem.
Without a limit the exact models run up to a chain length (``compare_as``), so on the
bundled profiles ``compare remat-offload`` and ``compare pipeline`` had no proven bound.
With a time limit or a work budget, the method each problem declares ``compare_limited``
(checkpoint ``ilp``, offload ``cpsat``, remat-offload ``ilp``, pipeline ``chunks``) runs
whatever the length. Runs here use deterministic work budgets, never wall-clock limits.
"""

from __future__ import annotations

import json
import math

import pytest

from optmem.cli import dp_summary, main
from optmem.datasets import load_dataset
from optmem.datasets.synthetic import random_chain, random_pipeline_chain
from optmem.problems.checkpoint import CheckpointProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.pipeline import PipelineProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers.facade import compare, default_compare_methods, methods

LIMITED = {"checkpoint": "ilp", "offload": "cpsat", "remat-offload": "ilp", "pipeline": "chunks"}


# since stop 74 (time limits hold on long chains): remat-offload 60 (was 24), pipeline 100
LONGEST = {"checkpoint": 100, "offload": 100, "remat-offload": 60, "pipeline": 100}


def long_problems(name: str) -> list[object]:
    """One problem per kind on the bundled chain ``name``."""
    chain = load_dataset(name)
    return [CheckpointProblem(chain, "40%"), OffloadProblem(chain, "40%", bandwidth=12e9),
            RematOffloadProblem(chain, "40%", bandwidth=12e9),
            PipelineProblem(chain, 4, 3 * 2**30, bandwidth=12e9)]


# L = 39 is past checkpoint ilp's 20 and offload cpsat's 24; L = 22 past 6 and 8
CASES = [p for p in long_problems("resnet101-b32-224") if p.name in ("checkpoint", "offload")] \
    + [p for p in long_problems("resnet50-b32-224") if p.name in ("remat-offload", "pipeline")]


@pytest.mark.parametrize("problem", CASES, ids=lambda p: p.name)
def test_a_limit_adds_the_exact_model_past_its_length_cap(problem) -> None:
    name = LIMITED[problem.name]
    declared = {m.name: m.compare_limited for m in methods(problem.name).values()
                if m.compare_limited}
    assert declared == {name: LONGEST[problem.name]}
    assert name not in default_compare_methods(problem)
    assert name not in default_compare_methods(problem, SolveOptions())
    # a node limit bounds the ILP's branching only, not the whole solve
    assert name not in default_compare_methods(problem, SolveOptions(node_limit=10))
    for options in (SolveOptions(time_limit_s=30.0), SolveOptions(work_budget=5.0)):
        labels = default_compare_methods(problem, options)
        assert labels == [*default_compare_methods(problem), name]


@pytest.mark.parametrize("problem", long_problems("resnet1001-b8-224"), ids=lambda p: p.name)
def test_past_its_own_length_a_limit_adds_nothing(problem) -> None:
    """Not on the longest chains (L = 339): before stop 74 the limited methods did not keep
    a 10 s limit there (offload cpsat 270 s, remat-offload ilp out of memory); they do now,
    but their builds stopped at the deadline leave no bound above the DPs' plans."""
    assert problem.chain.length > max(LONGEST.values())
    assert default_compare_methods(problem, SolveOptions(time_limit_s=10.0)) == \
        default_compare_methods(problem)


def test_within_the_cap_the_label_is_not_repeated() -> None:
    problem = CheckpointProblem(random_chain(8, seed=1), "50%")
    plain = default_compare_methods(problem)
    assert "ilp" in plain
    assert default_compare_methods(problem, SolveOptions(time_limit_s=10.0)) == plain


def test_compare_remat_offload_reports_a_proven_bound_past_six_stages() -> None:
    problem = RematOffloadProblem(random_chain(7, seed=3), "70%", chain_bandwidth=1.0)
    options = SolveOptions(work_budget=1.0)
    assert "ilp" not in default_compare_methods(problem)
    results = {r.method + (f":{r.variant}" if r.variant else ""): r
               for r in compare(problem, options=options)}
    exact = results["ilp"]
    assert exact.status.has_plan and math.isfinite(exact.bound)
    replay = verify_plan(problem, exact.to_json())  # the independent simulator
    assert replay["objective"] == pytest.approx(exact.objective)
    assert replay["peak_memory"] <= replay["memory_limit"]
    summary = dp_summary(list(results.values()))
    assert summary["bound_method"] == "ilp" and summary["bound"] == exact.bound
    assert summary["dp"] is not None and summary["bound"] <= summary["dp"] + 1e-9
    if exact.status is Status.OPTIMAL:
        assert summary["optimum"] == exact.objective


def test_compare_pipeline_runs_chunks_and_proves_the_optimum() -> None:
    chain = random_pipeline_chain(10, seed=2)
    problem = PipelineProblem(chain, 3, 8 * sum(chain.weight_size))
    results = compare(problem, options=SolveOptions(work_budget=5.0))
    by = {r.method: r for r in results}
    assert "chunks" in by and "chunks" not in default_compare_methods(problem)
    summary = dp_summary(results)
    assert summary["bound_method"] == "chunks"
    assert by["chunks"].status is Status.OPTIMAL
    assert summary["optimum"] == by["chunks"].objective <= by["madpipe"].objective
    assert summary["dp"] == by["contiguous"].objective > summary["optimum"]
    assert summary["gap"] == pytest.approx((summary["dp"] - summary["bound"]) / summary["dp"])


def test_cli_compare_with_a_work_budget_names_the_exact_model(capsys, tmp_path) -> None:
    path = tmp_path / "c.json"
    random_chain(7, seed=3).save(path)
    code = main(["compare", "remat-offload", str(path), "--memory", "70%",
                 "--chain-bandwidth", "1", "--work-budget", "1", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in data["results"]][-1] == "ilp"
    assert data["summary"]["bound_method"] == "ilp"
    # without a limit, the table's hint says how to get the bound: a limit adds ilp here
    code = main(["compare", "remat-offload", str(path), "--memory", "70%",
                 "--chain-bandwidth", "1"])
    assert code == 0
    assert "or give --time-limit (adds ilp)" in capsys.readouterr().out
    # named methods: a limit would add nothing, so the hint does not offer it (stop 74)
    code = main(["compare", "remat-offload", str(path), "--memory", "70%",
                 "--chain-bandwidth", "1", "--methods", "dp"])
    assert code == 0
    out = capsys.readouterr().out
    assert "name them with --methods)" in out and "--time-limit" not in out


def test_the_hint_offers_a_limit_only_where_it_adds_an_exact_model() -> None:
    """Past every cap (L = 339) and for min-peak, which declares no limited method, a
    limit adds nothing; on a 70-stage chain it adds checkpoint ilp, not remat-offload ilp
    (cap 60)."""
    from optmem.cli import format_summary
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.problems.remat_offload import RematOffloadProblem
    from optmem.solvers.facade import limited_compare_methods

    long = random_chain(339, seed=1)
    assert limited_compare_methods(RematOffloadProblem(long, long.store_all_peak(),
                                                       chain_bandwidth=1.0)) == []
    assert limited_compare_methods(CheckpointProblem(long, long.store_all_peak())) == []
    mid = random_chain(70, seed=1)
    assert limited_compare_methods(CheckpointProblem(mid, mid.store_all_peak())) == ["ilp"]
    # a limit given already: nothing more to offer
    assert limited_compare_methods(CheckpointProblem(mid, mid.store_all_peak()),
                                   SolveOptions(time_limit_s=5.0)) == []
    assert limited_compare_methods(RematOffloadProblem(mid, mid.store_all_peak(),
                                                       chain_bandwidth=1.0)) == []
    assert "--time-limit" not in format_summary([])
