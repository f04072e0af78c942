"""--format kohya: adapters as kohya's tools write them, `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` /
`.alpha` (DoRA adds `.dora_scale`, LoHa and LoKr LyCORIS' `.hada_*` / `.lokr_*`), the module named as kohya names it
(SD 1.x/2.x: the diffusers path; SDXL: the original layout's path), dots turned to underscores; loaded by ComfyUI,
A1111, kohya's tools and diffusers (LoRA). DoRA is refused here (check: its readers disagree), written by
--format comfyui and diffusers. UNet adapters only (export/comfyui.py writes the same keys under the
names ComfyUI maps for the other families)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..errors import ExportError
from ..models.family import FusedRows
from ..models.lora import adapted_module, lora_scale
from ..models.single_file import kohya_lora_names
from ..written_files import EXPORT_KEY, save_tensors
from .run import one_file, only_unets

__all__ = ["check", "target", "write", "write_adapters"]


target = one_file


def check(run) -> None:
    only_unets(run, "kohya")
    if not run.lora:
        raise ExportError(f"--format kohya writes LoRA adapters, and {run.folder} trained every weight "
                          "(adapter.type = \"none\"); use --format diffusers or original")
    if run.config.adapter.type == "dora":
        raise ExportError("a DoRA's `.dora_scale` is read three ways: diffusers drops it from kohya's files, A1111 "
                          "divides by each input column's norm, ComfyUI and Forge by the base row's: use --format "
                          "comfyui (kohya's names, written for ComfyUI's and Forge's arithmetic) or --format diffusers")


def write(run, out: Path) -> Path:
    return write_adapters(run, out, lambda modules: kohya_lora_names(modules, run.model_config))


def write_adapters(run, out: Path, name_of, alpha: bool = True, dora_scale=None, fmt: str = "kohya") -> Path:
    """The run's adapters under `name_of(modules)`'s names, in the keys kohya's and LyCORIS' files use:

    - lora: `.lora_down.weight` (peft's lora_A), `.lora_up.weight` (lora_B), `.alpha`;
    - dora: the same and `.dora_scale`, `dora_scale(module, magnitude, adapters)` of each output row's trained
      magnitude (`adapters`: the run's whole file, read once here),
      shaped (out, 1, ...) as loaders tell its axis by its first dimension (export/comfyui.py);
    - loha: `.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, `.alpha`;
    - lokr: `.lokr_w1` (or `_a` / `_b`), `.lokr_w2` (or `_a` / `_b`), the scale alpha / rank in w1: LyCORIS' loaders
      scale by alpha / rank only where a factor is a product, and by 1 where both are whole, as peft never does.

    Loaders scale by alpha / rank, as peft trained. Without `alpha`, no `.alpha` is written and the first factor
    (`lora_up`, `hada_w1_a`) carries the scale (loaders then scale by 1). Modules named as `FusedRows` (a release's
    layer fusing several of diffusers', BFL's `qkv`) are written as that layer's one LoRA (`fused_lora`)."""
    adapters = load_file(str(run.folder / "lora.safetensors"))
    with safe_open(str(run.folder / "lora.safetensors"), framework="pt") as f:
        metadata = f.metadata() or {}
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapters.items():
        module = adapted_module(key)
        by_module.setdefault(module, {})[key.removeprefix(f"{module}.")] = tensor.contiguous()
    names = name_of(sorted(by_module))
    adapter = run.config.adapter
    scale = lora_scale(adapter)
    written, fused = {}, {}
    for module, own in sorted(by_module.items()):
        rows = (lambda m: dora_scale(module, m, adapters)) if dora_scale else (lambda m: m)
        keys = _lycoris_keys(own, adapter.alpha if alpha else None, scale, rows)
        if isinstance(names[module], FusedRows):
            fused.setdefault(names[module].name, {})[names[module]] = keys
            continue
        written.update({f"{names[module]}.{key}": t for key, t in keys.items()})
    for name, parts in fused.items():
        written.update({f"{name}.{key}": t for key, t in fused_lora(parts, scale, alpha).items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    if adapter.type == "lora":
        header = {"ss_network_module": "networks.lora"}
    else:  # LyCORIS' network, which kohya's and A1111's tools load
        algo = {"dora": "lora", "loha": "loha", "lokr": "lokr"}[adapter.type]
        header = {"ss_network_module": "lycoris.kohya",
                  "ss_network_args": json.dumps({"algo": algo, "dora_wd": str(adapter.type == "dora")})}
    header.update({"ss_network_dim": str(adapter.rank), "ss_network_alpha": str(adapter.alpha), **metadata,
                   EXPORT_KEY: fmt})  # a later export --force may replace it
    return save_tensors(written, out, metadata=header)


def fused_lora(parts: dict[FusedRows, dict[str, torch.Tensor]], scale: float, alpha: bool) -> dict[str, torch.Tensor]:
    """One LoRA of a fused layer from its parts' (kohya's keys, scaled by `scale` unless `alpha`): the downs stacked,
    each up in its part's rows and its down's columns (zero elsewhere: a part not adapted changes nothing), the scale
    in `lora_up` and `.alpha` the whole rank (loaders scale by alpha / rank = 1). Exact: the fused delta is each
    part's delta in its rows."""
    ordered = sorted(parts.items())  # by part: the fused layer's rows in order
    downs = [keys["lora_down.weight"] for _, keys in ordered]
    ups = [keys["lora_up.weight"] * (scale if alpha else 1.0) for _, keys in ordered]
    count, width = ordered[0][0].parts, ups[0].shape[0]
    up = torch.zeros(count * width, sum(d.shape[0] for d in downs), dtype=ups[0].dtype)
    column = 0
    for (where, _), down, part_up in zip(ordered, downs, ups):
        up[where.part * width:(where.part + 1) * width, column:column + down.shape[0]] = part_up
        column += down.shape[0]
    keys = {"lora_down.weight": torch.cat(downs, dim=0), "lora_up.weight": up}
    if alpha:
        keys["alpha"] = torch.tensor(float(column))
    return keys


def _lycoris_keys(own: dict[str, torch.Tensor], alpha: float | None, scale: float,
                  dora_scale) -> dict[str, torch.Tensor]:
    """One module's adapters (peft's plain keys, the module's name removed) in kohya's / LyCORIS' keys; `alpha` None:
    the scale in the first factor, no `.alpha`."""
    baked = 1.0 if alpha is not None else scale
    if "lora_A.weight" in own:
        keys = {"lora_down.weight": own["lora_A.weight"], "lora_up.weight": own["lora_B.weight"] * baked}
        if "lora_magnitude_vector" in own:
            m = own["lora_magnitude_vector"]
            keys["dora_scale"] = dora_scale(m).reshape(keys["lora_up.weight"].shape[0], *[1] * (m.dim() - 1 or 1))
    elif "hada_w1_a" in own:
        keys = {**own, "hada_w1_a": own["hada_w1_a"] * baked}
    else:
        first = "lokr_w1" if "lokr_w1" in own else "lokr_w1_a"
        return {**own, first: own[first] * scale}
    if alpha is not None:
        keys["alpha"] = torch.tensor(float(alpha))
    return keys
