"""An optimizer's gradients split by device: the dense float32/float16/bfloat16 ones in a kernel table, the rest through torch's ops.

The kernels walk a table of (pointer, element count) pairs, so they can only take gradients whose
elements are exactly the ``numel()`` ones from ``data_ptr()`` on. Everything torch's GradScaler also
takes goes the slow way here, with torch's own ops and without a host sync: sparse gradients (their
``_values()``), views with gaps or overlaps a user assigned (``p.grad = big[:, :5]``, changed in
place so that the view's owner sees the unscaled values), and float64 gradients. Their findings
reach the kernels' epilogue as one *extra* partial per device (norm accumulator, found flag, first
bad parameter), so one skip decision covers both kinds.
"""
import math

import torch

from .. import _C
from . import sharded, tensor_table

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD_DTYPES = KERNEL_DTYPES + (torch.float64,)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


class DeviceGrads:
    """One device's share of an optimizer's gradients. `table` (a GradientTable, or None) holds the dense
    ones; `others` are the flat indices of parameters whose gradient takes torch's ops, read from the
    parameter at each use (checking a float16 sparse gradient replaces it by its coalesced form)."""

    __slots__ = ("device", "device_index", "table", "dense_index", "others", "others_index", "stream", "report")

    def __init__(self, device, dense, dense_index, others, stream, report):
        self.device = device
        self.device_index = device.index if device.type == "cuda" else -1
        self.table = tensor_table.GradientTable(None, dense, dense_index, device, stream) if dense else None
        self.dense_index = dense_index
        self.others = others
        # the others' parameter indices as floats on the device, for the extra partial's first-bad slot
        self.others_index = torch.tensor(others, dtype=torch.float32).to(device) if others else None
        self.stream = stream
        self.report = report


def split(grads):
    """{device: (dense gradients, their parameter indices, other parameter indices)}, devices in order of
    first appearance. Raises TypeError/ValueError, before anything runs, for a gradient no path can take."""
    by_device = {}
    for i, g in enumerate(grads):
        if g is None:
            continue
        if g.layout not in (torch.strided, torch.sparse_coo):
            raise TypeError(f"parameter {i}: expected a strided or sparse COO gradient, got layout {g.layout}")
        if g.dtype not in GRAD_DTYPES:
            raise TypeError(f"parameter {i}: expected a float32, float16, bfloat16 or float64 gradient, got "
                            f"{_dtype_name(g.dtype)}")
        if g.device.type not in ("cuda", "cpu"):
            raise ValueError(f"parameter {i}: expected a gradient on a cuda or cpu device, got one on {g.device}")
        if g.layout is torch.strided and any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape)):
            # torch cannot unscale one in place either (its unscale_ raises): say so before anything runs
            raise ValueError(f"parameter {i}: expected a gradient whose elements do not overlap, got strides "
                             f"{g.stride()} for shape {tuple(g.shape)} (an expand()ed tensor?); assign a .clone()")
        dense, index, others = by_device.setdefault(g.device, ([], [], []))
        if g.layout is torch.strided and g.dtype in KERNEL_DTYPES and tensor_table.is_dense(g):
            dense.append(g)
            index.append(i)
        else:
            others.append(i)
    return by_device


def values(param, coalesce):
    """The tensor whose elements are param's gradient values: the gradient itself, or a sparse one's
    _values(). With `coalesce` a sparse gradient with repeated indices is first replaced by its
    coalesced form (the sum of repeats is what the optimizer will see, and may overflow alone).
    A DTensor gradient's values are its local shard's."""
    g = param.grad
    if not g.is_sparse:
        return sharded.local(g)
    if coalesce and not g.is_coalesced():
        param.grad = g = g.coalesce()
    return g._values()


def _norm_acc(u, mode, p):
    """u's share of the norm before its root, in float64: what the kernels' partials hold."""
    u = u.double()
    if mode == _C.AMP_NORM_L2:
        return u.square().sum()
    if mode == _C.AMP_NORM_INF:
        return torch.linalg.vector_norm(u, math.inf)  # NaN wins, as in the kernels
    return u.abs().pow(p).sum()


def measure(params, dg, inv, write, mode, p):
    """The extra partial (AMP_EXTRA_LEN float32 on dg.device) of dg's other gradients, as the kernels
    measure theirs: the values times `inv` (a 0-dim float32 tensor on the device, or None: already
    unscaled), rounded to the gradient's dtype, checked for inf/NaN and added to the norm. With `write`
    the unscaled values are stored, in place. No host sync."""
    return measure_these(params, dg.others, dg.others_index, dg.device, inv, write, mode, p)


def measure_these(params, indices, index_on_device, device, inv, write, mode, p):
    """measure() for the gradients of params[i] for i in `indices` (as floats on the device:
    `index_on_device`), whatever their layout."""
    bad, accs = [], []
    for i in indices:
        # float16 sparse gradients as torch checks them; any sparse one for a norm (of the sum of repeats)
        v = values(params[i], coalesce=params[i].grad.dtype is torch.float16 or mode != _C.AMP_NORM_NONE)
        if inv is None:
            u = v
        elif write:
            u = v.mul_(inv)  # in place: a view's owner sees the unscaled values, as with torch
        else:
            u = v * inv  # a 0-dim float32 factor keeps v's dtype: rounded as the kernels round
        bad.append(torch.isfinite(u).all().logical_not())
        if mode != _C.AMP_NORM_NONE:
            accs.append(_norm_acc(u, mode, p))
    bad = torch.stack(bad)
    extra = torch.empty(_C.AMP_EXTRA_LEN, dtype=torch.float32, device=device)
    if not accs:
        extra[_C.AMP_EXTRA_ACC] = 0.0
    elif mode == _C.AMP_NORM_INF:
        extra[_C.AMP_EXTRA_ACC] = torch.linalg.vector_norm(torch.stack(accs), math.inf)
    else:
        extra[_C.AMP_EXTRA_ACC] = torch.stack(accs).sum()
    found = bad.any()
    extra[_C.AMP_EXTRA_FOUND] = found
    # argmax of the flags is the first bad one (ties go to the lowest index)
    first = index_on_device[bad.to(torch.uint8).argmax()]
    extra[_C.AMP_EXTRA_PARAM] = torch.where(found, first, torch.full_like(first, -1.0))
    return extra


def apply(params, dg, aux, unscale, clip):
    """Multiply dg's other gradients by the factors in `aux` (a check's epilogue), rounding after each
    as the kernels' apply pass does, unless aux says the step is skipped. No host sync."""
    one = torch.ones((), dtype=torch.float32, device=dg.device)
    skip = aux[_C.AMP_AUX_FOUND] != 0
    inv = torch.where(skip, one, aux[_C.AMP_AUX_INV_SCALE])
    coef = torch.where(skip, one, aux[_C.AMP_AUX_CLIP])
    for i in dg.others:
        v = values(params[i], coalesce=False)
        if unscale:
            v.mul_(inv)
        if clip:
            v.mul_(coef)
