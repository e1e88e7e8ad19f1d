"""Decoding at a DCT scale in the workers (gpu_decode's CPU backend): large photos against torchvision's
pipeline (a full decode, then crop and resize) within the bounds the GPU decoders are held to, the
transform's draws unchanged, and the files a scaled decode does not take decoded as PIL does.

Bound: the scaled decode is a low-pass of the full one (NOTE [ Decoding at a DCT scale ] in
data/image/source.py), so its images differ from the CPU pipeline's as an nvjpeg decode's do: at
most DECODE_MAX_LEVELS levels of 255 per value and DECODE_MEAN_LEVELS on average per batch, the
bounds of tests/data/test_gpu_decode_gpu.py."""
import io
import os
import random

import numpy as np
import pytest
import torch
import torchvision.transforms as v1
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data.image.plan import ImagePlan
from hotloop.data.image.source import (DRAFT_MARGIN, DRAFT_MARGIN_INSIDE, PIXELS, EncodedImageDataset,
                                       EncodedSamples, ImageSource, draft_scale)

from ..seeding import derived_seed, seeded_generator
from .image_folders import MEAN, STD, TRAIN_V1, seeded_batches

HANG_GUARD_S = 300  # torch's pipeline decodes every 12-megapixel photo whole

DECODE_MAX_LEVELS = 12
DECODE_MEAN_LEVELS = 1.0
EVAL = v1.Compose([v1.Resize(256), v1.CenterCrop(224), v1.ToTensor(), v1.Normalize(MEAN, STD)])
TRAIN = TRAIN_V1(224)


def _photos():
    """scikit-image's colour photographs (the bench's), opened as RGB."""
    photos = pytest.importorskip("hotloop.bench.photos")
    try:
        colour, _ = photos.source_photos()
    except RuntimeError as err:
        pytest.skip(str(err))
    return [Image.open(p).convert("RGB") for p in colour]


def large_photo(rng, photos, h, w):
    """A real photograph's crop enlarged to h x w, with a camera's grain: an enlarged crop alone is
    smoother than any camera's picture."""
    photo = photos[int(rng.integers(len(photos)))]
    side = rng.uniform(0.5, 1.0)
    cw, ch = max(8, int(photo.width * side)), max(8, int(photo.height * side))
    x, y = int(rng.integers(0, photo.width - cw + 1)), int(rng.integers(0, photo.height - ch + 1))
    picture = photo.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BICUBIC)
    pixels = np.asarray(picture, dtype=np.float32) + rng.normal(0, rng.uniform(1.5, 4.0), (h, w, 3)).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def encoded(image, kind, rng):
    """The bytes of `image` saved as one of the kinds a photo folder holds."""
    out = io.BytesIO()
    quality = int(rng.integers(70, 96))
    if kind == "yuv420":
        image.save(out, "JPEG", quality=quality, subsampling=2)
    elif kind == "yuv444":
        image.save(out, "JPEG", quality=quality, subsampling=0)
    elif kind == "grey":
        image.convert("L").save(out, "JPEG", quality=quality)
    elif kind == "progressive":
        image.save(out, "JPEG", quality=quality, progressive=True)
    elif kind == "cmyk":
        image.convert("CMYK").save(out, "JPEG", quality=quality)
    elif kind == "png_named":
        image.save(out, "PNG", compress_level=1)
    return out.getvalue()


KINDS = ("yuv420", "yuv444", "grey", "progressive", "cmyk", "png_named")


def photo_folder(root, rng, sizes, kinds):
    """An ImageFolder of large photos: one file per (size, kind), two classes."""
    photos = _photos()
    for c in range(2):
        os.makedirs(os.path.join(root, f"c{c}"), exist_ok=True)
    for i, ((h, w), kind) in enumerate(zip(sizes, kinds, strict=True)):
        with open(os.path.join(root, f"c{i % 2}", f"{i:03d}.jpg"), "wb") as f:
            f.write(encoded(large_photo(rng, photos, h, w), kind, rng))
    return root


def levels(x, tx):
    """|difference| in levels of 255, per value, of two normalised batches."""
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (x.float() - tx.float()).abs() * std * 255


def assert_within_decode_bounds(ours, theirs):
    assert len(ours) == len(theirs)
    for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
        assert torch.equal(y, ty) and x.shape == tx.shape
        d = levels(x, tx)
        assert d.max().item() <= DECODE_MAX_LEVELS + 0.01, f"max {d.max().item():.2f} levels"
        worst_image = d.mean(dim=(1, 2, 3)).max().item()  # per image: stricter than the GPU tests' per batch
        assert worst_image <= DECODE_MEAN_LEVELS, f"an image's mean {worst_image:.3f} levels"


def records(ds, transform, seed):
    """What the CPU backend's workers ship for each file of ds, under `seed`."""
    source, _ = ImageSource.of(ds)
    samples = EncodedSamples(source, ImagePlan.of(transform), gpu_jpeg=False, progressive=False, capacity=0)
    torch.manual_seed(seed)
    return [samples[i] for i in range(len(ds))]


@pytest.mark.parametrize("transform", ["eval", "train"])
def test_large_photos_match_torchvision_within_the_decode_bounds(tmp_path, transform):
    """12-megapixel and other large photos of every kind, through hotloop's loader (workers decoding
    at a DCT scale) and torch's (PIL's full decode): the same labels, and images within the bounds."""
    rng = np.random.default_rng(derived_seed())
    sizes = [(3000, 4000), (4000, 3000)] + [(int(rng.integers(1100, 3300)), int(rng.integers(1100, 4300)))
                                            for _ in range(6)]
    kinds = ["yuv420", "yuv444", "grey", "progressive", "yuv420", "cmyk", "png_named", "yuv420"]
    tf = EVAL if transform == "eval" else TRAIN
    ds = ImageFolder(photo_folder(str(tmp_path), rng, sizes, kinds), transform=tf)
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                            generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                generator=torch.Generator().manual_seed(seed), gpu_decode=True)
    assert_within_decode_bounds(seeded_batches(loader), theirs)
    assert loader.stats.images_cpu_decoded == len(ds)
    # the scaled decode did run: the JPEGs PIL decodes to RGB or grey shipped an output-sized window
    shipped = records(ds, tf, seed)
    scaled = [r for r in shipped if r[0] == PIXELS and r[1].shape[:2] == (224, 224)]
    assert len(scaled) >= (6 if transform == "eval" else 1)


def test_the_validation_transform_on_12_megapixel_photos(tmp_path):
    """The issue's case, Resize(256) + CenterCrop(224) on 4000 x 3000 photos: a 1/4 decode (1/8 would
    leave the scaled crop less than DRAFT_MARGIN times the resized size) within the bounds, with
    only the 224 x 224 window shipped instead of the 3000 x 4000 crop box."""
    rng = np.random.default_rng(derived_seed())
    ds = ImageFolder(photo_folder(str(tmp_path), rng, [(3000, 4000)] * 4, ["yuv420"] * 4), transform=EVAL)
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4), seed)
    ours = seeded_batches(hotloop.DataLoader(ds, batch_size=4, gpu_decode=True), seed)
    assert_within_decode_bounds(ours, theirs)
    for kind, window, shape, _, _, _, _ in records(ds, EVAL, seed):
        geo = shape[3]
        assert kind == PIXELS and window.shape == (224, 224, 3)
        assert (geo.box_h, geo.box_w, geo.resized_h, geo.resized_w) == (224, 224, 224, 224)
        assert (geo.box_top, geo.box_left, geo.out_top, geo.out_left) == (0, 0, 0, 0)
    plan = ImagePlan.of(EVAL)
    assert draft_scale(plan.draw(3000, 4000), 3000, 4000) == 4


@pytest.mark.parametrize("transform", [TRAIN, EVAL, v1.Compose([v1.RandomHorizontalFlip(), v1.RandomResizedCrop(224),
                                                                 v1.ToTensor()])])
def test_draws_are_torchs_whatever_the_scale(tmp_path, transform):
    """For a seed, the workers make the transform's own draws, as many of them and from the full
    image's size (not the scaled one): the generator is where torchvision's pipeline leaves it, and
    a record's flip is the one torchvision draws."""
    rng = np.random.default_rng(derived_seed())
    sizes = [(int(rng.integers(1500, 3200)), int(rng.integers(1500, 4200))) for _ in range(3)]
    ds = ImageFolder(photo_folder(str(tmp_path), rng, sizes, ["yuv420"] * 3), transform=transform)
    source, _ = ImageSource.of(ds)
    samples = EncodedSamples(source, ImagePlan.of(transform), gpu_jpeg=False, progressive=False, capacity=0)
    for i in range(len(ds)):
        for seed in [derived_seed() for _ in range(4)]:
            torch.manual_seed(seed)
            record = samples[i]
            after_ours = torch.rand(4)
            torch.manual_seed(seed)
            ds[i]
            after_theirs = torch.rand(4)
            assert torch.equal(after_ours, after_theirs)
            width, height = Image.open(ds.samples[i][0]).size
            torch.manual_seed(seed)
            assert record[2][3].flip == ImagePlan.of(transform).draw(height, width).flip


def test_the_rule_keeps_the_margin():
    """draft_scale: the largest scale whose scaled box keeps the margin in both dimensions, the larger
    margin where the box's edge lies inside the image."""
    plan = ImagePlan.of(EVAL)
    rrc = ImagePlan.of(TRAIN)
    rng = np.random.default_rng(derived_seed())
    for _ in range(2000):
        h, w = (int(v) for v in rng.integers(100, 9000, size=2))
        geo = (plan if rng.random() < 0.5 else rrc).draw(h, w)
        scale = draft_scale(geo, h, w)
        mh = DRAFT_MARGIN if geo.box_h == h else DRAFT_MARGIN_INSIDE
        mw = DRAFT_MARGIN if geo.box_w == w else DRAFT_MARGIN_INSIDE
        fits = lambda s: geo.box_h / s >= mh * geo.resized_h and geo.box_w / s >= mw * geo.resized_w
        assert scale in (1, 2, 4, 8) and (scale == 1 or fits(scale))
        assert not any(fits(s) for s in (2, 4, 8) if s > scale)


def test_files_a_scaled_decode_does_not_take_decode_whole(tmp_path):
    """CMYK and PNG-named files ship their whole crop box, as before, decoded by PIL; a user's own
    EncodedImageDataset.load is not bypassed."""
    rng = np.random.default_rng(derived_seed())
    ds = ImageFolder(photo_folder(str(tmp_path), rng, [(2400, 3000)] * 2, ["cmyk", "png_named"]), transform=EVAL)
    for kind, pixels, shape, _, index, _, _ in records(ds, EVAL, derived_seed()):
        geo = shape[3]
        assert kind == PIXELS and pixels.shape == (geo.box_h, geo.box_w, 3) == (2400, 3000, 3)
        full = np.asarray(Image.open(ds.samples[index][0]).convert("RGB"))
        assert np.array_equal(pixels, full)
    data = encoded(large_photo(rng, _photos(), 2000, 2600), "yuv420", rng)
    loads = []

    class OwnLoad(EncodedImageDataset):
        def load(self, data, index):
            loads.append(index)
            return super().load(data, index)

    own = OwnLoad(lambda i: (data, 0), 2, transform=EVAL)
    samples = EncodedSamples(ImageSource.of(own)[0], ImagePlan.of(EVAL), False, False, 0)
    assert [samples[i][1].shape for i in range(2)] == [(2000, 2600, 3)] * 2 and loads == [0, 1]
    plain = EncodedImageDataset(lambda i: (data, 0), 1, transform=EVAL)
    assert EncodedSamples(ImageSource.of(plain)[0], ImagePlan.of(EVAL), False, False, 0)[0][1].shape == (224, 224, 3)


@pytest.mark.parametrize("cut", ["half", "header"])
def test_a_truncated_large_jpeg_raises_what_pil_raises(tmp_path, cut):
    rng = np.random.default_rng(derived_seed())
    data = encoded(large_photo(rng, _photos(), 2400, 3200), "yuv420", rng)
    os.makedirs(tmp_path / "c0")
    path = tmp_path / "c0" / "cut.jpg"
    path.write_bytes(data[:len(data) // 2] if cut == "half" else data[:600])
    ds = ImageFolder(str(tmp_path), transform=EVAL)
    with pytest.raises(Exception) as theirs:
        seeded_batches(TorchDataLoader(ds, batch_size=1, num_workers=1))
    with pytest.raises(type(theirs.value)) as ours:
        seeded_batches(hotloop.DataLoader(ds, batch_size=1, num_workers=1, gpu_decode=True))
    assert str(theirs.value).splitlines()[-1] in str(ours.value)
