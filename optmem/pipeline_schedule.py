"""A pipeline plan unrolled into per-rank action lists, and PyTorch's schedule CSV.

A plan (CONTRACT section 11) is a 1-periodic pattern: in repetition ``j`` the task of
stage ``s`` starts at ``j T + start`` on micro-batch ``j + shift``. One training step with a
flush runs micro-batches ``0..N-1``; every GPU executes its forwards and backwards of those
micro-batches in the order of their start times in the unrolled pattern (ties: micro-batch,
then dependency order). Because the pattern respects every dependency (the simulator checks
it), this order does too, so it can be handed to any runtime that executes a per-rank action
list: optmem's own point-to-point runner, or PyTorch's ``_PipelineScheduleRuntime``.

**The CSV** is the compute-only schedule format of ``torch.distributed.pipelining``
(``PipelineScheduleMulti._load_csv`` / ``_PipelineScheduleRuntime._load_csv``, the path
torchtitan's ``pipeline_parallel_schedule_csv`` uses): one row per pipeline rank, one cell per
action ``{stage}{F|B}{microbatch}`` with 0-based stage and micro-batch indices (``0F0``,
``2B3``); PyTorch inserts the sends and receives itself. Row ``r`` is the ``r``-th GPU the
plan uses in increasing order (the GPU ids themselves when every GPU holds a stage); plan
stage ``s`` (1-based) is PyTorch stage ``s - 1``. This module does not import torch.
"""

from __future__ import annotations

import csv
import io
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from optmem.errors import OptmemInputError
from optmem.pipeline_plan import PipelinePlan

__all__ = ["RankOp", "check_microbatches", "default_microbatches", "pipeline_ranks",
           "rank_programs", "schedule_csv", "schedule_rows", "write_schedule_csv"]


@dataclass(frozen=True)
class RankOp:
    """One operation of a GPU: ``kind`` ("F"/"B") of 1-based ``stage`` on ``microbatch``."""

    time: float
    order: int
    kind: str
    stage: int
    microbatch: int

    def action(self) -> str:
        """The action string of ``torch.distributed.pipelining`` (``0F3``: 0-based stage)."""
        return f"{self.stage - 1}{self.kind}{self.microbatch}"


def check_microbatches(microbatches: int) -> None:
    """Raise an :class:`~optmem.errors.OptmemInputError` unless ``microbatches`` is an int >= 1."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise OptmemInputError(f"expected a positive number of micro-batches, got "
                               f"{microbatches!r}", field="microbatches")


def rank_programs(plan: PipelinePlan, microbatches: int) -> dict[int, list[RankOp]]:
    """The operations of every GPU for micro-batches ``0..N-1``, sorted by start time.

    Keys are the plan's GPU ids. Ties (zero-length operations) are broken by micro-batch, then
    by dependency order (forwards by increasing stage, backwards by decreasing stage).

    Examples
    --------
    >>> plan = PipelinePlan.from_strings(["period 2", "stage 1 layers 1-1 gpu 0",
    ...     "stage 2 layers 2-2 gpu 1", "F 1 start 0 shift 1", "F 2 start 1 shift 1",
    ...     "B 2 start 0 shift 0", "B 1 start 1 shift 0"])
    >>> [op.action() for op in rank_programs(plan, 2)[0]]
    ['0F0', '0F1', '0B0', '0B1']
    """
    check_microbatches(microbatches)
    programs: dict[int, list[RankOp]] = defaultdict(list)
    n_stages = len(plan.stages)
    for t in plan.tasks:
        if t.op not in ("F", "B"):
            continue
        gpu = plan.stages[t.stage - 1].gpu
        order = t.stage if t.op == "F" else 2 * n_stages + 1 - t.stage
        for m in range(microbatches):
            start = (m - t.shift) * plan.period + t.start
            programs[gpu].append(RankOp(start, order, t.op, t.stage, m))
    for ops in programs.values():
        ops.sort(key=lambda o: (o.time, o.microbatch, o.order))
    return dict(programs)


def pipeline_ranks(plan: PipelinePlan) -> list[int]:
    """The GPUs holding at least one stage, in increasing order (the CSV's rows)."""
    return sorted({st.gpu for st in plan.stages})


def default_microbatches(plan: PipelinePlan) -> int:
    """Twice the number of stages: enough micro-batches to reach the steady state."""
    return 2 * len(plan.stages)


def schedule_rows(plan: PipelinePlan, microbatches: int) -> list[list[str]]:
    """The CSV's rows: the actions of every used GPU (see :func:`pipeline_ranks`)."""
    programs = rank_programs(plan, microbatches)
    return [[op.action() for op in programs[g]] for g in pipeline_ranks(plan)]


def schedule_csv(plan: PipelinePlan, microbatches: int) -> str:
    """The schedule as CSV text (``torch.distributed.pipelining`` compute-only format)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(schedule_rows(plan, microbatches))
    return buf.getvalue()


def write_schedule_csv(plan: PipelinePlan, microbatches: int, path: str | Path) -> None:
    """Write :func:`schedule_csv` to ``path`` (atomically: nothing is left on error)."""
    text = schedule_csv(plan, microbatches)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
