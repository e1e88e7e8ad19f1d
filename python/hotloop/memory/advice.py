"""Advice computed from a memory report's figures: one line per finding, each with what to do."""
import os

from .clock_reasons import POWER_REASONS, SLOWDOWN_REASONS, reason_bits
from .ranks import compared_peaks
from .text import MiB, forecast_text, format_size, top_level_modules

IMBALANCE = 1.1  # the heaviest rank's peak over the lightest's above which the ranks are flagged
STALL_SPREAD = 0.10  # a data-stall share this much larger on one rank than on another is flagged


def compute_advice(r) -> list:
    """One line per finding, computed from the report's (a MemoryReport) figures."""
    advice = []
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:True" in alloc_conf
    frag = r.fragmentation_at_peak
    oom_frag = (r.oom or {}).get("fragmentation_bytes") or 0
    fragmented = (frag is not None and r.peak_reserved and frag > 0.2 * r.peak_reserved and frag > 256 * MiB)
    if not expandable and (fragmented or (r.alloc_retries or 0) > 0 or oom_frag > 256 * MiB):
        what = []
        if fragmented:
            what.append(f"{format_size(frag)} of the {format_size(r.peak_reserved)} torch reserved was not allocated at the peak")
        if r.alloc_retries:
            what.append(f"{r.alloc_retries} allocation retries (cudaMalloc failed, cache flushed)")
        if oom_frag > 256 * MiB:
            what.append(f"{format_size(oom_frag)} reserved but free when the OOM hit")
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
        advice.append(f"activations are {format_size(total_act)} of the {format_size(r.peak_allocated)} peak allocated: "
                      f"gradient checkpointing of {', '.join(m.name for m in chosen)} "
                      f"(torch.utils.checkpoint) would save about {format_size(saving)}")

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
    seen = reason_bits(r.throttle_reasons)
    if seen & POWER_REASONS:
        limit = f" (limit {r.power_limit_w:.0f} W, max drawn {r.power_max_w:.0f} W)" \
            if r.power_limit_w and r.power_max_w else ""
        advice.append(f"clocks held back by the power cap{limit}: expected under full load; if the limit is "
                      "below the default, raise it with your administrator (hotloop never changes it)")
    if seen & SLOWDOWN_REASONS:
        temp = f" (max {r.temperature_max_c} °C)" if r.temperature_max_c is not None else ""
        advice.append(f"thermal or hardware slowdown seen{temp}: check cooling, airflow and fan curves")

    if r.util_mean is None and r.stall_fraction is not None and r.stall_fraction > 0.10:
        advice.append(f"the loop waited on its data loader {100 * r.stall_fraction:.0f} % of the time: raise "
                      "num_workers, or make __getitem__ cheaper")
    advice += host_advice(r)

    if r.oom:
        req, free = r.oom.get("requested_bytes"), r.oom.get("free_bytes")
        if req and free is not None and oom_frag and req <= free + oom_frag:
            advice.append("out of memory although reserved-but-free plus device-free memory would have fit the "
                          "request: fragmentation; expandable_segments:True, or free caches between phases")
        else:
            advice.append("out of memory: lower the batch size, use AMP, or checkpoint the heaviest modules; "
                          "run with model= to see which modules hold the activations")
    return advice


def host_advice(r) -> list:
    """Workers whose private memory grew by a sizeable amount, steadily or to a plateau: copy-on-read (NOTE
    [ Copy-on-read in DataLoader workers ] in memory/host.py), with what each copied, what the workers hold
    together and, where the growth is steady, the forecast; workers gone while the machine's memory was near zero."""
    advice = []
    copied = [p for p in r.host_processes if p.copied or p.steady_growth]
    if copied:
        figures = []
        for p in copied[:4]:
            per = (f", {p.growth_mib_per_1k_samples:.1f} MiB per 1,000 samples"
                   if p.growth_mib_per_1k_samples is not None and p.steady_growth else "")
            how = "and still growing" if p.steady_growth else "then stopped"
            figures.append(f"pid {p.pid} +{format_size(p.growth_bytes)} in {p.end_s - p.start_s:.1f} s{per}, {how}")
        more = f" and {len(copied) - 4} more" if len(copied) > 4 else ""
        # over every worker read twice: workers that served fewer samples copied less
        workers = [p for p in r.host_processes if p.is_worker and p.readings >= 2] or copied
        each = sum(max(p.growth_bytes, 0) for p in workers) / len(workers)
        held = sum(p.last_uss for p in workers) / len(workers)  # what a fork of main has of its own
        n = len(workers)
        line = (f"copy-on-read in DataLoader workers: each worker copied about {format_size(each)} of the main "
                f"process's memory while watched and holds {format_size(held)} of its own ({'; '.join(figures)}"
                f"{more}); {n} worker{'s' if n != 1 else ''} hold {format_size(held * n)} together, and "
                f"num_workers=N holds about N times {format_size(held)}. Each worker inherits the dataset's Python "
                "objects at fork, and every read of one writes its reference count, so the pages holding them are "
                "copied into each worker as __getitem__ touches them (PyTorch issue #13246). Keep the data in numpy "
                "arrays or torch tensors, Arrow, or a memory-mapped file (np.memmap) instead of lists or dicts of "
                "Python objects, or use fewer workers")
        if r.host_forecast is not None:
            line += "; at this rate " + forecast_text(r.host_forecast)
        advice.append(line)
    killed = [p for p in r.host_processes if p.low_memory_exit and p.role != "main"]
    if killed:
        who = ", ".join(f"pid {p.pid} (+{format_size(p.growth_bytes)} since its first reading)" for p in killed[:4])
        kills = (f"; the kernel counted {r.host_oom_kills} OOM kill(s) meanwhile" if r.host_oom_kills else "")
        advice.append(f"process{'es' if len(killed) > 1 else ''} {who} vanished while the machine's available "
                      f"memory was low ({format_size(min(p.available_at_exit for p in killed))} at the last reading"
                      f"{kills}): the kernel's OOM killer likely took them (dmesg says so); lower host memory: fewer "
                      "workers, smaller prefetch_factor, data held in numpy arrays or a memory-mapped file")
    return advice


def _differs(hi, lo, part):
    a, b = part(hi), part(lo)
    return None if a is None or b is None else a - b


def compute_rank_advice(rows) -> list:
    """Where the gathered ranks (RankMemory rows) differ: a peak imbalance (the heaviest over the
    lightest above IMBALANCE), with the part of the difference that dominates and its likely causes;
    and a data-loader stall share that differs by more than STALL_SPREAD."""
    advice = []
    compared = compared_peaks(rows)
    if compared is not None and len(rows) > 1 and min(compared[0]) > 0:
        peaks, what = compared
        hi, lo = rows[peaks.index(max(peaks))], rows[peaks.index(min(peaks))]
        ratio = max(peaks) / min(peaks)
        if ratio > IMBALANCE:
            line = (f"imbalance: rank {hi.rank}'s peak ({what}) is {format_size(max(peaks))}, {ratio:.2f}x rank "
                    f"{lo.rank}'s {format_size(min(peaks))} (+{format_size(max(peaks) - min(peaks))}): the batch that "
                    f"fits is set by rank {hi.rank} while the others leave memory unused; ")
            allocated = _differs(hi, lo, lambda x: x.peak_allocated)
            fragmentation = _differs(hi, lo, lambda x: x.fragmentation_at_peak)
            outside = None
            if what.startswith("device") and hi.peak_reserved is not None and lo.peak_reserved is not None:
                outside = _differs(hi, lo, lambda x: x.peak_device_used - x.peak_reserved)
            parts = {k: v for k, v in (("allocated", allocated), ("fragmentation", fragmentation),
                                       ("outside", outside)) if v is not None}
            main = max(parts, key=parts.get) if parts and max(parts.values()) > 0 else None
            rank0_work = (f"work only rank {hi.rank} does (logging, evaluation, checkpointing under "
                          "`if rank == 0`: move it out of the training step, or share it out)")
            uneven = ("uneven batches or sequence lengths across ranks (DistributedSampler with drop_last=True, "
                      "padded or length-bucketed batches of one size)")
            stages = "pipeline stages of unequal size (rebalance the layers across stages)"
            if main == "allocated":
                causes = [uneven, stages] if hi.rank != 0 else [rank0_work, uneven, stages]
                line += (f"most of it is memory torch allocated (+{format_size(allocated)}): likely "
                         + "; or ".join(causes))
            elif main == "fragmentation":
                line += (f"most of it is fragmentation (+{format_size(fragmentation)} reserved but not allocated at "
                         f"rank {hi.rank}'s peak): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or tensor "
                         "shapes that vary from step to step on that rank")
            elif main == "outside":
                line += (f"most of it is outside torch's allocator (+{format_size(outside)}: CUDA contexts, NCCL, "
                         f"cuBLAS/cuDNN workspaces): other ranks' CUDA contexts on rank {hi.rank}'s GPU (call "
                         "torch.cuda.set_device(local_rank) before anything touches CUDA), or another process on it")
            else:
                causes = ([rank0_work] if hi.rank == 0 else []) + [uneven, stages, "other processes or other ranks' "
                                                                   "CUDA contexts on its GPU"]
                line += "likely " + "; or ".join(causes)
            advice.append(line)
    stalls = [x for x in rows if x.stall_fraction is not None]
    if len(stalls) > 1:
        slow = max(stalls, key=lambda x: x.stall_fraction)
        fast = min(stalls, key=lambda x: x.stall_fraction)
        if slow.stall_fraction - fast.stall_fraction > STALL_SPREAD:
            advice.append(f"rank {slow.rank} waited on its data loader {100 * slow.stall_fraction:.0f} % of the time, "
                          f"rank {fast.rank} {100 * fast.stall_fraction:.0f} %: every rank waits for it at each "
                          f"collective; give rank {slow.rank}'s loader more workers or check its host (storage, CPU)")
    return advice
