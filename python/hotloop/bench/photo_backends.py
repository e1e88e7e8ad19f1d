"""Benchmark rows for JPEG training on a GPU without JPEG engines (GeForce cards such as the RTX 4090,
many workstation and cloud cards), measured on whatever GPU runs them by forcing gpu_decode's backends
one by one, in the user's loop (image_loop.plain_loop), alternated with torch's loader in one process:

- backend "cpu": the workers decode (with PIL, at a DCT scale where the crop allows) and ship pixels;
  the crop, resize, flip and normalisation run as one GPU kernel. auto takes it where nvjpeg does not
  open at all.
- backend "cuda": nvjpeg decodes on the SMs, beside the training step's kernels.
- backend "hybrid": nvjpeg's Huffman decoding on the main process's threads, the IDCT and colour on the
  SMs (NOTE [ Hybrid lanes ] in csrc/nvjpeg_hybrid.c). auto takes it where nvjpeg's hardware decoder
  cannot open.
- torch's loader with torchvision's transform in (cores - 1, at most 15) workers.
- backend "hybrid" with as many threads as the cores hotloop's workers leave (GpuDecode(threads=)),
  against its default of one per CPU: whether fewer threads take less from the main thread that
  feeds the step.
- backend "hardware": the engines, as a reference for what the cards that have them reach.

Rows: each loader alone (img/s and CPU ms per image of the process tree), then ResNet-18 fp32 and
ResNet-50 AMP fed by each of these backends and by torch's loader (steady img/s as % of the model's
speed on a resident batch, and epoch time).
On a GPU without engines the hardware rows are left out. --quick: 2,048 files, one round.
"""
import os

import torch

from .harness import Row
from .image_loop import (BATCH, TorchWay, alternated, epoch_settings, gpu_photo_rows, hotloop_way, loader_alone,
                         median, model_fed, photo_folder, train_transform, worker_counts)

COMPONENT = "photos-engines-off"
BACKENDS = ("cpu", "cuda", "hybrid")  # what a GPU without engines can run
FED_MODELS = (("resnet18", "fp32"), ("resnet50", "fp16"))


def engines_present(device) -> bool:
    """Whether nvjpeg's hardware decoder opens on `device` (False where nvjpeg or the engines are missing)."""
    from ..data.image.decoder_opening import open_decoder

    decoder, _ = open_decoder(device, "hardware", BATCH)
    if decoder is None:
        return False
    decoder.close()
    return True


@gpu_photo_rows(COMPONENT)
def rows(ctx):
    from torchvision.datasets import ImageFolder

    device = ctx.device
    files, warmup, steady, rounds = epoch_settings(ctx)
    torch_workers, ours_workers = worker_counts()
    counts = f"hotloop {ours_workers} workers, torch {torch_workers}"
    lanes = max(1, (os.cpu_count() or 2) - ours_workers)
    # (backend, GpuDecode's threads) by the name the rows give them: the engines-off ones, fed too
    settings = {b: (b, None) for b in BACKENDS}
    settings[f"hybrid {lanes} threads"] = ("hybrid", lanes)
    alone_settings = dict(settings, **({"hardware": ("hardware", None)} if engines_present(device) else {}))
    backends = tuple(alone_settings)
    with photo_folder(files) as (root, data):
        dataset = ImageFolder(root, transform=train_transform())

        def way(b, dtype):
            backend, threads = alone_settings[b]
            return hotloop_way(dataset, ours_workers, device, dtype, backend, threads=threads)

        ways = {b: lambda dtype, b=b: way(b, dtype) for b in backends}
        ways["torch"] = lambda dtype: TorchWay(dataset, torch_workers, device, dtype)
        runs = alternated(ways, lambda make: loader_alone(make(torch.float16), device, warmup, steady), rounds)
        ms_per_image = {name: median(r, "cpu_ms") for name, r in runs.items()}
        for b in backends:
            what = "the engines, for reference" if b == "hardware" else "engines off"
            yield Row(COMPONENT, f"loader alone, backend {b} ({what}), steady img/s", median(runs[b], "rate"),
                      median(runs["torch"], "rate"), "img/s",
                      note=f"{data}; {counts}; decoder {runs[b][0]['decoder']!r}; medians of {rounds}, alternated")
            yield Row(COMPONENT, f"loader alone, backend {b}, CPU ms per image, all processes", ms_per_image[b],
                      ms_per_image["torch"], "ms", note="user + system time of the main process and its workers "
                                                        "over the epoch")
        def fed_ways(dtype):
            ways = {b: lambda b=b: way(b, dtype) for b in settings}
            ways["torch"] = lambda: TorchWay(dataset, torch_workers, device, dtype)
            return ways

        for name, precision in FED_MODELS:
            resident, fed = model_fed(name, precision, dataset, device, warmup, steady, rounds, fed_ways)
            label = f"{name} {precision}"
            for b in settings:
                yield Row(COMPONENT, f"{label} fed, backend {b}, steady, % of resident",
                          100 * median(fed[b], "rate") / resident, 100 * median(fed["torch"], "rate") / resident,
                          "%", note=f"resident {resident:.0f} img/s; {counts}; plain loop, wall clock")
                yield Row(COMPONENT, f"{label} fed, backend {b}, epoch time", median(fed[b], "epoch_s"),
                          median(fed["torch"], "epoch_s"), "s",
                          note=f"{len(dataset) // BATCH} steps from iter() to the last one done")
