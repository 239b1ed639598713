"""``benchmarks/bench_hf_early_stop.py`` on a tiny GPT-2 (no timing assertions).

What its table rests on: the four settings run one plan and give the plain model's loss
and gradients; torch's early stop is what makes HF's re-run skip matrix products (each
layer's MLP output projection); optmem's joint re-runs skip them too (the first step,
which traces them, included), and without them the executor re-runs them, as HF without
early stop does. The report's ratios and intervals come from the per-round times.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch bridge needs torch")
pytest.importorskip("transformers", reason="the HF benchmark needs transformers (dev extra)")

HERE = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def es():
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location("bench_hf_early_stop",
                                                  HERE / "bench_hf_early_stop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    return module


def test_the_four_settings_and_what_early_stop_skips(es):
    bh = es.bh
    spec = bh.Spec("gpt2", 3, 32, 16, 2, vocab=100)
    steps, plan = es.settings(spec)
    assert set(steps) == {es.HF, es.NO_EARLY_STOP, es.OPTMEM, es.OPTMEM_EAGER}
    assert sum(str(op).startswith("F_ck") for op in plan) == 3  # one segment per layer
    counts = {}
    for name, step in steps.items():
        with es._OpCount() as mode:
            step()
        counts[name] = es._matmuls(mode.ops)
    # early stop skips one product per layer (the MLP's c_proj), so do joint re-runs;
    # without either it is re-run
    assert counts[es.NO_EARLY_STOP] == counts[es.HF] + spec.layers
    assert counts[es.OPTMEM_EAGER] == counts[es.NO_EARLY_STOP]
    assert counts[es.OPTMEM] == counts[es.HF]


def test_report_ratios_come_from_the_rounds(es):
    spec = es.bh.Spec("gpt2", 3, 32, 16, 2, vocab=100)
    times = {es.HF: [10.0] * 5, es.NO_EARLY_STOP: [11.0] * 5, es.OPTMEM: [9.0, 9.5, 10.0,
                                                                        10.5, 11.0]}
    counts = {k: Counter({"aten.mm.default": 2, "aten.addmm.default": 3, "aten.add.Tensor": 1})
              for k in times}
    rows = es.report(spec, times, counts)
    assert rows[0].startswith("### gpt2: 3 layers")
    hf, off, opt = rows[4:7]
    assert "| 1.100 | 1.100-1.100" in off and "| 5 | 6 |" in off
    assert opt.startswith("| optmem, HF's plan | 10.0 | 1.000 | 0.900-1.100")
