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

Under torch.distributed, all_ranks=True gathers every rank's peaks, their parts and its data-loader
stalls to the group's first rank, which prints one table with a row per rank and flags an imbalance
(the heaviest peak over the lightest above 1.1) with what differs and its likely causes.
"""
import functools
import logging
import os
import re
import sys
import threading
import time

from .. import _C, input_wait
from .._arguments import expect_count, expect_positive
from .advice import compute_advice, compute_rank_advice
from .clock_reasons import reason_names
from .hooks import ModuleHooks
from .host import HostWatch, fill as fill_host
from .ranks import RankMemory, gather_rows, group_rank
from .report import MemoryReport
from .timeline import Timeline

_logger = logging.getLogger(__name__)


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None




_no_gpu_said = False

# NVML samplers, kept per process and settings: made once (opening NVML and finding the device is the slow part),
# started and stopped by each monitor; a monitor nested in another, or in another thread, takes one of its own.
_nvml_pool = {}
_nvml_refusals = {}  # pool key -> why NVML did not open for it: not tried again at every entry
_pool_lock = threading.Lock()

# NOTE [ Nested torch peaks ]
# torch keeps one peak per device, which a monitor resets when it starts. A monitor that starts while others run
# on the device first folds the peak so far into theirs, so each still reports the largest it saw.
_open_monitors = []
_device_infos = {}  # (pool key, NVML index) -> nvml_device_info() of that device


def _take_sampler(key, make):
    with _pool_lock:
        idle = _nvml_pool.setdefault(key, [])
        if idle:
            return idle.pop()
    return make()


def _give_back_sampler(key, sampler):
    with _pool_lock:
        _nvml_pool.setdefault(key, []).append(sampler)


def _say_no_gpu(nvml_reason, host_reason):
    """Without a GPU the report covers the host; where /proc cannot be read either there is nothing to
    report: one line per process says so (each monitored run used to print a report of nothing, with
    the library loader's error in it); the reasons at debug level."""
    global _no_gpu_said
    _logger.debug("hotloop.memory_monitor: NVML: %s; torch sees no CUDA device; host: %s", nvml_reason, host_reason)
    if not _no_gpu_said:
        _no_gpu_said = True
        _logger.warning("hotloop.memory_monitor: no GPU and no /proc: reporting nothing")


def _nvml_index(dev, torch):
    """The NVML index a device spec names when torch has no CUDA: an int, or what torch.device
    accepts ("cuda:1", torch.device("cuda", 1)); "cuda" alone, or None, is device 0."""
    if dev is None or isinstance(dev, int):
        return dev or 0
    if isinstance(dev, str):
        if torch is None:
            m = re.fullmatch(r"\s*cuda(?::(\d+))?\s*", dev)
            if m is None:
                raise ValueError(f"device: expected an NVML index, 'cuda' or 'cuda:N', got {dev!r}")
            return int(m.group(1) or 0)
        dev = torch.device(dev)
    return getattr(dev, "index", None) or 0


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
    memory samples kept (the oldest are dropped; peaks still see every sample). host_interval_ms: the
    host sampler's period (hotloop._C.HostSampler: /proc/PID/smaps_rollup of this process and every
    descendant, such as DataLoader workers, and the machine's available memory and swap; see
    NOTE [ Host sampling rate ] in csrc/host_sampler.c for why it is slower than the GPU's; one per process
    and settings, on which each monitor opens a window: NOTE [ Sampler windows ]);
    host_pss_budget: the share of one core the costly PSS readings (smaps_rollup) may take.
    Without a GPU the report holds the host's figures, the GPU's fields None.

    all_ranks: under torch.distributed, when the block ends normally every rank of `process_group`
    (default: the default group) sends its figures to the group's first rank (one gather_object: every
    rank must run the block), whose report then holds a row per rank (`report.ranks`), prints them as
    one table and advises on an imbalance; the other ranks keep their own report (rank and world_size
    set, `ranks` empty) and print and plot nothing. A block that raises gathers nothing (the rank that
    failed must not wait for the others) and prints its own report as without all_ranks. Without an
    initialized process group all_ranks changes nothing.
    """

    def __init__(self, interval_ms=1.0, device=None, model=None, report=None, file=None, plot=None,
                 slow_interval_ms=50.0, pcie_interval_ms=0.0, capacity=131072, all_ranks=False,
                 process_group=None, host_interval_ms=50.0, host_pss_budget=0.02):
        if report not in ("table", "json", None):
            raise ValueError(f"report: expected 'table', 'json' or None, got {report!r}")
        expect_positive("MemoryMonitor", "interval_ms", interval_ms)
        expect_positive("MemoryMonitor", "slow_interval_ms", slow_interval_ms)
        expect_positive("MemoryMonitor", "pcie_interval_ms", pcie_interval_ms, zero_ok=True)
        expect_count("MemoryMonitor", "capacity", capacity, least=1)
        expect_positive("MemoryMonitor", "host_interval_ms", host_interval_ms)
        if host_interval_ms < 1.0:
            raise ValueError(f"MemoryMonitor: expected host_interval_ms of at least 1, got {host_interval_ms!r}")
        expect_positive("MemoryMonitor", "host_pss_budget", host_pss_budget)
        if host_pss_budget > 1:
            raise ValueError(f"MemoryMonitor: expected host_pss_budget (a share of one core) of at most 1, "
                             f"got {host_pss_budget!r}")
        if not isinstance(all_ranks, bool):
            raise TypeError(f"MemoryMonitor: expected all_ranks to be True or False, got {all_ranks!r}")
        if model is not None:
            torch = _torch()
            if torch is None or not isinstance(model, torch.nn.Module):
                raise TypeError(f"MemoryMonitor: expected model to be a torch.nn.Module (its modules are hooked), "
                                f"got {type(model).__name__}")
        self.interval_ms = float(interval_ms)
        self.slow_interval_ms = max(float(slow_interval_ms), self.interval_ms)
        self.pcie_interval_ms = float(pcie_interval_ms)
        self.capacity = int(capacity)
        self.host_interval_ms = float(host_interval_ms)
        self.host_pss_budget = float(host_pss_budget)
        self._host = None
        self.model = model
        self.report_format = report
        self.file = file
        self.plot_path = plot
        self._device_arg = device
        self._sampler = None
        self._running = False
        self._report = None
        self._gathered = False
        self._hooks = None
        self.all_ranks = all_ranks
        self.process_group = process_group

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
            nvml_device = _nvml_index(dev, torch)
            self.device_label = f"nvml:{nvml_device}"
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
        # the library is part of the key: HOTLOOP_NVML_LIBRARY chooses it (a fake one in tests)
        self._pool_key = (os.environ.get("HOTLOOP_NVML_LIBRARY"), nvml_device, self.interval_ms,
                          self.slow_interval_ms, self.pcie_interval_ms, self.capacity)
        self.nvml_reason = None
        if self._sampler is None:
            with _pool_lock:
                self.nvml_reason = _nvml_refusals.get(self._pool_key)
            if self.nvml_reason is None:
                self._sampler = _take_sampler(self._pool_key, lambda: self._open_sampler(nvml_device))
                if self._sampler is None:
                    with _pool_lock:
                        _nvml_refusals[self._pool_key] = self.nvml_reason
        torch = self.torch
        self._torch_start = None
        self._torch_peaks = {"allocated": 0, "reserved": 0}
        if self.torch_device is not None:
            torch.cuda.synchronize(self.torch_device)  # creates the context, so the baseline includes it
            with _pool_lock:  # NOTE [ Nested torch peaks ]
                for other in _open_monitors:
                    if other.torch_device == self.torch_device:
                        other._fold_torch_peaks()
                torch.cuda.reset_peak_memory_stats(self.torch_device)
                _open_monitors.append(self)
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
            self._hooks = ModuleHooks(self.model, allocated)
        self._host = HostWatch(self.host_interval_ms, max(1, self.capacity // 16), self.host_pss_budget)
        self._loader_start = input_wait.snapshot()
        self._ring_window = input_wait.open_window()
        self._oom = None
        self._gathered = False
        self._t0 = time.monotonic()
        self._host.start()
        if self._sampler is None and self.torch_device is None and self._host.sampler is None:
            _say_no_gpu(self.nvml_reason, self._host.reason)
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
        self._host.stop()
        self._running = False
        self._leave_open_monitors()
        if self._hooks is not None:
            self._hooks.remove()
        try:
            self._report = self._build_report()
        finally:
            self._release_sampler()
        return self._report

    def _device_info(self):
        """NVML's facts about the device (name, power limit), read once per sampler: a dozen NVML calls are not
        what a monitor's end should cost each time."""
        key = (self._pool_key, self._sampler.device)
        info = _device_infos.get(key)
        if info is None:
            info = _device_infos[key] = _C.nvml_device_info(self._sampler.device)
        return info

    def _fold_torch_peaks(self):
        """Keep torch's peaks so far before another monitor resets them (NOTE [ Nested torch peaks ])."""
        torch, dev = self.torch, self.torch_device
        self._torch_peaks["allocated"] = max(self._torch_peaks["allocated"], int(torch.cuda.max_memory_allocated(dev)))
        self._torch_peaks["reserved"] = max(self._torch_peaks["reserved"], int(torch.cuda.max_memory_reserved(dev)))

    def _leave_open_monitors(self):
        with _pool_lock:
            if self in _open_monitors:
                _open_monitors.remove(self)

    def _release_sampler(self):
        """The NVML sampler back to the pool, for the next monitor with the same settings."""
        if self._sampler is not None:
            _give_back_sampler(self._pool_key, self._sampler)
            self._sampler = None

    def report(self, all_ranks=False, process_group=None) -> MemoryReport:
        """The report: the final one after stop(), else one of the run so far.

        all_ranks=True, under torch.distributed: a collective over process_group (default: the
        monitor's, else the default group) that every rank must call; the group's first rank gets
        a report with every rank's row in `ranks` and advice on where they differ, the others their
        own. A final report gathered once (by the block's end with all_ranks=True, or by an earlier
        call) is returned again without a collective. Without an initialized process group, the
        same as all_ranks=False."""
        if not isinstance(all_ranks, bool):
            raise TypeError(f"MemoryMonitor.report(): expected all_ranks to be True or False, got {all_ranks!r}")
        if self._running:
            self._t1 = time.monotonic()
            report = self._build_report()
            return self._gather(report, process_group) if all_ranks else report
        if self._report is None:
            raise RuntimeError("MemoryMonitor.report(): not started")
        if all_ranks and not self._gathered:
            self._report = self._gather(self._report, process_group)
            self._gathered = True
        return self._report

    def _gather(self, report, process_group=None):
        """report with every rank's row on the group's first rank (a collective); report unchanged
        where torch.distributed is not initialized or this process is not in the group."""
        group = process_group if process_group is not None else self.process_group
        where = group_rank(group)
        if where is None or where[0] < 0:
            return report
        report.rank, report.world_size = where
        rows = gather_rows(RankMemory.of(report, report.rank), group)
        if rows is not None:
            report.ranks = rows
            report.advice = report.advice + compute_rank_advice(rows)
        return report

    @property
    def timeline(self) -> Timeline:
        if not self._running and self._report is not None:
            return self._report.timeline  # the samplers went back to the pool with the report made
        nvml = None if self._sampler is None else self._sampler.snapshot()
        host = None if self._host is None else self._host.snapshot()
        return Timeline(nvml, getattr(self, "_t0", 0.0), host=host)

    @property
    def running(self):
        return self._running

    @property
    def last_report(self):
        """The report the last stop made (None before one, or when the run ended before it could)."""
        return self._report

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
        elif exc is None and self.all_ranks:
            report = self.report(all_ranks=True)
            if report.rank in (None, 0):  # the other ranks sent theirs to the first: they print nothing
                self._emit(report)
        else:
            self._emit(report)

    def _abandon(self):
        """stop sampling and unhook without a report"""
        if self._sampler is not None:
            self._sampler.stop()
        if self._host is not None:
            self._host.stop()
        if self._hooks is not None:
            self._hooks.remove()
        self._running = False
        self._leave_open_monitors()
        self._release_sampler()

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
        if not report.nvml and not report.torch_cuda and not report.host and not report.ranks:
            return  # no GPU and no /proc: said once per process (_say_no_gpu), the report has nothing to show
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
        if not r.nvml and not r.torch_cuda:
            r.device = None  # no GPU: the GPU's fields stay None, the host's are filled
        if r.torch_cuda:
            dev = self.torch_device
            r.device_name = torch.cuda.get_device_name(dev)
            stats = torch.cuda.memory_stats(dev)
            r.peak_allocated = max(int(torch.cuda.max_memory_allocated(dev)), self._torch_peaks["allocated"])
            r.peak_reserved = max(int(torch.cuda.max_memory_reserved(dev)), self._torch_peaks["reserved"])
            r.fragmentation_at_peak = r.peak_reserved - r.peak_allocated
            r.inactive_split_peak = int(stats.get("inactive_split_bytes.all.peak", 0))
            r.alloc_retries = int(stats.get("num_alloc_retries", 0) - self._torch_start["retries"])
            r.ooms = int(stats.get("num_ooms", 0) - self._torch_start["ooms"])
        host = self._host.snapshot()
        loader_end = input_wait.snapshot()
        if host is not None:
            fill_host(r, host, self._t0, loader_end["samples"] - self._loader_start["samples"], torch,
                      getattr(self._host, "oom_kills", None), self._host.torch_workers,
                      loader_end["batches"] > self._loader_start["batches"], self._host.main_anon)
        else:
            r.host_unavailable_reason = self._host.reason
        r.timeline = Timeline(None, self._t0, host=host)
        if r.nvml:
            s = self._sampler.snapshot()
            r.timeline = Timeline(s, self._t0, host=host)
            if s["memory_samples"]:
                r.peak_device_used = int(s["peak_used"])
                r.peak_time_s = s["peak_t"] - self._t0
                r.driver_reserved = int(s["reserved_at_peak"])
            r.device_total = int(self._total)
            if r.device_name is None:
                try:
                    r.device_name = self._device_info().get("name")
                except (_C.NvmlError, ValueError):
                    pass
            if r.torch_cuda:
                r.context_baseline = int(self._used_at_start - self._torch_start["reserved"])
                if r.peak_device_used is not None:
                    r.non_torch_at_peak = max(0, r.peak_device_used - r.peak_reserved - r.context_baseline)
            else:
                r.context_baseline = int(self._used_at_start)
            r.util_mean = None if s["util_mean"] < 0 else s["util_mean"]
            jpeg = r.timeline.util_jpeg
            jpeg = jpeg[jpeg == jpeg]  # NaN: the GPU has no JPEG engines, or the driver cannot say
            r.util_jpeg_mean = float(jpeg.mean()) if len(jpeg) else None
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
                limit = self._device_info().get("power_limit_mw")
                r.power_limit_w = None if limit is None else limit / 1e3
            except (_C.NvmlError, ValueError):
                pass
        r.loader_ring_bytes = input_wait.close_window(self._ring_window) or None
        if loader_end["batches"] > self._loader_start["batches"]:  # a hotloop.DataLoader fed this run
            r.loader_wait_s = loader_end["wait_seconds"] - self._loader_start["wait_seconds"]
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
        host = getattr(self, "_host", None)
        if host is not None and self._running:
            host.stop()
            self._leave_open_monitors()
