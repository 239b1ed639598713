"""Synthetic chains: uniform chains, seeded random heterogeneous chains, the papers' gadgets.

* :func:`uniform_chain`: identical stages (thesis chapter 1 setting).
* :func:`random_chain`: seeded heterogeneous chain with network-like shapes (activation sizes
  that shrink by stages, tapes 1-3x the output, backward about twice the forward).
* :func:`resnet_like_chain`: a deterministic ResNet-shaped chain for demos.
* :func:`counterexample_chain`: the non-persistence family of thesis section 2.3.1
  (``rotor.md`` oracle O1).
* :func:`partition_chain`: the 2-Partition reduction of thesis Theorem 4 (oracle O2).
* :func:`random_pipeline_chain`: seeded pipeline profiles with weights (transformer or CNN).
* :func:`offload_partition_chain`: the 2-Partition reduction of OFF_comm (thesis Theorem 9).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optmem.chain import Chain


def uniform_chain(
    n: int, *, fwd_time: float = 1.0, bwd_time: float = 2.0, output_size: int = 1,
    saved_size: int = 2, input_size: int | None = None, seed: int | None = None,
) -> Chain:
    """A chain of ``n`` identical stages (``seed`` is accepted for a uniform signature).

    Examples
    --------
    >>> uniform_chain(3).saved_size
    (2, 2, 2)
    """
    del seed
    return Chain.from_lists(
        [fwd_time] * n, [bwd_time] * n, [output_size] * n, [saved_size] * n,
        input_size=output_size if input_size is None else input_size, name=f"uniform-{n}",
    )


def random_chain(
    n: int, *, seed: int | None = None, max_size: int = 10, overheads: bool = True,
    integer_times: bool = True,
) -> Chain:
    """A seeded random heterogeneous chain (small integers by default, for exact tests).

    Examples
    --------
    >>> random_chain(4, seed=1) == random_chain(4, seed=1)
    True
    """
    rng = np.random.default_rng(seed)
    out = rng.integers(1, max_size + 1, n)
    saved = out + rng.integers(0, max_size + 1, n)
    fwd = rng.integers(0, 6, n).astype(float) if integer_times else rng.uniform(0.1, 5, n)
    bwd = rng.integers(0, 8, n).astype(float) if integer_times else rng.uniform(0.2, 10, n)
    of = rng.integers(0, max_size // 2 + 1, n) if overheads else np.zeros(n, int)
    ob = rng.integers(0, max_size // 2 + 1, n) if overheads else np.zeros(n, int)
    return Chain.from_lists(
        fwd.tolist(), bwd.tolist(), out.tolist(), saved.tolist(),
        input_size=int(rng.integers(1, max_size + 1)), fwd_overhead=of.tolist(),
        bwd_overhead=ob.tolist(), loss_bwd_time=float(rng.integers(0, 3)),
        loss_bwd_overhead=int(rng.integers(0, 3)) if overheads else 0,
        name=f"random-{n}-seed{seed}",
    )


def resnet_like_chain(
    n: int = 40, *, batch: int = 32, resolution: int = 224, seed: int | None = 0,
) -> Chain:
    """A ResNet-shaped chain in bytes and milliseconds (four resolutions, doubling channels).

    Stage ``k`` of ``n`` belongs to one of four groups; activation sizes drop 2x per group
    (spatial /4, channels x2), forward times stay roughly flat, tapes are 2.5-3.5x the output.
    """
    rng = np.random.default_rng(seed)
    groups = np.minimum(4 * np.arange(n) // n, 3)
    base = batch * 64 * (resolution // 4) ** 2 * 4  # float32 bytes of the first group
    out = (base / 2.0 ** groups * rng.uniform(0.9, 1.1, n)).astype(np.int64)
    saved = (out * rng.uniform(2.5, 3.5, n)).astype(np.int64)
    fwd = np.round(rng.uniform(0.8, 1.2, n) * batch * resolution**2 / 2.0e6, 3)
    bwd = np.round(fwd * rng.uniform(1.8, 2.2, n), 3)
    of = (out * rng.uniform(0.0, 0.5, n)).astype(np.int64)
    ob = (out * rng.uniform(0.5, 1.5, n)).astype(np.int64)
    return Chain.from_lists(
        fwd.tolist(), bwd.tolist(), out.tolist(), saved.tolist(),
        input_size=batch * 3 * resolution**2 * 4, fwd_overhead=of.tolist(),
        bwd_overhead=ob.tolist(), loss_bwd_time=0.1, name=f"resnet-like-{n}-b{batch}",
    )


def counterexample_chain(n: int) -> Chain:
    """Thesis section 2.3.1 family (``L = n + 2``, use ``M = 15``): persistence costs 3/2.

    Persistent optimum ``3n - 2``; exact optimum (pinning, no discard) ``min(3n-2, 2n+2)``.
    """
    length = n + 2
    x = [0, 1] + [3] * (length - 2) + [4]
    return Chain.from_rotor([n - 2, 2] + [0] * (length - 2), [0] * (length + 1), x, x,
                            name=f"counterexample-{n}")


def partition_chain(values: Sequence[int]) -> tuple[Chain, int, float]:
    """2-Partition gadget of thesis Theorem 4; returns ``(chain, M = 3V, T = 4V + U_B)``.

    A plan of makespan ``<= T`` exists under ``M`` iff ``values`` split into two halves of
    equal sum ``V``.
    """
    total = sum(values)
    v = total // 2
    fw: list[float] = []
    x: list[int] = [0]
    for value in values:
        fw += [value, 0]
        x += [value, 0]
    fw.append(v)
    x.append(v)
    length = len(fw)
    bw = [1.0] * (length + 1)
    return (Chain.from_rotor(fw, bw, x, x, name=f"partition-{'-'.join(map(str, values))}"),
            3 * v, 4 * v + float(length + 1))


def random_pipeline_chain(
    n: int, *, seed: int | None = None, kind: str = "transformer", batch: int = 8,
    width: int = 1024, sequence: int = 512, jitter: float = 0.2,
) -> Chain:
    """A seeded random pipeline profile with weights, in bytes and milliseconds.

    Shaped like the layers pipelined model parallelism splits (``madpipe.md``): ``kind =
    "transformer"`` gives ``n`` decoder blocks of width ``width`` (weights ``12 w^2`` float32
    parameters, activations ``batch * sequence * w``, tapes about 16x that, forward time
    proportional to ``24 batch sequence w^2`` FLOPs at 10 TFLOP/s, backward 2x); ``"cnn"``
    gives ``n`` convolution blocks whose activations shrink and weights grow with depth.
    Every quantity is multiplied by a seeded factor in ``[1 - jitter, 1 + jitter]``.

    Examples
    --------
    >>> c = random_pipeline_chain(6, seed=3)
    >>> c.length, min(c.weight_size) > 0
    (6, True)
    >>> random_pipeline_chain(4, seed=1) == random_pipeline_chain(4, seed=1)
    True
    """
    if kind not in ("transformer", "cnn"):
        raise ValueError(f"kind must be 'transformer' or 'cnn', got {kind!r}")
    rng = np.random.default_rng(seed)

    def noise() -> np.ndarray:
        return rng.uniform(1 - jitter, 1 + jitter, n)

    if kind == "transformer":
        act = np.full(n, 4.0 * batch * sequence * width)
        weights = np.full(n, 4.0 * 12 * width**2)
        flops = np.full(n, 24.0 * batch * sequence * width**2)
        tape = 16.0
    else:
        depth = np.arange(n) / max(n - 1, 1)
        act = 4.0 * batch * 64 * 112**2 * 2.0 ** (-3 * depth)
        weights = 4.0 * 9 * 64**2 * 4.0 ** (3 * depth)
        flops = np.full(n, 2.0 * batch * 9 * 64**2 * 112**2)
        tape = 3.0
    out = (act * noise()).astype(np.int64)
    saved = (out * tape * noise()).astype(np.int64)
    fwd = np.round(flops * noise() / 1e10, 4)
    bwd = np.round(2 * fwd * noise(), 4)
    return Chain.from_lists(
        fwd.tolist(), bwd.tolist(), out.tolist(), saved.tolist(),
        input_size=int(out[0]), weight_size=(weights * noise()).astype(np.int64).tolist(),
        fwd_overhead=(out * 0.5 * noise()).astype(np.int64).tolist(),
        bwd_overhead=(out * noise()).astype(np.int64).tolist(),
        loss_bwd_time=float(round(fwd.mean() / 4, 4)),
        name=f"pipeline-{kind}-{n}-seed{seed}",
    )


def offload_partition_chain(values: Sequence[int]) -> tuple[Chain, int, float, float]:
    """2-Partition gadget of OFF_comm (thesis Theorem 9, ``offload.md`` section 2.2).

    Returns ``(chain, M = 2V, bandwidth = V, T = 2)`` where ``sum(values) = 2V``: the
    offloading problem has a plan of makespan ``T`` under ``M`` iff ``values`` split into two
    halves of sum ``V`` (offload one half during the only costly forward, prefetch it back
    during its backward).

    The thesis' layers ``1..n+2`` are stages ``2..n+3`` here, after a first stage of zero
    cost that produces the thesis' input ``abar_0 = x_1`` (so that ``delta^0``, sized like
    the chain input, is 0 as the gadget's ``delta = 0`` requires). Every ``output_size`` is
    0 (``delta = 0``); ``saved_size`` carries the tapes: ``x_1 .. x_n``, then 0, 0, ``V``.

    Examples
    --------
    >>> chain, m, bw, t = offload_partition_chain([1, 1, 2])
    >>> chain.length, m, bw, t, chain.saved_size
    (6, 4, 2.0, 2.0, (1, 1, 2, 0, 0, 2))
    """
    total = sum(values)
    if total % 2 or any(v <= 0 for v in values):
        raise ValueError(f"expected positive values with an even sum, got {list(values)}")
    v = total // 2
    saved = [*values, 0, 0, v]
    length = len(saved)
    fwd = [0.0] * length
    fwd[-2] = 1.0  # the thesis' layer n+1
    return (Chain.from_lists(fwd, list(fwd), [0] * length, saved, input_size=0,
                             name=f"offload-partition-{'-'.join(map(str, values))}"),
            2 * v, float(v), 2.0)
