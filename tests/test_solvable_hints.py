"""Known defects of issue 12, each with its regression test.

* A smallest-feasible-memory hint is feasible *as solved*: solving again at exactly the
  hinted limit (same slots) finds a plan, on byte-scale chains (sizes ~1e9, rounded to
  units of ``M // 500``), for every problem and method that prints one, the torch bridge's
  message included. The checkpoint ILP's hint used raw byte coefficients, and HiGHS called
  the always-feasible min-peak model infeasible (``random_chain(8, seed=0)`` x 1e9).
* ``optmem sweep --memory auto`` starts at a limit that is feasible as solved.
* ``optmem export CHAIN --method cpsat -o model.pb`` writes the CP-SAT model.
"""

from __future__ import annotations

import csv
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets.synthetic import random_chain
from optmem.problems import (
    CheckpointProblem,
    MinPeakProblem,
    OffloadProblem,
    PipelineProblem,
    RematOffloadProblem,
)
from optmem.result import SolveOptions, Status
from optmem.solvers.facade import solve
from optmem.sweep import parse_memory_range

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 4.0 notices


@st.composite
def byte_chains(draw: st.DrawFn, max_length: int = 6) -> Chain:
    """Chains with byte-scale sizes (0.1-10 GB, not multiples of anything)."""
    n = draw(st.integers(2, max_length))
    size = st.integers(10**8, 10**10)
    out = [draw(size) for _ in range(n)]
    saved = [o + draw(st.integers(0, 10**9)) for o in out]
    overhead = st.one_of(st.just(0), st.integers(0, 10**9))
    times = st.floats(0.5, 5.0, allow_nan=False).map(lambda t: round(t, 2))
    return Chain.from_lists([draw(times) for _ in range(n)], [draw(times) for _ in range(n)],
                            out, saved, input_size=draw(st.integers(10**7, 10**9)),
                            fwd_overhead=[draw(overhead) for _ in range(n)],
                            bwd_overhead=[draw(overhead) for _ in range(n)])


def hinted(make, method: str, **opts: object) -> int:
    """The ``min_feasible_memory`` of ``method`` at limit 0, after checking it solves."""
    options = SolveOptions(**opts)
    first = solve(make(0), method, options=options)
    assert first.status is Status.INFEASIBLE, first
    hint = first.min_feasible_memory
    assert hint is not None, first.report
    again = solve(make(hint), method, options=options)
    assert again.status.has_plan, (hint, again.report)
    return hint


# ------------------------------------------------------------------ the reported defect
def test_ilp_hint_on_the_reported_chain() -> None:
    """``random_chain(8, seed=0)`` x 1e9: the ILP's hint exists and solves."""
    chain = random_chain(8, seed=0).scaled(memory=10**9)
    for method in ("ilp", "cpsat", "dp"):
        hint = hinted(lambda m: CheckpointProblem(chain, m), method)
        assert 43 * 10**9 <= hint <= 43 * 10**9 * 1.01  # the least peak, 43 GB, + rounding


def test_persistent_exact_hints_are_the_persistent_dps() -> None:
    """``ilp:persistent`` and ``cpsat:persistent`` solve the persistent DP's model; their
    hint was the least limit at which the min-peak plan fits after rounding (572000 here),
    above the least limit of the model (570000, the DP's, where they find a plan too).
    Found by a hunt in stop 51."""
    chain = Chain.from_lists(
        [4.0, 2.0, 1.0], [7.0, 1.0, 1.0], [74070, 123450, 61725], [74070, 148140, 74070],
        input_size=98760, fwd_overhead=[0, 12345, 12345], bwd_overhead=[12345, 49380, 12345],
        loss_bwd_time=0.0, loss_bwd_overhead=24690)
    dp = hinted(lambda m: CheckpointProblem(chain, m), "dp")
    assert dp == 570000
    for method in ("ilp:persistent", "cpsat:persistent"):
        assert hinted(lambda m: CheckpointProblem(chain, m), method) == dp
        below = solve(CheckpointProblem(chain, dp - 1), method)
        assert below.status is Status.INFEASIBLE, method


def test_brute_names_its_least_limit() -> None:
    """Checkpoint ``brute`` said ``infeasible`` with no ``min_feasible_memory`` (where
    ``ilp`` named 13 B on the hunt's 5-stage chain). Found by the stop-52 contract hunt."""
    chain = Chain.from_lists([1, 2, 1, 3, 1], [2, 3, 1, 2, 2], [2, 3, 1, 2, 2],
                             [3, 4, 2, 3, 2], input_size=2, fwd_overhead=[0, 1, 0, 0, 1],
                             bwd_overhead=[0, 0, 1, 1, 0])
    brute = hinted(lambda m: CheckpointProblem(chain, m), "brute")
    assert solve(CheckpointProblem(chain, brute - 1), "brute").status is Status.INFEASIBLE
    assert brute <= hinted(lambda m: CheckpointProblem(chain, m), "ilp")


# ------------------------------------------------------------------ properties
@settings(max_examples=25)
@given(byte_chains())
def test_checkpoint_dp_and_baseline_hints_solve(chain: Chain) -> None:
    def make(m: int) -> CheckpointProblem:
        return CheckpointProblem(chain, m)

    for method in ("dp", "dp:rotor", "chen", "sequential", "revolve", "store_all",
                   "recompute_all"):
        hint = hinted(make, method)
        assert hint >= (chain.input_size if method != "store_all" else chain.store_all_peak())


@settings(max_examples=12)
@given(byte_chains(max_length=4))
def test_checkpoint_exact_and_floating_hints_solve(chain: Chain) -> None:
    def make(m: int) -> CheckpointProblem:
        return CheckpointProblem(chain, m)

    exact = [hinted(make, method) for method in ("ilp", "cpsat")]
    assert exact[0] == exact[1]  # the same model, the same min-peak search
    assert hinted(make, "brute") <= exact[0]  # every plan, so at most the ILP's least limit
    assert exact[0] <= hinted(make, "dp")  # the full model needs at most the DP's memory
    hinted(make, "dp:floating")


@settings(max_examples=15)
@given(byte_chains(max_length=5), st.sampled_from(["12GB/s", "1GB/s", 5e8]))
def test_offload_and_remat_offload_hints_solve(chain: Chain, bandwidth: object) -> None:
    for method in ("dp", "greedy", "vdnn", "offload_all"):
        hinted(lambda m: OffloadProblem(chain, m, bandwidth), method)
    hinted(lambda m: RematOffloadProblem(chain, m, bandwidth), "remat_only")
    # remat-offload dp prints the figure of its plan without transfers: that figure solves
    first = solve(RematOffloadProblem(chain, 0, bandwidth), "dp")
    least = first.report["checkpoint_min_memory"]
    assert str(least) in first.report["hint"]
    assert solve(RematOffloadProblem(chain, least, bandwidth), "dp").status.has_plan


@settings(max_examples=15)
@given(byte_chains(max_length=5), st.sampled_from(["pytorch", "static", "optmem"]))
def test_pipeline_and_min_peak_hints_solve(chain: Chain, model: str) -> None:
    hinted(lambda m: PipelineProblem(chain, 2, m, "12GB/s"), "contiguous")
    hinted(lambda m: MinPeakProblem(chain, model=model, memory_limit=m), "dp")


@settings(max_examples=10)
@given(byte_chains())
def test_torch_bridge_figure_solves(chain: Chain) -> None:
    """Passing the figure the torch bridge's error message prints works."""
    pytest.importorskip("torch", reason="the torch bridge needs torch (optmem[torch])")
    from optmem.errors import OptmemInputError
    from optmem.pytorch.api import solve_chain

    with pytest.raises(OptmemInputError) as info:
        solve_chain(chain, chain.input_size)
    figure = int(re.search(r"\((\d+) B\)", str(info.value)).group(1))
    assert solve_chain(chain, figure).status.has_plan


# ------------------------------------------------------------------ sweep auto, export .pb
def test_sweep_auto_starts_at_a_limit_feasible_as_solved(tmp_path) -> None:
    chain = random_chain(8, seed=0).scaled(memory=10**9)
    limits = parse_memory_range("auto:4", chain)
    assert solve(CheckpointProblem(chain, limits[0]), "dp").status.has_plan
    path = tmp_path / "c.json"
    chain.save(path)
    assert main(["sweep", "checkpoint", str(path), "--memory", "auto:3", "--methods",
                 "dp,chen", "--csv", str(tmp_path / "s.csv"), "-q", "--jobs", "1"]) == 0
    with open(tmp_path / "s.csv") as fh:
        rows = list(csv.DictReader(fh))
    first = min(int(r["memory_limit"]) for r in rows)
    assert {r["status"] for r in rows if int(r["memory_limit"]) == first and
            r["method"] == "dp"} == {"optimal"}


@pytest.mark.parametrize("suffix", [".pb", ".pbtxt"])
def test_export_cpsat_model_proto(tmp_path, capsys, suffix: str) -> None:
    """CONTRACT 12 and docs/exact.md: ``export --method cpsat -o model.pb`` (was exit 2)."""
    pytest.importorskip("ortools", reason="CP-SAT (optmem[engines])")
    from google.protobuf import text_format
    from ortools.sat import cp_model_pb2

    chain = tmp_path / "c.json"
    random_chain(6, seed=1).scaled(memory=10**6).save(chain)
    target = tmp_path / f"model{suffix}"
    assert main(["export", "checkpoint", str(chain), "--memory", "30MB", "--method",
                 "cpsat", "-o", str(target)]) == 0
    proto = cp_model_pb2.CpModelProto()
    if suffix == ".pb":
        proto.ParseFromString(target.read_bytes())
    else:
        text_format.Parse(target.read_text(), proto)
    assert len(proto.variables) > 100 and proto.HasField("objective")
    capsys.readouterr()
    wrong = tmp_path / "ilp.pb"
    assert main(["export", "checkpoint", str(chain), "--memory", "30MB", "--method",
                 "ilp", "-o", str(wrong)]) == 2
    assert "expected a .mps or .lp" in capsys.readouterr().err and not wrong.exists()


def test_hint_search_stops_when_no_coarser_unit_can_fit() -> None:
    """More values than any unit's limit holds: the search ends after a few rounded solves.

    ``need`` of 1,002 units at every unit (a 1,000-stage chain whose sizes round to one
    unit each, 500 slots): no limit fits. Before, the search jumped through 200 units and
    rounded the chain 402 times (``store_all`` on ``uniform_chain(1000)`` spent minutes on
    its ``infeasible`` answer); now the first check against ``need(COARSEST)`` stops it.
    """
    from optmem.solvers.hints import smallest_solvable_limit

    calls: list[int] = []

    def need(unit: int) -> int:
        calls.append(unit)
        return 1002

    assert smallest_solvable_limit(2002, need, slots=500) is None
    assert len(calls) <= 3
    fits = smallest_solvable_limit(100_000, lambda u: -(-100_000 // u) + 3, slots=500)
    assert fits == 100701
