"""UNet weights in the original Stable Diffusion key layout (Stability's releases, A1111, ComfyUI and most shared
fine-tunes: `model.diffusion_model.input_blocks.1.0.in_layers.0.weight`, ...) and diffusers' layout.

Reading: a single .safetensors file in a family's original layout (this UNet layout, or Flux's BFL layout:
families/flux/release_layout.py, ...) is converted once by the family's `ReleaseLayout` (for UNets `SGM` here: diffusers' own key
map `convert_ldm_unet_checkpoint`, what `from_single_file` uses) for the architecture of the run, and written as a
diffusers-named file under ~/.cache/diffpipe/converted (keyed by the file's name, size, time and header and the
architecture), which every process then reads tensor by tensor as any other weights file.

Writing (`to_original_layout`): the inverse map, derived from the UNet's config (levels, layers per level, which
levels attend), so a trained UNet can go back to the layout ComfyUI and A1111 load. The round trip through
diffusers' converter is tested to give back every tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..written_files import cache_home
from .family import ReleaseLayout

__all__ = ["ORIGINAL_PREFIX", "SGM", "converted_file", "to_original_layout", "kohya_lora_names", "is_fp8_file",
           "without_scales", "dequantised"]

ORIGINAL_PREFIX = "model.diffusion_model."
_RESNET_PARTS = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                 "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def _cache_root() -> Path:
    return cache_home() / "converted"


def _file_identity(path: Path) -> str:
    stat = path.stat()
    with path.open("rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        header = f.read(min(header_length, 1 << 26))
    return hashlib.sha256(f"{path.resolve()}/{stat.st_size}/{stat.st_mtime_ns}".encode() + header).hexdigest()[:16]


# ComfyUI's fp8 files: weights in float8 with a scale each (`NAME.scale_weight`, or `NAME.weight_scale` in its newer
# format), the file marked by a `scaled_fp8` tensor; `scale_input` / `input_scale` and `comfy_quant` serve its fp8
# matmuls and are not weights
_SCALES = (".scale_weight", ".weight_scale")
_NOT_WEIGHTS = (".scale_input", ".input_scale", ".comfy_quant")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _is_marker(key: str) -> bool:
    return key == "scaled_fp8" or key.endswith(".scaled_fp8")


def without_scales(keys: list[str]) -> list[str]:
    """A file's weight names, less those of an fp8 file's scales and markers."""
    return [k for k in keys if not (_is_marker(k) or k.endswith(_SCALES) or k.endswith(_NOT_WEIGHTS))]


def is_fp8_file(path: Path) -> bool:
    """Whether a .safetensors file holds float8 weights (ComfyUI's fp8 and fp8 "scaled" releases); reads the header."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return any(isinstance(v, dict) and v.get("dtype") in ("F8_E4M3", "F8_E5M2") for v in header.values())


def dequantised(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An fp8 file's weights in bf16, each float8 weight times its scale as ComfyUI computes it (in fp32, then bf16:
    its compute dtype), the scales and markers dropped. A scale must be one number or one per output row."""
    out = {}
    for key in without_scales(list(weights)):
        tensor = weights[key]
        if tensor.dtype in _FP8:
            base = key.removesuffix(".weight")
            scale = next((weights[base + s] for s in _SCALES if base + s in weights), None)
            tensor = tensor.float()
            if scale is not None:
                scale = scale.float()
                if scale.numel() not in (1, tensor.shape[0]):
                    raise ValueError(f"{key}'s scale has {scale.numel()} values: diffpipe reads a scale per tensor or "
                                     "per output row, not block-wise ones (dequantise the file with its own tool)")
                tensor = tensor * (scale.reshape(-1, *[1] * (tensor.dim() - 1)) if scale.numel() > 1 else scale)
            tensor = tensor.to(torch.bfloat16)
        out[key] = tensor
    return out


def converted_file(path: Path, family, config: dict, layout: bool = True) -> Path:
    """The diffusers-named weights of a file in `family`'s release layout (`ModelFamily.release_layout`), converted
    on first use; an fp8 file's weights dequantised first (`dequantised`), and `layout` False for one already in
    diffusers' names."""
    # keyed by the file and the architecture it is read as: a conversion for a wrong config is never reused for the
    # right one (a UNet's config decides which original keys become which diffusers names)
    architecture = hashlib.sha256(json.dumps([family.name, config, layout], sort_keys=True, default=str).encode()).hexdigest()[:12]
    target = _cache_root() / f"{path.stem}-{_file_identity(path)}-{architecture}.safetensors"
    if target.is_file():
        return target
    weights = load_file(str(path))
    if any(t.dtype in _FP8 for t in weights.values()):
        weights = dequantised(weights)
    converted = family.release_layout.to_diffusers(weights, config) if layout else weights
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}")
    save_file({k: v.contiguous() for k, v in converted.items()}, str(temporary))
    temporary.rename(target)  # several processes may convert at once: each rename is whole
    return target


def _prefix_map(config: dict) -> dict[str, str]:
    """diffusers module prefix -> original prefix, for this UNet's levels."""
    levels = len(config["block_out_channels"])
    layers = config.get("layers_per_block", 2)
    layers = [layers] * levels if isinstance(layers, int) else list(layers)
    names = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
             "mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
             "mid_block.resnets.1": "middle_block.2"}
    n = 1
    for i, kind in enumerate(config["down_block_types"]):
        for j in range(layers[i]):
            names[f"down_blocks.{i}.resnets.{j}"] = f"input_blocks.{n}.0"
            if "CrossAttn" in kind:
                names[f"down_blocks.{i}.attentions.{j}"] = f"input_blocks.{n}.1"
            n += 1
        if i < levels - 1:
            names[f"down_blocks.{i}.downsamplers.0.conv"] = f"input_blocks.{n}.0.op"
            n += 1
    n = 0
    for i, kind in enumerate(config["up_block_types"]):
        attends = "CrossAttn" in kind
        last = list(reversed(layers))[i]
        for j in range(last + 1):
            names[f"up_blocks.{i}.resnets.{j}"] = f"output_blocks.{n}.0"
            if attends:
                names[f"up_blocks.{i}.attentions.{j}"] = f"output_blocks.{n}.1"
            if i < levels - 1 and j == last:
                names[f"up_blocks.{i}.upsamplers.0.conv"] = f"output_blocks.{n}.{2 if attends else 1}.conv"
            n += 1
    return names


def to_original_layout(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A diffusers UNet state dict under the original names (with the `model.diffusion_model.` prefix)."""
    prefixes = sorted(_prefix_map(config).items(), key=lambda kv: -len(kv[0]))
    out = {}
    for key, tensor in state_dict.items():
        for ours, theirs in prefixes:
            if key.startswith(ours + "."):
                rest = key[len(ours) + 1:]
                if ".resnets." in ours:
                    part, _, tail = rest.partition(".")
                    rest = f"{_RESNET_PARTS[part]}.{tail}"
                out[ORIGINAL_PREFIX + theirs + "." + rest] = tensor
                break
        else:
            raise KeyError(f"{key}: no original-layout name known for it")
    return out


def _unet_from_sgm(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    return convert_ldm_unet_checkpoint({k: v for k, v in weights.items() if k.startswith(ORIGINAL_PREFIX)}, config)


SGM = ReleaseLayout("original (SGM)", lambda keys: any(k.startswith(ORIGINAL_PREFIX) for k in keys), _unet_from_sgm,
                    to_original_layout)


def kohya_lora_names(modules: list[str], unet_config: dict) -> dict[str, str]:
    """Module path -> kohya's LoRA name (`lora_unet_` and the module's path, dots turned to underscores): SD 1.x/2.x
    name diffusers' path, kohya's SDXL networks the original layout's. ComfyUI, A1111 and kohya's tools read both."""
    if unet_config.get("addition_embed_type") == "text_time":
        renamed = to_original_layout({f"{m}.weight": torch.empty(0) for m in modules}, unet_config)
        originals = [k.removeprefix(ORIGINAL_PREFIX).removesuffix(".weight") for k in renamed]
        pairs = zip(modules, originals)
    else:
        pairs = ((m, m) for m in modules)
    return {m: "lora_unet_" + name.replace(".", "_") for m, name in pairs}
