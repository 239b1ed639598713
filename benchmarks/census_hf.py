"""Census of transformers causal-LM families under the three one-liners (tiny random configs).

For each model type given (``transformers`` names, e.g. ``ministral3 nanochat``): its
default config shrunk to a tiny one (:func:`tiny_config`: 2 layers, hidden 32, 2 heads,
vocabulary 100, 4 experts of which 2 per token; every sub-config alike;
:data:`OVERRIDES` where a family needs more), built with
``AutoModelForCausalLM.from_config`` (random initialisation, nothing downloaded), a batch of
2 x 16 token ids, their own labels. Under ``op.checkpoint``, ``op.offload`` and
``op.remat_offload`` (``fast_path=False``, fixed stage times, ``bandwidth="1MB/s"``) at
``"60%"``, else ``"85%"``, ``"95%"``, ``"min"`` (the first limit with a plan), one training step
is compared with a deep copy of the plain model under the same seed: loss, every output
tensor and every parameter gradient, bitwise. One markdown row per type: per one-liner, the
limit used and ``bitwise``; ``DIFF`` (the largest difference, and whether the plain model
with ``is_torchdynamo_exporting()`` forced true is bitwise: the model's own branch);
``refused: <message>`` (one ``OptmemInputError``); ``build fails`` or ``plain fails`` (the
config or the model itself, without optmem); or ``ERROR <type>: <message>`` (anything
else: a defect). Deterministic: fixed seeds, fixed stage times, one thread.

    PYTHONPATH=. python benchmarks/census_hf.py ministral3 nanochat [--markdown out.md]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import optmem.pytorch as op
from optmem.errors import OptmemInputError

BATCH, SEQ, VOCAB = 2, 16, 100
LIMITS = ("60%", "85%", "95%", "min")
KINDS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "checkpoint": (op.checkpoint, {}),
    "offload": (op.offload, {"bandwidth": "1MB/s"}),
    "remat_offload": (op.remat_offload, {"bandwidth": "1MB/s"}),
}
FIXED: dict[str, Any] = {
    "fast_path": False,
    "repeats": 1,
    "warmup": 0,
    "time_model": lambda *_: (1.0, 2.0),
}

#: Tiny values of the config fields most families share (set where the field exists).
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "sliding_window": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "n_positions": 64,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "d_ff": 64,
    "ffn_dim": 64,
    "num_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 2,
    "encoder_attention_heads": 2,
    "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "embedding_size": 32,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "o_lora_rank": 16,
    "o_groups": 1,
    "num_nextn_predict_layers": 0,
    "shape_vocab_size": VOCAB,
    "pronunciation_vocab_size": VOCAB,
    "shape_embed_dim": 16,
    "pronunciation_embed_dim": 16,
    "dim_ff": 64,
    "expert_ffn_hidden_size": 32,
    "ffn_hidden_size": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
#: Per family: fields beyond :data:`TINY` (applied last, sub-configs as dictionaries).
OVERRIDES: dict[str, dict[str, Any]] = {
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},
    "gemma4_assistant": {
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
            "num_kv_shared_layers": 0,
        }
    },
    "gemma4_unified_assistant": {"text_config": {"num_kv_shared_layers": 2}},
    "qwen4_exp": {
        "text_config": {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 2,
        }
    },
    "dots3_note": {
        "vision_config": {"adapter_in_dim": 32, "adapter_out_dim": 32},
        "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32},
    },
    "kolibri1_1": {
        "index_num_heads": 1,
        "index_layers": [1],
        "mlp_only_layers": [0],
        "mlp_only_intermediate_size": 64,
        "index_topk": 8,
        "index_pool_size": 16,
        "index_compression": 2,
        "index_num_local_tokens": 4,
        "index_num_sink_tokens": 1,
    },
    "bailing_hybrid": {
        "linear_head_dim": 16,
        "linear_num_heads": 2,
        "num_expert_group": 1,
        "num_experts_per_token": 2,
        "layer_group_size": 2,
        "layer_types": ["linear_attention", "full_attention"],
    },
    "dory": {
        "num_hidden_layers": 4,
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
    },
}


def _per_layer(value: Any, layers: int | None) -> Any:
    """A per-layer list shrunk to two layers, keeping its first two distinct kinds."""
    if not isinstance(value, list) or layers is None or len(value) != layers or layers <= 2:
        return value
    kinds = list(dict.fromkeys(map(repr, value)))[:2]
    first = [next(v for v in value if repr(v) == k) for k in kinds]
    return (first * 2)[:2]


def tiny_kwargs(config: PretrainedConfig) -> dict[str, Any]:
    """The constructor arguments that shrink ``config`` (recursively into sub-configs)."""
    fields = config.to_dict()
    layers = fields.get("num_hidden_layers")
    out: dict[str, Any] = {}
    for key, value in fields.items():
        sub = vars(config).get(key)
        if isinstance(sub, PretrainedConfig):
            whole = {k: v for k, v in sub.to_dict().items() if k != "per_layer_config"}
            out[key] = {**whole, **tiny_kwargs(sub)}  # per-layer configs: derived again
        elif key in TINY and value is not None and not isinstance(value, (dict, bool)):
            out[key] = TINY[key]
        elif isinstance(value, list):
            shrunk = _per_layer(value, layers)
            if shrunk is not value:
                out[key] = shrunk
    if "qk_rope_head_dim" in fields:  # MLA: rotary on the rope part, as many kv heads as q
        out.update(
            {
                k: v
                for k, v in (
                    ("head_dim", TINY["qk_rope_head_dim"]),
                    ("num_key_value_heads", TINY["num_attention_heads"]),
                )
                if k in fields
            }
        )
    return out


def tiny_config(model_type: str) -> PretrainedConfig:
    """The model type's default config with :data:`TINY` and :data:`OVERRIDES` applied."""
    extra = OVERRIDES.get(model_type, {})
    try:
        default = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001  (a default transformers cannot build: Gemma 4 Assistant)
        default = AutoConfig.for_model(model_type, **extra)
    kwargs = tiny_kwargs(default)
    for key, value in extra.items():  # a sub-config's overrides merge into its tiny fields
        kwargs[key] = {**kwargs[key], **value} if isinstance(kwargs.get(key), dict) else value
    return AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model (random initialisation, seed 0, train mode) and its batch."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def run_step(
    call: Callable[..., Any], owner: torch.nn.Module, kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """Loss, output tensors and every parameter gradient of one step (seed 5)."""
    owner.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    out = call(**kwargs)
    out.loss.backward()
    values = [out.loss.detach()] + [v.detach() for v in out.values() if isinstance(v, torch.Tensor)]
    values += [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in owner.parameters()]
    owner.zero_grad(set_to_none=True)
    return values


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str:
    """``bitwise``, or the largest difference and where: ``value k of n`` in
    :func:`run_step`'s order (the loss, the output tensors, each parameter's gradient)."""
    if len(got) != len(ref) or any(a.shape != b.shape for a, b in zip(got, ref, strict=True)):
        return "DIFFERENT outputs or gradients"
    diffs = [
        (float((a.double() - b.double()).abs().max()), k)
        for k, (a, b) in enumerate(zip(got, ref, strict=True))
        if a.numel() and not torch.equal(a, b)
    ]
    if not diffs:
        return "bitwise"
    worst, where = max(diffs)
    return f"DIFF {worst:.1e} at value {where} of {len(got)} ({len(diffs)} differ)"


def own_branch(
    plain: torch.nn.Module, kwargs: dict[str, Any], got: list[torch.Tensor], ref: list[torch.Tensor]
) -> str:
    """Where a step differs: whether the plain model with its modeling module's
    ``is_torchdynamo_exporting()`` forced true (the code torch.export runs) gives the
    wrapped step bitwise (the model's own branch, e.g. ``solve_triangular`` in eager mode,
    a forward substitution under export)."""
    module = sys.modules[type(plain).__module__]
    if compare(got, ref) == "bitwise" or not hasattr(module, "is_torchdynamo_exporting"):
        return ""
    with mock.patch.object(module, "is_torchdynamo_exporting", lambda: True):
        exporting = run_step(plain, plain, kwargs)
    return (
        "; bitwise the model with is_torchdynamo_exporting() forced (its own branch)"
        if compare(got, exporting) == "bitwise"
        else ""
    )


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def check(model_type: str, kind: str) -> tuple[str, str]:
    """The limit used and the result of one one-liner on one family."""
    wrap, options = KINDS[kind]
    try:
        model, kwargs = build(model_type)
    except Exception as exc:  # noqa: BLE001  (transformers' own failure)
        return "-", f"build fails: {_short(exc)}"
    plain = copy.deepcopy(model)
    try:
        ref = run_step(plain, plain, kwargs)
    except Exception as exc:  # noqa: BLE001  (the model's own failure)
        return "-", f"plain fails: {_short(exc)}"
    for limit in LIMITS:
        try:
            wrapped = wrap(model, kwargs, memory_limit=limit, **options, **FIXED)
        except OptmemInputError as exc:
            if exc.field == "memory_limit" and limit != LIMITS[-1]:
                continue
            return limit, f"refused: {_short(exc)}"
        except Exception as exc:  # noqa: BLE001  (a defect: reported)
            return limit, f"ERROR {_short(exc)}"
        try:
            got = run_step(wrapped, model, kwargs)
        except Exception as exc:  # noqa: BLE001
            return limit, f"ERROR in step {_short(exc)}"
        return limit, compare(got, ref) + own_branch(plain, kwargs, got, ref)
    return LIMITS[-1], "no plan"


def row(model_type: str) -> str:
    """The markdown row of one type: per one-liner, the limit used and the result."""
    cells = [
        f"{limit}: {result}" if limit != "-" else result
        for limit, result in (check(model_type, kind) for kind in KINDS)
    ]
    return f"| {model_type} | " + " | ".join(cells) + " |"


def main() -> None:
    """Print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="+", help="transformers model types")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    lines = ["| type | checkpoint | offload | remat_offload |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for model_type in args.types:
        lines.append(row(model_type))
        print(lines[-1], flush=True)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
