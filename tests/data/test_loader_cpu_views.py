"""hotloop.DataLoader's zero-copy CPU batches: views of ring slots, lent until their last tensor is gone."""
import gc

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop
from hotloop.data.ring.layout import flatten
from hotloop.data.ring.slots import LEASE_SLOTS

from ..seeding import seeded_generator
from .conftest import Mixed, assert_same, both, open_fds, rss_kb, shm_files

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Blocks(Dataset):
    """Sample i: 64 kB of random int32 drawn once, plus i: a reused slot shows as wrong values."""

    def __init__(self, n=40, numel=1 << 14, seed=None):
        g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(1 << 30, ())))
        self.data = torch.randint(-(1 << 30), 1 << 30, (n, numel), generator=g, dtype=torch.int32)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


def _in_ring(t, pool):
    """True when the tensor's memory lies inside the pool's ring (a view, not a copy)."""
    ring = pool.leases.ring if pool.leases is not None else pool.ring
    start = ring.slot_address(0)
    return start <= t.data_ptr() < start + ring.nslots * ring.slot_bytes


@pytest.mark.parametrize("kind", ["tuple", "dict", "nested"])
def test_view_batches_equal_torch(kind):
    theirs, ours = both(Mixed(n=37, kind=kind), batch_size=4, num_workers=2, shuffle=True, generator=True)
    assert len(theirs) == len(ours) == 10
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)
    for batch in ours:  # each tensor has a storage of its own bytes, as a collated one has
        tensors = []
        flatten(batch, tensors)
        for t in tensors:
            assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_batches_are_views_and_slots_come_back():
    ds = Blocks()
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    pool = None
    for epoch in range(3):
        for k, (x, i) in enumerate(loader):
            pool = loader._hl_pool
            assert torch.equal(x, ds.data[i]) and torch.equal(i, torch.arange(4 * k, 4 * k + 4))
            assert _in_ring(x, pool) and _in_ring(i, pool)
            assert pool.leases.outstanding <= 2  # this batch, and the previous one until `x, i` are rebound
        del x, i
    st = loader.stats
    assert st.batches == st.view_batches == 30  # every batch was lent: slots came back in time
    pool.collect_leases()
    assert pool.leases.outstanding == 0 and len(pool.free_slots) == pool.ring.nslots  # the ring never grew


@pytest.mark.parametrize("persistent", [False, True])
def test_holding_every_batch_keeps_their_values(persistent):
    """A consumer that keeps every batch: the first LEASE_SLOTS are lent, the rest copied out, no
    deadlock, and no held batch is overwritten, neither in its epoch nor in the next ones."""
    ds = Blocks(n=64)
    loader = hotloop.DataLoader(ds, batch_size=2, num_workers=3, shuffle=True,
                                generator=seeded_generator(5), persistent_workers=persistent)
    ref = list(TorchDataLoader(ds, batch_size=2, shuffle=True, generator=seeded_generator(5)))
    held = []
    for epoch in range(3):
        batches = list(loader)
        assert len(batches) == 32
        held.append(batches)
        # held batches never come back: a pool lends LEASE_SLOTS of them (persistent: one pool for all)
        assert loader.stats.view_batches == LEASE_SLOTS * (1 if persistent else epoch + 1)
        if epoch == 0:
            for (x, i), (y, j) in zip(ref, batches, strict=True):
                assert torch.equal(i, j) and torch.equal(x, y)
        for old in held:  # this epoch's, and every earlier one's, still hold their samples
            assert torch.equal(torch.cat([j for _, j in old]).sort().values, torch.arange(64))
            for y, j in old:
                assert torch.equal(y, ds.data[j])
    if persistent:
        pool = loader._hl_pool
        assert [_in_ring(x, pool) for x, _ in held[0]] == [True] * LEASE_SLOTS + [False] * (32 - LEASE_SLOTS)


def test_numpy_arrays_views_and_storages_keep_their_slot():
    ds = Blocks(n=80)
    loader = hotloop.DataLoader(ds, batch_size=2, num_workers=2)
    it = iter(loader)
    x, i = next(it)
    leases = it._pool.leases
    arr = x.numpy()  # shares the slot's memory
    part = x[1, 100:200].view(torch.int16)  # a view of a view, another dtype
    storage, i_at = i.untyped_storage(), i.storage_offset()
    want_x, want_i = ds.data[i].clone(), i.clone()
    del x, i
    for x2, i2 in it:  # every slot but the held one is reused many times meanwhile
        assert torch.equal(x2, ds.data[i2])
        assert leases.outstanding >= 1
    del x2, i2
    assert np.array_equal(arr, want_x.numpy())
    assert torch.equal(part, want_x[1, 100:200].view(torch.int16))
    assert torch.equal(torch.tensor([], dtype=torch.int64).set_(storage, i_at, (2,)), want_i)
    # the batch kept aside holds one of the LEASE_SLOTS (2) leases: the other 39 alternate between
    # views and copies (the ring has no slot for a batch kept beyond what a loop holds)
    assert LEASE_SLOTS == 2 and loader.stats.view_batches == 1 + (39 + 1) // 2
    assert leases.outstanding == 1 and not leases.ring.closed  # the pool closed with the epoch, the ring waits
    del arr, part
    assert leases.outstanding == 1  # the storage still refers to it
    del storage
    assert leases.outstanding == 0 and leases.ring.closed


def test_a_batch_dropped_in_another_thread():
    import threading

    ds = Blocks(n=12)
    loader = hotloop.DataLoader(ds, batch_size=2, num_workers=1)
    box = []
    for x, i in loader:
        assert torch.equal(x, ds.data[i])
        box.append((x, i))
        del x, i
        th = threading.Thread(target=box.clear)  # the last reference dies there
        th.start()
        th.join()
    assert loader.stats.view_batches == 6


@pytest.mark.parametrize("persistent", [False, True])
def test_fds_rss_and_no_shm_over_epochs(persistent):
    ds = Blocks(n=48, numel=1 << 16)
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)

    def same(x, i):  # row by row: ds.data[i] would allocate a batch per check (and ASan keeps those)
        return all(torch.equal(x[r], ds.data[int(k)]) for r, k in enumerate(i))

    list(loader)  # warm up
    gc.collect()
    shm, fds, rss = shm_files(), set(open_fds()), rss_kb()
    keep = None
    for epoch in range(6):
        for k, (x, i) in enumerate(loader):
            assert same(x, i)
            if k == 5:
                keep = (x, i)  # one batch of each epoch survives into the next one
                assert shm_files() <= shm
        del x, i
        gc.collect()
        assert shm_files() <= shm
        assert len(set(open_fds()) - fds) == (0 if persistent else 1)  # non-persistent: the kept batch's ring
        assert same(*keep)
    # kB: flat, not growing by epochs. Not under AddressSanitizer, whose quarantine keeps freed memory
    # (up to 256 MB) on purpose: there RSS rose 20.5 MiB in one CI run and under 20 in others
    if "address" not in hotloop.build_info()["sanitizers"]:
        assert rss_kb() - rss < 20 << 10
    del keep, loader
    gc.collect()
    assert set(open_fds()) <= fds


def test_ring_leases_directly():
    from hotloop import _C

    ring = _C.Ring(3, 5000)
    leases = _C.RingLeases(ring)
    with pytest.raises(TypeError, match="expected a hotloop._C.Ring"):
        _C.RingLeases(object())
    with pytest.raises(IndexError, match="out of range"):
        leases.lease(3, _pairs())
    with pytest.raises(ValueError, match="do not lie inside a slot"):
        leases.lease(0, _pairs(4096, 4096 + 1))
    with pytest.raises(TypeError, match="int64"):
        leases.lease(0, b"123")
    t, u = (torch.from_dlpack(c) for c in leases.lease(1, _pairs(0, 16, 4096, 100)))
    assert t.dtype == torch.uint8 and t.shape == (16,) and t.data_ptr() == ring.slot_address(1)
    assert u.shape == (100,) and u.data_ptr() == ring.slot_address(1) + 4096
    with pytest.raises(ValueError, match="leased already"):
        leases.lease(1, _pairs(0, 1))
    leases.lease(2, _pairs(0, 1, 5, 5))  # capsules torch never took: their destructors return the lease
    assert leases.returned() == [2] and leases.returned() == []
    assert leases.lease(0, _pairs()) == [] and leases.returned() == [0]  # nothing lent: back at once
    assert leases.outstanding == 1
    del t
    assert leases.outstanding == 1 and leases.returned() == []  # u still holds slot 1
    del u
    assert leases.outstanding == 0 and leases.returned() == [1]
    t = torch.from_dlpack(leases.lease(1, _pairs(0, 8))[0])  # a returned slot may be lent again
    leases.close_ring()
    assert not ring.closed  # t still reads it
    values = t.clone()
    assert torch.equal(t, values)
    del t
    assert ring.closed


def _pairs(*values):
    import array

    return array.array("q", values).tobytes()


def test_lease_returned_by_a_thread_without_the_gil():
    """torch runs the deleter wherever the storage dies, often without the GIL: call it that way
    (ctypes releases the GIL around a foreign call) and check that it takes the GIL itself."""
    import ctypes

    from hotloop import _C

    ring = _C.Ring(2, 4096)
    leases = _C.RingLeases(ring)
    capsule = leases.lease(0, _pairs(0, 64))[0]
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    used = ctypes.c_char_p(b"used_dltensor")  # outlives the capsule below
    ctypes.pythonapi.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ctypes.pythonapi.PyCapsule_SetName(capsule, used)  # consumed, as torch marks it
    deleter = ctypes.c_void_p.from_address(managed + 56).value  # dl_tensor (48 bytes), manager_ctx, deleter
    assert leases.outstanding == 1
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(managed)  # GIL released during the call
    assert leases.outstanding == 0 and leases.returned() == [0]
    del capsule
    leases.close_ring()
    assert ring.closed
