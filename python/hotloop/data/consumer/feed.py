"""One epoch of hotloop.DataLoader's multi-worker iterator (Feed): its tasks, sent round robin to the
workers as torch sends them, the batches taken from the pool in torch's order (or as they finish with
in_order=False) and those prepared ahead for a device. next() and the prefetch thread drive it, one at
a time, under its lock; it calls down only (the pool, its slots and copies, a maker's making) and says
what happened through attributes its caller reads (epoch_done, exhausted, top_up_due)."""
import collections
import itertools
import threading
import time

from ... import _C
from ..._torch_compat import DatasetKind
from ..messages import Ended, Failed, WholeBatch
from ..prefetch.making import BatchMaking
from ..ring.copies import QueuedBatch
from ..ring.layout import first_dim
from .handout import RaiseWhenDue, batch_samples, host_batch_out
from .pool import POLL_S
from .resume import EpochLog, sampler_state
from .tasks import Task, TaskKind


class Feed:
    """One epoch of a MultiProcessIter: its tasks, the batches prepared ahead and the pool they come from.
    It refers to the iterator's sampler iterator and settings, never to the iterator itself; next()
    and the prefetch thread both drive it, one at a time, under `lock` (reentrant: next() may shut
    the epoch down while holding it)."""

    def __init__(self, settings, sampler_iter, index_sampler, sampler_start, pool, plan, skip, stats):
        """settings: FeedSettings (settings.py); sampler_iter: the iterator's sampler iterator, which the
        epoch draws index batches from; index_sampler: the sampler it iterates; sampler_start: a
        Stateful sampler's loaded state (its batches are not drawn again), or None; plan: the loaded
        state as a resumed epoch applies it (consumer.resume.Plan), or None; skip: batches handed out before
        it; stats: the loader's LoaderStats."""
        self.lock = threading.RLock()
        self.pool = pool
        self._stats = stats
        self._prefetch_batches = settings.prefetch_batches
        self._transform = settings.transform
        # where the maker's batches are made (NOTE [ One way down for a batch ] in prefetch/making.py); with
        # no device (pool.copies None), on the CPU under the lock
        self.making = BatchMaking(settings.maker, pool.copies) if settings.maker is not None else None
        self.epoch_done = False  # the last batch was handed out (or the epoch was shut down)
        self.exhausted = False  # take_next found the epoch's end: its caller ends the epoch
        self.top_up_due = False  # a device batch went out: its caller tops up (or kicks the thread that does)
        self._sampler_iter = sampler_iter
        # a Stateful sampler: its state after each index batch drawn goes into the epoch's log
        self._sampler_stateful = sampler_state(index_sampler, sampler_iter) is not None
        self._index_sampler = index_sampler
        self._dataset_kind = settings.dataset_kind
        self._auto_collation = settings.auto_collation
        self._num_workers = settings.num_workers
        self._prefetch_factor = settings.prefetch_factor
        self._persistent_workers = settings.persistent_workers
        self._in_order = settings.in_order
        self._timeout = settings.timeout
        self._pin_memory = settings.pin_memory
        self._handed = skip  # batches of the epoch handed out (torch's _num_yielded), for messages
        self._order = []  # tasks of this epoch in the order torch would return them
        self._rcvd_idx = 0
        self._outstanding = 0
        n = self._num_workers
        self._workers_status = [True] * n if plan is None else [not s for s in plan.stopped]
        self._stop_ids = [-1 if not active else 1 << 62 for active in self._workers_status]
        self._worker_cycle = itertools.cycle(range(n))
        for _ in range(plan.next_worker if plan is not None else 0):
            next(self._worker_cycle)
        self._prepared = collections.deque()
        self._skip_batches = 0
        self._indices_done = False  # the sampler is exhausted: every index batch of the epoch went out
        self._skip_positions = {}  # position -> None or the RNG states after it (in_order=False)
        self._ahead = [list(a) for a in plan.ahead] if plan is not None else [[] for _ in range(n)]
        self._fetches = [0] * n  # an IterableDataset's batches per worker in this resumed epoch
        pool.begin_epoch(plan.setups if plan is not None else None)
        iterable = self._dataset_kind == DatasetKind.Iterable
        pos0 = 0
        if not iterable:
            pos0 = plan.positions if plan is not None else skip
            for _ in range(pos0 if sampler_start is None else 0):  # a Stateful sampler resumed where it stood
                next(self._sampler_iter)
            if plan is not None:
                self._skip_positions = dict(zip(plan.yielded_after, plan.yielded_after_rng))
        elif plan is None or plan.setups is None:
            self._skip_batches = skip  # no worker positions: walk the iterable through the workers
        self._next_pos = pos0
        self.log = self._log = EpochLog(n, iterable, self._order, pos0, plan.next_worker if plan is not None else 0,
                                        pool.track, sampler_start)

    def fill(self):
        """Hand out tasks up to prefetch_factor per worker (the epoch's first ones, at its start)."""
        self._fill()

    def ahead(self) -> int:
        """Batches prepared for the consumer's next next() calls (read without the lock: a length)."""
        return len(self._prepared)

    def abandon_prepared(self):
        """Copies queued for batches never handed out: their slots are freed once those end."""
        pool = self.pool
        if pool is not None and not pool.closed:
            for old in self._prepared:
                if isinstance(old[0], QueuedBatch):
                    if self.making is not None:
                        self.making.drop(old[0])  # not made, or waited for while it is being made
                    pool.slots.abandon(old[0])
        self._prepared = collections.deque()

    def shutdown(self):
        """The epoch's end without persistent workers, or the iterator's: the workers go (its caller
        stopped the prefetch thread first)."""
        self.abandon_prepared()  # their copies must end before the ring is unregistered
        pool, self.pool = self.pool, None
        if pool is not None and not self._persistent_workers:
            pool.close()

    def settle(self):
        """The epoch's end with persistent workers: the epoch's last copies waited for, so that its
        batches' buffers are not held until the next epoch (DeviceCopies.settle)."""
        if self.pool is not None and self.pool.device is not None:
            self.pool.slots.settle()

    def _fill(self):
        while self._try_put_index():
            pass

    def _try_put_index(self):
        pool = self.pool
        ring_known = pool.ring is not None or pool.ring_unused
        max_tasks = self._prefetch_factor * self._num_workers if ring_known else self._num_workers
        if self._outstanding >= max_tasks:
            return False
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            self._indices_done = True
            return False
        for _ in range(self._num_workers):  # the next active worker, round robin as torch does
            wid = next(self._worker_cycle)
            if self._workers_status[wid]:
                break
        else:
            return False
        pos = self._next_pos
        self._next_pos += 1
        if self._sampler_stateful:
            self._log.drew(self._next_pos - self._log.pos0, sampler_state(self._index_sampler, self._sampler_iter))
        if pos in self._skip_positions:  # a resumed epoch: handed out before the state was taken
            rng = self._skip_positions.pop(pos)
            if rng is None:  # its worker's saved states already cover it
                self._order.append(Task(-1, wid, None, -1, consumed=True, kind=TaskKind.BATCH, handed=True))
            else:
                ghost = pool.ghost(wid, index, rng)
                self._order.append(ghost)
                self._log.add(ghost)
            return True
        ahead = self._ahead[wid]
        while ahead and ahead[0] == self._fetches[wid]:  # a resumed IterableDataset: skip what was handed out
            ahead.pop(0)
            self._log.add(pool.ghost(wid, index, None))
            self._fetches[wid] += 1
        self._fetches[wid] += 1
        task = pool.new_task(wid, index)
        self._order.append(task)
        self._log.add(task)
        self._outstanding += 1
        return True

    def _next_task(self):
        """The next task to return (in order, or any finished one when in_order=False)."""
        while self._rcvd_idx < len(self._order):
            task = self._order[self._rcvd_idx]
            if task.consumed:
                self._rcvd_idx += 1
                continue
            if self._live(task) or self.pool.is_done(task):
                break
            self.pool.drop(task)
            self._log.settle(task)
            self._outstanding -= 1
            self._rcvd_idx += 1
        else:
            return None
        if not self._in_order:
            for task in self._order[self._rcvd_idx:]:
                if not task.consumed and self.pool.is_done(task):
                    return task
        return self._order[self._rcvd_idx]

    def _live(self, task):
        """Its worker may still deliver it: it is active, or the task came before its stop (with
        in_order=False a stop can be taken before an earlier batch of the same worker)."""
        return self._workers_status[task.wid] or task.id < self._stop_ids[task.wid]

    def _first_done(self, head):
        """in_order=False: sleep until any outstanding task is done and return it (the head once
        `timeout` passed: _wait then raises)."""
        pool = self.pool
        deadline = time.monotonic() + self._timeout if self._timeout and self._timeout > 0 else None
        while deadline is None or time.monotonic() < deadline:
            candidates = [t for t in self._order[self._rcvd_idx:] if not t.consumed and self._live(t)]
            for task in candidates:
                if pool.is_done(task):
                    return task
            pool.check_workers()
            if pool.layouts:
                pool.place_layouts()
            self._fill()
            waiting = [t for t in candidates if t.slot >= 0 and pool.ring.state(t.slot) == _C.RING_ASSIGNED]
            # a slot's change wakes it, a pipe message does not: candidates that take the pipe
            # (side path, layouts) are looked at again after 20 ms
            pool.doze(waiting[0].slot if waiting else -1, 0.02 if waiting else POLL_S)
        return head

    def _wait(self, task):
        """Block until the task is done; a dead worker is replaced meanwhile (or raises), more
        tasks are handed out as the ring allows (it may be made meanwhile), and every sleep is bounded."""
        pool, timeout, batch_number = self.pool, self._timeout, self._handed + len(self._prepared)
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        while True:
            outcome = pool.poll_or_tend(task)
            if outcome is not None:
                return outcome
            self._fill()
            pool.doze_for(task, deadline, timeout, batch_number)

    def _next_result(self, block=True):
        """(the next batch, assembled (CPU) or with its copy queued (QueuedBatch, CUDA; a batch the
        maker makes is made outside the lock: BatchMaking.make_ready), its samples, its task). None when
        the next one is not ready and block is False."""
        pool = self.pool
        while True:
            task = self._next_task()
            if task is None:
                if self._dataset_kind == DatasetKind.Map and not self._indices_done:
                    # every task handed out, yet the sampler has more: a bug here, never a short epoch in silence
                    raise RuntimeError(f"hotloop.DataLoader: the epoch ran out of tasks after {self._next_pos} index "
                                       "batches while the sampler had more (a bug in hotloop: please report it)")
                raise StopIteration  # the caller shuts the workers down once nothing is left to hand out
            if not block and (not pool.is_done(task) or pool.slots.copy_can_wait(task.slot)):
                return None
            if not self._in_order and not pool.is_done(task):
                task = self._first_done(task)
            outcome = self._wait(task)
            pool.finish(task)
            pool.took(task, outcome)
            if isinstance(outcome, Ended):
                self._outstanding -= 1
                self._log.settle(task)
                self._workers_status[task.wid] = False
                self._stop_ids[task.wid] = task.id
                if task.slot >= 0:
                    pool.release_slot(task.slot)
                self._fill()
                continue
            if isinstance(outcome, Failed):
                if task.slot >= 0:
                    pool.release_slot(task.slot)
                self._fill()
                try:
                    outcome.error.reraise()
                except Exception as exc:  # raised when its batch is due (a device prefetch takes it early)
                    return RaiseWhenDue(exc), 0, task
            self._stats.worker_busy_seconds += outcome.busy
            if isinstance(outcome, WholeBatch):
                batch = outcome.batch
                self._fill()
                samples = self._samples_of(task, lambda: batch_samples(batch, 1))
                out = host_batch_out(pool.device, self._transform, self.making, batch, self._pin_memory)
                return out, samples, task
            spec, leaves = outcome.spec, outcome.leaves  # a SlotBatch
            samples = self._samples_of(task, lambda: first_dim(spec, leaves, 1))
            parts = self.making.parts_of(spec) if self.making is not None else None
            if pool.device is None and parts is not None:
                out = self.making.make_on_cpu(pool.slots, task.slot, spec, leaves, parts, self._pin_memory)
            elif pool.device is None:
                out = pool.slots.copy_out(task.slot, spec, leaves, self._pin_memory)
            else:
                out = pool.slots.copy_to_device(task.slot, spec, leaves, parts)
            self._fill()
            return out, samples, task

    def _samples_of(self, task, from_batch):
        if not self._auto_collation:
            return 1
        if self._dataset_kind == DatasetKind.Map:
            return len(task.index)
        return from_batch()  # an iterable's last batch may be short

    def take_next(self):
        """(the next batch, its samples), with the lock held. Its caller reads what happened besides:
        epoch_done, exhausted (the epoch's end found now: stop the prefetch thread, shut down) and
        top_up_due (a device batch went out, or raised: top up, or kick the thread that does)."""
        if self.pool is None:
            self.epoch_done = True
            raise StopIteration
        self.exhausted = False
        if self.pool.closed:
            raise RuntimeError("DataLoader: this epoch ended with an error in a worker (see above); start a new "
                               "one with iter(loader)")
        self._skip()
        pool = self.pool
        try:
            if pool.device is None:
                out, samples, task = self._next_result()
            else:
                if not self._prepared:
                    self._prepared.append(self._next_result())
                out, samples, task = self._prepared.popleft()
        except StopIteration:
            self.epoch_done = self.exhausted = True
            raise
        self._handed += 1
        if pool.device is None:
            self._hand_out(out, task)
            return out, samples
        self.top_up_due = True
        self._hand_out(out, task)
        if isinstance(out, QueuedBatch):
            out = pool.slots.deliver(out)
        return out, samples

    def next_to_make(self):
        """With a maker and a device, lock held, before take_next: the batch the next take_next hands
        out (prepared now if none is), when it is still to be made (by the caller, once it let go of
        the lock: BatchMaking.make_ready); else None. It stays first in line until handed out, so a Ctrl-C
        while it is being made loses nothing. Raises what take_next would (StopIteration at the
        epoch's end, its caller's cue to end it)."""
        if self.pool is None or self.pool.closed or self.pool.device is None:
            return None  # take_next says why
        self._skip()
        try:
            if not self._prepared:
                self._prepared.append(self._next_result())
        except StopIteration:
            self.epoch_done = self.exhausted = True
            raise
        head = self._prepared[0][0]
        return head if isinstance(head, QueuedBatch) and not head.sealed else None

    def _skip(self):
        """A resumed IterableDataset's batches handed out before the state was taken: taken from the
        workers and dropped (their copies freed, a maker's batches not made)."""
        while self._skip_batches:
            self._skip_batches -= 1
            out, _, task = self._next_result()
            self._hand_out(out, task)
            if isinstance(out, QueuedBatch):
                if self.making is not None:
                    self.making.drop(out)
                self.pool.slots.abandon(out)

    def top_up(self, limit=None):
        """With a device, lock held (the prefetch thread, or next() without it): take the batches
        after the one handed out from the workers and queue their copies, up to prefetch_batches
        (and at most `limit` of them), as far as they are done and their slots page-locked (it never
        waits: next() takes a batch that was not, and page-locks its slot if need be). True when
        it is worth looking again soon: the next batch is done but its slot not yet page-locked, or
        `limit` batches were prepared with room for more. An exception here is raised by next()
        at the turn of the batch it was preparing. A maker's batches are left for the caller to
        make once it let go of the lock (to_make)."""
        pool = self.pool
        if pool is None or pool.closed:
            return False
        room = self._prefetch_batches
        try:
            for _ in range(room if limit is None else limit):
                if len(self._prepared) >= room:
                    return False
                task = self._next_task()
                if task is None:
                    return False  # the epoch's end, or every task sent is prepared: the next come with hand-outs
                nxt = self._next_result(block=False)
                if nxt is None:
                    return pool.is_done(task)
                self._prepared.append(nxt)
            return len(self._prepared) < room
        except StopIteration:
            pass  # the epoch's last batches are prepared; they are handed out by the next calls
        except Exception as exc:
            self._prepared.append((RaiseWhenDue(exc), 0, None))
        return False

    def to_make(self):
        """With the lock held: the prepared batches a maker has still to make, in batch order."""
        return [out for out, _, _ in self._prepared if isinstance(out, QueuedBatch) and not out.sealed]

    def _hand_out(self, out, task):
        """The task's batch goes to the consumer now: log it (state_dict), or raise its error (task
        None: an error of the prefetch itself, no batch of its own)."""
        if task is not None:
            task.handed = True
            self._log.settle(task)
            # a batch counts among the prefetch_factor * workers until handed out, as torch counts it, and
            # its hand-out sends the next index (torch's _try_put_index): batches copied to the device
            # ahead do not let the sampler be read further, which a sampler read past its end would show
            # in the loader's generator (test_sampler_reads.py)
            self._outstanding -= 1
            self._fill()
        if isinstance(out, RaiseWhenDue):
            raise out.exc
