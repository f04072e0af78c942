"""The start-up probes of the links a run's processes use (observe/observer.py): between neighbouring pipeline
stages, three processes (the middle one pairs with each neighbour in turn), a round trip's seconds per byte, and the
exchange each probe times moves what it says: the payload sent comes back whole."""
from __future__ import annotations

from ..helpers import run_workers


def _pipeline_probe_worker(out_dir: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    import diffpipe.observe.observer as observer
    from diffpipe.distributed import init_topology

    topo = init_topology(3, 1, "cpu")
    moved = []
    timed = observer._seconds_per_byte

    def counting(exchange, nbytes, device, repeats):  # what each probe times, and how many bytes it says it moved
        moved.append(nbytes)
        return timed(exchange, nbytes, device, repeats)
    observer._seconds_per_byte = counting
    try:
        rate = observer.probe_link(topo, nbytes=4096, repeats=2)
    finally:
        observer._seconds_per_byte = timed
    torch.save({"rate": rate, "moved": moved}, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def test_each_stage_probes_the_link_to_each_neighbour(tmp_path):
    import torch

    run_workers(_pipeline_probe_worker, (str(tmp_path),), 3)
    seen = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(3)]
    assert all(s["rate"] > 0 for s in seen)
    # a round trip moves the buffer twice; the middle stage times one pair with each neighbour
    assert [s["moved"] for s in seen] == [[8192], [8192, 8192], [8192]]
