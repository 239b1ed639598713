"""Peak-memory minimisation over single-pass checkpoint sets (Hong et al.).

Hong, Tsai, Wang, Liu, Wu, *GPU Memory Usage Optimization for Backward Propagation in Deep
Network Training* (digest ``shared/design/hong_delta.md`` part A). Choose a checkpoint set
``C`` with ``{0, n} <= C <= {0..n}``; the forward pass keeps the checkpoints only, the
backward pass recomputes each segment between two consecutive checkpoints exactly once
(``torch.utils.checkpoint`` / ``checkpoint_sequential``). The objective is the **peak
memory** of the resulting schedule, under one of three memory models:

``pytorch`` (default)
    Hong's model fitted to PyTorch traces (Alg. 4, eqs. 9-12): tensors are freed as soon
    as their backward step ends, and each segment holds one gradient buffer the size of
    its largest tensor (left checkpoint included)::

        peak(C) = max_{(h,i] segment} sum_{c in C, c <= i} d_c + s(h,i)        (eq. 12)
        s(h,i)  = sum_{h<k<i} d_k + max_{h<=k<i} d_k                             (eq. 11)

``static``
    The "checkpoint selection problem" of Chen et al. and Feng & Huang (eq. 6): all
    checkpoints stay resident during the whole backward, segments are freed as blocks,
    gradients are ignored::

        cost(C) = sum_{c in C} d_c + max_{segments} sum_{k in segment} d_k      (eq. 6)

``optmem``
    The same schedule class measured with optmem's own accounting (CONTRACT section 3 and
    :mod:`optmem.simulate.checkpoint`): tapes ``abar`` instead of ``a``, gradients
    ``delta^i`` and ``delta^{i-1}`` at each backward, forward/backward overheads, and the
    last segment taped directly in the forward (no recomputation). Its peak is exactly the
    simulated peak of :func:`checkpoint_plan`, so it is the least memory a
    ``checkpoint_sequential``-style plan needs on this chain: an upper bound on the
    smallest memory of the rotor DP (``optmem solve checkpoint``), which may nest
    recomputations.

How Hong's tensors map to a chain: ``d_0`` is ``input_size`` (0 with ``count_input=False``,
the paper's apparent convention for plain AlexNet, digest A.4.5) and ``d_k`` is
``output_size`` of stage ``k``; ``saved_size``, overheads and the loss are ignored by the
``pytorch`` and ``static`` models (Hong counts one tensor per layer, of the size of its
output, and puts weights, workspaces and allocator slack in a constant offset, A.4.6).

Checkpoint sets are written with Hong's 0-based tensor indices: ``0`` is the input and
``n = L`` the last stage's output; the paper's published sets are these indices without 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from optmem.chain import Chain
from optmem.errors import OptmemInputError, PlanError
from optmem.plan import Op, OpKind, parse_plan, segments_plan
from optmem.problems.checkpoint import check_chain
from optmem.units import memory_size

MODELS = ("pytorch", "static", "optmem")


@dataclass(frozen=True)
class MinPeakProblem:
    """Choose checkpoints so that the peak memory is least (Hong et al., digest part A).

    Parameters
    ----------
    chain
        The chain (or a chain file path or bundled dataset name); ``d_0 = input_size``,
        ``d_k = output_size[k-1]``.
    model
        ``pytorch`` (Hong eq. 12, default), ``static`` (eq. 6) or ``optmem`` (optmem's
        simulator, see the module docstring).
    count_input
        Whether ``d_0`` counts (``False`` sets ``d_0 = 0``; ``pytorch``/``static`` only).
    memory_limit
        Optional upper bound in the chain's memory unit (``None``: no bound; any form of
        :func:`optmem.units.memory_size`, ``0`` is a bound of 0): when the least peak
        exceeds it, the result is ``infeasible`` with the least peak as
        ``min_feasible_memory``.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> c = Chain.from_lists([1] * 4, [1] * 4, [1, 1, 3, 1], [1, 1, 3, 1], input_size=1)
    >>> MinPeakProblem(c).sizes()
    (1, 1, 1, 3, 1)
    """

    chain: Chain
    model: str = "pytorch"
    count_input: bool = True
    memory_limit: int | None = None  # any MemoryLike is accepted and normalised to int

    name = "min-peak"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", check_chain(self.chain))
        if self.model not in MODELS:
            raise OptmemInputError(
                f"unknown min-peak model {self.model!r} (expected one of {', '.join(MODELS)})",
                field="model")
        if not isinstance(self.count_input, bool):
            raise OptmemInputError(f"expected True or False, got {self.count_input!r}",
                                   field="count_input")
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", memory_size(self.memory_limit))
        if not self.count_input and self.model == "optmem":
            raise OptmemInputError("the optmem model always counts the input a^0 (as the "
                                   "checkpoint simulator does); drop --ignore-input",
                                   field="count_input")

    @property
    def n(self) -> int:
        """Index of the last tensor ``d_n`` (the number of stages ``L``)."""
        return self.chain.length

    def sizes(self) -> tuple[int, ...]:
        """Hong's tensor sizes ``d_0..d_n``."""
        d0 = self.chain.input_size if self.count_input else 0
        return (d0, *self.chain.output_size)


# ------------------------------------------------------------------ sets and plans
def normalize_checkpoints(checkpoints: Iterable[int], n: int) -> tuple[int, ...]:
    """Sorted checkpoint set with ``0`` and ``n`` added; out-of-range indices are rejected.

    Examples
    --------
    >>> normalize_checkpoints([6, 3, 24], 24)
    (0, 3, 6, 24)
    """
    out = set()
    for c in checkpoints:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= n:
            raise OptmemInputError(f"checkpoint {c!r} is not a tensor index in 0..{n}",
                                   field="checkpoints")
        out.add(c)
    return tuple(sorted(out | {0, n}))


def checkpoint_segments(checkpoints: Sequence[int]) -> list[tuple[int, int]]:
    """Stage ranges ``[(first, last), ...]`` of the segments of a normalised set."""
    return [(h + 1, i) for h, i in zip(checkpoints, checkpoints[1:], strict=False)]


def checkpoint_plan(checkpoints: Sequence[int]) -> tuple[Op, ...]:
    """The checkpoint op plan of a set: each segment recomputed once, the last one taped.

    Forward: ``F_ck h+1`` keeps each checkpoint ``a^h``, ``F_none`` elsewhere; the last
    segment runs ``F_all`` directly (recomputing it right away would cost time and no
    memory). Backward, segment by segment from the right: ``F_all h+1..i``, ``B i..h+1``.

    Examples
    --------
    >>> [str(op) for op in checkpoint_plan((0, 2, 3))]
    ['F_ck 1', 'F_none 2', 'F_all 3', 'Loss', 'B 3', 'F_all 1', 'F_all 2', 'B 2', 'B 1']
    """
    return segments_plan(checkpoint_segments(checkpoints))


def checkpoints_of_plan(plan: Iterable[Op | str], n: int) -> tuple[int, ...]:
    """Recover the checkpoint set of a plan built by :func:`checkpoint_plan`.

    Raises
    ------
    PlanError
        If the plan is not of that shape (rebuilding it from the set differs).
    """
    ops = parse_plan(plan)
    # F_ck h+1 keeps checkpoint h; the last segment starts at the first F_all (taped at once)
    first_all = next((op.stage - 1 for op in ops if op.kind is OpKind.F_ALL), 0)
    try:
        checkpoints = normalize_checkpoints(
            [first_all, *(op.stage - 1 for op in ops if op.kind is OpKind.F_CK)], n)
    except OptmemInputError as exc:
        raise PlanError(exc.reason) from None
    if tuple(ops) != checkpoint_plan(checkpoints):
        raise PlanError("not a single-pass checkpoint plan (F_ck/F_none forward, each segment "
                        "recomputed once); min-peak plans are checkpoint sets")
    return checkpoints
