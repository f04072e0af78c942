"""From a config to the objects a run needs: backbone, text encoder, example inputs. Shared by train,
sample, plan and the checks before launch."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from .config import ConfigError, RunConfig
from .diffusion.timesteps import DYNAMIC_SHIFT
from .data.sources import source_of
from .models.family import Feed, ModelFamily
from .models.fp8_training import train_in_fp8
from .models.lora import add_lora, base_module_name, is_adapter_holder, load_adapters, seed_lora
from .models.loading import CheckpointError, build_model, checked_weights
from .models.folder import dynamic_shift, expert_boundary
from .models.materialise import is_meta, materialise
from .models.storage import FrozenStorage
from .models.two_experts import TwoExperts, each_expert
from .models.registry import ArchitectureError, family_for
from .models.text import CaptionEncoder, TextEncoder
from .models.units import Backbone, full_parameter_names
from .pipeline.split import StageSpec, stage_specs
from .pipeline.stage import StageModule, build_stage_modules
from .precision import AUTOCAST_DTYPES, fp8_compute_on, frozen_storage
from .models.fp8_attention import attend_in_fp8, fp8_attention_problem
from .torch_support import fp8_matmul_problem
from .pipeline.traffic import Crossing, boundary_crossings, trace_tensors

__all__ = ["build_backbone", "give_weights", "build_stages", "choose_attention", "build_text_encoder", "sample_shape", "example_inputs",
           "boundary_traffic", "text_length", "build_dataset", "model_family", "feed", "timestep_range",
           "shift_schedule", "weights_of_each"]

def build_backbone(config: RunConfig, device: str | torch.device = "cpu") -> Backbone:
    """The backbone with all its weights on `device`; on "meta", none yet (see `give_weights`), and with
    adapter.type set its adapters too, which get weights with the rest. Built with weights (sampling, benches)
    it is the plain model: a LoRA run's model.safetensors has the adapters merged in."""
    family = model_family(config)
    model = build_model(config.model, family)
    if config.adapter.type != "none" and str(device) == "meta":  # before the units take their modules: peft
        try:  # replaces a targeted module in its parent, and a unit holding the old one would never use its adapter
            unreached = [prefix + name for prefix, expert in each_expert(model) for name in family.unreached(expert)]
            add_lora(model, config.adapter, family.lora_targets, config.train.seed, unreached)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        backbone = family.backbone(model, config.model.units)
    except ValueError as exc:  # options the adapter cannot train yet
        raise CheckpointError(str(exc)) from None
    if str(device) != "meta":
        give_weights(backbone, config, device=device)
    return backbone


def give_weights(backbone: Backbone, config: RunConfig, units: list[int] | None = None,
                 device: str | torch.device = "cpu", frozen: FrozenStorage | None = None) -> None:
    """Weights (model.path's, else seeded random) for the given units of a meta backbone, all when None; the
    other units stay on the meta device. The same unit gets the same weights whatever else is built. LoRA layers
    already injected get their seeded initial adapters. `frozen`: how frozen weights are held (precision.py)."""
    modules = None if units is None else _modules_holding(backbone, units)
    adapters = config.adapter.type != "none"

    def reset_own(module: torch.nn.Module) -> bool:  # an adapter's tensors are drawn by seed_lora, below
        return (adapters and is_adapter_holder(module)) or backbone.family.reset_own_parameters(module)

    family = backbone.family
    for model, weights in weights_of_each(backbone.model, config, family):
        buffers = {prefix + name: value for prefix, expert in each_expert(model)
                   for name, value in family.constructor_buffers(expert).items()}
        materialise(model, config.train.seed, weights, modules, device, rename=base_module_name, buffers=buffers,
                    reset_own=reset_own, frozen=frozen)
    if adapters:
        seed_lora(backbone.model, config.train.seed)
        if config.adapter.init_from:
            try:
                load_adapters(backbone.model, config.adapter.init_from)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    backbone.parameter_names = full_parameter_names(backbone.model)  # buffers given values are new objects


def weights_of_each(model: torch.nn.Module, config: RunConfig, family) -> list[tuple[torch.nn.Module, Path | None]]:
    """(model, its checked weights file) to materialise: the model and model.path's weights; both experts of a
    pipeline folder each with its own subfolder's (a run folder's model.safetensors holds both under their
    subfolders' names, as the model names them)."""
    folder = config.model.pipeline_folder()
    if not isinstance(model, TwoExperts) or config.model.path is None or Path(config.model.path) != folder:
        return [(model, checked_weights(model, config.model, family))]
    return [(expert, checked_weights(expert, config.model.model_copy(update={"expert": expert_name}), family))
            for (_, expert), expert_name in zip(each_expert(model), ("high", "low"))]


def build_stages(config: RunConfig, backbone: Backbone, specs: list[StageSpec], mine: list[int],
                 device: torch.device, recomputed: list[int]) -> list[StageModule]:
    """The stages `mine` of a meta backbone ready to train on `device`, as the trainer and the planner's probe run
    them: weights for their units only (the others stay on the meta device, costing nothing), frozen ones stored as
    memory.base_dtype says module by module (the host never holds a bf16 base whole in fp32), memory.block_swap
    units in host memory, the last `recomputed[i]` units of stage i checkpointed (none where the list is short), dropout
    off unless train.dropout."""
    choose_attention(backbone, device)
    problem = fp8_matmul_problem(device) if fp8_compute_on(config, device.type) else None
    problem = problem or (fp8_attention_problem(device) if config.train.fp8_attention else None)
    if problem is not None:  # tried on the device itself, before any weight is read
        raise ConfigError(problem)
    give_weights(backbone, config, [u for i in mine for u in range(specs[i].first, specs[i].last)],
                 frozen=replace(frozen_storage(config, device.type), quantise_on=device))
    every = build_stage_modules(backbone, specs, AUTOCAST_DTYPES[config.train.precision],
                                compiled=config.pipeline.compile, recomputed=recomputed)
    modules = [every[i].to_device(device, config.memory.block_swap).train() for i in mine]
    if config.adapter.type == "none" and fp8_compute_on(config, device.type):  # a full fine-tune's, torchao's
        for module in modules:
            train_in_fp8(module, device.type)
    if config.train.fp8_attention:
        for module in modules:
            attend_in_fp8(module, backbone.family.fp8_attention_processors, device)
    if not config.train.dropout:
        for dropout in (m for module in modules for m in module.modules() if isinstance(m, torch.nn.Dropout)):
            dropout.eval()
    return modules


def choose_attention(backbone: Backbone, device: torch.device) -> None:
    """Turn cuDNN's attention kernels off in this process where the family's backward fails in them on CUDA
    (models/family.py `cudnn_attention`: Flux's failed with an illegal memory access on an H200, torch 2.11); torch
    then takes its flash or memory-efficient kernels. Called wherever units train on a device."""
    if device.type == "cuda" and not backbone.family.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)


def _modules_holding(backbone: Backbone, units: list[int]) -> set[int]:
    """The model's modules owning a weight the units use: a unit may hold a parameter of a module it does not wrap
    whole (Wan's output unit, the model's own `scale_shift_table`)."""
    used = {id(t) for i in units for t in (*backbone.units[i].module.parameters(), *backbone.units[i].module.buffers())}
    return {id(m) for m in backbone.model.modules()
            if any(id(t) in used for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))}


def model_family(config: RunConfig) -> ModelFamily:
    """The family of model.architecture (models/registry.py)."""
    try:
        return family_for(config.model.architecture)
    except ArchitectureError as exc:
        raise ConfigError(str(exc)) from None


def feed(config: RunConfig, backbone: Backbone) -> Feed:
    """How this run's backbone is fed (its family's conditions and latent layout)."""
    return Feed.of(backbone, config.model.guidance)


def timestep_range(config: RunConfig) -> tuple[float, float] | None:
    """The timesteps the run trains on (and evaluates at the quantiles of): train.timestep_range, else model.expert's
    side of its pipeline's boundary (high: [boundary, 1], low: [0, boundary]), else None (all: both experts too)."""
    if config.train.timestep_range is not None:
        return tuple(config.train.timestep_range)
    if config.model.expert in (None, "both"):
        return None
    boundary = expert_boundary(config.model.pipeline_folder())
    return (boundary, 1.0) if config.model.expert == "high" else (0.0, boundary)


def shift_schedule(config: RunConfig) -> tuple[int, int, float, float]:
    """train.shift = "resolution"'s line (base tokens, max tokens, base shift, max shift): model.path's scheduler's
    when it shifts by resolution (Flux's, Qwen-Image's), else Flux.1's."""
    folder = config.model.pipeline_folder()
    return (dynamic_shift(folder) if folder is not None else None) or DYNAMIC_SHIFT


def sample_shape(config: RunConfig, backbone: Backbone) -> tuple[int, ...]:
    """(channels, height, width) of the latents the backbone denoises (before any packing), (channels, frames, height,
    width) for a video family: for image folders, the latents of a data.resolution square (every bucket has about
    its area) and of the longest frame bucket, else data.latent_size or the family's default size."""
    family, cfg, source = backbone.family, backbone.model.config, source_of(config)
    size = source.latent_size(config)
    if size is None:
        size = tuple(config.data.latent_size or (family.default_latent_size(cfg),) * 2)
    frames = family.latent_frames(cfg)
    if frames is not None:
        frames = family.sample_frames(cfg, source.latent_frames(config) or config.data.frames or frames, size)
    return (family.latent_channels(cfg),) + ((frames,) if frames is not None else ()) + size


def text_length(config: RunConfig) -> int:
    """Tokens per caption: a pipeline folder's tokenizer decides, else model.text_max_length."""
    folder = config.model.pipeline_folder()
    if folder is not None:
        return model_family(config).folder_text_length(folder)
    return config.model.text_max_length


def build_text_encoder(config: RunConfig, backbone: Backbone) -> CaptionEncoder:
    """A pipeline folder's own text encoders, else model.text_encoder (tiny-clip or a CLIP folder); where the family
    cuts a batch's text to its captions (`reads_text_lengths`), keeping and caching each caption's states only up to
    its last filled position."""
    text = _text_encoder(config, backbone)
    text.trims_padding = backbone.family.reads_text_lengths
    return text


def _text_encoder(config: RunConfig, backbone: Backbone) -> CaptionEncoder:
    folder = config.model.pipeline_folder()
    if folder is not None:
        return backbone.family.folder_text_encoder(folder)
    if config.model.text_encoder == "tiny-clip":
        hidden, pooled = backbone.family.text_widths(backbone.model.config)
        return TextEncoder.tiny(hidden, max(pooled, 1), config.model.text_max_length, config.train.seed + 1,
                                source_of(config).words)
    return TextEncoder.from_folder(config.model.text_encoder, config.model.text_max_length)


def example_inputs(config: RunConfig, backbone: Backbone, batch: int) -> tuple[dict, dict]:
    """Zero-filled inputs and conditions of the shapes a step feeds the backbone (for tracing and costing)."""
    hidden, pooled = backbone.family.text_widths(backbone.model.config)
    shape = sample_shape(config, backbone)
    fed = feed(config, backbone)
    control = torch.zeros(batch, *shape) if source_of(config).has_controls(config, backbone.family) else None
    length = backbone.family.example_text_length(backbone.model.config, text_length(config), shape[1:],
                                                 control is not None, config.model.pipeline_folder())
    conditions = fed.conditions(torch.zeros(batch, length, hidden), torch.zeros(batch, pooled),
                                torch.zeros(batch, 6), shape[1:], control=control)
    conditions["timestep"] = torch.zeros(batch)
    return {"sample": fed.pack(torch.zeros(batch, *shape))}, conditions


def boundary_traffic(config: RunConfig, backbone: Backbone, split: list[int]) -> list[Crossing]:
    """Bytes each boundary sends per micro-batch, from tensors traced on the meta device in their training dtypes
    (under train.precision's autocast as CUDA gives them, as the planner counts them)."""
    meta = backbone if is_meta(backbone.model) else build_backbone(config, "meta")
    inputs, conditions = example_inputs(config, meta, config.micro_batch_size)
    tensors = trace_tensors(meta, inputs, conditions, AUTOCAST_DTYPES[config.train.precision])
    return boundary_crossings(stage_specs(meta, split), tensors)


def build_dataset(config: RunConfig, backbone: Backbone, text: CaptionEncoder, device: torch.device, rank: int = 0,
                  world: int = 1, barrier=lambda: None):
    """The training data of data.dataset's source (data/sources.py): image folders go through the pipeline folder's
    VAE (latents and text outputs cached, each process computing its share of what is missing; `barrier` waits for
    all)."""
    return source_of(config).build(config, backbone, sample_shape(config, backbone), text, device, rank, world,
                                   barrier)
