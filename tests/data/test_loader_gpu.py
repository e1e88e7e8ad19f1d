"""hotloop.DataLoader on a GPU: device batches equal torch's, Normalize equals torch's ops, no early reuse."""
import gc
import os

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop

from ..seeding import current_seed, seeded_generator
from .conftest import prefetch_threads, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:This DataLoader will create")]


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Images(Dataset):
    """uint8 HWC images with a random crop and flip drawn in the worker, a label, features, a name."""

    def __init__(self, n=48, size=40, crop=32):
        self.data = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8)
        self.feat = torch.randn(n, 5, dtype=torch.float64)
        self.size, self.crop = size, crop

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        top, left = torch.randint(0, self.size - self.crop + 1, (2,)).tolist()
        x = self.data[i, top:top + self.crop, left:left + self.crop]
        if torch.rand(()) < 0.5:
            x = x.flip(1)
        return x, i, {"feat": self.feat[i], "name": f"img{i}"}


def torch_batches(ds, **kw):
    torch.manual_seed(current_seed())
    return list(TorchDataLoader(ds, generator=seeded_generator(7), **kw))


def hotloop_batches(ds, **kw):
    torch.manual_seed(current_seed())
    return list(hotloop.DataLoader(ds, generator=seeded_generator(7), **kw))


def check_equal(cpu, dev, where):
    if isinstance(cpu, torch.Tensor):
        assert dev.device.type == "cuda", f"{where}: on {dev.device}"
        assert dev.dtype == cpu.dtype and dev.shape == cpu.shape, where
        assert torch.equal(dev.cpu(), cpu), f"{where}: values differ"
    elif isinstance(cpu, dict):
        assert list(cpu) == list(dev)
        for k in cpu:
            check_equal(cpu[k], dev[k], f"{where}[{k}]")
    elif isinstance(cpu, (list, tuple)):
        assert type(cpu) is type(dev) and len(cpu) == len(dev), where
        for i, (a, b) in enumerate(zip(cpu, dev, strict=True)):
            check_equal(a, b, f"{where}[{i}]")
    else:
        assert cpu == dev, where


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_device_batches_equal_cpu_batches(num_workers, prefetch_thread):
    ds = Images()
    ref = torch_batches(ds, batch_size=5, shuffle=True, num_workers=num_workers)
    got = hotloop_batches(ds, batch_size=5, shuffle=True, num_workers=num_workers, device="cuda",
                          prefetch_batches=3)
    assert len(got) == len(ref) == 10
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        check_equal(a, b, f"batch {k}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1, 3), (3, 17, 33, 3), (4, 224, 224, 3), (2, 9, 7, 1)])
def test_normalize_gpu_equals_torch_ops(dtype, channels_last, shape):
    c = shape[-1]
    mean, std = torch.rand(c).tolist(), (torch.rand(c) * 0.5 + 0.1).tolist()
    tf = hotloop.Normalize(mean, std, dtype=dtype, channels_last=channels_last)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    m = torch.tensor(mean, device="cuda") * 255
    s = torch.tensor(std, device="cuda") * 255
    ref = x.permute(0, 3, 1, 2).float().sub(m.view(1, c, 1, 1)).div(s.view(1, c, 1, 1)).to(dtype)
    out = tf(x)
    torch.cuda.synchronize()
    assert out.shape == ref.shape and out.dtype == dtype
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.contiguous().view(bits), ref.contiguous().view(bits)), "not bit-equal to torch's ops"
    assert torch.equal(out.cpu(), tf(x.cpu())), "GPU and C reference differ"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_normalize_gpu_unaligned_input_equals_torch_ops(dtype):
    # a view one byte into its storage: not 16-byte aligned, so the kernel takes its gather path
    shape = (2, 31, 29, 3)
    flat = torch.randint(0, 256, (torch.Size(shape).numel() + 1,), dtype=torch.uint8, device="cuda")
    x = flat[1:].view(shape)
    assert x.data_ptr() % 16 != 0
    mean, std = torch.rand(3).tolist(), (torch.rand(3) * 0.5 + 0.1).tolist()
    tf = hotloop.Normalize(mean, std, dtype=dtype, channels_last=True)
    m = torch.tensor(mean, device="cuda").view(1, 3, 1, 1) * 255
    s = torch.tensor(std, device="cuda").view(1, 3, 1, 1) * 255
    ref = x.permute(0, 3, 1, 2).float().sub(m).div(s).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(tf(x).contiguous().view(bits), ref.contiguous().view(bits))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_gpu_transform_in_loader(num_workers):
    ds = Images(n=30)
    tf = hotloop.Normalize(MEAN, STD, dtype=torch.float16, channels_last=True)
    ref = torch_batches(ds, batch_size=4, shuffle=True, num_workers=num_workers)
    got = hotloop_batches(ds, batch_size=4, shuffle=True, num_workers=num_workers, device="cuda", gpu_transform=tf)
    assert len(got) == len(ref)
    for (x, i, meta), (y, j, meta2) in zip(ref, got, strict=True):
        want = tf.reference(x.cuda())
        assert y.dtype == torch.float16 and y.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(y, want)
        assert torch.equal(i.cuda(), j) and meta["name"] == meta2["name"]


class Marked(Dataset):
    """Sample i is a 1 MB block filled with i: any early reuse of a slot or a device buffer shows."""

    def __init__(self, n=96, numel=1 << 18):
        self.n, self.numel = n, numel

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.numel,), i, dtype=torch.int32)


@pytest.mark.parametrize("prefetch_batches", [0, 2])
@pytest.mark.parametrize("normalize", [False, True])
def test_single_process_device_batches_equal_torch(prefetch_batches, normalize):
    """num_workers=0 with device=: the main process writes into its local ring, copies run on a side
    stream; every batch equals torch's DataLoader + .to(device) (+ the transform), epoch after epoch."""
    ds = Images(n=43)
    tf = hotloop.Normalize(MEAN, STD, dtype=torch.bfloat16) if normalize else None
    torch.manual_seed(current_seed())
    ref = list(TorchDataLoader(ds, batch_size=4, shuffle=True, generator=seeded_generator(7)))
    torch.manual_seed(current_seed())
    loader = hotloop.DataLoader(ds, batch_size=4, shuffle=True, generator=seeded_generator(7),
                                device="cuda", prefetch_batches=prefetch_batches, gpu_transform=tf)
    for epoch in range(2):
        got = list(loader)
        assert len(got) == len(ref) == 11
        for k, ((x, i, meta), (y, j, meta2)) in enumerate(zip(ref, got, strict=True)):
            if tf is not None:
                want = tf.reference(x.cuda())
                assert y.device.type == "cuda" and y.dtype == want.dtype and y.shape == want.shape
                assert torch.equal(y, want), f"epoch {epoch} batch {k}: x differs"
            else:
                check_equal(x, y, f"epoch {epoch} batch {k} x")
            check_equal(i, j, f"epoch {epoch} batch {k} i")
            check_equal(meta, meta2, f"epoch {epoch} batch {k} meta")
        torch.manual_seed(current_seed())
        loader.generator.manual_seed(current_seed() + 7)
    ring = loader._hl_local_ring.ring
    assert ring.registered  # the batches went through the page-locked ring
    st = loader.stats
    assert st.batches == 22 and st.samples == 86 and st.h2d_bytes > 0 and st.h2d_seconds > 0
    del loader, got
    gc.collect()
    assert ring.closed and not ring.registered  # the loader's end unregisters and unmaps it


def test_single_process_ring_is_page_locked_ahead_of_its_copies():
    """num_workers=0 with device=: the local ring's background threads page-lock a slot no copy has
    used yet (the training thread only registers what it copies from, and only if they have not)."""
    loader = hotloop.DataLoader(Images(n=40), batch_size=4, device="cuda", prefetch_batches=2)
    it = iter(loader)
    next(it)  # batch 0 handed out, 1 and 2 queued: three of the four slots copied from
    ring = loader._hl_local_ring.ring
    assert ring.nslots == 4
    wait_for(lambda: ring.registered == ring.nslots)
    assert len(list(it)) == 9
    del it, loader
    gc.collect()
    assert ring.closed and not ring.registered


class Growing(Dataset):
    """Samples that grow: later batches no longer fit the ring sized from the first one."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full(((i + 1) * 300,), i, dtype=torch.int32), torch.randn(3)  # batch 1 > batch 0's 8 kB slot


def _cat(samples):
    return torch.cat([a for a, _ in samples]), torch.stack([b for _, b in samples]), "tag"


@pytest.mark.parametrize("collate", ["default", "custom"])
def test_single_process_device_fallbacks(collate):
    """Batches that do not fit the local ring sized from the first one (custom collate, growing
    shapes) take the plain .to(device) path, a short last batch takes the ring; all equal torch's."""
    ds = Growing()
    kw = dict(batch_size=3, collate_fn=_cat) if collate == "custom" else dict(batch_size=3)
    if collate == "default":
        ds = Images(n=17)  # 17 = 5 * 3 + 2: a short last batch
    torch.manual_seed(current_seed())
    ref = list(TorchDataLoader(ds, **kw))
    torch.manual_seed(current_seed())
    got = list(hotloop.DataLoader(ds, device="cuda", prefetch_batches=2, **kw))
    assert len(got) == len(ref)
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        check_equal(a, b, f"batch {k}")


def read_each_batch_late(loader, side_stream):
    """Keep the consumer's stream busy before each batch of Marked() is read and drop the batch at
    once: its device memory goes back to the allocator while the read is still queued. Every batch
    must still read as it was made (no slot or device buffer reused too early)."""
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    copies = []
    with torch.cuda.stream(stream):
        for batch in loader:
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the read below can run
            copies.append(batch.sum(dtype=torch.int64, dim=1))
            del batch
    torch.cuda.synchronize()
    got = torch.cat(copies).cpu()
    want = torch.arange(96, dtype=torch.int64) * (1 << 18)
    assert torch.equal(got, want), f"early reuse: first bad batch {int((got != want).nonzero()[0]) // 2}"


@pytest.mark.parametrize("prefetch_batches", [0, 4])
@pytest.mark.parametrize("side_stream", [False, True])
def test_single_process_no_early_reuse(side_stream, prefetch_batches):
    """The reuse race below with num_workers=0: the main thread rewrites a slot of the local ring only
    once the copy out of it finished, and prefetch copies never overwrite device memory the
    consumer's queued reads still need."""
    loader = hotloop.DataLoader(Marked(), batch_size=2, device="cuda", prefetch_batches=prefetch_batches)
    read_each_batch_late(loader, side_stream)


@pytest.mark.parametrize("side_stream", [False, True])
def test_no_early_reuse_of_slots_or_device_buffers(side_stream, prefetch_thread):
    """timm #2781: the consumer's stream is kept busy (a sleep kernel) before each batch is read and
    the batch dropped at once, so its device memory returns to the allocator while the read is
    still queued; prefetch copies must not overwrite it, nor may workers overwrite a slot whose
    copy is still queued. With the prefetch thread, the copies are queued (and their device memory
    allocated) by that thread, whose current stream is not the consumer's side stream."""
    loader = hotloop.DataLoader(Marked(), batch_size=2, num_workers=2, prefetch_factor=1, device="cuda",
                                prefetch_batches=4)
    read_each_batch_late(loader, side_stream)


def test_stats_on_gpu():
    ds = Images(n=40, size=64, crop=64)
    loader = hotloop.DataLoader(ds, batch_size=8, num_workers=2, device="cuda")
    nbytes = 0
    for x, i, meta in loader:
        nbytes += x.numel() + i.numel() * 8 + meta["feat"].numel() * 8
    torch.cuda.synchronize()
    st = loader.stats
    assert st.batches == 5 and st.samples == 40
    assert st.ring_bytes > 0
    # the first batch of each worker comes through its pipe; the rest through the ring and the copies
    assert 0 < st.h2d_bytes <= nbytes and st.h2d_seconds > 0
    assert st.h2d_gbps > 0.05
    assert 0 <= st.stall_fraction <= 1


def test_cleanup_on_gpu():
    torch.zeros(1, device="cuda")  # the driver's own files are opened before the baseline
    fds = set(os.listdir("/proc/self/fd"))
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for _ in range(20):  # the drop used to race the prefetch thread's top-up: 1 run in 3 failed
        loader = hotloop.DataLoader(Images(), batch_size=4, num_workers=2, device="cuda")
        it = iter(loader)
        next(it), next(it), next(it)
        ring = it._pool.ring
        assert ring.registered
        del it
        assert ring.closed and not ring.registered  # at once, without a collection
        assert not prefetch_threads()
    left = {f for f in set(os.listdir("/proc/self/fd")) - fds if not _is_driver_fd(f)}
    assert not left, f"file descriptors left open: {[_describe(f) for f in left]}"
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) <= shm


def _describe(fd):
    try:
        return f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return fd


def _is_driver_fd(fd):
    # the CUDA driver may open more /dev/nvidia* files lazily (pinned memory); they are not the loader's
    return _describe(fd).split(" -> ")[-1].startswith("/dev/nvidia")



def test_pin_memory_batches_are_pinned_copies_not_views():
    """pin_memory=True: batches are copied into torch's pinned memory (a view of a slot could be read
    by a queued non_blocking copy after the slot went back to a worker); without it they are views."""
    ds = Images(n=20)
    torch.manual_seed(current_seed())
    ref = list(TorchDataLoader(ds, batch_size=4, num_workers=2, pin_memory=True))
    for pin in (True, False):
        torch.manual_seed(current_seed())
        loader = hotloop.DataLoader(ds, batch_size=4, num_workers=2, pin_memory=pin)
        # nothing of a batch is kept but copies: with pin=False each batch's slot comes back at once
        got = [(x.is_pinned(), x.cuda(non_blocking=True), i.clone(), meta["name"]) for x, i, meta in loader]
        torch.cuda.synchronize()
        assert len(got) == len(ref) == 5
        for (x, i, meta), (pinned, y, j, meta2) in zip(ref, got, strict=True):
            assert pinned == pin
            assert torch.equal(y.cpu(), x) and torch.equal(i, j) and meta["name"] == meta2
        assert loader.stats.view_batches == (0 if pin else 5)
