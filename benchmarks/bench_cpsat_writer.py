"""Writing a model for CP-SAT: the proto written directly against CP-SAT's Python API.

:func:`~optmem.models.formulation.to_cpsat` writes each linear row straight into CP-SAT's
``ConstraintProto`` (stop 67). The baseline, :func:`api_to_cpsat`, is the writer of stops
up to 66: the same scaling and rounding, each row built as a CP-SAT expression term by term
and added with ``add_linear_constraint`` and ``only_enforce_if``. Both must write the same
proto (checked here on every model, and in ``tests/test_formulation.py`` on random ones).

The models: the pipeline head pass's questions on the headline instance (ResNet-50, 21
units, 4 GPUs, 3 GiB, 12 GB/s) at its proven optimum 31.3896, ``--sample`` heads per length
of ``--lengths`` drawn as in ``bench_pipeline_head_params.py`` (seed 2), each built as
:func:`~optmem.solvers.pipeline_chunks.head_question` builds it (delayed tail, stash
floors, no objective). Each model is written ``--repeat`` times by each writer in
alternating order; prints, per length, the models' rows, the CPU seconds of each writer
(medians of the repeats, summed over the models), their ratio, the CPU seconds of building
the models (for scale) and how many protos were the same.

Usage::

    python benchmarks/bench_cpsat_writer.py [--lengths 10 14 18] [--sample 30] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from optmem.datasets import resolve_chain
from optmem.models.formulation import (
    CpsatModel,
    Kind,
    Model,
    _ceil,
    _cp_bound,
    _floor,
    _integral,
    to_cpsat,
)
from optmem.models.pipeline import delay_tail, make_units
from optmem.solvers import pipeline_chunks
from optmem.solvers.pipeline_common import build_model, lower_bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline_exact import headline_problem  # noqa: E402
from bench_pipeline_head_params import OPTIMUM, samples  # noqa: E402


def api_to_cpsat(model: Model, scale: int = 1, objective_scale: int | None = None
                 ) -> CpsatModel:
    """``to_cpsat`` as written up to stop 66: every row through CP-SAT's Python API."""
    from ortools.sat.python import cp_model

    cp = cp_model.CpModel()
    xs: list[Any] = [cp.new_bool_var(v.name) if v.kind is Kind.BINARY
                     else cp.new_int_var(*_cp_bound(v, scale), v.name) for v in model.vars]
    div = [scale if v.kind is Kind.CONTINUOUS else 1 for v in model.vars]
    worst = 0.0

    def lit(literal: tuple[int, bool]) -> Any:
        return xs[literal[0]] if literal[1] else xs[literal[0]].negated()

    def rounded(value: float) -> int:
        nonlocal worst
        r, err = _integral(value)
        worst = max(worst, err)
        return r

    for con in model.constraints:
        if not con.terms:
            ct = cp.add_bool_or([])
        else:
            k = scale if any(div[i] != 1 for i, _ in con.terms) else 1
            expr = sum(rounded(c * k / div[i]) * xs[i] for i, c in con.terms)
            lo = -cp_model.INT_MAX if con.lo is None else _ceil(con.lo * k)
            hi = cp_model.INT_MAX if con.hi is None else _floor(con.hi * k)
            for side in (con.lo, con.hi):
                if side is not None:
                    rounded(side * k)
            ct = cp.add_linear_constraint(expr, lo, hi)
        if con.enforce:
            ct.only_enforce_if([lit(x) for x in con.enforce])
    ivs = []
    for it in model.intervals:
        k = div[it.var]
        start = xs[it.var] + rounded(it.offset * k)
        size = rounded(it.size * k)
        ivs.append(cp.new_fixed_size_interval_var(start, size, it.name)
                   if it.presence is None else
                   cp.new_optional_fixed_size_interval_var(start, size, lit(it.presence),
                                                           it.name))
    for group in model.no_overlaps:
        cp.add_no_overlap([ivs[j] for j in group.intervals])
    k = scale if objective_scale is None else objective_scale
    cp.minimize(sum(rounded(c * k / div[i]) * xs[i] for i, c in model.objective.merged()))
    if model.trivially_infeasible:
        cp.add_bool_or([])
    return CpsatModel(model, cp, xs, scale, worst <= 1e-6, worst, float(k))


def head_models(lengths: list[int], size: int) -> list[tuple[str, list[tuple[Model, int]]]]:
    """The head pass's models (with their time scales) per length of ``lengths``."""
    problem = headline_problem(resolve_chain("resnet50-b32-224"))
    units = make_units(problem)
    cutoff = OPTIMUM * (1 - pipeline_chunks.PROOF_STEP)
    low = lower_bound(problem)
    out = []
    for label, picked in samples(problem, lengths, size, False):
        models = []
        for head in picked:
            relaxed, alloc = delay_tail(units, head)
            shape, floors = pipeline_chunks.head_instance(problem, relaxed, alloc, cutoff, low)
            form = build_model(shape, units=relaxed, gpu=list(alloc), upper_bound=cutoff,
                               lower=low, feasibility=True, stash_floors=floors)
            models.append((form.model, form.time_scale()[0]))
        out.append((label, models))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 14, 18])
    parser.add_argument("--sample", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    start = time.process_time()
    sets = head_models(args.lengths, args.sample)
    built = time.process_time() - start
    print(f"Drew and built {sum(len(m) for _, m in sets)} models in {built:.2f} CPU s "
          "(the enumeration of the heads included).")
    print("| models | count | rows | API writer CPU s | proto writer CPU s | ratio | "
          "same proto |")
    print("|---|---|---|---|---|---|---|")
    for label, models in sets:
        spent = [0.0, 0.0]
        same = 0
        for j, (model, scale) in enumerate(models):
            times: list[list[float]] = [[], []]
            written: list[Any] = [None, None]
            for r in range(args.repeat):
                for which in ((0, 1) if (j + r) % 2 == 0 else (1, 0)):
                    t = time.process_time()
                    written[which] = (api_to_cpsat, to_cpsat)[which](model, scale)
                    times[which].append(time.process_time() - t)
            spent[0] += statistics.median(times[0])
            spent[1] += statistics.median(times[1])
            same += _same(*written)
        rows = sum(len(m.constraints) for m, _ in models)
        print(f"| {label} | {len(models)} | {rows:,} | {spent[0]:.3f} | {spent[1]:.3f} | "
              f"{spent[1] / spent[0]:.2f} | {same} / {len(models)} |", flush=True)


def _same(a: CpsatModel, b: CpsatModel) -> bool:
    """The same proto text, rounding report and objective scale."""
    return (str(a.cp.proto) == str(b.cp.proto) and a.exact == b.exact
            and a.max_rounding == b.max_rounding and a.objective_scale == b.objective_scale)


if __name__ == "__main__":
    main()
