"""Where exact methods turn a failed engine call into a :class:`~optmem.result.Result`.

The engine adapters (:mod:`optmem.solvers.engines`) never raise for an engine fault: they
return an ``error`` :class:`~optmem.solvers.engines.EngineResult` with the engine's message.
Every exact method hands such an outcome to :func:`engine_failure`, which returns

* ``status: feasible`` with the method's warm-start plan when the method had one (the
  ``fallback`` builds it through the method's own simulator-checked result path, so the
  plan, its objective and its peak are verified), with ``report['engine_error']`` and a
  ``note`` saying that the engine failed; or
* ``status: error`` with ``report['error']`` = the engine's message otherwise.

So a crashing CBC, a HiGHS exception or an invalid CP-SAT model never escapes ``solve`` or
``compare`` as an exception, and the CLI keeps its exit codes (``error`` exits 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from optmem.result import Result, Status
from optmem.solvers.engines import EngineResult

FALLBACK_NOTE = "the engine failed; returning the warm-start plan, replayed by the simulator"


def engine_failure(
    problem: str, method: str, out: EngineResult, *, report: dict[str, Any],
    fallback: Callable[[dict[str, Any]], Result] | None = None, **fields: Any,
) -> Result:
    """The result of a method whose engine call ``out`` failed (see the module docstring).

    Parameters
    ----------
    problem, method
        Names for the result.
    out
        The failed engine outcome (``out.failed``).
    report
        The method's report so far; the engine keys of :meth:`EngineResult.report` are added.
    fallback
        ``report -> Result`` building the verified warm-start result, or ``None``.
    fields
        Other :class:`Result` fields of the error result (``memory_limit``, ``unit``, ...).
    """
    info = {**report, **out.report()}
    if fallback is not None:
        result = fallback({**info, "note": FALLBACK_NOTE})
        if result.status.has_plan:
            return result.with_(status=Status.FEASIBLE)
        info["fallback_error"] = result.report.get("error", str(result.status))
    info["error"] = info["engine_error"]
    fields.setdefault("solver", out.engine)
    return Result(problem, method, Status.ERROR, report=info, **fields)
