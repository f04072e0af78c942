"""Write small diffusers pipeline folders (random weights, the exact SD 1.5, SDXL, Flux, SD3 and Wan layouts), a folder
of real photographs with captions and a folder of short captioned videos, so the real-data path can be tried and
tested without downloading anything.

    python examples/make_tiny_pipeline.py                  # writes examples/tiny/{sd15,sdxl,flux,flux_kontext,chroma,sd3,...}
    python examples/make_tiny_pipeline.py --out DIR        # somewhere else
    diffpipe train examples/photos.toml                    # then fine-tune the tiny SDXL-layout pipeline on the photos
    diffpipe train examples/flux_tiny.toml                 # or the tiny Flux-layout one (sd3_tiny.toml: SD3)
    diffpipe train examples/wan_clips.toml                 # a tiny Wan-layout video model on the clips
    diffpipe train examples/qwen_image_tiny.toml           # a tiny Qwen-Image-layout model on the photos
    diffpipe train examples/flux_kontext_tiny.toml         # a tiny Flux Kontext-layout edit model on the edits
    diffpipe train examples/chroma_tiny.toml               # a tiny Chroma-layout model on the photos
    diffpipe train examples/qwen_image_edit_tiny.toml      # a tiny Qwen-Image-Edit-layout edit model on the edits
    diffpipe train examples/hunyuan_video15_tiny.toml      # a tiny HunyuanVideo 1.5-layout video model on the clips
    diffpipe train examples/flux2_klein_tiny.toml          # a tiny FLUX.2 klein-layout model on the photos

Each pipeline is built from diffusers' and transformers' own classes (UNet2DConditionModel, AutoencoderKL, CLIP text
models and a real CLIP BPE tokenizer over a small vocabulary) and written by the pipeline's `save_pretrained`, so
the folders are laid out as on the Hub: model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/ (and
text_encoder_2/, tokenizer_2/ for SDXL; transformer/, a CLIP and a T5 encoder with a real T5 unigram tokenizer for
Flux; the T5 alone for Chroma; three text encoders for SD3; for Wan its video VAE and a umT5 encoder; Wan 2.2 A14B's two experts; Wan 2.1 I2V's CLIP vision model; for
Qwen-Image a Qwen2.5-VL encoder with a real Qwen2 byte-level BPE tokenizer, and Qwen's VAE; for Qwen-Image-Edit
the same with a Qwen2VLProcessor whose vision tower reads the control picture; for HunyuanVideo 1.5 a Qwen2.5-VL text
model with a chat template, a ByT5 encoder and its 16x video VAE; for Z-Image and FLUX.2 klein a Qwen3 model with a
chat template, and FLUX.2's own VAE for klein; for LTX-2 a Gemma 3 model, the text connectors, the video and audio
VAEs and a vocoder). The photos are scikit-learn's two sample photographs (china.jpg,
flower.jpg, shipped inside the package), cut into crops of three aspect ratios, each with a same-named .txt caption;
the edits are eight of them with a grey copy of each as its control image.
The clips are coloured shapes sliding over a gradient, written as mp4 (H.264) and webm (VP9) by PyAV, captioned with
the shape, its colour and its motion; av_clips/ are such clips with a tone of the colour's pitch as their sound.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
from pathlib import Path

import torch
from diffusers import (AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan, ChromaPipeline,
                       ChromaTransformer2DModel, EulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel, PNDMScheduler,
                       QwenImagePipeline, QwenImageTransformer2DModel, SD3Transformer2DModel,
                       StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline,
                       UNet2DConditionModel, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel)
from transformers import (CLIPImageProcessor, CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModel, CLIPTextModelWithProjection, CLIPTokenizer, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLImageProcessor,
                          T5Config, T5EncoderModel, T5Tokenizer,
                          UMT5Config, UMT5EncoderModel)

__all__ = ["write_sd15", "write_sdxl", "write_flux", "write_chroma", "write_sd3", "write_wan", "write_wan22", "write_wan22_ti2v", "write_wan22_i2v",
           "write_wan21_i2v",
           "write_qwen_image", "write_hunyuan_video15", "write_z_image", "write_flux2_klein", "write_ltx2",
           "write_photos", "write_edits", "write_clips", "write_av_clips", "write_video_with_audio",
           "write_video", "fitted_vae", "CAPTION_WORDS"]

CAPTION_WORDS = ("a photo of the chinese temple flower pink yellow red roof tree sky close view wide "
                 "detail painting drawing").split()

_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  steps_offset=1)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-to-character table: every byte gets a printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def tiny_clip_tokenizer() -> CLIPTokenizer:
    """A real CLIP BPE tokenizer: every byte, every byte at a word's end, and merges that make CAPTION_WORDS single
    tokens (any other text still tokenizes, letter by letter)."""
    alphabet = list(_bytes_to_unicode().values())
    vocab = alphabet + [c + "</w>" for c in alphabet]
    merges = []
    for word in CAPTION_WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            if pieces[0] not in vocab:
                vocab.append(pieces[0])
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=list(dict.fromkeys(merges)),
                         model_max_length=77)


def tiny_t5_tokenizer() -> T5Tokenizer:
    """A real T5 (unigram) tokenizer: CAPTION_WORDS as single pieces, any other text letter by letter."""
    letters = sorted(set("".join(CAPTION_WORDS)) | set("abcdefghijklmnopqrstuvwxyz"))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    vocab += [("\u2581" + w, -1.0) for w in CAPTION_WORDS] + [(c, -5.0) for c in letters]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


# the words of QwenImagePipeline's prompt template: as single tokens, its 34 tokens before the caption are 34 here too
_QWEN_TEMPLATE_WORDS = ("system user assistant Describe the image by detailing color shape size texture quantity text "
                        "spatial relationships of objects and background").split()


# the words of QwenImageEditPipeline's template before its picture: merged into 61 pieces (with <|im_start|>, the two
# newlines and "user": 64 tokens, the pipeline's prompt_template_encode_start_idx), as Qwen's own tokenizer counts them
_QWEN_EDIT_WORDS = ("Describe key features input image color shape size texture objects background then explain how "
                    "user text instruction should alter or modify Generate new that meets requirements while "
                    "maintaining consistency with original where appropriate Picture").split()
_QWEN_EDIT_PIECES = ("(", "),", "'s", ".")


def tiny_qwen_tokenizer(vision: bool = False, extra_words: tuple[str, ...] = (), space_run: int = 1) -> Qwen2Tokenizer:
    """A real Qwen2 byte-level BPE tokenizer: every byte, merges that make CAPTION_WORDS, the prompt template's words
    and `extra_words` single tokens (with and without their leading space), runs of up to `space_run` spaces (a power
    of two) one token, and Qwen's chat tokens; with `vision` also the edit template's words and Qwen2.5-VL's picture
    tokens (<|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>)."""
    alphabet = list(_bytes_to_unicode().values())
    space = _bytes_to_unicode()[ord(" ")]
    words = [*CAPTION_WORDS, *_QWEN_TEMPLATE_WORDS, *extra_words] + ([*_QWEN_EDIT_WORDS, "the", "a"] if vision else [])
    pieces_of = [space + w for w in words] + _QWEN_TEMPLATE_WORDS + list(extra_words) + (
        [*_QWEN_EDIT_WORDS, *_QWEN_EDIT_PIECES, space + "("] if vision else [])
    vocab, merges = list(alphabet), []
    for word in pieces_of:
        pieces = list(word)
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            if pieces[0] not in vocab:
                vocab.append(pieces[0])
    run = 1
    while 2 * run <= space_run:  # ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ...: a run of spaces merged by halves
        merges.append((space * run, space * run))
        vocab.append(space * 2 * run)
        run *= 2
    chat = ["<|im_start|>", "<|im_end|>"] + (["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"] if vision else [])
    vocab = list(dict.fromkeys(vocab)) + ["<|endoftext|>"] + chat
    tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=list(dict.fromkeys(merges)))
    tokenizer.add_special_tokens({"additional_special_tokens": chat})
    return tokenizer


def _t5(tokenizer: T5Tokenizer, width: int) -> T5EncoderModel:
    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=width, d_kv=16, d_ff=2 * width, num_layers=2,
                                   num_heads=width // 16, relative_attention_num_buckets=8, pad_token_id=0,
                                   eos_token_id=1, decoder_start_token_id=0))


def _text_config(tokenizer: CLIPTokenizer, hidden: int, projection: int) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=77,
                          projection_dim=projection, hidden_act="gelu", pad_token_id=1,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def fitted_vae(steps: int = 400) -> AutoencoderKL:
    """Four levels, as SD's VAE (8x fewer pixels per side in the latents, 4 latent channels), trained for `steps` to
    reconstruct crops of the sample photos (MSE and a small KL term, as the SD VAE's objective less its GAN): random
    weights would decode any latents to coloured noise. Its scaling factor makes the latents' spread 1, as SD's."""
    import torch.nn.functional as F
    from sklearn.datasets import load_sample_images

    torch.manual_seed(0)  # its first weights: without a seed each writing drew others (0.35 and 0.43 scaling factors seen)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16, 16),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=8, sample_size=128)
    photos = torch.stack([torch.tensor(p).permute(2, 0, 1).float() / 127.5 - 1 for p in load_sample_images().images])
    photos = F.interpolate(photos, size=(128, 192), mode="area")  # about the scale the buckets train at
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(vae.parameters(), lr=2e-3)
    for _ in range(steps):
        tops, lefts = torch.randint(0, 128 - 48, (8,), generator=gen), torch.randint(0, 192 - 48, (8,), generator=gen)
        which = torch.randint(0, 2, (8,), generator=gen)
        batch = torch.stack([photos[w, :, t:t + 48, l:l + 48] for w, t, l in zip(which, tops, lefts)])
        posterior = vae.encode(batch).latent_dist
        loss = F.mse_loss(vae.decode(posterior.sample(gen)).sample, batch) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        spread = vae.encode(photos).latent_dist.mean.std().item()
    vae.register_to_config(scaling_factor=round(1 / spread, 5))
    return vae.eval()


def write_sd15(out: Path, vae: AutoencoderKL | None = None, seed: int = 0) -> Path:
    """SD 1.5 layout: one CLIP text encoder whose last hidden states the UNet attends to; epsilon prediction."""
    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer()
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    pipe = StableDiffusionPipeline(
        vae=vae or fitted_vae(), text_encoder=CLIPTextModel(_text_config(tokenizer, 32, 32)), tokenizer=tokenizer, unet=unet,
        scheduler=PNDMScheduler(**_SCHEDULER, skip_prk_steps=True), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.save_pretrained(out / "sd15", safe_serialization=True)
    return out / "sd15"


def write_sdxl(out: Path, vae: AutoencoderKL | None = None, seed: int = 0) -> Path:
    """SDXL layout: two CLIP text encoders (penultimate hidden states concatenated: 32 + 32 = the UNet's 64-wide
    cross-attention; the second's pooled projection, 32, and six time ids of 8 each feed the added embedding)."""
    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer()
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), attention_head_dim=(4, 8), cross_attention_dim=64,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8,
        use_linear_projection=True, norm_num_groups=8, flip_sin_to_cos=True, freq_shift=0)
    pipe = StableDiffusionXLPipeline(
        vae=vae or fitted_vae(), text_encoder=CLIPTextModel(_text_config(tokenizer, 32, 32)),
        text_encoder_2=CLIPTextModelWithProjection(_text_config(tokenizer, 32, 32)), tokenizer=tokenizer,
        tokenizer_2=tokenizer, unet=unet,
        scheduler=EulerDiscreteScheduler(**_SCHEDULER, timestep_spacing="leading"))
    pipe.save_pretrained(out / "sdxl", safe_serialization=True)
    return out / "sdxl"


def write_flux(out: Path, vae: AutoencoderKL | None = None, seed: int = 0, kontext: bool = False) -> Path:
    """Flux layout: a CLIP text model (pooled output, 32) and T5 (64 wide, 512 tokens); the transformer reads 4-channel
    latents packed 2x2 (16 channels), two double-stream and two single-stream blocks, guidance embedded (as dev).
    With `kontext`: FluxKontextPipeline's folder (the same components; its model_index names the edit pipeline)."""
    torch.manual_seed(seed)
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    pipe = (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae or fitted_vae(),
        text_encoder=CLIPTextModel(_text_config(clip_tokenizer, 32, 32)), tokenizer=clip_tokenizer,
        text_encoder_2=_t5(t5_tokenizer, 64), tokenizer_2=t5_tokenizer, transformer=transformer)
    folder = out / ("flux_kontext" if kontext else "flux")
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_chroma(out: Path, vae: AutoencoderKL | None = None, seed: int = 0) -> Path:
    """Chroma layout: T5 alone (64 wide, 512 tokens, read with its mask); the transformer reads Flux's packed
    4-channel latents, two double-stream and two single-stream blocks, modulated by a two-layer distilled guidance
    layer; Flux's dynamically shifted flow-matching scheduler, as Chroma1-HD's."""
    torch.manual_seed(seed)
    tokenizer = tiny_t5_tokenizer()
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=64, axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=2)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae or fitted_vae(), text_encoder=_t5(tokenizer, 64),
                          tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(out / "chroma", safe_serialization=True)
    return out / "chroma"


def write_sd3(out: Path, vae: AutoencoderKL | None = None, seed: int = 0) -> Path:
    """SD3 layout: two CLIP text models with projection (penultimate states 32 + 32, zero-padded to T5's 64; pooled
    32 + 32) and T5 (64 wide, 256 tokens); the transformer patchifies 4-channel latents 2x2, three joint blocks."""
    torch.manual_seed(seed)
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=32)
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae or fitted_vae(), transformer=transformer,
        text_encoder=CLIPTextModelWithProjection(_text_config(clip_tokenizer, 32, 32)), tokenizer=clip_tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_text_config(clip_tokenizer, 32, 32)), tokenizer_2=clip_tokenizer,
        text_encoder_3=_t5(t5_tokenizer, 64), tokenizer_3=t5_tokenizer)
    pipe.save_pretrained(out / "sd3", safe_serialization=True)
    return out / "sd3"


def write_wan(out: Path, seed: int = 0) -> Path:
    """Wan layout: a umT5 encoder (32 wide, 512 tokens, real T5 unigram tokenizer), Wan's video VAE (4 latent channels,
    8x smaller sides, a latent frame per 4 video frames; random weights, latents scaled to spread 1) and a
    two-block WanTransformer3DModel."""
    _wan_pipeline(seed).save_pretrained(out / "wan", safe_serialization=True)
    return out / "wan"


def write_wan22(out: Path, seed: int = 0) -> Path:
    """Wan 2.2 A14B's layout: Wan's (above) with a second expert, transformer_2/ (the low-noise one, its own random
    weights), and model_index.json's boundary_ratio 0.875, as WanPipeline saves Wan2.2-T2V-A14B-Diffusers."""
    _wan_pipeline(seed, two_experts=True).save_pretrained(out / "wan22", safe_serialization=True)
    return out / "wan22"


def write_wan22_i2v(out: Path, seed: int = 0) -> Path:
    """Wan 2.2 I2V-A14B's layout: Wan's (above) as WanImageToVideoPipeline saves Wan2.2-I2V-A14B-Diffusers: no image
    encoder, two experts whose transformers read 12 channels (the noisy latents' 4, the first frame's mask's 4 and
    its latents' 4; 36 at full size) and predict 4, boundary_ratio 0.9."""
    pipe = _wan_pipeline(seed)
    torch.manual_seed(seed + 7)
    high, low = (_wan_transformer(in_channels=12) for _ in range(2))
    WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, transformer=high,
                            transformer_2=low, scheduler=pipe.scheduler, boundary_ratio=0.9,
                            ).save_pretrained(out / "wan22_i2v", safe_serialization=True)
    return out / "wan22_i2v"


def write_wan21_i2v(out: Path, seed: int = 0) -> Path:
    """Wan 2.1 I2V's layout (Wan2.1-I2V-14B-480P-Diffusers): Wan's (above) as WanImageToVideoPipeline saves it with
    one transformer reading 12 channels and a CLIP vision model's penultimate states of the picture (image_encoder/:
    16 wide, 224 x 224 pixels in 14-pixel patches, 257 tokens as the release's ViT-H/14; image_processor/: CLIP's
    224-pixel resize and crop), through its `image_dim` embedder and `added_kv_proj_dim` cross-attention."""
    pipe = _wan_pipeline(seed)
    torch.manual_seed(seed + 9)
    transformer = _wan_transformer(in_channels=12, image_dim=16)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=224, patch_size=14))
    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                            transformer=transformer, scheduler=pipe.scheduler, image_encoder=image_encoder.eval(),
                            image_processor=processor).save_pretrained(out / "wan21_i2v", safe_serialization=True)
    return out / "wan21_i2v"


def write_wan22_ti2v(out: Path, seed: int = 0) -> Path:
    """Wan 2.2 TI2V-5B's layout: Wan's (above) with Wan 2.2's residual video VAE (2x2 pixel patches before its levels:
    16 pixels a latent along a side, 4 frames a latent frame; `scale_factor_spatial` 16 in its config) and
    model_index.json's expand_timesteps, as WanPipeline saves Wan2.2-TI2V-5B-Diffusers."""
    pipe = _wan_pipeline(seed)
    torch.manual_seed(seed + 5)
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                           patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 4,
                           latents_std=[1.0] * 4)
    WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=vae.eval(), transformer=pipe.transformer,
                scheduler=pipe.scheduler, expand_timesteps=True).save_pretrained(out / "wan22_ti2v",
                                                                                  safe_serialization=True)
    return out / "wan22_ti2v"


def write_qwen_image(out: Path, seed: int = 0, edit: bool = False, plus: bool = False) -> Path:
    """Qwen-Image layout: a Qwen2.5-VL model (text 32 wide, a one-block vision tower), Qwen's VAE (4 latent channels,
    8x smaller sides; random weights, latents scaled to spread 1) and a two-block QwenImageTransformer2DModel reading
    the latents packed 2x2; the scheduler as Qwen/Qwen-Image's. `edit`: Qwen-Image-Edit's layout (QwenImageEditPipeline:
    the same components and a Qwen2VLProcessor under processor/, whose vision tower reads the control picture);
    `plus`: QwenImageEditPlusPipeline's, with Qwen-Image-Edit-2511's transformer (zero_cond_t: the control's tokens
    modulated at time zero)."""
    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer(vision=edit)
    chat_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    picture = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"))} if edit else dict.fromkeys(
        ("image_token_id", "video_token_id", "vision_start_token_id"), chat_end - 2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         bos_token_id=chat_end - 2, eos_token_id=chat_end),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]), **picture))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    with torch.no_grad():  # the spread of its latents of a random image, as diffusers' configs record Qwen's
        z = vae.encode(torch.rand(1, 3, 1, 64, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1).latent_dist.mean
    vae.register_to_config(latents_mean=z.mean(dim=(0, 2, 3, 4)).tolist(), latents_std=z.std(dim=(0, 2, 3, 4)).tolist())
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6), zero_cond_t=plus)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    parts = dict(scheduler=scheduler, vae=vae.eval(), text_encoder=text_encoder, tokenizer=tokenizer,
                 transformer=transformer)
    if not edit:
        QwenImagePipeline(**parts).save_pretrained(out / "qwen_image", safe_serialization=True)
        return out / "qwen_image"
    # QwenImageEditPipeline's save_pretrained needs a Qwen2VLProcessor object, which transformers builds only beside
    # torchvision (for its video half): the folder is written as the edit pipeline writes it, processor/ by its parts
    folder = out / ("qwen_image_edit_plus" if plus else "qwen_image_edit")
    QwenImagePipeline(**parts).save_pretrained(folder, safe_serialization=True)
    # 14-pixel patches merged 2x2, as Qwen's; at most 112^2 pixels (Qwen's: 3584^2), so the pipeline's 1024^2 input
    # is 16 vision tokens, not 1,369
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}).save_pretrained(folder / "processor")
    tokenizer.save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index.update(_class_name="QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline",
                 processor=["transformers", "Qwen2VLProcessor"])
    (folder / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    return folder


def qwen3_chat_tokenizer():
    """The tiny Qwen2 BPE tokenizer carrying Qwen3's chat template: a user message, the assistant's turn opened, and
    with thinking off the empty thinking block Qwen3 writes (Z-Image's pipeline turns thinking on, FLUX.2 klein's off)."""
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
        "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    return tokenizer


def write_z_image(out: Path, vae: AutoencoderKL | None = None, seed: int = 0) -> Path:
    """Z-Image layout (ZImagePipeline, as Tongyi-MAI/Z-Image-Turbo): a Qwen3 model (32 wide, three layers: the
    pipeline reads the states second from the last) with a real Qwen2 BPE tokenizer carrying Qwen3's chat template
    (thinking on: nothing after the assistant's turn opens), the 4-channel VAE the other layouts share, and a
    ZImageTransformer2DModel of one noise and one context refiner and two main blocks reading 2 x 2 patches; the
    scheduler shifted by 3, as Turbo's."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = qwen3_chat_tokenizer()
    chat_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, rope_theta=1000000.0,
        bos_token_id=chat_end - 2, eos_token_id=chat_end))
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, qk_norm=True, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[1536, 64, 64])
    ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae or fitted_vae(),
                   text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer,
                   ).save_pretrained(out / "z_image", safe_serialization=True)
    return out / "z_image"


def write_flux2_klein(out: Path, seed: int = 0) -> Path:
    """FLUX.2 klein's layout (Flux2KleinPipeline, as black-forest-labs/FLUX.2-klein-4B): a Qwen3 causal LM (16 wide,
    four layers: the pipeline reads states of three, which diffpipe takes at a quarter, a half and three quarters of
    its depth, as 9, 18, 27 of klein's 36) with a real Qwen2 BPE tokenizer carrying Qwen3's chat template (thinking
    off), FLUX.2's VAE (4 latent channels, 8x smaller sides; its batch norm's statistics drawn, not the identity, so a
    latent left unnormalised shows) and a Flux2Transformer2DModel of one double and two single blocks reading 2 x 2
    patches (16 channels) and the three states side by side (48 wide); the scheduler shifted by 3."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = qwen3_chat_tokenizer()
    chat_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, rope_theta=1000000.0,
        bos_token_id=chat_end - 2, eos_token_id=chat_end, tie_word_embeddings=True))
    vae = AutoencoderKLFlux2(block_out_channels=(16, 16, 32, 32), latent_channels=4, norm_num_groups=8,
                             layers_per_block=1, sample_size=64)
    with torch.no_grad():  # statistics as if fitted: each of the 16 patch channels its own mean and spread
        vae.bn.running_mean.copy_(0.2 * torch.randn(16))
        vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae.eval(),
                       text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer,
                       is_distilled=True).save_pretrained(out / "flux2_klein", safe_serialization=True)
    return out / "flux2_klein"


# Mistral's chat template in the shape Mistral Small 3's has (system prompt, then the user's turn), for text given as
# a list of blocks as Flux2Pipeline gives it (pictures are [IMG], which a caption never has)
_MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- if system is defined %}{{- '[SYSTEM_PROMPT]' }}{%- if system is string %}{{- system }}"
    "{%- else %}{%- for block in system %}{{- block['text'] }}{%- endfor %}{%- endif %}{{- '[/SYSTEM_PROMPT]' }}"
    "{%- endif %}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '[/INST]' }}{%- else %}{{- message['content'] }}{{- eos_token }}{%- endif %}{%- endfor %}")


def write_flux2_dev(out: Path, seed: int = 0) -> Path:
    """FLUX.2 dev's layout (Flux2Pipeline, as black-forest-labs/FLUX.2-dev): a Mistral 3 model (its text model 16 wide,
    four layers: the pipeline reads states of three, 10, 20, 30 of the release's 40, which diffpipe takes at a quarter,
    a half and three quarters of its depth; a one-layer Pixtral tower it never uses for text) and its tokenizer folder
    as the release's processor keeps it (the tiny Qwen2 BPE with Mistral's special tokens, a Mistral-style chat
    template in chat_template.jinja, processor_config.json naming PixtralProcessor, which model_index.json names too);
    FLUX.2's VAE and a Flux2Transformer2DModel with the guidance embedding dev has, reading the three states side by
    side (48 wide). PixtralProcessor itself needs torchvision, which this project does not install: the folder is
    written by hand around the components' own save_pretrained."""
    import json

    import diffusers
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    torch.manual_seed(seed)
    folder = out / "flux2_dev"
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                                  "additional_special_tokens": ["[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                                                "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tokenizer.save_pretrained(folder / "tokenizer")
    (folder / "tokenizer" / "chat_template.jinja").write_text(_MISTRAL_TEMPLATE)
    (folder / "tokenizer" / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
         "image_end_token": "[IMG_END]", "patch_size": 16, "spatial_merge_size": 2}, indent=2))
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=MistralConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=2048, rope_theta=1000000.0,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id),
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=8, image_size=64, patch_size=16),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2))
    text_encoder.eval().save_pretrained(folder / "text_encoder", safe_serialization=True)
    vae = AutoencoderKLFlux2(block_out_channels=(16, 16, 32, 32), latent_channels=4, norm_num_groups=8,
                             layers_per_block=1, sample_size=64)
    with torch.no_grad():  # statistics as if fitted, as klein's
        vae.bn.running_mean.copy_(0.2 * torch.randn(16))
        vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    vae.eval().save_pretrained(folder / "vae", safe_serialization=True)
    Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True,
    ).save_pretrained(folder / "transformer", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "Flux2Pipeline", "_diffusers_version": diffusers.__version__,
         "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers",
         "Mistral3ForConditionalGeneration"], "tokenizer": ["transformers", "PixtralProcessor"],
         "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]},
        indent=2))
    return folder


def write_ltx2(out: Path, seed: int = 0) -> Path:
    """LTX-2's layout (LTX2Pipeline, as Lightricks/LTX-2): a Gemma 3 model (16 wide, two layers, a one-layer SigLIP
    tower it never uses for text) with the tiny Qwen2 BPE tokenizer, the pipeline's text connectors (one layer a
    stream, 8 learned registers: the release's 128 make their mask all ones, as these do), the video VAE (8 latent
    channels, 8x smaller sides, a latent frame per 4 frames after the first, as stated in its config) and the audio VAE
    (stereo 16-bin mel spectrograms, 2 latent channels, 4x fewer frames and bins: audio tokens 2 x 4 = 8 wide, as the
    video's), a vocoder, and a two-block LTX2VideoTransformer3DModel reading 8-channel tokens of both."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer()
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     max_position_embeddings=2048, sliding_window=16),
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4))
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 16), down_block_types=("LTX2VideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 16), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False), downsample_type=("spatiotemporal",) * 2,
        upsample_type=("spatiotemporal",) * 2, upsample_residual=(False, False), upsample_factor=(1, 1),
        patch_size=2, spatial_compression_ratio=8, temporal_compression_ratio=4)
    with torch.no_grad():  # statistics as if fitted: a latent left unnormalised shows
        vae.latents_mean.copy_(0.1 * torch.randn(8))
        vae.latents_std.copy_(torch.rand(8) + 0.5)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1, resolution=32,
                                       latent_channels=2, mel_bins=16)
    with torch.no_grad():
        audio_vae.latents_mean.copy_(0.1 * torch.randn(8))
        audio_vae.latents_std.copy_(torch.rand(8) + 0.5)
    vocoder = LTX2Vocoder(in_channels=2 * 16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        vae_scale_factors=(4, 8, 8), audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2,
        audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2, caption_channels=16)
    LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), audio_vae=audio_vae.eval(),
                 text_encoder=text_encoder.eval(), tokenizer=tokenizer, connectors=connectors.eval(),
                 transformer=transformer, vocoder=vocoder.eval()).save_pretrained(out / "ltx2",
                                                                                  safe_serialization=True)
    return out / "ltx2"


def write_hunyuan_video15(out: Path, seed: int = 0) -> Path:
    """HunyuanVideo 1.5's layout (HunyuanVideo15Pipeline, as hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v): a
    Qwen2.5-VL text model (32 wide, three layers: the pipeline reads the states three from the last) with a real Qwen2
    BPE tokenizer carrying a chat template (the system message 108 tokens, as Qwen's own tokenizer counts it and the
    pipeline drops), a ByT5 encoder (16 wide, ByT5's byte tokenizer) for quoted text, the 16x video VAE (4 latent
    channels, a latent frame per 4 video frames; random weights, latents scaled to spread 1) and a two-block
    HunyuanVideo15Transformer3DModel reading 2 x 4 + 1 channels; the scheduler shifted by 5, classifier-free guidance."""
    import re

    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(seed)
    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    tokenizer = tiny_qwen_tokenizer(extra_words=tuple(dict.fromkeys(re.findall(r"[A-Za-z]+", system))), space_run=8)
    tokenizer.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=chat_end - 2, eos_token_id=chat_end))
    glyph_tokenizer = ByT5Tokenizer()
    glyph_encoder = T5EncoderModel(T5Config(vocab_size=len(glyph_tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                            num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                            eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 16, 16, 16, 16), layers_per_block=1)
    with torch.no_grad():  # latents of a random clip scaled to spread 1, as the release's scaling_factor does
        z = vae.encode(torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1).latent_dist.mean
    vae.register_to_config(scaling_factor=1.0 / z.std().item())
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
        mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
        target_size=64, task_type="t2v")
    HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae.eval(),
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=glyph_encoder,
                           tokenizer_2=glyph_tokenizer, guider=ClassifierFreeGuidance(guidance_scale=6.0),
                           ).save_pretrained(out / "hunyuan_video15", safe_serialization=True)
    return out / "hunyuan_video15"


def _wan_transformer(in_channels: int = 4, image_dim: int | None = None) -> WanTransformer3DModel:
    """`image_dim`: Wan 2.1 I2V's, reading a CLIP embedding of that width (its added key/value projections take the
    embedder's output, the transformer's width)."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=in_channels, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=64, image_dim=image_dim, added_kv_proj_dim=32 if image_dim else None)


def _wan_pipeline(seed: int, two_experts: bool = False) -> WanPipeline:
    torch.manual_seed(seed)
    tokenizer = tiny_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    with torch.no_grad():  # the spread of its latents of a random clip, as diffusers' configs record Wan's
        z = vae.encode(torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1).latent_dist.mean
    vae.register_to_config(latents_mean=z.mean(dim=(0, 2, 3, 4)).tolist(), latents_std=z.std(dim=(0, 2, 3, 4)).tolist())
    high = _wan_transformer()
    experts = dict(transformer_2=_wan_transformer(), boundary_ratio=0.875) if two_experts else {}
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae.eval(), transformer=high,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **experts)


def write_video(path: Path, frames: list, fps: int = 8) -> Path:
    """RGB frames (uint8 arrays, height x width x 3, even sides) as a video: H.264 in .mp4, VP9 in .webm."""
    import av

    codec = {".mp4": "libx264", ".webm": "libvpx-vp9"}[path.suffix]
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())  # flush
    return path


_COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
_MOTIONS = {"left": (0, -2), "right": (0, 2), "up": (-2, 0), "down": (2, 0)}  # (rows, columns) a frame


def _shape_frames(shape: str, colour: str, motion: str, frames: int, size: tuple[int, int]) -> list:
    import numpy as np

    height, width = size
    rows, cols = np.mgrid[0:height, 0:width]
    background = np.stack([40 + 120 * rows / height, 90 + 60 * cols / width, 160 + 0 * rows], -1)
    (dy, dx), side = _MOTIONS[motion], min(height, width) // 4
    clip = []
    for f in range(frames):
        top, left = (height // 2 + dy * (f - frames // 2)) % height, (width // 2 + dx * (f - frames // 2)) % width
        if shape == "square":
            inside = (abs(rows - top) <= side // 2) & (abs(cols - left) <= side // 2)
        else:
            inside = (rows - top) ** 2 + (cols - left) ** 2 <= (side // 2) ** 2
        clip.append(np.where(inside[..., None], _COLOURS[colour], background).astype(np.uint8))
    return clip


def write_clips(out: Path) -> Path:
    """Twelve captioned videos of a square or disc sliding left, right, up or down (landscape 64x48 and portrait
    48x64, 24 to 40 frames; eleven mp4, one webm) and one still image."""
    from PIL import Image

    folder = out / "clips"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(12):
        shape, colour, motion = ("square", "disc")[i % 2], list(_COLOURS)[i % 3], list(_MOTIONS)[i % 4]
        size = (48, 64) if i % 3 else (64, 48)
        frames = _shape_frames(shape, colour, motion, 24 + 4 * (i % 5), size)
        name = f"{colour}_{shape}_{motion}_{i}"
        write_video(folder / f"{name}{'.webm' if i == 5 else '.mp4'}", frames)
        (folder / f"{name}.txt").write_text(f"a {colour} {shape} moving {motion}\n")
    Image.fromarray(_shape_frames("disc", "blue", "left", 1, (48, 64))[0]).save(folder / "still_blue_disc.png")
    (folder / "still_blue_disc.txt").write_text("a blue disc\n")
    return folder


def write_video_with_audio(path: Path, frames: list, fps: int, audio, rate: int = 48000) -> Path:
    """RGB frames as H.264 and a stereo waveform (2, samples) of floats in [-1, 1] as AAC, in one .mp4."""
    import av
    import numpy as np

    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.height, video.width = frames[0].shape[:2]
        video.pix_fmt = "yuv420p"
        sound = container.add_stream("aac", rate=rate, layout="stereo")
        for pixels in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        step = sound.codec_context.frame_size or 1024
        for start in range(0, audio.shape[1], step):
            chunk = np.ascontiguousarray(audio[:, start:start + step], dtype=np.float32)
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = rate, start
            container.mux(sound.encode(frame))
        container.mux(sound.encode())
    return path


_PITCHES = {"red": 330.0, "blue": 550.0, "yellow": 880.0}  # Hz: each colour sounds its own tone


def write_av_clips(out: Path) -> Path:
    """Eight captioned clips with their sound (LTX-2's data): 24 frames a second, 64x48 or 48x64, 17 to 25 frames,
    a shape sliding as in clips/ while a tone of its colour's pitch sounds, louder on the side it moves to (stereo
    AAC at 48 kHz, a little longer than the video); one at 8 frames a second (read at 24: each frame shown three
    times); and two that LTX-2 cannot use: one at 30 frames a second too short at 24 (17 frames: 14 at 24, fewer
    than the tiny example's 17), one without sound."""
    import numpy as np

    folder = out / "av_clips"
    folder.mkdir(parents=True, exist_ok=True)

    def tone(colour: str, motion: str, seconds: float):
        t = np.arange(int((seconds + 0.2) * 48000)) / 48000
        wave = 0.3 * np.sin(2 * np.pi * _PITCHES[colour] * t)
        left = {"left": 1.0, "right": 0.3}.get(motion, 0.7)
        return np.stack([left * wave, (1.3 - left) * wave])

    for i in range(8):
        shape, colour, motion = ("square", "disc")[i % 2], list(_COLOURS)[i % 3], list(_MOTIONS)[i % 4]
        count = 17 + 4 * (i % 3)
        frames = _shape_frames(shape, colour, motion, count, (48, 64) if i % 3 else (64, 48))
        name = f"{colour}_{shape}_{motion}_{i}"
        write_video_with_audio(folder / f"{name}.mp4", frames, 24, tone(colour, motion, count / 24))
        (folder / f"{name}.txt").write_text(f"a {colour} {shape} moving {motion}, a {colour} tone\n")
    for name, (shape, colour, motion), count, fps in (("slow_red_disc", ("disc", "red", "left"), 8, 8),
                                                       ("quick_yellow_square", ("square", "yellow", "right"), 17, 30)):
        frames = _shape_frames(shape, colour, motion, count, (48, 64))
        write_video_with_audio(folder / f"{name}.mp4", frames, fps, tone(colour, motion, count / fps))
        (folder / f"{name}.txt").write_text(f"a {colour} {shape} moving {motion}, a {colour} tone\n")
    write_video(folder / "silent_blue_square.mp4", _shape_frames("square", "blue", "up", 17, (48, 64)), fps=24)
    (folder / "silent_blue_square.txt").write_text("a blue square moving up\n")
    return folder


# (photo, caption, crops as (left, top, width, height) in the 640x427 photo): landscape, portrait and square crops
_CROPS = {
    "china": ("a photo of the chinese temple", [
        (0, 0, 640, 427), (100, 40, 480, 320), (0, 100, 420, 280), (200, 0, 420, 300),
        (60, 0, 280, 420), (300, 20, 260, 390), (150, 60, 300, 300), (380, 150, 250, 250)]),
    "flower": ("a close photo of a pink flower", [
        (0, 0, 640, 427), (120, 60, 450, 300), (40, 120, 420, 290), (220, 0, 400, 270),
        (200, 0, 280, 420), (330, 30, 250, 380), (180, 80, 300, 300), (0, 0, 260, 260)]),
}


def write_photos(out: Path) -> Path:
    """scikit-learn's two sample photographs cut into 16 crops (landscape, portrait, square) with .txt captions."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    folder = out / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    for path, pixels in zip(photos.filenames, photos.images):
        name = Path(path).stem
        caption, crops = _CROPS[name]
        image = Image.fromarray(pixels)
        for i, (left, top, width, height) in enumerate(crops):
            image.crop((left, top, left + width, top + height)).save(folder / f"{name}_{i}.jpg", quality=92)
            (folder / f"{name}_{i}.txt").write_text(caption + "\n")
    return folder


def write_edits(out: Path) -> Path:
    """An edit dataset (data.control_path): eight of the photos' crops (three shapes) in colour under `pictures/` with their
    captions, and each as a grey photograph of the same size and name under `controls/`: the edit colours it in."""
    from PIL import Image, ImageOps
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    folder = out / "edits"
    for part in ("pictures", "controls"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    for path, pixels in zip(photos.filenames, photos.images):
        name = Path(path).stem
        caption, crops = _CROPS[name]
        image = Image.fromarray(pixels)
        for i in (0, 1, 4, 6):  # landscape, landscape, upright, square
            left, top, width, height = crops[i]
            picture = image.crop((left, top, left + width, top + height))
            picture.save(folder / "pictures" / f"{name}_{i}.jpg", quality=92)
            (folder / "pictures" / f"{name}_{i}.txt").write_text(caption + "\n")
            ImageOps.grayscale(picture).convert("RGB").save(folder / "controls" / f"{name}_{i}.png")
    return folder


STAMP = "made-by.txt"  # the sha256 of the script that wrote a folder whole (the tests reuse such a folder)


def _this_script() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def made_by_this_script(out: Path) -> bool:
    """Whether `out` was written whole by this version of the script."""
    stamp = out / STAMP
    return stamp.is_file() and stamp.read_text().strip() == _this_script()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "tiny"), help="folder to write into")
    args = parser.parse_args()
    out = Path(args.out)
    (out / STAMP).unlink(missing_ok=True)  # written again last: a run cut short leaves no stamp
    vae = fitted_vae()  # one VAE for every layout: they differ in the backbone and text encoders
    for path in (write_sd15(out, vae), write_sdxl(out, vae), write_flux(out, vae), write_flux(out, vae, kontext=True),
                 write_chroma(out, vae),
                 write_sd3(out, vae), write_wan(out), write_wan22(out), write_wan22_i2v(out), write_wan22_ti2v(out),
                 write_wan21_i2v(out),
                 write_qwen_image(out),
                 write_qwen_image(out, edit=True), write_qwen_image(out, edit=True, plus=True),
                 write_hunyuan_video15(out), write_z_image(out, vae), write_flux2_klein(out), write_flux2_dev(out), write_ltx2(out), write_photos(out),
                 write_edits(out), write_clips(out), write_av_clips(out)):
        print(f"wrote {path}")
    (out / STAMP).write_text(_this_script() + "\n")


if __name__ == "__main__":
    main()
