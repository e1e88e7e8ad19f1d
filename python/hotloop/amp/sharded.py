"""Gradients sharded across ranks: which process groups the GradScaler's check reduces over, and the one gather.

Each rank's check pass sees only its shard of the gradients, so its found-inf flag and its share of the
norm are partial. Every rank adds one small collective per sharded dimension: an all-gather of each
rank's (norm accumulator, found flag, first bad parameter), which the epilogue then folds in rank
order. Every rank folds the same numbers in the same order, so all take bit-identical norms, clip
coefficients and skip decisions, and a NaN in one shard makes the inf-norm NaN on every rank, as
torch's clip of whole tensors does (the max all-reduce under torch's own DTensor clip can drop it:
gloo's does). On NCCL the collective is launched asynchronously and ``wait()`` only orders the current stream
after it: no host sync.

Which group: a ``process_group`` given to the scaler, for any gradients (a user's own sharded
optimizer); else, for DTensor gradients (FSDP2's ``fully_shard``), the device-mesh dimensions they are
sharded over (HSDP's replicate dimension is left out: its ranks hold the same shard). Plain
gradients without a process_group are replicated (DDP) or alone: no collective.
"""
import sys

import torch
import torch.distributed as dist

from .. import _C


_dtensor = None


def dtensor_type():
    """torch's DTensor class if something imported it already, else None: no DTensor can exist before
    its module is imported, and importing it here would slow every ``import hotloop``."""
    global _dtensor
    if _dtensor is None:
        # torch.distributed.tensor since torch 2.4, torch.distributed._tensor before
        for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
            _dtensor = getattr(sys.modules.get(name), "DTensor", None)
            if _dtensor is not None:
                break
    return _dtensor


def local(grad):
    """A DTensor gradient's local shard (the tensor its elements live in: changed in place, the
    DTensor sees it); any other gradient itself."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(grad, dtensor):
        return grad.to_local()
    return grad


def expect_process_group(value):
    """None or a torch.distributed.ProcessGroup: TypeError otherwise, naming what was given."""
    if value is None:
        return None
    if not dist.is_available():
        raise TypeError("GradScaler: process_group needs torch.distributed, which this torch build lacks")
    if not isinstance(value, dist.ProcessGroup):
        hint = ""
        if type(value).__name__ == "DeviceMesh":
            hint = " (for a DeviceMesh pass mesh.get_group(dim), or leave it out: DTensor gradients name their mesh)"
        raise TypeError(f"GradScaler: expected process_group to be a torch.distributed.ProcessGroup or None, "
                        f"got {type(value).__name__}{hint}")
    return value


def _sharded_dims(i, grad):
    dims = []
    for d, placement in enumerate(grad.placements):
        if placement.is_shard():
            dims.append(d)
        elif not placement.is_replicate():
            raise ValueError(f"parameter {i}: expected a DTensor gradient sharded or replicated on each mesh "
                             f"dimension, got placements {tuple(grad.placements)}")
    return tuple(dims)


def local_grads(grads, process_group):
    """(the gradients as the kernels take them: DTensors as their local shards, the process groups their
    check is reduced over, whether there were DTensors). Groups of one rank are left out (nothing to
    reduce). Raises ValueError when DTensor gradients disagree on where they are sharded, or mix with
    plain ones without a process_group: a rank's share of the norm would then count some gradients
    that other ranks count too."""
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(g, dtensor) for g in grads):
        return grads, _more_than_one((process_group,) if process_group is not None else ()), False
    if process_group is not None:
        # the user says what the gradients are: each rank's shard over this group
        return [local(g) for g in grads], _more_than_one((process_group,)), True
    mesh = dims = first = None
    for i, g in enumerate(grads):
        if g is None:
            continue
        if not isinstance(g, dtensor):
            raise ValueError(f"parameter {i}: a plain-tensor gradient among DTensor ones; shard every "
                             f"parameter of the optimizer (fully_shard the root module too), or pass "
                             f"process_group= to say which group the gradients are sharded over")
        here = _sharded_dims(i, g)
        if mesh is None:
            mesh, dims, first = g.device_mesh, here, i
        elif g.device_mesh != mesh or here != dims:
            raise ValueError(f"parameter {i}: its DTensor gradient is sharded over mesh dimensions {here} of "
                             f"{g.device_mesh}, parameter {first}'s over {dims} of {mesh}; one GradScaler "
                             f"reduces one optimizer's gradients over one set of ranks (pass process_group= "
                             f"to choose it)")
    return [local(g) for g in grads], _more_than_one(tuple(mesh.get_group(d) for d in dims)), True


def _more_than_one(groups):
    return tuple(g for g in groups if g.size() > 1)


def gather(share, group):
    """Every rank's `share` (AMP_EXTRA_LEN float32 on its device) in rank order, as one tensor of
    group.size() partials for the epilogue to fold. One collective, launched asynchronously; wait()
    makes the current stream wait for it (NCCL: no host sync; gloo is synchronous anyway)."""
    out = torch.empty(group.size() * _C.AMP_EXTRA_LEN, dtype=torch.float32, device=share.device)
    work = _all_gather(out, share, group=group, async_op=True)
    work.wait()
    return out


def _all_gather(out, share, group, async_op):
    # torch 2.14 renamed all_gather_into_tensor (which now warns) to all_gather_single
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, share, group=group, async_op=async_op)
