"""Samples copied into their slot rows as they are made (loader_rows.py): same batches as
default_collate, the sample's own memory freed at once, the dataset's containers untouched."""
import collections
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, default_collate
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop
from hotloop.data.ring.layout import (FastPathDeclined, SlotWriter, collate_no_shm, plan_layout, sample_plan, unflatten,
                                 write_fast, write_general)
from hotloop.data.ring.copies import slot_layout
from hotloop.data.worker.rows import SlotRows

from .conftest import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

Pair = collections.namedtuple("Pair", "a b")


def _tensor_and_label(j):
    return torch.randint(0, 256, (6, 5, 3), dtype=torch.uint8), j


def _dict_of_everything(j):
    return {"img": torch.randn(4, 3), "arr": np.random.rand(2, 2), "f": float(j) / 3, "name": f"s{j}",
            "n": np.int32(j), "pair": Pair(torch.rand(2), [j, torch.rand(3, dtype=torch.float64)])}


def _views_and_flips(j):
    base = torch.arange(400, dtype=torch.int16).view(20, 20)
    x = base[j % 5:j % 5 + 8, 2:10]
    return (x.flip(1) if j % 2 else x), torch.tensor(j).expand(3)


def _write(samples):
    """Write `samples` as a worker does: each into its rows (SlotRows), then write_fast, or
    default_collate when it gives up. Returns (the batch read back from the slot, samples placed)."""
    n = len(samples)
    plan = sample_plan(samples[0])
    sizes, side = plan_layout(plan, samples[0], n)
    layout, nbytes = slot_layout(sizes, 4096)
    slot = torch.zeros(nbytes, dtype=torch.uint8)
    rows = SlotRows(plan, samples[0], n, slot, layout)
    put = [rows.put(s) for s in samples]
    writer = SlotWriter(slot, layout)
    try:
        spec = write_fast(put, writer, rows.placed)
    except FastPathDeclined:
        writer = SlotWriter(slot, layout)
        spec = write_general(collate_no_shm(put), writer)
    leaves = [slot[off:off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape).clone()
              for off, dtype, shape in writer.leaves]
    return unflatten(spec, leaves), rows.placed


@pytest.mark.parametrize("make", [_tensor_and_label, _dict_of_everything, _views_and_flips])
def test_rows_give_default_collate_batch(make):
    samples = [make(j) for j in range(7)]
    want = default_collate(samples)
    got, placed = _write(samples)
    assert placed == 7
    assert_same(got, want)


def test_dataset_containers_are_not_changed():
    samples = [{"x": torch.rand(3), "y": [torch.rand(2), j]} for j in range(4)]
    keep = [(s, s["x"], s["y"], s["y"][0]) for s in samples]
    got, placed = _write(samples)
    assert placed == 4
    for s, x, y, y0 in keep:
        assert s["x"] is x and s["y"] is y and y[0] is y0  # the rows hold copies; the samples are as made
    assert_same(got, default_collate(samples))


@pytest.mark.parametrize("bad", [1, 4])
def test_a_sample_unlike_the_first_ends_placing_and_falls_back(bad):
    """Sample `bad` has another dtype: default_collate promotes the whole column. The samples placed
    before it are views of the slot when default_collate reads them, before the slot is rewritten."""
    samples = [(torch.randn(3, 2), j) for j in range(6)]
    samples[bad] = (samples[bad][0].double(), bad)
    got, placed = _write(samples)
    assert placed == bad
    want = default_collate(samples)
    assert want[0].dtype == torch.float64
    assert_same(got, want)


def test_slot_too_small_places_nothing():
    samples = [(torch.randn(3, 2), j) for j in range(4)]
    plan = sample_plan(samples[0])
    rows = SlotRows(plan, samples[0], 4, torch.zeros(8192, dtype=torch.uint8), [(4096, 64), (4096 + 64, 64)])
    assert [rows.put(s) for s in samples] == samples and rows.placed == 0


class Alive(Dataset):
    """Sample i: fresh tensors, and how many tensors this dataset returned earlier in this process
    are still alive (held by the loader)."""

    def __init__(self, n=48):
        self.n = n
        self.alive = weakref.WeakSet()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        held = len(self.alive)
        x = torch.full((1024,), float(i))
        self.alive.add(x)
        return x, torch.tensor(i), torch.tensor(held)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_workers_free_each_sample_once_in_its_row(num_workers):
    """Every batch equals torch's. Once a worker's task comes with its slot (every task after the
    workers' first ones: those are made before the ring exists and kept whole for it), at most the
    previous sample is still held from the batch's third sample on; torch's loader holds all the
    batch's samples until it collates them."""
    ds = Alive()
    want = list(TorchDataLoader(ds, batch_size=8, num_workers=num_workers))
    got = list(hotloop.DataLoader(ds, batch_size=8, num_workers=num_workers))
    assert len(got) == len(want) == 6
    for k, ((x, i, held), (x0, i0, held0)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(x, x0) and torch.equal(i, i0)
        assert held0.tolist()[2:] == list(range(2, 8))
        if k >= num_workers:
            assert max(held.tolist()[2:]) <= 1, (k, held.tolist())
