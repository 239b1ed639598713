"""Test-suite policy: deterministic verdicts, and no skips in CI but CUDA ones.

* Hypothesis runs with the ``ci`` profile by default: derandomised (the same examples on
  every run), no deadline, no example database, the ``too_slow`` health check off (it times
  data generation, so a loaded machine would fail it) and a reproduction blob printed on
  failure. ``HYPOTHESIS_PROFILE=dev`` gives random examples for local bug hunting.
* No test's verdict depends on wall-clock time or load: solver tests use deterministic work
  limits (``SolveOptions.node_limit``, ``deterministic_time``) or inject engines; timings
  live in ``benchmarks/``.
* In CI (``CI=true``) every engine is installed, so a skip is a defect. Only tests that need
  CUDA may skip there (this machine and CI have no GPU); any other skip, including a module
  skipped by ``pytest.importorskip`` because an engine is missing, turns the run red with
  the skip's reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run the test with one torch thread, then restore the count (torch imported here only).

    Tiny kernels run faster on one thread than on oversubscribed ones on a shared machine;
    modules ask for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank(tmp_path: Any) -> Iterator[None]:
    """A gloo process group of one process (this one), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_ALLOWED = ("CUDA", "GPU")
_unexpected: list[str] = []


def _record(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if not any(word in reason for word in _ALLOWED):
        _unexpected.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") and _unexpected:
        print("\nskips are not allowed in CI (every engine is installed there):")
        for line in _unexpected:
            print("  " + line)
        session.exitstatus = 1
