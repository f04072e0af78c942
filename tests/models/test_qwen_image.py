"""Qwen-Image (issue 30) from a folder QwenImagePipeline's own `save_pretrained` wrote: captions encoded exactly as
the pipeline's `encode_prompt`; a batch's text cut to one of a few lengths and masked computes what the pipeline's
own padding computes; the tiny example trains on 1 and 2 stages to the same losses; a LoRA exported for diffusers
loads into QwenImagePipeline with the trained output, and for ComfyUI under the names its Qwen-Image loader maps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from diffpipe.cli import main
from diffpipe.models.families.qwen_image.text import QwenImageText
from diffpipe.models.family import Feed
from diffpipe.models.families.qwen_image.qwen_image import QwenImageFamily
from diffpipe.models.tokens import text_mask

from ..helpers import (check_diffusers_lora, photos_with_long_captions, predicted_with_padded_text,
                       run_command, trains_alike_on_one_and_two_stages)

ROOT = Path(__file__).parent.parent.parent
CAPTIONS = ["a photo of the chinese temple", "", "a close photo of a pink flower with words unknown to the vocab"]
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def pipe(tiny) -> QwenImagePipeline:
    return QwenImagePipeline.from_pretrained(tiny / "qwen_image")


def _train(tiny: Path, out: Path, *extra: str, photos: Path | None = None):
    photos = photos or tiny / "photos"
    return run_command(["train", str(ROOT / "examples" / "qwen_image_tiny.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny / "qwen_image"}"', "--set", f'data.path="{photos}"',
                        *QUICK, *extra])


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_text_is_encoded_as_diffusers_qwen_image_pipeline_does(tiny, pipe):
    with torch.no_grad():  # as the pipeline's __call__ runs it
        expected, mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=512)
    hidden, pooled = QwenImageText.from_folder(tiny / "qwen_image").encode(CAPTIONS)
    assert hidden.shape == (3, 512, 32) and pooled.shape == (3, 0)
    assert mask.sum(dim=1).tolist() == [11, 5, 34]  # the template's 34 tokens before the caption dropped, as Qwen's
    torch.testing.assert_close(hidden[:, :expected.shape[1]], expected, rtol=0, atol=0)
    assert not hidden[:, expected.shape[1]:].any()  # zero past every caption, as the pipeline pads


def _output(family, transformer, sample, timestep, hidden, mask, grid):
    return transformer(hidden_states=sample, timestep=timestep / 1000, encoder_hidden_states=hidden,
                       encoder_hidden_states_mask=mask, img_shapes=[[(1, *grid)]] * len(sample), return_dict=False)[0]


def test_text_cut_to_its_length_and_masked_computes_what_the_pipelines_padding_computes(tiny, pipe):
    family, transformer = QwenImageFamily(), pipe.transformer.eval()
    feed = Feed(family, transformer.config)
    text = QwenImageText.from_folder(tiny / "qwen_image")
    hidden, pooled = text.encode(CAPTIONS)
    # each caption's filled positions, as a step gets them from the host (the encoder keeps them per caption)
    assert text.filled_lengths(CAPTIONS, hidden) == [11, 5, 34]
    assert text.filled_lengths(CAPTIONS[::-1], hidden[:0]) == [34, 5, 11]  # known now: the states are not read again
    text.remember({"kept": (hidden[1].clone(), pooled[1].clone())})  # a text cache's entry
    kept, _ = text.encode(["kept"])
    assert text.filled_lengths(["kept"], kept) == [5]
    with torch.no_grad():
        exact, exact_mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=512)
    gen = torch.Generator().manual_seed(0)
    latents, timestep = torch.randn(3, 4, 16, 12, generator=gen), torch.tensor([900.0, 417.0, 20.0])
    conditions = dict(feed.conditions(hidden, pooled, torch.zeros(3, 6), (16, 12)), timestep=timestep)
    assert conditions["encoder_hidden_states"].shape[1] == 64  # the longest caption (34) cut to the next length
    given = feed.conditions(hidden, pooled, torch.zeros(3, 6), (16, 12), [11, 5, 34])  # as a step makes them
    assert all(torch.equal(given[k], conditions[k]) for k in given)
    backbone = family.backbone(transformer, "layers")
    with torch.no_grad():
        ours = backbone.forward({"sample": feed.pack(latents)}, conditions)
        theirs = _output(family, transformer, feed.pack(latents), timestep, exact, exact_mask, (8, 6))
        unmasked = _output(family, transformer, feed.pack(latents), timestep, exact, None, (8, 6))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (unmasked - theirs).abs().max() > 1e-2  # the mask matters: without it padding is attended to
    # captions that all fill the cut length: no mask, as the pipeline passes none when nothing is padded
    full = torch.randn(2, 512, 32, generator=gen)
    full[:, 32:] = 0
    cut, mask = text_mask(full)
    assert cut.shape == (2, 32, 32) and mask.shape == (2, 0)
    cut, mask = text_mask(torch.zeros(2, 512, 32))  # what a plan traces: the longest text a caption may have
    assert cut.shape == (2, 512, 32) and mask.shape == (2, 0)


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny, tmp_path):
    """The upright pictures' captions made long (53 tokens): their bucket's steps cut text to 64 positions, the others'
    to 32, each shape with its own receive buffers."""
    photos = photos_with_long_captions(tiny, tmp_path, "*_4.txt", "*_5.txt")
    trains_alike_on_one_and_two_stages(lambda out, *args: _train(tiny, out, *args, photos=photos), tmp_path)


def _sampled(transformer) -> torch.Tensor:
    return predicted_with_padded_text(QwenImageFamily(), transformer, 32)


def test_a_lora_exports_for_diffusers_and_comfyui(tiny, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny, run, "--set", "train.max_steps=6", "--set", "train.learning_rate=1e-2",
                    "--set", 'adapter.type="lora"', "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0")
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(QwenImagePipeline, tiny / "qwen_image", run, tmp_path / "out", _sampled)
    merged = load_file(str(run / "model.safetensors"))  # the base with the adapters merged, diffusers' names
    comfy = tmp_path / "comfy.safetensors"
    assert main(["export", str(run), "--format", "comfyui", "--out", str(comfy)]) == 0
    # ComfyUI's Qwen-Image keeps diffusers' layer names; its loader maps `diffusion_model.` + a weight's name
    layers = {k.removesuffix(".weight") for k in merged}
    keys = load_file(str(comfy))
    downs = [k.removeprefix("diffusion_model.").removesuffix(".lora_down.weight") for k in keys if "lora_down" in k]
    assert downs and all(k.startswith("diffusion_model.") for k in keys) and set(downs) <= layers
    assert "transformer_blocks.1.attn.add_q_proj" in downs  # the text stream's projections train too
    original = tmp_path / "qwen_image_finetune.safetensors"  # Qwen's own layout: diffusers' names, as ComfyUI loads
    assert main(["export", str(run), "--format", "original", "--out", str(original)]) == 0
    assert load_file(str(original)).keys() == merged.keys()


def test_a_preset_without_weights_draws_them_as_diffusers_builds_them():
    """Random weights on the meta-built model (no model.path): diffusers' RMSNorm, which has no reset_parameters,
    starts at weight 1 as its constructor makes it; the rest drawn, finite."""
    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    config = build_config({"model": {"architecture": "qwen_image", "preset": "digits", "text_max_length": 8},
                           "data": {"dataset": "digits"}, "train": {"device": "cpu"}})
    model = build_backbone(config).model
    assert torch.equal(model.txt_norm.weight, torch.ones(32))
    assert all(torch.isfinite(p).all() and p.device.type == "cpu" for p in model.parameters())
    assert model.img_in.weight.std() > 0
    # the last block's text side reaches no prediction: frozen, so data parallel waits for no gradient of it (the
    # central test's qwen-image-dp2 failed in DDP before); the rest trains
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"transformer_blocks.2.{m}.{w}" for m in ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
                      for w in ("weight", "bias")}


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_a_single_file_reads_in_diffusers_names_and_as_comfyui_saves_it(tiny, tmp_path, monkeypatch, prefix):
    """Qwen's releases and ComfyUI's split files name the weights as diffusers does; a checkpoint ComfyUI saves whole
    puts `model.diffusion_model.` before them (refused as 77 unexpected weights before the layout knew it)."""
    from safetensors.torch import save_file

    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tiny / "qwen_image"
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    single = tmp_path / "qwen_image_bf16.safetensors"
    save_file({prefix + k: v for k, v in weights.items()}, str(single))
    config = build_config({"model": {"architecture": "qwen_image", "path": str(single), "components": str(folder)},
                           "data": {"dataset": "folder", "path": str(tiny / "photos"), "resolution": 128,
                                    "bucket_step": 32}})
    model = build_backbone(config).model
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_a_lora_over_an_fp8_base_leaves_the_unread_text_side_without_adapters(tiny, tmp_path):
    """Adapters only where a prediction reads them: the last block's to_add_out and txt_mlp get none (an adapter
    there, frozen, was stored in fp8 like a base layer and its draw failed: "check_uniform_bounds" for fp8)."""
    run = tmp_path / "fp8"
    result = _train(tiny, run, "--set", "train.max_steps=2", "--set", "pipeline.stages=1",
                    "--set", 'adapter.type="lora"', "--set", 'memory.base_dtype="fp8"')
    assert result.returncode == 0, result.stderr[-3000:]
    adapters = load_file(str(run / "lora.safetensors"))
    assert any(k.startswith("transformer_blocks.1.attn.to_q.") for k in adapters)
    assert not any(k.startswith(("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.txt_mlp."))
                   for k in adapters)
    assert any(k.startswith("transformer_blocks.0.attn.to_add_out.") for k in adapters)  # read there: trained


def test_a_run_shifts_by_resolution_on_the_folders_own_line(tiny, tmp_path):
    """train.shift = "resolution" reads QwenImagePipeline's scheduler (its dynamic shifting line); a folder whose
    scheduler shifts by a fixed amount gives Flux.1's line; the run trains and evaluates at each bucket's shift."""
    from diffpipe.build import shift_schedule
    from diffpipe.config_files import build_config
    from diffpipe.models.folder import dynamic_shift

    assert dynamic_shift(tiny / "qwen_image") == (256, 8192, 0.5, 0.9)
    assert dynamic_shift(tiny / "flux") is None  # FlowMatchEulerDiscreteScheduler(shift=3.0)
    flux = build_config({"model": {"architecture": "flux", "path": str(tiny / "flux")},
                         "data": {"dataset": "folder", "path": str(tiny / "photos")}})
    assert shift_schedule(flux) == (256, 4096, 0.5, 1.15)
    run = tmp_path / "shifted"
    result = _train(tiny, run, "--set", "train.max_steps=2", "--set", "pipeline.stages=1",
                    "--set", 'train.shift="resolution"', "--set", "train.eval_every=2",
                    "--set", f'data.eval_path="{tiny / "photos"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in row for row in rows)
