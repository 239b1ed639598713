"""Min-peak (Hong et al.) and sweeps: timings, ratios against baselines, the README pictures.

Prints, for bundled chains:

* the least peak under Hong's PyTorch model (Alg. 6 / Alg. 5), the static model (Alg. 3)
  and optmem's accounting, with DP and ILP times, and the ratio of Chen's sqrt(n) set and of
  "every tensor a checkpoint" to the optimum;
* for the optmem model, the least memory of single-pass plans against the rotor DP's
  smallest feasible memory (nested recomputation) and the store-all peak;
* the time of a 20-limit DP sweep (the curve of ``docs/img``).

``--quick`` runs two chains and skips the ILP; ``--pictures DIR`` regenerates the figures.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from optmem.datasets import resolve_chain
from optmem.problems import CheckpointProblem
from optmem.problems.min_peak import MinPeakProblem
from optmem.result import SolveOptions
from optmem.solvers.checkpoint_dp import min_memory_persistent
from optmem.solvers.facade import solve
from optmem.sweep import CheckpointFactory, parse_memory_range, sweep
from optmem.units import format_size

CHAINS = ["resnet-like-40", "resnet50-b32-224", "vgg19-b64-224", "resnet101-b32-224",
          "gpt2-small-b8-1024", "resnet1001-b1-224"]
QUICK = ["resnet-like-40", "vgg19-b64-224"]


def timed(problem, method: str, options: SolveOptions | None = None):
    start = time.perf_counter()
    r = solve(problem, method, options=options)
    return r, time.perf_counter() - start


def bench_min_peak(names: list[str], ilp: bool) -> None:
    timed(MinPeakProblem(resolve_chain(names[0])), "dp")  # warm-up: loads the method modules
    print("== least peak (min-peak dp) and baselines, ratio = baseline / optimum")
    print(f"{'chain':<20} {'L':>4} {'model':<8} {'optimum':>11} {'dp ms':>8} {'variant':<9} "
          f"{'ilp s':>7} {'chen':>6} {'every':>6} {'#ckpt':>5}")
    for name in names:
        chain = resolve_chain(name)
        for model in ("pytorch", "static", "optmem"):
            p = MinPeakProblem(chain, model=model)
            variants = ["linear", "quadratic"] if model == "pytorch" else [None]
            for variant in variants:
                r, t = timed(p, "dp", SolveOptions(variant=variant))
                chen, _ = timed(p, "chen")
                every, _ = timed(p, "every")
                ilp_t = "-"
                if ilp and chain.length <= 40 and variant != "quadratic":
                    ri, ti = timed(p, "ilp", SolveOptions(time_limit_s=120))
                    ok = ri.status.value == "optimal" and ri.objective == r.objective
                    ilp_t = f"{ti:.1f}" + ("" if ok else f"({ri.status.value})")
                print(f"{name:<20} {chain.length:>4} {model:<8} "
                      f"{format_size(r.objective):>11} {t * 1e3:>8.2f} {r.variant or '':<9} "
                      f"{ilp_t:>7} {chen.objective / r.objective:>6.3f} "
                      f"{every.objective / r.objective:>6.3f} "
                      f"{len(r.report['checkpoints']):>5}")


def bench_vs_rotor(names: list[str]) -> None:
    print("\n== optmem accounting: single-pass (Hong class) vs rotor persistent DP vs store-all")
    print(f"{'chain':<20} {'single-pass min':>15} {'rotor min':>11} {'ratio':>6} "
          f"{'store-all':>11} {'its makespan / no-recompute':>28}")
    for name in names:
        chain = resolve_chain(name)
        r = solve(MinPeakProblem(chain, model="optmem"), "dp")
        rotor = min_memory_persistent(chain)
        mk = r.report["checkpoint_plan_makespan"] / chain.total_compute_time()
        print(f"{name:<20} {format_size(r.objective):>15} {format_size(rotor):>11} "
              f"{r.objective / rotor:>6.2f} {format_size(chain.store_all_peak()):>11} "
              f"{mk:>28.3f}")


def bench_sweep(names: list[str]) -> None:
    print("\n== DP sweep, 20 limits from the smallest feasible memory to the store-all peak")
    for name in names:
        chain = resolve_chain(name)
        limits = parse_memory_range("auto:20", chain)
        res = sweep(CheckpointFactory(chain), limits, ["dp"], jobs=2)
        front = res.fronts()["dp"]
        first = front[0]
        print(f"{name:<20} L={chain.length:<4} {res.wall_time_s:6.1f} s, {len(front)} front "
              f"points, {format_size(first.memory)} -> {first.objective:.1f} ms, store-all "
              f"{front[-1].objective:.1f} ms")


def pictures(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    chain = resolve_chain("resnet50-b32-224")
    limits = parse_memory_range("auto:24", chain)
    res = sweep(CheckpointFactory(chain), limits,
                ["dp", "chen", "sequential", "revolve", "store_all"], jobs=2)
    res.plot(out / "sweep-resnet50-b32-224.png")
    res.write_json(out / "sweep-resnet50-b32-224.json")
    print(f"sweep picture: {res.wall_time_s:.1f} s")
    from optmem.show import show_plan

    limit = limits[len(limits) // 4]
    r = solve(CheckpointProblem(chain, limit), "dp")
    show_plan(chain, r.to_json(), out / "plan-resnet50-b32-224.png")
    hong = solve(MinPeakProblem(chain, model="optmem"), "dp")
    show_plan(chain, hong.to_json(), out / "plan-min-peak-resnet50-b32-224.png",
              title=f"{chain.name}: least-peak single-pass plan (min-peak, optmem model, "
                    f"{len(hong.report['checkpoints']) - 2} checkpoints)")
    try:
        off = solve(_offload(chain, int(chain.store_all_peak() * 0.6)), "auto")
        if off.status.has_plan:
            show_plan(chain, {**off.to_json(), "bandwidth": 12e6},
                      out / "plan-offload-resnet50-b32-224.png")
    except Exception as exc:  # noqa: BLE001 - optional picture
        print(f"offload picture skipped: {exc}")


def _offload(chain, limit: int):
    from optmem.problems.offload import OffloadProblem

    return OffloadProblem(chain, limit, chain_bandwidth=12e6)  # 12 GB/s in bytes per ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pictures", type=Path)
    args = ap.parse_args()
    names = QUICK if args.quick else CHAINS
    bench_min_peak(names, ilp=not args.quick)
    bench_vs_rotor(names)
    bench_sweep(names[:2] if args.quick else names[:4])
    if args.pictures:
        pictures(args.pictures)


if __name__ == "__main__":
    main()
