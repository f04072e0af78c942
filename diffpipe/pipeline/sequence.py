"""Sequence parallelism: every sample's tokens split over `pipeline.sequence_parallel` processes inside each stage.

The unit that first writes a token stream (a DiT's embedding: the video tokens and their rotary table) keeps only
this process's contiguous share of the tokens; every later unit computes on that share, stage boundaries carry it
(no gather at a boundary), and the loss is this share's mean against the same share of the target. Attention is
the one place tokens meet: there DeepSpeed-Ulysses exchanges token shards for head shards (an all-to-all), attends
over every token with heads/N, and exchanges back, as diffusers' own context-parallel attention does
(`TemplatedUlyssesAttention`, forward and backward). Text, timesteps and their embeddings stay whole on every
process, and a cross-attention (Wan's) attends from this process's queries to the whole text directly, as
diffusers' processors leave it; where every attention joins text and picture tokens (Flux, HunyuanVideo 1.5) the
text splits too, since N whole copies of its keys among the gathered ones would weigh them N times.

Gradients: each process's loss is the mean over its equal share, so the average over the shares is the unsplit
model's loss, and averaging gradients over them gives the unsplit model's gradients, exactly as data parallelism
averages over samples. With data-parallel replicas too, torch's data parallelism averages over all of them (the
stage's replicas: pipeline/data_parallel.py); with none, `average_over_shares` does, after the step's backward,
without wrapping the modules, so block swap (which moves frozen weights during the step) works beside it.

Every such attention counts the bytes of its queries, keys, values and output as the exchanged attention sees them
(exchange.py's `exchanged_bytes`: what the all-to-alls carry, in forward, again in backward and in any recomputation); the runner
reads them after each step (`SequenceShards.take_exchanged_bytes`) and the observer turns them into the all-to-all
time of the step at the rate measured when the run starts (observe/observer.py: `probe_all_to_all`).

Picture tokens that the degree does not divide (a clip of 21 x 30 x 30 tokens over 8 processes): where the family
allows it (`ModelFamily.sequence_pads`), the picture's stream is padded with zeros at its end to the next multiple,
so that the last shares hold pad tokens; every attention the shares reach masks the pad out of its keys (a key mask
laid out as the process's keys are, which diffusers' Ulysses gathers with the keys), and the loss leaves the pad out
and counts only the picture's own tokens (`SequenceShards.kept`, read by the runner). The runner says each step's
picture token count (`SequenceShards.picture_tokens`), since a bucket's count is known only when its batch comes.

Heads that the degree does not divide (Wan 14B's 40 over 16 processes) are padded with zero heads and exchanged by
diffpipe's own all-to-alls (pipeline/exchange.py: `PaddedHeads`), since diffusers' Ulysses needs them to divide; the
result is the unsplit attention's, at the pad's share of attention's compute and all-to-alls more (planned so).

What a family must give: `ModelFamily.sequence_streams`, the names of its token streams and the dimension their
tokens lie along; attention processors that read diffusers' parallel config. A family without them is refused
(`sequence_refusal`), as are token counts the degree does not divide where the family does not pad them.
"""
from __future__ import annotations

import functools
import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..models.tokens import TEXT_LENGTHS
from ..models.units import Backbone
from .exchange import AttentionBytes, PaddedHeads, heads_padded

__all__ = ["SequenceShards", "split_sequence", "sequence_refusal", "sequence_problem", "tokens_problem",
           "sample_tokens", "attend_across_shards", "average_over_shares"]

_BUCKET_ELEMENTS = 16 * 2**20  # gradients averaged 64 MB of fp32 at a time


class _StepState:
    """The step under way: the picture tokens of one sample, before padding (None between steps), and the bytes this
    process's attentions gave their all-to-alls since they were last taken."""

    def __init__(self):
        self.count: int | None = None
        self.exchanged_bytes = 0


@dataclass(frozen=True)
class SequenceShards:
    """This process's share of every sample's tokens: share `rank` of `size` equal, contiguous shares. With `pads`,
    a stream the size does not divide is padded with zeros at its end first (the family masks the pad)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None = None  # the processes of one sample (all its shares)
    pads: bool = False
    step: _StepState = field(default_factory=_StepState, compare=False, repr=False)

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This process's share along `dim` (a view, or of the padded tensor; its gradient flows back into the
        share's place)."""
        tokens = tensor.shape[dim]
        if tokens % self.size:
            if not self.pads:
                raise ConfigError(f"pipeline.sequence_parallel = {self.size} splits each sample's tokens into equal "
                                  f"shares, and this batch has {tokens} tokens a sample: choose a degree that divides "
                                  f"{tokens}, or latent sizes/frames whose token count it divides")
            pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, self.padded(tokens) - tokens]
            tensor = torch.nn.functional.pad(tensor, pad)
        per = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * per, per)

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every share of `tensor` along `dim`, in order (no gradient: for outputs read after a forward); the pad
        of the step's picture tokens left out where `tensor` is in the picture's token layout."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        whole = torch.cat(parts, dim=dim)
        count = self.step.count
        return whole.narrow(dim, 0, count) if count is not None and whole.shape[dim] == self.padded(count) else whole

    def take_exchanged_bytes(self) -> int:
        """The bytes this process's attentions gave their all-to-alls since the last call (forward, backward and any
        recomputation); counting starts again at 0."""
        taken, self.step.exchanged_bytes = self.step.exchanged_bytes, 0
        return taken

    def padded(self, tokens: int) -> int:
        """`tokens` rounded up to a multiple of the size: the length of a padded stream."""
        return -(-tokens // self.size) * self.size

    @contextmanager
    def picture_tokens(self, count: int):
        """Within: every sample's picture has `count` tokens before padding (the runner says it around each step,
        so that the attentions and the loss know which of their tokens are pad)."""
        before, self.step.count = self.step.count, count
        try:
            yield
        finally:
            self.step.count = before

    @property
    def padding(self) -> bool:
        """Whether the step under way pads its picture tokens."""
        return self.step.count is not None and self.step.count % self.size != 0

    def kept(self, device: torch.device) -> torch.Tensor:
        """Which of this process's share of the step's picture tokens are the picture's own (True) rather than pad."""
        share = self.padded(self.step.count) // self.size
        start = self.rank * share
        return torch.arange(start, start + share, device=device) < self.step.count


class _Shares(nn.Module):
    """A unit's module whose outputs named in `streams` keep only this process's share of their tokens. A stream
    given as (dim, parts) is the named parts' tokens joined along `dim` (Flux's rotary table: the text's positions,
    then the image's); each part keeps its own share, so the table's rows stay those of the tokens kept."""

    def __init__(self, inner: nn.Module, streams: dict, shards: SequenceShards):
        super().__init__()
        self.inner, self.streams, self.shards = inner, streams, shards

    def forward(self, **named: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.inner(**named)
        return {name: self._share(out, named, name) if name in self.streams else t for name, t in out.items()}

    def _share(self, out: dict[str, torch.Tensor], named: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        spec = self.streams[name]
        if isinstance(spec, int):  # a copy: a view would keep the whole stream's storage alive (Wan 14B at 720p:
            return self.shards.shard(out[name], spec).clone()  # 0.72 GiB a process, measured on an H100)
        dim, parts = spec  # each part's length from the unit's outputs, or its inputs (along the same dimension)
        lengths = [(out[part] if part in out else named[part]).shape[dim] for part in parts]
        return torch.cat([self.shards.shard(piece, dim) for piece in out[name].split(lengths, dim=dim)], dim=dim)


class _SharedReads(nn.Module):
    """A unit's module given only this process's share of the conditions named in `streams` (tables and masks laid
    out along the tokens, which the stage receives whole, as every stage does)."""

    def __init__(self, inner: nn.Module, streams: dict[str, int], shards: SequenceShards):
        super().__init__()
        self.inner, self.streams, self.shards = inner, streams, shards

    def forward(self, **named: torch.Tensor) -> dict[str, torch.Tensor]:
        shared = {name: self.shards.shard(t, self.streams[name]) if name in self.streams and t.shape[self.streams[name]]
                  else t for name, t in named.items()}  # an empty mask (nothing masked) stays empty
        return self.inner(**shared)


def split_sequence(backbone: Backbone, streams: dict, shards: SequenceShards,
                   conditions: dict[str, int] | None = None) -> Backbone:
    """The backbone with each token stream cut to this process's share where it is first written (a unit writing
    it without reading it), and the `conditions` laid out along the tokens (name: dimension) cut to it where a unit
    after those reads them; the units' modules and parameters are the same objects."""
    units, started = [], set()
    for unit in backbone.units:
        starts = {name: dim for name, dim in streams.items()
                  if name in unit.writes and name not in unit.reads and name not in started}
        read = {name: dim for name, dim in (conditions or {}).items() if name in unit.reads} if started else {}
        started.update(starts)
        module = _SharedReads(unit.module, read, shards) if read else unit.module
        units.append(replace(unit, module=_Shares(module, starts, shards)) if starts else replace(unit, module=module))
    missing = sorted(set(streams) - started)
    if missing:
        raise RuntimeError(f"no unit of the backbone writes the token stream(s) {missing} before reading them")
    return replace(backbone, units=units)


def sequence_refusal(backbone: Backbone, degree: int) -> str | None:
    """Why the backbone cannot split its tokens over `degree` processes, in a line; None if it can."""
    family, model = backbone.family, backbone.model
    if degree == 1:
        return None
    why = family.sequence_refusal_for(model)
    if why is not None:
        return (f"pipeline.sequence_parallel = {degree}: the {family.name} family cannot split a sample's tokens "
                f"({why}); set pipeline.sequence_parallel = 1 and split the model with pipeline.stages instead")
    unsplittable = sorted({type(_processor(m)).__name__ for m in _shared_attentions(backbone)
                           if not hasattr(_processor(m), "_parallel_config")})
    if unsplittable:
        return (f"pipeline.sequence_parallel = {degree}: {', '.join(unsplittable)} (this model's attention) cannot "
                "attend across token shares; set pipeline.sequence_parallel = 1")
    return None


def sample_tokens(backbone: Backbone, shape: tuple[int, ...], text_tokens: int) -> dict[str, int] | None:
    """What of one sample must divide into equal shares, by kind (`ModelFamily.split_token_counts` of latents
    `shape`, channels first: "picture tokens"; and "text tokens", `text_tokens`, where the family splits its text
    stream too); None for a family that cannot split them."""
    family, model = backbone.family, backbone.model
    if family.sequence_refusal_for(model) is not None:
        return None
    counts = family.split_token_counts(model.config, shape)
    if family.sequence_text_stream in family.sequence_streams:
        # a family that cuts each batch's text to TEXT_LENGTHS: every cut is a multiple of their divisor
        counts["text tokens"] = math.gcd(*TEXT_LENGTHS) if family.reads_text_lengths else text_tokens
    return counts


def sequence_problem(backbone: Backbone, degree: int, tokens: dict[str, int] | None) -> str | None:
    """`sequence_refusal`, then `tokens_problem`; None if the backbone can split."""
    return sequence_refusal(backbone, degree) or (tokens_problem(backbone, degree, tokens) if degree > 1 else None)


def tokens_problem(backbone: Backbone, degree: int, tokens: dict[str, int]) -> str | None:
    """Whether each kind of a sample's `tokens` divides into `degree` equal shares (picture tokens the family pads:
    whether there are at least as many as shares); None if it does."""
    padded = ("picture tokens",) if backbone.family.sequence_pads else ()
    for kind, count in tokens.items():
        if kind in padded:
            if count < degree:
                return (f"pipeline.sequence_parallel = {degree} splits each sample's {count} {kind} over {degree} "
                        f"processes: more processes than tokens; choose a degree of at most {count}")
            continue
        if count % degree:
            fix = ("model.text_max_length a multiple of it" if kind == "text tokens"
                   else "a latent size and frame count whose tokens it divides")
            return (f"pipeline.sequence_parallel = {degree} splits each sample's {count} {kind} into equal "
                    f"shares: choose a degree that divides {count}, or {fix}")
    return None


def attend_across_shards(backbone: Backbone, mesh, device: torch.device, shards: SequenceShards) -> None:
    """Every attention that the token shares reach (those of the units after the one that cuts them: not, say, a
    text refiner inside the embedding) attends over all shares (Ulysses all-to-alls over the mesh's "ulysses"
    dimension). diffusers' own `enable_parallelism` would do this but cannot run on the CPU (it divides by the
    accelerator count, 0 there) and also adds hooks that split and gather at its own places, which the units do
    here; so its parallel config is set up on our mesh and handed to each such attention's processor, the one
    attribute `enable_parallelism` sets on them. Each processor is wrapped to count what its all-to-alls carry and,
    where the shares may pad, to mask the pad (`_SharedAttention`)."""
    from diffusers import ContextParallelConfig, ParallelConfig

    size = mesh["ulysses"].size()
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=size, mesh=mesh))
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    family = backbone.family
    joins_text = family.sequence_text_stream in family.sequence_streams
    for module in _shared_attentions(backbone):
        pads_heads = heads_padded(getattr(module, "heads", None), size) is not None
        if not pads_heads:  # else it attends as if alone, its attention call exchanged by PaddedHeads
            _processor(module)._parallel_config = config
        module.set_processor(_SharedAttention(_processor(module), shards, joins_text, pads_heads))


class _SharedAttention:
    """An attention processor whose self- or joint attention attends across the shares: it counts the bytes its
    all-to-alls carry (`AttentionBytes`: forward now, backward when the output's gradient arrives; a recomputation's
    forward counts again, its output getting no gradient) and masks the pad of the step's picture tokens out of its
    keys. The keys a process holds end with its share of the picture's tokens (Flux puts the text's first); a
    cross-attention to the whole text (Wan's: `encoder_hidden_states` given where the family does not join text
    and picture) attends locally, with no pad among its keys, and is left as it is. Every process of a sample passes
    a mask while the step pads (diffusers' Ulysses gathers it from all of them), none otherwise. Inside a compiled
    block nothing is counted (the observer's all-to-all time then reads 0)."""

    def __init__(self, inner, shards: SequenceShards, joins_text: bool, pads_heads: bool = False):
        self.inner, self.shards, self.joins_text, self.pads_heads = inner, shards, joins_text, pads_heads
        self.signature = inspect.signature(inner)
        # diffusers' attentions give a processor only the keyword arguments its __call__ names, read with
        # inspect.signature(processor.__call__) (Qwen-Image's text mask and rotary tables among them): that lookup
        # finds this attribute, which shows the inner processor's parameters; a call still runs the class's __call__
        self.__call__ = functools.wraps(inner.__call__)(functools.partial(type(self).__call__, self))

    @property
    def _parallel_config(self):  # diffusers' name, read by a family's own attention (HunyuanVideo 1.5's)
        return self.inner._parallel_config

    @property
    def _attention_backend(self):
        return self.inner._attention_backend

    def __call__(self, *args, **kwargs):
        # bound by the processor's own parameters: Flux's attention passes the mask fourth, Qwen-Image's by name
        # (its processor's fourth place is the text's mask)
        call = self.signature.bind(*args, **kwargs)
        hidden_states = call.arguments["hidden_states"]
        encoder_hidden_states = call.arguments.get("encoder_hidden_states")
        if self.shards.padding and (encoder_hidden_states is None or self.joins_text):
            if call.arguments.get("attention_mask") is not None:
                raise NotImplementedError("a padded share of the picture's tokens in an attention given a mask")
            keys = hidden_states.shape[1] + (0 if encoder_hidden_states is None else encoder_hidden_states.shape[1])
            kept = self.shards.kept(hidden_states.device)
            call.arguments["attention_mask"] = torch.cat([kept.new_ones(keys - len(kept)), kept]).expand(
                hidden_states.shape[0], keys)
        if not (encoder_hidden_states is None or self.joins_text):
            return self.inner(*call.args, **call.kwargs)
        return self.exchanged(lambda: self.inner(*call.args, **call.kwargs))

    def exchanged(self, attend):
        """`attend()`, this attention's call across the shares, with what its all-to-alls carry counted (and its heads
        exchanged where they are padded). A family whose blocks attend through their own code rather than the
        processor (HunyuanVideo 1.5's) calls it so."""
        if torch.compiler.is_compiling():
            if self.pads_heads:  # refused before launch (preflight): the exchange is this mode's
                raise RuntimeError("heads padded for sequence parallelism cannot run inside a compiled block")
            return attend()
        with (PaddedHeads(self.shards.group, self.shards.size) if self.pads_heads else AttentionBytes()) as counted:
            out = attend()
        if self.pads_heads and not counted.bytes:
            raise RuntimeError(f"{type(self.inner).__name__} did not call torch's scaled_dot_product_attention (its "
                               "attention backend is not diffusers' native one): heads that "
                               f"pipeline.sequence_parallel = {self.shards.size} does not divide need it")
        step = self.shards.step
        step.exchanged_bytes += counted.bytes
        first = out[0] if isinstance(out, tuple) else out
        if first.requires_grad:  # the backward's all-to-alls carry the gradients of as many bytes
            first.register_hook(lambda grad: setattr(step, "exchanged_bytes", step.exchanged_bytes + counted.bytes))
        return out


def average_over_shares(params: list[torch.Tensor], shards: SequenceShards) -> None:
    """Each gradient of `params` averaged over the processes sharing each sample's tokens, in buckets of one dtype
    (one all-reduce each rather than one a tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    held = 0  # elements in the bucket
    for grad in grads + [None]:
        if bucket and (grad is None or grad.dtype != bucket[0].dtype or held + grad.numel() > _BUCKET_ELEMENTS):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=shards.group)
            flat /= shards.size
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))
            bucket, held = [], 0
        if grad is not None:
            bucket.append(grad)
            held += grad.numel()


def _processor(module: nn.Module):
    return getattr(module, "processor", None)


def _shared_attentions(backbone: Backbone) -> list[nn.Module]:
    """The attention modules of the units after the first that writes a token stream (which computes on whole
    samples): those that see token shares."""
    streams = backbone.family.sequence_streams
    first = next((i for i, u in enumerate(backbone.units) if any(n in u.writes for n in streams)), 0)
    seen, found = set(), []
    for unit in backbone.units[first + 1:]:
        for m in unit.module.modules():
            if _processor(m) is not None and callable(_processor(m)) and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    return found

