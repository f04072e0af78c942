"""Everything that can fail on the user's input, checked cheaply on the meta device before any process starts:
architecture, checkpoint file, resolution, dataset shape, and the stage split (planned when "auto")."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .build import build_backbone, sample_shape
from .config import ConfigError, RunConfig
from .distributed import resolve_device_kind, under_torchrun
from .models.loading import CheckpointError, checked_weights
from .models.units import Backbone
from .pipeline.schedules import schedule_named
from .pipeline.split import SplitError
from .pipeline.stage import repeated_blocks
from .planner.plan import resolve_memory, resolve_stages
from .torch_support import schedule_problem

__all__ = ["Checked", "check_before_launch"]


@dataclass
class Checked:
    """The model on the meta device, the resolved stage starts, the stages to checkpoint and the [memory] settings the
    planner chose ("auto"), by key."""

    backbone: Backbone
    split: list[int]
    checkpointing: list[int]
    memory: dict = field(default_factory=dict)


def check_before_launch(config: RunConfig) -> Checked:
    backbone = build_backbone(config, device="meta")
    checked_weights(backbone.model, config.model, backbone.family)  # converts an original-layout file once
    if config.model.text_encoder != "tiny-clip" and not (Path(config.model.text_encoder) / "config.json").is_file():
        raise CheckpointError(f"model.text_encoder={config.model.text_encoder}: no config.json there; give a local "
                              "transformers CLIP folder or \"tiny-clip\"")
    shape = sample_shape(config, backbone)  # UNets: any size (the upsamplers return to each skip's size)
    if config.data.dataset == "digits" and shape != (1, 8, 8):
        raise SplitError(f"data.dataset='digits' has 1x8x8 images but the model takes {shape}; use "
                         "model.preset = \"digits\", a config made for 1-channel 8x8 images, or data.dataset = \"synthetic\"")
    if config.data.dataset == "moving_digits" and (len(shape) != 4 or shape[0] != 1 or shape[2:] != (8, 8)):
        raise SplitError(f"data.dataset='moving_digits' has clips of 1x8x8 frames but the model takes {shape}; use a "
                         "video family made for them (model.architecture = \"wan\", model.preset = \"digits\")")
    multiple = backbone.family.latent_multiple(backbone.model.config)
    if config.data.dataset != "folder" and (shape[-2] % multiple or shape[-1] % multiple):
        raise SplitError(f"the {config.model.architecture} model takes latents whose sides are multiples of {multiple} "
                         f"(its patch size), but the data is {shape[-2]}x{shape[-1]}")
    if config.data.dataset == "folder":
        _check_folder_data(config, backbone)
    repeated_blocks(backbone, config.pipeline.compile)  # "blocks" needs some
    _check_device(config)
    memory = resolve_memory(config, backbone)
    changes = memory.changes(config.memory)
    if changes:  # settings left to the planner ("auto"): the stages are planned with them as chosen
        config = config.model_copy(update={"memory": config.memory.model_copy(update=changes)})
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"memory settings chosen by the planner (\"auto\"): {memory.words()} (planner/levers.py: the "
                  "first, in order of how little they change, with which the plan fits; where none fits, the most "
                  "saving)", flush=True)
    split, checkpointing = resolve_stages(config, backbone)
    _check_first_stage_trains(backbone, split)
    return Checked(backbone, split, checkpointing, changes)


def _check_device(config: RunConfig) -> None:
    """The device the processes will use exists, and the schedule runs on its backend with this torch."""
    local = int(os.environ["LOCAL_WORLD_SIZE"]) if under_torchrun() else config.world_size
    try:
        device_kind = resolve_device_kind(config.train.device, local)
    except RuntimeError as exc:  # cuda asked for where none is visible, or too few GPUs
        raise ConfigError(str(exc)) from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.train.device == "auto" and device_kind == "cpu" and gpus and int(os.environ.get("RANK", "0")) == 0:
        print(f"train.device = \"auto\": {local} processes on this machine but {gpus} GPU(s), and NCCL needs one GPU "
              f"per process: training on the CPU (gloo). For the GPU, use at most {gpus} processes (pipeline.stages x "
              "pipeline.data_parallel)", flush=True)
    if config.pipeline.stages < 2:
        return
    problem = schedule_problem(config.pipeline.schedule, schedule_named(config.pipeline.schedule).placement,
                               device_kind)
    if problem is not None:
        raise ConfigError(problem)


def _check_first_stage_trains(backbone: Backbone, split: list[int]) -> None:
    """A first stage without trainable parameters (LoRA on modules it lacks) makes outputs that need no gradient,
    and the pipeline's backward through it fails deep inside torch: refused here, naming the fix."""
    first = backbone.units[:split[0]] if split else backbone.units
    if not any(p.requires_grad for unit in first for p in unit.module.parameters()):
        names = f"{first[0].name}..{first[-1].name}"
        raise SplitError(f"stage 0 (units {names}) holds no trainable parameter (no module of adapter.target_modules "
                         "is in it), so nothing before it needs a gradient; put more units into stage 0 "
                         f"(pipeline.split = [{split[0] + 1 if split else 1}, ...]) or add its modules to "
                         "adapter.target_modules (e.g. \"conv1\", \"conv2\")")


def _check_folder_data(config: RunConfig, backbone: Backbone) -> None:
    """Image folders need a pipeline folder whose VAE and text encoders fit the UNet, and folders that exist."""
    from .data.images import data_folders
    from .models.pipeline_folder import is_pipeline_folder
    from .models.vae import vae_frame_factor, vae_latent_channels, vae_scale_factor

    if not is_pipeline_folder(config.model.path):
        raise CheckpointError("data.dataset = 'folder' needs model.path to be a diffusers pipeline folder (with "
                              "model_index.json, unet/, vae/ and text encoders), whose VAE turns the images into latents")
    folder = Path(config.model.path)
    for key, eval_split in (("data.path", False), ("data.eval_path", True)):
        for path, _ in data_folders(config.data, eval_split):
            if not path.is_dir():
                raise FileNotFoundError(f"{key}: {path} is not a folder")
    family, cfg = backbone.family, backbone.model.config
    channels = vae_latent_channels(folder)
    if channels != family.latent_channels(cfg):
        raise CheckpointError(f"{folder}: the VAE makes {channels}-channel latents but the "
                              f"{family.backbone_name} takes {family.latent_channels(cfg)}; the folder mixes components "
                              "of different models")
    frame_factor = vae_frame_factor(folder)
    if family.latent_frames(cfg) is not None:
        wrong = [f for f in config.data.frame_buckets if (f - 1) % frame_factor]
        if wrong:
            raise CheckpointError(f"data.frame_buckets = {config.data.frame_buckets}: {folder.name}'s VAE makes a latent "
                                  f"frame of the first frame and of every {frame_factor} after it, so a clip needs "
                                  f"1 + {frame_factor}k frames; {wrong} are not (e.g. {1 + 8 * frame_factor})")
    elif frame_factor > 1:
        raise CheckpointError(f"{folder}: its VAE encodes video clips but the {family.backbone_name} is an image "
                              "model; the folder mixes components of different models")
    factor = vae_scale_factor(folder)
    multiple = family.latent_multiple(cfg)
    if (config.data.bucket_step // factor) % multiple or config.data.bucket_step % factor:
        raise CheckpointError(f"data.bucket_step = {config.data.bucket_step}: the {family.backbone_name} needs latents whose "
                              f"sides are multiples of {multiple} ({multiple * factor} pixels through this VAE); "
                              f"use a multiple of {multiple * factor}")
    given, wanted = family.folder_text_widths(folder), family.text_widths(cfg)
    if given != wanted:
        raise CheckpointError(f"{folder}: the text encoders give {given[0]}-wide states and {given[1]}-wide pooled "
                              f"embeddings but the {family.backbone_name} takes {wanted[0]} and {wanted[1]}; the folder "
                              "mixes components of different models")
