"""Samples of a fast-path batch copied into their rows of the ring slot as they are made.

write_fast stacks a batch's samples into the slot once all of them exist. Holding them until then
costs a worker fresh memory for every sample that is not a view (a flipped crop: 150 kB, mapped and
zeroed page by page), and a second pass over the batch once it is cold in the cache. SlotRows copies
each sample's tensor and array leaves into their rows at once and hands back the sample with those
leaves replaced by views of the rows: the sample's own memory is freed before the next one is made,
and write_fast then skips the rows already in place (placed=). The batch is the same: the slot's
leaf order and offsets are write_fast's, and the samples (now partly views of the slot) still go to
default_collate whenever write_fast gives up, which reads the rows before anything is rewritten.

Only a prefix of the batch is placed: the first sample that does not match the plan ends the
placing (write_fast then gives up on it as it would have). One difference from torch remains: a
dataset that rewrites, in place, a tensor it returned for an earlier sample of the same batch gets
the values as they were when returned here, where torch's collate stacks the rewritten ones.
"""
import torch

from ..ring.layout import plan_layout, row_tensor


class SlotRows:
    """The rows of one slot for a batch of n samples shaped like `first` (plan: its sample_plan)."""

    def __init__(self, plan, first, n, slot_u8, layout):
        self.placed = 0  # samples 0..placed-1 are in their rows
        self.open = False  # whether the slot takes write_fast's layout: set below
        sizes, _ = plan_layout(plan, first, n)
        # every ring leaf fits its place: then write_fast puts leaf k at layout[k], as placed here
        if len(sizes) > len(layout) or any(nbytes > cap for nbytes, (_, cap) in zip(sizes, layout)):
            return
        self._leaf = 0
        self.dest = self._dest(plan, slot_u8, layout, n)
        self.open = True

    def _dest(self, p, slot_u8, layout, n):
        """The plan with each row leaf's (n, *shape) region of the slot, in write_fast's leaf order."""
        kind = p[0]
        if kind == "row":
            off = layout[self._leaf][0]
            self._leaf += 1
            shape, dtype = (n,) + p[1], p[2]
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            return ("row", slot_u8[off:off + nbytes].view(dtype).view(shape), p[1], dtype, p[3])
        if kind == "scalar":
            self._leaf += 1  # a tensor of the batch's numbers takes the next leaf (plan_layout sized it)
            return p
        if kind == "list":
            return p
        if kind == "dict":
            return ("dict", [(key, self._dest(sub, slot_u8, layout, n)) for key, sub in p[1]])
        return (kind, p[1], [self._dest(sub, slot_u8, layout, n) for sub in p[2]])

    def put(self, sample):
        """The sample with its rows in the slot (as views), if it is the next one and matches the
        plan; else the sample itself, and no later sample is placed."""
        if not self.open:
            return sample
        if not _matches(self.dest, sample):
            self.open = False
            return sample
        j = self.placed
        self.placed += 1
        return _copy_in(self.dest, sample, j)


def _matches(d, value):
    """value is batched by default_collate as write_fast expects (the checks write_fast makes)."""
    kind = d[0]
    if kind == "row":
        try:
            return row_tensor(value, d[2], d[3], d[4]) is not None
        except TypeError:  # a numpy dtype torch has no type for: write_fast's general path says so
            return False
    if kind in ("scalar", "list"):
        return True
    if kind == "dict":
        return type(value) is dict and all(key in value and _matches(sub, value[key]) for key, sub in d[1])
    subs = d[2]
    return type(value) is d[1] and len(value) == len(subs) and all(_matches(s, v) for s, v in zip(subs, value))


def _copy_in(d, value, j):
    """value with its row leaves copied into row j and replaced by views of it (new containers:
    the dataset's own dicts and lists are never changed)."""
    kind = d[0]
    if kind == "row":
        dst = d[1][j]
        dst.copy_(row_tensor(value, d[2], d[3], d[4]))
        return dst.numpy() if d[4] else dst
    if kind in ("scalar", "list"):
        return value
    if kind == "dict":
        out = dict(value)  # keys past the plan's stay (default_collate ignores them, as write_fast does)
        for key, sub in d[1]:
            out[key] = _copy_in(sub, value[key], j)
        return out
    items = [_copy_in(sub, v, j) for sub, v in zip(d[2], value)]
    if kind == "namedtuple":
        return d[1](*items)
    return d[1](items)
