"""The split of a batch's JPEGs between the GPU decoder and the workers (image/split.py), on the CPU
with stand-in decoders: the share at which both pools take as long, the workers' choice, batches equal
to torch's pipeline with each image decoded once and in order, and the workers taking over when the
decoder fails mid-epoch."""
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data.image import split
from hotloop.data.image.split import PROBE_SHARE, SPLIT_CAP, DecodeShare, ShareTaker, balanced_share

from .conftest import open_with
from .image_folders import TRAIN_V2, assert_batches_close, make_folder, seeded_batches
from .test_gpu_decode import PilDecoder


def _pools(x, c_gpu, c_upload, c_read, c_cpu, workers):
    """(main thread's, workers') seconds per image of a batch at share x."""
    return (1 - x) * c_gpu + x * c_upload, ((1 - x) * c_read + x * c_cpu) / workers


def test_the_balanced_share_gives_both_pools_the_same_time():
    rng = np.random.default_rng()
    inside = 0
    for _ in range(500):
        workers = int(rng.integers(1, 17))
        c_read, c_upload = rng.uniform(10e-6, 80e-6), rng.uniform(0, 200e-6)
        # a worker's decode: mostly far above its read; now and then (a tiny file, a slow disk) at or below it
        c_gpu = rng.uniform(5e-6, 300e-6)
        c_cpu = rng.uniform(0.5e-3, 6e-3) if rng.random() < 0.8 else c_read * rng.uniform(0.5, 1)
        x = balanced_share(c_gpu, c_upload, c_read, c_cpu, workers, current=0.5)
        assert PROBE_SHARE <= x <= SPLIT_CAP
        main, pool = _pools(x, c_gpu, c_upload, c_read, c_cpu, workers)
        if PROBE_SHARE < x < SPLIT_CAP:
            inside += 1
            assert main == pytest.approx(pool, rel=1e-9)
        elif x == SPLIT_CAP:  # even at the cap the main thread is the slower pool, or both gain with the share
            assert main >= pool * (1 - 1e-9) or c_cpu <= c_read
        else:  # at the probe: the workers are already the slower pool, or their share saves main nothing
            assert pool >= main * (1 - 1e-9) or c_upload >= c_gpu
        # no other share in the bounds does better for the slower pool
        best = min(max(_pools(y, c_gpu, c_upload, c_read, c_cpu, workers))
                   for y in np.linspace(PROBE_SHARE, SPLIT_CAP, 101))
        assert max(main, pool) <= best * (1 + 1e-9)
    assert inside > 50


def test_an_unmeasured_figure_keeps_the_share():
    assert balanced_share(None, 0.0, 1e-5, 1e-3, 8, current=0.1) == 0.1
    assert balanced_share(1e-4, 0.0, 1e-5, None, 8, current=0.2) == 0.2


def test_a_worker_takes_its_share_of_images_without_drawing():
    share = DecodeShare()
    for x in (0.0, PROBE_SHARE, 0.1, 0.25, 1 / 3, 1.0):
        share.set(x)
        taker = ShareTaker(share)
        taken = [taker.decode_here() for _ in range(3000)]
        assert abs(sum(taken) - x * 3000) <= 1
    state = torch.get_rng_state()
    ShareTaker(share).decode_here()
    assert torch.equal(state, torch.get_rng_state())


@pytest.fixture
def half_split(monkeypatch):
    """Workers decode half of the JPEGs the decoder takes, whatever the balance measures."""
    monkeypatch.setattr(split, "PROBE_SHARE", 0.5)
    monkeypatch.setattr(split, "SPLIT_CAP", 0.5)


@pytest.mark.parametrize("workers", [1, 3])
def test_split_batches_equal_torchs_each_image_decoded_once(tmp_path, monkeypatch, half_split, workers):
    decoder = PilDecoder()
    open_with(monkeypatch, decoder)
    ds = ImageFolder(make_folder(str(tmp_path), n=40), transform=TRAIN_V2(28))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                                            generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                                gpu_decode=hotloop.GpuDecode(worker_decode=True),
                                generator=torch.Generator().manual_seed(seed))
    assert_batches_close(seeded_batches(loader), theirs, levels=2)  # order, labels and pixels as torch's
    st = loader.stats
    assert st.images_split > 0 and st.images_gpu_decoded == decoder.decoded > 0
    # each image once: by the decoder, by PIL after the decoder refused it, or by a worker
    assert st.images_gpu_decoded + st.images_refused + st.images_cpu_decoded == len(ds)
    assert st.image_worker_share == 0.5


@pytest.mark.parametrize("gpu_decode", [True, hotloop.GpuDecode(worker_decode=False)])
def test_worker_decode_false_leaves_every_jpeg_to_the_decoder(tmp_path, monkeypatch, half_split, gpu_decode):
    """The default: whatever the share's bounds, the decoder takes every JPEG."""
    decoder = PilDecoder()
    open_with(monkeypatch, decoder)
    ds = ImageFolder(make_folder(str(tmp_path), n=24), transform=TRAIN_V2(28))
    seed = random.randrange(2**31)
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=8, shuffle=True, num_workers=2,
                                            generator=torch.Generator().manual_seed(seed)))
    loader = hotloop.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, gpu_decode=gpu_decode,
                                generator=torch.Generator().manual_seed(seed))
    assert_batches_close(seeded_batches(loader), theirs, levels=2)
    st = loader.stats
    assert st.images_split == 0 and st.image_worker_share == 0.0
    assert st.images_gpu_decoded == decoder.decoded == len(ds) - st.images_refused - st.images_cpu_decoded


def test_worker_decode_must_be_a_bool():
    with pytest.raises(TypeError, match="worker_decode to be a bool"):
        hotloop.GpuDecode(worker_decode="no")


class CostlyDecoder(PilDecoder):
    """PilDecoder that costs `seconds` per image besides (or, with decode=False, only that, its
    pixels left as they are: for a test of the share alone)."""

    def __init__(self, seconds, decode=True):
        super().__init__()
        self.seconds, self.decode_pixels = seconds, decode

    def decode(self, sources, dests, count, stream):
        import time
        time.sleep(self.seconds * count)
        if self.decode_pixels:
            return super().decode(sources, dests, count, stream)
        self.decoded += count
        return bytes(count)


@pytest.mark.parametrize("cost", [0.0, 0.02])
def test_the_share_follows_what_each_pool_spends(tmp_path, monkeypatch, cost):
    """A decoder that costs next to nothing keeps the workers near the probe share; one slower than
    the workers' decode hands them the most they may take."""
    open_with(monkeypatch, CostlyDecoder(cost, decode=False))
    ds = ImageFolder(make_folder(str(tmp_path), n=96), transform=TRAIN_V2(28))
    loader = hotloop.DataLoader(ds, batch_size=16, num_workers=2, gpu_decode=hotloop.GpuDecode(worker_decode=True))
    for _ in range(3):
        for _ in loader:
            pass
    share = loader.stats.image_worker_share
    # next to nothing: the running averages may hold a pause of the main thread's (a collection, a busy CI machine)
    assert share == pytest.approx(SPLIT_CAP) if cost else PROBE_SHARE <= share < SPLIT_CAP / 2


class FailingDecoder(PilDecoder):
    """PilDecoder whose `fail_at`-th call and every one after raise, as nvjpeg's errors do."""

    def __init__(self, fail_at):
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def decode(self, sources, dests, count, stream):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("nvjpegDecodeJpeg: NVJPEG_STATUS_EXECUTION_FAILED (a stand-in's)")
        return super().decode(sources, dests, count, stream)


@pytest.mark.parametrize("worker_decode", [False, True])
@pytest.mark.parametrize("workers, persistent", [(0, False), (2, True), (2, False)])
def test_a_decoder_failing_mid_epoch(tmp_path, monkeypatch, workers, persistent, worker_decode):
    """With workers, the epoch completes as torch's would, after one warning, and the workers decode
    everything from then on: the next epoch never calls the decoder, and new workers run the CPU
    backend; without workers, the error is raised. The same whether the workers shared the decode
    before or not."""
    decoder = FailingDecoder(fail_at=2)
    open_with(monkeypatch, decoder)
    ds = ImageFolder(make_folder(str(tmp_path), n=40), transform=TRAIN_V2(28))
    seed = random.randrange(2**31)
    loader = hotloop.DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                                gpu_decode=hotloop.GpuDecode(worker_decode=worker_decode),
                                generator=torch.Generator().manual_seed(seed), persistent_workers=persistent)
    if workers == 0:
        with pytest.raises(RuntimeError, match="EXECUTION_FAILED"):
            list(loader)
        return
    theirs = seeded_batches(TorchDataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                                            generator=torch.Generator().manual_seed(seed)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = seeded_batches(loader)
    failed = [w for w in caught if "decoder failed" in str(w.message)]
    assert len(failed) == 1 and "EXECUTION_FAILED" in str(failed[0].message)
    assert_batches_close(ours, theirs, levels=2)
    st = loader.stats
    assert st.decoder.startswith("cpu (workers decode with PIL) since nvjpeg hardware failed")
    assert "EXECUTION" in st.decoder
    assert st.image_worker_share == 1.0
    assert st.images_gpu_decoded + st.images_refused + st.images_cpu_decoded == len(ds)
    calls = decoder.calls
    assert len(list(loader)) == 5 and decoder.calls == calls  # the next epoch: the workers decode all
