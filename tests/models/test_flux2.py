"""FLUX.2 klein (issue 57) from a folder Flux2KleinPipeline's own `save_pretrained` wrote: the units compute the
model's own forward as the pipeline calls it; captions are encoded and pictures' latents made exactly as the
pipeline makes them (three layers' states of Qwen3; patches normalised by the VAE's batch norm); the tiny example
trains on 1 and 2 stages to the same losses; a LoRA exported for diffusers loads into Flux2KleinPipeline with the
trained output."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
from safetensors.torch import load_file, save_file

from diffpipe.cli import main
from diffpipe.models.families.flux2.flux2 import FLUX2_PRESETS, Flux2Family, flux2_backbone, image_ids, text_ids
from diffpipe.models.families.flux2.release_layout import flux2_from_release, flux2_to_release
from diffpipe.models.families.flux2.text import Flux2DevText, Flux2KleinText
from diffpipe.models.family import Feed
from diffpipe.models.tokens import pack_latents
from diffpipe.models.vae import decode_latents, encode_latents, load_vae

from ..helpers import check_comfyui_lora, check_diffusers_lora, run_command, trains_alike_on_one_and_two_stages

ROOT = Path(__file__).parent.parent.parent
CAPTIONS = ["a photo of the chinese temple", "", "a close photo of a pink flower with words unknown to the vocab"]
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def pipe(tiny) -> Flux2KleinPipeline:
    return Flux2KleinPipeline.from_pretrained(tiny / "flux2_klein")


def _train(tiny: Path, out: Path, *extra: str):
    return run_command(["train", str(ROOT / "examples" / "flux2_klein_tiny.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny / "flux2_klein"}"', "--set", f'data.path="{tiny / "photos"}"',
                        *QUICK, *extra])


def _run_units(backbone, named):
    named = dict(named)
    for unit in backbone.units:
        named.update(unit(named))
    return named[backbone.output]


@pytest.mark.parametrize("guided", [False, True])
def test_the_units_compute_the_models_own_forward(guided):
    torch.manual_seed(0)
    model = Flux2Transformer2DModel(**dict(FLUX2_PRESETS["digits"], guidance_embeds=guided)).eval()
    batch, tokens_size, text_length = 3, (4, 4), 5
    sample = torch.randn(batch, tokens_size[0] * tokens_size[1], 4)
    hidden = torch.randn(batch, text_length, 32)
    t = torch.tensor([10.0, 500.0, 990.0])  # diffpipe's timesteps, 0..1000
    img, txt = image_ids(tokens_size), text_ids(text_length)
    named = {"sample": sample, "timestep": t, "encoder_hidden_states": hidden,
             "img_ids": img.expand(batch, -1, -1), "txt_ids": txt.expand(batch, -1, -1)}
    guidance = torch.full((batch,), 4.0)
    if guided:
        named["guidance"] = guidance
    with torch.no_grad():
        got = _run_units(flux2_backbone(model), named)
        want = model(hidden_states=sample, encoder_hidden_states=hidden, timestep=t / 1000, img_ids=img, txt_ids=txt,
                     guidance=guidance if guided else None, return_dict=False)[0]
    assert got.shape == want.shape == sample.shape
    assert torch.equal(got, want)


def test_text_is_encoded_as_flux2_klein_pipeline_does(tiny, pipe):
    with torch.no_grad():  # the tiny encoder has 4 layers: the pipeline told to read 1, 2, 3 (klein's 9, 18, 27 of 36)
        expected, ids = pipe.encode_prompt(list(CAPTIONS), device="cpu", text_encoder_out_layers=(1, 2, 3))
    hidden, pooled = Flux2KleinText.from_folder(tiny / "flux2_klein").encode(CAPTIONS)
    assert hidden.shape == expected.shape == (3, 512, 48) and pooled.shape == (3, 0)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(text_ids(512).expand(3, -1, -1), ids.float())


def test_latents_are_made_and_decoded_as_flux2_klein_pipeline_does(tiny, pipe):
    """encode: FLUX.2's VAE, each 2x2 patch normalised by its batch norm, packed into tokens: the pipeline's own
    `_encode_vae_image` then `_pack_latents`; decode: the pipeline's unpacking and restoring before its VAE."""
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = load_vae(tiny / "flux2_klein")
    ours = encode_latents(vae, pixels)
    assert ours.shape == (2, 4, 8, 6)
    with torch.no_grad():
        theirs = pipe._pack_latents(pipe._encode_vae_image(pixels, generator=None))
    torch.testing.assert_close(pack_latents(ours), theirs, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the pipeline's ending of its loop: tokens to patches, restored, unpatchified, decoded
        patches = theirs.permute(0, 2, 1).reshape(2, 16, 4, 3)
        mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        image = pipe.vae.decode(pipe._unpatchify_latents(patches * std + mean), return_dict=False)[0]
    torch.testing.assert_close(decode_latents(vae, ours), image.clamp(-1, 1), rtol=1e-4, atol=1e-4)


def _fed(transformer, latent_size: tuple[int, int], timestep: torch.Tensor):
    """Two captions' random states, random latents packed, and the conditions diffpipe feeds the units."""
    hidden = torch.randn(2, 512, 48, generator=torch.Generator().manual_seed(0))
    feed = Feed(Flux2Family(), transformer.config)
    conditions = dict(feed.conditions(hidden, torch.zeros(2, 0), torch.zeros(2, 6), latent_size), timestep=timestep)
    return hidden, feed.pack(torch.randn(2, 4, *latent_size, generator=torch.Generator().manual_seed(1))), conditions


def test_the_units_compute_the_pipelines_transformer_call(tiny, pipe):
    """What diffpipe feeds (conditions of text, a bucket's latent size) through the units equals the folder's model
    called as Flux2KleinPipeline calls it (t / 1000, the ids of the first sample, no guidance)."""
    family, transformer = Flux2Family(), pipe.transformer.eval()
    hidden, sample, conditions = _fed(transformer, (8, 6), torch.tensor([900.0, 20.0]))
    with torch.no_grad():
        ours = family.backbone(transformer, "layers").forward({"sample": sample}, conditions)
        theirs = transformer(hidden_states=sample, timestep=conditions["timestep"] / 1000, guidance=None,
                             encoder_hidden_states=hidden, txt_ids=pipe._prepare_text_ids(hidden),
                             img_ids=pipe._prepare_latent_ids(torch.zeros(2, 16, 4, 3)), return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny, tmp_path):
    trains_alike_on_one_and_two_stages(lambda out, *args: _train(tiny, out, *args), tmp_path)


def _sampled(transformer) -> torch.Tensor:
    _, sample, conditions = _fed(transformer, (8, 8), torch.tensor([500.0, 20.0]))
    with torch.no_grad():
        return Flux2Family().diffusers_forward(transformer.eval(), sample, conditions)


def test_a_lora_exports_for_diffusers_and_comfyui_and_loads_to_the_trained_output(tiny, tmp_path):
    """diffusers' names into Flux2KleinPipeline; ComfyUI's (BFL's names, a double block's query, key and value as
    one LoRA of `qkv`; here the text's key alone too, the rest of its `txt_attn.qkv` untouched) as ComfyUI loads
    them onto BFL's model, read back by diffusers' converter."""
    run = tmp_path / "lora"
    targets = '["to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj", "add_k_proj"]'
    result = _train(tiny, run, "--set", "train.max_steps=6", "--set", "train.learning_rate=1e-2",
                    "--set", 'adapter.type="lora"', "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0",
                    "--set", f"adapter.target_modules={targets}")
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(Flux2KleinPipeline, tiny / "flux2_klein", run, tmp_path / "out", _sampled)
    comfy = tmp_path / "comfy.safetensors"
    check_comfyui_lora(Flux2KleinPipeline, tiny / "flux2_klein", run, comfy, _sampled, flux2_to_release,
                       flux2_from_release)
    names = {k.removesuffix(".lora_down.weight") for k in load_file(str(comfy)) if k.endswith(".lora_down.weight")}
    assert {"diffusion_model.double_blocks.0.img_attn.qkv", "diffusion_model.double_blocks.0.txt_attn.qkv",
            "diffusion_model.double_blocks.0.img_attn.proj", "diffusion_model.single_blocks.1.linear1"} <= names


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_a_single_file_in_bfls_layout_reads_as_the_folders_weights(tiny, tmp_path, monkeypatch, prefix):
    """BFL's layout (`img_attn.qkv`, `linear1`, `.scale` norms, the final modulation's halves swapped), as BFL
    releases it or as ComfyUI saves it, with model.components naming the folder of the rest; written back
    (`export --format original`'s map), diffusers' own reader gives every tensor back."""
    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tiny / "flux2_klein"
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    release = flux2_to_release(weights)
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear1.weight", "img_in.weight",
            "double_blocks.0.txt_attn.norm.key_norm.scale", "final_layer.adaLN_modulation.1.weight",
            "double_stream_modulation_img.lin.weight"} <= release.keys()
    back = flux2_from_release(dict(release))
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    single = tmp_path / "flux-2-klein-4b.safetensors"
    save_file({prefix + k: v for k, v in release.items()}, str(single))
    config = build_config({"model": {"architecture": "flux2", "path": str(single), "components": str(folder)},
                           "data": {"dataset": "folder", "path": str(tiny / "photos"), "resolution": 64}})
    model = build_backbone(config).model
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_a_dev_folders_captions_are_encoded_as_flux2_pipeline_encodes_them(tiny):
    """FLUX.2 dev's Flux2Pipeline: Mistral 3 after FLUX.2's system message, the tokenizer's chat template read from
    the processor's file; equal to the pipeline's own encoding (its `_get_mistral_3_small_prompt_embeds`, told to
    read layers 1, 2, 3 of the tiny encoder's 4: dev's 10, 20, 30 of 40) given the folder's tokenizer. The pipeline
    itself is not built here: its PixtralProcessor needs torchvision."""
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    text = Flux2DevText.from_folder(tiny / "flux2_dev")
    hidden, pooled = text.encode(CAPTIONS)
    with torch.no_grad():
        expected = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            text.models[0], text.tokenizers[0], list(CAPTIONS), device="cpu", system_message=SYSTEM_MESSAGE,
            hidden_states_layers=(1, 2, 3))
    assert hidden.shape == expected.shape == (3, 512, 48) and pooled.shape == (3, 0)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-6)
    filled = text.tokenizers[0].apply_chat_template(text.conversations(["a red square"]), tokenize=False)[0]
    assert filled.startswith("<s>[SYSTEM_PROMPT]" + SYSTEM_MESSAGE) and filled.endswith("[INST]a red square[/INST]")


def test_a_dev_folder_trains_a_lora_that_flux2_pipeline_loads_to_the_trained_output(tiny, tmp_path):
    """The tiny Flux2Pipeline folder (Mistral 3, the guidance embedding) trains a LoRA on 2 stages; exported for
    diffusers it is Flux2Pipeline's file, and Flux2Pipeline's own loader (`lora_state_dict`,
    `load_lora_into_transformer`: the pipeline itself needs torchvision for its processor) puts it into the folder's
    transformer with the trained output."""
    from diffusers import Flux2Pipeline

    run = tmp_path / "dev"
    result = run_command(["train", str(ROOT / "examples" / "flux2_klein_tiny.toml"), "--output-dir", str(run),
                          "--set", f'model.path="{tiny / "flux2_dev"}"', "--set", f'data.path="{tiny / "photos"}"',
                          "--set", "train.max_steps=4", "--set", "train.learning_rate=1e-2", "--set",
                          'adapter.type="lora"', "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0", *QUICK])
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tiny / "flux2_dev" / "transformer"
    trained = Flux2Transformer2DModel.from_pretrained(folder)
    trained.load_state_dict(load_file(str(run / "model.safetensors")))
    want = _sampled(trained)
    assert main(["export", str(run), "--format", "diffusers", "--out", str(tmp_path / "out")]) == 0
    base = Flux2Transformer2DModel.from_pretrained(folder)
    before = _sampled(base)
    # as Flux2Pipeline.load_lora_weights reads and loads it: the file's metadata carries the adapters' config (alpha)
    adapters, metadata = Flux2Pipeline.lora_state_dict(str(tmp_path / "out" / "pytorch_lora_weights.safetensors"),
                                                       return_lora_metadata=True)
    Flux2Pipeline.load_lora_into_transformer(adapters, transformer=base, metadata=metadata)
    assert (before - want).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(_sampled(base), want, rtol=1e-5, atol=1e-5)
