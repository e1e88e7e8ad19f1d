"""`python -m hotloop bench train`: the seeds' FP32-vs-AMP table measured on this machine: per precision
and batch size, samples/s, ms per step, torch's peak memory, and (from hotloop.MemoryMonitor's NVML
timeline) GPU utilisation, mean power and samples per joule."""
import contextlib
import csv
import json
import sys
import time
import warnings

from .workloads import BenchError, build, check_precision

AMP_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
WARMUP_STEPS = 3  # cuDNN's algorithm search, torch.compile and the allocator settle in these


class Progress:
    """One line on stderr: redrawn in place on a terminal, a line per finished run otherwise."""

    def __init__(self, total, stream=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, label, step, steps):
        if self.tty:
            width = 20
            filled = int(width * step / max(steps, 1))
            self.stream.write(f"\r[{self.done + 1}/{self.total}] {label} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{step}/{steps}  ")
            self.stream.flush()

    def finish(self, label, outcome):
        self.done += 1
        self.stream.write(("\r" if self.tty else "") + f"[{self.done}/{self.total}] {label}: {outcome}" + " " * 10 + "\n")
        self.stream.flush()


@contextlib.contextmanager
def backend_flags(torch, precision, device):
    """TF32 on for tf32 only (fp32 means true fp32 convolutions and matmuls, forward and backward),
    cuDNN's algorithm search on a GPU; torch's flags restored afterwards."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer torch suggests its fp32_precision API; this one still works
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = device.type == "cuda"
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.backends.cudnn.benchmark = saved[2]


class Trainer:
    """One model, optimizer and (for fp16) hotloop.GradScaler at one precision; step(size) trains one
    step on a synthetic batch of that size made on the device."""

    def __init__(self, model_name, precision, device, channels_last=False, compile=False):
        import torch

        import hotloop

        self.torch, self.device, self.precision = torch, device, precision
        self.workload = build(model_name, device)
        self.channels_last = channels_last and self.workload.kind == "image"
        if self.channels_last:
            self.workload.model.to(memory_format=torch.channels_last)
        self.forward_model = self.workload.model
        if compile:
            self.workload.model = torch.compile(self.workload.model)
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.forward_model.parameters(), lr=1e-4, fused=fused)
        self.scaler = hotloop.GradScaler(device.type) if precision == "fp16" else None
        self.batches = {}

    def batch(self, size):
        if size not in self.batches:
            self.batches.clear()  # one size's batch at a time: the next one may need its memory
            g = self.torch.Generator(device=self.device).manual_seed(size)
            x, y = self.workload.batch(size, self.device, g)
            if self.channels_last:
                x = x.contiguous(memory_format=self.torch.channels_last)
            self.batches[size] = (x, y)
        return self.batches[size]

    def step(self, size):
        x, y = self.batch(size)
        self.optimizer.zero_grad(set_to_none=True)
        dtype = AMP_DTYPES.get(self.precision)
        with self.torch.autocast(self.device.type, dtype=getattr(self.torch, dtype or "float32"), enabled=dtype is not None):
            loss = self.workload.loss(x, y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def measure(trainer, size, steps, progress, label):
    """One row: run WARMUP_STEPS, then `steps` timed steps under hotloop.MemoryMonitor (on a GPU)."""
    import hotloop
    from hotloop.memory.batch_size import is_out_of_memory

    torch = trainer.torch
    row = {"model": trainer.workload.name, "precision": trainer.precision, "batch_size": size, "steps": steps,
           "status": "ok", "ms_per_step": None, "samples_per_s": None, "peak_gib": None, "gpu_util_pct": None,
           "power_w": None, "samples_per_j": None}
    cuda = trainer.device.type == "cuda"
    try:
        for _ in range(WARMUP_STEPS):
            trainer.step(size)
        trainer.sync()
        monitor = hotloop.MemoryMonitor(device=trainer.device, interval_ms=5.0, report=None).start() if cuda else None
        t0 = time.perf_counter()
        for i in range(steps):
            trainer.step(size)
            progress.update(label, i + 1, steps)
        trainer.sync()
        seconds = time.perf_counter() - t0
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        row["status"] = "OOM"
        trainer.batches.clear()
        if cuda:
            torch.cuda.empty_cache()
        return row
    row["ms_per_step"] = seconds * 1e3 / steps
    row["samples_per_s"] = size * steps / seconds
    if monitor is not None:
        report = monitor.stop()
        row["peak_gib"] = report.peak_allocated / 2**30 if report.peak_allocated is not None else None
        row["gpu_util_pct"] = report.util_mean
        row["power_w"] = report.power_mean_w
        if report.power_mean_w:
            row["samples_per_j"] = row["samples_per_s"] / report.power_mean_w
    return row


def add_speedups(rows):
    """samples/s over fp32's at the same batch size (or fp32's best where it ran another size)."""
    for row in rows:
        base = [r for r in rows if r["precision"] == "fp32" and r["samples_per_s"]]
        same = [r for r in base if r["batch_size"] == row["batch_size"]]
        ref = (same or sorted(base, key=lambda r: -r["samples_per_s"]))[:1]
        row["speedup_vs_fp32"] = row["samples_per_s"] / ref[0]["samples_per_s"] if ref and row["samples_per_s"] else None


def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


COLUMNS = [("precision", "precision", "s"), ("batch", "batch_size", "d"), ("ms/step", "ms_per_step", ".1f"),
           ("samples/s", "samples_per_s", ".1f"), ("peak GiB", "peak_gib", ".2f"), ("GPU util %", "gpu_util_pct", ".0f"),
           ("power W", "power_w", ".0f"), ("samples/J", "samples_per_j", ".2f"), ("vs fp32", "speedup_vs_fp32", ".2f")]


def format_table(rows):
    header = [c[0] for c in COLUMNS]
    body = []
    for r in rows:
        cells = [_cell(r[key], fmt) for _, key, fmt in COLUMNS]
        if r["speedup_vs_fp32"] is not None:
            cells[-1] += "x"
        if r["status"] != "ok":
            cells[2] = r["status"]
        body.append(cells)
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for precision in dict.fromkeys(r["precision"] for r in rows):
        points = sorted((r["batch_size"], r["samples_per_s"]) for r in rows
                        if r["precision"] == precision and r["samples_per_s"])
        if points:
            ax.plot(*zip(*points), marker="o", label=precision)
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows, args, meta):
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot, f"{meta['model']} on {meta['device_name']}")


def run(args, device):
    """The whole command: validate, measure each precision and batch size, print and write."""
    import torch

    precisions = args.precisions
    for p in precisions:
        check_precision(p, device)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--plot needs matplotlib, which is not installed here (pip install matplotlib)") from None
    if args.batch_sizes == "auto" and device.type != "cuda":
        raise BenchError("--batch-size auto: finds the largest batch that fits in GPU memory, so it needs a GPU")
    sizes = args.batch_sizes
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    runs = len(precisions) * (len(sizes) if isinstance(sizes, list) else 1)
    progress = Progress(runs)
    rows, found = [], {}
    for precision in precisions:
        trainer = Trainer(args.model, precision, device, args.channels_last, args.compile)
        if not rows and not found:
            w = trainer.workload
            print(f"hotloop bench train: {w.name} ({w.source}, {w.parameters / 1e6:.3g} M parameters) on {device} "
                  f"({device_name}), torch {torch.__version__}, {args.steps} steps after {WARMUP_STEPS} warm-up"
                  + (", channels_last" if args.channels_last else "") + (", torch.compile" if args.compile else ""),
                  flush=True)
        todo = sizes or [trainer.workload.default_batch]
        if sizes == "auto":
            import hotloop

            def trial(size):
                for _ in range(2):
                    trainer.step(size)
                trainer.batches.clear()

            with backend_flags(torch, precision, device):
                result = hotloop.find_max_batch_size(trial, device=device)
            found[precision] = result.to_dict()
            print(f"  {precision}: largest batch {int(result)} in {len(result.trials)} trials", file=sys.stderr)
            todo = [int(result)]
        for size in todo:
            label = f"{precision} batch {size}"
            with backend_flags(torch, precision, device):
                row = measure(trainer, size, args.steps, progress, label)
            rows.append(row)
            progress.finish(label, row["status"] if row["status"] != "ok" else
                            f"{row['ms_per_step']:.1f} ms/step, {row['samples_per_s']:.1f} samples/s")
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_speedups(rows)
    print()
    print(format_table(rows))
    meta = {"model": args.model, "device": str(device), "device_name": device_name, "torch": torch.__version__,
            "steps": args.steps, "warmup_steps": WARMUP_STEPS, "channels_last": args.channels_last,
            "compile": args.compile, "batch_size_search": found or None}
    write_outputs(rows, args, meta)
    return 0
