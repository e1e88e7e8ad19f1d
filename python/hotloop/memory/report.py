"""MemoryReport: what a monitored run used, from NVML, torch's caching allocator and /proc, with advice."""
import dataclasses
import json

from .plot import plot_report
from .text import format_report
from .timeline import Timeline


@dataclasses.dataclass
class ModuleMemory:
    """What one module's forward kept alive (activations saved for backward plus its output)."""
    name: str
    activation_bytes: int  # memory_allocated() after forward minus before, at least 0 (max over calls)
    output_bytes: int      # bytes of the tensors it returned
    calls: int
    backward_allocated_bytes: int = 0  # memory_allocated() when backward reached its output (max)


@dataclasses.dataclass
class MemoryReport:
    """What a monitored run used, from NVML and from torch's caching allocator, with advice.

    Sizes are bytes, None where the source was unavailable (the GPU's fields without a GPU: the keys
    are the same either way). After a gather (all_ranks=True) the
    group's first rank holds every rank's row in `ranks`, and its advice says where they differ.
    `str(report)` is a table;
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
    util_jpeg_mean: float = None  # the hardware JPEG decoders' (NVML), over the kept samples; None where absent
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
    # the host (hotloop._C.HostSampler: /proc); None where /proc cannot be read. PSS: each process's share
    # of every page it maps, so the processes' figures add up to the tree's real use
    host: bool = False
    host_unavailable_reason: str = None
    host_peak_bytes: int = None           # PSS of this process and every descendant at the tick it peaked
    host_peak_time_s: float = None
    host_peak_main_bytes: int = None      # this process's part of it
    host_peak_children_bytes: int = None  # its descendants' part (DataLoader workers, launchers)
    host_peak_processes: int = None
    host_before_run: bool = False         # the run was shorter than a whole round of PSS readings: the peak is
                                          # the last round's before it
    host_unreadable: int = None           # processes of the tree there but unreadable (another user's), most at once
    host_locked_max_bytes: int = None     # page-locked (mlock) in this process, the most seen
    pinned_torch_peak_bytes: int = None   # torch's caching host (pinned) allocator, where torch reports it
    host_total_bytes: int = None
    host_available_min_bytes: int = None
    host_swap_total_bytes: int = None
    host_swap_used_max_bytes: int = None
    cpu_main_s: float = None              # CPU time (user + system) of this process while watched
    cpu_children_s: float = None          # and of its descendants
    host_processes: list = dataclasses.field(default_factory=list)  # ProcessMemory, this process first
    host_oom_kills: int = None            # OOM kills the kernel made on the machine while watched (/proc/vmstat)
    host_forecast: dict = None            # when workers grow steadily: when the machine runs out (seconds, samples)
    host_samples: int = None
    host_sample_rate_hz: float = None
    host_interval_ms: float = None
    host_ticks_missed: int = None
    host_sampler_s: float = None          # time the host sampler's thread spent reading /proc
    loader_samples: int = None            # samples hotloop.DataLoader handed out while watched
    # hotloop.DataLoader
    loader_wait_s: float = None
    stall_fraction: float = None
    loader_ring_bytes: int = None  # the most host shared memory hotloop.DataLoader rings held at once
    # model=
    modules: list = dataclasses.field(default_factory=list)
    autocast_seen: bool = None
    fp32_matmul_seen: bool = None
    # torch.OutOfMemoryError inside the run
    oom: dict = None
    # report(all_ranks=True) under torch.distributed: this rank in its group, and on the group's first
    # rank every rank's row (RankMemory, in rank order; empty on the other ranks)
    rank: int = None
    world_size: int = None
    ranks: list = dataclasses.field(default_factory=list)
    advice: list = dataclasses.field(default_factory=list)
    timeline: Timeline = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "timeline":
                continue
            value = getattr(self, f.name)
            if f.name in ("modules", "ranks", "host_processes"):
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
