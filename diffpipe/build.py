"""From a config to the objects a run needs: backbone, stage specs, text encoder. Shared by train, sample, checks.

`check_before_launch` does everything that can fail on the user's input (architecture, checkpoint, split,
resolution) on the meta device, in the launching process, before any worker starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import RunConfig
from .models.loading import CheckpointError, build_unet, check_checkpoint, weights_file
from .models.text import TextEncoder
from .models.units import Backbone
from .models.unet import unet_backbone
from .pipeline.split import SplitError, balanced_by_parameters, stage_specs
from .pipeline.traffic import Crossing, boundary_crossings, trace_shapes

__all__ = ["Checked", "build_backbone", "resolve_split", "build_text_encoder", "check_before_launch",
           "AUTOCAST_DTYPES", "sample_shape", "boundary_traffic"]

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Checked:
    """What `check_before_launch` found: the model on the meta device and the resolved stage starts."""

    backbone: Backbone
    split: list[int]


def build_backbone(config: RunConfig, device: str | torch.device = "cpu") -> Backbone:
    try:
        return unet_backbone(build_unet(config.model, config.train.seed, device))
    except ValueError as exc:  # unsupported UNet options
        raise CheckpointError(str(exc)) from None


def resolve_split(config: RunConfig, backbone: Backbone) -> list[int]:
    """Stage start indices: the user's `pipeline.split`, or balanced by parameter count."""
    stages = config.pipeline.stages * config.pipeline.virtual_stages
    if stages > len(backbone.units):
        raise SplitError(
            f"pipeline.stages x pipeline.virtual_stages = {stages} stages, but the model has only "
            f"{len(backbone.units)} units ({', '.join(u.name for u in backbone.units)}); use at most "
            f"{len(backbone.units)} stages")
    if config.pipeline.split == "auto":
        return balanced_by_parameters(backbone, stages)
    stage_specs(backbone, config.pipeline.split)  # validates
    return list(config.pipeline.split)


def sample_shape(config: RunConfig, backbone: Backbone) -> tuple[int, int, int]:
    cfg = backbone.model.config
    size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
    return cfg.in_channels, size, size


def build_text_encoder(config: RunConfig, backbone: Backbone) -> TextEncoder:
    cfg = backbone.model.config
    if config.model.text_encoder == "tiny-clip":
        pooled = 0
        if cfg.addition_embed_type == "text_time":
            pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        return TextEncoder.tiny(cfg.cross_attention_dim, max(pooled, 1), config.model.text_max_length,
                                config.train.seed + 1)
    return TextEncoder.from_folder(config.model.text_encoder, config.model.text_max_length)


def boundary_traffic(config: RunConfig, backbone: Backbone, split: list[int]) -> list[Crossing]:
    """Bytes each boundary sends per micro-batch, from shapes traced on the meta device."""
    cfg, b = backbone.model.config, config.micro_batch_size
    conditions = {"timestep": torch.zeros(b),
                  "encoder_hidden_states": torch.zeros(b, config.model.text_max_length, cfg.cross_attention_dim)}
    if "text_embeds" in backbone.conditions:
        conditions["text_embeds"] = torch.zeros(b, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim)
        conditions["time_ids"] = torch.zeros(b, 6)
    meta = backbone if next(backbone.model.parameters()).is_meta else build_backbone(config, "meta")
    shapes = trace_shapes(meta, {"sample": torch.zeros(b, *sample_shape(config, meta))}, conditions)
    element = 4 if config.train.precision == "fp32" else 2
    return boundary_crossings(stage_specs(meta, split), shapes, element)


def check_before_launch(config: RunConfig) -> Checked:
    """Validate model, checkpoint, split and resolution cheaply, on the meta device."""
    backbone = build_backbone(config, device="meta")
    if config.model.path is not None:
        check_checkpoint(backbone.model, weights_file(Path(config.model.path)))
    if config.model.text_encoder != "tiny-clip" and not (Path(config.model.text_encoder) / "config.json").is_file():
        raise CheckpointError(f"model.text_encoder={config.model.text_encoder}: no config.json there; give a local "
                              "transformers CLIP folder or \"tiny-clip\"")
    factor = 2 ** backbone.model.num_upsamplers
    _, h, w = sample_shape(config, backbone)
    if h % factor or w % factor:
        raise SplitError(f"sample size {h}x{w} must be divisible by {factor} (the UNet upsamples {backbone.model.num_upsamplers} times)")
    if config.data.dataset == "digits" and sample_shape(config, backbone) != (1, 8, 8):
        raise SplitError(f"data.dataset='digits' has 1x8x8 images but the model takes {sample_shape(config, backbone)}; "
                         "use model.preset = \"digits\" or a config with in_channels=1, sample_size=8")
    return Checked(backbone, resolve_split(config, backbone))
