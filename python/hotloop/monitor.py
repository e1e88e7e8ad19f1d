"""Peak-memory reports that add up: a C sampler reads NVML at ~1 kHz without the GIL, torch gives exact peaks.

`@hotloop.memory_monitor` on a train function (or `with hotloop.MemoryMonitor() as mon:`) starts the
C sampler (hotloop._C.Monitor: device memory every tick; utilisation, power, temperature, clocks and
clock-event reasons on a slower tick), resets torch's allocator peaks, optionally hooks a model's
modules, and at the end joins what the device saw with what torch's caching allocator saw:

    peak device used (NVML) = CUDA context (and other processes) at start
                            + torch peak reserved (= peak allocated + fragmentation)
                            + memory outside torch at the peak (cuBLAS/cuDNN/NCCL, other libraries)

followed by advice computed from those figures. Works without torch's CUDA (NVML figures only) and
without NVML (torch figures only), and says which part is missing.
"""
import dataclasses
import functools
import json
import logging
import os
import re
import sys
import time

from . import _C

_logger = logging.getLogger(__name__)

GiB = float(1 << 30)
MiB = float(1 << 20)

# clock-event ("throttle") reason bits, as NVML documents them
REASON_NAMES = {
    0x1: "GPU idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clocks setting",
}
POWER_REASONS = 0x4 | 0x80
THERMAL_REASONS = 0x20 | 0x40
UNSUPPORTED = 0xFFFFFFFF


def reason_names(bits: int) -> list:
    """NVML clock-event reason bits -> names (idle excluded: an idle GPU is not held back)."""
    return [name for bit, name in REASON_NAMES.items() if bits & bit and bit != 0x1]


def _dtypes():
    import numpy as np

    memory = np.dtype([("t", "<f8"), ("used", "<u8"), ("reserved", "<u8"), ("free", "<u8")])
    slow = np.dtype([("t", "<f8"), ("util_gpu", "<u4"), ("util_memory", "<u4"), ("power_mw", "<u4"),
                     ("temperature_c", "<u4"), ("sm_clock_mhz", "<u4"), ("memory_clock_mhz", "<u4"),
                     ("reasons", "<u8")])
    pcie = np.dtype([("t", "<f8"), ("rx_kb_per_s", "<u4"), ("tx_kb_per_s", "<u4")])
    assert (memory.itemsize, slow.itemsize, pcie.itemsize) == (
        _C.MONITOR_MEMORY_SAMPLE_BYTES, _C.MONITOR_SLOW_SAMPLE_BYTES, _C.MONITOR_PCIE_SAMPLE_BYTES)
    return memory, slow, pcie


class Timeline:
    """The kept samples as numpy arrays; times in seconds since the monitor started.

    memory: time, used, reserved, free (bytes); slow: slow_time, util_gpu (%), power_w,
    temperature_c, sm_clock_mhz, reasons; pcie: pcie_time, pcie_rx_mb_s, pcie_tx_mb_s. Readings the
    device does not offer are NaN. `.memory`, `.slow`, `.pcie` hold the raw structured arrays.
    """

    def __init__(self, snapshot=None, t0=0.0):
        import numpy as np

        memory_dtype, slow_dtype, pcie_dtype = _dtypes()
        snapshot = snapshot or {"memory": b"", "slow": b"", "pcie": b""}
        self.memory = np.frombuffer(snapshot["memory"], dtype=memory_dtype)
        self.slow = np.frombuffer(snapshot["slow"], dtype=slow_dtype)
        self.pcie = np.frombuffer(snapshot["pcie"], dtype=pcie_dtype)
        self.time = self.memory["t"] - t0
        self.used = self.memory["used"]
        self.reserved = self.memory["reserved"]
        self.free = self.memory["free"]

        def readings(field, scale=1.0):
            raw = self.slow[field]
            return np.where(raw == UNSUPPORTED, np.nan, raw.astype(np.float64) * scale)

        self.slow_time = self.slow["t"] - t0
        self.util_gpu = readings("util_gpu")
        self.power_w = readings("power_mw", 1e-3)
        self.temperature_c = readings("temperature_c")
        self.sm_clock_mhz = readings("sm_clock_mhz")
        self.reasons = self.slow["reasons"]
        self.pcie_time = self.pcie["t"] - t0
        self.pcie_rx_mb_s = self.pcie["rx_kb_per_s"].astype(np.float64) / 1024.0
        self.pcie_tx_mb_s = self.pcie["tx_kb_per_s"].astype(np.float64) / 1024.0

    def __len__(self):
        return len(self.memory)

    def __repr__(self):
        return f"Timeline({len(self.memory)} memory, {len(self.slow)} slow, {len(self.pcie)} pcie samples)"


@dataclasses.dataclass
class ModuleMemory:
    """What one module's forward kept alive (activations saved for backward plus its output)."""
    name: str
    activation_bytes: int  # memory_allocated() after forward minus before (max over calls)
    output_bytes: int      # bytes of the tensors it returned
    calls: int
    backward_allocated_bytes: int = 0  # memory_allocated() when backward reached its output (max)


@dataclasses.dataclass
class MemoryReport:
    """What a monitored run used, from NVML and from torch's caching allocator, with advice.

    Sizes are bytes, None where the source was unavailable. `str(report)` is a table;
    `to_dict()`/`to_json()` give every field; `plot(path)` draws the timeline.
    """
    device: str = "cuda:0"
    device_name: str = None
    duration_s: float = 0.0
    nvml: bool = False
    nvml_unavailable_reason: str = None
    torch_cuda: bool = False
    # torch's caching allocator, exact
    peak_allocated: int = None
    peak_reserved: int = None
    fragmentation_at_peak: int = None  # peak reserved - peak allocated
    inactive_split_peak: int = None
    alloc_retries: int = None
    ooms: int = None
    # NVML
    peak_device_used: int = None
    peak_time_s: float = None
    device_total: int = None
    driver_reserved: int = None
    context_baseline: int = None       # device used at start minus torch reserved at start
    non_torch_at_peak: int = None      # peak device used - peak reserved - context baseline
    util_mean: float = None
    power_mean_w: float = None
    power_max_w: float = None
    power_limit_w: float = None
    temperature_max_c: int = None
    sm_clock_min_mhz: int = None
    sm_clock_max_mhz: int = None
    throttle_reasons: list = dataclasses.field(default_factory=list)
    samples: int = 0
    samples_kept: int = 0
    samples_dropped: int = 0
    ticks_missed: int = 0
    sample_rate_hz: float = None
    interval_ms: float = None
    nvml_errors: dict = None
    # hotloop.DataLoader
    loader_wait_s: float = None
    stall_fraction: float = None
    # model=
    modules: list = dataclasses.field(default_factory=list)
    autocast_seen: bool = None
    fp32_matmul_seen: bool = None
    # torch.OutOfMemoryError inside the run
    oom: dict = None
    advice: list = dataclasses.field(default_factory=list)
    timeline: Timeline = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "timeline":
                continue
            value = getattr(self, f.name)
            if f.name == "modules":
                value = [dataclasses.asdict(m) if dataclasses.is_dataclass(m) else dict(m) for m in value]
            out[f.name] = value
        return out

    def to_json(self, indent=2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self):
        return format_report(self)

    def plot(self, path):
        """Memory, utilisation and power against time, as a PNG (needs matplotlib)."""
        return plot_report(self, path)


# ---------------------------------------------------------------------------------------------
# the report as text


def _size(n):
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= 0.5 * GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    return f"{sign}{n / MiB:.1f} MiB" if n >= 0.1 * MiB else f"{sign}{n / 1024:.1f} KiB"


def top_level_modules(report):
    """the model's direct children (no dot in the name): what one would checkpoint"""
    return [m for m in report.modules if m.name and "." not in m.name]


def format_report(r: MemoryReport) -> str:
    title = f"hotloop memory report: {r.device}" + (f" ({r.device_name})" if r.device_name else "")
    title += f", {r.duration_s:.2f} s"
    rows = []
    if r.nvml and r.peak_device_used is not None:
        parts = []
        if r.context_baseline is not None and r.peak_reserved is not None:
            parts = [f"context {_size(r.context_baseline)}", f"torch reserved {_size(r.peak_reserved)}",
                     f"other {_size(r.non_torch_at_peak)}"]
        rows.append(("peak device used (NVML)", _size(r.peak_device_used)
                     + (f"  at {r.peak_time_s:.3f} s" if r.peak_time_s is not None else "")
                     + (f"  = {' + '.join(parts)}" if parts else "")))
        if r.device_total:
            rows.append(("  of device total", _size(r.device_total)))
        rows.append(("  CUDA context (and others) at start" if r.torch_cuda else "  device used at start",
                     _size(r.context_baseline)))
    elif not r.nvml:
        rows.append(("NVML", f"not available: {r.nvml_unavailable_reason}"))
    if r.torch_cuda:
        rows.append(("  torch peak reserved", _size(r.peak_reserved)))
        rows.append(("    torch peak allocated", _size(r.peak_allocated)))
        rows.append(("    fragmentation at peak", f"{_size(r.fragmentation_at_peak)}"
                     f"  (inactive split {_size(r.inactive_split_peak)})"))
        if r.nvml:
            rows.append(("  outside torch at peak", f"{_size(r.non_torch_at_peak)}"
                         "  (cuBLAS/cuDNN/NCCL, other libraries)"))
        rows.append(("allocation retries / OOMs", f"{r.alloc_retries} / {r.ooms}"))
    else:
        rows.append(("torch", "no CUDA device in torch: allocator figures unavailable"))
    if r.nvml:
        rows.append(("GPU utilisation (mean)", "-" if r.util_mean is None else f"{r.util_mean:.0f} %"))
        power = [("-" if v is None else f"{v:.0f}") for v in (r.power_mean_w, r.power_max_w, r.power_limit_w)]
        rows.append(("power mean / max / limit", " / ".join(power) + " W"))
        rows.append(("temperature max", "-" if r.temperature_max_c is None else f"{r.temperature_max_c} °C"))
        if r.sm_clock_max_mhz is not None:
            rows.append(("SM clock min / max", f"{r.sm_clock_min_mhz} / {r.sm_clock_max_mhz} MHz"))
        rows.append(("clock-event reasons seen", ", ".join(r.throttle_reasons) or "none"))
        rate = "-" if r.sample_rate_hz is None else f"{r.sample_rate_hz:.0f} Hz"
        rows.append(("memory samples", f"{r.samples} at {rate} (asked {1e3 / r.interval_ms:.0f} Hz; "
                     f"{r.samples_dropped} dropped from the ring, {r.ticks_missed} ticks missed)"))
        if r.nvml_errors:
            e = r.nvml_errors
            rows.append(("NVML errors", f"{e['count']}, first: {e['call']}: {e['text']} ({e['code']})"))
    if r.stall_fraction is not None:
        rows.append(("data loader stalls", f"{100 * r.stall_fraction:.1f} % of the time ({r.loader_wait_s:.2f} s)"))
    if r.oom:
        o = r.oom
        rows.append(("OUT OF MEMORY", f"asked for {_size(o.get('requested_bytes'))} with {_size(o.get('free_bytes'))}"
                     f" free on the device; torch reserved {_size(o.get('reserved_bytes'))}, allocated "
                     f"{_size(o.get('allocated_bytes'))}, fragmentation {_size(o.get('fragmentation_bytes'))}"))
    width = max(len(k) for k, _ in rows)
    lines = [title] + [f"  {k:<{width}}  {v}" for k, v in rows]
    top = sorted(top_level_modules(r), key=lambda m: -m.activation_bytes)[:8]
    if top:
        lines.append("  activations per module (forward, max over calls):")
        w = max(len(m.name) for m in top)
        for m in top:
            lines.append(f"    {m.name:<{w}}  {_size(m.activation_bytes):>10}  (output {_size(m.output_bytes)}, "
                         f"{m.calls} call{'s' if m.calls != 1 else ''})")
    if r.advice:
        lines.append("advice:")
        lines += [f"  - {a}" for a in r.advice]
    return "\n".join(lines)


def plot_report(r: MemoryReport, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("MemoryReport.plot needs matplotlib: pip install 'hotloop[plot]' "
                          "(or pip install matplotlib)") from e
    t = r.timeline if r.timeline is not None else Timeline()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    axes[0].plot(t.time, t.used / GiB, label="device used (NVML)")
    if r.peak_reserved is not None and r.context_baseline is not None:
        axes[0].axhline((r.peak_reserved + r.context_baseline) / GiB, color="C1", ls="--",
                        label="context + torch peak reserved")
    if r.peak_allocated is not None and r.context_baseline is not None:
        axes[0].axhline((r.peak_allocated + r.context_baseline) / GiB, color="C2", ls=":",
                        label="context + torch peak allocated")
    axes[0].set_ylabel("GiB")
    axes[0].legend(loc="best", fontsize=8)
    axes[1].plot(t.slow_time, t.util_gpu, color="C3")
    axes[1].set_ylabel("utilisation %")
    axes[1].set_ylim(0, 105)
    axes[2].plot(t.slow_time, t.power_w, color="C4")
    if r.power_limit_w:
        axes[2].axhline(r.power_limit_w, color="k", ls="--", lw=0.8)
    axes[2].set_ylabel("power W")
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"hotloop: {r.device}" + (f" ({r.device_name})" if r.device_name else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# advice


def compute_advice(r: MemoryReport) -> list:
    """One line per finding, computed from the report's figures."""
    advice = []
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:True" in alloc_conf
    frag = r.fragmentation_at_peak
    oom_frag = (r.oom or {}).get("fragmentation_bytes") or 0
    fragmented = (frag is not None and r.peak_reserved and frag > 0.2 * r.peak_reserved and frag > 256 * MiB)
    if not expandable and (fragmented or (r.alloc_retries or 0) > 0 or oom_frag > 256 * MiB):
        what = []
        if fragmented:
            what.append(f"{_size(frag)} of the {_size(r.peak_reserved)} torch reserved was not allocated at the peak")
        if r.alloc_retries:
            what.append(f"{r.alloc_retries} allocation retries (cudaMalloc failed, cache flushed)")
        if oom_frag > 256 * MiB:
            what.append(f"{_size(oom_frag)} reserved but free when the OOM hit")
        advice.append("fragmentation: " + "; ".join(what)
                      + ": set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch starts")

    top = sorted(top_level_modules(r), key=lambda m: -m.activation_bytes)
    total_act = sum(max(m.activation_bytes, 0) for m in top)
    if top and r.peak_allocated and total_act > 0.5 * r.peak_allocated:
        chosen, covered = [], 0
        for m in top:
            if covered >= 0.5 * total_act or len(chosen) == 3:
                break
            chosen.append(m)
            covered += m.activation_bytes
        saving = sum(max(m.activation_bytes - m.output_bytes, 0) for m in chosen)
        advice.append(f"activations are {_size(total_act)} of the {_size(r.peak_allocated)} peak allocated: "
                      f"gradient checkpointing of {', '.join(m.name for m in chosen)} "
                      f"(torch.utils.checkpoint) would save about {_size(saving)}")

    if r.autocast_seen is False and r.fp32_matmul_seen:
        advice.append("no autocast seen and matmuls/convolutions ran in float32: use AMP "
                      "(torch.autocast('cuda', dtype=torch.bfloat16) around the forward, or float16 with "
                      "hotloop.GradScaler) for tensor-core speed and about half the activation memory")

    if r.util_mean is not None and r.util_mean < 70:
        if r.stall_fraction is not None and r.stall_fraction > 0.10:
            advice.append(f"GPU busy {r.util_mean:.0f} % of the time while the data loader stalled "
                          f"{100 * r.stall_fraction:.0f} % of it: raise num_workers or use hotloop.DataLoader "
                          "(pinned ring, copies ahead on a side stream)")
        elif r.stall_fraction is None:
            advice.append(f"GPU busy only {r.util_mean:.0f} % of the time: it waits on the host (input "
                          "pipeline, .item()/synchronize calls, Python overhead); hotloop.DataLoader reports "
                          "its stalls here when it feeds the loop")
        else:
            advice.append(f"GPU busy only {r.util_mean:.0f} % of the time although the data loader stalled only "
                          f"{100 * r.stall_fraction:.0f} %: the host is slow elsewhere (.item()/synchronize "
                          "calls, Python overhead, small kernels: try larger batches or CUDA graphs)")
    seen = 0
    for name in r.throttle_reasons:
        seen |= next((bit for bit, n in REASON_NAMES.items() if n == name), 0)
    if seen & POWER_REASONS:
        limit = f" (limit {r.power_limit_w:.0f} W, max drawn {r.power_max_w:.0f} W)" \
            if r.power_limit_w and r.power_max_w else ""
        advice.append(f"clocks held back by the power cap{limit}: expected under full load; if the limit is "
                      "below the default, raise it with your administrator (hotloop never changes it)")
    if seen & (THERMAL_REASONS | 0x8):
        temp = f" (max {r.temperature_max_c} °C)" if r.temperature_max_c is not None else ""
        advice.append(f"thermal or hardware slowdown seen{temp}: check cooling, airflow and fan curves")

    if r.oom:
        req, free = r.oom.get("requested_bytes"), r.oom.get("free_bytes")
        if req and free is not None and oom_frag and req <= free + oom_frag:
            advice.append("out of memory although reserved-but-free plus device-free memory would have fit the "
                          "request: fragmentation; expandable_segments:True, or free caches between phases")
        else:
            advice.append("out of memory: lower the batch size, use AMP, or checkpoint the heaviest modules; "
                          "run with model= to see which modules hold the activations")
    return advice


# ---------------------------------------------------------------------------------------------
# per-module activation memory, read from the allocator in forward hooks (no sync)


class _ModuleHooks:
    def __init__(self, model, allocated):
        import torch

        self.torch = torch
        self.allocated = allocated  # callable -> bytes, or None: then outputs' bytes are the estimate
        self.stats = {}
        self.stack = {}
        self.handles = []
        self.autocast_seen = False
        self.fp32_matmul_seen = False
        matmul_types = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                        torch.nn.MultiheadAttention)
        for name, module in model.named_modules():
            if module is model:
                continue
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._pre, name)))
            self.handles.append(module.register_forward_hook(
                functools.partial(self._post, name, isinstance(module, matmul_types))))

    def _tensors(self, out):
        t = self.torch
        if isinstance(out, t.Tensor):
            return [out]
        if isinstance(out, (list, tuple)):
            return [x for x in out if isinstance(x, t.Tensor)]
        if isinstance(out, dict):
            return [x for x in out.values() if isinstance(x, t.Tensor)]
        return []

    def _pre(self, name, module, args):
        self.stack.setdefault(name, []).append(self.allocated() if self.allocated else 0)

    def _post(self, name, is_matmul, module, args, out):
        t = self.torch
        before = self.stack[name].pop() if self.stack.get(name) else 0
        tensors = self._tensors(out)
        out_bytes = sum(x.numel() * x.element_size() for x in tensors)
        act = (self.allocated() - before) if self.allocated else out_bytes
        s = self.stats.get(name)
        if s is None:
            s = self.stats[name] = ModuleMemory(name, act, out_bytes, 0)
        s.activation_bytes = max(s.activation_bytes, act)
        s.output_bytes = max(s.output_bytes, out_bytes)
        s.calls += 1
        device_type = tensors[0].device.type if tensors else "cuda"
        try:
            autocast = t.is_autocast_enabled(device_type)
        except TypeError:  # torch < 2.4
            autocast = t.is_autocast_enabled()
        self.autocast_seen |= bool(autocast)
        if is_matmul and not autocast and any(x.dtype == t.float32 for x in tensors):
            self.fp32_matmul_seen = True
        # backward reaches this module when the gradient of its output is computed
        if self.allocated and tensors and tensors[0].requires_grad and t.is_grad_enabled():
            tensors[0].register_hook(functools.partial(self._backward, s))

    def _backward(self, s, grad):
        s.backward_allocated_bytes = max(s.backward_allocated_bytes, self.allocated())

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def modules(self):
        return list(self.stats.values())


# ---------------------------------------------------------------------------------------------
# the monitor


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


def _loader_wait():
    """(wait_seconds, batches) of every hotloop.DataLoader so far, or None before the loader exists."""
    try:
        from .loader import loader_stats_snapshot
    except (ImportError, AttributeError):
        return None
    try:
        return float(loader_stats_snapshot()["wait_seconds"])
    except Exception:  # a loader without stats must not break the monitor
        _logger.debug("loader_stats_snapshot failed", exc_info=True)
        return None


def _parse_size(text):
    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", text or "")
    if not m:
        return None
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _oom_types(torch):
    if torch is None:
        return ()
    types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                              getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if t is not None)
    return types


class MemoryMonitor:
    """Watch device memory (and utilisation, power, temperature, clocks) while a block runs.

        with hotloop.MemoryMonitor(model=model) as mon:
            train(model, loader)
        print(mon.report())
        mon.timeline.used  # numpy array of bytes, one per sample

    interval_ms: memory sampling period of the C thread (1.0: 1 kHz). device: a torch device or
    index (default: torch's current device), or an NVML index when torch has no CUDA. model: an
    nn.Module whose modules are hooked to measure their activation memory. report: "table",
    "json" or None: what is printed to `file` (default sys.stderr) when the block ends. plot: a
    PNG path the timeline is drawn to (needs matplotlib). slow_interval_ms: utilisation, power,
    temperature, clocks. pcie_interval_ms: PCIe throughput on its own thread (0: off). capacity:
    memory samples kept (the oldest are dropped; peaks still see every sample).
    """

    def __init__(self, interval_ms=1.0, device=None, model=None, report=None, file=None, plot=None,
                 slow_interval_ms=50.0, pcie_interval_ms=0.0, capacity=131072):
        if report not in ("table", "json", None):
            raise ValueError(f"report: expected 'table', 'json' or None, got {report!r}")
        if not (isinstance(interval_ms, (int, float)) and interval_ms > 0):
            raise ValueError(f"interval_ms: expected a positive number of milliseconds, got {interval_ms!r}")
        self.interval_ms = float(interval_ms)
        self.slow_interval_ms = max(float(slow_interval_ms), self.interval_ms)
        self.pcie_interval_ms = float(pcie_interval_ms)
        self.capacity = int(capacity)
        self.model = model
        self.report_format = report
        self.file = file
        self.plot_path = plot
        self._device_arg = device
        self._sampler = None
        self._running = False
        self._report = None
        self._hooks = None

    # -- device resolution: torch index for the allocator, NVML index or UUID for the sampler --
    def _resolve(self):
        torch = _torch()
        self.torch = torch
        self.torch_device = None
        dev = self._device_arg
        torch_cuda = torch is not None and torch.cuda.is_available()
        if torch_cuda:
            if dev is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            elif isinstance(dev, int):
                dev = torch.device("cuda", dev)
            else:
                dev = torch.device(dev)
            if dev.type == "cuda":
                self.torch_device = torch.device("cuda", dev.index if dev.index is not None
                                                 else torch.cuda.current_device())
        if self.torch_device is not None:
            self.device_label = str(self.torch_device)
            nvml_device = self.torch_device.index
            try:  # NVML counts devices its own way; the UUID names the one torch uses
                uuid = str(torch.cuda.get_device_properties(self.torch_device).uuid)
                nvml_device = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
            except Exception:
                pass
        else:
            index = dev if isinstance(dev, int) else (getattr(dev, "index", None) or 0)
            self.device_label = f"nvml:{index}"
            nvml_device = index
        return nvml_device

    def _open_sampler(self, nvml_device):
        self.nvml_reason = None
        try:
            return _C.Monitor(nvml_device, self.interval_ms, self.slow_interval_ms, self.pcie_interval_ms,
                              self.capacity)
        except _C.NvmlError as e:
            if isinstance(nvml_device, str):  # an old NVML without UUID lookup: fall back to the index
                try:
                    return _C.Monitor(self.torch_device.index, self.interval_ms, self.slow_interval_ms,
                                      self.pcie_interval_ms, self.capacity)
                except _C.NvmlError:
                    pass
            self.nvml_reason = str(e)
            return None

    def start(self):
        """Reset torch's peaks, start the sampler (and hooks). Returns self."""
        if self._running:
            raise RuntimeError("MemoryMonitor.start(): already running")
        nvml_device = self._resolve()
        if self._sampler is None:
            self._sampler = self._open_sampler(nvml_device)
        torch = self.torch
        self._torch_start = None
        if self.torch_device is not None:
            torch.cuda.synchronize(self.torch_device)  # creates the context, so the baseline includes it
            torch.cuda.reset_peak_memory_stats(self.torch_device)
            stats = torch.cuda.memory_stats(self.torch_device)
            self._torch_start = {"reserved": torch.cuda.memory_reserved(self.torch_device),
                                 "retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}
        self._used_at_start = None
        if self._sampler is not None:
            self._used_at_start, _, _, self._total = self._sampler.read_memory()
        if self.model is not None:
            allocated = None
            if self.torch_device is not None:
                dev = self.torch_device
                allocated = functools.partial(torch.cuda.memory_allocated, dev)
            self._hooks = _ModuleHooks(self.model, allocated)
        if self._sampler is None and self.torch_device is None:
            _logger.warning("hotloop.MemoryMonitor: no GPU to watch (NVML: %s; torch sees no CUDA device)",
                            self.nvml_reason)
        self._loader_start = _loader_wait()
        self._oom = None
        self._t0 = time.monotonic()
        if self._sampler is not None:
            self._sampler.start()
        self._running = True
        return self

    def stop(self) -> MemoryReport:
        """Stop the sampler (its thread is joined), remove hooks, and build the report."""
        if not self._running:
            if self._report is None:
                raise RuntimeError("MemoryMonitor.stop(): not started")
            return self._report
        if self._sampler is not None:
            self._sampler.stop()
        self._t1 = time.monotonic()
        self._running = False
        if self._hooks is not None:
            self._hooks.remove()
        self._report = self._build_report()
        return self._report

    def report(self) -> MemoryReport:
        """The report: the final one after stop(), else one of the run so far."""
        if self._running:
            self._t1 = time.monotonic()
            return self._build_report()
        if self._report is None:
            raise RuntimeError("MemoryMonitor.report(): not started")
        return self._report

    @property
    def timeline(self) -> Timeline:
        if self._sampler is None:
            return Timeline()
        return Timeline(self._sampler.snapshot(), getattr(self, "_t0", 0.0))

    @property
    def running(self):
        return self._running

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        # the block's result or exception comes out unchanged, whatever happens to the report
        try:
            self._exit_with(exc)
        except Exception:
            _logger.warning("hotloop.MemoryMonitor: no report for this run", exc_info=True)
            self._abandon()
        return False

    def _exit_with(self, exc):
        if exc is not None and isinstance(exc, _oom_types(self.torch)):
            self.note_oom(exc)
        report = self.stop()
        if exc is not None and self._oom is not None:
            try:
                exc.hotloop_report = report
            except AttributeError:
                pass
            self._emit(report, force=True)
        else:
            self._emit(report)

    def _abandon(self):
        """stop sampling and unhook without a report"""
        if self._sampler is not None:
            self._sampler.stop()
        if self._hooks is not None:
            self._hooks.remove()
        self._running = False

    def note_oom(self, exc):
        """Record what memory looked like when `exc` (torch.OutOfMemoryError) was raised."""
        oom = {"message": str(exc).split("\n")[0][:500], "requested_bytes": _parse_size(str(exc)),
               "free_bytes": None, "total_bytes": None, "reserved_bytes": None, "allocated_bytes": None,
               "fragmentation_bytes": None}
        if self._sampler is not None:
            try:
                _, _, oom["free_bytes"], oom["total_bytes"] = self._sampler.read_memory()
            except _C.NvmlError:
                pass
        torch = self.torch
        if self.torch_device is not None:
            if oom["free_bytes"] is None:
                oom["free_bytes"], oom["total_bytes"] = torch.cuda.mem_get_info(self.torch_device)
            oom["reserved_bytes"] = torch.cuda.memory_reserved(self.torch_device)
            oom["allocated_bytes"] = torch.cuda.memory_allocated(self.torch_device)
            oom["fragmentation_bytes"] = oom["reserved_bytes"] - oom["allocated_bytes"]
        self._oom = oom

    def _emit(self, report, force=False):
        out = self.file if self.file is not None else sys.stderr
        fmt = self.report_format or ("table" if force else None)
        if fmt == "table":
            print(str(report), file=out, flush=True)
        elif fmt == "json":
            print(report.to_json(), file=out, flush=True)
        if self.plot_path:
            try:
                report.plot(self.plot_path)
            except ImportError as e:
                print(f"hotloop: no plot: {e}", file=out)

    def _build_report(self) -> MemoryReport:
        r = MemoryReport(device=self.device_label, duration_s=self._t1 - self._t0, interval_ms=self.interval_ms)
        torch = self.torch
        r.nvml = self._sampler is not None
        r.nvml_unavailable_reason = self.nvml_reason
        r.torch_cuda = self.torch_device is not None
        if r.torch_cuda:
            dev = self.torch_device
            r.device_name = torch.cuda.get_device_name(dev)
            stats = torch.cuda.memory_stats(dev)
            r.peak_allocated = int(torch.cuda.max_memory_allocated(dev))
            r.peak_reserved = int(torch.cuda.max_memory_reserved(dev))
            r.fragmentation_at_peak = r.peak_reserved - r.peak_allocated
            r.inactive_split_peak = int(stats.get("inactive_split_bytes.all.peak", 0))
            r.alloc_retries = int(stats.get("num_alloc_retries", 0) - self._torch_start["retries"])
            r.ooms = int(stats.get("num_ooms", 0) - self._torch_start["ooms"])
        if r.nvml:
            s = self._sampler.snapshot()
            r.timeline = Timeline(s, self._t0)
            if s["memory_samples"]:
                r.peak_device_used = int(s["peak_used"])
                r.peak_time_s = s["peak_t"] - self._t0
                r.driver_reserved = int(s["reserved_at_peak"])
            r.device_total = int(self._total)
            if r.device_name is None:
                try:
                    r.device_name = _C.nvml_device_info(self._sampler.device).get("name")
                except (_C.NvmlError, ValueError):
                    pass
            if r.torch_cuda:
                r.context_baseline = int(self._used_at_start - self._torch_start["reserved"])
                if r.peak_device_used is not None:
                    r.non_torch_at_peak = max(0, r.peak_device_used - r.peak_reserved - r.context_baseline)
            else:
                r.context_baseline = int(self._used_at_start)
            r.util_mean = None if s["util_mean"] < 0 else s["util_mean"]
            r.power_mean_w = None if s["power_mean_w"] < 0 else s["power_mean_w"]
            r.power_max_w = None if s["power_max_mw"] is None else s["power_max_mw"] / 1e3
            r.temperature_max_c = s["temperature_max_c"]
            r.sm_clock_min_mhz = s["sm_clock_min_mhz"]
            r.sm_clock_max_mhz = s["sm_clock_max_mhz"]
            r.throttle_reasons = reason_names(s["reasons_seen"])
            r.samples = int(s["memory_samples"])
            r.samples_kept = len(r.timeline.memory)
            r.samples_dropped = int(s["memory_dropped"])
            r.ticks_missed = int(s["ticks_missed"])
            span = (s["last_t"] - s["first_t"])
            r.sample_rate_hz = (r.samples - 1) / span if r.samples > 1 and span > 0 else None
            r.nvml_errors = s["error"]
            try:
                limit = _C.nvml_device_info(self._sampler.device).get("power_limit_mw")
                r.power_limit_w = None if limit is None else limit / 1e3
            except (_C.NvmlError, ValueError):
                pass
        loader_end = _loader_wait()
        if self._loader_start is not None and loader_end is not None:
            r.loader_wait_s = loader_end - self._loader_start
            r.stall_fraction = r.loader_wait_s / r.duration_s if r.duration_s > 0 else 0.0
        if self._hooks is not None:
            r.modules = self._hooks.modules()
            r.autocast_seen = self._hooks.autocast_seen
            r.fp32_matmul_seen = self._hooks.fp32_matmul_seen
        r.oom = self._oom
        r.advice = compute_advice(r)
        return r

    def __del__(self):
        sampler = getattr(self, "_sampler", None)
        if sampler is not None and self._running:
            sampler.stop()


def memory_monitor(fn=None, *, interval_ms=1.0, device=None, model=None, report="table", file=None, plot=None,
                   **options):
    """Decorate a train function: its run is monitored and a MemoryReport is printed when it returns.

        @hotloop.memory_monitor
        def train(): ...

        @hotloop.memory_monitor(model=model, report="json", plot="memory.png")
        def train(): ...

    The function's return value and exceptions are unchanged; the last report is kept on
    `train.last_report`. On torch.OutOfMemoryError the report (with the failed request, free memory
    and fragmentation) is printed and attached to the exception as `err.hotloop_report`.
    Options are MemoryMonitor's.
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"memory_monitor: expected a function or keyword options, got {fn!r}")

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            monitor = MemoryMonitor(interval_ms=interval_ms, device=device, model=model, report=report, file=file,
                                    plot=plot, **options)
            try:
                with monitor:
                    return func(*args, **kwargs)
            finally:
                wrapper.last_report = monitor._report

        wrapper.last_report = None
        return wrapper

    return decorate(fn) if fn is not None else decorate
