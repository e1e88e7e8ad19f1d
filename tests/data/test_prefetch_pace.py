"""The prefetch thread's paced top-ups (gpu_decode's loaders, prefetch.thread.TopUpPace): the top-up after a
next() starts later in the step (PACE_FRACTION of it), where a batch is already prepared for the next next(), and at once
when the consumer is behind or comes back first; one batch per run, the next at its own paced time; the
step is the shortest recent gap between next() calls, counted from call to call."""
import threading
import time

import pytest
import torch

import hotloop
from hotloop.data.consumer import feed as feed_module
from hotloop.data.consumer import iterators
from hotloop.data.prefetch.thread import PACE_FRACTION, PACE_MARGIN_S, PERIOD_WINDOW, Prefetcher, TopUpPace

from .conftest import Images, fake_device, wait_for


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


def test_the_period_is_the_shortest_recent_step():
    pace = TopUpPace()
    t = 0.0
    for gap in (0.040, 0.085, 0.044, 0.090, 10.0):  # steps slowed by decodes, a validation pause
        pace.kicked(t)
        t += gap
    assert pace.period == pytest.approx(0.040)
    for _ in range(PERIOD_WINDOW):  # the step got longer for good (a larger batch, say)
        pace.kicked(t)
        t += 0.060
    assert pace.period == pytest.approx(0.060)


def test_the_period_counts_gaps_between_calls_not_returns():
    """A consumer on a fixed schedule (a thread taking a batch every 40 ms) whose next() waited 30 ms
    returns 30 ms late and calls again 10 ms later: counted between returns, the step would seem
    10 ms long and the top-ups would start early in its real step."""
    prefetcher = Prefetcher(FakeFeed(), paced=True)
    try:
        t = time.perf_counter()
        for called_at in (t, t + 0.040, t + 0.080, t + 0.120):  # the call at 80 ms returned at 110 ms
            prefetcher.kick(called_at)
        assert prefetcher._pace.period == pytest.approx(0.040)
    finally:
        prefetcher.close()


def test_next_kicks_with_the_time_it_was_called(fake_cuda, monkeypatch):
    calls = []
    real = Prefetcher.kick
    monkeypatch.setattr(Prefetcher, "kick", lambda self, called_at=None: (calls.append(called_at), real(self, called_at)))
    loader = fake_device(hotloop.DataLoader(Images(n=16, size=8), batch_size=4, num_workers=2, prefetch_batches=2))
    it = iter(loader)
    for _ in range(3):
        before = time.perf_counter()
        next(it)
        after = time.perf_counter()
        assert calls and calls[-1] is not None and before <= calls[-1] <= after
    del it


def _learn_period(prefetcher, period):
    """The prefetcher's pace as after next() calls `period` apart, the next one due now."""
    now = time.perf_counter()
    prefetcher._pace.kicked(now - 2 * period)
    prefetcher._pace.kicked(now - period)


class FakeFeed:
    """What the prefetch thread drives: a lock, top_up() (records when it ran), ahead()."""

    def __init__(self, ahead=1):
        self.lock = threading.RLock()
        self.ran = []
        self._ahead = ahead

    def ahead(self):
        return self._ahead

    making = None  # no batch maker: nothing to make outside the lock

    def top_up(self, limit=None):
        self.ran.append(time.perf_counter())
        return False

    def to_make(self):
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
        _learn_period(prefetcher, 10.0)  # a paced top-up would start seconds after its kick
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
    _learn_period(prefetcher, 10.0)
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
        _learn_period(prefetcher, 10.0)
        t = time.perf_counter()
        prefetcher.kick()
        _wait_runs(feed, 1)
        assert feed.ran[0] - t < 0.5
    finally:
        prefetcher.close()


class FillingFeed(FakeFeed):
    """A feed whose top-ups each prepare one batch of the `room` it has, asked with limit=1."""

    def __init__(self, room=2):
        super().__init__(ahead=0)
        self.room = room
        self.limits = []

    def top_up(self, limit=None):
        self.limits.append(limit)
        super().top_up(limit)
        self._ahead += 1
        return self._ahead < self.room  # room for another: worth a run of its own


def test_a_paced_top_up_prepares_one_batch_and_the_next_at_its_paced_time():
    """Behind (nothing prepared), the first batch is prepared at once and the second PACE_FRACTION
    of a step after the kick, not back to back with it in the consumer's launches."""
    feed = FillingFeed()
    prefetcher = Prefetcher(feed, paced=True)
    try:
        period = 1.0  # long enough that "at once" holds on a loaded machine
        _learn_period(prefetcher, period)
        t = time.perf_counter()
        prefetcher.kick()
        _wait_runs(feed, 2, timeout=5.0)
        assert feed.limits == [1, 1]
        assert feed.ran[0] - t < 0.5 * PACE_FRACTION * period  # at once
        assert feed.ran[1] - t >= PACE_FRACTION * period - 0.005  # a wait ends no sooner
        time.sleep(period)
        assert len(feed.ran) == 2  # full: nothing until the next kick
    finally:
        prefetcher.close()


def test_top_up_with_a_limit_prepares_that_many(fake_cuda, monkeypatch):
    # next() tops up itself: not while this test does
    monkeypatch.setattr(iterators.MultiProcessIter, "prefetch_thread", False)
    real, ours = feed_module.Feed.top_up, threading.Event()
    monkeypatch.setattr(feed_module.Feed, "top_up", lambda self, limit=None: real(self, limit) if ours.is_set() else False)
    ds = Images(n=24, size=8)
    loader = fake_device(hotloop.DataLoader(ds, batch_size=4, num_workers=2, prefetch_batches=2))
    it = iter(loader)
    _, first = next(it)  # the ring exists from here on: the next tasks are sent
    feed = it._feed
    wait_for(lambda: all(feed.pool.is_done(t) for t in feed._order[1:3]))
    ours.set()
    with feed.lock:
        assert feed.top_up(limit=1) is True and feed.ahead() == 1  # room for one more
        assert feed.top_up(limit=1) is False and feed.ahead() == 2  # full
    labels = torch.cat([first] + [y for _, y in it])
    assert labels.tolist() == list(range(len(ds)))  # in order, nothing lost or repeated


def test_only_gpu_decode_loaders_pace(fake_cuda, monkeypatch):
    made = []
    real = iterators.Prefetcher

    def recording(feed, paced=False):
        made.append(paced)
        return real(feed, paced)

    monkeypatch.setattr(iterators, "Prefetcher", recording)
    loader = fake_device(hotloop.DataLoader(Images(n=16, size=8), batch_size=4, num_workers=2))
    assert len(list(loader)) == 4
    assert made == [False]
