"""What the DataLoader tests share: a guard against hangs, the datasets several files use, the
comparison with torch's batches, process and file-descriptor probes, and fake CUDA for the device path."""
import collections
import gc
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import hotloop
from hotloop.bench.procfs import descendants, process_stats
from hotloop.data.ring.copies import CudaCalls, DeviceCopies

from ..seeding import current_seed


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def descendant_states():
    """One line per thread of every process below this one: where the kernel has it waiting (wchan)
    and in which system call (the first number of /proc/.../syscall: 202 futex, 0 read, 7 poll),
    so that a hang says whether a worker waits for a lock, a pipe or nothing."""
    stats = process_stats()
    found = descendants(stats, os.getpid())
    lines = []
    for pid in found:
        lines.append(f"process {pid} (parent {stats[pid][1]}): {_read(f'/proc/{pid}/cmdline').replace(chr(0), ' ')}")
        for tid in sorted(os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []):
            task = f"/proc/{pid}/task/{tid}"
            lines.append(f"  thread {tid} {_read(task + '/comm')}: wchan {_read(task + '/wchan')}, "
                         f"syscall {_read(task + '/syscall').split(' ')[0]}")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def hang_guard(request):
    """A loader that stops making progress fails its test instead of blocking the suite (after 60 s,
    or the test module's HANG_GUARD_S), saying where every process below this one waits."""
    seconds = getattr(request.module, "HANG_GUARD_S", 60)

    def on_alarm(signum, frame):
        raise TimeoutError(f"no result after {seconds} s (a hang in the loader?)\n{descendant_states()}")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


Point = collections.namedtuple("Point", ["a", "b"])


class Mixed(Dataset):
    """Samples of every kind default_collate handles, with random draws from torch, numpy and random."""

    def __init__(self, n=23, kind="tuple", seed=None):
        g = torch.Generator().manual_seed(current_seed() if seed is None else seed)
        self.base = torch.randn(n, 3, 5, generator=g)
        self.n, self.kind = n, kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.base[i] + torch.rand(3, 5)  # worker RNG: must match torch's seeding
        arr = np.random.rand(4).astype(np.float32) + i
        if self.kind == "tuple":
            return x, arr, i, float(i) / 3 + random.random(), f"name-{i}"
        if self.kind == "dict":
            return {"x": x, "meta": {"arr": arr, "id": i, "tags": [f"t{i}", b"b"]}, "flag": bool(i % 2),
                    "np": np.int16(i)}
        return Point(a=[x, (i, i * 2.5)], b={"s": str(i) * (i % 4 + 1), "y": torch.tensor(i, dtype=torch.int8)})


class Images(Dataset):
    """n random uint8 HWC images and their index."""

    def __init__(self, n=24, size=64):
        self.data = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


def draw_from_rngs(i, width=2):
    """Sample i with a draw from each global RNG a worker seeds: torch's, numpy's and random's (the
    resume tests' samples: a resumed epoch must repeat every draw)."""
    return (torch.tensor(i), torch.rand(width) + i, torch.from_numpy(np.random.rand(2)),
            torch.tensor(random.random(), dtype=torch.float64))


def assert_same(a, b, path="batch"):
    """Two batches equal in type, structure, dtype, shape and every value."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def both(dataset, seed=None, **kwargs):
    """(torch's batches, hotloop's batches) for the same arguments, generators and global seeds (the
    test's seed unless `seed` is given)."""
    seed = current_seed() if seed is None else seed
    out = []
    for cls in (TorchDataLoader, hotloop.DataLoader):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        kw = dict(kwargs)
        if "generator" in kw:
            kw["generator"] = torch.Generator().manual_seed(1234 + seed)
        out.append(list(cls(dataset, **kw)))
    return out


def shm_files():
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def open_fds():
    return sorted(os.listdir("/proc/self/fd"))


def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return 0


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition, seconds=20.0, what=None):
    """Poll condition() until true; after `seconds`, fail saying what was waited for and, where `what` is
    callable, what it returns then (the state that did not come)."""
    deadline = time.monotonic() + seconds
    while not condition():
        said = "" if what is None else f": {what() if callable(what) else what}"
        assert time.monotonic() < deadline, f"still not so after {seconds} s{said}"
        time.sleep(0.005)


class FakeCuda:
    """The device path run on the CPU: a CudaCalls whose copies are host memcpys and whose events
    complete at once, and what it was asked to do. It checks the path's logic (prefetch, slot reuse,
    end of epoch, transform), not the GPU's ordering (test_loader_gpu.py does)."""

    def __init__(self):
        self.recorded, self.waited, self.copies, self.registered = 0, 0, 0, set()
        self.copy_threads = []  # the thread that queued each copy
        self.fail_copy = None  # copy number (from 1) that raises
        self.background_pins = True  # whether ring slots count as page-locked by the ring's own thread
        self.register_threads = []  # the thread that page-locked each slot

    def calls(self):
        fake = self

        class Calls(CudaCalls):
            def new_stream(self):
                return 7

            def current_stream(self):
                return 7

            def record_stream(self, tensors):
                pass

            def event(self, timing):
                return 1

            def record(self, event, stream):
                fake.recorded += 1

            def wait(self, stream, event):
                fake.waited += 1

            def done(self, event):
                return True

            def synchronize(self, event):
                pass

            def elapsed_ms(self, start, end):
                return 0.5

            def destroy(self, event):
                pass

            def empty(self, shape, dtype):
                return torch.empty(shape, dtype=dtype)  # "device" memory is host memory here

            def run_transform(self, transform, src, mem, stream):
                transform.transform_leaf(src, mem)

            def populate(self, ring, order):
                ring.populate_all(order)  # the pages only: no CUDA to page-lock them for

            def register(self, ring, slot):
                new = slot not in fake.registered
                fake.registered.add(slot)
                if new:
                    fake.register_threads.append(threading.current_thread())
                return new

            def slot_pinned(self, ring, slot):
                return fake.background_pins or slot in fake.registered

            def copy(self, ring, slot, packed, stream):
                fake.copies += 1
                fake.copy_threads.append(threading.current_thread())
                if fake.copies == fake.fail_copy:
                    raise RuntimeError(f"copy {fake.copies} failed")
                ring.copy_out(slot, packed)

        return Calls


@pytest.fixture
def fake_cuda(monkeypatch):
    """The one seam: DeviceCopies makes its CUDA calls through this fake (with fake_device(loader))."""
    fake = FakeCuda()
    monkeypatch.setattr(DeviceCopies, "calls", fake.calls())
    yield fake
    # loaders made under the fake close under it too: a fake event handle given to the real CUDA
    # (a loader collected in a later test) crashes a GPU machine
    gc.collect()


def fake_device(loader):
    """The loader with the device that device="cuda" sets on a GPU machine: under fake_cuda its
    device path runs on the CPU."""
    import types

    loader.device = types.SimpleNamespace(type="cuda", index=0)
    return loader


@pytest.fixture(params=[True, False], ids=["prefetch-thread", "no-prefetch-thread"])
def prefetch_thread(request, monkeypatch):
    """Both ways of queueing copies ahead: in the prefetch thread, or in next() itself."""
    import hotloop.data.consumer.iterators as iterators

    monkeypatch.setattr(iterators.MultiProcessIter, "prefetch_thread", request.param)
    return request.param


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "hotloop-prefetch" and t.is_alive()]


def no_prefetch_thread_left(timeout=5.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return not prefetch_threads()


def open_with(monkeypatch, decoder):
    """Every gpu_decode loader made in the test opens `decoder` (a stand-in for nvjpeg's) as its
    hardware backend."""
    from hotloop.data.image.maker import ImageMaker

    def open_stand_in(self):
        self.backend, self.decoder = "hardware", decoder
        self.stats.decoder = self.description
        return self.backend

    monkeypatch.setattr(ImageMaker, "open", open_stand_in)
