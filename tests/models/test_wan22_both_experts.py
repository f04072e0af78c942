"""Wan 2.2 A14B's two experts in one run (issue 30, `model.expert = "both"`): each sample goes to the expert its
timestep picks, as WanPipeline picks one (transformer/ from boundary_ratio x 1000 up, transformer_2/ below); the
paired units compute what the experts' own forwards compute, in order and as stages, with the gradients of a loss
over a mixed batch; 1 and 2 stages train to the same losses and both experts move; exports load into WanPipeline
with both experts trained; what cannot hold two experts is refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from diffpipe.build import build_backbone, timestep_range
from diffpipe.cli import main
from diffpipe.config_files import load_config
from diffpipe.errors import ExportError
from diffpipe.export.run import export_run
from diffpipe.models.family import Feed
from diffpipe.models.loading import CheckpointError
from diffpipe.models.two_experts import TwoExperts
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.sampling import run_stages

from ..helpers import losses_of, run_command

ROOT = Path(__file__).parent.parent.parent
QUICK = ["output.sample_every_end=false", "checkpoint.every=0", "observe.log_every=0", 'train.device="cpu"',
         'model.expert="both"', "data.caption_dropout=0.0", "train.warmup_steps=0"]
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def clips(tiny_video, tmp_path_factory) -> Path:
    return shutil.copytree(tiny_video / "clips", tmp_path_factory.mktemp("both") / "clips")


def _config(tiny_video: Path, clips: Path, *extra: str):
    return load_config(ROOT / "examples" / "wan_clips.toml",
                       [f'model.path="{tiny_video / "wan22"}"', f'data.path="{clips}"', *QUICK, *extra])


def _train(tiny_video: Path, clips: Path, run: Path, *extra: str):
    sets = [f'model.path="{tiny_video / "wan22"}"', f'data.path="{clips}"', *QUICK, *extra]
    return run_command(["train", str(ROOT / "examples" / "wan_clips.toml"), "--output-dir", str(run),
                        *[a for s in sets for a in ("--set", s)]])


def _batch(model, timesteps: list[float]):
    gen = torch.Generator().manual_seed(0)
    feed = Feed(model.family, model.model.config)
    conditions = feed.conditions(torch.randn(len(timesteps), 512, 32, generator=gen), torch.zeros(len(timesteps), 0),
                                 torch.zeros(len(timesteps), 6), (3, 8, 8))
    latents = torch.randn(len(timesteps), 4, 3, 8, 8, generator=gen)
    return feed.pack(latents), dict(conditions, timestep=torch.tensor(timesteps))


@pytest.mark.parametrize("timesteps", [[999.0, 100.0, 875.0, 874.0], [999.0, 900.0], [10.0, 500.0], [999.0, 10.0]])
def test_each_sample_goes_to_the_expert_its_timestep_picks_in_order_as_stages_and_in_its_gradients(
        tiny_video, clips, timesteps):
    backbone = build_backbone(_config(tiny_video, clips))
    experts = backbone.model
    assert isinstance(experts, TwoExperts) and experts.boundary == 875.0
    for component in ("transformer", "transformer_2"):  # each expert with its own subfolder's weights
        own = load_file(str(tiny_video / "wan22" / component / WEIGHTS))
        assert all(torch.equal(v, own[k]) for k, v in getattr(experts, component).state_dict().items())
    sample, conditions = _batch(backbone, timesteps)
    family = backbone.family
    units = backbone.forward({"sample": sample}, conditions)
    staged = run_stages(build_stage_modules(backbone, stage_specs(backbone, [1, 3])), sample, conditions)
    reference = family.diffusers_forward(experts, sample, conditions)  # TwoExperts: the pipeline's choice per sample
    assert torch.equal(units, reference) and torch.equal(staged, units)
    for i, t in enumerate(timesteps):  # ... which is each expert's own forward on its samples (t = 875: the high one)
        own = experts.transformer if t >= 875 else experts.transformer_2
        alone = family.diffusers_forward(own, sample[i:i + 1], {k: v[i:i + 1] for k, v in conditions.items()})
        torch.testing.assert_close(units[i:i + 1], alone, rtol=1e-5, atol=1e-6)
    grads = []
    for predict in (lambda: backbone.forward({"sample": sample}, conditions),
                    lambda: family.diffusers_forward(experts, sample, conditions)):
        experts.zero_grad(set_to_none=True)
        (predict() ** 2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in experts.named_parameters() if p.grad is not None})
    units, reference = grads
    assert reference.keys() <= units.keys()
    for name, grad in units.items():  # an expert no sample reached: zeros from the units (its weights tied in at
        # zero, for data-parallel replicas; the trainer then drops them), none from the reference
        torch.testing.assert_close(grad, reference.get(name, torch.zeros_like(grad)), rtol=1e-5, atol=1e-7)
    for expert, reached in (("transformer.", any(t >= 875 for t in timesteps)),
                            ("transformer_2.", not all(t >= 875 for t in timesteps))):
        assert any(n.startswith(expert) for n in reference) == reached


def test_both_experts_train_on_one_and_two_stages_to_the_same_losses_and_export_into_the_pipeline(
        tiny_video, clips, tmp_path):
    runs = {stages: tmp_path / f"stages{stages}" for stages in (1, 2)}
    for stages, run in runs.items():
        result = _train(tiny_video, clips, run, "train.max_steps=4", "train.learning_rate=1e-2",
                        f"pipeline.stages={stages}", 'train.timestep_sampling="uniform"',
                        f'data.cache_dir="{tmp_path / "cache"}"')
        assert result.returncode == 0, result.stderr[-3000:]
        assert 'model.expert = "both"' in result.stdout
    losses = [losses_of(run) for run in runs.values()]
    assert len(losses[0]) == 4
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)
    trained = [load_file(str(run / "model.safetensors")) for run in runs.values()]
    # against lr x steps (4e-2), the furthest AdamW moves a weight: it divides a gradient near its epsilon by its own
    # root-mean-square, so the stages' order of summing shows up to 3.5e-4 of that (measured 1.4e-5 on
    # 2026-12-05; the former bound, 1e-5 absolute, failed then); a wrong split moves weights by a whole step
    for name in trained[0]:
        torch.testing.assert_close(trained[1][name], trained[0][name], rtol=0, atol=2e-3 * 1e-2 * 4)
    base = tiny_video / "wan22"
    out = tmp_path / "pipeline"
    assert main(["export", str(runs[2]), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = WanPipeline.from_pretrained(out)
    for component in ("transformer", "transformer_2"):  # each expert trained (the steps' samples reached both)
        exported = getattr(pipe, component).state_dict()
        assert all(torch.equal(v, trained[1][f"{component}.{k}"]) for k, v in exported.items())
        assert any(not torch.equal(v, load_file(str(base / component / WEIGHTS))[k]) for k, v in exported.items())
    with pytest.raises(ExportError, match="trained both experts .* other formats hold one backbone"):
        export_run(runs[2], "comfyui", tmp_path / "x.safetensors")
    with pytest.raises(ExportError, match="--out names a folder"):
        export_run(runs[2], "diffusers", tmp_path / "x.safetensors")
    assert main(["sample", str(runs[2]), "--prompt", "a red square moving right", "--out", str(tmp_path / "s.gif"),
                 "--steps", "2"]) == 0


def test_a_lora_of_both_experts_exports_a_file_for_each_that_the_pipeline_loads(tiny_video, clips, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny_video, clips, run, "train.max_steps=4", "train.learning_rate=1e-2", "pipeline.stages=1",
                    'train.timestep_sampling="uniform"', 'adapter.type="lora"', "adapter.rank=4", "adapter.alpha=8.0",
                    f'data.cache_dir="{tmp_path / "cache"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    merged = load_file(str(run / "model.safetensors"))  # the adapters merged into both experts
    pipe = WanPipeline.from_pretrained(tiny_video / "wan22")
    backbone = build_backbone(_config(tiny_video, clips))
    sample, conditions = _batch(backbone, [999.0, 100.0])
    with torch.no_grad():
        base = backbone.family.diffusers_forward(TwoExperts(pipe.transformer, pipe.transformer_2, 875.0), sample,
                                                 conditions)
        pipe.load_lora_weights(out)
        pipe.load_lora_weights(out, weight_name="pytorch_lora_weights_low_noise.safetensors",
                               load_into_transformer_2=True)
        loaded = backbone.family.diffusers_forward(TwoExperts(pipe.transformer, pipe.transformer_2, 875.0), sample,
                                                   conditions)
        backbone.model.load_state_dict(merged)
        want = backbone.family.diffusers_forward(backbone.model, sample, conditions)
    for row in (0, 1):  # the high expert's sample and the low one's: each file moved its expert
        assert (base[row] - want[row]).abs().max() > 1e-3
    torch.testing.assert_close(loaded, want, rtol=1e-5, atol=1e-5)


def test_both_on_a_one_backbone_folder_and_experts_of_two_architectures_are_refused(tiny_video, clips, tmp_path):
    one = load_config(ROOT / "examples" / "wan_clips.toml", [f'model.path="{tiny_video / "wan"}"',
                                                            'model.expert="both"'])
    with pytest.raises(CheckpointError, match="has one backbone: leave model.expert unset"):
        build_backbone(one, "meta")
    folder = shutil.copytree(tiny_video / "wan22", tmp_path / "mixed")
    low = json.loads((folder / "transformer_2" / "config.json").read_text())
    (folder / "transformer_2" / "config.json").write_text(json.dumps(dict(low, ffn_dim=96)))
    mixed = load_config(ROOT / "examples" / "wan_clips.toml", [f'model.path="{folder}"', 'model.expert="both"'])
    with pytest.raises(CheckpointError, match="experts differ in ffn_dim; both must be one architecture"):
        build_backbone(mixed, "meta")
    assert timestep_range(_config(tiny_video, clips)) is None  # the whole range: each sample picks its expert


def test_data_parallel_replicas_train_as_one_process_does(tiny_video, clips, tmp_path):
    """1 process, 2 replicas (DDP's engine), 2 stages x 2 replicas (FSDP2's replicate) and 2 stages: the same losses
    and weights, though a replica's samples often all go to one expert (its other expert's weights tied in at zero)."""
    runs = {}
    for stages, replicas in ((1, 1), (1, 2), (2, 2), (2, 1)):
        runs[stages, replicas] = run = tmp_path / f"{stages}x{replicas}"
        result = _train(tiny_video, clips, run, "train.max_steps=4", "train.learning_rate=1e-2",
                        f"pipeline.stages={stages}", f"pipeline.data_parallel={replicas}", "pipeline.microbatches=2",
                        'train.timestep_sampling="uniform"', f'data.cache_dir="{tmp_path / "cache"}"',
                        "train.adam_eps=1e-6")
        assert result.returncode == 0, result.stderr[-3000:]
    one = losses_of(runs[1, 1])
    reference = load_file(str(runs[1, 1] / "model.safetensors"))
    for layout, run in runs.items():
        torch.testing.assert_close(torch.tensor(losses_of(run)), torch.tensor(one), rtol=1e-5, atol=0, msg=str(layout))
        weights = load_file(str(run / "model.safetensors"))
        # replicas sum in another order; AdamW's epsilon at 1e-6 (not 1e-8) keeps a weight whose gradient is near
        # zero from stepping a whole learning rate on the sign of rounding: with 1e-8 one moved 4.7e-4 apart on the
        # thirty-second session's machine (6e-5 on earlier ones), past the bound; with 1e-6 at most 7.6e-6 there
        for name, tensor in reference.items():
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-4, msg=f"{layout} {name}")


def test_an_expert_no_sample_reached_is_left_as_it_was(tiny_video, clips, tmp_path):
    """Every timestep below the boundary (train.timestep_range): the high-noise expert gets no gradient, and AdamW
    (with weight decay, which would shrink it on a zero gradient) leaves it bit-equal, on 2 replicas too."""
    run = tmp_path / "low-side"
    result = _train(tiny_video, clips, run, "train.max_steps=3", "train.learning_rate=1e-2", "train.weight_decay=0.1",
                    "pipeline.stages=1", "pipeline.data_parallel=2", "train.timestep_range=[0.0, 0.5]",
                    f'data.cache_dir="{tmp_path / "cache"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    trained = load_file(str(run / "model.safetensors"))
    for component, moved in (("transformer", False), ("transformer_2", True)):
        base = load_file(str(tiny_video / "wan22" / component / WEIGHTS))
        changed = [k for k, v in base.items() if not torch.equal(trained[f"{component}.{k}"], v)]
        assert bool(changed) == moved, (component, changed[:3])


def test_two_of_a_preset_plan_at_the_t2v_boundary_with_replicas_where_they_fit():
    from diffpipe.planner.plan import hardware, search_layouts

    config = load_config(ROOT / "examples" / "wan22_a14b_both.toml", ["data.latent_size=[8, 8]", "data.frames=3",
                                                                     "plan.memory_gib=1000"])  # all fit
    meta = build_backbone(config, "meta")  # two of the preset (no folder: Wan 2.2 T2V's boundary)
    assert meta.model.boundary == 875.0
    assert round(sum(p.numel() for p in meta.model.parameters() if not p.requires_grad) / 1e9, 1) == 28.6
    layouts = search_layouts(config, meta, 4, hardware(config))
    assert {plan.data_parallel for plan in layouts} >= {1, 2, 4}


def test_a_run_of_both_experts_resumes_on_another_layout_to_the_same_weights(tiny_video, clips, tmp_path):
    settings = ("train.learning_rate=1e-2", 'train.timestep_sampling="uniform"', "checkpoint.every=2",
                'train.lr_schedule="constant"',  # (a cosine's rate depends on max_steps, which the halves change)
                f'data.cache_dir="{tmp_path / "cache"}"')
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert _train(tiny_video, clips, whole, "train.max_steps=4", *settings).returncode == 0
    assert _train(tiny_video, clips, halves, "train.max_steps=2", *settings, "pipeline.stages=1").returncode == 0
    sets = [f'model.path="{tiny_video / "wan22"}"', f'data.path="{clips}"', *QUICK, *settings, "train.max_steps=4",
            "pipeline.stages=2"]
    assert run_command(["train", str(ROOT / "examples" / "wan_clips.toml"), "--resume", str(halves),
                        *[a for s in sets for a in ("--set", s)]]).returncode == 0
    torch.testing.assert_close(torch.tensor(losses_of(halves)), torch.tensor(losses_of(whole)), rtol=1e-5, atol=0)
    resumed, straight = load_file(str(halves / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    for name, tensor in straight.items():  # (1 and 2 stages round apart: as the replicas' test allows)
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=4e-4, msg=name)
