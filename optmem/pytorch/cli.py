"""``optmem profile SPEC -o chain.json`` and ``optmem train-pipeline SPEC`` (under torchrun).

``SPEC`` is a registered model name (``optmem profile --list``) or
``package.module:factory`` where the factory returns an ``nn.Module`` or a
``(module, sample)`` pair (see :mod:`optmem.pytorch.models`). This module does not import
torch until a command runs.

``torchrun --nproc_per_node P -m optmem train-pipeline SPEC --batch B ...`` is the torchrun
entry point for pipelines: every rank builds the model (seeded), rank 0 profiles one
micro-batch of ``B`` examples and solves, the plan is broadcast, and the ranks train a few
steps on PyTorch's pipeline runtime (:func:`optmem.pytorch.pipelining.pipeline`; a module
that is not an ``nn.Sequential`` is exported with ``torch.export``, and a factory may return
a call as its sample, e.g. ``{"input_ids": ids, "labels": ids}``).
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


def register_cli(subparsers: Any) -> None:
    """Add the ``profile`` subcommand to ``subparsers``."""
    p = subparsers.add_parser(
        "profile", help="profile a PyTorch model into a chain file (optmem.chain/1)",
        description="Extract the chain of a PyTorch model (an nn.Sequential, or any module "
                    "torch.export or torch.fx can trace on the factory's sample, e.g. a "
                    "HuggingFace model with a keyword sample; --device meta: nn.Sequential "
                    "or torch.fx only), time and size every stage on one batch, and write "
                    "an optmem.chain/1 JSON file for `optmem solve checkpoint`.")
    p.add_argument("spec", nargs="?",
                   help="registered model name or package.module:factory")
    p.add_argument("-o", "--output", help="chain file to write (default: print it)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (passed to the factory if it takes `batch`)")
    p.add_argument("--input-shape", type=_shape, default=None,
                   help="shape of one example, e.g. 3,224,224 (if the factory gives no sample)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:N, or meta (exact sizes without running; times "
                        "from FLOPs)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per stage (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per stage")
    p.add_argument("--max-stages", type=int, default=None,
                   help="merge stages into at most this many (balanced)")
    p.add_argument("--name", default=None, help="chain name (default: the spec)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the registered models and exit")
    p.set_defaults(func=run_profile)

    p = subparsers.add_parser(
        "train-pipeline", help="plan and train a model as a pipeline (run under torchrun)",
        description="Under torchrun: profile SPEC on rank 0 (one micro-batch), solve the "
                    "pipeline problem for the world size, broadcast the plan and train a few "
                    "steps on torch.distributed.pipelining with synthetic data (the sample "
                    "repeated; loss: the model's own when the sample passes labels, else the "
                    "mean square of the output or its logits). Rank 0 prints the plan, the "
                    "rank(s) with the last stage the losses.")
    p.add_argument("spec", help="registered model name or package.module:factory")
    p.add_argument("--batch", type=int, default=2, help="examples per micro-batch")
    p.add_argument("--input-shape", type=_shape, default=None,
                   help="shape of one example, e.g. 3,224,224 (if the factory gives no sample)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step (default: twice the stages)")
    p.add_argument("--memory-per-gpu", default="16GiB", help="memory of each GPU")
    p.add_argument("--bandwidth", default=None, help="link bandwidth, e.g. 12GB/s (default inf)")
    p.add_argument("--method", default="madpipe", help="pipeline method (default madpipe)")
    p.add_argument("--memory-model", choices=("stash", "strict"), default="stash",
                   help="memory model of the plan (default stash)")
    p.add_argument("--temporaries", action="store_true", default=False,
                   help="also count each task's temporaries (with --memory-model strict)")
    p.add_argument("--plan", default=None,
                   help="run this plan (result or plan JSON) instead of solving")
    p.add_argument("--steps", type=int, default=2, help="training steps")
    p.add_argument("--max-stages", type=int, default=None,
                   help="merge the extracted stages into at most this many")
    p.set_defaults(func=run_train_pipeline)


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
        raise OptmemInputError(f"expected cpu, cuda, cuda:N or meta, got {args.device!r}",
                               field="device")

    from optmem.pytorch import api, profile
    from optmem.pytorch.models import out_of_memory, resolve_spec

    if args.device.startswith("cuda"):
        _check_cuda_device(args.device)
    module = sample = None
    try:
        module, sample = resolve_spec(args.spec, batch=args.batch,
                                      input_shape=args.input_shape,
                                      device="meta" if args.device == "meta" else None)
        if args.device != "meta":
            module = module.to(args.device)
        # on meta (sizes without running) only the stage profiler works: an nn.Sequential
        # or a module torch.fx traces; elsewhere the sample's call is exported, as
        # op.profile_chain does (keyword samples, HF models)
        profile_chain = profile.profile_chain if args.device == "meta" else api.profile_chain
        chain = profile_chain(module, sample, device=args.device, repeats=args.repeats,
                              warmup=args.warmup, max_stages=args.max_stages,
                              name=args.name or args.spec,
                              progress=False if args.no_progress else None)
    except (MemoryError, RuntimeError) as exc:
        if not out_of_memory(exc):
            _raise_if_the_model_fails(args.spec, module, sample)
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


def _check_cuda_device(name: str) -> None:
    """``--device cuda[:N]``: one this machine has, else one clear input error.

    Before, a malformed name (``cudax``, ``cuda:-1``) or a device index beyond the
    machine's (``cuda:3`` with one GPU) failed in ``module.to`` with PyTorch's error (a raw
    traceback, or a message about the model).
    """
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise OptmemInputError(f"expected cpu, cuda, cuda:N or meta, got {name!r}",
                               field="device") from None
    if device.type != "cuda":
        raise OptmemInputError(f"expected cpu, cuda, cuda:N or meta, got {name!r}",
                               field="device")
    if not torch.cuda.is_available():
        raise OptmemInputError("--device cuda but CUDA is not available", field="device")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise OptmemInputError(f"--device {name}: this machine has {count} CUDA device(s), "
                               f"cuda:0 to cuda:{count - 1}", field="device")


def _raise_if_the_model_fails(spec: str, module: Any, sample: Any) -> None:
    """One input error when the model itself cannot run its sample (a profile failed).

    A factory whose module does not take its own sample (``Linear(4, 4)`` with a ``(2, 5)``
    batch) printed the profile's 59-line traceback, exit 1 (a hunt in stop 51); a profile
    that fails where the model runs is optmem's error and keeps its traceback.
    """
    import torch

    from optmem.pytorch.wrapper import call_of

    if module is None:  # the factory itself failed: its own error
        return
    args, kwargs = call_of(sample)
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's model: reported in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise OptmemInputError(f"the model of {spec!r} does not run on its own sample: "
                               f"{type(exc).__name__}: {first}", field="spec") from None


def run_train_pipeline(args: argparse.Namespace) -> int:
    """Handler of ``optmem train-pipeline`` (every rank of a torchrun job runs it)."""
    if args.batch < 1 or args.steps < 1:
        raise OptmemInputError("expected a positive --batch and --steps", field="batch")
    from optmem.problems.pipeline import check_temporaries

    check_temporaries(args.memory_model, args.temporaries)  # exit 2 before any process group
    import torch
    import torch.distributed as dist

    from optmem.pytorch.distributed import end_process, init_distributed
    from optmem.pytorch.models import resolve_spec
    from optmem.pytorch.pipelining import PipelinedModel, pipeline

    device = init_distributed()
    torch.manual_seed(0)  # the same weights and sample on every rank
    module, sample = resolve_spec(args.spec, batch=args.batch, input_shape=args.input_shape)

    def loss_fn(output: Any, _unused_target: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)  # the model's own (the sample has labels=)
        if isinstance(loss, torch.Tensor):
            return loss
        return getattr(output, "logits", output).float().pow(2).mean()

    if args.plan:
        with open(args.plan) as fh:
            piped = PipelinedModel(module, fh.read(), sample=sample,
                                   microbatches=args.microbatches, loss_fn=loss_fn,
                                   device=device)
    else:
        piped = pipeline(module, sample, memory_per_gpu=args.memory_per_gpu,
                         bandwidth=args.bandwidth, loss_fn=loss_fn, method=args.method,
                         microbatches=args.microbatches, max_stages=args.max_stages,
                         memory_model=args.memory_model, temporaries=args.temporaries,
                         device=device)
    rank = dist.get_rank()
    if rank == 0 and piped.result is not None:
        print(f"{args.spec}: {piped.result.method} plan ({piped.result.status}), predicted "
              f"period {piped.result.objective:.4g} ms per micro-batch; "
              f"{piped.result.report.get('allocation')}", flush=True)
    call_args, call_kwargs = _repeated_call(sample, piped.microbatches)
    opt = torch.optim.SGD(piped.parameters(), lr=1e-3)
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        losses = piped.step(*call_args, **call_kwargs)
        opt.step()
        if losses:
            print(f"rank {rank} step {step}: mean micro-batch loss "
                  f"{sum(float(v) for v in losses) / len(losses):.6g}", flush=True)
    dist.destroy_process_group()
    end_process(0)  # no interpreter finalisation: gloo's threads can abort it (end_process)


def _repeated_call(sample: Any, n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch of ``n`` copies of the sample micro-batch, as a call.

    Every tensor of the sample is repeated along dimension 0.
    """
    import torch
    from torch.utils._pytree import tree_map_only

    from optmem.pytorch.wrapper import call_of

    args, kwargs = call_of(sample)
    return tree_map_only(torch.Tensor, lambda t: torch.cat([t] * n), (args, kwargs))
