"""Eval loss and samples during training, both through the training pipeline: the eval loss equals the one computed
by diffusers' UNet in one process on the same held-out batches, and samples made through the pipeline equal those of
`diffpipe sample`'s chained stages."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from PIL import Image
from safetensors.torch import load_file
from scipy import stats

from diffpipe.build import build_backbone, build_text_encoder
from diffpipe.config_files import load_config
from diffpipe.diffusion.timesteps import sample_timesteps, timestep_quantiles

from ..pipeline.reference_loop import Text, digits, noised

from ..helpers import grid_size, run_command

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"


@pytest.mark.parametrize("kind", ["uniform", "logit_normal", "shift", "importance"])
def test_eval_timesteps_are_the_quantiles_of_the_training_density(kind):
    drawn = sample_timesteps(kind, 200_000, torch.Generator().manual_seed(0)).double()
    q = [0.1, 0.5, 0.9]
    expected = torch.quantile(drawn[:100_000], torch.tensor(q, dtype=torch.float64))
    assert torch.allclose(timestep_quantiles(kind, q).double(), expected, atol=0.005)


def _reference_eval_loss(run: Path) -> float:
    """The eval loss of the run's final weights by UNet2DConditionModel.forward in this process, without diffpipe's
    evaluation or batch code: the held-out digits from scikit-learn, the timesteps at the quantiles of the training
    density by scipy's normal quantile (logit-normal: sigmoid(mean + std * ppf(q))), every held-out item once in
    batches of train.batch_size (the last filled up from the first items), each batch's noise drawn from seed x
    1000003 + its number (the seed of the eval's fixed batch, diffpipe/seeds.py), rectified-flow inputs and targets,
    text through transformers' CLIP from the run's text encoder folder."""
    config = tomllib.loads((run / "config.toml").read_text())
    train = config["train"]
    assert (train["objective"], train["timestep_sampling"]) == ("flow_matching", "logit_normal")  # as computed here
    unet = UNet2DConditionModel(**json.loads((run / "model_config.json").read_text()))
    unet.load_state_dict(load_file(str(run / "model.safetensors")))
    unet.eval()
    images, captions = digits(held_out=True)
    text = Text(config["model"]["text_encoder"], config["model"]["text_max_length"])
    size = train["batch_size"]
    batches = [[i % len(images) for i in range(start, start + size)] for start in range(0, len(images), size)]
    quantiles = stats.norm.ppf(train["eval_quantiles"])
    ts = torch.sigmoid(torch.tensor(train["logit_mean"] + train["logit_std"] * quantiles)).float()
    losses = []
    for t in ts.tolist():
        per_batch = []
        for b, indices in enumerate(batches):
            x0 = images[indices]
            noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(train["seed"] * 1_000_003 + b))
            noisy, timestep, target = noised("flow_matching", x0, noise, torch.full((len(x0),), t))
            hidden, _ = text([captions[i] for i in indices])
            with torch.no_grad():
                out = unet(noisy, timestep, encoder_hidden_states=hidden).sample
            per_batch.append(F.mse_loss(out, target).item())
        losses.append(sum(per_batch) / len(per_batch))
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """The example's tiny CLIP text encoder as a transformers folder, read by the run and by the reference."""
    config = load_config(EXAMPLE)
    folder = tmp_path_factory.mktemp("text") / "clip"
    build_text_encoder(config, build_backbone(config, "meta")).save(folder)
    return folder


# 2 stages x 2 replicas under 1F1B; one stage on 2 sharded replicas (each unit gathered as it computes); 4 stages
# on 2 processes under zbv, whose forward-only passes go through the
# stages in order with plain sends (torch's V-shaped schedules cannot run without a backward)
LAYOUTS = {"1f1b-dp2": ["pipeline.data_parallel=2"],
           "sharded-dp2": ["pipeline.stages=1", "pipeline.data_parallel=2", "pipeline.data_parallel_shard=true"],
           "zbv": ['pipeline.schedule="zbv"', "pipeline.virtual_stages=2"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_loss_and_samples_through_the_pipeline_equal_the_unsplit_model(tmp_path, layout, text_folder):
    run = tmp_path / "run"
    cmd = ["train", str(EXAMPLE), "--output-dir", str(run),
           "--set", "train.max_steps=4", "--set", "train.batch_size=32",
           "--set", "pipeline.microbatches=2", "--set", "train.eval_every=2", "--set", "sample.every=2",
           "--set", "sample.steps=3", "--set", "sample.seeds=[0, 1]", "--set", "checkpoint.every=0",
           "--set", f'model.text_encoder="{text_folder}"']
    cmd += [arg for item in LAYOUTS[layout] for arg in ("--set", item)]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 3]
    assert {f"eval_loss_t{q:.2f}" for q in (0.1, 0.3, 0.5, 0.7, 0.9)} <= set(evals[-1])
    assert evals[-1]["eval_loss"] == pytest.approx(_reference_eval_loss(run), rel=1e-5)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # trained on: the held-out loss falls

    # the last samples through the pipeline against diffpipe sample's chain
    through_pipeline = np.asarray(Image.open(run / "samples" / "step-000004.png"), dtype=np.int16)
    assert (run / "samples" / "step-000002.png").is_file()
    chained = np.asarray(Image.open(run / "samples.png"), dtype=np.int16)  # written by load_generator at the end
    width, height = grid_size(10, 2, (64, 64), [0, 1])  # 10 digits x 2 seeds, 8x8 shown 8x, labelled
    assert through_pipeline.shape == chained.shape == (height, width)
    assert np.abs(through_pipeline - chained).max() <= 1  # 8-bit rounding at most
    assert through_pipeline.std() > 10  # not a blank image
