"""Benchmarks of the memory monitor: what a 1 kHz sampler costs a training step, and the rate it holds.

Step time of a ResNet-50 AMP step (torchvision; a small conv net without it) with no monitor, with
hotloop's C sampler at 1 kHz, with torch's `_record_memory_history`, and with a Python thread polling
NVML every 1 ms (pynvml, else ctypes), the configurations alternated block by block in one process.
Then the sample rate the C sampler achieves when 1 kHz and 10 kHz are asked, against a Python thread.
Beside them, on any machine: what the host sampler (hotloop._C.HostSampler) costs while it watches this
process and two children, against a Python thread reading the same /proc files at the same rate; and what
entering and leaving a monitor costs (NOTE [ Sampler windows ] in csrc/host_sampler.c), against the peak
bookkeeping a hand-written decorator does. A row that needs a GPU says so on a CPU, with no figure.
"""
import ctypes
import os
import statistics
import threading
import time

from .. import _C
from ..memory import MemoryMonitor
from .harness import Row


class PythonNvmlPoller:
    """What users write today: a Python thread that reads NVML memory info every `interval` seconds."""

    def __init__(self, index=0, interval=0.001):
        self.interval = interval
        self.samples = 0
        self.peak = 0
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.read = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
            self.how = "pynvml"
        except Exception:  # no nvidia-ml-py: the same calls through ctypes
            lib = ctypes.CDLL(os.environ.get("HOTLOOP_NVML_LIBRARY") or "libnvidia-ml.so.1")
            lib.nvmlInit_v2()
            handle = ctypes.c_void_p()
            lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
            memory = (ctypes.c_ulonglong * 3)()
            self.read = lambda: (lib.nvmlDeviceGetMemoryInfo(handle, memory), memory[2])[1]
            self.how = "ctypes"
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self.samples += 1
            time.sleep(self.interval)

    def start(self):
        self._stop.clear()
        self.samples = 0
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.t1 = time.perf_counter()

    @property
    def rate(self):
        return self.samples / (self.t1 - self.t0)


def _model(torch, device, quick):
    try:
        import torchvision

        model = torchvision.models.resnet18() if quick else torchvision.models.resnet50()
        name = "ResNet-18" if quick else "ResNet-50"
    except ImportError:
        layers = []
        ch = 3
        for out in (64, 128, 256, 512):
            layers += [torch.nn.Conv2d(ch, out, 3, stride=2, padding=1), torch.nn.BatchNorm2d(out), torch.nn.ReLU()]
            ch = out
        model = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                    torch.nn.Linear(ch, 1000))
        name = "small conv net (no torchvision)"
    return model.to(device).to(memory_format=torch.channels_last), name


class PythonProcPoller:
    """What users write today for host memory: a Python thread that reads smaps_rollup of each process
    (psutil's memory_full_info() reads the same file) and /proc/meminfo every `interval` seconds."""

    def __init__(self, pids, interval):
        self.pids, self.interval = pids, interval
        self.busy = 0.0
        self.ticks = 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            for pid in self.pids:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    fields = {line.split()[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
                self.peak = fields.get("Pss:", 0)
            with open("/proc/meminfo") as f:
                f.read()
            self.busy += time.perf_counter() - t
            self.ticks += 1
            time.sleep(self.interval)

    def run(self, seconds):
        thread = threading.Thread(target=self._run, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        time.sleep(seconds)
        self._stop.set()
        thread.join()
        return time.perf_counter() - t0


def host_rows(seconds):
    """The host sampler's cost per second watched (this process and two sleeping children, PSS read in
    every tick: its budget set to a whole core) against a Python thread doing the same reads."""
    import subprocess
    import sys

    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    try:
        time.sleep(0.2)

        def sampled(budget):
            """the sampler's steady cost: between two snapshots taken while it runs (start() and stop()
            each take a whole reading of their own, which a short window would count as the rate)"""
            sampler = _C.HostSampler(50.0, 50.0, 4096, True, budget)
            sampler.start()
            time.sleep(0.1)
            a, ta = sampler.snapshot(), time.monotonic()
            time.sleep(seconds)
            b, tb = sampler.snapshot(), time.monotonic()
            sampler.stop()
            spent = tb - ta
            cost = (b["read_s"] + b["scan_s"]) - (a["read_s"] + a["scan_s"])
            return 1e3 * cost / spent, (b["ticks"] - a["ticks"]) / spent, (b["rounds"] - a["rounds"]) / spent

        poller = PythonProcPoller([os.getpid()] + [c.pid for c in children], 0.05)
        elapsed = poller.run(seconds)
        python_ms, python_hz = 1e3 * poller.busy / elapsed, poller.ticks / elapsed
        for budget, what in ((1.0, "PSS every tick"), (0.02, "default PSS budget, 2 % of a core")):
            hotloop_ms, hz, rounds = sampled(budget)
            yield Row("monitor", f"host sampler, 20 Hz, 3 processes, {what}: /proc time per second watched",
                      hotloop_ms, python_ms, "ms", f"hotloop C thread {hz:.0f} Hz, PSS rounds {rounds:.1f} Hz; torch "
                      f"column: Python thread reading smaps_rollup every tick, {python_hz:.0f} Hz")
    finally:
        for c in children:
            c.kill()
            c.wait()


def _sample_rate(device, interval_ms, seconds):
    """(the memory sample rate hotloop's monitor held, its report) over `seconds` of an idle host"""
    with MemoryMonitor(interval_ms=interval_ms, device=device) as mon:
        time.sleep(seconds)
    r = mon.report()
    return r.sample_rate_hz or float("nan"), r


def _quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[1], q[2]


def enter_leave_row(ctx, calls=20):
    """Entering and leaving a default MemoryMonitor around an empty block (report=None), median of `calls`,
    against what a hand-written peak decorator does: torch's peak reset and read on a GPU, /proc/self/smaps_rollup
    read at both ends on a CPU (psutil's memory_full_info() reads the same file)."""
    torch = ctx.torch

    def ours():
        with MemoryMonitor(device=ctx.device if ctx.is_cuda else None):
            pass

    def theirs():
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            torch.cuda.max_memory_allocated(ctx.device)
        else:
            for _ in range(2):
                with open("/proc/self/smaps_rollup") as f:
                    f.read()

    ours()  # the samplers are made once per process: not the figure
    times = {"ours": [], "theirs": []}
    for k in range(calls):  # alternated, the order flipped each call
        for key, fn in ((("ours", ours), ("theirs", theirs)) if k % 2 == 0 else (("theirs", theirs), ("ours", ours))):
            t0 = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t0) * 1e3)
    q1, med, q3 = _quartiles(times["ours"])
    what = "torch peak reset + read" if ctx.is_cuda else "smaps_rollup read at enter and leave"
    return Row("monitor", "enter + leave a default memory monitor (empty block)", med,
               statistics.median(times["theirs"]), "ms", f"median of {calls}, IQR {q1:.2f}-{q3:.2f} ms; torch column: "
               f"{what}, what a hand-written decorator does")


def rows(ctx):
    yield from host_rows(0.5 if ctx.quick else 2.0)
    yield enter_leave_row(ctx)
    if not ctx.is_cuda:  # the steady cost is measured on a training step, on the GPU
        yield Row("monitor", "ResNet-50 AMP step: steady overhead of the default monitor", float("nan"), float("nan"),
                  "ms", "n/a on CPU: measured on a CUDA device (bench components --device cuda)")
    reason = _C.nvml_unavailable_reason()
    if reason is not None:
        print(f"  monitor: sample-rate rows skipped, no NVML ({reason})", flush=True)
        if ctx.is_cuda:
            yield from _overhead_rows(ctx)
        return
    torch = ctx.torch
    seconds = 0.3 if ctx.quick else 1.0
    device = ctx.device if ctx.is_cuda else 0  # torch's device, or NVML's first without one

    # achieved sample rate, idle host, against a Python thread asked for the same rate
    for hz in (1000, 10000):
        rate, r = _sample_rate(device, 1000.0 / hz, seconds)
        poller = None
        try:
            poller = PythonNvmlPoller(ctx.device.index or 0 if ctx.is_cuda else 0, 1.0 / hz)
            poller.start()
            time.sleep(seconds)
            poller.stop()
            py_rate = poller.rate
        except Exception as e:  # no real NVML for Python (a fake one, say)
            print(f"  monitor: Python NVML poller unavailable ({e})", flush=True)
            py_rate = float("nan")
        yield Row("monitor", f"achieved sample rate, {hz} Hz asked", rate, py_rate, "Hz",
                  f"hotloop {100 * rate / hz:.1f} % of asked, {r.ticks_missed} ticks missed; torch column: "
                  f"Python thread ({getattr(poller, 'how', '-')})")

    if ctx.is_cuda:
        yield from _overhead_rows(ctx)


def _overhead_rows(ctx):
    """The step time of a ResNet-50 AMP step with no monitor, the default monitor, torch's memory history and a
    Python NVML thread, alternated block by block, the order flipped each round; the overhead as the median and
    interquartile range of each round's paired ratio."""
    torch = ctx.torch
    model, name = _model(torch, ctx.device, ctx.quick)
    batch = 32 if ctx.quick else 128
    x = torch.randn(batch, 3, 224, 224, device=ctx.device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = 3 if ctx.quick else 10
    rounds = 4 if ctx.quick else 30  # alternations: the overhead sought (< 0.5 %) is within the step-to-step spread

    def block():
        for _ in range(steps):
            step()

    hotloop_monitor = MemoryMonitor(device=ctx.device)  # the default monitor, as @hotloop.memory_monitor makes it
    try:
        poller = PythonNvmlPoller(ctx.device.index or 0, 0.001)
    except Exception as e:  # no NVML for Python: that comparison is left out
        print(f"  monitor: Python NVML poller unavailable ({e})", flush=True)
        poller = None

    def record_history(on):
        if on:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)

    configs = {
        "none": (lambda: None, lambda: None),
        "hotloop": (hotloop_monitor.start, hotloop_monitor.stop),
        "history": (lambda: record_history(True), lambda: record_history(False)),
    }
    if poller is not None:
        configs["python"] = (poller.start, poller.stop)
    for _ in range(3):
        step()
    ctx.sync()
    times = {k: [] for k in configs}
    rates = []
    for r in range(rounds):  # alternate the configurations, block by block, the order flipped each round
        for key in (list(configs) if r % 2 == 0 else list(reversed(configs))):
            on, off = configs[key]
            on()
            step()  # the first step under a new configuration is not timed
            ms = ctx.time_ms(block) / steps
            off()
            times[key].append(ms)
            if key == "hotloop":
                rates.append(hotloop_monitor.last_report.sample_rate_hz or float("nan"))
    med = {k: statistics.median(v) for k, v in times.items()}
    label = f"{name} AMP step, batch {batch}"
    paired = [100 * (a / b - 1) for a, b in zip(times["hotloop"], times["none"])]
    q1, overhead, q3 = _quartiles(paired)
    yield Row("monitor", f"{label}: steady overhead of the default monitor (1 kHz)", med["hotloop"], med["none"],
              "ms", f"overhead {overhead:+.2f} % (median of {rounds} alternations, order flipped each round; IQR "
              f"{q1:+.2f} to {q3:+.2f} %); sampler held {statistics.median(rates):.0f} Hz during training")
    yield Row("monitor", f"{label}: 1 kHz hotloop monitor vs torch _record_memory_history", med["hotloop"],
              med["history"], "ms", f"history overhead {100 * (med['history'] / med['none'] - 1):+.1f} %")
    if poller is not None:
        yield Row("monitor", f"{label}: 1 kHz hotloop monitor vs Python NVML thread (1 ms)", med["hotloop"],
                  med["python"], "ms", f"Python thread ({poller.how}) overhead "
                  f"{100 * (med['python'] / med['none'] - 1):+.1f} %")
