"""``retain_graph=True`` and double backward through the one-liners: exact peaks, gradients.

Stop 81. For each model and executor, three training steps, run on the plain model and on
the wrapper (same initialisation, same dropout seed):

* ``normal``: ``loss.backward()``;
* ``retain``: two losses on one output, ``loss1.backward(retain_graph=True)`` then
  ``loss2.backward()``;
* ``penalty``: a gradient penalty, ``autograd.grad(..., create_graph=True)`` then the
  backward of the penalty (WGAN-GP on the toy's input; the squared gradients of three
  weights on GPT-2, whose input is token ids).

Each step's exact activation peak (:func:`optmem.pytorch.memory.measure_training_peak`, the
offload executor's host copies left out: what stays on the compute device) and the largest
parameter-gradient difference from the plain model. A step the wrapper refuses (before
stop 81: ``retain`` and ``penalty``) prints ``refused``. Plans come from a constant time
model (``time_model``): nothing here depends on timing.

Usage::

    PYTHONPATH=. python benchmarks/bench_retain_graph.py [--markdown FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from hf_helpers import gpt2  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.memory import measure_training_peak  # noqa: E402

Step = Callable[[Any, nn.Module], None]


def _toy() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1))
              for _ in range(12)]
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    return nn.Sequential(*blocks, nn.Linear(256, 10)), {"x": x}


def _gpt2() -> tuple[nn.Module, dict[str, Any]]:
    return gpt2(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)


def _call(f: Any, inputs: dict[str, Any]) -> Any:
    return f(inputs["x"]) if "x" in inputs else f(**inputs)


def _loss(out: Any) -> torch.Tensor:
    return out.square().mean() if isinstance(out, torch.Tensor) else out.loss


def _second(out: Any) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits.float().sin().mean()


def normal(f: Any, model: nn.Module, inputs: dict[str, Any]) -> None:
    _loss(_call(f, inputs)).backward()


def retain(f: Any, model: nn.Module, inputs: dict[str, Any]) -> None:
    out = _call(f, inputs)
    _loss(out).backward(retain_graph=True)
    _second(out).backward()


def penalty(f: Any, model: nn.Module, inputs: dict[str, Any]) -> None:
    if "x" in inputs:
        x = inputs["x"].clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        (g.norm() ** 2).backward()
        return
    params = dict(model.named_parameters())
    some = [params[k] for k in ("transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight",
                                "transformer.h.1.attn.c_attn.weight")]
    grads = torch.autograd.grad(_call(f, inputs).loss, some, create_graph=True)
    sum(g.square().sum() for g in grads).backward()


STEPS = {"normal": normal, "retain": retain, "penalty": penalty}
MODELS = {"toy MLP (12 x 256, batch 64)": _toy, "GPT-2 tiny (exported)": _gpt2}
KINDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "checkpoint": (op.checkpoint, {}),
    "remat_offload": (op.remat_offload, {"bandwidth": "20MB/s"}),
}


def _measure(f: Any, model: nn.Module, inputs: dict[str, Any], step: Any
             ) -> tuple[int | str, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    try:
        peak: int | str = measure_training_peak(lambda: step(f, model, inputs), model,
                                                tuple(inputs.values()), host_copies=False)
    except RuntimeError as exc:
        peak = f"refused ({str(exc)[:40]}...)"
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return peak, grads


def _diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> str:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return "differs (None)"
        if x is not None:
            worst = max(worst, (x - y).abs().max().item())  # type: ignore[operator]
    return "0 (bitwise)" if worst == 0 else f"{worst:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    branch = subprocess.run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=HERE,
                            capture_output=True, text=True, check=False).stdout.strip()
    lines = [f"branch {branch}, torch {torch.__version__}, 1 thread; peaks in bytes "
             "(exact, `measure_training_peak`, host copies left out)", "",
             "| model | executor | step | plain peak | wrapper peak | wrapper / plain | "
             "largest gradient difference |", "|---|---|---|---|---|---|---|"]
    for model_name, factory in MODELS.items():
        for kind_name, (kind, options) in KINDS.items():
            plain, inputs = factory()
            model, _ = factory()
            sample = inputs.get("x", inputs)
            wrapper = kind(model, sample, memory_limit="60%", repeats=1, warmup=0,
                           time_model=lambda *_: (1.0, 2.0), fast_path=False, **options)
            for step_name, step in STEPS.items():
                ref, want = _measure(plain, plain, inputs, step)
                got, grads = _measure(wrapper, model, inputs, step)
                ratio = f"{got / ref:.2f}" if isinstance(got, int) and isinstance(ref, int) \
                    else "-"
                diff = _diff(grads, want) if isinstance(got, int) else "-"
                lines.append(f"| {model_name} | {kind_name} | {step_name} | {ref} | {got} | "
                             f"{ratio} | {diff} |")
                print(lines[-1], flush=True)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
