"""A batch as the ring holds it: a spec tree whose tensor leaves sit at fixed offsets of a slot.

Workers write batches into slots here: sample by sample straight into their rows (write_fast, when
the result is provably what default_collate would make), or a collated batch's tensors copied in
(write_general). Leaves that are not fixed-shape CPU tensors stay in the spec, which travels in the
slot's pickled metadata; unflatten rebuilds the batch from the spec and the leaves. A tensor whose
elements overlap (a stride 0 from expand(), a sliding window from as_strided) takes only the storage
its elements reach, and is rebuilt with its shape and strides: what torch's loader delivers (the
view), never numel elements written out (torch.zeros(1).expand(2**28) would be 1 GiB a batch).
"""
import pickle

import torch

from ..._torch_compat import collate, default_collate_fn_map

# leaf kinds of the spec tree (they travel in the slot metadata)
_TENSOR, _SIDE, _STRIDED = "T", "O", "S"  # _STRIDED: (kind, leaf, shape, stride) of an overlapping tensor
_DICT, _LIST, _TUPLE, _NAMEDTUPLE = "D", "L", "U", "N"


def spec_list(spec):
    """The child specs of a list node (what a collated list or tuple of samples is), or None for any
    other node."""
    return spec[1] if spec[0] == _LIST else None


def spec_dict(spec):
    """A dict node's {key: child spec}, or None for any other node."""
    return dict(spec[1]) if spec[0] == _DICT else None


def ring_leaf(spec):
    """The index, among the slot's leaves, of a tensor that lies whole in the slot; None for any other
    node (a side object, an overlapping tensor, a container)."""
    return spec[1] if spec[0] == _TENSOR else None


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


def reach(t):
    """Elements of its storage that the tensor's elements lie in, from its storage offset on: fewer
    than numel when elements overlap (torch's strides are never negative)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def overlaps(t) -> bool:
    return reach(t) < t.numel()


def leaf_bytes(t):
    """Bytes the tensor takes in a slot: its elements, or the storage they reach when they overlap."""
    return min(reach(t), t.numel()) * t.element_size()


def first_dim(spec, leaves, default):
    """A slot batch's samples as consumer.handout.batch_samples counts a batch's: the first dimension of its first
    tensor that has one (an overlapping tensor's leaf is its reached storage: its shape is in the spec)."""
    kind = spec[0]
    if kind == _TENSOR:
        shape = leaves[spec[1]][2]
        return int(shape[0]) if shape else None
    if kind == _STRIDED:
        return int(spec[2][0]) if spec[2] else None
    if kind == _SIDE:
        t = spec[1]
        return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
    children = [v for _, v in spec[1]] if kind == _DICT else spec[2] if kind == _NAMEDTUPLE else spec[1]
    for child in children:
        n = first_dim(child, leaves, None)
        if n is not None:
            return n
    return default


def _compact(t):
    """An overlapping tensor with the same shape, strides and values on a storage of only what it
    reaches (a side object pickles its whole storage)."""
    return t.as_strided((reach(t),), (1,)).clone().as_strided(t.shape, t.stride())


def unflatten(spec, leaves):
    kind = spec[0]
    if kind == _TENSOR:
        return leaves[spec[1]]
    if kind == _STRIDED:
        return leaves[spec[1]].as_strided(spec[2], spec[3])
    if kind == _SIDE:
        return spec[1]
    if kind == _DICT:
        return {k: unflatten(v, leaves) for k, v in spec[1]}
    if kind == _LIST:
        return [unflatten(v, leaves) for v in spec[1]]
    if kind == _TUPLE:
        return tuple(unflatten(v, leaves) for v in spec[1])
    return spec[1](*(unflatten(v, leaves) for v in spec[2]))


class FastPathDeclined(Exception):
    """The fast path cannot reproduce default_collate for this batch: take the general path."""


def sample_plan(elem):
    """How default_collate treats one sample: a tree whose leaves say how each leaf is batched."""
    import numpy as np

    t = type(elem)
    if t is torch.Tensor:
        if not is_ring_tensor(elem):
            raise FastPathDeclined
        return ("row", tuple(elem.shape), elem.dtype, False)
    if t is np.ndarray:
        if elem.dtype.kind in "SaUO":
            raise FastPathDeclined
        try:
            dtype = torch.as_tensor(elem).dtype
        except Exception:
            raise FastPathDeclined from None  # default_collate raises it: let the general path do so
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
        return ("dict", [(k, sample_plan(v)) for k, v in elem.items()])
    if t is tuple or t is list:
        return ("seq", t, [sample_plan(v) for v in elem])
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return ("namedtuple", t, [sample_plan(v) for v in elem])
    raise FastPathDeclined


def _float_batch(values):
    return torch.tensor(values, dtype=torch.float64)


class SlotWriter:
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
    """Spec of a collated batch, its tensors copied into the slot (or kept in the spec when they do
    not fit); of an overlapping tensor only the storage it reaches."""
    tensors = []
    spec = flatten(batch, tensors)
    lapped = [overlaps(t) for t in tensors]
    index_of = [writer.put(t.as_strided((reach(t),), (1,)) if lap else t) for t, lap in zip(tensors, lapped)]

    def fix(s):
        kind = s[0]
        if kind == _TENSOR:
            t, k = tensors[s[1]], index_of[s[1]]
            if k is None:
                return (_SIDE, _compact(t) if lapped[s[1]] else t)
            return (_STRIDED, k, tuple(t.shape), t.stride()) if lapped[s[1]] else (_TENSOR, k)
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
    Raises FastPathDeclined whenever the result could differ from default_collate's. samples[:placed] are in
    their rows already, as SlotRows put them (worker/rows.py): their row leaves are not copied again."""
    n = len(samples)
    plan = sample_plan(samples[0])

    def build(p, values):
        kind = p[0]
        if kind == "row":
            shape, dtype, from_numpy = p[1], p[2], p[3]
            dst = writer.region((n,) + shape, dtype)
            if dst is None:
                raise FastPathDeclined
            for j in range(placed, n):
                v = row_tensor(values[j], shape, dtype, from_numpy)
                if v is None:
                    raise FastPathDeclined
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
                raise FastPathDeclined
            try:
                return (_DICT, [(key, build(sub, [v[key] for v in values])) for key, sub in p[1]])
            except KeyError:
                raise FastPathDeclined from None
        t, subs = p[1], p[2]
        if any(type(v) is not t or len(v) != len(subs) for v in values):
            raise FastPathDeclined
        children = [build(sub, tuple(v[i] for v in values)) for i, sub in enumerate(subs)]  # as zip(*batch)
        if kind == "namedtuple":
            return (_NAMEDTUPLE, t, children)
        return (_LIST, children)  # default_collate turns tuples and lists of samples into lists

    return build(plan, samples)


def plan_layout(plan, first, n):
    """(bytes of each ring leaf, in the order write_fast places them; bytes of the side objects) of a
    batch of n samples shaped like `first`, from its sample_plan: what the ring is sized from."""
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

