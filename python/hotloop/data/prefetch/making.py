"""The one place a BatchMaker (gpu_decode's) is called for a batch: BatchMaking makes each batch
whose parts the copy engine left in the slot, where the batch becomes ready.

NOTE [ One way down for a batch ]
A batch goes down one way, and nothing below calls back up. Under the epoch's lock, the feed takes
a worker's batch from the ring and the copy engine (ring.copies.DeviceCopies) queues the copies of
its leaves on the copy stream, and its leaf transform (gpu_transform) there too; a batch a maker
makes from parts of the slot (gpu_decode's JPEG bytes) has those parts left in the slot, its event
not yet recorded. Then, outside the lock, BatchMaking.make_ready has the maker make it (nvjpeg's
decode, and the kernel on the copy stream) and records the batch's event after that work: in the
prefetch thread right after its top-up (prefetch.thread.Prefetcher), or in next() for the batch it
hands out if the prefetch thread has not made it (consumer.iterators.MultiProcessIter), or, with
num_workers=0, as soon as the loader's own ring holds it (consumer.iterators.SingleProcessIter).
Outside the lock because nvjpeg holds its thread until a batch is decoded, and next() would wait
for that with a batch ready to hand out.

Batches are made in batch order, one at a time (the decoder serves one thread at a time): the
prefetch thread makes those it prepared, in order, and next() makes only the batch it hands out,
which comes before any the prefetch thread prepared since. A batch made stays made, so next()
looks without the lock first (its event recorded: QueuedBatch.sealed), and does not wait for a
later batch's decode. A batch never handed out is dropped here (its event recorded, no decode),
then freed by the copy engine.
"""
import threading

import torch

from ..._torch_compat import pin_memory
from ..ring.copies import ring_tensor, slot_leaf
from ..ring.layout import ring_leaf, unflatten

__all__ = ["BatchMaking"]


class BatchMaking:
    """A maker's batches made, for one copy engine (`copies`; None without a device, or until the
    loader's own ring exists: made on the CPU, or whole)."""

    def __init__(self, maker, copies=None):
        self.maker = maker
        self.copies = copies
        self._lock = threading.Lock()  # one batch made at a time, by whichever thread comes first

    def parts_of(self, spec):
        """The parts of the slot the maker makes the batch from (left there by the copy), or None."""
        return self.maker.slot_parts(spec)

    def make_ready(self, batch):
        """Make a QueuedBatch whose parts the copy left in the slot (once: a made batch stays made),
        then record its event. What fails (a file PIL cannot read, a CUDA error, a Ctrl-C) is kept
        for the copy engine's deliver to raise at the batch's turn, its slot freed as any other's."""
        if batch.sealed:  # read without the lock: made already (or dropped)
            return
        with self._lock:
            if batch.sealed:  # made meanwhile, by the thread that held the lock
                return
            parts, batch.left = batch.left, None
            copies = self.copies
            try:
                out, buffers, held = self.maker.make(parts, copies.copy_stream, copies.empty_ordered)
                self.maker.place(batch.result, out)
                copies.keep(batch, out, buffers, held)
            except BaseException as exc:
                batch.error = exc
            finally:
                del parts  # the slot's views: its bytes are read once the stream passed them
                try:
                    copies.seal(batch)
                except BaseException as exc:  # a CUDA error: raised at the batch's turn
                    batch.error = batch.error or exc
                    batch.sealed = True  # never made again

    def drop(self, batch):
        """A batch that will never be handed out: not made; its event recorded, so that the copy
        engine frees its slot once the copies queued so far are over."""
        with self._lock:
            if not batch.sealed:
                batch.left = None
                self.copies.seal(batch)

    def make_on_cpu(self, slots, slot, spec, leaves, parts, pin):
        """Without a device: the batch made on the CPU from the slot (`parts`: its slot_parts), the
        rest of its leaves copied out; the slot freed once it is made."""
        ring = slots.ring
        try:
            host = [slot_leaf(ring, slot, leaves, s) for s in parts]
            taken = {ring_leaf(s) for s in parts}
            outs = [None if k in taken else ring_tensor(ring, slot, leaves, k).clone() for k in range(len(leaves))]
            batch = unflatten(spec, outs)
            self.maker.place(batch, self.maker.make(host, 0, _cpu_empty)[0])
            del host
        finally:
            slots.release_slot(slot)
        if pin:  # as torch pins a batch with pin_memory=True
            batch = pin_memory(batch)
        return batch

    def make_whole(self, batch, device):
        """A batch that came whole (not through a slot): made by the maker, waiting for it, when it is
        one of its own; one batch at a time, as any other."""
        with self._lock:
            return self.maker.whole_batch(batch, device)


def _cpu_empty(shape, dtype):
    return torch.empty(shape, dtype=dtype)
