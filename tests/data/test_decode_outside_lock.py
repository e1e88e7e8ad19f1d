"""gpu_decode's batches are made outside the epoch's lock, in one place (prefetch.making.BatchMaking: NOTE
[ One way down for a batch ]): a next() hands out a batch prepared earlier while a later batch
decodes in the prefetch thread, a decode's error is raised at its batch's turn, and batches prepared
but never handed out free their slots without being decoded.
The device path runs on the CPU (fake_cuda), with PIL standing in for nvjpeg."""
import random
import signal
import threading
import time
import types

import pytest
import torch
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data import LoaderStats
from hotloop.data.settings import CopySettings
from hotloop.data.ring.copies import DeviceCopies, QueuedBatch
from hotloop.data.prefetch.making import BatchMaking

from .conftest import fake_device, open_with, wait_for
from .image_folders import TRAIN_V2, assert_batches_close, make_folder
from .stand_in_decoder import GatedDecoder, gpu_decode_loaders, take_batch


@pytest.fixture
def stand_in(monkeypatch):
    """The decoder every gpu_decode loader made in the test opens."""
    decoder = GatedDecoder()
    open_with(monkeypatch, decoder)
    return decoder


def _first_tasks_done(it, n):
    feed = it._feed
    return len(feed._order) >= n and all(feed.pool.is_done(t) for t in feed._order[:n])


def _second_epoch(tmp_path, stand_in):
    """A gpu_decode loader with persistent workers and torch's, same seed: (torch's two epochs, [ours
    first], ours, the iterator of our second epoch) with the stand-in's calls cleared and the first
    three batches done by the workers, so that the top-up after the first next() prepares 2 and 3."""
    ds = ImageFolder(make_folder(str(tmp_path), n=30), transform=TRAIN_V2(28))
    theirs, ours = gpu_decode_loaders(ds, random.randrange(2**31), batch_size=5, shuffle=True, num_workers=2,
                            persistent_workers=True)
    expected = [[(x.clone(), y.clone()) for x, y in theirs] for _ in range(2)]
    got = [[(x.clone(), y.clone()) for x, y in ours]]  # the first epoch makes the ring
    stand_in.calls.clear()
    it = iter(ours)
    wait_for(lambda: _first_tasks_done(it, 3), what="the workers' first three batches of the second epoch")
    return expected, got, ours, it


def test_next_hands_out_a_ready_batch_while_a_later_one_decodes(tmp_path, fake_cuda, stand_in):
    expected, got, ours, it = _second_epoch(tmp_path, stand_in)
    stand_in.gate_from = 3  # batch 1 decodes in next() (nothing prepared yet), 2 and 3 in the prefetch thread
    got.append([take_batch(it)])
    wait_for(stand_in.entered.is_set)  # batch 3's decode has started, in the prefetch thread
    releaser = threading.Timer(3.0, stand_in.release.set)  # what a next() that waits for it would need
    releaser.start()
    try:
        t0 = time.monotonic()
        got[1].append(take_batch(it))
        took = time.monotonic() - t0
        still_decoding = not stand_in.release.is_set()
    finally:
        stand_in.release.set()
        releaser.cancel()
    got[1] += [(x.clone(), y.clone()) for x, y in it]
    assert still_decoding and took < 1.5, f"next() took {took:.2f} s: it waited for batch 3's decode"
    assert stand_in.calls[:3] == ["MainThread", "hotloop-prefetch", "hotloop-prefetch"]
    for epoch in range(2):
        assert_batches_close(got[epoch], expected[epoch], levels=2)


def test_ctrl_c_while_next_waits_for_a_decode_loses_no_batch(tmp_path, fake_cuda, stand_in):
    expected, got, ours, it = _second_epoch(tmp_path, stand_in)
    stand_in.gate_from = 2  # batch 2's decode, in the prefetch thread, waits
    got.append([take_batch(it)])
    wait_for(stand_in.entered.is_set, what=lambda: f"the decoder's calls so far, by thread: {stand_in.calls}")
    # Ctrl-C as in a terminal, also where the tests run in a background job (which inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)  # waits for batch 2's decode
    finally:
        ctrl_c.join()
        signal.signal(signal.SIGINT, previous)
        stand_in.release.set()
    got[1] += [(x.clone(), y.clone()) for x, y in it]  # batch 2 first: the interrupted next() lost nothing
    for epoch in range(2):
        assert_batches_close(got[epoch], expected[epoch], levels=2)


def _outcomes(it, n):
    """n batches of the iterator, or the exception a next() raised instead (the epoch goes on)."""
    out = []
    for _ in range(n):
        try:
            x, y = next(it)
            out.append((x.clone(), y.clone()))
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - the batch's own error
            out.append(exc.with_traceback(None))  # its frames would keep the loaders for the collector
    return out


def test_an_error_in_a_deferred_decode_is_raised_at_its_batch(tmp_path, fake_cuda, stand_in):
    expected, got, ours, it = _second_epoch(tmp_path, stand_in)
    stand_in.fail_at = 3  # the decode of batch 3, which the prefetch thread makes, raising
    # not nvjpeg's RuntimeError, after which the workers decode instead (test_decode_split.py), but an
    # error of the call itself, as the decoder's ValueError for a bad table
    stand_in.error = ValueError("stand-in decoder failed")
    got.append([take_batch(it)])
    wait_for(lambda: len(stand_in.calls) >= 3)
    got[1] += _outcomes(it, len(ours) - 1)
    with pytest.raises(StopIteration):
        next(it)
    assert stand_in.calls[1:3] == ["hotloop-prefetch", "hotloop-prefetch"]
    assert isinstance(got[1][2], ValueError) and "stand-in decoder failed" in str(got[1][2])
    assert len(ours._hl_pool.free_slots) == ours._hl_pool.ring.nslots  # the failed batch's slot came back
    assert_batches_close(got[0], expected[0], levels=2)
    assert_batches_close(got[1][:2] + got[1][3:], expected[1][:2] + expected[1][3:], levels=2)  # nothing lost around it


def test_batches_prepared_but_not_handed_out_free_their_slots(tmp_path, fake_cuda, stand_in):
    """Epochs left after one batch, with batches prepared (their decodes queued or not): the slots
    come back, so later epochs run whole, every sample once."""
    ds = ImageFolder(make_folder(str(tmp_path), n=30), transform=TRAIN_V2(28))
    loader = fake_device(hotloop.DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, persistent_workers=True,
                                            gpu_decode=True, prefetch_batches=2))
    for _ in range(10):
        it = iter(loader)
        next(it)
        del it
    labels = torch.cat([y for _, y in loader])
    assert sorted(labels.tolist()) == sorted(ds.targets)
    assert len(loader._hl_pool.free_slots) == loader._hl_pool.ring.nslots


class Maker:
    """A BatchMaker's per-batch hooks, counted: make() returns its parts' sum, or raises `fail`."""

    def __init__(self, fail=None, gate=None):
        self.made, self.threads, self.fail, self.gate = [], [], fail, gate
        self.entered = threading.Event()

    def make(self, parts, stream, empty):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.threads.append(threading.current_thread().name)
        if self.fail is not None:
            raise self.fail
        self.made.append(sum(parts))
        return sum(parts), ["buffer"], "held"

    def place(self, batch, out):
        batch[0] = out


class Copies:
    """The copy engine's side of making: the stream, the allocation, what the batch keeps, its event."""

    copy_stream = 7
    empty_ordered = None

    def __init__(self, fail_seal=None):
        self.sealed, self.fail_seal = [], fail_seal

    @staticmethod
    def keep(batch, out, buffers, held):
        batch.keep += buffers
        batch.held = held

    def seal(self, batch):
        self.sealed.append(batch.slot)
        batch.sealed = True
        if self.fail_seal is not None:
            raise self.fail_seal


def _queued(slot, parts):
    return QueuedBatch(slot, 1, [None, "targets"], [], 7, [], 0, None, left=list(parts))


def test_a_batch_is_made_once_and_its_event_always_recorded():
    maker, copies = Maker(), Copies()
    making = BatchMaking(maker, copies)
    batch = _queued(3, [1, 2])
    making.make_ready(batch)
    making.make_ready(batch)  # made already: nothing more
    making.drop(batch)
    assert maker.made == [3] and copies.sealed == [3] and batch.result == [3, "targets"]
    assert (batch.left, batch.keep, batch.held, batch.error) == (None, ["buffer"], "held", None)

    dropped = _queued(4, [5])
    making.drop(dropped)  # never handed out: its event, no make
    making.make_ready(dropped)
    assert maker.made == [3] and copies.sealed == [3, 4] and dropped.sealed

    error = OSError("image file is truncated")
    maker.fail = error
    failed = _queued(5, [1])
    making.make_ready(failed)  # kept for deliver to raise at the batch's turn; the event recorded all the same
    assert failed.error is error and copies.sealed[-1] == 5

    cuda_error = RuntimeError("CUDA error: an illegal memory access was encountered")
    maker.fail = None
    making = BatchMaking(maker, Copies(fail_seal=cuda_error))
    batch = _queued(6, [1])
    making.make_ready(batch)  # recording the event failed: kept too, the maker's thread is not the one to raise it
    assert batch.error is cuda_error


def test_a_second_thread_waits_for_the_batch_being_made():
    gate = threading.Event()
    maker, copies = Maker(gate=gate), Copies()
    making = BatchMaking(maker, copies)
    batch = _queued(1, [2, 2])
    prefetch = threading.Thread(target=making.make_ready, args=(batch,), name="prefetch")
    prefetch.start()
    assert maker.entered.wait(10)
    threading.Timer(0.2, gate.set).start()
    making.make_ready(batch)  # next()'s call: returns once the prefetch thread's make is over, makes nothing
    prefetch.join()
    assert maker.made == [4] and maker.threads == ["prefetch"] and copies.sealed == [1]


def test_the_copy_engine_raises_a_making_error_at_the_batch_and_frees_its_slot(fake_cuda):
    """deliver raises what making raised, and the slot comes back once its event completed."""
    copies = DeviceCopies(CopySettings(device=types.SimpleNamespace(type="cuda", index=0), pin_slots=False),
                          LoaderStats())
    copies.copy_stream = 7
    batch = _queued(2, [1])
    batch.error = OSError("broken")
    copies.seal(batch)
    with pytest.raises(OSError, match="broken"):
        copies.deliver(batch)
    copies.reclaim(True)
    assert copies.take_finished() == [2]
    unmade = _queued(3, [1])
    with pytest.raises(RuntimeError, match="before its event was recorded"):
        copies.deliver(unmade)
    copies.reclaim(True)
    assert copies.take_finished() == [3] and unmade.sealed
