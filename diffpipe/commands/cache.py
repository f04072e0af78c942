"""`diffpipe cache CONFIG [--processes N]`: compute the VAE latents and text-encoder outputs of an image-folder run
before training, N processes (one per GPU on a GPU machine; or under torchrun) each encoding its share.

    diffpipe cache examples/photos.toml
    diffpipe cache my_sdxl.toml --processes 8
    torchrun --nproc-per-node 8 -m diffpipe cache my_sdxl.toml

Training then finds every entry in the cache and starts at once; a run started without it builds the same cache on
its own processes first.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from ..build import build_backbone, build_dataset, build_text_encoder
from ..config_files import build_config, load_config
from ..data.sources import source_of
from ..distributed import init_topology, launch, resolve_device_kind, under_torchrun
from ..errors import ConfigError

__all__ = ["cache_command", "cache_worker"]


def cache_command(config_path: str, sets: list[str], processes: int) -> None:
    """Build the cache of an image-folder config in `processes` processes (under torchrun: its processes)."""
    config = load_config(config_path, sets)
    if not source_of(config).cached(config):
        raise ConfigError(f"{config_path}: nothing to cache; diffpipe cache needs data.dataset = \"folder\" and "
                          "data.cache = true")
    launch(cache_worker, (config.model_dump(mode="json"),), int(os.environ["WORLD_SIZE"]) if under_torchrun()
           else processes)


def cache_worker(config_data: dict) -> None:
    """Each process: its share of the missing cache entries, then everyone reads the whole cache back (a check)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    config = build_config(config_data)
    world = int(os.environ["WORLD_SIZE"])
    topo = init_topology(1, world, resolve_device_kind(config.train.device), config.train.collective_timeout_minutes)
    backbone = build_backbone(config, "meta")
    text = build_text_encoder(config, backbone).to(topo.device)
    data = build_dataset(config, backbone, text, topo.device, topo.rank, topo.world_size, dist.barrier)
    if topo.is_main:
        counts = ", ".join(f"{b} {n}" for b, n in data.bucket_counts().items())
        print(f"cached {len(data.items)} {data.kind} ({counts}) and {len(set(data.captions))} captions", flush=True)
