r"""Solver-neutral mixed-integer models, written once and emitted to PuLP and to CP-SAT.

An exact model of optmem is built once as a :class:`Model`: variables (binary, integer,
continuous, each with finite bounds where an emitter needs them), linear constraints
``lo <= expr <= hi`` that may be *enforced* only when some literals are true, optional
fixed-size intervals and ``no_overlap`` sets of them (one machine, one link), and a linear
objective to minimise. Two emitters write it for an engine:

* :func:`to_pulp` (HiGHS, CBC, Gurobi through PuLP): an enforced constraint becomes a big-M
  row whose ``M`` is computed from the variable bounds (the tightest valid one); a
  ``no_overlap`` set becomes one order binary per pair of intervals, with big-M rows again
  from the bounds of the interval starts (a set marked ``redundant``, implied by the rows,
  is left out); the objective constant rides on a variable fixed
  to 1 so that every MPS reader sees the same optimum.
* :func:`to_cpsat` (OR-Tools CP-SAT): enforced constraints use ``only_enforce_if``,
  intervals are ``new_optional_fixed_size_interval_var`` and ``no_overlap`` is CP-SAT's own
  global constraint. CP-SAT needs integers: continuous variables are represented on a grid
  of ``1 / scale`` (see *Time scaling* below).

So a formulation never exists twice: both engines solve the same model, and
:meth:`Model.violated` checks any assignment against it independently of either engine
(tests use it to cross-check the emitters on random models).

Time scaling (the one policy of the package for CP-SAT)
-------------------------------------------------------
Let ``s = scale``. A continuous variable ``t`` becomes an integer variable ``T`` with
``t = T / s``; every row that involves a continuous variable is multiplied by ``s``; interval
sizes become ``size * s``. Emission is **exact** when every resulting coefficient, bound and
size is an integer (``CpsatModel.exact``), which :func:`time_scale` arranges whenever the
data have at most ``max_decimals`` decimals. Otherwise coefficients are rounded to the
nearest integer and ``CpsatModel.max_rounding`` reports the largest change; a model builder
that needs valid bounds in the original units must then put its data on the grid itself
(e.g. durations rounded up for a restriction, down for a relaxation) and state which, as
the models of :mod:`optmem.models` do in their docstrings; :func:`rational_time_scale`
finds the exact grid of data that are fractions (times ``size / bandwidth``) rather than
decimals. Decoded values are divided back
by ``s``; plans are always replayed by the simulator, which gives the true objective.

Notation
--------
``x[i]`` the variables (index ``i`` in creation order); a *literal* is ``(i, True)`` for
``x[i] = 1`` or ``(i, False)`` for ``x[i] = 0`` (binary variables only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from typing import Any

from optmem.models.interrupt import poll

__all__ = [
    "Constraint", "CpsatModel", "Expr", "Interval", "Kind", "Literal", "Model", "NoOverlap",
    "PulpModel", "Var", "exact_scale", "largest_bound", "magnitude",
    "milp_integrality_tolerance", "milp_time_unit",
    "rational_time_scale", "time_scale", "to_cpsat", "to_pulp",
]

MILP_LEAST_TOLERANCE = 1e-9
"""The smallest integrality tolerance :func:`milp_integrality_tolerance` asks for (stop 78)."""
MILP_DEFAULT_TOLERANCE = 1e-6
"""HiGHS's default ``mip_feasibility_tolerance`` (kept unless a model needs less)."""
MILP_HORIZON = 2.0**20
"""Largest continuous variable bound a badly conditioned MILP is emitted with
(:func:`milp_time_unit`, :meth:`Model.in_units`; stop 77)."""

MAX_DECIMALS = 6
_TOL = 1e-9


class Kind(StrEnum):
    """Variable domain."""

    BINARY = "binary"
    INTEGER = "integer"
    CONTINUOUS = "continuous"


@dataclass(frozen=True)
class Var:
    """A model variable (``lo``/``hi`` may be infinite for continuous/integer variables)."""

    index: int
    name: str
    kind: Kind
    lo: float
    hi: float


Literal = tuple[int, bool]
"""``(variable index, polarity)``: true when the binary variable equals ``polarity``."""

Term = tuple[int, float]


class Expr:
    """A linear expression ``sum coef * x[i] + const``.

    Supports ``+``, ``-``, multiplication by a number and comparison with ``<=``, ``>=`` and
    ``==`` (which give a :class:`Relation` for :meth:`Model.add`).

    Examples
    --------
    >>> m = Model("doc")
    >>> x, y = m.binary("x"), m.integer("y", 0, 5)
    >>> e = 2 * x + y - 1
    >>> e.terms, e.const
    ([(0, 2.0), (1, 1.0)], -1.0)
    """

    __slots__ = ("const", "terms")

    def __init__(self, terms: Iterable[Term] = (), const: float = 0.0) -> None:
        self.terms: list[Term] = list(terms)
        self.const = float(const)

    @classmethod
    def _own(cls, terms: list[Term], const: float) -> Expr:
        """An expression taking ``terms`` (a new list) and the float ``const`` as they are.

        The constructor's copy and conversion skipped: the operators below build one
        expression per step of every model (a pipeline question builds ~100,000).
        """
        e = object.__new__(cls)
        e.terms = terms
        e.const = const
        return e

    @staticmethod
    def of(value: ExprLike) -> Expr:
        """``value`` as an expression (numbers become constants)."""
        if isinstance(value, Expr):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"cannot use {value!r} in a linear expression")
        return Expr((), float(value))

    @staticmethod
    def sum(items: Iterable[ExprLike]) -> Expr:
        """The sum of expressions and numbers (linear time, unlike ``sum()``)."""
        terms: list[Term] = []
        const = 0.0
        for item in items:
            e = item if type(item) is Expr else Expr.of(item)
            terms.extend(e.terms)  # type: ignore[union-attr]
            const += e.const  # type: ignore[union-attr]
        return Expr._own(terms, const)

    def __add__(self, other: ExprLike) -> Expr:
        o = other if type(other) is Expr else Expr.of(other)
        return _expr(self.terms + o.terms, self.const + o.const)  # type: ignore[union-attr]

    __radd__ = __add__

    # subtraction and scaling written out (no intermediate expression, exact types tested
    # first): a remat + offload model of L = 39 makes 1.6 M products and 1.2 M differences
    def __sub__(self, other: ExprLike) -> Expr:
        o = other if type(other) is Expr else Expr.of(other)
        return _expr(self.terms + [(i, -c) for i, c in o.terms],  # type: ignore[union-attr]
                     self.const - o.const)  # type: ignore[union-attr]

    def __rsub__(self, other: ExprLike) -> Expr:
        o = Expr.of(other)
        return _expr(o.terms + [(i, -c) for i, c in self.terms], o.const - self.const)

    def __neg__(self) -> Expr:
        return self * -1.0

    def __mul__(self, c: float) -> Expr:
        kind = type(c)
        if kind is not float and kind is not int and (  # bool and Expr fail both
                isinstance(c, Expr | bool) or not isinstance(c, int | float)):
            raise TypeError("a linear expression can only be multiplied by a number")
        c = float(c)
        return _expr([(i, c * v) for i, v in self.terms], c * self.const)

    __rmul__ = __mul__

    def __le__(self, other: ExprLike) -> Relation:  # type: ignore[override]
        return Relation(self - Expr.of(other), None, 0.0)

    def __ge__(self, other: ExprLike) -> Relation:  # type: ignore[override]
        return Relation(self - Expr.of(other), 0.0, None)

    def __eq__(self, other: object) -> Relation:  # type: ignore[override]
        return Relation(self - Expr.of(other), 0.0, 0.0)  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]

    def merged(self) -> tuple[Term, ...]:
        """Terms with one entry per variable and no zero coefficients."""
        terms = self.terms
        if len({i for i, _ in terms}) == len(terms):  # nothing to merge: the same order
            return tuple(t for t in terms if t[1] != 0.0)
        acc: dict[int, float] = {}
        for i, c in self.terms:
            acc[i] = acc.get(i, 0.0) + c
        return tuple((i, c) for i, c in acc.items() if c != 0.0)

    def value(self, values: Sequence[float]) -> float:
        """Value under an assignment."""
        return self.const + sum(c * values[i] for i, c in self.terms)

    def __repr__(self) -> str:
        return f"Expr({self.terms!r}, {self.const!r})"


ExprLike = Expr | int | float
_expr = Expr._own  # the operators' constructor (bound once)


@dataclass(frozen=True)
class Relation:
    """``lo <= expr <= hi`` before it is added to a model (what comparisons return)."""

    expr: Expr
    lo: float | None
    hi: float | None


@dataclass(frozen=True)
class Constraint:
    """``lo <= sum(terms) <= hi``, enforced only when every literal of ``enforce`` holds."""

    name: str
    terms: tuple[Term, ...]
    lo: float | None
    hi: float | None
    enforce: tuple[Literal, ...] = ()


@dataclass(frozen=True)
class Interval:
    """A task ``[start, start + size)`` on one resource, present when ``presence`` holds.

    ``start`` is ``x[var] + offset`` for one integer or continuous variable (CP-SAT needs an
    affine start); ``presence`` is ``None`` for an interval that is always present.
    """

    name: str
    var: int
    offset: float
    size: float
    presence: Literal | None = None


@dataclass(frozen=True)
class NoOverlap:
    """No two present intervals of the set overlap (one machine or one link).

    ``redundant``: the set is implied by the model's rows (a global constraint that only
    helps CP-SAT's propagation); :func:`to_pulp` leaves it out, :func:`to_cpsat` and
    :meth:`Model.violated` keep it.
    """

    name: str
    intervals: tuple[int, ...]
    redundant: bool = False


@dataclass
class Model:
    """A solver-neutral minimisation model (see the module docstring).

    Examples
    --------
    Two jobs of sizes 2 and 3 on one machine, minimise the makespan:

    >>> m = Model("two-jobs")
    >>> s1, s2 = m.continuous("s1", 0, 10), m.continuous("s2", 0, 10)
    >>> c = m.continuous("cmax", 0, 10)
    >>> m.no_overlap("machine", [m.interval("j1", s1, 2), m.interval("j2", s2, 3)])
    >>> m.add(c >= s1 + 2, "end1"); m.add(c >= s2 + 3, "end2")
    >>> m.minimize(c)
    >>> m.violated([0, 2, 5]), m.violated([0, 1, 4])
    ([], ['no_overlap machine: j1 and j2'])
    """

    name: str
    vars: list[Var] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    no_overlaps: list[NoOverlap] = field(default_factory=list)
    objective: Expr = field(default_factory=Expr)

    # ------------------------------------------------------------------ variables
    def _new(self, name: str, kind: Kind, lo: float, hi: float) -> Expr:
        if lo > hi:
            raise ValueError(f"variable {name}: lower bound {lo} above upper bound {hi}")
        self.vars.append(Var(len(self.vars), name, kind, float(lo), float(hi)))
        return Expr([(len(self.vars) - 1, 1.0)])

    def binary(self, name: str) -> Expr:
        """A new 0/1 variable, as an expression."""
        return self._new(name, Kind.BINARY, 0, 1)

    def integer(self, name: str, lo: float, hi: float) -> Expr:
        """A new integer variable in ``[lo, hi]``."""
        return self._new(name, Kind.INTEGER, math.ceil(lo - _TOL), math.floor(hi + _TOL))

    def continuous(self, name: str, lo: float = 0.0, hi: float = math.inf) -> Expr:
        """A new continuous variable in ``[lo, hi]``."""
        return self._new(name, Kind.CONTINUOUS, lo, hi)

    def in_units(self, unit: float) -> Model:
        """The same model with every continuous variable ``x`` written ``x' = x / unit``.

        Every row and the objective that hold a continuous variable are divided by
        ``unit`` (their other coefficients and constants too), interval starts and sizes
        as well: an exact reformulation for a power of two ``unit`` (no float rounding);
        values map back with :meth:`from_units`. ``self`` for ``unit == 1``. Intervals
        must start at continuous variables.

        Examples
        --------
        >>> m = Model("m")
        >>> x, y = m.continuous("x", 0, 2.0**30), m.binary("y")
        >>> m.add(x >= 2.0**28 * y + 3, "row"); m.minimize(x + 1)
        >>> g = m.in_units(2.0**10)
        >>> g.vars[0].hi, g.constraints[0].terms, g.constraints[0].lo, g.objective.const
        (1048576.0, ((0, 1.0), (1, -262144.0)), 0.0029296875, 0.0009765625)
        >>> m.from_units([2.0**18, 1.0], 2.0**10)
        [268435456.0, 1.0]
        """
        if unit == 1:
            return self
        cont = {v.index for v in self.vars if v.kind is Kind.CONTINUOUS}

        def div(x: float | None) -> float | None:
            return None if x is None else x / unit

        def row(con: Constraint) -> Constraint:
            if not any(i in cont for i, _ in con.terms):
                return con
            terms = tuple((i, c if i in cont else c / unit) for i, c in con.terms)
            return replace(con, terms=terms, lo=div(con.lo), hi=div(con.hi))

        for iv in self.intervals:
            if iv.var not in cont:
                raise ValueError(f"interval {iv.name} starts at a variable that is not "
                                 "continuous: no change of units")
        objective = Expr([(i, c if i in cont else c / unit) for i, c in self.objective.terms],
                         self.objective.const / unit) \
            if any(i in cont for i, _ in self.objective.terms) else self.objective
        return replace(self, vars=[replace(v, lo=v.lo / unit, hi=v.hi / unit)
                                   if v.index in cont else v for v in self.vars],
                       constraints=[row(con) for con in self.constraints],
                       intervals=[replace(iv, offset=iv.offset / unit, size=iv.size / unit)
                                  for iv in self.intervals],
                       no_overlaps=list(self.no_overlaps), objective=objective)

    def from_units(self, values: Sequence[float], unit: float) -> list[float]:
        """Values of :meth:`in_units` ``(unit)`` back in this model's units."""
        return [x * unit if v.kind is Kind.CONTINUOUS else x
                for v, x in zip(self.vars, values, strict=True)]

    def to_units(self, values: Sequence[float], unit: float) -> list[float]:
        """Values of this model in the units of :meth:`in_units` ``(unit)``."""
        return [x / unit if v.kind is Kind.CONTINUOUS else x
                for v, x in zip(self.vars, values, strict=True)]

    @staticmethod
    def index(x: Expr) -> int:
        """The variable index of a single-variable expression made by this model."""
        if len(x.terms) != 1 or x.terms[0][1] != 1.0 or x.const != 0.0:
            raise ValueError(f"expected a single variable, got {x!r}")
        return x.terms[0][0]

    def literal(self, x: Expr, value: bool = True) -> Literal:
        """The literal ``x == value`` of a binary variable."""
        i = self.index(x)
        if self.vars[i].kind is not Kind.BINARY:
            raise ValueError(f"{self.vars[i].name} is not binary")
        return (i, bool(value))

    # ------------------------------------------------------------------ constraints
    def add(self, rel: Relation, name: str, *, only_if: Sequence[Literal] | Literal = ()
            ) -> None:
        """Add a relation (``expr <= ..``, ``>=``, ``==``), optionally enforced by literals.

        A relation without variables is checked at once: a violated one is kept as an
        infeasible row (``name!``) so that both emitters and :meth:`violated` see it.
        Polls :func:`optmem.models.interrupt.poll` (a build stops at its solve's deadline).
        """
        poll()
        lits: tuple[Literal, ...]
        if isinstance(only_if, tuple) and len(only_if) == 2 and isinstance(only_if[1], bool):
            lits = (only_if,)  # type: ignore[assignment]
        else:
            lits = tuple(only_if)  # type: ignore[arg-type]
        terms = rel.expr.merged()
        lo = None if rel.lo is None else rel.lo - rel.expr.const
        hi = None if rel.hi is None else rel.hi - rel.expr.const
        if not terms:
            bad = (lo is not None and lo > _TOL) or (hi is not None and hi < -_TOL)
            if bad:
                self.constraints.append(Constraint(name + "!", (), lo, hi, lits))
            return
        self.constraints.append(Constraint(name, terms, lo, hi, lits))

    def interval(self, name: str, start: Expr, size: float,
                 presence: Literal | None = None) -> int:
        """A new interval ``[start, start + size)``; returns its index."""
        if len(start.terms) != 1 or start.terms[0][1] != 1.0:
            raise ValueError(f"interval {name}: the start must be one variable plus a constant")
        if size < 0:
            raise ValueError(f"interval {name}: negative size {size}")
        self.intervals.append(Interval(name, start.terms[0][0], start.const, float(size),
                                       presence))
        return len(self.intervals) - 1

    def no_overlap(self, name: str, intervals: Iterable[int], *, redundant: bool = False
                   ) -> None:
        """No two present intervals of ``intervals`` overlap.

        ``redundant=True`` states that the model's rows already imply it (see
        :class:`NoOverlap`): only CP-SAT receives it.
        """
        self.no_overlaps.append(NoOverlap(name, tuple(intervals), redundant))

    def minimize(self, expr: ExprLike) -> None:
        """Set the objective (to minimise)."""
        self.objective = Expr.of(expr)

    # ------------------------------------------------------------------ checking
    @property
    def size(self) -> dict[str, int]:
        """Variables, constraints (rows, intervals and no-overlap sets) and non-zeros."""
        return {"variables": len(self.vars), "constraints": len(self.constraints),
                "intervals": len(self.intervals), "no_overlaps": len(self.no_overlaps),
                "nonzeros": sum(len(c.terms) for c in self.constraints)}

    @property
    def trivially_infeasible(self) -> bool:
        """Whether an unconditional constraint without variables is violated."""
        return any(not c.terms and not c.enforce for c in self.constraints)

    def evaluate(self, values: Sequence[float]) -> float:
        """Objective value of an assignment."""
        return self.objective.value(values)

    def solution_error(self, values: Sequence[float], tol: float = 1e-6) -> str | None:
        """Why ``values`` is no solution of the model (``None`` when it is one).

        What an engine returns is checked with it before it is decoded: a misbehaving engine
        (a wrong number of values, NaN, rows violated) is then an engine fault, not a
        decoding crash.

        Examples
        --------
        >>> m = Model("m"); x = m.integer("x", 0, 3); m.add(x >= 2, "low"); m.minimize(x)
        >>> m.solution_error([2]), m.solution_error([1]), m.solution_error([])
        (None, 'violates 1 constraint(s): low', '0 values for 1 variables')
        """
        shape = shape_error(values, len(self.vars))
        if shape is not None:
            return shape
        bad = self.violated(values, tol)
        return f"violates {len(bad)} constraint(s): {', '.join(bad[:3])}" if bad else None

    def violated(self, values: Sequence[float], tol: float = 1e-6) -> list[str]:
        """Names of what an assignment violates: bounds, integrality, rows, no-overlaps."""
        bad: list[str] = []
        for v in self.vars:
            x = values[v.index]
            if x < v.lo - tol or x > v.hi + tol:
                bad.append(f"bound {v.name}")
            elif v.kind is not Kind.CONTINUOUS and abs(x - round(x)) > tol:
                bad.append(f"integrality {v.name}")
        for con in self.constraints:
            if not all(_holds(values, lit) for lit in con.enforce):
                continue
            s = sum(c * values[i] for i, c in con.terms)
            scale = max(1.0, *(abs(c) for _, c in con.terms)) if con.terms else 1.0
            if (con.lo is not None and s < con.lo - tol * scale) or (
                    con.hi is not None and s > con.hi + tol * scale):
                bad.append(con.name)
        for group in self.no_overlaps:
            present = [self.intervals[k] for k in group.intervals
                       if self.intervals[k].presence is None
                       or _holds(values, self.intervals[k].presence)]  # type: ignore[arg-type]
            for a_pos, a in enumerate(present):
                sa = values[a.var] + a.offset
                for b in present[a_pos + 1:]:
                    sb = values[b.var] + b.offset
                    if a.size > 0 and b.size > 0 and sa + a.size > sb + tol \
                            and sb + b.size > sa + tol:
                        bad.append(f"no_overlap {group.name}: {a.name} and {b.name}")
        return bad


def _holds(values: Sequence[float], lit: Literal) -> bool:
    return (values[lit[0]] > 0.5) == lit[1]


# ------------------------------------------------------------------ bounds of expressions
def milp_time_unit(horizon: float, target: float = MILP_HORIZON) -> float:
    """The power of two ``2**e >= 1`` that brings ``horizon`` to at most ``target``.

    A MILP whose times reach ``horizon`` is emitted in these units (:meth:`Model.in_units`):
    on a very slow link (horizons ~1e10 against durations ~1, big-M rows as large) HiGHS
    called feasible offload models infeasible and proved wrong optima (hunt, stop 76);
    ``1.0`` for ``horizon <= target`` (nothing changes).

    Examples
    --------
    >>> milp_time_unit(34000000012.0), milp_time_unit(2.0**20), milp_time_unit(math.inf)
    (32768.0, 1.0, 1.0)
    """
    if not math.isfinite(horizon) or horizon <= target:
        return 1.0
    return 2.0 ** math.ceil(math.log2(horizon / target))


def largest_bound(model: Model) -> float:
    """The largest finite bound of a continuous variable (``0`` without one).

    Examples
    --------
    >>> m = Model("m"); _ = m.continuous("x", -3, 2), m.continuous("y"), m.integer("k", 0, 9)
    >>> largest_bound(m)
    3.0
    """
    return max((abs(b) for v in model.vars if v.kind is Kind.CONTINUOUS
                for b in (v.lo, v.hi) if math.isfinite(b)), default=0.0)


def magnitude(model: Model) -> float:
    """The largest row coefficient times the largest finite variable bound (``|a| * |x|``).

    An engine that linearises an enforced row multiplies its coefficients by a big-M of the
    order of the variable bounds: this product is the size such numbers reach. CP-SAT 9.15's
    presolve proved wrong optima on models where it is ~1e20 (stop 77,
    :data:`optmem.models.offload.CPSAT_PRESOLVE_MAGNITUDE`).

    Examples
    --------
    >>> m = Model("m")
    >>> x, y = m.continuous("x", 0, 1e10), m.binary("y")
    >>> m.add(x >= 4e9 * y, "row")
    >>> magnitude(m)
    4e+19
    """
    coef = max((abs(c) for con in model.constraints for _, c in con.terms), default=0.0)
    coef = max([coef, *(abs(iv.size) for iv in model.intervals)])
    bound = max((abs(b) for v in model.vars for b in (v.lo, v.hi) if math.isfinite(b)),
                default=0.0)
    return coef * bound


def _range(model: Model, terms: Iterable[Term]) -> tuple[float, float]:
    """Smallest and largest value of ``sum c x`` over the variable bounds."""
    lo = hi = 0.0
    for i, c in terms:
        v = model.vars[i]
        a, b = (c * v.lo, c * v.hi) if c >= 0 else (c * v.hi, c * v.lo)
        lo += a
        hi += b
    return lo, hi


def _big_m(model: Model, con: Constraint) -> tuple[float | None, float | None]:
    """Big-M of the ``hi`` and ``lo`` sides of an enforced row (None: side not needed)."""
    lo, hi = _range(model, con.terms)
    m_hi = m_lo = None
    if con.hi is not None and hi > con.hi + _TOL:
        m_hi = hi - con.hi
        if not math.isfinite(m_hi):
            raise ValueError(f"constraint {con.name}: enforced row needs finite variable "
                             "bounds for its big-M")
    if con.lo is not None and lo < con.lo - _TOL:
        m_lo = con.lo - lo
        if not math.isfinite(m_lo):
            raise ValueError(f"constraint {con.name}: enforced row needs finite variable "
                             "bounds for its big-M")
    return m_hi, m_lo


def milp_integrality_tolerance(model: Model, resolution: float, *,
                               least: float = MILP_LEAST_TOLERANCE,
                               default: float = MILP_DEFAULT_TOLERANCE) -> float:
    """An integrality tolerance under which no time row slips by ``resolution / 2``.

    A MILP engine accepts an integer variable within its tolerance ``eps`` of an integer
    and decodes it rounded; a row of :func:`to_pulp` that holds an integer variable with
    coefficient ``a`` (a transfer time on a 0/1 choice, or the big-M of an enforced row)
    then holds for the rounded value only up to ``|a| eps``. On a slow link (stop 77's 42
    remat + offload cases: transfers ~5e7 beside compute ops of 1-10) HiGHS's default
    ``eps = 1e-6`` let such rows slip by 10-40 time units and the decoded plans overran the
    memory. This returns ``resolution / (2 K)`` with ``K`` the largest such ``|a|`` (the
    M of :func:`_big_m` for enforced sides) over the rows that hold a continuous variable,
    clamped to ``[least, default]``: ``default`` when the model's coefficients are small
    beside ``resolution`` (most models: nothing changes). ``least`` (1e-9) because HiGHS
    called feasible models infeasible at 1e-10 (stop 78); below it the replay of the
    decoded plan stays the judge. Invariant under :meth:`Model.in_units` when
    ``resolution`` is given in the same units.

    Examples
    --------
    >>> m = Model("m"); t, y = m.continuous("t", 0, 1e9), m.binary("y")
    >>> m.add(t >= 5e7 * y, "busy"); m.minimize(t)
    >>> [milp_integrality_tolerance(m, r) for r in (0.01, 1.0, 1000.0)]
    [1e-09, 1e-08, 1e-06]
    """
    cont = {v.index for v in model.vars if v.kind is Kind.CONTINUOUS}
    largest = 0.0
    for con in model.constraints:
        if not any(i in cont for i, _ in con.terms):
            continue
        for i, c in con.terms:
            if i not in cont:
                largest = max(largest, abs(c))
        if con.enforce:
            largest = max(largest, *(m for m in _big_m(model, con) if m is not None),
                          0.0)
    if largest == 0.0 or not math.isfinite(largest) or not resolution > 0:
        return default
    return min(default, max(least, resolution / (2.0 * largest)))


def shape_error(values: Sequence[float], count: int) -> str | None:
    """Why an engine's ``values`` are no assignment of ``count`` variables (``None``: they are).

    Examples
    --------
    >>> shape_error([1.0, 2.0], 2), shape_error([1.0], 2), shape_error([math.nan], 1)
    (None, '1 values for 2 variables', 'a value is not finite')
    """
    if len(values) != count:
        return f"{len(values)} values for {count} variables"
    if not all(math.isfinite(x) for x in values):
        return "a value is not finite"
    return None


# ------------------------------------------------------------------ PuLP
@dataclass
class PulpModel:
    """A :class:`Model` written for PuLP.

    ``variables`` are in model order (the order of engine values and warm starts);
    ``auxiliary`` are the order binaries of ``no_overlap`` sets and the objective constant,
    whose warm-start values :func:`to_pulp` derives from a full assignment.
    """

    model: Model
    problem: Any
    variables: list[Any]
    auxiliary: list[Any]
    orders: list[tuple[int, int, int]]  # (aux index, interval a, interval b): 1 = a before b

    def initial(self, values: Sequence[float] | None) -> list[float] | None:
        """A warm start for every PuLP variable (model and auxiliary) from model values."""
        if values is None:
            return None
        out = [float(v) for v in values]
        aux = [0.0] * len(self.auxiliary)
        for k, a, b in self.orders:
            ia, ib = self.model.intervals[a], self.model.intervals[b]
            aux[k] = 1.0 if values[ia.var] + ia.offset <= values[ib.var] + ib.offset else 0.0
        if self.auxiliary and self.auxiliary[-1].name == "objective_constant":
            aux[-1] = 1.0
        return out + aux

    @property
    def all_variables(self) -> list[Any]:
        """Model variables then auxiliary ones (the engine's variable list)."""
        return self.variables + self.auxiliary


def _lit_expr(xs: Sequence[Any], lits: Sequence[Literal]) -> Any:
    """``sum of (1 - literal value)``: 0 exactly when every literal holds."""
    return _affine(xs, [(i, -1.0 if pol else 1.0) for i, pol in lits],
                   float(sum(1 for _, pol in lits if pol)))


def _affine(xs: Sequence[Any], terms: Iterable[tuple[int, float]], constant: float = 0.0
            ) -> Any:
    """``constant + sum of c * xs[i]`` as one PuLP expression, written at once.

    Equal to ``pulp.lpSum(c * xs[i] ...)`` (a repeated index adds up) without its one
    temporary expression per term: on the remat + offload link relaxation of ResNet-101
    (17 k rows, 0.9 M terms) ``lpSum`` took 10.8 of the emission's 11.5 s under cProfile.
    """
    import pulp  # type: ignore[import-untyped]

    coef: dict[Any, float] = {}
    for i, c in terms:
        x = xs[i]
        coef[x] = coef.get(x, 0.0) + c
    return pulp.LpAffineExpression(coef, constant=constant)


def to_pulp(model: Model) -> PulpModel:
    """Write ``model`` as a PuLP minimisation problem (big-M for enforcement and orders)."""
    import pulp  # type: ignore[import-untyped]

    prob = pulp.LpProblem(_safe(model.name), pulp.LpMinimize)
    cat = {Kind.BINARY: pulp.LpBinary, Kind.INTEGER: pulp.LpInteger,
           Kind.CONTINUOUS: pulp.LpContinuous}
    xs = [prob.add_variable(_safe(v.name) + f"_{v.index}",
                            None if v.lo == -math.inf else v.lo,
                            None if v.hi == math.inf else v.hi, cat=cat[v.kind])
          for v in model.vars]
    aux: list[Any] = []
    for con in model.constraints:
        poll()  # the emission stops at its solve's deadline (optmem.models.interrupt)
        _pulp_row(prob, model, xs, con)
    orders: list[tuple[int, int, int]] = []
    for g, group in enumerate(model.no_overlaps):
        if group.redundant:
            continue
        for p, a in enumerate(group.intervals):
            for b in group.intervals[p + 1:]:
                ia, ib = model.intervals[a], model.intervals[b]
                if ia.size == 0 or ib.size == 0:
                    continue
                o = prob.add_variable(f"order_{g}_{a}_{b}", 0, 1, cat=pulp.LpBinary)
                orders.append((len(aux), a, b))
                aux.append(o)
                _pulp_order(prob, model, xs, ia, ib, o, f"no_{g}_{a}_{b}")
    objective = _affine(xs, model.objective.merged())
    if model.objective.const:
        one = prob.add_variable("objective_constant", 1, 1, cat=pulp.LpInteger)
        aux.append(one)
        objective += model.objective.const * one
    prob += objective
    if model.trivially_infeasible and xs:
        prob += (xs[0] >= (model.vars[0].hi + 1), "infeasible_constant_row")
    return PulpModel(model, prob, xs, aux, orders)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name) or "x"


def _pulp_row(prob: Any, model: Model, xs: Sequence[Any], con: Constraint) -> None:

    if not con.terms:
        if con.enforce:  # a violated constant row: its literals cannot all hold
            prob += (_lit_expr(xs, con.enforce) >= 1, _safe(con.name) + "_never")
        return  # an unconditional one: see trivially_infeasible
    lhs = _affine(xs, con.terms)
    name = _safe(con.name)
    if not con.enforce:
        if con.lo is not None and con.hi is not None and con.lo == con.hi:
            prob += (lhs == con.hi, name)
            return
        if con.hi is not None:
            prob += (lhs <= con.hi, name + "_hi")
        if con.lo is not None:
            prob += (lhs >= con.lo, name + "_lo")
        return
    m_hi, m_lo = _big_m(model, con)
    off = _lit_expr(xs, con.enforce)
    if m_hi is not None:
        prob += (lhs <= con.hi + m_hi * off, name + "_hi")
    if m_lo is not None:
        prob += (lhs >= con.lo - m_lo * off, name + "_lo")


def _pulp_order(prob: Any, model: Model, xs: Sequence[Any], a: Interval, b: Interval,
                o: Any, name: str) -> None:
    """``o = 1``: a ends before b starts; ``o = 0``: b before a (when both are present)."""
    va, vb = model.vars[a.var], model.vars[b.var]
    for bound in (va.lo, va.hi, vb.lo, vb.hi):
        if not math.isfinite(bound):
            raise ValueError(f"no_overlap of {a.name} and {b.name} needs finite start bounds")
    sa, sb = xs[a.var] + a.offset, xs[b.var] + b.offset
    # largest violation of "a before b": end_a - start_b, over the bounds
    m_ab = va.hi + a.offset + a.size - (vb.lo + b.offset)
    m_ba = vb.hi + b.offset + b.size - (va.lo + a.offset)
    pres = [p for p in (a.presence, b.presence) if p is not None]
    absent = _lit_expr(xs, pres) if pres else 0
    if m_ab > 0:
        prob += (sa + a.size <= sb + m_ab * (1 - o) + m_ab * absent, name + "_ab")
    if m_ba > 0:
        prob += (sb + b.size <= sa + m_ba * o + m_ba * absent, name + "_ba")


# ------------------------------------------------------------------ CP-SAT
@dataclass
class CpsatModel:
    """A :class:`Model` written for CP-SAT.

    Attributes
    ----------
    scale
        Continuous variables are integers in units of ``1 / scale``.
    exact
        Whether every scaled coefficient, bound and size was an integer (no rounding).
    max_rounding
        The largest change that rounding made to a scaled number (0 when exact).
    """

    model: Model
    cp: Any
    variables: list[Any]
    scale: int
    exact: bool
    max_rounding: float
    objective_scale: float

    def hint(self, values: Sequence[float] | None) -> list[int] | None:
        """Integer hint values (continuous ones scaled) from model values."""
        if values is None:
            return None
        return [int(round(x * self.scale)) if v.kind is Kind.CONTINUOUS else int(round(x))
                for v, x in zip(self.model.vars, values, strict=True)]

    def values(self, raw: Sequence[float]) -> list[float]:
        """Model values from the engine's integer values."""
        return [x / self.scale if v.kind is Kind.CONTINUOUS else float(x)
                for v, x in zip(self.model.vars, raw, strict=True)]

    def objective(self, raw_objective: float) -> float:
        """Objective in the model's units from CP-SAT's (scaled, constant excluded)."""
        return raw_objective / self.objective_scale + self.model.objective.const


def time_scale(values: Iterable[float], max_decimals: int = MAX_DECIMALS) -> tuple[int, bool]:
    """Smallest ``10**d`` (``d <= max_decimals``) making every value integral; whether it exists.

    Examples
    --------
    >>> time_scale([1.0, 2.0]), time_scale([0.25, 1.5]), time_scale([1 / 3])
    ((1, True), (100, True), (1000000, False))
    >>> time_scale([1e-9, 0.0])  # 1e-9 is not 0: off every grid up to 1e-6
    (1000000, False)
    """
    vals = [float(v) for v in values if math.isfinite(v)]
    for d in range(max_decimals + 1):
        scale = 10**d
        # relative only: an absolute 1e-9 took a time of 1e-9 for 0 on the grid of 1
        # ("exact"), and CP-SAT then proved "optimal" plans that were not
        if all(abs(t * scale - round(t * scale)) <= 1e-9 * abs(t * scale) for t in vals):
            return scale, True
    return 10**max_decimals, False


GRID_CEILING_SLACK = 1e-5
"""Relative slack of :func:`grid_ceiling`: ten times the engines' tolerance on a bound."""


def grid_ceiling(bound: float, scale: int) -> float:
    """A lower bound lifted to the grid ``1 / scale`` of the values it bounds.

    When every duration of an instance is a multiple of ``1 / scale``, so is every plan's
    makespan (its starts and ends are maxima and sums of durations), hence so is the
    optimum, and a valid bound ``b`` gives the bound ``ceil(b scale) / scale``. ``b`` comes
    from an engine and may be a hair above its true value (tolerances) or a hair below the
    grid point it proves (the margins callers take off): the ceiling is taken of ``b scale``
    less a slack of :data:`GRID_CEILING_SLACK` relative, and only where that slack is below
    half a grid step (otherwise ``b`` is returned as it is). Never below ``b``.

    Examples
    --------
    >>> grid_ceiling(87.99999991, 1), grid_ceiling(87.3, 1), grid_ceiling(87.0000001, 1)
    (88.0, 88.0, 87.0000001)
    >>> round(grid_ceiling(67.64, 51) * 51, 9), grid_ceiling(1234.5, 1000)  # fine: unchanged
    (3450.0, 1234.5)
    """
    x = bound * scale
    slack = GRID_CEILING_SLACK * max(1.0, abs(x))
    if not math.isfinite(x) or scale <= 0 or slack >= 0.5:
        return bound
    return max(bound, math.ceil(x - slack) / scale)


def exact_scale(values: Iterable[Fraction], limit: int = 10**13) -> int | None:
    """Smallest ``scale`` with every value a multiple of ``1 / scale`` (``None`` above ``limit``).

    The least common multiple of the denominators: the grid of :func:`rational_time_scale`,
    and of models whose data are exact fractions already (:mod:`optmem.models.offload`).

    Examples
    --------
    >>> exact_scale([Fraction("0.25"), Fraction(7, 3)], 10**6)
    12
    >>> exact_scale([Fraction(1, 10**10)], 10**6) is None
    True
    """
    scale = 1
    for v in values:
        scale = math.lcm(scale, v.denominator)
        if scale > limit:
            return None
    return scale


def rational_time_scale(values: Iterable[float], *, resolution: float | None = None,
                        max_denominator: int = 10**7, max_scale: int = 10**13
                        ) -> tuple[int, bool]:
    """Smallest integer scale ``s`` putting every value on the grid ``1 / s``; whether exact.

    Each value is read as the fraction ``p / q`` with ``q <= max_denominator`` closest to it,
    kept when within ``1e-15`` relative (a few units in the last place: "exact" means exact
    up to the float's own rounding). Profiled times with six decimals and transfer times
    ``size / bandwidth`` are such fractions, which powers of ten alone cannot make integral.
    ``s`` is the least common multiple of the ``q``. ``resolution`` multiplies ``s`` by the
    smallest integer making ``1 / s <= resolution`` (a finer grid keeps values that the data
    do not fix, such as a period ``D / k``, within one grid step of their true value). When
    ``s`` would exceed ``max_scale``, the result is ``10**MAX_DECIMALS`` (refined the same
    way; ``max_scale`` if smaller) and ``False``.

    Examples
    --------
    >>> rational_time_scale([0.724323, 102760448 / 12e6])
    (3000000, True)
    >>> rational_time_scale([1.0, 0.5], resolution=0.01)
    (100, True)
    >>> rational_time_scale([1 / 3, 0.25]), rational_time_scale([0.1234567], max_denominator=1000)
    ((12, True), (1000000, False))
    """
    fractions: list[Fraction] = []
    exact = True
    for v in values:
        if not math.isfinite(v):
            continue
        frac = Fraction(v).limit_denominator(max_denominator)
        if abs(v - float(frac)) > 1e-15 * max(1.0, abs(v)):
            exact = False
            break
        fractions.append(frac)
    lcm = exact_scale(fractions, max_scale) if exact else None
    exact = lcm is not None
    scale = lcm if lcm is not None else 1
    if not exact:
        scale = min(10**MAX_DECIMALS, max_scale)
    if resolution is not None and resolution > 0 and 1 / scale > resolution:
        scale *= math.ceil(1 / (scale * resolution) - 1e-12)
    return scale, exact


def _integral(x: float) -> tuple[int, float]:
    r = round(x)
    return int(r), abs(x - r)


_SNAP = 1e-6  # a scaled number this close to an integer is that integer (``exact``)


def _ceil(x: float) -> int:
    """``ceil(x)``, except that ``x`` within ``_SNAP`` of an integer is that integer.

    Scaled data carry float noise that grows with their magnitude (``2.5e8`` is off by
    ``3e-8``): an absolute ``1e-9`` would round such a bound up by one grid step.
    """
    r, err = _integral(x)
    return r if err <= _SNAP else math.ceil(x)


def _floor(x: float) -> int:
    """``floor(x)``, with the same snapping as :func:`_ceil`."""
    r, err = _integral(x)
    return r if err <= _SNAP else math.floor(x)


def _cp_bound(v: Var, scale: int) -> tuple[int, int]:
    lo, hi = v.lo, v.hi
    if v.kind is Kind.CONTINUOUS:
        lo, hi = lo * scale, hi * scale
    big = 2**62 // 4
    low = max(-big, _ceil(lo)) if math.isfinite(lo) else -big
    high = min(big, _floor(hi)) if math.isfinite(hi) else big
    if low > high and lo <= hi:
        # no grid point between the two bounds (a period bounded by lower = upper = 7e-9 on
        # a grid of 7e-18): the nearest one above, not an empty domain (CP-SAT's
        # MODEL_INVALID, an engine error where the instance was only infeasible)
        high = low
    return low, high


def _write_row(row: Any, con: Constraint, divisor: Sequence[int], scale: int) -> float:
    """Write ``con`` into the empty CP-SAT ``row`` (a ``ConstraintProto``); its rounding error.

    The proto is written directly, as ``CpModel.add_linear_constraint`` and
    ``only_enforce_if`` write it (variables in increasing order, zero coefficients dropped,
    no domain where the bounds cross), without CP-SAT's expression objects built term by
    term: 2.2x faster on the pipeline's head questions (``benchmarks/bench_cpsat_writer.py``).
    One difference, on purpose: a row whose coefficients all round to 0 and whose bounds
    cross stays an infeasible row (no term, no domain), where the API writes an empty
    constraint, always true.
    """
    ids = [i for i, _ in con.terms]
    if any(divisor[i] != 1 for i in ids):  # a continuous term: the row is on the grid
        k = scale
        scaled = [c * k / divisor[i] for i, c in con.terms]
    else:
        k = 1
        scaled = [c for _, c in con.terms]
    coefs = [round(c) for c in scaled]
    worst = max(abs(c - r) for c, r in zip(scaled, coefs, strict=True))
    if 0 in coefs or ids != sorted(ids):  # CP-SAT's canonical form
        pairs = sorted((i, r) for i, r in zip(ids, coefs, strict=True) if r)
        ids = [i for i, _ in pairs]
        coefs = [r for _, r in pairs]
    lo = -_INT_MAX if con.lo is None else _ceil(con.lo * k)
    hi = _INT_MAX if con.hi is None else _floor(con.hi * k)
    for side in (con.lo, con.hi):
        if side is not None:
            worst = max(worst, _integral(side * k)[1])
    if con.enforce:
        row.enforcement_literal.extend([i if positive else -i - 1
                                        for i, positive in con.enforce])
    linear = row.linear
    linear.vars.extend(ids)
    linear.coeffs.extend(coefs)
    if lo <= hi:
        linear.domain.extend([lo, hi])
    return worst


_INT_MAX = 2**63 - 1
"""CP-SAT's ``INT_MAX`` (``cp_model.INT_MAX``): an open side of a row."""


def to_cpsat(model: Model, scale: int = 1, objective_scale: int | None = None) -> CpsatModel:
    """Write ``model`` for CP-SAT, continuous variables on a grid of ``1 / scale``.

    The objective is multiplied by ``objective_scale`` (default ``scale``: objectives are
    times) before its coefficients are rounded.
    """
    from ortools.sat.python import cp_model

    cp = cp_model.CpModel()
    xs: list[Any] = []
    for v in model.vars:
        if v.kind is Kind.BINARY:
            xs.append(cp.new_bool_var(v.name))
        else:
            lo, hi = _cp_bound(v, scale)
            xs.append(cp.new_int_var(lo, hi, v.name))
    # a term's divisor: the grid of a continuous variable (its coefficient is per grid step)
    divisor = [scale if v.kind is Kind.CONTINUOUS else 1 for v in model.vars]
    worst = 0.0

    def lit(literal: Literal) -> Any:
        return xs[literal[0]] if literal[1] else xs[literal[0]].negated()

    rows = cp.proto.constraints
    for con in model.constraints:
        poll()  # the emission stops at its solve's deadline (optmem.models.interrupt)
        if not con.terms:
            c0 = cp.add_bool_or([])  # violated constant row
            if con.enforce:
                c0.only_enforce_if([lit(x) for x in con.enforce])
            continue
        worst = max(worst, _write_row(rows.add(), con, divisor, scale))
    ivs: list[Any] = []
    for it in model.intervals:
        k = divisor[it.var]
        off, e1 = _integral(it.offset * k)
        size, e2 = _integral(it.size * k)
        worst = max(worst, e1, e2)
        start = xs[it.var] + off
        if it.presence is None:
            ivs.append(cp.new_fixed_size_interval_var(start, size, it.name))
        else:
            ivs.append(cp.new_optional_fixed_size_interval_var(start, size, lit(it.presence),
                                                               it.name))
    for group in model.no_overlaps:
        cp.add_no_overlap([ivs[k] for k in group.intervals])
    terms = model.objective.merged()
    k = scale if objective_scale is None else objective_scale
    obj = []
    for i, c in terms:
        ic, err = _integral(c * k / divisor[i])
        worst = max(worst, err)
        obj.append(ic * xs[i])
    cp.minimize(sum(obj))
    if model.trivially_infeasible:
        cp.add_bool_or([])
    return CpsatModel(model, cp, xs, scale, worst <= 1e-6, worst, float(k))
