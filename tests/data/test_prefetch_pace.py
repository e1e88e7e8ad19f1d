"""The prefetch thread's paced top-ups (gpu_decode's loaders, _prefetch.TopUpPace): the top-up after a
next() starts later in the step (PACE_FRACTION of it), where a batch is already prepared for the next next(), and at once
when the consumer is behind or comes back first."""
import threading
import time

import pytest

import hotloop
from hotloop.data import dataloader
from hotloop.data._prefetch import PACE_FRACTION, PACE_MARGIN_S, Prefetcher, TopUpPace

from .conftest import Images, fake_device


def test_no_delay_until_a_period_is_known_or_when_behind():
    pace = TopUpPace()
    assert pace.delay(ahead=2) == 0.0  # no period yet
    pace.kicked(0.0)
    pace.kicked(0.040)
    assert pace.delay(ahead=0) == 0.0  # nothing prepared for the next next(): at once
    assert pace.delay(ahead=1) == pytest.approx(PACE_FRACTION * 0.040)
    assert pace.delay(ahead=3) == pytest.approx(PACE_FRACTION * 0.040)


def test_the_top_up_ends_before_the_batch_it_prepares_is_wanted():
    def pace_after(work):
        pace = TopUpPace()
        for t in (0.0, 0.040, 0.080):
            pace.kicked(t)
        pace.worked(work)
        return pace

    # one that outlasts the step's last 35 % still starts PACE_FRACTION in: its batch is wanted a step later
    assert pace_after(0.030).delay(ahead=1) == pytest.approx(PACE_FRACTION * 0.040)
    # one that takes longer than a step starts early enough to end before the next next() but one
    assert pace_after(0.060).delay(ahead=1) == pytest.approx(2 * 0.040 - 0.060 - PACE_MARGIN_S)
    assert pace_after(0.200).delay(ahead=1) == 0.0


def test_a_pause_stretches_the_period_boundedly():
    pace = TopUpPace()
    for t in (0.0, 0.040, 0.080):
        pace.kicked(t)
    pace.kicked(10.0)  # validation between two epochs' next() calls
    assert pace.period == pytest.approx(0.8 * 0.040 + 0.2 * 0.080)


class FakeFeed:
    """What the prefetch thread drives: a lock, top_up() (records when it ran), ahead()."""

    def __init__(self, ahead=1):
        self.lock = threading.RLock()
        self.ran = []
        self._ahead = ahead

    def ahead(self):
        return self._ahead

    def top_up(self, defer=False):
        self.ran.append(time.perf_counter())
        return False

    def waiting_launches(self):
        return []


def _wait_runs(feed, n, timeout=2.0):
    deadline = time.monotonic() + timeout
    while len(feed.ran) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(feed.ran) >= n


def test_a_paced_top_up_starts_into_the_step_after_the_kick():
    feed = FakeFeed()
    prefetcher = Prefetcher(feed, paced=True)
    try:
        period = 0.08
        for k in range(4):  # kicks one period apart: the pace learns the period
            t = time.perf_counter()
            prefetcher.kick()
            _wait_runs(feed, k + 1)
            time.sleep(max(0.0, t + period - time.perf_counter()))
        t = time.perf_counter()
        prefetcher.kick()
        _wait_runs(feed, 5)
        assert feed.ran[-1] - t >= 0.5 * PACE_FRACTION * period  # not at once (a wait ends no sooner)
    finally:
        prefetcher.close()


def test_the_consumer_back_early_gets_its_top_up_at_once():
    feed = FakeFeed()
    prefetcher = Prefetcher(feed, paced=True)
    try:
        prefetcher._pace.period = 10.0  # a paced top-up would start seconds after its kick
        prefetcher._pace._last = time.perf_counter()
        prefetcher.kick()
        time.sleep(0.05)
        assert len(feed.ran) == 0  # waiting for its start
        t = time.perf_counter()
        prefetcher.kick()  # the next next(): the waiting top-up runs now
        _wait_runs(feed, 1)
        assert feed.ran[0] - t < 0.5
    finally:
        t = time.perf_counter()
        prefetcher.close()
        assert time.perf_counter() - t < 1.0


def test_close_while_waiting_ends_the_thread_at_once():
    feed = FakeFeed()
    prefetcher = Prefetcher(feed, paced=True)
    prefetcher._pace.period = 10.0
    prefetcher._pace._last = time.perf_counter()
    prefetcher.kick()
    time.sleep(0.05)
    t = time.perf_counter()
    prefetcher.close()
    assert time.perf_counter() - t < 1.0 and not feed.ran
    assert not prefetcher._thread.is_alive()


def test_behind_means_at_once():
    feed = FakeFeed(ahead=0)
    prefetcher = Prefetcher(feed, paced=True)
    try:
        prefetcher._pace.period = 10.0
        prefetcher._pace._last = time.perf_counter()
        t = time.perf_counter()
        prefetcher.kick()
        _wait_runs(feed, 1)
        assert feed.ran[0] - t < 0.5
    finally:
        prefetcher.close()


def test_only_gpu_decode_loaders_pace(fake_cuda, monkeypatch):
    made = []
    real = dataloader.Prefetcher

    def recording(feed, paced=False):
        made.append(paced)
        return real(feed, paced)

    monkeypatch.setattr(dataloader, "Prefetcher", recording)
    loader = fake_device(hotloop.DataLoader(Images(n=16, size=8), batch_size=4, num_workers=2))
    assert len(list(loader)) == 4
    assert made == [False]
