"""hotloop.DataLoader against torch's DataLoader on the CPU: same batches, faults, resume, cleanup."""
import gc
import os
import random
import signal
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, SubsetRandomSampler
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import get_worker_info

import hotloop
from hotloop import input_wait

from ..seeding import current_seed, seeded_generator
from .conftest import (Images, Mixed, alive, assert_same, both, fake_device, no_prefetch_thread_left, open_fds,
                       prefetch_threads, rss_kb, shm_files)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("kind", ["tuple", "dict", "nested"])
def test_same_batches_as_torch(num_workers, kind):
    seed = random.randrange(1 << 20)
    theirs, ours = both(Mixed(kind=kind, seed=seed), seed, batch_size=4, shuffle=True, num_workers=num_workers,
                        generator=True)
    assert len(ours) == len(theirs) == 6
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)


class Rows(Dataset):
    def __init__(self, n=37):
        self.data = torch.randint(0, 1 << 30, (n, 7), dtype=torch.int64)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], self.data[i, 0].item() % 5


class EvenOdd(torch.utils.data.Sampler):
    """A batch sampler of uneven batch sizes."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        idx = list(range(self.n))
        yield from (idx[i:i + 2 + (i % 3)] for i in range(0, self.n, 4))

    def __len__(self):
        return len(range(0, self.n, 4))


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("config", ["sampler", "batch_sampler", "drop_last", "no_batch", "collate_fn"])
def test_samplers_and_collation(num_workers, config):
    ds = Rows()
    kwargs = {"num_workers": num_workers}
    if config == "sampler":
        kwargs.update(batch_size=5, sampler=SubsetRandomSampler(list(range(3, 30)),
                                                               generator=seeded_generator(3)))
    elif config == "batch_sampler":
        kwargs.update(batch_sampler=EvenOdd(len(ds)))
    elif config == "drop_last":
        kwargs.update(batch_size=6, drop_last=True, shuffle=True, generator=True)
    elif config == "no_batch":
        kwargs.update(batch_size=None)
    else:
        kwargs.update(batch_size=4, collate_fn=pad_collate)
    if config == "sampler":  # the sampler holds its generator: one per loader
        theirs = list(TorchDataLoader(ds, **kwargs))
        kwargs["sampler"] = SubsetRandomSampler(list(range(3, 30)), generator=seeded_generator(3))
        ours = list(hotloop.DataLoader(ds, **kwargs))
    else:
        theirs, ours = both(ds, **kwargs)
    assert len(ours) == len(theirs) > 0
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)


def pad_collate(samples):
    rows = torch.stack([s[0] for s in samples])
    return {"rows": rows, "sum": rows.sum(1), "labels": [s[1] for s in samples], "n": len(samples)}


class Shards(IterableDataset):
    def __init__(self, n=29):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, self.n, nw):
            yield torch.full((2,), i) + torch.rand(2), f"s{i}"


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_iterable_dataset(num_workers):
    theirs, ours = both(Shards(), batch_size=3, num_workers=num_workers)
    assert len(ours) == len(theirs) > 0
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)


def test_in_order_false_and_persistent_workers():
    ds = Rows(40)
    theirs = list(TorchDataLoader(ds, batch_size=4, num_workers=2))
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, in_order=False, persistent_workers=True)
    for _ in range(3):
        ours = list(loader)
        key = lambda b: b[0][0, 0].item()  # noqa: E731
        assert sorted(map(key, ours)) == sorted(map(key, theirs))
        for a, b in zip(sorted(theirs, key=key), sorted(ours, key=key), strict=True):
            assert_same(a, b)
    pids = [p.pid for p in loader._hl_pool.procs]
    ring = loader._hl_pool.ring
    del loader
    gc.collect()
    assert not ring.closed  # the batches in `ours` are views of its slots
    del ours, a, b
    assert ring.closed
    for pid in pids:
        assert not alive(pid)


def test_persistent_workers_abandoned_epoch_then_full_epoch():
    ds = Rows(60)
    loader = hotloop.DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True, shuffle=True,
                                generator=seeded_generator())
    it = iter(loader)
    next(it), next(it)
    ref = TorchDataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True, shuffle=True,
                          generator=seeded_generator())
    ref_it = iter(ref)
    next(ref_it), next(ref_it)
    theirs = list(ref)
    ours = list(loader)  # second epoch, after the first was abandoned
    assert len(theirs) == 20
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)
    assert len(ours) == 20


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch(num_workers):
    ds = Mixed(n=41, kind="tuple")
    kwargs = dict(batch_size=4, shuffle=True, num_workers=num_workers)
    full = list(hotloop.DataLoader(ds, generator=seeded_generator(9), **kwargs))
    first = hotloop.DataLoader(ds, generator=seeded_generator(9), **kwargs)
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    del it
    assert state["batches_yielded"] == 4
    second = hotloop.DataLoader(ds, generator=seeded_generator(123), **kwargs)
    second.load_state_dict(state)
    rest = list(second)
    assert len(head) + len(rest) == len(full)
    for a, b in zip(full[4:], rest, strict=True):
        # worker-drawn noise depends on which batches a worker did; the indices do not
        assert_same(a[2], b[2])
        assert_same(a[4], b[4])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_after_a_finished_epoch_starts_the_next(num_workers):
    ds = Rows(30)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=num_workers)
    ref = hotloop.DataLoader(ds, generator=seeded_generator(5), **kwargs)
    list(ref)
    state = ref.state_dict()
    second_epoch = list(ref)
    other = hotloop.DataLoader(ds, generator=seeded_generator(77), **kwargs)
    other.load_state_dict(state)
    got = list(other)
    assert len(got) == len(second_epoch) == 8
    for a, b in zip(second_epoch, got, strict=True):
        assert_same(a, b)


class Counting(Dataset):
    """Sample i is i; the worker that first loads `victim` kills itself with SIGKILL (once per marker)."""

    def __init__(self, n, victim, marker, always=False):
        self.n, self.victim, self.marker, self.always = n, victim, marker, always

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.victim and (self.always or not os.path.exists(self.marker)):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i, i * 3]), i


@pytest.mark.parametrize("victim", [17, 2])  # 2: in a worker's first batch, before the ring exists
def test_worker_killed_every_sample_once(tmp_path, victim):
    ds = Counting(50, victim=victim, marker=str(tmp_path / "died"))
    loader = hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=3,
                                generator=seeded_generator(1))
    got = list(loader)
    ref = list(TorchDataLoader(Counting(50, -1, ""), batch_size=4, shuffle=True,
                               generator=seeded_generator(1)))
    for a, b in zip(ref, got, strict=True):
        assert_same(a, b)
    ids = torch.cat([b[1] for b in got]).tolist()
    assert sorted(ids) == list(range(50))
    assert os.path.exists(tmp_path / "died")
    assert loader.stats.worker_restarts == 1


def test_launcher_killed_every_sample_once():
    # workers 1.. are forked by a launcher process; if it dies they are replaced like dead workers
    ds = Counting(60, victim=-1, marker="")
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=3, shuffle=True, max_worker_restarts=1,
                                generator=seeded_generator(3))
    it = iter(loader)
    launcher = it._pool.launcher
    os.kill(launcher.pid, signal.SIGKILL)
    got = list(it)
    ref = list(TorchDataLoader(ds, batch_size=4, shuffle=True, generator=seeded_generator(3)))
    assert len(got) == len(ref) == 15
    for a, b in zip(ref, got, strict=True):
        assert_same(a, b)
    # one event, not two deaths: max_worker_restarts=1 is not used up by it (workers 1 and 2 were the
    # launcher's; worker 0 is forked by the main process and lives on)
    assert launcher.pid is None and launcher.lost and loader.stats.worker_restarts == 2


@pytest.mark.parametrize("by_launcher", [True, False])
def test_every_process_reaped(monkeypatch, by_launcher):
    import hotloop.data.consumer.processes as workers_module

    monkeypatch.setattr(workers_module, "USE_LAUNCHER", by_launcher)
    loader = hotloop.DataLoader(Rows(40), batch_size=4, num_workers=3)
    it = iter(loader)
    next(it)
    pool = it._pool
    pids = [p.pid for p in pool.procs]
    launcher = pool.launcher.pid if by_launcher else None
    assert (pool.launcher is not None) == by_launcher and len(set(pids)) == 3
    del it
    gc.collect()
    assert pool.closed and all(p is None for p in pool.procs)
    for pid in pids + ([launcher] if launcher else []):
        assert not alive(pid)
    if by_launcher:
        assert pool.launcher.pid is None  # reaped: no zombie left behind


def test_worker_dying_at_the_same_indices_again_raises(tmp_path):
    """A death may be external (the OOM killer): the worker is replaced. Its successor dying at the
    same indices is the dataset's doing: raised then, without using up max_worker_restarts."""
    ds = Counting(30, victim=5, marker=str(tmp_path / "died"), always=True)
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, max_worker_restarts=2)
    it = iter(loader)
    pool = it._pool
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed\. It was "
                                           r"worker 1, holding the indices \[\[4, 5, 6, 7\].*; a worker had died holding "
                                           r"\[\[4, 5, 6, 7\]"):
        list(it)
    assert loader.stats.worker_restarts == 1
    assert pool.closed and all(p is None for p in pool.procs)  # reaped at once, not at garbage collection
    with pytest.raises(RuntimeError, match="ended with an error"):
        next(it)


class Segfaulting(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 9:
            import ctypes
            import faulthandler

            faulthandler.disable()  # the crash is the test's: no "Fatal Python error" dump in the run's log
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return torch.tensor([i])


@pytest.mark.parametrize("num_workers", [1, 2])
def test_segfaulting_dataset_raises_as_torch_words_it(num_workers):
    """torch raises at once that the worker "is killed by signal: "; we replace the worker once (a
    death can be external) and raise when its successor dies at the same indices."""
    loader = hotloop.DataLoader(Segfaulting(), batch_size=2, num_workers=num_workers)
    # under AddressSanitizer (CI's second run) the worker reports the SEGV and exits with code 1
    how = (r"exited unexpectedly with exit code 1\." if "address" in hotloop.build_info()["sanitizers"]
           else r"is killed by signal: Segmentation fault\.")
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) " + how +
                                           r".*; a worker had died holding \[\[8, 9\]"):
        list(loader)
    assert loader.stats.worker_restarts == 1


class Faulty(Dataset):
    def __init__(self, bad=13):
        self.bad = bad

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return torch.ones(2) * i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exception_in_dataset(num_workers):
    loader = hotloop.DataLoader(Faulty(), batch_size=4, num_workers=num_workers)
    it = iter(loader)
    assert_same(next(it), torch.ones(4, 2) * torch.arange(4.0).view(4, 1))
    with pytest.raises(ValueError, match="bad sample 13") as info:
        list(it)
    if num_workers:
        text = str(info.value)
        assert "Original Traceback" in text and "dataset[13]" in text and "in __getitem__" in text


@pytest.mark.parametrize("bad", [0, 2, 5])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_exception_in_a_first_batch(num_workers, bad):
    # the first batches of each worker are made before the ring exists: a worker sends their layout
    # from their first sample, so a later sample can still fail after the ring was sized from it
    loader = hotloop.DataLoader(Faulty(bad), batch_size=4, num_workers=num_workers)
    it = iter(loader)
    if bad >= 4:
        assert_same(next(it), torch.ones(4, 2) * torch.arange(4.0).view(4, 1))
    with pytest.raises(ValueError, match=f"bad sample {bad}") as info:
        next(it)
    assert f"dataset[{bad}]" in str(info.value)
    good = hotloop.DataLoader(Faulty(-1), batch_size=4, num_workers=num_workers)
    assert_same(torch.cat(list(good)), torch.ones(20, 2) * torch.arange(20.0).view(20, 1))


class Opaque:
    """A sample default_collate rejects (as a PIL image without a transform)."""


@pytest.mark.parametrize("first", [True, False], ids=["first-batch", "later-batch"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_collate_error_is_raised_once_as_torch_raises_it(num_workers, first):
    """A batch default_collate rejects: torch raises the worker's TypeError; so must we, with its
    traceback, and no worker dies for it (the first batches are collated outside the ring)."""
    ds = [torch.ones(2) if first is False and i < 8 else Opaque() for i in range(16)]
    errors = []
    for cls in (TorchDataLoader, hotloop.DataLoader):
        loader = cls(ds, batch_size=2, num_workers=num_workers)
        it = iter(loader)
        if not first:
            for _ in range(4):
                next(it)
        with pytest.raises(TypeError) as info:
            next(it)
        errors.append(info.value)
        del it
    theirs, ours = (str(e) for e in errors)
    # "Caught TypeError in DataLoader worker process k" (ours may add the indices it was loading)
    assert ours.splitlines()[0].startswith(theirs.splitlines()[0].rstrip("."))
    assert ours.splitlines()[-1] == theirs.splitlines()[-1]  # default_collate's own message
    assert loader.stats.worker_restarts == 0


class Slow(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i >= 4:
            time.sleep(1.5)
        return i


def test_timeout_names_the_batch():
    loader = hotloop.DataLoader(Slow(), batch_size=4, num_workers=1, timeout=0.3)
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match=r"timed out after 0.3 seconds waiting for batch 1"):
        next(it)
    del it


class Ragged(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.arange(i % 3 + 1), {"blob": "x" * 70000 if i == 7 else "y"}


def test_ragged_and_large_side_objects():
    # ragged tensors: default_collate's own error, as torch raises it
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(hotloop.DataLoader(Ragged(), batch_size=4, num_workers=1))
    loader = hotloop.DataLoader(Ragged(), batch_size=4, num_workers=2, collate_fn=lambda s: s)
    ref = list(TorchDataLoader(Ragged(), batch_size=4, collate_fn=lambda s: s))
    got = list(loader)
    for a, b in zip(ref, got, strict=True):
        assert_same(a, b)
    # a 70 kB string: larger than the slot's metadata area, so it takes the pipe
    theirs, ours = both(BigStrings(), batch_size=3, num_workers=2)
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)


class BigStrings(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((5,), i), ("z" * 100000 if i in (4, 10) else "s") + str(i)


def test_layout_changes_take_the_side_path():
    ds = Growing()
    theirs, ours = both(ds, batch_size=2, num_workers=2, collate_fn=cat_collate)
    assert len(ours) == 6
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)


class Growing(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((i + 1,), i, dtype=torch.int32)


def cat_collate(samples):
    return torch.cat(samples), len(samples)


def test_worker_init_fn_and_spawn_context():
    ds = Rows(10)
    theirs = list(TorchDataLoader(ds, batch_size=5))
    ours = list(hotloop.DataLoader(ds, batch_size=5, num_workers=1, multiprocessing_context="spawn",
                                   worker_init_fn=_init))
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)


def _init(worker_id):
    assert get_worker_info().id == worker_id


def test_attributes_and_len():
    ds = Rows(30)
    loader = hotloop.DataLoader(ds, batch_size=4, drop_last=True, num_workers=2)
    ref = TorchDataLoader(ds, batch_size=4, drop_last=True, num_workers=2)
    assert isinstance(loader, TorchDataLoader)
    assert len(loader) == len(ref) == 7
    assert loader.dataset is ds and loader.batch_size == 4 and loader.drop_last
    assert type(loader.sampler) is type(ref.sampler) and type(loader.batch_sampler) is type(ref.batch_sampler)
    assert loader.prefetch_factor == ref.prefetch_factor == 2
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 3
    with pytest.raises(ValueError, match="prefetch_batches"):
        hotloop.DataLoader(ds, prefetch_batches=-1)
    with pytest.raises(TypeError, match="gpu_transform"):
        hotloop.DataLoader(ds, gpu_transform=lambda x: x)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_workers=2.0), TypeError, "expected num_workers to be an int"),
    (dict(num_workers=-1), ValueError, "num_workers option should be non-negative"),  # torch's words
    (dict(prefetch_batches=True), TypeError, "prefetch_batches"),
    (dict(prefetch_batches=1.5), TypeError, "prefetch_batches"),
    (dict(max_worker_restarts=None), TypeError, "max_worker_restarts"),
    (dict(max_worker_restarts=-2), ValueError, "max_worker_restarts"),
])
def test_bad_counts_are_refused_at_construction(kwargs, error, words):
    with pytest.raises(error, match=words):
        hotloop.DataLoader(Rows(8), **kwargs)


@pytest.mark.parametrize("persistent", [False, True])
def test_no_shm_files_fds_threads_and_rss_stable(persistent):
    ds = Images()
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
    list(loader)  # warm up: imports, allocator pools
    gc.collect()
    shm, fds, threads, rss = shm_files(), open_fds(), threading.active_count(), rss_kb()
    for _ in range(5):
        it = iter(loader)
        for k, (x, i) in enumerate(it):
            assert torch.equal(x, ds.data[i])
            if k == 2:
                assert shm_files() <= shm  # nothing appears while batches flow
        del it, x, i  # the last batch is a view of its epoch's ring: it keeps the ring open
    gc.collect()
    assert shm_files() <= shm
    assert threading.active_count() == threads
    if not persistent:
        assert set(open_fds()) <= set(fds)  # nothing of the loader left open
    assert rss_kb() - rss < 20 << 10  # kB: flat, not growing by epochs
    del loader
    gc.collect()
    assert set(open_fds()) <= set(fds)


def test_abandoned_epoch_reaps_workers_andopen_fds():
    ds = Images()
    fds = open_fds()
    loader = hotloop.DataLoader(ds, batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    pool = it._pool
    pids = [p.pid for p in pool.procs]
    ring_fd = pool.ring.fd
    assert os.readlink(f"/proc/self/fd/{ring_fd}").startswith("/memfd:hotloop-ring")
    del it
    gc.collect()
    assert pool.closed and pool.ring is None
    for pid in pids:
        assert not alive(pid)
    assert set(open_fds()) <= set(fds)  # nothing of the loader left open


def test_normalize_cpu_matches_torch():
    x = torch.randint(0, 256, (3, 7, 9, 3), dtype=torch.uint8)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for cl in (True, False):
            tf = hotloop.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), dtype=dtype, channels_last=cl)
            ref = x.permute(0, 3, 1, 2).float().sub(torch.tensor([0.485, 0.456, 0.406]).mul(255).view(1, 3, 1, 1))
            ref = ref.div(torch.tensor([0.229, 0.224, 0.225]).mul(255).view(1, 3, 1, 1)).to(dtype)
            got = tf(x)
            assert got.shape == (3, 3, 7, 9) and got.dtype == dtype
            assert got.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
            assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               ref.view(torch.int16 if dtype != torch.float32 else torch.int32))
            assert torch.equal(got, tf.reference(x))
    with pytest.raises(ValueError, match=r"image batch \[n, 3, h, w\] or \[n, h, w, 3\], got torch.uint8 of shape "
                                         r"\[2, 4, 4, 4\]"):
        tf(torch.zeros(2, 4, 4, 4, dtype=torch.uint8))  # no dim of 3 channels (float NCHW: tests/data/test_normalize.py)
    with pytest.raises(TypeError, match="dtype"):
        hotloop.Normalize((0.5,), (0.5,), dtype=torch.int32)


def test_gpu_transform_on_cpu_loader():
    ds = Images(n=10, size=16)
    tf = hotloop.Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), dtype=torch.bfloat16, channels_last=False)
    ref = list(TorchDataLoader(ds, batch_size=4))
    for nw in (0, 2):
        got = list(hotloop.DataLoader(ds, batch_size=4, num_workers=nw, gpu_transform=tf))
        for (x, i), (y, j) in zip(ref, got, strict=True):
            assert torch.equal(i, j)
            assert torch.equal(tf.reference(x), y) and y.dtype == torch.bfloat16 and y.shape == (len(i), 3, 16, 16)


def test_normalize_without_a_dtype_gives_float32_on_the_cpu():
    """A loop written for the GPU (Normalize's default dtype) runs on a CPU-only machine: float32
    batches that a float32 model takes without autocast (float16 ones made it fail)."""
    ds = Images(n=10, size=16)
    tf = hotloop.Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    ref = list(TorchDataLoader(ds, batch_size=4))
    for nw in (0, 2):
        got = list(hotloop.DataLoader(ds, batch_size=4, num_workers=nw, gpu_transform=tf))
        for (x, i), (y, j) in zip(ref, got, strict=True):
            assert torch.equal(i, j) and y.dtype == torch.float32
            assert torch.equal(tf.reference(x), y)
            assert torch.equal(y, x.permute(0, 3, 1, 2).float().sub(tf.mean_scaled.view(1, 3, 1, 1))
                               .div(tf.std_scaled.view(1, 3, 1, 1)))
            model(y)
    assert tf.output_dtype("cuda") == torch.float16


def test_stats_and_process_snapshot():
    before = input_wait.snapshot()
    loader = hotloop.DataLoader(Images(n=20, size=8), batch_size=4, num_workers=2)
    n = sum(1 for _ in loader)
    after = input_wait.snapshot()
    st = loader.stats
    assert n == 5 and st.batches == 5 and st.samples == 20
    assert after["batches"] - before["batches"] == 5 and after["samples"] - before["samples"] == 20
    assert after["wait_seconds"] > before["wait_seconds"]
    assert 0 < st.wait_seconds <= st.elapsed_seconds + 1e-6
    assert 0 <= st.stall_fraction <= 1
    assert st.ring_bytes >= 4 * 8 * 8 * 3 and st.worker_busy_seconds > 0


_EXIT_SCRIPT = r"""
import gc, os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore")
import torch
import hotloop

class Sleepy(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if i >= 8:
            time.sleep(0.1)
        return torch.full((4,), i)

loader = hotloop.DataLoader(Sleepy(), batch_size=4, num_workers=2)
fds = sorted(os.listdir("/proc/self/fd"))
it = iter(loader)
next(it)
print("pids", " ".join(str(p.pid) for p in it._pool.procs), flush=True)
if sys.argv[1] == "interrupt":
    # Ctrl-C as in a terminal, even where this test runs in a background job (which inherits SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        for _ in it:
            pass
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    time.sleep(0.1)  # let the timer thread end
    _ = None  # the last batch, if one came: a view of the ring, it would keep the ring's fd open
    del it
    gc.collect()
    print("fds", "same" if sorted(os.listdir("/proc/self/fd")) == fds else "differ", flush=True)
# "exit": leave with the iterator alive and workers busy
"""


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_interpreter_exit_and_ctrl_c_reap_workers(tmp_path, how):
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_EXIT_SCRIPT)
    shm = shm_files()
    out = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    pids = [int(p) for p in lines["pids"].split()]
    assert len(pids) == 2
    if how == "interrupt":
        assert "interrupted" in out.stdout and lines["fds"] == "same"
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    assert shm_files() <= shm


@pytest.mark.parametrize("num_workers,prefetch_batches,transform",
                         [(1, 0, False), (3, 2, True), (2, 3, False), (0, 0, False), (0, 2, True), (0, 3, False)])
def test_device_path_logic_with_fake_cuda(fake_cuda, prefetch_thread, num_workers, prefetch_batches, transform):
    ds = Images(n=42, size=12)
    ref = list(TorchDataLoader(ds, batch_size=4, shuffle=True, generator=seeded_generator(2)))
    fake = fake_cuda
    tf = hotloop.Normalize((0.4, 0.5, 0.6), (0.2, 0.3, 0.25), dtype=torch.float16) if transform else None
    loader = fake_device(hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=num_workers, gpu_transform=tf,
                                            generator=seeded_generator(2),
                                            prefetch_batches=prefetch_batches))
    for epoch in range(2):
        got = list(loader)
        assert len(got) == len(ref) == 11  # every batch, the last ones after the prefetch included
        for (x, i), (y, j) in zip(ref, got, strict=True):
            assert torch.equal(i, j)
            assert torch.equal(y, tf.reference(x) if tf else x)
        loader.generator.manual_seed(current_seed() + 2)  # the next epoch in the same order as `ref` again
    assert fake.copies == 2 * 11 and fake.waited >= 2 * 11 * 2  # copy stream and consumer stream both wait
    assert 0 < len(fake.registered) <= num_workers * 2 + prefetch_batches + 3
    st = loader.stats
    assert st.batches == 22 and st.h2d_bytes == 2 * sum(x.numel() + i.numel() * 8 for x, i in ref)


@pytest.mark.parametrize("prefetch_batches", [0, 2])
def test_single_process_device_resume_and_errors_with_fake_cuda(fake_cuda, prefetch_batches):
    """num_workers=0 with a device: batches made ahead do not move the resume point, and an error
    in a batch made ahead is raised when that batch is due, after the batches before it."""
    ds = Images(n=42, size=12)
    ref = list(TorchDataLoader(ds, batch_size=4, shuffle=True, generator=seeded_generator(3)))
    fake = fake_cuda

    def make(dataset):
        return fake_device(hotloop.DataLoader(dataset, batch_size=4, shuffle=True,
                                              generator=seeded_generator(3),
                                              prefetch_batches=prefetch_batches))

    loader = make(ds)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    assert state["batches_yielded"] == 4
    again = make(ds)
    again.load_state_dict(state)
    rest = list(again)
    assert len(first) + len(rest) == len(ref)
    for (x, i), (y, j) in zip(ref, first + rest, strict=True):
        assert torch.equal(i, j) and torch.equal(x, y)
    assert fake.copies == 11 + prefetch_batches and loader.stats.samples == 16  # made ahead: copied, not counted
    assert again.stats.samples == 42 - 16
    del it

    bad = FailsAt(ds, 21)  # in batch 5 of the sequential order
    got = []
    with pytest.raises(ValueError, match="sample 21"):
        for batch in _device_loader(bad, prefetch_batches):
            got.append(batch)
    assert len(got) == 5 and all(torch.equal(x, ds.data[4 * k:4 * k + 4]) for k, (x, _) in enumerate(got))


@pytest.mark.parametrize("prefetch_batches", [0, 2, 3])
def test_worker_error_made_ahead_is_raised_when_due_with_fake_cuda(fake_cuda, prefetch_thread, prefetch_batches):
    """With a device, batches are taken from the workers ahead of the one returned: an error among
    them is raised at its own batch's turn, after every batch before it, and the epoch goes on after
    it as torch's does."""
    ds = Images(n=42, size=12)
    bad = FailsAt(ds, 21)  # in batch 5
    loader = fake_device(hotloop.DataLoader(bad, batch_size=4, num_workers=2, prefetch_batches=prefetch_batches))
    it = iter(loader)
    got = []
    with pytest.raises(ValueError, match="sample 21"):
        while True:
            got.append(next(it))
            time.sleep(0.1)  # the workers finish the batches ahead, the failing one among them
    got += list(it)
    assert_sequential_batches(got, ds, lost=[5])


def assert_sequential_batches(got, ds, lost=()):
    """`got` holds every batch of 4 of the unshuffled Images(n=42) `ds`, in order, except the
    batches numbered in `lost`."""
    want = [k for k in range(11) if k not in lost]
    assert len(got) == len(want)
    for k, (x, i) in zip(want, got, strict=True):
        assert torch.equal(x, ds.data[4 * k:4 * k + 4]) and torch.equal(i, torch.arange(4 * k, min(4 * k + 4, 42)))


def test_prefetch_thread_queues_the_next_copies_while_the_consumer_works(fake_cuda):
    """next() hands out a batch whose copy is queued, and the copies of the batches after it are
    queued by the prefetch thread while the consumer works on it, not by the consumer's thread;
    the batches are torch's, and the thread ends with the epoch."""
    ds = Images(n=42, size=12)
    ref = list(TorchDataLoader(ds, batch_size=4, shuffle=True, generator=seeded_generator(5)))
    loader = fake_device(hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                             generator=seeded_generator(5)))
    got = []
    for batch in loader:
        got.append(batch)
        time.sleep(0.05)  # "the training step": the workers and the prefetch thread go on meanwhile
    assert len(got) == len(ref) == 11
    for (x, i), (y, j) in zip(ref, got, strict=True):
        assert torch.equal(x, y) and torch.equal(i, j)
    main = threading.main_thread()
    off_main = [t for t in fake_cuda.copy_threads if t is not main]
    assert len(fake_cuda.copy_threads) == 11
    assert len(off_main) >= 8  # all but the first and a late one or two
    assert all(t.name == "hotloop-prefetch" for t in off_main)
    assert no_prefetch_thread_left()


def test_dropping_the_iterator_during_a_top_up_shuts_down_at_once(fake_cuda, monkeypatch):
    """The consumer drops its iterator while the prefetch thread is in the middle of a top-up: the
    workers are gone and the thread has ended by the time `del it` returns, in the consumer's thread
    (when the thread held the iterator, its last reference was the thread's and the shutdown ran
    there, later: test_cleanup_on_gpu failed 1 run in 3)."""
    import hotloop.data.consumer.iterators as iterators

    real_prefetcher = iterators.Prefetcher
    in_top_up = threading.Event()

    def slow_top_ups(target, paced=False):  # whatever the prefetch thread drives, its top-ups take a while
        top_up = type(target).top_up

        def slow(self, *args, **kwargs):
            in_top_up.set()
            time.sleep(0.2)
            return top_up(self, *args, **kwargs)

        monkeypatch.setattr(type(target), "top_up", slow)
        return real_prefetcher(target, paced)

    monkeypatch.setattr(iterators, "Prefetcher", slow_top_ups)
    ds = Images(n=40, size=8)
    for _ in range(3):
        loader = fake_device(hotloop.DataLoader(ds, batch_size=4, num_workers=2))
        it = iter(loader)
        in_top_up.clear()
        x, i = next(it)
        assert torch.equal(x, ds.data[:4])
        pool = it._pool
        pids = [w.pid for w in it._workers]
        assert in_top_up.wait(5)
        del it
        assert pool.closed
        assert not prefetch_threads()
        for pid in pids:
            assert not alive(pid)


def test_prefetch_waits_for_slots_to_be_page_locked(fake_cuda):
    """A batch copied ahead whose slot the ring's background thread has not page-locked yet is not
    page-locked by the prefetch thread (that holds the driver lock the training thread's launches
    need): it is copied once its slot is, or when it is due, by next() itself."""
    ds = Images(n=42, size=12)
    fake_cuda.background_pins = False  # the background thread never gets there
    loader = fake_device(hotloop.DataLoader(ds, batch_size=4, num_workers=2))
    got = []
    for batch in loader:
        got.append(batch)
        time.sleep(0.05)
    assert_sequential_batches(got, ds)
    main = threading.main_thread()
    # every slot was page-locked by next() when its batch came due, none by the prefetch thread (which
    # copies ahead out of slots page-locked before)
    assert len(fake_cuda.register_threads) >= 3 and all(t is main for t in fake_cuda.register_threads)
    assert fake_cuda.copy_threads[:3] == [main] * 3
    assert no_prefetch_thread_left()


@pytest.mark.parametrize("persistent", [False, True])
def test_prefetch_thread_ends_with_an_abandoned_iterator(fake_cuda, persistent):
    ds = Images(n=42, size=12)
    loader = fake_device(hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                             persistent_workers=persistent))
    for epoch in range(2):
        it = iter(loader)
        for _ in range(3):
            next(it)
            time.sleep(0.05)
        assert len(prefetch_threads()) == 1  # a persistent loader's second epoch replaced the first's
        if not persistent:
            del it
            assert no_prefetch_thread_left()
    assert len(list(loader)) == 11
    assert no_prefetch_thread_left()  # a finished epoch ends it, persistent workers or not


def test_error_while_prefetching_is_raised_at_its_batch(fake_cuda, prefetch_thread):
    """A copy that fails while being queued ahead is raised by next() at its batch's turn, after the
    batches before it; the epoch goes on after it (the failed batch is lost, as any batch whose
    copy fails)."""
    ds = Images(n=42, size=12)
    fake_cuda.fail_copy = 5
    loader = fake_device(hotloop.DataLoader(ds, batch_size=4, num_workers=2))
    it = iter(loader)
    got = []
    with pytest.raises(RuntimeError, match="copy 5 failed"):
        while True:
            got.append(next(it))
            time.sleep(0.05)
    got += list(it)
    assert_sequential_batches(got, ds, lost=[4])


def test_state_dict_while_the_prefetch_thread_runs(fake_cuda):
    """state_dict() taken between next() calls while the prefetch thread takes batches ahead: the
    resumed loader yields exactly the rest, as torch's loader would have (random crops included)."""
    ds = RandomCrops()
    ref = list(TorchDataLoader(ds, batch_size=4, shuffle=True, num_workers=3,
                               generator=seeded_generator(7)))

    def make():
        return fake_device(hotloop.DataLoader(ds, batch_size=4, shuffle=True, num_workers=3,
                                               generator=seeded_generator(7)))

    loader = make()
    it = iter(loader)
    first = []
    for _ in range(5):
        first.append(next(it))
        time.sleep(0.05)
    state = loader.state_dict()
    del it
    again = make()
    again.load_state_dict(state)
    rest = list(again)
    assert len(first) + len(rest) == len(ref)
    for (x, i), (y, j) in zip(ref, first + rest, strict=True):
        assert torch.equal(x, y) and torch.equal(i, j)


class RandomCrops(Dataset):
    """Each sample draws from the worker's torch RNG: batches match torch's only with its streams."""

    def __init__(self, n=40):
        self.data = torch.randint(0, 256, (n, 10, 10, 3), dtype=torch.uint8)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        top, left = torch.randint(0, 3, (2,)).tolist()
        return self.data[i, top:top + 8, left:left + 8].contiguous(), i


def _device_loader(dataset, prefetch_batches):
    return fake_device(hotloop.DataLoader(dataset, batch_size=4, prefetch_batches=prefetch_batches))


class FailsAt(Dataset):
    def __init__(self, base, bad):
        self.base, self.bad = base, bad

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i}")
        return self.base[i]


class SlowFirst(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == 0:
            time.sleep(0.8)
        return i


def test_in_order_false_does_not_wait_for_a_slow_batch():
    got = [b.tolist() for b in hotloop.DataLoader(SlowFirst(), batch_size=4, num_workers=2, in_order=False)]
    assert got[0] != [0, 1, 2, 3]  # the slow batch came later, others went past it
    assert sorted(x for b in got for x in b) == list(range(24))
    ordered = [b.tolist() for b in hotloop.DataLoader(SlowFirst(), batch_size=4, num_workers=2)]
    assert ordered == [list(range(k, k + 4)) for k in range(0, 24, 4)]


def test_generic_like_torchs():
    """`-> DataLoader[X]` annotations work as with torch's class (torch's is Generic in the batch type)."""
    import typing

    alias = hotloop.DataLoader[typing.List[torch.Tensor]]
    assert typing.get_origin(alias) is hotloop.DataLoader
    assert typing.get_args(alias) == (typing.List[torch.Tensor],)
    assert issubclass(hotloop.DataLoader, TorchDataLoader)


def test_persistent_workers_end_with_their_loader():
    """torch's persistent workers are gone as soon as the loader is: no reference cycle may keep a
    pool (and its processes) alive until the cycle collector runs."""
    loader = hotloop.DataLoader(Images(n=16, size=8), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    assert len([b for b in it]) == 4
    pool = loader._hl_pool
    pids = [p.pid for p in pool.procs] + ([pool.launcher.pid] if pool.launcher is not None else [])
    gc.collect()
    gc.disable()
    try:
        del it, loader, pool
        assert not any(alive(pid) for pid in pids)
    finally:
        gc.enable()


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_listed_as_torch_lists_them(persistent):
    """it._workers, as torch's iterator has it (tools read it to see whether workers live): one
    handle per worker with pid, exitcode, is_alive and join, valid after the workers were reaped."""
    loader = hotloop.DataLoader(Images(n=24, size=8), batch_size=4, num_workers=3, persistent_workers=persistent)
    it = iter(loader)
    workers = it._workers
    assert len(workers) == 3 and len({w.pid for w in workers}) == 3
    assert all(w.is_alive() and alive(w.pid) and w.exitcode is None for w in workers)
    for i, _ in enumerate(it):
        if i == 2:
            break
    del it, loader, _
    for w in workers:
        w.join(5)
        assert not w.is_alive() and not alive(w.pid) and w.exitcode is not None
        w.terminate()  # as torch's tests do once their workers ended: nothing left to do
        w.kill()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("persistent", [False, True])
def test_datapipe_sharded_and_seeded_as_torch(persistent):
    """A DataPipe with a shuffle and a sharding_filter: each worker takes its shard (every item once,
    not once per worker) of one order all workers draw from the same shared seed, epoch by epoch as
    torch's workers do (the same global seed before an epoch gives the same order)."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    seeds = [random.randrange(1 << 30)] * 2 + [random.randrange(1 << 30)]
    runs = []
    for cls in (TorchDataLoader, hotloop.DataLoader):
        pipe = IterableWrapper(range(60)).shuffle(buffer_size=7).sharding_filter()
        loader = cls(pipe, batch_size=4, num_workers=3, persistent_workers=persistent)
        epochs = []
        for seed in seeds:
            torch.manual_seed(seed)
            epochs.append(torch.cat(list(loader)).tolist())
        runs.append(epochs)
    theirs, ours = runs
    assert ours == theirs
    assert all(sorted(e) == list(range(60)) for e in ours) and ours[0] == ours[1]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's half-made iterator's __del__
def test_prefetch_factor_0_is_refused_as_torch_refuses_it():
    """torch accepts prefetch_factor=0 when the loader is made and refuses it at iter(); it used to
    cap hotloop's tasks in flight at 0, ending every epoch after num_workers batches in silence."""
    for cls in (TorchDataLoader, hotloop.DataLoader):
        loader = cls(torch.arange(40), batch_size=4, num_workers=2, prefetch_factor=0)
        with pytest.raises(AssertionError, match="prefetch_factor must be greater than 0"):
            iter(loader)


def test_an_epoch_never_ends_short_in_silence():
    """Whatever stops tasks going out (here: the cap on tasks in flight forced to 0 mid-epoch), an
    epoch of a map-style dataset ends only once the sampler is exhausted; else it says so."""
    loader = hotloop.DataLoader(torch.arange(40), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    it._feed._prefetch_factor = 0  # a bug stand-in: no task goes out any more
    with pytest.raises(RuntimeError, match="sampler"):
        list(it)
