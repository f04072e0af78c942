"""`diffpipe train` and `diffpipe sample` as a user runs them, in real processes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from diffpipe.cli import main

from .helpers import Ran, grid_size, run_command

EXAMPLE = Path(__file__).parent.parent / "examples" / "digits.toml"
QUICK = ["--set", "train.max_steps=4", "--set", "train.batch_size=16", "--set", "sample.steps=2",
         "--set", "sample.seeds=[0]"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(out), *QUICK, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _train_here(out: Path, *extra: str) -> Ran:
    """The same in pytest's process (run_command), where the test reads only files and the launcher's lines."""
    return run_command(["train", str(EXAMPLE), "--output-dir", str(out), *QUICK, *extra])


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_and_two_stages_and_torchrun_give_the_same_losses_and_a_usable_run_folder(tmp_path):
    one, two, under_torchrun = tmp_path / "one", tmp_path / "two", tmp_path / "torchrun"
    for run, stages in ((one, "1"), (two, "2")):
        result = _train_here(run, "--set", f"pipeline.stages={stages}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(one) == pytest.approx(_losses(two), rel=1e-6, abs=1e-7)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(under_torchrun), *QUICK]
    result = subprocess.run(torchrun, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(under_torchrun) == _losses(two)
    assert len(_losses(one)) == 4
    for name in ("config.toml", "model.safetensors", "metrics.jsonl", "samples.png", "loss.png"):
        assert (two / name).is_file(), name
    assert Image.open(two / "samples.png").size == grid_size(10, 1, (64, 64), [0])  # 10 digits, 1 seed, 8x

    _check_observability(two)

    out = tmp_path / "row.png"
    assert main(["sample", str(two), "--prompt", "a handwritten digit three", "--num", "5", "--seed", "2",
                 "--steps", "3", "--out", str(out)]) == 0
    assert Image.open(out).size == (5 * 8 * 8, 8 * 8)  # 8x8 digits enlarged 8x: visible when opened


def _check_observability(run: Path) -> None:
    """Per-stage metrics, stage_times.jsonl, the timeline, TensorBoard events read back, report and timeline commands."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("stage0_compute_s", "stage1_bubble_s", "stage1_comm_s", "bubble_fraction", "ideal_bubble_fraction"):
        assert all(key in r for r in rows), key
    assert all(r["stage0_compute_s"] > 0 for r in rows)
    assert all(r["stage1_alloc_retries"] == 0 for r in rows)  # no CUDA allocator on CPU: nothing to retry
    assert (run / "timeline.png").is_file() and json.loads((run / "timeline.json").read_text())["traceEvents"]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/samples_per_s", "stage1/compute_s", "pipeline/bubble_fraction"} <= set(tags)
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    picture = run.parent / f"{run.name}-t2.png"  # never into a run folder (written_files.check_target)
    assert main(["timeline", str(run), "--step", "2", "--out", str(picture)]) == 0
    assert Image.open(picture).size[0] > 400
    assert main(["report", str(run)]) == 0 and (run / "report.png").is_file()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_on_two_stages(tmp_path, precision):
    result = _train_here(tmp_path / precision, "--set", f"train.precision={precision}", "--set", "sample.steps=1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / precision / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] and 0 < r["loss"] < 10 for r in rows)  # finite, sensible
    if precision == "fp16":
        assert all("loss_scale" in r for r in rows)


@pytest.mark.parametrize("override,message", [
    ("train.max_stepz=3", "train.max_stepz: unknown key; did you mean 'max_steps'?"),
    ("train.max_steps=\"many\"", "train.max_steps: Input should be a valid integer"),
    ("train.batch_size=30", "nearest valid batch sizes: 28 or 32"),
    ("pipeline.stages=14 pipeline.schedule=\"gpipe\"", "the model has only 13 units"),
    ("pipeline.microbatches=1", "needs pipeline.microbatches >= its 2 stages"),
    ("pipeline.split=[3,2] pipeline.stages=3", "strictly increasing"),
    ("train.precision=\"fp8\"", "train.precision: Input should be 'fp32', 'bf16' or 'fp16'"),
    # values that failed only inside a worker, after the run folder existed, or trained to NaN and ended "done"
    ("train.learning_rate=inf", "train.learning_rate: Input should be a finite number (got inf)"),
    ("train.adam_eps=nan", "train.adam_eps: Input should be a finite number"),
    ("train.betas=[2.0,0.5]", "train.betas.0: Input should be less than 1 (got 2.0)"),
    ("pipeline.stages=2 train.stage_lr_scale=[-1.0,1.0]", "train.stage_lr_scale.0: Input should be greater than"),
    ("train.collective_timeout_minutes=1e300", "train.collective_timeout_minutes: Input should be less than or equal"),
    ("data.latent_size=[0,0]", "data.latent_size.0: Input should be greater than or equal to 1"),
])
def test_config_errors_name_the_key_and_start_nothing(tmp_path, capsys, override, message):
    out = tmp_path / "run"
    sets = [arg for item in override.split(" ") for arg in ("--set", item)]
    code = main(["train", str(EXAMPLE), "--output-dir", str(out), *sets])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_existing_run_folder_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors").write_text("precious")
    assert main(["train", str(EXAMPLE), "--output-dir", str(out)]) == 2
    assert "is not empty and diffpipe did not make it" in capsys.readouterr().err
    assert (out / "model.safetensors").read_text() == "precious"


def test_sample_to_a_file_it_cannot_write_is_refused_before_sampling(tmp_path, capsys, monkeypatch):
    import diffpipe.sampling

    def never(*args):
        raise AssertionError("sampled before checking --out")

    monkeypatch.setattr(diffpipe.sampling, "load_generator", never)
    assert main(["sample", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'x.txt'}: give an image file name" in err


def test_sample_from_an_unfinished_run_says_what_is_missing(tmp_path, capsys):
    assert main(["sample", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "a.png")]) == 2
    assert "config.toml is missing" in capsys.readouterr().err


def test_monitor_stop_action_saves_and_ends_the_run_early(tmp_path):
    """A hair-trigger monitor (any step slower than the rolling mean) with on_anomaly = stop."""
    run = tmp_path / "run"
    result = _train(run, "--set", "train.max_steps=40", "--set", "observe.anomaly_factor=1.0001",
                    "--set", "observe.anomaly_warmup=2", "--set", "observe.on_anomaly=stop")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: step" in result.stdout and "action: stop" in result.stdout
    assert "stopped after step" in result.stdout
    assert len(_losses(run)) < 40
    assert (run / "model.safetensors").is_file()


def test_observe_every_times_only_some_steps(tmp_path):
    run = tmp_path / "run"
    result = _train_here(run, "--set", "observe.every=2", "--set", "observe.timeline_step=3")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "stage0_compute_s" in r] == [0, 2, 3]
    assert (run / "timeline.png").is_file()
    assert main(["report", str(run)]) == 0


def test_help_answers_before_the_heavy_imports():
    """`diffpipe --help` parses first: no torch, diffusers or transformers is imported to print it."""
    code = ("import sys\nfrom diffpipe.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_bad_input_gets_one_line_and_nothing_is_touched(tmp_path, capsys):
    """Each says what is wrong and what to do (exit 2), before any process starts."""
    def refused(*argv: str) -> str:
        assert main(list(argv)) == 2
        return capsys.readouterr().err.strip()

    assert "train.batch_size: Input should be a valid integer (got '64')" in refused(
        "train", str(EXAMPLE), "--set", 'train.batch_size="64"')
    binary = tmp_path / "config.toml"
    binary.write_bytes(bytes(range(256)))
    assert "is not a text file" in refused("train", str(binary))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is a file, not a folder" in refused("train", str(EXAMPLE), "--output-dir", str(a_file))
    assert "cannot write the run folder" in refused("train", str(EXAMPLE), "--output-dir", "/sys/diffpipe-run")
    for flag, value in (("--num", "0"), ("--steps", "0"), ("--steps", "-5")):
        assert f"{flag} {value}: give 1 or more" in refused(
            "sample", str(tmp_path), "--prompt", "a digit", "--out", str(tmp_path / "x.png"), flag, value)


def test_a_run_that_could_not_save_its_weights_does_not_start(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    from diffpipe.commands.train import _check_free_space
    from diffpipe.errors import CommandError
    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    config = build_config({})
    backbone = build_backbone(config, "meta")
    _check_free_space(tmp_path, backbone, config)  # 0.79 M parameters: fits
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
    with pytest.raises(CommandError, match=r": 1000 B free, but the weights and 3 checkpoint\(s\) need 3[0-9.]+ MiB"):
        _check_free_space(tmp_path, backbone, config)


def test_a_monitor_warning_never_cancels_a_scheduled_checkpoint(tmp_path):
    """The monitor warns on every step (its verdict planted: real latencies warn only now and then): every
    scheduled checkpoint is still written (24 of 103 were missing in one run where the monitor only warned)."""
    run = tmp_path / "run"
    code = ("import sys\nfrom diffpipe.observe.observer import PipelineObserver\n"
            "PipelineObserver.after_step = lambda self, step, record, times: 'warn'\n"
            "from diffpipe.cli import main\nsys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "train", str(EXAMPLE), "--output-dir", str(run), *QUICK,
           "--set", "pipeline.stages=1", "--set", "train.max_steps=12", "--set", "checkpoint.every=2",
           "--set", "checkpoint.keep=20", "--set", "output.sample_every_end=false"]  # one process: the plant applies
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{s:08d}" for s in range(2, 13, 2)]
