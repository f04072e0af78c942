"""Process groups: a process waiting for another that never comes fails after `train.collective_timeout_minutes`
instead of hanging, in collectives and in the pipeline's sends alike."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diffpipe.distributed import init_topology

from .helpers import run_workers

TIMEOUT_S = 2.0
SILENT_S = 60.0  # the silent peer stays this long at most: without a timeout, that is how long the other waits


def _wait_for_a_peer_that_never_comes(out_dir: str, timeout_minutes: float) -> None:
    topo = init_topology(2, 1, "cpu", timeout_minutes)
    if topo.rank == 1:  # alive but never joining (a process hung elsewhere), until the other is done
        deadline = time.monotonic() + SILENT_S
        while not Path(out_dir, "waits.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return
    waits = []
    for wait in (lambda: dist.all_reduce(torch.ones(1), group=topo.pp_group),
                 lambda: dist.recv(torch.ones(1), src=1, group=topo.send_group)):
        start = time.monotonic()
        try:
            wait()
            waits.append("returned")
        except RuntimeError:
            waits.append(f"{time.monotonic() - start:.1f}")
    Path(out_dir, "waits.txt").write_text(" ".join(waits))


def test_a_missing_peer_fails_a_collective_and_a_receive_after_the_timeout(tmp_path):
    run_workers(_wait_for_a_peer_that_never_comes, (str(tmp_path), TIMEOUT_S / 60), 2)
    waits = (tmp_path / "waits.txt").read_text().split()
    print("seconds waited:", waits)
    # each wait ends at the timeout, far from the silent peer's 60 s (the bound leaves room for a loaded machine)
    assert len(waits) == 2 and all(w != "returned" and float(w) < SILENT_S / 4 for w in waits), waits


if __name__ == "__main__":  # the planted error: torch's default timeout, under which rank 0 waits for rank 1's exit
    run_workers(_wait_for_a_peer_that_never_comes, (sys.argv[1], None), 2)
    print(Path(sys.argv[1], "waits.txt").read_text())


def test_nccl_gets_a_gpu_per_process_or_auto_trains_on_the_cpu(monkeypatch):
    """Two processes on one GPU failed inside NCCL ("Duplicate GPU detected"), "auto" included (seen on one H200)."""
    from diffpipe.distributed import resolve_device_kind

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device_kind("auto", 1) == "cuda"
    assert resolve_device_kind("auto", 2) == "cpu"
    assert resolve_device_kind("cuda", 1) == "cuda"
    with pytest.raises(RuntimeError, match=r"2 processes on this machine .* but 1 GPU\(s\): NCCL needs one GPU per"):
        resolve_device_kind("cuda", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device_kind("auto", 2) == "cpu"
