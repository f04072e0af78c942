"""Generate images from a run folder through the same stage modules that trained, chained in one process; a run
on a pipeline folder decodes the latents with that folder's VAE into RGB images.

Used by `diffpipe sample RUN_DIR --prompt TEXT --out FILE.png` and for `samples.png` at the end of training (the
grids as files: grids.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from PIL import Image

from .build import build_backbone, build_text_encoder, feed, sample_shape
from .config import RunConfig
from .config_files import load_run_config
from .data.batches import BatchMaker, square_size_ids
from .data.sources import source_of
from .diffusion.samplers import sample
from .diffusion.timesteps import NUM_TRAIN_TIMESTEPS
from .models.family import Feed
from .models.loading import CheckpointError
from .models.registry import family_for
from .models.vae import decode_latents, encode_latents, vae_scale_factor
from .models.text import CaptionEncoder, TextEncoder
from .pipeline.split import stage_specs
from .pipeline.stage import StageModule, build_stage_modules
from .precision import AUTOCAST_DTYPES

__all__ = ["Generator", "load_generator", "finished_run_config", "images_to_pil", "quantise", "run_stages", "grid_prompts", "grid_controls",
           "placed_controls", "show_controls"]


def run_stages(modules: list[StageModule], sample_in: torch.Tensor, conditions: dict[str, torch.Tensor],
               like: torch.Tensor | None = None) -> torch.Tensor:
    """The pipeline's forward in one process: each stage's sends are the next stage's receives."""
    out: tuple = (sample_in,)
    for module in modules:
        result = module(*out, **conditions)
        out = result if isinstance(result, tuple) else (result,)
    return out[0]


# (x, conditions, a tensor shaped as the output) -> the backbone's output, all in the backbone's own layout
Forward = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass
class Generator:
    """Samples through `forward`: the stage modules chained in one process (`load_generator`), or the training
    pipeline itself (Trainer.generate)."""

    config: RunConfig
    forward: Forward
    text: CaptionEncoder
    feed: Feed  # how the backbone is fed: its conditions and latent layout
    shape: tuple[int, int, int]  # of what the backbone denoises (before packing): latents when there is a VAE
    vae: torch.nn.Module | None = None

    @torch.no_grad()
    def generate(self, prompts: list[str], seeds: list[int], steps: int, guidance_scale: float,
                 decode: bool = True, controls: list[Path] | None = None) -> torch.Tensor:
        """One image per (prompt, seed) pair, in [-1, 1], shape (N, C, H, W): RGB pixels decoded by the VAE when the
        run has one (and `decode`), else what the backbone made. An edit model edits `controls` (an image file per
        prompt, placed at the sample size as a picture in its bucket); the unguided half keeps the control."""
        noise = torch.stack([torch.randn(self.shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
        latent_size = self.shape[1:]
        noise = noise.to(self.text.outputs_device)
        maker = BatchMaker(None, self.text, self.config.train, 0.0, self.feed)
        guided = guidance_scale != 1.0
        texts = list(prompts) + ([""] * len(prompts) if guided else [])
        height, width = self.pixel_size
        control = pictures = None
        if controls is not None:
            placed = placed_controls(controls, self.pixel_size)  # each file read and placed once
            control = self.control_latents(placed)
            control = torch.cat([control, control]) if guided else control
            if self.text.reads_pictures:
                pictures = show_controls(self.text, controls, self.pixel_size, placed)
                pictures = pictures + pictures if guided else pictures
        conditions = maker.text_conditions(texts, square_size_ids(len(texts), height, width), latent_size, control,
                                           pictures)

        low, high = self.config.sample.guidance_interval

        def predict(x: torch.Tensor, model_t: torch.Tensor) -> torch.Tensor:
            # every sample of a call is at the same step; read on the host, before the timesteps go to the device
            noise_level = float(model_t[0]) / NUM_TRAIN_TIMESTEPS
            xin = torch.cat([x, x]) if guided else x
            model_t = model_t.to(x.device)
            named = dict(conditions, timestep=torch.cat([model_t, model_t]) if guided else model_t)
            out = self.forward(self.feed.pack(xin), named, self.feed.pack_prediction(xin))
            out = self.feed.unpack_prediction(out, latent_size).float()
            if not guided:
                return out
            cond, uncond = out.chunk(2)
            scale = guidance_scale if low <= noise_level <= high else 1.0  # outside: the prompt alone
            return uncond + scale * (cond - uncond)

        made = sample(predict, noise, steps, self.config.train.objective)
        if (clean := self.feed.clean_latents(conditions, latent_size)) is not None:  # put back, as the pipeline does
            mask, latents = (c[:len(made)].to(made.device) for c in clean)
            made = torch.where(mask > 0, latents.to(made.dtype), made)
        if self.vae is not None and decode:
            return self.decode(made)
        return made.clamp(-1, 1)

    @property
    def pixel_size(self) -> tuple[int, int]:
        """(height, width) of the images made, in pixels."""
        factor = vae_scale_factor(self.vae) if self.vae is not None else 1
        return self.shape[-2] * factor, self.shape[-1] * factor

    def control_latents(self, placed: list[Image.Image]) -> torch.Tensor:
        """Control images placed at the sample size (`placed_controls`), encoded by the VAE; an image-to-video
        model's first frames each followed by grey frames for the clip's length, as the pipeline encodes them."""
        from .data.buckets import pixels_of
        from .data.frames import grey_after
        from .models.vae import vae_frame_factor

        if self.vae is None:
            raise CheckpointError("control images are encoded by a pipeline folder's VAE, and this run has none")
        pixels = torch.stack([pixels_of(picture) for picture in placed])
        if self.feed.family.reads_first_frame:
            factor = vae_frame_factor(self.vae)
            pixels = grey_after(pixels, 1 + (self.shape[1] - 1) * factor)  # shape: (channels, latent frames, ...)
        return encode_latents(self.vae, pixels.to(next(self.vae.parameters()).device)).float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents scaled as in training (models/vae.py) to RGB in [-1, 1]: images, or clips (N, 3, F, H, W)."""
        return decode_latents(self.vae, latents)


def finished_run_config(run_dir: Path):
    """The config of a finished run folder, or an error naming what it lacks (cheap: no model is built)."""
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"{run_dir} is not a finished run folder: config.toml is missing "
                              "(train first with `diffpipe train CONFIG`)")
    config = load_run_config(run_dir)
    needed = ("model.safetensors",) if config.model.pipeline_folder() is not None else ("model.safetensors",
                                                                                       "text_encoder")
    for name in needed:
        if not (run_dir / name).exists():
            raise CheckpointError(f"{run_dir} is not a finished run folder: {name} is missing "
                                  "(train first with `diffpipe train CONFIG`)")
    return config


def load_generator(run_dir: str | Path) -> Generator:
    """The trained backbone of a finished run; the text encoders (and VAE) of the pipeline folder it started from,
    else the text encoder saved in the run folder."""
    run_dir = Path(run_dir)
    config = finished_run_config(run_dir)
    pipeline = config.model.pipeline_folder()
    config.model.path = str(run_dir)  # the run's own weights (model.safetensors, model_config.json), not its start
    expert, components = config.model.expert, config.model.components
    if expert == "both":  # the run holds both experts; the folder says where they switch
        config.model.components = str(pipeline)
    else:  # one of two experts trained: the run holds that one
        config.model.expert = None
    backbone = build_backbone(config)
    config.model.expert, config.model.components = expert, components
    backbone.model.eval()
    split = config.pipeline.split if isinstance(config.pipeline.split, list) else []
    modules = build_stage_modules(backbone, stage_specs(backbone, split), AUTOCAST_DTYPES[config.train.precision])
    forward = partial(run_stages, modules)
    if pipeline is None:
        return Generator(config, forward, TextEncoder.from_folder(run_dir / "text_encoder", config.model.text_max_length),
                         feed(config, backbone), sample_shape(config, backbone))
    config.model.path = str(pipeline)  # back to the folder its text encoders, VAE and sample size come from
    return Generator(config, forward, build_text_encoder(config, backbone), feed(config, backbone),
                     sample_shape(config, backbone), backbone.family.folder_vae(pipeline))


def _grey_levels(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] to the 8-bit levels 0..255 an image file holds (as floats)."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round()


def quantise(images: torch.Tensor) -> torch.Tensor:
    """Images as they read back from an 8-bit PNG, still in [-1, 1]."""
    return _grey_levels(images) / 127.5 - 1


def images_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[-1, 1] tensors (N, C, H, W) with C = 1 or 3 to 8-bit images."""
    if images.shape[1] not in (1, 3):
        raise ValueError(f"cannot write {images.shape[1]}-channel images as PNG (latent models need a VAE)")
    arr = _grey_levels(images).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arr]


def grid_prompts(config: RunConfig, data_captions: Callable[[], list[str]]) -> list[str]:
    """The columns of a grid of samples (at the end of training and during it), as data.dataset's source chooses
    them: every digit, a digit in each motion, else sample.prompts or up to four distinct captions of the data."""
    return source_of(config).grid_prompts(config, data_captions)


def placed_controls(images: list[Path], pixel_size: tuple[int, int]) -> list[Image.Image]:
    """Control images placed at `pixel_size` (height, width): resized to cover it, centre-cropped, as a picture in
    its bucket."""
    from .data.buckets import Bucket, place, placed
    from .data.frames import read_first_frame

    height, width = pixel_size
    return [placed(image, place(*image.size, [Bucket(width, height)]))
            for image in map(read_first_frame, map(Path, images))]


def show_controls(text: CaptionEncoder, images: list[Path], pixel_size: tuple[int, int],
                  placed: list[Image.Image] | None = None) -> list[str]:
    """Keys of the control images placed at `pixel_size` (the file's bytes and the size), each shown to `text`
    under its key (CaptionEncoder.show): what an encoder that reads pictures reads beside a sample's prompt.
    `placed`: the images already placed (`placed_controls`), else they are read and placed here."""
    from .data.images import file_hash

    keys = [f"{file_hash(Path(path))}/{pixel_size[1]}x{pixel_size[0]}" for path in images]
    if text.reads_pictures:
        pictures = placed if placed is not None else placed_controls(images, pixel_size)
        text.show({key: (lambda picture=picture: picture) for key, picture in zip(keys, pictures)})
    return keys


def grid_controls(config: RunConfig) -> list[Path] | None:
    """An edit model's image for each column of the grid: sample.control_images, else with data.control_path and no
    sample.prompts the controls of the pictures whose captions head the columns; None: text alone."""
    if config.sample.control_images:
        return [Path(p) for p in config.sample.control_images]
    if config.data.control_path and not config.sample.prompts:
        from .data.controls import first_edits

        return [control for _, control in first_edits(config.data)]
    if family_for(config.model.architecture).reads_first_frame:  # an image-to-video model: its data's first frames
        return source_of(config).grid_first_frames(config)
    return None
