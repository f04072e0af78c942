"""The whole model's weights on rank 0, sent over the process group: no folder shared between machines needed.

Each pipeline rank of replica 0 lists its stages' tensors (names, shapes, dtypes: a small object gather), then
sends them one by one; rank 0 receives each into a buffer on its device and keeps it on the host, so its device
holds one tensor of another stage at a time.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import Topology
from ..pipeline.data_parallel import full

__all__ = ["gather_weights", "original_base"]


def gather_weights(modules, topo: Topology) -> dict[str, torch.Tensor] | None:
    """Every weight of the model under its diffusers name, on the host of rank 0; None on the other ranks.
    Collective over every process: replicas that cut their stages' weights (pipeline.data_parallel_shard) make each
    whole together, one at a time, in the same order; replica 0's pipeline ranks send them."""
    own = {name: t for m in modules for name, t in m.full_state_dict().items()}
    if topo.dp_rank != 0:
        for t in own.values():
            full(t)  # this replica's part in making each whole
        return None
    listing = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in own.items()]
    listings = [None] * topo.pp_size if topo.pp_rank == 0 else None
    dist.gather_object(listing, listings, dst=0, group=topo.pp_group)  # replica 0's pipeline rank r is rank r
    if topo.pp_rank != 0:
        for name, _, _ in listing:
            dist.send(full(own[name]).to(topo.device).contiguous(), dst=0)  # swapped blocks' are in host memory
        return None
    merged = {name: full(t).cpu() for name, t in own.items()}
    for source, theirs in enumerate(listings[1:], start=1):
        for name, shape, dtype in theirs:
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=topo.device)
            dist.recv(buffer, src=source)
            merged[name] = buffer.cpu()
    return merged


def original_base(config, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a LoRA run's, under peft's names) with the frozen base's entries replaced by the base as model.path
    holds it (or as seeded, without one), in fp32: what the adapters are merged into where the run stored the base
    in fewer bits (memory.base_dtype bf16, fp8, int8, nf4), whose rounding would otherwise stay in the merged model
    (NF4: up to 0.15 of each block's largest weight). Built again on this host's CPU, one model's worth of memory."""
    from ..build import build_backbone
    from ..models.lora import is_adapter, plain_name

    base = build_backbone(config, "cpu").model.state_dict()  # without adapters: the plain model, every weight real
    return {name: t if is_adapter(name) else base[plain_name(name)] for name, t in weights.items()}
