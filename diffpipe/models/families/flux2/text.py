"""FLUX.2's frozen text encoders. Klein's (Flux2KleinPipeline's `_get_qwen3_prompt_embeds`): a Qwen3 causal LM reading
the caption set in its tokenizer's chat template (a user message, the assistant's turn opened, thinking off), padded
to 512 tokens as the pipeline pads it (the transformer attends to every position, pads included, so the padding is
part of what it reads), the hidden states of three of its layers side by side. The pipeline's layers are 9, 18 and
27 of the 36 of klein's encoders: a quarter, a half and three quarters of the way, the rule used here for any depth
(the tests' 4-layer encoder: 1, 2 and 3).

Dev's (Flux2Pipeline's `_get_mistral_3_small_prompt_embeds`): Mistral 3 reading the caption after FLUX.2's system
message (diffusers' `SYSTEM_MESSAGE`, the conversation built by diffusers' `format_input`, as the pipeline builds it)
in the tokenizer's chat template, padded to 512 tokens, the states of layers 10, 20 and 30 of its 40 (the same
quarter, half and three quarters) side by side. The release keeps its tokenizer as a PixtralProcessor, which needs
torchvision for its picture half; captions need only the tokenizer and the processor's chat template, read here
without it (`chat_template.jinja`, or the `chat_template` of `chat_template.json`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

from ...folder_text import FolderText, load_text_encoder

__all__ = ["Flux2DevText", "Flux2KleinText", "FLUX2_TEXT_TOKENS", "hidden_layers"]

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
    def text_config(self):
        """The config of the language model whose layers are read."""
        return self.models[0].config

    @property
    def hidden_size(self) -> int:
        return 3 * self.text_config.hidden_size

    @property
    def pooled_size(self) -> int:
        return 0

    def prompts(self, captions: list[str]) -> list[str]:
        return [self.tokenizers[0].apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                       add_generation_prompt=True, enable_thinking=False)
                for c in captions]

    def tokens(self, captions: list[str]):
        """The captions' token ids and attention mask, padded to `max_length`, as the pipeline tokenizes them."""
        return self.tokenizers[0](self.prompts(captions), max_length=self.max_length, padding="max_length",
                                  truncation=True, return_tensors="pt")

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokens(captions).to(self.device)
        states = self.models[0](input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                                output_hidden_states=True, use_cache=False).hidden_states
        layers = hidden_layers(self.text_config.num_hidden_layers)
        hidden = torch.cat([states[k] for k in layers], dim=-1)  # (B, L, 3 D): each position's three states in turn
        return hidden, torch.zeros(len(captions), 0, device=self.device)


class Flux2DevText(Flux2KleinText):
    """Klein's encoding of dev's Mistral 3 (its language model's layers), with dev's conversation."""

    @classmethod
    def from_folder(cls, folder: Path) -> "Flux2DevText":
        tokenizer, model = load_text_encoder(folder, "1", Mistral3ForConditionalGeneration)
        tokenizer.chat_template = tokenizer.chat_template or processor_chat_template(folder)
        return cls([tokenizer], [model], folder)

    @property
    def text_config(self):
        return self.models[0].config.text_config

    def conversations(self, captions: list[str]) -> list:
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        return format_input(prompts=captions, system_message=SYSTEM_MESSAGE)

    def tokens(self, captions: list[str]):
        return self.tokenizers[0].apply_chat_template(
            self.conversations(captions), add_generation_prompt=False, tokenize=True, return_dict=True,
            return_tensors="pt", padding="max_length", truncation=True, max_length=self.max_length)


def processor_chat_template(folder: Path) -> str:
    """The chat template a pipeline folder's processor keeps beside its tokenizer; CheckpointError without one."""
    import json

    from ....errors import CheckpointError

    here = Path(folder) / "tokenizer"
    if (here / "chat_template.jinja").is_file():
        return (here / "chat_template.jinja").read_text()
    if (here / "chat_template.json").is_file():
        return json.loads((here / "chat_template.json").read_text())["chat_template"]
    raise CheckpointError(f"model.path={folder}: tokenizer/ has no chat template (chat_template.jinja or "
                          "chat_template.json), which FLUX.2 dev's captions are written in; copy tokenizer/ from the "
                          "release")
