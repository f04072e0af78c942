"""Nothing a user holds is lost to a diffpipe command (issue 58): `export --force` and `sample --out` replace only
what diffpipe wrote (written_files.check_target, the rule they share with the run folder's --overwrite), a resume
never changes its run when another folder was named, settings that could not apply are refused before launch, and
a folder that is not a run is said not to be one. Each test was seen failing on the code before its fix."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file, save_file

from diffpipe.cli import main
from diffpipe.config import ConfigError
from diffpipe.config_files import load_config
from diffpipe.preflight import check_before_launch

from .helpers import run_command

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished one-stage digits run of 2 steps with its checkpoints and a timed step (for `timeline`)."""
    out = tmp_path_factory.mktemp("nothing_lost") / "run"
    result = run_command(["train", str(EXAMPLES / "digits.toml"), "--output-dir", str(out), "--set",
                          "train.max_steps=2", "--set", "train.batch_size=16", "--set", "output.sample_every_end=false",
                          "--set", "pipeline.stages=1", "--set", "observe.log_every=0", "--set", "checkpoint.every=1",
                          "--set", "observe.timeline_step=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _project(folder: Path) -> dict[str, str]:
    """A user's folder (a config.toml, some code) and what it holds."""
    (folder / "src").mkdir(parents=True)
    files = {"config.toml": "lr = 1\n", "src/main.py": "print('mine')\n"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def _holds(folder: Path, files: dict[str, str]) -> bool:
    return all((folder / name).read_text() == text for name, text in files.items())


def test_export_force_never_replaces_a_folder_an_export_did_not_write(run, tmp_path, capsys):
    mine = tmp_path / "mine"
    files = _project(mine)
    assert main(["export", str(run), "--format", "diffusers", "--out", str(mine), "--force"]) == 2
    err = capsys.readouterr().err
    assert "--force replaces only an earlier export" in err and "config.toml, src" in err
    assert _holds(mine, files) and sorted(p.name for p in mine.iterdir()) == ["config.toml", "src"]


def test_export_force_replaces_an_earlier_export_folder_whole(run, tmp_path, capsys):
    out = tmp_path / "unet"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    (out / "left_over.txt").write_text("from the export before")  # replaced whole: nothing of it stays
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out), "--force"]) == 0
    assert (out / "config.json").is_file() and not (out / "left_over.txt").exists()
    assert set(load_file(str(out / "diffusion_pytorch_model.safetensors"))) == set(
        load_file(str(run / "model.safetensors")))


@pytest.mark.parametrize("fmt", ["original", "diffusers"])
def test_export_force_replaces_an_exported_file_and_never_a_users_own(run, tmp_path, capsys, fmt):
    exported = tmp_path / "unet.safetensors"
    assert main(["export", str(run), "--format", fmt, "--out", str(exported)]) == 0
    assert main(["export", str(run), "--format", fmt, "--out", str(exported), "--force"]) == 0
    users = tmp_path / "users.safetensors"  # a file of the user's (another tool's weights)
    save_file({"w": load_file(str(exported))[next(iter(load_file(str(exported))))]}, str(users))
    before = users.read_bytes()
    assert main(["export", str(run), "--format", fmt, "--out", str(users), "--force"]) == 2
    assert "--force replaces only an earlier export" in capsys.readouterr().err
    assert users.read_bytes() == before


def test_sample_never_writes_into_a_run_folder_nor_over_an_image_without_force(run, tmp_path, capsys):
    loss = run / "loss.png"
    before = loss.read_bytes()
    for out, extra in ((loss, []), (loss, ["--force"]), (run / "seven.png", [])):
        assert main(["sample", str(run), "--prompt", "a seven", "--steps", "1", "--out", str(out), *extra]) == 2
        assert "is in the run folder" in capsys.readouterr().err
    assert loss.read_bytes() == before and not (run / "seven.png").exists()
    mine = tmp_path / "mine.png"
    Image.new("RGB", (4, 4), (1, 2, 3)).save(mine)
    picture = mine.read_bytes()
    assert main(["sample", str(run), "--prompt", "a seven", "--steps", "1", "--out", str(mine)]) == 2
    assert "already exists; choose another path, or add --force" in capsys.readouterr().err
    assert mine.read_bytes() == picture
    assert main(["sample", str(run), "--prompt", "a seven", "--steps", "1", "--out", str(mine), "--force"]) == 0
    assert mine.read_bytes() != picture and Image.open(mine).size == (64, 64)
    notes = tmp_path / "notes.png"  # named as an image, holding something else: not replaced even with --force
    notes.write_text("my notes")
    assert main(["sample", str(run), "--prompt", "a seven", "--steps", "1", "--out", str(notes), "--force"]) == 2
    assert "--force replaces only an image file" in capsys.readouterr().err and notes.read_text() == "my notes"


def test_a_resume_with_another_output_dir_is_refused_and_the_run_is_untouched(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    other = tmp_path / "other"
    before = {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert main(["train", str(EXAMPLES / "digits.toml"), "--resume", str(copy), "--output-dir", str(other),
                 "--set", "train.max_steps=3", "--set", "train.batch_size=16", "--set", "pipeline.stages=1",
                 "--set", "checkpoint.every=1"]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {other} names another" in err and f"cp -r {copy} {other}" in err
    assert {p.relative_to(copy): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    assert not other.exists()


@pytest.mark.parametrize("setting", ['memory.base_dtype="nf4"', 'memory.base_dtype="int8"', 'memory.base_dtype="fp8"',
                                     "memory.block_swap=2"])
def test_a_memory_setting_a_full_fine_tune_cannot_use_is_refused(setting):
    with pytest.raises(ConfigError, match="a full fine-tune.*would\nchange nothing|a full fine-tune.*change nothing"):
        load_config(EXAMPLES / "digits.toml", [setting])


def test_block_swap_above_the_units_holding_frozen_weights_is_refused_naming_how_many():
    config = load_config(EXAMPLES / "digits_lora.toml", ["memory.block_swap=999", "pipeline.stages=1"])
    with pytest.raises(ConfigError, match=r"memory.block_swap = 999 .* no stage has more than (\d+) unit"):
        check_before_launch(config)
    config = load_config(EXAMPLES / "digits_lora.toml", ["memory.block_swap=2", "pipeline.stages=1"])
    assert check_before_launch(config).split == []  # a count that applies is kept


def test_sample_and_export_of_a_folder_that_is_not_a_run_say_so(tmp_path, capsys):
    folder = tmp_path / "project"
    _project(folder)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "model_config.json").write_text("{}")
    assert main(["sample", str(folder), "--prompt", "x", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{folder} is not a run folder" in err and "unknown key" not in err
    assert main(["export", str(folder), "--format", "diffusers", "--out", str(tmp_path / "x")]) == 2
    assert f"{folder} is not a run folder" in capsys.readouterr().err


def test_timeline_and_report_follow_the_same_rule(run, tmp_path, capsys):
    """`timeline --out` and `report --out` wrote over any file and into run folders; report's own default,
    RUN/report.png, is a file the run folder may hold (so --overwrite replaces the run after a report)."""
    from diffpipe.run_folder import WRITTEN

    mine = tmp_path / "mine.png"
    Image.new("RGB", (4, 4)).save(mine)
    picture = mine.read_bytes()
    for command in (["timeline", str(run), "--out", str(mine)], ["report", str(run), "--out", str(mine)]):
        assert main(command) == 2 and "already exists" in capsys.readouterr().err
        assert main([*command[:2], "--out", str(run / "timeline.png"), "--force"]) == 2
        assert "is in the run folder" in capsys.readouterr().err
    assert mine.read_bytes() == picture
    assert main(["timeline", str(run), "--out", str(mine), "--force"]) == 0 and mine.read_bytes() != picture
    assert main(["timeline", str(run), "--out", str(mine), "--force"]) == 0  # its own trace (mine.json) replaced
    assert main(["report", str(run)]) == 0 and "report.png" in WRITTEN and (run / "report.png").is_file()


def test_a_data_error_is_one_line_on_one_stage_as_on_two(tiny, tmp_path, capfd):
    """A non-UTF-8 metadata.jsonl reached the user of a one-stage run as a ValueError's traceback (two stages gave
    one line): data errors are DataError, printed as one line whatever the layout."""
    photos = tmp_path / "photos"
    shutil.copytree(tiny / "photos", photos)
    (photos / "metadata.jsonl").write_bytes(b'{"file_name": "china_0.jpg", "text": "caf\xe9"}\n')
    assert main(["train", str(EXAMPLES / "photos.toml"), "--output-dir", str(tmp_path / "run"),
                 "--set", f'model.path="{tiny / "sdxl"}"', "--set", f'data.path="{photos}"', "--set", "data.cache=false",
                 "--set", "pipeline.stages=1", "--set", "train.max_steps=1"]) == 2
    err = capfd.readouterr().err  # (the process's own stderr: the one-stage worker runs in this process)
    assert "metadata.jsonl is not UTF-8 text (byte" in err and len(err.strip().splitlines()) == 1


def test_an_empty_or_unusable_data_folder_is_named_before_anything_loads_or_is_written(tiny, tmp_path, capsys):
    """It was reported after the model loaded and the text encoders ran, leaving a config.toml (issue 56)."""
    empty, broken = tmp_path / "empty", tmp_path / "broken"
    empty.mkdir()
    broken.mkdir()
    (broken / "a.jpg").write_text("not a picture")
    for folder, why in ((empty, ""), (broken, "a.jpg: not a readable image")):
        run = tmp_path / f"run-{folder.name}"
        assert main(["train", str(EXAMPLES / "photos.toml"), "--output-dir", str(run), "--set",
                     f'model.path="{tiny / "sdxl"}"', "--set", f'data.path="{folder}"']) == 2
        err = capsys.readouterr().err
        listed = ".jpg, .jpeg, .jfif, .png, .webp, .bmp, .tif, .tiff, .avif"
        assert f"data.path: no usable images ({listed}) in {folder}" in err
        assert why in err
        assert not run.exists()
