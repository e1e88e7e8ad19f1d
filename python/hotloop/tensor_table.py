"""Packs many tensors into the table that hotloop._C reads: (data pointer, element count, dtype, device).

One bytes object per call lets one kernel launch walk any number of tensors. Only what C cannot see
from a pointer is checked here (layout, sparsity); C checks dtypes, devices and pointers.
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


def pack(tensors, argname="tensors"):
    """The packed table of `tensors` (a list of torch.Tensor) as bytes."""
    fields = []
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:
            raise TypeError(f"{argname}[{i}]: expected a dense (strided) tensor, got layout {t.layout}")
        if not t.is_contiguous():
            raise ValueError(f"{argname}[{i}]: expected a contiguous tensor, got one with strides "
                             f"{t.stride()} for shape {tuple(t.shape)} (call .contiguous() first)")
        fields += (t.data_ptr(), t.numel(), DTYPE_CODES.get(t.dtype, UNKNOWN_DTYPE), t.get_device())
    return struct.pack(f"{len(fields)}q", *fields)


def device_scratch(count, device):
    """Device memory for `count` table entries, from torch's caching allocator on the current stream."""
    return torch.empty(count * _C.TABLE_ENTRY_BYTES, dtype=torch.uint8, device=device)
