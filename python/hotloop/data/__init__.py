"""hotloop.DataLoader and its GPU transform. dataloader.py holds the user-facing class; the underscore
modules beside it are the machinery it drives, each calling only the ones below it
(tests/data/test_layers.py declares the order): _iterators (the iterators torch's loader returns),
_prefetch (the thread that queues the next copies), _feed (one multi-worker epoch: tasks in torch's
order, batches prepared ahead), _pool (tasks, messages, dead workers replaced), _workers (the worker
processes and their pipes), _slots (the ring's slots and the copies out of them), _tasks (tasks and
where each worker stands), _device (copies to the GPU), _worker (the worker loop), _launcher (forks
workers 1..), _batch and _rows (a batch's layout in a slot), _resume (state_dict), _rng (worker RNG
states), _messages (what the processes send each other), _handout (batches that came whole, errors
raised when due), _config (the frozen settings the layers below the loader get), _shutdown (what ends
at interpreter exit); stats (LoaderStats, the sink they add to, and every rank's gathered to one
under torch.distributed). What batches go through beyond the ring's copies is a BatchStage (stage:
the hook the core calls): the gpu_transform (normalize: Normalize) or gpu_decode's image path, in
image/, a package the core never imports."""
from .dataloader import DataLoader
from .image import EncodedImageDataset, GpuDecode
from .normalize import Normalize
from .stats import GatheredStats, LoaderStats

__all__ = ["DataLoader", "EncodedImageDataset", "GatheredStats", "GpuDecode", "LoaderStats", "Normalize"]
