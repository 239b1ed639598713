"""Min-peak (Hong et al.): DPs vs brute force vs ILP, the paper's sets, the digest's oracles."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.cli_problems import add_min_peak_options, min_peak_from_cli
from optmem.datasets.synthetic import random_chain
from optmem.errors import OptmemInputError, PlanError
from optmem.problems.min_peak import MinPeakProblem, checkpoint_plan, checkpoints_of_plan
from optmem.result import SolveOptions, Status
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.simulate.min_peak import (
    model_peak,
    pytorch_checkpoint_memory,
    pytorch_peak,
    pytorch_trace,
    static_cost,
    static_trace,
)
from optmem.simulate.verify import verify_plan
from optmem.solvers.checkpoint_baselines import segments_plan
from optmem.solvers.checkpoint_dp import min_memory_persistent
from optmem.solvers.facade import solve
from optmem.solvers.min_peak import chen_checkpoints
from optmem.solvers.min_peak_dp import (
    linear_min_peak,
    quadratic_min_peak,
    static_min_peak,
)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "hong_checkpoint_sets.json").read_text())


def chain_of(sizes: list[int], name: str = "hong") -> Chain:
    """A chain whose Hong sizes are ``sizes`` (d_0 = input), times 1 forward, 2 backward."""
    n = len(sizes) - 1
    return Chain.from_lists([1.0] * n, [2.0] * n, sizes[1:], sizes[1:], input_size=sizes[0],
                            name=name)


def brute(d: list[int], f) -> int:
    n = len(d) - 1
    return min(f(d, (0, *inner, n)) for r in range(n)
               for inner in itertools.combinations(range(1, n), r))


def full(cps: list[int]) -> tuple[int, ...]:
    return tuple(sorted({0, *cps}))


# ------------------------------------------------------------------ golden: the paper's sets
class TestVgg19:
    inst = GOLDEN["instances"]["vgg19"]
    d = inst["sizes"]

    def test_static_dp_returns_the_papers_alg3_set(self) -> None:
        assert static_min_peak(self.d) == (self.inst["static_optimum"],
                                           full(self.inst["paper_sets"]["alg3"]))
        assert static_cost(self.d, full(self.inst["paper_sets"]["acg"])) == \
            self.inst["static_optimum"]

    def test_pytorch_dps_reach_the_papers_alg6_peak(self) -> None:
        opt = self.inst["pytorch_optimum"]
        assert linear_min_peak(self.d)[0] == opt
        assert quadratic_min_peak(self.d)[0] == opt
        paper = full(self.inst["paper_sets"]["alg6"])
        assert pytorch_peak(self.d, paper) == opt  # the published set is optimal
        assert max(pytorch_trace(self.d, paper)) == opt
        memory = pytorch_checkpoint_memory(self.d, paper)
        assert {str(k): v for k, v in memory.items()} == self.inst["alg6_checkpoint_memory"]

    def test_other_sets_and_ignore_input(self) -> None:
        sets = {**{k: full(v) for k, v in self.inst["paper_sets"].items()},
                "every": tuple(range(25)), "none": (0, 24)}
        for name, peak in self.inst["pytorch_peak_of"].items():
            assert pytorch_peak(self.d, sets[name]) == peak, name
        assert linear_min_peak([0, *self.d[1:]])[0] == self.inst["pytorch_optimum_ignore_input"]
        assert chen_checkpoints(24) == full(self.inst["paper_sets"]["sqrt"])

    def test_facade_and_cli_problem(self) -> None:
        chain = chain_of(self.d, "vgg19")
        r = solve(MinPeakProblem(chain, model="static"), "dp")
        assert r.status is Status.OPTIMAL and r.objective == self.inst["static_optimum"]
        assert r.report["checkpoints"] == [0, 3, 6, 24]
        r = solve(MinPeakProblem(chain), "dp")
        assert r.objective == r.bound == r.peak_memory == self.inst["pytorch_optimum"]
        # the op plan is the checkpoint set, replayable by the checkpoint simulator
        assert checkpoints_of_plan(r.plan, 24) == tuple(r.report["checkpoints"])
        sim = simulate_checkpoint(chain, r.plan)
        assert r.report["checkpoint_plan_makespan"] == sim.makespan
        r = solve(MinPeakProblem(chain, count_input=False), "dp:quadratic")
        assert r.objective == self.inst["pytorch_optimum_ignore_input"]

    def test_ilp_matches(self) -> None:
        pytest.importorskip("pulp", reason="the ILP needs PuLP (optmem[engines])")
        chain = chain_of(self.d, "vgg19")
        r = solve(MinPeakProblem(chain), "ilp")
        assert r.status is Status.OPTIMAL and r.objective == self.inst["pytorch_optimum"]


def test_alexnet_extended() -> None:
    inst = GOLDEN["instances"]["alexnet_ext"]
    d = inst["sizes"]
    assert linear_min_peak(d)[0] == inst["pytorch_optimum"]
    assert linear_min_peak([0, *d[1:]])[0] == inst["pytorch_optimum_ignore_input"]
    assert pytorch_peak(d, full(inst["paper_sets"]["alg6"])) == inst["pytorch_optimum"]
    assert pytorch_peak(d, full(inst["paper_sets"]["alg3"])) == inst["pytorch_peak_of"]["alg3"]
    value, cps = static_min_peak(d)
    assert value == inst["static_optimum"]
    assert list(cps[1:]) in inst["static_optimal_sets"]
    assert chen_checkpoints(15) == full(inst["paper_sets"]["sqrt"])


# ------------------------------------------------------------------ digest A.4.1-A.4.3
def test_smallest_instance_where_models_disagree() -> None:
    d = [1, 1, 1, 3, 1]
    table = {(0, 4): (7, 10), (0, 1, 4): (7, 10), (0, 2, 4): (6, 9), (0, 3, 4): (7, 8),
             (0, 1, 2, 4): (7, 10), (0, 1, 3, 4): (7, 9), (0, 2, 3, 4): (7, 9),
             (0, 1, 2, 3, 4): (7, 10)}
    for cps, (static, dynamic) in table.items():
        assert static_cost(d, cps) == max(static_trace(d, cps)) == static
        assert pytorch_peak(d, cps) == max(pytorch_trace(d, cps)) == dynamic
    assert pytorch_checkpoint_memory(d, (0, 3, 4)) == {3: 7, 4: 8}
    assert static_min_peak(d) == (6, (0, 2, 4))
    assert linear_min_peak(d) == quadratic_min_peak(d) == (8, (0, 3, 4))


@pytest.mark.parametrize("n", range(1, 13))
def test_uniform_chain_closed_forms(n: int) -> None:
    d = [1] * (n + 1)
    dynamic = next(v for v in itertools.count(3) if (v - 1) * (v - 2) // 2 >= n)
    static = min(m + 2 + math.ceil((n - 1 - m) / (m + 1)) for m in range(n))
    assert linear_min_peak(d)[0] == quadratic_min_peak(d)[0] == dynamic
    assert static_min_peak(d)[0] == static
    if n == 10:
        assert pytorch_peak(d, (0, 4, 7, 9, 10)) == 6


@pytest.mark.parametrize(("d", "static", "dynamic"), [
    ([2, 8, 2, 8, 2, 8, 2], 16, 24),
    ([1, 4, 1, 4, 1, 4, 1, 4, 1], 9, 13),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5], 24, 28),
    ([4, 16, 4, 8, 2, 4, 1, 1], 25, 40),
])
def test_digest_small_instances(d: list[int], static: int, dynamic: int) -> None:
    assert static_min_peak(d)[0] == brute(d, static_cost) == static
    assert linear_min_peak(d)[0] == quadratic_min_peak(d)[0] == dynamic


# ------------------------------------------------------------------ DPs vs brute force
sizes = st.lists(st.integers(0, 9), min_size=2, max_size=10)


@settings(max_examples=300, deadline=None)
@given(sizes)
def test_dps_match_brute_force(d: list[int]) -> None:
    opt = brute(d, pytorch_peak)
    for value, cps in (linear_min_peak(d), quadratic_min_peak(d)):
        assert value == opt
        assert pytorch_peak(d, cps) == max(pytorch_trace(d, cps)) == opt
    value, cps = static_min_peak(d)
    assert value == brute(d, static_cost) == static_cost(d, cps) == max(static_trace(d, cps))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=60, max_size=200))
def test_linear_matches_quadratic_on_long_chains(d: list[int]) -> None:
    assert linear_min_peak(d)[0] == quadratic_min_peak(d)[0]


@settings(max_examples=60, deadline=None)
@given(sizes, st.data())
def test_replay_matches_closed_forms(d: list[int], data: st.DataObject) -> None:
    n = len(d) - 1
    inner = data.draw(st.sets(st.integers(1, max(1, n - 1)))) if n > 1 else set()
    cps = tuple(sorted({0, n, *inner}))
    assert max(pytorch_trace(d, cps)) == pytorch_peak(d, cps)
    assert max(static_trace(d, cps)) == static_cost(d, cps)


@settings(max_examples=40, deadline=None)
@given(sizes, st.integers(1, 5))
def test_scale_invariance_and_lower_bound(d: list[int], k: int) -> None:
    value, cps = linear_min_peak(d)
    assert linear_min_peak([k * x for x in d])[0] == k * value
    assert static_min_peak([k * x for x in d])[0] == k * static_min_peak(d)[0]
    n = len(d) - 1
    assert value >= d[0] + d[n] + d[n - 1]
    for other in ((0, n), tuple(range(n + 1)), static_min_peak(d)[1]):
        assert value <= pytorch_peak(d, other)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("model", ["pytorch", "static", "optmem"])
def test_methods_agree_on_random_chains(seed: int, model: str) -> None:
    chain = random_chain(3 + seed % 6, seed=seed)
    problem = MinPeakProblem(chain, model=model)
    results = {m: solve(problem, m) for m in ("dp", "brute")}
    if model == "pytorch":
        results["dp:quadratic"] = solve(problem, "dp:quadratic")
    values = {m: r.objective for m, r in results.items()}
    assert all(r.status is Status.OPTIMAL for r in results.values()), values
    assert len(set(values.values())) == 1, values
    for r in results.values():
        # every result is replayed: the peak is the model's, the plan the checkpoint set's
        assert model_peak(problem, r.report["checkpoints"]) == r.objective
        sim = simulate_checkpoint(chain, r.plan)
        assert sim.peak_memory == r.report["checkpoint_plan_peak"]


@pytest.mark.parametrize("model", ["pytorch", "static", "optmem"])
def test_ilp_matches_dp(model: str) -> None:
    pytest.importorskip("pulp", reason="the ILP needs PuLP (optmem[engines])")
    for seed in range(4):
        chain = random_chain(4 + 2 * seed, seed=100 + seed)
        problem = MinPeakProblem(chain, model=model)
        dp, ilp = solve(problem, "dp"), solve(problem, "ilp")
        cold = solve(problem, "ilp", options=SolveOptions(warm_start=False, solver="cbc"))
        assert ilp.status is Status.OPTIMAL and cold.status is Status.OPTIMAL
        assert dp.objective == ilp.objective == cold.objective


@pytest.mark.parametrize("model", ["pytorch", "static", "optmem"])
def test_ilp_on_terabyte_sizes_is_never_a_wrong_infeasible(model: str) -> None:
    """HiGHS solves the ILP on sizes scaled to coefficients of at most 1e4: on activations
    of 2^40 bytes it returned a set one byte above the least peak as optimal, so at the
    least peak as the limit the ILP said ``infeasible`` (and its bound was above the
    optimum). Found by a hunt in stop 51. Now the warm start (the DP's set) is kept when
    the engine's set peaks higher, the bound never exceeds the plan, and without a warm
    start a set above the limit within the engine's tolerance is ``no_solution``."""
    pytest.importorskip("pulp", reason="the ILP needs PuLP (optmem[engines])")
    big = 2**40
    chain = Chain.from_lists([1.0] * 3, [1.0] * 3, [big, big, 1], [big, big, 1],
                             input_size=0)
    least = solve(MinPeakProblem(chain, model=model), "brute").objective
    ilp = solve(MinPeakProblem(chain, model=model), "ilp")
    assert ilp.status is Status.OPTIMAL and ilp.objective == least and ilp.bound <= least
    at_least = solve(MinPeakProblem(chain, model=model, memory_limit=int(least)), "ilp")
    assert at_least.status is Status.OPTIMAL and at_least.objective == least
    cold = solve(MinPeakProblem(chain, model=model, memory_limit=int(least)), "ilp",
                 options=SolveOptions(warm_start=False))
    assert cold.status in (Status.OPTIMAL, Status.NO_SOLUTION), cold.status
    if cold.status is Status.NO_SOLUTION:
        assert "not proven infeasible" in cold.report["hint"]
    else:
        assert cold.objective == least
    far = solve(MinPeakProblem(chain, model=model, memory_limit=10), "ilp")
    assert far.status is Status.INFEASIBLE and far.min_feasible_memory == least


# ------------------------------------------------------------------ optmem accounting
@pytest.mark.parametrize("seed", range(20))
def test_optmem_model_is_the_checkpoint_simulator(seed: int) -> None:
    chain = random_chain(2 + seed % 7, seed=seed)
    r = solve(MinPeakProblem(chain, model="optmem"), "dp")
    cps = r.report["checkpoints"]
    plan = checkpoint_plan(cps)
    bounds = [(h + 1, i) for h, i in zip(cps, cps[1:], strict=False)]
    assert plan == segments_plan(bounds)
    assert simulate_checkpoint(chain, plan).peak_memory == r.objective
    # single-pass plans are persistent plans: rotor's smallest memory is never larger
    assert min_memory_persistent(chain) <= r.objective


# ------------------------------------------------------------------ limits, CLI hooks, verify
def test_memory_limit_is_an_upper_bound() -> None:
    chain = chain_of([1, 1, 1, 3, 1])
    assert solve(MinPeakProblem(chain, memory_limit=8), "dp").status is Status.OPTIMAL
    r = solve(MinPeakProblem(chain, memory_limit=7), "dp")
    assert r.status is Status.INFEASIBLE and r.min_feasible_memory == 8
    assert solve(MinPeakProblem(chain, memory_limit=7), "chen").status is Status.NO_SOLUTION
    with pytest.raises(OptmemInputError):
        MinPeakProblem(chain, model="nope")
    with pytest.raises(OptmemInputError):
        solve(MinPeakProblem(chain), "dp:cubic")


def test_cli_hooks_and_verify() -> None:
    chain = chain_of([1, 1, 1, 3, 1])
    parser = argparse.ArgumentParser()
    add_min_peak_options(parser)
    args = parser.parse_args(["--model", "static", "--ignore-input"])
    problem = min_peak_from_cli(chain, None, args)
    assert (problem.model, problem.count_input, problem.memory_limit) == ("static", False, None)
    assert min_peak_from_cli(chain, 0, args).memory_limit == 0  # 0 is a bound, not "none"
    problem = min_peak_from_cli(chain, 9, parser.parse_args([]))
    r = solve(problem, "dp")
    report = verify_plan(problem, list(r.plan))
    assert report["objective"] == report["peak_memory"] == 8
    assert verify_plan(problem, {"checkpoints": [3]})["objective"] == 8
    assert verify_plan(problem, r.to_json())["checkpoints"] == [0, 3, 4]
    with pytest.raises(PlanError):
        verify_plan(problem, ["F_all 1", "F_all 2", "F_all 3", "F_all 4", "Loss", "B 4"])
    with pytest.raises(PlanError):
        verify_plan(min_peak_from_cli(chain, 7, parser.parse_args([])), [3])
    # an infeasible result has no plan: verified as the set {0, n} until stop 51
    tight = min_peak_from_cli(chain, 7, parser.parse_args([]))
    infeasible = solve(tight, "dp")
    assert infeasible.status is Status.INFEASIBLE and not infeasible.plan
    with pytest.raises(PlanError, match="the plan is empty .the result's status is "
                                        "infeasible"):
        verify_plan(tight, infeasible.to_json())
    with pytest.raises(PlanError, match="the plan is empty"):
        verify_plan(problem, [])


def test_cli_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from optmem.cli import main

    path = tmp_path / "vgg.json"
    chain_of(GOLDEN["instances"]["vgg19"]["sizes"], "vgg19").save(path)
    assert main(["solve", "min-peak", str(path), "--model", "static", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"] == 7778280 and out["report"]["checkpoints"] == [0, 3, 6, 24]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(out))
    assert main(["verify", "min-peak", str(path), str(plan), "--model", "static"]) == 0


def test_cli_min_peak_needs_no_memory_and_zero_is_a_bound(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Regression (issue 12): ``solve min-peak`` without ``--memory``; ``--memory 0`` is 0."""
    from optmem.cli import main

    path = tmp_path / "vgg.json"
    chain_of(GOLDEN["instances"]["vgg19"]["sizes"], "vgg19").save(path)
    assert main(["solve", "min-peak", str(path), "--model", "static", "--json"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["status"] == "optimal" and free["memory_limit"] is None
    assert main(["solve", "min-peak", str(path), "--model", "static", "--memory", "0",
                 "--json"]) == 0
    zero = json.loads(capsys.readouterr().out)
    assert zero["status"] == "infeasible" and zero["memory_limit"] == 0
    assert zero["min_feasible_memory"] == free["objective"] == 7778280
    assert main(["solve", "checkpoint", str(path)]) == 2  # other problems need --memory
    assert "needs --memory" in capsys.readouterr().err


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(0, 10_000))
def test_optmem_model_dp_matches_brute_force(n: int, seed: int) -> None:
    chain = random_chain(n, seed=seed)
    problem = MinPeakProblem(chain, model="optmem")
    dp = solve(problem, "dp")
    assert dp.objective == solve(problem, "brute").objective
    assert dp.objective == simulate_checkpoint(chain, dp.plan).peak_memory


@pytest.mark.parametrize("model", ["pytorch", "static"])
def test_exported_model_has_the_limit_row(tmp_path, model: str) -> None:  # noqa: ANN001
    """The exported ILP, solved by highspy alone, gives the method's verdict at the limit.

    Before, the file had no limit row: at a limit below the least peak another solver
    returned that least peak as optimal where ``solve`` says ``infeasible``.
    """
    highspy = pytest.importorskip("highspy", reason="the ILP engine is HiGHS (optmem[engines])")
    from optmem.models.min_peak_ilp import build_min_peak_ilp
    from optmem.solvers.facade import export

    chain = random_chain(7, seed=3)
    least = solve(MinPeakProblem(chain, model=model), "ilp").objective
    for limit, feasible in ((least, True), (least - 1, False)):
        problem = MinPeakProblem(chain, model=model, memory_limit=int(limit))
        assert (solve(problem, "ilp").status is Status.OPTIMAL) is feasible
        path = tmp_path / f"m_{model}_{int(limit)}.mps"
        export(problem, "ilp", str(path))
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        assert h.readModel(str(path)) == highspy.HighsStatus.kOk
        h.run()
        status = h.getModelStatus()
        if feasible:
            assert status == highspy.HighsModelStatus.kOptimal
            scale = build_min_peak_ilp(problem).scale
            assert h.getInfo().objective_function_value * scale == pytest.approx(least)
        else:
            assert status == highspy.HighsModelStatus.kInfeasible
