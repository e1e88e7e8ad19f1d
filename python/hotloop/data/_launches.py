"""A stage's batches queued on the device out of the epoch's lock: each batch's ImageLaunch, and the
thread (LaunchRunner) that queues them one after another while the prefetch thread prepares the next.

NOTE [ Decoding ahead ]
gpu_decode's launch of a batch is host work (the decode's and the kernel's tables built: the stage's
begin_batch) and then device work (nvjpeg's call, which holds its thread until the batch is decoded,
and the kernel: finish_batch). Run by one thread, a batch's host work waits for the previous batch's
decode, and the decoder waits for the host work: the engines idle for that long per batch, which is
what bounds a loader that feeds a fast step. So the prefetch thread does the host work
(ImageLaunch.start) and hands the batch to a LaunchRunner, whose thread runs the device work of the
batches in the order they came; the next batch's host work runs meanwhile.

Whichever thread comes first queues a batch's device work: the runner, or next() wanting the batch
(ImageLaunch.run); the other finds it queued, or waits for it. Batches are handed to the runner in
batch order and next() wants the oldest first, so device work is never queued for two batches at
once (the decoder serves one thread at a time) nor out of order.

It buys nothing where nvjpeg's call is the bound, and DeviceCopies.decode_ahead is off by default:
nvjpeg's call is itself host work (a copy, a kernel and an event per image), so the next batch's
host work, run beside it, slowed it by about what it took off the prefetch thread, and the loader's
rate stayed where it was. That was when the host work included copying the JPEG bytes into
page-locked memory. Measured again once nvjpeg read them from the slot (stage.py's begin), with
about 1.2 ms of host work a batch beside a 7-11 ms call, it still bought nothing: the loader alone's
first epoch ran at 22.8k img/s against 22.2k off, its second at 20.2k against 23.6k (H100, medians
of 4 fresh loaders). Kept for machines whose host work, not the decoder, is the bound (set the
class attribute to True), and for its tests.
"""
import collections
import os
import threading
import weakref


class ImageLaunch:
    """A batch's stage work, queued once: begin (host work), complete (its device work, on the copy
    stream), finish (records the batch's event there: after that work, or alone). start() begins it
    and leaves the rest to the runner; run() does what is left, in whichever thread comes first (the
    runner, or next()); skip(), for a batch never handed out, only records the event that frees its
    slot."""

    def __init__(self, begin, complete, finish, runner=None):
        self._begin = begin  # () -> what complete takes
        self._complete = complete
        self._finish = finish
        self._runner = runner  # None: start() runs it all in its own thread
        self._begun = None
        self._lock = threading.Lock()
        self._state = "waiting"  # then "begun", and "queued" or "skipped"
        # what begin, complete or finish raised (a file PIL cannot read, a CUDA error): deliver raises it
        self.error = None

    @property
    def waiting(self) -> bool:
        return self._state == "waiting"

    def start(self):
        """The prefetch thread's call: the host work here, the device work to the runner."""
        runner = self._runner
        if runner is None:
            self.run()
            return
        with self._lock:
            if self._state != "waiting":
                return
            self._begin_here()
        runner.submit(self)  # a closed runner takes nothing: next() or skip() finishes the batch

    def run(self):
        with self._lock:
            if self._state == "waiting":
                self._begin_here()
            if self._state != "begun":
                return
            self._state = "queued"
            # what fails is kept for deliver to raise (the threads that queue launches run on): a
            # Ctrl-C in next()'s own call too, raised there, the slot freed all the same
            if self.error is None:
                try:
                    self._complete(self._begun)
                except BaseException as exc:
                    self.error = exc
            try:
                self._finish()
            except BaseException as exc:
                self.error = self.error or exc
            self._drop_closures()

    def skip(self):
        with self._lock:
            if self._state in ("waiting", "begun"):
                self._state = "skipped"
                try:
                    self._finish()
                finally:
                    self._drop_closures()

    def _begin_here(self):
        self._state = "begun"
        try:
            self._begun = self._begin()
        except BaseException as exc:
            self.error = exc

    def _drop_closures(self):
        # they hold the Pending that holds this launch: a reference cycle, and with it the batch's
        # device memory, would otherwise wait for the collector (and be collected in a worker forked
        # meanwhile, where freeing CUDA memory may block on the allocator's lock)
        self._begin = self._complete = self._finish = self._begun = self._runner = None


class _Queue:
    """What the runner's thread shares with its owner: the thread holds this, not the LaunchRunner,
    so that a runner nobody closed is still collected (and its thread then ends)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.launches = collections.deque()
        self.closed = False
        self.pid = os.getpid()

    def close(self):
        if self.pid != os.getpid():
            return  # a forked copy: the thread, and perhaps the lock's holder, stayed in the parent
        with self.cond:
            self.closed = True
            self.launches.clear()  # their owners run or skip them (deliver, abandon)
            self.cond.notify()


def _run_launches(queue):
    while True:
        with queue.cond:
            while not queue.launches and not queue.closed:
                queue.cond.wait()
            if queue.closed:
                return
            launch = queue.launches.popleft()
        launch.run()
        del launch


class LaunchRunner:
    """A thread that runs the device work of the launches handed to it, in the order they came
    (NOTE [ Decoding ahead ]). Its thread starts with the first launch."""

    def __init__(self, name="hotloop-launch"):
        self._queue = _Queue()
        self._name = name
        self._thread = None
        weakref.finalize(self, self._queue.close)

    def submit(self, launch) -> bool:
        """Queue the launch's run(); False when closed (its owner runs it then)."""
        queue = self._queue
        with queue.cond:
            if queue.closed:
                return False
            queue.launches.append(launch)
            if self._thread is None:
                self._thread = threading.Thread(target=_run_launches, args=(queue,), name=self._name, daemon=True)
                self._thread.start()
            queue.cond.notify()
        return True

    def close(self):
        """Take no more launches and drop those not started; wait for the one running (unless
        called from the runner's own thread)."""
        self._queue.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and self._queue.pid == os.getpid():
            thread.join()
