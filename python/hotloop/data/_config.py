"""What the layers below hotloop.DataLoader are given of it: frozen settings, made once per pool or ring.

The pool and the device copies never hold the loader (SPDL's and timm's way: a lower object gets a
frozen configuration and a sink for its statistics, not a proxy of the object above it). The sink is
the loader's LoaderStats (stats.py), whose counters they add to."""
import dataclasses
import typing


@dataclasses.dataclass(frozen=True)
class CopySettings:
    """What DeviceCopies needs of its loader."""

    device: typing.Any  # the torch.device (or a stand-in with .type and .index) the copies go to
    stage: typing.Any = None  # the loader's stage.BatchStage (gpu_transform or gpu_decode's), or None


@dataclasses.dataclass(frozen=True)
class FeedSettings:
    """What one multi-worker epoch (_feed.Feed) needs of its loader and iterator, as they stand at its start."""

    dataset_kind: int  # torch's _DatasetKind
    auto_collation: bool
    num_workers: int
    prefetch_factor: int  # tasks in flight per worker
    persistent_workers: bool
    in_order: bool
    timeout: float  # seconds a batch may take (0: no limit)
    pin_memory: bool
    prefetch_batches: int  # with a device: batches copied ahead of the one handed out
    stage: typing.Any  # the loader's stage.BatchStage, or None, for batches that come whole


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """What a worker pool needs of its loader, as it stood when the pool was made."""

    mp_context: typing.Any  # a multiprocessing context (torch.multiprocessing when the loader has none)
    num_workers: int
    device: typing.Any  # None: batches stay on the CPU
    stage: typing.Any  # the loader's stage.BatchStage, or None
    batch_size: typing.Any  # the loader's batch_size (None without automatic batching)
    prefetch_factor: int  # tasks in flight per worker
    prefetch_batches: int  # with a device: batches copied ahead of the one handed out
    max_worker_restarts: int

    @property
    def copies(self) -> CopySettings:
        return CopySettings(self.device, self.stage)
