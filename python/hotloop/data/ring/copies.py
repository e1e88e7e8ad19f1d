"""CUDA delivery of ring slots: copies on a side stream, slots and device buffers reused only once events allow it."""
import array
import collections
import dataclasses
import time
import warnings

import torch

from ... import _C, input_wait
from ..._torch_compat import raw_current_stream
from ..at_exit import LOCAL_RINGS, close_at_exit, forget
from .layout import leaf_bytes, ring_leaf, unflatten



class CudaCalls:
    """Every CUDA call of the device path, for one device. Tests replace this class (DeviceCopies.calls)
    to run the path's logic on the CPU; nothing else of the loader touches CUDA."""

    def __init__(self, device):
        self.device = device
        self._streams = []  # torch.cuda.Stream objects own the streams whose handles we hand out

    def new_stream(self) -> int:
        stream = torch.cuda.Stream(self.device)
        self._streams.append(stream)
        return stream.cuda_stream

    def current_stream(self) -> int:
        """The handle of the consumer's current stream on our device: torch's raw call where it has
        one, far cheaper than building a torch.cuda.Stream (it is asked twice per batch)."""
        if raw_current_stream is not None:
            return raw_current_stream(self.device.index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def record_stream(self, tensors):
        """The tensors are used on the current stream, not the one they were allocated for."""
        stream = torch.cuda.current_stream(self.device)
        for t in tensors:
            t.record_stream(stream)

    def event(self, timing):
        return _C.cuda_event_create(self.device.index, timing)

    def record(self, event, stream):
        _C.cuda_event_record(event, stream)

    def wait(self, stream, event):
        _C.cuda_stream_wait_event(stream, event)

    def done(self, event) -> bool:
        return _C.cuda_event_query(event)

    def synchronize(self, event):
        _C.cuda_event_synchronize(event)

    def elapsed_ms(self, start, end) -> float:
        return _C.cuda_event_elapsed(start, end)

    def destroy(self, event):
        _C.cuda_event_destroy(event)

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def run_transform(self, transform, src, mem, stream):
        transform.transform_leaf(src, mem, stream)

    def populate(self, ring, order):
        """Allocate and page-lock the ring's slots in `order`, on the ring's background threads."""
        ring.populate_all(order, self.device.index)

    def register(self, ring, slot) -> bool:
        """Page-lock the slot now (True if this call did it)."""
        return ring.cuda_register_slot(slot, self.device.index)

    def slot_pinned(self, ring, slot) -> bool:
        return ring.slot_pinned(slot)

    def copy(self, ring, slot, packed, stream):
        ring.copy_to_device(slot, packed, stream, self.device.index)


@dataclasses.dataclass(eq=False)
class QueuedBatch:
    """A batch whose copy to the device is queued: its slot is freed once `event` completed."""

    slot: int
    event: int
    result: object
    keep: list  # staging buffers the copy stream still writes
    stream: int  # the stream the device tensors were allocated for (its handle)
    tensors: list
    nbytes: int
    timing: tuple  # (start, end) timing events or None
    # the leaves the copy left in the slot (CPU tensors where they lie, or side objects), for the
    # caller's work on the copy stream (a BatchMaker's), until it took them; its event is recorded
    # by seal() after that work
    left: list = None
    sealed: bool = False  # its event is recorded: the copy engine may free its slot once it completed
    held: object = None  # kept until `event` was seen done (gpu_decode's entry table and decode buffer)
    error: BaseException = None  # what the caller's work raised: deliver raises it


class DeviceCopies:
    """The side stream, the events and the copies in flight of one ring: a slot goes back only once
    the copy out of it finished. deliver and reclaim move such slots to `finished`, which the ring's
    owner takes (take_finished) and frees: nothing here calls back into the owner. It copies bytes
    and applies the loader's leaf transform, nothing else: a batch a maker makes from the slot has
    its parts left there for the caller (NOTE [ One way down for a batch ] in prefetch/making.py)."""

    calls = CudaCalls  # the seam the CPU tests replace

    def __init__(self, settings, stats):
        """settings: the loader's CopySettings (settings.py); stats: its LoaderStats, which copies add to."""
        self.device = settings.device
        self.transform = settings.transform
        self.stats = stats
        self.cuda = self.calls(self.device)
        self.copy_stream = None
        # a batch maker that reads its batches' slots itself says so (gpu_decode's pins_ring, and why)
        self.pin_slots = settings.pin_slots
        self.inflight = collections.deque()
        self.event_pool = []
        self.alloc_event = None
        self.left_event = None  # orders the copy stream after allocations for the leaves left in the slot
        self.timing_pool = []  # timing events (h2d seconds in stats) are made once, not per batch
        self.pinned = set()  # slots page-locked through this object
        self.finished = []  # slots whose copies are over, until the owner takes them (take_finished)

    def populate(self, ring, order):
        """Background threads of the ring allocate its pages and page-lock its slots, in `order`:
        a worker's first write finds its pages and a copy its slot page-locked, without the training
        thread doing either (unless a copy comes first: ring_pin.c). Without pin_slots, the pages only."""
        if self.pin_slots:
            self.cuda.populate(ring, order)
        else:
            ring.populate_all(order)

    def _pin(self, ring, slot):
        if not self.pin_slots:
            return
        t0 = time.perf_counter()
        try:
            if self.cuda.register(ring, slot):
                self.stats.register_seconds += time.perf_counter() - t0
            self.pinned.add(slot)
        except Exception as exc:  # still correct without pinning, only slower
            self.pin_slots = False
            warnings.warn(f"hotloop.DataLoader: the ring could not be page-locked ({exc}); copies will be "
                          "slower", stacklevel=5)

    def slot_pinned(self, ring, slot):
        """Whether a copy out of the slot can start without page-locking it first (which holds the
        driver lock for a time that grows with the slot, while the training thread's launches wait:
        ring_pin.c)."""
        return not self.pin_slots or slot in self.pinned or self.cuda.slot_pinned(ring, slot)

    def _event(self, timing=False):
        pool = self.timing_pool if timing else self.event_pool
        return pool.pop() if pool else self.cuda.event(timing)

    def copy_to_device(self, ring, slot, spec, leaves, left=None):
        """Queue the slot's copy to the device on the side stream; the result is usable once the
        consumer's stream waited on the returned QueuedBatch's event (deliver). left: the specs of
        leaves (ring_leaf's, or side objects) not to copy, handed to the caller in the batch's
        `left` for work of its own on the copy stream; the batch's event is then recorded by
        seal(), once the caller queued that work."""
        cuda = self.cuda
        transform = self.transform
        if self.copy_stream is None:
            self.copy_stream = cuda.new_stream()
            self.alloc_event = cuda.event(False)
            self.left_event = cuda.event(False)
        consumer = cuda.current_stream()
        outs, triples, staged, keep, nbytes = [], [], [], [], 0
        skipped = {ring_leaf(s) for s in left} - {None} if left is not None else ()
        # which leaves the transform takes (gpu_transform's images): ValueError (before any copy) for
        # one it cannot take
        transformed = (transform.leaf_outputs(leaf[1:] for leaf in leaves) if transform is not None
                       else [False] * len(leaves))
        for k, (off, dtype, shape) in enumerate(leaves):
            size = torch.Size(shape).numel() * dtype.itemsize
            if k in skipped:  # read where it lies, in the slot, by the caller's work
                outs.append(None)
                continue
            nbytes += size
            if transformed[k]:
                staging = cuda.empty(shape, dtype)
                out, mem = transform.empty_leaf(dtype, shape, self.device, cuda.empty)
                staged.append((staging, mem))
                keep.append(staging)
                triples += (off, staging.data_ptr(), size)
                outs.append(out)
            else:
                t = cuda.empty(shape, dtype)
                triples += (off, t.data_ptr(), size)
                outs.append(t)
        if slot not in self.pinned:
            self._pin(ring, slot)  # what the ring's pinning thread has not page-locked yet
        side = self.copy_stream
        # the tensors were allocated for the consumer's stream: blocks it freed may still be in use
        # by work queued there, so the copy stream waits for everything queued so far (timm #2781)
        cuda.record(self.alloc_event, consumer)
        cuda.wait(side, self.alloc_event)
        timing = (self._event(True), self._event(True))
        cuda.record(timing[0], side)
        if triples:
            cuda.copy(ring, slot, array.array("q", triples).tobytes(), side)
        cuda.record(timing[1], side)
        for staging, mem in staged:
            cuda.run_transform(transform, staging, mem, side)
        # the consumer's tensors (record_stream in deliver): not the left leaves' places
        batch = QueuedBatch(slot, self._event(), unflatten(spec, outs), keep, consumer,
                            [t for t in outs if t is not None], nbytes, timing)
        if left is None:
            self.seal(batch)
        else:
            batch.left = [slot_leaf(ring, slot, leaves, s) for s in left]
        return batch

    def empty_ordered(self, shape, dtype):
        """Device memory for the consumer's stream that work queued on the copy stream from now on
        may write: the copy stream waits for all the consumer's stream holds so far (timm #2781),
        which covers what was allocated on it before this call too."""
        t = self.cuda.empty(shape, dtype)
        self.cuda.record(self.left_event, self.cuda.current_stream())
        self.cuda.wait(self.copy_stream, self.left_event)
        return t

    @staticmethod
    def keep(batch, out, buffers, held):
        """What the caller's work on the copy stream made of the left leaves: `out` goes to the
        consumer with the batch, `buffers` are kept until the stream passed them, `held` until
        the batch's event was seen done."""
        batch.keep += buffers
        batch.tensors.append(out)
        batch.held = held

    def seal(self, batch):
        """Record the batch's event after all the copy stream holds: its slot may be freed once it
        completed."""
        self.cuda.record(batch.event, self.copy_stream)
        batch.sealed = True

    def deliver(self, batch):
        """The batch, usable on the current stream; its slot goes to `finished` once the copy is
        over. What the caller's work on the copy stream raised is raised here, the slot freed all
        the same."""
        if not batch.sealed:
            self.abandon(batch)
            raise RuntimeError("hotloop.DataLoader: a batch was handed out before its event was recorded "
                               "(a bug in hotloop: please report it)")
        if batch.error is not None:
            error, batch.error = batch.error, None
            self.abandon(batch)
            raise error
        consumer = self.cuda.current_stream()
        self.cuda.wait(consumer, batch.event)
        if consumer != batch.stream:
            self.cuda.record_stream(batch.tensors)
        # the staging buffers go back to the allocator now: later work on the consumer's stream is
        # ordered after the event, so it cannot overwrite them while the copy stream reads them
        batch.keep = None
        batch.tensors = None
        result, batch.result = batch.result, None
        self.inflight.append(batch)
        self.reclaim(False)
        return result

    def abandon(self, batch):
        """A batch whose copy was queued but that will never be handed out: its slot is released
        (by the next reclaim) once the copy is over (its event recorded now if the caller did not)."""
        if not batch.sealed:
            batch.left = None
            self.seal(batch)
        self.inflight.append(batch)  # its buffers are let go once its event completed (reclaim)

    def reclaim(self, block):
        """Move the slots whose copies finished to `finished` (with block: wait for the oldest if none did)."""
        st = self.stats
        while self.inflight:
            p = self.inflight[0]
            if not self.cuda.done(p.event):
                if not block:
                    return
                self.cuda.synchronize(p.event)
            self.inflight.popleft()
            block = False
            self.finished.append(p.slot)
            if p.timing is not None:
                st.h2d_seconds += self.cuda.elapsed_ms(*p.timing) / 1e3
                st.h2d_bytes += p.nbytes
            self._recycle(p)

    def settle(self):
        """Wait for every copy in flight and let go of its buffers: at an epoch's end, so that between
        epochs the loader holds none of a batch's memory (gpu_decode's decode buffer and entry table
        included), and memory_allocated() after an epoch shows none of it. The host waits only for the
        last batches' copies, which their consumer's stream waits for anyway."""
        while self.inflight:
            self.reclaim(True)

    def take_finished(self) -> list:
        """The slots whose copies are over since the last call: the owner frees them."""
        finished, self.finished = self.finished, []
        return finished

    def _recycle(self, p):
        """Its events back to the pools, for later copies (or for close to destroy)."""
        p.held = None
        self.event_pool.append(p.event)
        if p.timing is not None:
            self.timing_pool += p.timing

    def close(self):
        """Wait for the copies in flight (DMA must be over before the ring is unregistered) and
        destroy the events."""
        try:
            for p in self.inflight:
                self.cuda.synchronize(p.event)
                self._recycle(p)
            self.inflight.clear()
            for e in self.event_pool + self.timing_pool + [e for e in (self.alloc_event, self.left_event) if e]:
                self.cuda.destroy(e)
        except Exception:  # at interpreter exit CUDA may already be torn down
            pass
        self.event_pool = []
        self.timing_pool = []
        self.alloc_event = self.left_event = None


def slot_leaf(ring, slot, leaves, leaf_spec):
    """A batch leaf as a CPU tensor where it lies in the slot (its ring_leaf), or the tensor itself
    when it travelled in the spec (a side object: too big for the slot)."""
    k = ring_leaf(leaf_spec)
    if k is None:
        return leaf_spec[1]
    return ring_tensor(ring, slot, leaves, k)


def ring_tensor(ring, slot, leaves, k):
    """The slot's leaf k as a CPU tensor where it lies."""
    off, dtype, shape = leaves[k]
    count = torch.Size(shape).numel()
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(ring.view(slot), dtype=torch.uint8, count=count * dtype.itemsize,
                            offset=off).view(dtype).view(shape)


def page_round(nbytes):
    page = _C.RING_PAGE_BYTES
    return (nbytes + page - 1) // page * page


def slot_layout(sizes, start=0):
    """([(offset, capacity)] of each leaf in a slot, page-aligned from `start`; the slot's bytes)."""
    layout, offset = [], start
    for nbytes in sizes:
        cap = page_round(max(nbytes, 1))
        layout.append((offset, cap))
        offset += cap
    return layout, offset


class LocalRing:
    """num_workers=0 with a device: a small ring in this process that the main thread writes batches
    into (one host copy), page-locked in the background, copied to the device by DeviceCopies. It
    lives as long as its loader, so slots are page-locked once, not once per epoch."""

    def __init__(self, settings, stats, prefetch_batches, sizes):
        """settings: the loader's CopySettings; stats: its LoaderStats; sizes: the first batch's leaf bytes."""
        layout, offset = slot_layout(sizes)
        # the batches queued ahead, the one being handed out, one whose copy may still run
        nslots = prefetch_batches + 2
        self.ring = _C.Ring(nslots, offset)
        self.layout = layout
        self.slot_u8 = [torch.frombuffer(self.ring.view(i), dtype=torch.uint8) for i in range(nslots)]
        self.free_slots = list(range(nslots))
        self.copies = DeviceCopies(settings, stats)
        stats.ring_bytes = self.ring.nbytes
        input_wait.ring_made(self.ring.nbytes)
        # in the order take_slot hands them out, while this thread makes the next batches; it
        # registers only what they have not reached
        self.copies.populate(self.ring, self.free_slots[::-1])
        close_at_exit(self, LOCAL_RINGS)

    def fits(self, tensors):
        return len(tensors) <= len(self.layout) and all(
            leaf_bytes(t) <= cap for t, (_, cap) in zip(tensors, self.layout))

    def take_slot(self):
        """A free slot (after waiting for the oldest copy in flight if none is), or None."""
        if not self.free_slots:
            try:
                self.copies.reclaim(True)
            finally:
                self.free_slots += self.copies.take_finished()
        if not self.free_slots:
            return None  # another iterator of the same loader holds them all
        slot = self.free_slots.pop()
        if not self.ring.faulted(slot):
            self.ring.prefault(slot)  # one madvise instead of a page fault per 4 kB of the first batch
        return slot

    def slot(self, slot):
        return self.slot_u8[slot]

    def release_slot(self, slot):
        self.free_slots.append(slot)

    def deliver(self, batch):
        """The batch of a QueuedBatch, usable on the current stream (DeviceCopies.deliver); the
        slots whose copies are over go back."""
        try:
            return self.copies.deliver(batch)
        finally:
            self.free_slots += self.copies.take_finished()

    def settle(self):
        """The epoch's end: every copy waited for and its slot back (DeviceCopies.settle)."""
        try:
            self.copies.settle()
        finally:
            self.free_slots += self.copies.take_finished()

    def close(self):
        if self.ring is None:
            return
        forget(self)
        self.copies.close()  # copies over before the ring is unregistered and unmapped
        self.slot_u8 = None
        input_wait.ring_gone(self.ring.nbytes)
        self.ring.close()
        self.ring = None
