"""Tensors whose elements overlap (a stride 0 from expand(), windows from as_strided) reach the consumer
as torch's loader delivers them, the same view (shape, strides, values), from only the storage they
reach: never numel elements written into the ring (torch.zeros(1).expand(2**28) was 1 GiB a batch)."""
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import hotloop

from .conftest import assert_same, fake_device


class Images(Dataset):
    """(a random 3x64x64 float image, i), the image drawn anew every run."""

    def __init__(self, n=40):
        self.data = torch.randn(n, 3, 64, 64)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


def _stack(batch):
    return torch.stack([x for x, _ in batch])


# each makes a batch with an overlapping leaf of 4 to 16 MiB of elements from a few kB of storage
CASES = {
    "expand_scalar": lambda b: torch.full((1,), float(b[0][0].sum())).expand(2**22),
    "expand_image": lambda b: {"x": _stack(b), "ref": _stack(b)[:1].expand(256, 3, 64, 64)},
    "windows": lambda b: _stack(b).flatten().as_strided((_stack(b).numel() - 63, 64), (1, 1)),
    "offset_in_a_large_storage": lambda b: [_stack(b).flatten()[3:7].expand(2**20, 4), b[0][1]],
    # reaches more storage batch after batch: past the first batch's slot layout, the side path
    "growing": lambda b: _stack(b).flatten()[:64 * (1 + b[0][1])].expand(512, -1),
}


def _tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    return [t for x in batch for t in _tensors(x)] if isinstance(batch, (list, tuple)) else []


def _reached_bytes(t):
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def _check(a, b):
    """b is torch's batch a: values, dtypes, shapes and strides, on no more storage than it reaches."""
    assert_same(a, b)
    for x, y in zip(_tensors(a), _tensors(b), strict=True):
        assert x.stride() == y.stride()
        assert y.untyped_storage().nbytes() <= max(_reached_bytes(y), y.numel() * y.element_size())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", [False, True], ids=["cpu", "fake-device"])
def test_overlapping_leaves_as_torch_delivers_them(case, device, request):
    ds = Images()
    kw = dict(batch_size=4, num_workers=2, collate_fn=CASES[case])
    theirs = list(TorchDataLoader(ds, **kw))
    loader = hotloop.DataLoader(ds, persistent_workers=True, **kw)
    if device:
        request.getfixturevalue("fake_cuda")
        fake_device(loader)
    for keep in (False, True):  # views of their slots, then (all kept) copied out of it
        ours = []
        for i, batch in enumerate(loader):
            _check(theirs[i], batch)
            if keep:
                ours.append(batch)
        del batch
        assert i + 1 == len(theirs) and len(ours) == (len(theirs) if keep else 0)  # no batch short
        if keep:  # every batch kept: each still torch's once the loader went on
            for a, b in zip(theirs, ours, strict=True):
                _check(a, b)
    pool = loader._hl_pool
    # the slot holds the metadata and what each leaf reaches: a few pages, not 4 to 16 MiB of elements
    assert pool.ring.slot_bytes <= (1 << 20), pool.ring.slot_bytes
    assert loader.stats.ring_bytes == pool.ring.nbytes


class Expanded(Dataset):
    """Samples that are themselves views with a stride 0 (no batching: batch_size=None)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i + 0.5, -i]).expand(2**20, 2)


def test_unbatched_expanded_samples():
    theirs = list(TorchDataLoader(Expanded(), batch_size=None, num_workers=2))
    loader = hotloop.DataLoader(Expanded(), batch_size=None, num_workers=2, persistent_workers=True)
    ours = list(loader)
    assert len(ours) == len(theirs) == 12
    for a, b in zip(theirs, ours, strict=True):
        assert_same(a, b)
        assert a.stride() == b.stride() == (0, 1)
    assert loader._hl_pool.ring.slot_bytes <= (1 << 20)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(20))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_samples_counted_from_the_view_not_its_storage(num_workers):
    """stats count an IterableDataset's batch by its first tensor's first dimension: an overlapping
    first leaf is a (4, 1000) view of 1000 elements, not 1000 samples."""
    def collate(samples):
        return torch.arange(1000.0).expand(len(samples), 1000), torch.tensor(samples)

    loader = hotloop.DataLoader(Stream(), batch_size=4, num_workers=num_workers, collate_fn=collate)
    got = list(loader)
    ref = list(TorchDataLoader(Stream(), batch_size=4, num_workers=num_workers, collate_fn=collate))
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert_same(a, b)
    assert loader.stats.samples == sum(len(i) for _, i in ref)  # every worker streams it all, as in torch
