"""LeafTransform: what the copy engine applies to a batch's leaves once copied (hotloop.Normalize,
a DataLoader's gpu_transform). The copy engine copies bytes and applies a leaf transform, nothing
else: a transform never sees the slot, the ring or a batch's structure, only leaves."""

__all__ = ["LeafTransform"]


class LeafTransform:
    """The hooks a leaf transform answers; a subclass implements them all."""

    def leaf_outputs(self, leaves) -> list:
        """Which of a batch's leaves ((dtype, shape) each, in order) it transforms: a list of bools.
        ValueError for one it cannot take, raised before any copy."""
        raise NotImplementedError

    def empty_leaf(self, dtype, shape, device, empty=None):
        """(the output for a leaf leaf_outputs took, the memory transform_leaf writes), made by
        `empty(shape, dtype)` (torch.empty on `device` by default)."""
        raise NotImplementedError

    def transform_leaf(self, src, mem, stream=None):
        """Write the transformed `src` into `mem` (empty_leaf's), queued on `stream` (a handle)."""
        raise NotImplementedError

    def transform(self, x):
        """A leaf of a batch that came whole (num_workers=0 without a ring, the pipe): transformed
        where it is."""
        raise NotImplementedError
