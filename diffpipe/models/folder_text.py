"""Text encoders read from a diffusers pipeline folder's text_encoder*/ and tokenizer*/ subfolders, shared by the
families whose pipelines hold them: the loading (safetensors only), the fingerprint a text cache is keyed by, and a
T5 encoder alone. Each family's own encoders, encoding as its pipeline's `encode_prompt` does, are in its package
(families/flux/text.py, families/sd3/text.py, families/wan/text.py, families/qwen_image/text.py,
families/hunyuan_video15/text.py, families/unet/text.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError
from .folder import component_weights, fingerprint_files, load_tokenizer
from .text import CaptionEncoder

__all__ = ["FolderText", "OneT5", "load_text_encoder", "token_ids", "CLIP_TOKENS"]

CLIP_TOKENS = 77


def load_text_encoder(folder: Path, index: str, model_class) -> tuple:
    suffix = "" if index == "1" else f"_{index}"
    if not (folder / f"text_encoder{suffix}").is_dir():
        raise CheckpointError(f"model.path={folder}: the pipeline folder has no text_encoder{suffix}/ subfolder")
    component_weights(folder, f"text_encoder{suffix}")  # refuses pickles before from_pretrained could read one
    tokenizer = load_tokenizer(folder, f"tokenizer{suffix}")
    model = model_class.from_pretrained(folder, subfolder=f"text_encoder{suffix}", use_safetensors=True,
                                        local_files_only=True)
    return tokenizer, model.eval().requires_grad_(False)


def token_ids(tokenizer, captions: list[str], length: int, device) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                     return_tensors="pt").input_ids.to(device)


class FolderText(CaptionEncoder):
    """Text encoders loaded from a pipeline folder's text_encoder*/ and tokenizer*/ subfolders."""

    suffixes: tuple[str, ...]

    def __init__(self, tokenizers: list, models: list[torch.nn.Module], folder: Path | None = None):
        super().__init__()
        self.tokenizers, self.models, self.folder = tokenizers, models, folder

    def fingerprint(self) -> str:
        """Of the weights and tokenizers: a text cache keyed by it is invalid once any of them changes."""
        files = [f for s in self.suffixes for f in component_weights(self.folder, f"text_encoder{s}")]
        files += [f for s in self.suffixes for f in sorted((self.folder / f"tokenizer{s}").iterdir()) if f.is_file()]
        return fingerprint_files(files, extra=type(self).__name__)

    def modules(self) -> list[torch.nn.Module]:
        return self.models


class OneT5(FolderText):
    """A T5 encoder alone (text_encoder/, tokenizer/): its states, no pooled text."""

    suffixes = ("",)
    model_class: type

    @classmethod
    def from_folder(cls, folder: Path) -> "OneT5":
        tokenizer, model = load_text_encoder(folder, "1", cls.model_class)
        return cls([tokenizer], [model], folder)

    @property
    def hidden_size(self) -> int:
        return self.models[0].config.d_model

    @property
    def pooled_size(self) -> int:
        return 0
