"""``optmem profile SPEC -o chain.json``: profile a PyTorch model into a chain file.

``SPEC`` is a registered model name (``optmem profile --list``) or
``package.module:factory`` where the factory returns an ``nn.Module`` or a
``(module, sample)`` pair (see :mod:`optmem.pytorch.models`). This module does not import
torch until the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from optmem.errors import OptmemInputError

__all__ = ["register_cli"]


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 3,224,224, got {text!r}") \
            from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive dimensions, got {text!r}")
    return dims


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CPU allocator, CUDA or ``MemoryError``)."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in text \
        or "can't allocate memory" in text or "cannot allocate memory" in text


def register_cli(subparsers: Any) -> None:
    """Add the ``profile`` subcommand to ``subparsers``."""
    p = subparsers.add_parser(
        "profile", help="profile a PyTorch model into a chain file (optmem.chain/1)",
        description="Extract the chain of a PyTorch model (nn.Sequential, or any module "
                    "torch.fx can trace), time and size every stage on one batch, and "
                    "write an optmem.chain/1 JSON file for `optmem solve checkpoint`.")
    p.add_argument("spec", nargs="?",
                   help="registered model name or package.module:factory")
    p.add_argument("-o", "--output", help="chain file to write (default: print it)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (passed to the factory if it takes `batch`)")
    p.add_argument("--input-shape", type=_shape, default=None,
                   help="shape of one example, e.g. 3,224,224 (if the factory gives no sample)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, or meta (exact sizes without running; times from FLOPs)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per stage (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per stage")
    p.add_argument("--max-stages", type=int, default=None,
                   help="merge stages into at most this many (balanced)")
    p.add_argument("--name", default=None, help="chain name (default: the spec)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the registered models and exit")
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    """Handler of ``optmem profile``."""
    from optmem.pytorch.models import list_models

    if args.list:
        for entry in list_models():
            print(f"{entry.name:24s} {entry.description}")
        return 0
    if not args.spec:
        raise OptmemInputError("expected a model: a registered name or package.module:factory"
                               " (see --list)", field="spec")
    if args.batch is not None and args.batch < 1:
        raise OptmemInputError(f"expected a positive batch size, got {args.batch}",
                               field="batch")
    if args.device not in ("cpu", "meta") and not args.device.startswith("cuda"):
        raise OptmemInputError(f"expected cpu, cuda or meta, got {args.device!r}",
                               field="device")
    import torch

    from optmem.pytorch.models import resolve_spec
    from optmem.pytorch.profile import profile_chain

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OptmemInputError("--device cuda but CUDA is not available", field="device")
    try:
        module, sample = resolve_spec(args.spec, batch=args.batch,
                                      input_shape=args.input_shape,
                                      device="meta" if args.device == "meta" else None)
        if args.device != "meta":
            module = module.to(args.device)
        chain = profile_chain(module, sample, device=args.device, repeats=args.repeats,
                              warmup=args.warmup, max_stages=args.max_stages,
                              name=args.name or args.spec,
                              progress=False if args.no_progress else None)
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise OptmemInputError(f"not enough memory on {args.device} to profile "
                               f"{args.spec!r} with batch {args.batch} (try a smaller batch "
                               "or --device meta)", field="batch") from None
    if args.output:
        chain.save(args.output)
        from optmem.units import format_size

        print(f"wrote {args.output}: {chain.length} stages, store-all peak "
              f"{format_size(chain.store_all_peak())}, compute "
              f"{chain.total_compute_time():.3f} {chain.time_unit}", file=sys.stderr)
    else:
        import json

        print(json.dumps(chain.to_dict(), indent=1))
    return 0
