"""The large-neighbourhood search of remat + offload (``extra["lns"]``;
:mod:`optmem.solvers.remat_offload_lns`).

A primal heuristic: its plans count only through the simulator. Checked: the result replays
to its claimed makespan within the limit and is never slower than the start plan (random
chains, fixed seeds); with one window freeing every phase it reaches the proven optimum
(brute force, hypothesis derandomised, ``L <= 2``; the exact solve, ``L = 3``); an
acceptance that trusts a wrong makespan fails that check; through the solver (``full`` and
``benders``) the results stay consistent with brute force; a spent deadline starts no
engine call (fake clock); bad option values are refused before any work. Every engine call
has a deterministic work limit, no time limit.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remat_offload_helpers import (
    BENDERS,
    OPTS,
    brute_optimum,
    check,
    limits,
    needs_cpsat,
    refused_before_any_work,
)
from test_remat_offload_exact import tiny

import optmem.solvers.remat_offload_exact as exact
from optmem.chain import Chain
from optmem.datasets.synthetic import random_chain
from optmem.models.remat_offload import build_remat_offload
from optmem.plan import AnyOp
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.offload import simulate_offload
from optmem.simulate.verify import verify_plan
from optmem.solvers.facade import solve
from optmem.solvers.remat_offload import discretized, offload_candidate, remat_candidate
from optmem.solvers.remat_offload_lns import (
    LnsOutcome,
    LnsSettings,
    complete_plan,
    improve,
    lns_settings,
    phase_windows,
    window_solve,
)
from optmem.solvers.time_budget import Deadline

pytest.importorskip("ortools", reason="the search runs CP-SAT")

WORK = 5.0  # deterministic seconds per window: tiny chains are solved far below it


def _start(problem: RematOffloadProblem) -> tuple[float, tuple[AnyOp, ...]] | None:
    """The slowest of the checkpoint-only and offload-only plans that replay (room to gain)."""
    disc, beta = discretized(problem, OPTS)
    found = []
    for plan in (remat_candidate(disc), offload_candidate(problem, OPTS)):
        if plan is None:
            continue
        try:
            sim = simulate_offload(disc.chain, plan, beta, disc.memory_limit)
        except Exception:  # noqa: BLE001 - a plan that does not replay is no start
            continue
        found.append((sim.makespan, tuple(plan)))
    return max(found, key=lambda t: t[0]) if found else None


def _run(problem: RematOffloadProblem, start: tuple[float, tuple[AnyOp, ...]],
         lns: LnsSettings, **kwargs) -> LnsOutcome:
    disc, beta = discretized(problem, OPTS)
    scale, is_exact = exact.cpsat_time_scale(disc.chain, beta)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta,
                                grid=None if is_exact else scale)
    return improve(built, disc.chain, disc.memory_limit, beta, scale, start, lns, OPTS,
                   **kwargs)


def _check(problem: RematOffloadProblem, start: tuple[float, tuple[AnyOp, ...]],
           out: LnsOutcome) -> None:
    """The search's plan replays to its makespan within the limit, never slower than start."""
    verified = verify_plan(problem, [str(op) for op in out.plan], OPTS)
    assert verified["objective"] == pytest.approx(out.makespan, rel=1e-9, abs=1e-9)
    assert out.makespan <= start[0] + 1e-9
    assert out.improved == (out.makespan < start[0])
    accepted = [w["makespan"] for w in out.report["windows"] if w.get("accepted")]
    assert accepted == sorted(accepted, reverse=True)
    if accepted:
        assert accepted[-1] == pytest.approx(out.makespan)


def _full_window(chain: Chain) -> LnsSettings:
    """One window freeing every phase (the forward one too): the whole model."""
    return LnsSettings(enabled=True, work=WORK, windows=2, width=chain.length, step=1,
                       forward=True)


def test_phase_windows_cover_every_phase() -> None:
    for length in range(1, 9):
        for width in range(1, 6):
            for step in range(1, width + 2):
                windows = phase_windows(length, width, step, True)
                assert all(length + 1 in w for w in windows)
                back = [w - {length + 1} for w in windows]
                assert all(len(w) <= width for w in back)
                if step <= width:  # overlapping or adjacent: every backward phase freed
                    assert set().union(*back) == set(range(1, length + 1))
                assert [sorted(w) for w in phase_windows(length, width, step, False)] == \
                    [sorted(w) for w in back]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_full_window_reaches_brute_force(chain: Chain, limit: int, beta: float) -> None:
    """With a window covering every phase the search ends at brute force's optimum."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    start = _start(problem)
    if start is None:
        return
    brute = solve(problem, "brute", options=OPTS)
    assert brute.status is Status.OPTIMAL
    out = _run(problem, start, _full_window(chain))
    _check(problem, start, out)
    assert out.makespan == pytest.approx(brute.objective)


@pytest.mark.parametrize("seed", range(3))
def test_full_window_reaches_the_exact_optimum(seed: int) -> None:
    """On 3-stage chains a window covering every phase ends at the exact solve's optimum."""
    chain = random_chain(3, seed=seed, max_size=6)
    for limit in limits(chain):
        problem = RematOffloadProblem(chain, limit, chain_bandwidth=1.0)
        start = _start(problem)
        if start is None:
            continue
        proven = solve(problem, "cpsat", options=OPTS.with_(deterministic_time=30.0))
        assert proven.status is Status.OPTIMAL
        out = _run(problem, start, _full_window(chain))
        _check(problem, start, out)
        assert out.makespan == pytest.approx(proven.objective)


def _windowed() -> list[tuple[RematOffloadProblem, LnsSettings]]:
    out = []
    for seed in range(4):
        chain = random_chain(5, seed=seed, max_size=6)
        for limit in limits(chain)[:2]:
            for beta in (0.5, 2.0):
                lns = LnsSettings(enabled=True, work=WORK, windows=6, width=2, step=1,
                                  forward=seed % 2 == 0)
                out.append((RematOffloadProblem(chain, limit, chain_bandwidth=beta), lns))
    return out


@pytest.mark.parametrize(("problem", "lns"), _windowed())
def test_windows_never_worse_and_replayed(problem: RematOffloadProblem,
                                          lns: LnsSettings) -> None:
    """Small windows on 5-stage chains: a valid plan, never slower than the start."""
    start = _start(problem)
    if start is None:
        pytest.skip("no start plan")
    out = _run(problem, start, lns)
    _check(problem, start, out)
    assert len(out.report["windows"]) <= lns.windows


def test_improves_somewhere() -> None:
    """The windows do find better plans (not only keep the start) on these chains."""
    gains = 0
    for problem, lns in _windowed()[:8]:
        start = _start(problem)
        if start is not None and _run(problem, start, lns).improved:
            gains += 1
    assert gains >= 2


def test_wrong_acceptance_fails_the_check() -> None:
    """An acceptance that trusts a wrong makespan (half the replay) is caught by the check."""
    chain = random_chain(3, seed=1, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    start = _start(problem)
    assert start is not None
    disc, beta = discretized(problem, OPTS)

    def wrong(plan: tuple[AnyOp, ...]) -> float | None:
        return 0.5 * simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan

    out = _run(problem, start, _full_window(chain), accept=wrong)
    with pytest.raises(AssertionError):
        _check(problem, start, out)
    _check(problem, start, _run(problem, start, _full_window(chain)))


def test_spent_deadline_starts_no_engine_call() -> None:
    """A spent deadline (fake clock): the start plan back, no completion, no window."""
    chain = random_chain(3, seed=1, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    start = _start(problem)
    assert start is not None
    now = [0.0]
    deadline = Deadline.start(10.0, clock=lambda: now[0], margin=0.0)
    now[0] = 9.5
    out = _run(problem, start, _full_window(chain), deadline=deadline)
    assert out.plan == start[1] and not out.improved
    assert out.report["completion"] == "skipped (time)" and out.report["windows"] == []


@pytest.mark.parametrize("opts", [OPTS, BENDERS], ids=["full", "benders"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 3.0]))
def test_solves_with_lns_agree_with_brute(chain: Chain, limit: int, beta: float,
                                          opts: SolveOptions) -> None:
    """Solves with the search: plan replayed, bound at most the optimum, optimal = optimum."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    lns = {"lns": True, "lns_work": WORK, "lns_windows": 3, "lns_width": 1}
    res = solve(problem, "cpsat", options=opts.with_(extra={**opts.extra, **lns}))
    check(problem, res, optimum=brute_optimum(problem))


def test_solve_reports_the_search() -> None:
    """``report["lns"]`` under ``strategy=benders`` (no warm-up: the search runs before)."""
    chain = random_chain(4, seed=2, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=0.5)
    extra = {**BENDERS.extra, "lns": True, "lns_work": WORK, "lns_windows": 2,
             "relaxation": False}
    res = solve(problem, "cpsat", options=BENDERS.with_(extra=extra))
    check(problem, res)
    assert res.report["lns"]["windows"]
    assert res.objective <= res.report["lns"]["best"] + 1e-9


@pytest.mark.parametrize("extra", [{"lns": "yes"}, {"lns": 1}, {"lns_work": 0},
                                   {"lns_work": -1.0}, {"lns_windows": 0},
                                   {"lns_windows": 2.5}, {"lns_width": 0},
                                   {"lns_step": True}, {"lns_forward": "no"}])
def test_bad_options_refused_before_any_work(extra: dict, monkeypatch) -> None:
    refused_before_any_work(monkeypatch, extra, lns_settings)


def test_lns_needs_cpsat() -> None:
    needs_cpsat({"lns": True})


@pytest.mark.parametrize("seed", range(3))
def test_window_solve_frees_only_its_slots(seed: int) -> None:
    """``window_solve`` (the phase windows' and the benchmarks' stage blocks' one solve):
    with no slot free it keeps the hint's compute binaries and makespan; with every slot
    free it is never slower than the hint, and it decodes to a plan that replays to its
    model makespan or faster."""
    chain = random_chain(4, seed=seed, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=1.0)
    start = _start(problem)
    assert start is not None
    disc, beta = discretized(problem, OPTS)
    scale, is_exact = exact.cpsat_time_scale(disc.chain, beta)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta,
                                grid=None if is_exact else scale)
    fixed = built.fixing(start[1])
    assert fixed is not None
    report: dict[str, object] = {}
    lns = LnsSettings(enabled=True, work=WORK)
    hint = complete_plan(built, fixed, scale, lns, OPTS, Deadline(None), report)
    assert hint is not None
    compute = [idx for slot in built.slots for _, idx in slot.ops]
    entry, kept = window_solve(built, hint, lambda slot: False, scale, WORK, OPTS)
    assert kept is not None and entry["status"] == "optimal"
    assert [round(kept[i]) for i in compute] == [round(hint[i]) for i in compute]
    assert kept[built.objective_var] == pytest.approx(hint[built.objective_var], abs=1e-6)
    entry, free = window_solve(built, hint, lambda slot: True, scale, WORK, OPTS)
    assert free is not None
    assert free[built.objective_var] <= hint[built.objective_var] + 1e-6
    sim = simulate_offload(disc.chain, built.decode(free), beta, disc.memory_limit)
    assert sim.makespan <= free[built.objective_var] + 1e-6
