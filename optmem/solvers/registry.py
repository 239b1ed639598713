"""Every problem's methods and model exporters, listed in one place.

Each solver module declares its methods where they are written
(:func:`optmem.solvers.registration.register`: name, exactness, engines, extra keys); this
module lists them per problem, in the order ``compare`` runs them and ``--help`` prints
them. The facade (:mod:`optmem.solvers.facade`) reads :data:`METHODS` and
:data:`EXPORTERS` on first use. To add a method: declare it in its solver module and list
it here.
"""

from __future__ import annotations

from optmem.solvers import (
    checkpoint,
    checkpoint_exact,
    min_peak,
    offload,
    pipeline,
    remat_offload,
    remat_offload_delta,
    remat_offload_exact,
)
from optmem.solvers.registration import (
    Exporter,
    MethodFn,
    MethodInfo,
    declared_exports,
    declared_methods,
)

__all__ = ["EXPORTERS", "METHODS", "exporters", "method_infos"]

METHODS: dict[str, tuple[MethodFn, ...]] = {
    "checkpoint": (
        checkpoint.solve_checkpoint_dp,
        checkpoint.solve_store_all,
        checkpoint.solve_recompute_all,
        checkpoint.solve_chen,
        checkpoint.solve_sequential,
        checkpoint.solve_revolve,
        checkpoint.solve_checkpoint_brute,
        checkpoint_exact.solve_checkpoint_ilp,
        checkpoint_exact.solve_checkpoint_cpsat,
    ),
    "offload": (
        offload.solve_frac,
        offload.solve_greedy,
        offload.solve_dynprog,
        offload.solve_vdnn,
        offload.solve_vdnn_conv,
        offload.solve_offload_all,
        offload.solve_cpsat,
        offload.solve_ilp,
        offload.solve_brute,
    ),
    "remat-offload": (
        remat_offload.solve_dp,
        remat_offload.solve_remat_only,
        remat_offload.solve_offload_only,
        remat_offload.solve_opportunist,
        remat_offload.solve_autocapper,
        remat_offload_delta.solve_delta,
        remat_offload_exact.solve_brute,
        remat_offload_exact.solve_ilp,
        remat_offload_exact.solve_cpsat,
    ),
    "pipeline": (
        pipeline.solve_pipeline_contiguous,
        pipeline.solve_pipeline_equal,
        pipeline.solve_pipeline_pipedream,
        pipeline.solve_pipeline_ilp,
        pipeline.solve_pipeline_cpsat,
        pipeline.solve_pipeline_madpipe,
        pipeline.solve_pipeline_chunks,
    ),
    "min-peak": (
        min_peak.solve_min_peak_dp,
        min_peak.solve_min_peak_ilp,
        min_peak.solve_min_peak_brute,
        min_peak.solve_min_peak_chen,
        min_peak.solve_min_peak_every,
    ),
}
"""Each problem's methods in order (the first declared ``default`` is ``method="auto"``)."""

EXPORTERS: tuple[Exporter, ...] = (
    checkpoint_exact.export_checkpoint_ilp,
    checkpoint_exact.export_checkpoint_cpsat,
    offload.export_offload_ilp,
    remat_offload_exact.export_ilp,
    pipeline.export_pipeline_ilp,
    min_peak.export_min_peak_ilp,
)
"""Functions ``fn(problem, options, path)`` that write an exact method's model to a file."""


def method_infos() -> dict[str, dict[str, MethodInfo]]:
    """Problem name to ``{method name: info}`` from :data:`METHODS`.

    Raises
    ------
    ValueError
        If a listed function declares no method of its problem, or a name twice.
    """
    out: dict[str, dict[str, MethodInfo]] = {}
    for problem, fns in METHODS.items():
        table = out.setdefault(problem, {})
        for fn in fns:
            infos = [i for i in declared_methods(fn) if i.problem == problem]
            if not infos:
                raise ValueError(f"{fn.__qualname__} declares no method of {problem}")
            for info in infos:
                if info.name in table:
                    raise ValueError(f"method {info.name!r} of {problem} listed twice")
                table[info.name] = info
    return out


def exporters() -> dict[tuple[str, str], Exporter]:
    """``(problem, method)`` to the exporter declared for it in :data:`EXPORTERS`."""
    return {key: fn for fn in EXPORTERS for key in declared_exports(fn)}
