"""``extra["prefetch"]`` of the remat + offload methods: the placement policy of the plan.

Every method that places transfers with ``best_placement`` (``dp``, ``opportunist``,
``autocapper``, ``delta``, and the candidate plans of ``ilp`` / ``cpsat``) places them with
the given policy only; without the option the fastest of all policies is kept. A bad value
is one :class:`OptmemInputError` naming ``prefetch``, raised before any DP runs.
"""

from __future__ import annotations

import pytest

from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.result import SolveOptions, Status
from optmem.simulate.verify import verify_plan
from optmem.solvers import remat_offload
from optmem.solvers.facade import solve
from optmem.solvers.remat_offload import pofo_plan
from optmem.solvers.remat_offload_schedule import PREFETCH_POLICIES

# the chapter 4 DP's plan of this instance replays in 36 (alap), 41.6 (eager), 44.2 (lazy)
CHAIN = random_chain(6, seed=3)
PROBLEM = RematOffloadProblem(CHAIN, 49, chain_bandwidth=1.25)
OPTS = SolveOptions(slots=64)


def _with(**extra: object) -> SolveOptions:
    return OPTS.with_(extra=dict(extra))


def test_dp_places_with_the_given_policy() -> None:
    objectives = {}
    for policy in PREFETCH_POLICIES:
        res = solve(PROBLEM, "dp:extended", options=_with(prefetch=policy))
        assert res.status.has_plan, res.report
        assert res.report["prefetch"] == policy
        assert verify_plan(PROBLEM, list(res.plan), OPTS)["objective"] == \
            pytest.approx(res.objective)
        objectives[policy] = res.objective
    assert objectives == pytest.approx({"alap": 36.0, "eager": 41.6, "lazy": 44.2})
    best = solve(PROBLEM, "dp:extended", options=OPTS)  # no option: the fastest policy
    assert best.report["prefetch"] == "alap"
    assert best.objective == pytest.approx(min(objectives.values()))


def test_candidate_plans_of_the_exact_methods_use_the_policy() -> None:
    # ilp / cpsat take their DP candidates (default grid and dp_ladder) from pofo_plan
    for policy in PREFETCH_POLICIES:
        plan, info = pofo_plan(PROBLEM, _with(prefetch=policy), "extended")
        assert plan is not None
        assert info["prefetch"] == policy


@pytest.mark.parametrize("method", ["opportunist", "autocapper", "delta"])
@pytest.mark.parametrize("policy", PREFETCH_POLICIES)
def test_heuristics_place_with_the_given_policy(method: str, policy: str) -> None:
    res = solve(PROBLEM, method, options=_with(prefetch=policy))
    assert res.status is not Status.ERROR, res.report
    if res.status.has_plan and any(op.startswith("prefetch") for op in res.plan):
        choice = res.report.get("prefetch", res.report.get("choice", ""))
        assert policy in choice, res.report


@pytest.mark.parametrize("method", ["dp", "opportunist", "autocapper", "delta", "ilp",
                                    "cpsat"])
def test_bad_policy_is_refused_before_any_work(method: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(remat_offload, "PofoDP", no_work)
    monkeypatch.setattr(remat_offload, "checkpoint_table", no_work)
    monkeypatch.setattr(remat_offload, "static_replay", no_work)
    with pytest.raises(OptmemInputError) as err:
        solve(PROBLEM, method, options=_with(prefetch="soon"))
    assert err.value.field == "prefetch"
