"""The capped probe of the remat + offload model (``extra["probe_gap"]``, cpsat).

Against brute force on tiny chains (hypothesis, fixed examples): the model capped just
below the optimum is infeasible and capped just above it has a plan that replays within
the cap, so its verdict is a bound or a plan; solves with the probe keep every result
invariant (plan replayed, bound at most the optimum); on a chain where a solve stops with a
gap the probe closes it to the asked share; bad options are refused before any work.
"""

from __future__ import annotations

import math

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
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.offload import simulate_offload
from optmem.solvers.facade import solve
from optmem.solvers.remat_offload import discretized
from optmem.solvers.remat_offload_probe import capped_probe, probe_settings
from optmem.solvers.time_budget import Deadline

pytest.importorskip("ortools", reason="the probe runs CP-SAT")

WORK = 20.0  # deterministic seconds: tiny chains are decided far below it


def _probe(problem: RematOffloadProblem, cap: float):
    disc, beta = discretized(problem, OPTS)
    scale, is_exact = exact.cpsat_time_scale(disc.chain, beta)
    built = build_remat_offload(disc.chain, disc.memory_limit, beta,
                                grid=None if is_exact else scale)

    def replay(plan):
        return simulate_offload(disc.chain, plan, beta, disc.memory_limit).makespan

    return capped_probe(built, scale, is_exact, cap, WORK, OPTS, Deadline(None), replay)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_cap_below_the_optimum_is_infeasible_above_it_a_plan(chain: Chain, limit: int,
                                                              beta: float) -> None:
    """Brute force's optimum ``z``: capped at ``z - 1e-3`` the model is infeasible (the
    bound ``z - 1e-3`` holds), capped at ``z`` it has a plan that replays within ``z``."""
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    brute = solve(problem, "brute", options=OPTS)
    if not brute.status.has_plan:
        return
    z = brute.objective
    below = _probe(problem, z - 1e-3)
    assert below.report["status"] == "infeasible"
    assert below.bound == z - 1e-3 and below.plan is None
    at = _probe(problem, z)
    assert at.plan is not None and at.makespan <= z + 1e-9
    assert at.bound == -math.inf


@pytest.mark.parametrize("opts", [OPTS, BENDERS], ids=["full", "benders"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(chain=tiny(), limit=st.integers(3, 22), beta=st.sampled_from([0.5, 3.0]))
def test_solves_with_the_probe_agree_with_brute(chain: Chain, limit: int, beta: float,
                                                opts: SolveOptions) -> None:
    problem = RematOffloadProblem(chain, limit, chain_bandwidth=beta)
    extra = {**opts.extra, "probe_gap": 0.01, "probe_work": WORK}
    res = solve(problem, "cpsat", options=opts.with_(extra=extra))
    check(problem, res, optimum=brute_optimum(problem))


def test_the_probe_closes_a_gap_left_by_a_stopped_solve() -> None:
    """A solve without the relaxation and with almost no search work ends with a gap; with
    ``probe_gap`` the capped model is decided, and the result is within the share (a bound
    at the cap, or a plan found below it), the plan replayed, the bound valid."""
    chain = random_chain(4, seed=2, max_size=6)
    problem = RematOffloadProblem(chain, limits(chain)[0], chain_bandwidth=0.5)
    stopped = OPTS.with_(deterministic_time=0.01,
                         extra={"relaxation": False, "relaxation_sequence": False})
    before = solve(problem, "cpsat", options=stopped)
    proven = solve(problem, "cpsat", options=OPTS.with_(deterministic_time=60.0))
    assert proven.status is Status.OPTIMAL
    assert before.status is Status.FEASIBLE and before.gap > 0.02, (before.objective,
                                                                     before.bound)
    after = solve(problem, "cpsat", options=stopped.with_(
        extra={**stopped.extra, "probe_gap": 0.02, "probe_work": WORK}))
    check(problem, after, optimum=proven.objective)
    probe = after.report["probe"]
    assert probe["cap"] == pytest.approx(before.objective * 0.98)
    assert probe["status"] in ("infeasible", "feasible", "optimal")
    assert after.gap <= 0.02 + 1e-9 or after.objective < before.objective
    if probe["status"] == "infeasible":  # the cap, lifted to the grid of integer times
        assert after.bound == pytest.approx(min(math.ceil(probe["cap"]), after.objective))
        assert (after.status is Status.OPTIMAL) == (after.bound == after.objective)


@pytest.mark.parametrize("extra", [{"probe_gap": 0}, {"probe_gap": 1}, {"probe_gap": -0.1},
                                   {"probe_gap": True}, {"probe_gap": "1%"},
                                   {"probe_gap": 0.01, "probe_work": 0}])
def test_bad_options_refused_before_any_work(extra: dict, monkeypatch) -> None:
    refused_before_any_work(monkeypatch, extra, probe_settings)


def test_the_probe_needs_cpsat() -> None:
    needs_cpsat({"probe_gap": 0.01})
