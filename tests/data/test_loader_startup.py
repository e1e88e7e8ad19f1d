"""hotloop.DataLoader's first batches: eager placement into the ring, and how the workers are forked."""
import collections
import gc
import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop
import hotloop.data.consumer.pool as pool_module
import hotloop.data.consumer.processes as workers_module
from hotloop import _C
from hotloop.data.launcher.zygote import LaunchedWorker
from hotloop.data.messages import Layout

from .conftest import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture
def ring_made(monkeypatch):
    """An event set once the main process has made the ring (and placed the waiting tasks): a
    dataset that waits for it makes its sample after the ring exists, whatever the timing."""
    event = multiprocessing.get_context("fork").Event()
    make_ring = pool_module.Pool.make_ring

    def made(self, *args):
        make_ring(self, *args)
        event.set()

    monkeypatch.setattr(pool_module.Pool, "make_ring", made)
    return event


class Timed(Dataset):
    """Sample i: random draws (worker RNG, so seeding must match torch's) and i. `late`: a worker's
    first sample comes late (after a delay, or after the ring exists); `early`: the first sample
    comes at once and the rest of that batch late, so the ring is made from it meanwhile."""

    def __init__(self, n, mode, gate=None):
        self.n, self.mode, self.gate = n, mode, gate
        self.calls = 0  # per process: a worker's own count of the samples it made

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        info = get_worker_info()
        if info is not None and self.mode == "late" and self.calls == 1:
            if self.gate is not None and info.id > 0:
                self.gate.wait(30)
            else:
                time.sleep(0.02 * (info.id + 1))
        elif info is not None and self.mode == "early" and 1 < self.calls <= 4:
            time.sleep(0.005)
        return torch.rand(3, 4) + i, np.float32(random.random()), i, f"s{i}"


def assert_ring_free(pool):
    """Every slot is back: FREE in the ring, once in the free list."""
    gc.collect()
    pool.collect_leases()
    ring = pool.ring
    assert ring is not None
    states = [ring.state(i) for i in range(ring.nslots)]
    assert states == [_C.RING_FREE] * ring.nslots, states
    assert sorted(pool.free_slots) == list(range(ring.nslots))  # no duplicates, none missing
    assert not pool.placed_early


def reference(dataset, epochs, seed, **kwargs):
    """torch's batches for `epochs` epochs, with the generator and global seeds fixed."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    loader = TorchDataLoader(dataset, generator=torch.Generator().manual_seed(seed), persistent_workers=True,
                             **kwargs)
    return [list(loader) for _ in range(epochs)]


def ours_epochs(dataset, epochs, seed, check, **kwargs):
    """hotloop's epochs against `check(epoch, batches)`, each batch dropped before the ring is looked
    at (CPU batches are views of their slots)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    loader = hotloop.DataLoader(dataset, generator=torch.Generator().manual_seed(seed), persistent_workers=True,
                                **kwargs)
    for epoch in range(epochs):
        check(epoch, list(loader))
        assert_ring_free(loader._hl_pool)
    return loader


@pytest.mark.parametrize("num_workers, mode, by_launcher",
                         [(n, m, True) for n in (1, 3, 5) for m in ("late", "early", "gated")]
                         + [(3, "gated", False), (5, "early", False)])
def test_first_batches_same_as_torch(num_workers, mode, by_launcher, request, monkeypatch):
    monkeypatch.setattr(workers_module, "USE_LAUNCHER", by_launcher)
    gate = request.getfixturevalue("ring_made") if mode == "gated" else None
    ds = Timed(53, "late" if mode == "gated" else mode, gate)
    seed = random.randrange(1 << 20)
    kw = dict(batch_size=4, shuffle=True, num_workers=num_workers)
    ref = reference(Timed(53, "none"), 2, seed, **kw)

    def check(epoch, got):
        assert len(got) == len(ref[epoch]) == 14
        for a, b in zip(ref[epoch], got, strict=True):
            assert_same(a, b)
        assert sorted(i for b in got for i in b[2].tolist()) == list(range(53))

    ours_epochs(ds, 2, seed, check, **kw)


def test_first_batches_in_order_false(ring_made):
    ds = Timed(40, "late", ring_made)
    seed = random.randrange(1 << 20)
    ref = reference(Timed(40, "none"), 2, seed, batch_size=4, num_workers=3)

    def check(epoch, got):
        key = lambda b: b[2][0].item()  # noqa: E731
        assert sorted(map(key, got)) == sorted(map(key, ref[epoch]))
        for a, b in zip(sorted(ref[epoch], key=key), sorted(got, key=key), strict=True):
            assert_same(a, b)

    ours_epochs(ds, 2, seed, check, batch_size=4, num_workers=3, in_order=False)


class FailsAt(Dataset):
    """Sample i is a row of i; dataset[bad] raises (after the ring exists, with a gate)."""

    def __init__(self, bad, gate=None, wait_at=()):
        self.bad, self.gate, self.wait_at = bad, gate, wait_at

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i in self.wait_at and self.gate is not None:
            self.gate.wait(30)
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return torch.full((2,), float(i)), i


# the first batches are [0, 1, 2, 3] (worker 0) and [4, 5, 6, 7] (worker 1): 0 and 4 raise before
# their worker sent a layout, 3 and 7 after
@pytest.mark.parametrize("bad", [0, 3, 4, 7])
@pytest.mark.parametrize("gated", [True, False])
def test_error_in_a_first_batch_placed_early(bad, gated, request):
    gate = request.getfixturevalue("ring_made") if gated else None
    loader = hotloop.DataLoader(FailsAt(bad, gate, wait_at=(4,)), batch_size=4, num_workers=3,
                                persistent_workers=True)
    for _ in range(2):
        it = iter(loader)
        got = []
        for k in range(6):
            if k == bad // 4:
                with pytest.raises(ValueError, match=f"bad sample {bad}") as info:
                    next(it)
                assert f"dataset[{bad}]" in str(info.value)
            else:  # as torch: the epoch goes on after a worker's error
                got.append(next(it))
                assert_same(got[-1], [torch.arange(4.0 * k, 4 * k + 4).view(4, 1).expand(4, 2),
                                      torch.arange(4 * k, 4 * k + 4)])
        with pytest.raises(StopIteration):
            next(it)
        del got
        assert_ring_free(loader._hl_pool)


def test_epoch_abandoned_while_first_batches_are_placed(ring_made):
    """Persistent workers: a new epoch starts while the first batches of workers 1.. (placed when
    the ring was made, their layouts not read yet) are still being made; their slots come back."""
    ds = Timed(40, "late", ring_made)
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=3, persistent_workers=True)
    it = iter(loader)
    assert next(it)[2].tolist() == [0, 1, 2, 3]
    del it
    for _ in range(2):
        got = list(loader)
        assert [i for b in got for i in b[2].tolist()] == list(range(40))
        del got
        assert_ring_free(loader._hl_pool)


class SlowFirst(Dataset):
    """Worker 1's first sample comes after the ring exists and then takes `delay` seconds."""

    def __init__(self, gate, delay):
        self.gate, self.delay = gate, delay
        self.calls = 0

    def __len__(self):
        return 24

    def __getitem__(self, i):
        self.calls += 1
        info = get_worker_info()
        if info.id == 1 and self.calls == 1:
            self.gate.wait(30)
            time.sleep(self.delay)
        return torch.full((2,), float(i)), i


def test_timeout_on_a_batch_placed_early(ring_made):
    loader = hotloop.DataLoader(SlowFirst(ring_made, 2.0), batch_size=4, num_workers=3, persistent_workers=True,
                                timeout=0.3)
    it = iter(loader)
    assert next(it)[1].tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match=r"timed out after 0.3 seconds waiting for batch 1 \(worker 1"):
        next(it)
    del it
    for _ in range(2):  # the next epochs: every slot of the abandoned one came back
        got = list(loader)
        assert [i for b in got for i in b[1].tolist()] == list(range(24))
        del got
        assert_ring_free(loader._hl_pool)


class Sparse(IterableDataset):
    """Worker w yields the samples w, w + n, ... below `n_samples`; the workers in `empty` yield
    none (after the ring exists, with a gate): their first task ends in a stop."""

    def __init__(self, n_samples, empty, gate=None):
        self.n, self.empty, self.gate = n_samples, empty, gate

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        if wid in self.empty:
            if self.gate is not None:
                self.gate.wait(30)
            return
        for i in range(wid, self.n, nw):
            yield torch.full((3,), i) + torch.rand(3), f"s{i}"


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("empty", [(1,), (1, 2), (0, 2)])
def test_iterable_workers_that_stop_on_their_first_task(empty, gated, request):
    gate = request.getfixturevalue("ring_made") if gated else None
    seed = random.randrange(1 << 20)
    torch.manual_seed(seed)
    ref = [list(TorchDataLoader(Sparse(29, empty), batch_size=3, num_workers=3, persistent_workers=True))
           for _ in range(2)][0]
    torch.manual_seed(seed)

    def check(epoch, got):
        if epoch == 0:
            assert len(got) == len(ref) > 0
            for a, b in zip(ref, got, strict=True):
                assert_same(a, b)
        wanted = sorted(f"s{i}" for i in range(29) if i % 3 not in empty)
        assert sorted(s for b in got for s in b[1]) == wanted

    loader = hotloop.DataLoader(Sparse(29, empty, gate), batch_size=3, num_workers=3, persistent_workers=True)
    for epoch in range(2):
        check(epoch, list(loader))
        assert_ring_free(loader._hl_pool)


def hold_later_workers(gate, i):
    """Workers 1.. stop at every fourth sample until the gate opens (the main process opens it once
    the ring exists): their first batches are placed before their layouts come."""
    info = get_worker_info()
    if gate is not None and info is not None and info.id > 0 and i % 4 == 0:
        gate.wait(30)


class SideAndRagged(Dataset):
    """A string leaf on every sample, and tensors whose shape changes within the first batch."""

    def __init__(self, gate=None):
        self.gate = gate

    def __len__(self):
        return 20

    def __getitem__(self, i):
        hold_later_workers(self.gate, i)
        return torch.arange(i % 3 + 1) * 1.5, f"name-{i}" * (i + 1), {"k": i}


def list_collate(samples):
    return samples


@pytest.mark.parametrize("gated", [True, False])
def test_side_path_and_ragged_first_batches(gated, request):
    gate = request.getfixturevalue("ring_made") if gated else None
    # default collate: torch's own error for the ragged tensors, from every first batch
    loader = hotloop.DataLoader(SideAndRagged(gate), batch_size=4, num_workers=3, persistent_workers=True)
    for _ in range(2):
        it = iter(loader)
        for _ in range(5):
            with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
                next(it)
        with pytest.raises(StopIteration):
            next(it)
        assert_ring_free(loader._hl_pool)
    # a collate_fn that keeps them: the leaves that do not fit the first layout take the side path
    ref = list(TorchDataLoader(SideAndRagged(), batch_size=4, collate_fn=list_collate))

    def check(epoch, got):
        assert len(got) == len(ref) == 5
        for a, b in zip(ref, got, strict=True):
            assert_same(a, b)

    ours = hotloop.DataLoader(SideAndRagged(gate), batch_size=4, num_workers=3, persistent_workers=True,
                              collate_fn=list_collate)
    for epoch in range(2):
        check(epoch, list(ours))
        assert_ring_free(ours._hl_pool)
    # a string leaf with default collate: the fast path with side objects
    ref = list(TorchDataLoader(SideAndRagged(), batch_size=1))
    ours = hotloop.DataLoader(SideAndRagged(gate), batch_size=1, num_workers=3, persistent_workers=True)
    got = list(ours)
    assert len(got) == len(ref) == 20
    for a, b in zip(ref, got, strict=True):
        assert_same(a, b)
    del got
    assert_ring_free(ours._hl_pool)


class Ordered(Dataset):
    """An OrderedDict leaf: default_collate keeps its type, the fast plan gives up on it at the first
    sample (no early layout), so each first batch is collated whole and its layout sent after."""

    def __init__(self, gate=None):
        self.gate = gate

    def __len__(self):
        return 30

    def __getitem__(self, i):
        hold_later_workers(self.gate, i)
        return torch.rand(3) + i, collections.OrderedDict(a=i, t=torch.full((2,), i))


@pytest.mark.parametrize("gated", [True, False])
def test_first_batches_the_fast_plan_gives_up_on(gated, request):
    gate = request.getfixturevalue("ring_made") if gated else None
    seed = random.randrange(1 << 20)
    kw = dict(batch_size=4, shuffle=True, num_workers=3)
    ref = reference(Ordered(), 2, seed, **kw)

    def check(epoch, got):
        assert len(got) == len(ref[epoch]) == 8
        for a, b in zip(ref[epoch], got, strict=True):
            assert_same(a, b)

    ours_epochs(Ordered(gate), 2, seed, check, **kw)


class DiesAfterFirst(Dataset):
    """Sample i is i; the worker that makes `victim` (the second sample of its first batch) kills
    itself with SIGKILL the first time, right after its first sample (and its layout) went out."""

    def __init__(self, victim, marker, gate=None):
        self.victim, self.marker, self.gate = victim, marker, gate

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == self.victim and not os.path.exists(self.marker):
            if self.gate is not None:
                self.gate.wait(30)  # its batch has its slot now: the successor must write that one
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i, i * 3]), i


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("victim", [1, 5])  # worker 0's and worker 1's first batch
def test_worker_killed_after_its_first_sample(tmp_path, victim, gated, request):
    gate = request.getfixturevalue("ring_made") if gated and victim != 1 else None
    ds = DiesAfterFirst(victim, str(tmp_path / "died"), gate)
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=3, persistent_workers=True)
    ref = list(TorchDataLoader(DiesAfterFirst(-1, ""), batch_size=4))
    for _ in range(2):
        got = list(loader)
        assert len(got) == len(ref) == 10
        for a, b in zip(ref, got, strict=True):
            assert_same(a, b)
        del got, a, b
        assert_ring_free(loader._hl_pool)
    assert os.path.exists(tmp_path / "died") and loader.stats.worker_restarts == 1


class Gated(Dataset):
    """Worker 1's first sample waits until the ring exists (made from worker 0's first sample)."""

    def __init__(self, gate):
        self.gate = gate

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 4:
            self.gate.wait(30)
        return torch.full((8,), i), i


def test_placement_does_not_wait_for_the_main_process(ring_made, monkeypatch):
    """Worker 1 sizes nothing: the ring exists before its first sample, and its Place was sent
    with the ring. The main process holds worker 1's layout message until that worker published its
    first batch into the ring: with placement that waits for the layout, the slot is not even
    assigned when the layout is read, so the worker cannot have written it."""
    seen = []
    on_message = pool_module.Pool._on_message

    def held(self, msg):
        if isinstance(msg, Layout) and self.task_worker.get(msg.task_id) == 1 and not seen:
            task = self.tasks[msg.task_id]
            if task.slot < 0:
                seen.append("layout read before the batch had a slot")
            else:
                deadline = time.monotonic() + 30
                while self.ring.state(task.slot) == _C.RING_ASSIGNED and time.monotonic() < deadline:
                    time.sleep(0.001)
                state, tid, wid, _, _ = self.ring.info(task.slot)
                seen.append("written first" if state != _C.RING_ASSIGNED and (tid, wid) == (task.id, 1)
                            else "never written")
        on_message(self, msg)

    monkeypatch.setattr(pool_module.Pool, "_on_message", held)
    loader = hotloop.DataLoader(Gated(ring_made), batch_size=4, num_workers=2)
    got = list(loader)
    assert seen == ["written first"]
    assert torch.equal(torch.cat([b[1] for b in got]), torch.arange(16))
    assert torch.equal(torch.cat([b[0] for b in got]), torch.arange(16).view(16, 1).expand(16, 8))


def _parent(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def _pipes(pid):
    """The pipes process pid holds open (both ends of a pipe read as the same "pipe:[inode]")."""
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return {n for n in names if n.startswith("pipe:")}


@pytest.mark.parametrize("num_workers", [2, 4])
def test_worker_0_is_forked_by_the_main_process(num_workers, monkeypatch):
    monkeypatch.setattr(workers_module, "USE_LAUNCHER", True)
    loader = hotloop.DataLoader(torch.arange(40.0) + 0.5, batch_size=4, num_workers=num_workers,
                                persistent_workers=True)
    assert torch.equal(torch.cat(list(loader)), torch.arange(40.0) + 0.5)
    pool = loader._hl_pool
    pids = [p.pid for p in pool.procs]
    assert not isinstance(pool.procs[0], LaunchedWorker)
    assert all(isinstance(p, LaunchedWorker) for p in pool.procs[1:])
    assert _parent(pids[0]) == os.getpid()
    assert _parent(pool.launcher.pid) == os.getpid()
    assert [_parent(p) for p in pids[1:]] == [pool.launcher.pid] * (num_workers - 1)
    # each worker holds its own pipes only, the launcher none: a death shows as EOF at once
    own = [{os.readlink(f"/proc/self/fd/{c.fileno()}") for c in (pool.task_conns[w], pool.result_conns[w])}
           for w in range(num_workers)]
    for wid, pid in enumerate(pids):
        assert own[wid] <= _pipes(pid)
        assert not _pipes(pid) & set().union(*(own[w] for w in range(num_workers) if w != wid))
    assert not _pipes(pool.launcher.pid) & set().union(*own)
    assert torch.equal(torch.cat(list(loader)), torch.arange(40.0) + 0.5)  # a second epoch, same workers
    assert [p.pid for p in pool.procs] == pids
