"""hotloop.DataLoader's iterators: num_workers=0 (SingleProcessIter, torch's single-process iterator
plus a local ring for a device) and num_workers > 0 (MultiProcessIter, torch's iterator whose epochs a
consumer.feed.Feed runs over a worker pool). They are the loader's own layer: they read and update its epoch
state (state_dict's) and hand the layers below frozen settings and the stats sink."""
import collections
import functools
import os
import time

import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

from ... import input_wait
from ..._torch_compat import (BaseDataLoaderIter, DatasetKind, SingleProcessDataLoaderIter, default_collate,
                              sharding_worker_init_fn)
from ..at_exit import forked_copy
from ..prefetch.making import BatchMaking
from ..prefetch.thread import Prefetcher
from ..ring.copies import LocalRing, QueuedBatch
from ..ring.layout import FastPathDeclined, SlotWriter, flatten, leaf_bytes, write_fast, write_general
from ..settings import CopySettings, FeedSettings, PoolSettings
from ..worker.loop import WorkerSpec
from .feed import Feed
from .handout import RaiseWhenDue, batch_samples, host_batch_out
from .pool import Pool
from .resume import Plan, dataset_state, epoch_sampler, load_dataset_state, load_sampler_state, sampler_state


class LoaderEpochs:
    """The loader's state that its iterators keep up to date and its state_dict() reads. The loader
    makes one and hands it to each iterator it makes: they reach it there, never through the
    loader's private attributes."""

    def __init__(self):
        self.pool = None  # persistent workers keep theirs here
        self.local_ring = None  # num_workers=0 with a device: the ring batches go through
        self.resume = None  # a loaded state, applied by the next iterator
        self.epoch = None  # the current epoch's (generator state, base seed)
        self.epoch_done = False  # its last batch was handed out
        self.yielded = 0  # batches handed out in it
        self.iter = None  # weak reference to the live iterator
        self.plan = None  # the loaded state, as the next multi-worker iterator applies it
        self.log = None  # the current epoch's EpochLog (num_workers > 0)
        # num_workers=0: the Stateful sampler's and dataset's states after the last batch handed out
        self.single = {"sampler_state": None, "dataset_state": None}
        self.sampler_epoch = None  # the epoch sampler's epoch (DistributedSampler.set_epoch) in the current epoch
        self.epoch_at_load = None  # the epoch sampler's epoch when a state was loaded (resume_sampler_epoch)


def generator_of(loader):
    """The generator the loader's sampler and worker seeds draw from: its own, or torch's default one."""
    return loader.generator if loader.generator is not None else torch.default_generator


def _record(epochs, stats, t0, samples):
    dt = time.perf_counter() - t0
    epochs.yielded += 1
    st = stats
    st.wait_seconds += dt
    st.batches += 1
    st.samples += samples
    input_wait.add(dt, samples)


def _count_elapsed(it, stats, t0):
    """Epoch wall time as the consumer sees it: from entering the first __next__ to the last return."""
    now = time.perf_counter()
    last = getattr(it, "_last_return", None)
    stats.elapsed_seconds += now - (t0 if last is None else last)
    it._last_return = now


def pool_settings(loader):
    """What a worker pool is given of the loader (its settings as they stand at the pool's start)."""
    return PoolSettings(mp_context=loader.multiprocessing_context or torch.multiprocessing,
                        num_workers=loader.num_workers, copies=copy_settings(loader), batch_size=loader.batch_size,
                        prefetch_factor=loader.prefetch_factor,
                        prefetch_batches=loader.prefetch_batches, max_worker_restarts=loader.max_worker_restarts)


def copy_settings(loader):
    """What a copy engine is given of the loader."""
    maker = loader.batch_maker
    return CopySettings(device=loader.device, transform=loader.gpu_transform,
                        pin_slots=maker is None or maker.pins_ring)


def _swap_in_worker_side(it, loader) -> bool:
    """What the iterator's workers (or its own thread) index and how they collate it, as the loader's
    batch maker has them (gpu_decode: the image path's samples, packed batches). False when that is
    the dataset and collate_fn as given."""
    maker = loader.batch_maker
    if maker is None:
        return False
    dataset, collate_fn = maker.worker_side(it._dataset, it._collate_fn, loader.num_workers)
    if dataset is it._dataset and collate_fn is it._collate_fn:
        return False
    it._dataset, it._collate_fn = dataset, collate_fn
    return True


class _EpochStart:
    """What both iterators do as an epoch starts (their `_epochs`: the loader's LoaderEpochs)."""

    def _begin_epoch(self, loader):
        """Once the sampler iterator exists and before the epoch draws from it: rewind the generator
        for a resumed epoch, remember where this epoch starts, return the batches to skip. A
        multi-worker iterator finds the rest of a loaded state in its LoaderEpochs' plan."""
        epochs = self._epochs
        gen = generator_of(loader)
        resume, epochs.resume = epochs.resume, None
        epochs.plan = None
        epochs.log = None
        epochs.single = {"sampler_state": None, "dataset_state": None}
        self._hl_sampler_start = None  # a Stateful sampler's loaded state: its batches are not drawn again
        self._hl_dataset_start = None  # num_workers=0: a Stateful dataset's loaded state, likewise
        skip = 0
        if resume is not None and resume.get("generator_state") is not None:
            gen.set_state(resume["generator_state"])  # epoch_done with persistent workers: undo the seed draw
            if resume.get("base_seed") is not None:
                self._base_seed = resume["base_seed"]
            skip = int(resume["batches_yielded"])
            if resume.get("sampler_state") is not None:
                self._sampler_iter = load_sampler_state(self._index_sampler, resume["sampler_state"])
                self._hl_sampler_start = resume["sampler_state"]
            if resume.get("dataset_state") is not None and loader.num_workers == 0:
                self._hl_dataset_start = resume["dataset_state"]
            if resume["version"] >= 2 and loader.num_workers > 0:
                epochs.plan = Plan.of(resume, loader.num_workers, self._dataset_kind == DatasetKind.Iterable)
        epochs.single = {"sampler_state": self._hl_sampler_start, "dataset_state": self._hl_dataset_start}
        epochs.epoch = (gen.get_state(), self._base_seed)
        sampler = epoch_sampler(loader.batch_sampler, loader.sampler)
        epochs.sampler_epoch = sampler.epoch if sampler is not None else None
        epochs.epoch_done = False
        epochs.yielded = skip
        return skip


class SingleProcessIter(_EpochStart, SingleProcessDataLoaderIter):
    """num_workers=0: torch's own single-process iterator, plus device, transform, stats and resume.

    With a device, batches are made in the main thread as torch makes them (the dataset need not be
    thread-safe), but written straight into a slot of a small page-locked ring (LocalRing) and copied
    to the device asynchronously on a side stream: the copy of batch k overlaps the making of batch
    k+1. `prefetch_batches` batches are made and queued ahead of the one returned."""

    def __init__(self, loader, epochs):
        """epochs: the loader's LoaderEpochs."""
        self._hl_pid = os.getpid()
        self._epochs = epochs
        super().__init__(loader)
        if _swap_in_worker_side(self, loader):
            self._dataset_fetcher = DatasetKind.create_fetcher(self._dataset_kind, self._dataset, self._auto_collation,
                                                                self._collate_fn, self._drop_last)
        self._loader = loader
        self._last_return = None
        self._prepared = collections.deque()  # (QueuedBatch or batch or RaiseWhenDue, samples), oldest first
        maker = loader.batch_maker
        self._making = BatchMaking(maker) if maker is not None else None  # where its batches are made
        self._exhausted = False
        self._fast = (self._dataset_kind == DatasetKind.Map and self._auto_collation
                      and self._collate_fn is default_collate and not getattr(self._dataset, "__getitems__", None))
        skip = self._begin_epoch(loader)
        self._skip(skip)
        # the Stateful sampler and dataset (if any) whose states go with each batch, for state_dict()
        self._stateful = (sampler_state(self._index_sampler, self._sampler_iter) is not None
                          or dataset_state(self._dataset, self._dataset_fetcher) is not None)

    def _skip(self, n):
        if self._hl_dataset_start is not None:  # a Stateful dataset: set where it stood, not walked
            self._dataset_fetcher = load_dataset_state(self._dataset, self._hl_dataset_start, functools.partial(
                DatasetKind.create_fetcher, self._dataset_kind, self._dataset, self._auto_collation,
                self._collate_fn, self._drop_last))
        for _ in range(n):
            if self._dataset_kind == DatasetKind.Map:
                if self._hl_sampler_start is None:  # a Stateful sampler resumed where it stood
                    next(self._sampler_iter)
            elif self._hl_dataset_start is None:
                super()._next_data()  # an iterable's position is only known by walking it
            self._num_yielded += 1

    def _states_now(self):
        """The Stateful sampler's and dataset's states as they stand (after the batches made so far)."""
        if not self._stateful:
            return None
        return {"sampler_state": sampler_state(self._index_sampler, self._sampler_iter),
                "dataset_state": dataset_state(self._dataset, self._dataset_fetcher)}

    def _handed(self, states):
        if states is not None:
            self._epochs.single = states

    def _next_data(self):
        t0 = time.perf_counter()
        loader = self._loader
        if loader.device is None:
            try:
                batch = super()._next_data()  # torch pins it there when pin_memory
            except StopIteration:
                self._epochs.epoch_done = True
                raise
            finally:
                self._handed(self._states_now())  # a batch that raised was handed out too
            batch = host_batch_out(loader.device, loader.gpu_transform, self._making, batch, False)
            _record(self._epochs, loader.stats, t0, batch_samples(batch, 1))
        else:
            try:
                if not self._prepared:
                    if self._exhausted:
                        raise StopIteration
                    self._prepared.append(self._produce_noted())
            except StopIteration:
                self._exhausted = True
                self._epochs.epoch_done = True
                if self._epochs.local_ring is not None:
                    self._epochs.local_ring.settle()
                raise
            batch, samples, states = self._prepared.popleft()
            self._handed(states)
            if isinstance(batch, RaiseWhenDue):
                raise batch.exc
            if isinstance(batch, QueuedBatch):
                batch = self._epochs.local_ring.deliver(batch)
            # the next batches are made while the copy of this one runs
            while not self._exhausted and len(self._prepared) < loader.prefetch_batches:
                try:
                    self._prepared.append(self._produce_noted())
                except StopIteration:
                    self._exhausted = True
                except Exception as exc:  # raised when its batch's turn comes, as torch would
                    self._prepared.append((RaiseWhenDue(exc), 0, self._states_now()))
                    break
            _record(self._epochs, loader.stats, t0, samples)
        _count_elapsed(self, loader.stats, t0)
        return batch

    def _produce_noted(self):
        """_produce's batch and samples, and the states after it: made ahead, they count once handed out."""
        batch, samples = self._produce()
        return batch, samples, self._states_now()

    def _produce(self):
        """The next batch: made as torch makes it, written into a slot of the local ring and its copy
        to the device queued (a QueuedBatch), or, when it does not fit the ring, sent to the device as
        the plain path does. Returns (batch, samples)."""
        loader = self._loader
        index = self._next_index()
        epochs = self._epochs
        ring = epochs.local_ring
        if ring is not None and ring.ring is None:
            ring = epochs.local_ring = None  # closed (interpreter exit)
        if self._fast:
            samples = [self._dataset[i] for i in index]
            if ring is not None:
                slot = ring.take_slot()
                if slot is not None:
                    writer = SlotWriter(ring.slot(slot), ring.layout)
                    try:
                        spec = write_fast(samples, writer)
                    except FastPathDeclined:
                        ring.release_slot(slot)
                    except BaseException:
                        ring.release_slot(slot)
                        raise
                    else:
                        return self._copy(ring, slot, spec, writer.leaves), len(index)
            batch = self._collate_fn(samples)
        else:
            batch = self._dataset_fetcher.fetch(index)
        tensors = []
        flatten(batch, tensors)
        if not self._auto_collation:
            n = 1
        else:  # an iterable's last batch may be short
            n = len(index) if self._dataset_kind == DatasetKind.Map else batch_samples(batch, 1)
        if tensors and ring is None:
            ring = epochs.local_ring = LocalRing(copy_settings(loader), loader.stats, loader.prefetch_batches,
                                                 [leaf_bytes(t) for t in tensors])
        if tensors and ring.fits(tensors):
            slot = ring.take_slot()
            if slot is not None:
                writer = SlotWriter(ring.slot(slot), ring.layout)
                spec = write_general(batch, writer)  # every tensor fits: none stays in the spec
                return self._copy(ring, slot, spec, writer.leaves), n
        return host_batch_out(loader.device, loader.gpu_transform, self._making, batch, False), n

    def _copy(self, ring, slot, spec, leaves):
        """The slot's copy to the device queued; a maker's batch made now, as soon as the ring holds
        it (NOTE [ One way down for a batch ] in prefetch/making.py)."""
        making = self._making
        if making is not None:
            making.copies = ring.copies  # the loader's own ring: the same from batch to batch
        parts = making.parts_of(spec) if making is not None else None
        batch = ring.copies.copy_to_device(ring.ring, slot, spec, leaves, parts)
        if parts is not None:
            making.make_ready(batch)
        return batch

    def __del__(self):
        if forked_copy(self):
            return
        # copies queued for batches never handed out: their slots are freed once those end
        epochs = getattr(self, "_epochs", None)
        ring = epochs.local_ring if epochs is not None else None
        for batch, _, _ in getattr(self, "_prepared", ()):
            if isinstance(batch, QueuedBatch) and ring is not None and ring.ring is not None:
                ring.copies.abandon(batch)
        self._prepared = collections.deque()


class MultiProcessIter(_EpochStart, BaseDataLoaderIter):
    """num_workers > 0: torch's iterator (its samplers, seeds and attributes), whose epochs a Feed
    runs: tasks go round robin to the workers as torch sends them, results come back through the
    ring (the first batch of each worker too: it gets its slot when the ring is made), or through the
    worker's pipe when there is no ring (batches without tensors) or the outcome of a first batch came
    before its worker sent a layout (an error or a stop at its first sample).

    The feed is apart so that the prefetch thread holds the feed, never this object: the consumer's
    last reference to the iterator is then always the one that drops it, and its workers are shut
    down in the consumer's thread before `del it` returns. (When the thread held the iterator for a
    top-up at that moment, the shutdown ran later, in the thread.)"""

    # the seams tests and the bench turn off, to cover (and time) both ways
    prefetch_thread = True  # with a device, the next copies are queued by a thread (prefetch.thread.Prefetcher)
    paced_top_ups = True  # a batch maker's top-ups start later in the consumer's step (prefetch.thread.TopUpPace)

    def __init__(self, loader, epochs):
        """epochs: the loader's LoaderEpochs."""
        self._hl_pid = os.getpid()
        self._epochs = epochs
        if loader.prefetch_factor <= 0:  # torch's check, in torch's words (its DataLoader accepts the argument)
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")
        pool = epochs.pool if loader.persistent_workers else None
        carry_on = pool is not None and not pool.closed
        if carry_on:
            # the loader's persistent workers outlived the iterator that started them: this one
            # stands in for torch's reset of that iterator, which draws no new worker seed
            generator_state = generator_of(loader).get_state()
        super().__init__(loader)
        _swap_in_worker_side(self, loader)
        # torch starts its workers here, before _reset draws another: a DataPipe's first epoch is seeded with this one
        self._first_shared_seed = self._shared_seed
        if carry_on:
            generator_of(loader).set_state(generator_state)
            self._base_seed = pool.spec.base_seed
        self._loader = loader
        self._prefetch_factor = loader.prefetch_factor
        self._feed = None
        self._prefetcher = None  # the thread that tops the feed up with a device (prefetch/thread.py)
        self._reset(loader, first_iter=True)

    @property
    def lock(self):
        """The current epoch's lock (state_dict takes it: the prefetch thread adds to the epoch's log)."""
        return self._feed.lock

    @property
    def _pool(self):
        return self._feed.pool if self._feed is not None else None

    def _reset(self, loader, first_iter=False):
        old = self._feed
        if old is not None:
            self._stop_prefetcher()
        super()._reset(loader, first_iter)
        skip = self._begin_epoch(loader)
        plan = self._epochs.plan
        pool = self._epochs.pool if self._persistent_workers else None
        if pool is not None and not pool.closed and plan is not None and plan.setups is not None:
            # saved RNG states and replays start from freshly seeded workers: these are not
            if old is not None:
                old.abandon_prepared()
            pool.close()
        if pool is None or pool.closed:
            init_fn = loader.worker_init_fn
            if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):  # as torch: shard a DataPipe per worker
                init_fn = functools.partial(sharding_worker_init_fn, init_fn, self._world_size, self._rank)
            spec = WorkerSpec(self._num_workers, self._dataset_kind, self._dataset, self._auto_collation,
                              self._collate_fn, self._drop_last, self._base_seed, init_fn,
                              self._first_shared_seed if first_iter else self._shared_seed)
            pool = Pool(pool_settings(loader), loader.stats, spec)
            if self._persistent_workers:
                self._epochs.pool = pool
        elif not first_iter or old is None:
            pool.resume(self._shared_seed)
        if old is not None:
            old.abandon_prepared()  # copies of an abandoned epoch: their slots are freed later
        self._num_yielded = skip
        self._last_return = None
        maker = loader.batch_maker
        settings = FeedSettings(dataset_kind=self._dataset_kind, auto_collation=self._auto_collation,
                                num_workers=self._num_workers, prefetch_factor=self._prefetch_factor,
                                persistent_workers=self._persistent_workers, in_order=loader.in_order,
                                timeout=self._timeout, pin_memory=self._pin_memory,
                                prefetch_batches=loader.prefetch_batches, transform=loader.gpu_transform,
                                maker=maker)
        feed = Feed(settings, self._sampler_iter, self._index_sampler, self._hl_sampler_start, pool, plan, skip,
                    loader.stats)
        self._epochs.log = feed.log  # the epoch's log, which state_dict reads
        feed.fill()
        self._feed = feed
        pool.start_all()  # workers that got no task yet: torch starts every worker at iter() too
        self._workers = pool.workers()  # torch's name, which tools read
        if pool.device is not None and loader.prefetch_batches > 0 and self.prefetch_thread:
            self._prefetcher = Prefetcher(feed, paced=self.paced_top_ups and maker is not None and maker.paced_top_ups)

    def restart(self, loader):
        """The next epoch with the same workers (persistent workers): what torch's DataLoader.__iter__
        does with its iterator's _reset."""
        self._reset(loader)

    def _stop_prefetcher(self):
        """No more top-ups by the thread (waited for unless this thread holds the feed's lock)."""
        prefetcher, self._prefetcher = getattr(self, "_prefetcher", None), None
        if prefetcher is not None:
            prefetcher.close()

    def _next_data(self):
        t0 = time.perf_counter()
        feed = self._feed
        if feed.making is not None and feed.making.copies is not None:
            self._make_next(feed)
        with feed.lock:
            try:
                out, samples = feed.take_next()
            except StopIteration:
                if feed.epoch_done:
                    self._epochs.epoch_done = True
                if feed.exhausted:  # the epoch's end, found now: the workers go (unless persistent)
                    self._stop_prefetcher()
                    if not self._persistent_workers:
                        feed.shutdown()
                    else:
                        feed.settle()
                raise
            finally:
                if feed.top_up_due:  # a device batch went out (or raised): the next batches' copies
                    feed.top_up_due = False
                    if self._prefetcher is not None:
                        self._prefetcher.kick(t0)  # queued while the step runs
                    else:
                        feed.top_up()
        _record(self._epochs, self._loader.stats, t0, samples)
        _count_elapsed(self, self._loader.stats, t0)
        return out

    def _make_next(self, feed):
        """A maker's batch that next() hands out, made here if the prefetch thread has not made it,
        outside the lock (NOTE [ One way down for a batch ] in prefetch/making.py). What stops the epoch
        here is take_next's to raise again."""
        try:
            with feed.lock:
                batch = feed.next_to_make()
        except StopIteration:
            return
        if batch is not None:
            feed.making.make_ready(batch)

    def _shutdown(self):
        feed = getattr(self, "_feed", None)
        if feed is not None:
            self._stop_prefetcher()
            feed.shutdown()

    def __del__(self):
        feed = getattr(self, "_feed", None)
        if feed is None or forked_copy(self):
            return
        self._stop_prefetcher()  # waits for a top-up in progress: this thread does not hold the lock
        if not self._persistent_workers:
            feed.shutdown()
        else:
            feed.abandon_prepared()  # the loader's workers live on: free these copies' slots
