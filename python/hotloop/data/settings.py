"""What the layers below hotloop.DataLoader are given of it: frozen settings, made once per pool or ring.

The pool and the device copies never hold the loader (SPDL's and timm's way: a lower object gets a
frozen configuration and a sink for its statistics, not a proxy of the object above it). The sink is
the loader's LoaderStats (stats.py), whose counters they add to. Every field is given by keyword
(kw_only): a swapped pair of positional arguments would pass in silence."""
import dataclasses
import typing


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopySettings:
    """What the copy engine (DeviceCopies) needs of its loader."""

    device: typing.Any  # the torch.device (or a stand-in with .type and .index) the copies go to
    transform: typing.Any = None  # the loader's LeafTransform (gpu_transform), or None
    pin_slots: bool = True  # page-lock the ring's slots (False where a batch maker reads its slots itself)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeedSettings:
    """What one multi-worker epoch (consumer.feed.Feed) needs of its loader and iterator, as they stand at its start."""

    dataset_kind: int  # torch's _DatasetKind
    auto_collation: bool
    num_workers: int
    prefetch_factor: int  # tasks in flight per worker
    persistent_workers: bool
    in_order: bool
    timeout: float  # seconds a batch may take (0: no limit)
    pin_memory: bool
    prefetch_batches: int  # with a device: batches copied ahead of the one handed out
    transform: typing.Any  # the loader's LeafTransform, or None, for batches that come whole
    maker: typing.Any  # the loader's BatchMaker (gpu_decode's), or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSettings:
    """What a worker pool needs of its loader, as it stood when the pool was made."""

    mp_context: typing.Any  # a multiprocessing context (torch.multiprocessing when the loader has none)
    num_workers: int
    copies: CopySettings  # what its copy engine is given (device None: batches stay on the CPU)
    batch_size: typing.Any  # the loader's batch_size (None without automatic batching)
    prefetch_factor: int  # tasks in flight per worker
    prefetch_batches: int  # with a device: batches copied ahead of the one handed out
    max_worker_restarts: int

    @property
    def device(self):
        return self.copies.device
