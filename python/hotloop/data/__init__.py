"""hotloop.DataLoader and its GPU transform. dataloader.py holds the user-facing class and its
iterators; the underscore modules beside it are the machinery they drive: _pool (worker processes,
the ring, copies out of it), _worker (the worker loop), _launcher (forks workers 1..), _batch and
_rows (a batch's layout in a slot), _device (copies to the GPU), _prefetch (the thread that queues
them), _resume (state_dict), _rng (worker RNG states), _messages (what the processes send each
other), _shutdown (what ends at interpreter exit); stats (LoaderStats, and every rank's gathered
to one under torch.distributed). The image path (gpu_decode) is in gpu_decode (the option),
image_plan (the transform as one kernel's parameters), image_source (the workers' half),
image_stage (the main process's half), image_resize (the kernel) and nvjpeg (the decoder)."""
from .dataloader import DataLoader
from .gpu_decode import GpuDecode
from .image_source import EncodedImageDataset
from .normalize import Normalize
from .stats import GatheredStats, LoaderStats

__all__ = ["DataLoader", "EncodedImageDataset", "GatheredStats", "GpuDecode", "LoaderStats", "Normalize"]
