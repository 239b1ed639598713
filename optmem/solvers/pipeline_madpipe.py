r"""MadPipe (thesis chapter 7): a DP for non-contiguous allocations, then an exact schedule.

Phase 1, MadPipe-DP(T-hat) (digest ``madpipe.md`` 5.1-5.3): ``P - 1`` *normal* GPUs hold one
stage each, one *special* GPU holds any set of stages. State ``T(j, p, t_P, m_P, V)``: the
smallest period estimate for layers ``1..j`` with ``p`` normal GPUs left, the special GPU
already carrying load ``t_P`` and memory ``m_P``, and ``V`` the group-aware accumulated load
of the pseudo-chain to the right (``(+)`` operator). Last stage ``i..j``:

* ``V' = (V (+) U(i, j)) (+) C(i - 1)``, ``g = ceil((V (+) U(i, j)) / T-hat)``;
* normal: ``M(i, j, g) <= M`` and ``T_N = max(U(i, j), C(i-1), T(i-1, p-1, t_P, m_P, V'))``;
* special: ``t'_P = t_P + U(i, j)``, ``m'_P = m_P + M(i, j, g - 1) <= M`` (the deliberate
  under-estimate of 5.2), ``T_S = max(t'_P, C(i-1), T(i-1, p, t'_P, m'_P, V'))``;
* ``T(0, ...) = t_P``; ``T(j, 0, ...)`` puts the whole prefix on the special GPU.

Algorithm 8 chooses ``T-hat`` by the bisection-like loop of the thesis (``K`` iterations).
``t_P``, ``m_P`` and ``V`` are exact for short chains and rounded *up* to the thesis grids
(101, 11 and 51 values, section 5.5) otherwise.

Computation (:func:`madpipe_dp`): the recursion is evaluated level by level, ``j = L..0``,
over the states it reaches, with numpy: the states of a level and all their moves (every
last stage ``i..j``, both kinds) at once, then the values bottom-up; ties keep the move the
recursion tries first (``i`` decreasing, normal before special), so values and allocations
are those of the memoised recursion it replaces (checked on 800 random instances and
bundled profiles before that was deleted; ``tests/test_pipeline_exact.py`` checks the DP
against an enumeration of its class). A call only needs its value below the best estimate
of Algorithm 8 so far, so it is capped there (states that cannot lead below the cap are
never created), with smaller caps tried first from a lower bound (a DP run without
``t_P``). On the grids a move is also dropped when a lower bound of its child state reaches
the cap: the DP's recursion without ``m_P`` and ``V`` (:attr:`DPTables.relaxed`, one table
per memory rung), and the least completions of the child's ``(p, m_P, V)`` in the run
without ``t_P`` (:class:`Prune`; that run is itself capped), and a memory-aware bound
without ``t_P`` and ``V`` (:meth:`DPTables.relaxed_memory`: ``V`` is at least the loads to
the right, so every stage keeps at least its least number of stash copies; one small table
per ``T-hat``; :data:`MEMORY_BOUND`). While Algorithm 8 has no estimate yet, the run without
``t_P`` is capped at each cap tried rather than not at all (:data:`LIMIT_RUNS`); the
capped runs without ``t_P`` keep in each state the least ``t_P`` of the paths reaching it
and prune by it (:data:`PREFIX_BOUND`). Almost every state of a capped run used to have no
estimate below the cap (over 99 % at L = 56: memory rules them out); the bounds leave the
values, ties and allocations unchanged (:data:`BOUNDS`, :data:`MEMORY_BOUND`,
:data:`LIMIT_RUNS` and :data:`PREFIX_BOUND` switch them off; tests compare both). A level's
moves are computed on the (state, first layer) matrix: the same float operations per pair,
in the same order. On the grids a level's states are merged through a table of their keys
(their grid indices; no sort) and the values of all levels live in one flat array. A level
is small (about 116 states and 15 first layers at L = 56), so numpy's cost per call, not
the arithmetic, dominates; the grid runs thus check the bounds without ``V`` through one
threshold table per cap (:data:`THRESHOLDS`) and look the terms that depend on ``t_P`` or
``m_P`` alone up in per-level tables (:data:`STAGE_TABLES`), both the same values as
computing them per state. ResNet-152 (L = 56), P = 8, 12 GB/s, 2-16 GiB: Algorithm 8 at
all 10 memory factors takes 1.6-3.8 CPU s (1.75, 2.38, 2.66, 3.78, 3.19, 2.02, 1.63 s at 2,
3, 4, 6, 8, 12, 16 GiB; a solve stops its ladder after 2 factors at 8 GiB and 1 at 16),
1.25-1.43x less than before these lookups, with the same states
(``benchmarks/bench_madpipe_phase1.py``, ``benchmarks/results/madpipe_speed.md``, load
1.4-1.9); the 0.9-1.4 s once quoted here were measured with links 1000 times slower (a
bandwidth in bytes per ms passed as bytes per second), where transfers decide the estimate
and the DP has 0.1 M states.

Phase 2 (section 7.2): the stages become the units of a coarse chain and the exact model
(:mod:`optmem.models.pipeline`, ``options.extra["phase2"]``: ``"cpsat"``, the default when
OR-Tools is installed, or ``"ilp"``, the thesis' choice) finds a valid 1-periodic schedule,
first with the DP's GPU assignment fixed, then with a free assignment of the stages when the
fixed one is infeasible under the exact memory model (the digest's 5.6 ambiguity). Each call
gets the user's limits (``node_limit``, ``deterministic_time``, and what is left of
``time_limit_s``, a limit on the whole run); without
any, a deterministic work limit (:data:`PHASE2_NODE_LIMIT` nodes for the ILP,
:data:`PHASE2_DETERMINISTIC_TIME` for CP-SAT), so the heuristic's answer does not depend on
the machine's load; an engine that fails leaves that attempt without a plan. While no valid
period reaches the phase-1 estimate, phase 1 runs again with the memory reduced by a safety
margin (the digest's fallback x0.85, x0.7, x0.55, here in steps of 0.05:
:data:`MEMORY_FACTORS`). A DP allocation that is contiguous is
scheduled by 1F1B* instead (optimal for it, Theorem 15). The best valid plan found is
returned; since contiguous allocations belong to the DP's class but phase 2 cannot always
recover them, the best contiguous 1F1B* plan is a candidate too (reported as the source).
It is computed first, so that phase 2 skips the models of an allocation that cannot matter:
a lower bound of every plan they can return (:func:`allocation_bound`) at or above the best
phase-2 period so far, or above the contiguous one, and above the phase-1 estimate (so the
ladder stops where it did); :func:`_skippable` gives the argument, :data:`SKIP_PHASE2`
switches it off, ``report["phase2_skipped"]`` counts the skipped allocations and
``report["phase2_models"]`` the models run. ResNet-152, P = 8, 12 GB/s: a whole solve
takes 5.7-9.9 CPU s at 2-4 GiB instead of 6.8-200 s, with the same plans.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np

from optmem.models.interrupt import Interrupted, poll_now, stop_when
from optmem.models.pipeline import load_bound, make_units
from optmem.pipeline_plan import PipelinePlan
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers import pipeline_contiguous as contig
from optmem.solvers.options import choice, positive_int
from optmem.solvers.pipeline_common import (
    below_least_memory,
    fits,
    infeasible,
    lower_bound,
    plan_result,
    run_model,
    scaled,
)
from optmem.solvers.pipeline_contiguous import TOL
from optmem.solvers.time_budget import stopped_during

EXACT_MAX_LAYERS = 12
GRID_T, GRID_M, GRID_V = 101, 11, 51
K_ITERATIONS = 10
MADPIPE_GRIDS = ("auto", "exact", "thesis")  # extra["madpipe_grid"]
PHASE2_ENGINES = ("cpsat", "ilp")  # extra["phase2"]
MEMORY_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55)
"""Memory given to phase 1, as a share of the problem's, tried in turn (the digest's x0.85,
x0.7, x0.55 safety margins, in steps of 0.05: on ResNet-50, 4 GPUs, 3 GiB, 12 GB/s, x0.9
gives the allocation of a 34.04 ms plan that peaks at 2.63 GiB, where x0.85 and x1.0 give
plans of 35.58 and 43.37 ms; an allocation already scheduled is not scheduled again)."""
PHASE2_NODE_LIMIT = 20_000
"""Default ILP work limit of each phase-2 model (branch-and-bound nodes) when no limit is set."""
PHASE2_DETERMINISTIC_TIME = 30.0
"""Default CP-SAT work limit of each phase-2 model (deterministic seconds) likewise."""
PHASE2_SLIM = False
"""Whether phase 2's fixed-allocation model is the slim one
(:data:`~optmem.models.pipeline.SLIM_FIXED`); ``False``: the general model with the
allocation fixed. Both have the same solutions, but phase 2 stops at a work limit, where
their searches differ. On the 63 settings of ``bench_pipeline.py`` (stop 48,
``benchmarks/results/pipeline.md``): the general model gives 240.04 on ResNet-101 (b8,
1000 px), P = 8, 12 GiB, where the slim one stops at 258.97 (-7.3 %), the slim one 19.46 on
Inception-v3, P = 8, 12 GiB, where the general one gives 19.74 (+1.5 %), the other 61 the
same, in 366 CPU s in all against 424. Asking the general model only after an unproven
slim one gave 243.82 and 19.46 but took 775 CPU s."""

Allocation = list[tuple[int, int, str]]  # (first, last, "N"|"S") in chain order


# ------------------------------------------------------------------ phase 1: the DP
@dataclass(frozen=True)
class DPTables:
    """``U(i, j)``, weights + buffers and stash of every stage ``i..j`` (1-based, numpy).

    ``grows[i, j]``: the static memory without the buffer before ``i`` (it only grows as the
    stage extends to the left); ``cost[i]``: both transfers over the cut after layer ``i``.
    """

    n: int
    n_gpus: int
    limit: int
    load: np.ndarray
    static: np.ndarray
    stash: np.ndarray
    grows: np.ndarray
    cost: tuple[float, ...]
    total: float
    memo: dict[float, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def cost_array(self) -> np.ndarray:
        """``cost`` as an array (``cost_array[i - 1]``: the cut before layer ``i``)."""
        return np.asarray(self.cost)

    def firsts(self, j: int) -> np.ndarray:
        """``j, j - 1, ..., 1``: the first layers of the stages ending at ``j``."""
        return self._descending[self.n - j:]

    @cached_property
    def stage_columns(self) -> list[tuple[np.ndarray, ...]]:
        """The columns of :func:`_expand`'s matrix at each level ``j``.

        ``i`` (:meth:`firsts`), ``U(i, j)``, ``C(i - 1)``, ``grows``, ``stash`` and
        ``static`` of the stages ``i..j``.
        """
        out: list[tuple[np.ndarray, ...]] = [()]
        for j in range(1, self.n + 1):
            ii = self.firsts(j)
            out.append((ii, self.load[ii, j], self.cost_array[ii - 1], self.grows[ii, j],
                        self.stash[ii, j], self.static[ii, j]))
        return out

    @cached_property
    def stage_tables(self) -> list[tuple[np.ndarray, ...]]:
        """Per level ``j``, on the grids: :func:`_expand`'s terms that depend on ``t_P`` or ``m_P``.

        ``rt(t_P + U(i, j))`` and its index by ``t_P`` index (rows) and ``i`` (columns, as
        :meth:`firsts`), and by ``m_P`` index whether a stage ``i..j`` and every longer one
        can still be held (``alive`` without the cap). Computed from the grid values ``index
        * step`` with :func:`_expand`'s float operations: a state on the grid finds its
        terms in its rows.
        """
        step, step_m, _ = self.steps()
        tgrid = (np.arange(self.relaxed.shape[2]) * step)[:, None]
        mgrid = (np.arange(GRID_M + 2) * step_m)[:, None]
        out: list[tuple[np.ndarray, ...]] = [()]
        for _, u, _, grows, stash, _ in self.stage_columns[1:]:
            tp2 = _round_up(tgrid + u, step)
            alive = np.logical_and.accumulate((grows + mgrid <= self.limit)
                                              | (grows + stash <= self.limit), axis=1)
            out.append((tp2, np.rint(tp2 / step).astype(np.intp), alive))
        return out

    @cached_property
    def _descending(self) -> np.ndarray:
        return np.arange(self.n, 0, -1)

    @classmethod
    def of(cls, problem: PipelineProblem) -> DPTables:
        """The tables of ``problem`` (``O(L^2)`` entries, Python's float sums)."""
        lay = problem.layers
        n = lay.n
        load = np.zeros((n + 1, n + 1))
        static = np.zeros((n + 1, n + 1))
        stash = np.zeros((n + 1, n + 1))
        grows = np.zeros((n + 1, n + 1))
        for i in range(1, n + 1):
            for j in range(i, n + 1):
                load[i, j] = lay.load(i, j)
                stash[i, j] = lay.stash(i, j)
                static[i, j] = problem.stage_memory(i, j, 0)
                grows[i, j] = problem.static_memory(i, j, cut_before=False, cut_after=j < n)
        cost = (0.0, *(2 * problem.transfer_time(j) for j in range(1, n)))
        return cls(n, problem.n_gpus, problem.memory_per_gpu, load, static, stash, grows,
                   cost, lay.load(1, n))

    def steps(self) -> tuple[float, float, float]:
        """Grid steps of ``t_P``, ``m_P`` and ``V`` (thesis section 5.5)."""
        return (self.total / (GRID_T - 1) or 1.0, self.limit / (GRID_M - 1) or 1.0,
                (self.total + sum(self.cost)) / (GRID_V - 1) or 1.0)

    def rounders(self, exact: bool) -> tuple[Callable[[np.ndarray], np.ndarray], ...]:
        """``rt``, ``rm``, ``rv``: identity (exact) or rounding up to the thesis grids."""
        if exact:
            return _identity, _identity, _identity
        return tuple(partial(_round_up, step=s) for s in self.steps())

    @cached_property
    def relaxed(self) -> np.ndarray:
        """``H[j, p, k]``: a lower bound of ``T(j, p, k * step_t, m_P, V)`` (grids).

        It holds for every ``m_P`` and ``V``: the DP's recursion without them.
        The same recursion as the module docstring's, with the same rounding of ``t_P``, on
        a relaxed class: a normal stage only needs ``static + stash <= M`` (``g >= 1``), a
        special one ``static`` rounded up to the ``m_P`` grid at most ``M`` (``m_P >= 0``,
        ``g >= 1``, the rounding is monotone), and the prefix left with
        ``p = 0`` is one special stage whatever its memory. Each value of the DP is then at
        least ``H`` of its state (induction on ``j``: every move of the DP is a move here,
        with the same ``t_P`` and an estimate made of the same terms). It depends on the
        tables only, not on ``T-hat`` or the cap, so one table serves every DP call of
        Algorithm 8. ``H`` is nondecreasing in ``k`` (``rt`` is), so a ``t_P`` beyond the
        table may use its last column. Computed level by level with numpy.
        """
        step, step_m, _ = self.steps()
        size = int(math.ceil(self.total / step)) + self.n + 2
        tgrid = np.arange(size) * step  # the DP's t_P values: k * step, same float product
        h = np.empty((self.n + 1, self.n_gpus, size))
        h[0] = tgrid
        for j in range(1, self.n + 1):
            poll_now()  # a solve's deadline (optmem.models.interrupt): 0.6 s at L = 339
            h[j, 0] = self.load[1, j] + tgrid
            ii = np.arange(1, j + 1)
            u, c = self.load[ii, j], self.cost_array[ii - 1]
            normal = self.static[ii, j] + self.stash[ii, j] <= self.limit
            special = _round_up(self.static[ii, j], step_m) <= self.limit  # m'_P at least
            tp2 = _round_up(tgrid[None, :] + u[:, None], step)
            k2 = np.minimum(np.rint(tp2 / step).astype(np.intp), size - 1)
            own = np.maximum(tp2, c[:, None])[:, None, :]
            far = np.maximum(u, c)[:, None, None]
            pp = np.arange(1, self.n_gpus)[None, :, None]  # every p at once: the children
            cand_n = np.where(normal[:, None, None], np.maximum(far, h[ii - 1, :-1]), np.inf)
            cand_s = np.where(special[:, None, None],  # are on lower levels, all known
                              np.maximum(own, h[ii[:, None, None] - 1, pp, k2[:, None, :]]),
                              np.inf)
            h[j, 1:] = np.minimum(cand_n.min(axis=0), cand_s.min(axis=0))
        return h

    @cached_property
    def relaxed_nondecreasing(self) -> bool:
        """Whether :attr:`relaxed` is nondecreasing in ``k`` (it is: see there; checked)."""
        h = self.relaxed
        return bool(np.all(h[:, :, 1:] >= h[:, :, :-1]))

    def relaxed_memory(self, that: float) -> np.ndarray:
        """``G``: memory-aware lower bounds of ``T(j, p, t_P, m * step_m, V)`` (grids).

        ``G[0, j, p, m]``, ``G[1, j, p, m]``: lower bounds of the largest normal stage or
        link and of the special load added by the completions of the state at ``T-hat =
        that``, for every ``t_P`` and ``V``: ``T >= max(G[0], t_P + G[1])``.

        The DP's recursion with ``m_P`` but without ``t_P`` and ``V``: ``V`` at level ``j``
        is at least the loads to its right (``(+)`` only rounds up, up to ``TOL`` per
        stage), so a stage ``i..j`` has ``g >= g_min = group(U(i, L))`` (slightly reduced
        for those ``TOL``); a normal stage needs ``static + g_min stash <= M``, a special
        one ``rm(m_P + static + (g_min - 1) stash) <= M``, the prefix left with ``p = 0``
        ``m_P + static + (g_min - 1) stash <= M``. Each DP move is such a move, its child's
        ``m_P`` at least the one here; ``G`` is nondecreasing in ``m`` (induction: more
        memory used leaves fewer moves), and every estimate of the DP is at least these
        terms, so every value of the DP (and of its runs without ``t_P``) is at least
        ``max(G[0], t_P + G[1])`` of its state (induction on ``j``). Memoised per ``that``.
        """
        memo = self.memo.get(that)
        if memo is not None:
            return memo
        _, step_m, _ = self.steps()
        mgrid = np.arange(GRID_M + 1) * step_m
        g = np.empty((2, self.n + 1, self.n_gpus, GRID_M + 1))
        g[:, 0] = 0.0
        # what does not depend on the levels below, for every stage i..j at once (rows i,
        # columns j; the same float operations per entry as level by level)
        least = self._least_groups(that, self.n)[:, None]  # g_min of i..j: i's loads right
        static, stash = self.static[1:, 1:], self.stash[1:, 1:]
        fits_all = static + least * stash <= self.limit
        m2_all = _round_up(mgrid[None, None, :] + (static + (least - 1) * stash)[:, :, None],
                           step_m)
        k2_all = np.minimum(np.rint(m2_all / step_m).astype(np.intp), GRID_M)
        far_all = np.maximum(self.load[1:, 1:], self.cost_array[:, None])
        pp = np.arange(1, self.n_gpus)[None, :, None]  # every p at once: the
        flat0, flat1 = g[0].reshape(-1), g[1].reshape(-1)  # views: filled as j grows
        for j in range(1, self.n + 1):
            poll_now()
            fit0 = mgrid + self.static[1, j] + (least[0, 0] - 1) * self.stash[1, j] \
                <= self.limit
            g[0, j, 0] = np.where(fit0, 0.0, np.inf)
            g[1, j, 0] = np.where(fit0, self.load[1, j], np.inf)
            c, u = self.cost_array[:j], self.load[1:j + 1, j]
            fits_n = fits_all[:j, j - 1, None, None]
            far = far_all[:j, j - 1, None, None]
            m2, k2 = m2_all[:j, j - 1], k2_all[:j, j - 1]
            rows = np.arange(j)[:, None, None]  # children are on lower levels, all known
            a_n, s_n = g[0, :j, :-1], g[1, :j, :-1]
            at = (rows * self.n_gpus + pp) * (GRID_M + 1) + k2[:, None, :]  # g[:, rows, pp, k2]
            a_s, s_s = flat0.take(at), flat1.take(at)
            fits_s = (m2 <= self.limit)[:, None, :]
            g[0, j, 1:] = np.minimum(
                np.where(fits_n, np.maximum(far, a_n), np.inf).min(0),
                np.where(fits_s, np.maximum(c[:, None, None], a_s), np.inf).min(0))
            g[1, j, 1:] = np.minimum(np.where(fits_n, s_n, np.inf).min(0),
                                     np.where(fits_s, u[:, None, None] + s_s, np.inf).min(0))
        self.memo[that] = g
        return g

    def _least_groups(self, that: float, j: int) -> np.ndarray:
        """``g_min`` of the stages ``i..j``, ``i = 1..j`` (:meth:`relaxed_memory`)."""
        rest = self.load[np.arange(1, j + 1), self.n] - (2 * self.n + 4) * TOL * max(1.0, that)
        return _group(rest, that)


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _round_up(x: np.ndarray, step: float) -> np.ndarray:
    return np.ceil(x / step - 1e-9) * step + 0.0  # + 0.0: no -0.0 (state keys compare bytes)


def _oplus(x: np.ndarray, y: float | np.ndarray, period: float, q: np.ndarray | None = None
           ) -> np.ndarray:
    """:func:`~optmem.solvers.pipeline_contiguous.oplus` on an array (same float operations).

    ``q``: ``ceil(x / period - TOL)`` if already computed (:func:`_group`'s quotient).
    """
    eps = TOL * max(1.0, period)
    cx = np.where(x > eps, np.ceil(x / period - TOL) if q is None else q, 0.0) * period
    s = x + y
    return np.where(s <= cx + eps, s, cx + y)


def _group(v: np.ndarray, period: float) -> np.ndarray:
    return np.maximum(1.0, np.ceil(v / period - TOL))


@dataclass
class _Level:
    """The states of one level ``j`` and their moves (last stage ``i..j``, one kind each).

    Moves are listed state by state, then by decreasing ``i``, normal before special: the
    order in which the thesis' recursion tries them (ties keep the first).
    """

    states: np.ndarray  # rows (p, t_P, m_P, V)
    state: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    first: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    special: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=bool))
    value: np.ndarray = field(default_factory=lambda: np.empty(0))  # u or t'_P
    load: np.ndarray = field(default_factory=lambda: np.empty(0))  # u = U(i, j)
    link: np.ndarray = field(default_factory=lambda: np.empty(0))  # C(i - 1)
    child: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


Pending = list[list[tuple[np.ndarray, _Level | None, np.ndarray]]]


def madpipe_dp(problem: PipelineProblem, that: float, *, exact: bool = True,
               cap: float = math.inf, tables: DPTables | None = None,
               feasibility: bool = False, prune: Prune | None = None
               ) -> tuple[float, Allocation | None, int]:
    """MadPipe-DP(``that``): ``(period estimate, allocation, states)``; ``inf`` if none.

    Same values, allocations and ties as the recursion of the module docstring, computed
    level by level (``j = L .. 0``) over the reachable states with numpy: first the states
    and their moves top-down, then the values bottom-up. ``cap``: only estimates below it
    are computed exactly (``inf`` otherwise); states whose estimate cannot be below it are
    never created (a stage, a link or the special load at ``cap`` or above; on the grids,
    a lower bound of the rest at ``cap`` or above: :attr:`DPTables.relaxed` and ``prune``,
    the least completions of the same ``(p, m_P, V)`` from a run without ``t_P``;
    otherwise layers ``1..j`` left with ``U(1, j) + t_P >= cap (p + 1)``).
    ``feasibility``: only whether some allocation fits (the special load ``t_P`` is not
    tracked; the value is then ``0`` or ``inf``; see :func:`feasibility_run`).
    """
    tb = tables if tables is not None else DPTables.of(problem)
    levels = _levels(tb, that, exact, cap, feasibility, prune)
    n = tb.n
    count = sum(len(level.states) for level in levels)
    if feasibility:
        return _least(tb, that, levels)[0], None, count
    values, chosen = _evaluate(tb, that, cap, levels)
    if not len(values[n]) or not math.isfinite(values[n][0]):
        return math.inf, None, count
    alloc: Allocation = []
    j, k = n, 0
    while j > 0:
        move = chosen[j][k]
        if move < 0:  # no normal GPU left: the prefix 1..j on the special GPU
            alloc.append((1, j, "S"))
            break
        level = levels[j]
        first = int(level.first[move])
        alloc.append((first, j, "S" if level.special[move] else "N"))
        j, k = first - 1, int(level.child[move])
    return float(values[n][0]), alloc[::-1], count


def _levels(tb: DPTables, that: float, exact: bool, cap: float, feasibility: bool,
            prune: Prune | None) -> list[_Level]:
    """The reachable states of every level ``j = L .. 0`` and their moves."""
    rounders = tb.rounders(exact)
    n = tb.n
    pending: Pending = [[] for _ in range(n + 1)]
    pending[n].append((np.array([[tb.n_gpus - 1, 0.0, 0.0, 0.0]]), None, np.zeros(1, int)))
    levels: list[_Level] = [_Level(np.empty((0, 4)))] * (n + 1)
    bounds = None if exact or not math.isfinite(cap) or not BOUNDS else \
        _Bounds(tb, that, cap, None if feasibility else prune)
    prefix = feasibility and bounds is not None and PREFIX_BOUND
    for j in range(n, -1, -1):
        poll_now()  # a solve's deadline (optmem.models.interrupt): one check per level
        levels[j] = _Level(_collect(pending[j], None if exact else tb.steps(), prefix))
        if j > 0:
            _expand(tb, that, cap, rounders, j, levels[j], pending, feasibility, bounds,
                    prefix, not exact)
    return levels


@dataclass(frozen=True)
class Prune:
    """Least completions of the states of a DP run without ``t_P`` (grids only).

    ``a[j, p, m, v]``: the least largest normal stage or link, ``s[j, p, m, v]``: the least
    special load (raw sums) over the completions of the state ``(j, p, m_P, V)`` (grid
    indices ``m``, ``v``); ``inf`` when none fits, ``0`` for a state that run did not
    reach. A run with ``t_P`` makes the same moves from ``(j, p, t_P, m_P, V)`` (``m_P``
    and ``V`` do not depend on ``t_P``; without a cap nothing is pruned), each with an
    estimate of at least ``max(a, t_P + s)`` (its special load only grows by the loads it
    adds, up to the grid rounding's ``1e-9`` steps: :data:`PRUNE_SLACK`).
    """

    a: np.ndarray
    s: np.ndarray

    @classmethod
    def of(cls, tb: DPTables, levels: list[_Level], a_flat: np.ndarray,
           t_flat: np.ndarray, offsets: np.ndarray) -> Prune:
        """The table of a run without ``t_P`` (its levels and least completions)."""
        _, step_m, step_v = tb.steps()
        size_v = 1 + max((int(np.rint(level.states[:, 3].max() / step_v))
                          for level in levels if len(level.states)), default=0)
        a = np.zeros((tb.n + 1, tb.n_gpus, GRID_M + 1, size_v))
        s = np.zeros_like(a)
        for j, level in enumerate(levels):
            if not len(level.states):
                continue
            p, _, m, v = level.states.T
            where = (j, p.astype(np.intp), np.rint(m / step_m).astype(np.intp),
                     np.rint(v / step_v).astype(np.intp))
            a[where] = a_flat[offsets[j]:offsets[j + 1]]
            s[where] = t_flat[offsets[j]:offsets[j + 1]]
        return cls(a, s)


BOUNDS = True
"""Whether capped DP calls drop the moves the lower bounds of their child states rule out
(:attr:`DPTables.relaxed`, :class:`Prune`, a capped run without ``t_P``). ``False``: the
state space of the plain capped recursion, as before these bounds (same values, estimates
and allocations, more states; ``tests/test_pipeline_exact.py`` and
``benchmarks/bench_madpipe.py`` compare both)."""
MEMORY_BOUND = True
"""Whether the capped runs (with and without ``t_P``) also drop the moves that
:attr:`DPTables.relaxed_memory` rules out (the child's memory-aware lower bound). ``False``:
as before it (same values, estimates and allocations, more states)."""
PREFIX_BOUND = True
"""Whether a capped grid run without ``t_P`` (:func:`feasibility_run`) also drops the moves
whose child state cannot lead below the cap *given the least special load of the paths
reaching it*: each state carries ``t_min``, the least ``t_P`` (rounded up after each stage
exactly as the run with ``t_P`` does: :meth:`DPTables.rounders`) over the paths of the run
that reach it, and a move is checked by the bounds of :class:`_Bounds` (without
:class:`Prune`) at the child's ``t_min``, as the run with ``t_P`` checks it at its ``t_P``.

Validity (the :class:`Prune` table stays a table of lower bounds for the capped run with
``t_P``): every state ``(j, p, t_P, m_P, V)`` that run reaches is reached here as ``(j, p,
m_P, V)`` with ``t_min <= t_P`` (induction down the levels: the parent's ``t_min`` is at
most its ``t_P``, the rounding up is monotone, and the bounds are nondecreasing in ``t_P``:
:attr:`DPTables.relaxed` in its column, :meth:`DPTables.relaxed_memory` as ``max(G0, t_P +
G1)``, so a move that run keeps is kept here); and every completion of such a state with
an estimate below the cap is kept here (each of its moves passes the checks at the
child's ``t_P``, hence at its ``t_min``). The least completions over the moves kept are
thus at most those of the completions below the cap, and the run's bound is still a lower
bound of the capped value (``>= cap``: nothing below it). Same values, estimates and
allocations; fewer states. ``False``: as before."""
PRUNE_SLACK = 1e-7
"""Relative margin of the :class:`Prune` bound (float sums in another order, ``1e-9`` grid
roundings): a move is dropped only when its bound is above ``cap (1 + PRUNE_SLACK)``."""


class _Bounds:
    """What :func:`_expand` checks a capped grid move against (its child's lower bounds).

    The checks of :attr:`DPTables.relaxed` and :meth:`DPTables.relaxed_memory` at a grid
    ``t_P = k * step_t`` are one table, :attr:`kmax`: ``k < kmax[child, p, m]`` exactly when
    ``H[child, p, min(k, last)] < limit`` and ``max(G0, k * step_t + G1) < limit`` (both
    are nondecreasing in ``k``, so each holds for ``k`` below a threshold; the threshold of
    ``G`` is found with the same float sum ``k * step_t + G1`` as the check). ``t_P`` is
    always on the grid (``0`` or rounded up by ``rt``), so this is the same check, with
    one lookup per move instead of three.
    """

    def __init__(self, tb: DPTables, that: float, cap: float, prune: Prune | None) -> None:
        self.h = tb.relaxed
        self.g = tb.relaxed_memory(that) if MEMORY_BOUND else None
        self.prune = prune
        self.steps = tb.steps()
        self.limit = cap * (1 + PRUNE_SLACK)
        self.kmax = self._thresholds(tb) if THRESHOLDS else None
        if self.kmax is not None:
            self.kmax_flat = np.ravel(self.kmax)

    def _thresholds(self, tb: DPTables) -> np.ndarray | None:
        """:attr:`kmax` (``None`` if ``H`` were not nondecreasing in ``k``: old checks)."""
        if not tb.relaxed_nondecreasing:
            return None
        h, lim = self.h, self.limit
        kh = np.count_nonzero(h < lim, axis=2)  # H < lim exactly for k < kh
        kmax = np.where(kh < h.shape[2], kh, np.iinfo(np.intp).max)[:, :, None]
        if self.g is None:
            return np.broadcast_to(kmax, (*h.shape[:2], GRID_M + 1))
        return np.minimum(kmax, np.where(self.g[0] < lim,
                                         _grid_count(self.g[1], self.steps[0], lim), 0))

    def below(self, child: np.ndarray, p: np.ndarray, t: np.ndarray, m: np.ndarray,
              v: np.ndarray) -> np.ndarray:
        """Whether the state ``(child, p, t, m, v)`` may have an estimate below the cap."""
        return self.below_at(child, p, t, np.rint(t / self.steps[0]).astype(np.intp),
                             np.minimum(np.rint(m / self.steps[1]).astype(np.intp), GRID_M),
                             np.rint(v / self.steps[2]).astype(np.intp))

    def below_at(self, child: np.ndarray, p: np.ndarray, t: np.ndarray, k: np.ndarray,
                 mc: np.ndarray, vc: np.ndarray) -> np.ndarray:
        """:meth:`below` given the grid indices of ``t``, ``m`` (at most ``GRID_M``), ``v``."""
        if self.kmax is not None:
            ok = k < self.kmax_flat.take(child * self.kmax[0].size + (p * (GRID_M + 1) + mc))
        else:
            ok = self.h[child, p, np.minimum(k, self.h.shape[2] - 1)] < self.limit
            if self.g is not None:
                ok &= np.maximum(self.g[0, child, p, mc],
                                 t + self.g[1, child, p, mc]) < self.limit
        if self.prune is not None:  # m clamped: only for pairs already ruled out
            _, size_p, size_m, size_v = self.prune.a.shape
            inside = vc < size_v
            at = (child * (size_p * size_m) + (p * size_m + mc)) * size_v + np.where(inside, vc,
                                                                                     0)
            lb = np.maximum(self.prune.a.ravel().take(at), t + self.prune.s.ravel().take(at))
            ok &= ~inside | (lb < self.limit)
        return ok


STAGE_TABLES = True
"""Whether grid runs look ``t'_P``, its index and ``alive`` up in
:attr:`DPTables.stage_tables` (the same values) rather than computing them per state."""
THRESHOLDS = True
"""Whether :class:`_Bounds` checks the bounds without ``V`` through its threshold table
(:attr:`_Bounds.kmax`; the same checks). ``False``: one lookup per bound, as before."""


def _grid_count(s: np.ndarray, step: float, limit: float) -> np.ndarray:
    """How many ``k = 0, 1, ...`` have ``k * step + s < limit`` (float sums; ``limit`` finite).

    The sum is nondecreasing in ``k``: the count is the least ``k`` where it reaches
    ``limit``, guessed from ``(limit - s) / step`` and corrected with the sums themselves.
    """
    with np.errstate(invalid="ignore"):
        k = np.clip(np.nan_to_num(np.floor((limit - s) / step), nan=0.0, neginf=0.0),
                    0, None).astype(np.int64)
    while True:
        down = (k > 0) & ((k - 1).astype(np.float64) * step + s >= limit)
        if not down.any():
            break
        k -= down
    while True:
        up = k.astype(np.float64) * step + s < limit
        if not up.any():
            return k
        k += up


def _collect(chunks: list[tuple[np.ndarray, _Level | None, np.ndarray]],
             steps: tuple[float, float, float] | None, prefix: bool = False) -> np.ndarray:
    """The distinct states of a level; the moves that lead there learn their indices.

    On the grids (``steps``) a state is an integer key (its grid indices); exact states are
    keyed by the codes of their distinct values. ``prefix`` (grids, a run without ``t_P``
    under :data:`PREFIX_BOUND`): the key leaves ``t_P`` out and a state keeps the least
    ``t_P`` of the rows that reach it.
    """
    if not chunks:
        return np.empty((0, 4))
    rows = np.concatenate([c for c, _, _ in chunks])
    if prefix and steps is not None:
        codes = [rows[:, 0]] + [np.rint(rows[:, k + 1] / steps[k]) for k in (1, 2)]
    elif steps is not None:  # grid values: their indices order them as their ranks do
        codes = [rows[:, 0]] + [np.rint(rows[:, k + 1] / steps[k]) for k in (0, 1, 2)]
    else:
        codes = [np.unique(rows[:, k], return_inverse=True)[1].ravel() for k in range(4)]
    if steps is not None:  # indices from the least one: the same order, fewer keys
        codes = [code - code.min() for code in codes]
    radix = [float(c.max()) + 1 for c in codes]
    size = math.prod(radix)
    if size <= DENSE_KEYS and steps is not None:  # float products exact below 2**53
        key_f = codes[0]
        for code, r in zip(codes[1:], radix[1:], strict=True):  # mixed-radix key
            key_f = key_f * r + code
        first, inverse = _dense_unique(key_f.astype(np.int64), int(size))
    elif size < 2**62:
        key = np.zeros(len(rows), dtype=np.int64)
        for code, r in zip(codes, radix, strict=True):  # mixed-radix key
            key = key * int(r) + code.astype(np.int64)
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    pos = 0
    for chunk, parent, where in chunks:
        if parent is not None:
            parent.child[where] = inverse[pos:pos + len(chunk)]
        pos += len(chunk)
    states = rows.take(first, axis=0)
    if prefix and steps is not None:
        least = np.full(len(first), np.inf)
        np.minimum.at(least, inverse, rows[:, 1])
        states[:, 1] = least
    return states


DENSE_KEYS = 1 << 24
"""Largest key range :func:`_collect` tabulates instead of sorting (grid states only)."""


def _dense_unique(key: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first, inverse)`` of ``np.unique`` for keys in ``[0, size)``, by a table, no sort.

    ``first`` is *an* occurrence of each key, not always the first (grid states with one key
    are one row, so any occurrence represents it); ``inverse`` is ``np.unique``'s.
    """
    present = np.zeros(size, dtype=bool)
    present[key] = True
    rank = np.cumsum(present) - 1
    where = np.empty(size, dtype=np.int64)
    where[key] = np.arange(len(key))
    keys = np.flatnonzero(present)
    return where[keys], rank[key]


def _expand(tb: DPTables, that: float, cap: float, rounders: tuple, j: int, level: _Level,
            pending: Pending, feasibility: bool = False, bounds: _Bounds | None = None,
            prefix: bool = False, grid: bool = False) -> None:
    """Moves of the states of level ``j``: every last stage ``i..j`` and GPU kind.

    ``prefix``: a run without ``t_P`` whose states carry the least ``t_P`` of the paths
    reaching them (:data:`PREFIX_BOUND`), checked like a run with ``t_P``.
    """
    rt, rm, rv = rounders
    active = np.nonzero(level.states[:, 0] > 0)[0]
    columns = tb.stage_columns[j]
    keep = columns[1] < cap  # loads grow as i drops
    count = int(np.count_nonzero(keep))
    if not len(active) or not count:
        return
    sliced = bool(keep[:count].all())
    ii, u, c, grows, stash, static = (col[:count] for col in columns) if sliced \
        else (col[keep] for col in columns)
    # (state, i) on a matrix: state-only columns, i-only rows, the same float operations
    # per pair as on a list of pairs (elementwise), listed by state, then i decreasing
    p, t, m, v = (col[:, None] for col in level.states.take(active, axis=0).T)
    tk = mi = ti = None
    if grid and sliced and STAGE_TABLES:  # t_P and m_P on the grid: rows of tables
        ti = np.rint(t[:, 0] / tb.steps()[0]).astype(np.intp)
        mi = np.rint(m[:, 0] / tb.steps()[1]).astype(np.intp)
        t_rows, k_rows, alive_rows = tb.stage_tables[j]
        if mi.max() >= len(alive_rows) or ti.max() >= len(t_rows):
            tk = mi = ti = None  # beyond the tables (not seen): computed below
    if mi is not None and ti is not None:
        alive = alive_rows.take(mi, axis=0)[:, :count] & (c < cap)
        if feasibility and not prefix:
            tp2, tk = np.zeros(alive.shape), np.zeros(alive.shape, dtype=np.intp)
        else:
            tp2, tk = t_rows.take(ti, axis=0)[:, :count], k_rows.take(ti, axis=0)[:, :count]
    else:
        # neither kind can hold i..j here, nor any longer stage: the recursion stops
        alive = np.logical_and.accumulate((grows + m <= tb.limit)
                                          | (grows + stash <= tb.limit), axis=1) & (c < cap)
        tp2 = np.zeros(alive.shape) if feasibility and not prefix else rt(t + u)
    normal, special = alive, alive & (np.maximum(tp2, c) < cap)
    if math.isfinite(cap) and bounds is None:  # U(1, i-1) on p-1 normal GPUs and the special
        rest = np.where(ii > 1, tb.load[1, ii - 1], 0.0)
        normal = alive & ((ii == 1) | ((rest + t) / p < cap))
        special &= (ii == 1) | ((rest + tp2) / (p + 1) < cap)
    vs = _oplus(v, u, that)
    q = np.ceil(vs / that - TOL)  # the group count's quotient, and the next (+)'s
    g = np.maximum(1.0, q)  # _group(vs, that)
    vn = np.where(ii > 1, rv(_oplus(vs, c, that, q)), 0.0)
    mp2 = rm(m + static + (g - 1) * stash)
    normal = normal & (static + g * stash <= tb.limit)
    special &= mp2 <= tb.limit
    if bounds is not None:  # the child states' lower bounds
        pi = p.astype(np.intp)
        if mi is not None and ti is not None and tk is not None:
            steps = tb.steps()
            vc = np.rint(vn / steps[2]).astype(np.intp)
            normal &= bounds.below_at(ii - 1, pi - 1, t, ti[:, None],
                                      np.minimum(mi, GRID_M)[:, None], vc)
            special &= bounds.below_at(ii - 1, pi, tp2, tk, np.minimum(
                np.rint(mp2 / steps[1]).astype(np.intp), GRID_M), vc)
        else:
            normal &= bounds.below(ii - 1, pi - 1, t, m, vn)
            special &= bounds.below(ii - 1, pi, tp2, mp2, vn)
    both = np.empty((*normal.shape, 2), dtype=bool)
    both[:, :, 0], both[:, :, 1] = normal, special
    flat = np.flatnonzero(both)  # (s len(ii) + k) 2 + kind: by state, i desc, N, S
    pair = flat >> 1  # s len(ii) + k: the (state, i) pair's place in the matrix
    is_special = (flat & 1).astype(bool)
    s, k = np.divmod(pair, len(ii))
    tp2, mp2, vn = (np.ravel(x).take(pair) for x in (tp2, mp2, vn))
    level.state = active.take(s)
    p, t, m, _ = level.states.take(level.state, axis=0).T
    level.first = ii[k]
    level.special = is_special
    level.load = u[k]
    level.value = np.where(is_special, tp2, level.load)
    level.link = c[k]
    level.child = np.zeros(len(s), dtype=np.int64)
    rows = np.column_stack([np.where(is_special, p, p - 1), np.where(is_special, tp2, t),
                            np.where(is_special, mp2, m), vn])
    order = np.argsort(k.astype(np.int16 if len(ii) < 2**15 else np.int64), kind="stable")
    rows = rows.take(order, axis=0)  # grouped by child level; each group a view
    edges = [0, *itertools.accumulate(np.bincount(k, minlength=len(ii)).tolist())]
    for i, a, b in zip(ii.tolist(), edges, edges[1:], strict=False):
        if b > a:
            pending[i - 1].append((rows[a:b], level, order[a:b]))

def _evaluate(tb: DPTables, that: float, cap: float, levels: list[_Level]
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Values of every state by increasing ``j`` and the move each one keeps (-1: base)."""
    n = tb.n
    offsets, flat = _flat(levels)
    flat[:offsets[1]] = levels[0].states[:, 1]  # T(0, ...) = t_P
    values: list[np.ndarray] = [flat[:offsets[1]]]
    chosen: list[np.ndarray] = [np.full(len(levels[0].states), -1)]
    for j in range(1, n + 1):
        poll_now()
        level = levels[j]
        states = level.states
        best = flat[offsets[j]:offsets[j + 1]]
        move = np.full(len(states), -1)
        base = states[:, 0] == 0
        if base.any():  # T(j, 0, ...): the prefix 1..j is one more special stage
            _, t, m, v = states[base].T
            g = _group(_oplus(v, float(tb.load[1, j]), that), that)
            ok = m + tb.static[1, j] + (g - 1) * tb.stash[1, j] <= tb.limit
            best[base] = np.where(ok, tb.load[1, j] + t, np.inf)
        if len(level.state):
            cand = np.maximum(np.maximum(level.value, level.link),
                              flat[_children(level, offsets)])
            starts = _starts(level.state)
            owners = level.state[starts]
            best[owners] = np.minimum.reduceat(cand, starts)
            hit = np.flatnonzero((cand == best[level.state]) & np.isfinite(cand))
            pick = hit[_starts(level.state[hit])]  # the first best move of each state
            move[level.state[pick]] = pick
        best[best >= cap] = np.inf
        values.append(best)
        chosen.append(move)
    return values, chosen


def _least(tb: DPTables, that: float, levels: list[_Level]
           ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """``max(least A, least special load)`` over the paths of a DP run without ``t_P``.

    Every allocation's estimate is ``max(A, t_P)`` (``A``: its largest normal stage or link,
    ``t_P`` its special load, rounded up): at least both minima. ``inf`` when nothing fits.
    Also the offsets, least ``A`` and least special load of every state (:class:`Prune`).
    """
    offsets, a_flat = _flat(levels)
    t_flat = np.full(len(a_flat), np.inf)
    a_flat[:offsets[1]] = t_flat[:offsets[1]] = 0.0
    for j in range(1, tb.n + 1):
        poll_now()
        level = levels[j]
        states = level.states
        a = a_flat[offsets[j]:offsets[j + 1]]
        t = t_flat[offsets[j]:offsets[j + 1]]
        base = states[:, 0] == 0
        if base.any():
            _, _, m, v = states[base].T
            g = _group(_oplus(v, float(tb.load[1, j]), that), that)
            ok = m + tb.static[1, j] + (g - 1) * tb.stash[1, j] <= tb.limit
            a[base] = np.where(ok, 0.0, np.inf)
            t[base] = np.where(ok, tb.load[1, j], np.inf)
        if len(level.state):
            below = _children(level, offsets)
            own = np.where(level.special, 0.0, level.load)
            cand_a = np.maximum(np.maximum(own, level.link), a_flat[below])
            cand_t = np.where(level.special, level.load, 0.0) + t_flat[below]
            starts = _starts(level.state)
            owners = level.state[starts]
            a[owners] = np.minimum.reduceat(cand_a, starts)
            t[owners] = np.minimum.reduceat(cand_t, starts)
    top = offsets[tb.n]
    bound = math.inf if top == offsets[tb.n + 1] else float(max(a_flat[top], t_flat[top]))
    return bound, offsets, a_flat, t_flat


def feasibility_run(tb: DPTables, that: float, exact: bool, cap: float = math.inf
                    ) -> tuple[float, int, Prune | None]:
    """A DP run without ``t_P``: a lower bound of the DP's value, states, :class:`Prune`.

    The bound is :func:`_least`'s; the :class:`Prune` table only on the grids.
    ``cap``: moves whose every completion has an estimate at ``cap`` or above are left out
    (the checks of a capped run with ``t_P = 0``, a lower bound of any ``t_P``), so the
    least completions are over the others: still lower bounds for a capped run with a cap
    up to ``cap`` (the completions left out could not bring its value below its cap), and
    so is the value (``>= cap``: the capped value is ``inf``).
    """
    levels = _levels(tb, that, exact, cap if BOUNDS else math.inf, True, None)
    bound, offsets, a_flat, t_flat = _least(tb, that, levels)
    prune = None if exact or not BOUNDS else Prune.of(tb, levels, a_flat, t_flat, offsets)
    return bound, sum(len(level.states) for level in levels), prune


def _flat(levels: list[_Level]) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of each level's states in one flat array, and that array (``inf``)."""
    offsets = np.zeros(len(levels) + 1, dtype=np.int64)
    np.cumsum([len(level.states) for level in levels], out=offsets[1:])
    return offsets, np.full(int(offsets[-1]), np.inf)


def _children(level: _Level, offsets: np.ndarray) -> np.ndarray:
    """Flat index of the state each move of ``level`` leads to."""
    return offsets[level.first - 1] + level.child


def _starts(owner: np.ndarray) -> np.ndarray:
    """Positions where a sorted owner array starts a new run."""
    new = np.empty(len(owner), dtype=bool)
    new[:1] = True
    np.not_equal(owner[1:], owner[:-1], out=new[1:])
    return np.flatnonzero(new)


def algorithm8(problem: PipelineProblem, *, exact: bool, iterations: int = K_ITERATIONS,
               stop: Callable[[], bool] | None = None
               ) -> tuple[float, float, Allocation | None, int]:
    """Algorithm 8: ``(estimate max(DP, T-hat), T-hat, allocation, DP states)``.

    The loop of the thesis (digest 5.4), unchanged. A DP call only matters when its value
    is below the best estimate so far (otherwise neither the estimate nor ``lb``/``ub``
    change), so it is capped there (:func:`madpipe_dp`), trying smaller caps first
    (:func:`_capped_dp`). ``stop`` (a time limit, :func:`solve_madpipe`): checked before
    each DP call once an allocation is found, which then ends the loop with the best so
    far (before stop 75 phase 1 ran whole: ``--time-limit 5`` took 9.4 s at L = 339).

    The DP calls poll the enclosing :func:`~optmem.models.interrupt.stop_when` (since
    stop 77: without an allocation phase 1 ran on, 6 s for a 5 s limit at L = 339,
    3 GiB): stopped inside one, the loop ends with the best allocation so far.

    Raises
    ------
    optmem.models.interrupt.Interrupted
        When stopped before any allocation was found.
    """
    tables = DPTables.of(problem)
    total = tables.total
    lb = total / problem.n_gpus
    ub = total + sum(tables.cost)
    that = lb
    best: tuple[float, float, Allocation | None] = (math.inf, math.nan, None)
    states = 0
    seen: list[tuple[float, float]] = []  # (T-hat, DP value) of the calls so far
    for _ in range(iterations):
        if stop is not None and best[2] is not None and stop():
            break
        floor = max((v for t, v in seen if t >= that and math.isfinite(v)), default=0.0)
        try:
            value, alloc, count = _capped_dp(problem, tables, that, exact, best[0], floor)
        except Interrupted:
            if best[2] is None:
                raise
            break  # the best allocation so far
        seen.append((that, value))
        states += count
        tilde = max(value, that)
        if tilde < best[0]:
            best = (tilde, that, alloc)
        lb = max(lb, min(value, that))
        ub = min(ub, tilde)
        that = (lb + ub) / 2
    if best[2] is None:  # last chance: the loosest T-hat
        value, alloc, count = _capped_dp(problem, tables, ub, exact, math.inf, 0.0)
        states += count
        if alloc is not None:
            best = (max(value, ub), ub, alloc)
    return best[0], best[1], best[2], states


CAP_GROWTH = 1.25
"""Ratio between successive caps tried by :func:`_capped_dp`."""


def _capped_dp(problem: PipelineProblem, tables: DPTables, that: float, exact: bool,
               cap: float, floor: float) -> tuple[float, Allocation | None, int]:
    """The DP's value and allocation when the value is below ``cap``, else ``inf``.

    The state space grows with the cap, so caps are tried from just above a lower bound of
    the value upwards: a DP run without ``t_P`` (:func:`_lower_bound`; ``inf`` when nothing
    fits), ``floor`` (the DP values at larger ``T-hat``, which the thesis shows do not
    exceed this one) and the load bound. Each capped call is exact below its cap, so the
    guess only decides the cost. Without a cap yet, on the grids:
    :func:`_capped_dp_per_limit`.
    """
    if not exact and BOUNDS and LIMIT_RUNS and not math.isfinite(cap):
        return _capped_dp_per_limit(problem, tables, that, cap, floor)
    bound, states, prune = feasibility_run(tables, that, exact, cap)
    if bound >= cap * (1 + PRUNE_SLACK):  # raw sums: the rounded t_P may be 1e-9 steps less
        return math.inf, None, states
    low = max(bound, floor, tables.total / problem.n_gpus,
              max(tables.load[q, q] for q in range(1, tables.n + 1)))
    limit = low * 1.04 + 1e-12
    while True:
        limit = min(limit, cap)
        value, alloc, count = madpipe_dp(problem, that, exact=exact, cap=limit, tables=tables,
                                         prune=prune)
        states += count
        if alloc is not None or limit >= cap:
            return value, alloc, states
        limit *= CAP_GROWTH


LIMIT_RUNS = True
"""Whether a grid DP call with no cap yet (Algorithm 8 has no estimate) runs its run
without ``t_P`` at each cap it tries (:func:`_capped_dp_per_limit`) rather than once
uncapped (no bound can then prune it). Calls with a cap run it once at that cap (trying
it at every cap cost more than it saved at 8-12 GiB on ResNet-152). ``False``: as before."""


def _capped_dp_per_limit(problem: PipelineProblem, tables: DPTables, that: float,
                         cap: float, floor: float) -> tuple[float, Allocation | None, int]:
    """:func:`_capped_dp` on the grids, with a run without ``t_P`` capped at each cap tried.

    Same value and allocation: for each cap ``limit`` tried, the run without ``t_P`` capped
    at ``limit`` gives a lower bound of the DP's value (at or above ``limit``: the DP
    capped there has no value, so it is not run) and the :class:`Prune` table of the DP
    capped there (valid for caps up to ``limit``). The first lower bound is
    :meth:`DPTables.relaxed_memory` at the top state (``inf``: nothing fits); ``cap`` is
    lowered to :func:`_ceiling` (no finite value reaches it), so the loop ends.
    """
    cap = min(cap, _ceiling(tables))
    top = tables.relaxed_memory(that)[:, tables.n, tables.n_gpus - 1, 0] if MEMORY_BOUND \
        else np.zeros(2)
    start = float(max(top))
    if start >= cap * (1 + PRUNE_SLACK):
        return math.inf, None, 0
    low = max(start, floor, tables.total / problem.n_gpus,
              max(tables.load[q, q] for q in range(1, tables.n + 1)))
    limit, states = low * 1.04 + 1e-12, 0
    while True:
        limit = min(limit, cap)
        bound, count, prune = feasibility_run(tables, that, False, limit)
        states += count
        if bound < limit * (1 + PRUNE_SLACK):
            value, alloc, count = madpipe_dp(problem, that, exact=False, cap=limit,
                                             tables=tables, prune=prune)
            states += count
            if alloc is not None:
                return value, alloc, states
        if limit >= cap:
            return math.inf, None, states
        limit *= CAP_GROWTH


def _ceiling(tables: DPTables) -> float:
    """A period above every finite value of the grid DP.

    Each term of an estimate is a stage's load, a link, or the special load (the loads,
    each sum rounded up by less than a step).
    """
    return (tables.total + tables.n * tables.steps()[0] + sum(tables.cost)) * (1 + 1e-6) + 1e-9


def gpu_labels(alloc: Allocation) -> list[int]:
    """GPU of each stage: special stages on GPU 0, normal ones on GPUs 1, 2, ..."""
    labels, nxt = [], 1
    for _, _, kind in alloc:
        if kind == "S":
            labels.append(0)
        else:
            labels.append(nxt)
            nxt += 1
    if 0 not in labels:
        labels = [g - 1 for g in labels]
    return labels


SKIP_PHASE2 = True
"""Whether phase 2 skips the models of an allocation that cannot matter (:func:`_skippable`).
``False``: every allocation's models run, as before (same result; ``tests`` and
``benchmarks/bench_madpipe.py`` compare both)."""
SKIP_SLACK = 1e-6
"""Relative margin of :func:`_skippable`: CP-SAT's period is within one time step (at most
``1e-7`` of the load bound) of its true value, so a bound is used as ``bound (1 - 1e-6)``."""


def allocation_bound(problem: PipelineProblem, units: Any) -> float:
    """A lower bound of the period of every plan either phase-2 model can return.

    The free model (any GPU for each unit; the fixed one is a restriction of it, so its
    plans are among the free model's) has ``T >=`` every GPU's load and ``T >=
    max(total / P, heaviest unit, lower_bound(problem))`` as constraints
    (:func:`~optmem.models.pipeline.load_bound`); with ``P + 1`` units or more, two of the
    ``P + 1`` heaviest share a GPU, so ``T >=`` the sum of the ``P``-th and ``(P + 1)``-th
    heaviest loads (pigeonhole).
    """
    loads = sorted((units.load(q) for q in range(units.n)), reverse=True)
    pair = loads[problem.n_gpus - 1] + loads[problem.n_gpus] if len(loads) > problem.n_gpus \
        else 0.0
    return max(load_bound(units, problem.n_gpus), lower_bound(problem), pair)


def _skippable(bound: float, incumbent: float, contiguous: float, estimate: float) -> bool:
    """Whether an allocation's phase-2 models cannot change the solve (exact skip).

    ``bound``: :func:`allocation_bound` of the allocation, so every plan of its models has
    a period of at least ``b = bound (1 - SKIP_SLACK)``. ``incumbent``: the best phase-2
    period so far, ``contiguous``: the contiguous 1F1B* candidate (computed before the
    ladder, appended after it), ``estimate``: the phase-1 estimate of the full memory.
    Skipped when ``b > estimate (1 + 1e-6)`` and ``b >= incumbent`` or ``b > contiguous``:

    * the returned plan is the first candidate of least period; the skipped models' plan
      (if any) would come after the incumbent and before the contiguous candidate, so a
      period ``>= incumbent`` or ``> contiguous`` is never chosen;
    * the ladder stops when the best phase-2 period reaches ``estimate (1 + 1e-6)``: the
      skipped plan could not (``b`` is above), and whether the fixed model's plan exists
      only decides if the free one runs, of which both are skipped together. So the same
      rungs run, with the same allocations and the same final plan.
    """
    low = bound * (1 - SKIP_SLACK)
    return low > estimate * (1 + 1e-6) and (low >= incumbent or low > contiguous)


def _phase2(problem: PipelineProblem, alloc: Allocation, options: SolveOptions,
            log: list[dict[str, Any]], skip: Callable[[float], bool] | None = None
            ) -> tuple[float, PipelinePlan] | None:
    """Schedule the DP's allocation: 1F1B* if contiguous, else the exact model (fixed, free).

    ``skip(bound)``: whether the models of an allocation whose plans have periods of at
    least ``bound`` (:func:`allocation_bound`) cannot matter (:func:`_skippable`).
    """
    bounds = [(i, j) for i, j, _ in alloc]
    labels = gpu_labels(alloc)
    if len(set(labels)) == len(labels) and problem.memory_model == "stash":
        found = contig.best_period_for_allocation(problem, bounds)
        log.append({"phase2": "1F1B*", "period": found[0] if found else None})
        return found
    units = make_units(problem, bounds)
    if skip is not None and SKIP_PHASE2:
        bound = allocation_bound(problem, units)
        if skip(bound):
            log.append({"phase2": "skipped", "bound": bound})
            return None
    method = phase2_engine(options)
    if options.time_limit_s is None and options.node_limit is None \
            and options.deterministic_time is None:
        options = options.with_(node_limit=PHASE2_NODE_LIMIT,
                                deterministic_time=PHASE2_DETERMINISTIC_TIME)
    for mode, gpu in (("fixed", labels), ("free", None)):
        run = run_model(problem, method, options, units=units, gpu=gpu, slim=PHASE2_SLIM)
        plan = run.plan
        log.append({"phase2": f"{method}-{mode}", "status": str(run.status),
                    "period": plan.period if plan is not None else None,
                    "model_size": run.report["model_size"]})
        if plan is not None:
            return plan.period, plan
    return None


def phase2_engine(options: SolveOptions) -> str:
    """``extra["phase2"]``: the engine of phase 2 (default CP-SAT when installed)."""
    return choice(options, "phase2", "cpsat" if _has_ortools() else "ilp", PHASE2_ENGINES)


def madpipe_settings(options: SolveOptions) -> tuple[str, int]:
    """``extra["madpipe_grid"]`` and ``["madpipe_iterations"]``, with ``["phase2"]`` checked.

    Raises
    ------
    OptmemInputError
        For a value outside :data:`MADPIPE_GRIDS`, a non-positive or non-integer iteration
        count or an unknown phase 2 engine (before any work).
    """
    phase2_engine(options)
    return (choice(options, "madpipe_grid", "auto", MADPIPE_GRIDS),
            positive_int(options, "madpipe_iterations", K_ITERATIONS))


def solve_madpipe(problem: PipelineProblem, options: SolveOptions) -> Result:
    """MadPipe: phase 1 (Algorithm 8), phase 2 with fallbacks; the best valid plan."""
    grid, iterations = madpipe_settings(options)
    if (below := below_least_memory(problem, "madpipe")) is not None:
        return below
    exact = grid == "exact" or (grid == "auto" and problem.layers.n <= EXACT_MAX_LAYERS)
    log: list[dict[str, Any]] = []
    candidates: list[tuple[float, PipelinePlan, str]] = []
    estimate = math.nan
    total_states = 0
    tried: set[tuple] = set()
    limit = options.time_limit_s
    deadline = None if limit is None else time.perf_counter() + limit

    def late() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    # first: it lets phase 2 skip models; the deadline stops its search too (stop 76)
    contiguous, stopped = _contiguous_candidate(problem, late if deadline is not None else None)
    skipped = 0
    phase1_stopped = False
    for factor in MEMORY_FACTORS:
        if late():  # the limit bounds phase 1 too (since stop 75)
            log.append({"memory_factor": factor, "phase1": "time limit reached"})
            break
        sub = problem if factor == 1.0 else scaled(problem, factor)
        try:  # its DP calls poll the deadline (since stop 77), before any allocation too
            with stop_when(late if deadline is not None else None):
                est, that, alloc, states = algorithm8(sub, exact=exact,
                                                      iterations=iterations, stop=late)
        except Interrupted:
            log.append({"memory_factor": factor, "phase1": "time limit reached"})
            phase1_stopped = True
            break
        total_states += states
        entry: dict[str, Any] = {"memory_factor": factor, "estimate": est, "t_hat": that}
        log.append(entry)
        if alloc is None:
            entry["allocation"] = None
            break  # less memory cannot help phase 1
        entry["allocation"] = " ".join(f"{k}:{i}-{j}" for i, j, k in alloc)
        if factor == 1.0:
            estimate = est
        key = tuple(alloc)
        if key in tried:
            entry["phase2"] = "allocation already scheduled"
            continue
        tried.add(key)
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                entry["phase2"] = "time limit reached"
                break  # the limit bounds the whole run (a limit of 0 is no limit)
            options = options.with_(time_limit_s=left)
        incumbent = min((c[0] for c in candidates), default=math.inf)
        skip = partial(_skippable, incumbent=incumbent, estimate=estimate,
                       contiguous=contiguous[0] if contiguous else math.inf)
        found = _phase2(problem, alloc, options, log, skip)
        skipped += log[-1].get("phase2") == "skipped"
        if found is not None and not fits(problem, found[1]):
            log.append({"phase2": "rejected by the simulator"})
            found = None
        if found is not None:
            candidates.append((found[0], found[1], f"phase 2, memory x{factor}"))
            if min(c[0] for c in candidates) <= estimate * (1 + 1e-6):
                break  # the valid period reaches the phase-1 estimate of the full memory
    if contiguous is not None:
        candidates.append((contiguous[0], contiguous[1], "contiguous 1F1B*"))
    report = {"phase1_estimate": estimate, "attempts": log, "dp_states": total_states,
              "phase2_skipped": skipped, "phase2_models": sum(
                  str(a.get("phase2", "")).startswith(("cpsat", "ilp")) for a in log),
              "grid": "exact" if exact else f"{GRID_T}x{GRID_M}x{GRID_V}"}
    if stopped:
        report["stopped"] = stopped_during("the contiguous candidate")
    elif phase1_stopped:
        report["stopped"] = stopped_during("phase 1")
    if not candidates:
        res = infeasible(problem, "madpipe", "phase 1 found no allocation or phase 2 could "
                         "not schedule it", proven=False, report=report)
        # stopped: the load bound, as contiguous's stopped search (stop 77)
        return res.with_(bound=lower_bound(problem)) if phase1_stopped else res
    period, plan, source = min(candidates, key=lambda c: c[0])
    report["source"] = source
    return plan_result(problem, plan, method="madpipe", status=Status.FEASIBLE,
                       bound=lower_bound(problem), claimed=period,
                       solver=options.solver, report=report)


def _contiguous_candidate(problem: PipelineProblem, stop: Callable[[], bool] | None = None
                          ) -> tuple[tuple[float, PipelinePlan] | None, bool]:
    """The best contiguous allocation scheduled by 1F1B* (stash memory model only).

    With whether ``stop`` (the solve's deadline, stop 76) stopped
    :func:`contig.best_contiguous`: the plan is then the one of the least period it found
    feasible so far. The stop is asked once a split is found (``keep_first``), so MadPipe
    has this candidate whenever a contiguous split fits, as before.
    """
    if problem.memory_model != "stash":
        return None, False
    best_contig = contig.best_contiguous(problem, stop=stop, keep_first=True)
    if best_contig is None:
        return None, False
    return (best_contig.period, best_contig.plan), best_contig.stopped


def _has_ortools() -> bool:
    import importlib.util

    return importlib.util.find_spec("ortools") is not None
