"""gpu_decode's ring is never page-locked: its batches leave their slot through a page-locked copy of
their own (image/maker.py), and page-locking the ring only held the driver lock while the first
decodes and training steps ran (ring.copies.DeviceCopies). The device path runs on the CPU (fake_cuda),
with PIL standing in for nvjpeg; a loader without gpu_decode still page-locks its slots."""
import random

import torch
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data.ring.copies import DeviceCopies

from .conftest import Images, fake_device, open_with
from .image_folders import TRAIN_V1, assert_batches_close, make_folder
from .stand_in_decoder import GatedDecoder, gpu_decode_loaders, take_batch


def _record_populate(monkeypatch):
    """The orders DeviceCopies gave CudaCalls.populate (which page-locks on a GPU)."""
    calls = DeviceCopies.calls
    asked, real = [], calls.populate

    def populate(self, ring, order):
        asked.append(list(order))
        return real(self, ring, order)

    monkeypatch.setattr(calls, "populate", populate)
    return asked


def test_a_gpu_decode_ring_is_not_page_locked(tmp_path, fake_cuda, monkeypatch):
    open_with(monkeypatch, GatedDecoder())
    fake_cuda.background_pins = False  # a slot counts as page-locked only once register() did it
    asked = _record_populate(monkeypatch)
    ds = ImageFolder(make_folder(str(tmp_path), n=30), transform=TRAIN_V1(28))
    theirs, ours = gpu_decode_loaders(ds, random.randrange(2**31), batch_size=5, shuffle=True, num_workers=2)
    expected = [(x.clone(), y.clone()) for x, y in theirs]
    it = iter(ours)
    got = [take_batch(it) for _ in range(len(ours) - 1)]
    pool = it._pool  # the epoch's, until its last batch
    assert pool.ring.nslots > 0 and not pool.copies.pin_slots
    got.append(take_batch(it))
    assert fake_cuda.registered == set() and asked == []  # neither in the background nor before a copy
    assert_batches_close(got, expected)


def test_a_ring_without_gpu_decode_still_is(fake_cuda, monkeypatch):
    fake_cuda.background_pins = False
    asked = _record_populate(monkeypatch)
    loader = fake_device(hotloop.DataLoader(Images(n=16, size=8), batch_size=4, num_workers=2))
    assert torch.cat([y for _, y in loader]).tolist() == list(range(16))
    assert len(asked) == 1 and fake_cuda.registered  # the background thread's order, and copies that came first
