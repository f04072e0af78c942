"""The frozen text encoders: captions in, (hidden states for cross-attention, pooled embedding) out.

`CaptionEncoder` keeps each distinct caption's outputs once computed (the encoders are frozen). `TextEncoder` is
one transformers CLIP text model with its tokenizer: `tiny-clip` builds both locally (random seeded weights, a
word-level vocabulary) so nothing is downloaded; a path loads a local transformers folder; either way the run folder
gets a copy that `diffpipe sample` loads. The text encoders of a diffusers pipeline folder (SD, SDXL) are in
models/folder.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.normalizers import Lowercase
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast

from .folder import component_weights

__all__ = ["CaptionEncoder", "TextEncoder", "TINY_VOCABULARY", "filled_lengths_of", "caption_and_picture"]

# joins a caption and the key of the picture an encoder that reads pictures sees beside it (Qwen-Image-Edit's
# Qwen2.5-VL reads the control picture with the instruction): a character no caption file holds
_PICTURE_MARK = "\x1d"

TINY_VOCABULARY = (
    "a an the of digit digits number handwritten written drawn picture photo image "
    "zero one two three four five six seven eight nine small large thick thin"
).split()


def _tiny_tokenizer(max_length: int, extra_words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    words = ["<pad>", "<unk>", "<bos>", "<eos>"] + TINY_VOCABULARY + list(extra_words)
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.normalizer = Lowercase()
    core.pre_tokenizer = Whitespace()
    # CLIP pools at the end-of-text token, and its causal mask means only that token has seen the caption
    core.post_processor = TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>", eos_token="<eos>", model_max_length=max_length)


def caption_and_picture(text: str) -> tuple[str, str | None]:
    """(caption, picture key or None) of what `CaptionEncoder.texts` made."""
    caption, _, picture = text.partition(_PICTURE_MARK)
    return caption, picture or None


class CaptionEncoder:
    """Captions -> (hidden states, pooled embedding), without gradients, each distinct caption computed once when
    `keep` or `remember` is asked to. Subclasses give `_encode`, `modules`, `hidden_size` and `pooled_size`.

    An encoder that `reads_pictures` (Qwen-Image-Edit's) encodes a caption together with a picture: it is asked for
    `texts(captions, pictures)`, each caption joined with its picture's key, and reads each picture through what
    `show` gave it under that key; such a text is kept, cached and answered as a caption is."""

    max_length: int
    reads_pictures = False
    # True where the family cuts a batch's text to its captions and pads it to its lengths again (build.py sets it
    # from the family's `reads_text_lengths`): each caption's outputs are kept and cached only up to their last
    # filled position (`rows`): HunyuanVideo 1.5's 1,000 x 5,056 states of a 40-token caption are 10 MB in bf16
    # whole, 0.4 MB so
    trims_padding = False

    def __init__(self):
        self._kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # caption -> (hidden, pooled)
        self._outputs_on: torch.device | None = None  # where outputs go once the weights are parked (`park`)
        self._lengths: dict[str, int] = {}  # caption -> positions up to its last filled one (`filled_lengths`)
        self._pictures: dict[str, Callable[[], Image.Image]] = {}  # picture key -> its reader (`show`)

    def texts(self, captions: list[str], pictures: list[str] | None) -> list[str]:
        """What to ask this encoder for: the captions, or, where it reads pictures and each caption has one (a key
        `show` was given), each caption joined with its picture."""
        if not self.reads_pictures or pictures is None:
            return captions
        return [f"{c}{_PICTURE_MARK}{p}" for c, p in zip(captions, pictures)]

    def show(self, pictures: dict[str, Callable[[], Image.Image]]) -> None:
        """Readers of the pictures `texts` may name, by key: read only when a text naming one is encoded."""
        self._pictures.update(pictures)

    def picture(self, key: str) -> Image.Image:
        if key not in self._pictures:
            raise KeyError(f"the picture {key} was never shown to the text encoder (CaptionEncoder.show)")
        return self._pictures[key]()

    def modules(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    @property
    def pooled_size(self) -> int:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.modules()[0].parameters()).device

    @property
    def outputs_device(self) -> torch.device:
        """Where encoded captions are given: the weights' device, or the one they left when parked."""
        return self._outputs_on or self.device

    def park(self, captions: list[str]) -> bool:
        """When every one of `captions` is kept, move the weights to host memory (Flux's T5-XXL and CLIP take 19 GB
        of GPU memory in fp32) and return True; outputs stay on the device they were on. A caption asked for later
        and not kept is still encoded, on the CPU (slowly), and its outputs moved there."""
        if not self._kept or any(c not in self._kept for c in captions) or self.device.type == "cpu":
            return False
        self._outputs_on, was = self.device, self.device
        self.to("cpu")
        if was.type == "cuda":
            torch.cuda.empty_cache()  # the stages built next, and NCCL, get the memory the encoders held
        return True

    def to(self, device: torch.device | str) -> "CaptionEncoder":
        for module in self.modules():
            module.to(device)
        return self

    def caption_bytes(self) -> int:
        """Bytes one caption's outputs take."""
        dtype_bytes = next(self.modules()[0].parameters()).element_size()
        return (self.max_length * self.hidden_size + self.pooled_size) * dtype_bytes

    def keep(self, captions: list[str], max_gib: float, chunk: int = 64) -> bool:
        """Encode each distinct caption once, on the encoder's device, and answer `encode` from memory from then on:
        the encoder is frozen, so its output for a caption never changes. Only when all of them fit in `max_gib`;
        returns whether they were kept."""
        distinct = sorted(set(captions) - self._kept.keys())  # those kept already are not computed again
        if not captions or len(distinct) * self.caption_bytes() > max_gib * 2**30:
            return False
        for start in range(0, len(distinct), chunk):
            part = distinct[start:start + chunk]
            hidden, pooled = self._encode(part)
            hidden, pooled = hidden.to(self.outputs_device), pooled.to(self.outputs_device)
            self._kept.update({c: (h, p) for c, h, p in zip(part, self.rows(part, hidden), pooled)})
        return True

    def rows(self, captions: list[str], hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each caption's hidden states as they are kept and cached: up to its last filled position where the encoder
        `trims_padding` (at least one), else whole."""
        if not self.trims_padding:
            return list(hidden)
        return [h[:max(n, 1)] for h, n in zip(hidden, self.filled_lengths(captions, hidden))]

    def remember(self, outputs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Outputs computed before (the text cache on disk), answered by `encode` from now on."""
        device = self.outputs_device
        self._kept.update({c: (h.to(device), p.to(device)) for c, (h, p) in outputs.items()})

    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, pooled embedding) of a batch of captions."""
        if self._kept and all(c in self._kept for c in captions):
            rows = [self._kept[c] for c in captions]
            longest = max(h.shape[0] for h, _ in rows)  # texts with pictures are kept as long as they are
            return (torch.stack([F.pad(h, (0, 0, 0, longest - h.shape[0])) for h, _ in rows]),
                    torch.stack([p for _, p in rows]))
        hidden, pooled = self._encode(captions)
        return hidden.to(self.outputs_device), pooled.to(self.outputs_device)

    def filled_lengths(self, captions: list[str], hidden: torch.Tensor) -> list[int]:
        """Each caption's positions up to its last filled one (a state not all zero) in `hidden`, its `encode`d
        states: read off the device the first time a caption is asked for, then known on the host, so later steps
        asking for them do not wait for the device."""
        unknown = [i for i, c in enumerate(captions) if c not in self._lengths]
        if unknown:
            self._lengths.update(zip([captions[i] for i in unknown], filled_lengths_of(hidden[unknown])))
        return [self._lengths[c] for c in captions]

    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def filled_lengths_of(hidden: torch.Tensor) -> list[int]:
    """(B, L, D) states -> for each row, the positions up to its last one not all zero (0 when none is)."""
    filled = hidden.abs().amax(dim=-1) > 0
    return (filled * torch.arange(1, hidden.shape[1] + 1, device=hidden.device)).amax(dim=-1).tolist()


class TextEncoder(CaptionEncoder):
    """One CLIP text model: its last hidden states and its pooled projection (the digits models' conditioning)."""

    def __init__(self, model: CLIPTextModelWithProjection, tokenizer, max_length: int):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_length = max_length

    @classmethod
    def tiny(cls, hidden_size: int, projection_dim: int, max_length: int, seed: int,
             extra_words: tuple[str, ...] = ()) -> "TextEncoder":
        """`extra_words`: known beyond TINY_VOCABULARY (the motions of moving digits), appended so the others keep
        their ids."""
        tokenizer = _tiny_tokenizer(max_length, extra_words)
        config = CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=2, num_attention_heads=max(1, hidden_size // 16), max_position_embeddings=max_length,
            projection_dim=projection_dim, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(seed)
        return cls(CLIPTextModelWithProjection(config), tokenizer, max_length)

    @classmethod
    def from_folder(cls, folder: str | Path, max_length: int) -> "TextEncoder":
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"text encoder folder {folder} has no config.json; give a local transformers "
                                    "CLIP folder or model.text_encoder = \"tiny-clip\"")
        component_weights(folder.parent, folder.name)  # refuses pickles before from_pretrained could read one
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = CLIPTextModelWithProjection.from_pretrained(folder, use_safetensors=True, local_files_only=True)
        return cls(model, tokenizer, max_length)

    def save(self, folder: str | Path) -> None:
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def pooled_size(self) -> int:
        return self.model.config.projection_dim

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(captions, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        device = next(self.model.parameters()).device
        out = self.model(input_ids=tokens.input_ids.to(device), attention_mask=tokens.attention_mask.to(device))
        return out.last_hidden_state, out.text_embeds
