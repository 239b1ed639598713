"""Measuring what a recomputed segment costs beyond its stages' forward times.

The chain counts the kernels of every forward and backward (plus ``op_overhead`` per
``F`` op, :data:`~optmem.pytorch.profile.DEFAULT_OP_OVERHEAD_MS`). Running a plan through
:class:`~optmem.pytorch.execute.CheckpointedChain` also costs something per *recomputed
segment* (a maximal run ``F_ck s, F_none s+1 .. F_none s'-1`` re-forwarded before its
backward): the re-forwarded run is back-propagated by its own ``torch.autograd.grad``
call, with its source and sink nodes, and the stored run before it is cut into a separate
call too (:func:`~optmem.pytorch.execute.fusable_runs`). On BERT this was 1.1-1.3 ms per
segment (``benchmarks/results/hf_bert_diagnosis.md``), which the persistent DP can charge
through its ``segment_cost`` option (:func:`optmem.solvers.checkpoint_dp.solve_persistent_table`).

:func:`measure_segment_cost` measures it per model when asked
(``profile_chain(..., measure_segments=True)``; by default the profile records the constant
:data:`~optmem.pytorch.profile.DEFAULT_SEGMENT_COST_MS`, since one difference of two noisy
train steps per round does not give the same figure twice on a loaded machine): two plans
re-forward **the same stages** ``1 .. k`` (``k = L - 1``) exactly once each, one as a single segment
(:func:`segment_plans`, ``one``), the other as ``g`` segments (``many``). The chain predicts
the same time for both (the same ops, only ``F_ck``/``F_none`` differ, which cost the same
``fwd_time``), so what the second costs more, divided by its ``g - 1`` extra segments, is
the cost of one segment that the chain does not see. Rounds run both plans in alternating
order (``one, many`` then ``many, one``: a drift of the machine's speed cancels out over
two rounds); the median of the per-round differences is kept, and a negative median
(noise) is reported as 0.

The timer is injectable (``timer(fn) -> ms``), so tests are deterministic; the default is
the profiler's (the thread's CPU time on one CPU thread, CUDA events on CUDA).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from optmem.errors import OptmemInputError
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op
from optmem.pytorch.execute import CheckpointedChain
from optmem.pytorch.extract import Stage, value_tensors

__all__ = ["SegmentCost", "SegmentTimer", "measure_segment_cost", "segment_groups",
           "segment_plans"]

SegmentTimer = Callable[[Callable[[], Any]], float]
"""``timer(fn) -> ms``: runs ``fn()`` once and returns how long it took."""

MIN_STAGES = 3
"""Shortest chain measured: two re-forwarded stages (two segments) and the last stage."""

DEFAULT_SEGMENT_LENGTH = 4
"""Stages per segment of the ``many`` plan (about one attention or MLP half of a
transformer layer on the exported chains of ``bench_hf``: the segments the DP picks)."""


@dataclass(frozen=True)
class SegmentCost:
    """A measured cost per recomputed segment (milliseconds, or the timer's unit).

    Attributes
    ----------
    ms
        The median per-round difference ``(many - one) / (groups - 1)``, at least 0.
    groups
        Segments of the ``many`` plan (the ``one`` plan has 1).
    reforwards
        Stages re-forwarded by both plans (``1 .. reforwards``).
    samples
        The per-round differences per extra segment (before the median and the clamp).
    """

    ms: float
    groups: int
    reforwards: int
    samples: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form kept in ``chain.extra["profile"]["segment_cost"]``."""
        return {"ms": self.ms, "groups": self.groups, "reforwards": self.reforwards,
                "samples": list(self.samples)}


def segment_groups(reforwards: int, segment_length: int = DEFAULT_SEGMENT_LENGTH) -> int:
    """Segments of the ``many`` plan: ``reforwards / segment_length`` rounded, at least 2.

    Examples
    --------
    >>> segment_groups(104), segment_groups(2), segment_groups(9, 3)
    (26, 2, 3)
    """
    if reforwards < 2:
        raise OptmemInputError(f"two segments need at least 2 re-forwarded stages, got "
                               f"{reforwards}", field="segment_cost")
    return max(2, min(reforwards, round(reforwards / max(1, segment_length))))


def segment_plans(length: int, groups: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """``(one, many)``: stages ``1 .. L-1`` re-forwarded as 1 and as ``groups`` segments.

    Both plans run ``F_all``/``B`` of every stage once, ``L`` forward once more than that
    not at all, and every other stage forward twice (once without a tape, once with); the
    ``many`` plan starts a new ``F_ck`` segment at ``groups`` evenly spaced stages.

    Examples
    --------
    >>> one, many = segment_plans(4, 3)
    >>> " ".join(map(str, one))
    'F_ck 1 F_none 2 F_none 3 F_all 4 Loss B 4 F_all 1 F_all 2 F_all 3 B 3 B 2 B 1'
    >>> " ".join(map(str, many))
    'F_ck 1 F_ck 2 F_ck 3 F_all 4 Loss B 4 F_all 3 B 3 F_all 2 B 2 F_all 1 B 1'
    """
    k = length - 1
    if k < 2 or not 2 <= groups <= k:
        raise OptmemInputError(f"expected 2 <= groups <= {k} for a chain of {length} stages, "
                               f"got {groups}", field="segment_cost")
    starts = [1 + (k * g) // groups for g in range(groups)] + [k + 1]

    def plan(bounds: Sequence[int]) -> tuple[Op, ...]:
        ops: list[Op] = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            ops.append(F_ck(lo))
            ops.extend(F_none(j) for j in range(lo + 1, hi))
        ops += [F_all(length), LOSS, B(length)]
        for lo, hi in reversed(list(zip(bounds, bounds[1:], strict=False))):
            ops.extend(F_all(j) for j in range(lo, hi))
            ops.extend(B(j) for j in range(hi - 1, lo - 1, -1))
        return tuple(ops)

    return plan([1, k + 1]), plan(starts)


def _backward_targets(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs a step back-propagates (the loss alone when one is returned), all-ones."""
    outs = [t for t in value_tensors(out) if t.requires_grad]
    losses = [t for t in outs if t.dim() == 0 and t.is_floating_point()]
    if losses and len(outs) > 1:
        outs = losses
    return outs, [torch.ones_like(t) for t in outs]


def _step(executor: torch.nn.Module, sample: Any, params: Sequence[torch.nn.Parameter]
          ) -> Callable[[], Any]:
    def run() -> None:
        with torch.enable_grad():
            outs, grads = _backward_targets(executor(sample))
            if outs:
                torch.autograd.backward(outs, grads)
        for p in params:
            p.grad = None

    return run


def measure_segment_cost(stages: Sequence[Stage], sample: Any, timer: SegmentTimer, *,
                         repeats: int = 3, warmup: int = 1,
                         segment_length: int = DEFAULT_SEGMENT_LENGTH) -> SegmentCost:
    """Cost of one recomputed segment beyond its stages' forwards (see the module docstring).

    Parameters
    ----------
    stages
        The extracted stages (side inputs, if any, must be active: the profiler runs this
        inside their context).
    sample
        The chain's input.
    timer
        ``timer(fn) -> ms`` (:data:`SegmentTimer`).
    repeats, warmup
        Timed and untimed rounds; each round runs both plans once (one train step each).
    segment_length
        Stages per segment of the ``many`` plan (:func:`segment_groups`).

    Returns
    -------
    SegmentCost
        The median difference per extra segment, clamped at 0, with its samples.
    """
    if len(stages) < MIN_STAGES:
        raise OptmemInputError(f"measuring a segment cost needs at least {MIN_STAGES} stages, "
                               f"got {len(stages)}", field="segment_cost")
    if repeats < 1 or warmup < 0:
        raise OptmemInputError(f"expected repeats >= 1 and warmup >= 0, got {repeats}, "
                               f"{warmup}", field="repeats")
    # the caller's input tensors get no gradient from the measurement: detached copies
    sample = tree_map(lambda v: v.detach().requires_grad_(v.requires_grad)
                      if isinstance(v, torch.Tensor) else v, sample)
    groups = segment_groups(len(stages) - 1, segment_length)
    one, many = segment_plans(len(stages), groups)
    runners = [CheckpointedChain(stages, plan) for plan in (one, many)]
    params = [p for s in stages for p in s.module.parameters()]
    steps = [_step(r, sample, params) for r in runners]
    samples: list[float] = []
    for r in range(warmup + repeats):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        ms = [0.0, 0.0]
        for k in order:
            ms[k] = float(timer(steps[k]))
        if r >= warmup:
            samples.append((ms[1] - ms[0]) / (groups - 1))
    return SegmentCost(max(0.0, float(statistics.median(samples))), groups, len(stages) - 1,
                       tuple(samples))
