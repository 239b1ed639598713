"""More transformers families (``test_hf_zoo.ZOO``) at 60 %: predicted against real peaks.

For each tiny config of ``tests/test_hf_zoo.py`` (random init, nothing downloaded; default
dropout): the plain model's real activation peak of one training step, the profiled chain's
store-all peak, the limit (60 % of it), the plan's predicted peak, the real peak of one step
through the executor (``fast_path=False``), the allowance of ``docs/pytorch.md``, and
whether loss and gradients are bitwise the plain model's. Peaks are exact storage traces
(``optmem.pytorch.memory.measure_training_peak``), and the stage times are a fixed model
(``test_hf_zoo.fixed_times``: 1 ms forward, 2 ms backward per stage), so the plan, and
with it every figure, is the same on any machine and load. Until stop 84 the times were
measured (one repeat): sizes, store-all and limit did not depend on them, but the plan
did wherever several plans fit the limit at nearly the same modelled time, and with it
the predicted and real peaks, the allowance and real / plain (MobileViT: three plans in
13 runs, predicted 827.5, 899.6 or 906.7 KiB; ``benchmarks/results/hf_zoo.md``).

    PYTHONPATH=. python benchmarks/bench_hf_zoo.py [--markdown benchmarks/results/hf_zoo.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_helpers import step  # noqa: E402
from test_hf_zoo import ROUNDING, ZOO, fixed_times  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.memory import measure_training_peak, plan_allowance  # noqa: E402

KiB = 1024


def _same(got: tuple, ref: tuple) -> str:
    (out, grads), (rout, rgrads) = got, ref
    pairs = [(out.loss, rout.loss), (out.logits, rout.logits),
             *((a, b) for a, b in zip(grads, rgrads, strict=True) if a is not None)]
    if all(torch.equal(a, b) for a, b in pairs):
        return "bitwise"
    worst = max(float((a - b).abs().max()) for a, b in pairs)
    return f"max diff {worst:.1e}"


def row(name: str) -> str:
    """One family's line of the table."""
    model, kwargs = ZOO[name]()
    model.train()

    def peak(call) -> int:
        model.zero_grad(set_to_none=True)
        out = measure_training_peak(lambda: call(**kwargs).loss.backward(), model,
                                    list(kwargs.values()))
        model.zero_grad(set_to_none=True)
        return out

    plain = peak(model)
    cmodel = op.checkpoint(model, kwargs, memory_limit="60%", fast_path=False,
                           time_model=fixed_times)
    chain = cmodel.chain
    limit = int(0.6 * chain.store_all_peak())
    allowance = plan_allowance(chain, cmodel.result.plan, list(cmodel.stages))
    real = peak(cmodel)
    same = _same(step(cmodel, model, kwargs, seed=5), step(model, model, kwargs, seed=5))
    why = f" ({name}: see test_hf_zoo.ROUNDING)" if name in ROUNDING else ""
    return (f"| {name} | {chain.length} | {plain / KiB:.1f} | {chain.store_all_peak() / KiB:.1f}"
            f" | {limit / KiB:.1f} | {cmodel.expected_peak_bytes / KiB:.1f} | {real / KiB:.1f}"
            f" | {allowance / KiB:.1f} | {'yes' if real <= limit + allowance else 'NO'}"
            f" | {real / plain:.2f} | {same}{why} |")


def main() -> None:
    """Print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="write the report here")
    parser.add_argument("--families", help="comma-separated subset of the families")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.families.split(",") if args.families else sorted(ZOO)
    import transformers

    lines = [
        f"# {len(ZOO)} more transformers families at `memory_limit=\"60%\"`",
        "",
        f"Produced by `PYTHONPATH=. python benchmarks/bench_hf_zoo.py` on "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC (torch {torch.__version__}, "
        f"transformers {transformers.__version__}, CPU, 1 thread). The tiny configs of "
        "`tests/test_hf_zoo.py` (random init, default dropout), one training step each "
        "through the executor (`fast_path=False`). KiB; peaks are exact storage traces "
        "(`measure_training_peak`) and stage times a fixed model (`fixed_times`: 1 ms "
        "forward, 2 ms backward per stage), so every figure is independent of the "
        "machine's load. **plain**: the "
        "unwrapped model's real peak; **store-all**: the profiled chain's; **limit**: 60 % "
        "of it; **predicted**: the plan's simulated peak; **real**: the wrapped step's.",
        "",
        "| family | stages | plain | store-all | limit | predicted | real | allowance "
        "| real <= limit + allowance | real / plain | loss and gradients vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---|",
    ]
    for name in names:
        lines.append(row(name))
        print(lines[-1], flush=True)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
