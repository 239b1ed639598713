"""Replay a plan file's plan for one problem and report what the simulator measured.

``optmem verify`` (and tests) call :func:`verify_plan`, which picks the verifier of the
problem's class. Each verifier accepts the shapes a plan file may take (a list of op
strings, or a ``solve --json`` object), replays the plan in this package's simulators and
returns the verified ``objective``, ``peak_memory`` and ``memory_limit`` with per-problem
details. Checkpoint, offload and remat + offload plans are replayed on the problem's
discretised instance (CONTRACT section 2), as solved.

Every solver builds its :class:`~optmem.result.Result` through :func:`replay_result`: the
one place where a method's claimed objective is compared with the simulator's
(:data:`CLAIM_TOLERANCE`) and the simulated peak with the limit. This module imports only
the core and the simulators.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optmem.errors import OptmemInputError, PlanError
from optmem.pipeline_plan import PipelinePlan
from optmem.plan import (
    MixedPlan,
    Op,
    parse_mixed_plan,
    parse_plan,
    plan_file_int,
    store_all_plan,
)
from optmem.problems.checkpoint import DEFAULT_SLOTS, CheckpointProblem
from optmem.problems.min_peak import (
    MinPeakProblem,
    checkpoint_plan,
    checkpoints_of_plan,
    normalize_checkpoints,
)
from optmem.problems.offload import OffloadProblem
from optmem.problems.pipeline import PipelineProblem
from optmem.result import Result, SolveOptions, Status
from optmem.simulate.checkpoint import simulate_checkpoint
from optmem.simulate.min_peak import model_peak
from optmem.simulate.offload import simulate_offload
from optmem.simulate.pipeline import simulate_pipeline

__all__ = ["CLAIM_TOLERANCE", "RECORDED_SETTINGS", "Replay", "Wording",
           "check_result_fields", "check_store_all_sequence", "claim_holds", "plan_input",
           "recorded_settings", "replay_result", "settings_as_solved",
           "verify_checkpoint_plan", "verify_min_peak_plan", "verify_offload_plan",
           "verify_pipeline_plan", "verify_plan"]

CLAIM_TOLERANCE = 1e-6
"""Relative tolerance between a method's claimed objective and the simulated one.

The pipeline simulator's time tolerance (:func:`optmem.simulate.pipeline.simulate_pipeline`):
CP-SAT periods live on a grid of at most 1e-7 of the load bound; every other method claims
a value computed in floats from the same durations. The absolute tolerance is 1e-9.
"""


def claim_holds(claimed: float, simulated: float) -> bool:
    """Whether a claimed objective equals the simulated one (:data:`CLAIM_TOLERANCE`)."""
    return math.isclose(claimed, simulated, rel_tol=CLAIM_TOLERANCE, abs_tol=1e-9)


@dataclass(frozen=True)
class Replay:
    """What the simulator measured for one plan.

    Parameters
    ----------
    objective
        The simulated objective (makespan, period or peak).
    peak_memory
        The simulated peak, in the units of the limit it is checked against.
    report
        Measured details added to the result's ``report`` (CONTRACT section 4).
    """

    objective: float
    peak_memory: int
    report: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Wording:
    """The ``report['error']`` messages of one problem's results (format strings).

    ``claim`` gets ``claimed`` and ``simulated``; ``peak`` gets ``peak`` and ``limit``;
    ``invalid`` prefixes the simulator's :class:`~optmem.errors.PlanError` (``None``: the
    error propagates, for methods whose plans are valid by construction).
    """

    claim: str = "claimed objective {claimed} but the simulator says {simulated}"
    peak: str = "plan peaks at {peak}, above {limit}"
    invalid: str | None = None


def replay_result(
    problem: str,
    method: str,
    status: Status,
    plan: tuple[str, ...],
    replay: Callable[[], Replay],
    *,
    bound: float,
    memory_limit: int | None,
    claimed: float | None = None,
    unit: int = 1,
    variant: str | None = None,
    solver: str | None = None,
    report: dict[str, Any] | None = None,
    wording: Wording = Wording(),
    check_peak: bool = True,
    optimal_bound: bool = True,
) -> Result:
    """Replay a method's plan and build its :class:`Result` from the simulation.

    The result's ``objective`` and ``peak_memory`` are the simulator's, never the method's.
    It becomes ``status: error`` (with ``report['error']``) when the plan does not replay
    (``wording.invalid``), when ``claimed`` differs from the simulated objective by more
    than :data:`CLAIM_TOLERANCE`, or, with ``check_peak``, when the simulated peak exceeds
    ``memory_limit``. Otherwise an ``optimal`` result gets the simulated objective as its
    ``bound`` (with ``optimal_bound``; else ``bound`` is kept as given).

    Parameters
    ----------
    problem, method, status, variant, solver, unit, memory_limit
        The fields of the result (``status`` as the method claims it).
    plan
        The plan as op strings (kept on an error result).
    replay
        Runs the simulator on the plan; may raise :class:`~optmem.errors.PlanError`.
    bound, claimed
        The method's proven lower bound and its own objective (``None``: nothing claimed).
    report
        The method's details; the replay's are added to a copy.
    wording
        The problem's error messages.
    """
    info = dict(report or {})
    try:
        sim = replay()
    except PlanError as exc:
        if wording.invalid is None:
            raise
        info["error"] = f"{wording.invalid}{exc}"
        return Result(problem, method, Status.ERROR, plan=plan, memory_limit=memory_limit,
                      unit=unit, variant=variant, solver=solver, report=info)
    info.update(sim.report)
    out = Result(problem, method, status, objective=sim.objective, bound=bound, plan=plan,
                 peak_memory=sim.peak_memory, memory_limit=memory_limit, unit=unit,
                 variant=variant, solver=solver, report=info)
    if claimed is not None and not claim_holds(claimed, sim.objective):
        info["error"] = wording.claim.format(claimed=claimed, simulated=sim.objective)
        return out.with_(status=Status.ERROR)
    if check_peak and memory_limit is not None and sim.peak_memory > memory_limit:
        info["error"] = wording.peak.format(peak=sim.peak_memory, limit=memory_limit)
        return out.with_(status=Status.ERROR)
    if status is Status.OPTIMAL and optimal_bound:
        out = out.with_(bound=sim.objective)
    return out


def verify_checkpoint_plan(problem: CheckpointProblem, plan_data: Any,
                           options: Any = None) -> dict[str, Any]:
    """Replay a checkpoint plan (ops or ``solve --json`` output) under the problem's limit.

    The plan runs on the instance discretised with ``options.slots`` (default 500), as
    solved; returns ``objective``, ``peak_memory``, ``memory_limit`` and ``unit`` (in
    discretised units) and ``ops``.

    Raises
    ------
    PlanError
        With the index of the first invalid op and the reason (the limit included).
    """
    ops = plan_data.get("plan") if isinstance(plan_data, dict) else plan_data
    if not isinstance(ops, list):
        raise PlanError("expected a JSON list of ops or an object with a 'plan' list")
    disc = problem.discretize(getattr(options, "slots", DEFAULT_SLOTS))
    sim = simulate_checkpoint(disc.chain, parse_plan(ops), disc.memory_limit)
    return {"objective": sim.makespan, "peak_memory": sim.peak_memory,
            "memory_limit": disc.memory_limit, "unit": disc.unit, "ops": len(ops)}


def verify_min_peak_plan(problem: MinPeakProblem, plan_data: Any,
                         options: SolveOptions | None = None) -> dict[str, Any]:
    """Check a min-peak plan and return its peak under the problem's model.

    ``plan_data`` is a list of op strings (the ``plan`` of ``optmem solve min-peak``), a
    list of checkpoint indices, or an object with a ``plan`` or ``checkpoints`` list.

    Raises
    ------
    PlanError
        If the plan is not a checkpoint plan, or its peak exceeds the memory limit.
    """
    del options
    data = plan_data
    if isinstance(data, dict):
        data = data.get("checkpoints", data.get("plan"))
    if not isinstance(data, list | tuple):
        raise PlanError("expected a list of ops, a list of checkpoints, or an object with "
                        "'plan' or 'checkpoints'")
    if not data:  # read as the set {0, n} until stop 51: an infeasible result verified
        status = plan_data.get("status") if isinstance(plan_data, dict) else None
        raise PlanError("the plan is empty" + (f" (the result's status is {status})"
                                                if status else "")
                        + f"; give the checkpoints (e.g. [0, {problem.n}]) or the ops")
    n = problem.n
    texts = [isinstance(x, str) for x in data]
    if all(texts):
        checkpoints = checkpoints_of_plan(data, n)
    elif any(texts):  # one kind or the other: name the first item of the other kind
        k = texts.index(not texts[0])
        raise PlanError(f"item {k}: expected {'an op string' if texts[0] else 'a checkpoint'} "
                        f"as item 0 is, got {data[k]!r} (a list of ops or a list of "
                        f"checkpoints, not both)")
    else:  # checkpoints: name the first bad one by its place (op 0 was named until the audit)
        for k, c in enumerate(data):
            try:
                normalize_checkpoints([c], n)
            except OptmemInputError as exc:
                raise OptmemInputError(f"item {k}: {exc.reason}", field=exc.field) from None
        checkpoints = normalize_checkpoints(data, n)
    peak = model_peak(problem, checkpoints)
    sim = simulate_checkpoint(problem.chain, checkpoint_plan(checkpoints))
    if problem.memory_limit is not None and peak > problem.memory_limit:
        raise PlanError(f"peak {peak} under the {problem.model} model exceeds the limit "
                        f"{problem.memory_limit}")
    return {
        "objective": peak, "peak_memory": peak, "memory_limit": problem.memory_limit,
        "unit": 1, "model": problem.model, "count_input": problem.count_input,
        "checkpoints": list(checkpoints),
        "checkpoint_plan_makespan": sim.makespan, "checkpoint_plan_peak": sim.peak_memory,
    }


def verify_offload_plan(problem: OffloadProblem, plan_data: Any,
                        options: Any = None) -> dict[str, Any]:
    """Replay an offload (or combined remat + offload) plan (ops or ``solve --json`` output).

    Raises
    ------
    PlanError
        With the index of the first invalid op and the reason.
    """
    ops = plan_data.get("plan") if isinstance(plan_data, dict) else plan_data
    if not isinstance(ops, list):
        raise PlanError("expected a JSON list of ops or an object with a 'plan' list")
    slots = getattr(options, "slots", DEFAULT_SLOTS)
    disc = problem.discretize(slots)
    plan = parse_mixed_plan(ops)
    if problem.name == "offload":  # remat-offload plans may also recompute
        check_store_all_sequence(plan, problem.chain.length)
    sim = simulate_offload(disc.chain, plan, problem.unit_bandwidth(disc.unit),
                           disc.memory_limit)
    if sim.peak_memory > disc.memory_limit:
        raise PlanError(f"the plan peaks at {sim.peak_memory}, above {disc.memory_limit}")
    return {"objective": sim.makespan, "peak_memory": sim.peak_memory,
            "memory_limit": disc.memory_limit, "unit": disc.unit, "ops": len(ops),
            "idle_time": sim.idle_time, "offloaded": sim.offloaded_size}


def check_store_all_sequence(plan: MixedPlan, length: int) -> None:
    """Refuse an offload plan whose compute ops are not the store-all sequence.

    The offload problem (CONTRACT section 10) allows one compute sequence, ``F_all 1 ..
    F_all L``, ``Loss``, ``B L .. B 1``, with transfer ops between its ops; a plan that
    recomputes (``F_ck``, ``F_none``) or runs the ops in another order belongs to the
    remat-offload problem. A plan that stops early is left to the simulator (incomplete).

    Raises
    ------
    PlanError
        Naming the first compute op that differs from the store-all sequence and the op
        expected there.
    """
    expected = store_all_plan(length)
    k = 0
    for index, op in enumerate(plan):
        if not isinstance(op, Op):
            continue
        want = expected[k] if k < len(expected) else None
        if op != want:
            here = f"which has {want} here" if want else "which has ended here"
            raise PlanError(f"{op} is not in the offload problem's compute sequence, {here} "
                            f"(store-all: F_all 1 .. F_all {length}, Loss, B {length} .. "
                            f"B 1, transfers between them); a plan that recomputes is a "
                            f"remat-offload plan (verify remat-offload)", index=index)
        k += 1


def verify_pipeline_plan(problem: PipelineProblem, plan_data: Any,
                         options: Any = None) -> dict[str, Any]:
    """Replay a pipeline plan (a result JSON, a plan JSON or a list of op strings).

    Returns ``objective`` (the period), ``peak_memory`` (largest GPU peak), ``memory_limit``,
    ``unit`` (1: pipelines are not discretised), ``peaks`` (per GPU) and ``nca`` (per stage),
    and the settings that differ from their defaults
    (:meth:`~optmem.problems.pipeline.PipelineProblem.settings_report`: ``memory_model``,
    ``temporaries`` ...).
    Raises :class:`optmem.errors.PlanError`.
    """
    del options
    plan = PipelinePlan.from_any(plan_data)
    sim = simulate_pipeline(problem, plan)
    if sim.peak_memory > problem.memory_per_gpu:
        worst = max(range(len(sim.peaks)), key=lambda g: sim.peaks[g])
        raise PlanError(f"GPU {worst} peaks at {sim.peaks[worst]}, above the memory per GPU "
                        f"{problem.memory_per_gpu}")
    return {"objective": sim.period, "peak_memory": sim.peak_memory,
            "memory_limit": problem.memory_per_gpu, "unit": 1, "peaks": list(sim.peaks),
            "nca": list(sim.nca), **problem.settings_report()}


def verify_plan(problem: Any, plan_data: Any, options: Any = None, *,
                as_solved: bool = False) -> dict[str, Any]:
    """Replay ``plan_data`` for ``problem`` with the verifier of its class.

    Remat + offload problems are offload problems (their plans may also recompute).

    A result (``solve --json``, ``Result.to_json()``) of a pipeline or min-peak problem
    records the settings it was solved under in its ``report``
    (:data:`RECORDED_SETTINGS`). By default they must equal ``problem``'s: a plan solved
    under a stronger memory check is never replayed under a weaker one in silence. With
    ``as_solved`` the recorded settings replace ``problem``'s, and the returned object
    names them in ``from_plan`` (CONTRACT section 6). A bare plan (a list of ops, a
    pipeline plan object) records nothing and replays under ``problem``'s settings.

    Raises
    ------
    PlanError
        If the plan is invalid or exceeds the memory limit.
    OptmemInputError
        If ``problem`` is no problem object of optmem, or (field ``report.NAME``) the plan
        records a setting ``NAME`` that differs from ``problem``'s (without ``as_solved``)
        or that the problem refuses; (field ``as_solved``) ``as_solved`` is no bool.
    """
    if not isinstance(as_solved, bool):  # "no" would replay as solved
        raise OptmemInputError(f"expected True or False, got {as_solved!r}", field="as_solved")
    plan_data = plan_input(plan_data)
    check_result_fields(problem, plan_data)
    solved, taken = settings_as_solved(problem, plan_data, explicit=None if not as_solved
                                       else ())
    out = replay_plan(solved, plan_data, options)
    return {**out, "from_plan": taken} if taken else out


def replay_plan(problem: Any, plan_data: Any, options: Any = None) -> dict[str, Any]:
    """Replay ``plan_data`` under ``problem``'s own settings (no recorded-settings pass).

    The verifier dispatch of :func:`verify_plan`, for a caller that has already put
    ``problem`` under the plan's settings with :func:`settings_as_solved` (the CLI's
    ``verify``); ``plan_data`` is in the form :func:`plan_input` returns.

    Raises
    ------
    PlanError
        If the plan is invalid or exceeds the memory limit.
    OptmemInputError
        If ``problem`` is no problem object of optmem.
    """
    for cls, verifier in _VERIFIERS:
        if isinstance(problem, cls):
            return verifier(problem, plan_data, options)
    raise OptmemInputError(f"no plan verifier for {type(problem).__name__}", field="problem")


def check_result_fields(problem: Any, plan_data: Any) -> None:
    """Check the fields a result object carries besides its plan, as ``optmem show`` does.

    ``unit`` (an integer >= 1) and ``memory_limit`` (an integer >= 0, or ``null``) are
    checked by :func:`optmem.plan.plan_file_int`, the check of ``show``; ``problem``, when
    present, must name a problem whose plans are ``problem``'s kind of plan: a pipeline
    result is not replayed as a list of ops, nor a checkpoint, offload, remat-offload or
    min-peak result as a pipeline plan (those four share their ops: a checkpoint or offload
    result replays in remat-offload, as before the API audit). Anything but a JSON object
    (a list of ops) has no such fields.

    Raises
    ------
    PlanError
        Naming the field (``unit``, ``memory_limit``, ``problem``).
    """
    if not isinstance(plan_data, dict):
        return
    plan_file_int(plan_data, "unit", default=1, least=1)
    plan_file_int(plan_data, "memory_limit", default=None, least=0)
    recorded = plan_data.get("problem")
    name = getattr(problem, "name", None)
    if recorded is None or name is None or recorded == name:
        return
    if isinstance(recorded, str) and recorded in _OP_PROBLEMS and name in _OP_PROBLEMS:
        return  # the same ops: a checkpoint or offload result is a remat-offload plan, ...
    shown = recorded if isinstance(recorded, str) else repr(recorded)
    raise PlanError(f"the file is a result of the {shown} problem, whose plans are not "
                    f"{name} plans", field="problem")


# the problems whose plans are lists of the same ops (CONTRACT sections 3, 10, 13): a result
# of one replays as a plan of another (a checkpoint result in remat-offload, a min-peak one
# in checkpoint; the verifier refuses the ops the problem has not); pipeline plans are not
_OP_PROBLEMS = frozenset({"checkpoint", "min-peak", "offload", "remat-offload"})


def plan_input(plan_data: Any, *, text: bool = True) -> Any:
    """``plan_data`` in the form the verifiers read, whatever the problem.

    A :class:`~optmem.result.Result` becomes its JSON object (``solve --json``), a string
    is read as JSON text, a tuple of ops (``Result.plan``) becomes a list; anything else is
    returned as it is. Until stop 55 only the pipeline verifier took JSON text and tuples,
    and no verifier took a ``Result``. With ``text=False`` (``plan_data`` is a plan file's
    content, already read as JSON) a string is what the file holds, not JSON text.

    Raises
    ------
    PlanError
        For a string that is not JSON, or (``text=False``) for any string.
    """
    if isinstance(plan_data, Result):
        return plan_data.to_json()
    if isinstance(plan_data, str) and not text:  # "F_all 1" said "not valid JSON" until the audit
        shown = plan_data if len(plan_data) <= 40 else plan_data[:40] + "..."
        raise PlanError(f"expected a JSON list of ops (e.g. [\"F_all 1\", \"Loss\", \"B 1\"]) "
                        f"or a result object (solve --json), got the JSON string {shown!r}")
    if isinstance(plan_data, str):
        try:
            return json.loads(plan_data)
        except ValueError:
            raise PlanError("not valid JSON (a plan as JSON text, a list of ops, a result "
                            "or its JSON object)") from None
    return list(plan_data) if isinstance(plan_data, tuple) else plan_data


RECORDED_SETTINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "pipeline": {"memory_model": ("--memory-model",), "temporaries": ("--temporaries",),
                 "weight_copies": ("--weight-copies",), "buffers": (),
                 "chain_bandwidth": ("--bandwidth", "--chain-bandwidth")},
    "min-peak": {"model": ("--model",), "count_input": ("--ignore-input",)},
}
"""The settings a result records in its ``report``, by problem: keyword -> CLI flags.

Each changes the memory check (or, ``chain_bandwidth``, the transfers) of the replay. The
report key is the problem's keyword; a pipeline result records the ones that differ from
their defaults (:meth:`~optmem.problems.pipeline.PipelineProblem.settings_report`), a
min-peak result both of its own.
"""


def recorded_settings(problem: Any, plan_data: Any) -> dict[str, Any]:
    """The settings ``plan_data`` records for ``problem``'s kind, as stored (unchecked).

    Only a result of the same problem (an object with ``problem`` equal to the problem's
    name and a ``report`` object) records settings; anything else records none.
    """
    names = RECORDED_SETTINGS.get(getattr(problem, "name", ""), {})
    if not names or not isinstance(plan_data, dict) or plan_data.get("problem") != problem.name:
        return {}
    report = plan_data.get("report")
    if not isinstance(report, dict):
        return {}
    return {name: report[name] for name in names if name in report}


def settings_as_solved(problem: Any, plan_data: Any, *,
                       explicit: Any = None) -> tuple[Any, dict[str, Any]]:
    """``problem`` under the settings ``plan_data`` records, and the settings taken from it.

    The recorded values are checked by the problem class itself (one clear error, field
    ``report.NAME``, for a value it refuses). A setting named in ``explicit`` (``None``:
    every setting) was asked for by the caller and must equal the recorded one (else an
    error, field ``report.NAME``, naming both values and the flag); the others are taken
    from the plan (and listed when they change the problem).

    Parameters
    ----------
    problem
        The problem as built from the caller's arguments.
    plan_data
        The plan file's content.
    explicit
        The keywords of :data:`RECORDED_SETTINGS` the caller gave (the CLI: the flags on
        its command line), or ``None`` for all of them (Python's ``verify_plan``).

    Returns
    -------
    tuple
        The problem to replay under and ``{keyword: value}`` of the settings taken from
        the plan that differ from ``problem``'s (empty: ``problem`` itself).
    """
    recorded = recorded_settings(problem, plan_data)
    if not recorded:
        return problem, {}
    flags = RECORDED_SETTINGS[problem.name]
    solved = _with_settings(problem, recorded, recorded)
    asked = set(recorded) if explicit is None else set(explicit) & set(recorded)
    for name in (n for n in flags if n in asked):
        if not _same(getattr(solved, name), getattr(problem, name)):
            raise OptmemInputError(
                f"the plan was solved with {name} {getattr(solved, name)!r}, this replay "
                f"asks for {getattr(problem, name)!r} ({_flag(flags[name], name)}): to "
                f"replay the plan as solved, leave the flag out (Python: as_solved=True); "
                f"to replay its ops under other settings, verify them alone (the result's "
                f"'plan' list)",
                field=f"report.{name}")
    taken = {name: getattr(solved, name) for name in flags if name in recorded
             and name not in asked and not _same(getattr(solved, name), getattr(problem, name))}
    return (_with_settings(problem, taken, recorded) if taken else problem), taken


def _with_settings(problem: Any, values: dict[str, Any], recorded: dict[str, Any]) -> Any:
    """``problem`` rebuilt with ``values`` (its class checks them; errors name the key)."""
    changes = dict(values)
    if isinstance(problem, PipelineProblem):  # the link is rebuilt from chain_bandwidth
        changes.update(bandwidth=None,
                       chain_bandwidth=changes.get("chain_bandwidth", problem.chain_bandwidth))
    try:
        return dataclasses.replace(problem, **changes)
    except (OptmemInputError, TypeError, ValueError) as exc:
        reason = getattr(exc, "reason", str(exc))
        key = str(getattr(exc, "field", "") or "").replace("-", "_")
        key = "chain_bandwidth" if "bandwidth" in key else key
        if key not in values:
            key = next(iter(values))
        raise OptmemInputError(f"the plan records {key} {recorded.get(key)!r}: {reason}",
                               field=f"report.{key}") from None


def _flag(flags: tuple[str, ...], name: str) -> str:
    """How a setting is given: ``--memory-model, Python memory_model=``."""
    return "".join(f"{flag}, " for flag in flags) + f"Python {name}="


def _same(a: Any, b: Any) -> bool:
    """Whether two setting values are equal (floats within 1e-9 relative)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and \
            math.isclose(a, b, rel_tol=1e-9)
    return bool(a == b and type(a) is type(b))


_VERIFIERS: tuple[tuple[type, Callable[..., dict[str, Any]]], ...] = (
    (CheckpointProblem, verify_checkpoint_plan),
    (MinPeakProblem, verify_min_peak_plan),
    (OffloadProblem, verify_offload_plan),
    (PipelineProblem, verify_pipeline_plan),
)
