"""The thread that queues the next batches' copies to the device while the training step runs.

With a device, next() hands out a batch whose copy is already queued; it then used to take the
next batches from the workers and queue their copies itself: Python work (slot metadata, the
sampler's next indices, the task sent to a worker, three allocations, the copy, the transform's
launch) on the training thread between one step and the next, while the GPU had little queued
(a step that ends with a sync, as torch's GradScaler's does). This thread does that part instead,
after next() returned, largely while the training thread waits for the GPU with the GIL released
(backward, `.item()`): next() only hands a batch out, and what the work still costs the training
thread is its share of the GIL the two threads hold by turns.

It never waits for a worker: it takes what is done when next() wakes it and sleeps again; a batch
that was not done is taken by the next next() as before. Nor does it page-lock a slot: the ring's
background thread does that, slot after slot, and until it reaches a done batch's slot this thread
looks again every RETRY_S. Page-locking here would hold the driver lock, which the training
thread's kernel launches wait for, and the iterator's lock, which next() waits for: the first steps,
when most slots are not page-locked yet, would pay for it.

With gpu_decode the top-up is paced: it starts later in the step than next(), where a batch is already
prepared, so that nvjpeg's CUDA calls fall while the training thread waits for the GPU rather than
while it launches; and it prepares one batch per run, each at its own paced time (NOTE [ Paced top-ups ]).

Everything it does runs under the epoch's lock, which next() holds too, so the pool and the
epoch's state never see two threads; all but the making of a batch maker's batches (gpu_decode's),
which it does right after, once it let go of that lock (NOTE [ One way down for a batch ] in
prefetch/making.py). It holds the epoch's feed (consumer.feed.Feed), never the iterator, and the feed only through a
weak reference: the iterator's last reference is the consumer's, whose drop stops this thread and
shuts the workers down at once, in the consumer's thread.
"""
import collections
import threading
import time
import weakref

from ..at_exit import PREFETCH_THREADS, close_at_exit, forget

RETRY_S = 0.002  # how soon to look again at a batch that waits for its slot to be page-locked
PACE_FRACTION = 0.65  # a paced top-up starts this far into the consumer's step (its period)
PACE_MARGIN_S = 0.002  # and ends this long before the next next() but one at the latest
PERIOD_WINDOW = 8  # the consumer's step is the shortest of this many gaps between next() calls


# NOTE [ Paced top-ups ]
# nvjpeg's decode of a batch makes hundreds of CUDA calls from the prefetch thread. What they cost a
# training step is not work on the GPU but the training thread's own launches, slowed while those
# calls run (a step captured as one CUDA graph, which launches once, hardly feels them). A step
# launches its kernels first and then mostly waits for the GPU (a loss.item(), GradScaler's
# found_inf), so a paced top-up starts PACE_FRACTION of a step after next(): by then a batch is
# already prepared for the next next() (nothing is late for it), and it is early enough to end
# before the next next() but one, which wants the batch it prepares. Started at once, the decode
# falls among the forward's launches; started just early enough to end before the next next(),
# among the backward's; around two thirds into the step, mostly while the step waits for the GPU.
# The measured `work` is the whole top-up, the decode included: the latest start is two periods
# less that work, so that the batch is decoded before the next next() but one.
#
# The period is the shortest of the last PERIOD_WINDOW gaps between next() calls: the step as long
# as nothing slowed it. A moving average would count the steps that decodes slowed, and a paced
# start computed from it can come after the next next(), which then finds no batch prepared and has
# two decoded back to back among its own launches: slow and fast steps by turns. For the same reason
# a paced run prepares one batch (Prefetcher): two decodes at the step's start slow its launches.
# Gaps run from call to call (kicked): a training loop's are the same either way, but a consumer on
# a fixed schedule catches up after a next() that waited, and its return-to-return gap would shrink
# the period.


class TopUpPace:
    """When a paced top-up starts after next() kicked it (gpu_decode's loaders): NOTE [ Paced top-ups ]."""

    def __init__(self):
        self._gaps = collections.deque(maxlen=PERIOD_WINDOW)  # seconds between next() calls, latest last
        self.work = 0.0  # seconds a top-up that prepared a batch took, a moving average
        self._last = None

    @property
    def period(self):
        """The consumer's step (seconds between next() calls): the shortest recent one, or None."""
        return min(self._gaps) if self._gaps else None

    def kicked(self, called_at):
        """A next() was called at `called_at`. Gaps are counted between calls, not returns: a
        consumer on a fixed schedule (a thread taking one batch per period) calls again one period
        after its last call however long that call waited, but returns a wait's length closer to it;
        a training loop's call-to-call gap is its step plus any wait, never shorter than the step."""
        if self._last is not None:
            self._gaps.append(called_at - self._last)
        self._last = called_at

    def worked(self, seconds):
        self.work = seconds if self.work == 0.0 else 0.8 * self.work + 0.2 * seconds

    def delay(self, ahead) -> float:
        """Seconds from the kick to the top-up, with `ahead` batches prepared for the consumer."""
        period = self.period
        if ahead < 1 or period is None:
            return 0.0  # behind, or no period measured yet: at once
        return max(0.0, min(PACE_FRACTION * period, 2 * period - self.work - PACE_MARGIN_S))


class Prefetcher:
    """Runs `feed.top_up()` under `feed.lock` in a thread of its own each time `kick()` is called;
    paced: later in the consumer's step (TopUpPace), where feed.ahead() batches allow it, one batch
    per run (top_up's limit), the next one's run paced from the same kick."""

    def __init__(self, feed, paced=False):
        self._feed = weakref.ref(feed)
        self._lock = feed.lock
        self._cond = threading.Condition()
        self._wanted = False
        self._stopped = False
        self._thread = None
        self._pace = TopUpPace() if paced else None
        self._kicked_at = 0.0
        close_at_exit(self, PREFETCH_THREADS)  # no top-up may be left working on a pool being closed

    def kick(self, called_at=None):
        """Top up once, soon, in the thread (started on the first call); called_at: when the next()
        that kicks was called (perf_counter; None: now), which paces the top-ups (TopUpPace.kicked)."""
        with self._cond:
            if self._stopped:
                return
            self._wanted = True
            if self._pace is not None:
                self._kicked_at = time.perf_counter()
                self._pace.kicked(self._kicked_at if called_at is None else called_at)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hotloop-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self):
        """No more top-ups; wait for one in progress unless called with the feed's lock held (the
        epoch ending in next(): the thread would wait for that lock) or from the thread itself."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        forget(self)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not _held(self._lock):
            thread.join()

    def _loop(self):
        again = False  # a done batch waits for its slot to be page-locked: look again after RETRY_S
        more = False  # paced: one batch prepared, room for another, which starts at its own paced time
        while True:
            with self._cond:
                if again and not self._wanted and not self._stopped:
                    self._cond.wait(RETRY_S)
                while not self._wanted and not self._stopped and not again and not more:
                    self._cond.wait()
                if self._stopped:
                    return
                self._wanted = False
                kicked_at = self._kicked_at
            if self._pace is not None and not again and self._wait_for_pace(kicked_at):
                return
            feed = self._feed()
            if feed is None:
                return
            with self._lock:
                t0, ahead = time.perf_counter(), feed.ahead()
                # paced: one batch per run, each at its paced time: two decoded back to back at the
                # step's start (the consumer caught up with the prepared ones) slowed its launches
                again = not self._stopped and feed.top_up(limit=1 if self._pace is not None else None)
                unmade = feed.to_make()
                prepared = feed.ahead() > ahead
                making = feed.making
            del feed
            for batch in unmade:  # a maker's batches, outside the lock: next() is not held up
                if self._stopped:
                    break  # next() makes what it hands out, the epoch's end drops the rest
                making.make_ready(batch)
            del unmade, making
            # top_up's True after a paced run that prepared its one batch: room for the next; else a
            # done batch whose slot waits to be page-locked
            more = again and prepared and self._pace is not None
            again = again and not more
            if self._pace is not None and prepared:
                self._pace.worked(time.perf_counter() - t0)

    def _wait_for_pace(self, kicked_at) -> bool:
        """Wait until the paced start (a kick meanwhile, the consumer back: at once). True if stopped.
        The feed is not held meanwhile: the consumer's drop of the iterator must end it at once."""
        feed = self._feed()
        if feed is None:
            return True
        deadline = kicked_at + self._pace.delay(feed.ahead())
        del feed
        with self._cond:
            while not self._wanted and not self._stopped:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._stopped


def _held(lock):
    """Whether this thread holds the RLock (its _is_owned is what Condition uses to ask the same)."""
    return lock._is_owned()
