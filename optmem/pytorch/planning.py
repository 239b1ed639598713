"""Solving a profiled chain for the torch bridge: problems, limits, executors.

One :class:`Planner` per kind of plan (``checkpoint``, ``offload``, ``remat_offload``)
turns a profiled :class:`~optmem.chain.Chain` into a :class:`~optmem.result.Result` and the
result into an executor module over the stages:

* ``checkpoint``: :class:`~optmem.problems.checkpoint.CheckpointProblem`, executed by
  :class:`~optmem.pytorch.execute.CheckpointedChain`;
* ``offload``: :class:`~optmem.problems.offload.OffloadProblem`, executed by
  :class:`~optmem.pytorch.offload.OffloadedChain`;
* ``remat_offload``: :class:`~optmem.problems.remat_offload.RematOffloadProblem`, executed
  by :class:`~optmem.pytorch.remat_offload.RematOffloadChain`.

Bandwidths: a number is bytes per second, a string a rate such as ``"12GB/s"``
(:func:`optmem.units.parse_bandwidth`); :func:`bandwidth_per_unit` converts either to the
chain's units in one place.

Checkpoint plans with the ``dp`` method (:meth:`Planner.solve_at`): when the store-all plan
fits the limit at exact sizes, it is the answer (it runs every op once, so no plan is
faster); the discretised DP could miss it by rounding every size up to its unit. Without an
explicit ``slots``, the DP gets :func:`auto_slots` memory units: more for short chains, where
rounding costs most and the DP is cheap.

Checkpoint plans with the ``dp`` method also charge, by default, the cost per recomputed
segment that the profile recorded (:func:`recorded_segment_cost`: 1.0 ms by default, or
the measurement of :mod:`optmem.pytorch.segments`): the executor pays it for every
segment, the chain's stage times do not hold it. ``extra={"segment_cost": 0}``
(``op.checkpoint(segment_cost=0)``) turns it off, any other value replaces it.

When no plan fits, the error names the smallest limit at which the method *does* find a
plan after discretisation (:func:`smallest_feasible`): passing that figure back works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.plan import Plan, parse_plan
from optmem.problems.checkpoint import unit_of
from optmem.result import Result, SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.units import chain_rate, format_size, rate_per_second, relative_memory

__all__ = ["KINDS", "Planner", "auto_slots", "bandwidth_per_unit", "recorded_segment_cost",
           "refine_by_rounding_down", "rounded_down", "smallest_feasible"]

KINDS = ("checkpoint", "offload", "remat_offload")

DEFAULT_SLOTS = 500
"""Memory units of a solve when none are given (offloading, remat+offload, long chains)."""

AUTO_SLOTS_MAX = 2000
AUTO_SLOTS_BUDGET = 22_000_000
"""``L^2 * slots`` budget of :func:`auto_slots`: the persistent DP's table at the old
default (500 slots) for 210 stages, about 0.4 GB and a second on one core (measured on
BERT's 105-stage chain at 2,000 slots: 0.8 s, 384 MB)."""


def auto_slots(length: int) -> int:
    """Memory units for the checkpoint DP of a chain of ``length`` stages.

    Rounding every size up to a unit of ``limit / slots`` costs up to ``length`` units of
    memory: near store-all the 500-slot DP of a 105-stage chain (BERT) ran 5 % slower than
    store-all at store-all's own limit. ``slots = L^2``-budgeted, between 500 and 2,000.

    Examples
    --------
    >>> auto_slots(29), auto_slots(105), auto_slots(400)
    (2000, 1995, 500)
    """
    return max(DEFAULT_SLOTS, min(AUTO_SLOTS_MAX, AUTO_SLOTS_BUDGET // max(1, length) ** 2))


def recorded_segment_cost(chain: Chain) -> float:
    """The cost per recomputed segment the profile recorded for ``chain`` (0 if none).

    Recorded, not necessarily measured: the profile's default constant
    (:data:`~optmem.pytorch.profile.DEFAULT_SEGMENT_COST_MS`) unless ``measure_segments=True``
    (``chain.extra["profile"]["segment_cost_source"]`` says which).

    ``chain.extra["profile"]["segment_cost_ms"]`` (:mod:`optmem.pytorch.segments`): the
    default ``segment_cost`` of the checkpoint ``dp`` method in the bridge. Chains from a
    time model, the roofline, a file without it or of fewer than 3 stages give 0 (rotor's
    model).

    Examples
    --------
    >>> c = Chain.from_lists([1.0] * 3, [1.0] * 3, [4] * 3, [4] * 3, input_size=4)
    >>> recorded_segment_cost(c)
    0.0
    """
    profile = (chain.extra or {}).get("profile") or {}
    cost = profile.get("segment_cost_ms") if isinstance(profile, dict) else None
    return float(cost) if isinstance(cost, (int, float)) and cost > 0 else 0.0


def bandwidth_per_unit(bandwidth: float | str, chain: Chain) -> float:
    """Bytes per chain time unit of ``bandwidth`` (bytes per second, or ``"12GB/s"``).

    Examples
    --------
    >>> c = Chain.from_lists([1.0], [1.0], [4], [4], input_size=4)
    >>> bandwidth_per_unit(12e9, c), bandwidth_per_unit("12GB/s", c)
    (12000000.0, 12000000.0)
    """
    return chain_rate(bandwidth, chain.time_unit, field="bandwidth")


def smallest_feasible(solve_at: Callable[[int], Result], low: int, high: int) -> int:
    """The smallest limit (about) in ``[low, high]`` at which ``solve_at`` finds a plan.

    Discretisation makes feasibility not quite monotone in the limit, so the answer is
    always one at which ``solve_at`` was *seen* to succeed: an exponential search up from
    ``low`` (a known lower bound, e.g. the method's ``min_feasible_memory``), then a
    bisection between the last failure and the first success.

    Raises
    ------
    OptmemInputError
        If even ``high`` has no plan.
    """
    low = max(1, int(low))
    if solve_at(low).status.has_plan:
        return low
    step = max(1, low // 1000)
    fail, ok = low, None
    while ok is None:
        trial = min(high, fail + step)
        if solve_at(trial).status.has_plan:
            ok = trial
        elif trial >= high:
            raise OptmemInputError(f"no plan even at {format_size(high)} ({high} B)",
                                   field="memory_limit")
        else:
            fail, step = trial, step * 2
    while ok - fail > max(1, ok // 2000):
        mid = (fail + ok) // 2
        if solve_at(mid).status.has_plan:
            ok = mid
        else:
            fail = mid
    return ok


@dataclass
class Planner:
    """What to solve and how to run it: the kind of plan, the limit, the method, options.

    Parameters
    ----------
    kind
        ``"checkpoint"``, ``"offload"`` or ``"remat_offload"``.
    memory_limit
        Bytes or a size (``"2GiB"``); a percentage of the chain's store-all peak
        (``"60%"``: :func:`~optmem.units.relative_memory`, rounded down to a byte);
        ``"min"`` takes the smallest limit with a plan.
    method
        A method of the facade for that problem (``"dp"`` by default).
    bandwidth
        Link bandwidth for offloading: bytes per second or ``"12GB/s"``.
    slots, variant, time_limit_s, extra
        Solver options (:class:`~optmem.result.SolveOptions`); ``slots=None``:
        :func:`auto_slots` for the checkpoint DP, 500 otherwise.
    process_group
        Ranks that must train with the same plan
        (:func:`optmem.pytorch.distributed.resolve_group`): by default, when
        ``torch.distributed`` is initialised, rank 0 profiles and solves and broadcasts the
        chain and the plan; ``"local"`` decides in this process alone.
    executor_options
        Keyword arguments of the executor class.
    """

    kind: str
    memory_limit: int | str
    method: str = "dp"
    bandwidth: float | str | None = None
    slots: int | None = None
    variant: str | None = None
    time_limit_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    executor_options: dict[str, Any] = field(default_factory=dict)
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OptmemInputError(f"expected one of {', '.join(KINDS)}, got {self.kind!r}",
                                   field="kind")
        if self.kind != "checkpoint" and self.bandwidth is None:
            raise OptmemInputError(f"{self.kind} needs a bandwidth (bytes per second or a "
                                   "rate such as '12GB/s')", field="bandwidth")
        if self.memory_limit != "min":  # fail early on bad sizes and percentages
            relative_memory(self.memory_limit, 0, field="memory_limit")
        # and on a method the problem does not have, before any profile (stop 78: after it)
        from optmem.solvers.facade import check_variant, method_info

        info = method_info(self.kind.replace("_", "-"), self.method)
        # and on bad solver options, also those a store-all answer never reads (stop 84)
        self.options()
        if self.variant == "":
            raise OptmemInputError("expected a variant name or None, got ''", field="variant")
        check_variant(self.kind, info, self.variant)
        if self.bandwidth is not None:
            rate_per_second(self.bandwidth, field="bandwidth")

    def options(self, chain: Chain | None = None, method: str | None = None) -> SolveOptions:
        """The solver options (``slots`` chosen for ``chain`` and ``method`` when unset)."""
        slots = self.slots
        if slots is None:
            checkpoint_dp = self.kind == "checkpoint" and (method or self.method) == "dp"
            slots = auto_slots(chain.length) if chain is not None and checkpoint_dp \
                else DEFAULT_SLOTS
        extra = dict(self.extra)
        if "segment_cost" not in extra and chain is not None and self.kind == "checkpoint" \
                and (method or self.method) == "dp" \
                and not (self.variant or "").startswith("floating"):
            cost = recorded_segment_cost(chain)
            if cost:
                extra["segment_cost"] = cost
        return SolveOptions(variant=self.variant, slots=slots,
                            time_limit_s=self.time_limit_s, extra=extra)

    def problem(self, chain: Chain, limit: int) -> Any:
        """The problem instance at ``limit`` bytes."""
        if self.kind == "checkpoint":
            from optmem.problems.checkpoint import CheckpointProblem

            return CheckpointProblem(chain, limit)
        beta = bandwidth_per_unit(self.bandwidth, chain)  # type: ignore[arg-type]
        if self.kind == "offload":
            from optmem.problems.offload import OffloadProblem

            return OffloadProblem(chain, limit, chain_bandwidth=beta)
        from optmem.problems.remat_offload import RematOffloadProblem

        return RematOffloadProblem(chain, limit, chain_bandwidth=beta)

    def solve_at(self, chain: Chain, limit: int, method: str | None = None) -> Result:
        """Solve at ``limit`` bytes (no error when there is no plan).

        A checkpoint ``dp`` solve returns the store-all plan when it fits the limit at
        exact sizes (:meth:`~optmem.chain.Chain.store_all_peak`): it runs every op once,
        so it is optimal; the result keeps the method's name and says
        ``report["store_all_fits"]``; its ``variant`` is checked as the solve checks it
        (a variant ``dp`` does not declare is an :class:`~optmem.errors.OptmemInputError`).
        Otherwise its result is :func:`refine_by_rounding_down`'s: the DP's plan, or a
        better one from the DP on sizes rounded down that fits at exact sizes.
        """
        from optmem.solvers.facade import check_variant, method_info, solve

        method = method or self.method
        if self.kind == "checkpoint" and method == "dp" and chain.store_all_peak() <= limit:
            check_variant(self.kind, method_info(self.kind, method), self.variant)
            return _store_all_result(chain, limit, method)
        options = self.options(chain, method)
        result = solve(self.problem(chain, limit), method, options=options)
        if self.kind == "checkpoint" and method == "dp" and self.variant in (None, "paper"):
            return refine_by_rounding_down(chain, limit, options, result)
        return result

    def smallest_limit(self, chain: Chain, method: str | None = None) -> int:
        """The smallest limit (bytes) at which the method finds a plan, verified."""
        first = self.solve_at(chain, max(1, chain.input_size), method)
        if first.status.has_plan:
            return max(1, chain.input_size)
        low = first.min_feasible_memory or chain.input_size
        return smallest_feasible(lambda m: self.solve_at(chain, m, method), low,
                                 max(low, chain.store_all_peak()) * 2)

    def solve(self, chain: Chain, memory_limit: int | str | None = None,
              method: str | None = None) -> Result:
        """Solve ``chain``; an :class:`~optmem.errors.OptmemInputError` without a plan."""
        method = method or self.method
        wanted = self.memory_limit if memory_limit is None else memory_limit
        limit = (self.smallest_limit(chain, method) if wanted == "min"
                 else relative_memory(wanted, chain.store_all_peak(), field="memory_limit"))
        result = self.solve_at(chain, limit, method)
        if result.status.has_plan:
            if self.kind == "checkpoint":
                refuse_second_copies(chain, result.plan, f"the {method} plan")
            return result
        hint = ""
        # remat + offload's methods report no least memory of their own (offloading may
        # need less than checkpointing): the search below finds it for them too
        if result.min_feasible_memory is not None or result.status is Status.INFEASIBLE:
            try:
                least = self.smallest_limit(chain, method)
            except OptmemInputError:
                least = None
            if least is not None:
                hint = (f"; the smallest feasible limit is {format_size(least)} ({least} B),"
                        " after rounding sizes to the solver's units")
        elif result.report.get("error"):
            hint = f" ({result.report['error']})"
        raise OptmemInputError(
            f"no {method} {self.kind} plan for {chain.name} within {format_size(limit)}: "
            f"status {result.status}{hint}", field="memory_limit")

    def executor(self, stages: Sequence[Any], plan: Sequence[str]) -> nn.Module:
        """The module that trains ``stages`` by following ``plan``."""
        if self.kind == "checkpoint":
            from optmem.pytorch.execute import CheckpointedChain

            return CheckpointedChain(stages, plan, **self.executor_options)
        if self.kind == "offload":
            from optmem.pytorch.offload import OffloadedChain

            return OffloadedChain(stages, plan, **self.executor_options)
        from optmem.pytorch.remat_offload import RematOffloadChain

        return RematOffloadChain(stages, plan, **self.executor_options)


def refuse_second_copies(chain: Chain, plan: Sequence[Any], what: str) -> None:
    """One :class:`OptmemInputError` if ``plan`` copies a value the chain counts once.

    A checkpoint chain of the torch profiler counts a value carried beside the boundaries
    once (:func:`optmem.pytorch.profile.carried_generations_error`); rotor's DPs never
    make a second copy, another method's plan or a given one may.
    """
    from optmem.pytorch.profile import carried_generations_error

    why = carried_generations_error(chain, plan)
    if why is not None:
        raise OptmemInputError(
            f"{what} does not fit {chain.name}, which counts each value carried beside the "
            f"boundaries once: {why}; use method='dp', or wrap with another method (its "
            "chain counts such values in every boundary)", field="plan")


def _store_all_result(chain: Chain, limit: int, method: str) -> Result:
    """The store-all plan as an optimal result at exact sizes (unit 1).

    Built by the checkpoint problem's one result path
    (:func:`optmem.solvers.checkpoint.plan_result`: replayed by the simulator, the peak
    checked against ``limit``).
    """
    from optmem.plan import store_all_plan
    from optmem.problems.checkpoint import CheckpointProblem, Discretized
    from optmem.solvers.checkpoint import plan_result

    return plan_result(CheckpointProblem(chain, limit), Discretized(chain, limit, 1),
                       store_all_plan(chain.length), method=method, status=Status.OPTIMAL,
                       bound=chain.total_compute_time(), report={"store_all_fits": True})


ROUND_DOWN_TRIES = 3
"""DP solves on sizes rounded down per :func:`refine_by_rounding_down` call (at most)."""


def rounded_down(chain: Chain, unit: int) -> Chain:
    """``chain`` with every size rounded down to a multiple of ``unit`` (times unchanged).

    Discretised with that ``unit`` (CONTRACT section 2 rounds up), it gives
    ``floor(size / unit)``: every plan's peak is then at most its exact peak, so the DP's
    optimum on it is a lower bound on the optimum at exact sizes.

    Examples
    --------
    >>> c = Chain.from_lists([1.0], [1.0], [150], [250], input_size=99)
    >>> d = rounded_down(c, 100)
    >>> d.output_size, d.saved_size, d.input_size
    ((100,), (200,), 0)
    """
    return chain.map_sizes(lambda v: v - v % unit)


def _model_value(result: Result) -> float:
    """What the checkpoint DP minimised: the makespan, plus the segment charges if any."""
    return float(result.report.get("objective_with_segments", result.objective))


def _round_down_solve(chain: Chain, target: int, options: SolveOptions) -> Result:
    """The checkpoint DP at ``target`` on the chain rounded down to the DP's own unit."""
    from optmem.problems.checkpoint import CheckpointProblem
    from optmem.solvers.facade import solve

    unit = unit_of(target, options.slots)
    return solve(CheckpointProblem(rounded_down(chain, unit), target), "dp", options=options)


def refine_by_rounding_down(chain: Chain, limit: int, options: SolveOptions,
                            first: Result) -> Result:
    """The checkpoint DP's result, or a better plan found by rounding sizes down.

    The DP rounds every size *up* to its unit (``limit // slots``, CONTRACT section 2), so
    plans within a unit per stage of the limit look too large to it. This solves the DP
    again on the sizes rounded *down* (:func:`rounded_down`) and replays that plan at exact
    sizes: if it fits ``limit`` and the DP's objective (makespan plus segment charges) is
    lower than ``first``'s, it replaces ``first``. If it does not fit, the target is
    lowered by the excess and the DP tried again, :data:`ROUND_DOWN_TRIES` solves in all.

    The first rounded-down optimum is a lower bound at exact sizes for the DP's model (a
    relaxation: every plan's rounded-down peak is at most its exact peak), so a plan found
    by the first try is **optimal at exact sizes** (``status: optimal`` without a segment
    charge, ``model_status: optimal`` with one); one found by a later try is ``feasible``
    with that bound (``report["model_bound"]``). The result is at unit 1 and says
    ``report["rounding"] = "down"`` and ``report["rounding_tries"]``.
    """
    if unit_of(limit, options.slots) == 1:
        return first
    target, lower = limit, None
    for attempt in range(ROUND_DOWN_TRIES):
        trial = _round_down_solve(chain, target, options)
        if not trial.status.has_plan:
            return first
        lower = _model_value(trial) if lower is None else lower
        plan = parse_plan(trial.plan or ())
        peak = simulate_checkpoint(chain, plan).peak_memory
        if peak <= limit:
            better = not first.status.has_plan or _model_value(trial) < _model_value(first)
            return _rounded_down_result(chain, limit, trial, plan, attempt, lower) \
                if better else first
        target -= peak - limit
        if target < 1:
            break
    return first


def _rounded_down_result(chain: Chain, limit: int, trial: Result, plan: Plan, attempt: int,
                         lower: float) -> Result:
    """``trial``'s plan replayed at exact sizes (unit 1), with its status and bound."""
    from optmem.problems.checkpoint import CheckpointProblem, Discretized
    from optmem.solvers.checkpoint import plan_result

    proven = attempt == 0
    report = dict(trial.report, rounding="down", rounding_tries=attempt + 1)
    charged = "objective_with_segments" in report
    if charged:
        report["model_status"] = (Status.OPTIMAL if proven else Status.FEASIBLE).value
    if not proven:
        report["model_bound"] = lower
    status = Status.OPTIMAL if proven and not charged else Status.FEASIBLE
    bound = trial.bound if charged else lower
    return plan_result(CheckpointProblem(chain, limit), Discretized(chain, limit, 1),
                       plan, method="dp", status=status, bound=bound,
                       variant=trial.variant, claimed=trial.objective, report=report)
