"""Where a run's training data comes from: one `DataSource` per `data.dataset`, as model families are for
`model.architecture`. A new source is one class (here, or in its own module) and one line in `SOURCES`; the
config's allowed names, its checks before launch, the training data, the held-out data, the sample grid and the
cache command all ask the source, never the name.

Imports here stay light (the config reads `SOURCES`): each source imports its data modules when asked.
"""
from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING, Callable, ClassVar

from ..errors import DataError

if TYPE_CHECKING:
    import torch

    from ..config import DataConfig, RunConfig
    from ..models.text import CaptionEncoder
    from ..models.units import Backbone

__all__ = ["DataSource", "SOURCES", "source_of"]


class DataSource:
    """The defaults: data made in memory at the model's sample shape, captions from the data or sample.prompts."""

    name: ClassVar[str]
    fixed_shape: ClassVar[bool] = True  # every item has the sample shape (folders: buckets of about its area)
    samples: ClassVar[bool] = True  # a grid of samples at the end means something (random latents: nothing)
    words: ClassVar[tuple[str, ...]] = ()  # words the tiny text encoder must know beyond its own
    held_out_split: ClassVar[bool] = False  # data never trained on, for the eval loss

    def check_data(self, data: DataConfig) -> None:
        """Refuse [data] settings this source cannot serve (ValueError, read by the config's validation)."""
        if data.mask_path:
            raise ValueError(f"data.mask_path masks pictures of data.dataset = 'folder', and data.dataset is "
                             f"{self.name!r}: unset data.mask_path")
        if data.regularisation_path:
            raise ValueError(f"data.regularisation_path adds images to data.dataset = 'folder', and data.dataset is "
                             f"{self.name!r}: unset data.regularisation_path")
        if data.control_path:
            raise ValueError(f"data.control_path pairs control images with the pictures of data.dataset = 'folder', "
                             f"and data.dataset is {self.name!r}: unset data.control_path")

    def check_config(self, config: RunConfig) -> None:
        """Refuse other settings this source cannot serve, such as an eval loss without held-out data."""
        if config.sample.control_images:
            raise ValueError(f"sample.control_images are encoded by a pipeline folder's VAE, for an edit model on "
                             f"data.dataset = 'folder', and data.dataset is {self.name!r}: unset sample.control_images")
        if config.train.eval_every and not self.held_out_split:
            raise ValueError(f"train.eval_every needs held-out data, and data.dataset = {self.name!r} has none: "
                             "use digits, or folder with data.eval_fraction or data.eval_path; or set "
                             "train.eval_every = 0")

    def check(self, config: RunConfig, backbone: Backbone, shape: tuple[int, ...]) -> None:
        """Refuse, before any process starts, a model this data cannot feed (`shape`: its latents' sample shape)."""

    def has_controls(self, config: RunConfig, family) -> bool:
        """Whether this data gives each item a control image (an edit model's): what steps feed and plans count."""
        return False

    def grid_first_frames(self, config: RunConfig) -> list[Path] | None:
        """Files whose first frames an image-to-video model's sample grid continues, one per column (else None: each
        column from nothing)."""
        return None

    def latent_size(self, config: RunConfig) -> tuple[int, int] | None:
        """(height, width) of the latents this data has, where the data decides it (else None)."""
        return None

    def latent_frames(self, config: RunConfig) -> int | None:
        """Latent frames of this data's longest clips, where the data decides it (else None)."""
        return None

    def build(self, config: RunConfig, backbone: Backbone, shape: tuple[int, ...], text: CaptionEncoder,
              device: torch.device, rank: int, world: int, barrier: Callable[[], None]):
        from . import make_dataset

        data = make_dataset(self.name, shape, config.train.seed, self.has_controls(config, backbone.family))
        text.keep(data.captions + [""], config.data.text_cache_gib)  # "": captions dropped for guidance
        return data

    def held_out(self, config: RunConfig, data):
        """The eval loss's data (train.eval_every > 0; only asked where `held_out_split`)."""
        return data.held_out

    def grid_prompts(self, config: RunConfig, data_captions: Callable[[], list[str]]) -> list[str]:
        return config.sample.prompts or list(dict.fromkeys(data_captions()))[:4] or [""]

    def cached(self, config: RunConfig) -> bool:
        """Whether `diffpipe cache` has anything to compute ahead of training."""
        return False


class DigitsSource(DataSource):
    name = "digits"
    held_out_split = True  # every fourth digit

    def check(self, config, backbone, shape):
        if shape != (1, 8, 8):
            raise DataError(f"data.dataset='digits' has 1x8x8 images but the model takes {shape}; use "
                             "model.preset = \"digits\", a config made for 1-channel 8x8 images, or "
                             "data.dataset = \"synthetic\"")

    def held_out(self, config, data):
        from .batches import TensorImages
        from .digits import DigitsDataset

        held = DigitsDataset(split="held_out")  # the digits never trained on
        return TensorImages(held.images, held.captions)

    def grid_prompts(self, config, data_captions):
        from .digits import DIGIT_WORDS, digit_caption

        return [digit_caption(d) for d in range(len(DIGIT_WORDS))]


class MovingDigitsSource(DataSource):
    name = "moving_digits"

    @property
    def words(self) -> tuple[str, ...]:
        from .moving_digits import MOTION_WORDS

        return MOTION_WORDS

    def check(self, config, backbone, shape):
        if len(shape) != 4 or shape[0] != 1 or shape[2:] != (8, 8):
            raise DataError(f"data.dataset='moving_digits' has clips of 1x8x8 frames but the model takes {shape}; "
                             "use a video family made for them (model.architecture = \"wan\", model.preset = "
                             "\"digits\")")

    def has_controls(self, config, family):
        return family.reads_first_frame  # each clip's first frame, then zeros (no VAE: the pixels are the latents)

    def grid_prompts(self, config, data_captions):
        from .moving_digits import moving_prompts

        return moving_prompts()


class SyntheticSource(DataSource):
    name = "synthetic"
    samples = False

    def has_controls(self, config, family):
        # random control latents beside the random latents: what an edit or image-to-video model reads
        return family.reads_control or family.reads_first_frame


class FolderSource(DataSource):
    """Images or videos with captions in folders, through the VAE of model.path's pipeline folder."""

    name = "folder"
    fixed_shape = False
    held_out_split = True  # data.eval_fraction or data.eval_path (checked below)

    def check_data(self, data):
        if not data.path:
            raise ValueError("data.dataset = 'folder' needs data.path: a folder of images with captions (or a list)")
        paths = [data.path] if isinstance(data.path, str) else data.path
        if isinstance(data.repeats, list) and len(data.repeats) != len(paths):
            raise ValueError(f"data.repeats lists {len(data.repeats)} numbers for {len(paths)} folders in "
                             "data.path; give one per folder, or a single number")
        if any(f < 1 for f in data.frame_buckets):
            raise ValueError(f"data.frame_buckets={data.frame_buckets}: each must be 1 frame or more")
        repeats = data.repeats if isinstance(data.repeats, list) else [data.repeats]
        if any(r < 1 for r in repeats):
            raise ValueError(f"data.repeats={data.repeats}: each must be 1 or more")
        if data.mask_path and not Path(data.mask_path).is_dir():
            raise ValueError(f"data.mask_path: {data.mask_path} is not a folder (of masks named as the pictures)")
        if data.control_path and not Path(data.control_path).is_dir():
            raise ValueError(f"data.control_path: {data.control_path} is not a folder (of control images named as "
                             "the pictures)")
        if data.bucket_sizes is not None and (not data.bucket_sizes or any(
                len(b) != 2 or min(b) < 8 for b in data.bucket_sizes)):
            raise ValueError(f"data.bucket_sizes={data.bucket_sizes}: give [width, height] pairs of 8 pixels or "
                             "more")

    def check_config(self, config):
        if config.train.eval_every and not (config.data.eval_fraction or config.data.eval_path):
            raise ValueError("train.eval_every needs held-out images: set data.eval_fraction (e.g. 0.1) or "
                             "data.eval_path, or train.eval_every = 0")

    def check(self, config, backbone, shape):
        """Image folders need a pipeline folder whose VAE and text encoders fit the UNet, and folders that exist."""
        from ..models.loading import CheckpointError
        from ..models.vae import latent_frames, trains_images, vae_frame_factor, vae_latent_channels, vae_scale_factor
        from .images import data_folders, regularisation_folders

        folder = config.model.pipeline_folder()
        if folder is None:
            raise CheckpointError("data.dataset = 'folder' needs a diffusers pipeline folder (with model_index.json, "
                                  "vae/ and text encoders) whose VAE turns the images into latents: model.path, or "
                                  "model.components beside a single backbone file")
        for key, eval_split in (("data.path", False), ("data.eval_path", True)):
            for path, _ in data_folders(config.data, eval_split):
                if not path.is_dir():
                    raise FileNotFoundError(f"{key}: {path} is not a folder")
        for path, _ in regularisation_folders(config.data):
            if not path.is_dir():
                raise FileNotFoundError(f"data.regularisation_path: {path} is not a folder")
        family, cfg = backbone.family, backbone.model.config
        _check_usable_files(config.data, videos=family.latent_frames(cfg) is not None)
        channels = vae_latent_channels(folder)
        if channels != family.latent_channels(cfg):
            raise CheckpointError(f"{folder}: the VAE makes {channels}-channel latents but the "
                                  f"{family.backbone_name} takes {family.latent_channels(cfg)}; the folder mixes "
                                  "components of different models")
        frame_factor = vae_frame_factor(folder)
        if family.latent_frames(cfg) is not None:
            wrong = [f for f in config.data.frame_buckets if (f - 1) % frame_factor]
            if wrong:
                raise CheckpointError(f"data.frame_buckets = {config.data.frame_buckets}: {folder.name}'s VAE makes "
                                      f"a latent frame of the first frame and of every {frame_factor} after it, so a "
                                      f"clip needs 1 + {frame_factor}k frames; {wrong} are not (e.g. "
                                      f"{1 + 8 * frame_factor})")
            given = [f for f in config.data.frame_buckets if latent_frames(f, frame_factor) == 1]
            if given and family.gives_first_latent_frame(cfg):
                raise DataError(f"data.frame_buckets = {config.data.frame_buckets}: this {family.backbone_name} is "
                                "given each clip's first latent frame clean and predicts only the frames after it "
                                f"(TI2V-5B's image-to-video), so a clip of {given[0]} frame(s), one latent frame, has "
                                f"nothing to train; leave {given} out (still images are then skipped)")
        elif not trains_images(folder):
            raise CheckpointError(f"{folder}: its VAE encodes video clips but the {family.backbone_name} is an image "
                                  "model; the folder mixes components of different models")
        if config.sample.control_images and not (family.reads_control or family.reads_first_frame):
            raise DataError(f"sample.control_images are images to edit, and the {family.backbone_name} of "
                             f"model.architecture = {config.model.architecture!r} edits none; unset "
                             "sample.control_images")
        for image in config.sample.control_images:
            if not Path(image).is_file():
                raise FileNotFoundError(f"sample.control_images: {image} is not a file")
        if config.data.control_path and not family.reads_control:
            raise DataError(f"data.control_path gives each picture a control image, and the {family.backbone_name} "
                             f"of model.architecture = {config.model.architecture!r} reads none; train an edit model "
                             "(flux_kontext, qwen_image_edit), or unset data.control_path")
        if config.data.mask_path and family.latent_frames(cfg) is not None:
            raise ValueError(f"data.mask_path masks pictures, and the {family.backbone_name} trains on clips: unset "
                             "data.mask_path")
        factor = vae_scale_factor(folder)
        multiple = family.latent_multiple(cfg)
        if (config.data.bucket_step // factor) % multiple or config.data.bucket_step % factor:
            raise CheckpointError(f"data.bucket_step = {config.data.bucket_step}: the {family.backbone_name} needs "
                                  f"latents whose sides are multiples of {multiple} ({multiple * factor} pixels "
                                  f"through this VAE); use a multiple of {multiple * factor}")
        given, wanted = family.folder_text_widths(folder), family.text_widths(cfg)
        if given != wanted:
            raise CheckpointError(f"{folder}: the text encoders give {given[0]}-wide states and {given[1]}-wide "
                                  f"pooled embeddings but the {family.backbone_name} takes {wanted[0]} and "
                                  f"{wanted[1]}; the folder mixes components of different models")

    def has_controls(self, config, family):
        return bool(config.data.control_path) or family.reads_first_frame

    def grid_prompts(self, config, data_captions):
        if config.data.control_path and not config.sample.prompts:  # an edit model: the first pictures, each edited
            from .controls import first_edits

            return [caption for caption, _ in first_edits(config.data)]
        from ..models.registry import family_for

        if not config.sample.prompts and family_for(config.model.architecture).reads_first_frame:
            from .controls import GRID_EDITS
            from .first_frames import first_clips

            return [caption for caption, _ in first_clips(config.data, GRID_EDITS)]  # each clip continued
        return super().grid_prompts(config, data_captions)

    def grid_first_frames(self, config):
        """The first clips of data.path (their captions head the columns without sample.prompts), repeated to give
        each of sample.prompts one."""
        from .controls import GRID_EDITS
        from .first_frames import first_clips

        count = len(config.sample.prompts) or GRID_EDITS
        clips = [path for _, path in first_clips(config.data, count)]
        return clips if not config.sample.prompts else [clips[i % len(clips)] for i in range(count)]

    def latent_size(self, config):
        from ..models.vae import vae_scale_factor

        folder = config.model.pipeline_folder()
        if folder is None:
            return None
        return (config.data.resolution // vae_scale_factor(folder),) * 2

    def latent_frames(self, config):
        from ..models.vae import latent_frames, vae_frame_factor

        folder = config.model.pipeline_folder()
        if folder is None:
            return None
        return latent_frames(max(config.data.frame_buckets), vae_frame_factor(folder))

    def build(self, config, backbone, shape, text, device, rank, world, barrier):
        from ..models.loading import CheckpointError
        from .preparation import prepare_folder_images

        folder = config.model.pipeline_folder()
        if folder is None:
            raise CheckpointError("data.dataset = 'folder' needs a diffusers pipeline folder (with model_index.json "
                                  "and vae/) whose VAE turns the images into latents: model.path or model.components")
        vae = backbone.family.folder_vae(folder).to(device)
        video = backbone.family.latent_frames(backbone.model.config) is not None
        return prepare_folder_images(config.data, folder, vae, text, rank, world, barrier,
                                     frame_buckets=sorted(set(config.data.frame_buckets)) if video else None,
                                     first_frames=backbone.family.reads_first_frame)

    def cached(self, config):
        return config.data.cache


SOURCES: dict[str, DataSource] = {source.name: source for source in (
    DigitsSource(), MovingDigitsSource(), SyntheticSource(), FolderSource())}


def source_of(config: RunConfig) -> DataSource:
    return SOURCES[config.data.dataset]


def _check_usable_files(data, videos: bool) -> None:
    """data.path holds a file to train on (read up to the first usable one: headers only): an empty or unusable
    folder is named before any model loads or the run folder is written, not after the text encoders ran."""
    from .folder import IMAGE_SUFFIXES, Skipped, scan_folders
    from .images import data_buckets, data_folders, smallest_side

    skipped = Skipped(kind="image or video" if videos else "image")
    if scan_folders(data_folders(data), smallest_side(data_buckets(data)), skipped, videos, first=1):
        return
    what = "images or videos" if videos else f"images ({', '.join(IMAGE_SUFFIXES)})"
    folders = ", ".join(str(f) for f, _ in data_folders(data))
    why = f"; {skipped.warning().removeprefix('warning: ')}" if skipped.files else ""
    raise DataError(f"data.path: no usable {what} in {folders}{why}")
