"""Wan's attention processor with its self-attention in fp8 (train.fp8_attention, models/fp8_attention.py).

`Fp8WanAttnProcessor` is diffusers' `WanAttnProcessor` with one change: the self-attention (no text, no mask, not
split over processes) runs `attend_fp8` where diffusers' calls torch's scaled_dot_product_attention. Its steps
(projections, q/k norms, heads, the rotary table, the output projection) are diffusers' own, written again here:
neither a torch-function mode around diffusers' call (torch.compile cannot trace one through Tensor methods) nor a
replaced attention backend (diffusers' registry is private) does it without. tests/models/test_fp8_attention.py
checks that, with torch's attention in place of fp8's, it computes exactly what diffusers' processor does; the
cross-attention and any other call are diffusers' own.
"""
from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from ...fp8_attention import attend_fp8

__all__ = ["Fp8WanAttnProcessor"]


def _projections(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Self-attention's queries, keys and values (diffusers' `_get_qkv_projections`, private to it)."""
    if attn.fused_projections:
        return attn.to_qkv(x).chunk(3, dim=-1)
    return attn.to_q(x), attn.to_k(x), attn.to_v(x)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of (batch, tokens, heads, head size) (diffusers' `apply_rotary_emb` in its processor)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class Fp8WanAttnProcessor(WanAttnProcessor):
    """diffusers' Wan processor, its self-attention through `attend` (fp8's; torch's in the test of its steps)."""

    attend = staticmethod(attend_fp8)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if (encoder_hidden_states is not None or attention_mask is not None or attn.add_k_proj is not None
                or self._parallel_config is not None):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = _projections(attn, hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotated(query, *rotary_emb), _rotated(key, *rotary_emb)
        out = self.attend(*(t.transpose(1, 2) for t in (query, key, value)), attn.fp8_attention_maxima)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
