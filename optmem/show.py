"""Plan pictures: ``optmem show PLAN.json --chain CHAIN [-o out.png]``.

A plan file is a JSON list of op strings or the ``--json`` output of ``optmem solve`` (which
carries ``problem``, ``memory_limit`` and ``unit``). The plan is replayed by the simulator of
its family and drawn as a timeline:

* checkpoint plans (also ``min-peak`` plans): one row per stage with the ops over time
  (``F_ck``, ``F_none``, ``F_all``, ``Loss``, ``B`` coloured apart), and below it the memory
  curve (the peak during each op, what stays stored after it) under the limit, replayed by
  :func:`optmem.simulate.checkpoint.simulate_checkpoint` on the chain itself (bytes);
* offload plans (ops ``offload X`` / ``prefetch X``): two lanes, compute and link, and the
  GPU memory of each compute op, replayed by :func:`optmem.simulate.offload.simulate_offload`
  on the discretised chain of the solve (``unit``) with the link bandwidth
  (``--bandwidth``, or a ``bandwidth`` field of the file).

matplotlib is imported only when a picture is drawn.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from optmem.chain import Chain, check_text
from optmem.errors import OptmemInputError, PlanError
from optmem.plan import read_plan_json
from optmem.units import chain_bandwidth_value, format_size, parse_bandwidth, parse_size

TRANSFER_WORDS = ("offload", "prefetch")


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """Read a plan file into ``{"plan": [...], "memory_limit", "unit", "problem", ...}``."""
    path = Path(path)
    data = read_plan_json(path)
    if not data["plan"]:
        raise PlanError("the plan is empty (the solve found no plan?)", source=str(path))
    if not all(isinstance(op, str) for op in data["plan"]):
        raise PlanError("expected op strings like 'F_all 3' in 'plan'", source=str(path))
    return data


def is_offload_plan(ops: list[str]) -> bool:
    """Whether the plan contains transfer ops (``offload X`` / ``prefetch X``)."""
    return any(op.split()[0] in TRANSFER_WORDS for op in ops if op.split())


def show_plan(
    chain: Chain,
    data: dict[str, Any],
    path: str | Path,
    *,
    memory_limit: int | None = None,
    bandwidth: float | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Replay the plan of ``data`` (see :func:`read_plan_file`) and draw it to ``path``.

    Parameters
    ----------
    chain
        The chain the plan was computed for.
    data
        ``{"plan": [...]}`` plus, optionally, ``memory_limit`` and ``unit`` (solve output).
    path
        Output picture (``.png``, ``.svg``, ``.pdf``).
    memory_limit
        Limit to draw, in the chain's memory unit (default: ``memory_limit * unit``).
    bandwidth
        Link bandwidth in memory units per time unit (offload plans).

    Returns
    -------
    dict
        ``kind``, ``makespan``, ``peak_memory`` (chain units), ``memory_limit``, ``path``.
    """
    from optmem import plotting

    ops = data["plan"]
    unit_value = _file_int(data, "unit", default=1, least=1)
    unit = 1 if unit_value is None else unit_value
    file_limit = _file_int(data, "memory_limit", default=None, least=0)
    if memory_limit is None and file_limit is not None:
        memory_limit = file_limit * unit
    label = str(data.get("problem") or "checkpoint")
    if label == "pipeline" or any(isinstance(o, str) and o.startswith("period ") for o in ops):
        raise PlanError("optmem show draws checkpoint, min-peak, offload and remat-offload "
                        "plans, not pipeline plans (their schedule: optmem export pipeline "
                        "... -o schedule.csv)")
    method = f" ({data['method']})" if data.get("method") else ""
    if is_offload_plan(ops):
        from optmem.simulate.offload import simulate_offload

        bw = bandwidth if bandwidth is not None else _file_bandwidth(data, chain)
        if bw is None:
            raise OptmemInputError("an offload plan needs the link bandwidth: pass "
                                   "--bandwidth (e.g. 12GB/s)", field="bandwidth")
        limit_units = memory_limit // unit if memory_limit is not None else None
        sim = simulate_offload(chain.quantize(unit), ops, float(bw) / unit, limit_units)
        peak = sim.peak_memory * unit
        head = title or (f"{chain.name}: {label} plan{method}, makespan {sim.makespan:.6g} "
                         f"{chain.time_unit}, peak {_size(peak, chain)}")
        plotting.plot_offload_timeline(sim, path, scale_memory=unit, memory_limit=memory_limit,
                                       memory_unit=chain.memory_unit, time_unit=chain.time_unit,
                                       title=head)
        return {"kind": "offload", "makespan": sim.makespan, "peak_memory": peak,
                "memory_limit": memory_limit, "path": str(path)}
    from optmem.simulate.checkpoint import simulate_checkpoint

    sim_c = simulate_checkpoint(chain, ops)
    head = title or (f"{chain.name}: {label} plan{method}, makespan {sim_c.makespan:.6g} "
                     f"{chain.time_unit}, peak {_size(sim_c.peak_memory, chain)}")
    plotting.plot_checkpoint_timeline(sim_c.timeline, chain.length, path,
                                      memory_limit=memory_limit, memory_unit=chain.memory_unit,
                                      time_unit=chain.time_unit, title=head)
    return {"kind": "checkpoint", "makespan": sim_c.makespan, "peak_memory": sim_c.peak_memory,
            "memory_limit": memory_limit, "path": str(path)}


def _file_int(data: dict[str, Any], name: str, *, default: int | None,
              least: int) -> int | None:
    """The integer field ``name`` of a plan file (``unit``, ``memory_limit``), checked."""
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 2**62:
        shown = value if not isinstance(value, int) or value < 10**30 else "a larger integer"
        raise PlanError(f"field '{name}': expected an integer in {least}..2^62 (a size in "
                        f"memory units), got {shown!r}")
    return value


def _file_bandwidth(data: dict[str, Any], chain: Chain) -> float | None:
    """The link bandwidth a plan file carries, ``None`` if absent.

    ``bandwidth``, or ``report.bandwidth`` of a ``solve --json`` output, in memory units per
    chain time unit (or a rate such as ``12GB/s``).
    """
    report = data.get("report")
    value = data.get("bandwidth")
    name = "bandwidth"
    if value is None and isinstance(report, dict):
        value, name = report.get("bandwidth"), "report.bandwidth"
    if value is None:
        return None
    try:
        if isinstance(value, str):  # a rate such as "12GB/s"
            return parse_bandwidth(value, time_unit=chain.time_unit, field=name)
        # a number is in chain units, as solve writes it: parsed as bytes per second until
        # stop 51, the link was 1000x slower per ms (137.8 ms drawn as 112,140 ms; a hunt)
        return chain_bandwidth_value(value, field=name, allow_inf=True)
    except OptmemInputError as exc:
        raise PlanError(f"field '{name}': {exc.reason}") from None


def _size(value: int, chain: Chain) -> str:
    return format_size(value) if chain.memory_unit == "B" else f"{value} {chain.memory_unit}"


def register_cli(subparsers: Any) -> None:
    """Add ``optmem show`` to the CLI."""
    p = subparsers.add_parser(
        "show", help="draw a plan as a timeline (ops over time, memory under the limit)",
        description="Replay a plan file (a JSON list of ops or the --json output of "
                    "'optmem solve') and draw its timeline.")
    p.add_argument("plan", help="plan file (JSON)")
    p.add_argument("--chain", "-c", required=True, help="chain file or bundled dataset name")
    p.add_argument("--output", "-o", help="picture file (.png, .svg, .pdf; default "
                                          "PLAN.png next to the plan)")
    p.add_argument("--memory", "-m", help="memory limit to draw (default: the file's)")
    p.add_argument("--bandwidth", help="link bandwidth for offload plans (e.g. 12GB/s)")
    p.add_argument("--title", help="figure title")
    p.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    """Handler of ``optmem show``."""
    from optmem.datasets import resolve_chain

    chain = resolve_chain(args.chain)
    if args.title:
        check_text(args.title, name="--title", allow="\n")
    data = read_plan_file(args.plan)
    out = args.output or str(Path(args.plan).with_suffix(".png"))
    limit = parse_size(args.memory, field="--memory") if args.memory else None
    bandwidth = (parse_bandwidth(args.bandwidth, time_unit=chain.time_unit, field="--bandwidth")
                 if args.bandwidth else None)
    try:
        info = show_plan(chain, data, out, memory_limit=limit, bandwidth=bandwidth,
                         title=args.title)
    except PlanError as exc:
        raise exc.with_source(args.plan) from None
    limit_text = f" / limit {_size(info['memory_limit'], chain)}" \
        if info["memory_limit"] is not None else ""
    print(f"{info['kind']} plan: makespan {info['makespan']:.6g} {chain.time_unit}, peak "
          f"{_size(info['peak_memory'], chain)}{limit_text}; picture written to {out}")
    return 0
