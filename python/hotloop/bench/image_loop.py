"""Benchmark rows for JPEG training as a user runs it: `for x, y in loader: step(x, y)`, timed by the wall
clock, on distinct files made from real photographs (photos.py), torch's loader and hotloop's
gpu_decode alternated in one process.

Per model (ResNet-18 fp32, ResNet-50 fp16 AMP, ViT-B/16 with bf16 weights; batch 256, channels_last,
SGD with momentum): the model's speed with one batch already on the GPU (resident), then each loader
feeding it for a whole epoch, twice, alternated: the time to the first batch from iter(), the steady
img/s after WARMUP steps (as % of resident), and the epoch's time from iter() to its last step done.
Before the models: each loader alone (no step; the GPU's queued copies and decodes are waited for at
the ends of the timed window), and the CPU seconds per image of the main process and its workers over
that epoch; beside them gpu_decode with worker_decode=True, the workers decoding a share of the JPEGs
the GPU decoder would take (data/image/split.py). --quick: 2,048 files, 2 + 4 steps, one round (a smoke run).

torch's way is its DataLoader with torchvision's RandomResizedCrop(224) + flip + ToTensor + Normalize
in (cores - 1, at most 15) workers, pin_memory, then `.to(device)` and a cast to the model's dtype in
channels_last; hotloop's is the same dataset and transform with gpu_decode in at most 8 workers.
"""
import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch

from . import photos
from .harness import Row
from .loader import sync
from .procfs import descendants, process_stats

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FILES = 15_000
BATCH = 256
WARMUP = 15  # steps before the steady window: workers started, queues filled, cuDNN tuned
STEADY = 40  # steps timed
ROUNDS = 2  # epochs of each loader per model, alternated
MODELS = (("resnet18", "fp32"), ("resnet50", "fp16"), ("vit_b_16", "bf16"))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def train_transform(size=224):
    import torchvision.transforms as T

    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


class TorchWay:
    """torch's DataLoader, its transform in the workers, pinned, then copied and cast as a user's loop does."""

    def __init__(self, dataset, workers, device, dtype, batch_size=BATCH, shuffle=True):
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                                                  pin_memory=True, drop_last=True)
        self.device, self.dtype = device, dtype

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            x = x.to(self.device, non_blocking=True).to(self.dtype, memory_format=torch.channels_last)
            yield x, y.to(self.device, non_blocking=True)


def hotloop_way(dataset, workers, device, dtype, backend="auto", batch_size=BATCH, shuffle=True,
                worker_decode=False, threads=None):
    import hotloop

    return hotloop.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers, drop_last=True,
                              device=device, gpu_decode=hotloop.GpuDecode(backend=backend, dtype=dtype,
                                                                          channels_last=True,
                                                                          worker_decode=worker_decode,
                                                                          threads=threads))


def model_step(name, precision, device):
    """step(x, y): forward, cross-entropy, backward and an SGD step of torchvision's `name` at `precision`."""
    import torchvision

    model = getattr(torchvision.models, name)().to(device).to(memory_format=torch.channels_last)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16, enabled=precision == "fp16"):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def tree_cpu_seconds():
    """user + system CPU seconds of this process and every live descendant (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats, me = process_stats(), os.getpid()
    return sum((int(stats[pid][11]) + int(stats[pid][12])) / tick for pid in [me] + descendants(stats, me))


def plain_loop(step, loader, device, warmup=WARMUP, steady=STEADY):
    """One epoch of `for x, y in loader: step(x, y)`: {"first_s": iter() to the first batch, "rate": img/s
    over `steady` steps after `warmup`, "epoch_s": iter() to the last step done, "cpu_s": CPU seconds of
    the process tree over the epoch (read before the workers end), "images": images delivered, "batches": their
    batches, "cpu_ms": the CPU milliseconds per image}."""
    cpu0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    first = t1 = t2 = cpu = None
    n = images = timed_images = 0
    for x, y in loader:
        if first is None:
            first = time.perf_counter() - t0
        step(x, y)
        n += 1
        images += len(y)
        if warmup < n <= warmup + steady:
            timed_images += len(y)
        if n == warmup:
            sync(device)
            t1 = time.perf_counter()
        elif n == warmup + steady:
            sync(device)
            t2 = time.perf_counter()
        if n == len(loader):  # the last batch: CPU read while the workers still live
            sync(device)
            cpu = tree_cpu_seconds() - cpu0
    epoch = time.perf_counter() - t0
    if t2 is None:
        raise RuntimeError(f"an epoch of {n} batches is shorter than {warmup + steady} steps")
    return {"first_s": first, "rate": timed_images / (t2 - t1), "epoch_s": epoch, "cpu_s": cpu, "images": images,
            "batches": n, "cpu_ms": 1e3 * cpu / images}


def loader_alone(loader, device, warmup=WARMUP, steady=STEADY):
    """plain_loop with no step; for hotloop's loader also what its stats say of the epoch: "decoder",
    and its main process's ms per batch in the decoder's call ("decode_ms") and building the batch's
    decode and kernel tables ("staging_ms"), the share of the GPU decoder's JPEGs the workers
    decoded at the end ("worker_share"), and the share of the pixels and the images host threads beside
    the engines decoded ("lane_share", "lane_images"; nan and 0 without them)."""
    result = plain_loop(lambda x, y: None, loader, device, warmup, steady)
    stats = getattr(loader, "stats", None)
    if stats is not None:
        result["decoder"] = stats.decoder
        result["worker_share"] = stats.image_worker_share
        result["lane_share"] = stats.image_lane_share if stats.image_lane_share is not None else float("nan")
        result["lane_images"] = stats.images_on_lanes
        result["decode_ms"] = 1e3 * stats.image_decode_seconds / result["batches"]
        result["staging_ms"] = 1e3 * stats.image_staging_seconds / result["batches"]
    return result


def model_fed(name, precision, dataset, device, warmup, steady, rounds, ways):
    """(the model's img/s on a resident batch, {way: [plain_loop's results]}): torchvision's `name` at
    `precision` (model_step) fed by each loader of ways(dtype) ({way: a function that makes it}), alternated."""
    dtype = DTYPES[precision]
    step = model_step(name, precision, device)
    x, y = next(iter(TorchWay(dataset, 2, device, dtype)))
    resident = resident_rate(step, x, y, device, warmup, steady)
    del x, y
    fed = alternated(ways(dtype), lambda make: plain_loop(step, make(), device, warmup, steady), rounds)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the model's blocks, for the next model's
    return resident, fed


def resident_rate(step, x, y, device, warmup=WARMUP, steady=STEADY):
    """img/s of `step` on one batch already on the device."""
    for _ in range(warmup):
        step(x, y)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steady):
        step(x, y)
    sync(device)
    return steady * len(y) / (time.perf_counter() - t0)


def alternated(ways, measure, rounds=ROUNDS):
    """{name: [results]}: each way measured `rounds` times, the order flipped each round."""
    results = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            results[name].append(measure(ways[name]))
    return results


def median(results, key):
    return statistics.median(r[key] for r in results)


def worker_counts():
    """(torch's workers, hotloop's): the machine's cores less one, at most 15, and at most 8 of those."""
    torch_workers = min(15, max(1, (os.cpu_count() or 2) - 1))
    return torch_workers, min(8, torch_workers)


@contextlib.contextmanager
def scratch_folder(prefix):
    """A new temporary folder, removed at the end however the block ends."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def photo_folder(files):
    """(an ImageFolder root of `files` distinct photo files, a sentence describing them); removed at the end."""
    with scratch_folder("hotloop-bench-photos-") as root:
        t0 = time.perf_counter()
        made = photos.write_photo_dataset(root, files)
        yield root, (f"{made['files']} distinct files from real photographs written in {time.perf_counter() - t0:.0f} "
                     f"s: mean {made['mean_width']:.0f} x {made['mean_height']:.0f} px, "
                     f"{made['mean_bytes'] / 1e3:.0f} KB; {made['yuv444']} 4:4:4, {made['grey']} grey, "
                     f"{made['cmyk']} CMYK, {made['png']} PNG")


def gpu_photo_rows(component):
    """A component's rows(ctx) that run only on a GPU (gpu_decode's figures are the GPU's: none off
    one) and with torchvision (the pipeline measured is its own: a row that says so without it)."""
    def wrap(rows):
        @functools.wraps(rows)
        def gpu_rows(ctx):
            if not ctx.is_cuda:
                return
            try:
                import torchvision  # noqa: F401
            except ImportError:
                yield Row(component, "needs torchvision", float("nan"), float("nan"), "img/s")
                return
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            yield from rows(ctx)
        return gpu_rows
    return wrap


def epoch_settings(ctx):
    """(files, warmup steps, steady steps, rounds) of the photo rows: --quick's smoke sizes, or the full ones."""
    return (2_048, 2, 4, 1) if ctx.quick else (FILES, WARMUP, STEADY, ROUNDS)


@gpu_photo_rows("photos")
def rows(ctx):
    from torchvision.datasets import ImageFolder

    device = ctx.device
    files, warmup, steady, rounds = epoch_settings(ctx)
    torch_workers, ours_workers = worker_counts()
    with photo_folder(files) as (root, data):
        dataset = ImageFolder(root, transform=train_transform())
        counts = f"hotloop {ours_workers} workers, torch {torch_workers}"

        def alone(make):
            return loader_alone(make(torch.float16), device, warmup, steady)

        # host threads beside the engines: the cores hotloop's workers leave (GpuDecode(threads=))
        lanes = max(1, (os.cpu_count() or 2) - ours_workers)
        runs = alternated({"hotloop": lambda dtype: hotloop_way(dataset, ours_workers, device, dtype),
                           "beside": lambda dtype: hotloop_way(dataset, ours_workers, device, dtype, threads=lanes),
                           "torch": lambda dtype: TorchWay(dataset, torch_workers, device, dtype)}, alone, rounds)
        rate = median(runs["hotloop"], "rate")
        yield Row("photos", "loader alone, fp16 channels_last, steady img/s", rate, median(runs["torch"], "rate"),
                  "img/s", note=f"{data}; {counts}; decoder {runs['hotloop'][0]['decoder']!r}; medians of {rounds}, "
                                "alternated")
        beside = runs["beside"]
        yield Row("photos", f"loader alone, {lanes} host threads beside the GPU decoder, steady img/s",
                  median(beside, "rate"), median(runs["torch"], "rate"), "img/s",
                  note=f"{median(beside, 'rate') / rate:.2f}x the default (the GPU decoder alone), in the same "
                       f"alternation; decoder {beside[0]['decoder']!r}; the threads' share of the pixels at the end "
                       f"{median(beside, 'lane_share'):.3f}, {median(beside, 'lane_images'):.0f} images")
        yield Row("photos", "loader alone, CPU ms per image, all processes",
                  median(runs["hotloop"], "cpu_ms"), median(runs["torch"], "cpu_ms"), "ms",
                  note="user + system time of the main process and its workers over the epoch")
        # hotloop's alone: a diagnosis of its own rate, with no torch figure to set beside it
        batch_ms = 1e3 * BATCH / median(runs["hotloop"], "rate")
        for key, what, field in (("decode_ms", "in the decoder's call", "image_decode_seconds"),
                                 ("staging_ms", "building its decode and kernel tables", "image_staging_seconds")):
            yield Row("photos", f"loader alone, hotloop's ms per batch {what} (diagnosis)",
                      median(runs["hotloop"], key), float("nan"), "ms",
                      note=f"loader.stats.{field} over the epoch, per batch; a batch takes {batch_ms:.1f} ms at "
                           "the steady rate")
        for name, precision in MODELS:
            resident, fed = model_fed(name, precision, dataset, device, warmup, steady, rounds, lambda dtype: {
                "hotloop": lambda: hotloop_way(dataset, ours_workers, device, dtype),
                "beside": lambda: hotloop_way(dataset, ours_workers, device, dtype, threads=lanes),
                "torch": lambda: TorchWay(dataset, torch_workers, device, dtype)})
            label = f"{name} {precision}"
            yield Row("photos", f"{label} fed, {lanes} host threads beside the GPU decoder, steady, % of resident",
                      100 * median(fed["beside"], "rate") / resident, 100 * median(fed["torch"], "rate") / resident,
                      "%", note=f"{median(fed['beside'], 'rate') / median(fed['hotloop'], 'rate'):.3f}x the default's "
                                "rate, in the same alternation")
            yield Row("photos", f"{label} fed, steady, % of resident", 100 * median(fed["hotloop"], "rate") / resident,
                      100 * median(fed["torch"], "rate") / resident, "%",
                      note=f"resident {resident:.0f} img/s; {counts}; plain loop, wall clock")
            yield Row("photos", f"{label} fed, time to first batch", median(fed["hotloop"], "first_s"),
                      median(fed["torch"], "first_s"), "s", note="from iter(), workers started there in both")
            yield Row("photos", f"{label} fed, epoch time", median(fed["hotloop"], "epoch_s"),
                      median(fed["torch"], "epoch_s"), "s",
                      note=f"{len(dataset) // BATCH} steps from iter() to the last one done")
