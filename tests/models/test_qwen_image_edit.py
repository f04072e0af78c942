"""Qwen-Image-Edit (issue 30) from a folder in QwenImageEditPipeline's layout: a caption read with its control picture
as the pipeline's `encode_prompt` reads them; a step's text and control tokens are each picture's own control's; the
tiny edit example trains on 1 and 2 stages to the same losses, cached or not; a LoRA exported for diffusers loads
into QwenImageEditPipeline with the trained output; samples read their control; plans count its vision tokens.

transformers builds a Qwen2VLProcessor only beside torchvision (for its video half; not installable beside our CPU
torch), so the pipeline here gets one assembled from the folder's processor/ parts: its own `__call__` runs."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor

from diffpipe.cli import main
from diffpipe.config_files import build_config
from diffpipe.data.batches import BatchMaker
from diffpipe.data.buckets import placed
from diffpipe.data.folder import read_rgb
from diffpipe.data.preparation import prepare_folder_images
from diffpipe.models.families.qwen_image.text import QwenImageEditText
from diffpipe.models.family import Feed
from diffpipe.models.families.qwen_image.edit import QwenImageEditFamily, picture_tokens
from diffpipe.models.vae import load_vae

from ..helpers import check_edit_lora, train_edit_example

ROOT = Path(__file__).parent.parent.parent


def as_the_pipeline_reads(pipe: QwenImageEditPipeline, picture: Image.Image, area: int = 1024 * 1024) -> Image.Image:
    """What QwenImageEditPipeline.__call__ hands its processor of an input image: about 1024^2 pixels
    (QwenImageEditPlusPipeline's: its CONDITION_IMAGE_SIZE, 384^2)."""
    width, height, _ = calculate_dimensions(area, picture.size[0] / picture.size[1])
    return pipe.image_processor.resize(picture, height, width)


def edit_pipeline(folder: Path, pipeline_class=QwenImageEditPipeline) -> QwenImageEditPipeline:
    """`pipeline_class` (QwenImageEditPipeline, QwenImageEditPlusPipeline) of the folder, its Qwen2VLProcessor
    assembled from processor/'s tokenizer and image processor (see the module's note)."""
    base = QwenImagePipeline.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder / "processor")
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_processor = Qwen2VLImageProcessor.from_pretrained(folder / "processor")
    processor.tokenizer, processor.video_processor, processor.chat_template = tokenizer, None, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return pipeline_class(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                          tokenizer=base.tokenizer, processor=processor, transformer=base.transformer)


@pytest.fixture(scope="module")
def pipe(tiny) -> QwenImageEditPipeline:
    return edit_pipeline(tiny / "qwen_image_edit")


def _train(tiny: Path, out: Path, *extra: str):
    return train_edit_example("qwen_image_edit_tiny", tiny / "qwen_image_edit", tiny, out, *extra)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_text_is_read_with_its_picture_as_the_pipeline_does(tiny, pipe):
    """Two captions with two pictures of another size each (the vision tokens differ), and a caption alone."""
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, size, dtype=np.uint8)) for size in ((128, 96, 3), (64, 160, 3))]
    captions = ["a photo of the chinese temple", ""]
    with torch.no_grad():  # one batch, as the pipeline pads it: each caption's states, zero past them
        states, mask = pipe.encode_prompt(captions, image=[as_the_pipeline_reads(pipe, p) for p in pictures],
                                          device="cpu")
    want = [row[:int(n)] for row, n in zip(states, mask.sum(1))]
    text = QwenImageEditText.from_folder(tiny / "qwen_image_edit")
    text.show({"first": lambda: pictures[0], "second": lambda: pictures[1]})
    hidden, pooled = text.encode(text.texts(captions, ["first", "second"]))
    assert hidden.shape[0] == 2 and pooled.shape == (2, 0)
    for row, wanted in zip(hidden, want):  # each padded with zeros to the longer
        assert torch.equal(row[:len(wanted)], wanted) and not row[len(wanted):].any()
    assert len(want[0]) != len(want[1])
    assert not torch.equal(text.encode(text.texts(captions[:1], ["second"]))[0][0, :len(want[0])], want[0])
    alone = text.encode(captions[:1])[0]  # (the pipeline reads none without a picture: the caption in the template)
    assert alone.shape[1] < len(want[0]) and alone.abs().sum() > 0


def test_a_step_reads_each_pictures_own_control(tiny, pipe, tmp_path):
    """The batch's text is its caption read with its own control picture (placed in the picture's bucket, then sized
    as the pipeline sizes its input), and its reference tokens are that control's latents; the eval loss's batches
    too."""
    folder = tiny / "qwen_image_edit"
    config = build_config({"model": {"architecture": "qwen_image_edit", "path": str(folder)},
                           "data": {"dataset": "folder", "path": str(tiny / "edits" / "pictures"), "resolution": 128,
                                    "bucket_step": 32, "control_path": str(tiny / "edits" / "controls"),
                                    "cache_dir": str(tmp_path / "cache")},
                           "train": {"batch_size": 2}, "pipeline": {"stages": 1, "microbatches": 1}})
    text = QwenImageEditText.from_folder(folder)
    data = prepare_folder_images(config.data, folder, load_vae(folder), text, show=False)
    maker = BatchMaker(data, text, config.train, 0.0, Feed(QwenImageEditFamily(), pipe.transformer.config))
    for step in range(3):
        indices = data.batch_indices(step, 2, config.train.seed)
        batch = maker.make(step, 0, 1)
        for row, i in zip(batch.conditions["encoder_hidden_states"], indices):
            picture = as_the_pipeline_reads(pipe, placed(read_rgb(data.controls[i]), data.control_placements[i]))
            with torch.no_grad():
                wanted = pipe.encode_prompt(data.captions[i], image=picture, device="cpu")[0][0]
            torch.testing.assert_close(row[:len(wanted)], wanted, rtol=1e-5, atol=1e-6)
        latents = data.control_latents(indices)
        assert batch.conditions["reference"].shape[1] == latents.shape[2] * latents.shape[3] // 4
    same_bucket = data.groups()[0][:2]
    fixed = maker.make_fixed(data, same_bucket, 0, 0, 1)[0]
    first = same_bucket[0]
    picture = as_the_pipeline_reads(pipe, placed(read_rgb(data.controls[first]), data.control_placements[first]))
    with torch.no_grad():
        wanted = pipe.encode_prompt(data.captions[first], image=picture, device="cpu")[0][0]
    torch.testing.assert_close(fixed.conditions["encoder_hidden_states"][0, :len(wanted)], wanted, rtol=1e-5,
                               atol=1e-6)


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny, tmp_path):
    """Cached on two stages; uncached (the text read with its picture at each step) on one: the same losses."""
    runs = {}
    for stages in (1, 2):
        runs[stages] = tmp_path / f"stages{stages}"
        cache = [] if stages == 2 else ["--set", "data.cache=false"]
        result = _train(tiny, runs[stages], "--set", "train.max_steps=6", "--set", f"pipeline.stages={stages}", *cache)
        assert result.returncode == 0, result.stdout[-3000:]
        assert f"{stages} stage(s)" in result.stdout
    one, two = _losses(runs[1]), _losses(runs[2])
    assert len(one) == 6 and all(l == l for l in one)
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0)


@torch.no_grad()
def _predicted(transformer) -> torch.Tensor:
    family, gen = QwenImageEditFamily(), torch.Generator().manual_seed(0)
    feed = Feed(family, transformer.config)
    conditions = feed.conditions(torch.randn(2, 40, 32, generator=gen), torch.zeros(2, 0), torch.zeros(2, 6), (16, 12),
                                 control=torch.randn(2, 4, 12, 16, generator=gen))
    conditions["timestep"] = torch.tensor([500.0, 20.0])
    return family.diffusers_forward(transformer.eval(), feed.pack(torch.randn(2, 4, 16, 12, generator=gen)), conditions)


def test_a_lora_exports_for_diffusers(tiny, tmp_path):
    check_edit_lora("qwen_image_edit_tiny", SimpleNamespace(from_pretrained=edit_pipeline), tiny / "qwen_image_edit",
                    tiny, tmp_path, _predicted)


def test_samples_read_their_control_images(tiny, tmp_path):
    """The grid edits the first pictures' controls (during training through the pipeline, and at the end); `diffpipe
    sample --control` edits the image given; a sample's text is read with its control: another control, another
    text and another image."""
    from diffpipe.models.text import caption_and_picture
    from diffpipe.sampling import load_generator

    run = tmp_path / "run"
    result = _train(tiny, run, "--set", "train.max_steps=2", "--set", "pipeline.stages=2",
                    "--set", "output.sample_every_end=true", "--set", "sample.every=2", "--set", "sample.steps=2",
                    "--set", "sample.seeds=[0]")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (run / "samples.png").is_file() and (run / "samples" / "step-000002.png").is_file()
    controls = [tiny / "edits" / "controls" / f"{name}.png" for name in ("china_0", "flower_4")]
    assert main(["sample", str(run), "--prompt", "a photo of the chinese temple", "--control", str(controls[0]),
                 "--steps", "2", "--out", str(tmp_path / "made.png")]) == 0
    generator = load_generator(run)
    asked, encode = [], generator.text.encode
    generator.text.encode = lambda texts: asked.extend(texts) or encode(texts)
    made = [generator.generate(["a photo of the chinese temple"], [0], 2, 4.0, decode=False, controls=[c])
            for c in controls]
    pictures = {caption_and_picture(t)[1] for t in asked}
    assert len(pictures) == 2 and None not in pictures  # each prompt (and "", unguided) read with its control
    # a random model trained two steps: the latents differ by 0.0044 on average (0.67 their size), seen
    assert (made[0] - made[1]).abs().mean() > 1e-3


def test_plans_count_the_controls_vision_tokens():
    """A 1024^2 control: 64^2 reference tokens beside the picture's, and its 37^2 vision tokens in the text beside
    the example's 128 caption positions (padded to the next of EDIT_TEXT_LENGTHS)."""
    from diffpipe.build import build_backbone, example_inputs
    from diffpipe.config_files import load_config

    assert picture_tokens(1024, 1024) == picture_tokens(64, 64) == 37 * 37  # any control is sized to ~1024^2 first
    config = load_config(ROOT / "examples" / "qwen_image_edit_lora.toml")
    _, conditions = example_inputs(config, build_backbone(config, "meta"), 1)
    assert conditions["reference"].shape == (1, 4096, 64)
    assert conditions["encoder_hidden_states"].shape[1] == 1536 and conditions["reference_rotary"].shape[1:3] == (64, 64)


def test_a_folder_names_its_family_by_its_pipeline(tiny):
    for layout, family in (("qwen_image", "qwen_image"), ("qwen_image_edit", "qwen_image_edit"),
                           ("qwen_image_edit_plus", "qwen_image_edit")):
        config = build_config({"model": {"path": str(tiny / layout)},
                               "data": {"dataset": "folder", "path": str(tiny / "photos"), "resolution": 128}})
        assert config.model.architecture == family


def test_the_plus_pipelines_text_and_2511s_time_zero_control(tiny, tmp_path):
    """A QwenImageEditPlusPipeline folder (2509, 2511): a caption read with its picture at 384^2 in that pipeline's
    template, and alone, as its `encode_prompt` reads them; its 2511 transformer (zero_cond_t: the control's tokens
    modulated at time zero, `temb` twice the batch across the boundary) trains on 1 and 2 stages to the same losses."""
    folder = tiny / "qwen_image_edit_plus"
    plus = edit_pipeline(folder, QwenImageEditPlusPipeline)
    text = QwenImageEditText.from_folder(folder)
    picture = Image.open(tiny / "edits" / "controls" / "china_0.png").convert("RGB")
    text.show({"control": lambda: picture})
    with torch.no_grad():
        want = plus.encode_prompt("a photo of the chinese temple",
                                  image=as_the_pipeline_reads(plus, picture, CONDITION_IMAGE_SIZE), device="cpu")[0]
        alone = plus.encode_prompt("a photo of the chinese temple", image=None, device="cpu")[0]
    assert torch.equal(text.encode(text.texts(["a photo of the chinese temple"], ["control"]))[0], want)
    assert torch.equal(text.encode(["a photo of the chinese temple"])[0], alone)
    runs = {}
    for stages in (1, 2):
        runs[stages] = tmp_path / f"stages{stages}"
        result = _train(tiny, runs[stages], "--set", "train.max_steps=4", "--set", f"pipeline.stages={stages}",
                        "--set", f'model.path="{folder}"')
        assert result.returncode == 0, result.stdout[-3000:]
        assert f"training qwen_image_edit ({folder}" in result.stdout
    torch.testing.assert_close(torch.tensor(_losses(runs[2])), torch.tensor(_losses(runs[1])), rtol=1e-5, atol=0)
