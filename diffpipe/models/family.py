"""The adapter protocol: what diffpipe needs to know about one family of backbones (UNet, Flux, SD3, ...).

A family says how to build its diffusers model on the meta device, how to describe it as units (units.py), what
it is fed (the latent layout and the named conditions, from the frozen text encoders' outputs), and how diffusers'
own forward is called (the reference every pipelined run is tested against). Nothing else in diffpipe knows which
family it trains: `build.py`, `data/`, `preflight.py`, `sampling.py` and the planner ask the family.

Add a family with one module defining a `ModelFamily` subclass and one line in registry.py, or, without touching
diffpipe, by naming it in the config: `model.architecture = "my_package.my_module:MyFamily"`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, NamedTuple

import torch
from torch import nn

from .units import Backbone

__all__ = ["ModelFamily", "TextBatch", "Feed", "FusedRows", "ReleaseLayout", "unprefixed"]

# what ComfyUI puts before a backbone's names in the checkpoints it saves; the families' own releases have none
_SAVED_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def unprefixed(key: str) -> str:
    """A weight's name without ComfyUI's saved-checkpoint prefix."""
    for prefix in _SAVED_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


@dataclass(frozen=True)
class ReleaseLayout:
    """How a family's own releases name its backbone's weights in one file (the SGM UNet layout, BFL's Flux, ...):
    whether a file's names are that layout, and the conversions to and from diffusers' names, for the model of a
    config. Single-file loading reads it (models/single_file.py's cache), `export --format original` writes it."""

    name: str
    recognises: Callable[[list[str]], bool]
    to_diffusers: Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]]
    from_diffusers: Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]]


class FusedRows(NamedTuple):
    """Where a LoRA of one diffusers layer goes in a release whose one layer fuses several (BFL's `qkv`): the fused
    layer's `name`, the layer's `part` of its rows (0 first), of `parts` equal parts."""

    name: str
    part: int
    parts: int


@dataclass
class TextBatch:
    """What the frozen encoders and the data give a batch, before the family names it for its backbone.

    hidden: (B, L, D) text hidden states; pooled: (B, P) pooled text embedding (P may be 0), or what a text encoder
    that reads pictures makes of each caption's picture (Wan 2.1 I2V: its CLIP states, flattened); size_ids: (B, 6)
    SDXL's (original h, w, crop top, left, target h, w); latent_size: (h, w) of the latents ((frames, h, w) for
    clips); guidance: the
    embedded guidance value of guidance-distilled models (Flux-dev); filled: each caption's positions up to its last
    filled one (a state not all zero), known on the host, or None (a family needing them reads them off `hidden`);
    control: (B, C, h, w) latents of each sample's control image (data.control_path) for a family that
    `reads_control`, or (B, C, F, h, w) of each clip's first frame for one that `reads_first_frame`, or None (no
    control image: the family is fed none).
    """

    hidden: torch.Tensor
    pooled: torch.Tensor
    size_ids: torch.Tensor
    latent_size: tuple[int, ...]
    guidance: float
    filled: list[int] | None = None
    control: torch.Tensor | None = None


class ModelFamily:
    """One family of backbones. Methods take the diffusers model's config (`model.config`), never its weights,
    except `describe` and `diffusers_forward`."""

    name: ClassVar[str]
    model_class: ClassVar[type[nn.Module]]
    component: ClassVar[str]  # the pipeline folder's subfolder holding the backbone: "unet", "transformer"
    backbone_name: ClassVar[str] = "transformer"  # what messages call it
    presets: ClassVar[dict[str, dict]] = {}  # built-in configs (keyword arguments of model_class), random weights
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    default_objective: ClassVar[str] = "flow_matching"  # when neither train.objective nor a scheduler decides
    cudnn_attention: ClassVar[bool] = True  # False: cuDNN's attention kernels fail on this family's shapes (CUDA)
    # train.fp8_attention: the family's attention processor classes whose self-attention can run in fp8 -> the
    # subclass that runs it so (models/fp8_attention.py); empty: the family is refused it
    fp8_attention_processors: ClassVar[dict[type, type]] = {}
    comfyui_lora_alpha: ClassVar[bool] = True  # False: --format comfyui writes no `.alpha` (the scale is in lora_up)
    reads_text_lengths: ClassVar[bool] = False  # True: `conditions` reads TextBatch.filled (the batch maker gives it)
    reads_control: ClassVar[bool] = False  # True: an edit model; `conditions` reads TextBatch.control (data.control_path)
    # True: image-to-video; `conditions` reads TextBatch.control, each clip's first frame encoded (data/first_frames.py)
    reads_first_frame: ClassVar[bool] = False
    # pipeline.sequence_parallel (pipeline/sequence.py): the token streams that split over a sample's processes, each
    # with the dimension its tokens lie along, or (dimension, the streams whose tokens it joins) (written unsplit by
    # one unit, then read and written as shares); empty: the family cannot split, for the reason in
    # `sequence_refusal`. `sequence_text_stream`: the text's stream, whose length must divide too where it splits
    sequence_streams: ClassVar[dict] = {}
    sequence_conditions: ClassVar[dict[str, int]] = {}  # conditions laid out along the tokens (tables, masks): dim
    sequence_refusal: ClassVar[str] = ""
    sequence_text_stream: ClassVar[str] = "context"
    # True: picture tokens the degree does not divide are padded (its attentions take a key mask: pipeline/sequence.py)
    sequence_pads: ClassVar[bool] = False
    pipelines: ClassVar[tuple[str, ...]] = ()  # diffusers pipelines whose folders it trains, where a backbone class
    # serves several families (FluxPipeline: flux, FluxKontextPipeline: flux_kontext): model_index.json's _class_name

    def split_token_counts(self, cfg: Any, shape: tuple[int, ...]) -> dict[str, int]:
        """What must divide by pipeline.sequence_parallel for latents `shape` (channels first): the picture's tokens
        in the backbone's output layout."""
        return {"picture tokens": self.pack_prediction(cfg, torch.empty((1, *shape), device="meta")).shape[1]}

    def sequence_refusal_for(self, model: nn.Module) -> str | None:
        """Why `model` cannot split a sample's tokens over processes (pipeline.sequence_parallel), in a clause; None
        where it can."""
        from .two_experts import TwoExperts

        if not self.sequence_streams:
            return self.sequence_refusal or "its adapter does not name its token streams yet"
        if isinstance(model, TwoExperts):
            return "the two experts' units route samples by timestep, which the token shares do not follow yet"
        return None

    def backbone(self, model: nn.Module, granularity: str) -> Backbone:
        """`model` checked (`check_supported`), what it never trains frozen (`unreached`), and described as units,
        with this family attached."""
        from .two_experts import TwoExperts, each_expert, two_expert_backbone

        for _, expert in each_expert(model):  # (both experts of a TwoExperts: models/two_experts.py)
            self.check_supported(expert)
            for name in self.unreached(expert):
                expert.get_submodule(name).requires_grad_(False)
        if isinstance(model, TwoExperts):
            backbone = two_expert_backbone(self, model, granularity)
        else:
            backbone = self.describe(model, granularity)
        backbone.family = self
        return backbone

    def check_supported(self, model: nn.Module) -> None:
        """Raise ValueError naming a config option the adapter cannot train yet."""

    def unreached(self, model: nn.Module) -> list[str]:
        """Modules whose outputs reach no prediction (their parameters never get a gradient, as in Qwen-Image's last
        block's text side): frozen in every run and given no adapter, as a plain loop's optimizer leaves them; data
        parallel would otherwise wait for their gradients."""
        return []

    def describe(self, model: nn.Module, granularity: str) -> Backbone:
        """The model as units in forward order, sharing its modules (and weights)."""
        raise NotImplementedError

    def latent_channels(self, cfg: Any) -> int:
        """Channels of the latents the VAE must make (before any packing)."""
        raise NotImplementedError

    def default_latent_size(self, cfg: Any) -> int:
        """Side of the square latent trained on when no pipeline folder's VAE decides (digits, synthetic data)."""
        raise NotImplementedError

    def latent_multiple(self, cfg: Any) -> int:
        """Latent sides must be multiples of this (the patch size of a transformer)."""
        return 1

    def text_widths(self, cfg: Any) -> tuple[int, int]:
        """(hidden, pooled) widths the backbone expects from the text encoders."""
        raise NotImplementedError

    def conditions(self, cfg: Any, text: TextBatch) -> dict[str, torch.Tensor]:
        """The named conditions every stage gets, less the timestep (the batch maker adds it)."""
        raise NotImplementedError

    def clean_latents(self, cfg: Any, conditions: dict[str, torch.Tensor],
                      latent_size: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Latents the backbone is given clean, not noised, and does not predict (TI2V-5B's fixed first frame): a 0/1
        mask and their values, both broadcasting over latents (B, C, *latent_size). Their targets are zero (the
        backbone predicts zero there, so they add nothing to the loss) and a sample ends with their values. None:
        every latent is noised and predicted."""
        return None

    def gives_first_latent_frame(self, cfg: Any) -> bool:
        """Whether every clip's first latent frame is given clean and not predicted (`clean_latents`): a clip of one
        latent frame then has nothing to train."""
        return False

    def trains_folder(self, index: dict) -> bool:
        """Whether this family, set as model.architecture, trains a pipeline folder whose backbone class is its own,
        from the folder's model_index.json. Unset, the family whose `pipelines` name the folder's class is used."""
        return index.get("_class_name") in self.pipelines

    def pack(self, cfg: Any, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, H, W) in the layout the backbone reads (Flux: 2x2 patches as tokens)."""
        return latents

    def pack_prediction(self, cfg: Any, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, H, W) in the layout the backbone predicts in (the training target's): a transformer's last
        unit leaves its tokens unpatchified, so no later stage needs the image's height and width."""
        return self.pack(cfg, latents)

    def unpack_prediction(self, cfg: Any, prediction: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
        """The inverse of `pack_prediction`: a prediction as latents (B, C, H, W)."""
        return prediction

    def diffusers_forward(self, model: nn.Module, sample: torch.Tensor,
                          conditions: dict[str, torch.Tensor]) -> torch.Tensor:
        """The diffusers model's own forward on what the first stage is fed, as the pipeline's output is laid out
        (`pack_prediction`): the reference of the correctness tests."""
        raise NotImplementedError

    def folder_text_encoder(self, folder: Path):
        """The frozen text encoders of a local diffusers pipeline folder, as a CaptionEncoder."""
        raise NotImplementedError(f"{self.name}: loading text encoders from a pipeline folder is not supported yet")

    def folder_text_widths(self, folder: Path) -> tuple[int, int]:
        """(hidden, pooled) widths the folder's text encoders make, read from their configs (no weights loaded)."""
        raise NotImplementedError

    def folder_text_length(self, folder: Path) -> int:
        """Length of the hidden-state sequence the folder's text encoders make per caption."""
        from .folder import caption_tokens

        return caption_tokens(folder)

    def example_text_length(self, cfg: Any, length: int, latent_size: tuple[int, ...], control: bool,
                            folder: Path | None) -> int:
        """Text positions a step of items of `latent_size` (with a control picture each, where `control`) feeds,
        for plans to trace: `length`, the text encoders' per caption, unless the text reads the control too (as
        the pipeline folder `folder`, if any, reads it)."""
        return length

    def objective_of_folder(self, folder: Path) -> str:
        """The objective a pipeline folder's scheduler was trained with."""
        return self.default_objective

    def latent_frames(self, cfg: Any) -> int | None:
        """Latent frames of a clip trained on without a VAE deciding (video families); None: images."""
        return None

    def folder_vae(self, folder: Path):
        """The frozen VAE a pipeline folder's latents are made with (models/vae.py `load_vae`), or the family's own
        codec of the folder's autoencoders (LTX-2's video and audio VAEs)."""
        from .vae import load_vae

        return load_vae(folder)

    def sample_frames(self, cfg: Any, frames: int, latent_size: tuple[int, int]) -> int:
        """Latent frames of a sample whose clip has `frames` latent frames of `latent_size`: the same, unless the
        family lays more than the video in a sample (LTX-2: its audio's tokens in frames after the video's)."""
        return frames

    def diffusers_lora_pipeline(self, cfg: Any):
        """The diffusers pipeline class whose `save_lora_weights` writes this family's LoRA files (export
        --format diffusers), or None where none is known."""
        return None

    release_layout: ClassVar[ReleaseLayout | None] = None  # the family's own single-file layout, where known

    def comfyui_lora_names(self, cfg: Any, modules: list[str]) -> dict[str, str | FusedRows] | None:
        """Module path -> the name ComfyUI's LoRA loader maps onto that module (comfy/lora.py,
        `model_lora_keys_unet`), before `.lora_down.weight`, or `FusedRows` where ComfyUI's layer fuses several of
        diffusers' (their LoRAs are written as one); None where ComfyUI loads no LoRA of this family (export
        --format comfyui). Raise ValueError naming a module it would leave unloaded."""
        return None

    def reset_own_parameters(self, module: nn.Module) -> bool:
        """Draw the random weights of a module without `reset_parameters` (in place, from the seeded generator the
        caller set); False when this family does not know the module."""
        return False

    def constructor_buffers(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Buffers only the constructor can fill (a fixed positional table), by full name, for a meta-built model
        whose weights file does not hold them."""
        return {}


@dataclass(frozen=True)
class Feed:
    """How one built model is fed: its family and config, bound (what the batch maker and the sampler hold)."""

    family: ModelFamily
    cfg: Any
    guidance: float = 1.0

    @classmethod
    def of(cls, backbone: Backbone, guidance: float = 1.0) -> "Feed":
        return cls(backbone.family, backbone.model.config, guidance)

    def conditions(self, hidden: torch.Tensor, pooled: torch.Tensor, size_ids: torch.Tensor,
                   latent_size: tuple[int, int], filled: list[int] | None = None,
                   control: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if control is not None:
            control = control.to(hidden.device)
        return self.family.conditions(self.cfg, TextBatch(hidden, pooled, size_ids.to(hidden.device),
                                                          tuple(latent_size), self.guidance, filled, control))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.family.pack(self.cfg, latents)

    def pack_prediction(self, latents: torch.Tensor) -> torch.Tensor:
        return self.family.pack_prediction(self.cfg, latents)

    def clean_latents(self, conditions: dict[str, torch.Tensor],
                      latent_size: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.family.clean_latents(self.cfg, conditions, tuple(latent_size))

    def unpack_prediction(self, prediction: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
        return self.family.unpack_prediction(self.cfg, prediction, latent_size)
