"""Wan's frozen text encoder (WanPipeline's `_get_t5_prompt_embeds`): umT5's last hidden states over 512 tokens (the
pipeline's default), the caption cleaned as the pipeline cleans it, every position past the caption's tokens zero;
no pooled text.
"""
from __future__ import annotations

import torch
from transformers import UMT5EncoderModel

from ...folder_text import OneT5

__all__ = ["WanText", "WAN_T5_TOKENS"]

WAN_T5_TOKENS = 512  # WanPipeline's max_sequence_length


class WanText(OneT5):
    model_class = UMT5EncoderModel
    max_length = WAN_T5_TOKENS

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.tokenizers[0]([prompt_clean(c) for c in captions], padding="max_length", max_length=WAN_T5_TOKENS,
                                    truncation=True, add_special_tokens=True, return_attention_mask=True,
                                    return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        hidden = self.models[0](tokens.input_ids.to(self.device), mask).last_hidden_state
        return hidden * mask.unsqueeze(-1).to(hidden.dtype), torch.zeros(len(captions), 0, device=self.device)
