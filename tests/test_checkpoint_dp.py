"""Checkpoint DPs: golden oracles of rotor.md section 8, brute force, simulator, properties."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.datasets.synthetic import counterexample_chain, partition_chain, random_chain
from optmem.plan import OpKind, from_rotor_sequence
from optmem.problems import CheckpointProblem
from optmem.result import SolveOptions, Status
from optmem.simulate import simulate_checkpoint
from optmem.solvers import checkpoint_baselines as base
from optmem.solvers.checkpoint_bruteforce import brute_force_checkpoint
from optmem.solvers.checkpoint_dp import min_memory_persistent, solve_persistent_table
from optmem.solvers.checkpoint_floating import FloatingTable, solve_floating
from optmem.solvers.facade import solve
from optmem.testing import assert_plan_valid

GOLDEN = Path(__file__).parent / "golden"


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"checkpoint_{name}.json").read_text())


def rotor_chain(data: dict) -> Chain:
    return Chain.from_rotor(**data["chain"])


def persistent(chain: Chain, limit: int, variant: str = "paper") -> float:
    """Persistent DP value for a limit that includes a^0 (inf when infeasible)."""
    budget = limit - chain.input_size
    if budget < 0:
        return math.inf
    return solve_persistent_table(chain, budget, variant).value()


def floating(chain: Chain, limit: int, printed: bool = False) -> float:
    return solve_floating(chain, limit, printed=printed)[0]


def brute(chain: Chain, limit: int) -> float:
    found = brute_force_checkpoint(chain, limit)
    return math.inf if found is None else found[0]


def assert_plan_replays(chain: Chain, plan, value: float, limit: int | None) -> None:
    """The simulator reproduces the DP value; each F_all and B runs exactly once."""
    sim = simulate_checkpoint(chain, plan, limit)
    assert sim.makespan == pytest.approx(value, rel=1e-12, abs=1e-12)
    if limit is not None:
        assert sim.peak_memory <= limit
    kinds = [(op.kind, op.stage) for op in plan]
    for i in range(1, chain.length + 1):
        assert kinds.count((OpKind.F_ALL, i)) == 1
        assert kinds.count((OpKind.B, i)) == 1
    assert kinds.count((OpKind.LOSS, 0)) == 1


# ------------------------------------------------------------------ golden oracles
O1 = golden("o1_counterexample")


@pytest.mark.parametrize("case", O1["cases"], ids=lambda c: f"n={c['n']}")
def test_o1_counterexample_family(case: dict) -> None:
    n, memory = case["n"], O1["memory"]
    chain = counterexample_chain(n)
    assert persistent(chain, memory, "paper") == case["persistent"] == 3 * n - 2
    assert persistent(chain, memory, "rotor") == case["persistent"]
    value, plan, _ = solve_floating(chain, memory)
    assert value == case["floating"] == min(3 * n - 2, 2 * n + 2)
    assert_plan_replays(chain, plan, value, memory)
    assert floating(chain, memory, printed=True) >= value


@pytest.mark.parametrize("n", [3, 4])
def test_o1_brute_force_confirms_exact(n: int) -> None:
    case = next(c for c in O1["cases"] if c["n"] == n)
    assert brute(counterexample_chain(n), O1["memory"]) == case["exact"]


def test_o1_rotor_sequence_peaks_at_limit() -> None:
    chain = counterexample_chain(4)
    plan = from_rotor_sequence(O1["rotor_sequence_n4"], chain.length)
    sim = simulate_checkpoint(chain, plan, O1["memory"])
    assert sim.peak_memory == O1["rotor_sequence_n4_peak"]
    assert sim.makespan == 10


O2 = golden("o2_partition")


@pytest.mark.parametrize("case", O2["cases"], ids=lambda c: "-".join(map(str, c["values"])))
def test_o2_partition_gadget(case: dict) -> None:
    chain, memory, bound = partition_chain(case["values"])
    assert bound == case["T"]
    for variant in ("paper", "rotor"):
        assert persistent(chain, memory, variant) == case["optimum"]
    value, plan, _ = solve_floating(chain, memory)
    assert value == case["optimum"]
    assert_plan_replays(chain, plan, value, memory)
    assert (value <= bound) == case["partition"]


@pytest.mark.parametrize("values", [[1, 1], [1, 3]])
def test_o2_brute_force(values: list[int]) -> None:
    case = next(c for c in O2["cases"] if c["values"] == values)
    chain, memory, _ = partition_chain(values)
    assert brute(chain, memory) == case["optimum"]


@pytest.mark.parametrize("name", ["o3_h1", "o4_u6", "o5_trivial"])
def test_tables_h1_u6_t1(name: str) -> None:
    data = golden(name)
    chain = rotor_chain(data)
    expected = {int(m): v for m, v in data["optimum"].items()}
    top = max(expected)
    for memory in range(0, top + 1):
        want = expected.get(memory)
        if memory <= data["infeasible_up_to"]:
            want = math.inf
        elif want is None:  # between two listed limits: the value of the last one below
            want = expected[max(m for m in expected if m < memory)]
        got = {
            "paper": persistent(chain, memory, "paper"),
            "rotor": persistent(chain, memory, "rotor"),
            "floating": floating(chain, memory),
            "printed": floating(chain, memory, printed=True),
        }
        assert got == dict.fromkeys(got, want), memory
    if "store_all" in data:
        sim = simulate_checkpoint(chain, base.store_all_plan(chain.length))
        assert (sim.makespan, sim.peak_memory) == (data["store_all"]["makespan"],
                                                   data["store_all"]["peak"])


@pytest.mark.parametrize("name", ["o3_h1", "o4_u6", "o5_trivial"])
def test_golden_sequences_are_the_rotor_plans(name: str) -> None:
    data = golden(name)
    chain = rotor_chain(data)
    for memory, text in data["sequences"].items():
        limit = int(memory)
        plan = from_rotor_sequence(text, chain.length)
        table = solve_persistent_table(chain, limit - chain.input_size, "rotor")
        assert table.plan() == plan
        assert_plan_replays(chain, plan, data["optimum"][memory], limit)


@pytest.mark.parametrize("memory", [15, 17, 20, 24])
def test_o3_brute_force(memory: int) -> None:
    data = golden("o3_h1")
    assert brute(rotor_chain(data), memory) == data["optimum"][str(memory)]


def test_o6_opt0_table() -> None:
    data = golden("o6_opt0")
    table = base.revolve_table(10, 8, 1.0, 1.0)
    got = table[:, data["columns_m"][0]:data["columns_m"][-1] + 1]
    np.testing.assert_array_equal(got, np.array(data["rows"], dtype=float))
    assert table[0, 2] == 1 and np.all(np.isinf(table[1:, 2]))


def test_o6_binomial_closed_form() -> None:
    """rotor.md 4.2: Opt_0 - (l+1) = r (l+1) - C(c+r, c+1), c = m-2, r least: C(c+r, c) >= l+1."""
    table = base.revolve_table(30, 10, 1.0, 1.0)
    for ell in range(0, 31):
        for m in range(3, 11):
            c, length = m - 2, ell + 1
            r = 0
            while math.comb(c + r, c) < length:
                r += 1
            forwards = r * length - math.comb(c + r, c + 1)
            assert table[ell, m] - length == forwards, (ell, m)


def test_rotor_variant_is_occasionally_too_loose() -> None:
    data = golden("rotor_variant")
    chain, memory = rotor_chain(data), data["memory"]
    table = solve_persistent_table(chain, memory - chain.input_size, "rotor")
    assert table.value() == data["rotor"]["value"]
    plan = table.plan()
    assert plan == from_rotor_sequence(data["rotor"]["sequence"], chain.length)
    sim = simulate_checkpoint(chain, plan)
    assert (sim.makespan, sim.peak_memory) == (data["rotor"]["value"], data["rotor"]["peak"])
    assert persistent(chain, memory, "paper") == data["paper"]
    assert floating(chain, memory) == data["exact"]
    assert brute(chain, memory) == data["exact"]
    # the facade never reports an over-limit plan as a solution
    result = solve(CheckpointProblem(chain, memory), "dp:rotor")
    assert result.status is Status.ERROR and result.peak_memory == data["rotor"]["peak"]
    assert solve(CheckpointProblem(chain, memory), "dp").objective == data["paper"]


# ------------------------------------------------------------------ brute force oracle
TINY = [(seed, 2 + seed % 3) for seed in range(12)]


@pytest.mark.parametrize(("seed", "n"), TINY)
def test_floating_equals_brute_force_on_tiny_chains(seed: int, n: int) -> None:
    chain = random_chain(n, seed=seed, max_size=6)
    for memory in range(chain.input_size, chain.store_all_peak() + 2, 2 if n == 4 else 1):
        exact = brute(chain, memory)
        value, plan, _ = solve_floating(chain, memory)
        assert value == exact, memory
        if plan is not None:
            assert_plan_replays(chain, plan, value, memory)
        assert floating(chain, memory, printed=True) >= value
        assert persistent(chain, memory) >= value


def test_printed_floating_misses_a_case() -> None:
    """Findings item 1: without C3 the printed recurrence is worse than the optimum here."""
    chain, memory = random_chain(4, seed=37, max_size=6), 32
    assert floating(chain, memory, printed=True) == 31
    value, plan, _ = solve_floating(chain, memory)
    assert value == 30 == brute(chain, memory)
    # the optimum moves the floating checkpoint a^1 -> a^2 with F_none, then F_all 3
    text = [str(op) for op in plan]
    assert text[text.index("B 4") + 1:text.index("B 4") + 3] == ["F_none 2", "F_all 3"]


def test_printed_safety_check_only_removes_options() -> None:
    """The check added to the printed thresholds (module docstring) prunes inner cells only."""
    chain = Chain.from_rotor([20, 0, 1, 0, 0, 1], [1, 1, 0, 1, 1, 0, 1],
                             [1, 12, 12, 1, 12, 1, 12], [0, 12, 12, 1, 13, 1, 12],
                             [0, 0, 0, 8, 4, 0], [0] * 7)
    budget = chain.store_all_peak() - chain.input_size
    literal = FloatingTable(chain, budget, printed=True, literal=True)
    safe = FloatingTable(chain, budget, printed=True)
    assert np.all(literal.cost <= safe.cost) and np.any(literal.cost < safe.cost)
    assert literal.value() == safe.value()


# ------------------------------------------------------------------ plans replay
@pytest.mark.parametrize("seed", range(6))
def test_every_dp_plan_replays(seed: int) -> None:
    chain = random_chain(7, seed=100 + seed, max_size=20)
    low = min_memory_persistent(chain)
    for memory in np.linspace(low, chain.store_all_peak(), 6).astype(int):
        for variant in ("paper", "rotor"):
            table = solve_persistent_table(chain, int(memory) - chain.input_size, variant)
            assert math.isfinite(table.value())
            limit = int(memory) if variant == "paper" else None  # rotor may exceed it
            assert_plan_replays(chain, table.plan(), table.value(), limit)
        for printed in (False, True):
            value, plan, _ = solve_floating(chain, int(memory), printed=printed)
            assert_plan_replays(chain, plan, value, int(memory))


def test_facade_floating_matches_module() -> None:
    chain = random_chain(5, seed=9)
    memory = (min_memory_persistent(chain) + chain.store_all_peak()) // 2
    problem = CheckpointProblem(chain, memory)
    for variant, printed in (("floating", False), ("floating-printed", True)):
        result = solve(problem, "dp", options=SolveOptions(variant=variant))
        assert result.status is Status.OPTIMAL
        assert_plan_valid(problem, result)
        assert result.objective == floating(chain, memory, printed)
        assert result.report["model"] == "floating"
    below = solve(CheckpointProblem(chain, chain.input_size - 1), "dp:floating")
    assert below.status is Status.INFEASIBLE


# ------------------------------------------------------------------ properties
chains = st.builds(
    lambda n, seed, size: random_chain(n, seed=seed, max_size=size),
    st.integers(1, 6), st.integers(0, 10**6), st.sampled_from([4, 10, 30]),
)


@settings(max_examples=40, deadline=None)
@given(chains)
def test_persistent_monotone_in_memory(chain: Chain) -> None:
    top = chain.store_all_peak() + 3
    for variant in ("paper", "rotor"):
        table = solve_persistent_table(chain, top - chain.input_size, variant)
        row = table.cost[1, chain.length + 1]
        assert np.all(row[1:] <= row[:-1])
        if variant == "paper":  # store-all once the limit reaches its peak
            assert row[-1] == pytest.approx(chain.total_compute_time())


@settings(max_examples=25, deadline=None)
@given(st.builds(lambda n, seed: random_chain(n, seed=seed, max_size=8),
                 st.integers(1, 5), st.integers(0, 10**6)))
def test_floating_monotone_and_below_persistent(chain: Chain) -> None:
    previous = math.inf
    for memory in range(chain.input_size, chain.store_all_peak() + 2):
        value = floating(chain, memory)
        assert value <= previous
        assert value <= persistent(chain, memory)
        assert value <= floating(chain, memory, printed=True)
        previous = value
    assert previous == pytest.approx(chain.total_compute_time())


@settings(max_examples=40, deadline=None)
@given(chains)
def test_paper_never_worse_than_rotor_when_rotor_fits(chain: Chain) -> None:
    top = chain.store_all_peak() + 1
    paper = solve_persistent_table(chain, top - chain.input_size, "paper")
    rotor = solve_persistent_table(chain, top - chain.input_size, "rotor")
    for memory in range(chain.input_size, top + 1):
        budget = memory - chain.input_size
        if not math.isfinite(rotor.value(budget)):
            continue
        if simulate_checkpoint(chain, rotor.plan(budget)).peak_memory <= memory:
            assert paper.value(budget) <= rotor.value(budget)


@settings(max_examples=30, deadline=None)
@given(chains, st.sampled_from([0.5, 2.0, 4.0]), st.integers(1, 4))
def test_scale_invariance(chain: Chain, time: float, memory_scale: int) -> None:
    big = chain.scaled(time=time, memory=memory_scale)
    for memory in (min_memory_persistent(chain), chain.store_all_peak()):
        for variant in ("paper", "rotor"):
            assert persistent(big, memory * memory_scale, variant) == \
                time * persistent(chain, memory, variant)
    if chain.length <= 4:
        memory = min_memory_persistent(chain)
        assert floating(big, memory * memory_scale) == time * floating(chain, memory)
    # through the facade: with S = M slots the scaled instance discretises back to the original
    memory = max(chain.store_all_peak() // 2, min_memory_persistent(chain))
    options = SolveOptions(slots=memory)
    small = solve(CheckpointProblem(chain, memory), "dp", options=options)
    large = solve(CheckpointProblem(big, memory * memory_scale), "dp", options=options)
    assert (small.unit, large.unit) == (1, memory_scale)
    assert large.memory_limit == small.memory_limit == memory
    assert large.objective == time * small.objective
    assert large.plan == small.plan


@settings(max_examples=40, deadline=None)
@given(chains)
def test_infeasible_exactly_below_min_memory(chain: Chain) -> None:
    for variant in ("paper", "rotor"):
        low = min_memory_persistent(chain, variant)
        assert math.isinf(persistent(chain, low - 1, variant))
        assert math.isfinite(persistent(chain, low, variant))
    low = min_memory_persistent(chain)
    result = solve(CheckpointProblem(chain, low - 1), "dp")
    assert result.status is Status.INFEASIBLE and result.min_feasible_memory == low
    assert solve(CheckpointProblem(chain, low), "dp").status is Status.OPTIMAL


@settings(max_examples=25, deadline=None)
@given(chains, st.floats(0.0, 1.0))
def test_baselines_never_beat_the_dp(chain: Chain, where: float) -> None:
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    memory = int(low + where * (high - low))
    best = persistent(chain, memory)
    assert math.isfinite(best)
    plans = [base.store_all_plan(chain.length), base.recompute_all_plan(chain.length),
             base.chen_plan(chain.length)]
    plans += [plan for _, plan in base.sequential_plans(chain.length)]
    plans += [base.revolve_plan(chain.length, slots) for slots in range(3, chain.length + 3)]
    for plan in plans:
        sim = simulate_checkpoint(chain, plan)
        if sim.peak_memory <= memory:
            assert sim.makespan >= best - 1e-9
