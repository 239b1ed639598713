"""Chunk scan: the best pipeline plan whose GPUs each hold at most ``k`` runs of layers.

Interleaved and V-shaped pipeline schedules (``torch.distributed.pipelining``'s
``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble``; Qi et al., "Pipeline Parallelism
with Controllable Memory", 2024) give each GPU two or more *chunks*: runs of consecutive
layers. The V shape puts an early, stash-heavy chunk and a late, stash-light one on the same
GPU, which balances memory where a contiguous split cannot (thesis Part III, ch. 7: MadPipe's
non-contiguous allocations serve the same end). This method searches that family exactly:

1. **Enumerate** every allocation of the units (:func:`~optmem.models.pipeline.make_units`)
   in which each GPU holds at most ``k`` chunks (``extra["chunks"]``, default 2), GPUs
   numbered by first use, each GPU's load at most the incumbent's period.
2. **Bound** each one (:func:`allocation_floor`): its GPU and link loads, and the memory
   when each forward starts with the stash copies that lifetimes force at a period ``T``
   (the rows of :func:`~optmem.models.pipeline.build_relaxation` without window arcs, with
   the allocation fixed: ``ceil(D / T)`` copies of the starting unit's stash, of every lower
   unit's ``ceil(D(q -> r) / T)``, of every higher unit's ``ceil(D_r / T) - 1``). The floor
   is the least ``T`` that passes them (a bisection: memory needs only shrink as ``T``
   grows). Where asked (``rounds``), a complete allocation's rows then take the *waits*
   (stop 57, :func:`waits_check`): the ops of one GPU, and the transfers of one link, do
   not overlap modulo ``T``, so the delays between them avoid windows and the lifetimes
   ``D`` grow. The method asks them (``extra["waits"]``, default true, stop 59) before
   each question of the scan (:meth:`_Asker.waited`) and in :func:`allocations_bound`,
   not in the walks (their cost).
3. **Scan** the allocations by increasing floor: the exact model with the allocation fixed
   (``build_pipeline_model(gpu=...)``, CP-SAT, one worker, ``extra["chunk_work"]``
   deterministic seconds, default 5) asked for *any* plan of period at most the incumbent's
   less one step (``extra["chunk_step"]``, relative, default 1e-4). A cutoff near the
   answer decides it in about a second (ResNet-50 below); a plan found is then polished
   (the same model minimising the period, hinted with it) and taken after the simulator
   replays it. An allocation refuted at a cutoff stays refuted at every lower one, so one
   pass suffices; the scan stops at the first floor at or above the cutoff. The allocations
   left undecided are asked once more at the final cutoff with ``extra["chunk_retry_work"]``
   deterministic seconds each (default :data:`RETRY_WORK`). CP-SAT's refutations count only
   where the durations lie on its time grid
   (:func:`~optmem.solvers.pipeline_common.run_model`); elsewhere they stay undecided.
4. **In parallel**: with ``w`` threads (``SolveOptions.threads``) up to ``LOOKAHEAD * w``
   questions are in flight, each sent at the cutoff in force a fixed number of answers
   earlier and answered in the order sent (:class:`_Asker`), so the scan is the same for
   the same ``w`` on any machine.
5. **Trimmed questions** (stop 62; ``extra["trim"]``, default true, ``extra["trim_tail"]``,
   default :data:`TRIM_TAIL`): allocations that place units ``0 .. n - 1 - t`` alike share
   a *prefix* (levels ``t = tail, tail - 1, ..., 1``, those at which the pass's
   allocations are at least :data:`TRIM_SHARE` per prefix). Before its own question, an
   allocation asks, most trimmed first, each of its prefixes not yet asked whether those
   units alone (:func:`~optmem.models.pipeline.trim_units`, a relaxation of every
   allocation with that prefix, whatever it does with the last ``t`` units) have a plan at
   the cutoff; the first that has none refutes every allocation with that prefix, without
   their own questions (:class:`_Asker`). On the ResNets the last units' stashes are small
   and the memory binds on the first ones: on ResNet-50 at 1.5x the 11,934 allocations of
   the complete family share 660 prefixes of 17 units and 1,922 of 19.

When the pass ends with no allocation undecided, every plan of the family has a period of at
least the last cutoff (less CP-SAT's grid step): ``report["chunks_bound"]``, a bound of the
family, not of the problem (plans with more chunks may be faster), and the result's status
stays ``feasible`` unless the problem's own lower bound meets the plan.

**The complete family** (``extra["family"] = "all"``, :func:`complete`): after the k-chunk
scan, every allocation (any number of chunks, GPUs numbered by first use: the problem's GPUs
are identical) whose floor is below the plan's period is enumerated by a depth-first walk
pruned by the floor of the prefix placed so far (a lower bound of the floor of every
completion, :func:`allocation_floor`), and asked the same way at the period less
``min(chunk_step, PROOF_STEP)``. Before that listing, the **head pass** (stop 63,
:func:`head_pass`; ``extra["heads"]``, default true, ``extra["head_step"]``, default
:data:`HEAD_STEP`) refutes whole subtrees of the walk: for head lengths ``n // 2``,
``n // 2 + step``, ..., each head still open (the GPUs of units ``0 .. k - 1``) is asked
whether those units, the later ones kept as pure delays on GPUs of their own
(:func:`~optmem.models.pipeline.delay_tail`), have a plan at the cutoff; one that has none
removes every allocation extending it, and the walk lists only the others (stop 64,
``extra["head_floor"]``, default false: a head whose :func:`allocation_floor` on that
instance, :data:`HEAD_ROUNDS` rounds of the waits rows, is above the cutoff is refuted
without a question; stop 65, ``extra["head_contents"]``, default false: each GPU of a
refuted head is asked alone, :func:`refuted_contents`, and a GPU content refuted removes
every head and allocation that puts it on one GPU; the heads' questions run with
:data:`HEAD_PARAMETERS`). If none is
left undecided, ``report["complete_bound"]`` bounds every plan of the problem (1-periodic
patterns, as the exact model): the result is ``optimal``. It is asked only when at most
``extra["family_limit"]`` allocations (:data:`FAMILY_LIMIT`) are below the cutoff, and at
most that many heads at each length: a deterministic limit on the work. On the
bench_exact rows (4 GPUs, 12 GB/s) that proves ResNet-18 at 1.1x, 1.5x and 3x and
ResNet-50 at 1.1x (108.98, where the exact solve's 60 s plan is 119.82) optimal
(``benchmarks/results/pipeline_exact.md``, "Stop 56").

On ResNet-50 (21 units, 4 GPUs, 3 GiB, 12 GB/s), 1,534 two-chunk allocations have a floor
below 31.39 ms; each is decided in 0.3-17 s, and 31.39 (the exact solve's best plan) is the
family's optimum (``benchmarks/results/pipeline_exact.md``, "Chunk scan").
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import threading
import time
from collections import deque
from collections.abc import (
    Callable,
    Collection,
    Container,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import (
    BrokenExecutor,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
)
from dataclasses import dataclass, field, replace
from functools import partial

from optmem.engines.adapters import active_budget, carry_budget
from optmem.errors import OptmemInputError
from optmem.models.interrupt import Interrupted, poll, stop_when
from optmem.models.pipeline import Units, delay_tail, isolate_units, trim_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.options import choice, flag, fraction, positive_float, positive_int
from optmem.solvers.pipeline_common import (
    OPTIMALITY_TOLERANCE,
    lower_bound,
    refute,
    replayed_period,
    run_model,
)
from optmem.solvers.time_budget import Deadline, left_for_engine

MAX_CHUNKS = 2
"""Default ``extra["chunks"]``: chunks (runs of consecutive units) per GPU."""
CHUNK_WORK = 5.0
"""Default ``extra["chunk_work"]``: CP-SAT deterministic seconds per allocation (each run)."""
CHUNK_STEP = 1e-4
"""Default ``extra["chunk_step"]``: the cutoff is the incumbent's period times ``1 - step``."""
RETRY_WORK = 200.0
"""Default ``extra["chunk_retry_work"]``: CP-SAT deterministic seconds per allocation when the
allocations left undecided are asked once more at the final cutoff (at least ``chunk_work``).
40x the first pass: 4x left 4 of the headline's 1,534 allocations undecided, 40x none."""
LOOKAHEAD = 4
"""With ``w > 1`` workers, up to ``LOOKAHEAD * w`` questions are in flight (:class:`_Asker`)."""
MAX_ALLOCATIONS = 2_000_000
"""Enumeration stops after this many allocations (``report["chunks_truncated"]``)."""
FAMILIES = ("chunks", "all")
"""``extra["family"]``: the k-chunk family alone (default), or then every allocation."""
FAMILY_LIMIT = 20_000
"""Default ``extra["family_limit"]``: ``family="all"`` asks the complete family only when at
most this many allocations have a floor below the cutoff (a deterministic work limit)."""
PROOF_STEP = OPTIMALITY_TOLERANCE / 2
"""Largest relative step of the complete family's pass: its bound then meets the
optimality tolerance (:func:`~optmem.solvers.pipeline_common.proven`) up to the grid."""
FLOOR_ITERATIONS = 40
"""Bisection steps of :func:`allocation_floor` (relative precision about 1e-12)."""
BOUND_WORK = 1_000_000
"""Prefixes :func:`allocations_bound`'s walks may try in all (a deterministic work limit)."""
WAITS_WORK = 5_000
"""Interval DPs (:func:`waits_check`) :func:`allocations_bound` may run with ``waits`` (a
deterministic work limit; about 0.4-3 ms each on 14-21 units): past it the bisection goes
on with the floors alone. ResNet-18 at 3x: 31.90 with 2,000, 32.12 with 5,000 (3 s), its
optimum 32.15 with 21,662 (8 s); ResNet-50 at 3x gains nothing and 5,000 take 15 s."""
WAIT_ROUNDS = 2
"""Rounds of the waits floor where it is asked (``rounds=WAIT_ROUNDS`` in
:func:`allocation_floor`, :func:`within`, :func:`chunk_allocations`,
:func:`allocations_bound`; the scan's check before each question, :meth:`_Asker.waited`),
each from the previous round's floor. The walks of the method ``chunks`` keep ``rounds=0``:
a floor costs about 0.1 s per allocation on 21 units, 10-100 times the lifetimes floor,
which made ``allocations_bound`` on ResNet-50 at 1.5x run over 15 minutes
(``benchmarks/bench_pipeline_floor.py``); its ``waits`` option is the cheap form."""
TRIM_TAIL = 4
"""Default ``extra["trim_tail"]``: most units dropped from the end for a trimmed question
(:meth:`_Asker.send`, stop 62; then one fewer, down to 1): allocations that place units
``0 .. n - 1 - t`` alike share a question. On ResNet-50 at 1.5x the complete family's
11,934 allocations share 660 prefixes with 4 units dropped (1,023 with 3, 1,922 with 2, 184
with 8); the trimmed question refuted 7 of the first 8 allocations asked with 4 dropped,
none with 8."""
TRIM_SHARE = 2.5
"""A level of the trimmed questions is asked in a pass only when the pass's allocations are
at least this many per prefix of that level (:func:`trim_levels`). A prefix's question costs
about one full question (0.1-7 CPU s on ResNet-50): it pays when several allocations share
it. ResNet-50 at 1.5x: 1,269 two-chunk allocations, 252 / 288 / 433 / 613 prefixes with
4 / 3 / 2 / 1 units dropped (levels 4, 3, 2 asked); the headline's 1,517 have 766 / 911 /
1,017 / 1,181 (none asked: with all four it took 948 CPU s instead of 782)."""
HEAD_STEP = 1
"""Default ``extra["head_step"]``: :func:`head_pass` asks the heads of ``n // 2``,
``n // 2 + step``, ... units (below ``n``; :func:`head_depths`). On the headline (21
units) the delayed heads of 10 units refute 179 of 366, those of 12 (extending no refuted
one) 529 of 817, of 14 2,172 of 2,365 (stop 63, a step of 2: 2,925 CPU s for three
levels): a head asked at every length spares the questions of the children of the heads
it refutes."""
HEAD_ROUNDS = 4
"""Rounds of the waits floor :func:`head_pass` tries on each delayed head before its
question when ``extra["head_floor"]`` is true (stop 64; default false): a head whose
:func:`allocation_floor` (the relaxed instance of
:func:`~optmem.models.pipeline.delay_tail`, complete, so with the waits rows) is above the
cutoff is refuted without CP-SAT. On the headline at 31.3896, of the heads of 10 / 12 / 14
units the floor refutes 37 of 366 / 237 of 1,239 / 536 of 1,500 with 2 rounds (about
45 ms a head) and 62 / 350 / 675 with 4 (about 75 ms). In the method it refuted 794 of
the 4,336 heads asked but saved no time (5,471 CPU s against stop 63's 4,873, both under
load): the heads it refutes are those CP-SAT refutes fastest (0.36 s against 0.83 s at
14 units), and it costs every head its 75 ms. Off by default
(``benchmarks/results/pipeline_exact.md``, "Stop 64")."""
HEAD_PARAMETERS: dict[str, object] = {"use_precedences_in_disjunctive_constraint": False}
"""CP-SAT parameters of :func:`head_pass`'s questions (and :func:`refuted_contents`'):
without the precedences CP-SAT infers inside each no-overlap (disjunctive) constraint.
Measured on the headline's delayed heads at 31.3896 (stop 65, one worker, 5 deterministic
seconds, 40 random heads per length, each asked with both settings in alternating order):
CPU 26.3 -> 22.6 s for heads of 12 units, 26.5 -> 18.0 of 14, 47.7 -> 27.2 of 16, the
same answer for every head (``benchmarks/results/pipeline_exact.md``, "Stop 65"). The
scan's questions on whole allocations gain little (45.9 -> 45.4 s on 30 of the complete
family) and keep CP-SAT's defaults."""
HEAD_FIRST_SHARE = 0.2
"""Share of the work :func:`head_question` gives its first run (:data:`HEAD_PARAMETERS`)."""
HEAD_LAG = 16
"""Default ``lag`` of :func:`head_pass`: answers taken between a head's predecessor
``lag + 1`` places before it and the head's own check against the contents refuted (the
window of its threads: the same for any number of them, so the pass is too). Wide enough
that a slow question does not leave a thread idle (with 4, the pass at 2 threads used 1.6
CPUs of 2 on the headline)."""
HEAD_PROCESSES = True
"""Default ``extra["head_processes"]`` (stop 69): :func:`head_pass` asks its heads on worker
processes (forked, :func:`can_fork`) instead of threads where it can. A head question
spends about 36 ms of its ~0.24 s in Python (building and writing the model), which
threads run one at a time under the GIL; processes run it side by side. On 240 heads
captured from the headline's pass (4 blocks of 60, each asked by 2 threads and by 2
processes in alternating order): 20.5 s of wall time on threads, 19.3 s on processes
(0.95x), 1.72-1.94 CPUs busy against 1.89-1.97."""
CONTENT_WORK = 0.5
"""CP-SAT deterministic seconds for one GPU content of :func:`refuted_contents`. On the
headline most are answered in 0.05-0.1 CPU s; a few run to any cap given (5-9 s at 5)."""
STASH_FLOORS = True
"""Whether the exact model's questions of this module (:func:`_decide`, the scan's and the
complete family's; :func:`head_question`, the head pass's; the trimmed questions and
:func:`refuted_contents`) carry :func:`stash_floors`: rows giving CP-SAT the least stash
counts the waits rows prove at the cutoff (stop 66; valid inequalities: the same answers,
2-4x less CPU on the headline's heads). ``False`` asks the models as before (tests compare
both)."""
_EPS = 1e-9
_Key = tuple[int, tuple[int, ...]]
"""A prefix of :class:`_Asker`'s trimmed questions: units dropped, GPUs of the units kept."""


@dataclass(frozen=True)
class ChunkSettings:
    """The scan's ``extra`` options.

    ``chunks``, ``chunk_work``, ``chunk_step``, ``chunk_retry_work``, ``family``,
    ``family_limit``, ``waits`` (stop 59, default true: the waits rows,
    :func:`waits_check`, refute allocations before the exact model is asked and in
    :func:`allocations_bound`), ``trim``, ``trim_tail`` and ``trim_share`` (stop 62,
    default true, :data:`TRIM_TAIL` and :data:`TRIM_SHARE`: the trimmed questions of
    :class:`_Asker`; ``tail`` is 0 when off), ``heads`` and ``head_step`` (stop 63, default
    true and :data:`HEAD_STEP`: the complete family's :func:`head_pass`; ``head_step`` is 0
    when off), ``head_floor`` (stop 64, default false: the heads' floor rounds,
    :data:`HEAD_ROUNDS` when on, 0 when off), ``head_contents`` (stop 65, default false:
    :func:`refuted_contents` after each refuted head), ``head_processes`` (stop 69,
    default :data:`HEAD_PROCESSES`: the heads asked on worker processes where
    :func:`can_fork`), ``proof_gap`` (stop 70, default none: the complete family's pass
    proves a bound within this share of the plan instead of its optimality, :func:`complete`).
    """

    chunks: int
    work: float
    step: float
    retry: float = RETRY_WORK
    family: str = "chunks"
    limit: int = FAMILY_LIMIT
    waits: bool = True
    tail: int = TRIM_TAIL
    share: float = TRIM_SHARE
    head_step: int = HEAD_STEP
    """Units between the head lengths of :func:`head_pass` (0: no head pass)."""
    head_rounds: int = 0
    """Rounds of the floor :func:`head_pass` tries before each question (0: none)."""
    head_contents: bool = False
    """Whether :func:`head_pass` asks the GPUs of each refuted head alone (stop 65)."""
    head_processes: bool = HEAD_PROCESSES
    """Whether :func:`head_pass` may ask its heads on worker processes (stop 69)."""
    gap: float | None = None
    """``proof_gap``: the share below the plan the complete family's pass proves (stop 70)."""


def settings(options: SolveOptions) -> ChunkSettings:
    """The scan's settings (defaults :data:`MAX_CHUNKS`, :data:`CHUNK_WORK`, :data:`CHUNK_STEP`)."""
    chunks = positive_int(options, "chunks", MAX_CHUNKS)
    step = positive_float(options, "chunk_step", CHUNK_STEP)
    if step >= 1:
        raise OptmemInputError(f"expected a relative step below 1 for chunk_step, got {step!r}",
                               field="chunk_step")
    family = choice(options, "family", "chunks", FAMILIES)
    return ChunkSettings(chunks, positive_float(options, "chunk_work", CHUNK_WORK), step,
                         positive_float(options, "chunk_retry_work", RETRY_WORK), family,
                         positive_int(options, "family_limit", FAMILY_LIMIT),
                         flag(options, "waits", True),
                         positive_int(options, "trim_tail", TRIM_TAIL)
                         if flag(options, "trim", True) else 0,
                         positive_float(options, "trim_share", TRIM_SHARE),
                         positive_int(options, "head_step", HEAD_STEP)
                         if flag(options, "heads", True) else 0,
                         HEAD_ROUNDS if flag(options, "head_floor", False) else 0,
                         flag(options, "head_contents", False),
                         flag(options, "head_processes", HEAD_PROCESSES),
                         _proof_gap(options, family))


def _proof_gap(options: SolveOptions, family: str) -> float | None:
    """``extra["proof_gap"]``: a share in (0, 1), only with ``family="all"`` (its pass)."""
    gap = fraction(options, "proof_gap")
    if gap is not None and family != "all":
        raise OptmemInputError("proof_gap sets the complete family's proof: give it with "
                               "family=all", field="proof_gap")
    return gap


# ------------------------------------------------------------------ enumeration
def chunk_allocations(units: Units, n_gpus: int, chunks: int, cap: float,
                      memory: int | None = None, stats: dict[str, int] | None = None,
                      rounds: int = 0, depth: int | None = None,
                      skip: Container[tuple[int, ...]] = ()) -> Iterator[tuple[int, ...]]:
    """Allocations with at most ``chunks`` chunks per GPU and a floor of at most ``cap``.

    GPUs are numbered by first use (each allocation once; the GPUs of a problem are
    identical: one memory, one bandwidth for every pair); GPUs may stay unused. A
    depth-first walk over the units in order, pruned by the loads (what is left must fit
    under ``cap`` on the GPUs) and by the floor of the prefix (:func:`within`: its GPU and
    link loads and, with ``memory``, its lifetime copies at ``cap``), which never exceeds
    the floor of any completion. Without ``memory`` every allocation whose GPU and link
    loads are at most ``cap`` is listed; with it, exactly those whose
    :func:`allocation_floor` is finite at ``cap``. ``stats`` (if given) counts the
    prefixes tried (``tried``), cut by the loads (``load``) and by the partial floor
    (``floor``). ``rounds > 0``: complete allocations must also pass the waits floor with
    that many rounds (:func:`within`; prefixes keep the lifetimes floor, so the pruning
    stays valid).

    ``skip``: prefixes (of any length) whose allocations are not listed (those refuted by
    :func:`head_pass`). ``depth``: list the prefixes of units ``0 .. depth - 1`` of the
    allocations that would be listed instead (each once, as soon as one completion is
    found), in the same order.
    """
    tally = {"tried": 0, "load": 0, "floor": 0} if stats is None else stats
    for key in ("tried", "load", "floor"):
        tally.setdefault(key, 0)
    n = units.n
    stop = n if depth is None else depth
    load = [units.load(q) for q in range(n)]
    left = [0.0] * (n + 1)
    for q in range(n - 1, -1, -1):
        left[q] = left[q + 1] + load[q]
    loads = [0.0] * n_gpus
    count = [0] * n_gpus
    gpu: list[int] = []

    def walk(q: int, used: int, end: int) -> Generator[tuple[int, ...], None, None]:
        if q == end:
            if end == n or completes(q, used):
                yield tuple(gpu)
            return
        last = gpu[-1] if gpu else -1
        for g in range(min(used + 1, n_gpus)):
            if g != last and count[g] >= chunks:
                continue
            tally["tried"] += 1
            poll()  # a caller's deadline (optmem.models.interrupt; ranked)
            if loads[g] + load[q] > cap * (1 + _EPS):
                tally["load"] += 1
                continue
            loads[g] += load[q]
            count[g] += g != last
            gpu.append(g)
            try:
                room = sum(max(0.0, cap - x) for x in loads[:max(used, g + 1)]) \
                    + cap * (n_gpus - max(used, g + 1))
                if skip and tuple(gpu) in skip:
                    pass
                elif room < left[q + 1] * (1 - _EPS):
                    tally["load"] += 1
                elif not within(units, gpu, n_gpus, memory, cap, rounds):
                    tally["floor"] += 1
                else:
                    yield from walk(q + 1, max(used, g + 1), end)
            finally:  # also when a completion check stops its walk early
                gpu.pop()
                count[g] -= g != last
                loads[g] -= load[q]

    def completes(q: int, used: int) -> bool:
        inner = walk(q, used, n)
        try:
            return next(inner, None) is not None
        finally:
            inner.close()  # its finally clauses restore the state it changed

    yield from walk(0, 0, stop)


# ------------------------------------------------------------------ the floor
def _paths(units: Units, gpu: Sequence[int]) -> tuple[list[float], list[float]]:
    """``D_q`` (``F_q`` to the end of ``B_q``, cut transfers included) and backward prefixes.

    ``back[q] - back[r]`` (``r < q``) is the time from the end of ``B_q`` to the end of
    ``B_r`` along the micro-batch's path (backwards ``r..q-1`` and the gradients of the cuts
    between them). ``gpu`` may be a prefix (units ``0..m-1`` placed): ``D_q`` then counts
    the loads of every unit but only the transfers of the cuts placed (``c < m - 1``), a
    lower bound of its value in any completion; ``back`` is exact for ``r < q < m``.
    """
    n, m = units.n, len(gpu)
    cut = [gpu[c] != gpu[c + 1] for c in range(m - 1)]
    down = [0.0] * m
    acc = sum(units.load(q) for q in range(m, n))
    for q in range(m - 1, -1, -1):
        acc += units.load(q) + (2 * units.dt[q] if q < m - 1 and cut[q] else 0.0)
        down[q] = acc
    back = [0.0] * (m + 1)
    for s in range(m):
        back[s + 1] = back[s] + units.b[s] + (units.dt[s] if s < m - 1 and cut[s] else 0.0)
    return down, back


def _statics(units: Units, gpu: Sequence[int], n_gpus: int) -> list[int]:
    """Weights and cut buffers per GPU (of the units and cuts placed, for a prefix)."""
    static = [0] * n_gpus
    for q in range(len(gpu)):
        static[gpu[q]] += units.w[q]
    for c in range(len(gpu) - 1):
        if gpu[c] != gpu[c + 1]:
            static[gpu[c]] += units.buf[c]
            static[gpu[c + 1]] += units.buf[c]
    return static


def memory_check(units: Units, gpu: Sequence[int], n_gpus: int, memory: int
                 ) -> Callable[[float], bool]:
    """:func:`memory_fits` of one allocation as a function of the period.

    The paths, static memory and GPU members do not depend on the period: they are computed
    once here, so that a bisection over the period (:func:`allocation_floor`) pays only for
    the copy counts. For a prefix ``gpu`` (units ``0..m-1`` placed) it checks the rows of
    the units placed, with the terms of the units placed and the lower bounds of
    :func:`_paths`: every term is at most its value in any completion, so a prefix that
    fails at a period fails in every completion (:func:`allocation_floor`).
    """
    down, back = _paths(units, gpu)
    static = _statics(units, gpu, n_gpus)
    on = [[q for q in range(len(gpu)) if gpu[q] == g] for g in range(n_gpus)]

    def fits(period: float) -> bool:
        def copies(d: float) -> int:
            return math.ceil(d / period - _EPS)

        for g, qs in enumerate(on):
            for q in qs:
                need = static[g] + units.x[q] * copies(down[q])
                for r in qs:
                    if r < q:
                        need += units.x[r] * copies(down[q] + back[q] - back[r])
                    elif r > q:
                        need += units.x[r] * max(0, copies(down[r]) - 1)
                if need > memory:
                    return False
        return True

    return fits


def memory_fits(units: Units, gpu: Sequence[int], n_gpus: int, memory: int, period: float
                ) -> bool:
    """Whether the lifetime copies at ``period`` fit the memory when each forward starts.

    The stash model's rows of :func:`~optmem.models.pipeline.build_relaxation` (no window
    arcs) with the allocation fixed: a necessary condition for a plan of this allocation with
    that period.
    """
    return memory_check(units, gpu, n_gpus, memory)(period)


def _load_floor(units: Units, gpu: Sequence[int], n_gpus: int) -> float:
    """The largest GPU load and link load (two transfers per cut) of ``gpu`` (or a prefix)."""
    loads = [0.0] * n_gpus
    for q in range(len(gpu)):
        loads[gpu[q]] += units.load(q)
    links: dict[tuple[int, int], float] = {}
    for c in range(len(gpu) - 1):
        if gpu[c] != gpu[c + 1]:
            key = (min(gpu[c], gpu[c + 1]), max(gpu[c], gpu[c + 1]))
            links[key] = links.get(key, 0.0) + 2 * units.dt[c]
    return max([*loads, *links.values()])



def _old_floor(units: Units, gpu: Sequence[int], n_gpus: int, memory: int | None,
               cap: float) -> float:
    """The loads-and-lifetimes floor (before stop 57's waits; see :func:`allocation_floor`)."""
    low = _load_floor(units, gpu, n_gpus)
    if low > cap * (1 + _EPS):
        return math.inf
    if memory is None:
        return low
    fits = memory_check(units, gpu, n_gpus, memory)
    if fits(low):
        return low
    if not fits(cap):
        return math.inf
    return _bisect(fits, low, cap)


def _bisect(fits: Callable[[float], bool], low: float, high: float) -> float:
    """The failing end after :data:`FLOOR_ITERATIONS` halvings of ``[low, high]``.

    ``fits`` must fail at ``low``, pass at ``high`` and only pass more as its argument grows
    (memory rows relax as the period grows): the answer is at most the least passing value.
    """
    for _ in range(FLOOR_ITERATIONS):
        mid = (low + high) / 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return low


def _lift(delay: float, first: float, second: float, low: float, period: float) -> float:
    """The least delay ``>= delay`` between two ops of one resource, for periods in a range.

    The plans considered have a period ``T`` in ``[low, period]``. Ops ``a`` (duration
    ``first``) and ``b`` (``second``) of one GPU (or transfers of one link), ``b`` after
    ``a`` on the micro-batch's path, do not overlap modulo ``T``: ``t_b - t_a`` avoids every open
    window ``(kT - second, kT + first)`` (``k >= 1``; ``k = 0`` is ``t_b - t_a < first``,
    already excluded by the path). For every ``T`` in ``[low, period]`` that window holds
    ``(k period - second, k low + first)``, so a delay inside the latter is infeasible for
    every such ``T``. The least delay ``>= delay`` outside all of them is returned (windows
    are empty once ``k (period - low) >= first + second``). It only grows with ``delay``
    and ``low`` and only shrinks as ``period`` grows.

    No plan has a period in the range when ``low > period`` (a question at a cutoff below
    a proven bound) or ``first + second > period`` (the two ops overlap modulo any period
    of the range): then every value is a bound and ``delay`` is returned. The windows there
    need not empty, and the loop ran until float rounding ended it (a hunt, stop 79:
    ``_lift(1, 1, 1, 2, 1.999999)`` took 19 s and returned 1.8e16, outside any time limit);
    otherwise at most one window is left (each one ends before the next one opens).
    """
    if period <= 0 or low > period or first + second > period:
        return delay
    while True:
        k = math.floor((delay + second) / period)
        moved = False
        for j in (k, k - 1):  # the latest window that opens below ``delay``
            if j >= 1 and j * period - second < delay < j * low + first:
                delay = j * low + first
                moved = True
                break
        if not moved:
            return delay


def _path_ops(units: Units, gpu: Sequence[int], n_gpus: int
              ) -> tuple[list[int], list[float], list[int], list[int]]:
    """The micro-batch's path ``F_0 -> S_0 -> F_1 -> ... -> B_{n-1} -> G_{n-2} -> ... -> B_0``.

    Returns each op's resource (the GPU, or ``n_gpus`` plus an id of the unordered GPU pair
    for a transfer, present only over a cut: the link it occupies), its duration (also the
    least delay from its start to the next op's, the shift rows (6.23)-(6.30)), and the
    positions of ``F_q`` and of ``B_q``.
    """
    n = units.n
    where: list[int] = []
    dur: list[float] = []
    fpos = [0] * n
    bpos = [0] * n

    def link(c: int) -> None:
        if gpu[c] != gpu[c + 1]:
            lo, hi = sorted((gpu[c], gpu[c + 1]))
            where.append(n_gpus + lo * n_gpus + hi)
            dur.append(units.dt[c])

    for q in range(n):
        fpos[q] = len(where)
        where.append(gpu[q])
        dur.append(units.f[q])
        if q < n - 1:
            link(q)
    for q in range(n - 1, -1, -1):
        bpos[q] = len(where)
        where.append(gpu[q])
        dur.append(units.b[q])
        if q > 0:
            link(q - 1)
    return where, dur, fpos, bpos


def _waited_delays(where: Sequence[int], dur: Sequence[float], low: float, period: float
                   ) -> list[list[float]]:
    """``L[i][j]``: a lower bound of ``t_j - t_i`` (path positions ``i <= j``).

    It holds in every plan of period in ``[low, period]``.

    Proof by induction on ``j - i``: ``t_j - t_i = (t_{j-1} - t_i) + (t_j - t_{j-1})`` with
    ``t_j - t_{j-1} >= dur[j-1]`` (path precedence); for ``i < k < j``,
    ``t_j - t_i = (t_k - t_i) + (t_j - t_k)``; and when ``i`` and ``j`` use one resource
    (a GPU, or a link: its transfers do not overlap modulo the period either, (6.5)-(6.16)),
    ``t_j - t_i`` is a delay that :func:`_lift` allows and is at least the bound so far, so
    at least its lift (the least allowed delay above it). Each bound only grows with
    ``low`` and shrinks as ``period`` grows (:func:`_lift`, sums and maxima).
    """
    size = len(where)
    same = [[k for k in range(j) if where[k] == where[j]] for j in range(size)]
    lb = [[0.0] * size for _ in range(size)]
    for j in range(1, size):
        for i in range(j - 1, -1, -1):
            value = lb[i][j - 1] + dur[j - 1]
            for k in same[j]:
                if k > i:
                    value = max(value, lb[i][k] + lb[k][j])
            if where[i] == where[j]:
                value = _lift(value, dur[i], dur[j], low, period)
            lb[i][j] = value
    return lb


def waits_check(units: Units, gpu: Sequence[int], n_gpus: int, memory: int, low: float
                ) -> Callable[[float], bool]:
    """Whether a complete allocation may have a plan of period in ``[low, c]`` (as ``c -> bool``).

    :func:`memory_check`'s rows (each forward start: the static memory, ``ceil(D / c)``
    copies of the unit's own stash, ``ceil(D(q -> r) / c)`` of each lower unit of the GPU,
    ``ceil(D_r / c) - 1`` of each higher one), with every path length ``D`` taken from
    :func:`_waited_delays` (the start of ``F_q`` to the start of ``B_r``, plus ``b_r``)
    instead of the path's least length: the waits that non-overlap modulo the period forces
    between the ops of one GPU and between the transfers of one link. ``low`` must be a
    lower bound of the period of every plan of the allocation (e.g. :func:`_old_floor`).

    Validity: in a plan of period ``T`` in ``[low, c]``, each lifetime is at least its bound
    (:func:`_waited_delays`, as ``T`` lies in the interval), the copies alive when a forward
    starts are at least :func:`memory_check`'s counts at ``T`` of the actual lifetimes, so
    at least those at ``T`` of the bounds, and at ``c = T`` the row is exactly this one:
    ``check(T)`` holds for every plan's period ``T``. Monotone: as ``c`` grows each bound
    and each ``ceil(D / c)`` only shrinks, so a ``c`` that passes makes every larger one
    pass (a bisection on ``c`` is exact up to its precision).
    """
    n = units.n
    where, dur, fpos, bpos = _path_ops(units, gpu, n_gpus)
    static = _statics(units, gpu, n_gpus)
    on = [[q for q in range(n) if gpu[q] == g] for g in range(n_gpus)]

    def fits(period: float) -> bool:
        copies = _waited_copies(units, _waited_delays(where, dur, low, period), fpos, bpos,
                                period)
        for g, qs in enumerate(on):
            for q in qs:
                need = static[g] + sum(units.x[r] * c for r, c in _row_counts(qs, q, copies))
                if need > memory:
                    return False
        return True

    return fits


def _waited_copies(units: Units, lb: list[list[float]], fpos: Sequence[int],
                   bpos: Sequence[int], period: float) -> Callable[[int, int], int]:
    """``copies(q, r)``: ``ceil(D / period)``, ``D`` the waited delay from ``F_q`` to ``B_r``."""
    def copies(q: int, r: int) -> int:
        return math.ceil((lb[fpos[q]][bpos[r]] + units.b[r]) / period - _EPS)

    return copies


def _row_counts(qs: Sequence[int], q: int, copies: Callable[[int, int], int]
                ) -> Iterator[tuple[int, int]]:
    """``(r, stashes of r alive when F_q starts)`` for the units ``qs`` of ``q``'s GPU.

    :func:`memory_check`'s counts: ``copies(q, q)`` of its own (the new copy included),
    ``copies(q, r)`` of a lower unit (``F_q`` to the end of ``B_r``), ``copies(r, r) - 1``
    (at least 0) of a higher one.
    """
    for r in qs:
        yield r, copies(q, r) if r <= q else max(0, copies(r, r) - 1)


def stash_floors(units: Units, gpu: Sequence[int], n_gpus: int, memory: int | None,
                 low: float, cap: float) -> dict[tuple[int, int], int]:
    """Least stash counts of every plan of allocation ``gpu`` with a period in ``[low, cap]``.

    ``{(r, q): k}`` for ``r`` and ``q`` on one GPU, ``r`` with a stash: in every such plan
    at least ``k > 0`` micro-batches' stashes of unit ``r`` are alive when ``F_q`` starts
    (``r == q``: its own new copy included), the rows
    :func:`~optmem.models.pipeline.build_pipeline_model` adds as ``stash_floors`` (stop
    66). ``{}`` without a memory limit (``memory`` is ``None``: no memory rows to help).

    The counts are :func:`waits_check`'s at ``cap``, from ``L = max(low, old floor)``
    (:func:`_old_floor` at ``cap``, when finite: no plan of the allocation is below it).
    Validity: in a plan of period ``T`` in ``[L, cap]``, the time from ``F_q``'s start to
    ``B_r``'s end is at least its waited bound ``D`` (:func:`_waited_delays`: ``T`` lies
    in the interval), and the stashes of ``r`` alive then are at least ``ceil(D / T)``
    (``r <= q``) or ``ceil(D_r / T) - 1`` (``r > q``; :func:`memory_check`'s proof), which
    are at least the same at ``cap >= T``. A plan with a period below ``L`` has none.

    On the headline's heads (21 units, 4 GPUs, 3 GiB, 31.3896; 30 heads drawn per length,
    one CP-SAT worker, ``benchmarks/bench_pipeline_stash_floors.py``) the rows cut a head
    question's CPU to 0.20x at 10 units, 0.30x at 12, 0.48x at 14 and 0.36x at 16, with
    the same answers, and the headline's proof from 3,942 to 1,519 CPU s
    (``benchmarks/results/pipeline_exact.md``, "Stop 66"): CP-SAT's own propagation
    through the shifts' conditional rows does not find these counts.
    """
    if memory is None:
        return {}
    old = _old_floor(units, gpu, n_gpus, memory, cap)
    start = max(low, old) if math.isfinite(old) else low
    where, dur, fpos, bpos = _path_ops(units, gpu, n_gpus)
    copies = _waited_copies(units, _waited_delays(where, dur, start, cap), fpos, bpos, cap)
    floors: dict[tuple[int, int], int] = {}
    for g in range(n_gpus):
        qs = [q for q in range(units.n) if gpu[q] == g]
        for q in qs:
            for r, count in _row_counts(qs, q, copies):
                if count > 0 and units.x[r]:
                    floors[(r, q)] = count
    return floors


def within(units: Units, gpu: Sequence[int], n_gpus: int, memory: int | None, cap: float,
           rounds: int = 0) -> bool:
    """Whether :func:`allocation_floor` of ``gpu`` (or of a prefix) is finite at ``cap``.

    A prefix: its loads and lifetime rows (:func:`memory_check`); a complete allocation
    with ``rounds > 0``: also the waits rows (its :func:`allocation_floor` with those rounds
    is at most ``cap``).
    """
    if _load_floor(units, gpu, n_gpus) > cap * (1 + _EPS):
        return False
    if memory is None:
        return True
    if len(gpu) < units.n or rounds <= 0:
        return memory_check(units, gpu, n_gpus, memory)(cap)
    low = _old_floor(units, gpu, n_gpus, memory, cap)
    return low < math.inf and _waits_floor(units, gpu, n_gpus, memory, low, cap, rounds,
                                           settle=False) < math.inf


def allocation_floor(units: Units, gpu: Sequence[int], n_gpus: int, memory: int | None,
                     cap: float, rounds: int = 0) -> float:
    """A lower bound of the period of every plan with allocation ``gpu`` (``inf``: above ``cap``).

    ``max`` of the GPU loads, the link loads (two transfers per cut) and, with ``memory``
    (stash model; ``None`` skips it), the least period at which :func:`memory_fits` holds,
    found by bisection between the loads and ``cap`` (the *old floor*, :func:`_old_floor`).
    For a complete allocation with ``memory`` and ``rounds > 0`` (stop 57; at most
    ``rounds`` rounds, :data:`WAIT_ROUNDS` where asked), then the least ``c`` at or above
    the old floor ``L`` at which :func:`waits_check` (from ``L``) passes, by bisection up
    to ``cap``: no plan has a period in ``[L, c)`` when the check fails at ``c``, and none
    has one below ``L``. Valid: at a plan's period ``T`` the check from ``L <= T`` passes
    (:func:`waits_check`), so the least passing ``c`` is at most ``T``; the check only
    relaxes as ``c`` grows, so the bisection finds that least ``c`` (up to its precision,
    returning the failing end). That ``c`` is again a lower bound of every plan's period:
    the next round (``rounds`` in all, stopping when one gains nothing) checks
    from it, with wider windows (:func:`_lift`). The waits rows dominate the lifetime rows
    (each waited delay is at least the path's), so this floor is never below the old one.

    ``gpu`` may be a prefix (units ``0..m-1`` placed; the *partial floor*): then it is at
    most the floor of every completion, and it only grows as units are added. Proof: a GPU
    load and a link load are sums of non-negative terms over the units and cuts placed,
    and placing a unit only adds terms. In each memory row (:func:`memory_check`) the
    static memory (weights and buffers of the units and cuts placed) only grows; ``D_q``
    counts every unit's load but only the placed cuts' transfers (a later cut only adds
    ``2 dt``), so it only grows, and with it each copy count ``ceil(D / T)`` (the paths
    ``back[q] - back[r]``, ``r < q``, lie between placed units: exact); a unit placed later
    only adds a row (its own) and a non-negative term ``x_r (ceil(D_r / T) - 1)^+`` to the
    rows of the earlier units of its GPU. So every row of a prefix is at most the same row
    in any completion, which has more rows: whatever period a completion's rows pass, the
    prefix's rows pass, and the least such period (the bisection's answer, up to its
    precision) cannot be larger for the prefix. The waits rows apply to complete
    allocations only: a prefix's floor (old) is at most the old floor of any completion,
    at most its floor.
    """
    low = _old_floor(units, gpu, n_gpus, memory, cap)
    if memory is None or low == math.inf or len(gpu) < units.n:
        return low
    return _waits_floor(units, gpu, n_gpus, memory, low, cap, rounds)


def _waits_floor(units: Units, gpu: Sequence[int], n_gpus: int, memory: int, low: float,
                 cap: float, rounds: int, settle: bool = True) -> float:
    """:func:`allocation_floor`'s rounds of the waits rows from the old floor ``low``.

    ``settle=False`` (:func:`within`, stop 69) skips the last round's bisection and
    returns ``max(low, cap)`` when that round's check passes at ``cap``: whether the floor
    is finite is decided by that check alone (a check passing at ``low`` passes at ``cap``
    too), so the answer is finite exactly when :func:`allocation_floor`'s is, at some 40
    interval DPs less for an allocation that passes.
    """
    for done in range(1, rounds + 1):
        waits = waits_check(units, gpu, n_gpus, memory, low)
        last = done == rounds and not settle
        if not last and waits(low):
            return low
        high = max(low, cap)
        if not waits(high):
            return math.inf
        if last:
            return high
        start, low = low, _bisect(waits, low, high)
        if low <= start * (1 + _EPS):
            break
    return low


def allocations_bound(units: Units, n_gpus: int, memory: int | None, low: float, cap: float,
                      decided: Mapping[tuple[int, ...], float] | None = None,
                      work: int = BOUND_WORK, rounds: int = 0, waits: bool = False,
                      waits_work: int = WAITS_WORK,
                      heads: Heads | None = None, deadline: float | None = None) -> float:
    """A lower bound of every plan of the problem: the least bound over all allocations.

    Every plan (a 1-periodic pattern, as the exact model) has an allocation of the units
    to GPUs, equal up to renumbering the GPUs (they are identical) to one numbered by first
    use, whose period is at least its :func:`allocation_floor` and, if it was asked,
    at least what the exact model proved for it (``decided``, :attr:`Scan.decided`: its
    refutation cutoff or its optimum, less the grid). So the least of
    ``max(floor, decided)`` over all allocations bounds every plan: a branch and bound
    over allocations whose leaves are bounded, not solved. It is found by bisection on
    ``c`` between ``low`` (a bound known to hold, e.g. the load bound) and ``cap``: some
    allocation has a bound at most ``c`` iff :func:`chunk_allocations` (no chunk limit)
    lists, at ``c``, one that is not decided above ``c`` (its floor is finite at ``c``
    exactly when every prefix passes :func:`within` at ``c``, as memory rows only relax
    when the period grows). Returns ``cap`` when no allocation has a bound below it.

    ``work`` caps the prefixes the walks try in all (deterministic); the bisection then
    stops, and the largest ``c`` proven so far is returned: each step that finds no
    allocation proves its ``c``, so a partial bisection is still a bound. ``rounds > 0``
    bounds each complete allocation by the waits floor too (:func:`allocation_floor`).

    ``waits`` (stop 59, what the method ``chunks`` asks; cheaper than ``rounds``): a
    complete allocation listed at ``c`` is also asked :func:`waits_check` from the bound
    the bisection has proven so far (``L``: no plan of *any* allocation is below it, so it
    is a lower bound of this one's) at ``c``, one interval DP; when that fails, no plan of
    the allocation has a period in ``[L, c]`` (:func:`waits_check`: the check passes at
    every plan's period in ``[L, c]`` and only relaxes as ``c`` grows), so none at most
    ``c``, and the allocation is not counted (nor asked again at a lower ``c``: a proven
    bound is kept per allocation). The rounds of :func:`allocation_floor` happen through
    the bisection itself: each step that finds no allocation raises ``L``, and the windows
    of the next steps widen with it. At most ``waits_work`` DPs are run (deterministic);
    the steps after that ask the floors alone (each step's answer stays a proof).

    ``heads`` (:func:`head_pass`): a head (or GPU content, :attr:`Heads.contents`) refuted
    with bound ``b`` bounds every allocation extending it (putting it on a GPU) by ``b``; a
    step at ``c < b`` skips them all (:func:`chunk_allocations`, :meth:`Heads.skip`).

    ``deadline`` (``time.perf_counter()`` value; stop 71): a walk that reaches it stops as
    ``work`` stops it, the bisection keeping what it proved (``low`` if nothing). Without
    it a 60 s solve of ResNet-50 at 3x ran 21 s past its limit here, for no gain.
    """
    done = {} if decided is None else decided
    stats: dict[str, int] = {"tried": 0}
    proven = {"low": low}
    beyond: dict[tuple[int, ...], float] = {}  # allocation -> c at which the waits refuted it

    def refuted(gpu: tuple[int, ...], c: float) -> bool:
        if not waits or memory is None:
            return False
        if beyond.get(gpu, -math.inf) >= c:
            return True
        if stats.setdefault("waits", 0) >= waits_work:
            return False
        stats["waits"] += 1
        if waits_check(units, gpu, n_gpus, memory, proven["low"])(c):
            return False
        beyond[gpu] = c
        return True

    def some_below(c: float) -> bool | None:
        skip = heads.skip(c) if heads is not None else ()
        try:  # the walk itself polls the deadline (stop 74: 8.4 s past it at L = 68)
            with stop_when(Deadline(deadline, time.perf_counter).stopper()):
                for gpu in chunk_allocations(units, n_gpus, units.n, c, memory, stats,
                                             rounds, skip=skip):
                    if stats["tried"] > work or passed(deadline):
                        return None
                    if done.get(gpu, -math.inf) <= c * (1 + _EPS) and not refuted(gpu, c):
                        return True
        except Interrupted:
            return None  # a walk cut short proves nothing at c
        if stats["tried"] > work:
            return None
        proven["low"] = max(proven["low"], c)
        return False

    if low >= cap:
        return cap
    hit = some_below(cap)
    if hit is not False:
        return low if hit is None else _bisect_bound(some_below, low, cap)
    return cap


def _bisect_bound(some_below: Callable[[float], bool | None], low: float, high: float
                  ) -> float:
    """The largest ``c`` in ``[low, high)`` found with ``some_below(c)`` False (else ``low``)."""
    for _ in range(FLOOR_ITERATIONS):
        if high - low <= _EPS * high:
            break
        mid = (low + high) / 2
        hit = some_below(mid)
        if hit is None:
            break
        if hit:
            high = mid
        else:
            low = mid
    return low


# ------------------------------------------------------------------ the scan
@dataclass
class Scan:
    """Outcome of :func:`scan`: the best plan and what the pass decided.

    ``family``: allocations with a floor below the first cutoff; ``refuted``: decided
    without a plan below the cutoff then in force; ``undecided``: stopped by the work limit
    (or an engine failure, also counted in ``failed``); ``skipped``: whose floor reached a
    lowered cutoff; ``waited``: refuted by the waits rows before the exact model was asked
    (:meth:`_Asker.run`, counted in ``refuted`` too); ``trimmed``: refuted by a trimmed
    question (:meth:`_Asker.send`: its own, or one asked for an allocation with the same
    prefix; counted in ``refuted`` too), of ``trim_questions`` asked; ``bound``: every
    plan of the family has at least this period (``nan`` unless the pass ended with none
    undecided and none truncated); ``found_at``: the
    evaluation (1-based) that found each of ``improvements``; ``decided``: for each
    allocation asked and refuted, or solved to its optimum, a lower bound of its plans'
    periods proven by the exact model (the cutoff, or its optimum, less two steps of
    CP-SAT's grid), which :func:`allocations_bound` takes over the floor.
    """

    period: float
    plan: PipelinePlan | None
    family: int = 0
    evaluated: int = 0
    refuted: int = 0
    undecided: int = 0
    failed: int = 0
    skipped: int = 0
    waited: int = 0
    trimmed: int = 0
    trim_questions: int = 0
    truncated: bool = False
    stopped: str = "done"
    bound: float = math.nan
    improvements: list[float] = field(default_factory=list)
    found_at: list[int] = field(default_factory=list)
    decided: dict[tuple[int, ...], float] = field(default_factory=dict)

    def report(self, prefix: str = "chunks") -> dict[str, object]:
        """Report keys (``chunks_*``; ``complete_*`` for the complete family)."""
        keys: dict[str, object] = {
            "family": self.family, "evaluated": self.evaluated, "refuted": self.refuted,
            "undecided": self.undecided, "failed": self.failed, "skipped": self.skipped,
            "waited": self.waited, "trimmed": self.trimmed,
            "trim_questions": self.trim_questions,
            "truncated": self.truncated, "stopped": self.stopped,
            "bound": None if math.isnan(self.bound) else self.bound,
            "improvements": list(self.improvements), "found_at": list(self.found_at)}
        return {f"{prefix}_{key}": value for key, value in keys.items()}


def floor_memory(problem: PipelineProblem) -> int | None:
    """The memory the floors check (stash model), ``None`` (loads only) for the strict one."""
    return problem.memory_per_gpu if problem.memory_model == "stash" else None


def ranked(problem: PipelineProblem, units: Units, chunks: int, cap: float,
           limit: int = MAX_ALLOCATIONS, skip: Container[tuple[int, ...]] = (),
           deadline: float | None = None
           ) -> tuple[list[tuple[float, tuple[int, ...]]], bool]:
    """The family's allocations with a floor below ``cap``, by floor; and whether truncated.

    The enumeration stops after ``limit`` allocations, or once ``deadline`` (a
    :func:`time.perf_counter` instant) has passed (then ``truncated``: the list proves
    nothing about the family); allocations extending a head of ``skip`` are left out
    (:func:`chunk_allocations`). Why the deadline: on ResNet-101 (L = 39, 4 GPUs, 3 GiB,
    12 GB/s) the enumeration and its floors ran 113 s under ``--time-limit 10`` (stop 74).
    """
    memory = floor_memory(problem)
    found: list[tuple[float, tuple[int, ...]]] = []
    truncated = False
    with stop_when(Deadline(deadline, time.perf_counter).stopper()):
        try:  # the walk polls too: at L = 339 it ran 53 s before its first allocation
            for k, gpu in enumerate(chunk_allocations(units, problem.n_gpus, chunks, cap,
                                                      memory, skip=skip)):
                if k >= limit or passed(deadline):
                    truncated = True
                    break
                floor = allocation_floor(units, gpu, problem.n_gpus, memory, cap)
                if floor < cap * (1 + _EPS):
                    found.append((floor, gpu))
        except Interrupted:
            truncated = True
    found.sort()
    return found, truncated


def scan(problem: PipelineProblem, units: Units, period: float, plan: PipelinePlan | None, *,
         chunks: int, work: float, step: float, seed: int = 0,
         deadline: float | None = None, workers: int = 1,
         retry: float = RETRY_WORK, waits: bool = False, tail: int = 0,
         share: float = TRIM_SHARE) -> Scan:
    """Improve ``plan`` (period ``period``; ``inf`` and ``None`` without one) over the family.

    One pass by increasing :func:`allocation_floor`; see the module docstring. An allocation
    that gives a better plan is asked again at the lowered cutoff until it is refuted there,
    its polished plan is proven optimal for it, or it is undecided. The allocations left
    undecided are asked once more at the final cutoff with ``max(retry, work)``
    deterministic seconds each (a cutoff lowered since their first run is often decided at
    once; the others need more work).

    ``workers`` allocations are asked at once (threads; CP-SAT runs outside the GIL), each
    at the cutoff in force a fixed number of answers earlier, the answers taken in the
    scan's order (:class:`_Asker`): the same answers for the same ``workers`` on any
    machine, as each question is deterministic. Under a work budget
    (``SolveOptions.work_budget``) one allocation is asked at a time: what each question
    in flight would be granted of the budget depends on when it starts. ``waits``: an
    allocation the waits rows refute at the cutoff is not asked (:meth:`_Asker.run`).
    ``tail > 0``: the trimmed questions (:meth:`_Asker.send`) from that many units
    dropped, at the levels :func:`trim_levels` keeps (``share``).
    """
    cap = period if math.isfinite(period) else units.big_m()
    family, truncated = ranked(problem, units, chunks, cap, deadline=deadline)
    return ask_family(problem, units, period, plan, family, work=work, step=step, seed=seed,
                      deadline=deadline, workers=workers, retry=retry, truncated=truncated,
                      waits=waits, tail=tail, share=share)


def complete(problem: PipelineProblem, units: Units, first: Scan, *, limit: int,
             work: float, step: float, seed: int = 0, deadline: float | None = None,
             workers: int = 1, retry: float = RETRY_WORK, waits: bool = False,
             tail: int = 0, share: float = TRIM_SHARE, heads: Sequence[int] = (),
             head_rounds: int = 0, head_contents: bool = False,
             head_processes: bool = False, gap: float | None = None) -> tuple[Scan, Heads]:
    """Every allocation (any chunk count) with a floor below ``first``'s period, asked.

    The complete family (``extra["family"] = "all"``): the allocations of the units with
    GPUs numbered by first use (the GPUs are identical) whose :func:`allocation_floor` is
    below ``first.period`` (the k-chunk scan's plan; :data:`Units.big_m` without one),
    enumerated by :func:`chunk_allocations` with no chunk limit (pruned by the partial
    floor), asked by :func:`ask_family` at the period less ``min(step, PROOF_STEP)``.
    ``heads`` (stop 63): :func:`head_pass` first refutes whole subtrees at that cutoff
    (heads of those lengths, the later units delayed), and only the allocations extending
    no refuted head are listed and asked (``head_rounds``: the pass's floor, stop 64;
    ``head_contents``: its GPU contents, stop 65, which remove every allocation putting
    one of them on a GPU too; ``head_processes``: its heads on worker processes, stop 69).
    ``gap`` (stop 70, ``extra["proof_gap"]``): the pass asks at the period less this share
    instead (when larger than that step), so its bound proves the plan within ``gap`` rather
    than optimal: a lower cutoff refutes sooner (on the headline, 1 %: 1,280 heads asked and
    410 CPU s against 4,139 and 1,039 CPU s). With no allocation undecided, ``Scan.bound`` is a
    lower bound of every plan of the problem (1-periodic patterns): every allocation was
    asked, extends a refuted head or has a floor at or above the cutoff. More than
    ``limit`` allocations (or heads at one level): nothing more is asked (``truncated``,
    ``stopped = "limit"``); a run stopped by the time limit is not continued.
    """
    if first.stopped != "done":
        return Scan(first.period, first.plan, stopped=first.stopped), Heads()
    cap = first.period if math.isfinite(first.period) else units.big_m()
    cut = max(min(step, PROOF_STEP), gap or 0.0)
    cutoff = _cutoff(first, cap, cut)
    pre = head_pass(problem, units, cap, cutoff, depths=heads, work=work, limit=limit,
                    seed=seed, deadline=deadline, workers=workers, rounds=head_rounds,
                    contents=head_contents, processes=head_processes)
    if pre.stopped != "done":
        return Scan(first.period, first.plan, truncated=pre.stopped == "limit",
                    stopped=pre.stopped), pre
    family, truncated = ranked(problem, units, units.n, cap, limit=limit, skip=pre.skip(),
                               deadline=deadline)
    if truncated:
        return Scan(first.period, first.plan, family=len(family), truncated=True,
                    stopped="time" if passed(deadline) else "limit"), pre
    out = ask_family(problem, units, first.period, first.plan, family, work=work, step=cut,
                     seed=seed, deadline=deadline, workers=workers, retry=retry,
                     waits=waits, tail=tail, share=share)
    if pre.bounds() and not math.isnan(out.bound):
        out.bound = min(out.bound, *pre.bounds())
    return out, pre


@dataclass
class Heads:
    """Outcome of :func:`head_pass`: the heads refuted, with the bound each proves.

    ``cut``: head (GPUs of units ``0 .. k - 1``) -> a lower bound of every plan of every
    allocation extending it (the cutoff less two steps of CP-SAT's grid, or the cutoff
    itself for a head its floor refuted); ``asked``: heads asked (by the floor or by
    CP-SAT); ``floored``: heads the floor refuted without a question; ``depths``: the head
    lengths asked, in order; ``levels``: ``[length, asked, refuted, floored]`` for each;
    ``stopped``: ``"done"``, ``"time"`` (the deadline passed) or ``"limit"`` (a level had
    more heads than the limit).
    """

    cut: dict[tuple[int, ...], float] = field(default_factory=dict)
    asked: int = 0
    depths: list[int] = field(default_factory=list)
    stopped: str = "done"
    levels: list[list[int]] = field(default_factory=list)
    contents: dict[tuple[int, int], float] = field(default_factory=dict)
    """``(k, mask)`` -> a lower bound of every plan of every allocation that puts exactly
    the units of ``mask`` (bit ``q``: unit ``q``) of units ``0 .. k - 1`` on one GPU
    (stop 65, :func:`refuted_contents`)."""
    pool: str = field(default="serial", compare=False)
    """Where the heads were asked: ``"serial"`` (one worker, or under a work budget),
    ``"threads"`` or ``"processes"`` (stop 69, :func:`head_pool`)."""
    questions: list[int] = field(default_factory=lambda: [0, 0], compare=False)
    """GPU contents asked and refuted by :func:`refuted_contents` (``extra["head_contents"]``;
    the count depends on the threads' timing through a shared cache, so it is left out of
    comparisons)."""

    @property
    def floored(self) -> int:
        """Heads the floor refuted without a question (summed over :attr:`levels`)."""
        return sum(level[3] for level in self.levels)

    @property
    def covered(self) -> int:
        """Heads refuted by a GPU content refuted before them (summed over :attr:`levels`)."""
        return sum(level[4] for level in self.levels)

    def skip(self, above: float = -math.inf) -> Skip:
        """The prefixes refuted with a bound above ``above``, for :func:`chunk_allocations`."""
        sets: dict[int, set[int]] = {}
        for (k, mask), bound in self.contents.items():
            if bound > above * (1 + _EPS):
                sets.setdefault(k, set()).add(mask)
        return Skip(frozenset(head for head, bound in self.cut.items()
                              if bound > above * (1 + _EPS)), sets)

    def bounds(self) -> list[float]:
        """The bounds of the heads and GPU contents refuted."""
        return [*self.cut.values(), *self.contents.values()]

    def report(self, prefix: str = "complete") -> dict[str, object]:
        """Report keys (``complete_heads``, ``complete_heads_refuted``, ...)."""
        return {f"{prefix}_heads": self.asked, f"{prefix}_heads_refuted": len(self.cut),
                f"{prefix}_head_depths": list(self.depths),
                f"{prefix}_heads_stopped": self.stopped,
                f"{prefix}_heads_floored": self.floored,
                f"{prefix}_heads_covered": self.covered,
                f"{prefix}_head_contents": [*self.questions, len(self.contents)],
                f"{prefix}_head_pool": self.pool,
                f"{prefix}_head_levels": [list(level) for level in self.levels]}


@dataclass(frozen=True)
class Skip:
    """Prefixes whose allocations :func:`chunk_allocations` does not list (stop 65).

    ``heads``: refuted heads (:attr:`Heads.cut`); ``contents``: length ``k`` -> masks of
    units ``0 .. k - 1`` refuted on one GPU (:attr:`Heads.contents`). A prefix of length
    ``k`` is skipped when it is a head of ``heads`` or one of its GPUs holds exactly a
    mask of ``contents[k]``: a walk reaches every prefix's shorter prefixes first, so a
    prefix is checked at its own length only.
    """

    heads: Collection[tuple[int, ...]] = frozenset()
    contents: Mapping[int, Collection[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.heads) or bool(self.contents)

    def __contains__(self, prefix: object) -> bool:
        if not isinstance(prefix, tuple):
            return False
        if prefix in self.heads:
            return True
        masks = self.contents.get(len(prefix), ())
        return any(m in masks for m in gpu_masks(prefix, len(prefix))) if masks else False


def gpu_masks(gpu: Sequence[int], k: int) -> list[int]:
    """The units of ``0 .. k - 1`` on each GPU ``gpu`` uses (bit ``q``: unit ``q``)."""
    masks: dict[int, int] = {}
    for q in range(k):
        masks[gpu[q]] = masks.get(gpu[q], 0) | 1 << q
    return list(masks.values())


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (a :func:`time.perf_counter` instant, or none) has passed."""
    return Deadline(deadline, time.perf_counter).spent()


def time_limit(deadline: float | None) -> float | None:
    """A question's time limit: what is left before ``deadline`` (at least 1 ms), or none.

    One rule for the scan's questions (:meth:`_Asker.limit`) and the heads'
    (:func:`head_pass`); until stop 65 the head pass computed it itself.
    """
    return left_for_engine(Deadline(deadline, time.perf_counter), least=1e-3)


def head_depths(n: int, step: int) -> list[int]:
    """Head lengths :func:`head_pass` asks: ``n // 2``, then every ``step`` units, below ``n``."""
    return list(range(max(1, n // 2), n, step))


def head_pass(problem: PipelineProblem, units: Units, cap: float, cutoff: float, *,
              depths: Sequence[int], work: float, limit: int, seed: int = 0,
              deadline: float | None = None, workers: int = 1, rounds: int = 0,
              contents: bool = False, lag: int = HEAD_LAG, processes: bool = False
              ) -> Heads:
    """Refute whole subtrees of the allocations: their heads, with the later units delayed.

    For each length ``k`` of ``depths`` in turn, every head (the GPUs of units
    ``0 .. k - 1``) of an allocation :func:`chunk_allocations` lists at ``cap`` (no chunk
    limit), less those extending a head already refuted, is asked whether
    :func:`~optmem.models.pipeline.delay_tail` of it has a plan at ``cutoff``
    (:func:`~optmem.solvers.pipeline_common.refute`, one CP-SAT worker, ``work``
    deterministic seconds, the problem's load bound as the period's floor). That instance
    relaxes every allocation extending the head (proof in ``delay_tail``): when it has
    none, none of them has a plan at most the cutoff less two steps of the grid, and the
    head is kept in :attr:`Heads.cut`. With ``rounds > 0`` (stop 64) a head is first tried
    on :func:`allocation_floor` of that instance (complete, so with ``rounds`` rounds of
    the waits rows) at the cutoff: a floor above it refutes the head with no question, at
    the cutoff itself (every such plan has a larger period; valid as the instance relaxes
    every allocation extending the head, and the floor bounds every plan of the instance).
    With ``contents`` (stop 65) each GPU of a refuted head is then asked alone
    (:func:`refuted_contents`); a content refuted there refutes every head, of this
    length or longer, that puts exactly those units of ``0 .. k - 1`` on one GPU, with no
    question (:attr:`Heads.contents`, counted in :attr:`Heads.covered`).

    The heads of one level are asked in order on ``workers`` threads, at most ``lag + 1``
    in flight (:data:`HEAD_LAG`): a head is sent once the answer ``lag + 1`` places before
    it is taken, and checked against the contents refuted by the answers taken so far, so
    the pass is the same with any number of workers on any machine. With ``processes``
    (stop 69) the workers are forked processes where :func:`head_pool` allows them (the
    same questions, each answered the same: CP-SAT is deterministic). It stops at the
    deadline (``"time"``: the heads reached after it are neither asked nor counted) or
    before a level with more than ``limit`` heads (``"limit"``); the heads refuted so far
    stay valid.
    """
    out = Heads()
    memory = floor_memory(problem)
    low = lower_bound(problem)
    seen: dict[tuple[int, int], float | None] = {}  # GPU contents asked -> bound, or None
    question = partial(ask_head, problem, units, cutoff=cutoff, work=work, seed=seed,
                       deadline=deadline, lower=low, rounds=rounds)

    def ask(head: tuple[int, ...]) -> _HeadAnswer | None:
        answer = question(head)
        if answer is None or answer.bound is None or answer.floored or not contents:
            return answer
        relaxed, alloc = delay_tail(units, head)
        return replace(answer, found=refuted_contents(
            problem, relaxed, alloc, len(head), cutoff, seed=seed, deadline=deadline,
            lower=low, seen=seen, tally=out.questions))

    # the contents' cache is shared by the workers: threads only
    pool = head_pool(workers, processes and not contents)
    submit: Callable[[tuple[int, ...]], Future[_HeadAnswer | None]] | None = None
    if isinstance(pool, ProcessPoolExecutor):
        out.pool, submit = "processes", partial(pool.submit, question)
    elif pool is not None:
        out.pool, submit = "threads", partial(pool.submit, carry_budget(ask))
    try:
        for depth in depths:
            heads: list[tuple[int, ...]] = []
            for head in chunk_allocations(units, problem.n_gpus, units.n, cap, memory,
                                          depth=depth, skip=out.skip()):
                heads.append(head)
                if len(heads) > limit:
                    out.stopped = "limit"
                    return out
            out.depths.append(depth)
            level = [depth, 0, 0, 0, 0]
            out.levels.append(level)
            for head, answer in _in_order(heads, ask, out, submit, lag):
                if answer is None:
                    continue
                out.asked += not answer.covered
                level[1] += not answer.covered
                if answer.bound is not None:
                    out.cut[head] = answer.bound
                    level[2] += 1
                    level[3] += answer.floored
                    level[4] += answer.covered
                for key, bound in answer.found:
                    out.contents[key] = bound
            if passed(deadline):
                out.stopped = "time"
                return out
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return out


def can_fork() -> bool:
    """Whether :func:`head_pool` may fork worker processes here (stop 69).

    Only on Linux, where ``fork`` is a start method, and only from a process running one
    Python thread: a fork copies the forking thread alone, so a lock another thread held
    would stay held in the child (CPython warns of it since 3.12). ``fork`` also needs no
    ``if __name__ == "__main__"`` guard in the user's script (``spawn`` and
    ``forkserver`` import it again).
    """
    return (sys.platform.startswith("linux")
            and "fork" in multiprocessing.get_all_start_methods()
            and threading.active_count() == 1)


def stop_idle_tqdm_monitors() -> int:
    """Stop tqdm's monitor threads that watch no open bar; return how many were stopped.

    ``torch.fx``'s interpreter opens a tqdm bar (``torch.compile`` with ``aot_eager`` runs
    it), and tqdm's first bar starts a daemon monitor thread (``tqdm._monitor.TMonitor``)
    that lives to the end of the process: that one thread kept :func:`can_fork` false, so
    the head pass ran on threads in any process that had compiled a model (stop 71, found
    in the test suite). A monitor only sleeps and nudges open bars; with none open it has
    nothing to do, and tqdm starts a new one with its next bar (``tqdm.__new__`` does when
    ``monitor.report()`` is false), so stopping it changes nothing a user sees. A monitor
    of an open bar is left alone.
    """
    module = sys.modules.get("tqdm._monitor")
    if module is None:
        return 0
    stopped = 0
    for thread in threading.enumerate():
        if isinstance(thread, module.TMonitor) and not thread.get_instances():
            thread.exit()
            stopped += 1
    return stopped


def head_pool(workers: int, processes: bool) -> Executor | None:
    """The workers of :func:`head_pass`: ``None`` (asked in turn), processes or threads.

    ``None`` with one worker or under a work budget (what each question may use of the
    budget depends on when it starts); forked processes (:func:`can_fork`) when
    ``processes``: the questions' Python (building and writing each model, about 15 % of
    a head question on the headline) then runs on both cores, not under one GIL;
    threads otherwise (CP-SAT runs outside the GIL). Idle tqdm monitor threads are stopped
    first (:func:`stop_idle_tqdm_monitors`).
    """
    if workers <= 1 or active_budget() is not None:
        return None
    if processes and (can_fork() or stop_idle_tqdm_monitors() and can_fork()):
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(workers, thread_name_prefix="optmem-heads")


def ask_head(problem: PipelineProblem, units: Units, head: tuple[int, ...], *,
             cutoff: float, work: float, seed: int, deadline: float | None, lower: float,
             rounds: int) -> _HeadAnswer | None:
    """One head of :func:`head_pass` (``None``: not asked, the deadline had passed).

    Its delayed instance (:func:`~optmem.models.pipeline.delay_tail`) is refuted by the
    floor (``rounds > 0``, :func:`within` at ``cutoff``) or asked :func:`head_question`.
    A module-level function of picklable arguments, so a worker process can run it.
    """
    if passed(deadline):
        return None  # not asked: the deadline fell inside the level
    relaxed, alloc = delay_tail(units, head)
    if rounds > 0 and not within(relaxed, alloc, max(alloc) + 1, floor_memory(problem),
                                 cutoff, rounds):
        return _HeadAnswer(cutoff, floored=True)
    return _HeadAnswer(head_question(problem, relaxed, alloc, cutoff, work=work, seed=seed,
                                     deadline=deadline, lower=lower))


@dataclass(frozen=True)
class _HeadAnswer:
    """One head's answer: its bound (``None``: not refuted), how, and contents refuted."""

    bound: float | None
    floored: bool = False
    covered: bool = False
    found: tuple[tuple[tuple[int, int], float], ...] = ()


def _in_order(heads: list[tuple[int, ...]],
              ask: Callable[[tuple[int, ...]], _HeadAnswer | None], out: Heads,
              submit: Callable[[tuple[int, ...]], Future[_HeadAnswer | None]] | None,
              lag: int) -> Iterator[tuple[tuple[int, ...], _HeadAnswer | None]]:
    """``(head, answer)`` in order (``None``: not asked, the deadline had passed).

    ``submit`` sends a head to the workers (``None``: ``ask`` it here, in turn).

    A head covered by a content refuted ``lag + 1`` answers or more before it is answered
    at that content's bound without a question. If the workers break (a worker process
    killed, e.g. by the kernel's out-of-memory killer), the heads they had and every later
    head are asked here: the answers are the same (deterministic work limits and seeds),
    and a dead worker never ends a solve.
    """
    flight: deque[tuple[tuple[int, ...], Future[_HeadAnswer | None] | _HeadAnswer | None]] \
        = deque()
    sent = 0

    def dispatch(head: tuple[int, ...]) -> Future[_HeadAnswer | None] | _HeadAnswer | None:
        nonlocal submit
        if submit is not None:
            try:
                return submit(head)
            except BrokenExecutor:
                submit = None
        return ask(head)

    def send(upto: int) -> None:
        nonlocal sent
        while sent < min(upto, len(heads)):
            head = heads[sent]
            sent += 1
            bound = _covering(out, head)
            flight.append((head, _HeadAnswer(bound, covered=True) if bound is not None
                           else dispatch(head)))

    send(lag + 1)
    while flight:
        head, pending = flight.popleft()
        if isinstance(pending, Future):
            try:
                pending = pending.result()
            except BrokenExecutor:
                submit, pending = None, ask(head)
        yield head, pending
        send(sent + 1)


def _covering(out: Heads, head: Sequence[int]) -> float | None:
    """The largest bound of the GPU contents refuted that cover ``head`` (``None``: none)."""
    return max((bound for (k, mask), bound in out.contents.items()
                if k <= len(head) and mask in gpu_masks(head, k)), default=None)


def head_question(problem: PipelineProblem, relaxed: Units, alloc: Sequence[int],
                  cutoff: float, *, work: float, seed: int, deadline: float | None,
                  lower: float) -> float | None:
    """One question of :func:`head_pass`: the bound proven at ``cutoff``, or ``None``.

    ``relaxed, alloc``: the head's instance (:func:`~optmem.models.pipeline.delay_tail`).
    Asked with :data:`HEAD_PARAMETERS` first (``work`` deterministic seconds, one worker);
    when that run ends with neither a plan nor a refutation, asked again with CP-SAT's
    defaults, so the pass refutes every head the defaults refute (at most one question
    more, for the rare head the parameters leave open: 1 of 40 sampled heads of 10 units
    on the headline, refuted by the defaults in 0.7 CPU s after 8.9 s).
    """
    shape, floors = head_instance(problem, relaxed, alloc, cutoff, lower)
    bound = None
    for parameters, share in ((HEAD_PARAMETERS, HEAD_FIRST_SHARE), (None, 1.0)):
        if passed(deadline):
            break
        run, bound = refute(shape, _question_options(work * share, seed, time_limit(deadline)),
                            cutoff, units=relaxed, gpu=list(alloc), lower=lower,
                            parameters=parameters, stash_floors=floors)
        if bound is not None or run.plan is not None:
            break
    return bound


def head_instance(problem: PipelineProblem, relaxed: Units, alloc: Sequence[int],
                  cutoff: float, lower: float
                  ) -> tuple[PipelineProblem, dict[tuple[int, int], int]]:
    """The problem a head question asks (one GPU per label of ``alloc``) and its stash floors.

    ``relaxed, alloc``: the head's instance (:func:`~optmem.models.pipeline.delay_tail`);
    the floors are :func:`stash_floors` at ``cutoff`` (none when :data:`STASH_FLOORS` is
    off). :func:`head_question` asks
    :func:`~optmem.solvers.pipeline_common.refute` of them; the benchmarks build the same
    model with :func:`~optmem.solvers.pipeline_common.build_model`.
    """
    shape = replace(problem, n_gpus=max(alloc) + 1)
    return shape, _floors(problem, relaxed, alloc, shape.n_gpus, lower, cutoff)


def refuted_contents(problem: PipelineProblem, relaxed: Units, alloc: Sequence[int], k: int,
                     cutoff: float, *, seed: int, deadline: float | None, lower: float,
                     seen: dict[tuple[int, int], float | None], tally: list[int]
                     ) -> tuple[tuple[tuple[int, int], float], ...]:
    """The GPUs of a refuted head that refute it alone: ``((j, mask), bound)`` for each.

    ``relaxed, alloc``: :func:`~optmem.models.pipeline.delay_tail` of a head of ``k``
    units. Each GPU of the head is asked alone at ``cutoff``
    (:func:`~optmem.models.pipeline.isolate_units` of that instance, :data:`CONTENT_WORK`
    deterministic seconds). The isolated instance relaxes every allocation whose units
    ``0 .. k - 1`` put exactly those units on one GPU (``delay_tail`` relaxes the
    allocation to its head's instance, ``isolate_units`` that instance to the GPU; both
    proofs in :mod:`optmem.models.pipeline`), and depends only on the units on that GPU
    (``mask``, highest unit ``m``) and on ``j = min(k, m + 2)``: every unit outside the
    mask is a pure delay and every cut between two of them is free in both steps, so the
    heads of every length from ``m + 2`` up give the same instance (for ``k = m + 1`` the
    cut after ``m`` is free too). A refuted content is kept as ``(j, mask)``: it refutes
    every allocation whose units ``0 .. j - 1`` put exactly ``mask`` on one GPU, which is
    more than those of length ``k``. ``seen`` caches the answers by ``(j, mask)`` across
    heads, levels and threads (an answer depends on nothing else, CP-SAT being
    deterministic); ``tally``: contents asked and refuted, counted here.
    """
    found = []
    for mask in gpu_masks(alloc, k):
        key = (min(k, mask.bit_length() + 1), mask)  # the shortest prefix it speaks of
        if key not in seen:
            if passed(deadline):
                break
            kept = {alloc[(mask & -mask).bit_length() - 1]}
            part, labels = isolate_units(relaxed, alloc, kept)
            shape = replace(problem, n_gpus=max(labels) + 1)
            _, seen[key] = refute(shape,
                                  _question_options(CONTENT_WORK, seed, time_limit(deadline)),
                                  cutoff, units=part, gpu=list(labels), lower=lower,
                                  parameters=HEAD_PARAMETERS,
                                  stash_floors=_floors(problem, part, labels, shape.n_gpus,
                                                       lower, cutoff))
            tally[0] += 1
            tally[1] += seen[key] is not None
        bound = seen[key]
        if bound is not None:
            found.append((key, bound))
    return tuple(found)


def ask_family(problem: PipelineProblem, units: Units, period: float,
               plan: PipelinePlan | None, family: Sequence[tuple[float, tuple[int, ...]]], *,
               work: float, step: float, seed: int = 0, deadline: float | None = None,
               workers: int = 1, retry: float = RETRY_WORK, truncated: bool = False,
               waits: bool = False, tail: int = 0, share: float = TRIM_SHARE) -> Scan:
    """:func:`scan`'s pass and retry pass over a given ``family`` of ``(floor, allocation)``.

    ``family`` must be sorted by floor (:func:`allocation_floor`, as :func:`ranked` gives it)
    and hold allocations numbered by first use; any set of allocations may be asked this way
    (e.g. the neighbourhood of a plan's allocation, ``benchmarks/bench_pipeline_neighbours.py``).
    ``Scan.bound`` then bounds the plans of these allocations only; ``truncated`` (the
    family is incomplete) withholds it. ``waits``: allocations the waits rows refute at the
    cutoff in force are not asked (:meth:`_Asker.waited`); ``tail > 0``: the trimmed
    questions of :meth:`_Asker.send` at the levels of :func:`trim_levels` (``share``).
    """
    if active_budget() is not None:
        workers = 1
    out = Scan(period, plan, truncated=truncated)
    cap = period if math.isfinite(period) else units.big_m()
    family = list(family)
    out.family = len(family)
    ask = _Asker(problem, units, cap, step, seed, deadline, max(1, workers), waits,
                 trim_levels(family, units.n, tail, share))
    with ask:
        pending = ask.run(out, family, work)
        if out.stopped == "done" and pending:
            out.undecided -= len(pending)  # counted again below unless decided now
            ask.run(out, pending, max(retry, work))
    if out.stopped == "done" and not out.truncated and out.undecided == 0:
        out.bound = max(0.0, _cutoff(out, cap, step) - 2 * ask.grid)
    return out


class _Asker:
    """Asks allocations through a window of in-flight questions; takes answers in order.

    With one worker each allocation is asked at the cutoff in force when the previous
    answer was taken (the plain sequential scan). With ``w > 1`` workers, up to
    ``LOOKAHEAD * w`` questions are in flight on ``w`` threads (CP-SAT runs outside the
    GIL); the ``k``-th question is sent right after the ``(k - window)``-th answer is taken,
    at the cutoff then in force, and answers are taken in the order sent. So which
    allocation is asked at which cutoff depends only on earlier answers, never on which
    thread finishes first: the same scan for the same ``w`` on any machine (each question
    being deterministic), and a slow question holds back only its own answer's turn.

    With ``levels`` (stop 62, :func:`trim_levels`) allocations are grouped by their
    *prefixes*, the GPUs of units ``0 .. n - 1 - t`` for each level ``t`` (:meth:`keys`),
    and a prefix is asked once, before the first allocation with it (:meth:`send`): its
    answer refutes or opens every allocation that shares it. The state that decides what is
    asked (refuted, open and in-flight prefixes) changes only when an answer is taken, so
    the scan stays deterministic.
    """

    def __init__(self, problem: PipelineProblem, units: Units, cap: float, step: float,
                 seed: int, deadline: float | None, workers: int, waits: bool = False,
                 levels: Sequence[int] = ()) -> None:
        self.problem, self.units, self.cap, self.step = problem, units, cap, step
        self.seed, self.deadline, self.workers = seed, deadline, workers
        self.memory = floor_memory(problem) if waits else None
        self.window = 1 if workers == 1 else LOOKAHEAD * workers
        self.grid = 0.0
        self.pool: ThreadPoolExecutor | None = None
        self.levels = tuple(levels)  # units dropped, most first
        self.trimmed_units = {t: trim_units(units, 0, t) for t in self.levels}
        self.cut: dict[_Key, float] = {}  # refuted prefix -> proven bound
        self.opened: dict[_Key, float] = {}  # prefix -> the cutoff it was not refuted at
        self.parked: dict[_Key, list[tuple[float, tuple[int, ...]]]] = {}  # in flight

    def __enter__(self) -> _Asker:
        if self.workers > 1:
            self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="optmem-chunks")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def limit(self) -> float | None:
        """A question's time limit: what is left of the run (at least 1 ms), or none."""
        return time_limit(self.deadline)

    def run(self, out: Scan, items: list[tuple[float, tuple[int, ...]]], work: float
            ) -> list[tuple[float, tuple[int, ...]]]:
        """One pass over ``items`` (by floor); returns the allocations left undecided.

        An allocation whose plan was taken (not proven optimal for it), or whose plan was
        overtaken by an answer taken before it, goes back to the front of the queue, to be
        asked at the cutoff then in force. The window is filled only with allocations whose
        floor is below the cutoff in force; once the front's floor reaches the cutoff (and
        the questions in flight are answered), the rest of the queue is skipped. Until stop
        56 the window was filled regardless, so with two workers up to eight allocations
        whose floor had reached the cutoff were asked. With the waits rows on (stash
        memory), an allocation they refute at the cutoff in force is not asked
        (:meth:`waited`): it depends only on the cutoff, so the scan stays deterministic.
        """
        queue = deque(items)
        flight: deque[tuple[tuple[float, tuple[int, ...]], tuple[_Key, ...],
                            Future[_Outcome]]] = deque()
        pending: list[tuple[float, tuple[int, ...]]] = []
        while True:
            cutoff = _cutoff(out, self.cap, self.step)
            if queue and _out_of_reach(out, queue[0][0], cutoff):
                out.skipped += len(queue)
                queue.clear()
            if passed(self.deadline):
                out.stopped = "time"
                break
            while queue and len(flight) < self.window \
                    and not _out_of_reach(out, queue[0][0], cutoff):
                item = queue.popleft()
                if self.pruned(out, item) or self.waited(out, item, cutoff):
                    continue
                needed = self.needed(out, item[1], cutoff)
                flight.append((item, needed, self.send(item[1], needed, cutoff, work)))
            if not flight:
                break
            item, needed, answer = flight.popleft()
            outcome = answer.result()
            state = self.take(out, outcome)
            proven = outcome.proven()
            if proven is not None:
                out.decided[item[1]] = max(proven, out.decided.get(item[1], 0.0))
            self.settle(out, needed, outcome, queue)
            if state == "undecided":
                pending.append(item)
            elif state == "again":
                queue.appendleft(item)
        for _, _, answer in flight:
            answer.cancel()
        return pending

    def waited(self, out: Scan, item: tuple[float, tuple[int, ...]], cutoff: float) -> bool:
        """Whether the waits rows refute ``item`` at ``cutoff`` (then counted and decided).

        :func:`within` at ``cutoff`` with :data:`WAIT_ROUNDS` rounds: the waits floor of
        :func:`allocation_floor`, from the allocation's loads-and-lifetimes floor, is
        above ``cutoff``, so no plan of the allocation has a period at most ``cutoff``: it
        is decided there (:attr:`Scan.decided`) without a question. Up to two bisections
        of interval DPs (tens of milliseconds on 21 units), where a question takes CP-SAT
        seconds. On ResNet-18 at 3x (4 GPUs, 12 GB/s) it refutes all 873 allocations of
        the complete family below the optimum, on the headline 1,463 of the 1,534
        two-chunk allocations below 31.39 (one round: 777 and 1,431).
        """
        if self.memory is None:
            return False
        gpu = item[1]
        if within(self.units, gpu, self.problem.n_gpus, self.memory, cutoff, WAIT_ROUNDS):
            return False
        out.waited += 1
        out.refuted += 1
        out.decided[gpu] = max(cutoff, out.decided.get(gpu, 0.0))
        return True

    def keys(self, gpu: tuple[int, ...]) -> list[_Key]:
        """``gpu``'s prefixes, most trimmed first: ``(t, GPUs of units 0 .. n - 1 - t)``."""
        return [(t, gpu[:self.units.n - t]) for t in self.levels]

    def pruned(self, out: Scan, item: tuple[float, tuple[int, ...]]) -> bool:
        """Whether ``item``'s prefixes decide it now: one refuted, or one not yet answered.

        A refuted prefix refutes ``item`` (counted and decided: :meth:`refute_by`); else a
        prefix in flight parks ``item`` until its answer is taken (:meth:`settle`).
        """
        keys = self.keys(item[1])
        for key in keys:
            if key in self.cut:
                self.refute_by(out, item[1], self.cut[key])
                return True
        for key in keys:
            if key in self.parked:
                self.parked[key].append(item)
                return True
        return False

    def refute_by(self, out: Scan, gpu: tuple[int, ...], proven: float) -> None:
        """Count ``gpu`` refuted by a prefix's trimmed question (``proven``: its bound)."""
        out.refuted += 1
        out.trimmed += 1
        out.decided[gpu] = max(proven, out.decided.get(gpu, 0.0))

    def needed(self, out: Scan, gpu: tuple[int, ...], cutoff: float) -> tuple[_Key, ...]:
        """The prefixes of ``gpu`` to ask at ``cutoff`` (none refuted, none in flight).

        Those never asked, or open at a cutoff above this one; each is marked in flight.
        """
        keys = tuple(key for key in self.keys(gpu)
                     if cutoff < self.opened.get(key, math.inf) * (1 - _EPS))
        for key in keys:
            self.parked[key] = []
        out.trim_questions += len(keys)
        return keys

    def settle(self, out: Scan, needed: tuple[_Key, ...], outcome: _Outcome,
               queue: deque[tuple[float, tuple[int, ...]]]) -> None:
        """Take the answers of the trimmed questions of one allocation (``needed``).

        The refuting prefix (if any) refutes every allocation parked on it, and every later
        one (:meth:`pruned`); the allocation itself was counted by :meth:`take`. A prefix
        asked and open is asked again only once the cutoff falls below this one. The
        allocations parked on the others go back to the front of the queue, by floor
        (their floors are at most the front's: they left the queue before it).
        """
        back: list[tuple[float, tuple[int, ...]]] = []
        proven = outcome.proven()
        for key in needed:
            waiting = self.parked.pop(key, [])
            if key[0] == outcome.cut_by and proven is not None:
                out.trimmed += 1
                self.cut[key] = proven
                for item in waiting:
                    self.refute_by(out, item[1], proven)
                continue
            if key[0] in outcome.asked:
                self.opened[key] = outcome.cutoff
            back.extend(waiting)
        queue.extendleft(sorted(back, reverse=True))

    def send(self, gpu: tuple[int, ...], needed: tuple[_Key, ...], cutoff: float, work: float
             ) -> Future[_Outcome]:
        """Ask ``gpu`` at ``cutoff`` (on the pool, or at once without one).

        With trimmed questions (``needed``: prefixes to ask, most trimmed first), each is
        asked first, in turn, whether :func:`~optmem.models.pipeline.trim_units` of its
        prefix (units ``0 .. n - 1 - t``, the allocation's GPUs) has a plan at ``cutoff``
        (:func:`~optmem.solvers.pipeline_common.refute`, the same work). That instance
        relaxes every allocation with the same prefix, whatever it does with the dropped
        units (proof in ``trim_units``): when it has none, none of them has a plan at most
        the cutoff less two steps of its grid, and the allocation is refuted without its
        own question; when every prefix has one (or no answer, or the engine failed), the
        allocation's own question follows.
        """
        def ask() -> _Outcome:
            asked: list[int] = []
            for tail, key in needed:
                asked.append(tail)
                trimmed = self.trim_question(tail, key, cutoff, work)
                if trimmed.refuted:
                    return replace(trimmed, asked=tuple(asked))
            answer = _decide(self.problem, self.units, gpu, cutoff, work, self.seed,
                             self.limit())
            return replace(answer, asked=tuple(asked))

        if self.pool is not None:
            return self.pool.submit(carry_budget(ask))
        done: Future[_Outcome] = Future()
        done.set_result(ask())
        return done

    def trim_question(self, tail: int, key: tuple[int, ...], cutoff: float, work: float
                      ) -> _Outcome:
        """Whether the units less the last ``tail`` with allocation ``key`` have no plan."""
        trimmed = self.trimmed_units[tail]
        run, bound = refute(self.problem, _question_options(work, self.seed, self.limit()),
                            cutoff, units=trimmed, gpu=list(key),
                            stash_floors=_floors(self.problem, trimmed, key,
                                                 self.problem.n_gpus, 0.0, cutoff))
        return _Outcome(refuted=bound is not None, grid=run.step, cutoff=cutoff,
                        cut_by=tail if bound is not None else 0)

    def take(self, out: Scan, outcome: _Outcome) -> str:
        """Count one outcome, in the scan's order, against the cutoff now in force.

        A refutation at the cutoff the batch was asked at holds at the cutoff now (never
        higher); a plan below the cutoff now is taken; a plan overtaken by an earlier one of
        the batch refutes the allocation if it was proven optimal for it. Returns
        ``refuted``, ``failed``, ``undecided``, ``optimal`` (a plan taken, proven optimal
        for its allocation) or ``again`` (ask this allocation again at the cutoff now).
        """
        cutoff = _cutoff(out, self.cap, self.step)
        out.evaluated += 1
        self.grid = max(self.grid, outcome.grid)
        if outcome.found is None:
            out.refuted += outcome.refuted
            out.undecided += not outcome.refuted
            out.failed += outcome.failed
            return "refuted" if outcome.refuted else "failed" if outcome.failed \
                else "undecided"
        if outcome.found[0] > cutoff * (1 + _EPS):  # overtaken within its batch
            if outcome.optimal:
                out.refuted += 1
                return "refuted"
            return "again"
        out.period, out.plan = outcome.found
        out.improvements.append(outcome.found[0])
        out.found_at.append(out.evaluated)
        return "optimal" if outcome.optimal else "again"


def trim_levels(family: Sequence[tuple[float, tuple[int, ...]]], n: int, tail: int,
                share: float = TRIM_SHARE) -> tuple[int, ...]:
    """The levels of trimmed questions worth asking over ``family``, most units dropped first.

    Among ``tail, tail - 1, ..., 1`` (at least two units kept), those at which ``family``
    holds at least ``share`` (:data:`TRIM_SHARE`) allocations per prefix (the GPUs of units
    ``0 .. n - 1 - t``): a question pays only when several allocations share it.
    """
    levels = []
    for t in range(min(tail, n - 2), 0, -1):
        prefixes = {gpu[:n - t] for _, gpu in family}
        if prefixes and len(family) >= share * len(prefixes):
            levels.append(t)
    return tuple(levels)


def _cutoff(out: Scan, cap: float, step: float) -> float:
    """The period a plan must reach to improve ``out`` (``cap`` before any plan)."""
    return out.period * (1 - step) if math.isfinite(out.period) else cap


def _out_of_reach(out: Scan, floor: float, cutoff: float) -> bool:
    """Whether an allocation with this floor (and every later one) cannot meet ``cutoff``.

    With a plan, the cutoff is below its period and a floor at the cutoff cannot beat it.
    Before any plan the cutoff is the cap itself, which a plan may reach exactly (one GPU
    running everything in sequence takes ``Units.big_m``): only a floor above it is out of
    reach. Until stop 55 a floor at the cap was skipped there too, and ``chunks`` without
    an incumbent (``warm_start=False``) answered ``no_solution`` on one GPU.
    """
    if math.isfinite(out.period):
        return floor >= cutoff * (1 - _EPS)
    return floor > cutoff * (1 + _EPS)


@dataclass(frozen=True)
class _Outcome:
    """One allocation at one cutoff (:func:`_decide`)."""

    found: tuple[float, PipelinePlan] | None = None
    refuted: bool = False
    failed: bool = False
    optimal: bool = False
    grid: float = 0.0
    cutoff: float = math.nan
    asked: tuple[int, ...] = ()
    """The levels (units dropped) of the trimmed questions asked first (:meth:`_Asker.send`)."""
    cut_by: int = 0
    """The level whose trimmed question refuted the allocation (0: none did)."""

    def proven(self) -> float | None:
        """A lower bound of every plan of the allocation, or ``None`` (nothing proven).

        Refuted at ``cutoff``: no plan has a period at most the cutoff on CP-SAT's grid, so
        every plan has at least the cutoff less two grid steps (as :func:`ask_family`'s
        family bound); a plan proven optimal for the allocation: its period, less the same.
        """
        if self.refuted:
            return max(0.0, self.cutoff - 2 * self.grid)
        if self.found is not None and self.optimal:
            return max(0.0, self.found[0] - 2 * self.grid)
        return None


def _floors(problem: PipelineProblem, units: Units, gpu: Sequence[int], n_gpus: int,
            low: float, cutoff: float) -> dict[tuple[int, int], int]:
    """A question's :func:`stash_floors` at ``cutoff`` (none when :data:`STASH_FLOORS` is off)."""
    if not STASH_FLOORS:
        return {}
    return stash_floors(units, gpu, n_gpus, floor_memory(problem), low, cutoff)


def _question_options(work: float, seed: int, left: float | None) -> SolveOptions:
    """One question's options: one CP-SAT worker, ``work`` deterministic seconds, ``left``."""
    return SolveOptions(threads=1, deterministic_time=work, seed=seed, time_limit_s=left)


def _decide(problem: PipelineProblem, units: Units, gpu: Sequence[int], cutoff: float,
            work: float, seed: int, left: float | None) -> _Outcome:
    """Some plan of allocation ``gpu`` with period <= ``cutoff`` (then polished), or a refutation.

    ``found``: a replayed plan below ``cutoff``, then the same model minimising the period
    from it (``optimal``: proven for this allocation); ``refuted``: none exists;
    neither: undecided within ``work`` (``failed``: the engine failed).
    """
    opts = _question_options(work, seed, left)
    floors = _floors(problem, units, gpu, problem.n_gpus, 0.0, cutoff)
    run = run_model(problem, "cpsat", opts, units=units, gpu=list(gpu), upper_bound=cutoff,
                    feasibility=True, stash_floors=floors)
    if run.failed:
        return _Outcome(failed=True, grid=run.step, cutoff=cutoff)
    if run.status is Status.INFEASIBLE or run.bound == math.inf:
        return _Outcome(refuted=True, grid=run.step, cutoff=cutoff)
    period = None if run.plan is None else replayed_period(problem, run.plan)
    if period is None or run.plan is None or period > cutoff * (1 + _EPS):
        return _Outcome(grid=run.step, cutoff=cutoff)
    best = (period, run.plan)
    polish = run_model(problem, "cpsat", opts, units=units, gpu=list(gpu), upper_bound=period,
                       warm=run.plan, stash_floors=floors)  # rows at cutoff >= period
    optimal = False
    if polish.plan is not None and not polish.failed:
        again = replayed_period(problem, polish.plan)
        if again is not None and again < period:
            best = (again, polish.plan)
        optimal = polish.status is Status.OPTIMAL and again is not None \
            and again <= best[0] * (1 + _EPS)
    return _Outcome(found=best, optimal=optimal, grid=max(run.step, polish.step),
                    cutoff=cutoff)


__all__ = ["BOUND_WORK", "CHUNK_STEP", "CHUNK_WORK", "FAMILIES", "FAMILY_LIMIT",
           "FLOOR_ITERATIONS", "HEAD_PROCESSES", "HEAD_ROUNDS", "HEAD_STEP", "LOOKAHEAD",
           "MAX_ALLOCATIONS", "MAX_CHUNKS", "PROOF_STEP", "RETRY_WORK", "STASH_FLOORS",
           "TRIM_SHARE", "TRIM_TAIL", "WAITS_WORK", "WAIT_ROUNDS", "ChunkSettings", "Heads",
           "Scan", "allocation_floor", "allocations_bound", "ask_family", "ask_head",
           "can_fork", "chunk_allocations", "complete", "floor_memory", "head_depths",
           "head_pass", "head_pool", "memory_check", "memory_fits", "ranked", "scan",
           "settings", "stash_floors", "stop_idle_tqdm_monitors", "trim_levels", "waits_check",
           "within"]
