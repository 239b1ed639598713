r"""The exact pipeline model: PIPE_{S^1&A} (thesis ch. 6, corrected), written once.

One solver-neutral :class:`~optmem.models.formulation.Model` of all allocations and
1-periodic patterns, emitted to PuLP (HiGHS, CBC, Gurobi: method ``ilp``) and to CP-SAT
(method ``cpsat``) by :mod:`optmem.models.formulation`. It places *units*: the ``L`` layers
(:func:`model_bounds`: one unit per layer; under ``stash`` last layers without any time
join the last one with time), or the stages of a
MadPipe allocation (its phase 2, thesis section 7.2: the "coarse chain").

The model is chapter 6's (digest ``madpipe.md`` section 4) with the digest's corrections
(4.5: transitivity of "same GPU" in every orientation, transfer durations only between
different GPUs, ``w + w' = z`` for the two orders of a pair, the index ranges), rewritten
to prove:

Allocation (6.1)-(6.4)
    ``x[q, p] = 1``: unit ``q`` on GPU ``p``; ``z(q, r)`` (same GPU) is defined exactly from
    ``x`` (``z >= x_qp + x_rp - 1``, ``z <= 1 - x_qp + x_rp``), so transitivity holds by
    construction. **Symmetry breaking** between identical GPUs: GPUs are numbered by their
    lowest unit (``x[q, p] = 0`` for ``p > q``; ``x[q, p] <= sum_{r<q} x[r, p-1]``: GPU ``p``
    hosts the lowest unit that GPUs ``0..p-1`` do not hold).
Windows (6.17)-(6.21)
    Each GPU ``p`` runs its tasks once per period inside a window ``[win_p, win_p + T]``,
    ``0 <= win_p <= T`` (a window can be moved by whole periods), ``win_0 = 0`` (the time
    origin); task ``t`` of unit ``q`` starts at ``tau_t`` with ``win_p <= tau_t`` and
    ``tau_t + d_t <= win_p + T`` when ``x[q, p]``. So every start lies in ``[0, 2T]``. Links
    (unordered GPU pairs) have windows too; a transfer over the cut after unit ``c`` takes
    ``dt_c`` on the link ``{p, p'}`` when ``e[c, p, p'] = 1`` (the cut joins ``p`` and
    ``p'``, defined exactly from ``x``) and no time when both units share a GPU.
    Where a window starts is part of the plan, not a symmetry: shifts are at least 0, so
    the tasks that come first in each window decide which path edges may wait a period
    longer than needed (rows that opened each window with a chosen task refuted allocations
    that have plans; ``benchmarks/results/pipeline_exact.md``, "Stop 68").
No overlap (6.5)-(6.16)
    One order binary per pair of tasks, enforced when the pair shares a GPU (``z``) or a
    link (``zl``, bounded below by the ``e``); the same sets are also given as optional
    intervals and ``no_overlap`` (marked redundant: CP-SAT uses them for propagation, the
    MILP emission leaves them out).
Shifts (6.23)-(6.30)
    Along one micro-batch's path ``F_1 -> S_1 -> F_2 -> ... -> B_L -> G_{L-1} -> ... -> B_1``
    each edge ``x -> y`` has a shift ``s = v1 + v2 in {0, 1, 2}`` (``v2 <= v1``) with
    ``tau_y + s T >= tau_x + d_x`` (2 suffices since starts lie in ``[0, 2T]``). Larger
    shifts than needed are allowed but only cost memory; the decoder recomputes the smallest.
Memory (6.31)-(6.36)
    ``stash`` model (thesis ch. 5/7): at the start of every forward ``F_q``, weights of the
    GPU's units + buffers of its cuts + ``x_r`` times the stashes of unit ``r`` alive then,
    ``sigma_r + [F_r before F_q] - [B_r before F_q]`` (``sigma_r``: the shifts summed from
    ``F_r`` to ``B_r``; for ``r = q`` its own new copy too). ``strict`` (eq. 6.36): at every
    task start, without the starting forward's own copy, plus the task's input and output and
    the data waiting on the GPU (``o``, eq. 6.22). Sizes are divided by their greatest common
    divisor (exact) so that both engines see the same integer rows.
Ties of zero-length tasks (``stash``)
    A task of zero duration may start at the instant another task of its GPU starts or
    ends. The simulator counts, at an instant, every stash whose forward started then or
    before and whose backward did not end by then (and at a forward's start its own new
    stash). The order binaries put such a task after a task that ends at its start and
    before one that starts with it; among the zero-length tasks of a GPU the rows
    ``tie_*`` make the orders transitive (pair by pair they could be cyclic: a hunt), so
    the tasks at one instant are in one order. The row of the *last* forward in it counts
    what the simulator counts there (a zero-length backward ordered after it is counted
    alive: more, never less) and the rows of the earlier ones a subset, so the largest row
    at each instant is the simulator's memory. A zero-length task at the window's end
    (``tau = win + T``, the instant ``win`` of the next window) comes first at that
    instant: the rows at ``win`` count it as the previous occurrence. One exception: a
    stash that may live no time at all (its unit and every later layer without time:
    forward and backward at one instant), which the simulator still counts at its
    forward's start while its row may miss a forward starting then; such last layers join
    the last layer with time (:func:`model_bounds`). So under ``stash`` the units are the
    layers otherwise, and the model's optimum is the problem's.
Ties of zero-length tasks (``strict``, stop 78)
    Every task's row is checked with its own terms (its input and output, without its own
    new stash), so the largest row at an instant is not enough: each row of a zero-length
    task ``t`` must count what the simulator counts at ``t``'s start, where every task
    starting then has started (its forward's stash held, its input consumed) and every
    zero-length task then has ended (its backward's stash freed, its output produced),
    whatever the order binaries say. Until stop 78 a row ordered before a tied forward or
    backward missed that stash (hunts: a plan decoded at memory 21 replayed at 24, one at
    31 at 36, and ``ilp`` answered ``no_solution``). Indicators after ``t`` in its order
    (:meth:`_Builder.tie_vars`) count them: ``near`` (a start less than
    :func:`separation`, ``(T + 1) / 2^14``, after ``t`` counts as tied: the rows count it,
    more, never less), ``tied`` (a start at ``t``'s instant: the rows free what ends
    there), no zero-length task within that separation of its window's end (ties never
    span two windows). The simulator checks a stage's layers where the stage starts
    (``Layers.strict_task``), so a stage whose last backward takes no time is checked
    before the tasks that start when it ends: binaries ``join``
    (:meth:`_Builder.stage_joins`) let such a unit share the next one's stage, decoded as
    one stage. So the rows of a plan hold iff the simulator fits it
    (``tests/test_pipeline_zero_ties.py``: random plans of one- and multi-layer stages),
    up to the separation: when the best
    plan needs a zero-length task just before another start (the tie costs memory at the
    period itself, so no plan attains the infimum), the models answer the infimum plus
    at most the separation (a seeded chain: 11.00073 for 11). The bound reported for the
    problem comes from the model without the rows ``neara`` (``tie_relaxed``, stop 79),
    which holds every plan at its period.
Zero-length forwards in a stage (``strict``, stop 80)
    Until stop 80 layers without forward time joined their predecessor
    (:func:`zero_forward_merged`), so the proofs covered that class only. Now every layer
    is a unit and ``join[q]`` is also defined where unit ``q + 1``'s forward takes no
    time: the stage's forward checks its trailing zero-length layers where it starts, and
    the row of a joined ``F_q+1`` is that check (no tie after it counts, ``near`` is free
    and ``tied`` 0 unless ``F_q`` takes no time too, whose indicators it then takes; it may
    end a window, as a joined backward: the tasks at the window's start ran before the
    stage started). Three rows make the stage's tasks what the simulator replays: ``F_q``
    before ``F_q+1`` (``joinof``), a stage's stashes held from its first forward (``held``,
    at least ``near`` of the unit's own forward: counted once) and until its last backward
    ends (``ended``: a zero-length ``B_r`` tied after a task frees ``r``'s stash there
    only when no backward that takes time follows it in its stage). A stage boundary with
    neither a zero-length backward below nor a zero-length forward above needs no join:
    its layers as stages, at the same times, hold no more at any check (the encoder writes
    them so). Random plans (stages of 1-3 layers, zero forward and backward times,
    temporaries or not): the rows hold iff the simulator fits the plan the model reads,
    ``tests/test_pipeline_zero_forward.py``.
Cuts (valid inequalities; they change no solution)
    * loads: ``T >=`` the load of every GPU and of every link, ``T >= max(total / P,
      heaviest unit)`` (the bound of :func:`load_bound`);
    * copies: unit ``q``'s stash lives at least ``D_q = sum_{r >= q} (f_r + b_r)`` per
      micro-batch, so the copies alive when ``F_q`` starts, ``c_q = sigma_q + [F_q before
      B_q] = ceil(lifetime / T)``, satisfy ``c_q T >= D_q``; its convex hull over integers
      ``c_q`` gives ``k (k + 1) T + D_q c_q >= (2k + 1) D_q`` for every ``k >= 1`` (the
      secant of ``D_q / c`` between ``k`` and ``k + 1``): memory bounds the copies and
      the copies bound the period, already in the LP relaxation;
    * memory: when ``F_q`` starts, every lower unit of its GPU holds at least the current
      micro-batch's stash;
    * fixings from an upper bound ``T_hi`` (an incumbent): two units whose loads exceed
      ``T_hi`` never share a GPU, a cut whose two transfers exceed ``T_hi`` never exists.

Times are continuous; :meth:`PipelineFormulation.time_scale` gives the CP-SAT grid
(:func:`~optmem.models.formulation.rational_time_scale`: exact for profiled times and
``size / bandwidth`` transfers, refined to at most ``1e-7`` of the load bound, so the period,
which need not lie on the data's grid, is within one step of its true value).
:meth:`PipelineFormulation.encode` writes a plan (1F1B*, MadPipe) as a complete assignment
(warm starts, and a check of the model against the simulator), :meth:`decode` reads a plan.

:func:`build_relaxation` is a second, much smaller model: allocations only, with the copies
of every stash bounded by lifetimes and by the window arcs of its GPU's other forwards
(:class:`_Relaxation`) at a fixed period; its infeasibility at a period proves a lower bound
(the exact methods search it by bisection before the full model runs).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce

from optmem.models.formulation import Expr, Literal, Model, rational_time_scale
from optmem.pipeline_plan import (
    PipelinePlan,
    PipelineStage,
    PipelineTask,
    minimal_shifts,
    phase,
)
from optmem.problems.pipeline import PipelineProblem

Task = tuple[str, int]
"""``("F"|"B", unit)`` or ``("S"|"G", cut)`` (0-based; cut ``c`` follows unit ``c``)."""

TIME_RESOLUTION = 1e-7
"""CP-SAT time grid, relative to the load bound (see :meth:`PipelineFormulation.time_scale`)."""

MAX_SCALED_TIME = 2.0**50
"""Largest scaled sum of durations of :func:`grid_scale` (CP-SAT's domains and sums are
64-bit integers)."""


def grid_scale(values: list[float], lower: float, *, refine: bool = True) -> tuple[int, bool]:
    """CP-SAT grid of a pipeline's durations: exact, at most ``TIME_RESOLUTION`` of ``lower``.

    Durations that no grid makes exact are rounded on a grid 100 times finer (``refine``;
    the model's grid), so that the rounding along a cycle stays far below the optimality
    tolerance. No grid is finer than
    the durations summed over :data:`MAX_SCALED_TIME`: beyond, the period's bounds and rows
    leave CP-SAT's 64-bit integers (a raw ``TypeError`` before stop 52: a period of 1e9 ms
    on the exact grid 1 / 2.8e12 of a 2^46 B transfer at 1e15 B/s; 1e-6 ms layers beside
    1.1e6 ms transfers refined to 1 / 2.9e14 by the resolution). The one grid of the model,
    the relaxation's bisection and the decomposition.

    Examples
    --------
    >>> grid_scale([1.0, 0.5], 1.5)  # the grid 1/2, refined to 1e-7 of 1.5
    (6666668, True)
    >>> grid_scale([1e9, 70368.744177664], 1e9)[0] <= 2**50 / (1e9 + 70368.744177664)
    True
    """
    top = max(1.0, math.fsum(v for v in values if math.isfinite(v)))
    coarsest = top / MAX_SCALED_TIME
    max_scale = max(1, min(10**13, int(MAX_SCALED_TIME / top)))
    resolution = max(TIME_RESOLUTION * max(lower, 1e-12), coarsest)
    scale, exact = rational_time_scale(values, resolution=resolution, max_scale=max_scale)
    if refine and not exact:
        scale, exact = rational_time_scale(values, resolution=max(resolution / 100, coarsest),
                                           max_scale=max_scale)
    return scale, exact

MAX_SECANTS = 64

TIE_SLOTS = 2**14
"""``K``: under ``strict``, a start less than ``(T + 1) / K`` after a zero-length task is
counted in its row as tied with it (:meth:`_Builder.tie_vars`): ``6.1e-5 (T + 1)``, 61
times the simulator's tolerance ``1e-6 max(1, T)``, and a period that much longer is
above HiGHS's tolerances (at ``K = 2^18`` HiGHS answered a plan at 4.000019 optimal where
the model's optimum was 4). An integer, so that the rows ``K (tau_u - tau_t) >= T + 1``
are exact on the CP-SAT grid."""

STRICT_LAYERS = True
"""Under ``strict``, one unit per layer (stop 80: joins for zero-length forwards, module
docstring); ``False``: layers without forward time join their predecessor
(:func:`zero_forward_merged`, the units before stop 80, whose proofs cover that class only:
:func:`optmem.solvers.pipeline.merged_class`)."""

SLIM_FIXED = True
"""With the allocation fixed (``build_pipeline_model(gpu=...)``), write ``x``, ``z``, ``e``,
``zl`` and the buffer indicators as constants and leave out the rows and order variables
of pairs that never share a GPU or link (``False``: the general model with fixing rows,
for comparisons; both have the same solutions, see :class:`_Builder`)."""


# ------------------------------------------------------------------ units
@dataclass(frozen=True)
class Units:
    """Units (consecutive layer ranges) of a pipeline problem, 0-based.

    ``f``/``b``: forward/backward durations; ``w``: weight memory (copies included);
    ``x``: stash per in-flight micro-batch; ``a_in``/``a_out``: input and output sizes;
    ``dt[c]``: duration of one transfer over the cut after unit ``c``; ``buf[c]``: buffers
    each GPU of that cut holds; ``task_f``/``task_b``: what the unit's forward / backward
    adds under the ``strict`` memory model (``Layers.strict_task``: its layers run one
    after the other; ``a_in + a_out`` for one layer).
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
    task_f: tuple[int, ...]
    task_b: tuple[int, ...]

    @property
    def n(self) -> int:
        """Number of units."""
        return len(self.bounds)

    @property
    def comm(self) -> bool:
        """Whether any transfer takes time (links must then be scheduled)."""
        return any(d > 0 for d in self.dt)

    def load(self, q: int) -> float:
        """``f_q + b_q``."""
        return self.f[q] + self.b[q]

    def big_m(self) -> float:
        """``K``: the period of running everything in sequence (an upper bound)."""
        return float(sum(self.f) + sum(self.b) + 2 * sum(self.dt)) or 1.0


def make_units(problem: PipelineProblem, bounds: Sequence[tuple[int, int]] | None = None
               ) -> Units:
    """Units of ``problem``: the model's layer units (:func:`model_bounds`), or the given ranges."""
    lay = problem.layers
    if bounds is None:
        bounds = model_bounds(problem)
    bounds = tuple((int(i), int(j)) for i, j in bounds)
    tasks = [lay.strict_task(i, j) for i, j in bounds]
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
        task_f=tuple(f for f, _ in tasks),
        task_b=tuple(b for _, b in tasks),
    )


def model_bounds(problem: PipelineProblem) -> list[tuple[int, int]]:
    """Layer ranges of the model's units: one per layer, or :func:`zero_forward_merged`.

    Under ``stash`` the model counts what the simulator counts at ties of zero-length tasks
    (module docstring, "Ties of zero-length tasks"): one unit per layer, the model's
    optimum is the problem's, except that the last layers, when none of them takes time,
    join the last one that does: their stash could live no time at all (its forward and
    backward at one instant), which the simulator still counts at their forward's start
    and the rows of a tie could miss. Under ``strict`` every layer is its own unit (since
    stop 80, :data:`STRICT_LAYERS`), also without forward or any time: the rows of a
    zero-length task count what the simulator counts at its start (``_Builder.tie_vars``),
    and the joins (``_Builder.stage_joins``) write the stages whose layers are checked at
    the stage's start. Before, layers without forward time stayed with their predecessor
    (:func:`zero_forward_merged`, still the units with ``STRICT_LAYERS = False``).

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> chain = Chain.from_lists([1.0, 0.0], [1.0, 1.0], [1, 1], [1, 1], input_size=1)
    >>> model_bounds(PipelineProblem(chain, 2, 100))
    [(1, 1), (2, 2)]
    >>> model_bounds(PipelineProblem(chain, 2, 100, memory_model="strict"))
    [(1, 1), (2, 2)]
    """
    lay = problem.layers
    if problem.memory_model == "strict":
        return [(q, q) for q in range(1, lay.n + 1)] if STRICT_LAYERS \
            else zero_forward_merged(problem)
    last = max((q for q in range(1, lay.n + 1) if lay.fwd(q, lay.n) + lay.bwd(q, lay.n) > 0),
               default=1)  # no layer takes time: one unit
    return [(q, q) for q in range(1, last)] + [(last, lay.n)]


def zero_forward_merged(problem: PipelineProblem) -> list[tuple[int, int]]:
    """One unit per layer, except that layers without forward time join their predecessor.

    The ``strict`` model's units (:func:`model_bounds`). A zero-length forward may start at
    the instant another task of its GPU starts; until stop 78 the order binaries then put
    its row first while the simulator counts both stashes at that instant (module
    docstring, "Ties of zero-length tasks (``strict``)"). Keeping such a layer with its
    neighbour removes the tie (a restriction only for chains with zero forward times).
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


def trim_units(units: Units, head: int, tail: int) -> Units:
    r"""Units ``head .. n - tail - 1`` only: a relaxation of every allocation that extends them.

    The kept units keep their durations, weights and stashes; the cuts inside the kept range
    keep their transfers and buffers; the new last unit sends nothing (``a_out = 0``, as the
    loss layer's output).

    **Validity** (digest ``madpipe.md`` sections 1.1, 1.5, 1.6, 4.3). Take any 1-periodic
    plan of the full units with period ``T`` and keep only the tasks of the kept units and
    the transfers of the cuts between them, at the same start times and shifts. Then:

    * every dependency of the trimmed path ``F_h -> ... -> F_k -> B_k -> ... -> B_h``
      (``k = n - tail - 1``) holds: each is a dependency of the full path, except ``F_k ->
      B_k`` when ``tail > 0``, which holds because the full path runs from ``F_k`` through
      the dropped units back to ``B_k``;
    * every GPU and link runs a subset of its tasks, so nothing overlaps and each window
      keeps its length ``T``;
    * a kept unit's stash lives from the start of its forward to the end of its backward,
      unchanged, so the copies alive at any instant are the same; weights and buffers of
      dropped units and cuts vanish; ``strict`` counts the same task terms (``task_f``,
      ``task_b``: the kept tasks' inputs and outputs are unchanged) and fewer pending
      outputs (eq. 6.22: the last unit's output no longer waits on its GPU);
    * the shift of ``F_k -> B_k`` (periods between them, any number in the restricted plan)
      can be lowered to the smallest one the start times allow, which only shortens the
      stashes of units ``h..k``: the models' shifts of at most 2 per edge lose nothing.

    So the restricted plan fits the same memory with the same period and the same partition
    of the kept units: the trimmed optimum with that partition fixed is at most the optimum
    of every full allocation that agrees with it on the kept units (up to GPU labels), and an
    infeasible trimmed allocation at period ``T`` refutes all of them at once.
    """
    if head < 0 or tail < 0 or head + tail >= units.n:
        raise ValueError(f"cannot keep units {head}..{units.n - tail - 1} of {units.n}")
    keep = range(head, units.n - tail)

    def part(values: Sequence) -> tuple:
        return tuple(values[q] for q in keep)

    cuts = range(head, units.n - tail - 1)
    return Units(bounds=part(units.bounds), f=part(units.f), b=part(units.b), w=part(units.w),
                 x=part(units.x), a_in=part(units.a_in),
                 a_out=(*part(units.a_out)[:-1], 0), task_f=part(units.task_f),
                 task_b=part(units.task_b),
                 dt=tuple(units.dt[c] for c in cuts), buf=tuple(units.buf[c] for c in cuts))


def isolate_units(units: Units, gpu: Sequence[int], kept: Collection[int]
                  ) -> tuple[Units, tuple[int, ...]]:
    r"""GPUs ``kept`` of allocation ``gpu`` as they are, every other unit a pure delay.

    Returns the relaxed units and their allocation (labels by first use; its number of GPUs
    is ``len(kept)`` plus one per other unit): a unit not on a kept GPU keeps its durations
    but holds nothing (no weights, no stash, no input or output) and sits alone on a GPU
    of its own; a cut between two such units takes no time and holds no buffers; every
    other cut is kept.

    **Validity** (digest ``madpipe.md`` sections 1.2-1.6, 4.3). Let ``K`` be the kept GPUs
    and ``S`` the units on them. Take any 1-periodic plan of period ``T`` within the
    memory of an allocation ``A`` that puts exactly ``S`` on ``|K|`` GPUs, partitioned as
    ``gpu`` partitions them. Keep every start time and shift, and put each unit outside
    ``S`` on its own GPU:

    * dependencies: unchanged, except that a cut between two units outside ``S`` becomes a
      transfer of no time, placed when its producer ends (in ``A`` the consumer started
      at or after that instant, with or without a transfer);
    * resources: a kept GPU runs exactly its tasks in ``A`` (same window); a private GPU
      runs one unit's forward and backward, which did not overlap on that unit's GPU in
      ``A`` and lie in its window of length ``T``; a cut with an end in ``S`` joins two
      different GPUs in ``A`` too (the other end is outside ``K``), with the same duration,
      and its link carries a subset of what the link of ``A`` carried; the transfers of no
      time overlap nothing;
    * memory (``stash`` and ``strict``, eq. 6.36): a kept GPU holds the same weights,
      buffers (its cuts are the same), stashes (same times, so same copies), inputs,
      outputs and pending data (a producer and consumer on one kept GPU are both in
      ``S``); a private GPU holds only buffers of cuts that also end on that unit's GPU in
      ``A``, at the same instants: at most what ``A`` holds there.

    So the relaxed plan has period ``T`` within the same memory. The model represents
    every 1-periodic plan of its instance (thesis Lemma 15, Thm 19; module docstring), so
    the relaxed optimum is at most the optimum of every such ``A``: an infeasible relaxed
    instance at period ``T`` refutes all of them at once, however they split the other
    units over the other GPUs. It composes with :func:`trim_units` (trim first).
    """
    if len(gpu) != units.n:
        raise ValueError(f"allocation of {len(gpu)} units for {units.n}")
    inside = [g in kept for g in gpu]
    # a unit outside alone on a GPU of its own (a label no kept GPU has), labels by first use
    alloc = first_use([g if inside[q] else ("own", q) for q, g in enumerate(gpu)])

    def only(values: Sequence) -> tuple:
        return tuple(v if inside[q] else 0 for q, v in enumerate(values))

    def cut(values: Sequence, zero: float) -> tuple:
        return tuple(v if inside[c] or inside[c + 1] else zero for c, v in enumerate(values))

    relaxed = Units(bounds=units.bounds, f=units.f, b=units.b, w=only(units.w),
                    x=only(units.x), a_in=only(units.a_in), a_out=only(units.a_out),
                    dt=cut(units.dt, 0.0), buf=cut(units.buf, 0), task_f=only(units.task_f),
                    task_b=only(units.task_b))
    return relaxed, alloc


def delay_tail(units: Units, head: Sequence[int]) -> tuple[Units, tuple[int, ...]]:
    r"""Units ``0 .. k - 1`` placed as ``head`` (``k = len(head)``), every later unit a pure delay.

    Returns the relaxed units and their allocation (``head``'s labels by first use, then one
    GPU of its own per later unit): a later unit keeps its durations but holds nothing (no
    weights, stash, input, output or task terms) and sits alone on its GPU; unit ``k - 1``
    sends nothing (``a_out = 0``); the cuts from unit ``k - 1`` on take no time and hold no
    buffers; the cuts between units of ``head`` are kept.

    Where :func:`trim_units` drops the later units, this keeps them on the micro-batch's
    path: the stash of every unit of ``head`` still lives through the later units'
    forwards and backwards, as the floors of a partial allocation count it
    (:func:`~optmem.solvers.pipeline_chunks.allocation_floor`). On ResNet-50 (21 units,
    4 GPUs, 3 GiB) the instance refutes every one of 15 sampled 14-unit heads at 31.39 ms
    that the trimmed one left open (``benchmarks/results/pipeline_exact.md``, "Stop 63").

    **Validity** (digest ``madpipe.md`` sections 1.2-1.6, 4.3; the arguments of
    :func:`trim_units` and :func:`isolate_units` together). Take any 1-periodic plan of
    period ``T`` within the memory of an allocation that places units ``0 .. k - 1`` as
    ``head`` does (up to GPU labels). Keep every start time and shift, drop the later
    units' tasks from their GPUs and put each later unit on its own GPU:

    * dependencies: unchanged, except that each cut from ``k - 1`` on becomes a transfer of
      no time, placed when its producer ends (in the plan the consumer started at or after
      that instant, with or without a transfer between two GPUs); every edge keeps a shift
      of at most 2, and lowering a shift to the smallest one the start times allow only
      shortens lifetimes (as in :func:`trim_units`);
    * resources: a GPU of ``head`` runs a subset of its tasks (same window), a private GPU
      one unit's forward and backward, which did not overlap on that unit's GPU in the plan
      and lie in one window of length ``T``; the links carry the transfers of the cuts
      inside ``head``, a subset of what they carried;
    * memory (``stash`` and ``strict``, eq. 6.36): a GPU of ``head`` holds the weights,
      stashes (same times and shifts, so the same copies) and task terms of its units of
      ``head``, the buffers of the cuts inside ``head`` and the data pending between them:
      a subset of what it held; a private GPU holds nothing.

    So the relaxed plan has period ``T`` within the same memory: when the relaxed instance
    has no plan at period ``T``, no allocation extending ``head`` has one, however it places
    the later units.
    """
    k = len(head)
    if not 0 < k <= units.n:
        raise ValueError(f"cannot place a head of {k} units of {units.n}")

    def only(values: Sequence) -> tuple:
        return tuple(v if q < k else 0 for q, v in enumerate(values))

    def kept(values: Sequence, zero: float) -> tuple:
        return tuple(v if c < k - 1 else zero for c, v in enumerate(values))

    relaxed = Units(bounds=units.bounds, f=units.f, b=units.b, w=only(units.w),
                    x=only(units.x), a_in=only(units.a_in),
                    a_out=tuple(v if q < k - 1 else 0 for q, v in enumerate(units.a_out)),
                    dt=kept(units.dt, 0.0), buf=kept(units.buf, 0),
                    task_f=only(units.task_f), task_b=only(units.task_b))
    return relaxed, first_use([*head, *(("own", q) for q in range(k, units.n))])


def separation(period: float) -> float:
    """``(T + 1) / K`` (:data:`TIE_SLOTS`): starts closer after a zero-length task tie with it."""
    return (period + 1) / TIE_SLOTS


def load_bound(units: Units, n_gpus: int) -> float:
    """``max(total / P, heaviest unit)``: no period can be smaller."""
    total = sum(units.f) + sum(units.b)
    return max(total / n_gpus, max(units.load(q) for q in range(units.n)))


def decode_plan(
    units: Units, gpu: Sequence[int], period: float,
    fstart: Sequence[float], bstart: Sequence[float],
    sstart: Mapping[int, float], gstart: Mapping[int, float],
    joined: Collection[int] = (),
) -> PipelinePlan:
    """Build the plan from a solution: unit GPUs, period and start times (any real numbers).

    GPUs are renumbered by first use; shifts are the smallest valid ones given the times.
    One stage per unit, except that unit ``q`` in ``joined`` shares the stage of unit
    ``q + 1`` (``strict``: a stage whose last backward takes no time,
    :meth:`_Builder.stage_joins`); a stage's forward starts with its first unit's, its
    backward with its last unit's.
    """
    labels: dict[int, int] = {}
    for g in gpu:
        labels.setdefault(g, len(labels))
    runs: list[list[int]] = []
    for q in range(units.n):
        if runs and q - 1 in joined:
            runs[-1].append(q)
        else:
            runs.append([q])
    stages = tuple(PipelineStage(units.bounds[r[0]][0], units.bounds[r[-1]][1],
                                 labels[gpu[r[0]]]) for r in runs)
    starts: dict[tuple[str, int], float] = {}
    durs: dict[tuple[str, int], float] = {}
    for k, run in enumerate(runs, start=1):
        first, last = run[0], run[-1]
        starts[("F", k)] = phase(fstart[first], period, 1e-9)
        starts[("B", k)] = phase(bstart[last], period, 1e-9)
        durs[("F", k)] = math.fsum(units.f[q] for q in run)
        durs[("B", k)] = math.fsum(units.b[q] for q in run)
        if k < len(runs) and gpu[last] != gpu[last + 1]:
            starts[("send", k)] = phase(sstart[last], period, 1e-9)
            starts[("grad", k)] = phase(gstart[last], period, 1e-9)
            durs[("send", k)] = durs[("grad", k)] = units.dt[last]
    shifts = minimal_shifts(starts, durs, len(runs), period, tol=1e-6)
    tasks = tuple(PipelineTask(op, s, starts[(op, s)], shifts[(op, s)])
                  for (op, s) in sorted(starts, key=lambda key: (key[1], key[0])))
    return PipelinePlan(period, stages, tasks)


def dependency_path(n: int) -> list[Task]:
    """Tasks along one micro-batch: F_0, S_0, F_1, ..., F_{n-1}, B_{n-1}, G_{n-2}, ..., B_0."""
    order: list[Task] = []
    for q in range(n):
        order.append(("F", q))
        if q < n - 1:
            order.append(("S", q))
    for q in range(n - 1, -1, -1):
        order.append(("B", q))
        if q > 0:
            order.append(("G", q - 1))
    return order


# ------------------------------------------------------------------ the formulation
@dataclass
class PipelineFormulation:
    """The built model and the handles that encode and decode plans.

    Expressions are single variables of :attr:`model` (``Model.index`` gives the index).
    """

    units: Units
    n_gpus: int
    memory: int
    strict: bool
    model: Model
    period: Expr
    lower: float
    upper: float
    mem_unit: int
    x: dict[tuple[int, int], Expr] = field(default_factory=dict)
    z: dict[tuple[int, int], Expr] = field(default_factory=dict)
    start: dict[Task, Expr] = field(default_factory=dict)
    window: list[Expr] = field(default_factory=list)
    order: dict[tuple[Task, Task], Expr] = field(default_factory=dict)
    e: dict[tuple[int, int, int], Expr] = field(default_factory=dict)
    link_window: dict[tuple[int, int], Expr] = field(default_factory=dict)
    zl: dict[tuple[int, int], Expr] = field(default_factory=dict)
    link_order: dict[tuple[Task, Task], Expr] = field(default_factory=dict)
    edges: list[tuple[Task, Task, Expr, Expr]] = field(default_factory=list)
    sig: dict[tuple[int, int], Expr] = field(default_factory=dict)
    bufv: dict[tuple[int, int], Expr] = field(default_factory=dict)
    pending: dict[tuple[Task, int], tuple[Expr, Task, Task]] = field(default_factory=dict)
    near: dict[tuple[Task, Task], Expr] = field(default_factory=dict)
    tied: dict[tuple[Task, Task], Expr] = field(default_factory=dict)
    joins: dict[int, Expr] = field(default_factory=dict)
    ties: bool = False
    mates: dict[tuple[Task, Task], Expr] = field(default_factory=dict)
    held: dict[tuple[Task, int], Expr] = field(default_factory=dict)
    ended: dict[tuple[Task, int], Expr] = field(default_factory=dict)
    once: set[tuple[Task, int]] = field(default_factory=set)
    fixed_gpu: tuple[int, ...] | None = None
    tie_relaxed: bool = False
    _sums: dict[tuple[int, int, int], Expr] = field(default_factory=dict, repr=False,
                                                    compare=False)

    # ------------------------------------------------------------ small helpers
    @property
    def tasks(self) -> list[Task]:
        """GPU tasks in the model's pair order: F_0..F_{n-1}, B_{n-1}..B_0."""
        n = self.units.n
        return [("F", q) for q in range(n)] + [("B", q) for q in range(n - 1, -1, -1)]

    def same(self, q: int, r: int) -> Expr:
        """``z(q, r)`` (1 when ``q == r``)."""
        return Expr.of(1) if q == r else self.z[(min(q, r), max(q, r))]

    def prec(self, t: Task, u: Task) -> Expr:
        """1 iff ``t`` and ``u`` share a GPU and ``t`` runs first in its window."""
        if t == u:
            return Expr.of(0)
        if (t, u) in self.order:
            return self.order[(t, u)]
        return self.same(t[1], u[1]) - self.order[(u, t)]

    def produced(self, x: Task, t: Task) -> Expr:
        """1 iff ``x`` ended by ``t``'s start: before it, or (zero-length) tied after it.

        ``near`` (:meth:`_Builder.tie_vars`) may also be 1 a little after a tie: more, never
        less (the output then counts as produced, and it is counted held).
        """
        near = self.near.get((t, x)) if self.duration(x).const == 0 and not \
            self.duration(x).terms else None
        return self.prec(x, t) + (near if near is not None else Expr.of(0))

    def waits(self, t: Task, y: Task) -> Expr:
        """1 iff ``y`` has not started at ``t``'s start: after it, and not tied with it."""
        return self.prec(t, y) - self.tied.get((t, y), Expr.of(0))

    def duration(self, t: Task) -> Expr:
        """Duration of a task (a transfer's is ``dt_c (1 - z(c, c+1))``)."""
        kind, k = t
        if kind == "F":
            return Expr.of(self.units.f[k])
        if kind == "B":
            return Expr.of(self.units.b[k])
        return self.units.dt[k] - self.units.dt[k] * self.same(k, k + 1)

    def sigma(self, q: int) -> Expr:
        """Shifts summed from ``F_q`` to ``B_q`` (stashes held when the period starts)."""
        n = self.units.n
        return self._shifts(2 * q, 2 * n - 1 + 2 * (n - 1 - q))  # F_q and B_q on the path

    def _shifts(self, lo: int, hi: int) -> Expr:
        """Shifts summed over the path's edges from position ``lo`` to ``hi``.

        Kept per range (and number of edges): the memory rows ask each unit's sum about 60
        times per model, and expressions are never changed in place.
        """
        key = (lo, hi, len(self.edges))
        if key not in self._sums:
            self._sums[key] = Expr.sum(v1 + v2 for _, _, v1, v2 in self.edges[lo:hi])
        return self._sums[key]

    def copies(self, q: int) -> Expr:
        """Stashes of unit ``q`` alive when ``F_q`` starts, its own included."""
        return self.sigma(q) + self.order[(("F", q), ("B", q))]

    def link_copies(self, c: int) -> Expr:
        """Link stashes of the cut after unit ``c`` alive when ``S_c`` starts, its own included.

        As :meth:`copies` for a unit: the shifts from ``S_c`` to ``G_c`` plus ``[S_c before
        G_c]`` on their link (the cut's two transfers share its window; 0 without a cut).
        Defined where the cut's transfers take time (they then have an order variable).
        """
        path = dependency_path(self.units.n)
        return (self._shifts(path.index(("S", c)), path.index(("G", c)))
                + self.link_order[(("S", c), ("G", c))])

    def time_scale(self) -> tuple[int, bool]:
        """CP-SAT grid: exact for the durations, at most ``TIME_RESOLUTION`` of the bound.

        Durations that no grid makes exact are rounded on a grid 100 times finer, so that
        the rounding along a cycle stays far below the optimality tolerance.
        """
        u = self.units
        return grid_scale([*u.f, *u.b, *u.dt], self.lower)

    # ------------------------------------------------------------ decode
    def decode(self, values: Sequence[float]) -> PipelinePlan:
        """The plan of an assignment (GPU of each unit, period and start times)."""
        n = self.units.n

        def val(e: Expr) -> float:
            return float(e.value(values))

        gpu = [max((p for p in range(self.n_gpus) if (q, p) in self.x),
                   key=lambda p: val(self.x[(q, p)])) for q in range(n)]
        return decode_plan(
            self.units, gpu, val(self.period),
            [val(self.start[("F", q)]) for q in range(n)],
            [val(self.start[("B", q)]) for q in range(n)],
            {c: val(self.start[("S", c)]) for c in range(n - 1)},
            {c: val(self.start[("G", c)]) for c in range(n - 1)},
            {q for q, m in self.joins.items() if val(m) > 0.5},
        )

    # ------------------------------------------------------------ encode
    def encode(self, plan: PipelinePlan) -> list[float] | None:
        """``plan`` as a complete assignment of the model (``None`` if it is not representable).

        Not representable: stages that split a unit, GPUs that differ from a fixed allocation,
        a period outside the model's bounds. Shifts are the smallest the times allow.
        """
        layout = _plan_layout(self.units, plan)
        if layout is None:
            return None
        gpu, times = layout
        if self.fixed_gpu is not None and tuple(gpu) != self.fixed_gpu:
            return None
        first = {i: q for q, (i, _) in enumerate(self.units.bounds)}
        joined = {q for st in plan.stages for q in range(first[st.first], self.units.n - 1)
                  if self.units.bounds[q][1] < st.last}
        if self.ties and any(q not in self.joins for q in joined
                             if self.units.b[q] == 0 or self.units.f[q + 1] == 0):
            return None  # a join the model cannot write (units on two GPUs: fixed)
        period = plan.period
        if max(gpu) >= self.n_gpus or not (
                self.lower * (1 - 1e-9) - 1e-12 <= period <= self.upper * (1 + 1e-9) + 1e-12):
            return None
        return _Encoder(self, gpu, times, period, joined & set(self.joins)).run()


def plan_gpus(units: Units, plan: PipelinePlan) -> tuple[int, ...] | None:
    """GPU of each unit in ``plan``, labels by first use (``None``: a stage splits a unit)."""
    layout = _plan_layout(units, plan)
    return None if layout is None else tuple(layout[0])


def _plan_layout(units: Units, plan: PipelinePlan
                 ) -> tuple[list[int], dict[Task, float]] | None:
    """GPU per unit (labels by first use) and pattern start of every task and transfer."""
    n = units.n
    first = {i: q for q, (i, _) in enumerate(units.bounds)}
    last = {j: q for q, (_, j) in enumerate(units.bounds)}
    gpu = [0] * n
    times: dict[Task, float] = {}
    for k, st in enumerate(plan.stages, start=1):
        if st.first not in first or st.last not in last:
            return None
        members = range(first[st.first], last[st.last] + 1)
        ftask, btask = plan.task("F", k), plan.task("B", k)
        if ftask is None or btask is None:
            return None
        fstart, bstart = ftask.start, btask.start
        for q in members:
            gpu[q] = st.gpu
            times[("F", q)] = fstart + sum(units.f[r] for r in members if r < q)
            times[("B", q)] = bstart + sum(units.b[r] for r in members if r > q)
        for c in members:
            if c == n - 1:
                continue
            if c == members[-1] and plan.task("send", k) is not None:
                times[("S", c)] = plan.task("send", k).start  # type: ignore[union-attr]
                times[("G", c)] = plan.task("grad", k).start  # type: ignore[union-attr]
    labels: dict[int, int] = {}
    for g in gpu:
        labels.setdefault(g, len(labels))
    return [labels[g] for g in gpu], times


class _Encoder:
    """Writes a plan as model values (see :meth:`PipelineFormulation.encode`)."""

    def __init__(self, form: PipelineFormulation, gpu: list[int], times: dict[Task, float],
                 period: float, joined: set[int]) -> None:
        self.form = form
        self.joined = joined  # units sharing the next one's stage (strict joins)
        self.gpu = gpu
        self.times = times
        self.period = period
        self.values = [0.0] * len(form.model.vars)
        self.path = dependency_path(form.units.n)

    def set(self, e: Expr, value: float) -> None:
        if e.terms:  # constants (a slim model's fixed indicators) hold no variable
            self.values[Model.index(e)] = float(value)

    def val(self, e: Expr) -> float:
        return float(e.value(self.values))

    def run(self) -> list[float] | None:
        form, gpu, period = self.form, self.gpu, self.period
        units = form.units
        n = units.n
        self.set(form.period, period)
        for (q, p), v in form.x.items():
            self.set(v, 1.0 if gpu[q] == p else 0.0)
        for (q, r), v in form.z.items():
            self.set(v, 1.0 if gpu[q] == gpu[r] else 0.0)
        for (c, p, pp), v in form.e.items():
            self.set(v, 1.0 if {gpu[c], gpu[c + 1]} == {p, pp} else 0.0)
        self._gpu_times()
        self._link_times()
        for c in range(n - 1):  # transfers that take no time: right after their producer
            if ("S", c) not in self.times or gpu[c] == gpu[c + 1] or not units.comm:
                self.set(form.start[("S", c)], self.val(form.start[("F", c)]) + units.f[c])
                self.set(form.start[("G", c)],
                         self.val(form.start[("B", c + 1)]) + units.b[c + 1])
        for (t, u), v in form.order.items():
            same = gpu[t[1]] == gpu[u[1]]
            self.set(v, 1.0 if same and self._before(t, u) else 0.0)
        for (c, d), v in form.zl.items():
            self.set(v, 1.0 if self._same_link(c, d) else 0.0)
        for (t, u), v in form.link_order.items():
            self.set(v, 1.0 if self._same_link(t[1], u[1]) and self._before(t, u) else 0.0)
        if not self._shifts():
            return None
        for (q, r), v in form.sig.items():
            self.set(v, self.val(form.sigma(r)) if gpu[q] == gpu[r] else 0.0)
        for (q, c), v in form.bufv.items():
            self.set(v, abs(self.val(form.same(q, c)) - self.val(form.same(q, c + 1))))
        self._ties()
        for (t, _), (o, x, y) in form.pending.items():
            done, waits = form.produced(x, t), form.waits(t, y)
            self.set(o, max(0.0, self.val(done) + self.val(waits)
                            + self.val(form.prec(y, x)) - 1))
        return self._clamped()

    def _ties(self) -> None:
        """``join``, ``near``, ``tied``, ``held`` (strict): ties after a zero-length task."""
        form = self.form
        tol = 1e-9 * max(1.0, self.period)
        for q, j in form.joins.items():
            self.set(j, 1.0 if q in self.joined else 0.0)
        for (t, v), k in form.mates.items():
            self.set(k, 1.0 if self._mates(t, v) else 0.0)
        for store, tied in ((form.near, False), (form.tied, True)):
            for (t, v), k in store.items():  # a stage's anchors come first
                above = self._anchor(t)
                if above is not None:  # its stage's check: as its anchor's
                    inherit = self.val(form.duration(above)) == 0 and (above, v) in store
                    self.set(k, self.val(store[(above, v)]) if inherit else 0.0)
                    continue
                gap = self.val(form.start[v]) - self.val(form.start[t])
                # tie-relaxed: near only at the same instant (the simulator's tie)
                close = gap <= tol if tied or form.tie_relaxed \
                    else gap < separation(self.period)
                own = self._mates(t, v)  # one stage: its own stash held at its check
                self.set(k, 1.0 if self.val(form.prec(t, v)) > 0.5 and close and not own
                         else 0.0)
        for (t, r), e in form.ended.items():  # not while its stage runs on (stage_rest)
            rest = self._rest_positive(r)
            self.set(e, 0.0 if rest else self.val(form.tied[(t, ("B", r))]))
        for (t, r), h in sorted(form.held.items(), key=lambda item: item[0][1]):
            same = self.val(form.joins[r - 1])
            lows = [e for e in (form.near.get((t, ("F", r - 1))), form.held.get((t, r - 1)))
                    if e is not None]
            start = form.near.get((t, ("F", r))) if (t, r) in form.once else None
            self.set(h, max([0.0, 0.0 if start is None else self.val(start)]
                            + [self.val(e) + same - 1 for e in lows]))

    def _mates(self, t: Task, v: Task) -> bool:
        """Whether ``t`` and ``v`` are in one joined stage.

        Backwards: ``v`` below ``t``; forwards: ``v`` above ``t``.
        """
        if t[0] != v[0] or t[0] not in ("F", "B") or (v[1] >= t[1]) == (t[0] == "B"):
            return False
        return all(q in self.joined for q in range(min(t[1], v[1]), max(t[1], v[1])))

    def _rest_positive(self, r: int) -> bool:
        """Whether a backward that takes time runs after ``B_r`` in its stage."""
        units, s = self.form.units, r - 1
        while s >= 0 and s in self.joined:
            if units.b[s] > 0:
                return True
            s -= 1
        return False

    def _anchor(self, t: Task) -> Task | None:
        """Where a joined ``t``'s stage is checked (:meth:`_Builder.stage_anchor`), if joined."""
        if t[0] == "B" and t[1] in self.joined:
            return ("B", t[1] + 1)
        if t[0] == "F" and t[1] - 1 in self.joined:
            return ("F", t[1] - 1)
        return None

    def _before(self, t: Task, u: Task) -> bool:
        """Whether ``t`` comes first in its window.

        It starts earlier, or at once with zero length, before a task that takes time or,
        both zero-length, earlier on a micro-batch's path (data a tied producer hands to a
        tied consumer is not held).
        """
        a, b = self.val(self.form.start[t]), self.val(self.form.start[u])
        if a != b:
            return a < b
        dt, du = self.val(self.form.duration(t)), self.val(self.form.duration(u))
        if dt == 0 and du == 0:
            path = self.path
            return (self._rank(t), path.index(t)) < (self._rank(u), path.index(u))
        return dt == 0 and du > 0

    def _rank(self, t: Task) -> int:
        """Where a zero-length task goes among those of its instant.

        Its joined stage's tasks stay together (rows ``joinif`` / ``joinib``): first (-1)
        after a task of its stage that takes time, last (1) before one, else by path (0).
        """
        if t[0] not in ("F", "B"):
            return 0
        units, q = self.form.units, t[1]
        lo, hi = q, q
        while lo - 1 in self.joined:
            lo -= 1
        while hi in self.joined:
            hi += 1
        dur = units.f if t[0] == "F" else units.b
        earlier = range(lo, q) if t[0] == "F" else range(q + 1, hi + 1)
        later = range(q + 1, hi + 1) if t[0] == "F" else range(lo, q)
        if any(dur[r] > 0 for r in earlier):
            return -1
        return 1 if any(dur[r] > 0 for r in later) else 0

    def _same_link(self, c: int, d: int) -> bool:
        g = self.gpu
        return g[c] != g[c + 1] and {g[c], g[c + 1]} == {g[d], g[d + 1]}

    def _windowed(self, members: dict[int, list[Task]], origin: float
                  ) -> dict[int, float]:
        """Place each resource's tasks in a window starting at its earliest task."""
        wins: dict[int, float] = {}
        for res, tasks in members.items():
            rel = self._relative(tasks, origin)
            wins[res] = min(rel.values())
            for t, r in rel.items():
                self.set(self.form.start[t], r)
        return wins

    def _gpu_times(self) -> None:
        """Place the GPU windows and their tasks.

        Each window starts at its earliest task, or (``strict``, zero-length tasks) at its
        first task start that no zero-length task precedes by less than the tie separation
        (the rows ``wend_*`` of :meth:`_Builder.tie_vars`).
        """
        form, period = self.form, self.period
        members: dict[int, list[Task]] = {}
        for t in form.tasks:
            members.setdefault(self.gpu[t[1]], []).append(t)
        origin = min(self.times[t] for t in members[0])
        origin += self._window_start(self._relative(members[0], origin))
        self.origin = origin
        for p, tasks in members.items():
            rel = self._relative(tasks, origin)
            win = self._window_start(rel)
            for t, r in rel.items():
                self.set(form.start[t], r + period if r < win else r)
            if p < len(form.window):
                self.set(form.window[p], win)
        for q in sorted(self.joined, reverse=True):  # a stage's last backward: at its end
            self.set(form.start[("B", q)], self.val(form.start[("B", q + 1)])
                     + form.units.b[q + 1])
        for q in sorted(self.joined):  # a stage's forwards back to back from its start
            self.set(form.start[("F", q + 1)], self.val(form.start[("F", q)]) + form.units.f[q])

    def _relative(self, tasks: list[Task], origin: float) -> dict[Task, float]:
        """Each task's start modulo the period from ``origin``, in ``[0, T)`` (``T``: 0)."""
        return {t: phase(self.times[t] - origin, self.period, 1e-12) for t in tasks}

    def _window_start(self, rel: dict[Task, float]) -> float:
        """Phase of the window of a GPU whose tasks start at ``rel`` (:meth:`_gpu_times`)."""
        form, period = self.form, self.period
        if not form.strict:
            return min(rel.values())
        inner = {("F", q + 1) for q in self.joined} | {("B", q) for q in self.joined}
        zero = [r for t, r in rel.items() if self.val(form.duration(t)) == 0 and t not in inner]
        sep = separation(period)
        for c in sorted({r for t, r in rel.items() if t not in inner}):
            gaps = (phase(c - z, period, 1e-12) for z in zero)
            if all(g <= 1e-12 * period or g >= sep for g in gaps):
                return c
        return min(rel.values())


    def _link_times(self) -> None:
        form = self.form
        members: dict[int, list[Task]] = {}
        keys: dict[int, tuple[int, int]] = {}
        for c in range(form.units.n - 1):
            g0, g1 = self.gpu[c], self.gpu[c + 1]
            if g0 == g1 or not form.units.comm or ("S", c) not in self.times:
                continue
            link = (min(g0, g1), max(g0, g1))
            k = link[0] * form.n_gpus + link[1]
            keys[k] = link
            members.setdefault(k, []).extend([("S", c), ("G", c)])
        wins = self._windowed(members, self.origin)
        for k, w in wins.items():
            if keys[k] in form.link_window:
                self.set(form.link_window[keys[k]], w)

    def _shifts(self) -> bool:
        period = self.period
        for x, y, v1, v2 in self.form.edges:
            gap = self.val(self.form.start[x]) + self.val(self.form.duration(x)) \
                - self.val(self.form.start[y])
            s = max(0, math.ceil(gap / period - 1e-9))
            if s > 2:
                return False
            self.set(v1, 1.0 if s >= 1 else 0.0)
            self.set(v2, 1.0 if s >= 2 else 0.0)
        return True

    def _clamped(self) -> list[float]:
        out = []
        for v, x in zip(self.form.model.vars, self.values, strict=True):
            out.append(min(max(x, v.lo), v.hi))
        return out


# ------------------------------------------------------------------ building
def build_pipeline_model(
    units: Units, n_gpus: int, memory: int, *, strict: bool = False,
    gpu: Sequence[int] | None = None, upper_bound: float | None = None,
    lower_bound: float = 0.0, lifetime_cuts: bool = False,
    together: Sequence[Sequence[int]] = (),
    same_gpu: Mapping[tuple[int, int], bool] | None = None, slim: bool = True,
    stash_floors: Mapping[tuple[int, int], int] | None = None, tie_relaxed: bool = False,
) -> PipelineFormulation:
    """Build the model of the module docstring.

    Parameters
    ----------
    units
        What to place (layers, or the stages of a fixed partitioning).
    n_gpus, memory
        ``P`` and ``M`` (memory per GPU, chain units).
    strict
        Memory model ``strict`` (ch. 6 eq. 6.36) instead of ``stash``.
    gpu
        Fix the allocation (MadPipe phase 2 with a fixed assignment): GPU label per unit.
    upper_bound, lower_bound
        Known bounds on the optimal period (a valid plan's period; a proven bound). The
        load bound is always added.
    lifetime_cuts
        Add the lifetime relaxation's copy rows at the period ``upper_bound``
        (:class:`_LifetimeCuts`: valid inequalities, they remove no solution).
    together
        Groups of units (0-based) that must share a GPU: a *restriction* to the allocations
        that co-locate each group (rows ``z(q, r) = 1`` for consecutive units of a group;
        "same GPU" is transitive, so the group is on one GPU). The decomposition's
        co-location no-goods (:mod:`optmem.solvers.pipeline_benders`) refute such models.
    same_gpu
        Unit pairs ``(q, r)`` (0-based) whose "same GPU" relation is fixed: rows
        ``z(q, r) = 1`` (together) or ``0`` (apart). Also a restriction: the
        large-neighbourhood search (:mod:`optmem.solvers.pipeline_lns`) keeps the
        incumbent's relation between the units it does not free.
    slim
        With ``gpu`` fixed, build the slim model (:data:`SLIM_FIXED`, same solutions,
        fewer rows); ``False``: the general model with the allocation fixed, whose search
        under a work limit can find better plans (MadPipe's phase 2,
        :data:`~optmem.solvers.pipeline_madpipe.PHASE2_SLIM`).
    tie_relaxed
        ``strict`` only: leave out the rows ``neara`` (:meth:`_Builder.tie_vars`), so a
        task after a zero-length task may count as tied with it or not wherever it starts:
        a relaxation of the problem that does not depend on :func:`separation`, whose
        optimum bounds every plan's period (stop 79,
        :func:`optmem.solvers.pipeline_exact.tie_relaxed_bound`). Its encoder sets
        ``near`` at exact ties only.
    """
    n = units.n
    if gpu is not None:
        gpu = first_use(gpu)
        if max(gpu) >= n_gpus:
            raise ValueError(f"the fixed allocation uses {max(gpu) + 1} GPUs > {n_gpus}")
    lower = max(lower_bound, load_bound(units, n_gpus))
    upper = units.big_m() if upper_bound is None else min(units.big_m(), upper_bound)
    upper = max(upper, lower)
    model = Model("pipeline")
    period = model.continuous("T", lower, upper)
    model.minimize(period)
    form = PipelineFormulation(units, min(n_gpus, n), memory, strict, model, period, lower,
                               upper, _size_unit(units, memory),
                               fixed_gpu=None if gpu is None else gpu,
                               tie_relaxed=tie_relaxed and strict)
    _Builder(form, slim=slim and SLIM_FIXED and gpu is not None and not lifetime_cuts).build()
    for k, group in enumerate(together):
        members = sorted(set(group))
        if not all(0 <= q < n for q in members):
            raise ValueError(f"together: units {members} outside 0..{n - 1}")
        for q, r in itertools.pairwise(members):
            model.add(form.same(q, r) == 1, f"together_{k}_{q}_{r}")
    for (q, r), colocated in sorted((same_gpu or {}).items()):
        if not (0 <= q < n and 0 <= r < n and q != r):
            raise ValueError(f"same_gpu: pair {(q, r)} is not two units of 0..{n - 1}")
        model.add(form.same(q, r) == int(colocated), f"same_{q}_{r}")
    if lifetime_cuts and _Builder(form).memory_binds():
        scale, _ = form.time_scale()
        _LifetimeCuts(form, math.ceil(form.upper * scale), scale).build()
    if stash_floors:
        _stash_rows(form, gpu, stash_floors)
    return form


def _stash_rows(form: PipelineFormulation, gpu: Sequence[int] | None,
                floors: Mapping[tuple[int, int], int]) -> None:
    """The rows of ``stash_floors`` (:func:`build_pipeline_model`)."""
    if gpu is None:
        raise ValueError("stash_floors need a fixed allocation")
    builder = _Builder(form)
    if not builder.memory_binds():
        return  # no memory rows: the counts constrain nothing
    n = form.units.n
    for (r, q), k in sorted(floors.items()):
        if not (0 <= r < n and 0 <= q < n) or gpu[r] != gpu[q]:
            raise ValueError(f"stash_floors: units {r} and {q} are not on one GPU")
        if k <= 0 or not form.units.x[r]:
            continue
        held = form.copies(q) if r == q else builder.alive(r, q, ("F", q))
        form.model.add(held >= k, f"stashes_{r}_{q}")


def first_use(gpu: Sequence[Hashable]) -> tuple[int, ...]:
    """GPU labels (any hashable) renumbered by first use (the symmetry breaking's numbering)."""
    labels: dict[Hashable, int] = {}
    for g in gpu:
        labels.setdefault(g, len(labels))
    return tuple(labels[g] for g in gpu)


def _size_unit(units: Units, memory: int) -> int:
    """Greatest common divisor of every size (memory rows are divided by it, exactly)."""
    sizes = [s for s in (*units.w, *units.x, *units.a_in, *units.a_out, *units.buf,
                         *units.task_f, *units.task_b) if s]
    return reduce(math.gcd, sizes, 0) or 1


class _Builder:
    """Adds the rows of :func:`build_pipeline_model` to a formulation, one block at a time.

    ``slim`` (a fixed allocation, :data:`SLIM_FIXED`): the allocation's indicators are
    constants (``x``, ``z``, the cut-to-link ``e``, the shared-link ``zl``, the buffer
    indicators), so a row enforced by an indicator is written unconditionally when it is 1
    and left out when it is 0, and a pair of tasks on different GPUs or links gets the
    constant 0 as its order instead of a binary with rows. The general model with the
    allocation fixed by rows has exactly these solutions (its fixed binaries take these
    values, its free order binaries of such pairs constrain nothing); only the number of
    variables and rows differs (ResNet-50's 21 units on 4 GPUs: 578 variables and 1,214
    rows instead of 3,326 and 11,729; ``benchmarks/bench_pipeline_fixed.py``).
    """

    def __init__(self, form: PipelineFormulation, *, slim: bool = False) -> None:
        self.form = form
        self.m = form.model
        self.u = form.units
        self.T = form.period
        self.slim = slim and form.fixed_gpu is not None

    def when(self, e: Expr, value: bool = True) -> tuple[Literal, ...] | None:
        """Literals that enforce a row when the indicator ``e`` equals ``value``.

        ``e`` is a binary variable, or a constant 0/1 in a slim model: then ``()`` (always)
        or ``None`` (never: leave the row out).
        """
        if not e.terms:
            return () if (e.const > 0.5) == value else None
        return (self.m.literal(e, value),)

    def build(self) -> None:
        self.allocation()
        self.gpu_loads()
        self.gpu_tasks()
        self.transfers()
        if self.u.comm:
            self.link_vars()
            self.links()
        self.shifts()
        if self.memory_binds():
            self.buffer_vars()
            self.memory()
            if not self.form.strict:  # strict keeps its rows (its ties: module docstring)
                self.tie_orders()
            self.copy_cuts()
        self.fixings()

    # ------------------------------------------------------------ allocation
    def allocation(self) -> None:
        form, m, u = self.form, self.m, self.u
        n, gpus = u.n, form.n_gpus
        if self.slim:
            self.fixed_allocation()
            return
        for q in range(n):
            for p in range(min(q, gpus - 1) + 1):
                form.x[(q, p)] = m.binary(f"x_{q}_{p}")
            m.add(Expr.sum(form.x[(q, p)] for p in range(min(q, gpus - 1) + 1)) == 1,
                  f"assign_{q}")
            for p in range(1, min(q, gpus - 1) + 1):  # GPU p opens after GPU p-1 (symmetry)
                m.add(form.x[(q, p)] <= Expr.sum(self.xv(r, p - 1) for r in range(q)),
                      f"sym_{q}_{p}")
        if form.fixed_gpu is not None:
            for (q, p), v in form.x.items():
                m.add(v == (1 if form.fixed_gpu[q] == p else 0), f"fixed_{q}_{p}")
        for q, r in itertools.combinations(range(n), 2):
            z = form.z[(q, r)] = m.binary(f"z_{q}_{r}")
            for p in range(gpus):
                xq, xr = self.xv(q, p), self.xv(r, p)
                m.add(z >= xq + xr - 1, f"zlo_{q}_{r}_{p}")
                m.add(z <= 1 - xq + xr, f"zhi_{q}_{r}_{p}")
                m.add(z <= 1 - xr + xq, f"zhj_{q}_{r}_{p}")

    def fixed_allocation(self) -> None:
        """``x`` and ``z`` as the fixed allocation's constants (slim model)."""
        form, n = self.form, self.u.n
        gpu = form.fixed_gpu
        assert gpu is not None
        for q in range(n):
            for p in range(min(q, form.n_gpus - 1) + 1):
                form.x[(q, p)] = Expr.of(1 if gpu[q] == p else 0)
        for q, r in itertools.combinations(range(n), 2):
            form.z[(q, r)] = Expr.of(1 if gpu[q] == gpu[r] else 0)

    def gpu_loads(self) -> None:
        """``T >=`` the load of every GPU (a cut)."""
        u = self.u
        for p in range(self.form.n_gpus):
            m = Expr.sum(u.load(q) * self.xv(q, p) for q in range(u.n))
            self.m.add(m <= self.T, f"load_{p}")

    def xv(self, q: int, p: int) -> Expr:
        """``x[q, p]`` (0 where symmetry breaking removed it)."""
        return self.form.x.get((q, p), Expr.of(0))

    # ------------------------------------------------------------ GPUs
    def gpu_tasks(self) -> None:
        form, m, T = self.form, self.m, self.T
        hi = form.upper
        form.window = [m.continuous(f"win_{p}", 0, 0 if p == 0 else hi)
                       for p in range(form.n_gpus)]
        for p in range(1, form.n_gpus):
            m.add(form.window[p] <= T, f"winT_{p}")
        for t in form.tasks:
            form.start[t] = m.continuous(f"tau_{t[0]}{t[1]}", 0, 2 * hi)
        intervals: dict[int, list[int]] = {p: [] for p in range(form.n_gpus)}
        for t in form.tasks:
            tau, d, q = form.start[t], self.dur(t), t[1]
            m.add(tau + d <= 2 * T, f"end_{t[0]}{t[1]}")
            for p in range(form.n_gpus):
                lits = None if (q, p) not in form.x else self.when(form.x[(q, p)])
                if lits is None:
                    continue
                m.add(tau >= form.window[p], f"wlo_{t[0]}{q}_{p}", only_if=lits)
                m.add(tau + d <= form.window[p] + T, f"whi_{t[0]}{q}_{p}", only_if=lits)
                intervals[p].append(m.interval(f"iv_{t[0]}{q}_{p}", tau, d,
                                               lits[0] if lits else None))
        for p, ivs in intervals.items():
            m.no_overlap(f"gpu_{p}", ivs, redundant=True)
        for t, v in itertools.combinations(form.tasks, 2):
            self.pair(t, v, form.same(t[1], v[1]), form.order, "w")

    def dur(self, t: Task) -> float:
        return self.u.f[t[1]] if t[0] == "F" else self.u.b[t[1]]

    def pair(self, t: Task, v: Task, same: Expr, store: dict, tag: str) -> None:
        """One order binary for a pair that may share a resource (``same``; 0: none)."""
        m, form = self.m, self.form
        if self.when(same) is None:  # never on one resource (slim model)
            store[(t, v)] = Expr.of(0)
            return
        w = store[(t, v)] = m.binary(f"{tag}_{t[0]}{t[1]}_{v[0]}{v[1]}")
        lits: list = []
        if same.terms:
            m.add(w <= same, f"{tag}le_{t[0]}{t[1]}_{v[0]}{v[1]}")
            lits = [m.literal(same)]
        a, b = form.start[t], form.start[v]
        m.add(b >= a + form.duration(t), f"{tag}a_{t[0]}{t[1]}_{v[0]}{v[1]}",
              only_if=[*lits, m.literal(w)])
        m.add(a >= b + form.duration(v), f"{tag}b_{t[0]}{t[1]}_{v[0]}{v[1]}",
              only_if=[*lits, m.literal(w, False)])

    # ------------------------------------------------------------ transfers
    def transfers(self) -> None:
        form, m, u, T = self.form, self.m, self.u, self.T
        for c in range(u.n - 1):
            for kind, src in (("S", ("F", c)), ("G", ("B", c + 1))):
                t = (kind, c)
                tau = form.start[t] = m.continuous(f"tau_{kind}{c}", 0, 2 * form.upper)
                m.add(tau + form.duration(t) <= 2 * T, f"end_{kind}{c}")
                ready = form.start[src] + self.dur(src)
                lits = () if not u.comm else self.when(form.same(c, c + 1))
                if lits is not None:  # no link busy (no comm, or no cut): right after its producer
                    m.add(tau == ready, f"tie_{kind}{c}", only_if=lits)

    def link_vars(self) -> None:
        """``e[c, p, p']``: the cut after unit ``c`` joins GPUs ``p < p'`` (exact)."""
        form, m = self.form, self.m
        if self.slim:
            gpu = form.fixed_gpu
            assert gpu is not None
            for c in range(self.u.n - 1):
                if gpu[c] != gpu[c + 1]:
                    form.e[(c, min(gpu[c], gpu[c + 1]), max(gpu[c], gpu[c + 1]))] = Expr.of(1)
            return
        pairs = list(itertools.combinations(range(form.n_gpus), 2))
        for c in range(self.u.n - 1):
            for p, pp in pairs:
                a = [(self.xv(c, p), self.xv(c + 1, pp)), (self.xv(c, pp), self.xv(c + 1, p))]
                if all(not x0.terms or not x1.terms for x0, x1 in a):
                    continue
                e = form.e[(c, p, pp)] = m.binary(f"e_{c}_{p}_{pp}")
                for k, (x0, x1) in enumerate(a):
                    m.add(e >= x0 + x1 - 1, f"elo{k}_{c}_{p}_{pp}")
                m.add(e <= self.xv(c, p) + self.xv(c, pp), f"ehi0_{c}_{p}_{pp}")
                m.add(e <= self.xv(c + 1, p) + self.xv(c + 1, pp), f"ehi1_{c}_{p}_{pp}")
                m.add(e <= 1 - form.same(c, c + 1), f"ehi2_{c}_{p}_{pp}")

    def links(self) -> None:
        """Links, when some transfer takes time.

        A transfer without time (``dt = 0``) still happens at one instant on its link, which
        must not fall inside another transfer there (the simulator's semantics); two such
        instants never conflict.
        """
        form, m, u, T = self.form, self.m, self.u, self.T
        timed = list(range(u.n - 1))
        pairs = list(itertools.combinations(range(form.n_gpus), 2))
        for p, pp in pairs:
            on = [c for c in timed if (c, p, pp) in form.e]
            if not on:
                continue
            win = form.link_window[(p, pp)] = m.continuous(f"lwin_{p}_{pp}", 0, form.upper)
            m.add(win <= T, f"lwinT_{p}_{pp}")
            m.add(Expr.sum(2 * u.dt[c] * form.e[(c, p, pp)] for c in on) <= T,
                  f"linkload_{p}_{pp}")
            ivs = []
            for c in on:
                lits = self.when(form.e[(c, p, pp)])
                assert lits is not None  # a slim model lists only the cuts that exist
                for kind in ("S", "G"):
                    tau = form.start[(kind, c)]
                    m.add(tau >= win, f"lwlo_{kind}{c}_{p}_{pp}", only_if=lits)
                    m.add(tau + u.dt[c] <= win + T, f"lwhi_{kind}{c}_{p}_{pp}", only_if=lits)
                    if u.dt[c] > 0:
                        ivs.append(m.interval(f"liv_{kind}{c}_{p}_{pp}", tau, u.dt[c],
                                              lits[0] if lits else None))
            m.no_overlap(f"link_{p}_{pp}", ivs, redundant=True)
        for c, d in itertools.combinations(timed, 2):
            if u.dt[c] == 0 and u.dt[d] == 0:
                continue
            shared = [(p, pp) for p, pp in pairs if (c, p, pp) in form.e and (d, p, pp) in form.e]
            if not shared:
                continue
            if self.slim:  # both cuts exist, on the same link
                form.zl[(c, d)] = Expr.of(1)
                continue
            zl = form.zl[(c, d)] = m.binary(f"zl_{c}_{d}")
            for p, pp in shared:
                m.add(zl >= form.e[(c, p, pp)] + form.e[(d, p, pp)] - 1, f"zl_{c}_{d}_{p}_{pp}")
        transfers = [(k, c) for c in timed for k in ("S", "G")]
        for t, v in itertools.combinations(transfers, 2):
            if u.dt[t[1]] == 0 and u.dt[v[1]] == 0:
                continue
            if t[1] == v[1]:
                same = 1 - form.same(t[1], t[1] + 1)
                self.cut_pair(t, v, same)
            elif (t[1], v[1]) in form.zl:
                self.pair(t, v, form.zl[(t[1], v[1])], form.link_order, "wl")

    def cut_pair(self, t: Task, v: Task, cut: Expr) -> None:
        """The two transfers of one cut share its link when the cut exists."""
        m, form = self.m, self.form
        apart = self.when(form.same(t[1], t[1] + 1), False)
        if apart is None:  # no cut (slim model)
            form.link_order[(t, v)] = Expr.of(0)
            return
        w = form.link_order[(t, v)] = m.binary(f"wl_{t[0]}{t[1]}_{v[0]}{v[1]}")
        m.add(w <= cut, f"wlle_{t[0]}{t[1]}_{v[0]}{v[1]}")
        a, b = form.start[t], form.start[v]
        dt = self.u.dt[t[1]]
        m.add(b >= a + dt, f"wla_{t[0]}{t[1]}_{v[0]}", only_if=[*apart, m.literal(w)])
        m.add(a >= b + dt, f"wlb_{t[0]}{t[1]}_{v[0]}", only_if=[*apart, m.literal(w, False)])

    # ------------------------------------------------------------ shifts
    def shifts(self) -> None:
        form, m, T = self.form, self.m, self.T
        for k, (x, y) in enumerate(itertools.pairwise(dependency_path(self.u.n))):
            v1, v2 = m.binary(f"v1_{k}"), m.binary(f"v2_{k}")
            m.add(v2 <= v1, f"v21_{k}")
            gap = form.start[y] - form.start[x] - form.duration(x)
            m.add(gap >= 0, f"dep0_{k}", only_if=m.literal(v1, False))
            m.add(gap + T >= 0, f"dep1_{k}", only_if=m.literal(v2, False))
            m.add(gap + 2 * T >= 0, f"dep2_{k}")
            form.edges.append((x, y, v1, v2))

    # ------------------------------------------------------------ memory
    def memory_binds(self) -> bool:
        """Whether any GPU could exceed the memory (else the memory rows are left out)."""
        u = self.u
        most = sum(u.w) + sum(u.buf) + sum(x * (2 * len(self.form.edges) + 1) for x in u.x)
        if self.form.strict:
            most += max(u.task_f) + max(u.task_b) + 2 * sum(u.a_out)
        return most > self.form.memory

    def memory(self) -> None:
        form, m, u = self.form, self.m, self.u
        n, unit = u.n, form.mem_unit
        cap = form.memory // unit
        for q in range(n):
            sigma = form.sigma(q)
            for r in range(n):
                if r != q and u.x[q]:
                    lits = self.when(form.same(q, r))
                    if lits is None:  # other GPU (slim model): never counted
                        form.sig[(r, q)] = Expr.of(0)
                        continue
                    s = form.sig[(r, q)] = m.integer(f"sig_{r}_{q}", 0, 2 * len(form.edges))
                    m.add(s >= sigma, f"sig_{r}_{q}", only_if=lits)
        direct = self.direct_data()
        if form.strict:
            self.tie_vars(direct)
        for t in form.tasks:
            if t[0] == "B" and not form.strict:
                continue  # stash model: memory only grows when a forward starts
            q = t[1]
            static = self.static(q)
            stash = Expr.sum(u.x[r] // unit * (self.alive(r, q, t) + self.tied_alive(r, t))
                             for r in range(n) if u.x[r] and not self.apart(q, r))
            extra = Expr.of(0)
            if form.strict:
                task = u.task_f[q] if t[0] == "F" else u.task_b[q]
                extra = Expr.of(task // unit) + self.pending(t, direct)
            elif u.x[q]:
                extra = Expr.of(u.x[q] // unit)
            m.add(static + stash + extra <= cap, f"mem_{t[0]}{q}")
            if t[0] == "F":  # cut: every lower unit of the GPU stashes this micro-batch
                low = Expr.sum(u.x[r] // unit * form.same(q, r) for r in range(q)
                               if u.x[r] and self.outlives(q, r))
                own = Expr.of((u.task_f[q] if form.strict else u.x[q]) // unit)
                m.add(static + low + own <= cap, f"memlow_{q}")

    def tie_vars(self, direct: list[tuple[Task, Task, int]]) -> None:
        """``strict``: indicators of the tasks tied after a zero-length task.

        Module docstring, "Ties of zero-length tasks (``strict``)".

        For a zero-length task ``t`` and a task ``u`` that may share its GPU:

        * ``near[t, u]`` (``u`` a forward with a stash, or a zero-length producer of data
          waiting on the GPU): when 0 and ``t`` comes before ``u``, ``u`` starts at least
          :func:`separation` after ``t``; ``near <= prec(t, u)``.
          Valid: a plan whose ``u`` starts within that separation after ``t`` takes 1, which
          counts ``u``'s stash (or output) in ``t``'s row, as the simulator does at a tie.
        * ``tied[t, u]`` (``u`` a zero-length backward with a stash, or a consumer of data
          waiting on the GPU): when 1, ``u`` starts at ``t``'s instant; ``tied <= prec(t,
          u)``. Valid: every 0 is allowed (the row then counts ``u``'s stash or input as
          still held: more, never less); a plan with ``u`` tied after ``t`` takes 1, and the
          row frees what the simulator frees there.
        * rows ``wend``: ``t`` starts at least the separation before its window ends, so
          that no tie spans two windows (a zero-length task at ``win + T`` would tie with
          the next window's first tasks, which its row counts as not started). Valid: a
          window may start at any task's start (no task runs across it), so each GPU's
          window can start at a task that no zero-length task precedes by less than the
          separation (a zero-length task at that instant is placed at the window's start);
          the encoder does so (:meth:`_Encoder._gpu_times`).
        """
        form, m, u = self.form, self.m, self.u
        slots, gap = TIE_SLOTS, self.T + 1  # gap / slots: the separation
        form.ties = True
        producers = {x for x, _, _ in direct}
        consumers = {y for _, y, _ in direct}
        self.stage_joins()
        for t in form.tasks:
            if self.dur(t) != 0:
                continue
            above, join = self.stage_anchor(t)  # with join: checked where its stage starts
            free = [] if join is None else [m.literal(join, False)]  # its stage's check
            inherit = join is not None and self.dur(above) == 0
            for p in range(form.n_gpus):
                on = None if (t[1], p) not in form.x else self.when(form.x[(t[1], p)])
                if on is not None:
                    m.add(slots * (form.window[p] + self.T - form.start[t]) >= gap,
                          f"wend_{t[0]}{t[1]}_{p}", only_if=[*on, *free])
            for v in form.tasks:
                if v == t or self.apart(t[1], v[1]):
                    continue
                lits = self.before(t, v)
                if lits is None:
                    continue
                name = f"{t[0]}{t[1]}_{v[0]}{v[1]}"
                prec = form.prec(t, v)
                chain = self.stage_chain(t, v)  # joins that put t and v in one stage
                mate = [] if chain is None else [m.literal(self.stage_mate(t, v, chain), False)]
                stash = u.x[v[1]] // form.mem_unit > 0 or (v[0] == "F" and v[1] in form.joins)
                if (v[0] == "F" and stash) or (self.dur(v) == 0 and v in producers):
                    k = form.near[(t, v)] = m.binary(f"near_{name}")
                    m.add(k <= prec, f"nearle_{name}")
                    if not form.tie_relaxed:
                        m.add(slots * (form.start[v] - form.start[t]) >= gap,
                              f"neara_{name}", only_if=[*lits, m.literal(k, False), *free, *mate])
                    if inherit and (above, v) in form.near:
                        assert join is not None
                        m.add(k >= form.near[(above, v)] + join - 1, f"nearj_{name}")
                if (v[0] == "B" and stash and self.dur(v) == 0) or v in consumers:
                    k = form.tied[(t, v)] = m.binary(f"tied_{name}")
                    m.add(k <= prec, f"tiedle_{name}")
                    m.add(form.start[v] <= form.start[t], f"tieda_{name}", only_if=m.literal(k))
                    if join is not None:
                        up = form.tied.get((above, v)) if inherit else None
                        m.add(k <= (up if up is not None else 0) + 1 - join, f"tiedj_{name}")
                    if chain is not None:  # a stage's own stash is held at its check
                        m.add(k <= Expr.sum(1 - form.joins[q] for q in chain), f"tiedm_{name}")
                    if v[0] == "B" and self.dur(v) == 0 and (rest := self.stage_rest(v[1])):
                        self.stage_ended(t, v, k, rest)
            for q in sorted(form.joins):  # a joined stage's stashes start at its first forward
                j, first = form.joins[q], form.near.get((t, ("F", q)))
                lows = [e for e in (first, form.held.get((t, q))) if e is not None]
                if not lows:
                    continue
                h = form.held[(t, q + 1)] = m.binary(f"held_{t[0]}{t[1]}_{q + 1}")
                for i, e in enumerate(lows):
                    m.add(h >= e + j - 1, f"held{i}_{t[0]}{t[1]}_{q + 1}")
                own = form.near.get((t, ("F", q + 1))) if u.f[q] == 0 else None
                if own is not None:  # or its own forward tied with F_q: counted once
                    form.once.add((t, q + 1))
                    m.add(h >= own, f"heldo_{t[0]}{t[1]}_{q + 1}")

    def stage_rest(self, r: int) -> list[int]:
        """Joins down to the first unit below ``r`` whose backward takes time ([]: none).

        When they all hold, that backward runs in ``r``'s stage after ``B_r``, and the
        stage's stash, ``r``'s included, lives until it ends (``Layers.strict_task``).
        """
        rest: list[int] = []
        for s in range(r - 1, -1, -1):
            if s not in self.form.joins:
                return []
            rest.append(s)
            if self.u.b[s] > 0:
                return rest
        return []

    def stage_ended(self, t: Task, v: Task, tied: Expr, rest: list[int]) -> None:
        """``ended[t, r]``: ``B_r`` (``v``) tied after ``t`` ends ``r``'s stash there.

        Not when its stage runs on with a backward that takes time (joins ``rest``): the
        stage's stash lives until the stage ends (:meth:`tied_alive`).
        """
        m, name = self.m, f"{t[0]}{t[1]}_{v[0]}{v[1]}"
        e = self.form.ended[(t, v[1])] = m.binary(f"ended_{name}")
        m.add(e <= tied, f"endedle_{name}")
        m.add(e <= Expr.sum(1 - self.form.joins[q] for q in rest), f"endedj_{name}")

    def stage_anchor(self, t: Task) -> tuple[Task, Expr | None]:
        """The task where a joined zero-length ``t``'s stage is checked, and that join.

        A zero-length backward ``B_q`` joined to unit ``q + 1``'s stage is checked where
        ``B_q+1`` starts; a zero-length forward ``F_q`` joined to unit ``q - 1``'s stage
        where ``F_q-1`` starts (``Layers.strict_task``: a stage's layers are checked at its
        start). The join is ``None`` where no join is defined.
        """
        if t[0] == "B":
            return ("B", t[1] + 1), self.form.joins.get(t[1])
        return ("F", t[1] - 1), self.form.joins.get(t[1] - 1)

    def stage_chain(self, t: Task, v: Task) -> list[int] | None:
        """Joins that would put ``t`` and ``v`` in one stage, if any.

        Backwards: ``v`` below ``t``; forwards: ``v`` above ``t``.
        """
        if t[0] != v[0] or t[0] not in ("F", "B") or (v[1] >= t[1]) == (t[0] == "B"):
            return None
        chain = list(range(min(t[1], v[1]), max(t[1], v[1])))
        return chain if all(q in self.form.joins for q in chain) else None

    def stage_mate(self, t: Task, v: Task, chain: list[int]) -> Expr:
        """A binary at most every join of ``chain`` (``t`` and ``v`` in one stage)."""
        form, m = self.form, self.m
        if len(chain) == 1:
            return form.joins[chain[0]]
        key = (t, v)
        if key not in form.mates:
            tag = "" if t[0] == "B" else "F"
            k = form.mates[key] = m.binary(f"mate{tag}_{t[1]}_{v[1]}")
            for q in chain:
                m.add(k <= form.joins[q], f"mate{tag}_{t[1]}_{v[1]}_{q}")
        return form.mates[key]

    def stage_joins(self) -> None:
        """``strict``: ``join[q]``, unit ``q`` (no backward time) shares unit ``q + 1``'s stage.

        The simulator checks a stage's layers at the stage's start (``Layers.strict_task``),
        so the last layer of a stage's backward, when it takes no time, is checked before
        the tasks that start when the stage ends: a plan of such a stage can fit where its
        layers as stages, at the same times, do not (a stop-78 hunt: ``contiguous`` replayed
        9 where the models proved nothing fits). ``join[q] = 1``: the units share a GPU, run
        back to back (``F_q`` then ``F_q+1``, ``B_q+1`` then ``B_q``, no task between them
        in the order), ``B_q``'s row counts no tie after it and ends no window (the stage's
        check: what the GPU holds when ``B_q+1`` starts, ``q + 1``'s stash freed), and a
        zero-length task tied before ``F_q`` counts ``q + 1``'s stash (``held``: the stage's
        stash starts with its forward); the decoder writes one stage
        (:func:`decode_plan`). Valid: every plan whose stage holds both units takes 1 (its
        rows are then the simulator's checks), every other plan 0.
        """
        form, m, u = self.form, self.m, self.u
        for q in range(u.n - 1):
            same = form.same(q, q + 1)
            if (u.b[q] != 0 and u.f[q + 1] != 0) or self.when(same) is None:
                continue
            j = form.joins[q] = m.binary(f"join_{q}")
            if same.terms:
                m.add(j <= same, f"joinle_{q}")
            lit = m.literal(j)
            m.add(form.prec(("B", q + 1), ("B", q)) >= j, f"joino_{q}")
            if u.f[q] == 0:  # else implied: F_q+1 starts when F_q ends
                m.add(form.prec(("F", q), ("F", q + 1)) >= j, f"joinof_{q}")
            m.add(form.start[("F", q + 1)] == form.start[("F", q)] + u.f[q], f"joinf_{q}",
                  only_if=lit)
            m.add(form.start[("B", q)] == form.start[("B", q + 1)] + u.b[q + 1], f"joinb_{q}",
                  only_if=lit)
            for v in form.tasks:
                if self.dur(v) != 0 or self.apart(q, v[1]):
                    continue
                if v not in (("F", q), ("F", q + 1)):
                    m.add(form.prec(("F", q), v) - form.prec(("F", q + 1), v) <= 1 - j,
                          f"joinif_{q}_{v[0]}{v[1]}")
                if v not in (("B", q), ("B", q + 1)):
                    m.add(form.prec(("B", q + 1), v) - form.prec(("B", q), v) <= 1 - j,
                          f"joinib_{q}_{v[0]}{v[1]}")

    def before(self, t: Task, v: Task) -> list[Literal] | None:
        """Literals for "``t`` shares a GPU with ``v`` and comes first" (``None``: never)."""
        form, m = self.form, self.m
        if (t, v) in form.order:
            w = form.order[(t, v)]
            return None if not w.terms else [m.literal(w)]
        w = form.order[(v, t)]
        same = self.when(form.same(t[1], v[1]))
        if same is None:
            return None
        if not w.terms:
            return None if w.const > 0.5 else list(same)
        return [*same, m.literal(w, False)]

    def tied_alive(self, r: int, t: Task) -> Expr:
        """``strict``: stashes of unit ``r`` that ties after ``t`` start or free."""
        form = self.form
        freed = form.ended.get((t, r), form.tied.get((t, ("B", r)), Expr.of(0))) \
            if self.u.b[r] == 0 else Expr.of(0)
        if (t, r) in form.once:  # its stage started, or its own forward: counted once
            return form.held[(t, r)] - freed
        started = form.near.get((t, ("F", r)), Expr.of(0)) if self.u.x[r] else Expr.of(0)
        return started + form.held.get((t, r), Expr.of(0)) - freed

    def tie_orders(self) -> None:
        """Transitive orders among the zero-length tasks of a GPU (module docstring, "Ties").

        Tasks of zero duration that start at one instant may take any orders, pair by pair,
        which can be cyclic (each row then misses one stash the simulator counts there: a
        hunt). ``prec(a, b) + prec(b, c) - prec(a, c) <= 1`` makes them one order; every
        plan's ties can be ordered so (valid rows). Between tasks of positive duration, or
        one of each, the times already order them. ``stash`` only: the ``strict`` rows of
        tied tasks miss stashes in any order (module docstring), and stay as they were.
        """
        form, m = self.form, self.m
        zero = [t for t in form.tasks if self.dur(t) == 0]
        for a, b, c in itertools.permutations(zero, 3):
            row = form.prec(a, b) + form.prec(b, c) - form.prec(a, c)
            if row.terms:
                m.add(row <= 1, f"tie_{a[0]}{a[1]}_{b[0]}{b[1]}_{c[0]}{c[1]}")

    def outlives(self, q: int, r: int) -> bool:
        """Whether a micro-batch's stash of unit ``r < q`` is alive when its ``F_q`` starts.

        It lives from ``F_r`` (at or before ``F_q``) to the end of ``B_r``, after the work
        on the path from ``F_q`` to ``B_r``: alive unless all of it takes no time (then
        ``B_r`` may end at the instant ``F_q`` starts, and the simulator no longer counts
        it; the transfers are left out, they take time only between GPUs).
        """
        u = self.u
        return sum(u.f[q:]) + sum(u.b[r:]) > 0

    def buffer_vars(self) -> None:
        """``buf[q, c]``: the cut after unit ``c`` holds buffers on the GPU of unit ``q``."""
        form, m, u = self.form, self.m, self.u
        for q in range(u.n):
            for c in range(u.n - 1):
                if u.buf[c] and self.slim:
                    form.bufv[(q, c)] = Expr.of(abs(form.same(q, c).const
                                                    - form.same(q, c + 1).const))
                elif u.buf[c]:
                    b = form.bufv[(q, c)] = m.binary(f"buf_{q}_{c}")
                    m.add(b >= form.same(q, c) - form.same(q, c + 1), f"bufa_{q}_{c}")
                    m.add(b >= form.same(q, c + 1) - form.same(q, c), f"bufb_{q}_{c}")

    def static(self, q: int) -> Expr:
        """Weights and buffers on the GPU of unit ``q`` (in size units)."""
        form, u, unit = self.form, self.u, self.form.mem_unit
        return (Expr.sum(u.w[r] // unit * form.same(q, r) for r in range(u.n)
                         if u.w[r] and not self.apart(q, r))
                + Expr.sum(u.buf[c] // unit * form.bufv[(q, c)]
                           for c in range(u.n - 1) if u.buf[c]))

    def apart(self, q: int, r: int) -> bool:
        """Whether units ``q`` and ``r`` are on different GPUs for sure (a slim model's 0).

        Their terms in the memory rows are zeros, left out before they are written.
        """
        return self.when(self.form.same(q, r)) is None

    def alive(self, r: int, q: int, t: Task) -> Expr:
        """Stashes of unit ``r`` alive when task ``t`` (of unit ``q``) starts, same GPU."""
        form = self.form
        held = form.sigma(r) if r == q else form.sig[(q, r)]
        return held + form.prec(("F", r), t) - form.prec(("B", r), t)

    def direct_data(self) -> list[tuple[Task, Task, int]]:
        """Outputs consumed on the same GPU (strict model): producer, consumer, size."""
        u = self.u
        if not self.form.strict:
            return []
        out = []
        for q in range(u.n - 1):
            if u.a_out[q]:
                out.append((("F", q), ("F", q + 1), u.a_out[q]))
                out.append((("B", q + 1), ("B", q), u.a_out[q]))
        if u.a_out[u.n - 1]:
            out.append((("F", u.n - 1), ("B", u.n - 1), u.a_out[u.n - 1]))
        return out

    def pending(self, t: Task, direct: list[tuple[Task, Task, int]]) -> Expr:
        """Data produced before ``t`` on its GPU and consumed after it (eq. 6.22)."""
        form, m = self.form, self.m
        terms = []
        for k, (x, y, size) in enumerate(direct):
            if t in (x, y):
                continue
            done, waits = form.produced(x, t), form.waits(t, y)
            # ties after t (strict: tie_vars): at most 2 (a producer near t, its consumer later)
            o = (m.integer(f"o_{t[0]}{t[1]}_{k}", 0, 2) if (t, x) in form.near
                 and self.dur(x) == 0 else m.binary(f"o_{t[0]}{t[1]}_{k}"))
            m.add(o >= done + waits + form.prec(y, x) - 1, f"o_{t[0]}{t[1]}_{k}")
            form.pending[(t, k)] = (o, x, y)
            terms.append(size // form.mem_unit * o)
        return Expr.sum(terms)

    # ------------------------------------------------------------ cuts
    def copy_cuts(self) -> None:
        """``c_q T >= D_q`` through its secants (module docstring)."""
        form, m, u = self.form, self.m, self.u
        for q in range(u.n):
            if not u.x[q]:
                continue
            c = form.copies(q)
            m.add(c >= 1, f"copies_{q}")
            d0 = sum(u.load(r) for r in range(q, u.n))
            kmax = min(MAX_SECANTS, max(1, math.ceil(d0 / max(form.lower, 1e-12))))
            for k in range(1, kmax + 1):
                m.add(k * (k + 1) * self.T + d0 * c >= (2 * k + 1) * d0, f"secant_{q}_{k}")

    def fixings(self) -> None:
        """Pairs that cannot share a GPU and cuts that cannot exist below ``T_hi``."""
        form, m, u = self.form, self.m, self.u
        eps = 1e-9 * max(1.0, form.upper)
        for (q, r), z in form.z.items():
            if u.load(q) + u.load(r) > form.upper + eps:
                m.add(z == 0, f"apart_{q}_{r}")
        for c in range(u.n - 1):
            if 2 * u.dt[c] > form.upper + eps:
                m.add(form.same(c, c + 1) == 1, f"nocut_{c}")


# ------------------------------------------------------------------ the lifetime relaxation
def build_relaxation(units: Units, n_gpus: int, memory: int, ticks: int, scale: int, *,
                     strict: bool = False, gpu: Sequence[int] | None = None,
                     arcs: bool = True) -> PipelineFormulation:
    r"""A relaxation of "some plan has period ``T <= ticks / scale``": allocations only.

    No times: the copies of a stash are bounded by lifetimes instead. In a 1-periodic plan of
    period ``T`` the stash of unit ``r`` lives ``l_r`` per micro-batch, so when ``F_q``
    starts on its GPU it holds ``ceil(l_q / T)`` copies of its own stash, at least
    ``ceil(D(q -> r) / T)`` of every lower unit ``r`` there (micro-batch ``m``'s stash of
    ``r`` lives at least from ``F_q(m)`` to the end of ``B_r(m)``) and at least
    ``floor(l_r / T) >= ceil(D_r / T) - 1`` of every higher one (a window of length
    ``l_r`` holds that many starts), where ``D`` sums the durations on the path, transfers
    of the cuts included. With integer copy counts ``k``, ``T k >= D`` is linear at a fixed
    period. The rows: the allocation of :func:`build_pipeline_model` (with its symmetry
    breaking), GPU and link loads at most the period, those copies, and the memory when each
    forward starts (``strict``: without the starting forward's own copy, with its input and
    output). Times are integers on the grid ``1 / scale``, durations rounded down, so that
    infeasibility at ``ticks`` proves every period ``<= ticks / scale`` impossible. ``gpu``
    fixes the allocation (GPU label per unit, any labels). ``arcs`` (default) adds the
    window-arc rows of :class:`_Relaxation` (``False``: the relaxation without them, for
    comparisons).
    """
    model = Model("pipeline-relaxation")
    period = model.integer("T_ticks", ticks, ticks)
    form = PipelineFormulation(units, min(n_gpus, units.n), memory, strict, model, period,
                               ticks / scale, ticks / scale, _size_unit(units, memory),
                               fixed_gpu=None if gpu is None else first_use(gpu))
    _Relaxation(form, ticks, scale, arcs=arcs).build()
    return form


class _Relaxation(_Builder):
    r"""Rows of :func:`build_relaxation` (times in integer ticks), with the window arcs.

    **Window arcs: what a GPU runs while a stash waits** (digest ``madpipe.md`` sections
    1.5-1.6, 4.3; the thesis' Lemma 9 argument, per GPU). Take a 1-periodic plan of period
    ``T`` and a unit ``r`` on GPU ``p``. Its stash lives ``l_r = (c_r - 1) T + dist_r`` per
    micro-batch, where ``c_r`` is its copies when ``F_r`` starts and ``dist_r`` in ``(0,
    T]`` is the distance in ``p``'s window from the start of ``F_r`` to the end of ``B_r``:
    the *arc* of ``r``. Every other forward ``F_q`` of ``p`` (``f_q > 0``) lies wholly
    inside that arc or wholly in its complement (tasks of one GPU do not overlap), and:

    * inside (``in[q, r] = 1``): the stash intervals ``[F_r(m), end B_r(m))`` start every
      ``T`` and last ``(c_r - 1) T + dist_r``, so at the start of ``F_q`` exactly ``c_r``
      of them are alive (``c_r - 1`` outside the arc): the memory row of ``F_q`` counts
      ``c_r`` copies of ``r`` instead of ``c_r - 1``; and ``dist_r >= f_r + b_r + f_q``;
    * outside: ``F_q`` runs between the end of ``B_r(m)`` and the start of
      ``F_r(m + c_r)`` (the complement's tasks all do), so ``c_r T >= l_r + f_q``.

    Summed over the GPU's forwards, with ``D_r`` the work on the path from ``F_r`` to the
    end of ``B_r`` (a lower bound on ``l_r``): ``c_r T >= D_r + sum_{q outside} f_q``.
    Without the arcs the relaxation counts every other unit's stash ``c - 1`` times at a
    forward while each lifetime may end just before the next forward of its unit, leaving
    no GPU time between a stash's backward and that forward: a GPU that also runs the
    forwards of its other units can avoid only one of the two for each pair (a wait the
    stash pays, or a copy the memory holds). The binaries ``in[q, r]`` need not describe one
    cyclic order (a relaxation: every plan gives them values that satisfy the rows, by the
    two cases above). Durations are rounded down on the grid, so the rows stay valid there.
    Adding the same sums to the chain rows (inside: ``l_b`` grows; outside: ``l_a`` room
    shrinks) is valid too but tripled the headline's bisection time for one more moved
    bound in 20 random instances, so it is left out.
    """

    def __init__(self, form: PipelineFormulation, ticks: int, scale: int, *,
                 arcs: bool = False) -> None:
        super().__init__(form)
        self.grid(ticks, scale)
        self.arcs = arcs
        self.inside: dict[tuple[int, int], Expr] = {}

    def grid(self, ticks: int, scale: int) -> None:
        """Period ``ticks`` and durations rounded down on the grid ``1 / scale``."""
        self.ticks = ticks
        u = self.u
        self.f = [math.floor(v * scale + 1e-9) for v in u.f]
        self.b = [math.floor(v * scale + 1e-9) for v in u.b]
        self.dt = [math.floor(v * scale + 1e-9) for v in u.dt]

    def build(self) -> None:
        form, m, u = self.form, self.m, self.u
        self.allocation()
        for p in range(form.n_gpus):
            m.add(Expr.sum((self.f[q] + self.b[q]) * self.xv(q, p) for q in range(u.n))
                  <= self.ticks, f"load_{p}")
        if u.comm:
            self.link_vars()
            for p, pp in itertools.combinations(range(form.n_gpus), 2):
                m.add(Expr.sum(2 * self.dt[c] * e for (c, a, b), e in form.e.items()
                               if (a, b) == (p, pp)) <= self.ticks, f"linkload_{p}_{pp}")
        self.buffer_vars()
        self.copies_and_memory()

    def path(self, q: int, r: int) -> Expr:
        """Ticks from the start of ``F_q`` to the end of ``B_r`` (``r <= q``), cuts as variables."""
        n = self.u.n
        total = sum(self.f[q:]) + sum(self.b[r:])
        moves = [(c, self.dt[c]) for c in range(q, n - 1)] + \
            [(c, self.dt[c]) for c in range(r, n - 1)]
        return Expr.of(total) + Expr.sum(d - d * self.form.same(c, c + 1) for c, d in moves)

    def copies_and_memory(self) -> None:
        form, m, u, unit = self.form, self.m, self.u, self.form.mem_unit
        n, cap = u.n, form.memory // unit
        # copies are only bounded by memory: waits make lifetimes longer than the work on
        # the path (a micro-batch waits less than a period at each of its 4n - 2 tasks)
        work = sum(self.f) + sum(self.b) + 2 * sum(self.dt)
        most = [4 * n + 2 - (-work // max(self.ticks, 1))] * n
        own = [m.integer(f"k_{q}", 1, most[q]) for q in range(n)]
        if self.arcs:
            self.arc_vars()
        for q in range(n):
            m.add(self.ticks * own[q] >= self.path(q, q) + self.outside(q), f"own_{q}")
        self.chain(own, {c: m.integer(f"kl_{c}", 1, most[c]) for c in self.timed_cuts()})
        for q in range(n):
            terms = []
            for r in range(n):
                if not u.x[r]:
                    continue
                if r == q:
                    terms.append(u.x[q] // unit * (own[q] - 1 if form.strict else own[q]))
                    continue
                k = m.integer(f"k_{q}_{r}", 0, most[r])
                lit = m.literal(form.same(q, r))
                m.add(k >= own[r] - 1, f"floor_{q}_{r}", only_if=lit)
                if (q, r) in self.inside:
                    m.add(k >= own[r], f"full_{q}_{r}",
                          only_if=[lit, m.literal(self.inside[(q, r)])])
                if r < q:
                    m.add(self.ticks * k >= self.path(q, r), f"low_{q}_{r}", only_if=lit)
                terms.append(u.x[r] // unit * k)
            extra = u.task_f[q] // unit if form.strict else 0
            m.add(self.static(q) + Expr.sum(terms) + extra <= cap, f"mem_{q}")

    def arc_vars(self) -> None:
        """``in[q, r]``: ``F_q`` lies in the window arc of unit ``r`` (same GPU; class doc)."""
        form, m, n = self.form, self.m, self.u.n
        for q, r in itertools.permutations(range(n), 2):
            if self.f[q] and self.u.x[r]:  # without a stash, "inside" would change nothing
                y = self.inside[(q, r)] = m.binary(f"in_{q}_{r}")
                m.add(y <= form.same(q, r), f"inle_{q}_{r}")

    def outside(self, r: int) -> Expr:
        """Ticks of the forwards of ``r``'s GPU outside its arc (0 without the arcs)."""
        return Expr.sum(self.f[q] * (self.form.same(q, r) - y)
                        for (q, rr), y in self.inside.items() if rr == r)

    def timed_cuts(self) -> list[int]:
        """Cuts whose transfers take time on the grid (their links hold copies)."""
        return [c for c in range(self.u.n - 1) if self.dt[c] > 0]

    def chain(self, own: list[Expr], links: dict[int, Expr]) -> None:
        """Copies along the chain of units and links: ``(c_a - c_b + 1) T >= D(a..b)``.

        A unit's forward and backward share its GPU's window (a cut's two transfers share
        its link's), so a stash held ``c`` times lives at least ``(c - 1) T`` plus the
        unit's load; the stash of an earlier unit or link ``a`` outlives the one of ``b``
        by the path between them: ``c_a T >= l_a >= l_b + ... >= (c_b - 1) T + D(a..b)``,
        with ``D(a..b)`` the loads from ``a`` to ``b`` inclusive (links only where cut).
        """
        form, m, u = self.form, self.m, self.u
        stages: list[tuple[str, int, Expr]] = []
        for q in range(u.n):
            stages.append(("unit", q, own[q]))
            if q in links:
                stages.append(("link", q, links[q]))
        for (ka, a, ca), (kb, b, cb) in itertools.combinations(stages, 2):
            first = a + 1 if ka == "link" else a  # units first..b, cuts first..b-1 inside
            load = Expr.of(sum(self.f[s] + self.b[s] for s in range(first, b + 1))
                           + sum(2 * self.dt[c] for kind, c in ((ka, a), (kb, b))
                                 if kind == "link"))
            load += Expr.sum(2 * self.dt[c] * (1 - form.same(c, c + 1))
                             for c in range(first, b) if self.dt[c])
            lits = [m.literal(form.same(c, c + 1), False)
                    for kind, c in ((ka, a), (kb, b)) if kind == "link"]
            m.add(self.ticks * (ca - cb + 1) >= load, f"chain_{ka}{a}_{kb}{b}", only_if=lits)


class _LifetimeCuts(_Relaxation):
    r"""The lifetime relaxation's copy rows, added to the full model (valid inequalities).

    With ``c_q`` the model's copies of unit ``q`` (:meth:`PipelineFormulation.copies`:
    its shifts from ``F_q`` to ``B_q`` plus ``[F_q before B_q]``) and ``T_hi`` the model's
    upper bound on the period, on the grid ``1 / scale`` (``ticks = ceil(T_hi scale)``,
    durations rounded down):

    * ``ticks c_q >= D(q -> q)``, the work on the path from ``F_q`` to the end of ``B_q``,
      transfers of the cuts included;
    * the chain rows of :meth:`_Relaxation.chain`, ``(c_a - c_b + 1) ticks >= D(a..b)``
      between units and cut links (a link's copies:
      :meth:`PipelineFormulation.link_copies`, the model's own).

    **Validity.** In every solution of the model, decoded with the model's own shifts
    (digest ``madpipe.md`` 1.5-1.6, 4.3), unit ``q``'s stash lives ``l_q = tau_{B_q} +
    sigma_q T + b_q - tau_{F_q}``; its forward and backward lie in one window of length
    ``T``, so ``(c_q - 1) T + f_q + b_q <= l_q <= c_q T`` (if ``F_q`` precedes ``B_q`` in
    the window, ``l_q - sigma_q T`` lies in ``[f_q + b_q, T]`` and ``c_q = sigma_q + 1``;
    otherwise it lies in ``[f_q + b_q - T, 0]`` and ``c_q = sigma_q``); the same holds for
    a cut's two transfers on their link, whose window holds both (``link_copies``: the
    shifts from ``S_c`` to ``G_c`` plus ``[S_c before G_c]``). The dependency
    rows give ``l_q >= D(q -> q)`` and ``l_a >= l_b + D(a..b) - load(b)`` for ``a`` before
    ``b`` on the chain. So ``c_q T >= D(q -> q)`` and ``c_a T >= l_a >= (c_b - 1) T +
    D(a..b)``, with ``T <= T_hi <= ticks / scale`` and the rounded durations at most the
    true ones: every solution satisfies the rows (they remove none, only strengthen the
    propagation). They are the rows :func:`build_relaxation` proves with, here on the
    model's exact copies, so the full model sees them together with the waits its
    schedule imposes.
    """

    def build(self) -> None:
        form, m, u = self.form, self.m, self.u
        own = [form.copies(q) for q in range(u.n)]
        for q in range(u.n):
            m.add(self.ticks * own[q] >= self.path(q, q), f"lt_own_{q}")
        self.chain(own, {c: form.link_copies(c) for c in self.timed_cuts()})
