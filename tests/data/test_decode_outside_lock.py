"""gpu_decode's decodes run by the prefetch thread outside the epoch's lock (_device.ImageLaunch): a
next() hands out a batch prepared earlier while a later batch decodes, a decode's error is raised at
its batch's turn, and batches prepared but never handed out free their slots without being decoded.
The device path runs on the CPU (fake_cuda), with PIL standing in for nvjpeg."""
import random
import signal
import threading
import time

import pytest
import torch
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data._device import ImageLaunch

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
    wait_for(lambda: _first_tasks_done(it, 3))
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
    wait_for(stand_in.entered.is_set)
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
    stand_in.fail_at = 3  # nvjpeg failing at batch 3, which the prefetch thread decodes
    got.append([take_batch(it)])
    wait_for(lambda: len(stand_in.calls) >= 3)
    got[1] += _outcomes(it, len(ours) - 1)
    with pytest.raises(StopIteration):
        next(it)
    assert stand_in.calls[1:3] == ["hotloop-prefetch", "hotloop-prefetch"]
    assert isinstance(got[1][2], RuntimeError) and "stand-in decoder failed" in str(got[1][2])
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


class Recorder:
    def __init__(self, fail=None):
        self.queued, self.finished, self.fail = 0, 0, fail

    def queue(self):
        self.queued += 1
        if self.fail is not None:
            raise self.fail

    def finish(self):
        self.finished += 1


def test_an_image_launch_queues_once_and_always_records_its_event():
    rec = Recorder()
    launch = ImageLaunch(rec.queue, rec.finish)
    assert launch.waiting
    launch.run()
    launch.run()
    launch.skip()
    assert (rec.queued, rec.finished, launch.waiting, launch.error) == (1, 1, False, None)

    rec = Recorder()
    launch = ImageLaunch(rec.queue, rec.finish)
    launch.skip()  # a batch never handed out: its slot's event, no decode
    launch.run()
    assert (rec.queued, rec.finished) == (0, 1)

    error = OSError("image file is truncated")
    rec = Recorder(fail=error)
    launch = ImageLaunch(rec.queue, rec.finish)
    launch.run()  # the prefetch thread: kept for deliver to raise, the event recorded all the same
    assert launch.error is error and (rec.queued, rec.finished) == (1, 1)

    def cuda_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    launch = ImageLaunch(Recorder().queue, cuda_error)
    launch.run()  # recording the event failed: kept too, the prefetch thread is not the one to raise it
    assert "illegal memory access" in str(launch.error)


def test_a_second_thread_waits_for_the_launch_in_progress():
    started, release = threading.Event(), threading.Event()
    order = []

    def queue():
        started.set()
        release.wait(10)
        order.append("queued")

    launch = ImageLaunch(queue, lambda: order.append("event"))
    worker = threading.Thread(target=launch.run)
    worker.start()
    started.wait(10)
    threading.Timer(0.2, release.set).start()
    launch.run()  # deliver's call: returns once the prefetch thread's queueing is over
    assert order == ["queued", "event"]
    worker.join()
