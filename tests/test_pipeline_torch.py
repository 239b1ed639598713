"""Pipeline plans executed on torch.distributed (gloo, CPU processes): gradients match."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="the pipeline executor needs torch")

from optmem.chain import Chain  # noqa: E402
from optmem.problems.pipeline import PipelineProblem  # noqa: E402
from optmem.pytorch import pipeline as pp  # noqa: E402
from optmem.solvers.facade import solve  # noqa: E402

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.distributed.is_available()
                                 or not torch.distributed.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]

WIDTH, MICROBATCHES = 8, 6


def reference(depth: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = pp.demo_model(WIDTH, depth)
    xs, ys = pp.demo_batches(WIDTH, MICROBATCHES)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
    return {n: p.grad for n, p in model.named_parameters()}, losses


def plan_for(costs: list[float], gpus: int, method: str) -> pp.PipelinePlan:
    chain = Chain.from_lists([c / 2 for c in costs], [c / 2 for c in costs],
                             [1] * len(costs), [1] * len(costs), input_size=1)
    problem = PipelineProblem(chain, gpus, 10**6)
    result = solve(problem, method)  # no limit: small instances, proven in well under a second
    assert result.status.has_plan, result.report
    return pp.PipelinePlan.from_strings(result.plan)


def check_jobs(jobs, world: int, tmp_path) -> None:
    pp.spawn(pp.gradient_worker, world, jobs, WIDTH, MICROBATCHES, str(tmp_path),
             init_file=str(tmp_path / "rendezvous"))
    for k, (_, depth, _runner) in enumerate(jobs):
        grads, losses = reference(depth)
        got: dict[str, torch.Tensor] = {}
        got_losses: list[float] = []
        for rank in range(world):
            data = torch.load(tmp_path / f"rank{rank}_job{k}.pt")
            assert not set(got) & set(data["grads"])  # each parameter lives on one rank
            got.update(data["grads"])
            got_losses += data["losses"]
        assert set(got) == set(grads)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6)
        assert sorted(got_losses) == pytest.approx(sorted(losses), rel=1e-5)
        assert all(math.isfinite(v) for v in got_losses)


def test_plans_on_four_ranks_match_single_process(tmp_path):
    """Costs (1, 2, 1, 1, 2, 1) on 4 GPUs: a non-contiguous optimum (p2p) and the equal split
    (torch.distributed.pipelining, one stage per rank)."""
    pytest.importorskip("ortools", reason="the exact model needs OR-Tools")
    costs = [1, 2, 1, 1, 2, 1]
    general = plan_for(costs, 4, "cpsat")
    equal = plan_for(costs, 4, "equal")
    assert len(general.stages) > len({st.gpu for st in general.stages})  # non-contiguous
    assert pp.fits_pipelining(equal) and len(equal.stages) == 4
    check_jobs([(general.to_dict(), 6, "p2p"), (equal.to_dict(), 6, "pipelining")], 4, tmp_path)


def test_plans_on_two_ranks_match_single_process(tmp_path):
    """A contiguous 1F1B* plan and a non-contiguous optimum (costs 1, 2, 1: layers 1 and 3
    share a rank, two stages there) give the single-process gradients and losses, and so does
    the contiguous allocation run by torch.distributed.pipelining's Schedule1F1B."""
    pytest.importorskip("ortools", reason="the exact model needs OR-Tools")
    contiguous = plan_for([1, 1, 1, 1], 2, "contiguous")
    general = plan_for([1, 2, 1], 2, "cpsat")
    gpus = [st.gpu for st in general.stages]
    assert len(gpus) == 3 and gpus[0] == gpus[2] != gpus[1]
    assert pp.fits_pipelining(contiguous) and not pp.fits_pipelining(general)
    jobs = [(contiguous.to_dict(), 4, "p2p"), (general.to_dict(), 3, "p2p"),
            (contiguous.to_dict(), 4, "pipelining")]
    check_jobs(jobs, 2, tmp_path)


def test_rank_programs_follow_the_pattern():
    plan = plan_for([1, 2, 1], 2, "contiguous")
    programs = pp.rank_programs(plan, 4)
    assert sum(len(v) for v in programs.values()) == 2 * len(plan.stages) * 4
    for ops in programs.values():
        assert [o.time for o in ops] == sorted(o.time for o in ops)
