"""The ring is sized from what is in flight: prefetch_factor batches per worker, plus what the consumer's
side holds (two lent views on the CPU, as torch's consumer holds two batches; with a device the
batches queued ahead, the one handed out and one whose copy may still run), and Pool.ring_bytes says
how large it is."""
import collections

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import hotloop

from .conftest import assert_same, fake_device

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

BATCH = 8
SAMPLE = 128 << 10  # float32 elements: 512 KiB a sample, 4 MiB a batch


class Large(Dataset):
    def __init__(self, n=40):
        self.n = n
        self.seed = int(torch.randint(0, 2**31, ()))  # fresh data every run

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed + i)
        return torch.rand(SAMPLE, generator=g), i


def _bound(slots):
    """Bytes of a ring of `slots` slots of one batch: the tensors, the batch's metadata (64 KiB), a
    page per leaf for rounding, and a page of control blocks per 64 slots."""
    batch = BATCH * SAMPLE * 4 + BATCH * 8
    return slots * (batch + (64 << 10) + 2 * 4096) + (slots // 64 + 1) * 4096


@pytest.mark.parametrize("num_workers,prefetch_factor", [(1, 1), (2, 2), (3, 1), (2, 3)])
@pytest.mark.parametrize("device", [False, True], ids=["cpu", "fake-device"])
def test_ring_sized_from_what_is_in_flight(num_workers, prefetch_factor, device, request):
    ds = Large()
    kw = dict(batch_size=BATCH, num_workers=num_workers, prefetch_factor=prefetch_factor)
    theirs = list(TorchDataLoader(ds, **kw))
    loader = hotloop.DataLoader(ds, persistent_workers=True, **kw)
    if device:
        request.getfixturevalue("fake_cuda")
        fake_device(loader)
    # a consumer that keeps its last 3 batches (one more than are lent as views): every batch right
    for epoch in range(2):
        last = collections.deque(maxlen=3)
        for i, batch in enumerate(loader):
            assert_same(theirs[i], batch)
            last.append(batch)
        assert i + 1 == len(theirs)
        for k, b in enumerate(last):
            assert_same(theirs[len(theirs) - len(last) + k], b)
        del last, batch, b
    pool = loader._hl_pool
    held = loader.prefetch_batches + 2 if device else 2
    slots = num_workers * prefetch_factor + held
    assert pool.ring.nslots == slots
    assert BATCH * SAMPLE * 4 * slots < pool.ring_bytes <= _bound(slots)
    assert pool.ring_bytes == pool.ring.nbytes == loader.stats.ring_bytes
    ring_bytes = pool.ring_bytes
    pool.close()
    assert pool.ring is None and pool.ring_bytes == ring_bytes  # still readable for a report


def test_no_ring_no_ring_bytes():
    loader = hotloop.DataLoader(["a", "b", "c"], batch_size=2, num_workers=2, persistent_workers=True)
    assert list(loader) == list(TorchDataLoader(["a", "b", "c"], batch_size=2))
    assert loader._hl_pool.ring is None and loader._hl_pool.ring_bytes == 0
