"""The facade: one ``solve`` and one ``compare`` for every problem and method.

Solver modules declare their methods (:func:`optmem.solvers.registration.register`) and
:mod:`optmem.solvers.registry` lists every problem's methods; the facade imports that list
on first use, so ``import optmem`` stays light (optional engines such as PuLP and OR-Tools
are imported only when one of their methods runs).
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from optmem.engines.adapters import work_budget
from optmem.errors import OptmemInputError, UnavailableError, check_keywords
from optmem.fileio import write_atomic
from optmem.result import OPTION_NAMES, Result, SolveOptions, Status
from optmem.solvers.registration import Exporter, MethodFn, MethodInfo, register

__all__ = ["Exporter", "MethodFn", "MethodInfo", "available_methods", "best_objective",
           "check_extra", "check_shared_variant", "check_variant", "compare",
           "default_compare_methods", "distinct_methods", "export",
           "limited_compare_methods", "method_info", "method_names_of", "methods",
           "problem_name", "problems", "register", "reraise_input_error", "resolve_options",
           "run_options", "solve", "split_label"]

_REGISTRY: dict[str, dict[str, MethodInfo]] = {}
_DEFAULT: dict[str, str] = {}
_EXPORTERS: dict[tuple[str, str], Exporter] = {}


def _load() -> None:
    if _REGISTRY:
        return
    registry = importlib.import_module("optmem.solvers.registry")
    _EXPORTERS.update(registry.exporters())
    for problem, table in registry.method_infos().items():
        defaults = [name for name, info in table.items() if info.default]
        if defaults:
            _DEFAULT[problem] = defaults[0]
        _REGISTRY[problem] = table


def problems() -> list[str]:
    """Names of every problem with at least one method."""
    _load()
    return sorted(_REGISTRY)


def methods(problem: Any) -> dict[str, MethodInfo]:
    """Registered methods of ``problem`` (name to info): a problem name or a problem object.

    A problem object (``methods(CheckpointProblem(...))``, as CONTRACT writes it) is taken
    by its name since stop 75; before, it was refused with its whole ``repr`` in the line.

    Examples
    --------
    >>> "dp" in methods("checkpoint")
    True
    """
    _load()
    if not isinstance(problem, str):
        problem = problem_name(problem)
    if problem not in _REGISTRY:
        raise OptmemInputError(
            f"unknown problem {problem!r} (expected one of {', '.join(problems())})",
            field="problem")
    return dict(_REGISTRY[problem])


def problem_name(problem: Any) -> str:
    """The name of a problem object (``checkpoint``, ...); anything else raises.

    Examples
    --------
    >>> problem_name("checkpoint")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'problem': expected a problem object ...
    """
    name = getattr(type(problem), "name", None)
    if not isinstance(name, str) or name not in problems():
        raise OptmemInputError(f"expected a problem object (CheckpointProblem, OffloadProblem, "
                               f"RematOffloadProblem, PipelineProblem, MinPeakProblem), got "
                               f"{type(problem).__name__}", field="problem")
    return name


NO_METHODS = ("expected at least one method (for the default ones: no --methods on the "
              "command line, methods=None in Python)")
"""The refusal of an empty list of methods (``--methods ''``, ``","``, ``[]``)."""


def method_names_of(names: Iterable[str] | str | None) -> list[str] | None:
    """Method labels of ``compare``/``sweep``: a list, or one comma-separated string.

    A string is read as the CLI's ``--methods`` (``"dp,ilp"``); ``None`` stays ``None``.

    Examples
    --------
    >>> method_names_of("dp, dp:rotor,ilp"), method_names_of(["dp"]), method_names_of(None)
    (['dp', 'dp:rotor', 'ilp'], ['dp'], None)
    """
    if names is None:
        return None
    if isinstance(names, str):
        return [m.strip() for m in names.split(",") if m.strip()]
    try:
        return list(names)
    except TypeError:
        raise OptmemInputError(f"expected a list of method names or a comma-separated "
                               f"string, got {names!r}", field="methods") from None


def available_methods(problem: Any) -> list[str]:
    """Names of the methods of ``problem`` whose engines are installed."""
    name = problem if isinstance(problem, str) else problem_name(problem)
    return [m for m, info in methods(name).items() if info.is_available()]


def split_label(label: str) -> tuple[str, str | None]:
    """Split ``"dp:rotor"`` into ``("dp", "rotor")``; ``"dp"`` gives ``("dp", None)``."""
    name, _, variant = label.partition(":")
    return name, variant or None


def method_info(problem: str, method: str) -> MethodInfo:
    """Look up one method; unknown names get one clear error listing the known ones."""
    known = methods(problem)
    if not isinstance(method, str):
        raise OptmemInputError(f"expected a method name such as 'dp' or 'dp:rotor', got "
                               f"{method!r}", field="method")
    method = split_label(method)[0]
    if method == "auto":
        method = _DEFAULT.get(problem, next(iter(known)))
    if method not in known:
        raise OptmemInputError(
            f"unknown method {method!r} for {problem} (expected one of {', '.join(known)})",
            field="method")
    return known[method]


def check_variant(problem: str, info: MethodInfo, variant: str | None) -> None:
    """Raise unless ``variant`` is one the method declares (``None`` or ``""``: its default).

    Each method declares its variants where it is registered (``register(...,
    variants=...)``); a method without variants takes none (``chen:rotor`` ran ``chen``
    until stop 53).

    Examples
    --------
    >>> check_variant("checkpoint", method_info("checkpoint", "dp"), "rotor")
    >>> check_variant("checkpoint", method_info("checkpoint", "chen"), "rotor")
    Traceback (most recent call last):
    ...
    optmem.errors.OptmemInputError: field 'variant': method 'chen' of checkpoint has no \
variants, got 'rotor' (methods with variants: dp: paper, rotor, floating, floating-printed; \
ilp: full, persistent; cpsat: full, persistent)
    """
    if not variant or variant in info.variants:
        return
    if info.variants:
        raise OptmemInputError(f"unknown {info.name} variant {variant!r} (expected one of "
                               f"{', '.join(info.variants)})", field="variant")
    raise OptmemInputError(f"method {info.name!r} of {problem} has no variants, got "
                           f"{variant!r} ({_variants_text(problem)})", field="variant")


def _variants_text(problem: str) -> str:
    having = [f"{name}: {', '.join(info.variants)}" for name, info in methods(problem).items()
              if info.variants]
    return "methods with variants: " + "; ".join(having) if having else \
        f"no method of {problem} has variants"


def check_shared_variant(problem: str, labels: Iterable[str], options: SolveOptions) -> None:
    """Raise when ``options.variant`` is a variant of none of the methods it applies to.

    ``compare`` and ``sweep`` apply one ``options.variant`` (``--variant``) to each method
    of ``labels`` without a variant of its own (``dp``, not ``dp:rotor``) that declares it;
    the other methods run their default (:func:`run_options`). A variant that none of them
    declares is an input error, before anything runs.
    """
    variant = options.variant
    if not variant:
        return
    receivers = [method_info(problem, label) for label in labels
                 if split_label(label)[1] is None]
    if any(variant in info.variants for info in receivers):
        return
    names = ", ".join(dict.fromkeys(info.name for info in receivers)) or "none"
    raise OptmemInputError(f"variant {variant!r} is a variant of none of the methods it "
                           f"applies to (methods without a variant in their name: {names}; "
                           f"{_variants_text(problem)})", field="variant")


def run_options(problem: str, info: MethodInfo, label: str, options: SolveOptions, *,
                shared: bool = False) -> SolveOptions:
    """The options one method runs with: the variant of ``label`` or ``options.variant``.

    The variant of ``label`` (``dp:rotor``) overrides ``options.variant``; either is checked
    against the variants the method declares (:func:`check_variant`). With ``shared``
    (``compare``, ``sweep``: one ``options.variant`` for several methods), an
    ``options.variant`` the method does not declare is dropped and the method runs its
    default variant. Without ``shared`` (``solve``, ``export``), a variant in ``label``
    and another ``options.variant`` (``"dp:rotor"`` with ``variant="paper"``) are one input
    error (field ``variant``): until the API audit the label's variant ran in silence.
    """
    variant = split_label(label)[1]
    if variant is not None:
        check_variant(problem, info, variant)
        if not shared and options.variant and options.variant != variant:
            raise OptmemInputError(
                f"method {label!r} names the variant {variant!r}, and the variant "
                f"{options.variant!r} is also given (--variant, SolveOptions.variant): give "
                f"the variant once, in the method or as the variant", field="variant")
        return options.with_(variant=variant)
    if shared and options.variant and options.variant not in info.variants:
        return options.with_(variant=None)
    check_variant(problem, info, options.variant)
    return options


def distinct_methods(problem: str, labels: Sequence[str], options: SolveOptions) -> list[str]:
    """``labels`` without a repeat of one method and variant, the first kept, in order.

    ``compare`` and ``sweep`` (``--methods dp,dp``; ``dp`` and ``dp:paper``, the default
    variant, are one run) run each method once. The labels must be valid
    (:func:`run_options` with ``shared``).

    Examples
    --------
    >>> distinct_methods("checkpoint", ["dp", "chen", "dp:paper", "dp", "dp:rotor"],
    ...                  SolveOptions())
    ['dp', 'chen', 'dp:rotor']
    """
    infos = [method_info(problem, label) for label in labels]
    runs = [run_options(problem, info, label, options, shared=True)
            for label, info in zip(labels, infos, strict=True)]
    return [labels[k] for k in _first_runs(infos, runs)]


def _first_runs(infos: Sequence[MethodInfo], runs: Sequence[SolveOptions]) -> list[int]:
    """The position of each method and variant's first run, in order.

    The variant a run runs is its default when none is given (``dp`` and ``dp:paper``).
    """
    seen: set[tuple[str, str | None]] = set()
    out = []
    for k, (info, run) in enumerate(zip(infos, runs, strict=True)):
        key = (info.name, run.variant or (info.variants[0] if info.variants else None))
        if key not in seen:
            seen.add(key)
            out.append(k)
    return out


def resolve_options(options: SolveOptions | None, overrides: dict[str, Any]) -> SolveOptions:
    """``options`` (default ``SolveOptions()``) with keyword ``overrides`` of its fields.

    An unknown keyword raises :class:`OptmemInputError` naming the closest known one.
    """
    check_keywords(overrides, OPTION_NAMES, what="solve (the fields of SolveOptions)")
    if options is not None and not isinstance(options, SolveOptions):
        raise OptmemInputError(f"expected a SolveOptions or None, got {type(options).__name__} "
                               f"(give its fields as keywords: solve(p, time_limit_s=10))",
                               field="options")
    opts = options or SolveOptions()
    return opts.with_(**overrides) if overrides else opts


def check_extra(problem: str, options: SolveOptions) -> None:
    """Raise for a ``SolveOptions.extra`` key that no method of ``problem`` reads.

    Each method declares the keys it reads (``register(..., extra=...)``); one options
    object may carry keys for several methods of a problem (``compare``, sweeps), so a key
    is accepted when some method of the problem reads it, and a typo gets one error naming
    the closest known key.
    """
    if options.extra:
        known = {key for info in methods(problem).values() for key in info.extra}
        check_keywords(options.extra, known, what=f"SolveOptions.extra of {problem}",
                       elsewhere={**{name: "a SolveOptions field, not an extra key"
                                     for name in OPTION_NAMES},
                                  "extra": "not an option key: the options are the extra "
                                           "keys themselves (--option KEY=VALUE, Python "
                                           "extra={KEY: VALUE})"})


def solve(problem: Any, method: str = "auto", *, options: SolveOptions | None = None,
          **option_fields: Any) -> Result:
    """Solve ``problem`` with ``method`` and return a :class:`Result` (timed).

    ``method`` may carry a variant after a colon (``"dp:rotor"``); it overrides
    ``options.variant``. A variant the method does not declare (``"chen:rotor"``, a typo)
    raises :class:`OptmemInputError` naming the method and its variants. Keyword arguments
    set fields of :class:`SolveOptions` (``solve(p, "ilp", time_limit_s=10)``); an unknown
    one, or an ``options.extra`` key that no method of the problem reads, raises
    :class:`OptmemInputError` naming the closest.
    A failing engine does not raise: the result is ``status: error`` (or ``feasible`` with
    a verified warm start) and ``report['engine_error']`` says what the engine said.

    Examples
    --------
    >>> from optmem.chain import Chain
    >>> from optmem.problems import CheckpointProblem
    >>> chain = Chain.from_rotor([1], [2, 0], [1, 1], [1, 2])
    >>> r = solve(CheckpointProblem(chain, 5), "dp")
    >>> (r.status, r.objective, r.plan)
    (<Status.OPTIMAL: 'optimal'>, 3.0, ('F_all 1', 'Loss', 'B 1'))
    """
    opts = resolve_options(options, option_fields)
    info = method_info(problem_name(problem), method)
    check_extra(problem.name, opts)
    return _run(problem, info, run_options(problem.name, info, method, opts))


def _run(problem: Any, info: MethodInfo, opts: SolveOptions) -> Result:
    """Run one method with the options :func:`run_options` gave it (timed)."""
    if not info.is_available():
        raise UnavailableError(
            f"method {info.name!r} needs {', '.join(info.requires)}; install optmem[engines]",
            field="method")
    start = time.perf_counter()
    with work_budget(opts.work_budget) as budget:
        result = info.fn(problem, opts)
    elapsed = time.perf_counter() - start
    if budget is not None:  # the solve's work so far (the whole solve's, outermost)
        result = result.with_(report={**result.report, **budget.report()})
    return result.with_(solve_time_s=elapsed) if result.solve_time_s == 0.0 else result


def default_compare_methods(problem: Any, options: SolveOptions | None = None) -> list[str]:
    """Methods ``compare`` runs when none are named (available, and sized for the chain).

    Each method's ``compare_as`` labels up to their chain lengths; when ``options`` bound
    the solve (``time_limit_s`` or ``work_budget``), also the ``compare_limited`` method of
    each problem up to its own, longer, length (since stop 73: ``compare remat-offload``
    and ``compare pipeline`` ran no exact model past 6 and 8 stages, so their summary had
    no proven bound on any bundled profile).
    """
    length = getattr(getattr(problem, "chain", None), "length", 0)
    limited = _bounded(options)
    out: list[str] = []
    for info in methods(problem.name).values():
        if not info.is_available():
            continue
        if info.in_compare:
            out.extend(label for label, limit in info.compare_as
                       if limit is None or length <= limit)
        if limited and length <= info.compare_limited and info.name not in out:
            out.append(info.name)
    return out


def _bounded(options: SolveOptions | None) -> bool:
    """Whether ``options`` bound the whole solve (a time limit or a work budget)."""
    return options is not None and (options.time_limit_s is not None
                                    or options.work_budget is not None)


def limited_compare_methods(problem: Any, options: SolveOptions | None = None) -> list[str]:
    """The methods a time limit or work budget would add to ``compare``'s defaults.

    What :func:`default_compare_methods` adds under a limit (``compare_limited``) for this
    chain's length, none when ``options`` bound the solve already: the text summary's hint
    names them, and only offers the limit when there is one (since stop 74; before, it
    offered it past every cap and for ``min-peak``).
    """
    if _bounded(options):
        return []
    free = default_compare_methods(problem)
    limited = default_compare_methods(problem, SolveOptions(time_limit_s=1.0))
    return [name for name in limited if name not in free]


def compare(
    problem: Any,
    method_names: Iterable[str] | str | None = None,
    *,
    options: SolveOptions | None = None,
    progress: Callable[[str], None] | None = None,
    **option_fields: Any,
) -> list[Result]:
    """Run several methods on the same problem and return their results in order.

    ``method_names`` is a list of labels or one comma-separated string (``"dp,ilp"``, as the
    CLI's ``--methods``), not empty; ``None`` runs the problem's default methods. Unknown
    method names, unknown option keywords and ``options.extra`` keys that no method of the
    problem reads fail before anything runs. ``options.variant`` applies to each method
    that declares it and has no variant in its label; the others run their default variant
    (an error before anything runs if none declares it, :func:`check_shared_variant`); a
    variant in a label (``dp:rotor``) must be one of that method's. A method that then fails
    (an option it does not support, or an unexpected error) is
    reported as ``status: error`` with the message in ``report['error']`` instead of
    aborting the comparison. A bad value of an
    ``extra`` key that the method reads raises, as :func:`solve` does (since stop 51: the
    CLI's ``compare`` exited 0 with an error row where ``solve`` exits 2).
    """
    opts = resolve_options(options, option_fields)
    given = method_names_of(method_names)
    kind = problem_name(problem)
    if given is not None and not given:  # "," or []: an empty table, exit 0, until stop 52
        raise OptmemInputError(NO_METHODS, field="methods")
    names = given if given is not None else default_compare_methods(problem, opts)
    infos = [method_info(kind, label) for label in names]  # unknown names fail first
    check_extra(kind, opts)
    runs = [run_options(kind, info, label, opts, shared=True)  # dp:bogus, chen:rotor
            for label, info in zip(names, infos, strict=True)]
    check_shared_variant(kind, names, opts)
    kept = _first_runs(infos, runs)  # dp,dp ran twice until the API audit
    names = [names[k] for k in kept]
    infos = [infos[k] for k in kept]
    runs = [runs[k] for k in kept]
    results = []
    for name, info, run in zip(names, infos, runs, strict=True):
        if progress:
            progress(name)
        try:
            results.append(_run(problem, info, run))
        except OptmemInputError as exc:
            if reraise_input_error(exc, info, run):
                raise  # a bad value of an option this method reads: bad input, as for solve
            results.append(_error_row(problem, name, run, exc))
        except Exception as exc:  # noqa: BLE001 - reported in the table, not swallowed
            results.append(_error_row(problem, name, run, exc))
    return results


def reraise_input_error(exc: OptmemInputError, info: MethodInfo,
                        options: SolveOptions) -> bool:
    """Whether an input error of one method of ``compare``/``sweep`` is the user's input.

    True for a refused value of an ``extra`` key the method reads, and for a refused
    variant the method was given (a variant it declares but not for this problem, such as
    min-peak ``dp:cubic`` on the ``pytorch`` model): ``solve`` exits 2 on both, and so do
    ``compare`` and ``sweep``, instead of an ``error`` row.
    """
    return (exc.field in options.extra and exc.field in info.extra) or \
        (exc.field == "variant" and bool(options.variant))


def _error_row(problem: Any, name: str, options: SolveOptions, exc: BaseException) -> Result:
    """``compare``'s row for a method that failed (``status: error``, the message)."""
    return Result(problem.name, split_label(name)[0], Status.ERROR, variant=options.variant,
                  report={"error": f"{type(exc).__name__}: {exc}"})


def best_objective(results: Iterable[Result]) -> float:
    """Smallest objective among results that carry a plan (``inf`` if none)."""
    values = [r.objective for r in results if r.status.has_plan and math.isfinite(r.objective)]
    return min(values, default=math.inf)


# ------------------------------------------------------------------ model export
def export(problem: Any, method: str, path: str | os.PathLike[str], *,
           options: SolveOptions | None = None, **option_fields: Any) -> None:
    """Write the exact model of ``problem`` built by ``method`` to ``path``.

    ``.mps``/``.lp`` for every exportable method; ``cpsat`` also ``.pb``/``.pbtxt``.
    """
    _load()
    options = resolve_options(options, option_fields)
    method_info(problem_name(problem), method)  # a problem object and a known method name
    check_extra(problem.name, options)
    if not isinstance(path, str | os.PathLike):
        raise OptmemInputError(f"expected a file path, got {path!r}", field="output")
    name = split_label(method)[0]
    opts = run_options(problem.name, method_info(problem.name, method), method,
                       options or SolveOptions())
    key = (problem.name, name)
    if key not in _EXPORTERS:
        known = ", ".join(m for p, m in _EXPORTERS if p == problem.name) or "none"
        raise OptmemInputError(
            f"method {name!r} of {problem.name} has no exportable model (exportable: {known})",
            field="method")
    formats = (".mps", ".lp") + ((".pb", ".pbtxt") if name == "cpsat" else ())
    # any case, as the exporters and the CLI read it (m.MPS was refused until the API audit)
    if not os.fspath(path).lower().endswith(formats):  # offload's exporter took any name
        raise OptmemInputError(f"cannot tell the model format from {os.fspath(path)!r} "
                               f"(expected a {', '.join(formats[:-1])} or {formats[-1]} file)",
                               field="output")
    # every exporter writes a temporary file renamed over ``path``: nothing half-written
    write_atomic(os.fspath(path), lambda tmp: _EXPORTERS[key](problem, opts, str(tmp)),
                 field="output")
