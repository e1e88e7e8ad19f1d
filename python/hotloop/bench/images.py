"""Benchmark rows for gpu_decode: an ImageFolder of JPEGs, RandomResizedCrop(224) + flip + normalise.

It writes its own JPEGs first (ImageNet-like: 400-640 x 300-480 px, quality 90, ~70 KB; smooth
content plus noise, so that they compress like photos), into a temporary folder that is removed at
the end; nothing is downloaded. Batches of 256 arrive on the GPU as normalised float16 channels_last.
torch's way is its DataLoader running the torchvision transform in 15 workers (pin_memory, then
.to(device) and a cast); hotloop's is the same dataset and transform with gpu_decode in 4 workers.
Figures: the kernel alone (image_kernel.py), the loader alone (img/s), feeding a ResNet-50 AMP step (% of the speed with the batch
already on the GPU, steady state and first 25 steps), CPU seconds per image of all processes,
the step's own slowdown with the decoder working beside it (flat out, and paced as training takes
batches; and the same step captured as one CUDA graph), the step's GPU time while the loader
feeds it, top-ups paced or not (prefetch.thread.TopUpPace), and each backend forced in turn.
"""
import contextlib
import itertools
import multiprocessing
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import numpy as np
import torch

from . import image_kernel
from .harness import Row
from .loader import resnet_step, sync, timed_steps
from .procfs import descendants, process_stats

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
LOADER_REPS = 3  # the loader-alone figures: runs of each loader, alternated
BESIDE_JOIN_S = 60  # a thread decoding beside the step ends within a batch of being stopped


def _write_jpegs(args):
    from PIL import Image

    root, first, count, seed = args
    rng = np.random.default_rng(seed)
    for i in range(first, first + count):
        h, w = int(rng.integers(300, 481)), int(rng.integers(400, 641))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        planes = [np.sin(x / rng.uniform(8, 60) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(8, 60) + rng.uniform(0, 6))
                  for _ in range(3)]
        img = np.stack(planes, -1) * 90 + 128 + rng.normal(0, 9, (h, w, 3))
        path = os.path.join(root, f"c{i % 10}", f"{i:06d}.jpg")
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=90)


def write_dataset(root, n):
    """n JPEGs in 10 class folders under root, written by all cores."""
    for c in range(10):
        os.makedirs(os.path.join(root, f"c{c}"), exist_ok=True)
    chunks = [(root, k, min(64, n - k), k) for k in range(0, n, 64)]
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(_write_jpegs, chunks)


def train_transform(size=224):
    import torchvision.transforms as T

    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


def image_folder(root, repeat, size=224):
    """The folder's ImageFolder, its sample list repeated (an epoch long enough to time)."""
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(root, transform=train_transform(size))
    ds.samples = ds.samples * repeat
    ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    return ds


class TorchWay:
    """torch's DataLoader with the transform in its workers, pinned, copied, cast to fp16 channels_last."""

    def __init__(self, dataset, batch_size, workers, device):
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                                  pin_memory=True, drop_last=True, prefetch_factor=2)
        self.device = device

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            x = x.to(self.device, non_blocking=True).to(torch.float16, memory_format=torch.channels_last)
            yield x, y.to(self.device, non_blocking=True)


def hotloop_way(dataset, batch_size, workers, device, backend="auto"):
    import hotloop

    return hotloop.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                              device=device, gpu_decode=hotloop.GpuDecode(backend=backend, dtype=torch.float16,
                                                                          channels_last=True))


def _tree_cpu_seconds():
    """user + system CPU seconds of this process and every live descendant (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats, me = process_stats(), os.getpid()
    return sum((int(stats[pid][11]) + int(stats[pid][12])) / tick for pid in [me] + descendants(stats, me))


def _rate_and_cpu(make, batches, warmup, device):
    """(img/s over `batches` batches after `warmup`, CPU seconds per image over the whole epoch).
    The CPU is counted from before the workers start to the epoch's last batch, over every image
    of the epoch: workers make batches ahead, so a window of batches would miss work done before it.
    It is read when the last batch arrives, while the workers live: both loaders end them once the
    epoch is over, and a dead worker's time is no longer in /proc."""
    cpu0 = _tree_cpu_seconds()
    loader = make()
    total = len(loader)
    n = timed = 0
    t0 = elapsed = cpu = None
    for x, _y in loader:
        n += 1
        if n == warmup:
            sync(device)
            t0 = time.perf_counter()
        elif n == warmup + batches:
            sync(device)
            elapsed = time.perf_counter() - t0
            timed = batches * x.shape[0]
        if n == total:
            sync(device)
            cpu = (_tree_cpu_seconds() - cpu0) / (n * x.shape[0])
    return timed / elapsed, cpu


def _step_ms(step, x, y, reps):
    """The step's median GPU ms on the one batch (x, y), `reps` times."""
    return _fed_step_ms(step, itertools.repeat((x, y)), 0, reps)


def _fed_step_ms(step, loader, warmup, reps):
    """The step's median GPU ms over `reps` batches of `loader` after `warmup`, each timed alone."""
    times = []
    it = iter(loader)
    for k in range(warmup + reps):
        x, y = next(it)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(x, y)
        end.record()
        end.synchronize()
        if k >= warmup:
            times.append(start.elapsed_time(end))
    del it
    return statistics.median(times)


@contextlib.contextmanager
def _paced_top_ups(paced):
    """gpu_decode's prefetch thread paced (the default) or not, for the loaders made inside."""
    from ..data.consumer.iterators import MultiProcessIter

    before, MultiProcessIter.paced_top_ups = MultiProcessIter.paced_top_ups, paced
    try:
        yield
    finally:
        MultiProcessIter.paced_top_ups = before


def _step_beside_decoder(step, x, y, make_loader, period):
    """(the step's median ms while a loader from make_loader() runs in another thread, taking one
    batch per `period` seconds (0: as fast as it makes them), None); (NaN, what hung) when that
    thread did not come back."""
    stop = threading.Event()

    def decode_beside():
        loader = make_loader()
        while not stop.is_set():
            t0, n = time.perf_counter(), 0
            for _ in loader:
                n += 1
                if stop.is_set():
                    break
                time.sleep(max(0.0, t0 + n * period - time.perf_counter()))

    thread = threading.Thread(target=decode_beside, daemon=True)
    thread.start()
    time.sleep(3)  # the decoder started and at its pace
    try:
        ms = _step_ms(step, x, y, 40)
    finally:
        stop.set()
        thread.join(BESIDE_JOIN_S)
    if thread.is_alive():  # a hung loader (it happened: README, gpu_decode) must not eat the bench's time limit
        return float("nan"), f"hung: the loader's thread did not come back within {BESIDE_JOIN_S} s of being stopped"
    return ms, None


def graphed_step(device, x, y):
    """A ResNet-50 AMP training step (forward, backward, SGD) captured as one CUDA graph on the batch
    (x, y), as torch.cuda.graphs documents whole-network capture; no GradScaler (torch's syncs to
    read found_inf). The step it returns replays the graph; its arguments are ignored."""
    import torchvision

    model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def eager():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    warm = torch.cuda.Stream(device)  # capture wants the lazy state (grads, momentum) made off the capture
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        for _ in range(3):
            eager()
    torch.cuda.current_stream(device).wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    return lambda _x, _y: graph.replay()


def rows(ctx):
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    device = ctx.device
    yield from image_kernel.rows(ctx)
    if not ctx.is_cuda:
        return  # the loader's figures are the GPU's: without one gpu_decode runs the kernel's C reference
    try:
        import torchvision  # noqa: F401  the pipeline being measured is torchvision's
    except ImportError:
        yield Row("images", "needs torchvision", float("nan"), float("nan"), "img/s")
        return
    quick = ctx.quick
    batch, files = (64, 640) if quick else (256, 5120)
    batches, warmup = (6, 2) if quick else (40, 6)
    torch_workers = min(15, max(1, (os.cpu_count() or 2) - 1))
    ours_workers = min(4, torch_workers)
    root = tempfile.mkdtemp(prefix="hotloop-bench-jpegs-")
    try:
        t0 = time.perf_counter()
        write_dataset(root, files)
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs]
        note_data = (f"{files} JPEGs written in {time.perf_counter() - t0:.0f} s, mean {np.mean(sizes) / 1e3:.0f} KB; "
                     f"batch {batch}, fp16 channels_last on the GPU")
        steady = 60  # ResNet-50 steps timed after the first 25
        # batches per epoch: the CPU figure counts a whole epoch; the ResNet-50 runs need 25 + steady
        epoch = max(batches + warmup + 8, 0 if quick else 25 + steady + 2)
        ds = image_folder(root, repeat=max(1, epoch * batch // files + 1))

        # 1 and 3: the loader alone, and what it costs the CPUs; alternated, medians of LOADER_REPS runs
        # each: one loader's rate moves widely from one run to the next
        runs = {"ours": [], "theirs": []}
        for _ in range(1 if quick else LOADER_REPS):
            runs["ours"].append(_rate_and_cpu(lambda: hotloop_way(ds, batch, ours_workers, device), batches, warmup,
                                              device))
            runs["theirs"].append(_rate_and_cpu(lambda: TorchWay(ds, batch, torch_workers, device), batches, warmup,
                                                device))
        ours, theirs = ((statistics.median(r for r, _ in v), statistics.median(c for _, c in v))
                        for v in runs.values())
        probe = hotloop_way(ds, batch, ours_workers, device)
        iter(probe)
        decoder = probe.stats.decoder
        del probe
        yield Row("images", f"loader alone, hotloop {ours_workers} workers vs torch {torch_workers}", ours[0], theirs[0],
                  "img/s", note=f"{note_data}; hotloop decoder: {decoder}; medians of {len(runs['ours'])} runs each, "
                  "alternated")
        yield Row("images", "CPU seconds per image, all processes", ours[1] * 1e3, theirs[1] * 1e3, "ms",
                  note="user+system time of the main process and its workers over the timed batches")

        # 5. each backend forced (a GPU without hardware JPEG decoders gets cuda or cpu), timed as above
        for backend in ("hardware", "cuda", "cpu"):
            workers = torch_workers if backend == "cpu" else ours_workers
            try:
                rate, cpu = _rate_and_cpu(lambda: hotloop_way(ds, batch, workers, device, backend), batches, warmup,
                                          device)
            except RuntimeError as exc:
                yield Row("images", f"loader alone, backend {backend}", float("nan"), theirs[0], "img/s",
                          note=f"not available: {exc}")
                continue
            yield Row("images", f"loader alone, backend {backend}, {workers} workers", rate, theirs[0], "img/s",
                      note=f"torch: {torch_workers} workers, CPU pipeline; CPU {cpu * 1e3:.3f} ms per image "
                      f"(torch {theirs[1] * 1e3:.3f})")
        if quick:
            return

        # 2 and 4: feeding a ResNet-50 AMP step, and the step's own cost with the decoder beside it.
        # A script makes its loader, then its model: the decoder opens meanwhile (data/image/decoder_opening.py)
        made_first = hotloop_way(ds, batch, ours_workers, device)
        try:
            step = resnet_step(device)
        except ImportError:
            return
        x0, y0 = next(iter(TorchWay(ds, batch, 2, device)))
        for _ in range(5):
            step(x0, y0)
        resident = [(x0, y0)] * (25 + steady)
        t_first_res, rate_res = timed_steps(step, resident, 25, steady, device)
        res = {"hotloop": timed_steps(step, hotloop_way(ds, batch, ours_workers, device), 25, steady, device),
               "torch": timed_steps(step, TorchWay(ds, batch, torch_workers, device), 25, steady, device)}
        yield Row("images", "ResNet-50 AMP steady state, % of GPU-resident", 100 * res["hotloop"][1] / rate_res,
                  100 * res["torch"][1] / rate_res, "%", note=f"resident {rate_res:.0f} img/s; hotloop "
                  f"{ours_workers} workers, torch {torch_workers}")
        with _paced_top_ups(False):
            unpaced = timed_steps(step, hotloop_way(ds, batch, ours_workers, device), 25, steady, device)
        yield Row("images", "ResNet-50 AMP steady state, top-ups not paced, % of GPU-resident",
                  100 * unpaced[1] / rate_res, 100 * res["torch"][1] / rate_res, "%",
                  note="the prefetch thread decoding as soon as next() returned (before prefetch.thread.TopUpPace)")
        yield Row("images", "ResNet-50 AMP first 25 steps, % of GPU-resident", 100 * t_first_res / res["hotloop"][0],
                  100 * t_first_res / res["torch"][0], "%", note="from iter() to step 25 done, worker start-up "
                  "included; both loaders made just before iter()")
        t_first_early = timed_steps(step, made_first, 25, steady, device)[0]
        del made_first
        yield Row("images", "ResNet-50 AMP first 25 steps, loader made before the model", 100 * t_first_res / t_first_early,
                  100 * t_first_res / res["torch"][0], "%", note="% of GPU-resident, from iter(); hotloop's decoder "
                  "opened while the model was built, as in a script; torch's loader does nothing before iter()")

        alone = _step_ms(step, x0, y0, 40)
        for label, paced in (("top-ups paced", True), ("top-ups not paced", False)):
            with _paced_top_ups(paced):
                fed = _fed_step_ms(step, hotloop_way(ds, batch, ours_workers, device), 10, 40)
            yield Row("images", f"ResNet-50 step fed by gpu_decode, {label}", fed, alone, "ms",
                      note="GPU ms of the step (events around it) while the loader feeds it, as in training; "
                      "torch: the step alone on a resident batch")
        make = lambda: hotloop_way(ds, batch, ours_workers, device)  # noqa: E731
        for label, period in (("flat out", 0.0), ("paced at one batch per step", alone / 1e3)):
            beside, hung = _step_beside_decoder(step, x0, y0, make, period)
            yield Row("images", f"ResNet-50 step with the decoder working beside it, {label}", beside, alone, "ms",
                      note=hung or f"hotloop: the loader {label} in another thread of the process (paced: as "
                      "training takes batches); torch: the step alone")
        graphed = graphed_step(device, x0, y0)
        graph_alone = _step_ms(graphed, x0, y0, 40)
        beside, hung = _step_beside_decoder(graphed, x0, y0, make, graph_alone / 1e3)
        yield Row("images", "ResNet-50 step as one CUDA graph, the decoder beside it, paced", beside, graph_alone, "ms",
                  note=hung or "forward, backward and SGD replayed as one graph (no scaler): the same GPU work "
                  "without the eager step's kernel-by-kernel launches, which the decoder thread's CUDA calls slow")
    finally:
        shutil.rmtree(root, ignore_errors=True)
