"""Z-Image (issue 57) from a folder ZImagePipeline's own `save_pretrained` wrote: captions encoded exactly as the
pipeline's `encode_prompt`; the units, a batch's text cut to one of a few lengths and masked, compute the model's own
forward on each caption's real tokens (ZImagePipeline's call); the tiny example trains on 1 and 2 stages to the same
losses; a LoRA exported for diffusers loads into ZImagePipeline with the trained output, for ComfyUI under the names
its Z-Image loader maps; single files in Tongyi-MAI's layout read and are written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline
from safetensors.torch import load_file

from diffpipe.cli import main
from diffpipe.models.families.z_image.release_layout import z_image_from_release, z_image_to_release
from diffpipe.models.families.z_image.text import ZImageText
from diffpipe.models.families.z_image.z_image import ZImageFamily
from diffpipe.models.family import Feed

from ..helpers import check_diffusers_lora, photos_with_long_captions, run_command, trains_alike_on_one_and_two_stages

ROOT = Path(__file__).parent.parent.parent
CAPTIONS = ["a photo of the chinese temple", "", "a close photo of a pink flower with words unknown to the vocab"]
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def pipe(tiny) -> ZImagePipeline:
    return ZImagePipeline.from_pretrained(tiny / "z_image")


def _train(tiny: Path, out: Path, *extra: str, photos: Path | None = None):
    photos = photos or tiny / "photos"
    return run_command(["train", str(ROOT / "examples" / "z_image_tiny.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny / "z_image"}"', "--set", f'data.path="{photos}"', *QUICK, *extra])


def test_text_is_encoded_as_diffusers_z_image_pipeline_does(tiny, pipe):
    with torch.no_grad():  # as the pipeline's __call__ runs it: each caption's real tokens
        expected = pipe.encode_prompt(list(CAPTIONS), device="cpu", do_classifier_free_guidance=False)[0]  # it edits the list
    text = ZImageText.from_folder(tiny / "z_image")
    hidden, pooled = text.encode(CAPTIONS)
    assert hidden.shape == (3, 512, 32) and pooled.shape == (3, 0)
    lengths = [len(e) for e in expected]
    assert text.filled_lengths(CAPTIONS, hidden) == lengths and lengths[1] < lengths[0] < lengths[2]
    for row, want in zip(hidden, expected):  # padded to the batch's longest, not to 512: the sums' order differs
        torch.testing.assert_close(row[:len(want)], want, rtol=1e-5, atol=1e-7)
        assert not row[len(want):].any()  # zero past every caption


def _forward(family, transformer, hidden, lengths, latent_size, timestep):
    """(the backbone's units in order, the model's own forward as the pipeline calls it) on random latents."""
    feed = Feed(family, transformer.config)
    conditions = dict(feed.conditions(hidden, torch.zeros(len(hidden), 0), torch.zeros(len(hidden), 6), latent_size,
                                      lengths), timestep=timestep)
    sample = feed.pack(torch.randn(len(hidden), 4, *latent_size, generator=torch.Generator().manual_seed(1)))
    backbone = family.backbone(transformer, "layers")
    with torch.no_grad():
        return backbone.forward({"sample": sample}, conditions), family.diffusers_forward(transformer, sample,
                                                                                          conditions), conditions


@pytest.mark.parametrize("lengths, latent_size, masked", [([7, 40], (16, 12), True), ([32, 32], (16, 16), False),
                                                           ([3, 9], (10, 12), False)])
def test_the_units_compute_the_models_own_forward_on_each_captions_real_tokens(pipe, lengths, latent_size, masked):
    """Captions of mixed lengths (cut to 64 positions, the shorter masked past its 32: the model's own forward pads
    the batch to its longest instead), padded alike to the cut's length (no mask, as the model passes none; the pad
    tokens the model's), and a picture of 30 tokens (padded to 32 with the model's pad token); time given as
    t = 1 - sigma and the prediction negated, as the pipeline does."""
    family, transformer = ZImageFamily(), pipe.transformer.eval()
    hidden = torch.zeros(2, 512, 32)
    for i, n in enumerate(lengths):
        hidden[i, :n] = torch.randn(n, 32, generator=torch.Generator().manual_seed(i))
    ours, theirs, conditions = _forward(family, transformer, hidden, lengths, latent_size, torch.tensor([900.0, 20.0]))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert conditions["text_mask"].shape[1] == (conditions["text_rotary"].shape[1] if masked else 0)
    # what the units read matters: another caption length numbers the picture's positions elsewhere
    shifted, _, _ = _forward(family, transformer, hidden, [n + 32 for n in lengths], latent_size,
                             torch.tensor([900.0, 20.0]))
    assert (shifted - ours).abs().max() > 1e-4


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny, tmp_path):
    """The upright pictures' captions made long: their bucket's steps cut text to 128 positions, the others' to 32
    or 64, each shape with its own receive buffers."""
    photos = photos_with_long_captions(tiny, tmp_path, "*_4.txt", "*_5.txt")
    trains_alike_on_one_and_two_stages(lambda out, *args: _train(tiny, out, *args, photos=photos), tmp_path)


def _sampled(transformer) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 512, 32, generator=gen)
    hidden[0, 20:], hidden[1, 9:] = 0, 0
    return _forward(ZImageFamily(), transformer.eval(), hidden, [20, 9], (16, 12), torch.tensor([500.0, 20.0]))[1]


def test_a_lora_exports_for_diffusers_and_loads_into_z_image_pipeline(tiny, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny, run, "--set", "train.max_steps=6", "--set", "train.learning_rate=1e-2",
                    "--set", 'adapter.type="lora"', "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0")
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(ZImagePipeline, tiny / "z_image", run, tmp_path / "out", _sampled)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["loss"] == row["loss"] for row in rows)
    merged = load_file(str(run / "model.safetensors"))  # the base with the adapters merged, diffusers' names
    comfy = tmp_path / "comfy.safetensors"
    assert main(["export", str(run), "--format", "comfyui", "--out", str(comfy)]) == 0
    # ComfyUI's Z-Image maps `diffusion_model.` + diffusers' names onto its fused qkv (comfy/utils.py z_image_to_diffusers)
    layers = {k.removesuffix(".weight") for k in merged}
    downs = [k.removeprefix("diffusion_model.").removesuffix(".lora_down.weight") for k in load_file(str(comfy))
             if "lora_down" in k]
    assert downs and set(downs) <= layers and "layers.1.attention.to_q" in downs
    assert "noise_refiner.0.attention.to_k" in downs and "context_refiner.0.attention.to_v" in downs
    original = tmp_path / "z_image_finetune.safetensors"  # Tongyi-MAI's layout, as ComfyUI loads a checkpoint
    assert main(["export", str(run), "--format", "original", "--out", str(original)]) == 0
    written = load_file(str(original))
    assert "layers.0.attention.qkv.weight" in written and "x_embedder.weight" in written
    back = z_image_from_release(written)  # diffusers' own reader of that layout
    assert back.keys() == merged.keys() and all(torch.equal(back[k], merged[k]) for k in merged)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_a_single_file_in_the_release_layout_reads_as_the_folders_weights(tiny, tmp_path, monkeypatch, prefix):
    """Tongyi-MAI's single files (fused qkv, `x_embedder`, `final_layer`), and as ComfyUI saves a whole checkpoint
    (`model.diffusion_model.` before them), with model.components naming the folder of the rest."""
    from safetensors.torch import save_file

    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tiny / "z_image"
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    single = tmp_path / "z_image_turbo_bf16.safetensors"
    save_file({prefix + k: v for k, v in z_image_to_release(weights).items()}, str(single))
    config = build_config({"model": {"architecture": "z_image", "path": str(single), "components": str(folder)},
                           "data": {"dataset": "folder", "path": str(tiny / "photos"), "resolution": 128,
                                    "bucket_step": 32}})
    model = build_backbone(config).model
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_one_step_of_the_pipeline_moves_its_latents_by_the_families_prediction(tiny, pipe):
    """Z-Image's reversed time and negated prediction checked against ZImagePipeline's own loop, not a copy of it: one
    Euler step from pure noise (sigma 1 -> 0) gives latents - velocity, the velocity being what the family predicts
    (what diffpipe's flow-matching loss trains) at timestep 1000."""
    family, transformer = ZImageFamily(), pipe.transformer.eval()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 512, 32, generator=gen)
    hidden[0, 11:] = 0
    latents = torch.randn(1, 4, 16, 12, generator=gen)
    feed = Feed(family, transformer.config)
    conditions = dict(feed.conditions(hidden, torch.zeros(1, 0), torch.zeros(1, 6), (16, 12), [11]),
                      timestep=torch.tensor([1000.0]))
    with torch.no_grad():
        velocity = family.unpack_prediction(transformer.config, family.backbone(transformer, "layers").forward(
            {"sample": feed.pack(latents)}, conditions), (16, 12))
        stepped = pipe(prompt_embeds=[hidden[0, :11]], latents=latents.clone(), num_inference_steps=1, height=128,
                       width=96, guidance_scale=0.0, output_type="latent").images
    torch.testing.assert_close(stepped.float(), latents - velocity, rtol=1e-4, atol=1e-5)


def test_a_preset_without_weights_draws_them_as_diffusers_builds_them():
    """Random weights on the meta-built model (no model.path): the model's own pad tokens and diffusers' RMSNorm,
    which have no reset_parameters, start as the constructor makes them (zero, one); the rest drawn, finite."""
    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    config = build_config({"model": {"architecture": "z_image", "preset": "digits", "text_max_length": 8},
                           "data": {"dataset": "digits"}, "train": {"device": "cpu"}})
    model = build_backbone(config).model
    assert not model.x_pad_token.any() and not model.cap_pad_token.any()
    assert torch.equal(model.layers[0].attention_norm1.weight, torch.ones(32))
    assert all(torch.isfinite(p).all() and p.device.type == "cpu" for p in model.parameters())
    assert model.layers[0].attention.to_q.weight.std() > 0
