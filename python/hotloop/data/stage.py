"""The hook a DataLoader calls for what its batches go through beyond the ring's plain copies.

A loader has at most one stage: its gpu_transform (hotloop.Normalize), or gpu_decode's image path
(image/, made by `gpu_decode_stage`). The core (dataloader.py and the underscore modules) calls a
stage through BatchStage's hooks alone and never imports image/: an image change touches no ring,
prefetch or resume code. A stage does one of two kinds of work per batch, and says which by what
its hooks answer:

* leaves it transforms once copied (Normalize): `leaf_outputs` names them; the core copies each to a
  staging buffer and `transform_leaf` writes it, on the copy stream, into `empty_leaf`'s output;
* batches it makes itself from the slot (gpu_decode): `slot_parts` recognises one by its spec; the
  core hands the stage those leaves where they lie in the slot, `prepare_batch` allocates,
  `begin_batch` does the host work and `finish_batch` queues the device work on the copy stream
  (each in a thread of its own where a launch runner runs: _launches.py), and `place` puts the
  result into the batch.
"""
from ._batch import ring_leaf, spec_dict, spec_list

__all__ = ["BatchStage", "gpu_decode_stage", "ring_leaf", "spec_dict", "spec_list"]


class BatchStage:
    """The hooks, with the answers of a stage that takes nothing: every batch passes as it is."""

    paced_top_ups = False  # the prefetch thread's top-ups start later in the consumer's step (_prefetch.TopUpPace)
    pins_ring = True  # the ring's slots are page-locked for copies out of them (False: the stage reads them itself)

    # the loader's lifetime

    def expect_device(self, device):
        """The device the first iter() is expected to run on, known when the loader is made."""

    def use_device(self, device):
        """The device iter() resolved ("cuda" became the current device): the stage's from now on."""

    def worker_side(self, dataset, collate_fn):
        """(what the workers index, how they collate it), at iter(), before any worker starts."""
        return dataset, collate_fn

    # leaves transformed once copied

    def leaf_outputs(self, leaves) -> list:
        """Which of a batch's ring leaves ((dtype, shape) each, in order) this stage transforms: a
        list of bools. ValueError for one it cannot take, before any copy."""
        return [False] * len(list(leaves))

    def empty_leaf(self, dtype, shape, device, empty=None):
        """(the output for a leaf leaf_outputs took, the memory transform_leaf writes)."""
        raise NotImplementedError(f"{type(self).__name__} transforms no leaves")

    def transform_leaf(self, src, mem, stream=None):
        """Write the transformed `src` into `mem` (empty_leaf's), queued on `stream` (a handle)."""
        raise NotImplementedError(f"{type(self).__name__} transforms no leaves")

    def transform(self, x):
        """A leaf of a batch that came whole (num_workers=0, the pipe): transformed where it is."""
        raise NotImplementedError(f"{type(self).__name__} transforms no leaves")

    # batches made from the slot

    def slot_parts(self, spec):
        """The leaf specs (ring_leaf, or a side object's) of a batch this stage makes itself, read
        from the batch's spec; None for any other batch."""
        return None

    def prepare_batch(self, parts, empty):
        """Allocate, with `empty(shape, dtype)`, what the batch needs; `parts` are slot_parts' leaves
        as CPU tensors (views of the slot, or the side objects)."""
        raise NotImplementedError(f"{type(self).__name__} makes no batches")

    def begin_batch(self, prepared, parts, stream):
        """The batch's host work, queueing nothing on a device: what finish_batch takes. Runs outside
        the epoch's lock, in batch order (the prefetch thread, or next()), while earlier batches'
        finish_batch may run in another thread (_launches.ImageLaunch)."""
        raise NotImplementedError(f"{type(self).__name__} makes no batches")

    def finish_batch(self, begun):
        """Queue begin_batch's batch on its `stream` (0 on the CPU): (the output, buffers the caller
        keeps until `stream` passed them, what it keeps until it saw the batch's event done). Runs in
        batch order, one batch at a time, in the launch runner's thread or in next()."""
        raise NotImplementedError(f"{type(self).__name__} makes no batches")

    def launch_batch(self, prepared, parts, stream):
        """begin_batch then finish_batch, in this thread (a batch made on the CPU, here and now)."""
        return self.finish_batch(self.begin_batch(prepared, parts, stream))

    def place(self, batch, out):
        """Put finish_batch's output into the batch unflattened from the rest of the spec."""
        raise NotImplementedError(f"{type(self).__name__} makes no batches")

    def whole_batch(self, batch, device):
        """A batch that came whole (num_workers=0, one too big for the ring): made here, waiting
        for it, when it is one of this stage's; else the batch as it is."""
        return batch


def gpu_decode_stage(value, dataset, collate_fn, batch_size, loader_kind, device, stats):
    """(the gpu_decode argument resolved, for vars(loader); the image path's stage, or None when it
    is off or declined the dataset, with a warning that says why). image/ is imported here, once
    the loader asks: it builds on this module."""
    from .image import make_stage

    return make_stage(value, dataset, collate_fn, batch_size, loader_kind, device, stats)
