"""Qwen-Image's frozen text encoder (QwenImagePipeline's `_get_qwen_prompt_embeds`): Qwen2.5-VL's last hidden states of
the caption set in the pipeline's chat template, the template's first 34 tokens dropped, zero past the caption's
tokens (512 positions, the pipeline's max_sequence_length). Qwen-Image-Edit's (QwenImageEditPipeline's
`_get_qwen_prompt_embeds`): the same encoder reads the control picture with the instruction (its vision tower's tokens
in place of the template's <|image_pad|>, as the pipeline's Qwen2VLProcessor expands it), the template's first 64
tokens dropped, kept whole (no cut: the picture's tokens and the caption's).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from ....errors import CheckpointError
from ...folder import component_weights, fingerprint_files, load_tokenizer
from ...folder_text import FolderText, load_text_encoder
from ...text import caption_and_picture

__all__ = ["QwenImageText", "QwenImageEditText", "as_the_pipeline_sizes", "reads_pictures_as_plus",
           "EDIT_PICTURE_AREA", "EDIT_PLUS_PICTURE_AREA"]

# QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx (the template's tokens before the
# caption, dropped from the states); its tokenizer_max_length is 1024
_QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                  "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                  "<|im_start|>assistant\n")
_QWEN_TEMPLATE_TOKENS = 34
# QwenImageEditPipeline's: the picture's tokens go where <|image_pad|> is
_QWEN_EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                       "objects, background), then explain how the user's text instruction should alter or modify the "
                       "image. Generate a new image that meets the user's requirements while maintaining consistency "
                       "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                       "<|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
_QWEN_EDIT_TEMPLATE_TOKENS = 64
_IMAGE_PAD = "<|image_pad|>"
_PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"
# QwenImageEditPlusPipeline's (Qwen-Image-Edit-2509, -2511): the pictures named in the instruction, before it
_QWEN_EDIT_PLUS_TEMPLATE = _QWEN_EDIT_TEMPLATE.replace(_PICTURE, "")
_QWEN_EDIT_PLUS_PICTURE = "Picture 1: " + _PICTURE
EDIT_PICTURE_AREA = 1024 * 1024  # QwenImageEditPipeline sizes its input to about this many pixels for its processor
EDIT_PLUS_PICTURE_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE


class QwenImageText(FolderText):
    suffixes = ("",)
    max_length = 512  # QwenImagePipeline.__call__'s max_sequence_length (models/families/qwen_image/qwen_image.py QWEN_TEXT_TOKENS)

    @classmethod
    def from_folder(cls, folder: Path) -> "QwenImageText":
        tokenizer, model = load_text_encoder(folder, "1", Qwen2_5_VLForConditionalGeneration)
        return cls([tokenizer], [model], folder)

    @property
    def hidden_size(self) -> int:
        return self.models[0].config.text_config.hidden_size

    @property
    def pooled_size(self) -> int:
        return 0

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        dropped = _QWEN_TEMPLATE_TOKENS
        tokens = self.tokenizers[0]([_QWEN_TEMPLATE.format(c) for c in captions], max_length=1024 + dropped,
                                    padding=True, truncation=True, return_tensors="pt").to(self.device)
        states = self.models[0](input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                output_hidden_states=True).hidden_states[-1]
        hidden = states.new_zeros(len(captions), self.max_length, states.shape[-1])
        for i, (row, mask) in enumerate(zip(states, tokens.attention_mask.bool())):
            kept = row[mask][dropped:][:self.max_length]
            hidden[i, :len(kept)] = kept
        return hidden, torch.zeros(len(captions), 0, device=self.device)


def as_the_pipeline_sizes(picture: Image.Image, area: int = EDIT_PICTURE_AREA) -> Image.Image:
    """A control picture at about `area` pixels in its own proportions, sides multiples of 32 (Lanczos), as
    QwenImageEditPipeline (1024^2) and QwenImageEditPlusPipeline (384^2) resize their input image before their
    processor reads it: the text encoder sees a control as it will at inference, whatever the bucket it trains in."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(area, picture.width / picture.height)
    return picture.resize((width, height), Image.LANCZOS)


def reads_pictures_as_plus(folder: Path) -> bool:
    """Whether a Qwen-Image-Edit folder is QwenImageEditPlusPipeline's (2509, 2511: model_index.json says)."""
    index = folder / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == "QwenImageEditPlusPipeline"


class QwenImageEditText(QwenImageText):
    """Qwen-Image-Edit's: each caption read beside its picture (`texts(captions, pictures)`), the picture sized as
    the pipeline sizes its input (`as_the_pipeline_sizes`); a QwenImageEditPlusPipeline folder's (2509, 2511) in that
    pipeline's template ("Picture 1: " and the picture before the caption) at its 384^2 pixels. A caption without a
    picture (the Plus pipeline's text-only prompt; the first pipeline always has one) is read in the template without
    the picture's tokens."""

    max_length = 1369 + 512  # what a caption's outputs are counted as: a 1024^2 picture's tokens and a long caption
    reads_pictures = True

    def __init__(self, tokenizers: list, models: list[torch.nn.Module], folder: Path, pictures, plus: bool = False):
        super().__init__(tokenizers, models, folder)
        self.image_processor = pictures
        self.plus = plus  # QwenImageEditPlusPipeline's template and picture size

    @classmethod
    def from_folder(cls, folder: Path) -> "QwenImageEditText":
        from transformers import AutoImageProcessor

        _, model = load_text_encoder(folder, "1", Qwen2_5_VLForConditionalGeneration)
        if not (folder / "processor" / "preprocessor_config.json").is_file():
            raise CheckpointError(f"model.path={folder}: a Qwen-Image-Edit folder has processor/ (Qwen2VLProcessor: its "
                                  "preprocessor_config.json and tokenizer), which reads the control picture; copy it "
                                  "from the model's release")
        # the processor's own tokenizer and image processor, as the pipeline's Qwen2VLProcessor holds them
        tokenizer = load_tokenizer(folder, "processor")
        pictures = AutoImageProcessor.from_pretrained(folder, subfolder="processor", local_files_only=True)
        return cls([tokenizer], [model], folder, pictures, reads_pictures_as_plus(folder))

    def _prompt(self, caption: str, picture_tokens: int) -> str:
        """The caption in the pipeline's template, its picture's tokens where the processor puts them (none: the
        template without a picture)."""
        if self.plus:
            named = _QWEN_EDIT_PLUS_PICTURE if picture_tokens else ""
            text = _QWEN_EDIT_PLUS_TEMPLATE.format(named + caption)
        else:
            text = _QWEN_EDIT_TEMPLATE.format(caption) if picture_tokens else _QWEN_EDIT_PLUS_TEMPLATE.format(caption)
        return text.replace(_IMAGE_PAD, _IMAGE_PAD * picture_tokens, 1)

    def fingerprint(self) -> str:
        files = component_weights(self.folder, "text_encoder") + sorted(
            f for f in (self.folder / "processor").iterdir() if f.is_file())
        return fingerprint_files(files, extra=type(self).__name__)

    @torch.no_grad()
    def _encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        captions, keys = zip(*(caption_and_picture(t) for t in texts))
        area = EDIT_PLUS_PICTURE_AREA if self.plus else EDIT_PICTURE_AREA
        pictures = [as_the_pipeline_sizes(self.picture(k), area) for k in keys if k is not None]
        seen = self.image_processor(images=pictures, return_tensors="pt") if pictures else {}
        merged = self.image_processor.merge_size ** 2
        counts = iter((seen["image_grid_thw"].prod(-1) // merged).tolist() if pictures else [])
        prompts = [self._prompt(c, next(counts) if k is not None else 0) for c, k in zip(captions, keys)]
        tokens = self.tokenizers[0](prompts, padding=True, return_tensors="pt").to(self.device)
        states = self.models[0](input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                pixel_values=seen["pixel_values"].to(self.device) if pictures else None,
                                image_grid_thw=seen["image_grid_thw"].to(self.device) if pictures else None,
                                output_hidden_states=True).hidden_states[-1]
        kept = [row[mask][_QWEN_EDIT_TEMPLATE_TOKENS:] for row, mask in zip(states, tokens.attention_mask.bool())]
        hidden = states.new_zeros(len(texts), max(len(k) for k in kept), states.shape[-1])
        for i, row in enumerate(kept):
            hidden[i, :len(row)] = row
        return hidden, torch.zeros(len(texts), 0, device=self.device)
