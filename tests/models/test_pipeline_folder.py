"""Diffusers pipeline folders in the SD 1.5 and SDXL layouts: text encoded exactly as diffusers' own pipelines do,
the VAE and the UNet loaded from them, the scheduler deciding the objective, pickle weights refused unread."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

from diffpipe.build import build_backbone, build_text_encoder, example_inputs, sample_shape
from diffpipe.config import ConfigError
from diffpipe.config_files import build_config
from diffpipe.models.loading import CheckpointError
from diffpipe.models.folder import scheduler_objective
from diffpipe.models.families.unet.text import PipelineText
from diffpipe.models.vae import load_vae, vae_scale_factor

CAPTIONS = ["a photo of the chinese temple", "", "a close photo of a pink flower with words unknown to the vocab"]


def _config(folder, **data):
    return build_config({"model": {"path": str(folder)},
                         "data": {"dataset": "folder", "path": str(folder), "resolution": 128, **data}})


def test_sd15_text_is_encoded_as_diffusers_stable_diffusion_pipeline_does(tiny):
    pipe = StableDiffusionPipeline.from_pretrained(tiny / "sd15", safety_checker=None, requires_safety_checker=False)
    expected, _ = pipe.encode_prompt(CAPTIONS, "cpu", 1, False)
    text = PipelineText.from_folder(tiny / "sd15")
    hidden, pooled = text.encode(CAPTIONS)
    assert hidden.shape == (3, 77, 32) and pooled.shape == (3, 0)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_sdxl_text_is_encoded_as_diffusers_sdxl_pipeline_does(tiny):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny / "sdxl")
    expected, _, expected_pooled, _ = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
    text = PipelineText.from_folder(tiny / "sdxl")
    hidden, pooled = text.encode(CAPTIONS)
    assert hidden.shape == (3, 77, 64) and pooled.shape == (3, 32)  # penultimate states of both, concatenated
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    torch.testing.assert_close(pooled, expected_pooled, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["sd15", "sdxl"])
def test_both_layouts_load_unet_vae_and_text_with_matching_shapes(tiny, layout):
    config = _config(tiny / layout)
    backbone = build_backbone(config)
    unet = type(backbone.model).from_pretrained(tiny / layout, subfolder="unet")
    for name, tensor in unet.state_dict().items():
        assert torch.equal(backbone.model.state_dict()[name], tensor), name  # the folder's weights, not random ones
    assert vae_scale_factor(tiny / layout) == 8 and sample_shape(config, backbone) == (4, 16, 16)
    inputs, conditions = example_inputs(config, backbone, 2)
    text = build_text_encoder(config, backbone)
    hidden, pooled = text.encode(["a photo", "a photo"])
    assert hidden.shape == conditions["encoder_hidden_states"].shape
    if layout == "sdxl":
        assert pooled.shape == conditions["text_embeds"].shape
    vae = load_vae(tiny / layout)
    assert vae.encode(torch.zeros(1, 3, 64, 32)).latent_dist.mean.shape == (1, 4, 8, 4)
    assert config.train.objective == "epsilon"  # the scheduler's prediction_type


def test_the_scheduler_decides_the_objective_unless_the_config_does(tiny, tmp_path):
    folder = tmp_path / "sdxl"
    shutil.copytree(tiny / "sdxl", folder)
    path = folder / "scheduler" / "scheduler_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(dict(cfg, prediction_type="v_prediction")))
    assert scheduler_objective(folder) == "v_prediction" and _config(folder).train.objective == "v_prediction"
    explicit = build_config({"model": {"path": str(folder)}, "train": {"objective": "flow_matching"}})
    assert explicit.train.objective == "flow_matching"
    path.write_text(json.dumps(dict(cfg, beta_schedule="linear")))
    with pytest.raises(ConfigError, match="not Stable Diffusion's scaled_linear"):
        _config(folder)


def test_pickle_weights_in_a_pipeline_folder_are_refused_unread(tiny, tmp_path):
    folder = tmp_path / "sdxl"
    shutil.copytree(tiny / "sdxl", folder)
    vae_file = folder / "vae" / "diffusion_pytorch_model.safetensors"
    vae_file.rename(vae_file.with_suffix(".bin"))  # a pickle-era download (the bytes are never read)
    with pytest.raises(CheckpointError, match="only pickle weight files.*diffusion_pytorch_model.bin"):
        load_vae(folder)
    unet_file = folder / "unet" / "diffusion_pytorch_model.safetensors"
    unet_file.rename(unet_file.with_suffix(".bin"))
    with pytest.raises(CheckpointError, match="only pickle weight files"):
        build_backbone(_config(folder))
    encoder_file = folder / "text_encoder_2" / "model.safetensors"
    encoder_file.rename(folder / "text_encoder_2" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="text_encoder_2: only pickle weight files"):
        PipelineText.from_folder(folder)


@pytest.mark.parametrize("layout,missing", [("sdxl", "tokenizer_2"), ("flux", "tokenizer_2"), ("sd3", "tokenizer_3")])
def test_a_pipeline_folder_without_a_tokenizer_names_it(tiny, tmp_path, layout, missing):
    """SDXL without tokenizer_2/ said "install sentencepiece" (transformers' fallback to another tokenizer)."""
    folder = tmp_path / layout
    shutil.copytree(tiny / layout, folder)
    shutil.rmtree(folder / missing)
    with pytest.raises(CheckpointError, match=f"the pipeline folder has no {missing}/ .*which its "
                                              f"text_encoder_{missing[-1]}/ needs"):
        config = _config(folder)
        build_text_encoder(config, build_backbone(config, "meta"))


def test_a_transformer_in_shards_loads_as_one_file_does(tiny, tmp_path):
    """Released FLUX.1, Qwen-Image and Wan 14B folders hold their transformer in shards named by an index file
    (diffusers' max_shard_size); they load to the same weights as one file, and a missing shard is named."""
    from diffusers import FluxTransformer2DModel

    from diffpipe.build import build_backbone

    folder = tmp_path / "flux"
    shutil.copytree(tiny / "flux", folder)
    shutil.rmtree(folder / "transformer")
    FluxTransformer2DModel.from_pretrained(tiny / "flux", subfolder="transformer").save_pretrained(
        folder / "transformer", max_shard_size="100KB")
    shards = sorted((folder / "transformer").glob("*-of-*.safetensors"))
    assert len(shards) > 3 and (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    one, sharded = (build_backbone(_config(f)).model.state_dict() for f in (tiny / "flux", folder))
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)
    shards[2].unlink()
    with pytest.raises(CheckpointError, match=f"1 are missing \\({shards[2].name}\\)"):
        build_backbone(_config(folder))


@pytest.mark.parametrize("component,weights", [("text_encoder_2", "model.safetensors"),
                                               ("vae", "diffusion_pytorch_model.safetensors")])
def test_a_pickle_only_frozen_component_is_refused_before_launch_and_writes_nothing(tiny, tmp_path, capsys,
                                                                                   component, weights):
    """The text encoders were refused inside a training process (exit 1, after the run folder was written); every
    frozen component is now refused before any process starts, as the backbone's weights are (issue 58)."""
    from diffpipe.cli import main

    folder = tmp_path / "sdxl"
    shutil.copytree(tiny / "sdxl", folder)
    (folder / component / weights).rename(folder / component / "pytorch_model.bin")
    run = tmp_path / "run"
    assert main(["train", str(Path(__file__).parent.parent.parent / "examples" / "photos.toml"), "--output-dir",
                 str(run), "--set", f'model.path="{folder}"', "--set", f'data.path="{tiny / "photos"}"',
                 "--set", "data.cache=false", "--set", "pipeline.stages=2"]) == 2
    assert f"{component}: only pickle weight files (pytorch_model.bin)" in capsys.readouterr().err
    assert not run.exists()
