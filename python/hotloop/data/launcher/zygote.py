"""Start DataLoader workers 1.. from one forked launcher: two forks of the main process, not one per worker.

A fork copies the page tables of the process that forks. A training process holding CUDA, a model and
pinned buffers has many, so each fork takes a while, on the thread that also launches the training
step: a fork per worker keeps the GPU waiting that many times before anything else happens. Here the
main process forks worker
0 itself, sends it its first task, then forks a launcher (the zygote), and the launcher forks workers
1.. while the main thread goes on: worker 0 starts one fork after iter(), not two. The launcher is a
fork of a single thread, so its workers are forked from a process with no other threads, the safest
state a fork can start from. It stays alive as their parent, reaps them and reports each start (pid)
and exit (code) through a status pipe, which is also what the main process sleeps on to notice a
death. A worker replaced after a death is forked by the main process, as worker 0 is
(Pool.start_worker in consumer/pool.py).
"""
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait as wait_for

from ..messages import WorkerExited, WorkerStarted
from ..worker.inherited_garbage import forking_a_worker
from ..worker.loop import worker_main


class Launcher:
    """The launcher process and what it reported. `workers[k]` is (worker id, task_r, res_w, ring_conn)
    of its k-th worker, started with `spec` (reports and LaunchedWorker go by k; ring_conn: the socket
    the ring's memfd comes over); every end is closed here once the launcher has it. `close_in_launcher`: connections and file descriptors of the caller that the launcher
    (and so its workers) must not hold."""

    def __init__(self, ctx, spec, workers, close_in_launcher):
        self.n = len(workers)
        self.pids = [None] * self.n
        self.exit_codes = [None] * self.n
        self.lost = False  # the launcher died before reporting every exit
        status_r, status_w = ctx.Pipe(duplex=False)
        self.status = status_r
        with forking_a_worker():
            pid = os.fork()
        if pid == 0:  # the launcher: never returns into the caller's code
            code = 1
            try:
                status_r.close()
                for conn in close_in_launcher:
                    if isinstance(conn, int):
                        os.close(conn)
                    else:
                        conn.close()
                _launch(spec, workers, status_w)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.pid = pid
        status_w.close()
        for _, *conns in workers:
            for conn in conns:
                conn.close()

    def poll(self):
        """Read what the launcher reported so far (never blocks)."""
        try:
            while self.status.poll():
                report = self.status.recv()
                if isinstance(report, WorkerStarted):
                    self.pids[report.k] = report.pid
                else:
                    self.exit_codes[report.k] = report.code
        except (EOFError, OSError):
            self._launcher_gone()

    def _launcher_gone(self):
        """The status pipe closed: the launcher exited (after its last worker) or was killed."""
        if not self.status.closed:
            self.status.close()
        self._reap(0)
        for k in range(self.n):
            if self.exit_codes[k] is None:
                # orphaned or never forked: reparented workers exit once they see their parent
                # gone; make sure of it, and count them as killed
                self.lost = True
                if self.pids[k] is not None:
                    _kill_and_wait(self.pids[k])
                self.exit_codes[k] = -signal.SIGKILL

    def _reap(self, timeout):
        deadline = time.monotonic() + timeout
        while self.pid is not None:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid = self.pid
            if pid == self.pid:
                self.pid = None
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self):
        """After the workers were told to exit: wait for the launcher, kill it if it lingers."""
        if not self._reap(2.0):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reap(5.0)
        if not self.status.closed:
            self.status.close()


class LaunchedWorker:
    """What Pool uses of a multiprocessing.Process, for the launcher's k-th worker."""

    def __init__(self, launcher, k):
        self.launcher, self.k = launcher, k

    @property
    def pid(self):
        deadline = time.monotonic() + 5.0
        while self.launcher.pids[self.k] is None and self.exitcode is None and time.monotonic() < deadline:
            self._wait(0.05)
        return self.launcher.pids[self.k]

    @property
    def exitcode(self):
        if not self.launcher.status.closed:
            self.launcher.poll()
        return self.launcher.exit_codes[self.k]

    @property
    def sentinel(self):
        # readable whenever the launcher reports something (an exit among them) or dies; the callers
        # then look at every worker's exitcode, which reads the report
        return self.launcher.status

    def _wait(self, timeout):
        if not self.launcher.status.closed:
            wait_for([self.launcher.status], timeout)

    def join(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                return
            self._wait(left)

    def _signal(self, sig):
        if self.exitcode is None and self.launcher.pids[self.k] is not None:
            try:
                os.kill(self.launcher.pids[self.k], sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self._signal(signal.SIGTERM)

    def kill(self):
        self._signal(signal.SIGKILL)

    def close(self):
        pass


def _kill_and_wait(pid, timeout=2.0):
    """SIGKILL a process that is not our child and wait until it is gone (init reaps it), so that its
    replacement never races it for a ring slot."""
    deadline = time.monotonic() + timeout
    try:
        os.kill(pid, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.002)
    except ProcessLookupError:
        pass


def _launch(spec, workers, status_w):
    """The launcher's life: fork each worker, report it, then reap them all and report each exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    me = os.getpid()
    k_of = {}
    for k, (worker_id, task_r, res_w, ring_conn) in enumerate(workers):
        with forking_a_worker():  # what the launcher made since its own fork
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                status_w.close()
                for _, *later in workers[k + 1:]:  # the next workers' ends
                    for conn in later:
                        conn.close()
                _as_multiprocessing_child()
                worker_main(spec, worker_id, task_r, res_w, me, ring_conn=ring_conn)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        for conn in (task_r, res_w, ring_conn):
            conn.close()
        k_of[pid] = k
        status_w.send(WorkerStarted(k, pid))
    while k_of:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        k = k_of.pop(pid, None)
        if k is not None:
            try:
                status_w.send(WorkerExited(k, os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # the main process is gone; keep reaping


def _as_multiprocessing_child():
    """What multiprocessing does at the start of a forked child that user code may notice."""
    import multiprocessing.process
    import multiprocessing.util

    multiprocessing.process._children = set()  # the launcher's parent's (worker 0): not ours to join
    multiprocessing.util._finalizer_registry.clear()
    multiprocessing.util._run_after_forkers()
    try:
        sys.stdin.close()
        sys.stdin = open(os.devnull)
    except (OSError, ValueError):
        pass
