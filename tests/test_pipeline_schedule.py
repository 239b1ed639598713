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
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_helpers import forwards_ahead_plan

from optmem.chain import Chain
from optmem.cli import main
from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan
from optmem.pipeline_schedule import (
    SEND_BUFFERS,
    Message,
    RankStep,
    default_microbatches,
    held_sends,
    pipeline_ranks,
    rank_messages,
    rank_programs,
    schedule_csv,
    schedule_rows,
)
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions
from optmem.solvers.facade import solve

ACTION = re.compile(r"^(\d+)([FB])(\d+)$")
WORK_LIMITS = SolveOptions(node_limit=2000, deterministic_time=10.0, seed=0, threads=1)
"""Deterministic engine limits: the plans do not depend on the machine's load."""


def plan_for(costs: list[float], gpus: int, method: str, memory: int = 10**6) -> PipelinePlan:
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [1] * len(costs), [1] * len(costs), input_size=1)
    result = solve(PipelineProblem(chain, gpus, memory), method,
                   options=WORK_LIMITS)
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
                   options=WORK_LIMITS)
    if result.status.has_plan:
        assert_executable(PipelinePlan.from_strings(result.plan), 5)


def reachable(steps: dict[int, list[RankStep]], start: tuple[int, int]) -> set[tuple[int, int]]:
    """The operations ``(gpu, index)`` that happen after ``start``'s receives (breadth-first
    over program order and message edges, independent of the vector clocks)."""
    receiver = {msg: (g, k) for g, ops in steps.items() for k, st in enumerate(ops)
                for _, msg in st.receive}
    seen, todo = {start}, deque([start])
    while todo:
        g, k = todo.popleft()
        send = steps[g][k].send
        nxt = [(g, k + 1)] if k + 1 < len(steps[g]) else []
        nxt += [receiver[send[1]]] if send is not None else []
        for node in nxt:
            if node not in seen:
                seen.add(node)
                todo.append(node)
    return seen


def assert_releases_follow_receipt(plan: PipelinePlan, microbatches: int) -> None:
    """Each cross-GPU message is received once, in its link's order, by its stage's GPU; a
    send is released at the first operation of its sender reachable from its receipt, and
    only a send with no such operation is never released."""
    steps = rank_messages(plan, microbatches)
    sent = {st.send[1]: (g, k, st.send[0]) for g, ops in steps.items()
            for k, st in enumerate(ops) if st.send is not None}
    got = {msg: (g, k, peer) for g, ops in steps.items() for k, st in enumerate(ops)
           for peer, msg in st.receive}
    assert got.keys() == sent.keys()
    for msg, (g, _, peer) in sent.items():  # received by its addressee, from its sender
        assert (got[msg][0], got[msg][2]) == (peer, g)
    for g, ops in steps.items():  # the link to g from each peer is read in its send order
        for peer in steps:
            order = [st.send[1] for st in steps[peer] if st.send and st.send[0] == g]
            assert [m for st in ops for p, m in st.receive if p == peer] == order
    released = {m: (g, k) for g, ops in steps.items() for k, st in enumerate(ops)
                for m in st.release}
    for msg, (g, _, _) in sent.items():
        after = reachable(steps, got[msg][:2])
        first = min((k for h, k in after if h == g), default=None)
        assert released.get(msg, (g, None)) == (g, first), msg
    assert_sends_bounded(steps)
    assert_runs_to_the_end(steps)


def assert_sends_bounded(steps: dict[int, list[RankStep]]) -> None:
    """When an operation starts (its releases and waits done), its GPU holds at most
    ``SEND_BUFFERS`` sent messages of each cut that are buffers of their own: a gradient
    from the operation after the backward that sent it, an activation from the operation
    after its stage's backward (until then it is the stash)."""
    for ops in steps.values():
        ran: set[tuple[str, int, int]] = set()
        sent: dict[Message, int] = {}
        gone: set[Message] = set()
        for k, step in enumerate(ops):
            gone |= {*step.release, *step.wait}
            alone = [(kind, s) for (kind, s, m), at in sent.items() if at < k
                     and (kind, s, m) not in gone and (kind == "g" or ("B", s, m) in ran)]
            assert all(alone.count(key) <= SEND_BUFFERS for key in alone), (k, alone)
            ran.add((step.op.kind, step.op.stage, step.op.microbatch))
            if step.send is not None:
                sent[step.send[1]] = k


def assert_runs_to_the_end(steps: dict[int, list[RankStep]]) -> None:
    """Run the steps as ``run_plan`` does, each GPU as far as it can: receive (blocks until
    the message is sent), wait on ``release`` and ``wait`` (blocks until the receiver has
    taken the message), send. Every GPU reaches its end: the waits cannot deadlock."""
    actions = {g: [(what, msg) for st in ops
                   for what, msg in [*(("take", m) for _, m in st.receive),
                                     *(("wait", m) for m in (*st.release, *st.wait)),
                                     *([("send", st.send[1])] if st.send else [])]]
               for g, ops in steps.items()}
    sent: set[Message] = set()
    taken: set[Message] = set()
    pos = dict.fromkeys(actions, 0)
    progress = True
    while progress:
        progress = False
        for g, todo in actions.items():
            while pos[g] < len(todo):
                what, msg = todo[pos[g]]
                if (what == "take" and msg not in sent) or (what == "wait" and msg not in taken):
                    break
                (taken if what == "take" else sent).add(msg)
                pos[g] += 1
                progress = True
    assert all(pos[g] == len(todo) for g, todo in actions.items()), pos


def test_a_rank_running_forwards_ahead_waits_on_its_gradients():
    """MadPipe's plan of ``bench_pipeline_runtime.py --temporaries``: GPU 0 runs 7 forwards
    before its first backward and then sends only the forward of micro-batch 7, so no
    message tells GPU 1 that its gradients of micro-batches 1-7 arrived, and it held 7 of
    its 8 to the end of the step (1.14x its plan). It now waits on the gradient of m when
    the one of m + 2 becomes a buffer of its own (before ``2B(m+3)``: GPU 0 took it at
    ``0B(m)``, a period earlier in the plan); GPU 0's sent activations are its stash until
    their backward, which releases them: no wait there. The contiguous plan keeps its
    releases, without waits."""
    steps = rank_messages(forwards_ahead_plan(), 8)
    assert [held_sends(steps[g]) for g in (0, 1)] == [7, 3]
    waits = [(st.op.action(), st.wait) for st in steps[1] if st.wait]
    assert waits == [(f"2B{m + 3}", (("g", 1, m),)) for m in range(5)]
    assert not any(st.wait for st in steps[0])
    assert_sends_bounded(steps)
    assert_runs_to_the_end(steps)
    contiguous = rank_messages(plan_for([1] * 6, 2, "contiguous"), 8)
    assert not any(st.wait for ops in contiguous.values() for st in ops)


@pytest.mark.parametrize(("costs", "gpus", "method", "memory"), [
    ([1, 1, 1, 1, 1, 1], 2, "contiguous", 10**6), ([1, 2, 1], 2, "cpsat", 10**6),
    ([1, 2, 2, 2, 1], 2, "madpipe", 10**6), ([1, 2, 1, 1, 2, 1], 3, "madpipe", 60),
    ([1, 2, 1, 1, 2, 1], 4, "cpsat", 10**6), ([3, 1, 4, 1, 5, 9, 2, 6], 3, "madpipe", 30),
])
def test_sends_are_released_where_the_receipt_happens_before(costs, gpus, method, memory):
    plan = plan_for(costs, gpus, method, memory)
    for microbatches in (1, 3, 8):
        assert_releases_follow_receipt(plan, microbatches)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(costs=st.lists(st.integers(1, 9), min_size=2, max_size=9), gpus=st.integers(2, 4),
       memory=st.integers(8, 60), method=st.sampled_from(["contiguous", "madpipe", "equal"]))
def test_sends_of_random_plans_are_released_where_received(costs, gpus, memory, method):
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [1] * len(costs), [1] * len(costs), input_size=1)
    result = solve(PipelineProblem(chain, gpus, memory), method, options=WORK_LIMITS)
    if result.status.has_plan:
        assert_releases_follow_receipt(PipelinePlan.from_strings(result.plan), 5)


def test_a_contiguous_plan_holds_two_sends_per_rank_not_a_step():
    """1F1B on 2 GPUs: GPU 1's gradient of micro-batch m is released when GPU 0's forward of
    m + 2 arrives; the last two have no later message and are held to the end."""
    steps = rank_messages(plan_for([1] * 6, 2, "contiguous"), 8)
    assert [held_sends(steps[g]) for g in (0, 1)] == [2, 2]
    released = [msg for st in steps[1] for msg in st.release]
    assert released == [("g", 1, m) for m in range(6)]
    assert [st.op.action() for st in steps[1] if st.release][0] == "1F2"


def test_an_order_that_deadlocks_is_a_plan_error():
    """GPU 0 runs B 1 of micro-batch 0 before F 1 of micro-batch 1, and GPU 1 F 2 of
    micro-batch 1 before B 2 of micro-batch 0: each waits for the other's message
    (``run_plan`` would have waited forever; it computes the messages first). Until the
    review of stop 56 this test's plan ran B 1 before F 1 on GPU 0, now refused before
    the replay (below)."""
    plan = PipelinePlan.from_strings([
        "period 4", "stage 1 layers 1-1 gpu 0", "stage 2 layers 2-2 gpu 1",
        "F 1 start 0 shift 0", "B 1 start 1 shift 0", "F 2 start 0 shift 1",
        "B 2 start 1 shift 0"])
    with pytest.raises(PlanError, match="deadlocks: GPU 0 at 0B0, GPU 1 at 1F1 waits"):
        rank_messages(plan, 2)


def test_an_order_that_runs_a_backward_before_its_forward_is_a_plan_error():
    """Shifts that put each GPU's backwards before its forwards: the replay of the
    messages finished (it checks messages between GPUs only), its waits deadlocked and
    were dropped, and ``run_plan`` failed with a ``KeyError`` on rank 1 (``2B0`` without its
    forward) while rank 0 waited for it (review of stop 56). Refused before any rank runs;
    no plan of the solvers does this (the waits of 250,000 random plans ordered by their
    dependencies never needed dropping)."""
    plan = PipelinePlan.from_strings([
        "period 1", "stage 1 layers 1-1 gpu 0", "stage 2 layers 2-2 gpu 1",
        "F 1 start 0.75 shift 1", "B 1 start 0.5 shift 3", "F 2 start 0.5 shift 1",
        "B 2 start 0.25 shift 4", "send 1 start 0 shift 0", "grad 1 start 0 shift 0"])
    with pytest.raises(PlanError, match="runs 0B0 before 0F0 on GPU 0"):
        rank_messages(plan, 3)
    with pytest.raises(PlanError, match="before"):
        schedule_rows(plan, 3)


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
