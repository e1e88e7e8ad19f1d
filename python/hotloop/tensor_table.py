"""Packs many tensors into the table that hotloop._C reads: (data pointer, element count, dtype, device).

One bytes object per call lets one kernel launch walk any number of tensors. Only what C cannot see
from a pointer is checked here (layout, density); C checks dtypes, devices and pointers.
"""
import struct

import torch

from . import _C

# codes of enum hl_dtype in kernels/tensor_table.h
DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.uint8: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float64: 6,
    torch.int8: 7,
    torch.int16: 8,
    torch.bool: 9,
    torch.complex64: 10,
    torch.complex128: 11,
}
UNKNOWN_DTYPE = -1
FLOATING_MASK = (1 << 0) | (1 << 1) | (1 << 2)


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


def packed_bytes(tensors):
    """The packed table of tensors the caller has already checked (strided and dense)."""
    fields = []
    for t in tensors:
        fields += (t.data_ptr(), t.numel(), DTYPE_CODES.get(t.dtype, UNKNOWN_DTYPE), t.get_device())
    return struct.pack(f"{len(fields)}q", *fields)


def device_scratch(count, device):
    """Device memory for `count` table entries, from torch's caching allocator on the current stream."""
    return torch.empty(count * _C.TABLE_ENTRY_BYTES, dtype=torch.uint8, device=device)
