"""``torch.vmap`` inside a forward (``graphcut.vmap_regions``).

Export traces ``torch.vmap`` into calls that open and close a vmap level around the batched
ops, calls without users. Until 2026-11-30 the side-input program kept only the ops whose
values it needed and dropped those calls, so a mask built with ``torch.vmap`` (HF's mask
functions; Gemma 3's image mask) failed at the first call with functorch's "your tensor may
have escaped from inside a function being vmapped", a traceback out of ``op.checkpoint``.
A region now runs whole, in the program (side inputs or one stage) that runs its ops.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
from pytorch_helpers import loss_grads  # noqa: E402
from torch import nn  # noqa: E402

import optmem.pytorch as op  # noqa: E402
from optmem.pytorch.extract import extract_program  # noqa: E402
from optmem.pytorch.graphcut import vmap_regions  # noqa: E402

WIDTH = 16


class VmapMask(nn.Module):
    """Layers under a mask built with ``torch.vmap`` (side), one of them vmapped (chain)."""

    def __init__(self, chain_vmap: bool = False) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.chain_vmap = chain_vmap

    def forward(self, x: torch.Tensor) -> Any:
        rows = torch.arange(x.shape[0])
        band = torch.vmap(lambda r: (rows - r).abs() <= 1)(rows)  # (n, n) band mask
        h = x
        for k, lin in enumerate(self.lins):
            h = torch.tanh(lin(h))
            if self.chain_vmap and k == 1:
                h = torch.vmap(lambda v: v * v.sum())(h)
            h = torch.where(band, h @ h.T, 0.0) @ h / WIDTH
        return h.square().mean()


@pytest.mark.parametrize("chain_vmap", [False, True])
def test_a_vmapped_mask_and_a_vmapped_layer_run_whole_and_give_the_models_gradients(
        chain_vmap: bool) -> None:
    torch.manual_seed(0)
    model = VmapMask(chain_vmap)
    x = torch.randn(8, WIDTH)
    cmodel = op.checkpoint(model, (x,), memory_limit="70%", repeats=1, warmup=0,
                           fast_path=False)
    assert any(o.startswith(("F_ck", "F_none")) for o in cmodel.result.plan), "no re-run"
    for seed in (1, 2):
        y = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(seed))
        got, ref = cmodel(y), model(y)
        assert torch.equal(got, ref)
        assert all(torch.equal(a, b) for a, b in
                   zip(loss_grads(model, got), loss_grads(model, ref), strict=True))


def test_the_side_program_holds_the_masks_region_and_no_stage_splits_one():
    torch.manual_seed(0)
    model = VmapMask(chain_vmap=True)
    ext = extract_program(model, (torch.randn(8, WIDTH),))
    side = ext.side.gm
    assert side is not None
    side_regions = vmap_regions(list(side.graph.nodes))
    assert side_regions, "the mask's vmap region is in the side program"
    opened = [n for n in side.graph.nodes if "increment_nesting" in str(n.target)]
    closed = [n for n in side.graph.nodes if "decrement_nesting" in str(n.target)]
    assert len(opened) == len(closed) >= 1
    for stage in ext.stages:  # a region is whole in the one stage that holds it
        nodes = list(stage.module.gm.graph.nodes)
        opened = sum("increment_nesting" in str(n.target) for n in nodes)
        closed = sum("decrement_nesting" in str(n.target) for n in nodes)
        assert opened == closed
    assert sum(any("increment_nesting" in str(n.target) for n in st.module.gm.graph.nodes)
               for st in ext.stages) == 1  # the vmapped layer's region
