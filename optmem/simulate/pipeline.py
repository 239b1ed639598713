"""Pipeline plans: unroll a 1-periodic pattern over several periods and check everything.

Semantics (thesis section 4.2, digest ``madpipe.md`` sections 1.2-1.6 and 4.3):

* Stages partition layers ``1..L`` in order; stage ``s`` runs its layers' forwards back to
  back as one task ``F s`` (duration: the sum of forward times) and its backwards as ``B s``.
* A cut between stages ``s`` and ``s+1`` on different GPUs ``p != p'`` needs the transfers
  ``send s`` (activation) and ``grad s`` (gradient), each of duration ``a_j / bandwidth`` on
  the link ``{p, p'}``. Same-GPU cuts must have no transfer.
* In repetition ``j`` a task starts at ``j T + start`` on micro-batch ``j + shift``. The
  replay unrolls enough repetitions that the steady state is reached, keeps micro-batches
  ``0..N-1`` and checks, with absolute times:

  - resources: the occurrences on each GPU (computations) and on each link (transfers) do
    not overlap, and every task fits in a period;
  - dependencies, per micro-batch: ``F 1 -> [send 1] -> F 2 -> ... -> F S -> B S ->
    [grad S-1] -> B S-1 -> ... -> B 1``;
  - memory per GPU as defined in :mod:`optmem.problems.pipeline` (``stash`` or ``strict``).

The result carries the period, the per-GPU peaks, the per-stage number of concurrent
activations (NCA) and the loads of GPUs and links.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from optmem.errors import PlanError
from optmem.pipeline_plan import PipelinePlan, PipelineTask
from optmem.problems.pipeline import PipelineProblem

MAX_SHIFT_SPAN_PER_TASK = 4
"""Largest ``(max shift - min shift) / number of tasks`` a replayed plan may have. Along
the dependency order each task lags the previous one by at most 2 periods (it starts and
lasts within a period), so minimal shifts span at most ``2 (tasks - 1)``; larger spans only
delay micro-batches, and the replay, which unrolls ``2 span + 6`` micro-batches, would
never end for shifts such as ``10^18``."""


@dataclass(frozen=True)
class PipelineSimulation:
    """What a replay measured.

    Parameters
    ----------
    period
        ``T`` (time between two micro-batches in steady state).
    peaks
        Peak memory of each GPU (``n_gpus`` values, 0 for unused GPUs).
    nca
        Largest number of micro-batches stashed at once by each stage.
    gpu_loads, link_loads
        Busy time per period of each GPU and of each used link.
    microbatches
        Number of micro-batches replayed.
    task_memory
        The memory of its GPU at the start of each task checked (``("F" | "B", stage,
        micro-batch)``; the stash model checks forwards only), the largest of its per-layer
        checks under ``strict``: what a runner's operation can be compared with.
    """

    period: float
    peaks: tuple[int, ...]
    nca: tuple[int, ...]
    gpu_loads: tuple[float, ...]
    link_loads: dict[tuple[int, int], float]
    microbatches: int
    task_memory: dict[tuple[str, int, int], int] = field(default_factory=dict, compare=False,
                                                         repr=False)

    @property
    def peak_memory(self) -> int:
        """Largest GPU peak."""
        return max(self.peaks, default=0)


def _durations(problem: PipelineProblem, plan: PipelinePlan) -> dict[tuple[str, int], float]:
    lay = problem.layers
    out: dict[tuple[str, int], float] = {}
    for k, st in enumerate(plan.stages, start=1):
        out[("F", k)] = lay.fwd(st.first, st.last)
        out[("B", k)] = lay.bwd(st.first, st.last)
        if k < len(plan.stages):
            out[("send", k)] = out[("grad", k)] = problem.transfer_time(st.last)
    return out


def _check_structure(problem: PipelineProblem, plan: PipelinePlan) -> dict[tuple[str, int],
                                                                           PipelineTask]:
    return check_plan_structure(plan, problem.layers.n, problem.n_gpus)


def check_plan_structure(plan: PipelinePlan, n: int, n_gpus: int | None = None
                         ) -> dict[tuple[str, int], PipelineTask]:
    """Check that ``plan`` is well formed for a chain of ``n`` layers; its tasks by key.

    The stages partition layers ``1..n`` in order, each on a GPU ``0..n_gpus-1`` (``None``:
    any GPU >= 0), and the pattern has one forward and one backward per stage and one
    ``send`` and ``grad`` per cut between GPUs, each starting within the period. Raises
    :class:`~optmem.errors.PlanError` naming the first fault. Times and memory are not
    checked (:func:`simulate_pipeline` does).
    """
    if not (math.isfinite(plan.period) and plan.period > 0):
        raise PlanError(f"the period must be positive and finite, got {plan.period}")
    nxt = 1
    for k, st in enumerate(plan.stages, start=1):
        if st.first != nxt or st.last < st.first:
            raise PlanError(f"stage {k} covers layers {st.first}-{st.last}; expected a range "
                            f"starting at layer {nxt} (stages partition 1..{n} in order)")
        if st.gpu < 0 or (n_gpus is not None and st.gpu >= n_gpus):
            shown = "a GPU >= 0" if n_gpus is None else f"0..{n_gpus - 1}"
            raise PlanError(f"stage {k} is on GPU {st.gpu}; expected {shown}")
        nxt = st.last + 1
    if nxt != n + 1:
        raise PlanError(f"the stages cover layers 1..{nxt - 1}; expected 1..{n}")
    n_stages = len(plan.stages)
    expected = {("F", k) for k in range(1, n_stages + 1)} | {("B", k) for k in
                                                             range(1, n_stages + 1)}
    for k in range(1, n_stages):
        if plan.stages[k - 1].gpu != plan.stages[k].gpu:
            expected |= {("send", k), ("grad", k)}
    tasks: dict[tuple[str, int], PipelineTask] = {}
    for t in plan.tasks:
        key = (t.op, t.stage)
        if key not in expected:
            raise PlanError(f"unexpected task '{t.op} {t.stage}' (stages: {n_stages}; transfers "
                            "exist only between stages on different GPUs)")
        if key in tasks:
            raise PlanError(f"task '{t.op} {t.stage}' appears twice (1-periodic pattern)")
        tol = 1e-9 * max(1.0, plan.period)
        if not -tol <= t.start < plan.period + tol:
            raise PlanError(f"task '{t.op} {t.stage}' starts at {t.start}, outside [0, "
                            f"{plan.period})")
        tasks[key] = t
    missing = sorted(expected - set(tasks))
    if missing:
        raise PlanError("missing tasks: " + ", ".join(f"{o} {s}" for o, s in missing))
    return tasks


def _check_exclusive(res: tuple, items: list[tuple[float, float, str]], eps: float) -> None:
    """Refuse two occurrences on one resource that overlap by more than ``eps``.

    ``items``: ``(start, end, name)`` sorted by start. Each is compared with the earlier
    one that reaches furthest, both ways: a zero-time task ``eps`` or less after another's
    start lies at its boundary, not inside it. Until stop 51 only the end of the previous
    item was compared, so such a task a few ulps after a backward's start was an overlap
    and one ulps before it was not (a hunt; ``contiguous`` then raised this error).
    """
    reach: tuple[float, float, str] | None = None
    for s2, e2, n2 in items:
        if reach is not None:
            s1, e1, n1 = reach
            if s2 < e1 - eps and s1 < e2 - eps:
                name = f"GPU {res[1]}" if res[0] == "gpu" else f"link {res[1]}-{res[2]}"
                raise PlanError(f"{name} runs {n1} until {e1:g} and {n2} from {s2:g}: overlap")
        if reach is None or e2 > reach[1]:
            reach = (s2, e2, n2)


def _dependency_order(plan: PipelinePlan, tasks: dict) -> list[tuple[str, int]]:
    n_stages = len(plan.stages)
    order: list[tuple[str, int]] = []
    for s in range(1, n_stages + 1):
        order.append(("F", s))
        if ("send", s) in tasks:
            order.append(("send", s))
    for s in range(n_stages, 0, -1):
        order.append(("B", s))
        if s > 1 and ("grad", s - 1) in tasks:
            order.append(("grad", s - 1))
    return order


def simulate_pipeline(
    problem: PipelineProblem, plan: PipelinePlan, *, microbatches: int | None = None,
    tol: float = 1e-6,
) -> PipelineSimulation:
    """Replay ``plan`` for ``problem`` and return period, peaks and NCA.

    Parameters
    ----------
    problem
        The instance (layers, GPUs, bandwidth, memory model).
    plan
        Allocation and 1-periodic pattern.
    microbatches
        Micro-batches to replay (default: enough for several steady-state periods).
    tol
        Relative time tolerance (times from LP solvers carry rounding noise).

    Raises
    ------
    PlanError
        When a resource is used twice at once, a dependency is violated or a task does not
        fit in a period. Memory above the limit is reported through ``peaks``, not raised.
    """
    tasks = _check_structure(problem, plan)
    dur = _durations(problem, plan)
    period = plan.period
    eps = tol * max(1.0, period)
    for key, t in tasks.items():
        if dur[key] > period + eps:
            raise PlanError(f"task '{t.op} {t.stage}' lasts {dur[key]}, longer than the period "
                            f"{period}")
    stages = plan.stages
    shifts = [t.shift for t in tasks.values()]
    span = max(shifts) - min(shifts)
    if span > MAX_SHIFT_SPAN_PER_TASK * len(tasks):
        raise PlanError(f"the shifts span {span} periods; a pattern needs at most 2 per task "
                        f"(the replay accepts {MAX_SHIFT_SPAN_PER_TASK} per task: "
                        f"{MAX_SHIFT_SPAN_PER_TASK * len(tasks)})")
    n_mb = microbatches if microbatches is not None else 2 * span + 6
    # absolute start of (task, micro-batch m): (m - h) T + start
    def start(key: tuple[str, int], m: int) -> float:
        t = tasks[key]
        return (m - t.shift) * period + t.start

    # ---- resources
    def resource(key: tuple[str, int]) -> tuple:
        op, s = key
        if op in ("F", "B"):
            return ("gpu", stages[s - 1].gpu)
        p, q = stages[s - 1].gpu, stages[s].gpu
        return ("link", min(p, q), max(p, q))

    busy: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for key in tasks:
        for m in range(n_mb):
            s0 = start(key, m)
            busy[resource(key)].append((s0, s0 + dur[key], f"{key[0]} {key[1]} (micro-batch {m})"))
    for res, items in busy.items():
        _check_exclusive(res, sorted(items), eps)
    # ---- dependencies
    order = _dependency_order(plan, tasks)
    for x, y in zip(order, order[1:], strict=False):
        for m in (0,):  # identical for every micro-batch: (h_x - h_y) T + t_y - t_x - d_x >= 0
            end_x = start(x, m) + dur[x]
            if start(y, m) < end_x - eps:
                raise PlanError(f"'{y[0]} {y[1]}' of micro-batch {m} starts at "
                                f"{start(y, m):g} before '{x[0]} {x[1]}' ends at {end_x:g}")
    # ---- loads
    gpu_loads = [0.0] * problem.n_gpus
    link_loads: dict[tuple[int, int], float] = defaultdict(float)
    for key in tasks:
        res = resource(key)
        if res[0] == "gpu":
            gpu_loads[res[1]] += dur[key]
        else:
            link_loads[(res[1], res[2])] += dur[key]
    # ---- memory
    peaks, nca, at = _memory(problem, plan, tasks, dur, start, n_mb, eps)
    return PipelineSimulation(period, tuple(peaks), tuple(nca), tuple(gpu_loads),
                              dict(link_loads), n_mb, at)


def _memory(problem, plan, tasks, dur, start, n_mb, eps):  # noqa: ANN001, ANN202
    lay = problem.layers
    stages = plan.stages
    n_stages = len(stages)
    static = [0] * problem.n_gpus
    for k, st in enumerate(stages, start=1):
        static[st.gpu] += problem.weight_copies * lay.weights(st.first, st.last)
        if k < n_stages and stages[k].gpu != st.gpu:
            static[st.gpu] += problem.buffer_size(st.last)
            static[stages[k].gpu] += problem.buffer_size(st.last)
    stash = [lay.stash(st.first, st.last) for st in stages]
    # alive interval of stage s's stash for micro-batch m: [F start, B end)
    alive = {(s, m): (start(("F", s), m), start(("B", s), m) + dur[("B", s)])
             for s in range(1, n_stages + 1) for m in range(n_mb)}
    nca = [0] * n_stages
    for s in range(1, n_stages + 1):
        events = sorted([(alive[(s, m)][0], 1) for m in range(n_mb)]
                        + [(alive[(s, m)][1] - eps, -1) for m in range(n_mb)])
        count = 0
        for _, d in events:
            count += d
            nca[s - 1] = max(nca[s - 1], count)
    strict = problem.memory_model == "strict"
    # data waiting on the same GPU (strict): producer -> consumer, size
    direct: list[tuple[tuple[str, int], tuple[str, int], int, int]] = []
    if strict:
        for s in range(1, n_stages):
            if stages[s - 1].gpu == stages[s].gpu:
                size = lay.a[stages[s - 1].last]
                direct.append((("F", s), ("F", s + 1), size, stages[s].gpu))
                direct.append((("B", s + 1), ("B", s), size, stages[s].gpu))
        direct.append((("F", n_stages), ("B", n_stages), lay.a[lay.n], stages[-1].gpu))
    peaks = list(static)
    at: dict[tuple[str, int, int], int] = {}
    for k, st in enumerate(stages, start=1):
        kinds = ("F",) if not strict else ("F", "B")
        # strict: the stage's layers run one after the other (Layers.strict_task)
        task = dict(zip(("F", "B"), lay.strict_task(st.first, st.last), strict=True))
        for op in kinds:
            for m in range(n_mb):
                now = start((op, k), m)
                mem = static[st.gpu]
                for s2, st2 in enumerate(stages, start=1):
                    if st2.gpu != st.gpu:
                        continue
                    for m2 in range(n_mb):
                        f0, b1 = alive[(s2, m2)]
                        own = (s2, m2) == (k, m)
                        if own and op == "F":
                            if not strict:
                                mem += stash[s2 - 1]
                            continue
                        # the backward reads its own stash: alive at its start, also when
                        # it takes no time (its end is its start; stop 76, a hunt)
                        if f0 <= now + eps and (b1 > now + eps or own):
                            mem += stash[s2 - 1]
                if strict:
                    mem += task[op]
                    for x, y, size, gpu in direct:
                        if gpu != st.gpu or size == 0 or (op, k) in (x, y):
                            continue
                        for m2 in range(n_mb):
                            if (start(x, m2) + dur[x] <= now + eps
                                    and start(y, m2) > now + eps):
                                mem += size
                peaks[st.gpu] = max(peaks[st.gpu], mem)
                at[(op, k, m)] = mem
    return peaks, nca, at
