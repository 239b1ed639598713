"""Stop 87 census: transformers 5.25 causal-LM families no earlier sweep had named.

``benchmarks/census_hf.py`` builds each model type's default config shrunk to a tiny one
(2 layers, hidden 32, vocabulary 100, 4 experts; random initialisation, nothing downloaded)
through ``AutoModelForCausalLM.from_config`` and compares one training step under the three
one-liners with the plain model's, bitwise (``docs/pytorch.md``, "Stop 87 (census: causal
LMs)"). This file keeps a representative set of the new families at 60 % through
:func:`hf_helpers.check_one_liner` (exported, a plan that re-runs, the state-dict keys, the
step bitwise, the real peak within the limit plus the plan's allowance): Ministral 3,
DeepSeek-V4 (compressed attention, hash-routed experts), MiniCPM3 and LongCat-Flash
(multi-head latent attention), NanoChat, HunYuan-MoE, FlexOlmo, GLM-MoE-DSA (its sparse
attention's indexer), Megatron-BERT as a decoder; and one census row under the three
one-liners.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import census_hf  # noqa: E402
from hf_helpers import check_one_liner  # noqa: E402
from test_hf_zoo import fixed_times  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = [
    "ministral3",
    "deepseek_v4",
    "minicpm3",
    "longcat_flash",
    "nanochat",
    "hunyuan_v1_moe",
    "flex_olmo",
    "glm_moe_dsa",
    "megatron-bert",
]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_new_family_trains_bitwise_at_60_percent(model_type: str) -> None:
    model, kwargs = census_hf.build(model_type)
    check_one_liner(model, kwargs, time_model=fixed_times)


def test_census_row_under_the_three_one_liners() -> None:
    """The tool's row: each one-liner at 60 %, one step bitwise the plain model's."""
    assert census_hf.row("nanochat") == (
        "| nanochat | 60%: bitwise | 60%: bitwise | 60%: bitwise |"
    )


def test_census_tiny_config_shrinks_every_sub_config() -> None:
    """A multimodal type's text config is tiny too (its per-layer configs derived again)."""
    config = census_hf.tiny_config("gemma4_unified")
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (32, 2, 100)
