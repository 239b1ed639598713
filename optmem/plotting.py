"""Figures: the memory/makespan curve of a sweep and the timeline of a plan (matplotlib).

matplotlib is imported inside the functions (with the ``Agg`` backend), so importing this
module costs nothing; install it with ``optmem[plot]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optmem.errors import OptmemInputError, UnavailableError

if TYPE_CHECKING:
    from optmem.sweep import SweepResult

OP_COLORS = {"F_all": "#1f77b4", "F_ck": "#2ca02c", "F_none": "#98df8a", "Loss": "#7f7f7f",
             "B": "#d62728", "offload": "#9467bd", "prefetch": "#ff7f0e"}
FORMATS = (".png", ".svg", ".pdf")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UnavailableError("plots need matplotlib; install optmem[plot]",
                               field="plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _literal_text(fn: Any) -> Any:
    """Run a plot function with mathtext off.

    Titles, labels and legends carry chain names, memory units and user titles, where a
    ``$`` must be a dollar sign, not the start of a (possibly malformed, hence crashing)
    formula.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        plt = _pyplot()
        with plt.rc_context({"text.parse_math": False}):
            return fn(*args, **kwargs)

    return wrapper


def check_plot_path(path: str | Path) -> Path:
    """``path`` as a :class:`Path` if its suffix is a picture format, else raise clearly."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise OptmemInputError(f"expected a .png, .svg or .pdf file name, got {str(path)!r}",
                               field="plot")
    return path


def memory_scale(unit: str, largest: float) -> tuple[float, str]:
    """Divisor and label for memory axes (GiB/MiB when sizes are bytes).

    Examples
    --------
    >>> memory_scale("B", 3 * 2**30)
    (1073741824, 'GiB')
    >>> memory_scale("elements", 10)
    (1, 'elements')
    """
    if unit != "B":
        return 1, unit
    for label, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return scale, label
    return 1, "B"


def save_figure(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically and close it (nothing is left on an error)."""
    from optmem.fileio import write_atomic

    try:
        return write_atomic(path, lambda tmp: fig.savefig(
            tmp, dpi=130, format=path.suffix.lower().lstrip(".")), field="plot")
    finally:
        _pyplot().close(fig)


# ------------------------------------------------------------------ sweep curve
def _x(point: Any, scale: float) -> float:
    """Memory of a front point (never ``None`` on a front) on the plot's axis."""
    return float(point.memory or 0) / scale


@_literal_text
def plot_sweep(result: SweepResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draw every method's Pareto front, its lower-envelope markers and reference lines."""
    path = check_plot_path(path)
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fronts = result.fronts()
    memories = [p.memory for f in fronts.values() for p in f if p.memory is not None]
    memories += [m for m in (result.store_all_peak,) if m]
    memories += list(result.limits)
    scale, label = memory_scale(result.memory_unit, max(memories, default=1))
    xmax = max(memories, default=1) / scale
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    envelope = result.envelope()
    if envelope:
        xs = [_x(p, scale) for p in envelope] + [xmax]
        ys = [p.objective for p in envelope] + [envelope[-1].objective]
        ax.step(xs, ys, where="post", color="0.6", lw=7, alpha=0.3, zorder=1,
                solid_capstyle="butt")
    summary = result.summary()
    for k, (method, front) in enumerate(fronts.items()):
        color = colors[k % len(colors)]
        if not front:
            continue
        xs = [_x(p, scale) for p in front] + [xmax]
        ys = [p.objective for p in front] + [front[-1].objective]
        ax.step(xs, ys, where="post", color=color, lw=1.6, zorder=3, label=method)
        proven = [p for p in front if p.proven]
        other = [p for p in front if not p.proven]
        ax.scatter([_x(p, scale) for p in proven], [p.objective for p in proven], s=22,
                   color=color, zorder=4)
        ax.scatter([_x(p, scale) for p in other], [p.objective for p in other], s=22,
                   facecolors="white", edgecolors=color, zorder=4)
        first, best = front[0], front[-1]
        ax.scatter([_x(first, scale)], [first.objective], marker="<", s=110,
                   color=color, edgecolors="black", linewidths=0.6, zorder=5)
        ax.scatter([_x(best, scale)], [best.objective], marker="*", s=170,
                   color=color, edgecolors="black", linewidths=0.6, zorder=5)
        known = summary[method]["min_feasible_memory"]
        if known is not None and (not front or known < first.memory):
            ax.axvline(known / scale, color=color, lw=0.8, ls=(0, (1, 3)), zorder=2)
    if result.no_recompute_time is not None and result.problem != "min-peak":
        ax.axhline(result.no_recompute_time, color="black", lw=0.8, ls="--", zorder=2)
    if result.store_all_peak is not None:
        ax.axvline(result.store_all_peak / scale, color="black", lw=0.8, ls=":", zorder=2)
    ax.set_xlabel(f"peak memory ({label})")
    ylabel = "peak memory" if result.problem == "min-peak" else "makespan"
    ax.set_ylabel(f"{ylabel} ({result.time_unit})" if result.time_unit and
                  result.problem != "min-peak" else ylabel)
    ax.set_title(title or f"{result.chain_name}: {result.problem}, memory vs makespan")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    extra = [
        Line2D([], [], color="0.3", marker="o", ls="", label="proven optimal"),
        Line2D([], [], color="0.3", marker="o", ls="", markerfacecolor="white",
               label="feasible (heuristic / time limit)"),
        Line2D([], [], color="0.3", marker="<", ls="", markersize=9,
               label="smallest memory found"),
        Line2D([], [], color="0.3", marker="*", ls="", markersize=11,
               label="store-all point (best makespan)"),
        Line2D([], [], color="0.6", lw=6, alpha=0.3, label="lower envelope"),
    ]
    if any(s["min_feasible_memory"] is not None for s in summary.values()):
        extra.append(Line2D([], [], color="0.3", lw=0.8, ls=(0, (1, 3)),
                            label="smallest feasible memory (method's own)"))
    if result.no_recompute_time is not None and result.problem != "min-peak":
        extra.append(Line2D([], [], color="black", lw=0.8, ls="--",
                            label="total compute time (no recomputation)"))
    if result.store_all_peak is not None:
        extra.append(Line2D([], [], color="black", lw=0.8, ls=":", label="store-all peak"))
    ax.legend(handles=handles + extra, labels=labels + [h.get_label() for h in extra],
              fontsize=8, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    return save_figure(fig, path)


# ------------------------------------------------------------------ plan timelines
def _op_kind(op: str) -> str:
    return op.split()[0]


def _op_row(op: str, length: int) -> int:
    parts = op.split()
    if parts[0] == "Loss":
        return length + 1
    return int(parts[-1])


@_literal_text
def plot_checkpoint_timeline(
    steps: Sequence[Any], length: int, path: str | Path, *, scale_memory: float = 1.0,
    memory_limit: float | None = None, memory_unit: str = "B", time_unit: str = "ms",
    title: str = "",
) -> Path:
    """Ops over time (one row per stage) above the memory curve under the limit.

    ``steps`` are :class:`optmem.simulate.checkpoint.Step` (``start``, ``end``, ``peak``,
    ``after``); memory values are multiplied by ``scale_memory`` (the discretisation unit).
    """
    path = check_plot_path(path)
    plt = _pyplot()
    from matplotlib.patches import Patch

    peaks = [s.peak * scale_memory for s in steps]
    largest = max([*peaks, memory_limit or 0, 1])
    scale, label = memory_scale(memory_unit, largest)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for s in steps:
        kind = _op_kind(s.op)
        width = max(s.end - s.start, 1e-9)
        top.barh(_op_row(s.op, length), width, left=s.start, height=0.8,
                 color=OP_COLORS.get(kind, "0.5"), edgecolor="none")
    top.set_ylabel("stage (loss on top)")
    top.set_ylim(0.3, length + 1.7)
    kinds = [k for k in ("F_ck", "F_none", "F_all", "Loss", "B")
             if any(_op_kind(s.op) == k for s in steps)]
    top.legend(handles=[Patch(color=OP_COLORS[k], label=k) for k in kinds], fontsize=8,
               loc="upper right", ncol=len(kinds))
    xs: list[float] = []
    ys: list[float] = []
    for s in steps:  # during the op: its peak; at its end: what stays stored
        xs += [s.start, s.end]
        ys += [s.peak * scale_memory / scale, s.peak * scale_memory / scale]
        xs.append(s.end)
        ys.append(s.after * scale_memory / scale)
    bottom.fill_between(xs, ys, color="#1f77b4", alpha=0.35, lw=0)
    bottom.plot(xs, ys, color="#1f77b4", lw=1)
    if memory_limit is not None:
        bottom.axhline(memory_limit / scale, color="#d62728", ls="--", lw=1,
                       label=f"limit {memory_limit / scale:.4g} {label}")
    peak_step = max(steps, key=lambda s: s.peak)
    bottom.scatter([(peak_step.start + peak_step.end) / 2],
                   [peak_step.peak * scale_memory / scale], color="black", s=15, zorder=5,
                   label=f"peak {peak_step.peak * scale_memory / scale:.4g} {label}")
    bottom.set_ylabel(f"memory ({label})")
    bottom.set_xlabel(f"time ({time_unit})")
    bottom.set_ylim(0, largest / scale * 1.12)
    bottom.legend(fontsize=8, loc="upper right")
    top.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


@_literal_text
def plot_offload_timeline(
    sim: Any, path: str | Path, *, scale_memory: float = 1.0,
    memory_limit: float | None = None, memory_unit: str = "B", time_unit: str = "ms",
    title: str = "",
) -> Path:
    """Two lanes (compute stream, link) above the GPU memory of each compute op."""
    path = check_plot_path(path)
    plt = _pyplot()
    from matplotlib.patches import Patch

    mems = [s.memory * scale_memory for s in sim.compute]
    largest = max([*mems, memory_limit or 0, 1])
    scale, label = memory_scale(memory_unit, largest)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 2]})
    for s in sim.compute:
        top.barh(1, max(s.end - s.start, 1e-9), left=s.start, height=0.7,
                 color=OP_COLORS.get(_op_kind(s.op), "0.5"), edgecolor="white", lw=0.3)
        if s.idle > 0:
            top.barh(1, s.idle, left=s.start - s.idle, height=0.7, color="none",
                     edgecolor="0.4", hatch="///", lw=0)
    for s in sim.link:
        top.barh(0, max(s.end - s.start, 1e-9), left=s.start, height=0.7,
                 color=OP_COLORS.get(_op_kind(s.op), "0.5"), edgecolor="white", lw=0.3)
    top.set_yticks([0, 1], ["link", "compute"])
    top.set_ylim(-0.6, 2.1)
    kinds = [k for k in OP_COLORS if any(_op_kind(s.op) == k for s in
                                         (*sim.compute, *sim.link))]
    handles = [Patch(color=OP_COLORS[k], label=k) for k in kinds]
    if any(s.idle > 0 for s in sim.compute):
        handles.append(Patch(facecolor="white", edgecolor="0.4", hatch="///", label="waiting"))
    top.legend(handles=handles, fontsize=8, loc="upper left", ncol=len(handles))
    # each compute op's memory from its start; the level holds while the stream waits
    xs = [s.start for s in sim.compute] + [sim.compute[-1].end] if sim.compute else [0.0]
    ys = [s.memory * scale_memory / scale for s in sim.compute]
    ys = [*ys, ys[-1]] if ys else [0.0]
    bottom.fill_between(xs, ys, step="post", color="#9467bd", alpha=0.35, lw=0)
    bottom.step(xs, ys, where="post", color="#9467bd", lw=1)
    if memory_limit is not None:
        bottom.axhline(memory_limit / scale, color="#d62728", ls="--", lw=1,
                       label=f"limit {memory_limit / scale:.4g} {label}")
        bottom.legend(fontsize=8, loc="upper right")
    bottom.set_ylabel(f"GPU memory ({label})")
    bottom.set_xlabel(f"time ({time_unit})")
    bottom.set_ylim(0, largest / scale * 1.12)
    top.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
