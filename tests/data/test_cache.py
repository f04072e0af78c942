"""Latent and text caches: reused by a second run, exactly one entry recomputed for one changed image, a damaged
shard named and rebuilt (never trained on), broken images skipped and counted; bucketed batches and SDXL time ids."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffpipe.build import build_backbone, feed
from diffpipe.config_files import build_config
from diffpipe.data.batches import BatchMaker
from diffpipe.data.buckets import to_pixels
from diffpipe.data.cache import ShardStore, fill_store
from diffpipe.data.folder import read_rgb
from diffpipe.data.images import cache_folder
from diffpipe.data.preparation import prepare_folder_images
from diffpipe.models.families.unet.text import PipelineText
from diffpipe.models.vae import encode_latents, load_vae


def _config(tiny: Path, photos: Path, **data):
    return build_config({"model": {"path": str(tiny / "sdxl")}, "train": {"batch_size": 4},
                         "data": {"dataset": "folder", "path": str(photos), "resolution": 128, "bucket_step": 32, **data}})


def _written_keys(folder: Path, before: set[Path]) -> int:
    """Entries written to the cache's shards since `before` (the seals then)."""
    return sum(len(json.loads(p.read_text())["keys"]) for p in set(folder.rglob("*.json")) - before)


def _prepare(config, tiny):
    text = PipelineText.from_folder(tiny / "sdxl")
    return prepare_folder_images(config.data, tiny / "sdxl", load_vae(tiny / "sdxl"), text, show=False), text


@pytest.fixture()
def photos(tiny, tmp_path) -> Path:
    folder = tmp_path / "photos"
    shutil.copytree(tiny / "photos", folder, ignore=shutil.ignore_patterns(".diffpipe_cache"))  # others' runs cache there
    return folder


def test_a_second_run_reuses_the_cache_and_one_changed_image_is_recomputed_alone(tiny, photos):
    config = _config(tiny, photos)
    cache = cache_folder(config.data)
    data, text = _prepare(config, tiny)
    assert len(data.items) == 16 and len(data.latents) == 16
    assert len(data.bucket_counts()) == 3  # landscape, portrait and square crops
    assert _written_keys(cache, set()) == 16 + 3  # 16 latents; 2 captions and the empty one

    seals = set(cache.rglob("*.json"))
    again, _ = _prepare(config, tiny)
    assert _written_keys(cache, seals) == 0
    assert all(torch.equal(a, b) for a, b in zip(data.latents, again.latents))

    changed = photos / "flower_3.jpg"
    Image.open(changed).transpose(Image.FLIP_LEFT_RIGHT).save(changed)
    seals = set(cache.rglob("*.json"))
    third, _ = _prepare(config, tiny)
    assert _written_keys(cache, seals) == 1
    i = [item.path for item in third.items].index(changed)
    fresh = encode_latents(load_vae(tiny / "sdxl"), to_pixels(read_rgb(changed), third.placements[i])[None])[0]
    torch.testing.assert_close(third.latents[i], fresh)  # the new image's latent, not the old one's
    hidden, _ = text.encode(["a photo of the chinese temple"])
    torch.testing.assert_close(hidden, PipelineText.from_folder(tiny / "sdxl")._encode(["a photo of the chinese temple"])[0])


def test_a_damaged_shard_is_named_removed_and_rebuilt(tiny, photos, capsys):
    config = _config(tiny, photos)
    data, _ = _prepare(config, tiny)
    shard = next(cache_folder(config.data).glob("latents-*/*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte inside a tensor: the header still reads
    shard.write_bytes(bytes(raw))
    rebuilt, _ = _prepare(config, tiny)
    out = capsys.readouterr().out
    assert f"damaged cache shard {shard}" in out and "do not match the sha256" in out
    assert not shard.exists()
    assert all(torch.equal(a, b) for a, b in zip(data.latents, rebuilt.latents))  # recomputed, not the damaged bytes


def test_shard_store_gives_every_process_the_same_entries():
    """Two processes (threads sharing a barrier) fill one store: each computes its own share of what is missing,
    the shares cover it all, and both get every entry."""
    import tempfile
    import threading

    with tempfile.TemporaryDirectory() as folder:
        store = ShardStore(Path(folder))
        computed = {0: [], 1: []}
        barrier = threading.Barrier(2)
        results = {}

        def compute_for(rank):
            def compute(keys):
                computed[rank].extend(keys)
                return {k: {"x": torch.full((2,), float(k))} for k in keys if k != "7"}, {"7": "broken"} if "7" in keys else {}
            return compute

        def process(rank):
            results[rank] = fill_store(store, [str(i) for i in range(10)], compute_for(rank), rank=rank, world=2,
                                       barrier=barrier.wait)

        threads = [threading.Thread(target=process, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(computed[1]) == ["1", "3", "5", "7", "9"]  # this process's share of what was missing
        assert sorted(computed[0]) == ["0", "2", "4", "6", "8"]
        for entries, failed in results.values():
            assert set(entries) == {str(i) for i in range(10)} - {"7"} and failed == {"7": "broken"}
        entries, failed = fill_store(store, [str(i) for i in range(10)], compute_for(0))
        assert len(computed[0]) == 5 and set(entries) == set(results[0][0])  # a second run computes nothing


@pytest.mark.parametrize("cache", [True, False])
def test_broken_images_are_skipped_and_counted_with_and_without_the_cache(tiny, photos, cache, capsys):
    data = (photos / "china_0.jpg").read_bytes()
    (photos / "china_0.jpg").write_bytes(data[: len(data) // 3])  # truncated: its header reads
    (photos / "zero.png").write_bytes(b"")
    (photos / "small.png").write_bytes(b"")
    Image.new("RGB", (20, 20)).save(photos / "small.png")
    dataset, _ = _prepare(_config(tiny, photos, cache=cache), tiny)
    assert len(dataset.items) == 15 and len(dataset.skipped) == 3
    assert {p.name for p, _ in dataset.skipped.files} == {"china_0.jpg", "zero.png", "small.png"}
    assert "skipped 3 image file(s)" in capsys.readouterr().out
    if not cache:
        assert dataset.x0([0, 1]).shape[0] == 2  # the VAE runs in the step


def test_batches_come_from_one_bucket_and_carry_each_images_time_ids(tiny, photos):
    config = _config(tiny, photos)
    data, text = _prepare(config, tiny)
    seen = set()
    for step in range(8):  # two epochs of 16 images in batches of 4 (buckets of 4, 4 and 8)
        indices = data.batch_indices(step, 4, seed=0)
        assert len({data.placements[i].bucket for i in indices}) == 1
        seen.update(indices)
    assert seen == set(range(16))
    maker = BatchMaker(data, text, config.train, 0.0, feed(config, build_backbone(config, "meta")))
    batch = maker.make(3, 0, 1)
    indices = data.batch_indices(3, 4, seed=0)
    bucket = data.placements[indices[0]].bucket
    assert batch.noisy.shape == (4, 4, bucket.height // 8, bucket.width // 8)
    for row, i in zip(batch.conditions["time_ids"].tolist(), indices):
        item, p = data.items[i], data.placements[i]
        assert row == [item.height, item.width, p.top, p.left, bucket.height, bucket.width]
    assert any(row[2] or row[3] for i in range(16) for row in data.size_ids([i]).tolist())  # some crops are offset


def test_cache_command_builds_everything_ahead_on_two_processes(tiny, photos):
    from diffpipe.cli import main

    config_file = photos.parent / "photos.toml"
    config_file.write_text(f'[model]\npath = "{tiny / "sdxl"}"\n[data]\ndataset = "folder"\npath = "{photos}"\n'
                           'resolution = 128\nbucket_step = 32\n')
    assert main(["cache", str(config_file), "--processes", "2"]) == 0
    cache = cache_folder(_config(tiny, photos).data)
    assert _written_keys(cache, set()) == 16 + 3
    assert len(list(cache.glob("latents-*/*.safetensors"))) == 2  # one shard per process
    seals = set(cache.rglob("*.json"))
    _prepare(_config(tiny, photos), tiny)  # what a training run does first: finds it all
    assert _written_keys(cache, seals) == 0


def test_the_cache_stays_out_of_the_users_data_folder_and_says_where_it_is(tiny, photos, tmp_path, capsys):
    """It was written inside the photos folder (`.diffpipe_cache`: issue 56); now under diffpipe's cache home, one
    folder per data folder, printed; data.cache_dir moves it; a cache an earlier version left in the folder is still
    read there."""
    import os

    before = sorted(p.relative_to(photos) for p in photos.rglob("*"))
    config = _config(tiny, photos)
    _prepare(config, tiny)
    assert sorted(p.relative_to(photos) for p in photos.rglob("*")) == before  # nothing written beside the photos
    cache = cache_folder(config.data)
    assert cache.is_relative_to(Path(os.environ["XDG_CACHE_HOME"]) / "diffpipe" / "data") and cache.name.startswith("photos-")
    assert f"cache: {cache}" in capsys.readouterr().out
    assert cache_folder(_config(tiny, photos, cache_dir=str(tmp_path / "mine")).data) == tmp_path / "mine"
    (photos / ".diffpipe_cache").mkdir()
    assert cache_folder(config.data) == photos / ".diffpipe_cache"


def test_eval_splits_hold_out_whole_files_or_take_another_folder(tiny, photos, tmp_path):
    data, _ = _prepare(_config(tiny, photos, eval_fraction=0.25, repeats=2), tiny)
    held = data.held_out
    assert len(held.items) == 4 and len(data.items) == 2 * 12  # repeats apply to training only
    assert not {i.path for i in held.items} & {i.path for i in data.items}
    assert len(held.latents) == 4 and held.x0([0]).shape[1] == 4
    other = tmp_path / "eval"
    other.mkdir()
    for name in ("china_1", "flower_1"):
        shutil.copy(photos / f"{name}.jpg", other / f"{name}.jpg")
        (other / f"{name}.txt").write_text("a painting of a flower")
    data, text = _prepare(_config(tiny, photos, eval_path=str(other)), tiny)
    assert len(data.items) == 16 and len(data.held_out.items) == 2
    assert data.held_out.captions == ["a painting of a flower"] * 2
    assert "a painting of a flower" in text._kept  # its text cached too


@pytest.mark.parametrize("seal", ['[1, 2]', '"keys"', '{"keys": 5}', '{"keys": ["a"], "failed": []}', 'null'])
def test_a_seal_of_the_wrong_json_shape_rebuilds_its_shard_instead_of_failing_every_run(tmp_path, seal):
    store = ShardStore(tmp_path)
    entries, failed = fill_store(store, ["a", "b"], lambda keys: ({k: {"x": torch.ones(2)} for k in keys}, {}))
    (written,) = tmp_path.glob("*.json")
    written.write_text(seal)
    assert store.known() == (set(), {})
    shard = written.with_suffix(".safetensors")
    warnings = []
    entries, failed = fill_store(store, ["a", "b"], lambda keys: ({k: {"x": torch.ones(2)} for k in keys}, {}),
                                 warn=warnings.append)
    assert set(entries) == {"a", "b"} and not failed
    # named and removed with its shard, as the README says: no stale shard left beside the rebuilt one (issue 58)
    assert warnings == [f"warning: damaged cache shard {shard}: its seal {written.name} is damaged; removed, its "
                        "entries are computed again"]
    assert not shard.exists() and not written.exists() and len(list(tmp_path.glob("*.safetensors"))) == 1
