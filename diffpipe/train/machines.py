"""Resuming on machines that share no disk: every process agrees on the checkpoint, and the files its machine's
run folder lacks are sent over the process group by a process that has them.

Each machine's run folder holds the shards its own processes wrote and the seal listing every file
(train/checkpoint.py). A run restarted by torchrun (`--max-restarts`) on several machines therefore finds its
checkpoint in pieces; before loading, `complete_checkpoint` gives every folder the whole of it, checked against the
seal's sha256. Nothing moves where every folder is already whole (one machine, or a shared disk).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..models.loading import CheckpointError
from .checkpoint import CHECKPOINTS, read_seal, sha256_of

__all__ = ["agreed_checkpoint", "complete_checkpoint"]

_CHUNK = 64 * 2**20  # bytes per broadcast


def _complete_checkpoints(run_dir: Path) -> list[str]:
    root = Path(run_dir) / CHECKPOINTS
    return sorted(p.name for p in root.glob("step-*") if (p / "complete.json").is_file()) if root.is_dir() else []


def agreed_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint that every process's run folder holds a seal of (a machine that stopped while sealing
    may lack the newest); the same for every process. Collective."""
    mine = _complete_checkpoints(run_dir)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    common = sorted(set.intersection(*(set(names) for names in everyone)))
    if not common:
        raise CheckpointError(f"{run_dir}: no checkpoint is sealed in every machine's run folder (this one holds "
                              f"{', '.join(mine) or 'none'}); start the run again, or copy one checkpoint folder "
                              "into every machine's run folder")
    return Path(run_dir) / CHECKPOINTS / common[-1]


def complete_checkpoint(path: Path) -> int:
    """Every file of the seal into this process's folder, sent by the lowest process that has it; returns the
    bytes received. Collective (over a gloo group of its own: files travel through host memory)."""
    files = read_seal(path)["files"]
    have = {name for name, info in files.items()
            if (path / name).is_file() and (path / name).stat().st_size == info["bytes"]}
    everyone: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, have)
    missing_somewhere = sorted(name for name in files if any(name not in h for h in everyone))
    if not missing_somewhere:
        return 0
    group = dist.new_group(backend="gloo")
    received = 0
    try:
        for name in missing_somewhere:
            holders = [rank for rank, h in enumerate(everyone) if name in h]
            if not holders:
                raise CheckpointError(f"checkpoint {path}: {name} is in no machine's run folder; resume from an older "
                                      "checkpoint (delete this folder on every machine)")
            received += _send_file(path / name, files[name], holders[0], name not in have, group)
    finally:
        dist.destroy_process_group(group)
    return received


def _send_file(target: Path, info: dict, source: int, wanted: bool, group) -> int:
    size = info["bytes"]
    partial = target.with_name(f".{target.name}.{dist.get_rank()}.part")
    out = open(partial, "wb") if wanted else None
    try:
        with open(target, "rb") if dist.get_rank() == source else contextlib.nullcontext() as src:
            for start in range(0, size, _CHUNK):
                length = min(_CHUNK, size - start)
                buffer = (torch.frombuffer(bytearray(src.read(length)), dtype=torch.uint8) if src is not None
                          else torch.empty(length, dtype=torch.uint8))
                dist.broadcast(buffer, group_src=source, group=group)
                if out is not None:
                    out.write(buffer.numpy().tobytes())
    finally:
        if out is not None:
            out.close()
    if not wanted:
        return 0
    if sha256_of(partial) != info["sha256"]:
        partial.unlink()
        raise CheckpointError(f"checkpoint {target.parent}: {target.name} arrived damaged from process {source} "
                              "(sha256 differs from its seal); resume from an older checkpoint")
    os.replace(partial, target)
    return size

