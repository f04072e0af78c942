"""LoRA adapters (Hu et al., arXiv:2106.09685) through peft, on the backbone before it is cut into stages.

peft injects its LoRA layers into the model in place (`inject_adapter_in_model`), on the modules a process has
weights for and, on the meta device, on the others; the base weights are frozen, so only the adapters reach the
optimizer, the gradients and the checkpoints. Each adapter's A matrix is drawn from a generator seeded by the
module's name (B starts at zero, as peft does), so every stage count trains the same adapter.

Names: peft calls a wrapped weight `....to_q.base_layer.weight` and an adapter `....to_q.lora_A.default.weight`;
`plain_name` gives the names diffusers and the exports use (`....to_q.weight`, `....to_q.lora_A.weight`).
"""
from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from .. import seeds
from ..config import AdapterConfig

__all__ = ["load_adapters", "lora_metadata", "add_lora", "seed_lora", "plain_name", "base_module_name", "is_adapter", "merge_lora", "lora_weights", "lora_scale"]


def add_lora(model: torch.nn.Module, adapter: AdapterConfig, default_targets: tuple[str, ...], seed: int) -> None:
    """Inject LoRA into `model` in place, freeze everything else; seeded per module where weights are real.
    `default_targets`: the family's modules (ModelFamily.lora_targets) when adapter.target_modules is unset."""
    config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                        target_modules=adapter.target_modules or list(default_targets),
                        init_lora_weights=True)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:  # peft: no module matched
        raise ValueError(f"adapter.target_modules={config.target_modules}: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    seed_lora(model, seed)


def seed_lora(model: torch.nn.Module, seed: int) -> None:
    """Initial adapters of every LoRA layer with real weights: A as peft draws it, from a generator seeded by the
    layer's name; B zero (the adapted model starts equal to the base)."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.lora_A["default"].weight.is_meta:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seeds.named(seed, f"lora/{name}"))
                module.reset_lora_parameters("default", True)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def plain_name(name: str) -> str:
    """A parameter's name without peft's wrapping: `x.to_q.base_layer.weight` -> `x.to_q.weight`."""
    return name.replace(".base_layer.", ".").replace(".default.", ".")


def base_module_name(name: str) -> str | None:
    """A module's name in the base model (`x.to_q.base_layer` -> `x.to_q`); None for LoRA's own modules."""
    if ".lora_" in name:
        return None
    return name.removesuffix(".base_layer")


def lora_scale(adapter: AdapterConfig) -> float:
    return adapter.alpha / adapter.rank


def lora_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict (peft names), under plain names: `x.to_q.lora_A.weight` ..."""
    return {plain_name(k): v for k, v in state.items() if is_adapter(k)}


def merge_lora(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The backbone's own weights with each adapter merged in (W + scale B A), under diffusers' names: what a full
    fine-tune of the same result would hold, loadable without peft."""
    merged = {plain_name(k): v for k, v in state.items() if not is_adapter(k)}
    for key, a in state.items():
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            b = state[key.replace(".lora_A.", ".lora_B.")]
            weight = f"{module}.weight"
            base = merged[weight]
            # Linear: B A; Conv2d (A a k x k convolution, B 1 x 1): the same product over the flattened kernels
            delta = (b.float().flatten(1) @ a.float().flatten(1)).view(base.shape)
            merged[weight] = (base.float() + scale * delta).to(base.dtype)
    return merged


def lora_metadata(config, default_targets: tuple[str, ...]) -> dict[str, str]:
    """The safetensors header of an adapter file: rank, alpha, targets, base model, and the training config."""
    import json

    adapter = config.adapter
    return {"format": "pt", "diffpipe.lora": json.dumps({
        "r": adapter.rank, "lora_alpha": adapter.alpha,
        "target_modules": adapter.target_modules or list(default_targets),
        "base_model": config.model.path or f"preset {config.model.preset}"}),
        "diffpipe.config": json.dumps(config.model_dump(mode="json"))}


def load_adapters(model: torch.nn.Module, path: str) -> None:
    """Adapters from a LoRA file (plain names, optionally under diffusers' `unet.` prefix) into the LoRA layers with
    real weights; every such layer must be in the file with the same rank."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        saved = {k.removeprefix("unet."): v for k, v in load_file(path).items()}
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
