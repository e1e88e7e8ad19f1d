"""`python -m hotloop bench loop`: a whole training loop with hotloop's three pieces (DataLoader,
GradScaler, MemoryMonitor) against the same loop with torch's (DataLoader with pinned memory and a
copy, torch.amp.GradScaler, the seeds' reset/max_memory_allocated decorator); in the GPT cases the
hotloop side also steps hotloop.optim.AdamW where torch's steps torch.optim.AdamW(fused=True). Same
model, data, seed and steps, timed from the iterator's start, with where the time went. The -jpeg cases
read a folder of generated JPEGs through torchvision's RandomResizedCrop + flip + normalise: torch's
loader runs it in its workers, hotloop's with gpu_decode=True (images.py has the loader-only figures)."""
import json
import math
import os
import shutil
import tempfile
import time

from .workloads import BenchError, build

# case -> (model, batch size on a GPU, batch size on the CPU, clip the gradient norm, JPEG files)
CASES = {"resnet50": ("resnet50", 256, 8, False, False), "resnet50-jpeg": ("resnet50", 256, 8, False, True),
         "gpt2-medium": ("gpt2-medium", 8, 2, True, False), "tiny-cnn": ("tiny-cnn", 64, 16, False, False),
         "tiny-cnn-jpeg": ("tiny-cnn", 64, 16, False, True), "tiny-gpt": ("tiny-gpt", 16, 4, True, False)}
HOTLOOP_OPTIMIZER_MODELS = ("gpt2-medium", "tiny-gpt")  # the hotloop side steps hotloop.optim.AdamW
JPEG_FILES = 2560  # distinct files of a -jpeg case, fewer when the loop needs fewer; the epoch repeats them
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Samples:
    """A generated in-memory dataset: uint8 HWC images with labels, or token sequences (inputs, targets)
    shifted by one. A few hundred distinct samples, indexed round the length."""

    def __init__(self, workload, length, distinct=256):
        import torch

        g = torch.Generator().manual_seed(1234)
        self.length, self.kind = length, workload.kind
        if workload.kind == "image":
            c, h, w = workload.shape
            self.x = torch.randint(0, 256, (distinct, h, w, c), dtype=torch.uint8, generator=g)
            self.y = torch.randint(0, workload.classes, (distinct,), generator=g)
        else:
            tokens = torch.randint(0, workload.classes, (distinct, workload.shape[0] + 1), generator=g)
            self.x, self.y = tokens[:, :-1].clone(), tokens[:, 1:].clone()

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        i %= len(self.x)
        return self.x[i], self.y[i]


def _timers(torch, device):
    """(mark() -> token, seconds(a, b)): CUDA events on a GPU (the optimizer's device time between two
    points of the stream), the host clock on the CPU."""
    if device.type == "cuda":
        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return mark, lambda a, b: a.elapsed_time(b) / 1e3
    return time.perf_counter, lambda a, b: b - a


def _optimizer(name, side, params, cuda):
    """(the side's AdamW, its name for the table): hotloop.optim.AdamW on the hotloop side of the GPT
    cases, torch's (fused on a GPU) otherwise"""
    import torch

    import hotloop

    if side == "hotloop" and name in HOTLOOP_OPTIMIZER_MODELS:
        return hotloop.optim.AdamW(params, lr=1e-4), "hotloop.optim.AdamW"
    return torch.optim.AdamW(params, lr=1e-4, fused=cuda), "torch.optim.AdamW" + ("(fused=True)" if cuda else "")


def _batch_size(case, device):
    _, gpu_batch, cpu_batch, _, _ = CASES[case]
    return gpu_batch if device.type == "cuda" else cpu_batch


def _jpeg_loader(side, root, workload, batch, steps, workers, generator, device):
    """The -jpeg cases' loader: an ImageFolder of the files in root, long enough for `steps` batches."""
    import torch

    import hotloop

    from .images import image_folder

    files = sum(len(f) for _, _, f in os.walk(root))
    dataset = image_folder(root, repeat=math.ceil(steps * batch / files), size=workload.shape[1])
    cuda = device.type == "cuda"
    if side == "hotloop":
        decode = hotloop.GpuDecode(dtype=torch.float16 if cuda else torch.float32, channels_last=True)
        return hotloop.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, generator=generator,
                                  device=device if cuda else None, persistent_workers=False, gpu_decode=decode)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                       generator=generator, pin_memory=cuda)


def one_loop(case, side, device, steps, workers, jpeg_root=None):
    """Train `steps` steps of `case` with `side`'s pieces; the figures of that run. jpeg_root: the
    folder of JPEGs of a -jpeg case."""
    import torch

    import hotloop

    name, _, _, clip, jpeg = CASES[case]
    cuda = device.type == "cuda"
    batch = _batch_size(case, device)
    workload = build(name, device, seed=0)
    model = workload.model
    image = workload.kind == "image"
    if image:
        model.to(memory_format=torch.channels_last)
    amp_dtype = torch.float16 if cuda else torch.bfloat16
    optimizer, optimizer_name = _optimizer(name, side, model.parameters(), cuda)
    # the same warm-up for both sides: cuDNN's algorithm search and cuBLAS's set-up are not the loop's
    x, y = workload.batch(batch, device)
    for _ in range(2):
        with torch.autocast(device.type, dtype=amp_dtype):
            workload.loss(x.contiguous(memory_format=torch.channels_last) if image else x, y).backward()
    optimizer.zero_grad(set_to_none=True)
    del x, y
    generator = torch.Generator().manual_seed(0)
    if jpeg:
        loader = _jpeg_loader(side, jpeg_root, workload, batch, steps, workers, generator, device)
    elif side == "hotloop":
        loader = hotloop.DataLoader(Samples(workload, steps * batch), batch_size=batch, shuffle=True,
                                    num_workers=workers, generator=generator, device=device if cuda else None,
                                    persistent_workers=False,
                                    gpu_transform=hotloop.Normalize(MEAN, STD) if image else None)
    else:
        loader = torch.utils.data.DataLoader(Samples(workload, steps * batch), batch_size=batch, shuffle=True,
                                             num_workers=workers, generator=generator, pin_memory=cuda)
    if side == "hotloop":
        scaler = hotloop.GradScaler(device.type)
        monitor = hotloop.MemoryMonitor(device=device, report=None) if cuda else None
    else:
        scaler = torch.amp.GradScaler(device.type)
        monitor = None
        mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    mark, between = _timers(torch, device)
    optimizer_spans = []
    wait = 0.0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if monitor is not None:
        monitor.start()
    t0 = time.perf_counter()
    it = iter(loader)
    for _ in range(steps):
        t_wait = time.perf_counter()
        inputs, targets = next(it)
        wait += time.perf_counter() - t_wait
        if side == "torch":
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            if jpeg:  # normalised float32 NCHW from the transform: what gpu_decode hands out
                inputs = inputs.to(torch.float16 if cuda else torch.float32, memory_format=torch.channels_last)
            elif image:  # what hotloop.Normalize does in one kernel: HWC uint8 -> normalised channels_last
                dtype = torch.float16 if cuda else torch.float32
                inputs = ((inputs.permute(0, 3, 1, 2).float() - mean) / std).to(dtype)
                inputs = inputs.contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = workload.loss(inputs, targets)
        scaler.scale(loss).backward()
        start = mark()
        if clip and side == "hotloop":
            scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        elif clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer_spans.append((start, mark()))
    if cuda:
        torch.cuda.synchronize(device)
    total = time.perf_counter() - t0
    report = monitor.stop() if monitor is not None else None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    optimizer_s = sum(between(a, b) for a, b in optimizer_spans)
    figures = {"case": case, "loop": side, "optimizer": optimizer_name, "batch_size": batch, "steps": steps,
               "workers": workers, "total_s": total, "samples_per_s": batch * steps / total, "data_wait_s": wait,
               "optimizer_s": optimizer_s, "rest_s": max(0.0, total - wait - optimizer_s), "peak_gib": peak,
               "final_loss": float(loss.detach())}
    if side == "hotloop":
        figures["loader_stats_wait_s"] = loader.stats.wait_seconds
        if report is not None:
            figures["gpu_util_pct"] = report.util_mean
    del it, loader
    return figures


def _write_jpegs(case, device, steps):
    """A temporary folder of generated JPEGs for a -jpeg case (removed after its two loops)."""
    from .images import write_dataset

    try:
        import torchvision  # noqa: F401  the pipeline being timed is torchvision's
    except ImportError:
        raise BenchError(f"--case {case}: needs torchvision (pip install torchvision)") from None
    root = tempfile.mkdtemp(prefix="hotloop-bench-loop-jpegs-")
    write_dataset(root, min(JPEG_FILES, steps * _batch_size(case, device)))
    return root


def run(args, device):
    import torch

    cuda = device.type == "cuda"
    cases = args.case or (["resnet50", "resnet50-jpeg", "gpt2-medium"] if cuda else ["tiny-cnn", "tiny-gpt"])
    for case in cases:
        if case not in CASES:
            raise BenchError(f"--case: unknown case {case!r} (choose from {', '.join(CASES)})")
    steps = args.steps or (60 if cuda else 6)
    workers = args.workers if args.workers is not None else min(8, os.cpu_count() or 1)
    if workers < 0:
        raise BenchError(f"--workers: expected 0 or more, got {workers}")
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"hotloop bench loop on {device} ({name}), torch {torch.__version__}, {steps} steps, {workers} workers, "
          f"{'fp16' if cuda else 'bf16'} autocast; timed from iter(loader) to the last step's end", flush=True)
    results = []
    header = (f"{'case':<13} {'loop':<8} {'batch':>5} {'total s':>8} {'samples/s':>10} {'data wait s':>11} "
              f"{'optimizer s':>11} {'rest s':>7} {'peak GiB':>8}  optimizer")
    print(header)
    for case in cases:
        pair = {}
        jpeg_root = _write_jpegs(case, device, steps) if CASES[case][4] else None
        try:
            for side in ("torch", "hotloop"):
                f = pair[side] = one_loop(case, side, device, steps, workers, jpeg_root)
                results.append(f)
                peak = "-" if f["peak_gib"] is None else f"{f['peak_gib']:.2f}"
                print(f"{case:<13} {side:<8} {f['batch_size']:>5} {f['total_s']:>8.2f} {f['samples_per_s']:>10.1f} "
                      f"{f['data_wait_s']:>11.3f} {f['optimizer_s']:>11.3f} {f['rest_s']:>7.2f} {peak:>8}  "
                      f"{f['optimizer']}", flush=True)
                if cuda:
                    torch.cuda.empty_cache()
        finally:
            if jpeg_root is not None:
                shutil.rmtree(jpeg_root, ignore_errors=True)
        ratio = pair["hotloop"]["samples_per_s"] / pair["torch"]["samples_per_s"]
        print(f"{'':<13} hotloop ÷ torch: {ratio:.3f}x samples/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "device_name": name, "torch": torch.__version__, "runs": results}, f,
                      indent=2)
    return 0
