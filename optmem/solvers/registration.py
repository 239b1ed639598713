"""How a solver module declares its methods (no global state, no import side effects).

A solver module decorates each method with :func:`register` and each model exporter with
:func:`register_exporter`; the decorators only attach a :class:`MethodInfo` (or the
exporter's key) to the function. The one list of every problem's methods is
:mod:`optmem.solvers.registry`, which the facade reads.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from optmem.result import Result, SolveOptions

__all__ = ["Exporter", "MethodFn", "MethodInfo", "declared_exports", "declared_methods",
           "register", "register_exporter"]

MethodFn = Callable[[Any, SolveOptions], Result]
Exporter = Callable[[Any, SolveOptions, str], None]

_METHODS_ATTR = "optmem_methods"
_EXPORTS_ATTR = "optmem_exports"


@dataclass(frozen=True)
class MethodInfo:
    """A declared method.

    Parameters
    ----------
    problem, name
        Problem name and method name (``checkpoint``, ``dp``).
    fn
        ``fn(problem, options) -> Result``.
    exact
        Whether the method proves optimality (of its own model).
    description
        One line for ``--help`` and tables.
    requires
        Importable modules the method needs (for :func:`is_available`).
    in_compare
        Whether ``compare`` runs it by default.
    max_length
        Longest chain ``compare`` runs it on by default (``None``: no limit).
    compare_as
        ``(label, max_length)`` pairs that ``compare`` runs by default, where a label is
        ``name`` or ``name:variant``; default ``((name, max_length),)``.
    compare_limited
        Longest chain ``compare`` also runs it on by default (as ``name``, despite
        ``max_length`` and ``in_compare=False``) when a time limit or a work budget bounds
        the solve (:func:`optmem.solvers.facade.default_compare_methods`; 0: never): the
        problem's exact model with the best bound in a bounded time, so that ``compare``'s
        summary has a proven bound for every problem (issue 15, item 5). Capped where the
        method was measured to keep a 10 s limit within about 2.5x (stop 73).
    extra
        The ``SolveOptions.extra`` keys the method reads (any other key is an input error).
    default
        Whether ``method="auto"`` picks it (one per problem).
    full_model
        Whether the method solves the problem's exact model (the exact models and brute
        force; pipeline ``chunks``, which decides allocations with the exact model and whose
        bound, ``optimal`` and ``infeasible`` hold for every plan of the problem, as
        ``ilp``'s), so that its bound is a lower bound for every plan of that model's class
        (the class its module documents, e.g. one increasing forward run per phase for the
        checkpoint ILP with ``sweeps = 1``). ``exact`` alone is weaker: the contiguous
        pipeline DP proves optimality among contiguous allocations only. ``compare``'s
        summary reads bounds of these methods only.
    restricted_variants
        Variants of a ``full_model`` method that solve a restriction of the full model (the
        checkpoint ILP's ``persistent``): their bounds hold for that restriction only.
    variants
        Every variant the method accepts (``options.variant``, ``NAME:VARIANT``), its
        default first; empty for a method without variants. The facade refuses any other
        variant before the method runs (:func:`optmem.solvers.facade.solve`).
    """

    problem: str
    name: str
    fn: MethodFn
    exact: bool
    description: str
    requires: tuple[str, ...] = ()
    in_compare: bool = True
    max_length: int | None = None
    compare_as: tuple[tuple[str, int | None], ...] = ()
    extra: tuple[str, ...] = ()
    default: bool = False
    full_model: bool = False
    restricted_variants: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()
    compare_limited: int = 0

    def solves_full_model(self, variant: str | None) -> bool:
        """Whether a result of this method in ``variant`` bounds every plan of the problem."""
        return self.full_model and variant not in self.restricted_variants

    def is_available(self) -> bool:
        """Whether every required module can be imported."""
        return all(importlib.util.find_spec(m) is not None for m in self.requires)


def register(
    problem: str,
    name: str,
    *,
    exact: bool,
    description: str,
    requires: Sequence[str] = (),
    default: bool = False,
    in_compare: bool = True,
    max_length: int | None = None,
    compare_as: Sequence[tuple[str, int | None]] = (),
    extra: Sequence[str] = (),
    full_model: bool = False,
    restricted_variants: Sequence[str] = (),
    variants: Sequence[str] = (),
    compare_limited: int = 0,
) -> Callable[[MethodFn], MethodFn]:
    """Declare ``fn`` as method ``name`` of ``problem`` (decorator; see :class:`MethodInfo`).

    The method is solvable once :mod:`optmem.solvers.registry` lists ``fn``.
    """

    def deco(fn: MethodFn) -> MethodFn:
        info = MethodInfo(problem, name, fn, exact, description, tuple(requires), in_compare,
                          max_length, tuple(compare_as) or ((name, max_length),),
                          tuple(extra), default, full_model,
                          tuple(restricted_variants), tuple(variants), compare_limited)
        setattr(fn, _METHODS_ATTR, (*declared_methods(fn), info))
        return fn

    return deco


def declared_methods(fn: Callable[..., Any]) -> tuple[MethodInfo, ...]:
    """The methods :func:`register` declared on ``fn`` (empty if none)."""
    return tuple(getattr(fn, _METHODS_ATTR, ()))


def register_exporter(problem: str, method: str) -> Callable[[Exporter], Exporter]:
    """Declare ``fn(problem, options, path)`` as the model writer of ``method`` (decorator)."""

    def deco(fn: Exporter) -> Exporter:
        setattr(fn, _EXPORTS_ATTR, (*declared_exports(fn), (problem, method)))
        return fn

    return deco


def declared_exports(fn: Callable[..., Any]) -> tuple[tuple[str, str], ...]:
    """The ``(problem, method)`` keys :func:`register_exporter` declared on ``fn``."""
    return tuple(getattr(fn, _EXPORTS_ATTR, ()))
