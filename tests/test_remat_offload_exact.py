"""The exact remat + offload model (``ilp``, ``cpsat``) against brute force, the pure optima
and the DP; HiGHS and CP-SAT emitters of the one model against each other."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import BENDERS, OPTS, check, idle_op_chains, limits

from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.engines import adapters as engines
from optmem.engines.adapters import EngineResult
from optmem.models.formulation import to_cpsat
from optmem.models.remat_offload import build_remat_offload
from optmem.problems.checkpoint import CheckpointProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.offload import simulate_offload
from optmem.solvers.facade import solve

pytest.importorskip("ortools", reason="the exact remat-offload model uses OR-Tools CP-SAT")

EXAMPLE = Chain.from_lists([2, 2, 2], [4, 4, 4], [2, 2, 2], [4, 4, 4], input_size=2)
METHODS = ("cpsat", "ilp")
# the Benders strategy of cpsat (tests/test_remat_offload_benders.py) goes through the same
# cross-checks: (method, options) pairs
VARIANTS = (("cpsat", OPTS), ("ilp", OPTS), ("cpsat", BENDERS))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("limit", "beta", "expected"), [
    (10, 0.5, 32), (10, 1.0, 26), (10, 2.0, 24), (12, 1.0, 22), (12, 2.0, 21), (14, 1.0, 20),
])
def test_example_exact(method: str, limit: int, beta: float, expected: float) -> None:
    problem = RematOffloadProblem(EXAMPLE, limit, chain_bandwidth=beta)
    exact = solve(problem, method, options=OPTS)
    assert exact.status is Status.OPTIMAL, exact.report
    assert exact.objective == pytest.approx(expected)
    check(problem, exact)
    dp = solve(problem, "dp", options=OPTS)
    assert exact.objective <= dp.objective + 1e-9


@pytest.mark.parametrize("method", METHODS)
def test_example_exact_infeasible(method: str) -> None:
    assert solve(RematOffloadProblem(EXAMPLE, 8, chain_bandwidth=1.0), method,
                 options=OPTS).status is Status.INFEASIBLE


@st.composite
def tiny(draw: st.DrawFn, max_length: int = 2) -> Chain:
    n = draw(st.integers(1, max_length))
    out = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    extra = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return Chain.from_lists(
        draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)),
        draw(st.lists(st.integers(1, 6), min_size=n, max_size=n)),
        out, [o + e for o, e in zip(out, extra, strict=True)],
        input_size=draw(st.integers(1, 4)),
        fwd_overhead=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        loss_bwd_time=draw(st.integers(0, 2)))


@pytest.mark.parametrize("opts", [OPTS, BENDERS], ids=["full", "benders"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_exact_equals_brute_and_bounds(chain: Chain, limit: int, beta: float,
                                       opts: SolveOptions) -> None:
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    exact = solve(problem, "cpsat", options=opts)
    brute = solve(problem, "brute", options=OPTS)
    assert brute.status is not Status.ERROR
    check(problem, exact, optimum=brute.objective if brute.status.has_plan else None)
    assert exact.status.has_plan == brute.status.has_plan
    if not exact.status.has_plan:
        assert exact.status is Status.INFEASIBLE  # proven: no limit stops these solves
        for name in ("dp", "remat_only", "offload_only", "autocapper"):
            assert not solve(problem, name, options=OPTS).status.has_plan, name
        return
    assert exact.status is Status.OPTIMAL
    assert exact.objective == pytest.approx(brute.objective)
    # exact <= every heuristic plan (they live in the same simulator's plan space)
    for name in ("dp", "remat_only", "offload_only", "opportunist", "autocapper"):
        res = solve(problem, name, options=OPTS)
        if res.status.has_plan:
            assert exact.objective <= res.objective + 1e-9, name
    # like with like: exact pure optima (full checkpoint model, exact OFF_int)
    ckpt = solve(CheckpointProblem(chain, limit), "brute", options=OPTS)
    if ckpt.status.has_plan:
        assert exact.objective <= ckpt.objective + 1e-9
    off = solve(OffloadProblem(chain, limit, chain_bandwidth=beta), "brute", options=OPTS)
    if off.status.has_plan:
        assert exact.objective <= off.objective + 1e-9


def tiny_with_idle_ops() -> st.SearchStrategy[Chain]:
    """Like :func:`tiny`, but forwards and backwards may take no time."""
    return idle_op_chains(2, 3, 4)


@pytest.mark.parametrize("opts", [OPTS, BENDERS], ids=["full", "benders"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny_with_idle_ops(), limit=st.integers(3, 24),
       beta=st.sampled_from([0.3, 1.0]))
def test_zero_duration_ops_equal_brute(chain: Chain, limit: int, beta: float,
                                       opts: SolveOptions) -> None:
    """Ops that take no time: an item that counts a value on the host may not be followed
    by a reader of it before its prefetch (the simulator releases the value only after
    every reader listed after the offload), even when the release rows allow it."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    exact = solve(problem, "cpsat", options=opts)
    brute = solve(problem, "brute", options=OPTS)
    assert brute.status is not Status.ERROR
    check(problem, exact, optimum=brute.objective if brute.status.has_plan else None)
    assert exact.status is (Status.OPTIMAL if brute.status.has_plan else Status.INFEASIBLE)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_brute_enumerates_the_recomputed_loss_stage(beta: float) -> None:
    """Regression: ``brute`` enumerated compute sequences with at most ``L(L+1)/2``
    forwards, which leaves out ``F_ck 1, Loss, F_all 1, B 1`` (the last stage run again
    for its backward). At 5 (the loss' overhead makes ``F_all 1, Loss`` need 6) it answered
    ``infeasible`` where ``remat_only``, ``dp`` and ``cpsat`` run that plan in 3."""
    chain = Chain.from_lists([1], [1], [1], [2], input_size=1, loss_bwd_overhead=2)
    problem = RematOffloadProblem(chain, 5, chain_bandwidth=beta)
    brute = solve(problem, "brute", options=OPTS)
    assert brute.status is Status.OPTIMAL
    assert brute.objective == pytest.approx(3.0)
    if beta == 0:  # with a link, offloading a^0 during the loss is as fast
        assert brute.plan == ("F_ck 1", "Loss", "F_all 1", "B 1")
    for method in ("remat_only", "cpsat"):
        assert solve(problem, method, options=OPTS).objective == pytest.approx(3.0), method


@pytest.mark.parametrize(("seed", "integer_times"), [(79, True), (23, False), (27, False)])
def test_brute_never_worse_than_the_checkpoint_dp(seed: int, integer_times: bool) -> None:
    """``brute``'s class holds every persistent sequence: at the persistent checkpoint DP's
    least memory, where its plan recomputes the last stage (``random_chain(2, seed=79)``:
    ``F_ck 1, F_none 2, Loss, F_ck 1, F_all 2, B 2, F_all 1, B 1``, five forwards), it
    equals ``remat_only`` with bandwidth 0 (it answered ``infeasible`` at 15, 17, 16)."""
    chain = random_chain(2, seed=seed, max_size=6, integer_times=integer_times)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=0.0)
    remat = solve(problem, "remat_only", options=OPTS)
    brute = solve(problem, "brute", options=OPTS)
    assert remat.status.has_plan and brute.status is Status.OPTIMAL, remat.plan
    assert brute.objective == pytest.approx(remat.objective)


@pytest.mark.parametrize("method", METHODS)
def test_reader_after_a_host_item_keeps_the_value(method: str) -> None:
    """Regression (``random_chain(4, seed=7)``: ``F_all 1`` and ``B 2`` take no time): the
    model let ``B 2`` count ``a^0`` on the host while ``F_all 1``, a reader listed after it,
    had not run; the decoded plan needed 31 > 29 and the solve ended in ``error``."""
    chain = random_chain(4, seed=7, max_size=6)
    problem = RematOffloadProblem(chain, 29, chain_bandwidth=0.3)
    opts = SolveOptions(slots=64, seed=1, deterministic_time=30.0, node_limit=20_000,
                        extra={"relaxation": False})
    res = solve(problem, method, options=opts)
    check(problem, res, opts)
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(128 / 3)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(chain=tiny(max_length=3), limit=st.integers(4, 24),
       beta=st.sampled_from([0.25, 1.0, 2.0, 5.0]))
def test_highs_and_cpsat_emitters_agree(chain: Chain, limit: int, beta: float) -> None:
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    ilp = solve(problem, "ilp", options=OPTS)
    cpsat = solve(problem, "cpsat", options=OPTS)
    check(problem, ilp)
    check(problem, cpsat)
    assert ilp.status is cpsat.status
    if ilp.status.has_plan:
        assert ilp.objective == pytest.approx(cpsat.objective, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.0, 1e-4])
def test_useless_link_equals_checkpoint_optimum(seed: int, beta: float) -> None:
    chain = random_chain(3 + seed % 2, seed=seed, max_size=6)
    for limit in limits(chain):
        ckpt = solve(CheckpointProblem(chain, limit), "ilp", options=OPTS)
        assert ckpt.status is Status.OPTIMAL
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        for method, opts in VARIANTS:
            res = solve(problem, method, options=opts)
            check(problem, res)
            assert res.status is Status.OPTIMAL, (method, opts.extra, limit)
            assert res.objective == pytest.approx(ckpt.objective), (method, opts.extra, limit)


def _working_set(chain: Chain) -> int:
    """The largest memory any op of the store-all sequence needs beside the values it
    does not read, plus room for one value being prefetched."""
    a = [chain.input_size, *chain.output_size]
    ab = [chain.input_size, *chain.saved_size]
    need = []
    for i in range(1, chain.length + 1):
        need.append(ab[i - 1] + ab[i] + chain.fwd_overhead[i - 1])
        need.append(ab[i - 1] + ab[i] + a[i] + a[i - 1] + chain.bwd_overhead[i - 1])
    need.append(ab[chain.length] + a[chain.length] + chain.loss_bwd_overhead)
    return max(need) + max(ab)


@pytest.mark.parametrize("seed", range(3))
def test_free_link_reaches_the_compute_time(seed: int) -> None:
    chain = random_chain(3, seed=seed, max_size=6)
    limit = _working_set(chain)
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=1e5)
    for method, opts in VARIANTS:
        res = solve(problem, method, options=opts)
        check(problem, res)
        assert res.status is Status.OPTIMAL
        # every transfer takes at most 1e-4: only they may delay the compute stream
        assert chain.total_compute_time() <= res.objective <= chain.total_compute_time() + 1e-3


@pytest.mark.parametrize("opts", [OPTS, BENDERS], ids=["full", "benders"])
@pytest.mark.parametrize("seed", range(3))
def test_never_worse_than_dp_and_pure_methods(seed: int, opts: SolveOptions) -> None:
    chain = random_chain(4, seed=10 + seed, max_size=6)
    for limit in limits(chain)[:2]:
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
        exact = solve(problem, "cpsat", options=opts)
        check(problem, exact)
        assert exact.status is Status.OPTIMAL
        for name in ("dp", "remat_only", "offload_only"):
            other = solve(problem, name, options=OPTS)
            if other.status.has_plan:
                assert exact.objective <= other.objective + 1e-9, name
        ckpt = solve(CheckpointProblem(chain, limit), "ilp", options=OPTS)
        assert exact.objective <= ckpt.objective + 1e-9


def test_model_decodes_what_it_claims() -> None:
    """Any solution of the model (not only optimal ones) replays no slower than claimed."""
    chain = random_chain(3, seed=7, max_size=6)
    limit = limits(chain)[0]
    built = build_remat_offload(chain, limit, 1.0)
    cp = to_cpsat(built.model)
    out = engines.solve_cpsat(cp.cp, cp.variables)
    assert out.status is Status.OPTIMAL
    values = cp.values(out.values)
    assert not built.model.violated(values)
    sim = simulate_offload(chain, built.decode(values), 1.0, limit)
    assert sim.makespan <= values[built.objective_var] + 1e-9
    assert sim.peak_memory <= limit


def test_stopped_engine_returns_the_warm_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def stopped(*args: object, **kwargs: object) -> EngineResult:
        return EngineResult(Status.NO_SOLUTION, None, math.nan, 5.0, "cpsat", 0.0, "stopped")

    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    real = engines.solve_cpsat
    calls = []

    def first_real(*args: object, **kwargs: object) -> EngineResult:
        calls.append(1)
        return real(*args, **kwargs) if len(calls) == 1 else stopped()  # type: ignore[arg-type]

    monkeypatch.setattr(engines, "solve_cpsat", first_real)
    # without the link relaxation, whose deadline rows prove this instance with no search
    res = solve(problem, "cpsat", options=OPTS.with_(extra={"relaxation": False}))
    assert res.status is Status.FEASIBLE
    assert res.report["incumbent"] == "the fastest candidate plan"
    dp = solve(problem, "dp", options=OPTS)
    assert res.objective <= dp.objective + 1e-9
    assert res.bound <= res.objective
    assert res.bound >= EXAMPLE.total_compute_time()


# stop 50's hunt: CBC, given the DP's optimal plan as a start, called the model with every
# time at most the start's value infeasible (its completion broke a row by 3.3e-8)
CBC_START_CHAIN = Chain.from_lists([1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [2, 4, 1], [3, 5, 1],
                                   input_size=1)


def test_cbc_with_an_optimal_warm_start_proves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The horizon lies :data:`HORIZON_SLACK` above the start's value: CBC proves the start.

    Without the slack CBC's preprocessing says infeasible, and the solve returns the
    start as ``feasible`` with the contradiction reported as an engine fault, never
    ``infeasible``."""
    from optmem.solvers import remat_offload_exact as exact

    problem = RematOffloadProblem(CBC_START_CHAIN, 13, chain_bandwidth=3.0)
    opts = OPTS.with_(solver="cbc", extra={"relaxation": False})
    res = solve(problem, "ilp", options=opts)
    check(problem, res)
    assert res.status is Status.OPTIMAL
    assert res.objective == pytest.approx(7 / 3)
    assert "engine_error" not in res.report
    monkeypatch.setattr(exact, "HORIZON_SLACK", 0.0)
    bare = solve(problem, "ilp", options=opts)
    check(problem, bare)
    assert bare.status is Status.FEASIBLE  # CBC's verdict at the bare horizon is not taken
    assert "but the warm-start plan replays" in bare.report["engine_error"]
    assert bare.report["incumbent"] == "the fastest candidate plan"
    assert bare.objective == pytest.approx(7 / 3)


def test_an_infeasible_verdict_below_a_start_is_not_taken(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """An engine that calls the model infeasible although the warm start fits it is wrong
    (an engine fault): the solve returns the start (``feasible``), not ``infeasible``."""
    from optmem.solvers import remat_offload_exact as exact

    def wrong(*args: object, **kwargs: object) -> EngineResult:
        return EngineResult(Status.INFEASIBLE, None, math.inf, math.inf, "cpsat", 0.0,
                            "infeasible")

    problem = RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0)
    real = exact._engine_solve

    def wrong_search(model: Any, engine: str, options: SolveOptions, **kw: Any) -> Any:
        if kw.get("initial") is None:  # the warm start's completion stays real
            return real(model, engine, options, **kw)
        return wrong(), None, math.inf

    monkeypatch.setattr(exact, "_engine_solve", wrong_search)
    res = solve(problem, "cpsat", options=OPTS.with_(extra={"relaxation": False}))
    check(problem, res)
    assert res.status is Status.FEASIBLE
    assert "but the warm-start plan replays" in res.report["engine_error"]
    assert res.bound <= res.objective
    assert res.objective <= solve(problem, "dp", options=OPTS).objective + 1e-9


def test_options_are_checked() -> None:
    from optmem.errors import OptmemInputError

    with pytest.raises(OptmemInputError):
        solve(RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0), "cpsat",
              options=OPTS.with_(extra={"transfers_per_gap": 0}))
    with pytest.raises(OptmemInputError, match="relaxation_deadlines"):
        solve(RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0), "cpsat",
              options=OPTS.with_(extra={"relaxation_deadlines": "yes"}))
    for key, value in (("relaxation_read_deadlines", "yes"), ("relaxation_sequence", 2),
                       ("relaxation_share", 0.0), ("relaxation_share", 1.5)):
        with pytest.raises(OptmemInputError, match=key):
            solve(RematOffloadProblem(EXAMPLE, 12, chain_bandwidth=1.0), "cpsat",
                  options=OPTS.with_(extra={key: value}))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", [41, 2])
def test_relaxation_sequence_is_a_candidate(method: str, seed: int) -> None:
    """``relaxation_sequence`` (default on under ``strategy=benders`` only): the relaxation's
    compute sequence, completed by the engine, is a replayed candidate plan no faster than
    the relaxation's bound; off, no such candidate; the optimum is the same either way
    (deterministic limits)."""
    chain = random_chain(4, seed=seed, max_size=6)
    opts = SolveOptions(slots=64, threads=1, seed=1, deterministic_time=30.0, node_limit=200)
    for limit in limits(chain)[:1]:
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
        on = solve(problem, method, options=opts.with_(extra={"relaxation_sequence": True}))
        off = solve(problem, method, options=opts)  # the default of strategy=full
        check(problem, on, opts)
        check(problem, off, opts)
        assert "relaxation_sequence" not in off.report
        seq = on.report.get("relaxation_sequence")
        if seq is not None:
            assert seq["makespan"] >= on.report["relaxation"]["bound"] - 1e-6
            assert seq["makespan"] >= on.objective - 1e-9
        if on.status is Status.OPTIMAL and off.status is Status.OPTIMAL:
            assert on.objective == pytest.approx(off.objective)


def test_cli_solve_and_export(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    import json

    from optmem.cli import main

    path = tmp_path / "example.json"
    EXAMPLE.save(path)
    # the relaxation off: its deadline rows prove this instance without the model's search
    code = main(["solve", "remat-offload", str(path), "--memory", "12", "--bandwidth", "1B/ms",
                 "--method", "ilp", "--json", "--option", "relaxation=false"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["status"] == "optimal" and data["objective"] == 22.0 and data["bound"] == 22.0
    assert data["report"]["model_objective"] == pytest.approx(22.0)
    # the Benders strategy of cpsat is reachable as an option
    assert main(["solve", "remat-offload", str(path), "--memory", "12", "--bandwidth", "1B/ms",
                 "--method", "cpsat", "--json", "--option", "strategy=benders"]) == 0
    data = json.loads(capsys.readouterr()[0])
    assert data["status"] == "optimal" and data["objective"] == 22.0
    assert data["report"]["strategy"] == "benders"
    model = tmp_path / "m.lp"
    assert main(["export", "remat-offload", str(path), "--memory", "12", "--bandwidth", "1B/ms",
                 "--method", "ilp", "-o", str(model)]) == 0
    assert model.read_text().startswith("\\*")


def _normalised(plan: list[str]) -> list[str]:
    """Transfers listed before the first op moved just after it (they start at 0 either way)."""
    first = next(k for k, op in enumerate(plan) if not op.startswith(("offload", "prefetch")))
    return [plan[first], *plan[:first], *plan[first + 1:]]


def _fixed_plans_checked(chain: Chain, beta: float, transfers_per_gap: int) -> int:
    """Fix the DP, checkpoint-only and offload-only plans in the model (every limit of
    :func:`_limits`): the model never claims less than the simulator, and exactly the
    simulated makespan when it keeps the plan's transfer positions. Returns how many plans
    were checked exactly."""
    from optmem.models.formulation import to_pulp
    from optmem.models.remat_offload import with_fixed
    from optmem.plan import parse_mixed_plan

    checked = 0
    for limit in limits(chain):
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        built = build_remat_offload(chain, limit, beta, transfers_per_gap=transfers_per_gap)
        for name in ("dp", "remat_only", "offload_only"):
            res = solve(problem, name, options=OPTS)
            if not res.status.has_plan:
                continue
            fixed = built.fixing(parse_mixed_plan(res.plan))
            assert fixed is not None, name
            pm = to_pulp(with_fixed(built, fixed))
            out = engines.solve_pulp(pm.problem, pm.all_variables, "highs")
            assert out.status is Status.OPTIMAL, name
            values = out.values[:len(built.model.vars)]
            decoded = [str(op) for op in built.decode(values)]
            model = values[built.objective_var]
            # HiGHS's feasibility tolerance (1e-6 per row) can add up along the chained
            # time rows: 86.999999 against 87 after other solves in the same process
            assert model >= res.objective - 1e-5, name
            if decoded == _normalised(list(res.plan)):
                assert model == pytest.approx(res.objective, abs=1e-6), name
                checked += 1
    return checked


@pytest.mark.parametrize("seed", range(4))
def test_model_value_of_a_fixed_plan_is_the_simulated_one(seed: int) -> None:
    """Direction 1 of exactness: a plan of the class, fixed in the model, gets exactly the
    simulator's makespan (the DP, checkpoint-only and offload-only plans of random chains)."""
    chain = random_chain(5, seed=20 + seed, max_size=8)
    assert _fixed_plans_checked(chain, 1.5, 2) >= 4


@settings(max_examples=6, deadline=None, derandomize=True)
@given(length=st.integers(3, 5), seed=st.integers(0, 10_000),
       beta=st.sampled_from([0.3, 1.0, 1.5, 4.0]), per_gap=st.integers(1, 2))
def test_link_cuts_keep_every_simulated_plan(length: int, seed: int, beta: float,
                                             per_gap: int) -> None:
    """The link cuts (``cut_*`` rows: host values offloaded before the op and prefetched
    after it, the total link time) are valid: every plan of the class keeps its simulated
    makespan in the model (a cut that removed a schedule would raise it)."""
    chain = random_chain(length, seed=seed, max_size=8)
    built = build_remat_offload(chain, limits(chain)[0], beta, transfers_per_gap=per_gap)
    assert any(c.name.startswith("cut_") for c in built.model.constraints)
    assert _fixed_plans_checked(chain, beta, per_gap) >= 1


def test_link_cuts_lift_the_relaxation() -> None:
    """The LP relaxation with the cuts is above the sum of compute times (the bound of the
    model without them) and below the DP's plan, at a limit where the DP offloads."""
    import pulp

    from optmem.models.formulation import to_pulp

    chain = random_chain(6, seed=3, max_size=8)
    limit = limits(chain)[0]
    beta = 0.5
    built = build_remat_offload(chain, limit, beta)
    pm = to_pulp(built.model)
    for var in pm.all_variables:
        var.cat = pulp.LpContinuous
    # through the adapter: it keeps HiGHS's one thread pool per process consistent
    relaxed = engines.solve_pulp(pm.problem, pm.all_variables, "highs").objective
    dp = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "dp", options=OPTS)
    assert chain.total_compute_time() + 1e-6 < relaxed <= dp.objective + 1e-6


def _relaxation(chain: Chain, limit: int, beta: float, fixed: dict[int, float] | None = None,
                *, highs_options: dict[str, Any] | None = None, **rows: Any) -> float:
    """The optimum of the link relaxation (HiGHS, proven); ``rows``: its row options,
    ``fixed``: variables fixed (the compute binaries of a sequence), ``highs_options``:
    HiGHS's options (``engines.solve_pulp``)."""
    from optmem.models.formulation import Expr, Relation, to_pulp
    from optmem.models.remat_offload import build_link_relaxation

    model = build_link_relaxation(chain, limit, beta, **rows)
    for i, x in (fixed or {}).items():
        model.add(Relation(Expr([(i, 1.0)]), x, x), f"fix_{i}")
    pm = to_pulp(model)
    out = engines.solve_pulp(pm.problem, pm.all_variables, "highs",
                             highs_options=highs_options)
    if out.status is Status.INFEASIBLE:
        return math.inf
    assert out.status is Status.OPTIMAL, out
    return out.objective


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_link_relaxation_never_exceeds_the_brute_optimum(chain: Chain, limit: int,
                                                         beta: float) -> None:
    """The link relaxation's optimum is a lower bound: at most brute force's optimum (and
    at least the compute sum where a plan exists)."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    bound = _relaxation(chain, limit, beta)
    if brute.status.has_plan:
        assert chain.total_compute_time() - 1e-6 <= bound <= brute.objective + 1e-6


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_host_value_rows_only_lift_the_relaxation(chain: Chain, limit: int,
                                                  beta: float) -> None:
    """The per-value host rows (``host_values``, the default) never lower the relaxation
    (with the aggregated deadline rows) and never lift it above brute force's optimum, also
    with ops that take no time."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    aggregated = _relaxation(chain, limit, beta, host_values=False)
    lifted = _relaxation(chain, limit, beta)
    assert lifted >= aggregated - 1e-6
    if brute.status.has_plan:
        assert lifted <= brute.objective + 1e-6
    else:
        assert brute.status is Status.INFEASIBLE


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]), items=st.sets(st.integers(0, 40), max_size=12))
def test_host_rows_on_some_items_stay_a_relaxation(chain: Chain, limit: int, beta: float,
                                                   items: set[int]) -> None:
    """The per-value host rows on a subset of the items only (``host_items``, the rows a
    lazy master would add) never lower the aggregated relaxation and never lift it above
    brute force's optimum, nor above the relaxation with the host rows everywhere."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    aggregated = _relaxation(chain, limit, beta, host_values=False)
    partial = _relaxation(chain, limit, beta, host_items=items)
    assert aggregated - 1e-6 <= partial <= _relaxation(chain, limit, beta) + 1e-6
    if brute.status.has_plan:
        assert partial <= brute.objective + 1e-6
    else:
        assert brute.status is Status.INFEASIBLE


def test_host_value_rows_lift_a_compute_sequence_toward_its_value() -> None:
    """Where the bound was weak (``random_chain(10, seed=1)`` at its 10 % limit, the
    benchmark's bandwidth): the aggregated relaxation's own compute sequence is worth more
    in the model (proven by CP-SAT with the sequence fixed) than the aggregated relaxation
    says; with the host rows the relaxation of that sequence is strictly higher and still
    at most the model's value."""
    from optmem.models.formulation import to_pulp
    from optmem.models.remat_offload import build_link_relaxation, with_fixed

    disc, beta = _discretized_instance(random_chain(10, seed=1), 59)
    pm = to_pulp(build_link_relaxation(disc.chain, disc.memory_limit, beta,
                                       host_values=False))
    out = engines.solve_pulp(pm.problem, pm.all_variables, "highs")
    assert out.status is Status.OPTIMAL and out.values is not None
    built = build_remat_offload(disc.chain, disc.memory_limit, beta)
    xhat = {i: float(round(out.values[i])) for i in built.plan_vars
            if i < len(built.checkpoint.names)}
    aggregated = _relaxation(disc.chain, disc.memory_limit, beta, xhat, host_values=False)
    lifted = _relaxation(disc.chain, disc.memory_limit, beta, xhat)
    cp = to_cpsat(with_fixed(built, xhat, 2 * out.objective), scale=1)
    value = engines.solve_cpsat(cp.cp, cp.variables, threads=1, seed=1,
                                deterministic_time=60.0)
    assert value.status is Status.OPTIMAL
    assert aggregated == pytest.approx(out.objective)
    assert aggregated + 1 <= lifted <= cp.objective(value.objective) + 1e-6


def _sequence_plans(chain: Chain, limit: int, beta: float, built: Any) -> Any:
    """Every compute sequence of brute force's enumeration inside the model's class:
    ``(ops, fixing, found)``, ``fixing`` the model's values for it and ``found`` its best
    plan ``(makespan, ops)`` (its compute time where it fits without transfers, else brute
    force's best transfers; ``None``: no plan of that sequence fits)."""
    from optmem.solvers.remat_offload_exact import _brute_transfers, compute_sequences

    for compute, peak, ops in compute_sequences(chain):
        fixing = built.fixing(ops)
        if fixing is None:
            continue  # outside the model's class (sweeps)
        yield ops, fixing, ((compute, ops) if peak <= limit else
                            _brute_transfers(chain, limit, beta, ops))


def _fixed_sequences(chain: Chain, limit: int, beta: float) -> Any:
    """``(ops, xhat, best)`` for every compute sequence of :func:`_sequence_plans` with a
    plan: ``xhat`` the model's compute binaries for it (what :func:`_relaxation` fixes),
    ``best`` its best plan's makespan."""
    built = build_remat_offload(chain, limit, beta)
    n_ck = len(built.checkpoint.names)
    for ops, fixing, found in _sequence_plans(chain, limit, beta, built):
        if found is not None:
            yield ops, {i: x for i, x in fixing.items() if i < n_ck}, found[0]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_host_bound_of_a_sequence_never_exceeds_its_brute_value(chain: Chain, limit: int,
                                                                beta: float) -> None:
    """The Benders loop's host-rows bound of a proposal (``benders_host_bound``) is a lower
    bound on every plan of that compute sequence: for every compute sequence of the brute
    force's enumeration with a plan (its compute time where it fits without transfers,
    else brute force's best transfers), the bound with the sequence fixed is at most that
    plan's makespan (``inf``, no plan of the sequence, only where brute force finds
    none)."""
    from optmem.models.remat_offload import build_link_relaxation
    from optmem.solvers.remat_offload_benders import host_bound

    built = build_remat_offload(chain, limit, beta)
    host = build_link_relaxation(chain, limit, beta)
    opvars = [i for sl in built.slots for _, i in sl.ops]
    checked = 0
    for ops, fixing, found in _sequence_plans(chain, limit, beta, built):
        bound = host_bound(host, {i: int(fixing[i]) for i in opvars}, OPTS, None)
        assert math.isfinite(bound) or bound == math.inf
        if found is not None:
            assert bound <= found[0] + 1e-6, (ops, bound, found[0])
            checked += 1
    assert checked > 0 or solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                "brute", options=OPTS).status is Status.INFEASIBLE


def _sequence_bounds_checked(chain: Chain, limit: int, beta: float,
                             cumulative: bool = False) -> int:
    """For every compute sequence of brute force's enumeration with a plan (its compute
    time where it fits without transfers, else brute force's best transfers), the link
    relaxation with the read deadlines (``read_deadlines``; host rows and aggregated; with
    ``cumulative``: host rows with ``cumulative_reads``) and that sequence fixed is at most
    the plan's makespan; returns how many were checked."""
    checked = 0
    rows = [{"host_values": True, "cumulative_reads": True}] if cumulative else \
        [{"host_values": True}, {"host_values": False}]
    for ops, xhat, best in _fixed_sequences(chain, limit, beta):
        for kw in rows:
            bound = _relaxation(chain, limit, beta, xhat, read_deadlines=True, **kw)
            assert bound <= best + 1e-6, (ops, kw, bound, best)
        checked += 1
    return checked


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_read_deadlines_of_a_sequence_never_exceed_its_brute_value(chain: Chain, limit: int,
                                                                   beta: float) -> None:
    """The read-deadline rows (``read_deadlines``: a value on the host during an item and
    read by a later recomputation slot is prefetched between the two) keep the relaxation
    of every compute sequence at most that sequence's best plan (brute force), with and
    without the per-value host rows, also with ops that take no time."""
    checked = _sequence_bounds_checked(chain, limit, beta)
    assert checked > 0 or solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                "brute", options=OPTS).status is Status.INFEASIBLE


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_read_deadlines_only_lift_the_relaxation(chain: Chain, limit: int,
                                                 beta: float) -> None:
    """Over all sequences the read deadlines never lower the relaxation (host rows or
    aggregated) and never lift it above brute force's optimum."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    for host_values in (True, False):
        before = _relaxation(chain, limit, beta, host_values=host_values)
        after = _relaxation(chain, limit, beta, host_values=host_values, read_deadlines=True)
        assert after >= before - 1e-6
        if brute.status.has_plan:
            assert after <= brute.objective + 1e-6


# a chain, limit and link where a read-deadline row binds (found by search; F_all 1 in the
# backward pass reads a^0, which the relaxation would otherwise bring back during it)
READ_ROW_CASE = (Chain.from_lists([3, 4], [6, 4], [3, 2], [3, 2], input_size=2,
                                  fwd_overhead=[1, 0]), 10, 3.0)


@pytest.mark.parametrize("factor", [0.25, 0.5])
def test_a_wrong_read_deadline_is_caught(monkeypatch: pytest.MonkeyPatch,
                                         factor: float) -> None:
    """The per-sequence check of the read deadlines fails for a deliberately wrong row (the
    link made slower in it by ``factor``): the test above would catch an invalid row."""
    import optmem.models.remat_offload as ro

    real = ro._read_deadline

    def wrong(m, p, q, slot_reads, seen, unread, held, relief, D, S, bandwidth, size):
        return real(m, p, q, slot_reads, seen, unread, held, relief, D, S, bandwidth * factor,
                    size)

    chain, limit, beta = READ_ROW_CASE
    assert _sequence_bounds_checked(chain, limit, beta) > 0
    monkeypatch.setattr(ro, "_read_deadline", wrong)
    with pytest.raises(AssertionError):
        _sequence_bounds_checked(chain, limit, beta)


# random_chain(10, seed=1) at its 10 % limit (59, bandwidth 1): the host relaxation's best
# compute sequence before the read deadlines (HiGHS, 2026-11-28) with its best transfers
# (CP-SAT with the sequence fixed proves 90)
PLAN_10_1 = ("F_all 1", "offload a 0", "F_ck 2", "offload abar 1", "F_none 3", "F_ck 4",
             "F_all 5", "offload a 3", "F_ck 6", "F_ck 7", "F_all 8", "F_all 9", "F_all 10",
             "Loss", "B 10", "offload a 6", "B 9", "prefetch a 6", "B 8", "prefetch a 0",
             "F_all 7", "B 7", "prefetch a 3", "F_all 6", "B 6", "B 5", "F_all 4", "B 4",
             "prefetch abar 1", "F_all 2", "F_all 3", "B 3", "B 2", "B 1")


def _discretized_instance(chain: Chain, memory: int) -> tuple[Any, float]:
    """``(disc, beta)`` of ``chain`` at ``memory`` with the proofs benchmark's link (it moves
    half the forward's outputs in the forward's time), discretized as the solvers do."""
    from optmem.solvers.remat_offload import discretized

    problem = RematOffloadProblem(chain, memory, chain_bandwidth=sum(chain.output_size) / sum(
        chain.fwd_time) / 2)
    return discretized(problem, OPTS)


def _plan_sequence(chain: Chain, memory: int, plan_ops: tuple[str, ...]
                   ) -> tuple[Any, float, float, dict[int, int]]:
    """``(disc, beta, makespan, xhat)`` of a plan on ``chain`` at ``memory``
    (:func:`_discretized_instance`): the simulated makespan of the plan and its compute
    sequence as the model's compute binaries."""
    from optmem.plan import Op, parse_mixed_plan

    disc, beta = _discretized_instance(chain, memory)
    plan = parse_mixed_plan(list(plan_ops))
    makespan = simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan
    built = build_remat_offload(disc.chain, disc.memory_limit, beta)
    fixing = built.fixing([op for op in plan if isinstance(op, Op)])
    assert fixing is not None
    xhat = {i: x for i, x in fixing.items() if i < len(built.checkpoint.names)}
    return disc, beta, makespan, xhat


def test_read_deadlines_lift_a_compute_sequence_toward_its_value() -> None:
    """Where the host rows were loose (``PLAN_10_1``'s sequence: 76 in the host relaxation,
    90 in the model): the read deadlines lift the sequence's relaxation to 85, at most the
    simulated makespan of the plan (90; ``abar^1`` must be back before ``F_all 2``)."""
    disc, beta, makespan, xhat = _plan_sequence(random_chain(10, seed=1), 59, PLAN_10_1)
    host = _relaxation(disc.chain, disc.memory_limit, beta, xhat)
    lifted = _relaxation(disc.chain, disc.memory_limit, beta, xhat, read_deadlines=True)
    assert makespan == pytest.approx(90)
    assert host == pytest.approx(76)
    assert lifted == pytest.approx(85)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_cumulative_reads_of_a_sequence_never_exceed_its_brute_value(chain: Chain, limit: int,
                                                                     beta: float) -> None:
    """The cumulative read rows (``cumulative_reads``: every value on the host during an
    item and read by a slot before ``q`` is prefetched before ``q``) keep the host
    relaxation of every compute sequence at most that sequence's best plan (brute force),
    also with ops that take no time."""
    checked = _sequence_bounds_checked(chain, limit, beta, cumulative=True)
    assert checked > 0 or solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta),
                                "brute", options=OPTS).status is Status.INFEASIBLE


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_cumulative_reads_only_lift_the_relaxation(chain: Chain, limit: int,
                                                   beta: float) -> None:
    """Over all sequences the cumulative read rows never lower the host relaxation with the
    read deadlines and never lift it above brute force's optimum; the lazy host stage's
    choice of items with them stays between the two as well."""
    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    before = _relaxation(chain, limit, beta, read_deadlines=True)
    after = _relaxation(chain, limit, beta, read_deadlines=True, cumulative_reads=True)
    assert after >= before - 1e-6
    if brute.status.has_plan:
        assert after <= brute.objective + 1e-6


# a chain, limit and link where a cumulative row binds (found by search over 2-stage chains)
CUMULATIVE_ROW_CASE = (Chain.from_lists([3, 4], [6, 5], [1, 5], [2, 6], input_size=3), 15, 0.5)


@pytest.mark.parametrize("wrong", ["no_read", "slow_link"])
def test_a_wrong_cumulative_read_row_is_caught(monkeypatch: pytest.MonkeyPatch,
                                               wrong: str) -> None:
    """The per-sequence check fails for deliberately wrong cumulative rows: ``z`` counting
    a value on the host whether or not a slot reads it (``z >= h``), or the link made 4x
    slower in the deadline rows that carry ``z``."""
    import optmem.models.remat_offload as ro

    real = ro._read_before

    def no_read(m, p, q, w, h, lit, before):
        return real(m, p, q, w, h, True, before)

    def slow_link(m, p, q, w, h, lit, before):
        return real(m, p, q, w, h, lit, before) * 4

    chain, limit, beta = CUMULATIVE_ROW_CASE
    assert _sequence_bounds_checked(chain, limit, beta, cumulative=True) > 0
    monkeypatch.setattr(ro, "_read_before", no_read if wrong == "no_read" else slow_link)
    with pytest.raises(AssertionError):
        _sequence_bounds_checked(chain, limit, beta, cumulative=True)


# random_chain(10, seed=3) at its 10 % limit (55): the host relaxation's best compute
# sequence with the read deadlines (HiGHS, 2026-11-28) and its best transfers (CP-SAT with
# the sequence fixed proves 90.86)
PLAN_10_3 = ("F_ck 1", "offload a 0", "F_none 2", "F_all 3", "F_ck 4", "offload abar 3",
             "F_ck 5", "F_all 6", "F_all 7", "F_all 8", "offload a 4", "F_all 9",
             "offload a 2", "F_all 10", "offload a 5", "Loss", "B 10", "B 9", "B 8", "B 7",
             "prefetch a 0", "prefetch a 5", "prefetch a 4", "B 6", "prefetch abar 3",
             "F_all 5", "B 5", "F_all 1", "prefetch a 2", "F_all 4", "offload a 0", "B 4",
             "B 3", "prefetch a 0", "F_all 2", "B 2", "B 1")


def test_cumulative_reads_lift_a_compute_sequence_to_its_value() -> None:
    """Where the read deadlines were loose (``PLAN_10_3``'s sequence: 83 in the host
    relaxation with them, 90.86 in the model): with the cumulative rows the sequence's
    relaxation is 90.86, the simulated makespan of the plan (``a^0`` and ``abar^3``, read
    by ``F_all 1`` and ``F_all 4``, cannot both come back in the 11 time units left)."""
    disc, beta, makespan, xhat = _plan_sequence(random_chain(10, seed=3), 55, PLAN_10_3)
    reads = _relaxation(disc.chain, disc.memory_limit, beta, xhat, read_deadlines=True)
    lifted = _relaxation(disc.chain, disc.memory_limit, beta, xhat, read_deadlines=True,
                         cumulative_reads=True)
    assert makespan == pytest.approx(90 + 37 / 43)
    assert reads == pytest.approx(83)
    assert lifted == pytest.approx(makespan)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(length=st.integers(3, 4), seed=st.integers(0, 10_000),
       beta=st.sampled_from([0.3, 1.0, 2.0]))
def test_link_relaxation_never_exceeds_the_model_optimum(length: int, seed: int,
                                                         beta: float) -> None:
    """On random chains the relaxation stays at most the model's proven optimum (solved
    without the relaxation, deterministic CP-SAT) and every candidate plan's makespan."""
    chain = random_chain(length, seed=seed, max_size=8)
    opts = SolveOptions(slots=64, threads=1, seed=1, deterministic_time=60.0,
                        extra={"relaxation": False})
    for limit in limits(chain)[:2]:
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        bound = _relaxation(chain, limit, beta)
        exact = solve(problem, "cpsat", options=opts)
        check(problem, exact, opts)
        assert exact.report["relaxation"] == {"status": "off"}
        if exact.status is Status.OPTIMAL:
            assert bound <= exact.objective + 1e-6
        for name in ("dp", "remat_only", "offload_only"):
            res = solve(problem, name, options=OPTS)
            if res.status.has_plan:
                assert bound <= res.objective + 1e-6, name


@settings(max_examples=6, deadline=None, derandomize=True)
@given(length=st.integers(5, 6), seed=st.integers(0, 10_000),
       beta=st.sampled_from([0.3, 1.0, 51 / 46, 2.0]))
def test_link_windows_never_cut_a_plan(length: int, seed: int, beta: float) -> None:
    """The prefetch-deadline rows only lift the relaxation and keep it below every plan
    found on longer chains: the model's incumbent after a short
    deterministic search (relaxation off) and the DP / pure plans."""
    from optmem.models.formulation import to_pulp
    from optmem.models.remat_offload import build_link_relaxation

    chain = random_chain(length, seed=seed, max_size=10)
    opts = SolveOptions(slots=64, threads=1, seed=1, deterministic_time=2.0,
                        extra={"relaxation": False})
    for limit in limits(chain)[:2]:
        pm = to_pulp(build_link_relaxation(chain, limit, beta, deadlines=False))
        plain = engines.solve_pulp(pm.problem, pm.all_variables, "highs")
        bound = _relaxation(chain, limit, beta)
        if plain.status is Status.INFEASIBLE:
            continue
        assert bound >= plain.objective - 1e-6
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
        for name in ("cpsat", "dp", "remat_only", "offload_only"):
            res = solve(problem, name, options=opts if name == "cpsat" else OPTS)
            if res.status.has_plan:
                assert bound <= res.objective + 1e-6, name


@pytest.mark.parametrize("seed", range(3))
def test_link_relaxation_with_a_useless_link_is_the_checkpoint_optimum(seed: int) -> None:
    """With a link too slow to relieve a unit of memory the relaxation is the checkpoint
    model of the same class (``reductions=False``), whose optimum the checkpoint ILP proves."""
    chain = random_chain(3 + seed % 2, seed=seed, max_size=6)
    for limit in limits(chain):
        ckpt = solve(CheckpointProblem(chain, limit), "ilp", options=OPTS)
        assert ckpt.status is Status.OPTIMAL
        assert _relaxation(chain, limit, 1e-4) == pytest.approx(ckpt.objective)


def test_link_relaxation_bound_is_reported_and_lifts_the_floor() -> None:
    """The exact methods report the relaxation, use its bound (above the compute sum at a
    tight limit) and stay consistent with it: the optimum found is not below it."""
    chain = random_chain(6, seed=3, max_size=8)
    limit = limits(chain)[0]
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=0.5)
    bound = _relaxation(chain, limit, 0.5)
    assert bound > chain.total_compute_time() + 1e-6
    for method in METHODS:
        res = solve(problem, method, options=SolveOptions(slots=64, threads=1, seed=1,
                                                          deterministic_time=20.0,
                                                          node_limit=200))
        check(problem, res)
        assert res.report["relaxation"]["status"] == "optimal"
        assert res.report["relaxation"]["bound"] == pytest.approx(bound, rel=1e-6)
        assert res.bound >= bound - 1e-6
        assert res.objective >= bound - 1e-6


def test_relaxation_keeps_the_strongest_solved_stage(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """The relaxation's stages (plain, deadline rows, host rows): each one's bound is
    reported and the best is the bound; the Benders loop's first master is the strongest
    stage solved to optimality, so a last stage stopped early (injected) gives its dual
    bound but not the master."""
    from dataclasses import replace

    import optmem.solvers.remat_offload_exact as exact

    chain = random_chain(4, seed=41, max_size=6)
    limit = limits(chain)[0]
    solved = exact._relaxation_bound(chain, limit, 1.0, 1, OPTS, "cpsat")
    assert solved.out is not None and solved.out.status is Status.OPTIMAL
    assert solved.master is not None and any(v.name.startswith("h_")
                                             for v in solved.master.vars)
    stages = [solved.info[key] for *_, key in exact.RELAXATION_STAGES]
    assert stages == sorted(stages) and solved.bound == pytest.approx(stages[-1])
    real = exact.engines.solve_pulp

    def stop_the_last(*args, **kwargs):
        out = real(*args, **kwargs)
        if any(v.name.startswith("h_") for v in args[1]):
            return replace(out, status=Status.FEASIBLE, bound=stages[1] + 0.5,
                           stopped_by="time")
        return out

    monkeypatch.setattr(exact.engines, "solve_pulp", stop_the_last)
    stopped = exact._relaxation_bound(chain, limit, 1.0, 1, OPTS, "cpsat")
    assert stopped.out is not None and stopped.out.status is Status.OPTIMAL
    assert stopped.master is not None
    assert not any(v.name.startswith("h_") for v in stopped.master.vars)
    assert any(c.name.startswith("deadline_") for c in stopped.master.constraints)
    assert stopped.bound == pytest.approx(max(stages[1] + 0.5, stages[1]))


@pytest.mark.parametrize("seed", [41, 2])
def test_lazy_host_stage_matches_the_host_stage(seed: int) -> None:
    """``relaxation_lazy``: the host stage with its rows added only on the items whose
    local host rows the current solution violates reaches the full host stage's bound on
    the 4-stage chains (from the deadline stage's, in one or two rounds, with fewer
    items), and is never above it."""
    import optmem.solvers.remat_offload_exact as exact

    chain = random_chain(4, seed=seed, max_size=6)
    rounds = 0
    for limit in limits(chain):
        full = exact._relaxation_bound(chain, limit, 1.0, 1,
                                       OPTS.with_(extra={"relaxation_lazy": False}), "cpsat")
        lazy = exact._relaxation_bound(chain, limit, 1.0, 1,
                                       OPTS.with_(extra={"relaxation_lazy": True}), "cpsat")
        assert lazy.info["deadline_bound"] == pytest.approx(full.info["deadline_bound"])
        assert lazy.bound == pytest.approx(full.bound, abs=1e-6)
        assert lazy.info["host_bound"] <= full.info["host_bound"] + 1e-6
        assert lazy.info["host_items"] < len(build_remat_offload(
            chain, limit, 1.0).checkpoint.sequence)
        rounds += lazy.info["host_rounds"]
    assert rounds >= 1


@settings(max_examples=20, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_lazy_host_stage_never_exceeds_the_brute_optimum(chain: Chain, limit: int,
                                                         beta: float) -> None:
    """The lazy host stage's bound (every round's) is at most brute force's optimum."""
    import optmem.solvers.remat_offload_exact as exact

    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    lazy = exact._relaxation_bound(chain, limit, beta, 1,
                                   OPTS.with_(extra={"relaxation_lazy": True}), "cpsat")
    if brute.status.has_plan:
        assert lazy.bound <= brute.objective + 1e-6


CUMULATIVE = {"relaxation_read_deadlines": True, "relaxation_cumulative_reads": True}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(chain=st.one_of(tiny(), tiny_with_idle_ops()), limit=st.integers(3, 22),
       beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_lazy_cumulative_host_stage_never_exceeds_the_brute_optimum(chain: Chain, limit: int,
                                                                    beta: float) -> None:
    """With the cumulative read rows (``relaxation_cumulative_reads``) the lazy host stage's
    bound is at most brute force's optimum and never above the full host stage's."""
    import optmem.solvers.remat_offload_exact as exact

    brute = solve(RematOffloadProblem(chain, limit, chain_bandwidth=beta), "brute",
                  options=OPTS)
    assert brute.status is not Status.ERROR
    lazy = exact._relaxation_bound(chain, limit, beta, 1, OPTS.with_(extra=CUMULATIVE), "cpsat")
    full = exact._relaxation_bound(chain, limit, beta, 1, OPTS.with_(
        extra={**CUMULATIVE, "relaxation_lazy": False}), "cpsat")
    assert lazy.bound <= full.bound + 1e-6
    if brute.status.has_plan:
        assert full.bound <= brute.objective + 1e-6


@pytest.mark.parametrize("seed", range(3))
def test_lazy_cumulative_host_stage_stays_between_its_neighbours(seed: int) -> None:
    """On 4-stage chains the lazy host stage with the cumulative rows lies between the
    deadline stage and the full host stage with them, and never below the lazy stage
    without them (its rounds come first; each ``z`` of ``host_violations`` at its least
    value)."""
    import optmem.solvers.remat_offload_exact as exact

    chain = random_chain(4, seed=seed, max_size=6)
    for limit in limits(chain):
        plain = exact._relaxation_bound(chain, limit, 1.0, 1, OPTS.with_(
            extra={"relaxation_read_deadlines": True}), "cpsat")
        lazy = exact._relaxation_bound(chain, limit, 1.0, 1, OPTS.with_(extra=CUMULATIVE),
                                       "cpsat")
        full = exact._relaxation_bound(chain, limit, 1.0, 1, OPTS.with_(
            extra={**CUMULATIVE, "relaxation_lazy": False}), "cpsat")
        assert lazy.info["deadline_bound"] - 1e-6 <= lazy.bound <= full.bound + 1e-6
        assert lazy.bound >= plain.bound - 1e-6


class _Clock:
    """A clock the tests move by hand (the relaxation's time source)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed_stages(monkeypatch: pytest.MonkeyPatch, build_s: float,
                  stages: list[tuple[float, Status]]) -> tuple[_Clock, list[float | None]]:
    """Stub the relaxation's build and engine on a :class:`_Clock`: a build takes
    ``build_s``, the i-th solve ``stages[i]`` (seconds, capped by its limit; status, which
    becomes ``feasible`` when the limit cuts it). Returns the clock and the limits given."""
    import optmem.solvers.remat_offload_exact as exact

    clock, limits_given = _Clock(), []
    real_build = exact.build_link_relaxation

    def build(*args, **kwargs):
        clock.now += build_s
        return real_build(*args, **kwargs)

    def solve_pulp(*args, time_limit_s=None, **kwargs):
        seconds, status = stages[len(limits_given)]
        limits_given.append(time_limit_s)
        if time_limit_s is not None and seconds > time_limit_s:
            seconds, status = time_limit_s, Status.FEASIBLE
        clock.now += seconds
        return EngineResult(status, None, 80.0, 70.0 + len(limits_given), "highs", seconds)

    monkeypatch.setattr(exact, "build_link_relaxation", build)
    monkeypatch.setattr(exact.engines, "solve_pulp", solve_pulp)
    return clock, limits_given


FULL_HOST = {"relaxation_lazy": False}  # the clocked tests: the host stage in one MILP
_TOO_LARGE = "skipped (too large, or the deadline stage not solved)"


@pytest.mark.parametrize(("build_s", "stages", "max_values", "ran", "skipped"), [
    # slow builds and a deadline stage that uses all that is left: the host stage never starts
    (3.0, [(1.0, Status.OPTIMAL), (50.0, Status.OPTIMAL)], 1200, 2, "skipped (time)"),
    # the host stage runs in what is left, stopped at the end of the share
    (0.5, [(1.0, Status.OPTIMAL), (2.0, Status.OPTIMAL), (60.0, Status.OPTIMAL)], 1200, 3,
     None),
    # too many per-value host binaries (the chain has 104): built (its time counted), not run
    (1.0, [(1.0, Status.OPTIMAL), (3.0, Status.OPTIMAL)], 103, 2, _TOO_LARGE),
    # the deadline stage was stopped: the harder host stage is not started
    (0.0, [(1.0, Status.OPTIMAL), (5.0, Status.FEASIBLE)], 1200, 2, _TOO_LARGE),
])
def test_relaxation_stays_within_its_share(monkeypatch: pytest.MonkeyPatch, build_s: float,
                                           stages: list[tuple[float, Status]],
                                           max_values: int, ran: int,
                                           skipped: str | None) -> None:
    """The whole relaxation (builds included) keeps to ``RELAXATION_SHARE`` of the time
    limit, on an injected clock and engine: each stage's limit is what is left after the
    builds and the stages before it; a stage with less than the engine's least time left
    is skipped, the host stage also when it is too large or the deadline stage was not
    solved (``_host_stage_fits``)."""
    import optmem.solvers.remat_offload_exact as exact

    monkeypatch.setattr(exact, "HOST_STAGE_MAX_VALUES", max_values)
    clock, given = _timed_stages(monkeypatch, build_s, stages)
    chain = random_chain(4, seed=41, max_size=6)
    share = exact.RELAXATION_SHARE * 100.0
    relaxed = exact._relaxation_bound(chain, limits(chain)[0], 1.0, 1,
                                      SolveOptions(threads=1, time_limit_s=100.0, extra=FULL_HOST),
                                      "cpsat",
                                      clock=clock)
    assert len(given) == ran
    assert clock.now <= share + 1e-9
    assert relaxed.info["relaxation_s"] == pytest.approx(clock.now)
    assert given[0] == pytest.approx(share - build_s)
    spent = build_s
    for limit, (seconds, _) in zip(given, stages[:ran], strict=True):
        assert limit == pytest.approx(share - spent)  # the builds are counted
        spent += min(seconds, limit) + build_s
    if skipped is not None:
        assert relaxed.info[exact.RELAXATION_STAGES[ran][2]] == skipped
    assert relaxed.bound == pytest.approx(70.0 + ran, rel=1e-6)


@pytest.mark.parametrize(("stages", "given_limits", "host"), [
    # the deadline stage runs past the share on the loop's time; no time left for the host
    ([(1.0, Status.OPTIMAL), (40.0, Status.OPTIMAL)], [70.0, 69.0], "skipped (time)"),
    # a quick deadline stage: the host stage gets what is left of the share, not of 70 s
    ([(1.0, Status.OPTIMAL), (5.0, Status.OPTIMAL), (60.0, Status.OPTIMAL)],
     [70.0, 69.0, 19.0], 70.0 + 3),
])
def test_relaxation_master_stages_may_use_the_loops_time(
        monkeypatch: pytest.MonkeyPatch, stages: list[tuple[float, Status]],
        given_limits: list[float], host: str | float) -> None:
    """``strategy=benders``: the stages up to the deadline rows (the loop's first master)
    run within ``master_budget_s``, the host stage within the relaxation's share."""
    import optmem.solvers.remat_offload_exact as exact

    clock, given = _timed_stages(monkeypatch, 0.0, stages)
    chain = random_chain(4, seed=41, max_size=6)
    relaxed = exact._relaxation_bound(chain, limits(chain)[0], 1.0, 1,
                                      SolveOptions(threads=1, time_limit_s=100.0, extra=FULL_HOST),
                                      "cpsat",
                                      master_budget_s=70.0, clock=clock)
    assert given == pytest.approx(given_limits)
    assert relaxed.info["host_bound"] == host
    assert clock.now <= max(exact.RELAXATION_SHARE * 100.0, sum(s for s, _ in stages[:2]))


@pytest.mark.parametrize("share", [None, 0.6, 1.0])
def test_relaxation_share_is_the_relaxations_budget(monkeypatch: pytest.MonkeyPatch,
                                                    share: float | None) -> None:
    """``relaxation_share`` (default ``RELAXATION_SHARE``) is the relaxation's share of the
    time limit: the first stage's limit on an injected clock."""
    import optmem.solvers.remat_offload_exact as exact

    clock, given = _timed_stages(monkeypatch, 1.0, [(1.0, Status.OPTIMAL)] * 3)
    chain = random_chain(4, seed=41, max_size=6)
    extra = FULL_HOST if share is None else {**FULL_HOST, "relaxation_share": share}
    exact._relaxation_bound(chain, limits(chain)[0], 1.0, 1,
                            SolveOptions(threads=1, time_limit_s=100.0, extra=extra), "cpsat",
                            clock=clock)
    expected = 100.0 * (exact.RELAXATION_SHARE if share is None else share)
    assert given[0] == pytest.approx(expected - 1.0)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"strategy": "benders"}, 0.6), ({"strategy": "benders", "relaxation_share": 0.25}, 0.25),
    ({}, None)])
def test_benders_gives_the_relaxation_more_time(monkeypatch: pytest.MonkeyPatch,
                                                extra: dict[str, Any],
                                                expected: float | None) -> None:
    """``strategy=benders`` solves the relaxation with ``BENDERS_RELAXATION_SHARE`` unless
    ``relaxation_share`` is given, and with the read deadlines; ``full`` keeps the options
    as given (default absent)."""
    import optmem.solvers.remat_offload_exact as exact

    seen: list[Any] = []
    real = exact._relaxation_bound

    def spy(*args, **kwargs):
        seen.append(args[4].extra.get("relaxation_share"))
        reads = args[4].extra.get("relaxation_read_deadlines")
        assert reads is (True if expected is not None else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(exact, "_relaxation_bound", spy)
    chain = random_chain(3, seed=2, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    res = solve(problem, "cpsat", options=OPTS.with_(seed=1, deterministic_time=20.0,
                                                     extra=extra))
    check(problem, res)
    assert seen == [expected]
    assert exact.BENDERS_RELAXATION_SHARE == 0.6


def test_relaxation_without_time_limit_runs_every_stage(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """No time limit: every stage runs, without a limit."""
    import optmem.solvers.remat_offload_exact as exact

    clock, given = _timed_stages(monkeypatch, 1.0, [(1.0, Status.OPTIMAL)] * 3)
    chain = random_chain(4, seed=41, max_size=6)
    exact._relaxation_bound(chain, limits(chain)[0], 1.0, 1,
                            SolveOptions(threads=1, extra=FULL_HOST), "cpsat", clock=clock)
    assert given == [None, None, None]


def test_failing_relaxation_engine_never_fails_the_solve(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """HiGHS failing on the link relaxation leaves ``cpsat`` without that bound, not broken:
    same optimum as with it, the failure in ``report["relaxation"]``."""
    import optmem.solvers.remat_offload_exact as exact

    problem = RematOffloadProblem(EXAMPLE, 10, chain_bandwidth=1.0)
    good = solve(problem, "cpsat", options=OPTS)
    monkeypatch.setattr(exact.engines, "solve_pulp", lambda *a, **k: engines.failed_result(
        "highs", RuntimeError("injected HiGHS failure")))
    res = solve(problem, "cpsat", options=OPTS)
    check(problem, res)
    assert res.report["relaxation"]["status"] == "error"
    assert res.status is good.status is Status.OPTIMAL
    assert res.objective == pytest.approx(good.objective)


def test_cpsat_time_grid_is_the_exact_rational_one() -> None:
    from optmem.solvers.remat_offload_exact import MAX_RATIONAL_SCALE, cpsat_time_scale

    chain = Chain.from_lists([3, 3], [6, 2], [5, 6], [7, 9], input_size=8)
    # transfer times size * 46 / 51: no power of ten is exact, 51 is
    assert cpsat_time_scale(chain, 51 / 46) == (51, True)
    assert cpsat_time_scale(chain, 0.5) == (1, True)  # decimal data keep the decimal grid
    assert cpsat_time_scale(chain, 8.0) == (8, True)  # coarser than the decimal 1000
    # a finer exact grid than the cap falls back to the (rounding) decimal one
    prime = 1_000_003
    assert prime > MAX_RATIONAL_SCALE
    assert cpsat_time_scale(chain, prime / 7) == (10**6, False)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.7, 51 / 46, 1.1]))
def test_cpsat_on_fractional_transfer_times_is_exact(chain: Chain, limit: int,
                                                     beta: float) -> None:
    """Fractional ``size / beta``: CP-SAT solves on the exact grid and equals brute force."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    exact = solve(problem, "cpsat", options=OPTS)
    brute = solve(problem, "brute", options=OPTS)
    check(problem, exact)
    assert exact.status.has_plan == brute.status.has_plan
    if exact.status.has_plan:
        assert exact.report["exact_times"] is True
        assert exact.status is Status.OPTIMAL
        assert exact.objective == pytest.approx(brute.objective)


def test_engine_work_is_reported() -> None:
    problem = RematOffloadProblem(EXAMPLE, 10, chain_bandwidth=0.5)
    opts = SolveOptions(slots=64, extra={"relaxation": False})
    res = solve(problem, "cpsat", options=opts)
    assert res.status is Status.OPTIMAL
    assert res.report["engine_work"]["deterministic_time"] >= 0
    assert res.report["engine_work"]["branches"] >= 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", [5, 7, 9])
def test_decoded_plans_replay_with_idle_ops(seed: int, method: str) -> None:
    """Random chains with zero-duration ops (``random_chain`` draws them), the relaxation
    off so that the model's own search decides, at two limits of :func:`limits` and at 29:
    every decoded plan replays within the limit (before the ``pendG`` rows, seed 7 at 29
    ended in ``error`` with CP-SAT)."""
    chain = random_chain(4, seed=seed, max_size=6)
    assert 0.0 in (*chain.fwd_time, *chain.bwd_time, chain.loss_bwd_time)
    opts = SolveOptions(slots=64, seed=1, deterministic_time=10.0, node_limit=5_000,
                        extra={"relaxation": False})
    for limit in (*limits(chain)[:2], 29):
        for beta in (0.3, 1.0):
            problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
            check(problem, solve(problem, method, options=opts), opts)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0, 51 / 46]))
def test_grid_ceiling_keeps_the_relaxation_a_bound(chain: Chain, limit: int,
                                                   beta: float) -> None:
    """The premise of :func:`~optmem.models.formulation.grid_ceiling`: on the exact time grid
    every plan's makespan (here brute force's optimum) is a multiple of ``1 / scale``; so the
    link relaxation's bound lifted to that grid stays at most the optimum."""
    from optmem.models.formulation import grid_ceiling
    from optmem.solvers.remat_offload_exact import cpsat_time_scale

    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    brute = solve(problem, "brute", options=OPTS)
    assert brute.status is not Status.ERROR
    scale, exact = cpsat_time_scale(chain, beta)
    assert exact
    if not brute.status.has_plan:
        return
    ticks = brute.objective * scale
    assert abs(ticks - round(ticks)) <= 1e-9 * max(1.0, ticks)  # the optimum is on the grid
    bound = _relaxation(chain, limit, beta)
    assert bound <= grid_ceiling(bound, scale) <= brute.objective + 1e-9


def test_a_grid_ceiling_one_step_too_high_is_caught() -> None:
    """Lifting one grid step more than :func:`grid_ceiling` does is not valid: on these
    instances the link relaxation is tight, and one step more passes the optimum."""
    from optmem.models.formulation import grid_ceiling
    from optmem.solvers.remat_offload_exact import cpsat_time_scale

    caught = 0
    for seed in range(4):
        chain = random_chain(3, seed=seed, max_size=6)
        beta = 51 / 46
        problem = RematOffloadProblem(chain, limits(chain)[1], chain_bandwidth=beta)
        best = solve(problem, "cpsat", options=OPTS)
        assert best.status is Status.OPTIMAL
        scale, _ = cpsat_time_scale(chain, beta)
        lifted = grid_ceiling(_relaxation(chain, problem.memory_limit, beta), scale)
        assert lifted <= best.objective + 1e-9
        caught += lifted + 1 / scale > best.objective + 1e-9
    assert caught >= 1


@pytest.mark.parametrize("factor", [1, 4])
def test_cpsat_grid_fits_int64_at_the_contract_ranges(factor: int) -> None:
    """A 1e9 ms stage beside a 3e-9 ms one (in the contract's ranges) solves with CP-SAT.

    Before: the decimal grid 1e-6 of the rounded times put the model's domains beyond
    int64 in sum, CP-SAT's ``MODEL_INVALID``: ``status: error`` at the store-all peak less
    one (brute force and ``ilp``: infeasible), the warm start only (``feasible``, an
    ``engine_error``) at four times it. Now the grid is coarser when the durations summed
    are that large (``time_scale`` 100 here).
    """
    chain = Chain.from_lists([1e9, 3e-9], [1e9, 1e-6], [2**46, 7], [2**46 + 1, 2**30 + 7],
                             input_size=2, loss_bwd_time=1e-6)
    memory = chain.store_all_peak() - 1 if factor == 1 else factor * chain.store_all_peak()
    problem = RematOffloadProblem(chain, memory, bandwidth=1e6)
    brute = solve(problem, "brute")
    result = solve(problem, "cpsat", threads=1)
    assert "engine_error" not in result.report
    assert result.status is brute.status
    if brute.status is Status.OPTIMAL:
        assert result.objective == pytest.approx(brute.objective, rel=1e-9)
