"""Command-line hooks of the problems: their options and how parsed options build a problem.

The problem classes (:mod:`optmem.problems`) are values only; this module, above them, turns
``argparse`` options into problem objects for ``optmem solve``, ``compare``, ``verify`` and
``sweep``. :data:`HOOKS` maps each problem name to its ``add_options(parser)`` hook (or
``None``) and its ``from_cli(chain, memory_limit, args)`` builder. Plan verification is
:func:`optmem.simulate.verify.verify_plan`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.problems.checkpoint import CheckpointProblem
from optmem.problems.min_peak import MODELS, MinPeakProblem
from optmem.problems.offload import OffloadProblem
from optmem.problems.pipeline import DEFAULT_WEIGHT_COPIES, MEMORY_MODELS, PipelineProblem
from optmem.problems.remat_offload import RematOffloadProblem
from optmem.units import chain_rate

__all__ = [
    "HOOKS",
    "ProblemHooks",
    "add_min_peak_options",
    "add_offload_options",
    "add_pipeline_options",
    "add_chain_bandwidth_option",
    "check_problem_options",
    "link_from_cli",
    "option_defaults",
    "checkpoint_from_cli",
    "min_peak_from_cli",
    "offload_from_cli",
    "parse_pipeline_bandwidth",
    "pipeline_from_cli",
    "remat_offload_from_cli",
]


# ------------------------------------------------------------------ min-peak
def add_min_peak_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``optmem solve min-peak``: ``--model`` and ``--ignore-input``."""
    parser.add_argument("--model", choices=MODELS, default="pytorch",
                        help="memory model: pytorch (Hong eq. 12, default), static (eq. 6), "
                             "optmem (optmem's checkpoint simulator)")
    parser.add_argument("--ignore-input", action="store_true",
                        help="do not count the input d_0 (Hong's plain-AlexNet convention)")


def min_peak_from_cli(chain: Chain, memory_limit: int | None, args: Any) -> MinPeakProblem:
    """Build the problem from CLI arguments; ``--memory`` is an optional upper bound.

    ``None`` (no ``--memory``) means no bound; ``0`` is a bound of 0 bytes.
    """
    return MinPeakProblem(
        chain, model=getattr(args, "model", None) or "pytorch",
        count_input=not getattr(args, "ignore_input", False),
        memory_limit=memory_limit,
    )


# ------------------------------------------------------------------ offload, remat-offload
def add_offload_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``optmem solve offload``, ``remat-offload``: ``--[chain-]bandwidth``."""
    parser.add_argument(
        "--bandwidth", default=None,
        help="offload link bandwidth: a rate such as 12GB/s or 500MiB/s, or a bare number "
             "of bytes (memory units) per second, as in Python")
    add_chain_bandwidth_option(parser)


def add_chain_bandwidth_option(parser: Any) -> None:
    """Add ``--chain-bandwidth`` (Python's ``chain_bandwidth=``) to a parser or group."""
    parser.add_argument(
        "--chain-bandwidth", default=None, metavar="X",
        help="link bandwidth in the chain's own units instead of --bandwidth: a number of "
             "memory units per chain time unit (chains in other units than bytes and "
             "s/ms/us/ns)")


def link_from_cli(args: Any, problem: str, *, required: bool) -> dict[str, Any]:
    """The link of ``args`` as the problem's keyword: ``bandwidth`` or ``chain_bandwidth``.

    ``--bandwidth`` (a rate, or bytes per second: the problem class parses it) and
    ``--chain-bandwidth`` (memory units per chain time unit, Python's ``chain_bandwidth=``)
    exclude each other; ``required``: one of them must be given. The problem class then
    checks the value as from Python.
    """
    text = getattr(args, "bandwidth", None)
    chain_text = getattr(args, "chain_bandwidth", None)
    if text is not None and chain_text is not None:
        raise OptmemInputError("give the link as --bandwidth (bytes per second or a rate) "
                               "or as --chain-bandwidth (chain units), not both",
                               field="--chain-bandwidth")
    if chain_text is not None:  # the problem class parses the text, as from Python
        return {"chain_bandwidth": str(chain_text)}
    if text is None:
        if required:
            raise OptmemInputError(f"the {problem} problem needs --bandwidth (e.g. 12GB/s) or "
                                   f"--chain-bandwidth (memory units per chain time unit)",
                                   field="--bandwidth")
        return {}
    return {"bandwidth": str(text)}


def _build_with_link(build: Callable[..., Any], link: dict[str, Any]) -> Any:
    """``build(**link)``; an error of the problem class on ``chain_bandwidth`` names the flag.

    The problem class checks the link as from Python (a link too slow for the chain, a
    pipeline link of 0) and names ``bandwidth``/``chain_bandwidth``; given as
    ``--chain-bandwidth``, the error names ``--chain-bandwidth``.
    """
    try:
        return build(**link)
    except OptmemInputError as exc:
        if "chain_bandwidth" in link and exc.field in ("bandwidth", "chain_bandwidth"):
            raise OptmemInputError(exc.reason, field="--chain-bandwidth") from None
        raise


def offload_from_cli(chain: Chain, memory_limit: int, args: Any) -> OffloadProblem:
    """Build the offload problem (``--bandwidth`` or ``--chain-bandwidth`` is required)."""
    return _build_with_link(lambda **link: OffloadProblem(chain, memory_limit, **link),
                            link_from_cli(args, "offload", required=True))


def remat_offload_from_cli(chain: Chain, memory_limit: int, args: Any) -> RematOffloadProblem:
    """Build the remat + offload problem (``--bandwidth`` or ``--chain-bandwidth``)."""
    return _build_with_link(lambda **link: RematOffloadProblem(chain, memory_limit, **link),
                            link_from_cli(args, "remat-offload", required=True))


# ------------------------------------------------------------------ pipeline
def add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    """Add the pipeline options: ``--gpus``, ``--bandwidth`` ... ``--temporaries``."""
    group = parser.add_argument_group("pipeline")
    group.add_argument("--gpus", type=int, default=None,
                       help="number of GPUs P (pipeline; --memory is per GPU)")
    group.add_argument("--bandwidth", default=None,
                       help="link bandwidth: a rate such as 12GB/s, a bare number of bytes "
                            "(memory units) per second, or inf (pipeline; default inf)")
    add_chain_bandwidth_option(group)
    group.add_argument("--weight-copies", type=int, default=DEFAULT_WEIGHT_COPIES,
                       help="copies of each weight held per GPU: 3 = 2 versions + gradient "
                            "(default), 5 with Adam states")
    group.add_argument("--memory-model", choices=MEMORY_MODELS, default="stash",
                       help="stash (thesis ch. 5/7, default) or strict (ch. 6 eq. 6.36)")
    group.add_argument("--temporaries", action="store_true", default=False,
                       help="also count each task's temporaries (the chain's overheads, the "
                            "loss gradient): with --memory-model strict only")


def parse_pipeline_bandwidth(text: Any, time_unit: str) -> float:
    """``--bandwidth`` in memory units per chain time unit (``inf``/``none``/absent: free)."""
    if text is None:
        return math.inf
    value = chain_rate(text, time_unit, allow_inf=True)
    if value <= 0:
        raise OptmemInputError(f"expected a positive bandwidth, got {text!r}", field="bandwidth")
    return value


def pipeline_from_cli(chain: Chain, memory_limit: int, args: Any) -> PipelineProblem:
    """Build the problem from parsed CLI options (``--memory`` is per GPU)."""
    gpus = getattr(args, "gpus", None)
    if gpus is None:
        raise OptmemInputError("the pipeline problem needs --gpus P", field="gpus")
    return _build_with_link(lambda **link: PipelineProblem(
        chain, n_gpus=int(gpus), memory_per_gpu=memory_limit, **link,
        weight_copies=int(getattr(args, "weight_copies", DEFAULT_WEIGHT_COPIES)),
        memory_model=str(getattr(args, "memory_model", "stash") or "stash"),
        temporaries=bool(getattr(args, "temporaries", False)),
    ), link_from_cli(args, "pipeline", required=False))


# ------------------------------------------------------------------ checkpoint
def checkpoint_from_cli(chain: Chain, memory_limit: int, args: Any) -> CheckpointProblem:
    """Build the checkpoint problem (no options beyond ``--memory``)."""
    del args
    return CheckpointProblem(chain, memory_limit)


class ProblemHooks(NamedTuple):
    """A problem's CLI hooks: options to add (or ``None``) and the problem builder.

    ``from_cli(chain, memory_limit, args)`` reads the options ``add_options`` adds, and
    only those (:func:`check_problem_options` refuses the other problems' options).
    """

    add_options: Callable[[argparse.ArgumentParser], None] | None
    from_cli: Callable[[Chain, Any, Any], Any]


HOOKS: dict[str, ProblemHooks] = {
    "checkpoint": ProblemHooks(None, checkpoint_from_cli),
    "min-peak": ProblemHooks(add_min_peak_options, min_peak_from_cli),
    "offload": ProblemHooks(add_offload_options, offload_from_cli),
    "remat-offload": ProblemHooks(add_offload_options, remat_offload_from_cli),
    "pipeline": ProblemHooks(add_pipeline_options, pipeline_from_cli),
}


def _own_options(hooks: ProblemHooks) -> list[argparse.Action]:
    """The options a problem's hooks add (its builder reads these)."""
    if hooks.add_options is None:
        return []
    probe = argparse.ArgumentParser(add_help=False)
    hooks.add_options(probe)
    return list(probe._actions)


def option_defaults() -> dict[str, Any]:
    """The default of every problem option, by ``argparse`` destination."""
    return {action.dest: action.default for hooks in HOOKS.values()
            for action in _own_options(hooks)}


def check_problem_options(problem: str, args: Any) -> None:
    """Raise for an option of another problem given to ``problem`` (``checkpoint --gpus 4``).

    Every command lists the options of every problem (``add_problem_options``); until stop
    53 the ones ``problem`` does not read were ignored in silence (``solve checkpoint
    --bandwidth 12GB/s`` solved plain checkpointing). An option counts as given when its
    value differs from its default.
    """
    owners = {name: {a.dest for a in _own_options(hooks)} for name, hooks in HOOKS.items()}
    for other in HOOKS.values():
        for action in _own_options(other):
            if action.dest in owners[problem] or getattr(args, action.dest, action.default) \
                    == action.default:
                continue
            flag = action.option_strings[0]
            takes = [name for name, dests in owners.items() if action.dest in dests]
            names = takes[0] if len(takes) == 1 else \
                f"{', '.join(takes[:-1])} and {takes[-1]}"
            raise OptmemInputError(f"{flag} is an option of {names}, not of {problem}",
                                   field=flag)
