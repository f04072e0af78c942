"""Z-Image's frozen text encoder (ZImagePipeline's `_encode_prompt`): a Qwen3 model's second-to-last hidden states of
the caption set in the tokenizer's own chat template (a user message, the assistant's turn opened, thinking on),
at most 512 tokens (the pipeline's max_sequence_length), only the positions its tokenizer's mask sets: zero past
them (the family pads each caption to a multiple of 32 with the model's pad token, as the model does).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel

from ...folder_text import FolderText, load_text_encoder

__all__ = ["ZImageText"]


class ZImageText(FolderText):
    suffixes = ("",)
    max_length = 512  # ZImagePipeline.__call__'s max_sequence_length (z_image.py Z_IMAGE_TEXT_TOKENS)

    @classmethod
    def from_folder(cls, folder: Path) -> "ZImageText":
        tokenizer, model = load_text_encoder(folder, "1", AutoModel)  # Qwen3Model, as model_index.json names it
        return cls([tokenizer], [model], folder)

    @property
    def hidden_size(self) -> int:
        return self.models[0].config.hidden_size

    @property
    def pooled_size(self) -> int:
        return 0

    def prompts(self, captions: list[str]) -> list[str]:
        """Each caption as the pipeline sets it in the tokenizer's chat template."""
        return [self.tokenizers[0].apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                       add_generation_prompt=True, enable_thinking=True)
                for c in captions]

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # padded to the batch's longest, not to 512 as the pipeline pads: the model attends causally, so the states
        # of a caption's tokens do not depend on what follows them
        tokens = self.tokenizers[0](self.prompts(captions), max_length=self.max_length, padding=True, truncation=True,
                                    return_tensors="pt").to(self.device)
        states = self.models[0](input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                output_hidden_states=True).hidden_states[-2]
        hidden = states.new_zeros(len(captions), self.max_length, states.shape[-1])
        for i, (row, mask) in enumerate(zip(states, tokens.attention_mask.bool())):
            kept = row[mask]
            hidden[i, :len(kept)] = kept
        return hidden, torch.zeros(len(captions), 0, device=self.device)
