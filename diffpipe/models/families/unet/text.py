"""The text encoders of an SD (one CLIP) or SDXL (two CLIPs) pipeline folder, encoding as diffusers' own pipelines
do: SD 1.x/2.x attend to the last hidden states of one CLIP text model; SDXL to the penultimate hidden states of
both, concatenated, with the second's pooled projection as the pooled text embedding (tested against
`encode_prompt` of both pipelines).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from ...folder import component_weights, fingerprint_files, has_component, load_tokenizer
from ...text import CaptionEncoder

__all__ = ["PipelineText"]


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
            if suffix and not has_component(folder, f"text_encoder{suffix}"):
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
