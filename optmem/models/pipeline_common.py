"""Shared data of the exact pipeline models: the units to place and the plan decoder.

The chapter 6 ILP (:mod:`optmem.models.pipeline_ilp`) and the CP-SAT model
(:mod:`optmem.models.pipeline_cpsat`) place *units*: the ``L`` layers for the full model (layers
without forward time merged into their predecessor),
or the stages of a MadPipe allocation for its phase 2 (thesis section 7.2, the "coarse
chain": ``u'_F`` and ``u'_B`` are sums over the stage, weights and stashes are summed, the
transferred tensor is the stage's output).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optmem.pipeline_plan import (
    PipelinePlan,
    PipelineStage,
    PipelineTask,
    minimal_shifts,
    phase,
)
from optmem.problems.pipeline import PipelineProblem


@dataclass(frozen=True)
class Units:
    """Units (consecutive layer ranges) of a pipeline problem, 0-based.

    ``f``/``b``: forward/backward durations; ``w``: weight memory (copies included);
    ``x``: stash per in-flight micro-batch; ``a_in``/``a_out``: input and output sizes;
    ``dt[c]``: duration of one transfer over the cut after unit ``c``; ``buf[c]``: buffers
    each GPU of that cut holds.
    """

    bounds: tuple[tuple[int, int], ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[int, ...]
    x: tuple[int, ...]
    a_in: tuple[int, ...]
    a_out: tuple[int, ...]
    dt: tuple[float, ...]
    buf: tuple[int, ...]

    @property
    def n(self) -> int:
        """Number of units."""
        return len(self.bounds)

    @property
    def comm(self) -> bool:
        """Whether any transfer takes time (links must then be scheduled)."""
        return any(d > 0 for d in self.dt)

    def big_m(self) -> float:
        """``K``: the period of running everything in sequence (an upper bound)."""
        return float(sum(self.f) + sum(self.b) + 2 * sum(self.dt)) or 1.0


def make_units(problem: PipelineProblem, bounds: Sequence[tuple[int, int]] | None = None
               ) -> Units:
    """Units of ``problem``: one per layer, or the given layer ranges."""
    lay = problem.layers
    if bounds is None:
        bounds = zero_forward_merged(problem)
    bounds = tuple((int(i), int(j)) for i, j in bounds)
    return Units(
        bounds=bounds,
        f=tuple(lay.fwd(i, j) for i, j in bounds),
        b=tuple(lay.bwd(i, j) for i, j in bounds),
        w=tuple(problem.weight_copies * lay.weights(i, j) for i, j in bounds),
        x=tuple(lay.stash(i, j) for i, j in bounds),
        a_in=tuple(lay.a[i - 1] for i, _ in bounds),
        a_out=tuple(lay.a[j] for _, j in bounds),
        dt=tuple(problem.transfer_time(j) for _, j in bounds[:-1]),
        buf=tuple(problem.buffer_size(j) for _, j in bounds[:-1]),
    )


def zero_forward_merged(problem: PipelineProblem) -> list[tuple[int, int]]:
    """One unit per layer, except that layers without forward time join their predecessor.

    A zero-length forward may start at the same instant as another forward of its GPU; the
    models order such ties freely while the simulator counts both stashes at that instant.
    Keeping such a layer with its neighbour removes the ambiguity (a restriction only for
    chains with zero forward times).
    """
    lay = problem.layers
    bounds: list[list[int]] = []
    for q in range(1, lay.n + 1):
        if bounds and (lay.f[q] == 0 or lay.f[bounds[-1][0]:bounds[-1][1] + 1] == (0.0,) * (
                bounds[-1][1] - bounds[-1][0] + 1)):
            bounds[-1][1] = q
        else:
            bounds.append([q, q])
    return [(i, j) for i, j in bounds]


def _mod(t: float, period: float) -> float:
    return phase(t, period, 1e-9)


def decode_plan(
    units: Units, gpu: Sequence[int], period: float,
    fstart: Sequence[float], bstart: Sequence[float],
    sstart: Mapping[int, float], gstart: Mapping[int, float],
) -> PipelinePlan:
    """Build the plan from a solution: unit GPUs, period and start times (any real numbers).

    GPUs are renumbered by first use; shifts are the smallest valid ones given the times.
    """
    labels: dict[int, int] = {}
    for g in gpu:
        labels.setdefault(g, len(labels))
    stages = tuple(PipelineStage(i, j, labels[gpu[q]]) for q, (i, j) in enumerate(units.bounds))
    starts: dict[tuple[str, int], float] = {}
    durs: dict[tuple[str, int], float] = {}
    for q in range(units.n):
        starts[("F", q + 1)] = _mod(fstart[q], period)
        starts[("B", q + 1)] = _mod(bstart[q], period)
        durs[("F", q + 1)], durs[("B", q + 1)] = units.f[q], units.b[q]
        if q < units.n - 1 and gpu[q] != gpu[q + 1]:
            starts[("send", q + 1)] = _mod(sstart[q], period)
            starts[("grad", q + 1)] = _mod(gstart[q], period)
            durs[("send", q + 1)] = durs[("grad", q + 1)] = units.dt[q]
    shifts = minimal_shifts(starts, durs, units.n, period, tol=1e-6)
    tasks = tuple(PipelineTask(op, s, starts[(op, s)], shifts[(op, s)])
                  for (op, s) in sorted(starts, key=lambda key: (key[1], key[0])))
    return PipelinePlan(period, stages, tasks)
