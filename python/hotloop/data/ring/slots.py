"""The shared ring of a worker pool and what leaves it: its free slots, batches lent to a CPU consumer
as views of their slots (leases), copies out to the CPU, and copies to the device (ring.copies.DeviceCopies).
A slot goes back to the free list only once nothing reads it any more."""
import array
import pickle

import torch

from ... import _C, input_wait
from .copies import DeviceCopies, page_round, slot_layout
from .layout import unflatten

_META_MIN = 64 << 10  # bytes reserved per slot for the batch's metadata and side-path objects
# slots the consumer may hold as zero-copy batches, beyond, batches are copied out: the one being
# handed out and the one a `for batch in loader` loop still holds meanwhile (as torch's loader,
# whose consumer holds those two batches' shared memory then)
LEASE_SLOTS = 2


class RingSlots:
    """A pool's ring (None until the first batch's layout sized it), its free slots and the copies
    out of them."""

    def __init__(self, settings, stats):
        """settings: the loader's CopySettings (settings.py); stats: its LoaderStats."""
        self.device = settings.device
        self.transform = settings.transform
        self.stats = stats
        self.ring = None
        self.layout = []
        self.free_slots = []
        self.ring_bytes = 0  # kept after close() unmapped the ring
        self.copies = DeviceCopies(settings, stats) if self.device is not None else None
        self.leases = None  # CPU batches lent out as views of their slots (copy_out)

    def create(self, nslots, sizes, spec_bytes):
        """Make the ring: at least `nslots` slots, each holding leaves of `sizes` bytes after room for
        metadata of a batch whose spec pickles to `spec_bytes`. Returns (its layout, metadata bytes)."""
        meta_cap = page_round(max(_META_MIN, 8 * spec_bytes + 4096))
        layout, offset = slot_layout(sizes, meta_cap)
        ring = _C.Ring(nslots, offset)
        self.ring, self.layout, self.ring_bytes = ring, layout, ring.nbytes
        self.free_slots = list(range(ring.nslots))
        self.stats.ring_bytes = ring.nbytes
        input_wait.ring_made(ring.nbytes)
        if self.copies is not None:
            self.copies.populate(ring, self.free_slots[::-1])  # in the order take_slot hands slots out
        return layout, meta_cap

    def take_slot(self):
        if not self.free_slots:
            self.reclaim(block=True)
        if not self.free_slots:
            raise AssertionError("hotloop.DataLoader: no free slot in the ring")
        slot = self.free_slots.pop()
        self.ring.set_state(slot, _C.RING_ASSIGNED)
        return slot

    def release_slot(self, slot):
        self.ring.set_state(slot, _C.RING_FREE)
        self.free_slots.append(slot)

    def slot_meta(self, slot, meta_len):
        """The outcome a worker pickled at the start of its slot."""
        view = self.ring.view(slot)
        try:
            return pickle.loads(view[:meta_len])
        finally:
            view.release()

    def copy_out(self, slot, spec, leaves, pin):
        """CPU delivery. Without pin the leaves are views of the slot (zero-copy): the slot is leased
        and comes back once the last tensor, view, storage or numpy array made from them is gone;
        past LEASE_SLOTS leases (a consumer that keeps batches) they are copied out instead, so that
        the workers always find free slots. Leaves the transform applies to are normalised into new
        tensors.

        With pin the leaves are copied into torch's pinned memory, as torch does. A view of the slot
        is not page-locked, and even if the ring were, a `.to(device, non_blocking=True)` from it is
        a DMA that runs after the call returned: the consumer may drop the batch right after queuing
        it, the lease ends, the slot goes back to a worker and is rewritten while the DMA still reads
        it. torch's pinned allocator keeps a block until events recorded on the streams that used it
        completed; a lease sees no such event."""
        transform = self.transform
        try:  # which leaves the transform takes (gpu_transform's images): ValueError for one it cannot take
            normalized = (transform.leaf_outputs(leaf[1:] for leaf in leaves) if transform is not None
                          else [False] * len(leaves))
        except ValueError:
            self.release_slot(slot)
            raise
        outs, triples = [], []
        view = parts = None
        lent = [(off, torch.Size(shape).numel() * dtype.itemsize)
                for (off, dtype, shape), image in zip(leaves, normalized) if not image]
        if not pin and lent:
            self.collect_leases()
            if self.leases is None:
                self.leases = _C.RingLeases(self.ring)
            if self.leases.outstanding < LEASE_SLOTS:
                # one capsule per leaf: each tensor gets a storage of its own bytes, as collated ones do
                parts = iter(self.leases.lease(slot, array.array("q", [x for p in lent for x in p]).tobytes()))
        try:
            for (off, dtype, shape), image in zip(leaves, normalized):
                if image:
                    if view is None:
                        view = self.ring.view(slot)
                    src = torch.frombuffer(view, dtype=dtype, count=torch.Size(shape).numel(), offset=off).view(shape)
                    out, mem = transform.empty_leaf(dtype, shape, "cpu")
                    transform.transform_leaf(src, mem)
                    del src
                    outs.append(out)
                elif parts is not None:
                    outs.append(torch.from_dlpack(next(parts)).view(dtype).view(shape))
                else:
                    t = torch.empty(shape, dtype=dtype, pin_memory=pin)
                    triples += (off, t.data_ptr(), t.numel() * t.element_size())
                    outs.append(t)
            if triples:
                self.ring.copy_out(slot, array.array("q", triples).tobytes())
        finally:
            if view is not None:
                view.release()
        if parts is None:
            self.release_slot(slot)
        else:
            self.stats.view_batches += 1  # the slot comes back through collect_leases
        return unflatten(spec, outs)

    def collect_leases(self):
        """Free the slots whose leased tensors are all gone."""
        if self.leases is not None:
            for slot in self.leases.returned():
                self.release_slot(slot)

    # CUDA: the side stream, events and copies in flight live in ring.copies.DeviceCopies
    def copy_to_device(self, slot, spec, leaves, left=None):
        return self.copies.copy_to_device(self.ring, slot, spec, leaves, left)

    def copy_can_wait(self, slot):
        """A batch copied ahead whose slot the background thread has not page-locked yet: better
        copied once it has than page-locked now (the batch due next is copied either way)."""
        return self.copies is not None and slot >= 0 and not self.copies.slot_pinned(self.ring, slot)

    def deliver(self, batch):
        try:
            return self.copies.deliver(batch)
        finally:
            self._release_finished()

    def abandon(self, batch):
        """A copy queued for a batch that will never be handed out: its slot is freed once it is over."""
        self.copies.abandon(batch)

    def reclaim(self, block):
        """Free the slots whose copies finished (with block: wait for the oldest if none did) or
        whose leased tensors are gone."""
        self.collect_leases()
        if self.copies is not None:
            try:
                self.copies.reclaim(block)
            finally:
                self._release_finished()

    def settle(self):
        """The epoch's end: every copy waited for and its slot freed (DeviceCopies.settle)."""
        if self.copies is not None:
            try:
                self.copies.settle()
            finally:
                self._release_finished()

    def _release_finished(self):
        for slot in self.copies.take_finished():
            self.release_slot(slot)

    def close(self):
        """Wait for the copies in flight, then unmap the ring (once the last batch lent as views of
        it is gone)."""
        if self.copies is not None:
            self.copies.close()
        if self.ring is not None:
            input_wait.ring_gone(self.ring_bytes)
            if self.leases is not None:
                self.leases.close_ring()  # batches handed out as views may still read it: the last one closes it
            else:
                self.ring.close()
            self.ring = None
            self.leases = None
