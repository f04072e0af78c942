"""LTX-2's frozen text encoding (LTX2Pipeline's `encode_prompt` then its `connectors`): Gemma 3 reads the caption
(stripped, left-padded to 1,024 tokens, the tokenizer's special tokens added), the hidden states of all its layers and
of its embedding are stacked, and the pipeline's text connectors (`connectors/`, frozen here as in the pipeline: they
are not the transformer's) turn them into the video stream's and the audio stream's caption states. Both are cached
side by side, the video's first; what the connectors' mask says is not kept: with learned registers (the release's
128) it is all ones, and a connectors config without them is refused.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ....errors import CheckpointError
from ...folder import component_weights, fingerprint_files
from ...folder_text import FolderText, load_text_encoder

__all__ = ["LTX2Text", "LTX2_TEXT_TOKENS", "connector_widths"]

LTX2_TEXT_TOKENS = 1024  # LTX2Pipeline's max_sequence_length


def connector_widths(config: dict) -> tuple[int, int]:
    """(video, audio) widths of the caption states a connectors config makes."""
    return (config["video_connector_num_attention_heads"] * config["video_connector_attention_head_dim"],
            config["audio_connector_num_attention_heads"] * config["audio_connector_attention_head_dim"])


def _connectors(folder: Path):
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    component_weights(folder, "connectors")  # refuses pickles before from_pretrained could read one
    connectors = LTX2TextConnectors.from_pretrained(folder, subfolder="connectors", use_safetensors=True,
                                                    local_files_only=True)
    cfg = connectors.config
    if cfg.video_connector_num_learnable_registers is None or cfg.audio_connector_num_learnable_registers is None:
        raise CheckpointError(f"model.path={folder}: its text connectors have no learned registers, so their caption "
                              "states come with a mask of padding, which diffpipe does not feed LTX-2 yet (the "
                              "releases' connectors have 128 registers)")
    return connectors.eval().requires_grad_(False)


class LTX2Text(FolderText):
    suffixes = ("",)
    max_length = LTX2_TEXT_TOKENS

    def __init__(self, tokenizers, models, folder=None):
        super().__init__(tokenizers, models, folder)
        tokenizer = self.tokenizers[0]
        tokenizer.padding_side = "left"  # as the pipeline sets it: Gemma's chat-style padding
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

    @classmethod
    def from_folder(cls, folder: Path) -> "LTX2Text":
        from transformers import Gemma3ForConditionalGeneration

        tokenizer, model = load_text_encoder(folder, "1", Gemma3ForConditionalGeneration)
        return cls([tokenizer], [model, _connectors(folder)], folder)

    def fingerprint(self) -> str:
        return fingerprint_files(component_weights(self.folder, "connectors"), extra=super().fingerprint())

    @property
    def hidden_size(self) -> int:
        return sum(connector_widths(self.models[1].config))

    @property
    def pooled_size(self) -> int:
        return 0

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        gemma, connectors = self.models
        tokens = self.tokenizers[0]([c.strip() for c in captions], padding="max_length", max_length=self.max_length,
                                    truncation=True, add_special_tokens=True, return_tensors="pt").to(self.device)
        states = gemma(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                       output_hidden_states=True).hidden_states
        stacked = torch.stack(states, dim=-1).flatten(2, 3)  # (B, L, D * (layers + 1)), as the pipeline packs them
        video, audio, _ = connectors(stacked, tokens.attention_mask, padding_side="left")
        return torch.cat((video, audio), dim=-1), torch.zeros(len(captions), 0, device=self.device)
