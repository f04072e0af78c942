"""Built-in backbone configs (keyword arguments of diffusers' UNet2DConditionModel), random weights, no download."""
from __future__ import annotations

__all__ = ["UNET_PRESETS"]

_DIGITS = dict(
    sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
    block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8, cross_attention_dim=32,
    attention_head_dim=8,
)

_SD15 = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8,
)

_SDXL = dict(
    act_fn="silu", addition_embed_type="text_time", addition_embed_type_num_heads=64,
    addition_time_embed_dim=256, attention_head_dim=(5, 10, 20), block_out_channels=(320, 640, 1280),
    cross_attention_dim=2048, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    flip_sin_to_cos=True, freq_shift=0, in_channels=4, layers_per_block=2,
    mid_block_type="UNetMidBlock2DCrossAttn", norm_eps=1e-5, norm_num_groups=32, out_channels=4,
    projection_class_embeddings_input_dim=2816, sample_size=128, transformer_layers_per_block=(1, 2, 10),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), use_linear_projection=True,
)

UNET_PRESETS = {"digits": _DIGITS, "sd15": _SD15, "sdxl": _SDXL}
