"""Flux's frozen text encoders (FluxPipeline.encode_prompt): the pooled output of a CLIP text model (text_encoder/)
and the last hidden states of T5 (text_encoder_2/, 512 tokens); Chroma's (ChromaPipeline's `_get_t5_prompt_embeds`):
T5's last hidden states over 512 tokens, T5 reading the caption with its attention mask, zero past the caption's
tokens and its first pad (the positions the pipeline leaves unmasked in the transformer). Tested equal to the
pipelines' own encoding on folders their `save_pretrained` wrote.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPTextModel, T5EncoderModel

from ...folder import text_encoder_configs
from ...folder_text import FolderText, OneT5, load_text_encoder, token_ids

__all__ = ["FluxText", "ChromaText", "FLUX_T5_TOKENS", "CHROMA_T5_TOKENS", "flux_text_widths"]

FLUX_T5_TOKENS = 512  # FluxPipeline's max_sequence_length
CHROMA_T5_TOKENS = 512  # ChromaPipeline's max_sequence_length


class FluxText(FolderText):
    suffixes = ("", "_2")
    max_length = FLUX_T5_TOKENS

    @classmethod
    def from_folder(cls, folder: Path) -> "FluxText":
        (clip_tok, clip), (t5_tok, t5) = load_text_encoder(folder, "1", CLIPTextModel), load_text_encoder(folder, "2", T5EncoderModel)
        return cls([clip_tok, t5_tok], [clip, t5], folder)

    @property
    def hidden_size(self) -> int:
        return self.models[1].config.d_model

    @property
    def pooled_size(self) -> int:
        return self.models[0].config.hidden_size

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        (clip_tok, t5_tok), (clip, t5) = self.tokenizers, self.models
        pooled = clip(token_ids(clip_tok, captions, clip_tok.model_max_length, self.device),
                      output_hidden_states=False).pooler_output
        hidden = t5(token_ids(t5_tok, captions, FLUX_T5_TOKENS, self.device), output_hidden_states=False)[0]
        return hidden, pooled


class ChromaText(OneT5):
    model_class = T5EncoderModel
    max_length = CHROMA_T5_TOKENS

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizers[0](captions, padding="max_length", max_length=CHROMA_T5_TOKENS, truncation=True,
                                    return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        hidden = self.models[0](tokens.input_ids.to(self.device), attention_mask=mask, output_hidden_states=False)[0]
        # what the transformer attends to: the caption's tokens and the first pad (ChromaPipeline's mask)
        kept = torch.arange(mask.shape[1], device=self.device)[None, :] <= mask.sum(dim=1, keepdim=True)
        return hidden * kept.unsqueeze(-1).to(hidden.dtype), torch.zeros(len(captions), 0, device=self.device)


def flux_text_widths(folder: Path) -> tuple[int, int]:
    """(T5's width, CLIP's pooled width) from the folder's configs."""
    clip, t5 = text_encoder_configs(folder)[:2]
    return t5["d_model"], clip["hidden_size"]
