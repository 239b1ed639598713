"""Fast tests of ``benchmarks/bench_exact.py``'s options (no solve, no timing assertions).

``--threads``, ``--options`` and ``--memories`` must reach the solves as given, and leave the
defaults (2 threads, no extra, every memory) as they were; the solves are replaced by a stub
so the test is deterministic and runs no engine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from optmem import SolveOptions, Status
from optmem.result import Result

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_exact.py"


@pytest.fixture()
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_exact_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    calls: list[tuple[str, str, SolveOptions]] = []

    def instances(profile):
        for label in ("10%", "30%", "60%"):
            yield label, SimpleNamespace(chain=SimpleNamespace(length=3), label=label)

    def timed(problem, method, options):
        calls.append((problem.label, method, options))
        status = Status.OPTIMAL if method == "cpsat" else Status.FEASIBLE
        return Result(problem="remat-offload", method=method, status=status,
                      objective=2.0, bound=2.0 if method == "cpsat" else 1.0), 0.0

    monkeypatch.setitem(module.SETTINGS, "remat-offload",
                        module.Setting("cpsat", "dp", instances))
    monkeypatch.setattr(module, "timed", timed)
    module.calls = calls
    return module


def main(bench, monkeypatch, tmp_path, *argv):
    out = tmp_path / "exact.md"
    monkeypatch.setattr(sys, "argv", ["bench_exact.py", "--problems", "remat-offload",
                                      "--profiles", "p", "--out", str(out), *argv])
    bench.main()
    return out.read_text()


def test_defaults_unchanged(bench, monkeypatch, tmp_path):
    text = main(bench, monkeypatch, tmp_path)
    assert [label for label, method, _ in bench.calls if method == "cpsat"] == \
        ["10%", "30%", "60%"]
    for _, method, options in bench.calls:
        assert options.threads == 2
        assert options.extra == {}
        assert options.time_limit_s == (600.0 if method == "cpsat" else None)
    assert "600 s and 2 threads per exact solve, 12GB/s" in text
    assert "| remat-offload | 3 / 3 |" in text


def test_threads_options_memories(bench, monkeypatch, tmp_path):
    text = main(bench, monkeypatch, tmp_path, "--threads", "1", "--time-limit", "300",
                "--options", '{"strategy": "benders"}', "--memories", "10%,60%")
    exact = [(label, options) for label, method, options in bench.calls if method == "cpsat"]
    assert [label for label, _ in exact] == ["10%", "60%"]
    for _, options in exact:
        assert options.threads == 1
        assert options.time_limit_s == 300.0
        assert options.extra == {"strategy": "benders"}
    dps = [options for _, method, options in bench.calls if method == "dp"]
    assert len(dps) == 2 and all(o.threads == 1 and o.extra == {} for o in dps)
    assert "300 s and 1 thread per exact solve, options {'strategy': 'benders'}" in text
    assert text.count("| remat-offload | p |") == 2


@pytest.mark.parametrize("bad", ["not json", "[1, 2]"])
def test_options_must_be_a_json_object(bench, monkeypatch, tmp_path, bad):
    with pytest.raises(SystemExit):
        main(bench, monkeypatch, tmp_path, "--options", bad)
    assert bench.calls == []


def test_the_pipeline_rows_decide_every_allocation(bench, monkeypatch, tmp_path):
    """Stop 71: the pipeline's exact method is ``chunks`` with ``family="all"`` (its
    ``extra`` under ``--options``); ``--exact pipeline=ilp`` drops that entry (ilp refuses
    it)."""
    setting = bench.SETTINGS["pipeline"]
    assert (setting.exact, setting.dp, dict(setting.extra)) == ("chunks", "madpipe",
                                                               {"family": "all"})
    monkeypatch.setitem(bench.SETTINGS, "remat-offload",
                        bench.dataclasses.replace(bench.SETTINGS["remat-offload"],
                                                  extra=(("family", "all"),)))
    main(bench, monkeypatch, tmp_path, "--options", '{"chunk_work": 2}', "--memories", "10%")
    exact = [options for _, method, options in bench.calls if method == "cpsat"]
    assert [o.extra for o in exact] == [{"family": "all", "chunk_work": 2}]
    bench.calls.clear()
    main(bench, monkeypatch, tmp_path, "--exact", "remat-offload=cpsat", "--memories", "10%")
    assert [o.extra for _, m, o in bench.calls if m == "cpsat"] == [{}]
