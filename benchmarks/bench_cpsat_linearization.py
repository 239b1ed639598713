"""CP-SAT's linearization level on the checkpoint, offload and remat + offload models.

Each instance is solved with ``method="cpsat"`` twice in one process, interleaved: at
CP-SAT's default ``linearization_level`` (1, the code before stop 50) and at level 2 (the
checkpoint model's :data:`optmem.solvers.checkpoint_exact.CPSAT_PARAMETERS` now). The level
is set on every CP-SAT call of the solve (a wrapper of
:func:`optmem.engines.adapters.solve_cpsat`), one CP-SAT worker, seed 0, a deterministic
work limit per call (``--work``): the verdicts, objectives and bounds are the same on any
machine; the CPU seconds are not.

Parts (``--parts``):

* ``small``: the 16 chains ``compare`` runs CP-SAT on by default (random L = 6..12 and four
  small networks at 10 % and 30 %; ``bench_checkpoint_exact.cpsat_instances``);
* ``random``: ``random_chain(L, seed)`` for L = 16, 20, 24, 30 and seeds 1-5 at 10 % and
  30 % of the way from the persistent DP's least memory to store-all (40 chains);
* ``big``: bundled networks of 22-68 stages at 10, 30 and 60 % of the way from the smallest
  feasible memory to store-all (``bench_checkpoint_exact._zoo_limit``);
* ``offload``, ``remat``: ``bench_exact.py``'s offload and remat + offload instances
  (ResNet-18, ResNet-50 at 10, 30, 60 %, 12 GB/s).

Run: ``python benchmarks/bench_cpsat_linearization.py [--parts small big] [--work 60]
[--out F]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from optmem.datasets import load_dataset
from optmem.datasets.synthetic import random_chain
from optmem.engines import adapters
from optmem.problems.checkpoint import CheckpointProblem
from optmem.result import Result, SolveOptions
from optmem.solvers.facade import solve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import uptime  # noqa: E402
from bench_checkpoint_exact import _limit, _zoo_limit, cpsat_instances  # noqa: E402
from bench_exact import SETTINGS  # noqa: E402

LEVELS = (1, 2)
BIG = (("resnet50-b32-224", (0.1, 0.3, 0.6)), ("inception3-b32-299", (0.3,)),
       ("gpt2-medium-b4-1024", (0.3,)), ("resnet101-b32-224", (0.1, 0.3, 0.6)),
       ("gpt2-large-b2-1024", (0.3,)), ("resnet152-b32-224", (0.1, 0.3, 0.6)),
       ("densenet121-b32-224", (0.3,)))
REMAT_PROFILES = ("resnet18-b64-224", "resnet50-b32-224")
RANDOM_LENGTHS = (16, 20, 24, 30)


@contextmanager
def level(value: int) -> Iterator[None]:
    """Every CP-SAT call inside runs at ``linearization_level = value``."""
    real = adapters.solve_cpsat

    def at_level(*args: Any, parameters: dict[str, Any] | None = None, **kw: Any) -> Any:
        return real(*args, parameters={**(parameters or {}), "linearization_level": value},
                    **kw)

    adapters.solve_cpsat = at_level  # type: ignore[assignment]
    try:
        yield
    finally:
        adapters.solve_cpsat = real  # type: ignore[assignment]


def timed(problem: Any, work: float, value: int) -> tuple[Result, float]:
    """``cpsat`` on ``problem`` at level ``value``: the result and its CPU seconds."""
    opts = SolveOptions(threads=1, seed=0, deterministic_time=work)
    with level(value):
        cpu = time.process_time()
        res = solve(problem, "cpsat", options=opts)
        return res, time.process_time() - cpu


def cell(res: Result, cpu: float) -> str:
    """``status objective / bound (gap), CPU s``."""
    if not res.status.has_plan:
        return f"{res.status} | - | - | {cpu:.1f}"
    return (f"{res.status} | {res.objective:.4f} / {res.bound:.4f} | "
            f"{100 * res.gap:.2f} % | {cpu:.1f}")


HEADER = ["| instance | L | " + " | ".join(
    f"level {v}: status | objective / bound | gap | CPU s" for v in LEVELS) + " |",
          "|---|---|" + "---|---|---|---|" * len(LEVELS)]


def rows(instances: Iterator[tuple[str, Any]], work: float) -> list[str]:
    """One row per instance, both levels side by side (printed as they come)."""
    out = list(HEADER)
    for label, problem in instances:
        cells = [cell(*timed(problem, work, v)) for v in LEVELS]
        out.append(f"| {label} | {problem.chain.length} | " + " | ".join(cells) + " |")
        print(out[-1], flush=True)
    return out


def big_instances() -> Iterator[tuple[str, CheckpointProblem]]:
    """Bundled networks of 22-68 stages at their fractions (:data:`BIG`)."""
    for name, fracs in BIG:
        chain = load_dataset(name)
        for frac in fracs:
            yield f"{name} {int(100 * frac)} %", CheckpointProblem(chain, _zoo_limit(name, frac))


def random_instances() -> Iterator[tuple[str, CheckpointProblem]]:
    """Random chains of 16-30 stages (:data:`RANDOM_LENGTHS`, seeds 1-5, 10 % and 30 %)."""
    for length in RANDOM_LENGTHS:
        for seed in range(1, 6):
            chain = random_chain(length, seed=seed)
            for frac in (0.1, 0.3):
                yield (f"random L={length} seed {seed} {int(100 * frac)} %",
                       CheckpointProblem(chain, _limit(chain, frac)))


def setting_instances(problem: str) -> Callable[[], Iterator[tuple[str, Any]]]:
    """``bench_exact.py``'s instances of ``problem`` on :data:`REMAT_PROFILES`."""

    def make() -> Iterator[tuple[str, Any]]:
        for name in REMAT_PROFILES:
            for frac, inst in SETTINGS[problem].instances(name):
                yield f"{name} {frac}", inst

    return make


PARTS: dict[str, Callable[[], Iterator[tuple[str, Any]]]] = {
    "small": lambda: iter(cpsat_instances(False)),
    "random": random_instances,
    "big": big_instances,
    "offload": setting_instances("offload"),
    "remat": setting_instances("remat-offload"),
}


def main() -> None:
    """Run the parts and write the Markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["small", "big"], choices=list(PARTS))
    parser.add_argument("--work", type=float, default=60.0,
                        help="deterministic seconds per CP-SAT call (default 60)")
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    args = parser.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# CP-SAT linearization level 1 against 2 ({when})", "",
             f"One worker, seed 0, {args.work:g} deterministic s per CP-SAT call; "
             f"load at start {uptime()}.", ""]
    for part in args.parts:
        print(f"## {part}", flush=True)
        lines += [f"## {part}", "", *rows(PARTS[part](), args.work), ""]
    lines.append(f"Load at the end: {uptime()}.")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
