"""Checkpoints and resume, as a user runs them: a run cut short after its checkpoint at step 3 resumes to the same
losses step for step as the uninterrupted run on the same 2 stages, and on 1 and 4 stages (resharded by name);
damaged, partial, foreign and incompatible checkpoints are refused with a message before any process starts."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffpipe.cli import main
from diffpipe.models.loading import CheckpointError
from diffpipe.train.checkpoint import latest_checkpoint, verify_checkpoint

from ..helpers import Ran, run_command
from ..planted import planted

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"
QUICK = ["--set", "train.max_steps=6", "--set", "train.batch_size=16", "--set", "checkpoint.every=3",
         "--set", "output.sample_every_end=false", "--set", "observe.log_every=0",
         "--set", 'train.device="cpu"']  # every layout on one kind of device: a GPU's kernels round otherwise


def _train(*args: str) -> Ran:
    return run_command(["train", str(EXAMPLE), *QUICK, *args])


def _train_in_own_process(*args: str) -> subprocess.CompletedProcess:
    """Where the test reads the run's error message (printed to stderr, which run_command leaves to pytest)."""
    cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), *QUICK, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _cut_short(full: Path, to: Path) -> Path:
    """The run folder as a crash after step 4 leaves it: checkpoint 3 complete, metrics of steps 0-4, no step 6."""
    shutil.copytree(full, to)
    shutil.rmtree(to / "checkpoints" / "step-00000006")
    rows = (to / "metrics.jsonl").read_text().splitlines()
    (to / "metrics.jsonl").write_text("".join(line + "\n" for line in rows if json.loads(line)["step"] <= 4))
    return to


@pytest.mark.torch_smoke
def test_checkpoints_are_written_and_kept(full_run):
    names = sorted(p.name for p in (full_run / "checkpoints").iterdir())
    assert names == ["step-00000003", "step-00000006"]  # every 3 steps and at the end; keep = 2
    assert latest_checkpoint(full_run).name == "step-00000006"
    files = sorted(p.name for p in (full_run / "checkpoints" / "step-00000003").iterdir())
    assert "complete.json" in files and len(files) == 3  # one shard per stage, then the seal
    assert all(f.endswith(".safetensors") for f in files if f != "complete.json")  # no pickle


# the layout resumed on: a checkpoint is read by name, into plain tensors or into replicas' parts (torch's DTensors)
LAYOUTS = {"2 stages": ["pipeline.stages=2"], "1 stage": ["pipeline.stages=1"], "4 stages": ["pipeline.stages=4"],
           "2 sharded replicas": ["pipeline.stages=1", "pipeline.data_parallel=2", "pipeline.data_parallel_shard=true"]}


@pytest.mark.torch_smoke
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_cut_short_run_resumes_to_the_same_losses(full_run, tmp_path, layout):
    run = _cut_short(full_run, tmp_path / "run")
    unfinished = run / "checkpoints" / ".step-00000004.partial"
    unfinished.mkdir()  # a save that a full disk stopped: removed as the resume starts (issue 58)
    result = _train("--resume", str(run), *(arg for item in LAYOUTS[layout] for arg in ("--set", item)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming" in result.stdout and "(step 3)" in result.stdout
    assert not unfinished.exists() and f"removed {unfinished}" in result.stdout
    got, want = _losses(run), _losses(full_run)
    assert list(got) == list(range(6))  # steps 0-2 kept, 3-5 trained again once each
    if layout == "2 stages":
        assert got == want  # the same layout: bit for bit
    else:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)  # another layout sums in another order
    assert latest_checkpoint(run).name == "step-00000006"


def test_a_run_of_sharded_replicas_resumes_on_a_pipeline(full_run, tmp_path):
    """Each replica writes its part of every weight and AdamW moment; a pipeline of 2 stages reads them whole."""
    sharded = tmp_path / "sharded"
    result = _train("--output-dir", str(sharded), "--set", "pipeline.stages=1", "--set", "pipeline.data_parallel=2",
                    "--set", "pipeline.data_parallel_shard=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(sharded) == pytest.approx(_losses(full_run), rel=1e-5, abs=1e-7)
    run = _cut_short(sharded, tmp_path / "run")
    result = _train("--resume", str(run), "--set", "pipeline.stages=2", "--set", "pipeline.data_parallel=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == pytest.approx(_losses(sharded), rel=1e-5, abs=1e-7)


def _refused(run: Path, *extra: str, capsys) -> str:
    assert main(["train", str(EXAMPLE), *QUICK, "--resume", str(run), *extra]) == 2
    return capsys.readouterr().err


def test_a_damaged_checkpoint_is_refused_and_left_in_place(full_run, tmp_path, capsys):
    run = _cut_short(full_run, tmp_path / "run")
    shard = sorted((run / "checkpoints" / "step-00000003").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    err = _refused(run, capsys=capsys)
    assert "damaged" in err and shard.name in err and shard.exists()
    shard.unlink()
    assert f"{shard.name} (written by process 0) is missing" in _refused(run, capsys=capsys)


def test_a_flipped_byte_or_an_edited_seal_is_refused(full_run, tmp_path, capsys):
    """A byte changed inside a tensor (same size), a seal without its file list, and a seal whose next_step was
    edited by hand (which resumed at the wrong step, silently) are each refused in one line."""
    run = _cut_short(full_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step-00000003"
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[-5] ^= 0x01
    shard.write_bytes(bytes(flipped))
    assert f"{shard.name} is damaged" in _refused(run, capsys=capsys)
    shard.write_bytes(original)
    seal = checkpoint / "complete.json"
    record = json.loads(seal.read_text())
    seal.write_text(json.dumps({k: v for k, v in record.items() if k != "files"}))
    assert "is not a diffpipe checkpoint seal (it needs next_step, model and files)" in _refused(run, capsys=capsys)
    seal.write_text(json.dumps([record]))
    assert "is not a diffpipe checkpoint seal" in _refused(run, capsys=capsys)
    seal.write_text(json.dumps(dict(record, next_step=5)))
    err = _refused(run, capsys=capsys)
    assert "was changed after it was written" in err and "Traceback" not in err


def test_without_the_sha256_check_a_flipped_byte_would_resume(full_run, tmp_path):
    """The plant: a check of sizes alone takes the same-size damaged shard that the test above sees refused."""
    checkpoint = _cut_short(full_run, tmp_path / "run") / "checkpoints" / "step-00000003"
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    flipped = bytearray(shard.read_bytes())
    flipped[-5] ^= 0x01
    shard.write_bytes(bytes(flipped))
    shapes = {k: tuple(v) for k, v in json.loads((checkpoint / "complete.json").read_text())["model"].items()}
    with pytest.raises(CheckpointError, match="is damaged"):
        verify_checkpoint(checkpoint, shapes)
    sizes_only = planted("diffpipe.train.checkpoint", ' or sha256_of(f) != expected["sha256"]:', ":")
    assert sizes_only.verify_checkpoint(checkpoint, shapes) == 3


def test_an_incompatible_config_or_model_is_refused(full_run, tmp_path, capsys):
    run = _cut_short(full_run, tmp_path / "run")
    assert "train.seed: 0 -> 5" in _refused(run, "--set", "train.seed=5", capsys=capsys)
    assert "raise it to train on" in _refused(run, "--set", "train.max_steps=3", capsys=capsys)
    checkpoint = latest_checkpoint(run)
    record = json.loads((checkpoint / "complete.json").read_text())
    shapes = {k: tuple(v) for k, v in record["model"].items()}
    assert verify_checkpoint(checkpoint, shapes) == 3
    other = dict(shapes, **{"conv_in.weight": (64, 1, 3, 3)})
    with pytest.raises(CheckpointError, match="of another model: conv_in.weight"):
        verify_checkpoint(checkpoint, other)


def test_partial_saves_are_never_resumed_from(full_run, tmp_path):
    run = _cut_short(full_run, tmp_path / "run")
    (run / "checkpoints" / ".step-00000009.partial").mkdir()
    shutil.copytree(run / "checkpoints" / "step-00000003", run / "checkpoints" / "step-00000008")
    (run / "checkpoints" / "step-00000008" / "complete.json").unlink()  # a save cut off before it was sealed
    assert latest_checkpoint(run).name == "step-00000003"


def test_no_checkpoint_no_resume(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    assert "no run there" in _refused(run, capsys=capsys)


def test_a_checkpoint_holding_nan_weights_is_never_resumed(full_run, tmp_path):
    """Sealed as written (sizes and sha256 match), but with NaN weights: refused when read, by name."""
    import hashlib

    from safetensors.torch import load_file, save_file

    run = _cut_short(full_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step-00000003"
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    name = next(k for k in tensors if k.startswith("model."))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(shard))
    record = json.loads((checkpoint / "complete.json").read_text())
    record.pop("seal_sha256")
    record["files"][shard.name] = {"bytes": shard.stat().st_size, "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    record["seal_sha256"] = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()  # sealed anew
    (checkpoint / "complete.json").write_text(json.dumps(record))
    result = _train_in_own_process("--resume", str(run))
    assert result.returncode == 1
    assert "holds NaN or inf values" in result.stderr and "Traceback" not in result.stderr


def _tensors(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for shard in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


def test_a_checkpoint_written_in_the_background_holds_the_step_it_was_taken_at(full_run, tmp_path):
    """checkpoint.asynchronous: training goes on while the checkpoint is written, yet it holds exactly what the
    synchronous run's checkpoint of the same step holds (the weights were copied when it was taken)."""
    run = tmp_path / "async"
    result = _train("--output-dir", str(run), "--set", "checkpoint.asynchronous=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == _losses(full_run)
    for name in ("step-00000003", "step-00000006"):
        got, want = _tensors(run / "checkpoints" / name), _tensors(full_run / "checkpoints" / name)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name


def test_checkpoints_by_the_clock(tmp_path):
    """checkpoint.every_minutes, with steps off: a tiny interval asks for one after every step (all processes follow
    the main one's clock); a long one leaves only the end's."""
    often, rarely = tmp_path / "often", tmp_path / "rarely"
    for run, minutes in ((often, "1e-9"), (rarely, "60")):
        result = _train("--output-dir", str(run), "--set", "checkpoint.every=0", "--set",
                        f"checkpoint.every_minutes={minutes}", "--set", "checkpoint.keep=6")
        assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (often / "checkpoints").iterdir()) == [f"step-0000000{i}" for i in range(1, 7)]
    assert sorted(p.name for p in (rarely / "checkpoints").iterdir()) == ["step-00000006"]


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_a_lora_run_checkpoints_its_adapters_alone_and_resumes_on_another_layout(tmp_path, kind):
    """Every adapter.type: the adapters alone in the checkpoint, resumed on 1 stage to the losses of 2 (DoRA's
    magnitude, LoHa's and LoKr's factors restored by name, each stage's drawn as the unsplit model's)."""
    from diffpipe.models.lora import is_adapter

    lora = ["--set", f"adapter.type=\"{kind}\"", "--set", "adapter.rank=4"]
    full = tmp_path / "full"
    assert _train("--output-dir", str(full), *lora).returncode == 0
    names = set()
    for shard in (full / "checkpoints" / "step-00000003").glob("*.safetensors"):
        from safetensors import safe_open
        with safe_open(str(shard), framework="pt") as f:
            names |= {k for k in f.keys() if k.startswith("model.")}
    assert names and all(is_adapter(k) for k in names)  # the frozen base comes from the model
    assert (kind == "dora") == any(".lora_magnitude_vector." in k for k in names)
    run = _cut_short(full, tmp_path / "run")
    result = _train("--resume", str(run), *lora, "--set", "pipeline.stages=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == pytest.approx(_losses(full), rel=1e-5, abs=1e-7)


_SPLIT_SAVE = """
import sys, torch
from pathlib import Path
import diffpipe.train.checkpoint as checkpoint
from diffpipe.config_files import load_config
from diffpipe.distributed import single_process_topology
from diffpipe.train.trainer import Trainer

checkpoint._FILE_BYTES = 64 * 1024  # a 0.13 M-parameter model in several files
config = load_config(sys.argv[1], ["pipeline.stages=1", "train.batch_size=8", "output.sample_every_end=false",
                                   "observe.enabled=false"])
trainer = Trainer(config, single_process_topology("cpu"), Path(sys.argv[2]))
trainer.steps.take(0)
path = checkpoint.save_checkpoint(trainer, 1, keep=1)
saved = {k: v.clone() for k, v in checkpoint._state(trainer, 1).items()}
for p in trainer.params:
    p.data.zero_()
checkpoint.verify_checkpoint(path, trainer.model_shapes)
assert checkpoint.load_checkpoint(trainer, path) == 1
loaded = checkpoint._state(trainer, 1)
assert all(torch.equal(saved[k], loaded[k]) for k in saved), "a tensor differs after loading"
print(len(list(path.glob("*.safetensors"))), "files")
"""


def test_a_checkpoint_is_cut_into_files_of_about_a_gib_and_reads_back_whole(tmp_path):
    """DCP's safetensors writer builds each file in memory: one file per process doubled a save's memory (and
    tripled a background one's), so files are cut at about 1 GiB; every tensor reads back from the pieces."""
    from diffpipe.build import build_backbone
    from diffpipe.config_files import load_config
    from diffpipe.train.checkpoint import file_of_each_tensor, model_shapes

    sdxl = model_shapes(build_backbone(load_config(EXAMPLE.parent / "sdxl_unet.toml"), "meta").model)
    files = file_of_each_tensor(sdxl)
    sizes: dict[int, int] = {}
    for name, shape in sdxl.items():
        assert files[f"model.{name}"] == files[f"optim.{name}.exp_avg"] == files[f"optim.{name}.exp_avg_sq"]
        sizes[files[f"model.{name}"]] = sizes.get(files[f"model.{name}"], 0) + 12 * torch.Size(shape).numel()
    assert 28 <= len(sizes) <= 31 and max(sizes.values()) <= 2**30  # 28.7 GiB of weights and moments
    assert files["a second name of a tied weight"] == 0
    averaged = file_of_each_tensor(sdxl, moving_average=True)  # train.ema_decay: an average beside each weight
    sizes = {}
    for name, shape in sdxl.items():
        assert averaged[f"ema.{name}"] == averaged[f"model.{name}"]
        sizes[averaged[f"model.{name}"]] = sizes.get(averaged[f"model.{name}"], 0) + 16 * torch.Size(shape).numel()
    assert max(sizes.values()) <= 2**30
    result = subprocess.run([sys.executable, "-c", _SPLIT_SAVE, str(EXAMPLE), str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-2]) >= 10, result.stdout
