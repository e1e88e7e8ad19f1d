"""`python -m hotloop bench components`: hotloop's way and torch's way of the same job, alternated in
one process, printed as hotloop ÷ torch per figure.

Each component lives in its own module (COMPONENTS) with `rows(ctx)` yielding Row objects; this file
owns the timing (CUDA events on a GPU, perf_counter on the CPU; warm-up, alternation, median) and the
table. Benchmarks are never tests: nothing here asserts on speed.
"""
import dataclasses
import importlib
import statistics
import time

# component name -> module with rows(ctx); each component issue adds its line
COMPONENTS = {
    "ops": "hotloop.bench_ops",
    "scaler": "hotloop.bench_scaler",
    "monitor": "hotloop.bench_monitor",
    "loader": "hotloop.bench_loader",
}


@dataclasses.dataclass
class Row:
    component: str
    figure: str
    hotloop: float
    torch: float
    unit: str  # "ms" (lower is better) or a rate such as "GB/s", "img/s" (higher is better)
    note: str = ""

    @property
    def lower_is_better(self) -> bool:
        return self.unit in ("ms", "us", "s")

    @property
    def ratio(self) -> float:
        """hotloop ÷ torch, as the figure is stated."""
        return self.hotloop / self.torch if self.torch else float("nan")

    @property
    def speedup(self) -> float:
        """how many times better hotloop does (time: torch ÷ hotloop; rate: hotloop ÷ torch)."""
        if self.lower_is_better:
            return self.torch / self.hotloop if self.hotloop else float("nan")
        return self.ratio


class Context:
    """What a component needs to measure: the device, and timers that alternate two ways of one job."""

    def __init__(self, device, quick=False):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.quick = quick

    def sync(self):
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    def time_ms(self, fn):
        """One timed call of fn, in milliseconds (CUDA events around it on a GPU)."""
        if self.is_cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def host_time_ms(self, fn):
        """Host (CPU) time of one call, without waiting for the device: what the launch costs."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - t0) * 1e3
        self.sync()
        return elapsed

    def compare(self, hotloop_fn, torch_fn, warmup=3, reps=20, timer=None):
        """Median milliseconds of (hotloop_fn, torch_fn), run alternately after warm-up."""
        timer = timer or self.time_ms
        if self.quick:
            warmup, reps = 1, 3
        for _ in range(warmup):
            hotloop_fn()
            torch_fn()
        self.sync()
        ours, theirs = [], []
        for _ in range(reps):
            ours.append(timer(hotloop_fn))
            theirs.append(timer(torch_fn))
        return statistics.median(ours), statistics.median(theirs)


def format_table(rows) -> str:
    header = ("component", "figure", "hotloop", "torch", "unit", "hotloop÷torch", "better by", "note")
    body = [(r.component, r.figure, f"{r.hotloop:.4g}", f"{r.torch:.4g}", r.unit, f"{r.ratio:.3f}",
             f"{r.speedup:.2f}x", r.note) for r in rows]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser):
    parser.add_argument("what", choices=["components"], help="what to benchmark")
    parser.add_argument("--only", action="append", choices=sorted(COMPONENTS),
                        help="run only this component (repeatable)")
    parser.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda when usable)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")


def main(args) -> int:
    import torch

    from . import cuda_available

    device = args.device or ("cuda" if cuda_available() and torch.cuda.is_available() else "cpu")
    ctx = Context(device, quick=args.quick)
    names = args.only or list(COMPONENTS)
    rows = []
    print(f"hotloop bench components on {device}"
          + (f" ({torch.cuda.get_device_name(ctx.device)})" if ctx.is_cuda else "")
          + f", torch {torch.__version__}", flush=True)
    for name in names:
        for row in importlib.import_module(COMPONENTS[name]).rows(ctx):
            rows.append(row)
            print(f"  {row.component}: {row.figure}: hotloop {row.hotloop:.4g} {row.unit}, "
                  f"torch {row.torch:.4g} {row.unit}", flush=True)
    print()
    print(format_table(rows))
    return 0


def transformer_shapes(hidden, layers, vocab=50304):
    """Parameter shapes of a GPT-like model: embedding, then per layer qkv, proj, two MLP matrices,
    their biases and two layer norms (12 tensors a layer, about 12·hidden² parameters)."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                   (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,),
                   (hidden,), (hidden,), (hidden,), (hidden,)]
    return shapes


# (hidden, layers): ~353 M parameters in 289 tensors, ~1.3 B in 481
MODEL_353M = (1024, 24)
MODEL_1_3B = (1600, 40)
MODEL_TINY = (256, 4)
