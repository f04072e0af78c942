"""Attention's exchanges among the processes that share each sample's tokens (pipeline/sequence.py): what they carry,
and diffpipe's own exchange where the degree does not divide the heads.

What diffusers' Ulysses moves is counted where attention is computed (`AttentionBytes`, a torch function mode around
an attention processor): every scaled_dot_product_attention call after its all-to-alls sees every token with this
process's heads, and its queries, keys, values and output are what the all-to-alls carried one way
(`exchanged_bytes`, also the planner's count: planner/costs.py).

diffusers' Ulysses needs the heads to divide by the degree N. Where they do not (Wan 14B's 40 over 16), an attention
keeps no parallel config, so it attends as if alone on this process's tokens, and `PaddedHeads` takes over its
scaled_dot_product_attention call: queries, keys and values are padded with zero heads to the next multiple of N,
exchanged from token shares to head shares (an all-to-all whose gradient goes back by the inverse one), attended over
every token, exchanged back, and the pad heads dropped. A zero head's output is dropped and nothing flows back into
it, so the result and its gradients are the unsplit attention's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["exchanged_bytes", "heads_padded", "AttentionBytes", "PaddedHeads"]


def heads_padded(heads: int | None, degree: int) -> int | None:
    """The heads an attention of `heads` attends with when split over `degree` processes that do not divide them
    (the next multiple of the degree); None where they divide (or are unknown)."""
    if not heads or heads % degree == 0:
        return None
    return -(-heads // degree) * degree


def exchanged_bytes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """What the all-to-alls of an attention split over a sample's processes carry, one way: its queries, keys, values
    and output (as large as its queries), in the layout attention sees them in; the planner's count and the run's."""
    return sum(t.numel() * t.element_size() for t in (query, key, value)) + query.numel() * query.element_size()


class AttentionBytes(TorchFunctionMode):
    """Within: the `exchanged_bytes` of every scaled_dot_product_attention called (diffusers' Ulysses calls it after
    its all-to-alls, on every token and this process's heads), summed in `bytes`."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(("query", "key", "value"), args), **kwargs)
            self.bytes += exchanged_bytes(named["query"], named["key"], named["value"])
        return func(*args, **kwargs)


class PaddedHeads(TorchFunctionMode):
    """Within: every scaled_dot_product_attention called on this process's share of the tokens, with all of its heads
    (B, H, S/N, D), is computed as Ulysses computes it, the heads padded with zero heads to a multiple of N: each
    process attends over every token with its share of the heads, and the outputs are exchanged back. A key mask laid
    out along this process's keys is gathered from every process. The exchanged bytes are summed in `bytes`."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        super().__init__()
        self.group, self.size, self.bytes = group, size, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args), **kwargs)
        query, key, value = named.pop("query"), named.pop("key"), named.pop("value")
        heads = query.shape[1]
        if key.shape[1] != heads or key.shape[2] != query.shape[2]:
            raise NotImplementedError("padded heads for an attention whose keys have other heads or other tokens")
        pad = (0, 0, 0, 0, 0, heads_padded(heads, self.size) - heads)
        query, key, value = (_Exchanged.apply(torch.nn.functional.pad(t, pad), self.group, True)
                             for t in (query, key, value))
        if named.get("attn_mask") is not None:
            named["attn_mask"] = self._gathered(named["attn_mask"])
        self.bytes += exchanged_bytes(query, key, value)
        out = func(query, key, value, **named)
        return _Exchanged.apply(out, self.group, False)[:, :heads]

    def _gathered(self, mask: torch.Tensor) -> torch.Tensor:
        """A mask laid out along this process's keys, laid out along every process's (in the order of the shares)."""
        parts = [torch.empty_like(mask) for _ in range(self.size)]
        dist.all_gather(parts, mask.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _heads_for_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, S/N, D), this process's tokens with every head -> (B, H/N, S, D), its share of the heads over every
    token (the shares in order): head group j goes to process j."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    given = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    taken = torch.empty_like(given)
    dist.all_to_all_single(taken, given, group=group)
    return taken.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _tokens_for_heads(y: torch.Tensor, group) -> torch.Tensor:
    """The way back: (B, H/N, S, D) -> (B, H, S/N, D); share j of the tokens goes to process j."""
    n = dist.get_world_size(group)
    b, h, s, d = y.shape
    given = y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    taken = torch.empty_like(given)
    dist.all_to_all_single(taken, given, group=group)
    return taken.transpose(0, 1).reshape(b, n * h, s // n, d)


class _Exchanged(torch.autograd.Function):
    """`_heads_for_tokens` (`to_heads`) or `_tokens_for_heads`, whose gradient goes back by the other."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_heads_for_tokens if to_heads else _tokens_for_heads)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_tokens_for_heads if ctx.to_heads else _heads_for_tokens)(grad, ctx.group), None, None
