"""Memory figures of every rank of a torch.distributed group: the monitor's rows and their gather, the group lookup.

Each rank sends a RankMemory (its peaks, the parts they add up from, its data-loader stalls: a few
numbers, not its timeline) with one gather_object over the group; the group's first rank gets the
list, every other rank gets nothing back. find_max_batch_size finds its group here too. Imports
torch.distributed only when asked.
"""
import dataclasses
import socket


@dataclasses.dataclass
class RankMemory:
    """One rank's row of a gathered report: its MemoryReport's figures that compare across ranks
    (bytes, None where that rank's source was unavailable)."""
    rank: int
    host: str
    device: str
    duration_s: float
    peak_device_used: int = None     # NVML: the device's peak, whatever allocated it
    device_total: int = None
    context_baseline: int = None     # device used at start minus torch reserved then (CUDA context, others)
    peak_reserved: int = None        # torch's caching allocator
    peak_allocated: int = None
    fragmentation_at_peak: int = None
    non_torch_at_peak: int = None    # cuBLAS/cuDNN/NCCL workspaces, other libraries
    alloc_retries: int = None
    ooms: int = None
    stall_fraction: float = None     # share of the run spent waiting on hotloop.DataLoader
    loader_wait_s: float = None
    util_mean: float = None

    @classmethod
    def of(cls, report, rank):
        """The row of a rank's own MemoryReport."""
        return cls(rank=rank, host=socket.gethostname(), device=report.device or "cpu", duration_s=report.duration_s,
                   **{f.name: getattr(report, f.name) for f in dataclasses.fields(cls)
                      if f.name not in ("rank", "host", "device", "duration_s")})


def compared_peaks(rows):
    """(the peaks rows are compared by, what they are): the device's (NVML) where every rank has it,
    else torch's peak reserved where every rank has that; None where the ranks cannot be compared."""
    for field, what in (("peak_device_used", "device used, NVML"), ("peak_reserved", "torch reserved")):
        peaks = [getattr(x, field) for x in rows]
        if all(p is not None for p in peaks):
            return peaks, what
    return None


def group_rank(process_group=None):
    """(rank in the group, its size) where torch.distributed is initialized, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def gather_rows(row, process_group=None):
    """Every rank's row on the group's first rank (a list in rank order), None on the others.
    A collective: every rank of the group must call it."""
    import torch.distributed as dist

    rank = dist.get_rank(process_group)
    size = dist.get_world_size(process_group)
    dst = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    rows = [None] * size if rank == 0 else None
    dist.gather_object(row, rows, dst=dst, group=process_group)
    return rows
