"""Contiguous allocations: 1F1B*, the exact period search, and the allocation DPs.

Thesis chapter 5 (digest ``madpipe.md`` section 3):

* :func:`one_f_one_b_star` builds the 1F1B*(T) pattern of a contiguous allocation in closed
  form (digest 3.3): groups are built greedily from the last (pseudo-)stage while their total
  load stays ``<= T`` (Algorithm 6, phase 1); forwards run back to back; stage ``s`` in group
  ``g`` runs ``B_s(m)`` at ``(m + g - 1) T + sum_{q <= last(s)} f_q + sum_{q=s+1}^{last(s)}
  b_q``. Every stage of group ``g`` keeps exactly ``g`` activations (Theorem 15: the fewest
  of any 1-periodic pattern of period ``T``).
* Communication is handled by the 2P-1 transformation (section 1.3): each cut becomes a link
  pseudo-stage with forward and backward durations ``a_j / beta``.
* :func:`best_period_for_allocation` replaces the bisection of Algorithm 7 by an exact scan:
  the grouping only changes when ``T`` equals the sum of consecutive pseudo-stage loads, so
  the smallest feasible ``T`` is one of these ``O(n^2)`` candidates (digest 3.5 impl-note).
* :func:`feasible_contiguous_split` decides, for a given ``T``, whether some contiguous
  allocation on at most ``P`` GPUs fits with 1F1B*(T): a DP over suffixes keeping the
  smallest group-aware accumulated load ``V`` (the ``+`` operator of MadPipe, digest 5.3),
  which is optimal because ``V (+) y`` and the copy count ``ceil(V / T)`` are monotone in
  ``V``. :func:`best_contiguous` searches ``T`` over the candidate loads ``U(i, j)`` when
  transfers are free (exact) and otherwise bisects, then snaps to the exact period of the
  allocation found and certifies it (infeasible 1e-7 below, relative).
* :func:`pipedream_split`: PipeDream's planner (Narayanan et al. SOSP'19, digest 3.8), the
  straight-pipeline DP ``A(j, m) = min_i max(A(i, m-1), 2 a_i / beta, U(i+1, j))`` with its
  crude memory filter (stage ``k`` of ``S`` holds ``S - k + 1`` copies of its activations and
  one of its weights, no buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple

from optmem.models.interrupt import Interrupted, poll, poll_now, stop_when
from optmem.pipeline_plan import (
    PipelinePlan,
    PipelineStage,
    PipelineTask,
    minimal_shifts,
    phase,
)
from optmem.problems.pipeline import PipelineProblem

TOL = 1e-9
Bounds = list[tuple[int, int]]


def oplus(x: float, y: float, period: float) -> float:
    """The group-aware addition ``x (+) y`` of MadPipe (digest 5.3, with ``T-hat``).

    Examples
    --------
    >>> [oplus(0, 3, 4), oplus(3, 1, 4), oplus(4, 1, 4), oplus(5, 2, 4), oplus(7, 2, 4)]
    [3, 4, 5, 7, 10]
    """
    eps = TOL * max(1.0, period)
    cx = math.ceil(x / period - TOL) if x > eps else 0
    if x + y <= cx * period + eps:
        return x + y
    return cx * period + y


def group_of(v: float, period: float) -> int:
    """Group number ``max(1, ceil(V / T))`` of an accumulated load ``V``."""
    return max(1, math.ceil(v / period - TOL))


def pseudo_loads(problem: PipelineProblem, bounds: Bounds) -> tuple[list[float], list[float]]:
    """Forward and backward durations of the 2S-1 pseudo-stages (stages and links)."""
    lay = problem.layers
    f: list[float] = []
    b: list[float] = []
    for k, (i, j) in enumerate(bounds):
        if k:
            c = problem.transfer_time(i - 1)
            f.append(c)
            b.append(c)
        f.append(lay.fwd(i, j))
        b.append(lay.bwd(i, j))
    return f, b


def pseudo_groups(loads: Sequence[float], period: float) -> list[int]:
    """1F1B* groups of the pseudo-stages (Algorithm 6 phase 1), numbered from the end."""
    out = [0] * len(loads)
    v = 0.0
    for k in range(len(loads) - 1, -1, -1):
        v = oplus(v, loads[k], period)
        out[k] = group_of(v, period)
    return out


def stage_copies(problem: PipelineProblem, bounds: Bounds, period: float) -> list[int]:
    """Activations kept by each stage under 1F1B*(``period``)."""
    f, b = pseudo_loads(problem, bounds)
    groups = pseudo_groups([x + y for x, y in zip(f, b, strict=True)], period)
    return groups[::2]


def memory_fits(problem: PipelineProblem, bounds: Bounds, period: float) -> bool:
    """Whether every GPU fits under 1F1B*(``period``) (stash model; one stage per GPU)."""
    for (i, j), g in zip(bounds, stage_copies(problem, bounds, period), strict=True):
        if problem.stage_memory(i, j, g) > problem.memory_per_gpu:
            return False
    return True


def one_f_one_b_star(problem: PipelineProblem, bounds: Bounds, period: float) -> PipelinePlan:
    """The 1F1B*(``period``) pattern of the contiguous allocation ``bounds`` (stage k on GPU k-1).

    Raises ``ValueError`` if a (pseudo-)stage's load exceeds the period.
    """
    f, b = pseudo_loads(problem, bounds)
    n = len(f)
    loads = [x + y for x, y in zip(f, b, strict=True)]
    eps = TOL * max(1.0, period)
    if max(loads) > period + eps:
        raise ValueError(f"a stage or link needs {max(loads)} per period, more than {period}")
    groups = pseudo_groups(loads, period)
    last = [0] * n
    for k in range(n - 1, -1, -1):
        last[k] = k if k == n - 1 or groups[k + 1] != groups[k] else last[k + 1]
    prefix_f = [0.0]
    for x in f:
        prefix_f.append(prefix_f[-1] + x)
    fstart = [prefix_f[k] for k in range(n)]
    bstart = [(groups[k] - 1) * period + prefix_f[last[k] + 1] + sum(b[k + 1:last[k] + 1])
              for k in range(n)]
    starts: dict[tuple[str, int], float] = {}
    durs: dict[tuple[str, int], float] = {}
    for k in range(n):
        stage, is_link = k // 2 + 1, k % 2 == 1
        fop, bop = ("send", "grad") if is_link else ("F", "B")
        starts[(fop, stage)] = _mod(fstart[k], period)
        starts[(bop, stage)] = _mod(bstart[k], period)
        durs[(fop, stage)], durs[(bop, stage)] = f[k], b[k]
    shifts = minimal_shifts(starts, durs, len(bounds), period)
    stages = tuple(PipelineStage(i, j, k) for k, (i, j) in enumerate(bounds))
    tasks = tuple(PipelineTask(op, s, starts[(op, s)], shifts[(op, s)])
                  for (op, s) in sorted(starts, key=lambda key: (key[1], key[0])))
    return PipelinePlan(period, stages, tasks)


def _mod(t: float, period: float) -> float:
    return phase(t, period, 1e-12)


def period_candidates(loads: Sequence[float], lower: float) -> list[float]:
    """Sums of consecutive loads that are ``>= lower`` (sorted, deduplicated)."""
    out = set()
    for i in range(len(loads)):
        acc = 0.0
        for j in range(i, len(loads)):
            acc += loads[j]
            if acc >= lower * (1 - TOL):
                out.add(acc)
    return sorted(out)


def best_period_for_allocation(
    problem: PipelineProblem, bounds: Bounds, *, at_most: float = math.inf,
    equal: bool = True,
) -> tuple[float, PipelinePlan] | None:
    """Smallest ``T`` whose 1F1B*(T) fits (exact scan over the candidates, Algorithm 7).

    Under ``strict`` only periods below ``at_most`` (or equal to it, with ``equal``) are
    tried: a caller that holds a plan of period ``at_most`` skips the rest of the scan.
    """
    f, b = pseudo_loads(problem, bounds)
    loads = [x + y for x, y in zip(f, b, strict=True)]
    cands = period_candidates(loads, max(loads))
    if problem.memory_model == "stash":
        lo, hi = 0, len(cands) - 1
        if not memory_fits(problem, bounds, cands[hi]):
            return None
        while lo < hi:
            poll()
            mid = (lo + hi) // 2
            if memory_fits(problem, bounds, cands[mid]):
                hi = mid
            else:
                lo = mid + 1
        return cands[lo], one_f_one_b_star(problem, bounds, cands[lo])
    from optmem.simulate.pipeline import simulate_pipeline

    for period in cands:  # strict model: memory is not monotone in general; scan upwards
        poll_now()  # each step replays the plan: a check per step (ms at L = 339)
        if period > at_most or (period == at_most and not equal):
            break
        plan = one_f_one_b_star(problem, bounds, period)
        if simulate_pipeline(problem, plan).peak_memory <= problem.memory_per_gpu:
            return period, plan
    return None


def feasible_contiguous_split(
    problem: PipelineProblem, period: float, max_stages: int | None = None
) -> Bounds | None:
    """A contiguous allocation on at most ``P`` GPUs whose 1F1B*(``period``) fits, or None."""
    lay = problem.layers
    n = lay.n
    limit = problem.memory_per_gpu
    kmax = min(max_stages or problem.n_gpus, n)
    eps = TOL * max(1.0, period)
    inf = math.inf
    # best[k][j]: smallest V for layers j..n in k stages; parent for reconstruction
    best = [[inf] * (n + 2) for _ in range(kmax + 1)]
    parent: dict[tuple[int, int], int] = {}
    for i in range(1, n + 1):
        u = lay.load(i, n)
        if u <= period + eps and problem.stage_memory(i, n, 1) <= limit:
            best[1][i] = u
            parent[(1, i)] = n + 1
    for k in range(1, kmax):
        for j in range(2, n + 1):
            poll()  # a stop (optmem.models.interrupt): 80 ms per call at L = 339
            v = best[k][j]
            if v == inf:
                continue
            c = 2 * problem.transfer_time(j - 1)
            if c > period + eps:
                continue
            v1 = oplus(v, c, period)
            for i in range(j - 1, 0, -1):
                u = lay.load(i, j - 1)
                if u > period + eps:
                    break
                v2 = oplus(v1, u, period)
                if v2 < best[k + 1][i] and problem.stage_memory(
                        i, j - 1, group_of(v2, period)) <= limit:
                    best[k + 1][i] = v2
                    parent[(k + 1, i)] = j
    for k in range(1, kmax + 1):
        if best[k][1] < inf:
            bounds: Bounds = []
            i, kk = 1, k
            while kk >= 1:
                j = parent[(kk, i)]
                bounds.append((i, j - 1))
                i, kk = j, kk - 1
            return bounds
    return None


def scan_contiguous(problem: PipelineProblem) -> tuple[float, PipelinePlan] | None:
    """The best 1F1B* plan of every contiguous split, by brute force (a reference).

    Every split on at most ``P`` GPUs (fewer stages first, cuts in lexicographic order),
    every candidate period of each (:func:`best_period_for_allocation`); the first split of
    the least period wins. What ``contiguous`` under ``strict`` computed until stop 55, and
    what its pruned scan must return (tests, ``benchmarks/bench_pipeline_strict.py``), on
    chains of at most 20,000 splits: ``contiguous`` stops at that many, this scan does not.
    """
    from itertools import combinations

    n = problem.layers.n
    best: tuple[float, PipelinePlan] | None = None
    for k in range(1, min(problem.n_gpus, n) + 1):
        for cuts in combinations(range(1, n), k - 1):
            edges = [0, *cuts, n]
            found = best_period_for_allocation(
                problem, [(edges[t] + 1, edges[t + 1]) for t in range(k)])
            if found and (best is None or found[0] < best[0]):
                best = found
    return best


def min_memory_by_search(problem: PipelineProblem) -> int:
    """The least memory per GPU :func:`best_contiguous` fits, by search (a reference).

    A doubling search from ``problem.memory_per_gpu``, then a bisection over integers, each
    step a whole :func:`best_contiguous`: how ``contiguous`` found its threshold until stop
    75 (111 s at L = 339), kept to check :func:`~optmem.solvers.pipeline.
    min_memory_contiguous` against (tests, ``benchmarks/bench_pipeline_min_memory.py``).
    """
    def fits(memory: int) -> bool:
        return best_contiguous(replace(problem, memory_per_gpu=memory)) is not None

    low, high = problem.memory_per_gpu, max(1, 2 * problem.memory_per_gpu)
    while not fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


class ContiguousBest(NamedTuple):
    """:func:`best_contiguous`'s answer: a split, its 1F1B* period and plan, whether proven.

    ``plan``: the 1F1B* plan of ``bounds`` at ``period`` (:func:`best_period_for_allocation`,
    computed by the search: callers need not compute it again). ``proven``: the period is
    the least of any contiguous allocation. ``stopped``: the search's ``stop`` held before
    the end; ``bounds`` is then the split of least 1F1B* period (``period``) among those
    found feasible so far, ``proven`` false.
    """

    period: float
    bounds: Bounds
    plan: PipelinePlan
    proven: bool
    stopped: bool = False


@dataclass
class _Incumbent:
    """The splits :func:`best_contiguous` found feasible so far (at decreasing periods)."""

    splits: list[Bounds] = field(default_factory=list)

    def split(self, problem: PipelineProblem, period: float) -> Bounds | None:
        """:func:`feasible_contiguous_split` at ``period``, kept when there is one.

        The stop is checked first (:func:`~optmem.models.interrupt.poll_now`): once per
        step of the search, whatever the chain's length.
        """
        poll_now()
        bounds = feasible_contiguous_split(problem, period)
        if bounds is not None:
            self.splits.append(bounds)
        return bounds

    def best(self, problem: PipelineProblem) -> ContiguousBest | None:
        """The split of least exact 1F1B* period (the first such), ``stopped``, or ``None``.

        Each split fits at the period its DP call found it at, so it has a period.
        """
        best: ContiguousBest | None = None
        for bounds in self.splits:
            found = best_period_for_allocation(problem, bounds)
            assert found is not None
            if best is None or found[0] < best.period:
                best = ContiguousBest(found[0], bounds, found[1], False, stopped=True)
        return best


def best_contiguous(problem: PipelineProblem, *, stop: Callable[[], bool] | None = None,
                    keep_first: bool = False) -> ContiguousBest | None:
    """Best contiguous allocation with 1F1B*, or ``None`` when none fits.

    Stash memory model only (the DP uses the closed-form memory of 1F1B*). ``stop`` (a
    time limit: :meth:`~optmem.solvers.time_budget.Deadline.stopper`) is checked before
    each DP call of the search and inside the DP (:mod:`optmem.models.interrupt`); once it
    holds the search ends with the split of least 1F1B* period among those it found
    feasible so far (``stopped``, not ``proven``). Without ``stop`` (or an enclosing
    :func:`~optmem.models.interrupt.stop_when`) the search runs whole, as before stop 76,
    when it did not poll: 3.8 s at L = 339 (ResNet-1001, 4 GPUs, 24 GiB, 12 GB/s), which
    ``madpipe --time-limit 5`` spent before its phase 1. ``keep_first``: ``stop`` is only
    asked once a split was found (one DP call at most, 80 ms at L = 339), so that a caller
    which needs a plan (MadPipe's candidate, the exact methods' incumbent) has one whenever
    some split fits, as before stop 76.

    Raises
    ------
    Interrupted
        When ``stop`` held before any split was found feasible (no plan yet; never with
        ``keep_first``).
    """
    found = _Incumbent()
    if stop is None:
        return _search_contiguous(problem, found)
    if keep_first:
        stop = partial(_once_found, found, stop)
    with stop_when(stop):
        try:
            return _search_contiguous(problem, found)
        except Interrupted:
            if not found.splits:
                raise
    return found.best(problem)


def _once_found(found: _Incumbent, stop: Callable[[], bool]) -> bool:
    """``stop()``, asked only once ``found`` holds a split (``keep_first``)."""
    return bool(found.splits) and stop()


def _search_contiguous(problem: PipelineProblem, found: _Incumbent) -> ContiguousBest | None:
    """:func:`best_contiguous`'s search; every split found feasible is kept in ``found``."""
    lay = problem.layers
    n = lay.n
    total = lay.load(1, n)
    links = sum(2 * problem.transfer_time(j) for j in range(1, n))
    lo: float = max(total / problem.n_gpus, max(lay.load(q, q) for q in range(1, n + 1)))
    hi: float = total + links
    if found.split(problem, hi) is None:
        return None
    if links == 0:
        return _search_free_links(problem, found, lo)
    if found.split(problem, lo) is not None:
        hi = lo
    else:
        for _ in range(100):
            if hi - lo <= 1e-12 * hi:
                break
            half = (lo + hi) / 2
            if found.split(problem, half) is not None:
                hi = half
            else:
                lo = half
    bounds = found.split(problem, hi)
    assert bounds is not None
    best = best_period_for_allocation(problem, bounds)
    assert best is not None
    period = best[0]
    proven = found.split(problem, period * (1 - 1e-7)) is None
    return ContiguousBest(period, bounds, best[1], proven)


def _search_free_links(problem: PipelineProblem, found: _Incumbent, lo: float
                       ) -> ContiguousBest:
    """Free transfers: a bisection over the candidate loads ``U(i, j) >= lo`` (exact)."""
    lay = problem.layers
    cands = period_candidates([lay.load(q, q) for q in range(1, lay.n + 1)], lo)
    a, z = 0, len(cands) - 1
    while a < z:
        mid = (a + z) // 2
        if found.split(problem, cands[mid]) is not None:
            z = mid
        else:
            a = mid + 1
    bounds = found.split(problem, cands[a])
    assert bounds is not None
    best = best_period_for_allocation(problem, bounds)
    assert best is not None
    return ContiguousBest(best[0], bounds, best[1], True)


def pipedream_split(problem: PipelineProblem, n_stages: int) -> Bounds | None:
    """PipeDream's straight-pipeline DP with its crude memory filter (``n_stages`` stages)."""
    lay = problem.layers
    n = lay.n
    if n_stages > n:
        return None
    inf = math.inf

    def ok(i: int, j: int, k: int) -> bool:
        copies = n_stages - k + 1
        return copies * lay.stash(i, j) + lay.weights(i, j) <= problem.memory_per_gpu

    a = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    parent: dict[tuple[int, int], int] = {}
    a[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n + 1):
            for i in range(k, j + 1):  # stage k = layers i..j
                prev = a[k - 1][i - 1]
                if prev == inf or not ok(i, j, k):
                    continue
                c = 2 * problem.transfer_time(i - 1) if i > 1 else 0.0
                val = max(prev, c, lay.load(i, j))
                if val < a[k][j]:
                    a[k][j] = val
                    parent[(k, j)] = i
    if a[n_stages][n] == inf:
        return None
    bounds: Bounds = []
    j = n
    for k in range(n_stages, 0, -1):
        i = parent[(k, j)]
        bounds.append((i, j))
        j = i - 1
    return bounds[::-1]


def equal_split(problem: PipelineProblem, n_stages: int) -> Bounds:
    """Equal layer counts (torch.distributed.pipelining style); earlier stages get the extras."""
    length = problem.layers.n
    n_stages = max(1, min(n_stages, length))
    size, extra = divmod(length, n_stages)
    bounds: Bounds = []
    first = 1
    for k in range(n_stages):
        last = first + size - 1 + (1 if k < extra else 0)
        bounds.append((first, last))
        first = last + 1
    return bounds
