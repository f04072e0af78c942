"""`train.epochs`: a run as many passes over its data as asked, each pass showing every item, the epoch in the metrics;
and a run of epochs resumed with more of them trains on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffpipe.config_files import load_config
from diffpipe.data.batches import TensorImages
from diffpipe.data.buckets import Bucket, Placement
from diffpipe.data.folder import ImageItem, Skipped
from diffpipe.data.images import FolderImages
from diffpipe.train.run_parts import resolve_epochs

from ..helpers import run_command

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"


def _folder(bucket_sizes: list[int]) -> FolderImages:
    items, placements = [], []
    for width, count in zip((96, 128, 160), bucket_sizes):
        for _ in range(count):
            items.append(ImageItem(Path(f"{len(items)}.png"), f"item {len(items)}", width, 128))
            placements.append(Placement(Bucket(width, 128), (width, 128), 0, 0))
    return FolderImages(items, placements, Skipped())


def _steps(data, epochs: int, batch_size: int) -> int:
    train = load_config(EXAMPLE, [f"train.epochs={epochs}", f"train.batch_size={batch_size}",
                                  "pipeline.microbatches=1", "pipeline.stages=1"]).train
    resolve_epochs(train, data, say=False)
    return train.max_steps


@pytest.mark.parametrize("data,batch,per_epoch", [(_folder([3, 4, 9]), 4, 1 + 1 + 3),
                                                  (TensorImages(torch.zeros(10, 1, 8, 8), ["x"] * 10), 4, 2.5)])
def test_each_epoch_shows_every_item(data, batch, per_epoch):
    """An image folder's epoch is each bucket's items in batches of one bucket (a part batch filled from the bucket's
    start); a tensor dataset's runs on across epochs, so two epochs of 10 at batch 4 are 5 steps."""
    assert data.steps_per_epoch(batch) == per_epoch
    steps = _steps(data, 2, batch)
    assert steps == -(-2 * per_epoch // 1)
    items = len(data.captions)
    if isinstance(data, FolderImages):
        for epoch in range(2):
            seen = [i for s in range(epoch * steps // 2, (epoch + 1) * steps // 2)
                    for i in data.batch_indices(s, batch, seed=0)]
            assert set(seen) == set(range(items))
            assert len({data.placements[i].bucket for i in data.batch_indices(epoch, batch, seed=0)}) == 1
    else:
        seen = [i for s in range(steps) for i in data.batch_indices(s, batch, seed=0)]
        assert sorted(seen) == sorted(2 * list(range(items)))


def test_a_run_of_epochs_logs_its_epoch_and_resumes_with_more(tmp_path, capfd):
    """Digits (1,348 training items) at batch 256: 5.27 steps an epoch, so one epoch is 6 steps; resumed with
    train.epochs = 2 it trains on to step 11, the epoch rising past 2; the same again is refused with what to do."""
    run = tmp_path / "run"
    quick = ["--set", "train.batch_size=256", "--set", "pipeline.stages=1", "--set", "pipeline.microbatches=1",
             "--set", "sample.steps=2", "--set", "sample.seeds=[0]", "--set", "checkpoint.every=3",
             "--set", "output.sample_every_end=false"]
    first = run_command(["train", str(EXAMPLE), "--output-dir", str(run), *quick, "--set", "train.epochs=1"])
    assert first.returncode == 0, first.stdout[-3000:]
    assert "train.epochs = 1: 6 steps (5.26562 an epoch of 1348 items at batch 256)" in first.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert rows[-1]["epoch"] == pytest.approx(6 / (1348 / 256), abs=1e-3)
    more = run_command(["train", str(EXAMPLE), "--resume", str(run), *quick, "--set", "train.epochs=2"])
    assert more.returncode == 0, more.stdout[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(11)) and rows[-1]["epoch"] > 2
    capfd.readouterr()
    again = run_command(["train", str(EXAMPLE), "--resume", str(run), *quick, "--set", "train.epochs=2"])
    said = capfd.readouterr().err  # the run's own process printed it
    assert again.returncode != 0 and "run is 11 steps long (train.epochs = 2); raise train.epochs" in said, said
