"""How a benchmark row is measured and shown: hotloop's way and torch's way of one job, alternated
in one process (CUDA events on a GPU, perf_counter on the CPU; warm-up, median), hotloop ÷ torch.
Benchmarks are never tests: nothing here asserts on speed."""
import dataclasses
import math
import statistics
import time


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
        self._copy_rate = None

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

    def device_time_ms(self, fn):
        """The device's time for fn's work alone, in milliseconds: the host enqueues it behind a ~50 ms
        sleep kernel, so it is all queued before the device starts on it, as in a training loop whose
        host runs ahead; what its host time would add when the device waits is in time_ms. Without a
        GPU, time_ms."""
        if self.is_cuda:
            self.sync()
            # cycles: ~50 ms at 2 GHz, longer than any step's host time; time_ms's start event is queued
            # behind it, so the clock starts when the device reaches fn's work
            self.torch.cuda._sleep(100_000_000)
        return self.time_ms(fn)

    def host_time_ms(self, fn):
        """Host (CPU) time of one call, without waiting for the device: what the launch costs."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - t0) * 1e3
        self.sync()
        return elapsed

    def copy_rate_gbps(self):
        """The device's copy rate here, bytes read + written per second (dst.copy_(src) of float32: 1 GiB
        on a GPU, 64 MiB on a CPU): the bandwidth a pass over memory is held against. Measured once per
        context."""
        if self._copy_rate is None:
            torch = self.torch
            # on a CPU as large as the passes held against it (the tiny model's 16 M elements): a copy
            # inside a large last-level cache runs at several times memory's rate, and so may they
            numel = 2**28 if self.is_cuda and not self.quick else 2**24
            src = torch.empty(numel, device=self.device).normal_()
            dst = torch.empty_like(src)
            warmup, reps = (1, 3) if self.quick else (3, 20)
            for _ in range(warmup):
                dst.copy_(src)
            self.sync()
            ms = statistics.median(self.time_ms(lambda: dst.copy_(src)) for _ in range(reps))
            self._copy_rate = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
            del src, dst
            if self.is_cuda:
                torch.cuda.empty_cache()
        return self._copy_rate

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
    def number(value, form):  # a row that does not apply here (n/a on a CPU) has no figure
        return format(value, form) if math.isfinite(value) else "-"

    body = [(r.component, r.figure, number(r.hotloop, ".4g"), number(r.torch, ".4g"), r.unit, number(r.ratio, ".3f"),
             number(r.speedup, ".2f") + ("x" if math.isfinite(r.speedup) else ""), r.note) for r in rows]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
