"""The memory report drawn: device memory, utilisation and power against time (needs matplotlib)."""
from .text import GiB
from .timeline import Timeline


def plot_report(r, path):
    """The report's (a MemoryReport) timeline as a PNG at `path`; returns the path."""
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
