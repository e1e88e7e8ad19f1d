"""`python -m hotloop demo`: hotloop at work in one minute, on any machine. A small CNN learns a
generated image dataset (nothing downloaded) from the same seed with hotloop's pieces (DataLoader with
its device copies and Normalize, GradScaler on CUDA, hotloop.optim's AdamW step on the CPU,
@memory_monitor) and with torch's (DataLoader with pin_memory, normalising ops, torch.amp.GradScaler,
torch.optim.AdamW). It prints the monitor's report, the loader's and the scaler's figures, the two
loops side by side (medians of alternated rounds) and a verdict that says whether the rounds agree. On a
GPU the JPEG round follows (demo_photos.py), where the loader is what a GPU user waits for.

NOTE [ The demo's timing ]: one loop of each, timed once, gave a verdict that changed from run to run
on a CPU. What it measured besides the loaders: the first loop (hotloop's) paid the process's
first-use costs (the thread pool, oneDNN's kernels, the allocator's first blocks; on a GPU NVRTC's
compile too), and only hotloop's loop ran under the memory monitor, whose sampler takes CPU time the
loop competes for; and a loop of a second on a busy machine moves by more than the loaders differ.
So the monitored hotloop loop runs first and is not timed (it pays the first-use costs), then each
round times both loops, the order flipped each round; the summary shows medians, and calls a
difference only where every round of one way beat every round of the other."""
import math
import sys
import time

from .. import _C, cuda_available
from . import demo_photos
from .rounds import print_table, verdict_line

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
CLASSES = 10


def add_arguments(parser):

    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when usable)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per loop (default: 60 on the CPU, "
                                                                 "200 on a GPU)")
    parser.add_argument("--batch-size", type=int, default=None, help="images per step (default: 64 on the CPU, "
                                                                      "256 on a GPU)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each one loop of torch's way and one of "
                                                             "hotloop's (default 3; a verdict needs 3 or more)")
    parser.add_argument("--photos", type=int, default=demo_photos.FILES,
                        help="on a GPU, then a JPEG round: ResNet-50 fed from a folder of this many photo files it "
                             "writes, torch's ImageFolder pipeline against gpu_decode=True (default "
                             f"{demo_photos.FILES}; 0 or --no-photos: none; at least {demo_photos.LEAST_FILES})")
    parser.add_argument("--no-photos", dest="photos", action="store_const", const=0, help="no JPEG round")


def main(args) -> int:
    import torch


    device = _device_or_none(args.device, torch)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (200 if cuda else 60)
    batch_size = args.batch_size if args.batch_size is not None else (256 if cuda else 64)
    for name, value, least in (("--steps", steps, 1), ("--batch-size", batch_size, 1), ("--workers", args.workers, 0),
                               ("--rounds", args.rounds, 1)):
        if value < least:
            print(f"hotloop demo: {name}: expected a number >= {least}, got {value}", file=sys.stderr)
            return 2
    if 0 < args.photos < demo_photos.LEAST_FILES:
        print(f"hotloop demo: --photos: expected 0 or a number >= {demo_photos.LEAST_FILES}, got {args.photos}",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if cuda else "the CPU"
    print(f"hotloop demo: a small CNN learns {steps} steps of {batch_size} generated 32x32 images on {name}, "
          f"{args.workers} workers, {'float16 autocast' if cuda else 'float32'}, the same seed every loop: hotloop "
          f"once under its memory monitor (not timed), then {args.rounds} rounds of torch's way and hotloop's, "
          "alternating", flush=True)
    dataset = GeneratedImages(steps * batch_size)
    if cuda:
        _warm_up(device, batch_size)  # CUDA's and cuDNN's first-use costs, paid by neither loop
    # NOTE [ The demo's timing ]: the monitored loop pays the first-use costs; the timed rounds run unmonitored
    shown = _hotloop_run(dataset, device, steps, batch_size, args.workers, "hotloop", monitor=True)
    timed = []  # in the order run
    for r in range(args.rounds):
        for way in ((_torch_run, _hotloop_run) if r % 2 == 0 else (_hotloop_run, _torch_run)):
            label = f"{'hotloop' if way is _hotloop_run else 'torch'} {r + 1}/{args.rounds}"
            timed.append(way(dataset, device, steps, batch_size, args.workers, label))
    _print_summary(shown, timed, cuda)
    if cuda and args.photos:
        return demo_photos.run(device, args.photos, args.rounds)
    return 0


def _device_or_none(spec, torch):
    """The torch.device to run on, or None after saying why it cannot be used."""
    gpu = cuda_available() and torch.cuda.is_available()
    spec = spec or ("cuda" if gpu else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        print(f"hotloop demo: --device: expected cpu, cuda or cuda:N, got {spec!r}", file=sys.stderr)
        return None
    if device.type == "cuda":
        if not gpu:
            reason = _C.cuda_unavailable_reason() or "torch sees no CUDA device"
            print(f"hotloop demo: --device {spec}: no usable GPU here ({reason})", file=sys.stderr)
            return None
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return device


class GeneratedImages:
    """uint8 32x32 RGB images and labels, made per sample from its index: each class a colour and a
    stripe direction under noise, so that the CNN has something to learn within a minute; a random
    flip (from the worker's torch generator, as a transform would draw it) is the per-sample work."""

    def __init__(self, n, size=32):
        import torch

        self.n, self.size = n, size
        g = torch.Generator().manual_seed(1234)
        self.colours = torch.randint(40, 216, (CLASSES, 3), generator=g, dtype=torch.int16)
        ramp = torch.arange(size, dtype=torch.int16) % 8 * 6
        self.stripes = [ramp.view(1, -1, 1).expand(size, size, 1), ramp.view(-1, 1, 1).expand(size, size, 1)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        label = i * 7 % CLASSES
        g = torch.Generator().manual_seed(i)
        noise = torch.randint(-30, 31, (self.size, self.size, 3), generator=g, dtype=torch.int16)
        image = (self.colours[label] + self.stripes[label % 2] + noise).clamp_(0, 255).to(torch.uint8)
        if torch.rand(()) < 0.5:
            image = image.flip(1)
        return image, label


def _model(device, hotloop_optim=False):
    """The CNN, the same weights every time, and its AdamW: hotloop.optim's (on the CPU) or torch's (fused
    on CUDA, where hotloop's GradScaler hands it grad_scale and found_inf)."""
    import torch
    from torch import nn

    import hotloop

    torch.manual_seed(0)  # the same weights for every loop
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, CLASSES))
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if hotloop_optim:
        return model, hotloop.optim.AdamW(model.parameters(), lr=3e-3)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=device.type == "cuda")


def _warm_up(device, batch_size):
    """A few steps of a throwaway copy of the model on random data: the CUDA context, cuDNN's
    choice of kernels and the allocator's first blocks would otherwise be counted in the first loop."""
    import torch

    model, optimizer = _model(device)
    images = torch.randn(batch_size, 3, 32, 32, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, CLASSES, (batch_size,), device=device)
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(images.half()), labels)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize(device)


class _Run:
    """What one loop did: losses per step, seconds, seconds inside next()."""

    def __init__(self, way, label):
        self.way = way  # "hotloop" or "torch"
        self.label = label
        self.losses = []
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.samples = 0
        self.extra = []  # (name, value) lines shown under the table


def _train(run, loader, model, optimizer, scaler, device, steps, prepare):
    """The loop both ways share: `prepare(batch)` is what differs (hotloop's batch is ready). The
    workers' start-up is timed, as an epoch pays it."""
    import torch

    cuda = device.type == "cuda"
    loss_fn = torch.nn.CrossEntropyLoss()
    progress = _Progress(run.label, steps)
    losses = []
    t0 = time.perf_counter()
    it = iter(loader)
    for _ in range(steps):
        t = time.perf_counter()
        images, labels = prepare(next(it))
        run.wait_seconds += time.perf_counter() - t
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
            loss = loss_fn(model(images), labels)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        losses.append(loss.detach())
        run.samples += labels.shape[0]
        progress.step(losses)
    if cuda:
        torch.cuda.synchronize(device)
    run.seconds = time.perf_counter() - t0
    run.losses = [float(x) for x in losses]
    progress.done(run)
    del it


def _hotloop_run(dataset, device, steps, batch_size, workers, label, monitor=False):
    import torch

    import hotloop

    run = _Run("hotloop", label)
    cuda = device.type == "cuda"
    model, optimizer = _model(device, hotloop_optim=not cuda)
    loader = hotloop.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                                generator=torch.Generator().manual_seed(5), device=device if cuda else None,
                                gpu_transform=hotloop.Normalize(MEAN, STD))
    scaler = hotloop.GradScaler(device) if cuda else None

    def prepare(batch):
        return batch  # on the device, normalised, channels_last: nothing left to do

    def train():
        _train(run, loader, model, optimizer, scaler, device, steps, prepare)

    if monitor:  # (model= would add per-module hooks: their cost shows in a model this small)
        train = hotloop.memory_monitor(train)
    train()
    st = loader.stats
    run.wait_seconds = st.wait_seconds  # the loader's own count: the same span, measured inside next()
    run.extra.append(("loader", f"{st.batches} batches, waited {st.wait_seconds:.2f} s "
                                f"({st.stall_fraction:.0%} of the loop), workers busy {st.worker_busy_seconds:.2f} s, "
                                f"ring {st.ring_bytes / 2**20:.1f} MiB"
                                + (f", host-to-device {st.h2d_gbps:.1f} GB/s" if st.h2d_seconds else "")))
    if scaler is not None:
        run.extra.append(("scaler", f"scale {scaler.get_scale():.0f}, skipped steps {scaler.skipped_steps}, "
                                    "no host sync in step()"))
    return run


def _torch_run(dataset, device, steps, batch_size, workers, label):
    import torch

    run = _Run("torch", label)
    cuda = device.type == "cuda"
    model, optimizer = _model(device)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                         drop_last=True, generator=torch.Generator().manual_seed(5), pin_memory=cuda)
    scaler = torch.amp.GradScaler("cuda") if cuda else None
    mean = torch.tensor(MEAN, device=device).mul(255).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).mul(255).view(1, 3, 1, 1)

    def prepare(batch):
        images, labels = (t.to(device, non_blocking=True) for t in batch)
        images = images.permute(0, 3, 1, 2).float().sub(mean).div(std)
        if cuda:
            images = images.half().contiguous(memory_format=torch.channels_last)
        return images, labels

    _train(run, loader, model, optimizer, scaler, device, steps, prepare)
    return run


class _Progress:
    """One line on stderr, redrawn in place on a terminal (a line per quarter elsewhere)."""

    WIDTH = 30

    def __init__(self, label, total):
        self.label, self.total, self.n = label, total, 0
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, losses):
        self.n += 1
        quarter = max(1, self.total // 4)
        if not self.tty and self.n % quarter and self.n != self.total:
            return
        if self.tty and self.n % 5 and self.n != self.total:
            return
        filled = self.WIDTH * self.n // self.total
        line = (f"  {self.label:13} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.n}/{self.total} steps, "
                f"loss {float(losses[-1]):.3f}, {time.perf_counter() - self.t0:.1f} s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self, run):
        if self.tty:
            print(file=sys.stderr, flush=True)


def _print_summary(shown, timed, cuda):
    hot = [r for r in timed if r.way == "hotloop"]
    ref = [r for r in timed if r.way == "torch"]
    rows = [("samples/s", [r.samples / r.seconds for r in hot], [r.samples / r.seconds for r in ref], True),
            ("seconds", [r.seconds for r in hot], [r.seconds for r in ref], False),
            ("waiting for data, s", [r.wait_seconds for r in hot], [r.wait_seconds for r in ref], False)]
    print()
    print_table(rows)
    for name, index in (("first loss", 0), ("last loss", -1)):
        print(f"  {name:22}{hot[0].losses[index]:12.3f}{ref[0].losses[index]:12.3f}  (the same data and seed)")
    print("  rounds, loop seconds in the order run: " + " | ".join(
        ", ".join(f"{r.way} {r.seconds:.2f}" for r in timed[i:i + 2]) for i in range(0, len(timed), 2)))
    for name, text in shown.extra:
        print(f"  {name} (the monitored loop): {text}")
    worst = max(abs(a - b) for h, t in zip(hot, ref) for a, b in zip(h.losses, t.losses))
    if not cuda:
        same = "the same in every step" if worst == 0 else f"within {worst:.2g} of each other"
        print(f"  losses: {same} (same seed, same batches, same normalisation bits; hotloop's AdamW step rounds "
              "its bias corrections in float32, torch's CPU step in double)")
        print("  on the CPU: no host-to-device copies to overlap and no GPU kernels; float32, so no GradScaler "
              "(float16 autocast, which needs one, runs slowly on a CPU). What differs is the loader (workers "
              "write into a shared ring, Normalize in C) and AdamW's step (hotloop.optim's C loop); the "
              "model's own compute, the same in both, is most of each step")
    else:
        print(f"  losses: within {worst:.2g} of each other (float16 kernels need not be bitwise reproducible)")
    if not all(math.isfinite(x) for r in hot for x in r.losses):
        print("  note: hotloop's loss was not finite in some steps (the scaler skipped them)")
    print("  " + verdict_line([r.seconds for r in hot], [r.seconds for r in ref]))
