"""Exact remat + offload optima on tiny chains: ``cpsat`` and ``brute`` (problem ``remat-offload``).

The plan space: every compute sequence of checkpoint ops (CONTRACT section 3) with at most
``L (L + 1) / 2`` forward ops (the recompute-all count, which bounds every persistent
plan), and for every stored value and every gap between two consecutive uses of it (a
:class:`~optmem.solvers.remat_offload_schedule.Window`) at most one offload/prefetch pair
(two pairs in one gap are dominated by one pair spanning both). Compute sequences are
enumerated by increasing total compute time (a lower bound on their makespan, so the
search stops as soon as it reaches the best makespan found); for each one, the transfers
are chosen by

* ``cpsat``: the exact CP-SAT model of :mod:`optmem.models.remat_offload_cpsat`;
* ``brute``: enumeration of window subsets, link orders and issue points, each plan replayed
  by :func:`optmem.simulate.offload.simulate_offload` (an independent oracle, ``L <= 2``).

Both are exact for the simulator's semantics over that plan space (not bound by the
persistence assumption OR.1 nor by OR.2/OR.3 of the chapter 4 DP).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.plan import LOSS, AnyOp, B, F_all, F_ck, F_none, Op
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import initial_state, is_final, transition
from optmem.simulate.offload import reads, simulate_offload
from optmem.solvers.engine_results import engine_failure
from optmem.solvers.engines import EngineResult, cpsat_settings
from optmem.solvers.facade import register
from optmem.solvers.offload_bruteforce import interleave_transfers
from optmem.solvers.remat_offload import PROBLEM, _disc, _no_plan, plan_result
from optmem.solvers.remat_offload_schedule import Window, static_replay, window_before

CPSAT_MAX_LENGTH = 3
BRUTE_MAX_LENGTH = 2


def compute_sequences(chain: Chain, max_forwards: int | None = None
                      ) -> list[tuple[float, int, tuple[Op, ...]]]:
    """Every complete compute sequence: ``(compute time, checkpoint peak, ops)``."""
    L = chain.length
    cap = L * (L + 1) // 2 if max_forwards is None else max_forwards
    out: list[tuple[float, int, tuple[Op, ...]]] = []
    candidates = [LOSS, *(f(i) for i in range(1, L + 1) for f in (F_all, F_ck, F_none)),
                  *(B(i) for i in range(1, L + 1))]

    def dfs(stored: frozenset, ops: list[Op], time: float, peak: int, fwd: int) -> None:
        if is_final(stored):
            out.append((time, peak, tuple(ops)))
            return
        for op in candidates:
            is_fwd = op.kind.value.startswith("F")
            if is_fwd and fwd >= cap:
                continue
            try:
                new, op_peak, duration = transition(chain, stored, op)
            except PlanError:
                continue
            ops.append(op)
            dfs(new, ops, time + duration, max(peak, op_peak), fwd + int(is_fwd))
            ops.pop()

    dfs(initial_state(), [], 0.0, 0, 0)
    out.sort(key=lambda t: (t[0], len(t[2])))
    return out


def all_windows(chain: Chain, ops: Sequence[Op]) -> list[Window]:
    """Every gap between two consecutive uses of a stored value."""
    static = static_replay(chain, ops)
    out = []
    for c, op in enumerate(ops):
        for value in static.before[c]:
            if value[0] == "delta" or not reads(op, value, chain.length):
                continue
            w = window_before(chain, ops, static, value, c)
            if w is not None and w.last + 1 < w.consumer:
                out.append(w)
    return out


def _exact_search(problem: RematOffloadProblem, options: SolveOptions, method: str,
                  transfers: str) -> Result:
    disc, beta = _disc(problem, options)
    chain, limit = disc.chain, disc.memory_limit
    seqs = compute_sequences(chain)
    best: tuple[float, tuple[AnyOp, ...]] | None = None
    proven = True
    tried = 0
    failure: EngineResult | None = None
    for time, peak, ops in seqs:
        if best is not None and time >= best[0] - 1e-12:
            break
        if peak <= limit:
            best = (time, ops)
            break
        if beta <= 0 or not _may_fit(chain, limit, ops):
            continue
        tried += 1
        if transfers == "cpsat":
            found, ok, out = _cpsat_transfers(chain, limit, beta, ops, options)
            proven = proven and ok
            failure = failure or (out if out.failed else None)
        else:
            found = _brute_transfers(chain, limit, beta, ops)
        if found is not None and (best is None or found[0] < best[0] - 1e-12):
            best = found
    report = {"sequences": len(seqs), "sequences_with_transfers": tried,
              "plan_space": "compute sequences with <= L(L+1)/2 forwards, one transfer "
                            "pair per gap between uses"}
    if failure is not None:
        found_best = best

        def fallback(info: dict[str, Any]) -> Result:
            assert found_best is not None
            return plan_result(problem, options, found_best[1], method=method,
                               status=Status.FEASIBLE, report=info, solver="cpsat")

        return engine_failure(PROBLEM, method, failure, report=report,
                              fallback=fallback if best is not None else None,
                              memory_limit=limit, unit=disc.unit)
    if best is None:
        return _no_plan(problem, options, method,
                        Status.INFEASIBLE if proven else Status.NO_SOLUTION, report)
    status = Status.OPTIMAL if proven else Status.FEASIBLE
    return plan_result(problem, options, best[1], method=method, status=status,
                       report=report, claimed=best[0] if proven else None,
                       solver="cpsat" if transfers == "cpsat" else None)


def _cpsat_transfers(chain: Chain, limit: int, beta: float, ops: tuple[Op, ...],
                     options: SolveOptions
                     ) -> tuple[tuple[float, tuple[AnyOp, ...]] | None, bool, EngineResult]:
    """Best transfers for ``ops``: ``(found, proven, engine outcome)``."""
    from optmem.models.remat_offload_cpsat import (
        build_transfer_cpsat,
        decode_transfer_cpsat,
        solve_transfer_cpsat,
    )

    built = build_transfer_cpsat(chain, limit, beta, ops, all_windows(chain, ops))
    out = solve_transfer_cpsat(built, **cpsat_settings(options.with_(verbose=False)))
    if out.values is None:
        return None, out.status is Status.INFEASIBLE and built.exact, out
    plan, _ = decode_transfer_cpsat(built, out.values)
    try:
        sim = simulate_offload(chain, plan, beta, limit)
    except PlanError:
        return None, False, out
    return (sim.makespan, plan), out.status is Status.OPTIMAL and built.exact, out


def _may_fit(chain: Chain, limit: int, ops: tuple[Op, ...]) -> bool:
    """Necessary condition: every op fits with every value it does not read on the host."""
    from optmem.simulate.checkpoint import value_size

    static = static_replay(chain, ops)
    windows = all_windows(chain, ops)
    for j, peak in enumerate(static.peaks):
        if peak <= limit:
            continue
        host = {w.value for w in windows if w.last < j < w.consumer}
        if peak - sum(value_size(chain, v) for v in host) > limit:
            return False
    return True


def _orders(wins: list[int], windows: list[Window]) -> Iterator[list[tuple[str, int]]]:
    items = [("O", i) for i in wins] + [("P", i) for i in wins]
    after = [(i1, i2) for i1 in wins for i2 in wins
             if windows[i1].value == windows[i2].value
             and windows[i1].consumer <= windows[i2].last]
    for perm in itertools.permutations(items):
        pos = {t: k for k, t in enumerate(perm)}
        if all(pos[("O", i)] < pos[("P", i)] for i in wins) and \
                all(pos[("P", i1)] < pos[("O", i2)] for i1, i2 in after):
            yield list(perm)


def _gaps(order: list[tuple[str, int]], windows: list[Window], lo: int = 0
          ) -> Iterator[list[int]]:
    """Non-decreasing issue points (the compute op each transfer is listed before)."""
    if not order:
        yield []
        return
    kind, i = order[0]
    w = windows[i]
    first = max(lo, w.first if kind == "O" else w.last + 1)
    last = w.consumer - 1 if kind == "O" else w.consumer
    for g in range(first, last + 1):
        for rest in _gaps(order[1:], windows, g):
            yield [g, *rest]


def _brute_transfers(chain: Chain, limit: int, beta: float, ops: tuple[Op, ...]
                     ) -> tuple[float, tuple[AnyOp, ...]] | None:
    windows = all_windows(chain, ops)
    best: tuple[float, tuple[AnyOp, ...]] | None = None
    idx = list(range(len(windows)))
    for r in range(1, len(idx) + 1):
        for chosen in itertools.combinations(idx, r):
            values = [windows[i].value for i in chosen]
            if len(set(values)) < len(values) and _overlap(windows, chosen):
                continue
            for order in _orders(list(chosen), windows):
                for gaps in _gaps(order, windows):
                    plan = interleave_transfers(
                        ops, [(kind, windows[i].value) for kind, i in order], gaps)
                    try:
                        sim = simulate_offload(chain, plan, beta, limit)
                    except PlanError:
                        continue
                    if best is None or sim.makespan < best[0] - 1e-12:
                        best = (sim.makespan, tuple(plan))
    return best


def _overlap(windows: list[Window], chosen: Sequence[int]) -> bool:
    for i, k in itertools.combinations(chosen, 2):
        a, b = windows[i], windows[k]
        if a.value == b.value and not (a.consumer <= b.last or b.consumer <= a.last):
            return True
    return False


@register(PROBLEM, "cpsat", exact=True, requires=("ortools",), max_length=CPSAT_MAX_LENGTH,
          description="exact: compute sequences x CP-SAT transfer model (tiny chains)")
def solve_cpsat(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Exact optimum over the plan space of the module docstring."""
    if problem.chain.length > CPSAT_MAX_LENGTH:
        raise OptmemInputError(f"the exact remat-offload search is for L <= "
                               f"{CPSAT_MAX_LENGTH}; got L = {problem.chain.length}",
                               field="method")
    return _exact_search(problem, options, "cpsat", "cpsat")


@register(PROBLEM, "brute", exact=True, max_length=BRUTE_MAX_LENGTH,
          description="exact: compute sequences x enumerated transfers (L <= 2)")
def solve_brute(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Exact optimum by enumeration and simulation (independent of the CP-SAT model)."""
    if problem.chain.length > BRUTE_MAX_LENGTH:
        raise OptmemInputError(f"brute force is for L <= {BRUTE_MAX_LENGTH}; got L = "
                               f"{problem.chain.length}", field="method")
    return _exact_search(problem, options, "brute", "brute")

