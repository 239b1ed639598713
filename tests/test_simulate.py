"""The checkpoint simulator: hand-computed peaks and makespans, invalid plans (index, reason)."""

from __future__ import annotations

import pytest

from optmem.chain import Chain
from optmem.errors import PlanError
from optmem.plan import TransferOp, from_rotor_sequence, load_plan, parse_plan
from optmem.simulate import simulate_checkpoint
from optmem.simulate.checkpoint import value_size
from optmem.solvers import checkpoint_baselines as base

# H1 of rotor.md section 8 (O3), rotor convention
H1 = Chain.from_rotor([2, 3, 1, 4], [3, 5, 2, 6, 0], [2, 3, 1, 2, 3], [2, 5, 2, 4, 5],
                      [1, 0, 2, 1], [1, 2, 0, 1, 0])
# Two stages with distinct sizes so that every term of a peak is identifiable.
TWO = Chain.from_lists([1.0, 10.0], [100.0, 1000.0], [3, 5], [7, 11], input_size=2,
                       fwd_overhead=[13, 17], bwd_overhead=[19, 23], loss_bwd_time=0.5,
                       loss_bwd_overhead=29)


def test_store_all_by_hand() -> None:
    plan = ["F_all 1", "F_all 2", "Loss", "B 2", "B 1"]
    sim = simulate_checkpoint(TWO, plan)
    # a0=2, abar1=7, abar2=11, a2 = delta2 = 5, delta1 = 3, delta0 = 2
    peaks = [
        2 + 7 + 13,  # F_all 1: a0 + abar1 + of1
        2 + 7 + 11 + 17,  # F_all 2: a0 + abar1 + abar2 + of2
        2 + 7 + 11 + 5 + 29,  # Loss: stored + delta2 + loss overhead (abar2 is a tape: kept)
        2 + 7 + 11 + 5 + 3 + 23,  # B 2: stored + delta1 + ob2, frees delta2, abar2
        2 + 7 + 3 + 2 + 19,  # B 1: a0 + abar1 + delta1 + delta0 + ob1
    ]
    assert [s.peak for s in sim.timeline] == peaks
    assert sim.peak_memory == max(peaks) == 54
    assert sim.makespan == 1 + 10 + 0.5 + 1000 + 100
    assert [s.after for s in sim.timeline] == [9, 20, 25, 12, 2]  # a0 is never freed
    assert sim.timeline[3].start == 11.5 and sim.timeline[3].end == 1011.5
    assert sim.peak_index == 2


def test_recompute_plan_by_hand() -> None:
    # F_ck 1 keeps a0, F_none 2 consumes a1; Loss consumes a2; recompute a1 for B 2
    plan = ["F_ck 1", "F_none 2", "Loss", "F_ck 1", "F_all 2", "B 2", "F_all 1", "B 1"]
    sim = simulate_checkpoint(TWO, plan)
    peaks = [
        2 + 3 + 13,  # F_ck 1
        2 + 3 + 5 + 17,  # F_none 2: input counted during the op
        2 + 5 + 5 + 29,  # Loss with a2 stored, then a2 freed
        2 + 5 + 3 + 13,  # F_ck 1 while delta2 held
        2 + 5 + 3 + 11 + 17,  # F_all 2
        2 + 5 + 3 + 11 + 3 + 23,  # B 2: frees a1 (a plain activation), delta2, abar2
        2 + 3 + 7 + 13,  # F_all 1 with delta1 held
        2 + 3 + 7 + 2 + 19,  # B 1
    ]
    assert [s.peak for s in sim.timeline] == peaks
    assert [s.after for s in sim.timeline] == [5, 7, 7, 10, 21, 5, 12, 2]
    assert sim.makespan == 1 + 10 + 0.5 + 1 + 10 + 1000 + 1 + 100


def test_h1_golden_sequence() -> None:
    plan = from_rotor_sequence("CF_0 Fn_1 CF_2 Fe_3 L B_3 Fe_2 B_2 Fe_0 Fe_1 B_1 B_0", 4)
    sim = simulate_checkpoint(H1, plan, 16)
    assert (sim.makespan, sim.peak_memory) == (32, 16)
    with pytest.raises(PlanError, match=r"op 5: B 4 needs 16 memory, above the limit 15"):
        simulate_checkpoint(H1, plan, 15)


def test_tape_input_kept_by_backward() -> None:
    # F_all 1 stores abar1; B 2 consumes a^1 in tape form but keeps the tape for B 1
    sim = simulate_checkpoint(TWO, ["F_all 1", "F_all 2", "Loss", "B 2", "B 1"])
    assert sim.timeline[3].after == 2 + 7 + 3


@pytest.mark.parametrize(("plan", "index", "reason"), [
    (["F_all 2"], 0, "F_all 2 needs a^1 in memory"),
    (["F_all 1", "B 1"], 1, "B 1 needs delta^1 in memory"),
    (["F_ck 1", "F_none 2", "Loss", "B 2"], 3, "B 2 needs abar^2 in memory"),
    (["F_ck 1", "F_all 2", "Loss", "B 2", "B 1"], 4, "B 1 needs abar^1 in memory"),
    (["Loss"], 0, "Loss needs a^2 in memory"),
    (["F_all 1", "F_all 2", "Loss", "Loss"], 3, "Loss runs twice"),
    # after B 2, delta^2 is gone: a second Loss was accepted until stop 51, and the torch
    # executor then failed mid-backward ("Loss needs a^-1")
    (["F_all 1", "F_all 2", "Loss", "B 2", "F_ck 2", "Loss"], 5, "Loss runs twice"),
    (["F_none 1"], 0, "consume the chain input a^0"),
    (["F_ck 3"], 0, "stage 3 out of range 1..2"),
    (["F_all 1", "F_all 2", "Loss", "B 2"], 4, "ends before B 1 has run"),
    (["F_all 1", "F_all 2", "Loss", "B 2", "B 1", "F_ck 1"], 5, "after the last backward"),
])
def test_invalid_plans_name_index_and_reason(plan, index, reason) -> None:
    with pytest.raises(PlanError) as info:
        simulate_checkpoint(TWO, plan)
    assert info.value.index == index
    assert reason in str(info.value)
    assert str(info.value).startswith(f"op {index}: ")


def test_no_duplicate_rule() -> None:
    # a^1 is stored by F_ck 1; producing it again (in either form) is refused
    with pytest.raises(PlanError, match=r"op 1: F_ck 1 would duplicate a\^1"):
        simulate_checkpoint(TWO, ["F_ck 1", "F_ck 1"])
    with pytest.raises(PlanError, match=r"op 1: F_all 1 would duplicate a\^1"):
        simulate_checkpoint(TWO, ["F_ck 1", "F_all 1"])
    with pytest.raises(PlanError, match=r"op 1: F_ck 1 would duplicate abar\^1"):
        simulate_checkpoint(TWO, ["F_all 1", "F_ck 1"])


def test_pinning_rule() -> None:
    """The F_all-then-F_none trick of rotor.md 2.1 (free a^{l-1} while abar^l lives) is refused."""
    chain = Chain.from_rotor([4, 3, 0, 5], [0, 1, 0, 0, 0], [1, 2, 0, 2, 3], [0, 6, 0, 2, 3],
                             [0, 8, 1, 0], [0] * 5)
    trick = from_rotor_sequence("CF_0 Fe_1 Fn_1 Fe_2 Fe_3 L B_3 B_2 Fe_0 B_1 B_0", 4)
    with pytest.raises(PlanError) as info:
        simulate_checkpoint(chain, trick)
    assert info.value.index == 2
    assert "abar^2" in str(info.value)


def test_pinning_rule_at_a_backward() -> None:
    """``B i`` frees ``abar^i``, which holds ``a^i``: refused while a tape ``abar^{i+1}``
    made again after ``B i+1`` is alive (a torch step of such a plan held ``a^i`` through
    that tape, one activation above the replayed peak; found by a hunt in stop 51)."""
    plan = ["F_all 1", "F_all 2", "Loss", "B 2", "F_all 2", "B 1"]
    with pytest.raises(PlanError) as info:
        simulate_checkpoint(TWO, plan)
    assert info.value.index == 5
    assert "B 1 would free a^1, the input of stage 2, while abar^2 is alive" in str(info.value)
    # a plain output made again (no tape) pins nothing: accepted, its memory counted
    sim = simulate_checkpoint(TWO, ["F_all 1", "F_all 2", "Loss", "B 2", "F_ck 2", "B 1"])
    assert sim.timeline[-1].after == value_size(TWO, ("a", 2)) + value_size(TWO, ("delta", 0))


def test_limit_is_checked_per_op() -> None:
    plan = ["F_all 1", "F_all 2", "Loss", "B 2", "B 1"]
    assert simulate_checkpoint(TWO, plan, 54).peak_memory == 54
    with pytest.raises(PlanError, match="op 2: Loss needs 54 memory, above the limit 53"):
        simulate_checkpoint(TWO, plan, 53)


def test_plan_parsing_and_files(tmp_path) -> None:
    with pytest.raises(PlanError, match=r"op 1: unknown op kind 'F_foo'"):
        parse_plan(["F_all 1", "F_foo 2"])
    with pytest.raises(PlanError, match="op 0: bad stage"):
        parse_plan(["F_all 0"])
    with pytest.raises(PlanError, match="op 2: cannot parse"):
        parse_plan(["F_all 1", "Loss", "B"])
    # digits that are not ASCII: "²" was a raw ValueError from int(), "١" read as 1 (stop 51)
    for text in ("F_all ²", "B ١"):
        with pytest.raises(PlanError, match="op 0: bad stage"):
            parse_plan([text])
    for text in ("offload a ²", "prefetch abar ١"):
        with pytest.raises(PlanError, match="bad index"):
            TransferOp.parse(text)
    with pytest.raises(PlanError, match="cannot parse rotor op"):
        from_rotor_sequence("Fe_² L", 1)
    path = tmp_path / "plan.json"
    path.write_text('{"plan": ["F_all 1", "F_all 2", "Loss", "B 2", "B 1"], "objective": 1}')
    assert simulate_checkpoint(TWO, load_plan(path)).peak_memory == 54
    path.write_text('["F_all 1", 7]')
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert str(path) in str(info.value) and "op 1" in str(info.value)


@pytest.mark.parametrize("length", [1, 2, 5, 9])
def test_baseline_plans_simulate(length: int) -> None:
    chain = Chain.from_lists([1.0] * length, [2.0] * length, [1] * length, [2] * length,
                             input_size=1)
    store = simulate_checkpoint(chain, base.store_all_plan(length))
    assert store.makespan == 3 * length
    assert store.peak_memory == 1 + 2 * length + 1 + 1  # a0 + tapes + delta_L + delta_{L-1}
    recompute = simulate_checkpoint(chain, base.recompute_all_plan(length))
    assert recompute.makespan == 3 * length + length * (length + 1) / 2


def test_verify_plan_takes_a_checkpoint_problem_as_optmem_verify_does():
    """``verify_plan`` raised "no plan verifier for CheckpointProblem" (only ``optmem
    verify`` replayed checkpoint plans): the Python API accepted less than the CLI."""
    from optmem.problems import CheckpointProblem
    from optmem.simulate.verify import verify_plan
    from optmem.solvers.facade import solve

    chain = Chain.from_rotor([2, 3, 1, 4], [3, 5, 2, 6, 0], [2, 3, 1, 2, 3], [2, 5, 2, 4, 5],
                             [1, 0, 2, 1], [1, 2, 0, 1, 0])
    problem = CheckpointProblem(chain, 18)
    solved = solve(problem, "dp")
    report = verify_plan(problem, solved.to_json())
    assert report == {"objective": solved.objective, "peak_memory": solved.peak_memory,
                      "memory_limit": 18, "unit": 1, "ops": len(solved.plan)}
    assert verify_plan(problem, list(solved.plan)) == report
    coarse = CheckpointProblem(chain, 2**20)  # unit 2**20 // 500: replayed as solved
    assert verify_plan(coarse, ["F_all 1", "F_all 2", "F_all 3", "F_all 4", "Loss", "B 4",
                                "B 3", "B 2", "B 1"])["unit"] == 2**20 // 500
    with pytest.raises(PlanError, match="above the limit 17"):
        verify_plan(CheckpointProblem(chain, 17), list(solved.plan))
