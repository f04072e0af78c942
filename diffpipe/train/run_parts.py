"""A run's parts in one process, built from its config: this process's stages and what trains them (optimizer, loss
scale, the pipeline runner, weights tied across stages), and what feeds them (text encoders, data, batches, held-out
data). `Trainer` (train/trainer.py) loops over them; evaluation and checkpoints read them through it.

Every process builds the backbone on the meta device and gives weights only to the units of its own stages (each
module seeded alike whatever the stage count: models/materialise.py), then moves them to its device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..build import (boundary_traffic, build_backbone, build_dataset, build_stages, build_text_encoder, feed,
                     sample_shape, shift_schedule, text_length, timestep_range)
from ..config import ConfigError, RunConfig, TrainConfig
from ..data.batches import BatchMaker, CaptionTags, loss_weighting, step_texts
from ..diffusion.objectives import element_weighted_mse, weighted_mse
from ..distributed import Topology
from ..models.family import Feed
from ..models.text import CaptionEncoder
from ..models.tokens import TEXT_LENGTHS
from ..models.two_experts import IdleExpertGradients, TwoExperts
from ..models.units import Backbone
from ..models.vae import vae_scale_factor
from ..pipeline.data_parallel import spread_over_replicas
from ..pipeline.runtime import PipelineRunner
from ..pipeline.schedules import schedule_named
from ..pipeline.sequence import SequenceShards, attend_across_shards, sample_tokens, split_sequence, tokens_problem
from ..pipeline.split import stage_specs
from ..pipeline.stage import StageModule, compiled_shapes_words
from ..pipeline.tied import TiedGradients, tied_parameters
from ..pipeline.traffic import Crossing
from ..planner.plan import resolve_memory, resolve_stages, take_stages
from ..sampling import grid_controls, grid_prompts, show_controls
from .checkpoint import model_shapes
from .evaluation import held_out_data
from .optim import LossScaler, make_optimizer

__all__ = ["RunParts", "build_run", "resolve_layout", "resolve_epochs"]


@dataclass
class RunParts:
    model_config: dict  # the backbone's diffusers config, written beside the weights
    model_shapes: dict[str, tuple[int, ...]]  # every weight's shape: what a checkpoint must match
    modules: list[StageModule]  # this process's stages, on its device
    params: list[torch.nn.Parameter]  # their trained weights, each once
    tied: TiedGradients
    scaler: LossScaler
    runner: PipelineRunner
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    text: CaptionEncoder
    data: Any  # the data source's dataset (data/sources.py)
    feed: Feed
    batches: BatchMaker
    held_out: Any  # held-out data for the eval loss, or None
    sample_shape: tuple[int, ...]
    bytes_moved: int  # sent and received by this process in a step (the observer's communication figures)
    idle_experts: IdleExpertGradients | None = None  # both experts of a two-expert model (models/two_experts.py)


class _ScaledMSE:
    """Mean squared error in fp32, times the current loss scale (1 unless fp16); weighted by what the target carries
    (diffusion/objectives.py): with data.mask_path a weight per element (`with_element_weights`), else with
    train.min_snr_gamma one per sample (`with_weights`)."""

    def __init__(self, scaler: LossScaler, weighting: str):
        self.scaler = scaler
        self.loss = {"elements": element_weighted_mse, "samples": weighted_mse,
                     "none": lambda output, target: F.mse_loss(output.float(), target.float())}[weighting]

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, target) * self.scaler.scale


def resolve_layout(config: RunConfig, backbone: Backbone) -> None:
    """The settings left to the planner ("auto"), chosen in `config` where the launcher did not choose them before
    starting processes: the [memory] settings, then the split and the units checkpointed."""
    p, m = config.pipeline, config.memory
    if not isinstance(p.split, list) or "auto" in (m.block_swap, m.optimizer_state):
        for key, value in resolve_memory(config, backbone).changes(m).items():
            setattr(m, key, value)
    if not isinstance(p.split, list) or p.recomputed_units is None:
        take_stages(p, *resolve_stages(config, backbone))


def resolve_epochs(train: TrainConfig, data, say: bool) -> None:
    """train.epochs: train.max_steps set (in `train`) to that many of the data's epochs, rounded up to a whole step."""
    if train.epochs:
        per_epoch = data.steps_per_epoch(train.batch_size)
        train.max_steps = math.ceil(train.epochs * per_epoch - 1e-9)
        if say:
            print(f"train.epochs = {train.epochs}: {train.max_steps} steps ({per_epoch:g} an epoch of "
                  f"{len(data.captions)} items at batch {train.batch_size})", flush=True)


def build_run(config: RunConfig, topo: Topology) -> RunParts:
    """This process's parts of the run (rank 0 prints what the data and the text encoders came to)."""
    p = config.pipeline
    backbone = build_backbone(config, "meta")
    shapes, model_config = model_shapes(backbone.model), dict(backbone.model.config)
    resolve_layout(config, backbone)
    shards = _sequence_shards(topo, backbone)
    if shards is not None:  # each unit computes on this process's share of every sample's tokens
        backbone = split_sequence(backbone, backbone.family.sequence_streams, shards,
                                  backbone.family.sequence_conditions)
    specs = stage_specs(backbone, p.split)
    schedule = schedule_named(p.schedule)
    mine = schedule.stage_indices(topo.pp_rank, p.stages, p.virtual_stages)
    text, data, held_out = _text_and_data(config, backbone, topo)  # first: the text encoders leave before the stages come
    _check_shares_of_buckets(config, backbone, data)
    if p.compile and topo.is_main:  # recompiles bounded, and said: a graph per bucket shape
        text_lengths = len(TEXT_LENGTHS) if backbone.family.reads_text_lengths else 1
        print(compiled_shapes_words(p.compile, len(data.groups()) if hasattr(data, "groups") else 1, text_lengths),
              flush=True)
    modules = build_stages(config, backbone, specs, mine, topo.device, p.recomputed_units)
    if shards is not None:
        attend_across_shards(backbone, topo.sp_mesh, topo.device, shards)
    tied = tied_parameters(backbone, specs)  # by the backbone's parameter objects, which wrapping replaces:
    spread_over_replicas(modules, topo, p.data_parallel_shard)  # before anything keeps the parameters
    lr_scale = config.train.stage_lr_scale or [1.0] * len(specs)
    seen: set[int] = set()  # a weight tied between two stages of this process is one parameter, trained once
    groups = [([q for q in m.parameters() if q.requires_grad and not (id(q) in seen or seen.add(id(q)))],
               lr_scale[i]) for m, i in zip(modules, mine)]
    held = {name: q for m in modules for name, q in m.full_named_parameters()}
    tied_gradients = TiedGradients(tied, held, mine, topo, p.data_parallel_shard)
    scaler = LossScaler(config.train.precision == "fp16")
    weighting = loss_weighting(config.train, config.data)  # what the batches' targets carry, for the loss to read
    runner = PipelineRunner(modules, mine, len(specs), topo.pp_group, topo.device, p.schedule, p.microbatches,
                            _ScaledMSE(scaler, weighting=weighting), timeable=config.observe.enabled,
                            send_group=topo.send_group, sequence=shards)
    optimizer, lr_schedule = make_optimizer(groups, config.train, config.memory.optimizer_state,
                                            reduce_group=topo.pp_group,
                                            not_counted=frozenset(tied_gradients.not_counted_here))
    family_feed = feed(config, backbone)
    moved = _bytes_moved(boundary_traffic(config, backbone, p.split), mine, len(specs), p.microbatches,
                         lambda s: schedule.rank_of(s, p.stages))
    idle = IdleExpertGradients(backbone.model, held.items()) if isinstance(backbone.model, TwoExperts) else None
    return RunParts(model_config, shapes, modules, [q for params, _ in groups for q in params],
                    tied_gradients, scaler, runner, optimizer,
                    lr_schedule, text, data, family_feed,
                    BatchMaker(data, text, config.train, config.data.caption_dropout, family_feed,
                               caption_tags(config.data), weighting,
                               timestep_range(config), shift_schedule(config)), held_out,
                    sample_shape(config, backbone), moved, idle)


def _sequence_shards(topo: Topology, backbone: Backbone) -> SequenceShards | None:
    """This process's share of every sample's tokens (pipeline.sequence_parallel); None when it holds them all."""
    if topo.sp_size == 1:
        return None
    return SequenceShards(topo.sp_size, topo.sp_rank, topo.sp_mesh["ulysses"].get_group(),
                          pads=backbone.family.sequence_pads)


def _check_shares_of_buckets(config: RunConfig, backbone: Backbone, data) -> None:
    """With pipeline.sequence_parallel, every bucket's tokens divide into a sample's shares (or are padded, where the
    family pads them): refused before the first step, naming the bucket (data of one shape was checked before
    launch)."""
    degree = config.pipeline.sequence_parallel
    if degree == 1 or not hasattr(data, "groups"):
        return
    for group in data.groups():
        shape = tuple(data.x0(group[:1]).shape[1:])
        problem = tokens_problem(backbone, degree, sample_tokens(backbone, shape, text_length(config)))
        if problem is not None:
            bucket = data.placements[group[0]].name if hasattr(data, "placements") else "x".join(map(str, shape))
            raise ConfigError(f"the bucket {bucket} ({len(group)} items): {problem}; or set data.resolution, "
                              "data.bucket_step or data.frame_buckets so that no bucket has such a count")


def caption_tags(data) -> CaptionTags:
    return CaptionTags(data.caption_shuffle, data.tag_dropout, data.keep_tokens)


def _text_and_data(config: RunConfig, backbone, topo: Topology):
    """The text encoders and the data (latents and captions cached, each process its share), then every caption the
    run will ask for encoded (cached or kept) and the text encoders moved to host memory: built before the stages,
    so a card never holds the text encoders (Flux's T5-XXL and CLIP: 19 GB in fp32) beside the stages' weights."""
    text = build_text_encoder(config, backbone).to(topo.device)
    data = build_dataset(config, backbone, text, topo.device, topo.rank, topo.world_size, dist.barrier)
    resolve_epochs(config.train, data, topo.is_main)  # the learning-rate schedule reads max_steps as it goes
    held_out = held_out_data(config, data)
    grid = _grid_texts(config, text, data, backbone)
    text.keep(grid, config.data.text_cache_gib)
    asked = [*step_texts(text, data), *(step_texts(text, held_out) if held_out is not None else []), *grid]
    if not caption_tags(config.data).changes and text.park(asked) and topo.is_main:  # changed: encoded as they come
        print("text encoders moved to host memory: every caption is encoded already", flush=True)
    summary = data.summary(held_out)
    if topo.is_main and summary:
        print(summary, flush=True)
    return text, data, held_out


def _grid_texts(config: RunConfig, text, data, backbone) -> list[str]:
    """The texts the sample grid asks for: its prompts, and where the text encoder reads pictures each prompt (and
    "", unguided) with its column's control picture at the sample size."""
    prompts = grid_prompts(config, lambda: data.captions)
    controls = grid_controls(config)
    if not (text.reads_pictures and controls and getattr(data, "vae", None) is not None):
        return prompts
    factor = vae_scale_factor(data.vae)
    pictures = show_controls(text, controls, tuple(s * factor for s in sample_shape(config, backbone)[-2:]))
    return text.texts(prompts, pictures) + text.texts([""] * len(prompts), pictures)


def _bytes_moved(crossings: list[Crossing], mine: list[int], stages: int, microbatches: int, rank_of) -> int:
    """Bytes this rank sends and receives in a step: activations forward, their gradients back (none between two
    stages of this process: V-shaped schedules put neighbouring stages on one)."""
    per_boundary = {c.after_stage: c.bytes for c in crossings}
    total = 0
    for s in mine:
        if s > 0 and rank_of(s - 1) != rank_of(s):
            total += per_boundary.get(s - 1, 0)
        if s < stages - 1 and rank_of(s + 1) != rank_of(s):
            total += per_boundary.get(s, 0)
    return 2 * microbatches * total
