"""The solver-neutral model layer: both emitters solve the same model as brute force does.

Random small models (binary and small integer variables, rows with and without enforcement
literals, optional intervals in no-overlap sets) are solved by enumeration over every
assignment (judged by :meth:`Model.violated`, which knows nothing of either engine), by
HiGHS and CBC through :func:`to_pulp` and by CP-SAT through :func:`to_cpsat`; status and
optimum must agree. Scheduling models with continuous start times check the big-M of the
no-overlap emission and the CP-SAT time scaling.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optmem.engines import adapters as engines
from optmem.models.formulation import (
    Constraint,
    Expr,
    Kind,
    Model,
    rational_time_scale,
    time_scale,
    to_cpsat,
    to_pulp,
)
from optmem.result import Status

# FORM_EXAMPLES=1500 for a long run (passed: 1,500 models per property)
SETTINGS = settings(max_examples=int(os.environ.get("FORM_EXAMPLES", 70)), deadline=None,
                    derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def brute(model: Model) -> float | None:
    """Optimum over every assignment of a model with discrete variables only (None: infeasible)."""
    domains = [range(int(v.lo), int(v.hi) + 1) for v in model.vars]
    best = None
    for values in itertools.product(*domains):
        if model.violated(list(values)):
            continue
        obj = model.evaluate(list(values))
        best = obj if best is None else min(best, obj)
    return best


def solve_all(model: Model, scale: int = 1) -> dict[str, tuple[Status, float, list[float]]]:
    out = {}
    for engine in ("highs", "cbc"):
        pm = to_pulp(model)
        res = engines.solve_pulp(pm.problem, pm.all_variables, engine, threads=1)
        vals = res.values[:len(model.vars)] if res.values is not None else []
        out[engine] = (res.status, res.objective, vals)
    cm = to_cpsat(model, scale)
    res = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
    vals = cm.values(res.values) if res.values is not None else []
    obj = cm.objective(res.objective) if res.values is not None else math.nan
    out["cpsat"] = (res.status, obj, vals)
    return out


@st.composite
def random_models(draw):
    m = Model("random")
    n_bin = draw(st.integers(1, 3))
    n_int = draw(st.integers(0, 2))
    xs = [m.binary(f"b{i}") for i in range(n_bin)]
    xs += [m.integer(f"i{i}", draw(st.integers(-2, 0)), draw(st.integers(0, 3)))
           for i in range(n_int)]
    coef = st.integers(-4, 4)
    for r in range(draw(st.integers(1, 4))):
        expr = Expr.sum(draw(coef) * x for x in xs)
        rhs = draw(st.integers(-4, 6))
        kind = draw(st.sampled_from(["<=", ">=", "=="]))
        rel = expr <= rhs if kind == "<=" else expr >= rhs if kind == ">=" else expr == rhs
        lits = []
        if draw(st.booleans()):
            k = draw(st.integers(0, n_bin - 1))
            lits.append(m.literal(xs[k], draw(st.booleans())))
        m.add(rel, f"r{r}", only_if=lits)
    if n_int and draw(st.booleans()):
        ivs = []
        for k in range(n_bin):
            start = xs[n_bin + draw(st.integers(0, n_int - 1))]
            pres = m.literal(xs[k]) if draw(st.booleans()) else None
            ivs.append(m.interval(f"iv{k}", start + draw(st.integers(0, 2)),
                                  draw(st.integers(1, 2)), pres))
        m.no_overlap("machine", ivs)
    m.minimize(Expr.sum(draw(coef) * x for x in xs) + draw(st.integers(0, 3)))
    return m


@SETTINGS
@given(random_models())
def test_emitters_agree_with_brute_force(model):
    expected = brute(model)
    for engine, (status, obj, values) in solve_all(model).items():
        if expected is None:
            assert status is Status.INFEASIBLE, engine
            continue
        assert status is Status.OPTIMAL, (engine, status)
        assert obj == pytest.approx(expected, abs=1e-6), engine
        assert not model.violated([round(v) for v in values]), engine
        assert model.evaluate([round(v) for v in values]) == pytest.approx(expected, abs=1e-6)


def single_machine(durations, releases, decimals_ok=True):
    """Minimise the sum of completion times of jobs on one machine with release dates."""
    m = Model("machine")
    horizon = max(releases) + sum(durations)
    starts = [m.continuous(f"s{j}", r, horizon) for j, r in enumerate(releases)]
    ivs = [m.interval(f"j{j}", s, d) for j, (s, d) in enumerate(zip(starts, durations,
                                                                     strict=True))]
    m.no_overlap("machine", ivs)
    m.minimize(Expr.sum(s + d for s, d in zip(starts, durations, strict=True)))
    return m


def brute_machine(durations, releases):
    best = math.inf
    for order in itertools.permutations(range(len(durations))):
        t = total = 0.0
        for j in order:
            t = max(t, releases[j]) + durations[j]
            total += t
        best = min(best, total)
    return best


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 10)), min_size=1, max_size=5),
       st.sampled_from([1, 4, 10]))
def test_scheduling_with_continuous_starts(jobs, divisor):
    durations = [d / divisor for d, _ in jobs]
    releases = [r / divisor for _, r in jobs]
    model = single_machine(durations, releases)
    expected = brute_machine(durations, releases)
    scale, exact = time_scale(durations + releases)
    assert exact
    for engine, (status, obj, values) in solve_all(model, scale).items():
        assert status is Status.OPTIMAL, engine
        assert obj == pytest.approx(expected, rel=1e-6, abs=1e-6), engine
        assert not model.violated(values, tol=1e-5), engine


def test_cpsat_rounding_is_reported():
    model = single_machine([1 / 3, 2 / 3], [0.0, 0.0])
    cm = to_cpsat(model, 1000)
    assert not cm.exact and cm.max_rounding == pytest.approx(1 / 3, abs=1e-6)
    assert to_cpsat(single_machine([0.5, 1.5], [0, 0]), 10).exact


def test_enforced_row_needs_finite_bounds():
    m = Model("unbounded")
    b, t = m.binary("b"), m.continuous("t")
    m.add(t <= 3, "cap", only_if=m.literal(b))
    m.minimize(-1 * t - b)
    with pytest.raises(ValueError, match="finite variable bounds"):
        to_pulp(m)


def test_trivially_infeasible_model_is_infeasible_for_every_engine():
    m = Model("bad")
    x = m.binary("x")
    m.add(Expr.of(0) >= 1, "impossible")
    m.minimize(x)
    assert m.trivially_infeasible
    for engine, (status, _, _) in solve_all(m).items():
        assert status is Status.INFEASIBLE, engine


def test_warm_start_values_cover_auxiliary_variables():
    model = single_machine([2, 3], [0, 0])
    pm = to_pulp(model)
    init = pm.initial([0, 2])
    assert len(init) == len(pm.all_variables)
    assert init[len(model.vars)] == 1.0  # j0 before j1
    res = engines.solve_pulp(pm.problem, pm.all_variables, "highs", threads=1, initial=init)
    assert res.status is Status.OPTIMAL and res.objective == pytest.approx(7.0)


def test_kinds_and_bounds_are_kept():
    m = Model("kinds")
    m.integer("i", -1.5, 2.5)
    m.continuous("c", -1, 1)
    assert [(v.kind, v.lo, v.hi) for v in m.vars] == [
        (Kind.INTEGER, -1, 2), (Kind.CONTINUOUS, -1.0, 1.0)]
    with pytest.raises(ValueError):
        m.literal(Expr([(0, 1.0)]))


def test_scaled_bounds_snap_float_noise_to_the_grid():
    """A bound on the grid stays on it despite float noise (518554019 * 1e-6, scale 1e6).

    ``lo * scale`` is ``518554019.00000006`` in floats: rounding it up with an absolute
    tolerance excluded the grid point itself (an exact warm start became infeasible).
    """
    lo = 518.554019
    assert lo * 10**6 > 518554019  # the float noise this test is about
    m = Model("noise")
    x = m.continuous("x", lo, 1000.0)
    y = m.continuous("y", 0.0, 1000.0)
    m.add(y >= x + 0.0, "after")
    m.add(y <= lo + 0.0, "cap")  # a row bound with the same noise
    m.minimize(y)
    cm = to_cpsat(m, 10**6)
    assert cm.exact
    res = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
    assert res.status is Status.OPTIMAL
    assert cm.values(res.values) == [lo, lo]


def test_redundant_no_overlap_reaches_cpsat_only():
    """A no-overlap set marked redundant adds no order binary to the MILP, but is checked."""
    m = Model("redundant")
    s1, s2 = m.continuous("s1", 0, 10), m.continuous("s2", 0, 10)
    ivs = [m.interval("a", s1, 2), m.interval("b", s2, 3)]
    m.no_overlap("machine", ivs, redundant=True)
    m.minimize(s1 + s2)
    assert to_pulp(m).orders == []
    assert "no_overlap" in str(to_cpsat(m).cp.proto)
    assert m.violated([0, 0]) == ["no_overlap machine: a and b"]


@pytest.mark.parametrize(("values", "resolution", "expected"), [
    ([1.0, 2.0], None, (1, True)),
    ([0.5, 0.25], None, (4, True)),
    ([102760448 / 12e6, 0.724323], None, (3000000, True)),  # size / bandwidth, profiled time
    ([1 / 3], 1e-3, (1002, True)),
    ([math.sqrt(2)], None, (10**6, False)),
])
def test_rational_time_scale(values, resolution, expected):
    scale, exact = rational_time_scale(values, resolution=resolution)
    assert (scale, exact) == expected
    if exact:
        assert all(abs(v * scale - round(v * scale)) < 1e-6 for v in values)
    if resolution is not None:
        assert 1 / scale <= resolution



def _api_writer():
    """``api_to_cpsat`` of ``benchmarks/bench_cpsat_writer.py``: the writer of stops up to
    66, every row through CP-SAT's Python API (the oracle of the proto writer)."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("bench_cpsat_writer",
                                                      bench / "bench_cpsat_writer.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module.api_to_cpsat


@pytest.fixture(scope="module")
def api_writer():
    return _api_writer()


@st.composite
def rows_in_any_order(draw):
    """Rows over mixed kinds with terms out of order, fractional and vanishing coefficients."""
    m = Model("rows")
    kinds = draw(st.lists(st.sampled_from(["b", "i", "c"]), min_size=1, max_size=6))
    xs = [m.binary(f"v{j}") if k == "b" else m.integer(f"v{j}", -5, 5) if k == "i"
          else m.continuous(f"v{j}", -5, 5) for j, k in enumerate(kinds)]
    binaries = [x for x, k in zip(xs, kinds, strict=True) if k == "b"]
    coef = st.sampled_from([1.0, -1.0, 3.0, 0.5, -2.25, 1e-4, 7 / 3])
    side = st.one_of(st.none(), st.sampled_from([0.0, 0.3, -1.5, 2.0, 1 / 3]))
    for r in range(draw(st.integers(1, 5))):
        picked = draw(st.permutations(range(len(xs))))[:draw(st.integers(1, len(xs)))]
        expr = Expr.sum(draw(coef) * xs[j] for j in picked)
        lo, hi = draw(side), draw(side)
        lits = [m.literal(b, draw(st.booleans())) for b in binaries[:draw(st.integers(0, 2))]]
        if lo is not None:
            m.add(expr >= lo, f"lo{r}", only_if=lits)
        if hi is not None:
            m.add(expr <= hi, f"hi{r}", only_if=lits)
        if lo is not None and hi is not None:  # one two-sided row (crossed bounds possible)
            m.constraints.append(Constraint(f"both{r}", expr.merged(), lo, hi, tuple(lits)))
        if draw(st.booleans()):  # a row without variables, violated (kept as such)
            m.add(Expr.of(0) >= 1, f"never{r}", only_if=lits)
    m.minimize(Expr.sum(xs))
    return m, draw(st.sampled_from([1, 10, 1000]))


@SETTINGS
@given(rows_in_any_order())
def test_rows_are_written_as_the_cpsat_api_writes_them(api_writer, case):
    """:func:`to_cpsat` writes the rows' proto directly; CP-SAT's API must write the same.

    Terms out of variable order, coefficients that round to zero on the grid, bounds that
    cross once rounded to it (an empty domain), rows without variables and negated
    enforcement literals included; the oracle is the writer of stops up to 66.
    """
    model, scale = case
    ours, api = to_cpsat(model, scale), api_writer(model, scale)
    assert (ours.exact, ours.max_rounding) == (api.exact, api.max_rounding)
    rows, api_rows = ours.cp.proto.constraints, api.cp.proto.constraints
    assert len(rows) == len(api_rows) == len(model.constraints) + model.trivially_infeasible
    for j in range(len(rows)):
        if str(rows[j]) != str(api_rows[j]):
            # the one divergence: every coefficient rounded to 0 and the bounds crossed.
            # CP-SAT's API then writes an empty constraint (always true); the row is
            # infeasible, and so is ours (a linear row with no term and an empty domain)
            assert str(api_rows[j]) == "" and model.constraints[j].terms
            assert not rows[j].linear.vars and not rows[j].linear.domain
            rows[j].copy_from(api_rows[j])
    assert str(ours.cp.proto) == str(api.cp.proto)


def test_a_row_rounded_to_no_term_with_crossed_bounds_stays_infeasible():
    """``0.5 v`` within ``[0, -1.5]`` on the grid of 1: ``0 v`` within ``[0, -2]``, no plan.

    CP-SAT's Python API writes such a row as an empty, always satisfied constraint (so the
    writer of stops up to 66 reported this model ``optimal``); :func:`to_cpsat` writes it
    as the infeasible row it is.
    """
    m = Model("crossed")
    v = m.binary("v0")
    m.constraints.append(Constraint("crossed", ((0, 0.5),), 0.0, -1.5, ()))
    m.minimize(v)
    assert m.violated([0]) and m.violated([1])
    cm = to_cpsat(m, 1)
    assert not cm.exact
    res = engines.solve_cpsat(cm.cp, cm.variables, threads=1)
    assert res.status is Status.INFEASIBLE


def test_expression_algebra_keeps_operands_and_merges_terms():
    """The operators' fast paths (stop 67) build new term lists and merge as before."""
    m = Model("algebra")
    x, y = m.binary("x"), m.integer("y", 0, 3)
    e = 2 * x + y
    f = e + x - 3
    g = Expr.sum([e, 1, -1 * e, 0.5 * y])
    assert (e.terms, e.const) == ([(0, 2.0), (1, 1.0)], 0.0)  # the operands unchanged
    assert (f.terms, f.const) == ([(0, 2.0), (1, 1.0), (0, 1.0)], -3.0)
    assert f.merged() == ((0, 3.0), (1, 1.0))
    assert g.merged() == ((1, 0.5),) and g.const == 1.0  # cancelled terms dropped
    assert (x * 0.0).merged() == ()  # a zero coefficient with nothing to merge: dropped
    assert isinstance(g.const, float) and all(isinstance(c, float) for _, c in g.terms)
    with pytest.raises(TypeError):
        e + "1"  # noqa: B018
