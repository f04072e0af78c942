"""Adapters through peft, on the backbone before it is cut into stages (adapter.type):

- lora: LoRA (Hu et al., arXiv:2106.09685), W + (alpha / r) B A;
- dora: DoRA (Liu et al., arXiv:2402.09353), peft's `use_dora`: each output row of W + (alpha / r) B A rescaled to a
  trained magnitude m (m starts at the row norms of W, so the adapted model starts equal to the base);
- loha: LoHa (LyCORIS; FedPara), W + (alpha / r) (W1a W1b) * (W2a W2b), an elementwise product of two rank-r matrices;
- lokr: LoKr (LyCORIS), W + (alpha / r) kron(W1, W2), W2 as a rank-r product where it is large.

peft injects its layers into the model in place (`inject_adapter_in_model`), on the modules a process has weights for
and, on the meta device, on the others; the base weights are frozen, so only the adapters reach the optimizer, the
gradients and the checkpoints. Each layer's adapters are drawn as peft draws them from a generator seeded by the
module's name (the adapted model starts equal to the base), so every stage count trains the same adapter; DoRA's
magnitude is computed once the base weight the layer computes with is there.

Names: peft calls a wrapped weight `....to_q.base_layer.weight` and an adapter `....to_q.lora_A.default.weight`
(`....to_q.hada_w1_a.default`, `....to_q.lora_magnitude_vector.default.weight`); `plain_name` gives the names peft's
and diffusers' files use (`....to_q.weight`, `....to_q.lora_A.weight`, `....to_q.hada_w1_a`,
`....to_q.lora_magnitude_vector`).
"""
from __future__ import annotations

import re

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lycoris_utils import LycorisLayer

from .. import seeds
from ..config import AdapterConfig

__all__ = ["load_adapters", "lora_metadata", "add_lora", "seed_lora", "plain_name", "base_module_name", "is_adapter",
           "merge_lora", "lora_weights", "lora_scale", "adapted_module", "is_adapter_holder", "delta_weight"]

# an adapter's own tensors, by the attribute peft keeps them under in the layer it wraps
_ADAPTER = re.compile(r"\.(lora_A|lora_B|lora_magnitude_vector|hada_w[12]_[ab]|hada_t[12]|lokr_w[12](_[ab])?|lokr_t2)"
                      r"(\.|$)")


def add_lora(model: torch.nn.Module, adapter: AdapterConfig, default_targets: tuple[str, ...], seed: int,
             leave_out: list[str] = ()) -> None:
    """Inject adapter.type's adapters into `model` in place, freeze everything else; seeded per module where weights
    are real. `default_targets`: the family's modules (ModelFamily.lora_targets) when adapter.target_modules is unset.
    `leave_out`: modules (and all inside them) that get no adapter (ModelFamily.unreached: no prediction reads them)."""
    config = _peft_config(adapter, adapter.target_modules or list(default_targets))
    config.exclude_modules = [name for name, _ in model.named_modules()
                              if any(name == m or name.startswith(f"{m}.") for m in leave_out)] or None
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:  # peft: no module matched
        raise ValueError(f"adapter.target_modules={config.target_modules}: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    seed_lora(model, seed)


def _peft_config(adapter: AdapterConfig, targets: list[str]):
    if adapter.type in ("lora", "dora"):
        return LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                          target_modules=targets, init_lora_weights=True, use_dora=adapter.type == "dora")
    kind = {"loha": LoHaConfig, "lokr": LoKrConfig}[adapter.type]
    return kind(r=adapter.rank, alpha=adapter.alpha, target_modules=targets, init_weights=True)


def seed_lora(model: torch.nn.Module, seed: int) -> None:
    """Initial adapters of every adapted layer with real weights, drawn as peft draws them from a generator seeded
    by the layer's name (LoRA: B zero; LoHa: W2b zero; LoKr: W1 zero: the adapted model starts equal to the base);
    DoRA's magnitude: the row norms of the base weight as the layer holds it (memory.base_dtype's rounding in)."""
    for name, module in model.named_modules():
        if not isinstance(module, (LoraLayer, LycorisLayer)) or _is_meta(module):
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds.named(seed, f"lora/{name}"))
            if isinstance(module, LoraLayer):
                module.reset_lora_parameters("default", True)
            else:
                module.reset_adapter_parameters("default")
        if isinstance(module, LoraLayer) and "default" in module.lora_magnitude_vector:
            _start_magnitude(module)


def _is_meta(layer: torch.nn.Module) -> bool:
    return any(p.is_meta for n, p in layer.named_parameters() if is_adapter(f".{n}"))


def _start_magnitude(layer: LoraLayer) -> None:
    dora = layer.lora_magnitude_vector["default"]
    weight = layer.get_base_layer().weight
    with torch.no_grad():
        norm = dora.get_weight_norm(weight.float(), torch.zeros_like(weight, dtype=torch.float32), 1.0)
        dora.weight.copy_(norm.view_as(dora.weight))


def is_adapter(name: str) -> bool:
    """A parameter (or a plain name) that is an adapter's, not the base model's."""
    return _ADAPTER.search(name) is not None


def is_adapter_holder(module: torch.nn.Module) -> bool:
    """A module peft keeps adapter tensors in without a `reset_parameters` of its own (LoHa's and LoKr's parameter
    dicts, DoRA's magnitude): `seed_lora` fills it."""
    return isinstance(module, (torch.nn.ParameterDict, DoraLinearLayer))


def adapted_module(name: str) -> str | None:
    """The adapted module of an adapter tensor's plain name (`x.to_q.hada_w1_a` -> `x.to_q`); None for the base's."""
    found = _ADAPTER.search(name)
    return name[:found.start()] if found else None


def plain_name(name: str) -> str:
    """A parameter's name without peft's wrapping: `x.to_q.base_layer.weight` -> `x.to_q.weight`,
    `x.to_q.lora_A.default.weight` -> `x.to_q.lora_A.weight`, `x.to_q.hada_w1_a.default` -> `x.to_q.hada_w1_a`,
    `x.to_q.lora_magnitude_vector.default.weight` -> `x.to_q.lora_magnitude_vector` (peft's file names)."""
    name = name.replace(".base_layer.", ".").replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
    return name.replace(".default.", ".").removesuffix(".default")


def base_module_name(name: str) -> str | None:
    """A module's name in the base model (`x.to_q.base_layer` -> `x.to_q`); None for the adapters' own modules."""
    if ".lora_" in name or is_adapter(name):
        return None
    return name.removesuffix(".base_layer")


def lora_scale(adapter: AdapterConfig) -> float:
    return adapter.alpha / adapter.rank


def lora_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict (peft names), under plain names: `x.to_q.lora_A.weight` ..."""
    return {plain_name(k): v for k, v in state.items() if is_adapter(k)}


def delta_weight(adapters: dict[str, torch.Tensor], module: str, scale: float, shape: torch.Size) -> torch.Tensor:
    """What one module's LoRA, LoHa or LoKr adapters (plain names) add to its weight, in fp32, scaled (alpha / r)."""
    def get(key: str, flat: bool = True) -> torch.Tensor | None:
        t = adapters.get(f"{module}.{key}")
        return None if t is None else t.float().flatten(1) if flat else t.float()

    if f"{module}.lora_A.weight" in adapters:  # Conv2d: A a k x k convolution, B 1 x 1: over the flattened kernels
        delta = get("lora_B.weight") @ get("lora_A.weight")
    elif f"{module}.hada_w1_a" in adapters:
        delta = (get("hada_w1_a") @ get("hada_w1_b")) * (get("hada_w2_a") @ get("hada_w2_b"))
    else:
        w1 = get("lokr_w1")
        w1 = w1 if w1 is not None else get("lokr_w1_a") @ get("lokr_w1_b")
        w2 = get("lokr_w2", flat=False)  # a convolution's whole kernel stays 4-D
        w2 = w2 if w2 is not None else get("lokr_w2_a") @ get("lokr_w2_b")
        if w2.dim() == 4:  # a convolution's kernel kept whole: kron over the channels, each kernel position alike
            w1 = w1[:, :, None, None]
        delta = torch.kron(w1, w2)
    return scale * delta.reshape(shape)


def merge_lora(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The backbone's own weights with each adapter merged in (W + delta; DoRA: m (W + delta) / |W + delta| per
    output row), under diffusers' names: what a full fine-tune of the same result would hold, loadable without peft."""
    adapters = lora_weights(state)
    merged = {plain_name(k): v for k, v in state.items() if not is_adapter(k)}
    for module in sorted({adapted_module(k) for k in adapters}):
        weight = f"{module}.weight"
        base = merged[weight]
        adapted = base.float() + delta_weight(adapters, module, scale, base.shape)
        magnitude = adapters.get(f"{module}.lora_magnitude_vector")
        if magnitude is not None:  # peft's DoRA: the norm over all but the output axis
            norm = adapted.flatten(1).norm(dim=1).view(-1, *[1] * (adapted.dim() - 1))
            adapted = magnitude.float().reshape(norm.shape) * adapted / norm
        merged[weight] = adapted.to(base.dtype)
    return merged


def lora_metadata(config, default_targets: tuple[str, ...]) -> dict[str, str]:
    """The safetensors header of an adapter file: rank, alpha, targets, base model, and the training config."""
    import json

    adapter = config.adapter
    return {"format": "pt", "diffpipe.lora": json.dumps({
        "type": adapter.type, "r": adapter.rank, "lora_alpha": adapter.alpha,
        "target_modules": adapter.target_modules or list(default_targets),
        "base_model": config.model.path or f"preset {config.model.preset}"}),
        "diffpipe.config": json.dumps(config.model_dump(mode="json"))}


def load_adapters(model: torch.nn.Module, path: str) -> None:
    """Adapters from a LoRA file (plain names, optionally under diffusers' `unet.` or `transformer.` prefix) into the
    adapted layers with real weights; every such layer must be in the file with the same rank."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        saved = {k.removeprefix("unet.").removeprefix("transformer."): v for k, v in load_file(path).items()}
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"adapter.init_from={path}: not a readable .safetensors file ({exc})") from None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_adapter(name) or p.is_meta:
                continue
            key = plain_name(name)
            if key not in saved:
                raise ValueError(f"adapter.init_from={path} has no {key}: it was trained with other "
                                 "adapter.target_modules or on another model")
            if tuple(saved[key].shape) != tuple(p.shape):
                raise ValueError(f"adapter.init_from={path}: {key} is {tuple(saved[key].shape)}, the adapter here "
                                 f"{tuple(p.shape)}; set adapter.rank to the file's")
            p.copy_(saved[key])
