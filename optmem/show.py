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
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from optmem.chain import Chain, ChainError, check_text
from optmem.errors import OptmemInputError, PlanError
from optmem.plan import plan_file_int, read_plan_json
from optmem.problems.checkpoint import check_chain, check_memory_limit
from optmem.simulate.verify import plan_input
from optmem.units import (
    chain_bandwidth_value,
    format_size,
    parse_bandwidth,
    parse_chain_bandwidth,
)

TRANSFER_WORDS = ("offload", "prefetch")
_Sim = TypeVar("_Sim")


def read_plan_file(path: str | Path) -> dict[str, Any]:
    """Read a plan file into ``{"plan": [...], "memory_limit", "unit", "problem", ...}``."""
    path = Path(path)
    try:
        return _checked_plan(read_plan_json(path))
    except PlanError as exc:
        raise exc.with_source(str(path)) from None


def _checked_plan(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` if its ``plan`` is a non-empty list of op strings (a plan file's checks)."""
    if not data["plan"]:
        raise PlanError("the plan is empty (the solve found no plan?)")
    if not all(isinstance(op, str) for op in data["plan"]):
        raise PlanError("expected op strings like 'F_all 3' in 'plan'")
    return data


def is_offload_plan(ops: list[str]) -> bool:
    """Whether the plan contains transfer ops (``offload X`` / ``prefetch X``)."""
    return any(op.split()[0] in TRANSFER_WORDS for op in ops if op.split())


def show_plan(
    chain: Chain | str | Path,
    data: Any,
    path: str | Path,
    *,
    memory_limit: int | str | None = None,
    bandwidth: float | str | None = None,
    chain_bandwidth: float | str | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Replay the plan of ``data`` (see :func:`read_plan_file`) and draw it to ``path``.

    Parameters
    ----------
    chain
        The chain the plan was computed for: a :class:`Chain`, a chain file path or a
        bundled dataset name (as the CLI's ``--chain``).
    data
        ``{"plan": [...]}`` plus, optionally, ``memory_limit`` and ``unit`` (solve output),
        a :class:`~optmem.result.Result`, a list or tuple of ops, a :class:`~pathlib.Path`
        of a plan file (as the CLI's ``PLAN``), or JSON text of any of those.
    path
        Output picture (``.png``, ``.svg``, ``.pdf``).
    memory_limit
        Limit to draw (default: the file's ``memory_limit * unit``): bytes (memory units)
        as the problems take them, an int or a size string (``"4GiB"``), or a percentage
        of the chain's store-all peak (``"60%"``).
    bandwidth
        Link bandwidth for offload plans, as the problems take it (CONTRACT section 14): a
        number of bytes (memory units) per second or a rate (``"12GB/s"``).
    chain_bandwidth
        The link in memory units per chain time unit instead (``--chain-bandwidth``).
        Until stop 75 ``bandwidth`` was read in these units, and the chain, the data and
        the limit had to be given as objects and an int (the CLI took names and sizes).

    Returns
    -------
    dict
        ``kind``, ``makespan``, ``peak_memory`` (chain units), ``memory_limit``, ``path``,
        ``above_limit`` (``None``, or why the plan does not fit ``memory_limit``).

    Notes
    -----
    One rule for every problem (since stop 53; before, a checkpoint plan above the limit
    was drawn and an offload plan refused): the plan is replayed under the limit drawn, as
    ``verify`` replays it; a plan that does not fit that limit is drawn as replayed without
    it (an offload plan's compute then never waits for memory) over the limit line, and
    ``above_limit`` says which op first goes above it. A plan invalid in itself raises
    :class:`~optmem.errors.PlanError`.
    """
    from optmem import plotting

    chain = check_chain(chain)
    data = _plan_data(data)
    if memory_limit is not None:
        memory_limit = check_memory_limit(memory_limit, field="memory_limit", chain=chain)
    bandwidth = _link(chain, bandwidth, chain_bandwidth)
    ops = data["plan"]
    unit_value = plan_file_int(data, "unit", default=1, least=1)
    unit = 1 if unit_value is None else unit_value
    file_limit = plan_file_int(data, "memory_limit", default=None, least=0)
    if memory_limit is None and file_limit is not None:
        memory_limit = file_limit * unit
    label = _file_text(data, "problem") or "checkpoint"
    if label == "pipeline" or any(isinstance(o, str) and o.startswith("period ") for o in ops):
        raise PlanError("optmem show draws checkpoint, min-peak, offload and remat-offload "
                        "plans, not pipeline plans (their schedule: optmem export pipeline "
                        "... -o schedule.csv)")
    method_name = _file_text(data, "method")
    method = f" ({method_name})" if method_name else ""
    if is_offload_plan(ops):
        from optmem.simulate.offload import simulate_offload

        bw = bandwidth if bandwidth is not None else _file_bandwidth(data, chain)
        if bw is None:
            raise OptmemInputError("an offload plan needs the link bandwidth: pass "
                                   "--bandwidth (e.g. 12GB/s) or --chain-bandwidth (memory "
                                   "units per chain time unit)", field="bandwidth")
        limit_units = memory_limit // unit if memory_limit is not None else None
        quantized = chain.quantize(unit)
        sim, above = _replay(lambda limit: simulate_offload(quantized, ops, float(bw) / unit,
                                                            limit), limit_units)
        peak = sim.peak_memory * unit
        head = title or (f"{chain.name}: {label} plan{method}, makespan {sim.makespan:.6g} "
                         f"{chain.time_unit}, peak {_size(peak, chain)}")
        plotting.plot_offload_timeline(sim, path, scale_memory=unit, memory_limit=memory_limit,
                                       memory_unit=chain.memory_unit, time_unit=chain.time_unit,
                                       title=head)
        return {"kind": "offload", "makespan": sim.makespan, "peak_memory": peak,
                "memory_limit": memory_limit, "path": str(path), "above_limit": above}
    from optmem.simulate.checkpoint import simulate_checkpoint

    sim_c, above = _replay(lambda limit: simulate_checkpoint(chain, ops, limit), memory_limit)
    head = title or (f"{chain.name}: {label} plan{method}, makespan {sim_c.makespan:.6g} "
                     f"{chain.time_unit}, peak {_size(sim_c.peak_memory, chain)}")
    plotting.plot_checkpoint_timeline(sim_c.timeline, chain.length, path,
                                      memory_limit=memory_limit, memory_unit=chain.memory_unit,
                                      time_unit=chain.time_unit, title=head)
    return {"kind": "checkpoint", "makespan": sim_c.makespan, "peak_memory": sim_c.peak_memory,
            "memory_limit": memory_limit, "path": str(path), "above_limit": above}


def _plan_data(data: Any) -> dict[str, Any]:
    """``show_plan``'s ``data`` as a plan file's content (:func:`read_plan_file`)."""
    if isinstance(data, Path):
        return read_plan_file(data)
    data = plan_input(data)  # a Result, JSON text, a tuple of ops
    if isinstance(data, list):
        data = {"plan": data}
    if not isinstance(data, dict) or not isinstance(data.get("plan"), list):
        raise PlanError("expected a plan: a list of ops, a result or its JSON object (with a "
                        "'plan' list), or the Path of a plan file")
    return _checked_plan(data)


def _link(chain: Chain, bandwidth: Any, chain_bandwidth: Any) -> float | None:
    """The link in chain units from ``bandwidth`` (per second) or ``chain_bandwidth``."""
    if bandwidth is not None and chain_bandwidth is not None:
        raise OptmemInputError("give the link as bandwidth (bytes per second or a rate) or "
                               "as chain_bandwidth (chain units), not both",
                               field="chain_bandwidth")
    if bandwidth is not None:
        return parse_bandwidth(bandwidth, time_unit=chain.time_unit, field="bandwidth")
    if chain_bandwidth is not None:
        return parse_chain_bandwidth(chain_bandwidth, field="chain_bandwidth")
    return None


def _replay(run: Callable[[int | None], _Sim], limit: int | None) -> tuple[_Sim, str | None]:
    """``run(limit)``; ``run(None)`` and the reason when the plan does not fit ``limit``.

    The rule of :func:`show_plan`: a plan valid without the limit but not under it is
    replayed without it; a plan invalid in itself raises from ``run(None)``.
    """
    if limit is None:
        return run(None), None
    try:
        return run(limit), None
    except PlanError as exc:
        sim = run(None)  # a plan invalid in itself raises its own error here
        return sim, exc.reason


def _file_text(data: dict[str, Any], name: str) -> str | None:
    """The text field ``name`` of a plan file (``problem``, ``method``); ``None`` if absent.

    It is drawn in the title: an unpaired surrogate (a JSON escape of one) made matplotlib
    raise a ``TypeError`` traceback until stop 53 (fuzz seed 5).
    """
    value = data.get(name)
    if value is None:
        return None
    try:
        return check_text(value, name=name)
    except ChainError as exc:
        raise PlanError(f"field '{name}': {exc.reason}") from None


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
    p.add_argument("--chain-bandwidth", metavar="X",
                   help="link bandwidth in the chain's own units instead of --bandwidth: "
                        "memory units per chain time unit")
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
    limit = check_memory_limit(args.memory, field="--memory", chain=chain) \
        if args.memory else None
    bandwidth = (parse_bandwidth(args.bandwidth, time_unit=chain.time_unit, field="--bandwidth")
                 if args.bandwidth else None)
    if args.chain_bandwidth is not None:
        if bandwidth is not None:
            raise OptmemInputError("give the link as --bandwidth (bytes per second or a rate) "
                                   "or as --chain-bandwidth (chain units), not both",
                                   field="--chain-bandwidth")
        bandwidth = parse_chain_bandwidth(args.chain_bandwidth, field="--chain-bandwidth")
    try:
        info = show_plan(chain, data, out, memory_limit=limit, chain_bandwidth=bandwidth,
                         title=args.title)
    except PlanError as exc:
        raise exc.with_source(args.plan) from None
    limit_text = f" / limit {_size(info['memory_limit'], chain)}" \
        if info["memory_limit"] is not None else ""
    if info["above_limit"] is not None:
        limit_text += " (above the limit)"
        print(f"optmem: warning: {args.plan} does not fit the limit "
              f"{_size(info['memory_limit'], chain)} ({info['above_limit']}); drawn as "
              "replayed without the limit", file=sys.stderr)
    print(f"{info['kind']} plan: makespan {info['makespan']:.6g} {chain.time_unit}, peak "
          f"{_size(info['peak_memory'], chain)}{limit_text}; picture written to {out}")
    return 0
