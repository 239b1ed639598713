"""Command line: ``python -m optmem`` (also installed as ``optmem``), CONTRACT section 4.

Commands: ``solve``, ``compare``, ``verify``, ``export``, ``datasets``, ``demo`` and the
extra commands of ``EXTRA_COMMANDS`` (``profile``, ``sweep``, ``show``). Bad input prints one
line on stderr and exits 2; an infeasible instance exits 0 with ``status: infeasible``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib
import importlib.util
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from optmem.chain import Chain
from optmem.cli_problems import HOOKS, ProblemHooks, check_problem_options, option_defaults
from optmem.errors import OptmemInputError, PlanError
from optmem.fileio import read_json, write_text_atomic
from optmem.result import MAX_WORKERS, OPTION_NAMES, Result, SolveOptions, Status
from optmem.units import format_size, memory_percent, relative_memory

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
MEMORY_OBJECTIVE = {"min-peak"}  # problems whose objective is a memory size, not a time
OPTIONAL_MEMORY = {"min-peak"}  # problems for which --memory is an optional upper bound
RELATIVE_MEMORY = {"checkpoint", "offload", "remat-offload"}  # --memory may be "60%" of store-all
MODEL_SUFFIXES = (".mps", ".lp", ".pb", ".pbtxt")  # export: MPS/LP (every model), CP-SAT protos

# Modules that add whole subcommands through ``register_cli(subparsers)``.
EXTRA_COMMANDS = ["optmem.pytorch.cli", "optmem.sweep", "optmem.show"]


def worker_count(text: str) -> int:
    """Parse ``--threads`` / ``--jobs``: an integer in ``1..MAX_WORKERS``.

    HiGHS aborts the whole process when asked for 100000 threads and spends minutes starting
    8192; CP-SAT rejects such models; so the CLI refuses them up front.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_WORKERS}, got {value}")
    return value


def number_text(text: str) -> int | float:
    """A number flag's text as Python would give it: ``1000`` an int, ``1e3`` a float.

    For flags whose value :class:`SolveOptions` checks (``--node-limit``): the CLI takes
    what ``SolveOptions(node_limit=1e3)`` takes, and refuses it in the same words.
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise OptmemInputError(f"{self.prog}: {message}")


# ------------------------------------------------------------------ problems
def problem_hooks(problem: str) -> ProblemHooks:
    """The CLI hooks of ``problem`` (:data:`optmem.cli_problems.HOOKS`)."""
    hooks = HOOKS.get(problem)
    if hooks is None:
        from optmem.solvers.facade import problems

        raise OptmemInputError(
            f"unknown problem {problem!r} (expected one of {', '.join(problems())})",
            field="problem")
    return hooks


def add_problem_options(parser: argparse.ArgumentParser) -> None:
    """Options of every problem module, so ``--help`` lists them (each added once)."""
    from optmem.solvers.facade import problems

    seen: set[str] = set()
    for problem in problems():
        hook = problem_hooks(problem).add_options
        if hook is None:
            continue
        group = parser.add_argument_group(f"{problem} options")
        probe = _Parser(add_help=False)
        hook(probe)
        for action in probe._actions:
            if any(opt in seen for opt in action.option_strings):
                continue
            seen.update(action.option_strings)
            group._add_action(action)


def memory_from_args(problem: str, args: argparse.Namespace, chain: Chain) -> int | None:
    """``--memory`` in bytes (``None`` when absent, which only min-peak allows).

    ``--memory 60%`` is 60 % of ``chain``'s store-all peak, rounded down
    (:func:`~optmem.units.relative_memory`), for the problems whose limit bounds the chain's
    activations (:data:`RELATIVE_MEMORY`).
    """
    text = getattr(args, "memory", None)
    if text is None:
        if problem in OPTIONAL_MEMORY:
            return None
        raise OptmemInputError(f"the {problem} problem needs --memory (e.g. --memory 4GiB)",
                               field="--memory")
    if memory_percent(text, field="--memory") is not None and problem not in RELATIVE_MEMORY:
        raise OptmemInputError(f"a percentage of the store-all peak is a limit of "
                               f"{', '.join(sorted(RELATIVE_MEMORY))} only; give the {problem} "
                               f"problem a size (e.g. --memory 4GiB)", field="--memory")
    return relative_memory(text, chain.store_all_peak(), field="--memory")


def build_problem(problem: str, chain: Chain, memory_limit: int | None,
                  args: argparse.Namespace) -> Any:
    """Build the problem object from the parsed arguments."""
    hooks = problem_hooks(problem)
    check_problem_options(problem, args)
    if memory_limit is None and problem not in OPTIONAL_MEMORY:
        raise OptmemInputError(f"the {problem} problem needs --memory (e.g. --memory 4GiB)",
                               field="--memory")
    return hooks.from_cli(chain, memory_limit, args)


def load_chain(spec: str) -> Chain:
    """A chain file path or a bundled dataset name."""
    from optmem.datasets import resolve_chain

    return resolve_chain(spec)


def options_from_args(args: argparse.Namespace) -> SolveOptions:
    """The :class:`SolveOptions` of the common flags."""
    extra = parse_extra_options(getattr(args, "option", None) or [])
    for key in extra:  # Python's SolveOptions(time_limit_s=3) is a flag here, not an option
        if key in OPTION_NAMES and key != "extra":
            raise OptmemInputError(f"{key} is a setting of every method, not an option of "
                                   f"one: on the command line it is {_flag_of(key)}",
                                   field="--option")
    try:
        return SolveOptions(variant=args.variant, slots=args.slots,
                            time_limit_s=args.time_limit, solver=args.solver,
                            threads=args.threads, verbose=args.verbose,
                            node_limit=getattr(args, "node_limit", None),
                            deterministic_time=getattr(args, "deterministic_time", None),
                            seed=getattr(args, "seed", 0), extra=extra,
                            work_budget=getattr(args, "work_budget", None))
    except OptmemInputError as exc:
        raise OptmemInputError(exc.reason, field=_flag_of(exc.field or "")) from None


def _flag_of(field: str) -> str:
    """The flag of a :class:`SolveOptions` field (``time_limit_s``: ``--time-limit``)."""
    return "--" + {"time_limit_s": "time_limit"}.get(field, field).replace("_", "-")


def parse_extra_options(items: Sequence[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` flags as ``SolveOptions.extra`` (the Python API's ``extra``).

    A value is read as JSON where it parses (``4``, ``true``, ``{"a": 1}``, ``[1, 2]``),
    otherwise kept as a string (``strategy=benders``). Which keys a method reads is checked
    by the facade (one error naming the closest known key).

    Examples
    --------
    >>> parse_extra_options(["strategy=benders", "sweeps=2", "prefetch=true"])
    {'strategy': 'benders', 'sweeps': 2, 'prefetch': True}
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OptmemInputError(f"expected KEY=VALUE, got {item!r}", field="--option")
        if key in out:
            raise OptmemInputError(f"option {key!r} given twice", field="--option")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


# ------------------------------------------------------------------ output
def _fmt(value: float | None, digits: int = 6) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}g}"


def size_text(value: int, unit: Chain | str) -> str:
    """A size in a chain's memory unit as text: ``1.50 GiB`` for bytes, ``19 KiB`` otherwise.

    ``unit`` is the chain or its ``memory_unit``. Byte sizes get binary prefixes
    (:func:`~optmem.units.format_size`); a size in another unit is printed as it is.
    """
    name = unit.memory_unit if isinstance(unit, Chain) else unit
    return format_size(value) if name == "B" else f"{value} {name}"


def format_result(result: Result, chain: Chain) -> str:
    """Human-readable summary of one result."""
    lines = [f"problem   {result.problem}   method {result.method}"
             + (f" ({result.variant})" if result.variant else "")
             + (f"   solver {result.solver}" if result.solver else ""),
             f"status    {result.status}"]
    if result.status.has_plan:
        unit = chain.memory_unit if result.problem in MEMORY_OBJECTIVE else chain.time_unit
        lines.append(f"objective {_fmt(result.objective)} {unit}"
                     f"   bound {_fmt(result.bound)}   gap {_fmt(result.gap * 100, 3)}%")
        limit = "" if result.memory_limit is None else f" / {result.memory_limit}"
        lines.append(f"peak      {result.peak_memory}{limit} units of "
                     f"{result.unit} {chain.memory_unit}"
                     f" ({size_text((result.peak_memory or 0) * result.unit, chain)})")
        lines.append(f"plan      {len(result.plan)} ops: " + " ".join(result.plan[:30])
                     + (" ..." if len(result.plan) > 30 else ""))
    if result.min_feasible_memory is not None:
        lines.append(f"smallest feasible memory: {result.min_feasible_memory} "
                     f"{chain.memory_unit} ({size_text(result.min_feasible_memory, chain)})")
    for key in ("hint", "error"):
        if key in result.report:
            lines.append(f"{key}: {result.report[key]}")
    lines.append(f"time      {result.solve_time_s:.3f} s")
    return "\n".join(lines)


def format_table(results: Sequence[Result], chain: Chain) -> str:
    """The ``compare`` table: status, objective, bound, gap, gap to the best, peak, time."""
    from optmem.solvers.facade import best_objective

    best = best_objective(results)
    header = ("method", "status", "objective", "bound", "gap%", "vs best%", "peak", "time s")
    rows = []
    for r in results:
        label = _label(r)
        vs_best = (r.objective / best - 1) * 100 if r.status.has_plan and best > 0 else math.nan
        peak = f"{r.peak_memory}/{r.memory_limit}" if r.peak_memory is not None else "-"
        rows.append((label, str(r.status), _fmt(r.objective), _fmt(r.bound),
                     _fmt(r.gap * 100, 3), _fmt(vs_best, 3), peak, f"{r.solve_time_s:.3f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    out += [line.format(*row) for row in rows]
    objective_unit = chain.memory_unit if results and results[0].problem in MEMORY_OBJECTIVE \
        else chain.time_unit
    units = f"(objective in {objective_unit}; peak/limit in units of {results[0].unit} " \
            f"{chain.memory_unit})" if results else ""
    return "\n".join(out + [units])


def dp_summary(results: Sequence[Result]) -> dict[str, Any]:
    """The DP's value against the exact models' proven bound (issue 15, item 5).

    ``dp``: the problem's default method (best of its rows); ``bound``: the largest bound of
    the rows of methods that solve the problem's full model
    (:meth:`~optmem.solvers.registration.MethodInfo.solves_full_model`: not a DP whose
    bound holds in its own model only, not a restricted variant); ``optimum``: their
    objective when one is proven optimal; ``gap``: ``(dp - bound) / dp``; ``infeasible``:
    the first such method that proved the limit infeasible (no plan at all). Missing values
    are ``None``.
    """
    from optmem.solvers.facade import method_info

    out: dict[str, Any] = {"dp_method": None, "dp": None, "bound": None, "bound_method": None,
                           "optimum": None, "gap": None, "infeasible": None}
    if not results:
        return out
    default = method_info(results[0].problem, "auto").name
    dps = [r for r in results if r.method == default and r.status.has_plan]
    full = [r for r in results
            if method_info(r.problem, r.method).solves_full_model(r.variant)]
    refuted = [r for r in full if r.status is Status.INFEASIBLE]
    if refuted:
        out["infeasible"] = _label(refuted[0])
    exact = [r for r in full if math.isfinite(r.bound) and r.status is not Status.ERROR]
    if dps:
        best = min(dps, key=lambda r: r.objective)
        out.update(dp_method=_label(best), dp=best.objective)
    if exact:
        top = max(exact, key=lambda r: r.bound)
        out.update(bound=top.bound, bound_method=_label(top))
        proven = [r for r in exact if r.status is Status.OPTIMAL]
        if proven:
            out["optimum"] = min(r.objective for r in proven)
    if out["dp"] is not None and out["bound"] is not None and out["dp"] > 0:
        out["gap"] = max(0.0, (out["dp"] - out["bound"]) / out["dp"])
    return out


def _full_models(results: Sequence[Result]) -> list[str]:
    """The names of the problem's methods that solve its full model."""
    from optmem.solvers.facade import methods

    if not results:
        return []
    return [m.name for m in methods(results[0].problem).values() if m.full_model]


def _label(r: Result) -> str:
    return r.method + (f":{r.variant}" if r.variant and r.variant != "paper" else "")


def format_summary(results: Sequence[Result], limited: Sequence[str] = ()) -> str:
    """One line: DP value, proven optimum (or best exact bound) and the DP's gap to it.

    ``limited``: the exact methods a time limit would add to the run
    (:func:`~optmem.solvers.facade.limited_compare_methods`); the hint offers the limit
    only when there are some.
    """
    s = dp_summary(results)
    dp = "no DP plan" if s["dp"] is None else f"DP ({s['dp_method']}) {_fmt(s['dp'])}"
    if s["infeasible"] is not None:
        return f"{dp}; no plan fits the limit (proven infeasible by {s['infeasible']})"
    if s["bound"] is None:
        offer = f", or give --time-limit (adds {', '.join(limited)})" if limited else ""
        return f"{dp}; no exact model ran ({', '.join(_full_models(results))}: " \
               f"name them with --methods{offer})"
    exact = (f"proven optimum {_fmt(s['optimum'])}" if s["optimum"] is not None
             else f"best proven bound {_fmt(s['bound'])}") + f" ({s['bound_method']})"
    gap = "" if s["gap"] is None else f"; DP gap to it {_fmt(s['gap'] * 100, 3)}%"
    return f"{dp}; {exact}{gap}"


# ------------------------------------------------------------------ commands
@contextlib.contextmanager
def engine_logs_to_stderr(active: bool) -> Iterator[None]:
    """While ``active``, send standard output (file descriptor 1) to standard error.

    For engine logs (``--verbose``) under ``--json``: HiGHS and CP-SAT write them from C++
    to descriptor 1, past ``sys.stdout``, so with ``--json --verbose`` they came before the
    JSON object, which then did not parse.
    """
    if not active:
        yield
        return
    _flush_c_stdio()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    """Flush the C library's output buffers (``fflush(NULL)``) where the library is found."""
    with contextlib.suppress(OSError, AttributeError, TypeError):  # no C library: nothing
        ctypes.CDLL(None).fflush(None)


def cmd_solve(args: argparse.Namespace) -> int:
    """``optmem solve``."""
    from optmem.solvers.facade import solve

    chain = load_chain(args.chain)
    problem = build_problem(args.problem, chain, memory_from_args(args.problem, args, chain), args)
    with engine_logs_to_stderr(args.json and args.verbose):
        result = solve(problem, args.method, options=options_from_args(args))
    if args.output:
        _write_json(args.output, result.to_json())
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_result(result, chain))
    return EXIT_FAILURE if result.status is Status.ERROR else EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    """``optmem compare``."""
    from optmem.solvers.facade import compare, limited_compare_methods, method_names_of

    chain = load_chain(args.chain)
    problem = build_problem(args.problem, chain, memory_from_args(args.problem, args, chain), args)
    names = method_names_of(args.methods)  # as Python reads it: '' is no method, not all

    def progress(name: str) -> None:
        if not args.json and sys.stderr.isatty():
            print(f"  running {name} ...", file=sys.stderr)

    options = options_from_args(args)
    with engine_logs_to_stderr(args.json and args.verbose):
        results = compare(problem, names, options=options, progress=progress)
    if args.json:
        print(json.dumps({"problem": args.problem, "chain": chain.name,
                          "results": [r.to_json() for r in results],
                          "summary": dp_summary(results)}))
    else:
        limit = "none" if args.memory is None else args.memory
        print(f"{chain.name}: {args.problem}, memory limit {limit}")
        print(format_table(results, chain))
        print(format_summary(results, limited_compare_methods(problem, options)
                             if names is None else ()))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """``optmem verify``: replay a plan file in the independent simulator.

    A setting the result records (``memory_model``, ``temporaries`` ..., CONTRACT section
    6) that the command line does not give is taken from the plan file (``from_plan``).
    """
    from optmem.simulate.verify import (
        check_result_fields,
        plan_input,
        replay_plan,
        settings_as_solved,
    )

    chain = load_chain(args.chain)
    explicit = recorded_flags_given(args)
    plan_file = functools.cache(functools.partial(_read_json, args.plan))  # read once
    needed = _model_of_temporaries(args, explicit, plan_file)
    problem = build_problem(args.problem, chain, memory_from_args(args.problem, args, chain), args)
    options = options_from_args(args)
    plan_data = plan_file()
    taken: dict[str, Any] = {}
    try:  # the recorded settings are checked once, here (verify_plan would redo it)
        plan_data = plan_input(plan_data, text=False)  # the file's JSON string is no JSON text
        check_result_fields(problem, plan_data)
        problem, taken = settings_as_solved(problem, plan_data, explicit=explicit)
        taken = {**needed, **taken}
        report = replay_plan(problem, plan_data, options)
    except OptmemInputError as exc:  # whatever is wrong with the plan, name the plan file
        if taken:  # a refusal under settings the command line did not give says so
            exc.reason += f" (replayed as solved: {_settings_text(taken)})"
        raise exc.with_source(exc.source or args.plan) from None
    solved_unit = plan_data.get("unit") if isinstance(plan_data, dict) else None
    if isinstance(solved_unit, int) and not isinstance(solved_unit, bool) and \
            solved_unit != report.get("unit", solved_unit):
        print(f"optmem: warning: {args.plan} was solved with unit {solved_unit} "
              f"{chain.memory_unit}; this replay rounds sizes to unit {report['unit']} "
              f"(--memory {args.memory}, --slots {args.slots}): pass the limit and slots it "
              "was solved with to replay it as solved", file=sys.stderr)
    else:
        _warn_if_not_as_recorded(args.plan, plan_data, report)
    report = {"valid": True, **report, **({"from_plan": taken} if taken else {})}
    if args.json:
        print(json.dumps(report))
    else:
        print("valid plan: " + ", ".join(f"{k} {v}" for k, v in report.items()
                                         if k not in ("valid", "from_plan")))
        if taken:
            print(f"replayed as solved: {_settings_text(taken)} (recorded in {args.plan}; "
                  "not given on the command line)")
    return EXIT_OK


def _warn_if_not_as_recorded(path: str, plan_data: Any, report: dict[str, Any]) -> None:
    """One stderr warning when the replay's objective or peak is not the one PLAN records.

    A result replayed under the settings it was solved with (and the same unit) gives its
    own ``objective`` and ``peak_memory`` back; another value means this replay's settings
    differ from the solve's in a way the file does not record (a pipeline result written
    before stop 55 records neither ``weight_copies`` nor its link; a chain changed since):
    the plan is still checked, against this replay's settings.
    """
    if not isinstance(plan_data, dict):
        return
    differ = []
    for key in ("objective", "peak_memory"):
        recorded, replayed = plan_data.get(key), report.get(key)
        if isinstance(recorded, int | float) and not isinstance(recorded, bool) and \
                isinstance(replayed, int | float) and \
                not math.isclose(recorded, replayed, rel_tol=1e-9, abs_tol=1e-9):
            differ.append(f"{key} {replayed} where it records {recorded}")
    if differ:
        print(f"optmem: warning: this replay of {path} gives {' and '.join(differ)}: it was "
              "solved under other settings than this replay's (pass the flags it was solved "
              "with to replay it as solved)", file=sys.stderr)


def _model_of_temporaries(args: argparse.Namespace, explicit: set[str],
                          plan_file: Callable[[], Any]) -> dict[str, Any]:
    """``--temporaries`` without ``--memory-model`` on a strict result: its model, taken.

    ``--temporaries`` needs ``--memory-model strict``; left out, the memory model is the
    one the result records (CONTRACT section 6), so it is set in ``args`` before the
    problem is built (else the default ``stash`` refuses the flag) and returned to be
    listed in ``from_plan``. Empty otherwise (a bare plan records no model: the refusal).
    Until the stop 55 review the flag was refused there, naming no file.
    """
    from types import SimpleNamespace

    from optmem.simulate.verify import recorded_settings

    if not getattr(args, "temporaries", False) or "memory_model" in explicit:
        return {}
    recorded = recorded_settings(SimpleNamespace(name=args.problem), plan_file())
    if recorded.get("memory_model") != "strict":
        return {}
    args.memory_model = "strict"
    return {"memory_model": "strict"}


def _settings_text(settings: dict[str, Any]) -> str:
    """``memory_model "strict", temporaries true``: settings as the plan file writes them."""
    return ", ".join(f"{k} {json.dumps(v)}" for k, v in settings.items())


def _recorded_dests() -> dict[str, tuple[str, ...]]:
    """The recorded settings of every problem and the ``argparse`` destinations giving them."""
    from optmem.simulate.verify import RECORDED_SETTINGS

    return {name: tuple(flag[2:].replace("-", "_") for flag in flags)
            for settings in RECORDED_SETTINGS.values() for name, flags in settings.items()}


def recorded_flags_given(args: argparse.Namespace) -> set[str]:
    """The recorded settings the ``verify`` command line gives; fills in the others' defaults.

    ``verify`` parses the flags of the recorded settings with the default ``None``, so that
    a flag left out tells from one given at its default value (``--memory-model stash``).
    """
    defaults = option_defaults()
    given = set()
    for name, dests in _recorded_dests().items():
        if any(getattr(args, dest, None) is not None for dest in dests):
            given.add(name)
        for dest in dests:
            if getattr(args, dest, None) is None:
                setattr(args, dest, defaults.get(dest))
    return given


def cmd_export(args: argparse.Namespace) -> int:
    """``optmem export``: the exact model (MPS, LP; CP-SAT: .pb/.pbtxt) or a schedule CSV."""
    from optmem.solvers.facade import export

    suffix = Path(args.output).suffix.lower()
    if suffix == ".csv" and args.problem == "pipeline":
        return export_schedule_csv(args)
    if suffix not in MODEL_SUFFIXES:
        raise OptmemInputError(f"expected an output file ending in "
                               f"{', '.join(MODEL_SUFFIXES)} (or .csv for a pipeline "
                               f"schedule), got {args.output!r}", field="-o")
    chain = load_chain(args.chain)
    problem = build_problem(args.problem, chain, memory_from_args(args.problem, args, chain), args)
    export(problem, args.method or "ilp", args.output, options=options_from_args(args))
    print(f"wrote {args.output}")
    return EXIT_OK


def export_schedule_csv(args: argparse.Namespace) -> int:
    """Solve the pipeline problem and write the plan as PyTorch's schedule CSV (CONTRACT 11)."""
    from optmem.pipeline_plan import PipelinePlan
    from optmem.pipeline_schedule import default_microbatches, pipeline_ranks, write_schedule_csv
    from optmem.solvers.facade import solve

    chain = load_chain(args.chain)
    problem = build_problem(args.problem, chain, memory_from_args(args.problem, args, chain), args)
    result = solve(problem, args.method or "auto", options=options_from_args(args))
    if not result.status.has_plan:
        hint = "" if result.min_feasible_memory is None else \
            f"; the smallest feasible memory is about {result.min_feasible_memory}"
        raise OptmemInputError(f"no plan to export: {result.method} gives status "
                               f"{result.status}{hint}", field="memory")
    plan = PipelinePlan.from_strings(result.plan)
    microbatches = default_microbatches(plan) if args.microbatches is None \
        else args.microbatches
    write_schedule_csv(plan, microbatches, args.output)
    ranks = pipeline_ranks(plan)
    print(f"wrote {args.output}: {result.method} plan, period {_fmt(result.objective)} "
          f"{chain.time_unit}, {len(plan.stages)} stages on ranks 0..{len(ranks) - 1} "
          f"(GPUs {','.join(map(str, ranks))}), {microbatches} micro-batches")
    return EXIT_OK


def cmd_datasets(args: argparse.Namespace) -> int:
    """``optmem datasets [list | show NAME | path NAME]``; NAME may be a chain file, as CHAIN."""
    from optmem.datasets import dataset_path, list_datasets

    if args.action == "list":
        rows = [_dataset_row(info.name) for info in list_datasets()]
        if args.json:
            print(json.dumps(rows))
            return EXIT_OK
        header = ("name", "stages", "parameters", "store-all", "min feasible", "description")
        table = [(r["name"], str(r["stages"]), r["parameters_h"], r["store_all_h"],
                  r["min_feasible_h"], textwrap.shorten(r["description"], 60, placeholder="...")
                  ) for r in rows]
        widths = [max(len(x) for x in col) for col in zip(header, *table, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        print("\n".join(fmt.format(*row).rstrip() for row in [header, *table]))
        return EXIT_OK
    if not args.name:
        raise OptmemInputError(f"'datasets {args.action}' needs a dataset NAME")
    if args.action == "path":
        path = str(Path(args.name).resolve() if _chain_file(args.name)
                   else dataset_path(args.name))
        print(json.dumps(path) if args.json else path)
    else:
        row = _dataset_row(args.name)
        print(json.dumps(row, indent=1) if args.json  # "held" as text only (held_h)
              else "\n".join(f"{k}: {v}" for k, v in row.items() if k != "held"))
    return EXIT_OK


def _chain_file(name: str) -> bool:
    """Whether ``datasets show|path NAME`` names a chain file (loaded: errors name it)."""
    from optmem.datasets import is_chain_path

    if not is_chain_path(name):
        return False
    Chain.load(name)
    return True


def _dataset_row(name: str) -> dict[str, Any]:
    from optmem.solvers.dataset_summary import chain_file_summary, dataset_summary

    row = dict(chain_file_summary(name) if _chain_file(name) else dataset_summary(name))
    for key in ("store_all", "min_feasible"):
        row[f"{key}_h"] = size_text(row[key], row.get("memory_unit", "B"))
    params = row.get("parameters")  # an int (or None) in the JSON, as in the file's summary
    row["parameters_h"] = f"{params / 1e6:.1f}M" if isinstance(params, int | float) else "-"
    if row.get("held"):  # stop 83: only a chain with held terms has these two keys
        row["held_h"] = held_text(row["held"], row.get("memory_unit", "B"))
    return row


def held_text(held: dict[str, Any], unit: str, *, most: int = 4) -> str:
    """The held terms of :func:`~optmem.solvers.dataset_summary.held_summary` as one line.

    ``fwd_held 2 B (stage 1), 6 B (stage 3); loss.held 1 B``; past ``most`` stages a
    field gives its count and range (``bwd_held 40 stages, 1.00 MiB .. 3.00 MiB``).
    """
    parts = []
    for name in ("fwd_held", "bwd_held"):
        terms = held.get(name, [])
        sizes = [size for _, size in terms]
        if len(terms) > most:
            parts.append(f"{name} {len(terms)} stages, {size_text(min(sizes), unit)} .. "
                         f"{size_text(max(sizes), unit)}")
        elif terms:
            parts.append(f"{name} " + ", ".join(f"{size_text(size, unit)} (stage {i})"
                                                for i, size in terms))
    if held.get("loss.held"):
        parts.append(f"loss.held {size_text(held['loss.held'], unit)}")
    return "; ".join(parts)


def cmd_demo(args: argparse.Namespace) -> int:
    """Solve a bundled network at three memory limits, then prove one DP answer exactly."""
    from optmem.problems import CheckpointProblem
    from optmem.solvers.checkpoint_dp import min_memory_persistent
    from optmem.solvers.facade import available_methods, compare

    try:  # checked before any output; 0 was read as the default 20 s until stop 52
        options = SolveOptions(time_limit_s=20.0 if args.time_limit is None
                               else args.time_limit)
    except OptmemInputError as exc:
        raise OptmemInputError(exc.reason, field="--time-limit") from None
    chain = load_chain(args.chain)
    low, high = min_memory_persistent(chain), chain.store_all_peak()
    print(f"optmem demo: {chain.name}, {chain.length} stages; store-all peak "
          f"{size_text(high, chain)}, smallest feasible memory {size_text(low, chain)}\n")
    for frac in (0.25, 0.5, 0.75):
        limit = int(low + frac * (high - low))
        print(f"== memory limit {size_text(limit, chain)} ({limit} {chain.memory_unit})")
        results = compare(CheckpointProblem(chain, limit), options=options)
        print(format_table(results, chain) + "\n")
    small = load_chain(args.exact_chain)
    if "ilp" in available_methods("checkpoint"):
        limit = int(min_memory_persistent(small) * 1.25)
        print(f"== exact check: {small.name} ({small.length} stages) at "
              f"{size_text(limit, small)}: the DPs against the proven optimum of the full model")
        results = compare(CheckpointProblem(small, limit),
                          ["dp", "dp:floating", "ilp", "ilp:persistent", "sequential"],
                          options=options)
        print(format_table(results, small))
    return EXIT_OK


# ------------------------------------------------------------------ parser
def _add_common(p: argparse.ArgumentParser, *, memory: bool = True) -> None:
    p.add_argument("problem", help="checkpoint, offload, remat-offload, pipeline, min-peak")
    p.add_argument("chain", help="chain file (optmem.chain/1 JSON) or bundled dataset name")
    if memory:
        p.add_argument("--memory", "-m",
                       help="memory limit: bytes or a size like 4GiB, 512MB, 1.5GiB, or 60%% "
                            "of the chain's store-all peak (checkpoint, offload, "
                            "remat-offload); required except for min-peak, where it is an "
                            "optional upper bound")
    p.add_argument("--variant", help="method variant (e.g. paper, rotor, floating, persistent)")
    p.add_argument("--slots", type=int, default=500, help="memory slots (default 500)")
    add_engine_limits(p)
    p.add_argument("--solver", default="highs", help="ILP engine: highs (default), cbc, gurobi")
    p.add_argument("--threads", type=worker_count, default=2,
                   help="threads for exact engines (1..256)")
    p.add_argument("--verbose", action="store_true", help="show engine logs")
    add_option_flag(p)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def add_option_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--option KEY=VALUE`` (repeatable): ``SolveOptions.extra``.

    Read by :func:`parse_extra_options`; ``solve``, ``compare``, ``export`` and ``sweep``.
    """
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="a method option (SolveOptions.extra), repeatable; VALUE is JSON "
                        "or a string, e.g. --option strategy=benders")


def add_engine_limits(p: argparse.ArgumentParser) -> None:
    """Add the engine limits and the seed.

    ``--time-limit``, ``--node-limit``, ``--deterministic-time``, ``--work-budget``,
    ``--seed``.
    """
    p.add_argument("--time-limit", type=float,
                   help="wall-clock seconds per solve: the exact methods keep their model "
                        "builds and engine calls within it, and answer with the best plan "
                        "and bound found (compare: per method; default: none)")
    p.add_argument("--node-limit", type=number_text,
                   help="deterministic limit: branch-and-bound nodes per ILP engine call")
    p.add_argument("--deterministic-time", type=float,
                   help="deterministic limit: CP-SAT deterministic seconds per call "
                        "(one worker)")
    p.add_argument("--work-budget", type=float, metavar="S",
                   help="deterministic limit of the whole solve: deterministic seconds "
                        "summed over all its CP-SAT, HiGHS and CBC calls (one worker/thread; "
                        "50 HiGHS limit checks or CBC nodes a second; Gurobi calls are not "
                        "bounded; inf: measure only)")
    p.add_argument("--seed", type=int, default=0, help="random seed of every engine (0)")


def build_parser() -> argparse.ArgumentParser:
    """The full ``optmem`` parser."""
    parser = _Parser(prog="optmem", description="Proven-optimal memory-saving plans for "
                     "training deep networks: checkpointing, offloading, pipelining.")
    from optmem import __version__

    parser.add_argument("--version", action="version", version=f"optmem {__version__}",
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("solve", help="solve one instance")
    _add_common(p)
    p.add_argument("--method", default="auto", help="dp (default), ilp, cpsat, brute, chen, ...")
    p.add_argument("--output", "-o", help="also write the JSON result to this file")
    add_problem_options(p)
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("compare", help="run several methods side by side")
    _add_common(p)
    p.add_argument("--methods", help="comma-separated methods, e.g. dp,dp:rotor,ilp,cpsat")
    add_problem_options(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("verify", help="replay a plan file in the independent simulator")
    p.add_argument("problem")
    p.add_argument("chain")
    p.add_argument("plan", help="JSON list of ops, or the --json output of solve")
    p.add_argument("--memory", "-m", help="memory limit (optional for min-peak)")
    p.add_argument("--slots", type=int, default=500)
    p.add_argument("--json", action="store_true")
    add_problem_options(p)
    p.set_defaults(func=cmd_verify, variant=None, time_limit=None, solver="highs", threads=2,
                   verbose=False, **dict.fromkeys(
                       dest for dests in _recorded_dests().values() for dest in dests))

    p = sub.add_parser("export", help="write the exact model (MPS, LP; CP-SAT: .pb/.pbtxt) "
                       "or a pipeline schedule (CSV)")
    _add_common(p)
    p.add_argument("--method", default=None,
                   help="exact model to write (default ilp), or for a .csv the pipeline "
                        "method to solve with (default: the problem's default)")
    p.add_argument("--output", "-o", required=True,
                   help="model.mps or model.lp; --method cpsat also model.pb or model.pbtxt; "
                        "schedule.csv (pipeline: the plan's per-rank actions for "
                        "torch.distributed.pipelining)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step in the CSV (default: twice the stages)")
    add_problem_options(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("datasets", help="bundled chains")
    p.add_argument("action", nargs="?", default="list", choices=("list", "show", "path"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("demo", help="solve a bundled chain at three limits")
    p.add_argument("--chain", default="resnet101-b8-1000")
    p.add_argument("--exact-chain", default="gpt2-small-b8-1024")
    p.add_argument("--time-limit", type=float, default=None)
    p.set_defaults(func=cmd_demo)

    for module in EXTRA_COMMANDS:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module).register_cli(sub)
    return parser


def _read_json(path: str) -> Any:
    return read_json(path, error=PlanError, what="plan file")


def _write_json(path: str, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n", field="--output")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except OptmemInputError as exc:
        print(f"optmem: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("optmem: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
