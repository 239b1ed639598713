"""Remat + offload methods behind the facade (problem ``remat-offload``).

Thesis chapter 4 (digest ``shared/design/offload.md`` section 5) and DELTA (digest
``shared/design/hong_delta.md`` part B):

* ``dp``: the chapter 4 DP "pofo" (:mod:`optmem.solvers.remat_offload_dp`) on a memory grid
  of ``grid`` x ``backlog_grid`` values (:func:`grid_of`; the thesis used N = 50), whose
  compute ops and offloaded inputs are turned into a plan by
  :mod:`optmem.solvers.remat_offload_schedule`. Variants (the segment-bound option, digest
  5.4 and erratum 14): ``thesis`` reproduces the text (``t <= L-1``, the pofo plan only);
  ``extended`` uses ``t <= L``; ``never-worse`` (default) is ``extended`` and also replays
  the optimal persistent checkpoint plan and the offload-only DYNPROG plan, keeping the
  fastest, so it is never worse than either pure method;
* ``opportunist``, ``autocapper``: the heuristics of thesis 4.3 (digest 5.8);
* ``remat_only``, ``offload_only``: the pure baselines (persistent checkpoint DP, DYNPROG);
* ``delta``: the DELTA-style online policy (filter + director) simulated on the chain
  (:mod:`optmem.solvers.remat_offload_delta`);
* ``brute`` / ``cpsat``: exact models on tiny / small chains
  (:mod:`optmem.solvers.remat_offload_exact`).

Every plan is replayed by :func:`optmem.simulate.offload.simulate_offload` on the
discretised chain (``slots``); the objective is the simulated makespan, the peak is checked
against the limit, and a method whose plan does not replay returns ``status: error``.
``bound`` is the sum of all compute times (every op runs at least once).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.models.interrupt import Interrupted, stop_when
from optmem.plan import AnyOp, Op, OpKind, parse_mixed_plan
from optmem.problems.checkpoint import CheckpointProblem, Discretized, discretize
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import value_size
from optmem.simulate.offload import simulate_offload
from optmem.simulate.verify import Replay, Wording, replay_result
from optmem.solvers.checkpoint import dp_min_memory
from optmem.solvers.checkpoint_baselines import store_all_or_chen
from optmem.solvers.checkpoint_dp import (
    PersistentTable,
    solve_persistent_table,
)
from optmem.solvers.hints import AS_SOLVED, too_few_slots
from optmem.solvers.offload import replay_offload
from optmem.solvers.options import one_or_all, positive_int
from optmem.solvers.registration import register
from optmem.solvers.remat_offload_dp import PofoDP, checkpoint_subplan
from optmem.solvers.remat_offload_schedule import (
    PREFETCH_POLICIES,
    Window,
    backward_windows,
    best_placement,
    static_replay,
    window_before,
)
from optmem.solvers.time_budget import Deadline, stopped_during

PROBLEM = "remat-offload"
DEFAULT_GRID = 200
DEFAULT_BACKLOG_GRID = 25
DP_VARIANTS = ("never-worse", "extended", "thesis")
AUTOCAPPER_VALUES = 40
LEAST_ENGINE_TIME_S = 1.0  # an exact method's engine call always gets this long (it needs a
# positive limit): the search, the relaxation, every Benders master and subproblem
WORDING = Wording(invalid="the plan does not replay: ")


LINK_CAP = 1e200
"""Fastest link the remat + offload solvers compute with (memory units of the discretised
chain per time unit). A faster link moves every value (at most 2^50 units) in under 1e-185
time units, at the cap too: every makespan is the same to float precision at any time a
chain holds (at least 1e-9), while the link's products with times (at most 1e12) stay
finite. At a chain bandwidth of 1e308 they overflowed the DP (``OverflowError``, a wrong
``infeasible``) and the exact models' rows ("Cannot set constraint RHS to NaN/inf
values"): a stop-78 fuzz case. ``optmem verify`` replays at the problem's own bandwidth."""


def discretized(problem: RematOffloadProblem, options: SolveOptions) -> tuple[Discretized, float]:
    """The discretised instance (``options.slots``) and the bandwidth in its units.

    The bandwidth is capped at :data:`LINK_CAP`.
    """
    disc = problem.discretize(options.slots)
    return disc, min(problem.unit_bandwidth(disc.unit), LINK_CAP)


def lower_bound(problem: RematOffloadProblem) -> float:
    """Every forward and backward runs at least once: the sum of all compute times."""
    return problem.chain.total_compute_time()


def plan_result(problem: RematOffloadProblem, options: SolveOptions, plan: Sequence[AnyOp], *,
                method: str, status: Status = Status.FEASIBLE, variant: str | None = None,
                report: dict | None = None, solver: str | None = None,
                claimed: float | None = None) -> Result:
    """Replay ``plan`` and build the result from the simulation (objective = makespan).

    :func:`optmem.simulate.verify.replay_result`: a plan that does not replay, a claim the
    simulator does not reproduce or a peak above the limit is an ``error``.
    """
    disc, beta = discretized(problem, options)

    def replay() -> Replay:
        return replay_offload(problem, disc, beta, plan, {
            "recomputed_forwards": _recomputed(plan, problem.chain.length)})

    return replay_result(PROBLEM, method, status, tuple(str(op) for op in plan), replay,
                         bound=lower_bound(problem), claimed=claimed,
                         memory_limit=disc.memory_limit, unit=disc.unit, variant=variant,
                         solver=solver, report=report, wording=WORDING)


def _recomputed(plan: Sequence[AnyOp], length: int) -> int:
    forwards = sum(1 for op in plan if isinstance(op, Op)
                   and op.kind in (OpKind.F_ALL, OpKind.F_CK, OpKind.F_NONE))
    return forwards - length


def no_plan_result(problem: RematOffloadProblem, options: SolveOptions, method: str,
                   status: Status, report: dict, variant: str | None = None) -> Result:
    """A result without a plan (``infeasible``: bound ``inf``; else the compute-time bound)."""
    disc, _ = discretized(problem, options)
    bound = math.inf if status is Status.INFEASIBLE else lower_bound(problem)
    return Result(PROBLEM, method, status, bound=bound, memory_limit=disc.memory_limit,
                  unit=disc.unit, variant=variant, report=report)


def below_least_forward(problem: RematOffloadProblem, options: SolveOptions, method: str,
                        report: dict | None = None) -> Result | None:
    """``infeasible`` when the limit is below the least memory of every plan, else ``None``.

    Every plan runs some forward of each stage with its input and output on the GPU
    (:func:`_least_forward_memory`, on the discretised chain the methods solve), so a method
    whose own search only finds plans (``offload_only``, ``opportunist``, ``autocapper``,
    ``delta``) proves such a limit infeasible at once (stop 71: three of them answered
    ``no_solution``), and the exact models (``ilp``, ``cpsat``) answer it without a search
    (they searched, and named no bound).

    Returns
    -------
    Result or None
        ``infeasible`` with report keys ``hint`` and ``memory_lower_bound`` (in the chain's
        memory unit), or ``None``.
    """
    disc, _ = discretized(problem, options)
    least = _least_forward_memory(disc.chain)
    if disc.memory_limit >= least:
        return None
    return no_plan_result(problem, options, method, Status.INFEASIBLE, {
        **(report or {}), "memory_lower_bound": least * disc.unit,
        "hint": f"every plan needs at least {least * disc.unit} "
                f"{problem.chain.memory_unit} (the least memory of some forward)"})


# ------------------------------------------------------------------ candidates
def checkpoint_table(disc: Discretized, budget: int | None = None) -> PersistentTable | None:
    """Persistent checkpoint table of the discretised chain.

    ``None`` if ``a^0`` alone is over the limit.
    """
    m = disc.memory_limit - disc.chain.input_size if budget is None else budget
    if m < 0:
        return None
    return solve_persistent_table(disc.chain, m, "paper")


def remat_candidate(disc: Discretized) -> tuple[Op, ...] | None:
    """The optimal persistent checkpoint plan (no transfer), or ``None``."""
    table = checkpoint_table(disc)
    if table is None or not math.isfinite(table.value()):
        return None
    return table.plan()


def shortest_transfer(chain: Chain, beta: float) -> float:
    """Time of the shortest transfer of a value of positive size (``inf`` if none).

    ``beta``: the bandwidth in ``chain``'s units (:func:`discretized`); a transfer of ``x``
    units takes ``x / beta`` (O.2). Every ``a^i`` and ``abar^i`` of the chain counts.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> c = Chain.from_lists([1, 1], [1, 1], [4, 2], [6, 3], input_size=5)
    >>> shortest_transfer(c, 2.0), shortest_transfer(c, 0.0)
    (1.0, inf)
    """
    values = [("a", i) for i in range(chain.length + 1)] + \
        [("abar", i) for i in range(1, chain.length + 1)]
    sizes = [size for value in values if (size := value_size(chain, value)) > 0]
    return min(sizes) / beta if sizes and beta > 0 else math.inf


def offload_candidate(problem: RematOffloadProblem, options: SolveOptions
                      ) -> tuple[AnyOp, ...] | None:
    """The offload-only DYNPROG plan of :mod:`optmem.solvers.offload`, or ``None``."""
    from optmem.problems.offload import OffloadProblem
    from optmem.solvers.offload import solve_dynprog

    if problem.chain_bandwidth <= 0:
        return None
    res = solve_dynprog(OffloadProblem(problem.chain, problem.memory_limit,
                                       chain_bandwidth=problem.chain_bandwidth),
                        options.with_(variant=None))
    return parse_mixed_plan(res.plan) if res.status.has_plan else None


def grid_of(options: SolveOptions) -> tuple[int, int]:
    """DP grids: memory values ``N_A`` and backlog values ``N_D`` (thesis: N = 50 for both).

    ``options.extra['grid']`` (default ``min(slots, 200)``) discretises the kept memory
    ``A``; ``options.extra['backlog_grid']`` (default 25) the backlogs ``dF``, ``dB``,
    ``Delta``. The forward table has ``2 L N_A N_D^2`` states, the backward one
    ``L^2 N_A N_D / 2`` (thesis Thm 12 with N split in two).
    """
    return (positive_int(options, "grid", min(options.slots, DEFAULT_GRID)),
            positive_int(options, "backlog_grid", DEFAULT_BACKLOG_GRID))


def prefetch_policies(options: SolveOptions) -> tuple[str, ...]:
    """``extra["prefetch"]``: the placement policies tried (one, else all of them).

    One of :data:`~optmem.solvers.remat_offload_schedule.PREFETCH_POLICIES`; every method
    that places transfers with :func:`best_placement` reads it (a bad value is one
    :class:`OptmemInputError`, raised before any work).

    Examples
    --------
    >>> prefetch_policies(SolveOptions(extra={"prefetch": "lazy"}))
    ('lazy',)
    """
    return one_or_all(options, "prefetch", PREFETCH_POLICIES)


def pofo_plan(problem: RematOffloadProblem, options: SolveOptions, last_segment: str,
              info: dict | None = None) -> tuple[tuple[AnyOp, ...] | None, dict]:
    """Solve the chapter 4 DP on the coarse grid and place its transfers (fine grid).

    The transfers are placed with the policies of :func:`prefetch_policies` (the fastest
    replay kept; ``info["prefetch"]``: its policy). ``info`` (a new dict when not given)
    gets the report keys as they are known: a solve stopped in the placement, which polls
    its deadline since stop 80, has the DP's (``dp_value`` among them).
    """
    policies = prefetch_policies(options)  # a bad policy fails before the DP
    disc, beta = discretized(problem, options)
    grid, backlog = grid_of(options)
    # coarsen the discretised chain by an integer factor: conservative w.r.t. ``disc``
    coarse = discretize(disc.chain, disc.memory_limit, grid)
    q = max(1, -(-coarse.memory_limit // backlog))
    dp = PofoDP(coarse.chain, coarse.memory_limit, beta / coarse.unit, last_segment,
                backlog_unit=q)
    sol = dp.solve()
    info = {} if info is None else info
    info.update({"dp_value": sol.value, "dp_states": sol.states, "grid": grid,
                 "backlog_grid": backlog, "grid_unit": coarse.unit * disc.unit,
                 "backlog_unit": q * coarse.unit * disc.unit, "last_segment": last_segment})
    if not math.isfinite(sol.value):
        return None, info
    info["dp_offloaded"] = [f"{k} {i}" for k, i in sol.offloaded]
    static = static_replay(disc.chain, sol.ops)
    windows = backward_windows(disc.chain, sol.ops, static, sol.offloaded)
    found = best_placement(disc.chain, beta, disc.memory_limit, sol.ops, windows, policies)
    if found is None:
        info["placement"] = ("no prefetch policy fits" if len(policies) > 1 else
                             f"prefetch policy {policies[0]} does not fit")
        return None, info
    plan, _, policy = found
    info["prefetch"] = policy
    return plan, info


def best_candidate(problem: RematOffloadProblem, options: SolveOptions,
                   candidates: Sequence[tuple[str, Sequence[AnyOp] | None]],
                   seen: dict | None = None) -> tuple[str, Sequence[AnyOp], float] | None:
    """The fastest candidate plan that replays within the limit: ``(label, plan, makespan)``.

    ``seen`` (when given) collects each replayed candidate's makespan by label.
    """
    disc, beta = discretized(problem, options)
    best = None
    for label, plan in candidates:
        if plan is None:
            continue
        try:
            sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
        except PlanError:
            continue
        if seen is not None:
            seen[label] = sim.makespan
        if best is None or sim.makespan < best[2] - 1e-12:
            best = (label, plan, sim.makespan)
    return best


# ------------------------------------------------------------------ methods
POFO = "pofo"
REMAT_LABEL = "remat only (persistent DP)"
OFFLOAD_LABEL = "offload only (DYNPROG)"
DP_STAGES = {POFO: "the DP", REMAT_LABEL: "the checkpoint-only DP",
             OFFLOAD_LABEL: "the offload-only DP"}
"""``report["stopped"]`` of a ``dp`` solve stopped in each candidate's computation (stop 79):
``"time limit (during the DP)"`` in the chapter 4 DP (:func:`stopped_during`)."""
PLACEMENT_STAGE = "the DP's transfer placement"
"""``report["stopped"]`` stage of a ``dp`` solve stopped after the chapter 4 DP, while its
transfers are placed (stop 80)."""
HINT_STAGE = "the smallest-memory search"
"""``report["stopped"]`` stage of a ``dp`` solve that found no plan and was stopped while it
searched the smallest memory of a checkpoint plan for its hint (stop 80)."""


def _finished(found: dict[str, Sequence[AnyOp] | None]) -> list[tuple[str, Sequence[AnyOp] | None]]:
    """The ``dp`` candidates computed so far, in the fixed order they are compared in."""
    return [(label, found[label]) for label in DP_STAGES if label in found]


def _dp_candidates(problem: RematOffloadProblem, options: SolveOptions, variant: str,
                   found: dict[str, Sequence[AnyOp] | None], info: dict, deadline: Deadline
                   ) -> str | None:
    """Compute the ``dp`` candidates into ``found`` by ``deadline``.

    The chapter 4 DP (``pofo``; its report keys into ``info``), and for ``never-worse`` the
    checkpoint-only and offload-only plans, which run first under a time limit (they are
    cheap and are what a stopped solve answers with), after it without one. Every DP
    polls the solve's :class:`~optmem.solvers.time_budget.Deadline` (stop 79: the chapter
    4 DP ran 6 s at L = 40 under ``--time-limit 0.05``), and so do the checkpoint DP's
    table set-up and the chapter 4 plan's transfer placement (stop 80).

    Returns
    -------
    str or None
        The label of the candidate whose computation the limit stopped, or ``None``.
    """
    last = "thesis" if variant == "thesis" else "extended"

    def pofo() -> Sequence[AnyOp] | None:
        return pofo_plan(problem, options, last, info)[0]

    makers: list[tuple[str, Callable[[], Sequence[AnyOp] | None]]] = []
    if variant == "never-worse":
        disc, _ = discretized(problem, options)
        makers = [(REMAT_LABEL, lambda: remat_candidate(disc)),
                  (OFFLOAD_LABEL, lambda: offload_candidate(problem, options))]
    makers.insert(0 if deadline.end is None else len(makers), (POFO, pofo))
    with stop_when(deadline.stopper()):
        for label, make in makers:
            try:
                found[label] = make()
            except Interrupted:
                return label
    return None


def _dp_stopped(problem: RematOffloadProblem, options: SolveOptions, variant: str,
                found: dict[str, Sequence[AnyOp] | None], info: dict, label: str) -> Result:
    """The answer of a ``dp`` solve whose time limit stopped the computation of ``label``.

    The fastest finished candidate that replays (``feasible``), else store-all when its
    peak fits, else Chen's ``sqrt(L)`` segments (no DP, replayed), else ``no_solution``
    with the compute-time bound; never ``infeasible``. ``report["stopped"]`` names the
    stage (:data:`DP_STAGES`; :data:`PLACEMENT_STAGE` once the chapter 4 DP has its value),
    ``report["choice"]`` the plan.
    """
    disc, _ = discretized(problem, options)
    stage = PLACEMENT_STAGE if label == POFO and "dp_value" in info else DP_STAGES[label]
    report = {**info, "stopped": stopped_during(stage)}
    seen: dict[str, float] = {}
    best = best_candidate(problem, options, _finished(found), seen)
    if best is None:
        best = best_candidate(problem, options,
                              [store_all_or_chen(disc.chain, disc.memory_limit)], seen)
    report["candidates"] = seen
    if best is None:
        return no_plan_result(problem, options, "dp", Status.NO_SOLUTION, report, variant)
    report["choice"] = best[0]
    return plan_result(problem, options, best[1], method="dp", variant=variant, report=report)


@register(PROBLEM, "dp", exact=False, default=True,
          description="thesis ch. 4 DP (pofo): remat + offload; variants never-worse, "
                      "extended, thesis",
          compare_as=(("dp", None), ("dp:thesis", None)),
          extra=("grid", "backlog_grid", "prefetch"), variants=DP_VARIANTS)
def solve_dp(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """The chapter 4 DP; ``report['dp_value']`` is its value under Assumptions 4.

    ``options.time_limit_s`` bounds the DPs (:func:`_dp_candidates`); stopped, the answer
    is :func:`_dp_stopped`'s.
    """
    variant = options.variant or "never-worse"
    if variant not in DP_VARIANTS:
        raise OptmemInputError(f"unknown dp variant {variant!r} (expected one of "
                               f"{', '.join(DP_VARIANTS)})", field="variant")
    prefetch_policies(options)  # bad options fail before any DP
    grid_of(options)
    found: dict[str, Sequence[AnyOp] | None] = {}
    info: dict = {}
    deadline = Deadline.start(options.time_limit_s)
    stopped = _dp_candidates(problem, options, variant, found, info, deadline)
    if stopped is not None:
        return _dp_stopped(problem, options, variant, found, info, stopped)
    plan = found[POFO]
    seen: dict[str, float] = {}
    best = best_candidate(problem, options, _finished(found), seen)
    info["candidates"] = seen
    if best is None:
        if plan is not None:  # the pofo plan exists but does not replay: an error
            return plan_result(problem, options, plan, method="dp", variant=variant,
                               report=info)
        status = Status.INFEASIBLE if not math.isfinite(info["dp_value"]) else \
            Status.NO_SOLUTION
        _no_plan_hint(problem, options, info, deadline)
        return no_plan_result(problem, options, "dp", status, info, variant)
    info["choice"] = best[0]
    return plan_result(problem, options, best[1], method="dp", variant=variant, report=info)


def _no_plan_hint(problem: RematOffloadProblem, options: SolveOptions, info: dict,
                  deadline: Deadline) -> None:
    """``info["hint"]`` and ``info["checkpoint_min_memory"]`` of a ``dp`` that found no plan.

    The smallest memory of a persistent checkpoint plan (:func:`dp_min_memory`: the DP's
    recurrence on the chain rounded to many units, 8.8 s at L = 339) is searched by
    ``deadline``; stopped (since stop 80; it ran whole before), the hint says so,
    ``checkpoint_min_memory`` is ``None`` and ``report["stopped"]`` names
    :data:`HINT_STAGE`. The answer's status is the DPs' (they finished).
    """
    try:
        with stop_when(deadline.stopper()):
            least = dp_min_memory(CheckpointProblem(problem.chain, problem.memory_limit),
                                  options, "paper")
    except Interrupted:
        info["stopped"] = stopped_during(HINT_STAGE)
        info["hint"] = ("no plan fits; the time limit stopped the search for the smallest "
                        "memory of a persistent checkpoint plan (no transfers)")
        info["checkpoint_min_memory"] = None
        return
    info["hint"] = ((f"no plan fits; the smallest memory of a persistent checkpoint plan "
                     f"(no transfers) is {least} {problem.chain.memory_unit} ({AS_SOLVED}; "
                     "offloading may need less: try a larger bandwidth or grid)")
                    if least is not None else
                    f"no plan fits; none without transfers at any limit with slots = "
                    f"{options.slots}: {too_few_slots()}")
    info["checkpoint_min_memory"] = least


@register(PROBLEM, "remat_only", exact=False,
          description="baseline: optimal persistent checkpoint plan (no transfer)")
def solve_remat_only(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """The persistent checkpoint DP's plan replayed with the link idle."""
    disc, _ = discretized(problem, options)
    plan = remat_candidate(disc)
    if plan is None:
        least = dp_min_memory(CheckpointProblem(problem.chain, problem.memory_limit), options,
                              "paper")
        hint = (f"the smallest memory of a persistent checkpoint DP plan is {least} "
                f"{problem.chain.memory_unit} ({AS_SOLVED})" if least is not None else
                f"the persistent checkpoint DP finds no plan at any limit with slots = "
                f"{options.slots}: {too_few_slots()}")
        return no_plan_result(problem, options, "remat_only", Status.INFEASIBLE,
                              {"hint": hint}).with_(min_feasible_memory=least)
    return plan_result(problem, options, plan, method="remat_only")


@register(PROBLEM, "offload_only", exact=False,
          description="baseline: DYNPROG offload set, store-all sequence (no recompute)",
          extra=("prefetch",))
def solve_offload_only(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """The offload problem's DYNPROG plan."""
    prefetch_policies(options)  # a bad policy fails before any answer
    if (below := below_least_forward(problem, options, "offload_only")) is not None:
        return below
    plan = offload_candidate(problem, options)
    if plan is None:
        return no_plan_result(problem, options, "offload_only", Status.NO_SOLUTION,
                        {"hint": "DYNPROG finds no offload-only plan"})
    return plan_result(problem, options, plan, method="offload_only")


# ------------------------------------------------------------------ heuristics (thesis 4.3)
def opportunist_ops(disc: Discretized, beta: float, table: PersistentTable
                    ) -> tuple[list[Op], list[tuple[str, int]]] | None:
    """Compute ops and offloaded values of the opportunist heuristic (digest 5.8).

    Group by group: ``F_all s`` with its input and its tape ``abar^s`` offloaded, then
    ``F_ck s+1``, ``F_none`` until the link has moved both (estimated with back-to-back
    compute), until the rest of the chain runs without recomputation in the memory left;
    the rest and each group's backward come from the persistent checkpoint DP.
    """
    ch = disc.chain
    L, M = ch.length, disc.memory_limit
    a = [ch.input_size, *ch.output_size, 0]
    abar = [ch.input_size, *ch.saved_size, 0]
    uf = [0.0, *ch.fwd_time, 0.0]
    ub = [0.0, *ch.bwd_time, ch.loss_bwd_time]
    fwd: list[Op] = []
    tails: list[list[Op]] = []
    offloaded: list[tuple[str, int]] = []
    s, x, clock, link = 1, 0, 0.0, 0.0
    while True:
        inp = abar[s - 1] if x else a[s - 1]
        budget = M - inp
        rest_time = sum(uf[s:L + 1]) + sum(ub[s:L + 2])
        value = float(table.cost[s, L + 1, budget]) if 0 <= budget <= table.budget else math.inf
        if math.isfinite(value) and value <= rest_time + 1e-9:
            fwd.extend(checkpoint_subplan(table, s, L + 1, budget))
            break
        if s >= L or beta <= 0:
            return None
        # F_all s, offload its input and its tape
        in_value = ("abar", s - 1) if x and s > 1 else ("a", s - 1)
        offloaded += [in_value, ("abar", s)]
        fwd.append(Op.parse(f"F_all {s}"))
        link = max(link, clock) + inp / beta
        clock += uf[s]
        link = max(link, clock) + abar[s] / beta
        # F_ck s+1, F_none until the transfers are done
        t = s + 1
        clock += uf[t]
        while clock < link and t < L:
            t += 1
            clock += uf[t]
        fwd.append(Op.parse(f"F_ck {s + 1}"))
        fwd.extend(Op.parse(f"F_none {k}") for k in range(s + 2, t + 1))
        m = M - abar[s]
        if not (0 <= m <= table.budget) or not math.isfinite(float(table.cost[s + 1, t, m])):
            return None
        tail = checkpoint_subplan(table, s + 1, t, m) + [Op.parse(f"B {s}")]
        tails.append(tail)
        s, x = t + 1, 0
        if s > L:  # the loss is next: its input a^L stays
            fwd.append(Op.parse("Loss"))
            break
    ops = list(fwd)
    for tail in reversed(tails):
        ops.extend(tail)
    return ops, offloaded


@register(PROBLEM, "opportunist", exact=False,
          description="thesis 4.3 opportunist: keep the link busy, remat DP per group",
          extra=("prefetch",))
def solve_opportunist(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """The opportunist heuristic (may find no plan at low memory, as in the thesis)."""
    prefetch_policies(options)  # a bad policy fails before any work
    if (below := below_least_forward(problem, options, "opportunist")) is not None:
        return below
    disc, beta = discretized(problem, options)
    table = checkpoint_table(disc, disc.memory_limit)
    built = opportunist_ops(disc, beta, table) if table is not None else None
    if built is None:
        return no_plan_result(problem, options, "opportunist", Status.NO_SOLUTION,
                        {"hint": "the opportunist heuristic finds no plan here"})
    ops, values = built
    return _placed(problem, options, "opportunist", ops, values, {})


def _placed(problem: RematOffloadProblem, options: SolveOptions, method: str,
            ops: Sequence[Op], values: Sequence[tuple[str, int]] | None, report: dict,
            windows: Sequence[Window] | None = None) -> Result:
    disc, beta = discretized(problem, options)
    try:
        static = static_replay(disc.chain, ops)
        if windows is None:
            windows = backward_windows(disc.chain, ops, static, values or ())
        found = best_placement(disc.chain, beta, disc.memory_limit, ops, windows,
                               prefetch_policies(options))
    except PlanError as exc:
        report["error"] = f"invalid compute sequence: {exc}"
        return no_plan_result(problem, options, method, Status.ERROR, report)
    if found is None:
        report["hint"] = "the transfers cannot be placed within the memory limit"
        return no_plan_result(problem, options, method, Status.NO_SOLUTION, report)
    plan, _, policy = found
    report["prefetch"] = policy
    return plan_result(problem, options, plan, method=method, report=report)


def capper_windows(disc: Discretized, ops: Sequence[Op]) -> list[Window] | None:
    """Capper (digest 5.8): offload the lowest-indexed value resident at the peak, repeat.

    Returns the windows once the sequence fits in the limit (``None`` if it never does).
    """
    ch = disc.chain
    static = static_replay(ch, ops)
    windows: list[Window] = []
    host = [0] * len(ops)
    from optmem.simulate.offload import reads

    while True:
        mem = [p - h for p, h in zip(static.peaks, host, strict=True)]
        j = max(range(len(ops)), key=lambda k: mem[k])
        if mem[j] <= disc.memory_limit:
            return windows
        done = False
        for value in sorted((v for v in static.before[j] if v[0] != "delta"),
                            key=lambda v: (v[1], v[0])):
            if reads(ops[j], value, ch.length):
                continue
            if any(w.value == value and w.last < j < w.consumer for w in windows):
                continue
            consumer = next((k for k in range(j + 1, len(ops))
                             if reads(ops[k], value, ch.length)), None)
            if consumer is None:
                continue
            w = window_before(ch, ops, static, value, consumer)
            if w is None and value == ("a", 0):
                last = max((k for k in range(consumer) if reads(ops[k], value, ch.length)),
                           default=-1)
                w = Window(value, 0, last, consumer) if 0 <= last < j else None
            if w is None or not w.last < j < w.consumer:
                continue
            windows.append(w)
            size = value_size(ch, value)
            for k in range(w.last + 1, w.consumer):
                host[k] += size
            done = True
            break
        if not done:
            return None


@register(PROBLEM, "autocapper", exact=False,
          description="thesis 4.3 autocapper: capper for 40 relaxed limits, best simulated",
          extra=("autocapper_values", "prefetch"))
def solve_autocapper(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Capper(M') for ``AUTOCAPPER_VALUES`` values of M' in [M, M_high]; keep the best."""
    count = positive_int(options, "autocapper_values", AUTOCAPPER_VALUES)
    policies = prefetch_policies(options)
    disc, beta = discretized(problem, options)
    ch = disc.chain
    high = max(disc.memory_limit, _store_all_peak(ch))
    # below the least memory of any forward nothing fits (and a limit far below the chain's
    # sizes, such as 0 on a chain in bytes, would tabulate up to the store-all peak in bytes)
    below = below_least_forward(problem, options, "autocapper") if beta > 0 else None
    if below is not None:
        return below  # without a link remat_only's hint (its least memory) is the one
    table = checkpoint_table(disc, high - ch.input_size) if beta > 0 else None
    if table is None:
        return solve_remat_only(problem, options).with_(method="autocapper")
    tried: set[tuple[str, ...]] = set()
    best: tuple[float, tuple, str] | None = None
    for k in range(count):
        limit = disc.memory_limit + (high - disc.memory_limit) * k // max(count - 1, 1)
        budget = limit - ch.input_size
        if not math.isfinite(table.value(budget)):
            continue
        ops = table.plan(budget)
        windows = capper_windows(disc, ops)
        if windows is None:
            continue
        key = tuple(map(str, ops)) + tuple(f"{w}" for w in windows)
        if key in tried:
            continue
        tried.add(key)
        found = best_placement(ch, beta, disc.memory_limit, ops, windows, policies)
        if found is not None and (best is None or found[1].makespan < best[0] - 1e-12):
            best = (found[1].makespan, found[0], f"M' = {limit} units ({found[2]})")
    if best is None:
        return no_plan_result(problem, options, "autocapper", Status.NO_SOLUTION,
                        {"hint": "no capper run fits", "capper_runs": len(tried)})
    return plan_result(problem, options, best[1], method="autocapper",
                       report={"choice": best[2], "capper_runs": len(tried)})


def _least_forward_memory(chain: Chain) -> int:
    """A lower bound on the memory of every plan.

    Some forward of each stage ``i`` holds its input ``a^{i-1}`` (or the tape containing it)
    and its output ``a^i`` (plus ``o_f^i``) on the GPU at once.
    """
    inputs = (chain.input_size, *chain.output_size[:-1])
    return max(x + y + o for x, y, o in zip(inputs, chain.output_size, chain.fwd_overhead,
                                            strict=True))


def _store_all_peak(chain: Chain) -> int:
    from optmem.plan import store_all_plan
    from optmem.simulate.checkpoint import simulate_checkpoint

    return simulate_checkpoint(chain, store_all_plan(chain.length)).peak_memory

