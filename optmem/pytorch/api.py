"""User API: ``optmem.pytorch.checkpoint(module, sample, memory_limit)``.

Three steps, as rotor's ``Checkpointable`` (digest ``rotor.md`` section 6): extract the
chain of stages (:mod:`optmem.pytorch.extract`), profile it on the sample batch
(:mod:`optmem.pytorch.profile`), solve ``CheckpointProblem(chain, memory_limit)`` with any
registered method (``dp`` by default: the optimal persistent plan), and wrap the stages in a
:class:`~optmem.pytorch.execute.CheckpointedChain` that follows the plan.

``memory_limit`` bounds the *activation* memory of one training step as the chain model
counts it: the input batch, the stored activations, tapes and gradients of activations
(plus the measured overheads on CUDA). Parameters, their gradients and optimizer state are
not part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.problems.checkpoint import CheckpointProblem
from optmem.pytorch.execute import CheckpointedChain
from optmem.pytorch.extract import Stage, extract_stages, merge_stages
from optmem.pytorch.profile import TimeModel, profile_stages
from optmem.result import Result, SolveOptions
from optmem.units import format_size, parse_size

__all__ = ["CheckpointedModule", "checkpoint", "smallest_limit", "solve_chain"]


def solve_chain(chain: Chain, memory_limit: int | str, method: str = "dp", *,
                slots: int = 500, variant: str | None = None,
                time_limit_s: float | None = None, **extra: Any) -> Result:
    """Solve the checkpoint problem of ``chain`` and raise a clear error without a plan."""
    from optmem.solvers.facade import solve

    limit = parse_size(memory_limit)
    options = SolveOptions(variant=variant, slots=slots, time_limit_s=time_limit_s,
                           extra=dict(extra))
    result = solve(CheckpointProblem(chain, limit), method, options=options)
    if not result.status.has_plan:
        hint = ""
        if result.min_feasible_memory is not None:
            hint = (f"; the smallest feasible limit is about "
                    f"{format_size(result.min_feasible_memory)} "
                    f"({result.min_feasible_memory} B)")
        elif result.report.get("error"):
            hint = f" ({result.report['error']})"
        raise OptmemInputError(
            f"no {method} plan for {chain.name} within {format_size(limit)}: "
            f"status {result.status}{hint}", field="memory_limit")
    return result


def smallest_limit(chain: Chain, method: str = "dp", *, slots: int = 500) -> int:
    """The smallest memory limit (bytes) at which ``method`` finds a plan for ``chain``.

    Uses the method's own ``min_feasible_memory`` when it reports one (the DPs do), then
    steps up by one discretisation unit until the discretised instance is feasible too;
    otherwise bisects between the input size and the store-all peak.
    """
    from optmem.solvers.facade import solve

    options = SolveOptions(slots=slots)

    def feasible(limit: int) -> bool:
        r = solve(CheckpointProblem(chain, limit), method, options=options)
        return r.status.has_plan

    first = solve(CheckpointProblem(chain, max(1, chain.input_size)), method, options=options)
    if first.status.has_plan:
        return max(1, chain.input_size)
    if first.min_feasible_memory is not None:
        low = first.min_feasible_memory
        for k in range(4 * slots):
            limit = low + k * max(1, low // slots)
            if feasible(limit):
                return limit
    lo, hi = chain.input_size, chain.store_all_peak()
    if not feasible(hi):
        raise OptmemInputError(f"{method} finds no plan for {chain.name} even with the "
                               f"store-all peak {hi} B", field="method")
    while hi - lo > max(1, hi // (4 * slots)):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


class CheckpointedModule(CheckpointedChain):
    """A module trained under a memory limit; ``.result`` holds the plan and predictions.

    Attributes
    ----------
    chain
        The profiled chain (bytes, milliseconds).
    result
        The :class:`~optmem.result.Result` of the solve: ``plan``, ``objective`` (expected
        makespan in ms), ``peak_memory`` in units of ``unit`` bytes.
    """

    def __init__(self, stages: Sequence[Stage], chain: Chain, result: Result, **kw: Any) -> None:
        super().__init__(stages, result.plan, **kw)
        self.chain = chain
        self.result = result

    @property
    def expected_makespan(self) -> float:
        """Predicted duration of one forward+backward in the chain's time unit (ms)."""
        return float(self.result.objective)

    @property
    def expected_peak_bytes(self) -> int:
        """Predicted activation peak in bytes: the plan replayed on the (byte) chain.

        At most ``result.peak_memory * result.unit`` (the peak after rounding sizes up to
        the discretisation unit, which is what the limit was checked against).
        """
        from optmem.simulate import simulate_checkpoint

        return int(simulate_checkpoint(self.chain, self.result.plan).peak_memory)

    def resolve(self, memory_limit: int | str | None = None, method: str | None = None,
                **options: Any) -> Result:
        """Solve again (new limit and/or method) and switch to the new plan."""
        if memory_limit is None:
            if self.result.memory_limit is None:
                raise OptmemInputError("the current plan has no memory limit: give one",
                                       field="memory_limit")
            memory_limit = self.result.memory_limit * self.result.unit
        method = method or self.result.method
        if memory_limit == "min":
            memory_limit = smallest_limit(self.chain, method)
        result = solve_chain(self.chain, memory_limit, method, **options)
        self.result = result
        self.set_plan(result.plan)
        return result

    def use_plan(self, plan: Sequence[str], method: str = "custom") -> Result:
        """Run a given plan (validated by the simulator); ``.result`` describes it."""
        from optmem.simulate import simulate_checkpoint

        sim = simulate_checkpoint(self.chain, plan)
        from optmem.result import Status

        self.set_plan(plan)
        self.result = Result("checkpoint", method, Status.FEASIBLE, objective=sim.makespan,
                             plan=tuple(str(p) for p in plan), peak_memory=sim.peak_memory,
                             memory_limit=None, unit=1)
        return self.result

    def summary(self) -> str:
        """A few lines: stages, plan size, predicted makespan and peak vs store-all."""
        store_all = self.chain.store_all_peak()
        return (f"{self.chain.name}: {self.chain.length} stages, method {self.result.method}"
                f" ({self.result.status}), {len(self.result.plan)} ops\n"
                f"expected step time {self.expected_makespan:.3f} {self.chain.time_unit} "
                f"(no recomputation: {self.chain.total_compute_time():.3f})\n"
                f"expected activation peak {format_size(self.expected_peak_bytes)} "
                f"(store all: {format_size(store_all)})")


def checkpoint(
    module: nn.Module | Sequence[nn.Module | Stage],
    sample: Any,
    memory_limit: int | str = "2GiB",
    method: str = "dp",
    *,
    max_stages: int | None = None,
    slots: int = 500,
    variant: str | None = None,
    time_limit_s: float | None = None,
    chain: Chain | None = None,
    device: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    progress: bool | None = None,
    time_model: TimeModel | None = None,
    preserve_rng_state: bool = True,
    restore_buffers: bool = True,
    strip_suffix: bool = True,
    process_group: Any = None,
) -> CheckpointedModule:
    """Return ``module`` wrapped to train with the optimal plan under ``memory_limit``.

    Parameters
    ----------
    module
        An ``nn.Sequential``, any ``torch.fx``-traceable module, or a list of stages.
    sample
        A batch like the ones the module will train on (a tensor or a tuple of tensors).
    memory_limit
        Activation memory for one step: bytes or a size such as ``"2GiB"``, ``"512MB"``;
        ``"min"`` takes the smallest limit at which ``method`` finds a plan.
    method
        Any checkpoint method of the facade: ``dp`` (optimal persistent), ``dp:floating``,
        ``ilp``, ``brute``, or a baseline (``store_all``, ``recompute_all``, ``chen``,
        ``sequential``, ``revolve``).
    max_stages
        Merge the extracted stages into at most this many, balanced by measured
        forward+backward time (a quick extra profile), or by parameter count with
        ``device="meta"`` or a given ``chain``.
    slots, variant, time_limit_s
        Solver options (CONTRACT section 2 and :class:`~optmem.result.SolveOptions`).
    chain
        A chain profiled earlier for the same stages (skips profiling).
    device, repeats, warmup, progress, time_model
        Profiling options (:func:`~optmem.pytorch.profile.profile_chain`).
    preserve_rng_state, restore_buffers, strip_suffix
        Executor options (:class:`~optmem.pytorch.execute.CheckpointedChain`).
    process_group
        Ranks that must train with the same plan (``docs/distributed.md``): by default, when
        ``torch.distributed`` is initialised, rank 0 of the default group profiles and
        solves and broadcasts the chain and the plan; a ``ProcessGroup`` does so within it;
        ``"local"`` decides in this process alone.

    Returns
    -------
    CheckpointedModule
        Shares the parameters of ``module``; ``.result`` has the plan and predictions.

    Raises
    ------
    OptmemInputError
        When no chain can be extracted or no plan fits the limit (the message says the
        smallest feasible limit when known).

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    >>> x = torch.randn(8, 32)
    >>> cnet = checkpoint(net, x, memory_limit="6KiB", repeats=1, warmup=0)
    >>> torch.allclose(cnet(x), net(x))
    True
    >>> cnet.expected_peak_bytes <= 6 * 1024
    True
    """
    from optmem.pytorch.distributed import refuse_sharded, resolve_group, run_once

    refuse_sharded(module)
    stages = extract_stages(module)
    name = type(module).__name__ if isinstance(module, nn.Module) else "torch"
    merge = max_stages is not None and len(stages) > max_stages

    def decide() -> tuple[list[float] | None, Chain, Result]:
        """Profile and solve (on one rank when distributed); the costs used for merging."""
        costs, merged, prof = None, stages, chain
        if merge and chain is None and device != "meta":
            # balance by measured time: a quick profile of the fine chain gives the costs
            fine = profile_stages(stages, sample, device=device, repeats=1, warmup=1,
                                  name=name, progress=progress, time_model=time_model)
            costs = [f + b for f, b in zip(fine.fwd_time, fine.bwd_time, strict=True)]
        if merge:
            merged = merge_stages(stages, max_stages, costs)  # type: ignore[arg-type]
        if prof is None:
            prof = profile_stages(merged, sample, device=device, repeats=repeats,
                                  warmup=warmup, name=name, progress=progress,
                                  time_model=time_model)
        elif prof.length != len(merged):
            raise OptmemInputError(
                f"the given chain has {prof.length} stages but the module has {len(merged)}",
                field="chain")
        limit = smallest_limit(prof, method, slots=slots) if memory_limit == "min" \
            else memory_limit
        return costs, prof, solve_chain(prof, limit, method, slots=slots, variant=variant,
                                        time_limit_s=time_limit_s)

    # every rank of the group runs the plan rank 0 profiled and solved
    costs, chain, result = run_once(decide, resolve_group(process_group))
    if merge:
        stages = merge_stages(stages, max_stages, costs)  # type: ignore[arg-type]
    return CheckpointedModule(stages, chain, result, preserve_rng_state=preserve_rng_state,
                              restore_buffers=restore_buffers, strip_suffix=strip_suffix)
