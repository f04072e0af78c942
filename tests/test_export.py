"""Exports loaded by their real consumers: a LoRA trained over 2 stages, written in diffusers' and kohya's layouts,
loaded by diffusers' `load_lora_weights` (whose kohya conversion is the key-by-key check); full fine-tunes as a
diffusers folder (`from_pretrained`) and as one original-layout file (`from_single_file`). Each loaded model's
output equals diffpipe's own trained model on the same inputs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe.cli import main

from .helpers import run_command

EXAMPLE = Path(__file__).parent.parent / "examples" / "photos.toml"


def _train(tiny: Path, photos: Path, out: Path, layout: str, *extra: str) -> Path:
    cmd = ["train", str(EXAMPLE), "--output-dir", str(out),
           "--set", f"model.path=\"{tiny / layout}\"", "--set", f"data.path=\"{photos}\"", "--set", "train.max_steps=3",
           "--set", "train.learning_rate=1e-2", "--set", "train.warmup_steps=0", "--set", "checkpoint.every=0",
           "--set", "output.sample_every_end=false", *extra]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _inputs(sdxl: bool):
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 16, 12, generator=gen), torch.tensor([500.0, 20.0])
    hidden = torch.randn(2, 77, 64 if sdxl else 32, generator=gen)
    added = {"text_embeds": torch.randn(2, 32, generator=gen),
             "time_ids": torch.tensor([[128.0, 96, 0, 0, 128, 96]] * 2)} if sdxl else None
    return x, t, hidden, added


@torch.no_grad()
def _output(unet: UNet2DConditionModel, sdxl: bool) -> torch.Tensor:
    x, t, hidden, added = _inputs(sdxl)
    return unet.eval()(x, t, encoder_hidden_states=hidden, added_cond_kwargs=added).sample


def _trained(run: Path) -> UNet2DConditionModel:
    unet = UNet2DConditionModel(**json.loads((run / "model_config.json").read_text()))
    unet.load_state_dict(load_file(str(run / "model.safetensors")))
    return unet


@pytest.fixture(scope="module")
def photos(tiny, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("export") / "photos"
    shutil.copytree(tiny / "photos", folder)
    return folder


@pytest.mark.parametrize("layout,stages", [("sdxl", 2), ("sd15", 1)])
def test_lora_exports_load_in_diffusers_and_reproduce_the_trained_model(tiny, photos, tmp_path, layout, stages):
    """SD 1.5 with conv_in and conv_out adapted too: modules the UNet's first and last units hold themselves."""
    sdxl = layout == "sdxl"
    targets = [] if sdxl else ["--set", 'adapter.target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv_in", '
                               '"conv_out"]']
    run = _train(tiny, photos, tmp_path / "run", layout, "--set", "adapter.type=\"lora\"", "--set", "adapter.rank=4",
                 "--set", "adapter.alpha=8.0", "--set", f"pipeline.stages={stages}", *targets)
    want = _output(_trained(run), sdxl)  # the base with the adapters merged, as diffpipe samples with it
    pipeline_class = StableDiffusionXLPipeline if sdxl else StableDiffusionPipeline
    for fmt, out in (("diffusers", tmp_path / "lora"), ("kohya", tmp_path / "lora_kohya.safetensors"),
                     ("comfyui", tmp_path / "lora_comfyui.safetensors")):  # ComfyUI reads kohya's UNet files
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 0
        pipe = pipeline_class.from_pretrained(tiny / layout)
        base = _output(pipe.unet, sdxl)
        pipe.load_lora_weights(out / "pytorch_lora_weights.safetensors" if fmt == "diffusers" else out)
        got = _output(pipe.unet, sdxl)
        assert (base - want).abs().max() > 1e-3  # the adapters matter
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with safe_open(str(tmp_path / "lora_kohya.safetensors"), framework="pt") as f:
        keys, header = list(f.keys()), f.metadata()
    prefix = "lora_unet_input_blocks_" if sdxl else "lora_unet_down_blocks_"  # kohya's own naming per family
    assert any(k.startswith(prefix) for k in keys) and all(k.startswith("lora_unet_") for k in keys)
    if not sdxl:
        assert {"lora_unet_conv_in.lora_down.weight", "lora_unet_conv_out.lora_up.weight"} <= set(keys)
    assert header["ss_network_dim"] == "4" and json.loads(header["diffpipe.lora"])["lora_alpha"] == 8.0


def test_full_exports_load_as_a_diffusers_pipeline_and_as_one_original_file(tiny, photos, tmp_path):
    run = _train(tiny, photos, tmp_path / "run", "sdxl", "--set", "pipeline.stages=1")
    want = _output(_trained(run), True)
    assert (_output(UNet2DConditionModel.from_pretrained(tiny / "sdxl", subfolder="unet"), True) - want).abs().max() > 1e-3
    folder = tmp_path / "pipeline"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(folder)]) == 0
    pipe = StableDiffusionXLPipeline.from_pretrained(folder)  # the whole pipeline: base components copied
    torch.testing.assert_close(_output(pipe.unet, True), want, rtol=0, atol=0)
    assert main(["export", str(run), "--format", "original", "--out", str(tmp_path / "unet")]) == 0
    single = UNet2DConditionModel.from_single_file(str(tmp_path / "unet.safetensors"), config=str(tiny / "sdxl"),
                                                   subfolder="unet")
    torch.testing.assert_close(_output(single, True), want, rtol=0, atol=0)
    assert main(["export", str(run), "--format", "kohya", "--out", str(tmp_path / "x")]) == 2  # no adapters to write


def test_a_checkpoint_exports_as_the_finished_run_would(tiny, photos, tmp_path, capsys):
    """`diffpipe export RUN --step N`: the LoRA of the checkpoint after the last step is the finished run's, tensor
    for tensor; an earlier checkpoint's differs; a step without a checkpoint is refused naming those there are.
    checkpoint.export_every's files, written while training, are the same as the checkpoints' exports."""
    run = _train(tiny, photos, tmp_path / "run", "sd15", "--set", "adapter.type=\"lora\"", "--set", "adapter.rank=4",
                 "--set", "checkpoint.every=2", "--set", "checkpoint.export_every=2",
                 "--set", "checkpoint.export_format=\"kohya\"")
    files = {}
    for step in (None, 3, 2):
        out = tmp_path / f"kohya-{step}.safetensors"
        assert main(["export", str(run), "--format", "kohya", "--out", str(out),
                     *(["--step", str(step)] if step else [])]) == 0
        files[step] = load_file(str(out))
    assert files[None].keys() == files[3].keys() == files[2].keys()
    assert all(torch.equal(files[None][k], files[3][k]) for k in files[None])
    assert any(not torch.equal(files[3][k], files[2][k]) for k in files[3] if k.endswith("lora_up.weight"))
    # checkpoint.export_every wrote the same files while it trained: after step 2 and after the last
    during = {step: load_file(str(run / "exports" / f"lora-step-{step:08d}.safetensors")) for step in (2, 3)}
    for step in (2, 3):
        assert during[step].keys() == files[step].keys()
        assert all(torch.equal(during[step][k], files[step][k]) for k in files[step])
    capsys.readouterr()
    assert main(["export", str(run), "--format", "kohya", "--out", str(tmp_path / "x"), "--step", "1"]) == 2
    assert "no checkpoint after step 1; the checkpoints there are after steps 2, 3" in capsys.readouterr().err
    # the run folder holds only what diffpipe writes (its exports/ too), so --overwrite replaces it (issue 56)
    from diffpipe.run_folder import WRITTEN, prepare_new_run

    assert {p.name for p in run.iterdir()} <= WRITTEN
    prepare_new_run(run, overwrite=True).release()
    assert not (run / "exports").exists()


def test_export_every_epochs_writes_the_adapters_after_each_epoch(tiny, photos, tmp_path):
    """checkpoint.export_every_epochs = 2: the 16 photos in batches of 8 make 3 steps an epoch (a batch per bucket,
    the short ones filled up), so after steps 6 and 12 and after the last, step 13."""
    run = _train(tiny, photos, tmp_path / "run", "sd15", "--set", "adapter.type=\"lora\"", "--set", "adapter.rank=4",
                 "--set", "train.max_steps=13", "--set", "checkpoint.export_every_epochs=2")
    assert sorted(p.name for p in (run / "exports").iterdir()) == [
        f"lora-step-{step:08d}.safetensors" for step in (6, 12, 13)]


def test_export_every_is_refused_before_launch_where_it_cannot_be_written(tmp_path, capsys):
    """A full fine-tune has no adapters to export every N steps; kohya's layout holds UNet LoRAs only: both said
    before any process starts."""
    flux = Path(__file__).parent.parent / "examples" / "flux_tiny.toml"
    full = ["train", str(flux), "--output-dir", str(tmp_path / "a"), "--set", "checkpoint.export_every=5"]
    assert main(full) == 2
    assert "checkpoint.export_every writes a LoRA's adapters" in capsys.readouterr().err
    kohya = ["train", str(flux), "--output-dir", str(tmp_path / "b"), "--set", "checkpoint.export_every=5",
             "--set", "adapter.type=\"lora\"", "--set", "checkpoint.export_format=\"kohya\""]
    assert main(kohya) == 2
    assert "--format kohya writes UNet layouts" in capsys.readouterr().err
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
