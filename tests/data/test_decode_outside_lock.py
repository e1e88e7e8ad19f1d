"""gpu_decode's launches run outside the epoch's lock (_launches.ImageLaunch): a next() hands out a
batch prepared earlier while a later batch decodes, a decode's error is raised at its batch's turn,
and batches prepared but never handed out free their slots without being decoded. With decode ahead
(NOTE [ Decoding ahead ], off by default, on in these tests unless one says otherwise) the host work
runs in the prefetch thread and the decodes in the launch runner's.
The device path runs on the CPU (fake_cuda), with PIL standing in for nvjpeg."""
import random
import signal
import threading
import time

import pytest
import torch
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data import _device
from hotloop.data._launches import ImageLaunch, LaunchRunner
from hotloop.data.image import stage as image_stage

from .conftest import fake_device, open_with, wait_for
from .image_folders import TRAIN_V2, assert_batches_close, make_folder
from .stand_in_decoder import GatedDecoder, gpu_decode_loaders, take_batch


@pytest.fixture(autouse=True, params=[True])
def decode_ahead(request, monkeypatch):
    monkeypatch.setattr(_device.DeviceCopies, "decode_ahead", request.param)
    return request.param


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


@pytest.mark.parametrize("decode_ahead", [True, False], indirect=True)
def test_next_hands_out_a_ready_batch_while_a_later_one_decodes(tmp_path, fake_cuda, stand_in, decode_ahead):
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
    decoder_thread = "hotloop-launch" if decode_ahead else "hotloop-prefetch"
    assert stand_in.calls[:3] == ["MainThread", decoder_thread, decoder_thread]
    for epoch in range(2):
        assert_batches_close(got[epoch], expected[epoch], levels=2)


def test_later_batches_are_staged_while_a_batch_decodes(tmp_path, fake_cuda, stand_in, monkeypatch):
    """NOTE [ Decoding ahead ]: batch 3's host work (its bytes staged, its tables built) is done by the
    prefetch thread while batch 2's decode holds the launch runner's thread."""
    begun = []
    begin = image_stage.ImageStage.begin

    def recording_begin(self, *args):
        begun.append(threading.current_thread().name)
        return begin(self, *args)

    monkeypatch.setattr(image_stage.ImageStage, "begin", recording_begin)
    expected, got, ours, it = _second_epoch(tmp_path, stand_in)
    begun.clear()
    stand_in.gate_from = 2  # batch 2's decode, in the runner's thread, waits
    try:
        got.append([take_batch(it)])
        wait_for(stand_in.entered.is_set)
        wait_for(lambda: len(begun) >= 3)  # batch 3 begun while batch 2 decodes
        assert not stand_in.release.is_set()
        assert begun == ["MainThread", "hotloop-prefetch", "hotloop-prefetch"]
    finally:
        stand_in.release.set()
    got[1] += [(x.clone(), y.clone()) for x, y in it]
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
    assert stand_in.calls[1:3] == ["hotloop-launch", "hotloop-launch"]
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
    """A launch's three steps, counted; the begun work carries a token from begin to complete."""

    def __init__(self, fail=None, fail_begin=None):
        self.begun, self.queued, self.finished, self.fail, self.fail_begin = 0, 0, 0, fail, fail_begin
        self.threads = []

    def begin(self):
        self.begun += 1
        self.threads.append(("begin", threading.current_thread().name))
        if self.fail_begin is not None:
            raise self.fail_begin
        return ("token", self.begun)

    def queue(self, begun):
        assert begun == ("token", self.begun)
        self.queued += 1
        self.threads.append(("queue", threading.current_thread().name))
        if self.fail is not None:
            raise self.fail

    def finish(self):
        self.finished += 1

    def launch(self, runner=None):
        return ImageLaunch(self.begin, self.queue, self.finish, runner)


def test_an_image_launch_queues_once_and_always_records_its_event():
    rec = Recorder()
    launch = rec.launch()
    assert launch.waiting
    launch.run()
    launch.run()
    launch.skip()
    assert (rec.begun, rec.queued, rec.finished, launch.waiting, launch.error) == (1, 1, 1, False, None)

    rec = Recorder()
    launch = rec.launch()
    launch.skip()  # a batch never handed out: its slot's event, no decode
    launch.run()
    assert (rec.begun, rec.queued, rec.finished) == (0, 0, 1)

    error = OSError("image file is truncated")
    rec = Recorder(fail=error)
    launch = rec.launch()
    launch.run()  # the prefetch thread: kept for deliver to raise, the event recorded all the same
    assert launch.error is error and (rec.queued, rec.finished) == (1, 1)

    rec = Recorder(fail_begin=error)
    launch = rec.launch()
    launch.run()  # the host work failed: nothing queued, the event recorded
    assert launch.error is error and (rec.begun, rec.queued, rec.finished) == (1, 0, 1)

    def cuda_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    launch = ImageLaunch(Recorder().begin, lambda begun: None, cuda_error)
    launch.run()  # recording the event failed: kept too, the prefetch thread is not the one to raise it
    assert "illegal memory access" in str(launch.error)


def test_a_second_thread_waits_for_the_launch_in_progress():
    started, release = threading.Event(), threading.Event()
    order = []

    def queue(begun):
        started.set()
        release.wait(10)
        order.append("queued")

    launch = ImageLaunch(lambda: None, queue, lambda: order.append("event"))
    worker = threading.Thread(target=launch.run)
    worker.start()
    started.wait(10)
    threading.Timer(0.2, release.set).start()
    launch.run()  # deliver's call: returns once the prefetch thread's queueing is over
    assert order == ["queued", "event"]
    worker.join()


def test_a_started_launch_begins_here_and_is_queued_by_the_runner():
    runner = LaunchRunner(name="test-runner")
    try:
        recs = [Recorder() for _ in range(5)]
        launches = [rec.launch(runner) for rec in recs]
        for launch in launches:
            launch.start()
        wait_for(lambda: all(rec.finished for rec in recs))
        for launch in launches:
            launch.run()  # deliver's call: finds it queued
        me = threading.current_thread().name
        for rec in recs:
            assert (rec.begun, rec.queued, rec.finished) == (1, 1, 1)
            assert rec.threads == [("begin", me), ("queue", "test-runner")]
    finally:
        runner.close()


def test_the_runner_queues_in_order_one_at_a_time_while_later_batches_begin():
    """The runner's thread holds a batch's decode; meanwhile the next batches' host work runs in the
    thread that starts them, and their decodes follow in order, never two at once."""
    runner = LaunchRunner(name="test-runner")
    gate, entered = threading.Event(), threading.Event()
    order, running = [], []

    def queue_for(k):
        def queue(begun):
            running.append(k)
            assert len(running) == 1, f"batch {k} queued while {running[0]} was"
            if k == 0:
                entered.set()
                gate.wait(10)
            order.append(k)
            running.remove(k)
        return queue

    begun = []
    launches = [ImageLaunch(lambda k=k: begun.append(k), queue_for(k), lambda: None, runner) for k in range(6)]
    try:
        launches[0].start()
        assert entered.wait(10)  # batch 0 decodes in the runner's thread
        for launch in launches[1:]:
            launch.start()  # does not wait for batch 0's decode
        assert begun == list(range(6)) and order == []
        gate.set()
        for launch in launches:
            launch.run()
        assert order == list(range(6))
    finally:
        gate.set()
        runner.close()


def test_a_closed_runner_leaves_the_launch_to_its_owner():
    runner = LaunchRunner()
    runner.close()
    rec = Recorder()
    launch = rec.launch(runner)
    launch.start()  # begun here; the runner takes nothing
    assert (rec.begun, rec.queued) == (1, 0) and not launch.waiting
    launch.run()  # deliver
    assert (rec.begun, rec.queued, rec.finished) == (1, 1, 1)
    rec = Recorder()
    launch = rec.launch(runner)
    launch.start()
    launch.skip()  # the epoch ended first: only the event
    assert (rec.begun, rec.queued, rec.finished) == (1, 0, 1)


def _launch_threads():
    return [t for t in threading.enumerate() if t.name == "hotloop-launch" and t.is_alive()]


@pytest.mark.parametrize("persistent", [False, True])
def test_the_launch_runner_ends_with_the_workers(tmp_path, fake_cuda, stand_in, persistent):
    ds = ImageFolder(make_folder(str(tmp_path), n=20), transform=TRAIN_V2(28))
    _, ours = gpu_decode_loaders(ds, random.randrange(2**31), batch_size=5, num_workers=2,
                                 persistent_workers=persistent)

    def epoch():
        for _ in ours:
            time.sleep(0.05)  # "the training step": the prefetch thread and the runner go on meanwhile

    epoch()
    assert "hotloop-launch" in stand_in.calls  # the runner decoded some of them
    if persistent:
        epoch()  # the same runner, the next epoch
        del ours
    wait_for(lambda: not _launch_threads())
