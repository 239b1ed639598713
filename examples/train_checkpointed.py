"""Train a small CNN with and without an optmem checkpointing plan; compare losses and memory.

    PYTHONPATH=. python examples/train_checkpointed.py [--steps 5] [--fraction 0.5]

Both runs start from the same weights and see the same synthetic batches and dropout masks,
so they print the same losses (bit for bit on CPU). The activation peak of each step is
measured with saved-tensor hooks (``optmem.pytorch.ActivationTracker``): the checkpointed
run keeps fewer activations alive, at the price of recomputing some forwards.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import optmem.pytorch as op
from optmem.units import format_size


def small_cnn(channels: int = 16, classes: int = 10) -> nn.Sequential:
    c = channels

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True))

    return nn.Sequential(block(3, c), block(c, c), nn.MaxPool2d(2), block(c, 2 * c),
                         block(2 * c, 2 * c), nn.MaxPool2d(2), block(2 * c, 4 * c),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                         nn.Linear(4 * c, classes))


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
          owner: nn.Module) -> tuple[list[float], int, float]:
    """A few SGD steps; returns the losses, the activation peak and the time per step."""
    opt = torch.optim.SGD(owner.parameters(), lr=0.05, momentum=0.9)
    losses, peak = [], 0
    torch.manual_seed(1234)  # same dropout masks in both runs
    start = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with op.ActivationTracker(owner, pinned=[x]) as tracker:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
        peak = max(peak, tracker.peak_bytes)
    return losses, peak, (time.perf_counter() - start) / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.5,
                    help="memory limit as a fraction of the store-all activation peak")
    args = ap.parse_args()

    torch.manual_seed(0)
    net = small_cnn()
    reference = copy.deepcopy(net)  # identical weights, trained without a plan
    batches = [(torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,)))
               for _ in range(args.steps)]
    sample = batches[0][0]

    chain = op.profile_chain(net, sample, repeats=3)
    # the limit: a fraction of what plain PyTorch needs, but no less than the smallest feasible
    limit = max(int(args.fraction * chain.store_all_peak()), op.smallest_limit(chain))
    cnet = op.checkpoint(net, sample, memory_limit=limit, chain=chain)
    print(cnet.summary())
    print("plan:", " ".join(f"[{o}]" for o in cnet.result.plan))
    print()

    ref_losses, ref_peak, ref_time = train(reference, batches, reference)
    ck_losses, ck_peak, ck_time = train(cnet, batches, net)
    print(f"{'step':>4}  {'loss (plain)':>14}  {'loss (optmem)':>14}")
    for k, (a, b) in enumerate(zip(ref_losses, ck_losses, strict=True)):
        print(f"{k:>4}  {a:14.8f}  {b:14.8f}{'' if a == b else '  DIFFERENT'}")
    print()
    print(f"measured activation peak, plain PyTorch : {format_size(ref_peak)}"
          f"  ({ref_time * 1e3:.1f} ms/step)")
    print(f"measured activation peak, optmem plan   : {format_size(ck_peak)}"
          f"  ({ck_time * 1e3:.1f} ms/step)")
    print(f"predicted peak of the plan (limit {format_size(limit)}): "
          f"{format_size(cnet.expected_peak_bytes)}")
    same = ref_losses == ck_losses
    print("same losses:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
