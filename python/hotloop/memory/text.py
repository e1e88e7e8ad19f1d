"""The memory report as text: a table whose lines add up (the GPU's, the host's), the biggest modules,
the processes, the ranks, the advice."""
from .ranks import compared_peaks

GiB = float(1 << 30)
MiB = float(1 << 20)


def format_size(n):
    """Bytes as KiB, MiB or GiB ("-" for None)."""
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


def format_report(r) -> str:
    """The report (a MemoryReport) as the table `str(report)` prints."""
    gpu = r.nvml or r.torch_cuda
    title = "hotloop memory report: " + (f"{r.device}" + (f" ({r.device_name})" if r.device_name else "")
                                         if gpu else "host (no GPU)")
    if r.world_size is not None:
        title += f", rank {r.rank} of {r.world_size}"
    title += f", {r.duration_s:.2f} s"
    rows = []
    if r.nvml and r.peak_device_used is not None:
        parts = []
        if r.context_baseline is not None and r.peak_reserved is not None:
            parts = [f"context {format_size(r.context_baseline)}", f"torch reserved {format_size(r.peak_reserved)}",
                     f"other {format_size(r.non_torch_at_peak)}"]
        rows.append(("peak device used (NVML)", format_size(r.peak_device_used)
                     + (f"  at {r.peak_time_s:.3f} s" if r.peak_time_s is not None else "")
                     + (f"  = {' + '.join(parts)}" if parts else "")))
        if r.device_total:
            rows.append(("  of device total", format_size(r.device_total)))
        rows.append(("  CUDA context (and others) at start" if r.torch_cuda else "  device used at start",
                     format_size(r.context_baseline)))
    elif not r.nvml and r.torch_cuda:
        rows.append(("NVML", f"not available: {r.nvml_unavailable_reason}"))
    if not gpu:
        rows.append(("GPU", "none seen (NVML not available, no CUDA device in torch)"))
    elif r.torch_cuda:
        rows.append(("  torch peak reserved", format_size(r.peak_reserved)))
        rows.append(("    torch peak allocated", format_size(r.peak_allocated)))
        rows.append(("    fragmentation at peak", f"{format_size(r.fragmentation_at_peak)}"
                     f"  (inactive split {format_size(r.inactive_split_peak)})"))
        if r.nvml:
            rows.append(("  outside torch at peak", f"{format_size(r.non_torch_at_peak)}"
                         "  (cuBLAS/cuDNN/NCCL, other libraries)"))
        rows.append(("allocation retries / OOMs", f"{r.alloc_retries} / {r.ooms}"))
    elif gpu:
        rows.append(("torch", "no CUDA device in torch: allocator figures unavailable"))
    if r.nvml:
        rows.append(("GPU utilisation (mean)", "-" if r.util_mean is None else f"{r.util_mean:.0f} %"))
        if r.util_jpeg_mean is not None:  # beside the SMs': what gpu_decode's hardware decoders did
            rows.append(("  JPEG decoders (mean)", f"{r.util_jpeg_mean:.0f} %"))
        power = [("-" if v is None else f"{v:.0f}") for v in (r.power_mean_w, r.power_max_w, r.power_limit_w)]
        rows.append(("power mean / max / limit", " / ".join(power) + " W"))
        rows.append(("temperature max", "-" if r.temperature_max_c is None else f"{r.temperature_max_c} °C"))
        if r.sm_clock_max_mhz is not None:
            rows.append(("SM clock min / max", f"{r.sm_clock_min_mhz} / {r.sm_clock_max_mhz} MHz"))
        rows.append(("clock-event reasons seen", ", ".join(r.throttle_reasons) or "none"))
        rate = "-" if r.sample_rate_hz is None else f"{r.sample_rate_hz:.0f} Hz"
        rows.append(("memory samples", f"{r.samples} at {rate} (asked {1e3 / r.interval_ms:.0f} Hz; "
                     f"{r.samples_dropped} dropped from the ring, {r.ticks_missed} tick"
                     f"{'s' if r.ticks_missed != 1 else ''} missed)"))
        if r.nvml_errors:
            e = r.nvml_errors
            rows.append(("NVML errors", f"{e['count']}, first: {e['call']}: {e['text']} ({e['code']})"))
    rows += host_rows(r)
    if r.stall_fraction is not None:
        rows.append(("data loader stalls", f"{100 * r.stall_fraction:.1f} % of the time ({r.loader_wait_s:.2f} s)"))
    if r.loader_ring_bytes:
        rows.append(("data loader rings", f"{format_size(r.loader_ring_bytes)} of host shared memory at most "
                     "(page-locked with device=)"))
    if r.oom:
        o = r.oom
        rows.append(("OUT OF MEMORY", f"asked for {format_size(o.get('requested_bytes'))} with {format_size(o.get('free_bytes'))}"
                     f" free on the device; torch reserved {format_size(o.get('reserved_bytes'))}, allocated "
                     f"{format_size(o.get('allocated_bytes'))}, fragmentation {format_size(o.get('fragmentation_bytes'))}"))
    width = max(len(k) for k, _ in rows)
    lines = [title] + [f"  {k:<{width}}  {v}" for k, v in rows]
    top = sorted(top_level_modules(r), key=lambda m: -m.activation_bytes)[:8]
    if top:
        lines.append("  activations per module (forward, max over calls):")
        w = max(len(m.name) for m in top)
        for m in top:
            lines.append(f"    {m.name:<{w}}  {format_size(m.activation_bytes):>10}  (output {format_size(m.output_bytes)}, "
                         f"{m.calls} call{'s' if m.calls != 1 else ''})")
    lines += format_processes(r)
    if r.ranks:
        lines += format_ranks(r.ranks)
    if r.advice:
        lines.append("advice:")
        lines += [f"  - {a}" for a in r.advice]
    return "\n".join(lines)


_RANK_COLUMNS = (("peak device used", "peak_device_used"), ("torch reserved", "peak_reserved"),
                 ("allocated", "peak_allocated"), ("fragmentation", "fragmentation_at_peak"),
                 ("outside torch", "non_torch_at_peak"), ("context", "context_baseline"))


def format_ranks(rows) -> list:
    """The gathered rows (RankMemory) as a table, a line per rank, the heaviest and lightest marked;
    columns no rank could fill are left out."""
    columns = [("rank", lambda x: str(x.rank))]
    if len({x.host for x in rows}) > 1:
        columns.append(("host", lambda x: x.host))
    columns.append(("device", lambda x: x.device))
    columns += [(name, lambda x, f=field: format_size(getattr(x, f))) for name, field in _RANK_COLUMNS
                if any(getattr(x, field) is not None for x in rows)]
    if any(x.stall_fraction is not None for x in rows):
        columns.append(("data stalls",
                        lambda x: "-" if x.stall_fraction is None else f"{100 * x.stall_fraction:.1f} %"))
    cells = [[name for name, _ in columns]] + [[cell(x) for _, cell in columns] for x in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    compared = compared_peaks(rows)
    marks = [""] * len(rows)
    if compared is not None and max(compared[0]) > min(compared[0]):
        peaks = compared[0]
        marks[peaks.index(max(peaks))], marks[peaks.index(min(peaks))] = "  <- heaviest", "  <- lightest"
    lines = [f"  per rank ({len(rows)}" + (f"; peaks compared: {compared[1]}" if compared else "") + "):"]
    for row, mark in zip(cells, [""] + marks):
        lines.append("    " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     + mark)
    return lines


def host_rows(r) -> list:
    """The host's rows: the process tree's peak as its parts, the machine, pinned memory, CPU time."""
    if not r.host:
        return [("host memory", f"not read: {r.host_unavailable_reason}")] if r.host_unavailable_reason else []
    others = r.host_peak_processes - 1 if r.host_peak_processes else 0
    if r.host_peak_time_s is None:
        rows = [("peak host memory (PSS)", "not read: the run ended before the sampler's first whole reading")]
    else:
        when = (f"{-r.host_peak_time_s:.3f} s before the run (shorter than one whole round of readings: the last "
                "round before it)" if r.host_before_run else f"at {r.host_peak_time_s:.3f} s (one tick's sum)")
        rows = [("peak host memory (PSS)", f"{format_size(r.host_peak_bytes)}  {when}  = main process "
                 f"{format_size(r.host_peak_main_bytes)} + {others} other process"
                 f"{'es' if others != 1 else ''} {format_size(r.host_peak_children_bytes)}")]
    if r.host_unreadable:
        who = ", ".join(f"pid {p.pid} ({p.command})" for p in r.host_processes if p.unreadable)
        rows.append(("  not counted", f"{r.host_unreadable} process{'es' if r.host_unreadable != 1 else ''} of the "
                     f"tree could not be read at one tick or more (permissions, or a race){': ' + who if who else ''}"))
    swap = (f"; swap used at most {format_size(r.host_swap_used_max_bytes)} of {format_size(r.host_swap_total_bytes)}"
            if r.host_swap_total_bytes else "; no swap")
    rows.append(("  machine", f"{format_size(r.host_total_bytes)} total, {format_size(r.host_available_min_bytes)}"
                 f" available at the least{swap}"))
    pinned = []  # (hotloop's rings have their own line below: page-locked when the loader has a device)
    if r.pinned_torch_peak_bytes is not None:
        pinned.append(f"torch pinned cache {format_size(r.pinned_torch_peak_bytes)}")
    if r.host_locked_max_bytes:
        pinned.append(f"mlocked {format_size(r.host_locked_max_bytes)}")
    if pinned:
        rows.append(("  page-locked (in the main process)", ", ".join(pinned)))
    if r.cpu_main_s is not None:
        rows.append(("CPU time", f"main process {r.cpu_main_s:.2f} s, other processes {r.cpu_children_s:.2f} s"
                     f" (over {r.duration_s:.2f} s)"))
    rate = "-" if r.host_sample_rate_hz is None else f"{r.host_sample_rate_hz:.0f} Hz"
    missed = r.host_ticks_missed
    rows.append(("host samples", f"{r.host_samples} at {rate} (asked {1e3 / r.host_interval_ms:.0f} Hz; "
                 f"{missed} tick{'s' if missed != 1 else ''} missed; the sampler read /proc for "
                 f"{r.host_sampler_s:.3f} s)"))
    if r.host_forecast is not None:
        rows.append(("  at this rate", forecast_text(r.host_forecast)))
    if r.host_oom_kills:
        rows.append(("  kernel OOM kills", f"{r.host_oom_kills} on the machine while watched (/proc/vmstat)"))
    return rows


def forecast_text(f) -> str:
    when = f"~{f['samples']:,} more samples (~{f['seconds']:.0f} s)" if f["samples"] is not None \
        else f"~{f['seconds']:.0f} s"
    workers = f"{f['workers']} worker{'s' if f['workers'] != 1 else ''}"
    return (f"the machine runs out of memory after {when}: {workers} growing "
            f"{f['bytes_per_s'] / MiB:.1f} MiB/s together, {format_size(f['available_bytes'])} available")


def _role_text(p):
    return {"main": "main", "worker": "worker", "torch worker": "worker (torch)", "launcher": "launcher"}.get(
        p.role, f"child ({p.command or '?'})")


def format_processes(r) -> list:
    """A line per process of the tree: what it is, its USS (what it alone holds) at its first and last reading,
    and its growth; main's drop at a fork said as sharing, not as memory freed."""
    shown = [p for p in r.host_processes if p.role == "main" or p.readings > 0 or p.unreadable]
    if len(shown) < 2:
        return []
    workers = sum(1 for p in shown if p.is_worker or p.role == "launcher")
    lines = ["  processes (USS: what each holds alone, first reading -> last):"]
    roles = [_role_text(p) for p in shown[:17]]
    width = max(len(x) for x in roles)
    for p, role in zip(shown[:17], roles):
        if p.unreadable and p.readings == 0:
            lines.append(f"    {role:<{width}} pid {p.pid:<7} unreadable (another user's, or a hardened /proc): not "
                         "counted, not 0 bytes")
            continue
        growth = f"{'+' if p.growth_bytes >= 0 else ''}{format_size(p.growth_bytes)}"
        if p.role == "main" and p.growth_bytes < 0 and workers:
            growth += (f": pages shared with {workers} forked process{'es' if workers != 1 else ''} after the fork, "
                       "not freed")
        if p.growth_mib_per_1k_samples is not None and (p.steady_growth or not p.copied):
            growth += f", {p.growth_mib_per_1k_samples:.1f} MiB per 1,000 samples"
        if p.steady_growth:
            growth += ", steady"
        end = ", alive at the end"
        if p.exited:
            end = ", exited" + (" while available memory was near zero (OOM killer?)" if p.low_memory_exit else "")
        lines.append(f"    {role:<{width}} pid {p.pid:<7} {format_size(p.first_uss):>10} -> "
                     f"{format_size(p.last_uss):>10}"
                     f"  ({growth}; {p.start_s:.2f}-{p.end_s:.2f} s{end})")
    if len(shown) > 17:
        lines.append(f"    ... and {len(shown) - 17} more")
    return lines
