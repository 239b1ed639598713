"""Fuzz the torch bridge's own arguments (stop 84): one argument at a time, nasty values.

Oracle per call: it works, or raises one ``OptmemInputError`` naming the argument; after an
error the model is exactly as before (state, flags, hooks, attributes, RNG, global state);
an accepted value is honoured (checked by hand for the flagged ones).

Run: ``PYTHONPATH=. python tools/fuzz_bridge_args.py [--gpt2] [--only NAME]``.
"""

from __future__ import annotations

import argparse
import collections
import math
import signal
import sys
import traceback
from typing import Any

import numpy as np
import torch
from torch import nn

import optmem.pytorch as op
from optmem.chain import Chain
from optmem.errors import OptmemInputError

torch.set_num_threads(1)

NASTY: list[tuple[str, Any]] = [
    ("None", None), ("-1", -1), ("0", 0), ("0.5", 0.5), ("nan", math.nan), ("inf", math.inf),
    ("-inf", -math.inf), ("True", True), ("False", False), ("np.int64(2)", np.int64(2)),
    ("np.float32(1.5)", np.float32(1.5)), ("2**70", 2**70), ("'abc'", "abc"), ("''", ""),
    ("'150%'", "150%"), ("'-5%'", "-5%"), ("'0%'", "0%"), ("'1e3GiB'", "1e3GiB"),
    ("'12 GB'", "12 GB"), ("'nan%'", "nan%"), ("[1]", [1]), ("{}", {}), ("{'a': 1}", {"a": 1}),
    ("-5", -5), ("3", 3), ("1e300", 1e300),
]


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a failed call must leave as it was."""
    from torch.nn.modules import module as mm
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mods = dict(model.named_modules(remove_duplicate=False))
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "req": {k: p.requires_grad for k, p in model.named_parameters()},
        "grad": {k: None if p.grad is None else p.grad.clone()
                 for k, p in model.named_parameters()},
        "pid": {k: id(p) for k, p in model.named_parameters()},
        "training": {k: m.training for k, m in mods.items()},
        "hooks": {k: (tuple(m._forward_hooks), tuple(m._forward_pre_hooks),
                      tuple(m._backward_hooks), tuple(m._backward_pre_hooks),
                      tuple(m._state_dict_hooks), tuple(m._load_state_dict_pre_hooks))
                  for k, m in mods.items()},
        "attrs": {k: tuple(sorted(m.__dict__)) for k, m in mods.items()},
        "rng": torch.get_rng_state().clone(),
        "global": (len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks),
                   len(mm._global_backward_hooks), len(mm._global_backward_pre_hooks),
                   len(_get_current_dispatch_mode_stack()), torch.is_grad_enabled(),
                   torch.is_inference_mode_enabled()),
        "class": type(model),
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The names of the parts that differ."""
    diffs = []
    for key in a:
        x, y = a[key], b[key]
        if key == "state" or key == "grad":
            if x.keys() != y.keys() or any(
                    (x[k] is None) != (y[k] is None) or (x[k] is not None and not (
                        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                        and torch.equal(x[k], y[k]))) for k in x):
                diffs.append(key)
        elif key == "rng":
            if not torch.equal(x, y):
                diffs.append(key)
        elif x != y:
            diffs.append(key)
    return diffs


def mlp() -> tuple[nn.Module, Any]:
    """A 3-stage ``nn.Sequential`` MLP and its sample."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)


class Net(nn.Module):
    """A non-Sequential MLP (exported)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def net() -> tuple[nn.Module, Any]:
    """The same MLP as a plain module (exported) and its sample."""
    torch.manual_seed(0)
    return Net(), torch.randn(4, 8)


def gpt2() -> tuple[nn.Module, Any]:
    """A tiny GPT-2 (random init, ``tests/hf_helpers.py``) and its batch."""
    sys.path.insert(0, "tests")
    import hf_helpers

    return hf_helpers.gpt2()


FAST = dict(repeats=1, warmup=0)
ENTRY = {
    "checkpoint": lambda m, s, **kw: op.checkpoint(m, s, **{"memory_limit": "100%", **FAST, **kw}),
    "offload": lambda m, s, **kw: op.offload(m, s, **{"memory_limit": "100%", **FAST, **kw}),
    "remat_offload": lambda m, s, **kw: op.remat_offload(
        m, s, **{"memory_limit": "100%", **FAST, **kw}),
    "profile_chain": lambda m, s, **kw: op.profile_chain(m, s, **{**FAST, **kw}),
}
COMMON = ["memory_limit", "method", "max_stages", "slots", "variant", "time_limit_s", "chain",
          "device", "repeats", "warmup", "progress", "time_model", "extract", "dynamic",
          "process_group", "fast_path", "op_overhead", "op_overhead_ratio",
          "preserve_rng_state", "restore_buffers"]
ARGS = {
    "checkpoint": COMMON + ["strip_suffix", "segment_cost", "autotune", "autotune_rounds",
                            "autotune_timer", "measure_segments"],
    "offload": COMMON + ["bandwidth"],
    "remat_offload": COMMON + ["bandwidth"],
    "profile_chain": ["device", "repeats", "warmup", "progress", "time_model", "max_stages",
                      "extract", "name", "op_overhead", "op_overhead_ratio", "loss_fn"],
}
EXTRA_VALUES: dict[str, list[tuple[str, Any]]] = {
    "chain": [("a dict", {"stages": []}), ("a path", "/tmp/nope.json"),
              ("wrong length", Chain.from_lists([1.0] * 5, [1.0] * 5, [4] * 5, [4] * 5,
                                                input_size=4))],
    "time_model": [("a string", "a100"), ("a function", lambda *a: 1.0)],
    "autotune_timer": [("an int", 3)],
}


class Hang(Exception):
    """A call over the per-call alarm (a value taken as a huge count, say)."""


def _alarm(*_: Any) -> None:
    raise Hang("over 10 s")


def classify(exc: BaseException) -> str:
    """The class of an escape."""
    return type(exc).__name__


def run_one(entry: str, make: Any, name: str, label: str, value: Any,
            results: collections.Counter, failures: list[str], before_mode: str) -> None:
    """One call of ``entry`` with ``name=value``, judged by the oracle."""
    model, sample = make()
    kw = {name: value}
    if name.startswith("autotune_") and entry == "checkpoint":
        kw["autotune"] = True
    before = snapshot(model)
    where = f"{entry}({make.__name__}, {name}={label})"
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        ENTRY[entry](model, sample, **kw)
    except OptmemInputError as exc:
        msg = str(exc)
        results["input_error"] += 1
        if name not in msg and (getattr(exc, "field", None) or "") != name:
            failures.append(f"{where}: OptmemInputError not naming {name}: {msg[:200]}")
            results["unnamed"] += 1
        diffs = same(before, snapshot(model))
        if diffs:
            failures.append(f"{where}: state changed after error: {diffs}")
            results["state"] += 1
        return
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, TypeError) and "unexpected keyword" in str(exc) \
                and entry in ("profile_chain",):
            results["unknown_kw"] += 1
        results[classify(exc)] += 1
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        failures.append(f"{where}: {classify(exc)}: {str(exc)[:160]} "
                        f"[{tb.filename.split('/')[-1]}:{tb.lineno}]")
        diffs = same(before, snapshot(model))
        if diffs:
            failures.append(f"{where}: state changed after error: {diffs}")
            results["state"] += 1
        return
    finally:
        signal.alarm(0)
    results["ok"] += 1
    if before_mode == "verbose":
        failures.append(f"{where}: accepted")


def main() -> None:
    """Every entry, model, option and nasty value; print the counts and the escapes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpt2", action="store_true")
    parser.add_argument("--only", default=None)
    parser.add_argument("--entry", default=None)
    parser.add_argument("--accepted", action="store_true", help="list accepted values too")
    args = parser.parse_args()
    makes = [gpt2] if args.gpt2 else [mlp, net]
    results: collections.Counter = collections.Counter()
    failures: list[str] = []
    calls = 0
    for entry, names in ARGS.items():
        if args.entry and entry != args.entry:
            continue
        for make in makes:
            for name in names:
                if args.only and name != args.only:
                    continue
                for label, value in NASTY + EXTRA_VALUES.get(name, []):
                    calls += 1
                    run_one(entry, make, name, label, value, results, failures,
                            "verbose" if args.accepted else "")
                    print(calls, entry, make.__name__, name, label, dict(results), flush=True,
                          file=sys.stderr)
    print(f"calls {calls}: {dict(results)}")
    for line in failures:
        print(line)


if __name__ == "__main__" and "--more" not in sys.argv:
    main()


def more_cases() -> list[tuple[str, Any]]:
    """Samples, modules, and the wrapper's own methods, with bad values."""
    cases: list[tuple[str, Any]] = []
    good_x = torch.randn(4, 8)
    samples = [("a list", [[0.0] * 8] * 4), ("None", None), ("empty tensor", torch.empty(0)),
               ("batch 0", torch.randn(0, 8)), ("wrong width", torch.randn(4, 5)),
               ("int tensor", torch.ones(4, 8, dtype=torch.long)),
               ("float64", torch.randn(4, 8, dtype=torch.float64)), ("a string", "abc"),
               ("a dict", {"x": good_x}), ("a tuple of 2", (good_x, good_x))]
    modules = [("empty Sequential", nn.Sequential()), ("not a module", 3),
               ("a function", torch.relu), ("no parameters", nn.Sequential(nn.ReLU())),
               ("a list with junk", [nn.Linear(8, 8), 3]), ("None", None)]
    for entry in ENTRY:
        for label, x in samples:
            cases.append((f"{entry}(mlp, sample={label})",
                          lambda e=entry, x=x: (mlp()[0], lambda m: ENTRY[e](m, x))))
            cases.append((f"{entry}(net, sample={label})",
                          lambda e=entry, x=x: (net()[0], lambda m: ENTRY[e](m, x))))
        for label, mod in modules:
            cases.append((f"{entry}(module={label})",
                          lambda e=entry, mod=mod: (nn.Linear(1, 1),
                                                    lambda m: ENTRY[e](mod, good_x))))
    for label, value in NASTY:
        for meth in ("resolve", "use_plan", "use_plan_limit", "set_plan",
                     "submodule_sample", "smallest_limit", "solve_chain"):
            cases.append((f"{meth}({label})", lambda meth=meth, value=value: _method_case(
                meth, value)))
    return cases


def _method_case(meth: str, value: Any) -> tuple[nn.Module, Any]:
    model, x = mlp()
    if meth == "submodule_sample":
        return model, lambda m: op.submodule_sample(m, value, x)
    if meth in ("smallest_limit", "solve_chain"):
        chain = op.profile_chain(model, x, repeats=1, warmup=0)
        if meth == "smallest_limit":
            return model, lambda m: op.smallest_limit(chain, value)
        return model, lambda m: op.solve_chain(chain, value)
    cm = op.checkpoint(model, x, memory_limit="100%", repeats=1, warmup=0)
    if meth == "resolve":
        return cm, lambda m: m.resolve(value)
    if meth == "use_plan":
        return cm, lambda m: m.use_plan(value)
    if meth == "use_plan_limit":
        return cm, lambda m: m.use_plan(list(cm.result.plan), memory_limit=value)
    return cm, lambda m: m.set_plan(value)


def run_more() -> None:
    """Samples, modules and the wrapper's methods (``--more``)."""
    results: collections.Counter = collections.Counter()
    for where, make in more_cases():
        model, call = make()
        before = snapshot(model)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(10)
        try:
            call(model)
            results["ok"] += 1
            print(f"{where}: accepted")
        except OptmemInputError as exc:
            results["input_error"] += 1
            print(f"{where}: input error: {str(exc)[:140]}")
        except Exception as exc:  # noqa: BLE001
            results[classify(exc)] += 1
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            print(f"{where}: ESCAPE {classify(exc)}: {str(exc)[:140]} "
                  f"[{tb.filename.split('/')[-1]}:{tb.lineno}]")
        finally:
            signal.alarm(0)
        diffs = same(before, snapshot(model))
        if diffs:
            results["state"] += 1
            print(f"{where}: STATE {diffs}")
    print(f"calls {sum(v for k, v in results.items() if k != 'state')}: {dict(results)}")


if __name__ == "__main__" and "--more" in sys.argv:
    run_more()
