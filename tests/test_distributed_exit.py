"""How a rank started by ``spawn`` ends (:func:`optmem.pytorch.distributed.end_process`).

It leaves with ``os._exit`` to skip the interpreter's finalisation, where gloo's threads can
abort a finished rank; what a normal exit does must still happen: ``atexit`` handlers,
non-daemon threads and thread pools finish, redirected output is flushed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="spawn needs torch")

import distributed_workers as w  # noqa: E402

from optmem.pytorch.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.distributed


def test_a_rank_ends_as_a_normal_exit_would(tmp_path):
    spawn(w.exit_hooks, 2, str(tmp_path), init_file=str(tmp_path / "rendezvous"))
    for rank in range(2):
        for name in ("atexit", "thread", "pool"):
            assert (tmp_path / f"{name}{rank}").read_text() == name
        assert (tmp_path / f"stdout{rank}").read_text() == f"rank {rank} of 2\n"


def test_more_ranks_than_gpus_is_refused_before_any_process(monkeypatch):
    """With CUDA, ``spawn`` gives rank ``r`` the GPU ``r % count``: more ranks than GPUs put
    two ranks on one GPU, which NCCL does not take (they failed inside NCCL, after the
    start). It is one input error before any process starts (a one-GPU machine faked)."""
    import torch.multiprocessing as mp

    from optmem.errors import OptmemInputError

    class Started(Exception):
        pass

    def start_processes(*args, **kwargs):
        raise Started

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(mp, "start_processes", start_processes)
    with pytest.raises(OptmemInputError, match="2 processes but 1 CUDA device"):
        spawn(w.exit_hooks, 2, "unused", init_file="unused")
    with pytest.raises(Started):  # one rank per GPU: started
        spawn(w.exit_hooks, 1, "unused", init_file="unused")
