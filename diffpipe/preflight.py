"""Everything that can fail on the user's input, checked cheaply on the meta device before any process starts:
architecture, checkpoint file, resolution, dataset shape, and the stage split (planned when "auto")."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .build import build_backbone, sample_shape, text_length, weights_of_each
from .config import ConfigError, RunConfig
from .data.sources import source_of
from .distributed import resolve_device_kind, under_torchrun
from .errors import DataError
from .errors import CheckpointError
from .models.folder import component_weights
from .models.folder import is_pipeline_folder, pipeline_index
from .models.units import Backbone
from .pipeline.block_swap import holds_frozen
from .pipeline.schedules import schedule_named
from .pipeline.exchange import heads_padded
from .pipeline.sequence import sample_tokens, sequence_problem
from .pipeline.split import SplitError
from .pipeline.stage import repeated_blocks
from .planner.plan import resolve_memory, resolve_stages
from .planner.partition import Recomputed
from .precision import fp8_compute_on, frozen_storage
from .torch_support import fp8_matmul_problem, schedule_problem

__all__ = ["Checked", "check_before_launch"]


@dataclass
class Checked:
    """The model on the meta device, the resolved stage starts, how many of each stage's last units run checkpointed,
    the [memory] settings the planner chose ("auto"), by key, train.fp8_compute resolved, and the kind of device the
    processes train on."""

    backbone: Backbone
    split: list[int]
    recomputed: Recomputed
    memory: dict = field(default_factory=dict)
    fp8_compute: bool = False
    device_kind: str = "cpu"


def check_before_launch(config: RunConfig) -> Checked:
    backbone = build_backbone(config, device="meta")
    weights_of_each(backbone.model, config, backbone.family)  # converts an original-layout file once
    if config.model.text_encoder != "tiny-clip" and not (Path(config.model.text_encoder) / "config.json").is_file():
        raise CheckpointError(f"model.text_encoder={config.model.text_encoder}: no config.json there; give a local "
                              "transformers CLIP folder or \"tiny-clip\"")
    _check_frozen_components(config)
    shape = sample_shape(config, backbone)  # UNets: any size (the upsamplers return to each skip's size)
    _check_sequence_split(config, backbone, shape)
    source = source_of(config)
    source.check(config, backbone, shape)
    multiple = backbone.family.latent_multiple(backbone.model.config)
    if source.fixed_shape and (shape[-2] % multiple or shape[-1] % multiple):  # folders: their buckets' steps
        raise DataError(f"the {config.model.architecture} model takes latents whose sides are multiples of {multiple} "
                        f"(its patch size), but the data is {shape[-2]}x{shape[-1]}")
    repeated_blocks(backbone, config.pipeline.compile)  # "blocks" needs some
    if config.train.fp8_attention and not backbone.family.fp8_attention_processors:
        raise ConfigError(f"train.fp8_attention runs Wan's self-attention in fp8 (its processor: "
                          f"models/families/wan/attention.py); {config.model.architecture}'s attention has no fp8 "
                          "processor yet: set train.fp8_attention = false")
    device_kind = _check_device(config)
    fp8_compute = fp8_compute_on(config, device_kind)
    if config.train.fp8_compute == "auto":  # the stages are planned with it as resolved
        config = config.model_copy(update={"train": config.train.model_copy(update={"fp8_compute": fp8_compute})})
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train.fp8_compute = \"auto\": {'on' if fp8_compute else 'off'} (on where blocks are compiled on a "
                  "GPU with fp8 tensor cores, for a LoRA, LoHa or LoKr in bf16 over an fp8 or \"auto\" base)", flush=True)
    memory = resolve_memory(config, backbone)
    changes = memory.changes(config.memory)
    if changes:  # settings left to the planner ("auto"): the stages are planned with them as chosen
        config = config.model_copy(update={"memory": config.memory.model_copy(update=changes)})
        if int(os.environ.get("RANK", "0")) == 0:
            held = frozen_storage(config, device_kind).name
            print(f"memory settings chosen by the planner (\"auto\"): {memory.words(held)} (the first, in order "
                  "of how little they change the model, with which the plan fits: block swap, then 8-bit moments, then "
                  "a quantised base where memory.quantise_if_needed lists one; where none fits, the most saving)", flush=True)
    split, recomputed = resolve_stages(config, backbone)
    if config.pipeline.checkpointing == "auto" and int(os.environ.get("RANK", "0")) == 0:
        print(checkpointing_words(recomputed, [0, *split, len(backbone.units)]), flush=True)
    _check_first_stage_trains(backbone, split)
    _check_block_swap(config.memory.block_swap, backbone, split)
    return Checked(backbone, split, recomputed, changes, fp8_compute, device_kind)


def checkpointing_words(recomputed: Recomputed, bounds: list[int]) -> str:
    """What pipeline.checkpointing = "auto" chose, stage by stage: none, all, or the last N of its units."""
    def stage(i: int, count: int) -> str:
        units = bounds[i + 1] - bounds[i]
        which = "none" if not count else "all" if count == units else f"its last {count} of {units} units"
        return f"stage {i} {which}"

    return ("pipeline.checkpointing = \"auto\": recomputed in backward: "
            + ", ".join(stage(i, count) for i, count in enumerate(recomputed))
            + " (the fewest, counted from each stage's end, with which it fits the memory)")


def _check_sequence_split(config: RunConfig, backbone: Backbone, shape: tuple[int, ...]) -> None:
    """pipeline.sequence_parallel: the family splits its tokens and the sample's divide by it (or are padded); heads
    it does not divide are padded, which a compiled block cannot run."""
    tokens = sample_tokens(backbone, shape, text_length(config))
    problem = sequence_problem(backbone, config.pipeline.sequence_parallel, tokens)
    if problem is not None:
        raise ConfigError(problem)
    degree, heads = config.pipeline.sequence_parallel, getattr(backbone.model.config, "num_attention_heads", None)
    padded = heads_padded(heads, degree) if degree > 1 else None
    if padded is not None and config.pipeline.compile:
        divisors = ", ".join(str(d) for d in range(2, heads + 1) if heads % d == 0)
        raise ConfigError(f"pipeline.sequence_parallel = {degree} does not divide the model's {heads} heads, so its "
                          f"attention pads them to {padded} in an exchange a compiled block cannot run: set "
                          f"pipeline.compile = false, or a degree that divides {heads} ({divisors})")


def _check_frozen_components(config: RunConfig) -> None:
    """The text encoders, image encoder and VAE the processes will load hold .safetensors weights: a pickle-only or
    empty one is refused here (models/folder.py component_weights' words), as the backbone's weights are, not in a process."""
    if config.model.text_encoder != "tiny-clip":
        folder = Path(config.model.text_encoder)
        component_weights(folder.parent, folder.name)
    folder = config.model.pipeline_folder()
    if folder is None or not is_pipeline_folder(folder):
        return
    for component, entry in pipeline_index(folder).items():
        frozen = component.startswith("text_encoder") or component in ("image_encoder", "vae")
        if frozen and isinstance(entry, list) and entry[0] is not None and (folder / component).is_dir():
            component_weights(folder, component)


def _check_device(config: RunConfig) -> str:
    """The device the processes will use exists, and the schedule runs on its backend with this torch; its kind."""
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
    if config.train.fp8_compute is True:  # a GPU's kind here (no CUDA context in the launcher); its product where it trains
        problem = fp8_matmul_problem(torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu"),
                                     try_product=device_kind == "cpu")
        if problem is not None:
            raise ConfigError(problem)
    if config.pipeline.stages < 2:
        return device_kind
    problem = schedule_problem(config.pipeline.schedule, schedule_named(config.pipeline.schedule).placement,
                               device_kind)
    if problem is not None:
        raise ConfigError(problem)
    return device_kind


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


def _check_block_swap(block_swap, backbone: Backbone, split: list[int]) -> None:
    """memory.block_swap above the units of every stage that hold frozen weights would change nothing past them:
    refused, naming the most there are (a setting that cannot apply is never silently ignored)."""
    if not isinstance(block_swap, int) or block_swap == 0:
        return
    edges = [0, *split, len(backbone.units)]
    holding = max(sum(holds_frozen(backbone.units[a:b])) for a, b in zip(edges, edges[1:]))
    if block_swap > holding:
        raise ConfigError(f"memory.block_swap = {block_swap} units of each stage, but no stage has more than "
                          f"{holding} unit(s) holding frozen weights (the only ones it swaps): set memory.block_swap "
                          f"= {holding} (all of them), fewer, or \"auto\"")
