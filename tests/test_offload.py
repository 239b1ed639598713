"""Offloading (issue 6): simulator, bounds, DP, heuristics, exact CP-SAT, brute force."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.cli_problems import offload_from_cli
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError, PlanError
from optmem.plan import TransferOp, parse_mixed_plan
from optmem.problems.offload import OffloadProblem
from optmem.result import Status
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.simulate.offload import simulate_offload
from optmem.simulate.verify import verify_plan
from optmem.solvers.checkpoint_baselines import store_all_plan
from optmem.solvers.facade import solve
from optmem.solvers.offload_comm import (
    Layers,
    evaluate,
    fractional_bound,
    prop3_bound,
    solve_comm_dp,
)

HEURISTICS = ("greedy", "dp", "vdnn", "vdnn_conv", "offload_all")


def worked_chain() -> Chain:
    """Digest section 7.2: L = 3, u_F = 2, u_B = 4, a = 2, abar = 4, delta = 2."""
    return Chain.from_lists([2, 2, 2], [4, 4, 4], [2, 2, 2], [4, 4, 4], input_size=2)


def two_partition_chain(items: list[int]) -> tuple[Chain, int, float]:
    """Thesis Thm 9 gadget (digest 2.2): M = 2V, beta = V."""
    n, v = len(items), sum(items) // 2
    length = n + 2
    fwd, bwd, saved = [0.0] * length, [0.0] * length, [0] * length
    for i in range(1, n):
        saved[i - 1] = items[i]
    fwd[n] = bwd[n] = 1.0
    saved[n + 1] = v
    chain = Chain.from_lists(fwd, bwd, [0] * length, saved, input_size=items[0])
    return chain, 2 * v, float(v)


def three_partition_chain(items: list[int]) -> tuple[Chain, int, float]:
    """Thesis Thm 7 gadget in [T] indexing (digest 2.1, errata 3): M = nV, beta = V."""
    n = len(items) // 3
    v = sum(items) // n
    length = 5 * n
    fwd, bwd, saved = [0.0] * length, [0.0] * length, [0] * length
    for i in range(1, 3 * n):
        saved[i - 1] = items[i]
    for k in range(1, n + 1):
        fwd[3 * n + 2 * k - 2] = 1.0
        saved[3 * n + 2 * k - 1] = v
    bwd[3 * n] = float(n)
    chain = Chain.from_lists(fwd, bwd, [0] * length, saved, input_size=items[0])
    return chain, n * v, float(v)


def check(problem: OffloadProblem, result) -> None:
    """Every plan replays with objective == makespan, peak <= limit and bound <= objective."""
    assert result.status is not Status.ERROR, result.report
    if not result.status.has_plan:
        return
    verified = verify_plan(problem, list(result.plan))
    assert math.isclose(verified["objective"], result.objective, rel_tol=1e-9, abs_tol=1e-9)
    assert verified["peak_memory"] == result.peak_memory <= result.memory_limit
    assert result.bound <= result.objective + 1e-9 * max(1.0, result.objective)


# ------------------------------------------------------------------ simulator
def test_store_all_matches_checkpoint_simulator():
    chain = random_chain(5, seed=3)
    plan = store_all_plan(5)
    ref = simulate_checkpoint(chain, plan)
    sim = simulate_offload(chain, plan, 1.0)
    assert sim.makespan == ref.makespan and sim.peak_memory == ref.peak_memory
    assert sim.idle_time == 0 and not sim.link


def test_overlap_and_idle_times():
    chain = worked_chain()
    plan = ["F_all 1", "offload a 0", "F_all 2", "Loss", "B 2", "prefetch a 0", "B 1"]
    chain2 = Chain.from_lists([2, 2], [4, 4], [2, 2], [4, 4], input_size=2)
    sim = simulate_offload(chain2, plan, 1.0, 12)
    assert (sim.makespan, sim.peak_memory, sim.idle_time) == (14.0, 12, 2.0)
    # the prefetch of a^0 cannot run during B 2 (12 + 2 > 12): it waits for B 2's end
    assert [(s.op, s.start, s.end) for s in sim.link] == [
        ("offload a 0", 0.0, 2.0), ("prefetch a 0", 8.0, 10.0)]
    assert sim.compute[-1].idle == 2.0
    del chain


def test_offload_frees_memory_when_complete_and_reader_done():
    chain = worked_chain()
    plan = ["offload a 0", "F_all 1", "offload abar 1", "F_all 2", "F_all 3", "Loss", "B 3",
            "prefetch abar 1", "B 2", "prefetch a 0", "B 1"]
    sim = simulate_offload(chain, plan, 1.0, 12)
    assert sim.makespan == 24.0 and sim.peak_memory == 12
    with pytest.raises(PlanError, match="op 4: Loss needs 14 memory"):
        simulate_offload(chain, plan[:2] + plan[3:], 1.0, 12)


@pytest.mark.parametrize("plan, message", [
    (["F_all 1", "offload abar 1", "F_all 2", "F_all 3", "Loss", "B 3", "B 2", "B 1"],
     "op 7: B 1 frees abar\\^1 while it is being offloaded"),
    (["prefetch a 0", "F_all 1"], "op 0: prefetch a 0: a\\^0 is not on the host"),
    (["offload abar 2"], "op 0: offload abar 2: abar\\^2 is not in memory"),
    (["offload a 0", "offload a 0"], "op 1: offload a 0: a\\^0 is already offloaded"),
])
def test_invalid_plans_name_index_and_reason(plan, message):
    with pytest.raises(PlanError, match=message):
        simulate_offload(worked_chain(), plan, 1.0)


def test_zero_bandwidth_rejects_transfers():
    with pytest.raises(PlanError, match="bandwidth is 0"):
        simulate_offload(worked_chain(), ["offload a 0"], 0.0)


def test_remat_ops_and_offloads_in_one_plan():
    """Issue 7 groundwork: checkpoint ops (F_ck/F_none recomputation) mix with transfers."""
    chain = worked_chain()
    plan = ["F_ck 1", "offload a 0", "F_none 2", "F_all 3", "Loss", "B 3", "F_all 2",
            "B 2", "prefetch a 0", "F_all 1", "B 1"]
    with pytest.raises(PlanError, match="op 6: F_all 2 needs a\\^1"):
        simulate_offload(chain, plan, 1.0)
    with pytest.raises(PlanError, match="op 2: F_all 1 would duplicate abar\\^1"):
        simulate_offload(chain, ["F_all 1", "offload abar 1", "F_all 1"], 1.0)
    plan = ["F_ck 1", "offload a 0", "F_none 2", "F_all 3", "Loss", "B 3", "prefetch a 0",
            "F_ck 1", "F_all 2", "B 2", "F_all 1", "B 1"]
    # a^1 is consumed by F_none 2 (needs recomputation from a^0, prefetched back first)
    sim = simulate_offload(chain, plan, 1.0, 12)
    ref = simulate_checkpoint(chain, [op for op in plan if not op.startswith(("off", "pre"))])
    assert sim.makespan == ref.makespan + 0.0
    assert sim.peak_memory <= ref.peak_memory


def test_transfer_op_strings_round_trip():
    ops = parse_mixed_plan(["offload a 0", "prefetch abar 3", "F_all 1", "Loss"])
    assert [str(op) for op in ops] == ["offload a 0", "prefetch abar 3", "F_all 1", "Loss"]
    assert isinstance(ops[0], TransferOp) and ops[1].key == ("abar", 3)
    for bad in ("offload delta 1", "offload abar 0", "prefetch a", "offload a x"):
        with pytest.raises(PlanError):
            parse_mixed_plan([bad])


# ------------------------------------------------------------------ problem and CLI hooks
def test_problem_validation_and_cli_bandwidth():
    chain = worked_chain()
    with pytest.raises(OptmemInputError, match="bandwidth"):
        OffloadProblem(chain, 12, -1.0)

    class Args:
        bandwidth = "12GB/s"

    assert offload_from_cli(chain, 12, Args()).chain_bandwidth == pytest.approx(1.2e7)
    Args.bandwidth = None
    with pytest.raises(OptmemInputError, match="--bandwidth"):
        offload_from_cli(chain, 12, Args())


# ------------------------------------------------------------------ golden values
# digest 7.2: (M, beta) -> (LB, OFF_frac, OFF_comm DP)
WORKED = {
    (12, 1): (18, 24, 24), (12, 2): (18, 21, 21), (12, 4): (18, 19.5, 19.5),
    (14, 1): (18, 20, 20), (14, 2): (18, 19, 19), (14, 4): (18, 18.5, 18.5),
    (16, 1): (18, 18, 18), (18, 4): (18, 18, 18),
}


@pytest.mark.parametrize("key", sorted(WORKED))
def test_worked_example_of_the_digest(key):
    memory, beta = key
    lb, frac, comm = WORKED[key]
    chain = worked_chain()
    assert Layers.of(chain).peak() == 18 and Layers.of(chain).min_memory() == 12
    assert prop3_bound(chain, memory, beta) == lb
    assert fractional_bound(chain, memory, beta) == pytest.approx(frac)
    assert solve_comm_dp(chain, memory, beta).value == pytest.approx(comm)


def test_worked_example_low_bandwidth_and_infeasible():
    chain = worked_chain().scaled(memory=2)  # beta = 1/2 as beta = 1 on doubled sizes
    assert prop3_bound(chain, 24, 1.0) == 24
    assert fractional_bound(chain, 24, 1.0) == 36 == solve_comm_dp(chain, 24, 1.0).value
    assert fractional_bound(chain, 28, 1.0) == 24 and solve_comm_dp(chain, 28, 1.0).value == 28
    result = solve(OffloadProblem(worked_chain(), 10, chain_bandwidth=4.0), "dp")
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory == 12


# digest 7.1.2: items -> OFF_comm optimum, GREEDY set evaluated in the comm model
TWO_PARTITION = {
    (1, 1, 2): (2, None), (1, 1, 4): (8 / 3, 4), (2, 2, 2, 4): (12 / 5, 12 / 5),
    (1, 1, 10): (10 / 3, 4), (5, 5, 5, 1): (5 / 2, None), (3, 1, 1, 2, 3): (2, None),
}


@pytest.mark.parametrize("items", sorted(TWO_PARTITION))
def test_two_partition_gadget(items):
    comm, greedy = TWO_PARTITION[items]
    chain, memory, beta = two_partition_chain(list(items))
    assert Layers.of(chain).peak() == 3 * beta
    assert fractional_bound(chain, memory, beta) == pytest.approx(2)
    dp = solve_comm_dp(chain, memory, beta)
    assert dp.value == pytest.approx(comm)
    if greedy is not None:
        sizes = [chain.input_size, *chain.saved_size]
        prefix, total = [], 0
        while total < beta:
            total += sizes[len(prefix)]
            prefix.append(len(prefix))
        fractions = [1.0 if k in prefix else 0.0 for k in range(chain.length)]
        assert evaluate(chain, memory, beta, fractions) == pytest.approx(greedy)
    problem = OffloadProblem(chain, memory, chain_bandwidth=beta)
    exact = solve(problem, "cpsat")
    check(problem, exact)
    assert exact.status is Status.OPTIMAL
    assert exact.objective >= dp.value - 1e-9  # OFF_comm relaxes OFF_int
    milp = solve(problem, "ilp")
    check(problem, milp)
    assert milp.status is Status.OPTIMAL and milp.objective == pytest.approx(exact.objective)
    if comm == 2:  # a partition exists: the models coincide at the bound
        assert exact.objective == pytest.approx(2)


@pytest.mark.parametrize("items, yes", [((3, 3, 4, 3, 3, 4), True),
                                        ((2, 4, 4, 3, 3, 4), True),
                                        ((3, 3, 3, 3, 3, 5), False)])
def test_three_partition_gadget(items, yes):
    chain, memory, beta = three_partition_chain(list(items))
    assert prop3_bound(chain, memory, beta) == 4  # LB = 2n
    assert fractional_bound(chain, memory, beta) == pytest.approx(4)
    assert solve_comm_dp(chain, memory, beta).value == pytest.approx(4)  # partial discards
    problem = OffloadProblem(chain, memory, chain_bandwidth=beta)
    exact = solve(problem, "cpsat")
    check(problem, exact)
    assert exact.status is Status.OPTIMAL
    assert (exact.objective == pytest.approx(4)) is yes  # OFF_int = 2n iff 3-Partition yes
    assert exact.objective >= 4 - 1e-9


# ------------------------------------------------------------------ cross-checks
def _all_methods(problem: OffloadProblem, exact: tuple[str, ...]) -> dict[str, object]:
    out = {}
    for name in (*HEURISTICS, *exact, "frac"):
        result = solve(problem, name)
        check(problem, result)
        out[name] = result
    return out


@pytest.mark.parametrize("seed", range(6))
def test_exact_equals_brute_force_on_tiny_chains(seed):
    chain = random_chain(2, seed=seed, max_size=6)
    lay = Layers.of(chain)
    low, high = int(math.ceil(lay.min_memory())), int(lay.peak())
    for memory in sorted({low, (low + high) // 2, high - 1}):
        for beta in (1.0, 2.0):
            problem = OffloadProblem(chain, memory, chain_bandwidth=beta)
            res = _all_methods(problem, ("cpsat", "ilp", "brute"))
            brute, exact = res["brute"], res["cpsat"]
            assert brute.status == exact.status == res["ilp"].status
            if brute.status is Status.OPTIMAL:
                assert exact.objective == pytest.approx(brute.objective)
                assert res["ilp"].objective == pytest.approx(brute.objective)
                _assert_order(res, exact.objective)


def _assert_order(res: dict, optimum: float) -> None:
    bound = res["frac"].bound
    assert bound <= optimum + 1e-9
    for name in HEURISTICS:
        if res[name].status.has_plan:
            assert optimum <= res[name].objective + 1e-9, name
            assert res[name].bound <= optimum + 1e-9


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 4), beta=st.sampled_from([1.0, 2.0, 3.0]),
       where=st.floats(0.0, 1.0))
def test_random_chains_bound_exact_heuristics(seed, n, beta, where):
    chain = random_chain(n, seed=seed, max_size=8)
    lay = Layers.of(chain)
    low, high = math.ceil(lay.min_memory()), int(lay.peak())
    memory = int(low + where * (high - low))
    problem = OffloadProblem(chain, memory, chain_bandwidth=beta)
    res = _all_methods(problem, ("cpsat", "ilp"))
    exact = res["cpsat"]
    assert exact.status in (Status.OPTIMAL, Status.INFEASIBLE)
    assert res["ilp"].status is exact.status
    if exact.status is Status.OPTIMAL:
        assert res["ilp"].objective == pytest.approx(exact.objective)
    if exact.status is Status.OPTIMAL:
        _assert_order(res, exact.objective)
        comm = solve_comm_dp(chain, memory, beta).value  # u * beta integral: exact DP
        assert comm <= exact.objective + 1e-9
        assert res["frac"].bound <= comm + 1e-9
    if memory >= high:
        assert res["dp"].objective == pytest.approx(chain.total_compute_time())
        assert res["greedy"].objective == pytest.approx(chain.total_compute_time())


def test_vdnn_conv_uses_stage_names():
    from optmem.solvers.offload import conv_stages

    chain = Chain.from_dict({
        "format": "optmem.chain/1", "input_size": 4, "stages": [
            {"name": "conv1", "fwd_time": 2, "bwd_time": 4, "output_size": 2, "saved_size": 4},
            {"name": "relu", "fwd_time": 1, "bwd_time": 1, "output_size": 2, "saved_size": 2},
            {"name": "fc", "fwd_time": 1, "bwd_time": 1, "output_size": 2, "saved_size": 2,
             "kind": "conv"}]})
    problem = OffloadProblem(chain, 16, chain_bandwidth=2.0)
    assert conv_stages(problem) == [0, 2]
    result = solve(problem, "vdnn_conv")
    check(problem, result)
    assert result.report["choice"].startswith("conv inputs")
    assert result.report["offload_set"] == [0, 2]


def test_ilp_export(tmp_path):
    from optmem.solvers.facade import export

    problem = OffloadProblem(worked_chain(), 14, chain_bandwidth=1.0)
    path = tmp_path / "offload.lp"
    export(problem, "ilp", str(path))
    assert "off0" in path.read_text()
    # a suffix the method cannot write is refused, nothing written (until stop 51 the offload
    # exporter wrote MPS text to any name: model.pb, model.txt)
    for name in ("model.pb", "model.pbtxt", "model.txt"):
        with pytest.raises(OptmemInputError, match="cannot tell the model format"):
            export(problem, "ilp", str(tmp_path / name))
        assert not (tmp_path / name).exists()


def test_remat_plan_with_offloaded_checkpoints_lowers_peak():
    """Issue 7 groundwork: a checkpoint a^1 (F_ck) and the input are offloaded and prefetched
    around a recomputation of stage 1; same makespan as the checkpoint plan, lower peak."""
    chain = worked_chain()
    plan = ["F_ck 1", "offload a 0", "F_all 2", "offload a 1", "F_all 3", "Loss", "B 3",
            "prefetch a 1", "B 2", "prefetch a 0", "F_all 1", "B 1"]
    sim = simulate_offload(chain, plan, 1.0)
    ref = simulate_checkpoint(chain, [op for op in plan if not op.startswith(("off", "pre"))])
    assert (sim.makespan, ref.makespan) == (20.0, 20.0)
    assert (sim.peak_memory, ref.peak_memory) == (14, 16)
    assert sim.idle_time == 0
    tight = simulate_offload(chain, plan, 1.0, 13)  # prefetch of a^1 waits for B 3's end
    assert (tight.makespan, tight.peak_memory, tight.idle_time) == (22.0, 12, 2.0)
    assert tight.link[2].start == tight.compute[4].end


@pytest.mark.parametrize("key", [(14, 2), (14, 1), (14, 4)])
def test_thesis_discretisation_variant(key):
    memory, beta = key
    problem = OffloadProblem(worked_chain(), memory, chain_bandwidth=beta)
    result = solve(problem, "dp:thesis")
    check(problem, result)
    assert result.variant == "thesis" and result.report["dp_runs"] >= 1
    # the set chosen on optimistically rounded sizes, valued on the true sizes
    assert result.report["comm_value"] == pytest.approx(WORKED[key][2], rel=0.02)
    with pytest.raises(OptmemInputError, match="unknown dp variant"):
        solve(problem, "dp:nope")


def test_brute_refuses_more_than_three_stages(monkeypatch):
    """Regression: ``brute`` accepted up to 6 stages (docs: L <= 3) and on 4 enumerated for
    minutes (``random_chain(4, seed=1)`` at 40 B: no answer in 120 s). It now refuses
    before any enumeration, as the remat + offload brute force does (CLI: exit 2)."""
    import optmem.solvers.offload_bruteforce as bruteforce

    def enumeration(*args, **kwargs):
        raise AssertionError("the enumeration started")

    monkeypatch.setattr(bruteforce, "brute_force_offload", enumeration)
    chain = random_chain(4, seed=1, max_size=6)
    problem = OffloadProblem(chain, 40, chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match="brute force is for L <= 3; got L = 4"):
        solve(problem, "brute")


def test_dp_variant_is_checked_and_kept_below_the_least_memory():
    """Regression: below the least memory ``dp`` answered ``infeasible`` before it read
    its variant: ``dp:nope`` was accepted there, and the rows of ``dp`` and ``dp:thesis``
    had no variant (``compare`` listed two rows named ``dp``). The variant is now checked
    first and the infeasible row carries it."""
    problem = OffloadProblem(worked_chain(), 1, chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match="unknown dp variant"):
        solve(problem, "dp:nope")
    for label, variant in (("dp", "contract"), ("dp:thesis", "thesis")):
        result = solve(problem, label)
        assert result.status is Status.INFEASIBLE and result.variant == variant



def test_hint_without_a_solvable_limit_names_the_slots():
    """Regression: with ``--slots 2`` no limit is solvable (every value takes a unit of
    half the limit) and the hint read ``(None B, as solved)`` (``random_chain(4, seed=1)``
    at 40 B). It now says that no limit fits with that many slots and to raise them;
    ``min_feasible_memory`` stays unknown (``None``)."""
    from optmem.result import SolveOptions

    problem = OffloadProblem(random_chain(4, seed=1, max_size=6), 40, chain_bandwidth=1.0)
    result = solve(problem, "dp", options=SolveOptions(slots=2))
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory is None
    assert "None" not in result.report["hint"] and "slots = 2" in result.report["hint"]


def test_hint_does_not_say_below_when_the_least_limit_is_smaller():
    """Regression: after rounding, feasibility is not monotone in the limit
    (``random_chain(5, seed=1707, max_size=8, integer_times=False)``, 2 B/ms, 7 slots: 48 B
    fits with a unit of 6, 49-55 B do not with a unit of 7). At 51 B the hint read "below the
    minimum memory of the store-all sequence with everything offloaded (48 B, as solved)",
    false at 51 > 48; it now says the smallest feasible memory is 48 B, as solved, as the
    checkpoint hint does."""
    from optmem.result import SolveOptions

    chain = random_chain(5, seed=1707, max_size=8, integer_times=False)
    result = solve(OffloadProblem(chain, 51, chain_bandwidth=2.0), "dp",
                   options=SolveOptions(slots=7))
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory == 48
    assert "below" not in result.report["hint"]
    assert "smallest feasible memory is 48 B" in result.report["hint"]


@pytest.mark.parametrize("limit", [0, 5, 12, 40])
def test_an_unknown_dp_variant_is_an_input_error_at_every_limit(limit):
    """``dp:bogus`` was ``infeasible`` (exit 0) below the least memory and an input error
    above it; the variant is now checked first, and an infeasible ``dp`` names its variant."""
    chain = Chain.from_lists([1, 2, 1, 3], [2, 3, 1, 2], [2, 3, 1, 2], [3, 4, 2, 5],
                             input_size=2, fwd_overhead=[0, 1, 0, 0],
                             bwd_overhead=[0, 0, 1, 0], loss_bwd_time=0.5)
    problem = OffloadProblem(chain, limit, chain_bandwidth=1.0)
    with pytest.raises(OptmemInputError, match="field 'variant'"):
        solve(problem, "dp:bogus")
    result = solve(problem, "dp:thesis")
    assert result.variant == "thesis"
    assert result.status is (Status.INFEASIBLE if limit < 12 else Status.FEASIBLE)


@pytest.mark.parametrize("method", ["dp", "greedy", "brute", "ilp", "cpsat"])
def test_no_link_hint_is_the_store_all_peak(method: str) -> None:
    """At bandwidth 0 (no link) ``min_feasible_memory`` is a limit with a plan (section 14).

    Before: the hint was the least memory with everything offloaded (22), at which no
    method finds a plan without a link (the store-all peak, 31, is the least).
    """
    chain = Chain.from_lists([1.0, 2.0, 1.0], [2.0, 3.0, 2.0], [4, 4, 4], [8, 6, 5],
                             input_size=4)
    result = solve(OffloadProblem(chain, 20, bandwidth=0), method, threads=1)
    assert result.status is Status.INFEASIBLE
    assert result.min_feasible_memory == chain.store_all_peak() == 31
    again = solve(OffloadProblem(chain, result.min_feasible_memory, bandwidth=0), method,
                  threads=1)
    assert again.status.has_plan


@pytest.mark.parametrize("method", ["vdnn", "vdnn_conv", "offload_all"])
def test_no_link_heuristics_that_always_offload_name_no_limit(method: str) -> None:
    """Their plans always offload, so at bandwidth 0 no limit gives them one: they named the
    store-all peak (31) and answered ``no_solution`` there. Found by the stop-52 hunt."""
    chain = Chain.from_lists([1.0, 2.0, 1.0], [2.0, 3.0, 2.0], [4, 4, 4], [8, 6, 5],
                             input_size=4)
    result = solve(OffloadProblem(chain, 20, bandwidth=0), method, threads=1)
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory is None
    assert "always offloads" in result.report["hint"]
    for limit in (31, 100):  # the store-all peak and above: still no plan
        assert not solve(OffloadProblem(chain, limit, bandwidth=0), method).status.has_plan
