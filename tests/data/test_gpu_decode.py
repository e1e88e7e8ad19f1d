"""gpu_decode on the CPU: the transform read as one kernel's parameters, draws equal to torchvision's,
fallbacks, bad files, and whole batches against torch's DataLoader running the CPU pipeline.

Without a device the image path still runs: workers decode with PIL (the CPU backend) and the
kernel's C reference resizes. Bound: the resize rounds as PIL's does, so an image differs from the
CPU pipeline's by at most 1 level of 255 before normalising (asserted on every element)."""
import array
import ctypes
import io
import random
import time

import numpy as np
import pytest
import torch
import torchvision.transforms as v1
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data.image.gpu_decode import ImagePipeline
from hotloop.data.image.plan import ImagePlan
from hotloop.data.image.source import collate_encoded
from hotloop.data.image.split import SPLIT_CAP

from ..seeding import derived_seed, seeded_generator
from .conftest import open_with
from .image_folders import (EVAL_V1, EVAL_V2, LEVEL, MEAN, STD, TRAIN_V1, TRAIN_V2, assert_batches_close, make_folder,
                            make_photo, seeded_batches)


def encoded(image, fmt="JPEG", **kw):
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("make", [TRAIN_V1, TRAIN_V2, EVAL_V1, EVAL_V2])
def test_plan_reads_the_usual_pipelines(make):
    plan = ImagePlan.of(make(32))
    assert plan is not None and plan.out_size == (32, 32)
    assert plan.mean == MEAN and plan.std == STD and plan.scale == 255.0 and plan.dtype == torch.float32


@pytest.mark.parametrize("transform", [
    v1.Compose([v1.RandomResizedCrop(32), v1.ColorJitter(0.2), v1.ToTensor()]),  # a step it does not move
    v1.Compose([v1.RandomResizedCrop(32, interpolation=v1.InterpolationMode.BICUBIC), v1.ToTensor()]),
    v1.Compose([v1.Resize(40), v1.RandomResizedCrop(32), v1.ToTensor()]),  # two resamplings
    v1.Compose([v1.Resize(40), v1.ToTensor()]),  # the size depends on the image
    v1.Compose([v1.ToTensor(), v1.RandomResizedCrop(32)]),  # geometry on floats
    v1.Compose([v1.RandomResizedCrop(32)]),  # a PIL image out
    v1.Compose([v1.RandomResizedCrop(32), v1.ToTensor(), v1.Lambda(lambda x: x * 2)]),
    None,
])
def test_plan_declines_what_it_cannot_do(transform):
    assert ImagePlan.of(transform) is None


@pytest.mark.parametrize("make", [TRAIN_V1, TRAIN_V2])
def test_draws_are_the_transforms_own(make):
    """For a seed, draw() makes as many generator draws as the transform on a PIL image of that size,
    and they give torchvision's own crop box and flip. (Whole batches against the CPU pipeline, below,
    show the crops are the ones the transform makes.)"""
    t = make(24)
    plan = ImagePlan.of(t)
    rng = np.random.default_rng(derived_seed())
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(8, 300, size=2))
        seed = int(rng.integers(2**31))
        torch.manual_seed(seed)
        geo = plan.draw(h, w)
        after_plan = torch.rand(4)
        torch.manual_seed(seed)
        t(Image.new("RGB", (w, h)))
        after_transform = torch.rand(4)
        assert torch.equal(after_plan, after_transform)  # the same number of draws
        torch.manual_seed(seed)
        probe = v1.RandomResizedCrop.get_params(torch.zeros(()).expand(3, h, w), (0.08, 1.0), (3 / 4, 4 / 3))
        flip = bool(torch.rand(1) < 0.5)
        assert (geo.box_top, geo.box_h, geo.box_w, geo.flip) == (probe[0], probe[2], probe[3], flip)
        assert geo.box_left == probe[1]  # the flip comes after the crop: the box is not mirrored


def test_a_flip_before_the_crop_mirrors_the_box():
    plan = ImagePlan.of(v1.Compose([v1.RandomHorizontalFlip(p=1.0), v1.RandomResizedCrop(16), v1.ToTensor()]))
    for seed in [derived_seed() for _ in range(50)]:
        torch.manual_seed(seed)
        geo = plan.draw(60, 90)
        torch.manual_seed(seed)
        torch.rand(1)
        top, left, h, w = v1.RandomResizedCrop.get_params(torch.zeros(()).expand(3, 60, 90), (0.08, 1.0), (3 / 4, 4 / 3))
        assert (geo.box_top, geo.box_left, geo.box_h, geo.box_w, geo.flip) == (top, 90 - left - w, h, w, 1)


@pytest.mark.parametrize("make", [TRAIN_V1, TRAIN_V2, EVAL_V1, EVAL_V2])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_match_the_cpu_pipeline(tmp_path, make, workers):
    root = make_folder(str(tmp_path), n=22)
    seed = random.randrange(2**31)
    ds = ImageFolder(root, transform=make(32))
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=5, shuffle=True, num_workers=workers,
                                      generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=5, shuffle=True, num_workers=workers,
                                generator=torch.Generator().manual_seed(seed), gpu_decode=True)
    assert_batches_close(seeded_batches(loader), theirs, levels=2 if make is TRAIN_V2 else 1)
    st = loader.stats
    assert st.decoder.startswith("cpu") and st.images_cpu_decoded == 22 and st.images_gpu_decoded == 0


def test_files_the_jpeg_path_cannot_take_fall_back(tmp_path):
    rng = np.random.default_rng(derived_seed())
    photo = make_photo(rng, 50, 70)
    extra = [("png_named.jpg", encoded(photo, "PNG")), ("grey.jpg", encoded(photo.convert("L"))),
             ("cmyk.jpg", encoded(photo.convert("CMYK"))), ("progressive.jpg", encoded(photo, progressive=True)),
             ("real.png", encoded(photo, "PNG"))]
    root = make_folder(str(tmp_path), n=10, extra=extra)
    ds = ImageFolder(root, transform=TRAIN_V1(24))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4, num_workers=2, generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, generator=torch.Generator().manual_seed(seed),
                                gpu_decode=True)
    assert_batches_close(seeded_batches(loader), theirs)


def test_center_crop_larger_than_the_image_runs_the_transform(tmp_path):
    root = make_folder(str(tmp_path), n=8, sizes=(20, 60))
    tf = v1.Compose([v1.CenterCrop(48), v1.ToTensor(), v1.Normalize(MEAN, STD)])
    ds = ImageFolder(root, transform=tf)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4))
    loader = hotloop.DataLoader(ds, batch_size=4, gpu_decode=True)
    assert_batches_close(seeded_batches(loader), theirs)
    assert loader.stats.images_cpu_pipeline > 0


@pytest.mark.parametrize("bad", [b"\xff\xd8\xff\xe0 truncated", "noise", b""])
def test_a_bad_file_raises_what_pil_raises(tmp_path, bad):
    if bad == "noise":
        bad = random.randbytes(3000)  # drawn under the test's seed, not at collection
    root = make_folder(str(tmp_path), n=6, extra=[("bad.jpg", bad)])
    ds = ImageFolder(root, transform=TRAIN_V1(24))
    with pytest.raises(Exception) as theirs:
        seeded_batches(TorchDataLoader(ds, batch_size=7, num_workers=0))
    with pytest.raises(type(theirs.value)) as ours:
        seeded_batches(hotloop.DataLoader(ds, batch_size=7, num_workers=0, gpu_decode=True))
    assert str(ours.value) == str(theirs.value)  # PIL's words (naming the file where PIL does)


def test_a_truncated_jpeg_raises_what_pil_raises(tmp_path):
    whole = encoded(make_photo(np.random.default_rng(derived_seed()), 80, 80))
    root = make_folder(str(tmp_path), n=6, extra=[("cut.jpg", whole[:len(whole) // 2])])
    ds = ImageFolder(root, transform=TRAIN_V1(24))
    with pytest.raises(Exception) as theirs:
        seeded_batches(TorchDataLoader(ds, batch_size=7, num_workers=2))
    with pytest.raises(type(theirs.value)) as ours:
        seeded_batches(hotloop.DataLoader(ds, batch_size=7, num_workers=2, gpu_decode=True))
    assert str(theirs.value).splitlines()[-1] in str(ours.value)


def test_unrecognised_pipelines_warn_and_run_as_torch(tmp_path):
    root = make_folder(str(tmp_path), n=8)
    ds = ImageFolder(root, transform=v1.Compose([v1.RandomResizedCrop(24), v1.ColorJitter(0.3), v1.ToTensor()]))
    with pytest.warns(UserWarning, match="gpu_decode is off"):
        loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, gpu_decode=True,
                                    generator=seeded_generator(1))
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4, num_workers=2, generator=seeded_generator(1)))
    for (x, y), (tx, ty) in zip(seeded_batches(loader), theirs, strict=True):
        assert torch.equal(x, tx) and torch.equal(y, ty)
    assert loader.stats.decoder is None and loader.stats.images_gpu_decoded == 0


def test_encoded_image_dataset_from_bytes():
    rng = np.random.default_rng(derived_seed())
    items = [(encoded(make_photo(rng, int(rng.integers(30, 90)), int(rng.integers(30, 90)))), i % 4) for i in range(13)]
    ds = hotloop.EncodedImageDataset(lambda i: items[i], len(items), transform=EVAL_V2(24))
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4))
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, gpu_decode=True)
    assert_batches_close(seeded_batches(loader), theirs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dtype_and_layout(tmp_path, dtype, channels_last):
    # images too small for a decode at a DCT scale (test_image_draft.py): the bound is the kernel's rounding
    root = make_folder(str(tmp_path), n=9, sizes=(40, 100))
    ds = ImageFolder(root, transform=EVAL_V1(24))
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=3))
    loader = hotloop.DataLoader(ds, batch_size=3, gpu_decode=hotloop.GpuDecode(dtype=dtype, channels_last=channels_last))
    ours = seeded_batches(loader)
    for (x, _), (tx, _) in zip(ours, theirs, strict=True):
        assert x.dtype == dtype and x.shape == tx.shape
        assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        tol = LEVEL + tx.abs().max().item() * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
        assert (x.float() - tx).abs().max().item() <= tol


@pytest.mark.parametrize("backend, workers", [("cpu", 2), ("hardware", 0), ("hardware", 2)])
def test_the_ring_reserves_room_for_what_the_backend_sends(tmp_path, backend, workers):
    """A batch bigger than the ring's reservation travels outside the ring, a slow way: the CPU
    backend's crop pixels, once reserved as if JPEG bytes, never fit (half torch's speed on an H200).
    With a GPU decoder, workers and worker_decode, a batch holds the pixels of the most the workers may
    decode (without worker_decode they decode none while the decoder works)."""
    root = make_folder(str(tmp_path), n=32, sizes=(100, 300))
    ds = ImageFolder(root, transform=TRAIN_V1(32))
    pipeline = ImagePipeline.make(hotloop.GpuDecode(worker_decode=True), ds, None, 8, "map")
    samples = pipeline.worker_dataset(backend, workers)
    assert (pipeline.share is not None) == (backend == "hardware" and workers > 0)
    if pipeline.share is not None:
        pipeline.share.set(SPLIT_CAP)
    # the reservation is an estimate from a sample of files and their own draws: a batch may exceed it
    # now and then (it travels whole, correctly), so the test holds the mean batch to it. A reservation
    # sized as JPEG bytes falls an order of magnitude short, and one whose sample drew one box for
    # every file (one fork of the generator per file) often fell short of the mean
    sent = [sum(r[1].nbytes if r[0] != 0 else len(r[1]) for r in (samples[i] for i in range(first, first + 8)))
            for first in range(0, len(ds), 8)]
    assert sum(sent) / len(sent) <= pipeline.capacity, (sent, pipeline.capacity)


def test_the_reservation_samples_a_box_per_file_and_leaves_the_callers_draws(tmp_path, monkeypatch):
    """The sample behind the ring's reservation draws each file's crop box anew (files of one size
    get different boxes), and the caller's generator is where it was."""
    from hotloop.data.image import gpu_decode

    ds = ImageFolder(make_folder(str(tmp_path), n=16, sizes=(200, 201)), transform=TRAIN_V1(32))
    pipeline = ImagePipeline.make(True, ds, None, 8, "map")
    sizes, shipped = [], gpu_decode.shipped_pixel_bytes
    monkeypatch.setattr(gpu_decode, "shipped_pixel_bytes", lambda *a: sizes.append(shipped(*a)) or sizes[-1])
    state = torch.get_rng_state()
    pipeline.worker_dataset("cpu", 2)
    assert torch.equal(state, torch.get_rng_state())
    assert len(sizes) == 16 and len(set(sizes)) > 4, sizes


def test_bad_options():
    with pytest.raises(ValueError, match="backend"):
        hotloop.GpuDecode(backend="nvdec")
    with pytest.raises(TypeError, match="dtype"):
        hotloop.GpuDecode(dtype=torch.int32)
    with pytest.raises(TypeError, match="gpu_decode"):
        hotloop.DataLoader(list(range(4)), gpu_decode=3)
    for threads in (0, 65):
        with pytest.raises(ValueError, match="threads None or 1 to 64"):
            hotloop.GpuDecode(threads=threads)
    with pytest.raises(TypeError, match="threads to be None or an int"):
        hotloop.GpuDecode(threads=True)
    with pytest.raises(ValueError, match="backend 'cuda' has none"):
        hotloop.GpuDecode(backend="cuda", threads=4)
    assert hotloop.GpuDecode(backend="hardware", threads=4).threads == 4


class PilDecoder:
    """nvjpeg's part played by PIL on the CPU, so that CI runs the JPEG-bytes path: the maker hands
    it host pointers and pitches as it would nvjpeg; it refuses every third image (status 1), as
    nvjpeg refuses what it does not support, and those go to the maker's own fallback."""

    library = "PIL, standing in for nvjpeg"
    threads, lane_share, lane_images = 0, None, 0  # JpegDecoder's: no host threads beside the decoder

    def __init__(self):
        self.decoded = self.refused = 0

    def decode(self, sources, dests, count, stream):
        src, dst = array.array("q", sources), array.array("q", dests)
        statuses = bytearray()
        for k in range(count):
            if k % 3 == 2:
                statuses.append(1)
                self.refused += 1
                continue
            data = ctypes.string_at(src[2 * k], src[2 * k + 1])
            pixels = np.ascontiguousarray(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            h, w, _ = pixels.shape
            for r in range(h):
                ctypes.memmove(dst[2 * k] + r * dst[2 * k + 1], pixels[r].ctypes.data, w * 3)
            statuses.append(0)
            self.decoded += 1
        return bytes(statuses)

    def close(self):
        pass


@pytest.mark.parametrize("workers", [0, 2])
def test_jpeg_bytes_path_with_a_stand_in_decoder(tmp_path, monkeypatch, workers):
    """Workers send JPEG bytes and headers; the maker decodes them in one call into its buffer,
    decodes what the decoder refused itself, and the batches equal the CPU pipeline's."""
    decoder = PilDecoder()
    open_with(monkeypatch, decoder)
    photo = make_photo(np.random.default_rng(derived_seed()), 60, 50)
    extra = [("grey.jpg", encoded(photo.convert("L"))), ("cmyk.jpg", encoded(photo.convert("CMYK"))),
             ("progressive.jpg", encoded(photo, progressive=True)), ("png_named.jpg", encoded(photo, "PNG"))]
    root = make_folder(str(tmp_path), n=23, extra=extra)
    ds = ImageFolder(root, transform=TRAIN_V2(28))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=6, shuffle=True, num_workers=workers,
                                      generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=6, shuffle=True, num_workers=workers, gpu_decode=True,
                                generator=torch.Generator().manual_seed(seed))
    assert_batches_close(seeded_batches(loader), theirs, levels=2)  # TRAIN_V2 resizes tensors
    st = loader.stats
    assert st.images_gpu_decoded == decoder.decoded > 0 and st.images_refused == decoder.refused > 0
    # the CMYK, progressive and PNG files never reach the decoder: the workers decode them, and with
    # worker processes a share of the JPEGs too (split.py)
    assert st.images_cpu_decoded == 3 + st.images_split and (st.images_split == 0 or workers > 0)
    assert st.images_gpu_decoded + st.images_refused + st.images_cpu_decoded == len(ds)


class PausingDecoder(PilDecoder):
    """PilDecoder whose every call takes at least PAUSE seconds, and that counts its calls."""

    PAUSE = 0.05

    def __init__(self):
        super().__init__()
        self.calls = 0

    def decode(self, sources, dests, count, stream):
        self.calls += 1
        time.sleep(self.PAUSE)
        return super().decode(sources, dests, count, stream)


class LanesDecoder(PilDecoder):
    """PilDecoder with host threads beside it, as JpegDecoder's hardware backend with threads: a share
    and an image count that move with each call, and from the `fail_from`-th call on the lanes' failure
    said (lane_failure), as the engine says it once they stop."""

    threads = 2
    FAILURE = "nvjpegDecodeJpegDevice failed with NVJPEG_STATUS_EXECUTION_FAILED (6)"

    def __init__(self, fail_from):
        super().__init__()
        self.calls, self.fail_from = 0, fail_from
        self.lane_share, self.lane_failure = 0.25, None

    def decode(self, sources, dests, count, stream):
        self.calls += 1
        if self.calls == self.fail_from:
            self.lane_failure = self.FAILURE
        if self.lane_failure is None:
            self.lane_images += 1
            self.lane_share += 0.125
        return super().decode(sources, dests, count, stream)


def test_stats_follow_the_lanes_and_their_failure_warns_once(tmp_path, monkeypatch):
    """loader.stats gives the lanes' share and images after each batch; their failure warns once, the
    decoder named as decoding alone since, and the epoch's batches are the CPU pipeline's."""
    decoder = LanesDecoder(fail_from=2)
    open_with(monkeypatch, decoder)
    root = make_folder(str(tmp_path), n=16)
    ds = ImageFolder(root, transform=TRAIN_V2(28))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4, shuffle=True,
                                            generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=4, shuffle=True, gpu_decode=True,
                                generator=torch.Generator().manual_seed(seed))
    with pytest.warns(RuntimeWarning, match="host threads beside the JPEG engines failed") as caught:
        ours = seeded_batches(loader)
    assert_batches_close(ours, theirs, levels=2)
    assert sum("beside the JPEG engines" in str(w.message) for w in caught) == 1 and decoder.calls == 4
    st = loader.stats
    assert st.image_lane_share == 0.375 and st.images_on_lanes == 1
    assert st.decoder.endswith(f"2 threads beside the engines until {LanesDecoder.FAILURE})")


def test_stats_say_how_long_the_decoder_and_the_staging_took(tmp_path, monkeypatch):
    decoder = PausingDecoder()
    open_with(monkeypatch, decoder)
    root = make_folder(str(tmp_path), n=12)
    loader = hotloop.DataLoader(ImageFolder(root, transform=TRAIN_V2(28)), batch_size=4, gpu_decode=True)
    started = time.perf_counter()
    assert len(list(loader)) == 3
    elapsed = time.perf_counter() - started
    st = loader.stats
    assert decoder.calls == 3
    assert PausingDecoder.PAUSE * decoder.calls <= st.image_decode_seconds < elapsed
    assert 0 < st.image_staging_seconds < elapsed - st.image_decode_seconds
    assert st.as_dict()["image_decode_seconds"] == st.image_decode_seconds
