"""Synthetic chains: uniform chains, seeded random heterogeneous chains, the papers' gadgets.

* :func:`uniform_chain`: identical stages (thesis chapter 1 setting).
* :func:`random_chain`: seeded heterogeneous chain with network-like shapes (activation sizes
  that shrink by stages, tapes 1-3x the output, backward about twice the forward).
* :func:`resnet_like_chain`: a deterministic ResNet-shaped chain for demos.
* :func:`counterexample_chain`: the non-persistence family of thesis section 2.3.1
  (``rotor.md`` oracle O1).
* :func:`partition_chain`: the 2-Partition reduction of thesis Theorem 4 (oracle O2).
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
