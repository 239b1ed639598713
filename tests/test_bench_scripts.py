"""Every benchmark script still imports and builds its command line; a few cheap smoke runs.

No test ran most of ``benchmarks/``, so a refactor of ``optmem`` could break a script
unnoticed (stop 56 found ``bench_distributed.py`` planning with a bandwidth 1000x too small
and ``bench_hf_noise.py`` calling a helper with a missing argument). Each script is imported
in-process and its ``main`` run until it parses its arguments: the parser is captured there,
so nothing runs; it must build its help and know every option its docstring's usage lines
name. The smoke runs are the scripts' smallest deterministic modes (seconds, no torch
distributed); they assert on the output's shape and on solver figures, never on timings.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("bench_*.py")) + ["collect_results", "fuzz_cli",
                                                               "census_hf"]


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser ``main`` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parsed")
        self.parser = parser


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as the scripts import each other (``benchmarks/`` and
    the root on ``sys.path``)."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _parser_of(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``module.main`` builds, caught at its ``parse_args`` call."""
    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", [module.__file__])
    with pytest.raises(_Parsed) as caught:
        module.main()
    return caught.value.parser


def documented_options(name: str) -> set[str]:
    """The ``--options`` of the docstring's usage lines: lines naming ``<name>.py`` and their
    more indented continuation lines."""
    doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text())) or ""
    found: set[str] = set()
    indent = None
    for line in doc.splitlines():
        depth = len(line) - len(line.lstrip())
        if f"{name}.py" in line:
            indent = depth
        elif indent is None or not line.strip() or depth <= indent:
            indent = None
            continue
        found.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line))
    return found


def test_every_script_is_listed() -> None:
    assert len(SCRIPTS) >= 36
    assert {"bench_distributed", "bench_pipeline_exact", "bench_hf"} <= set(SCRIPTS)


def test_documented_options_reads_usage_lines() -> None:
    assert documented_options("bench_remat_offload_lns") >= {"--memory", "--work", "--start",
                                                             "--blocks", "--cap", "--light"}
    # the CLI's --memory-model in its prose is no option of the script
    assert "--memory-model" not in documented_options("bench_pipeline_strict")
    assert documented_options("bench_pipeline_strict") == {"--quick", "--markdown"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_builds_its_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _parser_of(_load(name, monkeypatch), monkeypatch)
    text = parser.format_help()
    assert text.startswith("usage:") and "--help" in text
    missing = documented_options(name) - set(parser._option_string_actions)
    assert not missing, f"{name}.py's docstring names options its parser lacks: {missing}"


def test_collect_results_help_writes_nothing(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    """``--help`` used to rewrite RESULTS.md (no parser); ``--out`` writes elsewhere."""
    module = _load("collect_results", monkeypatch)
    before = (BENCH / "RESULTS.md").stat().st_mtime_ns
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "--out" in capsys.readouterr().out
    out = tmp_path / "RESULTS.md"
    module.main(["--out", str(out)])
    assert (BENCH / "RESULTS.md").stat().st_mtime_ns == before
    text = out.read_text()
    assert text.startswith("# Benchmark results") and "- [hunts](results/hunts.md)" in text


def test_distributed_quick_plans_at_bytes_per_second(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """docs/distributed.md's table: the bandwidth went to the problem as bytes per ms where it
    takes bytes per second, so the plans ran on a 12 MB/s link (contiguous 1747.6 ms)."""
    module = _load("bench_distributed", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_distributed.py", "--quick"])
    module.main()
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| (16|8) \|", line)]
    assert [r[:6] for r in rows] == [
        ["| 16", "12GB/s", "201.9", "200.1", "134.0", "1.49"],
        ["| 16", "150GB/s", "198.7", "198.5", "132.4", "1.50"],
        ["| 8", "12GB/s", "332.4", "398.5", "233.2", "1.71"],
    ]


@pytest.mark.usefixtures("one_torch_thread")
def test_hf_noise_child_times_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child called ``bench_hf._with_plan`` without its limit (a TypeError at the first
    optmem step); on a tiny GPT-2, one round: every setting and way of timing has its time."""
    bench_hf = _load("bench_hf", monkeypatch)
    monkeypatch.setattr(bench_hf, "FULL", [bench_hf.Spec("gpt2", 2, 32, 16, 2, vocab=64)])
    module = _load("bench_hf_noise", monkeypatch)
    out = module.child("gpt2", 1)
    settings = ("store-all", "HF", "optmem halfway")
    assert set(out["cpu"]) == {f"{s}|{v}" for s in settings for v in module.VARIANTS}
    assert all(len(xs) == 1 and xs[0] > 0 for xs in out["cpu"].values())
    text = module.report("gpt2", 1, [out])
    assert len([line for line in text.splitlines() if line.startswith("| glibc")]) == 12
