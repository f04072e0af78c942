"""From a config to the objects a run needs: backbone, text encoder, example inputs. Shared by train,
sample, plan and the checks before launch."""
from __future__ import annotations

import torch

from .config import RunConfig
from .models.loading import CheckpointError, build_unet
from .models.text import TextEncoder
from .models.units import Backbone
from .models.unet import unet_backbone
from .pipeline.split import stage_specs
from .pipeline.traffic import Crossing, boundary_crossings, trace_shapes

__all__ = ["build_backbone", "build_text_encoder", "AUTOCAST_DTYPES", "sample_shape", "example_inputs",
           "boundary_traffic"]

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_backbone(config: RunConfig, device: str | torch.device = "cpu") -> Backbone:
    try:
        return unet_backbone(build_unet(config.model, config.train.seed, device), config.model.units)
    except ValueError as exc:  # unsupported UNet options
        raise CheckpointError(str(exc)) from None


def sample_shape(config: RunConfig, backbone: Backbone) -> tuple[int, int, int]:
    cfg = backbone.model.config
    size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
    return cfg.in_channels, size, size


def _pooled_text_width(backbone: Backbone) -> int:
    """Width of SDXL-style pooled text embeddings: the added embedding's input less the six time ids; 0 if unused."""
    cfg = backbone.model.config
    if cfg.addition_embed_type != "text_time":
        return 0
    return cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim


def build_text_encoder(config: RunConfig, backbone: Backbone) -> TextEncoder:
    cfg = backbone.model.config
    if config.model.text_encoder == "tiny-clip":
        pooled = max(_pooled_text_width(backbone), 1)
        return TextEncoder.tiny(cfg.cross_attention_dim, pooled, config.model.text_max_length,
                                config.train.seed + 1)
    return TextEncoder.from_folder(config.model.text_encoder, config.model.text_max_length)


def example_inputs(config: RunConfig, backbone: Backbone, batch: int) -> tuple[dict, dict]:
    """Zero-filled inputs and conditions of the shapes a step feeds the backbone (for tracing and costing)."""
    cfg = backbone.model.config
    conditions = {"timestep": torch.zeros(batch),
                  "encoder_hidden_states": torch.zeros(batch, config.model.text_max_length, cfg.cross_attention_dim)}
    if "text_embeds" in backbone.conditions:
        conditions["text_embeds"] = torch.zeros(batch, _pooled_text_width(backbone))
        conditions["time_ids"] = torch.zeros(batch, 6)
    return {"sample": torch.zeros(batch, *sample_shape(config, backbone))}, conditions


def boundary_traffic(config: RunConfig, backbone: Backbone, split: list[int]) -> list[Crossing]:
    """Bytes each boundary sends per micro-batch, from shapes traced on the meta device."""
    meta = backbone if next(backbone.model.parameters()).is_meta else build_backbone(config, "meta")
    shapes = trace_shapes(meta, *example_inputs(config, meta, config.micro_batch_size))
    element = 4 if config.train.precision == "fp32" else 2
    return boundary_crossings(stage_specs(meta, split), shapes, element)
