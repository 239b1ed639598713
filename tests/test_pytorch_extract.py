"""Chain extraction: nn.Sequential flattening, torch.fx cut points, merging, clear errors."""

from __future__ import annotations

import itertools
import re

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")

import pytorch_helpers  # noqa: E402, F401  (one thread)
from torch import nn  # noqa: E402

from optmem.errors import OptmemInputError  # noqa: E402
from optmem.pytorch.extract import (  # noqa: E402
    extract_stages,
    merge_stages,
    partition_costs,
    run_stages,
)
from optmem.pytorch.models import resolve_spec  # noqa: E402


def _same_output(module, stages, x):
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(run_stages(stages, x), module(x), rtol=0, atol=0)


def test_sequential_is_flattened_and_inplace_merged():
    net = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(inplace=True),
        nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8))),
        nn.Linear(8, 2))
    stages = extract_stages(net)
    assert [s.name for s in stages] == ["0..1", "2.0", "2.1.0", "2.1.1", "3"]
    assert all(p1 is p2 for p1, p2 in zip(
        (p for s in stages for p in s.module.parameters()), net.parameters(), strict=True))
    _same_output(net, stages, torch.randn(3, 4))


class NotReallySequential(nn.Sequential):
    not_really_sequential = True

    def forward(self, x):
        return super().forward(x) + x


def test_sequential_subclass_with_forward_stays_whole():
    net = nn.Sequential(nn.Linear(4, 4), NotReallySequential(nn.Linear(4, 4), nn.Tanh()),
                        nn.Linear(4, 1))
    stages = extract_stages(net)
    assert len(stages) == 3 and isinstance(stages[1].module, NotReallySequential)


def test_fx_resnet_keeps_residual_blocks_whole():
    module, x = resolve_spec("toy-resnet", batch=2)
    stages = extract_stages(module)
    names = [s.name for s in stages]
    # stem conv, bn+relu, six residual blocks, pooling, classifier
    assert names == ["stem", "bn..relu", *(f"layers.{k}" for k in range(6)), "mean", "fc"]
    _same_output(module, stages, x)


def test_fx_transformer_cut_only_between_residuals():
    module, x = resolve_spec("toy-transformer", batch=2)
    stages = extract_stages(module)
    assert [s.name for s in stages] == [
        "embed", "blocks.0#1", "blocks.0#2", "blocks.1#1", "blocks.1#2", "blocks.2#1",
        "blocks.2#2", "norm", "head"]
    _same_output(module, stages, x)


class Inception(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)
        self.c = nn.Conv2d(8, 2, 1)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x)], dim=1)
        y = torch.relu(self.c(y))
        return self.head(y.mean((2, 3)))


def test_fx_inception_branches_stay_in_one_stage():
    module = Inception()
    stages = extract_stages(module)
    assert len(stages) >= 3
    first = stages[0].module
    # both branches and the concatenation are inside the first stage
    code = first.gm.code
    assert "self.a(" in code and "self.b(" in code and "cat" in code
    _same_output(module, stages, torch.randn(2, 3, 5, 5))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.l2(torch.relu(self.l1(x) + y))


def test_fx_module_with_two_inputs_takes_a_tuple():
    module = TwoInputs()
    stages = extract_stages(module)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(run_stages(stages, (x, y)), module(x, y))


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent control flow
            return self.lin(h)
        return h


class Unet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x):
        return self.b(self.a(x)) + x  # the input is needed at the very end


def test_errors_name_the_module():
    with pytest.raises(OptmemInputError, match="Untraceable"):
        extract_stages(Untraceable())
    with pytest.raises(OptmemInputError, match="no chain found in Unet"):
        extract_stages(Unet())
    assert len(extract_stages(Unet(), allow_single=True)) == 1
    with pytest.raises(OptmemInputError, match="empty"):
        extract_stages(nn.Sequential())


def test_merge_to_at_most_n_stages():
    module, x = resolve_spec("toy-cnn", batch=2)
    stages = extract_stages(module)
    for n in (1, 3, 5, len(stages), len(stages) + 3):
        merged = extract_stages(module, max_stages=n) if n > 1 else \
            merge_stages(stages, 1)
        assert len(merged) == min(n, len(stages))
        _same_output(module, merged, x)


def test_partition_costs_is_optimal():
    costs = [5, 1, 1, 7, 2, 2, 2, 9, 1]
    for parts in range(1, 6):
        got = partition_costs(costs, parts)
        assert got[0][0] == 0 and got[-1][1] == len(costs) - 1
        value = max(sum(costs[a:b + 1]) for a, b in got)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, len(costs)), strict=True))
            for cut in itertools.combinations(range(1, len(costs)), parts - 1))
        assert value == best


# ------------------------------------------------------------------ extraction with a sample
class MaskedNet(nn.Module):
    """Blocks that read a mask computed from an input: the mask is a side input."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x, mask, scale: float = 2.0):
        m = (mask > 0).to(x.dtype) * scale
        h = x
        for block in self.blocks:
            h = torch.tanh(block(h)) * m
        return {"out": self.head(h), "mask": m}


def test_program_moves_masks_beside_the_chain():
    from optmem.pytorch.context import side_inputs
    from optmem.pytorch.extract import extract_program

    torch.manual_seed(0)
    net = MaskedNet()
    x, mask = torch.randn(3, 8), torch.randint(0, 2, (3, 8))
    ext = extract_program(net, (x, mask))
    assert ext.method == "export" and len(ext.stages) >= 5
    flat = ext.flatten((x, mask), {})
    ctx = ext.side_inputs(flat)
    side = [ctx[n] for n in ext.side.output_names]
    assert side and not any(t.requires_grad for t in side)
    with torch.no_grad():
        got, ref = ext.run(x, mask), net(x, mask)
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=0)
    # each stage maps one value to one value; the side inputs come from the context
    values = [ext.chain_input(flat)]
    with side_inputs(ctx):
        for st in ext.stages:
            values.append(st.module(values[-1]))
    assert all(isinstance(v, torch.Tensor) for v in values[1:])
    k = next(k for k, st in enumerate(ext.stages) if st.module.side_names)
    with pytest.raises(RuntimeError, match="outside its wrapper"):
        ext.stages[k].module(values[k])


class InplaceAfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        y = y.relu_()  # writes the linear's output in place: no boundary right after `a`
        return self.c(torch.sigmoid(self.b(y)))


def test_no_boundary_before_an_inplace_write():
    from optmem.pytorch.extract import extract_program
    from optmem.pytorch.graphcut import written_args

    net = InplaceAfterLinear()
    x = torch.randn(2, 4)
    for ext_stages in (extract_program(net, (x,)).stages, extract_stages(net)):
        for st in ext_stages[1:]:
            first = next(n for n in st.module.gm.graph.nodes
                         if n.op not in ("placeholder", "get_attr"))
            assert not any(w.op == "placeholder" for w in written_args(first, st.module.gm))
        with torch.no_grad():
            torch.testing.assert_close(run_stages(ext_stages, x), net(x), rtol=0, atol=0)


class MaskThroughDropout(nn.Module):
    """HF wav2vec2's SpecAugment: ``h = dropout(proj(x)); h[mask] = embed`` with p = 0."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.embed = nn.Parameter(torch.randn(4))
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, mask):
        h = nn.functional.dropout(self.proj(x), p=0.0, training=self.training)
        h[mask] = self.embed  # writes proj's output: dropout(p=0) returned that very tensor
        for lin in self.lins:
            h = torch.tanh(lin(h))
        return h.sum()


def test_a_dropout_returning_its_input_is_an_alias_for_the_cut():
    """``aten.dropout(x, 0.0, True)`` returns ``x`` itself though its schema declares no
    alias. Before, a boundary was cut after ``proj`` and the mask's write hit that stage's
    input: "a leaf Variable that requires grad is being used in an in-place operation"."""
    import optmem.pytorch as op

    torch.manual_seed(0)
    net = MaskThroughDropout().train()
    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(2, 6, 4, generator=g), torch.rand(2, 6, generator=g) > 0.5
    wrapped = op.checkpoint(net, (x, mask), memory_limit="90%", repeats=1, warmup=0,
                            fast_path=False)
    assert len(wrapped.stages) >= 3
    wrapped(x, mask).backward()
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    net(x, mask).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, net.parameters(), strict=True))


class GradInputUsedLate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.b(torch.tanh(self.a(x))) + y


def test_an_input_that_needs_grad_late_is_part_of_the_chain():
    from optmem.pytorch.extract import extract_program

    net = GradInputUsedLate()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    assert len(extract_program(net, (x, y)).stages) > 1  # y is a side input
    with pytest.raises(OptmemInputError, match="no chain"):
        extract_program(net, (x, y.requires_grad_(True)))  # y must carry a gradient


def test_unextractable_module_one_line_error():
    from optmem.pytorch.extract import extract_program

    with pytest.raises(OptmemInputError) as err:
        extract_program(Untraceable(), (torch.randn(2, 2),))
    message = str(err.value)
    assert "Untraceable" in message and "torch.export" in message and "torch.fx" in message
    assert "\n" not in message and "nn.Sequential" in message
    # the branch on an intermediate value is named (test_value_branches.py: one on an
    # input is exported with the sample's side)
    assert re.search(r"an intermediate tensor at test_pytorch_extract\.py:\d+ \(`if "
                     r"h\.sum\(\) > 0:  # data-dependent control flow`\), a value computed "
                     r"inside the forward .* which neither torch\.export nor torch\.fx can "
                     r"hold", message)
    assert "without the input" not in message  # not an input's branch: no such advice


class _Experts(nn.Module):
    """A mixture of experts as HF's DBRX (and Switch) write it: a loop over the experts the
    router picked, from ``nonzero``: a size no value of the call fixes."""

    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, n)
        self.w = nn.Parameter(torch.randn(n, d, d))
        self.n = n

    def forward(self, h):
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = nn.functional.one_hot(self.router(h).argmax(-1), self.n).permute(1, 0)
            hit = torch.greater(mask.sum(-1), 0).nonzero()
        for e in hit:  # the experts hit
            e = e[0]
            tok = torch.where(mask[e])[0]
            out.index_add_(0, tok, h[tok] @ self.w[e])
        return h + out


def test_a_loop_over_the_experts_a_router_picked_is_named_as_such():
    """Before: "branches on the value of a tensor ... Call it without the input that leads
    there (for a check on labels ...)", the advice for a check on an input, for HF DBRX."""
    from optmem.pytorch.extract import extract_program

    net = nn.Sequential(nn.Linear(8, 8), _Experts(), _Experts())
    with pytest.raises(OptmemInputError) as err:
        extract_program(net, (torch.randn(6, 8),))
    message = str(err.value)
    assert re.search(r"makes a tensor whose size depends on values computed in the call at "
                     r"test_pytorch_extract\.py:\d+ \(`for e in hit:  # the experts hit`\) "
                     r"in '1' \(a _Experts\)", message), message
    assert "neither torch.export nor torch.fx" in message and "\n" not in message
    assert "without the input" not in message


class _DeadEndDropout(nn.Module):
    """A branch whose dropped-out value is never used, after a dropout that is (HF
    Pegasus-X's last encoder layer computes its global-token branch, then drops it)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.lg, self.l1, self.l2, self.l3 = (nn.Linear(16, 16) for _ in range(5))

    def forward(self, x):
        h = self.l0(x)
        g = self.lg(h)  # the branch whose result is dropped
        h = torch.tanh(self.l2(torch.tanh(self.l1(h))))
        h = nn.functional.dropout(h, 0.5, self.training)  # draw 1, used
        nn.functional.dropout(g, 0.5, self.training)  # draw 2, a dead end
        return torch.tanh(self.l3(h)).sum()


@pytest.mark.parametrize("limit", ["100%", "min"])
def test_a_dead_end_dropout_draws_in_the_models_order(limit):
    """A dead end goes with its latest chain input, so the unused dropout ran in the stage
    of ``l0`` (before draw 1) and took draw 1's random numbers: every mask after it
    differed (Pegasus-X: 3.1e-5 in its logits, at every limit). The stages between the two
    draws are now one."""
    import optmem.pytorch as op

    torch.manual_seed(0)
    model = _DeadEndDropout().train()
    x = torch.randn(8, 16)
    cmodel = op.checkpoint(model, x, memory_limit=limit, repeats=1, warmup=0,
                           fast_path=False)
    assert cmodel.chain.length >= 3
    for seed in (1, 2):
        torch.manual_seed(seed)
        ref = model(x)
        grads = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
        torch.manual_seed(seed)
        got = cmodel(x)
        assert torch.equal(got, ref)
        for a, b in zip(torch.autograd.grad(got, list(model.parameters()), allow_unused=True),
                        grads, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


class _CopiedLayerDrop(nn.Module):
    """LayerDrop as HF M2M100 and NLLB write it: the encoder copies ``layerdrop`` from the
    config when built, so setting ``model.config.encoder_layerdrop`` later changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(encoder_layerdrop=0.1)
        self.enc = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.enc.layerdrop = self.config.encoder_layerdrop

    def forward(self, x):
        for layer in self.enc:
            if self.training and self.enc.layerdrop > 0.0:  # noqa: SIM102 - as HF writes it
                if torch.rand([]) < self.enc.layerdrop:
                    continue  # skip the layer
            x = torch.tanh(layer(x))
        return x.sum()


def test_a_layerdrop_the_module_copied_is_named_with_the_config_field():
    """Before: "set model.config.encoder_layerdrop = 0.0", which left the copy at 0.1 and the
    same refusal, now without advice (HF M2M100). And the ``torch.fx`` fallback no longer
    keeps the draw it made while tracing: this model was "extracted" by fx with the layers
    that draw skipped or kept for good (``torch.rand([])`` on no traced value runs at
    trace time)."""
    import optmem.pytorch as op

    model = _CopiedLayerDrop().train()
    x = torch.randn(4, 8)
    with pytest.raises(OptmemInputError) as err:
        op.checkpoint(model, x, memory_limit="100%", repeats=1, warmup=0)
    message = str(err.value)
    assert "model.config.encoder_layerdrop = 0.0; model.enc.layerdrop = 0.0" in message
    model.config.encoder_layerdrop = 0.0  # the config alone: the copy is still named
    with pytest.raises(OptmemInputError, match=r"set model\.enc\.layerdrop = 0\.0 before"):
        op.checkpoint(model, x, memory_limit="100%", repeats=1, warmup=0)
    model.enc.layerdrop = 0.0
    assert op.checkpoint(model, x, memory_limit="100%", repeats=1, warmup=0).chain.length > 1


# ------------------------------------------------------------------ constant attention masks
class Attention(nn.Module):
    """Self-attention layers given a mask built from shapes only (as HF builds it in export).

    ``kind``: ``"ones"`` (all True), ``"zeros"`` (additive float zeros), ``"causal"``
    (lower-triangular bool), ``"band"`` (a non-trivial constant) or ``"input"`` (from the
    ``keep`` input: data-dependent).
    """

    def __init__(self, kind, width=16, heads=2, depth=3):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def mask(self, b, s, keep):
        rows = torch.arange(s).view(1, 1, s, 1)
        cols = torch.arange(s).view(1, 1, 1, s)
        if self.kind == "ones":
            return torch.ones(b, 1, s, s, dtype=torch.bool)
        if self.kind == "zeros":
            return torch.zeros(b, 1, s, s)
        if self.kind == "causal":
            return (cols <= rows).expand(b, 1, s, s)
        if self.kind == "band":
            return ((rows - cols).abs() <= 1).expand(b, 1, s, s)
        return keep[:, None, None, :].expand(b, 1, s, s)

    def forward(self, x, keep):
        b, s, w = x.shape
        mask = self.mask(b, s, keep)
        for layer in self.qkv:
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                       for t in layer(x).split(w, dim=2))
            att = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + att.transpose(1, 2).reshape(b, s, w)
        return self.head(x).sum()


def _sdpa_calls(ext):
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    graphs = [m for st in ext.stages for m in st.module.modules()
              if isinstance(m, torch.fx.GraphModule)]
    return [n for gm in graphs for n in gm.graph.nodes if n.target is sdpa]


@pytest.mark.parametrize("kind, elided, causal", [
    ("ones", True, False), ("zeros", True, False), ("causal", True, True),
    ("band", False, False), ("input", False, False)])
def test_constant_trivial_attention_masks_are_elided(kind, elided, causal):
    from optmem.pytorch.extract import extract_program
    from optmem.pytorch.wrapper import canonical_call

    torch.manual_seed(0)
    net = Attention(kind)
    x = torch.randn(2, 6, 16)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    args, kwargs = canonical_call(net, (x, keep), {})
    ext = extract_program(net, args, kwargs)
    calls = _sdpa_calls(ext)
    assert len(calls) == 3
    for node in calls:
        has_mask = len(node.args) > 3 or node.kwargs.get("attn_mask") is not None
        assert has_mask is not elided
        assert bool(node.kwargs.get("is_causal", False)) is causal
    # an elided mask is no longer computed beside the chain (no 4-d side input)
    ctx = ext.side_inputs(ext.flatten(args, kwargs))
    masks = [n for n in ext.side.output_names if ctx[n].dim() == 4]
    assert elided is not bool(masks)
    # the wrapper's step: loss and gradients bitwise those of the plain module
    import optmem.pytorch as op

    ref_loss = net(x, keep)
    ref_loss.backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    cm = op.checkpoint(net, (x, keep), memory_limit="min", repeats=1, warmup=0)
    loss = cm(x, keep)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), ref, strict=True))


class _ChecksLabels(nn.Module):
    """A forward that branches on a tensor's value (as HF's CTC heads check their labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is not None and labels.max() >= 4:
            raise ValueError("labels out of range")
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return x.sum() if labels is None else (x - labels.float()).square().sum()


def test_a_branch_on_a_tensors_value_is_one_error_naming_the_line(capsys):
    """Before: "GuardOnDataDependentSymNode: Could not guard on data-dependent expression"
    with torch.fx's "Proxy object cannot be iterated", after torch had printed the partial
    graph traced so far on stderr (thousands of lines on Wav2Vec2ForCTC). Now one error
    names the file, line and code of the branch and what to do; nothing else is printed.
    Without the input that leads there the model extracts. (Since 2026-11-30 a sample whose
    labels are in range extracts too, asserting that side: ``test_value_branches.py``; the
    error remains for a sample whose side of the branch raises.)"""
    from optmem.pytorch.extract import extract_program

    net, x = _ChecksLabels(), torch.randn(2, 4)
    labels = torch.full((2, 4), 4, dtype=torch.long)  # out of range: the model raises
    with pytest.raises(OptmemInputError) as err:
        extract_program(net, (x,), {"labels": labels})
    message = str(err.value)
    assert "_ChecksLabels: its forward branches on the value of a tensor at " \
           "test_pytorch_extract.py:" in message
    assert "(`if labels is not None and labels.max() >= 4:`)" in message
    assert "without labels" in message
    captured = capsys.readouterr()
    assert "def forward" not in captured.err + captured.out
    assert len(extract_program(net, (x,), {}).stages) >= 3


def test_warnings_during_a_successful_export_still_reach_stderr(capsys):
    """The partial-graph filter keeps what else an export writes to stderr."""
    import sys

    from optmem.pytorch.extract import extract_program

    class Noisy(_ChecksLabels):
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            sys.stderr.write("a message of the model\n")
            return super().forward(x)

    extract_program(Noisy(), (torch.randn(2, 4),), {})
    assert "a message of the model" in capsys.readouterr().err




def test_a_dataclass_output_or_input_is_one_error_saying_to_register_it():
    """A forward returning a plain ``@dataclass`` (not a registered pytree) gets one error
    naming the class and ``torch.export.register_dataclass``; registered, it wraps and its
    gradients are the model's. Before, torch.export's failure sent it to torch.fx, whose
    graph returned the dataclass whole, and profiling stopped with "the stage returns no
    tensor". A dataclass *input* was refused as "called without any tensor", no reason."""
    import dataclasses

    from torch.utils._pytree import _deregister_pytree_node

    import optmem.pytorch as op

    out_cls = dataclasses.make_dataclass("Out", [("a", torch.Tensor), ("h", torch.Tensor)])
    batch_cls = dataclasses.make_dataclass("Batch", [("x", torch.Tensor)])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

        def forward(self, x):
            x = getattr(x, "x", x)
            for lin in self.lins:
                x = torch.tanh(lin(x)) + x
            return out_cls(x.sum(-1), x)

    torch.manual_seed(0)
    net, x = Net(), torch.randn(8, 6)
    with pytest.raises(OptmemInputError, match=r"Net returns a .*Out.*register_dataclass\(Out\)"):
        op.checkpoint(net, x, "70%", repeats=1, warmup=0, fast_path=False)
    with pytest.raises(OptmemInputError, match=r"inside a Batch.*register_dataclass\(Batch\)"):
        op.checkpoint(net, (batch_cls(x),), "70%", repeats=1, warmup=0, fast_path=False)
    torch.export.register_dataclass(out_cls)
    try:
        cnet = op.checkpoint(net, x, "70%", repeats=1, warmup=0, fast_path=False)
        got = cnet(x)
        assert type(got) is out_cls
        (got.a.pow(2).sum() + got.h.mean()).backward()
        grads = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        ref = net(x)
        (ref.a.pow(2).sum() + ref.h.mean()).backward()
        for a, b in zip(grads, (p.grad for p in net.parameters()), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        _deregister_pytree_node(out_cls)


class _DefaultMaskOnlyInEager(nn.Module):
    """Builds its default mask only outside tracing, as HF's LongT5 and Switch do."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        if attention_mask is None and not torch.compiler.is_compiling():
            attention_mask = torch.ones(x.shape[:2])
        keep = attention_mask[:, :, None]
        for lin in self.lins:
            x = torch.tanh(lin(x)) * keep
        return x.sum()


def test_a_default_mask_built_only_in_eager_mode_is_named_in_the_error():
    """Before: only "TypeError: 'NoneType' object is not subscriptable" from the export (and
    fx's error). Now the message says to pass the mask, and with it the model extracts."""
    from optmem.pytorch.extract import extract_program

    net, x = _DefaultMaskOnlyInEager(), torch.randn(2, 5, 4)
    with pytest.raises(OptmemInputError) as err:
        extract_program(net, (x,), {})
    message = str(err.value)
    assert "NoneType" in message and "attention_mask=torch.ones_like(input_ids)" in message
    assert len(extract_program(net, (x,), {"attention_mask": torch.ones(2, 5)}).stages) >= 3


class _MovesItsRouter(nn.Module):
    """Moves a submodule to its own dtype in the forward, as HF Switch's router does."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.router = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            x = torch.tanh(lin(x))
        self.router = self.router.to(x.dtype)  # a no-op in eager mode
        return self.router(x).square().sum()


def test_a_submodule_moved_to_its_own_dtype_in_the_forward_is_exported():
    """Before: "_apply(): Couldn't swap Linear.weight" (fake parameters cannot be swapped).
    Now a ``Module.to`` that changes nothing returns the module, as in eager mode (one that
    converts still goes to torch)."""
    import optmem.pytorch as op
    from optmem.pytorch.extract import extract_program

    torch.manual_seed(0)
    net, x = _MovesItsRouter(), torch.randn(6, 4)
    ext = extract_program(net, (x,), {})
    assert ext.method == "export" and len(ext.stages) >= 3
    net.zero_grad()
    net(x).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    cnet = op.checkpoint(net, x, memory_limit="60%", repeats=1, warmup=0, fast_path=False)
    net.zero_grad()
    cnet(x).backward()
    for a, b in zip(ref, (p.grad for p in net.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert nn.Module.to.__qualname__ == "Module.to"  # put back after the export


class _FillsAScratch(nn.Module):
    """Allocates a scratch tensor in its forward and writes computed rows into its views
    (HF xLSTM's ``matC_states = torch.zeros(...)``, then ``matC_states[..., k] = ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = torch.tanh(lin(x))
            scratch = torch.zeros(x.shape[0], 2, 4)
            scratch[:, 0] = h
            scratch[:, 1] = h * 2
            x = scratch.sum(1)
        return x.square().sum()


def test_a_scratch_tensor_the_chain_writes_into_is_allocated_by_its_stage():
    """Before (stop 40): the scratch depends on no input, so it was a side input computed
    under ``no_grad``. xLSTM's wrapping failed ("A view was created in no_grad mode and is
    being modified inplace with grad mode enabled"); this toy, whose every layer goes
    through its scratch, failed with "the model's output does not depend on any parameter".
    Now a side value the chain writes in place is in the chain; the plan re-runs stages,
    bitwise."""
    import optmem.pytorch as op

    torch.manual_seed(0)
    net, x = _FillsAScratch(), torch.randn(6, 4)
    net(x).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    cnet = op.checkpoint(net, x, memory_limit="60%", repeats=1, warmup=0, fast_path=False)
    assert any(o.startswith(("F_ck", "F_none")) for o in cnet.result.plan)
    for _ in range(2):
        net.zero_grad()
        cnet(x).backward()
        for a, b in zip(ref, (p.grad for p in net.parameters()), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _ClampsItsData(nn.Module):
    """Clamps a parameter's ``.data`` in its forward, as HF Gemma 3n's AltUp does."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 4, bias=False)
        self.coefs = nn.Linear(4, 4, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.coefs.weight.data.clamp_(-0.5, 0.5)
        return h * self.coefs(torch.tanh(self.router(h)))


class _ClampingLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ClampsItsData() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_write_to_a_parameters_data_is_named_in_the_error():
    """Before: torch's "We found a fake tensor in the exported program constant's list"
    alone, naming a ``lifted_tensor_0``, not the code. (torch.fx holds this toy's write,
    so export alone is asked for; fx cannot trace Gemma 3n.)"""
    from optmem.pytorch.extract import extract_program

    with pytest.raises(OptmemInputError, match=r"writing a parameter's \.data in place"):
        extract_program(_ClampingLayers(), (torch.randn(2, 4),), {}, method="export")


class _DrawsWhateverItsConfig(nn.Module):
    """Draws ``random.uniform`` for every layer and compares it with ``layerdrop`` (HF
    MusicGen), which is 0: the draws never change the graph, but the refusal stands."""

    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(layerdrop=0.0)
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        for lin in self.lins:
            if self.training and random.uniform(0, 1) < self.config.layerdrop:
                continue
            x = torch.tanh(lin(x))
        return x.sum()


def test_python_draws_made_whatever_the_config_say_so():
    """Before (stop 40's second sweep): the error advised "turn them off (e.g. layerdrop=0)"
    to a model whose layerdrop was already 0."""
    from optmem.pytorch.extract import extract_program

    with pytest.raises(OptmemInputError) as err:
        extract_program(_DrawsWhateverItsConfig(), (torch.randn(2, 4),), {})
    message = str(err.value)
    assert "No random option of its config is on" in message
    assert "e.g. layerdrop=0" not in message


class _View(nn.Module):
    """Returns a view of its input (a reshape module)."""

    def forward(self, x):
        return x.view(x.shape)


class _AddOne(nn.Module):
    """Writes into its input in place (no ``inplace`` attribute)."""

    def forward(self, x):
        return x.add_(1.0)


def _writer_models():
    def body(*mid):
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), *mid,
                             nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 4))
    return {
        "flatten-relu_": (lambda: body(nn.Flatten(), nn.ReLU(inplace=True)), "2..4", 4),
        "view-relu_": (lambda: body(_View(), nn.ReLU(inplace=True)), "2..4", 4),
        "add_": (lambda: body(_AddOne()), "2..3", 4),
        "view-view-relu_": (lambda: body(_View(), _View(), nn.ReLU(inplace=True)), "2..5", 5),
    }


@pytest.mark.parametrize("kind", list(_writer_models()))
def test_a_stage_writing_into_its_input_is_merged_into_the_one_before(kind):
    """Stages that write in place into their input, or into the view of it the stage before
    returns: ``nn.Flatten`` (on a 2-D tensor it returns the tensor itself) or a view module
    then ``ReLU(inplace=True)``, a custom ``x.add_(1)``. The plain step trains; before,
    wrapping raised autograd's "a leaf Variable that requires grad is being used in an
    in-place operation" (or "a view of a leaf Variable ..."), and the un-merged stages
    still do, now as one error naming the stage. Now the dry run merges each writer into
    the stage before it (repeatedly through views), the profile agrees with the wrapper,
    and a plan that re-runs stages gives the plain model's loss and gradients bitwise."""
    import copy

    import optmem.pytorch as op
    from optmem.pytorch.profile import profile_stages

    make, merged, writer = _writer_models()[kind]
    torch.manual_seed(0)
    net = make()
    plain = copy.deepcopy(net)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(OptmemInputError, match=r"writes in place into its input") as info:
        profile_stages(extract_stages(net), x, repeats=1, warmup=0)  # the sabotage: not merged
    assert info.value.stage == writer
    wrapped = op.checkpoint(net, x, memory_limit="min", repeats=1, warmup=0, fast_path=False)
    names = list(wrapped.stage_names)
    assert merged in names and len(names) == 8
    assert op.profile_chain(net, x, repeats=1, warmup=0).stage_names == tuple(names)
    forwards = [str(o) for o in wrapped.plan if str(o).startswith("F")]
    assert len(forwards) > len(names)  # some stage runs more than once
    loss = wrapped(x).square().mean()
    loss.backward()
    want = plain(x).square().mean()
    want.backward()
    assert torch.equal(loss, want)
    for (name, p), q in zip(net.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("head, stage, through", [
    ((_AddOne(),), 1, ""),
    ((nn.Flatten(), nn.ReLU(inplace=True)), 1, ""),
    ((_View(), _AddOne()), 2, ", through the view stage 1 returns,"),
])
def test_a_stage_writing_into_the_model_input_is_refused(head, stage, through):
    """A write in place into the model input (the plan may run that stage again on the
    input it wrote): one error naming the stage, and the sample is left as it was."""
    import optmem.pytorch as op

    net = nn.Sequential(*head, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    before = x.clone()
    with pytest.raises(OptmemInputError, match=re.escape(
            f"writes in place into the model input{through} and the plan may run it again")
            ) as info:
        op.checkpoint(net, x, memory_limit="min", repeats=1, warmup=0)
    assert info.value.stage == stage and info.value.field == "module"
    assert torch.equal(x, before)


class _ReturnsItsState(nn.Module):
    """Returns one of its own tensors beside the logits (a temperature, a codebook)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 2)
        self.register_buffer("codebook", torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for lin in self.lins:
            x = x + torch.tanh(lin(x))
        state = self.head.weight if self.what == "parameter" else self.codebook
        return self.head(x), state


@pytest.mark.parametrize("extract", ["export", "fx"])
@pytest.mark.parametrize("what", ["parameter", "buffer"])
@pytest.mark.parametrize("kind", ["checkpoint", "offload", "remat_offload"])
def test_a_parameter_or_buffer_the_model_returns_is_that_tensor(kind, what, extract):
    """Before (stop 52): a model returning one of its parameters or buffers as an output
    wrapped, and then every call failed with a raw ``KeyError: 'head_weight'`` (the output
    layout read it from the side inputs, which never computed it). Now the side program
    returns it: the output is the model's own tensor, and a loss on it gives the model's
    gradients, bitwise."""
    import optmem.pytorch as op

    torch.manual_seed(0)
    net, x = _ReturnsItsState(what), torch.randn(6, 4)
    logits, state = net(x)
    (logits.square().sum() + state.square().sum()).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    options = {} if kind == "checkpoint" else {"bandwidth": "1GB/s"}
    wrapped = getattr(op, kind)(net, x, memory_limit="60%", repeats=1, warmup=0,
                                fast_path=False, extract=extract, **options)
    for _ in range(2):
        net.zero_grad()
        out, got = wrapped(x)
        assert got is state
        torch.testing.assert_close(out, logits, rtol=0, atol=0)
        (out.square().sum() + got.square().sum()).backward()
        for a, b in zip(ref, (p.grad for p in net.parameters()), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _TinyLM(nn.Module):
    """Embedding, two residual blocks, head and a cross-entropy on ``labels``."""

    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = self.head(h)
        return nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100
        )


def test_one_tensor_given_as_two_arguments_is_exported_as_two_inputs():
    """Wrapped on ``{"input_ids": ids, "labels": ids}`` (one tensor, the docs' sample), the
    graph read both arguments from one placeholder: other labels ran the embedding on the
    labels (other tokens: loss and gradients wrong in silence; ``-100``: IndexError)."""
    import optmem.pytorch as op

    torch.manual_seed(0)
    model = _TinyLM()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (2, 8), generator=g)
    cmodel = op.checkpoint(
        model,
        {"input_ids": ids, "labels": ids},
        memory_limit="60%",
        repeats=1,
        warmup=0,
        fast_path=False,
    )
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan)
    padded = ids.clone()
    padded[0, :3] = -100
    for labels in (torch.randint(0, 20, (2, 8), generator=g), padded, ids):
        got, ref = [], []
        for call, out in ((cmodel, got), (model, ref)):
            loss = call(input_ids=ids, labels=labels)
            loss.backward()
            out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fx_extraction_forks_the_cuda_rng_of_the_models_devices(monkeypatch):
    """The fx route's shape propagation runs the model (its dropout draws) inside
    ``fork_rng(devices=[])``: the CPU generator was kept, those of the GPUs holding the
    model or the sample advanced, so a direct ``extract_program`` call changed the masks
    the training then drew. The devices of the parameters, buffers and inputs are forked
    now (a weight on a faked ``cuda:1`` here)."""
    from pytorch_helpers import on_fake_cuda

    from optmem.pytorch.extract import extract_program

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    forked: list[list[int]] = []
    real = torch.random.fork_rng

    def fork_rng(devices=None, enabled=True, **kwargs):
        forked.append(list(devices))
        return real(devices=[], enabled=enabled)  # no GPU here: the CPU state only

    net = Net()
    net.a.weight = nn.Parameter(on_fake_cuda(net.a.weight.detach()))
    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    ext = extract_program(net, (torch.randn(2, 4),), method="fx")
    assert len(ext.stages) == 3 and forked == [[1]]
