r"""Exact phase-indexed 0/1 model of checkpointing on the full operation model (Remat(L, M)).

Problem: thesis chapter 2, Problem 6 (Remat(L, M)); ops of RR-9302 Table 1 = thesis Table 2.1
with the rules of :mod:`optmem.simulate.checkpoint` (``shared/design/rotor.md`` sections 2, 5):
no free discard, no duplicates, pinning, ``F_none 1`` may not consume ``a^0``, ``Loss``
consumes a stored ``a^L``, ``B i`` frees ``a^{i-1}`` but keeps a tape ``abar^{i-1}``, peak of
an op = stored values + its outputs + its overhead, the input ``a^0`` counts.

The formulation is written once, as a solver-neutral :class:`optmem.models.formulation.Model`
(:func:`build_formulation`); :func:`emit_pulp` writes it for PuLP (HiGHS, CBC, Gurobi) and
:mod:`optmem.models.checkpoint_cpsat` for CP-SAT, both with the shared emitters, so both
engines solve the same model. :class:`Formulation` adds what plans need: the slot sequence
(:meth:`Formulation.decode`) and the rules that complete a plan into a full assignment
(:meth:`Formulation.assignment`, the warm start).

Phases
------
``B 1 .. B L`` each run exactly once, in the fixed order ``Loss, B L, ..., B 1`` (``B i``
needs ``delta^i``, which only ``B i+1`` (``Loss`` for ``i = L``) produces). The forward ops
between two consecutive backward-type ops form a *phase*: phase ``L+1`` is everything before
``Loss``; phase ``k <= L`` is everything between ``B k+1`` (or ``Loss``) and ``B k``. During
phase ``k <= L`` exactly one gradient, ``delta^k``, is stored, so gradients are constants.

Inside phase ``k`` the model offers ``R`` *sweeps* (``sweeps``, default 1); sweep ``r`` is a
pass over the stages ``j = 1 .. J_k`` (``J_{L+1} = L``, ``J_k = k``), and each *slot*
``(k, r, j)`` runs at most one forward op of stage ``j``. So a phase runs forward ops in
``R`` increasing runs. In phase ``k <= L`` slot ``j = k`` offers ``F_all`` only (and
``F_none`` when ``R > 1``): ``F_ck k`` would only create an ``a^k`` that nothing can read any
more (its readers ``F k+1``, ``B k+1`` and ``Loss`` are over) and whose removal keeps every
later op valid. Stages ``j > k`` are not offered in phase ``k``: their outputs have no
reader left either (``B j`` and ``Loss`` are over), so such an op could only serve to free
its input through ``F_none``; that input is ``abar^k``, which ``B k`` still needs, or a value
that no op of the model leaves unread.

**Exactness.** The model contains exactly the plans whose forward ops run in at most ``R``
increasing stage runs per phase (plus the exclusions above and the tape rule below), with
the simulator's memory accounting op by op; its optimum is the best such plan. ``R = 1`` is
the default. We have no proof that a phase never needs a descent (an op on stage
``j' <= j`` after one on stage ``j``, e.g. a recomputation from an earlier checkpoint after
``F_all k`` when ``F_all k`` has a large overhead); the evidence that it does not:

* ``R = 1`` equals the brute force over all op sequences
  (:func:`optmem.solvers.checkpoint_bruteforce.brute_force_checkpoint`) on every instance
  tried: 1,750 (chain, limit) pairs of ``random_chain`` with ``L = 3..5``, 1,080 pairs of
  chains with large forward overheads and 1,302 pairs mixing sizes 1..12 with overheads
  0..20;
* ``R = 2`` never improved on ``R = 1`` (540 pairs, ``L = 6..8``, large overheads), and
  ``R = 1`` equals the floating DP (which is a feasible plan, replayed) on 240 pairs with
  ``L = 6..10``.

``sweeps`` (``SolveOptions.extra["sweeps"]``) raises ``R`` for a larger class.

**Tapes are consumed by ``B`` only** (RR-9302 Lemma 4, restated for the full model with
pinning). A plan in which ``F_none j+1`` consumes a tape ``abar^j`` made by ``F_all j``
becomes, with that ``F_all j`` replaced by ``F_ck j`` (same slot, same time, output ``a^j``
instead of ``abar^j``), a valid plan of the same makespan whose memory is never larger
(``a[j] <= abar[j]``, a chain invariant): the readers of that value between the two ops
(``F j+1``, which accepts either form) are unchanged, ``F j`` stays forbidden while ``a^j``
is stored as it was while ``abar^j`` was (pinning), ``B j+1`` comes after ``F_none j+1``
(phases below ``j+1`` offer no stage ``j+1``), and ``B j`` used a later tape anyway. So
``F_none`` consumes only ``a^{j-1}`` and the optimum is unchanged. (These reductions are on by
default; ``build_formulation(..., reductions=False)`` drops them -- ``F_none j`` may then consume
``abar^{j-1}`` through a variable ``zT`` and ``F_all j`` may run more than once -- for
:mod:`optmem.models.remat_offload`, whose values may leave the GPU.) Consequences used below:
``abar^j`` is stored from its ``F_all j`` to ``B j``, during which ``F j`` cannot run (no
duplicates), and no stage ``j`` runs after ``B j``; hence **``F_all j`` runs exactly once**.

Notation (paper indices; sizes in discretised units)
-----------------------------------------------------
=====================  ==============================================================
``a[i]``               size of a^i and of delta^i (``a[0]`` the input)
``abar[i]``            size of the tape abar^i
``uf[j], of[j]``       forward time and overhead of stage ``j``
``ub[j], ob[j]``       backward time and overhead (``ub[L+1], ob[L+1]``: the loss)
``d_k``                size of the gradient held in phase ``k`` (``a[k]``; 0 for ``L+1``)
=====================  ==============================================================

Variables (binary unless stated)
--------------------------------
* ``fa[k,r,j]``, ``fc[k,r,j]``, ``fn[k,r,j]``: slot ``(k, r, j)`` runs ``F_all j``,
  ``F_ck j``, ``F_none j``; ``y = fa + fc + fn <= 1``.
* ``A[i]@p``, ``T[i]@p``: ``a^i`` / ``abar^i`` is stored before slot ``p`` (one new variable
  per slot that can change it; otherwise the previous one is reused; constants where the
  value is known: ``A[0] = 1`` until ``B 1``, everything 0 before it is first produced).
* ``zA[k,r,j]``: the ``F_none`` of the slot consumes ``a^{j-1}`` (so ``zA = fn``).
* ``K[i]@p`` (variant ``persistent``): ``a^i`` has been read by a keeping op ``F_ck i+1`` or
  ``F_all i+1``.
* ``peak`` (min-peak mode only, integer): bounds every op's memory.

Constraints of forward slot ``p = (k, r, j)`` (state ``A, T`` before, ``A', T'`` after)
-----------------------------------------------------------------------------------------
1. one op: ``fa + fc + fn <= 1``;
2. input present: ``fa + fc + fn <= A[j-1] + T[j-1]``;
3. no duplicates (and pinning): ``fa + fc + fn + A[j] + T[j] <= 1``;
4. ``F_none`` consumes ``a^{j-1}``: ``zA <= A[j-1]``, ``zA = fn``;
5. transitions: ``A'[j] = A[j] + fc + fn``, ``T'[j] = T[j] + fa``, ``A'[j-1] = A[j-1] - zA``;
   every other value is unchanged;
6. memory: ``sum_i a[i] A[i] + abar[i] T[i] + d_k + a[j] (fc + fn) + abar[j] fa
   + of[j] (fa + fc + fn) <= M`` (stored + output + overhead; an idle slot gives the state's
   size, which the previous op already bounded);
7. ``F_none 1`` does not exist (it would consume ``a^0``);
8. ``F_all j`` once: ``sum_{k,r} fa[k,r,j] = 1`` (see the tape rule above).

Running memory (``running_memory=True``: limit mode, with the reductions; CP-SAT)
---------------------------------------------------------------------------------
The stored size ``sum_i a[i] A[i] + abar[i] T[i]`` of rows 6 has ``2 L`` terms, so the
memory rows hold most of the non-zeros (ResNet-152, L = 56: 174,100 of them). A continuous
variable ``S`` per state change carries it instead: ``S' = S + sum a[i] (A'[i] - A[i]) +
abar[i] (T'[i] - T[i])`` over the values the item changes, and each forward row reads ``S``
(the same model; the LP relaxation is the same after projecting ``S`` out). The row of each
backward-type op (one per phase) is also kept in the dense form (``memd_*``): HiGHS derives
its cover cuts from those. ResNet-152 at 30 %: 67,085 non-zeros instead of 174,100. With it
CP-SAT proves the chains ``compare`` gives it in seconds (10-30 % gaps after 60 s from
L = 15 with the dense rows); HiGHS gains on some instances and loses on others, so the ILP
keeps the dense rows (``benchmarks/results/checkpoint_exact.md``).

Tape-chain rows (``tape_chain=True``; with the reductions only)
---------------------------------------------------------------
``T[j] <= A[j-1] + T[j-1]`` (``j = 2 .. L``) on the state before every backward-type op
(``Loss``, ``B k``): while the tape ``abar^j`` is stored, the value ``F_all j`` read (``a^{j-1}``
or ``abar^{j-1}``) is still stored. **Valid for every plan of the model** (so the optimum
is unchanged): ``abar^j`` exists only from its ``F_all j`` to ``B j`` (tape rule above);
``F_all j`` needs ``a^{j-1}`` or ``abar^{j-1}`` (row 2). Until ``B j``, ``a^{j-1}`` can only
be removed by ``F_none j`` (which cannot run while ``abar^j`` is stored: no duplicates, row
3) or by ``B j`` itself (``Loss`` removes ``a^L`` only, and ``j - 1 < L``); ``abar^{j-1}``
only by ``B j-1``, which comes after ``B j`` (no free discard; with the reductions
``F_none`` never consumes a tape). The rule holds for the persistent variant (a subset of
the plans) and in min-peak mode. Without the reductions (:mod:`optmem.models.remat_offload`,
where values may leave the GPU) no rows are added.

Why: the LP relaxation of the model without them holds tapes at fractional weights whose
inputs are not held (ResNet-152 at 30 %: in phase ``k``, ``F_all k-1`` at 1/2, ``F_all k-2``
at 1/4, ..., each fed by a tape held at half weight while ``a^{j-1}`` was consumed in the
forward phase), so it never pays for a recomputed segment; the rows make a held tape pay for
its whole chain down to a stored activation. LP bound 315.83 -> 316.22, root bound after
HiGHS's cuts 317.05 -> the optimum 317.652 (proven at the root;
``benchmarks/results/checkpoint_exact.md``). Tests: the same optimum with and without the
rows, equal to brute force / the persistent DP (hypothesis, derandomised), and every random
valid plan the model admits satisfies them.

Backward-type ops (state ``A, T`` before)
-----------------------------------------
* ``Loss``: ``A[L] + T[L] >= 1``; ``sum + a[L] + ob[L+1] <= M``; afterwards ``A[L] = 0``.
* ``B k``: ``T[k] = 1``; ``A[k-1] + T[k-1] >= 1``; ``sum + a[k] + a[k-1] + ob[k] <= M``;
  afterwards ``T[k] = 0`` and ``A[k-1] = 0`` (a tape ``abar^{k-1}`` stays for ``B k-1``).

Persistent variant (RR-9302 section 4 / thesis R.1, memory persistence)
-----------------------------------------------------------------------
Once ``a^i`` (or ``abar^i``) has been read by ``F_ck i+1`` or ``F_all i+1`` it stays until
``B i+1``: ``fn[k,r,i+1] <= 1 - K[i]`` with ``K[i]' >= K[i]``, ``K[i]' >= fa + fc``,
``K[i]' <= K[i] + fa + fc`` at slots of stage ``i+1``. With these, the optimum equals the
persistent DP (:mod:`optmem.solvers.checkpoint_dp`, paper variant) on every instance tested
(1,750 (chain, limit) pairs with ``L = 3..5`` and the test-suite).

Objective
---------
``min sum_p uf[j] (fa + fc + fn) + ub[L+1] + sum_k ub[k]`` (the backward part is constant).
Min-peak mode (``memory_limit=None``): every memory row bounds ``peak`` instead of ``M``,
and ``peak`` is minimised.

Every state is a 0/1 variable (declared binary: HiGHS presolve mis-handles such models
when they are continuous, see ``rotor.md`` Findings 3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.fileio import write_atomic
from optmem.models.formulation import Constraint, Expr, Model, PulpModel, Relation, to_pulp
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op, OpKind

VARIANTS = ("full", "persistent")

Rule = tuple[Any, ...]
"""How a derived variable follows from earlier ones: ``("lin", target, terms, const)``,
``("and", target, i, j)`` or ``("or", target, sources)``."""


@dataclass(frozen=True)
class Slot:
    """A forward slot ``(phase, sweep, stage)`` and the indices of its op variables."""

    phase: int
    sweep: int
    stage: int
    ops: tuple[tuple[OpKind, int], ...]


@dataclass
class Formulation:
    """The checkpoint model: a :class:`~optmem.models.formulation.Model` and its plan maps.

    Attributes
    ----------
    model
        The solver-neutral model (variables, rows, objective).
    sequence
        Forward slots and backward-type ops in execution order.
    derivations
        How every non-op variable follows from earlier ones (to complete a warm start).
    peak_var
        In min-peak mode (``memory_limit=None``), the variable bounding every op's memory,
        which is then the objective (integer, or continuous when ``size_scale > 1``).
    size_scale
        Sizes of the model are the chain's divided by this (min-peak mode on byte-sized
        chains: MILP engines mishandle coefficients of ~1e9).
    reductions
        Whether the tape rule (tapes consumed by ``B`` only) and ``F_all j`` once are in the
        model (see the module docstring; :func:`build_formulation`).
    states
        For models that extend this one (:mod:`optmem.models.remat_offload`): the state
        ``(A, T)`` (value index -> expression of ``A[i]`` / ``T[i]``) before each item of
        ``sequence``, and once more after the last one.
    memory_rows
        The memory expression (before the ``<= M`` bound) of each item of ``sequence``, with
        its row name, in the same order.
    running_memory
        Whether the stored size is carried by running variables ``S`` (see
        :func:`build_formulation`); the memory rows then read ``S`` instead of every state.
    tape_chain
        Whether the tape-chain rows ``T[j] <= A[j-1] + T[j-1]`` are in the model (see
        :func:`build_formulation`).
    """

    model: Model
    length: int
    memory_limit: int
    variant: str
    sweeps: int
    sequence: list[Slot | Op] = field(default_factory=list)
    derivations: list[Rule] = field(default_factory=list)
    peak_var: int | None = None
    size_scale: float = 1.0
    reductions: bool = True
    states: list[tuple[dict[int, Expr], dict[int, Expr]]] = field(default_factory=list)
    memory_rows: list[tuple[str, Expr]] = field(default_factory=list)
    running_memory: bool = False
    tape_chain: bool = False

    # ------------------------------------------------------------------ views of the model
    @property
    def names(self) -> list[str]:
        """Variable names, in model order."""
        return [v.name for v in self.model.vars]

    @property
    def constraints(self) -> list[Constraint]:
        """The rows of the model (name, terms, bounds)."""
        return self.model.constraints

    @property
    def objective(self) -> dict[int, float]:
        """Objective coefficients by variable index (the constant apart)."""
        return dict(self.model.objective.merged())

    @property
    def objective_const(self) -> float:
        """Constant part of the objective (backward and loss times)."""
        return self.model.objective.const

    @property
    def size(self) -> dict[str, int]:
        """Number of variables, constraints and non-zeros."""
        size = self.model.size
        return {key: size[key] for key in ("variables", "constraints", "nonzeros")}

    @property
    def trivially_infeasible(self) -> bool:
        """Whether a constraint without variables is violated (e.g. ``a^0`` above ``M``)."""
        return self.model.trivially_infeasible

    def evaluate(self, values: Sequence[float]) -> float:
        """Objective value of an assignment."""
        return self.model.evaluate(values)

    def violated(self, values: Sequence[float], tol: float = 1e-6) -> list[str]:
        """Names of the constraints (and bounds) an assignment violates."""
        return self.model.violated(values, tol)

    # ------------------------------------------------------------------ plans <-> values
    def decode(self, values: Sequence[float]) -> tuple[Op, ...]:
        """The plan of a (rounded) 0/1 assignment, ops in slot order."""
        plan: list[Op] = []
        make = {OpKind.F_ALL: F_all, OpKind.F_CK: F_ck, OpKind.F_NONE: F_none}
        for item in self.sequence:
            if isinstance(item, Op):
                plan.append(item)
                continue
            for kind, idx in item.ops:
                if values[idx] > 0.5:
                    plan.append(make[kind](item.stage))
        return tuple(plan)

    def assignment(self, plan: Iterable[Op]) -> list[int] | None:
        """The 0/1 assignment of ``plan``, or ``None`` if the plan does not fit the slots.

        Forward ops are placed greedily in the earliest slot of their phase that follows the
        previous op; the derived variables are then computed as the constraints define them,
        and the assignment is returned only if it satisfies every constraint.
        """
        values = [0] * len(self.model.vars)
        if not self._place(list(plan), values):
            return None
        for rule in self.derivations:
            kind, target = rule[0], rule[1]
            if kind == "lin":
                values[target] = round(sum(c * values[i] for i, c in rule[2]) + rule[3])
            elif kind == "and":
                values[target] = values[rule[2]] * values[rule[3]]
            else:  # "or"
                values[target] = max([values[i] for i in rule[2]] or [0])
        if self.violated(values):
            return None
        return values

    def _place(self, ops: list[Op], values: list[int]) -> bool:
        """Set the op variables of ``ops`` (greedy slot placement); False if they do not fit."""
        pos = 0
        for item in self.sequence:
            if isinstance(item, Op):
                if pos >= len(ops) or ops[pos] != item:
                    return False
                pos += 1
                continue
            if pos < len(ops) and ops[pos].kind is not OpKind.B and ops[pos] != LOSS \
                    and ops[pos].stage == item.stage:
                match = [idx for kind, idx in item.ops if kind is ops[pos].kind]
                if match:
                    values[match[0]] = 1
                    pos += 1
        return pos == len(ops)


@dataclass(frozen=True)
class _Arrays:
    """The chain in paper indices (sizes divided by ``scale``)."""

    a: list[float]
    abar: list[float]
    uf: list[float]
    of: list[float]
    ub: list[float]
    ob: list[float]

    @classmethod
    def of_chain(cls, chain: Chain, scale: float = 1.0) -> _Arrays:
        def sizes(values: Iterable[int]) -> list[float]:
            return [v if scale == 1 else v / scale for v in values]

        return cls(a=sizes([chain.input_size, *chain.output_size]),
                   abar=sizes([chain.input_size, *chain.saved_size]),
                   uf=[0.0, *chain.fwd_time], of=sizes([0, *chain.fwd_overhead]),
                   ub=[0.0, *chain.bwd_time, chain.loss_bwd_time],
                   ob=sizes([0, *chain.bwd_overhead, chain.loss_bwd_overhead]))


def _add(model: Model, name: str, expr: Expr, lo: float | None = None,
         hi: float | None = None) -> None:
    """``lo <= expr <= hi`` (constant-only rows are checked by the model)."""
    model.add(Relation(expr, lo, hi), name)


class _Builder:
    """Builds the phase-indexed model slot by slot (see the module docstring)."""

    def __init__(self, chain: Chain, memory_limit: int | None, variant: str, sweeps: int,
                 size_scale: float, reductions: bool, running_memory: bool,
                 tape_chain: bool = False) -> None:
        self.L = L = chain.length
        self.tape_chain = tape_chain and reductions
        self.ar = _Arrays.of_chain(chain, size_scale)
        self.m = Model("optmem_checkpoint")
        self.f = Formulation(self.m, L, -1 if memory_limit is None else memory_limit,
                             variant, sweeps, size_scale=size_scale, reductions=reductions)
        self.limit = memory_limit
        self.persistent = variant == "persistent"
        self.peak: Expr | None = None
        if memory_limit is None:
            bound = sum(self.ar.a) + sum(self.ar.abar) + max(self.ar.of + self.ar.ob)
            self.peak = (self.m.integer("peak", 0, bound) if size_scale == 1
                         else self.m.continuous("peak", 0, bound))
            self.f.peak_var = Model.index(self.peak)
        # state: value -> expression (a single variable or a constant)
        self.A: dict[int, Expr] = {i: Expr.of(0) for i in range(L + 1)}
        self.A[0] = Expr.of(1)
        self.T: dict[int, Expr] = {i: Expr.of(0) for i in range(1, L + 1)}
        self.K: dict[int, Expr] = {i: Expr.of(0) for i in range(L + 1)}
        self.objective: list[tuple[int, float]] = []
        self.f_all: dict[int, list[int]] = {j: [] for j in range(1, L + 1)}
        # running memory (limit mode): one variable per state change holds the stored size
        self.running = running_memory and memory_limit is not None
        self.mem: Expr = Expr.of(self.ar.a[0])
        self.f.running_memory = self.running
        self.f.tape_chain = self.tape_chain

    # ------------------------------------------------------------------ helpers
    def fits(self, name: str, expr: Expr) -> None:
        """``expr <= M``, or ``expr <= peak`` in min-peak mode."""
        self.f.memory_rows.append((name, expr))
        if self.peak is None:
            _add(self.m, name, expr, hi=self.limit)
        else:
            _add(self.m, name, expr - self.peak, hi=0)

    def fits_backward(self, name: str, extra: float) -> None:
        """Memory row of a backward-type op: stored size + ``extra`` fits.

        With running memory the row is also written on every state (``memd_*``, one per
        phase): redundant for the model, but HiGHS derives its knapsack-cover cuts from such
        rows and cannot do so through the running variables (without them ResNet-50,
        L = 22, at 10 % needs 5 nodes and 19,676 LP iterations instead of 1 node and 1,471).
        """
        self.fits(f"mem_{name}", self.stored() + extra)
        if self.running:
            _add(self.m, f"memd_{name}", self.stored(dense=True) + extra, hi=self.limit)

    def stored(self, dense: bool = False) -> Expr:
        """Size of every stored activation and tape (running variable unless ``dense``)."""
        if self.running and not dense:
            return self.mem
        a, abar = self.ar.a, self.ar.abar
        return Expr.sum([*(self.A[i] * a[i] for i in range(self.L + 1)),
                         *(self.T[i] * abar[i] for i in range(1, self.L + 1))])

    def fresh(self, name: str, expr: Expr) -> Expr:
        """A new binary variable equal to ``expr`` (or ``expr`` itself if constant)."""
        if not expr.terms:
            return expr
        if len(expr.terms) == 1 and expr.terms[0][1] == 1 and expr.const == 0:
            return expr
        v = self.m.binary(name)
        _add(self.m, f"def_{name}", v - expr, 0, 0)
        self.f.derivations.append(("lin", Model.index(v), list(expr.terms), expr.const))
        return v

    def advance(self, name: str, before: tuple[dict[int, Expr], dict[int, Expr]]) -> None:
        """Running memory: ``S' = S + sum size * (state' - state)`` over the changed states.

        An exact rewriting of the stored size (the same LP relaxation as the sum over
        every state, projected): each memory row then has a handful of non-zeros instead of
        ``2 L``, which makes HiGHS's LPs, hence strong branching, several times cheaper.
        """
        if not self.running:
            return
        old_a, old_t = before
        delta = Expr.sum([*((self.A[i] - old_a[i]) * self.ar.a[i] for i in self.A
                            if self.A[i] is not old_a[i]),
                          *((self.T[i] - old_t[i]) * self.ar.abar[i] for i in self.T
                            if self.T[i] is not old_t[i])])
        if not delta.terms:
            self.mem = self.mem + delta.const
            return
        hi = float("inf") if self.limit is None else float(self.limit)
        new = self.m.continuous(f"S_{name}", 0, hi)
        expr = self.mem + delta
        _add(self.m, f"def_S_{name}", new - expr, 0, 0)
        self.f.derivations.append(("lin", Model.index(new), list(expr.terms), expr.const))
        self.mem = new

    # ------------------------------------------------------------------ ops
    def slot(self, k: int, r: int, j: int) -> None:
        """Forward slot ``(k, r, j)``: op variables, constraints 1-7, state update."""
        L, ar, m = self.L, self.ar, self.m
        tag = f"{k}_{r}_{j}"
        kinds = [OpKind.F_ALL]
        if k == L + 1 or j < k:
            kinds.append(OpKind.F_CK)
        if j > 1 and (k == L + 1 or j < k or self.f.sweeps > 1):
            kinds.append(OpKind.F_NONE)
        op = {kind: m.binary(f"{kind.value}_{tag}") for kind in kinds}
        idx = {kind: Model.index(x) for kind, x in op.items()}
        before = (dict(self.A), dict(self.T))
        self.f.states.append(before)
        self.f.sequence.append(Slot(k, r, j, tuple(idx.items())))
        self.objective.extend((i, float(ar.uf[j])) for i in idx.values())
        self.f_all[j].append(idx[OpKind.F_ALL])
        y = Expr.sum(op.values())
        A, T = self.A, self.T
        has_in = A[j - 1] + (T[j - 1] if j > 1 else 0)
        _add(m, f"one_{tag}", y, hi=1)
        _add(m, f"input_{tag}", y - has_in, hi=0)
        _add(m, f"nodup_{tag}", y + A[j] + T[j], hi=1)
        produces_a = Expr.sum(op[kk] for kk in (OpKind.F_CK, OpKind.F_NONE) if kk in op)
        out = op[OpKind.F_ALL] * ar.abar[j] + produces_a * ar.a[j]
        d_k = ar.a[k] if k <= L else 0
        self.fits(f"mem_{tag}", self.stored() + d_k + out + y * ar.of[j])
        keep = Expr.sum(op[kk] for kk in (OpKind.F_ALL, OpKind.F_CK) if kk in op)
        if self.persistent:
            self.persist(tag, j, op, keep)
        if OpKind.F_NONE in op:
            self.consume(tag, j, op[OpKind.F_NONE])
        A[j] = self.fresh(f"A{j}_{tag}", A[j] + produces_a)
        T[j] = self.fresh(f"T{j}_{tag}", T[j] + op[OpKind.F_ALL])
        self.advance(tag, before)

    def persist(self, tag: str, j: int, op: dict[OpKind, Expr], keep: Expr) -> None:
        """Memory persistence: a read ``a^{j-1}`` stays until ``B j`` (variant persistent)."""
        m, K = self.m, self.K
        if OpKind.F_NONE in op:
            _add(m, f"persist_{tag}", op[OpKind.F_NONE] + K[j - 1], hi=1)
        kv = m.binary(f"K{j - 1}_{tag}")
        _add(m, f"Kge_{tag}", kv - K[j - 1], lo=0)
        _add(m, f"Kge2_{tag}", kv - keep, lo=0)
        _add(m, f"Kle_{tag}", kv - K[j - 1] - keep, hi=0)
        self.f.derivations.append(("or", Model.index(kv),
                                   [i for i, _ in K[j - 1].terms + keep.terms]))
        K[j - 1] = kv

    def consume(self, tag: str, j: int, fn: Expr) -> None:
        """``F_none j`` consumes ``a^{j-1}`` (without the reductions: or ``abar^{j-1}``).

        The persistent variant never consumes a tape (a read value stays until ``B``).
        """
        m, A, T = self.m, self.A, self.T
        za = m.binary(f"zA_{tag}")
        _add(m, f"zA_{tag}", za - A[j - 1], hi=0)
        self.f.derivations.append(self._and(za, fn, A[j - 1]))
        if self.f.reductions or self.persistent:
            _add(m, f"zsum_{tag}", za - fn, lo=0, hi=0)
        else:
            zt = m.binary(f"zT_{tag}")
            _add(m, f"zT_{tag}", zt - T[j - 1], hi=0)
            _add(m, f"zsum_{tag}", za + zt - fn, lo=0, hi=0)
            self.f.derivations.append(self._and(zt, fn, T[j - 1]))
            T[j - 1] = self.fresh(f"T{j - 1}_{tag}", T[j - 1] - zt)
        A[j - 1] = self.fresh(f"A{j - 1}_{tag}", A[j - 1] - za)

    @staticmethod
    def _and(target: Expr, fn: Expr, state: Expr) -> Rule:
        """Derivation of ``target = fn AND state`` (0 when the state is a constant 0)."""
        if not state.terms:
            return ("lin", Model.index(target), [], 0)
        return ("and", Model.index(target), Model.index(fn), state.terms[0][0])

    def chain_rows(self, name: str) -> None:
        """Tape-chain rows ``T[j] <= A[j-1] + T[j-1]`` on the state before a backward-type op.

        Valid for every plan of the model with the reductions (see *Tape-chain rows* in the
        module docstring); added only when ``tape_chain`` is set.
        """
        if not self.tape_chain:
            return
        A, T = self.A, self.T
        for j in range(2, self.L + 1):
            if T[j].terms:
                _add(self.m, f"tchain_{name}_{j}", T[j] - A[j - 1] - T[j - 1], hi=0)

    def loss(self) -> None:
        """``Loss``: reads ``a^L`` (or its tape), frees ``a^L``."""
        L, ar = self.L, self.ar
        self.f.sequence.append(LOSS)
        self.chain_rows("loss")
        _add(self.m, "loss_input", self.A[L] + self.T[L], lo=1)
        self.fits_backward("loss", ar.a[L] + ar.ob[L + 1])
        before = (dict(self.A), dict(self.T))
        self.A[L] = Expr.of(0)
        self.advance("loss", before)

    def backward(self, k: int) -> None:
        """``B k``: needs its tape and input; frees the tape and ``a^{k-1}``."""
        ar, A, T = self.ar, self.A, self.T
        self.f.sequence.append(B(k))
        self.chain_rows(f"B{k}")
        _add(self.m, f"tape_{k}", T[k], lo=1)
        _add(self.m, f"binput_{k}", A[k - 1] + (T[k - 1] if k > 1 else 0), lo=1)
        self.fits_backward(f"B{k}", ar.a[k] + ar.a[k - 1] + ar.ob[k])
        before = (dict(A), dict(T))
        T[k] = Expr.of(0)
        A[k - 1] = Expr.of(0)
        self.advance(f"B{k}", before)

    def build(self) -> Formulation:
        L = self.L
        for k in range(L + 1, 0, -1):
            last = L if k == L + 1 else k
            for r in range(1, self.f.sweeps + 1):
                for j in range(1, last + 1):
                    self.slot(k, r, j)
            self.f.states.append((dict(self.A), dict(self.T)))
            if k == L + 1:
                self.loss()
            else:
                self.backward(k)
        self.f.states.append((dict(self.A), dict(self.T)))
        if self.f.reductions:
            for j, ops in self.f_all.items():
                _add(self.m, f"once_{j}", Expr.sum(self.m_var(i) for i in ops), lo=1, hi=1)
        if self.peak is not None:
            self.m.minimize(self.peak)
        else:
            self.m.minimize(Expr(self.objective, float(sum(self.ar.ub[1:]))))
        return self.f

    @staticmethod
    def m_var(index: int) -> Expr:
        """The expression of variable ``index``."""
        return Expr([(index, 1.0)])


MAX_SLOTS = 2_000_000
"""Most compute slots (``sweeps`` x the phases' stage passes) a formulation is built with:
a larger one is refused before any memory is taken (``sweeps=10**30`` grew without bound)."""


def build_formulation(chain: Chain, memory_limit: int | None, variant: str = "full",
                      sweeps: int = 1, *, size_scale: float = 1.0,
                      reductions: bool = True,
                      running_memory: bool = False,
                      tape_chain: bool = False) -> Formulation:
    """Build the neutral model of ``chain`` (integer sizes) under ``memory_limit``.

    Parameters
    ----------
    chain
        The discretised chain.
    memory_limit
        Limit in the chain's (integer) units; ``a^0`` counts. ``None`` builds the min-peak
        model: an integer variable ``peak`` bounds every op's memory and is minimised.
    variant
        ``full`` (the simulator's model) or ``persistent`` (memory persistence added).
    sweeps
        Increasing forward runs offered per phase (``R``).
    size_scale
        Min-peak mode only: divide every size by this, so that the memory rows of a
        byte-sized chain have coefficients of at most about
        :data:`optmem.engines.adapters.MAX_COEFFICIENT` (with raw byte coefficients, HiGHS
        called an always-feasible model infeasible); the peak variable is then continuous
        and the true peak is the decoded plan's, replayed by the simulator.
    reductions
        Add the tape rule (``F_none`` consumes ``a^{j-1}`` only) and ``F_all j`` once
        (default; exact for checkpointing by RR-9302 Lemma 4, see the module docstring).
        ``False`` lets ``F_none j`` consume the tape ``abar^{j-1}`` too (variables ``zT``)
        and ``F_all j`` run any number of times: the model that
        :mod:`optmem.models.remat_offload` extends, where a value may leave the GPU and the
        argument does not carry over as it stands.
    running_memory
        Carry the stored size in one continuous variable per state change,
        ``S' = S + sum_i a[i] (A'[i] - A[i]) + abar[i] (T'[i] - T[i])``, and write the memory
        row of every forward slot on ``S`` (a few non-zeros) instead of on every state
        (``2 L``); the rows of backward-type ops are written both ways. The same model and
        the same LP relaxation. Limit mode with the reductions only (ignored otherwise: the
        models :mod:`optmem.models.remat_offload` extends read the dense memory rows). Used
        for CP-SAT (see :mod:`optmem.solvers.checkpoint_exact`).
    tape_chain
        Add the tape-chain rows ``T[j] <= A[j-1] + T[j-1]`` before every backward-type op
        (valid for every plan, see the module docstring; with the reductions only, ignored
        otherwise). :mod:`optmem.solvers.checkpoint_exact` sets it by default.
    """
    if size_scale != 1 and memory_limit is not None:
        raise ValueError("size_scale is for the min-peak mode (memory_limit=None) only")
    if variant not in VARIANTS:
        raise OptmemInputError(f"unknown exact-model variant {variant!r} "
                               f"(expected one of {', '.join(VARIANTS)})", field="variant")
    if sweeps < 1:
        raise OptmemInputError(f"expected at least one sweep, got {sweeps}", field="sweeps")
    L = chain.length
    slots = sweeps * (L * (L + 1) // 2 + L)  # phases k <= L offer k stages, phase L+1 all L
    if slots > MAX_SLOTS:
        raise OptmemInputError(
            f"sweeps={sweeps} gives {slots:,} compute slots on this {L}-stage chain, more "
            f"than the {MAX_SLOTS:,} a model is built with (each slot has several binaries): "
            "lower sweeps", field="sweeps")
    return _Builder(chain, memory_limit, variant, sweeps, size_scale, reductions,
                    running_memory and reductions, tape_chain).build()


# ------------------------------------------------------------------ PuLP emission
@dataclass
class CheckpointILP:
    """The PuLP model of a :class:`Formulation` (shared emitter :func:`to_pulp`)."""

    formulation: Formulation
    emitted: PulpModel

    @property
    def problem(self) -> Any:
        """The ``pulp.LpProblem``."""
        return self.emitted.problem

    @property
    def variables(self) -> list[Any]:
        """Every PuLP variable (model order, then the objective constant)."""
        return self.emitted.all_variables

    def initial(self, values: Sequence[float] | None) -> list[float] | None:
        """A warm start for :attr:`variables` from model values (``None`` passes through)."""
        return self.emitted.initial(values)

    def values(self) -> list[float]:
        """Model variable values after a solve (0 for unset ones)."""
        return [v.varValue or 0.0 for v in self.emitted.variables]


def emit_pulp(form: Formulation) -> CheckpointILP:
    """Write ``form`` as a PuLP problem (binary variables, named rows)."""
    return CheckpointILP(form, to_pulp(form.model))


def write_model(model: CheckpointILP, path: str | Path) -> None:
    """Write ``model`` as ``.mps`` or ``.lp`` (by suffix, any case), atomically.

    Through :func:`optmem.fileio.write_atomic`, so the file gets the mode every other
    output gets (0666 minus the umask; ``mkstemp`` made it 0600 until the API audit).

    Raises
    ------
    OptmemInputError
        If the suffix is neither ``.mps`` nor ``.lp``, or the file cannot be written.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".mps", ".lp"):
        raise OptmemInputError(f"cannot tell the model format from {path.name!r} "
                               "(expected a .mps or .lp file)", field="output")

    def write(tmp: Path) -> None:
        if suffix == ".mps":
            model.problem.writeMPS(str(tmp))
        else:
            model.problem.writeLP(str(tmp))

    write_atomic(path, write, field="output")
