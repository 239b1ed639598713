"""Does ``--time-limit`` hold on long chains? Wall time and peak memory of the limited methods.

    python benchmarks/bench_time_limits.py [--time-limit 10] [--base PATH] [--cap 120]
                                           [--quick] [--profiles NAME ...] [--out FILE.md]
                                           [--methods PROBLEM:METHOD ...]
                                           [--pipeline-memory 3GiB] [--strict] [--repeat 1]
                                           [--row-load]

Each exact method ``compare`` adds under a limit (stop 73: checkpoint ``ilp``, offload
``cpsat``, remat + offload ``ilp`` and ``cpsat``, pipeline ``chunks``) is run by the CLI,
``solve ... --time-limit T --json``, in its own process, on bundled profiles of 39, 68, 92
and 339 stages (50 % of the store-all peak, 12 GB/s; pipelines on 4 GPUs of 3 GiB). The
table gives the wall time of the whole command (interpreter start included), its ratio to
``T``, the process's peak RSS, and the answer (status, objective, bound, and
``report.stopped`` when the deadline stopped Python work, stop 74).

``--methods pipeline:madpipe pipeline:contiguous``: other methods than the five above
(stop 76); ``--pipeline-memory``: the pipelines' memory per GPU (``--strict``: their strict
memory model); ``--repeat N``: each
command N times, the cell of the median wall time (its RSS and answer); ``--row-load``: each
row's profile cell gets the 1-minute load average when the row started (stop 77: the
measurements share the machine with other jobs).

``--base PATH``: the same runs with the package at ``PATH`` (a checkout, e.g. ``git worktree
add /tmp/base <commit>``) side by side, each killed after ``--cap`` seconds (reported as
``> cap``; a run that exits with an error is reported with its last line). The baseline
of a time limit is the limit itself: a ratio above 1 is an overrun.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import print_and_write, uptime

PROFILES = ("resnet101-b32-224", "densenet121-b32-224", "densenet169-b16-500",
            "resnet1001-b8-224")
METHODS = (("checkpoint", "ilp"), ("offload", "cpsat"), ("remat-offload", "ilp"),
           ("remat-offload", "cpsat"), ("pipeline", "chunks"))
QUICK = PROFILES[:2]


def arguments(problem: str, pipeline_memory: str = "3GiB", strict: bool = False) -> list[str]:
    """The instance's CLI options (memory, link, GPUs, memory model)."""
    if problem == "pipeline":
        return ["--gpus", "4", "-m", pipeline_memory, "--bandwidth", "12GB/s",
                *(["--memory-model", "strict"] if strict else [])]
    if problem == "checkpoint":
        return ["-m", "50%"]
    return ["-m", "50%", "--bandwidth", "12GB/s"]


def run(root: str | None, problem: str, method: str, profile: str, limit: float, cap: float,
        pipeline_memory: str = "3GiB", strict: bool = False) -> dict[str, object]:
    """One CLI run: wall seconds, peak RSS (MiB), the JSON answer (``None`` if killed)."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = root
    cmd = [sys.executable, "-m", "optmem", "solve", problem, profile,
           *arguments(problem, pipeline_memory, strict),
           "--method", method, "--time-limit", str(limit), "--json"]
    began = time.perf_counter()
    # a forked runner per command: its RUSAGE_CHILDREN peak is that command's alone (the
    # parent's is the largest of every command run so far)
    pid = os.fork()
    if pid == 0:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=cap, env=env,
                                 cwd="/" if root is not None else None)
            stdout, code, error = out.stdout, out.returncode, out.stderr.strip()
        except subprocess.TimeoutExpired:
            stdout, code, error = "", None, ""
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        Path(f"/tmp/bench_time_limits.{os.getpid()}.json").write_text(json.dumps(
            {"stdout": stdout, "rss": rss, "code": code,
             "error": error.splitlines()[-1] if error else ""}))
        os._exit(0)
    os.waitpid(pid, 0)
    wall = time.perf_counter() - began
    path = Path(f"/tmp/bench_time_limits.{pid}.json")
    record = json.loads(path.read_text())
    path.unlink()
    try:
        answer = json.loads(record["stdout"]) if record["stdout"] else None
    except json.JSONDecodeError:
        answer = None
    return {"wall": wall, "rss": record["rss"], "answer": answer, "code": record["code"],
            "error": record["error"]}


def cell(out: dict[str, object], limit: float, cap: float) -> str:
    """``wall s (ratio x), RSS MiB: status objective / bound [stopped]``."""
    answer = out["answer"]
    if out["code"] is None:
        return f"> {cap:g} s (killed)"
    if not isinstance(answer, dict):
        wall = float(out["wall"])  # type: ignore[arg-type]
        return f"{wall:.1f} s, exit {out['code']}: {out['error']}"
    stopped = answer.get("report", {}).get("stopped") or ""
    objective, bound = answer.get("objective"), answer.get("bound")
    value = "-" if objective is None else f"{objective:.6g}"
    low = "-" if bound is None else f"{bound:.6g}"
    wall = float(out["wall"])  # type: ignore[arg-type]
    text = f"{wall:.1f} s ({wall / limit:.2f}x), {float(out['rss']):.0f} MiB: " \
        f"{answer['status']} {value} / {low}"  # type: ignore[arg-type]
    return text + (f" [{stopped}]" if stopped else "")


def median_run(root: str | None, problem: str, method: str, profile: str, limit: float,
               cap: float, pipeline_memory: str, repeat: int, strict: bool = False
               ) -> dict[str, object]:
    """:func:`run` ``repeat`` times; the run of the median wall time."""
    runs = [run(root, problem, method, profile, limit, cap, pipeline_memory, strict)
            for _ in range(repeat)]
    runs.sort(key=lambda out: float(out["wall"]))  # type: ignore[arg-type]
    return runs[(len(runs) - 1) // 2]


def table(profiles: tuple[str, ...], limit: float, base: str | None, cap: float,
          methods: tuple[tuple[str, str], ...] = METHODS, pipeline_memory: str = "3GiB",
          repeat: int = 1, strict: bool = False, row_load: bool = False) -> str:
    """The Markdown table, one row per (profile, method); the baseline's column if asked.

    ``row_load``: the profile cell names the 1-minute load average as the row starts.
    """
    head = "| profile | problem, method | this checkout |" + (" base |" if base else "")
    rows = [head, "|---|---|---|" + ("---|" if base else "")]
    for profile in profiles:
        for problem, method in methods:
            name = f"{profile} (load {os.getloadavg()[0]:.1f})" if row_load else profile
            mine = cell(median_run(None, problem, method, profile, limit, cap,
                                   pipeline_memory, repeat, strict), limit, cap)
            row = f"| {name} | {problem} {method} | {mine} |"
            if base:
                theirs = median_run(base, problem, method, profile, limit, cap,
                                    pipeline_memory, repeat, strict)
                row += f" {cell(theirs, limit, cap)} |"
            rows.append(row)
            print(row, flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--base", default=None, help="a checkout to run side by side")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds before a kill")
    parser.add_argument("--quick", action="store_true", help="L = 39 and 68 only")
    parser.add_argument("--profiles", nargs="+", default=None, help="bundled profiles to run")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="PROBLEM:METHOD pairs instead of the five exact methods")
    parser.add_argument("--pipeline-memory", default="3GiB", help="memory per GPU")
    parser.add_argument("--strict", action="store_true", help="strict pipeline memory model")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell (median)")
    parser.add_argument("--row-load", action="store_true",
                        help="each row's load average in its profile cell")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    began = uptime()
    profiles = tuple(args.profiles) if args.profiles else QUICK if args.quick else PROFILES
    methods = METHODS if not args.methods else tuple(
        tuple(pair.split(":", 1)) for pair in args.methods)
    text = table(profiles, args.time_limit, args.base, args.cap, methods,  # type: ignore[arg-type]
                 args.pipeline_memory, args.repeat, args.strict, args.row_load)
    model = " (strict)" if args.strict else ""
    print_and_write(f"time limit {args.time_limit:g} s, pipelines at {args.pipeline_memory}"
                    f"{model}, "
                    f"median of {args.repeat}; load {began} before, {uptime()} after\n\n"
                    f"{text}\n", args.out)


if __name__ == "__main__":
    main()
