"""HunyuanVideo 1.5's frozen text encoders (a HunyuanVideo15Pipeline folder's text_encoder/ and text_encoder_2/),
encoding as the pipeline's `encode_prompt` does: its own `_get_mllm_prompt_embeds` (Qwen2.5-VL's text model reading
the caption in the pipeline's chat template, padded to 1,108 tokens, the states three from the last, the template's
first 108 tokens dropped: 1,000 positions) and `_get_byt5_prompt_embeds` (ByT5 reading the caption's quoted text as
`Text "..."`, 256 positions; zeros and an empty mask for a caption with no quotes).

A caption's two outputs are given side by side along the width, Qwen's first, ByT5's over the first 256 positions,
each zero where its mask is (models/families/hunyuan_video15/hunyuan_video15.py reads the masks back off the zeros); no pooled text.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2_5_VLTextModel, T5EncoderModel

from ...folder_text import FolderText, load_text_encoder

__all__ = ["HunyuanVideo15Text", "QWEN_TOKENS", "BYT5_TOKENS"]

QWEN_TOKENS = 1000  # HunyuanVideo15Pipeline's tokenizer_max_length (after the template's 108 tokens)
BYT5_TOKENS = 256  # its tokenizer_2_max_length


class HunyuanVideo15Text(FolderText):
    suffixes = ("", "_2")
    max_length = QWEN_TOKENS

    @classmethod
    def from_folder(cls, folder: Path) -> "HunyuanVideo15Text":
        (qwen_tok, qwen), (byt5_tok, byt5) = load_text_encoder(folder, "1", Qwen2_5_VLTextModel), load_text_encoder(folder, "2", T5EncoderModel)
        return cls([qwen_tok, byt5_tok], [qwen, byt5], folder)

    @property
    def hidden_size(self) -> int:
        return self.models[0].config.hidden_size + self.models[1].config.d_model

    @property
    def pooled_size(self) -> int:
        return 0

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers import HunyuanVideo15Pipeline as Pipeline

        (qwen_tok, byt5_tok), (qwen, byt5) = self.tokenizers, self.models
        states, mask = Pipeline._get_mllm_prompt_embeds(qwen, qwen_tok, captions, self.device,
                                                        tokenizer_max_length=QWEN_TOKENS)
        glyphs, glyph_mask = Pipeline._get_byt5_prompt_embeds(byt5_tok, byt5, captions, self.device,
                                                               tokenizer_max_length=BYT5_TOKENS)
        hidden = states.new_zeros(len(captions), QWEN_TOKENS, self.hidden_size)
        width = states.shape[-1]
        hidden[:, :, :width] = states * mask[..., None].to(states.dtype)
        hidden[:, :BYT5_TOKENS, width:] = glyphs.to(states.dtype) * glyph_mask[..., None].to(states.dtype)
        return hidden, torch.zeros(len(captions), 0, device=self.device)
