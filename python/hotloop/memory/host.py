"""Host memory for the memory report: the C host sampler's readings (hotloop._C.HostSampler) turned into
the report's figures — the process tree's peak, each DataLoader worker's growth, the machine — and the
copy-on-read finding.

NOTE [ Copy-on-read in DataLoader workers ]
A worker forked from the training process shares the dataset's pages with it until one is written.
CPython writes an object whenever it reads it: a reference count goes up and down on every access.
So a dataset that holds its samples as Python objects (a list of paths, a dict of labels, a list of
floats) is copied into every worker page by page as __getitem__ touches it, and each worker's memory
grows steadily with the samples it has served, until the machine runs out (PyTorch issue #13246).
numpy arrays and tensors hold their data in one buffer with one reference count: reading them writes
nothing, so they stay shared. The finding fires when a worker's USS (the pages it alone holds: a copied
page is one) grows by a sizeable amount, whether steadily (it has not touched every page yet, or it leaks:
the forecast says when the machine runs out) or up to a plateau (it has copied all of it: num_workers
workers hold num_workers copies). The report's totals use PSS (each process's share of every page
it maps), whose figures add up across processes to the tree's real use; a worker's PSS is a poor
measure of its growth, since it also moves whenever another process starts or stops sharing a page.
"""
import dataclasses
import logging
import threading

from .. import _C

_logger = logging.getLogger(__name__)

MiB = float(1 << 20)
STEADY_MIN_BYTES = 16 << 20  # a worker must grow at least this much, first reading to last, to be flagged
STEADY_MIN_R2 = 0.8          # and grow steadily: the straight line through its PSS explains this share of it
STEADY_MIN_SAMPLES = 5       # host ticks in the worker's life
COPY_MIN_BYTES = 16 << 20    # a worker's USS growth from which copy-on-read is named (steady or to a plateau)
COPY_MIN_SHARE = 0.05        # and at least this share of main's anonymous memory (RssAnon) as the window opened:
                             # what a fork could have copied (its USS would count the private pages of the
                             # libraries it maps, the CUDA ones among them, which no worker copies)
LOW_AVAILABLE_SHARE = 0.03   # available memory below this share of the total (or LOW_AVAILABLE_BYTES): "near zero"
LOW_AVAILABLE_BYTES = 256 << 20


@dataclasses.dataclass
class ProcessMemory:
    """One process of the tree over the run, and what it is (`role`): this one ("main"); a DataLoader worker,
    hotloop's ("worker": a fork of main or of hotloop's launcher) or torch's ("torch worker": a
    multiprocessing child running torch's worker loop, or named so by torch); hotloop's launcher
    ("launcher": a fork of main that forks workers); or another child ("child", its command name in
    `command`)."""
    pid: int
    ppid: int
    role: str
    start_s: float  # its first and last reading, seconds since the monitor started
    end_s: float
    first_pss: int
    last_pss: int
    peak_pss: int
    first_uss: int
    last_uss: int
    growth_bytes: int            # last_uss - first_uss: the pages it came to hold alone
    growth_bytes_per_s: float    # the least-squares slope of its USS
    steadiness: float            # r squared of that line (None with too few readings or a flat line)
    readings: int = 0            # host ticks that read it
    samples: float = None        # samples it served while watched (estimated: the loop's samples shared out among
                                 # the workers by their CPU time, the same work per sample)
    growth_mib_per_1k_samples: float = None
    cpu_s: float = 0.0
    exited: bool = False         # vanished while watched
    available_at_exit: int = None  # the machine's available memory at its last reading, when it vanished
    low_memory_exit: bool = False  # vanished while available memory was near zero, or growing steadily while the
                                   # kernel's OOM killer struck: the OOM killer's likely victim
    steady_growth: bool = False
    command: str = ""            # its command name (/proc/PID/comm)
    unreadable: bool = False     # there, but its memory could not be read (another user's): its figures are not 0,
                                 # they are unknown
    copied: bool = False         # a worker whose USS grew by COPY_MIN_BYTES and COPY_MIN_SHARE: copy-on-read

    @property
    def is_worker(self):
        return self.role in ("worker", "torch worker")


def _proc_number(path, key):
    """The first number on the line of a /proc file that starts with `key`; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def oom_kills():
    """The kernel's count of OOM kills since boot (/proc/vmstat oom_kill, Linux 4.13+); None where it
    cannot be read. A worker that died of SIGKILL while this rose was most likely the OOM killer's."""
    return _proc_number("/proc/vmstat", "oom_kill ")


def death_by_oom(exitcode, kills_before) -> str:
    """What a worker's death message adds when the worker died of SIGKILL and the kernel's OOM killer
    killed since `kills_before` (oom_kills() read earlier): '' otherwise."""
    import signal

    now = oom_kills()
    if exitcode != -signal.SIGKILL or now is None or kills_before is None or now <= kills_before:
        return ""
    machine = _C.machine_memory() or {}
    left = (f" ({machine['available'] / (1 << 30):.2f} GiB available now of {machine['total'] / (1 << 30):.2f} GiB)"
            if machine else "")
    return (f"; the kernel's OOM killer killed {now - kills_before} process(es) meanwhile (/proc/vmstat oom_kill): "
            f"the machine ran out of host memory{left}. Workers whose memory grows with every sample are the "
            "usual cause: copy-on-read of a dataset held as Python objects (@hotloop.memory_monitor reports each "
            "worker's growth); hold it in numpy arrays or tensors, or a memory-mapped file, or use fewer workers")


_shared = {}  # (interval_ms, capacity, pss_budget) -> a HostSampler: NOTE [ Sampler windows ] in csrc/host_sampler.c
_shared_lock = threading.Lock()


def shared_sampler(interval_ms, capacity, pss_budget):
    """The process's HostSampler for these settings, made on first use and kept: a monitor opens a window on it."""
    key = (float(interval_ms), int(capacity), float(pss_budget))
    with _shared_lock:
        sampler = _shared.get(key)
        if sampler is None:
            sampler = _shared[key] = _C.HostSampler(interval_ms, interval_ms, capacity, True, pss_budget)
        return sampler


def torch_worker_pids():
    """The pids of this process's multiprocessing children that run torch's DataLoader worker loop."""
    import multiprocessing

    pids = set()
    for child in multiprocessing.active_children():
        target = getattr(child, "_target", None)
        if getattr(target, "__module__", "").startswith("torch.utils.data") and child.pid:
            pids.add(child.pid)
    return pids


class HostWatch:
    """One MemoryMonitor's window on the shared host sampler; `reason` says why there is none."""

    def __init__(self, interval_ms, capacity, pss_budget):
        self.reason = None
        self.sampler = None
        self.window = None
        self.closed = None
        self.torch_workers = set()
        self.main_anon = None  # main's RssAnon as the window opened: what its workers could copy
        try:
            self.sampler = shared_sampler(interval_ms, capacity, pss_budget)
        except (OSError, ValueError) as e:
            self.reason = str(e)

    def start(self):
        self.oom_kills_at_start = oom_kills()
        self.main_anon = rss_anon()
        if self.sampler is None:
            return
        try:
            self.window = self.sampler.open_window()
        except OSError as e:  # no /proc (not Linux): the report says so
            self.reason = f"/proc cannot be read: {e}"
            self.sampler = None
        self.torch_workers |= torch_worker_pids()

    def stop(self):
        if self.window is not None:
            self.torch_workers |= torch_worker_pids()
            self.closed = self.sampler.close_window(self.window)
            self.window = None
        now, before = oom_kills(), getattr(self, "oom_kills_at_start", None)
        self.oom_kills = None if now is None or before is None else now - before

    def snapshot(self):
        if self.window is not None:
            self.torch_workers |= torch_worker_pids()
            return self.sampler.snapshot(window=self.window)
        return self.closed


def _line(p):
    """slope (bytes/s) and r squared of a process's USS against time, from the sampler's sums (MiB, s)"""
    n = p["samples"]
    if n < 3:
        return 0.0, None
    sxx = n * p["sum_tt"] - p["sum_t"] ** 2
    sxy = n * p["sum_tp"] - p["sum_t"] * p["sum_p"]
    syy = n * p["sum_pp"] - p["sum_p"] ** 2
    if sxx <= 0:
        return 0.0, None
    slope = sxy / sxx * MiB
    r2 = (sxy * sxy) / (sxx * syy) if syy > 1e-12 else None
    return slope, r2


def _roles(seen, main_pid, torch_workers, hotloop_fed):
    """{pid: (role, command)} from what each process is (ProcessMemory's roles): torch's workers by the pids
    multiprocessing knows; hotloop's launcher as a fork of main that forks; its workers as forks of main or of the
    launcher, when hotloop's DataLoader fed the run or a launcher was seen."""
    forks_of = {}
    for p in seen:
        if p["forked"]:
            forks_of.setdefault(p["ppid"], []).append(p["pid"])
    launchers = {p["pid"] for p in seen if p["forked"] and p["ppid"] == main_pid and p["pid"] not in torch_workers
                 and p["pid"] in forks_of}
    roles = {}
    for p in seen:
        pid, command = p["pid"], p["comm"]
        if pid == main_pid:
            role = "main"
        elif pid in torch_workers or command == "pt_data_worker":  # the name torch's workers give themselves
            role = "torch worker"
        elif pid in launchers:
            role = "launcher"
        elif p["forked"] and (p["ppid"] in launchers or (p["ppid"] == main_pid and (hotloop_fed or launchers))):
            role = "worker"
        else:
            role = "child"
        roles[pid] = (role, command)
    return roles


def rss_anon(pid="self"):
    """A process's resident anonymous memory in bytes (RssAnon of /proc/PID/status, a counter the kernel keeps, so
    reading it walks no page table), where its heap and Python's objects live; None where it cannot be read."""
    kib = _proc_number(f"/proc/{pid}/status", "RssAnon:")
    return None if kib is None else kib * 1024


def processes_of(snapshot, t0, loader_samples, torch_workers=(), hotloop_fed=False, main_anon=None):
    """The ProcessMemory of every process the sampler saw, main first. loader_samples: how many samples
    the loop consumed (None where unknown), shared out among the workers by their CPU time: a process
    of the tree that serves no samples (a leftover worker of another loader, a subprocess) uses none.
    torch_workers: pids of torch's DataLoader workers; hotloop_fed: hotloop's DataLoader fed the run."""
    seen = snapshot["processes"]
    main_pid = snapshot["main_pid"]
    total = snapshot["total"] or 0
    low = max(LOW_AVAILABLE_SHARE * total, LOW_AVAILABLE_BYTES)
    roles = _roles(seen, main_pid, set(torch_workers), hotloop_fed)
    out = []
    for p in seen:
        role, command = roles[p["pid"]]
        slope, r2 = _line(p)
        exited = not p["alive"]
        out.append(ProcessMemory(
            pid=p["pid"], ppid=p["ppid"], role=role, start_s=p["first_t"] - t0, end_s=p["last_t"] - t0,
            first_pss=p["first_pss"], last_pss=p["last_pss"], peak_pss=p["peak_pss"], first_uss=p["first_uss"],
            last_uss=p["last_uss"], growth_bytes=p["last_uss"] - p["first_uss"], growth_bytes_per_s=slope,
            steadiness=r2, readings=p["samples"], cpu_s=p["cpu_s"], exited=exited,
            available_at_exit=p["available_last"] if exited else None,
            low_memory_exit=exited and p["available_last"] < low, command=command, unreadable=p["unreadable"]))
    main = next((p for p in out if p.role == "main"), None)
    copyable = main_anon if main_anon else (main.first_uss if main is not None else 0)
    workers = [w for w in out if w.is_worker]
    cpu = sum(w.cpu_s for w in workers)
    for w in workers:
        if loader_samples and cpu > 0 and w.cpu_s > 0:
            w.samples = loader_samples * w.cpu_s / cpu
            w.growth_mib_per_1k_samples = w.growth_bytes / w.samples * 1000 / MiB
        w.steady_growth = (w.readings >= STEADY_MIN_SAMPLES and w.growth_bytes >= STEADY_MIN_BYTES
                           and w.growth_bytes_per_s > 0 and (w.steadiness or 0) >= STEADY_MIN_R2)
        w.copied = (w.readings >= 2 and w.growth_bytes >= COPY_MIN_BYTES
                    and w.growth_bytes >= COPY_MIN_SHARE * copyable)
    out.sort(key=lambda x: (x.role != "main", x.start_s, x.pid))
    return out


def forecast(processes, available, samples_per_s):
    """When workers grow steadily: how long (and, where the loop's samples are counted, how many samples)
    until the machine's `available` memory is gone at their combined rate, while as many of them live
    at once as did here. None when nothing grows steadily."""
    steady = [w for w in processes if w.steady_growth]
    if not steady or not available:
        return None
    together = max(sum(1 for o in steady if o.start_s <= 0.5 * (w.start_s + w.end_s) <= o.end_s) for w in steady)
    rate = sum(w.growth_bytes_per_s for w in steady) / len(steady) * together
    seconds = available / rate
    return {"seconds": seconds, "samples": None if not samples_per_s else int(seconds * samples_per_s),
            "bytes_per_s": rate, "available_bytes": int(available), "workers": together}


def torch_pinned_peak(torch):
    """The peak of torch's caching host (pinned) allocator, where torch reports it; else None."""
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    value = stats.get("allocated_bytes.all.peak", stats.get("reserved_bytes.all.peak"))
    return None if value is None else int(value)


def fill(r, snapshot, t0, loader_samples, torch, oom_kill_count=None, torch_workers=(), hotloop_fed=False,
         main_anon=None):
    """Set the host fields of the report `r` (a MemoryReport) from the sampler's snapshot (a window's)."""
    import numpy as np

    from .timeline import host_records

    r.host = True
    ticks = snapshot["ticks"]
    r.host_samples = int(ticks)
    r.host_interval_ms = snapshot["interval_s"] * 1e3
    r.host_ticks_missed = int(snapshot["ticks_missed"])
    r.host_sampler_s = snapshot["read_s"] + snapshot["scan_s"]
    r.host_peak_bytes = int(snapshot["peak_tree_pss"])
    r.host_peak_main_bytes = int(snapshot["peak_main_pss"])
    r.host_peak_children_bytes = r.host_peak_bytes - r.host_peak_main_bytes
    r.host_peak_processes = int(snapshot["peak_processes"])
    r.host_peak_time_s = snapshot["peak_t"] - t0 if snapshot["peak_t"] else None
    r.host_unreadable = int(snapshot["unreadable_max"])
    r.host_before_run = bool(snapshot["before"])
    r.host_total_bytes = int(snapshot["total"])
    r.host_available_min_bytes = int(snapshot["min_available"])
    r.host_swap_total_bytes = int(snapshot["swap_total"])
    r.host_swap_used_max_bytes = int(snapshot["max_swap_used"])
    host = host_records(snapshot["host"])
    if len(host) > 1:
        span = host["t"][-1] - host["t"][0]
        r.host_sample_rate_hz = (len(host) - 1) / span if span > 0 else None
    r.host_locked_max_bytes = int(np.max(host["main_locked"])) if len(host) else None
    r.pinned_torch_peak_bytes = torch_pinned_peak(torch)
    samples_per_s = loader_samples / r.duration_s if loader_samples and r.duration_s > 0 else None
    r.loader_samples = loader_samples or None
    r.host_processes = processes_of(snapshot, t0, loader_samples, torch_workers, hotloop_fed, main_anon)
    r.host_oom_kills = oom_kill_count
    if oom_kill_count:  # the OOM killer struck: the workers that vanished growing steadily are its likely victims
        for p in r.host_processes:
            if p.exited and p.is_worker and p.steady_growth:
                p.low_memory_exit = True
    main = [p for p in r.host_processes if p.role == "main"]
    r.cpu_main_s = main[0].cpu_s if main else None
    r.cpu_children_s = sum(p.cpu_s for p in r.host_processes if p.role != "main")
    available_now = int(host["available"][-1]) if len(host) else r.host_available_min_bytes
    r.host_forecast = forecast(r.host_processes, available_now, samples_per_s)
