"""DELTA-style online policy (Tang et al.) simulated on a chain: method ``delta``.

Digest ``shared/design/hong_delta.md`` part B (Alg. 1-4, Eq. 1-6), at layer granularity:

* the forward pass runs ``F_all`` stage by stage; before each op, while the GPU memory is
  at or above ``trigger`` (0.75) of the budget or the op does not fit, the **filter**
  (Alg. 2, score ``h_base = 1 / (m s)``) picks the resident saved value with the largest
  size x staleness (time since its last use), excluding the op's input; the **director**
  (Alg. 3, Eq. 4) evicts it if recomputing is no dearer than swapping
  (``c_r <= c_s = kappa m / (eta b)``; ``c_r`` is the forward time from the nearest kept
  ancestor, DTR-style) and offloads it otherwise; the input ``a^0`` cannot be recomputed
  (``uncomputable``), so it is only offloaded;
* releases happen before the loss only (A2); in the backward pass offloaded values are
  prefetched (Alg. 4, next-use order) and evicted runs are recomputed from the kept
  ancestor, keeping the recomputed tapes while memory allows (DTR-like; a few memory
  shares are tried and the fastest replayed plan is kept);
* the decisions are written as a plan of the simulator's language: an evicted stage runs
  ``F_ck`` (first of a run) or ``F_none``; the transfers are placed by
  :mod:`optmem.solvers.remat_offload_schedule` and the plan is replayed by the simulator.

Being myopic, the policy may not fit at the given budget although a plan exists; it is
then rerun with a smaller internal budget (a safety margin, reported as ``margin``).
Deviation: DELTA's "recompute rather than reload" switch for offloaded tensors is not
modelled (an offloaded tape is always prefetched): the op language has no discard of a
stored value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from optmem.chain import Chain
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op
from optmem.problems.checkpoint import Discretized
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Result, SolveOptions, Status
from optmem.solvers.options import positive_float
from optmem.solvers.registration import register
from optmem.solvers.remat_offload import (
    PROBLEM,
    below_least_forward,
    discretized,
    no_plan_result,
    plan_result,
    prefetch_policies,
)
from optmem.solvers.remat_offload_schedule import (
    backward_windows,
    best_placement,
    static_replay,
)

KEPT, OFFLOADED, EVICTED = "kept", "offloaded", "evicted"
MARGINS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def delta_decisions(chain: Chain, budget: float, bandwidth: float, *, trigger: float = 0.75,
                    kappa: float = 1.0, eta: float = 1.0) -> list[str]:
    """Status of the input ``a^0`` (index 0) and of every tape ``abar^k`` (index k)."""
    L = chain.length
    size = [chain.input_size, *chain.saved_size]
    uf = [0.0, *chain.fwd_time]
    status = [KEPT] * (L + 1)
    last_use = [0.0] * (L + 1)
    resident: set[int] = {0}
    clock = 0.0
    b = eta * bandwidth

    def used() -> int:
        return sum(size[k] for k in resident)

    def recompute_cost(k: int) -> float:
        cost = 0.0
        while k >= 1 and status[k] == EVICTED:
            cost += uf[k]
            k -= 1
        return cost + uf[k] if k >= 1 else cost

    for i in range(1, L + 1):
        request = size[i] + chain.fwd_overhead[i - 1]
        pinned: set[int] = {i - 1}  # the op's input stays
        while used() >= trigger * budget or used() + request > budget:
            cand = [k for k in resident if k not in pinned]
            if not cand:
                break
            k = max(cand, key=lambda k: (size[k] * (clock - last_use[k]), -k))  # filter
            if k == 0:  # uncomputable: offload only
                if b > 0:
                    resident.discard(0)
                    status[0] = OFFLOADED
                else:
                    pinned.add(0)
                continue
            resident.discard(k)
            if b <= 0:
                status[k] = EVICTED
                continue
            c_s = kappa * size[k] / b
            status[k] = EVICTED if recompute_cost(k) <= c_s else OFFLOADED  # director
        last_use[i - 1] = clock
        clock += uf[i]
        last_use[i] = clock
        resident.add(i)
    return status


def delta_ops(chain: Chain, status: list[str], free: float = math.inf) -> list[Op]:
    """The compute sequence of the decisions (see the module docstring).

    ``free``: memory the backward recomputation of an evicted run may use to keep the tapes
    it recomputes (DTR keeps recomputed tensors while memory allows): the first tapes of
    the run that fit are kept, the others are recomputed again from the nearest kept one.
    """
    L = chain.length
    fwd: list[Op] = []
    for k in range(1, L + 1):
        if status[k] != EVICTED:
            fwd.append(F_all(k))
        elif k == 1 or status[k - 1] != EVICTED:
            fwd.append(F_ck(k))
        else:
            fwd.append(F_none(k))
    ops = [*fwd, LOSS]
    k = L
    while k >= 1:
        if status[k] != EVICTED:
            ops.append(B(k))
            k -= 1
            continue
        j = k
        while j >= 1 and status[j] == EVICTED:
            j -= 1
        ops.extend(_run_backward(chain, j + 1, k, free))  # run j+1..k, input kept
        k = j
    return ops


def _run_backward(chain: Chain, first: int, last: int, free: float) -> list[Op]:
    """Recompute an evicted run, keeping the first recomputed tapes that fit in ``free``."""
    kept: set[int] = set()
    total = 0
    for h in range(first, last):
        if total + chain.saved_size[h - 1] > free:
            break
        kept.add(h)
        total += chain.saved_size[h - 1]
    seq: list[Op] = []
    for h in range(first, last + 1):  # first sweep, up to the last stage
        if h in kept or h == last:
            seq.append(F_all(h))
        elif h == first or h - 1 in kept:
            seq.append(F_ck(h))
        else:
            seq.append(F_none(h))
    seq.append(B(last))
    for h in range(last - 1, first - 1, -1):
        if h not in kept:
            g = max((x for x in kept if x < h), default=first - 1)
            if g + 1 == h:
                seq.append(F_all(h))
            else:
                seq += [F_ck(g + 1), *(F_none(x) for x in range(g + 2, h)), F_all(h)]
        seq.append(B(h))
    return seq


def _build(disc: Discretized, beta: float, budget: float, trigger: float, kappa: float,
           eta: float, policies: Sequence[str]) -> tuple[tuple, str, list[str]] | None:
    chain = disc.chain
    status = delta_decisions(chain, budget, beta, trigger=trigger, kappa=kappa, eta=eta)
    values = [("a", 0) if k == 0 else ("abar", k) for k, s in enumerate(status)
              if s == OFFLOADED]
    best = None
    for share in (math.inf, 1.0, 0.5, 0.25, 0.0):
        ops = delta_ops(chain, status, share * disc.memory_limit)
        static = static_replay(chain, ops)
        windows = backward_windows(chain, ops, static, values)
        found = best_placement(chain, beta, disc.memory_limit, ops, windows, policies)
        if found is not None and (best is None or found[1].makespan < best[1].makespan):
            best = found
    if best is None:
        return None
    return best[0], best[2], status


@register(PROBLEM, "delta", exact=False,
          description="DELTA-style online policy: filter (size x staleness) + director "
                      "(recompute if cheaper than swap), simulated",
          extra=("delta_trigger", "delta_kappa", "delta_eta", "prefetch"))
def solve_delta(problem: RematOffloadProblem, options: SolveOptions) -> Result:
    """Simulate the policy.

    Options ``delta_trigger`` (0.75), ``delta_kappa`` (1), ``delta_eta`` (1: the chain's
    bandwidth is already the effective one), ``prefetch`` (the placement policy; default:
    the fastest of all).
    """
    disc, beta = discretized(problem, options)
    trigger = positive_float(options, "delta_trigger", 0.75)
    kappa = positive_float(options, "delta_kappa", 1.0)
    eta = positive_float(options, "delta_eta", 1.0)
    policies = prefetch_policies(options)
    if (below := below_least_forward(problem, options, "delta")) is not None:
        return below
    for margin in MARGINS:
        built = _build(disc, beta, margin * disc.memory_limit, trigger, kappa, eta, policies)
        if built is None:
            continue
        plan, policy, status = built
        report = {"margin": margin, "prefetch": policy, "trigger": trigger, "kappa": kappa,
                  "eta": eta, "evicted": status.count(EVICTED),
                  "offloaded_values": status.count(OFFLOADED)}
        return plan_result(problem, options, plan, method="delta", report=report)
    return no_plan_result(problem, options, "delta", Status.NO_SOLUTION,
                    {"hint": "the online policy does not fit even with a 70% margin"})

