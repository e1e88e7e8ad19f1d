"""hotloop.DataLoader: torch's DataLoader, with workers that write batches into a shared pinned ring.

Swap `torch.utils.data.DataLoader` for `hotloop.DataLoader` and nothing changes in what the loop
receives: the same arguments and defaults, torch's own samplers (so the same batches in the same
order for the same generator), workers seeded as torch seeds them. What changes is how batches move:

* workers write each sample's leaves straight into a slot of a ring of shared memory (memfd, no
  /dev/shm file, nothing pickled for tensor data), the main process never unpickles batch data;
* with `device="cuda"` the ring is page-locked once (`cudaHostRegister`) and each batch goes to the
  GPU with one `cudaMemcpyAsync` per leaf on a side stream, `prefetch_batches` ahead; the consumer's
  stream waits on an event, and a slot is reused only once its copy finished;
* `gpu_transform=hotloop.Normalize(mean, std)` turns uint8 HWC image batches into normalised
  float16/bfloat16/float32 NCHW or channels_last in one kernel, on the copy stream.

Extras: `stats` (batches, samples, seconds waited in `__next__`, stall fraction, host-to-device bytes
and seconds, worker busy seconds, ring bytes), `state_dict()`/`load_state_dict()` for mid-epoch
resume, and a worker that dies is replaced and its batches redone (`max_worker_restarts`).
"""
import array
import atexit
import collections
import dataclasses
import fcntl
import itertools
import logging
import multiprocessing.connection
import os
import pickle
import signal
import time
import warnings
import weakref

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind, _SingleProcessDataLoaderIter

from . import _C
from .loader_worker import collate_no_shm, flatten, unflatten, worker_main

_logger = logging.getLogger(__name__)

__all__ = ["DataLoader", "Normalize", "LoaderStats", "loader_stats_snapshot"]

# every hotloop.DataLoader of this process adds to these (the monitor reads them)
_PROCESS_STATS = {"wait_seconds": 0.0, "batches": 0, "samples": 0}

_POLL_S = 0.1  # how often a waiting main process looks at its workers' health
_META_MIN = 64 << 10  # bytes reserved per slot for the batch's metadata and side-path objects
_ALIGN = 4096
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ from Python 3.10 on; the number for older ones


def loader_stats_snapshot() -> dict:
    """Cumulative figures of every hotloop.DataLoader in this process: wait_seconds (time consumers
    spent inside __next__), batches and samples delivered."""
    return dict(_PROCESS_STATS)


class Normalize:
    """uint8 HWC image batches -> (x - mean) / std as float16/bfloat16/float32, NCHW or channels_last.

    `mean` and `std` are per channel and, as in torchvision, in units of x / 255 (e.g. ImageNet's
    (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225)); `scale` is that 255 (pass scale=1 for means in
    raw 0-255 units). The result equals, bit for bit, torch's

        m = torch.tensor(mean) * scale; s = torch.tensor(std) * scale   # float32
        x.permute(0, 3, 1, 2).float().sub(m.view(1, -1, 1, 1)).div(s.view(1, -1, 1, 1)).to(dtype)

    (then `.contiguous(memory_format=torch.channels_last)` when channels_last). One CUDA kernel on
    the GPU, a C loop on the CPU. As a DataLoader's gpu_transform it applies to every uint8 leaf of
    shape [n, h, w, c] with c == len(mean); other leaves pass unchanged.
    """

    def __init__(self, mean, std, dtype=torch.float16, channels_last=True, scale=255.0):
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"Normalize: expected dtype float16, bfloat16 or float32, got {dtype}")
        m = torch.as_tensor(mean, dtype=torch.float32).flatten() * scale
        s = torch.as_tensor(std, dtype=torch.float32).flatten() * scale
        if m.numel() != s.numel() or not 1 <= m.numel() <= 16:
            raise ValueError(f"Normalize: expected mean and std of 1 to 16 channels each, got {m.numel()} and "
                             f"{s.numel()}")
        if bool((s == 0).any()):
            raise ValueError("Normalize: std must not contain zeros")
        self.mean, self.std, self.scale = tuple(mean), tuple(std), scale
        self.mean_scaled, self.std_scaled = m, s
        self._m, self._s = m.tolist(), s.tolist()
        self.dtype = dtype
        self.channels_last = channels_last

    def __repr__(self):
        return (f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, "
                f"channels_last={self.channels_last}, scale={self.scale})")

    def applies_to(self, dtype, shape) -> bool:
        return dtype == torch.uint8 and len(shape) == 4 and shape[-1] == len(self._m)

    def empty_output(self, shape, device):
        """(the NCHW-shaped result, its memory in the kernel's order) for a uint8 [n, h, w, c] input."""
        n, h, w, c = shape
        if self.channels_last:
            mem = torch.empty((n, h, w, c), dtype=self.dtype, device=device)
            return mem.permute(0, 3, 1, 2), mem
        mem = torch.empty((n, c, h, w), dtype=self.dtype, device=device)
        return mem, mem

    def run(self, x, out_mem, stream=0):
        _C.normalize(x, out_mem, self._m, self._s, self.channels_last, stream)

    def __call__(self, x):
        """Normalise one uint8 [n, h, w, c] tensor (CPU or CUDA; on CUDA on the current stream)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Normalize: expected a uint8 tensor [n, h, w, c], got {type(x).__name__}")
        if not self.applies_to(x.dtype, tuple(x.shape)):
            raise ValueError(f"Normalize: expected a uint8 tensor [n, h, w, {len(self._m)}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.contiguous()
        out, mem = self.empty_output(tuple(x.shape), x.device)
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        self.run(x.detach(), mem, stream)
        return out

    def reference(self, x):
        """torch's own ops for the same result (what tests compare against)."""
        c = len(self._m)
        m = self.mean_scaled.to(x.device).view(1, c, 1, 1)
        s = self.std_scaled.to(x.device).view(1, c, 1, 1)
        y = x.permute(0, 3, 1, 2).float().sub(m).div(s).to(self.dtype)
        return y.contiguous(memory_format=torch.channels_last) if self.channels_last else y.contiguous()


@dataclasses.dataclass
class LoaderStats:
    """What one DataLoader did since it was made (all epochs)."""

    batches: int = 0
    samples: int = 0
    wait_seconds: float = 0.0  # time the consumer spent inside __next__
    elapsed_seconds: float = 0.0  # from the first __next__ of an epoch to the last return, summed
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0  # CUDA-event time of the host-to-device copies
    worker_busy_seconds: float = 0.0  # time workers spent producing batches
    ring_bytes: int = 0
    register_seconds: float = 0.0  # main-process time spent page-locking ring slots (once per slot)
    worker_restarts: int = 0

    @property
    def stall_fraction(self) -> float:
        return self.wait_seconds / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stall_fraction"] = self.stall_fraction
        d["h2d_gbps"] = self.h2d_gbps
        return d


def _cuda_device(device):
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"DataLoader: expected device=None, 'cpu' or a CUDA device, got {device}")
    reason = _C.cuda_unavailable_reason()
    if reason is not None or not torch.cuda.is_available():
        raise RuntimeError(f"DataLoader: device={device} needs CUDA: {reason or 'torch cannot see a CUDA device'}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader with the same arguments, defaults, attributes and batches, fed by
    a shared ring. Extra keyword arguments:

    device: a CUDA device: batches arrive there as tensors usable on the current stream.
    prefetch_batches: batches copied to the device ahead of the one being consumed (default 2).
    gpu_transform: e.g. hotloop.Normalize(mean, std): applied to image leaves on the way (on the CPU
        too when device is None).
    max_worker_restarts: dead workers replaced (their batches redone) before a RuntimeError.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor=None, persistent_workers=False,
                 pin_memory_device="", in_order=True, device=None, prefetch_batches=2, gpu_transform=None,
                 max_worker_restarts=3):
        if not isinstance(prefetch_batches, int) or prefetch_batches < 0:
            raise ValueError(f"DataLoader: expected prefetch_batches >= 0, got {prefetch_batches!r}")
        if gpu_transform is not None and not isinstance(gpu_transform, Normalize):
            raise TypeError(f"DataLoader: expected gpu_transform=None or a hotloop.Normalize, got "
                            f"{type(gpu_transform).__name__}")
        if not isinstance(max_worker_restarts, int) or max_worker_restarts < 0:
            raise ValueError(f"DataLoader: expected max_worker_restarts >= 0, got {max_worker_restarts!r}")
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
                         drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self.device = _cuda_device(device)
        self.prefetch_batches = prefetch_batches
        self.gpu_transform = gpu_transform
        self.max_worker_restarts = max_worker_restarts
        self._hl_stats = LoaderStats()
        self._hl_pool = None  # persistent workers keep theirs here
        self._hl_resume = None  # a loaded state, applied by the next iterator
        self._hl_epoch = None  # the current epoch's (generator state, base seed)
        self._hl_epoch_done = False  # its last batch was handed out
        self._hl_yielded = 0  # batches handed out in it
        self._hl_iter = None  # weak reference to the live iterator

    @property
    def stats(self) -> LoaderStats:
        return self._hl_stats

    def _get_iterator(self):
        if self.num_workers == 0:
            it = _SingleIter(self)
        else:
            self.check_worker_number_rationality()
            it = _MultiIter(self)
        self._hl_iter = weakref.ref(it)
        return it

    def __iter__(self):
        resume = self._hl_resume
        if resume is not None and resume.get("epoch_done") and not (self.persistent_workers and self.num_workers):
            # the saved epoch had ended: the next one starts from the generator as it was then
            self._hl_resume = None
            self._generator().set_state(resume["generator_state"])
        it = super().__iter__()
        self._hl_iter = weakref.ref(it)
        return it

    def _generator(self):
        return self.generator if self.generator is not None else torch.default_generator

    def state_dict(self) -> dict:
        """Where the current epoch stands: load it into a loader built the same way and the next batch
        it yields is the one this loader would have yielded next (after a finished epoch: the first
        batch of the next epoch). The loader's generator (torch's default one when generator=None)
        is rewound to make the sampler draw the same order; random transforms inside workers draw
        from fresh worker seeds, so they match only from the start of an epoch."""
        if self._hl_epoch is None:
            return {"version": 1, "batches_yielded": 0, "generator_state": None, "base_seed": None,
                    "epoch_done": False}
        if self._hl_epoch_done:
            return {"version": 1, "batches_yielded": 0, "generator_state": self._generator().get_state(),
                    "base_seed": None, "epoch_done": True}
        gen_state, base_seed = self._hl_epoch
        return {"version": 1, "batches_yielded": self._hl_yielded, "generator_state": gen_state.clone(),
                "base_seed": base_seed, "epoch_done": False}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError(f"load_state_dict: expected a dict from DataLoader.state_dict(), got {state!r:.80}")
        self._hl_resume = dict(state)

    def _hl_begin_epoch(self, it):
        """Called by an iterator once its sampler iterator exists and before it draws from it: rewinds
        the generator for a resumed epoch, remembers where this epoch starts, returns batches to skip."""
        gen = self._generator()
        resume, self._hl_resume = self._hl_resume, None
        skip = 0
        if resume is not None and resume.get("generator_state") is not None:
            gen.set_state(resume["generator_state"])  # epoch_done with persistent workers: undo the seed draw
            if resume.get("base_seed") is not None:
                it._base_seed = resume["base_seed"]
            skip = int(resume["batches_yielded"])
        self._hl_epoch = (gen.get_state(), it._base_seed)
        self._hl_epoch_done = False
        self._hl_yielded = skip
        return skip

    def __del__(self):
        pool = getattr(self, "_hl_pool", None)
        if pool is not None:
            pool.close()


def _record(loader, t0, samples):
    dt = time.perf_counter() - t0
    loader._hl_yielded += 1
    st = loader._hl_stats
    st.wait_seconds += dt
    st.batches += 1
    st.samples += samples
    _PROCESS_STATS["wait_seconds"] += dt
    _PROCESS_STATS["batches"] += 1
    _PROCESS_STATS["samples"] += samples


def _count_elapsed(it, loader, t0):
    """Epoch wall time as the consumer sees it: from entering the first __next__ to the last return."""
    now = time.perf_counter()
    last = getattr(it, "_last_return", None)
    loader._hl_stats.elapsed_seconds += now - (t0 if last is None else last)
    it._last_return = now


def _batch_samples(batch, default):
    tensors = []
    flatten(batch, tensors)
    for t in tensors:
        if t.dim() > 0:
            return int(t.shape[0])
    return default


def _host_batch_out(loader, batch, pin):
    """A batch that came whole (num_workers=0, or through a worker's pipe): to the device and/or
    through the transform, as the ring path would deliver it."""
    device, tf = loader.device, loader.gpu_transform
    if device is None and tf is None:
        if pin:
            from torch.utils.data._utils.pin_memory import pin_memory
            return pin_memory(batch)
        return batch
    tensors = []
    spec = flatten(batch, tensors)
    outs = []
    for t in tensors:
        if device is not None:
            t = t.to(device)
        if tf is not None and tf.applies_to(t.dtype, tuple(t.shape)):
            t = tf(t)
        elif pin and device is None:
            t = t.pin_memory()
        outs.append(t)
    return unflatten(spec, outs)


class _SingleIter(_SingleProcessDataLoaderIter):
    """num_workers=0: torch's own single-process iterator, plus device, transform, stats and resume."""

    def __init__(self, loader):
        super().__init__(loader)
        self._loader = loader
        self._last_return = None
        skip = loader._hl_begin_epoch(self)
        self._skip(skip)

    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)

    def _skip(self, n):
        for _ in range(n):
            if self._dataset_kind == _DatasetKind.Map:
                next(self._sampler_iter)
            else:
                super()._next_data()  # an iterable's position is only known by walking it
            self._num_yielded += 1

    def _next_data(self):
        t0 = time.perf_counter()
        try:
            batch = super()._next_data()  # torch pins it there when pin_memory
        except StopIteration:
            self._loader._hl_epoch_done = True
            raise
        batch = _host_batch_out(self._loader, batch, False)
        _record(self._loader, t0, _batch_samples(batch, 1))
        _count_elapsed(self, self._loader, t0)
        return batch


@dataclasses.dataclass(eq=False)
class _Task:
    id: int
    wid: int
    index: object
    slot: int
    consumed: bool = False


@dataclasses.dataclass(eq=False)
class _Pending:
    """A batch whose copy to the device is queued: its slot is freed once `event` completed."""

    slot: int
    event: int
    result: object
    keep: list  # staging buffers the copy stream still writes
    stream: object  # the stream the device tensors were allocated for
    tensors: list
    nbytes: int
    timing: tuple  # (start, end) timing events or None


_LIVE_POOLS = weakref.WeakSet()


@atexit.register
def _close_live_pools():
    for pool in list(_LIVE_POOLS):
        pool.close()


class _Pool:
    """Worker processes, their pipes, the ring and the copies out of it: what persistent workers keep."""

    def __init__(self, loader, it):
        self.loader = loader
        self.ctx = loader.multiprocessing_context or torch.multiprocessing
        self.n = loader.num_workers
        self.kind = it._dataset_kind
        self.worker_args = (it._dataset_kind, it._dataset, it._auto_collation, it._collate_fn, it._drop_last,
                            it._base_seed, loader.worker_init_fn)
        self.main_pid = os.getpid()
        self.device = loader.device
        self.ring = None
        self.ring_unused = False  # the first batch had no tensor: everything takes the pipe
        self.ring_msg = None
        self.layout = []
        self.free_slots = []
        self.tasks = {}
        self.pipe_results = {}
        self.layouts = {}  # task id -> (tensor bytes, spec bytes) of batches waiting for the ring
        self.task_worker = {}  # task id -> worker, for every task not yet finished
        self.resuming = False
        self.resumed = set()
        self.next_task_id = 0
        self.restarts = 0
        self.closed = False
        self.procs = [None] * self.n
        self.task_conns = [None] * self.n
        self.result_conns = [None] * self.n
        # CUDA state: a side stream for copies, events per slot, copies in flight
        self.copy_stream = None
        self.pin_slots = True
        self.inflight = collections.deque()
        self.event_pool = []
        self.alloc_event = None
        _LIVE_POOLS.add(self)
        for wid in range(self.n):
            self._start(wid)

    # workers ---------------------------------------------------------------------------------------
    def _start(self, wid):
        task_r, task_w = self.ctx.Pipe(duplex=False)
        res_r, res_w = self.ctx.Pipe(duplex=False)
        for conn in (task_w, res_r):
            try:  # 1 MiB pipes (Linux): large index lists and side objects rarely fill them
                fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, 1 << 20)
            except OSError:
                pass
        kind, dataset, auto, collate_fn, drop_last, base_seed, init_fn = self.worker_args
        # a forked worker inherits the main process's ends of the other workers' pipes (and the
        # ring's fd): it closes them, so that a dead main process or worker shows as EOF everywhere
        inherited = []
        if self.ctx.get_start_method() == "fork":
            inherited = [c.fileno() for c in self.task_conns + self.result_conns if c is not None and not c.closed]
            if self.ring is not None:
                inherited.append(self.ring.fd)
        proc = self.ctx.Process(target=worker_main,
                                args=(wid, self.n, kind, dataset, auto, collate_fn, drop_last, base_seed, init_fn,
                                      task_r, res_w, self.main_pid, True, inherited),
                                daemon=True)
        proc.start()
        task_r.close()  # the worker's ends: closed here so that the worker's exit shows as EOF
        res_w.close()
        self.procs[wid], self.task_conns[wid], self.result_conns[wid] = proc, task_w, res_r
        if self.ring_msg is not None:
            task_w.send(self.ring_msg)

    def send(self, wid, msg):
        try:
            self.task_conns[wid].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker is dead: _check_workers restarts it and gives its tasks again

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
        kind = msg[0]
        if kind == "resumed":
            self.resumed.add(msg[1])
        elif kind == "batch":
            self.pipe_results[msg[1]] = ("batch", msg[2], msg[3])
        elif kind == "error":
            self.pipe_results[msg[1]] = ("error", msg[2], 0.0)
        elif kind == "stop":
            self.pipe_results[msg[1]] = ("stop", 0.0)
        elif kind == "meta":
            self.pipe_results[msg[1]] = pickle.loads(msg[2])
        elif kind == "layout":
            self.layouts[msg[1]] = (msg[2], msg[3])
            self._place_layouts()

    def _place_layouts(self):
        """Batches made before the ring existed: size the ring from the first, then give each a slot."""
        if self.ring is None and not self.ring_unused and self.layouts and not self.resuming:
            self.make_ring(*self.layouts[min(self.layouts)])
        for tid in sorted(self.layouts):
            del self.layouts[tid]
            task = self.tasks.get(tid)
            if task is None or self.resuming:
                wid = self.task_worker.get(tid)
                if wid is not None and self.procs[wid] is not None:
                    self.send(wid, ("place", tid, -2))
                continue
            task.slot = self.take_slot() if self.ring is not None else -1
            self.send(task.wid, ("place", tid, task.slot))

    def _check_workers(self):
        for wid, proc in enumerate(self.procs):
            if proc is not None and proc.exitcode is not None:
                self._on_death(wid)

    def _is_done(self, task):
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
        lost = sorted((t for t in self.tasks.values() if t.wid == wid and not t.consumed and not self._is_done(t)),
                      key=lambda t: t.id)
        code = proc.exitcode
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        held = [list(t.index) if t.index is not None else None for t in lost]
        desc = f"DataLoader worker {wid} (pid {proc.pid}) {how} while holding the indices {held}"
        fatal = None
        if self.kind == _DatasetKind.Iterable and lost:
            fatal = desc + "; an IterableDataset worker cannot be restarted (its position is lost)"
        elif self.restarts >= self.loader.max_worker_restarts:
            fatal = desc + (f"; {self.restarts} worker(s) were restarted already "
                            f"(max_worker_restarts={self.loader.max_worker_restarts})")
        if fatal is not None:
            self.close()  # the epoch cannot go on: reap the other workers now, not at garbage collection
            raise RuntimeError(fatal)
        self.restarts += 1
        self.loader._hl_stats.worker_restarts += 1
        _logger.warning("%s; restarting it and redoing %d batch(es)", desc, len(lost))
        self._forget(wid)
        self._start(wid)
        for t in lost:
            self.layouts.pop(t.id, None)  # its batch died with the worker: made again below
            if t.slot < 0 and self.ring is not None:
                t.slot = self.take_slot()
            elif t.slot >= 0:
                self.ring.set_state(t.slot, _C.RING_ASSIGNED)  # e.g. flagged overflow, metadata lost
            self.send(wid, ("task", t.id, t.index, t.slot))

    def _forget(self, wid):
        for conn in (self.task_conns[wid], self.result_conns[wid]):
            try:
                conn.close()
            except OSError:
                pass
        proc = self.procs[wid]
        proc.join(0)
        try:
            proc.close()
        except ValueError:
            pass
        self.procs[wid] = None

    # tasks -----------------------------------------------------------------------------------------
    def new_task(self, wid, index):
        slot = self.take_slot() if self.ring is not None else -1
        task = _Task(self.next_task_id, wid, index, slot)
        self.next_task_id += 1
        self.tasks[task.id] = task
        self.task_worker[task.id] = wid
        self.send(wid, ("task", task.id, index, slot))
        return task

    def poll(self, task):
        """The task's outcome if it is done, else None (never blocks for long)."""
        if task.slot >= 0:
            state, tid, wid, meta_len, flags = self.ring.info(task.slot)
            if state == _C.RING_ASSIGNED:
                return None
            if tid != task.id:
                raise AssertionError(f"slot {task.slot} holds task {tid}, expected {task.id}")
            if flags & _C.RING_FLAG_OVERFLOW:
                self.drain_all()  # the metadata follows through the worker's pipe
                return self.pipe_results.pop(task.id, None)
            view = self.ring.view(task.slot)
            try:
                return pickle.loads(view[:meta_len])
            finally:
                view.release()
        if self.ring is None and not self.ring_unused:
            for wid in range(self.n):  # layouts of any worker may make the ring
                if self.procs[wid] is not None:
                    self._drain(wid)
        else:
            self._drain(task.wid)
        if task.slot >= 0:
            return self.poll(task)  # placed into the ring meanwhile
        return self.pipe_results.pop(task.id, None)

    def wait(self, task, timeout, batch_number, on_idle=None):
        """Block until the task is done; a dead worker is replaced meanwhile (or raises), and every
        sleep is bounded, so that nothing here can wait for an event that will not come."""
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        while True:
            outcome = self.poll(task)
            if outcome is not None:
                return outcome
            self._check_workers()
            if self.layouts:
                self._place_layouts()
            if on_idle is not None:
                on_idle()  # e.g. hand out more tasks as soon as the ring exists
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise RuntimeError(f"DataLoader timed out after {timeout} seconds waiting for batch {batch_number} "
                                   f"(worker {task.wid}, indices {task.index})")
            if task.slot >= 0 and self.ring.state(task.slot) == _C.RING_ASSIGNED:
                # wake on any slot's change: a worker that flagged an overflow is now writing its
                # metadata into its pipe and must be read, whichever task is awaited here
                self.ring.wait(task.slot, _C.RING_ASSIGNED, left, True)
            else:
                waitables = [c for c in self.result_conns if c is not None and not c.closed]
                waitables += [p.sentinel for p in self.procs if p is not None]
                multiprocessing.connection.wait(waitables, left)
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

    def drop(self, task):
        """A task whose result will never be used (exhausted iterable worker)."""
        self.finish(task)
        if task.slot >= 0 and self.procs[task.wid] is not None:
            # the worker skips tasks after its end, but may still be in the middle of this one
            self.ring.wait(task.slot, _C.RING_ASSIGNED, 0)
            self.release_slot(task.slot)

    def resume(self):
        """New epoch with persistent workers: let every worker finish what it had, then drop it."""
        self.resumed.clear()
        self.resuming = True
        for wid in range(self.n):
            self.send(wid, ("resume",))
        while len(self.resumed) < self.n:
            for wid in range(self.n):
                if wid not in self.resumed and not self._drain(wid):
                    self._check_workers()
            if len(self.resumed) < self.n:
                self._check_workers()
                multiprocessing.connection.wait([c for w, c in enumerate(self.result_conns) if w not in self.resumed],
                                                _POLL_S)
        for task in list(self.tasks.values()):
            if task.slot >= 0:
                self.release_slot(task.slot)
        self.tasks.clear()
        self.task_worker.clear()
        self.pipe_results.clear()
        self.layouts.clear()
        self.resuming = False

    # the ring --------------------------------------------------------------------------------------
    def make_ring(self, sizes, spec_bytes):
        """Size the ring from the first batch's layout and tell every worker about it."""
        if not sizes:
            self.ring_unused = True
            return
        meta_cap = _round(max(_META_MIN, 8 * spec_bytes + 4096), _ALIGN)
        layout, offset = [], meta_cap
        for nbytes in sizes:
            cap = _round(max(nbytes, 1), _ALIGN)
            layout.append((offset, cap))
            offset += cap
        loader = self.loader
        nslots = self.n * loader.prefetch_factor + 1 + (loader.prefetch_batches + 2 if self.device else 0)
        ring = _C.Ring(nslots, offset)  # pages are faulted by the workers, pinned slot by slot on first copy
        self.ring, self.layout = ring, layout
        self.free_slots = list(range(nslots))
        loader._hl_stats.ring_bytes = ring.nbytes
        self.ring_msg = ("ring", f"/proc/{self.main_pid}/fd/{ring.fd}", nslots, ring.slot_bytes, layout, meta_cap)
        for wid in range(self.n):
            if self.procs[wid] is not None:
                self.send(wid, self.ring_msg)

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
        """CPU delivery: copy (or normalise) each leaf out of the slot, then free the slot."""
        tf = self.loader.gpu_transform
        outs, triples = [], []
        view = None
        try:
            for off, dtype, shape in leaves:
                if tf is not None and tf.applies_to(dtype, shape):
                    if view is None:
                        view = self.ring.view(slot)
                    nbytes = torch.Size(shape).numel()
                    src = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=off).view(shape)
                    out, mem = tf.empty_output(shape, "cpu")
                    tf.run(src, mem)
                    del src
                    outs.append(out)
                    continue
                t = torch.empty(shape, dtype=dtype, pin_memory=pin)
                triples += (off, t.data_ptr(), t.numel() * t.element_size())
                outs.append(t)
            if triples:
                self.ring.copy_out(slot, array.array("q", triples).tobytes())
        finally:
            if view is not None:
                view.release()
        self.release_slot(slot)
        return unflatten(spec, outs)

    # CUDA ------------------------------------------------------------------------------------------
    def _event(self, timing=False):
        if not timing and self.event_pool:
            return self.event_pool.pop()
        return _C.cuda_event_create(self.device.index, timing)

    def copy_to_device(self, slot, spec, leaves):
        """Queue the slot's copy to the device on the side stream; the result is usable once the
        consumer's stream waited on the returned _Pending's event."""
        dev = self.device
        tf = self.loader.gpu_transform
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(dev)
            self.alloc_event = _C.cuda_event_create(dev.index, False)
        consumer = torch.cuda.current_stream(dev)
        outs, triples, staged, keep, nbytes = [], [], [], [], 0
        for off, dtype, shape in leaves:
            size = torch.Size(shape).numel() * dtype.itemsize
            nbytes += size
            if tf is not None and tf.applies_to(dtype, shape):
                staging = torch.empty(shape, dtype=torch.uint8, device=dev)
                out, mem = tf.empty_output(shape, dev)
                staged.append((staging, mem))
                keep.append(staging)
                triples += (off, staging.data_ptr(), size)
                outs.append(out)
            else:
                t = torch.empty(shape, dtype=dtype, device=dev)
                triples += (off, t.data_ptr(), size)
                outs.append(t)
        if self.pin_slots:
            t0 = time.perf_counter()
            try:
                if self.ring.cuda_register_slot(slot, dev.index):
                    self.loader._hl_stats.register_seconds += time.perf_counter() - t0
            except Exception as exc:  # still correct without pinning, only slower
                self.pin_slots = False
                warnings.warn(f"hotloop.DataLoader: the ring could not be page-locked ({exc}); copies will be "
                              "slower", stacklevel=4)
        side = self.copy_stream.cuda_stream
        # the tensors were allocated for the consumer's stream: blocks it freed may still be in use
        # by work queued there, so the copy stream waits for everything queued so far (timm #2781)
        _C.cuda_event_record(self.alloc_event, consumer.cuda_stream)
        _C.cuda_stream_wait_event(side, self.alloc_event)
        timing = (_C.cuda_event_create(dev.index, True), _C.cuda_event_create(dev.index, True))
        _C.cuda_event_record(timing[0], side)
        if triples:
            self.ring.copy_to_device(slot, array.array("q", triples).tobytes(), side, dev.index)
        _C.cuda_event_record(timing[1], side)
        for staging, mem in staged:
            tf.run(staging, mem, side)
        event = self._event()
        _C.cuda_event_record(event, side)
        return _Pending(slot, event, unflatten(spec, outs), keep, consumer, outs, nbytes, timing)

    def deliver(self, pending):
        consumer = torch.cuda.current_stream(self.device)
        _C.cuda_stream_wait_event(consumer.cuda_stream, pending.event)
        if consumer != pending.stream:
            for t in pending.tensors:
                t.record_stream(consumer)
        # the staging buffers go back to the allocator now: later work on the consumer's stream is
        # ordered after the event, so it cannot overwrite them while the copy stream reads them
        pending.keep = None
        pending.tensors = None
        result, pending.result = pending.result, None
        self.inflight.append(pending)
        self.reclaim(block=False)
        return result

    def reclaim(self, block):
        """Free the slots whose copies finished (with block: wait for the oldest if none did)."""
        st = self.loader._hl_stats
        while self.inflight:
            p = self.inflight[0]
            if not _C.cuda_event_query(p.event):
                if not block:
                    return
                _C.cuda_event_synchronize(p.event)
            self.inflight.popleft()
            block = False
            self.release_slot(p.slot)
            self.event_pool.append(p.event)
            if p.timing is not None:
                st.h2d_seconds += _C.cuda_event_elapsed(*p.timing) / 1e3
                st.h2d_bytes += p.nbytes
                for e in p.timing:
                    _C.cuda_event_destroy(e)

    # shutdown --------------------------------------------------------------------------------------
    def close(self):
        if self.closed or os.getpid() != self.main_pid:
            return  # a forked worker may hold a copy of this object: it owns none of it
        self.closed = True
        _LIVE_POOLS.discard(self)
        for wid in range(self.n):
            if self.procs[wid] is not None:
                try:
                    self.send(wid, None)
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
        try:
            for p in self.inflight:  # DMA must be over before the memory is unregistered
                _C.cuda_event_synchronize(p.event)
                self.event_pool.append(p.event)
                if p.timing is not None:
                    for e in p.timing:
                        _C.cuda_event_destroy(e)
            self.inflight.clear()
            for e in self.event_pool + ([self.alloc_event] if self.alloc_event else []):
                _C.cuda_event_destroy(e)
        except Exception:  # at interpreter exit CUDA may already be torn down
            pass
        self.event_pool = []
        self.alloc_event = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None


def _round(x, to):
    return (x + to - 1) // to * to


class _MultiIter(_BaseDataLoaderIter):
    """num_workers > 0: tasks go round robin to the workers as torch sends them, results come back
    through the ring (or, for the first batch of each worker, through its pipe)."""

    def __init__(self, loader):
        super().__init__(loader)
        self._loader = loader
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._pool = None
        self._reset(loader, first_iter=True)

    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)
        skip = loader._hl_begin_epoch(self)
        pool = loader._hl_pool if self._persistent_workers else None
        if pool is None or pool.closed:
            pool = _Pool(loader, self)
            if self._persistent_workers:
                loader._hl_pool = pool
        elif not first_iter or self._pool is None:
            pool.resume()
            pool.loader = loader
        for old in getattr(self, "_prepared", ()):  # copies of an abandoned epoch: free their slots later
            if isinstance(old[0], _Pending):
                pool.inflight.append(old[0])
        self._pool = pool
        self._last_return = None
        self._order = []  # tasks of this epoch in the order torch would return them
        self._rcvd_idx = 0
        self._outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._worker_cycle = itertools.cycle(range(self._num_workers))
        self._prepared = collections.deque()
        self._skip_batches = 0
        if self._dataset_kind == _DatasetKind.Map:
            for _ in range(skip):
                next(self._sampler_iter)
            self._num_yielded = skip
        else:
            self._skip_batches = skip
        self._fill()

    def _fill(self):
        while self._try_put_index():
            pass

    def _try_put_index(self):
        pool = self._pool
        ring_known = pool.ring is not None or pool.ring_unused
        max_tasks = self._prefetch_factor * self._num_workers if ring_known else self._num_workers
        if self._outstanding >= max_tasks:
            return False
        try:
            index = self._next_index()
        except StopIteration:
            return False
        for _ in range(self._num_workers):  # the next active worker, round robin as torch does
            wid = next(self._worker_cycle)
            if self._workers_status[wid]:
                break
        else:
            return False
        self._order.append(pool.new_task(wid, index))
        self._outstanding += 1
        return True

    def _next_task(self):
        """The next task to return (in order, or any finished one when in_order=False)."""
        while self._rcvd_idx < len(self._order):
            task = self._order[self._rcvd_idx]
            if task.consumed:
                self._rcvd_idx += 1
                continue
            if self._workers_status[task.wid] or self._pool._is_done(task):
                break
            self._pool.drop(task)
            self._outstanding -= 1
            self._rcvd_idx += 1
        else:
            return None
        if not self._in_order:
            for task in self._order[self._rcvd_idx:]:
                if not task.consumed and self._pool._is_done(task):
                    return task
        return self._order[self._rcvd_idx]

    def _first_done(self, head):
        """in_order=False: sleep until any outstanding task is done and return it (the head once
        `timeout` passed: pool.wait then raises)."""
        pool = self._pool
        deadline = time.monotonic() + self._timeout if self._timeout and self._timeout > 0 else None
        while deadline is None or time.monotonic() < deadline:
            candidates = [t for t in self._order[self._rcvd_idx:] if not t.consumed and self._workers_status[t.wid]]
            for task in candidates:
                if pool._is_done(task):
                    return task
            pool._check_workers()
            if pool.layouts:
                pool._place_layouts()
            self._fill()
            waiting = [t for t in candidates if t.slot >= 0 and pool.ring.state(t.slot) == _C.RING_ASSIGNED]
            if waiting:
                # any slot's change wakes it; pipe messages (layouts) do not, hence the short sleep
                pool.ring.wait(waiting[0].slot, _C.RING_ASSIGNED, 0.02, True)
            else:
                waitables = [c for c in pool.result_conns if c is not None and not c.closed]
                multiprocessing.connection.wait(waitables + [p.sentinel for p in pool.procs if p is not None],
                                                _POLL_S)
            pool.drain_all()
        return head

    def _next_result(self, block=True):
        """The next batch, assembled (CPU) or with its copy queued (_Pending, CUDA). None when the
        next one is not ready and block is False."""
        pool = self._pool
        while True:
            task = self._next_task()
            if task is None:
                raise StopIteration  # the caller shuts the workers down once nothing is left to hand out
            if not block and not pool._is_done(task):
                return None
            if not self._in_order and not pool._is_done(task):
                task = self._first_done(task)
            outcome = pool.wait(task, self._timeout, self._num_yielded + len(self._prepared), self._fill)
            pool.finish(task)
            self._outstanding -= 1
            kind = outcome[0]
            if kind == "stop":
                self._workers_status[task.wid] = False
                if task.slot >= 0:
                    pool.release_slot(task.slot)
                self._fill()
                continue
            if kind == "error":
                if task.slot >= 0:
                    pool.release_slot(task.slot)
                self._fill()
                outcome[1].reraise()
            st = self._loader._hl_stats
            st.worker_busy_seconds += outcome[-1]
            if kind == "batch":
                batch = outcome[1]
                self._fill()
                samples = self._samples_of(task, lambda: _batch_samples(batch, 1))
                out = _host_batch_out(self._loader, batch, self._pin_memory)
                return out, samples
            _, spec, leaves, _busy = outcome
            samples = self._samples_of(task, lambda: int(leaves[0][2][0]) if leaves and leaves[0][2] else 1)
            if pool.device is None:
                out = pool.copy_out(task.slot, spec, leaves, self._pin_memory)
            else:
                out = pool.copy_to_device(task.slot, spec, leaves)
            self._fill()
            return out, samples

    def _samples_of(self, task, from_batch):
        if not self._auto_collation:
            return 1
        if self._dataset_kind == _DatasetKind.Map:
            return len(task.index)
        return from_batch()  # an iterable's last batch may be short

    def _next_data(self):
        t0 = time.perf_counter()
        if self._pool is None:
            self._loader._hl_epoch_done = True
            raise StopIteration
        if self._pool.closed:
            raise RuntimeError("DataLoader: this epoch ended with an error in a worker (see above); start a new "
                               "one with iter(loader)")
        while self._skip_batches:
            self._skip_batches -= 1
            out, _ = self._next_result()
            if isinstance(out, _Pending):
                self._pool.deliver(out)
        pool = self._pool
        try:
            if pool.device is None:
                out, samples = self._next_result()
            else:
                if not self._prepared:
                    self._prepared.append(self._next_result())
                out, samples = self._prepared.popleft()
        except StopIteration:
            self._loader._hl_epoch_done = True
            if not self._persistent_workers:
                self._shutdown()
            raise
        if pool.device is not None:
            if isinstance(out, _Pending):
                out = pool.deliver(out)
            try:
                while len(self._prepared) < self._loader.prefetch_batches:
                    nxt = self._next_result(block=False)
                    if nxt is None:
                        break
                    self._prepared.append(nxt)
            except StopIteration:
                pass  # the epoch's last batches are prepared; they are handed out by the next calls
        _record(self._loader, t0, samples)
        _count_elapsed(self, self._loader, t0)
        return out

    def _shutdown(self):
        pool, self._pool = self._pool, None
        if pool is not None and not self._persistent_workers:
            for old in self._prepared:  # their copies must end before the ring is unregistered
                if isinstance(old[0], _Pending):
                    pool.inflight.append(old[0])
            self._prepared.clear()
            pool.close()

    def __del__(self):
        if not getattr(self, "_persistent_workers", True):
            self._shutdown()
