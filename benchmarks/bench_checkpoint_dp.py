"""Time optmem's persistent DP against a C transcription of rotor's ``persistent_compute_table``.

For chains of L = 100, 200 and 339 stages with S = 500 memory slots (the rotor setting), this
script

* fills optmem's numpy table (``solve_persistent_table``, variants ``rotor`` and ``paper``),
* compiles ``benchmarks/reference/rotor_dp.c`` with ``gcc -O2`` into a temporary directory and
  runs it on the same discretised chain,
* checks that the ``rotor`` variant and the C code give bit-identical values for every memory
  value and the same plan, and prints the times and the ratios.

Usage::

    python benchmarks/bench_checkpoint_dp.py            # L = 100, 200, 339
    python benchmarks/bench_checkpoint_dp.py --quick    # L = 60, 100
    python benchmarks/bench_checkpoint_dp.py --lengths 100 --repeat 3 --markdown out.md
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optmem.chain import Chain  # noqa: E402
from optmem.datasets.synthetic import random_chain, resnet_like_chain  # noqa: E402
from optmem.plan import from_rotor_sequence  # noqa: E402
from optmem.problems.checkpoint import discretize  # noqa: E402
from optmem.solvers.checkpoint_dp import solve_persistent_table  # noqa: E402

REFERENCE = Path(__file__).resolve().parent / "reference" / "rotor_dp.c"
SLOTS = 500


def compile_reference(workdir: Path) -> Path | None:
    """Compile the C reference with ``gcc -O2``; ``None`` when gcc is missing."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    exe = workdir / "rotor_dp"
    subprocess.run([gcc, "-O2", "-o", str(exe), str(REFERENCE), "-lm"], check=True)
    return exe


def reference_input(chain: Chain, mmax: int, budget: int) -> str:
    """The chain in rotor's padded code convention (see rotor_dp.c)."""
    L = chain.length
    fw = [*chain.fwd_time, 0.0]
    bw = [*chain.bwd_time, chain.loss_bwd_time]
    x = [chain.input_size, *chain.output_size, 0]
    xbar = [chain.input_size, *chain.saved_size, 0]
    ftmp = [*chain.fwd_overhead, 0]
    btmp = [*chain.bwd_overhead, chain.loss_bwd_overhead]
    lines = [f"{L} {mmax} {budget}", " ".join(repr(float(v)) for v in fw),
             " ".join(repr(float(v)) for v in bw)]
    lines += [" ".join(str(int(v)) for v in arr) for arr in (x, xbar, ftmp, btmp)]
    return "\n".join(lines) + "\n"


def run_reference(exe: Path, chain: Chain, budget: int) -> tuple[float, float, np.ndarray, str]:
    """Run the C DP; returns (table time, wall time, top row, sequence)."""
    start = time.perf_counter()
    out = subprocess.run([str(exe)], input=reference_input(chain, budget, budget),
                         capture_output=True, text=True, check=True).stdout.splitlines()
    wall = time.perf_counter() - start
    row = np.array([float.fromhex(v) for v in out[1].split()])
    return float(out[0]), wall, row, out[2].strip()


def bench_chain(kind: str, length: int, seed: int) -> tuple[Chain, int]:
    """A realistic chain and a limit of a third of its store-all peak, discretised to S slots."""
    if kind == "resnet":
        chain = resnet_like_chain(length, seed=seed)
    else:  # heterogeneous: random shapes scaled to MB-sized activations and ms times
        small = random_chain(length, seed=seed, max_size=100, integer_times=False)
        chain = small.scaled(memory=1 << 20)
    disc = discretize(chain, chain.store_all_peak() // 3, SLOTS)
    limit = min(SLOTS, disc.memory_limit)  # rotor keeps exactly S slots
    return disc.chain, limit - disc.chain.input_size


def timed(fn, repeat: int):  # noqa: ANN001, ANN202 - tiny helper
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 60 and 100 only")
    parser.add_argument("--lengths", type=int, nargs="*", help="chain lengths")
    parser.add_argument("--kinds", nargs="*", default=["resnet", "random"],
                        choices=["resnet", "random"])
    parser.add_argument("--repeat", type=int, default=1, help="best of N runs")
    parser.add_argument("--no-reference", action="store_true", help="skip the C reference")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    lengths = args.lengths or ([60, 100] if args.quick else [100, 200, 339])

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = None if args.no_reference else compile_reference(Path(tmp))
        if exe is None and not args.no_reference:
            print("gcc not found: timing optmem only", file=sys.stderr)
        header = (f"{'chain':<8}{'L':>5}{'M':>5}  {'rotor (s)':>10}{'paper (s)':>10}"
                  f"{'C ref (s)':>10}{'C/rotor':>9}  identical")
        print(header)
        for kind in args.kinds:
            for length in lengths:
                chain, budget = bench_chain(kind, length, seed=length)
                t_rotor, table = timed(lambda c=chain, b=budget:
                                       solve_persistent_table(c, b, "rotor"), args.repeat)
                t_paper, paper = timed(lambda c=chain, b=budget:
                                       solve_persistent_table(c, b, "paper"), args.repeat)
                t_ref, same = float("nan"), "-"
                if exe is not None:
                    t_ref = float("inf")
                    for _ in range(args.repeat):
                        t_c, _, ref_row, ref_seq = run_reference(exe, chain, budget)
                        t_ref = min(t_ref, t_c)
                    ours = table.cost[1, chain.length + 1]
                    identical = ours.tobytes() == ref_row.tobytes()
                    if np.isfinite(table.value()):
                        plan_same = table.plan() == from_rotor_sequence(ref_seq, chain.length)
                    else:
                        plan_same = ref_seq == "inf"
                    same = "yes" if identical and plan_same else \
                        f"NO (values {identical}, plan {plan_same})"
                ratio = t_ref / t_rotor
                line = (f"{kind:<8}{length:>5}{budget + chain.input_size:>5}  {t_rotor:>10.2f}"
                        f"{t_paper:>10.2f}{t_ref:>10.2f}{ratio:>8.1f}x  {same}")
                print(line, flush=True)
                rows.append((kind, length, budget + chain.input_size, t_rotor, t_paper, t_ref,
                             ratio, same, table.value(), paper.value()))
    if args.markdown:
        write_markdown(args.markdown, rows, args.repeat)
    return 0 if all(r[7] in ("yes", "-") for r in rows) else 1


def write_markdown(path: Path, rows: list[tuple], repeat: int) -> None:
    """Write the measured table as markdown."""
    lines = [
        f"Machine: {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, numpy {np.__version__}; best of {repeat} run(s). "
        "Times fill the whole table (all memory values 0..M); the C time is measured inside "
        "the C program (table only).",
        "",
        "| chain | L | M (slots) | optmem rotor (s) | optmem paper (s) | C reference (s) "
        "| C / optmem | bit-identical values and plan | makespan rotor | makespan paper |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, length, m, t_rotor, t_paper, t_ref, ratio, same, v_rotor, v_paper in rows:
        lines.append(f"| {kind} | {length} | {m} | {t_rotor:.2f} | {t_paper:.2f} | {t_ref:.2f} "
                     f"| {ratio:.1f}x | {same} | {v_rotor:.3f} | {v_paper:.3f} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
