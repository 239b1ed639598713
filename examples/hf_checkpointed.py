"""Train a HuggingFace Llama (random initialisation) with and without an optmem plan.

    PYTHONPATH=. python examples/hf_checkpointed.py [--layers 4] [--steps 3] [--fraction 0.6]

``op.checkpoint(model, batch, memory_limit=...)`` exports the model (``torch.export``), cuts
it into stages (attention and MLP halves of every layer, embeddings, norm, head, loss),
profiles them on the batch and wraps the model with the fastest plan under the limit. The
wrapped model is called like the model and returns its ``CausalLMOutputWithPast``; both
runs start from the same weights and print the same losses (bit for bit on CPU).
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import optmem.pytorch as op
from optmem.units import format_size


def train(model: torch.nn.Module, owner: torch.nn.Module,
          batches: list[torch.Tensor]) -> list[float]:
    """A few AdamW steps on ``owner``'s parameters through ``model``; the losses."""
    opt = torch.optim.AdamW(owner.parameters(), lr=1e-3)
    losses = []
    torch.manual_seed(1234)
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.6,
                    help="memory limit as a fraction of the store-all activations")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, max_position_embeddings=256)
    plain = LlamaForCausalLM(config)
    model = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (args.batch, args.seq), generator=g)
               for _ in range(args.steps)]
    sample = {"input_ids": batches[0], "labels": batches[0]}

    chain = op.profile_chain(model, sample, repeats=1, warmup=0)
    limit = int(args.fraction * chain.store_all_peak())
    cmodel = op.checkpoint(model, sample, memory_limit=limit, chain=chain)
    print(cmodel.summary())
    print(f"limit {format_size(limit)} ({args.fraction:.0%} of store-all); "
          f"{cmodel.chain.length} stages: {', '.join(cmodel.stage_names[:4])}, ...")
    ref = train(plain, plain, batches)
    got = train(cmodel, model, batches)
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        print(f"step {k}: plain {a:.6f}  optmem {b:.6f}{'' if a == b else '  DIFFERENT'}")
    print(f"same losses: {ref == got}")


if __name__ == "__main__":
    main()
