"""hotloop.DataLoader and its GPU transform. dataloader.py holds the user-facing class; the machinery it
drives lives in rooms named by where their code runs, each module calling only the ones below it
(tests/data/test_layers.py declares the order):

* consumer/: the main process, for next(): iterators (the iterators torch's loader returns), feed
  (one multi-worker epoch: tasks in torch's order, batches prepared ahead), pool (tasks, messages,
  dead workers replaced), processes (the worker processes and their pipes), tasks (where each worker
  stands), handout (batches that came whole, errors raised when due), resume (state_dict);
* prefetch/: the prefetch thread: thread (it tops the epoch up between next() calls) and making
  (where a batch maker's batches are made, once they are ready);
* worker/: the worker process: loop (dataset[i] into a slot), rows, rng, inherited_garbage;
* launcher/: the process that forks workers 1.. (zygote);
* ring/: layout (a batch as a slot holds it), slots (a pool's ring), copies (the copy engine: a
  slot's bytes to the device, and the leaf transform).

Beside them: messages (what the processes send each other), settings (the frozen settings the rooms
get of the loader), at_exit (what ends at interpreter exit), stats (LoaderStats, the sink they add
to), and the two interfaces the loader's options implement: leaf_transform.LeafTransform (the
gpu_transform, normalize.Normalize, applied by the copy engine) and batch_maker.BatchMaker
(gpu_decode's image path, in image/, a package the core never imports)."""
from .dataloader import DataLoader
from .image import EncodedImageDataset, GpuDecode
from .normalize import Normalize
from .stats import GatheredStats, LoaderStats

__all__ = ["DataLoader", "EncodedImageDataset", "GatheredStats", "GpuDecode", "LoaderStats", "Normalize"]
