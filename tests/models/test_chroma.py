"""Chroma (issue 30) from a folder ChromaPipeline's own `save_pretrained` wrote: captions encoded as the pipeline's
`encode_prompt` (T5 read with its mask; the positions the transformer attends to bit-equal); a batch's text cut and
masked computes what diffusers' forward computes on the pipeline's 512 positions with a boolean mask; the tiny example
trains on 1 and 2 stages to the same losses; a LoRA exported for diffusers loads into ChromaPipeline with the trained
output, and for ComfyUI under Flux's diffusers names (ComfyUI's Chroma is a Flux model to its LoRA loader)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel
from safetensors.torch import load_file

from diffpipe.cli import main
from diffpipe.config_files import build_config
from diffpipe.models.families.flux.chroma import CHROMA_PRESETS, ChromaFamily
from diffpipe.models.families.flux.text import ChromaText
from diffpipe.models.family import Feed

from ..helpers import (check_diffusers_lora, photos_with_long_captions, predicted_with_padded_text,
                       run_command, trains_alike_on_one_and_two_stages)

ROOT = Path(__file__).parent.parent.parent
CAPTIONS = ["a photo of the chinese temple", "", "a close photo of a pink flower with words unknown to the vocab"]
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def pipe(tiny) -> ChromaPipeline:
    return ChromaPipeline.from_pretrained(tiny / "chroma")


def _train(tiny: Path, out: Path, *extra: str, photos: Path | None = None):
    return run_command(["train", str(ROOT / "examples" / "chroma_tiny.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny / "chroma"}"', "--set", f'data.path="{photos or tiny / "photos"}"',
                        *QUICK, *extra])


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _encoded_by(pipe: ChromaPipeline) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():  # as the pipeline's __call__ runs it
        hidden, _, mask, *_ = pipe.encode_prompt(CAPTIONS, negative_prompt=None, device="cpu",
                                                 do_classifier_free_guidance=False)
    return hidden, mask.bool()


def test_text_is_encoded_as_diffusers_chroma_pipeline_does(tiny, pipe):
    expected, mask = _encoded_by(pipe)
    text = ChromaText.from_folder(tiny / "chroma")
    hidden, pooled = text.encode(CAPTIONS)
    assert hidden.shape == (3, 512, 64) and pooled.shape == (3, 0)
    assert mask.sum(dim=1).tolist() == [8, 2, 38]  # each caption's tokens, its </s> and the one pad attended to
    torch.testing.assert_close(hidden[mask], expected[mask], rtol=0, atol=0)
    assert not hidden[~mask].any()  # the masked padding: zero, so a step knows each caption's length
    assert text.filled_lengths(CAPTIONS, hidden) == [8, 2, 38]


def _prediction(transformer, sample, timestep, hidden, mask, grid):
    ids = ChromaPipeline._prepare_latent_image_ids(len(sample), *grid, "cpu", torch.float32)
    if mask is not None:  # the image's tokens always attended to, as ChromaPipeline._prepare_attention_mask
        mask = torch.cat((mask, torch.ones(len(sample), grid[0] * grid[1], dtype=mask.dtype)), dim=1)
    return transformer(hidden_states=sample, timestep=timestep / 1000, encoder_hidden_states=hidden, img_ids=ids,
                       txt_ids=torch.zeros(hidden.shape[1], 3), attention_mask=mask, return_dict=False)[0]


def test_text_cut_to_its_length_and_masked_computes_the_models_forward_over_512_masked_positions(tiny, pipe):
    family, transformer = ChromaFamily(), pipe.transformer.eval()
    feed = Feed(family, transformer.config)
    hidden, pooled = ChromaText.from_folder(tiny / "chroma").encode(CAPTIONS)
    expected, mask = _encoded_by(pipe)
    gen = torch.Generator().manual_seed(0)
    latents, timestep = torch.randn(3, 4, 16, 12, generator=gen), torch.tensor([900.0, 417.0, 20.0])
    conditions = dict(feed.conditions(hidden, pooled, torch.zeros(3, 6), (16, 12), [8, 2, 38]), timestep=timestep)
    assert conditions["encoder_hidden_states"].shape[1] == 64  # the longest (38) cut to the next length
    assert conditions["attention_mask"].shape == (3, 64 + 48) and conditions["attention_mask"][:, 64:].all()
    backbone = family.backbone(transformer, "layers")
    with torch.no_grad():
        ours = backbone.forward({"sample": feed.pack(latents)}, conditions)
        theirs = _prediction(transformer, feed.pack(latents), timestep, expected, mask, (8, 6))
        unmasked = _prediction(transformer, feed.pack(latents), timestep, expected, None, (8, 6))
        added = _prediction(transformer, feed.pack(latents), timestep, expected, mask.float(), (8, 6))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (unmasked - theirs).abs().max() > 1e-2  # the mask matters: without it T5's padding is attended to
    # ones and zeros in floating point (what diffusers 0.42's ChromaPipeline passes) are added to attention's scores,
    # not a mask (huggingface/diffusers#12116): not what Chroma trains with
    assert (added - theirs).abs().max() > 1e-2


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny, tmp_path):
    """Long captions on the upright pictures: their bucket's steps cut the text to 64 positions, the others' to 32."""
    photos = photos_with_long_captions(tiny, tmp_path, "*_4.txt")
    trains_alike_on_one_and_two_stages(lambda out, *args: _train(tiny, out, *args, photos=photos), tmp_path)


def _sampled(transformer) -> torch.Tensor:
    return predicted_with_padded_text(ChromaFamily(), transformer, 64)


def test_a_lora_exports_for_diffusers_and_comfyui(tiny, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny, run, "--set", "train.max_steps=4", "--set", "train.learning_rate=1e-2",
                    "--set", "pipeline.stages=1", "--set", 'adapter.type="lora"', "--set", "adapter.rank=4",
                    "--set", "adapter.alpha=8.0")
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(ChromaPipeline, tiny / "chroma", run, tmp_path / "out", _sampled)
    comfy = tmp_path / "comfy.safetensors"
    assert main(["export", str(run), "--format", "comfyui", "--out", str(comfy)]) == 0
    layers = {k.removesuffix(".weight") for k in load_file(str(run / "model.safetensors"))}
    downs = [k.removesuffix(".lora_down.weight") for k in load_file(str(comfy)) if k.endswith("lora_down.weight")]
    assert downs and {d.removeprefix("transformer.") for d in downs} <= layers
    assert "transformer.single_transformer_blocks.1.attn.to_q" in downs
    original = tmp_path / "chroma_finetune.safetensors"  # Chroma's release layout (flux_layout.CHROMA)
    assert main(["export", str(run), "--format", "original", "--out", str(original)]) == 0
    assert "distilled_guidance_layer.layers.0.in_layer.weight" in load_file(str(original))


def test_a_meta_built_model_gets_the_modulation_rows_sinusoids():
    """The modulation rows' sinusoids (a buffer the weights file does not hold) are rebuilt on a meta-built model as
    its constructor makes them."""
    family = ChromaFamily()
    real = ChromaTransformer2DModel(**CHROMA_PRESETS["digits"])
    with torch.device("meta"):
        meta = ChromaTransformer2DModel(**CHROMA_PRESETS["digits"])
    rebuilt = family.constructor_buffers(meta)
    assert set(rebuilt) == {name for name, _ in real.named_buffers()}
    assert all(torch.equal(rebuilt[name], buffer) for name, buffer in real.named_buffers())


def test_a_chroma_folder_needs_no_architecture(tiny):
    config = build_config({"model": {"path": str(tiny / "chroma")},
                           "data": {"dataset": "folder", "path": str(tiny / "photos")}})
    assert config.model.architecture == "chroma" and config.train.objective == "flow_matching"
