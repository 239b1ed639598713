"""Measured plan selection (opt-in): time the near-optimal checkpoint plans, keep the fastest.

The checkpoint DP is exact for the chain model, but the model's per-op and per-segment
charges are constants (``docs/pytorch.md``, "What the chain counts (time)"), and no constant
fits every model: on BERT at ``checkpoint_sequential(2)``'s memory the DP's 2-segment plan
beats the 1-segment plan by 0.115 % in the model and measures 0.7-2.3 ms slower
(``benchmarks/results/hf_bert_tie.md``), while the charges that fit BERT (0.05 ms + 0.2 t)
cost GPT-2 up to 0.9 ms. ``op.checkpoint(..., autotune=True)`` decides such near-ties the
way ``torch.backends.cudnn.benchmark`` picks a convolution algorithm: by running them.

**Candidates** (:func:`candidates`): the DP's optimum at the same limit under each of the
:data:`SETTINGS` (the profile's own charges, which give today's plan; ``hf9``'s per-op ratio;
no per-op charge; three times the segment charge, which favours fewer segments),
deduplicated by plan. Each is solved by the same :class:`~optmem.pytorch.planning.Planner`
(same limit semantics, same rounding refinement) on the chain re-charged by
:func:`~optmem.pytorch.profile.with_op_charge` (sizes unchanged), then replayed by the
simulator on the profiled chain within the limit (:func:`replayed`).

**Timing** (:func:`time_candidates`): a warm-up step per candidate, then ``rounds``
interleaved rounds of one training step each (forward on the sample, backward from the
loss or the outputs as :func:`~optmem.pytorch.memory.backward_roots` says); the median per
candidate decides, ties going to the earlier candidate (today's plan first). The model is
left as it was: parameter and input gradients restored, buffers and the RNG state restored
(:func:`~optmem.pytorch.wrapper.leaves_no_trace`). The clock is injectable (``timer(step,
candidate) -> ms``) so that tests are deterministic.

Nothing is timed when there is one candidate or when the store-all fast path is taken (the
wrapper calls the model itself: no plan of the executor can beat the plain step).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.plan import OpKind, parse_plan
from optmem.pytorch.arguments import check_rounds
from optmem.pytorch.hooks import cuda_indices
from optmem.pytorch.memory import backward_step, gradients_restored
from optmem.pytorch.planning import Planner
from optmem.pytorch.profile import with_op_charge
from optmem.pytorch.wrapper import PlannedModule, call_of, leaves_no_trace
from optmem.result import Result, Status

__all__ = ["AUTOTUNE_ROUNDS", "SETTINGS", "Candidate", "Setting", "autotune", "candidates",
           "chosen_record", "cuda_devices", "default_timer", "fastest", "replayed",
           "time_candidates"]

AUTOTUNE_ROUNDS = 5
"""Interleaved timed rounds of :func:`autotune` (one step per candidate and round)."""


@dataclass(frozen=True)
class Setting:
    """One cost-model setting a candidate plan is solved under.

    ``op_overhead``/``op_overhead_ratio``: the per-``F``-op charge (``None``: the profile's
    own); ``segment_factor``: the recorded segment charge is multiplied by it.
    """

    name: str
    op_overhead: float | None = None
    op_overhead_ratio: float | None = None
    segment_factor: float = 1.0


SETTINGS = (Setting("profile"), Setting("op ratio 0.05+0.2t", 0.05, 0.2),
            Setting("no op charge", 0.0, 0.0), Setting("3x segment charge", segment_factor=3.0))
"""The cost-model settings of the candidates, today's (the profile's charges) first.

``op ratio``: the charge that fits BERT (``hf9``, ``benchmarks/results/hf_bert_tie.md``);
``no op charge``: kernels only (re-forwards look cheaper: fewer, longer segments);
``3x segment charge``: the plan with fewer segments that the model ranks just behind."""

Timer = Callable[[Callable[[], None], "Candidate"], float]


@dataclass
class Candidate:
    """A plan to time: the settings that gave it, its result on the profiled chain, times."""

    plan: tuple[str, ...]
    result: Result
    settings: list[str]
    times: list[float] = field(default_factory=list)

    @property
    def plan_id(self) -> str:
        """A short stable name of the plan (its first 8 hex digits of SHA-1)."""
        return hashlib.sha1("\n".join(map(str, self.plan)).encode()).hexdigest()[:8]

    @property
    def segments(self) -> int:
        """Recomputed segments (``F_ck`` ops) of the plan."""
        return sum(1 for op in parse_plan(self.plan) if op.kind is OpKind.F_CK)

    @property
    def model_objective(self) -> float:
        """What the default DP minimises, on the profiled chain: makespan + segment charges."""
        return float(self.result.report.get("objective_with_segments", self.result.objective))

    @property
    def median(self) -> float | None:
        """Median measured step time (ms), ``None`` when not timed."""
        return statistics.median(self.times) if self.times else None

    def row(self, chosen: bool) -> dict[str, Any]:
        """The candidate as ``report["autotune"]["candidates"]`` lists it."""
        return {"plan_id": self.plan_id, "settings": list(self.settings),
                "segments": self.segments, "model_objective": self.model_objective,
                "objective": float(self.result.objective), "measured_ms": self.median,
                "times_ms": list(self.times), "chosen": chosen}


def replayed(chain: Chain, limit: int, plan: Sequence[str], segment_cost: float,
             setting: str) -> Result:
    """``plan`` replayed on ``chain`` at ``limit`` bytes (unit 1): a feasible result.

    Built by the checkpoint problem's one result path
    (:func:`optmem.solvers.checkpoint.plan_result`: the simulator's makespan is the
    objective, a peak above the limit is an ``error``); the model objective adds
    ``segment_cost`` per ``F_ck`` op as the dp's does (``report["objective_with_segments"]``).
    """
    from optmem.problems.checkpoint import CheckpointProblem, Discretized
    from optmem.solvers.checkpoint import lower_bound, plan_result

    problem = CheckpointProblem(chain, limit)
    ops = parse_plan(plan)
    report: dict[str, Any] = {"model": "persistent + segment cost", "autotune_setting": setting}
    result = plan_result(problem, Discretized(chain, limit, 1), ops, method="dp",
                         status=Status.FEASIBLE, bound=lower_bound(problem), report=report)
    if not (segment_cost and result.status.has_plan):
        return result
    segments = sum(1 for op in ops if op.kind is OpKind.F_CK)
    return dataclasses.replace(result, report={
        **result.report, "segment_cost": segment_cost, "segments": segments,
        "objective_with_segments": float(result.objective) + segment_cost * segments})


def _solve_under(planner: Planner, chain: Chain, limit: int, setting: Setting) -> Result | None:
    """The planner's result at ``limit`` on ``chain`` re-charged per ``setting`` (or None)."""
    charged = chain if setting.op_overhead is None else with_op_charge(
        chain, setting.op_overhead, setting.op_overhead_ratio or 0.0)
    solver = planner
    if setting.segment_factor != 1.0:
        cost = float(planner.options(chain).extra.get("segment_cost", 0.0))
        if not cost:
            return None  # no charge to scale: the profile setting's plan
        solver = dataclasses.replace(planner, extra={**planner.extra,
                                                     "segment_cost": cost * setting.segment_factor})
    try:
        return solver.solve(charged, memory_limit=limit)
    except OptmemInputError:
        return None


def candidates(planner: Planner, chain: Chain, limit: int, current: Result,
               settings: Sequence[Setting] = SETTINGS) -> list[Candidate]:
    """The distinct plans of ``settings`` at ``limit`` bytes, ``current`` (today's) first.

    ``current``: the result the wrapper already holds (the first setting's plan). Every
    other plan is replayed on ``chain`` (:func:`replayed`) and kept only if it fits.
    """
    cost = float(planner.options(chain).extra.get("segment_cost", 0.0))
    out = [Candidate(tuple(current.plan), current, [settings[0].name])]
    for setting in settings[1:]:
        result = _solve_under(planner, chain, limit, setting)
        if result is None or not result.status.has_plan:
            continue
        plan = tuple(result.plan)
        same = next((c for c in out if c.plan == plan), None)
        if same is not None:
            same.settings.append(setting.name)
            continue
        mine = replayed(chain, limit, plan, cost, setting.name)
        if mine.status.has_plan and (mine.peak_memory or 0) * mine.unit <= limit:
            out.append(Candidate(plan, mine, [setting.name]))
    return out


def default_timer(step: Callable[[], None], candidate: Candidate,
                  devices: Sequence[torch.device] | None = None) -> float:
    """Wall-clock milliseconds of ``step()`` (CUDA synchronised before and after).

    ``devices``: the CUDA devices the step runs on, each synchronised (``None``: the
    current device, when CUDA is available). :func:`time_candidates` passes the model's
    and the sample's: ``torch.cuda.synchronize()`` alone waits for the current device
    only, so a model on ``cuda:1`` was timed by its kernel launches.
    """
    if devices is None:
        devices = [torch.device("cuda", torch.cuda.current_device())] \
            if torch.cuda.is_available() else []

    def sync() -> None:
        for device in devices:
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - t0) * 1e3


def cuda_devices(module: nn.Module, sample: Any = None) -> list[torch.device]:
    """The CUDA devices of ``module``'s parameters and buffers and of ``sample``'s tensors."""
    tensors = [*module.parameters(), *module.buffers(), *_tensors(sample)]
    return [torch.device("cuda", i) for i in cuda_indices(tensors)]


def _training_step(cmodel: PlannedModule, sample: Any) -> Callable[[], None]:
    """One forward on ``sample`` and the backward from its loss (or outputs)."""
    args, kwargs = ((sample,), {}) if cmodel.extraction is None else call_of(sample)

    return lambda: backward_step(lambda: cmodel(*args, **kwargs))


def time_candidates(cmodel: PlannedModule, sample: Any, cands: Sequence[Candidate], *,
                    rounds: int = AUTOTUNE_ROUNDS, warmup: int = 1,
                    timer: Timer | None = None) -> None:
    """Time every candidate's training step on ``sample``, interleaved (``cand.times``).

    ``warmup`` untimed steps per candidate, then ``rounds`` rounds of one timed step per
    candidate, the order rotated by one each round. Gradients (parameters and sample
    tensors), buffers and the RNG state are as before; the executor's plan is left as
    found.
    """
    step = _training_step(cmodel, sample)
    model = cmodel.module
    if timer is None:
        timer = functools.partial(default_timer, devices=cuda_devices(model, sample))
    leaves = list(model.parameters()) + [
        t for t in _tensors(sample) if t.is_leaf and t.requires_grad]
    before = list(cmodel.plan)
    try:
        with leaves_no_trace(model, sample), gradients_restored(leaves):
            for r in range(warmup + rounds):
                shift = r % len(cands)
                for cand in [*cands[shift:], *cands[:shift]]:
                    cmodel.executor.set_plan(list(cand.plan))  # type: ignore[operator]
                    for t in leaves:
                        t.grad = None
                    ms = _milliseconds(timer(step, cand))
                    if r >= warmup:
                        cand.times.append(ms)
    finally:
        cmodel.executor.set_plan(before)  # type: ignore[operator]


def _milliseconds(value: Any) -> float:
    """A timer's answer as a duration: a finite number >= 0, or one clear error."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value < 0:
        raise OptmemInputError(f"autotune_timer: expected a finite number of milliseconds "
                               f">= 0, got {value!r}", field="autotune_timer")
    return float(value)


def _tensors(value: Any) -> list[torch.Tensor]:
    from optmem.pytorch.extract import value_tensors

    return list(value_tensors(value))


def fastest(cands: Sequence[Candidate]) -> int:
    """Index of the candidate with the least median (the earliest on ties or untimed)."""
    return min(range(len(cands)), key=lambda k: (cands[k].median or 0.0, k))


def chosen_record(cands: Sequence[Candidate], best: int) -> dict[str, Any]:
    """``chosen`` (plan id) and ``candidates`` (rows) of ``report["autotune"]``."""
    return {"chosen": cands[best].plan_id,
            "candidates": [c.row(k == best) for k, c in enumerate(cands)]}


def autotune(cmodel: PlannedModule, sample: Any, *, rounds: int = AUTOTUNE_ROUNDS,
             warmup: int = 1, timer: Timer | None = None,
             settings: Sequence[Setting] = SETTINGS) -> dict[str, Any]:
    """Choose the main plan of ``cmodel`` by timing the candidates; returns the record.

    The chosen plan's result gets the record as ``report["autotune"]`` (``candidates``:
    plan id, settings, segments, model objective, measured median ms; ``chosen``: the plan
    id; ``skipped``: why nothing was timed, or ``None``), and the wrapper switches to it.
    """
    check_rounds(rounds)
    if cmodel._planner.kind != "checkpoint":
        raise OptmemInputError("autotune chooses among checkpoint plans only",
                               field="autotune")
    main = cmodel._main
    record: dict[str, Any] = {"rounds": rounds, "warmup": warmup, "skipped": None}
    if main.limit is None:
        record["skipped"] = "no memory limit"
        cands = [Candidate(tuple(main.result.plan), main.result, [settings[0].name])]
    else:
        cands = candidates(cmodel._planner, main.chain, main.limit, main.result, settings)
        if cmodel.fast_path_taken:
            record["skipped"] = "store-all fast path: the model itself is called"
            cands = cands[:1]
        elif len(cands) == 1:
            record["skipped"] = "one candidate"
        else:
            time_candidates(cmodel, sample, cands, rounds=rounds, warmup=warmup, timer=timer)
    best = fastest(cands)
    record.update(chosen_record(cands, best))
    chosen = cands[best].result
    chosen = dataclasses.replace(chosen, report={**chosen.report, "autotune": record})
    cmodel._set_result(chosen, limit=main.limit)
    return record
