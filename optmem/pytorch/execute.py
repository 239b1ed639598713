"""Execution: a module that trains a chain of stages by following a checkpoint plan.

The plan ops (CONTRACT section 3: ``F_all i``, ``F_ck i``, ``F_none i``, ``Loss``, ``B i``)
are run by custom autograd Functions as rotor's ``CheckpointOptim`` does
(digest ``rotor.md`` section 6.2): the ops before ``Loss`` run in ``forward()``, which
returns the chain output ``a^L``; the ops after it run in ``backward()``, which receives
``delta^L`` and returns ``delta^0``. The backward is split in autograd nodes: the first
runs the ops up to ``B L`` and returns, so that autograd frees ``delta^L`` there (a
Function's incoming gradient lives until its backward returns); then one node per ``B`` op
that adds to some parameters' gradients (:class:`_Release`) runs the plan up to that op
and returns those contributions; the last runs the rest.
Memory follows the simulator's rules (``optmem/simulate/checkpoint.py``):

* storage slot ``i`` holds ``a^i``; a slot filled by ``F_all i`` also holds the tape: the
  gradient edges of the stage outputs, and the autograd graph of stage ``i``, rooted at a
  :class:`_Source` alias of ``a^{i-1}`` whose incoming gradient (``delta^{i-1}``) a hook
  captures. ``B i`` is ``torch.autograd.backward`` on those edges;
* ``F_none i`` drops slot ``i-1``; ``Loss`` drops ``a^L`` unless it is a tape; ``B i``
  drops the tape ``i`` and ``a^{i-1}`` unless slot ``i-1`` is a tape;
* with ``release_early`` (default), the executor also lets go of ``a^i`` as soon as no
  later op reads it: what autograd saved stays alive through the tape, the rest is freed.
  The chain model counts ``a^i`` inside the tape ``abar^i`` until ``B i``, so the real
  memory is at most the simulated peak, and often below.

Differences from rotor, all making the checkpointed module compute *exactly* what the
unmodified one does:

* The RNG state (CPU and the CUDA devices of the chain input and of the stages' parameters,
  :func:`~optmem.pytorch.hooks.cuda_indices`, and the ``torch.Generator`` objects the
  stage's modules hold) is saved before the first run of every stage the plan runs more
  than once, and restored (inside ``fork_rng``) before each re-run, whatever the op kinds;
  the global RNG and the stages' generators advance exactly as without the plan.
* A re-run stage runs on scratch copies of its buffers (BatchNorm running statistics), so
  the statistics are updated once per step, as in the unmodified module.
* The autocast state of the forward is re-entered for re-runs in the backward, its
  ``cache_enabled`` too (with the weight cache off, each use of a weight casts it anew and
  autograd sums its uses' gradients in float32; a re-run that cached the cast summed them
  in the low precision, as one node).

**Suffix stripping** (optional, on by default as in rotor): when the forward part of the
plan ends with ``F_all j .. F_all L`` mirrored by ``B L .. B j`` right after ``Loss``, the
stages ``j..L`` run as ordinary autograd code after the Function (no bookkeeping).

**Parameters are inputs of the plan's autograd nodes.** ``B i`` computes the gradients of
stage ``i``'s outputs with respect to its input *and its parameters* with
``torch.autograd.grad``, and the :class:`_Release` node of each ``B`` op that adds to a
parameter returns that contribution as soon as the op has run; autograd sums the
contributions of a parameter several stages use (a tied embedding) in the order they arrive,
as for the unmodified module, also with those made outside the plan (the native suffix's
head), and sets ``.grad`` after the last. So ``loss.backward()``,
``torch.autograd.grad(loss, params)``, ``backward(inputs=...)``, gradient hooks and DDP see
exactly what the unmodified module gives, stage by stage while the plan's backward goes on:
DDP all-reduces a bucket as soon as its parameters' last ``B`` has run, overlapping the rest
of the backward, as for the unmodified module. A stage that uses a tensor requiring grad
that is not one of its registered parameters is refused at its first run (that gradient
would be lost).

**retain_graph and double backward** (stop 81; both raised before). A backward that keeps
the graph (``retain_graph=True``, read by :func:`graph_kept`) runs the plan's backward on
copies of the slots the forward left, and retains the graphs of the forward's tapes, so
the next backward starts from the same checkpoints, RNG states and buffer snapshots and
gives the same gradients (bitwise); the last backward (without ``retain_graph``) consumes
them as a single one does: a step without ``retain_graph`` runs and frees exactly as
before. A double backward (grad mode on inside the backward: ``create_graph=True``) and a
retained backward of a runner whose transfers move the forward's values (remat + offload,
``PlanRunner.retains``) re-run stages ``1..n`` from the plan's input as one graph (each
stage's RNG state, buffers and parameters as at its first run, the side inputs and
autocast of the forward) and differentiate it with ``torch.autograd.grad``
(:meth:`PlanRunner.replay_backward`): differentiable gradients of the input and the
parameters, at the store-all peak of the plan's stages for that backward. The input is
held weakly (the normal path keeps only what it reads): freed before such a backward, one
error says to keep it. A backward after one that did not retain the graph raises, as
autograd does. A custom operator of the exported stages whose backward has no derivative
(transformers' ``grouped_mm_fallback``, which export picks for float32 MoE experts where
eager mode takes ``torch._grouped_mm``) makes the second backward raise one
``OptmemInputError`` naming it (:func:`refuse_underivable`, stop 81b).

**Side inputs** (:mod:`optmem.pytorch.context`): the side inputs active when the forward
starts are re-entered around every stage run, re-runs in the backward included. The executor
keeps only those its stages read (:func:`~optmem.pytorch.context.read_by`): one read only by
the native suffix (a loss's shifted labels) is freed when autograd lets go of it, as in the
plain model.

**torch.compile**: the plan interpreter never runs under dynamo (``torch.compiler.disable``,
a graph break); with :meth:`CheckpointedChain.compile_stages`, or when the executor is
called from a ``torch.compile``-d module, each stage runs compiled
(``torch.compile(stage, **options)``), in the forward and in re-runs. Called from a
``torch.compile``-d module without :meth:`~StageCalls.compile_stages`, the stages are
compiled with the backend of that enclosing compile (:func:`run_compiled`), so that
``torch.compile(model, backend="aot_eager")`` runs ``aot_eager`` stages, not inductor ones,
and with its ``dynamic=`` (:func:`enclosing_compile_options`). ``fullgraph=True`` cannot
hold (the plan is a graph break by design): dynamo's error then carries
:data:`FULLGRAPH_REASON`, which names ``cmodel.compile(fullgraph=True)`` instead.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from optmem.errors import OptmemInputError, PlanError
from optmem.plan import LOSS, Op, OpKind, parse_plan
from optmem.pytorch.context import (
    SideInputs,
    current_side_inputs_or_none,
    read_by,
    side_inputs,
)
from optmem.pytorch.extract import Stage, value_tensors
from optmem.pytorch.hooks import (
    cuda_indices,
    generators_restored,
    module_generators,
    quiet_gradient_hooks,
)
from optmem.pytorch.joint import JointStage, dead_outputs

__all__ = ["FULLGRAPH_REASON", "CheckpointedChain", "CompileRequest", "StageCalls", "add_monitor",
           "autocast_modes", "backward_outside_dynamo", "compile_stage",
           "enclosing_compile_options", "fusable_runs", "graph_kept", "modified_in_place",
           "refuse_underivable", "remove_monitor", "run_compiled", "run_in_order",
           "split_suffix", "underivable_op"]

Monitor = Callable[[str, list[torch.Tensor], list[torch.Tensor]], None]
_MONITORS: list[Monitor] = []


def add_monitor(fn: Monitor) -> None:
    """Call ``fn(op, stored, gradients)`` after every op the executor runs.

    ``stored`` are the tensors of the stored values (checkpoints, tapes' outputs and input
    leaves), ``gradients`` the current gradient ``delta^i`` (memory tracking).
    """
    _MONITORS.append(fn)


def remove_monitor(fn: Monitor) -> None:
    """Stop calling ``fn``."""
    if fn in _MONITORS:
        _MONITORS.remove(fn)


def split_suffix(plan: Sequence[Op], length: int) -> tuple[tuple[Op, ...], int]:
    """Strip the store-all suffix of ``plan``.

    Returns the plan of the prefix chain (stages ``1..j-1``) and ``j``: stages ``j..L`` can
    run natively after it. ``j = L + 1`` when nothing can be stripped, ``j = 1`` when the
    whole plan is store-all.

    Examples
    --------
    >>> plan = parse_plan(["F_ck 1", "F_all 2", "F_all 3", "Loss", "B 3", "B 2", "F_all 1", "B 1"])
    >>> ops, j = split_suffix(plan, 3)
    >>> [str(o) for o in ops], j
    (['F_ck 1', 'Loss', 'F_all 1', 'B 1'], 2)
    """
    ops = tuple(plan)
    loss = ops.index(LOSS)
    fwd, bwd = ops[:loss], ops[loss + 1:]
    k = 0
    while k < min(len(fwd), len(bwd), length):
        stage = length - k
        if fwd[len(fwd) - 1 - k] != Op(OpKind.F_ALL, stage) or bwd[k] != Op(OpKind.B, stage):
            break
        k += 1
    j = length - k + 1
    rest = fwd[:len(fwd) - k] + (LOSS,) + bwd[k:]
    while j <= length and any(op.stage >= j for op in rest if op.kind is not OpKind.LOSS):
        # a stripped stage is touched elsewhere: give it back to the Function
        j += 1
        rest = _unstrip(ops, length, j)
    return (rest if j > 1 else ()), j


def _unstrip(ops: tuple[Op, ...], length: int, j: int) -> tuple[Op, ...]:
    loss = ops.index(LOSS)
    k = length - j + 1
    return ops[:loss - k] + (LOSS,) + ops[loss + 1 + k:]


def backward_outside_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a hook or a ``Function.backward`` autograd calls) run outside dynamo.

    The forward's plan runs outside dynamo (:func:`run_disabled`), but autograd calls the
    executor's backward Python (re-runs, transfers, the plan's bookkeeping, saved-tensor
    unpack hooks, tensor hooks) with the caller's frame callback: a ``backward()`` called
    inside a ``torch.compile``-d training step had dynamo trace that Python (a false
    ``OptmemInputError`` from ``op.checkpoint``, and for the offload executors every
    transfer function traced, hitting the recompile limit after a few wrappers). The stages
    it re-runs still run compiled (their own ``torch.compile`` turns dynamo back on).
    """
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


class _Source(torch.autograd.Function):
    """Root of a stage's graph: an alias of ``a^{i-1}`` whose incoming gradient is captured.

    Unlike a detached leaf (whose ``AccumulateGrad`` node would keep ``a^{i-1}`` alive as
    long as the graph), this root does not own its input: the storage of ``a^{i-1}`` stays
    alive only if the stage's autograd graph saved it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


class _Tape:
    """What ``F_all i`` leaves for ``B i``: the output gradient edges and the input edges."""

    def __init__(self) -> None:
        self.out_edges: list[GradientEdge | None] = []
        self.in_edges: list[GradientEdge | None] = []
        self.sink: torch.Tensor | None = None  # the end of a fused run (its last stage)
        self.sunk: list[bool] = []  # which outputs the sink takes
        self.kept = False  # built before ``Loss``: a retained backward must not free it


@dataclass
class _Slot:
    value: Any  # a^i; None once no later op reads it (the tape, if any, stays)
    tape: _Tape | None = None


def _plan_reads(plan: Sequence[Op], n: int) -> list[bool]:
    """For every op, whether a later op still reads the slot it reads (before it is rebuilt).

    Op ``k`` reads slot ``s - 1`` if it is a forward of stage ``s``, slot ``n`` if it is
    ``Loss``; ``B`` ops read no activation data (the tape holds what they need).
    """
    later = [False] * len(plan)
    pending: dict[int, bool] = {}
    for k in range(len(plan) - 1, -1, -1):
        op = plan[k]
        if op.kind is OpKind.B:
            continue
        read = n if op.kind is OpKind.LOSS else op.stage - 1
        later[k] = pending.get(read, False)
        pending[read] = True
        if op.kind is not OpKind.LOSS:
            pending[op.stage] = False  # reads after this op see the value it builds
    return later


_Run = tuple[int, int, tuple[int, ...], int]  # (i, j, positions of F_all i..j, of B j)


def fusable_runs(plan: Sequence[Op], n: int) -> tuple[_Run, ...]:
    """Runs of stages the executor may tape as one graph: ``(i, j, f, q)``.

    Stages ``k`` and ``k + 1`` are *linked* when ``B k+1`` is immediately followed by
    ``B k`` and the tapes they consume were built in that order: the last forward of stage
    ``k`` before ``B k`` is an ``F_all`` (at ``f_k``), and so is the last forward of stage
    ``k + 1`` before ``B k+1`` (at ``f_{k+1} > f_k``; it reads ``a^k`` from that tape's
    slot, which no op rewrites in between). A run is a maximal chain of linked stages
    ``i..j`` with ``j < n`` (stage ``n``'s ``B`` frees ``delta^n``, see :class:`_Relay`);
    ``f`` are the positions of ``F_all i..j``, ``q`` that of ``B j``. Rotor's plans are full
    of them (``F_all i, ..., F_all j`` mirrored by ``B j, ..., B i``, or the forwards split by
    re-forwards of other stages). Such a run can be taped as one autograd graph rooted at
    ``a^{i-1}`` (stage ``k + 1`` reads ``a^k`` with its graph instead of a detached alias)
    and back-propagated by one call (:meth:`PlanRunner._backward_group`): the same ops,
    saved tensors and gradients, no value freed later.

    Examples
    --------
    >>> plan = parse_plan(["F_ck 1", "F_all 2", "F_all 3", "F_all 4", "Loss", "B 4", "B 3",
    ...                    "B 2", "F_all 1", "B 1"])
    >>> fusable_runs(plan, 4)
    ((2, 3, (1, 2), 6),)
    """
    ops = tuple(plan)
    where_b = {op.stage: k for k, op in enumerate(ops) if op.kind is OpKind.B}
    tape_at = {s: _last_forward(ops, s, q) for s, q in where_b.items()}

    def linked(k: int) -> bool:
        q = where_b.get(k + 1)
        if q is None or k + 1 >= n or q + 1 >= len(ops) or ops[q + 1] != Op(OpKind.B, k):
            return False
        low, high = tape_at.get(k), tape_at.get(k + 1)
        return low is not None and high is not None and low < high

    runs: list[_Run] = []
    k = 1
    while k < n:
        j = k
        while linked(j):
            j += 1
        if j > k:
            runs.append((k, j, tuple(tape_at[s] or 0 for s in range(k, j + 1)), where_b[j]))
        k = j + 1
    return tuple(runs)


def _last_forward(ops: tuple[Op, ...], stage: int, before: int) -> int | None:
    """Position of the last forward of ``stage`` before ``before`` if it is an ``F_all``."""
    for k in range(before - 1, -1, -1):
        op = ops[k]
        if op.stage == stage and op.kind is not OpKind.B and op.kind is not OpKind.LOSS:
            return k if op.kind is OpKind.F_ALL else None
    return None


@dataclass
class _Fusion:
    """Plan positions of the fused runs (see :func:`fusable_runs`), for one runner."""

    link: set[int]  # F_all of a run's stage i+1..j: takes a^{k-1} with its graph
    close: dict[int, tuple[int, int]]  # F_all j of a run (i, j): checks leaves, sinks
    start: dict[int, tuple[int, int]]  # B j of a run: back-propagates the whole run
    skip: set[int]  # B j-1 .. B i of a run: already done


def _split_runs(runs: Sequence[_Run], stage_params: dict[int, list[int]],
                excluded: set[int]) -> _Fusion:
    """The runs cut where a stage is ``excluded`` (FSDP) or shares a parameter with the run.

    A parameter used by two stages of one run would get its two contributions summed by
    autograd inside the call instead of by the executor in ``B`` order (bitwise different
    beyond two summands): such stages go to different runs.
    """
    fusion = _Fusion(set(), {}, {}, set())

    def emit(a: int, b: int, i: int, j: int, f: tuple[int, ...], q: int) -> None:
        if b <= a:  # a run of one stage is the per-stage execution
            return
        fusion.link.update(f[s - i] for s in range(a + 1, b + 1))
        fusion.close[f[b - i]] = (a, b)
        fusion.start[q + j - b] = (a, b)
        fusion.skip.update(q + j - s for s in range(a, b))

    for i, j, f, q in runs:
        a, seen = i, set[int]()
        for s in range(i, j + 1):
            mine = set(stage_params.get(s, ()))
            if s in excluded or mine & seen:
                emit(a, s - 1, i, j, f, q)
                a, seen = (s + 1 if s in excluded else s), set()
                if s in excluded:
                    continue
            seen |= mine
        emit(a, j, i, j, f, q)
    return fusion


class _Sink(torch.autograd.Function):
    """End of a fused run: a 0-element output whose backward hands out ``delta^j``.

    ``torch.autograd.grad`` keeps the gradients it is given alive until it returns; given
    through this node instead (``holder.grads``, taken once), ``delta^j`` is freed as soon as
    the run's last stage has consumed it, as between two ``B`` ops.
    """

    @staticmethod
    def forward(ctx: Any, holder: _GradHolder, *outs: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder
        return torch.empty(0)

    @staticmethod
    @backward_outside_dynamo
    def backward(ctx: Any, _: torch.Tensor) -> Any:
        grads, ctx.holder.grads = ctx.holder.grads, []
        return (None, *grads)


class _GradHolder:
    """The gradients a :class:`_Sink` returns (set just before the run's backward)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor | None] = []


class _BufferSnapshot:
    """The buffers of a re-run stage as they were before its first run.

    A stage whose output reads a buffer it updates in the same forward (an EMA normaliser,
    spectral norm's power iteration, a VQ codebook) must re-run from the values its first
    run saw, not from the updated ones: taken before the first run, then trimmed to the
    buffers that run changed (another tensor, a new version, or other values: a native op
    such as ``torch.fused_moving_avg_obs_fake_quant``, QAT's fused observer, updates its
    buffers in place without a new version, as batch norm does).
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.saved: dict[tuple[int, str], tuple[nn.Module, torch.Tensor, int, torch.Tensor]] = {
            (id(sub), name): (sub, buf, buf._version, buf.detach().clone())
            for sub in modules for name, buf in sub._buffers.items() if buf is not None}

    def keep_changed(self) -> bool:
        """Drop the copies of unchanged buffers; whether any is left."""
        self.saved = {key: entry for key, entry in self.saved.items()
                      if entry[0]._buffers.get(key[1]) is not entry[1]
                      or entry[1]._version != entry[2] or not _same_values(entry[1], entry[3])}
        return bool(self.saved)

    def value(self, sub: nn.Module, name: str, buf: torch.Tensor) -> torch.Tensor:
        """The buffer's value before the first run (``buf`` when it did not change)."""
        entry = self.saved.get((id(sub), name))
        return buf if entry is None else entry[3]


def _same_values(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether a buffer holds the values of its copy (a meta buffer: assumed so)."""
    return now.is_meta or (now.shape == before.shape and bool(torch.equal(now, before)))


def modified_in_place(what: str) -> RuntimeError:
    """Autograd's error for a saved tensor modified in place before the backward read it.

    Autograd raises it when the plain model's backward reads such a tensor; a plan that
    re-runs a stage, or saves tensors through hooks (which autograd does not check),
    raises it too instead of computing with the modified values in silence.

    Examples
    --------
    >>> str(modified_in_place("a tensor")).startswith("one of the variables needed")
    True
    """
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what}. Modify parameters and saved values after the "
        "backward (optimizer.step() after loss.backward())")


class _Parameters:
    """What the parameter slots of a re-run stage held at its first run.

    A re-run in the backward must compute with the tensors the first run used. The
    caller's code may have put others back in between: ``torch.func.functional_call``
    swaps its tensors into the model's parameter slots for the call only, and the backward
    (where a checkpointed stage is re-run) comes after it returned. A stage that is the
    model's own module (an ``nn.Sequential`` child) would then be re-run with the model's
    parameters, not the given ones.
    """

    def __init__(self, modules: Sequence[nn.Module], stage: str = "the stage") -> None:
        self.slots = [(m._parameters, name, t) for m in modules
                      for name, t in m._parameters.items()]
        self.stage = stage
        self.versions = [None if t is None else t._version for _, _, t in self.slots]

    def check_unmodified(self) -> None:
        """Raise autograd's error when a parameter was modified in place since the first run.

        The plain model's backward reads the values its forward saved, and autograd raises
        when one was modified in place in between (an optimizer step before the backward);
        a re-run would compute with the modified values instead, in silence.
        """
        for (_, name, t), version in zip(self.slots, self.versions, strict=True):
            if t is not None and t._version != version:
                raise modified_in_place(
                    f"parameter {name!r} of {self.stage} {list(t.shape)} is at version "
                    f"{t._version}; expected version {version} instead (optmem re-runs "
                    "that stage in the backward, which would compute with the modified "
                    "values)")

    @contextmanager
    def bound(self) -> Iterator[None]:
        """Within: every slot holds its first-run tensor (nothing swapped when all do)."""
        self.check_unmodified()
        swapped = []
        for d, name, t in self.slots:
            now = d[name] if name in d else None  # noqa: SIM401 - jit's wrapper has no .get
            if now is not t:
                swapped.append((d, name, now))
                d[name] = t
        try:
            yield
        finally:
            for d, name, now in swapped:
                d[name] = now


@contextmanager
def _scratch_buffers(modules: Sequence[nn.Module],
                     snapshot: _BufferSnapshot | None = None) -> Iterator[None]:
    """Run with copies of the buffers, so that a re-run does not update them twice.

    The copies are swapped in and out (no in-place write on the real buffers, whose
    version autograd may check: batch norm saves its running statistics). With a
    ``snapshot``, the copies start from the values before the stage's first run, so the
    re-run computes what the first run computed.
    """
    swapped = []
    for sub in modules:
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                swapped.append((sub, name, buf))
                start = snapshot.value(sub, name, buf) if snapshot is not None else buf
                sub._buffers[name] = start.detach().clone()
    try:
        yield
    finally:
        for sub, name, buf in swapped:
            sub._buffers[name] = buf


def autocast_modes() -> list[tuple[str, torch.dtype]]:
    """The autocast modes enabled now, ``(device type, dtype)``: what a re-run re-enters.

    A stage re-run in the backward (where the caller's ``torch.autocast`` has been left)
    must compute in the dtypes of its first run.
    """
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
            if torch.is_autocast_enabled(d)]


class _RngState:
    """CPU, CUDA and the stage's own generator states taken before the first run of a stage.

    ``generators`` are those the stage's modules hold
    (:func:`~optmem.pytorch.hooks.module_generators`: a model drawing with
    ``generator=self.gen``), which ``fork_rng`` does not save.
    """

    def __init__(self, devices: list[int], generators: Sequence[torch.Generator] = ()) -> None:
        self.devices = devices
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in devices]
        self.generators = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, s in zip(self.devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(s, d)
        for g, state in self.generators:
            g.set_state(state)




CompileRequest = bool | dict[str, Any] | None
"""How the stages are to run: ``None`` as :meth:`StageCalls.compile_stages` asked, ``False``
as they are, ``True`` compiled, a dict compiled with those ``torch.compile`` options (the
enclosing compile's, :func:`enclosing_compile_options`) unless ``compile_stages`` gave some."""


class StageCalls:
    """How an executor calls its stages: as they are, or compiled with ``torch.compile``.

    Mixed into the executors (:class:`CheckpointedChain`, ``OffloadedChain``,
    ``RematOffloadChain``, ``DeltaChain``), which keep their stages in ``self.stages`` and
    run their plan in ``_forward`` (called by :meth:`forward`).
    """

    stages: nn.ModuleList
    _compile_options: dict[str, Any] | None = None
    _compiled: list[Callable[[Any], Any]] | None = None
    _compiled_with: dict[str, Any] | None = None  # the options ``_compiled`` was built with

    def forward(self, x: Any) -> Any:
        """Run the stages by the executor's plan (:meth:`_forward`).

        Under ``torch.compile`` the plan runs outside dynamo (a graph break,
        :func:`run_compiled`), its stages compiled with the enclosing compile's options.
        """
        if torch.compiler.is_compiling():
            return run_compiled(run_disabled, self, x)
        return self._forward(x, None)

    def _forward(self, x: Any, compiled: CompileRequest) -> Any:
        """Run the stages (``compiled``: see :meth:`stage_functions`); each executor's own."""
        raise NotImplementedError

    def compile_stages(self, **options: Any) -> None:
        """Run every stage compiled: ``torch.compile(stage, **options)`` (lazily built)."""
        self._compile_options = dict(options)
        self._compiled = None

    def stage_functions(self, compiled: CompileRequest = None) -> list[Callable[[Any], Any]]:
        """The callables that run the stages.

        ``compiled=None``: as :meth:`compile_stages` asked; ``False``: as they are;
        ``True``: compiled (the executor is called from a ``torch.compile``-d module), with
        the options of :meth:`compile_stages` (default ones if it was never called); a
        dict: compiled, with the options of :meth:`compile_stages` if it was called, else
        with these (those of the enclosing ``torch.compile``, :func:`run_compiled`).
        """
        options = compile_options_for(compiled, self._compile_options)
        if options is None:
            return list(self.stages)
        if (self._compiled is None or len(self._compiled) != len(self.stages)
                or self._compiled_with != options):
            self._compiled = [compile_stage(m, options) for m in self.stages]
            self._compiled_with = dict(options)
        return list(self._compiled)


def compile_options_for(compiled: CompileRequest, chosen: dict[str, Any] | None
                        ) -> dict[str, Any] | None:
    """The ``torch.compile`` options to run with, or ``None`` to run uncompiled.

    ``chosen``: the options given explicitly (``compile_stages`` / ``cmodel.compile``, or
    ``None``); they win over the enclosing compile's (``compiled`` a dict).
    """
    if compiled is None:
        return chosen
    if compiled is False:
        return None
    if chosen is not None:
        return chosen
    return compiled if isinstance(compiled, dict) else {}


@torch.compiler.disable(recursive=False)
def enclosing_compile_options() -> dict[str, Any] | None:
    """The options of the ``torch.compile`` running the caller: ``backend`` and ``dynamic``.

    ``backend`` is read from dynamo's frame callback, which stays set while this function
    runs (dynamo skips its frame without disabling itself): the backend object
    ``torch.compile`` built (a named backend with its options, or inductor with its mode
    and options), unwrapped from dynamo's wrappers. ``dynamic`` is read from the dynamo
    configuration that the enclosing compile's ``dynamic=True`` (``assume_static_by_default``
    off) or ``dynamic=False`` (``automatic_dynamic_shapes`` off) patches while the compiled
    module runs, and is left out otherwise (dynamo's default). It is passed on because the
    patch ends when the compiled module returns: a stage compiled at a re-run in the backward
    (after ``loss.backward()`` started) would otherwise be traced with static shapes under
    ``dynamic=True``, while those compiled in the forward got dynamic ones (measured on tiny
    GPT-2, ``tests/test_hf_wrapper.py``). ``{}`` (default options) when no compile encloses
    the caller, or when this torch keeps the callback elsewhere. ``None`` when dynamo runs
    the caller's cached code but compiles nothing new (its callback is ``False``: the
    recompile limit of the wrapper's ``forward`` was hit, or ``torch._dynamo.run``): the
    stages then run as :meth:`StageCalls.compile_stages` asked (as they are if it was never
    called), as dynamo runs the frames it gave up on. Before, they were compiled with
    default options (inductor, not the enclosing ``aot_eager``: gradients 1.2e-7 off the
    plain model's).
    """
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # pragma: no cover - another torch
        return {}
    backend: Any = get_eval_frame_callback()
    if backend is False:  # run-only: dynamo compiles nothing new (recompile limit hit)
        return None
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    if backend is None or backend is False or not callable(backend):
        return {}
    options: dict[str, Any] = {"backend": backend}
    config = torch._dynamo.config
    if not getattr(config, "assume_static_by_default", True):
        options["dynamic"] = True
    elif not getattr(config, "automatic_dynamic_shapes", True):
        options["dynamic"] = False
    return options


FULLGRAPH_REASON = (
    "optmem runs its checkpoint plan in Python between the stages (re-runs, autograd.grad "
    "calls in the backward), so the wrapped model always breaks the graph here and "
    "torch.compile(..., fullgraph=True) cannot hold for it. Compile it without "
    "fullgraph=True (each stage still runs compiled, with your backend and dynamic=), or "
    "call cmodel.compile(fullgraph=True, ...) to compile every stage as one graph each (on "
    "an executor such as CheckpointedChain or DeltaChain, whose compile() is nn.Module's "
    "and fails the same way: executor.compile_stages(fullgraph=True, ...))")
"""The reason dynamo prints when ``torch.compile(cmodel, fullgraph=True)`` meets the plan.

Until stop 53 it named only the wrappers' ``cmodel.compile``: on an executor that is
``nn.Module.compile``, which compiles the executor's own ``forward`` with
``fullgraph=True`` and fails with this same error.
"""


def _disable(reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``torch.compiler.disable(recursive=False, reason=reason)`` (no reason before 2.7)."""
    try:
        return torch.compiler.disable(recursive=False, reason=reason)  # type: ignore[call-arg,no-any-return]
    except TypeError:  # pragma: no cover - a torch without ``reason=``
        return torch.compiler.disable(recursive=False)  # type: ignore[no-any-return]


@_disable(FULLGRAPH_REASON)
def run_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args, options)``, ``options`` those of the enclosing ``torch.compile``.

    Called from a module's ``forward`` while dynamo compiles it: dynamo breaks the graph
    here and runs this function uncompiled, its frame callback still set, so that
    :func:`enclosing_compile_options` finds the enclosing compile's backend. ``fn`` must
    be wrapped in ``torch.compiler.disable`` (the executor's plan runs uncompiled, its
    stages compiled with ``options``). Under ``torch.compile(..., fullgraph=True)`` dynamo
    refuses to skip this function and its error carries :data:`FULLGRAPH_REASON`, which says
    what to do instead.
    """
    return fn(*args, enclosing_compile_options())


def compile_stage(module: nn.Module, options: dict[str, Any]) -> Callable[[Any], Any]:
    """``module`` compiled with ``torch.compile(**options)``, with a cache of its own.

    Dynamo keeps its compiled graphs per code object; stages of one class (every
    ``GraphStage``, twelve identical blocks) share ``forward``'s code and would exhaust the
    recompile limit. A stage that knows how (``compiled_call``: extracted stages compile
    their own graph module) does it itself; any other module is called from a function
    with a code object of its own.
    """
    make = getattr(module, "compiled_call", None)
    if make is not None:
        return make(lambda m: compile_stage(m, options), options)
    namespace: dict[str, Any] = {"stage": module}
    code = compile("def run(x):\n    return stage(x)\n", f"<optmem stage {id(module):x}>",
                   "exec")
    exec(code, namespace)  # noqa: S102 - a fixed one-line trampoline
    return torch.compile(namespace["run"], **options)


def run_in_order(functions: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    """The stages one after the other (no plan: inference, or nothing needs a gradient)."""
    for f in functions:
        x = f(x)
    return x


SETUP_CACHE_SIZE = 8
"""How many plans an executor keeps the parameter setup of (:class:`_SetupCache`)."""


_VALUES = operator.methodcaller("values")
"""``d.values()``: a ``_parameters`` dict, or torch's wrapper of one on a scripted module."""


class _SetupCache:
    """What :meth:`PlanRunner.collect_parameters` found for one plan, while it stays valid.

    Valid while the key (chain length, runner class, fusion options, which stages are FSDP
    units) is the same, the stages hold the same module objects, and every
    ``_parameters`` dict of those modules holds the same parameter objects with the same
    ``requires_grad``: a parameter replaced (``load_state_dict(assign=True)``), frozen or
    unfrozen, or a submodule added or swapped, is seen at the next step. Checking this
    touches each dict once (tens of microseconds on BERT's 105-stage chain), where
    collecting walks every module and deduplicates (about 1.4 ms per step there, measured).
    """

    def __init__(self, key: tuple[Any, ...], modules: list[list[nn.Module]]) -> None:
        self.key = key
        self.source = modules  # the stage_modules() lists it was made from
        self.modules = [m for mods in modules for m in mods]
        self.dicts = [m._parameters for m in self.modules]
        self.lens = list(map(len, self.dicts))
        self.params = list(itertools.chain.from_iterable(map(_VALUES, self.dicts)))
        self.flags = [p is not None and p.requires_grad for p in self.params]
        self.setup: tuple[list[nn.Parameter], dict[int, list[int]], set[int], _Fusion,
                          list[tuple[int, list[int]]], list[int]] | None
        self.setup = None

    def valid(self, key: tuple[Any, ...], modules: list[list[nn.Module]]) -> bool:
        """Whether nothing the setup depends on changed (see the class docstring)."""
        if key != self.key:
            return False
        if modules is not self.source:  # rebuilt (set_plan): compare the module objects
            flat = [m for mods in modules for m in mods]
            if len(flat) != len(self.modules) or not all(map(operator.is_, flat,
                                                             self.modules)):
                return False
            self.source = modules
        if list(map(len, self.dicts)) != self.lens:
            return False
        params = list(itertools.chain.from_iterable(map(_VALUES, self.dicts)))
        return all(map(operator.is_, params, self.params)) and \
            [p is not None and p.requires_grad for p in params] == self.flags


class PlanRunner:
    """State of one forward/backward pass through the plan.

    ``fusable``: whether this runner may run the runs of :func:`fusable_runs` as one graph
    (a subclass that works on each stage's tape separately, such as the remat+offload
    runner, sets it to ``False``).
    """

    fusable = True
    joint_reruns = True  # dead F_all re-runs as joint graphs (a runner moving tapes says no)
    retains = True  # a retained backward re-runs the plan (else: replay_backward)

    def __init__(self, owner: CheckpointedChain, plan: tuple[Op, ...], n_stages: int) -> None:
        self.owner = owner
        self.plan = plan
        self.n = n_stages
        self.dead = owner.dead_reruns(plan, n_stages) if self.joint_reruns else frozenset()
        self.loss = plan.index(LOSS)
        counts = Counter(op.stage for op in plan if op.kind is not OpKind.B and op.stage)
        self.rerun = {s for s, c in counts.items() if c > 1}
        self.rng: dict[int, _RngState] = {}
        self.generators: dict[int, list[torch.Generator]] = {}  # the stages' own (re-runs)
        self.buffers: dict[int, _BufferSnapshot] = {}  # re-run stages' buffers, before
        self.bound: dict[int, _Parameters] = {}  # re-run stages' parameters at the first run
        self.ran: set[int] = set()
        self.storage: dict[int, _Slot] = {}
        self.input_requires_grad = False
        self.devices: list[int] = []
        self.autocast: list[tuple[str, torch.dtype]] = []
        self.autocast_cache = True  # the forward's torch.is_autocast_cache_enabled()
        self.context: SideInputs | None = None
        self.functions: list[Callable[[Any], Any]] = []
        self.current: list[torch.Tensor | None] = []
        self.in_leaves: list[Any] = []
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.outputs: list[torch.Tensor] = []  # a^n, from _PlanFunction to _Relay
        self.outputs_need_grad: list[bool] = []  # which of them autograd differentiates
        # a^n's differentiable outputs when there are several (one may be computed from
        # another inside the plan): checked for the caller's gradient hooks at the backward
        self.watched: list[weakref.ref[torch.Tensor]] = []
        self.read_later = _plan_reads(plan, n_stages)
        self.index = 0
        self.anchor = torch.empty(0, requires_grad=True)
        # parameters: inputs of the plan Function; stage_params[i] = their indices
        self.params: list[nn.Parameter] = []
        self.stage_params: dict[int, list[int]] = {}
        self.param_needed: list[bool] = []
        self.held: list[int] = []  # parameters whose gradients _PlanFunction returns
        self.releases: list[tuple[int, list[int]]] = []  # the others: (stop, params)
        self.param_grads: list[torch.Tensor | None] = []
        # FSDP2 units: parameters gathered at each run, gradients accumulated in .grad
        self.accumulating: set[int] = set()
        self.fusion = _Fusion(set(), {}, {}, set())
        self.holder = _GradHolder()
        # retain_graph / create_graph (:meth:`start_backward`, :meth:`replay_backward`)
        self.keep = False  # the running backward keeps the graph (retain_graph=True)
        self.retained: dict[int, _Slot] | None = None  # storage after the forward, kept
        self.replayed = False  # the running backward re-ran the stages (replay_backward)
        self.input_refs: list[weakref.ref[torch.Tensor]] = []  # a^0's tensors, weakly
        self.in_spec: Any = None
        self.in_others: list[Any] = []  # a^0's leaves, tensors as None
        self.start_rng: _RngState | None = None  # before the forward's first stage
        self.input_grads: list[torch.Tensor | None] = []  # of a replayed backward
        # buffers of the stages run once, with their versions before that run
        self.once: dict[int, list[tuple[dict[str, Any], str, torch.Tensor, int]]] = {}

    def collect_parameters(self) -> None:
        """The parameters (requiring grad) of stages ``1..n``, each once.

        An FSDP2 unit (``fully_shard(stage)``) is left out: it swaps in gathered parameters
        each time it runs, and its gradients must reach them through ``.grad`` (FSDP's
        hooks reduce-scatter them from there), so its ``B`` runs ``autograd.backward``.

        What is found depends only on the plan, the stages' current parameters (and their
        ``requires_grad``) and which stages are FSDP units: it is kept by the executor
        (:class:`_SetupCache`) and reused while none of these changed, instead of walking
        every stage's modules at every step.
        """
        cache = self.owner.setup_cache(self.plan, self.n, type(self))
        if cache.setup is None:
            self._collect_parameters()
            self.releases = self.release_groups()
            released = {k for _, ks in self.releases for k in ks}
            self.held = [k for k in range(len(self.params)) if k not in released]
            cache.setup = (list(self.params), self.stage_params, set(self.accumulating),
                           self.fusion, self.releases, list(self.held))
        else:
            params, self.stage_params, accumulating, self.fusion, self.releases, held = \
                cache.setup
            self.params, self.accumulating, self.held = list(params), set(accumulating), \
                list(held)
        if self.accumulating:  # an input that needs a gradient, so that backward() runs
            self.held.append(len(self.params))  # returned by _PlanFunction
            self.params.append(self.anchor)  # type: ignore[arg-type]
        self.param_needed = [False] * len(self.params)

    def _collect_parameters(self) -> None:
        """:meth:`collect_parameters` without the cache (the anchor not appended)."""
        index: dict[int, int] = {}
        modules = self.owner.stage_modules()
        for i in range(1, self.n + 1):
            ids: list[int] = []
            if _is_fsdp_unit(self.owner.stages[i - 1]):
                self.accumulating.add(i)
                self.stage_params[i] = ids
                continue
            for p in _parameters_of(modules[i - 1]):
                if not p.requires_grad:
                    continue
                k = index.get(id(p))
                if k is None:
                    k = index[id(p)] = len(self.params)
                    self.params.append(p)
                ids.append(k)
            self.stage_params[i] = ids
        if self.fusable:
            runs = self.owner.fusion_runs(self.plan, self.n)
            if runs:
                self.fusion = _split_runs(runs, self.stage_params, self.accumulating)

    def _generators(self, i: int) -> list[torch.Generator]:
        """The generators stage ``i``'s modules hold (found once per run of the plan)."""
        if i not in self.generators:
            self.generators[i] = module_generators(self.owner.stage_modules()[i - 1])
        return self.generators[i]

    # -------------------------------------------------------------- ops
    def _run_stage(self, op: Op) -> None:
        i = op.stage
        if i - 1 not in self.storage or self.storage[i - 1].value is None:
            raise PlanError(f"{op} needs a^{i - 1}, which is not stored")
        src = self.storage[i - 1].value
        call = self.functions[i - 1] if self.functions else self.owner.stages[i - 1]
        first = i not in self.ran
        with ExitStack() as stack:
            if current_side_inputs_or_none() is not self.context:
                # in the backward (the forward runs inside the call's own side inputs)
                stack.enter_context(side_inputs(self.context))
            if not first:
                stack.enter_context(torch.random.fork_rng(devices=self.devices, enabled=True))
                stack.enter_context(generators_restored(self._generators(i)))
                if i in self.rng:
                    self.rng[i].restore()
                for device_type, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                       cache_enabled=self.autocast_cache))
            elif self.owner.preserve_rng_state and i in self.rerun:
                self.rng[i] = _RngState(self.devices, self._generators(i))
            if not first and i in self.bound:
                stack.enter_context(self.bound[i].bound())
            elif i in self.rerun and i not in self.accumulating:  # an FSDP unit swaps its own
                self.bound[i] = _Parameters(self.owner.stage_modules()[i - 1],
                                            f"stage {i} ({self.owner.stage_names[i - 1]})")
            if not first and self.owner.restore_buffers:
                stack.enter_context(_scratch_buffers(self.owner.stage_modules()[i - 1],
                                                     self.buffers.get(i)))
            elif self.owner.restore_buffers and i in self.rerun:
                self.buffers[i] = _BufferSnapshot(self.owner.stage_modules()[i - 1])
            elif self.owner.restore_buffers:  # run once: a replay checks its buffers
                versions = _buffer_versions(self.owner.stage_modules()[i - 1])
                if versions:
                    self.once[i] = versions
            if op.kind is OpKind.F_ALL and self.index in self.dead:
                call = self._joint_call(i, call)
            if op.kind is OpKind.F_ALL and self.index in self.fusion.link:
                self.storage[i] = _Slot(self._run_linked(src, call), _Tape())
            elif op.kind is OpKind.F_ALL:
                tape = _Tape()
                with torch.enable_grad():
                    inp = self._sources(src, tape, i > 1 or self.input_requires_grad)
                    out = call(inp)
                del inp
                outs = value_tensors(out)
                tape.out_edges = [get_gradient_edge(t) if t.requires_grad else None
                                  for t in outs]
                if i not in self.accumulating:
                    self.owner._check_leaves(i, outs, self.params, self.stage_params[i])
                del outs
                self.storage[i] = _Slot(out, tape)
            else:
                with torch.no_grad():
                    out = call(src)
                self.storage[i] = _Slot(out)
        made = self.storage[i].tape
        if made is not None:
            made.kept = self.index < self.loss
        if first and i in self.buffers and not self.buffers[i].keep_changed():
            del self.buffers[i]
        if i in self.accumulating:
            following = self.plan[self.index + 1] if self.index + 1 < len(self.plan) else None
            _reshard_after_run(self.owner.stages[i - 1], self.storage[i].value,
                               backward_next=following == Op(OpKind.B, i))
        self.ran.add(i)
        if self.index in self.fusion.close:
            self._close_run(*self.fusion.close[self.index])
        if op.kind is OpKind.F_NONE:
            del self.storage[i - 1]
        elif not self.read_later[self.index] and self.owner.release_early:
            self.storage[i - 1].value = None  # nobody reads a^{i-1} again: drop it

    def _joint_call(self, i: int, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``call``, or a joint re-run of stage ``i`` (:mod:`optmem.pytorch.joint`).

        Allowed for the stage as it is (not compiled), without autocast, not an FSDP unit.
        """
        stage = self.owner.stages[i - 1]
        if (self.autocast or i in self.accumulating or not self.owner.joint_reruns
                or (self.functions and self.functions[i - 1] is not stage)):
            return call
        joint = self.owner.joint_stage(i)

        def run(x: Any) -> Any:
            out = joint.call(x, current_side_inputs_or_none())
            return call(x) if out is None else out

        return run

    @staticmethod
    def _run_linked(src: Any, call: Callable[[Any], Any]) -> Any:
        """A stage inside a fused run: its input is the previous stage's output, as is."""
        with torch.enable_grad():
            return call(src)

    def _close_run(self, i: int, j: int) -> None:
        """The last stage ``j`` of a fused run: leaves checked, the sink built."""
        slot = self.storage[j]
        tape = slot.tape
        assert tape is not None
        outs = value_tensors(slot.value)
        mine = [k for s in range(i, j + 1) for k in self.stage_params[s]]
        self.owner._check_leaves(i, outs, self.params, mine, last=j)
        tape.sunk = [t.requires_grad for t in outs]
        taken = [t for t in outs if t.requires_grad]
        if taken:
            with torch.enable_grad():
                tape.sink = _Sink.apply(self.holder, *taken)

    def _backward_group(self, i: int, j: int) -> None:
        """``B j .. B i`` of a fused run: one ``autograd.grad`` call from its sink.

        The inputs are the run's input edges and all its stages' parameters; each parameter
        belongs to one stage of the run (:func:`_split_runs`), so the sums over stages are
        the executor's, in ``B`` order, as without fusion.
        """
        last, first = self.storage.get(j), self.storage.get(i)
        if last is None or last.tape is None or first is None or first.tape is None:
            raise PlanError(f"B {j} needs the tapes of stages {i}..{j}, which are not stored")
        sink, sunk = last.tape.sink, last.tape.sunk
        current = self.current
        grads = [current[k] if k < len(current) else None for k, s in enumerate(sunk) if s]
        in_edges = first.tape.in_edges
        wanted = [e for e in in_edges if e is not None]
        params = [k for s in range(i, j + 1) for k in self.stage_params[s]
                  if self.param_needed[k]]
        got: Sequence[torch.Tensor | None]
        if sink is not None and any(g is not None for g in grads) and (wanted or params):
            self.current = []
            self.holder.grads = grads
            del grads, current
            targets: list[Any] = [*wanted, *(self.params[k] for k in params)]
            retain = self.keep and any(self.storage[s].tape.kept  # type: ignore[union-attr]
                                       for s in range(i, j + 1))
            with quiet_gradient_hooks(targets[len(wanted):], post_accumulate=False):
                got = torch.autograd.grad([sink], targets, [torch.empty(0)],
                                          allow_unused=True, retain_graph=retain)
        else:
            got = [None] * (len(wanted) + len(params))
        self._take_gradients(in_edges, params, got, len(wanted))
        for s in range(j, i - 1, -1):
            del self.storage[s]
        prev = self.storage.get(i - 1)
        if prev is not None and prev.tape is None:
            del self.storage[i - 1]

    def _take_gradients(self, in_edges: list[GradientEdge | None], params: list[int],
                        got: Sequence[torch.Tensor | None], n_wanted: int) -> None:
        """``delta^{i-1}`` from the input edges' gradients; parameter gradients summed."""
        it = iter(got[:n_wanted])
        self.current = [next(it) if e is not None else None for e in in_edges]
        for k, g in zip(params, got[n_wanted:], strict=True):
            if g is not None:
                acc = self.param_grads[k]
                self.param_grads[k] = g if acc is None else acc + g

    def _sources(self, value: Any, tape: _Tape, requires_grad: bool) -> Any:
        """The stage input: float tensors go through :class:`_Source` (an edge to ask for)."""
        if isinstance(value, torch.Tensor):  # the common case, without pytree
            return self._source(value, tape, requires_grad)
        leaves, spec = tree_flatten(value)
        out = []
        for v in leaves:
            out.append(self._source(v, tape, requires_grad) if isinstance(v, torch.Tensor)
                       else v)
        return tree_unflatten(out, spec)

    def _source(self, v: torch.Tensor, tape: _Tape, requires_grad: bool) -> torch.Tensor:
        """One input tensor of a stage (its edge, or ``None``, appended to the tape)."""
        if requires_grad and (v.is_floating_point() or v.is_complex()):
            # detached: the previous stage's graph must not be reachable from here
            t = _Source.apply(v.detach(), self.anchor)
            tape.in_edges.append(get_gradient_edge(t))
            return t
        tape.in_edges.append(None)
        return v.detach()

    def _backward(self, i: int) -> None:
        slot = self.storage.get(i)
        if slot is None or slot.tape is None:
            raise PlanError(f"B {i} needs the tape of stage {i}, which is not stored")
        edges, grads = [], []
        for e, g in zip(slot.tape.out_edges, self.current, strict=False):
            if e is not None and g is not None:
                edges.append(e)
                grads.append(g)
        in_edges = slot.tape.in_edges
        wanted = [e for e in in_edges if e is not None]
        params = [k for k in self.stage_params.get(i, ()) if self.param_needed[k]]
        got: Sequence[torch.Tensor | None]
        retain = self.keep and slot.tape.kept  # a retained backward keeps the forward's tapes
        if edges and i in self.accumulating:
            got = _backward_accumulating(edges, grads, wanted, retain)
        elif edges and (wanted or params):
            targets: list[Any] = [*wanted, *(self.params[k] for k in params)]
            with quiet_gradient_hooks(targets[len(wanted):], post_accumulate=False):
                got = torch.autograd.grad(edges, targets, grads, allow_unused=True,
                                          retain_graph=retain)
        else:
            got = [None] * (len(wanted) + len(params))
        self._take_gradients(in_edges, params, got, len(wanted))
        del self.storage[i]
        prev = self.storage.get(i - 1)
        if prev is not None and prev.tape is None:
            del self.storage[i - 1]

    def _run(self, op: Op) -> None:
        if op.kind is OpKind.B:
            if self.index in self.fusion.start:
                self._backward_group(*self.fusion.start[self.index])
            elif self.index not in self.fusion.skip:
                self._backward(op.stage)
        else:
            self._run_stage(op)
        self.index += 1
        if _MONITORS:
            live = [t for s in self.storage.values() for t in value_tensors(s.value)]
            grads = [g for g in self.current if g is not None]
            for fn in list(_MONITORS):
                fn(str(op), live, grads)

    # -------------------------------------------------------------- phases
    def forward(self, value: Any) -> list[torch.Tensor]:
        self.storage[0] = _Slot(value)
        if self.owner.preserve_rng_state and 1 not in self.rerun:
            self.start_rng = _RngState(self.devices)  # replay_backward starts there (else
            # from stage 1's state, taken before its first run: the same)
        for op in self.plan[:self.loss]:
            self._run(op)
        if self.n not in self.storage or self.storage[self.n].value is None:
            raise PlanError(f"Loss needs a^{self.n}, which is not stored")
        slot = self.storage[self.n]
        leaves, self.out_spec = tree_flatten(slot.value)
        self.out_leaves = leaves
        if slot.tape is None:
            del self.storage[self.n]
        elif not self.read_later[self.loss] and self.owner.release_early:
            slot.value = None
        self.index = self.loss + 1
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        # an output computed with its tape (under grad) that needs none stays so, as in the
        # model (the part of the forward after it ran under no_grad, or read no parameter)
        self.outputs_need_grad = [t.requires_grad or slot.tape is None for t in tensors]
        return [t.detach() for t in tensors]

    def begin_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Run the ops after ``Loss`` up to the first ``B`` (which consumes ``delta^n``)."""
        self.current = list(grads)
        self.param_grads = [None] * len(self.params)
        self.index = self.loss + 1
        while self.index < len(self.plan):
            op = self.plan[self.index]
            self._run(op)
            if op.kind is OpKind.B:
                break

    def release_groups(self) -> list[tuple[int, list[int]]]:
        """Parameters grouped by the plan index of each ``B`` op that adds to them.

        After that op the parameter's contribution from that stage is complete:
        :class:`_Release` hands it to autograd there, which sums the contributions of a
        parameter that several stages use (a tied embedding) in the order they arrive, as
        for the unmodified module, also with those made outside the plan (a native suffix's
        head, the caller's graph), and after the last one sets its ``.grad`` and runs its
        gradient hooks (DDP's reducer) while the plan's backward goes on. Latest index
        first (the order the nodes are made in).
        """
        groups: dict[int, list[int]] = {}
        for idx in range(self.loss + 1, len(self.plan)):
            op = self.plan[idx]
            if op.kind is OpKind.B:
                for k in self.stage_params.get(op.stage, ()):
                    groups.setdefault(idx, []).append(k)
        return sorted(groups.items(), reverse=True)

    def run_through(self, stop: int) -> None:
        """Run the plan's ops up to index ``stop`` (included)."""
        while self.index <= stop:
            self._run(self.plan[self.index])

    def backward(self, grads: Sequence[torch.Tensor | None] | None = None
                 ) -> list[torch.Tensor | None]:
        """Run the rest of the plan (all of it after ``Loss`` when ``grads`` are given)."""
        if grads is not None:
            self.begin_backward(grads)
        while self.index < len(self.plan):
            self._run(self.plan[self.index])
        out = self.current
        self.storage.clear()
        self.current = []
        if not self.keep:
            self.context = None
        return out

    # -------------------------------------------------------------- retained backward
    def start_backward(self, keep: bool) -> None:
        """Before a backward of the plan: keep the forward's storage if the graph is kept.

        A backward with ``retain_graph=True`` (``keep``) runs on copies of the slots the
        forward left (checkpoints and tapes, whose graphs its ``B`` ops retain), so the
        next backward starts from them again; the last one (``keep`` false) consumes them,
        freeing as a single backward does.
        """
        self.keep = keep
        self.replayed = False
        if self.retained is not None:
            self.storage = _copy_slots(self.retained) if keep else self.retained
            if not keep:
                self.retained = None
        elif keep:
            self.retained = _copy_slots(self.storage)

    def replay_backward(self, grads: Sequence[torch.Tensor | None], keep: bool) -> None:
        """The whole backward by re-running stages ``1..n`` from ``a^0`` as one graph.

        For a double backward (grad mode on inside the backward: ``create_graph=True``),
        and for a retained backward of a runner that cannot re-run its plan
        (:attr:`retains` false): the stages run under grad as in the unmodified module
        (the forward's RNG states, buffers as before their first run, the parameters of
        the first run, side inputs, autocast), then one ``torch.autograd.grad`` over that
        graph (``create_graph`` as the caller asked) gives the gradients of ``a^0``'s
        tensors and of the parameters; the nodes of the plan hand them out. Memory: the
        store-all peak of the plan's stages. The forward's storage is left as it is for a
        later backward.
        """
        if self.accumulating:
            raise RuntimeError("double backward (create_graph=True) through a plan with "
                               "FSDP units is not supported")
        self.keep, self.replayed = keep, True
        if not keep:  # the last backward: the forward's checkpoints are not needed
            self.storage.clear()
            self.retained = None
        create_graph = torch.is_grad_enabled()
        inputs = self._replay_inputs()
        with torch.enable_grad():
            outs = value_tensors(self._replay_stages(inputs))
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad]
        wanted = [k for k, t in enumerate(inputs) if t.requires_grad]
        params = [k for k in range(len(self.params)) if self.param_needed[k]]
        targets = [*(inputs[k] for k in wanted), *(self.params[k] for k in params)]
        got: Sequence[torch.Tensor | None] = [None] * len(targets)
        if pairs and targets:
            with quiet_gradient_hooks(targets, post_accumulate=False), \
                    torch.set_grad_enabled(create_graph):
                got = torch.autograd.grad([o for o, _ in pairs], targets,
                                          [g for _, g in pairs], allow_unused=True,
                                          create_graph=create_graph)
        del outs, pairs
        if create_graph:
            refuse_underivable(got, [t.grad_fn for t in inputs if t.grad_fn is not None])
        self.input_grads = [None] * len(inputs)
        for k, g in zip(wanted, got[:len(wanted)], strict=True):
            self.input_grads[k] = g
        self.param_grads = [None] * len(self.params)
        for k, g in zip(params, got[len(wanted):], strict=True):
            self.param_grads[k] = g

    def _replay_inputs(self) -> list[torch.Tensor]:
        """The tensors of ``a^0`` (the caller's, with their graph), alive or an error."""
        inputs = []
        for ref in self.input_refs:
            t = ref()
            if t is None:
                raise RuntimeError(
                    "a double backward (create_graph=True) through the optmem plan (or a "
                    "retained backward of a remat + offload plan) re-runs its stages from "
                    "the plan's input, which was freed: keep a reference to the tensors "
                    "passed to the wrapped module until that backward")
            inputs.append(t)
        return inputs

    def _replay_stages(self, inputs: list[torch.Tensor]) -> Any:
        """Stages ``1..n`` run under grad from ``inputs``, as the forward ran them."""
        it = iter(inputs)
        leaves = [next(it) if v is None else v for v in self.in_others]
        value = tree_unflatten(leaves, self.in_spec)
        with ExitStack() as stack:
            if current_side_inputs_or_none() is not self.context:
                stack.enter_context(side_inputs(self.context))
            stack.enter_context(torch.random.fork_rng(devices=self.devices, enabled=True))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=self.autocast_cache))
            if self.start_rng is not None:
                self.start_rng.restore()
            for i in range(1, self.n + 1):
                value = self._replay_stage(i, value)
        return value

    def _replay_stage(self, i: int, value: Any) -> Any:
        """Stage ``i`` run again (RNG, buffers and parameters as at its first run)."""
        modules = self.owner.stage_modules()[i - 1]
        with ExitStack() as stack:
            generators = self._generators(i)
            if generators:
                if self.owner.preserve_rng_state and i not in self.rng:
                    raise RuntimeError(
                        f"stage {i} ({self.owner.stage_names[i - 1]}) holds a "
                        "torch.Generator of its own, whose state before its only run was "
                        "not saved: a double backward (or a retained backward of a remat + "
                        "offload plan), which re-runs the plan's stages, cannot replay it")
                stack.enter_context(generators_restored(generators))
            if i in self.rng:
                self.rng[i].restore()
            if i in self.bound:
                stack.enter_context(self.bound[i].bound())
            if any((d[name] if name in d else None) is not buf  # noqa: SIM401 - jit's dict
                   or buf._version != version
                   for d, name, buf, version in self.once.get(i, ())):
                raise RuntimeError(
                    f"stage {i} ({self.owner.stage_names[i - 1]}) updated its buffers in "
                    "its only run (BatchNorm's running statistics, spectral norm's power "
                    "iteration), whose values before it were not saved: a double backward "
                    "(or a retained backward of a remat + offload plan), which re-runs the "
                    "plan's stages, cannot re-run it as it ran; use the unwrapped model for "
                    "it")
            if self.owner.restore_buffers:
                stack.enter_context(_scratch_buffers(modules, self.buffers.get(i)))
            return self.owner.stages[i - 1](value)


def _buffer_versions(modules: Sequence[nn.Module]
                     ) -> list[tuple[dict[str, Any], str, torch.Tensor, int]]:
    """Every buffer of ``modules``: its dict, name, tensor and version now."""
    return [(m._buffers, name, buf, buf._version) for m in modules
            for name, buf in m._buffers.items() if buf is not None]


def _copy_slots(storage: dict[int, _Slot]) -> dict[int, _Slot]:
    """New slots holding the same values and tapes (a backward may empty its slots)."""
    return {k: _Slot(slot.value, slot.tape) for k, slot in storage.items()}


def graph_kept() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``).

    Read from autograd's current graph task (a private API: without it, ``False``, and a
    second backward through the plan raises as it did before stop 81).
    """
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if get is None:  # pragma: no cover - another torch
        return False
    try:
        return bool(get())
    except RuntimeError:  # pragma: no cover - not inside a backward
        return False


class _PlanFunction(torch.autograd.Function):
    """Runs the plan: ops before ``Loss`` in forward, the rest of the plan in backward.

    Inputs: the tensors of ``a^0`` then the parameters the :class:`_Release` nodes do not
    hand over (``runner.held``: the FSDP anchor); it returns the gradients of both. Its
    output is a token that the release nodes, then :class:`_Relay`, pass on.
    """

    @staticmethod
    def forward(ctx: Any, runner: PlanRunner, treespec: Any, n_inputs: int,
                *args: torch.Tensor) -> torch.Tensor:
        inputs = args[:n_inputs]
        it = iter(t.detach() for t in inputs)
        leaves = [next(it) if isinstance(v, torch.Tensor) else v for v in runner.in_leaves]
        # weakly, for a double backward's replay (the normal path keeps only what it reads)
        runner.input_refs = [weakref.ref(t) for t in inputs]
        runner.in_spec = treespec
        runner.in_others = [None if isinstance(v, torch.Tensor) else v
                            for v in runner.in_leaves]
        runner.in_leaves = []
        runner.outputs = runner.forward(tree_unflatten(leaves, treespec))
        for k, need in zip(runner.held, ctx.needs_input_grad[3 + n_inputs:], strict=True):
            runner.param_needed[k] = need
        ctx.runner = runner
        ctx.n_inputs = n_inputs
        return torch.zeros(())

    @staticmethod
    @backward_outside_dynamo
    def backward(ctx: Any, token: torch.Tensor | None) -> Any:
        runner = _take_runner(ctx)
        input_grads = runner.input_grads if runner.replayed else runner.backward()
        runner.input_grads = []
        in_grads = list(input_grads) + [None] * (ctx.n_inputs - len(input_grads))
        return (None, None, None, *in_grads[:ctx.n_inputs],
                *(runner.param_grads[k] for k in runner.held))


class _Release(torch.autograd.Function):
    """Hands autograd the gradients that the ``B`` op at ``stop`` adds to its parameters.

    One node per such op, chained by tokens between :class:`_PlanFunction` and
    :class:`_Relay`, so that the backward reaches them in the plan's order: each runs the
    plan up to ``stop`` and returns that stage's contributions. Autograd sums a parameter's
    contributions in the order they arrive (from these nodes and from uses outside the
    plan), then accumulates them into ``.grad`` and runs its hooks (DDP's reducer starts
    its all-reduce) while the plan's backward goes on, as it does stage by stage for the
    unmodified module.
    """

    @staticmethod
    def forward(ctx: Any, runner: PlanRunner, stop: int, indices: list[int],
                token: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        for k, need in zip(indices, ctx.needs_input_grad[4:], strict=True):
            runner.param_needed[k] = need
        ctx.runner, ctx.stop, ctx.indices = runner, stop, indices
        return torch.zeros(())

    @staticmethod
    @backward_outside_dynamo
    def backward(ctx: Any, token: torch.Tensor | None) -> Any:
        runner = _take_runner(ctx)
        if not runner.replayed:
            runner.run_through(ctx.stop)
        grads = [runner.param_grads[k] for k in ctx.indices]
        for k in ctx.indices:  # autograd holds them from here (no second reference)
            runner.param_grads[k] = None
        return (None, None, None, torch.zeros(()), *grads)


class _Relay(torch.autograd.Function):
    """Hands the chain output ``a^n`` to autograd; its backward runs the plan up to ``B n``.

    The gradient ``delta^n`` that autograd passes to a Function's backward stays alive until
    that backward returns. Running the first ``B`` (which consumes ``delta^n``) here and the
    rest of the plan in :class:`_PlanFunction`'s backward frees ``delta^n`` at ``B n``, as
    the simulator counts it, instead of holding it (the gradient of the logits, say)
    through the whole backward.
    """

    @staticmethod
    def forward(ctx: Any, runner: PlanRunner, token: torch.Tensor) -> Any:
        outputs, runner.outputs = runner.outputs, []
        need = runner.outputs_need_grad or [True] * len(outputs)
        non_diff = [t for t, n in zip(outputs, need, strict=True)
                    if not n or not (t.is_floating_point() or t.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        ctx.set_materialize_grads(False)  # an output without gradient stays None, not zeros
        ctx.runner = runner
        return tuple(outputs)

    @staticmethod
    @backward_outside_dynamo
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        runner = _take_runner(ctx)
        warn_hooked_outputs(runner.watched)
        keep = graph_kept()
        if torch.is_grad_enabled() or (keep and not runner.retains):
            runner.replay_backward(grads, keep)  # create_graph=True: a differentiable one
        else:
            runner.start_backward(keep)
            runner.begin_backward(grads)
        return None, torch.zeros(())


HOOKED_OUTPUT_WARNING = (
    "optmem: a gradient hook or retain_grad() is on an output of the plan that is not its "
    "only differentiable one; it sees only the gradient that reaches it from outside the "
    "plan. What the plan computed from it (later layers from a hidden state, the loss from "
    "the logits under remat_offload) back-propagates inside the plan's backward, not "
    "through that tensor, so its .grad (None when only the loss is backpropagated) and the "
    "hook's argument are not the model's there; the parameters' gradients are. Read such "
    "gradients from the unwrapped model.")


def warn_hooked_outputs(watched: Sequence[weakref.ref[torch.Tensor]]) -> None:
    """One warning when a tensor of ``watched`` has a gradient hook or retains its gradient.

    Examples
    --------
    >>> import warnings
    >>> x = torch.ones(2, requires_grad=True)
    >>> y, z = x * 2, x * 3
    >>> warn_hooked_outputs([weakref.ref(y), weakref.ref(z)])  # no hook: silent
    >>> _ = z.retain_grad()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_hooked_outputs([weakref.ref(y), weakref.ref(z)])
    >>> len(caught)
    1
    """
    for ref in watched:
        t = ref()
        if t is not None and (t.retains_grad or t._backward_hooks):
            warnings.warn(HOOKED_OUTPUT_WARNING, stacklevel=2)
            return


def _take_runner(ctx: Any) -> PlanRunner:
    """The runner of a plan Function; let go of unless the backward keeps the graph.

    A backward after one that did not keep it (no ``retain_graph=True``) is refused, as
    autograd refuses it for the unmodified module.
    """
    runner: PlanRunner | None = ctx.runner
    if runner is None:
        raise RuntimeError("the checkpointed plan was already backpropagated without "
                           "retain_graph=True (it freed its saved values, as autograd "
                           "does); pass retain_graph=True to the earlier backward, or run "
                           "the forward again")
    if not graph_kept():
        ctx.runner = None
    return runner


class CheckpointedChain(StageCalls, nn.Module):
    """A chain of stages that trains by following a checkpoint plan.

    Parameters
    ----------
    stages
        The stages (from :func:`~optmem.pytorch.extract.extract_stages`); parameters are
        shared with the original module.
    plan
        Checkpoint ops (strings or :class:`~optmem.plan.Op`) over ``len(stages)`` stages.
    preserve_rng_state
        Restore the RNG state for re-run stages (dropout identical to the unmodified module).
    restore_buffers
        Undo buffer updates (BatchNorm running statistics) of re-run stages, and re-run a
        stage from its buffers as they were before its first run (a stage whose output
        reads a buffer it updates: an EMA normaliser, spectral norm, a VQ codebook).
    strip_suffix
        Run the store-all suffix of the plan as ordinary autograd code.
    release_early
        Drop an activation as soon as no later op of the plan reads it (the tape keeps what
        autograd saved); otherwise it is kept until the simulator frees it. Either way the
        memory stays within the plan's simulated peak; early release is often well below.
    fuse_stages
        Tape each run of :func:`fusable_runs` (``F_all i..F_all j`` mirrored by ``B j..B i``)
        as one autograd graph and back-propagate it with one call (with ``release_early``
        only): same ops, tape and gradients (bitwise), fewer autograd calls. Monitors see
        every op; the run's backward happens at its ``B j``, its other ``B`` ops do nothing.
    joint_reruns
        Run an ``F_all i`` whose output no later op reads (:func:`~optmem.pytorch.joint.
        dead_outputs`: the last stage of a re-run segment) and its ``B i`` as one traced
        forward-and-backward graph (:mod:`optmem.pytorch.joint`): the ops that only feed
        ``a^i`` are not re-run (torch's checkpoint *early stop*, without its hooks), same
        gradients (bitwise). Extracted graph stages only; not under autocast, with compiled
        stages or for FSDP units (they re-run as before).

    Notes
    -----
    Under ``torch.no_grad()`` (or when neither the input nor any parameter requires grad)
    the stages simply run one after the other.
    """

    def __init__(self, stages: Sequence[Stage | nn.Module], plan: Sequence[str | Op], *,
                 preserve_rng_state: bool = True, restore_buffers: bool = True,
                 strip_suffix: bool = True, release_early: bool = True,
                 fuse_stages: bool = True, joint_reruns: bool = True) -> None:
        super().__init__()
        mods = [s.module if isinstance(s, Stage) else s for s in stages]
        self.stage_names = [s.name if isinstance(s, Stage) else f"stage{k + 1}"
                            for k, s in enumerate(stages)]
        self.stages = nn.ModuleList(mods)
        self.preserve_rng_state = preserve_rng_state
        self.restore_buffers = restore_buffers
        self.strip_suffix = strip_suffix
        self.release_early = release_early
        self._leaves_checked: set[int | tuple[int, int]] = set()
        self.fuse_stages = fuse_stages
        self.joint_reruns = joint_reruns
        self._joints: dict[int, JointStage] = {}
        self._dead_cache: tuple[tuple[Op, ...], frozenset[int]] | None = None
        self._fusion_cache: tuple[tuple[Op, ...], tuple[_Run, ...]] | None = None
        self._setup_caches: dict[tuple[Op, ...], _SetupCache] = {}
        self._stage_modules: list[list[nn.Module]] | None = None
        self.set_plan(plan)

    def set_plan(self, plan: Sequence[str | Op]) -> None:
        """Replace the plan (validated against the simulator's op rules)."""
        ops = parse_plan(plan)
        self._check_plan(ops)
        self.plan: tuple[Op, ...] = ops
        self._stage_modules = None
        for joint in self._joints.values():
            joint.forget_modules()
        if self.strip_suffix:
            self._prefix_plan, self._suffix_start = split_suffix(ops, len(self.stages))
        else:
            self._prefix_plan, self._suffix_start = ops, len(self.stages) + 1

    def fusion_runs(self, plan: tuple[Op, ...], n: int) -> tuple[_Run, ...]:
        """:func:`fusable_runs` of ``plan`` (made once per plan); none without fusion."""
        if not (self.fuse_stages and self.release_early):
            return ()
        cache = self._fusion_cache
        if cache is None or cache[0] is not plan:
            cache = self._fusion_cache = (plan, fusable_runs(plan, n))
        return cache[1]

    def dead_reruns(self, plan: tuple[Op, ...], n: int) -> frozenset[int]:
        """:func:`~optmem.pytorch.joint.dead_outputs` of ``plan`` (made once per plan)."""
        cache = self._dead_cache
        if cache is None or cache[0] is not plan:
            cache = self._dead_cache = (plan, frozenset(dead_outputs(plan, n)))
        return cache[1]

    def joint_stage(self, i: int) -> JointStage:
        """The :class:`~optmem.pytorch.joint.JointStage` of stage ``i`` (its traced graphs)."""
        joint = self._joints.get(i)
        if joint is None or joint.module is not self.stages[i - 1]:
            joint = self._joints[i] = JointStage(self.stages[i - 1])
        return joint

    def setup_cache(self, plan: tuple[Op, ...], n: int, runner: type) -> _SetupCache:
        """The :class:`_SetupCache` of ``plan``: kept if still valid, else a new empty one.

        The last :data:`SETUP_CACHE_SIZE` plans keep theirs (a benchmark that switches
        plans between steps, as ``bench_hf`` does, hits them too).
        """
        modules = self.stage_modules()
        key = (n, runner, self.fuse_stages, self.release_early,
               tuple(_is_fsdp_unit(m) for m in self.stages))
        cache = self._setup_caches.pop(plan, None)
        if cache is None or not cache.valid(key, modules):
            cache = _SetupCache(key, modules)
        self._setup_caches[plan] = cache  # most recent last
        while len(self._setup_caches) > SETUP_CACHE_SIZE:
            del self._setup_caches[next(iter(self._setup_caches))]
        return cache

    def stage_modules(self) -> list[list[nn.Module]]:
        """``list(stage.modules())`` of every stage, made once (again after :meth:`set_plan`).

        The executor reads the stages' parameters and buffers through these lists at every
        step (their current values: a parameter or buffer replaced later is seen); a
        submodule added to a stage after the first step needs a :meth:`set_plan`.
        """
        if self._stage_modules is None or len(self._stage_modules) != len(self.stages):
            self._stage_modules = [list(m.modules()) for m in self.stages]
        return self._stage_modules

    def _check_plan(self, ops: tuple[Op, ...]) -> None:
        from optmem.chain import Chain
        from optmem.simulate import simulate_checkpoint

        n = len(self.stages)
        unit = Chain.from_lists([0.0] * n, [0.0] * n, [1] * n, [1] * n, input_size=1)
        simulate_checkpoint(unit, ops)  # raises PlanError naming the bad op

    def _check_leaves(self, i: int, outs: list[torch.Tensor], params: list[nn.Parameter],
                      mine: list[int], last: int | None = None) -> None:
        """Refuse a stage whose graph reaches a leaf that is not one of its parameters.

        ``B i`` asks autograd for the gradients of the stage's own parameters only; the
        gradient of any other leaf would be lost. Checked at the first run of each stage,
        or of each fused run ``i..last`` (its graph, against the run's parameters).
        """
        key = i if last is None else (i, last)
        if key in self._leaves_checked:
            return
        self._leaves_checked.add(key)
        allowed = {id(params[k]) for k in mine}
        foreign = [t for t in _graph_leaves(outs) if id(t) not in allowed]
        if foreign:
            shapes = ", ".join(str(tuple(t.shape)) for t in foreign[:3])
            where = f"stage {i}" if last is None else f"stages {i}..{last}"
            raise OptmemInputError(
                f"{where} ({self.stage_names[i - 1]}) uses {len(foreign)} tensor(s) that "
                f"require grad but are not its parameters (shapes {shapes}): register them "
                "as parameters of the stage module (their gradient would be lost)",
                field="module")

    def _forward(self, x: Any, compiled: CompileRequest) -> Any:
        functions = self.stage_functions(compiled)
        params_need_grad = any(p.requires_grad for p in self.stages.parameters())
        input_needs_grad = any(t.requires_grad for t in value_tensors(x))
        if not torch.is_grad_enabled() or not (params_need_grad or input_needs_grad):
            return run_in_order(functions, x)
        j = self._suffix_start
        if j > 1:
            x = self._run_plan(self._prefix_plan, j - 1, x, input_needs_grad, functions)
        return run_in_order(functions[j - 1:], x)

    def _make_runner(self, plan: tuple[Op, ...], n: int) -> PlanRunner:
        """The object that executes ``plan`` (subclasses return a specialised runner)."""
        return PlanRunner(self, plan, n)

    def _run_plan(self, plan: tuple[Op, ...], n: int, x: Any, input_needs_grad: bool,
                  functions: list[Callable[[Any], Any]] | None = None) -> Any:
        runner = self._make_runner(plan, n)
        runner.input_requires_grad = input_needs_grad
        # only what the plan's stages read is kept into the backward (read_by)
        runner.context = read_by(current_side_inputs_or_none(), self.stages[:n])
        runner.functions = list(functions) if functions is not None else []
        runner.collect_parameters()
        tensors = value_tensors(x)
        # the CUDA RNGs a re-run restores: the input's devices and the stages' parameters'
        # (a chain placed over two GPUs draws its later dropout masks on the second)
        runner.devices = cuda_indices([*tensors, *runner.params])
        runner.autocast = autocast_modes()
        runner.autocast_cache = torch.is_autocast_cache_enabled()
        leaves, spec = tree_flatten(x)
        runner.in_leaves = leaves
        inputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        token = _PlanFunction.apply(runner, spec, len(inputs), *inputs,
                                    *(runner.params[k] for k in runner.held))
        for stop, ks in runner.releases:
            token = _Release.apply(runner, stop, ks, token, *(runner.params[k] for k in ks))
        outs = _Relay.apply(runner, token)
        differentiable = [t for t in outs if t.requires_grad]
        if len(differentiable) > 1:
            runner.watched = [weakref.ref(t) for t in differentiable]
        it = iter(outs)
        out_leaves = [next(it) if isinstance(v, torch.Tensor) else v for v in runner.out_leaves]
        runner.out_leaves = []
        return tree_unflatten(out_leaves, runner.out_spec)

    def extra_repr(self) -> str:  # noqa: D102
        return f"plan={len(self.plan)} ops, native suffix from stage {self._suffix_start}"


@torch.compiler.disable
def run_disabled(executor: Any, x: Any, compiled: CompileRequest) -> Any:
    """Run an executor outside dynamo (a graph break), its stages compiled.

    ``compiled``: ``True``, or the enclosing compile's options (:func:`run_compiled`).
    """
    return executor._forward(x, compiled)


@functools.cache
def _fsdp_module_class() -> type | None:
    """FSDP2's module class, imported once at the first use (not when optmem is imported)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return FSDPModule


def _is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` was applied to it)."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def _reshard_after_run(unit: nn.Module, out: Any, *, backward_next: bool = False) -> None:
    """Reshard an FSDP2 unit after a run that FSDP2 leaves gathered.

    FSDP2 reshards a unit after its forward (``reshard_after_forward``) unless the forward
    runs inside a backward (a re-run of the plan), where it leaves the parameters to the
    unit's post-backward hook and its root's final callback. Two cases, both resharded
    here:

    * a re-run inside the backward whose outputs need a gradient: the unit stayed gathered
      from the re-run until its ``B``, past the re-runs of the stages after it, where the
      chain (:func:`optmem.pytorch.distributed.fsdp_chain`) counts its parameters during
      its own ops only (a residual MLP's plan re-running three units held the three at once:
      3 x 1088 B above the claim; stop 78). Its ``B`` gathers them again
      (FSDP2's pre-backward hook), as after a first forward. Not when the plan's next op
      is the unit's own ``B`` (``backward_next``: the chain counts its parameters in both
      ops, and nothing runs between them; FSDP2's own activation checkpointing keeps them
      so too), nor for a unit that keeps its parameters after its forward
      (``reshard_after_forward=False``);
    * a run whose outputs need no gradient (its parameters frozen and its input without
      one, or a forward under ``no_grad``): no backward will reshard it. A frozen embedding
      re-run in the backward stayed gathered past the step, and the next step's forward
      failed in it ("got mixed torch.Tensor and DTensor", a hunt in stop 55: Qwen2, Llama,
      ViT, ResNet with their first half frozen).
    """
    if not any(t.requires_grad for t in value_tensors(out)):
        unit.reshard()  # type: ignore[operator]
        return
    if backward_next or torch._C._current_graph_task_id() == -1:  # not in a backward:
        return  # FSDP2 resharded it
    state = unit._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None) or \
        [getattr(state, "_fsdp_param_group", None)]
    if all(getattr(g, "_reshard_after_forward", True) for g in groups if g is not None):
        unit.reshard()  # type: ignore[operator]


def _parameters_of(modules: Sequence[nn.Module]) -> Iterator[nn.Parameter]:
    """``module.parameters()`` from the list ``list(module.modules())`` (same order, each once).

    Reads the modules' current ``_parameters``, so a parameter replaced since the list was
    made is seen; walking a flat list instead of the module tree saves the recursive
    generators of ``named_modules`` (hundreds of modules per step on a long chain).
    """
    seen: set[int] = set()
    for m in modules:
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield p


def _backward_accumulating(edges: list[Any], grads: list[torch.Tensor],
                           wanted: list[GradientEdge], retain: bool = False
                           ) -> list[torch.Tensor | None]:
    """``autograd.backward`` from the stage outputs; the input gradients caught by hooks.

    Leaves (an FSDP unit's gathered parameters) accumulate their gradient in ``.grad``
    during the pass, where the unit's post-backward hook finds it. ``retain``: the graph
    is kept (a tape of the forward under a retained backward).
    """
    got: list[torch.Tensor | None] = [None] * len(wanted)

    def catch(k: int, nr: int) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            got[k] = grad_outputs[nr]

        return hook

    handles = [e.node.register_prehook(catch(k, e.output_nr)) for k, e in enumerate(wanted)]
    try:
        torch.autograd.backward(edges, grads, retain_graph=retain)
    finally:
        for h in handles:
            h.remove()
    return got


def _graph_nodes(outs: Sequence[torch.Tensor | None], stop: Sequence[Any] = ()
                 ) -> Iterator[Any]:
    """The autograd nodes reachable from ``outs``, each once.

    Not past the sources, the leaves (``AccumulateGrad``) and the nodes ``stop``.
    """
    seen: set[Any] = set(stop)
    stack = [t.grad_fn for t in outs if t is not None and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        if type(node).__name__ == "_SourceBackward" or hasattr(node, "variable"):
            continue
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def _graph_leaves(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors (``AccumulateGrad`` nodes) reachable from ``outs``, up to the sources."""
    leaves: dict[int, torch.Tensor] = {}
    for t in outs:
        if t.grad_fn is None and t.requires_grad:
            leaves[id(t)] = t
    for node in _graph_nodes(outs):
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
    return list(leaves.values())


def underivable_op(node: Any) -> Any:
    """The custom operator whose autograd node ``node`` is, if it has no derivative.

    ``torch.library`` gives every custom operator an autograd node class
    (``GeneratedBackwardFor_<namespace>_<name>_<overload>``); one registered without
    ``register_autograd`` (a backward operator, such as transformers'
    ``grouped_mm_fallback_backward``) raises when backpropagated through. ``None`` for
    any other node (or where torch's private layout differs).
    """
    cls = getattr(node, "_forward_cls", None)
    if cls is None or not cls.__name__.startswith("GeneratedBackwardFor_"):
        return None
    try:
        scope = inspect.getclosurevars(cls.backward).nonlocals
    except (TypeError, ValueError):
        return None
    info = scope.get("info")
    if info is None or getattr(info, "_backward_fn", True) is not None:
        return None
    return scope.get("op")


def refuse_underivable(grads: Sequence[torch.Tensor | None], stop: Sequence[Any]) -> None:
    """Make a backward through an underivable custom operator raise one clear error.

    Walks ``grads``' graph (up to the nodes ``stop``); a backward through an operator
    :func:`underivable_op` names raises one :class:`OptmemInputError`.

    A double backward re-runs the plan's *exported* stages: torch.export can make a model
    take another operator than in eager mode (transformers' MoE experts call
    ``torch._grouped_mm`` in eager, which differentiates twice, and its custom
    ``transformers::grouped_mm_fallback`` under export for float32 weights, whose
    backward does not), so the unwrapped model may differentiate where the plan cannot.
    """
    for node in _graph_nodes(grads, stop):
        op = underivable_op(node)
        if op is not None:
            node.register_prehook(functools.partial(_refuse_underivable, str(op)))


def _refuse_underivable(op: str, grad_outputs: Any) -> None:
    """The prehook of :func:`refuse_underivable`: raise."""
    raise OptmemInputError(
        f"double backward through the optmem plan: its exported stages call {op}, which "
        "has no derivative (torch.export made the model take this operator, where the "
        "unwrapped model, in eager mode, may take one that has: transformers' MoE experts "
        "take transformers::grouped_mm_fallback under export); wrap a model whose export "
        "differentiates twice (for the MoE experts: experts_implementation='batched_mm' "
        "in from_pretrained, or model.config._experts_implementation = 'batched_mm' "
        "before wrapping), or use the unwrapped model for the double backward",
        field="module")
