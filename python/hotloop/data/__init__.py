"""hotloop.DataLoader and its GPU transform. dataloader.py holds the user-facing class and its
iterators; the underscore modules beside it are the machinery they drive: _pool (worker processes,
the ring, copies out of it), _worker (the worker loop), _launcher (forks workers 1..), _batch and
_rows (a batch's layout in a slot), _device (copies to the GPU), _prefetch (the thread that queues
them), _resume (state_dict), _rng (worker RNG states), _messages (what the processes send each
other), _shutdown (what ends at interpreter exit); stats (LoaderStats, and every rank's gathered
to one under torch.distributed). What batches go through beyond the ring's copies is a BatchStage
(stage: the hook the core calls): the gpu_transform (normalize: Normalize) or gpu_decode's image
path, in image/, a package the core never imports."""
from .dataloader import DataLoader
from .image import EncodedImageDataset, GpuDecode
from .normalize import Normalize
from .stats import GatheredStats, LoaderStats

__all__ = ["DataLoader", "EncodedImageDataset", "GatheredStats", "GpuDecode", "LoaderStats", "Normalize"]
