"""At an epoch's end the loader waits for the copies still in flight and lets go of their buffers, so
that between epochs it holds none of a batch's memory (with persistent workers the ring and its copies
outlive the epoch; with num_workers=0 the local ring lives as long as the loader)."""
import pytest

import hotloop
from hotloop.data.ring.copies import DeviceCopies

from .conftest import Images, fake_device


@pytest.fixture
def slow_events(fake_cuda, monkeypatch):
    """fake_cuda whose events are never seen done by a poll, only by a wait: every copy a loader lets
    go of is one it waited for. Returns [copies waited for]."""
    waited = [0]
    base = DeviceCopies.calls

    class Calls(base):
        def done(self, event):
            return False

        def synchronize(self, event):
            waited[0] += 1

    monkeypatch.setattr(DeviceCopies, "calls", Calls)
    return fake_cuda, waited


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_copy_of_an_epoch_is_waited_for_by_its_end(slow_events, num_workers):
    fake, waited = slow_events
    loader = fake_device(hotloop.DataLoader(Images(n=40, size=8), batch_size=4, num_workers=num_workers,
                                            persistent_workers=num_workers > 0, prefetch_batches=2))
    for epoch in range(2):
        assert len(list(loader)) == 10
        # no copy of the epoch is left in flight, holding its slot and buffers, until the next one
        assert waited[0] == fake.copies == 10 * (epoch + 1)
