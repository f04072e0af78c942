"""Image folders: both caption conventions, every kind of bad file counted and skipped (never a crash), EXIF
orientation and mode conversions, buckets and crop offsets."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffpipe.data.buckets import Bucket, make_buckets, place, to_pixels
from diffpipe.data.folder import BadImage, Skipped, read_rgb, scan_folders, uncaptioned_note
from diffpipe.errors import DataError

from ..planted import planted


def _photo(path: Path, size=(96, 64), mode="RGB", **save) -> Path:
    rng = np.random.default_rng(len(path.name))
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels).convert(mode)
    image.save(path, **save)
    return path


def test_captions_from_txt_files_and_from_metadata_jsonl(tmp_path):
    kohya, hf = tmp_path / "kohya", tmp_path / "hf"
    kohya.mkdir(), hf.mkdir()
    _photo(kohya / "cat.jpg")
    (kohya / "cat.txt").write_text("a cat on a mat\n")
    _photo(kohya / "dog.png")  # no caption: the empty one
    _photo(kohya / "owl.jpg")
    (kohya / "owl.caption").write_text("an owl at night")  # kohya's default caption_extension
    _photo(kohya / "pig.jpg")
    (kohya / "pig.caption").write_text("not this one")
    (kohya / "pig.txt").write_text("a pig in mud")  # .txt first
    _photo(hf / "a.webp")
    _photo(hf / "b.jpg")
    (hf / "metadata.jsonl").write_text(json.dumps({"file_name": "a.webp", "text": "a red house"}) + "\n"
                                       + json.dumps({"file_name": "b.jpg", "caption": "a blue boat"}) + "\n")
    skipped = Skipped()
    items = scan_folders([(kohya, 1), (hf, 2)], min_side=16, skipped=skipped)
    captions = [(i.path.name, i.caption) for i in items]
    assert captions == [("cat.jpg", "a cat on a mat"), ("dog.png", ""), ("owl.jpg", "an owl at night"),
                        ("pig.jpg", "a pig in mud"), ("a.webp", "a red house"), ("a.webp", "a red house"),
                        ("b.jpg", "a blue boat"), ("b.jpg", "a blue boat")]  # repeats 2
    assert len(skipped) == 0
    note = uncaptioned_note(items)  # dog.png: counted once, whatever its repeats
    assert note.startswith("note: 1 of 6 file(s) have no caption (dog.png): trained with the empty caption")


def test_every_kind_of_bad_file_is_skipped_counted_and_named(tmp_path):
    _photo(tmp_path / "good.jpg")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.png").write_text("this is not an image")
    _photo(tmp_path / "tiny.png", size=(12, 40))
    data = (_photo(tmp_path / "whole.jpg", size=(200, 160))).read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 2])
    skipped = Skipped()
    items = scan_folders([(tmp_path, 1)], min_side=32, skipped=skipped)
    reasons = {p.name: why for p, why in skipped.files}
    assert set(reasons) == {"empty.jpg", "notes.png", "tiny.png"}
    assert "0 bytes" in reasons["empty.jpg"] and "not a readable image" in reasons["notes.png"]
    assert "too small" in reasons["tiny.png"]
    assert "skipped 3 image file(s)" in skipped.warning()
    # a truncated file has a sound header: it is caught where it is decoded
    assert {i.path.name for i in items} == {"good.jpg", "truncated.jpg", "whole.jpg"}
    with pytest.raises(BadImage, match="cannot be decoded"):
        read_rgb(tmp_path / "truncated.jpg")
    assert read_rgb(tmp_path / "whole.jpg").size == (200, 160)


def test_bmp_tiff_and_avif_are_read_and_pictures_of_kinds_not_read_are_reported_not_left_out(tmp_path):
    """A folder of .bmp or .tif scans, or .avif, trained on nothing and said nothing: only jpg/png/webp were
    listed. Now those are read as their pixels, and a .gif, .heic or (for an image model) a clip is skipped, naming
    why, in the warning a run prints, rather than silently left out."""
    expected = {}
    for name in ("scan.bmp", "scan.tif", "photo.avif", "old.jfif"):
        _photo(tmp_path / name, **({"quality": 100} if name.endswith(".avif") else {}))
        expected[name] = np.asarray(Image.open(tmp_path / name).convert("RGB"))
    Image.new("P", (64, 64)).save(tmp_path / "anim.gif")
    (tmp_path / "phone.heic").write_bytes(b"\0" * 64)
    (tmp_path / "clip.mp4").write_bytes(b"\0" * 64)
    (tmp_path / "readme.md").write_text("not a picture: not listed")
    skipped = Skipped()
    items = scan_folders([(tmp_path, 1)], min_side=32, skipped=skipped)
    assert sorted(i.path.name for i in items) == sorted(expected)
    for item in items:
        assert np.array_equal(np.asarray(read_rgb(item.path)), expected[item.path.name])
    reasons = {p.name: why for p, why in skipped.files}
    assert set(reasons) == {"anim.gif", "phone.heic", "clip.mp4"}
    assert ".gif files are not read" in reasons["anim.gif"] and "convert it to .png" in reasons["anim.gif"]
    assert reasons["clip.mp4"] == "a video, and this model trains still images"
    assert "skipped 3 image file(s)" in skipped.warning()


def test_an_image_past_pillows_size_limit_is_skipped_naming_it_and_a_large_one_is_read(tmp_path, recwarn):
    """A 15000 x 15000 scan stopped the folder's scan with Pillow's DecompressionBombError, a traceback; one of
    100 M pixels (between Pillow's two limits) printed its warning and trains."""
    Image.new("L", (15000, 15000), 128).save(tmp_path / "huge.png")
    Image.new("L", (10000, 10000), 128).save(tmp_path / "large.png")
    skipped = Skipped()
    items = scan_folders([(tmp_path, 1)], min_side=32, skipped=skipped)
    assert [i.path.name for i in items] == ["large.png"]
    ((path, reason),) = skipped.files
    assert path.name == "huge.png" and "too large for Pillow to open (over its limit of 179 M pixels)" in reason
    assert read_rgb(tmp_path / "large.png").size == (10000, 10000)
    with pytest.raises(BadImage, match="too large"):
        read_rgb(tmp_path / "huge.png")
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def test_exif_orientation_and_every_mode_become_upright_8_bit_rgb(tmp_path):
    base = Image.new("RGB", (60, 30), (255, 0, 0))
    base.paste((0, 0, 255), (0, 0, 10, 30))  # a blue stripe on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view"
    base.save(tmp_path / "turned.jpg", exif=exif, quality=95)
    upright = read_rgb(tmp_path / "turned.jpg")
    assert upright.size == (30, 60)
    assert upright.getpixel((15, 5))[2] > 200  # the stripe is now at the top
    item, = scan_folders([(tmp_path, 1)], min_side=8, skipped=Skipped())
    assert (item.width, item.height) == (30, 60)  # sizes as seen, for the buckets

    Image.new("RGBA", (20, 20), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    assert read_rgb(tmp_path / "clear.png").getpixel((3, 3)) == (255, 255, 255)  # transparent on white
    Image.new("L", (20, 20), 100).save(tmp_path / "grey.png")
    assert read_rgb(tmp_path / "grey.png").getpixel((3, 3)) == (100, 100, 100)
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(tmp_path / "print.jpg")
    red = read_rgb(tmp_path / "print.jpg").getpixel((3, 3))
    assert red[0] > 200 and red[1] < 60
    Image.fromarray(np.full((20, 20), 65535, dtype=np.uint16)).save(tmp_path / "deep.png")
    assert read_rgb(tmp_path / "deep.png").getpixel((3, 3)) == (255, 255, 255)  # 16-bit white stays white
    Image.fromarray(np.linspace(0, 1, 400, dtype=np.float32).reshape(20, 20)).save(tmp_path / "float.tif")
    ramp = np.asarray(read_rgb(tmp_path / "float.tif"))  # float grey 0..1 (was all black: cast, not scaled)
    assert ramp[0, 0].tolist() == [0, 0, 0] and ramp[-1, -1].tolist() == [255, 255, 255] and 120 < ramp.mean() < 135
    for name in ("clear.png", "grey.png", "print.jpg", "deep.png", "float.tif"):
        assert read_rgb(tmp_path / name).mode == "RGB"


def test_buckets_share_an_area_and_images_go_to_the_nearest_shape_centre_cropped():
    buckets = make_buckets(1024, 64, 2.0)
    assert Bucket(1024, 1024) in buckets and Bucket(1344, 768) in buckets and Bucket(768, 1344) in buckets
    for b in buckets:
        assert b.width % 64 == 0 and b.height % 64 == 0
        assert 0.85 * 1024**2 <= b.width * b.height <= 1024**2
        assert max(b.width / b.height, b.height / b.width) <= 2.0
    placement = place(1500, 1000, buckets)  # 3:2 landscape
    assert placement.bucket == Bucket(1216, 832)  # 1.46, the nearest ratio to 1.5
    assert placement.resized == (1248, 832)  # covers the bucket: height fits, width overflows by 32
    assert (placement.top, placement.left) == (0, 16)  # centred crop
    tall = place(400, 1000, buckets)
    assert tall.bucket.height > tall.bucket.width
    assert math.isclose(place(1000, 1000, buckets).bucket.width, 1024)


def test_pixels_are_the_crop_of_the_resized_image(tmp_path):
    image = Image.new("RGB", (150, 100), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 75, 100))  # left half white
    placement = place(150, 100, [Bucket(64, 64)])
    assert placement.resized == (96, 64) and (placement.top, placement.left) == (0, 16)
    pixels = to_pixels(image, placement)
    assert pixels.shape == (3, 64, 64) and pixels.min() >= -1 and pixels.max() <= 1
    # the crop starts 16 px in: the white half ends at 48 - 16 = 32
    assert pixels[:, :, 28].mean() > 0.9 and pixels[:, :, 36].mean() < -0.9


def test_a_metadata_jsonl_that_is_not_utf8_is_named(tmp_path):
    _photo(tmp_path / "a.jpg")
    (tmp_path / "metadata.jsonl").write_bytes(json.dumps({"file_name": "a.jpg", "text": "caf"}).encode()
                                              .replace(b"caf", b"caf\xe9"))  # Latin-1
    with pytest.raises(DataError, match=r"metadata.jsonl is not UTF-8 text \(byte \d+"):
        scan_folders([(tmp_path, 1)], min_side=16, skipped=Skipped())


def test_a_caption_txt_that_is_not_utf8_is_named_as_metadata_jsonl_is(tmp_path):
    """It trained as "caf\ufffd photo" (read with errors="replace"): one rule for both caption files (issue 58)."""
    _photo(tmp_path / "a.jpg")
    (tmp_path / "a.txt").write_bytes("café photo".encode("latin-1"))
    with pytest.raises(DataError, match=r"a.txt is not UTF-8 text \(byte 3"):
        scan_folders([(tmp_path, 1)], min_side=16, skipped=Skipped())
    (tmp_path / "a.txt").write_bytes("\ufeffcafé photo".encode("utf-8"))  # Notepad's byte-order mark: dropped
    assert [i.caption for i in scan_folders([(tmp_path, 1)], min_side=16, skipped=Skipped())] == ["café photo"]


def test_captions_of_images_in_subfolders_by_both_conventions(tmp_path, scan=scan_folders):
    """metadata.jsonl names files by their path inside the folder (as Hugging Face's imagefolder does), and a .txt
    lies beside its image in any subfolder: two images of one name in two subfolders get their own captions."""
    hf, kohya = tmp_path / "hf", tmp_path / "kohya"
    for root in (hf, kohya):
        (root / "cats").mkdir(parents=True)
        (root / "dogs").mkdir()
        _photo(root / "cats" / "01.jpg")
        _photo(root / "dogs" / "01.jpg")
    (hf / "metadata.jsonl").write_text(json.dumps({"file_name": "cats/01.jpg", "text": "a cat"}) + "\n"
                                       + json.dumps({"file_name": "dogs/01.jpg", "text": "a dog"}) + "\n")
    (kohya / "cats" / "01.txt").write_text("a kitten")
    (kohya / "dogs" / "01.txt").write_text("a puppy")
    items = scan([(hf, 1), (kohya, 1)], min_side=16, skipped=Skipped())
    assert [(i.path.relative_to(tmp_path).as_posix(), i.caption) for i in items] == [
        ("hf/cats/01.jpg", "a cat"), ("hf/dogs/01.jpg", "a dog"),
        ("kohya/cats/01.jpg", "a kitten"), ("kohya/dogs/01.jpg", "a puppy")]


def test_captions_looked_up_by_file_name_fail_the_subfolder_check(tmp_path):
    by_name = planted("diffpipe.data.folder", "relative = image.relative_to(folder).as_posix()", "relative = image.name")
    with pytest.raises(AssertionError):
        test_captions_of_images_in_subfolders_by_both_conventions(tmp_path, by_name.scan_folders)


def test_a_scan_for_the_first_files_reads_no_further(tmp_path):
    """A sample grid's pictures (the first few of a folder, at every grid) are found without reading the rest of a
    large folder: a broken file after them is never opened."""
    for name in ("a", "b", "c"):
        _photo(tmp_path / f"{name}.png")
    (tmp_path / "d.png").write_bytes(b"not an image")
    skipped = Skipped()
    first = scan_folders([(tmp_path, 2)], 0, skipped, first=2)  # each listed twice (repeats), two files
    assert [item.path.name for item in first] == ["a.png", "a.png", "b.png", "b.png"] and not skipped.files
    everything = Skipped()
    assert len(scan_folders([(tmp_path, 1)], 0, everything)) == 3 and len(everything.files) == 1
