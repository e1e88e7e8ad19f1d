"""Advice computed from a memory report's figures: one line per finding, each with what to do."""
import os

from .clock_reasons import POWER_REASONS, SLOWDOWN_REASONS, reason_bits
from .text import MiB, format_size, top_level_modules


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

    if r.oom:
        req, free = r.oom.get("requested_bytes"), r.oom.get("free_bytes")
        if req and free is not None and oom_frag and req <= free + oom_frag:
            advice.append("out of memory although reserved-but-free plus device-free memory would have fit the "
                          "request: fragmentation; expandable_segments:True, or free caches between phases")
        else:
            advice.append("out of memory: lower the batch size, use AMP, or checkpoint the heaviest modules; "
                          "run with model= to see which modules hold the activations")
    return advice
