"""BERT at ``checkpoint_sequential(2)``'s memory: the DP's plan against seq2's, exactly.

Issue 13.6 target 1: in bench_hf's quiet runs optmem's plan at the real memory of
``checkpoint_sequential(2)`` ran 1-2 % slower than it. This script takes bench_hf's BERT
chain (profiled as bench_hf does, or read with ``--chain``), finds the limit bench_hf uses
for that memory (:meth:`bench_hf.OptmemSearch.fit`: the largest limit whose plan's exact
real peak is at most seq2's), and compares, **without timing anything**:

* the bridge's ``dp`` plan at that limit (rounding pass and segment charge included) and the
  optmem plan equivalent to ``checkpoint_sequential(2)`` (:func:`bench_hf.grouped_plan`);
  both replayed by the simulator at exact sizes: peak, fit, makespan (exact: profiled times
  are multiples of ``2**-16`` ms), recomputed segments (``F_ck``), re-forwards
  (``F_ck`` + ``F_none``) and the DP's objective with the segment charge, split into the
  stages' kernels, the per-op constant (``op_overhead_ms`` per re-forward) and the
  segment charges;
* the same plans' peaks in the DP's units, rounded up (the DP's sizes) and down (the
  rounding pass's);
* the DP's plan at that limit when the per-op constant ``a`` and the segment charge ``C``
  take other values (the chain's forward times with ``a`` swapped, rounded again as the
  profile rounds).

Usage::

    PYTHONPATH=. python benchmarks/bench_hf_tie.py --chain CHAIN.json --markdown OUT.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_hf as bh  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.plan import Op, OpKind, parse_plan  # noqa: E402
from optmem.pytorch.planning import Planner, auto_slots, recorded_segment_cost, rounded_down  # noqa: E402
from optmem.pytorch.profile import with_op_charge  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402
from optmem.solvers.hints import unit_of  # noqa: E402

MiB = 2 ** 20
CONSTANTS = [(0.5, 1.0), (0.25, 1.0), (0.1, 1.0), (0.0, 1.0), (0.5, 0.5), (0.1, 0.5)]
"""``(a, C)`` pairs tried at the limit: per-op constant and segment charge (ms)."""


def counts(plan: tuple[Op, ...]) -> tuple[int, int]:
    """``(segments, re-forwards)``: ``F_ck`` ops, and ``F_ck`` plus ``F_none`` ops."""
    seg = sum(1 for o in plan if o.kind is OpKind.F_CK)
    return seg, seg + sum(1 for o in plan if o.kind is OpKind.F_NONE)


def with_constants(chain: Chain, a: float, cost: float) -> Chain:
    """``chain`` with the per-op constant ``a`` instead of its own and segment charge ``cost``."""
    ratio = float(((chain.extra or {}).get("profile") or {}).get("op_overhead_ratio") or 0.0)
    charged = with_op_charge(chain, a, ratio)  # the stages' kernels with the new constant
    prof = dict(charged.extra["profile"], segment_cost_ms=cost)
    return dataclasses.replace(charged, extra=dict(charged.extra, profile=prof))


def row(name: str, chain: Chain, plan: tuple[Op, ...], limit: int) -> dict[str, Any]:
    """The plan replayed at exact sizes, with the DP's objective split into its parts."""
    a = float(chain.extra["profile"].get("op_overhead_ms") or 0.0)
    cost = recorded_segment_cost(chain)
    sim = simulate_checkpoint(chain, plan)
    seg, re = counts(plan)
    makespan = Fraction(sim.makespan)
    return {"name": name, "peak": sim.peak_memory, "fits": sim.peak_memory <= limit,
            "makespan": makespan, "segments": seg, "reforwards": re,
            "constant": Fraction(a) * re, "charges": Fraction(cost) * seg,
            "objective": makespan + Fraction(cost) * seg,
            "kernels": makespan - Fraction(a) * (re + chain.length),
            "starts": " ".join(str(o) for o in plan if o.kind is OpKind.F_CK)}


def verdict(diff: Fraction, objective: Fraction, profile: dict[str, Any]) -> str:
    """``tie``, ``near-tie`` (below the profile's time resolution) or a clear difference.

    Profiled times are rounded to a relative grid of ``time_resolution`` (within a factor
    ``sqrt(1 + r)`` of the measurement, :func:`~optmem.pytorch.profile.round_time`), so a
    plan's objective is only known to about ``r / 2`` of itself: two plans closer than
    that are a near-tie the profile cannot order.

    Examples
    --------
    >>> verdict(Fraction(0), Fraction(100), {"time_resolution": 1 / 64})
    'a tie (equal objectives)'
    >>> verdict(Fraction(-1, 5), Fraction(100), {"time_resolution": 1 / 64})[:8]
    'a near-t'
    """
    if diff == 0:
        return "a tie (equal objectives)"
    rel = abs(float(diff / objective))
    res = float(profile.get("time_resolution") or 0.0)
    if rel < res / 2:
        return (f"a near-tie: the objectives differ by {100 * rel:.3f} %, below half the "
                f"profile's time resolution ({100 * res / 2:.2f} %)")
    return f"a clear difference ({100 * rel:.3f} %)"


def analyse(chain: Chain, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """Everything the report prints (see the module docstring)."""
    top = int(chain.store_all_peak() * 1.02) + 1
    cmodel = op.checkpoint(model, batch, memory_limit=top, chain=chain)
    layers = len(bh.layer_list(model))
    plan_seq2 = bh.grouped_plan(bh.layer_groups(bh.stage_layers(cmodel.stage_names),
                                                bh.torch_segments(layers, 2)))
    with bh.sequential(model, 2) as call:
        seq2_real = bh.real_peak(call, model, batch)
    limit = bh.OptmemSearch(cmodel, model, batch).fit(seq2_real, 8, 6)
    assert limit is not None
    result = Planner("checkpoint", limit).solve_at(chain, limit)
    plan_dp = parse_plan(result.plan or ())
    rows = [row("dp plan", chain, plan_dp, limit), row("seq2 plan", chain, plan_seq2, limit)]
    unit = unit_of(limit, auto_slots(chain.length))
    units = {name: [simulate_checkpoint(c, p).peak_memory for p in (plan_dp, plan_seq2)]
             for name, c in (("up", chain.quantize(unit)),
                             ("down", rounded_down(chain, unit).quantize(unit)))}
    alternatives = []
    for a, cost in CONSTANTS:
        alt = with_constants(chain, a, cost)
        plan = parse_plan(Planner("checkpoint", limit).solve_at(alt, limit).plan or ())
        alternatives.append((a, cost, row("", alt, plan, limit),
                             row("", alt, plan_seq2, limit), plan == plan_seq2,
                             row("", chain, plan, limit)["kernels"]))
    return {"limit": limit, "seq2_real": seq2_real, "result": result, "rows": rows,
            "unit": unit, "units": units, "alternatives": alternatives}


def report(res: dict[str, Any], chain: Chain, source: str) -> str:
    """The Markdown report."""
    prof = chain.extra["profile"]
    limit, rows = res["limit"], res["rows"]
    rep = res["result"].report
    out = ["# BERT at `checkpoint_sequential(2)`'s memory: the DP's plan against seq2's, exactly",
           "", "Produced by `PYTHONPATH=. python benchmarks/bench_hf_tie.py` (no timing; see "
           f"its docstring). Chain: {source}; {chain.length} stages, `op_overhead_ms` "
           f"{prof.get('op_overhead_ms')}, segment charge {recorded_segment_cost(chain)} ms, "
           f"time resolution {prof.get('time_resolution')}. "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
           f"{os.getloadavg()[0]:.1f}.", "",
           f"seq2's real peak {res['seq2_real']} B ({res['seq2_real'] / MiB:.2f} MiB); the "
           f"limit bench_hf uses under it: {limit} B ({limit / MiB:.2f} MiB). The dp's "
           f"report: segments {rep.get('segments')}, objective with charges "
           f"{rep.get('objective_with_segments')!r}, rounding {rep.get('rounding')}, tries "
           f"{rep.get('rounding_tries')}, model bound {rep.get('model_bound')!r}.", "",
           "| plan | `F_ck` at | segments | re-forwards | exact peak MiB | fits | makespan ms "
           "| kernels ms | per-op constant ms | segment charges ms | objective ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['starts']} | {r['segments']} | {r['reforwards']} | "
                   f"{r['peak'] / MiB:.4f} | {'yes' if r['fits'] else 'NO'} | "
                   f"{float(r['makespan']):.6f} | {float(r['kernels']):.6f} | "
                   f"{float(r['constant']):.2f} | {float(r['charges']):.2f} | "
                   f"{float(r['objective']):.6f} |")
    dp, seq = rows
    diff = dp["objective"] - seq["objective"]
    out += ["", f"**Verdict: {verdict(diff, seq['objective'], prof)}**; seq2's plan "
            f"{'fits' if seq['fits'] else 'does not fit'} the limit at exact sizes and "
            f"{'fits' if res['units']['down'][1] <= limit // res['unit'] else 'does not fit'}"
            " in the rounding pass's units (sizes rounded down), so the DP's size rounding "
            f"{'does not hide' if res['units']['down'][1] <= limit // res['unit'] else 'hides'}"
            " it.", "", f"dp - seq2: objective {diff} ms = {float(diff):+.6f} ms "
            f"({float(diff / seq['objective']) * 100:+.3f} %), of which kernels "
            f"{float(dp['kernels'] - seq['kernels']):+.4f}, per-op constant "
            f"{float(dp['constant'] - seq['constant']):+.4f}, segment charges "
            f"{float(dp['charges'] - seq['charges']):+.4f}.", "",
            f"In the DP's units ({res['unit']} B, limit {limit // res['unit']} units): peaks "
            f"rounded up (the DP's sizes) dp {res['units']['up'][0]}, seq2 "
            f"{res['units']['up'][1]}; rounded down (the rounding pass's) dp "
            f"{res['units']['down'][0]}, seq2 {res['units']['down'][1]}.", "",
            "The DP at the same limit with other constants (`a`: ms per re-forward, `C`: ms "
            "per segment; kernels from the profiled chain, objectives under those "
            "constants):", "",
            "| a | C | dp plan: `F_ck` at | segments | re-forwards | kernels ms | objective ms "
            "| seq2 plan's objective | dp plan is seq2's |",
            "|---|---|---|---|---|---|---|---|---|"]
    for a, cost, r, s, same, kernels in res["alternatives"]:
        starts = r["starts"] if r["segments"] <= 4 else f"{r['starts'][:24]} ..."
        out.append(f"| {a:g} | {cost:g} | {starts} | {r['segments']} | "
                   f"{r['reforwards']} | {float(kernels):.4f} | "
                   f"{float(r['objective']):.4f} | {float(s['objective']):.4f} | "
                   f"{'yes' if same else 'no'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    """Run the analysis (see the module docstring); returns the report."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--chain", help="read the profiled chain (JSON) instead of profiling")
    ap.add_argument("--save-chain", help="write the profiled chain (JSON) here")
    ap.add_argument("--markdown", help="write the report to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = next(s for s in bh.FULL if s.name == "bert")
    model, batch = bh.build(spec)
    if args.chain:
        chain, source = Chain.from_dict(json.loads(Path(args.chain).read_text())), \
            f"`{args.chain}`"
    else:
        chain, source = op.profile_chain(model, batch, repeats=3), "profiled now"
    if args.save_chain:
        Path(args.save_chain).write_text(json.dumps(chain.to_dict()))
    text = report(analyse(chain, model, batch), chain, source)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return text


if __name__ == "__main__":
    main()
