"""LTX-2 transformer weights in Lightricks' release layout (`ltx-2-19b-dev.safetensors`, what ComfyUI loads:
`model.diffusion_model.patchify_proj.weight`, `...adaln_single.emb...`, `...transformer_blocks.0.attn1.q_norm.weight`,
with the VAEs, the vocoder and the text connectors beside them under their own names) and diffusers' layout.

Reading keeps the transformer's weights (those under `model.diffusion_model.` where a file holds more than the
transformer) and goes through diffusers' own converter (`convert_ltx2_transformer_to_diffusers`, what
`from_single_file` uses), which drops the text connectors' weights (diffpipe reads them from the pipeline folder of
`model.components`). Writing is its inverse, the transformer alone, without a prefix. A test round-trips every tensor
through diffusers' reader. LTX-2.0's layout; LTX-2.3's files are not read yet.
"""
from __future__ import annotations

import torch

from ...family import ReleaseLayout, unprefixed

__all__ = ["LIGHTRICKS", "ltx2_from_release", "ltx2_to_release", "release_name"]

_PREFIX = "model.diffusion_model."
# diffusers' name -> the release's, for parts of a name (diffusers' converter maps them the other way)
_RENAMED = (("audio_proj_in", "audio_patchify_proj"), ("proj_in", "patchify_proj"),
            ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
            ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
            ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
            ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
            ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
            ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
            (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm."))
_TOP = (("audio_time_embed.", "audio_adaln_single."), ("time_embed.", "adaln_single."))


def ltx2_from_release(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release's transformer weights under diffusers' names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    if any(k.startswith(_PREFIX) for k in weights):  # a whole release: the transformer's part
        weights = {k: v for k, v in weights.items() if k.startswith(_PREFIX)}
    return convert_ltx2_transformer_to_diffusers({unprefixed(k): v for k, v in weights.items()})


def release_name(key: str) -> str:
    """A diffusers LTX-2 transformer weight's (or layer's) name in the release."""
    for ours, theirs in _TOP:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    for ours, theirs in _RENAMED:
        if ours in key:
            return key.replace(ours, theirs)
    return key


def ltx2_to_release(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' LTX-2 transformer weights under the release's names (no prefix)."""
    return {release_name(key): value for key, value in weights.items()}


LIGHTRICKS = ReleaseLayout(
    name="LTX-2 (Lightricks' release)",
    recognises=lambda keys: any(unprefixed(k).startswith("patchify_proj.") for k in keys),
    to_diffusers=lambda weights, config: ltx2_from_release(weights),
    from_diffusers=lambda weights, config: ltx2_to_release(weights))
