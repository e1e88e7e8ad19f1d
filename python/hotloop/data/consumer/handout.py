"""What both of hotloop.DataLoader's iterators (and the multi-worker feed) do to hand a batch out that
the ring did not carry: a batch that came whole, made as the ring path would deliver it; the error of
a batch made ahead, raised when that batch is due; a batch's sample count."""
from ..._torch_compat import pin_memory
from ..ring.layout import flatten, unflatten


class RaiseWhenDue:
    """An exception of a batch made ahead, raised when that batch is due."""

    def __init__(self, exc):
        self.exc = exc


def batch_samples(batch, default):
    tensors = []
    flatten(batch, tensors)
    for t in tensors:
        if t.dim() > 0:
            return int(t.shape[0])
    return default


def host_batch_out(device, transform, making, batch, pin):
    """A batch that came whole (num_workers=0, or through a worker's pipe): made by the loader's
    BatchMaker (`making`: prefetch.making.BatchMaking, or None) when it is one of its own, to the
    device and through its LeafTransform, as the ring path would deliver it."""
    if making is not None:
        batch = making.make_whole(batch, device)  # gpu_decode's packed batch, decoded
    if device is None and transform is None:
        return pin_memory(batch) if pin else batch
    tensors = []
    spec = flatten(batch, tensors)
    # which leaves the transform takes (gpu_transform's images): ValueError for one it cannot take, or for none
    images = (transform.leaf_outputs((t.dtype, t.shape) for t in tensors) if transform is not None
              else [False] * len(tensors))
    if device is None and not any(images):
        return pin_memory(batch) if pin else batch
    outs = []
    for t, image in zip(tensors, images):
        if device is not None:
            t = t.to(device)
        if image:
            t = transform.transform(t)
        elif pin and device is None:
            t = t.pin_memory()
        outs.append(t)
    return unflatten(spec, outs)
