r"""Exact ILP for the least peak memory of a single-pass checkpoint set (Hong et al.).

The same objective as the DPs of :mod:`optmem.solvers.min_peak_dp` (Hong eq. 6 for the
``static`` model, eq. 12 for ``pytorch``, optmem's simulator for ``optmem``), written as a
shortest-path-like ILP so that it checks them independently. The model is built once as a
solver-neutral :class:`optmem.models.formulation.Model` and written for PuLP by the shared
emitter (:func:`optmem.models.formulation.to_pulp`); build, solve and decode are kept apart.

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

from optmem.engines.adapters import EngineResult, coefficient_scale, pulp_settings
from optmem.errors import OptmemInputError
from optmem.models.formulation import Expr, Model, PulpModel, to_pulp
from optmem.models.min_peak_segments import segment_model
from optmem.problems.min_peak import MinPeakProblem
from optmem.result import SolveOptions, Status


@dataclass
class MinPeakModel:
    """The neutral model, its PuLP form and the indices of ``x[k]``, ``y[(h, i)]``, ``peak``.

    Sizes are divided by ``scale`` (:func:`optmem.engines.adapters.coefficient_scale`):
    byte-sized big-M coefficients (~1e9) made HiGHS return wrong "optimal" sets.
    """

    model: Model
    emitted: PulpModel
    x: list[int]
    y: dict[tuple[int, int], int]
    peak: int
    scale: float = 1.0

    @property
    def lp(self) -> Any:
        """The ``pulp.LpProblem``."""
        return self.emitted.problem

    @property
    def variables(self) -> list[Any]:
        """Every PuLP variable, in a fixed order (model variables, then auxiliary ones)."""
        return self.emitted.all_variables


@dataclass(frozen=True)
class IlpOutcome:
    """What the engine said (status mapped by the adapter), sizes back in chain units."""

    status: Status
    objective: float
    bound: float
    solver: str
    values: dict[str, float]
    engine: EngineResult | None = None


def _paths(m: Model, n: int) -> tuple[list[Expr], dict[tuple[int, int], Expr]]:
    """Checkpoint and segment binaries with the path constraints of the docstring."""
    x = [m.binary(f"x_{k}") for k in range(n + 1)]
    y = {(h, i): m.binary(f"y_{h}_{i}") for h in range(n) for i in range(h + 1, n + 1)}
    m.add(x[0] == 1, "first")
    m.add(x[n] == 1, "last")
    m.add(Expr.sum(y[(0, i)] for i in range(1, n + 1)) == 1, "leave_0")
    m.add(Expr.sum(y[(h, n)] for h in range(n)) == 1, "enter_n")
    for k in range(1, n):
        m.add(Expr.sum(y[(h, k)] for h in range(k)) == x[k], f"enter_{k}")
        m.add(Expr.sum(y[(k, i)] for i in range(k + 1, n + 1)) == x[k], f"leave_{k}")
    return x, y


def build_min_peak_ilp(problem: MinPeakProblem, *, limit_row: bool = False) -> MinPeakModel:
    """Build the ILP of the module docstring for ``problem``.

    Parameters
    ----------
    problem : MinPeakProblem
        The chain, memory model and optional ``memory_limit``.
    limit_row : bool
        Add ``peak <= memory_limit`` (scaled like the sizes) when the problem has a limit.
        The solver leaves it out, so that an infeasible limit still yields the least peak
        as ``min_feasible_memory``; the exported model has it, so that another solver's
        verdict on the file is the method's (optimum, or infeasible).
    """
    n = problem.n
    if problem.model == "static":
        d = list(problem.sizes())
        largest = float(sum(d))
    else:
        w, row = segment_model(problem)
        rows = [row(h) for h in range(n)]
        largest = float(sum(w) + max(max(r) for r in rows))
    scale = coefficient_scale(largest)
    m = Model("min_peak")
    x, y = _paths(m, n)
    peak = m.continuous("peak", 0)
    m.minimize(peak)
    if problem.model == "static":
        total = Expr.sum(x[k] * (d[k] / scale) for k in range(n + 1))
        seg = m.continuous("largest_segment", 0)
        m.add(peak >= total + seg, "peak")
        for (h, i), var in y.items():
            inner = sum(d[h + 1:i])
            if inner:
                m.add(seg >= var * (inner / scale), f"seg_{h}_{i}")
    else:
        z = [m.continuous(f"z_{k}", 0) for k in range(n + 1)]
        m.add(z[0] == x[0] * (w[0] / scale), "z_0")
        for k in range(1, n + 1):
            m.add(z[k] == z[k - 1] + x[k] * (w[k] / scale), f"z_{k}")
        prefix_total = 0.0
        for h in range(n):
            prefix_total += w[h] / scale
            for off, u in enumerate(rows[h]):
                i = h + 1 + off
                m.add(peak >= z[h] + y[(h, i)] * (u / scale + prefix_total) - prefix_total,
                      f"peak_{h}_{i}")
    if limit_row and problem.memory_limit is not None:
        m.add(peak <= problem.memory_limit / scale, "memory_limit")
    return MinPeakModel(m, to_pulp(m), [Model.index(v) for v in x],
                        {key: Model.index(v) for key, v in y.items()}, Model.index(peak),
                        scale)


def initial_values(model: MinPeakModel, problem: MinPeakProblem,
                   checkpoints: tuple[int, ...]) -> list[float]:
    """A feasible assignment of ``model.variables`` for a checkpoint set (warm start)."""
    n = problem.n
    cset = set(checkpoints)
    pairs = set(zip(checkpoints, checkpoints[1:], strict=False))
    values = [0.0] * len(model.model.vars)
    for k, idx in enumerate(model.x):
        values[idx] = float(k in cset)
    for key, idx in model.y.items():
        values[idx] = float(key in pairs)
    named = {v.name: v.index for v in model.model.vars}
    if problem.model == "static":
        d = problem.sizes()
        largest = max(sum(d[h + 1:i]) for h, i in pairs) / model.scale
        values[named["largest_segment"]] = largest
        values[model.peak] = sum(d[c] for c in cset) / model.scale + largest
    else:
        w, row = segment_model(problem)
        z, acc = [], 0.0
        for k in range(n + 1):
            acc += w[k] / model.scale if k in cset else 0.0
            z.append(acc)
            values[named[f"z_{k}"]] = acc
        values[model.peak] = max(z[h] + row(h)[i - h - 1] / model.scale for h, i in pairs)
    return model.emitted.initial(values)  # type: ignore[return-value]


def solve_min_peak_ilp(model: MinPeakModel, options: SolveOptions,
                       initial: list[float] | None = None) -> IlpOutcome:
    """Run the engine (:func:`optmem.engines.adapters.solve_pulp`); HiGHS, else CBC."""
    from optmem.engines.adapters import is_available, solve_pulp

    engine = (options.solver or "highs").lower()
    if engine == "highs" and not is_available("highs"):
        engine = "cbc"
    out = solve_pulp(model.lp, model.variables, engine, initial=initial,
                     **pulp_settings(options))
    return IlpOutcome(out.status, out.objective * model.scale, out.bound * model.scale,
                      out.engine, {}, out)


def decode_min_peak_ilp(model: MinPeakModel) -> tuple[int, ...]:
    """The checkpoint set of a solved model (``x_k > 0.5``)."""
    xs = model.emitted.variables
    return tuple(k for k, idx in enumerate(model.x)
                 if xs[idx].varValue is not None and xs[idx].varValue > 0.5)


def write_min_peak_ilp(problem: MinPeakProblem, path: str) -> None:
    """Write the model, with its limit row, to ``path`` (``.lp`` or ``.mps``)."""
    model = build_min_peak_ilp(problem, limit_row=True)
    if path.lower().endswith(".lp"):
        model.lp.writeLP(path)
    elif path.lower().endswith(".mps"):
        model.lp.writeMPS(path)
    else:
        raise OptmemInputError(f"expected a .lp or .mps file name, got {path!r}", field="output")
