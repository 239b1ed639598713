"""A wrapped model in users' training loops: HuggingFace's ``Trainer``, gradient accumulation
with clipping and ``zero_grad(set_to_none=True)``, ``GradScaler`` under bf16 autocast, and
``generate()`` between training steps (tiny GPT-2 and Llama configs, random weights).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
transformers = pytest.importorskip("transformers", reason="the HF tests need transformers")

from hf_helpers import TokenDataset, gpt2, llama, step  # noqa: E402

import optmem.pytorch as op  # noqa: E402


def _pair(factory: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """A plain copy of a tiny model, the model itself and its wrapper at 60 %."""
    model, kwargs = factory()
    ref = copy.deepcopy(model)
    cmodel = op.checkpoint(model, kwargs, memory_limit="60%", repeats=1, warmup=0,
                           fast_path=False)
    return ref, model, cmodel, kwargs


def _params(module: Any) -> list[Any]:
    return [p.detach().clone() for p in module.parameters()]


def _equal(a: list[Any], b: list[Any]) -> bool:
    assert len(a) == len(b)
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _train(model: Any, out: Path) -> tuple[list[float], Any]:
    """Three optimizer steps of ``Trainer`` (2 micro-batches each, clipped), then ``save_model``."""
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, weight_decay=0.5,
        learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    trainer.save_model(str(out / "final"))
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def test_trainer_trains_saves_and_reloads_a_model_whose_backbone_is_wrapped(tmp_path):
    """``model.transformer = op.checkpoint(model.transformer, ...)`` (docs/pytorch.md,
    *HuggingFace's Trainer*): ``Trainer`` sees a ``PreTrainedModel``, its losses and final
    weights are the plain model's bitwise, and ``save_model`` writes a checkpoint (tied
    embedding included) that ``from_pretrained`` loads into a plain model with the same
    weights. Wrapping the whole model instead made ``save_model`` fail: ``Trainer`` saves a
    module that is not a ``PreTrainedModel`` with safetensors' ``save_file``, which refuses
    GPT-2's tied ``wte``/``lm_head`` ("Some tensors share memory"); and its weight decay
    reached no parameter (its names, from ``named_children()``, carry
    ``_checkpoint_wrapped_module.``; the optimizer's, from ``named_parameters()``, do not)."""
    plain, _ = gpt2()
    ref_losses, ref_trainer = _train(plain, tmp_path / "plain")
    model, kwargs = gpt2()
    model.transformer = op.checkpoint(model.transformer, {"input_ids": kwargs["input_ids"]},
                                      memory_limit="60%", repeats=1, warmup=0, fast_path=False)
    losses, trainer = _train(model, tmp_path / "wrapped")
    assert losses == ref_losses and len(losses) == 3
    # weight decay on the same parameters (10 of GPT-2's 28: not biases, not LayerNorms)
    groups = [len(g["params"]) for g in trainer.optimizer.param_groups]
    assert groups == [len(g["params"]) for g in ref_trainer.optimizer.param_groups] == [10, 18]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert _equal(_params(model), _params(plain))
    assert (tmp_path / "wrapped" / "final" / "config.json").exists()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "wrapped" / "final")
    assert list(reloaded.state_dict()) == list(plain.state_dict())
    assert _equal(list(reloaded.state_dict().values()), list(plain.state_dict().values()))


def test_a_wrapped_whole_model_saves_with_save_pretrained(tmp_path):
    """Outside ``Trainer``, ``cmodel.save_pretrained`` is the model's (forwarded) and writes a
    checkpoint a plain model reloads with the same weights, after a training step."""
    ref, model, cmodel, kwargs = _pair(gpt2)
    step(cmodel, model, kwargs, seed=2)[0].loss.detach()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    cmodel.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert list(reloaded.state_dict()) == list(model.state_dict())
    assert _equal(list(reloaded.state_dict().values()), list(model.state_dict().values()))


def test_gradient_accumulation_clipping_and_set_to_none_match_the_plain_loop():
    """Two AdamW steps of three micro-batches each (dropout 0.1 drawn per micro-batch),
    ``clip_grad_norm_`` and ``zero_grad(set_to_none=True)``: the clipped norms and the final
    parameters are the plain model's bitwise."""
    ref, model, cmodel, kwargs = _pair(gpt2)
    runs = []
    for net, owner in ((ref, ref), (cmodel, model)):
        opt = torch.optim.AdamW(owner.parameters(), lr=1e-3)
        norms = []
        for it in range(2):
            for micro in range(3):
                torch.manual_seed(10 * it + micro)
                net(**kwargs).loss.div(3).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(owner.parameters(), 0.5))
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert all(p.grad is None for p in owner.parameters())
        runs.append((norms, _params(owner)))
    assert _equal(runs[0][0], runs[1][0])
    assert _equal(runs[0][1], runs[1][1])


def test_grad_scaler_under_bf16_autocast_matches_the_plain_step():
    """``torch.amp.GradScaler("cpu")`` around a bf16-autocast step of tiny Llama: the loss and
    the updated parameters are the plain model's bitwise."""
    ref, model, cmodel, kwargs = _pair(llama)
    runs = []
    for net, owner in ((ref, ref), (cmodel, model)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt = torch.optim.SGD(owner.parameters(), lr=1e-2)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(**kwargs).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        runs.append((loss.detach(), _params(owner)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert _equal(runs[0][1], runs[1][1])


def test_generate_between_training_steps():
    """Greedy ``generate()`` in eval mode is the model's, and the training step after
    ``train()`` is still bitwise the model's (the generation cache leaves no trace)."""
    ref, model, cmodel, kwargs = _pair(gpt2)
    ref.eval()
    cmodel.eval()
    prompt = kwargs["input_ids"][:, :5]
    want = ref.generate(prompt, max_new_tokens=5, do_sample=False)
    got = cmodel.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    ref.train()
    cmodel.train()
    assert model.training and all(m.training for m in model.modules())
    (ref_out, ref_grads), (out, grads) = (step(ref, ref, kwargs, seed=3),
                                          step(cmodel, model, kwargs, seed=3))
    assert torch.equal(out.loss, ref_out.loss)
    assert _equal(grads, ref_grads)


def _eval_loss(model: Any, out: Path, **options: Any) -> dict[str, float]:
    """``Trainer.evaluate`` of ``model`` on the eight sequences (batches of 4)."""
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_eval_batch_size=4, report_to=[], use_cpu=True,
        disable_tqdm=True, **options)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=TokenDataset())
    return trainer.evaluate()


def test_trainer_evaluates_a_wrapped_backbone_and_a_whole_model_given_label_names(tmp_path):
    """``Trainer.evaluate`` reports the plain model's ``eval_loss`` for a model whose backbone
    is wrapped, and for a whole-model wrapper given ``label_names=["labels"]``. Without it,
    ``Trainer`` finds no labels for the whole-model wrapper (``find_labels`` reads the
    *class*'s ``forward`` signature, the wrapper's ``forward(*args, **kwargs)``): the loss is
    not computed and ``eval_loss`` is missing from the metrics (docs/pytorch.md)."""
    plain, kwargs = gpt2()
    want = _eval_loss(plain, tmp_path / "plain")["eval_loss"]
    model, _ = gpt2()
    model.transformer = op.checkpoint(model.transformer, {"input_ids": kwargs["input_ids"]},
                                      memory_limit="60%", repeats=1, warmup=0, fast_path=False)
    assert _eval_loss(model, tmp_path / "backbone")["eval_loss"] == want
    whole, _ = gpt2()
    cmodel = op.checkpoint(whole, kwargs, memory_limit="60%", repeats=1, warmup=0,
                           fast_path=False)
    got = _eval_loss(cmodel, tmp_path / "whole", label_names=["labels"])
    assert got["eval_loss"] == want


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.linear = torch.nn.Linear(32, 32)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: Any) -> Any:
        return x + self.drop(torch.relu(self.linear(self.norm(x))))


def test_a_dropout_schedule_after_wrapping_is_followed():
    """A dropout schedule sets ``dropout.p`` between steps: the wrapped step uses the new
    probability, as the plain model does, bitwise. Before, export had baked ``p`` into the
    graph and the wrapper kept dropping 10 % of the units at ``p = 0.5`` and ``p = 0``, in
    silence (gradients differed from the plain model's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), *[_Block() for _ in range(6)],
                                torch.nn.Linear(32, 4))
    model = torch.nn.ModuleDict({"net": model})  # not an nn.Sequential: exported
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    class Net(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return self.inner["net"](x)

    net, ref = Net(model), Net(plain)
    cmodel = op.checkpoint(net, x, memory_limit="60%", repeats=1, warmup=0, fast_path=False)
    assert cmodel.extraction is not None
    for p in (0.5, 0.0, 0.1):
        for module in (*model.modules(), *plain.modules()):
            if isinstance(module, torch.nn.Dropout):
                module.p = p
        grads = []
        for call, owner in ((ref, plain), (cmodel, model)):
            owner.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            call(x).square().mean().backward()
            grads.append([q.grad.clone() for q in owner.parameters()])
        assert _equal(*grads), f"p = {p}"
