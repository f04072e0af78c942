"""`diffpipe export --format comfyui`: a LoRA of every family under the names ComfyUI's LoRA loader maps (issue 29).

ComfyUI is not a package to install, so its loader is written out here from its source (comfyanonymous/ComfyUI,
comfy/lora.py `model_lora_keys_unet` and `load_lora`, comfy/utils.py `flux_to_diffusers` and `mmdit_to_diffusers`):
the names it maps for a family, and its arithmetic, `W += alpha / rank * up @ down` (alpha 1 per rank without an
`.alpha`). ComfyUI applies a Flux or SD3 layer's patch to rows of its fused `qkv` / `linear1`; here the same patch
goes to diffusers' unfused layer, the same rows. Wan's files are also read by diffusers' own converter of Wan's
layout (WanPipeline.load_lora_weights), which names Wan's layers independently of diffpipe.
Each loaded model's output equals the trained one's (adapters merged) on the same inputs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe.cli import main
from diffpipe.models.family import Feed
from diffpipe.models.registry import family_for

from .helpers import run_command, wan_output

ROOT = Path(__file__).parent.parent

# diffusers' layers ComfyUI maps for each family (the domains of flux_to_diffusers and mmdit_to_diffusers, weights)
COMFYUI_LAYERS = {
    "flux": re.compile(
        r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|norm1(_context)?\.linear"
        r"|ff(_context)?\.net\.(0\.proj|2))"
        r"|single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|norm\.linear|proj_out)"
        r"|proj_out|x_embedder|context_embedder|time_text_embed\.(timestep|text|guidance)_embedder\.linear_[12]"
        r"|norm_out\.linear"),
    "sd3": re.compile(
        r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|norm1(_context)?\.linear"
        r"|ff(_context)?\.net\.(0\.proj|2))"
        r"|context_embedder|time_text_embed\.(timestep|text)_embedder\.linear_[12]|pos_embed\.proj|norm_out\.linear"
        r"|proj_out"),
}


def load_like_comfyui(transformer: torch.nn.Module, family: str, lora: dict[str, torch.Tensor]) -> set[str]:
    """The LoRA file's patches added to `transformer`'s weights as ComfyUI adds them (Flux, SD3: `transformer.`
    and diffusers' name); the keys ComfyUI would leave unloaded ("lora key not loaded")."""
    weights = dict(transformer.named_parameters())
    key_map = {f"transformer.{name.removesuffix('.weight')}": name for name in weights
               if name.endswith(".weight") and COMFYUI_LAYERS[family].fullmatch(name.removesuffix(".weight"))}
    loaded = set()
    with torch.no_grad():
        for x, weight in key_map.items():
            if f"{x}.lora_up.weight" not in lora:
                continue
            up, down = lora[f"{x}.lora_up.weight"], lora[f"{x}.lora_down.weight"]
            alpha = lora[f"{x}.alpha"].item() / down.shape[0] if f"{x}.alpha" in lora else 1.0
            weights[weight] += alpha * (up.flatten(1) @ down.flatten(1)).reshape(weights[weight].shape)
            loaded |= {f"{x}.lora_up.weight", f"{x}.lora_down.weight", f"{x}.alpha"}
    return set(lora) - loaded


@torch.no_grad()
def _output(family_name: str, transformer) -> torch.Tensor:
    family, gen = family_for(family_name), torch.Generator().manual_seed(0)
    hidden, pooled = family.text_widths(transformer.config)
    feed = Feed(family, transformer.config, guidance=3.5)
    conditions = feed.conditions(torch.randn(2, 16, hidden, generator=gen), torch.randn(2, pooled, generator=gen),
                                 torch.zeros(2, 6), (16, 12))
    conditions["timestep"] = torch.tensor([500.0, 20.0])
    latents = torch.randn(2, family.latent_channels(transformer.config), 16, 12, generator=gen)
    return family.diffusers_forward(transformer.eval(), feed.pack(latents), conditions)


def _train_lora(example: str, tiny: Path, run: Path, targets: list[str], *extra: str) -> Path:
    layout = example.split("_")[0]
    cmd = ["train", str(ROOT / "examples" / f"{example}.toml"), "--output-dir", str(run),
           "--set", f"model.path=\"{tiny / layout}\"", "--set", f"data.path=\"{tiny / 'photos'}\"",
           "--set", "train.max_steps=3", "--set", "train.learning_rate=3e-2", "--set", "train.warmup_steps=0",
           "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false", "--set", "pipeline.stages=1",
           "--set", "adapter.type=\"lora\"", "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0",
           "--set", f"adapter.target_modules={json.dumps(targets)}", *extra]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def _trained(run: Path, family_name: str):
    config = {k: v for k, v in json.loads((run / "model_config.json").read_text()).items() if not k.startswith("_")}
    model = family_for(family_name).model_class(**config)
    model.load_state_dict(load_file(str(run / "model.safetensors")))  # the base with the adapters merged
    return model


def _base(tiny: Path, layout: str):
    return family_for(layout).model_class.from_pretrained(tiny / layout / "transformer")


def test_flux_and_sd3_loras_load_through_comfyuis_key_map_to_the_trained_output(tiny, tmp_path):
    """Every layer kind ComfyUI maps onto Flux's fused layers (rows of double blocks' qkv, single blocks' linear1
    with proj_mlp) and the top-level ones; alpha 8 at rank 4, so a loader that ignored alpha would be 2x off."""
    cases = {"flux_tiny": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "proj_out",
                           "norm1.linear", "ff_context.net.2", "x_embedder"],
             "sd3_tiny": ["to_q", "to_k", "to_v", "to_out.0", "add_v_proj", "ff.net.0.proj", "norm1_context.linear",
                          "context_embedder"]}
    for example, targets in cases.items():
        layout = example.split("_")[0]
        run = _train_lora(example, tiny, tmp_path / layout, targets)
        out = tmp_path / f"{layout}_comfyui.safetensors"
        assert main(["export", str(run), "--format", "comfyui", "--out", str(out)]) == 0
        lora = load_file(str(out))
        assert all(k.startswith("transformer.") for k in lora)
        with safe_open(str(run / "lora.safetensors"), framework="pt") as f:
            assert len(lora) == 3 * len(f.keys()) // 2  # down, up, alpha for each adapted layer
        want = _output(layout, _trained(run, layout))
        base = _base(tiny, layout)
        assert (_output(layout, base) - want).abs().max() > 1e-3  # the adapters matter
        assert load_like_comfyui(base, layout, lora) == set(), layout
        torch.testing.assert_close(_output(layout, base), want, rtol=1e-5, atol=1e-5)


def test_a_layer_or_family_comfyui_would_drop_is_refused_before_training(tmp_path, capsys):
    """ComfyUI loads no LoRA of diffusers' 3-D UNets, and maps no SD3.5 `attn2` layer ("lora key not loaded"): said
    before launch when checkpoint.export_every writes comfyui files, not at the first export."""
    from diffpipe.models.families.sd3.sd3 import SD3Family

    cmd = ["train", str(ROOT / "examples" / "video_tiny.toml"), "--output-dir", str(tmp_path / "run"),
           "--set", "model.architecture=\"unet3d\"", "--set", "adapter.type=\"lora\"",
           "--set", "checkpoint.export_every=5", "--set", "checkpoint.export_format=\"comfyui\""]
    assert main(cmd) == 2
    assert "ComfyUI loads no LoRA of 'unet3d' models" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="maps no layer named 'transformer_blocks.0.attn2.to_q'"):
        SD3Family().comfyui_lora_names({}, ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn2.to_q"])


def test_a_wan_lora_loads_through_diffusers_reader_of_wans_own_layout(tmp_path):
    """Wan's LoRA under `diffusion_model.` and Wan's own layer names (ComfyUI's Wan layout, diffusion-pipe's):
    diffusers' converter of that layout, which knows Wan's names, loads it to the trained output."""
    from diffusers import WanPipeline

    from diffpipe.build import build_backbone
    from diffpipe.config_files import load_config

    run = tmp_path / "lora"
    cmd = ["train", str(ROOT / "examples" / "video_tiny.toml"), "--output-dir", str(run), "--set",
           "train.max_steps=3", "--set", "train.learning_rate=3e-2", "--set", "checkpoint.every=0", "--set",
           "output.sample_every_end=false", "--set", "adapter.type=\"lora\"", "--set", "adapter.rank=4", "--set",
           "adapter.alpha=8.0", "--set", 'adapter.target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", '
           '"ffn.net.2", "proj_out"]']
    assert run_command(cmd).returncode == 0
    out = tmp_path / "wan_comfyui.safetensors"
    assert main(["export", str(run), "--format", "comfyui", "--out", str(out)]) == 0
    keys = set(load_file(str(out)))
    assert {"diffusion_model.blocks.0.self_attn.q.lora_down.weight", "diffusion_model.blocks.1.cross_attn.o.lora_up.weight",
            "diffusion_model.blocks.0.ffn.2.lora_up.weight", "diffusion_model.head.head.lora_down.weight"} <= keys
    assert not any(k.endswith(".alpha") for k in keys)  # the scale alpha / rank is in lora_up
    want = wan_output(_trained(run, "wan"))
    base = build_backbone(load_config(run / "config.toml"), "cpu").model  # the seeded base the run started from
    assert (wan_output(base) - want).abs().max() > 1e-3  # the adapters matter
    pipe = WanPipeline(transformer=base, vae=None, text_encoder=None, tokenizer=None, scheduler=None)
    pipe.load_lora_weights(out)
    torch.testing.assert_close(wan_output(pipe.transformer), want, rtol=1e-5, atol=1e-5)
