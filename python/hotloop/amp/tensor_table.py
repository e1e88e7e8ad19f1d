"""Packs many tensors into the table that hotloop._C reads: (data pointer, element count, dtype, device).

One bytes object per call lets one kernel launch walk any number of tensors. Only what C cannot see
from a pointer is checked here (layout, density); C checks dtypes, devices and pointers.
GradientTable is the GradScaler's form of it: uploaded to the device once, reused every step.
"""
import functools
import struct

import torch

from .. import _C

# enum hl_dtype of kernels/tensor_table.h, as C exports it: torch dtype -> code
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}


def runs_eagerly(fn):
    """Mark a function that reads tensors' addresses or calls hotloop._C: torch.compile runs it, and what
    it calls, as plain Python (a graph break, as torch's own GradScaler and optimizers take where they
    leave the graph), since a graph cannot hold an address. See NOTE [ hotloop under torch.compile ]."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


_DISABLED = {}


def _disabled(fn):
    # made on first use under torch.compile: torch.compiler.disable imports Dynamo, seconds that a
    # program which never compiles should not pay at `import hotloop`
    disabled = _DISABLED.get(fn)
    if disabled is None:
        disabled = _DISABLED[fn] = torch.compiler.disable(fn, reason="hotloop calls its C extension with "
                                                                      "tensors' addresses")
    return disabled


# NOTE [ hotloop under torch.compile ]
# Dynamo cannot trace what hotloop does to tensors: it packs their data_ptr()s into bytes and hands
# them to C, which a graph of fake tensors has no address for (tracing struct.pack over them recursed
# until Python gave up). So every entry point that reaches _C through addresses is marked runs_eagerly:
# the scaler's unscale_, clip_grad_norm_, step, update and the rest, the table packers here (so that
# any caller of them, hotloop.optim included, breaks the graph there rather than fail). The model's
# forward and backward and scale(loss) stay in the compiled graph, and a compiled training step gives
# the numbers of the eager one.


def as_tensor_list(tensors, argname="tensors"):
    """A tensor, or an iterable of tensors, as a list; anything else is a TypeError."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        items = list(tensors)
    except TypeError:
        raise TypeError(f"{argname}: expected a tensor or an iterable of tensors, "
                        f"got {type(tensors).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{argname}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    return items


def is_dense(t) -> bool:
    """Non-overlapping and without gaps (contiguous in some order of its dimensions, e.g. a
    channels_last gradient): its numel() elements are the ones from data_ptr() on, which is all an
    elementwise kernel over the table needs."""
    if t.is_contiguous():
        return True
    dims = sorted((stride, size) for stride, size in zip(t.stride(), t.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def pack(tensors, argname="tensors"):
    """The packed table of `tensors` (a list of torch.Tensor) as bytes, after checking each."""
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:
            raise TypeError(f"{argname}[{i}]: expected a dense (strided) tensor, got layout {t.layout}")
        if not is_dense(t):
            raise ValueError(f"{argname}[{i}]: expected a dense tensor (contiguous in some order of its "
                             f"dimensions), got strides {t.stride()} for shape {tuple(t.shape)} "
                             f"(call .contiguous() first)")
    return packed_bytes(tensors)


@runs_eagerly
def packed_bytes(tensors):
    """The packed table of tensors the caller has already checked (strided and dense)."""
    fields = []
    for t in tensors:
        fields += (t.data_ptr(), t.numel(), DTYPE_CODES.get(t.dtype, _C.DTYPE_UNKNOWN), t.get_device())
    return struct.pack(f"{len(fields)}q", *fields)


def upload(nbytes, device, write):
    """(a table of `nbytes` on `device`, what `write` returned): `write(host)` fills a host uint8 tensor,
    page-locked for a CUDA table, which reaches the device in one non-blocking copy on the current stream
    (NOTE [ Table uploads ] in csrc/cuda.h); a CPU table is that host tensor itself."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    written = write(host)
    if not cuda:
        return host, written
    table = torch.empty(nbytes, dtype=torch.uint8, device=device)
    table.copy_(host, non_blocking=True)
    return table, written


def device_scratch(count, device):
    """Device memory for `count` table entries, from torch's caching allocator on the current stream."""
    return torch.empty(count * _C.TABLE_ENTRY_BYTES, dtype=torch.uint8, device=device)


class GradientTable:
    """The gradients of one optimizer as the GradScaler's kernels read them: packed with the index of
    each one's parameter (for the overflow report), uploaded once and reused every step while `key`
    (their data pointers) holds; `partials` are the check pass's per-chunk sums."""

    __slots__ = ("key", "count", "total_chunks", "device", "device_index", "table", "table_ptr", "index_ptr",
                 "partials", "partials_ptr", "stream")

    @runs_eagerly
    def __init__(self, key, grads, param_index, device, stream):
        count = len(grads)
        packed = packed_bytes(grads)  # the scaler checked them, naming parameters
        index = struct.pack(f"{count}i", *param_index)
        nbytes = count * (_C.TABLE_ENTRY_BYTES + 4)
        table, written = upload(nbytes, device, lambda host: _C.amp_table_pack(packed, index, host))
        self.count, self.total_chunks, _numel, self.device_index = written
        self.key = key
        self.device = device
        self.table = table
        self.table_ptr = table.data_ptr()
        self.index_ptr = self.table_ptr + count * _C.TABLE_ENTRY_BYTES
        # zeroed once so that nothing reads garbage; every check rewrites the partials it uses
        self.partials = torch.zeros(max(2 * self.total_chunks, 2), dtype=torch.float32, device=device)
        self.partials_ptr = self.partials.data_ptr()
        self.stream = stream
