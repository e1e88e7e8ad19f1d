"""The worker side of hotloop.DataLoader: a process that runs dataset[i] and writes batches into the ring.

A worker is seeded, named and given `get_worker_info()` exactly as torch's `_worker_loop` does, so
random transforms in `__getitem__` draw the same numbers as they would under torch's DataLoader.
Map-style batches with the default collate are written sample by sample straight into the slot (the
one host copy); anything else is collated as torch would (without torch's /dev/shm storage) and its
tensors copied in. Leaves that are not fixed-shape CPU tensors travel in the slot's pickled metadata.

Messages, main -> worker over a pipe: ("task", task_id, index, slot), ("ring", path, nslots,
slot_bytes, layout, meta_bytes), ("place", task_id, slot), ("resume",), ("setup", rng, recreate,
replay, expect_stop, index) (before any task: set the RNG states, make the iterator anew, fetch and
drop `replay` batches: a resumed epoch or a replaced worker), None (exit). Worker -> main over another
pipe, pickled with plain pickle (never ForkingPickler, which would move tensors through /dev/shm):
("layout", task_id, tensor_bytes, spec_bytes) for a batch made before the ring existed (the main
process sizes the ring from the first; on the fast path it is sent as soon as the batch's first
sample exists, so the ring is made while the rest of the batch is), ("batch", task_id, batch, busy,
rng) when there is no ring at all, ("meta", task_id, bytes) for metadata that did not fit its slot,
("error", task_id, ExceptionWrapper, rng), ("stop", task_id, rng) and ("resumed", worker_id, rng).

When it makes the ring, the main process sends "place" for every task without a slot right behind
"ring", without waiting for their layouts: a worker finds it in its pipe once its batch is done and
writes the batch straight in (the layout it sent is then ignored). An outcome that takes the pipe
instead (an error or a stop before any layout was sent) is never written to that slot: a worker
writes a placed slot only for a batch it kept in `pending`, and the main process gives the slot back
when the outcome comes.

A slot's metadata is the outcome plus (busy, rng). `rng` is `rng_state()` right after the task: the
main process keeps the one of the last batch it handed out from each worker, for state_dict().
"""
import array
import os
import pickle
import random
import signal
import struct
import time

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _utils
from torch.utils.data._utils.collate import collate, default_collate, default_collate_fn_map

from . import _C

# leaf kinds of the fixed layout; numbers are part of the slot metadata
_TENSOR, _SIDE = "T", "O"
_DICT, _LIST, _TUPLE, _NAMEDTUPLE = "D", "L", "U", "N"


def _stack_no_shm(batch, *, collate_fn_map=None):
    # torch's collate_tensor_fn puts worker batches in /dev/shm storage; here plain memory is enough
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:
        return default_collate_fn_map[torch.Tensor](batch, collate_fn_map=collate_fn_map)
    return torch.stack(batch, 0)


_COLLATE_MAP = dict(default_collate_fn_map)
_COLLATE_MAP[torch.Tensor] = _stack_no_shm


def collate_no_shm(batch):
    """default_collate, value for value, without shared-memory storage for the stacked tensors."""
    return collate(batch, collate_fn_map=_COLLATE_MAP)


def is_ring_tensor(x) -> bool:
    return (type(x) is torch.Tensor and x.layout == torch.strided and x.device.type == "cpu"
            and not x.is_nested and not x.requires_grad and not x.is_quantized)


def flatten(obj, tensors):
    """The batch as a spec tree; CPU tensors are replaced by their index in `tensors` (appended)."""
    t = type(obj)
    if is_ring_tensor(obj):
        tensors.append(obj)
        return (_TENSOR, len(tensors) - 1)
    if t is dict:
        return (_DICT, [(k, flatten(v, tensors)) for k, v in obj.items()])
    if t is list:
        return (_LIST, [flatten(v, tensors) for v in obj])
    if t is tuple:
        return (_TUPLE, [flatten(v, tensors) for v in obj])
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return (_NAMEDTUPLE, t, [flatten(v, tensors) for v in obj])
    return (_SIDE, obj)


def unflatten(spec, leaves):
    kind = spec[0]
    if kind == _TENSOR:
        return leaves[spec[1]]
    if kind == _SIDE:
        return spec[1]
    if kind == _DICT:
        return {k: unflatten(v, leaves) for k, v in spec[1]}
    if kind == _LIST:
        return [unflatten(v, leaves) for v in spec[1]]
    if kind == _TUPLE:
        return tuple(unflatten(v, leaves) for v in spec[1])
    return spec[1](*(unflatten(v, leaves) for v in spec[2]))


class _Abort(Exception):
    """The fast path cannot reproduce default_collate for this batch: take the general path."""


def _sample_plan(elem):
    """How default_collate treats one sample: a tree whose leaves say how each leaf is batched."""
    import numpy as np

    t = type(elem)
    if t is torch.Tensor:
        if not is_ring_tensor(elem):
            raise _Abort
        return ("row", tuple(elem.shape), elem.dtype, False)
    if t is np.ndarray:
        if elem.dtype.kind in "SaUO":
            raise _Abort
        try:
            dtype = torch.as_tensor(elem).dtype
        except Exception:
            raise _Abort from None  # default_collate raises it: let the general path do so
        return ("row", tuple(elem.shape), dtype, True)
    if isinstance(elem, (np.bool_, np.number)):
        return ("scalar", torch.as_tensor)
    if isinstance(elem, float):
        return ("scalar", _float_batch)
    if isinstance(elem, int):
        return ("scalar", torch.tensor)
    if isinstance(elem, (str, bytes)):
        return ("list",)
    if t is dict:
        return ("dict", [(k, _sample_plan(v)) for k, v in elem.items()])
    if t is tuple or t is list:
        return ("seq", t, [_sample_plan(v) for v in elem])
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return ("namedtuple", t, [_sample_plan(v) for v in elem])
    raise _Abort


def _float_batch(values):
    return torch.tensor(values, dtype=torch.float64)


class _SlotWriter:
    """Places tensors in the slot: leaf k of the layout at its offset, if it fits."""

    def __init__(self, slot_u8, layout):
        self.slot = slot_u8
        self.layout = layout  # [(offset, capacity)]
        self.leaves = []  # (offset, dtype, shape) per ring tensor, in spec order

    def region(self, shape, dtype):
        k = len(self.leaves)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if k >= len(self.layout) or nbytes > self.layout[k][1]:
            return None
        off = self.layout[k][0]
        self.leaves.append((off, dtype, tuple(shape)))
        return self.slot[off:off + nbytes].view(dtype).view(shape)

    def put(self, tensor):
        dst = self.region(tensor.shape, tensor.dtype)
        if dst is None:
            return None
        dst.copy_(tensor)
        return len(self.leaves) - 1


def write_general(batch, writer):
    """Spec of a collated batch, its tensors copied into the slot (or kept in the spec when they do not fit)."""
    tensors = []
    spec = flatten(batch, tensors)
    index_of = [writer.put(t) for t in tensors]

    def fix(s):
        kind = s[0]
        if kind == _TENSOR:
            k = index_of[s[1]]
            return (_TENSOR, k) if k is not None else (_SIDE, tensors[s[1]])
        if kind == _SIDE:
            return s
        if kind == _DICT:
            return (_DICT, [(key, fix(v)) for key, v in s[1]])
        if kind == _NAMEDTUPLE:
            return (_NAMEDTUPLE, s[1], [fix(v) for v in s[2]])
        return (kind, [fix(v) for v in s[1]])

    return fix(spec)


def row_tensor(v, shape, dtype, from_numpy):
    """v as the tensor that goes into one row of a (n, *shape) `dtype` leaf, or None when
    default_collate might batch it otherwise (another type, shape or dtype than the first sample's)."""
    if from_numpy:
        import numpy as np

        if type(v) is not np.ndarray or v.dtype.kind in "SaUO":
            return None
        v = torch.as_tensor(v)  # shares the array's memory
    elif not is_ring_tensor(v):
        return None
    return v if tuple(v.shape) == shape and v.dtype == dtype else None


def write_fast(samples, writer, placed=0):
    """default_collate(samples) written into the slot sample by sample, without the stacked copy.
    Raises _Abort whenever the result could differ from default_collate's. samples[:placed] are in
    their rows already, as SlotRows put them (loader_rows.py): their row leaves are not copied again."""
    n = len(samples)
    plan = _sample_plan(samples[0])

    def build(p, values):
        kind = p[0]
        if kind == "row":
            shape, dtype, from_numpy = p[1], p[2], p[3]
            dst = writer.region((n,) + shape, dtype)
            if dst is None:
                raise _Abort
            for j in range(placed, n):
                v = row_tensor(values[j], shape, dtype, from_numpy)
                if v is None:
                    raise _Abort
                dst[j].copy_(v)
            return (_TENSOR, len(writer.leaves) - 1)
        if kind == "scalar":
            out = p[1](list(values))
            k = writer.put(out) if is_ring_tensor(out) else None
            return (_TENSOR, k) if k is not None else (_SIDE, out)
        if kind == "list":
            return (_SIDE, values)  # collate_str_fn returns its input: a list, or a tuple from zip
        if kind == "dict":
            if any(type(v) is not dict for v in values):
                raise _Abort
            try:
                return (_DICT, [(key, build(sub, [v[key] for v in values])) for key, sub in p[1]])
            except KeyError:
                raise _Abort from None
        t, subs = p[1], p[2]
        if any(type(v) is not t or len(v) != len(subs) for v in values):
            raise _Abort
        children = [build(sub, tuple(v[i] for v in values)) for i, sub in enumerate(subs)]  # as zip(*batch)
        if kind == "namedtuple":
            return (_NAMEDTUPLE, t, children)
        return (_LIST, children)  # default_collate turns tuples and lists of samples into lists

    return build(plan, samples)


def plan_layout(plan, first, n):
    """(bytes of each ring leaf, in the order write_fast places them; bytes of the side objects) of a
    batch of n samples shaped like `first`, from its _sample_plan: what the ring is sized from."""
    sizes, side = [], [0]

    def walk(p, value):
        kind = p[0]
        if kind == "row":
            sizes.append(n * torch.Size(p[1]).numel() * p[2].itemsize)
        elif kind == "scalar":
            out = p[1]([value])
            if is_ring_tensor(out):
                sizes.append(n * out.element_size())
            else:
                side[0] += n * len(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        elif kind == "list":
            side[0] += n * len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        elif kind == "dict":
            for key, sub in p[1]:
                walk(sub, value[key])
        else:
            for sub, v in zip(p[2], value):
                walk(sub, v)

    walk(plan, first)
    return sizes, side[0]


def _seed_like_torch(base_seed, worker_id):
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(_utils.worker._generate_state(base_seed, worker_id))
    except ImportError:
        pass
    return seed


_RNG_HEAD = struct.Struct("<HI")  # format version, bytes of torch's state
_PY_RNG = struct.Struct("<?d")  # random's cached gauss: present, value
_NP_RNG = struct.Struct("<iid")  # numpy's position, has_gauss, cached_gaussian
_MT_WORDS = 624


def rng_state() -> bytes:
    """The process's global RNG states (torch's CPU generator, random, numpy's legacy one) as bytes:
    plain bytes pickle and torch.save cheaply (about 10 kB; 50 us to take, mostly numpy's getter)."""
    t = torch.get_rng_state().numpy().tobytes()
    version, words, gauss = random.getstate()
    if version != 3 or len(words) != _MT_WORDS + 1:
        raise ValueError(f"rng_state: unexpected random.getstate() version {version}")
    parts = [_RNG_HEAD.pack(1, len(t)), t, array.array("I", words).tobytes(),
             _PY_RNG.pack(gauss is not None, gauss or 0.0)]
    try:
        import numpy as np
    except ImportError:
        np = None
    state = np.random.get_state() if np is not None else None
    if type(state) is tuple and state[0] == "MT19937":  # else a bit generator set by the user: not ours
        _, keys, pos, has_gauss, cached = state
        parts += [keys.astype("<u4", copy=False).tobytes(), _NP_RNG.pack(pos, has_gauss, cached)]
    return b"".join(parts)


def set_rng_state(state: bytes) -> None:
    """Undo rng_state(): set the states it took (numpy's only if it was there and still is)."""
    fmt, tlen = _RNG_HEAD.unpack_from(state)
    if fmt != 1:
        raise ValueError(f"set_rng_state: unknown format {fmt}")
    off = _RNG_HEAD.size
    torch.set_rng_state(torch.frombuffer(bytearray(state[off:off + tlen]), dtype=torch.uint8))
    off += tlen
    words = array.array("I")
    words.frombytes(state[off:off + 4 * (_MT_WORDS + 1)])
    off += 4 * (_MT_WORDS + 1)
    has, gauss = _PY_RNG.unpack_from(state, off)
    off += _PY_RNG.size
    random.setstate((3, tuple(words), gauss if has else None))
    if off < len(state):
        try:
            import numpy as np
        except ImportError:
            return
        keys = np.frombuffer(state, dtype="<u4", count=_MT_WORDS, offset=off).astype(np.uint32)
        pos, has_gauss, cached = _NP_RNG.unpack_from(state, off + 4 * _MT_WORDS)
        np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


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


def worker_main(worker_id, num_workers, dataset_kind, dataset, auto_collation, collate_fn, drop_last, base_seed,
                init_fn, task_conn, result_conn, main_pid, fast_ok, inherited_fds=()):
    """The worker process: mirrors torch's _worker_loop, results go to the ring or the result pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    for fd in inherited_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    from .loader_rows import SlotRows  # it builds on this module

    torch.set_num_threads(1)
    seed = _seed_like_torch(base_seed, worker_id)
    _utils.worker._worker_info = _utils.worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                                          dataset=dataset)
    from torch.utils.data.dataloader import _DatasetKind

    fetch_collate = collate_no_shm if collate_fn is default_collate else collate_fn
    fast = fast_ok and collate_fn is default_collate and dataset_kind == _DatasetKind.Map and auto_collation \
        and not getattr(dataset, "__getitems__", None)
    where = f"in DataLoader worker process {worker_id}"
    init_exception = None
    fetcher = None
    try:
        if init_fn is not None:
            init_fn(worker_id)
        fetcher = _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, fetch_collate, drop_last)
    except Exception:
        init_exception = ExceptionWrapper(where=where)

    def send(msg):
        result_conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    ring = slot_u8 = None
    layout = []
    meta_cap = 0
    iteration_end = False
    # task id -> (outcome, busy seconds) of batches made before the ring existed: they wait for "place";
    # an outcome is ("samples", list, placed) (fast path, not collated yet), ("batch", collated) or ("error", ...)
    pending = {}
    early = set()  # tasks whose layout was sent from their first sample, before the batch was complete
    rng_after = {}  # task id -> rng_state() right after it, until its outcome is sent

    faulted = set()  # slots whose pages this process has faulted in

    def slot_tensor(slot):
        if slot not in faulted:
            ring.prefault(slot)  # one madvise instead of a page fault per 4 kB during the copy
            faulted.add(slot)
        return slot_u8[slot]

    def finish(task_id, slot, outcome, busy):
        rng = rng_after.pop(task_id, None)
        if slot < 0:
            if outcome[0] == "batch":
                send(("batch", task_id, outcome[1], busy, rng))
            elif outcome[0] == "stop":
                send(("stop", task_id, rng))
            else:
                send(("error", task_id, outcome[1], rng))
            return
        meta = pickle.dumps(outcome + (busy, rng), protocol=pickle.HIGHEST_PROTOCOL)
        if len(meta) <= meta_cap:
            slot_u8[slot][:len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
            ring.publish(slot, task_id, worker_id, len(meta), 0)
        else:
            # publish first, then send: the main process reads the pipe once it sees the flag
            ring.publish(slot, task_id, worker_id, 0, _C.RING_FLAG_OVERFLOW)
            send(("meta", task_id, meta))

    def load_samples(index, slot=-1, early_task=None):
        """("samples", [dataset[i] for i in index], placed), or ("error", ...) naming the index that
        raised. With a slot, each sample goes into its rows as soon as it is made (SlotRows; placed:
        how many did). early_task: a batch begun before the ring existed, whose layout is sent from
        its first sample (it keeps its samples until its slot is named)."""
        samples, rows, n = [], None, len(index)
        for i in index:
            try:
                sample = dataset[i]
            except Exception:
                return ("error", ExceptionWrapper(where=f"{where} at dataset[{i!r}]"))
            if not samples:
                try:
                    plan = _sample_plan(sample)
                except _Abort:
                    plan = None  # default_collate's general way: no rows, no early layout
                if plan is not None and early_task is not None:
                    send_early_layout(early_task, n, sample, plan)
                if plan is not None and slot >= 0:
                    rows = SlotRows(plan, sample, n, slot_tensor(slot), layout)
            samples.append(sample if rows is None else rows.put(sample))
        return ("samples", samples, rows.placed if rows is not None else 0)

    def write_samples(samples, slot, placed):
        """The batch default_collate would make of `samples`, written into the slot: its spec."""
        writer = _SlotWriter(slot_tensor(slot), layout)
        try:
            return write_fast(samples, writer, placed), writer.leaves
        except _Abort:
            writer = _SlotWriter(slot_u8[slot], layout)
            return write_general(collate_no_shm(samples), writer), writer.leaves

    def send_early_layout(task_id, n, first, plan):
        # the ring is sized from the first sample's layout, while the rest of the batch is still being
        # made: the main process makes (and page-locks) it meanwhile, and this batch goes straight in
        sizes, side_bytes = plan_layout(plan, first, n)
        send(("layout", task_id, sizes, side_bytes))
        early.add(task_id)

    def place(task_id, slot):
        """The main process named the slot for a batch made before the ring existed (-1: no ring)."""
        outcome, busy = pending.pop(task_id, (None, 0.0))
        early.discard(task_id)
        if slot == -2 or outcome is None:
            # the epoch it belonged to is over, it was given to this worker anew, or its outcome went
            # through the pipe (placed when the ring was made, before its layout): the main process
            # has given that slot back, it must not be written
            return
        kind = outcome[0]
        if kind == "samples" and slot < 0:
            outcome = ("batch", collate_no_shm(outcome[1]))
        elif kind != "error" and slot >= 0:
            try:
                if kind == "samples":
                    spec, leaves = write_samples(outcome[1], slot, outcome[2])
                else:
                    writer = _SlotWriter(slot_tensor(slot), layout)
                    spec, leaves = write_general(outcome[1], writer), writer.leaves
                outcome = ("ok", spec, leaves)
            except Exception:
                outcome = ("error", ExceptionWrapper(where=where))
        finish(task_id, slot, outcome, busy)

    try:
        while True:
            if not task_conn.poll(1.0):
                if os.getppid() != main_pid:
                    return  # the main process is gone
                continue
            try:
                msg = task_conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            if msg[0] == "ring":
                _, path, nslots, slot_bytes, layout, meta_cap = msg
                ring = _C.Ring(nslots, slot_bytes, path=path)
                views = [ring.view(i) for i in range(nslots)]
                slot_u8 = [torch.frombuffer(v, dtype=torch.uint8) for v in views]
                continue
            if msg[0] == "place":
                place(msg[1], msg[2])
                continue
            if msg[0] == "resume":
                pending.clear()
                early.clear()
                rng_after.clear()
                iteration_end = False
                states = rng_state()  # where this epoch starts: what a resumed or replaced worker is given
                fetcher = _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, fetch_collate,
                                                      drop_last)
                send(("resumed", worker_id, states))
                continue
            if msg[0] == "setup":
                _, rng, recreate, replay, expect_stop, replay_index = msg
                try:
                    if rng is not None:
                        set_rng_state(rng)
                except Exception:  # e.g. a state from another torch version: said at the next task
                    init_exception = ExceptionWrapper(where=f"{where} setting the RNG states of a resumed epoch")
                if init_exception is None:
                    if recreate and dataset_kind == _DatasetKind.Iterable:
                        iteration_end = False
                        fetcher = _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, fetch_collate,
                                                              drop_last)
                    if replay or expect_stop:
                        iteration_end, init_exception = _replay(fetcher, replay_index, replay, expect_stop, where)
                continue
            _, task_id, index, slot = msg
            if iteration_end:
                continue  # as torch: tasks after the end of an IterableDataset are dropped
            t0 = time.perf_counter()
            outcome = None
            if init_exception is not None:
                outcome, init_exception = ("error", init_exception), None
            else:
                try:
                    if fast and slot >= 0:
                        outcome = load_samples(index, slot)
                        if outcome[0] == "samples":
                            outcome = ("ok",) + write_samples(outcome[1], slot, outcome[2])
                    elif slot >= 0:
                        writer = _SlotWriter(slot_tensor(slot), layout)
                        outcome = ("ok", write_general(fetcher.fetch(index), writer), writer.leaves)
                    elif fast and ring is None:
                        outcome = load_samples(index, early_task=task_id)
                    else:
                        outcome = ("batch", fetcher.fetch(index))
                except StopIteration:
                    if dataset_kind != _DatasetKind.Iterable:
                        outcome = ("error", ExceptionWrapper(where=where))
                    else:
                        outcome = ("stop",)
                        iteration_end = True
                except Exception:
                    outcome = ("error", ExceptionWrapper(where=f"{where} while loading indices {_short(index)}"))
            busy = time.perf_counter() - t0
            rng_after[task_id] = rng_state()
            if task_id in early:
                pending[task_id] = (outcome, busy)  # its layout is on its way: wait for "place"
                continue
            if outcome[0] == "samples":
                outcome = ("batch", collate_no_shm(outcome[1]))  # no early layout (the fast plan gave up)
            if slot < 0 and ring is None and outcome[0] == "batch":
                # no ring yet: say what the batch looks like and keep it until the main process has
                # sized the ring from it and names the slot ("place")
                tensors = []
                spec = flatten(outcome[1], tensors)
                sizes = [t.numel() * t.element_size() for t in tensors]
                pending[task_id] = (outcome, busy)
                send(("layout", task_id, sizes, len(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))))
                continue
            finish(task_id, slot, outcome, busy)
            del outcome
    except KeyboardInterrupt:
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the main process closed our pipes: it is shutting down


def _short(index, limit=16):
    try:
        items = list(index)
    except TypeError:
        return repr(index)
    if len(items) <= limit:
        return repr(items)
    return repr(items[:limit])[:-1] + f", ... ({len(items)} in all)]"
