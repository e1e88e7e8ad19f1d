"""The worker side of hotloop.DataLoader: a process that runs dataset[i] and writes batches into the ring.

A worker is seeded, named and given `get_worker_info()` exactly as torch's `_worker_loop` does, so
random transforms in `__getitem__` draw the same numbers as they would under torch's DataLoader.
Map-style batches with the default collate are written sample by sample straight into the slot (the
one host copy); anything else is collated as torch would (without torch's /dev/shm storage) and its
tensors copied in. Leaves that are not fixed-shape CPU tensors travel in the slot's pickled metadata.
What it receives and sends is in messages.py.
"""
import dataclasses
import os
import pickle
import signal
import time
from multiprocessing import reduction

import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.graph_settings import apply_random_seed

from ... import _C
from ..._torch_compat import DatasetKind, ExceptionWrapper, default_collate, set_worker_info
from ..consumer.resume import dataset_state, load_dataset_state
from ..messages import (Discard, Ended, EpochStarted, Exit, Failed, Fetch, Layout, NewEpoch, Overflow, Place,
                        Result, Setup, SlotBatch, Started, UseRing, WholeBatch)
from ..ring.layout import (FastPathDeclined, SlotWriter, collate_no_shm, flatten, leaf_bytes, plan_layout,
                          sample_plan, write_fast, write_general)
from .rng import rng_state, seed_like_torch, set_rng_state
from .rows import SlotRows


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a pool starts with (besides its id); the rest comes through its task pipe."""

    num_workers: int
    dataset_kind: int  # torch's DatasetKind
    dataset: object
    auto_collation: bool
    collate_fn: object
    drop_last: bool
    base_seed: int
    init_fn: object
    shared_seed: int = None  # an IterDataPipe's: the same in every worker, for its random operations


@dataclasses.dataclass(frozen=True)
class _Samples:
    """A fast-path batch not collated yet: its samples, the first `placed` of them in their slot rows."""

    samples: list
    placed: int


def worker_main(spec: WorkerSpec, worker_id, task_conn, result_conn, parent_pid, inherited_fds=(), ring_conn=None):
    """The worker process: mirrors torch's _worker_loop, outcomes go to the ring or the result pipe.
    It returns when told to (Exit), at EOF, or once its parent is gone (parent_pid; None: the
    process it started with, a forkserver). ring_conn: the socket the ring's memfd comes over,
    unless this worker inherited it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    result_conn.send_bytes(pickle.dumps(Started(worker_id), protocol=pickle.HIGHEST_PROTOCOL))
    if parent_pid is None:
        parent_pid = os.getppid()
    for fd in inherited_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    torch.set_num_threads(1)
    seed = seed_like_torch(spec.base_seed, worker_id)
    dataset = _with_shared_seed(spec.dataset, spec.shared_seed)
    set_worker_info(id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset)
    _WorkerLoop(spec, worker_id, dataset, result_conn, ring_conn).run(task_conn, parent_pid)


def _with_shared_seed(dataset, shared_seed):
    """An IterDataPipe with its random operations (shuffle) seeded alike in every worker, as
    torch's worker does (so that sharding_filter splits one order); any other dataset as it is."""
    if not isinstance(dataset, IterDataPipe):
        return dataset
    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    return apply_random_seed(dataset, rng)


class _WorkerLoop:
    """One worker's state between messages: the ring once attached, and the batches made before it
    existed, which wait for Place."""

    def __init__(self, spec, worker_id, dataset, result_conn, ring_conn):
        self.spec = spec
        self.worker_id = worker_id
        self.dataset = dataset  # spec.dataset, a DataPipe seeded for this epoch
        self.result_conn = result_conn
        self.ring_conn = ring_conn
        self.fetch_collate = collate_no_shm if spec.collate_fn is default_collate else spec.collate_fn
        self.fast = (spec.collate_fn is default_collate and spec.dataset_kind == DatasetKind.Map
                     and spec.auto_collation and not getattr(spec.dataset, "__getitems__", None))
        self.where = f"in DataLoader worker process {worker_id}"
        self.ring = self.slot_u8 = None
        self.layout = []
        self.meta_bytes = 0
        self.iteration_end = False
        # task id -> (outcome, busy seconds) of batches made before the ring existed: they wait for
        # Place; an outcome is _Samples (fast path, not collated yet), WholeBatch or Failed
        self.pending = {}
        self.early = set()  # tasks whose layout was sent from their first sample, before the batch was complete
        self.rng_after = {}  # task id -> rng_state() right after it, until its outcome is sent
        self.data_after = {}  # task id -> a Stateful dataset's state right after it, likewise
        self.faulted = set()  # slots whose pages this process has faulted in
        self.init_error = None  # raised at the next task
        self.fetcher = None
        try:
            if spec.init_fn is not None:
                spec.init_fn(worker_id)
            self.fetcher = self.new_fetcher()
        except Exception:
            self.init_error = ExceptionWrapper(where=self.where)

    def new_fetcher(self):
        s = self.spec
        return DatasetKind.create_fetcher(s.dataset_kind, self.dataset, s.auto_collation, self.fetch_collate,
                                           s.drop_last)

    def send(self, msg):
        self.result_conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def run(self, task_conn, parent_pid):
        try:
            while True:
                if not task_conn.poll(1.0):
                    if os.getppid() != parent_pid:
                        return  # the main process (or the launcher) is gone
                    continue
                try:
                    msg = task_conn.recv()
                except EOFError:
                    return
                if isinstance(msg, Fetch):
                    self.fetch(msg.task_id, msg.index, msg.slot)
                elif isinstance(msg, UseRing):
                    self.use_ring(msg)
                elif isinstance(msg, Place):
                    self.place(msg.task_id, msg.slot)
                elif isinstance(msg, Discard):
                    self.pending.pop(msg.task_id, None)
                    self.early.discard(msg.task_id)
                    self.rng_after.pop(msg.task_id, None)
                    self.data_after.pop(msg.task_id, None)
                elif isinstance(msg, Setup):
                    self.setup(msg)
                elif isinstance(msg, NewEpoch):
                    self.new_epoch(msg.shared_seed)
                elif isinstance(msg, Exit):
                    return
                else:
                    raise TypeError(f"DataLoader worker: unexpected message {msg!r:.200}")
        except KeyboardInterrupt:
            pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # the main process closed our pipes: it is shutting down

    def use_ring(self, msg):
        fd = msg.fd
        if fd is None:
            fd = reduction.recv_handle(self.ring_conn)
            os.set_inheritable(fd, False)  # as the memfd was made: a program this worker runs gets no ring
            self.ring_conn.close()  # one ring per pool: nothing else comes over it
        try:
            self.ring = _C.Ring(msg.nslots, msg.slot_bytes, fd=fd)  # which owns fd from here on
        except BaseException:
            os.close(fd)
            raise
        self.slot_u8 = [torch.frombuffer(self.ring.view(i), dtype=torch.uint8) for i in range(msg.nslots)]
        self.layout, self.meta_bytes = msg.layout, msg.meta_bytes

    def slot_tensor(self, slot):
        if slot not in self.faulted:
            self.ring.prefault(slot)  # one madvise instead of a page fault per 4 kB during the copy
            self.faulted.add(slot)
        return self.slot_u8[slot]

    def new_epoch(self, shared_seed):
        """Persistent workers: drop the last epoch's kept batches, start the iterator anew."""
        self.dataset = _with_shared_seed(self.dataset, shared_seed)
        self.pending.clear()
        self.early.clear()
        self.rng_after.clear()
        self.data_after.clear()
        self.iteration_end = False
        states = rng_state()  # where this epoch starts: what a resumed or replaced worker is given
        self.fetcher = self.new_fetcher()
        self.send(EpochStarted(self.worker_id, states))

    def setup(self, msg):
        try:
            if msg.rng is not None:
                set_rng_state(msg.rng)
        except Exception:  # e.g. a state from another torch version: said at the next task
            self.init_error = ExceptionWrapper(where=f"{self.where} setting the RNG states of a resumed epoch")
        if self.init_error is not None:
            return
        if msg.data is not None:  # a Stateful dataset: set where it stood instead of replaying
            self.iteration_end = False
            try:
                self.fetcher = load_dataset_state(self.dataset, msg.data, self.new_fetcher)
            except Exception:
                self.init_error = ExceptionWrapper(where=f"{self.where} loading the dataset's state_dict()")
                return
        elif msg.recreate and self.spec.dataset_kind == DatasetKind.Iterable:
            self.iteration_end = False
            self.fetcher = self.new_fetcher()
        if msg.replay or msg.expect_stop:
            self.iteration_end, self.init_error = _replay(self.fetcher, msg.replay_index, msg.replay,
                                                          msg.expect_stop, self.where)

    def fetch(self, task_id, index, slot):
        if self.iteration_end:
            return  # as torch: tasks after the end of an IterableDataset are dropped
        t0 = time.perf_counter()
        if self.init_error is not None:
            outcome, self.init_error = Failed(self.init_error), None
        else:
            try:
                if self.fast and slot >= 0:
                    outcome = self.load_samples(index, slot)
                    if isinstance(outcome, _Samples):
                        outcome = self.write_samples(outcome.samples, slot, outcome.placed)
                elif slot >= 0:
                    outcome = self.write_collated(self.fetcher.fetch(index), slot)
                elif self.fast and self.ring is None:
                    outcome = self.load_samples(index, early_task=task_id)
                else:
                    outcome = WholeBatch(self.fetcher.fetch(index))
            except StopIteration:
                if self.spec.dataset_kind != DatasetKind.Iterable:
                    outcome = Failed(ExceptionWrapper(where=self.where))
                else:
                    outcome = Ended()
                    self.iteration_end = True
            except Exception:
                outcome = Failed(ExceptionWrapper(where=f"{self.where} while loading indices {_short(index)}"))
        busy = time.perf_counter() - t0
        self.rng_after[task_id] = rng_state()
        try:
            # taken with the batch, kept by the main process once the batch is handed out: the state
            # then matches what the consumer has, not what the workers made ahead
            data = dataset_state(self.dataset, self.fetcher)
        except Exception:
            data = None
            outcome = Failed(ExceptionWrapper(where=f"{self.where} in the dataset's state_dict()"))
        if data is not None:
            self.data_after[task_id] = data
        if task_id in self.early:
            self.pending[task_id] = (outcome, busy)  # its layout is on its way: wait for Place
            return
        if isinstance(outcome, _Samples):
            outcome = self.collate(outcome.samples)  # no early layout (the fast plan gave up)
        if slot < 0 and self.ring is None and isinstance(outcome, WholeBatch):
            # no ring yet: say what the batch looks like and keep it until the main process has
            # sized the ring from it and names the slot (Place)
            tensors = []
            spec = flatten(outcome.batch, tensors)
            sizes = [leaf_bytes(t) for t in tensors]
            self.pending[task_id] = (outcome, busy)
            self.send(Layout(task_id, sizes, len(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))))
            return
        self.finish(task_id, slot, outcome, busy)

    def load_samples(self, index, slot=-1, early_task=None):
        """_Samples([dataset[i] for i in index], placed), or Failed naming the index that raised.
        With a slot, each sample goes into its rows as soon as it is made (SlotRows; placed: how
        many did). early_task: a batch begun before the ring existed, whose layout is sent from its
        first sample (it keeps its samples until its slot is named)."""
        samples, rows, n = [], None, len(index)
        for i in index:
            try:
                sample = self.dataset[i]
            except Exception:
                return Failed(ExceptionWrapper(where=f"{self.where} at dataset[{i!r}]"))
            if not samples:
                try:
                    plan = sample_plan(sample)
                except FastPathDeclined:
                    plan = None  # default_collate's general way: no rows, no early layout
                if plan is not None and early_task is not None:
                    self.send_early_layout(early_task, n, sample, plan)
                if plan is not None and slot >= 0:
                    rows = SlotRows(plan, sample, n, self.slot_tensor(slot), self.layout)
            samples.append(sample if rows is None else rows.put(sample))
        return _Samples(samples, rows.placed if rows is not None else 0)

    def send_early_layout(self, task_id, n, first, plan):
        # the ring is sized from the first sample's layout, while the rest of the batch is still being
        # made: the main process makes (and page-locks) it meanwhile, and this batch goes straight in
        sizes, side_bytes = plan_layout(plan, first, n)
        self.send(Layout(task_id, sizes, side_bytes))
        self.early.add(task_id)

    def collate(self, samples):
        """The batch default_collate makes of the samples, or Failed with its error (a sample it
        rejects: the consumer gets that error, as from torch's worker, and the worker lives on)."""
        try:
            return WholeBatch(collate_no_shm(samples))
        except Exception:
            return Failed(ExceptionWrapper(where=self.where))

    def write_samples(self, samples, slot, placed):
        """The batch default_collate would make of `samples`, written into the slot."""
        writer = SlotWriter(self.slot_tensor(slot), self.layout)
        try:
            return SlotBatch(write_fast(samples, writer, placed), writer.leaves)
        except FastPathDeclined:
            pass
        # default_collate's general way, outside the handler: the error it raises (ragged shapes)
        # reaches the user alone, not chained to the fast path's internal refusal
        return self.write_collated(collate_no_shm(samples), slot)

    def write_collated(self, batch, slot):
        writer = SlotWriter(self.slot_tensor(slot), self.layout)
        return SlotBatch(write_general(batch, writer), writer.leaves)

    def place(self, task_id, slot):
        """The main process named the slot for a batch made before the ring existed (-1: no ring)."""
        outcome, busy = self.pending.pop(task_id, (None, 0.0))
        self.early.discard(task_id)
        if outcome is None:
            # it was given to this worker anew, or its outcome went through the pipe (placed when
            # the ring was made, before its layout): the main process has given that slot back
            return
        if isinstance(outcome, _Samples) and slot < 0:
            outcome = self.collate(outcome.samples)
        elif not isinstance(outcome, Failed) and slot >= 0:
            try:
                if isinstance(outcome, _Samples):
                    outcome = self.write_samples(outcome.samples, slot, outcome.placed)
                else:
                    outcome = self.write_collated(outcome.batch, slot)
            except Exception:
                outcome = Failed(ExceptionWrapper(where=self.where))
        self.finish(task_id, slot, outcome, busy)

    def finish(self, task_id, slot, outcome, busy):
        outcome = dataclasses.replace(outcome, busy=busy, rng=self.rng_after.pop(task_id, None),
                                      data=self.data_after.pop(task_id, None))
        if slot < 0:
            self.send(Result(task_id, outcome))
            return
        meta = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        if len(meta) <= self.meta_bytes:
            self.slot_u8[slot][:len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
            self.ring.publish(slot, task_id, self.worker_id, len(meta), 0)
        else:
            # publish first, then send: the main process reads the pipe once it sees the flag
            self.ring.publish(slot, task_id, self.worker_id, 0, _C.RING_FLAG_OVERFLOW)
            self.send(Overflow(task_id, outcome))


def _replay(fetcher, index, count, expect_stop, where):
    """Fetch and drop the `count` batches (and the end, with expect_stop) that this worker's
    IterableDataset produced before: for a resumed epoch or in place of a dead worker. Returns
    (iteration ended, an error for the next task if the iteration did not go as it went before)."""
    problem = None
    for i in range(count):
        try:
            fetcher.fetch(index)
        except StopIteration:
            problem = f"ended after {i} batches, where it had produced {count} before"
            break
        except Exception:
            pass  # it raised there before too: that error was delivered then
    else:
        if not expect_stop:
            return False, None
        try:
            fetcher.fetch(index)
            problem = f"went on after {count} batches, where it had ended before"
        except StopIteration:
            return True, None
        except Exception:
            problem = f"raised after {count} batches, where it had ended before"
    try:
        raise RuntimeError(f"replaying the IterableDataset to where this worker stood, its iteration {problem}; "
                           "it must be a function of the worker's seed and get_worker_info()")
    except RuntimeError:
        return False, ExceptionWrapper(where=where)


def _short(index, limit=16):
    try:
        items = list(index)
    except TypeError:
        return repr(index)
    if len(items) <= limit:
        return repr(items)
    return repr(items[:limit])[:-1] + f", ... ({len(items)} in all)]"
