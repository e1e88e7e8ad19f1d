"""The worker pool behind hotloop.DataLoader: its tasks and the messages that carry them, workers that
die replaced where they stood, and the ring made from the first batch's layout. The processes and
their pipes are consumer/processes.py's, the ring's slots and the copies out of them ring/slots.py's, what each
worker's replacement is sent consumer/tasks.py's. Persistent workers keep one pool across epochs; every
other epoch makes its own. The messages it exchanges with workers are in messages.py."""
import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import signal
import time

from ... import _C
from ..._torch_compat import DatasetKind
from ...memory.host import death_by_oom, oom_kills
from ..at_exit import WORKER_POOLS, close_at_exit, forget
from ..launcher.zygote import LaunchedWorker
from ..messages import (Discard, EpochStarted, Fetch, Layout, NewEpoch, Overflow, Place, Result, Setup, Started,
                        UseRing)
from ..ring.slots import LEASE_SLOTS, RingSlots
from .processes import WorkerProcesses, never_started
from .tasks import Task, TaskKind, WorkerEpoch, successor_plan

_logger = logging.getLogger("hotloop.data")

POLL_S = 0.1  # how often a waiting main process looks at its workers' health


class Pool:
    """Worker processes, their tasks, the ring and the copies out of it: what persistent workers keep."""

    track = None  # [WorkerEpoch] for the current epoch, from begin_epoch on
    replay_index = None  # the index an IterableDataset's tasks carry (all the same)
    resumed_rng = None  # worker -> its RNG states when it began this epoch (persistent workers' EpochStarted)

    def __init__(self, settings, stats, spec):
        """settings: the loader's PoolSettings (settings.py); stats: its LoaderStats, which the pool
        adds to; spec: the WorkerSpec every worker starts with."""
        self.settings = settings
        self.stats = stats
        self.ctx = settings.mp_context
        self.n = settings.num_workers
        self.kind = spec.dataset_kind
        self.spec = spec
        self.processes = WorkerProcesses(self.ctx, self.n, spec)
        self.oom_kills = oom_kills()  # a worker killed by SIGKILL while this rises was the OOM killer's
        self.device = settings.device
        self.slots = RingSlots(settings.copies, stats)
        self.ring_unused = False  # the first batch had no tensor: everything takes the pipe
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
        close_at_exit(self, WORKER_POOLS)

    # what the processes and the slots hold, read by the pool's users and tests
    procs = property(lambda self: self.processes.procs)
    task_conns = property(lambda self: self.processes.task_conns)
    result_conns = property(lambda self: self.processes.result_conns)
    running = property(lambda self: self.processes.running)
    launcher = property(lambda self: self.processes.launcher)
    ring = property(lambda self: self.slots.ring)
    free_slots = property(lambda self: self.slots.free_slots)
    leases = property(lambda self: self.slots.leases)
    copies = property(lambda self: self.slots.copies)

    # workers ---------------------------------------------------------------------------------------
    def start_worker(self, wid):
        """Start worker wid unless it was started already. Worker 0 is forked by this process, so its
        first task follows its fork at once; in a forking pool the first start of any other worker
        starts workers 1.. through the launcher (launcher/zygote.py): one more fork of this process
        instead of one per worker, and worker 0 computes its batch meanwhile. Otherwise (spawn, one
        worker, a restart) the iterator starts each worker as it sends it its first task."""
        processes = self.processes
        if processes.launcher_due(wid):
            processes.start_by_launcher()
        if not processes.started[wid]:
            processes.started[wid] = True
            processes.start(wid)
            # the workers forked so far may have sent their first layout: the ring is made from the
            # first one now, not after the last fork, so the workers' first batches go straight in
            self.drain_all()
            if self.layouts:
                self.place_layouts()

    def start_all(self):
        for wid in range(self.n):
            self.start_worker(wid)

    def workers(self):
        """What torch's iterator lists as `_workers`: a handle per worker (pid, exitcode, is_alive,
        join), which tools such as PyTorch Lightning read to see whether workers live."""
        return self.processes.handles()

    def send(self, wid, msg):
        if not self.processes.started[wid]:
            self.start_worker(wid)  # e.g. a resumed epoch's Setup, sent before the worker's first task
        self.processes.send(wid, msg)

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
        self.processes.forget(wid)
        self.processes.start(wid)
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
        """What a fresh worker is sent to stand where worker wid stood (consumer.tasks.successor_plan)."""
        track = self.track[wid] if self.track is not None else None
        if track is None:
            return list(lost)
        done = {t.id: self._peek(t) for t in track.open if t.kind is None and not any(t is x for x in lost)}
        return successor_plan(track, lost, self.kind == DatasetKind.Iterable and not self.resuming,
                              self.replay_index, done)

    def _peek(self, task):
        """A done task's outcome, left where it is."""
        if task.slot >= 0:
            _, tid, _, meta_len, flags = self.ring.info(task.slot)
            if flags & _C.RING_FLAG_OVERFLOW or tid != task.id:
                return self.pipe_results.get(task.id)
            return self.slots.slot_meta(task.slot, meta_len)
        return self.pipe_results.get(task.id)

    def begin_epoch(self, setups):
        """Before the epoch's first task: give each worker its Setup (resume: RNG states, replay), or
        None, and remember where each starts."""
        if self.kind == DatasetKind.Iterable:  # torch's batches of an IterableDataset: batch_size Nones
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
        task.kind = TaskKind.of(outcome)
        task.rng, task.data = outcome.rng, outcome.data
        self._fold(task.wid)

    def ghost(self, wid, index, rng):
        """A resumed epoch: a batch of worker wid that the saved run handed out, beyond what its saved
        states cover. Brings the worker past it: with rng (map-style) by setting the states after
        it, else (IterableDataset) by fetching and dropping it. Returns its stand-in task."""
        task = Task(-1, wid, index, -1, consumed=True, kind=TaskKind.BATCH, rng=rng, handed=True)
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
        if self.track is not None:
            self.track[wid].fold()

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
            return self.slots.slot_meta(task.slot, meta_len)
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
            multiprocessing.connection.wait(waitables + self.processes.sentinels(), timeout)
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
        task.kind = TaskKind.DROP
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
        layout, meta_cap = self.slots.create(self.slots_needed(), sizes, spec_bytes)
        ring = self.ring
        processes = self.processes
        processes.ring_fd = ring.fd
        processes.ring_msg = UseRing(ring.nslots, ring.slot_bytes, layout, meta_cap)
        for wid in range(self.n):
            if self.procs[wid] is not None:
                processes.hand_ring(wid)
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
        return self.slots.ring_bytes

    def take_slot(self):
        return self.slots.take_slot()

    def release_slot(self, slot):
        self.slots.release_slot(slot)

    def collect_leases(self):
        """Free the slots whose leased tensors are all gone."""
        self.slots.collect_leases()

    # shutdown --------------------------------------------------------------------------------------
    def close(self):
        if self.closed or os.getpid() != self.processes.main_pid:
            return  # a forked worker may hold a copy of this object: it owns none of it
        self.closed = True
        forget(self)
        self.processes.stop_all()
        self.slots.close()  # copies over before the ring is unregistered and unmapped
        self.processes.ring_fd = None
        self.processes.close_launcher()
