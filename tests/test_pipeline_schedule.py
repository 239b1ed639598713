"""Pipeline plans as per-rank action lists and PyTorch's schedule CSV (no torch needed).

The action list of every plan must be executable: a rank runs its actions in order, each
waiting only for its dependencies (F of the previous stage, B of the next stage) on other
ranks, and the whole schedule completes without deadlock (what PyTorch's lowering of a
compute-only CSV assumes). Every forward and backward of every micro-batch appears once, on
the rank of its stage.
"""

from __future__ import annotations

import csv
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.cli import main
from optmem.errors import OptmemInputError
from optmem.pipeline_plan import PipelinePlan
from optmem.pipeline_schedule import (
    default_microbatches,
    pipeline_ranks,
    rank_programs,
    schedule_csv,
    schedule_rows,
)
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions
from optmem.solvers.facade import solve

ACTION = re.compile(r"^(\d+)([FB])(\d+)$")


def plan_for(costs: list[float], gpus: int, method: str, memory: int = 10**6) -> PipelinePlan:
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [1] * len(costs), [1] * len(costs), input_size=1)
    result = solve(PipelineProblem(chain, gpus, memory), method,
                   options=SolveOptions(time_limit_s=30, threads=1))
    assert result.status.has_plan, result.report
    return PipelinePlan.from_strings(result.plan)


def assert_executable(plan: PipelinePlan, microbatches: int) -> None:
    """Replay the rows with blocking dependencies; every action runs once, no deadlock."""
    rows = schedule_rows(plan, microbatches)
    n_stages = len(plan.stages)
    ranks = pipeline_ranks(plan)
    expected = {(s, k, m) for s in range(n_stages) for k in "FB" for m in range(microbatches)}
    seen = set()
    for r, row in enumerate(rows):
        for cell in row:
            s, kind, m = ACTION.match(cell).groups()  # type: ignore[union-attr]
            key = (int(s), kind, int(m))
            assert key not in seen
            seen.add(key)
            assert ranks[r] == plan.stages[int(s)].gpu  # on the rank of its stage
    assert seen == expected
    done: set[tuple[int, str, int]] = set()
    pos = [0] * len(rows)
    while any(p < len(row) for p, row in zip(pos, rows, strict=True)):
        progress = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                s, kind, m = ACTION.match(row[pos[r]]).groups()  # type: ignore[union-attr]
                s, m = int(s), int(m)
                needs = [(s - 1, "F", m)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [(s, "F", m)] + ([(s + 1, "B", m)] if s < n_stages - 1 else [])
                if not all(n in done for n in needs):
                    break
                done.add((s, kind, m))
                pos[r] += 1
                progress = True
        assert progress, f"deadlock at positions {pos}"


@pytest.mark.parametrize(("costs", "gpus", "method"), [
    ([1, 2, 1], 2, "madpipe"), ([1, 2, 2, 2, 1], 2, "madpipe"), ([1, 2, 1], 2, "cpsat"),
    ([1, 2, 1, 1, 2, 1], 4, "cpsat"), ([3, 1, 4, 1, 5, 9, 2, 6], 3, "contiguous"),
    ([3, 1, 4, 1, 5, 9, 2, 6], 4, "pipedream"), ([1, 1, 1, 1], 2, "equal"),
])
def test_action_lists_are_executable(costs, gpus, method):
    plan = plan_for(costs, gpus, method)
    for microbatches in (1, 3, default_microbatches(plan)):
        assert_executable(plan, microbatches)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(costs=st.lists(st.integers(1, 9), min_size=2, max_size=9), gpus=st.integers(1, 4),
       memory=st.integers(8, 60), method=st.sampled_from(["contiguous", "madpipe", "equal"]))
def test_action_lists_of_random_plans_are_executable(costs, gpus, memory, method):
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [1] * len(costs), [1] * len(costs), input_size=1)
    result = solve(PipelineProblem(chain, gpus, memory), method,
                   options=SolveOptions(time_limit_s=10, threads=1))
    if result.status.has_plan:
        assert_executable(PipelinePlan.from_strings(result.plan), 5)


def test_csv_text_is_one_row_per_used_gpu():
    plan = plan_for([1, 1, 1], 4, "contiguous")  # three stages: one GPU stays idle
    text = schedule_csv(plan, 2)
    rows = list(csv.reader(text.splitlines()))
    assert len(rows) == len(pipeline_ranks(plan)) == 3
    assert rows == schedule_rows(plan, 2)
    assert all(ACTION.match(cell) for row in rows for cell in row)
    with pytest.raises(OptmemInputError, match="micro-batches"):
        rank_programs(plan, 0)


def test_export_pipeline_csv(tmp_path, capsys):
    chain = Chain.from_lists([0.5, 1, 1, 1, 0.5], [0.5, 1, 1, 1, 0.5], [1] * 5, [1] * 5,
                             input_size=1)
    chain.save(tmp_path / "chain.json")
    out = tmp_path / "schedule.csv"
    args = ["export", "pipeline", str(tmp_path / "chain.json"), "--gpus", "2", "--memory",
            "1000000", "--method", "madpipe", "-o", str(out)]
    assert main([*args, "--microbatches", "4"]) == 0
    assert "madpipe plan" in capsys.readouterr().out
    plan = plan_for([1, 2, 2, 2, 1], 2, "madpipe")
    assert out.read_text() == schedule_csv(plan, 4)
    assert_executable(plan, 4)
    out.unlink()
    assert main([*args, "--microbatches", "0"]) == 2  # one error line, nothing written
    assert "micro-batches" in capsys.readouterr().err and not out.exists()
    assert main([*args[:-1], str(tmp_path / "model.lp")]) == 2  # madpipe has no exact model
    assert main(["export", "pipeline", str(tmp_path / "chain.json"), "--gpus", "2",
                 "--memory", "1000000", "-o", str(tmp_path / "model.lp")]) == 0
    assert (tmp_path / "model.lp").exists()  # the exact ILP, as before
