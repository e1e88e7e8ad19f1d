"""Benchmark rows for hotloop.DataLoader against torch's DataLoader on an ImageNet-like in-memory dataset.

The dataset holds uint8 256x256x3 images; __getitem__ draws a random 224 crop and a flip (in the
worker, with the worker's RNG). Batches of 256 arrive on the GPU as normalised float16
channels_last: torch's way is DataLoader(pin_memory=True), .to(device, non_blocking=True) and
torch's normalise ops; hotloop's is DataLoader(device=, gpu_transform=Normalize(...)). Figures:
loader alone (img/s), feeding a ResNet-50 AMP step (steady state and first 25 steps, as % of the
speed with the batch already on the GPU), host-to-device GB/s, ring bytes. Both ways alternate in
one run. On the CPU (or --quick) sizes shrink to seconds and the ResNet rows are skipped.
"""
import statistics
import time
import warnings

import torch
from torch.utils.data import Dataset

from .harness import Row

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class SyntheticImages(Dataset):
    """`base` distinct uint8 HWC images, indexed modulo base, random crop + horizontal flip."""

    def __init__(self, length, base=512, size=256, crop=224, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (base, size, size, 3), dtype=torch.uint8, generator=g)
        self.length, self.size, self.crop = length, size, crop

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        top, left = torch.randint(0, self.size - self.crop + 1, (2,)).tolist()
        x = self.data[i % len(self.data), top:top + self.crop, left:left + self.crop]
        if torch.rand(()) < 0.5:
            x = x.flip(1)
        return x, i % 1000


class _TorchWay:
    """torch's DataLoader + pinned copies + normalise on the GPU: what a training script does today."""

    def __init__(self, dataset, batch_size, workers, device):
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                                  pin_memory=device.type == "cuda", drop_last=True,
                                                  persistent_workers=False, prefetch_factor=2)
        self.device = device
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def __iter__(self):
        for x, y in self.loader:
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            x = x.permute(0, 3, 1, 2).float().sub(self.mean).div(self.std).half()
            yield x.contiguous(memory_format=torch.channels_last), y


def _hotloop_way(dataset, batch_size, workers, device):
    import hotloop

    tf = hotloop.Normalize(MEAN, STD, dtype=torch.float16, channels_last=True) if device.type == "cuda" else None
    return hotloop.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                              device=device if device.type == "cuda" else None, gpu_transform=tf)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loader_rate(make, batches, warmup, device):
    """img/s of iterating a fresh loader, after `warmup` batches (worker start-up excluded)."""
    it = iter(make())
    n = 0
    for _ in range(warmup):
        next(it)
    sync(device)
    t0 = time.perf_counter()
    for x, _y in it:
        n += x.shape[0]
        if n >= batches * x.shape[0]:
            break
    sync(device)
    rate = n / (time.perf_counter() - t0)
    del it
    return rate


def resnet_step(device):
    import torchvision

    model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def timed_steps(step, batches, first, steady, device):
    """(seconds of the first `first` steps counted from iterator creation, img/s over `steady` later steps)"""
    t_start = time.perf_counter()
    it = iter(batches)
    n = 0
    t_first = t_steady0 = None
    for k in range(first + steady):
        x, y = next(it)
        step(x, y)
        if k + 1 == first:
            sync(device)
            t_first = time.perf_counter() - t_start
            t_steady0 = time.perf_counter()
        elif k + 1 > first:
            n += x.shape[0]
    sync(device)
    rate = n / (time.perf_counter() - t_steady0)
    del it
    return t_first, rate


def rows(ctx):
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    device = ctx.device
    cuda = ctx.is_cuda
    quick = ctx.quick or not cuda
    if quick:
        size, crop, batch, base, worker_counts, batches, warmup = 40, 32, 16, 64, [2], 10, 2
    else:
        size, crop, batch, base, worker_counts, batches, warmup = 256, 224, 256, 512, [4, 12], 30, 4
    # the loader alone: long enough that the batches the workers made ahead during warm-up do not count
    alone_batches = batches * 4
    ds = SyntheticImages(batch * (alone_batches + warmup + 4), base=base, size=size, crop=crop)

    # 1. the loader alone
    for workers in worker_counts:
        ours, theirs = [], []
        for _ in range(1 if quick else 2):  # alternate, keep the better of each
            ours.append(loader_rate(lambda: _hotloop_way(ds, batch, workers, device), alone_batches, warmup, device))
            theirs.append(loader_rate(lambda: _TorchWay(ds, batch, workers, device), alone_batches, warmup, device))
        yield Row("loader", f"loader alone, {workers} workers, batch {batch}, {crop}px", max(ours), max(theirs),
                  "img/s", note="uint8 crop+flip in workers, normalised fp16 channels_last on the device"
                  if cuda else "CPU batches")

    # 4. CPU batches (no device=, no pin_memory): lent as views of their slot unless the consumer keeps many
    import hotloop

    cpu_loader = hotloop.DataLoader(SyntheticImages(batch * 8, base=base, size=size, crop=crop), batch_size=batch,
                                    num_workers=2, drop_last=True)
    for _ in cpu_loader:
        pass
    st = cpu_loader.stats
    yield Row("loader", "host copies per batch byte, CPU batches", 2 - st.view_batches / st.batches, 1, "copies",
              note=f"hotloop: worker -> ring, {st.view_batches}/{st.batches} batches lent as views of their slot; "
                   "torch: collate into shm, mapped by the main process")
    del cpu_loader

    # 3. host-to-device bandwidth on large batches, from the loader's own copy events
    if cuda:
        big = SyntheticImages(256 * 12, base=64, size=224, crop=224)
        loader = hotloop.DataLoader(big, batch_size=256, num_workers=4, device=device, drop_last=True,
                                    persistent_workers=True)
        for _ in loader:  # epoch 1: the ring is made, and page-locked in the background meanwhile
            pass
        st = loader.stats
        first_gbps, bytes0, seconds0 = st.h2d_gbps, st.h2d_bytes, st.h2d_seconds
        for _ in loader:  # epoch 2: the same ring, page-locked
            pass
        st = loader.stats
        second_gbps = (st.h2d_bytes - bytes0) / (st.h2d_seconds - seconds0) / 1e9
        pinned = torch.empty(256, 224, 224, 3, dtype=torch.uint8).pin_memory()
        dst = torch.empty_like(pinned, device=device)

        def torch_copy():
            dst.copy_(pinned, non_blocking=True)

        ms = statistics.median(ctx.time_ms(torch_copy) for _ in range(20))
        torch_gbps = pinned.numel() / (ms * 1e-3) / 1e9
        yield Row("loader", "host-to-device copy, 38.5 MB uint8 batches", second_gbps, torch_gbps, "GB/s",
                  note=f"hotloop: ring slots (pinned by cuMemHostRegister), timed by its copy events, second epoch "
                       f"(first: {first_gbps:.1f} GB/s while the ring was still being page-locked); "
                       f"torch: copy_ from a pin_memory() tensor; ring {st.ring_bytes / 2**20:.0f} MiB, page-locked "
                       f"in 8 MiB chunks by a background thread, {st.register_seconds * 1e3:.0f} ms of it on the "
                       "consumer's thread")
        yield Row("loader", "host copies per batch byte, device=", 1, 2, "copies",
                  note="hotloop: worker -> ring, DMA from the ring; torch: collate into shm, then pin thread copy")
        del loader

    # 2. feeding ResNet-50 AMP
    if not cuda:
        return
    try:
        step = resnet_step(device)
    except ImportError:
        return
    x0, y0 = next(iter(_TorchWay(ds, batch, 2, device)))
    steady = 2 * batches  # steps per way and worker count: fewer left the figure moving from run to run
    resident = [(x0, y0)] * (25 + steady)
    for _ in range(3):
        step(x0, y0)
    fed_ds = SyntheticImages(batch * (25 + steady + 4), base=base, size=size, crop=crop)
    for workers in (4, 8, 12, 14):
        # the GPU-resident reference next to the runs it is compared with: one taken minutes before can
        # differ from one taken now by more than the loaders differ, even come out below the fed runs
        t_first_res, rate_res = timed_steps(step, resident, 25, steady, device)
        res = {}
        for name, make in (("hotloop", lambda: _hotloop_way(fed_ds, batch, workers, device)),
                           ("torch", lambda: _TorchWay(fed_ds, batch, workers, device))):
            res[name] = timed_steps(step, make(), 25, steady, device)
        yield Row("loader", f"ResNet-50 AMP steady state, {workers} workers, % of GPU-resident",
                  100 * res["hotloop"][1] / rate_res, 100 * res["torch"][1] / rate_res, "%",
                  note=f"resident {rate_res:.0f} img/s, measured right before")
        yield Row("loader", f"ResNet-50 AMP first 25 steps, {workers} workers, % of GPU-resident",
                  100 * t_first_res / res["hotloop"][0], 100 * t_first_res / res["torch"][0], "%",
                  note="from iter() to step 25 done, worker start-up included")
