"""HunyuanVideo 1.5 (issue 30): the text is HunyuanVideo15Pipeline.encode_prompt's (Qwen's states and ByT5's of the
quoted text, bit-equal where the pipeline's masks are set, zero elsewhere; kept and cached up to each caption's last
filled position); units with a batch's text cut and masked
compute the model's own forward and gradients over the pipeline's full-length padded text; the VAE's latents are the
pipeline's (scaled, several clips at once); the tiny example trains to the same losses on 1 and 2 stages; a LoRA
exported for diffusers loads into the transformer with the trained output; image-to-video configs are refused; the
digits preset trains from random weights (no folder)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideo15Pipeline, HunyuanVideoPipeline

from diffpipe.build import build_backbone, build_text_encoder
from diffpipe.config_files import build_config
from diffpipe.models.family import Feed
from diffpipe.models.families.hunyuan_video15.text import HunyuanVideo15Text
from diffpipe.models.families.hunyuan_video15.hunyuan_video15 import HUNYUAN_VIDEO15_PRESETS, HunyuanVideo15Family
from diffpipe.models.vae import decode_latents, encode_latents
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.sampling import run_stages

from ..helpers import check_diffusers_lora, run_command, trains_alike_on_one_and_two_stages

ROOT = Path(__file__).parent.parent.parent
CAPTIONS = ["a red square moving right", 'a sign reading "OPEN" and \u201ccaf\u00e9\u201d', ""]
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def pipe(tiny_video) -> HunyuanVideo15Pipeline:
    return HunyuanVideo15Pipeline.from_pretrained(tiny_video / "hunyuan_video15")


def _encoded_by(pipe) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():  # as the pipeline's __call__ runs it
        qwen, mask, byt5, mask_2 = pipe.encode_prompt(CAPTIONS, device="cpu", batch_size=len(CAPTIONS))
    return qwen, mask.bool(), byt5, mask_2.bool()


def test_text_is_encoded_as_the_pipeline_does(tiny_video, pipe):
    qwen, mask, byt5, mask_2 = _encoded_by(pipe)
    config = build_config({"model": {"path": str(tiny_video / "hunyuan_video15")}})
    text = build_text_encoder(config, build_backbone(config, "meta"))  # as a run builds it
    assert isinstance(text, HunyuanVideo15Text)
    hidden, pooled = text.encode(CAPTIONS)
    assert hidden.shape == (3, 1000, 32 + 16) and pooled.shape == (3, 0)
    # the template's 108 tokens dropped (the tiny tokenizer counts them as Qwen's does: the empty caption keeps
    # the " " the template puts in its place and the five after it); quoted text only for ByT5
    assert mask.sum(dim=1).tolist() == [18, 33, 6] and mask_2.sum(dim=1).tolist() == [0, 28, 0]
    assert torch.equal(hidden[..., :32][mask], qwen[mask]) and not hidden[..., :32][~mask].any()
    assert torch.equal(hidden[:, :256, 32:][mask_2], byt5[mask_2]) and not hidden[:, :256, 32:][~mask_2].any()
    assert not hidden[:, 256:, 32:].any()
    assert text.filled_lengths(CAPTIONS, hidden) == [18, 33, 6]
    # kept (and cached) up to each caption's last filled position, a batch padded to its longest
    assert text.keep(CAPTIONS, max_gib=1.0) and [len(r) for r in text.rows(CAPTIONS, hidden)] == [18, 33, 6]
    kept, _ = text.encode(CAPTIONS)
    assert torch.equal(kept, hidden[:, :33])


def _model(seed: int = 0):
    """The digits preset with every weight drawn at 0.3 (diffusers zero-initialises none that matter here, but a
    spread this wide makes every path count)."""
    family = HunyuanVideo15Family()
    torch.manual_seed(seed)
    model = family.model_class(**HUNYUAN_VIDEO15_PRESETS["digits"])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return family, model


def _padded_text(cfg, batch: int = 3) -> torch.Tensor:
    """Texts as HunyuanVideo15Text gives them: Qwen's filled for 20, 37 and 9 positions, ByT5's for 0, 5 and 30."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(batch, 1000, cfg.text_embed_dim + cfg.text_embed_2_dim, generator=gen)
    for i, (qwen, byt5) in enumerate([(20, 0), (37, 5), (9, 30)][:batch]):
        hidden[i, qwen:, :cfg.text_embed_dim] = 0
        hidden[i, byt5:, cfg.text_embed_dim:] = 0
    return hidden


def test_units_with_the_text_cut_and_masked_compute_the_models_forward_and_gradients():
    family, model = _model()
    cfg = model.config
    feed = Feed(family, cfg)
    hidden = _padded_text(cfg)
    latents = torch.randn(3, 1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    timestep = torch.tensor([900.0, 417.0, 20.0])
    cut = dict(feed.conditions(hidden, torch.zeros(3, 0), torch.zeros(3, 6), (4, 8, 8)), timestep=timestep)
    assert cut["encoder_hidden_states"].shape[1] == 64  # the longest (37) cut to the next of TEXT_LENGTHS
    whole = dict(cut, encoder_hidden_states=hidden[..., :cfg.text_embed_dim],
                 encoder_attention_mask=hidden[..., :cfg.text_embed_dim].abs().amax(-1) > 0,
                 encoder_hidden_states_2=hidden[:, :256, cfg.text_embed_dim:],
                 encoder_attention_mask_2=hidden[:, :256, cfg.text_embed_dim:].abs().amax(-1) > 0)
    backbone = family.backbone(model, "layers")
    ours = backbone.forward({"sample": latents}, cut)
    ours.square().mean().backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    theirs = family.diffusers_forward(model, latents, whole)  # the pipeline's 1,000 + 256 positions, masked
    theirs.square().mean().backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - family.diffusers_forward(model, latents, dict(whole, timestep=timestep.flip(0)))).abs().max() > 1e-2
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    assert set(ours_grads) == reached  # what diffusers' forward reaches, ours reaches (and no more)
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():
        staged = run_stages(build_stage_modules(backbone, stage_specs(backbone, [1, 3])), latents, cut)
    torch.testing.assert_close(staged, ours.detach(), rtol=0, atol=0)
    assert torch.equal(feed.unpack_prediction(feed.pack_prediction(latents), (4, 8, 8)), latents)


def test_the_vae_makes_the_pipelines_latents_of_several_clips_at_once(pipe):
    vae = pipe.vae
    clips = torch.rand(2, 3, 9, 32, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    latents = encode_latents(vae, clips)
    with torch.no_grad():
        theirs = [vae.encode(clip[None]).latent_dist.mean * vae.config.scaling_factor for clip in clips]
    assert latents.shape == (2, 4, 3, 2, 3)  # 16x smaller sides, a latent frame per 4 video frames after the first
    assert vae.config.scaling_factor != 1.0 and torch.equal(latents, torch.cat(theirs))
    with torch.no_grad():
        decoded = [vae.decode(z[None] / vae.config.scaling_factor).sample.clamp(-1, 1) for z in latents]
    assert torch.equal(decode_latents(vae, latents), torch.cat(decoded))


def _train(tiny_video: Path, clips: Path, out: Path, *extra: str):
    return run_command(["train", str(ROOT / "examples" / "hunyuan_video15_tiny.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny_video / "hunyuan_video15"}"', "--set", f'data.path="{clips}"',
                        "--set", f'data.cache_dir="{out.parent / "cache"}"', *QUICK, *extra])


@pytest.fixture(scope="module")
def clips(tiny_video, tmp_path_factory) -> Path:
    """The tiny clips, one caption quoting a sign's text (ByT5 reads it)."""
    folder = shutil.copytree(tiny_video / "clips", tmp_path_factory.mktemp("hunyuan") / "clips")
    caption = sorted(folder.glob("*.txt"))[0]
    caption.write_text(caption.read_text().strip() + ' under a sign reading "GO"')
    return folder


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny_video, clips, tmp_path):
    """Weights within 4e-5 (1 % of what AdamW moves one in 4 steps at 1e-3): a weight whose gradients are nearly
    zero (the time embedding's rows reading sinusoids that barely change) gets steps of the order of lr from
    rounding, whichever way the micro-batches' sums were ordered (seen once: 1.2e-5 on one of 8,192)."""
    trains_alike_on_one_and_two_stages(lambda out, *args: _train(tiny_video, clips, out, *args), tmp_path, steps=4,
                                       weights_atol=4e-5)


def _load_lora(pipe, file) -> None:
    """HunyuanVideo15Pipeline has no load_lora_weights in diffusers 0.42: the file read as its pipelines read one."""
    state, metadata = HunyuanVideoPipeline.lora_state_dict(file, return_lora_metadata=True)
    pipe.transformer.load_lora_adapter(state, prefix="transformer", metadata=metadata)


def test_a_lora_exported_for_diffusers_loads_into_the_transformer(tiny_video, clips, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny_video, clips, run, "--set", "train.max_steps=4", "--set", "train.learning_rate=1e-2",
                    "--set", "pipeline.stages=1", "--set", 'adapter.type="lora"', "--set", "adapter.rank=4",
                    "--set", "adapter.alpha=8.0")
    assert result.returncode == 0, result.stderr[-3000:]
    family, folder = HunyuanVideo15Family(), tiny_video / "hunyuan_video15"
    feed_text = _padded_text(HunyuanVideo15Pipeline.from_pretrained(folder).transformer.config, batch=2)

    def predict(transformer):
        feed = Feed(family, transformer.config)
        latents = torch.randn(2, 4, 3, 2, 3, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            conditions = dict(feed.conditions(feed_text, torch.zeros(2, 0), torch.zeros(2, 6), (3, 2, 3)),
                              timestep=torch.tensor([500.0, 20.0]))
            return family.diffusers_forward(transformer.eval(), latents, conditions)

    check_diffusers_lora(HunyuanVideo15Pipeline, folder, run, tmp_path / "out", predict, load=_load_lora)


def test_a_folder_resolves_and_an_image_to_video_transformer_is_refused(tiny_video, clips, tmp_path, capfd):
    config = build_config({"model": {"path": str(tiny_video / "hunyuan_video15")},
                           "data": {"dataset": "folder", "path": str(clips)}})
    assert config.model.architecture == "hunyuan_video15" and config.train.objective == "flow_matching"
    folder = shutil.copytree(tiny_video / "hunyuan_video15", tmp_path / "i2v")
    transformer_config = folder / "transformer" / "config.json"
    transformer_config.write_text(json.dumps(dict(json.loads(transformer_config.read_text()), task_type="i2v")))
    result = _train(folder.parent, clips, tmp_path / "run", "--set", f'model.path="{folder}"')
    err = capfd.readouterr().err
    assert result.returncode != 0 and "task_type is 'i2v'" in err and "Traceback" not in err


def test_the_digits_preset_trains_from_random_weights_on_two_stages(tmp_path):
    """No pipeline folder: every weight drawn (diffusers' RMSNorm, which has no reset_parameters, as diffusers builds
    it), clips of moving digits, a stand-in text encoder of both streams' widths."""
    result = run_command(["train", str(ROOT / "examples" / "video_tiny.toml"), "--output-dir", str(tmp_path / "run"),
                          "--set", 'model.architecture="hunyuan_video15"', "--set", "train.max_steps=2", *QUICK])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
