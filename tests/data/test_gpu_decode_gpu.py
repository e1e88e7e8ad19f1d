"""gpu_decode on the GPU: whole batches from nvjpeg (hardware and CUDA backends) and the kernel against
torch's DataLoader running the CPU pipeline; the CPU backend on the GPU within one level; no leaks.

Bound for the nvjpeg backends: its IDCT and chroma upsampling are not libjpeg-turbo's, so decoded
pixels differ from PIL's by a few levels (tests/data/test_jpeg_decode.py measures them); after the
antialiased resize averages them, an output value differs from the CPU pipeline's by at most
DECODE_MAX_LEVELS levels of 255 and by DECODE_MEAN_LEVELS on average (asserted per batch)."""
import gc
import io
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data.image import maker as image_maker

from ..seeding import current_seed
from .image_folders import EVAL_V2, STD, TRAIN_V1, assert_batches_close, make_folder, make_photo, seeded_batches

pytestmark = pytest.mark.gpu

DECODE_MAX_LEVELS = 12
DECODE_MEAN_LEVELS = 1.0


def _levels(x, tx):
    """|difference| in levels of 255, per element (normalised values times std times 255)."""
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    return (x.float() - tx.to(x.device).float()).abs() * std * 255


def _assert_within_decode_bounds(ours, theirs):
    """Batch by batch: the labels equal, the images within the nvjpeg bounds of the CPU pipeline's."""
    worst = 0.0
    for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
        assert x.is_cuda and torch.equal(y.cpu(), ty)
        d = _levels(x, tx)
        worst = max(worst, d.max().item())
        assert d.mean().item() <= DECODE_MEAN_LEVELS
    assert worst <= DECODE_MAX_LEVELS


def _both_ways(ds, batch, backend, **options):
    """(hotloop's loader, its batches, torch's batches): the same shuffled epoch from a fresh seed,
    hotloop decoding with `backend` and GpuDecode's other `options` (skips where the GPU has no hardware
    JPEG decoder)."""
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=batch, shuffle=True, num_workers=2,
                                      generator=torch.Generator().manual_seed(seed)))
    try:
        loader = hotloop.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=2, device="cuda",
                                    generator=torch.Generator().manual_seed(seed),
                                    gpu_decode=hotloop.GpuDecode(backend=backend, **options))
        return loader, seeded_batches(loader), theirs
    except RuntimeError as exc:
        if backend == "hardware" and "hardware" in str(exc):
            pytest.skip(f"no hardware JPEG decoder here: {exc}")
        raise


def _each_image_decoded_once(st, n):
    """Every file a baseline JPEG the decoder takes: each decoded once, by the decoder or, for the
    workers' share of the batch (image/split.py), by a worker; none refused, none left to PIL otherwise."""
    assert st.images_refused == 0 and st.images_gpu_decoded > 0
    assert st.images_gpu_decoded + st.images_split == n and st.images_cpu_decoded == st.images_split


@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
@pytest.mark.parametrize("make", [TRAIN_V1, EVAL_V2])
def test_nvjpeg_batches_match_the_cpu_pipeline(tmp_path, backend, make):
    root = make_folder(str(tmp_path), n=40, sizes=(60, 400))
    ds = ImageFolder(root, transform=make(64))
    loader, ours, theirs = _both_ways(ds, 8, backend)
    _assert_within_decode_bounds(ours, theirs)
    st = loader.stats
    assert st.decoder.startswith(f"nvjpeg {backend}")
    _each_image_decoded_once(st, len(ds))


def test_threads_beside_the_engines_match_the_cpu_pipeline(tmp_path):
    """GpuDecode(threads=) on the engines: a share of each batch and the progressive JPEGs, which the
    engines refuse, decoded by host threads (NOTE [ Lanes beside the engines ] in csrc/nvjpeg_beside.c),
    every image within the decoder's bounds and decoded once, none by the workers."""
    rng = np.random.default_rng(current_seed())
    progressive = []
    for k in range(6):
        out = io.BytesIO()
        h, w = (int(v) for v in rng.integers(60, 400, size=2))
        make_photo(rng, h, w).save(out, "JPEG", quality=90, progressive=True)
        progressive.append((f"progressive{k}.jpg", out.getvalue()))
    root = make_folder(str(tmp_path), n=48, sizes=(60, 400), extra=progressive)
    ds = ImageFolder(root, transform=TRAIN_V1(64))
    loader, ours, theirs = _both_ways(ds, 8, "hardware", threads=2)
    _assert_within_decode_bounds(ours, theirs)
    st = loader.stats
    assert st.decoder.startswith("nvjpeg hardware") and "2 threads beside the engines" in st.decoder
    _each_image_decoded_once(st, len(ds))
    assert st.images_cpu_decoded == 0 and len(progressive) <= st.images_on_lanes < len(ds)
    assert 0.02 <= st.image_lane_share <= 0.98


@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid"])
def test_batches_the_prefetch_thread_makes_match_the_cpu_pipeline(tmp_path, backend, monkeypatch):
    """A consumer that takes its time ("the training step"): the prefetch thread makes the batches,
    outside the epoch's lock (NOTE [ One way down for a batch ] in data/prefetch/making.py)."""
    made_in = []
    make = image_maker.ImageMaker.make

    def recording_make(self, parts, stream, empty):
        made_in.append(threading.current_thread().name)
        return make(self, parts, stream, empty)

    monkeypatch.setattr(image_maker.ImageMaker, "make", recording_make)
    root = make_folder(str(tmp_path), n=48, sizes=(60, 400))
    ds = ImageFolder(root, transform=TRAIN_V1(64))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                            generator=torch.Generator().manual_seed(seed)))
    try:
        loader = hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, device="cuda",
                                    generator=torch.Generator().manual_seed(seed),
                                    gpu_decode=hotloop.GpuDecode(backend=backend))
        torch.manual_seed(current_seed())
        ours = []
        for x, y in loader:
            ours.append((x.clone(), y.clone()))
            time.sleep(0.05)
    except RuntimeError as exc:
        if backend == "hardware" and "hardware" in str(exc):
            pytest.skip(f"no hardware JPEG decoder here: {exc}")
        raise
    assert "hotloop-prefetch" in made_in
    _assert_within_decode_bounds(ours, theirs)
    _each_image_decoded_once(loader.stats, len(ds))


def test_cpu_backend_on_the_gpu_is_within_one_level(tmp_path):
    root = make_folder(str(tmp_path), n=30)
    ds = ImageFolder(root, transform=TRAIN_V1(48))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=7, num_workers=2, generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=7, num_workers=2, device="cuda", gpu_decode="cpu",
                                generator=torch.Generator().manual_seed(seed))
    ours = [(x.cpu(), y.cpu()) for x, y in seeded_batches(loader)]
    assert_batches_close(ours, theirs)


@pytest.mark.parametrize("backend", ["hardware", "cuda", "hybrid", "cpu"])
def test_batches_larger_than_one_ring_registration(tmp_path, backend):
    """A batch's bytes span several of the ring's 8 MiB page-locked registrations, which one DMA may
    not cross: on the H200 such batches of 256 made nvjpeg refuse images, then hang, and the CPU
    backend's uploads fail (cudaErrorInvalidValue), where small test batches never did."""
    root = make_folder(str(tmp_path), n=80, sizes=(700, 900))
    # no crop is 4 times 240 pixels: none decodes at a DCT scale, the CPU backend ships whole crop boxes
    ds = ImageFolder(root, transform=TRAIN_V1(240))
    batch = 40
    sizes = sorted(os.path.getsize(path) for path, _ in ds.samples)
    assert sum(sizes[:batch]) > 8 << 20, "the premise: even the smallest files of a batch fill more than 8 MiB"
    loader, ours, theirs = _both_ways(ds, batch, backend)
    if backend == "cpu":
        assert_batches_close([(x.cpu(), y.cpu()) for x, y in ours], theirs)
    else:
        for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
            assert torch.equal(y.cpu(), ty) and _levels(x, tx).max().item() <= DECODE_MAX_LEVELS
        st = loader.stats
        _each_image_decoded_once(st, len(ds))


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_no_leak_over_five_epochs(tmp_path):
    root = make_folder(str(tmp_path), n=48, sizes=(100, 300))
    ds = ImageFolder(root, transform=TRAIN_V1(64))
    loader = hotloop.DataLoader(ds, batch_size=16, num_workers=2, device="cuda", gpu_decode=True,
                                persistent_workers=True)
    for x, _ in loader:  # the first epoch makes the ring, the decoder and the allocator's blocks
        pass
    del x
    torch.cuda.synchronize()
    gc.collect()
    base_mem, base_fds = torch.cuda.memory_allocated(), _fds()
    for _ in range(5):
        for x, _ in loader:
            assert x.shape == (16, 3, 64, 64)
        del x
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() == base_mem
    assert _fds() == base_fds
    ring_bytes = loader.stats.ring_bytes
    del loader
    gc.collect()
    assert ring_bytes > 0 and _fds() < base_fds
