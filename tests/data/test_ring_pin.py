"""The ring's background faulting and page-locking (populate_all) and its chunk-split copies to the device."""
import array

import pytest
import torch

import hotloop
from hotloop import _C

from .conftest import wait_for

CHUNK = 8 << 20  # ring_pin.c's registration chunk


def test_populate_all_faults_every_slot_in_the_background():
    ring = _C.Ring(5, 3 << 20)
    try:
        assert not any(ring.faulted(i) for i in range(5))
        ring.populate_all([4, 3, 2, 1, 0])
        wait_for(lambda: all(ring.faulted(i) for i in range(5)))
        with pytest.raises(RuntimeError, match="started already"):
            ring.populate_all([0])
        assert ring.registered == 0  # no device: pages only
    finally:
        ring.close()
    assert ring.closed


def test_populate_all_rejects_bad_slots_and_closes_while_running():
    ring = _C.Ring(3, 1 << 20)
    with pytest.raises(IndexError, match="out of range"):
        ring.populate_all([0, 3])
    with pytest.raises(TypeError):
        ring.populate_all(5)
    big = _C.Ring(40, 16 << 20)
    big.populate_all(list(range(40)))
    big.close()  # joins the threads mid-way; nothing is left running on unmapped memory
    ring.close()


@pytest.mark.skipif(hotloop.cuda_available(), reason="checks the error without a usable GPU")
def test_populate_all_for_a_device_without_cuda_raises():
    ring = _C.Ring(2, 1 << 20)
    try:
        with pytest.raises(RuntimeError):
            ring.populate_all([0, 1], 0)
    finally:
        ring.close()


def _fill_and_copy(ring, slot, pieces):
    """Random bytes in the whole slot; the (offset, size) pieces (they may overlap) copied to the
    device: (expected, got)."""
    view = torch.frombuffer(ring.view(slot), dtype=torch.uint8)
    data = torch.randint(0, 256, (ring.slot_bytes,), dtype=torch.uint8)
    view.copy_(data)
    del view
    outs, triples = [], []
    for off, size in pieces:
        out = torch.empty(size, dtype=torch.uint8, device="cuda")
        outs.append(out)
        triples += (off, out.data_ptr(), size)
    stream = torch.cuda.current_stream()
    ring.copy_to_device(slot, array.array("q", triples).tobytes(), stream.cuda_stream, 0)
    stream.synchronize()
    return [data[off:off + size] for off, size in pieces], [o.cpu() for o in outs]


@pytest.mark.gpu
def test_background_page_locking_and_copies_across_chunks():
    slot_bytes = 2 * CHUNK + 5 * 4096  # three chunks, the last one short
    ring = _C.Ring(4, slot_bytes)
    try:
        ring.populate_all([3, 2, 1, 0], 0)
        wait_for(lambda: ring.registered == 4)
        assert all(ring.faulted(i) for i in range(4)) and all(ring.slot_pinned(i) for i in range(4))
        assert not ring.cuda_register_slot(2, 0)  # nothing left to register
        pieces = [(0, 100), (CHUNK - 7, 20), (CHUNK + 3, CHUNK), (2 * CHUNK - 1, 5 * 4096 + 1), (12345, 2 * CHUNK)]
        for slot in range(4):
            expected, got = _fill_and_copy(ring, slot, pieces)
            for k, (a, b) in enumerate(zip(expected, got, strict=True)):
                assert torch.equal(a, b), f"slot {slot} piece {k}"
    finally:
        ring.close()
    assert ring.registered == 0


@pytest.mark.gpu
def test_register_slot_on_the_main_thread_and_copy():
    ring = _C.Ring(2, CHUNK + 4096)
    try:
        with pytest.raises(ValueError, match="no CUDA device 99"):
            ring.cuda_register_slot(1, 99)
        assert not ring.slot_pinned(1)
        assert ring.cuda_register_slot(1, 0)
        assert ring.registered == 1 and not ring.cuda_register_slot(1, 0)
        assert ring.slot_pinned(1) and not ring.slot_pinned(0)
        with pytest.raises(IndexError):
            ring.slot_pinned(2)
        expected, got = _fill_and_copy(ring, 1, [(0, CHUNK + 4096), (CHUNK - 1, 2)])
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        # a slot never registered still copies correctly (the runtime stages pageable memory)
        expected, got = _fill_and_copy(ring, 0, [(10, CHUNK)])
        assert torch.equal(expected[0], got[0])
    finally:
        ring.close()
    assert ring.registered == 0
