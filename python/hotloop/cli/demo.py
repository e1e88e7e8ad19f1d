"""`python -m hotloop demo`: hotloop at work in one minute, on any machine. A small CNN learns a
generated image dataset (nothing downloaded) twice, from the same seed: once with hotloop's three
pieces (DataLoader with its device copies and Normalize, GradScaler on CUDA, @memory_monitor), once
with torch's (DataLoader with pin_memory, normalising ops, torch.amp.GradScaler). It prints the
monitor's report, the loader's and the scaler's figures, and the two loops side by side."""
import math
import sys
import time

from .. import _C, cuda_available

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


def main(args) -> int:
    import torch

    device = _device_or_none(args.device, torch)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (200 if cuda else 60)
    batch_size = args.batch_size if args.batch_size is not None else (256 if cuda else 64)
    for name, value, least in (("--steps", steps, 1), ("--batch-size", batch_size, 1), ("--workers", args.workers, 0)):
        if value < least:
            print(f"hotloop demo: {name}: expected a number >= {least}, got {value}", file=sys.stderr)
            return 2
    name = torch.cuda.get_device_name(device) if cuda else "the CPU"
    print(f"hotloop demo: a small CNN learns {steps} steps of {batch_size} generated 32x32 images on {name}, "
          f"{args.workers} workers, {'float16 autocast' if cuda else 'float32'}; first with hotloop, then with torch "
          "alone, same seed", flush=True)
    dataset = GeneratedImages(steps * batch_size)
    if cuda:
        _warm_up(device, batch_size)  # CUDA's and cuDNN's first-use costs, paid by neither loop
    hot = _hotloop_run(dataset, device, steps, batch_size, args.workers)
    ref = _torch_run(dataset, device, steps, batch_size, args.workers)
    _print_summary(hot, ref, cuda)
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


def _model(device):
    import torch
    from torch import nn

    torch.manual_seed(0)  # the same weights for both loops
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, CLASSES))
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=device.type == "cuda")
    return model, optimizer


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

    def __init__(self, label):
        self.label = label
        self.losses = []
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.samples = 0
        self.extra = []  # (name, value) lines shown under the table


def _train(run, loader, model, optimizer, scaler, device, steps, prepare):
    """The loop both runs share: `prepare(batch)` is what differs (hotloop's batch is ready)."""
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


def _hotloop_run(dataset, device, steps, batch_size, workers):
    import torch

    import hotloop

    run = _Run("hotloop")
    cuda = device.type == "cuda"
    model, optimizer = _model(device)
    loader = hotloop.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True,
                                generator=torch.Generator().manual_seed(5), device=device if cuda else None,
                                gpu_transform=hotloop.Normalize(MEAN, STD))
    scaler = hotloop.GradScaler(device) if cuda else None

    def prepare(batch):
        return batch  # on the device, normalised, channels_last: nothing left to do

    @hotloop.memory_monitor  # (model= would add per-module hooks: their cost shows in a model this small)
    def train():
        _train(run, loader, model, optimizer, scaler, device, steps, prepare)

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


def _torch_run(dataset, device, steps, batch_size, workers):
    import torch

    run = _Run("torch")
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
        line = (f"  {self.label:8} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.n}/{self.total} steps, "
                f"loss {float(losses[-1]):.3f}, {time.perf_counter() - self.t0:.1f} s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self, run):
        if self.tty:
            print(file=sys.stderr, flush=True)


def _print_summary(hot, ref, cuda):
    rows = [("samples/s", hot.samples / hot.seconds, ref.samples / ref.seconds, "higher"),
            ("seconds", hot.seconds, ref.seconds, "lower"),
            ("waiting for data, s", hot.wait_seconds, ref.wait_seconds, "lower"),
            ("first loss", hot.losses[0], ref.losses[0], None),
            ("last loss", hot.losses[-1], ref.losses[-1], None)]
    print()
    print(f"  {'':22}{'hotloop':>12}{'torch':>12}{'hotloop/torch':>15}")
    for name, h, t, better in rows:
        ratio = f"{h / t:.2f}x" if better and t > 0 else ""
        print(f"  {name:22}{h:12.3f}{t:12.3f}{ratio:>15}")
    for name, text in hot.extra:
        print(f"  {name}: {text}")
    worst = max(abs(a - b) for a, b in zip(hot.losses, ref.losses))
    if not cuda:
        same = "the same in every step" if worst == 0 else f"within {worst:.2g} of each other"
        print(f"  losses: {same} (same seed, same batches, same normalisation bits)")
    else:
        print(f"  losses: within {worst:.2g} of each other (float16 kernels need not be bitwise reproducible)")
    if not all(math.isfinite(x) for x in hot.losses):
        print("  note: hotloop's loss was not finite in some steps (the scaler skipped them)")
