r"""Exact ILP for the least peak memory of a single-pass checkpoint set (Hong et al.).

The same objective as the DPs of :mod:`optmem.solvers.min_peak_dp` (Hong eq. 6 for the
``static`` model, eq. 12 for ``pytorch``, optmem's simulator for ``optmem``), written as a
shortest-path-like ILP so that it checks them independently. Build, solve and decode are
kept apart; PuLP is imported inside the functions.

Variables (``0 <= h < i <= n``)::

    x_k   in {0,1}   d_k is a checkpoint (x_0 = x_n = 1)
    y_hi  in {0,1}   h and i are consecutive checkpoints (segment (h, i])
    z_k   >= 0       sum_{c <= k} w_c x_c   (prefix checkpoint weight)
    P     >= 0       peak

Constraints::

    sum_i y_0i = 1,  sum_h y_hn = 1                      (one path from 0 to n)
    sum_h y_hk = x_k = sum_i y_ki          0 < k < n     (flow conservation)
    z_0 = w_0,  z_k = z_{k-1} + w_k x_k
    pytorch / optmem (eq. 12 with eq. 13's U):
        P >= z_h + (U(h,i) + W_h) y_hi - W_h               W_h = sum_{c<=h} w_c
    static (eq. 6):
        P >= z_n + S,   S >= seg(h,i) y_hi,                seg(h,i) = sum_{h<k<i} d_k

Objective ``min P``. ``O(n^2)`` binaries and constraints with O(1) terms each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optmem.errors import OptmemInputError
from optmem.problems.min_peak import MinPeakProblem
from optmem.result import SolveOptions, Status
from optmem.solvers.engines import EngineResult, coefficient_scale, pulp_settings
from optmem.solvers.min_peak_dp import segment_model


@dataclass
class MinPeakModel:
    """A built PuLP model and its variables (``x[k]``, ``y[(h, i)]``, ``peak``).

    Sizes are divided by ``scale`` (:func:`optmem.solvers.engines.coefficient_scale`):
    byte-sized big-M coefficients (~1e9) made HiGHS return wrong "optimal" sets.
    """

    lp: Any
    x: list[Any]
    y: dict[tuple[int, int], Any]
    peak: Any
    scale: float = 1.0

    @property
    def variables(self) -> list[Any]:
        """Every variable of the model, in a fixed order."""
        return list(self.lp.variables())


@dataclass(frozen=True)
class IlpOutcome:
    """What the engine said (status mapped by the adapter), sizes back in chain units."""

    status: Status
    objective: float
    bound: float
    solver: str
    values: dict[str, float]
    engine: EngineResult | None = None


def build_min_peak_ilp(problem: MinPeakProblem) -> MinPeakModel:
    """Build the ILP of the module docstring for ``problem``."""
    import pulp

    n = problem.n
    if problem.model == "static":
        d = list(problem.sizes())
        largest = float(sum(d))
    else:
        w, row = segment_model(problem)
        rows = [row(h) for h in range(n)]
        largest = float(sum(w) + max(max(r) for r in rows))
    scale = coefficient_scale(largest)
    lp = pulp.LpProblem("min_peak", pulp.LpMinimize)
    x = [lp.add_variable(f"x_{k}", 0, 1, cat=pulp.LpBinary) for k in range(n + 1)]
    y = {(h, i): lp.add_variable(f"y_{h}_{i}", 0, 1, cat=pulp.LpBinary)
         for h in range(n) for i in range(h + 1, n + 1)}
    peak = lp.add_variable("peak", 0)
    lp += peak
    lp += x[0] == 1
    lp += x[n] == 1
    lp += pulp.lpSum(y[(0, i)] for i in range(1, n + 1)) == 1
    lp += pulp.lpSum(y[(h, n)] for h in range(n)) == 1
    for k in range(1, n):
        lp += pulp.lpSum(y[(h, k)] for h in range(k)) == x[k]
        lp += pulp.lpSum(y[(k, i)] for i in range(k + 1, n + 1)) == x[k]
    if problem.model == "static":
        total = pulp.lpSum(d[k] / scale * x[k] for k in range(n + 1))
        seg = lp.add_variable("largest_segment", 0)
        lp += peak >= total + seg
        for (h, i), var in y.items():
            inner = sum(d[h + 1:i])
            if inner:
                lp += seg >= inner / scale * var
        return MinPeakModel(lp, x, y, peak, scale)
    z = [lp.add_variable(f"z_{k}", 0) for k in range(n + 1)]
    lp += z[0] == w[0] / scale * x[0]
    for k in range(1, n + 1):
        lp += z[k] == z[k - 1] + w[k] / scale * x[k]
    prefix_total = 0.0
    for h in range(n):
        prefix_total += w[h] / scale
        for off, u in enumerate(rows[h]):
            i = h + 1 + off
            lp += peak >= z[h] + (u / scale + prefix_total) * y[(h, i)] - prefix_total
    return MinPeakModel(lp, x, y, peak, scale)


def initial_values(model: MinPeakModel, problem: MinPeakProblem,
                   checkpoints: tuple[int, ...]) -> list[float]:
    """A feasible assignment of ``model.variables`` for a checkpoint set (warm start)."""
    n = problem.n
    cset = set(checkpoints)
    pairs = set(zip(checkpoints, checkpoints[1:], strict=False))
    values: dict[str, float] = {f"x_{k}": float(k in cset) for k in range(n + 1)}
    values.update({f"y_{h}_{i}": float((h, i) in pairs) for (h, i) in model.y})
    if problem.model == "static":
        d = problem.sizes()
        largest = max(sum(d[h + 1:i]) for h, i in pairs) / model.scale
        values["largest_segment"] = largest
        values["peak"] = sum(d[c] for c in cset) / model.scale + largest
    else:
        w, row = segment_model(problem)
        z, acc = [], 0.0
        for k in range(n + 1):
            acc += w[k] / model.scale if k in cset else 0.0
            z.append(acc)
            values[f"z_{k}"] = acc
        values["peak"] = max(z[h] + row(h)[i - h - 1] / model.scale for h, i in pairs)
    return [values[v.name] for v in model.variables]


def solve_min_peak_ilp(model: MinPeakModel, options: SolveOptions,
                       initial: list[float] | None = None) -> IlpOutcome:
    """Run the engine (:func:`optmem.solvers.engines.solve_pulp`); HiGHS, else CBC."""
    from optmem.solvers.engines import is_available, solve_pulp

    engine = (options.solver or "highs").lower()
    if engine == "highs" and not is_available("highs"):
        engine = "cbc"
    out = solve_pulp(model.lp, model.variables, engine, initial=initial,
                     **pulp_settings(options))
    return IlpOutcome(out.status, out.objective * model.scale, out.bound * model.scale,
                      out.engine, {}, out)


def decode_min_peak_ilp(model: MinPeakModel) -> tuple[int, ...]:
    """The checkpoint set of a solved model (``x_k > 0.5``)."""
    return tuple(k for k, var in enumerate(model.x)
                 if var.varValue is not None and var.varValue > 0.5)


def write_min_peak_ilp(problem: MinPeakProblem, path: str) -> None:
    """Write the model to ``path`` (``.lp`` or ``.mps``)."""
    model = build_min_peak_ilp(problem)
    if path.endswith(".lp"):
        model.lp.writeLP(path)
    elif path.endswith(".mps"):
        model.lp.writeMPS(path)
    else:
        raise OptmemInputError(f"expected a .lp or .mps file name, got {path!r}", field="output")
