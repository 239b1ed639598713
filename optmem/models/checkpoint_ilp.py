r"""Exact phase-indexed 0/1 model of checkpointing on the full operation model (Remat(L, M)).

Problem: thesis chapter 2, Problem 6 (Remat(L, M)); ops of RR-9302 Table 1 = thesis Table 2.1
with the rules of :mod:`optmem.simulate.checkpoint` (``shared/design/rotor.md`` sections 2, 5):
no free discard, no duplicates, pinning, ``F_none 1`` may not consume ``a^0``, ``Loss``
consumes a stored ``a^L``, ``B i`` frees ``a^{i-1}`` but keeps a tape ``abar^{i-1}``, peak of
an op = stored values + its outputs + its overhead, the input ``a^0`` counts.

The formulation is written once, as a backend-neutral list of 0/1 variables, linear
constraints and a linear objective (:class:`Formulation`); :func:`build_checkpoint_ilp` emits
it to PuLP (HiGHS, CBC, Gurobi) and :mod:`optmem.models.checkpoint_cpsat` to CP-SAT, so both
engines solve the same model.

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
increasing stage runs per phase (plus the exclusions above), with the simulator's memory
accounting op by op; its optimum is the best such plan. ``R = 1`` is the default. We have no
proof that a phase never needs a descent (an op on stage ``j' <= j`` after one on stage
``j``, e.g. a recomputation from an earlier checkpoint after ``F_all k`` when ``F_all k``
has a large overhead); the evidence that it does not:

* ``R = 1`` equals the brute force over all op sequences
  (:func:`optmem.solvers.checkpoint_bruteforce.brute_force_checkpoint`) on every instance
  tried: 1,750 (chain, limit) pairs of ``random_chain`` with ``L = 3..5``, 1,080 pairs of
  chains with large forward overheads and 1,302 pairs mixing sizes 1..12 with overheads
  0..20;
* ``R = 2`` never improved on ``R = 1`` (540 pairs, ``L = 6..8``, large overheads), and
  ``R = 1`` equals the floating DP (which is a feasible plan, replayed) on 240 pairs with
  ``L = 6..10``.

``sweeps`` (``SolveOptions.extra["sweeps"]``) raises ``R`` for a larger class.

Notation (paper indices; sizes in discretised units)
-----------------------------------------------------
=====================  ==============================================================
``a[i]``               size of a^i and of delta^i (``a[0]`` the input)
``abar[i]``            size of the tape abar^i
``uf[j], of[j]``       forward time and overhead of stage ``j``
``ub[j], ob[j]``       backward time and overhead (``ub[L+1], ob[L+1]``: the loss)
``d_k``                size of the gradient held in phase ``k`` (``a[k]``; 0 for ``L+1``)
=====================  ==============================================================

Variables (all binary)
----------------------
* ``fa[k,r,j]``, ``fc[k,r,j]``, ``fn[k,r,j]``: slot ``(k, r, j)`` runs ``F_all j``,
  ``F_ck j``, ``F_none j``; ``y = fa + fc + fn <= 1``.
* ``A[i]@p``, ``T[i]@p``: ``a^i`` / ``abar^i`` is stored before slot ``p`` (one new variable
  per slot that can change it; otherwise the previous one is reused; constants where the
  value is known: ``A[0] = 1`` until ``B 1``, everything 0 before it is first produced).
* ``zA[k,r,j]``, ``zT[k,r,j]``: the ``F_none`` of the slot consumes ``a^{j-1}`` /
  ``abar^{j-1}``.
* ``K[i]@p`` (variant ``persistent``): ``a^i`` has been read by a keeping op ``F_ck i+1`` or
  ``F_all i+1``.

Constraints of forward slot ``p = (k, r, j)`` (state ``A, T`` before, ``A', T'`` after)
-----------------------------------------------------------------------------------------
1. one op: ``fa + fc + fn <= 1``;
2. input present: ``fa + fc + fn <= A[j-1] + T[j-1]``;
3. no duplicates (and pinning): ``fa + fc + fn + A[j] + T[j] <= 1``;
4. which form ``F_none`` consumes: ``zA <= A[j-1]``, ``zT <= T[j-1]``, ``zA + zT = fn``
   (exact because ``A[i] + T[i] <= 1`` always holds, by 3);
5. transitions: ``A'[j] = A[j] + fc + fn``, ``T'[j] = T[j] + fa``, ``A'[j-1] = A[j-1] - zA``,
   ``T'[j-1] = T[j-1] - zT``; every other value is unchanged;
6. memory: ``sum_i a[i] A[i] + abar[i] T[i] + d_k + a[j] (fc + fn) + abar[j] fa
   + of[j] (fa + fc + fn) <= M`` (stored + output + overhead; an idle slot gives the state's
   size, which the previous op already bounded);
7. ``F_none 1`` does not exist (it would consume ``a^0``).

Backward-type ops (state ``A, T`` before)
-----------------------------------------
* ``Loss``: ``A[L] + T[L] >= 1``; ``sum + a[L] + ob[L+1] <= M``; afterwards ``A[L] = 0``.
* ``B k``: ``T[k] = 1``; ``A[k-1] + T[k-1] >= 1``; ``sum + a[k] + a[k-1] + ob[k] <= M``;
  afterwards ``T[k] = 0`` and ``A[k-1] = 0`` (a tape ``abar^{k-1}`` stays for ``B k-1``).

Persistent variant (RR-9302 section 4 / thesis R.1, memory persistence)
-----------------------------------------------------------------------
Once ``a^i`` (or ``abar^i``) has been read by ``F_ck i+1`` or ``F_all i+1`` it stays until
``B i+1``: ``fn[k,r,i+1] <= 1 - K[i]`` with ``K[i]' >= K[i]``, ``K[i]' >= fa + fc``,
``K[i]' <= K[i] + fa + fc`` at slots of stage ``i+1``. A tape is consumed by ``B`` only
(thesis Lemma 4): ``zT = 0``. With these, the optimum equals the persistent DP
(:mod:`optmem.solvers.checkpoint_dp`, paper variant) on every instance tested (1,750
(chain, limit) pairs with ``L = 3..5`` and the test-suite).

Objective
---------
``min sum_p uf[j] (fa + fc + fn) + ub[L+1] + sum_k ub[k]`` (the backward part is constant).

Every state is a 0/1 variable (declared binary: HiGHS presolve mis-handles such models
when they are continuous, see ``rotor.md`` Findings 3).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.plan import LOSS, B, F_all, F_ck, F_none, Op, OpKind
from optmem.problems.checkpoint import Discretized

VARIANTS = ("full", "persistent")

Term = tuple[int, float]


@dataclass
class Expr:
    """A linear expression ``sum coef * x[idx] + const`` over formulation variables."""

    terms: list[Term] = field(default_factory=list)
    const: float = 0.0

    def __add__(self, other: Expr) -> Expr:
        return Expr(self.terms + other.terms, self.const + other.const)

    def scaled(self, c: float) -> Expr:
        """Return ``c * self``."""
        return Expr([(i, c * v) for i, v in self.terms], c * self.const)


def var(i: int, c: float = 1.0) -> Expr:
    """The expression ``c * x[i]``."""
    return Expr([(i, c)])


def const(c: float) -> Expr:
    """A constant expression."""
    return Expr([], float(c))


@dataclass(frozen=True)
class Constraint:
    """``lo <= expr <= hi`` (``None`` for no bound); ``expr`` has no constant."""

    name: str
    terms: tuple[Term, ...]
    lo: float | None
    hi: float | None


@dataclass(frozen=True)
class Slot:
    """A forward slot ``(phase, sweep, stage)`` and the indices of its op variables."""

    phase: int
    sweep: int
    stage: int
    ops: tuple[tuple[OpKind, int], ...]


@dataclass
class Formulation:
    """The backend-neutral 0/1 model (see the module docstring).

    Attributes
    ----------
    names
        Variable names; every variable is binary except ``peak_var``.
    constraints
        Linear constraints.
    objective, objective_const
        Linear objective (op times) and its constant (backward and loss times).
    sequence
        Forward slots and backward-type ops in execution order.
    derivations
        How every non-op variable follows from earlier ones (to complete a warm start).
    peak_var
        In min-peak mode (``memory_limit=None``), the variable bounding every op's memory,
        which is then the objective (integer, or continuous when ``size_scale > 1``).
    size_scale
        Sizes of the model are the chain's divided by this (min-peak mode on byte-sized
        chains: MILP engines mishandle coefficients of ~1e9, see :func:`build_formulation`).
    states
        For models that extend this one (:mod:`optmem.models.remat_offload`): the state
        ``(A, T)`` (value index -> expression of ``A[i]`` / ``T[i]``) before each item of
        ``sequence``, and once more after the last one.
    memory_rows
        The memory expression (before the ``<= M`` bound) of each item of ``sequence``, with
        its row name, in the same order.
    """

    length: int
    memory_limit: int
    variant: str
    sweeps: int
    names: list[str] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    objective: dict[int, float] = field(default_factory=dict)
    objective_const: float = 0.0
    sequence: list[Slot | Op] = field(default_factory=list)
    derivations: list[tuple[Any, ...]] = field(default_factory=list)
    peak_var: int | None = None
    states: list[tuple[dict[int, Expr], dict[int, Expr]]] = field(default_factory=list)
    memory_rows: list[tuple[str, Expr]] = field(default_factory=list)
    size_scale: float = 1.0

    # ------------------------------------------------------------------ building
    def new_var(self, name: str) -> int:
        """Add a binary variable and return its index."""
        self.names.append(name)
        return len(self.names) - 1

    def add(self, name: str, expr: Expr, lo: float | None = None, hi: float | None = None
            ) -> None:
        """Add ``lo <= expr <= hi``; constant-only constraints are checked right away."""
        merged: dict[int, float] = {}
        for i, c in expr.terms:
            merged[i] = merged.get(i, 0.0) + c
        terms = tuple((i, c) for i, c in merged.items() if c != 0)
        lo2 = None if lo is None else lo - expr.const
        hi2 = None if hi is None else hi - expr.const
        if not terms:
            if (lo2 is not None and lo2 > 1e-9) or (hi2 is not None and hi2 < -1e-9):
                self.constraints.append(Constraint(name + "!", (), lo2, hi2))  # infeasible
            return
        self.constraints.append(Constraint(name, terms, lo2, hi2))

    @property
    def size(self) -> dict[str, int]:
        """Number of variables, constraints and non-zeros."""
        return {"variables": len(self.names), "constraints": len(self.constraints),
                "nonzeros": sum(len(c.terms) for c in self.constraints)}

    @property
    def trivially_infeasible(self) -> bool:
        """Whether a constraint without variables is violated (e.g. ``a^0`` above ``M``)."""
        return any(not c.terms for c in self.constraints)

    # ------------------------------------------------------------------ checking
    def evaluate(self, values: Sequence[float]) -> float:
        """Objective value of an assignment."""
        return self.objective_const + sum(c * values[i] for i, c in self.objective.items())

    def violated(self, values: Sequence[float], tol: float = 1e-6) -> list[str]:
        """Names of the constraints an assignment violates."""
        bad = []
        for con in self.constraints:
            v = sum(c * values[i] for i, c in con.terms)
            if (con.lo is not None and v < con.lo - tol) or (con.hi is not None
                                                               and v > con.hi + tol):
                bad.append(con.name)
        return bad

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
        values = [0] * len(self.names)
        ops = list(plan)
        pos = 0
        for item in self.sequence:
            if isinstance(item, Op):
                if pos >= len(ops) or ops[pos] != item:
                    return None
                pos += 1
                continue
            if pos < len(ops) and ops[pos].kind is not OpKind.B and ops[pos] != LOSS \
                    and ops[pos].stage == item.stage:
                match = [idx for kind, idx in item.ops if kind is ops[pos].kind]
                if match:
                    values[match[0]] = 1
                    pos += 1
        if pos != len(ops):
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


def _arrays(chain: Chain, scale: float = 1.0) -> dict[str, list]:
    L = chain.length

    def sizes(values: list[int]) -> list:
        return values if scale == 1 else [v / scale for v in values]

    return {
        "a": sizes([chain.input_size, *chain.output_size]),
        "abar": sizes([chain.input_size, *chain.saved_size]),
        "uf": [0.0, *chain.fwd_time],
        "of": sizes([0, *chain.fwd_overhead]),
        "ub": [0.0, *chain.bwd_time, chain.loss_bwd_time],
        "ob": sizes([0, *chain.bwd_overhead, chain.loss_bwd_overhead]),
        "L": [L],
    }


def build_formulation(chain: Chain, memory_limit: int | None, variant: str = "full",
                      sweeps: int = 1, *, size_scale: float = 1.0) -> Formulation:
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
        :data:`optmem.solvers.engines.MAX_COEFFICIENT` (with raw byte coefficients, HiGHS
        called an always-feasible model infeasible); the peak variable is then continuous
        and the true peak is the decoded plan's, replayed by the simulator.
    """
    if size_scale != 1 and memory_limit is not None:
        raise ValueError("size_scale is for the min-peak mode (memory_limit=None) only")
    if variant not in VARIANTS:
        raise OptmemInputError(f"unknown exact-model variant {variant!r} "
                               f"(expected one of {', '.join(VARIANTS)})", field="variant")
    if sweeps < 1:
        raise OptmemInputError(f"expected at least one sweep, got {sweeps}", field="sweeps")
    ar = _arrays(chain, size_scale)
    L = chain.length
    a, abar, uf, of, ub, ob = ar["a"], ar["abar"], ar["uf"], ar["of"], ar["ub"], ar["ob"]
    persistent = variant == "persistent"
    f = Formulation(L, -1 if memory_limit is None else memory_limit, variant, sweeps,
                    size_scale=size_scale)
    f.objective_const = float(sum(ub[1:]))
    if memory_limit is None:
        f.peak_var = f.new_var("peak")

    def fits(name: str, expr: Expr) -> None:
        """``expr <= M``, or ``expr <= peak`` in min-peak mode."""
        f.memory_rows.append((name, expr))
        if f.peak_var is None:
            f.add(name, expr, hi=memory_limit)
        else:
            f.add(name, expr + var(f.peak_var, -1), hi=0)
    # state: value -> Expr (a single variable or a constant)
    A: dict[int, Expr] = {i: const(0) for i in range(L + 1)}
    A[0] = const(1)
    T: dict[int, Expr] = {i: const(0) for i in range(1, L + 1)}
    K: dict[int, Expr] = {i: const(0) for i in range(L + 1)}

    def stored() -> Expr:
        out = const(0)
        for i in range(L + 1):
            out = out + A[i].scaled(a[i])
        for i in range(1, L + 1):
            out = out + T[i].scaled(abar[i])
        return out

    def fresh(name: str, expr: Expr) -> Expr:
        """A new binary variable equal to ``expr`` (or ``expr`` itself if constant)."""
        if not expr.terms:
            return expr
        if len(expr.terms) == 1 and expr.terms[0][1] == 1 and expr.const == 0:
            return expr
        v = f.new_var(name)
        f.add(f"def_{name}", var(v) + expr.scaled(-1), 0, 0)
        f.derivations.append(("lin", v, list(expr.terms), expr.const))
        return var(v)

    for k in range(L + 1, 0, -1):
        d_k = a[k] if k <= L else 0
        last = L if k == L + 1 else k
        for r in range(1, sweeps + 1):
            for j in range(1, last + 1):
                tag = f"{k}_{r}_{j}"
                kinds = [OpKind.F_ALL]
                if k == L + 1 or j < k:
                    kinds.append(OpKind.F_CK)
                if j > 1 and (k == L + 1 or j < k or sweeps > 1):
                    kinds.append(OpKind.F_NONE)
                idx = {kind: f.new_var(f"{kind.value}_{tag}") for kind in kinds}
                f.states.append((dict(A), dict(T)))
                f.sequence.append(Slot(k, r, j, tuple(idx.items())))
                for v in idx.values():
                    f.objective[v] = float(uf[j])
                y = Expr([(v, 1.0) for v in idx.values()])
                has_in = A[j - 1] + (T[j - 1] if j > 1 else const(0))
                f.add(f"one_{tag}", y, hi=1)
                f.add(f"input_{tag}", y + has_in.scaled(-1), hi=0)
                f.add(f"nodup_{tag}", y + A[j] + T[j], hi=1)
                out = Expr([(idx[OpKind.F_ALL], abar[j])])
                prod_a = Expr([(idx[kk], 1.0) for kk in (OpKind.F_CK, OpKind.F_NONE)
                               if kk in idx])
                out = out + prod_a.scaled(a[j])
                fits(f"mem_{tag}", stored() + const(d_k) + out + y.scaled(of[j]))
                keep = Expr([(idx[kk], 1.0) for kk in (OpKind.F_ALL, OpKind.F_CK)
                             if kk in idx])
                if persistent:
                    if OpKind.F_NONE in idx:
                        f.add(f"persist_{tag}", var(idx[OpKind.F_NONE]) + K[j - 1], hi=1)
                    kv = f.new_var(f"K{j - 1}_{tag}")
                    f.add(f"Kge_{tag}", var(kv) + K[j - 1].scaled(-1), lo=0)
                    f.add(f"Kge2_{tag}", var(kv) + keep.scaled(-1), lo=0)
                    f.add(f"Kle_{tag}", var(kv) + K[j - 1].scaled(-1) + keep.scaled(-1), hi=0)
                    f.derivations.append(("or", kv, [i for i, _ in K[j - 1].terms
                                                     + keep.terms]))
                    K[j - 1] = var(kv)
                if OpKind.F_NONE in idx:
                    fn = idx[OpKind.F_NONE]
                    za = f.new_var(f"zA_{tag}")
                    f.add(f"zA_{tag}", var(za) + A[j - 1].scaled(-1), hi=0)
                    f.derivations.append(("and", za, fn, A[j - 1].terms[0][0])
                                         if A[j - 1].terms else ("lin", za, [], 0))
                    if persistent:
                        zt_expr = const(0)
                        f.add(f"zsum_{tag}", var(za) + var(fn, -1), lo=0, hi=0)
                    else:
                        zt = f.new_var(f"zT_{tag}")
                        zt_expr = var(zt)
                        f.add(f"zT_{tag}", var(zt) + T[j - 1].scaled(-1), hi=0)
                        f.add(f"zsum_{tag}", var(za) + var(zt) + var(fn, -1), lo=0, hi=0)
                        f.derivations.append(("and", zt, fn, T[j - 1].terms[0][0])
                                             if T[j - 1].terms else ("lin", zt, [], 0))
                    A[j - 1] = fresh(f"A{j - 1}_{tag}", A[j - 1] + var(za, -1))
                    if j > 1:
                        T[j - 1] = fresh(f"T{j - 1}_{tag}", T[j - 1] + zt_expr.scaled(-1))
                A[j] = fresh(f"A{j}_{tag}", A[j] + prod_a)
                T[j] = fresh(f"T{j}_{tag}", T[j] + var(idx[OpKind.F_ALL]))
        f.states.append((dict(A), dict(T)))
        if k == L + 1:
            f.sequence.append(LOSS)
            f.add("loss_input", A[L] + T[L], lo=1)
            fits("mem_loss", stored() + const(a[L] + ob[L + 1]))
            A[L] = const(0)
        else:
            f.sequence.append(B(k))
            f.add(f"tape_{k}", T[k], lo=1)
            f.add(f"binput_{k}", A[k - 1] + (T[k - 1] if k > 1 else const(0)), lo=1)
            fits(f"mem_B{k}", stored() + const(a[k] + a[k - 1] + ob[k]))
            T[k] = const(0)
            A[k - 1] = const(0)
    f.states.append((dict(A), dict(T)))
    if f.peak_var is not None:
        f.objective = {f.peak_var: 1.0}
        f.objective_const = 0.0
    return f


# ------------------------------------------------------------------ PuLP emission
@dataclass
class CheckpointILP:
    """The PuLP model of a :class:`Formulation` (``problem``) and its variables."""

    formulation: Formulation
    problem: Any  # pulp.LpProblem
    variables: list[Any]  # pulp.LpVariable, same order as formulation.names

    def values(self) -> list[float]:
        """Variable values after a solve (0 for unset ones)."""
        return [v.varValue or 0.0 for v in self.variables]


def build_checkpoint_ilp(disc: Discretized, variant: str = "full",
                         sweeps: int = 1) -> CheckpointILP:
    """Build the PuLP model of the discretised instance ``disc`` (see module docstring)."""
    form = build_formulation(disc.chain, disc.memory_limit, variant, sweeps)
    return emit_pulp(form)


def emit_pulp(form: Formulation) -> CheckpointILP:
    """Write ``form`` as a PuLP problem (binary variables, named rows)."""
    import pulp  # type: ignore[import-untyped]

    prob = pulp.LpProblem("optmem_checkpoint", pulp.LpMinimize)
    peak_cat = pulp.LpInteger if form.size_scale == 1 else pulp.LpContinuous
    xs = [prob.add_variable(n, 0, 1, cat=pulp.LpBinary) if i != form.peak_var
          else prob.add_variable(n, 0, None, cat=peak_cat)
          for i, n in enumerate(form.names)]
    objective = pulp.lpSum(c * xs[i] for i, c in form.objective.items())
    if form.objective_const:
        # MPS has no portable objective constant: carry it on a variable fixed to 1
        one = prob.add_variable("objective_constant", 1, 1, cat=pulp.LpInteger)
        one.setInitialValue(1)
        objective += form.objective_const * one
    prob += objective
    for con in form.constraints:
        lhs = pulp.lpSum(c * xs[i] for i, c in con.terms)
        if con.lo is not None and con.hi is not None and con.lo == con.hi:
            prob += (lhs == con.hi, con.name)
            continue
        if con.hi is not None:
            prob += (lhs <= con.hi, con.name if con.lo is None else con.name + "_hi")
        if con.lo is not None:
            prob += (lhs >= con.lo, con.name if con.hi is None else con.name + "_lo")
    if form.trivially_infeasible and xs:  # keep exported files honest: an infeasible row
        prob += (xs[0] >= 2, "infeasible_constant_row")
    return CheckpointILP(form, prob, xs)


def decode_checkpoint_ilp(model: CheckpointILP | Formulation,
                          values: Sequence[float] | None = None) -> tuple[Op, ...]:
    """The plan of a solved model (values from the engine, or the PuLP variables)."""
    if isinstance(model, CheckpointILP):
        form = model.formulation
        values = model.values() if values is None else values
    else:
        form = model
        if values is None:
            raise ValueError("values are needed to decode a bare formulation")
    return form.decode([round(v) for v in values])


def write_model(model: CheckpointILP, path: str | Path) -> None:
    """Write ``model`` as ``.mps`` or ``.lp`` (by suffix), atomically.

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
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(suffix=suffix, prefix=".optmem-", dir=directory)
    except OSError as exc:
        raise OptmemInputError(f"cannot write {path} ({exc.strerror})", field="output") from None
    os.close(fd)
    try:
        if suffix == ".mps":
            model.problem.writeMPS(tmp)
        else:
            model.problem.writeLP(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise OptmemInputError(f"cannot write {path} ({exc.strerror})", field="output") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
