"""Pipelined model parallelism: problem PIPE_{S^1&A}(L, M, P, beta) of the thesis, Part III.

Shilova's thesis (chapter 4 model, chapter 5 1F1B*, chapter 6 ILP, chapter 7 MadPipe), digested
in ``shared/design/madpipe.md``. A chain is split into *stages* (runs of consecutive layers),
each stage is placed on one of ``n_gpus`` identical GPUs, and a 1-periodic pattern of period
``T`` runs each stage's forward and backward once per period, on successive micro-batches.
The objective is the period (time per micro-batch in steady state).

Layers (notation table, thesis section 4.2)
-------------------------------------------
The optimisation works on the ``n = L`` layers of the chain; the loss (the thesis' layer
``L + 1``, forward time 0) runs on the GPU of layer ``L``, as in every pipeline runtime, so it
is folded into layer ``L``. For layer ``q``:

==============  ==========================================  ===============================
symbol          chain fields                                 meaning
==============  ==========================================  ===============================
``f[q]``        ``fwd_time``                                 u_F
``b[q]``        ``bwd_time`` (layer ``L``: + ``loss.bwd_time``)  u_B
``w[q]``        ``weight_size``                              W_q
``a[q]``        ``output_size`` (``a[0] = input_size``;      a_q, and delta_q (same size),
                ``a[L] = 0``: nothing leaves the loss)       sent over a cut after ``q``
``x[q]``        ``a[q-1] + saved_size - output_size``        stash kept per in-flight
                (layer ``L``: ``a[L-1] + saved_size``)       micro-batch from F_q to B_q
==============  ==========================================  ===============================

With ``saved_size == output_size`` (the thesis' "simple BP-transform") the stash of layer
``q`` is exactly its input ``a_{q-1}``, as in the thesis (layer ``L`` also keeps ``a_L`` for
the loss). Otherwise the stash is the input plus the tape the layer keeps beyond its output
(the output is stashed by the next layer).

Memory per GPU (the digest's sections 1.6, 4.3 and 5.2)
-------------------------------------------------------
``memory_model = "stash"`` (default; thesis chapters 5 and 7, eq. of ``M(i,j,g)``):

* weights: ``weight_copies * W`` for every layer on the GPU. ``weight_copies`` (``C`` in the
  thesis) defaults to 3: two weight versions (PipeDream-2BW) + one gradient. Set 5 to also
  hold Adam's two moment buffers, 4 for SGD with momentum; ZeRO's 16 for mixed-precision
  Adam is ``weight_copies=16`` with ``weight_size`` in fp16 parameters.
* communication buffers: for each cut between consecutive stages placed on different GPUs,
  both GPUs hold one buffer for the activation ``a_j`` and one for the gradient ``delta_j``
  (Assumption 5, eq. 6.34-6.35), i.e. ``2 a_j`` each.
* stashed activations: stage ``s`` keeps ``x`` (summed over its layers) for every
  micro-batch whose forward on ``s`` has started and whose backward on ``s`` has not ended.

``memory_model = "strict"`` (thesis chapter 6, eq. 6.36): checked at the start of every task,
weights + buffers + the stash of in-flight micro-batches (the one whose forward starts now
not included) + the task's input and output (``a_{k-1} + a_k`` for the forward of layer
``k``, ``delta_k + delta_{k-1}`` for its backward) + outputs of tasks on the same GPU still
waiting for their consumer on that GPU (``M^(DIR)``). The chapter's tasks are layers: a stage
of layers ``i..j`` runs them one after the other, so its forward is checked at the start of
each of its layers, holding the stash of its layers already run for that micro-batch, and
its backward likewise in reverse (:meth:`Layers.strict_task`). So a plan's memory does not
depend on how it groups layers of one GPU into stages. It is more conservative on
thesis-style chains; 1F1B* is only optimal for the ``stash`` model.

Temporaries (``temporaries=True``, strict model only)
----------------------------------------------------
Both models above leave out what a task holds only while it runs: the chain's
``fwd_overhead``, ``bwd_overhead`` and ``loss.bwd_overhead``, a forward's tape beyond its
output while it is built, and the loss gradient ``delta_L`` (``a_L = 0`` in the layers), so
a plan's peak is no bound on what a GPU allocates. ``temporaries=True`` adds them to the
strict model's per-layer checks (the checks are per task, where temporaries live; the stash
model checks only when a forward starts, so it is refused with them): the forward of layer
``k`` adds ``fwd_overhead_k + saved_size_k - a_k`` (what the checkpoint simulator's
``F_all k`` holds above its input), the backward of layer ``k < L`` adds ``bwd_overhead_k +
weight_size_k + a_k`` (the layer's weight gradient of the micro-batch, a new tensor until
autograd adds it to ``.grad``: gradients accumulate over the micro-batches of a step, and
the profiler leaves weight gradients out of ``bwd_overhead``; and its output ``a_k``, part
of the tape ``B_k`` reads, as in the checkpoint simulator, which the stash leaves to layer
``k + 1`` and frees with ``B_{k+1}``: Tanh, ReLU and Sigmoid keep their result to their
backward), and layer ``L``'s backward, which
runs the loss step and then ``B_L``, adds the larger of ``delta_L + loss.bwd_overhead -
a_{L-1}`` and ``delta_L + bwd_overhead_L + weight_size_L`` (each step with the
micro-batch's whole stash). On one GPU with one micro-batch in flight (and no weight
copies) the peak is then the checkpoint simulator's store-all peak of the chain, each
``B k`` with its weight gradient. Memory only grows with them: every plan feasible with them
is feasible without, so an optimum with them is never below the one without and period
bounds computed without memory (``lower_bound``) stay valid. With every overhead 0, tapes
equal to outputs, weights 0 and every ``output_size`` 0 the results are those of the plain
strict model.

Communication: with bandwidth ``beta`` a cut after layer ``j`` costs one transfer of ``a_j /
beta`` forward and one of ``delta_j / beta`` backward on the link joining the two GPUs; links
are exclusive (one transfer at a time) and independent of each other and of computation
(section 1.2). ``bandwidth=math.inf`` makes transfers free (buffers still count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Integral
from typing import Any

from optmem.chain import Chain
from optmem.errors import OptmemInputError
from optmem.problems.checkpoint import check_chain, check_memory_limit
from optmem.problems.offload import link_bandwidths

MEMORY_MODELS = ("stash", "strict")
DEFAULT_WEIGHT_COPIES = 3
MAX_GPUS = 4096  # far beyond any pipeline depth; each extra GPU is a column of every model
MAX_WEIGHT_COPIES = 64  # 3 (two versions and a gradient), 5 with Adam; 64 covers any optimiser


@dataclass(frozen=True)
class Layers:
    """The ``n = L`` layers of a pipeline problem (loss folded into the last), 1-based lists.

    Index 0 of ``f``, ``b``, ``w``, ``x`` is unused (0); ``a[0]`` is the chain input.
    ``tf`` / ``tb``: what the forward / backward of each layer holds beyond ``a_{k-1} + a_k``
    (``temporaries=True``, :func:`chain_layers`); empty (the default): nothing.
    """

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[int, ...]
    x: tuple[int, ...]
    a: tuple[int, ...]
    tf: tuple[int, ...] = ()
    tb: tuple[int, ...] = ()

    @property
    def n(self) -> int:
        """Number of layers."""
        return len(self.f) - 1

    @cached_property
    def _prefix(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name in ("f", "b", "w", "x"):
            acc = [0.0]
            for v in getattr(self, name)[1:]:
                acc.append(acc[-1] + v)
            out[name] = acc
        return out

    def _sum(self, name: str, i: int, j: int) -> float:
        acc = self._prefix[name]
        return acc[j] - acc[i - 1]

    def load(self, i: int, j: int) -> float:
        """``U(i, j)``: forward + backward time of layers ``i..j``."""
        return float(sum(self.f[i:j + 1]) + sum(self.b[i:j + 1])) if j - i < 4 else \
            self._sum("f", i, j) + self._sum("b", i, j)

    def fwd(self, i: int, j: int) -> float:
        """Forward time of layers ``i..j``."""
        return float(sum(self.f[i:j + 1]))

    def bwd(self, i: int, j: int) -> float:
        """Backward time of layers ``i..j``."""
        return float(sum(self.b[i:j + 1]))

    def stash(self, i: int, j: int) -> int:
        """Stash of one in-flight micro-batch on a stage of layers ``i..j``."""
        return int(self._sum("x", i, j))

    def weights(self, i: int, j: int) -> int:
        """Parameter size of layers ``i..j``."""
        return int(self._sum("w", i, j))

    def strict_task(self, i: int, j: int) -> tuple[int, int]:
        """Memory a stage of layers ``i..j`` adds while its forward / backward runs (strict).

        The stage runs its layers one after the other, and eq. 6.36 (thesis ch. 6, digest
        ``madpipe.md`` 4.3) checks the memory at the start of each layer's task (the
        chapter's tasks are layers). The forward of layer ``k`` holds the stash of layers
        ``i..k-1`` of its micro-batch (their forwards have started) and its input and
        output ``a_{k-1} + a_k``; the backward of layer ``k`` holds the stash of layers
        ``i..k`` (those of ``k+1..j`` are freed) and ``delta_k + delta_{k-1}``. With
        temporaries (``tf`` / ``tb`` not empty) each layer's check adds ``tf[k]`` /
        ``tb[k]`` (:func:`chain_layers`).

        Returns
        -------
        tuple of int
            ``max_k stash(i, k-1) + a_{k-1} + a_k`` (on top of the other micro-batches'
            stashes) and ``max_k a_{k-1} + a_k - stash(k+1, j)`` (on top of every stash
            alive when the backward starts, the micro-batch's whole ``stash(i, j)``
            included). One layer: ``a_{i-1} + a_i`` both.
        """
        a = self.a
        tf = self.tf or (0,) * len(a)
        tb = self.tb or (0,) * len(a)
        fwd = max(self.stash(i, k - 1) + a[k - 1] + a[k] + tf[k] for k in range(i, j + 1))
        bwd = max(a[k - 1] + a[k] + tb[k] - self.stash(k + 1, j) for k in range(i, j + 1))
        return fwd, bwd


def chain_layers(chain: Chain, *, temporaries: bool = False) -> Layers:
    """The layers of ``chain`` for pipelining (see the module notation table).

    Parameters
    ----------
    chain
        The chain.
    temporaries
        Also fill ``Layers.tf`` / ``Layers.tb``, what each task holds beyond ``a_{k-1} +
        a_k`` (module section "Temporaries"). The forward of layer ``k`` holds, as the
        checkpoint simulator's ``F_all k``, its whole tape and ``fwd_overhead_k`` (the
        profiler measures it above the tape): ``tf[k] = fwd_overhead_k + saved_size_k -
        a_k`` (``a_L = 0``: layer ``L``'s output is in its tape). The backward of layer
        ``k < L`` holds ``bwd_overhead_k`` and its weight gradient of this micro-batch,
        ``weight_size_k``, before autograd adds it to ``.grad`` (a pipeline accumulates
        gradients over micro-batches; the profiler leaves weight gradients out of
        ``bwd_overhead``), and its output ``a_k``, part of the tape ``abar_k`` it reads
        (the stash leaves ``a_k`` to layer ``k + 1``, freed by ``B_{k+1}``; the checkpoint
        simulator's ``B k`` counts it): ``tb[k] = bwd_overhead_k + weight_size_k + a_k``
        (until stop 54 without ``a_k``). Layer ``L``'s
        backward task runs the loss step (holding ``delta_L``, of ``output_size_L``, and
        ``loss.bwd_overhead``) and then ``B_L`` (holding ``delta_L``, ``delta_{L-1}``,
        ``bwd_overhead_L`` and ``weight_size_L``), each with the micro-batch's whole stash:
        ``tb[L] = max(output_size_L + loss.bwd_overhead - a_{L-1}, output_size_L +
        bwd_overhead_L + weight_size_L)`` (the check adds ``a_{L-1} + a_L = a_{L-1}``).
        Every entry is ``>= 0``.

    Returns
    -------
    Layers
        The ``L`` layers, the loss folded into the last.
    """
    n = chain.length
    a = (chain.input_size, *chain.output_size[:-1], 0)
    x = [0]
    for q in range(1, n + 1):
        x.append(a[q - 1] + chain.saved_size[q - 1] - chain.output_size[q - 1])
    x[n] += chain.output_size[n - 1]
    b = list(chain.bwd_time)
    b[-1] += chain.loss_bwd_time
    tf: tuple[int, ...] = ()
    tb: tuple[int, ...] = ()
    if temporaries:
        out = chain.output_size[n - 1]
        tf = (0, *(chain.fwd_overhead[k - 1] + chain.saved_size[k - 1] - a[k]
                   for k in range(1, n + 1)))
        grad = [o + w for o, w in zip(chain.bwd_overhead, chain.weight_size, strict=True)]
        tb = (0, *(grad[k - 1] + a[k] for k in range(1, n)),
              max(out + chain.loss_bwd_overhead - a[n - 1], out + grad[-1]))
    return Layers(f=(0.0, *chain.fwd_time), b=(0.0, *b), w=(0, *chain.weight_size),
                  x=tuple(x), a=a, tf=tf, tb=tb)


def check_temporaries(memory_model: str, temporaries: object) -> None:
    """Raise unless ``temporaries`` is a bool usable with ``memory_model``.

    Raises
    ------
    OptmemInputError
        ``temporaries`` is no bool, or is ``True`` with another model than ``"strict"``
        (field ``temporaries``).
    """
    if not isinstance(temporaries, bool):
        raise OptmemInputError(f"expected True or False, got {temporaries!r}",
                               field="temporaries")
    if temporaries and memory_model != "strict":
        raise OptmemInputError(
            f"temporaries are counted by the strict memory model only (its checks are per "
            f"task), not by {memory_model!r}: use memory_model='strict' (--memory-model "
            "strict)", field="temporaries")


@dataclass(frozen=True)
class PipelineProblem:
    """PIPE_{S^1&A}: the smallest period of a pipelined training of ``chain`` on ``n_gpus``.

    Parameters
    ----------
    chain
        The chain (or a chain file path or bundled dataset name); its loss runs with
        layer ``L``.
    n_gpus
        Number of identical GPUs ``P``.
    memory_per_gpu
        Memory of each GPU in the chain's memory unit (any form of
        :func:`optmem.units.memory_size`: ``6 * 2**30``, ``6e9``, ``"6GiB"``).
    bandwidth
        Link bandwidth in **memory units (bytes) per second** or a rate string
        (``"12GB/s"``); ``None`` (default), ``math.inf`` or ``"inf"`` for free transfers.
        Stored as a float per second.
    chain_bandwidth
        Keyword only, instead of ``bandwidth``: memory units per chain time unit (what the
        models use), a number or its text (``"2.5"``, ``"inf"``, as ``--chain-bandwidth``).
        Always set, as a float, after construction.
    weight_copies
        ``C``: copies of every weight held (2 versions + gradient = 3, the thesis' value;
        add optimizer states, e.g. 5 for Adam).
    memory_model
        ``"stash"`` (thesis ch. 5/7, default) or ``"strict"`` (ch. 6 eq. 6.36).
    buffers
        Count the communication buffers (default). ``False`` reproduces the memory of the
        thesis' chapter 5 examples, which ignore them.
    temporaries
        Keyword only, ``memory_model="strict"`` only: also count each task's temporaries
        (the chain's ``fwd_overhead``, ``bwd_overhead``, ``loss.bwd_overhead``, the forward's
        tape beyond its output, the loss gradient ``delta_L``, a backward's weight
        gradient before it is accumulated and the output its tape holds) at the check of
        its layer
        (module section "Temporaries"). Default ``False``: the plain strict model.

    Examples
    --------
    >>> from optmem.datasets.synthetic import uniform_chain
    >>> p = PipelineProblem(uniform_chain(4), n_gpus=2, memory_per_gpu=100, bandwidth="1kB/s")
    >>> p.layers.n, p.layers.x[1], p.layers.x[4], p.chain_bandwidth
    (4, 2, 3, 1.0)
    """

    chain: Chain
    n_gpus: int
    memory_per_gpu: int  # any MemoryLike is accepted and normalised to int
    bandwidth: float | str | None = None  # per second; a rate string is normalised to float
    weight_copies: int = DEFAULT_WEIGHT_COPIES
    memory_model: str = "stash"
    buffers: bool = True
    chain_bandwidth: float = field(default=None, kw_only=True)  # type: ignore[assignment]
    temporaries: bool = field(default=False, kw_only=True)

    name = "pipeline"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", check_chain(self.chain))
        if isinstance(self.n_gpus, bool) or not isinstance(self.n_gpus, Integral) \
                or self.n_gpus < 1:
            raise OptmemInputError(f"expected a positive number of GPUs, got {self.n_gpus!r}",
                                   field="gpus")
        object.__setattr__(self, "n_gpus", int(self.n_gpus))
        object.__setattr__(self, "memory_per_gpu",
                           check_memory_limit(self.memory_per_gpu, field="memory_per_gpu"))
        given = self.bandwidth
        if given is None and self.chain_bandwidth is None:
            given = math.inf
        per_second, per_chain = link_bandwidths(self.chain, given, self.chain_bandwidth,
                                                allow_inf=True)
        if not per_chain > 0:  # named chain_bandwidth=0 "got None" until stop 53
            name = "bandwidth" if self.bandwidth is not None else "chain_bandwidth"
            raise OptmemInputError(f"expected a positive bandwidth (or inf), got "
                                   f"{getattr(self, name)!r}", field=name)
        object.__setattr__(self, "bandwidth", per_second)
        object.__setattr__(self, "chain_bandwidth", per_chain)
        if (isinstance(self.weight_copies, bool) or not isinstance(self.weight_copies, Integral)
                or self.weight_copies < 0):
            raise OptmemInputError(
                f"expected a non-negative integer, got {self.weight_copies!r}",
                field="weight-copies")
        object.__setattr__(self, "weight_copies", int(self.weight_copies))
        if not isinstance(self.buffers, bool):
            raise OptmemInputError(f"expected True or False, got {self.buffers!r}",
                                   field="buffers")
        if self.memory_model not in MEMORY_MODELS:
            raise OptmemInputError(
                f"unknown memory model {self.memory_model!r} (expected one of "
                f"{', '.join(MEMORY_MODELS)})", field="memory-model")
        check_temporaries(self.memory_model, self.temporaries)
        if self.chain.total_compute_time() == 0:  # every period would be 0: no valid pattern
            raise OptmemInputError("every time of the chain is 0: a pipeline needs compute "
                                   "times to have a period (profile the chain with times)",
                                   field="chain")
        if self.n_gpus > MAX_GPUS:  # per-GPU tables and models of 10^10 GPUs never end
            raise OptmemInputError(f"expected at most {MAX_GPUS} GPUs, got {self.n_gpus}",
                                   field="gpus")
        if self.weight_copies > MAX_WEIGHT_COPIES:  # 10^30 copies overflow the models
            raise OptmemInputError(f"expected at most {MAX_WEIGHT_COPIES} weight copies, got "
                                   f"{self.weight_copies}", field="weight-copies")
        self.chain.check_rate(self.chain_bandwidth)

    def settings_report(self) -> dict[str, Any]:
        """The settings of the memory check that differ from their defaults, by keyword.

        ``memory_model`` (``"strict"``), ``temporaries`` (``True``), ``weight_copies`` (not
        3), ``buffers`` (``False``) and ``chain_bandwidth`` (finite): a result's ``report``
        and ``verify pipeline`` carry them, and ``verify`` replays a result under them
        (:func:`optmem.simulate.verify.settings_as_solved`). Empty for the defaults, so
        that a result without them stays as it was.

        Examples
        --------
        >>> from optmem.datasets.synthetic import uniform_chain
        >>> PipelineProblem(uniform_chain(4), 2, 100, memory_model="strict",
        ...                 temporaries=True).settings_report()
        {'memory_model': 'strict', 'temporaries': True}
        """
        out: dict[str, Any] = {}
        if self.memory_model != "stash":
            out["memory_model"] = self.memory_model
        if self.temporaries:
            out["temporaries"] = True
        if self.weight_copies != DEFAULT_WEIGHT_COPIES:
            out["weight_copies"] = self.weight_copies
        if not self.buffers:
            out["buffers"] = False
        if math.isfinite(self.chain_bandwidth):
            out["chain_bandwidth"] = self.chain_bandwidth
        return out

    @property
    def memory_limit(self) -> int:
        """Alias of ``memory_per_gpu`` (the generic name used by reports)."""
        return self.memory_per_gpu

    @cached_property
    def layers(self) -> Layers:
        """The ``L`` layers (the loss folded into the last; temporaries if asked)."""
        return chain_layers(self.chain, temporaries=self.temporaries)

    def memory_lower_bound(self) -> int:
        """A memory per GPU below which no plan fits (a valid bound, not the least limit).

        The GPUs hold ``C x`` every weight between them, so one holds at least ``C W / P``.
        The GPU of layer ``k`` holds ``C w_k`` and, at the check of a task of ``k`` (module
        section "Memory per GPU"), under ``stash`` the micro-batch's stash ``x_k`` (a
        forward's own micro-batch counts), under ``strict`` the larger of its forward's
        task ``a_{k-1} + a_k`` and its backward's ``x_k + a_{k-1} + a_k`` (temporaries
        included when counted), whatever the allocation, grouping and schedule: a stage of
        several layers, other micro-batches, buffers and other layers' weights only add.

        Returns
        -------
        int
            ``max(ceil(C W / P), max_k C w_k + task_k)``.

        Examples
        --------
        >>> from optmem.chain import Chain
        >>> c = Chain(fwd_time=(1.0, 1.0), bwd_time=(1.0, 1.0), output_size=(3, 5),
        ...           saved_size=(3, 5), fwd_overhead=(0, 0), bwd_overhead=(0, 0),
        ...           weight_size=(4, 1), input_size=2)
        >>> PipelineProblem(c, n_gpus=2, memory_per_gpu=100).memory_lower_bound()
        14
        """
        lay = self.layers
        need = math.ceil(self.weight_copies * lay.weights(1, lay.n) / self.n_gpus)
        return int(max(need, *(self.stage_memory_floor(k, k) for k in range(1, lay.n + 1))))

    def stage_memory_floor(self, i: int, j: int) -> int:
        """A memory below which no GPU running layers ``i..j`` as one stage fits.

        Whatever the grouping and schedule, the GPU holds ``C`` copies of the stage's
        weights and at least one micro-batch of it: under ``stash`` its stash ``x(i..j)``,
        under ``strict`` the larger of its forward's and its backward's task
        (:meth:`Layers.strict_task`, the backward on top of the micro-batch's whole
        stash). Other stages, micro-batches and buffers only add. For one layer this is
        the per-layer term of :meth:`memory_lower_bound`, which holds for any plan.

        Returns
        -------
        int
            ``C w(i..j) + x(i..j)`` (stash) or ``C w(i..j) + max(fwd, x(i..j) + bwd)``
            (strict).
        """
        lay = self.layers
        task = lay.stash(i, j)
        if self.memory_model == "strict":
            fwd, bwd = lay.strict_task(i, j)
            task = max(fwd, task + bwd)
        return int(self.weight_copies * lay.weights(i, j) + task)

    def buffer_size(self, j: int) -> int:
        """Buffers held by each of the two GPUs of a cut after layer ``j`` (``2 a_j``)."""
        return 2 * self.layers.a[j] if self.buffers else 0

    def transfer_time(self, j: int) -> float:
        """Duration of one transfer of ``a_j`` (or ``delta_j``) over a link."""
        if math.isinf(self.chain_bandwidth):
            return 0.0
        return self.layers.a[j] / self.chain_bandwidth

    def static_memory(self, i: int, j: int, *, cut_before: bool, cut_after: bool) -> int:
        """Weights and buffers of a stage ``i..j`` alone on its GPU."""
        lay = self.layers
        mem = self.weight_copies * lay.weights(i, j)
        if cut_before and self.buffers:
            mem += 2 * lay.a[i - 1]
        if cut_after and self.buffers:
            mem += 2 * lay.a[j]
        return mem

    def stage_memory(self, i: int, j: int, copies: int) -> int:
        """``M(i, j, g)`` of the digest (5.2): a stage alone on a GPU with ``copies`` stashes.

        Buffers are counted at both ends except at the chain's ends (stash memory model).
        """
        return (self.static_memory(i, j, cut_before=i > 1, cut_after=j < self.layers.n)
                + copies * self.layers.stash(i, j))
