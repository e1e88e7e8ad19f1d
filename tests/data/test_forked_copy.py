"""A process forked while a hotloop loader and its iterator live (another loader's worker, torch's
included; a multiprocessing child) holds copies of them, which its garbage collector may finalise. The
copies own nothing there: no worker, no thread, no CUDA state, and a lock the parent's prefetch thread
held at the fork stays held in the copy forever. Their finalisers leave them alone: the child neither
hangs nor touches the parent's workers, and the parent's epoch goes on whole."""
import gc
import os
import threading

import pytest

import hotloop

from ..forked import wait_for_child
from .conftest import fake_device



@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_forked_copy_of_a_live_loader_is_left_alone(device, num_workers, fake_cuda):
    data = list(range(48))
    loader = hotloop.DataLoader(data, batch_size=4, num_workers=num_workers)
    if device:
        fake_device(loader)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    feed = getattr(it, "_feed", None)
    prefetcher = getattr(it, "_prefetcher", None)
    lock = prefetcher._cond if prefetcher is not None else threading.Lock()
    held, release = threading.Event(), threading.Event()

    def hold():  # as the prefetch thread would be, at the fork, inside its lock
        with lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            del it, loader, feed, prefetcher
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    release.set()
    holder.join()
    assert wait_for_child(pid) == 0, "the child hung or failed finalising its copies"
    got += [b.tolist() for b in it]  # the parent's workers and epoch are untouched
    assert got == [data[k:k + 4] for k in range(0, 48, 4)]
