"""The worker pool behind hotloop.DataLoader: worker processes, their pipes, the shared ring, and the
copies out of it (to the CPU, or to the GPU on a side stream). Persistent workers keep one pool across
epochs; every other epoch makes its own. The messages it exchanges with workers are in _messages.py."""
import array
import collections
import dataclasses
import fcntl
import logging
import multiprocessing.connection
from multiprocessing import reduction
import os
import pickle
import signal
import time

import torch
from torch.utils.data.dataloader import _DatasetKind

from .. import _C, input_wait
from ..memory.host import death_by_oom, oom_kills
from ._batch import ring_leaf, unflatten
from ._device import DeviceCopies, page_round, ring_tensor, slot_layout, slot_leaf
from ._inherited_garbage import forking_a_worker
from ._launcher import LaunchedWorker, Launcher
from ._messages import (Discard, Ended, EpochStarted, Exit, Failed, Fetch, Layout, NewEpoch, Overflow, Place,
                        Result, Setup, Started, UseRing)
from ._shutdown import WORKER_POOLS, close_at_exit, forget
from ._worker import worker_main

_logger = logging.getLogger("hotloop.data")

POLL_S = 0.1  # how often a waiting main process looks at its workers' health
_META_MIN = 64 << 10  # bytes reserved per slot for the batch's metadata and side-path objects
# slots the consumer may hold as zero-copy batches, beyond, batches are copied out: the one being
# handed out and the one a `for batch in loader` loop still holds meanwhile (as torch's loader,
# whose consumer holds those two batches' shared memory then)
LEASE_SLOTS = 2
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ from Python 3.10 on; the number for older ones
USE_LAUNCHER = True  # fork workers 1.. through a launcher process (tests turn it off to cover both ways)


def never_started(method) -> str:
    """Why a worker started with `method` (spawn or forkserver) died before its first message."""
    return (f", before it started running (multiprocessing_context={method!r} starts each worker as a new "
            "Python process that imports the main module again and unpickles the dataset). If the script that "
            "makes and iterates the DataLoader does so at its top level, without an `if __name__ == \"__main__\":` "
            "guard, each worker runs it again and dies trying to start workers of its own (Python's message above "
            "about the \"bootstrapping phase\"): put that code under `if __name__ == \"__main__\":`. Otherwise the "
            "worker's traceback above says what failed in its start (for example a dataset class it cannot import)")


@dataclasses.dataclass(eq=False)
class Task:
    id: int
    wid: int
    index: object
    slot: int
    consumed: bool = False
    kind: str = None  # once taken: "batch", "error", "stop", or "drop" (never done: its worker had ended)
    rng: bytes = None  # the worker's RNG states right after it, until the iterator logged it
    data: dict = None  # and its Stateful dataset's state, likewise
    handed: bool = False  # its batch went to the consumer (or its error was raised)


@dataclasses.dataclass
class WorkerEpoch:
    """Where one worker stands in the current epoch, as far as the main process knows: what a
    replacement needs to carry on where it died."""

    start_rng: bytes = None  # the RNG states it started the epoch with (None: as seeded at its start)
    start_data: dict = None  # the Stateful dataset's state it started with (None: as made)
    recreate: bool = False  # its iterator was made anew after start_rng was set
    base: int = 0  # batches (and errors) of its IterableDataset it replayed at the epoch's start
    base_stopped: bool = False  # and its iteration had ended there
    taken: int = 0  # batches and errors the main process took from it since (in the order it made them)
    stopped: bool = False  # its Ended was taken
    last_rng: bytes = None  # its states after the last of those outcomes (None: none yet)
    last_data: dict = None  # its Stateful dataset's state after it, likewise
    # its tasks after those, in the order it makes them: a worker's second batch can be ready before
    # its first (the first waits for Place), and in_order=False takes it first
    open: collections.deque = dataclasses.field(default_factory=collections.deque)


def _cpu_empty(shape, dtype):
    return torch.empty(shape, dtype=dtype)


class Pool:
    """Worker processes, their pipes, the ring and the copies out of it: what persistent workers keep."""

    track = None  # [WorkerEpoch] for the current epoch, from begin_epoch on
    replay_index = None  # the index an IterableDataset's tasks carry (all the same)
    resumed_rng = None  # worker -> its RNG states when it began this epoch (persistent workers' EpochStarted)

    def __init__(self, settings, stats, spec):
        """settings: the loader's PoolSettings (_config.py); stats: its LoaderStats, which the pool
        adds to; spec: the WorkerSpec every worker starts with."""
        self.settings = settings
        self.stats = stats
        self.ctx = settings.mp_context
        self.n = settings.num_workers
        self.kind = spec.dataset_kind
        self.spec = spec
        self.main_pid = os.getpid()
        self.oom_kills = oom_kills()  # a worker killed by SIGKILL while this rises was the OOM killer's
        self.device = settings.device
        self.ring = None
        self.ring_unused = False  # the first batch had no tensor: everything takes the pipe
        self._ring_bytes = 0
        self.ring_msg = None  # the UseRing every worker is sent (fd=None: the memfd comes over its socket)
        self.layout = []
        self.free_slots = []
        self.tasks = {}
        self.pipe_results = {}
        self.layouts = {}  # task id -> its Layout, for batches waiting for the ring
        # tasks given a slot when the ring was made, before their own layout came: until it comes,
        # their outcome may still take the pipe (an error or a stop before their first sample's layout)
        self.placed_early = set()
        self.task_worker = {}  # task id -> worker, for every task not yet finished
        self.resuming = False
        self.resumed = set()
        self.next_task_id = 0
        self.restarts = 0
        self.died_at = set()  # ids of the tasks workers held when they died
        self.closed = False
        self.procs = [None] * self.n
        self.task_conns = [None] * self.n
        self.result_conns = [None] * self.n
        # this process's end of each worker's socket for the ring's memfd (SCM_RIGHTS); None for a
        # worker forked after the ring was made, which inherited the memfd
        self.ring_conns = [None] * self.n
        self.copies = DeviceCopies(settings.copies, stats) if self.device is not None else None
        self.leases = None  # CPU batches lent out as views of their slots (copy_out)
        self.started = [False] * self.n
        self.running = set()  # workers whose current process sent Started
        self.ended = [(None, None)] * self.n  # (pid, exit code) of each worker's last process once it is gone
        self.launcher = None  # the process that forked the first workers (_launcher.py)
        close_at_exit(self, WORKER_POOLS)

    # workers ---------------------------------------------------------------------------------------
    def start_worker(self, wid):
        """Start worker wid unless it was started already. Worker 0 is forked by this process, so its
        first task follows its fork at once; in a forking pool the first start of any other worker
        starts workers 1.. through the launcher (_launcher.py): one more fork of this process
        instead of one per worker, and worker 0 computes its batch meanwhile. Otherwise (spawn, one
        worker, a restart) the iterator starts each worker as it sends it its first task."""
        if not self.started[wid] and wid > 0 and self._launcher_ok():
            self._start_all_by_launcher()
        if not self.started[wid]:
            self.started[wid] = True
            self._start(wid)
            # the workers forked so far may have sent their first layout: the ring is made from the
            # first one now, not after the last fork, so the workers' first batches go straight in
            self.drain_all()
            if self.layouts:
                self.place_layouts()

    def start_all(self):
        for wid in range(self.n):
            self.start_worker(wid)

    def _launcher_ok(self):
        # the first start of workers 1.. in a forking pool (a restart forks one worker itself)
        return (USE_LAUNCHER and self.launcher is None and self.n > 1 and not any(self.started[1:])
                and self.ctx.get_start_method() == "fork")

    def _start_all_by_launcher(self):
        """Workers 1.. forked by the launcher, which is forked from here (worker 0 never is: see start_worker)."""
        workers = []
        for wid in range(1, self.n):
            task_r, task_w, res_r, res_w = self._pipes()
            ring_main, ring_worker = self.ctx.Pipe(duplex=True)
            self.task_conns[wid], self.result_conns[wid], self.ring_conns[wid] = task_w, res_r, ring_main
            workers.append((wid, task_r, res_w, ring_worker))
        # the launcher closes this process's ends of every pipe (worker 0's too, if it runs) and the
        # ring's fd, so that its workers hold none of them and every EOF shows; they get the memfd
        # over their sockets even when the ring exists already (it rarely does this early)
        close = [c for c in self.task_conns + self.result_conns + self.ring_conns if c is not None]
        if self.ring is not None:
            close.append(self.ring.fd)
        self.launcher = Launcher(self.ctx, self.spec, workers, close)
        for wid in range(1, self.n):
            self.procs[wid] = LaunchedWorker(self.launcher, wid - 1)
            self.started[wid] = True
            if self.ring_msg is not None:
                self._hand_ring(wid)

    def _pipes(self):
        task_r, task_w = self.ctx.Pipe(duplex=False)
        res_r, res_w = self.ctx.Pipe(duplex=False)
        for conn in (task_w, res_r):
            try:  # 1 MiB pipes (Linux): large index lists and side objects rarely fill them
                fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, 1 << 20)
            except OSError:
                pass
        return task_r, task_w, res_r, res_w

    def _start(self, wid):
        task_r, task_w, res_r, res_w = self._pipes()
        method = self.ctx.get_start_method()
        # a worker forked after the ring was made inherits its memfd; any other gets it over a socket
        ring_main = ring_worker = None
        if method != "fork" or self.ring is None:
            ring_main, ring_worker = self.ctx.Pipe(duplex=True)
        # a forked worker inherits the main process's ends of the other workers' pipes and sockets:
        # it closes them, so that a dead main process or worker shows as EOF everywhere
        inherited = []
        if method == "fork":
            inherited = [c.fileno() for c in self.task_conns + self.result_conns + self.ring_conns + [ring_main]
                         if c is not None and not c.closed]
        # a forkserver's worker is its child, not ours: it watches the parent it starts with
        parent = self.main_pid if method != "forkserver" else None
        proc = self.ctx.Process(target=worker_main, args=(self.spec, wid, task_r, res_w, parent, inherited,
                                                          ring_worker), daemon=True)
        with forking_a_worker():
            proc.start()
        for conn in (task_r, res_w, ring_worker):  # the worker's ends: closed here so that its exit shows as EOF
            if conn is not None:
                conn.close()
        self.procs[wid], self.task_conns[wid], self.result_conns[wid] = proc, task_w, res_r
        self.ring_conns[wid] = ring_main
        if self.ring_msg is not None:
            self._hand_ring(wid)

    def _hand_ring(self, wid):
        """Tell worker wid about the ring. A worker that inherited the memfd is told its number; any
        other gets the memfd itself over its socket (SCM_RIGHTS), right before UseRing. Never a path
        under /proc/<pid>/fd: opening one needs this process to be dumpable, and a process that called
        prctl(PR_SET_DUMPABLE, 0) or changed credentials (some schedulers and sandboxes) is not."""
        conn = self.ring_conns[wid]
        if conn is None:
            self.send(wid, dataclasses.replace(self.ring_msg, fd=self.ring.fd))
            return
        try:
            reduction.send_handle(conn, self.ring.fd, None)  # no UseRing without its memfd
        except OSError:
            return  # the worker is dead: check_workers restarts it, and its successor is given the ring
        self.send(wid, self.ring_msg)

    def workers(self):
        """What torch's iterator lists as `_workers`: a handle per worker (pid, exitcode, is_alive,
        join), which tools such as PyTorch Lightning read to see whether workers live."""
        return [WorkerHandle(self, wid) for wid in range(self.n)]

    def sentinels(self):
        """What becomes readable when a worker dies (the launcher's one status pipe counts once)."""
        return list({id(s): s for s in (p.sentinel for p in self.procs if p is not None)}.values())

    def send(self, wid, msg):
        if not self.started[wid]:
            self.start_worker(wid)  # e.g. a resumed epoch's Setup, sent before the worker's first task
        try:
            self.task_conns[wid].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is dead: check_workers restarts it and gives its tasks again

    def _drain(self, wid):
        """Read every complete message waiting in worker wid's pipe. False at EOF."""
        conn = self.result_conns[wid]
        try:
            while conn.poll():
                self._on_message(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            return False
        return True

    def _on_message(self, msg):
        if isinstance(msg, Result):
            self.pipe_results[msg.task_id] = msg.outcome
            self._unplace(msg.task_id)
        elif isinstance(msg, Overflow):
            self.pipe_results[msg.task_id] = msg.outcome
        elif isinstance(msg, Layout):
            self.layouts[msg.task_id] = msg
            self.place_layouts()
        elif isinstance(msg, Started):
            self.running.add(msg.worker_id)
        elif isinstance(msg, EpochStarted):
            self.resumed.add(msg.worker_id)
            self.resumed_rng[msg.worker_id] = msg.rng
        else:
            raise TypeError(f"hotloop.DataLoader: unexpected message from a worker: {msg!r:.200}")

    def _unplace(self, tid):
        """The task's outcome came through the pipe: its worker had it without a slot and never
        writes the one it was given when the ring was made (it writes a placed slot only for a batch
        it kept for Place), so that slot goes back now, once; the task is a pipe task from here."""
        self.placed_early.discard(tid)
        task = self.tasks.get(tid)
        if task is not None and task.slot >= 0:
            self.release_slot(task.slot)
            task.slot = -1

    def place_layouts(self):
        """Batches made before the ring existed: size the ring from the first (which places every
        task without a slot at once, see make_ring), then give each one still without a slot its slot."""
        if self.ring is None and not self.ring_unused and self.layouts and not self.resuming:
            first = self.layouts[min(self.layouts)]
            self.make_ring(first.sizes, first.side_bytes)
        for tid in sorted(self.layouts):
            del self.layouts[tid]
            task = self.tasks.get(tid)
            if task is not None and task.slot >= 0:
                self.placed_early.discard(tid)  # its Place went out with the ring: no second slot
                continue
            if task is None or self.resuming:
                wid = self.task_worker.get(tid)
                if wid is not None and self.procs[wid] is not None:
                    self.send(wid, Discard(tid))
                continue
            task.slot = self.take_slot() if self.ring is not None else -1
            self.send(task.wid, Place(tid, task.slot))

    def check_workers(self):
        """Replace every worker that died (or raise: max_worker_restarts)."""
        for wid, proc in enumerate(self.procs):
            if proc is not None and proc.exitcode is not None:
                self._on_death(wid)

    def is_done(self, task):
        """Whether the task's outcome is there to take (in its slot, or come through the pipe)."""
        if task.slot >= 0:
            state, _, _, _, flags = self.ring.info(task.slot)
            if state == _C.RING_ASSIGNED:
                return False
            # an overflowing batch is done once its metadata came through the pipe
            return not flags & _C.RING_FLAG_OVERFLOW or task.id in self.pipe_results
        return task.id in self.pipe_results

    def _on_death(self, wid):
        proc = self.procs[wid]
        self._drain(wid)
        lost = sorted((t for t in self.tasks.values() if t.wid == wid and not t.consumed and not self.is_done(t)),
                      key=lambda t: t.id)
        code = proc.exitcode
        # worded as torch words it (code that matches "is killed by signal: " still matches)
        how = (f"is killed by signal: {signal.strsignal(-code) or signal.Signals(-code).name}." if code < 0
               else f"exited unexpectedly with exit code {code}.")
        held = [list(t.index) if t.index is not None else None for t in lost]
        desc = f"DataLoader worker (pid {proc.pid}) {how} It was worker {wid}, holding the indices {held}"
        desc += death_by_oom(code, self.oom_kills)
        self.oom_kills = oom_kills()
        # a task redone after a death whose new worker dies at it again: the dataset (or collate_fn)
        # kills its worker there, and restarting cannot help
        again = [t for t in lost if t.id in self.died_at]
        self.died_at.update(t.id for t in lost)
        # the launcher's death takes every worker it had not yet seen exit with it: one event, which
        # does not use up max_worker_restarts (it cannot recur: restarts are forked from here)
        orphaned = isinstance(proc, LaunchedWorker) and proc.launcher.lost
        method = self.ctx.get_start_method()
        if wid not in self.running and method != "fork" and not orphaned:
            self.close()  # its successor would die in its start the same way
            raise RuntimeError(desc + never_started(method))
        if orphaned:
            desc += " (its launcher process had died)"
        elif again:
            self.close()  # the epoch cannot go on: reap the other workers now, not at garbage collection
            twice = [list(t.index) if t.index is not None else None for t in again]
            raise RuntimeError(desc + f"; a worker had died holding {twice} before: the dataset (or collate_fn) "
                               "kills its worker there")
        elif self.restarts >= self.settings.max_worker_restarts:
            self.close()  # the epoch cannot go on: reap the other workers now, not at garbage collection
            raise RuntimeError(desc + (f"; {self.restarts} worker(s) were restarted already "
                                       f"(max_worker_restarts={self.settings.max_worker_restarts})"))
        else:
            self.restarts += 1
        self.stats.worker_restarts += 1
        plan = self._successor_plan(wid, lost)
        self._forget(wid)
        self._start(wid)
        if self.resuming:
            # an abandoned epoch: nothing of it is redone, the successor only joins the next one
            _logger.warning("%s; restarting it", desc)
            for item in plan:
                if not isinstance(item, Task):
                    self.send(wid, item)
            self.send(wid, NewEpoch())
            return
        _logger.warning("%s; restarting it and redoing %d batch(es)", desc, len(lost))
        for item in plan:
            if not isinstance(item, Task):
                self.send(wid, item)
                continue
            t = item
            self.layouts.pop(t.id, None)  # its batch died with the worker: made again below
            self.placed_early.discard(t.id)  # the successor has the ring: its outcome goes to the slot
            if t.slot < 0 and self.ring is not None:
                t.slot = self.take_slot()
            elif t.slot >= 0:
                self.ring.set_state(t.slot, _C.RING_ASSIGNED)  # e.g. flagged overflow, metadata lost
            self.send(wid, Fetch(t.id, t.index, t.slot))

    def _successor_plan(self, wid, lost):
        """What a fresh worker is sent to stand where worker wid stood: Setup messages and the lost
        tasks, in the order wid made them. A map-style worker is given the RNG states after the last
        outcome before each lost task, so that redone batches are the ones it would have made; an
        IterableDataset's worker, whose position is not an RNG state, starts from its epoch's start
        and replays (fetches and drops) every batch the main process already has from it."""
        track = self.track[wid] if self.track is not None else None
        if track is None:
            return list(lost)
        iterable = self.kind == _DatasetKind.Iterable and not self.resuming
        missing = [t for t in lost if not any(t is o for o in track.open)]  # none expected: redone all the same
        lost = set(lost)
        items = list(missing)
        rng = data = None
        if iterable:
            replay, ended = track.base + track.taken, track.base_stopped or track.stopped
            if track.last_data is not None:  # a Stateful dataset: set where it stood, nothing replayed
                setup = Setup(track.last_rng, True, 0, ended, self.replay_index, track.last_data)
            else:
                setup = Setup(track.start_rng, track.recreate, replay, ended, self.replay_index, track.start_data)
            if setup.changes_anything():
                items.append(setup)
        else:  # a Stateful map-style dataset's state goes with the RNG states
            rng = track.last_rng if track.last_rng is not None else track.start_rng
            data = track.last_data if track.last_rng is not None else track.start_data
        for t in track.open:
            if t in lost:
                if rng is not None:
                    items.append(Setup(rng, data=data))
                    rng = None
                items.append(t)
                continue
            kind, after, after_data = t.kind, t.rng, t.data
            if kind is None:  # done, not taken yet: its outcome is in the ring or the pipe
                outcome = self._peek(t)
                if outcome is None:
                    continue
                kind, after, after_data = ("stop" if isinstance(outcome, Ended) else "batch"), outcome.rng, outcome.data
            if kind == "drop":
                continue
            if iterable:
                stop = kind == "stop"
                if after_data is not None:  # Stateful: set past it rather than fetch it again
                    items.append(Setup(after, True, 0, stop, self.replay_index, after_data))
                else:
                    items.append(Setup(replay=0 if stop else 1, expect_stop=stop, replay_index=self.replay_index))
            elif after is not None:
                rng, data = after, after_data
        if rng is not None:  # for the tasks still to come
            items.append(Setup(rng, data=data))
        return items

    def _peek(self, task):
        """A done task's outcome, left where it is."""
        if task.slot >= 0:
            _, tid, _, meta_len, flags = self.ring.info(task.slot)
            if flags & _C.RING_FLAG_OVERFLOW or tid != task.id:
                return self.pipe_results.get(task.id)
            return self._slot_meta(task.slot, meta_len)
        return self.pipe_results.get(task.id)

    def _slot_meta(self, slot, meta_len):
        """The outcome a worker pickled at the start of its slot."""
        view = self.ring.view(slot)
        try:
            return pickle.loads(view[:meta_len])
        finally:
            view.release()

    def begin_epoch(self, setups):
        """Before the epoch's first task: give each worker its Setup (resume: RNG states, replay), or
        None, and remember where each starts."""
        if self.kind == _DatasetKind.Iterable:  # torch's batches of an IterableDataset: batch_size Nones
            self.replay_index = [None] * self.settings.batch_size if self.spec.auto_collation else None
        self.track = []
        for wid in range(self.n):
            setup = setups[wid] if setups is not None else None
            track = WorkerEpoch()
            if setup is not None:
                track.start_rng, track.recreate, track.start_data = setup.rng, setup.recreate, setup.data
                track.base, track.base_stopped = setup.replay, setup.expect_stop
                if setup.changes_anything():
                    self.send(wid, dataclasses.replace(setup, replay_index=self.replay_index))
            elif self.resumed_rng and wid in self.resumed_rng:
                # persistent workers: their states at NewEpoch, before they made their iterator anew
                track.start_rng, track.recreate = self.resumed_rng[wid], True
            self.track.append(track)

    def took(self, task, outcome):
        """The main process took this outcome of the task (a batch, Failed or Ended)."""
        task.kind = "stop" if isinstance(outcome, Ended) else "error" if isinstance(outcome, Failed) else "batch"
        task.rng, task.data = outcome.rng, outcome.data
        self._fold(task.wid)

    def ghost(self, wid, index, rng):
        """A resumed epoch: a batch of worker wid that the saved run handed out, beyond what its saved
        states cover. Brings the worker past it: with rng (map-style) by setting the states after
        it, else (IterableDataset) by fetching and dropping it. Returns its stand-in task."""
        task = Task(-1, wid, index, -1, consumed=True, kind="batch", rng=rng, handed=True)
        if rng is not None:
            self.send(wid, Setup(rng))
        else:
            self.send(wid, Setup(replay=1, replay_index=index))
        if self.track is not None:
            self.track[wid].open.append(task)
            self._fold(wid)
        return task

    def _fold(self, wid):
        """Count the worker's taken outcomes into its track, as far as they follow each other."""
        if self.track is None:
            return
        track = self.track[wid]
        while track.open and track.open[0].kind is not None:
            t = track.open.popleft()
            if t.kind == "stop":
                track.stopped = True
            elif t.kind in ("batch", "error"):
                track.taken += 1
            if t.rng is not None:
                track.last_rng = t.rng
            if t.data is not None:
                track.last_data = t.data

    def _forget(self, wid):
        for conn in (self.task_conns[wid], self.result_conns[wid], self.ring_conns[wid]):
            try:
                if conn is not None:
                    conn.close()
            except OSError:
                pass
        self.ring_conns[wid] = None
        self.running.discard(wid)
        proc = self.procs[wid]
        proc.join(0)
        self.ended[wid] = (proc.pid, proc.exitcode)
        try:
            proc.close()
        except ValueError:
            pass
        self.procs[wid] = None

    # tasks -----------------------------------------------------------------------------------------
    def new_task(self, wid, index):
        self.start_worker(wid)
        slot = self.take_slot() if self.ring is not None else -1
        task = Task(self.next_task_id, wid, index, slot)
        self.next_task_id += 1
        if self.track is not None:
            self.track[wid].open.append(task)
        self.tasks[task.id] = task
        self.task_worker[task.id] = wid
        self.send(wid, Fetch(task.id, index, slot))
        return task

    def poll(self, task):
        """The task's outcome if it is done, else None (never blocks for long)."""
        if task.id in self.placed_early and self.ring.state(task.slot) == _C.RING_ASSIGNED:
            self._drain(task.wid)  # placed before its layout came: its outcome may take the pipe
        if task.slot >= 0:
            state, tid, wid, meta_len, flags = self.ring.info(task.slot)
            if state == _C.RING_ASSIGNED:
                return None
            if tid != task.id:
                raise AssertionError(f"slot {task.slot} holds task {tid}, expected {task.id}")
            if flags & _C.RING_FLAG_OVERFLOW:
                self.drain_all()  # the metadata follows through the worker's pipe
                return self.pipe_results.pop(task.id, None)
            return self._slot_meta(task.slot, meta_len)
        if self.ring is None and not self.ring_unused:
            for wid in range(self.n):  # layouts of any worker may make the ring
                if self.procs[wid] is not None:
                    self._drain(wid)
        else:
            self._drain(task.wid)
        if task.slot >= 0:
            return self.poll(task)  # placed into the ring meanwhile
        return self.pipe_results.pop(task.id, None)

    def poll_or_tend(self, task):
        """The task's outcome if it is done; else None, once dead workers were replaced (or raised)
        and batches made before the ring existed were given their slots. One round of a wait for
        the task, which the caller loops over (poll_or_tend, its own work, then doze_for), so that
        nothing here calls back into it."""
        outcome = self.poll(task)
        if outcome is not None:
            return outcome
        self.check_workers()
        if self.layouts:
            self.place_layouts()
        return None

    def doze_for(self, task, deadline, timeout, batch_number):
        """A wait's bounded sleep between rounds (deadline: time.monotonic() at which `timeout`
        runs out, or None): RuntimeError once the timeout passed. Every sleep is bounded, so that a
        wait can never sleep through an event that will not come."""
        left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if left <= 0:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds waiting for batch {batch_number} "
                               f"(worker {task.wid}, indices {task.index})")
        self.doze(task.slot, left)

    def doze(self, slot, timeout):
        """Sleep until something may have changed, at most `timeout` seconds, then read the pipes.
        While `slot` (>= 0) is being written: until any slot changes state (a worker that flagged an
        overflow is now writing its metadata into its pipe and must be read, whichever task is
        awaited), at most 20 ms while a task still waits for its slot (its layout comes through a
        pipe, which does not wake the futex) or a task placed before its layout came may still
        deliver through its pipe. Otherwise: until a pipe has a message or a worker dies."""
        if slot >= 0 and self.ring.state(slot) == _C.RING_ASSIGNED:
            if self.placed_early or any(t.slot < 0 for t in self.tasks.values()):
                timeout = min(timeout, 0.02)
            self.ring.wait(slot, _C.RING_ASSIGNED, timeout, True)
        else:
            waitables = [c for c in self.result_conns if c is not None and not c.closed]
            multiprocessing.connection.wait(waitables + self.sentinels(), timeout)
        self.drain_all()

    def drain_all(self):
        for wid in range(self.n):
            if self.procs[wid] is not None:
                self._drain(wid)

    def finish(self, task):
        """The task's result was taken: forget it (its slot is freed by whoever used the data)."""
        task.consumed = True
        self.tasks.pop(task.id, None)
        self.task_worker.pop(task.id, None)
        self.placed_early.discard(task.id)

    def drop(self, task):
        """A task whose result will never be used (exhausted iterable worker)."""
        self.finish(task)
        task.kind = "drop"
        self._fold(task.wid)
        if task.slot >= 0 and self.procs[task.wid] is not None:
            # the worker skips tasks after its end, but may still be in the middle of this one
            self.ring.wait(task.slot, _C.RING_ASSIGNED, 0)
            self.release_slot(task.slot)

    def resume(self, shared_seed=None):
        """New epoch with persistent workers: let every worker finish what it had, then drop it.
        shared_seed: the epoch's seed for a DataPipe's random operations (torch's _ResumeIteration)."""
        self.resumed.clear()
        self.resumed_rng = {}
        self.resuming = True
        self.spec = dataclasses.replace(self.spec, shared_seed=shared_seed)  # what a replacement starts with
        for wid in range(self.n):
            self.send(wid, NewEpoch(shared_seed))
        while len(self.resumed) < self.n:
            for wid in range(self.n):
                if wid not in self.resumed and not self._drain(wid):
                    self.check_workers()
            if len(self.resumed) < self.n:
                self.check_workers()
                multiprocessing.connection.wait([c for w, c in enumerate(self.result_conns) if w not in self.resumed],
                                                POLL_S)
        for task in list(self.tasks.values()):
            if task.slot >= 0:
                self.release_slot(task.slot)
        self.tasks.clear()
        self.task_worker.clear()
        self.pipe_results.clear()
        self.layouts.clear()
        self.placed_early.clear()
        self.resuming = False

    # the ring --------------------------------------------------------------------------------------
    def make_ring(self, sizes, spec_bytes):
        """Size the ring from the first batch's layout, tell every worker about it and place every
        task that has no slot yet."""
        if not sizes:
            self.ring_unused = True
            return
        meta_cap = page_round(max(_META_MIN, 8 * spec_bytes + 4096))
        layout, offset = slot_layout(sizes, meta_cap)
        ring = _C.Ring(self.slots_needed(), offset)
        nslots = ring.nslots
        self.ring, self.layout, self._ring_bytes = ring, layout, ring.nbytes
        self.free_slots = list(range(nslots))
        self.stats.ring_bytes = ring.nbytes
        input_wait.ring_made(ring.nbytes)
        if self.copies is not None:
            self.copies.populate(ring, self.free_slots[::-1])  # in the order take_slot hands slots out
        self.ring_msg = UseRing(nslots, ring.slot_bytes, layout, meta_cap)
        for wid in range(self.n):
            if self.procs[wid] is not None:
                self._hand_ring(wid)
        # eager placement: a worker still making its first batch finds its Place right behind the
        # UseRing in its pipe and writes the batch straight in, however long this thread takes to read
        # its layout (the consumer's training step, say); that layout is ignored when it comes
        for task in sorted(self.tasks.values(), key=lambda t: t.id):
            if task.slot < 0 and task.id not in self.pipe_results:
                task.slot = self.take_slot()
                if task.id not in self.layouts:
                    self.placed_early.add(task.id)
                self.send(task.wid, Place(task.id, task.slot))

    def slots_needed(self):
        """Slots of the ring: one per task in flight (prefetch_factor per worker; a task holds its
        slot from Fetch until its batch is taken), then what the consumer's side holds: on the CPU
        the batches lent as views (LEASE_SLOTS; past them batches are copied out), with a device the
        batches queued ahead, the one handed out and one whose copy may still run. With fewer, a
        task would wait for a slot; more are never used at once."""
        settings = self.settings
        held = settings.prefetch_batches + 2 if self.device is not None else LEASE_SLOTS
        return self.n * settings.prefetch_factor + held

    @property
    def ring_bytes(self):
        """Bytes of shared memory of this pool's ring (control blocks included; pages exist once a
        worker first writes them): 0 until the first batch's layout sized it (never, if no batch has
        a tensor); kept after close() unmapped it."""
        return self._ring_bytes

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
        stage = self.settings.stage
        packed = stage.slot_parts(spec) if stage is not None else None
        if packed is not None:
            return self.images_out(slot, spec, leaves, stage, packed, pin)
        try:  # which leaves the stage transforms (gpu_transform's images): ValueError for one it cannot take
            normalized = (stage.leaf_outputs(leaf[1:] for leaf in leaves) if stage is not None
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
                    out, mem = stage.empty_leaf(dtype, shape, "cpu")
                    stage.transform_leaf(src, mem)
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

    def images_out(self, slot, spec, leaves, stage, parts, pin):
        """A batch the stage makes from the slot (gpu_decode's packed images; `parts`: its slot_parts),
        without a device: made on the CPU, from the slot."""
        try:
            host = [slot_leaf(self.ring, slot, leaves, s) for s in parts]
            taken = {ring_leaf(s) for s in parts}
            outs = [None if k in taken else ring_tensor(self.ring, slot, leaves, k).clone() for k in range(len(leaves))]
            batch = unflatten(spec, outs)
            stage.place(batch, stage.launch_batch(stage.prepare_batch(host, _cpu_empty), host, 0)[0])
            del host
        finally:
            self.release_slot(slot)
        if pin:  # as torch pins a batch with pin_memory=True
            from torch.utils.data._utils.pin_memory import pin_memory
            batch = pin_memory(batch)
        return batch

    def collect_leases(self):
        """Free the slots whose leased tensors are all gone."""
        if self.leases is not None:
            for slot in self.leases.returned():
                self.release_slot(slot)

    # CUDA: the side stream, events and copies in flight live in _device.DeviceCopies ----------------
    def copy_to_device(self, slot, spec, leaves, defer=False):
        return self.copies.copy_to_device(self.ring, slot, spec, leaves, defer)

    def copy_can_wait(self, task):
        """A batch copied ahead whose slot the background thread has not page-locked yet: better
        copied once it has than page-locked now (the batch due next is copied either way)."""
        return self.copies is not None and task.slot >= 0 and not self.copies.slot_pinned(self.ring, task.slot)

    def deliver(self, pending):
        try:
            return self.copies.deliver(pending)
        finally:
            self._release_finished()

    def abandon(self, pending):
        """A copy queued for a batch that will never be handed out: its slot is freed once it is over."""
        self.copies.abandon(pending)

    def reclaim(self, block):
        """Free the slots whose copies finished (with block: wait for the oldest if none did) or
        whose leased tensors are gone."""
        self.collect_leases()
        if self.copies is not None:
            try:
                self.copies.reclaim(block)
            finally:
                self._release_finished()

    def _release_finished(self):
        for slot in self.copies.take_finished():
            self.release_slot(slot)

    # shutdown --------------------------------------------------------------------------------------
    def close(self):
        if self.closed or os.getpid() != self.main_pid:
            return  # a forked worker may hold a copy of this object: it owns none of it
        self.closed = True
        forget(self)
        for wid in range(self.n):
            if self.procs[wid] is not None:
                try:
                    self.send(wid, Exit())
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 2.0  # then SIGTERM, as torch does after its 5 s
        for wid, proc in enumerate(self.procs):
            if proc is None:
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.terminate()
                proc.join(1.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
            self._forget(wid)
        if self.copies is not None:
            self.copies.close()
        if self.ring is not None:
            input_wait.ring_gone(self._ring_bytes)
            if self.leases is not None:
                self.leases.close_ring()  # batches handed out as views may still read it: the last one closes it
            else:
                self.ring.close()
            self.ring = None
            self.leases = None
        if self.launcher is not None:
            self.launcher.close()  # it exits once its last worker did


class WorkerHandle:
    """A multiprocessing.Process's view of worker wid of a pool, valid after the pool reaped it (a
    closed Process refuses join()): its current process, or the last one's pid and exit code."""

    def __init__(self, pool, wid):
        self.pool, self.wid = pool, wid

    def _proc(self):
        return self.pool.procs[self.wid]

    @property
    def pid(self):
        proc = self._proc()
        return proc.pid if proc is not None else self.pool.ended[self.wid][0]

    @property
    def exitcode(self):
        proc = self._proc()
        return proc.exitcode if proc is not None else self.pool.ended[self.wid][1]

    def is_alive(self):
        return self.exitcode is None and self.pid is not None

    def join(self, timeout=None):
        proc = self._proc()
        if proc is not None:
            proc.join(timeout)

    def terminate(self):
        proc = self._proc()
        if proc is not None:
            proc.terminate()

    def kill(self):
        proc = self._proc()
        if proc is not None:
            proc.kill()

    def __repr__(self):
        return f"<hotloop DataLoader worker {self.wid} pid={self.pid} exitcode={self.exitcode}>"
