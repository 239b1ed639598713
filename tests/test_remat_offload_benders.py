"""``cpsat`` with ``strategy=benders`` (:mod:`optmem.solvers.remat_offload_benders`) against
the monolithic model; its stopped bound, warm-up, cuts and options (brute force and the
other cross-checks, and the CLI option: tests/test_remat_offload_exact.py).

Deterministic: CP-SAT runs with a deterministic-time limit (one worker) and a fixed seed,
HiGHS solves the master to optimality; no verdict depends on wall-clock time.
"""

from __future__ import annotations

import math

import pytest
from remat_offload_helpers import BENDERS, OPTS, check, limits

from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError
from optmem.models.remat_offload import build_remat_offload
from optmem.plan import parse_mixed_plan
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import Status
from optmem.solvers import remat_offload_benders as bd
from optmem.solvers.facade import solve
from optmem.solvers.remat_offload import discretized
from optmem.solvers.remat_offload_exact import cpsat_time_scale

pytest.importorskip("ortools", reason="the Benders subproblem uses OR-Tools CP-SAT")

SEEDED = OPTS.with_(seed=1)
# the brute-force, useless-link, free-link and never-worse cross-checks run the Benders
# strategy in tests/test_remat_offload_exact.py (VARIANTS)


@pytest.mark.parametrize("seed", range(4))
def test_benders_equals_the_monolithic_model(seed: int) -> None:
    """3-4-stage chains, three limits: both proven, same optimum (invalid cuts would cut the
    optimum off and report a higher value or a bound above the optimum)."""
    chain = random_chain(3 + seed % 2, seed=20 + seed, max_size=6)
    for limit in limits(chain):
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
        full = solve(problem, "cpsat", options=SEEDED.with_(deterministic_time=60.0))
        res = solve(problem, "cpsat", options=BENDERS)
        check(problem, res, optimum=full.objective)
        assert full.status is Status.OPTIMAL and res.status is Status.OPTIMAL, res.report
        assert res.objective == pytest.approx(full.objective)


@pytest.mark.parametrize("seed", range(3))
def test_stopped_loop_reports_a_valid_bound(seed: int) -> None:
    chain = random_chain(4, seed=30 + seed, max_size=6)
    limit = limits(chain)[0]
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
    full = solve(problem, "cpsat", options=SEEDED.with_(deterministic_time=60.0))
    assert full.status is Status.OPTIMAL
    for iterations in (1, 2, 3):
        for host in (False, True):  # with host: its bounds and cuts (no warm-up)
            res = solve(problem, "cpsat", options=BENDERS.with_(extra={
                **BENDERS.extra, "benders_iterations": iterations,
                **({"benders_host_bound": True, "benders_warmup": 0} if host else {})}))
            check(problem, res, optimum=full.objective)
            assert res.objective >= full.objective - 1e-9
        assert res.report["benders"]["iterations"] <= iterations


def test_deletion_filter_keeps_a_refuted_set() -> None:
    """With the optimum as the incumbent and its own compute sequence proposed, the filter's
    slots, fixed alone, still admit no faster plan; at a horizon that admits the optimum
    they are not refuted (the check can fail); without the single-slot pass it keeps whole
    phases, still refuted."""
    problem, built, scale = _loop_parts()
    disc, beta = discretized(problem, OPTS)
    full = solve(problem, "cpsat", options=SEEDED.with_(deterministic_time=60.0))
    assert full.status is Status.OPTIMAL
    slots = built.slots
    fixed = built.fixing(parse_mixed_plan(full.plan))
    assert fixed is not None
    xhat = {i: round(fixed[i]) for sl in slots for _, i in sl.ops}
    cp = bd._emit(built, full.objective, scale)
    state = bd._State(None, full.objective, disc.memory_limit, beta)
    assert bd._refuted(cp, slots, xhat, SEEDED, 60.0, state)  # nothing beats the optimum
    kept = bd.deletion_filter(cp, slots, xhat, SEEDED, 5.0, state)
    assert len(kept) < len(slots)
    assert bd._refuted(cp, kept, xhat, SEEDED, 60.0, state)
    # a horizon at the optimum itself admits the optimal plan: nothing is refuted there
    cp_at = bd._emit(built, full.objective + 1.0 / scale, scale)
    assert not bd._refuted(cp_at, kept, xhat, SEEDED, 60.0, state)
    # without the single-slot pass (benders_filter=phases): whole phases, still refuted
    whole = bd.deletion_filter(cp, slots, xhat, SEEDED, 5.0, state, single_slots=False)
    phases = {sl.phase for sl in whole}
    assert whole == [sl for sl in slots if sl.phase in phases]
    assert len(phases) < len({sl.phase for sl in slots})
    assert bd._refuted(cp, whole, xhat, SEEDED, 60.0, state)


@pytest.mark.parametrize("seed", range(2))
def test_slot_filter_keeps_the_optimum(seed: int) -> None:
    """``benders_filter=slots`` (the single-slot pass after the phases; the default,
    ``phases``, runs in the tests above): proven, the monolithic optimum; stopped after one
    iteration, a bound at most the optimum."""
    chain = random_chain(4, seed=50 + seed, max_size=6)
    extra = {**BENDERS.extra, "benders_filter": "slots", "benders_warmup": 0}
    for limit in limits(chain)[:2]:
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
        full = solve(problem, "cpsat", options=SEEDED.with_(deterministic_time=60.0))
        assert full.status is Status.OPTIMAL
        res = solve(problem, "cpsat", options=SEEDED.with_(extra=extra))
        check(problem, res)
        assert res.status is Status.OPTIMAL, res.report
        assert res.objective == pytest.approx(full.objective)
        counts = res.report["benders"]
        assert len(counts["cut_slots"]) == counts["refutation_cuts"]
        one = solve(problem, "cpsat", options=SEEDED.with_(
            extra={**extra, "benders_iterations": 1}))
        check(problem, one, optimum=full.objective)


def test_warmup_search_feeds_the_loop() -> None:
    """A warm-up bounded by deterministic time: stopped early, its plan and bound go into
    the loop, which proves; with enough work it proves alone and is returned as is."""
    problem = _problem(41)
    full = solve(problem, "cpsat", options=SEEDED.with_(deterministic_time=60.0))
    assert full.status is Status.OPTIMAL
    short = solve(problem, "cpsat", options=BENDERS.with_(deterministic_time=0.01))
    long = solve(problem, "cpsat", options=BENDERS.with_(deterministic_time=60.0))
    for res in (short, long):
        check(problem, res)
        assert res.status is Status.OPTIMAL, res.report
        assert res.objective == pytest.approx(full.objective)
    assert short.report["warmup"]["status"] == "feasible"
    assert short.report["strategy"] == "benders"
    assert short.report["benders"]["iterations"] >= 1
    assert long.report["warmup"]["status"] == "optimal"
    assert "warm-up" in long.report["strategy"]


def test_options_are_checked() -> None:
    problem = RematOffloadProblem(random_chain(3, seed=1, max_size=6), 40,
                                  chain_bandwidth=1.0)
    for extra, field in (({"strategy": "lbbd"}, "strategy"),
                         ({"strategy": "benders", "benders_work": 0}, "benders_work"),
                         ({"strategy": "benders", "benders_filter_work": "x"},
                          "benders_filter_work"),
                         ({"strategy": "benders", "benders_iterations": 0},
                          "benders_iterations"),
                         ({"strategy": "benders", "benders_warmup": 1.5}, "benders_warmup"),
                         ({"strategy": "benders", "benders_filter": "x"}, "benders_filter"),
                         ({"strategy": "benders", "benders_warmup": 0,
                           "relaxation_deadlines": "no"}, "relaxation_deadlines"),
                         ({"strategy": "benders", "benders_warmup": 0,
                           "relaxation_values": "no"}, "relaxation_values"),
                         ({"strategy": "benders", "benders_host_bound": "no"},
                          "benders_host_bound")):
        with pytest.raises(OptmemInputError, match=field):
            solve(problem, "cpsat", options=SEEDED.with_(extra=extra))


def test_warmup_shares_the_candidates_and_the_relaxation(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """With a warm-up, the candidate plans are computed once, the model is built once and
    the warm-up's link relaxation (with the deadline rows) is the loop's first master: the
    loop solves no master before its first subproblem."""
    from optmem.models import remat_offload as model
    from optmem.solvers import remat_offload_exact as exact

    problem = _problem(41)
    calls = {"candidates": 0, "builds": 0, "relaxations": 0}

    def counted(name: str, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(exact, "_candidates", counted("candidates", exact._candidates))
    monkeypatch.setattr(exact, "build_remat_offload",
                        counted("builds", model.build_remat_offload))
    monkeypatch.setattr(exact, "build_link_relaxation",
                        counted("relaxations", model.build_link_relaxation))
    monkeypatch.setattr(bd, "build_link_relaxation",
                        counted("relaxations", model.build_link_relaxation))
    res = solve(problem, "cpsat", options=BENDERS.with_(deterministic_time=0.01))
    check(problem, res)
    assert res.report["warmup"]["status"] == "feasible"
    assert res.report["benders"]["iterations"] >= 1
    # the plain relaxation, the one with the deadline rows and the one with the host rows
    # too (the lazy host stage's source of rows), the same with the cumulative read rows
    # (the source of the second phase, on by default under benders), and one per lazy round,
    # all by the warm-up (the loop builds its own host-rows model only with
    # benders_host_bound)
    rounds = res.report["relaxation"]["host_rounds"]
    assert rounds >= 1
    assert calls == {"candidates": 1, "builds": 1, "relaxations": 4 + rounds}
    assert res.report["relaxation"]["bound"] <= res.bound + 1e-9


def _problem(seed: int) -> RematOffloadProblem:
    """The loop tests' instance: a 4-stage chain at its least limit, bandwidth 1."""
    chain = random_chain(4, seed=seed, max_size=6)
    return RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)


def _loop_parts(seed: int = 31):
    """The instance of seed ``seed``, its built model and its exact CP-SAT time grid."""
    problem = _problem(seed)
    disc, beta = discretized(problem, OPTS)
    scale, exact = cpsat_time_scale(disc.chain, beta)
    assert exact
    return problem, build_remat_offload(disc.chain, disc.memory_limit, beta), scale


def test_no_useless_value_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subproblem that proves nothing above the master's value adds no cut (it would not
    remove the proposal); the next proposal of the same sequence gets twice the work."""
    problem, built, scale = _loop_parts()
    works: list[float] = []

    def stopped(*args, **kwargs):
        works.append(kwargs["deterministic_time"])
        return bd.EngineResult(Status.NO_SOLUTION, None, math.nan, math.nan, "cpsat", 0.0,
                               "UNKNOWN", info={"deterministic_time": 0.0, "branches": 0})

    monkeypatch.setattr(bd.engines, "solve_cpsat", stopped)
    report: dict = {}
    res = bd.solve_benders(problem, SEEDED.with_(extra={"benders_iterations": 3}),
                           built=built, scale=scale, incumbent=None, report=report)
    assert res.status is Status.NO_SOLUTION
    counts = report["benders"]
    assert counts["iterations"] == 3
    assert counts["value_cuts"] == 0 and counts["refutation_cuts"] == 0
    assert works == [bd.DEFAULT_SUB_WORK * 2 ** k for k in range(3)]
    assert res.bound == pytest.approx(max(report["relaxation"]["bound"],
                                          problem.chain.total_compute_time()))


def test_host_bound_cuts_a_proposal_without_cpsat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proposal whose host-rows bound reaches the incumbent gets a refutation cut from
    that bound (its filter checks are host-rows bounds too) and CP-SAT is not called for
    it; with ``benders_host_bound`` off, CP-SAT is. Injected bound: far above every plan."""
    problem, built, scale = _loop_parts()
    calls: list[int] = []
    real = bd.engines.solve_cpsat

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bd.engines, "solve_cpsat", counted)
    monkeypatch.setattr(bd, "host_bound", lambda host, xhat, options, limit: (
        1e6 if host is not None else -math.inf))
    for on in (True, False):
        calls.clear()
        report: dict = {}
        res = bd.solve_benders(problem, SEEDED.with_(extra={"benders_iterations": 1,
                                                            "benders_host_bound": on}),
                               built=built, scale=scale, incumbent=None, report=report)
        check(problem, res)
        counts = report["benders"]
        assert counts["iterations"] == 1
        assert (calls == []) is on
        assert counts["host_bounds"] == ([1e6] if on else [None])
        assert counts["host_cuts"] == int(on)
        if on:  # every phase dropped: the injected bound holds with nothing fixed
            assert counts["cut_slots"] == [0]


def test_proven_no_plan_is_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop whose cuts leave no compute sequence (or lift the bound to the default
    horizon, above every plan of the class) without a plan has proven that none exists:
    ``infeasible`` (was ``no_solution``). Injected: a subproblem that refutes every
    proposal at the horizon, then a master with no solution."""
    problem, built, scale = _loop_parts()
    real = bd.engines.solve_pulp
    masters: list[int] = []

    def refute(loop, xhat, work, value):
        loop.cut(loop.slots, xhat, loop.state.makespan, "injected")
        return loop.state.makespan

    def master(*args, **kwargs):
        masters.append(1)
        if len(masters) == 1:
            return real(*args, **kwargs)
        return bd.EngineResult(Status.INFEASIBLE, None, math.nan, math.nan, "highs", 0.0,
                               "kInfeasible")

    monkeypatch.setattr(bd, "_subproblem", refute)
    monkeypatch.setattr(bd.engines, "solve_pulp", master)
    res = bd.solve_benders(problem, SEEDED, built=built, scale=scale, incumbent=None,
                           report={})
    assert res.status is Status.INFEASIBLE and res.bound == math.inf
    assert "no compute sequence" in res.report["note"]
    # the same loop stopped by its iteration cap has proven nothing: no_solution
    monkeypatch.setattr(bd.engines, "solve_pulp", real)
    res = bd.solve_benders(problem, SEEDED.with_(extra={"benders_iterations": 1}),
                           built=built, scale=scale, incumbent=None, report={})
    assert res.status is Status.NO_SOLUTION and res.bound < math.inf


LOOP_BAD = [{"benders_first_found": "x"}, {"benders_host_bound": "x"}, {"benders_warmup": 7},
            {"benders_warmup": True}, {"benders_work": -1}, {"benders_filter_work": "x"},
            {"benders_iterations": "x"}, {"benders_filter": "x"}, {"relaxation_first": "x"},
            {"benders_compute_cut": "x"}, {"benders_compute_work": 0}]


@pytest.mark.parametrize("strategy", ["full", "benders"])
@pytest.mark.parametrize("extra", LOOP_BAD)
def test_bad_loop_options_refused_before_any_work(extra: dict, strategy: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value of a ``strategy=benders`` option is one input error before the model is
    built, also under ``strategy=full``, which does not read it (they were accepted in
    silence there, CLI exit 0)."""
    from optmem.solvers import remat_offload_exact as exact

    def no_work(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(exact, "build_remat_offload", no_work)
    chain = random_chain(3, seed=1, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match=next(iter(extra))):
        solve(problem, "cpsat", options=OPTS.with_(extra={**extra, "strategy": strategy}))
