"""Flux and SD3 pipeline folders (written by diffusers' own FluxPipeline / StableDiffusion3Pipeline): text encoded
exactly as those pipelines' `encode_prompt`, the transformer loaded from transformer/, folders that mix components
refused before launch, and the whole run (train on photos across 2 stages, sample, export) as a user does it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from PIL import Image
from safetensors.torch import load_file

from diffpipe.build import build_backbone, build_text_encoder, example_inputs, sample_shape
from diffpipe.config import ConfigError
from diffpipe.config_files import build_config
from diffpipe.models.families.flux.text import FluxText
from diffpipe.models.families.sd3.text import SD3Text
from diffpipe.models.loading import CheckpointError
from diffpipe.preflight import check_before_launch

from ..helpers import Ran, check_diffusers_lora, grid_size, run_command

ROOT = Path(__file__).parent.parent.parent
CAPTIONS = ["a photo of the chinese temple", "", "a close photo of a pink flower with words unknown to the vocab"]


def _config(folder, architecture, **data):
    return build_config({"model": {"path": str(folder), "architecture": architecture},
                         "data": {"dataset": "folder", "path": str(folder), "resolution": 128, "bucket_step": 32,
                                  **data}})


def test_flux_text_is_encoded_as_diffusers_flux_pipeline_does(tiny):
    pipe = FluxPipeline.from_pretrained(tiny / "flux")
    with torch.no_grad():  # as the pipeline's __call__ runs it (T5's CPU attention kernel differs with gradients)
        expected, expected_pooled, _ = pipe.encode_prompt(CAPTIONS, prompt_2=None, device="cpu")
    hidden, pooled = FluxText.from_folder(tiny / "flux").encode(CAPTIONS)
    assert hidden.shape == (3, 512, 64) and pooled.shape == (3, 32)  # T5's states, CLIP's pooled output
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    torch.testing.assert_close(pooled, expected_pooled, rtol=0, atol=0)


def test_sd3_text_is_encoded_as_diffusers_sd3_pipeline_does(tiny):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny / "sd3")
    with torch.no_grad():  # as the pipeline's __call__ runs it
        expected, _, expected_pooled, _ = pipe.encode_prompt(CAPTIONS, prompt_2=None, prompt_3=None, device="cpu",
                                                             do_classifier_free_guidance=False)
    hidden, pooled = SD3Text.from_folder(tiny / "sd3").encode(CAPTIONS)
    assert hidden.shape == (3, 77 + 256, 64) and pooled.shape == (3, 64)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    torch.testing.assert_close(pooled, expected_pooled, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["flux", "sd3"])
def test_the_transformer_and_text_encoders_load_with_matching_shapes(tiny, layout):
    config = _config(tiny / layout, layout)
    backbone = build_backbone(config)
    transformer = type(backbone.model).from_pretrained(tiny / layout, subfolder="transformer")
    for name, tensor in transformer.state_dict().items():
        assert torch.equal(backbone.model.state_dict()[name], tensor), name  # the folder's weights, not random ones
    assert sample_shape(config, backbone) == (4, 16, 16) and config.train.objective == "flow_matching"
    _, conditions = example_inputs(config, backbone, 2)
    hidden, pooled = build_text_encoder(config, backbone).encode(["a photo", "a photo"])
    assert hidden.shape == conditions["encoder_hidden_states"].shape
    assert pooled.shape == conditions["pooled_projections"].shape


def test_folders_that_mix_components_are_refused_before_launch(tiny, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny / "flux", mixed)
    t5 = mixed / "text_encoder_2" / "config.json"
    t5.write_text(t5.read_text().replace('"d_model": 64', '"d_model": 128'))
    with pytest.raises(CheckpointError, match="text encoders give 128-wide states and 32-wide pooled embeddings but "
                                              "the transformer takes 64 and 32"):
        check_before_launch(_config(mixed, "flux", path=str(tiny / "photos")))
    with pytest.raises(CheckpointError, match="sides are multiples of 2 .16 pixels through this VAE.; use a multiple of 16"):
        check_before_launch(_config(tiny / "sd3", "sd3", path=str(tiny / "photos"), bucket_step=8))
    with pytest.raises(ConfigError, match="model.architecture = 'flux' but .* StableDiffusionPipeline folder whose "
                                          "backbone is UNet2DConditionModel .architecture 'unet2d'."):
        _config(tiny / "sd15", "flux", path=str(tiny / "photos"))  # a UNet folder as Flux: refused as the config loads
    unet_only = tmp_path / "unet_only"  # a folder that is no pipeline (no model_index.json) reaches the loader
    shutil.copytree(tiny / "sd15" / "unet", unet_only / "unet")
    with pytest.raises(CheckpointError, match="no config.json there .nor in its transformer/ subfolder"):
        build_backbone(_config(unet_only, "flux", path=str(tiny / "photos")), "meta")


def _train(example: str, tiny: Path, out: Path, *extra: str) -> Ran:
    layout = example.split("_")[0]
    cmd = ["train", str(ROOT / "examples" / f"{example}.toml"), "--output-dir",
           str(out), "--set", f"model.path=\"{tiny / layout}\"", "--set", f"data.path=\"{tiny / 'photos'}\"", *extra]
    return run_command(cmd)


def test_the_tiny_sd3_example_trains_samples_and_exports_as_a_user_runs_it(tiny, tmp_path):
    run = tmp_path / "run"
    result = _train("sd3_tiny", tiny, run, "--set", "train.max_steps=30", "--set", "sample.steps=3",
                    "--set", "sample.seeds=[0]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 stage(s)" in result.stdout
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and all(l == l for l in losses)
    assert sum(losses[-10:]) < sum(losses[:10])  # it learns: flow matching's loss starts near 2 (noise - x0)
    assert Image.open(run / "samples.png").size == grid_size(2, 1, (128, 128), [0])  # 2 prompts x 1 seed, decoded by the VAE
    out = tmp_path / "pipeline"
    export = ["export", str(run), "--format", "diffusers", "--out", str(out)]
    assert run_command(export).returncode == 0
    pipeline = StableDiffusion3Pipeline.from_pretrained(out)
    trained = load_file(str(run / "model.safetensors"))
    for name, tensor in pipeline.transformer.state_dict().items():
        assert torch.equal(trained[name], tensor), name


@torch.no_grad()
def _flux_output(transformer) -> torch.Tensor:
    from diffpipe.models.family import Feed
    from diffpipe.models.families.flux.flux import FluxFamily

    family, gen = FluxFamily(), torch.Generator().manual_seed(0)
    feed = Feed(family, transformer.config, guidance=3.5)
    conditions = feed.conditions(torch.randn(2, 16, 64, generator=gen), torch.randn(2, 32, generator=gen),
                                 torch.zeros(2, 6), (16, 12))
    conditions["timestep"] = torch.tensor([500.0, 20.0])
    return family.diffusers_forward(transformer.eval(), feed.pack(torch.randn(2, 4, 16, 12, generator=gen)), conditions)


def test_the_tiny_flux_example_trains_lora_and_its_export_loads_in_diffusers(tiny, tmp_path, capsys):
    """The Flux example as LoRA (the SD3 one above trains every weight): samples, and a diffusers-layout LoRA file
    that FluxPipeline.load_lora_weights turns into the trained model's output; the merged model in BFL's layout."""
    from diffpipe.cli import main
    from diffpipe.models.families.flux.release_layout import flux_from_bfl

    run = tmp_path / "lora"
    result = _train("flux_tiny", tiny, run, "--set", "train.max_steps=20", "--set", "train.learning_rate=1e-2",
                    "--set", "train.warmup_steps=0", "--set", "checkpoint.every=0", "--set", "adapter.type=\"lora\"",
                    "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0", "--set", "sample.steps=3",
                    "--set", "sample.seeds=[0]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 stage(s)" in result.stdout
    assert Image.open(run / "samples.png").size == grid_size(2, 1, (128, 128), [0])
    check_diffusers_lora(FluxPipeline, tiny / "flux", run, tmp_path / "out", _flux_output)
    assert main(["export", str(run), "--format", "kohya", "--out", str(tmp_path / "k.safetensors")]) == 2  # UNets only
    assert "--format kohya writes UNet layouts" in capsys.readouterr().err
    original = tmp_path / "flux1-finetune.safetensors"  # the merged model in BFL's layout, as ComfyUI loads Flux.1
    assert main(["export", str(run), "--format", "original", "--out", str(original)]) == 0
    bfl = load_file(str(original))
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.0.linear1.weight" in bfl
    merged = load_file(str(run / "model.safetensors"))
    assert all(torch.equal(tensor, merged[name]) for name, tensor in flux_from_bfl(bfl).items())
