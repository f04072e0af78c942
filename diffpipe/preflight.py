"""Everything that can fail on the user's input, checked cheaply on the meta device before any process starts:
architecture, checkpoint file, resolution, dataset shape, and the stage split (planned when "auto")."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .build import build_backbone, sample_shape
from .config import RunConfig
from .models.loading import CheckpointError, check_checkpoint, weights_file
from .models.units import Backbone
from .pipeline.split import SplitError
from .pipeline.stage import repeated_blocks
from .planner.plan import resolve_stages

__all__ = ["Checked", "check_before_launch"]


@dataclass
class Checked:
    """The model on the meta device, the resolved stage starts and the stages to checkpoint."""

    backbone: Backbone
    split: list[int]
    checkpointing: list[int]


def check_before_launch(config: RunConfig) -> Checked:
    backbone = build_backbone(config, device="meta")
    if config.model.path is not None:
        check_checkpoint(backbone.model, weights_file(Path(config.model.path)))
    if config.model.text_encoder != "tiny-clip" and not (Path(config.model.text_encoder) / "config.json").is_file():
        raise CheckpointError(f"model.text_encoder={config.model.text_encoder}: no config.json there; give a local "
                              "transformers CLIP folder or \"tiny-clip\"")
    shape = sample_shape(config, backbone)  # any size: the upsamplers return to each skip's size, as in diffusers
    if config.data.dataset == "digits" and shape != (1, 8, 8):
        raise SplitError(f"data.dataset='digits' has 1x8x8 images but the model takes {shape}; use "
                         "model.preset = \"digits\", a config with in_channels=1 and sample_size=8, or data.dataset = \"synthetic\"")
    repeated_blocks(backbone, config.pipeline.compile)  # "blocks" needs some
    split, checkpointing = resolve_stages(config, backbone)
    return Checked(backbone, split, checkpointing)
