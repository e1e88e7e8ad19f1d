"""Test set-up: `gpu`-marked tests skip unless hotloop and torch can both use a CUDA device; under
AddressSanitizer, torch's reference loaders wait for their feeder threads at shutdown (see the end)."""
import os
import threading
import time

import pytest
import torch

import hotloop


def gpu_usable() -> bool:
    return hotloop.cuda_available() and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_usable():
        return
    reason = hotloop._C.cuda_unavailable_reason() or "torch cannot see a CUDA device"
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _wait_thread_gone(native_id, timeout=5.0):
    """Until the OS thread is gone: past Thread.join it still runs its exit (the sanitizer's part of it)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{native_id}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _shutdown_and_join_feeders(shutdown):
    def shutdown_workers(self):
        shutdown(self)
        for queue in getattr(self, "_index_queues", ()):
            thread = getattr(queue, "_thread", None)
            # the garbage collector may run this shutdown in that very thread (it pickles)
            if thread is not None and thread is not threading.current_thread():
                thread.join(5.0)
                _wait_thread_gone(thread.native_id)

    return shutdown_workers


# torch's reference loaders leave their index queues' feeder threads running past shutdown, and a
# test forks hotloop's workers right after. GCC 12's AddressSanitizer has no fork handler for its
# allocator (no lock taken around fork()): a child forked while such a thread is in malloc waits on
# that lock forever (seen in CI: worker 0 stuck in the allocator's mutex, its test timed out).
# glibc's malloc is fork-safe, so only the sanitizer build needs torch's shutdown to wait for those
# threads to be gone.
if "address" in hotloop.build_info()["sanitizers"]:
    _MPIter = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    _MPIter._shutdown_workers = _shutdown_and_join_feeders(_MPIter._shutdown_workers)
