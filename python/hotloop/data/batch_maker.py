"""BatchMaker: what a DataLoader calls for batches it does not collate itself but has made from
parts of the ring's slot (gpu_decode's images: image/, made by image.make_maker).

The loader's core never imports image/: it knows a maker by these hooks alone, so an image change
touches no ring, prefetch or resume code. The copy engine (ring/copies.py) never calls a maker: it
copies a batch's other leaves and leaves the maker's parts in the slot. A maker is called, per
batch, in one place: prefetch.making.BatchMaking, where the batch becomes ready (NOTE [ One way down for a
batch ] in prefetch/making.py).
"""
from .ring.layout import spec_dict, spec_list

__all__ = ["BatchMaker", "spec_dict", "spec_list"]


class BatchMaker:
    """The hooks a batch maker answers; a subclass implements them all."""

    paced_top_ups = False  # the prefetch thread's top-ups start later in the step (prefetch.thread.TopUpPace)
    pins_ring = True  # the ring's slots are page-locked for copies out of them (False: the maker reads them itself)

    # the loader's lifetime

    def expect_device(self, device):
        """The device the first iter() is expected to run on, known when the loader is made."""

    def use_device(self, device):
        """The device iter() resolved ("cuda" became the current device): the maker's from now on."""

    def worker_side(self, dataset, collate_fn, workers):
        """(what the `workers` processes index, how they collate it), at iter(), before any worker
        starts (0 workers: the loader's own thread)."""
        raise NotImplementedError

    # per batch

    def slot_parts(self, spec):
        """The leaf specs (ring_leaf, or a side object's) of a batch this maker makes, read from the
        batch's spec; None for any other batch."""
        raise NotImplementedError

    def make(self, parts, stream, empty):
        """Make the batch from `parts` (slot_parts' leaves as CPU tensors: views of the slot, or the
        side objects), its device work queued on `stream` (a handle; 0 on the CPU). `empty(shape,
        dtype)` allocates device memory for the consumer's stream and orders `stream` after the
        work the consumer's stream holds so far: what the maker allocates on the consumer's stream
        before its last `empty` call is covered by it. Returns (the output, buffers the caller keeps
        until `stream` passed them, what it keeps until it saw the batch's event done). Runs in
        batch order, one batch at a time, outside the epoch's lock."""
        raise NotImplementedError

    def place(self, batch, out):
        """Put make's output into the batch unflattened from the rest of the spec."""
        raise NotImplementedError

    def whole_batch(self, batch, device):
        """A batch that came whole (num_workers=0 without a ring, one too big for the ring, the
        pipe): made here, waiting for it, when it is one of this maker's; else the batch as it is."""
        raise NotImplementedError
