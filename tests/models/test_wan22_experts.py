"""Wan 2.2 (issue 30). A14B's two experts: a pipeline folder with transformer/ (high noise) and transformer_2/ (low
noise) switched at model_index.json's boundary_ratio trains one expert per run (model.expert), with that expert's
weights, on its own side of the boundary only; a full fine-tune exports into that expert's subfolder, the other left
as it was; a folder's experts are never guessed. TI2V-5B's layout (its 16x residual VAE) trains text-to-video."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from diffpipe.build import build_backbone, timestep_range
from diffpipe.cli import main
from diffpipe.config_files import load_config
from diffpipe.distributed import single_process_topology
from diffpipe.models.loading import CheckpointError
from diffpipe.train.trainer import Trainer

from ..helpers import run_command

ROOT = Path(__file__).parent.parent.parent
QUICK = ["train.max_steps=2", "output.sample_every_end=false", "checkpoint.every=0", "observe.log_every=0",
         'train.device="cpu"']


@pytest.fixture(scope="module")
def clips(tiny_video, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wan22") / "clips"
    shutil.copytree(tiny_video / "clips", folder)
    return folder


@contextlib.contextmanager
def _one_process():
    """A world of this process alone (as benches run a Trainer), its group and torchrun's variables gone after."""
    environment = dict(os.environ)
    try:
        yield single_process_topology("cpu")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


def _config(tiny_video: Path, clips: Path, *extra: str):
    return load_config(ROOT / "examples" / "wan_clips.toml",
                       [f'model.path="{tiny_video / "wan22"}"', f'data.path="{clips}"', *QUICK, *extra])


@pytest.mark.parametrize("expert,subfolder,side", [("high", "transformer", (0.875, 1.0)),
                                                   ("low", "transformer_2", (0.0, 0.875))])
def test_each_expert_trains_with_its_own_weights_on_its_own_timesteps(tiny_video, clips, tmp_path, expert,
                                                                       subfolder, side):
    config = _config(tiny_video, clips, f'model.expert="{expert}"', "pipeline.stages=1")
    model = build_backbone(config, "cpu").model
    file = load_file(str(tiny_video / "wan22" / subfolder / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(file[k], v) for k, v in model.state_dict().items())
    assert timestep_range(config) == side
    with _one_process() as topology:
        trainer = Trainer(config, topology, tmp_path / "run")
        drawn = torch.cat([trainer.batches.draw(step, (4, 5, 6, 10)).t for step in range(50)])  # the run's draws
    assert side[0] <= drawn.min() and drawn.max() <= side[1]
    assert drawn.max() - drawn.min() > 0.5 * (side[1] - side[0])  # spread over the side, not one point
    wider = _config(tiny_video, clips, f'model.expert="{expert}"', "train.timestep_range=[0.5, 0.9]")
    assert timestep_range(wider) == (0.5, 0.9)  # train.timestep_range overrides the expert's side


def test_a_two_expert_folder_without_model_expert_and_an_expert_of_one_backbone_are_refused(tiny_video, clips,
                                                                                           capsys):
    with pytest.raises(CheckpointError, match='set model.expert = "high" or "low"'):
        build_backbone(_config(tiny_video, clips), "meta")
    one = load_config(ROOT / "examples" / "wan_clips.toml", [f'model.path="{tiny_video / "wan"}"',
                                                            'model.expert="low"'])
    with pytest.raises(CheckpointError, match="has one backbone: leave model.expert unset"):
        build_backbone(one, "meta")
    assert run_command(["train", str(ROOT / "examples" / "wan_clips.toml"), "--set",
                        f'model.path="{tiny_video / "wan22"}"', "--set", f'data.path="{clips}"']).returncode == 2
    assert "has two experts" in capsys.readouterr().err


def test_the_low_expert_trained_on_two_stages_exports_into_its_own_subfolder(tiny_video, clips, tmp_path):
    run = tmp_path / "run"
    sets = [f'model.path="{tiny_video / "wan22"}"', f'data.path="{clips}"', 'model.expert="low"', *QUICK,
            "train.learning_rate=1e-2"]
    assert run_command(["train", str(ROOT / "examples" / "wan_clips.toml"), "--output-dir", str(run),
                        *[a for s in sets for a in ("--set", s)]]).returncode == 0
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    base = tiny_video / "wan22"
    name = "diffusion_pytorch_model.safetensors"
    high, low = load_file(str(out / "transformer" / name)), load_file(str(out / "transformer_2" / name))
    assert all(torch.equal(v, load_file(str(base / "transformer" / name))[k]) for k, v in high.items())
    trained = load_file(str(run / "model.safetensors"))
    assert all(torch.equal(low[k], trained[k]) for k in trained)
    assert any(not torch.equal(v, load_file(str(base / "transformer_2" / name))[k]) for k, v in low.items())
    assert json.loads((out / "model_index.json").read_text())["boundary_ratio"] == 0.875
    # samples from the run (as at its end): its one backbone, the trained expert (refused as "has one backbone:
    # leave model.expert unset" before the run's expert was set aside for loading it)
    assert main(["sample", str(run), "--prompt", "a red square moving right", "--out", str(tmp_path / "s.gif"),
                 "--steps", "2"]) == 0


def test_the_ti2v_layout_trains_text_to_video_through_its_16x_vae(tiny_video, clips, tmp_path, capfd):
    """Wan 2.2's residual VAE patches 2x2 pixels before its levels: 16 pixels a latent (its config says so, its
    levels alone would say 8), so buckets step by 32 pixels (16 x the transformer's 2x2 patches); 16 is refused."""
    from diffpipe.models.vae import vae_frame_factor, vae_scale_factor

    folder = tiny_video / "wan22_ti2v"
    assert (vae_scale_factor(folder), vae_frame_factor(folder)) == (16, 4)
    assert vae_scale_factor(tiny_video / "wan") == 8
    train = ["train", str(ROOT / "examples" / "wan_clips.toml"), "--set", f'model.path="{folder}"',
             "--set", f'data.path="{clips}"', *[a for s in QUICK for a in ("--set", s)]]
    ran = run_command([*train, "--output-dir", str(tmp_path / "run"), "--set", "data.bucket_step=32",
                       "--set", "pipeline.stages=1"])
    assert ran.returncode == 0
    assert "64x64x17f" in ran.stdout  # 4 x 4 latents of 17 frames: the 64-pixel square bucket, as the VAE makes it
    assert run_command([*train, "--output-dir", str(tmp_path / "refused")]).returncode == 2
    assert "use a multiple of 32" in capfd.readouterr().err
