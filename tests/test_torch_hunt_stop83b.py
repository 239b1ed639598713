"""Hunt of the torch bridge inside training frameworks: HuggingFace's ``Trainer``,
accelerate, ``torch.distributed.checkpoint`` (stop 83; ``docs/pytorch.md``, "Stop 83
(training frameworks)").

``Trainer`` reads two things of a model beside calling it: its name
(``model._get_name()``: label smoothing shifts the labels only for a causal language model)
and its ``forward`` signature (the dataset columns it keeps), both of a ``PeftModel``'s base
model. The wrapper gave its own class name, so a wrapped causal LM under
``label_smoothing_factor`` was trained on unshifted labels, in silence; and a wrapped
``PeftModel`` without a task type (``forward(*args, **kwargs)``) had every column dropped.
The wrapper now shows the model's name and signature (a PEFT model's base model's).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers", reason="the HF tests need transformers")
peft = pytest.importorskip("peft", reason="the LoRA test needs peft (dev extra)")

from hf_helpers import TokenDataset, gpt2  # noqa: E402
from pytorch_helpers import HUNT_FIXED  # noqa: E402

import optmem.pytorch as op  # noqa: E402

FIXED = HUNT_FIXED


def _trainer(model: Any, out: Path, **options: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, learning_rate=1e-2, label_names=["labels"], **options)
    return transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())


def _losses(trainer: Any) -> list[float]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("wrap", [op.checkpoint, op.remat_offload])
def test_label_smoothing_of_a_wrapped_causal_lm_shifts_the_labels(tmp_path, wrap):
    """``Trainer(label_smoothing_factor=0.1)`` trains a wrapped GPT-2 as the plain model
    (main: the wrapper's class name is no causal LM's, the labels were smoothed unshifted:
    losses 4.248 against 4.360 at the first step)."""
    model, sample = gpt2()
    ref = copy.deepcopy(model)
    extra = {"bandwidth": "1MB/s"} if wrap is op.remat_offload else {}
    cmodel = wrap(model, sample, **FIXED, **extra)
    assert cmodel._get_name() == "GPT2LMHeadModel"
    assert repr(cmodel).startswith(type(cmodel).__name__ + "(")
    expected = _losses(_trainer(ref, tmp_path, label_smoothing_factor=0.1))
    assert _losses(_trainer(cmodel, tmp_path, label_smoothing_factor=0.1)) == expected
    assert _same_weights(ref, model)


def _lora(task_type: str | None) -> tuple[Any, dict[str, Any]]:
    model, sample = gpt2()
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0,
                             task_type=task_type)
    return peft.get_peft_model(model, config), sample


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_trainer_sees_a_wrapped_peft_model_as_the_peft_model(tmp_path, task_type):
    """The columns ``Trainer`` keeps and its label-smoothed training are the plain
    ``PeftModel``'s (main: without a task type every column was dropped, "You have to
    specify either input_ids or inputs_embeds"; with ``CAUSAL_LM`` the columns lacked
    GPT-2's ``token_type_ids`` and ``position_ids`` and the labels were not shifted)."""
    ref, sample = _lora(task_type)
    model, _ = _lora(task_type)
    cmodel = op.checkpoint(model, sample, **FIXED)
    plain = _trainer(ref, tmp_path, label_smoothing_factor=0.1)
    expected = _losses(plain)  # each Trainer seeds the RNG when it is built: one at a time
    wrapped = _trainer(cmodel, tmp_path, label_smoothing_factor=0.1)
    assert _losses(wrapped) == expected
    assert _same_weights(ref, model)
    for trainer in (plain, wrapped):
        trainer._signature_columns = None
        trainer._set_signature_columns_if_needed()
    assert wrapped._signature_columns == plain._signature_columns
