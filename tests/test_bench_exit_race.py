"""``benchmarks/bench_exit_race.py``'s baseline is the example less its ``end_process`` line.

No launch here (the count is the benchmark's): only that the baseline differs from
``examples/ddp_checkpoint.py`` by exactly that line, and that a launch is classified by its
exit code and the race's line.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_exit_race.py"


@pytest.fixture()
def bench():
    spec = importlib.util.spec_from_file_location("bench_exit_race_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_baseline_is_the_example_without_end_process(bench, tmp_path):
    baseline = bench.baseline_copy(tmp_path).read_text().splitlines()
    example = bench.EXAMPLE.read_text().splitlines()
    assert len(baseline) == len(example) - 1
    assert [line for line in example if line not in baseline] == \
        [line for line in example if line.strip().startswith("op.end_process()")]
    assert (tmp_path / "common.py").exists()  # the example's helpers beside it


@pytest.mark.parametrize(("code", "stderr", "verdict"), [
    (0, "", "ok"), (1, "x\nterminate called without an active exception\ny", "race"),
    (1, "Traceback: ValueError", "other")])
def test_a_launch_is_classified(bench, monkeypatch, code, stderr, verdict):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, code, "", stderr)

    monkeypatch.setattr(bench.subprocess, "run", run)
    assert bench.launch(Path("script.py")) == verdict
