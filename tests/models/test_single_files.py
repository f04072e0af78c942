"""Backbones as users share them (issue 29): one .safetensors file in the family's own release layout (BFL's Flux,
Chroma's, Stability's SD3, Wan's own, the A1111/ComfyUI SDXL layout), trained on a folder of images or clips with the VAE, text encoders and
scheduler of their base model's diffusers folder (`model.components`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe.errors import ConfigError
from diffpipe.models.families.flux.flux import FLUX_PRESETS
from diffpipe.models.families.flux.release_layout import flux_from_bfl, flux_to_bfl, is_bfl_layout, is_chroma_layout

from ..helpers import run_command

ROOT = Path(__file__).parent.parent.parent


def test_a_bfl_flux_file_reads_as_diffusers_own_reader_reads_it_at_flux1_width():
    """diffusers' reader (`convert_flux_transformer_checkpoint_to_diffusers`) assumes Flux.1's width of 3072, so the
    two are compared there: one double and one single block of Flux.1-dev's size, in bf16 (1.1 GB)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        shapes = FluxTransformer2DModel(**dict(FLUX_PRESETS["dev"], num_layers=1, num_single_layers=1)).state_dict()
    gen = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(v.shape, generator=gen, dtype=torch.bfloat16) for k, v in shapes.items()}
    bfl = flux_to_bfl(ours)
    assert is_bfl_layout(bfl) and "single_blocks.0.linear1.weight" in bfl and "double_blocks.0.img_attn.qkv.bias" in bfl
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    mine = flux_from_bfl({f"model.diffusion_model.{k}": v for k, v in bfl.items()})  # ComfyUI's saved prefix too
    assert set(theirs) == set(mine) == set(ours)
    for key in ours:
        assert torch.equal(mine[key], theirs[key]) and torch.equal(mine[key], ours[key]), key


def test_a_chroma_release_file_reads_as_diffusers_own_reader_reads_it_at_chroma1_width():
    """Chroma's releases: BFL's names less the modulation Chroma pruned, with its distilled guidance layer. Compared
    with diffusers' `convert_chroma_transformer_checkpoint_to_diffusers` (which assumes the width of 3072) on one
    double and one single block and the whole guidance layer of Chroma1-HD's size, in bf16."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    from diffpipe.models.families.flux.chroma import CHROMA_PRESETS

    with torch.device("meta"):
        shapes = ChromaTransformer2DModel(**dict(CHROMA_PRESETS["hd"], num_layers=1, num_single_layers=1)).state_dict()
    gen = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(v.shape, generator=gen, dtype=torch.bfloat16) for k, v in shapes.items()}
    original = flux_to_bfl(ours)
    assert is_chroma_layout(original) and "distilled_guidance_layer.norms.4.scale" in original
    assert not any("_mod." in k or "modulation" in k for k in original)  # pruned by Chroma
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(original))
    mine = flux_from_bfl({f"model.diffusion_model.{k}": v for k, v in original.items()})  # as ComfyUI saves it
    assert set(theirs) == set(mine) == set(ours)
    for key in ours:
        assert torch.equal(mine[key], theirs[key]) and torch.equal(mine[key], ours[key]), key
    assert not is_chroma_layout(flux_to_bfl(_flux_one_block()))  # Flux's is not Chroma's


def _flux_one_block() -> dict[str, torch.Tensor]:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**dict(FLUX_PRESETS["digits"], num_layers=1, num_single_layers=1)).state_dict()


def test_wans_own_layout_round_trips_through_diffusers_reader():
    """Every tensor of a Wan transformer (text-to-video, and image-to-video with its image embedder and image
    keys) written in Wan's layout and read back by diffusers' `convert_wan_transformer_to_diffusers`."""
    from diffusers import WanTransformer3DModel

    from diffpipe.models.families.wan.wan import WAN_PRESETS
    from diffpipe.models.families.wan.release_layout import is_wan_layout, wan_from_original, wan_to_original

    for extra in ({}, {"image_dim": 32, "added_kv_proj_dim": 48}):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**dict(WAN_PRESETS["digits"], **extra))
        ours = model.state_dict()
        original = wan_to_original(ours)
        assert is_wan_layout(original) and "blocks.0.norm3.weight" in original and "head.modulation" in original
        if extra:
            assert {"img_emb.proj.0.weight", "blocks.0.cross_attn.k_img.weight"} <= set(original)
        back = wan_from_original({f"model.diffusion_model.{k}": v for k, v in original.items()})
        assert set(back) == set(ours)
        assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_stabilitys_sd3_layout_round_trips_through_diffusers_reader():
    """Every tensor of an SD3 transformer, and of an SD3.5 one (query/key norms, a second attention in block 0),
    written in Stability's layout and read back by diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`."""
    from diffusers import SD3Transformer2DModel

    from diffpipe.models.families.sd3.sd3 import SD3_PRESETS
    from diffpipe.models.families.sd3.release_layout import is_sai_layout, sd3_from_sai, sd3_to_sai

    for extra in ({}, {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}):
        torch.manual_seed(0)
        ours = SD3Transformer2DModel(**dict(SD3_PRESETS["digits"], **extra)).state_dict()
        original = sd3_to_sai(ours)
        assert is_sai_layout(original) and "final_layer.adaLN_modulation.1.weight" in original
        if extra:
            assert {"joint_blocks.0.x_block.attn2.qkv.weight", "joint_blocks.0.x_block.attn.ln_q.weight"} <= set(original)
        back = sd3_from_sai({f"model.diffusion_model.{k}": v for k, v in original.items()})
        assert set(back) == set(ours)
        assert all(torch.equal(back[k], ours[k]) for k in ours)


def _single_file(tiny: Path, layout: str, out: Path) -> Path:
    """The tiny pipeline's backbone as one file in its family's release layout."""
    if layout in ("flux", "chroma"):
        weights = flux_to_bfl(load_file(str(tiny / layout / "transformer" / "diffusion_pytorch_model.safetensors")))
    elif layout == "sd3":
        from diffpipe.models.families.sd3.release_layout import sd3_to_sai

        weights = sd3_to_sai(load_file(str(tiny / "sd3" / "transformer" / "diffusion_pytorch_model.safetensors")))
    elif layout == "wan":
        from diffpipe.models.families.wan.release_layout import wan_to_original

        weights = wan_to_original(load_file(str(tiny / "wan" / "transformer" / "diffusion_pytorch_model.safetensors")))
    else:
        from diffpipe.models.single_file import to_original_layout

        config = json.loads((tiny / "sdxl" / "unet" / "config.json").read_text())
        weights = to_original_layout(load_file(str(tiny / "sdxl" / "unet" / "diffusion_pytorch_model.safetensors")),
                                     config)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out))
    return out


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layout,example,data", [("flux", "flux_tiny", "photos"), ("chroma", "chroma_tiny", "photos"),
                                                ("sdxl", "photos", "photos"),
                                                ("sd3", "sd3_tiny", "photos"), ("wan", "wan_clips", "clips")])
def test_a_single_file_trains_with_its_base_folders_components(tiny, tiny_video, tmp_path, monkeypatch, layout,
                                                               example, data):
    """The same first losses as the base folder itself gives: the file's weights became the same model."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = tiny_video if layout == "wan" else tiny
    single = _single_file(base, layout, tmp_path / f"{layout}-finetune.safetensors")
    folder = shutil.copytree(base / data, tmp_path / data)  # its latent cache is written beside the images
    common = ["--set", f"data.path=\"{folder}\"", "--set", "train.max_steps=2", "--set", "pipeline.stages=1",
              "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false"]
    runs = {}
    for name, model in (("folder", [f"model.path=\"{base / layout}\""]),
                        ("file", [f"model.path=\"{single}\"", f"model.components=\"{base / layout}\""])):
        runs[name] = tmp_path / name
        cmd = ["train", str(ROOT / "examples" / f"{example}.toml"), "--output-dir", str(runs[name]), *common]
        for setting in model:
            cmd += ["--set", setting]
        result = run_command(cmd)
        assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(runs["file"]) == _losses(runs["folder"])
    assert len(list((tmp_path / "cache" / "diffpipe" / "converted").glob(f"{layout}-finetune-*"))) == 1


def test_components_that_are_not_a_pipeline_folder_are_refused_with_the_reason(tmp_path):
    from diffpipe.config_files import load_config

    with pytest.raises(ConfigError, match="model.components = .* is not a diffusers pipeline folder"):
        load_config(ROOT / "examples" / "flux_tiny.toml", [f"model.components=\"{tmp_path}\""])


def _fp8_scaled(weights: dict[str, torch.Tensor], scale_name: str) -> tuple[dict, dict]:
    """`weights` as ComfyUI's fp8 "scaled" files hold them (each matrix in float8 e4m3 with one fp32 scale, its
    input scale, the file's `scaled_fp8` marker), and the bf16 weights they stand for (each times its scale)."""
    scaled, meant = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for key, value in weights.items():
        if value.dim() == 2 and key.endswith(".weight"):
            scale = value.abs().max().float() / 448
            quantised = (value.float() / scale).to(torch.float8_e4m3fn)
            base = key.removesuffix(".weight")
            scaled.update({key: quantised, base + scale_name: scale.reshape(()), base + ".scale_input": torch.ones(())})
            meant[key] = (quantised.float() * scale).to(torch.bfloat16)
        else:
            scaled[key] = meant[key] = value
    return scaled, meant


@pytest.mark.parametrize("scale_name", [".scale_weight", ".weight_scale"], ids=["comfyui", "comfyui-newer"])
def test_a_comfyui_fp8_scaled_flux_file_trains_as_the_weights_it_stands_for(tiny, tmp_path, monkeypatch, scale_name):
    """BFL's layout in float8 with a scale per matrix (ComfyUI's flux_dev_fp8_scaled files): each weight is read as
    float8 x scale in bf16, as ComfyUI computes it, so the run's losses are those of a bf16 file of those weights."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bfl = flux_to_bfl(load_file(str(tiny / "flux" / "transformer" / "diffusion_pytorch_model.safetensors")))
    scaled, meant = _fp8_scaled(bfl, scale_name)
    files = {"scaled": tmp_path / "flux-fp8-scaled.safetensors", "meant": tmp_path / "flux-bf16.safetensors"}
    save_file(scaled, str(files["scaled"]))
    save_file({k: v.contiguous() for k, v in meant.items()}, str(files["meant"]))
    photos = shutil.copytree(tiny / "photos", tmp_path / "photos")
    losses = {}
    for name, single in files.items():
        cmd = ["train", str(ROOT / "examples" / "flux_tiny.toml"), "--output-dir", str(tmp_path / name),
               "--set", f"data.path=\"{photos}\"", "--set", "train.max_steps=2", "--set", "pipeline.stages=1",
               "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false",
               "--set", f"model.path=\"{single}\"", "--set", f"model.components=\"{tiny / 'flux'}\""]
        result = run_command(cmd)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = _losses(tmp_path / name)
    assert losses["scaled"] == losses["meant"]


def test_fp8_scales_per_row_are_applied_and_block_wise_ones_refused():
    from diffpipe.models.single_file import dequantised

    weight = torch.randn(4, 6).to(torch.float8_e4m3fn)
    rows = torch.tensor([[1.0], [2.0], [0.5], [4.0]])
    got = dequantised({"a.weight": weight, "a.weight_scale": rows})
    assert list(got) == ["a.weight"] and torch.equal(got["a.weight"], (weight.float() * rows).bfloat16())
    with pytest.raises(ValueError, match="block-wise"):
        dequantised({"a.weight": weight, "a.weight_scale": torch.ones(2, 3)})
