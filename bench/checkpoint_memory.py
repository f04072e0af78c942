"""How much host memory DCP's safetensors writer holds beyond the state it saves, in one file or cut into many, for
a synchronous and a background (`async_save`) checkpoint; one process on the CPU, gloo.

    python bench/checkpoint_memory.py [--gib 2] [--files 1|8]

Run once per (mode, files): the peak resident memory of a process only grows. Prints one JSON line: the state's
size, the peak resident memory before and after the save, and the save's time (and the background save's pause).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=2)
    parser.add_argument("--files", type=int, default=1)
    parser.add_argument("--background", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    tensors = 8 * args.gib
    state = {f"t{i}": torch.randn(32, 1024, 1024) for i in range(tensors)}  # 128 MiB each
    before = _peak_gib()
    files = {name: 1 + i * args.files // tensors for i, name in enumerate(state)} if args.files > 1 else None
    writer = HuggingFaceStorageWriter(tempfile.mkdtemp(), save_distributed=True, fqn_to_index_mapping=files)
    start = time.perf_counter()
    pause = None
    if args.background:
        future = dcp.async_save(state, storage_writer=writer, process_group=dist.new_group(backend="gloo"))
        pause = time.perf_counter() - start
        future.result()
    else:
        dcp.save(state, storage_writer=writer)
    print(json.dumps({"state_GiB": args.gib, "files": args.files, "background": args.background,
                      "peak_before_GiB": round(before, 2), "peak_after_GiB": round(_peak_gib(), 2),
                      "held_beyond_state_GiB": round(_peak_gib() - before, 2),
                      "save_s": round(time.perf_counter() - start, 2),
                      "pause_s": round(pause, 2) if pause is not None else None}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
