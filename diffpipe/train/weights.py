"""The whole model's weights on rank 0, sent over the process group: no folder shared between machines needed.

Each pipeline rank of replica 0 lists its stages' tensors (names, shapes, dtypes: a small object gather), then
sends them one by one; rank 0 receives each into a buffer on its device and keeps it on the host, so its device
holds one tensor of another stage at a time.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import Topology
from ..export.run import export_files, format_writer
from ..models.lora import lora_metadata, lora_scale, lora_weights, merge_lora
from ..models.text import TextEncoder
from ..pipeline.data_parallel import full
from ..precision import frozen_storage
from ..written_files import save_tensors

__all__ = ["gather_weights", "original_base", "save_run_weights", "write_weights", "export_adapters"]


def gather_weights(modules, topo: Topology, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
    """Every weight of the model (`trained_only`: every trained one) under its diffusers name, on the host of rank 0;
    None on the other ranks. Collective over every process: replicas that cut their stages' weights
    (pipeline.data_parallel_shard) make each whole together, one at a time, in the same order; replica 0's pipeline
    ranks send them."""
    own = ({name: p.detach() for m in modules for name, p in m.full_named_parameters() if p.requires_grad}
           if trained_only else {name: t for m in modules for name, t in m.full_state_dict().items()})
    if topo.replica_rank != 0:
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


def save_run_weights(trainer) -> None:
    """model.safetensors (every stage's weights, sent to rank 0 over the process group; with LoRA, merged into the
    base, and the adapters alone in lora.safetensors), model_config.json and the text encoder (unless it is a
    pipeline folder's), in rank 0's run folder. Every process takes part."""
    config, topo, run_dir = trainer.config, trainer.topo, trainer.run_dir
    if not config.output.save_weights:
        return
    merged = gather_weights(trainer.modules, topo)
    if topo.is_main:
        write_weights(config, merged, trainer.model_config, run_dir, topo.device.type,
                      trainer.feed.family.lora_targets)
        if isinstance(trainer.text, TextEncoder):  # a pipeline folder's text encoders stay in it
            trainer.text.to("cpu")
            trainer.text.save(run_dir / "text_encoder")
    dist.barrier()


def write_weights(config, weights: dict[str, torch.Tensor], model_config: dict, folder, device_kind: str,
                  lora_targets: tuple[str, ...]) -> None:
    """A run's weight files in `folder` from the whole model's `weights` (peft's names with LoRA): model.safetensors
    (with LoRA, the adapters merged in fp32 into the base as model.path holds it, whatever memory.base_dtype stored it
    in: a bf16 sum would round the update away, and a stored copy's rounding would stay in the result), the adapters
    alone in lora.safetensors, and model_config.json. `device_kind`: where the weights were trained (how "auto"
    stored the base)."""
    if config.adapter.type != "none":
        save_tensors(lora_weights(weights), folder / "lora.safetensors", metadata=lora_metadata(config, lora_targets))
        stored = frozen_storage(config, device_kind)
        if stored.dtype != torch.float32 or stored.linear:
            weights = original_base(config, weights)
        weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
        weights = merge_lora(weights, lora_scale(config.adapter))
    save_tensors(weights, folder / "model.safetensors")
    (folder / "model_config.json").write_text(json.dumps(model_config, indent=1, default=list))


def export_adapters(trainer, steps_done: int) -> Path | None:
    """checkpoint.export_every: the adapters after `steps_done` steps as RUN/exports/lora-step-N.safetensors in
    checkpoint.export_format (the export a finished run's `diffpipe export` writes); its path on rank 0. Every
    process takes part: only the trained weights travel to rank 0."""
    adapters = gather_weights(trainer.modules, trainer.topo, trained_only=True)
    if not trainer.topo.is_main:
        return None
    config = trainer.config
    writer = format_writer(config.checkpoint.export_format)
    out = trainer.run_dir / "exports" / f"lora-step-{steps_done:08d}.safetensors"
    with tempfile.TemporaryDirectory(prefix="diffpipe-export-") as folder:
        save_tensors(lora_weights(adapters), Path(folder) / "lora.safetensors",
                     metadata=lora_metadata(config, trainer.feed.family.lora_targets))
        (Path(folder) / "model_config.json").write_text(json.dumps(trainer.model_config, indent=1, default=list))
        return export_files(Path(folder), config, writer, writer.target(out))
