"""How often a finished torchrun job fails at exit on CPU (gloo), with and without ``end_process``.

    python benchmarks/bench_exit_race.py [--runs 20] [--busy 1] [--out FILE.md]

DDP keeps gloo's process group alive past ``destroy_process_group()``, and a rank can abort
in the interpreter's finalisation with "terminate called without an active exception" after
the script's last line; torchrun then reports the job as failed (docs/distributed.md).
``examples/ddp_checkpoint.py`` ends with ``op.end_process()``, which skips that
finalisation. Each round launches the example twice, alternated: as it is, and a copy with
that one line removed (the script as it was before, the baseline). ``--busy`` starts that
many busy-loop processes for the whole run (the abort needs a loaded machine). A run counts
as the race when torchrun's exit code is not 0 and its output holds that line; any other
failure is counted apart. This is a count, not a timing: the load only changes how often the
race shows, so the two variants are compared within one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_checkpoint.py"
ARGS = ["--steps", "2", "--width", "16", "--depth", "4"]
RACE = "terminate called without an active exception"
FIX = "op.end_process()"


def baseline_copy(folder: Path) -> Path:
    """The example without its ``op.end_process()`` line (beside a copy of its helpers)."""
    for path in EXAMPLE.parent.glob("*.py"):
        (folder / path.name).write_text(path.read_text())
    lines = EXAMPLE.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip().split("  #")[0] != FIX]
    if len(kept) != len(lines) - 1:
        raise SystemExit(f"{EXAMPLE} should have exactly one line {FIX!r}")
    out = folder / "ddp_checkpoint_baseline.py"
    out.write_text("".join(kept))
    return out


def launch(script: Path) -> str:
    """``ok``, ``race`` or ``other`` for one torchrun launch of ``script`` on 2 ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", str(script), *ARGS]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    if proc.returncode == 0:
        return "ok"
    return "race" if RACE in proc.stderr else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="launches of each variant")
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "exit_race.md"))
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    counts: dict[str, dict[str, int]] = {v: {"ok": 0, "race": 0, "other": 0}
                                         for v in ("baseline", "end_process")}
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scripts = {"baseline": baseline_copy(Path(tmp)), "end_process": EXAMPLE}
            for k in range(args.runs):
                for variant, script in scripts.items():
                    counts[variant][launch(script)] += 1
                print(f"round {k + 1}: {counts}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
    rows = [f"| {v} | {args.runs} | {c['race']} | {c['other']} | {c['ok']} |"
            for v, c in counts.items()]
    text = "\n".join([
        "# Exit race of gloo: finished torchrun jobs that fail at exit",
        "",
        f"Produced by `python benchmarks/bench_exit_race.py --runs {args.runs} --busy "
        f"{args.busy}` ({start}; load average {load_start:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end; 2 shared cores). `torchrun --nproc_per_node 2 "
        f"examples/ddp_checkpoint.py {' '.join(ARGS)}`, as it is (`end_process`) and without "
        f"its `{FIX}` line (`baseline`), alternated.",
        "",
        "| variant | runs | aborted at exit (the race) | other failures | exit 0 |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
