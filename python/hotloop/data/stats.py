"""What a DataLoader did (LoaderStats), and every rank's of it gathered to one rank under torch.distributed.

Under DDP the slowest rank sets the pace of every step: a rank whose loader keeps its training loop
waiting holds up the others in the gradients' all-reduce, where the wait no longer shows as input.
`loader.stats.gather()` brings each rank's figures to rank 0 and names the rank that waited most:

    gathered = loader.stats.gather()   # on every rank: a collective
    if gathered is not None:           # rank 0
        print(gathered.summary)        # one line: the slowest rank's wait fraction, the others' range
        worst = gathered.slowest       # its LoaderStats (gathered.ranks[i]: the rank of gathered[i])
"""
import dataclasses

from .._arguments import expect_int

__all__ = ["GatheredStats", "LoaderStats"]


@dataclasses.dataclass
class LoaderStats:
    """What one DataLoader did since it was made (all epochs)."""

    batches: int = 0
    samples: int = 0
    wait_seconds: float = 0.0  # time the consumer spent inside __next__
    elapsed_seconds: float = 0.0  # from the first __next__ of an epoch to the last return, summed
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0  # CUDA-event time of the host-to-device copies
    worker_busy_seconds: float = 0.0  # time workers spent producing batches
    ring_bytes: int = 0
    view_batches: int = 0  # CPU batches handed out as views of their ring slot (no copy out of the ring)
    register_seconds: float = 0.0  # main-process time spent page-locking ring slots (once per slot)
    worker_restarts: int = 0
    decoder: str = None  # gpu_decode: what decodes the images (None: gpu_decode off or not started)
    images_gpu_decoded: int = 0  # images nvjpeg decoded
    images_cpu_decoded: int = 0  # images the workers decoded (CPU backend; PNG, CMYK, progressive, truncated files)
    images_refused: int = 0  # images nvjpeg refused, decoded by PIL in the main process instead
    images_cpu_pipeline: int = 0  # images the dataset's own transform made (a CenterCrop larger than the image)
    images_split: int = 0  # of images_cpu_decoded: JPEGs the GPU decoder takes, decoded by workers to share the work
    image_worker_share: float = 0.0  # the share of those JPEGs the workers decode now (image/split.py)
    images_on_lanes: int = 0  # of images_gpu_decoded: by host threads beside the JPEG engines (GpuDecode(threads=))
    image_lane_share: float = None  # the share of a batch's pixels those threads take now (None: engines alone)
    # gpu_decode: where the main process's time per batch goes, beside the training loop
    image_staging_seconds: float = 0.0  # a batch's host work before its decode: its decode and kernel tables built
    image_decode_seconds: float = 0.0  # inside the decoder's calls (nvjpeg's: the calling thread waits for them)

    @property
    def stall_fraction(self) -> float:
        return self.wait_seconds / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stall_fraction"] = self.stall_fraction
        d["h2d_gbps"] = self.h2d_gbps
        return d

    def gather(self, dst: int = 0, group=None):
        """Every rank's stats, on rank `dst` (a global rank, as in torch.distributed.gather_object):
        a GatheredStats there, None on the other ranks. A collective: every rank of `group` (the
        default group when None) calls it, as for any torch.distributed call. With NCCL the figures
        travel through the current CUDA device (torch.cuda.set_device(local_rank) first, as torch
        asks of gather_object). A rank outside `group` gets None and takes no part."""
        import torch.distributed as dist

        expect_int("LoaderStats.gather", "dst", dst)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("LoaderStats.gather: needs torch.distributed initialised (init_process_group) "
                               "on every rank")
        if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a rank outside it
            return None
        members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if dst not in members:  # checked before the collective: the same answer on every rank
            raise ValueError(f"LoaderStats.gather: expected dst to be a rank of the group {members}, got {dst}")
        me = dist.get_rank()
        if me not in members:
            return None
        payload = dataclasses.asdict(self)  # plain fields: a rank on another hotloop version still unpickles it
        received = [None] * len(members) if me == dst else None
        dist.gather_object(payload, received, dst=dst, group=group)
        if me != dst:
            return None
        known = {f.name for f in dataclasses.fields(LoaderStats)}
        return GatheredStats(list(members), [LoaderStats(**{k: v for k, v in d.items() if k in known})
                                             for d in received])


@dataclasses.dataclass
class GatheredStats:
    """Each rank's LoaderStats, in the group's rank order: gathered[i] is rank ranks[i]'s (with the
    default group, gathered[r] is rank r's)."""

    ranks: list  # the global rank of each entry
    stats: list  # LoaderStats per rank

    def __len__(self):
        return len(self.stats)

    def __getitem__(self, i) -> LoaderStats:
        return self.stats[i]

    def __iter__(self):
        return iter(self.stats)

    @property
    def slowest_rank(self) -> int:
        """The global rank whose training loop waited the largest fraction of its epochs for batches
        (the lowest such rank on a tie)."""
        fractions = [s.stall_fraction for s in self.stats]
        return self.ranks[fractions.index(max(fractions))]

    @property
    def slowest(self) -> LoaderStats:
        return self.stats[self.ranks.index(self.slowest_rank)]

    @property
    def summary(self) -> str:
        """One line: the slowest rank's wait fraction, its seconds and batches, and the others' range."""
        n = len(self.stats)
        if not any(s.batches for s in self.stats):
            return f"hotloop.DataLoader on {n} rank{'s' if n != 1 else ''}: no batches yet"
        rank, worst = self.slowest_rank, self.slowest
        line = (f"hotloop.DataLoader on {n} rank{'s' if n != 1 else ''}: rank {rank} waited longest for its "
                f"batches, {worst.stall_fraction:.1%} of its time ({worst.wait_seconds:.3f} s of "
                f"{worst.elapsed_seconds:.3f} s, {worst.batches} batches)")
        others = [s.stall_fraction for r, s in zip(self.ranks, self.stats) if r != rank]
        if others:
            low, high = min(others), max(others)
            line += f"; the other ranks {low:.1%}" if low == high else f"; the other ranks {low:.1%} to {high:.1%}"
        return line

    def __str__(self):
        return self.summary
