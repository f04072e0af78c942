"""Exports of DoRA, LoHa and LoKr (adapter.type): each file loads, by the reader it is written for, to the trained
model's output (its adapters merged, as model.safetensors holds it).

- DoRA: --format diffusers through diffusers' own loader (peft's DoRA arithmetic); --format kohya refused (diffusers
  drops a kohya file's `dora_scale`, A1111 and ComfyUI compute it in two other ways);
- DoRA, LoHa, LoKr: --format comfyui through ComfyUI's arithmetic, written out here from its source
  (comfyanonymous/ComfyUI comfy/lora.py `load_lora`, comfy/weight_adapter/lora.py, loha.py, lokr.py and base.py
  `weight_decompose`): on SDXL (kohya's names) and on Flux (diffusers' names under `transformer.`);
- LoHa and LoKr refused by --format diffusers, whose loaders read neither.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from safetensors.torch import load_file

from diffpipe.cli import main
from diffpipe.models.single_file import kohya_lora_names

from .test_export import _output as unet_output, _train, _trained
from .test_export_comfyui import COMFYUI_LAYERS, _base, _output as transformer_output, _train_lora, _trained as trained_dit


@pytest.fixture(scope="module")
def photos(tiny, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("adapter_types") / "photos"
    shutil.copytree(tiny / "photos", folder)
    return folder


def comfyui_weight(weight: torch.Tensor, lora: dict[str, torch.Tensor], x: str) -> tuple[torch.Tensor, set[str]]:
    """`weight` patched by the adapter under `x` as ComfyUI computes it (strength 1, fp32); the keys it read."""
    def read(key):
        return lora.get(f"{x}.{key}")

    alpha, dora_scale = read("alpha"), read("dora_scale")
    alpha = None if alpha is None else alpha.item()
    if read("lora_up.weight") is not None:  # comfy/weight_adapter/lora.py
        up, down = read("lora_up.weight"), read("lora_down.weight")
        scale = alpha / down.shape[0] if alpha is not None else 1.0
        diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        keys = {"lora_up.weight", "lora_down.weight"}
    elif read("hada_w1_a") is not None:  # loha.py
        scale = alpha / read("hada_w1_b").shape[0] if alpha is not None else 1.0
        diff = ((read("hada_w1_a") @ read("hada_w1_b")) * (read("hada_w2_a") @ read("hada_w2_b"))).reshape(weight.shape)
        keys = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}
    else:  # lokr.py
        dim, w1, w2 = None, read("lokr_w1"), read("lokr_w2")
        if w1 is None:
            dim, w1 = read("lokr_w1_b").shape[0], read("lokr_w1_a") @ read("lokr_w1_b")
        if w2 is None:
            dim, w2 = read("lokr_w2_b").shape[0], read("lokr_w2_a") @ read("lokr_w2_b")
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        diff = torch.kron(w1, w2).reshape(weight.shape)
        keys = {k for k in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
                if read(k) is not None}
    keys |= {k for k in ("alpha", "dora_scale") if read(k) is not None}
    if dora_scale is None:
        return weight + scale * diff, {f"{x}.{k}" for k in keys}
    # base.py weight_decompose: the output axis where dora_scale's first dimension is the weight's
    weight_calc = weight + scale * diff
    assert dora_scale.shape[0] == weight.shape[0]
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True).reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    norm = norm + torch.finfo(weight.dtype).eps
    return weight_calc * (dora_scale / norm), {f"{x}.{k}" for k in keys}


def load_like_comfyui(model: torch.nn.Module, key_map: dict[str, str], lora: dict[str, torch.Tensor]) -> set[str]:
    """Each file name `x` of `key_map` patched into the model's weight it maps to; the file's keys left unread."""
    weights, loaded = dict(model.named_parameters()), set()
    with torch.no_grad():
        for x, weight in key_map.items():
            if any(k.startswith(f"{x}.") for k in lora):
                patched, keys = comfyui_weight(weights[weight].float(), lora, x)
                weights[weight].copy_(patched)
                loaded |= keys
    return set(lora) - loaded


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_sdxl_adapters_load_through_comfyuis_arithmetic_to_the_trained_output(tiny, photos, tmp_path, kind):
    """Attention projections and the first convolution (LoKr keeps a convolution's kernel factor whole); alpha 8 at
    rank 4, so a reader that ignored the scale would be off. DoRA's diffusers file loads in diffusers."""
    run = _train(tiny, photos, tmp_path / "run", "sdxl", "--set", f"adapter.type=\"{kind}\"", "--set",
                 "adapter.rank=4", "--set", "adapter.alpha=8.0", "--set",
                 'adapter.target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv_in"]')
    want = unet_output(_trained(run), True)
    out = tmp_path / "comfyui.safetensors"
    assert main(["export", str(run), "--format", "comfyui", "--out", str(out)]) == 0
    lora = load_file(str(out))
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny / "sdxl")
    assert (unet_output(pipe.unet, True) - want).abs().max() > 1e-3  # the adapters matter
    modules = sorted({name.removesuffix(".weight") for name, _ in pipe.unet.named_parameters()})
    names = kohya_lora_names(modules, dict(pipe.unet.config))
    assert load_like_comfyui(pipe.unet, {names[m]: f"{m}.weight" for m in modules}, lora) == set()
    torch.testing.assert_close(unet_output(pipe.unet, True), want, rtol=1e-5, atol=1e-5)
    if kind != "dora":
        return
    assert main(["export", str(run), "--format", "diffusers", "--out", str(tmp_path / "lora")]) == 0
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny / "sdxl")
    pipe.load_lora_weights(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    torch.testing.assert_close(unet_output(pipe.unet, True), want, rtol=1e-5, atol=1e-5)
    assert main(["export", str(run), "--format", "kohya", "--out", str(tmp_path / "kohya.safetensors")]) == 2
    assert not (tmp_path / "kohya.safetensors").exists()


@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_flux_adapters_load_through_comfyuis_arithmetic_to_the_trained_output(tiny, tmp_path, kind):
    run = _train_lora("flux_tiny", tiny, tmp_path / "run", ["to_q", "to_k", "proj_mlp", "proj_out"],
                      "--set", f"adapter.type=\"{kind}\"")
    out = tmp_path / "comfyui.safetensors"
    assert main(["export", str(run), "--format", "comfyui", "--out", str(out)]) == 0
    lora = load_file(str(out))
    assert all(k.startswith("transformer.") for k in lora)
    want = transformer_output("flux", trained_dit(run, "flux"))
    base = _base(tiny, "flux")
    assert (transformer_output("flux", base) - want).abs().max() > 1e-3
    key_map = {f"transformer.{n.removesuffix('.weight')}": n for n, _ in base.named_parameters()
               if n.endswith(".weight") and COMFYUI_LAYERS["flux"].fullmatch(n.removesuffix(".weight"))}
    assert load_like_comfyui(base, key_map, lora) == set()
    torch.testing.assert_close(transformer_output("flux", base), want, rtol=1e-5, atol=1e-5)


def test_loha_and_lokr_are_refused_by_the_diffusers_format(tiny, photos, tmp_path, capsys):
    run = _train(tiny, photos, tmp_path / "run", "sd15", "--set", "adapter.type=\"loha\"", "--set", "adapter.rank=4")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(tmp_path / "lora")]) == 2
    assert "diffusers' load_lora_weights reads LoRA and DoRA files, and" in capsys.readouterr().err
    assert not (tmp_path / "lora").exists()
