"""SD3 / SD3.5's frozen text encoders (StableDiffusion3Pipeline.encode_prompt): the penultimate hidden states of two
CLIP models with projection (text_encoder/, text_encoder_2/) concatenated and zero-padded to T5's width, followed
along the sequence by T5's (text_encoder_3/, 256 tokens); the pooled text is both CLIPs' projections concatenated.
Tested equal to the pipeline's `encode_prompt` on a folder its `save_pretrained` wrote.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from ...folder import text_encoder_configs
from ...folder_text import CLIP_TOKENS, FolderText, load_text_encoder, token_ids

__all__ = ["SD3Text", "SD3_T5_TOKENS", "sd3_text_widths"]

SD3_T5_TOKENS = 256  # StableDiffusion3Pipeline's max_sequence_length


class SD3Text(FolderText):
    suffixes = ("", "_2", "_3")
    max_length = CLIP_TOKENS + SD3_T5_TOKENS

    @classmethod
    def from_folder(cls, folder: Path) -> "SD3Text":
        loaded = [load_text_encoder(folder, "1", CLIPTextModelWithProjection), load_text_encoder(folder, "2", CLIPTextModelWithProjection),
                  load_text_encoder(folder, "3", T5EncoderModel)]
        return cls([t for t, _ in loaded], [m for _, m in loaded], folder)

    @property
    def hidden_size(self) -> int:
        return self.models[2].config.d_model

    @property
    def pooled_size(self) -> int:
        return self.models[0].config.projection_dim + self.models[1].config.projection_dim

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], []
        for tokenizer, model in zip(self.tokenizers[:2], self.models[:2]):
            out = model(token_ids(tokenizer, captions, tokenizer.model_max_length, self.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled.append(out[0])
        t5 = self.models[2](token_ids(self.tokenizers[2], captions, SD3_T5_TOKENS, self.device), output_hidden_states=False)[0]
        clip = torch.cat(hidden, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)


def sd3_text_widths(folder: Path) -> tuple[int, int]:
    """(T5's width, both CLIPs' projections) from the folder's configs."""
    clip_l, clip_g, t5 = text_encoder_configs(folder)[:3]
    return t5["d_model"], clip_l["projection_dim"] + clip_g["projection_dim"]
