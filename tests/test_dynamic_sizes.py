"""Calls that differ in tensor sizes only share one export (``optmem.pytorch.wrapper``, *Sizes*).

Training with dynamic padding calls the model with a new sequence length at almost every
step. Before, each length was exported again (about 1.7 s for a 12-layer GPT-2), profiled
and solved; with more than ``MAX_VARIANTS`` lengths in rotation, again and again. Now the
second size exports the model once with the changed dimensions dynamic, each size is
profiled and solved once, and a size at most ``SIZE_SLACK`` times smaller than a solved one
runs that plan. Every call stays bitwise the plain model's.
"""

from __future__ import annotations

import copy
import pickle

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
pytest.importorskip("transformers", reason="the HF tests need transformers (dev extra)")

from hf_helpers import VOCAB, assert_same, bert, gpt2, llama, step  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch import extract  # noqa: E402
from optmem.pytorch.memory import measure_training_peak  # noqa: E402
from optmem.pytorch.wrapper import SIZE_SLACK, covers  # noqa: E402
from optmem.simulate import simulate_checkpoint  # noqa: E402


def fixed_times(*_):
    """Times that do not depend on the machine's load (so neither do the plans)."""
    return 1.0, 2.0


FIXED = dict(repeats=1, warmup=0, time_model=fixed_times)


def _exports(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record every export the wrapper makes (``True``: with dynamic sizes)."""
    made: list[bool] = []
    original = extract._export_program

    def counting(module, args, kwargs, dynamic_shapes=None, **options):
        made.append(dynamic_shapes is not None)
        return original(module, args, kwargs, dynamic_shapes, **options)

    monkeypatch.setattr(extract, "_export_program", counting)
    return made


def _call(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """A padded batch: the first sequence's second half is padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _plain(kwargs):
    """The plain call the wrapper makes in training: without a generation cache (GPT-2's
    own logits with and without one differ by 7e-8 at some padded lengths)."""
    return dict(kwargs, use_cache=False)


def _wrap(factory, model=None, **options):
    model = factory()[0] if model is None else model
    sample = _call(2, 16, seed=0)
    chain = op.profile_chain(model, sample, **FIXED)
    limit = int(0.6 * chain.store_all_peak())
    return model, op.checkpoint(model, sample, memory_limit=limit, **FIXED, **options)


def _family(cmodel):
    (family,) = cmodel._families.values()
    return family


@pytest.mark.parametrize("factory", [gpt2, llama, bert], ids=["gpt2", "llama", "bert"])
def test_new_lengths_are_exported_once_and_run_bitwise(factory, monkeypatch):
    """Lengths 12, 10, 14, 8, then other batch sizes, after a sample of length 16: one
    export for the lengths; 10 runs the plan of 12 (12 <= 1.25 x 10), the others are
    profiled; a batch of 1 is exported on its own, a batch of 3 exports once more with the
    batch size dynamic too. Every step is bitwise the step of a
    wrapper with ``dynamic=False`` (an export per size, the code before), dropout included,
    and the plain model's called as the wrapper calls it (``use_cache=False``)."""
    model, cmodel = _wrap(factory)
    _, static = _wrap(factory, model, dynamic=False)  # the same model: one set of gradients
    made = _exports(monkeypatch)
    calls = [(2, 12), (2, 10), (2, 14), (2, 8), (2, 16), (1, 12), (3, 8)]
    for k, (batch, seq) in enumerate(calls):
        kwargs = _call(batch, seq, seed=k + 1)
        got = step(cmodel, model, kwargs, seed=k)
        assert_same(got, step(static, model, kwargs, seed=k))
        assert_same(got, step(model, model, _plain(kwargs), seed=k))
        if k == 4:
            assert made.count(True) == 1  # 16 is the sample's own (static) graph
            family = _family(cmodel)
            assert sorted(sizes[0][1] for sizes in family.variants) == [8, 12, 14]
            assert family.dims == {(0, 1), (1, 1), (2, 1)}  # the length of each input
    # a batch of 1: exported on its own (export would specialise a size of 1); a batch of 3:
    # the batch size joins the dynamic dimensions, exported once more
    # (the dynamic=False wrapper exports every size but the sample's: len(calls) - 1)
    assert made.count(True) == 2 and made.count(False) == len(calls) - 1 + 1
    assert _family(cmodel).dims == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)}
    assert len(cmodel.variants) == 2  # the sample's and the batch of 1; no other size
    assert len(static.variants) == len(calls)  # one per size before (16 is the sample's)


@pytest.mark.parametrize("kind", [op.offload, op.remat_offload], ids=["offload", "remat"])
def test_offload_one_liners_share_the_export_too(kind, monkeypatch):
    """``op.offload`` and ``op.remat_offload`` (Llama, a 1 GB/s link, plans that move
    activations): lengths 12, 10, 14 after the sample's 16 make one export, 10 runs 12's
    plan, and each step is bitwise a ``dynamic=False`` wrapper's."""
    model, _ = llama()
    sample = _call(2, 16, seed=0)
    limit = int(0.6 * op.profile_chain(model, sample, **FIXED).store_all_peak())
    cmodel = kind(model, sample, memory_limit=limit, bandwidth="1GB/s", **FIXED)
    static = kind(model, sample, memory_limit=limit, bandwidth="1GB/s", dynamic=False, **FIXED)
    assert any(o.startswith("offload") for o in cmodel.result.plan)
    made = _exports(monkeypatch)
    for k, seq in enumerate((12, 10, 14)):
        kwargs = _call(2, seq, seed=k)
        assert_same(step(cmodel, model, kwargs, seed=k), step(static, model, kwargs, seed=k))
    assert made.count(True) == 1 and made.count(False) == 3  # the static wrapper's three
    assert sorted(sizes[0][1] for sizes in _family(cmodel).variants) == [12, 14]


def test_a_shorter_call_stays_within_the_plan_it_reuses():
    """The plan solved at length 12 runs length 10: the real activation peak of that step
    (exact, dispatch-level) is at most the plan's predicted peak at length 12, which fits the
    limit. Nothing is profiled for 10."""
    model = gpt2()[0].eval()  # no dropout: one plain step to compare with
    model, cmodel = _wrap(gpt2, model)
    cmodel(**_call(2, 12, seed=1)).loss.backward()
    model.zero_grad(set_to_none=True)
    (solved,) = _family(cmodel).variants.values()
    kwargs = _call(2, 10, seed=2)
    real = measure_training_peak(lambda: cmodel(**kwargs).loss.backward(), model, kwargs)
    assert len(_family(cmodel).variants) == 1
    predicted = simulate_checkpoint(solved.chain, solved.result.plan).peak_memory
    assert real <= predicted <= solved.limit
    assert real > 0


def test_dynamic_false_exports_every_size(monkeypatch):
    """``dynamic=False``: each size is exported on its own, as before."""
    model, cmodel = _wrap(gpt2, dynamic=False)
    made = _exports(monkeypatch)
    for k, seq in enumerate((12, 10)):
        kwargs = _call(2, seq, seed=k)
        assert_same(step(cmodel, model, kwargs), step(model, model, _plain(kwargs)))
    assert made == [False, False]
    assert not cmodel._families and len(cmodel.variants) == 3


class _Branchy(torch.nn.Module):
    """A chain of linear layers with a Python branch on the length (export guards it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if k == 1 and x.shape[1] > 12:
                x = x * 2
        return x.sum()


def test_a_size_outside_the_exported_range_is_exported_on_its_own(monkeypatch):
    """The dynamic graph of length 14 holds only for lengths > 12 (the branch): length 10
    is refused by export's own constraint check and exported on its own; length 20 runs
    the dynamic graph. Each gradient equals the plain module's."""
    torch.manual_seed(0)
    model = _Branchy()
    cmodel = op.checkpoint(model, torch.randn(2, 16, 8), memory_limit="60%", **FIXED)
    made = _exports(monkeypatch)
    for seq in (14, 10, 20):
        x = torch.randn(2, seq, 8)
        model.zero_grad()
        cmodel(x).backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).backward()
        for a, b in zip(got, [p.grad for p in model.parameters()], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert made == [True, False]  # 14: the dynamic export; 10: its own; 20: none
    assert len(cmodel.variants) == 2  # the sample and length 10


def test_a_failed_dynamic_export_falls_back_to_one_export_per_size(monkeypatch):
    """When ``torch.export`` fails with dynamic sizes, each size is exported on its own
    (one log line says why), and every call is still the plain model's."""
    model, cmodel = _wrap(gpt2)
    original = torch.export.export

    def refusing(*args, dynamic_shapes=None, **kwargs):
        if dynamic_shapes is not None:
            raise RuntimeError("no dynamic sizes today")
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", refusing)
    for k, seq in enumerate((12, 10)):
        kwargs = _call(2, seq, seed=k)
        assert_same(step(cmodel, model, kwargs), step(model, model, _plain(kwargs)))
    assert _family(cmodel).refused == {frozenset({(0, 1), (1, 1), (2, 1)})}
    assert len(cmodel.variants) == 3


def test_a_copied_wrapper_keeps_running_new_sizes():
    """``copy.deepcopy`` and ``pickle`` of a wrapper whose family exists: the copy runs
    new sizes bitwise like its own model (its size check may be lost in the pickle: then
    sizes are exported on their own, never run on a wrong graph)."""
    _, cmodel = _wrap(gpt2)
    kwargs = _call(2, 12, seed=1)
    cmodel(**kwargs).loss.backward()
    for other in (copy.deepcopy(cmodel), pickle.loads(pickle.dumps(cmodel))):
        for k, seq in enumerate((10, 14)):
            kwargs = _call(2, seq, seed=k)
            assert_same(step(other, other.module, kwargs),
                        step(other.module, other.module, _plain(kwargs)))


sizes = st.lists(st.integers(1, 64), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(have=sizes, want=sizes, dynamic=st.sets(st.integers(0, 2)))
def test_covers_only_smaller_sizes_within_the_slack(have, want, dynamic):
    """``covers``: same rank, every dynamic size within ``[want, SIZE_SLACK x want]``, the
    others equal; and then every tensor of the call is no larger than the plan's."""
    dims = frozenset((0, d) for d in dynamic if d < len(have))
    if len(have) != len(want):
        return
    ok = covers((tuple(have),), (tuple(want),), dims)
    expected = all(w <= h <= SIZE_SLACK * w if (0, d) in dims else h == w
                   for d, (h, w) in enumerate(zip(have, want, strict=True)))
    assert ok == expected
    if ok:
        assert all(w <= h for h, w in zip(have, want, strict=True))


def test_resolve_and_use_plan_reach_the_sizes_plans():
    """After ``resolve`` (a new limit) the sizes are solved again under it, on the same
    graph (no export); after ``use_plan`` they run the given plan (it replays on their
    chains). Before a size's plan is rebuilt it is dropped, not run under the old policy."""
    model, cmodel = _wrap(gpt2)
    kwargs = _call(2, 12, seed=1)
    cmodel(**kwargs).loss.backward()
    (before,) = _family(cmodel).variants.values()
    store_all = cmodel.chain.store_all_peak()
    cmodel.resolve(memory_limit=int(0.9 * store_all))
    assert not _family(cmodel).variants and not cmodel._sized
    assert_same(step(cmodel, model, kwargs), step(model, model, _plain(kwargs)))
    (after,) = _family(cmodel).variants.values()
    assert after.limit > before.limit and after.extraction is before.extraction
    plan = tuple(str(o) for o in cmodel.plan)
    cmodel.use_plan(plan)
    kwargs = _call(2, 10, seed=2)
    assert_same(step(cmodel, model, kwargs), step(model, model, _plain(kwargs)))
    (given,) = _family(cmodel).variants.values()
    assert given.result.report.get("source") == "use_plan"
    assert tuple(str(o) for o in given.result.plan) == plan


@pytest.mark.parametrize("kind", [op.checkpoint, op.offload])
def test_dynamic_must_be_a_bool(kind):
    """``dynamic="yes"``: one error naming the field, before any extraction."""
    from optmem.errors import OptmemInputError

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    with pytest.raises(OptmemInputError, match="field 'dynamic': expected True or False") as info:
        kind(net, torch.randn(2, 4), memory_limit="60%", dynamic="yes")
    assert info.value.field == "dynamic"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                 for _ in range(8)])


def test_an_nn_sequential_plans_each_batch_size_within_the_limit():
    """An ``nn.Sequential`` wrapped on a batch of 8 at a byte limit (half its store-all
    peak). Before, every input ran the sample's plan: a batch of 10 peaked at 20,488 B
    against the 19,456 B limit, and a batch of 32 at about four times the limit, in
    silence. Now a batch of 10 is profiled and solved (its real peak within the limit), 7
    runs the sample's plan
    (8 <= 1.25 x 7), 32 is one error naming its sizes and the smallest feasible limit, and
    every gradient is the plain model's. Nothing is planned without gradients."""
    from optmem.errors import OptmemInputError

    net = _mlp()
    x = torch.randn(8, 64)
    limit = int(0.5 * op.profile_chain(net, x, **FIXED).store_all_peak())
    cnet = op.checkpoint(net, x, memory_limit=limit, **FIXED)
    for batch in (10, 7):
        xb = torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch))
        cnet(xb).sum().backward()  # plans the size (profiling is not part of the step)
        net.zero_grad(set_to_none=True)
        real = measure_training_peak(lambda xb=xb: cnet(xb).pow(2).sum().backward(), net, xb)
        got = [p.grad.clone() for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        net(xb).pow(2).sum().backward()
        for a, p in zip(got, net.parameters(), strict=True):
            torch.testing.assert_close(a, p.grad, rtol=0, atol=0)
        assert real <= limit
    assert [sizes[0][0] for sizes in _family(cnet).variants] == [10]  # 7: the sample's plan
    with pytest.raises(OptmemInputError, match=r"smallest feasible limit.*for a call with "
                       r"input sizes \[32, 64\]; the sample's were \[8, 64\]"):
        cnet(torch.randn(32, 64))
    with torch.no_grad():
        cnet(torch.randn(16, 64))
    assert [sizes[0][0] for sizes in _family(cnet).variants] == [10]


def test_an_nn_sequential_with_dynamic_false_runs_the_samples_plan_for_every_size():
    """``dynamic=False``: the behaviour before, one plan for every input."""
    net = _mlp()
    x = torch.randn(8, 64)
    limit = int(0.5 * op.profile_chain(net, x, **FIXED).store_all_peak())
    cnet = op.checkpoint(net, x, memory_limit=limit, dynamic=False, **FIXED)
    cnet(torch.randn(32, 64)).sum().backward()
    assert not cnet._families and not cnet._sized
