"""FLUX.2 klein's frozen text encoder (Flux2KleinPipeline's `_get_qwen3_prompt_embeds`): a Qwen3 causal LM reading
the caption set in its tokenizer's chat template (a user message, the assistant's turn opened, thinking off), padded
to 512 tokens as the pipeline pads it (the transformer attends to every position, pads included, so the padding is
part of what it reads), the hidden states of three of its layers side by side. The pipeline's layers are 9, 18 and
27 of the 36 of klein's encoders: a quarter, a half and three quarters of the way, the rule used here for any depth
(the tests' 4-layer encoder: 1, 2 and 3).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from ...folder_text import FolderText, load_text_encoder

__all__ = ["Flux2KleinText", "FLUX2_TEXT_TOKENS", "hidden_layers"]

FLUX2_TEXT_TOKENS = 512  # Flux2KleinPipeline's max_sequence_length


def hidden_layers(depth: int) -> tuple[int, int, int]:
    """The hidden states read of an encoder of `depth` layers: (9, 18, 27) of 36, as the pipeline reads them."""
    return depth // 4, depth // 2, 3 * depth // 4


class Flux2KleinText(FolderText):
    suffixes = ("",)
    max_length = FLUX2_TEXT_TOKENS

    @classmethod
    def from_folder(cls, folder: Path) -> "Flux2KleinText":
        tokenizer, model = load_text_encoder(folder, "1", Qwen3ForCausalLM)
        return cls([tokenizer], [model], folder)

    @property
    def hidden_size(self) -> int:
        return 3 * self.models[0].config.hidden_size

    @property
    def pooled_size(self) -> int:
        return 0

    def prompts(self, captions: list[str]) -> list[str]:
        return [self.tokenizers[0].apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                       add_generation_prompt=True, enable_thinking=False)
                for c in captions]

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizers[0](self.prompts(captions), max_length=self.max_length, padding="max_length",
                                    truncation=True, return_tensors="pt").to(self.device)
        states = self.models[0](input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                output_hidden_states=True, use_cache=False).hidden_states
        layers = hidden_layers(self.models[0].config.num_hidden_layers)
        hidden = torch.cat([states[k] for k in layers], dim=-1)  # (B, L, 3 D): each position's three states in turn
        return hidden, torch.zeros(len(captions), 0, device=self.device)
