"""The worker processes of a pool: their start (worker 0 forked by this process, workers 1.. by the
launcher in a forking pool, launcher/zygote.py), the pipes that carry tasks and results, the sockets that
carry the ring's memfd, and their end. What the messages mean is the pool's (consumer/pool.py)."""
import dataclasses
import fcntl
from multiprocessing import reduction
import os
import time

from ..launcher.zygote import LaunchedWorker, Launcher
from ..messages import Exit
from ..worker.inherited_garbage import forking_a_worker
from ..worker.loop import worker_main

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


class WorkerProcesses:
    """A pool's worker processes and their connections, indexed by worker id."""

    def __init__(self, ctx, n, spec):
        """ctx: the multiprocessing context; n: workers; spec: the WorkerSpec every worker starts with."""
        self.ctx = ctx
        self.n = n
        self.spec = spec
        self.main_pid = os.getpid()
        self.procs = [None] * n
        self.task_conns = [None] * n
        self.result_conns = [None] * n
        # this process's end of each worker's socket for the ring's memfd (SCM_RIGHTS); None for a
        # worker forked after the ring was made, which inherited the memfd
        self.ring_conns = [None] * n
        self.started = [False] * n
        self.running = set()  # workers whose current process sent Started
        self.ended = [(None, None)] * n  # (pid, exit code) of each worker's last process once it is gone
        self.launcher = None  # the process that forked the first workers (launcher/zygote.py)
        self.ring_fd = None  # the ring's memfd, once the pool made the ring
        self.ring_msg = None  # the UseRing every worker is sent (fd=None: the memfd comes over its socket)

    def launcher_due(self, wid):
        """Whether starting worker wid starts workers 1.. through the launcher: the first start of one of
        them in a forking pool (a restart forks one worker itself)."""
        return not self.started[wid] and wid > 0 and self._launcher_ok()

    def _launcher_ok(self):
        # the first start of workers 1.. in a forking pool (a restart forks one worker itself)
        return (USE_LAUNCHER and self.launcher is None and self.n > 1 and not any(self.started[1:])
                and self.ctx.get_start_method() == "fork")

    def start_by_launcher(self):
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
        if self.ring_fd is not None:
            close.append(self.ring_fd)
        self.launcher = Launcher(self.ctx, self.spec, workers, close)
        for wid in range(1, self.n):
            self.procs[wid] = LaunchedWorker(self.launcher, wid - 1)
            self.started[wid] = True
            if self.ring_msg is not None:
                self.hand_ring(wid)

    def _pipes(self):
        task_r, task_w = self.ctx.Pipe(duplex=False)
        res_r, res_w = self.ctx.Pipe(duplex=False)
        for conn in (task_w, res_r):
            try:  # 1 MiB pipes (Linux): large index lists and side objects rarely fill them
                fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, 1 << 20)
            except OSError:
                pass
        return task_r, task_w, res_r, res_w

    def start(self, wid):
        """Fork (or spawn) worker wid's process now, with new pipes; a restart's too."""
        task_r, task_w, res_r, res_w = self._pipes()
        method = self.ctx.get_start_method()
        # a worker forked after the ring was made inherits its memfd; any other gets it over a socket
        ring_main = ring_worker = None
        if method != "fork" or self.ring_fd is None:
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
            self.hand_ring(wid)

    def hand_ring(self, wid):
        """Tell worker wid about the ring. A worker that inherited the memfd is told its number; any
        other gets the memfd itself over its socket (SCM_RIGHTS), right before UseRing. Never a path
        under /proc/<pid>/fd: opening one needs this process to be dumpable, and a process that called
        prctl(PR_SET_DUMPABLE, 0) or changed credentials (some schedulers and sandboxes) is not."""
        conn = self.ring_conns[wid]
        if conn is None:
            self.send(wid, dataclasses.replace(self.ring_msg, fd=self.ring_fd))
            return
        try:
            reduction.send_handle(conn, self.ring_fd, None)  # no UseRing without its memfd
        except OSError:
            return  # the worker is dead: check_workers restarts it, and its successor is given the ring
        self.send(wid, self.ring_msg)

    def handles(self):
        """What torch's iterator lists as `_workers`: a handle per worker (pid, exitcode, is_alive,
        join), which tools such as PyTorch Lightning read to see whether workers live."""
        return [WorkerHandle(self, wid) for wid in range(self.n)]

    def sentinels(self):
        """What becomes readable when a worker dies (the launcher's one status pipe counts once)."""
        return list({id(s): s for s in (p.sentinel for p in self.procs if p is not None)}.values())

    def send(self, wid, msg):
        try:
            self.task_conns[wid].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is dead: check_workers restarts it and gives its tasks again

    def forget(self, wid):
        """Worker wid's process is gone (or going): close its pipes, reap it, keep its pid and exit code."""
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

    def stop_all(self):
        """Tell every worker to exit, then reap it (SIGTERM, then SIGKILL, for one that does not)."""
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
            self.forget(wid)

    def close_launcher(self):
        if self.launcher is not None:
            self.launcher.close()  # it exits once its last worker did


class WorkerHandle:
    """A multiprocessing.Process's view of worker wid of a pool, valid after the pool reaped it (a
    closed Process refuses join()): its current process, or the last one's pid and exit code."""

    def __init__(self, processes, wid):
        self.processes, self.wid = processes, wid

    def _proc(self):
        return self.processes.procs[self.wid]

    @property
    def pid(self):
        proc = self._proc()
        return proc.pid if proc is not None else self.processes.ended[self.wid][0]

    @property
    def exitcode(self):
        proc = self._proc()
        return proc.exitcode if proc is not None else self.processes.ended[self.wid][1]

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
