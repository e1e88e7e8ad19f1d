"""Benchmark rows for a validation pass over camera-sized photos (4000 x 3000, 4:2:0 JPEG: what a
user's own phone pictures are): torchvision's Resize(256) + CenterCrop(224) + ToTensor + Normalize,
torch's DataLoader in (cores - 1, at most 15) workers against hotloop.DataLoader(gpu_decode=...) in at
most 8, in the user's loop (image_loop.plain_loop with no step: a pass that only reads), alternated in
one process. Each of gpu_decode's backends is forced in turn: "hybrid" is what auto takes on a GPU
without JPEG engines; "cpu", the workers' decode at a DCT scale; "hardware", the engines, where the GPU
has them.

The figure is the whole pass's rate, from iter() to the last batch on the GPU (worker start
included, as a user's validation pass pays it), and the CPU ms per image of the process tree.
--quick: 96 files, one round.
"""
import os
import time

from . import photos
from .harness import Row
from .image_loop import (MEAN, STD, TorchWay, alternated, gpu_photo_rows, hotloop_way, loader_alone, median,
                         scratch_folder, worker_counts)
from .photo_backends import BACKENDS, engines_present

COMPONENT = "photos-12mp"
FILES = 512
BATCH = 32
ROUNDS = 2


def validation_transform():
    import torchvision.transforms as T

    return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])


@gpu_photo_rows(COMPONENT)
def rows(ctx):
    import torch
    from torchvision.datasets import ImageFolder

    device = ctx.device
    files, rounds = (96, 1) if ctx.quick else (FILES, ROUNDS)
    batches = files // BATCH
    warmup, steady = 1, batches - 2  # plain_loop's steady window; the figure here is the whole pass
    torch_workers, ours_workers = worker_counts()
    backends = BACKENDS + (("hardware",) if engines_present(device) else ())
    with scratch_folder("hotloop-bench-12mp-") as root:
        t0 = time.perf_counter()
        photos.write_large_photos(root, files)
        written = time.perf_counter() - t0
        megabytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs) / files / 1e6
        dataset = ImageFolder(root, transform=validation_transform())
        ways = {b: lambda b=b: hotloop_way(dataset, ours_workers, device, torch.float16, b, BATCH, False)
                for b in backends}
        ways["torch"] = lambda: TorchWay(dataset, torch_workers, device, torch.float16, BATCH, False)
        runs = alternated(ways, lambda make: loader_alone(make(), device, warmup, steady), rounds)
        pass_rate = {name: median(r, "images") / median(r, "epoch_s") for name, r in runs.items()}
        ms_per_image = {name: median(r, "cpu_ms") for name, r in runs.items()}
        for b in backends:
            yield Row(COMPONENT, f"validation pass, backend {b}, img/s", pass_rate[b], pass_rate["torch"], "img/s",
                      note=f"{files} files of 4000 x 3000, {megabytes:.1f} MB each, written in {written:.0f} s; "
                           f"batches of {BATCH}; hotloop {ours_workers} workers, torch {torch_workers}; decoder "
                           f"{runs[b][0]['decoder']!r}; medians of {rounds}, alternated")
            yield Row(COMPONENT, f"validation pass, backend {b}, CPU ms per image, all processes", ms_per_image[b],
                      ms_per_image["torch"], "ms", note="user + system time of the main process and its workers")
