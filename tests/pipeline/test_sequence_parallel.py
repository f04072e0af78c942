"""Sequence parallelism (pipeline/sequence.py): the central test's comparison, shown failing on the errors it exists
to catch, and the refusals said before anything launches.

The scenarios that train to the unsplit model's losses, gradients, moments and weights (sp2, sp2 x pp2, sp2 x dp2,
LoRA checkpointed) are in test_pipelined_gradients.py. Here the same comparison sees each planted error fail:
- a rotary table cut to the wrong share (every process given the first share's positions);
- attention without its all-to-alls (each share attends only to its own tokens);
- the shares' gradients left unaveraged (each process's loss counts only its own tokens);
- Flux's rotary table (the text's positions, then the image's) cut as one table rather than part by part;
- HunyuanVideo 1.5's rotary table (a condition every stage receives whole) cut to the first share;
- a token count the degree does not divide: the pad left among the attentions' keys; the pad counted in the loss;
  the loss over the picture's own tokens not scaled back to their count; Flux's key mask laid out with the pad
  first (its keys are the text's, then the picture's).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from diffpipe.config import ConfigError
from diffpipe.preflight import check_before_launch

from ..helpers import run_command, run_workers
from ..planted import planted
from ..train.test_checkpoint import _cut_short, _losses
from . import test_pipelined_gradients as central
from .reference_loop import reference

PLANTS = {"rope-first-share": "wan-sp2", "no-all-to-all": "wan-sp2", "shares-not-averaged": "wan-sp2",
          "joint-rope-cut-whole": "flux-sp2",
          "rope-first-share-hunyuan": "hunyuan-video15-sp2",  # its rotary table a condition, cut where blocks read it
          "pad-not-masked": "wan-sp2-padded", "pad-in-the-loss": "wan-sp2-padded",
          "pad-loss-not-scaled": "wan-sp2-padded", "joint-mask-pad-first": "flux-sp2-padded"}


def _planted_worker(plant: str, scenarios: list, out_dir: str) -> None:
    """The central test's worker with one error planted in this process's diffpipe."""
    import diffpipe.train.run_parts as run_parts
    import diffpipe.train.trainer as trainer

    if plant.startswith("rope-first-share"):  # the rope table (tokens along dimension 2) always cut to share 0
        wrong = planted("diffpipe.pipeline.sequence", "return tensor.narrow(dim, self.rank * per, per)",
                        "return tensor.narrow(dim, 0 if dim == 2 else self.rank * per, per)")
        run_parts.SequenceShards = wrong.SequenceShards
    elif plant == "no-all-to-all":
        run_parts.attend_across_shards = lambda model, mesh, device, shards: None
    elif plant == "joint-rope-cut-whole":
        wrong = planted("diffpipe.pipeline.sequence",
                        "return torch.cat([self.shards.shard(piece, dim) for piece in out[name].split(lengths, dim=dim)], dim=dim)",
                        "return self.shards.shard(out[name], dim)")
        run_parts.split_sequence = wrong.split_sequence
    elif plant == "pad-not-masked":
        wrong = planted("diffpipe.pipeline.sequence", "if self.shards.padding and (", "if False and (")
        run_parts.attend_across_shards = wrong.attend_across_shards
    elif plant == "joint-mask-pad-first":
        wrong = planted("diffpipe.pipeline.sequence", "torch.cat([kept.new_ones(keys - len(kept)), kept])",
                        "torch.cat([kept, kept.new_ones(keys - len(kept))])")
        run_parts.attend_across_shards = wrong.attend_across_shards
    elif plant in ("pad-in-the-loss", "pad-loss-not-scaled"):
        wrong = planted("diffpipe.pipeline.runtime", *(
            ("if shards is None or not shards.padding:", "if True:") if plant == "pad-in-the-loss" else
            ("return loss * (shards.padded(shards.step.count) / shards.step.count)", "return loss")))
        run_parts.PipelineRunner = wrong.PipelineRunner
    elif plant == "shares-not-averaged":
        wrong = planted("diffpipe.train.step", "average_over_shares(self.params, self.runner.sequence)", "pass")
        trainer.TrainingStep = wrong.TrainingStep
    central._scenario_worker(scenarios, out_dir)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, str]:
    return central.write_model_folders(tmp_path_factory.mktemp("initial-weights"))


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_sequence_errors_fail_the_comparison(plant, model_folders, tmp_path):
    name = PLANTS[plant]
    config = central.resolved(central.TWO[name], model_folders)
    central.planned_splits({name: config})
    run_workers(_planted_worker, (plant, [(name, config.model_dump(mode="json"))], str(tmp_path)), 2)
    ref = reference(config, central.draws_of(config))
    found = central.compare(ref, central._load_ranks(name, 2, tmp_path), central._weight_scale(config, ref))
    problems = central.failures(found)
    print(plant, problems)
    assert any(p.startswith(("losses", "grads")) for p in problems), plant


def _sequence_config(model: str, degree: int, **pipeline) -> dict:
    data = copy.deepcopy(central._config(1, "1f1b", model=model))
    data["pipeline"].update(sequence_parallel=degree, **pipeline)
    data["train"]["device"] = "cpu"
    return data


@pytest.mark.parametrize("model,degree,words", [
    ("digits", 2, "the unet2d family cannot split a sample's tokens"),
    ("sd3", 2, "the sd3 family cannot split"),
    ("chroma", 2, "the chroma family cannot split a sample's tokens .its attention masks the captions' padding"),
    ("flux-kontext", 2, "the flux_kontext family cannot split"),
    ("wan-ti2v-i2v", 2, "the wan_i2v family cannot split a sample's tokens .TI2V's timesteps"),
    ("qwen-image-edit", 2, "the qwen_image_edit family cannot split"),
])
def test_a_split_that_cannot_be_is_refused_before_launch(model, degree, words, model_folders):
    config = central.resolved(_sequence_config(model, degree), model_folders)
    with pytest.raises(ConfigError, match=words) as refused:
        check_before_launch(config)
    assert "\n" not in str(refused.value)


def test_heads_the_degree_does_not_divide_are_padded_but_not_in_a_compiled_block(model_folders):
    """The tiny Wan's 4 heads over 3 processes: allowed (padded to 6, its 64 tokens to 66); with pipeline.compile,
    refused before launch in a line (the exchange is a torch function mode, which a compiled block cannot run)."""
    check_before_launch(central.resolved(_sequence_config("wan", 3), model_folders))
    with pytest.raises(ConfigError, match="pipeline.sequence_parallel = 3 does not divide the model's 4 heads, so its "
                                          "attention pads them to 6 .* set pipeline.compile = false, or a degree "
                                          "that divides 4 .2, 4.") as refused:
        check_before_launch(central.resolved(_sequence_config("wan", 3, compile="blocks"), model_folders))
    assert "\n" not in str(refused.value)


def test_tokens_that_do_not_divide_are_padded_where_the_family_masks_the_pad(model_folders):
    """A clip of 3 frames of 75 picture tokens (Wan's 10x10 latents in 2x2 patches, HunyuanVideo's 5x5 in 1x1): Wan
    pads them to 76 for 2 processes (its runs are the central test's wan-sp2-padded); HunyuanVideo 1.5 (its text
    masks and rotary table cut as conditions) does not pad them and is refused; more processes than tokens is
    refused for any family."""
    for model, side, refused in (("wan", 10, None),
                                 ("hunyuan-video15", 5, "splits each sample's 75 picture tokens into equal")):
        data = central._odd_tokens(_sequence_config(model, 2), [side, side], frames=3)
        if refused is None:
            check_before_launch(central.resolved(data, model_folders))
            continue
        with pytest.raises(ConfigError, match=refused):
            check_before_launch(central.resolved(data, model_folders))
    data = central._odd_tokens(_sequence_config("wan", 4), [2, 2], frames=3)  # 3 tokens
    with pytest.raises(ConfigError, match="splits each sample's 3 picture tokens over 4 processes: more processes "
                                          "than tokens; choose a degree of at most 3"):
        check_before_launch(central.resolved(data, model_folders))


VIDEO = Path(__file__).parent.parent.parent / "examples" / "video_tiny.toml"  # Wan's digits preset: 64 tokens a clip
VIDEO_QUICK = ["--set", "train.max_steps=6", "--set", "train.batch_size=8", "--set", "checkpoint.every=3",
               "--set", "pipeline.stages=1", "--set", "output.sample_every_end=false", "--set", "observe.log_every=0",
               "--set", 'train.device="cpu"']


@pytest.fixture(scope="module")
def split_run(tmp_path_factory) -> Path:
    """6 steps of the tiny Wan with every clip's tokens split over 2 processes, checkpointed at steps 3 and 6."""
    run = tmp_path_factory.mktemp("sp2") / "run"
    result = run_command(["train", str(VIDEO), *VIDEO_QUICK, "--set", "pipeline.sequence_parallel=2",
                          "--output-dir", str(run)])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "x 2 processes sharing each sample's tokens" in result.stdout
    return run


def test_a_split_run_trains_to_the_losses_of_one_process(split_run, tmp_path):
    whole = tmp_path / "whole"
    result = run_command(["train", str(VIDEO), *VIDEO_QUICK, "--output-dir", str(whole)])
    assert result.returncode == 0, result.stdout[-3000:]
    assert _losses(split_run) == pytest.approx(_losses(whole), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("degree", [1, 4])
def test_a_split_run_resumes_at_another_degree_to_the_same_losses(split_run, tmp_path, degree):
    run = _cut_short(split_run, tmp_path / "run")
    result = run_command(["train", str(VIDEO), *VIDEO_QUICK, "--resume", str(run),
                          "--set", f"pipeline.sequence_parallel={degree}"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "(step 3)" in result.stdout
    got, want = _losses(run), _losses(split_run)
    assert list(got) == list(range(6))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_a_text_length_that_does_not_divide_is_refused_before_launch(model_folders):
    """Flux splits its text tokens beside the image's: 7 of them do not halve."""
    data = _sequence_config("flux", 2)
    data["model"]["text_max_length"] = 7
    with pytest.raises(ConfigError, match="splits each sample's 7 text tokens .* model.text_max_length a multiple"):
        check_before_launch(central.resolved(data, model_folders))


def test_a_folder_bucket_whose_tokens_do_not_divide_is_refused_before_the_first_step(tmp_path, capsys):
    """The tiny clips at 64x64 pixels fall into 48x80 and 80x48 buckets: 3 x 5 tokens a latent frame, odd, which
    HunyuanVideo 1.5 does not pad."""
    from diffpipe.cli import main

    run = tmp_path / "run"
    code = main(["train", str(VIDEO.parent / "hunyuan_video15_tiny.toml"), "--set", "train.max_steps=2",
                 "--set", "pipeline.stages=1", "--set", "pipeline.sequence_parallel=2", "--set", 'train.device="cpu"',
                 "--output-dir", str(run)])
    err = capsys.readouterr().err
    assert code != 0
    assert "(2 items): pipeline.sequence_parallel = 2 splits each sample's 75 picture tokens" in err
    assert not (run / "metrics.jsonl").exists()  # no step was taken


def test_a_folder_whose_buckets_pad_trains_to_the_losses_of_one_process(tmp_path):
    """The same clips through Wan (75 and 135 tokens a clip: padded to 76 and 136 over 2 processes) train to one
    process's losses, bucket after bucket."""
    quick = ["--set", "train.max_steps=4", "--set", "pipeline.stages=1", "--set", "output.sample_every_end=false",
             "--set", "observe.log_every=0", "--set", 'train.device="cpu"']
    runs = {}
    for degree in (1, 2):
        runs[degree] = tmp_path / f"sp{degree}"
        result = run_command(["train", str(VIDEO.parent / "wan_clips.toml"), *quick,
                              "--set", f"pipeline.sequence_parallel={degree}", "--output-dir", str(runs[degree])])
        assert result.returncode == 0, result.stdout[-3000:]
    assert _losses(runs[2]) == pytest.approx(_losses(runs[1]), rel=1e-5, abs=1e-7)


def test_picture_rows_that_do_not_divide_are_refused_for_qwen_image(model_folders):
    """Qwen-Image's rotary table is cut by rows of its grid: 6x8 latents are 3 rows of 4 tokens (12 tokens, which 2
    divides), and 2 processes cannot share 3 rows."""
    data = _sequence_config("qwen-image", 2)
    data["data"]["dataset"] = "synthetic"
    data["data"]["latent_size"] = [6, 8]
    with pytest.raises(ConfigError, match="splits each sample's 3 rows of picture tokens"):
        check_before_launch(central.resolved(data, model_folders))


def test_a_split_flux_run_on_a_folder_evaluates_and_trains_as_one_process(tmp_path):
    """The tiny Flux folder (three aspect buckets) with held-out photos: every step's loss and each eval loss of a run
    split over 2 processes equal one process's."""
    import json

    runs = {}
    for degree in (1, 2):
        run = tmp_path / f"sp{degree}"
        result = run_command(["train", str(VIDEO.parent / "flux_tiny.toml"), "--set", "train.max_steps=4",
                              "--set", "pipeline.stages=1", "--set", f"pipeline.sequence_parallel={degree}",
                              "--set", "train.eval_every=2", "--set", "data.eval_fraction=0.25",
                              "--set", "output.sample_every_end=false", "--set", 'train.device="cpu"',
                              "--output-dir", str(run)])
        assert result.returncode == 0, result.stdout[-3000:]
        runs[degree] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "eval_loss"):
        whole = [r[key] for r in runs[1] if key in r]
        split = [r[key] for r in runs[2] if key in r]
        assert whole and split == pytest.approx(whole, rel=1e-5), key


def _averaging_worker(out_dir: str) -> None:
    """Gradients of several sizes and two dtypes, different on each process, averaged in buckets of 10 elements."""
    import os

    import torch
    import torch.distributed as dist

    import diffpipe.pipeline.sequence as sequence
    from diffpipe.distributed import init_topology

    topo = init_topology(1, 1, "cpu", sp_size=2)
    sequence._BUCKET_ELEMENTS = 10  # this process's copy of the module: several buckets from a few tensors
    params = []
    for i, (numel, dtype) in enumerate([(3, torch.float32), (8, torch.float32), (12, torch.float32),
                                        (2, torch.float64), (5, torch.float64), (4, torch.float32)]):
        p = torch.zeros(numel, dtype=dtype, requires_grad=True)
        p.grad = torch.arange(numel, dtype=dtype) * (i + 1) + 100 * topo.sp_rank
        params.append(p)
    sequence.average_over_shares(params, sequence.SequenceShards(2, topo.sp_rank, topo.sp_mesh["ulysses"].get_group()))
    torch.save([p.grad for p in params], os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def test_gradients_are_averaged_over_the_shares_bucket_by_bucket(tmp_path):
    import torch

    run_workers(_averaging_worker, (str(tmp_path),), 2)
    for rank in range(2):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for i, grad in enumerate(grads):  # the mean of arange x (i + 1) and arange x (i + 1) + 100
            want = torch.arange(grad.numel(), dtype=grad.dtype) * (i + 1) + 50
            assert grad.dtype == want.dtype and torch.equal(grad, want), (rank, i)


HEAD_PLANTS = {"pad-heads-kept": ("return _Exchanged.apply(out, self.group, False)[:, :heads]",
                                  "return _Exchanged.apply(out, self.group, False)[:, -heads:]"),
               "mask-not-gathered": ('named["attn_mask"] = self._gathered(named["attn_mask"])',
                                     'named["attn_mask"] = named["attn_mask"].repeat(1, 1, 1, self.size)'),
               "gradient-dropped-on-its-way-back": ("(grad, ctx.group), None, None",
                                                    "(torch.zeros_like(grad), ctx.group), None, None")}


def _padded_heads_worker(out_dir: str, plant: str | None) -> None:
    """4 heads over 3 processes (padded to 6): each process attends from its third of the tokens, under a key mask;
    and the all-to-all rate is probed among them (its buffer in 3 equal parts)."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import diffpipe.pipeline.exchange as exchange
    from diffpipe.distributed import init_topology
    from diffpipe.observe.observer import probe_all_to_all

    if plant is not None:
        exchange = planted("diffpipe.pipeline.exchange", *HEAD_PLANTS[plant])
    topo = init_topology(1, 1, "cpu", sp_size=3)
    assert probe_all_to_all(topo) > 0
    torch.manual_seed(0)
    q, k, v, weights = (torch.randn(2, 4, 6, 4, dtype=torch.float64) for _ in range(4))
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 1] = mask[0, ..., 4] = False  # a key of each process's share masked out
    mine = slice(2 * topo.sp_rank, 2 * topo.sp_rank + 2)
    shares = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with exchange.PaddedHeads(topo.sp_mesh["ulysses"].get_group(), 3) as padded:
        out = F.scaled_dot_product_attention(*shares, attn_mask=mask[..., mine])
    (out * weights[:, :, mine]).sum().backward()
    torch.save({"out": out.detach(), "grads": [t.grad for t in shares], "bytes": padded.bytes},
               os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


@pytest.mark.parametrize("plant", [pytest.param(None, marks=pytest.mark.torch_smoke), *HEAD_PLANTS])
def test_heads_the_degree_does_not_divide_attend_as_one_process_does(tmp_path, plant):
    """The padded heads' exchange gives every process its tokens' share of the unsplit attention and of its
    gradients; the exchanged bytes are the padded queries, keys, values and output. Each plant fails it."""
    import torch
    import torch.nn.functional as F

    run_workers(_padded_heads_worker, (str(tmp_path), plant), 3)
    torch.manual_seed(0)
    q, k, v, weights = (torch.randn(2, 4, 6, 4, dtype=torch.float64).requires_grad_() for _ in range(4))
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 1] = mask[0, ..., 4] = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (out * weights).sum().backward()
    agree = []
    for rank in range(3):
        got, mine = torch.load(tmp_path / f"rank{rank}.pt"), slice(2 * rank, 2 * rank + 2)
        agree.append(torch.allclose(got["out"], out[:, :, mine], atol=1e-12)
                     and all(torch.allclose(g, t.grad[:, :, mine], atol=1e-12) for g, t in zip(got["grads"], (q, k, v))))
        assert got["bytes"] == 4 * 2 * 2 * 6 * 4 * 8  # (q, k, v, output) x samples x 2 of 6 heads x tokens x width
    assert all(agree) == (plant is None), plant


def test_a_units_share_of_a_stream_holds_only_its_own_tokens():
    """The unit that cuts a token stream keeps this process's share alone: a view of the whole stream would keep all
    of it alive as long as the share (on an H100 the whole 720p embedding of Wan 14B, 0.72 GiB a process)."""
    import torch
    from torch import nn

    from diffpipe.pipeline.sequence import SequenceShards, _Shares

    class Embedding(nn.Module):
        def forward(self, sample):
            return {"h": sample * 2}

    sample = torch.randn(2, 8, 4)
    share = _Shares(Embedding(), {"h": 1}, SequenceShards(2, 1))(sample=sample)["h"]
    assert torch.equal(share, sample[:, 4:] * 2)
    assert share.untyped_storage().nbytes() == share.numel() * share.element_size()


@pytest.mark.parametrize("checkpointing, passes", [("none", 2), ("all", 3)])
def test_a_step_reports_what_its_all_to_alls_carried(tmp_path, checkpointing, passes):
    """Each step's metrics (and the run's report) give the bytes the attentions' all-to-alls carried and their time at the rate
    measured at start: the tiny Wan's 4 self-attentions, each exchanging its queries, keys, values and output (4 x 8
    samples x 32 of 64 tokens x 48 wide, fp32) in forward, as much in backward, and again where checkpointing
    computes the forward twice; Wan's cross-attention to the text attends locally and exchanges nothing."""
    import json

    run = tmp_path / "run"
    result = run_command(["train", str(VIDEO), *VIDEO_QUICK, "--set", "pipeline.sequence_parallel=2",
                          "--set", "train.max_steps=2", "--set", "checkpoint.every=0", "--set", "observe.log_every=1",
                          "--set", f'pipeline.checkpointing="{checkpointing}"', "--output-dir", str(run)])
    assert result.returncode == 0, result.stdout[-3000:]
    one_way = 4 * 4 * 8 * 32 * 48 * 4  # blocks x (q, k, v, output) x samples x tokens x width x bytes
    for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        assert row["stage0_all_to_all_mib"] * 2**20 == passes * one_way
        assert 0 < row["stage0_all_to_all_s"] <= row["stage0_compute_s"]
    from diffpipe.observe.report import summarise_run

    assert "stage 0: compute " in summarise_run(run) and " (all-to-all 0.0" in summarise_run(run)
