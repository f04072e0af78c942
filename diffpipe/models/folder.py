"""A local diffusers pipeline folder: model_index.json beside unet/, vae/, text_encoder/, tokenizer/, scheduler/ (and
for SDXL text_encoder_2/, tokenizer_2/), as `save_pretrained` writes it and the Hub serves it.

The UNet is the trained backbone (loading.py reads its unet/ subfolder); the VAE and the text encoders here are
loaded frozen, from safetensors files only; the scheduler's config gives the objective (epsilon or v_prediction)
unless `train.objective` is set. Text encoding follows diffusers' own pipelines: SD 1.x/2.x attend to the last hidden
states of one CLIP text model; SDXL to the penultimate hidden states of both, concatenated, with the second's pooled
projection as the pooled text embedding (tested against `encode_prompt` of both pipelines).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from .loading import CheckpointError, component_weights, load_tokenizer
from .text import CaptionEncoder

__all__ = ["is_pipeline_folder", "pipeline_index", "expert_boundary", "component_weights", "scheduler_objective",
           "PipelineText", "fingerprint_files", "caption_tokens", "text_encoder_configs"]

_INDEX = "model_index.json"


def is_pipeline_folder(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / _INDEX).is_file()


def pipeline_index(folder: Path) -> dict:
    """The folder's model_index.json: the pipeline's class and each component's (library, class)."""
    return json.loads((folder / _INDEX).read_text())


def _has(folder: Path, component: str) -> bool:
    entry = pipeline_index(folder).get(component)
    return isinstance(entry, list) and entry[0] is not None and (folder / component).is_dir()


def expert_boundary(folder: Path) -> float | None:
    """A two-expert pipeline's switch (Wan 2.2: model_index.json's boundary_ratio, with transformer_2/ beside
    transformer/): `transformer` denoises t >= it, `transformer_2` below; None for a one-backbone pipeline."""
    ratio = pipeline_index(folder).get("boundary_ratio")
    return float(ratio) if ratio is not None and _has(folder, "transformer_2") else None


def dynamic_shift(folder: Path) -> tuple[int, int, float, float] | None:
    """(base tokens, max tokens, base shift, max shift) of a folder's flow-matching scheduler that shifts by
    resolution (use_dynamic_shifting: Flux's, Qwen-Image's), the scheduler's defaults filling what it leaves out;
    None for one that does not."""
    path = folder / "scheduler" / "scheduler_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    if not cfg.get("use_dynamic_shifting"):
        return None
    return (cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15))


def scheduler_objective(folder: Path) -> str:
    """The objective the folder's scheduler was trained with: its prediction_type, on the schedule diffpipe uses."""
    path = folder / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise CheckpointError(f"model.path={folder}: no scheduler/scheduler_config.json; set train.objective")
    cfg = json.loads(path.read_text())
    objective = cfg.get("prediction_type", "epsilon")
    if objective not in ("epsilon", "v_prediction"):
        raise CheckpointError(f"{path}: prediction_type {objective!r} is not supported; set train.objective to "
                              "epsilon, v_prediction or flow_matching")
    schedule = (cfg.get("beta_schedule"), cfg.get("beta_start"), cfg.get("beta_end"), cfg.get("num_train_timesteps"))
    if schedule != ("scaled_linear", 0.00085, 0.012, 1000):
        raise CheckpointError(f"{path}: the noise schedule {schedule} (beta_schedule, beta_start, beta_end, "
                              "num_train_timesteps) is not Stable Diffusion's scaled_linear 0.00085..0.012 over 1000 "
                              "steps, the only one diffpipe trains with; set train.objective = \"flow_matching\" to "
                              "train on another path")
    return objective


def text_encoder_configs(folder: Path, names: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
                         ) -> list[dict]:
    """The config.json of each text encoder the folder has, in order."""
    return [json.loads((folder / name / "config.json").read_text()) for name in names
            if (folder / name / "config.json").is_file()]


def caption_tokens(folder: Path) -> int:
    """Tokens per caption of the folder's (first) tokenizer: 77 for CLIP."""
    cfg = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    length = cfg.get("model_max_length", 77)
    return length if length <= 4096 else 77  # transformers writes 1e30 for "no limit"


def fingerprint_files(paths: list[Path], extra: str = "") -> str:
    """sha256 over the files' bytes (streamed) and `extra`: changes when any weight changes."""
    digest = hashlib.sha256(extra.encode())
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


class PipelineText(CaptionEncoder):
    """The text encoders of an SD (one) or SDXL (two) pipeline folder, encoding as diffusers' pipelines do."""

    def __init__(self, tokenizers: list, models: list[torch.nn.Module], folder: Path | None = None):
        super().__init__()
        self.tokenizers = tokenizers
        self.models = [m.eval().requires_grad_(False) for m in models]
        self.folder = folder
        self.max_length = tokenizers[0].model_max_length
        self.penultimate = len(models) > 1  # SDXL attends to the penultimate layer of each

    @classmethod
    def from_folder(cls, folder: Path) -> "PipelineText":
        tokenizers, models = [], []
        for suffix in ("", "_2"):
            if suffix and not _has(folder, f"text_encoder{suffix}"):
                break
            component_weights(folder, f"text_encoder{suffix}")
            tokenizers.append(load_tokenizer(folder, f"tokenizer{suffix}"))
            model_class = CLIPTextModelWithProjection if suffix else CLIPTextModel
            models.append(model_class.from_pretrained(folder, subfolder=f"text_encoder{suffix}", use_safetensors=True,
                                                      local_files_only=True))
        return cls(tokenizers, models, folder)

    def fingerprint(self) -> str:
        """Of the weights and tokenizers: a text cache keyed by it is invalid once any of them changes."""
        if self.folder is None:
            raise ValueError("a PipelineText built from objects has no files to fingerprint")
        suffixes = [""] + (["_2"] if len(self.models) > 1 else [])
        files = [f for s in suffixes for f in component_weights(self.folder, f"text_encoder{s}")]
        files += [f for s in suffixes for f in sorted((self.folder / f"tokenizer{s}").iterdir()) if f.is_file()]
        return fingerprint_files(files, extra=f"penultimate={self.penultimate}")

    def modules(self) -> list[torch.nn.Module]:
        return self.models

    @property
    def hidden_size(self) -> int:
        return sum(m.config.hidden_size for m in self.models)

    @property
    def pooled_size(self) -> int:
        last = self.models[-1]
        return last.config.projection_dim if self.penultimate else 0

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], torch.zeros(len(captions), 0, device=self.device)
        for tokenizer, model in zip(self.tokenizers, self.models):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids.to(self.device)
            out = model(ids, output_hidden_states=self.penultimate)
            hidden.append(out.hidden_states[-2] if self.penultimate else out.last_hidden_state)
        if self.penultimate:  # the second (last) encoder's pooled projection
            pooled = out.text_embeds
        return torch.cat(hidden, dim=-1), pooled
