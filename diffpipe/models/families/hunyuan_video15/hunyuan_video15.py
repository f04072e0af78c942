"""Adapter for diffusers' `HunyuanVideo15Transformer3DModel` (HunyuanVideo 1.5, text-to-video: an 8.3 B MMDiT of 54
double-stream blocks over a Qwen2.5-VL text encoder's states and a ByT5 encoder's of the caption's quoted text).

Units: `embed` (the latents' patch embedding, the time embedding, the token refiner over Qwen's states, the ByT5
projection and the condition-type embeddings), each block `block.i`, and `out` (the adaptive output norm and
projection). Named tensors: `h` (video tokens), `context` (the ByT5 tokens, then Qwen's) and `temb`. The rotary
embedding of the video's positions and both text masks are conditions, computed beside the data and given to every
stage: nothing of them crosses a boundary.

What the pipeline feeds and how it is kept the same:
- The transformer reads 2 x latent channels + 1: the noisy latents, then (text-to-video) zero condition latents and a
  zero mask, as `HunyuanVideo15Pipeline.prepare_cond_latents_and_mask`; `embed` joins the zeros, so the first stage
  is fed the latents alone.
- Text: a caption's Qwen states and its ByT5 states side by side along the width (text.py's HunyuanVideo15Text), zero
  past each one's tokens; a batch is cut to the smallest of `TEXT_LENGTHS` holding its longest (models/tokens.py's text_mask),
  and each stream's mask read off its zeros on the device (no wait).
- The model's forward gathers each sample's valid tokens first (image, ByT5, Qwen) and zeroes the rest; the image's
  are all invalid in text-to-video (zero `image_embeds`), so `embed` leaves them out. Attention is over the video's
  tokens and the text's with the padded text masked as keys only (the model's processor builds a sequence x
  sequence mask, 2.4 GB a sample at 121 frames of 480p): the order of text tokens and what padded queries get do not
  reach the prediction (tested against diffusers' forward).
- Timesteps reach the model as the pipeline gives them (t x 1000).

Image-to-video (a SigLIP embedding of the first frame and its latents beside the noisy ones) and the MeanFlow
super-resolution models are refused, naming the config key.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15RotaryPosEmbed
from torch import nn

from ...family import ModelFamily, TextBatch
from ...tokens import mask_or_none, reset_rms_norm, text_mask
from ...text import filled_lengths_of
from .text import BYT5_TOKENS, QWEN_TOKENS, HunyuanVideo15Text
from ...units import Backbone, Unit

__all__ = ["HunyuanVideo15Family", "hunyuan_video15_backbone", "HUNYUAN_VIDEO15_PRESETS", "TEXT_LENGTHS",
           "QWEN_TOKENS", "BYT5_TOKENS"]

TEXT_LENGTHS = (32, 64, 128, 256, 512, QWEN_TOKENS)  # a batch's text is cut to the smallest that holds it

HUNYUAN_VIDEO15_PRESETS = {
    # hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v's transformer/config.json: 8.3 B parameters
    "480p-t2v": dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                     num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                     text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                     rope_axes_dim=(16, 56, 56), target_size=480, task_type="t2v", use_meanflow=False),
    # clips of 1-channel 8x8 frames (moving digits): 4 frames of 64 tokens each
    "digits": dict(in_channels=3, out_channels=1, num_attention_heads=2, attention_head_dim=16, num_layers=3,
                   num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                   text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_theta=256.0,
                   rope_axes_dim=(4, 6, 6), target_size=8, task_type="t2v", use_meanflow=False),
}


@lru_cache(maxsize=8)
def _rotary_table(patch: tuple[int, int], axes: tuple[int, ...], theta: float,
                  latent_size: tuple[int, int, int]) -> torch.Tensor:
    """(2, tokens, head dim): the cosines and sines the model's `rope` gives latents of `latent_size` (it reads only
    their shape)."""
    rope = HunyuanVideo15RotaryPosEmbed(patch[0], patch[1], list(axes), theta)
    return torch.stack(rope(torch.empty(1, 1, *latent_size, device="cpu")))


def rotary_embedding(cfg, latent_size: tuple[int, int, int], device) -> torch.Tensor:
    return _rotary_table((cfg.patch_size, cfg.patch_size_t), tuple(cfg.rope_axes_dim), cfg.rope_theta,
                         tuple(latent_size)).to(device)


def text_streams(cfg, hidden: torch.Tensor, filled: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Qwen's and ByT5's states of a batch (side by side along the width, as HunyuanVideo15Text gives them) cut to
    `TEXT_LENGTHS`, and each one's mask: True where its encoder filled the position. Text with nothing filled (the
    zeros a plan traces) gets empty (B, 0) masks: unmasked, as qwen_image.text_mask leaves it, so a plan counts
    attention as the fused kernels run it."""
    filled = filled_lengths_of(hidden) if filled is None else filled
    hidden, _ = text_mask(hidden, filled, TEXT_LENGTHS)
    qwen, byt5 = hidden.split([cfg.text_embed_dim, cfg.text_embed_2_dim], dim=-1)
    if not any(filled):
        unmasked = torch.zeros(len(hidden), 0, dtype=torch.bool, device=hidden.device)
        return {"encoder_hidden_states": qwen, "encoder_attention_mask": unmasked,
                "encoder_hidden_states_2": byt5, "encoder_attention_mask_2": unmasked}
    return {"encoder_hidden_states": qwen, "encoder_attention_mask": qwen.abs().amax(dim=-1) > 0,
            "encoder_hidden_states_2": byt5, "encoder_attention_mask_2": byt5.abs().amax(dim=-1) > 0}


def pipeline_input(latents: torch.Tensor, in_channels: int) -> torch.Tensor:
    """What HunyuanVideo15Pipeline feeds the transformer for text-to-video: the latents, then zero condition latents
    and a zero mask (`prepare_cond_latents_and_mask`), `in_channels` in all."""
    b, c, *frames = latents.shape
    return torch.cat([latents, latents.new_zeros(b, in_channels - c, *frames)], dim=1)


def _valid(states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """States where the mask is set, zeros elsewhere (the model's forward puts zeros there)."""
    if mask is None:
        return states
    return torch.where(mask[..., None], states, torch.zeros((), dtype=states.dtype, device=states.device))


def _text_valid(mask: torch.Tensor, mask_2: torch.Tensor) -> torch.Tensor | None:
    """Which of the context's tokens (ByT5's, then Qwen's) are keys; None: all of them."""
    return torch.cat([mask_2, mask], 1) if mask.shape[1] else None


class _Embed(nn.Module):
    def __init__(self, model: HunyuanVideo15Transformer3DModel):
        super().__init__()
        self.x_embedder, self.time_embed = model.x_embedder, model.time_embed
        self.cond_type_embed = model.cond_type_embed
        self.context_embedder, self.context_embedder_2 = model.context_embedder, model.context_embedder_2
        self.image_embedder = model.image_embedder  # not run (text-to-video), held so the stage saves its weights
        self.in_channels = model.config.in_channels

    def _typed(self, states: torch.Tensor, kind: int) -> torch.Tensor:
        return self.cond_type_embed(torch.full(states.shape[:2], kind, dtype=torch.long, device=states.device))

    def forward(self, sample, timestep, encoder_hidden_states, encoder_attention_mask, encoder_hidden_states_2,
                encoder_attention_mask_2):
        sample = pipeline_input(sample, self.in_channels)
        mask, mask_2 = mask_or_none(encoder_attention_mask), mask_or_none(encoder_attention_mask_2)
        qwen = self.context_embedder(encoder_hidden_states, timestep, mask)
        qwen = _valid(qwen + self._typed(qwen, 0), mask)
        byt5 = self.context_embedder_2(encoder_hidden_states_2)
        byt5 = _valid(byt5 + self._typed(byt5, 1), mask_2)
        return {"h": self.x_embedder(sample), "context": torch.cat([byt5, qwen], 1), "temb": self.time_embed(timestep)}


def _attention(attn, h, context, text_valid, rope, text_queries: bool = True):
    """HunyuanVideo15AttnProcessor2_0's joint attention with padded text masked as keys only: (video, text) outputs,
    or the video's alone without `text_queries` (the text asks nothing)."""
    def heads(x):
        return x.unflatten(2, (attn.heads, -1))

    q, k, v = heads(attn.to_q(h)), heads(attn.to_k(h)), heads(attn.to_v(h))
    q = apply_rotary_emb(attn.norm_q(q), rope, sequence_dim=1)
    k = apply_rotary_emb(attn.norm_k(k), rope, sequence_dim=1)
    k = torch.cat([k, attn.norm_added_k(heads(attn.add_k_proj(context)))], 1)
    v = torch.cat([v, heads(attn.add_v_proj(context))], 1)
    # split over a sample's processes (pipeline/sequence.py: the processor counts, and may exchange, its attention),
    # the text asks its queries anyway: Ulysses' backward (diffusers 0.42's, and padded heads') takes as many
    # queries as keys (their answers are dropped below)
    exchanged = getattr(attn.processor, "exchanged", None)
    if text_queries or exchanged is not None:
        q = torch.cat([q, attn.norm_added_q(heads(attn.add_q_proj(context)))], 1)
    keys = None if text_valid is None else torch.cat([text_valid.new_ones(h.shape[:2]), text_valid], 1)[:, None, None]

    def attend():
        return dispatch_attention_fn(q, k, v, attn_mask=keys, dropout_p=0.0, is_causal=False,
                                     backend=attn.processor._attention_backend,
                                     parallel_config=attn.processor._parallel_config)  # set: pipeline/sequence.py
    out = attend() if exchanged is None else exchanged(attend)
    out = out.flatten(2, 3).to(q.dtype)
    video = attn.to_out[1](attn.to_out[0](out[:, :h.shape[1]]))
    return (video, attn.to_add_out(out[:, h.shape[1]:])) if text_queries else (video, None)


class _Block(nn.Module):
    """HunyuanVideo15TransformerBlock.forward, its attention through `_attention`. The `last` block runs its video
    side alone: the prediction reads no text, so the text asks no queries and its side after attention is not run."""

    def __init__(self, block: nn.Module, last: bool = False):
        super().__init__()
        self.block, self.last = block, last

    def forward(self, h, context, temb, encoder_attention_mask, encoder_attention_mask_2, rotary):
        block = self.block
        norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(h, emb=temb)
        norm_c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(context, emb=temb)
        text_valid = _text_valid(encoder_attention_mask, encoder_attention_mask_2)
        attn_h, attn_c = _attention(block.attn, norm_h, norm_c, text_valid, (rotary[0, 0], rotary[0, 1]),
                                    text_queries=not self.last)
        h = h + attn_h * gate_msa.unsqueeze(1)
        h = h + gate_mlp.unsqueeze(1) * block.ff(block.norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None])
        if self.last:
            return {"h": h}
        context = context + attn_c * c_gate_msa.unsqueeze(1)
        norm_c = block.norm2_context(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        return {"h": h, "context": context + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_c)}


class _Out(nn.Module):
    def __init__(self, model: HunyuanVideo15Transformer3DModel):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, h, temb):
        return {"prediction": self.proj_out(self.norm_out(h, temb))}


def hunyuan_video15_backbone(model: HunyuanVideo15Transformer3DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
                  "encoder_attention_mask_2", "rotary")
    block_reads = ("h", "context", "temb", "encoder_attention_mask", "encoder_attention_mask_2", "rotary")
    *blocks, last = model.transformer_blocks
    units = [Unit("embed", _Embed(model), ("sample",) + conditions[:5], ("h", "context", "temb"))]
    units += [Unit(f"block.{i}", _Block(b), block_reads, ("h", "context")) for i, b in enumerate(blocks)]
    units.append(Unit(f"block.{len(blocks)}", _Block(last, last=True), block_reads, ("h",)))
    units.append(Unit("out", _Out(model), ("h", "temb"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class HunyuanVideo15Family(ModelFamily):
    """HunyuanVideo 1.5 text-to-video: Qwen2.5-VL's and ByT5's states (text.py's HunyuanVideo15Text), its own video
    VAE (32 channels, 16x smaller sides, a latent frame per 4 video frames, latents x scaling_factor); flow matching.
    Latents are clips (B, C, F, H, W)."""

    name = "hunyuan_video15"
    model_class = HunyuanVideo15Transformer3DModel
    component = "transformer"
    presets = HUNYUAN_VIDEO15_PRESETS
    pipelines = ("HunyuanVideo15Pipeline",)
    reads_text_lengths = True  # a batch's text is cut to its captions (models/tokens.py's text_mask)
    # pipeline.sequence_parallel: the video tokens, and the text's (ByT5's, then Qwen's: attention joins them to the
    # video's as keys) each part split; the video's rotary table and both text masks cut to match where blocks read them
    sequence_streams = {"h": 1, "context": (1, ("encoder_hidden_states_2", "encoder_hidden_states"))}
    sequence_conditions = {"rotary": 2, "encoder_attention_mask": 1, "encoder_attention_mask_2": 1}
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    def diffusers_lora_pipeline(self, cfg):
        """HunyuanVideoPipeline's writer: `transformer.`-prefixed PEFT names and the LoRA config in the header.
        HunyuanVideo15Pipeline has no `load_lora_weights` in diffusers 0.42; read the file with
        `state, metadata = HunyuanVideoPipeline.lora_state_dict(path, return_lora_metadata=True)` and load it with
        `pipe.transformer.load_lora_adapter(state, prefix="transformer", metadata=metadata)` (without the metadata
        peft takes alpha = rank)."""
        import diffusers

        return diffusers.HunyuanVideoPipeline

    def check_supported(self, model):
        cfg = model.config
        if cfg.use_meanflow:
            raise ValueError("HunyuanVideo 1.5 configs with use_meanflow (the super-resolution models) are not "
                             "supported: the hunyuan_video15 adapter trains text-to-video")
        if cfg.task_type != "t2v":
            raise ValueError(f"this HunyuanVideo 1.5 transformer's task_type is {cfg.task_type!r}: image-to-video (a "
                             "SigLIP embedding and the first frame's latents) is not supported yet; train a t2v "
                             "release (task_type \"t2v\")")
        if cfg.in_channels != 2 * cfg.out_channels + 1:
            raise ValueError(f"this HunyuanVideo 1.5 transformer reads {cfg.in_channels} channels and predicts "
                             f"{cfg.out_channels}: the pipeline feeds 2 x {cfg.out_channels} + 1 (latents, condition "
                             "latents, mask)")

    def unreached(self, model):
        """The image embedder (text-to-video's image tokens are all masked out) and the last block's text queries and
        its text side after attention: the prediction reads video tokens only."""
        last = f"transformer_blocks.{len(model.transformer_blocks) - 1}"
        return ["image_embedder"] + [f"{last}.{name}" for name in ("attn.add_q_proj", "attn.norm_added_q",
                                                                   "attn.to_add_out", "ff_context")]

    def describe(self, model, granularity):
        return hunyuan_video15_backbone(model)

    def latent_channels(self, cfg):
        return cfg.out_channels

    def default_latent_size(self, cfg):
        return 8 if cfg.out_channels == 1 else 30  # digits clips; else 480 x 480 pixels through the 16x VAE

    def latent_frames(self, cfg):
        return 4 if cfg.out_channels == 1 else 31  # the VAE: 121 frames -> 1 + 120 / 4 latent frames

    def latent_multiple(self, cfg):
        return cfg.patch_size

    def text_widths(self, cfg):
        return cfg.text_embed_dim + cfg.text_embed_2_dim, 0

    def conditions(self, cfg, text: TextBatch):
        streams = text_streams(cfg, text.hidden, text.filled)
        table = rotary_embedding(cfg, text.latent_size, text.hidden.device)
        return {**streams, "rotary": table.expand(text.hidden.shape[0], *table.shape)}

    def pack_prediction(self, cfg, latents):
        """(B, C, F, H, W) -> (B, F/pt * H/p * W/p, C * pt * p * p): the model's tokens before it unpatchifies."""
        b, c, f, h, w = latents.shape
        pt, p = cfg.patch_size_t, cfg.patch_size
        out = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p).permute(0, 2, 4, 6, 1, 3, 5, 7)
        return out.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)

    def unpack_prediction(self, cfg, prediction, latent_size):
        """As the end of HunyuanVideo15Transformer3DModel.forward; latent_size = (frames, height, width)."""
        (f, h, w), pt, p = latent_size, cfg.patch_size_t, cfg.patch_size
        out = prediction.reshape(prediction.shape[0], f // pt, h // p, w // p, -1, pt, p, p)
        return out.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def diffusers_forward(self, model, sample, conditions):
        cfg = model.config
        sample = pipeline_input(sample, cfg.in_channels)
        image_embeds = sample.new_zeros(len(sample), 729, cfg.image_embed_dim)  # the pipeline's text-to-video one
        out = model(hidden_states=sample, timestep=conditions["timestep"],
                    encoder_hidden_states=conditions["encoder_hidden_states"],
                    encoder_attention_mask=conditions["encoder_attention_mask"],
                    encoder_hidden_states_2=conditions["encoder_hidden_states_2"],
                    encoder_attention_mask_2=conditions["encoder_attention_mask_2"], image_embeds=image_embeds,
                    return_dict=False)[0]
        return self.pack_prediction(cfg, out)

    def reset_own_parameters(self, module):
        """diffusers' RMSNorm (the attention's query and key norms), drawn as diffusers builds it."""
        return reset_rms_norm(module)

    def folder_text_encoder(self, folder):
        return HunyuanVideo15Text.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        qwen, byt5 = text_encoder_configs(folder)[:2]
        return qwen["hidden_size"] + byt5["d_model"], 0

    def folder_text_length(self, folder):
        return QWEN_TOKENS
