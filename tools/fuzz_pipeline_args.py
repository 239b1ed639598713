"""Fuzz ``op.pipeline`` and ``op.PipelinedModel``'s own arguments (stop 85): one at a time.

The sibling of ``tools/fuzz_bridge_args.py`` (stop 84) for the pipeline entries, which need a
process group. Every rank makes the same call with one bad value; the oracle per call:

1. it works, or raises one ``OptmemInputError`` naming the argument, on EVERY rank (the
   same message), with no ``TypeError``/``ValueError``/... from inside optmem, and no rank
   hanging (a per-call alarm here, the group's timeout as the backstop);
2. after an error the model is exactly as before (``fuzz_bridge_args.snapshot``: state,
   ``requires_grad``, ``.grad``, training flags, hooks, attributes, RNG, global state), and
   the process group still works (an ``all_reduce`` after the call);
3. an accepted value is listed (``--accepted``) to be judged by hand.

Run: ``PYTHONPATH=. python tools/fuzz_pipeline_args.py [--world 1|2] [--gpt2] [--only NAME]
[--entry pipeline|PipelinedModel] [--accepted] [--out FILE]``
(``--only a,b``: those arguments); world 1 runs in this process, world 2
spawns two gloo ranks (rank 0 prints).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import sys
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_bridge_args import NASTY, Hang, classify, gpt2, same, snapshot  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.chain import Chain  # noqa: E402
from optmem.errors import OptmemInputError  # noqa: E402

torch.set_num_threads(1)
ALARM_S = 60


def mlp() -> tuple[nn.Module, Any]:
    """A 4-layer ``nn.Sequential`` MLP and one micro-batch (2 rows)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)), \
        torch.randn(2, 8)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The MLP's loss."""
    return nn.functional.mse_loss(out, target)


def _small_gpt2() -> tuple[nn.Module, Any]:
    model, batch = gpt2()
    return model, {k: v[:1] for k, v in batch.items()}


FAST = dict(repeats=1, warmup=0, memory_per_gpu="1GiB")
PIPELINE_ARGS = ["gpus", "memory_per_gpu", "bandwidth", "loss_fn", "microbatches", "method",
                 "weight_copies", "memory_model", "temporaries", "max_stages", "time_limit_s",
                 "device", "repeats", "warmup", "time_model", "progress", "extract", "sample"]
MODEL_ARGS = ["plan", "sample", "microbatches", "loss_fn", "device", "scale_grads",
              "schedule_csv", "extract"]
EXTRA_VALUES: dict[str, list[tuple[str, Any]]] = {
    "method": [("'nope'", "nope"), ("'dp'", "dp")],
    "memory_model": [("'nope'", "nope")],
    "device": [("'gpu0'", "gpu0"), ("'cuda:99'", "cuda:99"), ("'meta'", "meta")],
    "time_model": [("a string", "a100")],
    "schedule_csv": [("a missing file", "/tmp/nope_schedule.csv")],
    "plan": [("a chain", Chain.from_lists([1.0] * 3, [1.0] * 3, [4] * 3, [4] * 3,
                                         input_size=4)),
             ("ops", ["F1", "B1"])],
}


def _plan_for(model: nn.Module, sample: Any, world: int, loss: Any) -> Any:
    """A good plan of ``model`` (from ``op.pipeline`` itself)."""
    return op.pipeline(model, sample, gpus=world, loss_fn=loss, **FAST).plan


def call(entry: str, name: str, value: Any, model: nn.Module, sample: Any, world: int,
         plan: Any) -> Any:
    """``entry`` with ``name=value`` (everything else good)."""
    loss = mse if isinstance(model, nn.Sequential) else None
    if entry == "pipeline":
        kw: dict[str, Any] = {"loss_fn": loss, **FAST}
        if name == "sample":
            return op.pipeline(model, value, **kw)
        kw[name] = value
        return op.pipeline(model, sample, **kw)
    kw = {"plan": plan, "loss_fn": loss, "sample": None if loss else sample}
    kw[name] = value
    return op.PipelinedModel(model, kw.pop("plan"), **kw)


def judge(rank: int, entry: str, make: Any, name: str, label: str, value: Any, world: int,
          plans: dict[str, Any]) -> tuple[str, str]:
    """One call, judged: ``(outcome, detail)`` on this rank."""
    model, sample = make()
    before = snapshot(model)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    outcome, detail = "ok", ""
    try:
        call(entry, name, value, model, sample, world, plans.get(make.__name__))
    except OptmemInputError as exc:
        outcome, detail = "input_error", str(exc)[:240]
        if name not in str(exc) and (exc.field or "") != name:
            outcome = "unnamed"
    except Hang:
        outcome = "hang"
    except Exception as exc:  # noqa: BLE001
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = classify(exc)
        detail = f"{str(exc)[:160]} [{tb.filename.split('/')[-1]}:{tb.lineno}]"
    finally:
        signal.alarm(0)
    if outcome != "ok":
        diffs = same(before, snapshot(model))
        if diffs:
            detail += f" STATE {diffs}"
            outcome += "+state"
    signal.alarm(ALARM_S)
    try:
        t = torch.ones(1)
        dist.all_reduce(t)
        if t.item() != world:
            outcome += "+group"
    except Exception:  # noqa: BLE001
        outcome += "+group"
    finally:
        signal.alarm(0)
    return outcome, detail


def _alarm(*_: Any) -> None:
    raise Hang(f"over {ALARM_S} s")


def fuzz(rank: int, world: int, opts: dict[str, Any]) -> None:
    """Every entry, model, argument and nasty value on this rank; rank 0 prints."""
    torch.set_num_threads(1)
    makes = [_small_gpt2] if opts["gpt2"] else [mlp]
    plans = {m.__name__: _plan_for(*m(), world, mse if m is mlp else None) for m in makes}
    results: collections.Counter = collections.Counter()
    lines: list[str] = []
    calls = 0
    for entry, names in (("pipeline", PIPELINE_ARGS), ("PipelinedModel", MODEL_ARGS)):
        if opts["entry"] and entry != opts["entry"]:
            continue
        for make in makes:
            for name in names:
                if opts["only"] and name not in opts["only"].split(","):
                    continue
                for label, value in NASTY + EXTRA_VALUES.get(name, []):
                    calls += 1
                    outcome, detail = judge(rank, entry, make, name, label, value, world,
                                            plans)
                    agreed = _agree(f"{outcome}|{detail}", world)
                    if not agreed:
                        outcome += "+ranks_differ"
                    results[outcome] += 1
                    where = f"{entry}({make.__name__}, {name}={label})"
                    if outcome != "input_error" and (outcome != "ok" or opts["accepted"]):
                        lines.append(f"{where}: {outcome}: {detail}")
                    if rank == 0:  # main: schedule_csv=np.int64(2) closed stderr
                        with contextlib.suppress(OSError, ValueError):
                            print(calls, where, outcome, flush=True, file=sys.stderr)
    if rank == 0:  # a fresh file: a bad schedule_csv (True, 0, 2) closed fd 1, 0 or 2
        with open(opts["out"], "w") as fh:
            fh.write(f"world {world}, calls {calls}: {dict(results)}\n")
            fh.writelines(line + "\n" for line in lines)


def _agree(text: str, world: int) -> bool:
    """Whether every rank got the same outcome (the texts are gathered)."""
    if world == 1:
        return True
    got: list[Any] = [None] * world
    dist.all_gather_object(got, text)
    return all(g == got[0] for g in got)


def _spawned(rank: int, world: int, opts: dict[str, Any]) -> None:
    fuzz(rank, world, opts)


def main() -> None:
    """Parse the options; fuzz on one rank here or on two spawned gloo ranks."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--gpt2", action="store_true")
    parser.add_argument("--only", default=None)
    parser.add_argument("--entry", default=None)
    parser.add_argument("--accepted", action="store_true")
    parser.add_argument("--out", default="fuzz_pipeline_args.txt", help="the report")
    args = parser.parse_args()
    opts = {"gpt2": args.gpt2, "only": args.only, "entry": args.entry,
            "accepted": args.accepted, "out": os.path.abspath(args.out)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.world == 1:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                                    world_size=1)
            fuzz(0, 1, opts)
            dist.destroy_process_group()
        else:
            from optmem.pytorch.distributed import spawn

            spawn(_spawned, args.world, opts, init_file=f"{tmp}/rendezvous", timeout_s=120.0,
                  deadline_s=None)


if __name__ == "__main__":
    main()
