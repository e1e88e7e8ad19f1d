"""The realistic image folder of the benchmarks (hotloop.bench.photos): distinct files, ImageNet's sizes and
mix of JPEG kinds as drawn, every file readable as what it claims, the same files for the same seed."""
import hashlib
import os

import numpy as np
import pytest

from hotloop.bench import photos

from ..seeding import derived_seed

Image = pytest.importorskip("PIL.Image")
JpegImagePlugin = pytest.importorskip("PIL.JpegImagePlugin")


@pytest.fixture
def own_photos(tmp_path, monkeypatch):
    """HOTLOOP_PHOTOS: a folder of three pictures of random texture, fresh each run."""
    folder = tmp_path / "mine"
    folder.mkdir()
    rng = np.random.default_rng(derived_seed())
    for k in range(3):
        pixels = rng.integers(0, 256, (int(rng.integers(200, 700)), int(rng.integers(200, 700)), 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"p{k}.png")
    monkeypatch.setenv("HOTLOOP_PHOTOS", str(folder))
    return folder


def read_all(root):
    files = sorted(p for p in root.rglob("*.JPEG"))
    return files, {p: p.read_bytes() for p in files}


def test_every_file_is_distinct_readable_and_of_the_kind_drawn(own_photos, tmp_path):
    mix = photos.Mix(yuv444=0.2, grey=0.2, cmyk=0.15, png=0.15)
    summary = photos.write_photo_dataset(tmp_path / "set", 120, classes=7, seed=int(np.random.default_rng(derived_seed()).integers(1 << 30)),
                                         mix=mix, processes=2)
    files, data = read_all(tmp_path / "set")
    assert summary["files"] == len(files) == 120
    assert len({hashlib.sha256(b).digest() for b in data.values()}) == 120  # no two alike
    assert sorted(os.listdir(tmp_path / "set")) == [f"n{c:04d}" for c in range(7)]
    kinds = {"png": 0, "cmyk": 0, "grey": 0, "yuv444": 0, "yuv420": 0}
    sides = []
    for path in files:
        with Image.open(path) as im:
            im.load()
            sides.append(im.size)
            if im.format == "PNG":
                kinds["png"] += 1
            elif im.mode == "CMYK":
                kinds["cmyk"] += 1
            elif im.mode == "L":
                kinds["grey"] += 1
            else:
                assert im.format == "JPEG" and im.mode == "RGB"
                kinds["yuv444" if JpegImagePlugin.get_sampling(im) == 0 else "yuv420"] += 1
    for kind in ("png", "cmyk", "grey", "yuv444"):
        assert kinds[kind] == summary[kind], (kind, kinds, summary)
    assert kinds["yuv420"] == 120 - sum(summary[k] for k in ("png", "cmyk", "grey", "yuv444"))
    assert all(0 < kinds[k] for k in kinds)  # with these shares each kind turns up in 120 draws (p > 0.99)
    assert max(max(s) for s in sides) == summary["max_side"] <= 1931
    assert np.mean([s[0] for s in sides]) == pytest.approx(summary["mean_width"])


def test_the_same_seed_makes_the_same_files(own_photos, tmp_path):
    for name in ("a", "b"):
        photos.write_photo_dataset(tmp_path / name, 40, classes=3, seed=11, processes=1)
    (_, first), (_, second) = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert [v for v in first.values()] == [v for v in second.values()]
    photos.write_photo_dataset(tmp_path / "c", 40, classes=3, seed=12, processes=1)
    assert list(read_all(tmp_path / "c")[1].values()) != list(first.values())


def test_sizes_follow_imagenets():
    rng = np.random.default_rng(derived_seed())
    sizes = np.array([photos.imagenet_size(rng) for _ in range(20000)])
    assert 480 < sizes[:, 0].mean() < 540 and 370 < sizes[:, 1].mean() < 430  # ImageNet: about 500 x 400
    assert (sizes.max(axis=1) == 500).mean() > 0.6 and sizes.max() <= 1931 and sizes.min() >= 1


def test_no_photographs_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HOTLOOP_PHOTOS", str(tmp_path))
    with pytest.raises(RuntimeError, match="no photographs found"):
        photos.write_photo_dataset(tmp_path / "set", 4)


def test_scikit_images_photographs_are_found(monkeypatch):
    pytest.importorskip("skimage", reason="scikit-image ships the photographs")
    monkeypatch.delenv("HOTLOOP_PHOTOS", raising=False)
    colour, grey = photos.source_photos()
    assert [p.name for p in colour] == list(photos.COLOUR_PHOTOS)
    assert [p.name for p in grey] == list(photos.GREY_PHOTOS)
